//! The transactional PostgreSQL mode, on both drivers.

#[macro_use]
mod support;

use std::{
    future::Future,
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc, Mutex,
    },
    time::Duration,
};

use axum::{
    extract::State,
    http::{HeaderMap, StatusCode},
    response::{IntoResponse, Response},
    routing::post,
    Json, Router,
};
use support::app::{post as request, send, Answer};
use support::{
    wrapped_store::{Hooks, Operation, Wrapped},
    Driver,
};
use tokio::sync::Semaphore;
use tower_http::catch_panic::CatchPanicLayer;
use tower_idempotency::{
    deadpool_postgres::{Manager, Pool, Runtime},
    sqlx::postgres::PgPoolOptions,
    transaction::{PostgresTransaction, SqlxTransaction},
    IdempotencyLayer, PostgresStore,
};

/// The conformance cases that apply to a transactional store, one test per case and driver:
/// all but the three whose holder's lease runs out (`in_progress_record_lives_for_its_lease`,
/// `writes_after_the_lease_are_lost`, `expired_holder_is_fenced_out`). A transaction holds
/// its key while it is open, whatever its lease; a dead holder's connection rolls it back
/// (below).
macro_rules! conformance {
    ($($case:ident),* $(,)?) => {
        mod postgres_conformance {
            $(#[tokio::test]
            #[ignore = "needs PostgreSQL: scripts/test.sh"]
            async fn $case() {
                let store = super::Driver::TokioPostgres.transactional().await;
                tower_idempotency::conformance::$case(&store).await;
            })*
        }
        mod sqlx_conformance {
            $(#[tokio::test]
            #[ignore = "needs PostgreSQL: scripts/test.sh"]
            async fn $case() {
                let store = super::Driver::Sqlx.transactional().await;
                tower_idempotency::conformance::$case(&store).await;
            })*
        }
        // Counted replays are read outside the transaction, where the tokio-postgres
        // driver otherwise reads in it.
        mod postgres_counting_conformance {
            $(#[tokio::test]
            #[ignore = "needs PostgreSQL: scripts/test.sh"]
            async fn $case() {
                let store = super::Driver::TokioPostgres.transactional().await.count_replays();
                tower_idempotency::conformance::$case(&store).await;
            })*
        }
    };
}

conformance!(
    claim_claims_a_free_key,
    second_claim_sees_in_progress,
    completed_response_is_returned_byte_exact,
    complete_resent_by_holder_is_applied,
    release_frees_the_key,
    extend_renews_the_lease,
    strangers_are_fenced_out,
    completed_record_is_final,
    completed_record_lives_for_its_ttl,
    completion_resent_after_expiry_is_lost,
    claim_resent_by_holder_keeps_the_claim,
    scopes_never_interfere,
    concurrent_claims_have_one_winner,
    watches_wake_on_completion_and_release,
);

// ---------------------------------------------------------------------------------------
// The handler's writes, through the layer.
// ---------------------------------------------------------------------------------------

/// Runs each listed `async fn case(driver: Driver)` on both drivers.
macro_rules! on_both_drivers {
    ($($case:ident),* $(,)?) => {
        mod tokio_postgres_driver {
            $(#[tokio::test]
            #[ignore = "needs PostgreSQL: scripts/test.sh"]
            async fn $case() {
                super::$case(super::Driver::TokioPostgres).await
            })*
        }
        mod sqlx_driver {
            $(#[tokio::test]
            #[ignore = "needs PostgreSQL: scripts/test.sh"]
            async fn $case() {
                super::$case(super::Driver::Sqlx).await
            })*
        }
    };
}

on_both_drivers!(
    recorded_outcomes_commit_the_handlers_writes_and_released_ones_roll_them_back,
    a_duplicate_is_answered_at_once_while_the_original_runs,
    an_exhausted_pool_answers_503_with_retry_after,
    connections_the_server_ended_while_pooled_are_replaced_unseen,
    a_backend_terminated_mid_handler_frees_the_key_and_commits_nothing,
    a_statement_timeout_fails_the_statement_and_nothing_commits,
    a_handler_past_the_idle_in_transaction_timeout_gets_503,
    counted_replays_are_committed,
    a_duplicate_that_waits_gets_the_originals_answer,
    a_duplicate_that_waits_is_woken_by_a_notification,
    a_completion_the_store_refuses_rolls_back_at_once,
    a_release_refused_in_front_of_the_store_still_rolls_back,
    an_abandoned_claim_whose_release_is_refused_still_rolls_back,
    a_completion_failing_in_front_of_the_store_is_answered_within_the_lease,
);

