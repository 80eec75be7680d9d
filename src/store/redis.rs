//! The Redis store: one key per record, one round trip per operation.

mod auto_pipeline;
mod channel;
mod cluster;
mod primary;
mod replicas;
mod signed;
mod subscriber;

use std::{
    collections::HashMap,
    fmt,
    sync::{
        atomic::{AtomicBool, AtomicUsize, Ordering},
        Arc, LazyLock, Mutex, MutexGuard, PoisonError,
    },
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use async_trait::async_trait;
use bytes::{Buf, BufMut, Bytes, BytesMut};
use redis::{
    aio::{ConnectionManager, ConnectionManagerConfig},
    cluster::ClusterClient,
    io::tcp::TcpSettings,
    sentinel::{SentinelClient, SentinelNodeConnectionInfo, SentinelServerType},
    Cmd, ErrorKind, FromRedisValue, IntoConnectionInfo, Script, ServerErrorKind,
};
use tokio::sync::OnceCell;

use self::{
    auto_pipeline::{AutoPipeline, Unawaited},
    cluster::Cluster,
    primary::Primary,
    replicas::Replicas,
    signed::Signer,
    subscriber::{Source, Subscriber},
};
use super::record::{self, completed_len, put_completed, IN_PROGRESS_LEN, TOKEN_OFFSET};
use super::{Announcements, Claim, Ending, Error, Fenced, Result, Store, Watch};
use crate::{ClaimToken, Fingerprint, Record, Scope, StoredResponse};

// The value of a key says until when it is live, so that a claim which finds it can say how
// long to wait, or how long a copy may be cached, without asking Redis for the key's TTL:
// - in progress: the encoded [`Record`], then its lease deadline (unix milliseconds, u64
//   big-endian);
// - completed: the byte `WITH_EXPIRY`, the encoded record, then its expiry (the same way).
// A value of any other form is refused (a store error), never replayed.
const DEADLINE_LEN: usize = 8;
const HELD_LEN: usize = IN_PROGRESS_LEN + DEADLINE_LEN;
const WITH_EXPIRY: u8 = 2;

/// Sets `held` when `current` (the key's value) is the in-progress record holding token
/// `ARGV[1]`: version byte, `P`, 32 fingerprint bytes, 16 token bytes, 8 deadline bytes.
/// Compared in place (`string.byte`, an anchored plain `string.find`): taking substrings
/// would make Redis allocate and intern a Lua string for each.
static HELD: LazyLock<String> = LazyLock::new(|| {
    format!(
        "local held = current and #current == {HELD_LEN}
    and string.byte(current, 1) == {VERSION} and string.byte(current, 2) == {IN_PROGRESS}
    and string.find(current, ARGV[1], {TOKEN_AT}, true) == {TOKEN_AT}",
        VERSION = record::VERSION_1,
        IN_PROGRESS = record::IN_PROGRESS,
        // Lua counts from 1.
        TOKEN_AT = TOKEN_OFFSET + 1,
    )
});
/// Returns 0 unless the key is held by token `ARGV[1]`.
static FENCE: LazyLock<String> =
    LazyLock::new(|| format!("{} if not held then return 0 end", *HELD));
const READ: &str = "local current = redis.call('GET', KEYS[1])";

/// The claim by script, with the same reply as `SET … NX GET` (the existing value or nil):
/// for servers before Redis 7.0, and for claims that replicas must acknowledge in a
/// cluster. `ARGV[1]` the token, `ARGV[2]` the value, `ARGV[3]` the lease in milliseconds.
/// A claim sent again that finds its own token writes the value again: a `WAIT` after it
/// then waits for that write, even on a connection that did not send the first one.
static CLAIM: LazyLock<Lua> = LazyLock::new(|| {
    Lua::new(format!(
        "{READ} if current then
    {held} if held then redis.call('SET', KEYS[1], current, 'KEEPTTL') end
    return current
end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3]) return false",
        held = *HELD,
    ))
});
/// `ARGV[2]` the completed value (marker, record, expiry: stored as sent), `ARGV[3]` the
/// TTL in milliseconds. Completing twice with the same record applies once and answers 1
/// both times (the retry's expiry differs, the record does not), so the layer may retry a
/// completion whose reply was lost. The second writes the stored value again, so that a
/// `WAIT` after it, on whatever connection, waits for the record.
static COMPLETE: LazyLock<Lua> = LazyLock::new(|| Lua::new(complete_script("")));
/// [`COMPLETE`], announcing the completion ([`RedisStore::announce_outcomes`]) on the
/// channel its last argument names; with five arguments, `ARGV[4]` is the record's
/// signature ([`RedisStore::announce_signed_records`]).
static COMPLETE_ANNOUNCED: LazyLock<Lua> =
    LazyLock::new(|| Lua::new(complete_script(&announce_completion("PUBLISH", "NUMSUB"))));
/// Sent whole (`EVAL`), not by hash: a release often goes out for a claim nobody awaits any
/// more (its request went away or timed out), and then no one would be there to load the
/// script and retry if Redis answered `NOSCRIPT`.
static RELEASE: LazyLock<String> = LazyLock::new(|| release_script(""));
/// [`RELEASE`], announcing the release ([`RedisStore::announce_outcomes`]) on the channel
/// `ARGV[2]`.
static RELEASE_ANNOUNCED: LazyLock<String> = LazyLock::new(|| release_script(PUBLISH));
/// [`COMPLETE_ANNOUNCED`] in a cluster: on the key's shard channel.
static COMPLETE_SHARD_ANNOUNCED: LazyLock<Lua> = LazyLock::new(|| {
    Lua::new(complete_script(&announce_completion(
        "SPUBLISH",
        "SHARDNUMSUB",
    )))
});
/// [`RELEASE_ANNOUNCED`] in a cluster: on the key's shard channel.
static RELEASE_SHARD_ANNOUNCED: LazyLock<String> = LazyLock::new(|| release_script(SPUBLISH));
/// Tells the subscribers of the key's channel (the last argument, [`channel::of`] the key)
/// that the claim `ARGV[1]` (its token) ended: named, so that an instance that announced
/// its own write hears it once. The message carries nothing else: a subscriber cannot
/// tell who published it, so its waiters read the key, and take only what the store holds.
const PUBLISH: &str = "redis.call('PUBLISH', ARGV[#ARGV], ARGV[1])";
/// [`PUBLISH`] on the key's shard channel, in a cluster, where a `PUBLISH` would reach
/// every node. Called so that a server without shard channels (before Redis 7.0) still
/// writes the outcome: its waiters cannot subscribe to one either, and read their keys
/// again.
const SPUBLISH: &str = "redis.pcall('SPUBLISH', ARGV[#ARGV], ARGV[1])";

/// The largest completed value a signed completion's message carries: the waiters of
/// another instance take it from there rather than each instance reading the key once. A
/// larger one is left to that read: a message goes whole into every subscriber's output
/// buffer, which Redis bounds (`client-output-buffer-limit pubsub`).
const ANNOUNCED_VALUE_MAX: usize = 64 * 1024;
/// The largest completed value a signed message carries whether anybody listens or not:
/// copying it into the message costs Redis about what asking for the key's subscribers
/// does.
const ANNOUNCED_ALWAYS_MAX: usize = 1024;

