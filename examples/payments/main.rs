//! The payments example server.
//!
//! ```sh
//! cargo run --example payments                                  # in-memory store
//! REDIS_URL=redis://127.0.0.1:6379/ cargo run --example payments # Redis
//! DATABASE_URL=postgres://localhost/app cargo run --example payments --features postgres
//! ```
//!
//! Try it: the same request twice is one payment, replayed (`Idempotent-Replayed: true`);
//! the key with another body is `409`; a slow payment's retry while it runs is `409` with
//! `Retry-After`.
//!
//! ```sh
//! pay() { curl -i localhost:3000/v1/payments -H "Idempotency-Key: $1" \
//!   -H 'Authorization: Bearer alice' -H 'Content-Type: application/json' -d "$2"; }
//! pay k1 '{"amount": 1000, "currency": "usd"}'   # 201, executed
//! pay k1 '{"amount": 1000, "currency": "usd"}'   # 201, replayed, the same id
//! pay k1 '{"amount": 5, "currency": "usd"}'      # 409 idempotency_key_reused_with_different_params
//! pay k2 '{"amount": 1, "currency": "usd", "simulate": "slow", "delay_ms": 5000}' &
//! pay k2 '{"amount": 1, "currency": "usd", "simulate": "slow", "delay_ms": 5000}' # 409 request_in_progress
//! curl localhost:3000/v1/stats                   # handler executions
//! ```
//!
//! Environment: `PAYMENTS_ADDR` (default `127.0.0.1:3000`); the store: `REDIS_URL` (one
//! Redis), `REDIS_CLUSTER_URLS` (comma-separated seed nodes of a Redis Cluster),
//! `REDIS_SENTINEL_URLS` (comma-separated sentinels) with `REDIS_SENTINEL_MASTER` (the
//! monitored name), `DATABASE_URL` (PostgreSQL), else memory; `IDEMPOTENCY_REPLICAS=<n>`
//! makes each claim and completion on Redis wait for `n` replicas (for at most
//! `IDEMPOTENCY_REPLICAS_TIMEOUT_MS`, default 1000; with `IDEMPOTENCY_REPLICAS_BEST_EFFORT=1`
//! a claim they do not acknowledge in time executes anyway, counted, instead of `503`);
//! `IDEMPOTENCY_PREFIX` (default
//! `idempotency:`) starts every Redis key; `IDEMPOTENCY_TTL_SECS`,
//! `IDEMPOTENCY_LEASE_SECS`; `IDEMPOTENCY_PROFILE=ietf` answers the layer's rejections as
//! IETF problem details (`application/problem+json`, `422` for a reused key);
//! `IDEMPOTENCY_MAX_RESPONSE_BODY` (bytes) caps recorded responses;
//! `IDEMPOTENCY_WAIT_MS` lets a duplicate of a running request wait that long for its
//! outcome instead of answering `409`; `IDEMPOTENCY_FAIL_OPEN=1` runs handlers unprotected
//! while the store is unreachable instead of answering `503`;
//! `IDEMPOTENCY_CACHE_RECORDS` (default
//! 100000, 0 to turn off) sizes the local cache of completed records kept in front of Redis
//! or PostgreSQL; `PAYMENTS_STATS=payments` makes
//! `GET /v1/stats` report the payments counter alone, for load harnesses that read one
//! number from it; `PAYMENTS_PROCESSOR_URL` names a processor (another instance) each
//! payment also charges, through the crate's client, with a key derived from the
//! payment's own (feature `client`); `PAYMENTS_LEDGER=postgres` writes each payment to
//! table `payments` in the `DATABASE_URL` database (feature `postgres`);
//! `IDEMPOTENCY_TRANSACTIONAL=1` runs each execution in a transaction of the `DATABASE_URL`
//! database, on an sqlx pool of 24 connections, skipping sqlx's ping before each acquire
//! (feature `sqlx`; `tokio-postgres` instead of `1`: on the store's own pool, given the
//! ledger's 16 connections for 32), in which the ledger's row commits with the record;
//! `IDEMPOTENCY_FINGERPRINT=json` fingerprints bodies as canonical JSON (key order and
//! whitespace do not matter; invalid JSON is fingerprinted raw) instead of their raw bytes,
//! and `IDEMPOTENCY_FINGERPRINT_IGNORE=/client_ts,/trace_id` leaves those JSON pointers out
//! of it (implies `json`). `GET /metrics` serves the layer's metrics as Prometheus text;
//! `RUST_LOG` filters the logs (default `info`).
//!
//! `POST /v1/webhooks` takes events as a webhook sender delivers them, with no
//! `Idempotency-Key`: the key is the event's `/id`. Deliver one twice, and the second gets
//! the first answer replayed:
//!
//! ```text
//! curl -i localhost:3000/v1/webhooks -d '{"id": "evt_1", "type": "charge.succeeded"}'
//! ```

