//! The PostgreSQL store: a durable record of every deduplicated operation.

mod listener;
mod notification;
mod resource_id;
#[cfg(feature = "sqlx")]
mod sqlx_transactions;
mod tokio_postgres_transactions;
mod transactional;

use std::{
    fmt,
    future::Future,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::Duration,
};

use async_trait::async_trait;
use bytes::{Bytes, BytesMut};
use deadpool_postgres::{Manager, Pool, Runtime};
use http::StatusCode;
use sha2::{Digest, Sha256};
use tokio::{task::JoinHandle, time::Instant};
use tokio_postgres::{types::ToSql, NoTls, Row};

use self::listener::Listener;
use self::resource_id::Extractor;
pub use self::resource_id::{ExtractResourceId, ResourceId, MAX_RESOURCE_ID_LEN};
use self::transactional::{Open, Transactions};
use super::{
    record::{headers_and_trailers_len, put_headers_and_trailers, take_headers_and_trailers},
    Claim, Ending, Error, Fenced, Result, Store, Watch,
};
use crate::{ClaimToken, Fingerprint, Scope, StoredResponse};

/// How long a request waits for a pooled connection (or a new one) before the layer
/// answers `503` (fail closed).
const POOL_TIMEOUT: Duration = Duration::from_secs(2);
/// How long an operation waits for PostgreSQL by default ([`PostgresStore::timeout`]).
const RESPONSE_TIMEOUT: Duration = Duration::from_secs(2);
/// How long one batch of [`PostgresStore::purge_expired`] waits for PostgreSQL.
const PURGE_BATCH_TIMEOUT: Duration = Duration::from_secs(60);
/// How long data sent on a connection opened by [`PostgresStore::connect`] may stay
/// unacknowledged before the system closes it (Linux; unless the URL sets
/// `tcp_user_timeout`): a connection whose peer vanished without a reset is closed, even one
/// the store has already given up on.
const TCP_USER_TIMEOUT: Duration = Duration::from_secs(30);
const POOL_SIZE: usize = 16;
/// A claim can lose a race with a row committed after its snapshot; it then reads again.
const CLAIM_ATTEMPTS: usize = 5;
/// How long [`PostgresStore::migrate`] waits for a lock it needs before it gives up.
const MIGRATION_LOCK_TIMEOUT: Duration = Duration::from_secs(5);
/// How many rows one statement of [`PostgresStore::purge_expired`] deletes at most.
const PURGE_BATCH: i64 = 1000;

/// A store in PostgreSQL, after the classic `idempotency_keys` table: one row per
/// `(idempotency_key, endpoint, principal)`, responses as `BYTEA` (byte-exact), the claim
/// token and `locked_until` for the in-progress lease, `created_at`, `completed_at` and
/// `expires_at`. All times come from the database's clock, so application servers with
/// skewed clocks agree.
///
/// - **claim** is one statement: `INSERT … ON CONFLICT DO UPDATE … WHERE <expired>`
///   takes a free, expired, or abandoned (lease run out) row, and the same statement returns
///   the live row otherwise. It tries the insert only when it saw no live row: a replay or
///   a duplicate only reads, taking no lock and writing nothing.
/// - **complete**, **release**, **extend** are one statement each, fenced by the claim token
///   and the lease.
/// - Each operation waits at most [`timeout`](Self::timeout) (2 s) for the database; a
///   connection that did not answer in time is closed, never pooled again.
/// - Expired rows are never replayed. [`purge_expired`](Self::purge_expired) deletes them
///   (or, with [`keep_completed`](Self::keep_completed), only abandoned claims, keeping
///   completed rows as an audit trail); [`spawn_purge`](Self::spawn_purge) runs it
///   periodically. A key reused after its TTL overwrites its expired row.
/// - With [`announce_outcomes`](Self::announce_outcomes), duplicates that wait for their
///   original ([`wait_for_original`](crate::IdempotencyLayer::wait_for_original)) are woken
///   through `LISTEN`/`NOTIFY`, whichever instance holds the original: **complete** and
///   **release** notify the table's channel ([`notification_channel`](Self::notification_channel)) in
///   the same statement, and a store opened with [`connect`](Self::connect) listens on one
///   connection of its own (not from the pool), opened when a request first waits and
///   opened again with backoff if it fails while requests wait. The waiters on the
///   original's instance are handed the record it wrote; on every other instance, one
///   waiter reads the key for the others (with [`count_replays`](Self::count_replays),
///   each waiter reads: each replay is counted). A store made with
///   [`new`](Self::new) from a pool cannot open one: its waiters read the key again
///   (every 20 ms, doubling up to 200 ms), as they do while the listening connection is
///   down.
///
/// Notifying has costs to weigh on a busy table: PostgreSQL serializes the commits of
/// transactions that notify, and every listening instance receives every completion and
/// release of the table, waited for or not: 96 bytes each.
///
/// PostgreSQL checks no privilege for `LISTEN` or `NOTIFY`: any role that can connect to
/// the database can hear the channel, and notify on it, and a listener cannot tell who
/// did. So a notification carries no record: it names its key by a digest (of the
/// scope's storage key, which such a role can match only by guessing the principal, the
/// endpoint and the idempotency key whole) and the claim that ended, and it only ever
/// wakes the waiters to read their key. A notification made up or sent again costs them
/// a read; they never answer anything but what the table holds for their own key.
///
/// Run [`migrate`](Self::migrate) once (it is idempotent) or apply
/// [`migration_sql`](Self::migration_sql) with your migration tool.
///
/// # Example
///
/// ```no_run
/// use tower_idempotency::{IdempotencyLayer, PostgresStore};
///
/// # async fn run() -> Result<(), tower_idempotency::store::PostgresStoreError> {
/// let store = PostgresStore::connect("postgres://app@localhost/app").await?;
/// store.migrate().await?;
/// let _purge = store.spawn_purge(std::time::Duration::from_secs(3600));
/// let layer = IdempotencyLayer::new(store);
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct PostgresStore {
    pool: Pool,
    table: Arc<Table>,
    keep_completed: bool,
    /// Whether completions and releases notify ([`PostgresStore::announce_outcomes`]).
    announce: bool,
    /// Announces this store's completions and releases, and relays other instances'.
    listener: Arc<Listener>,
    /// Finds the id of what a completed request created ([`PostgresStore::resource_id`]).
    resource_id: Extractor,
    /// Whether replays are counted in their row ([`PostgresStore::count_replays`]).
    count_replays: bool,
    /// Rows deleted per statement by [`PostgresStore::purge_expired`].
    purge_batch: i64,
    /// The open transactions of the transactional mode, if it is on
    /// ([`PostgresStore::transactional`]).
    transactions: Option<Arc<dyn Transactions>>,
    /// How long each operation waits for PostgreSQL ([`PostgresStore::timeout`]).
    timeout: Duration,
}

