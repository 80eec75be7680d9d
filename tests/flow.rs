//! The request flow of DESIGN.md, run unchanged against every store.

#[macro_use]
mod support;

use std::{
    sync::{
        atomic::{AtomicU64, AtomicUsize, Ordering},
        Arc,
    },
    time::Duration,
};

use axum::{
    body::Body,
    extract::Request,
    http::{header, request::Parts, HeaderMap, HeaderValue, StatusCode},
    response::Response,
    routing, Router,
};
use bytes::Bytes;
use futures_util::{stream::FuturesUnordered, StreamExt};
use http_body_util::BodyExt;
use tower::ServiceExt;
use tower_http::catch_panic::CatchPanicLayer;
use tower_idempotency::{
    store::Claim, store::Fenced, Fingerprint, IdempotencyKey, IdempotencyLayer, Principal, Scope,
    Store, StoredResponse,
};

use support::{
    app::*,
    wrapped_store::{Hooks, Operation, Wrapped},
};

for_each_store!(
    first_execution_then_byte_exact_replay,
    binary_body_replays_byte_exact,
    quoted_and_bare_keys_name_one_record,
    invalid_keys_are_rejected_before_anything_runs,
    missing_key_on_required_and_optional_routes,
    only_configured_methods_are_handled,
    oversized_request_body_claims_nothing,
    in_progress_conflict_says_when_to_retry,
    concurrent_duplicates_execute_once,
    a_request_dropped_mid_execution_still_records,
    panicking_handler_releases_the_key,
    a_panicking_response_body_releases_the_key,
    server_errors_release_and_client_errors_are_recorded,
    inner_service_error_releases_the_key,
    completed_records_expire_after_their_ttl,
    a_record_is_kept_for_its_ttl_from_its_completion,
    a_duplicate_back_when_told_finds_the_record_under_a_short_ttl,
    lease_is_renewed_while_the_handler_runs,
    lease_is_renewed_while_the_response_body_streams,
    completing_twice_with_one_token_is_harmless,
    scope_parts_never_splice,
    principals_are_isolated_by_default,
    a_keyed_request_without_a_principal_is_refused_unless_the_route_opts_in,
    credential_digests_are_keyed_by_the_layers_secret,
    set_cookie_is_replayed_only_when_chosen,
    principal_extension_from_an_auth_layer,
    one_principal_one_scope_however_named,
    endpoints_scope_keys,
    long_principals_and_paths_are_scoped_by_their_digest,
    matched_path_names_the_endpoint,
    oversized_response_is_streamed_and_never_executed_twice,
    a_response_of_many_headers_runs_once_and_its_retries_get_a_clean_answer,
    the_longest_durations_are_kept,
    hop_by_hop_headers_and_date_are_not_replayed,
    per_route_layers_are_configured_independently,
    plain_service_fn_is_protected,
    trailers_are_passed_on_recorded_and_replayed,
    transient_grpc_statuses_release_and_the_rest_replay,
    fingerprint_headers_are_part_of_the_parameters,
    key_reused_with_other_parameters_conflicts,
    a_claim_answered_after_its_lease_is_not_executed,
    a_claim_answered_late_is_renewed_in_time,
    a_claim_answered_after_its_lease_is_not_executed_failing_open,
    renewals_answered_slowly_keep_the_lease;
    not_transactional:
    a_record_the_store_refuses_for_good_is_refused_to_every_retry,
    a_store_that_refuses_every_record_never_holds_the_request,
    writes_a_store_fails_while_it_renews_are_given_up,
    a_renewal_that_hangs_does_not_hold_back_the_next,
    an_outage_past_half_the_lease_still_records_the_response,
    an_outage_with_one_renewal_through_still_records_the_response,
    an_outage_past_half_the_lease_still_records_a_refusal_to_replay,
    crashed_holder_frees_the_key_after_its_lease,
    stale_holder_cannot_touch_the_new_claim,
);

// ---------------------------------------------------------------------------------------
// Cases.

async fn first_execution_then_byte_exact_replay(store: Arc<dyn Store>) {
    let handler = Handler::default();
    // Every header replayed, the handler's cookies included.
    let app = router(&handler, layer(&store).replay_set_cookie());
    let first = send(&app, post("/pay").key("k1").body("amount=100")).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(!first.replayed());
    for _ in 0..3 {
        let retry = send(&app, post("/pay").key("k1").body("amount=100")).await;
        assert!(retry.replayed());
        assert_eq!(retry.status, first.status);
        assert_eq!(retry.body, first.body);
        let mut headers = retry.headers.clone();
        headers.remove("idempotent-replayed");
        assert_eq!(headers, first.headers);
    }
    assert_eq!(handler.executions(), 1);
}

async fn binary_body_replays_byte_exact(store: Arc<dyn Store>) {
    let handler = Handler::default();
    let app = router(&handler, layer(&store));
    let first = send(&app, post("/pay").key("bin").header("x-binary", "1")).await;
    assert_eq!(first.body.len(), 64);
    assert!(std::str::from_utf8(&first.body).is_err() || first.body.iter().any(|b| *b > 0x7f));
    let retry = send(&app, post("/pay").key("bin").header("x-binary", "1")).await;
    assert!(retry.replayed());
    assert_eq!(retry.body, first.body);
    assert_eq!(handler.executions(), 1);
}

