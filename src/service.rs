//! The `Idempotency` service: what happens before a key is claimed.

use std::{
    fmt,
    future::Future,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    task::{Context, Poll},
};

use bytes::{Buf, Bytes, BytesMut};
use http::{request::Parts, Extensions, Method, Request, Response, Uri};
use http_body::Body;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use tower_service::Service;
use tracing::Instrument;

use crate::{
    body::ResponseBody,
    execute,
    future::ResponseFuture,
    grpc::Protocol,
    layer::{Config, Endpoint},
    rejection::{Reason, Rejection},
    request_body::HandOnBody,
    store::Store,
    telemetry::{self, Outcome},
    Fingerprint, IdempotencyKey, Principal, Scope,
};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Middleware that executes each keyed request once and replays its response to retries.
/// Made by [`IdempotencyLayer`](crate::IdempotencyLayer).
///
/// The inner service gets a keyed request's body rebuilt from the bytes the layer read,
/// and the body of every other request untouched, both as the type [`HandOnBody`] names
/// (the caller's own for axum's body and `Full<Bytes>`, [`RequestBody`](crate::RequestBody)
/// around hyper's `Incoming`).
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
    S: Service<Request<ReqBody::Inner>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqBody: HandOnBody + Send + 'static,
    ReqBody::Inner: Send + 'static,
    ReqBody::Data: Send,
    ReqBody::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes> + Send + 'static,
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
            return ResponseFuture::pass_through(self.inner.call(request.map(HandOnBody::pass)));
        }
        let key = match IdempotencyKey::from_header_values(
            request.headers().get_all(&config.header_name),
        ) {
            Ok(Some(key)) => key,
            Ok(None) if config.required => {
                config.meters.answered(Outcome::KeyMissing);
                return ResponseFuture::answered(reject(Reason::KeyRequired, config, &request));
            }
            Ok(None) => {
                return ResponseFuture::pass_through(self.inner.call(request.map(HandOnBody::pass)))
            }
            Err(_) => {
                config.meters.answered(Outcome::InvalidKey);
                return ResponseFuture::answered(reject(Reason::InvalidKey, config, &request));
            }
        };
        // The service that was made ready goes with this request; the clone stays for the next.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let (parts, body) = request.into_parts();
        let principal = config.principal.0.extract(&parts);
        if principal.is_none() && !config.anonymous && !config.unscoped {
            config.meters.answered(Outcome::PrincipalMissing);
            return ResponseFuture::answered(refuse_anonymous(config, &parts));
        }
        let (store, config) = (self.store.clone(), self.config.clone());
        let keyed = keyed(inner, store, config, (principal, key), (parts, body));
        // A span no subscriber records is left out: entering it on every poll costs.
        let span = telemetry::request_span();
        if span.is_disabled() {
            ResponseFuture::keyed(Box::pin(keyed))
        } else {
            ResponseFuture::keyed(Box::pin(keyed.instrument(span)))
        }
    }
}

/// Buffers and fingerprints a keyed request, then claims and answers it.
///
/// A `fn` returning an `async move` block rather than an `async fn`, which would keep each
/// argument twice in the future (the argument, and the local it is moved into).
#[allow(clippy::manual_async_fn)] // on purpose: see above
fn keyed<S, ReqBody, ResBody>(
    inner: S,
    store: Arc<dyn Store>,
    config: Arc<Config>,
    (principal, key): (Option<Principal>, IdempotencyKey),
    (parts, body): (Parts, ReqBody),
) -> impl Future<Output = Result<Response<ResponseBody<ResBody>>, S::Error>>
where
    S: Service<Request<ReqBody::Inner>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqBody: HandOnBody + Send + 'static,
    ReqBody::Inner: Send + 'static,
    ReqBody::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: fmt::Display + Send,
{
    async move {
        let body = match buffer_request(&parts, body, config.max_request_body).await {
            Ok(body) => body,
            Err(reason) => {
                config.meters.answered(match reason {
                    Reason::BodyTooLarge { .. } => Outcome::BodyTooLarge,
                    _ => Outcome::InvalidBody,
                });
                let endpoint = endpoint(&config, &parts.method, &parts.uri, &parts.extensions);
                let endpoint = endpoint.concat();
                let rejection = Rejection::new(reason, Some(endpoint));
                return Ok(rejection.into_response(Protocol::of(&parts.headers), &config));
            }
        };
        let scope = scope(&config, &parts, principal.as_ref(), key);
        telemetry::show_scope(&scope, config.span_key, config.span_principal);
        let fingerprint = Fingerprint::of(&parts, &config.fingerprint_headers, &body);
        execute::run::<S, ReqBody, ResBody>(inner, store, config, scope, fingerprint, (parts, body))
            .await
    }
}

/// The layer's answer to a request it refuses before reading its body.
fn reject<ReqBody, ResBody>(
    reason: Reason,
    config: &Config,
    request: &Request<ReqBody>,
) -> Response<ResponseBody<ResBody>> {
    let (method, uri, extensions) = (request.method(), request.uri(), request.extensions());
    let endpoint = endpoint(config, method, uri, extensions).concat();
    Rejection::new(reason, Some(endpoint)).into_response(Protocol::of(request.headers()), config)
}