/// What the test handler does in its transaction, on either driver.
trait Ledger: Send + 'static {
    /// Runs `sql` (one or more statements, no parameters).
    fn run(&mut self, sql: String) -> impl Future<Output = Result<(), String>> + Send;
    /// The server process of the transaction's connection.
    fn pid(&mut self) -> impl Future<Output = i32> + Send;
}

impl Ledger for PostgresTransaction {
    async fn run(&mut self, sql: String) -> Result<(), String> {
        self.batch_execute(&sql).await.map_err(|e| e.to_string())
    }

    async fn pid(&mut self) -> i32 {
        let row = self.query_one("SELECT pg_backend_pid()", &[]).await;
        row.expect("the backend's pid").get(0)
    }
}

impl Ledger for SqlxTransaction {
    fn run(&mut self, sql: String) -> impl Future<Output = Result<(), String>> + Send {
        let connection: &mut tower_idempotency::sqlx::PgConnection = self;
        // Boxed: sqlx's executor bounds are too general for the compiler to prove this
        // future `Send` in place.
        let done: std::pin::Pin<Box<dyn Future<Output = _> + Send + '_>> = Box::pin(async move {
            use tower_idempotency::sqlx::Executor;
            connection.execute(sql.as_str()).await
        });
        async move { done.await.map(drop).map_err(|e| e.to_string()) }
    }

    async fn pid(&mut self) -> i32 {
        let pid = tower_idempotency::sqlx::query_scalar("SELECT pg_backend_pid()");
        pid.fetch_one(&mut **self).await.expect("the backend's pid")
    }
}

/// The orders service: each execution inserts one row of `orders` in its transaction;
/// headers choose the rest.
#[derive(Clone)]
struct Orders {
    table: String,
    executions: Arc<AtomicUsize>,
    /// Requests with `x-wait` wait here for a permit the test hands out.
    gate: Arc<Semaphore>,
    /// The backend pid of each execution that sent `x-pid`.
    pids: Arc<Mutex<Vec<i32>>>,
}

/// Inserts the order, then: `x-pid` records the connection's backend, `x-wait` waits at the
/// gate, `x-then` runs more SQL (answering `500` if it fails, with `x-check`),
/// `x-sleep-ms` sleeps, `x-panic` panics, and `x-status` is the answer (default `201`).
async fn create_order<L: Ledger>(
    State(orders): State<Orders>,
    headers: HeaderMap,
    mut tx: L,
) -> Response {
    let n = orders.executions.fetch_add(1, Ordering::SeqCst) + 1;
    let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    let id = format!("ord_{n}");
    let insert = format!("INSERT INTO {} (id) VALUES ('{id}')", orders.table);
    if let Err(error) = tx.run(insert).await {
        return (StatusCode::INTERNAL_SERVER_ERROR, error).into_response();
    }
    if header("x-pid").is_some() {
        let pid = tx.pid().await;
        orders.pids.lock().unwrap().push(pid);
    }
    if header("x-wait").is_some() {
        orders.gate.acquire().await.unwrap().forget();
    }
    if let Some(sql) = header("x-then") {
        let done = tx.run(sql.to_owned()).await;
        if done.is_err() && header("x-check").is_some() {
            return (StatusCode::INTERNAL_SERVER_ERROR, "the statement failed").into_response();
        }
    }
    if let Some(ms) = header("x-sleep-ms") {
        tokio::time::sleep(Duration::from_millis(ms.parse().unwrap())).await;
    }
    if header("x-panic").is_some() {
        panic!("the handler panicked on purpose");
    }
    let status = header("x-status").map_or(StatusCode::CREATED, |s| s.parse().unwrap());
    (status, Json(serde_json::json!({ "id": id }))).into_response()
}

/// The orders service behind a transactional layer on `store`, its ledger table created.
struct Service {
    app: Router,
    orders: Orders,
    store: PostgresStore,
    client: tokio_postgres::Client,
}

impl Service {
    async fn new(driver: Driver) -> Self {
        Self::on(driver, driver.transactional().await).await
    }

    async fn on(driver: Driver, store: PostgresStore) -> Self {
        Self::configured(driver, store, |layer| layer).await
    }

