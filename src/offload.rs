//! Work that would stall a queue thread (compressing a write's clusters and placing the
//! chunks), run on a small shared pool of threads. Results come back to the queue as
//! [`Completion`]s through its [`Inbox`], which wakes the queue's epoll loop through the same
//! eventfd its io_uring signals, so they take the ordinary completion path.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use crate::io::Completion;
use crate::locks::Locked;

/// One piece of work; it reports its own result (see [`Inbox::post`]).
pub type Job = Box<dyn FnOnce() + Send>;

/// A fixed set of threads taking jobs from one channel. Dropping the pool closes the channel;
/// the threads finish the jobs already queued and exit (they are not joined: the last
/// reference to whatever owns the pool may be dropped by a job on one of them).
pub struct Pool {
    tx: Mutex<Sender<Job>>,
    threads: usize,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Pool({} threads)", self.threads)
    }
}

impl Pool {
    pub fn new(threads: usize, name: &str) -> io::Result<Self> {
        let (tx, rx) = channel::<Job>();
        let rx = Arc::new(Mutex::new(rx));
        for i in 0..threads {
            let rx = rx.clone();
            std::thread::Builder::new()
                .name(format!("{name}-{i}"))
                .spawn(move || run(&rx))?;
        }
        Ok(Pool {
            tx: Mutex::new(tx),
            threads,
        })
    }

    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Queue a job; gives it back if every thread is gone.
    pub fn submit(&self, job: Job) -> Result<(), Job> {
        let tx = self.tx.locked();
        tx.send(job).map_err(|e| e.0)
    }
}

fn run(rx: &Mutex<Receiver<Job>>) {
    loop {
        let job = {
            let rx = rx.locked();
            rx.recv()
        };
        match job {
            Ok(job) => job(),
            Err(_) => return,
        }
    }
}

/// Where a queue's offloaded work reports back.
pub struct Inbox {
    done: Mutex<Vec<Completion>>,
    ready: AtomicBool,
    cv: Condvar,
    /// Threads blocked in [`Inbox::wait`] (a post only wakes the condvar when there are).
    waiters: AtomicUsize,
    /// Our own descriptor of the queue's completion eventfd (it outlives the queue's).
    event: OwnedFd,
}

