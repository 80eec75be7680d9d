//! A Redis Cluster: each command goes to the master holding its key, through the `redis`
//! crate's cluster connection, which keeps one multiplexed connection per node, follows
//! `MOVED` and `ASK`, refreshes its slot map when slots move and retries what a failed
//! node dropped.
//!
//! Commands are not batched by this crate here: the cluster connection hands each node's
//! commands to that node's multiplexed connection, which writes what is queued together.

use std::time::Duration;

use redis::{
    aio::ConnectionLike, cluster::ClusterClient, cluster_async::ClusterConnection, Cmd, ErrorKind,
    Pipeline, RedisError, RedisResult, ServerErrorKind, Value,
};

use super::{
    auto_pipeline::{timed_out, Unawaited},
    replicas::Replicas,
};

/// How often an acknowledged command follows its slot elsewhere before it fails.
const MAX_REDIRECTS: usize = 3;

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

    /// Sends `command` to the master holding its key, and returns its reply within
    /// `timeout`. With `acks`, a `WAIT` follows it on the same connection.
    /// A command whose caller stops waiting is sent all the same (the cluster connection
    /// queues it at once); a fenced write also runs to the end of its `WAIT` and retries.
    pub(super) async fn query(
        &self,
        command: Cmd,
        timeout: Duration,
        unawaited: Unawaited,
        acks: Option<Replicas>,
    ) -> RedisResult<Value> {
        let mut connection = self.connection.clone();
        let request = async move {
            match acks {
                None => connection
                    .req_packed_command(&command)
                    .await?
                    .extract_error(),
                Some(acks) => acknowledged(&mut connection, &command, acks).await,
            }
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
) -> RedisResult<Value> {
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
            Ok(value) => {
                acks.check(wait.as_ref())?;
                return Ok(value);
            }
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
