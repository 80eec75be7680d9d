//! The transactional mode: each execution in a database transaction of its own, which
//! claims the key, carries the handler's writes and commits them with the completed record.
//!
//! - A replay reads the committed record outside any transaction: one round trip.
//! - A first execution begins a transaction, takes a transaction-scoped advisory lock on the
//!   key without waiting, and claims the key in it. Its row stays invisible to everyone else
//!   until it commits completed; its duplicates find the lock taken and answer `409` at
//!   once, rather than queueing behind the uncommitted row.
//! - Completing writes the record in the transaction and commits; releasing rolls it back,
//!   the handler's writes with the claim. A crash or a lost connection rolls back both.

use std::{
    collections::HashMap,
    sync::{Mutex, PoisonError},
    time::Duration,
};

use async_trait::async_trait;
use sha2::{Digest, Sha256};

use super::{millis, principal, Completion, PostgresStore, CLAIM_ATTEMPTS};
use crate::{
    store::{Claim, Error, Fenced, Result},
    transaction::{Connection, InTransaction},
    ClaimToken, Fingerprint, Scope, StoredResponse,
};

/// How long a first execution waits for a connection to open its transaction on, before
/// the layer answers `503` with `Retry-After`.
pub(super) const BEGIN_TIMEOUT: Duration = Duration::from_secs(2);

/// `connecting` (a pool's connection, or a transaction on one), given up after
/// [`BEGIN_TIMEOUT`] as [`Error::Unavailable`]: no transaction was begun.
pub(super) async fn within_begin_timeout<T>(
    pool: &str,
    connecting: impl std::future::Future<Output = T>,
) -> Result<T> {
    tokio::time::timeout(BEGIN_TIMEOUT, connecting)
        .await
        .map_err(|_| {
            let why = format!("no {pool} connection within {BEGIN_TIMEOUT:?} for a transaction");
            Error::Unavailable(why.into())
        })
}

/// The parameters of the transactional claim, in the order of its `$1`…`$7`.
pub(super) struct Claiming<'a> {
    pub(super) key: &'a str,
    pub(super) endpoint: &'a str,
    pub(super) principal: &'a str,
    pub(super) fingerprint: &'a [u8],
    pub(super) token: &'a [u8],
    pub(super) lease: i64,
    /// The key's lock.
    pub(super) lock: i64,
    /// The request's lock: the key's and the fingerprint's.
    pub(super) request_lock: i64,
}

/// What the claim in a new transaction found.
pub(super) struct Begun<C> {
    pub(super) transaction: C,
    /// Whether the request's lock was free: an execution of the same request runs
    /// otherwise.
    pub(super) request_locked: bool,
    /// Whether the key's lock was free too: an execution of another request runs otherwise.
    pub(super) locked: bool,
    /// Whether the key was claimed: a row committed live is in the way otherwise.
    pub(super) claimed: bool,
    /// How long the lock's holder has been running, in milliseconds, when it was not free
    /// and the database tells.
    pub(super) holder_ran: Option<i64>,
    /// The live row committed in the key's way, where the driver reads it
    /// ([`Driver::reads_while_claiming`]).
    pub(super) found: Option<Claim>,
}

/// A database driver's transactions: the tokio-postgres pool's or sqlx's.
#[async_trait]
pub(super) trait Driver: Send + Sync + 'static {
    /// A connection inside its open transaction, as the handler gets it.
    type Connection: Connection;

    /// Whether [`begin_claiming`](Self::begin_claiming) reads the live row of the key in the
    /// same round trip as the claim (decoded as replays `counted`), so that no read outside
    /// the transaction need come first.
    fn reads_while_claiming(&self) -> bool;

    /// Begins a transaction and runs the claim `sql` in it. No connection within
    /// [`BEGIN_TIMEOUT`] is [`Error::Unavailable`].
    async fn begin_claiming(
        &self,
        sql: &str,
        claiming: &Claiming<'_>,
        counted: bool,
    ) -> Result<Begun<Self::Connection>>;

    /// Runs the completing `sql` in the transaction, which fails where it writes no row, and
    /// commits.
    async fn complete_and_commit(
        &self,
        transaction: Self::Connection,
        sql: &str,
        completion: &Completion<'_>,
    ) -> Result<()>;

    /// Rolls back; a connection that fails to is closed, which rolls back as well.
    async fn rollback(&self, transaction: Self::Connection);

    /// Rolls back a transaction that claimed nothing, without its caller waiting for it.
    fn abandon(&self, transaction: Self::Connection);
}

