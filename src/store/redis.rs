//! The Redis store: one key per record, one round trip per operation.

use std::{fmt, sync::LazyLock, time::Duration};

use async_trait::async_trait;
use bytes::Bytes;
use redis::{aio::ConnectionManager, Script, Value};

use super::{Claim, Error, Fenced, Result, Store};
use crate::{ClaimToken, Fingerprint, Record, Scope, StoredResponse};

/// Reads `KEYS[1]` into `current` and returns 0 unless it is the in-progress record holding
/// token `ARGV[1]`. The layout is [`Record::encode`]'s: version byte, `P`, 32 fingerprint
/// bytes, 16 token bytes.
const FENCE: &str = r"
local held = current and #current == 50 and string.sub(current, 1, 2) == '\1P'
    and string.sub(current, 35) == ARGV[1]
if not held then return 0 end
";
const READ: &str = "local current = redis.call('GET', KEYS[1])";

/// Returns the record and its remaining milliseconds, or claims the key and returns 0.
static CLAIM: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local current = redis.call('GET', KEYS[1])
if current then return {current, redis.call('PTTL', KEYS[1])} end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 0
",
    )
});
/// Completing twice with the same record applies once and answers 1 both times, so the
/// layer may retry a completion whose reply was lost.
static COMPLETE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(&format!(
        "{READ} if current == ARGV[2] then return 1 end
{FENCE} redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3]) return 1"
    ))
});
static RELEASE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(&format!(
        "{READ} {FENCE} redis.call('DEL', KEYS[1]) return 1"
    ))
});
static EXTEND: LazyLock<Script> = LazyLock::new(|| {
    Script::new(&format!(
        "{READ} {FENCE} redis.call('PEXPIRE', KEYS[1], ARGV[2]) return 1"
    ))
});

/// Defaults for the connection made by [`RedisStore::open`]: a request waits at most this
/// long for Redis before the layer answers `503` (fail closed).
const RESPONSE_TIMEOUT: Duration = Duration::from_secs(2);
const CONNECTION_TIMEOUT: Duration = Duration::from_secs(1);
/// A request waiting on a reconnection waits for these few quick attempts only: during an
/// outage it must get its `503` in well under a second, not after a long backoff. The next
/// request tries again, so recovery is as fast as Redis comes back.
const RECONNECT_RETRIES: usize = 2;
const RECONNECT_MIN_DELAY: Duration = Duration::from_millis(20);
const RECONNECT_MAX_DELAY: Duration = Duration::from_millis(200);

/// A store in Redis: the production default.
///
/// - Every operation is one Lua script, one round trip (`EVALSHA`, loading the script on
///   `NOSCRIPT`): claim returns the existing record in the same trip; complete, release and
///   extend compare the claim token before writing.
/// - One Redis key per record (`<prefix><scope>`), expiring by Redis's own TTL, so a Redis
///   Cluster can hold them.
/// - One multiplexed [`ConnectionManager`] shared by all requests, reconnecting by itself
///   after an outage.
///
/// # Example
///
/// ```no_run
/// use tower_idempotency::{IdempotencyLayer, RedisStore};
///
/// # async fn run() -> Result<(), tower_idempotency::store::RedisStoreError> {
/// let store = RedisStore::open("redis://127.0.0.1:6379/").await?.prefix("payments:idem:");
/// let layer = IdempotencyLayer::new(store);
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct RedisStore {
    connection: ConnectionManager,
    prefix: String,
}

/// Why a Redis operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RedisStoreError {
    /// The connection or the command failed.
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
    /// Redis answered something the scripts never return.
    #[error("unexpected redis reply: {0}")]
    UnexpectedReply(String),
}

impl From<RedisStoreError> for Error {
    fn from(error: RedisStoreError) -> Self {
        Error::Backend(Box::new(error))
    }
}

impl From<redis::RedisError> for Error {
    fn from(error: redis::RedisError) -> Self {
        RedisStoreError::Redis(error).into()
    }
}