/// Why a PostgreSQL operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PostgresStoreError {
    /// The database refused or failed a statement.
    #[error("postgres: {0}")]
    Postgres(#[from] tokio_postgres::Error),
    /// No connection could be had from the pool in time.
    #[error("postgres pool: {0}")]
    Pool(#[from] deadpool_postgres::PoolError),
    /// The connection URL or pool settings are invalid.
    #[error("postgres configuration: {0}")]
    Config(String),
    /// A schema or table name that is not a plain SQL identifier.
    #[error(
        "invalid SQL identifier {0:?}: use 1 to 63 of a-z, 0-9 and _, not starting with a digit, \
         and not a reserved word"
    )]
    InvalidIdentifier(String),
    /// [`PostgresStore::migrate`] had a change to make, but the table stayed locked (by a
    /// long transaction) past its lock timeout; it changed nothing.
    #[error(
        "migrating {table}: a lock was not granted within the lock timeout (a long transaction \
         holds the table?); nothing was changed, run it again later: {source}"
    )]
    MigrationBlocked {
        /// The table's qualified name.
        table: String,
        /// The database's error.
        source: tokio_postgres::Error,
    },
    /// A row holds something this version never writes.
    #[error("unexpected row: {0}")]
    UnexpectedRow(&'static str),
    /// PostgreSQL did not answer within the store's [`timeout`](PostgresStore::timeout)
    /// (a connection gone dead without a reset, a statement waiting on a lock). The
    /// connection is closed, never pooled again, and what it ran is cancelled.
    #[error("postgres: no answer within {0:?}")]
    Timeout(Duration),
    /// A claim took its key only once its lease had run out, having waited that long on a
    /// lock (a purge batch, `CREATE INDEX`, a `SELECT … FOR UPDATE`): another request could
    /// take the key at once, so the claim was withdrawn, and nothing may run.
    #[error("the claim took its key after its lease of {0:?} had run out (it waited on a lock); it was withdrawn")]
    LeaseSpent(Duration),
    /// sqlx failed a statement of the transactional mode's sqlx flavour.
    #[cfg(feature = "sqlx")]
    #[error("sqlx: {0}")]
    Sqlx(#[from] sqlx::Error),
}

impl From<PostgresStoreError> for Error {
    fn from(error: PostgresStoreError) -> Self {
        Error::Backend(Box::new(error))
    }
}

impl From<tokio_postgres::Error> for Error {
    fn from(error: tokio_postgres::Error) -> Self {
        PostgresStoreError::from(error).into()
    }
}

impl From<deadpool_postgres::PoolError> for Error {
    /// The pool gave no connection: the statement was never sent.
    fn from(error: deadpool_postgres::PoolError) -> Self {
        Error::Unavailable(Box::new(PostgresStoreError::from(error)))
    }
}

/// The table's qualified name and the statements on it, built once.
struct Table {
    name: String,
    /// Its DDL, and what `migrate` looks for in the catalog.
    migration: Migration,
    /// The qualified names of its `expires_at` and `resource_id` indexes.
    indexes: [String; 2],
    /// The key of the advisory lock that serializes migrations of this table.
    migration_lock: i64,
    /// Where its completions and releases are notified.
    channel: String,
    claim: String,
    /// `claim`, counting the replay when it finds the key completed
    /// ([`PostgresStore::count_replays`]).
    claim_counting: String,
    complete: String,
    release: String,
    /// `complete` and `release`, notifying the channel ([`PostgresStore::announce_outcomes`]).
    complete_announced: String,
    release_announced: String,
    /// Deletes a claim taken after its lease had run out, whatever its lease, and its
    /// notifying form.
    withdraw: String,
    withdraw_announced: String,
    extend: String,
    purge: String,
    purge_keeping_completed: String,
    transactional: Transactional,
}

/// The statements only the transactional mode runs.
struct Transactional {
    /// The live row of a key, read outside any transaction: what a replay costs.
    read: String,
    /// `read`, counting the replay ([`PostgresStore::count_replays`]).
    read_counting: String,
    /// In the execution's transaction: its locks, then its claim, or the live row.
    claim: String,
    /// In the execution's transaction: its completion, failing where it applies to no row.
    complete: String,
    /// `complete`, notifying the channel ([`PostgresStore::announce_outcomes`]).
    complete_announced: String,
    /// Notifies the channel of a rolled-back execution (`$1` the payload).
    notify: String,
}

impl PostgresStore {
    /// Connects a pool of up to 16 connections ([`max_connections`](Self::max_connections)
    /// changes it) to `url` (`postgres://user@host/db`), using
    /// the table `public.idempotency_keys`. Connections are opened on first use; so is the
    /// one that listens for other instances' completions, when a request first waits for
    /// its original.
    ///
    /// Unless `url` sets `tcp_user_timeout`, the system closes a connection once data sent
    /// on it has stayed unacknowledged for 30 s (on Linux): one whose server vanished
    /// without a reset, which the store gives up on after its [`timeout`](Self::timeout),
    /// is closed too, rather than held open until TCP gives up, after many minutes.
    pub async fn connect(url: &str) -> Result<Self, PostgresStoreError> {
        let mut config: tokio_postgres::Config = url
            .parse()
            .map_err(|e: tokio_postgres::Error| PostgresStoreError::Config(e.to_string()))?;
        if config.get_tcp_user_timeout().is_none() {
            config.tcp_user_timeout(TCP_USER_TIMEOUT);
        }
        let pool = Pool::builder(Manager::new(config.clone(), NoTls))
            .max_size(POOL_SIZE)
            .runtime(Runtime::Tokio1)
            .wait_timeout(Some(POOL_TIMEOUT))
            .create_timeout(Some(POOL_TIMEOUT))
            .recycle_timeout(Some(POOL_TIMEOUT))
            .build()
            .map_err(|e| PostgresStoreError::Config(e.to_string()))?;
        Ok(Self::with(pool, Some(config)))
    }

    /// A store on a pool the application already has.
    ///
    /// It cannot open a connection outside the pool to listen for other instances'
    /// completions: requests that wait for their original
    /// ([`wait_for_original`](crate::IdempotencyLayer::wait_for_original)) read the key
    /// again until it is completed or released, rather than being woken. Its own
    /// completions and releases still notify the instances that listen.
    pub fn new(pool: Pool) -> Self {
        Self::with(pool, None)
    }

    /// A store on `pool` that listens with `config`, if it has one.
    fn with(pool: Pool, config: Option<tokio_postgres::Config>) -> Self {
        let table = Table::new("public", "idempotency_keys");
        let listener = Listener::new(config, table.channel.clone());
        Self {
            pool,
            table: Arc::new(table),
            keep_completed: false,
            announce: false,
            listener: Arc::new(listener),
            resource_id: Extractor::default(),
            count_replays: false,
            purge_batch: PURGE_BATCH,
            transactions: None,
            timeout: RESPONSE_TIMEOUT,
        }
    }

    /// Uses `schema.table` instead of `public.idempotency_keys`. Both must be plain SQL
    /// identifiers (`[a-z_][a-z0-9_]*`, at most 63 bytes) that PostgreSQL does not reserve
    /// (not `user`, `order`, `table`...).
    ///
    /// # Example
    ///
    /// ```no_run
    /// # async fn run() -> Result<(), tower_idempotency::store::PostgresStoreError> {
    /// use tower_idempotency::PostgresStore;
    /// let store = PostgresStore::connect("postgres://localhost/app").await?.table("billing", "idempotency_keys")?;
    /// # Ok(())
    /// # }
    /// ```
    pub fn table(mut self, schema: &str, table: &str) -> Result<Self, PostgresStoreError> {
        validate_identifier(schema)?;
        validate_identifier(table)?;
        let table = Table::new(schema, table);
        let config = self.listener.config().cloned();
        self.listener = Arc::new(Listener::new(config, table.channel.clone()));
        self.table = Arc::new(table);
        Ok(self)
    }

    /// Keep completed rows past their expiry, for reconciliation: they are never replayed
    /// once expired, and [`purge_expired`](Self::purge_expired) deletes only abandoned
    /// claims.
    ///
    /// # Example
    ///
    /// ```no_run
    /// # async fn run() -> Result<(), tower_idempotency::store::PostgresStoreError> {
    /// use tower_idempotency::PostgresStore;
    /// let store = PostgresStore::connect("postgres://localhost/app").await?.keep_completed();
    /// # Ok(())
    /// # }
    /// ```
    pub fn keep_completed(mut self) -> Self {
        self.keep_completed = true;
        self
    }

    /// Notify every completion and release on the table's channel, so that requests
    /// waiting for their original
    /// ([`IdempotencyLayer::wait_for_original`](crate::IdempotencyLayer::wait_for_original))
    /// wake the moment it is done, on whichever instance they wait. Turn it on in every
    /// instance that shares the table. PostgreSQL serializes the commits of transactions
    /// that notify, so it is off by default: a store without it hands out no watch, and its
    /// waiters read their key again every 20 ms, doubling up to 200 ms.
    ///
    /// A notification names only the key's digest and the claim that ended
    /// ([`notification_channel`](Self::notification_channel)); a listener ignores any other
    /// payload, such as one that carries a record (as an earlier build's did): while
    /// instances of both run, such completions wake nobody here, and the waiters fall back
    /// on the holder's lease or their bound. Nothing runs twice.
    ///
    /// # Example
    ///
    /// ```no_run
    /// # async fn run() -> Result<(), tower_idempotency::store::PostgresStoreError> {
    /// use tower_idempotency::PostgresStore;
    /// let store = PostgresStore::connect("postgres://localhost/app").await?.announce_outcomes();
    /// # Ok(())
    /// # }
    /// ```
    pub fn announce_outcomes(mut self) -> Self {
        self.announce = true;
        self
    }

    /// How the `resource_id` column is filled when a request completes: with the id of what
    /// it created, found in its response by `extractor`, so that reconciliation can join
    /// each idempotency record to the business row it stands for. By default
    /// [`ResourceId::location`], the last path segment of `Location` (`pay_123` from
    /// `Location: /v1/payments/pay_123`); [`ResourceId::header`],
    /// [`ResourceId::json_pointer`], [`ResourceId::none`] or a closure
    /// `Fn(&StoredResponse) -> Option<String>` instead. An id longer than
    /// [`MAX_RESOURCE_ID_LEN`] bytes, empty, or with a control character leaves the column
    /// `NULL`. Other stores record no such id.
    ///
    /// # Example
    ///
    /// ```no_run
    /// # async fn run() -> Result<(), tower_idempotency::store::PostgresStoreError> {
    /// use tower_idempotency::{store::ResourceId, PostgresStore};
    /// // `{"id": "pay_123", ...}` → `pay_123`.
    /// let store = PostgresStore::connect("postgres://localhost/app")
    ///     .await?
    ///     .resource_id(ResourceId::json_pointer("/id"));
    /// # Ok(())
    /// # }
    /// ```
    pub fn resource_id(mut self, extractor: impl ExtractResourceId) -> Self {
        self.resource_id = Extractor::new(extractor);
        self
    }

    /// Count, in its row, every request that found the operation already completed:
    /// `replay_count` goes up by one and `last_replayed_at` becomes the database's `now()`,
    /// in the statement that reads the record (the claim), so it costs no round trip. What
    /// is counted is each retry that was deduplicated against the row: the replays, and the
    /// rare retry refused because it reused the key for a different request (`409`, or `422`
    /// with IETF problem details). Duplicates refused while the original ran are not (their
    /// next retry is).
    ///
    /// Every replay must reach the database to be counted, so a counting store reports no
    /// expiry with the records it returns: a [`CachedStore`](super::CachedStore) in front
    /// keeps no copy of them and passes every replay through, and duplicates that wait for
    /// their original ([`wait_for_original`](crate::IdempotencyLayer::wait_for_original))
    /// each read the record, rather than one read for all woken by one announcement.
    /// Off by default: each replay then writes its row (a new row version, and WAL).
    ///
    /// # Example
    ///
    /// ```no_run
    /// # async fn run() -> Result<(), tower_idempotency::store::PostgresStoreError> {
    /// use tower_idempotency::PostgresStore;
    /// let store = PostgresStore::connect("postgres://localhost/app").await?.count_replays();
    /// # Ok(())
    /// # }
    /// ```
    pub fn count_replays(mut self) -> Self {
        self.count_replays = true;
        self
    }

    /// How many rows each statement of [`purge_expired`](Self::purge_expired) deletes at
    /// most (default 1000, at least 1): each batch is a transaction of its own, which locks
    /// only its rows, and only until it commits.
    ///
    /// # Example
    ///
    /// ```no_run
    /// # async fn run() -> Result<(), tower_idempotency::store::PostgresStoreError> {
    /// use tower_idempotency::PostgresStore;
    /// let store = PostgresStore::connect("postgres://localhost/app").await?.purge_batch(5000);
    /// # Ok(())
    /// # }
    /// ```
    pub fn purge_batch(mut self, rows: u32) -> Self {
        self.purge_batch = i64::from(rows.max(1));
        self
    }

    /// The longest each operation waits for PostgreSQL: a claim, a completion, a release,
    /// a renewal of the lease, a waiter's read, counted from when the store is asked (time
    /// waiting for a pooled connection counts too). Past it the operation fails, and the
    /// layer answers `503` (fail closed). One that had sent no statement (no connection in
    /// time) changed nothing ([`Error::Unavailable`](super::Error::Unavailable)); one whose
    /// statement was sent may or may not have been applied
    /// ([`Error::Backend`](super::Error::Backend)): the layer releases a claim whose fate it
    /// does not know, and writes a completion again.
    ///
    /// The connection is then never pooled again: one that stopped answering without a
    /// reset (a failover, a NAT or firewall that dropped its state) would hang every
    /// operation handed to it, and a renewal of the lease stuck on it would let the lease
    /// lapse while the handler runs. It is closed, and its statement is cancelled (a cancel
    /// request, on a connection of its own), so that one held up by a lock does not apply
    /// long after. So does a statement whose operation is dropped before its answer.
    ///
    /// Keep it well under the layer's lease, which a renewal must reach the database
    /// within. In the [`transactional`](Self::transactional) mode it bounds the reads and
    /// notifications made outside the executions' transactions; those have bounds of their
    /// own (2 s to begin one, the database's `statement_timeout`). Each batch of
    /// [`purge_expired`](Self::purge_expired) waits up to 60 s. Default: 2 seconds.
    ///
    /// # Panics
    ///
    /// If `timeout` is zero: no statement could be answered.
    ///
    /// # Example
    ///
    /// ```no_run
    /// # async fn run() -> Result<(), tower_idempotency::store::PostgresStoreError> {
    /// use std::time::Duration;
    /// use tower_idempotency::PostgresStore;
    /// let store = PostgresStore::connect("postgres://localhost/app")
    ///     .await?
    ///     .timeout(Duration::from_millis(500));
    /// # Ok(())
    /// # }
    /// ```
    pub fn timeout(mut self, timeout: Duration) -> Self {
        assert!(
            !timeout.is_zero(),
            "PostgresStore::timeout must be more than zero: no statement could be answered"
        );
        self.timeout = timeout;
        self
    }

    /// Lets the store's pool hold up to `connections` (at least one, at most
    /// PostgreSQL's own limit of 262 143) instead of 16.
    ///
    /// Size it for the store calls that run at once: in the
    /// [`transactional`](Self::transactional) mode each execution holds a connection for
    /// its handler's whole run, so the pool bounds the executions that run at once, and the
    /// connections the handler's own writes used before move here. On a store made
    /// [`new`](Self::new), this resizes the application's pool.
    ///
    /// # Example
    ///
    /// ```no_run
    /// # async fn run() -> Result<(), tower_idempotency::store::PostgresStoreError> {
    /// use tower_idempotency::PostgresStore;
    /// let store = PostgresStore::connect("postgres://localhost/app")
    ///     .await?
    ///     .max_connections(32)
    ///     .transactional();
    /// # Ok(())
    /// # }
    /// ```
    pub fn max_connections(self, connections: usize) -> Self {
        // The pool reserves room for every connection up front: a huge number would
        // allocate for connections no server takes.
        const MOST: usize = 262_143;
        self.pool.resize(connections.clamp(1, MOST));
        self
    }

    /// Runs every execution in a transaction of its own, on a connection of this store's
    /// pool, and hands it to the handler ([`PostgresTransaction`](crate::transaction::PostgresTransaction)):
    /// the claim, the handler's writes and the completed record commit together, or not at
    /// all.
    ///
    /// - A crash or a lost connection at any point rolls back the handler's writes with the
    ///   claim: the retry executes once, cleanly, without waiting for a lease.
    /// - A released outcome (5xx, an inner error, a panic, the release policy's statuses)
    ///   rolls back the handler's writes; a recorded one commits them with its record. A
    ///   response whose commit fails is not sent: the client gets `503` and its retry
    ///   executes again.
    /// - A replay costs one round trip: `BEGIN` and the claim are pipelined, and the claim
    ///   reads a committed row in the key's way (the transaction is then rolled back
    ///   without waiting). A first execution's completion and `COMMIT` are pipelined too.
    ///   A duplicate of a running execution finds its transaction's advisory lock taken
    ///   (tried without waiting) and gets `409` at once: its row is invisible until it
    ///   commits, so the duplicate's own fingerprint stands in for the original's, and a
    ///   key reused with another body is told so only once the original has ended.
    /// - A transaction holds a pooled connection for the handler's whole run: size the
    ///   pool for the executions that run at once, plus the replays. A first execution
    ///   that finds no connection within 2 s gets `503` with `Retry-After`.
    /// - The database's own limits end a handler that runs past them: with
    ///   `statement_timeout` its statement fails, with `idle_in_transaction_session_timeout`
    ///   its connection is closed. Either way nothing commits: the handler's error
    ///   response releases the key, and a success response it sends anyway cannot be
    ///   committed and becomes `503`.
    /// - The lease does not bound a transactional execution: the transaction holds the key
    ///   for as long as it stays open, and is never taken over while its connection lives.
    ///
    /// Other settings are kept: the table, `keep_completed`, `resource_id`,
    /// `count_replays`, `announce_outcomes`, `purge_expired`.
    ///
    /// # Example
    ///
    /// ```no_run
    /// # async fn run() -> Result<(), tower_idempotency::store::PostgresStoreError> {
    /// use tower_idempotency::{IdempotencyLayer, PostgresStore};
    /// let store = PostgresStore::connect("postgres://localhost/app").await?.transactional();
    /// let layer = IdempotencyLayer::new(store);
    /// # Ok(())
    /// # }
    /// ```
    pub fn transactional(mut self) -> Self {
        let driver = tokio_postgres_transactions::Pooled::new(self.pool.clone());
        self.transactions = Some(Arc::new(Open::new(driver)));
        self
    }

    /// [`transactional`](Self::transactional), with each execution's transaction on a
    /// connection of `pool`, an sqlx pool of the same database, handed to the handler as an
    /// [`SqlxTransaction`](crate::transaction::SqlxTransaction). The store's own connections
    /// serve the replays, the migration and the purge. sqlx sends one statement at a time,
    /// so a replay reads outside any transaction first (one round trip), and a first
    /// execution then costs `BEGIN`, the claim, the completion and `COMMIT`, each a round
    /// trip of its own. A first execution waits at most 2 s for a connection of `pool` (less
    /// if the pool's `acquire_timeout` is shorter), then gets `503`.
    ///
    /// sqlx pings each idle connection before handing it out, by default: another round trip
    /// while the transaction holds its connection. The store needs no ping: a connection the
    /// server ended while it was pooled fails its `BEGIN` having done nothing, and the store
    /// tries the next (up to every connection the pool holds, and one it opens). So a pool
    /// built with `test_before_acquire(false)` serves more executions on as many connections.
    ///
    /// # Example
    ///
    /// ```no_run
    /// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
    /// use tower_idempotency::{IdempotencyLayer, PostgresStore};
    /// let url = "postgres://localhost/app";
    /// let pool = sqlx::postgres::PgPoolOptions::new()
    ///     .test_before_acquire(false)
    ///     .connect(url)
    ///     .await?;
    /// let store = PostgresStore::connect(url).await?.transactional_sqlx(pool);
    /// let layer = IdempotencyLayer::new(store);
    /// # Ok(())
    /// # }
    /// ```
    #[cfg(feature = "sqlx")]
    #[cfg_attr(docsrs, doc(cfg(feature = "sqlx")))]
    pub fn transactional_sqlx(mut self, pool: sqlx::PgPool) -> Self {
        let driver = sqlx_transactions::Sqlx::new(pool);
        self.transactions = Some(Arc::new(Open::new(driver)));
        self
    }

    /// How many executions' transactions are open now (0 unless
    /// [`transactional`](Self::transactional)).
    pub fn open_transactions(&self) -> usize {
        self.transactions.as_ref().map_or(0, |open| open.open())
    }

    /// The SQL that creates the table and its indexes, for this store's table name.
    pub fn migration_sql(&self) -> String {
        self.table.migration.sql()
    }

    /// Creates the table and its indexes if they do not exist. Idempotent; it runs in one
    /// transaction.
    ///
    /// It looks in the catalog first and changes only what is missing: on a table that is
    /// up to date it takes no lock on the table at all, so instances can run it at every
    /// start while the table is in service. Migrations of one table run one at a time
    /// (a transaction-scoped advisory lock keyed by the table's qualified name), so
    /// instances starting together on a fresh database do not race to create it. A change
    /// that is needed waits at most 5 s for its lock (`SET LOCAL lock_timeout`; `CREATE
    /// INDEX` on a table in service waits for every open transaction that wrote it, and
    /// every request's claim would queue behind it in turn):
    /// past that, `migrate` changes nothing and fails with
    /// [`PostgresStoreError::MigrationBlocked`]. Run it again when the long transaction is
    /// gone.
    pub async fn migrate(&self) -> Result<(), PostgresStoreError> {
        let mut client = self.pool.get().await?;
        let transaction = client.transaction().await?;
        let blocked = |error: tokio_postgres::Error| {
            if error.code() == Some(&tokio_postgres::error::SqlState::LOCK_NOT_AVAILABLE) {
                PostgresStoreError::MigrationBlocked {
                    table: self.table.name.clone(),
                    source: error,
                }
            } else {
                error.into()
            }
        };
        let timeout = MIGRATION_LOCK_TIMEOUT.as_millis();
        transaction
            .batch_execute(&format!("SET LOCAL lock_timeout = {timeout}"))
            .await?;
        transaction
            .execute(
                "SELECT pg_advisory_xact_lock($1)",
                &[&self.table.migration_lock],
            )
            .await
            .map_err(blocked)?;
        let [expires_at, resource_id] = &self.table.indexes;
        let found = transaction
            .query_one(
                "SELECT to_regclass($1) IS NOT NULL, to_regclass($2) IS NOT NULL,
    to_regclass($3) IS NOT NULL",
                &[&self.table.name, expires_at, resource_id],
            )
            .await?;
        let (table, expires_at, resource_id): (bool, bool, bool) =
            (found.get(0), found.get(1), found.get(2));
        let migration = &self.table.migration;
        let mut sql = String::new();
        if !table {
            sql.push_str(&migration.create_table);
        }
        if !expires_at {
            sql.push_str(&migration.expires_at_index);
        }
        if !resource_id {
            sql.push_str(&migration.resource_id_index);
        }
        if !sql.is_empty() {
            tracing::info!(table = %self.table.name, "migrating the idempotency table");
            transaction.batch_execute(&sql).await.map_err(blocked)?;
        }
        transaction.commit().await?;
        Ok(())
    }

    /// Deletes expired rows (only abandoned claims with
    /// [`keep_completed`](Self::keep_completed)) and returns how many.
    ///
    /// It deletes them in batches of [`purge_batch`](Self::purge_batch) rows, each one
    /// statement and transaction of its own, until a batch finds fewer: no long lock, no
    /// transaction the size of the backlog. A batch skips rows another transaction has
    /// locked (a claim taking an expired key), so a purge never waits for a claim, and a
    /// claim waits at most for one batch. The `expires_at` index finds the rows.
    pub async fn purge_expired(&self) -> Result<u64, PostgresStoreError> {
        let sql = if self.keep_completed {
            &self.table.purge_keeping_completed
        } else {
            &self.table.purge
        };
        let mut purged = 0;
        loop {
            // A connection per batch: the pool serves requests between batches.
            let bound = PURGE_BATCH_TIMEOUT.max(self.timeout);
            let connection = Connection::get(&self.pool, bound).await?;
            let client = connection.client();
            let statement = connection.answer(false, client.prepare_cached(sql)).await?;
            let deleted = connection
                .answer(true, client.execute(&statement, &[&self.purge_batch]))
                .await?;
            purged += deleted;
            if deleted < self.purge_batch as u64 {
                return Ok(purged);
            }
        }
    }

    /// Runs [`purge_expired`](Self::purge_expired) every `interval` until the handle is
    /// aborted; failures are logged and retried at the next tick.
    ///
    /// # Panics
    ///
    /// If `interval` is zero, here rather than in the task, where the panic would end the
    /// purging unseen.
    pub fn spawn_purge(&self, interval: Duration) -> JoinHandle<()> {
        assert!(
            !interval.is_zero(),
            "PostgresStore::spawn_purge: the interval must be more than zero"
        );
        let store = self.clone();
        tokio::spawn(async move {
            let mut ticks = tokio::time::interval(interval);
            loop {
                ticks.tick().await;
                match store.purge_expired().await {
                    Ok(purged) => tracing::debug!(purged, "purged expired idempotency rows"),
                    Err(error) => {
                        tracing::warn!(%error, "could not purge expired idempotency rows")
                    }
                }
            }
        })
    }

    /// The table's qualified name.
    pub fn table_name(&self) -> &str {
        &self.table.name
    }

    /// The channel on which completions and releases of this table's keys are notified
    /// (`idempotency_` and a digest of the table's qualified name, the same in every
    /// instance), each with the hex SHA-256 of the scope's
    /// [`storage_key`](Scope::storage_key) as its payload, followed by the hex of the
    /// token of the claim that ended: nothing else, since any role that can connect may
    /// notify the channel too.
    pub fn notification_channel(&self) -> &str {
        self.listener.channel()
    }

    /// How many keys this store's requests wait on now (each key once, however many wait
    /// on it).
    pub fn watched(&self) -> usize {
        self.listener.watched()
    }

    /// How this store's notifications name `scope`, if it announces: a store that does not
    /// notifies nothing and hands out no watch, so its writes have nobody to tell.
    fn announced_key(&self, scope: &Scope) -> Option<String> {
        self.announce.then(|| notification::key_of(scope))
    }

    /// The statements a request runs, as this store's settings choose them: its claim, then
    /// the completion, the release and the lease's extension.
    fn writes(&self) -> [&str; 4] {
        let table = &*self.table;
        let (claim, complete, release) = match (self.count_replays, self.announce) {
            (false, false) => (&table.claim, &table.complete, &table.release),
            (false, true) => (
                &table.claim,
                &table.complete_announced,
                &table.release_announced,
            ),
            (true, false) => (&table.claim_counting, &table.complete, &table.release),
            (true, true) => (
                &table.claim_counting,
                &table.complete_announced,
                &table.release_announced,
            ),
        };
        [claim, complete, release, &table.extend]
    }

    /// `sql` prepared on `client`. A connection that has not prepared a request's statements
    /// yet prepares them all at once, pipelined: a burst of claims opens connections that
    /// know only the claim, and the completion that lands on one of them would otherwise
    /// wait for a preparation of its own (about a millisecond) before it writes.
    async fn prepared(
        &self,
        client: &deadpool_postgres::Client,
        sql: &str,
    ) -> Result<tokio_postgres::Statement, tokio_postgres::Error> {
        let writes = self.writes();
        if client.statement_cache.size() < writes.len() {
            let preparing = writes.map(|write| client.prepare_cached(write));
            futures_util::future::try_join_all(preparing).await?;
        }
        client.prepare_cached(sql).await
    }

    /// A pooled connection for one operation, bounded by the store's
    /// [`timeout`](Self::timeout), and `sql` prepared on it.
    async fn connection_for(
        &self,
        sql: &str,
    ) -> Result<(Connection, tokio_postgres::Statement), Failure> {
        let connection = Connection::get(&self.pool, self.timeout).await?;
        let statement = connection
            .answer(false, self.prepared(connection.client(), sql))
            .await?;
        Ok((connection, statement))
    }

    async fn execute(&self, sql: &str, params: &[&(dyn ToSql + Sync)]) -> Result<u64> {
        let (connection, statement) = self.connection_for(sql).await?;
        let client = connection.client();
        Ok(connection
            .answer(true, client.execute(&statement, params))
            .await?)
    }

    /// Runs a fenced write that notifies the table's channel when it applies (it returns a
    /// row then).
    async fn notifying(&self, sql: &str, params: &[&(dyn ToSql + Sync)]) -> Result<Fenced> {
        let (connection, statement) = self.connection_for(sql).await?;
        let client = connection.client();
        let rows = connection
            .answer(true, client.query(&statement, params))
            .await?;
        Ok(fenced(rows.len() as u64))
    }

    /// The live row of `scope`, read (and its replay counted, if counted) outside any
    /// transaction; `None` when the key is free.
    async fn read(&self, scope: &Scope) -> Result<Option<Claim>> {
        let statements = &self.table.transactional;
        let sql = if self.count_replays {
            &statements.read_counting
        } else {
            &statements.read
        };
        let connection = Connection::get(&self.pool, self.timeout).await?;
        let client = connection.client();
        let statement = connection.answer(false, client.prepare_cached(sql)).await?;
        let (key, endpoint, principal) = (scope.key().as_str(), scope.endpoint(), principal(scope));
        // Only a read that counts its replay writes.
        let params: [&(dyn ToSql + Sync); 3] = [&key, &endpoint, &principal];
        let query = client.query_opt(&statement, &params);
        let row = connection.answer(self.count_replays, query).await?;
        row.map(|row| decode_claim(&row, self.count_replays))
            .transpose()
    }

    /// The parameters of `token`'s completion with `response`.
    fn completion<'a>(
        &self,
        scope: &'a Scope,
        token: &'a ClaimToken,
        fingerprint: &'a Fingerprint,
        response: &'a StoredResponse,
        ttl: Duration,
    ) -> Completion<'a> {
        let mut headers = BytesMut::with_capacity(headers_and_trailers_len(response));
        put_headers_and_trailers(&mut headers, response);
        let announced = self.announced_key(scope);
        let notification = announced
            .as_deref()
            .map_or_else(String::new, |key| notification::end_of(key, *token));
        Completion {
            key: scope.key().as_str(),
            endpoint: scope.endpoint(),
            principal: principal(scope),
            token: token.as_bytes(),
            fingerprint: fingerprint.as_bytes(),
            status: response.status.as_u16() as i16,
            headers: Vec::from(headers),
            body: &response.body,
            ttl: millis(ttl),
            notification,
            resource_id: self.resource_id.extract(response),
            announced,
            claim: *token,
        }
    }

    /// Writes `token`'s completion in a statement of its own.
    async fn complete_now(
        &self,
        scope: &Scope,
        token: ClaimToken,
        fingerprint: Fingerprint,
        response: &StoredResponse,
        ttl: Duration,
    ) -> Result<Fenced> {
        let completion = self.completion(scope, &token, &fingerprint, response, ttl);
        let [_, complete, ..] = self.writes();
        let ending = completion.ending(self);
        let completed = self.notifying(complete, &completion.params()).await?;
        if let (Fenced::Applied, Some(ending)) = (completed, ending) {
            // This process's waiters take the record as written, and none reads it.
            ending.completed(|| Claim::Completed {
                fingerprint,
                response: response.clone(),
                expires_in: Some(ttl),
            });
        }
        Ok(completed)
    }

    /// Deletes `token`'s in-progress row in a statement of its own.
    async fn release_now(&self, scope: &Scope, token: ClaimToken) -> Result<Fenced> {
        let [_, _, release, _] = self.writes();
        self.end_claim(scope, token, release).await
    }

    /// The answer to `token`'s claim, which took its key with less than half its `lease`
    /// left, `remaining` milliseconds (it waited on a lock): its lease is renewed whole
    /// first, so that the execution does not start on a lease about to lapse. One with none
    /// left is withdrawn instead: anyone may have taken the key over already.
    async fn short_lease(
        &self,
        scope: &Scope,
        token: ClaimToken,
        lease: Duration,
        remaining: i64,
    ) -> Result<Claim> {
        if remaining > 0 {
            match self.extend(scope, token, lease).await {
                Ok(Fenced::Applied) => return Ok(Claim::Claimed(token)),
                Ok(Fenced::Lost) => {}
                // The claim may hold the key: the layer releases it.
                Err(Error::Unavailable(error)) => return Err(Error::Backend(error)),
                Err(error) => return Err(error),
            }
        }
        Err(self.withdraw(scope, token, lease).await)
    }

    /// The error of `token`'s claim, which took its key only once its `lease` had run out
    /// (it waited on a lock): anyone may take the key over at once, so nothing may run on
    /// it. Its row is deleted, whatever its lease: the token says it is still this claim's.
    async fn withdraw(&self, scope: &Scope, token: ClaimToken, lease: Duration) -> Error {
        tracing::warn!(
            ?lease,
            "a claim waited on a lock until its lease had run out: withdrawn, the request is refused"
        );
        let table = &*self.table;
        let sql = if self.announce {
            &table.withdraw_announced
        } else {
            &table.withdraw
        };
        let spent = Box::new(PostgresStoreError::LeaseSpent(lease));
        match self.end_claim(scope, token, sql).await {
            // The key is not this claim's any more: nothing to release.
            Ok(_) => Error::Unavailable(spent),
            Err(error) => {
                tracing::warn!(%error, "could not withdraw a claim whose lease had run out");
                Error::Backend(spent)
            }
        }
    }

    /// Deletes `token`'s in-progress row with `sql`, a release's statement, and tells the
    /// waiters.
    async fn end_claim(&self, scope: &Scope, token: ClaimToken, sql: &str) -> Result<Fenced> {
        let key = self.announced_key(scope);
        let notification = key
            .as_deref()
            .map_or_else(String::new, |key| notification::end_of(key, token));
        let params: [&(dyn ToSql + Sync); 5] = [
            &scope.key().as_str(),
            &scope.endpoint(),
            &principal(scope),
            &token.as_bytes().as_slice(),
            &notification.as_str(),
        ];
        let ending = key.as_deref().map(|key| self.listener.ending(key, token));
        let released = self.notifying(sql, &params).await?;
        if let (Fenced::Applied, Some(ending)) = (released, ending) {
            ending.released();
        }
        Ok(released)
    }

    /// Tells the waiters of `scope`, in this process and, if it announces, every other,
    /// that the transaction of `token` was rolled back: a rollback notifies nothing by
    /// itself.
    async fn announce_rollback(&self, scope: &Scope, token: ClaimToken) {
        let Some(key) = self.announced_key(scope) else {
            return;
        };
        let ending = self.listener.ending(&key, token);
        let notification = notification::end_of(&key, token);
        let notified = async {
            let connection = Connection::get(&self.pool, self.timeout).await?;
            let client = connection.client();
            let sql = &self.table.transactional.notify;
            let statement = connection.answer(false, client.prepare_cached(sql)).await?;
            connection
                .answer(true, client.execute(&statement, &[&notification]))
                .await?;
            Ok::<_, Failure>(())
        };
        if let Err(error) = notified.await {
            let error = Error::from(error);
            tracing::warn!(%error, "could not notify a rolled-back execution: other instances' waiters read their key at their next check");
        }
        ending.released();
    }
}

