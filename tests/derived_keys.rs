//! Keys derived for downstream calls: a gateway behind the layer charges a processor behind
//! another, through the crate's client, and the processor executes once per operation
//! however often the gateway runs it.

use std::{
    convert::Infallible,
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
};

use axum::{body::Body, extract::State, routing::post, Router};
use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use tower::{service_fn, Layer, ServiceExt};
use tower_idempotency::{
    client::IdempotentClientLayer, DerivedKeys, IdempotencyLayer, MemoryStore,
};

/// A processor: each execution makes a new charge id.
fn processor(executed: Arc<AtomicUsize>) -> Router {
    let charge = move || {
        let n = executed.fetch_add(1, Ordering::SeqCst) + 1;
        async move { (StatusCode::CREATED, format!("ch_{n}")) }
    };
    Router::new()
        .route("/v1/charges", post(charge))
        .route_layer(
            IdempotencyLayer::new(MemoryStore::new())
                .required()
                .allow_anonymous(),
        )
}

/// How the gateway keys its call to the processor.
#[derive(Clone, Copy)]
enum Keying {
    Derived,
    FreshPerExecution,
}

#[derive(Clone)]
struct Gateway {
    processor: Router,
    keying: Keying,
    executions: Arc<AtomicUsize>,
    /// The processor's answer to each gateway execution, in order.
    charges: Arc<std::sync::Mutex<Vec<String>>>,
}

/// The gateway's handler: charges the processor, then dies on its first execution (it
/// answers 500 after the processor answered, which releases its own key), and succeeds
/// on the next.
async fn pay(State(gateway): State<Gateway>, keys: DerivedKeys) -> (StatusCode, String) {
    let processor = gateway.processor.clone();
    let http = service_fn(move |request: Request<Full<Bytes>>| {
        let processor = processor.clone();
        async move {
            let response = processor
                .oneshot(request.map(Body::new))
                .await
                .unwrap_or_else(|never: Infallible| match never {});
            let (parts, body) = response.into_parts();
            let body = body.collect().await?.to_bytes();
            Ok::<_, axum::Error>(Response::from_parts(parts, Full::new(body)))
        }
    });
    let client = IdempotentClientLayer::new().layer(http);
    let mut request = Request::post("http://processor/v1/charges")
        .body(Full::new(Bytes::from_static(b"{\"amount\":1999}")))
        .unwrap();
    if let Keying::Derived = gateway.keying {
        let key = keys.header_value("processor");
        request.headers_mut().insert("idempotency-key", key);
    }
    let response = client
        .oneshot(request)
        .await
        .expect("the processor answers");
    let charge = response.into_body().collect().await.unwrap().to_bytes();
    let charge = String::from_utf8(charge.to_vec()).unwrap();
    gateway.charges.lock().unwrap().push(charge.clone());
    if gateway.executions.fetch_add(1, Ordering::SeqCst) == 0 {
        return (StatusCode::INTERNAL_SERVER_ERROR, "died".to_owned());
    }
    (StatusCode::CREATED, charge)
}

/// Runs one payment through a gateway keyed as `keying`, its client retrying once after
/// the 500; returns how often the processor executed and what the gateway's runs saw.
async fn one_payment(keying: Keying) -> (usize, Vec<String>, (StatusCode, String)) {
    let charged = Arc::new(AtomicUsize::new(0));
    let gateway = Gateway {
        processor: processor(Arc::clone(&charged)),
        keying,
        executions: Arc::default(),
        charges: Arc::default(),
    };
    let app = Router::new()
        .route("/v1/payments", post(pay))
        .route_layer(
            IdempotencyLayer::new(MemoryStore::new())
                .required()
                .allow_anonymous()
                .derive_keys(),
        )
        .with_state(gateway.clone());
    let mut last = None;
    for _ in 0..2 {
        let request = Request::post("/v1/payments")
            .header("idempotency-key", "8e03978e-40d5-43e8-bc93-6894a57f9324")
            .body(Body::from("{\"amount\":1999}"))
            .unwrap();
        let response = app.clone().oneshot(request).await.unwrap();
        let status = response.status();
        let body = response.into_body().collect().await.unwrap().to_bytes();
        last = Some((status, String::from_utf8(body.to_vec()).unwrap()));
    }
    let charges = gateway.charges.lock().unwrap().clone();
    (charged.load(Ordering::SeqCst), charges, last.unwrap())
}

