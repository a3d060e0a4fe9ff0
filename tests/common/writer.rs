//! A guest stand-in for tests that change a disk under a running writer (backups,
//! snapshots): a thread writing random data at random places, which the test can pause
//! between two of its requests.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::client::{errno_name, Client};

/// The client, shared by the writer thread and the test (which pauses the writer by holding
/// it: no request is in flight then).
pub struct Shared(pub Client);
// SAFETY: the client is only used by whoever holds the mutex.
unsafe impl Send for Shared {}

/// A writer of random data at random places of the whole disk, one request at a time
/// (4-64 KiB, one byte value each), logging what it wrote.
pub struct Writer {
    client: Arc<Mutex<Shared>>,
    stop: Arc<AtomicBool>,
    log: Arc<Mutex<Vec<(u64, u64)>>>,
    writes: Arc<AtomicU64>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Writer {
    pub fn start(client: Client, seed: u64) -> Writer {
        let client = Arc::new(Mutex::new(Shared(client)));
        let stop = Arc::new(AtomicBool::new(false));
        let log = Arc::new(Mutex::new(Vec::new()));
        let writes = Arc::new(AtomicU64::new(0));
        let (c, s, l, w) = (client.clone(), stop.clone(), log.clone(), writes.clone());
        let thread = std::thread::spawn(move || {
            let mut x = seed | 1;
            let mut next = || {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x
            };
            let size = c.lock().unwrap().0.capacity();
            while !s.load(Ordering::Relaxed) {
                let len = 4096 * (1 + next() % 16);
                let offset = (next() % ((size - len) / 512)) * 512;
                let byte = (next() % 255 + 1) as u8;
                let mut g = c.lock().unwrap();
                let r = g.0.write_at(0, offset, &vec![byte; len as usize]);
                assert_eq!(r, 0, "guest write at {offset} failed: {}", errno_name(r));
                l.lock().unwrap().push((offset, len));
                drop(g);
                w.fetch_add(1, Ordering::Relaxed);
                std::thread::sleep(Duration::from_micros(200));
            }
        });
        Writer {
            client,
            stop,
            log,
            writes,
            thread: Some(thread),
        }
    }

    /// Run `f` with the writer paused (between two of its requests) and its client.
    pub fn paused<R>(&self, f: impl FnOnce(&mut Client) -> R) -> R {
        let mut g = self.client.lock().unwrap();
        f(&mut g.0)
    }

    /// Let the writer do at least `n` more writes.
    pub fn run_for(&self, n: u64) {
        let start = self.writes.load(Ordering::Relaxed);
        while self.writes.load(Ordering::Relaxed) < start + n {
            assert!(
                !self.thread.as_ref().is_some_and(|t| t.is_finished()),
                "the writer stopped (a guest write failed: see its panic above)"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    pub fn take_log(&self) -> Vec<(u64, u64)> {
        std::mem::take(&mut *self.log.lock().unwrap())
    }

    pub fn stop(mut self) -> Client {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            t.join().unwrap();
        }
        let m = Arc::try_unwrap(self.client).ok().unwrap();
        m.into_inner().unwrap().0
    }
}
