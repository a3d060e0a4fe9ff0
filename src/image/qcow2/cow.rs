//! Writes into clusters that have no data of their own yet, without the allocation lock
//! held across their data I/O:
//! - fresh clusters (reading as zeroes) get new host clusters and go through the engine;
//!   a partial first write may write them whole ("a fill", zeroes around the data), so that
//!   later writes into them are overwrites for the file system;
//! - whole clusters over a backing file get new host clusters whose L2 entries are
//!   installed when the data is in the file ([`CowInstall`]);
//! - a partial write over a backing file (or a zero cluster) is copied on write by the
//!   format: the new cluster allocated under the lock, the old data read and the cluster
//!   written without it, the L2 entry installed under it again.
//!
//! Synchronous writers through the format may write in place into clusters a fill is still
//! writing, so they raise the fill gate ([`FillGate`]) and wait for fills to drain first.

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

use super::map::{L2_COMPRESSED, L2_COPIED, L2_OFFSET_MASK, L2_ZERO};
use super::refcount::RefChange;
use super::{FillOld, ImageError, Qcow2Image, WriteState};
use crate::io::bounce::AlignedBuf;
use crate::io::ranges::{Holder, RangeLocks};
use crate::io::Storage;
use crate::locks::Locked;

/// Where a write planned into fresh clusters goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FreshWrite {
    /// Host offset of the write's first byte.
    pub host: u64,
    /// Write the new clusters whole instead: zeroes around the data. The caller must call
    /// [`Qcow2Image::end_fill`] with its key when that write has completed.
    pub fill: Option<Fill>,
    /// The L2 entries are not installed yet (the old contents came from the backing file, so
    /// they must stay visible until the data is in the file): the caller calls
    /// [`Qcow2Image::finish_cow`] with this when the write has completed, before completing
    /// the request.
    pub install: Option<CowInstall>,
}

/// New clusters written whole over clusters without data of their own, installed on
/// completion.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CowInstall {
    /// First guest cluster and how many.
    pub guest: u64,
    pub clusters: u64,
    /// First new host cluster (the rest follow it).
    pub host: u64,
    /// Extended L2 entries: the write covers only these subclusters of its one cluster
    /// (bits 0-31), in `host`, which was allocated for it (`fresh`) or is the image's own.
    pub sub: Option<SubInstall>,
}

/// The subclusters a [`CowInstall`] of one cluster marks allocated.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SubInstall {
    pub mask: u64,
    pub fresh: bool,
}

/// A whole-cluster first write of fresh clusters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fill {
    pub key: u64,
    /// Host range of the new clusters.
    pub start: u64,
    pub len: u64,
}

/// Fills in flight through the engine, and the gate synchronous format writers raise.
#[derive(Debug, Default)]
pub(super) struct Fills {
    /// Host ranges of fills in flight, held exclusively; in-place writes take shared ranges
    /// while any fill is in flight.
    ranges: RangeLocks,
    /// Fills in flight (counted before their L2 entries become visible), and whole-cluster
    /// writes waiting for their install.
    in_flight: AtomicU64,
    /// Raised gates: no new fill starts while one is up.
    gate: AtomicU64,
    /// Signalled when `in_flight` drops to zero.
    drained: (Mutex<()>, Condvar),
}

impl Fills {
    /// Counted before the gate is checked (both sequentially consistent): a writer that
    /// raises the gate and then waits for the count either sees this fill or stops it.
    fn start(&self) {
        self.in_flight.fetch_add(1, Ordering::SeqCst);
    }

    fn end(&self) {
        if self.in_flight.fetch_sub(1, Ordering::SeqCst) == 1 {
            let _g = self.drained.0.locked();
            self.drained.1.notify_all();
        }
    }

    fn gate_raised(&self) -> bool {
        self.gate.load(Ordering::SeqCst) > 0
    }
}

/// A raised fill gate: no fill starts until every gate is dropped.
#[derive(Debug)]
pub struct FillGate(Arc<Fills>);

