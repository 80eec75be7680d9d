//! A claimed key: execute once, keep the lease alive, record or release the outcome.

use std::{
    convert::Infallible,
    fmt,
    future::Future,
    panic::AssertUnwindSafe,
    pin::Pin,
    sync::{Arc, Mutex, PoisonError},
    task::{Context, Poll},
    time::Duration,
};

use bytes::{Bytes, BytesMut};
use futures_util::FutureExt;
use http::{header, request::Parts, HeaderMap, HeaderName, Request, Response, StatusCode};
use http_body::Body;
use http_body_util::BodyExt;
use tower_service::Service;
use tracing::Instrument;

use tokio::time::Instant;

use crate::{
    body::ResponseBody,
    fingerprint::SentHeaders,
    grpc::{Protocol, ResponseHead},
    in_flight::Execution,
    layer::Config,
    rejection::{Reason, Rejection},
    replay::replay,
    request_body::HandOnBody,
    store::{self, Claim, Fenced, Store},
    telemetry::{Operation, Outcome},
    wait, ClaimToken, Fingerprint, Scope, StoredResponse,
};

/// The first pause before writing an outcome again after the store failed the write, and
/// the longest: doubled each time in between. The writes go on until one is answered or the
/// claim's lease runs out.
const WRITE_RETRY_FIRST: Duration = Duration::from_millis(25);
const WRITE_RETRY_MAX: Duration = Duration::from_secs(1);

/// Claims `scope` and answers: a replay, a conflict, or the inner service's response
/// (recorded unless released).
///
/// Everything runs in the request's own task; an execution whose request is dropped
/// finishes in a task of its own, so a client disconnecting cannot cancel it or its
/// recording.
///
/// A `fn` returning an `async move` block, like its caller: an `async fn` would keep each
/// argument twice in the future.
#[allow(clippy::manual_async_fn)] // on purpose: see above
pub(crate) fn run<S, ReqBody, ResBody>(
    mut inner: S,
    store: Arc<dyn Store>,
    config: Arc<Config>,
    scope: Scope,
    fingerprint: Fingerprint,
    (parts, body): (Parts, Bytes),
) -> impl Future<Output = Result<Response<ResponseBody<ResBody>>, S::Error>>
where
    S: Service<Request<ReqBody::Inner>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqBody: HandOnBody + Send + 'static,
    ReqBody::Inner: Send + 'static,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: fmt::Display + Send,
{
    async move {
        // Read only where the layer answers by itself: a replay never needs it.
        let protocol = || Protocol::of(&parts.headers);
        let reject = |reason| {
            let rejection = Rejection::new(reason, Some(scope.endpoint().to_owned()));
            Ok(rejection.into_response(protocol(), &config))
        };
        let token = ClaimToken::unique();
        let mut claim = {
            let abandoned = AbandonedClaim::arm(&store, &config, &scope, token);
            let started = std::time::Instant::now();
            let claim = store
                .claim_with_token(&scope, fingerprint, token, config.lease)
                .await;
            config.meters.stored(Operation::Claim, started, &claim);
            if settled(&claim) {
                abandoned.disarm();
            }
            claim
        };
        // A duplicate of a running request may wait for its outcome (opt-in, bounded).
        let mut waited = false;
        if let Some(bound) = config.wait {
            let duplicate = matches!(&claim, Ok(Claim::InProgress { fingerprint: theirs, .. }) if *theirs == fingerprint);
            if let Some(_waiting) = duplicate
                .then(|| config.waiters.enter(config.max_waiting))
                .flatten()
            {
                let again = || claim_key(&store, &config, &scope, fingerprint, token);
                // Boxed: kept in place, this rare path would make every request's future
                // larger.
                let waiting =
                    wait::for_original(&*store, &scope, fingerprint, (bound, config.lease), again);
                claim = Box::pin(waiting).await;
                waited = true;
            }
        }
        let answered = |outcome| config.meters.answered(outcome);
        match claim {
            Ok(Claim::Claimed(_)) => {}
            Ok(Claim::InProgress {
                fingerprint: theirs,
                ..
            }) if theirs != fingerprint => {
                answered(Outcome::Mismatch);
                return reject(Reason::ReusedWithDifferentParams);
            }
            // A record of a negotiated response (`Vary`) keeps the fingerprint varied by
            // what its request asked for: only a retry asking the same matches. A record
            // kept before that, or of a response that varies on nothing, keeps the plain one.
            Ok(Claim::Completed {
                fingerprint: theirs,
                response,
                ..
            }) if theirs == fingerprint
                || theirs == fingerprint.varied(&response.headers, &parts.headers) =>
            {
                answered(if waited {
                    Outcome::Waited
                } else {
                    Outcome::Replayed
                });
                return Ok(replay(response));
            }
            Ok(Claim::Completed { .. }) => {
                answered(Outcome::Mismatch);
                return reject(Reason::ReusedWithDifferentParams);
            }
            Ok(Claim::InProgress {
                lease_remaining,
                running_for,
                ..
            }) => {
                let retry_after = retry_after(running_for, lease_remaining);
                answered(Outcome::InProgress);
                return reject(Reason::InProgress { retry_after });
            }
            Err(error) if config.fail_open => {
                tracing::warn!(
                    %error,
                    "idempotency store unavailable: executing WITHOUT idempotency protection (fail-open)"
                );
                answered(Outcome::FailOpen);
                let request = Request::from_parts(parts, ReqBody::buffered(body));
                // Boxed: kept in place, this rare path's future would make every request's
                // future larger.
                let started = Instant::now();
                let response = Box::pin(inner.call(request)).await;
                config.meters.executed_for(started.elapsed());
                return Ok(response?.map(ResponseBody::inner));
            }
            Err(error) => {
                tracing::error!(
                    %error,
                    "idempotency store unavailable: refusing the request (fail-closed)"
                );
                answered(Outcome::StoreUnavailable);
                return reject(Reason::StoreUnavailable);
            }
        }
        // Read once claimed, so that a replay pays nothing for it: the lease began a round
        // trip earlier, which only lets a write be retried a little past it, where the
        // fence refuses it anyway.
        let claimed_at = Instant::now();
        let held = Held {
            _in_flight: config.in_flight.enter(config.meters.in_flight()),
            store,
            config,
            scope,
            token,
            protocol: protocol(),
            renewed: Mutex::new(claimed_at),
        };
        // Rebuilt only here: a replay or a rejection never needs the request again.
        let request = Request::from_parts(parts, ReqBody::buffered(body));
        FinishOnDrop::new(held.execute(inner, fingerprint, request)).await
    }
}

