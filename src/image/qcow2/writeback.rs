//! Metadata write-back in dependency order (every allocated cluster inside the file,
//! refcount increases, a barrier, L2 tables, a barrier, then the decrements those L2
//! changes allow), FLUSH and the clean close.

use super::alloc::SIZE_STEP;
use super::refcount::{RefChange, MAX_DIRTY_REFCOUNT_CHUNKS};
use super::{ImageError, Qcow2Image, WriteState};
use crate::io::Storage;
use crate::locks::Locked;

impl Qcow2Image {
    /// Write back dirty metadata in dependency order; the caller syncs the file afterwards
    /// for durability (FLUSH). Read-only images have none.
    pub fn flush(&self, file: &dyn Storage) -> Result<(), ImageError> {
        let Ok(mut ws) = self.lock_write() else {
            return Ok(());
        };
        self.write_back(&mut ws, file)
    }

    /// Clean close: write back metadata and trim the file to the end of the last allocated
    /// cluster.
    pub fn close(&self, file: &dyn Storage) -> Result<(), ImageError> {
        let Ok(mut ws) = self.lock_write() else {
            return Ok(());
        };
        self.unreserve(&mut ws, file)?;
        self.write_back(&mut ws, file)?;
        // The decrements that write-back applied last (clusters the written L2 tables no
        // longer use): written now, or a clean shutdown would leave them leaked.
        if !ws.dirty_chunks.is_empty() {
            self.write_dirty_refcounts(&mut ws, file)?;
        }
        // A background extension still running would extend the file after the trim.
        if let Some(p) = ws.prealloc.as_mut().filter(|p| p.busy) {
            if let Some((e, r)) = self.prealloc_bg.wait_done() {
                let len = file.size().map_err(ImageError::Io)?;
                p.extended(e, r, len);
            }
            p.busy = false;
        }
        // Nothing past the last allocated cluster is referenced: drop the preallocated tail
        // (or one a crash left behind).
        let end = ws.next_free;
        if file.size().map_err(ImageError::Io)? > end {
            file.set_len(end).map_err(ImageError::Io)?;
            ws.covered = end;
            if let Some(p) = ws.prealloc.as_mut() {
                p.file_end = end;
                p.data_end = p.data_end.min(end);
                p.zero_start = p.zero_start.min(end);
            }
        }
        Ok(())
    }

    /// Write back early when the caches hold too much dirty metadata.
    pub(super) fn maybe_write_back(
        &self,
        ws: &mut WriteState,
        file: &dyn Storage,
    ) -> Result<(), ImageError> {
        let too_many_tables = {
            let cache = self.lock_l2();
            // Dirty tables are never evicted: write back early only when the cache could
            // run out of clean ones, not when it holds every table the image can have
            // (then a random write workload would sync every few writes).
            let all_tables = self
                .size_bytes()
                .div_ceil(1u64 << (self.cluster_bits + self.l2_bits));
            (cache.capacity as u64) < all_tables && cache.dirty_tables() * 2 >= cache.capacity
        };
        if too_many_tables || ws.dirty_chunks.len() >= MAX_DIRTY_REFCOUNT_CHUNKS {
            self.write_back(ws, file)?;
        }
        Ok(())
    }

    /// Every allocated cluster inside the file (so no L2 entry on disk points past its end),
    /// refcount increases, a barrier, dirty L2 tables, a barrier, then the decrements that
    /// the written L2 changes allow (they become dirty refcount chunks, written next time).
    pub(super) fn write_back(
        &self,
        ws: &mut WriteState,
        file: &dyn Storage,
    ) -> Result<(), ImageError> {
        self.write_back_ordered(ws, file, true)
    }

