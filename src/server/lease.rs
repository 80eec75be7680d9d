//! A claimed key: claiming it, keeping its lease alive while the handler runs, writing its
//! outcome until the store answers, and never leaving it held when a request is dropped.

use std::{
    convert::Infallible,
    future::Future,
    pin::Pin,
    sync::{Arc, Mutex, PoisonError},
    task::{Context, Poll},
    time::Duration,
};

use futures_util::stream::{FuturesUnordered, StreamExt};
use tokio::time::Instant;
use tracing::Instrument;

use super::{
    future::boxed_in_place,
    state::Shared,
    telemetry::{Operation, RequestOutcome},
};
use crate::{
    store::{self, Claim, Fenced},
    ClaimToken, Fingerprint, Scope, StoredResponse,
};

/// The first pause before writing an outcome again after the store failed the write, and
/// the longest: doubled each time in between. The writes go on until one is answered or the
/// claim's lease runs out.
const WRITE_RETRY_FIRST: Duration = Duration::from_millis(25);
const WRITE_RETRY_MAX: Duration = Duration::from_secs(1);
/// The most leases a write is retried for after its first failure, whatever the renewals
/// do meanwhile.
const WRITE_RETRY_LEASES: u32 = 3;

/// What came of writing a response's record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Completed {
    /// The store applied it.
    Recorded,
    /// Not written: the claim was lost, or the store failed every attempt until the lease
    /// ran out.
    NotRecorded,
    /// The store refuses the record for good (one past its size limit): it said so, or it
    /// failed this one write for a whole lease while it applied every renewal. The key is
    /// still this request's.
    Refused,
}

/// What the store made of a claim's renewals: when the last one it applied was sent (the
/// claim's own, at first), and the last one it failed.
#[derive(Clone, Copy)]
struct Renewals {
    applied: Instant,
    failed: Option<Instant>,
}

/// Since when, as far as a write's retries have seen, the store has applied every renewal
/// of the claim while it failed the write.
#[derive(Default)]
struct Answering {
    /// The renewal failure last seen, and the renewal applied first after it.
    streak: Option<(Option<Instant>, Instant)>,
}

impl Answering {
    /// Updated with `renewals`, for a write that first failed at `failed_at`: `None` while
    /// no renewal has been applied since both that and the last renewal that failed.
    fn since(&mut self, renewals: Renewals, failed_at: Instant) -> Option<Instant> {
        let quiet_from = renewals
            .failed
            .map_or(failed_at, |failed| failed.max(failed_at));
        if renewals.applied <= quiet_from {
            self.streak = None;
            return None;
        }
        let since = match self.streak {
            Some((failed, since)) if failed == renewals.failed => since,
            _ => renewals.applied,
        };
        self.streak = Some((renewals.failed, since));
        Some(since)
    }
}

/// A write after the handler that was given up.
struct Unwritten {
    error: store::Error,
    /// Refused for good: the store said so, or it applied every renewal for a lease while
    /// it failed a refusable write; not given up for an outage, nor a write that is not
    /// refusable.
    refused: bool,
}

/// Claims `scope` with `token`, sent at `sent` (timed from then), or reads what holds it;
/// with when the answer came, which starts an execution without reading the clock again.
/// A claim whose answer its request never sees (dropped while in flight, or failed) is
/// released.
///
/// A claim answered a whole lease after it was sent (held up behind a lock, a slow
/// connection) counts as failed, and is released: its lease may be over by the store's
/// clock, and another request may claim the key while this one would execute.
pub(crate) async fn claim(
    shared: &Arc<Shared>,
    scope: &Scope,
    fingerprint: Fingerprint,
    token: ClaimToken,
    sent: Instant,
) -> (store::Result<Claim>, Instant) {
    let abandoned = AbandonedClaim::arm(shared, scope, token);
    let claim = shared
        .store
        .claim_with_token(scope, fingerprint, token, shared.config.lease)
        .await;
    let answered = shared.state.meters.stored(Operation::Claim, sent, &claim);
    if let Ok(Claim::Claimed(_)) = claim {
        if answered >= sent + shared.config.lease {
            return (Err(answered_too_late()), answered);
        }
    }
    if settled(&claim) {
        abandoned.disarm();
    }
    (claim, answered)
}

#[cold]
fn renewal_unanswered() -> store::Error {
    store::Error::Backend("the renewal was not answered within a lease".into())
}

#[cold]
fn answered_too_late() -> store::Error {
    store::Error::Backend(Box::new(AnsweredLate))
}

