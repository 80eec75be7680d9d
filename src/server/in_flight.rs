//! Executions that have claimed a key and not yet recorded or released it: what a graceful
//! shutdown waits for.

use std::{
    fmt,
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
    time::Duration,
};

use metrics::Gauge;
use tokio::sync::Notify;

/// The executions of one [`IdempotencyLayer`](crate::IdempotencyLayer) that still hold a
/// key: running their handler, or writing its outcome to the store (retried while the
/// store is unreachable, for as long as the claim's lease lasts).
///
/// An execution whose client went away finishes in a task of its own, which a server's
/// graceful shutdown does not wait for. Wait here after the server has stopped and before
/// the runtime ends, so that those outcomes reach the store instead of being dropped with
/// the runtime (their keys would be answered `409` until their lease runs out, then run
/// again).
///
/// # Example
///
/// ```no_run
/// # async fn run(app: axum::Router, listener: tokio::net::TcpListener) -> std::io::Result<()> {
/// use std::time::Duration;
/// use tower_idempotency::{IdempotencyLayer, MemoryStore};
///
/// let layer = IdempotencyLayer::new(MemoryStore::new());
/// let in_flight = layer.in_flight();
/// let app = app.layer(layer);
/// axum::serve(listener, app)
///     .with_graceful_shutdown(async { let _ = tokio::signal::ctrl_c().await; })
///     .await?;
/// if !in_flight.settled(Duration::from_secs(10)).await {
///     eprintln!("{} executions still unrecorded at shutdown", in_flight.count());
/// }
/// # Ok(())
/// # }
/// ```
#[derive(Clone, Default)]
pub struct InFlight {
    executions: Arc<Executions>,
}

#[derive(Default)]
struct Executions {
    count: AtomicUsize,
    none_left: Notify,
}

impl InFlight {
    /// How many executions hold a key now.
    pub fn count(&self) -> usize {
        self.executions.count.load(Ordering::Acquire)
    }

    /// Waits until no execution holds a key, for at most `timeout`; `true` when none does.
    pub async fn settled(&self, timeout: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let none_left = self.executions.none_left.notified();
            tokio::pin!(none_left);
            // Registered before the count is read: a last execution ending in between
            // still wakes this waiter.
            none_left.as_mut().enable();
            if self.count() == 0 {
                return true;
            }
            if tokio::time::timeout_at(deadline, none_left).await.is_err() {
                return self.count() == 0;
            }
        }
    }

    /// Counts an execution holding a key, here and on `gauge`, until it has [`left`](Self::left).
    /// A count, not a guard holding its own handles: the execution's lease already holds
    /// the layer's state, and cloning two more shared handles per execution would touch
    /// two more shared counts on the way in and again on the way out.
    pub(crate) fn entered(&self, gauge: &Gauge) {
        self.executions.count.fetch_add(1, Ordering::AcqRel);
        gauge.increment(1.0);
    }

    /// An execution counted by [`entered`](Self::entered) let its key go.
    pub(crate) fn left(&self, gauge: &Gauge) {
        gauge.decrement(1.0);
        if self.executions.count.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.executions.none_left.notify_waiters();
        }
    }
}

impl fmt::Debug for InFlight {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("InFlight")
            .field("count", &self.count())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn settles_when_the_last_execution_ends() {
        let in_flight = InFlight::default();
        assert!(in_flight.settled(Duration::ZERO).await);
        let gauge = Gauge::noop();
        in_flight.entered(&gauge);
        in_flight.entered(&gauge);
        assert_eq!(in_flight.count(), 2);
        assert!(!in_flight.settled(Duration::from_millis(10)).await);
        let waiter = tokio::spawn({
            let in_flight = in_flight.clone();
            async move { in_flight.settled(Duration::from_secs(5)).await }
        });
        in_flight.left(&gauge);
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(!waiter.is_finished());
        in_flight.left(&gauge);
        assert!(waiter.await.unwrap());
        assert_eq!(in_flight.count(), 0);
    }
}