/// A completion's parameters, in the order of the completing statements' `$1`…`$11`.
pub(super) struct Completion<'a> {
    pub(super) key: &'a str,
    pub(super) endpoint: &'a str,
    pub(super) principal: &'a str,
    pub(super) token: &'a [u8],
    pub(super) fingerprint: &'a [u8],
    pub(super) status: i16,
    pub(super) headers: Vec<u8>,
    pub(super) body: &'a [u8],
    pub(super) ttl: i64,
    pub(super) notification: String,
    pub(super) resource_id: Option<String>,
    /// How the store's notifications name the key, if it announces.
    announced: Option<String>,
    claim: ClaimToken,
}

impl Completion<'_> {
    pub(super) fn params(&self) -> [&(dyn ToSql + Sync); 11] {
        [
            &self.key,
            &self.endpoint,
            &self.principal,
            &self.token,
            &self.fingerprint,
            &self.status,
            &self.headers,
            &self.body,
            &self.ttl,
            &self.notification,
            &self.resource_id,
        ]
    }

    /// The local announcement of this completion, to be made once it is written.
    fn ending<'s>(&'s self, store: &'s PostgresStore) -> Option<Ending<'s>> {
        let key = self.announced.as_deref()?;
        Some(store.listener.ending(key, self.claim))
    }
}

