//! Auto-pipelining: the commands that concurrent requests issue in one turn of the runtime
//! reach Redis in one write and come back in one read.
//!
//! A command sent on its own costs the sending core a system call and the kernel's whole
//! loopback (or network) send path, more than the rest of a request's work together. Here a
//! request queues its command and awaits the reply; one writer task waits for every task
//! that is ready to run to have had its turn (and so queued its own commands), then sends
//! all that is queued as one [`Pipeline`] and hands each reply back. An idle server pays one
//! scheduler turn per command; a loaded one pays one write for many.

use std::{
    future::Future,
    io,
    sync::{Arc, PoisonError, RwLock},
    time::Duration,
};

use futures_util::stream::{FuturesUnordered, StreamExt};
use redis::{Arg, Cmd, ErrorKind, Pipeline, RedisError, RedisResult, Value};
use tokio::sync::{mpsc, oneshot};

use super::replicas::{Replicas, Replied};

/// Most commands in one write: a bound on how long a batch's first command waits for the
/// rest to be encoded and answered.
const MAX_BATCH: usize = 512;
/// Most argument bytes in one write, past which a batch leaves with what it has: a few large
/// records go on their own rather than hold many small commands behind them.
const MAX_BATCH_BYTES: usize = 1 << 20;

/// A command waiting for the next batch, with where its reply goes.
pub(super) struct Queued {
    pub(super) command: Cmd,
    pub(super) reply: Reply,
    /// Whether the command still leaves once nobody awaits its reply.
    pub(super) unawaited: Unawaited,
    /// The replicas that must have the command's write before it is answered.
    pub(super) acks: Option<Replicas>,
    /// The cluster slot of the command's key (unused on one server).
    pub(super) slot: u16,
}

/// Where a command's reply goes.
pub(super) type Reply = oneshot::Sender<RedisResult<Replied>>;

/// Where batches go: one server, or the masters of a cluster.
pub(super) trait BatchSink: Send + Sync + 'static {
    /// Run when a writer starts: revives a connection that a runtime which has shut down
    /// may have left dead.
    fn revive(&self) -> impl Future<Output = ()> + Send;

    /// Sends one batch and answers each of its commands.
    fn send(self: Arc<Self>, batch: Vec<Queued>) -> impl Future<Output = ()> + Send;
}

/// What becomes of a command whose caller stopped waiting (timed out, or was dropped)
/// before its batch left.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Unawaited {
    /// Left out: a claim nobody will see the answer to must not hold its key.
    Skip,
    /// Sent all the same: a fenced write (complete, extend, release) acts only for its own
    /// claim and may be repeated, and dropping a completion would lose the record.
    Send,
}

impl Unawaited {
    /// Whether a command still goes out, its caller having stopped waiting for `reply` or
    /// not.
    pub(super) fn sent(self, reply: &Reply) -> bool {
        self == Self::Send || !reply.is_closed()
    }
}

/// Sends commands through a [`BatchSink`], batching those issued together.
pub(super) struct AutoPipeline<T> {
    sink: Arc<T>,
    /// The writer's queue. The writer starts on first use, in the runtime that uses it, and
    /// stops when the last handle to this queue is dropped or when that runtime shuts down;
    /// then the next command starts a new one.
    queue: RwLock<Option<mpsc::UnboundedSender<Queued>>>,
}

impl<T: BatchSink> AutoPipeline<T> {
    pub(super) fn new(sink: T) -> Self {
        Self {
            sink: Arc::new(sink),
            queue: RwLock::new(None),
        }
    }

    /// Where the batches go.
    pub(super) fn sink(&self) -> &Arc<T> {
        &self.sink
    }

    /// Sends `command` with the next batch and returns its reply; a server error comes
    /// back as `Err`, and so does no reply within `timeout`, counted from now: time spent
    /// queued behind a busy runtime counts, not only time on the wire. A command that times
    /// out before its batch leaves is sent or not as `unawaited` says. With `acks`, the
    /// reply comes once that many replicas have the write (one `WAIT` closes each batch
    /// that needs it), or once they did not in time, saying so. `slot` is the cluster slot
    /// of the command's key.
    pub(super) async fn query(
        &self,
        command: Cmd,
        slot: u16,
        timeout: Duration,
        unawaited: Unawaited,
        acks: Option<Replicas>,
    ) -> RedisResult<Replied> {
        let (reply, answer) = oneshot::channel();
        self.enqueue(Queued {
            command,
            reply,
            unawaited,
            acks,
            slot,
        });
        match tokio::time::timeout(timeout, answer).await {
            Ok(Ok(reply)) => reply,
            Ok(Err(_)) => Err(writer_stopped()),
            Err(_) => Err(timed_out(timeout)),
        }
    }