/// Claims `scope` with `token`, or reads what holds it.
async fn claim_key(
    store: &Arc<dyn Store>,
    config: &Arc<Config>,
    scope: &Scope,
    fingerprint: Fingerprint,
    token: ClaimToken,
) -> store::Result<Claim> {
    let abandoned = AbandonedClaim::arm(store, config, scope, token);
    let started = std::time::Instant::now();
    let claim = store
        .claim_with_token(scope, fingerprint, token, config.lease)
        .await;
    config.meters.stored(Operation::Claim, started, &claim);
    if settled(&claim) {
        abandoned.disarm();
    }
    claim
}

/// Whether a claim's outcome is known. One that failed (a timeout, a dropped connection)
/// may still have been applied: it is released like an abandoned one, so it cannot hold the
/// key for a lease. One the store could not take needs no release, and during an outage
/// sending one would only double the failed attempts. (The first claim of a request is
/// written out in place, as [`claim_key`] is: a call would cost every request a future.)
fn settled(claim: &store::Result<Claim>) -> bool {
    matches!(claim, Ok(_) | Err(store::Error::Unavailable(_)))
}

/// When a duplicate should come back: after as long again as the holder has been running
/// (a result that took a second so far is likely a second away; one that took ten, ten),
/// at least a second, and no later than the lease runs out (when a crashed holder's key
/// frees itself). Unknown running time counts as none: ask again soon.
fn retry_after(running_for: Option<Duration>, lease_remaining: Duration) -> Duration {
    let soonest = Duration::from_secs(1);
    running_for
        .unwrap_or_default()
        .max(soonest)
        .min(lease_remaining.max(soonest))
}

/// An execution polled in place by its request; if the request is dropped first (its client
/// went away), the rest of the execution (the handler, the recording) moves to a task of
/// its own rather than being cancelled. Running in place saves a task per execution; the
/// execution is boxed so it can move without being polled again from scratch.
struct FinishOnDrop<F: Future + Send + 'static>
where
    F::Output: Send,
{
    execution: Option<Pin<Box<F>>>,
    /// The request's span, which the execution keeps in a task of its own.
    span: tracing::Span,
}

impl<F: Future + Send + 'static> FinishOnDrop<F>
where
    F::Output: Send,
{
    fn new(execution: F) -> Self {
        Self {
            execution: Some(Box::pin(execution)),
            span: tracing::Span::current(),
        }
    }
}