/// A pooled connection serving one operation until its deadline. A statement not answered
/// by then fails the operation; so does a wait for the connection itself.
///
/// A connection left with a statement in flight (one not answered in time, or whose
/// operation was dropped before its answer) is never pooled again: it may have gone dead
/// without a reset, and would hang whatever the pool handed it next. It is closed, and its
/// statement is cancelled, so that one held up by a lock does not apply long after.
struct Connection {
    client: Option<deadpool_postgres::Client>,
    deadline: Instant,
    /// How long the operation was given, for its error.
    bound: Duration,
    /// Whether a statement is in flight, or was when its time ran out.
    in_flight: AtomicBool,
}

impl Connection {
    /// A connection from `pool` for an operation given `bound` from now. Past it, no
    /// statement was sent.
    async fn get(pool: &Pool, bound: Duration) -> Result<Self, Failure> {
        let deadline = Instant::now() + bound;
        let client = match tokio::time::timeout_at(deadline, pool.get()).await {
            Ok(client) => client,
            Err(_) => Err(deadpool_postgres::PoolError::Timeout(
                deadpool_postgres::TimeoutType::Wait,
            )),
        };
        let client = client.map_err(|error| Failure::Unsent(error.into()))?;
        Ok(Self {
            client: Some(client),
            deadline,
            bound,
            in_flight: AtomicBool::new(false),
        })
    }

