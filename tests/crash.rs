//! A holder that crashes, with real processes. Two `payments` example binaries share a
//! store: process A takes a slow payment and is killed (SIGKILL) while its handler runs, so
//! nothing releases its key. Process B must answer `409` to the retry while A's lease runs,
//! then execute the retry once, after the lease ran out. A holder that stays alive renews
//! its lease, so B never executes a payment A is still running, however long it takes.
//!
//! Redis is the suite's shared server (`REDIS_URL`, else 127.0.0.1:6379); keys and users
//! are unique, and the records expire after [`TTL_SECS`]. PostgreSQL runs in a database of
//! the test's own on the shared server (`DATABASE_URL`, else the local default), where the
//! example migrates its `public.idempotency_keys`; the database is dropped at the end.

mod support;

use std::{net::SocketAddr, time::Duration};

use serde_json::Value;
use support::payments::{
    eventually_within, fresh_key, raw_payment, slow_charge, Api, ExampleProcess, Reply, DEADLINE,
};
use tokio::{io::AsyncWriteExt, net::TcpStream, task::JoinHandle, time::Instant};

/// The lease of the crash tests, in seconds: a crashed holder's key is taken for this long.
const CRASH_LEASE_SECS: u64 = 3;
/// How long a crashed holder's key may stay taken before the test fails: the lease, and slack.
const TAKEOVER_DEADLINE: Duration = Duration::from_secs(15);
/// How long completed records are kept: enough for a test, short enough not to linger.
const TTL_SECS: &str = "120";

// ---------------------------------------------------------------------------------------
// The tests.
// ---------------------------------------------------------------------------------------

#[tokio::test]
#[ignore = "needs Redis: scripts/test.sh"]
async fn redis_crashed_holder_frees_its_key_after_the_lease() {
    crashed_holder_frees_its_key_after_the_lease(("REDIS_URL", &support::redis_url())).await;
}

#[tokio::test]
#[ignore = "needs PostgreSQL: scripts/test.sh"]
async fn postgres_crashed_holder_frees_its_key_after_the_lease() {
    let database = Database::create().await;
    crashed_holder_frees_its_key_after_the_lease(("DATABASE_URL", database.url())).await;
}

/// With a 2 s lease, a 7 s handler on A (more than three leases) keeps its key: B is told
/// to wait at ~3 s and ~6 s, never executes, and replays A's answer once A is done.
#[tokio::test]
#[ignore = "needs Redis: scripts/test.sh"]
async fn redis_long_handler_stays_protected_while_its_holder_lives() {
    let (a, b) = start_two(("REDIS_URL", &support::redis_url()), 2).await;
    let payment = Payment::slow(Duration::from_secs(7));

    let first = payment.send_in_background(a.api());
    a.api().wait_for_payments(1).await;
    let started = Instant::now();
    for secs in [3, 6] {
        tokio::time::sleep_until(started + Duration::from_secs(secs)).await;
        payment.send(b.api()).await.assert_in_progress();
        assert_payments(b.api(), 0).await;
    }

    let first = first.await.expect("A's answer");
    first.assert_fresh();
    first.assert_payment(700, "usd");
    payment.send(b.api()).await.assert_replay_of(&first);
    assert_payments(b.api(), 0).await;
    assert_payments(a.api(), 1).await;
}

/// The window that only a transaction closes: a payment's ledger row commits on its own,
/// apart from its idempotency record. Payments killed after their row and before their
/// record leave the row, and each retry, once the lease ran out, writes another.
#[tokio::test]
#[ignore = "needs PostgreSQL: scripts/test.sh"]
async fn postgres_ledger_rows_written_before_a_crash_are_written_again_by_the_retry() {
    let database = Database::create().await;
    let crash = LedgerCrash::start(&database, false).await;
    eventually_within(DEADLINE, "every row written", async || {
        (crash.rows().await == LedgerCrash::IN_FLIGHT).then_some(())
    })
    .await;
    let crash = crash.kill_a().await;

    // The client retries each payment on B until A's lease ran out and B executed it.
    let retries = crash.retries_on_b(TAKEOVER_DEADLINE, "the lease to run out", 200);
    for reply in retries.await {
        reply.assert_payment(1999, "usd");
    }
    assert_eq!(
        crash.rows().await,
        2 * LedgerCrash::IN_FLIGHT,
        "each payment in flight at the crash has two ledger rows"
    );
}

