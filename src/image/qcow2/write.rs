//! Writes and zeroing through the format, synchronously on the caller's thread (a queue
//! thread or a pool thread): in place where the image owns the cluster, else into a new
//! cluster holding the old contents around the new data (copy-on-write), or compressed.

use super::compress::Run;
use super::map::{L2_COMPRESSED, L2_COPIED, L2_OFFSET_MASK, L2_ZERO, SUB_ALL};
use super::{FillOld, ImageError, Qcow2Image, WriteState};
use crate::image::ZeroMode;
use crate::io::bounce::AlignedBuf;
use crate::io::Storage;

impl Qcow2Image {
    /// Write `data` at guest `offset` (synchronously, one request at a time per image).
    /// Clusters owned by this image alone are written in place; others (unallocated, zero,
    /// compressed, shared, or from the backing file) get a new cluster, filled with their old
    /// contents by `fill_old` and then `data`. The new cluster's refcount and L2 entry change
    /// in the caches; its data is written now, so it is in the file before the L2 entry that
    /// makes it visible; the old cluster's reference is dropped after that entry is durable.
    pub fn write(
        &self,
        file: &dyn Storage,
        offset: u64,
        data: &[u8],
        fill_old: &mut FillOld<'_>,
    ) -> Result<(), ImageError> {
        if self.write.is_none() {
            return Err(ImageError::ReadOnly);
        }
        let c = self.cluster_size();
        let end = offset + data.len() as u64;
        // Whole clusters compress the same whatever the image holds: compress them before
        // taking the allocation lock, so that writers on other threads compress in parallel.
        let mut pre: Vec<Option<Option<Vec<u8>>>> = Vec::new();
        if self.compress_writes() {
            let mut pos = offset;
            while pos < end {
                let in_cl = pos & (c - 1);
                let n = (c - in_cl).min(end - pos);
                let at = (pos - offset) as usize;
                pre.push((n == c).then(|| self.compress_cluster(&data[at..at + n as usize])));
                pos += n;
            }
        }
        let first_cl = offset & !(c - 1);
        let n_cl = (end - 1 - first_cl) / c + 1;
        // Extended L2 entries: a write inside one cluster goes to its subclusters only.
        if n_cl == 1 && !self.compress_writes() {
            let done = if self.extended_l2 {
                self.write_subclusters_unlocked(file, offset, data, fill_old)?
            } else {
                self.write_cow_unlocked(file, offset, data, fill_old)?
            };
            if done {
                return Ok(());
            }
        }
        // Never allocate for a cluster another writer is copying without the lock.
        let mut ws_guard = loop {
            let guard = self.lock_write()?;
            let busy = self.cow.lock();
            if !(0..n_cl).any(|k| busy.contains(&(first_cl + k * c))) {
                drop(busy);
                break guard;
            }
            drop(guard);
            self.cow.wait(busy);
        };
        let mut runs = Vec::new();
        let r = self.write_locked(&mut ws_guard, file, offset, data, fill_old, pre, &mut runs);
        if runs.is_empty() {
            r?;
            return self.maybe_write_back(&mut ws_guard, file);
        }
        // Full runs of compressed chunks go to the file without the allocation lock held, so
        // that other writers compress and place meanwhile; write-back waits for them.
        drop(ws_guard);
        let written = self.write_runs(file, runs);
        r?;
        written?;
        let mut ws = self.lock_write()?;
        self.maybe_write_back(&mut ws, file)
    }

