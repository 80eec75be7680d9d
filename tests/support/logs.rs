//! What the layer logged during a test.

use std::{
    io,
    sync::{Arc, Mutex},
};

use tracing::subscriber::DefaultGuard;

/// Log lines captured on this thread while the guard lives (a `#[tokio::test]` runs every
/// task on its one thread, so spawned tasks are captured too).
#[derive(Clone, Default)]
pub struct Logs(Arc<Mutex<Vec<u8>>>);

impl Logs {
    pub fn capture() -> (Self, DefaultGuard) {
        let logs = Self::default();
        let writer = logs.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .with_max_level(tracing::Level::DEBUG)
            .finish();
        (logs, tracing::subscriber::set_default(subscriber))
    }

    /// Whether a line at `level` (`"WARN"`, `"ERROR"`, …) contains `text`.
    pub fn has(&self, level: &str, text: &str) -> bool {
        let bytes = self.0.lock().unwrap();
        String::from_utf8_lossy(&bytes)
            .lines()
            .any(|line| line.contains(level) && line.contains(text))
    }

    pub fn dump(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

impl io::Write for Logs {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}
