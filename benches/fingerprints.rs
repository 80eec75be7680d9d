//! What a JSON fingerprint costs against the raw one: replays (whose work is reading the
//! body, fingerprinting it and finding the record) of a 1 KiB and a 64 KiB JSON body
//! through layers that differ only in their `BodyFingerprint`, side by side in one run, on
//! the memory store; and a JSON fingerprint on a route keyed by the body's `/id`, which
//! parses the body once for both.
//!
//! `cargo bench --bench fingerprints`

#[allow(dead_code)] // Shared with the other benches, which use all of it.
mod support;

use std::{convert::Infallible, hint::black_box};

use bytes::Bytes;
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use serde_json::json;
use tower_idempotency::{BodyFingerprint, IdempotencyLayer, MemoryStore};

use support::{call, request};

/// A payment with line items: about `size` bytes of JSON.
fn body_of(size: usize) -> Bytes {
    let mut items = Vec::new();
    let mut body = json!({ "id": "evt_1", "amount": 1000, "currency": "usd", "items": [] });
    while body.to_string().len() < size {
        let n = items.len();
        items.push(json!({ "sku": format!("sku-{n:06}"), "qty": n % 7 + 1, "price": 1999, "gift": n % 2 == 0 }));
        body["items"] = serde_json::Value::Array(items.clone());
    }
    Bytes::from(body.to_string())
}

fn raw_against_json(c: &mut Criterion) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut group = c.benchmark_group("fingerprint");
    for (label, size) in [("1KiB", 1024), ("64KiB", 64 * 1024)] {
        let body = body_of(size);
        group.throughput(Throughput::Bytes(body.len() as u64));
        let options = [
            ("raw", BodyFingerprint::raw()),
            ("json", BodyFingerprint::json()),
            (
                "json_ignoring",
                BodyFingerprint::json_ignoring(["/items/0/gift"]),
            ),
        ];
        // The last keyed by the body's `/id` as well: its one parse serves both.
        let keyed_by_body = [false, false, false, true];
        let options = options
            .into_iter()
            .chain([("json_keyed_by_body", BodyFingerprint::json())]);
        for ((name, option), keyed_by_body) in options.zip(keyed_by_body) {
            let mut layer = IdempotencyLayer::new(MemoryStore::new())
                .allow_anonymous()
                .fingerprint(option);
            if keyed_by_body {
                layer = layer.key_from_json("/id");
            }
            let handler = tower::service_fn(|_: Request<Full<Bytes>>| async {
                let mut response =
                    Response::new(Full::new(Bytes::from_static(b"{\"id\":\"pay_1\"}")));
                *response.status_mut() = StatusCode::CREATED;
                Ok::<_, Infallible>(response)
            });
            let service = tower::ServiceBuilder::new().layer(layer).service(handler);
            runtime.block_on(call(&service, request("POST", Some("replayed"), &body)));
            group.bench_function(BenchmarkId::new(name, label), |b| {
                b.to_async(&runtime).iter(|| async {
                    black_box(call(&service, request("POST", Some("replayed"), &body)).await)
                })
            });
        }
    }
    group.finish();
}

criterion_group!(benches, raw_against_json);
criterion_main!(benches);
