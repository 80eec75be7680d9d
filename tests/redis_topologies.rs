//! Exactly-once execution on real Redis topologies that each test starts for itself: a Redis
//! Cluster (keys spread over its masters, a master killed under load, slots resharded under
//! load) and a primary watched by Sentinel (the primary killed under load), with and without
//! replica acknowledgement, with replication keeping up or lagging; and the store operations
//! a retried command repeats.
//!
//! The `payments` example's app runs in process behind real HTTP; its handler counts its
//! executions, so a payment executed twice shows up as one execution too many.

#[path = "../examples/payments/app.rs"]
#[allow(dead_code)] // The tests serve its router; its `main` uses the rest.
mod app;
#[macro_use]
mod support;

use std::{
    collections::HashMap,
    net::SocketAddr,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Mutex,
    },
    time::Duration,
};

use axum::http::HeaderValue;
use bytes::Bytes;
use reqwest::{
    header::{CONTENT_TYPE, RETRY_AFTER},
    StatusCode,
};
use serde_json::{json, Value};
use support::{
    logs::Logs,
    payments::{assert_id, charge, fresh_key, slow_charge, Api, Reply},
    redis_server::RedisServer,
    redis_topology::{RedisCluster, SentinelSet},
    redis_url, unique_prefix,
};
use tokio::{net::TcpListener, task::JoinHandle, time::Instant};
use tower_idempotency::{
    redis,
    store::{Claim, Fenced},
    ClaimToken, Fingerprint, IdempotencyKey, RedisStore, Scope, Store, StoredResponse,
};

/// The endpoint the payments app scopes its keys by.
const ENDPOINT: &str = "POST /v1/payments";
/// Concurrent clients of the load.
const CLIENTS: usize = 16;
/// The longest one logical payment may take, retries included, before the test fails.
const PAYMENT_DEADLINE: Duration = Duration::from_secs(25);
/// The longest an HTTP request of the load may take before its client gives up and sends it
/// again: shorter than a failover, so that clients retry while the store is down, as
/// impatient clients do (the abandoned request's execution goes on without them).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);
/// The longest a client waits before a retry, whatever `Retry-After` says.
const MAX_PAUSE: Duration = Duration::from_secs(1);
/// Replica acknowledgement for the tests that ask for it.
const ACK_TIMEOUT: Duration = Duration::from_millis(500);
/// How long the load runs before the topology is disturbed, and after it settles.
const LOAD_BEFORE: Duration = Duration::from_secs(1);
const LOAD_AFTER: Duration = Duration::from_secs(3);

// ---------------------------------------------------------------------------------------
// Keys over the cluster's masters; one key stormed from two instances.
// ---------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs redis-server: scripts/test.sh"]
async fn keys_spread_over_every_master_and_a_storm_on_one_key_executes_once() {
    let clock = Clock::start("keys_spread");
    let cluster = blocking(|| RedisCluster::start(3, 1)).await;
    clock.note("cluster of 3 masters and 3 replicas up");
    let prefix = unique_prefix("keys_spread");
    let instances = [
        serve(Arc::new(cluster_store(&cluster, &prefix, false).await)).await,
        serve(Arc::new(cluster_store(&cluster, &prefix, false).await)).await,
    ];
    let apis: Vec<Api> = instances.iter().map(|i| Api::new(i.addr)).collect();

    // (a) 300 payments with keys of their own, through both instances in turn.
    const PAYMENTS_COUNT: usize = 300;
    const STREAMS: usize = 10;
    let streams: Vec<JoinHandle<()>> = (0..STREAMS)
        .map(|stream| {
            let apis = apis.clone();
            tokio::spawn(async move {
                for n in (stream..PAYMENTS_COUNT).step_by(STREAMS) {
                    let amount = 100 + n as i64;
                    let reply = apis[n % 2]
                        .pay(&fresh_key(), "spread", &charge(amount))
                        .await;
                    reply.assert_fresh();
                    reply.assert_payment(amount, "usd");
                }
            })
        })
        .collect();
    for stream in streams {
        join(stream).await;
    }
    clock.note("300 payments made");
    assert_eq!(executed(&instances), PAYMENTS_COUNT as u64);
    let pattern = format!("{prefix}*");
    let (cluster, masters, spread) = blocking(move || {
        let masters = cluster.master_ports();
        let spread: Vec<usize> = masters
            .iter()
            .map(|&port| scan_count(&cluster, port, &pattern))
            .collect();
        (cluster, masters, spread)
    })
    .await;
    eprintln!("keys_spread: store keys per master {masters:?}: {spread:?} of {PAYMENTS_COUNT}");
    assert_eq!(masters.len(), 3, "masters");
    assert_eq!(spread.iter().sum::<usize>(), PAYMENTS_COUNT, "{spread:?}");
    for &keys in &spread {
        assert!(keys > 0, "a master holds none of the keys: {spread:?}");
        assert!(
            keys * 100 <= PAYMENTS_COUNT * 60,
            "a master holds over 60 % of the keys: {spread:?}"
        );
    }

    // (b) 40 identical requests for one key at once, over both instances: one executes.
    const STORM: usize = 40;
    let key = fresh_key();
    let body = slow_charge(300);
    let storm: Vec<JoinHandle<Reply>> = (0..STORM)
        .map(|n| apis[n % 2].pay_in_background(&key, "storm", &body))
        .collect();
    let mut replies = Vec::with_capacity(STORM);
    for request in storm {
        replies.push(join(request).await);
    }
    clock.note("storm of 40 answered");
    let (executions, rest): (Vec<&Reply>, Vec<&Reply>) = replies
        .iter()
        .partition(|reply| reply.status == StatusCode::CREATED && !reply.replayed());
    assert_eq!(executions.len(), 1, "fresh executions: {executions:?}");
    let first = executions[0];
    let id = first.assert_payment(700, "usd");
    let (mut in_progress, mut late_replays) = (0, 0);
    for reply in rest {
        if reply.status == StatusCode::CONFLICT {
            reply.assert_in_progress();
            in_progress += 1;
        } else {
            // Sent after the execution was recorded: a replay is the right answer.
            reply.assert_replay_of(first);
            late_replays += 1;
        }
    }
    eprintln!(
        "keys_spread: storm of {STORM}: 1 executed, {in_progress} request_in_progress, \
         {late_replays} replayed"
    );
    assert_eq!(executed(&instances), PAYMENTS_COUNT as u64 + 1);
    for api in apis.iter().chain(&apis) {
        let retry = api.pay(&key, "storm", &body).await;
        retry.assert_replay_of(first);
        assert_eq!(retry.json()["id"], id.as_str());
    }
    assert_eq!(executed(&instances), PAYMENTS_COUNT as u64 + 1);
    clock.note("done");
    drop(instances);
    blocking(move || drop(cluster)).await;
}

/// The commands that concurrent requests issue together reach each master as one pipeline,
/// as they reach a single server: a few reads per master carry hundreds of claims.
// One worker, as on a server pinned to one core: each request's task runs in turn.
#[tokio::test(flavor = "current_thread")]
#[ignore = "needs redis-server: scripts/test.sh"]
async fn commands_of_concurrent_requests_share_writes_per_master() {
    const REQUESTS: u64 = 300;
    const LEASE: Duration = Duration::from_secs(30);
    let cluster = blocking(|| RedisCluster::start(3, 1)).await;
    let store = Arc::new(cluster_store(&cluster, &unique_prefix("batched"), false).await);
    // Connected to every master and warm: the counters below see only the claims.
    for i in 0..30 {
        let warm = scope("warm", &format!("warm-{i}"));
        store
            .claim(&warm, Fingerprint::from_bytes([0; 32]), LEASE)
            .await
            .unwrap();
    }
    let masters = cluster.master_ports();
    let reads = |cluster: &RedisCluster| -> Vec<u64> {
        masters
            .iter()
            .map(|&port| {
                let info = cluster.cli(port, &["INFO", "stats"]);
                info.lines()
                    .find_map(|line| line.strip_prefix("total_reads_processed:"))
                    .and_then(|value| value.trim().parse().ok())
                    .unwrap_or_else(|| panic!("no total_reads_processed in {info}"))
            })
            .collect()
    };
    let before = reads(&cluster);
    let claims: Vec<_> = (0..REQUESTS)
        .map(|i| {
            let store = store.clone();
            tokio::spawn(async move {
                let scope = scope("batched", &format!("key-{i}"));
                store
                    .claim(&scope, Fingerprint::from_bytes([1; 32]), LEASE)
                    .await
            })
        })
        .collect();
    for claim in claims {
        let claim = claim.await.unwrap().unwrap();
        assert!(matches!(claim, Claim::Claimed(_)), "{claim:?}");
    }
    let after = reads(&cluster);
    // Each master reads once for the INFO above, once for the INFO below, and a few times
    // for its share of the claims; one read per claim if they were not batched.
    let per_master: Vec<u64> = after.iter().zip(&before).map(|(a, b)| a - b).collect();
    eprintln!("reads per master for {REQUESTS} concurrent claims: {per_master:?}");
    // The claims leave in one batch, one pipeline per master. Sent one by one through the
    // cluster connection, they took 7 to 10 reads per master.
    assert!(
        per_master.iter().all(|&reads| reads <= 4),
        "{REQUESTS} concurrent claims took {per_master:?} reads: not one pipeline per master"
    );
    blocking(move || drop(cluster)).await;
}

