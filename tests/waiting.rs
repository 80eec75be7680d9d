//! Duplicates that wait for their original (`wait_for_original`) on the original's own
//! instance, against every store. (tests/waiting_across_instances.rs has them on another.)

#[macro_use]
mod support;

use std::{sync::Arc, time::Duration};

use axum::http::StatusCode;
use tower_idempotency::{store::Claim, MemoryStore, PostgresStore, RedisStore, Store};

use support::{
    app::*,
    wrapped_store::{ClaimsCounted, Hooks, Operation, Wrapped},
};

/// Runs every case through `$runner` (a macro that takes the cases' names).
macro_rules! every_case {
    ($runner:ident) => {
        $runner!(
            a_waiting_duplicate_gets_the_replay_of_the_original,
            a_waiting_duplicate_executes_when_the_original_is_released,
            after_a_release_one_waiter_executes_and_the_others_get_its_replay,
            past_its_bound_a_duplicate_gets_the_conflict,
            beyond_the_cap_duplicates_get_the_conflict_at_once,
            a_key_reused_with_other_parameters_never_waits;
            not_transactional:
            a_waiting_duplicate_executes_when_the_holder_crashed,
        );
    };
}

every_case!(for_each_store);

/// The same cases on stores that announce their outcomes (Redis pub/sub, PostgreSQL
/// `NOTIFY`), whose waiters are woken rather than left to read their keys again, as
/// `announcing_redis::case` and so on. (The stores above announce nothing: their waiters
/// poll.)
macro_rules! on_announcing_stores {
    ($($case:ident),*; not_transactional: $($more:ident),* $(,)?) => {
        on_announcing_stores!($($case,)* $($more),*);
    };
    ($($case:ident),* $(,)?) => {
        mod announcing {
            on_announcing!(
                #[ignore = "needs Redis: scripts/test.sh"]
                redis, crate::support::redis_store; $($case),*
            );
            on_announcing!(
                #[ignore = "needs a Redis Cluster and a Sentinel set: scripts/test.sh"]
                redis_cluster, crate::support::cluster_store; $($case),*
            );
            on_announcing!(
                #[ignore = "needs a Redis Cluster and a Sentinel set: scripts/test.sh"]
                redis_sentinel, crate::support::sentinel_store; $($case),*
            );
            on_announcing!(
                #[ignore = "needs PostgreSQL: scripts/test.sh"]
                postgres, |_| crate::support::postgres_store(); $($case),*
            );
        }
    };
}

/// The cases as `$module::case`, each on the store that `$open(case name)` opens, made to
/// announce its outcomes, with the attribute `$attr` (the server that store needs).
macro_rules! on_announcing {
    (#[$attr:meta] $module:ident, $open:expr; $($case:ident),*) => {
        mod $module {
            $(#[tokio::test]
            #[$attr]
            async fn $case() {
                let store = ($open)(stringify!($case)).await;
                super::super::$case(std::sync::Arc::new(store.announce_outcomes())).await
            })*
        }
    };
}

every_case!(on_announcing_stores);

const BOUND: Duration = Duration::from_secs(10);

fn waiting_layer(store: &Arc<dyn Store>) -> tower_idempotency::IdempotencyLayer {
    layer(store).wait_for_original(BOUND)
}

async fn a_waiting_duplicate_gets_the_replay_of_the_original(store: Arc<dyn Store>) {
    let handler = Handler::default();
    let app = router(&handler, waiting_layer(&store));
    let original = spawn_send(&app, post_waiting("w").body("amount=1"));
    until_executing(&handler, 1).await;
    let duplicates: Vec<_> = (0..3)
        .map(|_| spawn_send(&app, post("/pay").key("w").body("amount=1")))
        .collect();
    for duplicate in &duplicates {
        still_waiting(duplicate).await;
    }
    handler.gate.add_permits(1);
    let original = original.await.unwrap();
    assert_eq!(original.status, StatusCode::CREATED);
    for duplicate in duplicates {
        let duplicate = duplicate.await.unwrap();
        assert!(duplicate.replayed());
        assert_eq!(
            (duplicate.status, &duplicate.body),
            (original.status, &original.body)
        );
    }
    assert_eq!(handler.executions(), 1);
}

