//! Duplicates that wait for an original running on another instance: two stores on the
//! same records, as two processes have them, each with its own connections. The waiter's
//! instance is woken by the store's notifications of the other's completion or release,
//! not by reading the key again.
//!
//! Each store has a setup function that opens its two instances; the cases shared by every
//! store take them, and the cases only one store has follow its setup.

mod support;

use std::{sync::Arc, time::Duration};

use axum::http::StatusCode;
use tower_idempotency::{
    store::{Claim, Fenced, Watch},
    ClaimToken, Fingerprint, IdempotencyLayer, PostgresStore, RedisStore, Scope, Store,
    StoredResponse,
};

use futures_util::StreamExt;
use support::{
    app::*,
    redis_server::RedisServer,
    redis_topology::RedisCluster,
    wrapped_store::{ClaimsCounted, Wrapped},
};

/// Two instances of one store on the same records.
struct Instances {
    /// Runs the originals.
    a: Arc<dyn Store>,
    /// Runs the duplicates, and waits.
    b: Arc<dyn Store>,
    /// What B holds for its waiters, counted.
    held_by_b: Held,
}

/// How to count what a store holds for its waiters: the keys it watches and, on Redis, the
/// connections subscribed to a key's channel.
enum Held {
    Postgres(PostgresStore),
    Redis(RedisStore, Nodes),
}

/// The Redis servers a store's subscriber may be connected to.
enum Nodes {
    /// This server.
    Urls(Vec<String>),
    /// Every node of a cluster, where a key's channel is a shard channel.
    Shards(Vec<String>),
    /// The primary the Sentinels at these addresses name now.
    Sentinel(Vec<String>),
}

