//! The client's retry rules against the real `payments` example, through hyper-util's
//! client and reqwest: an in-progress `409` is waited out and answered by the original's
//! replay; a key reused with another body (`409` in the JSON profile, `422` in the IETF
//! one) is returned after one attempt; reqwest bodies that cannot be cloned are refused
//! before any attempt.

#[macro_use]
mod support;

use std::time::Duration;

use bytes::Bytes;
use http::StatusCode;
use http_body_util::Full;
use serde_json::Value;
use support::{
    client::{Answer, Clients, Http},
    payments::{charge, fresh_key, slow_charge, Api, ExampleProcess},
};
use tower_idempotency::client::{
    Backoff, ClientError, Failure, IdempotentCall, IdempotentClientLayer,
};

const USER: &str = "client-rules";

fn clients() -> Clients {
    Clients::new(
        IdempotentClientLayer::new()
            .backoff(Backoff::new(
                Duration::from_millis(10),
                Duration::from_millis(200),
            ))
            .max_attempts(10)
            .deadline(Duration::from_secs(20)),
    )
}

/// `POST /v1/payments` with `key` and `body` through the idempotent client over `http`.
async fn pay(http: Http, api: &Api, key: &str, body: &Value) -> Answer {
    let url = format!("http://{}/v1/payments", api.addr());
    clients().post(http, &url, Some(key), USER, body).await
}

#[tokio::test]
async fn hyper_waits_out_an_in_progress_original_and_gets_its_replay() {
    waits_out_an_in_progress_original(Http::Hyper).await;
}

#[tokio::test]
async fn reqwest_waits_out_an_in_progress_original_and_gets_its_replay() {
    waits_out_an_in_progress_original(Http::Reqwest).await;
}

async fn waits_out_an_in_progress_original(http: Http) {
    let server = ExampleProcess::start(&[]).await;
    let api = server.api();
    let (key, slow) = (fresh_key(), slow_charge(1500));
    let original = api.pay_in_background(&key, USER, &slow);
    api.wait_for_payments(1).await;

    let answer = pay(http, api, &key, &slow).await;
    let original = original.await.expect("the original");
    assert_eq!(answer.status, StatusCode::CREATED, "{answer:?}");
    assert_eq!(answer.body, original.body, "{answer:?}");
    assert!(answer.call.replayed, "{answer:?}");
    assert!(answer.call.attempts >= 2, "{answer:?}");
    assert_eq!(answer.call.key, key);
    assert_eq!(api.stats().await.payments_executed, 1);
}

#[tokio::test]
async fn hyper_returns_a_reused_key_after_one_attempt() {
    returns_a_reused_key_after_one_attempt(Http::Hyper, &[], 409).await;
}

#[tokio::test]
async fn reqwest_returns_a_reused_key_after_one_attempt() {
    returns_a_reused_key_after_one_attempt(Http::Reqwest, &[], 409).await;
}

#[tokio::test]
async fn hyper_returns_an_ietf_422_after_one_attempt() {
    let ietf = [("IDEMPOTENCY_PROFILE", "ietf")];
    returns_a_reused_key_after_one_attempt(Http::Hyper, &ietf, 422).await;
}

#[tokio::test]
async fn reqwest_returns_an_ietf_422_after_one_attempt() {
    let ietf = [("IDEMPOTENCY_PROFILE", "ietf")];
    returns_a_reused_key_after_one_attempt(Http::Reqwest, &ietf, 422).await;
}

async fn returns_a_reused_key_after_one_attempt(http: Http, env: &[(&str, &str)], status: u16) {
    let server = ExampleProcess::start(env).await;
    let api = server.api();
    let key = fresh_key();
    api.pay(&key, USER, &charge(100))
        .await
        .assert_payment(100, "usd");

    let answer = pay(http, api, &key, &charge(200)).await;
    assert_eq!(answer.status.as_u16(), status, "{answer:?}");
    let body: Value = serde_json::from_slice(&answer.body).expect("a JSON error");
    let code = body["code"].as_str().or(body["error"].as_str());
    assert_eq!(code, Some("idempotency_key_reused_with_different_params"));
    assert_eq!((answer.call.attempts, answer.call.replayed), (1, false));
    assert_eq!(api.stats().await.payments_executed, 1);
}

