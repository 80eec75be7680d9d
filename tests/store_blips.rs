//! Store blips while payments run: the `payments` example's router, served in-process over
//! real HTTP, takes a storm of slow payments whose clients retry with the same key until
//! they get their `201`, while the store goes away under it: a persistent Redis killed
//! (SIGKILL) and restarted, or every PostgreSQL connection of the store terminated while
//! its table is locked. A completion the store fails after the handler ran is written again
//! until the store answers, so no payment executes twice and every one replays afterwards.
//! And a graceful shutdown can wait for an execution whose client went away to record its
//! outcome.
//!
//! Each test has keys of its own: a private Redis, a PostgreSQL table of its own (and its
//! own connections, by application name), or a unique prefix on the shared Redis.

#[path = "../examples/payments/app.rs"]
#[allow(dead_code)] // The tests serve its router; its `main` uses the rest.
mod app;
mod support;

use std::{
    collections::{HashMap, HashSet},
    net::SocketAddr,
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc, Mutex,
    },
    time::Duration,
};

use async_trait::async_trait;
use axum::http::HeaderValue;
use reqwest::{header::RETRY_AFTER, StatusCode};
use serde_json::Value;
use support::{
    payments::{assert_id, fresh_key, raw_payment, slow_charge, Api, Reply},
    redis_server::RedisServer,
};
use tokio::{
    io::AsyncWriteExt,
    net::{TcpListener, TcpStream},
    sync::oneshot,
    task::JoinHandle,
    time::{sleep, sleep_until, timeout, Instant},
};
use tower_idempotency::{
    store::{self, Claim, Fenced},
    ClaimToken, Fingerprint, IdempotencyKey, MemoryStore, PostgresStore, RedisStore, Scope, Store,
    StoredResponse,
};

/// Logical payments in a storm, each with a key of its own and a client of its own.
const PAYMENTS: usize = 48;
/// A new payment starts this often, whatever became of the others: with the handlers'
/// delays about 18 run at once, and more while the store is away.
const ARRIVAL_EVERY: Duration = Duration::from_millis(30);
/// The fewest payments the storm must have had in flight at once.
const CONCURRENCY: usize = 16;
/// The storm's handlers sleep from this long to this plus [`DELAY_SPREAD_MS`]: long enough
/// that many are asleep when the store goes away, and finish while it is gone.
const MIN_DELAY_MS: u64 = 300;
const DELAY_SPREAD_MS: u64 = 500;
/// The store goes away once the handler has been entered this often: payments keep
/// arriving, and those of the last half second or so are in their handlers.
const OUTAGE_AFTER_EXECUTIONS: u64 = 20;
/// A client pauses this long (plus up to as long again) after a failed connection, and
/// honours `Retry-After` up to [`MAX_RETRY_AFTER`].
const RETRY_PAUSE: Duration = Duration::from_millis(100);
const MAX_RETRY_AFTER: Duration = Duration::from_secs(1);
/// A logical payment that has no `201` by then fails the test.
const PAYMENT_DEADLINE: Duration = Duration::from_secs(60);
/// A bound on any one request.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(20);
/// How long executions may take to settle once every client has its answer.
const SETTLE_LIMIT: Duration = Duration::from_secs(10);
/// The endpoint part of a payment's scope.
const PAYMENTS_ENDPOINT: &str = "POST /v1/payments";
/// The layer's default lease, which the example keeps.
const LEASE: Duration = Duration::from_secs(30);

// ---------------------------------------------------------------------------------------
// The tests.
// ---------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread")]
#[ignore = "needs redis-server: scripts/test.sh"]
async fn redis_restarted_mid_storm_executes_nothing_twice_gap_500ms() {
    redis_restarted_mid_storm_executes_nothing_twice(Duration::from_millis(500)).await;
}

#[tokio::test(flavor = "multi_thread")]
#[ignore = "needs redis-server: scripts/test.sh"]
async fn redis_restarted_mid_storm_executes_nothing_twice_gap_2s() {
    redis_restarted_mid_storm_executes_nothing_twice(Duration::from_secs(2)).await;
}

