//! Announcements of changed records, for requests waiting on a key in progress.

// Each store uses its own part of the board: a build without all three leaves some unused
// (a build with all of them, as clippy runs, still finds dead code).
#![cfg_attr(
    not(all(feature = "memory", feature = "redis", feature = "postgres")),
    allow(dead_code)
)]

use std::{
    collections::HashMap,
    fmt,
    future::Future,
    sync::{
        atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering},
        Arc, Mutex,
    },
    time::Duration,
};

use tokio::sync::Notify;

use super::{Claim, Error, Result};
use crate::{ClaimToken, Fingerprint};

/// An in-process board on which a store announces that a key's record changed (completed
/// or released), and from which waiters take a [`Watch`] on one key. A store with
/// notifications of its own relays each one here.
///
/// What a store of one's own needs is [`new`](Self::new), [`watch`](Self::watch) (in
/// [`Store::watch`](crate::Store::watch)) and [`announce`](Self::announce) (after each
/// completion and release it applies, and each one its backend reports from elsewhere):
/// the waiters woken read the key again, once between them. The crate's own stores also
/// hand over the records they wrote and tell their own writes from reports, which saves
/// reads; those parts stay inside the crate, where each use was checked against forged
/// reports.
///
/// Only keys somebody watches take room: a key's entry goes with its last watch.
#[derive(Clone, Default)]
pub struct Announcements {
    board: Arc<Board>,
}

#[derive(Default)]
struct Board {
    keys: Mutex<HashMap<String, Arc<Slot>>>,
    /// How many keys are watched, readable without the lock: an announcement nobody
    /// waits for (nearly all of them) costs one atomic read. A watch is counted before
    /// its waiter reads the record again, and an announcement made after a store wrote
    /// it, so an announcement that reads none comes before a read that sees its write.
    watched: AtomicUsize,
}

/// One watched key: how many changes were announced, who to wake, and what the last
/// read of the key after an announcement found.
#[derive(Default)]
struct Slot {
    /// How many watches hold the slot; changed only under the board's lock, so that the
    /// last watch to go, whichever it is, takes the key off the board. (`Arc`'s count
    /// would not do: a watch lets go of its `Arc` after its `drop` has released the lock,
    /// so two watches dropped at once could each see the other and leave the key.)
    watches: AtomicUsize,
    changes: AtomicU64,
    /// The claims whose ends are known here.
    ends: Mutex<Ends>,
    announced: Notify,
    /// The last shared read of the key: the waiters woken by one announcement read the
    /// key once between them.
    last_read: Mutex<Option<Arc<SharedRead>>>,
}

/// What a watched key's slot knows of the claims on it that ended.
#[derive(Default)]
struct Ends {
    /// The claim whose end this process wrote last: reported again, it is no change.
    last: Option<ClaimToken>,
    /// The claim whose end this process is writing ([`Ending`]): its end, heard before the
    /// write returns, is announced by the writer once it does.
    writing: Option<ClaimToken>,
}

/// One read of a key, begun when `changes` announcements had been made, and what it found
/// (for the other waiters: a claim it won is the key in progress).
struct SharedRead {
    changes: u64,
    /// What the read found, or that it failed: a failed read fails every waiter that
    /// joined it, rather than passing to the next, which would make the last wait for
    /// every failed read before its own.
    found: tokio::sync::OnceCell<std::result::Result<Claim, ()>>,
}

/// A watch on one key's record, made by [`Announcements::watch`] (through
/// [`Store::watch`](crate::Store::watch)): [`changed`](Self::changed) returns once a change
/// was announced after the watch was made. Make it before reading the record, and no
/// change between the read and the wait is missed.
pub struct Watch {
    key: String,
    slot: Arc<Slot>,
    seen: u64,
    announcements: Announcements,
    /// Whether the waiters woken by one announcement read the key once between them.
    shared: bool,
    /// What the store keeps alive while the watch lives (a subscription).
    _keeping: Option<Box<dyn Send + Sync>>,
}

