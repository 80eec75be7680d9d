//! Which outcomes of an attempt are worth another attempt.

use http::{HeaderMap, StatusCode};

use super::Failure;

/// What one attempt came to, as a [`RetryPolicy`] sees it.
#[derive(Debug)]
#[non_exhaustive]
pub enum Outcome<'a, E> {
    /// The server answered. Replays never get here: a replay is the operation's answer.
    Response {
        /// The answer's status.
        status: StatusCode,
        /// The answer's headers.
        headers: &'a HeaderMap,
        /// The body, when the policy asked to see it ([`RetryPolicy::inspects_body`]) and
        /// it is known to be at most [`MAX_INSPECTED_BODY`] bytes long; else `None`.
        body: Option<&'a [u8]>,
    },
    /// No answer.
    Failed(&'a Failure<E>),
}

/// The longest body the client reads to classify an answer, in bytes. A body whose length
/// is unknown in advance (chunked) or larger is not read; the policy sees `body: None`
/// and the caller gets the body as it came. A body that said it was no longer and turns
/// out longer is read no further than the frame that passes the limit: the policy sees
/// `body: None` too, and the caller gets the whole body, what was read then the rest.
pub const MAX_INSPECTED_BODY: u64 = 4096;

/// Decides whether an attempt's outcome is retried (with the same key). The client still
/// stops at its attempt limit and its deadline; a replay is never retried.
///
/// Implemented by [`DefaultPolicy`] and by closures `Fn(&Outcome<'_, E>) -> bool`.
///
/// # Example
///
/// The default rules, but never retry a `429`:
///
/// ```
/// use http::StatusCode;
/// use tower_idempotency::client::{DefaultPolicy, IdempotentClientLayer, Outcome, RetryPolicy};
///
/// let layer = IdempotentClientLayer::new().policy(|outcome: &Outcome<'_, std::io::Error>| {
///     match outcome {
///         Outcome::Response { status, .. } if *status == StatusCode::TOO_MANY_REQUESTS => false,
///         _ => DefaultPolicy.retry(outcome),
///     }
/// });
/// ```
pub trait RetryPolicy<E>: Send + Sync + 'static {
    /// Whether to try again after `outcome`.
    fn retry(&self, outcome: &Outcome<'_, E>) -> bool;

    /// Whether the client should read the body of an answer with `status` (up to
    /// [`MAX_INSPECTED_BODY`] bytes) before calling [`retry`](Self::retry). Default: for
    /// `409` only, the one status whose meaning the body decides.
    fn inspects_body(&self, status: StatusCode) -> bool {
        status == StatusCode::CONFLICT
    }
}

