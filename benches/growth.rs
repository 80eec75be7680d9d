//! How costs grow: Redis memory per record and store round-trip time, by response body
//! size and by the number of records already stored. Prints Markdown tables.
//!
//! `cargo bench --bench growth` (starts a redis-server of its own on a free port).

#[allow(dead_code)] // Shared with the tests, which use all of it.
#[path = "../tests/support/redis_server.rs"]
mod redis_server;

use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, StatusCode};
use redis_server::RedisServer;
use tower_idempotency::{
    store::{Claim, Fenced},
    Fingerprint, IdempotencyKey, MemoryStore, RedisStore, Scope, Store, StoredResponse,
};

const BODY_SIZES: [usize; 5] = [256, 4 * 1024, 64 * 1024, 256 * 1024, 1024 * 1024];
const STORED_KEYS: [usize; 4] = [0, 10_000, 100_000, 500_000];
const TTL: Duration = Duration::from_secs(3600);
const FINGERPRINT: Fingerprint = Fingerprint::from_bytes([7; 32]);
/// Timed operations per measurement, and measurements per cell (the median is reported).
const OPS: usize = 2_000;
const RUNS: usize = 5;

fn scope(i: usize) -> Scope {
    let key = IdempotencyKey::parse(&HeaderValue::from_str(&format!("{i:032x}")).unwrap()).unwrap();
    Scope::new(Some("user_42".into()), "POST /v1/payments".into(), key)
}

fn response(body_len: usize) -> StoredResponse {
    let mut headers = HeaderMap::new();
    headers.insert("content-type", HeaderValue::from_static("application/json"));
    headers.insert(
        "location",
        HeaderValue::from_static("/v1/payments/pay_0123456789"),
    );
    StoredResponse {
        status: StatusCode::CREATED,
        headers,
        body: Bytes::from(vec![b'x'; body_len]),
        trailers: None,
    }
}

/// Claims and completes `count` keys from `first`, 64 at a time.
async fn fill(store: &dyn Store, first: usize, count: usize, body_len: usize) {
    let stored = response(body_len);
    let mut next = first;
    while next < first + count {
        let batch = (next..(next + 64).min(first + count)).map(|i| {
            let stored = &stored;
            async move {
                let scope = scope(i);
                let Claim::Claimed(token) = store.claim(&scope, FINGERPRINT, TTL).await.unwrap()
                else {
                    panic!("key {i} was taken")
                };
                let fenced = store
                    .complete(&scope, token, FINGERPRINT, stored, TTL)
                    .await
                    .unwrap();
                assert_eq!(fenced, Fenced::Applied);
            }
        });
        futures_util::future::join_all(batch).await;
        next += 64;
    }
}

/// Median microseconds per replay claim over `OPS` sequential claims of stored keys.
async fn replay_micros(store: &dyn Store, stored: usize) -> f64 {
    let mut runs = Vec::with_capacity(RUNS);
    for run in 0..RUNS {
        let started = Instant::now();
        for op in 0..OPS {
            let i = (op * 7919 + run) % stored.max(1);
            let claim = store.claim(&scope(i), FINGERPRINT, TTL).await.unwrap();
            assert!(matches!(claim, Claim::Completed { .. }));
        }
        runs.push(started.elapsed().as_secs_f64() * 1e6 / OPS as f64);
    }
    runs.sort_by(f64::total_cmp);
    runs[RUNS / 2]
}

fn used_memory(server: &RedisServer) -> u64 {
    let info = server.cli(&["INFO", "memory"]);
    info.lines()
        .find_map(|line| line.strip_prefix("used_memory:"))
        .and_then(|v| v.trim().parse().ok())
        .expect("used_memory in INFO memory")
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let server = RedisServer::start();
    let redis = RedisStore::open(&server.url()).await.unwrap();

    println!("### By response body size (Redis, {OPS} replays per run, median of {RUNS})\n");
    println!("| body | Redis bytes per record | record / body | replay µs (Redis) | replay µs (memory) |");
    println!("|---:|---:|---:|---:|---:|");
    for body_len in BODY_SIZES {
        server.cli(&["FLUSHALL"]);
        let records = (64 * 1024 * 1024 / body_len).clamp(16, 2_000);
        let before = used_memory(&server);
        fill(&redis, 0, records, body_len).await;
        let per_record = (used_memory(&server) - before) as f64 / records as f64;
        let memory = MemoryStore::new();
        fill(&memory, 0, records, body_len).await;
        println!(
            "| {} | {:.0} | {:.2} | {:.1} | {:.1} |",
            human(body_len),
            per_record,
            per_record / body_len as f64,
            replay_micros(&redis, records).await,
            replay_micros(&memory, records).await,
        );
    }

    println!("\n### By records already stored (256 B bodies)\n");
    println!(
        "| records stored | Redis bytes per record | replay µs (Redis) | replay µs (memory) |"
    );
    println!("|---:|---:|---:|---:|");
    server.cli(&["FLUSHALL"]);
    let memory = MemoryStore::new();
    let base = used_memory(&server);
    let mut stored = 0;
    for target in STORED_KEYS.into_iter().skip(1) {
        fill(&redis, stored, target - stored, 256).await;
        fill(&memory, stored, target - stored, 256).await;
        stored = target;
        let per_record = (used_memory(&server) - base) as f64 / stored as f64;
        println!(
            "| {stored} | {per_record:.0} | {:.1} | {:.1} |",
            replay_micros(&redis, stored).await,
            replay_micros(&memory, stored).await,
        );
    }
}

fn human(bytes: usize) -> String {
    match bytes {
        b if b >= 1024 * 1024 => format!("{} MiB", b / (1024 * 1024)),
        b if b >= 1024 => format!("{} KiB", b / 1024),
        b => format!("{b} B"),
    }
}