/// The end of a claim that this process is writing, made by [`Announcements::ending`]: say
/// how the write ended with [`completed`](Self::completed) or
/// [`released`](Self::released); dropped without either, it announces the end, and the
/// waiters read the key.
#[must_use = "dropped at once, the end is announced before it is written"]
pub(crate) struct Ending<'a> {
    announcements: &'a Announcements,
    key: &'a str,
    token: ClaimToken,
}

impl Announcements {
    /// A board with nothing watched.
    pub fn new() -> Self {
        Self::default()
    }

    /// Watches `key` (a storage key: [`Scope::storage_key`](crate::Scope::storage_key)).
    pub fn watch(&self, key: &str) -> Watch {
        let mut keys = self.lock();
        let slot = keys
            .entry(key.to_owned())
            .or_insert_with(|| {
                self.board.watched.fetch_add(1, Ordering::SeqCst);
                Arc::default()
            })
            .clone();
        slot.watches.fetch_add(1, Ordering::Relaxed);
        let seen = slot.changes.load(Ordering::Acquire);
        Watch {
            key: key.to_owned(),
            slot,
            seen,
            announcements: self.clone(),
            shared: true,
            _keeping: None,
        }
    }

    /// Announces that `key`'s record changed: wakes every watch on it. Costs one atomic
    /// read when nobody watches any key.
    pub fn announce(&self, key: &str) {
        if !self.anyone_watching() {
            return;
        }
        if let Some(slot) = self.lock().get(key) {
            slot.changed();
        }
    }

    /// Announces that the claim `token` held on `key` ended, as a store's notification
    /// reports it: its record was completed or released, and the waiters read the key. A
    /// report of an end this process writes or wrote itself ([`ending`](Self::ending),
    /// [`announce_completed`](Self::announce_completed)) is no change: its waiters were
    /// told by the write. Any other report wakes them, however often it is heard: a report
    /// cannot be trusted to be the store's (whoever can notify could send one first, to
    /// make the real one look heard), and reading the key again costs a read, no more.
    pub(crate) fn announce_end(&self, key: &str, token: ClaimToken) {
        self.end(key, token, Slot::reported);
    }

    /// Wakes the watches on `key` if the end of the claim `token` is news to `heard`.
    fn end(&self, key: &str, token: ClaimToken, heard: fn(&Slot, ClaimToken) -> bool) {
        if !self.anyone_watching() {
            return;
        }
        if let Some(slot) = self.lock().get(key) {
            if heard(slot, token) {
                slot.changed();
            }
        }
    }

    /// Announces that the claim `token` held on `key` ended with its record completed, as
    /// `completed` says (a [`Claim::Completed`], made only if anybody watches the key): the
    /// waiters take it for what a read of the key would find, all woken at once, and none
    /// reads the key. For a store's own completions, whose record it wrote: only what this
    /// process wrote is handed over this way, never what a notification says. Heard again
    /// (from the store's notifications), the end of the claim is no change.
    pub(crate) fn announce_completed(
        &self,
        key: &str,
        token: ClaimToken,
        completed: impl FnOnce() -> Claim,
    ) {
        self.complete(key, token, Slot::written, || Some(completed()));
    }

    /// Announces that the claim `token` held on `key` ended, as a store's notification
    /// reports it ([`announce_end`](Self::announce_end)), with the completed record
    /// `record` makes of what the report carries, if it makes one: the waiters take it as
    /// with [`announce_completed`](Self::announce_completed); without one they read the
    /// key. `record` must make one only of what the store proved it wrote (a signature
    /// under the application's secret, checked): whoever can send the store's reports
    /// could send any other. It runs only when somebody watches the key and the end is
    /// news, so a report its own write already handed over, or nobody waits for, costs no
    /// check.
    pub(crate) fn announce_end_with(
        &self,
        key: &str,
        token: ClaimToken,
        record: impl FnOnce() -> Option<Claim>,
    ) {
        self.complete(key, token, Slot::reported, record);
    }