async fn a_waiting_duplicate_executes_when_the_original_is_released(store: Arc<dyn Store>) {
    let handler = Handler::default();
    let app = router(&handler, waiting_layer(&store));
    // The original answers 503 (released: its outcome was unknown).
    let original = spawn_send(&app, post_waiting("r").header("x-status", "503"));
    until_executing(&handler, 1).await;
    let duplicate = spawn_send(&app, post("/pay").key("r"));
    still_waiting(&duplicate).await;
    handler.gate.add_permits(1);
    assert_eq!(
        original.await.unwrap().status,
        StatusCode::SERVICE_UNAVAILABLE
    );
    let duplicate = duplicate.await.unwrap();
    assert_eq!(duplicate.status, StatusCode::CREATED);
    assert!(!duplicate.replayed(), "the duplicate executed");
    assert_eq!(handler.executions(), 2);
}

async fn after_a_release_one_waiter_executes_and_the_others_get_its_replay(store: Arc<dyn Store>) {
    let handler = Handler::default();
    let app = router(&handler, waiting_layer(&store));
    let original = spawn_send(&app, post_waiting("many").header("x-status", "503"));
    until_executing(&handler, 1).await;
    let duplicates: Vec<_> = (0..4)
        .map(|_| spawn_send(&app, post("/pay").key("many")))
        .collect();
    for duplicate in &duplicates {
        still_waiting(duplicate).await;
    }
    handler.gate.add_permits(1);
    original.await.unwrap();
    let mut answers = Vec::new();
    for duplicate in duplicates {
        answers.push(duplicate.await.unwrap());
    }
    let executed: Vec<_> = answers.iter().filter(|a| !a.replayed()).collect();
    assert_eq!(
        executed.len(),
        1,
        "exactly one waiter takes the released key"
    );
    for answer in &answers {
        assert_eq!(
            (answer.status, &answer.body),
            (StatusCode::CREATED, &executed[0].body)
        );
    }
    assert_eq!(handler.executions(), 2);
}

/// Not transactional: a transaction holds its key while its connection lives, whatever the
/// lease (`tests/transactional.rs` terminates a holder's backend instead).
async fn a_waiting_duplicate_executes_when_the_holder_crashed(store: Arc<dyn Store>) {
    let handler = Handler::default();
    let app = router(&handler, waiting_layer(&store));
    claim_and_crash(&*store, "c", Duration::from_millis(400)).await;
    let duplicate = send(&app, post("/pay").key("c")).await;
    assert_eq!(duplicate.status, StatusCode::CREATED);
    assert!(!duplicate.replayed());
    assert_eq!(handler.executions(), 1);
}

async fn past_its_bound_a_duplicate_gets_the_conflict(store: Arc<dyn Store>) {
    let handler = Handler::default();
    let app = router(
        &handler,
        layer(&store).wait_for_original(Duration::from_millis(300)),
    );
    let original = spawn_send(&app, post_waiting("b"));
    until_executing(&handler, 1).await;
    let duplicate = send(&app, post("/pay").key("b")).await;
    assert_eq!(duplicate.status, StatusCode::CONFLICT);
    assert_eq!(duplicate.error(), "request_in_progress");
    assert!(duplicate.headers.contains_key("retry-after"));
    handler.gate.add_permits(1);
    assert_eq!(original.await.unwrap().status, StatusCode::CREATED);
    assert_eq!(handler.executions(), 1);
}

