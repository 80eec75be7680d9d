//! The in-process store.

use std::{
    sync::{Arc, MutexGuard},
    time::{Duration, Instant},
};

use async_trait::async_trait;

use super::record::expiry;
use super::{
    shards::{Hashed, Shards, Table, SHARDS},
    Announcements, Claim, Error, Fenced, Result, Store, Watch,
};
use crate::{ClaimToken, Fingerprint, Record, Scope, StoredResponse};

/// A shard is swept for expired records when it has grown to twice its size after the last
/// sweep (and at least this size): memory stays within twice the live records, and the
/// sweeps cost O(1) amortized per claim.
const MIN_SWEEP_LEN: usize = 1024;

/// An in-process store: for development, tests and single-instance services.
///
/// Claims are atomic across every task and thread of the process (not across processes:
/// use [`RedisStore`](crate::RedisStore) for that). Expired records are evicted as new keys
/// arrive, so memory stays bounded by the live records; [`MemoryStore::max_records`] bounds
/// those too. Cloning shares the records.
///
/// # Example
///
/// ```
/// use tower_idempotency::{IdempotencyLayer, MemoryStore};
///
/// let layer = IdempotencyLayer::new(MemoryStore::new());
/// ```
#[derive(Clone)]
pub struct MemoryStore {
    inner: Arc<Inner>,
}

struct Inner {
    shards: Shards<Shard>,
    max_records_per_shard: usize,
    announcements: Announcements,
}

struct Shard {
    /// Each entry boxed: a slot is then a hash, a key and a pointer (40 bytes), where an
    /// entry is 208, and the table, probed and rehashed as it grows by a key per first
    /// execution, stays a sixth of the size (measured in BENCHMARKS.md).
    records: Table<String, Box<Entry>>,
    sweep_at_len: usize,
    /// When a shard at its bound is next swept for room (`None`: at once): once an eighth
    /// of what its last sweep kept has expired, or any record written since, whichever
    /// comes first.
    full_sweep_at: Option<Instant>,
}

struct Entry {
    record: Record,
    /// The claim that made the record; kept once completed, so a repeated completion by
    /// the same claim is recognised.
    token: ClaimToken,
    expires_at: Instant,
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryStore {
    /// An empty store with no bound but the records' TTLs.
    pub fn new() -> Self {
        Self::with_max_records(usize::MAX)
    }

    /// Caps the live records at about `max` (each of 16 shards holds `max / 16`). A claim
    /// for a new key that finds its shard full of live records fails with a store error
    /// (`503` by default): no record is ever dropped early, since that would let a retry
    /// execute twice. A full shard is swept of its expired records when it needs room:
    /// at once the first time, then once an eighth of the records its last sweep kept
    /// have expired, so that a shard full of live records costs no sweep per claim.
    ///
    /// # Example
    ///
    /// ```
    /// use tower_idempotency::MemoryStore;
    ///
    /// let store = MemoryStore::new().max_records(1_000_000);
    /// ```
    pub fn max_records(self, max: usize) -> Self {
        Self::with_max_records(max)
    }

    fn with_max_records(max: usize) -> Self {
        let shards = Shards::new(|| Shard {
            records: Table::default(),
            sweep_at_len: MIN_SWEEP_LEN,
            full_sweep_at: None,
        });
        Self {
            inner: Arc::new(Inner {
                shards,
                max_records_per_shard: (max / SHARDS).max(1),
                announcements: Announcements::default(),
            }),
        }
    }

    /// How many keys requests wait on now (each key once, however many wait on it).
    pub fn watched(&self) -> usize {
        self.inner.announcements.watched()
    }

    /// How many records the store holds, expired ones not yet evicted included.
    pub fn len(&self) -> usize {
        self.inner
            .shards
            .each()
            .map(|shard| shard.records.len())
            .sum()
    }

    /// Whether the store holds no record.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The scope's key, hashed once for its shard and its place in the shard.
    fn key<'s>(&self, scope: &'s Scope) -> Hashed<'s> {
        self.inner.shards.hash(scope.storage_key())
    }

    fn shard(&self, key: Hashed<'_>) -> MutexGuard<'_, Shard> {
        self.inner.shards.lock(key)
    }

    /// Runs `write` on the scope's in-progress record if `token` still holds it.
    fn fenced(&self, scope: &Scope, token: ClaimToken, write: impl FnOnce(&mut Entry)) -> Fenced {
        let key = self.key(scope);
        let mut shard = self.shard(key);
        match shard.records.get_mut(key) {
            Some(entry) if entry.is_held_by(token, Instant::now()) => {
                write(entry);
                Fenced::Applied
            }
            _ => Fenced::Lost,
        }
    }
}

