//! The `payments` example's contract (DESIGN.md, "The `payments` example server"), checked
//! over real HTTP: every case runs against the in-memory store, Redis and PostgreSQL, and
//! two tests run the compiled example binary itself.

#[path = "../examples/payments/app.rs"]
#[allow(dead_code)] // The tests serve its router; its `main` uses the rest.
mod app;
#[macro_use]
mod support;

use std::{sync::Arc, time::Duration};

use reqwest::{
    header::{HeaderValue, CONTENT_TYPE},
    StatusCode,
};
use serde_json::json;
use support::payments::{
    assert_id, charge, eventually, fresh_key, header, raw_header, raw_payment, slow_charge, Api,
    ExampleProcess, Stats,
};
use support::raw_http;
use tokio::{
    io::AsyncWriteExt,
    net::{TcpListener, TcpStream},
    task::JoinHandle,
};
use tower_idempotency::Store;

/// The example's default in-progress lease.
const DEFAULT_LEASE_SECS: u64 = 30;
/// The default `max_request_body`.
const MAX_REQUEST_BODY: usize = 1024 * 1024;

// ---------------------------------------------------------------------------------------
// The matrix: one `#[tokio::test]` per (case, store).
// ---------------------------------------------------------------------------------------

for_each_store!(
    payment_is_created_once_and_replayed,
    form_payment_is_created_once_and_replayed,
    quoted_key_names_the_bare_key,
    key_is_required_on_payments_and_tokens,
    key_is_optional_on_refunds,
    reused_key_with_different_body_conflicts,
    declined_payment_is_replayed,
    failed_payment_is_released,
    concurrent_retry_is_told_to_wait_then_replayed,
    principals_do_not_share_keys,
    token_bytes_are_replayed,
    invalid_keys_are_rejected_without_execution,
    oversized_body_claims_nothing,
    client_disconnect_does_not_cancel_the_payment,
);

// ---------------------------------------------------------------------------------------
// The cases.
// ---------------------------------------------------------------------------------------

async fn payment_is_created_once_and_replayed(store: Arc<dyn Store>) {
    let (api, _server) = serve(store).await;
    let key = fresh_key();

    let first = api.pay(&key, "alice", &charge(1999)).await;
    first.assert_fresh();
    first.assert_payment(1999, "usd");

    let retry = api.pay(&key, "alice", &charge(1999)).await;
    retry.assert_replay_of(&first);
    assert_eq!(api.stats().await.payments_executed, 1);
}

async fn form_payment_is_created_once_and_replayed(store: Arc<dyn Store>) {
    let (api, _server) = serve(store).await;
    let key = fresh_key();
    let pay = |body| api.post("/v1/payments").key(&key).user("alice").form(body);

    let first = pay("amount=1999&currency=usd").send().await;
    first.assert_fresh();
    first.assert_payment(1999, "usd");
    let retry = pay("amount=1999&currency=usd").send().await;
    retry.assert_replay_of(&first);
    let changed = pay("amount=2000&currency=usd").send().await;
    changed.assert_error(
        StatusCode::CONFLICT,
        "idempotency_key_reused_with_different_params",
    );

    // The optional fields, as form values, each under a key of its own.
    let once = |body| {
        let post = api.post("/v1/payments").key(&fresh_key()).user("alice");
        post.form(body).send()
    };
    let declined = once("amount=5&currency=eur&simulate=decline").await;
    declined.assert_error(StatusCode::PAYMENT_REQUIRED, "card_declined");
    let slow = once("amount=700&currency=usd&simulate=slow&delay_ms=1").await;
    slow.assert_payment(700, "usd");
    let malformed = once("amount=lots&currency=usd").await;
    assert!(malformed.status.is_client_error(), "{malformed:?}");
    assert_eq!(api.stats().await.payments_executed, 3);
}

