//! The `Idempotency` service: lets through what the layer does not handle, refuses what it
//! cannot handle before reading a body, and hands every keyed request to `execute`.

use std::{
    fmt,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    task::{Context, Poll},
};

use bytes::Bytes;
use http::{request::Parts, Request, Response};
use http_body::Body;
use tower_service::Service;
use tracing::Instrument;

use super::{
    body::ResponseBody,
    config::Config,
    execute,
    future::ResponseFuture,
    rejection::Reason,
    request_body::{BoxError, HandOnBody},
    scope,
    state::Shared,
    telemetry::{self, RequestOutcome},
};
use crate::IdempotencyKey;

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
    shared: Arc<Shared>,
}

impl<S> Idempotency<S> {
    pub(crate) fn new(inner: S, shared: Arc<Shared>) -> Self {
        Self { inner, shared }
    }
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for Idempotency<S>
where
    S: Service<Request<ReqBody::HandedOn>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqBody: HandOnBody + Send + 'static,
    ReqBody::HandedOn: Send + 'static,
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
        let shared = &self.shared;
        let (config, meters) = (&shared.config, &shared.state.meters);
        if !config.methods.contains(request.method()) {
            return ResponseFuture::pass_through(self.inner.call(request.map(HandOnBody::unread)));
        }
        if config.body_key.is_some() {
            // The key is in the body: looked for once it is read.
            let clone = self.inner.clone();
            let inner = std::mem::replace(&mut self.inner, clone);
            let keyed = execute::keyed(inner, shared.clone(), None, request.into_parts());
            return instrumented(config, keyed);
        }
        let key = match IdempotencyKey::from_header_values(
            request.headers().get_all(&config.header_name),
        ) {
            Ok(Some(key)) => key,
            Ok(None) if config.required => {
                meters.answered(RequestOutcome::KeyMissing);
                let (parts, _) = request.into_parts();
                return ResponseFuture::answered(config.refuse(Reason::KeyRequired, &parts));
            }
            Ok(None) => {
                let request = request.map(HandOnBody::unread);
                return ResponseFuture::pass_through(self.inner.call(request));
            }
            Err(_) => {
                meters.answered(RequestOutcome::InvalidKey);
                let (parts, _) = request.into_parts();
                return ResponseFuture::answered(config.refuse(Reason::InvalidKey, &parts));
            }
        };
        // The service that was made ready goes with this request; the clone stays for the next.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let (parts, body) = request.into_parts();
        let principal = config.principal.0.extract(&parts);
        if principal.is_none() && !config.anonymous && !config.unscoped {
            meters.answered(RequestOutcome::PrincipalMissing);
            return ResponseFuture::answered(refuse_anonymous(config, &parts));
        }
        let keyed = execute::keyed(inner, shared.clone(), Some((principal, key)), (parts, body));
        instrumented(config, keyed)
    }
}

/// A keyed request's future, in the request's span: one no subscriber records is left out,
/// since entering it on every poll costs.
fn instrumented<P, B, E, F>(config: &Config, keyed: F) -> ResponseFuture<P, B, E>
where
    F: std::future::Future<Output = Result<Response<ResponseBody<B>>, E>> + Send + 'static,
{
    let span = telemetry::request_span(config.span_level);
    if span.is_disabled() {
        ResponseFuture::keyed(Box::pin(keyed))
    } else {
        ResponseFuture::keyed(Box::pin(keyed.instrument(span)))
    }
}

/// The answer to a keyed request that names no principal on a route that allows no
/// anonymous requests. The first one logs an error naming the fix; the rest, a debug line
/// (each is also counted: `idempotency_requests_total{outcome="principal_missing"}`).
pub(crate) fn refuse_anonymous<ResBody>(
    config: &Config,
    parts: &Parts,
) -> Response<ResponseBody<ResBody>> {
    static LOGGED: AtomicBool = AtomicBool::new(false);
    let endpoint = scope::endpoint_of(&config.endpoint, parts);
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
    config.refuse_at(Reason::PrincipalMissing, parts, endpoint)
}

impl<S: fmt::Debug> fmt::Debug for Idempotency<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Idempotency")
            .field("inner", &self.inner)
            .field("store", &self.shared.store)
            .field("config", &self.shared.config)
            .finish()
    }
}
