//! In-process cost of the layer per request, over the same service without it.
//!
//! `cargo bench --bench layer` (Redis cases use `REDIS_URL`, default 127.0.0.1:6379).

mod support;

use std::{hint::black_box, sync::Arc};

use bytes::Bytes;
use criterion::{criterion_group, criterion_main, BatchSize, BenchmarkId, Criterion, Throughput};
use tokio::runtime::Runtime;
use tower_idempotency::{IdempotencyLayer, MemoryStore, RedisStore, Store};

use support::{call, handler, redis_url, request};

const SIZES: [(&str, usize); 2] = [("256B", 256), ("64KiB", 64 * 1024)];

fn stores(runtime: &Runtime) -> Vec<(&'static str, Arc<dyn Store>)> {
    let url = redis_url();
    let redis = runtime
        .block_on(RedisStore::open(&url))
        .unwrap_or_else(|e| panic!("the Redis benchmarks need Redis at {url}: {e}"))
        .prefix(format!("bench:{:x}:", rand::random::<u64>()));
    vec![
        ("memory", Arc::new(MemoryStore::new())),
        ("redis", Arc::new(redis)),
    ]
}

fn per_request(c: &mut Criterion) {
    // One thread, as in a server pinned to one core: a spawned task runs on the thread
    // that spawned it, as it would on a server's worker.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let stores = stores(&runtime);
    let bare = handler();
    let mut group = c.benchmark_group("per_request");
    for (size, len) in SIZES {
        let body = Bytes::from(vec![b'x'; len]);
        group.throughput(Throughput::Bytes(len as u64));
        group.bench_function(BenchmarkId::new("bare", size), |b| {
            b.to_async(&runtime)
                .iter(|| call(&bare, request("POST", None, &body)))
        });
        let memory = IdempotencyLayer::from_shared(stores[0].1.clone()).allow_anonymous();
        let pass_through = tower::ServiceBuilder::new()
            .layer(memory)
            .service(handler());
        group.bench_function(BenchmarkId::new("pass_through_get", size), |b| {
            b.to_async(&runtime)
                .iter(|| call(&pass_through, request("GET", None, &body)))
        });
        for (store_name, store) in &stores {
            let layer = IdempotencyLayer::from_shared(store.clone()).allow_anonymous();
            let service = tower::ServiceBuilder::new().layer(layer).service(handler());
            group.bench_function(BenchmarkId::new(format!("first_{store_name}"), size), |b| {
                b.to_async(&runtime).iter_batched(
                    || format!("{:032x}", rand::random::<u128>()),
                    |key| call(&service, request("POST", Some(&key), &body)),
                    BatchSize::SmallInput,
                )
            });
            let key = format!("replay-{size}");
            runtime.block_on(call(&service, request("POST", Some(&key), &body)));
            group.bench_function(
                BenchmarkId::new(format!("replay_{store_name}"), size),
                |b| {
                    b.to_async(&runtime).iter(|| async {
                        black_box(call(&service, request("POST", Some(&key), &body)).await)
                    })
                },
            );
        }
    }
    group.finish();
}

criterion_group!(benches, per_request);
criterion_main!(benches);
