//! The store the examples run on, chosen by environment variables, and their logging
//! (shared by `payments` and `grpc_payments`).

use std::{sync::Arc, time::Duration};

use tower_idempotency::{store::CachedStore, MemoryStore, ProblemDetails, Store};

/// The store the environment names: a Redis Cluster, a Sentinel-managed primary, one
/// Redis, PostgreSQL, else memory; a local cache of completed records in front of a shared
/// one.
pub async fn from_env() -> Result<Arc<dyn Store>, Box<dyn std::error::Error>> {
    let cache_records = match std::env::var("IDEMPOTENCY_CACHE_RECORDS") {
        Ok(value) => value
            .parse::<usize>()
            .map_err(|_| format!("IDEMPOTENCY_CACHE_RECORDS={value} is not a count"))?,
        Err(_) => 100_000,
    };
    // Replays of records this process has read once need no round trip to a shared store.
    #[cfg_attr(
        not(any(feature = "redis", feature = "postgres")),
        allow(unused_variables)
    )]
    let shared = |store: Arc<dyn Store>| -> Arc<dyn Store> {
        match cache_records {
            0 => store,
            records => Arc::new(CachedStore::from_shared(store, records)),
        }
    };
    let transactional = transactional_from_env()?;
    // With a ledger or the transactional mode, the records go to the database, whatever
    // else is set.
    let ledger = std::env::var_os("PAYMENTS_LEDGER").is_some() || transactional.is_some();
    #[cfg(feature = "redis")]
    if !ledger {
        if let Some(redis) = redis_store().await? {
            return Ok(shared(Arc::new(redis)));
        }
    }
    #[cfg(not(feature = "redis"))]
    for name in ["REDIS_URL", "REDIS_CLUSTER_URLS", "REDIS_SENTINEL_URLS"] {
        if !ledger && std::env::var(name).is_ok() {
            return Err(format!("{name} is set, but this build has no `redis` feature").into());
        }
    }
    if let Ok(url) = std::env::var("DATABASE_URL") {
        #[cfg(feature = "postgres")]
        {
            // Each row's `resource_id` is the payment's (or refund's) id: the last segment
            // of the `Location` the handlers answer with, the store's default.
            let mut store = tower_idempotency::PostgresStore::connect(&url).await?;
            if let Ok(table) = std::env::var("IDEMPOTENCY_TABLE") {
                let (schema, name) = table
                    .split_once('.')
                    .ok_or_else(|| format!("IDEMPOTENCY_TABLE={table} is not schema.table"))?;
                store = store.table(schema, name)?;
            }
            if std::env::var_os("IDEMPOTENCY_WAIT_MS").is_some() {
                store = store.announce_outcomes();
            }
            // Counted replays all reach the database: the cache keeps none of them.
            if std::env::var_os("IDEMPOTENCY_COUNT_REPLAYS").is_some() {
                store = store.count_replays();
            }
            store.migrate().await?;
            store.spawn_purge(Duration::from_secs(3600));
            match transactional {
                Some(Driver::Sqlx) => store = sqlx_transactional_store(store, &url).await?,
                // The ledger's inserts run on the layer's connections now: the store takes
                // the ledger's 16 too, so both modes hold the same 32 of the database's.
                Some(Driver::TokioPostgres) => store = store.max_connections(32).transactional(),
                None => {}
            }
            return Ok(shared(Arc::new(store)));
        }
        // Not the URL itself: it may hold a password.
        #[cfg(not(feature = "postgres"))]
        {
            let _ = url;
            tracing::warn!(
                "DATABASE_URL is set, but this build has no `postgres` feature: using memory"
            );
        }
    }
    if transactional.is_some() {
        return Err("IDEMPOTENCY_TRANSACTIONAL needs DATABASE_URL".into());
    }
    Ok(Arc::new(MemoryStore::new()))
}

/// The driver of the transactional PostgreSQL mode's transactions.
enum Driver {
    Sqlx,
    TokioPostgres,
}