#[tokio::test]
async fn reqwest_refuses_a_body_it_cannot_send_twice() {
    let server = ExampleProcess::start(&[]).await;
    let stream = http_body_util::combinators::BoxBody::new(Full::new(Bytes::from("{}")));
    let mut extensions = http::Extensions::new();
    let clients = clients();
    let request = clients
        .reqwest()
        .post(format!("http://{}/v1/payments", server.addr()))
        .body(reqwest::Body::wrap(stream))
        .build()
        .expect("a request");
    let error = clients
        .reqwest()
        .execute_with_extensions(request, &mut extensions)
        .await
        .expect_err("refused");
    let reqwest_middleware::Error::Middleware(error) = error else {
        panic!("not the client's error: {error:?}");
    };
    let error = error
        .downcast_ref::<ClientError<reqwest_middleware::Error>>()
        .expect("a ClientError");
    assert!(
        matches!(error.failure(), Failure::BodyNotReplayable),
        "{error}"
    );
    let call = error.call().expect("the call");
    assert_eq!(call.attempts, 0);
    assert_eq!(extensions.get::<IdempotentCall>(), Some(call));
    assert_eq!(server.api().stats().await.payments_executed, 0);
}

/// A zero deadline or attempt timeout would fail every call, some after the server took
/// it: refused when configured, with a message naming the setting.
#[test]
fn zero_durations_are_refused_when_configured() {
    let deadline = support::refusal("deadline(ZERO)", || {
        IdempotentClientLayer::new().deadline(Duration::ZERO)
    });
    let attempt = support::refusal("attempt_timeout(ZERO)", || {
        IdempotentClientLayer::new().attempt_timeout(Duration::ZERO)
    });
    for (message, name) in [(deadline, "deadline"), (attempt, "attempt_timeout")] {
        assert!(message.contains(name), "{message}");
    }
}

/// The client's retry log and its error name the call's attempts, never its key, which
/// anyone reading the logs could send again: the log shows the key's digest.
#[tokio::test]
async fn the_client_logs_no_key() {
    use std::sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    };
    use tower::{Layer, ServiceExt};
    let (logs, _guard) = support::logs::Logs::capture();
    let attempts = Arc::new(AtomicUsize::new(0));
    let server = {
        let attempts = attempts.clone();
        tower::service_fn(move |_: http::Request<Full<Bytes>>| {
            // A 503, then no answer in time: retried, then given up.
            let first = attempts.fetch_add(1, Ordering::SeqCst) == 0;
            async move {
                if !first {
                    tokio::time::sleep(Duration::from_secs(5)).await;
                }
                let answer = http::Response::builder().status(StatusCode::SERVICE_UNAVAILABLE);
                Ok::<_, std::convert::Infallible>(answer.body(Full::new(Bytes::new())).unwrap())
            }
        })
    };
    let client = IdempotentClientLayer::new()
        .backoff(Backoff::new(
            Duration::from_millis(1),
            Duration::from_millis(1),
        ))
        .max_attempts(2)
        .attempt_timeout(Duration::from_millis(100))
        .layer(server);
    let request = http::Request::post("http://processor/v1/payments")
        .header("idempotency-key", "client-key-0000-secret")
        .body(Full::new(Bytes::new()))
        .unwrap();
    let error = client
        .oneshot(request)
        .await
        .expect_err("no answer in time");
    assert_eq!(attempts.load(Ordering::SeqCst), 2);
    let logs = logs.dump();
    assert!(logs.contains("idempotent call: retrying"), "{logs}");
    assert!(!logs.contains("client-key-0000-secret"), "{logs}");
    assert!(
        !error.to_string().contains("client-key-0000-secret"),
        "{error}"
    );
}
