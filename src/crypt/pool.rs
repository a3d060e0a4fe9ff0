//! Encryption spread over more than one core, two ways:
//! - [`CryptPool::run`]: a large request's sectors are cut into pieces, the helper threads
//!   take all pieces but one, the calling queue thread does the last, then waits for the
//!   rest (reads, decrypted when they are in).
//! - [`CryptPool::spawn`]: a task queued for the helpers, the caller going on at once
//!   (large writes: the helpers encrypt their share of the parts while the queue thread
//!   encrypts its own, and nobody waits for anybody; the task reports back through the
//!   queue's inbox).
//!
//! One queue thread alone encrypts about 5 GB/s; a stream of 1 MiB writes would otherwise
//! be bound by it, not by the disk. Small requests (below [`SPLIT_MIN`]) are never handed
//! over: a hand-over costs more than their sectors.

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

/// Work that runs to its end on a helper and reports by itself.
pub type Task = Box<dyn FnOnce() + Send>;

enum Work {
    Piece(Job),
    Task(Task),
}

struct Done {
    left: AtomicUsize,
    lock: Mutex<()>,
    cv: Condvar,
}

/// The helper threads.
pub struct CryptPool {
    tx: Mutex<Option<Sender<Work>>>,
    threads: usize,
    /// Tasks handed over and not yet finished.
    tasks: Arc<AtomicUsize>,
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
        let (tx, rx) = channel::<Work>();
        let rx = Arc::new(Mutex::new(rx));
        let tasks = Arc::new(AtomicUsize::new(0));
        let mut handles = Vec::new();
        for n in 0..threads.max(1) {
            let rx = rx.clone();
            let tasks = tasks.clone();
            handles.push(
                std::thread::Builder::new()
                    .name(format!("vublk-crypt-{n}"))
                    .spawn(move || {
                        let mut spin = true;
                        loop {
                            match next_job(&rx, spin) {
                                Some(Work::Piece(job)) => {
                                    spin = true;
                                    // SAFETY: `run` keeps the closure alive until every piece
                                    // is done.
                                    let f = unsafe { &*job.f };
                                    f(job.i);
                                    finish(&job.done);
                                }
                                Some(Work::Task(t)) => {
                                    // The next task comes when the queue has the next
                                    // request, hundreds of microseconds away: sleep.
                                    spin = false;
                                    t();
                                    tasks.fetch_sub(1, Ordering::AcqRel);
                                }
                                None => return,
                            }
                        }
                    })?,
            );
        }
        Ok(CryptPool {
            tx: Mutex::new(Some(tx)),
            threads: threads.max(1),
            tasks,
            handles: Mutex::new(handles),
        })
    }

    pub fn threads(&self) -> usize {
        self.threads
    }

    /// How many pieces a buffer of `len` bytes (whole `sector`s) is cut into (one while
    /// every helper has a task: a piece would wait behind it).
    pub fn pieces(&self, len: usize) -> usize {
        if len < SPLIT_MIN || !self.idle() {
            1
        } else {
            (len / PIECE_MIN).clamp(1, self.threads + 1)
        }
    }

    /// Is a helper free for a task?
    pub fn idle(&self) -> bool {
        self.tasks.load(Ordering::Acquire) < self.threads
    }

    /// Queue `task` for the helpers; gives it back if the pool is shutting down.
    pub fn spawn(&self, task: Task) -> Result<(), Task> {
        self.tasks.fetch_add(1, Ordering::AcqRel);
        let tx = crate::locks::Locked::locked(&self.tx);
        let sent = match tx.as_ref() {
            Some(t) => t.send(Work::Task(task)).map_err(|e| match e.0 {
                Work::Task(t) => t,
                Work::Piece(_) => unreachable!("sent a task"),
            }),
            None => Err(task),
        };
        if sent.is_err() {
            self.tasks.fetch_sub(1, Ordering::AcqRel);
        }
        sent
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
                match tx.as_ref().map(|t| t.send(Work::Piece(job))) {
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

/// The next job: spinning for [`SPIN`] first if `spin` (a large read's pieces come one
/// after the other), then sleeping. None when the pool is dropped.
fn next_job(rx: &Mutex<std::sync::mpsc::Receiver<Work>>, spin: bool) -> Option<Work> {
    let rx = crate::locks::Locked::locked(rx);
    if !spin {
        return rx.recv().ok();
    }
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

    #[test]
    fn tasks_run_in_order_and_pieces_do_not_queue_behind_them() {
        let pool = CryptPool::new(1).unwrap();
        let (go_tx, go_rx) = channel::<()>();
        let (done_tx, done_rx) = channel::<u32>();
        let d = done_tx.clone();
        assert!(pool
            .spawn(Box::new(move || {
                go_rx.recv().unwrap();
                d.send(1).unwrap();
            }))
            .is_ok());
        assert!(!pool.idle());
        assert_eq!(pool.pieces(1 << 20), 1, "no pieces behind a task");
        let d = done_tx;
        assert!(pool.spawn(Box::new(move || d.send(2).unwrap())).is_ok());
        go_tx.send(()).unwrap();
        assert_eq!(done_rx.recv().unwrap(), 1);
        assert_eq!(done_rx.recv().unwrap(), 2);
        let t0 = std::time::Instant::now();
        while !pool.idle() {
            assert!(t0.elapsed() < std::time::Duration::from_secs(5));
            std::thread::yield_now();
        }
        assert_eq!(pool.pieces(1 << 20), 2);
    }
}
