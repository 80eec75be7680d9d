//! A local cache of completed records in front of a shared store.

use std::{
    collections::VecDeque,
    fmt,
    sync::{Arc, MutexGuard, OnceLock},
    time::{Duration, Instant},
};

use async_trait::async_trait;
use metrics::Counter;

use super::record::expiry;
use super::{
    shards::{Hashed, Shards, Table, SHARDS},
    Claim, Fenced, Result, Store, Watch,
};
use crate::{ClaimToken, Fingerprint, Scope, StoredResponse};

/// Serves replays from memory, without a round trip to the store behind it, once this
/// process has read the completed record from that store.
///
/// A completed record never changes until it expires, so a copy is as good as the original
/// for as long as the store keeps it: the cache keeps a record the store returned as
/// completed for the time the store says is left ([`Claim::Completed`]'s `expires_in`),
/// never in-progress ones nor one with no time left, and every other operation goes to
/// `inner`. Records are cached when read, not when completed: a first execution costs
/// nothing more than without the cache, the first retry reaching a process reads the shared
/// store, and every later one is served from memory, whichever process completed the
/// request. Bounded by `max_records`: past it,
/// the oldest cached records make room for new ones, and a record evicted early is simply
/// read from `inner` again; expired copies at the front of that order go as new ones come
/// in, so a cache larger than the live records holds little more than those. A cache of
/// `0` records keeps none: every operation goes to `inner`.
///
/// The store says how long is left: PostgreSQL by its own clock, Redis by the clock of the
/// process that completed the record (Redis reports no TTL with the claim). Where hosts'
/// clocks differ, a copy can outlive the record by that difference; a retry in that window
/// gets the replay, never a second execution.
///
/// A record deleted from the shared store by hand (to let a key execute again) is still
/// replayed by the processes that cached it, until its TTL.
///
/// A store that must see every replay reports no expiry with its records, and the cache
/// keeps none of them: in front of a
#[cfg_attr(
    feature = "postgres",
    doc = "[`PostgresStore::count_replays`](crate::PostgresStore::count_replays),"
)]
#[cfg_attr(not(feature = "postgres"), doc = "`PostgresStore::count_replays`,")]
/// every replay goes through to the store and is counted there.
///
/// # Example
///
/// ```no_run
/// use tower_idempotency::{store::CachedStore, IdempotencyLayer, RedisStore};
///
/// # async fn run() -> Result<(), tower_idempotency::store::RedisStoreError> {
/// let redis = RedisStore::open("redis://127.0.0.1:6379/").await?;
/// let layer = IdempotencyLayer::new(CachedStore::new(redis, 100_000));
/// # Ok(())
/// # }
/// ```
pub struct CachedStore<S: ?Sized> {
    inner: Arc<S>,
    shards: Shards<Shard>,
    max_per_shard: usize,
    /// `idempotency_cache_hits_total` and `_misses_total`, registered on first use.
    counters: OnceLock<CacheCounters>,
}

#[derive(Debug)]
struct CacheCounters {
    hits: Counter,
    misses: Counter,
}

#[derive(Default)]
struct Shard {
    records: Table<Arc<str>, Cached>,
    /// Keys in the order they were cached, oldest first, each with the number of its
    /// admission: a full shard evicts from the front. A mention whose key was cached again
    /// since, or dropped, is stale: it evicts nothing, goes when it reaches the front, and
    /// the order is compacted once stale mentions outnumber the copies.
    order: VecDeque<(Arc<str>, u64)>,
    /// How many copies the shard has admitted: the next one's number.
    admitted: u64,
}

struct Cached {
    fingerprint: Fingerprint,
    response: StoredResponse,
    expires_at: Instant,
    /// The number of its admission, which its one current mention in the order carries.
    admission: u64,
}

/// A shard's order is compacted once it holds twice as many mentions as the shard holds
/// copies, and this many more: compaction then costs O(1) amortized per admission.
const MIN_COMPACTION: usize = 16;

/// The copy `mention` names, if it is its key's current mention.
fn named<'r, T>(
    shards: &Shards<T>,
    records: &'r Table<Arc<str>, Cached>,
    (key, admission): &(Arc<str>, u64),
) -> Option<&'r Cached> {
    let cached = records.get(shards.hash(key))?;
    (cached.admission == *admission).then_some(cached)
}

impl<S: Store> CachedStore<S> {
    /// Caches up to about `max_records` completed records in front of `inner`.
    pub fn new(inner: S, max_records: usize) -> Self {
        Self::from_shared(Arc::new(inner), max_records)
    }
}