impl<F: Future + Send + 'static> Future for FinishOnDrop<F>
where
    F::Output: Send,
{
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        // Taken out while polled: one that panics is dropped here, never handed to a task.
        let mut execution = self
            .execution
            .take()
            .expect("FinishOnDrop polled after completion");
        let poll = execution.as_mut().poll(cx);
        if poll.is_pending() {
            self.execution = Some(execution);
        }
        poll
    }
}

impl<F: Future + Send + 'static> Drop for FinishOnDrop<F>
where
    F::Output: Send,
{
    fn drop(&mut self) {
        let Some(execution) = self.execution.take() else {
            return;
        };
        // Without a runtime (one shutting down) nothing can finish it: the lease frees
        // the key, as after a crash.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(execution.instrument(self.span.clone()));
        }
    }
}

/// Releases a claim whose answer its request never saw (the request was dropped while
/// the claim was in flight, or the claim failed). Release is fenced by the token, so
/// releasing a claim that did not happen is harmless.
struct AbandonedClaim<'a> {
    armed: Option<Armed<'a>>,
}

/// What releasing an abandoned claim takes.
type Armed<'a> = (&'a Arc<dyn Store>, &'a Arc<Config>, &'a Scope, ClaimToken);

impl<'a> AbandonedClaim<'a> {
    fn arm(
        store: &'a Arc<dyn Store>,
        config: &'a Arc<Config>,
        scope: &'a Scope,
        token: ClaimToken,
    ) -> Self {
        Self {
            armed: Some((store, config, scope, token)),
        }
    }

    fn disarm(mut self) {
        self.armed = None;
    }
}

impl Drop for AbandonedClaim<'_> {
    fn drop(&mut self) {
        let Some((store, config, scope, token)) = self.armed.take() else {
            return;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        // Counted from now: the claim left before, so its lease ends no later than this.
        let held = Held {
            _in_flight: config.in_flight.enter(config.meters.in_flight()),
            store: Arc::clone(store),
            config: Arc::clone(config),
            scope: scope.clone(),
            token,
            protocol: Protocol::Http,
            renewed: Mutex::new(Instant::now()),
        };
        let releasing = async move {
            let release = || held.store.release(&held.scope, held.token);
            let released = held.write_until_settled(Operation::Release, release).await;
            if let Err(error) = released {
                tracing::warn!(%error, "could not release an abandoned claim: it frees itself when its lease runs out");
            }
        };
        runtime.spawn(releasing.instrument(tracing::Span::current()));
    }
}

/// A key this request claimed, with what it takes to write to it.
struct Held {
    store: Arc<dyn Store>,
    config: Arc<Config>,
    scope: Scope,
    token: ClaimToken,
    /// How the request expects the layer's own answers.
    protocol: Protocol,
    /// When the last claim or renewal that the store applied was sent: the lease runs
    /// until at least this plus the lease.
    renewed: Mutex<Instant>,
    _in_flight: Execution,
}

impl Held {
    /// Runs the inner service, keeping the lease alive, then records or releases.
    async fn execute<S, ReqBody, ResBody>(
        self,
        mut inner: S,
        fingerprint: Fingerprint,
        request: Request<ReqBody>,
    ) -> Result<Response<ResponseBody<ResBody>>, S::Error>
    where
        S: Service<Request<ReqBody>, Response = Response<ResBody>>,
        ResBody: Body<Data = Bytes>,
        ResBody::Error: fmt::Display,
    {
        // What the request asked for, in case the response turns out to be negotiated on it
        // (`Vary`): its record must match only retries that ask the same.
        let asked = SentHeaders::of(request.headers());
        let call = AssertUnwindSafe(async move { inner.call(request).await }).catch_unwind();
        let started = Instant::now();
        let called = self.renew_while(call).await;
        self.config.meters.executed_for(started.elapsed());
        match called {
            Err(panic) => {
                self.release("the handler panicked").await;
                std::panic::resume_unwind(panic)
            }
            Ok(Err(error)) => {
                self.release("the inner service failed").await;
                Err(error)
            }
            Ok(Ok(response)) if (self.config.release_on)(response.status()) => {
                self.release("the response status releases the key").await;
                Ok(response.map(ResponseBody::inner))
            }
            Ok(Ok(response)) => Ok(self.record(fingerprint, &asked, response).await),
        }
    }