    /// Put every L2 change made so far into the file (after what it depends on, in the
    /// order `write_back` keeps), without the final release of freed clusters: called
    /// before requests whose writes changed the mapping complete, so that a new vublk
    /// process after a crash finds them (the host's page cache holds the metadata as it
    /// holds the data; FLUSH still makes both durable). Cheap when nothing changed.
    ///
    /// The L2 chunks are written without the allocation lock (what they depend on is
    /// written under it first), so copy-on-write threads allocate and install entries
    /// meanwhile; those changes are not in the chunks copied and wait for the next
    /// write-back.
    pub fn publish(&self, file: &dyn Storage) -> Result<(), ImageError> {
        loop {
            if !self.unpublished.pending() {
                return Ok(());
            }
            let Ok(mut ws) = self.lock_write() else {
                return Ok(());
            };
            // Written by another queue while this one waited for the lock, perhaps.
            if !self.unpublished.pending() {
                return Ok(());
            }
            let io = match self.write_back_io.try_lock() {
                Ok(g) => g,
                Err(std::sync::TryLockError::Poisoned(e)) => e.into_inner(),
                Err(std::sync::TryLockError::WouldBlock) => {
                    // Another write-back is writing: wait for it without the allocation
                    // lock, then look again (it may have covered this queue's changes).
                    drop(ws);
                    drop(self.write_back_io.lock());
                    continue;
                }
            };
            let (covers, copies) = self.prepare_write_back(&mut ws, file)?;
            drop(ws);
            self.write_chunk_copies(file, copies)?;
            self.unpublished.finished(covers);
            drop(io);
            return Ok(());
        }
    }

    /// `write_back`; `release`: also apply the decrements the written L2 changes allow
    /// (one more sync).
    fn write_back_ordered(
        &self,
        ws: &mut WriteState,
        file: &dyn Storage,
        release: bool,
    ) -> Result<(), ImageError> {
        let _io = self.write_back_io.locked();
        let (covers, copies) = self.prepare_write_back(ws, file)?;
        self.write_chunk_copies(file, copies)?;
        // Everything changed before `covers` is in the file now.
        self.unpublished.finished(covers);
        if !release {
            return Ok(());
        }
        for host in ws.pending_decs.release(file).map_err(ImageError::Io)? {
            if self.set_refcount(ws, file, host, RefChange::Dec)? == 0 {
                self.forget_freed_cluster(ws, host);
                ws.free_cursor = ws.free_cursor.min(host);
                ws.free_run_hint = u64::MAX;
                if self.punch_freed {
                    // Best effort: give the space back to the host file system.
                    let _ = file.punch_hole(host, self.cluster_size());
                }
            }
        }
        Ok(())
    }

    /// The first part of a write-back, under the allocation lock with `write_back_io` held:
    /// everything the L2 chunks depend on is written (and synced where needed), then the
    /// dirty chunks are copied for writing. Returns the change count the write-back covers
    /// once those copies are written.
    fn prepare_write_back(
        &self,
        ws: &mut WriteState,
        file: &dyn Storage,
    ) -> Result<(u64, super::l2cache::ChunkCopies), ImageError> {
        // What this write-back covers: every change made so far (all under `ws`).
        let covers = self.unpublished.start();
        // Compressed chunks reach the file before any L2 entry that names them; after a
        // failed cache write, nothing may claim durability again.
        self.write_back_cache(file)?;
        let l2_dirty = self.lock_l2().dirty_tables() > 0;
        if l2_dirty || !ws.dirty_chunks.is_empty() {
            if ws.covered < ws.next_free {
                let end = ws.next_free.next_multiple_of(SIZE_STEP);
                if file.size().map_err(ImageError::Io)? < ws.next_free {
                    file.set_len(end).map_err(ImageError::Io)?;
                    ws.unsynced_refcounts = true;
                }
                ws.covered = ws.covered.max(ws.next_free);
            }
            self.write_dirty_refcounts(ws, file)?;
        }
        if !l2_dirty {
            return Ok((covers, Default::default()));
        }
        // The barrier: no L2 chunk on disk may name a cluster whose refcount (or the file
        // length covering it), or whose copy of the data an entry replaced, is not durable.
        // Nothing to wait for when those were synced already (clusters reserved ahead need
        // no refcount write: `alloc::reserve`).
        if ws.unsynced_refcounts || ws.unsynced_data {
            file.sync_data().map_err(ImageError::Io)?;
            ws.unsynced_refcounts = false;
            ws.unsynced_data = false;
        }
        Ok((covers, self.copy_dirty_tables()?))
    }

    /// Write the dirty refcount chunks (any time is safe: see [`WriteState::dirty_chunks`]).
    pub(super) fn write_dirty_refcounts(
        &self,
        ws: &mut WriteState,
        file: &dyn Storage,
    ) -> Result<(), ImageError> {
        if ws.dirty_chunks.is_empty() {
            return Ok(());
        }
        ws.unsynced_refcounts = true;
        let chunks = &ws.refcount_chunks;
        ws.dirty_chunks
            .write_back(file, |at| chunks.get(&at).map(Vec::as_slice))
            .map_err(ImageError::Io)
    }
}
