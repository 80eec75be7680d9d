//! The idempotency layer composed with tower-http's layers, each placed inside or outside
//! it, in a real axum `Router`: where each layer belongs, and what goes wrong elsewhere.
//!
//! In an axum `Router`, `.layer(a).layer(b)` makes `b` the outermost: it sees the request
//! first and the response last.

#[macro_use]
mod support;

use std::{
    io::Read,
    sync::{atomic::Ordering, Arc, Mutex},
    time::Duration,
};

use axum::{
    body::Body,
    extract::{Request, State},
    http::{header, HeaderName, HeaderValue, Method, StatusCode},
    response::{IntoResponse, Response},
    routing, Router,
};
use bytes::Bytes;
use http_body_util::BodyExt;
use tower_http::{
    catch_panic::CatchPanicLayer,
    compression::CompressionLayer,
    cors::CorsLayer,
    limit::RequestBodyLimitLayer,
    timeout::TimeoutLayer,
    trace::{DefaultMakeSpan, DefaultOnRequest, HttpMakeClassifier, OnResponse, TraceLayer},
};
use tower_idempotency::{Principal, Store};

use support::app::*;

on_memory_and_redis!(
    compression_outside_encodes_each_replay_for_its_client,
    compression_inside_replays_only_to_a_client_asking_the_same_encoding,
    timeout_inside_releases_the_key,
    timeout_outside_leaves_the_handler_running_and_records_it,
    catch_panic_inside_or_outside_releases_the_key,
    body_limits_outside_claim_nothing,
    cors_outside_answers_each_origin_for_itself,
    cors_inside_makes_another_origin_a_conflict,
    trace_outside_sees_executions_replays_and_conflicts,
    auth_outside_scopes_keys_by_user,
    auth_inside_lets_one_user_replay_another_users_response,
    recommended_stack_serves_each_client_once,
);

/// A request body long enough that the handler's answer (which echoes it) is over
/// `CompressionLayer`'s default minimum of 32 bytes.
const ORDER: &str = "amount=1000&currency=usd&description=composition-test-order";

fn gunzip(bytes: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    flate2::read::GzDecoder::new(bytes)
        .read_to_end(&mut out)
        .expect("a gzip body");
    out
}

/// The test app's `POST /pay` without any layer, for the stacks built here.
fn routes() -> Router<Handler> {
    Router::new().route("/pay", routing::post(handle))
}

fn header_str<'a>(answer: &'a Answer, name: &str) -> Option<&'a str> {
    answer.headers.get(name).map(|v| v.to_str().unwrap())
}

fn assert_reused_with_different_params(answer: &Answer) {
    assert_eq!(
        (answer.status, answer.error().as_str()),
        (
            StatusCode::CONFLICT,
            "idempotency_key_reused_with_different_params"
        ),
        "{answer:?}"
    );
}

// ---------------------------------------------------------------------------------------
// Compression.

