//! Completions and releases announced by any instance, relayed from Redis pub/sub to the
//! store's waiters.
//!
//! The fenced scripts `PUBLISH` on a channel named as the key they wrote; a store
//! subscribes, on one connection of its own, to the channels of the keys its requests wait
//! on, and only while they wait: a completion nobody waits for reaches no client.

use std::{collections::HashMap, fmt, future::Future, pin::Pin, sync::Arc, time::Duration};

use futures_util::StreamExt;
use redis::{aio::PubSubSink, Client, ErrorKind, RedisResult};

use super::primary::Primary;
use crate::store::Announcements;

/// The longest a reconnection waits between attempts while keys are watched.
const RECONNECT_MAX_DELAY: Duration = Duration::from_secs(1);
const RECONNECT_MIN_DELAY: Duration = Duration::from_millis(20);

/// Where the subscriber connects.
pub(super) enum Source {
    /// One server, or a cluster's seed nodes (a message published on any node of a
    /// cluster reaches every node): the first that answers.
    Servers(Vec<Client>),
    /// The primary Sentinel names now.
    Sentinel(Arc<Primary>),
}

/// One pub/sub connection per store, shared by every waiter.
pub(super) struct Subscriber {
    source: Source,
    announcements: Announcements,
    timeout: Duration,
    state: Arc<tokio::sync::Mutex<State>>,
}

#[derive(Default)]
struct State {
    /// The live connection's command half; `None` before the first watch and after the
    /// connection is lost.
    sink: Option<PubSubSink>,
    /// The channels subscribed to, and how many watches hold each.
    channels: HashMap<String, usize>,
}

/// A subscription to one key's channel, ended with the last watch that keeps it.
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
        }
    }

    /// The board the store's waiters watch, and its own writes announce on.
    pub(super) fn announcements(&self) -> &Announcements {
        &self.announcements
    }

    /// Subscribes to `channel` (a key's name), connecting first if needed. Returns once
    /// Redis confirmed it: every message published after that is relayed.
    pub(super) async fn subscribe(self: &Arc<Self>, channel: &str) -> RedisResult<Subscription> {
        let mut state = self.state.lock().await;
        let subscribed = async {
            if state.sink.is_some() {
                if let Some(count) = state.channels.get_mut(channel) {
                    *count += 1;
                    return Ok(());
                }
            }
            let mut sink = match state.sink.clone() {
                Some(sink) => sink,
                None => self.connect(&mut state).await?,
            };
            sink.subscribe(channel).await?;
            *state.channels.entry(channel.to_owned()).or_default() += 1;
            Ok(())
        };
        match tokio::time::timeout(self.timeout, subscribed).await {
            Ok(Ok(())) => Ok(Subscription {
                subscriber: Arc::clone(self),
                channel: channel.to_owned(),
            }),
            Ok(Err(error)) => {
                state.sink = None;
                Err(error)
            }
            Err(_) => {
                state.sink = None;
                Err((ErrorKind::Io, "no answer to SUBSCRIBE in time").into())
            }
        }
    }

    /// Opens the connection, subscribes to every channel still watched, and starts
    /// relaying its messages.
    async fn connect(self: &Arc<Self>, state: &mut State) -> RedisResult<PubSubSink> {
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
        };
        let (mut sink, mut messages) = pubsub.split();
        for channel in state.channels.keys() {
            sink.subscribe(channel).await?;
        }
        state.sink = Some(sink.clone());
        let subscriber = Arc::downgrade(self);
        let announcements = self.announcements.clone();
        tokio::spawn(async move {
            while let Some(message) = messages.next().await {
                announcements.announce(message.get_channel_name());
            }
            // The connection is gone: what was published meanwhile is lost. Reconnect
            // while anybody waits, then wake every waiter to read its key again.
            if let Some(subscriber) = subscriber.upgrade() {
                subscriber.reconnect().await;
            }
        });
        Ok(sink)
    }

    /// Boxed, and `Send` said outright: it runs in the task that `connect` starts, and
    /// calls `connect` again.
    fn reconnect(self: Arc<Self>) -> Pin<Box<dyn Future<Output = ()> + Send>> {
        Box::pin(async move {
            let mut delay = RECONNECT_MIN_DELAY;
            loop {
                let mut state = self.state.lock().await;
                state.sink = None;
                if state.channels.is_empty() {
                    return;
                }
                let connected = tokio::time::timeout(self.timeout, self.connect(&mut state)).await;
                match connected.unwrap_or_else(|_| Err((ErrorKind::Io, "no answer in time").into()))
                {
                    Ok(_) => {
                        for channel in state.channels.keys() {
                            self.announcements.announce(channel);
                        }
                        return;
                    }
                    Err(error) => {
                        tracing::warn!(%error, "could not resubscribe to Redis announcements: waiters fall back on their leases");
                        for channel in state.channels.keys() {
                            self.announcements.announce(channel);
                        }
                    }
                }
                drop(state);
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(RECONNECT_MAX_DELAY);
            }
        })
    }

    /// Lets go of one watch's hold on `channel`; the last one unsubscribes.
    async fn release(&self, channel: &str) {
        let mut state = self.state.lock().await;
        let Some(count) = state.channels.get_mut(channel) else {
            return;
        };
        *count -= 1;
        if *count > 0 {
            return;
        }
        state.channels.remove(channel);
        if let Some(mut sink) = state.sink.clone() {
            let unsubscribed = tokio::time::timeout(self.timeout, sink.unsubscribe(channel));
            if !matches!(unsubscribed.await, Ok(Ok(()))) {
                // Unsure where the connection stands: the next watch connects afresh.
                state.sink = None;
            }
        }
    }

    /// How many channels are subscribed to now.
    pub(super) async fn channels(&self) -> usize {
        self.state.lock().await.channels.len()
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
            // No runtime to unsubscribe on: the count still drops, so that the channel is
            // not kept for nobody; the connection goes with its runtime anyway.
            Err(_) => {
                if let Ok(mut state) = subscriber.state.try_lock() {
                    if let Some(count) = state.channels.get_mut(&channel) {
                        *count -= 1;
                        if *count == 0 {
                            state.channels.remove(&channel);
                        }
                    }
                }
            }
        }
    }
}

impl fmt::Debug for Subscriber {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Subscriber").finish_non_exhaustive()
    }
}
