//! Completions and releases made by any instance, relayed to this one's waiters: each store
//! keeps one connection of its own that `LISTEN`s on its table's channel.
//!
//! The statements that complete and release a key notify the table's channel in the same
//! statement (what they say: [`notification`](super::notification)), so a notification
//! goes out exactly when the write is committed, and the store that made it and announced
//! it at once hears it once. The listener opens its connection at the first watch, confirms
//! `LISTEN` before that watch is handed out, and relays every notification on the channel
//! to the store's [`Announcements`]: each wakes the waiters of its key to read it. A
//! connection that fails is opened again with backoff while anybody watches; once it
//! listens again, every watched key is announced, since what was notified in between is
//! lost and its waiters must read their keys again.

use std::{
    collections::HashSet,
    future::poll_fn,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc, Mutex, MutexGuard, PoisonError,
    },
    time::{Duration, Instant},
};

use tokio::{sync::watch, task::JoinHandle};
use tokio_postgres::{tls::NoTlsStream, AsyncMessage, Config, Connection, NoTls, Socket};

use super::notification::heard;
use crate::{
    store::{Announcements, Ending, Watch},
    ClaimToken,
};

/// How long opening the listening connection may take, and then confirming `LISTEN`.
const LISTEN_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a watch waits for a listener that is opening its connection: both steps.
const OPENING_WAIT: Duration = Duration::from_secs(4);
/// How often the listening connection is checked with a query; the query may take as long.
const HEARTBEAT: Duration = Duration::from_secs(10);
/// A listener that has not run for this long is taken for stalled (a runtime that no
/// longer runs its tasks) and replaced.
const STALLED: Duration = Duration::from_secs(30);
/// The first pause before opening a failed connection again, and the longest: doubled each
/// time in between.
const FIRST_BACKOFF: Duration = Duration::from_millis(100);
const LAST_BACKOFF: Duration = Duration::from_secs(2);
/// The keys remembered for announcing after a reconnection are swept of those nobody
/// watches any more when they have doubled since the last sweep (and are at least this
/// many): they stay within twice the watched keys.
const MIN_SWEEP_LEN: usize = 64;

/// One store's listener: its announcements, and the task that relays the channel's
/// notifications to them while anybody watches.
pub(super) struct Listener {
    /// Where the listening connection goes; `None` for a store made from a pool, which
    /// cannot tell.
    config: Option<Config>,
    shared: Arc<Shared>,
    /// The task relaying notifications, once a watch started one.
    relay: Mutex<Option<Relay>>,
}

/// What the relaying task shares with the store.
struct Shared {
    channel: String,
    announcements: Announcements,
    /// The keys watched, to announce each once the connection listens again.
    remembered: Mutex<Remembered>,
    /// When the relaying task last ran, in milliseconds since `epoch`.
    beat: AtomicU64,
    epoch: Instant,
}

struct Remembered {
    keys: HashSet<String>,
    sweep_at_len: usize,
}

/// A running relaying task. Dropped with the store (or when replaced), it ends the task.
struct Relay {
    task: JoinHandle<()>,
    status: watch::Receiver<Status>,
}

/// Where a relaying task is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Status {
    /// Opening its first connection.
    Opening,
    /// `LISTEN` was confirmed: every notification from now on is relayed.
    Listening,
    /// The connection failed: opening it again, with backoff.
    Down,
    /// Nobody watched when the connection failed: the task ended.
    Ended,
}

/// Why a listening connection ended.
#[derive(Debug, thiserror::Error)]
enum Lost {
    #[error("{0}")]
    Postgres(#[from] tokio_postgres::Error),
    #[error("the server closed the connection")]
    Closed,
    #[error("no answer within {0:?}")]
    Timeout(Duration),
}

impl Listener {
    /// A listener on `channel` that connects with `config`; one without a `config` never
    /// listens, and its watches are all `None`.
    pub(super) fn new(config: Option<Config>, channel: String) -> Self {
        Self {
            config,
            shared: Arc::new(Shared {
                channel,
                announcements: Announcements::new(),
                remembered: Mutex::new(Remembered {
                    keys: HashSet::new(),
                    sweep_at_len: MIN_SWEEP_LEN,
                }),
                beat: AtomicU64::new(0),
                epoch: Instant::now(),
            }),
            relay: Mutex::new(None),
        }
    }