    /// [`Service::on`], its layer configured further by `configure`.
    async fn configured(
        driver: Driver,
        store: PostgresStore,
        configure: impl FnOnce(IdempotencyLayer) -> IdempotencyLayer,
    ) -> Self {
        let client = support::store_client(&support::database_url()).await;
        let table = format!(
            "{}.orders_{:016x}",
            support::TEST_SCHEMA,
            rand::random::<u64>()
        );
        client
            .batch_execute(&format!("CREATE TABLE {table} (id TEXT PRIMARY KEY)"))
            .await
            .expect("the orders table");
        let orders = Orders {
            table,
            executions: Arc::default(),
            gate: Arc::new(Semaphore::new(0)),
            pids: Arc::default(),
        };
        let route = match driver {
            Driver::TokioPostgres => post(create_order::<PostgresTransaction>),
            Driver::Sqlx => post(create_order::<SqlxTransaction>),
        };
        let layer = IdempotencyLayer::new(store.clone())
            .allow_anonymous()
            .lease(Duration::from_secs(60));
        let layer = configure(layer);
        let app = Router::new()
            .route("/orders", route.layer(layer))
            .with_state(orders.clone())
            // Outside the layer, as a server's would be: the layer releases, then this answers.
            .layer(CatchPanicLayer::new());
        Self {
            app,
            orders,
            store,
            client,
        }
    }

    async fn send(&self, key: &str, headers: &[(&str, &str)]) -> Answer {
        let mut req = request("/orders").key(key).body("{}");
        for (name, value) in headers {
            req = req.header(name, value);
        }
        send(&self.app, req).await
    }

    fn spawn(&self, key: &str, headers: &[(&str, &str)]) -> tokio::task::JoinHandle<Answer> {
        let mut req = request("/orders").key(key).body("{}");
        for (name, value) in headers {
            req = req.header(name, value);
        }
        let app = self.app.clone();
        tokio::spawn(async move { send(&app, req).await })
    }

    /// How many orders are committed.
    async fn rows(&self) -> i64 {
        let sql = format!("SELECT count(*) FROM {}", self.orders.table);
        self.client.query_one(&sql, &[]).await.unwrap().get(0)
    }

    /// The idempotency table's rows: (completed, in progress).
    async fn records(&self) -> (i64, i64) {
        let sql = format!(
            "SELECT count(*) FILTER (WHERE status = 'completed'),
                count(*) FILTER (WHERE status = 'in_progress') FROM {}",
            self.store.table_name()
        );
        let row = self.client.query_one(&sql, &[]).await.unwrap();
        (row.get(0), row.get(1))
    }

