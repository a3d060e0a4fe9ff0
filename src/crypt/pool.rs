//! Encryption spread over more than one core: a large request's sectors are cut into
//! pieces, the helper threads take all pieces but one, the calling queue thread does the
//! last, then waits for the rest. One queue thread alone encrypts about 4 GB/s; a stream of
//! 1 MiB writes would otherwise be bound by it, not by the disk. Small requests (below
//! [`SPLIT_MIN`]) are never split: a hand-over costs more than their sectors.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Condvar, Mutex};

/// Requests smaller than this are encrypted by the calling thread alone.
pub const SPLIT_MIN: usize = 128 << 10;
/// No piece is smaller than this.
const PIECE_MIN: usize = 64 << 10;

/// A piece of work: run `f` (a borrowed closure, see [`CryptPool::run`]) over piece `i`.
struct Job {
    f: *const (dyn Fn(usize) + Sync),
    i: usize,
    done: Arc<Done>,
}

// SAFETY: the closure is Sync and outlives the job (`run` waits for every piece).
unsafe impl Send for Job {}

struct Done {
    left: AtomicUsize,
    lock: Mutex<()>,
    cv: Condvar,
}

/// The helper threads.
pub struct CryptPool {
    tx: Mutex<Option<Sender<Job>>>,
    threads: usize,
    handles: Mutex<Vec<std::thread::JoinHandle<()>>>,
}

impl std::fmt::Debug for CryptPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CryptPool({} threads)", self.threads)
    }
}

impl CryptPool {
    /// `threads` helpers (at least one), named `vublk-crypt-N`.
    pub fn new(threads: usize) -> std::io::Result<CryptPool> {
        let (tx, rx) = channel::<Job>();
        let rx = Arc::new(Mutex::new(rx));
        let mut handles = Vec::new();
        for n in 0..threads.max(1) {
            let rx = rx.clone();
            handles.push(
                std::thread::Builder::new()
                    .name(format!("vublk-crypt-{n}"))
                    .spawn(move || loop {
                        let job = match next_job(&rx) {
                            Some(j) => j,
                            None => return,
                        };
                        // SAFETY: `run` keeps the closure alive until every piece is done.
                        let f = unsafe { &*job.f };
                        f(job.i);
                        finish(&job.done);
                    })?,
            );
        }
        Ok(CryptPool {
            tx: Mutex::new(Some(tx)),
            threads: threads.max(1),
            handles: Mutex::new(handles),
        })
    }

    pub fn threads(&self) -> usize {
        self.threads
    }

    /// How many pieces a buffer of `len` bytes (whole `sector`s) is cut into.
    pub fn pieces(&self, len: usize) -> usize {
        if len < SPLIT_MIN {
            1
        } else {
            (len / PIECE_MIN).clamp(1, self.threads + 1)
        }
    }

    /// Run `f(0..n)`: pieces 1..n on the helpers, piece 0 here; returns when all are done.
    pub fn run(&self, n: usize, f: &(dyn Fn(usize) + Sync)) {
        if n <= 1 {
            f(0);
            return;
        }
        let done = Arc::new(Done {
            left: AtomicUsize::new(n - 1),
            lock: Mutex::new(()),
            cv: Condvar::new(),
        });
        // SAFETY: the reference is only used by jobs, and this call does not return before
        // `done.left` is zero, i.e. before every job ran it: it outlives every use.
        let f_all: &'static (dyn Fn(usize) + Sync) = unsafe { std::mem::transmute(f) };
        let mut sent = 0;
        {
            let tx = crate::locks::Locked::locked(&self.tx);
            for i in 1..n {
                let job = Job {
                    f: f_all as *const (dyn Fn(usize) + Sync),
                    i,
                    done: done.clone(),
                };
                match tx.as_ref().map(|t| t.send(job)) {
                    Some(Ok(())) => sent += 1,
                    _ => break,
                }
            }
        }
        f(0);
        // Pieces no helper took (the pool is shutting down): here.
        for i in sent + 1..n {
            f(i);
            finish(&done);
        }
        // The helpers are usually done about when this thread is: wait by spinning a
        // little before sleeping (a wake-up costs more than the wait).
        let spin = std::time::Instant::now();
        while spin.elapsed() < SPIN {
            if done.left.load(Ordering::Acquire) == 0 {
                return;
            }
            std::hint::spin_loop();
        }
        let mut g = crate::locks::Locked::locked(&done.lock);
        while done.left.load(Ordering::Acquire) != 0 {
            g = done.cv.wait(g).unwrap_or_else(|e| e.into_inner());
        }
    }
}

/// How long a thread spins before it sleeps: for the next job (a helper), for the helpers
/// to finish (the caller).
const SPIN: std::time::Duration = std::time::Duration::from_micros(50);

/// The next job: spinning for [`SPIN`] first (a large write's parts come one after the
/// other), then sleeping. None when the pool is dropped.
fn next_job(rx: &Mutex<std::sync::mpsc::Receiver<Job>>) -> Option<Job> {
    let rx = crate::locks::Locked::locked(rx);
    let spin = std::time::Instant::now();
    while spin.elapsed() < SPIN {
        match rx.try_recv() {
            Ok(j) => return Some(j),
            Err(std::sync::mpsc::TryRecvError::Disconnected) => return None,
            Err(std::sync::mpsc::TryRecvError::Empty) => std::hint::spin_loop(),
        }
    }
    rx.recv().ok()
}

fn finish(done: &Done) {
    if done.left.fetch_sub(1, Ordering::AcqRel) == 1 {
        let _g = crate::locks::Locked::locked(&done.lock);
        done.cv.notify_all();
    }
}

impl Drop for CryptPool {
    fn drop(&mut self) {
        crate::locks::Locked::locked(&self.tx).take();
        for h in crate::locks::Locked::locked(&self.handles).drain(..) {
            let _ = h.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_piece_runs_once() {
        let pool = CryptPool::new(3).unwrap();
        let hits: Vec<AtomicUsize> = (0..4).map(|_| AtomicUsize::new(0)).collect();
        for _ in 0..100 {
            pool.run(4, &|i| {
                hits[i].fetch_add(1, Ordering::Relaxed);
            });
        }
        assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 100));
        assert_eq!(pool.pieces(4096), 1);
        assert_eq!(pool.pieces(1 << 20), 4);
    }
}
