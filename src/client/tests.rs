//! The client's loop through a Tower service that answers from a script, on tokio's paused
//! clock: what is retried, with which key, how long it waits, and when it gives up.

use std::{
    convert::Infallible,
    sync::{Arc, Mutex},
    time::{Duration, SystemTime},
};

use bytes::Bytes;
use http::{header::RETRY_AFTER, Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use tokio::time::Instant;
use tower::{service_fn, Layer, ServiceExt};

use super::*;
use crate::REPLAYED_HEADER;

type Reply = Result<Response<Full<Bytes>>, &'static str>;

/// What the fake server saw: every attempt's key.
#[derive(Clone, Default)]
struct Seen(Arc<Mutex<Vec<Option<String>>>>);

impl Seen {
    fn keys(&self) -> Vec<Option<String>> {
        self.0.lock().unwrap().clone()
    }
    fn attempts(&self) -> usize {
        self.0.lock().unwrap().len()
    }
}

/// The client under test, boxed.
type Client = tower::util::BoxService<
    Request<Full<Bytes>>,
    Response<crate::ResponseBody<Full<Bytes>>>,
    ClientError<&'static str>,
>;

/// A client whose server answers attempt `n` with `script(n)` (from 0), and what it saw.
fn scripted(
    layer: IdempotentClientLayer,
    script: impl Fn(usize) -> Reply + Clone + Send + Sync + 'static,
) -> (Client, Seen) {
    let seen = Seen::default();
    let log = seen.clone();
    let server = service_fn(move |request: Request<Full<Bytes>>| {
        let mut keys = log.0.lock().unwrap();
        let key = request.headers().get("idempotency-key");
        keys.push(key.map(|k| k.to_str().unwrap().to_owned()));
        let reply = script(keys.len() - 1);
        async move { reply }
    });
    (Client::new(layer.layer(server)), seen)
}

/// A layer whose backoff is small and whose limits are wide, unless a test narrows them.
fn layer() -> IdempotentClientLayer {
    IdempotentClientLayer::new()
        .backoff(Backoff::new(
            Duration::from_millis(10),
            Duration::from_millis(100),
        ))
        .max_attempts(10)
}

fn answer(status: u16, body: &str) -> Reply {
    let mut response = Response::new(Full::new(Bytes::from(body.to_owned())));
    *response.status_mut() = StatusCode::from_u16(status).unwrap();
    Ok(response)
}

fn with_header(reply: Reply, name: &'static str, value: &str) -> Reply {
    let mut response = reply?;
    response.headers_mut().insert(name, value.parse().unwrap());
    Ok(response)
}

fn in_progress() -> Reply {
    with_header(
        answer(409, r#"{"error":"request_in_progress","retry_after":1}"#),
        "retry-after",
        "1",
    )
}

fn post() -> Request<Full<Bytes>> {
    Request::post("http://payments.test/v1/payments")
        .body(Full::new(Bytes::from_static(b"{\"amount\":1}")))
        .unwrap()
}

fn call_of<B>(response: &Response<B>) -> IdempotentCall {
    response
        .extensions()
        .get::<IdempotentCall>()
        .expect("an IdempotentCall")
        .clone()
}

#[tokio::test(start_paused = true)]
async fn one_key_is_made_before_the_first_attempt_and_sent_on_every_retry() {
    let (client, seen) = scripted(layer(), |n| match n {
        0 => Err("connection reset"),
        1 => answer(503, ""),
        2 => in_progress(),
        _ => answer(201, r#"{"id":"pay_1"}"#),
    });
    let response = client.oneshot(post()).await.unwrap();
    assert_eq!(response.status(), StatusCode::CREATED);
    let keys = seen.keys();
    assert_eq!(keys.len(), 4);
    let key = keys[0].clone().expect("a key on the first attempt");
    assert!(
        keys.iter().all(|k| k.as_deref() == Some(key.as_str())),
        "{keys:?}"
    );
    let uuid = uuid::Uuid::parse_str(&key).expect("a UUID");
    assert_eq!(uuid.get_version_num(), 4);
    let call = call_of(&response);
    assert_eq!((call.key, call.attempts, call.replayed), (key, 4, false));
}

#[tokio::test(start_paused = true)]
async fn a_key_the_request_has_is_kept() {
    let (client, seen) = scripted(layer(), |n| match n {
        0 => answer(502, ""),
        _ => with_header(answer(201, "{}"), REPLAYED_HEADER, "true"),
    });
    let mut request = post();
    request
        .headers_mut()
        .insert("idempotency-key", "order-42".parse().unwrap());
    let response = client.oneshot(request).await.unwrap();
    assert_eq!(
        seen.keys(),
        [Some("order-42".into()), Some("order-42".into())]
    );
    let call = call_of(&response);
    assert_eq!(
        (call.key.as_str(), call.attempts, call.replayed),
        ("order-42", 2, true)
    );
}

#[tokio::test(start_paused = true)]
async fn answers_retrying_cannot_change_are_returned_after_one_attempt() {
    let reused = r#"{"error":"idempotency_key_reused_with_different_params"}"#;
    let ietf_reused = r#"{"type":"about:blank","status":422,"code":"idempotency_key_reused_with_different_params"}"#;
    let cases = [
        (409, reused),
        (422, ietf_reused),
        (400, r#"{"error":"invalid_idempotency_key"}"#),
        (402, r#"{"error":"card_declined"}"#),
        (404, ""),
        (413, r#"{"error":"request_body_too_large","limit":1}"#),
        (500, r#"{"error":"internal"}"#),
        (201, "{}"),
    ];
    for (status, body) in cases {
        let (client, seen) = scripted(layer(), move |_| answer(status, body));
        let response = client.oneshot(post()).await.unwrap();
        assert_eq!(response.status().as_u16(), status);
        assert_eq!(seen.attempts(), 1, "{status} {body}");
        assert_eq!(call_of(&response).attempts, 1);
        // The body the policy read is the body the caller gets.
        let bytes = response.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(bytes, body.as_bytes(), "{status}");
    }
}

#[tokio::test(start_paused = true)]
async fn a_replay_is_never_retried_whatever_its_status() {
    let (client, seen) = scripted(layer(), |_| {
        with_header(answer(503, ""), REPLAYED_HEADER, "true")
    });
    let response = client.oneshot(post()).await.unwrap();
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(seen.attempts(), 1);
    assert!(call_of(&response).replayed);
}

#[tokio::test(start_paused = true)]
async fn a_large_409_is_classified_by_retry_after_and_reaches_the_caller_whole() {
    let big = format!(
        r#"{{"error":"request_in_progress","pad":"{}"}}"#,
        "x".repeat(5000)
    );
    let body = big.clone();
    let (client, seen) = scripted(layer(), move |_| answer(409, &body));
    let response = client.oneshot(post()).await.unwrap();
    assert_eq!(
        seen.attempts(),
        1,
        "no Retry-After, body not read: not retried"
    );
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(bytes, big.as_bytes());

    let body = big.clone();
    let (client, seen) = scripted(layer().max_attempts(3), move |_| {
        with_header(answer(409, &body), "retry-after", "1")
    });
    client.oneshot(post()).await.unwrap();
    assert_eq!(seen.attempts(), 3);
}

/// A body that says it is 100 bytes long and is `chunks` 1000-byte frames of `text`'s
/// bytes, repeated as needed.
struct LyingBody {
    text: Bytes,
    chunks: usize,
    offset: usize,
}

impl http_body::Body for LyingBody {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        if self.chunks == 0 {
            return std::task::Poll::Ready(None);
        }
        self.chunks -= 1;
        let start = self.offset;
        let end = (start + 1000).min(self.text.len());
        self.offset = end;
        let chunk = self.text.slice(start..end);
        std::task::Poll::Ready(Some(Ok(http_body::Frame::data(chunk))))
    }

    fn size_hint(&self) -> http_body::SizeHint {
        http_body::SizeHint::with_exact(100)
    }
}

#[tokio::test(start_paused = true)]
async fn a_409_body_longer_than_it_said_is_not_inspected_and_reaches_the_caller_whole() {
    let text = format!(
        r#"{{"error":"request_in_progress","pad":"{}"}}"#,
        "x".repeat(8960)
    );
    assert_eq!(text.len(), 9000);
    let text = Bytes::from(text);
    let seen = Seen::default();
    let log = seen.clone();
    let served = text.clone();
    let server = service_fn(move |_: Request<Full<Bytes>>| {
        log.0.lock().unwrap().push(None);
        let body = LyingBody {
            text: served.clone(),
            chunks: 9,
            offset: 0,
        };
        let mut response = Response::new(body);
        *response.status_mut() = StatusCode::CONFLICT;
        async move { Ok::<_, &'static str>(response) }
    });
    let response = layer().layer(server).oneshot(post()).await.unwrap();
    assert_eq!(
        seen.attempts(),
        1,
        "read no further than the limit: no Retry-After, not retried"
    );
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(bytes, text);
}

#[tokio::test(start_paused = true)]
async fn a_409_is_classified_by_its_body_over_retry_after() {
    // In progress, as the server words it, without Retry-After (an error renderer may
    // drop it): retried.
    let (client, seen) = scripted(layer(), |n| match n {
        0 => answer(409, r#"{"error":"request_in_progress","retry_after":1}"#),
        _ => answer(201, "{}"),
    });
    let response = client.oneshot(post()).await.unwrap();
    assert_eq!(
        (response.status(), seen.attempts()),
        (StatusCode::CREATED, 2)
    );

    // The key reused for another request, with a Retry-After nonetheless: returned after
    // one attempt, its body intact.
    let reused = r#"{"error":"idempotency_key_reused_with_different_params"}"#;
    let (client, seen) = scripted(layer(), move |_| {
        with_header(answer(409, reused), "retry-after", "1")
    });
    let response = client.oneshot(post()).await.unwrap();
    assert_eq!(seen.attempts(), 1);
    assert_eq!(response.status(), StatusCode::CONFLICT);
    assert_eq!(response.headers()[RETRY_AFTER], "1");
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(bytes, reused.as_bytes());
}

#[tokio::test(start_paused = true)]
async fn retry_after_is_waited_in_seconds_and_as_a_date() {
    let (client, seen) = scripted(layer(), |n| match n {
        0 => with_header(answer(503, ""), "retry-after", "3"),
        _ => answer(201, "{}"),
    });
    let start = Instant::now();
    client.oneshot(post()).await.unwrap();
    assert_eq!(seen.attempts(), 2);
    // The backoff alone would be at most 10 ms.
    assert!(
        start.elapsed() >= Duration::from_secs(3),
        "{:?}",
        start.elapsed()
    );
    assert!(
        start.elapsed() < Duration::from_secs(4),
        "{:?}",
        start.elapsed()
    );

    // An HTTP-date is read against the wall clock, which the paused tokio clock does not
    // move: a date 3 s ahead, in whole seconds, is a wait of about 2 to 3 s.
    let date = httpdate::fmt_http_date(SystemTime::now() + Duration::from_secs(3));
    let (client, _) = scripted(layer(), move |n| match n {
        0 => with_header(answer(429, ""), "retry-after", &date),
        _ => answer(201, "{}"),
    });
    let start = Instant::now();
    client.oneshot(post()).await.unwrap();
    let waited = start.elapsed();
    assert!(waited >= Duration::from_millis(1900), "{waited:?}");
    assert!(
        waited <= Duration::from_secs(3) + Duration::from_millis(10),
        "{waited:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn retry_after_is_capped() {
    let layer = layer().max_retry_after(Duration::from_secs(2));
    let (client, seen) = scripted(layer, |n| match n {
        0 => with_header(answer(503, ""), "retry-after", "3600"),
        _ => answer(201, "{}"),
    });
    let start = Instant::now();
    client.oneshot(post()).await.unwrap();
    assert_eq!(seen.attempts(), 2);
    assert!(
        start.elapsed() >= Duration::from_secs(2),
        "{:?}",
        start.elapsed()
    );
    assert!(
        start.elapsed() < Duration::from_secs(3),
        "{:?}",
        start.elapsed()
    );
}

#[tokio::test(start_paused = true)]
async fn no_attempt_starts_and_no_wait_ends_past_the_deadline() {
    let deadline = Duration::from_secs(1);
    let layer = layer().max_attempts(1000).deadline(deadline);
    let (client, seen) = scripted(layer, |_| answer(503, ""));
    let start = Instant::now();
    let response = client.oneshot(post()).await.unwrap();
    assert!(start.elapsed() < deadline, "{:?}", start.elapsed());
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    let attempts = seen.attempts();
    assert!(attempts > 5 && attempts < 1000, "{attempts} attempts");
    assert_eq!(call_of(&response).attempts as usize, attempts);

    // A Retry-After past the deadline ends the call at once, with that answer.
    let layer = self::layer().deadline(Duration::from_secs(5));
    let (client, seen) = scripted(layer, |_| {
        in_progress().map(|mut r| {
            r.headers_mut().insert(RETRY_AFTER, "10".parse().unwrap());
            r
        })
    });
    let start = Instant::now();
    let response = client.oneshot(post()).await.unwrap();
    assert_eq!(seen.attempts(), 1);
    assert_eq!(start.elapsed(), Duration::ZERO);
    assert_eq!(response.status(), StatusCode::CONFLICT);
}

#[tokio::test(start_paused = true)]
async fn the_longest_deadline_and_retry_after_cap_do_not_overflow() {
    // A deadline too far for the clock to represent: as good as none.
    let layer = layer().deadline(Duration::MAX);
    let (client, seen) = scripted(layer, |n| match n {
        0 => with_header(answer(503, ""), "retry-after", "1"),
        _ => answer(201, "{}"),
    });
    let response = client.oneshot(post()).await.unwrap();
    assert_eq!(
        (response.status(), seen.attempts()),
        (StatusCode::CREATED, 2)
    );

    // A Retry-After too long for the clock, uncapped: a wait past the deadline.
    let layer = self::layer().max_retry_after(Duration::MAX);
    let (client, seen) = scripted(layer, |_| {
        with_header(answer(503, ""), "retry-after", "99999999999999999999")
    });
    let start = Instant::now();
    let response = client.oneshot(post()).await.unwrap();
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!((seen.attempts(), start.elapsed()), (1, Duration::ZERO));

    // Both: each is cut to the longest the setters take; the wait ends at the deadline.
    let layer = self::layer()
        .deadline(Duration::MAX)
        .max_retry_after(Duration::MAX);
    let (client, seen) = scripted(layer, |_| {
        with_header(answer(503, ""), "retry-after", "99999999999999999999")
    });
    let response = client.oneshot(post()).await.unwrap();
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(seen.attempts(), 1);
}

#[test]
fn a_deadline_or_wait_past_what_the_clock_holds_is_no_deadline_or_too_late() {
    let now = Instant::now();
    assert_eq!(retry::deadline_from(now, Duration::MAX), None);
    let deadline = retry::deadline_from(now, Duration::from_secs(1));
    assert_eq!(deadline, Some(now + Duration::from_secs(1)));
    assert!(retry::ends_in_time(now, Duration::MAX, None));
    assert!(!retry::ends_in_time(now, Duration::MAX, deadline));
    assert!(retry::ends_in_time(
        now,
        Duration::from_millis(999),
        deadline
    ));
    assert!(!retry::ends_in_time(now, Duration::from_secs(1), deadline));
    // The timer rounds a sleep up to the next millisecond: this one could wake at the deadline.
    assert!(!retry::ends_in_time(
        now,
        Duration::from_micros(999_500),
        deadline
    ));
}

#[tokio::test(start_paused = true)]
async fn a_hung_attempt_times_out_and_the_deadline_bounds_the_call() {
    let seen = Seen::default();
    let log = seen.clone();
    let server = service_fn(move |_: Request<Full<Bytes>>| {
        log.0.lock().unwrap().push(None);
        std::future::pending::<Result<Response<Full<Bytes>>, Infallible>>()
    });
    let layer = layer()
        .attempt_timeout(Duration::from_millis(300))
        .deadline(Duration::from_secs(1));
    let start = Instant::now();
    let error = layer.layer(server).oneshot(post()).await.unwrap_err();
    assert!(matches!(error.failure(), Failure::TimedOut), "{error}");
    assert!(
        start.elapsed() <= Duration::from_secs(1),
        "{:?}",
        start.elapsed()
    );
    assert!(seen.attempts() >= 3, "{} attempts", seen.attempts());
    assert_eq!(error.call().unwrap().attempts as usize, seen.attempts());
}

#[tokio::test(start_paused = true)]
async fn failures_are_retried_up_to_the_attempt_limit() {
    let (client, seen) = scripted(layer().max_attempts(4), |_| Err("connection refused"));
    let error = client.oneshot(post()).await.unwrap_err();
    assert_eq!(seen.attempts(), 4);
    assert!(matches!(
        error.failure(),
        Failure::Service("connection refused")
    ));
    let call = error.call().unwrap();
    assert_eq!(call.attempts, 4);
    assert_eq!(Some(call.key.clone()), seen.keys()[0]);
}

#[tokio::test(start_paused = true)]
async fn other_methods_pass_through_once_without_a_key() {
    let (client, seen) = scripted(layer(), |_| answer(503, ""));
    let request = Request::get("http://payments.test/v1/stats")
        .body(Full::new(Bytes::new()))
        .unwrap();
    let response = client.oneshot(request).await.unwrap();
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(seen.keys(), [None]);
    assert!(response.extensions().get::<IdempotentCall>().is_none());

    let layer = layer().methods([Method::PUT]);
    let (client, seen) = scripted(layer, |_| answer(503, ""));
    client.oneshot(post()).await.unwrap();
    assert_eq!(seen.keys(), [None]);
}

#[tokio::test(start_paused = true)]
async fn a_replaced_policy_decides() {
    let layer = layer().policy(|outcome: &Outcome<'_, &'static str>| {
        matches!(outcome, Outcome::Response { status, .. } if *status == StatusCode::IM_A_TEAPOT)
    });
    let (client, seen) = {
        let seen = Seen::default();
        let log = seen.clone();
        let server = service_fn(move |_: Request<Full<Bytes>>| {
            let mut keys = log.0.lock().unwrap();
            keys.push(None);
            let reply = if keys.len() < 3 {
                answer(418, "")
            } else {
                answer(503, "")
            };
            async move { reply }
        });
        (layer.layer(server), seen)
    };
    let response = client.oneshot(post()).await.unwrap();
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(seen.attempts(), 3);
}

#[test]
fn the_guide_shows_the_module_example_which_compiles() {
    let module = include_str!("mod.rs");
    let guide = include_str!("../guide/client.md");
    let lines = module
        .lines()
        .filter_map(|line| line.strip_prefix("//!"))
        .map(|line| line.strip_prefix(' ').unwrap_or(line));
    let example: Vec<&str> = lines
        .skip_while(|line| *line != "```no_run")
        .skip(1)
        .take_while(|line| *line != "```")
        .collect();
    assert!(example.len() > 5, "{example:?}");
    let example = format!("```no_run\n{}\n```", example.join("\n"));
    assert!(
        guide.contains(&example),
        "the client guide page differs from:\n{example}"
    );
}