/// The answer to a keyed request that names no principal on a route that allows no
/// anonymous requests. The first one logs an error naming the fix; the rest, a debug line
/// (each is also counted: `idempotency_requests_total{outcome="principal_missing"}`).
fn refuse_anonymous<ResBody>(config: &Config, parts: &Parts) -> Response<ResponseBody<ResBody>> {
    static LOGGED: AtomicBool = AtomicBool::new(false);
    let endpoint = endpoint(config, &parts.method, &parts.uri, &parts.extensions).concat();
    if LOGGED.swap(true, Ordering::Relaxed) {
        tracing::debug!(%endpoint, "idempotency: a keyed request named no principal: refused");
    } else {
        tracing::error!(
            %endpoint,
            "idempotency: a keyed request named no principal, and sharing one anonymous scope \
             between its callers was not chosen: refused with 500. Set a Principal extension \
             in the authentication layer (or name the principal with \
             IdempotencyLayer::principal), or opt in with IdempotencyLayer::allow_anonymous \
             or IdempotencyLayer::unscoped"
        );
    }
    let rejection = Rejection::new(Reason::PrincipalMissing, Some(endpoint));
    rejection.into_response(Protocol::of(&parts.headers), config)
}

async fn buffer_request<B>(parts: &Parts, body: B, limit: usize) -> Result<Bytes, Reason>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    let too_large = Reason::BodyTooLarge { limit };
    // A declared length over the limit is refused before reading a byte.
    let declared = parts
        .headers
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if declared.is_some_and(|len| len > limit as u64) {
        return Err(too_large);
    }
    // A limit layer outside this one fails the body with its own `LengthLimitError`,
    // which a router between them may wrap: look through the causes.
    let reading = |error: BoxError| {
        let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(&*error);
        while let Some(error) = cause {
            if error.is::<LengthLimitError>() {
                return too_large;
            }
            cause = error.source();
        }
        Reason::InvalidBody
    };
    // Most bodies arrive as one chunk, kept as it came; more are joined. (`collect` would
    // queue every chunk in a list first, one allocation more per request.)
    let mut body = std::pin::pin!(Limited::new(body, limit));
    let (mut first, mut joined) = (Bytes::new(), BytesMut::new());
    while let Some(frame) = body.frame().await {
        let Ok(mut data) = frame.map_err(reading)?.into_data() else {
            continue;
        };
        let data = data.copy_to_bytes(data.remaining());
        if first.is_empty() {
            first = data;
        } else {
            if joined.is_empty() {
                joined.extend_from_slice(&first);
            }
            joined.extend_from_slice(&data);
        }
    }
    Ok(if joined.is_empty() {
        first
    } else {
        joined.freeze()
    })
}

/// The request's scope; the endpoint goes into the storage key in pieces, never assembled
/// on its own.
fn scope(
    config: &Config,
    parts: &Parts,
    principal: Option<&Principal>,
    key: IdempotencyKey,
) -> Scope {
    let endpoint = endpoint(config, &parts.method, &parts.uri, &parts.extensions);
    Scope::from_parts(principal.map(Principal::as_str), &endpoint, key)
}

/// The endpoint part of a request's scope, in pieces: the layer's endpoint name, or
/// `"<METHOD> <path>"` (the route template with `endpoint_from_matched_path`).
fn endpoint<'a>(
    config: &'a Config,
    method: &'a Method,
    uri: &'a Uri,
    extensions: &'a Extensions,
) -> [&'a str; 3] {
    let path = match &config.endpoint {
        Endpoint::Fixed(name) => return [name, "", ""],
        #[cfg(feature = "axum")]
        Endpoint::MatchedPath => extensions
            .get::<axum::extract::MatchedPath>()
            .map_or(uri.path(), |matched| matched.as_str()),
        Endpoint::MethodAndPath => uri.path(),
    };
    #[cfg(not(feature = "axum"))]
    let _ = extensions;
    [method.as_str(), " ", path]
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

#[cfg(test)]
mod tests {
    use http_body::Frame;
    use http_body_util::StreamBody;

    use super::*;

    /// The body `buffer_request` makes of `frames` (data, or trailers where `None`).
    async fn buffered(frames: &[Option<&str>], limit: usize) -> Result<Bytes, Reason> {
        let frames: Vec<Result<Frame<Bytes>, std::io::Error>> = frames
            .iter()
            .map(|frame| {
                Ok(match frame {
                    Some(data) => Frame::data(Bytes::copy_from_slice(data.as_bytes())),
                    None => Frame::trailers(http::HeaderMap::new()),
                })
            })
            .collect();
        let body = StreamBody::new(futures_util::stream::iter(frames));
        let parts = Request::new(()).into_parts().0;
        buffer_request(&parts, body, limit).await
    }

    #[tokio::test]
    async fn chunks_are_joined_in_order_and_trailers_skipped() {
        assert_eq!(buffered(&[Some("abc")], 64).await.unwrap(), "abc");
        assert_eq!(
            buffered(&[Some(""), Some("ab"), Some(""), Some("c"), None], 64)
                .await
                .unwrap(),
            "abc"
        );
        assert_eq!(
            buffered(&[Some("a"), Some("b"), Some("c")], 64)
                .await
                .unwrap(),
            "abc"
        );
        assert_eq!(buffered(&[], 64).await.unwrap(), "");
    }

    #[tokio::test]
    async fn a_body_over_the_limit_is_refused_however_it_is_chunked() {
        assert_eq!(
            buffered(&[Some("ab"), Some("cd")], 3).await,
            Err(Reason::BodyTooLarge { limit: 3 })
        );
        assert_eq!(
            buffered(&[Some("abcd")], 3).await,
            Err(Reason::BodyTooLarge { limit: 3 })
        );
        assert_eq!(buffered(&[Some("ab"), Some("c")], 3).await.unwrap(), "abc");
    }
}