impl<S: Store + ?Sized> CachedStore<S> {
    /// Caches up to about `max_records` completed records in front of a store shared with
    /// others (or chosen at run time: `CachedStore<dyn Store>`).
    ///
    /// # Example
    ///
    /// ```
    /// use std::sync::Arc;
    /// use tower_idempotency::{store::CachedStore, MemoryStore, Store};
    ///
    /// let chosen: Arc<dyn Store> = Arc::new(MemoryStore::new());
    /// let cached: CachedStore<dyn Store> = CachedStore::from_shared(chosen, 10_000);
    /// ```
    pub fn from_shared(inner: Arc<S>, max_records: usize) -> Self {
        Self {
            inner,
            shards: Shards::new(Shard::default),
            max_per_shard: max_records.div_ceil(SHARDS),
            counters: OnceLock::new(),
        }
    }

    fn counters(&self) -> &CacheCounters {
        self.counters.get_or_init(|| CacheCounters {
            hits: metrics::counter!("idempotency_cache_hits_total"),
            misses: metrics::counter!("idempotency_cache_misses_total"),
        })
    }

    /// The store behind the cache.
    pub fn inner(&self) -> &S {
        &self.inner
    }

    fn shard(&self, key: Hashed<'_>) -> MutexGuard<'_, Shard> {
        self.shards.lock(key)
    }

    /// Keeps a copy of a completed record for as long as the store behind keeps it.
    fn admit(
        &self,
        key: Hashed<'_>,
        fingerprint: Fingerprint,
        response: &StoredResponse,
        expires_in: Duration,
    ) {
        // A copy with no time left is dropped by the next claim of its key, which reads
        // the store again: kept, it would only take a place in the order each time.
        if self.max_per_shard == 0 || expires_in.is_zero() {
            return;
        }
        let mut shard = self.shard(key);
        let now = Instant::now();
        // A copy of the key cached meanwhile (two claims missed at once) makes way for
        // this one: its mention goes stale, and the key is in the order once.
        shard.records.remove(key);
        // Expired copies at the front go first, and stale mentions: records mostly share
        // a TTL, so the oldest cached expire first.
        while let Some(oldest) = shard.order.front().cloned() {
            match named(&self.shards, &shard.records, &oldest).map(|c| c.expires_at > now) {
                Some(true) => break,
                Some(false) => {
                    shard.records.remove(self.shards.hash(&oldest.0));
                }
                None => {}
            }
            shard.order.pop_front();
        }
        // Every copy has its mention in the order: a full shard evicts the oldest copies,
        // and a stale mention on the way evicts nothing.
        while shard.records.len() >= self.max_per_shard {
            let Some(oldest) = shard.order.pop_front() else {
                break;
            };
            if named(&self.shards, &shard.records, &oldest).is_some() {
                shard.records.remove(self.shards.hash(&oldest.0));
            }
        }
        let admission = shard.admitted;
        shard.admitted += 1;
        let owned: Arc<str> = Arc::from(key.key());
        shard.order.push_back((owned.clone(), admission));
        let cached = Cached {
            fingerprint,
            response: response.clone(),
            expires_at: expiry(now, expires_in),
            admission,
        };
        shard.records.insert(key, || owned, cached);
        // Stale mentions behind a live copy at the front (a key cached again, or a copy
        // its claim found expired) go once they outnumber the copies.
        if shard.order.len() >= 2 * shard.records.len() + MIN_COMPACTION {
            let Shard { records, order, .. } = &mut *shard;
            order.retain(|mention| named(&self.shards, records, mention).is_some());
        }
    }
}

impl<S: ?Sized> CachedStore<S> {
    /// How many copies the cache holds, expired ones not yet dropped included.
    pub fn len(&self) -> usize {
        self.shards.each().map(|shard| shard.records.len()).sum()
    }

    /// Whether the cache holds no copy.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Settings and a count, never records: a record's scope names a principal and its key, and
/// its body may be anyone's.
impl<S: fmt::Debug + ?Sized> fmt::Debug for CachedStore<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CachedStore")
            .field("inner", &self.inner)
            .field("max_records", &(self.max_per_shard * SHARDS))
            .field("cached", &self.len())
            .finish()
    }
}

#[async_trait]
impl<S: Store + ?Sized> Store for CachedStore<S> {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    async fn claim_with_token(
        &self,
        scope: &Scope,
        fingerprint: Fingerprint,
        token: ClaimToken,
        lease: Duration,
    ) -> Result<Claim> {
        let key = self.shards.hash(scope.storage_key());
        {
            let mut shard = self.shard(key);
            let now = Instant::now();
            match shard.records.get(key) {
                Some(cached) if cached.expires_at > now => {
                    self.counters().hits.increment(1);
                    return Ok(Claim::Completed {
                        fingerprint: cached.fingerprint,
                        response: cached.response.replayable_copy(),
                        expires_in: Some(cached.expires_at - now),
                    });
                }
                Some(_) => {
                    shard.records.remove(key);
                }
                None => {}
            }
        }
        self.counters().misses.increment(1);
        let claim = self
            .inner
            .claim_with_token(scope, fingerprint, token, lease)
            .await?;
        if let Claim::Completed {
            fingerprint,
            response,
            expires_in: Some(expires_in),
        } = &claim
        {
            self.admit(key, *fingerprint, response, *expires_in);
        }
        Ok(claim)
    }

