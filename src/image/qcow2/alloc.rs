//! Where new clusters come from: free space inside the file (for data written whole), else
//! the end of the file, which grows ahead of the allocations (preallocation, or holes); and
//! the release of clusters an L2 change no longer references.

use std::sync::atomic::Ordering;

use super::map::{compressed_span, L2_COMPRESSED, L2_OFFSET_MASK};
use super::refcount::RefChange;
use super::{ImageError, Qcow2Image, WriteState};
use crate::image::prealloc::{errno, preallocate, PreallocMode};
use crate::io::aligned::write_all_aligned;
use crate::io::bounce::AlignedBuf;
use crate::io::Storage;

/// While serving, the file is grown in steps of this (never to a size that is not a multiple
/// of the page size, see `extend_to`).
pub(super) const SIZE_STEP: u64 = 1 << 20;

/// How far ahead of the allocations refcounts are set (`reserve`): one refcount write and
/// one sync per this much new space, instead of one per allocating write. The most a crash
/// can leak.
const RESERVE_BYTES: u64 = 8 << 20;

impl Qcow2Image {
    /// A new cluster at the end of the file, its refcount set to 1 (in the cache).
    pub(super) fn alloc_cluster(
        &self,
        ws: &mut WriteState,
        file: &dyn Storage,
    ) -> Result<u64, ImageError> {
        let host = ws.next_free;
        ws.next_free += self.cluster_size();
        self.file_size.fetch_max(ws.next_free, Ordering::AcqRel);
        self.reserve(ws, file, host, 1)?;
        self.grow(ws, file, host, host + self.cluster_size(), false);
        Ok(host)
    }

    /// A new cluster at the end of the file that starts out as zeroes (a new table): its
    /// refcount set, and its zeroes written unless it is preallocated space known to read
    /// as zeroes already.
    pub(super) fn alloc_zeroed_cluster(
        &self,
        ws: &mut WriteState,
        file: &dyn Storage,
    ) -> Result<u64, ImageError> {
        let c = self.cluster_size();
        let host = ws.next_free;
        ws.next_free += c;
        self.file_size.fetch_max(ws.next_free, Ordering::AcqRel);
        self.reserve(ws, file, host, 1)?;
        if !self.grow(ws, file, host, host + c, true) {
            let zero = AlignedBuf::new(c as usize, 4096).map_err(ImageError::Io)?;
            write_all_aligned(file, host, zero.as_slice()).map_err(ImageError::Io)?;
        }
        Ok(host)
    }

    /// Set the refcounts of the `n` clusters at `host`, just taken from the end of the
    /// allocations, to 1: nothing to do when they were reserved; else set them and the
    /// [`RESERVE_BYTES`] after them in one go (a refcount block this needs is allocated at
    /// `next_free`, inside the reserved space, which then moves past it).
    pub(super) fn reserve(
        &self,
        ws: &mut WriteState,
        file: &dyn Storage,
        host: u64,
        n: u64,
    ) -> Result<(), ImageError> {
        let c = self.cluster_size();
        let end = host + n * c;
        if end <= ws.reserved_end {
            return Ok(());
        }
        let target = (end + RESERVE_BYTES).next_multiple_of(c);
        let mut pos = ws.reserved_end.max(host);
        while pos < target {
            self.set_refcount(ws, file, pos, RefChange::Set(1))?;
            pos += c;
        }
        ws.reserved_end = target.max(ws.next_free);
        if ws.prealloc.is_none() {
            // The file covers what is reserved too: one sync then covers the length and the
            // refcounts of the whole reservation (with preallocation, its extensions do).
            Self::extend_to(ws, file, ws.reserved_end);
        }
        Ok(())
    }

    /// Give back the clusters reserved and not allocated (a clean close): their refcounts
    /// return to 0.
    pub(super) fn unreserve(
        &self,
        ws: &mut WriteState,
        file: &dyn Storage,
    ) -> Result<(), ImageError> {
        let c = self.cluster_size();
        let mut pos = ws.next_free;
        while pos < ws.reserved_end {
            self.set_refcount(ws, file, pos, RefChange::Set(0))?;
            pos += c;
        }
        ws.reserved_end = ws.next_free;
        Ok(())
    }

    /// A data cluster for a copy-on-write: free space first (counted), else the end of the
    /// file; whether it was reused.
    pub(super) fn alloc_data_cluster(
        &self,
        ws: &mut WriteState,
        file: &dyn Storage,
    ) -> Result<(u64, bool), ImageError> {
        Ok(match self.find_free_run(ws, file, 1)? {
            Some(h) => {
                self.stats.reused_clusters.fetch_add(1, Ordering::Relaxed);
                (h, true)
            }
            None => (self.alloc_cluster(ws, file)?, false),
        })
    }