/// A persistent Redis (every write synced to its append-only file before it answers) is
/// killed while many handlers sleep, and started again after `gap` with what it had
/// acknowledged: the claims, and the completions of payments that finished before.
async fn redis_restarted_mid_storm_executes_nothing_twice(gap: Duration) {
    let server = blocking(RedisServer::start_persistent).await;
    let redis = RedisStore::open(&server.url())
        .await
        .unwrap_or_else(|e| panic!("the test's own Redis at {}: {e}", server.url()));
    let outage = async move {
        let mut server = server;
        server = blocking(move || {
            server.stop();
            server
        })
        .await;
        sleep(gap).await;
        blocking(move || {
            server.restart();
            server
        })
        .await
    };
    let (report, _server) = storm_through(Arc::new(redis), outage).await;
    println!("redis, {gap:?} down: {report}");
}

/// While many handlers sleep, the test's table is locked for about a second (every
/// statement on it waits) and the store's connections, told apart from every other test's
/// by their application name, are terminated every [`TERMINATE_EVERY`]: whatever the store
/// sends meanwhile fails, its retries included, as in a failover. Without the lock a
/// statement takes a millisecond, and a termination would hardly ever catch one.
#[tokio::test(flavor = "multi_thread")]
#[ignore = "needs PostgreSQL: scripts/test.sh"]
async fn postgres_connections_terminated_mid_storm_execute_nothing_twice() {
    let application = format!("store_blips_{:016x}", rand::random::<u64>());
    let store = postgres_store(&application).await;
    let table = store.table_name().to_owned();
    // Two connections: the lock's transaction would read `pg_stat_activity` once, then keep
    // that snapshot.
    let locker = support::store_client(&support::database_url()).await;
    let killer = support::store_client(&support::database_url()).await;
    let outage = async move {
        locker
            .batch_execute(&format!(
                "BEGIN; LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE"
            ))
            .await
            .expect("lock the test's table");
        let mut terminated = 0;
        for _ in 0..TERMINATIONS {
            sleep(TERMINATE_EVERY).await;
            terminated += terminate_backends(&killer, &application).await;
        }
        locker.batch_execute("ROLLBACK").await.expect("unlock");
        assert!(terminated > 0, "no connection of the store was terminated");
        terminated
    };
    let (report, terminated) = storm_through(Arc::new(store), outage).await;
    println!("postgres, {terminated} connections terminated: {report}");
}

#[tokio::test(flavor = "multi_thread")]
async fn graceful_shutdown_waits_for_detached_executions_memory() {
    graceful_shutdown_waits_for_detached_executions(Arc::new(MemoryStore::new())).await;
}

#[tokio::test(flavor = "multi_thread")]
#[ignore = "needs Redis: scripts/test.sh"]
async fn graceful_shutdown_waits_for_detached_executions_redis() {
    let store = support::redis_store("graceful_shutdown_waits_for_detached_executions").await;
    graceful_shutdown_waits_for_detached_executions(Arc::new(store)).await;
}

/// A slow payment whose client went away is still running when the server has shut down
/// gracefully; the server's `in_flight` waits for its record, which is then replayed.
async fn graceful_shutdown_waits_for_detached_executions(store: Arc<dyn Store>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("local address");
    let (router, stats) = app::router(store.clone(), app::Settings::default());
    let (shut_down, shutdown) = oneshot::channel::<()>();
    let server = tokio::spawn(async move {
        axum::serve(listener, router)
            .with_graceful_shutdown(async {
                let _ = shutdown.await;
            })
            .await
    });
    let user = unique_user();
    let key = fresh_key();
    let slow = slow_charge(800);

    // The client sends the payment and goes away 100 ms later: the execution detaches.
    let sent = Instant::now();
    let mut socket = TcpStream::connect(addr).await.expect("connect");
    socket
        .write_all(&raw_payment(&key, &user, &slow))
        .await
        .expect("send the payment");
    wait_for(Duration::from_secs(5), "the payment to start", || {
        stats.payments.load(Ordering::SeqCst) == 1
    })
    .await;
    sleep(Duration::from_millis(100).saturating_sub(sent.elapsed())).await;
    drop(socket);

    let _ = shut_down.send(());
    timeout(Duration::from_secs(5), server)
        .await
        .expect("the server stops without waiting for the detached execution")
        .expect("server task")
        .expect("serve");
    let stopped = Instant::now();
    assert_eq!(
        stats.in_flight.count(),
        1,
        "the detached execution holds its key after the server stopped"
    );
    let scope = payment_scope(&user, &key);
    let probe = Fingerprint::from_bytes([0; 32]);
    match store.claim(&scope, probe, LEASE).await {
        Ok(Claim::InProgress { .. }) => {}
        other => panic!("the payment is still running, yet its key is {other:?}"),
    }

    assert!(
        stats.in_flight.settled(Duration::from_secs(5)).await,
        "{} executions still unrecorded",
        stats.in_flight.count()
    );
    assert!(
        stopped.elapsed() >= Duration::from_millis(200),
        "settled after {:?}: it did not wait for the handler",
        stopped.elapsed()
    );
    let recorded = match store.claim(&scope, probe, LEASE).await {
        Ok(Claim::Completed { response, .. }) => response,
        other => panic!("once settled, the payment's key is {other:?}"),
    };
    assert_eq!(recorded.status.as_u16(), 201, "{recorded:?}");
    let recorded: Value = serde_json::from_slice(&recorded.body).expect("a JSON record");
    let id = assert_id(&recorded["id"], "pay_");

    // Served again over the same store, the payment is a replay of that record.
    let (api, again, _server) = serve(store).await;
    let replay = api.pay(&key, &user, &slow).await;
    assert!(replay.replayed(), "the retry executed again: {replay:?}");
    assert_eq!(replay.assert_payment(700, "usd"), id);
    assert_eq!(stats.payments.load(Ordering::SeqCst), 1);
    assert_eq!(again.payments.load(Ordering::SeqCst), 0);
}