    /// Queues `queued` for the writer, starting one where there is none or where the
    /// runtime that ran the last one has shut down.
    fn enqueue(&self, queued: Queued) {
        let running = self.queue.read().unwrap_or_else(PoisonError::into_inner);
        let Some(queued) = send_to(&running, queued) else {
            return;
        };
        drop(running);
        let mut queue = self.queue.write().unwrap_or_else(PoisonError::into_inner);
        // Another command may have started a writer since the read.
        let Some(queued) = send_to(&queue, queued) else {
            return;
        };
        let (sender, commands) = mpsc::unbounded_channel();
        tokio::spawn(write_batches(Arc::clone(&self.sink), commands));
        // The writer holds the receiver until every sender is gone: this send succeeds.
        let _ = sender.send(queued);
        *queue = Some(sender);
    }
}

/// Sends `queued` to a running writer, or gives it back where none is running.
fn send_to(queue: &Option<mpsc::UnboundedSender<Queued>>, queued: Queued) -> Option<Queued> {
    match queue {
        Some(queue) => queue.send(queued).err().map(|stopped| stopped.0),
        None => Some(queued),
    }
}

/// Takes what is queued, batch after batch, until every sender is gone and every batch
/// answered. Batches are handed to the connection in the order they were formed.
async fn write_batches<T: BatchSink>(sink: Arc<T>, mut commands: mpsc::UnboundedReceiver<Queued>) {
    sink.revive().await;
    let mut in_flight = FuturesUnordered::new();
    loop {
        let first = tokio::select! {
            biased;
            // Polled first, so a batch just formed is queued on the connection before the
            // next one is; disabled while nothing is in flight.
            Some(()) = in_flight.next() => continue,
            next = commands.recv() => match next {
                Some(queued) => queued,
                None => break,
            },
        };
        // Yielding puts the writer behind every task that is ready now: the requests the
        // runtime polls in this turn queue their commands before the batch is taken.
        tokio::task::yield_now().await;
        let batch = take_batch(first, &mut commands);
        if !batch.is_empty() {
            in_flight.push(Arc::clone(&sink).send(batch));
        }
    }
    while in_flight.next().await.is_some() {}
}

/// The batch that leaves with `first`: what is queued behind it, within the bounds, less
/// the claims whose request went away (a claim nobody will see the answer to must not
/// hold its key).
fn take_batch(first: Queued, commands: &mut mpsc::UnboundedReceiver<Queued>) -> Vec<Queued> {
    let mut batch = Vec::with_capacity(commands.len().min(MAX_BATCH - 1) + 1);
    let mut bytes = payload(&first.command);
    batch.push(first);
    while batch.len() < MAX_BATCH && bytes < MAX_BATCH_BYTES {
        match commands.try_recv() {
            Ok(queued) => {
                bytes += payload(&queued.command);
                batch.push(queued);
            }
            Err(_) => break,
        }
    }
    batch.retain(|queued| queued.unawaited.sent(&queued.reply));
    batch
}

/// A batch as one pipeline: its commands in order, then, where any of them needs replicas'
/// acknowledgement, one `WAIT` for the most replicas any of them needs (`WAIT` covers every
/// write the connection sent before it).
pub(super) struct Batch {
    pub(super) pipeline: Pipeline,
    /// Where each command's reply goes, and what becomes of the command once nobody awaits
    /// it: a cluster that sends a command again after its pipeline failed leaves out a
    /// claim nobody awaits.
    pub(super) replies: Vec<(Reply, Unawaited)>,
    pub(super) acks: Vec<Option<Replicas>>,
    wait: Option<Replicas>,
}

impl Batch {
    pub(super) fn new(queued: Vec<Queued>) -> Self {
        let mut pipeline = Pipeline::with_capacity(queued.len() + 1);
        let mut replies = Vec::with_capacity(queued.len());
        let mut acks = Vec::with_capacity(queued.len());
        let mut wait: Option<Replicas> = None;
        for queued in queued {
            pipeline.add_command(queued.command);
            wait = Replicas::most(wait, queued.acks);
            replies.push((queued.reply, queued.unawaited));
            acks.push(queued.acks);
        }
        if let Some(wait) = wait {
            pipeline.add_command(wait.command());
        }
        Self {
            pipeline,
            replies,
            acks,
            wait,
        }
    }