/// A claim answered a whole lease after it was sent: it may hold its key no more.
#[derive(Debug, thiserror::Error)]
#[error("the claim was answered after its lease ran out")]
struct AnsweredLate;

/// Whether `error` is a claim's that took its key too late to run on it (answered after its
/// lease, or withdrawn by the store for that): another request may take the key at once,
/// so it is never executed, not even failing open.
pub(crate) fn too_late_to_run(error: &store::Error) -> bool {
    let (store::Error::Backend(source) | store::Error::Unavailable(source)) = error else {
        return false;
    };
    #[cfg(feature = "postgres")]
    if let Some(store::PostgresStoreError::LeaseSpent(_)) = source.downcast_ref() {
        return true;
    }
    source.is::<AnsweredLate>()
}

/// Whether a claim's outcome is known. One that failed (a timeout, a dropped connection)
/// may still have been applied: it is released like an abandoned one, so it cannot hold the
/// key for a lease. One the store could not take needs no release, and during an outage
/// sending one would only double the failed attempts.
fn settled(claim: &store::Result<Claim>) -> bool {
    matches!(
        claim,
        Ok(_) | Err(store::Error::Unavailable(_) | store::Error::Refused(_))
    )
}

/// A key this request claimed, with what it takes to write to it. Counted among the
/// layer's executions in flight while it lives.
pub(crate) struct Lease {
    shared: Arc<Shared>,
    scope: Scope,
    token: ClaimToken,
    /// When the last claim or renewal that the store applied was sent (the lease runs until
    /// at least this plus the lease), and the last renewal it failed.
    renewals: Mutex<Renewals>,
}

impl Lease {
    /// The lease of a claim applied no earlier than `claimed_at`.
    pub(crate) fn new(
        shared: Arc<Shared>,
        scope: Scope,
        token: ClaimToken,
        claimed_at: Instant,
    ) -> Self {
        let state = &shared.state;
        state.in_flight.entered(state.meters.in_flight());
        Self {
            shared,
            scope,
            token,
            renewals: Mutex::new(Renewals {
                applied: claimed_at,
                failed: None,
            }),
        }
    }

    pub(crate) fn shared(&self) -> &Shared {
        &self.shared
    }

    pub(crate) fn scope(&self) -> &Scope {
        &self.scope
    }