/// Tells the subscribers of the key's channel (`PUBLISH`, counted by `NUMSUB`) or shard
/// channel (`SPUBLISH`, `SHARDNUMSUB`) that the claim `ARGV[1]` ended. Signed (five
/// arguments), the message also carries the stored value `ARGV[2]` and its signature
/// `ARGV[4]` when the value is small, or not too large ([`ANNOUNCED_VALUE_MAX`]) and
/// somebody on this node listens: copied into every completion's message, a large value
/// would cost Redis about as much again as storing it. Called like [`SPUBLISH`], for a
/// server without shard channels.
fn announce_completion(publish: &str, numsub: &str) -> String {
    format!(
        "local announced = ARGV[1]
if #ARGV == 5 then
    local size = #ARGV[2]
    if size > {ANNOUNCED_ALWAYS_MAX} and size <= {ANNOUNCED_VALUE_MAX} then
        local subscribers = redis.pcall('PUBSUB', '{numsub}', ARGV[5])
        if (tonumber(subscribers[2]) or 0) > 0 then size = 0 end
    end
    if size <= {ANNOUNCED_ALWAYS_MAX} then announced = ARGV[1] .. ARGV[2] .. ARGV[4] end
end
redis.pcall('{publish}', ARGV[#ARGV], announced)"
    )
}

fn complete_script(announce: &str) -> String {
    format!(
        "{READ} if current and #current == #ARGV[2] and string.byte(current, 1) == {WITH_EXPIRY}
    and string.sub(current, 1, -{after_record}) == string.sub(ARGV[2], 1, -{after_record})
    then redis.call('SET', KEYS[1], current, 'KEEPTTL') return 1 end
{fence} redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
{announce} return 1",
        fence = *FENCE,
        after_record = DEADLINE_LEN + 1,
    )
}

fn release_script(announce: &str) -> String {
    format!(
        "{READ} {} redis.call('DEL', KEYS[1]) {announce} return 1",
        *FENCE
    )
}
/// `ARGV[2]` the lease in milliseconds, `ARGV[3]` the new deadline bytes.
static EXTEND: LazyLock<Lua> = LazyLock::new(|| {
    Lua::new(format!(
        "{READ} {fence}
redis.call('SET', KEYS[1], string.sub(current, 1, {IN_PROGRESS_LEN}) .. ARGV[3], 'PX', ARGV[2])
return 1",
        fence = *FENCE,
    ))
});

/// A Lua script, with the hash `EVALSHA` names it by.
struct Lua {
    code: String,
    hash: String,
}

impl Lua {
    fn new(code: String) -> Self {
        let hash = Script::new(&code).get_hash().to_owned();
        Self { code, hash }
    }
}

/// Redis's default `proto-max-bulk-len`: the largest value it takes in one argument.
const DEFAULT_MAX_VALUE_LEN: usize = 512 * 1024 * 1024;
/// The least `proto-max-bulk-len` Redis may be set to: a shorter value is always taken.
const LEAST_MAX_VALUE_LEN: usize = 1024 * 1024;

/// Defaults for the connection made by [`RedisStore::open`]: a request waits at most this
/// long for Redis before the layer answers `503` (fail closed).
const RESPONSE_TIMEOUT: Duration = Duration::from_secs(2);
/// A completion its replicas did not acknowledge is written again after this pause, then
/// after pauses twice as long, up to the longest, this many times: about four minutes.
const ACK_RETRY_FIRST: Duration = Duration::from_millis(500);
const ACK_RETRY_MAX: Duration = Duration::from_secs(10);
const ACK_RETRIES: usize = 26;
/// The most bytes of completions one store holds at once to write again for their
/// replicas: past it (a replica down under a stream of large records), a completion is not
/// written again (counted: `idempotency_replica_acks_dropped_total`), rather than holding
/// every record of the last four minutes.
const ACKS_PENDING_MAX: usize = 64 * 1024 * 1024;
const CONNECTION_TIMEOUT: Duration = Duration::from_secs(1);
/// A request waiting on a reconnection waits for these few quick attempts only: during an
/// outage it must get its `503` in well under a second, not after a long backoff. The next
/// request tries again, so recovery is as fast as Redis comes back.
const RECONNECT_RETRIES: usize = 2;
const RECONNECT_MIN_DELAY: Duration = Duration::from_millis(20);
const RECONNECT_MAX_DELAY: Duration = Duration::from_millis(200);

/// A store in Redis: the production default, on one server, a Sentinel-managed primary
/// or a Redis Cluster.
///
/// - Every operation is one round trip. The claim is one native `SET … NX PX … GET`
///   (a Lua script on servers before Redis 7.0), which returns the existing record in the
///   same trip; complete, release and extend are Lua scripts that compare the claim token
///   before writing: complete and extend by hash (`EVALSHA`, sent whole as `EVAL` by the
///   request that finds the script missing on its node: `NOSCRIPT`), release whole
///   (`EVAL`), since it often goes out for a request that has stopped waiting.
/// - One Redis key per record (`<prefix><scope>`), expiring by Redis's own TTL, so a Redis
///   Cluster routes each operation by its key ([`cluster`](Self::cluster)).
/// - Every operation may be sent twice (a retry after a lost reply, a redirect): a claim
///   that finds its own token has claimed, and the fenced writes apply once.
/// - On one server ([`open`](Self::open)) or behind Sentinel ([`sentinel`](Self::sentinel)):
///   one multiplexed [`ConnectionManager`] shared by all requests, reconnecting by itself
///   after an outage. The commands that concurrent requests issue in the same turn of the
///   runtime go to Redis as one pipeline: one write and one read for all of them, instead
///   of a system call and a trip through the kernel's network stack each. In a cluster,
///   one pipeline per master.
/// - Optionally, claims and completions wait for replicas to have them
///   ([`replicas`](Self::replicas)), so that a failover does not lose them.
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
    commands: Arc<Commands>,
    prefix: String,
    timeout: Duration,
    /// Whether the server takes `SET … NX GET` (Redis 7.0 and later); learnt on first use.
    native_claim: Arc<AtomicBool>,
    /// Replicas that must have each claim and completion before it counts.
    acks: Option<Replicas>,
    /// Whether a claim its replicas did not acknowledge executes all the same
    /// ([`RedisStore::replicas_best_effort`]).
    best_effort: bool,
    /// Relays announced completions and releases to waiters; `None` for a store made
    /// from a connection, which cannot open one of its own (its waiters poll).
    subscriber: Option<Arc<Subscriber>>,
    /// Whether completions and releases are published ([`RedisStore::announce_outcomes`]).
    announce: bool,
    /// Signs the records completions' messages carry
    /// ([`RedisStore::announce_signed_records`]).
    signer: Option<Arc<Signer>>,
    /// The database the keys are in, as far as the store knows it (0 otherwise), which
    /// signatures cover: Redis relays messages across its databases.
    database: i64,
    /// The largest value the server takes in one argument ([`RedisStore::max_value_len`]),
    /// lowered when the server refuses a longer one.
    max_value_len: Arc<AtomicUsize>,
    /// Whether the server that the store writes to has answered what its
    /// `proto-max-bulk-len` is (or that it will not say); asked again of each server a
    /// failover makes primary, unless told ([`RedisStore::max_value_len`]).
    value_limit_known: Arc<Mutex<ValueLimitKnown>>,
    /// Whether the value limit was told ([`RedisStore::max_value_len`]): never asked.
    value_limit_told: bool,
    /// The bytes of completions held to write again for their replicas
    /// ([`pending_acknowledgements`](Self::pending_acknowledgements)).
    acks_pending: Arc<AtomicUsize>,
}

/// Where the commands go, batched into pipelines.
enum Commands {
    /// One server (fixed, or Sentinel's primary).
    Node(AutoPipeline<Primary>),
    /// A Redis Cluster: one pipeline per master.
    Cluster(AutoPipeline<Cluster>),
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
    /// A record larger than the server takes in one value
    /// ([`RedisStore::max_value_len`]): not sent.
    #[error(
        "a record of {len} bytes is longer than the store sends Redis in one value \
         ({max} bytes, for its proto-max-bulk-len): not sent"
    )]
    ValueTooLarge {
        /// The record's length, as stored.
        len: usize,
        /// The store's [`max_value_len`](RedisStore::max_value_len).
        max: usize,
    },
}

impl From<RedisStoreError> for Error {
    fn from(error: RedisStoreError) -> Self {
        Error::Backend(Box::new(error))
    }
}