impl<E, F> RetryPolicy<E> for F
where
    F: Fn(&Outcome<'_, E>) -> bool + Send + Sync + 'static,
{
    fn retry(&self, outcome: &Outcome<'_, E>) -> bool {
        self(outcome)
    }
}

/// The rules of the crate's server and of the IETF `Idempotency-Key` draft.
///
/// Retried:
/// - every [`Failure`]: a connection refused or reset, a response lost, a timeout. The
///   request may or may not have been executed; the key makes trying again safe;
/// - `409 request_in_progress` (the first attempt still runs): see below;
/// - `429`, `502`, `503`, `504`: nothing was executed, or the server asks to come back.
///
/// Returned as they are: every other answer, in particular `409
/// idempotency_key_reused_with_different_params`, `422` (the IETF profile's reuse), any
/// other `4xx` (retrying cannot fix the request), `500` (the server failed the request
/// itself; the crate's server releases the key, but the caller decides) and `2xx`.
///
/// **Telling the two `409`s apart.** The body decides when it can be read: JSON (or
/// problem+json) whose `error`, `code` or `error.code` member is `request_in_progress` is
/// retried, any other code is not. A `409` whose body is not read (unknown length or over
/// [`MAX_INSPECTED_BODY`]) or names no code is retried only if it carries `Retry-After`: the
/// crate's server sends `Retry-After` on every in-progress `409`, whatever renders its
/// errors, and never on the others.
///
/// **Every error of the inner service is retried**, whatever it is: a generic Tower layer
/// cannot tell a connection refused from an error no attempt can fix (an invalid URI, a
/// request the HTTP client refuses to build). Such a call still ends, at the attempt
/// limit or the deadline, with the last error; to stop at once on errors you can tell
/// apart, replace the policy:
///
/// ```
/// use std::io::{Error, ErrorKind};
/// use tower_idempotency::client::{DefaultPolicy, Failure, IdempotentClientLayer, Outcome, RetryPolicy};
///
/// // The default rules, but an invalid input is returned at the first attempt.
/// let layer = IdempotentClientLayer::new().policy(|outcome: &Outcome<'_, Error>| match outcome {
///     Outcome::Failed(Failure::Service(error)) if error.kind() == ErrorKind::InvalidInput => false,
///     _ => DefaultPolicy.retry(outcome),
/// });
/// ```
#[derive(Clone, Copy, Debug, Default)]
pub struct DefaultPolicy;

/// The error code of an in-flight original.
const IN_PROGRESS: &str = "request_in_progress";

impl<E> RetryPolicy<E> for DefaultPolicy {
    fn retry(&self, outcome: &Outcome<'_, E>) -> bool {
        let (status, headers, body) = match outcome {
            Outcome::Failed(_) => return true,
            Outcome::Response {
                status,
                headers,
                body,
            } => (*status, *headers, *body),
        };
        match status {
            StatusCode::CONFLICT => match body.and_then(error_code) {
                Some(code) => code == IN_PROGRESS,
                None => headers.contains_key(http::header::RETRY_AFTER),
            },
            StatusCode::TOO_MANY_REQUESTS
            | StatusCode::BAD_GATEWAY
            | StatusCode::SERVICE_UNAVAILABLE
            | StatusCode::GATEWAY_TIMEOUT => true,
            _ => false,
        }
    }
}

/// The error code of a JSON error body: `{"error":"<code>"}` (the crate's JSON errors),
/// `{"code":"<code>"}` (problem+json) or `{"error":{"code":"<code>"}}` (Stripe's envelope).
fn error_code(body: &[u8]) -> Option<String> {
    let value: serde_json::Value = serde_json::from_slice(body).ok()?;
    let error = &value["error"];
    let code = error.as_str().or_else(|| value["code"].as_str());
    code.or_else(|| error["code"].as_str()).map(str::to_owned)
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::{header::RETRY_AFTER, HeaderValue};

    fn retried(status: u16, retry_after: bool, body: Option<&str>) -> bool {
        let mut headers = HeaderMap::new();
        if retry_after {
            headers.insert(RETRY_AFTER, HeaderValue::from_static("1"));
        }
        let outcome: Outcome<'_, ()> = Outcome::Response {
            status: StatusCode::from_u16(status).unwrap(),
            headers: &headers,
            body: body.map(str::as_bytes),
        };
        DefaultPolicy.retry(&outcome)
    }

    #[test]
    fn failures_and_transient_statuses_are_retried() {
        for failure in [
            Failure::Service(()),
            Failure::TimedOut,
            Failure::Body("x".into()),
        ] {
            assert!(
                DefaultPolicy.retry(&Outcome::Failed(&failure)),
                "{failure:?}"
            );
        }
        for status in [429, 502, 503, 504] {
            assert!(retried(status, false, None), "{status}");
        }
    }

    #[test]
    fn answers_retrying_cannot_change_are_not_retried() {
        for status in [
            200, 201, 204, 301, 400, 401, 402, 403, 404, 413, 422, 500, 501,
        ] {
            assert!(!retried(status, false, None), "{status}");
            assert!(!retried(status, true, None), "{status} with Retry-After");
        }
    }

    #[test]
    fn an_in_progress_409_is_retried_whatever_renders_it() {
        let json = r#"{"error":"request_in_progress","retry_after":1}"#;
        let problem = r#"{"type":"https://x","status":409,"code":"request_in_progress"}"#;
        let stripe = r#"{"error":{"type":"idempotency_error","code":"request_in_progress"}}"#;
        for body in [json, problem, stripe] {
            assert!(retried(409, true, Some(body)), "{body}");
            assert!(
                retried(409, false, Some(body)),
                "{body} without Retry-After"
            );
        }
        // Body not read, or no code in it: Retry-After decides.
        assert!(retried(409, true, None));
        assert!(retried(409, true, Some("busy")));
        assert!(!retried(409, false, None));
        assert!(!retried(409, false, Some("{}")));
    }

    #[test]
    fn a_reused_key_or_an_unreplayable_answer_is_never_retried() {
        let reused = r#"{"error":"idempotency_key_reused_with_different_params"}"#;
        let problem = r#"{"status":409,"code":"idempotency_key_reused_with_different_params"}"#;
        let not_replayable = r#"{"error":"response_not_replayable","status":201}"#;
        for body in [reused, problem, not_replayable] {
            assert!(!retried(409, false, Some(body)), "{body}");
            // Even a Retry-After does not override what the body says.
            assert!(!retried(409, true, Some(body)), "{body} with Retry-After");
        }
        let ietf_reuse = r#"{"status":422,"code":"idempotency_key_reused_with_different_params"}"#;
        assert!(!retried(422, true, Some(ietf_reuse)));
    }
}
