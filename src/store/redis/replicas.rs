//! Acknowledgement by replicas: a write answered only once `n` replicas have it (`WAIT`).

use std::time::Duration;

use redis::{Cmd, ErrorKind, RedisError, RedisResult, Value};

/// How many replicas must have a write before it is answered, and how long to wait for them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Replicas {
    pub(super) count: u32,
    pub(super) timeout: Duration,
}

impl Replicas {
    /// `WAIT <count> <timeout ms>`: blocks the connection until `count` replicas have every
    /// write it sent before, or the timeout passes, and answers how many do.
    pub(super) fn command(self) -> Cmd {
        let mut wait = redis::cmd("WAIT");
        wait.arg(self.count).arg(
            u64::try_from(self.timeout.as_millis())
                .unwrap_or(u64::MAX)
                .max(1),
        );
        wait
    }

    /// The stricter of two needs: one `WAIT` answers both.
    pub(super) fn most(a: Option<Self>, b: Option<Self>) -> Option<Self> {
        match (a, b) {
            (Some(a), Some(b)) => Some(Self {
                count: a.count.max(b.count),
                timeout: a.timeout.max(b.timeout),
            }),
            (a, b) => a.or(b),
        }
    }

    /// `value`, a write's reply, with whether `acknowledged` (what `WAIT` answered) says
    /// enough replicas have it.
    pub(super) fn replied(self, value: Value, acknowledged: Option<&Value>) -> Replied {
        Replied {
            value,
            unacknowledged: self.check(acknowledged).err(),
        }
    }

    /// `Ok` when `WAIT` answered at least `count` replicas.
    pub(super) fn check(self, acknowledged: Option<&Value>) -> RedisResult<()> {
        match acknowledged {
            Some(Value::Int(n)) if *n >= i64::from(self.count) => Ok(()),
            Some(Value::Int(n)) => Err(RedisError::from((
                ErrorKind::Client,
                "the write was not acknowledged by enough replicas in time",
                format!("{n} of {} within {:?}", self.count, self.timeout),
            ))),
            Some(Value::ServerError(error)) => Err(error.clone().into()),
            other => Err(RedisError::from((
                ErrorKind::Client,
                "unexpected reply to WAIT",
                format!("{other:?}"),
            ))),
        }
    }
}

/// A command's reply and, for a write that replicas were to acknowledge, whether they did:
/// a write they did not acknowledge still happened on its master, and its reply says what
/// it did (a claim that found a record wrote nothing at all).
#[derive(Debug)]
pub(super) struct Replied {
    pub(super) value: Value,
    /// Why the acknowledgement is missing, for a write that needed one.
    pub(super) unacknowledged: Option<RedisError>,
}

impl Replied {
    /// The reply of a command that needed no acknowledgement.
    pub(super) fn plain(value: Value) -> Self {
        Self {
            value,
            unacknowledged: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TWO: Replicas = Replicas {
        count: 2,
        timeout: Duration::from_millis(500),
    };

    #[test]
    fn enough_replicas_acknowledge() {
        assert!(TWO.check(Some(&Value::Int(2))).is_ok());
        assert!(TWO.check(Some(&Value::Int(3))).is_ok());
        assert!(TWO.check(Some(&Value::Int(1))).is_err());
        assert!(TWO.check(None).is_err());
    }

    #[test]
    fn one_wait_serves_the_strictest_need() {
        let one = Replicas {
            count: 1,
            timeout: Duration::from_secs(1),
        };
        assert_eq!(
            Replicas::most(Some(one), Some(TWO)),
            Some(Replicas {
                count: 2,
                timeout: Duration::from_secs(1)
            })
        );
        assert_eq!(Replicas::most(None, Some(TWO)), Some(TWO));
        assert_eq!(Replicas::most(None, None), None);
    }
}
