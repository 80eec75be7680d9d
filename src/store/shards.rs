//! Maps split into locked shards by key, so that requests on different keys rarely wait
//! on one lock. A key is hashed once, for its shard and for its place in the shard's table.

use std::{
    borrow::Borrow,
    collections::hash_map::RandomState,
    hash::BuildHasher,
    sync::{Mutex, MutexGuard},
};

use hashbrown::{hash_table, HashTable};

/// How many shards a map (and a bound on it) is split across.
pub(crate) const SHARDS: usize = 16;

/// A key and its hash, computed once per request by [`Shards::hash`].
#[derive(Clone, Copy, Debug)]
pub(crate) struct Hashed<'k> {
    key: &'k str,
    hash: u64,
}

impl<'k> Hashed<'k> {
    pub(crate) fn key(&self) -> &'k str {
        self.key
    }

    /// Whether a slot holds this key (the table has already matched its hash).
    fn holds<K: Borrow<str>, V>(self) -> impl Fn(&Slot<K, V>) -> bool + 'k {
        move |slot| slot.key.borrow() == self.key
    }
}

/// `SHARDS` values of `T`, each behind its own lock, chosen by a key's hash.
#[derive(Debug)]
pub(crate) struct Shards<T> {
    shards: Vec<Mutex<T>>,
    /// Keyed at random per process: clients choose the keys, and must not be able to pick
    /// ones that collide.
    hasher: RandomState,
}

impl<T> Shards<T> {
    pub(crate) fn new(shard: impl Fn() -> T) -> Self {
        Self {
            shards: (0..SHARDS).map(|_| Mutex::new(shard())).collect(),
            hasher: RandomState::new(),
        }
    }

    /// `key` with its hash, for [`lock`](Self::lock) and the shard's [`Table`].
    pub(crate) fn hash<'k>(&self, key: &'k str) -> Hashed<'k> {
        Hashed {
            key,
            hash: self.hasher.hash_one(key),
        }
    }

    /// The shard holding `key`, locked.
    pub(crate) fn lock(&self, key: Hashed<'_>) -> MutexGuard<'_, T> {
        // Bits a shard's table leaves alone: it finds buckets by the low bits and tags them
        // with the top seven, so every shard's keys still spread over all of its buckets.
        let index = (key.hash >> 48) as usize % SHARDS;
        lock(&self.shards[index])
    }

    /// Every shard, locked one after the other.
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

/// One shard's map from keys to values, looked up by the hash the key was sharded with.
#[derive(Debug)]
pub(crate) struct Table<K, V> {
    slots: HashTable<Slot<K, V>>,
}

#[derive(Debug)]
struct Slot<K, V> {
    /// Kept so that growing the table does not hash every key again.
    hash: u64,
    key: K,
    value: V,
}

impl<K, V> Default for Table<K, V> {
    fn default() -> Self {
        Self {
            slots: HashTable::new(),
        }
    }
}

impl<K: Borrow<str>, V> Table<K, V> {
    pub(crate) fn len(&self) -> usize {
        self.slots.len()
    }

    pub(crate) fn get(&self, key: Hashed<'_>) -> Option<&V> {
        let slot = self.slots.find(key.hash, key.holds())?;
        Some(&slot.value)
    }

    #[cfg(feature = "memory")]
    pub(crate) fn get_mut(&mut self, key: Hashed<'_>) -> Option<&mut V> {
        let slot = self.slots.find_mut(key.hash, key.holds())?;
        Some(&mut slot.value)
    }

    /// Sets `key`'s value; `owned` makes the stored key, only when the key is new.
    pub(crate) fn insert(&mut self, key: Hashed<'_>, owned: impl FnOnce() -> K, value: V) {
        let entry = self.slots.entry(key.hash, key.holds(), |slot| slot.hash);
        match entry {
            hash_table::Entry::Occupied(mut occupied) => occupied.get_mut().value = value,
            hash_table::Entry::Vacant(vacant) => {
                vacant.insert(Slot {
                    hash: key.hash,
                    key: owned(),
                    value,
                });
            }
        }
    }

    pub(crate) fn remove(&mut self, key: Hashed<'_>) -> Option<V> {
        let found = self.slots.find_entry(key.hash, key.holds()).ok()?;
        Some(found.remove().0.value)
    }

    #[cfg(any(test, feature = "memory"))]
    /// Keeps only the values `keep` returns true for.
    pub(crate) fn retain(&mut self, mut keep: impl FnMut(&V) -> bool) {
        self.slots.retain(|slot| keep(&slot.value));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_table_finds_what_it_holds_by_key_and_hash() {
        let shards = Shards::new(Table::<String, u32>::default);
        let keys: Vec<String> = (0..1000).map(|i| format!("key {i}")).collect();
        for (i, key) in keys.iter().enumerate() {
            let hashed = shards.hash(key);
            shards.lock(hashed).insert(hashed, || key.clone(), i as u32);
        }
        let held: usize = shards.each().map(|shard| shard.len()).sum();
        assert_eq!(held, 1000);
        // Every shard gets some keys: the shard bits are not constant.
        assert!(shards.each().all(|shard| shard.len() > 20));
        for (i, key) in keys.iter().enumerate() {
            let hashed = shards.hash(key);
            assert_eq!(shards.lock(hashed).get(hashed), Some(&(i as u32)));
        }
        let first = shards.hash(&keys[0]);
        shards
            .lock(first)
            .insert(first, || unreachable!("the key is held"), 7);
        assert_eq!(shards.lock(first).get(first), Some(&7));
        assert_eq!(shards.lock(first).remove(first), Some(7));
        assert_eq!(shards.lock(first).get(first), None);
        assert_eq!(shards.lock(first).remove(first), None);
        let absent = shards.hash("absent");
        assert_eq!(shards.lock(absent).get(absent), None);
        for mut shard in shards.each() {
            shard.retain(|value| value % 2 == 0);
        }
        // The even values of keys 1 to 999: key 0 was removed.
        let held: usize = shards.each().map(|shard| shard.len()).sum();
        assert_eq!(held, 499);
    }
}