/// Runs each listed `async fn case(instances: Instances)` on the instances that each
/// `$setup` opens, as `$setup::case`, with the attribute given before that setup (the
/// server its store needs).
macro_rules! across_instances {
    (#[$attr:meta] $setup:ident $(, #[$more_attr:meta] $more:ident)*: $($case:ident),* $(,)?) => {
        mod $setup {
            $(#[tokio::test]
            #[$attr]
            async fn $case() {
                super::$case(super::$setup().await).await
            })*
        }
        across_instances!($(#[$more_attr] $more),*: $($case),*);
    };
    (: $($case:ident),* $(,)?) => {};
}

across_instances!(
    #[ignore = "needs PostgreSQL: scripts/test.sh"] postgres:
    a_duplicate_on_another_instance_gets_the_replay,
    the_duplicates_on_another_instance_read_the_key_once,
    a_large_record_is_read_once_for_the_duplicates,
    a_duplicate_on_another_instance_executes_when_the_original_is_released,
    a_watch_is_woken_by_the_other_instance,
    each_instance_hears_the_end_of_a_claim_once,
    a_duplicate_on_another_instance_executes_when_the_holder_crashed,
    past_its_bound_a_duplicate_on_another_instance_gets_the_conflict,
    beyond_the_cap_duplicates_on_another_instance_get_the_conflict_at_once,
    a_waiter_on_another_instance_that_goes_away_leaves_nothing_behind,
);
across_instances!(
    #[ignore = "needs Redis: scripts/test.sh"] redis,
    #[ignore = "needs a Redis Cluster and a Sentinel set: scripts/test.sh"] redis_cluster,
    #[ignore = "needs a Redis Cluster and a Sentinel set: scripts/test.sh"] redis_sentinel:
    a_duplicate_on_another_instance_gets_the_replay,
    the_duplicates_on_another_instance_read_the_key_once,
    a_large_record_is_read_once_for_the_duplicates,
    a_duplicate_on_another_instance_executes_when_the_original_is_released,
    a_watch_is_woken_by_the_other_instance,
    each_instance_hears_the_end_of_a_claim_once,
    a_duplicate_on_another_instance_executes_when_the_holder_crashed,
    past_its_bound_a_duplicate_on_another_instance_gets_the_conflict,
    beyond_the_cap_duplicates_on_another_instance_get_the_conflict_at_once,
    a_waiter_on_another_instance_that_goes_away_leaves_nothing_behind,
);
across_instances!(
    #[ignore = "needs Redis: scripts/test.sh"] redis_signed,
    #[ignore = "needs a Redis Cluster and a Sentinel set: scripts/test.sh"] redis_cluster_signed:
    a_duplicate_on_another_instance_gets_the_replay,
    the_duplicates_on_another_instance_are_handed_the_record,
    a_larger_record_is_handed_to_the_duplicates_that_listen,
    a_large_record_is_read_once_for_the_duplicates,
    a_duplicate_on_another_instance_executes_when_the_original_is_released,
    a_watch_is_woken_by_the_other_instance,
    each_instance_hears_the_end_of_a_claim_once,
);

const BOUND: Duration = Duration::from_secs(10);
/// How long a woken watch may take to answer: far more than a notification takes, and
/// still far less than the bound a waiter without one would sit out.
const WOKEN_WITHIN: Duration = Duration::from_secs(2);
const LEASE: Duration = Duration::from_secs(30);
const FINGERPRINT: Fingerprint = Fingerprint::from_bytes([7; 32]);

/// The same service on both instances: one handler, two layers that wait.
fn apps(instances: &Instances, handler: &Handler) -> (axum::Router, axum::Router) {
    let app = |store| router(handler, layer(store).wait_for_original(BOUND));
    (app(&instances.a), app(&instances.b))
}

/// The original's service on instance A, and on instance B the duplicates' service made
/// by `b_layer` from B's layer.
fn apps_with(
    instances: &Instances,
    handler: &Handler,
    b_layer: impl FnOnce(IdempotencyLayer) -> IdempotencyLayer,
) -> (axum::Router, axum::Router) {
    let a = router(handler, layer(&instances.a).wait_for_original(BOUND));
    (a, router(handler, b_layer(layer(&instances.b))))
}

/// A holder on A claims the key and dies: nothing announces the end of its claim, and the
/// duplicate waiting on B takes the key once the lease has run out (well before its bound)
/// and executes, once.
async fn a_duplicate_on_another_instance_executes_when_the_holder_crashed(instances: Instances) {
    let handler = Handler::default();
    let (_, b) = apps(&instances, &handler);
    let lease = Duration::from_secs(1);
    claim_and_crash(&*instances.a, "crashed", lease).await;
    let duplicate = spawn_send(&b, post("/pay").key("crashed"));
    still_waiting(&duplicate).await;
    assert_eq!(
        handler.executions(),
        0,
        "nothing runs while the lease holds"
    );
    let duplicate = tokio::time::timeout(BOUND / 2, duplicate)
        .await
        .expect("the lease's end ends the wait, not the bound")
        .unwrap();
    assert_eq!(duplicate.status, StatusCode::CREATED);
    assert!(!duplicate.replayed(), "the duplicate executed");
    assert_eq!(handler.executions(), 1);
    // Its record is the key's: the next duplicate, on either instance, gets its replay.
    let again = send(&b, post("/pay").key("crashed")).await;
    assert!(again.replayed());
    assert_eq!(again.body, duplicate.body);
    assert_eq!(handler.executions(), 1);
}

/// A duplicate on B that waits past its bound gets today's conflict, with when to come
/// back; the original on A still completes, and B's waiter leaves no watch behind.
async fn past_its_bound_a_duplicate_on_another_instance_gets_the_conflict(instances: Instances) {
    let handler = Handler::default();
    let bound = Duration::from_millis(300);
    let (a, b) = apps_with(&instances, &handler, |layer| layer.wait_for_original(bound));
    let original = spawn_send(&a, post_waiting("bound"));
    until_executing(&handler, 1).await;
    in_progress(&b, "bound", "answered at its bound").await;
    eventually_zero(|| instances.held_by_b.watched()).await;
    handler.gate.add_permits(1);
    assert_eq!(original.await.unwrap().status, StatusCode::CREATED);
    assert_eq!(handler.executions(), 1);
}

/// B's layer lets one request wait: the next duplicate on B gets the conflict at once,
/// whatever A's layer would let wait; the one waiting gets the replay.
async fn beyond_the_cap_duplicates_on_another_instance_get_the_conflict_at_once(
    instances: Instances,
) {
    let handler = Handler::default();
    let b_layer = layer(&instances.b).wait_for_original(BOUND).max_waiting(1);
    let (a, b) = apps_with(&instances, &handler, |_| b_layer.clone());
    let original = spawn_send(&a, post_waiting("cap"));
    until_executing(&handler, 1).await;
    let waiting = spawn_send(&b, post("/pay").key("cap"));
    still_waiting(&waiting).await;
    assert_eq!(b_layer.waiting(), 1);
    in_progress(&b, "cap", "answered without waiting for the original").await;
    assert!(!waiting.is_finished(), "the one waiting still waits");
    gets_the_replay_once_the_original_answers(&handler, original, waiting).await;
    assert_eq!(b_layer.waiting(), 0);
    assert_eq!(handler.executions(), 1);
}

/// A waiter on B whose client goes away (its request's future dropped) leaves nothing
/// behind on B: no place among its waiters, no watch, and on Redis no subscription to the
/// key's channel. The original on A is untouched, and a later waiter on B is woken by it.
async fn a_waiter_on_another_instance_that_goes_away_leaves_nothing_behind(instances: Instances) {
    let handler = Handler::default();
    let b_layer = layer(&instances.b).wait_for_original(BOUND);
    let (a, b) = apps_with(&instances, &handler, |_| b_layer.clone());
    let held = &instances.held_by_b;
    let scope = scope("gone");
    let original = spawn_send(&a, post_waiting("gone"));
    until_executing(&handler, 1).await;
    let waiter = spawn_send(&b, post("/pay").key("gone"));
    still_waiting(&waiter).await;
    assert_eq!(b_layer.waiting(), 1);
    assert_eq!(held.watched().await, 1, "the waiter watches its key");
    if let Some(subscribed) = held.subscribed(&scope).await {
        assert_eq!(subscribed, 1, "B subscribed to the key's channel");
    }
    waiter.abort();
    assert!(waiter.await.unwrap_err().is_cancelled());
    eventually_zero(|| async { b_layer.waiting() }).await;
    eventually_zero(|| held.watched()).await;
    eventually_zero(|| async { held.subscribed(&scope).await.unwrap_or(0) }).await;
    // B still waits, and is woken, as before.
    let waiter = spawn_send(&b, post("/pay").key("gone"));
    still_waiting(&waiter).await;
    gets_the_replay_once_the_original_answers(&handler, original, waiter).await;
    assert_eq!(handler.executions(), 1);
    eventually_zero(|| held.watched()).await;
}

async fn a_duplicate_on_another_instance_gets_the_replay(instances: Instances) {
    let handler = Handler::default();
    let (a, b) = apps(&instances, &handler);
    let original = spawn_send(&a, post_waiting("w").body("amount=1"));
    until_executing(&handler, 1).await;
    let duplicates = three_waiting(&b, || post("/pay").key("w").body("amount=1")).await;
    handler.gate.add_permits(1);
    let original = original.await.unwrap();
    assert_eq!(original.status, StatusCode::CREATED);
    each_gets_the_replay(duplicates, &original).await;
    assert_eq!(handler.executions(), 1);
}

/// The completion's announcement says only that the claim ended (anyone who can publish
/// could have sent it): one of the duplicates waiting on B reads the key for them all, and
/// B reads it otherwise only as it did to begin waiting (each duplicate once to find it in
/// progress, and once more once watching).
async fn the_duplicates_on_another_instance_read_the_key_once(instances: Instances) {
    let (to_wait, after) = reads_of_duplicates_on_b(instances, "read-once", 100).await;
    assert_eq!(after, to_wait + 1);
}

/// Instances that sign their records: the completion's message carries the record, and
/// the duplicates waiting on B take it once its signature checks; B reads the key only as
/// it did to begin waiting.
async fn the_duplicates_on_another_instance_are_handed_the_record(instances: Instances) {
    let (to_wait, after) = reads_of_duplicates_on_b(instances, "handed", 100).await;
    assert_eq!(after, to_wait, "a duplicate read the key");
}

/// A signed record of a few KiB is carried only to a key somebody listens on, as B's
/// duplicates do: they are handed it too.
async fn a_larger_record_is_handed_to_the_duplicates_that_listen(instances: Instances) {
    let (to_wait, after) = reads_of_duplicates_on_b(instances, "handed-larger", 5_000).await;
    assert_eq!(after, to_wait, "a duplicate read the key");
}

/// However large the record (over 64 KiB, none is carried), it is read once for all the
/// duplicates waiting on B.
async fn a_large_record_is_read_once_for_the_duplicates(instances: Instances) {
    let (to_wait, after) = reads_of_duplicates_on_b(instances, "large", 70_000).await;
    assert_eq!(after, to_wait + 1);
}

/// Three duplicates on B wait for an original on A whose body is `body_len` bytes, and get
/// its replay: how often B read the key for them before the original answered, and in all.
async fn reads_of_duplicates_on_b(
    instances: Instances,
    key: &str,
    body_len: usize,
) -> (usize, usize) {
    reads_of_duplicates_on_b_after(instances, key, body_len, async |_| {}).await
}

/// As [`reads_of_duplicates_on_b`], with `meanwhile` run while they wait, before the
/// original answers.
async fn reads_of_duplicates_on_b_after(
    instances: Instances,
    key: &str,
    body_len: usize,
    meanwhile: impl AsyncFnOnce(&Wrapped<ClaimsCounted>),
) -> (usize, usize) {
    let b = Wrapped::new(instances.b.clone(), ClaimsCounted::default());
    let instances = Instances {
        b: b.clone(),
        ..instances
    };
    let handler = Handler::default();
    let (a, b_app) = apps(&instances, &handler);
    let length = body_len.to_string();
    let original = post_waiting(key).header("x-body-len", &length);
    let original = spawn_send(&a, original);
    until_executing(&handler, 1).await;
    let duplicates = three_waiting(&b_app, || post("/pay").key(key)).await;
    let to_wait = b.hooks.count();
    assert_eq!(to_wait, 2 * duplicates.len());
    meanwhile(&b).await;
    handler.gate.add_permits(1);
    let original = original.await.unwrap();
    assert_eq!(original.body.len(), body_len);
    each_gets_the_replay(duplicates, &original).await;
    assert_eq!(handler.executions(), 1);
    (to_wait, b.hooks.count())
}

async fn a_duplicate_on_another_instance_executes_when_the_original_is_released(
    instances: Instances,
) {
    let handler = Handler::default();
    let (a, b) = apps(&instances, &handler);
    // The original answers 503 (released: its outcome was unknown).
    let original = spawn_send(&a, post_waiting("r").header("x-status", "503"));
    until_executing(&handler, 1).await;
    let duplicate = spawn_send(&b, post("/pay").key("r"));
    still_waiting(&duplicate).await;
    handler.gate.add_permits(1);
    assert_eq!(
        original.await.unwrap().status,
        StatusCode::SERVICE_UNAVAILABLE
    );
    let duplicate = before_the_bound(duplicate).await;
    assert_eq!(duplicate.status, StatusCode::CREATED);
    assert!(!duplicate.replayed(), "the duplicate executed");
    assert_eq!(handler.executions(), 2);
}

/// The store hands out a watch (a waiter is woken, not left to read its key again), and a
/// completion, then a release, made by the other instance wakes it.
async fn a_watch_is_woken_by_the_other_instance(instances: Instances) {
    for (label, completes) in [("completed", true), ("released", false)] {
        let scope = scope(&format!("watched-{label}"));
        let mut watch = watch(&*instances.b, &scope).await;
        let token = claim(&*instances.a, &scope).await;
        not_woken(&mut watch, "by the claim").await;
        end_claim(&*instances.a, &scope, token, completes).await;
        woken(&mut watch, label).await;
    }
}

/// The instance that ends a claim announces it to its own watches at once, then hears it
/// again from the store's notifications, as the other instance does: each watch is woken
/// once all the same (twice, its waiters would read the key twice). Redis often delivers
/// the message before the write's reply, and a watch takes two changes at once for one, so
/// there the board's own tests show it; PostgreSQL notifies after its commit, later.
async fn each_instance_hears_the_end_of_a_claim_once(instances: Instances) {
    for (label, completes) in [("completed", true), ("released", false)] {
        let scope = scope(&format!("heard-once-{label}"));
        let mut own = watch(&*instances.a, &scope).await;
        let mut other = watch(&*instances.b, &scope).await;
        let token = claim(&*instances.a, &scope).await;
        end_claim(&*instances.a, &scope, token, completes).await;
        woken(&mut own, label).await;
        woken(&mut other, label).await;
        not_woken(&mut own, "again by its own notification").await;
        not_woken(&mut other, "twice").await;
    }
}

/// Sends a duplicate on `key` to `app`, which answers well before [`BOUND`] (`when`) with
/// the conflict of a key in progress, and when to come back.
async fn in_progress(app: &axum::Router, key: &str, when: &str) {
    let answer = tokio::time::timeout(BOUND / 2, send(app, post("/pay").key(key)))
        .await
        .expect(when);
    assert_eq!(answer.status, StatusCode::CONFLICT);
    assert_eq!(answer.error(), "request_in_progress");
    assert!(answer.headers.contains_key("retry-after"));
}

/// Lets the original (waiting on `handler`'s gate) answer: `waiter` is woken before its
/// bound, with the original's replay.
async fn gets_the_replay_once_the_original_answers(
    handler: &Handler,
    original: tokio::task::JoinHandle<Answer>,
    waiter: tokio::task::JoinHandle<Answer>,
) {
    handler.gate.add_permits(1);
    let original = original.await.unwrap();
    let waiter = before_the_bound(waiter).await;
    assert!(waiter.replayed());
    assert_eq!(
        (waiter.status, &waiter.body),
        (original.status, &original.body)
    );
}

/// Three requests made by `request`, sent to `app`, each waiting for its original.
async fn three_waiting(
    app: &axum::Router,
    request: impl Fn() -> Req,
) -> Vec<tokio::task::JoinHandle<Answer>> {
    let duplicates: Vec<_> = (0..3).map(|_| spawn_send(app, request())).collect();
    for duplicate in &duplicates {
        still_waiting(duplicate).await;
    }
    duplicates
}

/// Each duplicate is woken before its bound with the replay of `original`.
async fn each_gets_the_replay(duplicates: Vec<tokio::task::JoinHandle<Answer>>, original: &Answer) {
    for duplicate in duplicates {
        let duplicate = before_the_bound(duplicate).await;
        assert!(duplicate.replayed());
        assert_eq!(
            (duplicate.status, &duplicate.body),
            (original.status, &original.body)
        );
    }
}

/// The answer of a duplicate, woken before its bound.
async fn before_the_bound(duplicate: tokio::task::JoinHandle<Answer>) -> Answer {
    tokio::time::timeout(BOUND / 2, duplicate)
        .await
        .expect("woken before the bound")
        .unwrap()
}

/// A watch from `store`, which must hand one out.
async fn watch(store: &dyn Store, scope: &Scope) -> Watch {
    store
        .watch(scope)
        .await
        .expect("the watch")
        .expect("a store that announces hands out a watch")
}

async fn claim(store: &dyn Store, scope: &Scope) -> ClaimToken {
    match store.claim(scope, FINGERPRINT, LEASE).await.unwrap() {
        Claim::Claimed(token) => token,
        other => panic!("expected a free key, got {other:?}"),
    }
}

async fn complete(store: &dyn Store, scope: &Scope, token: ClaimToken) {
    let response = StoredResponse {
        status: StatusCode::CREATED,
        headers: Default::default(),
        body: "done".into(),
        trailers: None,
    };
    let completed = store
        .complete(scope, token, FINGERPRINT, &response, LEASE)
        .await
        .unwrap();
    assert_eq!(completed, Fenced::Applied);
}

/// Completes the claim `token` on `scope`, or releases it.
async fn end_claim(store: &dyn Store, scope: &Scope, token: ClaimToken, completes: bool) {
    if completes {
        complete(store, scope, token).await;
    } else {
        let released = store.release(scope, token).await.unwrap();
        assert_eq!(released, Fenced::Applied);
    }
}

async fn woken(watch: &mut Watch, what: &str) {
    if tokio::time::timeout(WOKEN_WITHIN, watch.changed())
        .await
        .is_err()
    {
        panic!("the watch was not woken: {what}");
    }
}

async fn not_woken(watch: &mut Watch, what: &str) {
    let changed = tokio::time::timeout(Duration::from_millis(300), watch.changed()).await;
    assert!(changed.is_err(), "the watch was woken {what}");
}

// ---------------------------------------------------------------------------------------
// PostgreSQL: `LISTEN`/`NOTIFY`.

async fn postgres() -> Instances {
    let (a, b) = postgres_instances().await;
    let held = Held::Postgres(b.clone());
    Instances::of(a, b, held)
}

/// Two stores on one table of their own, each with its pool and its listener.
async fn postgres_instances() -> (PostgresStore, PostgresStore) {
    let a = support::postgres_store().await.announce_outcomes();
    let b = postgres_on(a.table_name()).await;
    (a, b)
}

/// Another store on the table named `qualified` (`schema.table`).
async fn postgres_on(qualified: &str) -> PostgresStore {
    let (schema, table) = qualified.split_once('.').expect("a qualified name");
    PostgresStore::connect(&support::database_url())
        .await
        .unwrap()
        .table(schema, table)
        .unwrap()
        .announce_outcomes()
}

/// The listener relays its own table's notifications, not another's: the same scope
/// completed in another table wakes nothing.
#[tokio::test]
#[ignore = "needs PostgreSQL: scripts/test.sh"]
async fn postgres_listeners_relay_their_own_table_only() {
    let (a, b) = postgres_instances().await;
    let elsewhere = support::postgres_store().await.announce_outcomes();
    assert_ne!(
        elsewhere.notification_channel(),
        b.notification_channel(),
        "a channel per table"
    );
    assert_eq!(a.notification_channel(), b.notification_channel());
    let scope = scope("own-table");
    let mut watch = watch(&b, &scope).await;
    let token = claim(&elsewhere, &scope).await;
    complete(&elsewhere, &scope, token).await;
    not_woken(&mut watch, "by another table's completion").await;
    let token = claim(&a, &scope).await;
    complete(&a, &scope, token).await;
    woken(&mut watch, "by its table's completion").await;
}

/// A key is watched while a watch on it lives, however many there are, and no longer.
#[tokio::test]
#[ignore = "needs PostgreSQL: scripts/test.sh"]
async fn postgres_watches_dropped_leave_nothing_watched() {
    let (_, b) = postgres_instances().await;
    assert_eq!(b.watched(), 0);
    let first = watch(&b, &scope("dropped")).await;
    let second = watch(&b, &scope("dropped")).await;
    let other = watch(&b, &scope("dropped-other")).await;
    assert_eq!(b.watched(), 2, "one entry per key");
    drop(first);
    assert_eq!(b.watched(), 2);
    drop((second, other));
    assert_eq!(b.watched(), 0);
}

/// A listening connection that is cut: its watches are woken (what was notified meanwhile
/// is lost, so their waiters read their keys again), it listens again, and relays again.
#[tokio::test]
#[ignore = "needs PostgreSQL: scripts/test.sh"]
async fn postgres_listener_listens_again_after_its_connection_is_cut() {
    let (a, b) = postgres_instances().await;
    let scope = scope("cut");
    let mut kept = watch(&b, &scope).await;
    let admin = support::store_client(&support::database_url()).await;
    let cut = admin
        .query(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE query = $1",
            &[&format!("LISTEN {}", b.notification_channel())],
        )
        .await
        .unwrap();
    assert_eq!(cut.len(), 1, "one listening connection");
    woken(&mut kept, "by the cut").await;
    // Listening again (the watch returns `None` meanwhile), and relaying.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while b.watch(&scope).await.unwrap().is_none() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "never listened again"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Woken again as it listened again, unless that came with the cut's: let it pass.
    let _ = tokio::time::timeout(Duration::from_millis(200), kept.changed()).await;
    let mut fresh = watch(&b, &scope).await;
    not_woken(&mut fresh, "before the completion").await;
    let token = claim(&a, &scope).await;
    complete(&a, &scope, token).await;
    woken(&mut fresh, "after listening again").await;
    woken(&mut kept, "after listening again").await;
}

/// A store keeps relaying when the runtime its listener ran in has ended (the listener went
/// with it): the next watch opens another.
#[test]
#[ignore = "needs PostgreSQL: scripts/test.sh"]
fn postgres_listener_outlives_the_runtime_it_ran_in() {
    let runtime = || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    };
    let first = runtime();
    let (a, b) = first.block_on(postgres_instances());
    first.block_on(async {
        let _ = watch(&b, &scope("first-runtime")).await;
    });
    drop(first);
    runtime().block_on(async {
        let scope = scope("next-runtime");
        let first = tokio::time::timeout(WOKEN_WITHIN, watch(&b, &scope))
            .await
            .expect("the watch in the next runtime");
        // The listener that replaced the ended one woke every watch it found (their
        // waiters may have missed a completion): a watch made once it listens is woken
        // only by the completion.
        let mut watch = watch(&b, &scope).await;
        drop(first);
        not_woken(&mut watch, "before the completion").await;
        let token = claim(&a, &scope).await;
        complete(&a, &scope, token).await;
        woken(&mut watch, "in the next runtime").await;
    });
}

/// Where no connection can listen (nothing answers at the address), the store hands out no
/// watch: its waiters read their keys again.
#[tokio::test]
async fn postgres_without_a_listener_hands_out_no_watch() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let url = format!("postgres://postgres@127.0.0.1:{port}/postgres");
    let unreachable = PostgresStore::connect(&url)
        .await
        .unwrap()
        .announce_outcomes();
    let watch = tokio::time::timeout(WOKEN_WITHIN * 3, unreachable.watch(&scope("none")))
        .await
        .expect("answered");
    assert!(watch.unwrap().is_none());
    assert_eq!(unreachable.watched(), 0);
}