impl FillGate {
    /// Are the fills in flight drained? Waits at most `timeout` for the last one to end.
    pub fn wait_drained(&self, timeout: Duration) -> bool {
        let f = &self.0;
        if f.in_flight.load(Ordering::SeqCst) == 0 {
            return true;
        }
        if timeout.is_zero() {
            return false;
        }
        let g = f.drained.0.locked();
        if f.in_flight.load(Ordering::SeqCst) == 0 {
            return true;
        }
        drop(f.drained.1.wait_timeout(g, timeout));
        f.in_flight.load(Ordering::SeqCst) == 0
    }
}

impl Drop for FillGate {
    fn drop(&mut self) {
        self.0.gate.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Guest clusters being copied on write without the allocation lock (their new cluster is
/// allocated, its L2 entry not yet installed). Locked after the allocation lock.
#[derive(Debug, Default)]
pub(super) struct CowClusters {
    busy: Mutex<HashSet<u64>>,
    /// Signalled when a guest cluster leaves `busy`.
    done: Condvar,
    /// Threads waiting on `done` (counted under the `busy` lock): with none, leaving
    /// signals nobody (a notify is a system call; one per write was 15% of the queue
    /// thread's time in the subcluster row).
    waiters: AtomicUsize,
}

impl CowClusters {
    pub(super) fn lock(&self) -> MutexGuard<'_, HashSet<u64>> {
        self.busy.locked()
    }

    /// Wait (with the allocation lock dropped) until a cluster leaves the set.
    pub(super) fn wait<'a>(&self, busy: MutexGuard<'a, HashSet<u64>>) {
        self.waiters.fetch_add(1, Ordering::SeqCst);
        drop(crate::locks::wait(&self.done, busy));
        self.waiters.fetch_sub(1, Ordering::SeqCst);
    }

    /// `n` guest clusters from `first` (clusters of `c` bytes) are done.
    pub(super) fn finish(&self, first: u64, n: u64, c: u64) {
        let mut busy = self.lock();
        for k in 0..n {
            busy.remove(&(first + k * c));
        }
        drop(busy);
        // A waiter counts itself under the lock before it waits: one that saw the
        // cluster busy is counted by now.
        if self.waiters.load(Ordering::SeqCst) > 0 {
            self.done.notify_all();
        }
    }
}

impl Qcow2Image {
    /// Stop new fills until the gate is dropped (a synchronous writer then waits for those
    /// in flight with [`FillGate::wait_drained`]).
    pub fn raise_fill_gate(&self) -> FillGate {
        self.fills.gate.fetch_add(1, Ordering::SeqCst);
        FillGate(self.fills.clone())
    }

    /// Fills (and whole-cluster installs) in flight.
    #[cfg(test)]
    pub(crate) fn fill_count(&self) -> u64 {
        self.fills.in_flight.load(Ordering::SeqCst)
    }

    /// Is any fill (or whole-cluster install) in flight?
    pub fn fills_in_flight(&self) -> bool {
        self.fills.in_flight.load(Ordering::SeqCst) > 0
    }

    /// Hold [start, end) of the file shared for an in-place write into clusters a fill may
    /// still be writing (its L2 entries are visible before its write lands): None while a
    /// fill of that range is in flight (complete this queue's own work, then
    /// [`Self::wait_fill_change`] and try again).
    pub fn try_hold_overwrite(&self, start: u64, end: u64) -> Option<u64> {
        self.fills.ranges.try_acquire(start, end, Holder::Write)
    }

    /// Release a range taken by [`Self::try_hold_overwrite`].
    pub fn release_overwrite(&self, key: u64) {
        self.fills.ranges.release(key);
    }

    /// Wait at most `timeout` for a fill range to be released.
    pub fn wait_fill_change(&self, timeout: Duration) {
        self.fills.ranges.wait_change_for(timeout);
    }

    /// End a fill started by [`Self::plan_fresh_write`] (its write completed or failed).
    pub fn end_fill(&self, key: u64) {
        self.fills.ranges.release(key);
        self.fills.end();
    }