    /// Hands the record `completed` makes to the watches on `key` if the end of the claim
    /// `token` is news to `heard`; wakes them to read the key if it makes none.
    fn complete(
        &self,
        key: &str,
        token: ClaimToken,
        heard: fn(&Slot, ClaimToken) -> bool,
        completed: impl FnOnce() -> Option<Claim>,
    ) {
        if !self.anyone_watching() {
            return;
        }
        let keys = self.lock();
        let Some(slot) = keys.get(key).filter(|slot| heard(slot, token)) else {
            return;
        };
        let Some(completed) = completed() else {
            return slot.changed();
        };
        // Announcements are made under the board's lock: this is the count the change makes.
        let changes = slot.changes.load(Ordering::Acquire) + 1;
        let read = SharedRead {
            changes,
            found: tokio::sync::OnceCell::new_with(Some(Ok(completed))),
        };
        *lock(&slot.last_read) = Some(Arc::new(read));
        // Counted once the finding is in place: a waiter that sees the change finds it.
        slot.changes.store(changes, Ordering::Release);
        slot.announced.notify_waiters();
    }

    /// Marks the end of the claim `token` on `key` as being written by this process: until
    /// the returned [`Ending`] announces it, the end heard from elsewhere (the store's own
    /// notification, which can arrive before its write's reply) wakes nobody. For a
    /// store's completions and releases: their waiters are then handed the record the
    /// write returns with, rather than one of them reading it. Dropped unannounced (the
    /// write failed, or its caller went away), the `Ending` announces the end: the waiters
    /// read the key, as after a notification.
    pub(crate) fn ending<'a>(&'a self, key: &'a str, token: ClaimToken) -> Ending<'a> {
        if self.anyone_watching() {
            if let Some(slot) = self.lock().get(key) {
                lock(&slot.ends).writing = Some(token);
            }
        }
        Ending {
            announcements: self,
            key,
            token,
        }
    }

    /// Whether any key is watched now: one atomic read, for a store to skip the work of
    /// naming what it would announce.
    pub fn anyone_watching(&self) -> bool {
        self.board.watched.load(Ordering::SeqCst) > 0
    }

    /// How many keys are watched now.
    pub(crate) fn watched(&self) -> usize {
        self.lock().len()
    }

    /// Whether anybody watches `key`.
    pub(crate) fn is_watched(&self, key: &str) -> bool {
        self.lock().contains_key(key)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<Slot>>> {
        lock(&self.board.keys)
    }
}

impl Slot {
    /// Whether the end of the claim `token`, reported by the store, is news: not the end
    /// of a claim this process is writing or wrote. A report marks nothing as heard.
    fn reported(&self, token: ClaimToken) -> bool {
        let ends = lock(&self.ends);
        ends.writing != Some(token) && ends.last != Some(token)
    }

    /// Whether the end of the claim `token`, written here, is announced for the first
    /// time: it is no longer being written.
    fn written(&self, token: ClaimToken) -> bool {
        let mut ends = lock(&self.ends);
        if ends.writing == Some(token) {
            ends.writing = None;
        }
        ends.last.replace(token) != Some(token)
    }

    /// Whether the end of the claim `token`, whose write here failed or was abandoned
    /// (it may or may not have applied), is news: it is no longer being written, and it is
    /// not marked as written, so that a retry of the write that applies (with the same
    /// token), or the store's report of it, still wakes the waiters.
    fn unsettled(&self, token: ClaimToken) -> bool {
        let mut ends = lock(&self.ends);
        if ends.writing == Some(token) {
            ends.writing = None;
        }
        ends.last != Some(token)
    }

    /// Whether a change was announced since `seen` changes were; `seen` counts it now.
    fn changed_since(&self, seen: &mut u64) -> bool {
        let changes = self.changes.load(Ordering::Acquire);
        std::mem::replace(seen, changes) != changes
    }