    /// `n` contiguous free clusters (refcount 0) below the end of the allocations, for a
    /// data write that writes all of them (their old contents are anything); their
    /// refcounts are set. Never used for metadata: a guest write racing the discard that
    /// freed a cluster could still land in it. The scan starts at `free_cursor` (every
    /// cluster below is in use) and a failed scan is not repeated for as long a run until
    /// something is freed, so each cluster is looked at about once.
    pub(super) fn find_free_run(
        &self,
        ws: &mut WriteState,
        file: &dyn Storage,
        n: u64,
    ) -> Result<Option<u64>, ImageError> {
        if n > ws.free_run_hint {
            return Ok(None);
        }
        let c = self.cluster_size();
        let mut pos = ws.free_cursor;
        let mut first_free = None;
        let mut run_start = 0;
        let mut run = 0;
        while pos < ws.next_free {
            if !self.is_metadata(pos) && self.get_refcount(ws, file, pos)? == 0 {
                if run == 0 {
                    run_start = pos;
                }
                first_free.get_or_insert(pos);
                run += 1;
                if run == n {
                    for k in 0..n {
                        self.set_refcount(ws, file, run_start + k * c, RefChange::Set(1))?;
                    }
                    ws.free_cursor = match first_free {
                        Some(f) if f < run_start => f,
                        _ => pos + c,
                    };
                    return Ok(Some(run_start));
                }
            } else {
                run = 0;
            }
            pos += c;
        }
        ws.free_cursor = first_free.unwrap_or(ws.next_free);
        ws.free_run_hint = n - 1;
        Ok(None)
    }

    /// Queue the release of the host cluster(s) an old L2 entry used: applied once the L2
    /// change that dropped them is durable.
    pub(super) fn release_old(&self, ws: &mut WriteState, e: u64) {
        let c = self.cluster_size();
        if e & L2_COMPRESSED != 0 {
            let (host, sectors) = compressed_span(e, self.cluster_bits);
            let last = host + (sectors * 512).saturating_sub(host & 511).max(1) - 1;
            let mut cl = host & !(c - 1);
            while cl <= (last & !(c - 1)) {
                ws.pending_decs.push(cl);
                cl += c;
            }
        } else if e & L2_OFFSET_MASK != 0 {
            ws.pending_decs.push(e & L2_OFFSET_MASK);
        }
    }

    /// New file space [start, end) is about to be written (`zero`: with zeroes): let the
    /// preallocation extend the file ahead of it. True when a zero write there can be
    /// skipped (the range is preallocated and known to read as zeroes).
    pub(super) fn grow(
        &self,
        ws: &mut WriteState,
        file: &dyn Storage,
        start: u64,
        end: u64,
        zero: bool,
    ) -> bool {
        let Some(p) = ws.prealloc.as_mut() else {
            // No preallocation: still size the file over the new clusters (a hole, no
            // blocks), so the data writes into them do not each extend the file.
            Self::extend_to(ws, file, end);
            return false;
        };
        // With a background thread, zero writes are not merged (that would need the
        // extension's result now): they are written like data.
        let zero = zero && !self.prealloc_bg.active();
        // A background extension finished: take its result first.
        if let Some((e, r)) = self.prealloc_bg.take_done() {
            // Trust the file's real length: it is what reads and the metadata rely on.
            let len = file.size().unwrap_or(0);
            let was_unsupported = p.unsupported;
            let ok = p.extended(e.min(len), r, len);
            p.busy = false;
            self.count_prealloc(ok, p.unsupported && !was_unsupported);
            ws.covered = ws.covered.max(len);
            ws.unsynced_refcounts = true;
        }
        let Some(p) = ws.prealloc.as_mut() else {
            return false;
        };
        let plan = p.handle_write(start, end - start, zero);
        let Some((s, e)) = plan.extend else {
            // Halfway through the preallocated space: the next step starts now, in the
            // background, so that the writes find it done.
            if let Some((s, e)) = p.plan_ahead(p.data_end) {
                if self.prealloc_bg.active() && self.prealloc_bg.start(s, e) {
                    p.busy = true;
                }
            }
            if !plan.merged {
                // Past the end while an extension runs (or after one failed): size the
                // file over the new clusters, as without preallocation.
                Self::extend_to(ws, file, end);
            }
            return plan.merged;
        };
        if !zero && self.prealloc_bg.start(s, e) {
            // Off this thread: the write goes on meanwhile without waiting for it.
            p.busy = true;
            Self::extend_to(ws, file, end);
            return false;
        }
        let was_unsupported = p.unsupported;
        let r = preallocate(file, PreallocMode::Falloc, s, e).map_err(|err| errno(&err));
        let len = file.size().unwrap_or(0);
        let ok = p.extended(e, r, len);
        self.count_prealloc(ok, p.unsupported && !was_unsupported);
        if ok {
            ws.covered = ws.covered.max(e);
        }
        ws.unsynced_refcounts = true;
        ok && plan.merged
    }

    /// Make the file at least `end` long (never shorter: a background extension may have
    /// made it longer than `covered` says).
    pub(super) fn extend_to(ws: &mut WriteState, file: &dyn Storage, end: u64) {
        if end <= ws.covered {
            return;
        }
        // Whole pages, in steps: growing a file whose size is not a multiple of the page size
        // makes the file system zero the old last block through the page cache, which then
        // collides with concurrent direct I/O (EIO). The rounding is holes, trimmed on close.
        let end = end.next_multiple_of(SIZE_STEP);
        match file.size() {
            Ok(len) if len >= end => ws.covered = len,
            Ok(_) => {
                if file.set_len(end).is_ok() {
                    ws.covered = end;
                    // An L2 entry naming a cluster in the new length waits for a sync.
                    ws.unsynced_refcounts = true;
                }
            }
            Err(_) => {}
        }
    }

    pub(super) fn count_prealloc(&self, ok: bool, newly_unsupported: bool) {
        let counter = if ok {
            &self.stats.preallocs_done
        } else {
            &self.stats.preallocs_skipped
        };
        counter.fetch_add(1, Ordering::Relaxed);
        if newly_unsupported {
            log::warn!(
                "preallocation: fallocate is not supported by this file system; \
                 stopped trying (writes extend the file)"
            );
        }
    }
}
