//! Shared by the integration tests: stores to run against, and a throwaway Redis server.
#![allow(dead_code)]

pub mod app;
#[cfg(feature = "reqwest")]
pub mod client;
pub mod freezing_proxy;
#[cfg(feature = "tonic")]
pub mod grpc;
pub mod logs;
pub mod lossy_proxy;
pub mod payments;
pub mod raw_http;
pub mod redis_server;
pub mod redis_topology;
pub mod wrapped_store;

/// The message of the panic with which `configure` refuses a setting; a panic of this
/// test's own when `configure` takes it.
pub fn refusal<T>(what: &str, configure: impl FnOnce() -> T) -> String {
    let refused = std::panic::catch_unwind(std::panic::AssertUnwindSafe(configure));
    let Err(refused) = refused else {
        panic!("{what} taken");
    };
    let text = refused.downcast_ref::<&str>().map(|text| text.to_string());
    text.or_else(|| refused.downcast_ref::<String>().cloned())
        .expect("a panic with a message")
}

/// Runs each listed `async fn case(store: Arc<dyn Store>)` on a `MemoryStore`, as
/// `memory::case`, and on the shared Redis (own key prefix), as `redis::case`: for cases
/// about the layer rather than the store. The cases on a server are ignored, with the
/// reason naming the command that runs them.
#[allow(unused_macros)] // Not every test file runs cases per store.
macro_rules! on_memory_and_redis {
    ($($case:ident),* $(,)?) => {
        mod memory {
            $(#[tokio::test]
            async fn $case() {
                super::$case(std::sync::Arc::new(tower_idempotency::MemoryStore::new())).await
            })*
        }
        mod redis {
            $(#[tokio::test]
            #[ignore = "needs Redis: scripts/test.sh"]
            async fn $case() {
                super::$case(crate::support::shared_redis_store(stringify!($case)).await).await
            })*
        }
    };
}

/// Runs each listed `async fn case(store: Arc<dyn Store>)` once per store, as
/// `memory::case`, `redis::case` (shared Redis, own key prefix), `redis_cluster::case` and
/// `redis_sentinel::case` (the shared cluster and Sentinel set, own key prefix),
/// `postgres::case` (shared PostgreSQL, own table), `postgres_transactional::case` and
/// `sqlx_transactional::case` (the transactional mode on each driver, own table) and
/// `cached_redis::case` (a local cache of completed records in front of Redis).
///
/// Cases listed after `not_transactional:` skip the transactional stores: each says why
/// in its own docs (a lease taken over, a running original's fingerprint), and the
/// transactional suite shows what the mode does instead.
///
/// Every store but the `MemoryStore` needs a server: its cases are ignored, with the
/// reason naming the command that runs them.
#[allow(unused_macros)] // Not every test file runs cases per store.
macro_rules! for_each_store {
    ($($case:ident),* $(,)?) => {
        for_each_store!($($case),*; not_transactional:);
    };
    ($($case:ident),* $(,)?; not_transactional: $($untransacted:ident),* $(,)?) => {
        on_memory_and_redis!($($case,)* $($untransacted),*);
        mod postgres {
            $(#[tokio::test]
            #[ignore = "needs PostgreSQL: scripts/test.sh"]
            async fn $case() {
                super::$case(crate::support::shared_postgres_store().await).await
            })*
            $(#[tokio::test]
            #[ignore = "needs PostgreSQL: scripts/test.sh"]
            async fn $untransacted() {
                super::$untransacted(crate::support::shared_postgres_store().await).await
            })*
        }
        mod postgres_transactional {
            $(#[tokio::test]
            #[ignore = "needs PostgreSQL: scripts/test.sh"]
            async fn $case() {
                let store = crate::support::Driver::TokioPostgres.store().await;
                super::$case(store).await
            })*
        }
        #[cfg(feature = "sqlx")]
        mod sqlx_transactional {
            $(#[tokio::test]
            #[ignore = "needs PostgreSQL: scripts/test.sh"]
            async fn $case() {
                super::$case(crate::support::Driver::Sqlx.store().await).await
            })*
        }
        for_each_store!(@redis redis_cluster cluster_store $($case,)* $($untransacted),*);
        for_each_store!(@redis redis_sentinel sentinel_store $($case,)* $($untransacted),*);
        mod cached_redis {
            $(#[tokio::test]
            #[ignore = "needs Redis: scripts/test.sh"]
            async fn $case() {
                let redis = crate::support::redis_store(stringify!($case)).await;
                let cached = tower_idempotency::store::CachedStore::new(redis, 1000);
                super::$case(std::sync::Arc::new(cached)).await
            })*
            $(#[tokio::test]
            #[ignore = "needs Redis: scripts/test.sh"]
            async fn $untransacted() {
                let redis = crate::support::redis_store(stringify!($untransacted)).await;
                let cached = tower_idempotency::store::CachedStore::new(redis, 1000);
                super::$untransacted(std::sync::Arc::new(cached)).await
            })*
        }
    };
    (@redis $module:ident $store:ident $($case:ident),* $(,)?) => {
        mod $module {
            $(#[tokio::test]
            #[ignore = "needs a Redis Cluster and a Sentinel set: scripts/test.sh"]
            async fn $case() {
                super::$case(std::sync::Arc::new(crate::support::$store(stringify!($case)).await)).await
            })*
        }
    };
}

use std::sync::Arc;

use tower_idempotency::{RedisStore, Store};

/// The shared Redis the suite runs against: `REDIS_URL`, else the local default.
pub fn redis_url() -> String {
    std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379/".to_owned())
}

