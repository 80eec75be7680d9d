//! `IdempotentClient`: the Tower service.

use std::{
    fmt,
    future::{poll_fn, Future},
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
};

use bytes::{Bytes, BytesMut};
use http::{request::Parts, Extensions, HeaderMap, HeaderValue, Request, Response, StatusCode};
use http_body::Body;
use http_body_util::BodyExt;
use tower_service::Service;

use super::{
    layer::Settings,
    retry::{self, Answer, Transport},
    BoxError, ClientError, DefaultPolicy, Failure, RetryPolicy, MAX_INSPECTED_BODY,
};
use crate::ResponseBody;

/// The future of an [`IdempotentClient`] call.
pub type ResponseFuture<B, E> =
    Pin<Box<dyn Future<Output = Result<Response<ResponseBody<B>>, ClientError<E>>> + Send>>;

/// An HTTP client service whose calls of the configured methods carry an idempotency key
/// and are retried: made by [`IdempotentClientLayer`](super::IdempotentClientLayer).
///
/// A request that has the key header keeps it; one without gets a fresh UUID v4. Every
/// attempt sends the same method, URI, headers (with that key), extensions and body.
///
/// The request body must be `Clone`: every attempt sends it again, and a body that cannot
/// be sent twice is refused at compile time, not found out at the first retry. Buffered
/// bodies such as `http_body_util::Full<Bytes>` or `String` are; a stream is not.
///
/// The response's body is the inner service's, untouched, except for a `409` the policy
/// read to classify (see [`MAX_INSPECTED_BODY`](super::MAX_INSPECTED_BODY)), which comes
/// back buffered. Its extensions hold an [`IdempotentCall`](super::IdempotentCall).
pub struct IdempotentClient<S, P = DefaultPolicy> {
    inner: S,
    settings: Arc<Settings>,
    policy: Arc<P>,
}

impl<S, P> IdempotentClient<S, P> {
    pub(crate) fn new(inner: S, settings: Arc<Settings>, policy: Arc<P>) -> Self {
        Self {
            inner,
            settings,
            policy,
        }
    }

    /// The wrapped client.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }
}

impl<S: Clone, P> Clone for IdempotentClient<S, P> {
    fn clone(&self) -> Self {
        Self::new(
            self.inner.clone(),
            self.settings.clone(),
            self.policy.clone(),
        )
    }
}

impl<S: fmt::Debug, P> fmt::Debug for IdempotentClient<S, P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotentClient")
            .field("inner", &self.inner)
            .field("settings", &self.settings)
            .field("policy", &std::any::type_name::<P>())
            .finish()
    }
}

impl<S, P, B, RB> Service<Request<B>> for IdempotentClient<S, P>
where
    S: Service<Request<B>, Response = Response<RB>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Send + 'static,
    P: RetryPolicy<S::Error>,
    B: Clone + Send + 'static,
    RB: Body<Data = Bytes> + Send + 'static,
    RB::Error: Into<BoxError>,
{
    type Response = Response<ResponseBody<RB>>;
    type Error = ClientError<S::Error>;
    type Future = ResponseFuture<RB, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner
            .poll_ready(cx)
            .map_err(|e| ClientError::new(None, Failure::Service(e)))
    }

    fn call(&mut self, mut request: Request<B>) -> Self::Future {
        // The ready one is used for the first attempt (tower's note on cloning services).
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        if !self.settings.methods.contains(request.method()) {
            return Box::pin(async move {
                match inner.call(request).await {
                    Ok(response) => Ok(response.map(ResponseBody::inner)),
                    Err(e) => Err(ClientError::new(None, Failure::Service(e))),
                }
            });
        }
        let key = key_of(request.headers_mut(), &self.settings.header_name);
        let (parts, body) = request.into_parts();
        let (settings, policy) = (self.settings.clone(), self.policy.clone());
        Box::pin(async move {
            let mut transport = TowerTransport {
                template: inner.clone(),
                ready: Some(inner),
                parts,
                body,
            };
            retry::run(&settings, &*policy, key, &mut transport).await
        })
    }
}

/// The request's key, or a new UUID v4 put in the request.
pub(crate) fn key_of(headers: &mut HeaderMap, name: &http::HeaderName) -> String {
    if let Some(value) = headers.get(name) {
        return String::from_utf8_lossy(value.as_bytes()).into_owned();
    }
    let key = uuid::Uuid::new_v4().to_string();
    let value = HeaderValue::from_str(&key).expect("a UUID is a valid header value");
    headers.insert(name.clone(), value);
    key
}

/// One call's attempts through a Tower service.
struct TowerTransport<S, B> {
    /// Cloned (and made ready) for every attempt after the first.
    template: S,
    /// Ready for the first attempt.
    ready: Option<S>,
    parts: Parts,
    body: B,
}

impl<S, B, RB> Transport for TowerTransport<S, B>
where
    S: Service<Request<B>, Response = Response<RB>> + Clone + Send,
    S::Future: Send,
    S::Error: Send,
    B: Clone + Send,
    RB: Body<Data = Bytes> + Send + 'static,
    RB::Error: Into<BoxError>,
{
    type Answer = Response<ResponseBody<RB>>;
    type Error = S::Error;

    fn send(&mut self) -> impl Future<Output = Result<Self::Answer, S::Error>> + Send + '_ {
        let mut request = Request::new(self.body.clone());
        *request.method_mut() = self.parts.method.clone();
        *request.uri_mut() = self.parts.uri.clone();
        *request.version_mut() = self.parts.version;
        *request.headers_mut() = self.parts.headers.clone();
        *request.extensions_mut() = self.parts.extensions.clone();
        let ready = self.ready.take();
        async move {
            let mut service = match ready {
                Some(service) => service,
                None => {
                    let mut service = self.template.clone();
                    poll_fn(|cx| service.poll_ready(cx)).await?;
                    service
                }
            };
            let response = service.call(request).await?;
            Ok(response.map(ResponseBody::inner))
        }
    }
}

impl<B> Answer for Response<ResponseBody<B>>
where
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
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
        self.body().size_hint().upper()
    }

    async fn buffer(self) -> Result<(Self, Option<Bytes>), BoxError> {
        let (parts, body) = self.into_parts();
        let mut inner = match body.into_inner() {
            Ok(inner) => Box::pin(inner),
            Err(body) => return Ok((Response::from_parts(parts, body), None)),
        };
        // Read frame by frame, never more than the limit and one frame: a body may have
        // said it was shorter than it is.
        let mut read = BytesMut::new();
        let mut trailers: Option<HeaderMap> = None;
        while let Some(frame) = inner.frame().await {
            let frame = match frame.map_err(Into::into)?.into_data() {
                Ok(data) => {
                    read.extend_from_slice(&data);
                    if read.len() as u64 > MAX_INSPECTED_BODY {
                        // Not inspected; the caller gets what was read, then the rest.
                        let body = ResponseBody::spliced(read.freeze(), inner);
                        return Ok((Response::from_parts(parts, body), None));
                    }
                    continue;
                }
                Err(frame) => frame,
            };
            if let Ok(more) = frame.into_trailers() {
                trailers.get_or_insert_with(HeaderMap::new).extend(more);
            }
        }
        let bytes = read.freeze();
        let body = ResponseBody::with_trailers(bytes.clone(), trailers);
        Ok((Response::from_parts(parts, body), Some(bytes)))
    }
}