    async fn until_executing(&self, n: usize) {
        for _ in 0..500 {
            if self.orders.executions.load(Ordering::SeqCst) >= n {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("{n} executions never started");
    }

    /// Ends the server process `pid` (`pg_terminate_backend`), which must be live, and
    /// waits until it is gone.
    async fn terminate(&self, pid: i32) {
        let sql = "SELECT pg_terminate_backend($1)";
        let terminated = self.client.query_one(sql, &[&pid]).await.unwrap();
        assert!(terminated.get::<_, bool>(0), "backend {pid} was not live");
        let live = "SELECT count(*) FROM pg_stat_activity WHERE pid = $1";
        for _ in 0..500 {
            let row = self.client.query_one(live, &[&pid]).await.unwrap();
            if row.get::<_, i64>(0) == 0 {
                // A turn for the clients' own tasks, which read the server's goodbye.
                tokio::time::sleep(Duration::from_millis(20)).await;
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("backend {pid} outlived its termination");
    }

    /// Once `n` executions are running and at least as many pids are known, the last.
    async fn pid_of_execution(&self, n: usize) -> i32 {
        for _ in 0..500 {
            if let Some(pid) = self.orders.pids.lock().unwrap().get(n - 1) {
                return *pid;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("execution {n} never told its pid");
    }
}

fn retry_after(answer: &Answer) -> u64 {
    let value = answer.headers.get("retry-after").expect("Retry-After");
    value.to_str().unwrap().parse().unwrap()
}

async fn recorded_outcomes_commit_the_handlers_writes_and_released_ones_roll_them_back(
    driver: Driver,
) {
    let service = Service::new(driver).await;
    // A success commits its row with its record, once.
    let first = service.send("created", &[]).await;
    first.assert_executed();
    assert_eq!(service.rows().await, 1);
    let replay = service.send("created", &[]).await;
    assert!(replay.replayed(), "{replay:?}");
    assert_eq!(replay.body, first.body);
    // A decline is a result: its row commits too, and it replays.
    let declined = service.send("declined", &[("x-status", "402")]).await;
    assert_eq!(declined.status, StatusCode::PAYMENT_REQUIRED);
    assert_eq!(service.rows().await, 2);
    assert!(service.send("declined", &[]).await.replayed());
    // A server error releases the key: its row is rolled back with the claim.
    let failed = service.send("failed", &[("x-status", "500")]).await;
    assert_eq!(failed.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(service.rows().await, 2);
    // So does a panic.
    let panicked = service.send("panicked", &[("x-panic", "1")]).await;
    assert_eq!(panicked.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(service.rows().await, 2);
    // Their retries execute, once each.
    service.send("failed", &[]).await.assert_executed();
    service.send("panicked", &[]).await.assert_executed();
    assert_eq!(service.rows().await, 4);
    assert_eq!(service.orders.executions.load(Ordering::SeqCst), 6);
    // Nothing is left in progress, nor open.
    assert_eq!(service.records().await, (4, 0));
    assert_eq!(service.store.open_transactions(), 0);
}

async fn a_duplicate_is_answered_at_once_while_the_original_runs(driver: Driver) {
    let service = Service::new(driver).await;
    let original = service.spawn("held", &[("x-wait", "1")]);
    service.until_executing(1).await;
    // Answered while the original holds its uncommitted row: a duplicate that queued behind
    // it would not be answered before the gate opens.
    let bounded = Duration::from_secs(5);
    let duplicate = tokio::time::timeout(bounded, service.send("held", &[])).await;
    let duplicate = duplicate.expect("the duplicate was not answered while the original ran");
    assert_eq!(duplicate.status, StatusCode::CONFLICT, "{duplicate:?}");
    assert_eq!(duplicate.error(), "request_in_progress");
    assert!((1..=2).contains(&retry_after(&duplicate)));
    // Another body under the key is told so while the original runs.
    let mut reused = request("/orders").key("held").body("{\"other\":1}");
    reused = reused.header("content-type", "application/json");
    let reused = tokio::time::timeout(bounded, send(&service.app, reused)).await;
    let reused = reused.expect("the reuse was not answered while the original ran");
    assert_eq!(
        reused.error(),
        "idempotency_key_reused_with_different_params"
    );
    service.orders.gate.add_permits(1);
    original.await.unwrap().assert_executed();
    assert!(service.send("held", &[]).await.replayed());
    assert_eq!(service.rows().await, 1);
    assert_eq!(service.orders.executions.load(Ordering::SeqCst), 1);
}

async fn an_exhausted_pool_answers_503_with_retry_after(driver: Driver) {
    let url = support::database_url();
    // One connection for the transactions: the first execution holds it.
    let store = match driver {
        Driver::TokioPostgres => {
            let config: tokio_postgres::Config = url.parse().unwrap();
            let pool = Pool::builder(Manager::new(config, tokio_postgres::NoTls))
                .max_size(1)
                .wait_timeout(Some(Duration::from_millis(300)))
                .runtime(Runtime::Tokio1)
                .build()
                .unwrap();
            PostgresStore::new(pool).transactional()
        }
        Driver::Sqlx => {
            let pool = PgPoolOptions::new()
                .max_connections(1)
                .acquire_timeout(Duration::from_millis(300))
                .connect(&url)
                .await
                .unwrap();
            let store = PostgresStore::connect(&url).await.unwrap();
            store.transactional_sqlx(pool)
        }
    };
    let service = Service::on(driver, support::on_own_table(store).await).await;
    let original = service.spawn("first", &[("x-wait", "1")]);
    service.until_executing(1).await;
    let refused = tokio::time::timeout(Duration::from_secs(10), service.send("second", &[])).await;
    let refused = refused.expect("a request waited for a connection without bound");
    assert_eq!(
        refused.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{refused:?}"
    );
    assert_eq!(refused.error(), "idempotency_store_unavailable");
    assert!(retry_after(&refused) >= 1);
    service.orders.gate.add_permits(1);
    original.await.unwrap().assert_executed();
    // With the connection back, the refused request executes on its retry.
    service.send("second", &[]).await.assert_executed();
    assert_eq!(service.rows().await, 2);
}

/// The store's own pool holds as many transactions at once as it is sized for, not its
/// default 16, and one more execution finds none.
#[tokio::test]
#[ignore = "needs PostgreSQL: scripts/test.sh"]
async fn the_stores_pool_holds_as_many_transactions_as_it_is_sized_for() {
    const CONNECTIONS: usize = 18;
    let store = PostgresStore::connect(&support::database_url())
        .await
        .unwrap()
        .max_connections(CONNECTIONS)
        .transactional();
    let store = support::on_own_table(store).await;
    let service = Service::on(Driver::TokioPostgres, store).await;
    let running: Vec<_> = (0..CONNECTIONS)
        .map(|n| service.spawn(&format!("held-{n}"), &[("x-wait", "1")]))
        .collect();
    service.until_executing(CONNECTIONS).await;
    let refused = service.send("one-too-many", &[]).await;
    assert_eq!(
        refused.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{refused:?}"
    );
    service.orders.gate.add_permits(CONNECTIONS);
    for execution in running {
        execution.await.unwrap().assert_executed();
    }
    assert_eq!(service.rows().await, CONNECTIONS as i64);
}

/// A connection the server ended while it sat in the pool (as a restart ends them all)
/// reaches no request: the tokio-postgres pool sees it closed before lending it; an sqlx
/// pool that skips its ping before each acquire lends it, and the store replaces it.
async fn connections_the_server_ended_while_pooled_are_replaced_unseen(driver: Driver) {
    let url = support::database_url();
    let store = PostgresStore::connect(&url).await.unwrap();
    let store = match driver {
        Driver::TokioPostgres => store.max_connections(3).transactional(),
        Driver::Sqlx => {
            let pool = PgPoolOptions::new()
                .max_connections(3)
                .test_before_acquire(false)
                .connect(&url)
                .await
                .unwrap();
            store.transactional_sqlx(pool)
        }
    };
    let service = Service::on(driver, support::on_own_table(store).await).await;
    // Three executions at once: each on a connection of its own, pooled when they end.
    let running: Vec<_> = (0..3)
        .map(|n| service.spawn(&format!("pooled-{n}"), &[("x-pid", "1"), ("x-wait", "1")]))
        .collect();
    let pids = [
        service.pid_of_execution(1).await,
        service.pid_of_execution(2).await,
        service.pid_of_execution(3).await,
    ];
    service.orders.gate.add_permits(3);
    for execution in running {
        execution.await.unwrap().assert_executed();
    }
    // As a restart of the server would: every pooled connection ended.
    for pid in pids {
        service.terminate(pid).await;
    }
    service
        .send("after-the-restart", &[])
        .await
        .assert_executed();
    assert_eq!(service.rows().await, 4);
}

async fn a_backend_terminated_mid_handler_frees_the_key_and_commits_nothing(driver: Driver) {
    let service = Service::new(driver).await;
    // The handler ignores what fails after its insert, and answers 201 regardless.
    let original = service.spawn(
        "terminated",
        &[("x-pid", "1"), ("x-wait", "1"), ("x-then", "SELECT 1")],
    );
    let pid = service.pid_of_execution(1).await;
    service.terminate(pid).await;
    // The database rolled the transaction back and let go of its locks: the retry executes
    // at once, though the lease runs a minute and the first handler has not ended.
    let mut retried = None;
    for _ in 0..100 {
        let answer = service.send("terminated", &[]).await;
        if answer.status == StatusCode::CREATED {
            retried = Some(answer);
            break;
        }
        assert_eq!(answer.error(), "request_in_progress", "{answer:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    retried.expect("the retry never executed").assert_executed();
    // The first handler's 201 cannot commit: its client is told to retry, not that it worked.
    service.orders.gate.add_permits(1);
    let original = original.await.unwrap();
    assert_eq!(
        original.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{original:?}"
    );
    assert_eq!(original.error(), "idempotency_store_unavailable");
    assert_eq!(service.rows().await, 1);
    assert!(service.send("terminated", &[]).await.replayed());
    assert_eq!(service.records().await, (1, 0));
}

async fn a_statement_timeout_fails_the_statement_and_nothing_commits(driver: Driver) {
    let service = Service::new(driver).await;
    let timed_out = [
        (
            "x-then",
            "SET LOCAL statement_timeout = '50ms'; SELECT pg_sleep(2)",
        ),
        ("x-check", "1"),
    ];
    let answer = service.send("slow", &timed_out).await;
    // The handler's own error answer, released with its insert.
    assert_eq!(
        answer.status,
        StatusCode::INTERNAL_SERVER_ERROR,
        "{answer:?}"
    );
    assert_eq!(service.rows().await, 0);
    assert_eq!(service.records().await, (0, 0));
    service.send("slow", &[]).await.assert_executed();
    assert_eq!(service.rows().await, 1);
}

async fn a_handler_past_the_idle_in_transaction_timeout_gets_503(driver: Driver) {
    let service = Service::new(driver).await;
    let idle = [
        (
            "x-then",
            "SET LOCAL idle_in_transaction_session_timeout = '100ms'",
        ),
        ("x-sleep-ms", "600"),
    ];
    // The database closed the connection while the handler slept: its 201 cannot commit.
    let answer = service.send("idle", &idle).await;
    assert_eq!(answer.status, StatusCode::SERVICE_UNAVAILABLE, "{answer:?}");
    assert_eq!(answer.error(), "idempotency_store_unavailable");
    assert!(retry_after(&answer) >= 1);
    assert_eq!(service.rows().await, 0);
    service.send("idle", &[]).await.assert_executed();
    assert_eq!(service.rows().await, 1);
    assert!(service.send("idle", &[]).await.replayed());
}

async fn counted_replays_are_committed(driver: Driver) {
    let store = driver.transactional().await.count_replays();
    let service = Service::on(driver, store).await;
    service.send("counted", &[]).await.assert_executed();
    for _ in 0..2 {
        assert!(service.send("counted", &[]).await.replayed());
    }
    let sql = format!(
        "SELECT replay_count FROM {} WHERE idempotency_key = 'counted'",
        service.store.table_name()
    );
    let counted: i64 = service.client.query_one(&sql, &[]).await.unwrap().get(0);
    assert_eq!(counted, 2);
    assert_eq!(service.rows().await, 1);
}

async fn a_duplicate_that_waits_gets_the_originals_answer(driver: Driver) {
    let store = driver.transactional().await;
    duplicate_waits_for_the_original(driver, store).await;
}

async fn a_duplicate_that_waits_is_woken_by_a_notification(driver: Driver) {
    let store = driver.transactional().await.announce_outcomes();
    duplicate_waits_for_the_original(driver, store).await;
}

/// A duplicate of a running execution waits (bounded) for its commit, and answers with it.
async fn duplicate_waits_for_the_original(driver: Driver, store: PostgresStore) {
    let bound = Duration::from_secs(20);
    let service = Service::configured(driver, store, |layer| layer.wait_for_original(bound)).await;
    let original = service.spawn("waited", &[("x-wait", "1")]);
    service.until_executing(1).await;
    let duplicate = service.spawn("waited", &[]);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!duplicate.is_finished(), "the duplicate did not wait");
    service.orders.gate.add_permits(1);
    let original = original.await.unwrap();
    original.assert_executed();
    let duplicate = duplicate.await.unwrap();
    assert!(duplicate.replayed(), "{duplicate:?}");
    assert_eq!(duplicate.body, original.body);
    assert_eq!(service.rows().await, 1);
    assert_eq!(service.orders.executions.load(Ordering::SeqCst), 1);
}

/// sqlx's transaction lends its connection mutably (its executors need `&mut`): what a
/// handler can do with it must not end the layer's transaction. `begin()` on it makes a
/// savepoint, so a nested transaction's `commit()` commits nothing, and a released outcome
/// still rolls its writes back. (tokio-postgres's `transaction()` would commit the layer's
/// transaction: its connection is lent for statements only, and the call does not compile;
/// see `PostgresTransaction`.)
#[tokio::test]
#[ignore = "needs PostgreSQL: scripts/test.sh"]
async fn sqlx_a_nested_begin_is_a_savepoint_a_release_rolls_back() {
    use tower_idempotency::sqlx::Connection as _;
    #[derive(Clone)]
    struct Table(String);
    async fn create(
        State(Table(table)): State<Table>,
        headers: HeaderMap,
        mut tx: SqlxTransaction,
    ) -> StatusCode {
        let connection: &mut tower_idempotency::sqlx::PgConnection = &mut tx;
        let mut nested = connection.begin().await.unwrap();
        tower_idempotency::sqlx::query(&format!("INSERT INTO {table} (id) VALUES ('ord_1')"))
            .execute(&mut *nested)
            .await
            .unwrap();
        nested.commit().await.unwrap();
        headers
            .get("x-status")
            .map_or(StatusCode::CREATED, |status| {
                status.to_str().unwrap().parse().unwrap()
            })
    }
    let store = Driver::Sqlx.transactional().await;
    let client = support::store_client(&support::database_url()).await;
    let table = format!(
        "{}.nested_{:016x}",
        support::TEST_SCHEMA,
        rand::random::<u64>()
    );
    client
        .batch_execute(&format!("CREATE TABLE {table} (id TEXT PRIMARY KEY)"))
        .await
        .unwrap();
    let rows = || async {
        let count = format!("SELECT count(*) FROM {table}");
        client
            .query_one(&count, &[])
            .await
            .unwrap()
            .get::<_, i64>(0)
    };
    let layer = IdempotencyLayer::new(store).allow_anonymous();
    let app = Router::new()
        .route("/orders", post(create).layer(layer))
        .with_state(Table(table.clone()));
    let released = request("/orders")
        .key("k")
        .header("x-status", "500")
        .body("{}");
    assert_eq!(
        send(&app, released).await.status,
        StatusCode::INTERNAL_SERVER_ERROR
    );
    assert_eq!(
        rows().await,
        0,
        "the released execution's nested write committed"
    );
    send(&app, request("/orders").key("k").body("{}"))
        .await
        .assert_executed();
    assert_eq!(rows().await, 1);
}

/// Refuses every completion for good while `refusing` is set (`store::Error::Refused`,
/// nothing sent), as a store in front that limits a record's size would.
#[derive(Debug)]
struct RefusesCompletions {
    refusing: std::sync::atomic::AtomicBool,
}

impl Hooks for RefusesCompletions {
    fn before(&self, operation: Operation<'_>) -> tower_idempotency::store::Result<()> {
        match operation {
            Operation::Complete(_) if self.refusing.load(Ordering::SeqCst) => Err(
                tower_idempotency::store::Error::Refused("past this store's limit".into()),
            ),
            _ => Ok(()),
        }
    }
}

/// A completion refused for good answers 503 at once; the execution's transaction, which
/// the refused completion never reached, is rolled back with it: it stayed open, holding
/// the key (every retry got 409 in progress), the handler's writes and a connection.
async fn a_completion_the_store_refuses_rolls_back_at_once(driver: Driver) {
    let refusing = RefusesCompletions {
        refusing: true.into(),
    };
    let (service, app, wrapped) = wrapped_service(driver, refusing, Duration::from_secs(60)).await;
    let order = || request("/orders").key("refused").body("{}");
    let first = tokio::time::timeout(Duration::from_secs(10), send(&app, order()))
        .await
        .expect("answered at once");
    assert_eq!(first.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(service.store.open_transactions(), 0);
    assert_eq!(service.rows().await, 0);
    // The key is free at once, well within the lease: the retry executes.
    wrapped.hooks.refusing.store(false, Ordering::SeqCst);
    let retry = send(&app, order()).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert_eq!(service.rows().await, 1);
}

/// In front of the store (a wrapper of the application's): refuses releases, fails
/// completions as unavailable, or loses the answers of claims the store applied, while set.
#[derive(Debug, Default)]
struct FailsInFront {
    refusing_releases: std::sync::atomic::AtomicBool,
    failing_completions: std::sync::atomic::AtomicBool,
    losing_claim_answers: std::sync::atomic::AtomicBool,
}

impl Hooks for FailsInFront {
    fn before(&self, operation: Operation<'_>) -> tower_idempotency::store::Result<()> {
        use tower_idempotency::store::Error;
        match operation {
            Operation::Release if self.refusing_releases.load(Ordering::SeqCst) => {
                Err(Error::Refused("not past this wrapper".into()))
            }
            Operation::Complete(_) if self.failing_completions.load(Ordering::SeqCst) => {
                Err(Error::Unavailable("down in front of the store".into()))
            }
            _ => Ok(()),
        }
    }

    fn after_claim(&self) -> tower_idempotency::store::Result<()> {
        if self.losing_claim_answers.load(Ordering::SeqCst) {
            let lost = "the claim's answer was lost on its way back";
            return Err(tower_idempotency::store::Error::Backend(lost.into()));
        }
        Ok(())
    }
}

/// The orders service behind a transactional layer whose store is wrapped in `hooks`.
async fn wrapped_service<H: Hooks>(
    driver: Driver,
    hooks: H,
    lease: Duration,
) -> (Service, Router, Arc<Wrapped<H>>) {
    let service = Service::new(driver).await;
    let wrapped = Wrapped::new(Arc::new(service.store.clone()), hooks);
    let route = match driver {
        Driver::TokioPostgres => post(create_order::<PostgresTransaction>),
        Driver::Sqlx => post(create_order::<SqlxTransaction>),
    };
    let layer = IdempotencyLayer::from_shared(wrapped.clone())
        .allow_anonymous()
        .lease(lease);
    let app = Router::new()
        .route("/orders", route.layer(layer))
        .with_state(service.orders.clone());
    (service, app, wrapped)
}

/// A release that never reached the store (refused in front of it) still rolls the
/// execution's transaction back: it stayed open for good, holding the key (every retry got
/// 409 in progress, the store renewing the claim of an open transaction), the handler's
/// writes and a connection.
async fn a_release_refused_in_front_of_the_store_still_rolls_back(driver: Driver) {
    let hooks = FailsInFront::default();
    hooks.refusing_releases.store(true, Ordering::SeqCst);
    let (service, app, wrapped) = wrapped_service(driver, hooks, Duration::from_secs(2)).await;
    let order = || request("/orders").key("refused-release").body("{}");
    let failed = send(&app, order().header("x-status", "500")).await;
    assert_eq!(failed.status, StatusCode::INTERNAL_SERVER_ERROR);
    // Given up on at once (refused), and rolled back without waiting for the lease.
    wrapped
        .hooks
        .refusing_releases
        .store(false, Ordering::SeqCst);
    rolled_back_then_the_retry_executes(&service, &app, order()).await;
}

/// A claim the store applied but whose answer was lost is released in the background;
/// when that release is refused in front of the store, the claim is still abandoned and
/// its transaction rolled back: it stayed open, holding the key (every retry 409 in
/// progress) and a connection.
async fn an_abandoned_claim_whose_release_is_refused_still_rolls_back(driver: Driver) {
    let hooks = FailsInFront::default();
    hooks.refusing_releases.store(true, Ordering::SeqCst);
    hooks.losing_claim_answers.store(true, Ordering::SeqCst);
    let (service, app, wrapped) = wrapped_service(driver, hooks, Duration::from_secs(60)).await;
    let order = || request("/orders").key("lost-claim").body("{}");
    let failed = send(&app, order()).await;
    assert_eq!(failed.status, StatusCode::SERVICE_UNAVAILABLE);
    // Releases stay refused: the retry completes, it releases nothing.
    wrapped
        .hooks
        .losing_claim_answers
        .store(false, Ordering::SeqCst);
    rolled_back_then_the_retry_executes(&service, &app, order()).await;
}

/// A completion that fails in front of the store is given up within a lease of its first
/// failure: 503, the transaction rolled back, the key free. It was retried for ever, the
/// store applying every renewal of a claim whose transaction is open.
async fn a_completion_failing_in_front_of_the_store_is_answered_within_the_lease(driver: Driver) {
    let hooks = FailsInFront::default();
    hooks.failing_completions.store(true, Ordering::SeqCst);
    let (service, app, wrapped) = wrapped_service(driver, hooks, Duration::from_secs(2)).await;
    let order = || request("/orders").key("failing-completion").body("{}");
    let first = tokio::time::timeout(Duration::from_secs(15), send(&app, order()))
        .await
        .expect("answered within the lease of the first failure");
    assert_eq!(first.status, StatusCode::SERVICE_UNAVAILABLE);
    wrapped
        .hooks
        .failing_completions
        .store(false, Ordering::SeqCst);
    rolled_back_then_the_retry_executes(&service, &app, order()).await;
}

/// The execution's transaction rolled back (none open, no order written), and `retry`
/// executing once, committed.
async fn rolled_back_then_the_retry_executes(
    service: &Service,
    app: &Router,
    retry: support::app::Req,
) {
    until(|| async { service.store.open_transactions() == 0 }).await;
    assert_eq!(service.rows().await, 0);
    let retry = send(app, retry).await;
    assert_eq!(retry.status, StatusCode::CREATED, "{:?}", retry.body);
    assert_eq!(
        (service.rows().await, service.store.open_transactions()),
        (1, 0)
    );
}

/// A response body streaming rows from the execution's transaction (tokio-postgres's
/// `query_raw`) past `max_response_body`, so handed on only after its record: the
/// completion and the `COMMIT` queue behind rows nobody reads. They are given up after the
/// lease, the connection closed, and the request answered, where it hung for good with its
/// connection and the key.
#[tokio::test]
#[ignore = "needs PostgreSQL: scripts/test.sh"]
async fn a_body_streaming_from_the_transaction_cannot_hold_its_commit_for_ever() {
    use futures_util::StreamExt;
    let store = Driver::TokioPostgres.transactional().await;
    let route = post(|tx: PostgresTransaction| async move {
        let sql = "SELECT repeat('x', 1000) FROM generate_series(1, 20000)";
        let rows = tx.query_raw(sql, std::iter::empty::<&str>()).await.unwrap();
        let body = rows.map(|row| {
            let row = row.map_err(std::io::Error::other)?;
            Ok::<_, std::io::Error>(bytes::Bytes::from(row.get::<_, String>(0)))
        });
        (StatusCode::CREATED, axum::body::Body::from_stream(body))
    });
    let layer = IdempotencyLayer::new(store.clone())
        .allow_anonymous()
        .lease(Duration::from_secs(2))
        .max_response_body(64 * 1024);
    let app = Router::new().route("/export", route.layer(layer));
    let export = || request("/export").key("streamed").body("{}");
    let answer = tokio::time::timeout(Duration::from_secs(20), send(&app, export()))
        .await
        .expect("answered");
    assert_eq!(
        answer.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{:?}",
        answer.body
    );
    until(|| async { store.open_transactions() == 0 }).await;
}

/// Waits, up to ten seconds, until `holds`.
async fn until<F: Future<Output = bool>>(holds: impl Fn() -> F) {
    for _ in 0..200 {
        if holds().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("not within ten seconds");
}
