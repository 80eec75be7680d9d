//! Waiting for the original: a duplicate that finds its key in progress waits for the
//! outcome instead of being told to come back (opt-in, bounded).

use std::{
    fmt,
    future::Future,
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
    time::Duration,
};

use tokio::time::Instant;

use crate::{
    store::{self, Claim, Store},
    Fingerprint, Scope,
};

/// How often a waiter looks again at a store that announces nothing: from the first
/// interval, doubling up to the last.
const FIRST_POLL: Duration = Duration::from_millis(20);
const LAST_POLL: Duration = Duration::from_millis(200);
/// How long past the holder's lease a waiter looks again, when nothing was announced: a
/// holder that crashed has no one to announce the end of its claim.
const PAST_LEASE: Duration = Duration::from_millis(10);

/// The requests of one layer waiting for their originals, bounded.
#[derive(Clone, Default)]
pub(crate) struct Waiters {
    count: Arc<AtomicUsize>,
}

/// A place among the waiters, given back when dropped.
pub(crate) struct Waiting {
    count: Arc<AtomicUsize>,
}

impl Waiters {
    /// A place, unless `max` requests wait already.
    pub(crate) fn enter(&self, max: usize) -> Option<Waiting> {
        let entered = self
            .count
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |count| {
                (count < max).then_some(count + 1)
            });
        entered.ok().map(|_| Waiting {
            count: Arc::clone(&self.count),
        })
    }

    /// How many requests wait now.
    pub(crate) fn count(&self) -> usize {
        self.count.load(Ordering::Acquire)
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        self.count.fetch_sub(1, Ordering::AcqRel);
    }
}

impl fmt::Debug for Waiters {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Waiters")
            .field("count", &self.count())
            .finish()
    }
}

/// Waits, until `bound` has passed, for the key that `claim` found in progress with this
/// request's own fingerprint to be completed (then the claim finds the record), released or
/// given up by a crashed holder (then the claim takes the key). Returns the last claim.
///
/// Woken by the store's announcements where it makes them ([`Store::watch`]); a store that
/// makes none is looked at again every 20 ms, doubling up to 200 ms. Either way the key is
/// looked at again once the holder's lease would have run out, and, while it is still
/// held past that, as often as a store that makes none.
pub(crate) async fn for_original<C, F>(
    store: &dyn Store,
    scope: &Scope,
    fingerprint: Fingerprint,
    (bound, lease): (Duration, Duration),
    mut claim: C,
) -> store::Result<Claim>
where
    C: FnMut() -> F,
    F: Future<Output = store::Result<Claim>>,
{
    let deadline = Instant::now() + bound;
    // Made before the key is read again, so that nothing announced after that read is
    // missed. A store that cannot watch now is polled; one slow to start watching (a
    // listening connection that does not open) does not hold the waiter past its bound.
    let watching = tokio::time::timeout_at(deadline, store.watch(scope)).await;
    let mut watch = watching.ok().and_then(Result::ok).flatten();
    let mut poll = FIRST_POLL;
    let mut announced = false;
    loop {
        // The waiters one announcement wakes read the key once between them: a read that
        // fails fails them all, so none waits past its bound for more than that one read.
        let found = match watch.as_ref() {
            Some(watch) if announced => watch.read_shared(fingerprint, lease, &mut claim).await,
            _ => claim().await,
        };
        let lease_remaining = match &found {
            Ok(Claim::InProgress {
                fingerprint: theirs,
                lease_remaining,
                ..
            }) if *theirs == fingerprint => *lease_remaining,
            // Claimed, completed, taken by another request, or the store failed: the
            // caller answers as it would have at first.
            _ => return found,
        };
        let now = Instant::now();
        if now >= deadline {
            return found;
        }
        // A key still held once the lease it was read with ran out (a store that tells the
        // time left by the holder's clock, running behind this one's: Redis) is looked at
        // again as one that announces nothing is, not every `PAST_LEASE`.
        let overdue = lease_remaining.is_zero();
        let lease_ends = if overdue {
            now + poll
        } else {
            now + lease_remaining + PAST_LEASE
        };
        match watch.as_mut() {
            Some(watch) => {
                let woken = tokio::time::timeout_at(deadline.min(lease_ends), watch.announced());
                announced = woken.await.is_ok();
            }
            None => tokio::time::sleep_until(deadline.min(lease_ends).min(now + poll)).await,
        }
        if overdue || watch.is_none() {
            poll = (poll * 2).min(LAST_POLL);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waiters_are_capped_and_give_their_place_back() {
        let waiters = Waiters::default();
        let first = waiters.enter(2).unwrap();
        let second = waiters.enter(2).unwrap();
        assert!(waiters.enter(2).is_none());
        assert_eq!(waiters.count(), 2);
        drop(first);
        let third = waiters.enter(2).unwrap();
        drop((second, third));
        assert_eq!(waiters.count(), 0);
    }
}
