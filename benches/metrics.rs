//! What the layer's metrics cost: the same requests through a layer whose metrics go to
//! no recorder and through one whose metrics go to a Prometheus recorder, side by side in
//! one run, on the memory store (first executions and replays).
//!
//! `cargo bench --bench metrics`

#[allow(dead_code)] // Shared with the other benches, which use all of it.
mod support;

use std::hint::black_box;

use bytes::Bytes;
use criterion::{criterion_group, criterion_main, BatchSize, BenchmarkId, Criterion};
use metrics_exporter_prometheus::PrometheusBuilder;
use tower_idempotency::{IdempotencyLayer, MemoryStore};

use support::{call, handler, request};

fn with_and_without_a_recorder(c: &mut Criterion) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let recorder = PrometheusBuilder::new().build_recorder();
    let body = Bytes::from(vec![b'x'; 256]);
    let mut group = c.benchmark_group("metrics");
    for recorded in [false, true] {
        let name = if recorded { "prometheus" } else { "none" };
        let layer = IdempotencyLayer::new(MemoryStore::new()).allow_anonymous();
        let service = tower::ServiceBuilder::new().layer(layer).service(handler());
        // A layer registers its metrics with the recorder in place when it first reports,
        // and keeps them: one request with the recorder in place is enough.
        let warm_up = || runtime.block_on(call(&service, request("POST", Some("replayed"), &body)));
        if recorded {
            metrics::with_local_recorder(&recorder, warm_up);
        } else {
            warm_up();
        }
        group.bench_function(BenchmarkId::new("first_memory", name), |b| {
            b.to_async(&runtime).iter_batched(
                || format!("{:032x}", rand::random::<u128>()),
                |key| call(&service, request("POST", Some(&key), &body)),
                BatchSize::SmallInput,
            )
        });
        group.bench_function(BenchmarkId::new("replay_memory", name), |b| {
            b.to_async(&runtime).iter(|| async {
                black_box(call(&service, request("POST", Some("replayed"), &body)).await)
            })
        });
    }
    group.finish();
    // What the recorder took in: proof that the second half recorded.
    let rendered = recorder.handle().render();
    assert!(rendered.contains("idempotency_requests_total{outcome=\"replayed\"}"));
}

criterion_group!(benches, with_and_without_a_recorder);
criterion_main!(benches);