    /// A stream job's step: give guest cluster `cl`, if this image does not hold it (it
    /// reads from the backing file), a cluster of its own with the contents `fill_old` reads
    /// (the backing chain's, which is read-only: read before the allocation lock is taken); all-zero contents become the zero flag (v3) instead of data.
    /// Nothing changes where the image holds the cluster, zero-flagged or compressed: the
    /// guest wrote it first. Serialised with guest writes of the cluster as a synchronous
    /// write is (the allocation lock; a copy-on-write or install in flight is waited for), so
    /// a guest write is never overwritten with older data. True if the cluster was filled.
    pub fn populate(
        &self,
        file: &dyn Storage,
        cl: u64,
        fill_old: &mut FillOld<'_>,
    ) -> Result<bool, ImageError> {
        if self.write.is_none() {
            return Err(ImageError::ReadOnly);
        }
        let c = self.cluster_size();
        let cl = cl & !(c - 1);
        let held = |e: u64| e & L2_OFFSET_MASK != 0 || e & L2_COMPRESSED != 0 || e & L2_ZERO != 0;
        let whole = if self.extended_l2 {
            let (d, bitmap) = self.l2_raw(file, cl)?;
            d & L2_COMPRESSED != 0 || (bitmap | bitmap >> 32) & SUB_ALL == SUB_ALL
        } else {
            held(self.l2_entry(file, cl)?)
        };
        if whole {
            return Ok(false);
        }
        // The backing chain is read-only: what it holds for the cluster cannot change, so it
        // is read before the allocation lock is taken (guest writes go on meanwhile).
        let mut buf = AlignedBuf::new(c as usize, 4096).map_err(ImageError::Io)?;
        fill_old(cl, buf.as_mut_slice())?;
        let mut ws = self.lock_write_idle(cl)?;
        // Extended L2 entries: a cluster that holds some subclusters gets the others.
        if let Some(filled) = self.populate_subclusters(file, cl, buf.as_mut_slice(), &mut ws)? {
            self.maybe_write_back(&mut ws, file)?;
            return Ok(filled);
        }
        // Under the lock: still not the image's (a guest write may have got there).
        if held(self.l2_entry(file, cl)?) {
            return Ok(false);
        }
        let entry = if self.version >= 3 && crate::zero::is_zero(buf.as_mut_slice()) {
            L2_ZERO
        } else {
            let (new, _) = self.alloc_data_cluster(&mut ws, file)?;
            self.put_data(file, new, buf.as_mut_slice())?;
            new | L2_COPIED
        };
        let l2 = self.ensure_l2(&mut ws, file, cl)?;
        self.write_l2_entry(&mut ws, file, l2, self.l2_index(cl), entry)?;
        self.maybe_write_back(&mut ws, file)?;
        Ok(true)
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn write_locked(
        &self,
        ws: &mut WriteState,
        file: &dyn Storage,
        offset: u64,
        data: &[u8],
        fill_old: &mut FillOld<'_>,
        mut pre: Vec<Option<Option<Vec<u8>>>>,
        runs: &mut Vec<Run>,
    ) -> Result<(), ImageError> {
        let c = self.cluster_size();
        let end = offset + data.len() as u64;
        let mut pos = offset;
        let mut cluster = AlignedBuf::new(c as usize, 4096).map_err(ImageError::Io)?;
        let mut i = 0;
        while pos < end {
            let this = i;
            i += 1;
            let cl_start = pos & !(c - 1);
            let in_cl = (pos - cl_start) as usize;
            let n = ((c - in_cl as u64).min(end - pos)) as usize;
            let src = &data[(pos - offset) as usize..(pos - offset) as usize + n];
            let e = self.l2_entry(file, cl_start)?;
            let host = e & L2_OFFSET_MASK;
            let in_place =
                e & L2_COMPRESSED == 0 && e & L2_COPIED != 0 && e & L2_ZERO == 0 && host != 0;
            let compress = self.compress_writes() && (n == c as usize || !in_place);
            if compress {
                // The cluster's new contents, whole: old contents (a copy-on-write of zero,
                // backing, compressed or shared data) around the new data.
                let buf = cluster.as_mut_slice();
                let z = match pre.get_mut(this).and_then(Option::take) {
                    Some(z) => z,
                    None => {
                        if n < c as usize {
                            fill_old(cl_start, buf)?;
                        }
                        buf[in_cl..in_cl + n].copy_from_slice(src);
                        self.compress_cluster(buf)
                    }
                };
                self.store_compressed(ws, file, cl_start, e, z, (buf, in_cl, src), runs)?;
                pos += n as u64;
                continue;
            }
            if !in_place && self.write_subclusters(ws, file, cl_start, in_cl, src, fill_old)? {
                pos += n as u64;
                continue;
            }
            if in_place {
                if self.is_metadata(host) {
                    return Err(ImageError::Corrupt("a data cluster overlaps metadata"));
                }
                self.put_data(file, host + in_cl as u64, src)?;
            } else {
                let buf = cluster.as_mut_slice();
                let old_is_zero = Self::merge_cluster(buf, cl_start, in_cl, src, fill_old)?;
                let (new, reused) = self.alloc_data_cluster(ws, file)?;
                if old_is_zero && n < c as usize && !reused && !self.encrypted() {
                    // A fresh cluster past every earlier allocation is a hole: write only
                    // the new data (no copy of zeroes). A reused one is written whole, and
                    // so is an encrypted one (its hole would decrypt to noise).
                    self.put_data(file, new + in_cl as u64, src)?;
                } else {
                    self.put_data(file, new, buf)?;
                }
                let l2 = self.ensure_l2(ws, file, cl_start)?;
                self.write_l2_entry(ws, file, l2, self.l2_index(cl_start), new | L2_COPIED)?;
                self.release_old(ws, e);
            }
            pos += n as u64;
        }
        self.maybe_write_back(ws, file)
    }

    /// Zero [offset, offset + len). Whole clusters of a v3 image get the zero flag: with
    /// `unmap` their host cluster is released, without it an allocated cluster this image owns
    /// keeps its space (compressed or shared data is always released). `discard` marks whole
    /// clusters unallocated instead (zero-flagged when a backing file could show through).
    /// Partial clusters, and v2 images, get zero data through [`Self::write`].
    pub fn zero_range(
        &self,
        file: &dyn Storage,
        offset: u64,
        len: u64,
        mode: ZeroMode,
        has_backing: bool,
        fill_old: &mut FillOld<'_>,
    ) -> Result<(), ImageError> {
        let c = self.cluster_size();
        let end = offset + len;
        let mut pos = offset;
        let zero = vec![0u8; c as usize];
        while pos < end {
            let cl_start = pos & !(c - 1);
            let n = (c - (pos - cl_start)).min(end - pos);
            let whole = pos == cl_start && n == c;
            // v2 has no zero flag: deallocate where nothing shows through, else write zeroes.
            let v2_dealloc = mode == ZeroMode::Discard || (mode == ZeroMode::Unmap && !has_backing);
            if !whole || (self.version < 3 && !v2_dealloc) {
                if mode != ZeroMode::Discard {
                    self.write(file, pos, &zero[..n as usize], fill_old)?;
                }
                pos += n;
                continue;
            }
            // Not while the cluster is written without the allocation lock (its host
            // cluster must stay until that write's entry is in).
            let mut ws = self.lock_write_idle(cl_start)?;
            let e = self.l2_entry(file, cl_start)?;
            let host = e & L2_OFFSET_MASK;
            let keep =
                mode == ZeroMode::Keep && e & L2_COMPRESSED == 0 && e & L2_COPIED != 0 && host != 0;
            let new_entry = match mode {
                ZeroMode::Discard if !has_backing || self.version < 3 => 0,
                ZeroMode::Unmap if self.version < 3 => 0,
                _ if keep => host | L2_COPIED | L2_ZERO,
                _ => L2_ZERO,
            };
            if new_entry != e {
                let l2 = self.ensure_l2(&mut ws, file, cl_start)?;
                self.write_l2_entry(&mut ws, file, l2, self.l2_index(cl_start), new_entry)?;
                if !keep {
                    self.release_old(&mut ws, e);
                }
            }
            self.maybe_write_back(&mut ws, file)?;
            pos += n;
        }
        Ok(())
    }
}