/// The same crash in the transactional mode: the rows of the payments killed in flight were
/// rolled back with their claims, and each retry, at once, writes the one row its payment
/// has.
#[cfg(feature = "sqlx")]
#[tokio::test]
#[ignore = "needs PostgreSQL: scripts/test.sh"]
async fn postgres_transactional_ledger_rows_are_written_once_across_a_crash() {
    let database = Database::create().await;
    let crash = LedgerCrash::start(&database, true).await;
    // Uncommitted rows are invisible: each transaction that inserted one holds the table's
    // row-exclusive lock until it ends.
    eventually_within(DEADLINE, "every row inserted", async || {
        let row = crash.ledger.query_one(
            "SELECT count(*) FROM pg_locks
             WHERE relation = 'payments'::regclass AND mode = 'RowExclusiveLock' AND granted",
            &[],
        );
        let inserting: i64 = row.await.expect("pg_locks").get(0);
        (inserting == LedgerCrash::IN_FLIGHT).then_some(())
    })
    .await;
    let crash = crash.kill_a().await;
    assert_eq!(
        crash.rows().await,
        0,
        "a killed transaction committed its row"
    );

    // The database rolled A's transactions back as its connections closed: B executes the
    // retries without waiting for a lease.
    let retries = crash.retries_on_b(DEADLINE, "A's transactions to end", 50);
    for reply in retries.await {
        reply.assert_fresh();
        reply.assert_payment(1999, "usd");
    }
    assert_eq!(
        crash.rows().await,
        LedgerCrash::IN_FLIGHT,
        "each payment in flight at the crash has one ledger row"
    );
    assert_ledger_matches_records(&crash.ledger).await;
}

/// Two instances of the example with its ledger on a database of their own, and five
/// payments on A that write their row first and answer five seconds later: A is to be
/// killed in between.
struct LedgerCrash {
    a: ExampleProcess,
    b: ExampleProcess,
    charge: Value,
    keys: Vec<String>,
    firsts: Vec<JoinHandle<Reply>>,
    ledger: tokio_postgres::Client,
}

impl LedgerCrash {
    const IN_FLIGHT: i64 = 5;

    async fn start(database: &Database, transactional: bool) -> Self {
        let lease = CRASH_LEASE_SECS.to_string();
        let mut env = vec![
            ("DATABASE_URL", database.url()),
            ("PAYMENTS_LEDGER", "postgres"),
            ("IDEMPOTENCY_LEASE_SECS", &lease),
            ("IDEMPOTENCY_TTL_SECS", TTL_SECS),
        ];
        if transactional {
            env.push(("IDEMPOTENCY_TRANSACTIONAL", "1"));
        }
        let a = ExampleProcess::start(&env).await;
        let b = a.start_another().await;
        let charge = serde_json::json!({
            "amount": 1999, "currency": "usd", "simulate": "slow_after", "delay_ms": 5000
        });
        let keys: Vec<String> = (0..Self::IN_FLIGHT).map(|_| fresh_key()).collect();
        let firsts = keys
            .iter()
            .map(|key| a.api().pay_in_background(key, "carol", &charge))
            .collect();
        let ledger = support::store_client(database.url()).await;
        Self {
            a,
            b,
            charge,
            keys,
            firsts,
            ledger,
        }
    }

    /// The ledger's committed rows.
    async fn rows(&self) -> i64 {
        let row = self.ledger.query_one("SELECT count(*) FROM payments", &[]);
        row.await.expect("the ledger").get(0)
    }

    /// Kills A, whose payments then never answer.
    async fn kill_a(mut self) -> Self {
        self.a.kill();
        for first in self.firsts.drain(..) {
            assert!(first.await.is_err(), "the killed process answered");
        }
        self
    }

    /// Each payment sent again on B until it is no longer in progress (within `limit`,
    /// waiting `pause_ms` between tries): the answers.
    async fn retries_on_b(&self, limit: Duration, what: &str, pause_ms: u64) -> Vec<Reply> {
        let retries = self.keys.iter().map(|key| {
            let (api, charge) = (self.b.api().clone(), self.charge.clone());
            async move {
                eventually_within(limit, what, async || {
                    let reply = api.pay(key, "carol", &charge).await;
                    if reply.error_code().as_deref() == Some("request_in_progress") {
                        tokio::time::sleep(Duration::from_millis(pause_ms)).await;
                        return None;
                    }
                    Some(reply)
                })
                .await
            }
        });
        futures_util::future::join_all(retries).await
    }
}

