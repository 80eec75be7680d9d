//! How soon a waiting duplicate answers once its original is done: the time from the
//! original's handler returning (its outcome then goes to the store) to each waiter's
//! replay, p50 and p99, per store, with the waiters on the original's instance or on
//! another one, 1 and 1 000 at a time; and for 1 000, from the original's write returning
//! instead (the store's write left out; on the original's instance the store has begun to
//! wake its waiters by then). The same with a store that announces nothing shows what
//! polling would give, and with Redis stores that sign the records their messages carry,
//! what that saves another instance's waiters. Prints a Markdown table.
//!
//! `cargo bench --bench waiting` (Redis: a redis-server of its own on a free port;
//! PostgreSQL: `DATABASE_URL`, default the local server, on a table of its own;
//! `WAITING_ROWS=memory`, say, measures only the rows whose name contains it).

#[allow(dead_code)] // Shared with the tests, which use all of it.
#[path = "../tests/support/redis_server.rs"]
mod redis_server;

use std::{
    convert::Infallible,
    sync::Arc,
    time::{Duration, Instant},
};

use async_trait::async_trait;
use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use redis_server::RedisServer;
use tokio::sync::Semaphore;
use tower::{Layer, Service, ServiceExt};
use tower_idempotency::{
    store::{Claim, Fenced, Result, Watch},
    ClaimToken, Fingerprint, IdempotencyLayer, MemoryStore, PostgresStore, RedisStore, Scope,
    Store, StoredResponse,
};

/// Rounds per cell: an original and its waiters each.
const ROUNDS_ONE: usize = 300;
const ROUNDS_MANY: usize = 5;
const MANY: usize = 1_000;

/// A store as the benchmark sees it: it notes when each completion's write returned (the
/// waiters' delays are also counted from there, the store's own write left out), and
/// `silent` it announces nothing: its waiters read the key again (20 ms doubling to
/// 200 ms), the fallback every store without notifications gets.
#[derive(Debug)]
struct Observed {
    store: Arc<dyn Store>,
    silent: bool,
    completed: std::sync::Mutex<Option<Instant>>,
}

impl Observed {
    fn new(store: Arc<dyn Store>) -> Self {
        let completed = std::sync::Mutex::new(None);
        Self {
            store,
            silent: false,
            completed,
        }
    }

    fn silent(store: Arc<dyn Store>) -> Self {
        Self {
            silent: true,
            ..Self::new(store)
        }
    }

    /// When the last completion's write returned.
    fn completed(&self) -> Instant {
        self.completed.lock().unwrap().expect("a completion")
    }
}

#[async_trait]
impl Store for Observed {
    async fn claim_with_token(
        &self,
        scope: &Scope,
        fingerprint: Fingerprint,
        token: ClaimToken,
        lease: Duration,
    ) -> Result<Claim> {
        let claim = self
            .store
            .claim_with_token(scope, fingerprint, token, lease);
        claim.await
    }
    async fn complete(
        &self,
        scope: &Scope,
        token: ClaimToken,
        fingerprint: Fingerprint,
        response: &StoredResponse,
        ttl: Duration,
    ) -> Result<Fenced> {
        let complete = self
            .store
            .complete(scope, token, fingerprint, response, ttl);
        let completed = complete.await;
        *self.completed.lock().unwrap() = Some(Instant::now());
        completed
    }
    async fn release(&self, scope: &Scope, token: ClaimToken) -> Result<Fenced> {
        self.store.release(scope, token).await
    }
    async fn extend(&self, scope: &Scope, token: ClaimToken, lease: Duration) -> Result<Fenced> {
        self.store.extend(scope, token, lease).await
    }
    async fn watch(&self, scope: &Scope) -> Result<Option<Watch>> {
        match self.silent {
            true => Ok(None),
            false => self.store.watch(scope).await,
        }
    }
}

/// The handler: requests with `x-gate` wait for a permit first.
fn handler(
    gate: Arc<Semaphore>,
) -> impl Service<
    Request<Full<Bytes>>,
    Response = Response<Full<Bytes>>,
    Error = Infallible,
    Future = impl Send,
> + Clone
       + Send
       + 'static {
    tower::service_fn(move |request: Request<Full<Bytes>>| {
        let gate = gate.clone();
        async move {
            if request.headers().contains_key("x-gate") {
                gate.acquire().await.unwrap().forget();
            }
            let mut response = Response::new(Full::new(Bytes::from_static(b"{\"id\":1}")));
            *response.status_mut() = StatusCode::CREATED;
            Ok::<_, Infallible>(response)
        }
    })
}

fn request(key: &str, gated: bool) -> Request<Full<Bytes>> {
    let mut builder = Request::post("/v1/payments").header("idempotency-key", key);
    if gated {
        builder = builder.header("x-gate", "1");
    }
    builder.body(Full::new(Bytes::from_static(b"{}"))).unwrap()
}

