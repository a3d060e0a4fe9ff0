//! Metadata that reaches the file later than the change it records, shared by the formats:
//! chunks of a metadata table changed in memory and written back in offset order, and
//! releases (a freed cluster, a dropped reference) that may only take effect once the
//! metadata change that caused them is durable, so a crash can leak but never corrupt.

use std::collections::BTreeSet;
use std::io;

use crate::io::aligned::write_all_aligned;
use crate::io::Storage;

/// File offsets of metadata chunks that differ from the file.
#[derive(Debug, Default)]
pub struct DirtyChunks {
    set: BTreeSet<u64>,
}

impl DirtyChunks {
    pub fn mark(&mut self, at: u64) {
        self.set.insert(at);
    }

    pub fn len(&self) -> usize {
        self.set.len()
    }

    pub fn is_empty(&self) -> bool {
        self.set.is_empty()
    }

    /// Forget chunks (their metadata went away or is rewritten whole).
    pub fn retain(&mut self, keep: impl FnMut(&u64) -> bool) {
        self.set.retain(keep);
    }

    /// Write every dirty chunk in offset order; `bytes(at)` is its current contents (None:
    /// nothing to write any more). A failed write leaves that chunk and the later ones
    /// dirty, to be written next time.
    pub fn write_back<'a>(
        &mut self,
        file: &dyn Storage,
        mut bytes: impl FnMut(u64) -> Option<&'a [u8]>,
    ) -> io::Result<()> {
        while let Some(&at) = self.set.first() {
            if let Some(b) = bytes(at) {
                write_all_aligned(file, at, b)?;
            }
            self.set.remove(&at);
        }
        Ok(())
    }
}

/// Releases that wait until the metadata change that caused them is durable.
#[derive(Debug)]
pub struct AfterDurable<T> {
    pending: Vec<T>,
}

impl<T> Default for AfterDurable<T> {
    fn default() -> Self {
        AfterDurable {
            pending: Vec::new(),
        }
    }
}

impl<T> AfterDurable<T> {
    /// Release `t` once the metadata written so far is durable.
    pub fn push(&mut self, t: T) {
        self.pending.push(t);
    }

    pub fn is_empty(&self) -> bool {
        self.pending.is_empty()
    }

    /// The metadata that caused them has been written: make it durable (one sync, none
    /// when nothing waits) and hand out what may be released now.
    pub fn release(&mut self, file: &dyn Storage) -> io::Result<Vec<T>> {
        if self.pending.is_empty() {
            return Ok(Vec::new());
        }
        file.sync_data()?;
        Ok(std::mem::take(&mut self.pending))
    }

    /// The caller has just made everything durable itself: hand out every release.
    pub fn take_durable(&mut self) -> Vec<T> {
        std::mem::take(&mut self.pending)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::MemStorage;

    #[test]
    fn dirty_chunks_are_written_in_order_and_forgotten() {
        let disk = MemStorage::new(vec![0u8; 8192]);
        let mut d = DirtyChunks::default();
        d.mark(4096);
        d.mark(0);
        let a = [1u8; 512];
        let b = [2u8; 512];
        let mut seen = Vec::new();
        d.write_back(&disk, |at| {
            seen.push(at);
            Some(if at == 0 { &a[..] } else { &b[..] })
        })
        .unwrap();
        assert_eq!(seen, vec![0, 4096]);
        assert!(d.is_empty());
        let mut got = [0u8; 1];
        disk.read_at(&mut got, 4096).unwrap();
        assert_eq!(got[0], 2);
    }

    #[test]
    fn releases_wait_for_a_sync() {
        let disk = MemStorage::new(vec![0u8; 512]);
        let mut r = AfterDurable::default();
        assert!(r.release(&disk).unwrap().is_empty());
        r.push(7u64);
        assert_eq!(r.release(&disk).unwrap(), vec![7]);
        assert!(r.is_empty());
    }
}

/// Which metadata changes are in the file, for `publish`: before a request that changed the
/// mapping completes, every change made so far must have been written by a write-back that
/// *finished*. A flag cleared when a write-back starts is not enough: a second queue seeing
/// it cleared would complete its request while the first is still writing (and a process
/// killed then loses that request's mapping). Changes are counted instead; a write-back
/// records the count it started from once it has finished.
#[derive(Debug, Default)]
pub struct Publication {
    changed: std::sync::atomic::AtomicU64,
    published: std::sync::atomic::AtomicU64,
}

impl Publication {
    /// A change was made (call after it is visible to a write-back, under the lock that
    /// write-backs take).
    pub fn note_change(&self) {
        self.changed
            .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
    }

    /// Are there changes no finished write-back has covered?
    pub fn pending(&self) -> bool {
        use std::sync::atomic::Ordering::Acquire;
        self.published.load(Acquire) < self.changed.load(Acquire)
    }

    /// The count a write-back starting now covers (call under the write-back lock).
    pub fn start(&self) -> u64 {
        self.changed.load(std::sync::atomic::Ordering::Acquire)
    }

