//! The JSON fingerprint with serde_json's `arbitrary_precision` on in the build: numbers
//! still compare by value, and an object is never the number it is handed over as.

use std::convert::Infallible;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use tower::{service_fn, Layer, ServiceExt};
use tower_idempotency::{BodyFingerprint, IdempotencyLayer, MemoryStore};

/// `first`, then `second` under the same key, through a layer fingerprinting bodies as
/// canonical JSON: the second's status, and whether it was a replay.
async fn twice(first: &'static str, second: &'static str) -> (StatusCode, bool) {
    let handler = service_fn(|_: Request<Full<Bytes>>| async {
        Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"charged"))))
    });
    let service = IdempotencyLayer::new(MemoryStore::new())
        .allow_anonymous()
        .fingerprint(BodyFingerprint::json())
        .layer(handler);
    let post = |body: &'static str| {
        Request::post("/v1/payments")
            .header("idempotency-key", "k")
            .body(Full::new(Bytes::from_static(body.as_bytes())))
            .unwrap()
    };
    service.clone().oneshot(post(first)).await.unwrap();
    let answer = service.oneshot(post(second)).await.unwrap();
    let replayed = answer.headers().contains_key("idempotent-replayed");
    (answer.status(), replayed)
}

#[test]
fn the_build_has_arbitrary_precision() {
    let number: serde_json::Number = serde_json::from_str("12.50").unwrap();
    assert_eq!(number.to_string(), "12.50", "numbers kept as written");
}

#[tokio::test]
async fn a_retry_spelling_a_number_another_way_is_replayed() {
    for spelt in [r#"{"amount":12.50}"#, r#"{"amount":1.25e1}"#] {
        let second = twice(r#"{"amount":12.5}"#, spelt).await;
        assert_eq!(second, (StatusCode::OK, true), "{spelt}");
    }
}

#[tokio::test]
async fn an_object_is_not_the_number_it_is_handed_over_as() {
    let spelt = r#"{"amount":{"$serde_json::private::Number":"12.5"}}"#;
    let second = twice(r#"{"amount":12.5}"#, spelt).await;
    assert_eq!(second.0, StatusCode::CONFLICT, "{second:?}");
}