/// A store made from a pool cannot open a connection to listen on: it hands out no watch.
#[tokio::test]
async fn postgres_from_a_pool_hands_out_no_watch() {
    let config: tokio_postgres::Config = support::database_url().parse().unwrap();
    let manager = deadpool_postgres::Manager::new(config, tokio_postgres::NoTls);
    let pool = deadpool_postgres::Pool::builder(manager).build().unwrap();
    let store = PostgresStore::new(pool).announce_outcomes();
    assert!(store.watch(&scope("pooled")).await.unwrap().is_none());
    assert_eq!(store.watched(), 0);
}

// ---------------------------------------------------------------------------------------
// Redis: pub/sub, on one server, a cluster and a Sentinel-managed primary.

/// Two stores on the shared Redis under one prefix, as two instances of a service see it.
async fn redis_instances() -> (RedisStore, RedisStore) {
    let a = support::redis_store("waiting_across").await;
    // Not a clone, which would share its connections: another instance has its own.
    let b = RedisStore::open(&support::redis_url()).await.unwrap();
    announcing(a, b)
}

async fn redis() -> Instances {
    let (a, b) = redis_instances().await;
    let nodes = Nodes::Urls(vec![support::redis_url()]);
    let held = Held::Redis(b.clone(), nodes);
    Instances::of(a, b, held)
}

