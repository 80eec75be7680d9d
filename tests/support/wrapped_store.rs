//! A store in front of another that fails or changes some of its operations, as a backend
//! in trouble would, and passes the rest on: faults the real servers cannot be made to show
//! on cue.

use std::{
    fmt::Debug,
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
    time::Duration,
};

use tower_idempotency::{
    async_trait,
    store::{Claim, Fenced, Result, Watch},
    ClaimToken, Fingerprint, Scope, Store, StoredResponse,
};

/// An operation about to be sent to the store behind.
pub enum Operation<'a> {
    Claim,
    Complete(&'a StoredResponse),
    Release,
    Extend,
}

/// What a [`Wrapped`] store changes.
pub trait Hooks: Debug + Send + Sync + 'static {
    /// Before each operation: an error fails it, unsent.
    fn before(&self, _operation: Operation<'_>) -> Result<()> {
        Ok(())
    }

    /// A claim's answer, as the wrapper tells it.
    fn claimed(&self, claim: Claim) -> Claim {
        claim
    }

    /// How long a claim takes on its way, before it is sent.
    fn claim_delay(&self) -> Duration {
        Duration::ZERO
    }

    /// How long a claim's answer takes on its way back, after the store applied it.
    fn claim_answer_delay(&self) -> Duration {
        Duration::ZERO
    }

    /// How long a renewal takes on its way, before it is sent.
    fn extend_delay(&self) -> Duration {
        Duration::ZERO
    }

    /// After the store applied a claim: an error stands in for its answer, as for one
    /// whose answer was lost on the way back.
    fn after_claim(&self) -> Result<()> {
        Ok(())
    }
}

/// Counts the claims sent: each a read of the key when it is held.
#[derive(Debug, Default)]
pub struct ClaimsCounted(AtomicUsize);

impl ClaimsCounted {
    pub fn count(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }
}

impl Hooks for ClaimsCounted {
    fn before(&self, operation: Operation<'_>) -> Result<()> {
        if let Operation::Claim = operation {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
        Ok(())
    }
}

#[derive(Debug)]
pub struct Wrapped<H> {
    pub inner: Arc<dyn Store>,
    pub hooks: H,
}

impl<H: Hooks> Wrapped<H> {
    pub fn new(inner: Arc<dyn Store>, hooks: H) -> Arc<Self> {
        Arc::new(Self { inner, hooks })
    }
}

#[async_trait]
impl<H: Hooks> Store for Wrapped<H> {
    async fn claim_with_token(
        &self,
        scope: &Scope,
        fingerprint: Fingerprint,
        token: ClaimToken,
        lease: Duration,
    ) -> Result<Claim> {
        self.hooks.before(Operation::Claim)?;
        let delay = self.hooks.claim_delay();
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        let inner = &self.inner;
        let claim = inner
            .claim_with_token(scope, fingerprint, token, lease)
            .await?;
        let delay = self.hooks.claim_answer_delay();
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        self.hooks.after_claim()?;
        Ok(self.hooks.claimed(claim))
    }

    async fn complete(
        &self,
        scope: &Scope,
        token: ClaimToken,
        fingerprint: Fingerprint,
        response: &StoredResponse,
        ttl: Duration,
    ) -> Result<Fenced> {
        self.hooks.before(Operation::Complete(response))?;
        let inner = &self.inner;
        inner
            .complete(scope, token, fingerprint, response, ttl)
            .await
    }

    async fn release(&self, scope: &Scope, token: ClaimToken) -> Result<Fenced> {
        self.hooks.before(Operation::Release)?;
        self.inner.release(scope, token).await
    }

    async fn extend(&self, scope: &Scope, token: ClaimToken, lease: Duration) -> Result<Fenced> {
        self.hooks.before(Operation::Extend)?;
        let delay = self.hooks.extend_delay();
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        self.inner.extend(scope, token, lease).await
    }

    async fn watch(&self, scope: &Scope) -> Result<Option<Watch>> {
        self.inner.watch(scope).await
    }

    fn hand_over(&self, token: ClaimToken, extensions: &mut http::Extensions) {
        self.inner.hand_over(token, extensions);
    }

    fn abandon(&self, scope: &Scope, token: ClaimToken) {
        self.inner.abandon(scope, token);
    }

    fn commits_handler_writes(&self) -> bool {
        self.inner.commits_handler_writes()
    }
}
