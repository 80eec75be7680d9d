//! The layer's rejections as clients see them: every rejection in both HTTP profiles of the
//! `payments` example (the crate's JSON errors, and IETF problem details), a renderer of
//! the application's own in process, and gRPC statuses whatever the HTTP profile.

#[path = "../examples/payments/store.rs"]
#[allow(dead_code)] // The tests use its documentation URL, not the stores.
mod example_store;
mod support;

use std::{
    collections::BTreeSet,
    io,
    process::{Child, Command, Stdio},
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
};

use axum::body::Body;
use bytes::Bytes;
use example_store::PROBLEM_DOCS;
use http::{header, Response};
use reqwest::StatusCode;
use serde_json::{json, Value};
use support::grpc::{self, service::ChargeRequest};
use support::{
    app::{self, Answer, Handler},
    payments::{charge, fresh_key, slow_charge, ExampleProcess, Reply},
    raw_http,
    redis_server::RedisServer,
};
use tonic::{transport::Channel, Code, Status};
use tower_idempotency::{
    IdempotencyLayer, MemoryStore, RedisStore, Rejection, RejectionKind, Store,
};

/// The layer's default request body limit: 1 MiB.
const DEFAULT_LIMIT: u64 = 1024 * 1024;
/// The layer's default lease: no wait it advises can be longer.
const LEASE_SECS: u64 = 30;
/// The longest wait advised while a 3-second request holds its key: as long again as it
/// has run so far (at most its 3 s and the recording of its response), in whole seconds
/// rounded up.
const MAX_SLOW_WAIT: u64 = 4;

// ---------------------------------------------------------------------------------------
// What each rejection looks like.
// ---------------------------------------------------------------------------------------

/// A rejection as a client sees it, with what only it carries.
#[derive(Clone, Copy, Debug)]
enum Kind {
    KeyRequired,
    InvalidKey,
    InvalidBody,
    BodyTooLarge { limit: u64 },
    Reused,
    InProgress { retry_after: u64 },
    StoreUnavailable,
    NotReplayable { original: u16 },
}

impl Kind {
    fn code(self) -> &'static str {
        match self {
            Kind::KeyRequired => "idempotency_key_required",
            Kind::InvalidKey => "invalid_idempotency_key",
            Kind::InvalidBody => "invalid_request_body",
            Kind::BodyTooLarge { .. } => "request_body_too_large",
            Kind::Reused => "idempotency_key_reused_with_different_params",
            Kind::InProgress { .. } => "request_in_progress",
            Kind::StoreUnavailable => "idempotency_store_unavailable",
            Kind::NotReplayable { .. } => "response_not_replayable",
        }
    }

    /// The problem's `title`: the same for every rejection of a kind (the IETF draft's
    /// wording where it has one).
    fn title(self) -> &'static str {
        match self {
            Kind::KeyRequired => "Idempotency-Key is missing",
            Kind::InvalidKey => "Idempotency-Key is invalid",
            Kind::InvalidBody => "Request body could not be read",
            Kind::BodyTooLarge { .. } => "Request body is too large",
            Kind::Reused => "Idempotency-Key is already used",
            Kind::InProgress { .. } => "A request is outstanding for this Idempotency-Key",
            Kind::StoreUnavailable => "Idempotency store is unavailable",
            Kind::NotReplayable { .. } => "Response cannot be replayed",
        }
    }

    /// The status of the crate's JSON errors (and of a renderer that keeps
    /// `Rejection::status`).
    fn status(self) -> StatusCode {
        match self {
            Kind::KeyRequired | Kind::InvalidKey | Kind::InvalidBody => StatusCode::BAD_REQUEST,
            Kind::BodyTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            Kind::Reused | Kind::InProgress { .. } | Kind::NotReplayable { .. } => {
                StatusCode::CONFLICT
            }
            Kind::StoreUnavailable => StatusCode::SERVICE_UNAVAILABLE,
        }
    }

    /// The `Retry-After` the answer carries: a key in progress and an unreachable store
    /// only.
    fn retry_after(self) -> Option<u64> {
        match self {
            Kind::InProgress { retry_after } => Some(retry_after),
            Kind::StoreUnavailable => Some(1),
            _ => None,
        }
    }

    /// The crate's JSON error, whole: `{"error":code}` with `limit`, `retry_after` or
    /// `status` beside it where the kind has one (an unreachable store says its wait in
    /// `Retry-After` only).
    fn json_body(self) -> Value {
        let mut body = json!({ "error": self.code() });
        match self {
            Kind::BodyTooLarge { limit } => body["limit"] = limit.into(),
            Kind::InProgress { retry_after } => body["retry_after"] = retry_after.into(),
            Kind::NotReplayable { original } => body["status"] = original.into(),
            _ => {}
        }
        body
    }

    /// Checks that a `detail` (or message) for people says what the kind carries.
    fn check_detail(self, detail: &Value, context: &dyn std::fmt::Debug) {
        let detail = detail
            .as_str()
            .unwrap_or_else(|| panic!("the detail is not a string: {context:?}"));
        assert!(!detail.trim().is_empty(), "empty detail: {context:?}");
        let says = match self {
            Kind::BodyTooLarge { limit } => Some(limit.to_string()),
            Kind::InProgress { retry_after } => Some(format!("{retry_after} s")),
            Kind::StoreUnavailable => Some("1 s".to_owned()),
            Kind::NotReplayable { original } => Some(original.to_string()),
            _ => None,
        };
        if let Some(says) = says {
            assert!(
                detail.contains(&says),
                "the detail does not say {says:?}: {context:?}"
            );
        }
    }
}

