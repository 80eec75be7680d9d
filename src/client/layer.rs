//! `IdempotentClientLayer` and its settings.

use std::{fmt, sync::Arc, time::Duration};

use http::{HeaderName, Method};
use tower_layer::Layer;

use super::{Backoff, DefaultPolicy, IdempotentClient};

/// The longest deadline and `Retry-After` cap the setters keep: far longer than any call,
/// and far from the end of what the clock can represent.
const LONGEST: Duration = Duration::from_secs(365 * 24 * 60 * 60);

/// What a client does; shared by every service a layer makes.
#[derive(Clone, Debug)]
pub(crate) struct Settings {
    pub(crate) methods: Vec<Method>,
    pub(crate) header_name: HeaderName,
    pub(crate) max_attempts: u32,
    pub(crate) backoff: Backoff,
    pub(crate) deadline: Duration,
    pub(crate) attempt_timeout: Option<Duration>,
    pub(crate) max_retry_after: Duration,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            methods: vec![Method::POST, Method::PATCH],
            header_name: HeaderName::from_static("idempotency-key"),
            max_attempts: 5,
            backoff: Backoff::default(),
            deadline: Duration::from_secs(30),
            attempt_timeout: Some(Duration::from_secs(10)),
            max_retry_after: Duration::from_secs(30),
        }
    }
}

/// Applies [`IdempotentClient`] to an HTTP client service: each call of a configured method
/// carries one idempotency key on every attempt and is retried until it gets an answer
/// worth returning.
///
/// Defaults: methods `POST` and `PATCH`; header `Idempotency-Key`; 5 attempts; backoff
/// from 100 ms doubling up to 5 s with full jitter; a 30 s deadline per call; 10 s per
/// attempt; `Retry-After` honoured up to 30 s; [`DefaultPolicy`].
///
/// Cloning is cheap: the settings and the policy are shared.
///
/// # Example
///
/// ```
/// use std::time::Duration;
/// use tower_idempotency::client::IdempotentClientLayer;
///
/// let layer = IdempotentClientLayer::new()
///     .max_attempts(8)
///     .deadline(Duration::from_secs(20))
///     .attempt_timeout(Duration::from_secs(5));
/// ```
pub struct IdempotentClientLayer<P = DefaultPolicy> {
    pub(crate) settings: Arc<Settings>,
    pub(crate) policy: Arc<P>,
}

impl<P> Clone for IdempotentClientLayer<P> {
    fn clone(&self) -> Self {
        Self {
            settings: self.settings.clone(),
            policy: self.policy.clone(),
        }
    }
}

impl<P> fmt::Debug for IdempotentClientLayer<P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotentClientLayer")
            .field("settings", &self.settings)
            .field("policy", &std::any::type_name::<P>())
            .finish()
    }
}

impl Default for IdempotentClientLayer {
    fn default() -> Self {
        Self::new()
    }
}

impl IdempotentClientLayer {
    /// A layer with the default settings and [`DefaultPolicy`].
    pub fn new() -> Self {
        Self {
            settings: Arc::new(Settings::default()),
            policy: Arc::new(DefaultPolicy),
        }
    }
}

impl<P> IdempotentClientLayer<P> {
    fn with(mut self, change: impl FnOnce(&mut Settings)) -> Self {
        change(Arc::make_mut(&mut self.settings));
        self
    }

    /// The methods whose calls get a key and retries (default `POST` and `PATCH`); other
    /// requests are sent once, untouched.
    ///
    /// # Example
    ///
    /// ```
    /// use http::Method;
    /// use tower_idempotency::client::IdempotentClientLayer;
    ///
    /// let layer = IdempotentClientLayer::new().methods([Method::POST, Method::PUT]);
    /// ```
    pub fn methods(self, methods: impl IntoIterator<Item = Method>) -> Self {
        let methods = methods.into_iter().collect();
        self.with(|s| s.methods = methods)
    }

    /// The header the key goes in (default `Idempotency-Key`).
    ///
    /// # Example
    ///
    /// ```
    /// use http::HeaderName;
    /// use tower_idempotency::client::IdempotentClientLayer;
    ///
    /// let layer = IdempotentClientLayer::new().header_name(HeaderName::from_static("x-request-key"));
    /// ```
    pub fn header_name(self, name: HeaderName) -> Self {
        self.with(|s| s.header_name = name)
    }

