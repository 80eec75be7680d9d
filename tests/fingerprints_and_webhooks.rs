//! Fingerprints by JSON value and keys from the body, over HTTP against the `payments`
//! example process (DESIGN.md, "Fingerprints and webhooks"): retries that re-serialize
//! their JSON replay, and a webhook event delivered many times, one after another and at
//! once, across two instances, is handled once.

#[macro_use]
mod support;

use std::time::Duration;

use reqwest::StatusCode;
use serde_json::{json, Value};
use support::payments::{fresh_key, Api, ExampleProcess, Reply, DEADLINE};
use tokio::time::Instant;

/// One payment sent as `first`, then retried with the same key as each of `same` (each
/// must replay it) and as `different` (which must be a mismatch).
async fn retries_of(api: &Api, first: &str, same: &[&str], different: &str) {
    let key = fresh_key();
    let pay = |body: &str| {
        api.post("/v1/payments")
            .key(&key)
            .user("dana")
            .json_text(body)
            .send()
    };
    let original = pay(first).await;
    original.assert_payment(1000, "usd");
    for body in same {
        pay(body).await.assert_replay_of(&original);
    }
    pay(different).await.assert_error(
        StatusCode::CONFLICT,
        "idempotency_key_reused_with_different_params",
    );
}

#[tokio::test]
async fn a_retry_that_reorders_or_respaces_its_json_replays() {
    let example = ExampleProcess::start(&[("IDEMPOTENCY_FINGERPRINT", "json")]).await;
    let api = example.api();
    retries_of(
        api,
        r#"{"amount":1000,"currency":"usd"}"#,
        &[
            r#"{"currency":"usd","amount":1000}"#,
            "{\n  \"amount\": 1000,\n  \"currency\": \"usd\"\n}",
            r#"{"amount":1000.0,"currency":"\u0075sd"}"#,
        ],
        r#"{"currency":"usd","amount":1001}"#,
    )
    .await;
    assert_eq!(api.stats().await.payments_executed, 1);
}