#[tokio::test]
async fn a_processor_charges_once_when_the_gateway_dies_after_it_answered() {
    let (charged, charges, last) = one_payment(Keying::Derived).await;
    assert_eq!(charged, 1, "the retry's call was a replay at the processor");
    assert_eq!(charges, ["ch_1", "ch_1"]);
    assert_eq!(last, (StatusCode::CREATED, "ch_1".to_owned()));

    // The window it closes: a key made afresh by each execution charges twice.
    let (charged, charges, last) = one_payment(Keying::FreshPerExecution).await;
    assert_eq!(charged, 2);
    assert_eq!(charges, ["ch_1", "ch_2"]);
    assert_eq!(last, (StatusCode::CREATED, "ch_2".to_owned()));
}

#[tokio::test]
async fn any_service_finds_the_keys_in_its_request_and_an_unkeyed_request_has_none() {
    let seen = service_fn(|request: Request<Full<Bytes>>| async move {
        let keys = request.extensions().get::<DerivedKeys>();
        let body = keys.map_or("none".to_owned(), |keys| keys.key("downstream"));
        Ok::<_, Infallible>(Response::new(Full::new(Bytes::from(body))))
    });
    let layer = IdempotencyLayer::new(MemoryStore::new()).allow_anonymous();
    let deriving = layer.clone().derive_keys().layer(seen);
    let not_deriving = layer.layer(seen);
    // On another instance (another layer on another store), the same scope derives the same.
    let elsewhere = IdempotencyLayer::new(MemoryStore::new())
        .allow_anonymous()
        .derive_keys()
        .layer(seen);
    /// What the service saw of its derived keys, for a `POST` with `key`.
    async fn seen_by<S>(service: &S, key: Option<&str>) -> Bytes
    where
        S: tower::Service<Request<Full<Bytes>>, Error = Infallible> + Clone,
        S::Response: Into<Response<tower_idempotency::ResponseBody<Full<Bytes>>>>,
    {
        let mut request = Request::post("/v1/orders");
        if let Some(key) = key {
            request = request.header("idempotency-key", key);
        }
        let request = request.body(Full::new(Bytes::from("a"))).unwrap();
        let response = service.clone().oneshot(request).await.unwrap().into();
        response.into_body().collect().await.unwrap().to_bytes()
    }
    let first = seen_by(&deriving, Some("k1")).await;
    assert_eq!(first.len(), 36);
    assert_ne!(
        seen_by(&deriving, Some("k2")).await,
        first,
        "another key, another scope"
    );
    assert_eq!(seen_by(&deriving, None).await, "none");
    // A layer that does not derive keys hands on none: its executions pay nothing for them.
    assert_eq!(seen_by(&not_deriving, Some("k3")).await, "none");
    assert_eq!(seen_by(&elsewhere, Some("k1")).await, first);
}

#[tokio::test]
async fn the_extractor_answers_500_where_no_key_was_claimed() {
    let app = Router::new()
        .route(
            "/v1/orders",
            post(|keys: DerivedKeys| async move { keys.key("x") }),
        )
        .route_layer(
            IdempotencyLayer::new(MemoryStore::new())
                .allow_anonymous()
                .derive_keys(),
        );
    let unkeyed = Request::post("/v1/orders").body(Body::empty()).unwrap();
    let response = app.clone().oneshot(unkeyed).await.unwrap();
    assert_eq!(response.status(), StatusCode::INTERNAL_SERVER_ERROR);
    let keyed = Request::post("/v1/orders")
        .header("idempotency-key", "k1")
        .body(Body::empty())
        .unwrap();
    assert_eq!(app.oneshot(keyed).await.unwrap().status(), StatusCode::OK);
}
