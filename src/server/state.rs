//! What every service a layer made shares: the store, the layer's settings (`config.rs`),
//! and its live state, kept apart from them: the requests waiting for their originals, the
//! executions holding a key, and the metric handles.

use std::sync::Arc;

use super::{
    config::Config,
    in_flight::InFlight,
    telemetry::{Meters, RequestOutcome},
    wait::Waiters,
};
use crate::store::Store;

/// What every service a layer made shares: the store, the layer's settings, and its state.
#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) store: Arc<dyn Store>,
    pub(crate) config: Config,
    pub(crate) state: State,
}

impl Shared {
    /// Counts a request's outcome and names it on its span (see [`Meters::answered`]).
    pub(crate) fn answered(&self, outcome: RequestOutcome) {
        self.state.meters.answered(outcome, self.config.span_level);
    }
}

/// Made once per [`IdempotencyLayer::new`](crate::IdempotencyLayer::new) (or
/// `from_shared`) and shared, by choice, by every clone of that layer, whatever settings the
/// clone changes, and by every service they make: one count of waiting requests (each
/// clone's `max_waiting` caps it) and one set of executions for a graceful shutdown to wait
/// for. A layer built on its own has its own.
#[derive(Clone, Debug)]
pub(crate) struct State {
    pub(crate) waiters: Waiters,
    pub(crate) in_flight: InFlight,
    pub(crate) meters: Meters,
}

impl State {
    /// The state of a new layer on a store named `store` (its metrics' `store` label).
    pub(crate) fn new(store: &'static str) -> Self {
        Self {
            waiters: Waiters::default(),
            in_flight: InFlight::default(),
            meters: Meters::new(store),
        }
    }
}