    /// Drives `future` to completion, renewing the lease every third of it.
    async fn renew_while<F: Future>(&self, future: F) -> F::Output {
        // The renewals run beside the handler, never in its way: a slow store delays a
        // renewal, not the handler's next poll. Their schedule starts now, not when first
        // polled, so a handler that blocks its thread finds its renewal overdue.
        let period = self.config.lease / 3;
        let first = tokio::time::Instant::now() + period;
        tokio::select! {
            biased;
            output = future => output,
            never = self.renew_lease(first, period) => match never {},
        }
    }

    /// Renews the lease every `period` from `first`, until the claim is lost.
    async fn renew_lease(&self, first: tokio::time::Instant, period: Duration) -> Infallible {
        let lease = self.config.lease;
        let mut ticks = tokio::time::interval_at(first, period);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticks.tick().await;
            let sent = Instant::now();
            let started = std::time::Instant::now();
            let extended = self.store.extend(&self.scope, self.token, lease).await;
            self.config
                .meters
                .stored(Operation::Extend, started, &extended);
            match extended {
                Ok(Fenced::Applied) => {
                    *self.renewed.lock().unwrap_or_else(PoisonError::into_inner) = sent;
                }
                Ok(Fenced::Lost) => {
                    self.warn(
                        "lease lost while the handler ran: another request may execute this key",
                    );
                    return std::future::pending().await;
                }
                Err(error) => tracing::warn!(%error, "could not renew the idempotency lease"),
            }
        }
    }

    /// Runs a write after the handler until the store answers it: a blip (a restart, a
    /// failover, a dropped connection) must not cost the record, or the next retry would
    /// run the operation again. Retried with backoff while the store fails, for as long as
    /// the claim's lease lasts (counted from the last renewal the store applied), and the
    /// lease is renewed meanwhile whenever the store answers. Writes are fenced and
    /// idempotent, so repeating one that did apply is harmless; past the lease, the key
    /// may be another request's, and the fence would refuse the write anyway.
    async fn write_until_settled<'a, F>(
        &'a self,
        operation: Operation,
        write: impl Fn() -> F,
    ) -> store::Result<Fenced>
    where
        F: Future<Output = store::Result<Fenced>> + 'a,
    {
        let meters = &self.config.meters;
        // The first attempt goes alone: a store that answers (nearly always) costs no timer.
        let started = std::time::Instant::now();
        let written = write().await;
        meters.stored(operation, started, &written);
        let first = match written {
            Err(error) => error,
            done => return done,
        };
        let retries = async {
            let mut error = first;
            let mut backoff = WRITE_RETRY_FIRST;
            loop {
                let next = Instant::now() + backoff;
                if next >= self.lease_ends() {
                    return Err(error);
                }
                tracing::warn!(
                    %error, retry_in = ?backoff,
                    "idempotency store write failed; retrying while the lease lasts"
                );
                tokio::time::sleep_until(next).await;
                backoff = (backoff * 2).min(WRITE_RETRY_MAX);
                let started = std::time::Instant::now();
                let written = write().await;
                meters.stored(operation, started, &written);
                error = match written {
                    Err(error) => error,
                    done => return done,
                };
            }
        };
        self.renew_while(retries).await
    }

    /// When the claim's lease runs out, as far as this request knows.
    fn lease_ends(&self) -> Instant {
        *self.renewed.lock().unwrap_or_else(PoisonError::into_inner) + self.config.lease
    }

    async fn release(&self, why: &str) {
        let release = || self.store.release(&self.scope, self.token);
        match self.write_until_settled(Operation::Release, release).await {
            Ok(Fenced::Applied) => {
                tracing::debug!(why, "idempotency key released");
            }
            Ok(Fenced::Lost) => self.warn("could not release: the claim was already lost"),
            Err(error) => tracing::error!(
                %error, why,
                "could not release the idempotency key within its lease: it frees itself as the lease runs out"
            ),
        }
        self.config.meters.answered(Outcome::Released);
    }

    /// Buffers the response (up to `max_response_body`), stores it, and returns it.
    async fn record<B>(
        &self,
        fingerprint: Fingerprint,
        asked: &SentHeaders,
        response: Response<B>,
    ) -> Response<ResponseBody<B>>
    where
        B: Body<Data = Bytes>,
        B::Error: fmt::Display,
    {
        let (parts, body) = response.into_parts();
        let (stored, body, fingerprint, outcome) = match buffer_response(
            body,
            self.config.max_response_body,
        )
        .await
        {
            Buffered::Whole { body, trailers } => {
                if self.releases(&parts, trailers.as_ref()) {
                    self.release("the response releases the key").await;
                    let body = ResponseBody::with_trailers(body, trailers);
                    return Response::from_parts(parts, body);
                }
                let headers = replayable_headers(&parts.headers, self.config.replay_set_cookie);
                let stored = StoredResponse {
                    status: parts.status,
                    headers,
                    body: body.clone(),
                    trailers: trailers.clone(),
                };
                let fingerprint = fingerprint.varied_by_sent(&parts.headers, asked);
                (
                    stored,
                    ResponseBody::with_trailers(body, trailers),
                    fingerprint,
                    Outcome::Executed,
                )
            }
            Buffered::TooLarge { prefix, rest } => {
                self.warn("response larger than max_response_body: retries get 409 response_not_replayable");
                let reason = Reason::NotReplayable {
                    status: parts.status,
                };
                let endpoint = Some(self.scope.endpoint().to_owned());
                let stored =
                    Rejection::new(reason, endpoint).into_stored(self.protocol, &self.config);
                // Not the response but a refusal to replay it, to every retry alike.
                let body = ResponseBody::spliced(prefix, rest);
                (stored, body, fingerprint, Outcome::NotReplayable)
            }
            Buffered::Failed(error) => {
                tracing::error!(%error, "the response body failed");
                self.release("the response body failed").await;
                let mut response = Response::new(ResponseBody::full(Bytes::new()));
                *response.status_mut() = StatusCode::INTERNAL_SERVER_ERROR;
                return response;
            }
        };
        let ttl = self.config.ttl;
        let complete = || {
            self.store
                .complete(&self.scope, self.token, fingerprint, &stored, ttl)
        };
        match self
            .write_until_settled(Operation::Complete, complete)
            .await
        {
            Ok(Fenced::Applied) => {}
            Ok(Fenced::Lost) => {
                self.warn("claim lost before the response was recorded: it will not be replayed")
            }
            Err(error) => tracing::error!(
                %error,
                "could not record the response within the lease: a retry after the lease runs out executes again"
            ),
        }
        self.config.meters.answered(outcome);
        Response::from_parts(parts, body)
    }

    /// Whether a whole response releases the key: the layer's `release_when`, or by default
    /// a transient gRPC status, looked for only on gRPC requests (a plain HTTP response
    /// pays nothing for it).
    fn releases(&self, parts: &http::response::Parts, trailers: Option<&HeaderMap>) -> bool {
        let judge = |judge: &dyn Fn(&ResponseHead<'_>) -> bool| {
            let none = HeaderMap::new();
            judge(&ResponseHead::new(
                parts.status,
                &parts.headers,
                trailers.unwrap_or(&none),
            ))
        };
        match &self.config.release_when {
            Some(release_when) => judge(release_when.as_ref()),
            None => {
                self.protocol == Protocol::Grpc
                    && judge(&|head: &ResponseHead<'_>| head.is_transient_grpc_status())
            }
        }
    }

    fn warn(&self, message: &str) {
        tracing::warn!(token = ?self.token, "{message}");
    }
}

