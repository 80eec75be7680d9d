//! The client half: one idempotency key per logical call, reused by every retry, with
//! exponential backoff and full jitter, bounded attempts, a deadline, a timeout per
//! attempt, and `Retry-After` honoured.
//!
//! What every caller of an idempotent API otherwise writes by hand, often wrongly (a new
//! key per attempt, retrying a mismatch, no jitter, no deadline):
//!
//! - [`IdempotentClientLayer`] wraps any Tower HTTP client service, such as hyper-util's
//!   `Client`: its [`IdempotentClient`] handles calls of the configured methods (default
//!   `POST` and `PATCH`).
#![cfg_attr(
    feature = "reqwest",
    doc = "- [`IdempotentMiddleware`] (feature `reqwest`) does the same for `reqwest` through"
)]
#![cfg_attr(
    not(feature = "reqwest"),
    doc = "- `IdempotentMiddleware` (feature `reqwest`) does the same for `reqwest` through"
)]
//!   `reqwest-middleware`.
//!
//! A request without a key gets one (a UUID v4) before its first attempt; a request that
//! has one keeps it. What is retried is the [`RetryPolicy`]'s call ([`DefaultPolicy`]:
//! failures to get an answer, timeouts, `409 request_in_progress`, `429`, `502`, `503`,
//! `504`; never a reused key, a `422`, another `4xx`, or a replay). The caller learns per
//! call the key, the attempts made and whether the answer was a replay: an
//! [`IdempotentCall`] in the response's extensions, or in the [`ClientError`].
//!
//! # Example
//!
//! ```no_run
//! use bytes::Bytes;
//! use http::Request;
//! use http_body_util::Full;
//! use hyper_util::{client::legacy::Client, rt::TokioExecutor};
//! use tower::{Layer, ServiceExt};
//! use tower_idempotency::client::{IdempotentCall, IdempotentClientLayer};
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let http = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
//! let client = IdempotentClientLayer::new().max_attempts(6).layer(http);
//!
//! let request = Request::post("http://127.0.0.1:3000/v1/payments")
//!     .header("content-type", "application/json")
//!     .body(Full::new(Bytes::from(r#"{"amount":1999,"currency":"usd"}"#)))?;
//! let response = client.oneshot(request).await?;
//! let call = response.extensions().get::<IdempotentCall>().unwrap();
//! println!("{} with key {} after {} attempt(s)", response.status(), call.key, call.attempts);
//! # Ok(())
//! # }
//! ```
//!
//! # Bodies must be replayable
//!
//! Every attempt sends the body again, so [`IdempotentClient`] takes only request bodies
//! that are `Clone`. A streaming body does not compile:
//!
//! ```compile_fail
//! use std::convert::Infallible;
//! use bytes::Bytes;
//! use http::{Request, Response};
//! use http_body_util::{combinators::BoxBody, Full};
//! use tower::{service_fn, Layer, ServiceExt};
//! use tower_idempotency::client::IdempotentClientLayer;
//!
//! type Streamed = BoxBody<Bytes, Infallible>;
//! let http = service_fn(|_: Request<Streamed>| async {
//!     Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())))
//! });
//! let client = IdempotentClientLayer::new().layer(http);
//! let request = Request::post("/").body(Streamed::new(Full::new(Bytes::new()))).unwrap();
//! let _ = client.oneshot(request); // `BoxBody` is not `Clone`
//! ```

mod backoff;
mod call;
mod layer;
mod policy;
#[cfg(feature = "reqwest")]
mod reqwest;
mod retry;
mod retry_after;
mod service;

pub use backoff::Backoff;
pub use call::{BoxError, ClientError, Failure, IdempotentCall};
pub use layer::IdempotentClientLayer;
pub use policy::{DefaultPolicy, Outcome, RetryPolicy, MAX_INSPECTED_BODY};
#[cfg(feature = "reqwest")]
#[cfg_attr(docsrs, doc(cfg(feature = "reqwest")))]
pub use reqwest::IdempotentMiddleware;
pub use service::{IdempotentClient, ResponseFuture};

#[cfg(test)]
mod tests;