async fn quoted_key_names_the_bare_key(store: Arc<dyn Store>) {
    let (api, _server) = serve(store).await;
    let key = fresh_key();

    let bare = api.pay(&key, "alice", &charge(500)).await;
    bare.assert_payment(500, "usd");
    let quoted = api.pay(&format!("\"{key}\""), "alice", &charge(500)).await;
    quoted.assert_replay_of(&bare);

    // Inside quotes a space is part of the key.
    let spaced = "\"order 42\"";
    let first = api.pay(spaced, "alice", &charge(501)).await;
    first.assert_payment(501, "usd");
    api.pay(spaced, "alice", &charge(501))
        .await
        .assert_replay_of(&first);
    assert_eq!(api.stats().await.payments_executed, 2);
}

async fn key_is_required_on_payments_and_tokens(store: Arc<dyn Store>) {
    let (api, _server) = serve(store).await;
    for path in ["/v1/payments", "/v1/tokens"] {
        api.post(path)
            .user("alice")
            .json(&charge(100))
            .send()
            .await
            .assert_error(StatusCode::BAD_REQUEST, "idempotency_key_required");
    }
    assert_eq!(api.stats().await, Stats::default());
}

async fn key_is_optional_on_refunds(store: Arc<dyn Store>) {
    let (api, _server) = serve(store).await;
    let refund = || api.post("/v1/refunds").user("alice").json(&charge(250));

    // Without a key every request executes.
    let one = refund().send().await;
    let two = refund().send().await;
    let ids = [one.assert_refund(250), two.assert_refund(250)];
    assert_ne!(ids[0], ids[1], "two keyless refunds got one id");
    assert_eq!(api.stats().await.refunds_executed, 2);

    // With a key the retry is a replay.
    let key = fresh_key();
    let first = refund().key(&key).send().await;
    first.assert_fresh();
    first.assert_refund(250);
    refund().key(&key).send().await.assert_replay_of(&first);
    assert_eq!(api.stats().await.refunds_executed, 3);
}

async fn reused_key_with_different_body_conflicts(store: Arc<dyn Store>) {
    let (api, _server) = serve(store).await;
    let key = fresh_key();

    let first = api.pay(&key, "alice", &charge(1000)).await;
    first.assert_payment(1000, "usd");
    api.pay(&key, "alice", &charge(2000)).await.assert_error(
        StatusCode::CONFLICT,
        "idempotency_key_reused_with_different_params",
    );
    assert_eq!(api.stats().await.payments_executed, 1);

    // The conflict did not touch the record.
    api.pay(&key, "alice", &charge(1000))
        .await
        .assert_replay_of(&first);
}

async fn declined_payment_is_replayed(store: Arc<dyn Store>) {
    let (api, _server) = serve(store).await;
    let key = fresh_key();
    let declined = json!({ "amount": 4200, "currency": "eur", "simulate": "decline" });

    let first = api.pay(&key, "alice", &declined).await;
    first.assert_fresh();
    let body = first.assert_error(StatusCode::PAYMENT_REQUIRED, "card_declined");
    assert_id(&body["id"], "pay_");

    api.pay(&key, "alice", &declined)
        .await
        .assert_replay_of(&first);
    assert_eq!(api.stats().await.payments_executed, 1);
}

async fn failed_payment_is_released(store: Arc<dyn Store>) {
    let (api, _server) = serve(store).await;
    let key = fresh_key();
    let failing = json!({ "amount": 4200, "currency": "eur", "simulate": "error" });

    for executions in 1..=2 {
        let reply = api.pay(&key, "alice", &failing).await;
        assert_eq!(reply.status, StatusCode::INTERNAL_SERVER_ERROR, "{reply:?}");
        reply.assert_fresh();
        assert_eq!(api.stats().await.payments_executed, executions);
    }
}

async fn concurrent_retry_is_told_to_wait_then_replayed(store: Arc<dyn Store>) {
    let (api, _server) = serve(store).await;
    let key = fresh_key();
    let slow = slow_charge(1500);

    let first = api.pay_in_background(&key, "alice", &slow);
    // The handler counts itself on entry: from here on the first request holds the key.
    api.wait_for_payments(1).await;

    let retry_after = api.pay(&key, "alice", &slow).await.assert_in_progress();
    assert!(
        retry_after <= DEFAULT_LEASE_SECS,
        "retry_after {retry_after} is longer than the lease"
    );
    // A different body is a mismatch even while the first runs: retrying cannot fix it.
    api.pay(&key, "alice", &charge(1)).await.assert_error(
        StatusCode::CONFLICT,
        "idempotency_key_reused_with_different_params",
    );

    let first = first.await.expect("the first request");
    first.assert_fresh();
    first.assert_payment(700, "usd");
    api.pay(&key, "alice", &slow).await.assert_replay_of(&first);
    assert_eq!(api.stats().await.payments_executed, 1);
}

