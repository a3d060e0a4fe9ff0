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