    /// Plan an asynchronous write of [offset, offset + len) into fresh clusters: when every
    /// cluster it touches reads as zeroes without a copy (unallocated with no backing file,
    /// or zero-flagged), allocate that many contiguous clusters at the end of the file, point
    /// the L2 entries at them (in memory) and return where the data goes. The new clusters
    /// are holes, so the parts of them the write does not cover read as zeroes, as before,
    /// and a crash before the data lands leaves what was there. None: some cluster needs a
    /// copy-on-write or is already allocated (use [`Self::owned_extent`] or [`Self::write`]).
    /// Two queues writing the same cluster never allocate it twice: the second finds it
    /// allocated.
    pub fn plan_fresh_write(
        &self,
        file: &dyn Storage,
        offset: u64,
        len: u64,
        has_backing: bool,
    ) -> Result<Option<FreshWrite>, ImageError> {
        if self.write.is_none() || len == 0 {
            return Ok(None);
        }
        let mut ws = self.lock_write()?;
        let c = self.cluster_size();
        let first_cl = offset & !(c - 1);
        let n = ((offset + len - 1) & !(c - 1)).saturating_sub(first_cl) / c + 1;
        if self.cow_busy(first_cl, n) {
            // Being copied on write elsewhere: the synchronous path waits for it.
            return Ok(None);
        }
        // A write of whole clusters does not care what they held: it may reuse free space.
        // Anything else gets holes at the end of the file.
        let whole = offset == first_cl && len == n * c;
        // An encrypted image's new clusters are written whole (encrypted zeroes around the
        // data: a hole would decrypt to noise), by a fill, which a raised gate forbids.
        if self.encrypted() && !whole && (has_backing || self.fills.gate_raised()) {
            return Ok(None);
        }
        let mut olds = Vec::with_capacity(n as usize);
        // Whole clusters over the backing file: allocated now, installed on completion.
        let mut defer = false;
        for k in 0..n {
            let e = self.l2_entry(file, first_cl + k * c)?;
            let zero_flag = self.version >= 3 && e & L2_ZERO != 0;
            let unallocated = e & L2_OFFSET_MASK == 0 && !zero_flag;
            if e & L2_COMPRESSED != 0 {
                return Ok(None);
            }
            if unallocated && has_backing {
                if !whole || self.fills.gate_raised() {
                    return Ok(None);
                }
                defer = true;
            } else if !(zero_flag || unallocated) {
                return Ok(None);
            }
            olds.push(e);
        }
        let reused = if whole {
            self.find_free_run(&mut ws, file, n)?
        } else {
            None
        };
        let first = match reused {
            Some(h) => {
                self.stats.reused_clusters.fetch_add(1, Ordering::Relaxed);
                h
            }
            None => {
                let first = ws.next_free;
                ws.next_free += n * c;
                self.file_size.fetch_max(ws.next_free, Ordering::AcqRel);
                self.reserve(&mut ws, file, first, n)?;
                self.grow(&mut ws, file, first, first + n * c, false);
                first
            }
        };
        // A partial write into new clusters may write them whole (zeroes around the data),
        // so that later writes into them are plain overwrites for the file system. Its range
        // is held exclusively before the L2 entries make the clusters visible.
        // A write that starts at a cluster's start is how a sequential stream enters it: the
        // stream's next writes fill the rest, and a fill would only make them wait.
        let mut fill = None;
        if reused.is_none() && !whole && (offset != first_cl || self.encrypted()) {
            self.fills.start();
            let (start, end) = (first, first + n * c);
            let key = if self.fills.gate_raised() {
                None
            } else {
                self.fills.ranges.try_acquire(start, end, Holder::Rmw)
            };
            match key {
                Some(key) => {
                    fill = Some(Fill {
                        key,
                        start,
                        len: end - start,
                    })
                }
                None => self.fills.end(),
            }
        }
        if self.encrypted() && !whole && fill.is_none() {
            // Never reached (nobody holds a range of clusters just allocated): refused
            // rather than leaving a hole that decrypts to noise.
            return Err(ImageError::Corrupt(
                "new encrypted clusters without their fill",
            ));
        }
        if defer {
            // Counted as a fill so that synchronous writers drain it first; writers of these
            // guest clusters wait for the install.
            let mut busy = self.cow.lock();
            for k in 0..n {
                busy.insert(first_cl + k * c);
            }
            drop(busy);
            self.fills.start();
            return Ok(Some(FreshWrite {
                host: first,
                fill: None,
                install: Some(CowInstall {
                    guest: first_cl,
                    clusters: n,
                    host: first,
                    sub: None,
                }),
            }));
        }
        for (k, e) in olds.into_iter().enumerate() {
            let cl = first_cl + k as u64 * c;
            let l2 = self.ensure_l2(&mut ws, file, cl)?;
            let entry = (first + k as u64 * c) | L2_COPIED;
            self.write_l2_entry(&mut ws, file, l2, self.l2_index(cl), entry)?;
            self.release_old(&mut ws, e);
        }
        self.maybe_write_back(&mut ws, file)?;
        Ok(Some(FreshWrite {
            host: first + (offset - first_cl),
            fill,
            install: None,
        }))
    }

