//! The retry loop both front ends share: one key, bounded attempts, backoff with jitter,
//! `Retry-After`, a per-attempt timeout and an overall deadline.

use std::{
    future::Future,
    time::{Duration, SystemTime},
};

use bytes::Bytes;
use http::{header::RETRY_AFTER, Extensions, HeaderMap, StatusCode};
use tokio::time::{sleep, timeout, Instant};

use super::{
    layer::Settings, retry_after, BoxError, ClientError, Failure, IdempotentCall, Outcome,
    RetryPolicy, MAX_INSPECTED_BODY,
};
use crate::REPLAYED_HEADER;

/// A response of some HTTP client, as the loop reads it.
pub(crate) trait Answer: Sized + Send {
    fn status(&self) -> StatusCode;
    fn headers(&self) -> &HeaderMap;
    fn extensions_mut(&mut self) -> &mut Extensions;
    /// The most bytes the body can have, when known in advance.
    fn body_len(&self) -> Option<u64>;
    /// Reads the body, up to [`MAX_INSPECTED_BODY`] bytes; returns the answer with the same
    /// body, whole, and its bytes if it was no longer than that (`None` if it was: it
    /// misreported its length, and is not inspected).
    fn buffer(self) -> impl Future<Output = Result<(Self, Option<Bytes>), BoxError>> + Send;
}

/// Sends one attempt of a call: the same request, the same key, each time.
pub(crate) trait Transport: Send {
    type Answer: Answer;
    type Error: Send;
    fn send(&mut self) -> impl Future<Output = Result<Self::Answer, Self::Error>> + Send + '_;
}

/// Runs a call to its end: the answer to return (with its [`IdempotentCall`] in its
/// extensions) or the last attempt's failure.
pub(crate) async fn run<T, P>(
    settings: &Settings,
    policy: &P,
    key: String,
    transport: &mut T,
) -> Result<T::Answer, ClientError<T::Error>>
where
    T: Transport,
    P: RetryPolicy<T::Error>,
{
    let deadline = deadline_from(Instant::now(), settings.deadline);
    let mut attempts = 0;
    loop {
        attempts += 1;
        let left = deadline.map_or(Duration::MAX, |d| {
            d.saturating_duration_since(Instant::now())
        });
        let limit = settings.attempt_timeout.map_or(left, |t| t.min(left));
        let outcome = match timeout(limit, attempt(policy, transport)).await {
            Ok(outcome) => outcome,
            Err(_) => Err(Failure::TimedOut),
        };
        let (replayed, wanted, hint) = match &outcome {
            Ok((answer, body)) => {
                let replayed = answer
                    .headers()
                    .get(REPLAYED_HEADER)
                    .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"true"));
                let wanted = !replayed
                    && policy.retry(&Outcome::Response {
                        status: answer.status(),
                        headers: answer.headers(),
                        body: body.as_deref(),
                    });
                let hint = answer
                    .headers()
                    .get(RETRY_AFTER)
                    .and_then(|value| retry_after::parse(value, SystemTime::now()));
                (replayed, wanted, hint)
            }
            Err(failure) => (false, policy.retry(&Outcome::Failed(failure)), None),
        };
        if wanted && attempts < settings.max_attempts {
            let backoff = settings.backoff.delay(attempts);
            let told = hint.map_or(backoff, |hint| hint.min(settings.max_retry_after));
            let wait = backoff.max(told);
            // No attempt starts, and no wait ends, at or past the deadline.
            if ends_in_time(Instant::now(), wait, deadline) {
                // The key's digest, as the server's span shows keys: logs are no place for
                // a key another caller could replay.
                let key = crate::server::short_digest(&key);
                tracing::debug!(%key, attempts, ?wait, "idempotent call: retrying");
                drop(outcome);
                sleep(wait).await;
                continue;
            }
        }
        let call = IdempotentCall {
            key,
            attempts,
            replayed,
        };
        return match outcome {
            Ok((mut answer, _)) => {
                answer.extensions_mut().insert(call);
                Ok(answer)
            }
            Err(failure) => Err(ClientError::new(Some(call), failure)),
        };
    }
}

/// When a call started at `now` with `deadline` must end; `None` (no deadline) when that is
/// past what the clock can represent.
pub(crate) fn deadline_from(now: Instant, deadline: Duration) -> Option<Instant> {
    now.checked_add(deadline)
}

/// Whether a wait of `wait` from `now` ends before `deadline`. A wait past what the clock
/// can represent ends past any deadline.
pub(crate) fn ends_in_time(now: Instant, wait: Duration, deadline: Option<Instant>) -> bool {
    match deadline {
        None => true,
        Some(deadline) => now
            .checked_add(wait)
            .and_then(|end| end.checked_add(TIMER_GRANULARITY))
            .is_some_and(|latest| latest <= deadline),
    }
}

/// Tokio's timer fires on whole milliseconds, rounding a sleep's end up: a wait asked to end
/// within a millisecond of the deadline could otherwise wake at it.
const TIMER_GRANULARITY: Duration = Duration::from_millis(1);

/// One attempt, with the body read when the policy classifies by it.
async fn attempt<T, P>(
    policy: &P,
    transport: &mut T,
) -> Result<(T::Answer, Option<Bytes>), Failure<T::Error>>
where
    T: Transport,
    P: RetryPolicy<T::Error>,
{
    let answer = transport.send().await.map_err(Failure::Service)?;
    let small = answer.body_len().is_some_and(|n| n <= MAX_INSPECTED_BODY);
    if !small || !policy.inspects_body(answer.status()) {
        return Ok((answer, None));
    }
    let (answer, body) = answer.buffer().await.map_err(Failure::Body)?;
    Ok((answer, body))
}
