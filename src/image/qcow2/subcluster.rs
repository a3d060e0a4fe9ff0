//! Extended L2 entries (`extended_l2=on`, QEMU 5.2+): each cluster has 32 subclusters,
//! each allocated (data at its place in the host cluster), zero, or unallocated (the
//! backing file shows through) on its own. Reads map them in `map`; the L2 cache shows a
//! cluster whose subclusters agree to the rest of the format as the plain entry that reads
//! the same (`l2cache`), so every plain path stays right. Here are the paths that use the
//! subclusters: a write that covers part of a cluster writes only the subclusters it
//! touches, into the image's own host cluster or a new one, and copies nothing else (a
//! plain image copies the whole cluster from the backing file); a stream job's step fills
//! only the subclusters the image does not hold.

use super::cow::{CowInstall, FreshWrite, SubInstall};
use super::map::{sub_mask, L2_COMPRESSED, L2_COPIED, L2_OFFSET_MASK, SUBCLUSTERS, SUB_ALL};
use super::refcount::RefChange;
use super::{FillOld, ImageError, Qcow2Image, WriteState};
use crate::io::bounce::AlignedBuf;
use crate::io::Storage;

impl Qcow2Image {
    /// The first subcluster and how many the bytes [in_cl, in_cl + len) of a cluster touch.
    fn subclusters_of(&self, in_cl: u64, len: u64) -> (u64, u64) {
        let sub = self.cluster_size() / SUBCLUSTERS;
        let first = in_cl / sub;
        (first, (in_cl + len).div_ceil(sub) - first)
    }

    /// The stored entry of the cluster at `cl_start` checked for use here: None when the
    /// subclusters cannot be written on their own (a compressed cluster, or a host cluster
    /// shared with a snapshot: the cluster is copied whole).
    fn own_subclusters(
        &self,
        file: &dyn Storage,
        cl_start: u64,
    ) -> Result<Option<(u64, u64, u64)>, ImageError> {
        let (d, bitmap) = self.l2_raw(file, cl_start)?;
        let host = d & L2_OFFSET_MASK;
        if d & L2_COMPRESSED != 0 || (host != 0 && d & L2_COPIED == 0) {
            return Ok(None);
        }
        let (alloc, zero) = (bitmap & SUB_ALL, bitmap >> 32);
        if alloc & zero != 0 || (alloc != 0 && host == 0) {
            return Err(ImageError::Corrupt(
                "an L2 subcluster bitmap contradicts itself or its entry",
            ));
        }
        if host != 0 && self.is_metadata(host) {
            return Err(ImageError::Corrupt("a data cluster overlaps metadata"));
        }
        Ok(Some((host, alloc, zero)))
    }

    /// Extended L2 entries: write `src` at `in_cl` of the guest cluster at `cl_start` into
    /// the subclusters it touches only, in the image's own host cluster or a new one (whose
    /// other subclusters stay as they read: unallocated or zero), and mark them allocated.
    /// A subcluster the write covers in part gets its old contents around the data
    /// (`fill_old`, the cluster as the guest sees it). The data is written before the entry
    /// changes (in the cache; written back after the data is durable where that matters,
    /// `write_l2_raw`). Called with the allocation lock held. Ok(false): a plain image, or a
    /// cluster that is copied whole (compressed, shared with a snapshot).
    pub(super) fn write_subclusters(
        &self,
        ws: &mut WriteState,
        file: &dyn Storage,
        cl_start: u64,
        in_cl: usize,
        src: &[u8],
        fill_old: &mut FillOld<'_>,
    ) -> Result<bool, ImageError> {
        if !self.extended_l2 || src.is_empty() {
            return Ok(false);
        }
        let Some((host, alloc, zero)) = self.own_subclusters(file, cl_start)? else {
            return Ok(false);
        };
        let c = self.cluster_size();
        let sub = c / SUBCLUSTERS;
        let (first, n) = self.subclusters_of(in_cl as u64, src.len() as u64);
        let (span_start, span_end) = (first * sub, (first + n) * sub);
        let mut merged = None;
        if in_cl as u64 != span_start || in_cl as u64 + src.len() as u64 != span_end {
            let mut cluster = AlignedBuf::new(c as usize, 4096).map_err(ImageError::Io)?;
            let buf = cluster.as_mut_slice();
            fill_old(cl_start, buf)?;
            buf[in_cl..in_cl + src.len()].copy_from_slice(src);
            merged = Some(cluster);
        }
        let data = match &merged {
            Some(b) => &b.as_slice()[span_start as usize..span_end as usize],
            None => src,
        };
        let host = if host == 0 {
            // The other subclusters of a new cluster are never read: reused space needs
            // no clearing.
            self.alloc_data_cluster(ws, file)?.0
        } else {
            host
        };
        self.put_data(file, host + span_start, data)?;
        let m = sub_mask(first, n);
        let l2 = self.ensure_l2(ws, file, cl_start)?;
        let bitmap = (alloc | m) | ((zero & !m) << 32);
        self.write_l2_raw(
            ws,
            file,
            l2,
            self.l2_index(cl_start),
            (host | L2_COPIED, bitmap),
        )?;
        self.stats
            .subcluster_writes
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(true)
    }