impl Inbox {
    /// An inbox that signals `event_fd` (duplicated) when something is posted.
    pub fn new(event_fd: RawFd) -> io::Result<Arc<Self>> {
        // SAFETY: plain syscall; the result is checked before use.
        let fd = unsafe { libc::fcntl(event_fd, libc::F_DUPFD_CLOEXEC, 0) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` is a fresh descriptor that nothing else owns.
        let event = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(Arc::new(Inbox {
            done: Mutex::new(Vec::new()),
            ready: AtomicBool::new(false),
            cv: Condvar::new(),
            waiters: AtomicUsize::new(0),
            event,
        }))
    }

    /// Report a finished job and wake the queue. The eventfd is written only by the post
    /// that finds the inbox empty of untaken work: the queue takes everything posted until
    /// then in one go (the flag is set and cleared under the lock that guards the list), so
    /// a burst of completions costs one wake-up.
    pub fn post(&self, c: Completion) {
        let was_ready = {
            let mut done = self.done.locked();
            done.push(c);
            self.ready.swap(true, Ordering::AcqRel)
        };
        if self.waiters.load(Ordering::Acquire) > 0 {
            self.cv.notify_all();
        }
        if was_ready {
            return;
        }
        let one = 1u64.to_ne_bytes();
        // SAFETY: writes 8 bytes from a live buffer to our own descriptor. An eventfd write
        // only fails when the counter would overflow, and then it is already signalled.
        let _ = unsafe { libc::write(self.event.as_raw_fd(), one.as_ptr().cast(), 8) };
    }

    /// Something was posted and not taken yet (no lock, for polling).
    pub fn has(&self) -> bool {
        self.ready.load(Ordering::Acquire)
    }

    /// Move posted completions into `out`.
    pub fn take(&self, out: &mut Vec<Completion>) {
        if !self.has() {
            return;
        }
        let mut done = self.done.locked();
        self.ready.store(false, Ordering::Release);
        out.append(&mut done);
    }

    /// Move the posted completions `pick` chooses into `out`, leaving the others (and the
    /// signal, for them) in place.
    pub fn take_where(&self, out: &mut Vec<Completion>, pick: impl Fn(&Completion) -> bool) {
        if !self.has() {
            return;
        }
        let mut done = self.done.locked();
        let mut i = 0;
        while i < done.len() {
            if pick(&done[i]) {
                out.push(done.remove(i));
            } else {
                i += 1;
            }
        }
        if done.is_empty() {
            self.ready.store(false, Ordering::Release);
        }
    }

    /// Block until something is posted, at most `timeout`.
    pub fn wait(&self, timeout: Duration) {
        let done = self.done.locked();
        if done.is_empty() {
            // Counted under the lock a post takes first: a post after this sees the waiter.
            self.waiters.fetch_add(1, Ordering::AcqRel);
            let r = self.cv.wait_timeout(done, timeout);
            self.waiters.fetch_sub(1, Ordering::AcqRel);
            drop(r);
        }
    }
}

/// An inbox with an eventfd of its own: what an engine whose completions come from other
/// threads (librbd's, an NBD connection thread) gives its queue to watch.
pub struct Mailbox {
    event: vmm_sys_util::eventfd::EventFd,
    inbox: Arc<Inbox>,
}

impl Mailbox {
    pub fn new() -> io::Result<Self> {
        let event = vmm_sys_util::eventfd::EventFd::new(libc::EFD_NONBLOCK)?;
        let inbox = Inbox::new(event.as_raw_fd())?;
        Ok(Mailbox { event, inbox })
    }

    /// Where the other threads post.
    pub fn inbox(&self) -> &Arc<Inbox> {
        &self.inbox
    }

    /// Readable when something was posted.
    pub fn event_fd(&self) -> RawFd {
        self.event.as_raw_fd()
    }

    pub fn has(&self) -> bool {
        self.inbox.has()
    }

    /// Block until something is posted (at most a short while: the caller loops).
    pub fn wait(&self) {
        self.inbox.wait(Duration::from_millis(50));
    }

    /// Take what was posted (and the eventfd's signal).
    pub fn take(&self, out: &mut Vec<Completion>) {
        let _ = self.event.read();
        self.inbox.take(out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jobs_report_through_the_inbox_and_signal_its_eventfd() {
        // SAFETY: plain syscall; checked below.
        let efd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        assert!(efd >= 0);
        // SAFETY: fresh descriptor.
        let efd = unsafe { OwnedFd::from_raw_fd(efd) };
        let inbox = Inbox::new(efd.as_raw_fd()).unwrap();
        let pool = Pool::new(2, "test-pool").unwrap();
        for i in 0..100u64 {
            let inbox = inbox.clone();
            pool.submit(Box::new(move || {
                inbox.post(Completion {
                    user_data: i,
                    result: 0,
                })
            }))
            .map_err(|_| "submit")
            .unwrap();
        }
        let mut got = Vec::new();
        let t0 = std::time::Instant::now();
        while got.len() < 100 && t0.elapsed() < Duration::from_secs(10) {
            inbox.wait(Duration::from_millis(10));
            inbox.take(&mut got);
        }
        let mut ids: Vec<u64> = got.iter().map(|c| c.user_data).collect();
        ids.sort_unstable();
        assert_eq!(ids, (0..100).collect::<Vec<_>>());
        let mut v = [0u8; 8];
        // SAFETY: reads 8 bytes into a live buffer.
        let n = unsafe { libc::read(efd.as_raw_fd(), v.as_mut_ptr().cast(), 8) };
        assert_eq!(n, 8);
        assert!(
            u64::from_ne_bytes(v) >= 1,
            "the eventfd was never signalled"
        );
        assert!(!inbox.has());
        drop(pool);
    }
}
