//! The payments example server.
//!
//! ```sh
//! cargo run --example payments                                  # in-memory store
//! REDIS_URL=redis://127.0.0.1:6379/ cargo run --example payments # Redis
//! DATABASE_URL=postgres://localhost/app cargo run --example payments --features postgres
//! ```
//!
//! Environment: `PAYMENTS_ADDR` (default `127.0.0.1:3000`); the store: `REDIS_URL` (one
//! Redis), `REDIS_CLUSTER_URLS` (comma-separated seed nodes of a Redis Cluster),
//! `REDIS_SENTINEL_URLS` (comma-separated sentinels) with `REDIS_SENTINEL_MASTER` (the
//! monitored name), `DATABASE_URL` (PostgreSQL), else memory; `IDEMPOTENCY_REPLICAS=<n>`
//! makes each claim and completion on Redis wait for `n` replicas (for at most
//! `IDEMPOTENCY_REPLICAS_TIMEOUT_MS`, default 1000); `IDEMPOTENCY_TTL_SECS`,
//! `IDEMPOTENCY_LEASE_SECS`; `IDEMPOTENCY_CACHE_RECORDS` (default
//! 100000, 0 to turn off) sizes the local cache of completed records kept in front of Redis
//! or PostgreSQL; `PAYMENTS_STATS=payments` makes
//! `GET /v1/stats` report the payments counter alone, for load harnesses that read one
//! number from it.

mod app;

use std::{sync::Arc, time::Duration};

use tower_idempotency::{store::CachedStore, MemoryStore, Store};

/// How long a shutdown waits for executions to record their outcome: the default lease,
/// past which their keys are free again anyway.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(30);

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,tower_idempotency=info".into()),
        )
        .init();

    let mut timing = app::Timing::default();
    if let Some(secs) = env_secs("IDEMPOTENCY_TTL_SECS")? {
        timing.ttl = secs;
    }
    if let Some(secs) = env_secs("IDEMPOTENCY_LEASE_SECS")? {
        timing.lease = secs;
    }
    let store = store().await?;
    tracing::info!(?store, ?timing, "payments store");
    let (app, stats) = app::router(store, timing);
    if std::env::var("PAYMENTS_STATS").as_deref() == Ok("payments") {
        stats.report_payments_only();
    }

    let addr = std::env::var("PAYMENTS_ADDR").unwrap_or_else(|_| "127.0.0.1:3000".into());
    let listener = tokio::net::TcpListener::bind(&addr).await?;
    tracing::info!("payments listening on http://{}", listener.local_addr()?);
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown())
        .await?;
    // Executions whose client went away still record their outcome before the process ends.
    if !stats.in_flight.settled(SHUTDOWN_GRACE).await {
        tracing::error!(
            unrecorded = stats.in_flight.count(),
            "shutting down with executions still unrecorded"
        );
    }
    Ok(())
}

async fn store() -> Result<Arc<dyn Store>, Box<dyn std::error::Error>> {
    let cache_records = match std::env::var("IDEMPOTENCY_CACHE_RECORDS") {
        Ok(value) => value
            .parse::<usize>()
            .map_err(|_| format!("IDEMPOTENCY_CACHE_RECORDS={value} is not a count"))?,
        Err(_) => 100_000,
    };
    // Replays of records this process has read once need no round trip to a shared store.
    let shared = |store: Arc<dyn Store>| -> Arc<dyn Store> {
        match cache_records {
            0 => store,
            records => Arc::new(CachedStore::new(store, records)),
        }
    };
    #[cfg(feature = "redis")]
    if let Some(redis) = redis_store().await? {
        return Ok(shared(Arc::new(redis)));
    }
    #[cfg(not(feature = "redis"))]
    for name in ["REDIS_URL", "REDIS_CLUSTER_URLS", "REDIS_SENTINEL_URLS"] {
        if std::env::var(name).is_ok() {
            return Err(format!("{name} is set, but this build has no `redis` feature").into());
        }
    }
    if let Ok(url) = std::env::var("DATABASE_URL") {
        #[cfg(feature = "postgres")]
        {
            let store = tower_idempotency::PostgresStore::connect(&url).await?;
            store.migrate().await?;
            store.spawn_purge(Duration::from_secs(3600));
            return Ok(shared(Arc::new(store)));
        }
        #[cfg(not(feature = "postgres"))]
        tracing::warn!(%url, "DATABASE_URL is set, but this build has no `postgres` feature: using memory");
    }
    Ok(Arc::new(MemoryStore::new()))
}

/// The Redis store the environment names, if any: a cluster, a Sentinel-managed primary or
/// one server.
#[cfg(feature = "redis")]
async fn redis_store() -> Result<Option<tower_idempotency::RedisStore>, Box<dyn std::error::Error>>
{
    use tower_idempotency::RedisStore;
    let list = |value: String| -> Vec<String> {
        value
            .split(',')
            .map(str::trim)
            .filter(|url| !url.is_empty())
            .map(str::to_owned)
            .collect()
    };
    let store = if let Ok(urls) = std::env::var("REDIS_CLUSTER_URLS") {
        RedisStore::cluster(list(urls)).await?
    } else if let Ok(urls) = std::env::var("REDIS_SENTINEL_URLS") {
        let master = std::env::var("REDIS_SENTINEL_MASTER")
            .map_err(|_| "REDIS_SENTINEL_URLS is set without REDIS_SENTINEL_MASTER")?;
        RedisStore::sentinel(list(urls), &master).await?
    } else if let Ok(url) = std::env::var("REDIS_URL") {
        RedisStore::open(&url).await?
    } else {
        return Ok(None);
    };
    let replicas = match std::env::var("IDEMPOTENCY_REPLICAS") {
        Ok(value) => value
            .parse::<u32>()
            .map_err(|_| format!("IDEMPOTENCY_REPLICAS={value} is not a count"))?,
        Err(_) => 0,
    };
    let timeout = match std::env::var("IDEMPOTENCY_REPLICAS_TIMEOUT_MS") {
        Ok(value) => value
            .parse::<u64>()
            .map(Duration::from_millis)
            .map_err(|_| format!("IDEMPOTENCY_REPLICAS_TIMEOUT_MS={value} is not milliseconds"))?,
        Err(_) => Duration::from_secs(1),
    };
    Ok(Some(store.replicas(replicas, timeout)))
}

fn env_secs(name: &str) -> Result<Option<Duration>, String> {
    match std::env::var(name) {
        Ok(value) => value
            .parse::<u64>()
            .map(|secs| Some(Duration::from_secs(secs)))
            .map_err(|_| format!("{name}={value} is not a whole number of seconds")),
        Err(_) => Ok(None),
    }
}

async fn shutdown() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).expect("install SIGTERM handler");
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}