    /// Extended L2 entries, a write inside one cluster: as [`Self::write_subclusters`], but
    /// with the data written without the allocation lock (like `write_cow_unlocked`), so
    /// that writers on other threads overlap their I/O. The host cluster (the image's own,
    /// or a new one) is chosen under the lock and the guest cluster marked busy (its other
    /// writers, zeroing and streaming wait); the data is written and, where the subclusters
    /// showed something other than fresh zeroes (the backing file, reused space), synced on
    /// this thread; the entry's bits are set under the lock. Ok(false): the caller takes
    /// the locked path.
    pub(super) fn write_subclusters_unlocked(
        &self,
        file: &dyn Storage,
        offset: u64,
        src: &[u8],
        fill_old: &mut FillOld<'_>,
    ) -> Result<bool, ImageError> {
        let c = self.cluster_size();
        let cl_start = offset & !(c - 1);
        let in_cl = offset - cl_start;
        if !self.extended_l2 || src.is_empty() || in_cl + src.len() as u64 > c {
            return Ok(false);
        }
        let (host, fresh, reused) = {
            let mut ws = self.lock_write_idle(cl_start)?;
            let Some((host, _, _)) = self.own_subclusters(file, cl_start)? else {
                return Ok(false);
            };
            let got = if host == 0 {
                let (new, reused) = self.alloc_data_cluster(&mut ws, file)?;
                (new, true, reused)
            } else {
                (host, false, false)
            };
            self.cow.lock().insert(cl_start);
            got
        };
        let sub = c / SUBCLUSTERS;
        let (first, n) = self.subclusters_of(in_cl, src.len() as u64);
        let (span_start, span_end) = (first * sub, (first + n) * sub);
        // The I/O, without the allocation lock. Ok(true): the data written is durable.
        let io = (|| -> Result<bool, ImageError> {
            let mut merged = None;
            if in_cl != span_start || in_cl + src.len() as u64 != span_end {
                let mut cluster = AlignedBuf::new(c as usize, 4096).map_err(ImageError::Io)?;
                let buf = cluster.as_mut_slice();
                fill_old(cl_start, buf)?;
                buf[in_cl as usize..in_cl as usize + src.len()].copy_from_slice(src);
                merged = Some(cluster);
            }
            let data = match &merged {
                Some(b) => &b.as_slice()[span_start as usize..span_end as usize],
                None => src,
            };
            self.put_data(file, host + span_start, data)?;
            if fresh && !reused && self.backing_file.is_none() && !self.encrypted() {
                // Fresh space reads as zeroes, as the subclusters did.
                return Ok(false);
            }
            // Before the entry: a crash must not show a hole or old bytes where the backing
            // file (or zeroes) read before. Here, on the pool thread, rather than by the
            // queue's publish for the whole batch (measured: 22k against 19k IOPS at depth
            // 32, BENCHMARKS.md).
            self.data_sync
                .sync(|| file.sync_data())
                .map_err(ImageError::Io)?;
            Ok(true)
        })();
        let m = sub_mask(first, n);
        self.install_unlocked_write(file, cl_start, fresh.then_some(host), io, |ws, durable| {
            self.set_subclusters(ws, file, cl_start, host, fresh, m, durable)
        })?;
        Ok(true)
    }

