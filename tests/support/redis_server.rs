//! A `redis-server` process of the test's own, for tests that stop, restart or count
//! commands on Redis.

use std::{
    fs,
    net::TcpListener,
    path::PathBuf,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

/// A throwaway Redis on a free loopback port; killed when dropped.
pub struct RedisServer {
    port: u16,
    child: Option<Child>,
    /// Where a persistent server keeps its append-only file; `None` keeps nothing on disk.
    /// Removed when dropped.
    dir: Option<PathBuf>,
}

impl RedisServer {
    /// Starts one on a free port, keeping nothing on disk, and waits until it answers.
    pub fn start() -> Self {
        Self::start_in(None)
    }

    /// Starts one on a free port that appends every write to a file in a directory of its
    /// own and syncs it to disk before answering (`--appendonly yes --appendfsync always`),
    /// and waits until it answers: whatever it acknowledged survives [`stop`](Self::stop)
    /// (SIGKILL) and [`restart`](Self::restart).
    pub fn start_persistent() -> Self {
        let dir = std::env::temp_dir().join(format!(
            "tower-idempotency-redis-{:016x}",
            rand::random::<u64>()
        ));
        fs::create_dir_all(&dir).expect("create the Redis data directory");
        Self::start_in(Some(dir))
    }

    fn start_in(dir: Option<PathBuf>) -> Self {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("free port")
            .port();
        let mut server = Self {
            port,
            child: None,
            dir,
        };
        server.restart();
        server
    }

    /// `redis://127.0.0.1:<port>/`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// The port it listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Kills it (SIGKILL: an outage, not a shutdown) and waits until the port is closed.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        self.wait_until(false);
    }

    /// Starts it again on the same port: empty, or for a persistent server with what its
    /// append-only file holds (same directory, same settings).
    pub fn restart(&mut self) {
        self.stop();
        let mut command = Command::new("redis-server");
        command
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--protected-mode", "no"]);
        match &self.dir {
            Some(dir) => command
                .args(["--appendonly", "yes", "--appendfsync", "always", "--dir"])
                .arg(dir),
            None => command.args(["--appendonly", "no"]),
        };
        let child = command
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server on PATH (the test script installs it)");
        self.child = Some(child);
        self.wait_until(true);
    }

    /// Runs a command with `redis-cli` against this server and returns its output.
    pub fn cli(&self, args: &[&str]) -> String {
        let output = Command::new("redis-cli")
            .args(["-p", &self.port.to_string()])
            .args(args)
            .output()
            .expect("redis-cli on PATH");
        String::from_utf8_lossy(&output.stdout).into_owned()
    }

    fn wait_until(&self, up: bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let answering = std::net::TcpStream::connect(("127.0.0.1", self.port)).is_ok()
                && (!up || self.cli(&["PING"]).trim() == "PONG");
            if answering == up {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "redis-server on port {} did not come {}",
                self.port,
                if up { "up" } else { "down" }
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        if let Some(dir) = &self.dir {
            let _ = fs::remove_dir_all(dir);
        }
    }
}