/// A key prefix no other test (or run) uses, under `test:`: the test script removes every
/// `test:*` key at the end of a run.
pub fn unique_prefix(test: &str) -> String {
    format!("test:{test}:{:016x}:", rand::random::<u64>())
}

/// A Redis store on the shared server, isolated by a unique prefix.
pub async fn redis_store(test: &str) -> RedisStore {
    RedisStore::open(&redis_url())
        .await
        .unwrap_or_else(|e| panic!("Redis at {} (set REDIS_URL): {e}", redis_url()))
        .prefix(unique_prefix(test))
}

/// The same store behind the trait object the layer shares.
pub async fn shared_redis_store(test: &str) -> Arc<dyn Store> {
    Arc::new(redis_store(test).await)
}

/// The comma-separated URLs in environment variable `name`, which the test script sets.
pub fn urls_from(name: &str) -> Vec<String> {
    let urls = std::env::var(name).unwrap_or_else(|_| {
        panic!("{name} is not set: run the suite with scripts/test.sh, which starts the topology")
    });
    urls.split(',').map(str::to_owned).collect()
}

/// A store on the shared Redis Cluster (`REDIS_CLUSTER_URLS`), isolated by a unique prefix.
pub async fn cluster_store(test: &str) -> RedisStore {
    let urls = urls_from("REDIS_CLUSTER_URLS");
    RedisStore::cluster(urls.clone())
        .await
        .unwrap_or_else(|e| panic!("Redis Cluster at {urls:?}: {e}"))
        .prefix(unique_prefix(test))
}

/// A store on the primary of the shared Sentinel set (`REDIS_SENTINEL_URLS`,
/// `REDIS_SENTINEL_MASTER`), isolated by a unique prefix.
pub async fn sentinel_store(test: &str) -> RedisStore {
    let urls = urls_from("REDIS_SENTINEL_URLS");
    let master = std::env::var("REDIS_SENTINEL_MASTER").expect("REDIS_SENTINEL_MASTER");
    RedisStore::sentinel(urls.clone(), &master)
        .await
        .unwrap_or_else(|e| panic!("Sentinel at {urls:?}: {e}"))
        .prefix(unique_prefix(test))
}

/// The shared PostgreSQL the suite runs against: `DATABASE_URL`, else the local default.
#[cfg(feature = "postgres")]
pub fn database_url() -> String {
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned())
}

/// The schema holding every test table; the test script drops it before and after a run.
#[cfg(feature = "postgres")]
pub const TEST_SCHEMA: &str = "idempotency_tests";

/// A PostgreSQL store on a table of its own, migrated.
#[cfg(feature = "postgres")]
pub async fn postgres_store() -> tower_idempotency::PostgresStore {
    let url = database_url();
    let store = tower_idempotency::PostgresStore::connect(&url)
        .await
        .unwrap_or_else(|e| panic!("PostgreSQL at {url} (set DATABASE_URL): {e}"));
    on_own_table(store).await
}

/// `store` on a table of its own in the test schema, migrated.
#[cfg(feature = "postgres")]
pub async fn on_own_table(
    store: tower_idempotency::PostgresStore,
) -> tower_idempotency::PostgresStore {
    let client = store_client(&database_url()).await;
    // Parallel tests race to create the schema: one wins, the others see it exist.
    for _ in 0..5 {
        let created = client
            .batch_execute(&format!("CREATE SCHEMA IF NOT EXISTS {TEST_SCHEMA}"))
            .await;
        if created.is_ok() {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let table = format!("t_{:016x}", rand::random::<u64>());
    let store = store.table(TEST_SCHEMA, &table).expect("valid table name");
    store.migrate().await.expect("migrate");
    store
}

/// A plain client, for tests that look at the table itself.
#[cfg(feature = "postgres")]
pub async fn store_client(url: &str) -> tokio_postgres::Client {
    let (client, connection) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .unwrap_or_else(|e| panic!("PostgreSQL at {url}: {e}"));
    tokio::spawn(connection);
    client
}

/// The same store behind the trait object the layer shares.
#[cfg(feature = "postgres")]
pub async fn shared_postgres_store() -> Arc<dyn Store> {
    Arc::new(postgres_store().await)
}

/// Which driver a transactional store's executions run their transactions on.
#[cfg(feature = "postgres")]
#[derive(Clone, Copy, Debug)]
pub enum Driver {
    /// The store's own tokio-postgres pool.
    TokioPostgres,
    /// An sqlx pool of the same database.
    #[cfg(feature = "sqlx")]
    Sqlx,
}

#[cfg(feature = "postgres")]
impl Driver {
    /// A transactional PostgreSQL store on this driver, on a table of its own, migrated.
    pub async fn transactional(self) -> tower_idempotency::PostgresStore {
        transactional(self).await
    }

    /// [`Driver::transactional`], behind the trait object the layer shares.
    pub async fn store(self) -> Arc<dyn Store> {
        Arc::new(transactional(self).await)
    }
}

/// A transactional PostgreSQL store on a table of its own, migrated.
#[cfg(feature = "postgres")]
pub async fn transactional(driver: Driver) -> tower_idempotency::PostgresStore {
    let store = postgres_store().await;
    match driver {
        Driver::TokioPostgres => store.transactional(),
        #[cfg(feature = "sqlx")]
        Driver::Sqlx => {
            let pool = tower_idempotency::sqlx::postgres::PgPoolOptions::new()
                .max_connections(16)
                .connect(&database_url())
                .await
                .expect("an sqlx pool");
            store.transactional_sqlx(pool)
        }
    }
}