    async fn complete(
        &self,
        scope: &Scope,
        token: ClaimToken,
        fingerprint: Fingerprint,
        response: &StoredResponse,
        ttl: Duration,
    ) -> Result<Fenced> {
        self.inner
            .complete(scope, token, fingerprint, response, ttl)
            .await
    }

    async fn release(&self, scope: &Scope, token: ClaimToken) -> Result<Fenced> {
        self.inner.release(scope, token).await
    }

    async fn extend(&self, scope: &Scope, token: ClaimToken, lease: Duration) -> Result<Fenced> {
        self.inner.extend(scope, token, lease).await
    }

    async fn watch(&self, scope: &Scope) -> Result<Option<Watch>> {
        self.inner.watch(scope).await
    }

    fn hand_over(&self, token: ClaimToken, extensions: &mut http::Extensions) {
        self.inner.hand_over(token, extensions)
    }

    fn abandon(&self, scope: &Scope, token: ClaimToken) {
        self.inner.abandon(scope, token);
    }

    fn commits_handler_writes(&self) -> bool {
        self.inner.commits_handler_writes()
    }
}

#[cfg(all(test, feature = "memory"))]
mod tests {
    use http::{HeaderValue, StatusCode};

    use super::*;
    use crate::{IdempotencyKey, MemoryStore};

    fn scope(key: &str) -> Scope {
        let key = IdempotencyKey::parse(&HeaderValue::from_str(key).unwrap()).unwrap();
        Scope::new(Some("user_7342".into()), "POST /pay".into(), key)
    }

    /// Completes `key` in the store behind, then claims it through the cache: the claim
    /// reads the completed record, which the cache keeps.
    async fn replay_through(cache: &CachedStore<MemoryStore>, key: &str, ttl: Duration) {
        let scope = scope(key);
        let fingerprint = Fingerprint::from_bytes([1; 32]);
        let lease = Duration::from_secs(5);
        let Claim::Claimed(token) = cache.claim(&scope, fingerprint, lease).await.unwrap() else {
            panic!("a fresh key");
        };
        let response = StoredResponse {
            status: StatusCode::CREATED,
            headers: Default::default(),
            body: "card=4242424242424242".into(),
            trailers: None,
        };
        let completed = cache.complete(&scope, token, fingerprint, &response, ttl);
        assert_eq!(completed.await.unwrap(), Fenced::Applied);
        let replay = cache.claim(&scope, fingerprint, lease).await.unwrap();
        assert!(matches!(replay, Claim::Completed { .. }), "{replay:?}");
    }

    #[tokio::test]
    async fn a_cache_of_zero_records_keeps_none() {
        let cache = CachedStore::new(MemoryStore::new(), 0);
        replay_through(&cache, "k", Duration::from_secs(60)).await;
        assert!(cache.is_empty());
    }

    /// A cache far larger than its live records drops expired copies as new ones come in,
    /// instead of keeping every record ever replayed.
    #[tokio::test]
    async fn expired_copies_go_as_new_ones_come() {
        let cache = CachedStore::new(MemoryStore::new(), usize::MAX);
        for round in 0..5 {
            for i in 0..200 {
                let key = format!("k{round}-{i}");
                replay_through(&cache, &key, Duration::from_millis(20)).await;
            }
            tokio::time::sleep(Duration::from_millis(40)).await;
        }
        // Each shard keeps at most the one expired copy at its front that the next
        // admission would drop, besides the last round's.
        assert!(cache.len() <= 200 + SHARDS, "{} copies kept", cache.len());
    }

    /// A store that finds every key completed, with as much time left as it is set to.
    #[derive(Debug)]
    struct AlwaysCompleted(std::sync::Mutex<Duration>);

    impl AlwaysCompleted {
        fn with_time_left(left: Duration) -> Self {
            Self(std::sync::Mutex::new(left))
        }
    }

    #[async_trait]
    impl Store for AlwaysCompleted {
        async fn claim_with_token(
            &self,
            _: &Scope,
            _: Fingerprint,
            _: ClaimToken,
            _: Duration,
        ) -> Result<Claim> {
            Ok(Claim::Completed {
                fingerprint: Fingerprint::from_bytes([1; 32]),
                response: StoredResponse {
                    status: StatusCode::CREATED,
                    headers: Default::default(),
                    body: "ok".into(),
                    trailers: None,
                },
                expires_in: Some(*self.0.lock().unwrap()),
            })
        }
        async fn complete(
            &self,
            _: &Scope,
            _: ClaimToken,
            _: Fingerprint,
            _: &StoredResponse,
            _: Duration,
        ) -> Result<Fenced> {
            Ok(Fenced::Lost)
        }
        async fn release(&self, _: &Scope, _: ClaimToken) -> Result<Fenced> {
            Ok(Fenced::Lost)
        }
        async fn extend(&self, _: &Scope, _: ClaimToken, _: Duration) -> Result<Fenced> {
            Ok(Fenced::Lost)
        }
    }