/// Killed after its commit, before its client read the answer: the retry replays the
/// committed payment, and the ledger keeps its one row.
#[cfg(feature = "sqlx")]
#[tokio::test]
#[ignore = "needs PostgreSQL: scripts/test.sh"]
async fn postgres_transactional_a_payment_committed_before_the_crash_replays_after_it() {
    let database = Database::create().await;
    let env = transactional_ledger(&database);
    let mut a = ExampleProcess::start(&env).await;
    let b = a.start_another().await;
    let payment = Payment::slow(Duration::ZERO);
    // Sent, never read: whatever A answered is lost with it.
    let connection = payment.send_unanswered(a.addr()).await;
    let ledger = support::store_client(database.url()).await;
    let committed = eventually_within(DEADLINE, "the payment to commit", async || {
        let rows = ledger.query("SELECT id FROM payments", &[]).await;
        let ids: Vec<String> = rows
            .expect("the ledger")
            .iter()
            .map(|row| row.get(0))
            .collect();
        ids.into_iter().next()
    })
    .await;
    a.kill();
    drop(connection);

    let retry = payment.send(b.api()).await;
    assert!(retry.replayed(), "{retry:?}");
    assert_eq!(retry.assert_payment(700, "usd"), committed);
    assert_payments(b.api(), 0).await;
    let rows: i64 = ledger
        .query_one("SELECT count(*) FROM payments", &[])
        .await
        .expect("the ledger")
        .get(0);
    assert_eq!(rows, 1);
    assert_ledger_matches_records(&ledger).await;
}

/// Payments under retrying load on two instances, one of them killed three times at
/// arbitrary points (between a handler's insert and its commit, between a commit and its
/// answer, anywhere) and started again: every payment ends answered `201`, and the ledger
/// holds exactly one row per payment, the one its answer names.
#[cfg(feature = "sqlx")]
#[tokio::test]
#[ignore = "needs PostgreSQL: scripts/test.sh"]
async fn postgres_transactional_payments_under_retrying_load_survive_kills_exactly_once() {
    const CLIENTS: usize = 8;
    let database = Database::create().await;
    let env = transactional_ledger(&database);
    let b = ExampleProcess::start(&env).await;
    let mut a = b.start_another().await;
    let a_api = std::sync::Arc::new(std::sync::Mutex::new(a.api().clone()));
    // A little work after the insert widens the window between it and the commit.
    let charge = serde_json::json!({
        "amount": 500, "currency": "usd", "simulate": "slow_after", "delay_ms": 30
    });
    // The clients start payments until the kills are over.
    let killing = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let clients = (0..CLIENTS).map(|_| {
        let (a_api, b_api, charge) = (a_api.clone(), b.api().clone(), charge.clone());
        let killing = killing.clone();
        tokio::spawn(async move {
            let mut answered = Vec::new();
            while killing.load(std::sync::atomic::Ordering::Relaxed) {
                let key = fresh_key();
                // First to A, whichever A is alive; retries alternate with B.
                let mut attempt = 0;
                let reply = loop {
                    let api = if attempt % 2 == 0 {
                        a_api.lock().unwrap().clone()
                    } else {
                        b_api.clone()
                    };
                    attempt += 1;
                    assert!(attempt < 400, "payment {key} was never answered 201");
                    let post = api.post("/v1/payments").key(&key).user("dave");
                    match post.json(&charge).try_send().await {
                        Some(reply) if reply.status.as_u16() == 201 => break reply,
                        // 409 in progress, 503 (a commit that failed), or a dead instance.
                        _ => tokio::time::sleep(Duration::from_millis(25)).await,
                    }
                };
                answered.push((key, reply.assert_payment(500, "usd")));
            }
            answered
        })
    });
    let clients: Vec<_> = clients.collect();
    for _ in 0..3 {
        tokio::time::sleep(Duration::from_millis(700)).await;
        a.kill();
        a = b.start_another().await;
        *a_api.lock().unwrap() = a.api().clone();
    }
    killing.store(false, std::sync::atomic::Ordering::Relaxed);
    let mut ids = Vec::new();
    for client in clients {
        ids.extend(
            client
                .await
                .expect("a client")
                .into_iter()
                .map(|(_, id)| id),
        );
    }
    ids.sort();
    let ledger = support::store_client(database.url()).await;
    let rows = ledger
        .query("SELECT id FROM payments ORDER BY id", &[])
        .await
        .expect("the ledger");
    let rows: Vec<String> = rows.iter().map(|row| row.get(0)).collect();
    let extra: Vec<_> = rows
        .iter()
        .filter(|id| ids.binary_search(id).is_err())
        .collect();
    assert!(
        rows == ids,
        "the ledger holds {} rows for {} payments answered; rows no answer names: {extra:?}",
        rows.len(),
        ids.len()
    );
    assert_ledger_matches_records(&ledger).await;
}