    fn client(&self) -> &deadpool_postgres::Client {
        self.client.as_ref().expect("taken only when dropped")
    }

    /// `work` on this connection, answered by the deadline. `writes` says whether it
    /// sends a statement that may change the table: one that does and is not answered in
    /// time may or may not have been applied; one that does not (a preparation) changed
    /// nothing.
    async fn answer<T>(
        &self,
        writes: bool,
        work: impl Future<Output = Result<T, tokio_postgres::Error>>,
    ) -> Result<T, Failure> {
        self.in_flight.store(true, Ordering::Relaxed);
        let Ok(answer) = tokio::time::timeout_at(self.deadline, work).await else {
            let error = PostgresStoreError::Timeout(self.bound);
            return Err(if writes {
                Failure::Failed(error)
            } else {
                Failure::Unsent(error)
            });
        };
        self.in_flight.store(false, Ordering::Relaxed);
        answer.map_err(|error| Failure::Failed(error.into()))
    }
}

/// Why an operation on a [`Connection`] failed.
#[derive(Debug)]
enum Failure {
    /// Nothing that could change a row was sent: no connection in time, or a preparation
    /// not answered in time ([`Error::Unavailable`]).
    Unsent(PostgresStoreError),
    /// The database failed a statement, or did not answer it in time: it may or may not
    /// have been applied ([`Error::Backend`]).
    Failed(PostgresStoreError),
}

impl From<Failure> for Error {
    fn from(failure: Failure) -> Self {
        match failure {
            Failure::Unsent(error) => Error::Unavailable(Box::new(error)),
            Failure::Failed(error) => Error::Backend(Box::new(error)),
        }
    }
}