async fn redis_cluster() -> Instances {
    let (a, b) = (
        support::cluster_store("waiting_across").await,
        support::cluster_store("waiting_across").await,
    );
    let (a, b) = announcing(a, b);
    let nodes = Nodes::Shards(support::urls_from("REDIS_CLUSTER_URLS"));
    let held = Held::Redis(b.clone(), nodes);
    Instances::of(a, b, held)
}

async fn redis_sentinel() -> Instances {
    let (a, b) = (
        support::sentinel_store("waiting_across").await,
        support::sentinel_store("waiting_across").await,
    );
    let (a, b) = announcing(a, b);
    let nodes = Nodes::Sentinel(support::urls_from("REDIS_SENTINEL_URLS"));
    let held = Held::Redis(b.clone(), nodes);
    Instances::of(a, b, held)
}

/// The secret that signing instances share.
const SECRET: &[u8] = b"the secret every instance of the service shares";

async fn redis_signed() -> Instances {
    let a = support::redis_store("waiting_across").await;
    let b = RedisStore::open(&support::redis_url()).await.unwrap();
    let (a, b) = signing(a, b, SECRET);
    let nodes = Nodes::Urls(vec![support::redis_url()]);
    let held = Held::Redis(b.clone(), nodes);
    Instances::of(a, b, held)
}