// ---------------------------------------------------------------------------------------
// The storm.
// ---------------------------------------------------------------------------------------

/// Serves the payments router over `store` and runs the storm through `outage`, which
/// starts once the storm is under way; then checks that every payment got its `201`, ran
/// once, had its completion recorded and replays. Returns what happened, and what the
/// outage returned.
async fn storm_through<O>(
    store: Arc<dyn Store>,
    outage: impl std::future::Future<Output = O>,
) -> (Report, O) {
    let started = Instant::now();
    let store = Arc::new(Watched::new(store));
    let (api, stats, _server) = serve(store.clone()).await;
    let user = unique_user();
    let payments: Arc<Vec<Payment>> = Arc::new((0..PAYMENTS).map(Payment::new).collect());
    let http = reqwest::Client::builder()
        .no_proxy()
        .timeout(REQUEST_TIMEOUT)
        .build()
        .expect("HTTP client");

    let (active, most_active) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let clients: Vec<JoinHandle<Paid>> = (0..PAYMENTS)
        .map(|i| {
            let (http, user, payments) = (http.clone(), user.clone(), payments.clone());
            let (active, most_active) = (active.clone(), most_active.clone());
            let (addr, arrival) = (api.addr(), started + ARRIVAL_EVERY * i as u32);
            tokio::spawn(async move {
                sleep_until(arrival).await;
                let now_active = active.fetch_add(1, Ordering::SeqCst) + 1;
                most_active.fetch_max(now_active, Ordering::SeqCst);
                let paid = pay_until_created(&http, addr, &user, &payments[i]).await;
                active.fetch_sub(1, Ordering::SeqCst);
                paid
            })
        })
        .collect();

    wait_for(
        Duration::from_secs(20),
        "the storm to get under way",
        || stats.payments.load(Ordering::SeqCst) >= OUTAGE_AFTER_EXECUTIONS,
    )
    .await;
    let holding_at_outage = stats.in_flight.count();
    let outage_started = started.elapsed();
    let outage = outage.await;
    let outage_ended = started.elapsed();

    let mut replies = Vec::with_capacity(PAYMENTS);
    for client in clients {
        replies.push(client.await.expect("client task"));
    }
    let stormed = started.elapsed();
    let most_active = most_active.load(Ordering::SeqCst);
    assert!(
        most_active >= CONCURRENCY,
        "at most {most_active} payments in flight at once"
    );

    // Every payment ran once, and its completion was recorded: the outage hit some, which
    // were written again until the store took them.
    assert_eq!(
        stats.payments.load(Ordering::SeqCst),
        PAYMENTS as u64,
        "payment executions for {PAYMENTS} payments"
    );
    let completions = store.completions();
    assert_eq!(completions.len(), PAYMENTS, "completions: {completions:?}");
    let unrecorded: Vec<_> = completions
        .iter()
        .filter(|attempts| attempts.answered != Some(Fenced::Applied))
        .collect();
    assert!(
        unrecorded.is_empty(),
        "completions never recorded: {unrecorded:?}"
    );
    let retried = completions
        .iter()
        .filter(|attempts| attempts.failed > 0)
        .count();
    assert!(
        retried > 0,
        "no completion was written during the outage ({holding_at_outage} executions held a \
         key when it began): the test missed its point"
    );

    // Each client's 201 came once its payment was recorded, and is that record, replayed
    // to a retry.
    let mut ids = HashSet::new();
    for (payment, paid) in payments.iter().zip(&replies) {
        let id = paid.reply.assert_payment(700, "usd");
        assert!(ids.insert(id.clone()), "payment id {id} answered twice");
        let attempts: Vec<_> = completions
            .iter()
            .filter(|attempts| attempts.key == payment.key)
            .collect();
        assert!(
            attempts
                .iter()
                .any(|attempts| attempts.applied.is_some_and(|at| at <= paid.answered)),
            "payment {} was answered before it was recorded: {attempts:?}",
            payment.key
        );
        let replay = api.pay(&payment.key, &user, &payment.charge).await;
        assert!(
            replay.replayed(),
            "payment {} sent again after the storm: {replay:?}; its completions: {attempts:?}",
            payment.key
        );
        replay.assert_replay_of(&paid.reply);
        assert_eq!(replay.assert_payment(700, "usd"), id);
    }
    assert_eq!(stats.payments.load(Ordering::SeqCst), PAYMENTS as u64);
    assert!(
        stats.in_flight.settled(SETTLE_LIMIT).await,
        "{} executions still hold a key",
        stats.in_flight.count()
    );

    let report = Report {
        most_active,
        holding_at_outage,
        outage: outage_started..outage_ended,
        stormed,
        retried_completions: retried,
        most_failed_attempts: completions.iter().map(|a| a.failed).max().unwrap_or(0),
        unavailable: replies.iter().map(|paid| paid.unavailable).sum(),
        in_progress: replies.iter().map(|paid| paid.in_progress).sum(),
        failed: replies.iter().map(|paid| paid.failed).sum(),
        total: started.elapsed(),
    };
    (report, outage)
}