enum Buffered<B: Body> {
    Whole {
        body: Bytes,
        trailers: Option<HeaderMap>,
    },
    TooLarge {
        prefix: Bytes,
        rest: Pin<Box<B>>,
    },
    Failed(B::Error),
}

/// Reads `body` up to `limit` bytes. Boxed, so that a body that is not `Unpin` can be read
/// in place and still handed on whole when it turns out too large.
async fn buffer_response<B>(body: B, limit: usize) -> Buffered<B>
where
    B: Body<Data = Bytes>,
{
    let mut body = Box::pin(body);
    if body.size_hint().lower() > limit as u64 {
        return Buffered::TooLarge {
            prefix: Bytes::new(),
            rest: body,
        };
    }
    // Most bodies are one frame: keep it without copying.
    let mut first: Option<Bytes> = None;
    let mut trailers: Option<HeaderMap> = None;
    let mut more = BytesMut::new();
    let mut len = 0;
    while let Some(frame) = body.frame().await {
        let data = match frame {
            Ok(frame) => match frame.into_data() {
                Ok(data) => data,
                Err(frame) => {
                    if let Ok(more) = frame.into_trailers() {
                        trailers.get_or_insert_with(HeaderMap::new).extend(more);
                    }
                    continue;
                }
            },
            Err(error) => return Buffered::Failed(error),
        };
        len += data.len();
        match &first {
            None => first = Some(data),
            Some(head) => {
                if more.is_empty() {
                    more.extend_from_slice(head);
                }
                more.extend_from_slice(&data);
            }
        }
        if len > limit {
            let prefix = if more.is_empty() {
                first.unwrap_or_default()
            } else {
                more.freeze()
            };
            return Buffered::TooLarge { prefix, rest: body };
        }
    }
    let body = if more.is_empty() {
        first.unwrap_or_default()
    } else {
        more.freeze()
    };
    Buffered::Whole { body, trailers }
}