impl std::fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryStore")
            .field("records", &self.len())
            .finish()
    }
}

impl Entry {
    fn is_held_by(&self, token: ClaimToken, now: Instant) -> bool {
        matches!(self.record, Record::InProgress { .. })
            && self.token == token
            && self.expires_at > now
    }

    fn is_completed_by(&self, token: ClaimToken, now: Instant) -> bool {
        matches!(self.record, Record::Completed { .. })
            && self.token == token
            && self.expires_at > now
    }
}

impl Shard {
    fn sweep_if_due(&mut self, now: Instant) {
        if self.records.len() < self.sweep_at_len {
            return;
        }
        self.sweep(now, |_| {});
    }

    /// Drops the expired records, telling `kept` when each one it keeps expires.
    fn sweep(&mut self, now: Instant, mut kept: impl FnMut(Instant)) {
        self.records.retain(|entry| {
            let live = entry.expires_at > now;
            if live {
                kept(entry.expires_at);
            }
            live
        });
        self.sweep_at_len = (self.records.len() * 2).max(MIN_SWEEP_LEN);
    }

    /// A record now expires at `at`: a full shard is swept for room no later.
    fn expires(&mut self, at: Instant) {
        if let Some(sweep_at) = &mut self.full_sweep_at {
            *sweep_at = (*sweep_at).min(at);
        }
    }

    /// Whether a shard at its bound of `max` records has room for one more once swept
    /// of its expired records, sweeping it only when enough may have expired since its
    /// last sweep for room: the growth rule alone never sweeps a shard held below it.
    #[cold]
    fn make_room(&mut self, now: Instant, max: usize) -> bool {
        if self.full_sweep_at.is_none_or(|at| now >= at) {
            let mut expiries = Vec::with_capacity(self.records.len());
            self.sweep(now, |at| expiries.push(at));
            self.full_sweep_at = eighth_expired_at(expiries);
        }
        self.records.len() < max
    }
}

/// When an eighth of the records that expire at `expiries` (at least one) will have
/// expired, unless renewed or completed meanwhile; `None` for no record.
fn eighth_expired_at(mut expiries: Vec<Instant>) -> Option<Instant> {
    if expiries.is_empty() {
        return None;
    }
    let nth = (expiries.len() / 8).max(1) - 1;
    Some(*expiries.select_nth_unstable(nth).1)
}