/// One logical payment: its key and body, the same on every attempt.
struct Payment {
    key: String,
    charge: Value,
}

impl Payment {
    fn new(i: usize) -> Self {
        // Spread over the whole range, so that handlers end at every moment of an outage.
        let delay = MIN_DELAY_MS + (i as u64 * 211) % DELAY_SPREAD_MS;
        Self {
            key: fresh_key(),
            charge: slow_charge(delay),
        }
    }
}

/// A payment's `201`, and the answers before it.
struct Paid {
    reply: Reply,
    /// When the client had the `201` whole.
    answered: Instant,
    /// `503 idempotency_store_unavailable` answers.
    unavailable: usize,
    /// `409 request_in_progress` answers.
    in_progress: usize,
    /// Requests without an answer.
    failed: usize,
}

/// Sends `payment` until it is answered `201`: again after a failed connection, a `503` or
/// a `409 request_in_progress`, as a client would.
async fn pay_until_created(
    http: &reqwest::Client,
    addr: SocketAddr,
    user: &str,
    payment: &Payment,
) -> Paid {
    let deadline = Instant::now() + PAYMENT_DEADLINE;
    let (mut unavailable, mut in_progress, mut failed) = (0, 0, 0);
    loop {
        let sent = http
            .post(format!("http://{addr}/v1/payments"))
            .header("idempotency-key", &payment.key)
            .bearer_auth(user)
            .json(&payment.charge)
            .send()
            .await;
        let last = match sent {
            Ok(response) => {
                let reply = Reply {
                    status: response.status(),
                    headers: response.headers().clone(),
                    body: match response.bytes().await {
                        Ok(body) => body.to_vec(),
                        Err(error) => {
                            failed += 1;
                            retry(deadline, None, &error, &payment.key).await;
                            continue;
                        }
                    },
                };
                match reply.status {
                    StatusCode::CREATED => {
                        return Paid {
                            reply,
                            answered: Instant::now(),
                            unavailable,
                            in_progress,
                            failed,
                        }
                    }
                    StatusCode::SERVICE_UNAVAILABLE => {
                        reply.assert_error(
                            StatusCode::SERVICE_UNAVAILABLE,
                            "idempotency_store_unavailable",
                        );
                        unavailable += 1;
                    }
                    StatusCode::CONFLICT => {
                        reply.assert_in_progress();
                        in_progress += 1;
                    }
                    _ => panic!("payment {}: unexpected answer {reply:?}", payment.key),
                }
                reply
            }
            Err(error) => {
                failed += 1;
                retry(deadline, None, &error, &payment.key).await;
                continue;
            }
        };
        let retry_after = last
            .header(RETRY_AFTER.as_str())
            .and_then(|secs| secs.parse().ok())
            .map(Duration::from_secs);
        retry(deadline, retry_after, &last, &payment.key).await;
    }
}

