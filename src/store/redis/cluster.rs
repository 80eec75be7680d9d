//! A Redis Cluster: each command goes to the master holding its key, through the `redis`
//! crate's cluster connection, which keeps one multiplexed connection per node, follows
//! `MOVED` and `ASK`, refreshes its own slot map and retries what a failed node dropped.
//!
//! Batched per master, as on one server: a batch's commands are grouped by the master
//! that serves their key's slot, as `CLUSTER SLOTS` last said, and each group goes to its
//! master as one pipeline. A command answered with a redirect (a slot moved, a replica was
//! promoted) goes again alone, which follows the redirect, and the slot map is read again;
//! so does every command of a group whose master could not be reached.

use std::{
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, PoisonError, RwLock,
    },
    time::Duration,
};

use futures_util::future::join_all;
use redis::{
    aio::ConnectionLike,
    cluster::ClusterClient,
    cluster_async::ClusterConnection,
    cluster_routing::{RoutingInfo, SingleNodeRoutingInfo},
    Cmd, ErrorKind, Pipeline, RedisError, RedisResult, ServerErrorKind, Value,
};

use super::{
    auto_pipeline::{Batch, BatchSink, Queued, Reply, Unawaited},
    replicas::{Replicas, Replied},
};

/// Slots of a Redis Cluster.
pub(super) const SLOTS: usize = 16384;
/// How often an acknowledged command follows its slot elsewhere before it fails.
const MAX_REDIRECTS: usize = 3;
/// The least time between two readings of the slot map: during a failover every batch
/// would otherwise ask again.
const REFRESH_INTERVAL: Duration = Duration::from_millis(100);

/// Commands to a Redis Cluster.
pub(super) struct Cluster {
    connection: ClusterConnection,
    slots: RwLock<Arc<SlotMap>>,
    /// Set while the slot map is being read again (or was read too recently).
    refreshing: AtomicBool,
}

/// Which master serves each slot, as `CLUSTER SLOTS` said.
#[derive(Default)]
struct SlotMap {
    masters: Vec<(String, u16)>,
    /// The index in `masters` of each slot's master; `None` where no master was named.
    owners: Vec<Option<u16>>,
}

impl SlotMap {
    fn master_of(&self, slot: u16) -> Option<u16> {
        self.owners.get(usize::from(slot)).copied().flatten()
    }
}

impl Cluster {
    pub(super) async fn connect(client: &ClusterClient) -> RedisResult<Self> {
        let cluster = Self {
            connection: client.get_async_connection().await?,
            slots: RwLock::new(Arc::default()),
            refreshing: AtomicBool::new(false),
        };
        // Without a map, every command goes alone until the first redirect reads one.
        if let Err(error) = cluster.read_slots().await {
            tracing::warn!(%error, "could not read the cluster's slots: commands go one by one");
        }
        Ok(cluster)
    }

    /// Reads which master serves each slot.
    async fn read_slots(&self) -> RedisResult<()> {
        let mut command = redis::cmd("CLUSTER");
        command.arg("SLOTS");
        let any = RoutingInfo::SingleNode(SingleNodeRoutingInfo::Random);
        let reply = self.connection.clone().route_command(command, any).await?;
        let map = parse_slots(reply)?;
        *self.slots.write().unwrap_or_else(PoisonError::into_inner) = Arc::new(map);
        Ok(())
    }

    /// Reads the slot map again, in the background.
    fn refresh(self: &Arc<Self>) {
        if self.refreshing.swap(true, Ordering::AcqRel) {
            return;
        }
        let cluster = Arc::clone(self);
        tokio::spawn(async move {
            if let Err(error) = cluster.read_slots().await {
                tracing::debug!(%error, "could not read the cluster's slots");
            }
            tokio::time::sleep(REFRESH_INTERVAL).await;
            cluster.refreshing.store(false, Ordering::Release);
        });
    }

    /// Sends `command` on its own, routed by the cluster connection (which follows
    /// redirects); with `acks`, with its `WAIT`.
    async fn alone(&self, command: &Cmd, acks: Option<Replicas>) -> RedisResult<Replied> {
        let mut connection = self.connection.clone();
        match acks {
            None => connection
                .req_packed_command(command)
                .await?
                .extract_error()
                .map(Replied::plain),
            Some(acks) => acknowledged(&mut connection, command, acks).await,
        }
    }