async fn redis_cluster_signed() -> Instances {
    let (a, b) = signing(
        support::cluster_store("waiting_across").await,
        support::cluster_store("waiting_across").await,
        SECRET,
    );
    let nodes = Nodes::Shards(support::urls_from("REDIS_CLUSTER_URLS"));
    let held = Held::Redis(b.clone(), nodes);
    Instances::of(a, b, held)
}

/// Two stores as two instances of one service: `b` under `a`'s key prefix, `a` signing
/// with `SECRET` and `b` with `secret`.
fn signing(a: RedisStore, b: RedisStore, secret: &[u8]) -> (RedisStore, RedisStore) {
    let a = a.announce_signed_records(SECRET);
    let b = b.prefix(a.key_prefix()).announce_signed_records(secret);
    (a, b)
}

/// An instance whose secret is not the signer's cannot check the record a message
/// carries: its waiters read the key, once for them all, and get the original's replay.
#[tokio::test]
#[ignore = "needs Redis: scripts/test.sh"]
async fn redis_an_instance_with_another_secret_reads_the_key() {
    let a = support::redis_store("waiting_across").await;
    let b = RedisStore::open(&support::redis_url()).await.unwrap();
    let (a, b) = signing(a, b, b"another secret");
    let nodes = Nodes::Urls(vec![support::redis_url()]);
    let held = Held::Redis(b.clone(), nodes);
    let instances = Instances::of(a, b, held);
    let (to_wait, after) = reads_of_duplicates_on_b(instances, "other-secret", 100).await;
    assert_eq!(after, to_wait + 1);
}