/// The example with its ledger in the transactional mode (sqlx), on `database`.
#[cfg(feature = "sqlx")]
fn transactional_ledger(database: &Database) -> [(&'static str, &str); 4] {
    [
        ("DATABASE_URL", database.url()),
        ("PAYMENTS_LEDGER", "postgres"),
        ("IDEMPOTENCY_TRANSACTIONAL", "1"),
        ("IDEMPOTENCY_TTL_SECS", TTL_SECS),
    ]
}

/// Every ledger row is a completed operation's, and every completed payment has one row.
#[cfg(feature = "sqlx")]
async fn assert_ledger_matches_records(ledger: &tokio_postgres::Client) {
    let row = ledger
        .query_one(
            "SELECT
                (SELECT count(*) FROM payments p WHERE NOT EXISTS (
                    SELECT 1 FROM public.idempotency_keys k
                    WHERE k.resource_id = p.id AND k.status = 'completed')),
                (SELECT count(*) FROM public.idempotency_keys k
                 WHERE k.status = 'completed' AND k.endpoint LIKE '%/v1/payments'
                   AND NOT EXISTS (SELECT 1 FROM payments p WHERE p.id = k.resource_id)),
                (SELECT count(*) FROM public.idempotency_keys WHERE status = 'in_progress')",
            &[],
        )
        .await
        .expect("the ledger and the records");
    let (orphans, unwritten, in_progress): (i64, i64, i64) = (row.get(0), row.get(1), row.get(2));
    assert_eq!(orphans, 0, "ledger rows that belong to no operation");
    assert_eq!(unwritten, 0, "completed payments without their ledger row");
    assert_eq!(in_progress, 0, "claims committed in progress");
}

// ---------------------------------------------------------------------------------------
// The crash, on any store.
// ---------------------------------------------------------------------------------------

/// A is killed while it executes; B, on the same `store`, takes the key over only after
/// A's lease ran out, executes the retry once, and replays it afterwards.
async fn crashed_holder_frees_its_key_after_the_lease(store: (&str, &str)) {
    // B starts before the crash: its start-up must not eat into A's lease.
    let (mut a, b) = start_two(store, CRASH_LEASE_SECS).await;
    // Long enough to be running when A is killed, and short enough that B's takeover needs
    // a handful of renewals of its 3 s lease, not twenty: on a loaded machine, one renewal
    // late by two seconds loses the lease, and with it the record (as the layer warns).
    let payment = Payment::slow(Duration::from_secs(8));

    let connection = payment.send_unanswered(a.addr()).await;
    a.api().wait_for_payments(1).await;
    a.kill();
    drop(connection);

    // A's lease still runs: B must not execute.
    let retry_after = payment.send(b.api()).await.assert_in_progress();
    assert!(
        retry_after <= CRASH_LEASE_SECS,
        "retry_after {retry_after} with a {CRASH_LEASE_SECS} s lease"
    );
    assert_payments(b.api(), 0).await;

    // The retry that gets through runs the whole slow handler on B: `Payment::send` waits
    // for it.
    let taken_over = eventually_within(
        TAKEOVER_DEADLINE,
        "the crashed holder's lease to run out",
        async || {
            let reply = payment.send(b.api()).await;
            if reply.error_code().as_deref() != Some("request_in_progress") {
                return Some(reply);
            }
            reply.assert_in_progress();
            assert_payments(b.api(), 0).await;
            None
        },
    )
    .await;
    taken_over.assert_fresh();
    taken_over.assert_payment(700, "usd");
    assert_payments(b.api(), 1).await;

    payment.send(b.api()).await.assert_replay_of(&taken_over);
    assert_payments(b.api(), 1).await;
}

// ---------------------------------------------------------------------------------------
// Helpers.
// ---------------------------------------------------------------------------------------

/// Two example processes on `store` (`("REDIS_URL", url)` or `("DATABASE_URL", url)`) with
/// a lease of `lease_secs`.
async fn start_two(store: (&str, &str), lease_secs: u64) -> (ExampleProcess, ExampleProcess) {
    let lease_secs = lease_secs.to_string();
    let env = [
        store,
        ("IDEMPOTENCY_LEASE_SECS", &lease_secs),
        ("IDEMPOTENCY_TTL_SECS", TTL_SECS),
    ];
    let a = ExampleProcess::start(&env).await;
    let b = a.start_another().await;
    (a, b)
}

async fn assert_payments(api: &Api, executed: u64) {
    let stats = api.stats().await;
    assert_eq!(
        stats.payments_executed,
        executed,
        "payment executions on {}",
        api.addr()
    );
}

/// One payment as a client retries it: the same key, user and body every time.
#[derive(Clone)]
struct Payment {
    key: String,
    user: String,
    body: Value,
    delay: Duration,
}

impl Payment {
    /// A payment with a key and a user of its own, whose handler sleeps `delay`.
    fn slow(delay: Duration) -> Self {
        let delay_ms = u64::try_from(delay.as_millis()).expect("a delay in milliseconds");
        Self {
            key: fresh_key(),
            user: format!("crash-{:016x}", rand::random::<u64>()),
            body: slow_charge(delay_ms),
            delay,
        }
    }

    /// Sends it and waits for the answer, for as long as the handler may sleep and then
    /// [`DEADLINE`].
    async fn send(&self, api: &Api) -> Reply {
        api.post("/v1/payments")
            .key(&self.key)
            .user(&self.user)
            .json(&self.body)
            .timeout(self.delay + DEADLINE)
            .send()
            .await
    }

    /// [`Payment::send`] in a task of its own.
    fn send_in_background(&self, api: &Api) -> JoinHandle<Reply> {
        let (payment, api) = (self.clone(), api.clone());
        tokio::spawn(async move { payment.send(&api).await })
    }

    /// Sends it on a connection of its own and returns the connection unread: for a
    /// server that will not live to answer.
    async fn send_unanswered(&self, addr: SocketAddr) -> TcpStream {
        let mut connection = TcpStream::connect(addr).await.expect("connect");
        connection
            .write_all(&raw_payment(&self.key, &self.user, &self.body))
            .await
            .expect("send the payment");
        connection
    }
}

/// A database of the test's own on the shared PostgreSQL server; dropped, with any
/// connections still open to it, when this is.
struct Database {
    name: String,
    url: String,
}

impl Database {
    async fn create() -> Self {
        let server = support::database_url();
        let name = format!("idempotency_crash_{:016x}", rand::random::<u64>());
        support::store_client(&server)
            .await
            .batch_execute(&format!("CREATE DATABASE {name}"))
            .await
            .unwrap_or_else(|e| panic!("CREATE DATABASE {name} on {server}: {e}"));
        let url = with_database(&server, &name);
        Self { name, url }
    }

    fn url(&self) -> &str {
        &self.url
    }
}

impl Drop for Database {
    fn drop(&mut self) {
        // `drop` cannot await, and blocking the test's runtime on a future of its own would
        // stall it: drop the database from a thread with a runtime of its own.
        let sql = format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.name);
        let dropped = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("a runtime");
            runtime.block_on(async {
                let client = support::store_client(&support::database_url()).await;
                client.batch_execute(&sql).await.map_err(|e| e.to_string())
            })
        })
        .join();
        if !matches!(dropped, Ok(Ok(()))) {
            eprintln!("could not drop the database {}: {dropped:?}", self.name);
        }
    }
}

/// `url` (`postgres://user@host:port/db?options`) naming the database `name` instead.
fn with_database(url: &str, name: &str) -> String {
    let (base, options) = url
        .split_once('?')
        .map_or((url, None), |(b, o)| (b, Some(o)));
    let host = base
        .find("://")
        .unwrap_or_else(|| panic!("DATABASE_URL {url} is not a postgres:// URL"))
        + 3;
    let server = base[host..]
        .find('/')
        .map_or(base, |slash| &base[..host + slash]);
    match options {
        Some(options) => format!("{server}/{name}?{options}"),
        None => format!("{server}/{name}"),
    }
}