    fn changed(&self) {
        self.changes.fetch_add(1, Ordering::AcqRel);
        // One watch wakes, and passes the change on to the others: at once from
        // `changed`, or from `read_shared` once it has read the key, so that waiters woken
        // for a read are woken once, with its finding, not twice.
        self.announced.notify_one();
    }
}

impl Watch {
    /// Returns once a change to the key was announced since the watch was made, or since
    /// this last returned.
    pub async fn changed(&mut self) {
        self.announced().await;
        self.slot.announced.notify_waiters();
    }

    /// Returns as [`changed`](Self::changed) does, but leaves the others watching the key
    /// asleep when it was the one woken: its caller reads the key next, with
    /// [`read_shared`](Self::read_shared), which wakes them with what it found.
    pub(crate) async fn announced(&mut self) {
        let (slot, seen) = (&self.slot, &mut self.seen);
        loop {
            // Woken, a waiter finds the change counted and needs no registration: a thousand
            // woken at once would otherwise each register again, and unregister, under the
            // lock the waking takes between its batches.
            if slot.changed_since(seen) {
                return;
            }
            let announced = slot.announced.notified();
            tokio::pin!(announced);
            // Registered before the count is read again: an announcement in between still
            // wakes.
            announced.as_mut().enable();
            if slot.changed_since(seen) {
                return;
            }
            announced.await;
        }
    }

    /// Reads the key with `read`, unless another waiter on this watch's key began a read
    /// after the announcement this watch last saw: its finding then serves this one too.
    /// A claim it won is the key taken by another request, for this one: the key in
    /// progress (held by `fingerprint`, its lease `lease` from now).
    pub(crate) async fn read_shared<F, R>(
        &self,
        fingerprint: Fingerprint,
        lease: Duration,
        read: F,
    ) -> Result<Claim>
    where
        F: FnOnce() -> R,
        R: Future<Output = Result<Claim>>,
    {
        if !self.shared {
            // Each reads alone: the others need not wait for this one's finding.
            self.slot.announced.notify_waiters();
            return read().await;
        }
        let shared = {
            let mut last_read = lock(&self.slot.last_read);
            match &*last_read {
                Some(shared) if shared.changes >= self.seen => Arc::clone(shared),
                _ => {
                    let shared = Arc::new(SharedRead {
                        changes: self.slot.changes.load(Ordering::Acquire),
                        found: tokio::sync::OnceCell::new(),
                    });
                    *last_read = Some(Arc::clone(&shared));
                    shared
                }
            }
        };
        // One waiter reads; the others wait for its finding, all woken together when it
        // has one, whether they wait here or still for the announcement. (Should its
        // request go away, the next tries; should its read fail, every waiter that joined
        // it fails with it, as a read of its own would have, within one store timeout.)
        let reader = PassOn {
            announced: &self.slot.announced,
            read: AtomicBool::new(false),
        };
        let mut own = None;
        let found = shared
            .found
            .get_or_init(|| async {
                reader.read.store(true, Ordering::Relaxed);
                let found = read().await;
                let shared = match &found {
                    Ok(Claim::Claimed(_)) => Ok(Claim::InProgress {
                        fingerprint,
                        lease_remaining: lease,
                        running_for: Some(Duration::ZERO),
                    }),
                    Ok(found) => Ok(found.clone()),
                    Err(_) => Err(()),
                };
                own = Some(found);
                shared
            })
            .await;
        drop(reader);
        match (own, found) {
            (Some(own), _) => own,
            (None, Ok(found)) => Ok(found.clone()),
            (None, Err(())) => Err(Error::Backend("the shared read of the key failed".into())),
        }
    }

    /// The key watched.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The watch, its waiters each reading the key themselves once woken, rather than once
    /// between them: for a store that must see every read, as one that counts the replays
    /// it serves.
    pub fn reading_alone(mut self) -> Self {
        self.shared = false;
        self
    }