    /// Sends commands one by one, concurrently, each answered on its own; a claim whose
    /// caller stopped waiting is left out. A claim sent again after its pipeline failed
    /// may otherwise arrive after the caller, having answered `503`, released the key:
    /// it would hold the key, for a whole lease, for a request that is gone.
    async fn each_alone(&self, commands: Vec<(Cmd, Option<Replicas>, Reply, Unawaited)>) {
        join_all(
            commands
                .into_iter()
                .filter(|(_, _, reply, unawaited)| unawaited.sent(reply))
                .map(|(command, acks, reply, _)| async move {
                    let _ = reply.send(self.alone(&command, acks).await);
                }),
        )
        .await;
    }

    /// Sends the commands of one master as one pipeline.
    async fn send_to(self: Arc<Self>, master: Option<(String, u16)>, group: Vec<Queued>) {
        let Some((host, port)) = master else {
            let alone = group
                .into_iter()
                .map(|queued| (queued.command, queued.acks, queued.reply, queued.unawaited))
                .collect();
            return self.each_alone(alone).await;
        };
        let batch = Batch::new(group);
        let route = SingleNodeRoutingInfo::ByAddress { host, port };
        let answered = self
            .connection
            .clone()
            .route_pipeline(batch.pipeline.clone(), 0, batch.expected(), route)
            .await
            .and_then(|values| batch.results(values));
        let Batch {
            pipeline,
            replies,
            acks,
            ..
        } = batch;
        let commands = pipeline.cmd_iter().cloned().zip(acks).zip(replies);
        let again: Vec<_> = match answered {
            Ok(results) => commands
                .zip(results)
                .filter_map(
                    |(((command, acks), (reply, unawaited)), result)| match result {
                        Err(error) if redirected(&error) => Some((command, acks, reply, unawaited)),
                        result => {
                            let _ = reply.send(result);
                            None
                        }
                    },
                )
                .collect(),
            // The master is gone or unreachable: the cluster connection finds its slots'
            // new master for each command.
            Err(_) => commands
                .map(|((command, acks), (reply, unawaited))| (command, acks, reply, unawaited))
                .collect(),
        };
        if !again.is_empty() {
            self.refresh();
            self.each_alone(again).await;
        }
    }
}

/// A cluster takes a batch as one pipeline per master.
impl BatchSink for Cluster {
    async fn revive(&self) {}

    async fn send(self: Arc<Self>, batch: Vec<Queued>) {
        let map = Arc::clone(&self.slots.read().unwrap_or_else(PoisonError::into_inner));
        // A handful of masters: a list is quicker than a map.
        let mut groups: Vec<(Option<u16>, Vec<Queued>)> = Vec::new();
        for queued in batch {
            let master = map.master_of(queued.slot);
            match groups.iter_mut().find(|(m, _)| *m == master) {
                Some((_, group)) => group.push(queued),
                None => groups.push((master, vec![queued])),
            }
        }
        join_all(groups.into_iter().map(|(master, group)| {
            let address = master.and_then(|m| map.masters.get(usize::from(m)).cloned());
            Arc::clone(&self).send_to(address, group)
        }))
        .await;
    }
}

/// The slot map in a `CLUSTER SLOTS` reply: `[[start, end, [host, port, ..], replicas..]..]`.
fn parse_slots(reply: Value) -> RedisResult<SlotMap> {
    let malformed = |what: &str| {
        RedisError::from((
            ErrorKind::Client,
            "unexpected CLUSTER SLOTS reply",
            what.to_owned(),
        ))
    };
    let Value::Array(ranges) = reply else {
        return Err(malformed("not an array"));
    };
    let mut map = SlotMap {
        masters: Vec::new(),
        owners: vec![None; SLOTS],
    };
    for range in ranges {
        let Value::Array(range) = range else {
            return Err(malformed("a range is not an array"));
        };
        let (Some(Value::Int(start)), Some(Value::Int(end)), Some(Value::Array(master))) =
            (range.first(), range.get(1), range.get(2))
        else {
            return Err(malformed("a range without its start, end and master"));
        };
        let host = match master.first() {
            Some(Value::BulkString(host)) => String::from_utf8_lossy(host).into_owned(),
            Some(Value::SimpleString(host)) => host.clone(),
            _ => return Err(malformed("a master without its host")),
        };
        let Some(Value::Int(port)) = master.get(1) else {
            return Err(malformed("a master without its port"));
        };
        let port = u16::try_from(*port).map_err(|_| malformed("a port out of range"))?;
        if host.is_empty() {
            // A node that does not know its own address: its slots go one by one.
            continue;
        }
        let index = match map.masters.iter().position(|m| *m == (host.clone(), port)) {
            Some(index) => index,
            None => {
                map.masters.push((host, port));
                map.masters.len() - 1
            }
        };
        let index = u16::try_from(index).map_err(|_| malformed("too many masters"))?;
        let (start, end) = (usize::try_from(*start), usize::try_from(*end));
        let (Ok(start), Ok(end)) = (start, end) else {
            return Err(malformed("a slot out of range"));
        };
        for owner in map.owners.iter_mut().take(end + 1).skip(start) {
            *owner = Some(index);
        }
    }
    Ok(map)
}

