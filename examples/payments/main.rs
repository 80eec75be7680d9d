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
//! `IDEMPOTENCY_REPLICAS_TIMEOUT_MS`, default 1000); `IDEMPOTENCY_PREFIX` (default
//! `idempotency:`) starts every Redis key; `IDEMPOTENCY_TTL_SECS`,
//! `IDEMPOTENCY_LEASE_SECS`; `IDEMPOTENCY_PROFILE=ietf` answers the layer's rejections as
//! IETF problem details (`application/problem+json`, `422` for a reused key);
//! `IDEMPOTENCY_MAX_RESPONSE_BODY` (bytes) caps recorded responses;
//! `IDEMPOTENCY_WAIT_MS` lets a duplicate of a running request wait that long for its
//! outcome instead of answering `409`;
//! `IDEMPOTENCY_CACHE_RECORDS` (default
//! 100000, 0 to turn off) sizes the local cache of completed records kept in front of Redis
//! or PostgreSQL; `PAYMENTS_STATS=payments` makes
//! `GET /v1/stats` report the payments counter alone, for load harnesses that read one
//! number from it.

mod app;
mod store;

use std::time::Duration;

/// How long a shutdown waits for executions to record their outcome: the default lease,
/// past which their keys are free again anyway.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(30);

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    store::init_logging();

    let mut settings = app::Settings::default();
    if let Some(secs) = store::env_secs("IDEMPOTENCY_TTL_SECS")? {
        settings.ttl = secs;
    }
    if let Some(secs) = store::env_secs("IDEMPOTENCY_LEASE_SECS")? {
        settings.lease = secs;
    }
    settings.problems = store::problems_from_env()?;
    if let Ok(value) = std::env::var("IDEMPOTENCY_MAX_RESPONSE_BODY") {
        let bytes = value.parse().map_err(|_| {
            format!("IDEMPOTENCY_MAX_RESPONSE_BODY={value} is not a number of bytes")
        })?;
        settings.max_response_body = Some(bytes);
    }
    if let Ok(value) = std::env::var("IDEMPOTENCY_WAIT_MS") {
        let millis = value
            .parse()
            .map_err(|_| format!("IDEMPOTENCY_WAIT_MS={value} is not milliseconds"))?;
        settings.wait = Some(Duration::from_millis(millis));
    }
    let store = store::from_env().await?;
    tracing::info!(?store, ?settings, "payments store");
    let (app, stats) = app::router(store, settings);
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

async fn shutdown() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).expect("install SIGTERM handler");
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}
