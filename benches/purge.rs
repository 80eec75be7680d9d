//! Purging a large backlog of expired PostgreSQL rows while claims go on: how many rows a
//! second `purge_expired()` deletes in its bounded batches, and what it does to the latency
//! of the claims made meanwhile, next to one unbatched `DELETE` of the same backlog.
//!
//! Each pass fills a table of its own with `ROWS` expired completed rows (default
//! 1 000 000, one `INSERT … SELECT generate_series`), then purges them while `CLAIMERS`
//! tasks (default 2) claim through the store API, one claim after another: half of the
//! claims take a fresh key, half reuse the key of a random expired row (a client reusing a
//! key after its TTL), which takes that row over, and so must wait for a transaction that
//! is deleting it. Every claim made during the purge is timed. Claims are also timed for
//! two seconds before the purge, for reference. Prints a Markdown table.
//!
//! `cargo bench --bench purge` (PostgreSQL: `DATABASE_URL`, default the local server; the
//! table goes in schema `idempotency_tests` and is dropped at the end).

use std::{
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use http::HeaderValue;
use tokio_postgres::NoTls;
use tower_idempotency::{IdempotencyKey, PostgresStore, Scope, Store};

const SCHEMA: &str = "idempotency_tests";
const ENDPOINT: &str = "POST /v1/payments";

fn env_number(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .map(|value| value.parse().unwrap_or_else(|_| panic!("{name}={value}")))
        .unwrap_or(default)
}

fn scope(key: &str) -> Scope {
    let key = IdempotencyKey::parse(&HeaderValue::from_str(key).unwrap()).unwrap();
    Scope::new(None, ENDPOINT.to_owned(), key)
}

/// Fills `table` with `rows` completed rows that expired an hour ago, keys `expired-<n>`.
async fn fill(client: &tokio_postgres::Client, table: &str, rows: u64) -> Duration {
    client
        .batch_execute(&format!("TRUNCATE {table}"))
        .await
        .unwrap();
    let started = Instant::now();
    let sql = format!(
        "INSERT INTO {table} (idempotency_key, endpoint, principal, request_hash, status,
             status_code, response_headers, response_body, claim_token, created_at,
             completed_at, expires_at, resource_id)
         SELECT 'expired-' || n, '{ENDPOINT}', '', sha256(n::text::bytea), 'completed', 201,
             '\\x00000000'::bytea, convert_to(repeat('x', 200), 'UTF8'),
             substr(sha256(n::text::bytea), 1, 16), now() - interval '2 hours',
             now() - interval '2 hours', now() - interval '1 hour', 'pay_' || n
         FROM generate_series(1, $1::bigint) AS n"
    );
    client.execute(&sql, &[&(rows as i64)]).await.unwrap();
    client
        .batch_execute(&format!("ANALYZE {table}"))
        .await
        .unwrap();
    started.elapsed()
}

/// Claims until `stop`, alternating a fresh key and the key of a random expired row;
/// returns each claim's latency.
async fn claim_until(
    store: PostgresStore,
    stop: Arc<AtomicBool>,
    rows: u64,
    name: usize,
) -> Vec<Duration> {
    let fingerprint = tower_idempotency::Fingerprint::from_bytes([9; 32]);
    let mut latencies = Vec::new();
    let mut n = 0u64;
    while !stop.load(Ordering::Relaxed) {
        n += 1;
        let key = if n.is_multiple_of(2) {
            format!("expired-{}", rand::random_range(1..=rows))
        } else {
            format!("fresh-{name}-{n}-{:x}", rand::random::<u32>())
        };
        let scope = scope(&key);
        let started = Instant::now();
        store
            .claim(&scope, fingerprint, Duration::from_secs(60))
            .await
            .unwrap();
        latencies.push(started.elapsed());
    }
    latencies
}

/// Runs `claimers` claiming tasks while `work` runs; returns what `work` returned, how long
/// it took, and every claim's latency.
async fn with_claims<F, T>(
    store: &PostgresStore,
    claimers: usize,
    rows: u64,
    work: F,
) -> (T, Duration, Vec<Duration>)
where
    F: std::future::Future<Output = T>,
{
    let stop = Arc::new(AtomicBool::new(false));
    let tasks: Vec<_> = (0..claimers)
        .map(|name| tokio::spawn(claim_until(store.clone(), stop.clone(), rows, name)))
        .collect();
    let started = Instant::now();
    let output = work.await;
    let took = started.elapsed();
    stop.store(true, Ordering::Relaxed);
    let mut latencies = Vec::new();
    for task in tasks {
        latencies.extend(task.await.unwrap());
    }
    (output, took, latencies)
}

fn ms(duration: Duration) -> f64 {
    duration.as_secs_f64() * 1000.0
}

/// `count | p50 / p99 / max` of `latencies`, in milliseconds.
fn summary(latencies: &mut [Duration]) -> String {
    latencies.sort_unstable();
    let at = |q: f64| latencies[((latencies.len() - 1) as f64 * q).round() as usize];
    format!(
        "{} | {:.2} / {:.2} / {:.1}",
        latencies.len(),
        ms(at(0.5)),
        ms(at(0.99)),
        ms(*latencies.last().unwrap())
    )
}

#[tokio::main]
async fn main() {
    let rows = env_number("ROWS", 1_000_000);
    let claimers = env_number("CLAIMERS", 2) as usize;
    let batch = env_number("BATCH", 1000) as u32;
    let url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into());
    let (client, connection) = tokio_postgres::connect(&url, NoTls).await.unwrap();
    tokio::spawn(connection);
    client
        .batch_execute(&format!("CREATE SCHEMA IF NOT EXISTS {SCHEMA}"))
        .await
        .unwrap();
    let name = format!("bench_purge_{:08x}", rand::random::<u32>());
    let table = format!("{SCHEMA}.{name}");
    let store = PostgresStore::connect(&url)
        .await
        .unwrap()
        .table(SCHEMA, &name)
        .unwrap()
        .purge_batch(batch);
    store.migrate().await.unwrap();

    println!(
        "{rows} expired rows, {claimers} claimers, batches of {batch} (PostgreSQL {})\n",
        client
            .query_one("SHOW server_version", &[])
            .await
            .unwrap()
            .get::<_, String>(0)
    );
    println!(
        "| purge | fill s | purge s | rows/s | claims | claim ms p50 / p99 / max | \
         before the purge: claims | p50 / p99 / max |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|");
    for batched in [true, false] {
        let filled = fill(&client, &table, rows).await;
        let idle = tokio::time::sleep(Duration::from_secs(2));
        let ((), _, mut before) = with_claims(&store, claimers, rows, idle).await;
        let purge = async {
            if batched {
                store.purge_expired().await.unwrap()
            } else {
                let sql = format!("DELETE FROM {table} WHERE expires_at <= now()");
                client.execute(&sql, &[]).await.unwrap()
            }
        };
        let (purged, took, mut during) = with_claims(&store, claimers, rows, purge).await;
        let label = if batched {
            format!("`purge_expired()`, batches of {batch}")
        } else {
            "one `DELETE`".to_owned()
        };
        println!(
            "| {label} | {:.1} | {:.1} | {:.0} | {} | {} |",
            filled.as_secs_f64(),
            took.as_secs_f64(),
            purged as f64 / took.as_secs_f64(),
            summary(&mut during),
            summary(&mut before),
        );
    }
    client
        .batch_execute(&format!("DROP TABLE {table}"))
        .await
        .unwrap();
}