    /// A write-back that started at `at` (from [`Publication::start`]) has finished.
    pub fn finished(&self, at: u64) {
        self.published
            .fetch_max(at, std::sync::atomic::Ordering::AcqRel);
    }
}

#[cfg(test)]
mod publication_tests {
    use super::Publication;

    #[test]
    fn a_change_is_pending_until_a_write_back_that_started_after_it_finished() {
        let p = Publication::default();
        assert!(!p.pending());
        p.note_change();
        let at = p.start();
        // Another queue looks while the write-back runs: still pending.
        assert!(p.pending());
        p.note_change();
        p.finished(at);
        // The second change came after the write-back started.
        assert!(p.pending());
        let at = p.start();
        p.finished(at);
        assert!(!p.pending());
    }
}

/// Data syncs shared between threads (group commit): a thread that needs the writes it
/// has completed to be durable waits for a sync that started after them, and one sync
/// serves every thread waiting meanwhile, instead of one `fdatasync` each (the
/// copy-on-write pool's threads, each after its own cluster's write).
#[derive(Debug, Default)]
pub struct GroupSync {
    state: std::sync::Mutex<SyncRounds>,
    done: std::sync::Condvar,
}

#[derive(Debug, Default)]
struct SyncRounds {
    /// Rounds (syncs) finished, numbered from 1.
    finished: u64,
    /// A round is running (number `finished + 1`).
    running: bool,
    /// The latest round that failed, and its error number.
    failed: Option<(u64, i32)>,
    /// Rounds run, and callers served (for the statistics).
    calls: u64,
}

impl GroupSync {
    /// Make every write this thread completed before the call durable: with a sync of
    /// `sync` that starts after the call, run here or by another thread. A failure of any
    /// round from that one on is this call's failure.
    pub fn sync(&self, sync: impl FnOnce() -> io::Result<()>) -> io::Result<()> {
        use crate::locks::Locked;
        let mut st = self.state.locked();
        st.calls += 1;
        // A round running now may have started before this thread's writes: the next one.
        let need = st.finished + 1 + u64::from(st.running);
        let mut sync = Some(sync);
        loop {
            if st.finished >= need {
                return match st.failed {
                    Some((round, errno)) if round >= need => {
                        Err(io::Error::from_raw_os_error(errno))
                    }
                    _ => Ok(()),
                };
            }
            if !st.running {
                if let Some(f) = sync.take() {
                    st.running = true;
                    let round = st.finished + 1;
                    drop(st);
                    let r = f();
                    st = self.state.locked();
                    st.running = false;
                    st.finished = round;
                    if let Err(e) = &r {
                        st.failed = Some((round, e.raw_os_error().unwrap_or(libc::EIO)));
                    }
                    self.done.notify_all();
                    continue;
                }
            }
            st = self
                .done
                .wait(st)
                .unwrap_or_else(std::sync::PoisonError::into_inner);
        }
    }

    /// Callers so far, and syncs run for them.
    pub fn counts(&self) -> (u64, u64) {
        use crate::locks::Locked;
        let st = self.state.locked();
        (st.calls, st.finished)
    }
}

#[cfg(test)]
mod group_sync_tests {
    use super::GroupSync;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;
    use std::time::Duration;

    /// Every caller returns only after a sync that started after its call; callers that
    /// overlap share syncs.
    #[test]
    fn callers_wait_for_a_sync_that_started_after_them_and_share_it() {
        let g = Arc::new(GroupSync::default());
        // Each sync takes 5 ms and records when it started (ticks of a counter that
        // callers also read when they arrive).
        let clock = Arc::new(AtomicU64::new(0));
        let threads: Vec<_> = (0..8)
            .map(|_| {
                let (g, clock) = (g.clone(), clock.clone());
                std::thread::spawn(move || {
                    let mut starts = Vec::new();
                    for _ in 0..10 {
                        let arrived = clock.fetch_add(1, Ordering::SeqCst);
                        let started = Arc::new(AtomicU64::new(u64::MAX));
                        let s = started.clone();
                        let c = clock.clone();
                        g.sync(|| {
                            s.store(c.fetch_add(1, Ordering::SeqCst), Ordering::SeqCst);
                            std::thread::sleep(Duration::from_millis(5));
                            Ok(())
                        })
                        .unwrap();
                        starts.push((arrived, started.load(Ordering::SeqCst)));
                    }
                    starts
                })
            })
            .collect();
        for t in threads {
            for (arrived, ran) in t.join().unwrap() {
                // A caller that ran the sync itself started it after arriving.
                assert!(ran == u64::MAX || ran > arrived);
            }
        }
        let (calls, syncs) = g.counts();
        assert_eq!(calls, 80);
        assert!(syncs < 60, "{syncs} syncs for 80 overlapping calls");
    }

    #[test]
    fn a_failed_sync_fails_its_callers_and_not_later_ones() {
        let g = GroupSync::default();
        let e = g.sync(|| Err(std::io::Error::from_raw_os_error(libc::EIO)));
        assert_eq!(e.unwrap_err().raw_os_error(), Some(libc::EIO));
        g.sync(|| Ok(())).unwrap();
        assert_eq!(g.counts(), (2, 2));
    }
}