/// Sends `command` and a `WAIT` for `acks` as one pipeline, so that both go to the key's
/// master on one connection, and are sent again together if the cluster connection resends
/// them (on a new connection, or to a promoted replica): a `WAIT` counts the writes of the
/// connection it arrives on, and every command sent this way writes, even when sent again.
/// A pipeline's redirect comes back as its command's reply: the command then goes alone,
/// which follows the redirect and refreshes the slot map, and the pair is sent again.
async fn acknowledged(
    connection: &mut ClusterConnection,
    command: &Cmd,
    acks: Replicas,
) -> RedisResult<Replied> {
    let mut pipeline = Pipeline::with_capacity(2);
    pipeline
        .add_command(command.clone())
        .add_command(acks.command());
    let mut redirects = 0;
    loop {
        let mut replies = connection.req_packed_commands(&pipeline, 0, 2).await?;
        let wait = replies.pop();
        let reply = replies.pop().unwrap_or(Value::Nil).extract_error();
        match reply {
            Err(error) if redirected(&error) && redirects < MAX_REDIRECTS => {
                redirects += 1;
                connection
                    .req_packed_command(command)
                    .await?
                    .extract_error()?;
            }
            Err(error) => return Err(error),
            Ok(value) => return Ok(acks.replied(value, wait.as_ref())),
        }
    }
}

/// Whether a reply says the key's slot is served elsewhere, or not served yet.
fn redirected(error: &RedisError) -> bool {
    matches!(
        error.kind(),
        ErrorKind::Server(
            ServerErrorKind::Moved
                | ServerErrorKind::Ask
                | ServerErrorKind::TryAgain
                | ServerErrorKind::ClusterDown
                | ServerErrorKind::MasterDown
                | ServerErrorKind::ReadOnly
        )
    )
}

/// The cluster slot of `key`: CRC16 of the key, or of its `{hash tag}`, modulo 16384.
pub(super) fn slot(key: &[u8]) -> u16 {
    let tagged = key
        .iter()
        .position(|&b| b == b'{')
        .and_then(|open| {
            let rest = &key[open + 1..];
            rest.iter()
                .position(|&b| b == b'}')
                .filter(|&close| close > 0)
                .map(|close| &rest[..close])
        })
        .unwrap_or(key);
    crc16::State::<crc16::XMODEM>::calculate(tagged) % SLOTS as u16
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_match_redis() {
        // Values from `CLUSTER KEYSLOT`.
        assert_eq!(slot(b"foo"), 12182);
        assert_eq!(slot(b"bar"), 5061);
        assert_eq!(slot(b"test:abc:0123:xyz"), 12393);
        assert_eq!(slot(b"user1000"), 3443);
        assert_eq!(slot(b"{user1000}.following"), 3443);
        // An empty tag hashes the whole key.
        assert_eq!(slot(b"{}foo"), 9500);
    }

    #[test]
    fn slot_map_names_each_slots_master() {
        let node = |host: &str, port: i64| {
            Value::Array(vec![
                Value::BulkString(host.as_bytes().to_vec()),
                Value::Int(port),
                Value::BulkString(b"id".to_vec()),
            ])
        };
        let range = |start: i64, end: i64, master: Value| {
            Value::Array(vec![
                Value::Int(start),
                Value::Int(end),
                master,
                node("r", 1),
            ])
        };
        let reply = Value::Array(vec![
            range(0, 5460, node("10.0.0.1", 7000)),
            range(5461, 10922, node("10.0.0.2", 7000)),
            range(10923, 16383, node("10.0.0.1", 7000)),
        ]);
        let map = parse_slots(reply).unwrap();
        assert_eq!(map.masters.len(), 2);
        assert_eq!(map.master_of(0), Some(0));
        assert_eq!(map.master_of(5461), Some(1));
        assert_eq!(map.master_of(16383), Some(0));
        assert!(parse_slots(Value::Int(1)).is_err());
    }
}