    /// Drives `future`, begun at `started`, to completion, renewing the lease every third
    /// of it.
    pub(crate) fn renew_while<F: Future>(
        &self,
        future: F,
        started: Instant,
    ) -> RenewWhile<F, impl Future<Output = Infallible> + '_> {
        // The renewals run beside the handler, never in its way: a slow store delays a
        // renewal, not the handler's next poll. Their schedule starts with the future, not
        // when first polled, so a handler that blocks its thread finds its renewal overdue;
        // and no later than the last claim or renewal the store applied was sent, as its
        // lease did: a claim answered late is renewed at once.
        let period = self.shared.config.lease / 3;
        let first = started.min(self.renewals().applied) + period;
        RenewWhile {
            future,
            renewals: self.renew_lease(first, period),
        }
    }

    /// Renews the lease every `period` from `first`, until the claim is lost. Each renewal
    /// is sent when it is due, whether the last one was answered or not: one slow to answer
    /// (a store slow but applying it) still counts when it lands, and one hung on a dead
    /// connection holds back none of the next; each is given up once a lease has passed
    /// since it was sent, when it can no longer help.
    async fn renew_lease(&self, first: Instant, period: Duration) -> Infallible {
        let lease = self.shared.config.lease;
        let mut ticks = tokio::time::interval_at(first, period);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut in_flight = FuturesUnordered::new();
        loop {
            // A renewal answered, or `None`: the next is due.
            let next = std::future::poll_fn(|cx| match in_flight.poll_next_unpin(cx) {
                Poll::Ready(Some(answered)) => Poll::Ready(Some(answered)),
                _ => ticks.poll_tick(cx).map(|_| None),
            });
            let Some((sent, extended)) = next.await else {
                in_flight.push(self.renewal(Instant::now(), period, lease));
                continue;
            };
            self.shared
                .state
                .meters
                .stored(Operation::Extend, sent, &extended);
            match extended {
                Ok(Fenced::Applied) => self.renewals_mut(|renewals| {
                    renewals.applied = renewals.applied.max(sent);
                }),
                Ok(Fenced::Lost) => {
                    self.warn(
                        "lease lost while the handler ran: another request may execute this key",
                    );
                    return std::future::pending().await;
                }
                Err(error) => {
                    self.renewals_mut(|renewals| {
                        renewals.failed = renewals.failed.max(Some(sent));
                    });
                    tracing::warn!(%error, "could not renew the idempotency lease");
                }
            }
        }
    }

    /// A renewal sent at `sent`, with its answer; given up a `lease` after it was sent.
    /// Still unanswered when the next is due (`period`), it counts as failed meanwhile: a
    /// write's retries must not take the store for one that applies every renewal (see
    /// [`write_until_settled`](Self::write_until_settled)) while one hangs. Applied after
    /// all, it counts then.
    fn renewal(
        &self,
        sent: Instant,
        period: Duration,
        lease: Duration,
    ) -> impl Future<Output = (Instant, store::Result<Fenced>)> + '_ {
        let mut extending = self.shared.store.extend(&self.scope, self.token, lease);
        async move {
            if let Ok(extended) = tokio::time::timeout_at(sent + period, &mut extending).await {
                return (sent, extended);
            }
            self.renewals_mut(|renewals| renewals.failed = renewals.failed.max(Some(sent)));
            let extended = tokio::time::timeout_at(sent + lease, extending).await;
            (sent, extended.unwrap_or_else(|_| Err(renewal_unanswered())))
        }
    }

    /// Runs a write after the handler until the store answers it: a blip (a restart, a
    /// failover, a dropped connection) must not cost the record, or the next retry would
    /// run the operation again. Retried with backoff while the store fails, for as long as
    /// the claim's lease lasts (counted from the last renewal the store applied), and the
    /// lease is renewed meanwhile whenever the store answers. Writes are fenced and
    /// idempotent, so repeating one that did apply is harmless; past the lease, the key
    /// may be another request's, and the fence would refuse the write anyway. The first
    /// attempt is timed from `started`, a reading its caller took anyway.
    ///
    /// A write the store says it never takes ([`store::Error::Refused`]) is given up at
    /// once. Any write is given up too once the store has applied every renewal for a
    /// whole lease while it failed the write: a store that takes everything but this
    /// write, however often it is sent, would otherwise keep it retried, the key held and
    /// the client unanswered, for ever. A `refusable` one (a response's own record, outside
    /// the transactional mode) is then taken as refused for good. An outage fails the
    /// renewals too, and a failed renewal starts that count again: the lease stays the
    /// only bound there.
    ///
    /// A release renews nothing while it is retried: one that cannot land is the lease
    /// running out, which frees the key as well. And no write is retried past three leases
    /// from its first failure: renewals failing and applied by turns would otherwise keep
    /// both bounds above from ever being reached.
    async fn write_until_settled<'a, F>(
        &'a self,
        operation: Operation,
        write: impl Fn() -> F,
        started: Instant,
        refusable: bool,
    ) -> Result<Fenced, Unwritten>
    where
        F: Future<Output = store::Result<Fenced>> + 'a,
    {
        let meters = &self.shared.state.meters;
        // The first attempt goes alone: a store that answers (nearly always) costs no timer.
        let written = write().await;
        meters.stored(operation, started, &written);
        let first = match written {
            Ok(fenced) => return Ok(fenced),
            Err(error) => error,
        };
        // Sent again, a write the store refuses would be refused again, for as long as the
        // renewals hold the key.
        if let store::Error::Refused(_) = first {
            return Err(Unwritten {
                error: first,
                refused: true,
            });
        }
        // A transaction holds the key while it is open, so a transactional store applies
        // every renewal: the lease counts from the first failure there, or a write that
        // never reached the store (a wrapper's refusal) would be retried for ever.
        let transactional = self.shared.store.commits_handler_writes();
        let refusable = refusable && !transactional;
        let retries = async {
            let lease = self.shared.config.lease;
            let failed_at = Instant::now();
            let mut answering = Answering::default();
            let mut error = first;
            let mut backoff = WRITE_RETRY_FIRST;
            loop {
                let next = Instant::now() + backoff;
                let renewals = self.renewals();
                let since = if transactional {
                    failed_at
                } else {
                    renewals.applied
                };
                if next >= since + lease {
                    return Err(Unwritten {
                        error,
                        refused: false,
                    });
                }
                let answered_for = answering.since(renewals, failed_at);
                if answered_for.is_some_and(|since| next >= since + lease) {
                    return Err(Unwritten {
                        error,
                        refused: refusable,
                    });
                }
                // Renewals failing and applied by turns keep both counts above going:
                // whatever they do, a write is not retried past a few leases.
                if next >= failed_at + lease * WRITE_RETRY_LEASES {
                    return Err(Unwritten {
                        error,
                        refused: false,
                    });
                }
                tracing::warn!(
                    %error, retry_in = ?backoff,
                    "idempotency store write failed; retrying while the lease lasts"
                );
                tokio::time::sleep_until(next).await;
                backoff = (backoff * 2).min(WRITE_RETRY_MAX);
                let started = Instant::now();
                let written = write().await;
                meters.stored(operation, started, &written);
                error = match written {
                    Ok(fenced) => return Ok(fenced),
                    Err(error) => error,
                };
                if let store::Error::Refused(_) = error {
                    return Err(Unwritten {
                        error,
                        refused: true,
                    });
                }
            }
        };
        // Boxed: kept in place, this rare path (a timer, the renewals) would make every
        // execution's future larger.
        if operation == Operation::Release {
            return Box::pin(retries).await;
        }
        Box::pin(self.renew_while(retries, Instant::now())).await
    }

    fn renewals(&self) -> Renewals {
        *self.renewals.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn renewals_mut(&self, change: impl FnOnce(&mut Renewals)) {
        change(&mut self.renewals.lock().unwrap_or_else(PoisonError::into_inner));
    }

    /// Gives the key back, so that a retry executes again; counted as released.
    pub(crate) async fn release(&self, why: &str) {
        match self.give_back().await {
            Ok(Fenced::Applied) => {
                tracing::debug!(why, "idempotency key released");
            }
            Ok(Fenced::Lost) => self.warn("could not release: the claim was already lost"),
            Err(error) => {
                tracing::error!(
                    %error, why,
                    "could not release the idempotency key within its lease: it frees itself as the lease runs out"
                );
                self.abandon();
            }
        }
        self.shared.answered(RequestOutcome::Released);
    }

    /// Tells the store that no write will end this claim (see [`Store::abandon`]): a
    /// transactional store rolls the execution's transaction back, which frees the key.
    ///
    /// [`Store::abandon`]: crate::Store::abandon
    fn abandon(&self) {
        self.shared.store.abandon(&self.scope, self.token);
    }

    async fn give_back(&self) -> store::Result<Fenced> {
        let release = || self.shared.store.release(&self.scope, self.token);
        self.write_until_settled(Operation::Release, release, Instant::now(), false)
            .await
            .map_err(|unwritten| unwritten.error)
    }

    /// Records `response` as the key's outcome, replayed to every retry until the
    /// layer's ttl runs out, timed from `now`. A `refusable` response (one recorded as
    /// itself, not already a refusal to replay it) is given up as
    /// [`Refused`](Completed::Refused) when the store takes everything but this record
    /// (see [`write_until_settled`](Self::write_until_settled)); not in the transactional
    /// mode, where the lease stays the only bound and a record not written answers `503`.
    pub(crate) async fn complete(
        &self,
        fingerprint: Fingerprint,
        response: &StoredResponse,
        now: Instant,
        refusable: bool,
    ) -> Completed {
        let shared = &self.shared;
        match self
            .write_record(fingerprint, response, now, refusable)
            .await
        {
            Ok(Fenced::Applied) => return Completed::Recorded,
            Ok(Fenced::Lost) => {
                self.warn("claim lost before the response was recorded: it will not be replayed")
            }
            Err(Unwritten {
                error,
                refused: true,
            }) if refusable && !shared.store.commits_handler_writes() => {
                tracing::error!(
                    %error,
                    "the store refuses the response's record for good: recording that it cannot be replayed"
                );
                return Completed::Refused;
            }
            Err(Unwritten { error, refused }) if shared.store.commits_handler_writes() => {
                tracing::error!(
                    %error,
                    "could not commit the response's record, nor the handler's writes with it: answering 503, and a retry executes again"
                );
                if refused {
                    // Refused, the completion changed nothing: the transaction is still
                    // open, with the handler's writes and the key. (A commit that failed
                    // has ended it already.)
                    if let Err(error) = self.give_back().await {
                        tracing::error!(%error, "could not roll back the refused execution's transaction");
                    }
                }
                // Whatever did not reach the store (a completion failed in front of it)
                // left the transaction open: no write will end it now.
                self.abandon();
            }
            Err(Unwritten {
                error,
                refused: true,
            }) => tracing::error!(
                %error,
                "the store refuses the record for good: a retry after the lease runs out executes again"
            ),
            Err(Unwritten { error, .. }) => tracing::error!(
                %error,
                "could not record the response within the lease: a retry after the lease runs out executes again"
            ),
        }
        Completed::NotRecorded
    }

    /// Writes `response` as the key's record (see
    /// [`write_until_settled`](Self::write_until_settled)).
    async fn write_record(
        &self,
        fingerprint: Fingerprint,
        response: &StoredResponse,
        started: Instant,
        refusable: bool,
    ) -> Result<Fenced, Unwritten> {
        let ttl = self.shared.config.ttl;
        let complete = || {
            self.shared
                .store
                .complete(&self.scope, self.token, fingerprint, response, ttl)
        };
        self.write_until_settled(Operation::Complete, complete, started, refusable)
            .await
    }

    /// Records `refusal` (a `409 response_not_replayable`) under `fingerprint` where the
    /// store refused the response's own record ([`Completed::Refused`]), so that no retry
    /// executes again: whether it was recorded. A record already there (the response's,
    /// an attempt applied though its answer was lost) is left as it is: the store answers
    /// that the claim is gone.
    pub(crate) async fn record_refusal(
        &self,
        fingerprint: Fingerprint,
        refusal: &StoredResponse,
    ) -> bool {
        let written = self.write_record(fingerprint, refusal, Instant::now(), false);
        match written.await {
            Ok(Fenced::Applied) => {
                self.warn("recorded that the response cannot be replayed: retries get 409 response_not_replayable");
                return true;
            }
            Ok(Fenced::Lost) => self.warn(
                "could not record that the response cannot be replayed: the claim was lost, or the response's own record was written after all",
            ),
            Err(Unwritten { error, .. }) => tracing::error!(
                %error,
                "could not record that the response cannot be replayed: a retry after the lease runs out executes again"
            ),
        }
        false
    }

    #[cold]
    pub(crate) fn warn(&self, message: &str) {
        tracing::warn!(token = ?self.token, "{message}");
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        let state = &self.shared.state;
        state.in_flight.left(state.meters.in_flight());
    }
}