impl From<redis::RedisError> for Error {
    fn from(error: redis::RedisError) -> Self {
        // A refused connection is the one failure that proves the command never left.
        if error.is_connection_refusal() {
            return Error::Unavailable(Box::new(RedisStoreError::Redis(error)));
        }
        RedisStoreError::Redis(error).into()
    }
}

impl RedisStore {
    /// Connects to `url` (`redis://host:port/db`) with a reconnecting connection whose
    /// commands time out after 2 seconds (see [`timeout`](Self::timeout) for a command's
    /// whole wait); while Redis is unreachable, a request fails after
    /// two quick reconnection attempts instead of waiting out a long backoff. The socket
    /// has `TCP_NODELAY` set, so that a batch of commands is not held back while the
    /// previous batch is unanswered.
    pub async fn open(url: &str) -> Result<Self, RedisStoreError> {
        // Without TCP_NODELAY, a batch written while the previous one is unanswered waits
        // for that answer (Nagle's algorithm): batches in flight would go one at a time.
        let info = url.into_connection_info()?.set_tcp_settings(nodelay());
        Self::from_client(redis::Client::open(info)?).await
    }

    /// Connects with a client the application configured (TLS, credentials, protocol),
    /// with the same reconnection and timeout policy as [`open`](Self::open). The client's
    /// own TCP settings apply: set `TCP_NODELAY` in them
    /// ([`ConnectionInfo::set_tcp_settings`](redis::ConnectionInfo::set_tcp_settings)) unless
    /// Nagle's algorithm is wanted.
    pub async fn from_client(client: redis::Client) -> Result<Self, RedisStoreError> {
        let connection =
            ConnectionManager::new_with_config(client.clone(), manager_config()).await?;
        let database = client.get_connection_info().redis_settings().db();
        let store = Self::new(connection).subscribing(Source::Servers(vec![client]));
        Ok(Self { database, ..store })
    }

    /// A store on a connection the application already has (its response timeout and
    /// reconnection policy are the application's; [`timeout`](Self::timeout) still bounds
    /// each command's whole wait).
    pub fn new(connection: ConnectionManager) -> Self {
        Self::with(Commands::Node(AutoPipeline::new(Primary::fixed(
            connection,
        ))))
    }

    /// Connects to a Redis Cluster through the seed nodes `urls` (`redis://host:port`, any
    /// of its nodes; the rest are discovered). Each operation goes to the master holding
    /// its key, following `MOVED` and `ASK` redirects while slots move and the new master
    /// after a failover.
    ///
    /// # Example
    ///
    /// ```no_run
    /// # async fn run() -> Result<(), tower_idempotency::store::RedisStoreError> {
    /// use tower_idempotency::RedisStore;
    /// let store = RedisStore::cluster(["redis://10.0.0.1:7000", "redis://10.0.0.2:7000"]).await?;
    /// # Ok(())
    /// # }
    /// ```
    pub async fn cluster<I, U>(urls: I) -> Result<Self, RedisStoreError>
    where
        I: IntoIterator<Item = U>,
        U: IntoConnectionInfo,
    {
        let urls: Vec<_> = urls
            .into_iter()
            .map(|url| url.into_connection_info())
            .collect::<redis::RedisResult<_>>()?;
        let seeds = urls.clone();
        let client = ClusterClient::builder(urls)
            .connection_timeout(CONNECTION_TIMEOUT)
            .response_timeout(RESPONSE_TIMEOUT)
            .tcp_settings(nodelay())
            .build()?;
        Ok(Self::from_cluster_client(client)
            .await?
            .subscribing(Source::Cluster(seeds)))
    }

    /// Connects to a Redis Cluster with a client the application configured (TLS,
    /// credentials, retries, timeouts).
    pub async fn from_cluster_client(client: ClusterClient) -> Result<Self, RedisStoreError> {
        let cluster = Cluster::connect(&client).await?;
        Ok(Self::with(Commands::Cluster(AutoPipeline::new(cluster))))
    }

    /// Connects to the primary that the sentinels at `sentinel_urls` name for `master`, and
    /// follows it: after a failover, requests reach the new primary as soon as the
    /// sentinels name it, without restarting the application. Connections to the primary
    /// have the reconnection and timeout policy of [`open`](Self::open).
    ///
    /// # Example
    ///
    /// ```no_run
    /// # async fn run() -> Result<(), tower_idempotency::store::RedisStoreError> {
    /// use tower_idempotency::RedisStore;
    /// let sentinels = ["redis://10.0.0.1:26379", "redis://10.0.0.2:26379", "redis://10.0.0.3:26379"];
    /// let store = RedisStore::sentinel(sentinels, "payments").await?;
    /// # Ok(())
    /// # }
    /// ```
    pub async fn sentinel<I, U>(sentinel_urls: I, master: &str) -> Result<Self, RedisStoreError>
    where
        I: IntoIterator<Item = U>,
        U: IntoConnectionInfo,
    {
        let node = SentinelNodeConnectionInfo::default().set_tcp_settings(nodelay());
        let client = SentinelClient::build(
            sentinel_urls.into_iter().collect(),
            master.to_owned(),
            Some(node),
            SentinelServerType::Master,
        )?;
        Self::from_sentinel_client(client).await
    }

    /// Follows the primary of a Sentinel client the application configured (TLS,
    /// credentials, database), as [`sentinel`](Self::sentinel) does. The client must be for
    /// the master ([`SentinelServerType::Master`]): the store writes.
    pub async fn from_sentinel_client(client: SentinelClient) -> Result<Self, RedisStoreError> {
        let primary = Primary::sentinel(client, manager_config()).await?;
        let database = primary.database();
        let commands = AutoPipeline::new(primary);
        let source = Source::Sentinel(Arc::clone(commands.sink()));
        let store = Self::with(Commands::Node(commands)).subscribing(source);
        Ok(Self { database, ..store })
    }

    fn with(commands: Commands) -> Self {
        Self {
            commands: Arc::new(commands),
            prefix: "idempotency:".to_owned(),
            timeout: RESPONSE_TIMEOUT,
            native_claim: Arc::new(AtomicBool::new(true)),
            acks: None,
            best_effort: false,
            subscriber: None,
            announce: false,
            signer: None,
            database: 0,
            max_value_len: Arc::new(AtomicUsize::new(DEFAULT_MAX_VALUE_LEN)),
            value_limit_known: Arc::default(),
            value_limit_told: false,
            acks_pending: Arc::new(AtomicUsize::new(0)),
        }
    }