/// Two stores as two instances of one service: `b` under `a`'s key prefix, both
/// announcing their outcomes.
fn announcing(a: RedisStore, b: RedisStore) -> (RedisStore, RedisStore) {
    let a = a.announce_outcomes();
    let b = b.prefix(a.key_prefix()).announce_outcomes();
    (a, b)
}

impl Instances {
    fn of(a: impl Store, b: impl Store, held_by_b: Held) -> Self {
        Self {
            a: Arc::new(a),
            b: Arc::new(b),
            held_by_b,
        }
    }
}

impl Held {
    /// The Redis channel of `scope`'s key.
    fn channel(&self, scope: &Scope) -> String {
        match self {
            Held::Redis(store, _) => store.announcement_channel(scope),
            Held::Postgres(_) => panic!("PostgreSQL has one channel per table"),
        }
    }

    /// The Redis key of `scope`.
    fn key(&self, scope: &Scope) -> String {
        match self {
            Held::Redis(store, _) => store.redis_key(scope),
            Held::Postgres(_) => panic!("not a Redis store"),
        }
    }

    /// How many keys the store watches now.
    async fn watched(&self) -> usize {
        match self {
            Held::Postgres(store) => store.watched(),
            Held::Redis(store, _) => store.watched().await,
        }
    }

    /// How many connections Redis counts as subscribed to `scope`'s channel, over every
    /// server the store may subscribe on; `None` on PostgreSQL, whose listener listens on
    /// its table's one channel whatever is watched.
    async fn subscribed(&self, scope: &Scope) -> Option<i64> {
        let Held::Redis(_, nodes) = self else {
            return None;
        };
        let channel = self.channel(scope);
        let (urls, counted) = match nodes {
            Nodes::Urls(urls) => (urls.clone(), "NUMSUB"),
            Nodes::Shards(urls) => (urls.clone(), "SHARDNUMSUB"),
            Nodes::Sentinel(sentinels) => (vec![sentinels_primary(sentinels).await], "NUMSUB"),
        };
        let mut count = 0;
        for url in urls {
            let mut connection = redis_connection_to(&url).await;
            count += subscribers_by(&mut connection, counted, &channel).await;
        }
        Some(count)
    }
}

/// The URL of the primary the first answering Sentinel names.
async fn sentinels_primary(sentinels: &[String]) -> String {
    let master = std::env::var("REDIS_SENTINEL_MASTER").expect("REDIS_SENTINEL_MASTER");
    for sentinel in sentinels {
        let Ok(client) = tower_idempotency::redis::Client::open(sentinel.as_str()) else {
            continue;
        };
        let Ok(mut connection) = client.get_multiplexed_async_connection().await else {
            continue;
        };
        let named: Result<(String, String), _> = tower_idempotency::redis::cmd("SENTINEL")
            .arg("GET-MASTER-ADDR-BY-NAME")
            .arg(&master)
            .query_async(&mut connection)
            .await;
        if let Ok((host, port)) = named {
            return format!("redis://{host}:{port}/");
        }
    }
    panic!("no Sentinel at {sentinels:?} names {master}");
}

/// Two instances on one Redis: a duplicate through B waits for the original running
/// through A, woken by A's completion published on Redis; B's waiters share one
/// subscription, which ends with the last of them.
#[tokio::test]
#[ignore = "needs Redis: scripts/test.sh"]
async fn redis_waiters_share_one_subscription_and_leave_none_behind() {
    let (a, b) = redis_instances().await;
    let handler = Handler::default();
    let app_a = router(
        &handler,
        layer(&(Arc::new(a.clone()) as Arc<dyn Store>)).wait_for_original(BOUND),
    );
    let app_b = router(
        &handler,
        layer(&(Arc::new(b.clone()) as Arc<dyn Store>)).wait_for_original(BOUND),
    );
    let original = spawn_send(&app_a, post_waiting("x"));
    until_executing(&handler, 1).await;
    let waiters: Vec<_> = (0..3)
        .map(|_| spawn_send(&app_b, post("/pay").key("x")))
        .collect();
    for waiter in &waiters {
        still_waiting(waiter).await;
    }
    assert_eq!(
        b.watched().await,
        1,
        "one subscription for the key's waiters"
    );
    let mut redis = redis_connection().await;
    let channel = b.announcement_channel(&scope("x"));
    assert_eq!(subscribers(&mut redis, &channel).await, 1);
    handler.gate.add_permits(1);
    let original = original.await.unwrap();
    for waiter in waiters {
        let waiter = waiter.await.unwrap();
        assert!(waiter.replayed());
        assert_eq!(waiter.body, original.body);
    }
    assert_eq!(handler.executions(), 1);
    // The subscription ends with its last waiter, on this side and on Redis's.
    eventually_zero(|| async { b.watched().await }).await;
    eventually_zero(|| async { subscribers(&mut redis_connection().await, &channel).await }).await;

    // A waiter that goes away takes its subscription with it.
    let original = spawn_send(&app_a, post_waiting("y"));
    until_executing(&handler, 2).await;
    let waiter = spawn_send(&app_b, post("/pay").key("y"));
    still_waiting(&waiter).await;
    assert_eq!(b.watched().await, 1);
    waiter.abort();
    eventually_zero(|| async { b.watched().await }).await;
    handler.gate.add_permits(1);
    original.await.unwrap();
}