    /// The watch, keeping `guard` alive as long as it lives: for a store whose
    /// announcements come from a subscription that should end with its last watch.
    pub fn keeping(mut self, guard: impl Send + Sync + 'static) -> Self {
        self._keeping = Some(Box::new(guard));
        self
    }
}

/// Wakes every watch on a key once the waiter that read it for them is done, found
/// something or not, or went away.
struct PassOn<'a> {
    announced: &'a Notify,
    read: AtomicBool,
}

impl Drop for PassOn<'_> {
    fn drop(&mut self) {
        if *self.read.get_mut() {
            self.announced.notify_waiters();
        }
    }
}

impl Ending<'_> {
    /// The record was completed, as `completed` says: the watches take it for what a read
    /// would find, as with [`Announcements::announce_completed`].
    pub(crate) fn completed(self, completed: impl FnOnce() -> Claim) {
        let this = std::mem::ManuallyDrop::new(self);
        this.announcements
            .complete(this.key, this.token, Slot::written, || Some(completed()));
    }

    /// The claim was released: the watches read the key, one for them all.
    pub(crate) fn released(self) {
        let this = std::mem::ManuallyDrop::new(self);
        this.announcements.end(this.key, this.token, Slot::written);
    }
}

impl Drop for Ending<'_> {
    /// The write failed or its caller went away: whether it applied is unknown, so the
    /// waiters read the key, and the end is not taken as written (a retry that applies is
    /// announced again).
    fn drop(&mut self) {
        self.announcements
            .end(self.key, self.token, Slot::unsettled);
    }
}

impl fmt::Debug for Ending<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Ending").field("key", &self.key).finish()
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        let mut keys = self.announcements.lock();
        let last = self.slot.watches.fetch_sub(1, Ordering::Relaxed) == 1;
        if last && keys.remove(&self.key).is_some() {
            let board = &self.announcements.board;
            board.watched.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

/// A panic while holding one of these locks leaves what it guards whole: keep using it.
fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl fmt::Debug for Announcements {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Announcements")
            .field("watched", &self.watched())
            .finish()
    }
}