impl From<Failure> for PostgresStoreError {
    fn from(failure: Failure) -> Self {
        match failure {
            Failure::Unsent(error) | Failure::Failed(error) => error,
        }
    }
}

impl Drop for Connection {
    fn drop(&mut self) {
        if !*self.in_flight.get_mut() {
            return;
        }
        let Some(client) = self.client.take() else {
            return;
        };
        let cancel = client.cancel_token();
        // Out of the pool for good; dropped, it closes once its socket answers or fails.
        drop(deadpool_postgres::Object::take(client));
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let bound = self.bound;
            runtime.spawn(async move {
                let cancelled = tokio::time::timeout(bound, cancel.cancel_query(NoTls)).await;
                if !matches!(cancelled, Ok(Ok(()))) {
                    tracing::debug!("could not cancel the statement of a connection given up on");
                }
            });
        }
    }
}

fn validate_identifier(name: &str) -> Result<(), PostgresStoreError> {
    let mut chars = name.chars();
    let valid = name.len() <= 63
        && chars
            .next()
            .is_some_and(|c| c.is_ascii_lowercase() || c == '_')
        && chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
        && !RESERVED.contains(&name);
    if valid {
        Ok(())
    } else {
        Err(PostgresStoreError::InvalidIdentifier(name.to_owned()))
    }
}

/// The key words PostgreSQL reserves, including those it allows only as function or type
/// names: as a table or schema name, unquoted, each makes every statement fail.
#[rustfmt::skip]
const RESERVED: [&str; 101] = [
    "all", "analyse", "analyze", "and", "any", "array", "as", "asc", "asymmetric",
    "authorization", "binary", "both", "case", "cast", "check", "collate", "collation",
    "column", "concurrently", "constraint", "create", "cross", "current_catalog",
    "current_date", "current_role", "current_schema", "current_time", "current_timestamp",
    "current_user", "default", "deferrable", "desc", "distinct", "do", "else", "end",
    "except", "false", "fetch", "for", "foreign", "freeze", "from", "full", "grant",
    "group", "having", "ilike", "in", "initially", "inner", "intersect", "into", "is",
    "isnull", "join", "lateral", "leading", "left", "like", "limit", "localtime",
    "localtimestamp", "natural", "not", "notnull", "null", "offset", "on", "only", "or",
    "order", "outer", "overlaps", "placing", "primary", "references", "returning", "right",
    "select", "session_user", "similar", "some", "symmetric", "system_user", "table",
    "tablesample", "then", "to", "trailing", "true", "union", "unique", "user", "using",
    "variadic", "verbose", "when", "where", "window", "with",
];

/// The longest identifier PostgreSQL keeps whole, in bytes; it cuts longer ones.
const MAX_IDENTIFIER: usize = 63;

/// What ends the names of the table's unique constraint and indexes.
const INDEX_SUFFIXES: [&str; 3] = ["_scope", "_expires_at", "_resource_id"];

/// The names of the unique constraint (`scope`) and the indexes of `schema.table`, each at
/// most 63 bytes (PostgreSQL cuts longer identifiers) and distinct:
/// `<schema>_<table>_<suffix>` where that fits; else the first 42 bytes of
/// `<schema>_<table>`, then 8 hex digits of the SHA-256 of the qualified name, then the
/// suffix.
fn index_names(schema: &str, table: &str) -> [String; 3] {
    let base = format!("{schema}_{table}");
    let longest = INDEX_SUFFIXES.iter().map(|s| s.len()).max().unwrap_or(0);
    if base.len() + longest <= MAX_IDENTIFIER {
        return INDEX_SUFFIXES.map(|suffix| format!("{base}{suffix}"));
    }
    let digest = Sha256::digest(format!("{schema}.{table}").as_bytes());
    let hash: String = digest[..4].iter().map(|b| format!("{b:02x}")).collect();
    let keep = MAX_IDENTIFIER - 1 - hash.len() - longest;
    // Identifiers are ASCII: any byte is a character boundary.
    INDEX_SUFFIXES.map(|suffix| format!("{}_{hash}{suffix}", &base[..keep]))
}

/// The statements of the migration, each run by [`PostgresStore::migrate`] only when what
/// it creates is missing.
struct Migration {
    create_table: String,
    expires_at_index: String,
    resource_id_index: String,
}

impl Migration {
    fn new(schema: &str, table: &str) -> Self {
        let [scope, expires_at, resource_id] = index_names(schema, table);
        let table = format!("{schema}.{table}");
        Self {
            create_table: format!(
                "CREATE TABLE IF NOT EXISTS {table} (
    idempotency_key  TEXT        NOT NULL,
    endpoint         TEXT        NOT NULL,
    principal        TEXT        NOT NULL,  -- '' is anonymous
    request_hash     BYTEA       NOT NULL,  -- SHA-256 request fingerprint
    status           TEXT        NOT NULL CHECK (status IN ('in_progress', 'completed')),
    status_code      SMALLINT,
    response_headers BYTEA,                 -- headers, then trailers: binary, order kept
    response_body    BYTEA,
    claim_token      BYTEA       NOT NULL,
    locked_until     TIMESTAMPTZ,           -- the in-progress lease
    created_at       TIMESTAMPTZ NOT NULL DEFAULT now(),
    completed_at     TIMESTAMPTZ,
    expires_at       TIMESTAMPTZ NOT NULL,
    resource_id      TEXT,                  -- what the request created (e.g. a payment id)
    replay_count     BIGINT      NOT NULL DEFAULT 0,  -- retries deduplicated (when counted)
    last_replayed_at TIMESTAMPTZ,
    CONSTRAINT {scope} UNIQUE (idempotency_key, endpoint, principal)
);
"
            ),
            expires_at_index: format!(
                "CREATE INDEX IF NOT EXISTS {expires_at} ON {table} (expires_at);
"
            ),
            resource_id_index: format!(
                "CREATE INDEX IF NOT EXISTS {resource_id} ON {table} (resource_id)
    WHERE resource_id IS NOT NULL;
"
            ),
        }
    }

    /// All of it, for a migration tool.
    fn sql(&self) -> String {
        [
            &self.create_table,
            &self.expires_at_index,
            &self.resource_id_index,
        ]
        .into_iter()
        .map(String::as_str)
        .collect()
    }
}

