//! A Redis Cluster: each command goes to the master holding its key, through the `redis`
//! crate's cluster connection, which keeps one multiplexed connection per node, follows
//! `MOVED` and `ASK`, refreshes its slot map when slots move and retries what a failed
//! node dropped.
//!
//! Commands are not batched by this crate here: the cluster connection hands each node's
//! commands to that node's multiplexed connection, which writes what is queued together.

use std::time::Duration;

use redis::{
    aio::ConnectionLike,
    cluster::ClusterClient,
    cluster_async::ClusterConnection,
    cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr},
    Cmd, RedisResult, Value,
};

use super::{
    auto_pipeline::{timed_out, Unawaited},
    replicas::Replicas,
};

/// Slots of a Redis Cluster.
const SLOTS: u16 = 16384;

/// Commands to a Redis Cluster.
pub(super) struct Cluster {
    connection: ClusterConnection,
}

impl Cluster {
    pub(super) async fn connect(client: &ClusterClient) -> RedisResult<Self> {
        Ok(Self {
            connection: client.get_async_connection().await?,
        })
    }

    /// Sends `command`, whose key is `key`, to the master holding the key, and returns its
    /// reply within `timeout`. With `acks`, a `WAIT` follows on the same node's connection.
    /// A command whose caller stops waiting is sent all the same (the cluster connection
    /// queues it at once); a fenced write also runs to the end of its `WAIT` and retries.
    pub(super) async fn query(
        &self,
        command: Cmd,
        key: &str,
        timeout: Duration,
        unawaited: Unawaited,
        acks: Option<Replicas>,
    ) -> RedisResult<Value> {
        let mut connection = self.connection.clone();
        let node = slot(key.as_bytes());
        let request = async move {
            let value = connection
                .req_packed_command(&command)
                .await?
                .extract_error()?;
            if let Some(acks) = acks {
                // The cluster connection keeps one connection per node: a `WAIT` routed to
                // the key's master follows the write on the connection that sent it.
                let master = Route::new(node, SlotAddr::Master);
                let route = RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(master));
                let acknowledged = connection.route_command(acks.command(), route).await?;
                acks.check(Some(&acknowledged))?;
            }
            Ok(value)
        };
        let answered = match unawaited {
            Unawaited::Skip => tokio::time::timeout(timeout, request).await,
            Unawaited::Send => {
                let running = tokio::spawn(request);
                match tokio::time::timeout(timeout, running).await {
                    Ok(Ok(reply)) => Ok(reply),
                    Ok(Err(_)) => return Err(timed_out(timeout)),
                    Err(elapsed) => Err(elapsed),
                }
            }
        };
        answered.map_err(|_| timed_out(timeout))?
    }
}

/// The cluster slot of `key` (CRC16 of the key, or of its `{hash tag}`, modulo 16384).
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
    crc16::State::<crc16::XMODEM>::calculate(tagged) % SLOTS
}

#[cfg(test)]
mod tests {
    use super::slot;

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
}
