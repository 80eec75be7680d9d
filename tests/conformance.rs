//! The store conformance suite (`tower_idempotency::conformance`), one test per case,
//! against every built-in store on real servers. (The key-value store that the `Store`
//! documentation shows runs every case in its doctest.)

mod support;

tower_idempotency::store_conformance_tests!(memory, async {
    tower_idempotency::MemoryStore::new()
});
tower_idempotency::store_conformance_tests!(
    #[ignore = "needs Redis: scripts/test.sh"]
    redis,
    async {
        crate::support::redis_store("conformance")
            .await
            .announce_outcomes()
    }
);
tower_idempotency::store_conformance_tests!(
    #[ignore = "needs a Redis Cluster and a Sentinel set: scripts/test.sh"]
    redis_cluster,
    async {
        crate::support::cluster_store("conformance")
            .await
            .announce_outcomes()
    }
);
tower_idempotency::store_conformance_tests!(
    #[ignore = "needs a Redis Cluster and a Sentinel set: scripts/test.sh"]
    redis_sentinel,
    async {
        crate::support::sentinel_store("conformance")
            .await
            .announce_outcomes()
    }
);
tower_idempotency::store_conformance_tests!(
    #[ignore = "needs PostgreSQL: scripts/test.sh"]
    postgres,
    async { crate::support::postgres_store().await.announce_outcomes() }
);
tower_idempotency::store_conformance_tests!(
    #[ignore = "needs PostgreSQL: scripts/test.sh"]
    postgres_counting_replays,
    async {
        crate::support::postgres_store()
            .await
            .announce_outcomes()
            .count_replays()
    }
);
tower_idempotency::store_conformance_tests!(
    #[ignore = "needs PostgreSQL: scripts/test.sh"]
    cached_postgres_counting_replays,
    async {
        let postgres = crate::support::postgres_store()
            .await
            .announce_outcomes()
            .count_replays();
        tower_idempotency::store::CachedStore::new(postgres, 1000)
    }
);
tower_idempotency::store_conformance_tests!(
    #[ignore = "needs Redis: scripts/test.sh"]
    cached_redis,
    async {
        let redis = crate::support::redis_store("conformance")
            .await
            .announce_outcomes();
        tower_idempotency::store::CachedStore::new(redis, 1000)
    }
);