/// What a transactional [`PostgresStore`] does in place of its autocommit statements.
#[async_trait]
pub(super) trait Transactions: Send + Sync + 'static {
    async fn claim(
        &self,
        store: &PostgresStore,
        scope: &Scope,
        fingerprint: Fingerprint,
        token: ClaimToken,
        lease: Duration,
    ) -> Result<Claim>;

    async fn complete(
        &self,
        store: &PostgresStore,
        scope: &Scope,
        token: ClaimToken,
        fingerprint: Fingerprint,
        response: &StoredResponse,
        ttl: Duration,
    ) -> Result<Fenced>;

    async fn release(
        &self,
        store: &PostgresStore,
        scope: &Scope,
        token: ClaimToken,
    ) -> Result<Fenced>;

    /// Whether `token`'s transaction on `scope` is still open: its claim holds while it is.
    fn holds(&self, scope: &Scope, token: ClaimToken) -> bool;

    fn hand_over(&self, token: ClaimToken, extensions: &mut http::Extensions);

    /// Rolls back `token`'s transaction on `scope`, if still open, without waiting for it.
    fn abandon(&self, scope: &Scope, token: ClaimToken);

    /// How many transactions are open now.
    fn open(&self) -> usize;
}

/// The open transactions of one store, by the token of the claim each made, with the
/// storage key it claimed.
pub(super) struct Open<D: Driver> {
    driver: D,
    transactions: Mutex<HashMap<ClaimToken, Held<D::Connection>>>,
}

/// An open transaction, the storage key its claim holds, and the claim's lease: how long
/// its completion or its rollback may take before the connection is closed instead.
struct Held<C> {
    key: Box<str>,
    transaction: InTransaction<C>,
    lease: Duration,
}

impl<D: Driver> Open<D> {
    pub(super) fn new(driver: D) -> Self {
        Self {
            driver,
            transactions: Mutex::new(HashMap::new()),
        }
    }

    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<ClaimToken, Held<D::Connection>>> {
        self.transactions
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// The transaction `token`'s claim of `scope` opened: a token is no write's to
    /// another scope.
    fn take(&self, scope: &Scope, token: ClaimToken) -> Option<Held<D::Connection>> {
        let mut map = self.map();
        match map.get(&token) {
            Some(held) if *held.key == *scope.storage_key() => map.remove(&token),
            _ => None,
        }
    }
}

/// The advisory lock a running execution of `scope` holds in `table`: 64 bits of SHA-256, in
/// the one-`bigint` key space of PostgreSQL's advisory locks.
fn lock_of(table: &str, scope: &Scope) -> i64 {
    lock(&[
        b"tower-idempotency execution",
        table.as_bytes(),
        scope.storage_key().as_bytes(),
    ])
}

/// The advisory lock an execution of the request with `fingerprint` holds: its duplicates
/// tell by it whether the running execution is of their own request.
fn request_lock_of(table: &str, scope: &Scope, fingerprint: Fingerprint) -> i64 {
    lock(&[
        b"tower-idempotency request",
        table.as_bytes(),
        scope.storage_key().as_bytes(),
        fingerprint.as_bytes(),
    ])
}

/// 64 bits of SHA-256 over `parts`, each length-prefixed.
fn lock(parts: &[&[u8]]) -> i64 {
    let mut digest = Sha256::new();
    for part in parts {
        digest.update((part.len() as u64).to_be_bytes());
        digest.update(part);
    }
    i64::from_be_bytes(digest.finalize()[..8].try_into().expect("8 bytes"))
}

/// A fingerprint other than `fingerprint`: what a running execution of another request is
/// reported with, its own being unreadable until it commits.
fn another(fingerprint: Fingerprint) -> Fingerprint {
    Fingerprint::from_bytes(fingerprint.as_bytes().map(|byte| !byte))
}

#[async_trait]
impl<D: Driver> Transactions for Open<D> {
    async fn claim(
        &self,
        store: &PostgresStore,
        scope: &Scope,
        fingerprint: Fingerprint,
        token: ClaimToken,
        lease: Duration,
    ) -> Result<Claim> {
        // A claim sent again by its holder: it is still the holder's.
        if self.holds(scope, token) {
            return Ok(Claim::Claimed(token));
        }
        let claiming = Claiming {
            key: scope.key().as_str(),
            endpoint: scope.endpoint(),
            principal: principal(scope),
            fingerprint: fingerprint.as_bytes().as_slice(),
            token: token.as_bytes().as_slice(),
            lease: millis(lease),
            lock: lock_of(&store.table.name, scope),
            request_lock: request_lock_of(&store.table.name, scope, fingerprint),
        };
        // A counted replay must commit its count: it is read outside the transaction.
        let read_first = !self.driver.reads_while_claiming() || store.count_replays;
        for _ in 0..CLAIM_ATTEMPTS {
            if read_first {
                if let Some(found) = store.read(scope).await? {
                    return Ok(found);
                }
            }
            let sql = &store.table.transactional.claim;
            let begun = self
                .driver
                .begin_claiming(sql, &claiming, store.count_replays)
                .await?;
            if begun.claimed {
                let held = Held {
                    key: scope.storage_key().into(),
                    transaction: InTransaction::new(begun.transaction),
                    lease,
                };
                self.map().insert(token, held);
                return Ok(Claim::Claimed(token));
            }
            self.driver.abandon(begun.transaction);
            if let Some(found) = begun.found.filter(|_| !store.count_replays) {
                return Ok(found);
            }
            if !begun.locked {
                // Running in a transaction of its own, its row invisible until it commits:
                // its request's fingerprint cannot be read, but its locks tell whether it is
                // the caller's.
                let theirs = if begun.request_locked {
                    another(fingerprint)
                } else {
                    fingerprint
                };
                return Ok(Claim::InProgress {
                    fingerprint: theirs,
                    lease_remaining: lease,
                    running_for: begun
                        .holder_ran
                        .map(|ms| Duration::from_millis(ms.max(0) as u64)),
                });
            }
            // A row committed since the read holds the key: read it.
        }
        Err(Error::Backend(
            "a transactional claim found neither a free key nor a live row".into(),
        ))
    }