/// The `payments` example, as a process of its own, takes its store from
/// `REDIS_CLUSTER_URLS`, or `REDIS_SENTINEL_URLS` with `REDIS_SENTINEL_MASTER`, and waits for
/// a replica with `IDEMPOTENCY_REPLICAS` (the shared topologies of the test script).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a Redis Cluster and a Sentinel set: scripts/test.sh"]
async fn the_payments_example_runs_on_a_cluster_and_behind_sentinel() {
    let env = |name: &str| {
        std::env::var(name).unwrap_or_else(|_| {
            panic!("{name} is not set: run the suite with scripts/test.sh, which starts it")
        })
    };
    let cluster = env("REDIS_CLUSTER_URLS");
    let sentinels = env("REDIS_SENTINEL_URLS");
    let master = env("REDIS_SENTINEL_MASTER");
    let topologies = [
        vec![("REDIS_CLUSTER_URLS", cluster.as_str())],
        vec![
            ("REDIS_SENTINEL_URLS", sentinels.as_str()),
            ("REDIS_SENTINEL_MASTER", master.as_str()),
        ],
    ];
    for mut settings in topologies {
        settings.push(("IDEMPOTENCY_REPLICAS", "1"));
        let example = support::payments::ExampleProcess::start(&settings).await;
        let api = example.api();
        let key = fresh_key();
        let first = api.pay(&key, "alice", &charge(1250)).await;
        let id = first.assert_payment(1250, "usd");
        // A second instance on the same store replays it.
        let other = example.start_another().await;
        let retry = other.api().pay(&key, "alice", &charge(1250)).await;
        retry.assert_replay_of(&first);
        assert_eq!(retry.json()["id"].as_str(), Some(id.as_str()));
        assert_eq!(api.stats().await.payments_executed, 1, "{settings:?}");
        assert_eq!(
            other.api().stats().await.payments_executed,
            0,
            "{settings:?}"
        );
    }
}