async fn beyond_the_cap_duplicates_get_the_conflict_at_once(store: Arc<dyn Store>) {
    let handler = Handler::default();
    let app = router(&handler, waiting_layer(&store).max_waiting(1));
    let original = spawn_send(&app, post_waiting("cap"));
    until_executing(&handler, 1).await;
    let waiting = spawn_send(&app, post("/pay").key("cap"));
    still_waiting(&waiting).await;
    // The one place is taken: the next duplicate does not wait.
    let turned_away = tokio::time::timeout(BOUND / 2, send(&app, post("/pay").key("cap")))
        .await
        .expect("answered without waiting for the original");
    assert_eq!(turned_away.error(), "request_in_progress");
    handler.gate.add_permits(1);
    original.await.unwrap();
    assert!(waiting.await.unwrap().replayed());
    // Its place is free again.
    let original = spawn_send(&app, post_waiting("cap2"));
    until_executing(&handler, 2).await;
    let waiting = spawn_send(&app, post("/pay").key("cap2"));
    still_waiting(&waiting).await;
    handler.gate.add_permits(1);
    original.await.unwrap();
    assert!(waiting.await.unwrap().replayed());
    assert_eq!(handler.executions(), 2);
}

async fn a_key_reused_with_other_parameters_never_waits(store: Arc<dyn Store>) {
    let handler = Handler::default();
    let app = router(&handler, waiting_layer(&store));
    let original = spawn_send(&app, post_waiting("m").body("amount=1"));
    until_executing(&handler, 1).await;
    let reused = tokio::time::timeout(
        BOUND / 2,
        send(&app, post("/pay").key("m").body("amount=2")),
    )
    .await
    .expect("answered without waiting");
    assert_eq!(
        reused.error(),
        "idempotency_key_reused_with_different_params"
    );
    handler.gate.add_permits(1);
    original.await.unwrap();
    assert_eq!(handler.executions(), 1);
}

/// A store and how many keys its waiters watch now.
enum Watching {
    Memory(MemoryStore),
    Redis(RedisStore),
    Postgres(PostgresStore),
}

impl Watching {
    fn store(&self) -> Arc<dyn Store> {
        match self {
            Self::Memory(store) => Arc::new(store.clone()),
            Self::Redis(store) => Arc::new(store.clone()),
            Self::Postgres(store) => Arc::new(store.clone()),
        }
    }

    async fn watched(&self) -> usize {
        match self {
            Self::Memory(store) => store.watched(),
            Self::Redis(store) => store.watched().await,
            Self::Postgres(store) => store.watched(),
        }
    }