impl RedisStore {
    /// Connects to `url` (`redis://host:port/db`) with a reconnecting connection whose
    /// commands time out after 2 seconds; while Redis is unreachable, a request fails after
    /// two quick reconnection attempts instead of waiting out a long backoff.
    pub async fn open(url: &str) -> Result<Self, RedisStoreError> {
        let client = redis::Client::open(url)?;
        let config = redis::aio::ConnectionManagerConfig::new()
            .set_response_timeout(Some(RESPONSE_TIMEOUT))
            .set_connection_timeout(Some(CONNECTION_TIMEOUT))
            .set_number_of_retries(RECONNECT_RETRIES)
            .set_min_delay(RECONNECT_MIN_DELAY)
            .set_max_delay(RECONNECT_MAX_DELAY);
        let connection = ConnectionManager::new_with_config(client, config).await?;
        Ok(Self::new(connection))
    }

    /// A store on a connection the application already has (its timeouts and reconnection
    /// policy are the application's).
    pub fn new(connection: ConnectionManager) -> Self {
        Self {
            connection,
            prefix: "idempotency:".to_owned(),
        }
    }

    /// The prefix of every key. Default: `idempotency:`.
    ///
    /// # Example
    ///
    /// ```no_run
    /// # async fn run() -> Result<(), tower_idempotency::store::RedisStoreError> {
    /// use tower_idempotency::RedisStore;
    /// let store = RedisStore::open("redis://127.0.0.1/").await?.prefix("shop:idem:");
    /// # Ok(())
    /// # }
    /// ```
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// The Redis key holding a scope's record.
    pub fn redis_key(&self, scope: &Scope) -> String {
        let mut key = self.prefix.clone();
        key.push_str(&scope.storage_key());
        key
    }

    async fn fenced(
        &self,
        script: &Script,
        scope: &Scope,
        token: ClaimToken,
        extra: &[&[u8]],
    ) -> Result<Fenced> {
        let mut invocation = script.key(self.redis_key(scope));
        invocation.arg(token.as_bytes().as_slice());
        for arg in extra {
            invocation.arg(*arg);
        }
        let applied: i64 = invocation
            .invoke_async(&mut self.connection.clone())
            .await?;
        Ok(if applied == 1 {
            Fenced::Applied
        } else {
            Fenced::Lost
        })
    }
}

fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis())
        .unwrap_or(u64::MAX)
        .max(1)
}

#[async_trait]
impl Store for RedisStore {
    async fn claim_with_token(
        &self,
        scope: &Scope,
        fingerprint: Fingerprint,
        token: ClaimToken,
        lease: Duration,
    ) -> Result<Claim> {
        let record = Record::InProgress { fingerprint, token }.encode();
        let reply: Value = CLAIM
            .key(self.redis_key(scope))
            .arg(record.as_ref())
            .arg(millis(lease))
            .invoke_async(&mut self.connection.clone())
            .await?;
        let (current, pttl) = match reply {
            Value::Int(0) => return Ok(Claim::Claimed(token)),
            Value::Array(mut items) if items.len() == 2 => match (items.remove(0), items.remove(0))
            {
                (Value::BulkString(current), Value::Int(pttl)) => (current, pttl),
                other => return Err(unexpected(&other)),
            },
            other => return Err(unexpected(&other)),
        };
        Ok(match Record::decode(Bytes::from(current))? {
            Record::InProgress { fingerprint, .. } => Claim::InProgress {
                fingerprint,
                lease_remaining: Duration::from_millis(pttl.max(0) as u64),
            },
            Record::Completed {
                fingerprint,
                response,
            } => Claim::Completed {
                fingerprint,
                response,
            },
        })
    }

    async fn complete(
        &self,
        scope: &Scope,
        token: ClaimToken,
        fingerprint: Fingerprint,
        response: &StoredResponse,
        ttl: Duration,
    ) -> Result<Fenced> {
        let record = Record::Completed {
            fingerprint,
            response: response.clone(),
        }
        .encode();
        let ttl = millis(ttl).to_string();
        self.fenced(&COMPLETE, scope, token, &[&record, ttl.as_bytes()])
            .await
    }

    async fn release(&self, scope: &Scope, token: ClaimToken) -> Result<Fenced> {
        self.fenced(&RELEASE, scope, token, &[]).await
    }

    async fn extend(&self, scope: &Scope, token: ClaimToken, lease: Duration) -> Result<Fenced> {
        let lease = millis(lease).to_string();
        self.fenced(&EXTEND, scope, token, &[lease.as_bytes()])
            .await
    }
}

fn unexpected(reply: &impl fmt::Debug) -> Error {
    RedisStoreError::UnexpectedReply(format!("{reply:?}")).into()
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStore")
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}
