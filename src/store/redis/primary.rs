//! Where a single-node store's commands go: a fixed server, or whichever server Sentinel
//! names primary now.
//!
//! A fixed server keeps one reconnecting connection for good. Behind Sentinel, a connection
//! that fails (refused, dropped, timed out) or that finds its server demoted (`READONLY`)
//! makes the store ask the sentinels where the primary is; when they name another server,
//! later batches go to a new connection to it. No request waits on that question: the
//! ones that failed get their errors (and `503`), the next ones reach the new primary.

use std::{
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc, PoisonError, RwLock,
    },
    time::Duration,
};

use redis::{
    aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig},
    sentinel::SentinelClient,
    ConnectionAddr, ErrorKind, RedisError, RedisResult, ServerErrorKind,
};

use super::auto_pipeline::{Batch, BatchSink, Queued};

/// The least time between two questions to the sentinels: during a failover every failed
/// batch would otherwise ask again.
const RESOLVE_INTERVAL: Duration = Duration::from_millis(100);

/// The server a store writes to.
pub(super) struct Primary {
    connection: RwLock<Current>,
    /// How many times the store has followed Sentinel to another server.
    followed: AtomicU64,
    sentinel: Option<Follower>,
    /// The database of the primary's client (0 for a fixed server's connection, which does
    /// not tell).
    database: i64,
}

struct Current {
    connection: ConnectionManager,
    address: Option<ConnectionAddr>,
}

/// What it takes to find and connect to the primary Sentinel names.
struct Follower {
    client: tokio::sync::Mutex<SentinelClient>,
    config: ConnectionManagerConfig,
    /// Set while a question to the sentinels is under way (or was asked too recently).
    resolving: AtomicBool,
}

impl Primary {
    /// One server, for good.
    pub(super) fn fixed(connection: ConnectionManager) -> Self {
        Self {
            connection: RwLock::new(Current {
                connection,
                address: None,
            }),
            followed: AtomicU64::new(0),
            sentinel: None,
            database: 0,
        }
    }

    /// The primary `client`'s sentinels name now, followed through failovers.
    pub(super) async fn sentinel(
        mut client: SentinelClient,
        config: ConnectionManagerConfig,
    ) -> RedisResult<Self> {
        let primary = client.async_get_client().await?;
        let address = primary.get_connection_info().addr().clone();
        let database = primary.get_connection_info().redis_settings().db();
        let connection = ConnectionManager::new_with_config(primary, config.clone()).await?;
        Ok(Self {
            connection: RwLock::new(Current {
                connection,
                address: Some(address),
            }),
            followed: AtomicU64::new(0),
            sentinel: Some(Follower {
                client: tokio::sync::Mutex::new(client),
                config,
                resolving: AtomicBool::new(false),
            }),
            database,
        })
    }

    /// The database the keys are in, as far as the client tells.
    pub(super) fn database(&self) -> i64 {
        self.database
    }

    /// Which server the store writes to: a number that changes each time it follows
    /// Sentinel to another one (never, for a fixed server).
    pub(super) fn server(&self) -> u64 {
        self.followed.load(Ordering::Acquire)
    }

    /// A client for the primary the sentinels name now (for a connection of another kind
    /// than the store's own); an error for a fixed server, which keeps no client.
    pub(super) async fn client(&self) -> RedisResult<redis::Client> {
        match &self.sentinel {
            Some(follower) => follower.client.lock().await.async_get_client().await,
            None => Err((redis::ErrorKind::Client, "a fixed server keeps no client").into()),
        }
    }

    /// The connection to send the next batch on.
    pub(super) fn connection(&self) -> ConnectionManager {
        self.connection
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .connection
            .clone()
    }

    /// Told of an error from the current connection: behind Sentinel, one that may mean the
    /// primary moved makes the store ask where it is now (in the background).
    pub(super) fn suspect(self: &Arc<Self>, error: &RedisError) {
        let Some(follower) = &self.sentinel else {
            return;
        };
        if !may_mean_failover(error) || follower.resolving.swap(true, Ordering::AcqRel) {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            follower.resolving.store(false, Ordering::Release);
            return;
        };
        let primary = Arc::clone(self);
        runtime.spawn(async move {
            if let Err(error) = primary.follow().await {
                tracing::warn!(%error, "could not ask Sentinel for the Redis primary");
            }
            tokio::time::sleep(RESOLVE_INTERVAL).await;
            if let Some(follower) = &primary.sentinel {
                follower.resolving.store(false, Ordering::Release);
            }
        });
    }

    /// Asks the sentinels for the primary and, where they name another server, connects
    /// to it for the batches to come.
    async fn follow(&self) -> RedisResult<()> {
        let Some(follower) = &self.sentinel else {
            return Ok(());
        };
        let client = follower.client.lock().await.async_get_client().await?;
        let address = client.get_connection_info().addr().clone();
        let known = self
            .connection
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .address
            .clone();
        if known.as_ref() == Some(&address) {
            return Ok(());
        }
        let connection =
            ConnectionManager::new_with_config(client, follower.config.clone()).await?;
        tracing::info!(primary = %address, "Sentinel names a new Redis primary: following it");
        *self
            .connection
            .write()
            .unwrap_or_else(PoisonError::into_inner) = Current {
            connection,
            address: Some(address),
        };
        self.followed.fetch_add(1, Ordering::AcqRel);
        Ok(())
    }
}

/// One server takes a whole batch as one pipeline: one write and one read.
impl BatchSink for Primary {
    async fn revive(&self) {
        // The connection may be driven by a runtime that has shut down (the one the store
        // was opened in, or the one that ran the previous writer): a harmless command finds
        // it dead and starts a reconnection, rather than the first real batch failing on
        // it. One round trip per writer, which starts once per runtime.
        let _ = self
            .connection()
            .send_packed_command(&redis::cmd("PING"))
            .await;
    }

    async fn send(self: Arc<Self>, batch: Vec<Queued>) {
        let batch = Batch::new(batch);
        let answered = self
            .connection()
            .req_packed_commands(&batch.pipeline, 0, batch.expected())
            .await
            .and_then(|values| batch.results(values));
        match answered {
            Ok(results) => {
                for (result, (reply, _)) in results.into_iter().zip(batch.replies) {
                    if let Err(error) = &result {
                        self.suspect(error);
                    }
                    let _ = reply.send(result);
                }
            }
            Err(error) => {
                self.suspect(&error);
                for (reply, _) in batch.replies {
                    let _ = reply.send(Err(error.clone()));
                }
            }
        }
    }
}

/// Whether `error` may come from a primary that failed or was demoted, rather than from a
/// command Redis refused.
fn may_mean_failover(error: &RedisError) -> bool {
    matches!(
        error.kind(),
        ErrorKind::Io
            | ErrorKind::Server(
                ServerErrorKind::ReadOnly
                    | ServerErrorKind::MasterDown
                    | ServerErrorKind::BusyLoading
            )
    ) || error.is_timeout()
        || error.is_connection_dropped()
        || error.is_connection_refusal()
}