/// The transactional PostgreSQL mode, if `IDEMPOTENCY_TRANSACTIONAL` asks for it: `1` on an
/// sqlx pool, `tokio-postgres` on the store's own pool.
fn transactional_from_env() -> Result<Option<Driver>, String> {
    match std::env::var("IDEMPOTENCY_TRANSACTIONAL").as_deref() {
        Ok("1") => Ok(Some(Driver::Sqlx)),
        Ok("tokio-postgres") => Ok(Some(Driver::TokioPostgres)),
        Ok(value) => Err(format!(
            "IDEMPOTENCY_TRANSACTIONAL={value}: expected 1 (sqlx) or tokio-postgres"
        )),
        Err(_) => Ok(None),
    }
}

/// `store` in the transactional mode, its executions' transactions on an sqlx pool of the
/// database at `url`: sized for the executions that run at once, two instances to a
/// database of PostgreSQL's default 100 connections.
#[cfg(feature = "postgres")]
async fn sqlx_transactional_store(
    store: tower_idempotency::PostgresStore,
    url: &str,
) -> Result<tower_idempotency::PostgresStore, Box<dyn std::error::Error>> {
    #[cfg(feature = "sqlx")]
    {
        // No ping before each acquire: it would cost every execution a round trip while its
        // transaction holds the connection, and the store replaces a connection the server
        // ended while it was pooled on its own.
        let pool = tower_idempotency::sqlx::postgres::PgPoolOptions::new()
            .max_connections(24)
            .test_before_acquire(false)
            .connect(url)
            .await?;
        Ok(store.transactional_sqlx(pool))
    }
    #[cfg(not(feature = "sqlx"))]
    {
        let _ = (store, url);
        Err("IDEMPOTENCY_TRANSACTIONAL=1, but this build has no `sqlx` feature".into())
    }
}

/// The Redis store the environment names, if any: a cluster, a Sentinel-managed primary or
/// one server; its keys start with `IDEMPOTENCY_PREFIX` (default: the store's `idempotency:`).
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
    let mut store = store.replicas(replicas, timeout);
    match std::env::var("IDEMPOTENCY_REPLICAS_BEST_EFFORT").as_deref() {
        Ok("1") => store = store.replicas_best_effort(),
        Ok(value) => {
            return Err(format!("IDEMPOTENCY_REPLICAS_BEST_EFFORT={value}: expected 1").into())
        }
        Err(_) => {}
    }
    // Requests that wait for their original are woken by every instance's announcements.
    if std::env::var_os("IDEMPOTENCY_WAIT_MS").is_some() {
        store = store.announce_outcomes();
    }
    // Services (or test runs) sharing one Redis keep their keys apart.
    Ok(Some(match std::env::var("IDEMPOTENCY_PREFIX") {
        Ok(prefix) => store.prefix(prefix),
        Err(_) => store,
    }))
}

/// Where the example's problem details point: every problem's `type` and `describedby` link.
pub const PROBLEM_DOCS: &str =
    "https://docs.rs/tower-idempotency/latest/tower_idempotency/struct.ProblemDetails.html";

/// The layer's rejections as `IDEMPOTENCY_PROFILE` names them: `ietf` for the IETF draft's
/// problem details; unset (or `json`) for the crate's JSON errors.
pub fn problems_from_env() -> Result<Option<ProblemDetails>, String> {
    match std::env::var("IDEMPOTENCY_PROFILE").as_deref() {
        Ok("ietf") => Ok(Some(ProblemDetails::new(PROBLEM_DOCS))),
        Ok("json") | Err(_) => Ok(None),
        Ok(other) => Err(format!(
            "IDEMPOTENCY_PROFILE={other}: expected ietf or json"
        )),
    }
}

/// A whole number of seconds from environment variable `name`, if set.
pub fn env_secs(name: &str) -> Result<Option<Duration>, String> {
    match std::env::var(name) {
        Ok(value) => value
            .parse::<u64>()
            .map(|secs| Some(Duration::from_secs(secs)))
            .map_err(|_| format!("{name}={value} is not a whole number of seconds")),
        Err(_) => Ok(None),
    }
}

/// Logs to standard error, filtered by `RUST_LOG` (default: `info`).
pub fn init_logging() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,tower_idempotency=info".into()),
        )
        .init();
}

/// Returns on SIGTERM (how a process manager stops a service) or Ctrl-C: the examples then
/// stop accepting requests and wait for the executions still running to be recorded.
pub async fn shutdown() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).expect("install SIGTERM handler");
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}
