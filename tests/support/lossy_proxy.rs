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
//! It reads messages by `Content-Length` only, which is what the clients and the payments
//! example send. Anything else it cannot relay (a chunked message, a server it cannot
//! reach) is counted as `broken`, not as one more lost exchange: tests assert there is
//! none.

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
    /// Connections the proxy itself failed to relay (each reported on stderr): a test
    /// fault, not a loss.
    pub broken: u64,
}

#[derive(Default)]
struct Counters {
    requests: AtomicU64,
    resets: AtomicU64,
    dropped: AtomicU64,
    delivered: AtomicU64,
    broken: AtomicU64,
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
                    if let Err(failure) = relay(client, upstream, fate, &counters).await {
                        counters.broken.fetch_add(1, Ordering::SeqCst);
                        eprintln!("lossy proxy: {failure}");
                    }
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
            broken: read(&self.counters.broken),
        }
    }
}

impl Drop for LossyProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Relays one client connection, request by request, until one side closes it or a fate
/// ends it; fails when the proxy cannot do its part.
async fn relay(
    mut client: TcpStream,
    upstream: SocketAddr,
    fate: impl Fn() -> Fate,
    counters: &Counters,
) -> Result<(), String> {
    let mut server: Option<TcpStream> = None;
    let (mut from_client, mut from_server) = (Vec::new(), Vec::new());
    while let Some(request) = read_message(&mut client, &mut from_client, false).await? {
        counters.requests.fetch_add(1, Ordering::SeqCst);
        let fate = fate();
        if let Fate::Reset = fate {
            counters.resets.fetch_add(1, Ordering::SeqCst);
            client
                .set_zero_linger()
                .map_err(|e| format!("SO_LINGER 0: {e}"))?;
            return Ok(()); // Dropping the socket with a zero linger sends RST.
        }
        let to_server = match &mut server {
            Some(server) => server,
            None => server.insert(
                TcpStream::connect(upstream)
                    .await
                    .map_err(|e| format!("reach the server at {upstream}: {e}"))?,
            ),
        };
        if to_server.write_all(&request).await.is_err() {
            return Ok(());
        }
        let Some(response) = read_message(to_server, &mut from_server, true).await? else {
            return Ok(());
        };
        if let Fate::Drop = fate {
            counters.dropped.fetch_add(1, Ordering::SeqCst);
            return Ok(()); // Closes both connections; the client never sees the response.
        }
        if client.write_all(&response).await.is_err() {
            return Ok(());
        }
        counters.delivered.fetch_add(1, Ordering::SeqCst);
    }
    Ok(())
}

/// The next whole HTTP/1.1 message from `stream` (with bytes already read in `buffer`, and
/// leaving any after it there), or `None` once the stream ends (or fails: a loss).
async fn read_message(
    stream: &mut TcpStream,
    buffer: &mut Vec<u8>,
    response: bool,
) -> Result<Option<Vec<u8>>, String> {
    let mut chunk = [0; 16 * 1024];
    loop {
        if let Some(end) = buffer.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = std::str::from_utf8(&buffer[..end])
                .map_err(|_| format!("a head that is not ASCII: {:?}", &buffer[..end]))?;
            let length = body_length(head, response)?;
            let total = end + 4 + length;
            while buffer.len() < total {
                match stream.read(&mut chunk).await {
                    Ok(0) | Err(_) => return Ok(None),
                    Ok(n) => buffer.extend_from_slice(&chunk[..n]),
                }
            }
            let rest = buffer.split_off(total);
            return Ok(Some(std::mem::replace(buffer, rest)));
        }
        match stream.read(&mut chunk).await {
            Ok(0) | Err(_) => return Ok(None),
            Ok(n) => buffer.extend_from_slice(&chunk[..n]),
        }
    }
}

/// The body length a message head announces.
fn body_length(head: &str, response: bool) -> Result<usize, String> {
    let mut lines = head.split("\r\n");
    let start = lines.next().unwrap_or_default();
    if response
        && ["HTTP/1.1 204", "HTTP/1.1 304"]
            .iter()
            .any(|s| start.starts_with(s))
    {
        return Ok(0);
    }
    for line in lines {
        let (name, value) = line
            .split_once(':')
            .ok_or_else(|| format!("not a header line: {line:?}"))?;
        if name.eq_ignore_ascii_case("transfer-encoding") {
            return Err(format!("reads Content-Length messages only: {head}"));
        }
        if name.eq_ignore_ascii_case("content-length") {
            return value
                .trim()
                .parse()
                .map_err(|_| format!("not a Content-Length: {line:?}"));
        }
    }
    if response {
        return Err(format!("a response without Content-Length: {head}"));
    }
    Ok(0)
}
