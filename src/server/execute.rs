//! The story of one keyed request: read its body, scope and fingerprint it, claim its
//! key, then answer from what the claim found, or execute once and record the outcome.

use std::{
    fmt,
    future::Future,
    panic::AssertUnwindSafe,
    sync::{Arc, Mutex, PoisonError},
    time::Duration,
};

use bytes::Bytes;
use futures_util::FutureExt;
use http::{request::Parts, Request, Response};
use http_body::Body;
use tokio::time::Instant;
use tower_service::Service;

use super::{
    body::ResponseBody,
    canonical_json::Parsed,
    capture,
    derived_key::DerivedKeys,
    grpc::Protocol,
    lease::{self, FinishOnDrop, Lease},
    principal::Principal,
    rejection::{Reason, Rejection},
    replay::replay,
    request_body::{self, BoxError, HandOnBody},
    scope,
    service::{principal_of, refuse_anonymous, refuse_key},
    state::Shared,
    telemetry::{self, RequestOutcome},
    wait,
};
use crate::{
    fingerprint::SentHeaders, request_path::RequestPath, store::Claim, ClaimToken, Fingerprint,
    IdempotencyKey,
};

/// Answers a keyed request: a replay, a rejection, or the inner service's response
/// (recorded unless released).
///
/// `key` is the principal and key read before the body, or `None` on a route whose key is
/// in the body ([`key_from_json`](crate::IdempotencyLayer::key_from_json)): looked for once
/// the body is read, and a request whose body holds none is refused on a required route,
/// and passed through otherwise, as one without the header would be.
///
/// Everything runs in the request's own task; an execution whose request is dropped
/// finishes in a task of its own, so a client disconnecting cannot cancel it or its
/// recording.
///
/// A `fn` returning an `async move` block rather than an `async fn`, which would keep each
/// argument twice in the future (the argument, and the local it is moved into).
#[allow(clippy::manual_async_fn)] // on purpose: see above
pub(crate) fn keyed<S, ReqBody, ResBody>(
    mut inner: S,
    shared: Arc<Shared>,
    key: Option<(Option<Principal>, IdempotencyKey)>,
    (mut parts, body): (Parts, ReqBody),
) -> impl Future<Output = Result<Response<ResponseBody<ResBody>>, S::Error>>
where
    S: Service<Request<ReqBody::HandedOn>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqBody: HandOnBody + Send + 'static,
    ReqBody::HandedOn: Send + 'static,
    ReqBody::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: fmt::Display + Send,
{
    async move {
        let config = &shared.config;
        let meters = &shared.state.meters;
        // Read only where the layer answers by itself: a replay never needs it.
        let protocol = || Protocol::of(&parts.headers);
        let renderer = config.render_rejections.as_deref();
        let body = match request_body::read_whole(&parts, body, config.max_request_body).await {
            Ok(body) => body,
            Err(reason) => {
                shared.answered(match reason {
                    Reason::BodyTooLarge { .. } => RequestOutcome::BodyTooLarge,
                    _ => RequestOutcome::InvalidBody,
                });
                return Ok(config.refuse(reason, &parts));
            }
        };
        // Parsed once, if at all, for the key and the fingerprint both.
        let mut parsed = Parsed::new(&body);
        let (principal, key) = match key {
            Some(read) => read,
            None => match in_body(&shared, &parts, &mut parsed) {
                Found::Key(principal, key) => (principal, key),
                Found::Refused(refused) => return Ok(refused),
                Found::Nothing => {
                    drop(parsed);
                    let request = Request::from_parts(parts, ReqBody::rebuilt(body));
                    // Boxed: kept in place, the handler's future would make every keyed
                    // request's future larger.
                    let response = Box::pin(inner.call(request)).await?;
                    return Ok(response.map(ResponseBody::inner));
                }
            },
        };
        // Read once, for the scope and the fingerprint both.
        let sent = RequestPath::of(&parts);
        let scope = scope::of_request(&config.endpoint, &parts, &sent, principal.as_ref(), key);
        telemetry::show_scope(&scope, config);
        let fingerprint = config
            .fingerprint
            .of(&parts, &sent, &config.fingerprint_headers, parsed);
        drop(sent);
        let reject = |reason| {
            let rejection = Rejection::new(reason, scope.endpoint().to_owned());
            Ok(rejection.into_response(protocol(), renderer))
        };
        let mut sent = Instant::now();
        let token = ClaimToken::unique_at(sent.into_std());
        let (mut claim, mut answered_at) =
            lease::claim(&shared, &scope, fingerprint, token, sent).await;
        // A duplicate of a running request may wait for its outcome (opt-in, bounded).
        let mut waited = false;
        if let Some(bound) = config.wait {
            let duplicate = matches!(&claim, Ok(Claim::InProgress { fingerprint: theirs, .. }) if *theirs == fingerprint);
            if let Some(_waiting) = duplicate
                .then(|| shared.state.waiters.enter(config.max_waiting))
                .flatten()
            {
                // When the last claim was sent: one that takes the key runs its lease from
                // then, as the first claim would have.
                let last_sent = Mutex::new(sent);
                let again = || {
                    let sent = Instant::now();
                    *last_sent.lock().unwrap_or_else(PoisonError::into_inner) = sent;
                    let claim = lease::claim(&shared, &scope, fingerprint, token, sent);
                    async move { claim.await.0 }
                };
                let store = &*shared.store;
                // Boxed: kept in place, this rare path would make every request's future
                // larger.
                let waiting =
                    wait::for_original(store, &scope, fingerprint, (bound, config.lease), again);
                claim = Box::pin(waiting).await;
                waited = true;
                answered_at = Instant::now();
                sent = last_sent
                    .into_inner()
                    .unwrap_or_else(PoisonError::into_inner);
            }
        }
        let answered = |outcome| shared.answered(outcome);
        match claim {
            Ok(Claim::Claimed(_)) => {}
            Ok(Claim::InProgress {
                fingerprint: theirs,
                ..
            }) if theirs != fingerprint => {
                answered(RequestOutcome::Mismatch);
                return reject(Reason::ReusedWithDifferentParams);
            }
            // A record of a negotiated response (`Vary`) keeps the fingerprint varied by
            // what its request asked for: only a retry asking the same matches. A record
            // of a response that varies on nothing keeps the plain one.
            Ok(Claim::Completed {
                fingerprint: theirs,
                response,
                ..
            }) if theirs == fingerprint
                || theirs == fingerprint.varied(&response.headers, &parts.headers) =>
            {
                answered(if waited {
                    RequestOutcome::Waited
                } else {
                    RequestOutcome::Replayed
                });
                return Ok(replay(response));
            }
            Ok(Claim::Completed { .. }) => {
                answered(RequestOutcome::Mismatch);
                return reject(Reason::ReusedWithDifferentParams);
            }
            Ok(Claim::InProgress {
                lease_remaining,
                running_for,
                ..
            }) => {
                let retry_after = retry_after(running_for, lease_remaining, config.ttl);
                answered(RequestOutcome::InProgress);
                return reject(Reason::InProgress { retry_after });
            }
            // Never for a duplicate that waited: the store has said that another request
            // holds its key, and its failure since (perhaps one read shared by every
            // waiter) says nothing of that execution's end. Executed unprotected, each
            // waiting duplicate would run the payment again.
            Err(error) if config.fail_open && !waited && !lease::too_late_to_run(&error) => {
                tracing::warn!(
                    %error,
                    "idempotency store unavailable: executing WITHOUT idempotency protection (fail-open)"
                );
                answered(RequestOutcome::FailOpen);
                if config.derive_keys {
                    parts.extensions.insert(DerivedKeys::of(&scope));
                }
                let request = Request::from_parts(parts, ReqBody::rebuilt(body));
                // Boxed: kept in place, this rare path's future would make every request's
                // future larger.
                let started = Instant::now();
                let mut inner = inner;
                let response = Box::pin(inner.call(request)).await;
                meters.executed_for(started.elapsed());
                return Ok(response?.map(ResponseBody::inner));
            }
            Err(error) => {
                tracing::error!(
                    %error,
                    "idempotency store unavailable: refusing the request (fail-closed)"
                );
                answered(RequestOutcome::StoreUnavailable);
                return reject(Reason::StoreUnavailable);
            }
        }
        let protocol = protocol();
        if config.derive_keys {
            parts.extensions.insert(DerivedKeys::of(&scope));
        }
        shared.store.hand_over(token, &mut parts.extensions);
        // The lease runs from when its claim (after waiting, the last) was sent, no later
        // than the store applied it.
        let lease = Lease::new(shared, scope, token, sent);
        // Rebuilt only here: a replay or a rejection never needs the request again.
        let request = Request::from_parts(parts, ReqBody::rebuilt(body));
        // Timed from the claim's answer: what runs in between is the layer's own work of
        // a microsecond or so, and one clock reading fewer per execution.
        let started = answered_at;
        FinishOnDrop::new(|| execute(lease, protocol, inner, fingerprint, request, started)).await
    }
}