    /// Relays the completions and releases that Redis announces to this store's waiters.
    fn subscribing(mut self, source: Source) -> Self {
        let announcements = Announcements::new();
        self.subscriber = Some(Arc::new(Subscriber::new(
            source,
            announcements,
            RESPONSE_TIMEOUT,
        )));
        self
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

    /// Publish every completion and release on Redis (pub/sub, on a channel of the key's
    /// own: [`announcement_channel`](Self::announcement_channel)), so that requests waiting
    /// for their original
    /// ([`IdempotencyLayer::wait_for_original`](crate::IdempotencyLayer::wait_for_original))
    /// wake the moment it is done, on whichever instance they wait. Turn it on in every
    /// instance that shares the keys. It costs Redis one more command per completion
    /// (measured in BENCHMARKS.md), so it is off by default: a store without it hands out
    /// no watch, and its waiters read their key again every 20 ms, doubling up to 200 ms.
    ///
    /// Waiters subscribe on one connection per store, to the keys they wait on and only
    /// while they wait. A store made from a connection ([`RedisStore::new`]) publishes
    /// but cannot subscribe: its own waiters poll. On the instance that wrote the outcome,
    /// the waiters are handed it as written, and none reads the key; on every other
    /// instance one waiter reads the key for the others.
    ///
    /// A message says only which claim ended (its token), never what it answered: Redis
    /// does not tell a subscriber who published, and any client allowed to publish could
    /// send one. A message is only ever a reason to read the key, so a client that can
    /// publish but not read keys can make waiters read, never make them replay anything
    /// but what the store holds for their own key. The channel is named by a digest of the
    /// key, so a client allowed to list channels (`PUBSUB CHANNELS`) learns no principal
    /// and no idempotency key from it.
    ///
    /// Every instance that shares the keys must name channels alike, as this version does:
    /// the waiters of an instance that subscribes elsewhere (an earlier build) hear nothing,
    /// and fall back on the holder's lease or their bound.
    ///
    /// In a cluster ([`cluster`](Self::cluster), [`from_cluster_client`](Self::from_cluster_client))
    /// the channel is the key's shard channel (`SPUBLISH`, `SSUBSCRIBE`, Redis 7.0 and
    /// later), which only the master serving the key's slot and its replicas carry, where
    /// a `PUBLISH` would go to every node. The store subscribes on that master through a
    /// cluster connection of its own (RESP3), follows the slot when it moves or fails
    /// over, and then wakes the key's waiters to read it again. A cluster before Redis
    /// 7.0 still completes and releases, announcing nothing; its stores cannot subscribe
    /// either, and their waiters read their keys again as without announcements. Every
    /// instance on a cluster must announce on shard channels: one that subscribes to
    /// classic channels (an earlier version of this crate) hears nothing, and its waiters
    /// wait out the holder's lease.
    ///
    /// # Example
    ///
    /// ```no_run
    /// # use std::time::Duration;
    /// # use tower_idempotency::{IdempotencyLayer, RedisStore};
    /// # async fn run() -> Result<(), tower_idempotency::store::RedisStoreError> {
    /// let store = RedisStore::open("redis://127.0.0.1/").await?.announce_outcomes();
    /// let layer = IdempotencyLayer::new(store).wait_for_original(Duration::from_secs(5));
    /// # Ok(())
    /// # }
    /// ```
    pub fn announce_outcomes(mut self) -> Self {
        self.announce = true;
        self
    }

    /// [`announce_outcomes`](Self::announce_outcomes), and each completion's message also
    /// carries its record, signed with HMAC-SHA-256 under `secret`: the waiters of every
    /// instance that has the same secret check the signature and answer with the record,
    /// and none reads the key. Give every instance that shares the keys the same secret
    /// (at least 32 random bytes, kept like any other secret); an instance without it, or
    /// with another, reads the key as after an unsigned message.
    ///
    /// A record is carried when it takes at most 1 KiB, or at most 64 KiB and somebody
    /// on the key's node listens; a larger one is read once per instance. The signature
    /// covers the key's channel, the claim that ended, the record with its expiry and the
    /// time of signing, and the database number the store was opened on ([`open`]'s URL,
    /// the client's of [`from_client`] and [`from_sentinel_client`]; 0 for a cluster, which
    /// has no other, and for a store made with [`new`]): a message moved to another key,
    /// made up, or changed does not verify, nor one from a deployment on another database
    /// of the same server (Redis relays messages across databases), and one published
    /// again more than a minute after its signing (by the instances' clocks) is not taken.
    /// Deployments that share a server through connections made with [`new`], which do not
    /// tell their database, need secrets or [prefixes](Self::prefix) of their own. Within that minute, a captured message could
    /// reach only waiters of the same key, and only of a claim made after the record's key
    /// was deleted early. Anything that does not verify only wakes the waiters to read.
    ///
    /// The value is signed before the fenced write decides whether it applies: a holder
    /// whose lease was lost sends a signed value that Redis then neither stores nor
    /// publishes. Only a client that can see other clients' commands (`MONITOR`, or the
    /// traffic where it runs without TLS) could take it from there, and such a client
    /// can write the keys anyway: the store trusts its writers.
    ///
    /// # Example
    ///
    /// ```no_run
    /// # use std::time::Duration;
    /// # use tower_idempotency::{IdempotencyLayer, RedisStore};
    /// # async fn run() -> Result<(), tower_idempotency::store::RedisStoreError> {
    /// # let secret_from_vault = [7u8; 32];
    /// let store = RedisStore::open("redis://127.0.0.1/")
    ///     .await?
    ///     .announce_signed_records(secret_from_vault);
    /// let layer = IdempotencyLayer::new(store).wait_for_original(Duration::from_secs(5));
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// [`open`]: Self::open
    /// [`from_client`]: Self::from_client
    /// [`new`]: Self::new
    /// [`from_sentinel_client`]: Self::from_sentinel_client
    pub fn announce_signed_records(mut self, secret: impl AsRef<[u8]>) -> Self {
        let signer = Arc::new(Signer::new(secret.as_ref(), self.database));
        if let Some(subscriber) = &self.subscriber {
            subscriber.verify_with(Arc::clone(&signer));
        }
        self.signer = Some(signer);
        self.announce_outcomes()
    }

    /// The prefix of every key.
    pub fn key_prefix(&self) -> &str {
        &self.prefix
    }

    /// The longest each command waits for Redis, counted from when the request issues it:
    /// time queued behind other requests' commands counts as well as time on the wire.
    /// Past it the operation fails, and the layer answers `503` (fail closed). On one
    /// server, a claim still queued when its time runs out is not sent (in a cluster it
    /// may be, and the layer releases it); a fenced write (complete, extend, release)
    /// still is, since dropping a completion would lose its record. An operation
    /// that finds its script missing on the server (`NOSCRIPT`) sends it whole, within a
    /// bound of its own. Default: 2 seconds.
    ///
    /// # Panics
    ///
    /// If `timeout` is zero (no command could be answered), or not longer than the
    /// replicas' wait ([`replicas`](Self::replicas)), which every command may queue behind.
    ///
    /// # Example
    ///
    /// ```no_run
    /// # async fn run() -> Result<(), tower_idempotency::store::RedisStoreError> {
    /// use std::time::Duration;
    /// use tower_idempotency::RedisStore;
    /// let store = RedisStore::open("redis://127.0.0.1/")
    ///     .await?
    ///     .timeout(Duration::from_millis(500));
    /// # Ok(())
    /// # }
    /// ```
    pub fn timeout(mut self, timeout: Duration) -> Self {
        assert!(
            !timeout.is_zero(),
            "RedisStore::timeout must be more than zero: no command could be answered"
        );
        if let Some(acks) = self.acks {
            assert_waits_fit(acks.timeout, timeout);
        }
        self.timeout = timeout;
        self
    }

    /// Makes each claim and each completion wait until `count` replicas have it (Redis
    /// `WAIT`, on the connection that wrote it; in a cluster, to the key's master), for at
    /// most `timeout`. Default: off.
    ///
    /// A claim that writes nothing (a replay, a duplicate of a running request, a key reused
    /// with other parameters) is answered from what it read, whatever the replicas say:
    /// replays go on with no replica attached, each after its batch's `WAIT` (below). A
    /// claim that takes the key and is not acknowledged in time fails: the layer releases it
    /// and answers `503`, and the handler does not run (unless
    /// [`replicas_best_effort`](Self::replicas_best_effort)). A
    /// completion that its primary applied but the replicas did not acknowledge within
    /// `timeout` is answered then, counted
    /// (`idempotency_replica_acks_missing_total{operation="complete"}`) and logged, and
    /// written again in the background (each time waiting for the replicas) until they
    /// acknowledge it, for about four minutes; a completion that was not applied at all is
    /// written again until it is, within the claim's lease. So an operation runs only once
    /// its claim is on `count` replicas, and a failover to one of those replicas keeps it.
    ///
    /// To stay available through the loss of a primary, a shard needs `count + 1`
    /// replicas: after a failover promotes one, `count` remain to acknowledge. With fewer,
    /// new operations get `503` until a replica is attached again (acknowledgements then
    /// resume by themselves), while replays go on.
    ///
    /// A `WAIT` holds the connection it is sent on until the replicas answer or `timeout`
    /// passes (one closes each batch of commands that holds a claim or a completion), and
    /// every command sent on that connection after it waits as long. With the replicas
    /// answering, that is a replica's round trip; with one missing, each such batch waits
    /// the whole `timeout`, the batches behind it (replays too: a claim cannot know it
    /// will write nothing) add theirs, and under load commands fail past the store's
    /// [`timeout`](Self::timeout). So keep `timeout` to a fraction of the store's (a
    /// quarter, say), and alert on a missing replica. It must be shorter than the store's
    /// timeout (2 s by default; raise that first) and than its connections' own response
    /// timeout (2 s): a longer one fails every operation the first time a replica is
    /// missing.
    ///
    /// `WAIT` is not consensus: a failover may promote a replica that had not acknowledged
    /// (when more replicas exist than `count`), and a write acknowledged by replicas is
    /// still lost if every one of them fails too. Each claim and completion waits for a
    /// replica's round trip.
    ///
    /// # Example
    ///
    /// ```no_run
    /// # async fn run() -> Result<(), tower_idempotency::store::RedisStoreError> {
    /// use std::time::Duration;
    /// use tower_idempotency::RedisStore;
    /// let store = RedisStore::open("redis://127.0.0.1/")
    ///     .await?
    ///     .replicas(1, Duration::from_millis(500));
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Panics
    ///
    /// If `count` is not zero and `timeout` is not shorter than the store's
    /// [`timeout`](Self::timeout) and than 2 s.
    pub fn replicas(mut self, count: u32, timeout: Duration) -> Self {
        if count > 0 {
            assert_waits_fit(timeout, self.timeout);
        }
        self.acks = (count > 0).then_some(Replicas { count, timeout });
        self
    }

    /// With [`replicas`](Self::replicas): a claim the replicas do not acknowledge in time
    /// executes all the same, counted (`idempotency_replica_acks_missing_total{operation="claim"}`)
    /// and logged at `warn`, instead of being released and answered `503`.
    ///
    /// What that risks: while no replica acknowledges, a claim lives on the primary
    /// alone, and a failover in that time (to a replica that had not received it) forgets
    /// it, so a retry on the new primary runs the operation a second time while the first
    /// still runs, or after it, if its completion was lost too. The strict default refuses
    /// new operations instead, until a replica acknowledges again: a defensible choice,
    /// like Redis's `min-replicas-to-write`, where a second execution is worse than an
    /// outage of new writes. Replays are answered either way.
    ///
    /// # Example
    ///
    /// ```no_run
    /// # async fn run() -> Result<(), tower_idempotency::store::RedisStoreError> {
    /// use std::time::Duration;
    /// use tower_idempotency::RedisStore;
    /// let store = RedisStore::open("redis://127.0.0.1/")
    ///     .await?
    ///     .replicas(1, Duration::from_millis(500))
    ///     .replicas_best_effort();
    /// # Ok(())
    /// # }
    /// ```
    pub fn replicas_best_effort(mut self) -> Self {
        self.best_effort = true;
        self
    }

    /// The largest value the server takes in one command argument: its
    /// `proto-max-bulk-len`, 512 MiB (the default) unless lowered. A completion whose record
    /// is larger is refused without being sent ([`Error::Refused`] with
    /// [`RedisStoreError::ValueTooLarge`]): sent, Redis answers with a protocol error and
    /// closes the connection, failing the commands of every request that shared it, the
    /// lease's renewals included. The layer then records a refusal to replay the response
    /// at once (`409 response_not_replayable`), as for one over its `max_response_body`.
    /// Unless this is set, the store asks the server its `proto-max-bulk-len` (`CONFIG
    /// GET`, on the node that holds the key) before the first record past 1 MiB, the least
    /// Redis may be set to; records wait for that one question, and one left unanswered
    /// fails with nothing sent, to be asked again by the next. Behind Sentinel, each server
    /// a failover makes primary is asked again; in a Cluster, the first node asked answers
    /// for all (set this where nodes differ). Where the server will not
    /// say (a user without the right, a managed service that hides `CONFIG`; logged) and
    /// its limit is lower, the first record past it is sent and refused, and the store
    /// keeps below that length from then on; with [`replicas`](Self::replicas), whose
    /// `WAIT` hides the refusal, every such record is sent: set this there. Default:
    /// 512 MiB.
    ///
    /// # Panics
    ///
    /// If `bytes` is zero: no record could be written.
    ///
    /// # Example
    ///
    /// ```no_run
    /// # async fn run() -> Result<(), tower_idempotency::store::RedisStoreError> {
    /// use tower_idempotency::RedisStore;
    /// // The server runs with `proto-max-bulk-len 64mb`.
    /// let store = RedisStore::open("redis://127.0.0.1/")
    ///     .await?
    ///     .max_value_len(64 * 1024 * 1024);
    /// # Ok(())
    /// # }
    /// ```
    pub fn max_value_len(mut self, bytes: usize) -> Self {
        assert!(
            bytes > 0,
            "RedisStore::max_value_len must be more than zero: no record could be written"
        );
        self.max_value_len = Arc::new(AtomicUsize::new(bytes));
        self.value_limit_told = true;
        self
    }

    /// The Redis key holding a scope's record.
    pub fn redis_key(&self, scope: &Scope) -> String {
        let scope = scope.storage_key();
        let mut key = String::with_capacity(self.prefix.len() + scope.len());
        key.push_str(&self.prefix);
        key.push_str(scope);
        key
    }

    /// Sends `command` (with the next batch, on one server) and reads its reply as `T`; with
    /// `durable`, once the replicas of [`replicas`](Self::replicas) have it, or once they
    /// did not in time, saying so.
    async fn query<T: FromRedisValue>(
        &self,
        command: Cmd,
        key: &str,
        unawaited: Unawaited,
        durable: bool,
    ) -> redis::RedisResult<Acked<T>> {
        let acks = self.acks.filter(|_| durable);
        let reply = match &*self.commands {
            Commands::Node(pipeline) => {
                pipeline
                    .query(command, 0, self.timeout, unawaited, acks)
                    .await?
            }
            Commands::Cluster(pipeline) => {
                let slot = cluster::slot(key.as_bytes());
                pipeline
                    .query(command, slot, self.timeout, unawaited, acks)
                    .await?
            }
        };
        Ok(Acked {
            reply: redis::from_redis_value(reply.value)?,
            unacknowledged: reply.unacknowledged,
        })
    }

    /// Runs `script` on `key` with `args` by its hash; where the server that answers does
    /// not have it (a new or restarted server, a node that took over the key's slot), sends
    /// it whole, which also loads it there.
    async fn eval<T: FromRedisValue>(
        &self,
        script: &Lua,
        key: &str,
        args: &[&[u8]],
        unawaited: Unawaited,
        durable: bool,
    ) -> redis::RedisResult<Acked<T>> {
        let evalsha = script_command("EVALSHA", &script.hash, key, args);
        match self.query(evalsha, key, unawaited, durable).await {
            Err(error) if error.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
                let eval = script_command("EVAL", &script.code, key, args);
                self.query(eval, key, unawaited, durable).await
            }
            reply => reply,
        }
    }

