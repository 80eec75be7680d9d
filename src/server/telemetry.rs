//! What the layer tells the people running it: a counter of every request's outcome and
//! timings of the store and the handler, through the [`metrics`] facade (whatever recorder
//! the application installs), and a `tracing` span for every keyed request.
//!
//! Label values are few and fixed: outcomes, operations, results and store names. Keys,
//! principals and paths never become labels.

use std::{
    fmt::Write as _,
    sync::{Arc, OnceLock},
    time::Duration,
};

use hmac::{Hmac, Mac};
use metrics::{Counter, Gauge, Histogram};
use sha2::Sha256;
use tracing::{Level, Span};

use crate::store::{self, Claim, Fenced};

use super::{config::Config, scope::Scope};

/// What the layer did with a request: the `outcome` label of `idempotency_requests_total`
/// and the `outcome` field of the request's span.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum RequestOutcome {
    /// The handler ran and its response was recorded.
    Executed,
    /// The recorded response was replayed.
    Replayed,
    /// The recorded response was replayed to a duplicate that waited for its original.
    Waited,
    /// `409`: the key was in progress.
    InProgress,
    /// `409` (`422` in the IETF profile): the key was used before with other parameters.
    Mismatch,
    /// `400`: the route requires a key and the request had none.
    KeyMissing,
    /// `400`: the key header was malformed.
    InvalidKey,
    /// `413`: the request body was over the limit.
    BodyTooLarge,
    /// `400`: the request body could not be read.
    InvalidBody,
    /// `503`: the store could not be reached (fail closed).
    StoreUnavailable,
    /// The store could not be reached and the handler ran unprotected (fail open).
    FailOpen,
    /// The handler ran and the key was released (an error, a panic, a releasing status).
    Released,
    /// The handler ran and its response was too large to record: retries get `409`.
    NotReplayable,
    /// `500`: the request named no principal and the route allows no anonymous requests.
    PrincipalMissing,
}

impl RequestOutcome {
    const ALL: [RequestOutcome; 14] = [
        RequestOutcome::Executed,
        RequestOutcome::Replayed,
        RequestOutcome::Waited,
        RequestOutcome::InProgress,
        RequestOutcome::Mismatch,
        RequestOutcome::KeyMissing,
        RequestOutcome::InvalidKey,
        RequestOutcome::BodyTooLarge,
        RequestOutcome::InvalidBody,
        RequestOutcome::StoreUnavailable,
        RequestOutcome::FailOpen,
        RequestOutcome::Released,
        RequestOutcome::NotReplayable,
        RequestOutcome::PrincipalMissing,
    ];

    pub(crate) const fn label(self) -> &'static str {
        match self {
            RequestOutcome::Executed => "executed",
            RequestOutcome::Replayed => "replayed",
            RequestOutcome::Waited => "waited",
            RequestOutcome::InProgress => "in_progress",
            RequestOutcome::Mismatch => "mismatch",
            RequestOutcome::KeyMissing => "key_missing",
            RequestOutcome::InvalidKey => "invalid_key",
            RequestOutcome::BodyTooLarge => "body_too_large",
            RequestOutcome::InvalidBody => "invalid_body",
            RequestOutcome::StoreUnavailable => "store_unavailable",
            RequestOutcome::FailOpen => "fail_open",
            RequestOutcome::Released => "released",
            RequestOutcome::NotReplayable => "not_replayable",
            RequestOutcome::PrincipalMissing => "principal_missing",
        }
    }
}

/// A store call timed by `idempotency_store_operation_seconds`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Operation {
    Claim,
    Complete,
    Release,
    Extend,
}

impl Operation {
    const ALL: [Operation; 4] = [
        Operation::Claim,
        Operation::Complete,
        Operation::Release,
        Operation::Extend,
    ];

    const fn label(self) -> &'static str {
        match self {
            Operation::Claim => "claim",
            Operation::Complete => "complete",
            Operation::Release => "release",
            Operation::Extend => "extend",
        }
    }
}

/// How a store call ended: answered (`ok`), refused by the fence (`fence_lost`: the claim
/// was no longer the caller's), or failed (`error`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum StoreResult {
    Ok,
    FenceLost,
    Error,
}

impl StoreResult {
    const ALL: [StoreResult; 3] = [StoreResult::Ok, StoreResult::FenceLost, StoreResult::Error];