/// One cell: `rounds` originals through `first`, each with `waiters` duplicates through
/// `second`; the delays to each waiter's answer from its original's handler returning,
/// and from the original's write returning.
async fn delays(
    first: Arc<dyn Store>,
    second: Arc<dyn Store>,
    waiters: usize,
    rounds: usize,
) -> (Vec<Duration>, Vec<Duration>) {
    let timed = Arc::new(Observed::new(first));
    let first: Arc<dyn Store> = timed.clone();
    let gate = Arc::new(Semaphore::new(0));
    let layer = |store: Arc<dyn Store>| {
        IdempotencyLayer::from_shared(store)
            .allow_anonymous()
            .wait_for_original(Duration::from_secs(30))
            .max_waiting(2 * MANY)
    };
    let original_service = layer(first).layer(handler(gate.clone()));
    let waiting_layer = layer(second);
    let waiting_service = waiting_layer.layer(handler(gate.clone()));
    let mut delays = Vec::with_capacity(rounds * waiters);
    let mut from_write = Vec::with_capacity(rounds * waiters);
    for _ in 0..rounds {
        let key = format!("{:032x}", rand::random::<u128>());
        let original = tokio::spawn(original_service.clone().oneshot(request(&key, true)));
        // The original holds the key once its handler waits at the gate.
        tokio::time::sleep(Duration::from_millis(20)).await;
        let duplicates: Vec<_> = (0..waiters)
            .map(|_| {
                let service = waiting_service.clone();
                let request = request(&key, false);
                tokio::spawn(async move {
                    let response = service.oneshot(request).await.unwrap();
                    assert_eq!(response.status(), StatusCode::CREATED);
                    response.into_body().collect().await.unwrap();
                    Instant::now()
                })
            })
            .collect();
        // Every duplicate waits, and has read the key since it began to.
        while waiting_layer.waiting() < waiters {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        tokio::time::sleep(Duration::from_millis(if waiters > 1 { 1000 } else { 5 })).await;
        let released = Instant::now();
        gate.add_permits(1);
        original.await.unwrap().unwrap();
        let written = timed.completed();
        for duplicate in duplicates {
            let answered = duplicate.await.unwrap();
            delays.push(answered.saturating_duration_since(released));
            from_write.push(answered.saturating_duration_since(written));
        }
    }
    (delays, from_write)
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let at = ((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[at]
}

fn ms(duration: Duration) -> String {
    format!("{:.2}", duration.as_secs_f64() * 1000.0)
}

async fn row(name: &str, first: Arc<dyn Store>, second: Arc<dyn Store>) {
    // `WAITING_ROWS=memory` (say) measures only the rows whose name contains it.
    if std::env::var("WAITING_ROWS").is_ok_and(|only| !name.contains(only.as_str())) {
        return;
    }
    let cell = |mut delays: Vec<Duration>| {
        delays.sort();
        let (p50, p99) = (percentile(&delays, 0.5), percentile(&delays, 0.99));
        format!("{} / {}", ms(p50), ms(p99))
    };
    let (one, _) = delays(first.clone(), second.clone(), 1, ROUNDS_ONE).await;
    let (many, many_from_write) = delays(first, second, MANY, ROUNDS_MANY).await;
    let (one, many, many_from_write) = (cell(one), cell(many), cell(many_from_write));
    println!("| {name} | {one} | {many} | {many_from_write} |");
}

async fn redis_store(url: &str, prefix: &str) -> Arc<dyn Store> {
    let store = RedisStore::open(url).await.unwrap().prefix(prefix);
    Arc::new(store.announce_outcomes())
}

/// [`redis_store`], its completions' messages carrying their records, signed.
async fn redis_store_signed(url: &str, prefix: &str) -> Arc<dyn Store> {
    let store = RedisStore::open(url).await.unwrap().prefix(prefix);
    Arc::new(store.announce_signed_records(b"the instances' shared secret"))
}

async fn postgres_store(url: &str) -> Arc<dyn Store> {
    let store = PostgresStore::connect(url)
        .await
        .unwrap()
        .table("public", "idempotency_bench_waiting")
        .unwrap()
        .announce_outcomes();
    store.migrate().await.unwrap();
    Arc::new(store)
}

#[tokio::main]
async fn main() {
    let redis = RedisServer::start();
    let redis_url = redis.url();
    let postgres_url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into());

    println!(
        "| store, where the waiters are | 1 waiter: p50 / p99 ms | {MANY} waiters: p50 / p99 ms | {MANY}, from the write: p50 / p99 ms |"
    );
    println!("|---|---:|---:|---:|");
    let memory: Arc<dyn Store> = Arc::new(MemoryStore::new());
    row("memory, same instance", memory.clone(), memory).await;

    let a = redis_store(&redis_url, "bench:").await;
    row("Redis, same instance", a.clone(), a.clone()).await;
    let b = redis_store(&redis_url, "bench:").await;
    row("Redis, another instance", a.clone(), b.clone()).await;
    row(
        "Redis, another instance, polling (no announcements)",
        a,
        Arc::new(Observed::silent(b)),
    )
    .await;
    let a = redis_store_signed(&redis_url, "bench:").await;
    let b = redis_store_signed(&redis_url, "bench:").await;
    row("Redis, another instance, signed records", a, b).await;

    let a = postgres_store(&postgres_url).await;
    row("PostgreSQL, same instance", a.clone(), a.clone()).await;
    let b = postgres_store(&postgres_url).await;
    row("PostgreSQL, another instance", a, b).await;
}
