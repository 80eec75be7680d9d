//! A TCP proxy that loses HTTP/1.1 exchanges on purpose, to test clients that retry.
//!
//! For each request on a client connection it draws a fate:
//! - **reset**: the request is read whole and never forwarded; the client's connection is
//!   reset (RST). The server never sees it.
//! - **drop**: the request is forwarded, the server's whole response is read (so the server
//!   has handled and recorded it) and thrown away; the client's connection is closed.
//! - **deliver**: the response is passed on and the connection stays open for the next
//!   request.
//!
//! It reads messages by `Content-Length` only (chunked ones fail the test), which is what
//! the clients and the payments example send.

use std::{
    net::SocketAddr,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
};

use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream},
    task::JoinHandle,
};

/// What the proxy did so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counts {
    /// Requests read from clients.
    pub requests: u64,
    /// Connections reset before their request reached the server.
    pub resets: u64,
    /// Responses the server sent that the client never got.
    pub dropped: u64,
    /// Responses passed on.
    pub delivered: u64,
}

#[derive(Default)]
struct Counters {
    requests: AtomicU64,
    resets: AtomicU64,
    dropped: AtomicU64,
    delivered: AtomicU64,
}

/// The proxy, listening on a loopback port of its own; stops when dropped.
pub struct LossyProxy {
    addr: SocketAddr,
    counters: Arc<Counters>,
    task: JoinHandle<()>,
}

#[derive(Clone, Copy)]
enum Fate {
    Reset,
    Drop,
    Deliver,
}

impl LossyProxy {
    /// A proxy to `upstream` that resets the connection of a share `reset` of requests and
    /// drops the response of a share `drop` of them (shares between 0 and 1).
    pub async fn start(upstream: SocketAddr, reset: f64, drop: f64) -> Self {
        assert!(reset >= 0.0 && drop >= 0.0 && reset + drop <= 1.0);
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the proxy");
        let addr = listener.local_addr().expect("proxy address");
        let counters = Arc::new(Counters::default());
        let shared = counters.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    continue;
                };
                let counters = shared.clone();
                tokio::spawn(async move {
                    let fate = move || {
                        let draw: f64 = rand::random();
                        if draw < reset {
                            Fate::Reset
                        } else if draw < reset + drop {
                            Fate::Drop
                        } else {
                            Fate::Deliver
                        }
                    };
                    relay(client, upstream, fate, &counters).await;
                });
            }
        });
        Self {
            addr,
            counters,
            task,
        }
    }

    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// What it did so far.
    pub fn counts(&self) -> Counts {
        let read = |counter: &AtomicU64| counter.load(Ordering::SeqCst);
        Counts {
            requests: read(&self.counters.requests),
            resets: read(&self.counters.resets),
            dropped: read(&self.counters.dropped),
            delivered: read(&self.counters.delivered),
        }
    }
}

impl Drop for LossyProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Relays one client connection, request by request, until one side closes it or a fate
/// ends it.
async fn relay(
    mut client: TcpStream,
    upstream: SocketAddr,
    fate: impl Fn() -> Fate,
    counters: &Counters,
) {
    let mut server: Option<TcpStream> = None;
    let (mut from_client, mut from_server) = (Vec::new(), Vec::new());
    while let Some(request) = read_message(&mut client, &mut from_client, false).await {
        counters.requests.fetch_add(1, Ordering::SeqCst);
        let fate = fate();
        if let Fate::Reset = fate {
            counters.resets.fetch_add(1, Ordering::SeqCst);
            client.set_zero_linger().expect("SO_LINGER 0");
            return; // Dropping the socket with a zero linger sends RST.
        }
        if server.is_none() {
            server = Some(
                TcpStream::connect(upstream)
                    .await
                    .expect("reach the server"),
            );
        }
        let to_server = server.as_mut().expect("connected");
        if to_server.write_all(&request).await.is_err() {
            return;
        }
        let Some(response) = read_message(to_server, &mut from_server, true).await else {
            return;
        };
        if let Fate::Drop = fate {
            counters.dropped.fetch_add(1, Ordering::SeqCst);
            return; // Closes both connections; the client never sees the response.
        }
        if client.write_all(&response).await.is_err() {
            return;
        }
        counters.delivered.fetch_add(1, Ordering::SeqCst);
    }
}

/// The next whole HTTP/1.1 message from `stream` (with bytes already read in `buffer`, and
/// leaving any after it there), or `None` once the stream ends.
async fn read_message(
    stream: &mut TcpStream,
    buffer: &mut Vec<u8>,
    response: bool,
) -> Option<Vec<u8>> {
    let mut chunk = [0; 16 * 1024];
    loop {
        if let Some(end) = buffer.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = std::str::from_utf8(&buffer[..end]).expect("an ASCII head");
            let length = body_length(head, response);
            let total = end + 4 + length;
            while buffer.len() < total {
                let n = stream.read(&mut chunk).await.ok()?;
                if n == 0 {
                    return None;
                }
                buffer.extend_from_slice(&chunk[..n]);
            }
            let rest = buffer.split_off(total);
            return Some(std::mem::replace(buffer, rest));
        }
        let n = stream.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buffer.extend_from_slice(&chunk[..n]);
    }
}

/// The body length a message head announces.
fn body_length(head: &str, response: bool) -> usize {
    let mut lines = head.split("\r\n");
    let start = lines.next().unwrap_or_default();
    if response
        && ["HTTP/1.1 204", "HTTP/1.1 304"]
            .iter()
            .any(|s| start.starts_with(s))
    {
        return 0;
    }
    for line in lines {
        let (name, value) = line.split_once(':').expect("a header line");
        assert!(
            !name.eq_ignore_ascii_case("transfer-encoding"),
            "the lossy proxy reads Content-Length messages only: {head}"
        );
        if name.eq_ignore_ascii_case("content-length") {
            return value.trim().parse().expect("a Content-Length");
        }
    }
    assert!(!response, "a response without Content-Length: {head}");
    0
}
