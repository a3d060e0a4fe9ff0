//! Serialisation of overlapping writes where the file's direct-I/O block is larger than the
//! guest's block: a sub-block write is a read-modify-write of whole file blocks, and no other
//! write may touch those blocks meanwhile, or one of the two is lost (seed 001).
//!
//! Only used when read-modify-write can happen at all; otherwise writes never touch it.

use crate::locks::Locked;
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::Duration;

/// What holds a range.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Holder {
    /// An ordinary (aligned) write in flight.
    Write,
    /// A read-modify-write in progress.
    Rmw,
}

#[derive(Debug)]
struct Entry {
    key: u64,
    start: u64,
    end: u64,
    holder: Holder,
}

/// Byte ranges of the image currently being written.
#[derive(Debug, Default)]
pub struct RangeLocks {
    entries: Mutex<(u64, Vec<Entry>)>,
    changed: Condvar,
}

impl RangeLocks {
    fn lock(&self) -> MutexGuard<'_, (u64, Vec<Entry>)> {
        self.entries.locked()
    }

    /// Take [start, end) as `holder` if nothing conflicting holds an overlapping range:
    /// a read-modify-write conflicts with everything, an ordinary write only with a
    /// read-modify-write. Returns the key to release, or None if the caller must wait.
    pub fn try_acquire(&self, start: u64, end: u64, holder: Holder) -> Option<u64> {
        let mut g = self.lock();
        let conflict = g.1.iter().any(|e| {
            e.start < end && start < e.end && (holder == Holder::Rmw || e.holder == Holder::Rmw)
        });
        if conflict {
            return None;
        }
        g.0 += 1;
        let key = g.0;
        g.1.push(Entry {
            key,
            start,
            end,
            holder,
        });
        Some(key)
    }

    /// Wait briefly for a release (the caller then retries and reaps its own completions, so
    /// it never waits on itself).
    pub fn wait_change(&self) {
        let g = self.lock();
        let _ = self.changed.wait_timeout(g, Duration::from_millis(1));
    }

    /// Wait at most `timeout` for a release.
    pub fn wait_change_for(&self, timeout: Duration) {
        let g = self.lock();
        let _ = self.changed.wait_timeout(g, timeout);
    }

    pub fn release(&self, key: u64) {
        let mut g = self.lock();
        g.1.retain(|e| e.key != key);
        drop(g);
        self.changed.notify_all();
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.lock().1.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ordinary_writes_share_but_rmw_is_exclusive() {
        let l = RangeLocks::default();
        let a = l.try_acquire(0, 4096, Holder::Write).unwrap();
        let b = l.try_acquire(0, 4096, Holder::Write).unwrap();
        assert!(l.try_acquire(0, 4096, Holder::Rmw).is_none());
        let c = l.try_acquire(4096, 8192, Holder::Rmw).unwrap();
        assert!(l.try_acquire(4096, 4608, Holder::Write).is_none());
        assert!(l.try_acquire(8000, 9000, Holder::Rmw).is_none());
        l.release(a);
        l.release(b);
        l.release(c);
        assert_eq!(l.len(), 0);
        assert!(l.try_acquire(0, 8192, Holder::Rmw).is_some());
    }

    #[test]
    fn waiter_sees_release_from_another_thread() {
        let l = std::sync::Arc::new(RangeLocks::default());
        let k = l.try_acquire(0, 4096, Holder::Rmw).unwrap();
        let l2 = l.clone();
        let t = std::thread::spawn(move || loop {
            if let Some(k) = l2.try_acquire(1024, 2048, Holder::Write) {
                l2.release(k);
                return;
            }
            l2.wait_change();
        });
        std::thread::sleep(Duration::from_millis(5));
        l.release(k);
        t.join().unwrap();
    }
}
