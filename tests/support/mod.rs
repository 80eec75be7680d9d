//! Shared by the integration tests: stores to run against, and a throwaway Redis server.
#![allow(dead_code)]

pub mod redis_server;

use std::sync::Arc;

use tower_idempotency::{RedisStore, Store};

/// The shared Redis the suite runs against: `REDIS_URL`, else the local default.
pub fn redis_url() -> String {
    std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379/".to_owned())
}

/// A key prefix no other test (or run) uses.
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