async fn principals_do_not_share_keys(store: Arc<dyn Store>) {
    let (api, _server) = serve(store).await;
    let key = fresh_key();

    let alice = api.pay(&key, "alice", &charge(300)).await;
    let bob = api.pay(&key, "bob", &charge(300)).await;
    bob.assert_fresh();
    let (alice_id, bob_id) = (
        alice.assert_payment(300, "usd"),
        bob.assert_payment(300, "usd"),
    );
    assert_ne!(alice_id, bob_id, "alice and bob share a payment");
    assert_eq!(api.stats().await.payments_executed, 2);

    // Each keeps their own record.
    api.pay(&key, "alice", &charge(300))
        .await
        .assert_replay_of(&alice);
    api.pay(&key, "bob", &charge(300))
        .await
        .assert_replay_of(&bob);
    assert_eq!(api.stats().await.payments_executed, 2);

    // The scheme is case-insensitive: `bearer alice` is alice, `bearer mallory` is not.
    let as_sent = |authorization: &str| {
        let post = api
            .post("/v1/payments")
            .key(&key)
            .authorization(authorization);
        post.json(&charge(300)).send()
    };
    as_sent("bearer alice").await.assert_replay_of(&alice);
    let mallory = as_sent("BEARER mallory").await;
    mallory.assert_fresh();
    assert_ne!(mallory.assert_payment(300, "usd"), alice_id);
    // Another scheme's credentials are each their own principal, never the anonymous one.
    let basic = as_sent("Basic YWxpY2U6cHc=").await;
    basic.assert_fresh();
    as_sent("Basic Ym9iOnB3").await.assert_fresh();
    as_sent("Basic YWxpY2U6cHc=").await.assert_replay_of(&basic);
    assert_eq!(api.stats().await.payments_executed, 5);
}

async fn token_bytes_are_replayed(store: Arc<dyn Store>) {
    let (api, _server) = serve(store).await;
    let key = fresh_key();
    let token = || {
        api.post("/v1/tokens")
            .key(&key)
            .user("alice")
            .body("any body")
    };

    let first = token().send().await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    assert_eq!(
        first.header(CONTENT_TYPE.as_str()),
        Some("application/octet-stream")
    );
    assert_eq!(first.body.len(), 64, "{first:?}");
    first.assert_fresh();

    token().send().await.assert_replay_of(&first);
    assert_eq!(api.stats().await.tokens_executed, 1);
}

async fn invalid_keys_are_rejected_without_execution(store: Arc<dyn Store>) {
    let (api, _server) = serve(store).await;
    let repeated = fresh_key();
    let cases: [(&str, Vec<HeaderValue>); 9] = [
        ("empty", vec![HeaderValue::from_static("")]),
        ("256 characters", vec![header(&"k".repeat(256))]),
        (
            "256 quoted",
            vec![header(&format!("\"{}\"", "k".repeat(256)))],
        ),
        ("non-ASCII", vec![raw_header(b"caf\xc3\xa9")]),
        ("control character", vec![header("a\tb")]),
        ("bare space", vec![header("a b")]),
        ("unterminated quote", vec![header("\"abc")]),
        ("stray quote", vec![header("abc\"")]),
        ("two headers", vec![header(&repeated), header(&repeated)]),
    ];
    for path in ["/v1/payments", "/v1/refunds"] {
        for (what, keys) in &cases {
            let mut request = api.post(path).user("alice").json(&charge(100));
            for key in keys {
                request = request.raw_key(key.clone());
            }
            let reply = request.send().await;
            assert_eq!(
                reply.status,
                StatusCode::BAD_REQUEST,
                "{path}, {what}: {reply:?}"
            );
            reply.assert_error(StatusCode::BAD_REQUEST, "invalid_idempotency_key");
        }
    }
    assert_eq!(api.stats().await, Stats::default());

    // The repeated key was not claimed, and the longest valid key is accepted.
    for key in [repeated, "k".repeat(255)] {
        let reply = api.pay(&key, "alice", &charge(100)).await;
        reply.assert_fresh();
        reply.assert_payment(100, "usd");
    }
}