/// Every header but the hop-by-hop ones (RFC 9110 §7.6.1, and any that `Connection`
/// names) and `Date`, which belong to one transmission, not to the response; and unless
/// `set_cookie`, `Set-Cookie`, which belongs to one client's session: a replay goes to
/// whoever sends the key again.
fn replayable_headers(headers: &HeaderMap, set_cookie: bool) -> HeaderMap {
    const NOT_REPLAYED: [&str; 10] = [
        "connection",
        "keep-alive",
        "proxy-connection",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "date",
    ];
    let named_by_connection: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
        .collect();
    // One more than kept: a replay adds its marker without growing the map.
    let mut kept = HeaderMap::with_capacity(headers.len() + 1);
    for (name, value) in headers {
        if !NOT_REPLAYED.contains(&name.as_str())
            && !named_by_connection.contains(name)
            && (set_cookie || name != header::SET_COOKIE)
        {
            kept.append(name.clone(), value.clone());
        }
    }
    kept
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;
    use http_body_util::{Full, StreamBody};

    #[test]
    fn hop_by_hop_headers_and_date_are_not_replayed() {
        let mut headers = HeaderMap::new();
        headers.append("content-type", HeaderValue::from_static("application/json"));
        headers.append(
            "date",
            HeaderValue::from_static("Tue, 01 Dec 2026 00:00:00 GMT"),
        );
        headers.append("connection", HeaderValue::from_static("x-hop"));
        headers.append("x-hop", HeaderValue::from_static("1"));
        headers.append("transfer-encoding", HeaderValue::from_static("chunked"));
        headers.append("set-cookie", HeaderValue::from_static("a=1"));
        headers.append("set-cookie", HeaderValue::from_static("b=2"));
        let kept = |set_cookie| {
            let kept = replayable_headers(&headers, set_cookie);
            kept.iter()
                .map(|(n, v)| (n.as_str().to_owned(), v.to_str().unwrap().to_owned()))
                .collect::<Vec<_>>()
        };
        let pairs = |pairs: &[(&str, &str)]| {
            pairs
                .iter()
                .map(|(n, v)| (n.to_string(), v.to_string()))
                .collect::<Vec<_>>()
        };
        assert_eq!(
            kept(true),
            pairs(&[
                ("content-type", "application/json"),
                ("set-cookie", "a=1"),
                ("set-cookie", "b=2")
            ])
        );
        // By default a session cookie is not handed to whoever replays.
        assert_eq!(kept(false), pairs(&[("content-type", "application/json")]));
    }

    #[tokio::test]
    async fn buffering_stops_at_the_limit_and_keeps_the_rest() {
        let chunks = (0..10u8).map(|i| {
            Ok::<_, std::convert::Infallible>(http_body::Frame::data(Bytes::from(vec![i; 100])))
        });
        let body = StreamBody::new(futures_util::stream::iter(chunks));
        match buffer_response(body, 250).await {
            Buffered::TooLarge { prefix, rest } => {
                assert_eq!(prefix.len(), 300);
                let rest = rest.collect().await.unwrap().to_bytes();
                assert_eq!(prefix.len() + rest.len(), 1000);
                assert_eq!(rest[0], 3);
            }
            _ => panic!("expected TooLarge"),
        }
        match buffer_response(Full::new(Bytes::from_static(b"abc")), 3).await {
            Buffered::Whole { body, trailers } => {
                assert_eq!(body, "abc");
                assert!(trailers.is_none());
            }
            _ => panic!("expected Whole"),
        }
    }

    #[test]
    fn retry_after_tracks_the_running_time_within_the_lease() {
        let secs = Duration::from_secs;
        let lease = secs(29);
        assert_eq!(retry_after(None, lease), secs(1));
        assert_eq!(retry_after(Some(Duration::from_millis(80)), lease), secs(1));
        assert_eq!(retry_after(Some(secs(7)), lease), secs(7));
        assert_eq!(retry_after(Some(secs(40)), lease), lease);
        // A lease about to run out still leaves a second to come back in.
        assert_eq!(retry_after(Some(secs(5)), Duration::ZERO), secs(1));
    }
}