mod app;
mod store;

use std::time::Duration;

use axum::routing::get;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use tower_idempotency::BodyFingerprint;

/// Histogram buckets of the `_seconds` metrics, in seconds: from a local store's tens of
/// microseconds to a slow handler's seconds.
const SECONDS_BUCKETS: [f64; 16] = [
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0,
];

/// How long a shutdown waits for executions to record their outcome: the default lease,
/// past which their keys are free again anyway.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(30);

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    store::init_logging();
    // Installed before the layer first reports, which registers its metrics then.
    let metrics = install_metrics()?;

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
    settings.fail_open = std::env::var("IDEMPOTENCY_FAIL_OPEN").as_deref() == Ok("1");
    settings.fingerprint = fingerprint_from_env()?;
    if let Ok(ledger) = std::env::var("PAYMENTS_LEDGER") {
        if ledger != "postgres" {
            return Err(format!("PAYMENTS_LEDGER={ledger}: only postgres is known").into());
        }
        let url = std::env::var("DATABASE_URL")
            .map_err(|_| "PAYMENTS_LEDGER=postgres needs DATABASE_URL")?;
        #[cfg(feature = "postgres")]
        {
            settings.ledger = Some(app::ledger::Ledger::connect(&url).await?);
        }
        // Not the URL itself: it may hold a password.
        #[cfg(not(feature = "postgres"))]
        {
            let _ = url;
            return Err("PAYMENTS_LEDGER is set, but this build has no `postgres` feature".into());
        }
    }
    if let Ok(url) = std::env::var("PAYMENTS_PROCESSOR_URL") {
        #[cfg(feature = "client")]
        {
            settings.processor = Some(app::ProcessorUrl::new(url)?);
        }
        #[cfg(not(feature = "client"))]
        {
            let _ = url;
            return Err(
                "PAYMENTS_PROCESSOR_URL is set, but this build has no `client` feature".into(),
            );
        }
    }
    let store = store::from_env().await?;
    tracing::info!(?store, ?settings, "payments store");
    let (app, stats) = app::router(store, settings);
    let app = app.route("/metrics", get(move || async move { metrics.render() }));
    if std::env::var("PAYMENTS_STATS").as_deref() == Ok("payments") {
        stats.report_payments_only();
    }

    let addr = std::env::var("PAYMENTS_ADDR").unwrap_or_else(|_| "127.0.0.1:3000".into());
    let listener = tokio::net::TcpListener::bind(&addr).await?;
    tracing::info!("payments listening on http://{}", listener.local_addr()?);
    axum::serve(listener, app)
        .with_graceful_shutdown(store::shutdown())
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

/// `IDEMPOTENCY_FINGERPRINT=json` (canonical JSON) or `raw` (the default);
/// `IDEMPOTENCY_FINGERPRINT_IGNORE=/client_ts,/trace_id` leaves those fields out, and implies
/// `json`.
fn fingerprint_from_env() -> Result<BodyFingerprint, String> {
    let ignored: Vec<String> = match std::env::var("IDEMPOTENCY_FINGERPRINT_IGNORE") {
        Ok(list) => list
            .split(',')
            .map(str::trim)
            .filter(|pointer| !pointer.is_empty())
            .map(str::to_owned)
            .collect(),
        Err(_) => Vec::new(),
    };
    if let Some(bad) = ignored.iter().find(|pointer| !pointer.starts_with('/')) {
        return Err(format!(
            "IDEMPOTENCY_FINGERPRINT_IGNORE: {bad:?} is not a JSON pointer (\"/field\")"
        ));
    }
    match std::env::var("IDEMPOTENCY_FINGERPRINT").as_deref() {
        Ok("json") => Ok(BodyFingerprint::json_ignoring(ignored)),
        Ok("raw") | Err(_) if ignored.is_empty() => Ok(BodyFingerprint::raw()),
        Err(_) => Ok(BodyFingerprint::json_ignoring(ignored)),
        Ok("raw") => {
            Err("IDEMPOTENCY_FINGERPRINT_IGNORE needs the json fingerprint, not raw".into())
        }
        Ok(other) => Err(format!(
            "IDEMPOTENCY_FINGERPRINT={other}: expected json or raw"
        )),
    }
}

/// The Prometheus recorder behind the `metrics` facade, with histograms in buckets (for
/// `histogram_quantile`), drained every few seconds.
fn install_metrics() -> Result<PrometheusHandle, Box<dyn std::error::Error>> {
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), &SECONDS_BUCKETS)?
        .install_recorder()?;
    let upkeep = handle.clone();
    tokio::spawn(async move {
        let mut ticks = tokio::time::interval(Duration::from_secs(5));
        loop {
            ticks.tick().await;
            upkeep.run_upkeep();
        }
    });
    Ok(handle)
}