    /// Mark subclusters `mask` of the guest cluster at `cl` allocated in `host` (allocated
    /// for them, `fresh`, or the image's own), their zero bits cleared; the entry must still
    /// name that host cluster (or none, when fresh). `durable`: their data is durable
    /// already, so the entry waits for no sync.
    #[allow(clippy::too_many_arguments)]
    fn set_subclusters(
        &self,
        ws: &mut WriteState,
        file: &dyn Storage,
        cl: u64,
        host: u64,
        fresh: bool,
        mask: u64,
        durable: bool,
    ) -> Result<(), ImageError> {
        let (d, bitmap) = self.l2_raw(file, cl)?;
        if d & L2_OFFSET_MASK != if fresh { 0 } else { host } || d & L2_COMPRESSED != 0 {
            return Err(ImageError::Corrupt(
                "a cluster changed while its subclusters were written",
            ));
        }
        let bitmap = (bitmap & SUB_ALL | mask) | ((bitmap >> 32 & !mask) << 32);
        let l2 = self.ensure_l2(ws, file, cl)?;
        let others_unsynced = ws.unsynced_data;
        self.write_l2_raw(ws, file, l2, self.l2_index(cl), (host | L2_COPIED, bitmap))?;
        if durable {
            // This entry's data is durable already; other entries' need is unchanged.
            ws.unsynced_data = others_unsynced;
        }
        self.stats
            .subcluster_writes
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }

    /// Extended L2 entries, a write inside one cluster over a backing file that covers
    /// whole subclusters: its host place (the image's own host cluster, or a new one
    /// allocated now), to be written through the engine; the subclusters are marked
    /// allocated when it completes ([`Self::finish_cow`]), so reads see what they read
    /// before until then, and the guest cluster is busy meanwhile (its other writers,
    /// zeroing and streaming wait). The entry's change waits for the data to be durable
    /// (the publish syncs first: `write_l2_raw`). None: not such a write.
    ///
    /// Writers through the format wait for busy clusters, not for these writes as they
    /// do for fills (which make their clusters visible before their data lands).
    pub fn plan_subcluster_write(
        &self,
        file: &dyn Storage,
        offset: u64,
        len: u64,
    ) -> Result<Option<FreshWrite>, ImageError> {
        let c = self.cluster_size();
        let sub = c / SUBCLUSTERS;
        let cl_start = offset & !(c - 1);
        let in_cl = offset - cl_start;
        if !self.extended_l2
            || self.write.is_none()
            || len == 0
            || in_cl + len > c
            || !in_cl.is_multiple_of(sub)
            || !len.is_multiple_of(sub)
        {
            return Ok(None);
        }
        let mut ws = self.lock_write()?;
        if self.cow_busy(cl_start, 1) {
            return Ok(None);
        }
        let Some((host, _, _)) = self.own_subclusters(file, cl_start)? else {
            return Ok(None);
        };
        let fresh = host == 0;
        let host = if fresh {
            self.alloc_data_cluster(&mut ws, file)?.0
        } else {
            host
        };
        let (first, n) = self.subclusters_of(in_cl, len);
        // Not a fill: it writes only subclusters nothing reads until it is installed, and
        // every writer of the guest cluster (through the format too) waits for it; so
        // writes through the format need not drain it, nor it wait for their gate.
        self.cow.lock().insert(cl_start);
        Ok(Some(FreshWrite {
            host: host + in_cl,
            fill: None,
            install: Some(CowInstall {
                guest: cl_start,
                clusters: 1,
                host,
                sub: Some(SubInstall {
                    mask: sub_mask(first, n),
                    fresh,
                }),
            }),
        }))
    }