    async fn claim_by_script(
        &self,
        key: &str,
        token: ClaimToken,
        value: &[u8],
        lease: Duration,
    ) -> Result<Acked<Option<Vec<u8>>>> {
        let lease = millis(lease).to_string();
        let args: [&[u8]; 3] = [token.as_bytes(), value, lease.as_bytes()];
        Ok(self.eval(&CLAIM, key, &args, Unawaited::Skip, true).await?)
    }

    async fn eval_fenced(
        &self,
        script: &Lua,
        key: &str,
        token: ClaimToken,
        extra: &[&[u8]],
        durable: bool,
    ) -> Result<Acked<Fenced>> {
        let mut args = Vec::with_capacity(extra.len() + 1);
        args.push(token.as_bytes().as_slice());
        args.extend_from_slice(extra);
        let applied: Acked<i64> = self
            .eval(script, key, &args, Unawaited::Send, durable)
            .await?;
        Ok(Acked {
            reply: fenced(applied.reply),
            unacknowledged: applied.unacknowledged,
        })
    }

    /// Asks the server that holds `key` its `proto-max-bulk-len`, before the first record
    /// that could be past it: sent, such a record closes the connection. Records wait for
    /// the one question in flight; one that goes unanswered (a timeout, a dropped
    /// connection) fails with nothing sent, and the next record asks again. A server that
    /// answers that it will not say (no right to `CONFIG`, a managed service that hides
    /// it) leaves the default, and the store learns from a refusal where it can.
    async fn know_value_limit(&self, key: &str) -> Result<()> {
        if self.value_limit_told {
            return Ok(());
        }
        let answered = {
            let mut known = self.value_limit_known();
            let server = self.server();
            if known.server != server {
                // A failover made another server primary: its limit may differ.
                *known = ValueLimitKnown {
                    server,
                    answered: Arc::default(),
                };
                self.max_value_len
                    .store(DEFAULT_MAX_VALUE_LEN, Ordering::Relaxed);
            }
            Arc::clone(&known.answered)
        };
        let known = answered.get_or_try_init(|| async {
            let mut ask = redis::cmd("CONFIG");
            ask.arg("GET").arg("proto-max-bulk-len");
            let asked = self.query::<redis::Value>(ask, key, Unawaited::Skip, false);
            // Read here rather than by the query: a reply of another shape (a proxy's) is
            // the server's answer too, that it will not say, where a failure to read the
            // reply stream is not.
            let limit = asked.await.map(|answer| {
                redis::from_redis_value::<HashMap<String, u64>>(answer.reply)
                    .map(|limits| limits.into_values().next())
            });
            match limit {
                Ok(Ok(Some(limit))) => {
                    // Unless a failover has made another server primary meanwhile: this
                    // answer is no longer the limit of the server written to.
                    let known = self.value_limit_known();
                    if Arc::ptr_eq(&known.answered, &answered) {
                        let limit = usize::try_from(limit).unwrap_or(usize::MAX);
                        self.max_value_len.fetch_min(limit, Ordering::Relaxed);
                    }
                    Ok(())
                }
                Ok(Ok(None)) => Ok(()),
                Ok(Err(error)) => {
                    declined(&error);
                    Ok(())
                }
                Err(error) if declines_to_say(&error) => {
                    declined(&error);
                    Ok(())
                }
                Err(error) => Err(Error::Unavailable(Box::new(RedisStoreError::Redis(error)))),
            }
        });
        // Records take their turn at asking: bounded as a whole, or each would wait for
        // every question before its own to time out.
        match tokio::time::timeout(self.timeout, known).await {
            Ok(known) => known.copied(),
            Err(_) => Err(Error::Unavailable(Box::new(RedisStoreError::Redis(
                auto_pipeline::timed_out(self.timeout),
            )))),
        }
    }

