//! The client for `reqwest`, as `reqwest-middleware` middleware.

use std::{fmt, future::Future, sync::Arc};

use bytes::Bytes;
use http::{Extensions, HeaderMap, StatusCode};
use reqwest::{Request, Response, ResponseBuilderExt};
use reqwest_middleware::{Middleware, Next};

use super::{
    layer::Settings,
    retry::{self, Answer, Transport},
    service::key_of,
    BoxError, ClientError, DefaultPolicy, Failure, IdempotentCall, IdempotentClientLayer,
    RetryPolicy,
};

/// The client half for `reqwest`: middleware for a `reqwest_middleware::ClientWithMiddleware`,
/// with the same settings and policy as [`IdempotentClientLayer`] (it is made from one).
///
/// A successful response carries an [`IdempotentCall`] in its extensions
/// (`response.extensions()`); so does the `Extensions` a call was made with
/// (`execute_with_extensions`), whatever the outcome. An error is
/// `reqwest_middleware::Error::Middleware` around a
/// `ClientError<reqwest_middleware::Error>` ([`ClientError`]), whose
/// [`Failure::Service`] is the last attempt's own error.
///
/// **Bodies.** reqwest's request body is one fixed type, which can be a stream that cannot
/// be sent twice, so here replayability cannot be checked at compile time. A request whose
/// body cannot be cloned (`Request::try_clone` is `None`) is refused before its first
/// attempt with [`Failure::BodyNotReplayable`]: sending it once and failing at the retry
/// would leave the caller with an unknown outcome, and buffering a stream of unknown length
/// behind the caller's back would hold unbounded memory. Collect such a body into `Bytes`
/// first. Every attempt gets a copy of the call's `Extensions`.
///
/// # Example
///
/// ```
/// use tower_idempotency::client::{IdempotentCall, IdempotentClientLayer, IdempotentMiddleware};
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let client = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
///     .with(IdempotentMiddleware::from(IdempotentClientLayer::new().max_attempts(6)))
///     .build();
/// let response = client
///     .post("http://127.0.0.1:3000/v1/payments")
///     .header("content-type", "application/json")
///     .body(r#"{"amount":1999,"currency":"usd"}"#)
///     .send()
///     .await?;
/// let call = response.extensions().get::<IdempotentCall>().unwrap();
/// println!("key {} after {} attempt(s)", call.key, call.attempts);
/// # Ok(())
/// # }
/// ```
pub struct IdempotentMiddleware<P = DefaultPolicy> {
    settings: Arc<Settings>,
    policy: Arc<P>,
}

impl IdempotentMiddleware {
    /// Middleware with the default settings and [`DefaultPolicy`] (see
    /// [`IdempotentClientLayer`]).
    pub fn new() -> Self {
        IdempotentClientLayer::new().into()
    }
}

impl Default for IdempotentMiddleware {
    fn default() -> Self {
        Self::new()
    }
}

impl<P> From<IdempotentClientLayer<P>> for IdempotentMiddleware<P> {
    fn from(layer: IdempotentClientLayer<P>) -> Self {
        Self {
            settings: layer.settings,
            policy: layer.policy,
        }
    }
}

impl<P> fmt::Debug for IdempotentMiddleware<P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotentMiddleware")
            .field("settings", &self.settings)
            .field("policy", &std::any::type_name::<P>())
            .finish()
    }
}

#[async_trait::async_trait]
impl<P> Middleware for IdempotentMiddleware<P>
where
    P: RetryPolicy<reqwest_middleware::Error>,
{
    async fn handle(
        &self,
        mut request: Request,
        extensions: &mut Extensions,
        next: Next<'_>,
    ) -> reqwest_middleware::Result<Response> {
        if !self.settings.methods.contains(request.method()) {
            return next.run(request, extensions).await;
        }
        let key = key_of(request.headers_mut(), &self.settings.header_name);
        if request.try_clone().is_none() {
            let call = IdempotentCall {
                key,
                attempts: 0,
                replayed: false,
            };
            extensions.insert(call.clone());
            let error = ClientError::<reqwest_middleware::Error>::new(
                Some(call),
                Failure::BodyNotReplayable,
            );
            return Err(reqwest_middleware::Error::middleware(error));
        }
        let mut transport = ReqwestTransport {
            request,
            extensions,
            next,
        };
        let result = retry::run(&self.settings, &*self.policy, key, &mut transport).await;
        let call = match &result {
            Ok(response) => response.extensions().get::<IdempotentCall>(),
            Err(error) => error.call(),
        };
        if let Some(call) = call.cloned() {
            transport.extensions.insert(call);
        }
        result.map_err(reqwest_middleware::Error::middleware)
    }
}

/// One call's attempts through the rest of the middleware chain.
struct ReqwestTransport<'a> {
    /// Cloned for every attempt (checked to be clonable before the first).
    request: Request,
    extensions: &'a mut Extensions,
    next: Next<'a>,
}

impl Transport for ReqwestTransport<'_> {
    type Answer = Response;
    type Error = reqwest_middleware::Error;

    fn send(&mut self) -> impl Future<Output = reqwest_middleware::Result<Response>> + Send + '_ {
        let request = self
            .request
            .try_clone()
            .expect("checked to be clonable before the first attempt");
        let mut extensions = self.extensions.clone();
        let next = self.next.clone();
        async move { next.run(request, &mut extensions).await }
    }
}

impl Answer for Response {
    fn status(&self) -> StatusCode {
        self.status()
    }

    fn headers(&self) -> &HeaderMap {
        self.headers()
    }

    fn extensions_mut(&mut self) -> &mut Extensions {
        self.extensions_mut()
    }

    fn body_len(&self) -> Option<u64> {
        self.content_length()
    }

    // reqwest (hyper) fails a body longer than its `Content-Length`, the length inspected.
    async fn buffer(mut self) -> Result<(Self, Option<Bytes>), BoxError> {
        let (status, version, url) = (self.status(), self.version(), self.url().clone());
        let headers = std::mem::take(self.headers_mut());
        let extensions = std::mem::take(self.extensions_mut());
        let bytes = self.bytes().await?;
        let mut rebuilt = http::Response::builder()
            .status(status)
            .version(version)
            .url(url)
            .body(bytes.clone())?;
        *rebuilt.headers_mut() = headers;
        rebuilt.extensions_mut().extend(extensions);
        Ok((Response::from(rebuilt), Some(bytes)))
    }
}