/// Releases a claim whose answer its request never saw (the request was dropped while
/// the claim was in flight, or the claim failed). Release is fenced by the token, so
/// releasing a claim that did not happen is harmless.
struct AbandonedClaim<'a> {
    armed: Option<(&'a Arc<Shared>, &'a Scope, ClaimToken)>,
}

impl<'a> AbandonedClaim<'a> {
    fn arm(shared: &'a Arc<Shared>, scope: &'a Scope, token: ClaimToken) -> Self {
        Self {
            armed: Some((shared, scope, token)),
        }
    }

    fn disarm(mut self) {
        self.armed = None;
    }
}

impl Drop for AbandonedClaim<'_> {
    fn drop(&mut self) {
        let Some((shared, scope, token)) = self.armed.take() else {
            return;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        // Counted from now: the claim left before, so its lease ends no later than this.
        let lease = Lease::new(Arc::clone(shared), scope.clone(), token, Instant::now());
        let releasing = async move {
            if let Err(error) = lease.give_back().await {
                tracing::warn!(%error, "could not release an abandoned claim: it frees itself when its lease runs out");
                lease.abandon();
            }
        };
        runtime.spawn(releasing.instrument(tracing::Span::current()));
    }
}

pin_project_lite::pin_project! {
    /// A future driven to completion while its lease is renewed beside it: polled first,
    /// then the renewals. A combinator, not an `async fn` with `select!`: that keeps the
    /// future twice in its state (the argument, and the pair it polls), and every
    /// execution's future, moved a few times per request, would be larger by a handler's
    /// future.
    pub(crate) struct RenewWhile<F, R> {
        #[pin]
        future: F,
        #[pin]
        renewals: R,
    }
}

impl<F: Future, R: Future<Output = Infallible>> Future for RenewWhile<F, R> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = self.project();
        if let Poll::Ready(output) = this.future.poll(cx) {
            return Poll::Ready(output);
        }
        match this.renewals.poll(cx) {
            Poll::Ready(never) => match never {},
            Poll::Pending => Poll::Pending,
        }
    }
}

/// An execution polled in place by its request; if the request is dropped first (its client
/// went away), the rest of the execution (the handler, the recording) moves to a task of
/// its own rather than being cancelled. Running in place saves a task per execution; the
/// execution is boxed so it can move without being polled again from scratch.
pub(crate) struct FinishOnDrop<F: Future + Send + 'static>
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
    /// The execution `make` makes, made in its box.
    #[inline(always)]
    pub(crate) fn new(make: impl FnOnce() -> F) -> Self {
        Self {
            execution: Some(boxed_in_place(make)),
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