    const fn label(self) -> &'static str {
        match self {
            StoreResult::Ok => "ok",
            StoreResult::FenceLost => "fence_lost",
            StoreResult::Error => "error",
        }
    }
}

/// What a store call's result says, for its `result` label.
pub(crate) trait ReportsStoreResult {
    fn store_result(&self) -> StoreResult;
}

impl ReportsStoreResult for store::Result<Claim> {
    fn store_result(&self) -> StoreResult {
        if self.is_ok() {
            StoreResult::Ok
        } else {
            StoreResult::Error
        }
    }
}

impl ReportsStoreResult for store::Result<Fenced> {
    fn store_result(&self) -> StoreResult {
        match self {
            Ok(Fenced::Applied) => StoreResult::Ok,
            Ok(Fenced::Lost) => StoreResult::FenceLost,
            Err(_) => StoreResult::Error,
        }
    }
}

/// One layer's metric handles, registered with the recorder installed when the layer first
/// reports (install the recorder before serving), then kept: recording is one atomic
/// operation, with no name or label lookup per request.
#[derive(Clone)]
pub(crate) struct Meters {
    store: &'static str,
    handles: Arc<OnceLock<Handles>>,
}

struct Handles {
    requests: [Counter; RequestOutcome::ALL.len()],
    operations: [[Histogram; StoreResult::ALL.len()]; Operation::ALL.len()],
    execution: Histogram,
    in_flight: Gauge,
    fence_lost: Counter,
}

impl Meters {
    /// The meters of a layer on a store named `store` (its `store` label).
    pub(crate) fn new(store: &'static str) -> Self {
        Self {
            store,
            handles: Arc::default(),
        }
    }

    fn handles(&self) -> &Handles {
        self.handles.get_or_init(|| {
            describe();
            let store = self.store;
            Handles {
                requests: RequestOutcome::ALL.map(|outcome| {
                    metrics::counter!("idempotency_requests_total", "outcome" => outcome.label())
                }),
                operations: Operation::ALL.map(|operation| {
                    StoreResult::ALL.map(|answer| {
                        metrics::histogram!(
                            "idempotency_store_operation_seconds",
                            "store" => store,
                            "operation" => operation.label(),
                            "result" => answer.label(),
                        )
                    })
                }),
                execution: metrics::histogram!("idempotency_execution_seconds"),
                in_flight: metrics::gauge!("idempotency_in_flight"),
                fence_lost: metrics::counter!("idempotency_fence_lost_total"),
            }
        })
    }

    /// Counts a request's outcome, names it on the request's span (made at `span_level`),
    /// and logs it at a level that fits: routine outcomes at `debug`, a client's mistakes at
    /// `info`. (The store failing and fail-open executions are logged where they happen, at
    /// `error` and `warn`.)
    pub(crate) fn answered(&self, outcome: RequestOutcome, span_level: Level) {
        self.handles().requests[outcome as usize].increment(1);
        if let Some(span) = request_span_recorded(span_level) {
            span.record("outcome", outcome.label());
        }
        match outcome {
            RequestOutcome::Mismatch
            | RequestOutcome::KeyMissing
            | RequestOutcome::InvalidKey
            | RequestOutcome::BodyTooLarge
            | RequestOutcome::InvalidBody => {
                tracing::info!(outcome = outcome.label(), "idempotency: request refused")
            }
            _ => tracing::debug!(outcome = outcome.label(), "idempotency: request answered"),
        }
    }

    /// Records a store call begun at `started` that ended with `result`, and counts a lost
    /// fence; returns when the answer was seen, for whatever starts next. (Timed where it is
    /// awaited: wrapping the call in a future of its own would move the store's future once
    /// more per call. On tokio's clock, the lease's: a claim's one reading starts both.)
    pub(crate) fn stored(
        &self,
        operation: Operation,
        started: tokio::time::Instant,
        result: &impl ReportsStoreResult,
    ) -> tokio::time::Instant {
        let answered = tokio::time::Instant::now();
        let elapsed = answered - started;
        let answer = result.store_result();
        let handles = self.handles();
        handles.operations[operation as usize][answer as usize].record(elapsed);
        if answer == StoreResult::FenceLost {
            handles.fence_lost.increment(1);
        }
        tracing::debug!(
            operation = operation.label(),
            result = answer.label(),
            ?elapsed,
            "idempotency store"
        );
        answered
    }

    /// Records how long a handler ran.
    pub(crate) fn executed_for(&self, elapsed: Duration) {
        self.handles().execution.record(elapsed);
    }