    /// What the store knows of its server's value limit, locked.
    fn value_limit_known(&self) -> MutexGuard<'_, ValueLimitKnown> {
        self.value_limit_known
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Which server the store writes to: changes as it follows Sentinel through a
    /// failover (never for a fixed server, nor for a cluster, whose nodes are not told
    /// apart here).
    fn server(&self) -> u64 {
        match &*self.commands {
            Commands::Node(primary) => primary.sink().server(),
            Commands::Cluster(_) => 0,
        }
    }

    /// Keeps below `len` from now on when the server refused a value of that length as past
    /// its `proto-max-bulk-len`: sent again, each would close the connection again.
    #[cold]
    fn learn_value_limit(&self, error: &Error, len: usize) {
        let Error::Backend(error) = error else {
            return;
        };
        let Some(RedisStoreError::Redis(error)) = error.downcast_ref() else {
            return;
        };
        let refused = matches!(error.kind(), ErrorKind::Server(_))
            && error.to_string().contains("invalid bulk length");
        if !refused {
            return;
        }
        let before = self.max_value_len.fetch_min(len - 1, Ordering::Relaxed);
        if before >= len {
            tracing::warn!(
                len,
                "Redis refused a record past its proto-max-bulk-len: records this long are refused from now on without being sent (RedisStore::max_value_len)"
            );
        }
    }

    /// Counts and logs a write that the replicas of [`replicas`](Self::replicas) did not
    /// acknowledge in time, but that its master applied.
    fn unacknowledged(&self, operation: &'static str, error: &redis::RedisError) {
        metrics::counter!("idempotency_replica_acks_missing_total", "operation" => operation)
            .increment(1);
        tracing::warn!(
            %error, operation,
            "applied on the Redis primary, not acknowledged by its replicas in time: a failover before they have it would lose it"
        );
    }

    /// Writes a completion that its replicas did not acknowledge again, in the background,
    /// until they do (each write waits for them as the first did), for a bounded time:
    /// completing is idempotent, and a write sent again reaches a connection's `WAIT` even
    /// after a failover opened a new one.
    fn acknowledge_later(
        &self,
        script: &'static Lua,
        key: String,
        token: ClaimToken,
        args: Vec<Vec<u8>>,
    ) {
        let bytes = args.iter().map(Vec::len).sum::<usize>();
        let Some(held) = Pending::hold(&self.acks_pending, bytes) else {
            metrics::counter!("idempotency_replica_acks_dropped_total").increment(1);
            tracing::warn!(
                bytes,
                "a completion its replicas did not acknowledge is not written again: {ACKS_PENDING_MAX} bytes of others are already held to be"
            );
            return;
        };
        let store = self.clone();
        let acknowledging = async move {
            let _held = held;
            let mut pause = ACK_RETRY_FIRST;
            for _ in 0..ACK_RETRIES {
                tokio::time::sleep(pause).await;
                let refs: Vec<&[u8]> = args.iter().map(Vec::as_slice).collect();
                match store.eval_fenced(script, &key, token, &refs, true).await {
                    Ok(Acked {
                        reply: Fenced::Applied,
                        unacknowledged: None,
                    }) => {
                        metrics::counter!("idempotency_replica_acks_recovered_total").increment(1);
                        tracing::info!("a completion's replicas acknowledged it after all");
                        return;
                    }
                    // Expired, or taken by a claim since: nothing of it is left to keep.
                    Ok(Acked {
                        reply: Fenced::Lost,
                        ..
                    }) => return,
                    _ => pause = (pause * 2).min(ACK_RETRY_MAX),
                }
            }
            tracing::warn!(
                "a completion's replicas never acknowledged it: a failover before they have it would lose it"
            );
        };
        tokio::spawn(tracing::Instrument::instrument(
            acknowledging,
            tracing::Span::current(),
        ));
    }

    /// The end of the claim `token` on the key announced on `channel`, about to be
    /// written: this process's waiters are told of it once the write returns, whether
    /// Redis's message of it arrives before or after ([`Announcements::ending`]). One
    /// atomic read when nobody waits.
    fn ending<'a>(&'a self, channel: &'a str, token: ClaimToken) -> Option<Ending<'a>> {
        let subscriber = self.subscriber.as_ref()?;
        Some(subscriber.announcements().ending(channel, token))
    }

    /// The channel on which the completions and releases of `scope`'s key are announced
    /// ([`announce_outcomes`](Self::announce_outcomes)): named by a digest of the key, so
    /// that listing the channels in use (`PUBSUB CHANNELS`) shows no principal and no
    /// idempotency key, and in a cluster a shard channel of the key's own slot.
    pub fn announcement_channel(&self, scope: &Scope) -> String {
        channel::of(&self.redis_key(scope))
    }