    /// Where the listening connection goes.
    pub(super) fn config(&self) -> Option<&Config> {
        self.config.as_ref()
    }

    /// The channel listened on.
    pub(super) fn channel(&self) -> &str {
        &self.shared.channel
    }

    /// The end of the claim `token` on `key` (a [`key_of`](super::notification::key_of)),
    /// which this process is about
    /// to write: its notification, heard before the write returns, wakes nobody, and the
    /// write announces it ([`Announcements::ending`]).
    pub(super) fn ending<'a>(&'a self, key: &'a str, token: ClaimToken) -> Ending<'a> {
        self.shared.announcements.ending(key, token)
    }

    /// How many keys are watched now.
    pub(super) fn watched(&self) -> usize {
        self.shared.announcements.watched()
    }

    /// A watch on `key` (a [`key_of`](super::notification::key_of)) that sees every
    /// notification made once this returns; `None` when no connection listens (none can be opened, or the store cannot
    /// open one): the waiter then reads its key again by itself.
    pub(super) async fn watch(&self, key: &str) -> Option<Watch> {
        let config = self.config.as_ref()?;
        // On the board before the listener is asked whether it listens: whatever it relays
        // from then on reaches this watch.
        let watch = self.shared.announcements.watch(key);
        self.shared.remember(key);
        let mut status = self.relay(config)?;
        let settled = status.wait_for(|status| *status != Status::Opening);
        let listening = matches!(
            tokio::time::timeout(OPENING_WAIT, settled).await,
            Ok(Ok(status)) if *status == Status::Listening
        );
        listening.then_some(watch)
    }

