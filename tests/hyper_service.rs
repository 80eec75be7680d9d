//! The layer around a plain `service_fn` served by hyper-util: the outer request body is
//! hyper's `Incoming`, which cannot be rebuilt once read, so the inner service takes
//! `RequestBody<Incoming>`. Over real HTTP/1.1 and HTTP/2 connections.

#[macro_use]
mod support;

use std::{
    convert::Infallible,
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
};

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::{
    client::legacy::Client,
    rt::{TokioExecutor, TokioIo},
    server::conn::auto,
    service::TowerToHyperService,
};
use tokio::net::TcpListener;
use tower::ServiceBuilder;
use tower_idempotency::{IdempotencyLayer, MemoryStore, RequestBody};

/// Serves `POST /echo` (keyed: executed once) and `GET /echo` (passed through, its body
/// streamed untouched) on a free port, counting executions.
async fn serve(calls: Arc<AtomicUsize>) -> std::net::SocketAddr {
    let service = tower::service_fn(move |request: Request<RequestBody<Incoming>>| {
        let calls = calls.clone();
        async move {
            let buffered = request.body().as_bytes().is_some();
            let method = request.method().clone();
            let body = request.into_body().collect().await.unwrap().to_bytes();
            let n = calls.fetch_add(1, Ordering::SeqCst) + 1;
            let answer = format!(
                "{method} #{n} buffered={buffered}: {}",
                String::from_utf8_lossy(&body)
            );
            Ok::<_, Infallible>(Response::new(Full::new(Bytes::from(answer))))
        }
    });
    let service = ServiceBuilder::new()
        .layer(
            IdempotencyLayer::new(MemoryStore::new())
                .allow_anonymous()
                .methods([Method::POST]),
        )
        .service(service);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let (stream, _) = listener.accept().await.unwrap();
            let service = TowerToHyperService::new(service.clone());
            tokio::spawn(async move {
                let _ = auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    addr
}

async fn exchange(http2: bool) {
    let calls = Arc::new(AtomicUsize::new(0));
    let addr = serve(calls.clone()).await;
    let client = Client::builder(TokioExecutor::new())
        .http2_only(http2)
        .build_http::<Full<Bytes>>();
    let send = |method: Method, key: Option<&str>, body: &'static str| {
        let mut request = Request::builder()
            .method(method)
            .uri(format!("http://{addr}/echo"));
        if let Some(key) = key {
            request = request.header("idempotency-key", key);
        }
        let request = request
            .body(Full::new(Bytes::from_static(body.as_bytes())))
            .unwrap();
        let client = client.clone();
        async move {
            let response = client.request(request).await.unwrap();
            let status = response.status();
            let replayed = response.headers().contains_key("idempotent-replayed");
            let body = response.into_body().collect().await.unwrap().to_bytes();
            (status, replayed, String::from_utf8(body.to_vec()).unwrap())
        }
    };

    let first = send(Method::POST, Some("k1"), "charge 10").await;
    assert_eq!(
        first,
        (
            StatusCode::OK,
            false,
            "POST #1 buffered=true: charge 10".to_owned()
        )
    );
    let retry = send(Method::POST, Some("k1"), "charge 10").await;
    assert_eq!(retry.0, StatusCode::OK);
    assert!(retry.1, "a replay");
    assert_eq!(retry.2, first.2);
    let other = send(Method::POST, Some("k1"), "charge 99").await;
    assert_eq!(other.0, StatusCode::CONFLICT);
    // Not handled by the layer: the body streams through unread.
    let get = send(Method::GET, None, "").await;
    assert_eq!(get.2, "GET #2 buffered=false: ");
    let unkeyed = send(Method::POST, None, "free").await;
    assert_eq!(unkeyed.2, "POST #3 buffered=false: free");
    assert_eq!(calls.load(Ordering::SeqCst), 3);
}

#[tokio::test]
async fn an_incoming_service_over_http1_executes_once() {
    exchange(false).await;
}

#[tokio::test]
async fn an_incoming_service_over_http2_executes_once() {
    exchange(true).await;
}

/// The `payments` example speaks HTTP/2 (prior knowledge) as well as HTTP/1.1: a payment
/// over HTTP/2 runs once and replays byte for byte.
#[tokio::test]
async fn the_payments_example_answers_over_http2() {
    let example = support::payments::ExampleProcess::start(&[]).await;
    let client = Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build_http::<Full<Bytes>>();
    let pay = || {
        let request = Request::post(format!("http://{}/v1/payments", example.addr()))
            .header("idempotency-key", "h2-payment")
            .header("authorization", "Bearer alice")
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from_static(
                br#"{"amount":1200,"currency":"usd"}"#,
            )))
            .unwrap();
        let client = client.clone();
        async move {
            let response = client.request(request).await.unwrap();
            assert_eq!(response.version(), http::Version::HTTP_2);
            let replayed = response.headers().contains_key("idempotent-replayed");
            let status = response.status();
            let body = response.into_body().collect().await.unwrap().to_bytes();
            (status, replayed, body)
        }
    };
    let first = pay().await;
    assert_eq!((first.0, first.1), (StatusCode::CREATED, false));
    let retry = pay().await;
    assert_eq!((retry.0, retry.1), (StatusCode::CREATED, true));
    assert_eq!(retry.2, first.2);
    assert_eq!(example.api().stats().await.payments_executed, 1);
}
