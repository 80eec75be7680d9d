//! A TCP proxy whose connections can be frozen: bytes stop flowing both ways while the
//! sockets stay open, as when a failover or a NAT drops a connection's state without a
//! reset. Connections opened after a freeze pass.

use std::{
    net::SocketAddr,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc, Mutex,
    },
};

use tokio::{
    io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt},
    net::{TcpListener, TcpStream},
    task::JoinHandle,
};

/// The proxy, listening on a loopback port of its own; its connections end when dropped.
pub struct FreezingProxy {
    addr: SocketAddr,
    /// Connections numbered below this pass nothing.
    frozen_below: Arc<AtomicU64>,
    opened: Arc<AtomicU64>,
    tasks: Arc<Mutex<Vec<JoinHandle<()>>>>,
}

impl FreezingProxy {
    /// A proxy to `upstream`.
    pub async fn start(upstream: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the proxy");
        let addr = listener.local_addr().expect("proxy address");
        let frozen_below = Arc::new(AtomicU64::new(0));
        let opened = Arc::new(AtomicU64::new(0));
        let tasks = Arc::new(Mutex::new(Vec::new()));
        let (frozen, count, spawned) = (frozen_below.clone(), opened.clone(), tasks.clone());
        let accept = tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    return;
                };
                let Ok(server) = TcpStream::connect(upstream).await else {
                    continue;
                };
                let id = count.fetch_add(1, Ordering::SeqCst);
                let (client_read, client_write) = client.into_split();
                let (server_read, server_write) = server.into_split();
                let pumps = [
                    pump(id, frozen.clone(), client_read, server_write),
                    pump(id, frozen.clone(), server_read, client_write),
                ];
                spawned.lock().unwrap().extend(pumps.map(tokio::spawn));
            }
        });
        tasks.lock().unwrap().push(accept);
        Self {
            addr,
            frozen_below,
            opened,
            tasks,
        }
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// How many connections it has opened.
    pub fn opened(&self) -> u64 {
        self.opened.load(Ordering::SeqCst)
    }

    /// Freezes every connection opened so far.
    pub fn freeze_open_connections(&self) {
        self.frozen_below.store(self.opened(), Ordering::SeqCst);
    }
}

impl Drop for FreezingProxy {
    fn drop(&mut self) {
        for task in self.tasks.lock().unwrap().drain(..) {
            task.abort();
        }
    }
}

/// Copies `from` to `to` until either ends, or for ever once connection `id` is frozen:
/// then it holds both open and passes nothing.
async fn pump(
    id: u64,
    frozen_below: Arc<AtomicU64>,
    mut from: impl AsyncRead + Unpin,
    mut to: impl AsyncWrite + Unpin,
) {
    let mut buffer = vec![0; 64 * 1024];
    loop {
        let read = match from.read(&mut buffer).await {
            Ok(0) | Err(_) => return,
            Ok(read) => read,
        };
        if id < frozen_below.load(Ordering::SeqCst) {
            let _open = (from, to);
            return std::future::pending().await;
        }
        if to.write_all(&buffer[..read]).await.is_err() {
            return;
        }
    }
}