    /// The write of a [`CowInstall`] completed (`ok`) or failed: install its L2 entries (what
    /// the entries held by now is released once they are durable), or give the clusters
    /// back; then let waiting writers of those guest clusters go on.
    pub fn finish_cow(
        &self,
        file: &dyn Storage,
        install: CowInstall,
        ok: bool,
    ) -> Result<(), ImageError> {
        let c = self.cluster_size();
        let mut ws = self.lock_write()?;
        let r = (|| -> Result<(), ImageError> {
            if let Some(sub) = install.sub {
                return self.install_subclusters(&mut ws, file, install, sub, ok);
            }
            for k in 0..install.clusters {
                let (cl, host) = (install.guest + k * c, install.host + k * c);
                if !ok {
                    // Never referenced: safe to write back at any time.
                    self.set_refcount(&mut ws, file, host, RefChange::Dec)?;
                    continue;
                }
                let cur = self.l2_entry(file, cl)?;
                let l2 = self.ensure_l2(&mut ws, file, cl)?;
                self.write_l2_entry(&mut ws, file, l2, self.l2_index(cl), host | L2_COPIED)?;
                self.release_old(&mut ws, cur);
            }
            Ok(())
        })();
        self.cow.finish(install.guest, install.clusters, c);
        if install.sub.is_none() {
            self.fills.end();
        }
        r?;
        self.maybe_write_back(&mut ws, file)
    }

    /// The new contents of the cluster at guest `cl_start` in `buf`: its old contents (when
    /// `src` does not cover it) with `src` at `in_cl`; whether the old bytes around `src`
    /// were all zero.
    pub(super) fn merge_cluster(
        buf: &mut [u8],
        cl_start: u64,
        in_cl: usize,
        src: &[u8],
        fill_old: &mut FillOld<'_>,
    ) -> Result<bool, ImageError> {
        let n = src.len();
        let old_is_zero = if n < buf.len() {
            fill_old(cl_start, buf)?;
            crate::zero::is_zero(&buf[..in_cl]) && crate::zero::is_zero(&buf[in_cl + n..])
        } else {
            true
        };
        buf[in_cl..in_cl + n].copy_from_slice(src);
        Ok(old_is_zero)
    }

    /// The allocation lock, once guest cluster `cl` is not being written without it (a
    /// copy-on-write or a subcluster write in flight: its entry must go in first).
    pub(super) fn lock_write_idle(
        &self,
        cl: u64,
    ) -> Result<std::sync::MutexGuard<'_, WriteState>, ImageError> {
        loop {
            let guard = self.lock_write()?;
            let busy = self.cow.lock();
            if !busy.contains(&cl) {
                return Ok(guard);
            }
            drop(guard);
            self.cow.wait(busy);
        }
    }

    /// Is any of the `n` guest clusters from `first` being copied on write? (Called with the
    /// allocation lock held.)
    pub(super) fn cow_busy(&self, first: u64, n: u64) -> bool {
        let c = self.cluster_size();
        let busy = self.cow.lock();
        !busy.is_empty() && (0..n).any(|k| busy.contains(&(first + k * c)))
    }

