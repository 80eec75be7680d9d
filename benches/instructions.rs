//! Instructions per request on each path, counted rather than timed: on a shared machine
//! the count does not move with the load, so it shows a change of a few hundred
//! instructions that throughput noise would hide.
//!
//! `benches/instructions.sh` runs this under `valgrind --tool=callgrind`:
//! `instructions <path> <requests>` sends one warm-up request, then `<requests>` requests on
//! `<path>` (256-byte bodies); two runs with N and 2N requests give the cost of one request
//! without the start-up. Redis paths use `REDIS_URL` (default 127.0.0.1:6379).
//! `first_redis_16` sends its first executions 16 at a time, as concurrent requests under
//! load do, so that their Redis commands leave in shared batches. `waiter_memory` sends the
//! requests as duplicates of one original held at its handler, all waiting for it
//! (`wait_for_original`), then lets the original finish: the cost of one waiter, from its
//! claim to its replay. With `INSTRUCTIONS_RECORDER=prometheus` the layer's metrics go to a
//! Prometheus recorder (none otherwise); with `INSTRUCTIONS_SUBSCRIBER=info`, its logs to a
//! fmt subscriber at that level (none otherwise): both, as the gate counts them
//! (`scripts/instructions-gate.sh`), are the configuration that ships.

mod support;

use std::{convert::Infallible, sync::Arc, time::Duration};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use tokio::sync::Semaphore;
use tower_idempotency::{store::CachedStore, IdempotencyLayer, MemoryStore, RedisStore, Store};

use support::{call, handler, redis_url, request};

const PATHS: &str = "bare, pass_through, first_memory, replay_memory, first_redis, replay_redis, \
    first_cached_redis, replay_cached_redis, first_redis_16, waiter_memory";
/// Requests at a time on `first_redis_16`.
const AT_A_TIME: usize = 16;

fn main() {
    let mut args = std::env::args().skip(1);
    let (Some(path), Some(Ok(requests))) = (args.next(), args.next().map(|n| n.parse::<usize>()))
    else {
        // `cargo bench` runs every bench target with its own flags: nothing to count then.
        eprintln!("usage: instructions <{PATHS}> <requests>");
        return;
    };
    // `INSTRUCTIONS_RECORDER=prometheus`: the layer's metrics go to a Prometheus recorder,
    // as in a service that exports them.
    if std::env::var("INSTRUCTIONS_RECORDER").as_deref() == Ok("prometheus") {
        metrics_exporter_prometheus::PrometheusBuilder::new()
            .install_recorder()
            .expect("a Prometheus recorder");
    }
    // `INSTRUCTIONS_SUBSCRIBER=<filter>`: a fmt subscriber with that filter (`info` is the
    // payments example's default), writing nowhere, as a service logs at a production level.
    if let Ok(filter) = std::env::var("INSTRUCTIONS_SUBSCRIBER") {
        tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(std::io::sink)
            .init();
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let redis = || {
        let redis = runtime
            .block_on(RedisStore::open(&redis_url()))
            .expect("the Redis paths need Redis at REDIS_URL");
        redis.prefix(format!("instructions:{:x}:", rand::random::<u64>()))
    };
    let store: Arc<dyn Store> = match path.as_str() {
        "first_redis" | "replay_redis" | "first_redis_16" => Arc::new(redis()),
        "first_cached_redis" | "replay_cached_redis" => {
            Arc::new(CachedStore::new(redis(), 100_000))
        }
        _ => Arc::new(MemoryStore::new()),
    };
    let bare = handler();
    let layered = tower::ServiceBuilder::new()
        .layer(IdempotencyLayer::from_shared(store).allow_anonymous())
        .service(handler());
    let body = Bytes::from(vec![b'x'; 256]);
    if path == "waiter_memory" {
        measured(&|| runtime.block_on(waiters(requests, &body)));
        return;
    }
    // Outside what is counted: the first request (it also registers the layer's metrics).
    runtime.block_on(call(&layered, request("POST", Some("replayed"), &body)));
    measured(&|| {
        runtime.block_on(async {
            if path == "first_redis_16" {
                for group in (0..requests).collect::<Vec<_>>().chunks(AT_A_TIME) {
                    let calls = group.iter().map(|n| {
                        let key = format!("{n:032x}");
                        call(&layered, request("POST", Some(&key), &body))
                    });
                    for answer in futures_util::future::join_all(calls).await {
                        assert_eq!(answer.len(), body.len());
                    }
                }
                return;
            }
            for n in 0..requests {
                let key = format!("{n:032x}");
                let answer = match path.as_str() {
                    "bare" => call(&bare, request("POST", None, &body)).await,
                    "pass_through" => call(&layered, request("GET", None, &body)).await,
                    "first_memory" | "first_redis" | "first_cached_redis" => {
                        call(&layered, request("POST", Some(&key), &body)).await
                    }
                    "replay_memory" | "replay_redis" | "replay_cached_redis" => {
                        call(&layered, request("POST", Some("replayed"), &body)).await
                    }
                    other => panic!("unknown path {other}: one of {PATHS}"),
                };
                assert_eq!(answer.len(), body.len());
            }
        })
    });
}

/// What `benches/instructions.sh` counts: callgrind collects inside this function only, so
/// that what a run does once at start (a recorder calibrating its clock, say) is left out.
#[inline(never)]
fn measured(run: &dyn Fn()) {
    run()
}

/// `requests` duplicates waiting for one original on the memory store, answered by its replay.
async fn waiters(requests: usize, body: &Bytes) {
    let gate = Arc::new(Semaphore::new(0));
    let held = Arc::clone(&gate);
    // The original's handler waits at the gate; the duplicates never reach theirs.
    let handler = tower::service_fn(move |_: Request<Full<Bytes>>| {
        let gate = Arc::clone(&held);
        async move {
            gate.acquire().await.unwrap().forget();
            let mut response = Response::new(Full::new(Bytes::from(vec![b'x'; 256])));
            *response.status_mut() = StatusCode::CREATED;
            Ok::<_, Infallible>(response)
        }
    });
    let layer = IdempotencyLayer::new(MemoryStore::new())
        .allow_anonymous()
        .wait_for_original(Duration::from_secs(60))
        .max_waiting(requests + 1);
    let layered = tower::ServiceBuilder::new()
        .layer(layer.clone())
        .service(handler);
    let send = || {
        let (layered, request) = (layered.clone(), request("POST", Some("held"), body));
        tokio::spawn(async move { call(&layered, request).await })
    };
    let original = send();
    let duplicates: Vec<_> = (0..requests).map(|_| send()).collect();
    while layer.waiting() < requests {
        tokio::task::yield_now().await;
    }
    gate.add_permits(1);
    assert_eq!(original.await.unwrap().len(), body.len());
    for duplicate in duplicates {
        assert_eq!(duplicate.await.unwrap().len(), body.len());
    }
}
