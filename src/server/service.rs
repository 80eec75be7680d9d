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
    future::{boxed_in_place, ResponseFuture},
    principal::Principal,
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
        let config = &shared.config;
        if !config.methods.contains(request.method()) {
            return ResponseFuture::pass_through(self.inner.call(request.map(HandOnBody::unread)));
        }
        if config.body_key.is_some() {
            // The key is in the body: looked for once it is read.
            let inner = take_ready(&mut self.inner);
            let shared = shared.clone();
            return instrumented(config, || {
                execute::keyed(inner, shared, None, request.into_parts())
            });
        }
        let key = match IdempotencyKey::from_header_values(
            request.headers().get_all(&config.header_name),
        ) {
            Ok(Some(key)) => key,
            Ok(None) if config.required => {
                let (parts, _) = request.into_parts();
                return ResponseFuture::answered(refuse_key(shared, Reason::KeyRequired, &parts));
            }
            Ok(None) => {
                let request = request.map(HandOnBody::unread);
                return ResponseFuture::pass_through(self.inner.call(request));
            }
            Err(_) => {
                let (parts, _) = request.into_parts();
                return ResponseFuture::answered(refuse_key(shared, Reason::InvalidKey, &parts));
            }
        };
        let inner = take_ready(&mut self.inner);
        let (parts, body) = request.into_parts();
        let Ok(principal) = principal_of(shared, &parts) else {
            return ResponseFuture::answered(refuse_anonymous(config, &parts));
        };
        let shared = shared.clone();
        instrumented(config, || {
            execute::keyed(inner, shared, Some((principal, key)), (parts, body))
        })
    }
}

/// The service that was made ready, to go with this request; a clone stays for the next.
fn take_ready<S: Clone>(inner: &mut S) -> S {
    let clone = inner.clone();
    std::mem::replace(inner, clone)
}

/// The answer to a request whose key is missing on a required route
/// ([`Reason::KeyRequired`]) or invalid ([`Reason::InvalidKey`]), counted.
#[cold]
pub(crate) fn refuse_key<B>(
    shared: &Shared,
    reason: Reason,
    parts: &Parts,
) -> Response<ResponseBody<B>> {
    let outcome = match reason {
        Reason::KeyRequired => RequestOutcome::KeyMissing,
        _ => RequestOutcome::InvalidKey,
    };
    shared.answered(outcome);
    shared.config.refuse(reason, parts)
}

/// The principal a keyed request is scoped by; an error, counted, for one that names none
/// on a route that allows no anonymous requests (answered with [`refuse_anonymous`]).
pub(crate) fn principal_of(
    shared: &Shared,
    parts: &Parts,
) -> Result<Option<Principal>, PrincipalMissing> {
    let config = &shared.config;
    // An empty name (a blank header, a token whose subject is "") is no principal: its
    // scope is the anonymous one, which only a route that opts in may share.
    let principal = config
        .principal
        .0
        .extract(parts)
        .filter(|principal| !principal.as_str().is_empty());
    if principal.is_none() && !config.anonymous && !config.unscoped {
        shared.answered(RequestOutcome::PrincipalMissing);
        return Err(PrincipalMissing);
    }
    Ok(principal)
}

/// A keyed request named no principal where one is needed. A marker, not the refusal
/// itself: every keyed request returns this `Result`, and a response in it would make it
/// 160 bytes larger.
pub(crate) struct PrincipalMissing;

/// A keyed request's future, made in its box, in the request's span: one no subscriber
/// records is left out, since entering it on every poll costs.
#[inline(always)]
fn instrumented<P, B, E, F>(config: &Config, keyed: impl FnOnce() -> F) -> ResponseFuture<P, B, E>
where
    F: std::future::Future<Output = Result<Response<ResponseBody<B>>, E>> + Send + 'static,
{
    let span = telemetry::request_span(config.span_level);
    if span.is_disabled() {
        ResponseFuture::keyed(boxed_in_place(keyed))
    } else {
        ResponseFuture::keyed(boxed_in_place(|| keyed().instrument(span)))
    }
}

/// The answer to a keyed request that names no principal on a route that allows no
/// anonymous requests. The first one logs an error naming the fix; the rest, a debug line
/// (each is also counted: `idempotency_requests_total{outcome="principal_missing"}`).
#[cold]
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