    /// The gauge of executions holding a key.
    pub(crate) fn in_flight(&self) -> &Gauge {
        &self.handles().in_flight
    }
}

impl std::fmt::Debug for Meters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Meters")
            .field("store", &self.store)
            .finish()
    }
}

/// How a keyed request's span shows its idempotency key and its principal
/// ([`IdempotencyLayer::span_key`](crate::IdempotencyLayer::span_key),
/// [`span_principal`](crate::IdempotencyLayer::span_principal)).
///
/// A principal is a name the application gave, or a digest of a credential: never the
/// credential itself.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum SpanField {
    /// The first 12 hex digits of the value's HMAC-SHA-256 under a key drawn once per
    /// process: enough to follow one key through a process's logs, and nothing to read it
    /// back from, even for a value that can be guessed (another process shows another
    /// digest). The default.
    #[default]
    Digest,
    /// The value itself.
    Plain,
    /// Left out.
    Omitted,
}

impl SpanField {
    fn show(self, span: &Span, field: &str, value: &str) {
        match self {
            SpanField::Digest => span.record(field, short_digest(value).as_str()),
            SpanField::Plain => span.record(field, value),
            SpanField::Omitted => span,
        };
    }
}

/// The span of a keyed request, before its scope is known: `idempotency`, at `level`, with
/// its endpoint, key, principal and outcome filled in as they become known. Below every
/// subscriber's level, no span at all: a disabled one still reads its callsite, and with
/// tracing's `log` feature (on in axum's defaults) the `log` crate's level, as it is made
/// and as it is dropped.
pub(crate) fn request_span(level: Level) -> Span {
    if !tracing::level_enabled!(level) {
        return Span::none();
    }
    // `span!` takes its level as a constant: one call per level.
    macro_rules! request_span {
        ($level:expr) => {
            tracing::span!(
                $level,
                "idempotency",
                endpoint = tracing::field::Empty,
                key = tracing::field::Empty,
                principal = tracing::field::Empty,
                outcome = tracing::field::Empty,
            )
        };
    }
    match level {
        Level::TRACE => request_span!(Level::TRACE),
        Level::DEBUG => request_span!(Level::DEBUG),
        Level::INFO => request_span!(Level::INFO),
        Level::WARN => request_span!(Level::WARN),
        Level::ERROR => request_span!(Level::ERROR),
    }
}

/// The request's span, the current one, if a subscriber records it. Below the most verbose
/// level any subscriber takes (`info` in production, the span at `debug`), it is disabled
/// without looking it up: a lookup per outcome costs more than the check.
fn request_span_recorded(level: Level) -> Option<Span> {
    if !tracing::level_enabled!(level) {
        return None;
    }
    Some(Span::current()).filter(|span| !span.is_disabled())
}

/// Names the request's scope on its span, as configured: digests are made only for a span
/// some subscriber records.
pub(crate) fn show_scope(scope: &Scope, config: &Config) {
    let Some(span) = request_span_recorded(config.span_level) else {
        return;
    };
    span.record("endpoint", scope.endpoint());
    config.span_key.show(&span, "key", scope.key().as_str());
    if let Some(name) = scope.principal() {
        config.span_principal.show(&span, "principal", name);
    }
}

/// The metrics' help texts and units, for recorders that export them.
fn describe() {
    use metrics::Unit;
    metrics::describe_counter!(
        "idempotency_requests_total",
        "Requests with an idempotency key or refused for lacking one, by outcome"
    );
    metrics::describe_histogram!(
        "idempotency_store_operation_seconds",
        Unit::Seconds,
        "Idempotency store calls by store, operation and result"
    );
    metrics::describe_histogram!(
        "idempotency_execution_seconds",
        Unit::Seconds,
        "How long handlers ran for keyed requests that executed, to the end of the response body kept"
    );
    metrics::describe_gauge!(
        "idempotency_in_flight",
        "Executions holding an idempotency key: running or recording their outcome"
    );
    metrics::describe_counter!(
        "idempotency_fence_lost_total",
        "Writes refused because the claim was no longer the writer's (its lease ran out)"
    );
    metrics::describe_counter!(
        "idempotency_cache_hits_total",
        "Claims answered from the local cache of completed records"
    );
    metrics::describe_counter!(
        "idempotency_cache_misses_total",
        "Claims the local cache passed on to the store"
    );
}