async fn quoted_and_bare_keys_name_one_record(store: Arc<dyn Store>) {
    let handler = Handler::default();
    let app = router(&handler, layer(&store));
    send(&app, post("/pay").key("8e03978e-40d5")).await;
    let quoted = send(&app, post("/pay").key("\"8e03978e-40d5\"")).await;
    assert!(quoted.replayed());
    send(&app, post("/pay").key(r#""a \"quoted\" key""#)).await;
    assert_eq!(handler.executions(), 2);
}

async fn invalid_keys_are_rejected_before_anything_runs(store: Arc<dyn Store>) {
    let handler = Handler::default();
    let app = router(&handler, layer(&store).required());
    let too_long = "k".repeat(256);
    let bad: [&[u8]; 9] = [
        b"",
        b"\"\"",
        too_long.as_bytes(),
        "caf\u{e9}".as_bytes(),
        b"tab\there",
        b"two words",
        b"\"unterminated",
        b"stray\"quote",
        b"\"bad \\escape\"",
    ];
    for value in bad {
        let mut request = post("/pay").build();
        let value = HeaderValue::from_bytes(value).unwrap();
        request
            .headers_mut()
            .insert("idempotency-key", value.clone());
        let answer = read(app.clone().oneshot(request).await.unwrap()).await;
        assert_eq!(answer.status, StatusCode::BAD_REQUEST, "{value:?}");
        assert_eq!(
            answer.json(),
            serde_json::json!({"error": "invalid_idempotency_key"})
        );
    }
    let twice = post("/pay").key("a").key("a");
    let answer = send(&app, twice).await;
    assert_eq!(
        (answer.status, answer.error().as_str()),
        (StatusCode::BAD_REQUEST, "invalid_idempotency_key")
    );
    assert_eq!(handler.executions(), 0);
}

async fn missing_key_on_required_and_optional_routes(store: Arc<dyn Store>) {
    let handler = Handler::default();
    let required = router(&handler, layer(&store).required());
    let answer = send(&required, post("/pay")).await;
    assert_eq!(answer.status, StatusCode::BAD_REQUEST);
    assert_eq!(
        answer.json(),
        serde_json::json!({"error": "idempotency_key_required"})
    );
    assert_eq!(handler.executions(), 0);

    let optional = router(&handler, layer(&store));
    for _ in 0..2 {
        let answer = send(&optional, post("/pay")).await;
        assert_eq!(answer.status, StatusCode::CREATED);
        assert!(!answer.replayed());
    }
    assert_eq!(handler.executions(), 2);
}

async fn only_configured_methods_are_handled(store: Arc<dyn Store>) {
    let handler = Handler::default();
    let default = router(&handler, layer(&store).required());
    for method in ["GET", "PUT"] {
        for _ in 0..2 {
            let answer = send(&default, post("/pay").method(method).key("m")).await;
            assert_eq!(answer.status, StatusCode::CREATED);
            assert!(!answer.replayed());
        }
    }
    assert_eq!(handler.executions(), 4);
    let put = router(&handler, layer(&store).methods([http::Method::PUT]));
    send(&put, post("/pay").method("PUT").key("m")).await;
    assert!(send(&put, post("/pay").method("PUT").key("m"))
        .await
        .replayed());
    assert_eq!(handler.executions(), 5);
}

async fn oversized_request_body_claims_nothing(store: Arc<dyn Store>) {
    let handler = Handler::default();
    let app = router(&handler, layer(&store).max_request_body(16));
    let declared = send(&app, post("/pay").key("big").body("x".repeat(17))).await;
    assert_eq!(declared.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(
        declared.json(),
        serde_json::json!({"error": "request_body_too_large", "limit": 16})
    );
    // Without a Content-Length the limit is enforced while reading.
    let chunks = futures_util::stream::iter(
        ["x".repeat(10), "x".repeat(10)].map(|chunk| Ok::<_, std::io::Error>(Bytes::from(chunk))),
    );
    let streamed = send(
        &app,
        post("/pay").key("big").body(Body::from_stream(chunks)),
    )
    .await;
    assert_eq!(streamed.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(handler.executions(), 0);
    let small = send(&app, post("/pay").key("big").body("x".repeat(16))).await;
    assert_eq!(
        (small.status, small.replayed()),
        (StatusCode::CREATED, false)
    );
}

async fn key_reused_with_other_parameters_conflicts(store: Arc<dyn Store>) {
    let handler = Handler::default();
    let app = router(&handler, layer(&store));
    send(&app, post("/pay").key("r").body("amount=1")).await;
    for other in [
        post("/pay").key("r").body("amount=2"),
        post("/pay?q=1").key("r").body("amount=1"),
    ] {
        let answer = send(&app, other).await;
        assert_eq!(answer.status, StatusCode::CONFLICT);
        assert_eq!(
            answer.json(),
            serde_json::json!({"error": "idempotency_key_reused_with_different_params"})
        );
    }
    // Mismatch is reported first even while the key is in progress: retrying cannot fix it.
    let slow = tokio::spawn({
        let app = app.clone();
        async move {
            send(
                &app,
                post("/pay").key("r2").header("x-sleep-ms", "500").body("a"),
            )
            .await
        }
    });
    until_executing(&handler, 2).await;
    let answer = send(
        &app,
        post("/pay").key("r2").header("x-sleep-ms", "500").body("b"),
    )
    .await;
    assert_eq!(
        answer.error(),
        "idempotency_key_reused_with_different_params"
    );
    assert_eq!(slow.await.unwrap().status, StatusCode::CREATED);
    assert_eq!(handler.executions(), 2);
}

async fn in_progress_conflict_says_when_to_retry(store: Arc<dyn Store>) {
    let handler = Handler::default();
    let app = router(&handler, layer(&store).lease(Duration::from_secs(20)));
    let first = tokio::spawn({
        let app = app.clone();
        async move { send(&app, post("/pay").key("p").header("x-wait", "1")).await }
    });
    until_executing(&handler, 1).await;
    let answer = send(&app, post_waiting("p")).await;
    assert_eq!(answer.error(), "request_in_progress");
    let retry_after = retry_after_header(&answer);
    // Short while the holder has only just started, not the whole lease...
    assert!((1..=2).contains(&retry_after), "{retry_after}");
    assert_eq!(answer.json()["retry_after"], retry_after);
    // ...and as long again as it has been running once it runs for a while.
    tokio::time::sleep(Duration::from_millis(2200)).await;
    let later = send(&app, post_waiting("p")).await;
    let retry_after = retry_after_header(&later);
    assert!((3..=5).contains(&retry_after), "{retry_after}");
    assert_eq!(later.json()["retry_after"], retry_after);
    handler.gate.add_permits(1);
    assert_eq!(first.await.unwrap().status, StatusCode::CREATED);
    assert!(send(&app, post_waiting("p")).await.replayed());
    assert_eq!(handler.executions(), 1);
}

fn retry_after_header(reply: &Answer) -> u64 {
    let value = reply.headers[header::RETRY_AFTER].to_str().unwrap();
    value.parse().unwrap()
}

async fn concurrent_duplicates_execute_once(store: Arc<dyn Store>) {
    let handler = Handler::default();
    let app = router(&handler, layer(&store));
    let mut requests: FuturesUnordered<_> = (0..32)
        .map(|_| {
            let app = app.clone();
            tokio::spawn(async move { send(&app, post_waiting("same").body("amount=1")).await })
        })
        .collect();
    // The one execution holds the key until the other 31 have their answer.
    for _ in 0..31 {
        let answer = requests.next().await.unwrap().unwrap();
        assert_eq!(answer.status, StatusCode::CONFLICT, "{answer:?}");
        assert_eq!(answer.error(), "request_in_progress");
    }
    handler.gate.add_permits(1);
    let executed = requests.next().await.unwrap().unwrap();
    assert_eq!(
        (executed.status, executed.replayed()),
        (StatusCode::CREATED, false)
    );
    assert_eq!(handler.executions(), 1);
}

async fn a_request_dropped_mid_execution_still_records(store: Arc<dyn Store>) {
    let handler = Handler::default();
    let app = router(&handler, layer(&store));
    // The client goes away while its handler runs: the server drops the request's future.
    let gone = tokio::spawn({
        let app = app.clone();
        async move { send(&app, post_waiting("gone")).await }
    });
    until_executing(&handler, 1).await;
    gone.abort();
    assert!(gone.await.unwrap_err().is_cancelled());
    handler.gate.add_permits(1);
    // The execution finishes without its request and records the response for the retry.
    let mut answer = send(&app, post("/pay").key("gone")).await;
    for _ in 0..500 {
        if answer.status != StatusCode::CONFLICT {
            break;
        }
        assert_eq!(answer.error(), "request_in_progress");
        tokio::time::sleep(Duration::from_millis(10)).await;
        answer = send(&app, post("/pay").key("gone")).await;
    }
    assert_eq!(
        (answer.status, answer.replayed()),
        (StatusCode::CREATED, true)
    );
    assert_eq!(handler.executions(), 1);
}

async fn panicking_handler_releases_the_key(store: Arc<dyn Store>) {
    let handler = Handler::default();
    // Without CatchPanicLayer the panic reaches the caller, as it would without the layer.
    let bare = router(&handler, layer(&store));
    let outcome = tokio::spawn({
        let bare = bare.clone();
        async move { send(&bare, post("/pay").key("boom").header("x-panic", "1")).await }
    })
    .await;
    assert!(outcome.unwrap_err().is_panic());
    // Other keys are unaffected, and the panicked key executes again.
    assert_eq!(
        send(&bare, post("/pay").key("calm")).await.status,
        StatusCode::CREATED
    );
    let retry = send(&bare, post("/pay").key("boom")).await;
    assert_eq!(
        (retry.status, retry.replayed()),
        (StatusCode::CREATED, false)
    );

    // CatchPanicLayer outside the idempotency layer turns the panic into a 500.
    let outside = router(&handler, layer(&store)).layer(CatchPanicLayer::new());
    let answer = send(&outside, post("/pay").key("boom2").header("x-panic", "1")).await;
    assert_eq!(answer.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert!(!send(&outside, post("/pay").key("boom2")).await.replayed());

    // Inside it, the 500 releases like any 5xx.
    let inside = Router::new()
        .route("/pay", routing::post(handle).layer(CatchPanicLayer::new()))
        .layer(layer(&store))
        .with_state(handler.clone());
    let answer = send(&inside, post("/pay").key("boom3").header("x-panic", "1")).await;
    assert_eq!(answer.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert!(!send(&inside, post("/pay").key("boom3")).await.replayed());
    assert_eq!(handler.executions(), 7);
}

async fn server_errors_release_and_client_errors_are_recorded(store: Arc<dyn Store>) {
    let handler = Handler::default();
    let app = router(&handler, layer(&store));
    let failed = send(&app, post("/pay").key("e").header("x-status", "503")).await;
    assert_eq!(failed.status, StatusCode::SERVICE_UNAVAILABLE);
    let retry = send(&app, post("/pay").key("e").header("x-status", "503")).await;
    assert!(!retry.replayed());
    assert_eq!(handler.executions(), 2);

    // 408 (a timeout inside gave up) and 429 (a rate limiter inside turned it away): not
    // done, released by default like the 5xx.
    for (key, status) in [("t", "408"), ("r", "429")] {
        let first = send(&app, post("/pay").key(key).header("x-status", status)).await;
        assert_eq!(first.status.as_str(), status);
        let retry = send(&app, post("/pay").key(key)).await;
        assert!(!retry.replayed(), "{status}");
        assert_eq!(retry.status, StatusCode::CREATED, "{status}");
    }
    assert_eq!(handler.executions(), 6);

    let declined = send(&app, post("/pay").key("d").header("x-status", "402")).await;
    let retry = send(&app, post("/pay").key("d").header("x-status", "402")).await;
    assert!(retry.replayed());
    assert_eq!(
        (retry.status, retry.body),
        (StatusCode::PAYMENT_REQUIRED, declined.body)
    );
    assert_eq!(handler.executions(), 7);

    let custom = router(
        &handler,
        layer(&store).release_on(|s| s == StatusCode::TOO_MANY_REQUESTS),
    );
    send(&custom, post("/pay").key("c").header("x-status", "429")).await;
    assert!(
        !send(&custom, post("/pay").key("c").header("x-status", "429"))
            .await
            .replayed()
    );
    send(&custom, post("/pay").key("c5").header("x-status", "500")).await;
    assert!(
        send(&custom, post("/pay").key("c5").header("x-status", "500"))
            .await
            .replayed()
    );
}

async fn inner_service_error_releases_the_key(store: Arc<dyn Store>) {
    let calls = Arc::new(AtomicUsize::new(0));
    let service = tower::service_fn({
        let calls = calls.clone();
        move |_req: Request<http_body_util::Full<Bytes>>| {
            let n = calls.fetch_add(1, Ordering::SeqCst);
            async move {
                if n == 0 {
                    Err("the inner service failed")
                } else {
                    Ok(Response::new(http_body_util::Full::new(Bytes::from("ok"))))
                }
            }
        }
    });
    let service = tower::ServiceBuilder::new()
        .layer(layer(&store))
        .service(service);
    let request = || {
        Request::post("/x")
            .header("idempotency-key", "ie")
            .body(http_body_util::Full::default())
            .unwrap()
    };
    assert_eq!(
        service.clone().oneshot(request()).await.unwrap_err(),
        "the inner service failed"
    );
    let retry = read(service.clone().oneshot(request()).await.unwrap()).await;
    assert_eq!((retry.status, retry.replayed()), (StatusCode::OK, false));
    assert!(read(service.oneshot(request()).await.unwrap())
        .await
        .replayed());
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}

async fn completed_records_expire_after_their_ttl(store: Arc<dyn Store>) {
    let handler = Handler::default();
    let app = router(&handler, layer(&store).ttl(Duration::from_millis(300)));
    send(&app, post("/pay").key("t")).await;
    assert!(send(&app, post("/pay").key("t")).await.replayed());
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!send(&app, post("/pay").key("t")).await.replayed());
    assert_eq!(handler.executions(), 2);
}

/// The TTL counts from the completion, not the claim: a handler that ran longer than the
/// TTL is still replayed to a retry right after it.
async fn a_record_is_kept_for_its_ttl_from_its_completion(store: Arc<dyn Store>) {
    let handler = Handler::default();
    let app = router(&handler, layer(&store).ttl(Duration::from_millis(1000)));
    let slow = || {
        post("/pay")
            .key("ttl-from-end")
            .header("x-sleep-ms", "1500")
    };
    send(&app, slow()).await.assert_executed();
    let retry = send(&app, slow()).await;
    assert!(retry.replayed(), "{retry:?}");
    assert_eq!(handler.executions(), 1);
}

/// A duplicate of a running request that comes back when `Retry-After` says, a little late
/// on the way, finds the record, however short the TTL (two seconds here): the advice never
/// outlasts half of it. Told as long again as the holder had run (3 s), it came back after
/// the record expired and executed again.
async fn a_duplicate_back_when_told_finds_the_record_under_a_short_ttl(store: Arc<dyn Store>) {
    let handler = Handler::default();
    let app = router(&handler, layer(&store).ttl(Duration::from_secs(2)));
    let slow = || post("/pay").key("told").header("x-sleep-ms", "2500");
    let first = tokio::spawn({
        let app = app.clone();
        let original = slow();
        async move { send(&app, original).await }
    });
    tokio::time::sleep(Duration::from_millis(2200)).await;
    let busy = send(&app, slow()).await;
    let told_at = tokio::time::Instant::now();
    assert_eq!(busy.error(), "request_in_progress", "{busy:?}");
    let told = Duration::from_secs(retry_after_header(&busy));
    first.await.unwrap().assert_executed();
    let late = Duration::from_millis(400);
    tokio::time::sleep_until(told_at + told + late).await;
    let retry = send(&app, slow()).await;
    assert!(retry.replayed(), "told {told:?}: {retry:?}");
    assert_eq!(handler.executions(), 1);
}

async fn lease_is_renewed_while_the_handler_runs(store: Arc<dyn Store>) {
    let handler = Handler::default();
    let app = router(&handler, layer(&store).lease(Duration::from_millis(300)));
    let slow = || post("/pay").key("l").header("x-sleep-ms", "1000");
    let first = tokio::spawn({
        let app = app.clone();
        async move { send(&app, post("/pay").key("l").header("x-sleep-ms", "1000")).await }
    });
    // Well past the first lease, and past twice it: still held.
    for (wait, at) in [(500, 500), (300, 800)] {
        tokio::time::sleep(Duration::from_millis(wait)).await;
        let answer = send(&app, slow()).await;
        assert_eq!(answer.error(), "request_in_progress", "at {at} ms");
    }
    assert_eq!(first.await.unwrap().status, StatusCode::CREATED);
    assert!(send(&app, slow()).await.replayed());
    assert_eq!(handler.executions(), 1);
}

/// The body is the handler's work too: one that streams past the lease keeps its key, so
/// a retry meanwhile is told to come back, not executed again.
async fn lease_is_renewed_while_the_response_body_streams(store: Arc<dyn Store>) {
    let handler = Handler::default();
    let app = router(&handler, layer(&store).lease(Duration::from_millis(300)));
    let streamed = || {
        post("/pay")
            .key("streamed")
            .header("x-body-sleep-ms", "1000")
    };
    let first = spawn_send(&app, streamed());
    // Past the first lease, and past twice it, while the body still streams: still held.
    for (wait, at) in [(500, 500), (300, 800)] {
        tokio::time::sleep(Duration::from_millis(wait)).await;
        let answer = send(&app, streamed()).await;
        assert_eq!(answer.error(), "request_in_progress", "at {at} ms");
    }
    let first = first.await.unwrap();
    first.assert_executed();
    assert_eq!(&first.body[..], b"execution 1, part 0;execution 1, part 1;");
    let replay = send(&app, streamed()).await;
    assert!(replay.replayed());
    assert_eq!(replay.body, first.body);
    assert_eq!(handler.executions(), 1);
}

/// A body that panics while the layer reads it gives its key back, as a handler that
/// panics does: the retry executes, rather than waiting out the lease.
async fn a_panicking_response_body_releases_the_key(store: Arc<dyn Store>) {
    let handler = Handler::default();
    let app = router(&handler, layer(&store));
    let panicking = post("/pay").key("body-boom").header("x-body-panic", "1");
    let outcome = spawn_send(&app, panicking).await;
    assert!(outcome.unwrap_err().is_panic());
    send(&app, post("/pay").key("body-boom"))
        .await
        .assert_executed();
    assert_eq!(handler.executions(), 2);
}

/// Not transactional: a transaction holds its key while its connection lives, whatever the
/// lease; a dead holder's connection rolls back at once (`tests/transactional.rs`).
async fn crashed_holder_frees_the_key_after_its_lease(store: Arc<dyn Store>) {
    let handler = Handler::default();
    let app = router(&handler, layer(&store).unscoped());
    // A process claimed the key, then died: nothing renews or releases its claim.
    let request = post("/pay").key("crash").body("b").build();
    let (parts, _) = request.into_parts();
    let fingerprint = Fingerprint::of(&parts, &[], b"b");
    let claim = store
        .claim(&scope("crash"), fingerprint, Duration::from_millis(400))
        .await
        .unwrap();
    assert!(matches!(claim, Claim::Claimed(_)));
    let answer = send(&app, post("/pay").key("crash").body("b")).await;
    assert_eq!(answer.error(), "request_in_progress");
    assert_eq!(handler.executions(), 0);
    tokio::time::sleep(Duration::from_millis(600)).await;
    let answer = send(&app, post("/pay").key("crash").body("b")).await;
    assert_eq!(
        (answer.status, answer.replayed()),
        (StatusCode::CREATED, false)
    );
    assert_eq!(handler.executions(), 1);
}

/// Not transactional: no lease runs out under a transaction, so no holder goes stale.
async fn stale_holder_cannot_touch_the_new_claim(store: Arc<dyn Store>) {
    let scope = scope("stale");
    let fingerprint = Fingerprint::from_bytes([9; 32]);
    let Claim::Claimed(stale) = store
        .claim(&scope, fingerprint, Duration::from_millis(100))
        .await
        .unwrap()
    else {
        panic!("first claim")
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    let Claim::Claimed(fresh) = store
        .claim(&scope, fingerprint, Duration::from_secs(10))
        .await
        .unwrap()
    else {
        panic!("the lease ran out: the key is free")
    };
    let response = StoredResponse {
        status: StatusCode::OK,
        headers: HeaderMap::new(),
        body: Bytes::from_static(b"stale"),
        trailers: None,
    };
    let ttl = Duration::from_secs(60);
    assert_eq!(
        store
            .complete(&scope, stale, fingerprint, &response, ttl)
            .await
            .unwrap(),
        Fenced::Lost
    );
    assert_eq!(store.release(&scope, stale).await.unwrap(), Fenced::Lost);
    assert_eq!(
        store.extend(&scope, stale, ttl).await.unwrap(),
        Fenced::Lost
    );
    assert!(matches!(
        store.claim(&scope, fingerprint, ttl).await.unwrap(),
        Claim::InProgress { .. }
    ));
    assert_eq!(
        store.extend(&scope, fresh, ttl).await.unwrap(),
        Fenced::Applied
    );
    let fresh_response = StoredResponse {
        body: Bytes::from_static(b"fresh"),
        ..response
    };
    assert_eq!(
        store
            .complete(&scope, fresh, fingerprint, &fresh_response, ttl)
            .await
            .unwrap(),
        Fenced::Applied
    );
    match store.claim(&scope, fingerprint, ttl).await.unwrap() {
        Claim::Completed { response, .. } => assert_eq!(response, fresh_response),
        other => panic!("expected the fresh holder's record, got {other:?}"),
    }
    assert_eq!(
        store.release(&scope, fresh).await.unwrap(),
        Fenced::Lost,
        "completed is not releasable"
    );
}

async fn completing_twice_with_one_token_is_harmless(store: Arc<dyn Store>) {
    let scope = scope("twice");
    let fingerprint = Fingerprint::from_bytes([4; 32]);
    let ttl = Duration::from_secs(60);
    let Claim::Claimed(token) = store.claim(&scope, fingerprint, ttl).await.unwrap() else {
        panic!("free key")
    };
    let response = StoredResponse {
        status: StatusCode::CREATED,
        headers: HeaderMap::new(),
        body: Bytes::from_static(b"once"),
        trailers: None,
    };
    for _ in 0..2 {
        let fenced = store
            .complete(&scope, token, fingerprint, &response, ttl)
            .await
            .unwrap();
        assert_eq!(fenced, Fenced::Applied);
    }
    match store.claim(&scope, fingerprint, ttl).await.unwrap() {
        Claim::Completed {
            response: stored, ..
        } => assert_eq!(stored, response),
        other => panic!("expected the completed record, got {other:?}"),
    }
    // Another claim still cannot overwrite it.
    let other = tower_idempotency::ClaimToken::unique();
    let overwrite = StoredResponse {
        body: Bytes::from_static(b"twice"),
        ..response.clone()
    };
    let fenced = store
        .complete(&scope, other, fingerprint, &overwrite, ttl)
        .await
        .unwrap();
    assert_eq!(fenced, Fenced::Lost);
    match store.claim(&scope, fingerprint, ttl).await.unwrap() {
        Claim::Completed {
            response: stored, ..
        } => assert_eq!(stored, response),
        other => panic!("expected the completed record, got {other:?}"),
    }
}

async fn scope_parts_never_splice(store: Arc<dyn Store>) {
    let handler = Handler::default();
    let by_user = |parts: &http::request::Parts| {
        parts
            .headers
            .get("x-user")
            .map(|v| v.to_str().unwrap().to_owned())
    };
    let app = Router::new()
        .route("/v1/payments", routing::post(handle))
        .layer(layer(&store).principal(by_user))
        .with_state(handler.clone());
    let a = send(
        &app,
        post("/v1/payments")
            .key("x:/v1/payments:k")
            .header("x-user", "alice"),
    )
    .await;
    let b = send(
        &app,
        post("/v1/payments")
            .key("k")
            .header("x-user", "alice:/v1/payments:x"),
    )
    .await;
    assert!(!a.replayed() && !b.replayed());
    assert_eq!(handler.executions(), 2);
}

async fn principals_are_isolated_by_default(store: Arc<dyn Store>) {
    let handler = Handler::default();
    let app = router(&handler, layer(&store));
    let as_user = |user: &str| {
        post("/pay")
            .key("shared")
            .header("authorization", &format!("Bearer {user}"))
    };
    assert!(!send(&app, as_user("alice")).await.replayed());
    assert!(!send(&app, as_user("bob")).await.replayed());
    assert!(!send(&app, post("/pay").key("shared")).await.replayed());
    assert!(send(&app, as_user("alice")).await.replayed());
    assert_eq!(handler.executions(), 3);
}

/// A cookie-session (or mTLS) app: no `Principal` extension, no `Authorization` header. By
/// default the layer refuses its keyed requests, executes and claims nothing, and says
/// what is missing; an unkeyed request on an optional route still passes. A route that
/// opts in shares one anonymous scope between its callers.
async fn a_keyed_request_without_a_principal_is_refused_unless_the_route_opts_in(
    store: Arc<dyn Store>,
) {
    let handler = Handler::default();
    let strict = router(&handler, IdempotencyLayer::from_shared(store.clone()));
    let as_session = |key: &str, session: &str| {
        post("/pay")
            .key(key)
            .header("cookie", &format!("session={session}"))
    };
    let refused = send(&strict, as_session("anonymous", "a")).await;
    assert_eq!(refused.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(refused.error(), "idempotency_principal_missing");
    assert!(refused.headers.get("set-cookie").is_none());
    assert_eq!(handler.executions(), 0, "nothing executed");
    let claim = store
        .claim(
            &scope("anonymous"),
            Fingerprint::from_bytes([0; 32]),
            Duration::from_secs(1),
        )
        .await
        .unwrap();
    assert!(
        matches!(claim, Claim::Claimed(_)),
        "nothing claimed: {claim:?}"
    );
    send(&strict, post("/pay")).await.assert_executed();
    let named = post("/pay")
        .key("named")
        .header("authorization", "Bearer a");
    send(&strict, named).await.assert_executed();
    assert_eq!(handler.executions(), 2);

    let opted_in = [
        IdempotencyLayer::from_shared(store.clone()).allow_anonymous(),
        IdempotencyLayer::from_shared(store.clone()).unscoped(),
    ];
    for (at, layer) in opted_in.into_iter().enumerate() {
        let app = router(&handler, layer);
        let key = format!("opted-in-{at}");
        send(&app, as_session(&key, "a")).await.assert_executed();
        // Another session, the same key and body: the one anonymous scope's record.
        assert!(send(&app, as_session(&key, "b")).await.replayed());
    }
    assert_eq!(handler.executions(), 4);
    // Unscoped, then given a principal extractor after all: refused again.
    let rescoped = IdempotencyLayer::from_shared(store.clone())
        .unscoped()
        .credential_secret(b"secret");
    let rescoped = router(&handler, rescoped);
    let answer = send(&rescoped, as_session("rescoped", "a")).await;
    assert_eq!(answer.error(), "idempotency_principal_missing");
    assert_eq!(handler.executions(), 4);
    // An extractor that names the empty principal (a blank header) names none: refused,
    // rather than let into the anonymous scope the route did not opt in to.
    let by_header = IdempotencyLayer::from_shared(store.clone()).principal(|parts: &Parts| {
        let user = parts.headers.get("x-user-id")?.to_str().ok()?;
        Some(user.to_owned())
    });
    let by_header = router(&handler, by_header);
    let blank = || post("/pay").key("blank").header("x-user-id", "");
    let answer = send(&by_header, blank()).await;
    assert_eq!(answer.error(), "idempotency_principal_missing");
    assert_eq!(
        send(&by_header, blank()).await.error(),
        "idempotency_principal_missing"
    );
    assert_eq!(handler.executions(), 4);
    let named = post("/pay").key("blank").header("x-user-id", "u1");
    send(&by_header, named).await.assert_executed();
    assert_eq!(handler.executions(), 5);
    // So is a blank `Authorization` header under the default extractor: no credential, not
    // one shared by every client that sends it blank.
    for layer in [
        IdempotencyLayer::from_shared(store.clone()),
        IdempotencyLayer::from_shared(store.clone()).credential_secret(b"secret"),
    ] {
        let app = router(&handler, layer);
        let blank = post("/pay").key("blank-auth").header("authorization", "");
        let answer = send(&app, blank).await;
        assert_eq!(answer.error(), "idempotency_principal_missing");
    }
    assert_eq!(handler.executions(), 5);
}

/// With a secret, the `Authorization` digest is an HMAC under it: two instances with the
/// same secret share scopes, another secret starts afresh, and the store holds neither the
/// credential nor its plain SHA-256 (which a reader of the store could test guesses
/// against).
async fn credential_digests_are_keyed_by_the_layers_secret(store: Arc<dyn Store>) {
    let handler = Handler::default();
    let secret = b"0123456789abcdef0123456789abcdef";
    let keyed = |secret: &[u8]| {
        let layer = IdempotencyLayer::from_shared(store.clone()).credential_secret(secret);
        router(&handler, layer)
    };
    let (one, other_instance, rotated) = (keyed(secret), keyed(secret), keyed(b"another"));
    let credential = "Basic YWxpY2U6aHVudGVyMg==";
    let as_alice = || {
        post("/pay")
            .key("keyed")
            .header("authorization", credential)
    };
    send(&one, as_alice()).await.assert_executed();
    assert!(send(&other_instance, as_alice()).await.replayed());
    send(&rotated, as_alice()).await.assert_executed();
    assert_eq!(handler.executions(), 2);
    let scope_of = |principal: Principal| {
        let key = IdempotencyKey::parse(&HeaderValue::from_static("keyed")).unwrap();
        Scope::new(Some(principal.as_str().into()), "POST /pay".into(), key)
    };
    let found = |principal| {
        let scope = scope_of(principal);
        let store = store.clone();
        async move {
            let fingerprint = Fingerprint::from_bytes([0; 32]);
            store
                .claim(&scope, fingerprint, Duration::from_secs(1))
                .await
                .unwrap()
        }
    };
    let by_secret = Principal::from_credential_keyed(secret, credential.as_bytes());
    assert!(matches!(found(by_secret).await, Claim::Completed { .. }));
    let plain = Principal::from_credential(credential.as_bytes());
    assert!(matches!(found(plain).await, Claim::Claimed(_)));
}

/// The first response carries the handler's cookies to its client; a replay, which goes to
/// whoever sends the key again, carries none, unless the route chooses to replay them.
async fn set_cookie_is_replayed_only_when_chosen(store: Arc<dyn Store>) {
    let handler = Handler::default();
    let cookies = |answer: &Answer| {
        let cookies = answer.headers.get_all("set-cookie").iter();
        cookies
            .map(|value| value.to_str().unwrap().to_owned())
            .collect::<Vec<_>>()
    };
    let app = router(&handler, layer(&store));
    let first = send(&app, post("/pay").key("cookies")).await;
    assert_eq!(cookies(&first), ["a=1", "b=2"]);
    let replay = send(&app, post("/pay").key("cookies")).await;
    assert!(replay.replayed());
    assert!(cookies(&replay).is_empty(), "{:?}", replay.headers);
    assert_eq!(replay.body, first.body);

    let kept = router(&handler, layer(&store).replay_set_cookie());
    send(&kept, post("/pay").key("cookies-kept")).await;
    let replay = send(&kept, post("/pay").key("cookies-kept")).await;
    assert!(replay.replayed());
    assert_eq!(cookies(&replay), ["a=1", "b=2"]);
}

async fn principal_extension_from_an_auth_layer(store: Arc<dyn Store>) {
    let handler = Handler::default();
    let app = router(&handler, layer(&store)).layer(axum::middleware::map_request(
        |mut request: Request| async move {
            let user = request
                .headers()
                .get("x-session")
                .map(|v| v.to_str().unwrap().to_owned());
            if let Some(user) = user {
                request.extensions_mut().insert(Principal::new(user));
            }
            request
        },
    ));
    let as_session = |s: &str| post("/pay").key("ext").header("x-session", s);
    assert!(!send(&app, as_session("u1")).await.replayed());
    assert!(!send(&app, as_session("u2")).await.replayed());
    assert!(send(&app, as_session("u1")).await.replayed());
    assert_eq!(handler.executions(), 2);
}

async fn one_principal_one_scope_however_named(store: Arc<dyn Store>) {
    let handler = Handler::default();
    let session = |parts: &http::request::Parts| {
        let user = parts.headers.get("x-session")?.to_str().ok()?;
        Some(user.to_owned())
    };
    // Named by an auth layer's `Principal` extension (the default extractor)...
    let by_extension = router(&handler, layer(&store)).layer(axum::middleware::map_request(
        move |mut request: Request| async move {
            let (parts, body) = request.into_parts();
            let user = session(&parts);
            request = Request::from_parts(parts, body);
            if let Some(user) = user {
                request.extensions_mut().insert(Principal::new(user));
            }
            request
        },
    ));
    // ...or by a closure returning the same name: one scope, whichever a deploy uses.
    let by_closure = router(&handler, layer(&store).principal(session));
    let as_carol = |key: &str| post("/pay").key(key).header("x-session", "carol");
    assert!(!send(&by_extension, as_carol("one")).await.replayed());
    assert!(send(&by_closure, as_carol("one")).await.replayed());
    assert!(!send(&by_closure, as_carol("two")).await.replayed());
    assert!(send(&by_extension, as_carol("two")).await.replayed());
    assert_eq!(handler.executions(), 2);
    // What is stored is the name itself.
    let key = IdempotencyKey::parse(&HeaderValue::from_static("one")).unwrap();
    let stored = Scope::new(Some("carol".into()), "POST /pay".into(), key);
    let claim = store
        .claim(
            &stored,
            Fingerprint::from_bytes([0; 32]),
            Duration::from_secs(1),
        )
        .await
        .unwrap();
    assert!(matches!(claim, Claim::Completed { .. }), "{claim:?}");

    // A credential's digest never shares a scope with a name, even one spelled like it.
    let by_credential = router(&handler, layer(&store));
    let digest = Principal::from_credential(b"Bearer carol")
        .as_str()
        .to_owned();
    let by_name = router(
        &handler,
        layer(&store).principal(move |_: &http::request::Parts| Some(digest.clone())),
    );
    let credential = post("/pay")
        .key("three")
        .header("authorization", "Bearer carol");
    assert!(!send(&by_credential, credential).await.replayed());
    assert!(!send(&by_name, post("/pay").key("three")).await.replayed());
    assert_eq!(handler.executions(), 4);
}

async fn endpoints_scope_keys(store: Arc<dyn Store>) {
    let handler = Handler::default();
    let app = router(&handler, layer(&store));
    assert!(!send(&app, post("/pay").key("ep")).await.replayed());
    assert!(!send(&app, post("/other").key("ep")).await.replayed());
    assert_eq!(handler.executions(), 2);
    let named = router(&handler, layer(&store).endpoint_name("one-endpoint"));
    send(&named, post("/pay").key("ep2")).await;
    // Same endpoint name, other path: the fingerprint (which includes the path) differs.
    let answer = send(&named, post("/other").key("ep2")).await;
    assert_eq!(
        answer.error(),
        "idempotency_key_reused_with_different_params"
    );
}

/// `len` letters and digits no compression shrinks much, drawn from `seed`: what a long
/// token or a long path can look like.
fn incompressible(seed: u64, len: usize) -> String {
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
    let mut state = seed | 1;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            char::from(ALPHABET[(state % ALPHABET.len() as u64) as usize])
        })
        .collect()
}

/// A principal or a path longer than `MAX_SCOPE_PART_LEN` is scoped by its digest, which
/// every store can index (PostgreSQL's unique index refused such a scope outright: every
/// request got 503, or ran unprotected under `fail_open`): executed once, replayed, kept
/// apart from another as long, and from a principal named like its digest; so is one with a
/// NUL byte.
async fn long_principals_and_paths_are_scoped_by_their_digest(store: Arc<dyn Store>) {
    use sha2::{Digest, Sha256};

    let handler = Handler::default();
    let by_user = |parts: &Parts| {
        let user = parts.headers.get("x-user")?;
        Some(user.to_str().ok()?.to_owned())
    };
    let app = Router::new()
        .route("/orders/{id}", routing::post(handle))
        .route_layer(layer(&store).principal(by_user))
        .with_state(handler.clone());
    let (alice, order) = (incompressible(1, 3000), incompressible(2, 3000));
    let charge = |user: &str, order: &str| {
        post(&format!("/orders/{order}"))
            .key("long")
            .header("x-user", user)
    };
    let first = send(&app, charge(&alice, &order)).await;
    assert_eq!(first.status, StatusCode::CREATED, "{:?}", first.body);
    let retry = send(&app, charge(&alice, &order)).await;
    assert!(retry.replayed());
    assert_eq!(retry.body, first.body);
    assert_eq!(handler.executions(), 1);

    // One letter apart, in the principal or in the path: another operation.
    let mut bob = alice.clone();
    bob.replace_range(2999.., if alice.ends_with('A') { "B" } else { "A" });
    assert!(!send(&app, charge(&bob, &order)).await.replayed());
    let mut other = order.clone();
    other.replace_range(2999.., if order.ends_with('A') { "B" } else { "A" });
    assert!(!send(&app, charge(&alice, &other)).await.replayed());
    assert_eq!(handler.executions(), 3);

    // A principal named as Alice's is kept: never her scope.
    let digest: String = Sha256::digest(alice.as_bytes())
        .iter()
        .map(|byte| format!("{byte:02x}"))
        .collect();
    let named_like_hers = format!("sha256:{digest}");
    assert!(!send(&app, charge(&named_like_hers, &order))
        .await
        .replayed());
    assert_eq!(handler.executions(), 4);

    // A name with a NUL byte (a token's claim, decoded), which PostgreSQL's text refuses,
    // is kept as its digest too.
    let with_nul = Router::new()
        .route("/orders/{id}", routing::post(handle))
        .route_layer(layer(&store).principal(|_: &Parts| Some("carol\0".to_owned())))
        .with_state(handler.clone());
    let first = send(&with_nul, post("/orders/1").key("nul")).await;
    assert_eq!(first.status, StatusCode::CREATED, "{:?}", first.body);
    assert!(send(&with_nul, post("/orders/1").key("nul"))
        .await
        .replayed());
    assert_eq!(handler.executions(), 5);
}

async fn matched_path_names_the_endpoint(store: Arc<dyn Store>) {
    let handler = Handler::default();
    let app = Router::new()
        .route("/orders/{id}/capture", routing::post(handle))
        .route_layer(layer(&store).endpoint_from_matched_path())
        .with_state(handler.clone());
    send(&app, post("/orders/1/capture").key("mp")).await;
    let answer = send(&app, post("/orders/2/capture").key("mp")).await;
    assert_eq!(
        answer.error(),
        "idempotency_key_reused_with_different_params"
    );
    assert_eq!(handler.executions(), 1);
}

async fn oversized_response_is_streamed_and_never_executed_twice(store: Arc<dyn Store>) {
    let handler = Handler::default();
    let app = router(&handler, layer(&store).max_response_body(1024));
    let big = || post("/pay").key("huge").header("x-body-len", "10000");
    let first = send(&app, big()).await;
    assert_eq!(
        (first.status, first.body.len()),
        (StatusCode::CREATED, 10_000)
    );
    let retry = send(&app, big()).await;
    assert_eq!(retry.status, StatusCode::CONFLICT);
    assert_eq!(
        retry.json(),
        serde_json::json!({"error": "response_not_replayable", "status": 201})
    );
    assert_eq!(handler.executions(), 1);
    // At the limit exactly, the response is recorded.
    send(&app, post("/pay").key("fits").header("x-body-len", "1024")).await;
    let retry = send(&app, post("/pay").key("fits").header("x-body-len", "1024")).await;
    assert!(retry.replayed());
    assert_eq!(retry.body.len(), 1024);
}

/// A response of more header values than a map can be sized for (30 000 under one name)
/// is recorded and replayed whole; one of more header names than a replay's map holds with
/// its mark is recorded as not replayable, as a response over `max_response_body` is. Its
/// client gets it either way, every retry a clean answer, and the handler runs once.
async fn a_response_of_many_headers_runs_once_and_its_retries_get_a_clean_answer(
    store: Arc<dyn Store>,
) {
    use axum::{http::HeaderName, response::IntoResponse};
    fn many_headers(distinct_names: bool) -> Response {
        let mut response = (StatusCode::CREATED, "ok").into_response();
        if distinct_names {
            // With `Content-Type`, and the `Content-Length` axum adds, as many names as a
            // map holds (24 576).
            for i in 0..24_574 {
                let name = HeaderName::try_from(format!("x-item-{i}")).unwrap();
                response
                    .headers_mut()
                    .append(name, HeaderValue::from_static("1"));
            }
        } else {
            for _ in 0..30_000 {
                let value = HeaderValue::from_static("1");
                response.headers_mut().append("x-item", value);
            }
        }
        response
    }
    let calls = Arc::new(AtomicUsize::new(0));
    let route = |distinct_names: bool| {
        let calls = calls.clone();
        routing::post(move || {
            calls.fetch_add(1, Ordering::SeqCst);
            async move { many_headers(distinct_names) }
        })
    };
    let app = Router::new()
        .route("/values", route(false))
        .route("/names", route(true))
        .layer(layer(&store));

    let first = send(&app, post("/values").key("values")).await;
    first.assert_executed();
    assert_eq!(first.headers.get_all("x-item").iter().count(), 30_000);
    for _ in 0..2 {
        let retry = send(&app, post("/values").key("values")).await;
        assert!(retry.replayed(), "{retry:?}");
        assert_eq!(retry.status, StatusCode::CREATED);
        assert_eq!(retry.headers.get_all("x-item").iter().count(), 30_000);
        assert_eq!(retry.body, "ok");
    }
    assert_eq!(calls.load(Ordering::SeqCst), 1);

    let first = send(&app, post("/names").key("names")).await;
    first.assert_executed();
    assert_eq!(first.headers.keys_len(), 24_576);
    for _ in 0..2 {
        let retry = send(&app, post("/names").key("names")).await;
        assert_eq!(retry.status, StatusCode::CONFLICT);
        assert_eq!(
            retry.json(),
            serde_json::json!({"error": "response_not_replayable", "status": 201})
        );
    }
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}

async fn hop_by_hop_headers_and_date_are_not_replayed(store: Arc<dyn Store>) {
    let service = tower::service_fn(|_req: Request<http_body_util::Full<Bytes>>| async {
        let response = Response::builder()
            .status(StatusCode::CREATED)
            .header("date", "Wed, 02 Dec 2026 00:00:00 GMT")
            .header("connection", "x-conn-scoped")
            .header("x-conn-scoped", "1")
            .header("keep-alive", "timeout=5")
            .header("x-kept", "yes")
            .body(http_body_util::Full::new(Bytes::from_static(b"ok")))
            .unwrap();
        Ok::<_, std::convert::Infallible>(response)
    });
    let service = tower::ServiceBuilder::new()
        .layer(layer(&store))
        .service(service);
    let request = || {
        Request::post("/h")
            .header("idempotency-key", "hop")
            .body(http_body_util::Full::default())
            .unwrap()
    };
    let first = read(service.clone().oneshot(request()).await.unwrap()).await;
    assert_eq!(first.headers["date"], "Wed, 02 Dec 2026 00:00:00 GMT");
    let retry = read(service.oneshot(request()).await.unwrap()).await;
    let names: Vec<&str> = retry.headers.keys().map(|n| n.as_str()).collect();
    assert_eq!(names, ["x-kept", "idempotent-replayed"]);
}

async fn per_route_layers_are_configured_independently(store: Arc<dyn Store>) {
    let handler = Handler::default();
    let app = Router::new()
        .route(
            "/strict",
            routing::post(handle).layer(layer(&store).required().ttl(Duration::from_millis(300))),
        )
        .route(
            "/loose",
            routing::post(handle)
                .put(handle)
                .layer(layer(&store).methods([http::Method::PUT])),
        )
        .with_state(handler.clone());
    assert_eq!(
        send(&app, post("/strict")).await.error(),
        "idempotency_key_required"
    );
    assert_eq!(send(&app, post("/loose")).await.status, StatusCode::CREATED);
    // /loose handles PUT only: a keyed POST passes through every time.
    assert!(!send(&app, post("/loose").key("r")).await.replayed());
    assert!(!send(&app, post("/loose").key("r")).await.replayed());
    send(&app, post("/loose").method("PUT").key("r")).await;
    send(&app, post("/strict").key("r")).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    // /strict's records expire after 300 ms, /loose keeps its own for 24 h.
    assert!(!send(&app, post("/strict").key("r")).await.replayed());
    assert!(send(&app, post("/loose").method("PUT").key("r"))
        .await
        .replayed());
    assert_eq!(handler.executions(), 6);
}

async fn plain_service_fn_is_protected(store: Arc<dyn Store>) {
    let calls = Arc::new(AtomicUsize::new(0));
    let service = tower::service_fn({
        let calls = calls.clone();
        move |request: Request<http_body_util::Full<Bytes>>| {
            calls.fetch_add(1, Ordering::SeqCst);
            async move {
                let body = request.into_body().collect().await.unwrap().to_bytes();
                Ok::<_, std::convert::Infallible>(Response::new(http_body_util::Full::new(body)))
            }
        }
    });
    let service = tower::ServiceBuilder::new()
        .layer(layer(&store).required())
        .service(service);
    let request = |body: &'static str| {
        Request::post("/x")
            .header("idempotency-key", "fn")
            .body(http_body_util::Full::from(body))
            .unwrap()
    };
    let first = read(service.clone().oneshot(request("echo me")).await.unwrap()).await;
    assert_eq!(first.body, "echo me");
    let retry = read(service.clone().oneshot(request("echo me")).await.unwrap()).await;
    assert!(retry.replayed());
    assert_eq!(retry.body, "echo me");
    let other = read(service.oneshot(request("other")).await.unwrap()).await;
    assert_eq!(other.status, StatusCode::CONFLICT);
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

/// A response's trailers (where gRPC keeps its status) reach the first client, are recorded,
/// and end every replay, byte for byte.
async fn trailers_are_passed_on_recorded_and_replayed(store: Arc<dyn Store>) {
    let calls = Arc::new(AtomicUsize::new(0));
    let service = tower::service_fn({
        let calls = calls.clone();
        move |_: Request<http_body_util::Full<Bytes>>| {
            let call = calls.fetch_add(1, Ordering::SeqCst) + 1;
            async move {
                let mut trailers = HeaderMap::new();
                trailers.insert("grpc-status", HeaderValue::from_static("0"));
                trailers.insert("x-call", HeaderValue::from(call));
                trailers.append(
                    "x-bin",
                    HeaderValue::from_bytes(b"\xff\x00").unwrap_or(HeaderValue::from_static("b")),
                );
                let frames = [
                    Ok::<_, std::convert::Infallible>(http_body::Frame::data(Bytes::from_static(
                        b"\0\0\0\0\x02hi",
                    ))),
                    Ok(http_body::Frame::trailers(trailers)),
                ];
                let body = http_body_util::StreamBody::new(futures_util::stream::iter(frames));
                Ok::<_, std::convert::Infallible>(Response::new(body))
            }
        }
    });
    let service = tower::ServiceBuilder::new()
        .layer(layer(&store).required())
        .service(service);
    let request = || {
        Request::post("/grpc")
            .header("idempotency-key", "trailers")
            .body(http_body_util::Full::from("call"))
            .unwrap()
    };
    let first = service.clone().oneshot(request()).await.unwrap();
    assert!(first.headers().get("idempotent-replayed").is_none());
    let first = first.into_body().collect().await.unwrap();
    let trailers = first
        .trailers()
        .cloned()
        .expect("the first client gets the trailers");
    assert_eq!(trailers.get("x-call").unwrap(), "1");
    assert_eq!(trailers.get("grpc-status").unwrap(), "0");
    assert_eq!(first.to_bytes(), &b"\0\0\0\0\x02hi"[..]);
    for _ in 0..2 {
        let retry = service.clone().oneshot(request()).await.unwrap();
        assert_eq!(retry.headers().get("idempotent-replayed").unwrap(), "true");
        let retry = retry.into_body().collect().await.unwrap();
        assert_eq!(retry.trailers(), Some(&trailers));
        assert_eq!(retry.to_bytes(), &b"\0\0\0\0\x02hi"[..]);
    }
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

/// Over HTTP/1.1, on the wire: a response declaring a trailer (`Trailer: x-checksum`) and
/// ending with it reaches the first client with it, chunked, as it does without the layer,
/// and every replay too. The layer sent the first with `Content-Length` and no trailer (its
/// buffered body said its exact size), and replays without the `Trailer` header either,
/// which HTTP/1.1 needs to send a trailer.
#[tokio::test]
async fn http1_trailers_are_passed_on_and_replayed_on_the_wire() {
    async fn exchange(app: Router) -> String {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let server = tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        let mut stream = tokio::net::TcpStream::connect(address).await.unwrap();
        let request = "POST /sum HTTP/1.1\r\nhost: x\r\nte: trailers\r\nconnection: close\r\n\
            idempotency-key: sum-1\r\ncontent-length: 2\r\n\r\n{}";
        stream.write_all(request.as_bytes()).await.unwrap();
        let mut answer = Vec::new();
        let reading = stream.read_to_end(&mut answer);
        tokio::time::timeout(Duration::from_secs(5), reading)
            .await
            .unwrap()
            .unwrap();
        server.abort();
        String::from_utf8_lossy(&answer).to_ascii_lowercase()
    }
    let summed = || async {
        let mut trailers = HeaderMap::new();
        trailers.insert("x-checksum", HeaderValue::from_static("abc"));
        let frames = [
            Ok::<_, std::convert::Infallible>(http_body::Frame::data(Bytes::from_static(b"hello"))),
            Ok(http_body::Frame::trailers(trailers)),
        ];
        let body = http_body_util::StreamBody::new(futures_util::stream::iter(frames));
        Response::builder()
            .status(StatusCode::CREATED)
            .header("trailer", "x-checksum")
            .body(Body::new(body))
            .unwrap()
    };
    let bare = exchange(Router::new().route("/sum", routing::post(summed))).await;
    assert!(
        bare.contains("\r\nx-checksum: abc\r\n"),
        "without the layer: {bare}"
    );
    let store: Arc<dyn Store> = Arc::new(tower_idempotency::MemoryStore::new());
    let layer = IdempotencyLayer::from_shared(store).allow_anonymous();
    let app = Router::new().route("/sum", routing::post(summed).layer(layer));
    let first = exchange(app.clone()).await;
    assert!(!first.contains("idempotent-replayed"), "{first}");
    let replays = [exchange(app.clone()).await, exchange(app).await];
    for replay in &replays {
        assert!(replay.contains("idempotent-replayed: true"), "{replay}");
    }
    for answer in [&first, &replays[0], &replays[1]] {
        assert!(answer.contains("transfer-encoding: chunked"), "{answer}");
        assert!(answer.contains("\r\ntrailer: x-checksum\r\n"), "{answer}");
        assert!(answer.contains("\r\nx-checksum: abc\r\n"), "{answer}");
        assert!(answer.contains("hello"), "{answer}");
    }
}

/// A gRPC-shaped service (HTTP 200, the status in the trailers, or in the headers of a
/// trailers-only answer): `UNAVAILABLE` and `INTERNAL` mean "not done" and release the key,
/// so the retry executes; `FAILED_PRECONDITION` is a result, recorded and replayed. The
/// layer's own answers to a gRPC request are gRPC statuses.
async fn transient_grpc_statuses_release_and_the_rest_replay(store: Arc<dyn Store>) {
    let calls = Arc::new(AtomicUsize::new(0));
    let service = tower::service_fn({
        let calls = calls.clone();
        move |request: Request<http_body_util::Full<Bytes>>| {
            calls.fetch_add(1, Ordering::SeqCst);
            let status = request.headers()["x-grpc-status"].clone();
            let trailers_only = request.headers().contains_key("x-trailers-only");
            async move {
                let mut head = HeaderMap::new();
                head.insert("grpc-status", status);
                let mut response = if trailers_only {
                    let mut response =
                        Response::new(http_body_util::StreamBody::new(futures_util::stream::iter(
                            Vec::<Result<http_body::Frame<Bytes>, std::convert::Infallible>>::new(),
                        )));
                    *response.headers_mut() = head;
                    response
                } else {
                    let frames = vec![
                        Ok(http_body::Frame::data(Bytes::from_static(b"\0\0\0\0\0"))),
                        Ok(http_body::Frame::trailers(head)),
                    ];
                    Response::new(http_body_util::StreamBody::new(futures_util::stream::iter(
                        frames,
                    )))
                };
                response.headers_mut().insert(
                    header::CONTENT_TYPE,
                    HeaderValue::from_static("application/grpc"),
                );
                Ok::<_, std::convert::Infallible>(response)
            }
        }
    });
    let service = tower::ServiceBuilder::new()
        .layer(layer(&store).required())
        .service(service);
    let call = |key: &str, status: &'static str, trailers_only: bool| {
        let mut request = Request::post("/payments.v1.Payments/Charge")
            .header(header::CONTENT_TYPE, "application/grpc")
            .header("x-grpc-status", status);
        if !key.is_empty() {
            request = request.header("idempotency-key", key);
        }
        if trailers_only {
            request = request.header("x-trailers-only", "1");
        }
        request.body(http_body_util::Full::from("call")).unwrap()
    };
    let grpc_status = |response: &Response<_>, trailers: Option<&HeaderMap>| {
        trailers
            .and_then(|t| t.get("grpc-status"))
            .or_else(|| response.headers().get("grpc-status"))
            .map(|v: &HeaderValue| v.to_str().unwrap().to_owned())
    };
    let send = |request| {
        let service = service.clone();
        async move {
            let response = service.oneshot(request).await.unwrap();
            let (parts, body) = response.into_parts();
            let collected = body.collect().await.unwrap();
            let trailers = collected.trailers().cloned();
            let response = Response::from_parts(parts, ());
            let status = grpc_status(&response, trailers.as_ref());
            (response, status)
        }
    };

    // Transient: released, so each retry executes again.
    for (status, trailers_only) in [("14", false), ("13", true)] {
        let key = format!("transient-{status}");
        let before = calls.load(Ordering::SeqCst);
        for _ in 0..2 {
            let (response, got) = send(call(&key, status, trailers_only)).await;
            assert_eq!(got.as_deref(), Some(status));
            assert!(response.headers().get("idempotent-replayed").is_none());
        }
        assert_eq!(calls.load(Ordering::SeqCst), before + 2, "status {status}");
    }
    // A result: recorded once, replayed after.
    let before = calls.load(Ordering::SeqCst);
    let (_, first) = send(call("declined", "9", false)).await;
    let (replay, again) = send(call("declined", "9", false)).await;
    assert_eq!((first.as_deref(), again.as_deref()), (Some("9"), Some("9")));
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert_eq!(calls.load(Ordering::SeqCst), before + 1);

    // The layer's own answers: no key is INVALID_ARGUMENT; another body under the same key
    // is FAILED_PRECONDITION; both trailers-only, HTTP 200.
    let before = calls.load(Ordering::SeqCst);
    let (missing, status) = send(call("", "0", false)).await;
    assert_eq!(missing.status(), StatusCode::OK);
    assert_eq!(status.as_deref(), Some("3"));
    assert!(missing.headers()["grpc-message"]
        .to_str()
        .unwrap()
        .starts_with("idempotency_key_required"));
    let mut other = call("declined", "9", false);
    *other.body_mut() = http_body_util::Full::from("another call");
    let (reused, status) = send(other).await;
    assert_eq!(status.as_deref(), Some("9"));
    assert!(reused.headers()["grpc-message"]
        .to_str()
        .unwrap()
        .starts_with("idempotency_key_reused_with_different_params"));
    assert_eq!(calls.load(Ordering::SeqCst), before);
}

async fn fingerprint_headers_are_part_of_the_parameters(store: Arc<dyn Store>) {
    let handler = Handler::default();
    let account = http::HeaderName::from_static("x-account");
    let app = router(&handler, layer(&store).fingerprint_header(account));
    send(&app, post("/pay").key("fh").header("x-account", "a")).await;
    assert!(send(&app, post("/pay").key("fh").header("x-account", "a"))
        .await
        .replayed());
    let other = send(&app, post("/pay").key("fh").header("x-account", "b")).await;
    assert_eq!(
        other.error(),
        "idempotency_key_reused_with_different_params"
    );
    // Without the option the header is not a parameter.
    let plain = router(&handler, layer(&store));
    send(&plain, post("/pay").key("fh2").header("x-account", "a")).await;
    assert!(
        send(&plain, post("/pay").key("fh2").header("x-account", "b"))
            .await
            .replayed()
    );
}

/// A response body that is not `Unpin` (a stream built from an `async` state machine) is
/// recorded and replayed when it fits, and streamed on whole when it does not.
#[tokio::test]
async fn response_bodies_need_not_be_unpin() {
    fn chunks(count: u8) -> impl http_body::Body<Data = Bytes, Error = std::convert::Infallible> {
        let stream = futures_util::stream::unfold(0u8, move |n| async move {
            tokio::task::yield_now().await;
            (n < count).then(|| (Ok(http_body::Frame::data(Bytes::from(vec![n; 100]))), n + 1))
        });
        http_body_util::StreamBody::new(stream)
    }
    let store: Arc<dyn Store> = Arc::new(tower_idempotency::MemoryStore::new());
    let calls = Arc::new(AtomicUsize::new(0));
    let service = tower::service_fn({
        let calls = calls.clone();
        move |request: Request<http_body_util::Full<Bytes>>| {
            calls.fetch_add(1, Ordering::SeqCst);
            let count: u8 = request.uri().path()[1..].parse().unwrap();
            async move { Ok::<_, std::convert::Infallible>(Response::new(chunks(count))) }
        }
    });
    let service = tower::ServiceBuilder::new()
        .layer(layer(&store).max_response_body(500))
        .service(service);
    let request = |count: u8| {
        Request::post(format!("/{count}"))
            .header("idempotency-key", format!("stream-{count}"))
            .body(http_body_util::Full::default())
            .unwrap()
    };
    // Fits: recorded, then replayed byte for byte.
    let first = read(service.clone().oneshot(request(3)).await.unwrap()).await;
    assert_eq!(first.body.len(), 300);
    let retry = read(service.clone().oneshot(request(3)).await.unwrap()).await;
    assert!(retry.replayed());
    assert_eq!(retry.body, first.body);
    // Too large: the first client still gets all of it, in order.
    let large = read(service.clone().oneshot(request(9)).await.unwrap()).await;
    let expected: Vec<u8> = (0..9u8).flat_map(|n| vec![n; 100]).collect();
    assert_eq!(large.body, expected);
    let after = read(service.oneshot(request(9)).await.unwrap()).await;
    assert_eq!(after.status, StatusCode::CONFLICT);
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}

/// A gRPC response over `max_response_body` is recorded as not replayable once it passes
/// the limit, before its trailers: a transient status in them (which releases the key of
/// a response that fits) does not make the call run again. Its first client still gets
/// every byte and the trailers.
#[tokio::test]
async fn an_oversized_grpc_response_is_never_executed_again_whatever_its_trailers() {
    let store: Arc<dyn Store> = Arc::new(tower_idempotency::MemoryStore::new());
    let calls = Arc::new(AtomicUsize::new(0));
    let service = tower::service_fn({
        let calls = calls.clone();
        move |request: Request<http_body_util::Full<Bytes>>| {
            calls.fetch_add(1, Ordering::SeqCst);
            let count: u8 = request.uri().path()[1..].parse().unwrap();
            async move {
                let mut trailers = HeaderMap::new();
                trailers.insert("grpc-status", HeaderValue::from_static("14")); // UNAVAILABLE
                let frames = (0..count)
                    .map(|n| http_body::Frame::data(Bytes::from(vec![n; 100])))
                    .chain([http_body::Frame::trailers(trailers)])
                    .map(Ok::<_, std::convert::Infallible>);
                let body = http_body_util::StreamBody::new(futures_util::stream::iter(frames));
                Ok::<_, std::convert::Infallible>(Response::new(body))
            }
        }
    });
    let service = tower::ServiceBuilder::new()
        .layer(layer(&store).max_response_body(500))
        .service(service);
    let request = |count: u8| {
        Request::post(format!("/{count}"))
            .header("content-type", "application/grpc")
            .header("idempotency-key", format!("grpc-{count}"))
            .body(http_body_util::Full::default())
            .unwrap()
    };
    // Fits: the transient status releases the key, and the retry runs again.
    for _ in 0..2 {
        let small = service.clone().oneshot(request(3)).await.unwrap();
        let small = small.into_body().collect().await.unwrap();
        assert_eq!(small.trailers().unwrap()["grpc-status"], "14");
    }
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    // Too large: all of it reaches the first client, trailers included; the retry is
    // refused, not executed.
    let large = service.clone().oneshot(request(9)).await.unwrap();
    let large = large.into_body().collect().await.unwrap();
    assert_eq!(large.trailers().unwrap()["grpc-status"], "14");
    assert_eq!(large.to_bytes().len(), 900);
    let retry = service.oneshot(request(9)).await.unwrap();
    assert_eq!(retry.headers()["grpc-status"], "9"); // FAILED_PRECONDITION
    let message = retry.headers()["grpc-message"].to_str().unwrap();
    assert!(message.starts_with("response_not_replayable"), "{message}");
    assert_eq!(calls.load(Ordering::SeqCst), 3);
}

/// A retry whose path is spelled another way (`%31` for `1`, as a client or a proxy may
/// encode it) reaches the same handler through the router, and so names the same record:
/// replayed, not executed again. A path that differs in meaning (`%2F` is not `/`) stays
/// another scope.
#[tokio::test]
async fn a_retry_with_its_path_spelled_another_way_replays() {
    let store: Arc<dyn Store> = Arc::new(tower_idempotency::MemoryStore::new());
    let calls = Arc::new(AtomicUsize::new(0));
    let handler = {
        let calls = calls.clone();
        move |axum::extract::Path(id): axum::extract::Path<String>| async move {
            let call = calls.fetch_add(1, Ordering::SeqCst) + 1;
            (StatusCode::CREATED, format!("refund {call} of order {id}"))
        }
    };
    let app = Router::new()
        .route("/orders/{id}/refunds", routing::post(handler))
        .layer(layer(&store));
    let refund = |path: &str| {
        Request::post(path)
            .header("idempotency-key", "refund-1")
            .body(Body::empty())
            .unwrap()
    };
    let first = read(
        app.clone()
            .oneshot(refund("/orders/1/refunds"))
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(first.body, "refund 1 of order 1");
    for spelling in [
        "/orders/%31/refunds",
        "/%6Frders/1/refunds",
        "/orders/1/%72efunds",
    ] {
        let retry = read(app.clone().oneshot(refund(spelling)).await.unwrap()).await;
        assert!(retry.replayed(), "{spelling}: {:?}", retry.status);
        assert_eq!(retry.body, first.body, "{spelling}");
    }
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    // Another order, whatever it is spelled like: its own record.
    let other = read(app.oneshot(refund("/orders/a%2Fb/refunds")).await.unwrap()).await;
    assert!(!other.replayed());
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}

/// A path sent with bytes a URI may not hold raw (`é`, `{`, `"`, which hyper takes as they
/// are) and its retry sent percent-encoded, as a client library or a proxy re-encoding it
/// sends it, reach the handler as the same path: one record, replayed. They were two
/// scopes, and the retry executed again.
#[tokio::test]
async fn a_retry_with_its_path_percent_encoded_where_it_was_sent_raw_replays() {
    let store: Arc<dyn Store> = Arc::new(tower_idempotency::MemoryStore::new());
    let calls = Arc::new(AtomicUsize::new(0));
    let handler = {
        let calls = calls.clone();
        move |axum::extract::Path(id): axum::extract::Path<String>| async move {
            let call = calls.fetch_add(1, Ordering::SeqCst) + 1;
            (StatusCode::CREATED, format!("refund {call} of order {id}"))
        }
    };
    let app = Router::new()
        .route("/orders/{id}/refunds", routing::post(handler))
        .layer(layer(&store));
    let refund = |path: &str, key: &str| {
        Request::post(path)
            .header("idempotency-key", key)
            .body(Body::empty())
            .unwrap()
    };
    for (key, raw, encoded) in [
        (
            "raw-1",
            "/orders/caf\u{e9}/refunds",
            "/orders/caf%C3%A9/refunds",
        ),
        (
            "raw-2",
            "/orders/caf\u{e9}/refunds",
            "/orders/caf%c3%a9/refunds",
        ),
        ("raw-3", "/orders/a{b}/refunds", "/orders/a%7Bb%7D/refunds"),
        ("raw-4", "/orders/a\"b/refunds", "/orders/a%22b/refunds"),
    ] {
        let calls_before = calls.load(Ordering::SeqCst);
        let first = read(app.clone().oneshot(refund(raw, key)).await.unwrap()).await;
        assert_eq!(first.status, StatusCode::CREATED, "{raw}");
        let retry = read(app.clone().oneshot(refund(encoded, key)).await.unwrap()).await;
        assert!(retry.replayed(), "{raw} then {encoded}: {:?}", retry.body);
        assert_eq!(retry.body, first.body);
        assert_eq!(calls.load(Ordering::SeqCst), calls_before + 1, "{encoded}");
    }
}

/// Durations the stores cannot reach (a TTL meant as "forever", `Duration::MAX`), and an
/// empty set of methods (nothing protected), are refused when the layer is configured,
/// with a message naming the setting. A `Duration::MAX` TTL, taken, overflowed the memory
/// store's clock in its completion after the handler ran, leaving the key in progress
/// until its lease ended, and the retry executed again. (The longest accepted values work
/// on every store: `the_longest_durations_are_kept`.)
#[tokio::test]
async fn durations_past_what_a_store_keeps_are_refused_when_configured() {
    let fresh = || IdempotencyLayer::new(tower_idempotency::MemoryStore::new());
    for (message, name) in [
        (
            support::refusal("ttl(MAX)", || fresh().ttl(Duration::MAX)),
            "ttl",
        ),
        (
            support::refusal("ttl(ZERO)", || fresh().ttl(Duration::ZERO)),
            "ttl",
        ),
        (
            support::refusal("lease(MAX)", || fresh().lease(Duration::MAX)),
            "lease",
        ),
        (
            support::refusal("wait(MAX)", || fresh().wait_for_original(Duration::MAX)),
            "wait",
        ),
        (
            support::refusal("methods([])", || fresh().methods([])),
            "methods",
        ),
        (
            support::refusal("a long endpoint_name", || {
                fresh().endpoint_name("e".repeat(tower_idempotency::MAX_SCOPE_PART_LEN + 1))
            }),
            "endpoint_name",
        ),
        (
            support::refusal("an endpoint_name with a NUL", || {
                fresh().endpoint_name("create\0order")
            }),
            "endpoint_name",
        ),
    ] {
        assert!(message.contains(name), "{message}");
    }
}

/// A record kept for the longest TTL, under the longest lease and wait, on this store.
async fn the_longest_durations_are_kept(store: Arc<dyn Store>) {
    let longest = tower_idempotency::LONGEST_DURATION;
    let handler = Handler::default();
    let layer = layer(&store)
        .ttl(longest)
        .lease(longest)
        .wait_for_original(longest);
    let app = router(&handler, layer);
    send(&app, post("/pay").key("longest"))
        .await
        .assert_executed();
    assert!(send(&app, post("/pay").key("longest")).await.replayed());
    assert_eq!(handler.executions(), 1);
}

/// What a store in front of another fails: every record past `refuses_over` bytes of body,
/// however often it is sent (as Redis refuses one past its `proto-max-bulk-len`,
/// PostgreSQL one past 1 GiB), saying it never takes it or not (`refused`), and every
/// operation while an outage lasts, its windows counted from the first completion sent.
#[derive(Debug, Default)]
struct Faulty {
    refuses_over: Option<usize>,
    refused: bool,
    /// Every release fails (not saying the store never takes it).
    failing_releases: bool,
    outages: Vec<(Duration, Duration)>,
    first_completion: std::sync::Mutex<Option<std::time::Instant>>,
    completions: AtomicUsize,
}

impl Faulty {
    /// Records past 1 000 bytes of body fail, `refused` or not.
    fn refusing_large_records(refused: bool) -> Self {
        Self {
            refuses_over: Some(1000),
            refused,
            ..Self::default()
        }
    }

    /// Away during each window (from, to), counted from the first completion sent.
    fn away(outages: &[(Duration, Duration)]) -> Self {
        Self {
            outages: outages.to_vec(),
            ..Self::default()
        }
    }

    fn around(self, inner: Arc<dyn Store>) -> Arc<Wrapped<Self>> {
        Wrapped::new(inner, self)
    }
}

fn backend_error(what: &str) -> tower_idempotency::store::Error {
    tower_idempotency::store::Error::Backend(what.into())
}

impl Hooks for Faulty {
    fn before(&self, operation: Operation<'_>) -> tower_idempotency::store::Result<()> {
        let now = std::time::Instant::now();
        let completing = matches!(operation, Operation::Complete(_));
        if completing {
            self.completions.fetch_add(1, Ordering::SeqCst);
        }
        let mut first = self.first_completion.lock().unwrap();
        if completing && first.is_none() {
            *first = Some(now);
        }
        let away = first.is_some_and(|first| {
            let since = now - first;
            let mut windows = self.outages.iter();
            windows.any(|(from, to)| (*from..*to).contains(&since))
        });
        drop(first);
        if away {
            return Err(backend_error("the store is away"));
        }
        match operation {
            Operation::Release if self.failing_releases => Err(backend_error("release failed")),
            Operation::Complete(response)
                if self
                    .refuses_over
                    .is_some_and(|max| response.body.len() > max) =>
            {
                let what = "value past the store's limit";
                Err(if self.refused {
                    tower_idempotency::store::Error::Refused(what.into())
                } else {
                    backend_error(what)
                })
            }
            _ => Ok(()),
        }
    }
}

/// The lease of the [`Faulty`] cases, and an outage past half of it.
const FAULTY_LEASE: Duration = Duration::from_secs(3);
const PAST_HALF_THE_LEASE: Duration = Duration::from_secs(2);

fn not_replayable_201() -> serde_json::Value {
    serde_json::json!({"error": "response_not_replayable", "status": 201})
}

/// The store renews the lease but refuses the record for good: the request was never
/// answered (its completion retried for as long as the renewed lease lasted, that is for
/// ever, holding the key); now its client gets its response, and its retries a refusal to
/// replay it, never a second execution. A store that says it never takes the record has
/// it tried once; one that does not, until it has renewed the lease for a whole lease.
async fn a_record_the_store_refuses_for_good_is_refused_to_every_retry(store: Arc<dyn Store>) {
    for refused in [true, false] {
        let faulty = Faulty::refusing_large_records(refused).around(store.clone());
        let wrapped: Arc<dyn Store> = faulty.clone();
        let handler = Handler::default();
        let app = router(&handler, layer(&wrapped).lease(FAULTY_LEASE));
        let key = format!("refused-{refused}");
        let big = || post("/pay").key(&key).header("x-body-len", "2000");
        let first = tokio::time::timeout(Duration::from_secs(15), send(&app, big()))
            .await
            .expect("answered, not retried for as long as the lease is renewed");
        assert_eq!(
            (first.status, first.body.len()),
            (StatusCode::CREATED, 2000)
        );
        // The record, then the refusal to replay it.
        let completions = faulty.hooks.completions.load(Ordering::SeqCst);
        if refused {
            assert_eq!(completions, 2);
        } else {
            assert!(completions > 2, "{completions}");
        }
        for _ in 0..2 {
            let retry = send(&app, big()).await;
            assert_eq!(retry.status, StatusCode::CONFLICT);
            assert_eq!(retry.json(), not_replayable_201());
        }
        // A record the store takes is recorded and replayed as ever.
        let small = format!("small-{refused}");
        assert!(!send(&app, post("/pay").key(&small)).await.replayed());
        assert!(send(&app, post("/pay").key(&small)).await.replayed());
        assert_eq!(handler.executions(), 2);
    }
}

/// A store that refuses the refusal to replay too (every record past 10 bytes, saying so):
/// the refusal was retried, the lease renewed, for ever; now the client gets its response,
/// the store having been sent the record and the refusal once each. (The key then frees
/// itself as the lease runs out, as after a crash: nothing else can be recorded.) The same
/// for a response over `max_response_body`, whose record is the refusal.
async fn a_store_that_refuses_every_record_never_holds_the_request(store: Arc<dyn Store>) {
    for (max_response_body, completions) in [(1 << 20, 2), (1000, 1)] {
        let faults = Faulty {
            refuses_over: Some(10),
            refused: true,
            ..Faulty::default()
        };
        let faulty = faults.around(store.clone());
        let wrapped: Arc<dyn Store> = faulty.clone();
        let handler = Handler::default();
        let layer = layer(&wrapped)
            .lease(FAULTY_LEASE)
            .max_response_body(max_response_body);
        let app = router(&handler, layer);
        let key = format!("all-refused-{completions}");
        let big = post("/pay").key(&key).header("x-body-len", "2000");
        let first = tokio::time::timeout(Duration::from_secs(15), send(&app, big))
            .await
            .expect("answered, not retried for as long as the lease is renewed");
        assert_eq!(
            (first.status, first.body.len()),
            (StatusCode::CREATED, 2000)
        );
        let sent = faulty.hooks.completions.load(Ordering::SeqCst);
        assert_eq!(sent, completions);
    }
}

/// Delays claims, their answers and renewals by what they are set to (the next renewal
/// once, or every one).
#[derive(Debug, Default)]
struct Slow {
    claims_ms: AtomicU64,
    claim_answers_ms: AtomicU64,
    next_renewal_ms: AtomicU64,
    renewals_ms: AtomicU64,
}

impl Hooks for Slow {
    fn claim_delay(&self) -> Duration {
        Duration::from_millis(self.claims_ms.load(Ordering::SeqCst))
    }

    fn claim_answer_delay(&self) -> Duration {
        Duration::from_millis(self.claim_answers_ms.load(Ordering::SeqCst))
    }

    fn extend_delay(&self) -> Duration {
        let next = self.next_renewal_ms.swap(0, Ordering::SeqCst);
        Duration::from_millis(next.max(self.renewals_ms.load(Ordering::SeqCst)))
    }
}

/// `store` behind [`Slow`] hooks, and the test handler behind a layer `configured` on it.
fn slowed(
    store: Arc<dyn Store>,
    configured: impl FnOnce(IdempotencyLayer) -> IdempotencyLayer,
) -> (Arc<Wrapped<Slow>>, Handler, Router) {
    let slow = Wrapped::new(store, Slow::default());
    let wrapped: Arc<dyn Store> = slow.clone();
    let handler = Handler::default();
    let app = router(&handler, configured(layer(&wrapped)));
    (slow, handler, app)
}

/// A claim answered a whole lease after it was sent (held up behind a lock, on a slow
/// connection) is not executed: `503`, and the claim released at once, so the retry
/// executes without waiting for the lease. It was executed, its lease perhaps over by the
/// store's clock, while a retry could claim the key and execute too.
async fn a_claim_answered_after_its_lease_is_not_executed(store: Arc<dyn Store>) {
    let (slow, handler, app) = slowed(store, |layer| layer.lease(Duration::from_secs(1)));
    slow.hooks.claims_ms.store(1300, Ordering::SeqCst);
    let late = send(&app, post("/pay").key("answered-late")).await;
    assert_eq!(late.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(handler.executions(), 0);
    slow.hooks.claims_ms.store(0, Ordering::SeqCst);
    // Released in the background, well before the claim's own lease (a second from when
    // the store took it) runs out.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let retry = send(&app, post("/pay").key("answered-late")).await;
    assert_eq!(retry.status, StatusCode::CREATED, "{:?}", retry.json());
    assert_eq!(handler.executions(), 1);
}

/// A claim answered late, but within its lease, is renewed at once: its lease ran from
/// when the store took it, and the renewals are scheduled from when it was sent, not
/// answered. Scheduled from its answer, the first renewal came after the lease had run
/// out, and a duplicate sent meanwhile executed.
async fn a_claim_answered_late_is_renewed_in_time(store: Arc<dyn Store>) {
    let lease = Duration::from_millis(1500);
    let (slow, handler, app) = slowed(store, |layer| layer.lease(lease));
    slow.hooks.claim_answers_ms.store(1100, Ordering::SeqCst);
    let original = spawn_send(&app, post("/pay").key("late").header("x-sleep-ms", "2000"));
    tokio::time::sleep(Duration::from_millis(1200)).await;
    slow.hooks.claim_answers_ms.store(0, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let duplicate = send(&app, post("/pay").key("late")).await;
    assert_eq!(
        duplicate.status,
        StatusCode::CONFLICT,
        "{:?}",
        duplicate.json()
    );
    assert_eq!(handler.executions(), 1);
    original.await.unwrap().assert_executed();
}

/// With `fail_open`, a claim answered after its lease is not executed either: `503`. It was
/// executed unprotected while its key was released behind it, and the retry executed too.
async fn a_claim_answered_after_its_lease_is_not_executed_failing_open(store: Arc<dyn Store>) {
    let (slow, handler, app) = slowed(store, |layer| {
        layer.lease(Duration::from_secs(1)).fail_open()
    });
    slow.hooks.claims_ms.store(1300, Ordering::SeqCst);
    let late = send(&app, post("/pay").key("late-open")).await;
    assert_eq!(late.status, StatusCode::SERVICE_UNAVAILABLE);
    slow.hooks.claims_ms.store(0, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(200)).await;
    send(&app, post("/pay").key("late-open"))
        .await
        .assert_executed();
    assert_eq!(handler.executions(), 1);
}

/// Renewals a store answers slowly, but applies (700 ms each under a 1.5 s lease), keep the
/// lease: each counts when it lands, the next sent when due all the same. Given up at the
/// next one's time, none of them counted, and a duplicate executed under the handler.
async fn renewals_answered_slowly_keep_the_lease(store: Arc<dyn Store>) {
    let lease = Duration::from_millis(1500);
    let (slow, handler, app) = slowed(store, |layer| layer.lease(lease));
    slow.hooks.renewals_ms.store(700, Ordering::SeqCst);
    let original = spawn_send(
        &app,
        post("/pay")
            .key("slow-renewals")
            .header("x-sleep-ms", "4000"),
    );
    tokio::time::sleep(Duration::from_millis(2600)).await;
    let duplicate = send(&app, post("/pay").key("slow-renewals")).await;
    assert_eq!(
        duplicate.status,
        StatusCode::CONFLICT,
        "{:?}",
        duplicate.json()
    );
    original.await.unwrap().assert_executed();
    assert_eq!(handler.executions(), 1);
}

/// A renewal that hangs (sent on a dead connection) does not hold back the next: that one
/// is sent when due all the same and renews the lease, so a duplicate sent after the lease
/// would have run out still finds the key in progress. The renewals were awaited one
/// after another: the lease ran out under the running handler and the duplicate executed.
async fn a_renewal_that_hangs_does_not_hold_back_the_next(store: Arc<dyn Store>) {
    let lease = Duration::from_millis(1500);
    let (slow, handler, app) = slowed(store, |layer| layer.lease(lease));
    slow.hooks.next_renewal_ms.store(60_000, Ordering::SeqCst);
    let original = spawn_send(&app, post("/pay").key("hung").header("x-sleep-ms", "3500"));
    tokio::time::sleep(lease + Duration::from_millis(800)).await;
    let duplicate = send(&app, post("/pay").key("hung")).await;
    assert_eq!(
        duplicate.status,
        StatusCode::CONFLICT,
        "{:?}",
        duplicate.json()
    );
    assert_eq!(handler.executions(), 1);
    original.await.unwrap().assert_executed();
}

/// Writes the store keeps failing (not saying it never takes them) while it applies every
/// renewal are given up, the client answered: a release within the lease (renewing
/// nothing while retried, it lets the lease run out, and the retry executes), a refusal to
/// replay within a lease of renewals after the record's own. Both were retried, the lease
/// renewed beside them, for ever: the client never answered, the key held.
async fn writes_a_store_fails_while_it_renews_are_given_up(store: Arc<dyn Store>) {
    let faulty = Faulty {
        failing_releases: true,
        ..Faulty::default()
    }
    .around(store.clone());
    let wrapped: Arc<dyn Store> = faulty.clone();
    let handler = Handler::default();
    let app = router(&handler, layer(&wrapped).lease(FAULTY_LEASE));
    let failed = || post("/pay").key("unreleased").header("x-status", "503");
    let answer = tokio::time::timeout(FAULTY_LEASE * 2, send(&app, failed()))
        .await
        .expect("a release that keeps failing answered within the lease");
    assert_eq!(answer.status, StatusCode::SERVICE_UNAVAILABLE);
    tokio::time::sleep(FAULTY_LEASE).await;
    let retry = send(&app, failed()).await;
    assert!(!retry.replayed());
    assert_eq!(handler.executions(), 2);

    // Both the record and the refusal to replay it fail, not refused for good.
    let faulty = Faulty {
        refuses_over: Some(10),
        ..Faulty::default()
    }
    .around(store.clone());
    let wrapped: Arc<dyn Store> = faulty.clone();
    let app = router(&handler, layer(&wrapped).lease(FAULTY_LEASE));
    let big = post("/pay").key("unrecorded").header("x-body-len", "2000");
    let answer = tokio::time::timeout(FAULTY_LEASE * 5, send(&app, big))
        .await
        .expect("a refusal that keeps failing answered within two leases of renewals");
    assert_eq!(
        (answer.status, answer.body.len()),
        (StatusCode::CREATED, 2000)
    );
}

/// Fails every completion, and every other renewal.
#[derive(Debug, Default)]
struct Flapping {
    renewals: AtomicUsize,
}

impl Hooks for Flapping {
    fn before(&self, operation: Operation<'_>) -> tower_idempotency::store::Result<()> {
        match operation {
            Operation::Complete(_) => Err(backend_error("completions fail")),
            Operation::Extend if self.renewals.fetch_add(1, Ordering::SeqCst) % 2 == 1 => {
                Err(backend_error("every other renewal fails"))
            }
            _ => Ok(()),
        }
    }
}

/// A completion the store keeps failing while its renewals fail and are applied by turns
/// is given up within a few leases, and the client answered: each failed renewal started
/// the count of applied ones again, each applied one moved the lease on, and the record was
/// retried for ever, the client unanswered.
#[tokio::test]
async fn a_write_failing_while_renewals_flap_is_given_up() {
    let flapping = Wrapped::new(
        Arc::new(tower_idempotency::MemoryStore::new()),
        Flapping::default(),
    );
    let wrapped: Arc<dyn Store> = flapping.clone();
    let handler = Handler::default();
    // Long enough that a renewal is applied within each stretch of the write's retries.
    let lease = Duration::from_millis(4500);
    let app = router(&handler, layer(&wrapped).lease(lease));
    let answer = tokio::time::timeout(lease * 5, send(&app, post("/pay").key("flapping")))
        .await
        .expect("answered within a few leases");
    assert_eq!(answer.status, StatusCode::CREATED);
    assert!(flapping.hooks.renewals.load(Ordering::SeqCst) >= 4);
}

/// Completions fail while `failing`; the `hung`-th renewal (from 1) hangs, as one sent on a
/// dead connection would; the others are applied at once.
#[derive(Debug, Default)]
struct OneRenewalHung {
    failing: std::sync::atomic::AtomicBool,
    renewals: AtomicUsize,
    hung: usize,
}

impl Hooks for OneRenewalHung {
    fn before(&self, operation: Operation<'_>) -> tower_idempotency::store::Result<()> {
        match operation {
            Operation::Complete(_) if self.failing.load(Ordering::SeqCst) => {
                Err(backend_error("completions fail for now"))
            }
            _ => Ok(()),
        }
    }

    fn extend_delay(&self) -> Duration {
        let n = self.renewals.fetch_add(1, Ordering::SeqCst) + 1;
        if n == self.hung {
            Duration::from_secs(60)
        } else {
            Duration::ZERO
        }
    }
}

/// A record the store fails through a short blip, while one renewal hangs, is not taken as
/// refused for good: a renewal unanswered when the next is due counts as failed, so the
/// store has not applied every renewal for a lease. The hung renewal counted as nothing
/// until a lease after it was sent, the record was taken as refused, and the retry of a
/// payment that succeeded got `409 response_not_replayable`.
#[tokio::test]
async fn a_hung_renewal_does_not_make_a_record_failing_for_a_while_refused() {
    let hooks = OneRenewalHung {
        hung: 2,
        ..OneRenewalHung::default()
    };
    hooks.failing.store(true, Ordering::SeqCst);
    let wrapped = Wrapped::new(Arc::new(tower_idempotency::MemoryStore::new()), hooks);
    let store: Arc<dyn Store> = wrapped.clone();
    let handler = Handler::default();
    let app = router(&handler, layer(&store).lease(Duration::from_millis(1500)));
    let recovering = {
        let wrapped = wrapped.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(2000)).await;
            wrapped.hooks.failing.store(false, Ordering::SeqCst);
        })
    };
    send(&app, post("/pay").key("hung-blip"))
        .await
        .assert_executed();
    recovering.await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let retry = send(&app, post("/pay").key("hung-blip")).await;
    assert_eq!(
        (retry.status, retry.replayed()),
        (StatusCode::CREATED, true),
        "{:?}",
        retry.json()
    );
    assert_eq!(handler.executions(), 1);
}

/// An outage from the completion on, longer than half the lease but shorter than it, fails
/// the renewals too: the record is written once the store is back, not given up for a
/// refusal to replay as one the store refuses for good would be.
async fn an_outage_past_half_the_lease_still_records_the_response(store: Arc<dyn Store>) {
    let outage = [(Duration::ZERO, PAST_HALF_THE_LEASE)];
    outage_still_records_the_response(store, &outage, "outage").await;
}

/// The same with one renewal let through in the middle of the outage: the write's retries
/// miss it, and the renewals fail again after it.
async fn an_outage_with_one_renewal_through_still_records_the_response(store: Arc<dyn Store>) {
    let ms = Duration::from_millis;
    let outage = [(Duration::ZERO, ms(900)), (ms(1100), ms(2700))];
    outage_still_records_the_response(store, &outage, "flapping").await;
}

async fn outage_still_records_the_response(
    store: Arc<dyn Store>,
    outage: &[(Duration, Duration)],
    key: &str,
) {
    let store: Arc<dyn Store> = Faulty::away(outage).around(store);
    let handler = Handler::default();
    let app = router(&handler, layer(&store).lease(FAULTY_LEASE));
    let first = send(&app, post("/pay").key(key)).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let retry = send(&app, post("/pay").key(key)).await;
    assert!(retry.replayed(), "{:?}: {:?}", retry.status, retry.json());
    assert_eq!(retry.status, StatusCode::CREATED);
    assert_eq!(retry.body, first.body);
    assert_eq!(handler.executions(), 1);
}

/// A response over `max_response_body` is recorded as a refusal to replay it; an outage past
/// half the lease must not cost that record: once the lease ran out, a retry would execute
/// again.
async fn an_outage_past_half_the_lease_still_records_a_refusal_to_replay(store: Arc<dyn Store>) {
    let outage = [(Duration::ZERO, PAST_HALF_THE_LEASE)];
    let store: Arc<dyn Store> = Faulty::away(&outage).around(store);
    let handler = Handler::default();
    let layer = layer(&store).lease(FAULTY_LEASE).max_response_body(1000);
    let app = router(&handler, layer);
    let big = || post("/pay").key("too-large").header("x-body-len", "2000");
    let started = tokio::time::Instant::now();
    let first = send(&app, big()).await;
    assert_eq!(
        (first.status, first.body.len()),
        (StatusCode::CREATED, 2000)
    );
    // Past the lease: a key given up meanwhile would be free again.
    tokio::time::sleep_until(started + FAULTY_LEASE + Duration::from_millis(500)).await;
    let retry = send(&app, big()).await;
    assert_eq!(retry.status, StatusCode::CONFLICT);
    assert_eq!(retry.json(), not_replayable_201());
    assert_eq!(handler.executions(), 1);
}