/// What a body-keyed route found in a request's body.
enum Found<B> {
    Key(Option<Principal>, IdempotencyKey),
    /// No key: the request passes through.
    Nothing,
    /// The layer's answer: no key on a required route, an invalid one, or no principal.
    Refused(Response<ResponseBody<B>>),
}

/// The key in `body`, where the route's `BodyKey` finds it, and the principal to scope it
/// by: checked as the header's key and principal are before the body is read.
fn in_body<B>(shared: &Shared, parts: &Parts, body: &mut Parsed<'_>) -> Found<B> {
    let config = &shared.config;
    let Some(body_key) = &config.body_key else {
        return Found::Nothing;
    };
    let key = match body_key.find(parts, body) {
        Ok(Some(key)) => key,
        Ok(None) if config.required => {
            return Found::Refused(refuse_key(shared, Reason::KeyRequired, parts));
        }
        Ok(None) => return Found::Nothing,
        Err(_) => return Found::Refused(refuse_key(shared, Reason::InvalidKey, parts)),
    };
    match principal_of(shared, parts) {
        Ok(principal) => Found::Key(principal, key),
        Err(_) => Found::Refused(refuse_anonymous(config, parts)),
    }
}

/// Runs the inner service, begun at `started`, once, keeping the lease alive, then records
/// or releases.
///
/// A `fn` returning an `async move` block, as [`keyed`] is, for the same reason: the
/// future keeps each argument once, about four hundred bytes fewer to write.
#[allow(clippy::manual_async_fn)] // on purpose: see above
fn execute<S, ReqBody, ResBody>(
    lease: Lease,
    protocol: Protocol,
    mut inner: S,
    fingerprint: Fingerprint,
    request: Request<ReqBody>,
    started: Instant,
) -> impl Future<Output = Result<Response<ResponseBody<ResBody>>, S::Error>>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
    ResBody: Body<Data = Bytes>,
    ResBody::Error: fmt::Display,
{
    // What the request asked for, in case the response turns out to be negotiated on it
    // (`Vary`): its record must match only retries that ask the same.
    let asked = SentHeaders::of(request.headers());
    async move {
        let shared = lease.shared();
        let config = &shared.config;
        // The body is read in the call (see `capture::capture`): renewed and caught alike.
        let call = AssertUnwindSafe(async move {
            let response = inner.call(request).await?;
            Ok(if config.release.releases_status(response.status()) {
                Called::Released(response)
            } else {
                Called::Captured(capture::capture(response, config.max_response_body).await)
            })
        })
        .catch_unwind();
        let called = lease.renew_while(call, started).await;
        let ran = || shared.state.meters.executed_for(started.elapsed());
        match called {
            Err(panic) => {
                ran();
                lease
                    .release("the handler or its response body panicked")
                    .await;
                std::panic::resume_unwind(panic)
            }
            Ok(Err(error)) => {
                ran();
                lease.release("the inner service failed").await;
                Err(error)
            }
            Ok(Ok(Called::Released(response))) => {
                ran();
                lease.release("the response status releases the key").await;
                Ok(response.map(ResponseBody::inner))
            }
            // Timed there, to the end of the body it captured.
            Ok(Ok(Called::Captured(captured))) => {
                let recorded =
                    capture::record(&lease, protocol, fingerprint, &asked, captured, started);
                Ok(recorded.await)
            }
        }
    }
}