impl Table {
    fn new(schema: &str, table: &str) -> Self {
        let name = format!("{schema}.{table}");
        let channel = notification::channel(&name);
        let migration = Migration::new(schema, table);
        let [_, expires_at, resource_id] = index_names(schema, table);
        let indexes = [
            format!("{schema}.{expires_at}"),
            format!("{schema}.{resource_id}"),
        ];
        let digest = Sha256::digest(format!("tower-idempotency migrate {name}").as_bytes());
        let migration_lock = i64::from_be_bytes(digest[..8].try_into().expect("8 bytes"));
        // Ends a write that returns one row when it applies: that row notifies the channel
        // with the payload in `$n`, committed with the write.
        let notify =
            |n: u8| format!("\n    RETURNING 1\n)\nSELECT pg_notify('{channel}', ${n}) FROM done");
        // The same write, returning its row without notifying (the payload still named, so
        // that both take the same parameters).
        let quiet = |n: u8| format!("\n    RETURNING 1\n)\nSELECT ${n}::text FROM done");
        // The same write, failing when it matches no row; notifying `channel` if there is one
        // (the payload in `$10`).
        let guarded = |channel: Option<&str>| {
            let select = match channel {
                Some(channel) => format!("pg_notify('{channel}', $10)"),
                None => "$10::text".to_owned(),
            };
            format!(
                "\n    RETURNING 1\n),\nguard AS MATERIALIZED (\n    SELECT 1 / (SELECT count(*)::int FROM done) AS one\n)\nSELECT {select} FROM guard LEFT JOIN done ON true"
            )
        };
        let scope = "idempotency_key = $1 AND endpoint = $2 AND principal = $3";
        let held = format!(
            "{scope} AND status = 'in_progress' AND claim_token = $4 AND locked_until > now()"
        );
        // $5 fingerprint, $6 status, $7 headers, $8 body, $9 ttl ms, $10 payload, $11
        // resource id. A row this token already completed with the same record counts as
        // held while it lives, so a completion whose reply was lost can be retried; once
        // expired (purged or not) it is gone. Such a row keeps its completion's time, TTL
        // and replay count, and one with another record is not held: what waiters and
        // replays have read of it stays true. Completed, and kept for its TTL, from the
        // clock's time, not `now()`: in the transactional mode the statement runs in the
        // execution's transaction, whose `now()` is when it began, at the claim.
        let set_once = [
            ("completed_at", "clock_timestamp()"),
            (
                "expires_at",
                "clock_timestamp() + $9::bigint * interval '1 millisecond'",
            ),
            ("resource_id", "$11"),
            ("replay_count", "0"),
            ("last_replayed_at", "NULL"),
        ]
        .map(|(column, value)| {
            format!("{column} = CASE WHEN status = 'completed' THEN {column} ELSE {value} END")
        })
        .join(",\n    ");
        let completing = format!(
            "WITH done AS (
UPDATE {name} SET status = 'completed', locked_until = NULL, request_hash = $5,
    status_code = $6, response_headers = $7, response_body = $8,
    {set_once}
WHERE {scope} AND claim_token = $4
    AND ((status = 'completed' AND expires_at > now() AND request_hash = $5
            AND status_code = $6 AND response_headers = $7 AND response_body = $8)
        OR locked_until > now())"
        );
        // $5 payload.
        let releasing = format!("WITH done AS (\nDELETE FROM {name} WHERE {held}");
        let withdrawing = format!(
            "WITH done AS (\nDELETE FROM {name} WHERE {scope} AND status = 'in_progress' AND claim_token = $4"
        );
        // A row that holds its key now: in progress within its lease, or completed and not
        // expired.
        let alive = "expires_at > now() AND (status = 'completed' OR locked_until > now())";
        // $4 fingerprint, $5 token, $6 lease ms. Takes the key when it is free, expired or
        // abandoned; the row it finds in the way otherwise is read by what follows, which
        // runs only when nothing was claimed. A row seen alive is not even tried: `ON
        // CONFLICT DO UPDATE` locks the row it meets even when its `WHERE` leaves it be, and
        // that lock would make every replay and duplicate a write, flushed at commit. (A
        // row committed after the statement's snapshot is met, and locked, as before.)
        // The insert that takes the key, where `when` (more tables, then a `WHERE` clause)
        // lets it.
        //
        // Two clocks. `now()` is when the statement (in the transactional mode, its
        // transaction) began; `clock_timestamp()` is the time as the row is written. A
        // statement can wait between the two, on a row lock (a purge batch deleting the
        // key's expired row, `CREATE INDEX`, a `SELECT … FOR UPDATE`) for longer than a
        // lease: so the lease, as every time that runs from the write, is counted from the
        // clock, and what the lease has left is read from the clock once the row is written
        // (returned in place of the found row's remaining time). A row is taken as expired
        // only by `now()`, which is never later than the clock: nothing is taken over
        // before it has really expired. The update of a row met in the way runs once its
        // lock is granted: its lease starts then. An insert's values are computed before
        // it waits (on a row being deleted): one that waited past its lease returns none
        // left, and is withdrawn.
        let lease_from_clock =
            "(SELECT clock_timestamp() + $6::bigint * interval '1 millisecond' AS until) lease";
        let insert_claim = |when: &str| {
            format!(
                "INSERT INTO {name} AS r (idempotency_key, endpoint, principal, request_hash, status,
        claim_token, locked_until, created_at, expires_at)
    SELECT $1, $2, $3, $4::bytea, 'in_progress', $5::bytea, lease.until, now(), lease.until
    FROM {lease_from_clock}{when}
    ON CONFLICT (idempotency_key, endpoint, principal) DO UPDATE SET
        request_hash = EXCLUDED.request_hash, status = 'in_progress', status_code = NULL,
        response_headers = NULL, response_body = NULL, claim_token = EXCLUDED.claim_token,
        (locked_until, expires_at) = (SELECT lease.until, lease.until FROM {lease_from_clock}),
        created_at = EXCLUDED.created_at, completed_at = NULL, resource_id = NULL,
        replay_count = 0, last_replayed_at = NULL
    WHERE r.expires_at <= now() OR (r.status = 'in_progress' AND r.locked_until <= now())
    RETURNING (extract(epoch FROM r.locked_until - clock_timestamp()) * 1000)::bigint AS lease_left"
            )
        };
        let claiming = format!(
            "WITH seen AS (
    SELECT 1 FROM {name} WHERE {scope} AND {alive}
),
claimed AS (
    {}
)",
            insert_claim("\n    WHERE NOT EXISTS (SELECT 1 FROM seen)")
        );
        // The key taken, with the time its lease has left, in milliseconds.
        let claimed =
            "SELECT true, NULL::bytea, NULL::text, NULL::smallint, NULL::bytea, NULL::bytea,
    claimed.lease_left, NULL::bigint
FROM claimed";
        // The columns of the live row found: the time its lease (in progress) or its record
        // (completed) has left, and how long ago it was claimed, in milliseconds, by the
        // clock (the statement may have waited since it began).
        let found = "false, request_hash, status, status_code, response_headers, response_body,
    (extract(epoch FROM CASE WHEN status = 'in_progress' THEN locked_until ELSE expires_at END
        - clock_timestamp()) * 1000)::bigint,
    (extract(epoch FROM clock_timestamp() - created_at) * 1000)::bigint";
        let live = format!("{scope} AND {alive}\n    AND NOT EXISTS (SELECT 1 FROM claimed)");
        // The transactional mode's statements. Its claims are never committed in progress
        // (a transaction commits its row completed, or rolls it back), so its duplicates
        // cannot see a running original's row: its transaction's advisory lock on the
        // key (`$7`) is what they find taken.
        let replayed = |live: &str| {
            format!(
                "UPDATE {name} SET replay_count = replay_count + 1, last_replayed_at = now()
    WHERE {live} AND status = 'completed'
    RETURNING {found}"
            )
        };
        let read_live = format!("{scope} AND {alive}");
        let transactional = Transactional {
            read: format!("SELECT {found} FROM {name} WHERE {read_live}"),
            read_counting: format!(
                "WITH replayed AS (
    {}
)
SELECT * FROM replayed
UNION ALL
SELECT {found} FROM {name} WHERE {read_live} AND status = 'in_progress'",
                replayed(&read_live)
            ),
            // The execution's two locks, tried without waiting: one on its request (the
            // key and the fingerprint, `$8`), then one on its key (`$7`), taken only with the
            // first. A duplicate that finds the first taken runs the same request as a
            // running execution; one that finds only the second taken runs another.
            // Then whether the key was claimed, and the live row committed in the way if
            // there is one (read as `claim` reads it, from column 4 on), which the claim
            // leaves as it is: a replay read in the same round trip as the claim. A lock held
            // elsewhere comes with how long its holder's transaction has run, in
            // milliseconds, where this role may see it (its own sessions, or with
            // `pg_read_all_stats`).
            claim: format!(
                "WITH request AS MATERIALIZED (
    SELECT pg_try_advisory_xact_lock($8::bigint) AS taken
),
lock AS MATERIALIZED (
    SELECT request.taken,
        CASE WHEN request.taken THEN pg_try_advisory_xact_lock($7::bigint) ELSE false END AS taken_key,
        CASE WHEN request.taken THEN $7::bigint ELSE $8::bigint END AS held
    FROM request
),
seen AS MATERIALIZED (
    SELECT {found} FROM {name} WHERE {read_live}
),
claimed AS (
    {}
)
SELECT lock.taken, lock.taken_key, EXISTS (SELECT 1 FROM claimed),
    CASE WHEN NOT lock.taken_key THEN (
        SELECT (extract(epoch FROM now() - a.xact_start) * 1000)::bigint
        FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
        WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
            AND l.classid = ((lock.held >> 32) & 4294967295)::oid
            AND l.objid = (lock.held & 4294967295)::oid
        LIMIT 1
    ) END,
    seen.*
FROM lock LEFT JOIN seen ON true",
                insert_claim(", lock\n    WHERE lock.taken_key AND NOT EXISTS (SELECT 1 FROM seen)")
            ),
            // The completions of a transaction: an error where the completion finds no
            // row, so that a `COMMIT` sent right behind it, unawaited, rolls back instead.
            complete: format!("{completing}{}", guarded(None)),
            complete_announced: format!("{completing}{}", guarded(Some(&channel))),
            notify: format!("SELECT pg_notify('{channel}', $1)"),
        };
        Self {
            transactional,
            claim: format!(
                "{claiming}
{claimed}
UNION ALL
SELECT {found}
FROM {name}
WHERE {live}"
            ),
            // The completed row is read by the update that counts the replay; a row in
            // progress by a plain read. (Both see the statement's snapshot: one row at most.)
            claim_counting: format!(
                "{claiming},
replayed AS (
    {}
)
{claimed}
UNION ALL
SELECT * FROM replayed
UNION ALL
SELECT {found}
FROM {name}
WHERE {live} AND status = 'in_progress'",
                replayed(&live)
            ),
            complete_announced: format!("{completing}{}", notify(10)),
            release_announced: format!("{releasing}{}", notify(5)),
            complete: format!("{completing}{}", quiet(10)),
            release: format!("{releasing}{}", quiet(5)),
            withdraw: format!("{withdrawing}{}", quiet(5)),
            withdraw_announced: format!("{withdrawing}{}", notify(5)),
            // $5 lease ms, counted from the clock once the row's lock is granted (the lease
            // held by `now()`, when the statement began).
            extend: format!(
                "UPDATE {name} SET (locked_until, expires_at) = (
    SELECT lease.until, lease.until
    FROM (SELECT clock_timestamp() + $5::bigint * interval '1 millisecond' AS until) lease
)
WHERE {held}"
            ),
            // $1 batch size. Rows a claim has locked meanwhile are skipped; the condition is
            // checked again on the rows deleted.
            purge: purge(&name, "expires_at <= now()"),
            purge_keeping_completed: purge(&name, "expires_at <= now() AND status = 'in_progress'"),
            name,
            channel,
            migration,
            indexes,
            migration_lock,
        }
    }
}

/// A batch of the purge: up to `$1` rows of `table` where `condition` holds. Rows are
/// picked by `ctid` and locked: a row a claim rewrote since (taking the expired key) has a
/// new version, with another `ctid`, and is not deleted; the condition, checked again,
/// keeps it so whatever picks the rows.
fn purge(table: &str, condition: &str) -> String {
    format!(
        "DELETE FROM {table} WHERE ctid = ANY(ARRAY(
    SELECT ctid FROM {table} WHERE {condition} LIMIT $1 FOR UPDATE SKIP LOCKED
)) AND {condition}"
    )
}