/// The HTTP profiles of the `payments` example.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Profile {
    /// `IDEMPOTENCY_PROFILE` unset: the crate's JSON errors.
    Json,
    /// `IDEMPOTENCY_PROFILE=ietf`: RFC 9457 problem details with the draft's statuses.
    Ietf,
}

impl Profile {
    fn env(self) -> Vec<(&'static str, &'static str)> {
        match self {
            Profile::Json => vec![],
            Profile::Ietf => vec![("IDEMPOTENCY_PROFILE", "ietf")],
        }
    }

    /// The status this profile answers `kind` with: the draft's `422` for a reused key.
    fn status(self, kind: Kind) -> StatusCode {
        match (self, kind) {
            (Profile::Ietf, Kind::Reused) => StatusCode::UNPROCESSABLE_ENTITY,
            _ => kind.status(),
        }
    }
}

/// The names of a JSON object's members.
fn members(body: &Value) -> BTreeSet<&str> {
    body.as_object()
        .unwrap_or_else(|| panic!("not a JSON object: {body}"))
        .keys()
        .map(String::as_str)
        .collect()
}

/// Checks a rejection answered over HTTP in `profile`: status, headers and body, member by
/// member.
fn assert_rejection(reply: &Reply, profile: Profile, kind: Kind) {
    let status = profile.status(kind);
    assert_eq!(reply.status, status, "{profile:?} {kind:?}: {reply:?}");
    let retry_after = kind.retry_after().map(|secs| secs.to_string());
    assert_eq!(
        reply.header("retry-after"),
        retry_after.as_deref(),
        "{profile:?} {kind:?}: Retry-After on exactly the answers worth retrying: {reply:?}"
    );
    assert!(!reply.replayed() || matches!(kind, Kind::NotReplayable { .. }));
    let body = reply.json();
    match profile {
        Profile::Json => {
            assert_eq!(
                reply.header("content-type"),
                Some("application/json"),
                "{reply:?}"
            );
            assert_eq!(reply.header("link"), None, "{reply:?}");
            assert_eq!(reply.header("content-language"), None, "{reply:?}");
            assert_eq!(body, kind.json_body(), "{kind:?}: {reply:?}");
        }
        Profile::Ietf => {
            assert_eq!(
                reply.header("content-type"),
                Some("application/problem+json"),
                "{reply:?}"
            );
            assert_eq!(reply.header("content-language"), Some("en"), "{reply:?}");
            let link = format!(r#"<{PROBLEM_DOCS}>; rel="describedby"; type="text/html""#);
            assert_eq!(reply.header("link"), Some(link.as_str()), "{reply:?}");

            let mut expected = BTreeSet::from(["type", "title", "status", "detail", "code"]);
            match kind {
                Kind::BodyTooLarge { .. } => expected.insert("limit"),
                Kind::InProgress { .. } | Kind::StoreUnavailable => expected.insert("retry_after"),
                Kind::NotReplayable { .. } => expected.insert("original_status"),
                _ => false,
            };
            assert_eq!(members(&body), expected, "{kind:?}: {reply:?}");
            assert_eq!(body["type"], PROBLEM_DOCS, "{reply:?}");
            assert_eq!(body["title"], kind.title(), "{reply:?}");
            assert_eq!(body["status"], status.as_u16(), "{reply:?}");
            assert_eq!(body["code"], kind.code(), "{reply:?}");
            kind.check_detail(&body["detail"], reply);
            match kind {
                Kind::BodyTooLarge { limit } => assert_eq!(body["limit"], limit, "{reply:?}"),
                Kind::NotReplayable { original } => {
                    assert_eq!(body["original_status"], original, "{reply:?}")
                }
                _ => {}
            }
            if let Some(secs) = kind.retry_after() {
                assert_eq!(body["retry_after"], secs, "{reply:?}");
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// Over HTTP, against the `payments` example.
// ---------------------------------------------------------------------------------------

#[tokio::test]
async fn every_rejection_over_http_in_the_default_profile() {
    every_rejection_over_http(Profile::Json).await;
}

#[tokio::test]
async fn every_rejection_over_http_in_the_ietf_profile() {
    every_rejection_over_http(Profile::Ietf).await;
}

#[tokio::test]
#[ignore = "needs redis-server: scripts/test.sh"]
async fn store_unavailable_and_not_replayable_in_the_default_profile() {
    store_unavailable_and_not_replayable(Profile::Json).await;
}

#[tokio::test]
#[ignore = "needs redis-server: scripts/test.sh"]
async fn store_unavailable_and_not_replayable_in_the_ietf_profile() {
    store_unavailable_and_not_replayable(Profile::Ietf).await;
}

/// Every rejection the example's in-memory store can give, on one process.
async fn every_rejection_over_http(profile: Profile) {
    let example = ExampleProcess::start(&profile.env()).await;
    let api = example.api();

    // No key on a route that requires one.
    let reply = api
        .post("/v1/payments")
        .user("alice")
        .json(&charge(100))
        .send()
        .await;
    assert_rejection(&reply, profile, Kind::KeyRequired);

    // Invalid keys: too long, and given twice.
    let reply = api.pay(&"k".repeat(256), "alice", &charge(100)).await;
    assert_rejection(&reply, profile, Kind::InvalidKey);
    let twice = fresh_key();
    let reply = api
        .post("/v1/payments")
        .key(&twice)
        .key(&twice)
        .user("alice")
        .json(&charge(100))
        .send()
        .await;
    assert_rejection(&reply, profile, Kind::InvalidKey);

    // A body that ends before its Content-Length, and a malformed chunk.
    let reply = raw_http::exchange(example.addr(), &truncated_body(&fresh_key()), true).await;
    assert_rejection(&reply, profile, Kind::InvalidBody);
    let reply = raw_http::exchange(example.addr(), &malformed_chunk(&fresh_key()), false).await;
    assert_rejection(&reply, profile, Kind::InvalidBody);

    // A body over the default limit, refused by its declared length before a byte of it is
    // read: only the head is sent, so that closing with the body unread cannot reset the
    // connection before the answer is read.
    let reply = raw_http::exchange(
        example.addr(),
        &raw_http::oversized_head(&fresh_key(), DEFAULT_LIMIT),
        false,
    )
    .await;
    assert_rejection(
        &reply,
        profile,
        Kind::BodyTooLarge {
            limit: DEFAULT_LIMIT,
        },
    );
    assert_eq!(api.stats().await.payments_executed, 0, "nothing ran so far");

    // The same key with another amount.
    let key = fresh_key();
    let first = api.pay(&key, "alice", &charge(100)).await;
    first.assert_payment(100, "usd");
    let reply = api.pay(&key, "alice", &charge(200)).await;
    assert_rejection(&reply, profile, Kind::Reused);

    // The same request while the first still runs.
    let key = fresh_key();
    let slow = slow_charge(3000);
    let running = api.pay_in_background(&key, "alice", &slow);
    api.wait_for_payments(2).await;
    let reply = api.pay(&key, "alice", &slow).await;
    let retry_after = reply.json()["retry_after"]
        .as_u64()
        .unwrap_or_else(|| panic!("no whole retry_after: {reply:?}"));
    assert!(
        (1..=MAX_SLOW_WAIT).contains(&retry_after),
        "retry_after {retry_after}: {reply:?}"
    );
    assert_rejection(&reply, profile, Kind::InProgress { retry_after });
    let first = running.await.expect("the first request");
    first.assert_fresh();
    first.assert_payment(700, "usd");
    assert_eq!(api.stats().await.payments_executed, 2);
}

/// An unreachable store, and a response too large to keep: on Redis, which the test stops
/// once the response too large was recorded (the example does not start without its
/// store).
async fn store_unavailable_and_not_replayable(profile: Profile) {
    let mut redis = RedisServer::start();
    let url = redis.url();
    let mut env = profile.env();
    env.extend([
        ("REDIS_URL", url.as_str()),
        ("IDEMPOTENCY_MAX_RESPONSE_BODY", "16"),
    ]);
    let example = ExampleProcess::start(&env).await;
    let api = example.api();

    // A 64-byte token reaches its client whole; its retries are refused, with the status it
    // had.
    let key = fresh_key();
    let token = || api.post("/v1/tokens").key(&key).user("alice").body("{}");
    let first = token().send().await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    first.assert_fresh();
    assert_eq!(first.body.len(), 64, "{first:?}");
    let retry = token().send().await;
    assert_rejection(&retry, profile, Kind::NotReplayable { original: 201 });
    assert!(
        retry.replayed(),
        "the recorded refusal is replayed: {retry:?}"
    );
    let again = token().send().await;
    assert_eq!(again.body, retry.body, "every retry gets the same answer");
    assert_eq!(api.stats().await.tokens_executed, 1);

    // Redis goes away: nothing is executed, and the client is told when to try again.
    redis.stop();
    for _ in 0..2 {
        let reply = api.pay(&fresh_key(), "alice", &charge(100)).await;
        assert_rejection(&reply, profile, Kind::StoreUnavailable);
    }
    assert_eq!(api.stats().await.payments_executed, 0);
    // A webhook delivery, keyed by its body, is refused the same way: its sender retries.
    let event = json!({ "id": format!("evt_{}", fresh_key()), "type": "x" });
    let reply = api.post("/v1/webhooks").json(&event).send().await;
    assert_rejection(&reply, profile, Kind::StoreUnavailable);
    assert_eq!(api.stats().await.webhooks_executed, 0);
}

/// A `POST /v1/payments` whose `Content-Length` says 100 bytes, followed by 10.
fn truncated_body(key: &str) -> Vec<u8> {
    format!(
        "POST /v1/payments HTTP/1.1\r\nhost: 127.0.0.1\r\nidempotency-key: {key}\r\n\
         authorization: Bearer alice\r\ncontent-type: application/json\r\n\
         content-length: 100\r\n\r\n{{\"amount\":"
    )
    .into_bytes()
}

/// A chunked `POST /v1/payments` whose second chunk size is not hexadecimal.
fn malformed_chunk(key: &str) -> Vec<u8> {
    format!(
        "POST /v1/payments HTTP/1.1\r\nhost: 127.0.0.1\r\nidempotency-key: {key}\r\n\
         authorization: Bearer alice\r\ncontent-type: application/json\r\n\
         transfer-encoding: chunked\r\nconnection: close\r\n\r\n\
         a\r\n{{\"amount\":\r\nzz\r\n"
    )
    .into_bytes()
}

// ---------------------------------------------------------------------------------------
// In process: a renderer of the application's own.
// ---------------------------------------------------------------------------------------

/// The Stripe-style envelope of `RenderRejection`'s documentation, copied:
/// `{"error":{"type":..,"code":..,"message":..}}`. It sets no `Retry-After`.
fn stripe_style(rejection: &Rejection) -> Response<Bytes> {
    let kind = match rejection.kind() {
        RejectionKind::StoreUnavailable => "api_error",
        RejectionKind::InProgress | RejectionKind::ReusedWithDifferentParams => "idempotency_error",
        _ => "invalid_request_error",
    };
    let body = serde_json::json!({ "error": {
        "type": kind,
        "code": rejection.code(),
        "message": rejection.detail(),
    }});
    Response::builder()
        .status(rejection.status())
        .header(header::CONTENT_TYPE, "application/json")
        .body(Bytes::from(body.to_string()))
        .unwrap()
}

/// Checks a rejection the Stripe-style renderer rendered: the kind's status, the envelope
/// member by member, and `Retry-After` (added by the layer) exactly where it belongs.
fn assert_stripe(answer: &Answer, kind: Kind) {
    assert_eq!(
        answer.status.as_u16(),
        kind.status().as_u16(),
        "{kind:?}: {answer:?}"
    );
    let header = |name: &str| {
        answer
            .headers
            .get(name)
            .map(|value| value.to_str().expect("an ASCII header value"))
    };
    assert_eq!(
        header("content-type"),
        Some("application/json"),
        "{answer:?}"
    );
    let retry_after = kind.retry_after().map(|secs| secs.to_string());
    assert_eq!(
        header("retry-after"),
        retry_after.as_deref(),
        "{kind:?}: {answer:?}"
    );
    let body = answer.json();
    assert_eq!(members(&body), BTreeSet::from(["error"]), "{answer:?}");
    let error = &body["error"];
    assert_eq!(
        members(error),
        BTreeSet::from(["type", "code", "message"]),
        "{answer:?}"
    );
    let error_type = match kind {
        Kind::StoreUnavailable => "api_error",
        Kind::InProgress { .. } | Kind::Reused => "idempotency_error",
        _ => "invalid_request_error",
    };
    assert_eq!(error["type"], error_type, "{answer:?}");
    assert_eq!(error["code"], kind.code(), "{answer:?}");
    kind.check_detail(&error["message"], answer);
}

/// The `Retry-After` of an answer, in whole seconds.
fn retry_after_of(answer: &Answer) -> u64 {
    answer
        .headers
        .get("retry-after")
        .unwrap_or_else(|| panic!("no Retry-After: {answer:?}"))
        .to_str()
        .expect("an ASCII Retry-After")
        .parse()
        .unwrap_or_else(|_| panic!("Retry-After is not whole seconds: {answer:?}"))
}

/// A body whose second chunk fails.
fn failing_body() -> Body {
    let chunks = [
        Ok(Bytes::from_static(b"amount=")),
        Err(io::Error::other("the client went away")),
    ];
    Body::from_stream(futures_util::stream::iter(chunks))
}

#[tokio::test]
async fn a_stripe_style_renderer_renders_every_rejection_it_is_given() {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let handler = Handler::default();
    let layer = IdempotencyLayer::from_shared(store)
        .allow_anonymous()
        .required()
        .max_request_body(64)
        .render_rejections(stripe_style);
    let app = app::router(&handler, layer);

    let answer = app::send(&app, app::post("/pay").body("amount=1")).await;
    assert_stripe(&answer, Kind::KeyRequired);
    let answer = app::send(&app, app::post("/pay").key(&"k".repeat(256))).await;
    assert_stripe(&answer, Kind::InvalidKey);
    let answer = app::send(&app, app::post("/pay").key("body").body(failing_body())).await;
    assert_stripe(&answer, Kind::InvalidBody);
    let answer = app::send(&app, app::post("/pay").key("big").body("x".repeat(65))).await;
    assert_stripe(&answer, Kind::BodyTooLarge { limit: 64 });
    assert_eq!(handler.executions(), 0);

    app::send(&app, app::post("/pay").key("reused").body("amount=1"))
        .await
        .assert_executed();
    let answer = app::send(&app, app::post("/pay").key("reused").body("amount=2")).await;
    assert_stripe(&answer, Kind::Reused);

    // The renderer sets no Retry-After: the layer adds it.
    let running = tokio::spawn({
        let app = app.clone();
        async move { app::send(&app, app::post_waiting("busy").body("amount=1")).await }
    });
    app::until_executing(&handler, 2).await;
    let answer = app::send(&app, app::post("/pay").key("busy").body("amount=1")).await;
    let retry_after = retry_after_of(&answer);
    assert!(
        (1..=LEASE_SECS).contains(&retry_after),
        "retry_after {retry_after}: {answer:?}"
    );
    assert_stripe(&answer, Kind::InProgress { retry_after });
    handler.gate.add_permits(1);
    running.await.unwrap().assert_executed();
    assert_eq!(handler.executions(), 2);
}

#[tokio::test]
async fn a_renderers_own_retry_after_is_kept() {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let handler = Handler::default();
    let own_wait = |rejection: &Rejection| {
        let mut response = stripe_style(rejection);
        response
            .headers_mut()
            .insert(header::RETRY_AFTER, http::HeaderValue::from_static("7"));
        response
    };
    let layer = IdempotencyLayer::from_shared(store)
        .allow_anonymous()
        .render_rejections(own_wait);
    let app = app::router(&handler, layer);
    let running = tokio::spawn({
        let app = app.clone();
        async move { app::send(&app, app::post_waiting("busy")).await }
    });
    app::until_executing(&handler, 1).await;
    let answer = app::send(&app, app::post("/pay").key("busy")).await;
    assert_eq!(answer.status.as_u16(), 409, "{answer:?}");
    assert_eq!(retry_after_of(&answer), 7, "the renderer's own: {answer:?}");
    assert_eq!(answer.headers.get_all("retry-after").iter().count(), 1);
    handler.gate.add_permits(1);
    running.await.unwrap().assert_executed();
}

/// The store is a real Redis, stopped: the renderer renders the outage, and the layer adds
/// the `Retry-After` the renderer does not set.
#[tokio::test]
#[ignore = "needs redis-server: scripts/test.sh"]
async fn a_stripe_style_renderer_renders_an_unreachable_store() {
    let mut redis = RedisServer::start();
    let store: Arc<dyn Store> = Arc::new(RedisStore::open(&redis.url()).await.unwrap());
    let handler = Handler::default();
    let layer = IdempotencyLayer::from_shared(store)
        .allow_anonymous()
        .render_rejections(stripe_style);
    let app = app::router(&handler, layer);
    app::send(&app, app::post("/pay").key("warm"))
        .await
        .assert_executed();
    redis.stop();
    for key in ["down1", "down2"] {
        let answer = app::send(&app, app::post("/pay").key(key)).await;
        assert_stripe(&answer, Kind::StoreUnavailable);
    }
    assert_eq!(handler.executions(), 1);
}

/// A response too large to keep is recorded as its rejection, rendered once, when it is
/// recorded: every retry gets those bytes, and the renderer is not called again.
#[tokio::test]
async fn a_response_too_large_is_rendered_when_recorded_and_replayed() {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let handler = Handler::default();
    let renders = Arc::new(AtomicUsize::new(0));
    let counted = {
        let renders = renders.clone();
        move |rejection: &Rejection| {
            renders.fetch_add(1, Ordering::SeqCst);
            stripe_style(rejection)
        }
    };
    let layer = IdempotencyLayer::from_shared(store)
        .allow_anonymous()
        .max_response_body(16)
        .render_rejections(counted);
    let app = app::router(&handler, layer);
    let large = || app::post("/pay").key("large").header("x-body-len", "64");

    let first = app::send(&app, large()).await;
    first.assert_executed();
    assert_eq!(
        first.body,
        vec![b'x'; 64],
        "the client gets the whole response"
    );
    assert_eq!(
        renders.load(Ordering::SeqCst),
        1,
        "rendered when it was recorded"
    );

    let retry = app::send(&app, large()).await;
    assert_stripe(&retry, Kind::NotReplayable { original: 201 });
    assert!(retry.replayed(), "{retry:?}");
    let again = app::send(&app, large()).await;
    assert_eq!(again.status, retry.status);
    assert_eq!(again.body, retry.body);
    assert_eq!(
        renders.load(Ordering::SeqCst),
        1,
        "retries replay the recorded rendering"
    );
    assert_eq!(handler.executions(), 1);
}

// ---------------------------------------------------------------------------------------
// gRPC: statuses, whatever the HTTP profile.
// ---------------------------------------------------------------------------------------

/// The `grpc_payments` example as a process of its own; killed when dropped.
struct GrpcExample(Child);

impl Drop for GrpcExample {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts the `grpc_payments` example on the in-memory store with `env`; returns it and a
/// channel to it.
async fn start_grpc_example(env: &[(&str, &str)]) -> (GrpcExample, Channel) {
    let binary = support::payments::build_example("grpc_payments");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .expect("free port")
        .port();
    let child = Command::new(binary)
        .env("GRPC_ADDR", format!("127.0.0.1:{port}"))
        .env_remove("REDIS_URL")
        .env_remove("REDIS_CLUSTER_URLS")
        .env_remove("REDIS_SENTINEL_URLS")
        .env_remove("REDIS_SENTINEL_MASTER")
        .env_remove("DATABASE_URL")
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start the grpc_payments example");
    let example = GrpcExample(child);
    let channel = support::payments::eventually("grpc_payments to answer", async || {
        Channel::from_shared(format!("http://127.0.0.1:{port}"))
            .unwrap()
            .connect()
            .await
            .ok()
    })
    .await;
    (example, channel)
}

fn grpc_request(amount: i64, delay_ms: i64) -> ChargeRequest {
    ChargeRequest {
        amount,
        currency: "usd".to_owned(),
        simulate: if delay_ms > 0 { "slow" } else { "" }.to_owned(),
        delay_ms,
    }
}

/// A gRPC status of the layer's: `code`, a message starting with the error code, and the
/// response a gRPC one (never problem details).
fn assert_grpc_rejection(status: &Status, code: Code, kind: Kind) {
    assert_eq!(status.code(), code, "{kind:?}: {status:?}");
    assert!(
        status.message().starts_with(kind.code()),
        "{kind:?}: {status:?}"
    );
    // A trailers-only gRPC response: its headers are the status's metadata.
    let metadata = status.metadata();
    let content_type = metadata
        .get("content-type")
        .map(|value| value.to_str().unwrap());
    assert_eq!(content_type, Some("application/grpc"), "{status:?}");
    assert!(metadata.get("link").is_none(), "{status:?}");
    assert!(metadata.get("content-language").is_none(), "{status:?}");
    let retry_after = metadata
        .get("retry-after")
        .map(|value| value.to_str().expect("an ASCII retry-after"));
    let expected = kind.retry_after().map(|secs| secs.to_string());
    assert_eq!(retry_after, expected.as_deref(), "{kind:?}: {status:?}");
    if let Kind::InProgress { retry_after } = kind {
        assert_eq!(
            status.message(),
            format!("request_in_progress: retry after {retry_after} s"),
            "{status:?}"
        );
    }
}

#[tokio::test]
async fn grpc_requests_get_grpc_statuses_in_the_ietf_profile() {
    let (_example, channel) = start_grpc_example(&[("IDEMPOTENCY_PROFILE", "ietf")]).await;

    let missing = grpc::charge(&channel, None, grpc_request(1, 0))
        .await
        .unwrap_err();
    assert_grpc_rejection(&missing, Code::InvalidArgument, Kind::KeyRequired);

    // Two identical slow charges at once: one runs, the other is told to come back (which
    // one depends on which claims first).
    let key = fresh_key();
    let slow = || {
        let (channel, key) = (channel.clone(), key.clone());
        tokio::spawn(
            async move { grpc::charge(&channel, Some(&key), grpc_request(700, 3000)).await },
        )
    };
    let (a, b) = (slow(), slow());
    let (a, b) = (a.await.unwrap(), b.await.unwrap());
    let (done, busy) = match (a, b) {
        (Ok(done), Err(busy)) | (Err(busy), Ok(done)) => (done, busy),
        (a, b) => panic!("expected one charge and one refusal: {a:?}, {b:?}"),
    };
    assert_eq!(done.get_ref().amount, 700);
    let retry_after: u64 = busy
        .metadata()
        .get("retry-after")
        .unwrap_or_else(|| panic!("no retry-after: {busy:?}"))
        .to_str()
        .expect("an ASCII retry-after")
        .parse()
        .unwrap_or_else(|_| panic!("retry-after is not whole seconds: {busy:?}"));
    assert!(
        (1..=MAX_SLOW_WAIT).contains(&retry_after),
        "retry-after {retry_after}: {busy:?}"
    );
    assert_grpc_rejection(&busy, Code::Aborted, Kind::InProgress { retry_after });

    let reused = grpc::charge(&channel, Some(&key), grpc_request(800, 3000))
        .await
        .unwrap_err();
    assert_grpc_rejection(&reused, Code::FailedPrecondition, Kind::Reused);
    assert_eq!(grpc::charges_executed(&channel).await, 1);
}