/// Waits before the next attempt: `Retry-After` up to [`MAX_RETRY_AFTER`], else a
/// [`RETRY_PAUSE`] or up to twice that. Fails the test past the deadline.
async fn retry(
    deadline: Instant,
    retry_after: Option<Duration>,
    last: &(dyn std::fmt::Debug + Sync),
    key: &str,
) {
    let pause = match retry_after {
        Some(wait) => wait.min(MAX_RETRY_AFTER),
        None => RETRY_PAUSE + RETRY_PAUSE.mul_f64(rand::random::<f64>()),
    };
    assert!(
        Instant::now() + pause < deadline,
        "payment {key}: no 201 within {PAYMENT_DEADLINE:?}; the last answer: {last:?}"
    );
    sleep(pause).await;
}

/// What a storm went through, for the test's output.
struct Report {
    most_active: usize,
    holding_at_outage: usize,
    outage: std::ops::Range<Duration>,
    stormed: Duration,
    retried_completions: usize,
    most_failed_attempts: usize,
    unavailable: usize,
    in_progress: usize,
    failed: usize,
    total: Duration,
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{PAYMENTS} payments, at most {} at once, in {:.2?}; outage {:.2?}..{:.2?} with \
             {} executions holding a key; {} completions written again (at most {} failed \
             attempts); clients got {} 503s, {} 409s and {} failed requests; {:.2?} in all",
            self.most_active,
            self.stormed,
            self.outage.start,
            self.outage.end,
            self.holding_at_outage,
            self.retried_completions,
            self.most_failed_attempts,
            self.unavailable,
            self.in_progress,
            self.failed,
            self.total,
        )
    }
}

// ---------------------------------------------------------------------------------------
// The store, watched.
// ---------------------------------------------------------------------------------------

/// The store under test as it is, with a tally of each claim's completion attempts.
#[derive(Debug)]
struct Watched {
    store: Arc<dyn Store>,
    completions: Mutex<HashMap<ClaimToken, Attempts>>,
}

/// The completion attempts of one claim.
#[derive(Clone, Debug)]
struct Attempts {
    /// The idempotency key claimed.
    key: String,
    /// Attempts the store failed.
    failed: usize,
    /// The store's answer to the last attempt it answered.
    answered: Option<Fenced>,
    /// When the store had applied it.
    applied: Option<Instant>,
}

impl Watched {
    fn new(store: Arc<dyn Store>) -> Self {
        Self {
            store,
            completions: Mutex::default(),
        }
    }

    /// Every claim's completion attempts so far.
    fn completions(&self) -> Vec<Attempts> {
        self.completions.lock().unwrap().values().cloned().collect()
    }
}

#[async_trait]
impl Store for Watched {
    async fn claim_with_token(
        &self,
        scope: &Scope,
        fingerprint: Fingerprint,
        token: ClaimToken,
        lease: Duration,
    ) -> store::Result<Claim> {
        self.store
            .claim_with_token(scope, fingerprint, token, lease)
            .await
    }

    async fn complete(
        &self,
        scope: &Scope,
        token: ClaimToken,
        fingerprint: Fingerprint,
        response: &StoredResponse,
        ttl: Duration,
    ) -> store::Result<Fenced> {
        let result = self
            .store
            .complete(scope, token, fingerprint, response, ttl)
            .await;
        let mut completions = self.completions.lock().unwrap();
        let attempts = completions.entry(token).or_insert_with(|| Attempts {
            key: scope.key().as_str().to_owned(),
            failed: 0,
            answered: None,
            applied: None,
        });
        match &result {
            Ok(fenced) => {
                attempts.answered = Some(*fenced);
                if *fenced == Fenced::Applied {
                    attempts.applied.get_or_insert_with(Instant::now);
                }
            }
            Err(_) => attempts.failed += 1,
        }
        result
    }