fn millis(duration: Duration) -> i64 {
    i64::try_from(duration.as_millis())
        .unwrap_or(i64::MAX)
        .max(1)
}

fn fenced(rows: u64) -> Fenced {
    if rows == 1 {
        Fenced::Applied
    } else {
        Fenced::Lost
    }
}

fn principal(scope: &Scope) -> &str {
    scope.principal().unwrap_or("")
}

/// The live row a claim found. A store that counts replays says nothing of when a
/// completed one expires, so that no cache in front keeps a copy and serves replays the
/// count would not see.
fn decode_claim(row: &Row, counted: bool) -> Result<Claim> {
    decode_claim_at(row, 0, counted)
}

/// [`decode_claim`] of a row whose claim columns begin at column `first`.
fn decode_claim_at(row: &Row, first: usize, counted: bool) -> Result<Claim> {
    let column = |n: usize| first + n;
    let hash: Vec<u8> = row.try_get(column(1))?;
    let fingerprint = Fingerprint::from_bytes(
        hash.try_into()
            .map_err(|_| PostgresStoreError::UnexpectedRow("request_hash is not 32 bytes"))?,
    );
    let status: String = row.try_get(column(2))?;
    match status.as_str() {
        "in_progress" => {
            let lease_remaining = remaining_millis(row, first)?;
            let running: i64 = row.try_get(column(7))?;
            Ok(Claim::InProgress {
                fingerprint,
                lease_remaining,
                running_for: Some(Duration::from_millis(running.max(0) as u64)),
            })
        }
        "completed" => {
            let code: i16 = row.try_get(column(3))?;
            let status = u16::try_from(code)
                .ok()
                .and_then(|c| StatusCode::from_u16(c).ok())
                .ok_or(PostgresStoreError::UnexpectedRow("invalid status_code"))?;
            // The headers, then the trailers.
            let mut headers = Bytes::from(row.try_get::<_, Vec<u8>>(column(4))?);
            let (decoded, trailers) = take_headers_and_trailers(&mut headers)?;
            if !headers.is_empty() {
                return Err(
                    PostgresStoreError::UnexpectedRow("trailing bytes after trailers").into(),
                );
            }
            let body = Bytes::from(row.try_get::<_, Vec<u8>>(column(5))?);
            let response = StoredResponse {
                status,
                headers: decoded,
                body,
                trailers,
            };
            Ok(Claim::Completed {
                fingerprint,
                response,
                expires_in: if counted {
                    None
                } else {
                    Some(remaining_millis(row, first)?)
                },
            })
        }
        _ => Err(PostgresStoreError::UnexpectedRow("unknown status").into()),
    }
}

/// How long the row found in the way stays live: its lease while in progress, its TTL once
/// completed (the database's clock).
fn remaining_millis(row: &Row, first: usize) -> Result<Duration> {
    let remaining: i64 = row.try_get(first + 6)?;
    Ok(Duration::from_millis(remaining.max(0) as u64))
}

#[async_trait]
impl Store for PostgresStore {
    fn name(&self) -> &'static str {
        "postgres"
    }

    async fn claim_with_token(
        &self,
        scope: &Scope,
        fingerprint: Fingerprint,
        token: ClaimToken,
        lease: Duration,
    ) -> Result<Claim> {
        if let Some(open) = &self.transactions {
            return open.claim(self, scope, fingerprint, token, lease).await;
        }
        let [claim, ..] = self.writes();
        let (connection, statement) = self.connection_for(claim).await?;
        let client = connection.client();
        let (key, endpoint, principal) = (scope.key().as_str(), scope.endpoint(), principal(scope));
        let (hash, token_bytes, lease_ms) = (
            fingerprint.as_bytes().as_slice(),
            token.as_bytes().as_slice(),
            millis(lease),
        );
        for _ in 0..CLAIM_ATTEMPTS {
            let params: [&(dyn ToSql + Sync); 6] =
                [&key, &endpoint, &principal, &hash, &token_bytes, &lease_ms];
            let row = connection
                .answer(true, client.query_opt(&statement, &params))
                .await?;
            match row {
                Some(row) if row.try_get::<_, bool>(0)? => {
                    // What the lease has left by the clock, now that the row is written: a
                    // claim that waited on a lock took the key with less, or none.
                    let remaining: i64 = row.try_get(6)?;
                    if remaining > 0 && remaining >= lease_ms / 2 {
                        return Ok(Claim::Claimed(token));
                    }
                    drop(connection);
                    return self.short_lease(scope, token, lease, remaining).await;
                }
                Some(row) => return decode_claim(&row, self.count_replays),
                // The row in the way was committed after this statement's snapshot: again.
                None => continue,
            }
        }
        Err(
            PostgresStoreError::UnexpectedRow("claim found neither a free key nor a live row")
                .into(),
        )
    }

    async fn complete(
        &self,
        scope: &Scope,
        token: ClaimToken,
        fingerprint: Fingerprint,
        response: &StoredResponse,
        ttl: Duration,
    ) -> Result<Fenced> {
        match &self.transactions {
            Some(open) => {
                open.complete(self, scope, token, fingerprint, response, ttl)
                    .await
            }
            None => {
                self.complete_now(scope, token, fingerprint, response, ttl)
                    .await
            }
        }
    }

    async fn release(&self, scope: &Scope, token: ClaimToken) -> Result<Fenced> {
        match &self.transactions {
            Some(open) => open.release(self, scope, token).await,
            None => self.release_now(scope, token).await,
        }
    }

    async fn extend(&self, scope: &Scope, token: ClaimToken, lease: Duration) -> Result<Fenced> {
        if let Some(open) = &self.transactions {
            // Its transaction holds the key for as long as it is open.
            return Ok(if open.holds(scope, token) {
                Fenced::Applied
            } else {
                Fenced::Lost
            });
        }
        let params: [&(dyn ToSql + Sync); 5] = [
            &scope.key().as_str(),
            &scope.endpoint(),
            &principal(scope),
            &token.as_bytes().as_slice(),
            &millis(lease),
        ];
        let [.., extend] = self.writes();
        Ok(fenced(self.execute(extend, &params).await?))
    }

    async fn watch(&self, scope: &Scope) -> Result<Option<Watch>> {
        let Some(key) = self.announced_key(scope) else {
            return Ok(None);
        };
        let watch = self.listener.watch(&key).await;
        // Each replay a waiter is served must be read, to be counted.
        Ok(match watch {
            Some(watch) if self.count_replays => Some(watch.reading_alone()),
            watch => watch,
        })
    }

    fn hand_over(&self, token: ClaimToken, extensions: &mut http::Extensions) {
        if let Some(open) = &self.transactions {
            open.hand_over(token, extensions);
        }
    }

    fn abandon(&self, scope: &Scope, token: ClaimToken) {
        if let Some(open) = &self.transactions {
            open.abandon(scope, token);
        }
    }

    fn commits_handler_writes(&self) -> bool {
        self.transactions.is_some()
    }
}

impl fmt::Debug for PostgresStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PostgresStore")
            .field("table", &self.table.name)
            .field("keep_completed", &self.keep_completed)
            .field("count_replays", &self.count_replays)
            .field("transactional", &self.transactions.is_some())
            .field("watched", &self.watched())
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn index_names_fit_and_stay_distinct() {
        // Names that fit are kept whole.
        assert_eq!(
            index_names("public", "idempotency_keys"),
            [
                "public_idempotency_keys_scope",
                "public_idempotency_keys_expires_at",
                "public_idempotency_keys_resource_id",
            ]
        );
        // The longest suffix still fits whole...
        let (schema, table) = ("s".repeat(30), "t".repeat(20));
        assert_eq!(
            index_names(&schema, &table)[2],
            format!("{schema}_{table}_resource_id")
        );
        // ...and one byte more hashes every name, cutting none.
        let table = "t".repeat(21);
        let names = index_names(&schema, &table);
        assert!(!names[2].starts_with(&format!("{schema}_{table}")));
        assert!(names[2].ends_with("_resource_id"));
        let (s41, t31) = ("s".repeat(41), "t".repeat(31));
        for (schema, table) in [
            (s41.as_str(), t31.as_str()),
            (&"s".repeat(63), &"t".repeat(63)),
            ("s", &"t".repeat(60)),
        ] {
            let names = index_names(schema, table);
            for name in &names {
                assert!(name.len() <= MAX_IDENTIFIER, "{name}");
                assert!(validate_identifier(name).is_ok(), "{name}");
            }
            assert!(names[0] != names[1] && names[1] != names[2] && names[0] != names[2]);
        }
        // Two long names sharing their first 42 bytes differ by their hash.
        let (a, b) = (index_names(&s41, &t31), index_names(&s41, &"u".repeat(31)));
        assert_ne!(a, b);
    }

    #[test]
    fn identifiers_are_validated() {
        for good in ["idempotency_keys", "_t", "t1", &"a".repeat(63)] {
            assert!(validate_identifier(good).is_ok(), "{good}");
        }
        for bad in [
            "",
            "1t",
            "T",
            "a-b",
            "a.b",
            "a;drop",
            "\"q\"",
            &"a".repeat(64),
            "user",
            "order",
            "table",
        ] {
            assert!(validate_identifier(bad).is_err(), "{bad}");
        }
        // Only the reserved words themselves: names that contain one are plain.
        for good in ["users", "user_keys", "orders", "tables"] {
            assert!(validate_identifier(good).is_ok(), "{good}");
        }
    }
}