    /// A write inside one guest cluster that has no data cluster of its own (unallocated:
    /// its old contents come from the backing file or are zeroes; or a zero cluster): the new
    /// cluster is allocated under the allocation lock, the old contents are read and the
    /// cluster written without it (so writers on other threads overlap their I/O), and the
    /// L2 entry is installed under the lock once the data is in the file. Writers to the same
    /// guest cluster wait meanwhile; readers see the old contents until the entry changes.
    /// Ok(false): not such a write (the caller takes the locked path).
    pub(super) fn write_cow_unlocked(
        &self,
        file: &dyn Storage,
        offset: u64,
        data: &[u8],
        fill_old: &mut FillOld<'_>,
    ) -> Result<bool, ImageError> {
        let c = self.cluster_size();
        let cl_start = offset & !(c - 1);
        let in_cl = (offset - cl_start) as usize;
        let n = data.len();
        let (new, reused) = {
            let mut ws = self.lock_write_idle(cl_start)?;
            let e = self.l2_entry(file, cl_start)?;
            if e & L2_OFFSET_MASK != 0 || e & L2_COMPRESSED != 0 {
                return Ok(false);
            }
            let got = self.alloc_data_cluster(&mut ws, file)?;
            self.cow.lock().insert(cl_start);
            got
        };
        // The I/O, without the allocation lock.
        // Ok(true): the data written is durable.
        let io = (|| -> Result<bool, ImageError> {
            let mut cluster = AlignedBuf::new(c as usize, 4096).map_err(ImageError::Io)?;
            let buf = cluster.as_mut_slice();
            let old_is_zero = Self::merge_cluster(buf, cl_start, in_cl, data, fill_old)?;
            if old_is_zero && n < c as usize && !reused && !self.encrypted() {
                // A fresh cluster past every earlier allocation is a hole: only the data,
                // after allocating the cluster's blocks (reading as zeroes) in one go, so
                // the write is not a hole-filling one that the file system serialises (like
                // QEMU's zero copy-on-write); best effort.
                let _ = file.allocate(new, c);
                self.put_data(file, new + in_cl as u64, data)?;
                Ok(false)
            } else {
                self.put_data(file, new, buf)?;
                if old_is_zero {
                    return Ok(false);
                }
                // The cluster keeps old contents (the backing file's): they must be durable
                // before its L2 entry is. Synced here, on this pool thread and without any
                // lock, so the queue thread's publish need not wait for a sync (several pool
                // threads' syncs run at once, and the block layer merges their flushes).
                self.data_sync
                    .sync(|| file.sync_data())
                    .map_err(ImageError::Io)?;
                Ok(true)
            }
        })();
        self.install_unlocked_write(file, cl_start, Some(new), io, |ws, durable| {
            let cur = self.l2_entry(file, cl_start)?;
            let l2 = self.ensure_l2(ws, file, cl_start)?;
            let others_unsynced = ws.unsynced_data;
            self.write_l2_entry(ws, file, l2, self.l2_index(cl_start), new | L2_COPIED)?;
            if durable {
                // This entry's data is durable already; other entries' need is unchanged.
                ws.unsynced_data = others_unsynced;
            }
            // Whatever the entry held by now (a concurrent zeroing may have changed it) is
            // released once the new entry is durable.
            self.release_old(ws, cur);
            Ok(())
        })?;
        self.stats.cow_unlocked.fetch_add(1, Ordering::Relaxed);
        Ok(true)
    }

    /// The end of a write into guest cluster `cl_start` done without the allocation lock
    /// (`io`: its result, true if its data is durable): under the lock, `install` its
    /// entry; if that (or the I/O) failed, give back the host cluster allocated for it
    /// (`new`: never referenced, so safe to write back at any time); the cluster leaves
    /// the busy set whatever happened.
    pub(super) fn install_unlocked_write(
        &self,
        file: &dyn Storage,
        cl_start: u64,
        new: Option<u64>,
        io: Result<bool, ImageError>,
        install: impl FnOnce(&mut WriteState, bool) -> Result<(), ImageError>,
    ) -> Result<(), ImageError> {
        let mut ws = self.lock_write()?;
        let installed = io.and_then(|durable| install(&mut ws, durable));
        if let (Err(_), Some(new)) = (&installed, new) {
            let _ = self.set_refcount(&mut ws, file, new, RefChange::Dec);
        }
        self.cow.finish(cl_start, 1, self.cluster_size());
        installed?;
        self.maybe_write_back(&mut ws, file)
    }
}