async fn oversized_body_claims_nothing(store: Arc<dyn Store>) {
    let (api, _server) = serve(store).await;
    let key = fresh_key();

    // Only the head: the body it declares would be left unread (see `oversized_head`).
    let head = raw_http::oversized_head(&key, MAX_REQUEST_BODY as u64);
    let reply = raw_http::exchange(api.addr(), &head, false).await;
    let body = reply.assert_error(StatusCode::PAYLOAD_TOO_LARGE, "request_body_too_large");
    assert_eq!(body["limit"], MAX_REQUEST_BODY, "{reply:?}");
    assert_eq!(api.stats().await.payments_executed, 0);

    let small = api.pay(&key, "alice", &charge(100)).await;
    small.assert_fresh();
    small.assert_payment(100, "usd");
    assert_eq!(api.stats().await.payments_executed, 1);
}

async fn client_disconnect_does_not_cancel_the_payment(store: Arc<dyn Store>) {
    let (api, _server) = serve(store).await;
    let key = fresh_key();
    let slow = slow_charge(800);

    let mut socket = TcpStream::connect(api.addr()).await.expect("connect");
    socket
        .write_all(&raw_payment(&key, "alice", &slow))
        .await
        .expect("send the payment");
    tokio::time::sleep(Duration::from_millis(100)).await;
    drop(socket);

    api.wait_for_payments(1).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    // The handler may still be sleeping: retry as a client would until it is not in progress.
    let retry = eventually("the abandoned payment to be recorded", async || {
        let reply = api.pay(&key, "alice", &slow).await;
        (reply.error_code().as_deref() != Some("request_in_progress")).then_some(reply)
    })
    .await;
    assert!(retry.replayed(), "the retry executed again: {retry:?}");
    retry.assert_payment(700, "usd");
    assert_eq!(api.stats().await.payments_executed, 1);
}

// ---------------------------------------------------------------------------------------
// The compiled example binary (memory store).
// ---------------------------------------------------------------------------------------

#[tokio::test]
async fn example_binary_serves_and_replays() {
    let server = ExampleProcess::start(&[]).await;
    let api = server.api();
    let key = fresh_key();

    let first = api.pay(&key, "alice", &charge(1234)).await;
    first.assert_fresh();
    first.assert_payment(1234, "usd");
    api.pay(&key, "alice", &charge(1234))
        .await
        .assert_replay_of(&first);
    assert_eq!(api.stats().await.payments_executed, 1);
}

