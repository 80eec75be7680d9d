//! Exponential backoff with full jitter.

use std::time::Duration;

use rand::Rng;

/// How long to wait before a retry: exponential growth from a base, capped, with full
/// jitter.
///
/// Before retry `n` (1 for the first retry) the ceiling is `min(cap, base * 2^(n-1))`, and
/// the wait is drawn uniformly from `0..=ceiling` ("full jitter"): clients that failed
/// together do not come back together, which a fixed or "equal" jitter only partly avoids.
///
/// # Example
///
/// ```
/// use std::time::Duration;
/// use tower_idempotency::client::Backoff;
///
/// let backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(2));
/// assert_eq!(backoff.ceiling(1), Duration::from_millis(100));
/// assert_eq!(backoff.ceiling(3), Duration::from_millis(400));
/// assert_eq!(backoff.ceiling(10), Duration::from_secs(2));
/// assert!(backoff.delay(3) <= Duration::from_millis(400));
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Backoff {
    base: Duration,
    cap: Duration,
}

impl Default for Backoff {
    /// A base of 100 ms and a cap of 5 s.
    fn default() -> Self {
        Self::new(Duration::from_millis(100), Duration::from_secs(5))
    }
}

impl Backoff {
    /// Ceilings start at `base` and double up to `cap` (a `cap` below `base` is raised to it).
    ///
    /// # Panics
    ///
    /// If `base` is zero: every ceiling would be zero, and every retry immediate, whatever
    /// `cap` says.
    pub fn new(base: Duration, cap: Duration) -> Self {
        assert!(
            !base.is_zero(),
            "a backoff's base must be more than zero: every retry would be immediate"
        );
        Self {
            base,
            cap: cap.max(base),
        }
    }

    /// The ceiling before retry `retry` (1 for the first): `min(cap, base * 2^(retry-1))`.
    pub fn ceiling(&self, retry: u32) -> Duration {
        let doublings = retry.saturating_sub(1).min(31);
        self.base
            .checked_mul(1u32 << doublings)
            .map_or(self.cap, |ceiling| ceiling.min(self.cap))
    }

    /// A wait before retry `retry`, drawn uniformly from `0..=ceiling(retry)`.
    pub fn delay(&self, retry: u32) -> Duration {
        self.delay_with(retry, &mut rand::rng())
    }

    /// [`delay`](Self::delay) drawn from `rng`.
    pub fn delay_with(&self, retry: u32, rng: &mut impl Rng) -> Duration {
        let ceiling = self.ceiling(retry);
        let nanos = u64::try_from(ceiling.as_nanos()).unwrap_or(u64::MAX);
        Duration::from_nanos(rng.random_range(0..=nanos))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    #[should_panic(expected = "a backoff's base must be more than zero")]
    fn a_zero_base_is_refused() {
        let _ = Backoff::new(Duration::ZERO, Duration::from_secs(5));
    }

    #[test]
    fn ceilings_double_from_the_base_up_to_the_cap() {
        let backoff = Backoff::new(10 * MS, 100 * MS);
        let ceilings: Vec<_> = (1..=6).map(|n| backoff.ceiling(n)).collect();
        assert_eq!(
            ceilings,
            [10 * MS, 20 * MS, 40 * MS, 80 * MS, 100 * MS, 100 * MS]
        );
        // Far past any shift a u32 allows, without overflow.
        assert_eq!(backoff.ceiling(u32::MAX), 100 * MS);
        assert_eq!(backoff.ceiling(0), 10 * MS);
        let huge = Backoff::new(Duration::from_secs(u64::MAX / 2), Duration::MAX);
        assert_eq!(huge.ceiling(40), Duration::MAX);
    }

    #[test]
    fn a_cap_below_the_base_is_the_base() {
        let backoff = Backoff::new(50 * MS, 10 * MS);
        assert_eq!(backoff.ceiling(1), 50 * MS);
        assert_eq!(backoff.ceiling(5), 50 * MS);
    }

    #[test]
    fn delays_stay_within_zero_and_the_ceiling_and_spread_over_it() {
        let backoff = Backoff::new(100 * MS, Duration::from_secs(1));
        for retry in 1..=8 {
            let ceiling = backoff.ceiling(retry);
            let delays: Vec<_> = (0..2000).map(|_| backoff.delay(retry)).collect();
            assert!(delays.iter().all(|d| *d <= ceiling), "retry {retry}");
            // Full jitter: draws land in the lowest and the highest tenth of the range
            // (each misses 2000 draws with probability 0.9^2000).
            assert!(delays.iter().any(|d| *d < ceiling / 10), "retry {retry}");
            assert!(
                delays.iter().any(|d| *d > ceiling * 9 / 10),
                "retry {retry}"
            );
        }
    }
}