    /// How many replies the pipeline answers.
    pub(super) fn expected(&self) -> usize {
        self.pipeline.len()
    }

    /// Each command's own reply, from what the pipeline answered: a server error as `Err`,
    /// and for a write that needed replicas, whether they acknowledged it.
    pub(super) fn results(&self, mut values: Vec<Value>) -> RedisResult<Vec<RedisResult<Replied>>> {
        if values.len() != self.expected() {
            return Err(RedisError::from((
                ErrorKind::Client,
                "a pipeline answered a different number of replies than it sent commands",
                format!("{} commands, {} replies", self.expected(), values.len()),
            )));
        }
        let acknowledged = self.wait.map(|_| values.pop().unwrap_or(Value::Nil));
        Ok(values
            .into_iter()
            .zip(&self.acks)
            .map(|(value, acks)| {
                value.extract_error().map(|value| match acks {
                    Some(acks) => acks.replied(value, acknowledged.as_ref()),
                    None => Replied::plain(value),
                })
            })
            .collect())
    }
}

/// The bytes of a command's arguments, about what it adds to a write.
fn payload(command: &Cmd) -> usize {
    command
        .args_iter()
        .map(|arg| match arg {
            Arg::Simple(bytes) => bytes.len(),
            _ => 0,
        })
        .sum()
}

/// The error of an operation that had no reply within `timeout`.
pub(super) fn timed_out(timeout: Duration) -> RedisError {
    RedisError::from(io::Error::new(
        io::ErrorKind::TimedOut,
        format!("no reply from Redis within {timeout:?}"),
    ))
}

fn writer_stopped() -> RedisError {
    RedisError::from((
        ErrorKind::Client,
        "the Redis writer task has stopped (its runtime shut down)",
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Queues commands whose one argument has each of `sizes` bytes; keeps their replies
    /// open unless the size is 0.
    fn queue(
        sizes: &[usize],
    ) -> (
        mpsc::UnboundedReceiver<Queued>,
        Vec<oneshot::Receiver<RedisResult<Replied>>>,
    ) {
        let (sender, receiver) = mpsc::unbounded_channel();
        let mut answers = Vec::new();
        for &size in sizes {
            let mut command = Cmd::new();
            command.arg(vec![b'x'; size]);
            let (reply, answer) = oneshot::channel();
            if size > 0 {
                answers.push(answer);
            }
            // Odd sizes stand for fenced writes, sent even when nobody awaits them.
            let unawaited = if size % 2 == 0 {
                Unawaited::Skip
            } else {
                Unawaited::Send
            };
            sender
                .send(Queued {
                    command,
                    reply,
                    unawaited,
                    acks: None,
                    slot: 0,
                })
                .unwrap();
        }
        (receiver, answers)
    }

    fn batches(sizes: &[usize]) -> Vec<usize> {
        let (mut commands, _answers) = queue(sizes);
        let mut lengths = Vec::new();
        while let Ok(first) = commands.try_recv() {
            lengths.push(take_batch(first, &mut commands).len());
        }
        lengths
    }

    #[test]
    fn a_batch_takes_everything_queued_up_to_its_count() {
        assert_eq!(batches(&[10; 3]), [3]);
        assert_eq!(batches(&[10; MAX_BATCH + 1]), [MAX_BATCH, 1]);
    }

    #[test]
    fn a_batch_leaves_once_it_holds_its_bytes() {
        let half = MAX_BATCH_BYTES / 2;
        assert_eq!(batches(&[half, half, 10, 10]), [2, 2]);
        assert_eq!(batches(&[MAX_BATCH_BYTES * 2, 10]), [1, 1]);
    }

    #[test]
    fn claims_nobody_awaits_are_left_out() {
        // Size 0 stands for a claim whose request went away before its batch left.
        assert_eq!(batches(&[10, 0, 10, 0]), [2]);
    }

    #[test]
    fn fenced_writes_nobody_awaits_still_leave() {
        let (mut commands, answers) = queue(&[11, 11, 10]);
        // The first write's caller timed out, and so did the claim's.
        drop(answers);
        let first = commands.try_recv().unwrap();
        let batch = take_batch(first, &mut commands);
        let sizes: Vec<usize> = batch
            .iter()
            .map(|queued| payload(&queued.command))
            .collect();
        assert_eq!(sizes, [11, 11]);
    }
}