    /// How many bytes of completions this store holds now to write again until their
    /// replicas acknowledge them ([`replicas_best_effort`](Self::replicas_best_effort)): at
    /// most 64 MiB, past which a completion is not written again.
    pub fn pending_acknowledgements(&self) -> usize {
        self.acks_pending.load(Ordering::Relaxed)
    }

    /// How many keys this store's requests wait on now, each subscribed to once however
    /// many wait on it.
    pub async fn watched(&self) -> usize {
        match &self.subscriber {
            Some(subscriber) => subscriber.channels().await,
            None => 0,
        }
    }
}

/// Refuses a replicas' wait that the store's command timeout, or its connections' own
/// response timeout, cannot cover: with a replica missing, each `WAIT` would hold the
/// connection past every queued command's timeout.
fn assert_waits_fit(wait: Duration, timeout: Duration) {
    assert!(
        wait < RESPONSE_TIMEOUT,
        "RedisStore: the replicas' wait ({wait:?}) must be shorter than the connections' \
         response timeout ({RESPONSE_TIMEOUT:?}), which a WAIT counts against"
    );
    assert!(
        wait < timeout,
        "RedisStore: the replicas' wait ({wait:?}) must be shorter than the store's timeout \
         ({timeout:?}), which every command queued behind a WAIT counts against: raise \
         RedisStore::timeout first"
    );
}

fn nodelay() -> TcpSettings {
    TcpSettings::default().set_nodelay(true)
}

/// The reconnection policy of connections to one server.
fn manager_config() -> ConnectionManagerConfig {
    ConnectionManagerConfig::new()
        .set_response_timeout(Some(RESPONSE_TIMEOUT))
        .set_connection_timeout(Some(CONNECTION_TIMEOUT))
        .set_number_of_retries(RECONNECT_RETRIES)
        .set_min_delay(RECONNECT_MIN_DELAY)
        .set_max_delay(RECONNECT_MAX_DELAY)
}

/// `<verb> <script> 1 <key> <args…>` (`EVAL` with the script's source, `EVALSHA` with its
/// hash), sized up front: growing the command's buffers costs more than filling them.
fn script_command(verb: &str, script: &str, key: &str, args: &[&[u8]]) -> Cmd {
    let data =
        verb.len() + script.len() + 1 + key.len() + args.iter().map(|arg| arg.len()).sum::<usize>();
    let mut command = Cmd::with_capacity(4 + args.len(), data);
    command.arg(verb).arg(script).arg(1).arg(key);
    for arg in args {
        command.arg(*arg);
    }
    command
}

/// What a fenced script's reply says: 1 when it applied.
/// A reply, and why replicas did not acknowledge its write where they were to.
struct Acked<T> {
    reply: T,
    unacknowledged: Option<redis::RedisError>,
}

fn fenced(applied: i64) -> Fenced {
    if applied == 1 {
        Fenced::Applied
    } else {
        Fenced::Lost
    }
}

/// The value of a key claimed with `token` for `lease` from now.
fn held_value(fingerprint: Fingerprint, token: ClaimToken, lease: Duration) -> Vec<u8> {
    let mut value = Vec::with_capacity(HELD_LEN);
    value.extend_from_slice(&Record::InProgress { fingerprint, token }.encode());
    value.extend_from_slice(&deadline(lease).to_be_bytes());
    value
}

fn deadline(lease: Duration) -> u64 {
    unix_millis().saturating_add(millis(lease))
}

fn unix_millis() -> u64 {
    let since_epoch = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    u64::try_from(since_epoch.as_millis()).unwrap_or(u64::MAX)
}

fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis())
        .unwrap_or(u64::MAX)
        .max(1)
}

#[async_trait]
impl Store for RedisStore {
    fn name(&self) -> &'static str {
        "redis"
    }

    async fn claim_with_token(
        &self,
        scope: &Scope,
        fingerprint: Fingerprint,
        token: ClaimToken,
        lease: Duration,
    ) -> Result<Claim> {
        let value = held_value(fingerprint, token, lease);
        let key = self.redis_key(scope);
        // A cluster may send a command again on another connection (after an I/O error or a
        // failover), and a `WAIT` there counts only that connection's writes: a claim that
        // replicas must acknowledge goes by the script, which writes again when resent.
        let resent_acks = self.acks.is_some() && matches!(*self.commands, Commands::Cluster(_));
        let reply: Acked<Option<Vec<u8>>> = if self.native_claim.load(Ordering::Relaxed)
            && !resent_acks
        {
            // One native command: claims the key, or returns what holds it.
            // Sized up front: growing the command's buffers costs more than filling them.
            let mut set = Cmd::with_capacity(7, "SETNXPXGET".len() + key.len() + value.len() + 20);
            set.arg("SET")
                .arg(&key)
                .arg(value.as_slice())
                .arg("NX")
                .arg("PX")
                .arg(millis(lease))
                .arg("GET");
            match self.query(set, &key, Unawaited::Skip, true).await {
                Err(error) if error.to_string().contains("syntax error") => {
                    tracing::info!(
                        "this Redis has no SET … NX GET (before 7.0): claiming by script"
                    );
                    self.native_claim.store(false, Ordering::Relaxed);
                    self.claim_by_script(&key, token, &value, lease).await?
                }
                reply => reply?,
            }
        } else {
            self.claim_by_script(&key, token, &value, lease).await?
        };
        let Acked {
            reply,
            unacknowledged,
        } = reply;
        // A claim that wrote (took the key, or wrote its own again) counts only once replicas
        // have it, unless best effort was chosen. One that found another request's record
        // wrote nothing: what it read is the answer, whatever the replicas.
        let claimed = || match unacknowledged {
            None => Ok(Claim::Claimed(token)),
            Some(error) if self.best_effort => {
                self.unacknowledged("claim", &error);
                Ok(Claim::Claimed(token))
            }
            Some(error) => Err(Error::from(error)),
        };
        let Some(current) = reply else {
            return claimed();
        };
        let (record, deadline) = split_value(current)?;
        match Record::decode(record)? {
            // This very claim, sent twice (a retry after a lost reply, a cluster redirect):
            // the second finds what the first wrote. The key is ours.
            Record::InProgress { token: holder, .. } if holder == token => claimed(),
            Record::InProgress {
                fingerprint,
                token: holder,
            } => Ok(Claim::InProgress {
                fingerprint,
                lease_remaining: remaining(deadline),
                running_for: holder.age(),
            }),
            Record::Completed {
                fingerprint,
                response,
            } => Ok(Claim::Completed {
                fingerprint,
                response,
                expires_in: Some(remaining(deadline)),
            }),
        }
    }

    async fn complete(
        &self,
        scope: &Scope,
        token: ClaimToken,
        fingerprint: Fingerprint,
        response: &StoredResponse,
        ttl: Duration,
    ) -> Result<Fenced> {
        // The value as Redis stores it, so that the script sets it without concatenating.
        let len = 1 + completed_len(response) + DEADLINE_LEN;
        let key = self.redis_key(scope);
        if len > LEAST_MAX_VALUE_LEN {
            Box::pin(self.know_value_limit(&key)).await?;
        }
        let max = self.max_value_len.load(Ordering::Relaxed);
        if len > max {
            let too_large = RedisStoreError::ValueTooLarge { len, max };
            return Err(Error::Refused(Box::new(too_large)));
        }
        let mut value = BytesMut::with_capacity(len);
        value.put_u8(WITH_EXPIRY);
        put_completed(&mut value, &fingerprint, response);
        value.put_u64(deadline(ttl));
        let ttl_given = ttl;
        let ttl = millis(ttl).to_string();
        let script = match (self.announce, &*self.commands) {
            (false, _) => &*COMPLETE,
            (true, Commands::Node(_)) => &*COMPLETE_ANNOUNCED,
            (true, Commands::Cluster(_)) => &*COMPLETE_SHARD_ANNOUNCED,
        };
        let channel = self.announce.then(|| channel::of(&key));
        let ending = channel
            .as_deref()
            .and_then(|channel| self.ending(channel, token));
        let signer = self
            .signer
            .as_ref()
            .filter(|_| value.len() <= ANNOUNCED_VALUE_MAX);
        let signature;
        let args: &[&[u8]] = match (&channel, signer) {
            (Some(channel), Some(signer)) => {
                signature = signer.sign(channel, token, &value);
                &[&value, ttl.as_bytes(), &signature, channel.as_bytes()]
            }
            (Some(channel), None) => &[&value, ttl.as_bytes(), channel.as_bytes()],
            (None, _) => &[&value, ttl.as_bytes()],
        };
        let fenced = self.eval_fenced(script, &key, token, args, true).await;
        let Acked {
            reply: completed,
            unacknowledged,
        } = fenced.inspect_err(|error| self.learn_value_limit(error, len))?;
        if let (Fenced::Applied, Some(error)) = (completed, unacknowledged) {
            // On its master, which answers replays: the client gets its answer now, and the
            // replicas are asked again meanwhile.
            self.unacknowledged("complete", &error);
            let args = args.iter().map(|arg| arg.to_vec()).collect();
            self.acknowledge_later(script, key.clone(), token, args);
        }
        if let (Fenced::Applied, Some(ending)) = (completed, ending) {
            // This process's waiters take the record as written, and none reads it.
            ending.completed(|| Claim::Completed {
                fingerprint,
                response: response.clone(),
                expires_in: Some(ttl_given),
            });
        }
        Ok(completed)
    }

    async fn release(&self, scope: &Scope, token: ClaimToken) -> Result<Fenced> {
        let key = self.redis_key(scope);
        let script = match (self.announce, &*self.commands) {
            (false, _) => &*RELEASE,
            (true, Commands::Node(_)) => &*RELEASE_ANNOUNCED,
            (true, Commands::Cluster(_)) => &*RELEASE_SHARD_ANNOUNCED,
        };
        let channel = self.announce.then(|| channel::of(&key));
        let eval = match &channel {
            Some(channel) => {
                let args: [&[u8]; 2] = [token.as_bytes(), channel.as_bytes()];
                script_command("EVAL", script, &key, &args)
            }
            None => script_command("EVAL", script, &key, &[token.as_bytes()]),
        };
        let ending = channel
            .as_deref()
            .and_then(|channel| self.ending(channel, token));
        let released: Acked<i64> = self.query(eval, &key, Unawaited::Send, false).await?;
        let released = fenced(released.reply);
        if let (Fenced::Applied, Some(ending)) = (released, ending) {
            ending.released();
        }
        Ok(released)
    }

    async fn extend(&self, scope: &Scope, token: ClaimToken, lease: Duration) -> Result<Fenced> {
        let deadline = deadline(lease).to_be_bytes();
        let lease = millis(lease).to_string();
        let key = self.redis_key(scope);
        let extended = self
            .eval_fenced(&EXTEND, &key, token, &[lease.as_bytes(), &deadline], false)
            .await?;
        Ok(extended.reply)
    }

    async fn watch(&self, scope: &Scope) -> Result<Option<Watch>> {
        let Some(subscriber) = self.subscriber.as_ref().filter(|_| self.announce) else {
            return Ok(None);
        };
        let channel = self.announcement_channel(scope);
        // On the board before subscribing: what is published once Redis confirmed the
        // subscription is relayed to this watch.
        let watch = subscriber.announcements().watch(&channel);
        match subscriber.subscribe(&channel).await {
            Ok(subscription) => Ok(Some(watch.keeping(subscription))),
            Err(error) => {
                tracing::warn!(%error, "could not subscribe to Redis announcements: this waiter reads its key again instead");
                Ok(None)
            }
        }
    }
}

