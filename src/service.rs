//! The `Idempotency` service: what happens before a key is claimed.

use std::{
    fmt,
    sync::Arc,
    task::{Context, Poll},
};

use bytes::Bytes;
use http::{request::Parts, Request, Response};
use http_body::Body;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use tower_service::Service;

use crate::{
    body::ResponseBody,
    execute,
    future::ResponseFuture,
    layer::{Config, Endpoint},
    response::Rejection,
    store::Store,
    Fingerprint, IdempotencyKey, Scope,
};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Middleware that executes each keyed request once and replays its response to retries.
/// Made by [`IdempotencyLayer`](crate::IdempotencyLayer).
///
/// The inner service gets the request body buffered (`ReqBody::from(bytes)`); requests the
/// layer does not handle reach it untouched.
#[derive(Clone)]
pub struct Idempotency<S> {
    inner: S,
    store: Arc<dyn Store>,
    config: Arc<Config>,
}

impl<S> Idempotency<S> {
    pub(crate) fn new(inner: S, store: Arc<dyn Store>, config: Arc<Config>) -> Self {
        Self {
            inner,
            store,
            config,
        }
    }
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for Idempotency<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqBody: Body + From<Bytes> + Send + 'static,
    ReqBody::Data: Send,
    ReqBody::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes> + Unpin + Send + 'static,
    ResBody::Error: fmt::Display + Send,
{
    type Response = Response<ResponseBody<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future, ResBody, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        let config = &self.config;
        if !config.methods.contains(request.method()) {
            return ResponseFuture::pass_through(self.inner.call(request));
        }
        let key = match IdempotencyKey::from_header_values(
            request.headers().get_all(&config.header_name),
        ) {
            Ok(Some(key)) => key,
            Ok(None) if config.required => {
                return ResponseFuture::answered(Rejection::KeyRequired.into_response())
            }
            Ok(None) => return ResponseFuture::pass_through(self.inner.call(request)),
            Err(_) => return ResponseFuture::answered(Rejection::InvalidKey.into_response()),
        };
        // The service that was made ready goes with this request; the clone stays for the next.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let (store, config) = (self.store.clone(), self.config.clone());
        ResponseFuture::keyed(Box::pin(keyed(inner, store, config, key, request)))
    }
}

/// Buffers and fingerprints a keyed request, then claims and answers it.
async fn keyed<S, ReqBody, ResBody>(
    inner: S,
    store: Arc<dyn Store>,
    config: Arc<Config>,
    key: IdempotencyKey,
    request: Request<ReqBody>,
) -> Result<Response<ResponseBody<ResBody>>, S::Error>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqBody: Body + From<Bytes> + Send + 'static,
    ReqBody::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes> + Unpin + Send + 'static,
    ResBody::Error: fmt::Display + Send,
{
    let (parts, body) = request.into_parts();
    let body = match buffer_request(&parts, body, config.max_request_body).await {
        Ok(body) => body,
        Err(rejection) => return Ok(rejection.into_response()),
    };
    let principal = config.principal.0.extract(&parts);
    let scope = Scope::new(principal, endpoint(&config.endpoint, &parts), key);
    let fingerprint = Fingerprint::of(&parts, &config.fingerprint_headers, &body);
    let request = Request::from_parts(parts, ReqBody::from(body));
    execute::run(inner, store, config, scope, fingerprint, request).await
}

async fn buffer_request<B>(parts: &Parts, body: B, limit: usize) -> Result<Bytes, Rejection>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    let too_large = Rejection::BodyTooLarge { limit };
    // A declared length over the limit is refused before reading a byte.
    let declared = parts
        .headers
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if declared.is_some_and(|len| len > limit as u64) {
        return Err(too_large);
    }
    match Limited::new(body, limit).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(error) if error.is::<LengthLimitError>() => Err(too_large),
        Err(_) => Err(Rejection::InvalidBody),
    }
}

fn endpoint(endpoint: &Endpoint, parts: &Parts) -> String {
    let path = match endpoint {
        Endpoint::Fixed(name) => return name.to_string(),
        #[cfg(feature = "axum")]
        Endpoint::MatchedPath => parts
            .extensions
            .get::<axum::extract::MatchedPath>()
            .map_or(parts.uri.path(), |matched| matched.as_str()),
        Endpoint::MethodAndPath => parts.uri.path(),
    };
    let method = parts.method.as_str();
    let mut name = String::with_capacity(method.len() + 1 + path.len());
    name.push_str(method);
    name.push(' ');
    name.push_str(path);
    name
}

impl<S: fmt::Debug> fmt::Debug for Idempotency<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Idempotency")
            .field("inner", &self.inner)
            .field("store", &self.store)
            .field("config", &self.config)
            .finish()
    }
}
