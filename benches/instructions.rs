//! Instructions per request on each path, counted rather than timed: on a shared machine
//! the count does not move with the load, so it shows a change of a few hundred
//! instructions that throughput noise would hide.
//!
//! `benches/instructions.sh` runs this under `valgrind --tool=callgrind`:
//! `instructions <path> <requests>` sends one warm-up request, then `<requests>` requests on
//! `<path>` (256-byte bodies); two runs with N and 2N requests give the cost of one request
//! without the start-up. Redis paths use `REDIS_URL` (default 127.0.0.1:6379).
//! `first_redis_16` sends its first executions 16 at a time, as concurrent requests under
//! load do, so that their Redis commands leave in shared batches.

mod support;

use std::sync::Arc;

use bytes::Bytes;
use tower_idempotency::{store::CachedStore, IdempotencyLayer, MemoryStore, RedisStore, Store};

use support::{call, handler, redis_url, request};

const PATHS: &str = "bare, pass_through, first_memory, replay_memory, first_redis, replay_redis, \
    first_cached_redis, replay_cached_redis, first_redis_16";
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
        .layer(IdempotencyLayer::from_shared(store))
        .service(handler());
    let body = Bytes::from(vec![b'x'; 256]);
    runtime.block_on(async {
        call(&layered, request("POST", Some("replayed"), &body)).await;
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
    });
}