/// The first 12 hex digits of `value`'s HMAC-SHA-256 under a key drawn once per process:
/// the same value shows the same digest throughout one process's logs, and a value that
/// can be guessed (a numeric user id) cannot be found again by hashing guesses, as a plain
/// SHA-256 of it could.
pub(crate) fn short_digest(value: &str) -> String {
    static KEY: OnceLock<Hmac<Sha256>> = OnceLock::new();
    let key = KEY.get_or_init(|| {
        let secret: [u8; 32] = rand::random();
        Hmac::new_from_slice(&secret).unwrap_or_else(|_| unreachable!("any length is a key"))
    });
    let digest = key
        .clone()
        .chain_update(value.as_bytes())
        .finalize()
        .into_bytes();
    let mut hex = String::with_capacity(12);
    for byte in &digest[..6] {
        let _ = write!(hex, "{byte:02x}");
    }
    hex
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_are_distinct_and_indexed_in_order() {
        for (index, outcome) in RequestOutcome::ALL.iter().enumerate() {
            assert_eq!(*outcome as usize, index);
        }
        for (index, operation) in Operation::ALL.iter().enumerate() {
            assert_eq!(*operation as usize, index);
        }
        for (index, answer) in StoreResult::ALL.iter().enumerate() {
            assert_eq!(*answer as usize, index);
        }
        let mut labels: Vec<_> = RequestOutcome::ALL.iter().map(|o| o.label()).collect();
        labels.sort();
        labels.dedup();
        assert_eq!(labels.len(), RequestOutcome::ALL.len());
    }

    #[test]
    fn the_request_span_is_made_at_the_level_asked() {
        let subscriber = tracing_subscriber::registry();
        tracing::subscriber::with_default(subscriber, || {
            for level in [
                Level::TRACE,
                Level::DEBUG,
                Level::INFO,
                Level::WARN,
                Level::ERROR,
            ] {
                let span = request_span(level);
                assert_eq!(span.metadata().map(|m| *m.level()), Some(level));
                assert_eq!(span.metadata().map(|m| m.name()), Some("idempotency"));
            }
        });
        // At `info`, the default `debug` span is no span at all: nothing to pay for.
        let info = tracing_subscriber::fmt()
            .with_max_level(Level::INFO)
            .with_writer(std::io::sink)
            .finish();
        tracing::subscriber::with_default(info, || {
            assert!(request_span(Level::DEBUG).is_disabled());
            assert!(!request_span(Level::INFO).is_disabled());
        });
    }

    /// Writes what a subscriber formats into a buffer the test reads.
    #[derive(Clone, Default)]
    struct Written(Arc<std::sync::Mutex<Vec<u8>>>);

    impl std::io::Write for Written {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(bytes);
            Ok(bytes.len())
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    /// What an `info` subscriber writes of a mismatch answered in a request span made at
    /// `level`.
    fn refusal_logged_at_info(level: Level) -> String {
        let written = Written::default();
        let writer = written.clone();
        let info = tracing_subscriber::fmt()
            .with_max_level(Level::INFO)
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .finish();
        tracing::subscriber::with_default(info, || {
            let span = request_span(level);
            let _entered = span.enter();
            Meters::new("memory").answered(RequestOutcome::Mismatch, level);
        });
        let logs = written.0.lock().unwrap().clone();
        String::from_utf8(logs).unwrap()
    }

    #[test]
    fn an_outcome_is_named_on_a_span_made_at_a_level_the_subscriber_records() {
        // Raised to `info`: recorded, outcome and all.
        let logs = refusal_logged_at_info(Level::INFO);
        assert!(logs.contains("idempotency{outcome=\"mismatch\"}"), "{logs}");
        // At its default `debug`, no span: the refusal is logged on its own.
        let logs = refusal_logged_at_info(Level::DEBUG);
        assert!(
            logs.contains("request refused outcome=\"mismatch\""),
            "{logs}"
        );
        assert!(!logs.contains("idempotency{"), "{logs}");
    }

    #[test]
    fn a_digest_is_short_stable_and_keyed() {
        let abc = short_digest("abc");
        assert_eq!(abc.len(), 12);
        assert!(abc.bytes().all(|digit| digit.is_ascii_hexdigit()));
        assert_eq!(short_digest("abc"), abc);
        assert_ne!(short_digest("abd"), abc);
        // Not the plain SHA-256 of the value, which anyone could compute from a guess.
        assert_ne!(abc, "ba7816bf8f01");
    }
}