    /// [`Self::finish_cow`] of a [`Self::plan_subcluster_write`]: mark its subclusters
    /// allocated (`ok`), or give a new host cluster back.
    pub(super) fn install_subclusters(
        &self,
        ws: &mut WriteState,
        file: &dyn Storage,
        install: CowInstall,
        sub: SubInstall,
        ok: bool,
    ) -> Result<(), ImageError> {
        let (cl, host) = (install.guest, install.host);
        if !ok {
            if sub.fresh {
                // Never referenced: safe to write back at any time.
                self.set_refcount(ws, file, host, RefChange::Dec)?;
            }
            return Ok(());
        }
        self.set_subclusters(ws, file, cl, host, sub.fresh, sub.mask, false)
    }

    /// Extended L2 entries: the host offset of [offset, offset + len) inside one cluster
    /// when the image owns the cluster and every subcluster the range touches is allocated
    /// (a plain overwrite in place); None otherwise.
    pub(super) fn owned_subclusters(
        &self,
        file: &dyn Storage,
        offset: u64,
        len: u64,
    ) -> Result<Option<u64>, ImageError> {
        let c = self.cluster_size();
        let cl_start = offset & !(c - 1);
        if len == 0 || offset + len > cl_start + c {
            return Ok(None);
        }
        let Some((host, alloc, _)) = self.own_subclusters(file, cl_start)? else {
            return Ok(None);
        };
        let (first, n) = self.subclusters_of(offset - cl_start, len);
        let m = sub_mask(first, n);
        Ok((host != 0 && alloc & m == m).then_some(host + (offset - cl_start)))
    }

    /// Extended L2 entries, a stream job's step for a cluster that holds some subclusters
    /// and not others: the others get the contents `backing` holds for them (the backing
    /// chain's whole cluster), as data, or as zero subclusters where that is all zeroes.
    /// None: not such a cluster (the plain path handles it). Called without the allocation
    /// lock; takes it (`lock`) and looks again under it, so a guest write is never
    /// overwritten.
    pub(super) fn populate_subclusters(
        &self,
        file: &dyn Storage,
        cl: u64,
        backing: &[u8],
        ws: &mut WriteState,
    ) -> Result<Option<bool>, ImageError> {
        let (d, bitmap) = self.l2_raw(file, cl)?;
        let held = (bitmap | bitmap >> 32) & SUB_ALL;
        if !self.extended_l2 || d & L2_COMPRESSED != 0 || (held == 0 && d == 0) {
            return Ok(None);
        }
        if held == SUB_ALL {
            return Ok(Some(false));
        }
        let Some((host, alloc, zero)) = self.own_subclusters(file, cl)? else {
            return Err(ImageError::Corrupt(
                "a cluster shared with an internal snapshot holds only some subclusters",
            ));
        };
        let sub = (self.cluster_size() / SUBCLUSTERS) as usize;
        let missing = SUB_ALL & !(alloc | zero);
        let (mut new_alloc, mut new_zero) = (0u64, 0u64);
        for k in 0..SUBCLUSTERS {
            if missing >> k & 1 == 0 {
                continue;
            }
            let part = &backing[k as usize * sub..(k as usize + 1) * sub];
            if crate::zero::is_zero(part) {
                new_zero |= 1 << k;
            } else {
                new_alloc |= 1 << k;
            }
        }
        let host = if host == 0 && new_alloc != 0 {
            self.alloc_data_cluster(ws, file)?.0
        } else {
            host
        };
        // Runs of subclusters to copy, one write each.
        let mut k = 0;
        while k < SUBCLUSTERS {
            if new_alloc >> k & 1 == 0 {
                k += 1;
                continue;
            }
            let start = k;
            while k < SUBCLUSTERS && new_alloc >> k & 1 != 0 {
                k += 1;
            }
            let (a, b) = (start as usize * sub, k as usize * sub);
            self.put_data(file, host + a as u64, &backing[a..b])?;
        }
        let l2 = self.ensure_l2(ws, file, cl)?;
        let d = if host == 0 { 0 } else { host | L2_COPIED };
        let bitmap = (alloc | new_alloc) | ((zero | new_zero) << 32);
        self.write_l2_raw(ws, file, l2, self.l2_index(cl), (d, bitmap))?;
        Ok(Some(true))
    }
}