    async fn release(&self, scope: &Scope, token: ClaimToken) -> store::Result<Fenced> {
        self.store.release(scope, token).await
    }

    async fn extend(
        &self,
        scope: &Scope,
        token: ClaimToken,
        lease: Duration,
    ) -> store::Result<Fenced> {
        self.store.extend(scope, token, lease).await
    }
}

// ---------------------------------------------------------------------------------------
// PostgreSQL.
// ---------------------------------------------------------------------------------------

/// How often, and how many times, the store's connections are terminated while its table
/// is locked.
const TERMINATE_EVERY: Duration = Duration::from_millis(200);
const TERMINATIONS: usize = 5;

/// A store on a table of its own whose connections carry `application` as their
/// application name, so that terminating them spares every other test's.
async fn postgres_store(application: &str) -> PostgresStore {
    let url = support::database_url();
    let named = with_application_name(&url, application);
    let store = PostgresStore::connect(&named)
        .await
        .unwrap_or_else(|e| panic!("PostgreSQL at {url} (set DATABASE_URL): {e}"));
    let client = support::store_client(&url).await;
    // Parallel tests race to create the schema: one wins, the others see it exist.
    for _ in 0..5 {
        let created = client
            .batch_execute(&format!(
                "CREATE SCHEMA IF NOT EXISTS {}",
                support::TEST_SCHEMA
            ))
            .await;
        if created.is_ok() {
            break;
        }
        sleep(Duration::from_millis(20)).await;
    }
    let table = format!("t_{:016x}", rand::random::<u64>());
    let store = store
        .table(support::TEST_SCHEMA, &table)
        .expect("valid table name");
    store.migrate().await.expect("migrate");
    store
}

/// `url` with `application_name` set, as a URL or as `key=value` pairs.
fn with_application_name(url: &str, application: &str) -> String {
    if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        let separator = if url.contains('?') { '&' } else { '?' };
        format!("{url}{separator}application_name={application}")
    } else {
        format!("{url} application_name={application}")
    }
}

/// Terminates the backends of `application` on this database; returns how many.
async fn terminate_backends(control: &tokio_postgres::Client, application: &str) -> usize {
    let rows = control
        .query(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
             WHERE datname = current_database() AND pid <> pg_backend_pid()
                AND application_name = $1",
            &[&application],
        )
        .await
        .expect("terminate the store's connections");
    rows.iter().filter(|row| row.get::<_, bool>(0)).count()
}

// ---------------------------------------------------------------------------------------
// Helpers.
// ---------------------------------------------------------------------------------------

/// The payments router over `store` on a loopback port: a client for it, its stats, and
/// the server, which stops when dropped.
async fn serve(store: Arc<dyn Store>) -> (Api, Arc<app::Stats>, Server) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("local address");
    let (router, stats) = app::router(store, app::Settings::default());
    let task = tokio::spawn(async move { axum::serve(listener, router).await.expect("serve") });
    (Api::new(addr), stats, Server(task))
}

/// A server task, aborted when dropped.
struct Server(JoinHandle<()>);

impl Drop for Server {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// A user (the example's principal) no other test uses.
fn unique_user() -> String {
    format!("blips-{:016x}", rand::random::<u64>())
}

/// The scope of `user`'s payment with `key`.
fn payment_scope(user: &str, key: &str) -> Scope {
    let key = IdempotencyKey::parse(&HeaderValue::from_str(key).expect("a header value"))
        .expect("a valid key");
    Scope::new(Some(user.to_owned()), PAYMENTS_ENDPOINT.to_owned(), key)
}

/// Polls `done` until it holds, failing after `limit`.
async fn wait_for(limit: Duration, what: &str, done: impl Fn() -> bool) {
    let deadline = Instant::now() + limit;
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        sleep(Duration::from_millis(5)).await;
    }
}

/// Runs `work`, which blocks (starting or stopping a process), off the runtime's threads.
async fn blocking<T: Send + 'static>(work: impl FnOnce() -> T + Send + 'static) -> T {
    tokio::task::spawn_blocking(work)
        .await
        .expect("blocking task")
}