/// Two 64-bit ids past 2^53 that round to the same double (a card, an account) are two
/// requests, not a retry: JCS's numbers, compared as doubles, matched them, and the second
/// card's payment was answered with the first's replay.
#[tokio::test]
async fn integers_past_two_to_the_53_are_told_apart() {
    let example = ExampleProcess::start(&[("IDEMPOTENCY_FINGERPRINT", "json")]).await;
    let api = example.api();
    retries_of(
        api,
        r#"{"amount":1000,"currency":"usd","card":1234567890123456789}"#,
        &[r#"{"card":1234567890123456789, "currency":"usd","amount":1000}"#],
        r#"{"amount":1000,"currency":"usd","card":1234567890123456790}"#,
    )
    .await;
    assert_eq!(api.stats().await.payments_executed, 1);
}

#[tokio::test]
async fn an_ignored_field_may_change_on_a_retry() {
    let example =
        ExampleProcess::start(&[("IDEMPOTENCY_FINGERPRINT_IGNORE", "/client_ts,/trace_id")]).await;
    let api = example.api();
    retries_of(
        api,
        r#"{"amount":1000,"currency":"usd","client_ts":1,"trace_id":"a"}"#,
        &[
            r#"{"trace_id":"b","client_ts":2,"currency":"usd","amount":1000}"#,
            r#"{"amount":1000,"currency":"usd"}"#,
        ],
        r#"{"amount":2000,"currency":"usd","client_ts":1,"trace_id":"a"}"#,
    )
    .await;
    assert_eq!(api.stats().await.payments_executed, 1);
}

#[tokio::test]
async fn without_the_option_the_bytes_count_as_before() {
    let example = ExampleProcess::start(&[]).await;
    retries_of(
        example.api(),
        r#"{"amount":1000,"currency":"usd"}"#,
        &[r#"{"amount":1000,"currency":"usd"}"#],
        r#"{"currency":"usd","amount":1000}"#,
    )
    .await;
}

#[tokio::test]
async fn a_body_that_is_not_json_is_fingerprinted_raw() {
    let example = ExampleProcess::start(&[("IDEMPOTENCY_FINGERPRINT", "json")]).await;
    let api = example.api();
    let key = fresh_key();
    let pay = |body: &'static str| {
        api.post("/v1/payments")
            .key(&key)
            .user("erin")
            .json_text(body)
            .send()
    };
    // The handler refuses it (a 4xx, recorded): its retry with the same bytes replays, and
    // one spelled otherwise is another request, as raw bytes tell.
    let first = pay(r#"{"amount": 1000,"#).await;
    assert_eq!(first.status, StatusCode::BAD_REQUEST, "{first:?}");
    pay(r#"{"amount": 1000,"#).await.assert_replay_of(&first);
    pay(r#"{"amount":1000,"#).await.assert_error(
        StatusCode::CONFLICT,
        "idempotency_key_reused_with_different_params",
    );
}

/// Delivers `event` to `api` as a sender does: again while told `409` (after the
/// `Retry-After` it was given, in this test's tenths), until it gets an answer.
async fn deliver(api: &Api, event: &Value) -> Reply {
    let deadline = Instant::now() + DEADLINE;
    loop {
        let reply = api.post("/v1/webhooks").json(event).send().await;
        if reply.status != StatusCode::CONFLICT {
            return reply;
        }
        reply.assert_in_progress();
        assert!(Instant::now() < deadline, "still in progress: {reply:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// What every delivery of an event must get: the first answer, `200 {"received": id,
/// "handled_at": ms}`, the same bytes each time.
fn assert_handled(replies: &[Reply], id: &str) {
    let first = replies
        .iter()
        .find(|reply| !reply.replayed())
        .unwrap_or_else(|| panic!("no delivery was handled: {replies:?}"));
    assert_eq!(first.status, StatusCode::OK, "{first:?}");
    let body = first.json();
    assert_eq!(body["received"], id, "{first:?}");
    assert!(body["handled_at"].as_u64().is_some(), "{first:?}");
    for reply in replies {
        assert_eq!(
            (reply.status, &reply.body),
            (first.status, &first.body),
            "{reply:?}"
        );
    }
    let handled = replies.iter().filter(|reply| !reply.replayed()).count();
    assert_eq!(handled, 1, "{replies:?}");
}

fn event(id: &str) -> Value {
    json!({ "id": id, "type": "charge.succeeded", "data": { "object": { "amount": 1000 } } })
}

#[tokio::test]
async fn a_webhook_delivered_twenty_times_is_handled_once() {
    let example = ExampleProcess::start(&[]).await;
    let api = example.api();
    let id = format!("evt_{}", fresh_key());
    let mut replies = Vec::new();
    for _ in 0..20 {
        replies.push(deliver(api, &event(&id)).await);
    }
    assert_handled(&replies, &id);
    assert_eq!(api.stats().await.webhooks_executed, 1);
}

#[tokio::test]
async fn another_event_under_a_handled_id_is_a_mismatch_not_its_replay() {
    let example = ExampleProcess::start(&[]).await;
    let api = example.api();
    let id = format!("evt_{}", fresh_key());
    deliver(api, &event(&id)).await.assert_fresh();
    let other = json!({ "id": id, "type": "charge.refunded" });
    let reply = api.post("/v1/webhooks").json(&other).send().await;
    reply.assert_error(
        StatusCode::CONFLICT,
        "idempotency_key_reused_with_different_params",
    );
    assert_eq!(api.stats().await.webhooks_executed, 1);
}

#[tokio::test]
async fn a_delivery_without_a_string_id_is_refused_with_a_json_error() {
    let example = ExampleProcess::start(&[]).await;
    let api = example.api();
    for (body, code) in [
        (
            json!({ "type": "charge.succeeded" }),
            "idempotency_key_required",
        ),
        (
            json!({ "id": null, "type": "charge.succeeded" }),
            "idempotency_key_required",
        ),
        (
            json!({ "id": 42, "type": "charge.succeeded" }),
            "invalid_idempotency_key",
        ),
        (
            json!({ "id": { "n": 1 }, "type": "x" }),
            "invalid_idempotency_key",
        ),
        (json!({ "id": "", "type": "x" }), "invalid_idempotency_key"),
    ] {
        let reply = api.post("/v1/webhooks").json(&body).send().await;
        reply.assert_error(StatusCode::BAD_REQUEST, code);
    }
    // Which of two ids a consumer would read differs: neither is guessed.
    let twice = api
        .post("/v1/webhooks")
        .json_text(r#"{"id":"evt_B","type":"x","id":"evt_A"}"#)
        .send()
        .await;
    twice.assert_error(StatusCode::BAD_REQUEST, "invalid_idempotency_key");
    let not_json = api.post("/v1/webhooks").json_text("evt_1").send().await;
    not_json.assert_error(StatusCode::BAD_REQUEST, "idempotency_key_required");
    assert_eq!(api.stats().await.webhooks_executed, 0);
}

/// Twenty deliveries of each event, sent at once, half to each of two instances sharing
/// one Redis: each event is handled once, and every delivery ends with its answer.
#[tokio::test]
#[ignore = "needs Redis: scripts/test.sh"]
async fn concurrent_deliveries_across_two_instances_on_redis_are_handled_once() {
    let redis = support::redis_url();
    let a = ExampleProcess::start(&[("REDIS_URL", &redis)]).await;
    let b = a.start_another().await;
    let ids: Vec<String> = (0..5).map(|_| format!("evt_{}", fresh_key())).collect();
    let mut deliveries = Vec::new();
    for id in &ids {
        for n in 0..20 {
            let api = if n % 2 == 0 { a.api() } else { b.api() }.clone();
            let event = event(id);
            deliveries.push(tokio::spawn(async move { deliver(&api, &event).await }));
        }
    }
    let mut replies = Vec::new();
    for delivery in deliveries {
        replies.push(delivery.await.expect("a delivery"));
    }
    for (id, replies) in ids.iter().zip(replies.chunks(20)) {
        assert_handled(replies, id);
    }
    let handled = a.api().stats().await.webhooks_executed + b.api().stats().await.webhooks_executed;
    assert_eq!(handled, ids.len() as u64);
    // And sent again one by one, to either instance, each is answered the same.
    for (id, replies) in ids.iter().zip(replies.chunks(20)) {
        let again = deliver(b.api(), &event(id)).await;
        assert!(again.replayed(), "{again:?}");
        assert_eq!(again.body, replies[0].body);
    }
}

// ---------------------------------------------------------------------------------------
// The layer's options on the test app, in process: on the memory store and on Redis.
// ---------------------------------------------------------------------------------------

mod layer_options {
    use std::sync::Arc;

    use tower_idempotency::{BodyFingerprint, Store};

    use crate::support::app::{
        self, post, send, spawn_send, still_waiting, until_executing, Handler,
    };

    on_memory_and_redis!(
        a_key_found_by_a_function_replays_and_no_key_passes_through,
        a_duplicate_delivery_waits_for_the_original_when_asked,
        a_body_key_needs_a_principal_only_once_a_key_is_found,
        a_custom_fingerprint_decides_what_matches,
        a_body_key_is_looked_for_only_within_the_body_limit,
        a_duplicate_delivery_is_told_to_retry_while_the_first_runs,
        a_refusal_says_where_in_the_body_the_key_was_looked_for,
    );

    async fn a_key_found_by_a_function_replays_and_no_key_passes_through(store: Arc<dyn Store>) {
        let handler = Handler::default();
        let layer = app::layer(&store).key_from_body(|parts, _body| {
            let query = parts.uri.query()?;
            query.strip_prefix("delivery=").map(str::to_owned)
        });
        let app = app::router(&handler, layer);
        let key = crate::fresh_key();
        let first = send(&app, post(&format!("/pay?delivery={key}")).body("a")).await;
        first.assert_executed();
        let again = send(&app, post(&format!("/pay?delivery={key}")).body("a")).await;
        assert!(again.replayed(), "{again:?}");
        assert_eq!(again.body, first.body);
        // The header is not read on such a route: without a key found, it runs each time.
        for _ in 0..2 {
            send(&app, post("/pay").key(&key).body("a"))
                .await
                .assert_executed();
        }
        assert_eq!(handler.executions(), 3);
        let too_long = format!("/pay?delivery={}", "k".repeat(256));
        let invalid = send(&app, post(&too_long).body("a")).await;
        assert_eq!(invalid.status, 400, "{invalid:?}");
        assert_eq!(invalid.error(), "invalid_idempotency_key");
        assert_eq!(handler.executions(), 3);
    }

    async fn a_duplicate_delivery_waits_for_the_original_when_asked(store: Arc<dyn Store>) {
        let handler = Handler::default();
        let layer = app::layer(&store)
            .key_from_json("/id")
            .required()
            .wait_for_original(std::time::Duration::from_secs(10));
        let app = app::router(&handler, layer);
        let event = format!(r#"{{"id":"evt_{}"}}"#, crate::fresh_key());
        let original = spawn_send(&app, post("/pay").header("x-wait", "1").body(event.clone()));
        until_executing(&handler, 1).await;
        let duplicate = spawn_send(&app, post("/pay").header("x-wait", "1").body(event));
        still_waiting(&duplicate).await;
        handler.gate.add_permits(1);
        let original = original.await.unwrap();
        let duplicate = duplicate.await.unwrap();
        original.assert_executed();
        assert!(duplicate.replayed(), "{duplicate:?}");
        assert_eq!(duplicate.body, original.body);
        assert_eq!(handler.executions(), 1);
    }

    async fn a_body_key_needs_a_principal_only_once_a_key_is_found(store: Arc<dyn Store>) {
        let handler = Handler::default();
        // No `allow_anonymous`: keyed requests must name a principal, and these name none.
        let layer = tower_idempotency::IdempotencyLayer::from_shared(store).key_from_json("/id");
        let app = app::router(&handler, layer);
        send(&app, post("/pay").body(r#"{"type":"x"}"#))
            .await
            .assert_executed();
        let keyed = send(&app, post("/pay").body(r#"{"id":"evt_1"}"#)).await;
        assert_eq!(keyed.status, 500, "{keyed:?}");
        assert_eq!(keyed.error(), "idempotency_principal_missing");
        assert_eq!(handler.executions(), 1);
    }

    async fn a_custom_fingerprint_decides_what_matches(store: Arc<dyn Store>) {
        let handler = Handler::default();
        // Only the body's first line counts: the rest is a signature that changes on resend.
        let first_line = BodyFingerprint::custom("first-line", |_, body| {
            body.split(|b| *b == b'\n')
                .next()
                .unwrap_or_default()
                .to_vec()
        });
        let app = app::router(&handler, app::layer(&store).fingerprint(first_line));
        let key = crate::fresh_key();
        let first = send(&app, post("/pay").key(&key).body("amount=5\nsig=1")).await;
        first.assert_executed();
        let resent = send(&app, post("/pay").key(&key).body("amount=5\nsig=2")).await;
        assert!(resent.replayed(), "{resent:?}");
        let changed = send(&app, post("/pay").key(&key).body("amount=6\nsig=1")).await;
        assert_eq!(changed.status, 409, "{changed:?}");
        assert_eq!(
            changed.error(),
            "idempotency_key_reused_with_different_params"
        );
        assert_eq!(handler.executions(), 1);
    }

    async fn a_body_key_is_looked_for_only_within_the_body_limit(store: Arc<dyn Store>) {
        let handler = Handler::default();
        // Not required: a body without a key would pass through, but this one is over the
        // limit, and no key can be looked for in what was not read.
        let layer = app::layer(&store)
            .key_from_json("/id")
            .max_request_body(64)
            .fingerprint(BodyFingerprint::json());
        let app = app::router(&handler, layer);
        let padding = "x".repeat(64);
        for oversized in [
            format!(
                r#"{{"id":"evt_{}","padding":"{padding}"}}"#,
                crate::fresh_key()
            ),
            format!(r#"{{"padding":"{padding}"}}"#),
        ] {
            let refused = send(&app, post("/pay").body(oversized)).await;
            assert_eq!(refused.status, 413, "{refused:?}");
            assert_eq!(refused.error(), "request_body_too_large");
        }
        assert_eq!(handler.executions(), 0);
        send(&app, post("/pay").body(r#"{"small":1}"#))
            .await
            .assert_executed();
    }

    async fn a_duplicate_delivery_is_told_to_retry_while_the_first_runs(store: Arc<dyn Store>) {
        let handler = Handler::default();
        let app = app::router(&handler, app::layer(&store).key_from_json("/id").required());
        let event = format!(r#"{{"id":"evt_{}"}}"#, crate::fresh_key());
        let original = spawn_send(&app, post("/pay").header("x-wait", "1").body(event.clone()));
        until_executing(&handler, 1).await;
        let duplicate = send(&app, post("/pay").body(event.clone())).await;
        assert_eq!(duplicate.status, 409, "{duplicate:?}");
        assert_eq!(duplicate.error(), "request_in_progress");
        assert!(
            duplicate.headers.contains_key("retry-after"),
            "{duplicate:?}"
        );
        handler.gate.add_permits(1);
        let original = original.await.unwrap();
        original.assert_executed();
        let redelivered = send(&app, post("/pay").body(event)).await;
        assert!(redelivered.replayed(), "{redelivered:?}");
        assert_eq!(redelivered.body, original.body);
        assert_eq!(handler.executions(), 1);
    }

    async fn a_refusal_says_where_in_the_body_the_key_was_looked_for(store: Arc<dyn Store>) {
        let handler = Handler::default();
        let detail = |rejection: &tower_idempotency::Rejection| {
            let mut response = http::Response::new(bytes::Bytes::from(rejection.detail()));
            *response.status_mut() = rejection.status();
            response
        };
        let layer = app::layer(&store)
            .key_from_json("/event/id")
            .required()
            .render_rejections(detail);
        let app = app::router(&handler, layer);
        for body in [r#"{"event":{}}"#, r#"{"event":{"id":7}}"#] {
            let refused = send(&app, post("/pay").body(body)).await;
            assert_eq!(refused.status, 400, "{refused:?}");
            let text = String::from_utf8_lossy(&refused.body);
            assert!(text.contains("request body (at /event/id)"), "{text}");
        }
        assert_eq!(handler.executions(), 0);
    }
}
