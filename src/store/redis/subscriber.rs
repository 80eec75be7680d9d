//! Completions and releases announced by any instance, relayed from Redis pub/sub to the
//! store's waiters.
//!
//! The fenced scripts `PUBLISH` the token of the claim that ended on a channel named by a
//! digest of the key they wrote (`channel`); a store subscribes, on one connection of its
//! own, to the channels of the keys its requests wait on, and only while they wait: a
//! completion nobody waits for reaches no client. A message is only a reason to read the
//! key: any client allowed to publish could have sent it.
//!
//! In a cluster the channel is a shard channel (`SPUBLISH`, `SSUBSCRIBE`): a message goes
//! to the master serving the key's slot (and its replicas) only, not to every node. The
//! store's cluster connection (RESP3) subscribes on that master, and subscribes again
//! wherever the slot goes.

use std::{
    collections::HashMap,
    fmt,
    future::Future,
    pin::Pin,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Mutex, PoisonError, Weak,
    },
    time::Duration,
};

use futures_util::StreamExt;
use redis::{
    aio::PubSubSink, cluster::ClusterClient, cluster_async::ClusterConnection, Client,
    ConnectionInfo, ErrorKind, ProtocolVersion, PushInfo, PushKind, RedisResult, Value,
};
use tokio::sync::mpsc;

use super::{
    announced_record, nodelay,
    primary::Primary,
    signed::{Signer, SIGNATURE_LEN},
    ANNOUNCED_VALUE_MAX, CONNECTION_TIMEOUT,
};
use crate::{store::Announcements, ClaimToken};

/// The longest a reconnection waits between attempts while keys are watched.
const RECONNECT_MAX_DELAY: Duration = Duration::from_secs(1);
const RECONNECT_MIN_DELAY: Duration = Duration::from_millis(20);

/// Where the subscriber connects.
pub(super) enum Source {
    /// One server: the first that answers.
    Servers(Vec<Client>),
    /// The primary Sentinel names now.
    Sentinel(Arc<Primary>),
    /// A cluster's seed nodes: each key's shard channel on the master serving its slot.
    Cluster(Vec<ConnectionInfo>),
}

/// The command half of the subscribing connection.
#[derive(Clone)]
enum Sink {
    /// `SUBSCRIBE` on one server.
    Server(PubSubSink),
    /// `SSUBSCRIBE` through a cluster connection, which routes each to its slot's master;
    /// `confirming` counts the confirmations its own commands are still owed, so that the
    /// relay tells them from the cluster connection's own subscribing again.
    Cluster {
        connection: ClusterConnection,
        confirming: Arc<Confirming>,
    },
}

/// The shard-channel confirmations that commands sent by this store are owed: the relay
/// counts one off per confirmation, and a confirmation nobody is owed comes from the
/// cluster connection itself (it subscribed again after losing a node, or the server
/// dropped a subscription whose slot moved).
#[derive(Default)]
struct Confirming {
    owed: Mutex<HashMap<(String, bool), usize>>,
}

impl Confirming {
    fn expect(&self, channel: &str, subscribed: bool) {
        *self
            .lock()
            .entry((channel.to_owned(), subscribed))
            .or_default() += 1;
    }