    /// The status of the relaying task, started here (in the caller's runtime) if none
    /// runs: never yet, or it ended, or its runtime did (the task went with it), or its
    /// runtime no longer runs it.
    fn relay(&self, config: &Config) -> Option<watch::Receiver<Status>> {
        let mut relay = lock(&self.relay);
        if let Some(running) = relay.as_ref().filter(|relay| relay.runs(&self.shared)) {
            return Some(running.status.clone());
        }
        let runtime = tokio::runtime::Handle::try_current().ok()?;
        // A task that did not end by itself may have left waiters without a relay: they
        // read their keys again once the new one listens.
        let orphaned = relay
            .as_ref()
            .is_some_and(|relay| *relay.status.borrow() != Status::Ended);
        let (report, status) = watch::channel(Status::Opening);
        self.shared.beat();
        let shared = Arc::clone(&self.shared);
        let task = runtime.spawn(run(shared, config.clone(), report, orphaned));
        // The one it replaces, if any, is ended.
        *relay = Some(Relay {
            task,
            status: status.clone(),
        });
        Some(status)
    }
}

impl Relay {
    /// Whether the task still runs, and can relay.
    fn runs(&self, shared: &Shared) -> bool {
        !self.task.is_finished()
            && !self.status.is_closed()
            && *self.status.borrow() != Status::Ended
            && !shared.stalled()
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Shared {
    /// Marks the relaying task as running now.
    fn beat(&self) {
        self.beat.store(self.now(), Ordering::Relaxed);
    }

    fn stalled(&self) -> bool {
        let since = self.now().saturating_sub(self.beat.load(Ordering::Relaxed));
        since > STALLED.as_millis() as u64
    }

    fn now(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// Remembers `key`, watched now, for [`announce_all`](Self::announce_all).
    fn remember(&self, key: &str) {
        let mut remembered = lock(&self.remembered);
        if remembered.keys.contains(key) {
            return;
        }
        if remembered.keys.len() >= remembered.sweep_at_len {
            self.sweep(&mut remembered);
        }
        remembered.keys.insert(key.to_owned());
    }

    /// Announces every watched key: for waiters that may have missed a notification.
    fn announce_all(&self) {
        let keys: Vec<String> = {
            let mut remembered = lock(&self.remembered);
            self.sweep(&mut remembered);
            remembered.keys.iter().cloned().collect()
        };
        for key in &keys {
            self.announcements.announce(key);
        }
    }

    /// Announces the end of the claim a notification's `payload` names: its key's waiters
    /// read the key. Anything else is not a store's notification, and wakes nobody.
    fn relay(&self, payload: &str) {
        if let Some((key, token)) = heard(payload) {
            self.announcements.announce_end(key, token);
        }
    }

    /// Forgets the keys nobody watches any more.
    fn sweep(&self, remembered: &mut Remembered) {
        remembered
            .keys
            .retain(|key| self.announcements.is_watched(key));
        remembered.sweep_at_len = (remembered.keys.len() * 2).max(MIN_SWEEP_LEN);
    }
}

/// Listens and relays, opening the connection again with backoff when it fails, until it
/// fails while nobody watches. `orphaned`: announce every watched key once listening.
async fn run(
    shared: Arc<Shared>,
    config: Config,
    status: watch::Sender<Status>,
    mut orphaned: bool,
) {
    let mut backoff = FIRST_BACKOFF;
    let mut failures = 0u32;
    loop {
        shared.beat();
        let listening = || {
            // Before the status: a watch handed out once it reads `Listening` is not woken
            // for nothing.
            if orphaned {
                shared.announce_all();
            }
            status.send_replace(Status::Listening);
        };
        let (listened, lost) = listen(&shared, &config, listening).await;
        status.send_replace(Status::Down);
        // What was notified as the connection went, or while it was down, is lost: the
        // waiters read their keys again now, and again once it listens.
        shared.announce_all();
        orphaned = true;
        if listened {
            backoff = FIRST_BACKOFF;
            failures = 0;
        }
        failures += 1;
        if failures == 1 {
            tracing::warn!(channel = %shared.channel, error = %lost, listened, "idempotency listener connection failed: waiters read their keys again until it listens");
        } else {
            tracing::debug!(channel = %shared.channel, error = %lost, failures, "idempotency listener could not listen");
        }
        if shared.announcements.watched() == 0 {
            status.send_replace(Status::Ended);
            return;
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(LAST_BACKOFF);
    }
}

/// Opens a connection, listens on the channel (`listening` is called once that is
/// confirmed) and relays its notifications until the connection fails. Returns whether it
/// listened, and why it ended.
async fn listen(shared: &Shared, config: &Config, listening: impl FnOnce()) -> (bool, Lost) {
    let (client, mut connection) =
        match tokio::time::timeout(LISTEN_TIMEOUT, config.connect(NoTls)).await {
            Ok(Ok(connected)) => connected,
            Ok(Err(error)) => return (false, error.into()),
            Err(_) => return (false, Lost::Timeout(LISTEN_TIMEOUT)),
        };
    let mut listened = false;
    let lost = {
        // Driven beside the relay, which drives the connection they run on.
        let control = async {
            let sql = format!("LISTEN {}", shared.channel);
            if let Err(lost) = within(LISTEN_TIMEOUT, client.batch_execute(&sql)).await {
                return lost;
            }
            listened = true;
            listening();
            // A connection that no longer answers (a peer gone without a word) is noticed
            // here: its notifications would stop without an error.
            loop {
                tokio::time::sleep(HEARTBEAT).await;
                shared.beat();
                if let Err(lost) = within(HEARTBEAT, client.batch_execute("SELECT 1")).await {
                    return lost;
                }
            }
        };
        tokio::select! {
            lost = relay(shared, &mut connection) => lost,
            lost = control => lost,
        }
    };
    (listened, lost)
}

/// Relays the channel's notifications until the connection fails.
async fn relay(shared: &Shared, connection: &mut Connection<Socket, NoTlsStream>) -> Lost {
    loop {
        match poll_fn(|cx| connection.poll_message(cx)).await {
            Some(Ok(AsyncMessage::Notification(notification))) => {
                if notification.channel() == shared.channel {
                    shared.relay(notification.payload());
                }
            }
            Some(Ok(AsyncMessage::Notice(notice))) => {
                tracing::debug!(channel = %shared.channel, %notice, "idempotency listener notice");
            }
            Some(Ok(_)) => {}
            Some(Err(error)) => return error.into(),
            None => return Lost::Closed,
        }
    }
}

/// `future`'s result, or a timeout after `limit`.
async fn within<T>(
    limit: Duration,
    future: impl std::future::Future<Output = Result<T, tokio_postgres::Error>>,
) -> Result<T, Lost> {
    match tokio::time::timeout(limit, future).await {
        Ok(result) => Ok(result?),
        Err(_) => Err(Lost::Timeout(limit)),
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // Nothing panics while holding these locks with the state half-changed.
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;

    use super::super::notification::{channel, end_of, key_of, tests::scope};
    use super::*;
    use crate::{store::Claim, Fingerprint};

    #[tokio::test]
    async fn a_store_that_cannot_connect_watches_nothing() {
        let listener = Listener::new(None, channel("a.b"));
        assert!(listener.watch("k").await.is_none());
        assert_eq!(listener.watched(), 0);
    }

    #[test]
    fn remembered_keys_stay_within_twice_the_watched() {
        let listener = Listener::new(None, channel("a.b"));
        let shared = &listener.shared;
        let kept: Vec<Watch> = (0..10)
            .map(|i| {
                let key = format!("kept{i}");
                let watch = shared.announcements.watch(&key);
                shared.remember(&key);
                watch
            })
            .collect();
        for i in 0..10_000 {
            let key = format!("gone{i}");
            let watch = shared.announcements.watch(&key);
            shared.remember(&key);
            drop(watch);
        }
        let remembered = lock(&shared.remembered).keys.len();
        assert!(remembered <= 2 * MIN_SWEEP_LEN, "{remembered}");
        shared.announce_all();
        assert_eq!(lock(&shared.remembered).keys.len(), kept.len());
    }

    /// The end of a claim wakes the key's waiters, and one of them reads the key for all;
    /// a payload that names no claim (made up, or carrying anything more) wakes nobody.
    #[tokio::test]
    async fn a_notification_only_wakes_the_waiters_to_read_their_key() {
        let listener = Listener::new(None, channel("a.b"));
        let shared = &listener.shared;
        let key = key_of(&scope("mine"));
        let mut watch = shared.announcements.watch(&key);
        let ended = end_of(&key, ClaimToken::unique());
        for made_up in [format!("{ended}c2VhbGVk"), key.clone()] {
            shared.relay(&made_up);
            let woken = tokio::time::timeout(Duration::from_millis(50), watch.announced()).await;
            assert!(woken.is_err(), "woken by {made_up:?}");
        }
        shared.relay(&ended);
        tokio::time::timeout(Duration::from_secs(1), watch.announced())
            .await
            .expect("woken");
        let reads = AtomicUsize::new(0);
        let read = || async {
            reads.fetch_add(1, Ordering::SeqCst);
            Ok(Claim::Claimed(ClaimToken::unique()))
        };
        let fingerprint = Fingerprint::from_bytes([7; 32]);
        let lease = Duration::from_secs(60);
        watch.read_shared(fingerprint, lease, read).await.unwrap();
        assert_eq!(reads.load(Ordering::SeqCst), 1);
    }
}
