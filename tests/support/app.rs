//! The application the integration tests drive: one handler whose behaviour the request's
//! headers choose, and small helpers to build requests and read answers.

use std::{
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
    time::Duration,
};

use axum::{
    body::Body,
    extract::{Request, State},
    http::{header, HeaderMap, HeaderValue, StatusCode},
    response::{IntoResponse, Response},
    routing, Router,
};
use bytes::Bytes;
use futures_util::StreamExt;
use http_body_util::BodyExt;
use tokio::sync::Semaphore;
use tower::ServiceExt;
use tower_idempotency::{ClaimToken, Fingerprint, IdempotencyKey, IdempotencyLayer, Scope, Store};

#[derive(Clone)]
pub struct Handler {
    pub executions: Arc<AtomicUsize>,
    /// Requests with `x-wait` wait here for a permit the test hands out.
    pub gate: Arc<Semaphore>,
}

impl Default for Handler {
    fn default() -> Self {
        Self {
            executions: Arc::default(),
            gate: Arc::new(Semaphore::new(0)),
        }
    }
}

impl Handler {
    pub fn executions(&self) -> usize {
        self.executions.load(Ordering::SeqCst)
    }
}

pub async fn handle(State(handler): State<Handler>, request: Request) -> Response {
    let n = handler.executions.fetch_add(1, Ordering::SeqCst) + 1;
    let headers = request.headers().clone();
    let flag = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    if let Some(ms) = flag("x-block-ms") {
        // Blocks the thread, as a handler doing slow synchronous work would: nothing else
        // in this task (lease renewal included) runs meanwhile.
        std::thread::sleep(Duration::from_millis(ms.parse().unwrap()));
    }
    if let Some(ms) = flag("x-sleep-ms") {
        tokio::time::sleep(Duration::from_millis(ms.parse().unwrap())).await;
    }
    if flag("x-wait").is_some() {
        handler.gate.acquire().await.unwrap().forget();
    }
    if flag("x-panic").is_some() {
        panic!("handler panicked on purpose");
    }
    let status = flag("x-status").map_or(StatusCode::CREATED, |s| s.parse().unwrap());
    if let Some(ms) = flag("x-body-sleep-ms") {
        // The handler returns at once; its body's second part comes `ms` later.
        let ms = ms.parse().unwrap();
        let parts = futures_util::stream::iter([0, 1]).then(move |part| async move {
            if part == 1 {
                tokio::time::sleep(Duration::from_millis(ms)).await;
            }
            Ok::<_, std::io::Error>(Bytes::from(format!("execution {n}, part {part};")))
        });
        return (status, Body::from_stream(parts)).into_response();
    }
    if flag("x-body-panic").is_some() {
        let parts = futures_util::stream::iter([0, 1]).map(|part| {
            assert_eq!(part, 0, "the response body panicked on purpose");
            Ok::<_, std::io::Error>(Bytes::from_static(b"part 0;"))
        });
        return (status, Body::from_stream(parts)).into_response();
    }
    if let Some(len) = flag("x-body-len") {
        return (status, vec![b'x'; len.parse().unwrap()]).into_response();
    }
    if flag("x-binary").is_some() {
        let bytes: [u8; 64] = rand::random();
        return (status, bytes.to_vec()).into_response();
    }
    let body = request.into_body().collect().await.unwrap().to_bytes();
    let mut response = (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        format!(
            r#"{{"execution":{n},"echo":{:?}}}"#,
            String::from_utf8_lossy(&body)
        ),
    )
        .into_response();
    let out = response.headers_mut();
    out.append(header::SET_COOKIE, HeaderValue::from_static("a=1"));
    out.append(header::SET_COOKIE, HeaderValue::from_static("b=2"));
    response
}

pub fn router(handler: &Handler, layer: IdempotencyLayer) -> Router {
    Router::new()
        .route("/pay", routing::post(handle).get(handle).put(handle))
        .route("/other", routing::post(handle))
        .layer(layer)
        .with_state(handler.clone())
}

/// The layer on `store`; the test apps' requests name no principal, so they share the
/// anonymous scope, by choice.
pub fn layer(store: &Arc<dyn Store>) -> IdempotencyLayer {
    IdempotencyLayer::from_shared(store.clone()).allow_anonymous()
}

