//! What a caller learns about a call: its key, its attempts, whether it was a replay; and
//! the error of a call that got no answer.

use std::{error::Error as StdError, fmt};

/// A boxed error, as a response body can fail with.
pub type BoxError = Box<dyn StdError + Send + Sync>;

/// One logical call as the client made it: found in the extensions of the response it
/// returns, and in its [`ClientError`].
///
/// # Example
///
/// ```
/// # fn check(response: http::Response<()>) {
/// use tower_idempotency::client::IdempotentCall;
///
/// if let Some(call) = response.extensions().get::<IdempotentCall>() {
///     println!("key {} after {} attempt(s), replayed: {}", call.key, call.attempts, call.replayed);
/// }
/// # }
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct IdempotentCall {
    /// The idempotency key every attempt carried: the request's own, or the one the client
    /// generated (a UUID v4).
    pub key: String,
    /// How many attempts were sent (at least 1, except for a request refused before any).
    pub attempts: u32,
    /// Whether the answer returned is a replay (`Idempotent-Replayed: true`): the
    /// operation was executed by an earlier attempt (or an earlier call with this key).
    pub replayed: bool,
}

/// Why an attempt got no answer.
#[derive(Debug)]
#[non_exhaustive]
pub enum Failure<E> {
    /// The inner service (the HTTP client) failed: connecting, sending, or receiving the
    /// answer. Whether the server executed the request is unknown.
    Service(E),
    /// No answer within the attempt's timeout (or what was left of the deadline).
    TimedOut,
    /// The body of an answer the client reads to classify it (a `409`) failed.
    Body(BoxError),
    /// The request's body cannot be sent twice, so the client sent nothing. Only
    #[cfg_attr(
        feature = "reqwest",
        doc = "[`IdempotentMiddleware`](crate::client::IdempotentMiddleware)"
    )]
    #[cfg_attr(not(feature = "reqwest"), doc = "`IdempotentMiddleware`")]
    /// meets it: the Tower layer takes only bodies that can be cloned.
    BodyNotReplayable,
}

impl<E: fmt::Display> fmt::Display for Failure<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Service(error) => write!(f, "the request failed: {error}"),
            Self::TimedOut => f.write_str("the attempt timed out"),
            Self::Body(error) => write!(f, "the response body failed: {error}"),
            Self::BodyNotReplayable => {
                f.write_str("the request body is a stream that cannot be sent again")
            }
        }
    }
}

/// The error of a call: how its last attempt failed, and the [`IdempotentCall`] (`None`
/// for a request the client passed through, its method not configured).
#[derive(Debug)]
pub struct ClientError<E> {
    call: Option<IdempotentCall>,
    failure: Failure<E>,
}

impl<E> ClientError<E> {
    pub(crate) fn new(call: Option<IdempotentCall>, failure: Failure<E>) -> Self {
        Self { call, failure }
    }

    /// The call: its key and how many attempts were made. `None` when the request was
    /// passed through (its method is not one the client handles).
    pub fn call(&self) -> Option<&IdempotentCall> {
        self.call.as_ref()
    }

    /// How the last attempt failed.
    pub fn failure(&self) -> &Failure<E> {
        &self.failure
    }

    /// The failure, owned (the inner service's error is in [`Failure::Service`]).
    pub fn into_failure(self) -> Failure<E> {
        self.failure
    }
}

impl<E: fmt::Display> fmt::Display for ClientError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.call {
            Some(call) => write!(
                f,
                "no answer after {} attempt(s): {}",
                call.attempts, self.failure
            ),
            None => self.failure.fmt(f),
        }
    }
}

impl<E> StdError for ClientError<E>
where
    E: StdError + 'static,
{
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        match &self.failure {
            Failure::Service(error) => Some(error),
            Failure::Body(error) => Some(&**error),
            Failure::TimedOut | Failure::BodyNotReplayable => None,
        }
    }
}