/// What the inner service's call came to: a response whose status gives the key back,
/// passed on as it streams, or one captured to record.
enum Called<B: Body> {
    Released(Response<B>),
    Captured(capture::Captured<B>),
}

/// When a duplicate should come back: after as long again as the holder has been running
/// (a result that took a second so far is likely a second away; one that took ten, ten),
/// at least a second, and no later than the lease runs out (when a crashed holder's key
/// frees itself). Unknown running time counts as none: ask again soon.
///
/// Nor later than half the time the record is kept (`ttl`, in the whole seconds
/// `Retry-After` rounds up to, at least one): the holder may complete right after this
/// answer, and a duplicate that comes back when told, however late on the way, must find
/// its record, not execute again. (A TTL under two seconds cannot be kept so.)
fn retry_after(
    running_for: Option<Duration>,
    lease_remaining: Duration,
    ttl: Duration,
) -> Duration {
    let soonest = Duration::from_secs(1);
    let kept = Duration::from_secs(ttl.as_secs() / 2);
    running_for
        .unwrap_or_default()
        .max(soonest)
        .min(lease_remaining.max(soonest))
        .min(kept.max(soonest))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_tracks_the_running_time_within_the_lease() {
        let secs = Duration::from_secs;
        let (lease, ttl) = (secs(29), secs(86_400));
        assert_eq!(retry_after(None, lease, ttl), secs(1));
        assert_eq!(
            retry_after(Some(Duration::from_millis(80)), lease, ttl),
            secs(1)
        );
        assert_eq!(retry_after(Some(secs(7)), lease, ttl), secs(7));
        assert_eq!(retry_after(Some(secs(40)), lease, ttl), lease);
        // A lease about to run out still leaves a second to come back in.
        assert_eq!(retry_after(Some(secs(5)), Duration::ZERO, ttl), secs(1));
    }

    #[test]
    fn retry_after_never_outlasts_the_record() {
        let secs = Duration::from_secs;
        let lease = secs(29);
        assert_eq!(retry_after(Some(secs(7)), lease, secs(10)), secs(5));
        // In the whole seconds the header rounds up to: half of 5.5 s of TTL is told as 2.
        let told = retry_after(Some(secs(7)), lease, Duration::from_millis(5500));
        assert_eq!(told, secs(2));
        // At least a second, whatever the TTL.
        assert_eq!(
            retry_after(Some(secs(7)), lease, Duration::from_millis(300)),
            secs(1)
        );
    }
}