    /// A store may say it keeps a record for ever with the longest duration: the cache
    /// keeps its copy as long, without a panic.
    #[tokio::test]
    async fn a_record_kept_for_ever_is_cached_without_a_panic() {
        let cache = CachedStore::new(AlwaysCompleted::with_time_left(Duration::MAX), 1000);
        let (scope, fingerprint) = (scope("k"), Fingerprint::from_bytes([1; 32]));
        for _ in 0..2 {
            let claim = cache.claim(&scope, fingerprint, Duration::from_secs(5));
            let Claim::Completed { expires_in, .. } = claim.await.unwrap() else {
                panic!("a completed record");
            };
            assert!(expires_in > Some(Duration::from_secs(50 * 365 * 86_400)));
        }
        assert_eq!(cache.len(), 1);
    }

    /// How many mentions the shards' orders hold.
    fn mentions<S: ?Sized>(cache: &CachedStore<S>) -> usize {
        cache.shards.each().map(|shard| shard.order.len()).sum()
    }

    /// Redis reports a completed record's time left by the completer's clock: where it
    /// runs behind the reader's, a live record reads as having none left. Replayed again
    /// and again behind live copies at the front of every shard's order, such a record
    /// is not cached, nor mentioned in the order once per replay.
    #[tokio::test]
    async fn replays_of_a_record_with_no_time_left_keep_the_order_within_the_copies() {
        let inner = AlwaysCompleted::with_time_left(Duration::from_secs(3600));
        let cache = CachedStore::new(inner, usize::MAX);
        let fingerprint = Fingerprint::from_bytes([1; 32]);
        let lease = Duration::from_secs(5);
        for i in 0..1000 {
            let long = scope(&format!("long{i}"));
            cache.claim(&long, fingerprint, lease).await.unwrap();
        }
        *cache.inner().0.lock().unwrap() = Duration::ZERO;
        let skewed = scope("skewed");
        for _ in 0..100_000 {
            cache.claim(&skewed, fingerprint, lease).await.unwrap();
        }
        assert_eq!(mentions(&cache), 1000, "one mention a copy");
        assert_eq!(cache.len(), 1000);
    }

    /// A key cached again, whether its copy expired behind live ones or two claims missed
    /// at once, is current in the order once: its older mentions evict nothing, and go
    /// before they outnumber the copies.
    #[tokio::test]
    async fn a_key_cached_again_and_again_keeps_the_order_within_the_copies() {
        let inner = AlwaysCompleted::with_time_left(Duration::from_secs(3600));
        // Room for every copy: about 63 a shard, a few more in some.
        let cache = CachedStore::new(inner, 200 * SHARDS);
        let fingerprint = Fingerprint::from_bytes([1; 32]);
        let lease = Duration::from_secs(5);
        for i in 0..1000 {
            let long = scope(&format!("long{i}"));
            cache.claim(&long, fingerprint, lease).await.unwrap();
        }
        // Each claim finds the last copy expired, reads the store and caches it again.
        *cache.inner().0.lock().unwrap() = Duration::from_nanos(1);
        let again = scope("again");
        for _ in 0..20_000 {
            cache.claim(&again, fingerprint, lease).await.unwrap();
        }
        // Two claims of one key that both missed cache it twice.
        let key = cache.shards.hash(again.storage_key());
        let response = StoredResponse {
            status: StatusCode::CREATED,
            headers: Default::default(),
            body: "ok".into(),
            trailers: None,
        };
        for _ in 0..20_000 {
            cache.admit(key, fingerprint, &response, Duration::from_secs(3600));
        }
        assert_eq!(cache.len(), 1001, "no live copy evicted early");
        let bound = 2 * cache.len() + SHARDS * MIN_COMPACTION;
        assert!(mentions(&cache) <= bound, "{} mentions", mentions(&cache));
    }

    /// The cache's debug output (which the layer's includes) shows settings and a count,
    /// never a cached record's key, principal or body.
    #[tokio::test]
    async fn debug_shows_no_record() {
        let cache = CachedStore::new(MemoryStore::new(), 1000);
        replay_through(&cache, "order-42-secret", Duration::from_secs(60)).await;
        let shown = format!("{cache:?}");
        assert!(shown.contains("cached: 1"), "{shown}");
        for secret in ["order-42-secret", "user_7342", "4242424242424242"] {
            assert!(!shown.contains(secret), "{shown}");
        }
    }
}