/// Outside, compression applies to every answer, replays included: the layer records the
/// identity bytes once and each client gets them in the encoding it asked for.
async fn compression_outside_encodes_each_replay_for_its_client(store: Arc<dyn Store>) {
    let handler = Handler::default();
    let app = router(&handler, layer(&store)).layer(CompressionLayer::new());
    let order = || post("/pay").key("zip").body(ORDER);

    let first = send(&app, order().header("accept-encoding", "gzip")).await;
    first.assert_executed();
    assert_eq!(header_str(&first, "content-encoding"), Some("gzip"));
    let identity = gunzip(&first.body);
    assert!(
        identity.starts_with(br#"{"execution":1,"#),
        "{:?}",
        String::from_utf8_lossy(&identity)
    );

    let plain = send(&app, order()).await;
    assert_eq!(
        (plain.status, plain.replayed()),
        (StatusCode::CREATED, true)
    );
    assert_eq!(header_str(&plain, "content-encoding"), None);
    assert_eq!(plain.body, identity);

    let gzipped = send(&app, order().header("accept-encoding", "gzip")).await;
    assert_eq!(
        (gzipped.status, gzipped.replayed()),
        (StatusCode::CREATED, true)
    );
    assert_eq!(header_str(&gzipped, "content-encoding"), Some("gzip"));
    assert_eq!(gunzip(&gzipped.body), identity);
    assert_eq!(handler.executions(), 1);
}

/// Inside, the recorded response is one negotiated representation (`Vary:
/// accept-encoding`): replayed to a retry asking the same, and a conflict for one asking
/// otherwise, which must never get bytes in an encoding it did not accept.
async fn compression_inside_replays_only_to_a_client_asking_the_same_encoding(
    store: Arc<dyn Store>,
) {
    let handler = Handler::default();
    let app = routes()
        .layer(CompressionLayer::new())
        .layer(layer(&store))
        .with_state(handler.clone());
    let order = |key: &str| post("/pay").key(key).body(ORDER);

    let first = send(&app, order("zip").header("accept-encoding", "gzip")).await;
    first.assert_executed();
    assert_eq!(header_str(&first, "content-encoding"), Some("gzip"));
    assert_eq!(header_str(&first, "vary"), Some("accept-encoding"));
    assert!(gunzip(&first.body).starts_with(br#"{"execution":1,"#));

    let same = send(&app, order("zip").header("accept-encoding", "gzip")).await;
    assert_eq!((same.status, same.replayed()), (StatusCode::CREATED, true));
    assert_eq!(header_str(&same, "content-encoding"), Some("gzip"));
    assert_eq!(same.body, first.body);

    for other in [
        order("zip"),
        order("zip").header("accept-encoding", "identity"),
    ] {
        let answer = send(&app, other).await;
        assert_reused_with_different_params(&answer);
        assert_eq!(header_str(&answer, "content-encoding"), None);
        assert_ne!(answer.body, first.body);
    }
    assert_eq!(handler.executions(), 1);

    // The other way round: an identity response recorded first (compressible, so it varies
    // on Accept-Encoding all the same) is not replayed to a client asking for gzip either.
    let plain = send(&app, order("plain")).await;
    plain.assert_executed();
    assert_eq!(header_str(&plain, "content-encoding"), None);
    assert_eq!(header_str(&plain, "vary"), Some("accept-encoding"));
    assert_reused_with_different_params(
        &send(&app, order("plain").header("accept-encoding", "gzip")).await,
    );
    let again = send(&app, order("plain")).await;
    assert_eq!((again.replayed(), &again.body), (true, &plain.body));
    assert_eq!(handler.executions(), 2);
}

// ---------------------------------------------------------------------------------------
// Timeouts.

/// tower-http's timeout answering `408` (`TimeoutLayer::new`, which also does, is
/// deprecated since 0.6.7).
fn timeout(after: Duration) -> TimeoutLayer {
    TimeoutLayer::with_status_code(StatusCode::REQUEST_TIMEOUT, after)
}

/// Inside, a timeout cancels the handler and answers 408, which releases the key: the retry
/// executes again. (Safe only for a handler that may be cancelled at any `.await`.)
async fn timeout_inside_releases_the_key(store: Arc<dyn Store>) {
    let handler = Handler::default();
    let app = routes()
        .layer(timeout(Duration::from_secs(1)))
        .layer(layer(&store))
        .with_state(handler.clone());
    // Waits at the gate, which never opens: only the timeout ends it.
    let stuck = send(&app, post_waiting("t").body("amount=1")).await;
    assert_eq!(
        (stuck.status, stuck.replayed()),
        (StatusCode::REQUEST_TIMEOUT, false)
    );
    assert_eq!(handler.executions(), 1);

    let retry = send(&app, post("/pay").key("t").body("amount=1")).await;
    retry.assert_executed();
    assert_eq!(retry.json()["execution"], 2);
    let again = send(&app, post("/pay").key("t").body("amount=1")).await;
    assert_eq!((again.replayed(), &again.body), (true, &retry.body));
    assert_eq!(handler.executions(), 2);
}

/// Outside, a timeout answers its client but cannot cancel the execution: the handler runs
/// on, duplicates meanwhile are told to come back soon (not after the whole lease), and its
/// response is recorded and replayed.
async fn timeout_outside_leaves_the_handler_running_and_records_it(store: Arc<dyn Store>) {
    let handler = Handler::default();
    // Retries pass through the same timeout: it leaves them room for a store round trip.
    let app = router(&handler, layer(&store).lease(Duration::from_secs(30)))
        .layer(timeout(Duration::from_millis(500)));
    let request = || post_waiting("slow").body("amount=1");

    let gave_up = send(&app, request()).await;
    assert_eq!(
        (gave_up.status, gave_up.replayed()),
        (StatusCode::REQUEST_TIMEOUT, false)
    );
    until_executing(&handler, 1).await;

    let during = send(&app, request()).await;
    assert_eq!(
        (during.status, during.error().as_str()),
        (StatusCode::CONFLICT, "request_in_progress"),
        "{during:?}"
    );
    let retry_after: u64 = header_str(&during, "retry-after").unwrap().parse().unwrap();
    assert!((1..=2).contains(&retry_after), "Retry-After {retry_after}");
    assert_eq!(during.json()["retry_after"], retry_after);

    handler.gate.add_permits(1);
    let mut answer = send(&app, request()).await;
    for _ in 0..500 {
        if answer.status != StatusCode::CONFLICT {
            break;
        }
        assert_eq!(answer.error(), "request_in_progress");
        tokio::time::sleep(Duration::from_millis(10)).await;
        answer = send(&app, request()).await;
    }
    assert_eq!(
        (answer.status, answer.replayed()),
        (StatusCode::CREATED, true),
        "{answer:?}"
    );
    assert_eq!(answer.json()["execution"], 1);
    assert_eq!(handler.executions(), 1);
}

// ---------------------------------------------------------------------------------------
// Panics.

/// Either way a panic reaches the client as a 500 and the key is released: outside, the
/// layer releases and lets the panic go on to `CatchPanicLayer`; inside, the 500 releases
/// like any 5xx.
async fn catch_panic_inside_or_outside_releases_the_key(store: Arc<dyn Store>) {
    let handler = Handler::default();
    let outside = router(&handler, layer(&store)).layer(CatchPanicLayer::new());
    let inside = routes()
        .layer(CatchPanicLayer::new())
        .layer(layer(&store))
        .with_state(handler.clone());
    for (app, key) in [(outside, "outside"), (inside, "inside")] {
        let before = handler.executions();
        let panicked = send(&app, post("/pay").key(key).header("x-panic", "1")).await;
        assert_eq!(
            (panicked.status, panicked.replayed()),
            (StatusCode::INTERNAL_SERVER_ERROR, false),
            "{key}"
        );
        let retry = send(&app, post("/pay").key(key)).await;
        retry.assert_executed();
        let again = send(&app, post("/pay").key(key)).await;
        assert_eq!(
            (again.replayed(), &again.body),
            (true, &retry.body),
            "{key}"
        );
        assert_eq!(handler.executions(), before + 2, "{key}");
    }
}

// ---------------------------------------------------------------------------------------
// Body limits.

/// A body over a limit is refused before anything is claimed, by tower-http's limit
/// outside or by the layer's own `max_request_body`: the key stays free for a request
/// within the limit.
async fn body_limits_outside_claim_nothing(store: Arc<dyn Store>) {
    let handler = Handler::default();
    let app = router(&handler, layer(&store)).layer(RequestBodyLimitLayer::new(16));
    let over = send(
        &app,
        post("/pay")
            .key("big")
            .header("content-length", "17")
            .body("x".repeat(17)),
    )
    .await;
    assert_eq!(over.status, StatusCode::PAYLOAD_TOO_LARGE, "{over:?}");
    assert!(!over.replayed());
    assert_eq!(handler.executions(), 0);
    // Without a Content-Length, tower-http's limit trips while the layer reads the body:
    // refused, nothing claimed (but see `streamed_body_over_an_outer_limit_is_413`).
    let streamed = send(&app, post("/pay").key("big").body(streamed_body(20))).await;
    assert!(streamed.status.is_client_error(), "{streamed:?}");
    assert!(!streamed.replayed());
    assert_eq!(handler.executions(), 0);
    let small = send(&app, post("/pay").key("big").body("x".repeat(16))).await;
    small.assert_executed();
    assert_eq!(handler.executions(), 1);

    let own = router(&handler, layer(&store).max_request_body(16));
    let over = send(&own, post("/pay").key("own").body("x".repeat(17))).await;
    assert_eq!(over.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(
        over.json(),
        serde_json::json!({"error": "request_body_too_large", "limit": 16})
    );
    assert_eq!(handler.executions(), 1);
    send(&own, post("/pay").key("own").body("x".repeat(16)))
        .await
        .assert_executed();
    assert_eq!(handler.executions(), 2);
}

/// A body of `len` bytes in two chunks, without a Content-Length.
fn streamed_body(len: usize) -> Body {
    let half = len / 2;
    let chunks = ["x".repeat(half), "x".repeat(len - half)]
        .map(|chunk| Ok::<_, std::io::Error>(Bytes::from(chunk)));
    Body::from_stream(futures_util::stream::iter(chunks))
}

/// A streamed body over tower-http's limit outside is answered `413`, as a declared one is
/// (and as axum's own extractors answer it), although the router between the two layers
/// hands the limit's error on wrapped in `axum::Error`. Store-independent: nothing
/// reaches the store.
#[tokio::test]
async fn streamed_body_over_an_outer_limit_is_413() {
    let handler = Handler::default();
    let store: Arc<dyn Store> = Arc::new(tower_idempotency::MemoryStore::new());
    let app = router(&handler, layer(&store)).layer(RequestBodyLimitLayer::new(16));
    let streamed = send(&app, post("/pay").key("big").body(streamed_body(20))).await;
    assert_eq!(
        streamed.status,
        StatusCode::PAYLOAD_TOO_LARGE,
        "{streamed:?}"
    );
    assert_eq!(handler.executions(), 0);
}

// ---------------------------------------------------------------------------------------
// CORS.

const ORIGIN_A: &str = "https://a.example";
const ORIGIN_B: &str = "https://b.example";

fn cors() -> CorsLayer {
    CorsLayer::new()
        .allow_origin([
            HeaderValue::from_static(ORIGIN_A),
            HeaderValue::from_static(ORIGIN_B),
        ])
        .allow_methods([Method::POST])
        .allow_headers([
            header::CONTENT_TYPE,
            HeaderName::from_static("idempotency-key"),
        ])
}

fn from_origin(origin: &str, key: &str) -> Req {
    post("/pay")
        .key(key)
        .header("origin", origin)
        .body("amount=1")
}

/// Outside, CORS answers preflights itself and adds each request's own CORS headers to
/// whatever the layer answers, replays included.
async fn cors_outside_answers_each_origin_for_itself(store: Arc<dyn Store>) {
    let handler = Handler::default();
    let app = router(&handler, layer(&store)).layer(cors());

    let preflight = send(
        &app,
        post("/pay")
            .method("OPTIONS")
            .header("origin", ORIGIN_A)
            .header("access-control-request-method", "POST")
            .header("access-control-request-headers", "idempotency-key"),
    )
    .await;
    assert_eq!(preflight.status, StatusCode::OK);
    assert_eq!(
        header_str(&preflight, "access-control-allow-origin"),
        Some(ORIGIN_A)
    );
    assert!(header_str(&preflight, "access-control-allow-headers")
        .unwrap()
        .contains("idempotency-key"));
    assert_eq!(handler.executions(), 0);

    let first = send(&app, from_origin(ORIGIN_A, "cors")).await;
    first.assert_executed();
    assert_eq!(
        header_str(&first, "access-control-allow-origin"),
        Some(ORIGIN_A)
    );
    let from_b = send(&app, from_origin(ORIGIN_B, "cors")).await;
    assert_eq!(
        (from_b.status, from_b.replayed()),
        (StatusCode::CREATED, true)
    );
    assert_eq!(from_b.body, first.body);
    assert_eq!(
        header_str(&from_b, "access-control-allow-origin"),
        Some(ORIGIN_B)
    );
    assert_eq!(handler.executions(), 1);
}

/// Inside, the recorded response carries the first origin's CORS headers and varies on
/// `Origin`: a retry from another origin is a conflict, never handed the first origin's
/// headers. (The conflict itself carries no CORS headers, so a browser hides it.)
async fn cors_inside_makes_another_origin_a_conflict(store: Arc<dyn Store>) {
    let handler = Handler::default();
    let app = routes()
        .layer(cors())
        .layer(layer(&store))
        .with_state(handler.clone());

    let first = send(&app, from_origin(ORIGIN_A, "cors")).await;
    first.assert_executed();
    assert_eq!(
        header_str(&first, "access-control-allow-origin"),
        Some(ORIGIN_A)
    );
    assert!(header_str(&first, "vary").unwrap().contains("origin"));

    let from_b = send(&app, from_origin(ORIGIN_B, "cors")).await;
    assert_reused_with_different_params(&from_b);
    assert_eq!(header_str(&from_b, "access-control-allow-origin"), None);

    let from_a = send(&app, from_origin(ORIGIN_A, "cors")).await;
    assert_eq!((from_a.replayed(), &from_a.body), (true, &first.body));
    assert_eq!(
        header_str(&from_a, "access-control-allow-origin"),
        Some(ORIGIN_A)
    );
    assert_eq!(handler.executions(), 1);
}

// ---------------------------------------------------------------------------------------
// Tracing.

type Seen = Arc<Mutex<Vec<(StatusCode, bool)>>>;

/// A `TraceLayer` whose `on_response` notes each response's status and replay marker.
fn traced(
    seen: &Seen,
) -> TraceLayer<HttpMakeClassifier, DefaultMakeSpan, DefaultOnRequest, impl OnResponse<Body> + Clone>
{
    let seen = seen.clone();
    TraceLayer::new_for_http().on_response(
        move |response: &Response<Body>, _latency: Duration, _span: &tracing::Span| {
            let replayed = response.headers().contains_key("idempotent-replayed");
            seen.lock().unwrap().push((response.status(), replayed));
        },
    )
}

/// Outside, tracing sees every answer: executions, replays (marked) and the layer's own
/// conflicts. Inside, it sees executions only.
async fn trace_outside_sees_executions_replays_and_conflicts(store: Arc<dyn Store>) {
    let handler = Handler::default();
    let outer: Seen = Arc::default();
    let app = router(&handler, layer(&store)).layer(traced(&outer));
    send(&app, post("/pay").key("tr").body("amount=1"))
        .await
        .assert_executed();
    let replay = send(&app, post("/pay").key("tr").body("amount=1")).await;
    assert!(replay.replayed());
    let conflict = send(&app, post("/pay").key("tr").body("amount=2")).await;
    assert_reused_with_different_params(&conflict);
    assert_eq!(
        *outer.lock().unwrap(),
        [
            (StatusCode::CREATED, false),
            (StatusCode::CREATED, true),
            (StatusCode::CONFLICT, false)
        ]
    );

    let inner: Seen = Arc::default();
    let app = routes()
        .layer(traced(&inner))
        .layer(layer(&store))
        .with_state(handler.clone());
    send(&app, post("/pay").key("tr-inside"))
        .await
        .assert_executed();
    assert!(send(&app, post("/pay").key("tr-inside")).await.replayed());
    assert_eq!(*inner.lock().unwrap(), [(StatusCode::CREATED, false)]);
    assert_eq!(handler.executions(), 2);
}

// ---------------------------------------------------------------------------------------
// Authentication.

/// A stand-in for session authentication: the user named by `x-session` becomes the
/// request's `Principal`.
async fn authenticate(mut request: Request) -> Request {
    let user = request
        .headers()
        .get("x-session")
        .map(|v| v.to_str().unwrap().to_owned());
    if let Some(user) = user {
        request.extensions_mut().insert(Principal::new(user));
    }
    request
}

/// Answers with the user it acted for, as a handler behind authentication would.
async fn whoami(State(handler): State<Handler>, request: Request) -> Response {
    let n = handler.executions.fetch_add(1, Ordering::SeqCst) + 1;
    let user = request
        .extensions()
        .get::<Principal>()
        .map(|p| p.as_str().to_owned());
    let body = request.into_body().collect().await.unwrap().to_bytes();
    let echo = String::from_utf8_lossy(&body);
    let body = serde_json::json!({ "execution": n, "user": user, "echo": echo });
    (
        StatusCode::CREATED,
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

fn as_user(user: &str, key: &str) -> Req {
    post("/pay")
        .key(key)
        .header("x-session", user)
        .body("amount=1")
}

/// Outside, the layer sees who the caller is: one key, two users, two executions, and each
/// user replayed their own response.
async fn auth_outside_scopes_keys_by_user(store: Arc<dyn Store>) {
    let handler = Handler::default();
    let app = Router::new()
        .route("/pay", routing::post(whoami))
        .layer(layer(&store))
        .layer(axum::middleware::map_request(authenticate))
        .with_state(handler.clone());
    for user in ["alice", "bob"] {
        let answer = send(&app, as_user(user, "shared")).await;
        answer.assert_executed();
        assert_eq!(answer.json()["user"], user);
    }
    for user in ["alice", "bob"] {
        let answer = send(&app, as_user(user, "shared")).await;
        assert_eq!(
            (answer.status, answer.replayed()),
            (StatusCode::CREATED, true)
        );
        assert_eq!(answer.json()["user"], user);
    }
    assert_eq!(handler.executions(), 2);
}

/// Inside, the layer runs before authentication and cannot tell users apart (here they
/// send no `Authorization` header either): the second user's request with the same key is
/// replayed the FIRST user's response. This is why authentication goes outside.
async fn auth_inside_lets_one_user_replay_another_users_response(store: Arc<dyn Store>) {
    let handler = Handler::default();
    let app = Router::new()
        .route("/pay", routing::post(whoami))
        .layer(axum::middleware::map_request(authenticate))
        .layer(layer(&store))
        .with_state(handler.clone());
    let alice = send(&app, as_user("alice", "shared")).await;
    alice.assert_executed();
    assert_eq!(alice.json()["user"], "alice");

    let bob = send(&app, as_user("bob", "shared")).await;
    // The hazard: bob's request never ran, and he is handed alice's response.
    assert_eq!((bob.status, bob.replayed()), (StatusCode::CREATED, true));
    assert_eq!(bob.json()["user"], "alice");
    assert_eq!(bob.body, alice.body);
    assert_eq!(handler.executions(), 1);
}

// ---------------------------------------------------------------------------------------
// The whole recommended stack.

/// Session authentication that turns away requests without a session: `401`, before the
/// idempotency layer sees them.
async fn require_session(mut request: Request, next: axum::middleware::Next) -> Response {
    let Some(user) = request.headers().get("x-session").cloned() else {
        return StatusCode::UNAUTHORIZED.into_response();
    };
    let user = user.to_str().unwrap().to_owned();
    request.extensions_mut().insert(Principal::new(user));
    next.run(request).await
}

/// Every layer above in its recommended place (the last `.layer` is the outermost): one
/// execution per user and key, each client answered in its own encoding and with its own
/// origin's CORS headers, unauthenticated and oversized requests refused before the
/// layer, every answer traced.
async fn recommended_stack_serves_each_client_once(store: Arc<dyn Store>) {
    let handler = Handler::default();
    let seen: Seen = Arc::default();
    let app = Router::new()
        .route("/pay", routing::post(whoami))
        .layer(layer(&store).required())
        .layer(axum::middleware::from_fn(require_session))
        .layer(timeout(Duration::from_secs(10)))
        .layer(RequestBodyLimitLayer::new(64 * 1024))
        .layer(CompressionLayer::new())
        .layer(cors())
        .layer(CatchPanicLayer::new())
        .layer(traced(&seen))
        .with_state(handler.clone());
    let order = |user: Option<&str>, origin: &str| {
        let request = post("/pay").key("k").header("origin", origin).body(ORDER);
        match user {
            Some(user) => request.header("x-session", user),
            None => request,
        }
    };

    let preflight = send(
        &app,
        post("/pay")
            .method("OPTIONS")
            .header("origin", ORIGIN_A)
            .header("access-control-request-method", "POST")
            .header("access-control-request-headers", "idempotency-key"),
    )
    .await;
    assert_eq!(preflight.status, StatusCode::OK);
    let anonymous = send(&app, order(None, ORIGIN_A)).await;
    assert_eq!(anonymous.status, StatusCode::UNAUTHORIZED);
    assert_eq!(handler.executions(), 0);

    let first = send(
        &app,
        order(Some("alice"), ORIGIN_A).header("accept-encoding", "gzip"),
    )
    .await;
    first.assert_executed();
    assert_eq!(header_str(&first, "content-encoding"), Some("gzip"));
    assert_eq!(
        header_str(&first, "access-control-allow-origin"),
        Some(ORIGIN_A)
    );
    let identity = gunzip(&first.body);
    let retry = send(&app, order(Some("alice"), ORIGIN_B)).await;
    assert_eq!(
        (retry.status, retry.replayed()),
        (StatusCode::CREATED, true)
    );
    assert_eq!(header_str(&retry, "content-encoding"), None);
    assert_eq!(
        header_str(&retry, "access-control-allow-origin"),
        Some(ORIGIN_B)
    );
    assert_eq!(retry.body, identity);
    assert_eq!(retry.json()["user"], "alice");

    let bob = send(&app, order(Some("bob"), ORIGIN_A)).await;
    bob.assert_executed();
    assert_eq!(bob.json()["user"], "bob");

    let too_large = send(
        &app,
        order(Some("alice"), ORIGIN_A).header("content-length", "65537"),
    )
    .await;
    assert_eq!(too_large.status, StatusCode::PAYLOAD_TOO_LARGE);

    assert_eq!(
        *seen.lock().unwrap(),
        [
            (StatusCode::OK, false),
            (StatusCode::UNAUTHORIZED, false),
            (StatusCode::CREATED, false),
            (StatusCode::CREATED, true),
            (StatusCode::CREATED, false),
            (StatusCode::PAYLOAD_TOO_LARGE, false),
        ]
    );
    assert_eq!(handler.executions(), 2);
}

// ---------------------------------------------------------------------------------------
// Nested routers: axum's `nest` strips the prefix it matched before the nested routes'
// layers run; the layer reads the path the client sent.

/// Sends `body` under `key` to `path` as alice; the status and body.
async fn charge(app: &Router, path: &str, key: &str, body: &'static str) -> (StatusCode, String) {
    let request = Request::post(path)
        .header("idempotency-key", key)
        .header("authorization", "Bearer alice")
        .header("content-type", "application/json")
        .body(Body::from(body))
        .unwrap();
    let answer = read(
        tower::ServiceExt::oneshot(app.clone(), request)
            .await
            .unwrap(),
    )
    .await;
    (
        answer.status,
        String::from_utf8_lossy(&answer.body).into_owned(),
    )
}

/// A route that charges the account in its path, counting its executions.
fn charges(executions: &Arc<std::sync::atomic::AtomicUsize>) -> routing::MethodRouter {
    let executions = executions.clone();
    routing::post(
        move |axum::extract::Path(account): axum::extract::Path<String>| {
            executions.fetch_add(1, Ordering::SeqCst);
            async move { (StatusCode::CREATED, format!("charged account {account}")) }
        },
    )
}

/// Routes charging `/accounts/{account}/charges`, nested, with `with_layer` applied to the
/// nested routes; and how many charges ran.
fn nested_accounts(
    with_layer: impl FnOnce(Router) -> Router,
) -> (Router, Arc<std::sync::atomic::AtomicUsize>) {
    let executions = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let inner = Router::new().route("/charges", charges(&executions));
    let app = Router::new().nest("/accounts/{account}", with_layer(inner));
    (app, executions)
}

const AMOUNT: &str = r#"{"amount":100}"#;

/// Charges `account` under key `k1`, which must execute for it; its answer.
async fn charged(app: &Router, account: &str) -> String {
    let path = format!("/accounts/{account}/charges");
    let (status, body) = charge(app, &path, "k1", AMOUNT).await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    assert_eq!(body, format!("charged account {account}"));
    body
}

/// A charge on account A, then the same key and body for account B: another request, so
/// executed for B, never answered with A's record; A's retry is still A's replay.
#[tokio::test]
async fn a_nested_route_is_scoped_and_fingerprinted_by_the_path_sent() {
    let store: Arc<dyn Store> = Arc::new(tower_idempotency::MemoryStore::new());
    let layer = layer(&store).allow_anonymous();
    let (app, executions) = nested_accounts(|routes| routes.layer(layer));
    let a = charged(&app, "A").await;
    charged(&app, "B").await;
    let (status, again) = charge(&app, "/accounts/A/charges", "k1", AMOUNT).await;
    assert_eq!((status, again), (StatusCode::CREATED, a));
    assert_eq!(executions.load(Ordering::SeqCst), 2);
}

/// Scoped by the route's template, the key is the template's: sent for account B after
/// account A, it is a key reused with other parameters (the path the client sent differs),
/// never A's replay.
#[tokio::test]
async fn a_nested_route_scoped_by_its_template_is_fingerprinted_by_the_path_sent() {
    let store: Arc<dyn Store> = Arc::new(tower_idempotency::MemoryStore::new());
    let layer = layer(&store).allow_anonymous().endpoint_from_matched_path();
    let (app, executions) = nested_accounts(|routes| routes.route_layer(layer));
    let a = charged(&app, "A").await;
    let (status, b) = charge(&app, "/accounts/B/charges", "k1", AMOUNT).await;
    assert_eq!(status, StatusCode::CONFLICT, "{b}");
    assert!(
        b.contains("idempotency_key_reused_with_different_params"),
        "{b}"
    );
    let (_, again) = charge(&app, "/accounts/A/charges", "k1", AMOUNT).await;
    assert_eq!(again, a);
    assert_eq!(executions.load(Ordering::SeqCst), 1);
}

/// Two API versions nested under one layer (one store): each version's request is its own.
#[tokio::test]
async fn two_nested_api_versions_keep_their_records_apart() {
    let store: Arc<dyn Store> = Arc::new(tower_idempotency::MemoryStore::new());
    let layer = layer(&store).allow_anonymous();
    let api = |version: &'static str| {
        Router::new().route(
            "/payments",
            routing::post(move || async move {
                (StatusCode::CREATED, format!("paid through {version}"))
            }),
        )
    };
    let app = Router::new()
        .nest("/v1", api("v1").layer(layer.clone()))
        .nest("/v2", api("v2").layer(layer));
    let (_, one) = charge(&app, "/v1/payments", "k", "{}").await;
    assert_eq!(one, "paid through v1");
    let (status, two) = charge(&app, "/v2/payments", "k", "{}").await;
    assert_eq!(
        (status, two.as_str()),
        (StatusCode::CREATED, "paid through v2")
    );
}

// ---------------------------------------------------------------------------------------
// A signature check in front of an unscoped webhook route.

/// Webhook senders authenticate by signature; the check outside the layer names each
/// sender with a `Principal`, which scopes its event ids even on an `unscoped()` route:
/// two senders' events with one id are two deliveries, each handled.
#[tokio::test]
async fn a_principal_named_by_the_signature_check_scopes_an_unscoped_webhook_route() {
    let executions = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let store: Arc<dyn Store> = Arc::new(tower_idempotency::MemoryStore::new());
    let scoped_by_sender = layer(&store).key_from_json("/id").required().unscoped();
    let verify = axum::middleware::from_fn(
        |mut request: Request, next: axum::middleware::Next| async move {
            let sender = request.headers()["x-sender"].to_str().unwrap().to_owned();
            request.extensions_mut().insert(Principal::new(sender));
            next.run(request).await
        },
    );
    let handled = {
        let executions = executions.clone();
        move |headers: axum::http::HeaderMap| {
            executions.fetch_add(1, Ordering::SeqCst);
            async move { format!("handled for {:?}", headers["x-sender"]) }
        }
    };
    let app = Router::new()
        .route("/webhooks", routing::post(handled).layer(scoped_by_sender))
        .route_layer(verify);
    let deliver = |sender: &'static str| {
        let app = app.clone();
        async move {
            let request = Request::post("/webhooks")
                .header("x-sender", sender)
                .body(Body::from(r#"{"id":"evt_1","type":"charge.succeeded"}"#))
                .unwrap();
            read(tower::ServiceExt::oneshot(app, request).await.unwrap()).await
        }
    };
    let a = deliver("sender-a").await;
    let b = deliver("sender-b").await;
    assert_eq!(b.body, r#"handled for "sender-b""#, "{a:?}");
    assert!(deliver("sender-a").await.replayed());
    assert_eq!(executions.load(Ordering::SeqCst), 2);
    // Without a Principal, the route is unscoped as before: every sender shares the id.
    let shared = layer(&store).key_from_json("/id").required().unscoped();
    let unnamed = Router::new().route(
        "/events",
        routing::post(|| async { "handled" }).layer(shared),
    );
    let event = || {
        Request::post("/events")
            .body(Body::from(r#"{"id":"evt_2"}"#))
            .unwrap()
    };
    read(
        tower::ServiceExt::oneshot(unnamed.clone(), event())
            .await
            .unwrap(),
    )
    .await;
    let again = read(tower::ServiceExt::oneshot(unnamed, event()).await.unwrap()).await;
    assert!(again.replayed());
}