    /// Counts off one owed confirmation; `false` if none was owed.
    fn take(&self, channel: &str, subscribed: bool) -> bool {
        let mut owed = self.lock();
        let key = (channel.to_owned(), subscribed);
        match owed.get_mut(&key) {
            Some(count) => {
                *count -= 1;
                if *count == 0 {
                    owed.remove(&key);
                }
                true
            }
            None => false,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<(String, bool), usize>> {
        self.owed.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Sink {
    async fn subscribe(&mut self, channel: &str) -> RedisResult<()> {
        self.change(channel, true).await
    }

    async fn unsubscribe(&mut self, channel: &str) -> RedisResult<()> {
        self.change(channel, false).await
    }

    /// Subscribes to `channel`, or unsubscribes from it; returns once Redis confirmed.
    async fn change(&mut self, channel: &str, subscribe: bool) -> RedisResult<()> {
        match self {
            Sink::Server(sink) if subscribe => sink.subscribe(channel).await,
            Sink::Server(sink) => sink.unsubscribe(channel).await,
            Sink::Cluster {
                connection,
                confirming,
            } => {
                confirming.expect(channel, subscribe);
                let changed = if subscribe {
                    connection.ssubscribe(channel).await
                } else {
                    connection.sunsubscribe(channel).await
                };
                if changed.is_err() {
                    // Whether a confirmation comes is unknown: one that does wakes the
                    // key's waiters once more, for nothing.
                    confirming.take(channel, subscribe);
                }
                changed
            }
        }
    }

    /// Whether the master serving the key whose channel is `channel` answers (`EXISTS`
    /// on the channel's name, routed by its slot: the key's).
    async fn answers_for(&mut self, channel: &str) -> RedisResult<()> {
        match self {
            Sink::Server(_) => Ok(()),
            Sink::Cluster { connection, .. } => {
                let exists = redis::cmd("EXISTS").arg(channel).to_owned();
                exists.query_async::<i64>(connection).await.map(drop)
            }
        }
    }
}

/// One pub/sub connection per store, shared by every waiter.
pub(super) struct Subscriber {
    source: Source,
    announcements: Announcements,
    timeout: Duration,
    state: Arc<tokio::sync::Mutex<State>>,
    /// Set while a round of [`subscribe_again`](Self::subscribe_again) waits to start:
    /// a node lost is reported several times (each reconnection that fails), and one
    /// round answers them all.
    again_pending: AtomicBool,
    /// Checks the records that signed messages carry; without it, a message only wakes
    /// the waiters to read.
    signer: Mutex<Option<Arc<Signer>>>,
}

#[derive(Default)]
struct State {
    /// The live connection; `None` before the first watch and after the connection is
    /// lost or given up.
    connection: Option<Live>,
    /// How many connections were opened: each one's number tells its relay whether it is
    /// still the live one when its messages end.
    opened: u64,
    /// The channels subscribed to, each with the subscription its watches share (gone
    /// once the last of them is, until its unsubscribing runs).
    channels: HashMap<String, Weak<Subscription>>,
}

/// The live pub/sub connection: its command half, and the task that relays its messages.
/// Giving it up (dropping it) stops the relay, which holds the connection's read half:
/// dropping the command half alone would leave the socket open and subscribed for good.
struct Live {
    sink: Sink,
    number: u64,
    relay: tokio::task::AbortHandle,
}

impl Drop for Live {
    fn drop(&mut self) {
        self.relay.abort();
    }
}

/// A subscription to one key's channel, shared by every watch on the key and ended with
/// the last: a thousand waiters going at once let go of it once, not a thousand times.
pub(super) struct Subscription {
    subscriber: Arc<Subscriber>,
    channel: String,
}

impl Subscriber {
    pub(super) fn new(source: Source, announcements: Announcements, timeout: Duration) -> Self {
        Self {
            source,
            announcements,
            timeout,
            state: Arc::default(),
            again_pending: AtomicBool::new(false),
            signer: Mutex::new(None),
        }
    }

    /// Takes the records of messages that `signer`'s secret signed.
    pub(super) fn verify_with(&self, signer: Arc<Signer>) {
        *self.signer.lock().unwrap_or_else(PoisonError::into_inner) = Some(signer);
    }

    /// Relays what was published on `channel`.
    fn heard(&self, channel: &str, payload: &[u8]) {
        let signer = self
            .signer
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        heard(&self.announcements, signer.as_deref(), channel, payload);
    }

    /// The board the store's waiters watch, and its own writes announce on.
    pub(super) fn announcements(&self) -> &Announcements {
        &self.announcements
    }

    /// Subscribes to `channel` (a key's channel), connecting first if needed. Returns once
    /// Redis confirmed it: every message published after that is relayed.
    pub(super) async fn subscribe(
        self: &Arc<Self>,
        channel: &str,
    ) -> RedisResult<Arc<Subscription>> {
        let mut state = self.state.lock().await;
        let subscribed = async {
            let live = state.channels.get(channel).and_then(Weak::upgrade);
            if let (Some(_), Some(live)) = (&state.connection, live) {
                return Ok(live);
            }
            let mut sink = match &state.connection {
                Some(connection) => connection.sink.clone(),
                None => self.connect(&mut state).await?,
            };
            sink.subscribe(channel).await?;
            let subscription = Arc::new(Subscription {
                subscriber: Arc::clone(self),
                channel: channel.to_owned(),
            });
            // Watches still holding an earlier subscription to the channel (made before
            // the connection was lost) leave it to this one when they go.
            let held = Arc::downgrade(&subscription);
            state.channels.insert(channel.to_owned(), held);
            Ok(subscription)
        };
        match tokio::time::timeout(self.timeout, subscribed).await {
            Ok(Ok(subscription)) => Ok(subscription),
            Ok(Err(error)) => {
                self.give_up(&mut state);
                Err(error)
            }
            Err(_) => {
                self.give_up(&mut state);
                Err((ErrorKind::Io, "no answer to SUBSCRIBE in time").into())
            }
        }
    }

    /// Closes the connection, unsure where it stands (a command failed or went
    /// unanswered); if keys are still watched, connects again in the background, which
    /// subscribes to their channels and wakes their waiters to read.
    fn give_up(self: &Arc<Self>, state: &mut State) {
        state.connection = None;
        if !state.channels.is_empty() {
            tokio::spawn(Arc::clone(self).reconnect());
        }
    }

    /// The connection numbered `number` ended its messages (its socket closed): connect
    /// again if it was the live one; a connection opened since has its own relay.
    async fn ended(self: Arc<Self>, number: u64) {
        let mut state = self.state.lock().await;
        let live = state
            .connection
            .as_ref()
            .map(|connection| connection.number);
        if live.is_none() || live == Some(number) {
            // Giving the connection up stops its relay, the task running this: connecting
            // again goes on in a task of its own.
            self.give_up(&mut state);
        }
    }

    /// Makes `sink` the live connection, its messages relayed by `relay` (started once
    /// the connection's number is known).
    fn go_live<F>(state: &mut State, sink: &Sink, relay: impl FnOnce(u64) -> F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        state.opened += 1;
        let number = state.opened;
        let relay = tokio::spawn(relay(number)).abort_handle();
        state.connection = Some(Live {
            sink: sink.clone(),
            number,
            relay,
        });
    }

    /// Opens the connection, subscribes to every channel still watched, and starts
    /// relaying its messages.
    async fn connect(self: &Arc<Self>, state: &mut State) -> RedisResult<Sink> {
        if let Source::Cluster(seeds) = &self.source {
            return self.connect_cluster(seeds.clone(), state).await;
        }
        let pubsub = match &self.source {
            Source::Servers(clients) => {
                let mut last = None;
                let mut opened = None;
                for client in clients {
                    match client.get_async_pubsub().await {
                        Ok(pubsub) => {
                            opened = Some(pubsub);
                            break;
                        }
                        Err(error) => last = Some(error),
                    }
                }
                opened.ok_or_else(|| {
                    last.unwrap_or_else(|| (ErrorKind::Client, "no server to subscribe on").into())
                })?
            }
            Source::Sentinel(primary) => primary.client().await?.get_async_pubsub().await?,
            Source::Cluster(_) => unreachable!("a cluster connects above"),
        };
        let (sink, mut messages) = pubsub.split();
        let mut sink = Sink::Server(sink);
        for channel in state.channels.keys() {
            sink.subscribe(channel).await?;
        }
        let subscriber = Arc::downgrade(self);
        Self::go_live(state, &sink, |number| async move {
            while let Some(message) = messages.next().await {
                let Some(subscriber) = subscriber.upgrade() else {
                    return;
                };
                subscriber.heard(message.get_channel_name(), message.get_payload_bytes());
            }
            // The connection is gone: what was published meanwhile is lost. Reconnect
            // while anybody waits, then wake every waiter to read its key again.
            if let Some(subscriber) = subscriber.upgrade() {
                subscriber.ended(number).await;
            }
        });
        Ok(sink)
    }

    /// Opens a cluster connection whose node connections hand their pushes to a relay,
    /// subscribes to every channel still watched, and starts relaying.
    async fn connect_cluster(
        self: &Arc<Self>,
        seeds: Vec<ConnectionInfo>,
        state: &mut State,
    ) -> RedisResult<Sink> {
        let (pushes, received) = mpsc::unbounded_channel::<PushInfo>();
        let client = ClusterClient::builder(seeds)
            .connection_timeout(CONNECTION_TIMEOUT)
            .response_timeout(self.timeout)
            .tcp_settings(nodelay())
            .use_protocol(ProtocolVersion::RESP3)
            .push_sender(pushes)
            .build()?;
        let confirming = Arc::new(Confirming::default());
        let mut sink = Sink::Cluster {
            connection: client.get_async_connection().await?,
            confirming: Arc::clone(&confirming),
        };
        for channel in state.channels.keys() {
            sink.subscribe(channel).await?;
        }
        let subscriber = Arc::downgrade(self);
        Self::go_live(state, &sink, |number| {
            relay_shard_pushes(subscriber, received, confirming, number)
        });
        Ok(sink)
    }

    /// After the cluster connection lost a node or a subscription: subscribes again to
    /// every channel still watched (each goes to its slot's master now, found again if the
    /// old one is gone), then wakes its waiters, who read their keys again (what was
    /// published meanwhile is lost). Woken only once the master serving the key answers
    /// (a replica may confirm a shard subscription before it is promoted): their reads
    /// would fail before. Until then, waiters fall back on their leases.
    fn subscribe_again(self: Arc<Self>) {
        if self.again_pending.swap(true, Ordering::AcqRel) {
            return;
        }
        tokio::spawn(async move {
            let mut delay = RECONNECT_MIN_DELAY;
            loop {
                let state = self.state.lock().await;
                // What is reported from now on may need another round.
                self.again_pending.store(false, Ordering::Release);
                let Some(mut sink) = state.connection.as_ref().map(|live| live.sink.clone()) else {
                    // Connecting again subscribes to every channel, and wakes its waiters.
                    return;
                };
                let channels: Vec<String> = state.channels.keys().cloned().collect();
                let mut failed = false;
                for channel in &channels {
                    let again = async {
                        sink.subscribe(channel).await?;
                        sink.answers_for(channel).await
                    };
                    if matches!(tokio::time::timeout(self.timeout, again).await, Ok(Ok(()))) {
                        self.announcements.announce(channel);
                    } else {
                        failed = true;
                    }
                }
                if !failed {
                    return;
                }
                drop(state);
                tracing::warn!("could not subscribe again to Redis announcements: waiters fall back on their leases");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(RECONNECT_MAX_DELAY);
            }
        });
    }

    /// Connects again while keys are watched, unless a watch already did, then wakes
    /// every waiter to read its key again: what was published meanwhile is lost.
    ///
    /// Boxed, and `Send` said outright: it runs in a task of its own, and calls `connect`,
    /// whose relay may call it again.
    fn reconnect(self: Arc<Self>) -> Pin<Box<dyn Future<Output = ()> + Send>> {
        Box::pin(async move {
            let mut delay = RECONNECT_MIN_DELAY;
            loop {
                let mut state = self.state.lock().await;
                if state.channels.is_empty() {
                    return;
                }
                let connected = match state.connection {
                    Some(_) => Ok(()),
                    None => tokio::time::timeout(self.timeout, self.connect(&mut state))
                        .await
                        .unwrap_or_else(|_| Err((ErrorKind::Io, "no answer in time").into()))
                        .map(drop),
                };
                for channel in state.channels.keys() {
                    self.announcements.announce(channel);
                }
                if let Err(error) = connected {
                    tracing::warn!(%error, "could not resubscribe to Redis announcements: waiters fall back on their leases");
                } else {
                    return;
                }
                drop(state);
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(RECONNECT_MAX_DELAY);
            }
        })
    }

    /// Unsubscribes from `channel`, whose last watch went, unless a watch made since
    /// subscribed to it again.
    async fn release(self: Arc<Self>, channel: &str) {
        let mut state = self.state.lock().await;
        if !state.channels.get(channel).is_some_and(unheld) {
            return;
        }
        state.channels.remove(channel);
        if let Some(mut sink) = state.connection.as_ref().map(|live| live.sink.clone()) {
            let unsubscribed = tokio::time::timeout(self.timeout, sink.unsubscribe(channel));
            if !matches!(unsubscribed.await, Ok(Ok(()))) {
                self.give_up(&mut state);
            }
        }
    }

    /// How many channels are subscribed to now.
    pub(super) async fn channels(&self) -> usize {
        self.state.lock().await.channels.len()
    }
}

/// Relays a cluster connection's pushes: each shard message wakes its key's waiters; a
/// subscription the connection made again, or the server dropped, may have missed
/// messages, and wakes them too; a lost node's subscriptions are made again.
async fn relay_shard_pushes(
    subscriber: Weak<Subscriber>,
    mut pushes: mpsc::UnboundedReceiver<PushInfo>,
    confirming: Arc<Confirming>,
    number: u64,
) {
    while let Some(push) = pushes.recv().await {
        let Some(subscriber) = subscriber.upgrade() else {
            return;
        };
        let channel = push.data.first().and_then(channel_name);
        match (push.kind, channel) {
            (PushKind::SMessage, Some(channel)) => {
                let payload = match push.data.get(1) {
                    Some(Value::BulkString(payload)) => payload.as_slice(),
                    _ => &[],
                };
                subscriber.heard(&channel, payload);
            }
            // Not asked for: the cluster connection subscribed again after losing a node,
            // or the server dropped the subscription (its slot left the node). Either way
            // messages may have been lost: subscribed again where the slot is now.
            (PushKind::SSubscribe, Some(channel)) if !confirming.take(&channel, true) => {
                subscriber.subscribe_again();
            }
            (PushKind::SUnsubscribe, Some(channel)) if !confirming.take(&channel, false) => {
                subscriber.subscribe_again();
            }
            (PushKind::Disconnection, _) => {
                subscriber.subscribe_again();
            }
            _ => {}
        }
    }
    // The cluster connection closed: its subscriptions went with it.
    if let Some(subscriber) = subscriber.upgrade() {
        subscriber.ended(number).await;
    }
}

/// Announces what was published on `channel` (a key's channel): the end of the claim whose
/// token begins the payload, which wakes the key's waiters to read it, or, when `signer`
/// verifies the signed value that follows the token, hands them its record. Who published
/// cannot be told: a payload shorter than a token wakes nobody, and one whose value does
/// not verify is only the end of a claim.
///
/// A signature is checked only for a key watched here, only for a value no larger than a
/// store sends, and outside the board's lock: whoever can publish could otherwise make
/// every announcement in the process wait on checks of large made-up payloads.
fn heard(announcements: &Announcements, signer: Option<&Signer>, channel: &str, payload: &[u8]) {
    let Some((token, signed)) = payload.split_first_chunk::<16>() else {
        return;
    };
    let token = ClaimToken::from_bytes(*token);
    let checked = signer.filter(|_| {
        !signed.is_empty()
            && signed.len() <= ANNOUNCED_VALUE_MAX + SIGNATURE_LEN
            && announcements.is_watched(channel)
    });
    match checked.and_then(|signer| announced_record(signer.open(channel, token, signed)?)) {
        Some(record) => announcements.announce_end_with(channel, token, || Some(record)),
        None => announcements.announce_end(channel, token),
    }
}

/// A push's channel, as the board names keys.
fn channel_name(value: &Value) -> Option<String> {
    match value {
        Value::BulkString(bytes) => Some(String::from_utf8_lossy(bytes).into_owned()),
        Value::SimpleString(name) => Some(name.clone()),
        _ => None,
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        let (subscriber, channel) = (
            Arc::clone(&self.subscriber),
            std::mem::take(&mut self.channel),
        );
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn(async move { subscriber.release(&channel).await });
            }
            // No runtime to unsubscribe on: the channel is still forgotten, so that it is
            // not kept for nobody; the connection goes with its runtime anyway.
            Err(_) => {
                if let Ok(mut state) = subscriber.state.try_lock() {
                    if state.channels.get(&channel).is_some_and(unheld) {
                        state.channels.remove(&channel);
                    }
                }
            }
        }
    }
}

/// Whether no watch holds a channel's subscription any more.
fn unheld(subscription: &Weak<Subscription>) -> bool {
    subscription.strong_count() == 0
}

impl fmt::Debug for Subscriber {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Subscriber").finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;

    use bytes::BufMut;

    use super::*;
    use crate::{
        store::{record::put_completed, redis::WITH_EXPIRY, Claim},
        Fingerprint, StoredResponse,
    };

    /// A completed value as Redis stores it, kept a minute more.
    fn value() -> Vec<u8> {
        let response = StoredResponse {
            status: http::StatusCode::CREATED,
            headers: http::HeaderMap::new(),
            body: bytes::Bytes::from_static(b"{\"id\":\"pay_1\"}"),
            trailers: None,
        };
        let mut value = bytes::BytesMut::new();
        value.put_u8(WITH_EXPIRY);
        put_completed(&mut value, &Fingerprint::from_bytes([7; 32]), &response);
        value.put_u64(super::super::deadline(Duration::from_secs(60)));
        value.to_vec()
    }

    /// A message that signer `secret` made for `channel`: the token, the value, the
    /// signature.
    fn signed(secret: &[u8], channel: &str, token: ClaimToken) -> Vec<u8> {
        let value = value();
        let mut payload = token.as_bytes().to_vec();
        payload.extend_from_slice(&value);
        payload.extend_from_slice(&Signer::new(secret, 0).sign(channel, token, &value));
        payload
    }

    /// How many reads the waiter on `channel` makes after `payload` is heard there by a
    /// subscriber with `signer`.
    async fn reads_after(signer: Option<&Signer>, channel: &str, payload: &[u8]) -> usize {
        let board = Announcements::new();
        let mut watch = board.watch(channel);
        heard(&board, signer, channel, payload);
        let woken = tokio::time::timeout(Duration::from_secs(1), watch.announced()).await;
        woken.expect("woken");
        let reads = AtomicUsize::new(0);
        let read = || async {
            reads.fetch_add(1, Ordering::SeqCst);
            Ok(Claim::Claimed(ClaimToken::unique()))
        };
        let fingerprint = Fingerprint::from_bytes([7; 32]);
        let found = watch.read_shared(fingerprint, Duration::from_secs(1), read);
        if let Claim::Completed { response, .. } = found.await.unwrap() {
            assert_eq!(&response.body[..], b"{\"id\":\"pay_1\"}");
        }
        reads.load(Ordering::SeqCst)
    }

    #[tokio::test]
    async fn a_record_is_handed_over_only_when_its_signature_checks() {
        let (channel, token) = ("idempotency-ended:aa{0}", ClaimToken::unique());
        let signer = Signer::new(b"secret", 0);
        let genuine = signed(b"secret", channel, token);
        assert_eq!(reads_after(Some(&signer), channel, &genuine).await, 0);
        // Without the secret, signed by another, or for another key's channel: read.
        assert_eq!(reads_after(None, channel, &genuine).await, 1);
        let other = signed(b"another", channel, token);
        assert_eq!(reads_after(Some(&signer), channel, &other).await, 1);
        let moved = signed(b"secret", "idempotency-ended:bb{0}", token);
        assert_eq!(reads_after(Some(&signer), channel, &moved).await, 1);
        let unsigned = [token.as_bytes().as_slice(), &value()].concat();
        assert_eq!(reads_after(Some(&signer), channel, &unsigned).await, 1);
    }

    #[tokio::test]
    async fn a_payload_larger_than_a_store_sends_is_not_checked_and_only_wakes() {
        let (channel, token) = ("idempotency-ended:aa{0}", ClaimToken::unique());
        let signer = Signer::new(b"secret", 0);
        let mut huge = token.as_bytes().to_vec();
        huge.resize(16 + ANNOUNCED_VALUE_MAX + SIGNATURE_LEN + 1, b'x');
        assert_eq!(reads_after(Some(&signer), channel, &huge).await, 1);
    }

    #[tokio::test]
    async fn a_payload_shorter_than_a_token_wakes_nobody() {
        let board = Announcements::new();
        let mut watch = board.watch("c");
        heard(&board, None, "c", &[1; 15]);
        let woken = tokio::time::timeout(Duration::from_millis(50), watch.announced()).await;
        assert!(woken.is_err());
    }
}