impl fmt::Debug for Watch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Watch").field("key", &self.key).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two watches on one key dropped at once, on two threads: the last one out takes the
    /// key off the board, whichever it is.
    #[test]
    fn watches_dropped_at_once_on_two_threads_leave_no_key() {
        let board = Announcements::new();
        let barrier = Arc::new(std::sync::Barrier::new(2));
        let dropper = |watches: std::sync::mpsc::Receiver<Watch>| {
            let barrier = Arc::clone(&barrier);
            std::thread::spawn(move || {
                while let Ok(watch) = watches.recv() {
                    barrier.wait();
                    drop(watch);
                }
            })
        };
        let (to_a, a) = std::sync::mpsc::channel();
        let (to_b, b) = std::sync::mpsc::channel();
        let (a, b) = (dropper(a), dropper(b));
        for key in 0..20_000 {
            let key = key.to_string();
            to_a.send(board.watch(&key)).unwrap();
            to_b.send(board.watch(&key)).unwrap();
        }
        drop((to_a, to_b));
        a.join().unwrap();
        b.join().unwrap();
        assert_eq!(board.watched(), 0, "keys left on the board with no watch");
        assert!(!board.anyone_watching());
    }

    /// A read of the key, for `read_shared`.
    type Read = std::pin::Pin<Box<dyn Future<Output = Result<Claim>> + Send>>;

    #[tokio::test]
    async fn a_watch_sees_what_was_announced_after_it_was_made() {
        let board = Announcements::new();
        board.announce("k"); // Nobody watches: nothing kept.
        assert_eq!(board.watched(), 0);
        let mut watch = board.watch("k");
        let mut other = board.watch("other");
        assert_eq!(board.watched(), 2);
        // Announced before the wait begins: not missed.
        board.announce("k");
        tokio::time::timeout(Duration::from_secs(1), watch.changed())
            .await
            .expect("the announcement");
        // Nothing new since: it waits.
        let waiting = tokio::time::timeout(Duration::from_millis(20), watch.changed()).await;
        assert!(waiting.is_err());
        let waiting = tokio::time::timeout(Duration::from_millis(20), other.changed()).await;
        assert!(waiting.is_err(), "another key's announcement");
        drop(watch);
        drop(other);
        assert_eq!(board.watched(), 0, "the last watch takes its key's entry");
    }

    #[tokio::test]
    async fn one_announcement_wakes_every_watch_on_the_key() {
        let board = Announcements::new();
        let watches: Vec<_> = (0..100).map(|_| board.watch("k")).collect();
        assert_eq!(board.watched(), 1);
        let woken = watches
            .into_iter()
            .map(|mut watch| tokio::spawn(async move { watch.changed().await }));
        let woken: Vec<_> = woken.collect();
        tokio::task::yield_now().await;
        board.announce("k");
        for task in woken {
            tokio::time::timeout(Duration::from_secs(1), task)
                .await
                .expect("woken")
                .unwrap();
        }
        assert_eq!(board.watched(), 0);
    }

    /// `count` waiters on one key, each waiting for an announcement and then reading the
    /// key through `read_shared` with `read`; returns their findings once all are back.
    async fn waiters_reading<R>(
        board: &Announcements,
        count: usize,
        read: R,
    ) -> Vec<tokio::task::JoinHandle<Result<Claim>>>
    where
        R: Fn() -> Read + Clone + Send + 'static,
    {
        let tasks = (0..count)
            .map(|_| {
                let mut watch = board.watch("k");
                let read = read.clone();
                tokio::spawn(async move {
                    watch.announced().await;
                    let lease = Duration::from_secs(1);
                    watch
                        .read_shared(Fingerprint::from_bytes([1; 32]), lease, read)
                        .await
                })
            })
            .collect();
        tokio::task::yield_now().await;
        tokio::time::sleep(Duration::from_millis(20)).await;
        tasks
    }

    fn completed() -> Claim {
        Claim::Completed {
            fingerprint: Fingerprint::from_bytes([1; 32]),
            response: crate::StoredResponse {
                status: http::StatusCode::CREATED,
                headers: http::HeaderMap::new(),
                body: bytes::Bytes::from_static(b"{}"),
                trailers: None,
            },
            expires_in: None,
        }
    }

    /// A read that finds the key completed after `taking`, and the count of its calls.
    fn counted_read(taking: Duration) -> (Arc<AtomicUsize>, impl Fn() -> Read + Clone) {
        let reads = Arc::new(AtomicUsize::new(0));
        let counted = Arc::clone(&reads);
        let read = move || {
            counted.fetch_add(1, Ordering::SeqCst);
            Box::pin(async move {
                tokio::time::sleep(taking).await;
                Ok(completed())
            }) as Read
        };
        (reads, read)
    }

    /// A read whose first call is `first`, and each later one finds the key completed; and
    /// the count of its calls.
    fn first_read_then_completed(
        first: impl Fn() -> Read + Clone + Send + 'static,
    ) -> (Arc<AtomicUsize>, impl Fn() -> Read + Clone) {
        let reads = Arc::new(AtomicUsize::new(0));
        let counted = Arc::clone(&reads);
        let read = move || {
            if counted.fetch_add(1, Ordering::SeqCst) == 0 {
                first()
            } else {
                Box::pin(async { Ok(completed()) }) as Read
            }
        };
        (reads, read)
    }

    /// A board with a hundred waiters on "k", whose reads take `taking` and are counted.
    async fn a_hundred_waiting(
        taking: Duration,
    ) -> (
        Announcements,
        Arc<AtomicUsize>,
        Vec<tokio::task::JoinHandle<Result<Claim>>>,
    ) {
        let board = Announcements::new();
        let (reads, read) = counted_read(taking);
        let waiters = waiters_reading(&board, 100, read).await;
        (board, reads, waiters)
    }

    /// Every waiter answers soon, with the completed record.
    async fn all_find_it_completed(waiters: Vec<tokio::task::JoinHandle<Result<Claim>>>) {
        for waiter in waiters {
            let found = tokio::time::timeout(Duration::from_secs(1), waiter)
                .await
                .expect("woken with the finding")
                .unwrap();
            assert_eq!(found.unwrap(), completed());
        }
    }

    #[tokio::test]
    async fn one_announcement_is_read_once_for_every_waiter() {
        let (board, reads, waiters) = a_hundred_waiting(Duration::from_millis(10)).await;
        board.announce("k");
        all_find_it_completed(waiters).await;
        assert_eq!(reads.load(Ordering::SeqCst), 1);
    }

    /// A report of the end of a claim, heard before the claim really ended (made up by
    /// someone who can notify the store), wakes the waiters to read: they find the key in
    /// progress and wait on. The store's own report of the real end, with the same token,
    /// still wakes them: the first report did not mark it heard.
    #[tokio::test]
    async fn a_report_heard_first_never_hides_the_real_end() {
        let board = Announcements::new();
        // The first read finds the key in progress (the made-up report); the next, its record.
        let (reads, read) = first_read_then_completed(|| {
            Box::pin(async {
                Ok(Claim::InProgress {
                    fingerprint: Fingerprint::from_bytes([1; 32]),
                    lease_remaining: Duration::from_secs(30),
                    running_for: None,
                })
            })
        });
        let token = ClaimToken::unique();
        let waiters = waiters_reading(&board, 10, read.clone()).await;
        board.announce_end("k", token);
        for waiter in waiters {
            let found = tokio::time::timeout(Duration::from_secs(1), waiter)
                .await
                .expect("woken by the made-up report")
                .unwrap();
            assert!(matches!(found, Ok(Claim::InProgress { .. })), "{found:?}");
        }
        // Waiting again, as the layer's waiters do; the real end, named alike.
        let waiters = waiters_reading(&board, 10, read).await;
        board.announce_end("k", token);
        all_find_it_completed(waiters).await;
        assert_eq!(reads.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn a_completion_announced_with_its_record_is_read_by_nobody() {
        let (board, reads, waiters) = a_hundred_waiting(Duration::ZERO).await;
        let mut watch = board.watch("k");
        let token = ClaimToken::unique();
        board.announce_completed("k", token, completed);
        all_find_it_completed(waiters).await;
        assert_eq!(reads.load(Ordering::SeqCst), 0);
        saw_the_end_once(&board, &mut watch, token).await;
    }

    #[tokio::test]
    async fn the_end_of_a_claim_being_written_here_is_announced_by_the_write() {
        let (board, reads, waiters) = a_hundred_waiting(Duration::ZERO).await;
        let mut watch = board.watch("k");
        let token = ClaimToken::unique();
        let ending = board.ending("k", token);
        // The store's own notification, heard before its write returns: nobody wakes.
        board.announce_end("k", token);
        let wait = Duration::from_millis(20);
        assert!(tokio::time::timeout(wait, watch.changed()).await.is_err());
        ending.completed(completed);
        all_find_it_completed(waiters).await;
        assert_eq!(reads.load(Ordering::SeqCst), 0, "handed the record");
        saw_the_end_once(&board, &mut watch, token).await;
    }

    #[tokio::test]
    async fn an_ending_dropped_unannounced_wakes_the_waiters_to_read() {
        let (board, reads, waiters) = a_hundred_waiting(Duration::ZERO).await;
        let token = ClaimToken::unique();
        let ending = board.ending("k", token);
        board.announce_end("k", token);
        // The write failed, or its caller went away: whether it applied is unknown.
        drop(ending);
        all_find_it_completed(waiters).await;
        assert_eq!(reads.load(Ordering::SeqCst), 1);
    }

    /// A write that failed (its outcome unknown) wakes the waiters to read; its retry with
    /// the same token that applies is still announced, with its record, and the store's
    /// report of it after that is no change.
    #[tokio::test]
    async fn a_write_retried_after_a_failure_is_announced_again() {
        let board = Announcements::new();
        let mut watch = board.watch("k");
        let token = ClaimToken::unique();
        drop(board.ending("k", token));
        let wait = Duration::from_millis(20);
        assert!(tokio::time::timeout(wait, watch.changed()).await.is_ok());
        let (reads, read) = counted_read(Duration::ZERO);
        let waiters = waiters_reading(&board, 10, read).await;
        // The retry: reported early by the store, then written here.
        let ending = board.ending("k", token);
        board.announce_end("k", token);
        ending.completed(completed);
        all_find_it_completed(waiters).await;
        assert_eq!(reads.load(Ordering::SeqCst), 0, "handed the record");
        saw_the_end_once(&board, &mut watch, token).await;
    }

    #[tokio::test]
    async fn a_release_written_here_wakes_the_waiters_to_read() {
        let (board, reads, waiters) = a_hundred_waiting(Duration::ZERO).await;
        let mut watch = board.watch("k");
        let token = ClaimToken::unique();
        let ending = board.ending("k", token);
        ending.released();
        all_find_it_completed(waiters).await;
        assert_eq!(reads.load(Ordering::SeqCst), 1);
        saw_the_end_once(&board, &mut watch, token).await;
    }

    /// `watch` saw the end of the claim `token` on "k": heard again from the store's
    /// notifications, it is no change.
    async fn saw_the_end_once(board: &Announcements, watch: &mut Watch, token: ClaimToken) {
        let wait = Duration::from_millis(20);
        assert!(tokio::time::timeout(wait, watch.changed()).await.is_ok());
        board.announce_end("k", token);
        assert!(tokio::time::timeout(wait, watch.changed()).await.is_err());
    }

    #[tokio::test]
    async fn every_report_of_an_end_not_written_here_is_a_change() {
        let board = Announcements::new();
        let mut watch = board.watch("k");
        let (first, second) = (ClaimToken::unique(), ClaimToken::unique());
        let wait = Duration::from_millis(20);
        board.announce_end("k", first);
        assert!(tokio::time::timeout(wait, watch.changed()).await.is_ok());
        // Heard again: reports are not trusted to mark an end heard.
        board.announce_end("k", first);
        assert!(tokio::time::timeout(wait, watch.changed()).await.is_ok());
        board.announce_end("k", second);
        assert!(tokio::time::timeout(wait, watch.changed()).await.is_ok());
        // An announcement without a claim is always a change.
        board.announce("k");
        assert!(tokio::time::timeout(wait, watch.changed()).await.is_ok());
        // The end of a claim written here, reported after the write: no change.
        let written = ClaimToken::unique();
        board.ending("k", written).released();
        assert!(tokio::time::timeout(wait, watch.changed()).await.is_ok());
        board.announce_end("k", written);
        assert!(tokio::time::timeout(wait, watch.changed()).await.is_err());
    }

    #[tokio::test]
    async fn a_reader_that_goes_away_passes_the_read_on() {
        let board = Announcements::new();
        // The first read never ends; the next finds the record.
        let (reads, read) = first_read_then_completed(|| Box::pin(std::future::pending()));
        let mut waiters = waiters_reading(&board, 10, read).await;
        board.announce("k");
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(reads.load(Ordering::SeqCst), 1, "one waiter reads");
        // The reader is the one waiter that has not finished; its request goes away.
        let reader = waiters.iter().position(|waiter| !waiter.is_finished());
        let reader = waiters.remove(reader.expect("the reader still reads"));
        assert!(waiters.iter().all(|waiter| !waiter.is_finished()));
        reader.abort();
        all_find_it_completed(waiters).await;
        assert_eq!(reads.load(Ordering::SeqCst), 2);
    }
}
