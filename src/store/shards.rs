//! Maps split into locked shards by key, so that requests on different keys rarely wait
//! on one lock.

use std::{
    collections::hash_map::RandomState,
    hash::BuildHasher,
    sync::{Mutex, MutexGuard},
};

/// How many shards a map (and a bound on it) is split across.
pub(crate) const SHARDS: usize = 16;

/// `SHARDS` values of `T`, each behind its own lock, chosen by a key's hash.
#[derive(Debug)]
pub(crate) struct Shards<T> {
    shards: Vec<Mutex<T>>,
    hasher: RandomState,
}

impl<T> Shards<T> {
    pub(crate) fn new(shard: impl Fn() -> T) -> Self {
        Self {
            shards: (0..SHARDS).map(|_| Mutex::new(shard())).collect(),
            hasher: RandomState::new(),
        }
    }

    /// The shard holding `key`, locked.
    pub(crate) fn lock(&self, key: &str) -> MutexGuard<'_, T> {
        let index = self.hasher.hash_one(key) as usize % SHARDS;
        lock(&self.shards[index])
    }

    /// Every shard, locked one after the other.
    #[cfg(feature = "memory")]
    pub(crate) fn each(&self) -> impl Iterator<Item = MutexGuard<'_, T>> {
        self.shards.iter().map(lock)
    }
}

fn lock<T>(shard: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every critical section is one map operation: a panic elsewhere cannot leave a shard
    // half-written, so keep serving rather than poison every later request.
    shard
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}