#[async_trait]
impl Store for MemoryStore {
    fn name(&self) -> &'static str {
        "memory"
    }

    async fn claim_with_token(
        &self,
        scope: &Scope,
        fingerprint: Fingerprint,
        token: ClaimToken,
        lease: Duration,
    ) -> Result<Claim> {
        let now = Instant::now();
        let key = self.key(scope);
        let mut shard = self.shard(key);
        if let Some(entry) = shard.records.get(key).filter(|e| e.expires_at > now) {
            return Ok(match &entry.record {
                Record::InProgress { fingerprint, token } => Claim::InProgress {
                    fingerprint: *fingerprint,
                    lease_remaining: entry.expires_at - now,
                    running_for: token.age(),
                },
                Record::Completed {
                    fingerprint,
                    response,
                } => Claim::Completed {
                    fingerprint: *fingerprint,
                    response: response.replayable_copy(),
                    expires_in: Some(entry.expires_at - now),
                },
            });
        }
        shard.sweep_if_due(now);
        let max = self.inner.max_records_per_shard;
        if shard.records.len() >= max
            && shard.records.get(key).is_none()
            && !shard.make_room(now, max)
        {
            return Err(Error::Unavailable("memory store is full".into()));
        }
        let record = Record::InProgress { fingerprint, token };
        let expires_at = expiry(now, lease);
        let entry = Entry {
            record,
            token,
            expires_at,
        };
        shard
            .records
            .insert(key, || scope.storage_key().to_owned(), Box::new(entry));
        shard.expires(expires_at);
        Ok(Claim::Claimed(token))
    }

    async fn complete(
        &self,
        scope: &Scope,
        token: ClaimToken,
        fingerprint: Fingerprint,
        response: &StoredResponse,
        ttl: Duration,
    ) -> Result<Fenced> {
        let key = self.key(scope);
        let mut shard = self.shard(key);
        let now = Instant::now();
        match shard.records.get_mut(key) {
            Some(entry) if entry.is_held_by(token, now) => {
                entry.record = Record::Completed {
                    fingerprint,
                    response: response.clone(),
                };
                let expires_at = expiry(now, ttl);
                entry.expires_at = expires_at;
                shard.expires(expires_at);
                drop(shard);
                let completed = || Claim::Completed {
                    fingerprint,
                    response: response.replayable_copy(),
                    expires_in: Some(ttl),
                };
                let key = scope.storage_key();
                self.inner
                    .announcements
                    .announce_completed(key, token, completed);
                Ok(Fenced::Applied)
            }
            // This claim's completion, sent again; a different one finds the claim gone.
            Some(entry) if entry.is_completed_by(token, now) => Ok(match &entry.record {
                Record::Completed {
                    fingerprint: kept,
                    response: stored,
                } if *kept == fingerprint && stored == response => Fenced::Applied,
                _ => Fenced::Lost,
            }),
            _ => Ok(Fenced::Lost),
        }
    }

    async fn release(&self, scope: &Scope, token: ClaimToken) -> Result<Fenced> {
        let key = self.key(scope);
        let mut shard = self.shard(key);
        match shard.records.get(key) {
            Some(entry) if entry.is_held_by(token, Instant::now()) => {
                shard.records.remove(key);
                drop(shard);
                let key = scope.storage_key();
                self.inner.announcements.announce_end(key, token);
                Ok(Fenced::Applied)
            }
            _ => Ok(Fenced::Lost),
        }
    }

    async fn extend(&self, scope: &Scope, token: ClaimToken, lease: Duration) -> Result<Fenced> {
        Ok(self.fenced(scope, token, |entry| {
            entry.expires_at = expiry(Instant::now(), lease)
        }))
    }

    async fn watch(&self, scope: &Scope) -> Result<Option<Watch>> {
        Ok(Some(self.inner.announcements.watch(scope.storage_key())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::IdempotencyKey;

    fn scope(key: &str) -> Scope {
        let key = IdempotencyKey::parse(&http::HeaderValue::from_str(key).unwrap()).unwrap();
        Scope::new(None, "POST /".into(), key)
    }

    #[tokio::test]
    async fn memory_stays_bounded_under_unique_keys() {
        let store = MemoryStore::new();
        let fingerprint = Fingerprint::from_bytes([0; 32]);
        let lease = Duration::from_millis(1);
        let mut peak = 0;
        for i in 0..50_000 {
            store
                .claim(&scope(&format!("k{i}")), fingerprint, lease)
                .await
                .unwrap();
            if i % 1000 == 0 {
                peak = peak.max(store.len());
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        }
        peak = peak.max(store.len());
        // Every record expires within ~1000 claims: without eviction the store would hold
        // 50,000. With it, each shard holds at most about 2 * MIN_SWEEP_LEN.
        assert!(peak <= SHARDS * 2 * MIN_SWEEP_LEN, "peak {peak}");
        assert!(store.len() < 50_000);
    }

    #[tokio::test]
    async fn max_records_refuses_new_keys_but_keeps_old_ones() {
        let store = MemoryStore::new().max_records(SHARDS);
        let fingerprint = Fingerprint::from_bytes([0; 32]);
        let lease = Duration::from_secs(60);
        let mut refused = 0;
        for i in 0..200 {
            if store
                .claim(&scope(&format!("k{i}")), fingerprint, lease)
                .await
                .is_err()
            {
                refused += 1;
            }
        }
        assert!(store.len() <= SHARDS, "len {}", store.len());
        assert_eq!(refused, 200 - store.len());
    }

    /// A bound below the growth rule's first sweep: a full shard is swept for room, so
    /// expired records do not keep refusing new keys.
    #[tokio::test]
    async fn a_full_store_makes_room_as_its_records_expire() {
        let store = MemoryStore::new().max_records(SHARDS);
        let fingerprint = Fingerprint::from_bytes([0; 32]);
        claim_each(&store, "old", 400, Duration::from_millis(20)).await;
        assert_eq!(store.len(), SHARDS, "every shard full");
        tokio::time::sleep(Duration::from_millis(50)).await;
        for i in 0..200 {
            let claim = store
                .claim(
                    &scope(&format!("new{i}")),
                    fingerprint,
                    Duration::from_millis(1),
                )
                .await;
            assert!(claim.is_ok(), "new{i}: {claim:?}");
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }

    /// Full of live records, a shard is swept again only once an eighth of them may have
    /// expired, not on every claim it refuses.
    #[test]
    fn a_full_shard_is_swept_again_once_an_eighth_has_expired() {
        let now = Instant::now();
        let mut shard = Shard {
            records: Table::default(),
            sweep_at_len: MIN_SWEEP_LEN,
            full_sweep_at: None,
        };
        let shards = Shards::new(|| ());
        let fingerprint = Fingerprint::from_bytes([0; 32]);
        let keys: Vec<String> = (0..16).map(|i| format!("k{i}")).collect();
        for (i, key) in keys.iter().enumerate() {
            let token = ClaimToken::unique();
            let entry = Entry {
                record: Record::InProgress { fingerprint, token },
                token,
                expires_at: now + Duration::from_secs(10 + i as u64),
            };
            let hashed = shards.hash(key);
            shard
                .records
                .insert(hashed, || key.clone(), Box::new(entry));
        }
        assert!(!shard.make_room(now, 16), "nothing has expired");
        // Two of sixteen: the second to expire.
        assert_eq!(shard.full_sweep_at, Some(now + Duration::from_secs(11)));
        let first = shards.hash(&keys[0]);
        shard.records.get_mut(first).unwrap().expires_at = now;
        let later = now + Duration::from_secs(1);
        assert!(!shard.make_room(later, 16), "not swept before then");
        assert_eq!(shard.records.len(), 16);
        assert!(shard.make_room(now + Duration::from_secs(11), 16));
        assert_eq!(shard.records.len(), 14);
        // A record written since that expires sooner brings the next sweep forward.
        let at = now + Duration::from_secs(11);
        // One of the fourteen kept: the first to expire.
        assert_eq!(shard.full_sweep_at, Some(at + Duration::from_secs(1)));
        shard.expires(at + Duration::from_millis(1));
        assert_eq!(shard.full_sweep_at, Some(at + Duration::from_millis(1)));
    }

    /// Records of a short lease written into shards last swept for long-lived ones are
    /// swept for room as they expire, not when the long-lived ones would have.
    #[tokio::test]
    async fn a_full_store_sweeps_for_short_records_written_after_long_ones() {
        let store = MemoryStore::new().max_records(SHARDS);
        let fingerprint = Fingerprint::from_bytes([0; 32]);
        let week = Duration::from_secs(7 * 24 * 3600);
        let mut held = Vec::new();
        for i in 0..400 {
            let scope = scope(&format!("long{i}"));
            if let Ok(Claim::Claimed(token)) = store.claim(&scope, fingerprint, week).await {
                held.push((scope, token));
            }
        }
        assert_eq!(held.len(), SHARDS, "a week-long claim in every shard");
        // Refused in every shard, each swept and due again in a week.
        assert_eq!(claim_each(&store, "refused", 400, week).await, 0);
        let soon = Instant::now() + Duration::from_secs(3600);
        for shard in store.inner.shards.each() {
            assert!(shard.full_sweep_at.is_some_and(|at| at > soon));
        }
        // The week-long claims end; claims of 20 ms fill the shards again and expire.
        for (scope, token) in &held {
            let released = store.release(scope, *token).await.unwrap();
            assert_eq!(released, Fenced::Applied);
        }
        claim_each(&store, "short", 400, Duration::from_millis(20)).await;
        assert_eq!(store.len(), SHARDS);
        tokio::time::sleep(Duration::from_millis(50)).await;
        // Each shard takes one new key in place of its expired record.
        let taken = claim_each(&store, "new", 400, Duration::from_secs(60)).await;
        assert_eq!(taken, SHARDS);
    }

    /// Claims `count` keys, `prefix` and a number, each for `lease`: how many it took.
    async fn claim_each(store: &MemoryStore, prefix: &str, count: usize, lease: Duration) -> usize {
        let fingerprint = Fingerprint::from_bytes([0; 32]);
        let mut taken = 0;
        for i in 0..count {
            let scope = scope(&format!("{prefix}{i}"));
            taken += usize::from(store.claim(&scope, fingerprint, lease).await.is_ok());
        }
        taken
    }

    /// A lease or TTL of the longest duration, as a caller may pass for "for ever", is
    /// kept for ever, not a panic.
    #[tokio::test]
    async fn the_longest_durations_keep_a_record_for_ever_without_a_panic() {
        let store = MemoryStore::new();
        let (scope, fingerprint) = (scope("k"), Fingerprint::from_bytes([0; 32]));
        let claim = store.claim(&scope, fingerprint, Duration::MAX).await;
        let Ok(Claim::Claimed(token)) = claim else {
            panic!("{claim:?}");
        };
        let extended = store.extend(&scope, token, Duration::MAX).await;
        assert_eq!(extended.unwrap(), Fenced::Applied);
        let response = StoredResponse {
            status: http::StatusCode::CREATED,
            headers: Default::default(),
            body: "ok".into(),
            trailers: None,
        };
        let completed = store.complete(&scope, token, fingerprint, &response, Duration::MAX);
        assert_eq!(completed.await.unwrap(), Fenced::Applied);
        match store
            .claim(&scope, fingerprint, Duration::MAX)
            .await
            .unwrap()
        {
            Claim::Completed { expires_in, .. } => {
                assert!(expires_in > Some(Duration::from_secs(50 * 365 * 86_400)));
            }
            claim => panic!("{claim:?}"),
        }
    }
}