    /// The most attempts per call, the first included (default 5; 0 counts as 1).
    ///
    /// # Example
    ///
    /// ```
    /// use tower_idempotency::client::IdempotentClientLayer;
    ///
    /// let layer = IdempotentClientLayer::new().max_attempts(10);
    /// ```
    pub fn max_attempts(self, attempts: u32) -> Self {
        self.with(|s| s.max_attempts = attempts.max(1))
    }

    /// The waits between attempts (default [`Backoff::default`]: from 100 ms, up to 5 s).
    ///
    /// # Example
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_idempotency::client::{Backoff, IdempotentClientLayer};
    ///
    /// let layer = IdempotentClientLayer::new()
    ///     .backoff(Backoff::new(Duration::from_millis(50), Duration::from_secs(2)));
    /// ```
    pub fn backoff(self, backoff: Backoff) -> Self {
        self.with(|s| s.backoff = backoff)
    }

    /// How long a whole call may take, from its first attempt (default 30 s). No attempt
    /// starts and no wait ends past it: a retry that would is not made, and the last
    /// answer or failure is returned. An attempt in flight at the deadline times out. At
    /// most a year: a longer one (`Duration::MAX` for none) is taken as a year.
    ///
    /// # Panics
    ///
    /// If `deadline` is zero: every call would fail, some after the server took them.
    ///
    /// # Example
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_idempotency::client::IdempotentClientLayer;
    ///
    /// let layer = IdempotentClientLayer::new().deadline(Duration::from_secs(60));
    /// ```
    pub fn deadline(self, deadline: Duration) -> Self {
        assert!(
            !deadline.is_zero(),
            "IdempotentClientLayer::deadline must be more than zero"
        );
        self.with(|s| s.deadline = deadline.min(LONGEST))
    }

    /// How long one attempt may take before it is abandoned, as a [`Failure::TimedOut`]
    /// (default 10 s). The attempt timing out is retried: the key makes that safe even if
    /// the server was still working on it.
    ///
    /// [`Failure::TimedOut`]: super::Failure::TimedOut
    ///
    /// # Panics
    ///
    /// If `timeout` is zero: every attempt would time out, some after the server took it.
    ///
    /// # Example
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_idempotency::client::IdempotentClientLayer;
    ///
    /// let layer = IdempotentClientLayer::new().attempt_timeout(Duration::from_secs(2));
    /// ```
    pub fn attempt_timeout(self, timeout: Duration) -> Self {
        assert!(
            !timeout.is_zero(),
            "IdempotentClientLayer::attempt_timeout must be more than zero"
        );
        self.with(|s| s.attempt_timeout = Some(timeout))
    }

    /// No timeout per attempt: only the deadline bounds one.
    ///
    /// # Example
    ///
    /// ```
    /// use tower_idempotency::client::IdempotentClientLayer;
    ///
    /// let layer = IdempotentClientLayer::new().no_attempt_timeout();
    /// ```
    pub fn no_attempt_timeout(self) -> Self {
        self.with(|s| s.attempt_timeout = None)
    }

    /// The longest wait a `Retry-After` is obeyed for (default 30 s). A retried answer's
    /// `Retry-After` (seconds or an HTTP-date) is waited, capped at this, unless the
    /// backoff asks for longer; a wait past the deadline ends the call instead. At most a
    /// year: a longer one is taken as a year.
    ///
    /// # Example
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_idempotency::client::IdempotentClientLayer;
    ///
    /// let layer = IdempotentClientLayer::new().max_retry_after(Duration::from_secs(5));
    /// ```
    pub fn max_retry_after(self, max: Duration) -> Self {
        self.with(|s| s.max_retry_after = max.min(LONGEST))
    }

    /// Decides which outcomes are retried with `policy` instead (see [`RetryPolicy`]).
    ///
    /// [`RetryPolicy`]: super::RetryPolicy
    ///
    /// # Example
    ///
    /// ```
    /// use tower_idempotency::client::{IdempotentClientLayer, Outcome};
    ///
    /// // Retry only failures to get an answer, never an answer.
    /// let layer = IdempotentClientLayer::new()
    ///     .policy(|outcome: &Outcome<'_, std::io::Error>| matches!(outcome, Outcome::Failed(_)));
    /// ```
    pub fn policy<Q>(self, policy: Q) -> IdempotentClientLayer<Q> {
        IdempotentClientLayer {
            settings: self.settings,
            policy: Arc::new(policy),
        }
    }
}

impl<S, P> Layer<S> for IdempotentClientLayer<P> {
    type Service = IdempotentClient<S, P>;

    fn layer(&self, inner: S) -> Self::Service {
        IdempotentClient::new(inner, self.settings.clone(), self.policy.clone())
    }
}