/// How many clients `server` counts as connected (its `redis-cli` included).
fn connected_clients(server: &RedisServer) -> usize {
    let info = server.cli(&["INFO", "clients"]);
    info.lines()
        .find_map(|line| line.strip_prefix("connected_clients:"))
        .and_then(|count| count.trim().parse().ok())
        .expect("connected_clients in INFO")
}

/// Waits (bounded) for `server`'s connected clients to settle at or below `at_most`:
/// connections close in the background.
async fn clients_settle(server: &RedisServer, at_most: usize, what: &str) {
    let mut now = connected_clients(server);
    for _ in 0..50 {
        if now <= at_most {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        now = connected_clients(server);
    }
    let list = server.cli(&["CLIENT", "LIST"]);
    panic!("{now} clients connected {what}, at most {at_most} expected:\n{list}");
}

/// A subscription Redis refuses (an ACL user without channel rights, Redis 7's default for
/// a new user) gives its pub/sub connection up whole: the waiters fall back on reading
/// their keys, and no connection is left open per watch.
#[tokio::test]
#[ignore = "needs redis-server: scripts/test.sh"]
async fn redis_a_refused_subscription_leaves_no_connection_open() {
    let server = RedisServer::start();
    server.cli(&[
        "ACL",
        "SETUSER",
        "app",
        "on",
        ">pw",
        "~*",
        "+@all",
        "resetchannels",
    ]);
    let url = format!("redis://app:pw@127.0.0.1:{}/", server.port());
    let store = RedisStore::open(&url).await.unwrap().announce_outcomes();
    claim(&store, &scope("warm")).await;
    let before = connected_clients(&server);
    for n in 0..50 {
        let refused = store.watch(&scope(&format!("k{n}"))).await.unwrap();
        assert!(refused.is_none(), "the subscription is refused: no watch");
    }
    clients_settle(&server, before, "after 50 refused watches").await;
}

/// A `SUBSCRIBE` that Redis answers only after the store's timeout gives the connection
/// up whole, and the store connects again afterwards: a watch made before the stall is
/// still woken by another instance's completion, and each stall leaves no connection open.
#[tokio::test]
#[ignore = "needs redis-server: scripts/test.sh"]
async fn redis_a_subscription_answered_late_leaves_no_connection_open() {
    let server = RedisServer::start();
    let a = RedisStore::open(&server.url()).await.unwrap();
    let b = RedisStore::open(&server.url()).await.unwrap();
    let (a, b) = announcing(a, b);
    let held = scope("held");
    let token = claim(&a, &held).await;
    let mut kept = watch(&b, &held).await;
    let before = connected_clients(&server);
    for n in 0..3 {
        // Redis answers nothing for 2.5 s: the store's SUBSCRIBE times out after 2 s.
        server.cli(&["CLIENT", "PAUSE", "2500", "ALL"]);
        let late = b.watch(&scope(&format!("late{n}"))).await.unwrap();
        assert!(late.is_none(), "no watch without a confirmed subscription");
        tokio::time::sleep(Duration::from_millis(800)).await;
        let again = watch(&b, &scope(&format!("again{n}"))).await;
        drop(again);
    }
    clients_settle(&server, before, "after 3 stalls").await;
    // Connecting again woke the kept watch to read its key (what was published during the
    // stall is lost); from then on, it hears the other instance again.
    while tokio::time::timeout(Duration::from_millis(100), kept.changed())
        .await
        .is_ok()
    {}
    complete(&a, &held, token).await;
    woken(
        &mut kept,
        "by the other instance's completion after the stalls",
    )
    .await;
}

async fn redis_connection() -> tower_idempotency::redis::aio::MultiplexedConnection {
    redis_connection_to(&support::redis_url()).await
}

async fn redis_connection_to(url: &str) -> tower_idempotency::redis::aio::MultiplexedConnection {
    let client = tower_idempotency::redis::Client::open(url).unwrap();
    client.get_multiplexed_async_connection().await.unwrap()
}

/// How many connections Redis counts as subscribed to `channel`.
async fn subscribers(
    redis: &mut tower_idempotency::redis::aio::MultiplexedConnection,
    channel: &str,
) -> i64 {
    subscribers_by(redis, "NUMSUB", channel).await
}

/// How many connections this server counts as subscribed to `channel`: as a channel
/// (`NUMSUB`) or as a shard channel (`SHARDNUMSUB`).
async fn subscribers_by(
    redis: &mut tower_idempotency::redis::aio::MultiplexedConnection,
    counted: &str,
    channel: &str,
) -> i64 {
    let counts: Vec<(String, i64)> = tower_idempotency::redis::cmd("PUBSUB")
        .arg(counted)
        .arg(channel)
        .query_async(redis)
        .await
        .unwrap();
    counts.first().map_or(0, |(_, count)| *count)
}

/// Waits (bounded) for `count` to reach zero: subscriptions end in the background.
async fn eventually_zero<F, Fut, N>(mut count: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = N>,
    N: PartialEq + Default + std::fmt::Debug,
{
    let mut last = None;
    for _ in 0..200 {
        let now = count().await;
        if now == N::default() {
            return;
        }
        last = Some(now);
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("still {last:?}");
}

/// Without `announce_outcomes` a Redis store publishes nothing, so it hands out no watch:
/// its waiters read their key again rather than wait for a message that never comes.
#[tokio::test]
#[ignore = "needs Redis: scripts/test.sh"]
async fn redis_without_announcements_hands_out_no_watch() {
    let store = support::redis_store("no_announcements").await;
    assert!(store.watch(&scope("k")).await.unwrap().is_none());
}

/// Without `announce_outcomes` a PostgreSQL store notifies nothing, so it hands out no
/// watch: its waiters read their key again.
#[tokio::test]
#[ignore = "needs PostgreSQL: scripts/test.sh"]
async fn postgres_without_announcements_hands_out_no_watch() {
    let store = support::postgres_store().await;
    assert!(store.watch(&scope("k")).await.unwrap().is_none());
}

// ---------------------------------------------------------------------------------------
// Redis Cluster: shard channels, on the master serving each key's slot.

/// In a cluster a key's announcements stay on its shard: the waiter's instance subscribes
/// to the key's shard channel on the one master serving its slot, and a classic subscriber
/// to the same channel, on any node, hears nothing (a `PUBLISH` would reach every node);
/// the waiter on the other instance is woken all the same.
#[tokio::test]
#[ignore = "needs a Redis Cluster and a Sentinel set: scripts/test.sh"]
async fn redis_cluster_announces_on_the_keys_shard_only() {
    let instances = redis_cluster().await;
    let nodes = support::urls_from("REDIS_CLUSTER_URLS");
    let handler = Handler::default();
    let (a, b) = apps(&instances, &handler);
    let original = spawn_send(&a, post_waiting("shard"));
    until_executing(&handler, 1).await;
    let waiter = spawn_send(&b, post("/pay").key("shard"));
    still_waiting(&waiter).await;
    let channel = instances.held_by_b.channel(&scope("shard"));
    let mut subscribed_on = Vec::new();
    for url in &nodes {
        let mut node = redis_connection_to(url).await;
        match subscribers_by(&mut node, "SHARDNUMSUB", &channel).await {
            0 => {}
            1 => subscribed_on.push(url),
            more => panic!("{more} shard subscribers on {url}"),
        }
    }
    assert_eq!(
        subscribed_on.len(),
        1,
        "one shard subscription, on one node"
    );
    // That node serves the key's slot: it answers for the key, without a redirect.
    let exists: i64 = tower_idempotency::redis::cmd("EXISTS")
        .arg(instances.held_by_b.key(&scope("shard")))
        .query_async(&mut redis_connection_to(subscribed_on[0]).await)
        .await
        .expect("the subscribed node serves the key's slot");
    assert_eq!(exists, 1, "the original's claim is there");
    let mut classic = Vec::new();
    for url in &nodes {
        let client = tower_idempotency::redis::Client::open(url.as_str()).unwrap();
        let mut pubsub = client.get_async_pubsub().await.unwrap();
        pubsub.subscribe(&channel).await.unwrap();
        classic.push(pubsub);
    }
    gets_the_replay_once_the_original_answers(&handler, original, waiter).await;
    for pubsub in &mut classic {
        let mut messages = pubsub.on_message();
        let heard = tokio::time::timeout(Duration::from_millis(200), messages.next()).await;
        assert!(
            heard.is_err(),
            "a classic subscriber heard the announcement"
        );
    }
}

/// The master serving a waited-on key dies: the waiter's instance subscribes again on the
/// replica that takes over, and the completion made there wakes the waiter on the other
/// instance, long before its lease or its bound would have.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs redis-server: scripts/test.sh"]
async fn redis_cluster_waiters_are_woken_after_their_shards_master_fails_over() {
    let cluster = blocking(|| RedisCluster::start(3, 1)).await;
    let open = || async { RedisStore::cluster(cluster.urls()).await.unwrap() };
    let (a, b) = announcing(
        open()
            .await
            .prefix(support::unique_prefix("shard_failover")),
        open().await,
    );
    let b: Arc<dyn Store> = Arc::new(b);
    let handler = Handler::default();
    let long = Duration::from_secs(60);
    let app = router(&handler, layer(&b).wait_for_original(long));
    let token = claim_as_post(&a, "failover", long).await;
    let waiter = spawn_send(&app, post("/pay").key("failover"));
    still_waiting(&waiter).await;
    let channel = a.announcement_channel(&scope("failover"));
    let master = cluster.master_for_key(&channel);
    assert_eq!(shard_subscribers(&cluster, master, &channel), 1);
    let (cluster, promoted) = blocking(move || {
        let mut cluster = cluster;
        cluster.wait_replicated(master);
        cluster.kill(master);
        let promoted = cluster.wait_for_failover(master);
        (cluster, promoted)
    })
    .await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while shard_subscribers(&cluster, promoted, &channel) != 1 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "never subscribed again on the promoted replica"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(!waiter.is_finished(), "still waiting through the failover");
    // The holder completes on the new master, once its own connection has found it.
    let scope = scope("failover");
    let response = StoredResponse {
        status: StatusCode::CREATED,
        headers: Default::default(),
        body: "done".into(),
        trailers: None,
    };
    let fingerprint = support::app::post_fingerprint();
    loop {
        match a
            .complete(&scope, token, fingerprint, &response, long)
            .await
        {
            Ok(completed) => {
                assert_eq!(completed, Fenced::Applied);
                break;
            }
            Err(error) => {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "never completed: {error}"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
    let waiter = tokio::time::timeout(WOKEN_WITHIN, waiter)
        .await
        .expect("woken by the completion on the new master")
        .unwrap();
    assert!(waiter.replayed());
    assert_eq!(
        (waiter.status, &waiter.body[..]),
        (StatusCode::CREATED, &b"done"[..])
    );
    assert_eq!(handler.executions(), 0);
}

/// How many connections `port` counts as subscribed to the shard channel `channel`.
fn shard_subscribers(cluster: &RedisCluster, port: u16, channel: &str) -> i64 {
    let counted = cluster.cli(port, &["PUBSUB", "SHARDNUMSUB", channel]);
    counted
        .lines()
        .nth(1)
        .and_then(|count| count.trim().parse().ok())
        .unwrap_or_else(|| panic!("PUBSUB SHARDNUMSUB on port {port}: {counted}"))
}

/// Runs blocking code (a topology starting, failing over) off the runtime's workers; a
/// panic in it fails the test with its own message.
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    match tokio::task::spawn_blocking(f).await {
        Ok(value) => value,
        Err(error) => std::panic::resume_unwind(error.into_panic()),
    }
}