/// A key's value as its record and its deadline.
fn split_value(mut value: Vec<u8>) -> Result<(Bytes, u64)> {
    let with_expiry = value.first() == Some(&WITH_EXPIRY);
    let in_progress = value.len() == HELD_LEN && value.get(1) == Some(&record::IN_PROGRESS);
    if !with_expiry && !in_progress {
        return Err(unexpected(&"a value of no known form"));
    }
    let Some(at) = value.len().checked_sub(DEADLINE_LEN).filter(|&at| at > 1) else {
        return Err(unexpected(&"a value shorter than its deadline"));
    };
    let deadline = u64::from_be_bytes(value[at..].try_into().unwrap_or_default());
    value.truncate(at);
    let mut record = Bytes::from(value);
    if with_expiry {
        record.advance(1);
    }
    Ok((record, deadline))
}

/// What is left until `deadline` (Unix milliseconds).
fn remaining(deadline: u64) -> Duration {
    Duration::from_millis(deadline.saturating_sub(unix_millis()))
}

/// The completed record a verified message carries (its value as stored), with its time
/// left; `None` for anything else, or a record already expired.
fn announced_record(value: &[u8]) -> Option<Claim> {
    let (record, deadline) = split_value(value.to_vec()).ok()?;
    let expires_in = remaining(deadline);
    if expires_in.is_zero() {
        return None;
    }
    match Record::decode(record).ok()? {
        Record::Completed {
            fingerprint,
            response,
        } => Some(Claim::Completed {
            fingerprint,
            response,
            expires_in: Some(expires_in),
        }),
        Record::InProgress { .. } => None,
    }
}

fn unexpected(reply: &impl fmt::Debug) -> Error {
    RedisStoreError::UnexpectedReply(format!("{reply:?}")).into()
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStore")
            .field("prefix", &self.prefix)
            .field("timeout", &self.timeout)
            .field("max_value_len", &self.max_value_len.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

/// Whether `error`, the answer to `CONFIG GET proto-max-bulk-len`, is the server's
/// refusal to say (no right to `CONFIG`, a managed service or a proxy that hides it, with
/// an error code the client library names or not): not what asking again could change (a
/// dropped connection, a timeout, the store's own failure, or a server busy, loading or
/// failing over).
fn declines_to_say(error: &redis::RedisError) -> bool {
    const TRANSIENT: [&str; 7] = [
        "BUSY",
        "LOADING",
        "TRYAGAIN",
        "MASTERDOWN",
        "CLUSTERDOWN",
        "READONLY",
        "NOREPLICAS",
    ];
    let transient = error.code().is_some_and(|code| TRANSIENT.contains(&code));
    match error.kind() {
        ErrorKind::Server(_) | ErrorKind::Extension => {
            !transient && matches!(error.retry_method(), redis::RetryMethod::NoRetry)
        }
        _ => false,
    }
}

/// Logs that the server would not say its `proto-max-bulk-len`, as `error` shows.
#[cold]
fn declined(error: &dyn fmt::Display) {
    tracing::warn!(
        %error,
        "Redis would not say its proto-max-bulk-len: a record past it closes the connection until one is refused, or, with replicas to wait for, each time (set RedisStore::max_value_len)"
    );
}

/// Whether the server the store writes to (by its number) has answered what its value
/// limit is.
#[derive(Default)]
struct ValueLimitKnown {
    server: u64,
    answered: Arc<OnceCell<()>>,
}

/// Bytes counted in a store's [`RedisStore::pending_acknowledgements`] while held.
struct Pending {
    count: Arc<AtomicUsize>,
    bytes: usize,
}

impl Pending {
    /// `bytes` more held, unless that would pass [`ACKS_PENDING_MAX`].
    fn hold(count: &Arc<AtomicUsize>, bytes: usize) -> Option<Self> {
        count
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
                held.checked_add(bytes)
                    .filter(|&total| total <= ACKS_PENDING_MAX)
            })
            .ok()?;
        Some(Self {
            count: Arc::clone(count),
            bytes,
        })
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        self.count.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}