/// The example reads a plain `application/json` charge itself and hands every other type to
/// axum's `Json` or `Form`: each body is answered as axum's `Json` answers it, whichever way
/// it was read.
#[tokio::test]
async fn charge_bodies_are_read_as_axum_json_reads_them() {
    let (api, _server) = serve(Arc::new(tower_idempotency::MemoryStore::new())).await;
    let send = |content_type: &str, body| {
        let post = api.post("/v1/payments").key(&fresh_key()).user("alice");
        post.typed(content_type, body).send()
    };
    let charge = r#"{"amount": 1999, "currency": "usd"}"#;
    for plain in [
        "application/json",
        "Application/JSON",
        "application/json; charset=utf-8",
    ] {
        send(plain, charge).await.assert_payment(1999, "usd");
    }
    // Read by axum's own extractor.
    send("application/merchant+json", charge)
        .await
        .assert_payment(1999, "usd");
    for refused in ["text/plain", "application/jsonx"] {
        let reply = send(refused, charge).await;
        assert_eq!(
            reply.status,
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "{refused}"
        );
    }
    // Bad bodies: the same answer read either way, byte for byte.
    for (body, status) in [
        (r#"{"amount": 1999, "#, StatusCode::BAD_REQUEST),
        (
            r#"{"amount": "lots", "currency": "usd"}"#,
            StatusCode::UNPROCESSABLE_ENTITY,
        ),
        (r#"{"currency": "usd"}"#, StatusCode::UNPROCESSABLE_ENTITY),
    ] {
        let ours = send("application/json", body).await;
        let axums = send("application/merchant+json", body).await;
        assert_eq!(ours.status, status, "{body}: {ours:?}");
        assert_eq!(
            (ours.status, &ours.body),
            (axums.status, &axums.body),
            "{body}"
        );
    }
    assert_eq!(api.stats().await.payments_executed, 4);
}

/// `PAYMENTS_STATS=payments` serves load harnesses that read one number from the stats.
#[tokio::test]
async fn example_binary_can_report_the_payments_counter_alone() {
    let server = ExampleProcess::start(&[("PAYMENTS_STATS", "payments")]).await;
    let api = server.api();
    api.pay(&fresh_key(), "alice", &charge(1))
        .await
        .assert_fresh();
    assert_eq!(api.stats_text().await, r#"{"payments_executed":1}"#);
}

#[tokio::test]
async fn example_binary_honours_lease_secs() {
    let server = ExampleProcess::start(&[("IDEMPOTENCY_LEASE_SECS", "2")]).await;
    let api = server.api();
    let key = fresh_key();
    let slow = slow_charge(5000);

    let first = api.pay_in_background(&key, "alice", &slow);
    api.wait_for_payments(1).await;

    let retry_after = api.pay(&key, "alice", &slow).await.assert_in_progress();
    assert!(
        retry_after <= 2,
        "retry_after {retry_after} with a 2 s lease"
    );

    // Past the first lease the handler still holds the key: it renews its lease while it
    // runs, so a retry now is told to wait again (or, on a slow machine, replayed).
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let late = api.pay(&key, "alice", &slow).await;
    if !late.replayed() {
        late.assert_in_progress();
    }
    assert_eq!(api.stats().await.payments_executed, 1);

    let first = first.await.expect("the first request");
    first.assert_payment(700, "usd");
    api.pay(&key, "alice", &slow).await.assert_replay_of(&first);
    assert_eq!(api.stats().await.payments_executed, 1);
}

// ---------------------------------------------------------------------------------------
// Serving the router.
// ---------------------------------------------------------------------------------------

/// The example's router on a loopback port; stops serving when dropped.
struct Server(JoinHandle<()>);

impl Drop for Server {
    fn drop(&mut self) {
        self.0.abort();
    }
}

async fn serve(store: Arc<dyn Store>) -> (Api, Server) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("local address");
    let (router, _stats) = app::router(store, app::Settings::default());
    let task = tokio::spawn(async move { axum::serve(listener, router).await.expect("serve") });
    (Api::new(addr), Server(task))
}

/// Two instances of the example started together (one the other's processor, or two on
/// one ledger) never hand out the same payment id: ids were the start's millisecond and
/// a count, so two started in the same millisecond made the same ids.
#[tokio::test]
async fn two_instances_started_together_never_share_an_id() {
    let instance = || {
        let store: Arc<dyn Store> = Arc::new(tower_idempotency::MemoryStore::new());
        app::router(store, app::Settings::default()).0
    };
    let (one, two) = (instance(), instance());
    let pay = |router: axum::Router| async move {
        let request = axum::http::Request::post("/v1/payments")
            .header("idempotency-key", "k")
            .header("authorization", "Bearer alice")
            .header("content-type", "application/json")
            .body(axum::body::Body::from(charge(100).to_string()))
            .unwrap();
        let response = tower::ServiceExt::oneshot(router, request).await.unwrap();
        let body = http_body_util::BodyExt::collect(response.into_body())
            .await
            .unwrap();
        let payment: serde_json::Value = serde_json::from_slice(&body.to_bytes()).unwrap();
        assert_id(&payment["id"], "pay_")
    };
    assert_ne!(pay(one).await, pay(two).await);
}