    async fn complete(
        &self,
        store: &PostgresStore,
        scope: &Scope,
        token: ClaimToken,
        fingerprint: Fingerprint,
        response: &StoredResponse,
        ttl: Duration,
    ) -> Result<Fenced> {
        let Some(open) = self.take(scope, token) else {
            // A completion sent again after its commit's answer was lost: the row this
            // token committed answers it, if the commit was applied.
            return store
                .complete_now(scope, token, fingerprint, response, ttl)
                .await;
        };
        let Some(transaction) = open.transaction.take() else {
            // The handler still holds it (a task it spawned): it rolls back when dropped.
            return Err(Error::Backend(
                "the handler still holds its transaction: rolled back".into(),
            ));
        };
        let completion = store.completion(scope, &token, &fingerprint, response, ttl);
        let statements = &store.table.transactional;
        let sql = if store.announce {
            &statements.complete_announced
        } else {
            &statements.complete
        };
        let ending = completion.ending(store);
        // Bounded: a response body still streaming rows from the transaction (a
        // tokio-postgres `query_raw`) holds the completion and the `COMMIT` behind them.
        // Given up, the transaction is dropped and its connection closed, which rolls back
        // unless the `COMMIT` was applied; a completion sent again then finds which.
        let committing = self
            .driver
            .complete_and_commit(transaction, sql, &completion);
        tokio::time::timeout(open.lease, committing)
            .await
            .map_err(|_| {
                let why = format!(
                    "the completion and COMMIT were not answered within the lease ({:?}): \
                     the transaction's connection is closed",
                    open.lease
                );
                Error::Unavailable(why.into())
            })??;
        if let Some(ending) = ending {
            ending.completed(|| Claim::Completed {
                fingerprint,
                response: response.clone(),
                expires_in: Some(ttl),
            });
        }
        Ok(Fenced::Applied)
    }

    async fn release(
        &self,
        store: &PostgresStore,
        scope: &Scope,
        token: ClaimToken,
    ) -> Result<Fenced> {
        let Some(open) = self.take(scope, token) else {
            return store.release_now(scope, token).await;
        };
        // A transaction the handler still holds rolls back when it lets go of it. One whose
        // rollback is not answered within the lease (held behind rows a response body
        // still streams) is dropped, its connection closed, which rolls back as well.
        if let Some(transaction) = open.transaction.take() {
            let rolling_back = self.driver.rollback(transaction);
            let _ = tokio::time::timeout(open.lease, rolling_back).await;
        }
        store.announce_rollback(scope, token).await;
        Ok(Fenced::Applied)
    }

    fn holds(&self, scope: &Scope, token: ClaimToken) -> bool {
        self.map()
            .get(&token)
            .is_some_and(|held| *held.key == *scope.storage_key())
    }

    fn hand_over(&self, token: ClaimToken, extensions: &mut http::Extensions) {
        if let Some(held) = self.map().get(&token) {
            extensions.insert(held.transaction.clone());
        }
    }

    fn abandon(&self, scope: &Scope, token: ClaimToken) {
        let transaction = self
            .take(scope, token)
            .and_then(|held| held.transaction.take());
        if let Some(transaction) = transaction {
            self.driver.abandon(transaction);
        }
    }

    fn open(&self) -> usize {
        self.map().len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::IdempotencyKey;

    #[test]
    fn locks_differ_by_table_and_by_scope() {
        let scope = |key: &str| {
            let key = IdempotencyKey::parse(&http::HeaderValue::from_str(key).unwrap()).unwrap();
            Scope::new(Some("alice".into()), "POST /v1/payments".into(), key)
        };
        let a = lock_of("public.idempotency_keys", &scope("k1"));
        assert_eq!(a, lock_of("public.idempotency_keys", &scope("k1")));
        assert_ne!(a, lock_of("public.idempotency_keys", &scope("k2")));
        assert_ne!(a, lock_of("billing.idempotency_keys", &scope("k1")));
        let request = |fingerprint: [u8; 32]| {
            let fingerprint = Fingerprint::from_bytes(fingerprint);
            request_lock_of("public.idempotency_keys", &scope("k1"), fingerprint)
        };
        assert_ne!(request([1; 32]), request([2; 32]));
        assert_ne!(request([1; 32]), a);
        assert_ne!(
            another(Fingerprint::from_bytes([1; 32])),
            Fingerprint::from_bytes([1; 32])
        );
    }
}