    /// Waits (bounded) until nothing is watched, at once in memory: a Redis subscription
    /// ends in a task of its own.
    async fn until_nothing_watched(&self) {
        if let Self::Memory(store) = self {
            assert_eq!(store.watched(), 0);
            return;
        }
        for _ in 0..200 {
            if self.watched().await == 0 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("still {} keys watched", self.watched().await);
    }
}

#[tokio::test]
async fn a_waiter_that_goes_away_leaves_nothing_behind_in_memory() {
    a_waiter_that_goes_away_leaves_nothing_behind(Watching::Memory(MemoryStore::new())).await;
}

#[tokio::test]
#[ignore = "needs Redis: scripts/test.sh"]
async fn a_waiter_that_goes_away_leaves_nothing_behind_on_redis() {
    let store = crate::support::redis_store("waiter-goes-away").await;
    let watching = Watching::Redis(store.announce_outcomes());
    a_waiter_that_goes_away_leaves_nothing_behind(watching).await;
}

#[tokio::test]
#[ignore = "needs PostgreSQL: scripts/test.sh"]
async fn a_waiter_that_goes_away_leaves_nothing_behind_on_postgres() {
    let store = crate::support::postgres_store().await;
    let watching = Watching::Postgres(store.announce_outcomes());
    a_waiter_that_goes_away_leaves_nothing_behind(watching).await;
}

/// A waiter whose client goes away leaves nothing behind: no watch on the store, no place
/// among the waiters.
async fn a_waiter_that_goes_away_leaves_nothing_behind(watching: Watching) {
    let store = watching.store();
    let handler = Handler::default();
    let app = router(&handler, waiting_layer(&store).max_waiting(2));
    let original = spawn_send(&app, post_waiting("gone"));
    until_executing(&handler, 1).await;
    let waiters: Vec<_> = (0..2)
        .map(|_| spawn_send(&app, post("/pay").key("gone")))
        .collect();
    for waiter in &waiters {
        still_waiting(waiter).await;
    }
    assert_eq!(
        watching.watched().await,
        1,
        "one watch per key, shared by its waiters"
    );
    for waiter in &waiters {
        waiter.abort();
    }
    for waiter in waiters {
        assert!(waiter.await.unwrap_err().is_cancelled());
    }
    watching.until_nothing_watched().await;
    // Both places are free again: two new duplicates wait.
    let waiters: Vec<_> = (0..2)
        .map(|_| spawn_send(&app, post("/pay").key("gone")))
        .collect();
    for waiter in &waiters {
        still_waiting(waiter).await;
    }
    handler.gate.add_permits(1);
    original.await.unwrap();
    for waiter in waiters {
        assert!(waiter.await.unwrap().replayed());
    }
    watching.until_nothing_watched().await;
    assert_eq!(handler.executions(), 1);
}

/// The `payments` example with `IDEMPOTENCY_WAIT_MS`: a double-tapped payment gets the
/// payment, not a `409`.
#[tokio::test]
async fn the_payments_example_lets_a_double_tap_wait() {
    use support::payments::{fresh_key, slow_charge, ExampleProcess};

    let example = ExampleProcess::start(&[("IDEMPOTENCY_WAIT_MS", "10000")]).await;
    let api = example.api();
    let key = fresh_key();
    let first = api.pay_in_background(&key, "alice", &slow_charge(1000));
    api.wait_for_payments(1).await;
    let second = api.pay(&key, "alice", &slow_charge(1000)).await;
    let first = first.await.unwrap();
    let id = first.assert_payment(700, "usd");
    assert!(second.replayed());
    assert_eq!(second.assert_payment(700, "usd"), id);
    assert_eq!(api.stats().await.payments_executed, 1);
}

/// A duplicate keeps its bound when its store cannot start watching: a PostgreSQL store
/// whose new connections (the one it listens on among them) reach a server that accepts
/// them and never answers, as behind a proxy out of connections, while its pool's
/// connections still work. The duplicate answers at its bound, not when the listening
/// connection gives up.
#[tokio::test]
#[ignore = "needs PostgreSQL: scripts/test.sh"]
async fn postgres_a_waiter_keeps_its_bound_when_no_listening_connection_answers() {
    let config: tokio_postgres::Config = support::database_url().parse().unwrap();
    let upstream = match (&config.get_hosts()[0], config.get_ports().first()) {
        (tokio_postgres::config::Host::Tcp(host), port) => {
            format!("{host}:{}", port.copied().unwrap_or(5432))
        }
        _ => panic!("DATABASE_URL must name a TCP host"),
    };
    let proxy = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = proxy.local_addr().unwrap().port();
    let forwarding = Arc::new(std::sync::atomic::AtomicBool::new(true));
    tokio::spawn({
        let forwarding = forwarding.clone();
        async move {
            let mut unanswered = Vec::new();
            loop {
                let (mut client, _) = proxy.accept().await.unwrap();
                if forwarding.load(std::sync::atomic::Ordering::SeqCst) {
                    let mut server = tokio::net::TcpStream::connect(&upstream).await.unwrap();
                    tokio::spawn(async move {
                        let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                    });
                } else {
                    unanswered.push(client);
                }
            }
        }
    });
    let url = format!(
        "host=127.0.0.1 port={port} user={} dbname={}{}",
        config.get_user().unwrap_or("postgres"),
        config.get_dbname().unwrap_or("postgres"),
        match config.get_password() {
            Some(password) => format!(" password={}", String::from_utf8_lossy(password)),
            None => String::new(),
        }
    );
    let store = PostgresStore::connect(&url).await.unwrap();
    let store: Arc<dyn Store> = Arc::new(support::on_own_table(store).await.announce_outcomes());
    let handler = Handler::default();
    let app = router(
        &handler,
        layer(&store).wait_for_original(Duration::from_millis(300)),
    );
    // The pool's connections are open; from now on, no new one is answered.
    for key in ["warm-1", "warm-2", "warm-3"] {
        send(&app, post("/pay").key(key)).await.assert_executed();
    }
    forwarding.store(false, std::sync::atomic::Ordering::SeqCst);

    let original = spawn_send(&app, post_waiting("held"));
    until_executing(&handler, 4).await;
    let asked = std::time::Instant::now();
    let duplicate = send(&app, post("/pay").key("held")).await;
    let waited = asked.elapsed();
    assert_eq!(duplicate.error(), "request_in_progress");
    // The bound is 300 ms; the listening connection would give up after 2 s.
    assert!(
        waited < Duration::from_millis(1500),
        "answered after {waited:?}"
    );
    handler.gate.add_permits(1);
    assert_eq!(original.await.unwrap().status, StatusCode::CREATED);
    assert_eq!(handler.executions(), 4);
}

/// 300 keys a round, each with its original and three waiting duplicates, twenty rounds,
/// on two worker threads: each key executes once, its duplicates get its replay, and once
/// every request has answered nothing is left watched (duplicates woken together drop
/// their watches together, on both threads).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_on_many_keys_leave_nothing_watched() {
    let memory = MemoryStore::new();
    let store: Arc<dyn Store> = Arc::new(memory.clone());
    let handler = Handler::default();
    let layer = waiting_layer(&store);
    let app = router(&handler, layer.clone());
    let per_round = 300;
    for round in 0..20 {
        let keys: Vec<String> = (0..per_round).map(|i| format!("r{round}-k{i}")).collect();
        let originals: Vec<_> = keys
            .iter()
            .map(|key| spawn_send(&app, post_waiting(key)))
            .collect();
        until_executing(&handler, (round + 1) * per_round).await;
        let duplicates: Vec<_> = keys
            .iter()
            .flat_map(|key| (0..3).map(|_| spawn_send(&app, post("/pay").key(key))))
            .collect();
        for _ in 0..200 {
            if layer.waiting() == 3 * per_round {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        handler.gate.add_permits(per_round);
        for original in originals {
            original.await.unwrap().assert_executed();
        }
        for duplicate in duplicates {
            let duplicate = duplicate.await.unwrap();
            assert!(duplicate.replayed(), "{duplicate:?}");
        }
    }
    assert_eq!(handler.executions(), 20 * per_round, "a key executed twice");
    assert_eq!(layer.waiting(), 0);
    assert_eq!(
        memory.watched(),
        0,
        "keys still watched after every waiter answered"
    );
}

/// What a store in front of another changes: its answers tell no time left of a lease, as
/// Redis's do when the holder's clock runs behind the reader's by more than the lease (the
/// holder wrote its deadline by its clock; Redis keeps the key for the lease all the
/// same). Its claims are counted.
#[derive(Debug, Default)]
struct HolderClockBehind {
    reads: ClaimsCounted,
}

impl Hooks for HolderClockBehind {
    fn before(&self, operation: Operation<'_>) -> tower_idempotency::store::Result<()> {
        self.reads.before(operation)
    }

    fn claimed(&self, claim: Claim) -> Claim {
        match claim {
            Claim::InProgress {
                fingerprint,
                running_for,
                ..
            } => Claim::InProgress {
                fingerprint,
                lease_remaining: Duration::ZERO,
                running_for,
            },
            other => other,
        }
    }
}

#[tokio::test]
async fn a_key_held_past_the_lease_it_was_read_with_is_read_with_backoff_in_memory() {
    held_past_its_lease_read_with_backoff(Arc::new(MemoryStore::new())).await;
}

#[tokio::test]
#[ignore = "needs Redis: scripts/test.sh"]
async fn a_key_held_past_the_lease_it_was_read_with_is_read_with_backoff_on_redis() {
    let test = "held_past_its_lease_read_with_backoff";
    let store = support::redis_store(test).await.announce_outcomes();
    held_past_its_lease_read_with_backoff(Arc::new(store)).await;
}

/// A waiter that reads a key still held once the lease it was read with ran out looked
/// at it again every 10 ms until its bound (about a hundred reads a second, each waiter);
/// now as a store that announces nothing is looked at, from 20 ms doubling to 200 ms.
async fn held_past_its_lease_read_with_backoff(inner: Arc<dyn Store>) {
    let skewed = Wrapped::new(inner, HolderClockBehind::default());
    let store: Arc<dyn Store> = skewed.clone();
    let handler = Handler::default();
    let bound = Duration::from_secs(1);
    let app = router(&handler, layer(&store).wait_for_original(bound));
    let original = spawn_send(&app, post_waiting("skewed"));
    until_executing(&handler, 1).await;
    let before = skewed.hooks.reads.count();
    let duplicate = send(&app, post("/pay").key("skewed")).await;
    let reads = skewed.hooks.reads.count() - before;
    assert_eq!(duplicate.status, StatusCode::CONFLICT);
    assert_eq!(duplicate.error(), "request_in_progress");
    // 20 + 40 + 80 + 160 ms, then every 200 ms: 8 reads in the bound, the first included.
    assert!(reads <= 12, "{reads} reads of the key in a 1 s wait");
    handler.gate.add_permits(1);
    assert_eq!(original.await.unwrap().status, StatusCode::CREATED);
    assert_eq!(handler.executions(), 1);
}

/// Claims as slow on their way as `delay_ms` says (a read of a held key on a busy link).
#[derive(Debug, Default)]
struct SlowClaims {
    delay_ms: std::sync::atomic::AtomicU64,
}

impl Hooks for SlowClaims {
    fn claim_delay(&self) -> Duration {
        Duration::from_millis(self.delay_ms.load(std::sync::atomic::Ordering::SeqCst))
    }
}

/// The original completes on one instance 200 ms before the bound of a duplicate waiting on
/// another (woken by Redis's message, so it reads the key), whose read takes 400 ms: the
/// record is there, and the duplicate gets the replay, as one woken by nothing does (it
/// reads once more past its bound). Cut off at its bound, the read answered `409` in
/// progress.
#[tokio::test]
#[ignore = "needs Redis: scripts/test.sh"]
async fn a_waiter_woken_just_before_its_bound_gets_the_replay() {
    let prefix = support::unique_prefix("woken-late");
    let open = || async {
        RedisStore::open(&support::redis_url())
            .await
            .unwrap()
            .prefix(prefix.clone())
            .announce_outcomes()
    };
    let original_store: Arc<dyn Store> = Arc::new(open().await);
    let waiting_store = Wrapped::new(Arc::new(open().await), SlowClaims::default());
    let handler = Handler::default();
    let original_app = router(&handler, layer(&original_store));
    let waiting_app = router(
        &handler,
        layer(&(waiting_store.clone() as Arc<dyn Store>))
            .wait_for_original(Duration::from_millis(1000)),
    );
    let original = spawn_send(&original_app, post_waiting("late"));
    until_executing(&handler, 1).await;
    let duplicate = spawn_send(&waiting_app, post("/pay").key("late"));
    tokio::time::sleep(Duration::from_millis(800)).await;
    let slow = &waiting_store.hooks.delay_ms;
    slow.store(400, std::sync::atomic::Ordering::SeqCst);
    handler.gate.add_permits(1);
    original.await.unwrap().assert_executed();
    let duplicate = duplicate.await.unwrap();
    assert!(duplicate.replayed(), "{duplicate:?}");
    assert_eq!(handler.executions(), 1);
}

/// Fails the next claims it is told to (`Error::Backend`, unsent).
#[derive(Debug, Default)]
struct FailsNextClaims(std::sync::atomic::AtomicUsize);

impl Hooks for FailsNextClaims {
    fn before(&self, operation: Operation<'_>) -> tower_idempotency::store::Result<()> {
        use std::sync::atomic::Ordering::SeqCst;
        let failing = || {
            self.0
                .fetch_update(SeqCst, SeqCst, |n| n.checked_sub(1))
                .is_ok()
        };
        if let Operation::Claim = operation {
            if failing() {
                let failed = "one transient failure".into();
                return Err(tower_idempotency::store::Error::Backend(failed));
            }
        }
        Ok(())
    }
}

/// With `fail_open`, duplicates that waited for an original that was released, whose read
/// of the key (one, shared by them all) failed once, are answered `503`: the store had said
/// another request held their key. Each of them was executed unprotected, five payments
/// from one failed read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_are_never_executed_unprotected_when_their_read_fails() {
    let wrapped = Wrapped::new(Arc::new(MemoryStore::new()), FailsNextClaims::default());
    let store: Arc<dyn Store> = wrapped.clone();
    let handler = Handler::default();
    let layer = layer(&store)
        .fail_open()
        .wait_for_original(Duration::from_secs(5));
    let app = router(&handler, layer);
    let original = spawn_send(&app, post_waiting("fails-open").header("x-status", "503"));
    until_executing(&handler, 1).await;
    let duplicates: Vec<_> = (0..5)
        .map(|_| spawn_send(&app, post("/pay").key("fails-open")))
        .collect();
    for duplicate in &duplicates {
        still_waiting(duplicate).await;
    }
    wrapped
        .hooks
        .0
        .store(1, std::sync::atomic::Ordering::SeqCst);
    handler.gate.add_permits(1);
    let released = original.await.unwrap();
    assert_eq!(released.status, StatusCode::SERVICE_UNAVAILABLE);
    let mut answers = Vec::new();
    for duplicate in duplicates {
        answers.push(duplicate.await.unwrap().status);
    }
    // The original, and at most one duplicate that claimed the freed key after the failed
    // read (a waiter reading then claims it): none executed unprotected.
    assert!(handler.executions() <= 2, "{answers:?}");
}

/// Delays the answers of claims, after the store applied them.
#[derive(Debug, Default)]
struct SlowGrants {
    delay_ms: std::sync::atomic::AtomicU64,
}

impl Hooks for SlowGrants {
    fn claim_answer_delay(&self) -> Duration {
        Duration::from_millis(self.delay_ms.load(std::sync::atomic::Ordering::SeqCst))
    }
}

/// A waiter whose claim of the released key is answered late (1.3 s of a 1.5 s lease) runs
/// its lease from when that claim was sent, as a first claim does, and renews it at once: a
/// third request sent once that lease would have run out finds the key in progress (and,
/// waiting in turn, gets the waiter's replay). Its
/// lease ran from when the wait ended, the first renewal came after the store's lease had
/// run out, and the third request executed under the waiter's handler.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiters_claim_answered_late_is_renewed_in_time() {
    let slow = Wrapped::new(Arc::new(MemoryStore::new()), SlowGrants::default());
    let store: Arc<dyn Store> = slow.clone();
    let handler = Handler::default();
    let lease = Duration::from_millis(1500);
    let app = router(
        &handler,
        layer(&store)
            .lease(lease)
            .wait_for_original(Duration::from_secs(10)),
    );
    let original = spawn_send(&app, post_waiting("late-grant").header("x-status", "503"));
    until_executing(&handler, 1).await;
    let waiter = spawn_send(
        &app,
        post("/pay").key("late-grant").header("x-sleep-ms", "3000"),
    );
    still_waiting(&waiter).await;
    slow.hooks
        .delay_ms
        .store(1300, std::sync::atomic::Ordering::SeqCst);
    handler.gate.add_permits(1);
    assert_eq!(
        original.await.unwrap().status,
        StatusCode::SERVICE_UNAVAILABLE
    );
    until_executing(&handler, 2).await;
    slow.hooks
        .delay_ms
        .store(0, std::sync::atomic::Ordering::SeqCst);
    // Past the lease of the waiter's claim, counted from when it was sent: the third
    // request finds the key in progress, waits in turn, and gets the waiter's replay.
    tokio::time::sleep(Duration::from_millis(400)).await;
    let third = send(&app, post("/pay").key("late-grant")).await;
    assert!(third.replayed(), "{:?}", third.json());
    waiter.await.unwrap().assert_executed();
    assert_eq!(handler.executions(), 2);
}
