//! What the layer logged during a test.

use std::{
    cell::RefCell,
    io,
    sync::{Arc, Mutex, Once},
};

/// Log lines captured on this thread while the guard lives (a `#[tokio::test]` runs every
/// task on its one thread, so spawned tasks are captured too).
///
/// One subscriber serves the whole test binary and writes each line to the capture of the
/// thread that logged it. (A subscriber per thread would share tracing's cache of what may
/// be logged with the threads of other tests: rebuilt concurrently, that cache can leave a
/// capturing thread's debug lines and spans out.)
#[derive(Clone, Default)]
pub struct Logs(Arc<Mutex<Vec<u8>>>);

thread_local! {
    static CAPTURING: RefCell<Option<Logs>> = const { RefCell::new(None) };
}

/// Ends a capture when dropped.
pub struct Capturing(());

impl Drop for Capturing {
    fn drop(&mut self) {
        CAPTURING.with(|capturing| capturing.borrow_mut().take());
    }
}

/// Where a line goes: this thread's capture, if any, else nowhere.
struct ThisThread;

impl io::Write for ThisThread {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        CAPTURING.with(|capturing| {
            if let Some(logs) = &*capturing.borrow() {
                logs.0.lock().unwrap().extend_from_slice(buf);
            }
        });
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Logs {
    pub fn capture() -> (Self, Capturing) {
        static SUBSCRIBER: Once = Once::new();
        SUBSCRIBER.call_once(|| {
            let subscriber = tracing_subscriber::fmt()
                .with_writer(|| ThisThread)
                .with_ansi(false)
                .with_max_level(tracing::Level::DEBUG)
                .finish();
            tracing::subscriber::set_global_default(subscriber)
                .expect("no other subscriber in a test binary");
        });
        let logs = Self::default();
        CAPTURING.with(|capturing| *capturing.borrow_mut() = Some(logs.clone()));
        (logs, Capturing(()))
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