/// A request under construction: `post("/pay").key("k").body("{}")`.
pub struct Req(axum::http::request::Builder, Body);

pub fn post(path: &str) -> Req {
    Req(Request::post(path), Body::empty())
}

impl Req {
    pub fn key(self, key: &str) -> Self {
        self.header("idempotency-key", key)
    }
    pub fn header(self, name: &str, value: &str) -> Self {
        Req(self.0.header(name, value), self.1)
    }
    pub fn method(self, method: &str) -> Self {
        Req(self.0.method(method), self.1)
    }
    pub fn body(self, body: impl Into<Body>) -> Self {
        Req(self.0, body.into())
    }
    pub fn build(self) -> Request {
        self.0.body(self.1).unwrap()
    }
}

/// A response read whole.
#[derive(Debug)]
pub struct Answer {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Answer {
    /// Asserts a fresh execution's `201`, not a replay.
    pub fn assert_executed(&self) {
        assert_eq!(
            (self.status, self.replayed()),
            (StatusCode::CREATED, false),
            "{self:?}"
        );
    }

    pub fn replayed(&self) -> bool {
        self.headers
            .get("idempotent-replayed")
            .is_some_and(|v| v == "true")
    }
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap()
    }
    pub fn error(&self) -> String {
        self.json()["error"].as_str().unwrap_or_default().to_owned()
    }
}

pub async fn send(app: &Router, req: Req) -> Answer {
    read(app.clone().oneshot(req.build()).await.unwrap()).await
}

pub async fn read<B>(response: Response<B>) -> Answer
where
    B: http_body::Body,
    B::Error: std::fmt::Debug,
{
    let (parts, body) = response.into_parts();
    let body = body.collect().await.unwrap().to_bytes();
    Answer {
        status: parts.status,
        headers: parts.headers,
        body,
    }
}

pub fn scope(key: &str) -> Scope {
    let key = IdempotencyKey::parse(&HeaderValue::from_str(key).unwrap()).unwrap();
    Scope::new(None, "POST /pay".to_owned(), key)
}

/// Claims `key` through `store` for `lease`, as `post("/pay").key(key)` would, for a holder
/// that then dies: nobody completes or releases the claim, its lease runs out.
pub async fn claim_and_crash(store: &dyn Store, key: &str, lease: Duration) {
    claim_as_post(store, key, lease).await;
}

/// Claims `key` through `store` for `lease`, as `post("/pay").key(key)` would: its
/// duplicates wait for it.
pub async fn claim_as_post(store: &dyn Store, key: &str, lease: Duration) -> ClaimToken {
    match store
        .claim(&scope(key), post_fingerprint(), lease)
        .await
        .unwrap()
    {
        tower_idempotency::store::Claim::Claimed(token) => token,
        other => panic!("the holder claims a free key: {other:?}"),
    }
}

/// The fingerprint of `post("/pay").key(…)` (no body).
pub fn post_fingerprint() -> Fingerprint {
    let parts = axum::http::Request::post("/pay")
        .body(())
        .unwrap()
        .into_parts()
        .0;
    Fingerprint::of(&parts, &[], b"")
}

pub fn post_waiting(key: &str) -> Req {
    post("/pay").key(key).header("x-wait", "1")
}

/// Waits (bounded) until the handler has started `n` executions.
pub async fn until_executing(handler: &Handler, n: usize) {
    for _ in 0..500 {
        if handler.executions() >= n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("the handler never reached {n} executions");
}

/// Sends `request` in a task of its own.
pub fn spawn_send(app: &Router, request: Req) -> tokio::task::JoinHandle<Answer> {
    let app = app.clone();
    tokio::spawn(async move { send(&app, request).await })
}

/// Gives a task time to reach its wait (for an original), and checks it is still waiting.
pub async fn still_waiting(task: &tokio::task::JoinHandle<Answer>) {
    tokio::time::sleep(Duration::from_millis(150)).await;
    assert!(
        !task.is_finished(),
        "the duplicate answered while the original ran"
    );
}
