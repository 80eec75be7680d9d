//! The store contract, and the stores that meet it.

use std::{fmt::Debug, time::Duration};

use async_trait::async_trait;

use crate::{ClaimToken, Fingerprint, Scope, StoredResponse};

mod announce;
mod cached;
#[cfg(feature = "memory")]
mod memory;
#[cfg(feature = "postgres")]
mod postgres;
/// The record's byte layout, the one every store writes: its encoding, and the offsets
/// the Redis scripts compare in place.
pub(crate) mod record;
#[cfg(feature = "redis")]
mod redis;
mod shards;

#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub use self::postgres::{
    ExtractResourceId, PostgresStore, PostgresStoreError, ResourceId, MAX_RESOURCE_ID_LEN,
};
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub use self::redis::{RedisStore, RedisStoreError};
#[cfg(any(feature = "redis", feature = "postgres"))]
pub(crate) use announce::Ending;
pub use announce::{Announcements, Watch};
pub use cached::CachedStore;
#[cfg(feature = "memory")]
#[cfg_attr(docsrs, doc(cfg(feature = "memory")))]
pub use memory::MemoryStore;

/// A store failure. The layer answers `503 idempotency_store_unavailable` when a claim
/// fails this way (or executes unprotected in fail-open mode), and logs it after the
/// handler ran.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The backend failed the operation, or its answer was lost: the operation may or may
    /// not have been applied.
    #[error("idempotency store backend: {0}")]
    Backend(#[source] Box<dyn std::error::Error + Send + Sync + 'static>),
    /// The store could not take the operation (a refused connection, no connection from a
    /// pool, a full memory store): it changed nothing.
    #[error("idempotency store unavailable: {0}")]
    Unavailable(#[source] Box<dyn std::error::Error + Send + Sync + 'static>),
    /// The store will never take the operation as sent (a record past the largest value
    /// its backend takes): it changed nothing, and sending it again changes nothing
    /// either. The layer then records a refusal to replay the response instead
    /// (`409 response_not_replayable`), as for one over its `max_response_body`, rather
    /// than retrying the record for as long as the lease lasts.
    #[error("idempotency store refused: {0}")]
    Refused(#[source] Box<dyn std::error::Error + Send + Sync + 'static>),
    /// A stored record could not be decoded.
    #[error(transparent)]
    Decode(#[from] record::DecodeError),
}

/// What a store operation returns.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The answer to [`Store::claim`]: the key taken by the caller, or what holds it. Not
/// to be confused with a [`Record`](crate::Record), which is what a store keeps for a key
/// (in progress or completed, encoded as bytes), nor with the
/// [`StoredResponse`] inside a completed one, which is what a replay sends.
#[derive(Clone, Debug, PartialEq, Eq)]
// The completed variant is the one replays read: boxing it would cost them an allocation.
#[allow(clippy::large_enum_variant)]
pub enum Claim {
    /// The key was free and is now held by the caller, who must complete, release or
    /// extend it with this token.
    Claimed(ClaimToken),
    /// Another request holds the key.
    InProgress {
        /// The holder's request fingerprint. A store whose running records cannot be read
        /// until they commit ([`Store::commits_handler_writes`]) reports the caller's own
        /// fingerprint when the holder runs the same request, and another otherwise.
        fingerprint: Fingerprint,
        /// How long the holder's lease still runs.
        lease_remaining: Duration,
        /// How long the holder has been running, when the store can tell (the holder's
        /// [`ClaimToken::age`]): the layer's `Retry-After` grows with it.
        running_for: Option<Duration>,
    },
    /// The operation finished.
    Completed {
        /// The fingerprint of the request that ran.
        fingerprint: Fingerprint,
        /// What it answered.
        response: StoredResponse,
        /// How much longer the store keeps the record, where it can tell. A cache in front
        /// of the store ([`CachedStore`]) keeps a copy for about that long; `None`
        /// means it keeps none.
        expires_in: Option<Duration>,
    },
}

/// Whether a fenced write found the caller's claim.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[must_use]
pub enum Fenced {
    /// The claim was still the caller's; the write happened.
    Applied,
    /// The claim was gone (its lease ran out, and maybe another request claimed the key):
    /// nothing was written.
    Lost,
}

/// Where idempotency records live. Every backend meets this contract; the layer relies on
/// it for exactly-once execution.
///
/// - Each operation is **atomic** with respect to every other operation on the same scope,
///   from any process sharing the backend.
/// - An in-progress record lives only for its lease unless extended; a completed record for
///   its TTL. An expired record is indistinguishable from none.
/// - Writes after the claim are **fenced**: they apply only while the record is the
///   in-progress record made by the claim that returned `token`.
/// - Records are stored byte-exact: the response a claim returns equals the one completed.
/// - A claim sent again with the token that holds the key (a retry of a claim whose reply
///   was lost) leaves the claim the caller's: it answers [`Claim::Claimed`] with that token
///   or [`Claim::InProgress`] with the caller's fingerprint, whichever the store can tell.
/// - Each operation answers, or fails, within a bounded time, well under the lease (the
///   built-in stores time out after a few seconds): the layer counts a claim answered a
///   whole lease after it was sent as failed, and a renewal not answered before the next is
///   due as failed, but it waits for a completion's first attempt.
///
/// # Implementing a store
///
/// Implementations are written with [`#[tower_idempotency::async_trait]`](crate::async_trait)
/// on the `impl` block. A backend with a single key column can name each record by
/// [`Scope::storage_key`] and keep it as [`Record::encode`](crate::Record::encode) writes
/// it. The cases of
#[cfg_attr(feature = "conformance", doc = "[`conformance`](crate::conformance)")]
#[cfg_attr(not(feature = "conformance"), doc = "`conformance`")]
/// (feature `conformance`) check a store against this contract, as they check the
/// built-in ones.
///
/// A complete store over a key-value map whose entries expire, the shape of most backends
/// (an item with a TTL attribute and conditional writes, a key with a lease and a
/// transaction): each entry keeps the token of the claim that made it, so that the fenced
/// writes, a completion sent again included, can compare it.
///
/// ```
/// use std::{
///     collections::HashMap,
///     sync::Mutex,
///     time::{Duration, Instant},
/// };
///
/// use bytes::Bytes;
/// use tower_idempotency::{
///     async_trait,
///     store::{Claim, Fenced, Result},
///     ClaimToken, Fingerprint, Record, Scope, Store, StoredResponse,
/// };
///
/// /// Storage key → the token of the claim that made the record, the encoded record, and
/// /// when it expires. (A backend with TTLs deletes expired entries by itself; this map
/// /// keeps each until its key is claimed again.)
/// type Entries = HashMap<String, (ClaimToken, Bytes, Instant)>;
///
/// /// Records in a map; one lock makes each operation atomic.
/// #[derive(Debug, Default)]
/// pub struct KvStore(Mutex<Entries>);
///
/// /// The live record of `scope`, if the claim with `token` made it: an expired entry is
/// /// no record at all.
/// fn made_by(entries: &Entries, scope: &Scope, token: ClaimToken) -> Result<Option<Record>> {
///     match entries.get(scope.storage_key()) {
///         Some((holder, record, expires)) if *holder == token && *expires > Instant::now() => {
///             Ok(Some(Record::decode(record.clone())?))
///         }
///         _ => Ok(None),
///     }
/// }
///
/// #[async_trait]
/// impl Store for KvStore {
///     async fn claim_with_token(
///         &self,
///         scope: &Scope,
///         fingerprint: Fingerprint,
///         token: ClaimToken,
///         lease: Duration,
///     ) -> Result<Claim> {
///         let mut entries = self.0.lock().unwrap();
///         let now = Instant::now();
///         if let Some((_, record, expires)) = entries.get(scope.storage_key()) {
///             if *expires > now {
///                 let left = *expires - now;
///                 return Ok(match Record::decode(record.clone())? {
///                     Record::InProgress { fingerprint, token } => Claim::InProgress {
///                         fingerprint,
///                         lease_remaining: left,
///                         running_for: token.age(),
///                     },
///                     Record::Completed {
///                         fingerprint,
///                         response,
///                     } => Claim::Completed {
///                         fingerprint,
///                         response,
///                         expires_in: Some(left),
///                     },
///                 });
///             }
///         }
///         let record = Record::InProgress { fingerprint, token }.encode();
///         entries.insert(scope.storage_key().to_owned(), (token, record, now + lease));
///         Ok(Claim::Claimed(token))
///     }
///
///     async fn complete(
///         &self,
///         scope: &Scope,
///         token: ClaimToken,
///         fingerprint: Fingerprint,
///         response: &StoredResponse,
///         ttl: Duration,
///     ) -> Result<Fenced> {
///         let mut entries = self.0.lock().unwrap();
///         Ok(match made_by(&entries, scope, token)? {
///             Some(Record::InProgress { .. }) => {
///                 let completed = Record::Completed {
///                     fingerprint,
///                     response: response.clone(),
///                 };
///                 let entry = (token, completed.encode(), Instant::now() + ttl);
///                 entries.insert(scope.storage_key().to_owned(), entry);
///                 Fenced::Applied
///             }
///             // This claim's completion, sent again: it is there already.
///             Some(Record::Completed {
///                 fingerprint: kept,
///                 response: stored,
///             }) if kept == fingerprint && stored == *response => Fenced::Applied,
///             // Another completion, or no claim of this token.
///             _ => Fenced::Lost,
///         })
///     }
///
///     async fn release(&self, scope: &Scope, token: ClaimToken) -> Result<Fenced> {
///         let mut entries = self.0.lock().unwrap();
///         Ok(match made_by(&entries, scope, token)? {
///             Some(Record::InProgress { .. }) => {
///                 entries.remove(scope.storage_key());
///                 Fenced::Applied
///             }
///             _ => Fenced::Lost,
///         })
///     }
///
///     async fn extend(&self, scope: &Scope, token: ClaimToken, lease: Duration) -> Result<Fenced> {
///         let mut entries = self.0.lock().unwrap();
///         Ok(match made_by(&entries, scope, token)? {
///             Some(record @ Record::InProgress { .. }) => {
///                 let entry = (token, record.encode(), Instant::now() + lease);
///                 entries.insert(scope.storage_key().to_owned(), entry);
///                 Fenced::Applied
///             }
///             _ => Fenced::Lost,
///         })
///     }
/// }
///
/// # #[cfg(feature = "conformance")]
/// # tokio::runtime::Runtime::new().unwrap().block_on(async {
/// // Every case of the contract, as the built-in stores pass them (feature `conformance`).
/// tower_idempotency::conformance::run_all(&KvStore::default()).await;
/// # });
/// ```
#[async_trait]
pub trait Store: Debug + Send + Sync + 'static {
    /// Atomically: if `scope` has no live record, store an in-progress record with
    /// `fingerprint`, `token` and `lease`, and return [`Claim::Claimed`] with `token`;
    /// otherwise return the live record unchanged.
    ///
    /// The caller chooses the token so that it can release a claim whose reply it never
    /// saw (a request dropped mid-claim): release is fenced, so releasing a claim that did
    /// not happen changes nothing.
    async fn claim_with_token(
        &self,
        scope: &Scope,
        fingerprint: Fingerprint,
        token: ClaimToken,
        lease: Duration,
    ) -> Result<Claim>;

    /// [`claim_with_token`](Self::claim_with_token) with a fresh [`ClaimToken::unique`].
    async fn claim(
        &self,
        scope: &Scope,
        fingerprint: Fingerprint,
        lease: Duration,
    ) -> Result<Claim> {
        self.claim_with_token(scope, fingerprint, ClaimToken::unique(), lease)
            .await
    }

    /// If `scope` holds the in-progress record made with `token`, replace it with the
    /// completed `response` of the request with `fingerprint`, kept for `ttl`.
    ///
    /// Completing again with the same token once the record is completed answers
    /// [`Fenced::Applied`] and changes nothing that matters: the layer retries a completion
    /// whose reply was lost. A different completion with that token (a refusal to replay
    /// the response, recorded where its first write seemed to fail) answers
    /// [`Fenced::Lost`] and leaves the completed record as it is: waiters and replays may
    /// have read it already.
    async fn complete(
        &self,
        scope: &Scope,
        token: ClaimToken,
        fingerprint: Fingerprint,
        response: &StoredResponse,
        ttl: Duration,
    ) -> Result<Fenced>;

    /// If `scope` holds the in-progress record made with `token`, delete it: the next
    /// request with the key executes.
    async fn release(&self, scope: &Scope, token: ClaimToken) -> Result<Fenced>;

    /// If `scope` holds the in-progress record made with `token`, renew its lease to
    /// `lease` from now.
    async fn extend(&self, scope: &Scope, token: ClaimToken, lease: Duration) -> Result<Fenced>;

    /// A [`Watch`] on `scope`'s record that wakes when a completion or a release of it is
    /// announced, by this process or, where the store relays its backend's notifications,
    /// any other: for requests that wait for the original of their key
    /// ([`IdempotencyLayer::wait_for_original`](crate::IdempotencyLayer::wait_for_original)).
    /// The watch must see every announcement made after this returns.
    ///
    /// `None` (the default) when the store announces nothing: a waiter then reads the key
    /// again every 20 ms, doubling up to 200 ms, until its bound. A store that announces
    /// keeps an [`Announcements`] board, returns its watches
    /// ([`Announcements::watch`] of [`Scope::storage_key`]), and calls
    /// [`Announcements::announce`] after each completion and release it applies, and each
    /// one its backend reports from elsewhere: the waiters then read the key. A report
    /// from a backend only ever makes them read: whoever can send one could have.
    async fn watch(&self, _scope: &Scope) -> Result<Option<Watch>> {
        Ok(None)
    }

    /// Once `token` has claimed a key, puts in `extensions` (the request's, handed to the
    /// handler) what the handler needs to write in the store's transaction: a store that
    /// runs each execution in a database transaction (PostgreSQL's transactional modes)
    /// hands over that transaction. Others add nothing (the default).
    fn hand_over(&self, _token: ClaimToken, _extensions: &mut http::Extensions) {}

    /// The layer gave up on `token`'s claim of `scope` without the store ending it: its
    /// completion or its release was refused, or not answered within the lease. A store
    /// that holds something for a claim until one of them ends it (PostgreSQL's
    /// transactional modes: the execution's transaction) lets go of it now, rolling it back,
    /// rather than keeping the key and a connection for ever. Others have nothing to do (the
    /// default). A store that wraps another forwards it.
    fn abandon(&self, _scope: &Scope, _token: ClaimToken) {}

    /// Whether a completion also commits the handler's own writes (a transactional store).
    /// The layer then never sends a response whose completion the store did not apply, as
    /// its writes did not happen: it answers `503 idempotency_store_unavailable` instead,
    /// and the client's retry executes again. `false` by default: a response is sent
    /// whether or not its record could be written.
    fn commits_handler_writes(&self) -> bool {
        false
    }

    /// A short fixed name for the store's kind: the `store` label of the layer's metrics
    /// (`"memory"`, `"redis"`, `"postgres"`; a cache in front gives its store's). The
    /// default, `"custom"`, fits a store of one's own.
    fn name(&self) -> &'static str {
        "custom"
    }
}