// ---------------------------------------------------------------------------------------
// A cluster master killed under load.
// ---------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs redis-server: scripts/test.sh"]
async fn cluster_failover_under_load_with_replica_acks_executes_nothing_twice() {
    let outcome = cluster_failover("cluster_failover_acks", true, Replication::Live).await;
    outcome.assert_exactly_once();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs redis-server: scripts/test.sh"]
async fn cluster_failover_without_replica_acks_reports_double_executions() {
    let outcome = cluster_failover("cluster_failover_no_acks", false, Replication::Live).await;
    outcome.report_double_executions();
}

/// As above, with the killed master's last writes lost: its replica stops replicating
/// shortly before the master is killed, as a lagging replica would.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs redis-server: scripts/test.sh"]
async fn cluster_failover_with_lagging_replica_with_replica_acks_executes_nothing_twice() {
    let test = "cluster_lagging_acks";
    let outcome = cluster_failover(test, true, Replication::Stalled).await;
    outcome.assert_exactly_once();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs redis-server: scripts/test.sh"]
async fn cluster_failover_with_lagging_replica_without_replica_acks_reports_double_executions() {
    let test = "cluster_lagging_no_acks";
    let outcome = cluster_failover(test, false, Replication::Stalled).await;
    outcome.report_double_executions();
}

/// Two app instances on one cluster (3 masters, 1 replica each) under load; after a second,
/// SIGKILL to the master of a key in flight (`Stalled`: once its replica has stopped
/// replicating), then the load goes on past the failover.
///
/// The killed node is started again once its replica has taken over: it rejoins as the new
/// master's replica. Without it, the promoted master would have no replica, and with
/// `replicas(1, ..)` every claim on its slots would fail (`503`) for good.
async fn cluster_failover(test: &'static str, acks: bool, replication: Replication) -> Outcome {
    let clock = Clock::start(test);
    let cluster = blocking(|| RedisCluster::start(3, 1)).await;
    clock.note("cluster of 3 masters and 3 replicas up");
    let prefix = unique_prefix(test);
    let store = cluster_store(&cluster, &prefix, acks).await;
    let instances = vec![
        serve_with(Arc::new(store.clone()), replication.timing()).await,
        serve_with(
            Arc::new(cluster_store(&cluster, &prefix, acks).await),
            replication.timing(),
        )
        .await,
    ];
    let load = Load::start(&instances);
    tokio::time::sleep(LOAD_BEFORE).await;

    let in_flight = load.in_flight();
    let victim_key = in_flight
        .first()
        .map_or_else(|| prefix.clone(), |payment| redis_key(&store, payment));
    let (cluster, victim, stalled) = blocking(move || {
        let victim = cluster.master_for_key(&victim_key);
        let stalled = (replication == Replication::Stalled).then(|| {
            let replica = cluster
                .replica_ports()
                .into_iter()
                .find(|&port| replica_of(&cluster.cli(port, &["ROLE"])) == Some(victim))
                .expect("the master's replica");
            // Keys in the victim's slots: a hash tag of the key in flight.
            Stall::start(
                |args| cluster.cli(replica, args),
                victim,
                &format!("{{{victim_key}}}"),
            )
        });
        (cluster, victim, stalled)
    })
    .await;
    if stalled.is_some() {
        clock.note(&format!("the replica of {victim} stalled"));
        tokio::time::sleep(STALL).await;
    }
    let (cluster, victim) = blocking(move || {
        let mut cluster = cluster;
        cluster.kill(victim);
        drop(stalled);
        (cluster, victim)
    })
    .await;
    clock.note(&format!(
        "SIGKILL to master {victim} ({} payments in flight)",
        in_flight.len()
    ));
    let (cluster, promoted) = blocking(move || {
        let promoted = cluster.wait_for_failover(victim);
        (cluster, promoted)
    })
    .await;
    clock.note(&format!("replica {promoted} took over from {victim}"));
    let cluster = blocking(move || {
        let mut cluster = cluster;
        cluster.restart(victim);
        wait_for_replica_link(victim, |args| cluster.cli(victim, args));
        cluster
    })
    .await;
    clock.note(&format!("{victim} back as a replica of {promoted}"));
    tokio::time::sleep(LOAD_AFTER).await;
    let outcome = Outcome::collect(&clock, load, &instances).await;
    clock.note("load finished and re-sent");
    drop(instances);
    blocking(move || drop(cluster)).await;
    outcome
}

// ---------------------------------------------------------------------------------------
// The Sentinel-managed primary killed under load.
// ---------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs redis-server: scripts/test.sh"]
async fn sentinel_failover_under_load_with_replica_acks_executes_nothing_twice() {
    let outcome = sentinel_failover("sentinel_failover_acks", true, Replication::Live).await;
    outcome.assert_exactly_once();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs redis-server: scripts/test.sh"]
async fn sentinel_failover_without_replica_acks_reports_double_executions() {
    let outcome = sentinel_failover("sentinel_failover_no_acks", false, Replication::Live).await;
    outcome.report_double_executions();
}

/// As above, with the killed primary's last writes lost: its replica stops replicating
/// shortly before the primary is killed, as a lagging replica would.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs redis-server: scripts/test.sh"]
async fn sentinel_failover_with_lagging_replica_with_replica_acks_executes_nothing_twice() {
    let test = "sentinel_lagging_acks";
    let outcome = sentinel_failover(test, true, Replication::Stalled).await;
    outcome.assert_exactly_once();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs redis-server: scripts/test.sh"]
async fn sentinel_failover_with_lagging_replica_without_replica_acks_reports_double_executions() {
    let test = "sentinel_lagging_no_acks";
    let outcome = sentinel_failover(test, false, Replication::Stalled).await;
    outcome.report_double_executions();
}

/// Two app instances behind Sentinel under load, and a third, idle one; after a second,
/// SIGKILL to the primary (`Stalled`: once its replica has stopped replicating). Once the
/// sentinels name the replica, the idle instance must reach it within 5 s, without a
/// restart. Then the killed server is started again as the new primary's replica (with
/// `replicas(1, ..)` nothing could be claimed without one), and the load goes on.
async fn sentinel_failover(test: &'static str, acks: bool, replication: Replication) -> Outcome {
    /// How soon after the sentinels name the new primary an instance must reach it.
    const FOLLOW_LIMIT: Duration = Duration::from_secs(5);
    let clock = Clock::start(test);
    let set = blocking(SentinelSet::start).await;
    clock.note("primary, replica and 3 sentinels up");
    let prefix = unique_prefix(test);
    let instances = vec![
        serve_with(
            Arc::new(sentinel_store(&set, &prefix, acks).await),
            replication.timing(),
        )
        .await,
        serve_with(
            Arc::new(sentinel_store(&set, &prefix, acks).await),
            replication.timing(),
        )
        .await,
    ];
    let idle_prefix = unique_prefix(test);
    let idle = serve(Arc::new(sentinel_store(&set, &idle_prefix, false).await)).await;
    let idle_api = Api::new(idle.addr);
    idle_api
        .pay(&fresh_key(), "idle", &charge(100))
        .await
        .assert_payment(100, "usd");

    let load = Load::start(&instances);
    tokio::time::sleep(LOAD_BEFORE).await;
    let in_flight = load.in_flight().len();
    let (set, stalled) = blocking(move || {
        let stalled = (replication == Replication::Stalled).then(|| {
            let primary = set.primary_port();
            let replica = set
                .data_ports()
                .into_iter()
                .find(|&port| port != primary)
                .expect("the replica");
            Stall::start(|args| set.cli(replica, args), primary, "")
        });
        (set, stalled)
    })
    .await;
    if stalled.is_some() {
        clock.note("the replica stalled");
        tokio::time::sleep(STALL).await;
    }
    let (set, killed) = blocking(move || {
        let mut set = set;
        let killed = set.kill_primary();
        drop(stalled);
        (set, killed)
    })
    .await;
    clock.note(&format!(
        "SIGKILL to primary {killed} ({in_flight} payments in flight)"
    ));
    let (set, promoted) = blocking(move || {
        let promoted = set.wait_for_failover(killed);
        (set, promoted)
    })
    .await;
    clock.note(&format!("sentinels name {promoted}"));

    // The idle instance's connection still points at the dead primary.
    let named = Instant::now();
    let key = fresh_key();
    let mut refused = 0;
    let reply = loop {
        let reply = idle_api.pay(&key, "idle", &charge(200)).await;
        if reply.status != StatusCode::SERVICE_UNAVAILABLE {
            break reply;
        }
        refused += 1;
        assert!(
            named.elapsed() < FOLLOW_LIMIT,
            "the idle instance did not reach the new primary within {FOLLOW_LIMIT:?}: {reply:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let followed = named.elapsed();
    reply.assert_payment(200, "usd");
    clock.note(&format!(
        "the idle instance reached the new primary {followed:?} after the sentinels named it \
         ({refused} answers 503 before)"
    ));
    let pattern = format!("{idle_prefix}*");
    let (set, on_promoted) = blocking(move || {
        let keys = set
            .cli(promoted, &["--scan", "--pattern", &pattern])
            .lines()
            .filter(|line| !line.is_empty())
            .count();
        (set, keys)
    })
    .await;
    assert_eq!(
        on_promoted, 2,
        "the idle instance's keys on the new primary"
    );

    // The sentinels would make it a replica too, but only once they next ask it for its
    // INFO (every 10 s): told at once, as its configuration would on a restart.
    let set = blocking(move || {
        let mut set = set;
        set.restart(killed);
        let told = set.cli(killed, &["REPLICAOF", "127.0.0.1", &promoted.to_string()]);
        assert_eq!(told.trim(), "OK", "REPLICAOF on {killed}");
        wait_for_replica_link(killed, |args| set.cli(killed, args));
        set
    })
    .await;
    clock.note(&format!("{killed} replicates {promoted}"));
    tokio::time::sleep(LOAD_AFTER).await;
    let outcome = Outcome::collect(&clock, load, &instances).await;
    clock.note("load finished and re-sent");
    drop(instances);
    drop(idle);
    blocking(move || drop(set)).await;
    outcome
}

// ---------------------------------------------------------------------------------------
// Slots resharded under load.
// ---------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs redis-server: scripts/test.sh"]
async fn resharding_under_load_executes_once() {
    /// 2000 slots, moved a few hundred at a time while the load runs.
    const SLOTS_PER_STEP: usize = 400;
    const STEPS: usize = 5;
    let test = "resharding";
    let clock = Clock::start(test);
    let cluster = blocking(|| RedisCluster::start(3, 1)).await;
    clock.note("cluster of 3 masters and 3 replicas up");
    let prefix = unique_prefix(test);
    let instances = vec![
        serve(Arc::new(cluster_store(&cluster, &prefix, false).await)).await,
        serve(Arc::new(cluster_store(&cluster, &prefix, false).await)).await,
    ];
    let load = Load::start(&instances);
    tokio::time::sleep(LOAD_BEFORE).await;

    let (cluster, (from, to)) = blocking(move || {
        let masters = cluster.master_ports();
        let (from, to) = (masters[0], masters[1]);
        for _ in 0..STEPS {
            cluster.reshard(from, to, SLOTS_PER_STEP);
            std::thread::sleep(Duration::from_millis(200));
        }
        (cluster, (from, to))
    })
    .await;
    clock.note(&format!(
        "{} slots moved from {from} to {to} in {STEPS} steps",
        SLOTS_PER_STEP * STEPS
    ));
    tokio::time::sleep(Duration::from_secs(1)).await;
    let outcome = Outcome::collect(&clock, load, &instances).await;
    clock.note("load finished and re-sent");
    assert_eq!(
        outcome.tally.transport, 0,
        "HTTP requests that failed: {outcome:?}"
    );
    outcome.assert_exactly_once();
    let pattern = format!("{prefix}*");
    let (cluster, spread) = blocking(move || {
        let spread: Vec<(u16, usize)> = cluster
            .master_ports()
            .into_iter()
            .map(|port| (port, scan_count(&cluster, port, &pattern)))
            .collect();
        (cluster, spread)
    })
    .await;
    eprintln!("{test}: store keys per master (port, keys) afterwards: {spread:?}");
    drop(instances);
    blocking(move || drop(cluster)).await;
}

// ---------------------------------------------------------------------------------------
// A store command sent twice.
// ---------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs redis-server: scripts/test.sh"]
async fn a_claim_retried_after_its_reply_was_lost_is_still_the_claimers() {
    let cluster = blocking(|| RedisCluster::start(3, 0)).await;
    let prefix = unique_prefix("duplicate_claim");
    let on_cluster = cluster_store(&cluster, &prefix, false).await;
    duplicates_apply_once(&on_cluster, "cluster").await;
    let single = RedisStore::open(&redis_url())
        .await
        .unwrap_or_else(|e| panic!("Redis at {} (set REDIS_URL): {e}", redis_url()))
        .prefix(unique_prefix("duplicate_claim"));
    duplicates_apply_once(&single, "single node").await;
    blocking(move || drop(cluster)).await;
}

/// Each operation twice, as a client retrying a command whose reply it lost sends it.
async fn duplicates_apply_once(store: &RedisStore, topology: &str) {
    const LEASE: Duration = Duration::from_secs(30);
    const TTL: Duration = Duration::from_secs(600);
    let fingerprint = Fingerprint::from_bytes(rand::random());
    let token = ClaimToken::unique();

    // Claim, extend and complete, each twice.
    let scope = scope("alice", &fresh_key());
    for attempt in ["first", "retried"] {
        let claim = store
            .claim_with_token(&scope, fingerprint, token, LEASE)
            .await
            .unwrap();
        assert_eq!(
            claim,
            Claim::Claimed(token),
            "{topology}: {attempt} claim with the token"
        );
    }
    match store.claim(&scope, fingerprint, LEASE).await.unwrap() {
        Claim::InProgress {
            fingerprint: holder,
            lease_remaining,
            ..
        } => {
            assert_eq!(holder, fingerprint, "{topology}");
            assert!(lease_remaining <= LEASE, "{topology}: {lease_remaining:?}");
        }
        other => panic!("{topology}: another token's claim: {other:?}"),
    }
    for attempt in ["first", "retried"] {
        let extended = store.extend(&scope, token, LEASE).await.unwrap();
        assert_eq!(extended, Fenced::Applied, "{topology}: {attempt} extend");
    }
    let response = StoredResponse {
        status: StatusCode::CREATED,
        headers: [(CONTENT_TYPE, HeaderValue::from_static("application/json"))]
            .into_iter()
            .collect(),
        body: Bytes::from_static(br#"{"id":"pay_1"}"#),
        trailers: None,
    };
    for attempt in ["first", "retried"] {
        let completed = store
            .complete(&scope, token, fingerprint, &response, TTL)
            .await
            .unwrap();
        assert_eq!(completed, Fenced::Applied, "{topology}: {attempt} complete");
    }
    for claimer in [token, ClaimToken::unique()] {
        match store
            .claim_with_token(&scope, fingerprint, claimer, LEASE)
            .await
            .unwrap()
        {
            Claim::Completed {
                fingerprint: recorded,
                response: replayed,
                expires_in,
            } => {
                assert_eq!(recorded, fingerprint, "{topology}");
                assert_eq!(replayed, response, "{topology}");
                let expires_in = expires_in.expect("the record's expiry");
                assert!(expires_in <= TTL, "{topology}: {expires_in:?}");
            }
            other => panic!("{topology}: a claim after completion: {other:?}"),
        }
    }
    // Fenced writes after completion find no claim.
    assert_eq!(
        store.extend(&scope, token, LEASE).await.unwrap(),
        Fenced::Lost,
        "{topology}: extend after completion"
    );
    assert_eq!(
        store.release(&scope, token).await.unwrap(),
        Fenced::Lost,
        "{topology}: release after completion"
    );

    // Claim twice, release twice: the second release finds nothing, the key is free.
    let scope = self::scope("alice", &fresh_key());
    let token = ClaimToken::unique();
    for _ in 0..2 {
        let claim = store
            .claim_with_token(&scope, fingerprint, token, LEASE)
            .await
            .unwrap();
        assert_eq!(claim, Claim::Claimed(token), "{topology}");
    }
    let released = store.release(&scope, token).await.unwrap();
    assert_eq!(released, Fenced::Applied, "{topology}: first release");
    let again = store.release(&scope, token).await.unwrap();
    assert_eq!(again, Fenced::Lost, "{topology}: retried release");
    let next = ClaimToken::unique();
    let claim = store
        .claim_with_token(&scope, fingerprint, next, LEASE)
        .await
        .unwrap();
    assert_eq!(
        claim,
        Claim::Claimed(next),
        "{topology}: claim after release"
    );
    // The released token's writes cannot touch the new claim.
    assert_eq!(
        store.extend(&scope, token, LEASE).await.unwrap(),
        Fenced::Lost,
        "{topology}"
    );
    assert_eq!(
        store
            .complete(&scope, token, fingerprint, &response, TTL)
            .await
            .unwrap(),
        Fenced::Lost,
        "{topology}"
    );
    assert_eq!(
        store.release(&scope, next).await.unwrap(),
        Fenced::Applied,
        "{topology}"
    );
}

// ---------------------------------------------------------------------------------------
// A claim no replica acknowledges.
// ---------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs redis-server: scripts/test.sh"]
async fn a_claim_no_replica_acknowledges_is_released_and_answered_503() {
    let server = blocking(RedisServer::start).await;
    let prefix = unique_prefix("unacknowledged_claim");
    let acked = RedisStore::open(&server.url())
        .await
        .expect("private Redis")
        .prefix(prefix.clone())
        .replicas(1, Duration::from_millis(100));
    let instance = serve(Arc::new(acked)).await;
    let api = Api::new(instance.addr);

    let key = fresh_key();
    let reply = api.pay(&key, "alice", &charge(500)).await;
    let answered = Instant::now();
    reply.assert_error(
        StatusCode::SERVICE_UNAVAILABLE,
        "idempotency_store_unavailable",
    );
    assert_eq!(reply.header(RETRY_AFTER.as_str()), Some("1"), "{reply:?}");
    assert_eq!(instance.stats.payments.load(Ordering::Relaxed), 0);

    // The claim was written (SET) and then released (the fenced release is an EVAL).
    let plain = RedisStore::open(&server.url())
        .await
        .expect("private Redis")
        .prefix(prefix);
    let scope = scope("alice", &key);
    let fingerprint = Fingerprint::from_bytes(rand::random());
    let token = ClaimToken::unique();
    let mut held = 0;
    loop {
        match plain
            .claim_with_token(&scope, fingerprint, token, Duration::from_secs(30))
            .await
            .expect("claim on the private Redis")
        {
            Claim::Claimed(claimed) => {
                assert_eq!(claimed, token);
                break;
            }
            Claim::InProgress { .. } => held += 1,
            other => panic!("the key after a 503: {other:?}"),
        }
        assert!(
            answered.elapsed() < Duration::from_secs(5),
            "the unacknowledged claim still holds the key 5 s after its 503"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    eprintln!(
        "unacknowledged_claim: key free {:?} after the 503 ({held} claims found it held)",
        answered.elapsed()
    );
    let (server, stats) = blocking(move || {
        let stats = server.cli(&["INFO", "commandstats"]);
        (server, stats)
    })
    .await;
    assert!(stats.contains("cmdstat_set:"), "{stats}");
    assert!(stats.contains("cmdstat_wait:"), "{stats}");
    assert!(stats.contains("cmdstat_eval:"), "no release: {stats}");
    assert_eq!(instance.stats.payments.load(Ordering::Relaxed), 0);
    drop(instance);
    blocking(move || drop(server)).await;
}

/// On one server with no replica at all, a claim that finds a completed record replays it:
/// it wrote nothing, so no replica need acknowledge it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs redis-server: scripts/test.sh"]
async fn a_replay_needs_no_replica() {
    let server = blocking(RedisServer::start).await;
    let prefix = unique_prefix("replay_without_replica");
    let open = || async {
        RedisStore::open(&server.url())
            .await
            .expect("private Redis")
            .prefix(prefix.clone())
    };
    // Recorded before replicas were asked for.
    let plain = serve(Arc::new(open().await)).await;
    let (key, payment) = (fresh_key(), charge(100));
    let done = Api::new(plain.addr).pay(&key, "alice", &payment).await;
    done.assert_payment(100, "usd");
    let acked = open().await.replicas(1, Duration::from_millis(100));
    let instance = serve(Arc::new(acked)).await;
    let api = Api::new(instance.addr);
    for _ in 0..5 {
        api.pay(&key, "alice", &payment)
            .await
            .assert_replay_of(&done);
    }
    api.pay(&key, "alice", &charge(999)).await.assert_error(
        StatusCode::CONFLICT,
        "idempotency_key_reused_with_different_params",
    );
    // A new payment's claim writes, and is refused unacknowledged.
    api.pay(&fresh_key(), "alice", &payment).await.assert_error(
        StatusCode::SERVICE_UNAVAILABLE,
        "idempotency_store_unavailable",
    );
    assert_eq!(instance.stats.payments.load(Ordering::Relaxed), 0);
    drop((plain, instance));
    blocking(move || drop(server)).await;
}

// ---------------------------------------------------------------------------------------
// A failover that leaves the new primary with no replica, with `replicas(1, ..)`.
// ---------------------------------------------------------------------------------------

/// How long the payment that runs across the failover takes: longer than a failover.
const ACROSS_FAILOVER: Duration = Duration::from_secs(16);

/// Strict (the default), behind Sentinel: after the failover, replays, duplicates and
/// mismatches are answered from what their claims read, the running payment is answered
/// once its handler ends (not a lease later), new payments get `503`, and once the old
/// primary is back as a replica, new payments execute again, with no restart.
// On one thread: the logs these tests read are captured per thread.
#[tokio::test]
#[ignore = "needs redis-server: scripts/test.sh"]
async fn with_no_replica_left_replays_go_on_and_new_claims_get_503_until_one_is_back() {
    failover_to_no_replica(Topology::Sentinel, false).await;
}

/// Best effort, behind Sentinel: the same, but new payments execute while no replica
/// acknowledges.
#[tokio::test]
#[ignore = "needs redis-server: scripts/test.sh"]
async fn with_no_replica_left_best_effort_claims_execute() {
    failover_to_no_replica(Topology::Sentinel, true).await;
}

/// Strict, in a cluster whose shard failed over to its only replica: the same as behind
/// Sentinel, on that shard.
#[tokio::test]
#[ignore = "needs redis-server: scripts/test.sh"]
async fn in_a_cluster_a_shard_left_with_no_replica_replays_and_refuses_new_claims_until_one_is_back(
) {
    failover_to_no_replica(Topology::Cluster, false).await;
}

/// Best effort, in a cluster whose shard failed over to its only replica.
#[tokio::test]
#[ignore = "needs redis-server: scripts/test.sh"]
async fn in_a_cluster_a_shard_left_with_no_replica_executes_best_effort_claims() {
    failover_to_no_replica(Topology::Cluster, true).await;
}

/// Where the failover to no replica happens.
#[derive(Clone, Copy, Debug)]
enum Topology {
    /// A primary with one replica behind three sentinels.
    Sentinel,
    /// Three masters with one replica each: one shard fails over.
    Cluster,
}

/// The servers of a [`Topology`]; every method blocks.
enum Servers {
    Sentinel(SentinelSet),
    Cluster(RedisCluster),
}

impl Servers {
    fn start(topology: Topology) -> Self {
        match topology {
            Topology::Sentinel => Self::Sentinel(SentinelSet::start()),
            Topology::Cluster => Self::Cluster(RedisCluster::start(3, 1)),
        }
    }

    async fn store(&self, prefix: &str) -> RedisStore {
        match self {
            Self::Sentinel(set) => sentinel_store(set, prefix, true).await,
            Self::Cluster(cluster) => cluster_store(cluster, prefix, true).await,
        }
    }

    /// The primary serving a Redis key.
    fn primary_for(&self, redis_key: &str) -> u16 {
        match self {
            Self::Sentinel(set) => set.primary_port(),
            Self::Cluster(cluster) => cluster.master_for_key(redis_key),
        }
    }

    /// A fresh idempotency key whose record `primary` serves.
    fn fresh_key_on(&self, primary: u16, redis_key: impl Fn(&str) -> String) -> String {
        loop {
            let key = fresh_key();
            if self.primary_for(&redis_key(&key)) == primary {
                return key;
            }
        }
    }

    /// Kills `primary` and waits until its only replica has taken over; returns that one.
    fn fail_over(&mut self, primary: u16) -> u16 {
        match self {
            Self::Sentinel(set) => {
                assert_eq!(set.kill_primary(), primary);
                set.wait_for_failover(primary)
            }
            Self::Cluster(cluster) => {
                cluster.kill(primary);
                cluster.wait_for_failover(primary)
            }
        }
    }

    /// Starts the killed `old` primary again and waits until `new` has it as an online
    /// replica.
    fn bring_back(&mut self, old: u16, new: u16) {
        match self {
            Self::Sentinel(set) => set.restart(old),
            Self::Cluster(cluster) => cluster.restart(old),
        }
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while !self
            .cli(new, &["INFO", "replication"])
            .contains("state=online")
        {
            assert!(
                std::time::Instant::now() < deadline,
                "the old primary never came back as a replica"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn cli(&self, port: u16, args: &[&str]) -> String {
        match self {
            Self::Sentinel(set) => set.cli(port, args),
            Self::Cluster(cluster) => cluster.cli(port, args),
        }
    }
}

async fn failover_to_no_replica(topology: Topology, best_effort: bool) {
    let (logs, _capturing) = Logs::capture();
    let servers = blocking(move || Servers::start(topology)).await;
    let prefix = unique_prefix("no_replica_left");
    let mut store = servers.store(&prefix).await;
    if best_effort {
        store = store.replicas_best_effort();
    }
    let keys = store.clone();
    let record = move |key: &str| keys.redis_key(&scope("alice", key));
    let instance = serve(Arc::new(store)).await;
    let api = Api::new(instance.addr);
    let executed = || instance.stats.payments.load(Ordering::Relaxed);

    // Completed while the replica acknowledged it, on the primary that will fail.
    let (done_key, done_charge) = (fresh_key(), charge(100));
    let done = api.pay(&done_key, "alice", &done_charge).await;
    done.assert_fresh();
    let (done_record, on_shard) = (record(&done_key), record.clone());
    let (servers, old, running_key) = blocking(move || {
        let old = servers.primary_for(&done_record);
        let running_key = servers.fresh_key_on(old, on_shard);
        (servers, old, running_key)
    })
    .await;
    // Claimed (and acknowledged) before the failover, completed after it.
    let running_ms = ACROSS_FAILOVER.as_millis() as u64;
    let running = api.pay_in_background(&running_key, "alice", &slow_charge(running_ms));
    api.wait_for_payments(2).await;
    let handler_ends = Instant::now() + ACROSS_FAILOVER;

    let on_shard = record.clone();
    let (servers, new, new_key, later_key) = blocking(move || {
        let mut servers = servers;
        let new = servers.fail_over(old);
        let new_key = servers.fresh_key_on(new, &on_shard);
        let later_key = servers.fresh_key_on(new, &on_shard);
        (servers, new, new_key, later_key)
    })
    .await;

    // Replays are answered from what their claim read: no replica needed.
    replays_go_on(&api, &done_key, &done_charge, &done).await;
    // So are a duplicate of the running payment and a key reused with another body.
    api.pay(&running_key, "alice", &slow_charge(running_ms))
        .await
        .assert_in_progress();
    api.pay(&done_key, "alice", &charge(999))
        .await
        .assert_error(
            StatusCode::CONFLICT,
            "idempotency_key_reused_with_different_params",
        );

    // A new payment's claim, on the shard with no replica, is not acknowledged.
    let fresh = api.pay(&new_key, "alice", &charge(300)).await;
    let unacknowledged = |operation: &str| {
        logs.has("WARN", "not acknowledged by its replicas in time")
            && logs.has("WARN", &format!("operation=\"{operation}\""))
    };
    if best_effort {
        fresh.assert_fresh();
        fresh.assert_payment(300, "usd");
        assert!(unacknowledged("claim"), "the executed claim was not logged");
    } else {
        fresh.assert_error(
            StatusCode::SERVICE_UNAVAILABLE,
            "idempotency_store_unavailable",
        );
    }

    // The running payment is answered when its handler ends, its completion applied though
    // unacknowledged, not a lease (30 s) later; its retry replays it.
    let running = running.await.expect("the running payment");
    let late = Instant::now().saturating_duration_since(handler_ends);
    running.assert_fresh();
    running.assert_payment(700, "usd");
    assert!(
        late < ACK_TIMEOUT + Duration::from_secs(5),
        "answered {late:?} after its handler ended"
    );
    assert!(unacknowledged("complete"), "the completion was not logged");
    api.pay(&running_key, "alice", &slow_charge(running_ms))
        .await
        .assert_replay_of(&running);
    let before = if best_effort { 3 } else { 2 };
    assert_eq!(executed(), before);

    // The old primary comes back as the new one's replica: acknowledgements resume.
    let servers = blocking(move || {
        let mut servers = servers;
        servers.bring_back(old, new);
        servers
    })
    .await;
    // (Within moments: the replica may still be catching up when it shows online.)
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let later = api.pay(&later_key, "alice", &charge(400)).await;
        if later.status == StatusCode::CREATED {
            later.assert_fresh();
            break;
        }
        later.assert_error(
            StatusCode::SERVICE_UNAVAILABLE,
            "idempotency_store_unavailable",
        );
        assert!(Instant::now() < deadline, "acknowledgements never resumed");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(executed(), before + 1);
    // The running payment's completion, written again meanwhile, is acknowledged too.
    let deadline = Instant::now() + Duration::from_secs(20);
    while !logs.has("INFO", "acknowledged it after all") {
        assert!(
            Instant::now() < deadline,
            "the completion was never acknowledged"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    drop(instance);
    blocking(move || drop(servers)).await;
}

/// Replays of `done` (paid with `key` and `charge`) answered after a failover: once the
/// store has reconnected to the new primary (a first attempt may meet it reconnecting),
/// every one.
async fn replays_go_on(api: &Api, key: &str, charge: &Value, done: &Reply) {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let replay = api.pay(key, "alice", charge).await;
        if replay.replayed() {
            replay.assert_replay_of(done);
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no replay after the failover: {replay:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for _ in 0..10 {
        api.pay(key, "alice", charge).await.assert_replay_of(done);
    }
}

// ---------------------------------------------------------------------------------------
// A claim's `WAIT` cut off from its master, in a cluster.
// ---------------------------------------------------------------------------------------

/// With `replicas(1, ..)`, a claim counts only once a replica has it. Here the key's only
/// replica has stalled (stopped: still connected, acknowledging nothing), so no claim can be
/// acknowledged; the store's connection to the master drops while the claim's `WAIT`
/// blocks. Whatever the cluster connection sends again on its new connection, the claim
/// must fail: a `WAIT` alone on a connection that has written nothing is answered at once,
/// with every online replica.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs redis-server: scripts/test.sh"]
async fn a_claim_whose_wait_is_sent_again_on_a_new_connection_is_not_acknowledged() {
    claim_while_its_wait_is_cut_off(Cutoff::DropConnections).await;
}

/// As above, with the master killed while the claim's `WAIT` blocks: sent again, a `WAIT`
/// may reach another node, which answers for its own replicas.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs redis-server: scripts/test.sh"]
async fn a_claim_whose_master_dies_during_its_wait_is_not_acknowledged() {
    claim_while_its_wait_is_cut_off(Cutoff::KillMaster).await;
}

/// How the claim's `WAIT` is cut off from its master.
#[derive(Clone, Copy, Debug)]
enum Cutoff {
    /// `CLIENT KILL TYPE normal` on the master: the store reconnects to it.
    DropConnections,
    /// SIGKILL to the master.
    KillMaster,
}

async fn claim_while_its_wait_is_cut_off(cutoff: Cutoff) {
    let cluster = blocking(|| RedisCluster::start(3, 1)).await;
    let store = RedisStore::cluster(cluster.urls())
        .await
        .expect("cluster store")
        .prefix(unique_prefix("wait_cut_off"))
        .replicas(1, Duration::from_millis(1500));
    let scope = scope("alice", &fresh_key());
    let key = store.redis_key(&scope);
    let (cluster, master, stalled) = blocking(move || {
        let master = cluster.master_for_key(&key);
        let replica = cluster
            .replica_ports()
            .into_iter()
            .find(|&port| replica_of(&cluster.cli(port, &["ROLE"])) == Some(master))
            .expect("the master's replica");
        let stalled = Stall::start(
            |args| cluster.cli(replica, args),
            master,
            &format!("{{{key}}}"),
        );
        (cluster, master, stalled)
    })
    .await;

    let claiming = {
        let (store, scope) = (store.clone(), scope.clone());
        tokio::spawn(async move {
            let fingerprint = Fingerprint::from_bytes([1; 32]);
            let claim = store
                .claim(&scope, fingerprint, Duration::from_secs(30))
                .await;
            (claim, Instant::now())
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (cluster, cut_off) = blocking(move || {
        let mut cluster = cluster;
        match cutoff {
            Cutoff::DropConnections => {
                let killed = cluster.cli(master, &["CLIENT", "KILL", "TYPE", "normal"]);
                assert_ne!(killed.trim(), "0", "no connection to the master to drop");
            }
            Cutoff::KillMaster => cluster.kill(master),
        }
        (cluster, Instant::now())
    })
    .await;
    let (claim, answered) = join(claiming).await;
    drop(stalled);
    eprintln!(
        "{cutoff:?}: {claim:?}, {:?} after the cut-off",
        answered.saturating_duration_since(cut_off)
    );
    assert!(
        claim.is_err(),
        "{cutoff:?}: claimed although the only replica acknowledged nothing: {claim:?}"
    );
    blocking(move || drop(cluster)).await;
}

// ---------------------------------------------------------------------------------------
// The load: clients paying with fresh keys, retrying each payment until it is created.
// ---------------------------------------------------------------------------------------

/// One logical payment: the same key, user and body on every attempt.
#[derive(Clone, Debug)]
struct Payment {
    user: String,
    key: String,
    body: Value,
}

/// What the clients saw.
#[derive(Debug, Default)]
struct Tally {
    /// Payments answered `201`, with the id of the payment.
    paid: Vec<(Payment, String)>,
    /// Payments not answered `201` within [`PAYMENT_DEADLINE`], or answered otherwise.
    unpaid: Vec<String>,
    attempts: usize,
    /// `201`s that executed (no `Idempotent-Replayed`), and those replayed.
    created: usize,
    replayed: usize,
    /// `409 request_in_progress` and `503 idempotency_store_unavailable`, retried.
    in_progress: usize,
    unavailable: usize,
    /// HTTP requests that failed (timed out, connection lost), retried.
    transport: usize,
    /// Any other answer: a failure.
    unexpected: Vec<String>,
}

impl Tally {
    fn merge(&mut self, other: Tally) {
        self.paid.extend(other.paid);
        self.unpaid.extend(other.unpaid);
        self.attempts += other.attempts;
        self.created += other.created;
        self.replayed += other.replayed;
        self.in_progress += other.in_progress;
        self.unavailable += other.unavailable;
        self.transport += other.transport;
        self.unexpected.extend(other.unexpected);
    }
}

/// [`CLIENTS`] clients making payments one after another until stopped.
struct Load {
    stop: Arc<AtomicBool>,
    in_flight: Arc<Mutex<HashMap<usize, Payment>>>,
    clients: Vec<JoinHandle<Tally>>,
    http: reqwest::Client,
    addrs: Vec<SocketAddr>,
}

impl Load {
    fn start(instances: &[Instance]) -> Self {
        let http = reqwest::Client::builder()
            .no_proxy()
            .timeout(REQUEST_TIMEOUT)
            .build()
            .expect("HTTP client");
        let addrs: Vec<SocketAddr> = instances.iter().map(|i| i.addr).collect();
        let stop = Arc::new(AtomicBool::new(false));
        let in_flight = Arc::new(Mutex::new(HashMap::new()));
        let clients = (0..CLIENTS)
            .map(|n| {
                let (http, addrs) = (http.clone(), addrs.clone());
                let (stop, in_flight) = (stop.clone(), in_flight.clone());
                tokio::spawn(async move {
                    let mut tally = Tally::default();
                    let mut count: i64 = 0;
                    while !stop.load(Ordering::Relaxed) {
                        let payment = Payment {
                            user: format!("client-{n}"),
                            key: fresh_key(),
                            body: json!({
                                "amount": 100 + count,
                                "currency": "usd",
                                "simulate": "slow",
                                "delay_ms": rand::random_range(100..=300),
                            }),
                        };
                        count += 1;
                        in_flight.lock().unwrap().insert(n, payment.clone());
                        let result =
                            pay_until_created(&http, &addrs, n, &payment, &mut tally).await;
                        in_flight.lock().unwrap().remove(&n);
                        match result {
                            Ok((id, _)) => tally.paid.push((payment, id)),
                            Err(why) => tally.unpaid.push(why),
                        }
                    }
                    tally
                })
            })
            .collect();
        Self {
            stop,
            in_flight,
            clients,
            http,
            addrs,
        }
    }

    /// The payments being made now.
    fn in_flight(&self) -> Vec<Payment> {
        self.in_flight.lock().unwrap().values().cloned().collect()
    }

    /// Stops starting payments and waits for those under way.
    async fn finish(self) -> (Tally, reqwest::Client, Vec<SocketAddr>) {
        self.stop.store(true, Ordering::Relaxed);
        let deadline = Instant::now() + PAYMENT_DEADLINE + Duration::from_secs(5);
        let mut tally = Tally::default();
        for client in self.clients {
            let finished = tokio::time::timeout_at(deadline, client)
                .await
                .expect("the load's clients to finish");
            tally.merge(finished.unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic())));
        }
        (tally, self.http, self.addrs)
    }
}

/// Sends `payment` until it is answered `201` (through the instances in turn, starting with
/// `first`), retrying after `503`, `409 request_in_progress` and transport errors; returns
/// the payment's id and whether the `201` was a replay.
async fn pay_until_created(
    http: &reqwest::Client,
    addrs: &[SocketAddr],
    first: usize,
    payment: &Payment,
    tally: &mut Tally,
) -> Result<(String, bool), String> {
    let deadline = Instant::now() + PAYMENT_DEADLINE;
    for attempt in 0.. {
        let addr = addrs[(first + attempt) % addrs.len()];
        tally.attempts += 1;
        let pause = match send_payment(http, addr, payment).await {
            Ok(reply) if reply.status == StatusCode::CREATED => {
                let replayed = reply.replayed();
                if replayed {
                    tally.replayed += 1;
                } else {
                    tally.created += 1;
                }
                let id = assert_id(&reply.json()["id"], "pay_");
                return Ok((id, replayed));
            }
            Ok(reply)
                if reply.status == StatusCode::SERVICE_UNAVAILABLE
                    && reply.error_code().as_deref() == Some("idempotency_store_unavailable") =>
            {
                tally.unavailable += 1;
                retry_pause(&reply)
            }
            Ok(reply)
                if reply.status == StatusCode::CONFLICT
                    && reply.error_code().as_deref() == Some("request_in_progress") =>
            {
                tally.in_progress += 1;
                retry_pause(&reply)
            }
            Ok(reply) => {
                let why = format!("{payment:?}: attempt {attempt}: {reply:?}");
                tally.unexpected.push(why.clone());
                return Err(why);
            }
            Err(_) => {
                tally.transport += 1;
                jitter()
            }
        };
        if Instant::now() + pause >= deadline {
            return Err(format!(
                "{payment:?}: no 201 within {PAYMENT_DEADLINE:?} ({} attempts)",
                attempt + 1
            ));
        }
        tokio::time::sleep(pause).await;
    }
    unreachable!("the attempts never run out")
}

/// One `POST /v1/payments`, read whole.
async fn send_payment(
    http: &reqwest::Client,
    addr: SocketAddr,
    payment: &Payment,
) -> reqwest::Result<Reply> {
    let response = http
        .post(format!("http://{addr}/v1/payments"))
        .header("idempotency-key", &payment.key)
        .bearer_auth(&payment.user)
        .header(CONTENT_TYPE, "application/json")
        .body(payment.body.to_string())
        .send()
        .await?;
    let (status, headers) = (response.status(), response.headers().clone());
    let body = response.bytes().await?.to_vec();
    Ok(Reply {
        status,
        headers,
        body,
    })
}

/// `Retry-After`, at most [`MAX_PAUSE`]; else a short random pause.
fn retry_pause(reply: &Reply) -> Duration {
    reply
        .header(RETRY_AFTER.as_str())
        .and_then(|secs| secs.parse().ok())
        .map(Duration::from_secs)
        .map_or_else(jitter, |pause| pause.min(MAX_PAUSE))
}

fn jitter() -> Duration {
    Duration::from_millis(rand::random_range(100..=200))
}

/// Payments sent once more after the load: replayed with their id, executed again (another
/// id), or answered otherwise.
#[derive(Debug, Default)]
struct Resent {
    replayed: usize,
    executed: Vec<String>,
    wrong: Vec<String>,
}

/// A load's result, its payments sent once more afterwards, and the executions counted.
#[derive(Debug)]
struct Outcome {
    test: &'static str,
    tally: Tally,
    /// Executions the instances counted.
    executed: u64,
    /// Re-sent payments replayed with their id, executed again (with another id), and
    /// replayed with another id or not answered `201`.
    resent_replayed: usize,
    resent_executed: Vec<String>,
    resent_wrong: Vec<String>,
}

impl Outcome {
    /// Finishes the load, waits for the instances' executions to settle, then re-sends every
    /// payment once more and counts the executions.
    async fn collect(clock: &Clock, load: Load, instances: &[Instance]) -> Self {
        let test = clock.test;
        let (tally, http, addrs) = load.finish().await;
        clock.note("the load's last payments answered");
        for instance in instances {
            assert!(
                instance
                    .stats
                    .in_flight
                    .settled(Duration::from_secs(5))
                    .await,
                "{test}: executions still recording after the load"
            );
        }
        // Re-sent by as many clients as made them, each through the other instance than the
        // one its payment started on.
        let paid = Arc::new(tally.paid.clone());
        let resenders: Vec<JoinHandle<Resent>> = (0..CLIENTS)
            .map(|n| {
                let (http, addrs, paid) = (http.clone(), addrs.clone(), paid.clone());
                tokio::spawn(async move {
                    let mut resent = Resent::default();
                    for (payment, id) in paid.iter().skip(n).step_by(CLIENTS) {
                        let mut attempts = Tally::default();
                        match pay_until_created(&http, &addrs, n + 1, payment, &mut attempts).await
                        {
                            Ok((again, true)) if again == *id => resent.replayed += 1,
                            Ok((again, false)) => resent
                                .executed
                                .push(format!("{payment:?}: {id}, then {again}")),
                            other => resent
                                .wrong
                                .push(format!("{payment:?}: {id}, then {other:?}")),
                        }
                    }
                    resent
                })
            })
            .collect();
        let mut resent = Resent::default();
        for resender in resenders {
            let theirs = join(resender).await;
            resent.replayed += theirs.replayed;
            resent.executed.extend(theirs.executed);
            resent.wrong.extend(theirs.wrong);
        }
        clock.note("every payment re-sent");
        let (resent_replayed, resent_executed, resent_wrong) =
            (resent.replayed, resent.executed, resent.wrong);
        let executed = executed(instances);
        let outcome = Self {
            test,
            tally,
            executed,
            resent_replayed,
            resent_executed,
            resent_wrong,
        };
        eprintln!("{}", outcome.summary());
        outcome
    }

    fn payments(&self) -> usize {
        self.tally.paid.len() + self.tally.unpaid.len()
    }

    fn double_executions(&self) -> u64 {
        self.executed.saturating_sub(self.tally.paid.len() as u64)
    }

    fn summary(&self) -> String {
        let t = &self.tally;
        format!(
            "{}: {} payments ({} paid), {} attempts: {} executed, {} replayed, {} \
             request_in_progress, {} store_unavailable, {} transport errors, {} unexpected; \
             handler executions {}; re-sent: {} replayed, {} executed again, {} wrong",
            self.test,
            self.payments(),
            t.paid.len(),
            t.attempts,
            t.created,
            t.replayed,
            t.in_progress,
            t.unavailable,
            t.transport,
            t.unexpected.len(),
            self.executed,
            self.resent_replayed,
            self.resent_executed.len(),
            self.resent_wrong.len(),
        )
    }

    /// Every payment got a `201`, no answer but retried `503`s and `409`s, one execution
    /// each, and each replays its id afterwards.
    fn assert_exactly_once(&self) {
        let summary = self.summary();
        assert!(self.payments() > 0, "{summary}");
        assert!(
            self.tally.unpaid.is_empty(),
            "{summary}\nunpaid: {:#?}",
            self.tally.unpaid
        );
        assert!(
            self.tally.unexpected.is_empty(),
            "{summary}\nunexpected: {:#?}",
            self.tally.unexpected
        );
        assert!(
            self.resent_executed.is_empty() && self.resent_wrong.is_empty(),
            "{summary}\nexecuted again: {:#?}\nwrong: {:#?}",
            self.resent_executed,
            self.resent_wrong
        );
        assert_eq!(
            self.executed,
            self.payments() as u64,
            "executions against payments: {summary}"
        );
    }

    /// Prints the double executions; asserts only that every payment got its `201`.
    fn report_double_executions(&self) {
        let summary = self.summary();
        eprintln!(
            "{}: double executions without replica acks: {} of {}",
            self.test,
            self.double_executions(),
            self.payments()
        );
        assert!(
            self.tally.unpaid.is_empty(),
            "{summary}\nunpaid: {:#?}",
            self.tally.unpaid
        );
        assert!(
            self.tally.unexpected.is_empty(),
            "{summary}\nunexpected: {:#?}",
            self.tally.unexpected
        );
        assert!(
            self.resent_wrong.is_empty(),
            "{summary}\nwrong: {:#?}",
            self.resent_wrong
        );
        assert!(
            self.double_executions() <= self.payments() as u64,
            "{summary}"
        );
    }
}

// ---------------------------------------------------------------------------------------
// Helpers.
// ---------------------------------------------------------------------------------------

/// The payments app served in process on a free port; stops when dropped.
struct Instance {
    addr: SocketAddr,
    stats: Arc<app::Stats>,
    server: JoinHandle<()>,
}

impl Drop for Instance {
    fn drop(&mut self) {
        self.server.abort();
    }
}

async fn serve(store: Arc<dyn Store>) -> Instance {
    serve_with(store, app::Settings::default()).await
}

async fn serve_with(store: Arc<dyn Store>, timing: app::Settings) -> Instance {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("local address");
    let (router, stats) = app::router(store, timing);
    let server = tokio::spawn(async move { axum::serve(listener, router).await.expect("serve") });
    Instance {
        addr,
        stats,
        server,
    }
}

/// Payment handler executions over all instances.
fn executed(instances: &[Instance]) -> u64 {
    instances
        .iter()
        .map(|i| i.stats.payments.load(Ordering::Relaxed))
        .sum()
}

async fn cluster_store(cluster: &RedisCluster, prefix: &str, acks: bool) -> RedisStore {
    let store = RedisStore::cluster(cluster.urls())
        .await
        .expect("cluster store")
        .prefix(prefix);
    if acks {
        store.replicas(1, ACK_TIMEOUT)
    } else {
        store
    }
}

async fn sentinel_store(set: &SentinelSet, prefix: &str, acks: bool) -> RedisStore {
    let store = RedisStore::sentinel(set.sentinel_urls(), set.master_name())
        .await
        .expect("sentinel store")
        .prefix(prefix);
    if acks {
        store.replicas(1, ACK_TIMEOUT)
    } else {
        store
    }
}

fn scope(user: &str, key: &str) -> Scope {
    let key = IdempotencyKey::parse(&HeaderValue::from_str(key).expect("header value"))
        .expect("a valid key");
    Scope::new(Some(user.to_owned()), ENDPOINT.to_owned(), key)
}

/// The Redis key a payment's record lives under.
fn redis_key(store: &RedisStore, payment: &Payment) -> String {
    store.redis_key(&scope(&payment.user, &payment.key))
}

/// The keys matching `pattern` on one node (`SCAN`).
fn scan_count(cluster: &RedisCluster, port: u16, pattern: &str) -> usize {
    cluster
        .cli(port, &["--scan", "--pattern", pattern])
        .lines()
        .filter(|line| !line.is_empty())
        .count()
}

/// Whether the replica of the server about to be killed keeps up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Replication {
    /// Replication as it runs: the replica has nearly everything when its master dies.
    Live,
    /// The replica stops replicating [`STALL`] before its master dies, which loses the
    /// writes of that time.
    Stalled,
}

impl Replication {
    /// The app's TTL and lease. With a stalled replica, completions are lost whose claims
    /// the new master has: those keys stay in progress until their lease runs out, and
    /// their retries execute again only then. A lease of 10 s (rather than 30 s) lets the
    /// re-sent payments find that out within the test.
    fn timing(self) -> app::Settings {
        match self {
            Self::Live => app::Settings::default(),
            Self::Stalled => app::Settings {
                lease: Duration::from_secs(10),
                ..app::Settings::default()
            },
        }
    }
}

/// How long a stalled replica's master goes on under load before it is killed.
const STALL: Duration = Duration::from_millis(700);

/// A replica that has stalled: stopped (SIGSTOP: still connected and counted online by its
/// master, reading and acknowledging nothing), with the link to it clogged, so that its
/// master's next writes stay in the master's memory and die with it. Continued (SIGCONT)
/// when dropped.
struct Stall {
    pid: String,
}

impl Stall {
    /// Stalls the replica `replica_cli` runs commands on, and clogs the link from its
    /// master on port `master` with keys starting with `tag` (a hash tag, in a cluster,
    /// that puts them on that master).
    fn start(replica_cli: impl Fn(&[&str]) -> String, master: u16, tag: &str) -> Self {
        let info = replica_cli(&["INFO", "server"]);
        let pid = info
            .lines()
            .find_map(|line| line.trim().strip_prefix("process_id:"))
            .unwrap_or_else(|| panic!("no process_id in INFO server:\n{info}"))
            .to_owned();
        signal("-STOP", &pid);
        let stall = Self { pid };
        // More than the socket buffers between the two hold.
        let mut connection = redis::Client::open(format!("redis://127.0.0.1:{master}/"))
            .and_then(|client| client.get_connection())
            .expect("a connection to the master");
        let value = vec![b'x'; 8 << 20];
        for n in 0..4 {
            redis::cmd("SET")
                .arg(format!("{tag}stall:{n}"))
                .arg(&value)
                .query::<()>(&mut connection)
                .expect("SET on the master");
        }
        stall
    }
}

impl Drop for Stall {
    fn drop(&mut self) {
        signal("-CONT", &self.pid);
    }
}

fn signal(signal: &str, pid: &str) {
    let status = std::process::Command::new("kill")
        .args([signal, pid])
        .status()
        .expect("kill");
    assert!(status.success(), "kill {signal} {pid}: {status}");
}

/// The master's port in a replica's `ROLE` (`slave`, host, port, ...).
fn replica_of(role: &str) -> Option<u16> {
    let mut lines = role.lines();
    if lines.next()? != "slave" {
        return None;
    }
    lines.nth(1)?.trim().parse().ok()
}

/// Waits (blocking, at most 20 s) until the server on `port` is a replica whose link to its
/// primary is up; `cli` runs a command on it.
fn wait_for_replica_link(port: u16, cli: impl Fn(&[&str]) -> String) {
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let replication = cli(&["INFO", "replication"]);
        if replication.contains("role:slave") && replication.contains("master_link_status:up") {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "port {port} is no linked replica after 20 s:\n{replication}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Runs blocking code (a topology starting, failing over) off the runtime's workers; a
/// panic in it fails the test with its own message.
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    match tokio::task::spawn_blocking(f).await {
        Ok(value) => value,
        Err(error) => std::panic::resume_unwind(error.into_panic()),
    }
}

/// Awaits a task; a panic in it fails the test with its own message.
async fn join<T>(task: JoinHandle<T>) -> T {
    task.await
        .unwrap_or_else(|error| std::panic::resume_unwind(error.into_panic()))
}

/// Elapsed time since a test started, for its progress notes.
struct Clock {
    test: &'static str,
    started: Instant,
}

impl Clock {
    fn start(test: &'static str) -> Self {
        Self {
            test,
            started: Instant::now(),
        }
    }

    fn note(&self, what: &str) {
        eprintln!("{}: {:>6.2?} {what}", self.test, self.started.elapsed());
    }
}

/// The key's master stalls writes (`CLIENT PAUSE … WRITE`) while a request claims: the
/// store's timeout (900 ms) fails the claim, the layer answers 503 and releases the claim
/// (fenced by its token) behind it. At 2 s the cluster connection times the claim's
/// pipeline out, and the store sent every command of that pipeline again alone, the claim
/// included, though nobody awaited it any more. The master came back at 2.3 s: it ran the
/// claim, the release, then the claim sent again, which took the key for a token nobody
/// holds: the client's retry, long after the stall, got `409 request_in_progress` for a
/// whole lease (30 s). A claim nobody awaits is no longer sent again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "starts its own Redis Cluster: scripts/test.sh"]
async fn a_claim_timed_out_and_released_is_not_sent_again_to_hold_the_key() {
    use support::app::{self as app_support, post, router, send};

    let cluster = blocking(|| RedisCluster::start(3, 0)).await;
    let store = RedisStore::cluster(cluster.urls())
        .await
        .expect("cluster store")
        .prefix(unique_prefix("phantom"))
        .timeout(Duration::from_millis(900));
    let redis_key = store.redis_key(&app_support::scope("phantom"));
    let store: Arc<dyn Store> = Arc::new(store);
    let handler = app_support::Handler::default();
    let app = router(
        &handler,
        app_support::layer(&store).lease(Duration::from_secs(30)),
    );
    let master = cluster.master_for_key(&redis_key);
    cluster.cli(master, &["CLIENT", "PAUSE", "20000", "WRITE"]);
    let started = Instant::now();
    let first = send(&app, post("/pay").key("phantom")).await;
    assert_eq!(first.status, StatusCode::SERVICE_UNAVAILABLE, "{first:?}");
    tokio::time::sleep_until(started + Duration::from_millis(2300)).await;
    cluster.cli(master, &["CLIENT", "UNPAUSE"]);
    // Well past the stall, and past anything in flight.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let held = cluster.cli(master, &["PTTL", &redis_key]);
    let retry = send(&app, post("/pay").key("phantom")).await;
    assert_eq!(
        retry.status,
        StatusCode::CREATED,
        "the retry, 3 s after the stall: {retry:?}; PTTL of the key before it: {held}"
    );
    assert_eq!(handler.executions(), 1);
}

/// `total_connections_received` of one server.
fn connections_received(port: u16, cli: impl Fn(u16, &[&str]) -> String) -> u64 {
    let stats = cli(port, &["INFO", "stats"]);
    stats
        .lines()
        .find_map(|line| line.strip_prefix("total_connections_received:"))
        .and_then(|n| n.trim().parse().ok())
        .expect("total_connections_received")
}

/// The store asked Redis its `proto-max-bulk-len` once, of the primary it first wrote a
/// large record to, and kept the answer for good. Sentinel then fails over to a server
/// whose limit is lower (1 MiB): a 2 MB record was sent to it, and Redis answered with a
/// protocol error and closed the connection; with replicas to wait for, the `WAIT` behind
/// the record hid that answer, so the store never learnt, and the layer sent the record
/// again and again (each time closing the connection every request shares) until the
/// lease gave up. The new primary is now asked: the record is refused unsent at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "starts its own Sentinel set: scripts/test.sh"]
async fn the_value_limit_is_asked_again_after_a_failover() {
    use support::app::{self as app_support, post, router, send};

    let mut set = blocking(SentinelSet::start).await;
    let primary = set.primary_port();
    let replica = set
        .data_ports()
        .into_iter()
        .find(|&port| port != primary)
        .unwrap();
    set.cli(replica, &["CONFIG", "SET", "proto-max-bulk-len", "1mb"]);
    let store = RedisStore::sentinel(set.sentinel_urls(), set.master_name())
        .await
        .expect("sentinel store")
        .prefix(unique_prefix("limit-failover"))
        .replicas(1, Duration::from_millis(300))
        .replicas_best_effort();
    let store: Arc<dyn Store> = Arc::new(store);
    let handler = app_support::Handler::default();
    let lease = Duration::from_secs(3);
    let layer = app_support::layer(&store)
        .max_response_body(4 << 20)
        .lease(lease);
    let app = router(&handler, layer);
    let big = |key: &str| post("/pay").key(key).header("x-body-len", "2000000");
    // On the first primary (512 MiB): recorded, replayed.
    assert_eq!(send(&app, big("before")).await.status, StatusCode::CREATED);
    assert!(send(&app, big("before")).await.replayed());
    let (set, new_primary) = blocking(move || {
        let old = set.kill_primary();
        let new = set.wait_for_failover(old);
        (set, new)
    })
    .await;
    assert_eq!(new_primary, replica);
    // The store follows the new primary.
    let mut followed = false;
    for n in 0..100 {
        let small = send(&app, post("/pay").key(&format!("small-{n}"))).await;
        if small.status == StatusCode::CREATED {
            followed = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(followed, "the store never reached the new primary");
    let connections_before = connections_received(new_primary, |p, a| set.cli(p, a));
    let started = Instant::now();
    let after = tokio::time::timeout(Duration::from_secs(30), send(&app, big("after")))
        .await
        .expect("answered");
    let took = started.elapsed();
    // Less the connection that reads the count.
    let reconnections =
        connections_received(new_primary, |p, a| set.cli(p, a)) - connections_before - 1;
    let executions = handler.executions();
    // Past the lease: a record given up would leave the key to the next retry.
    tokio::time::sleep(lease + Duration::from_millis(500)).await;
    let retry = send(&app, big("after")).await;
    let executed_again = handler.executions() - executions;
    assert_eq!(after.status, StatusCode::CREATED);
    assert_eq!(executed_again, 0, "the retry executed again: {retry:?}");
    assert!(
        took < Duration::from_secs(1) && reconnections == 0,
        "the record past the new primary's limit took {took:?} and made the store reconnect \
         {reconnections} times"
    );
    assert_eq!(retry.status, StatusCode::CONFLICT, "{retry:?}");
}
