//! Guest-to-host mapping: L1 and L2 entries (their bits and the compressed-cluster
//! descriptor), the mapping of a guest range to extents, and the L2 tables the active image
//! gets when it first writes under an empty L1 entry or one shared with a snapshot.

use super::{ImageError, Qcow2Image, WriteState};
use crate::io::aligned::{write_all_aligned, write_unaligned};
use crate::io::Storage;
use crate::locks::RwLocked;

/// L1 entry: offset of the L2 table.
pub(super) const L1_OFFSET_MASK: u64 = 0x00ff_ffff_ffff_fe00;
/// L2 entry: a compressed cluster descriptor.
pub(super) const L2_COMPRESSED: u64 = 1 << 62;
/// L2 entry (v3): the cluster reads as zeroes.
pub(super) const L2_ZERO: u64 = 1;
/// "Copied" (L1 and L2 entries): the refcount is exactly 1, so the table or cluster may be
/// written in place.
pub(super) const L2_COPIED: u64 = 1 << 63;
/// L2 entry: offset of a standard data cluster.
pub(super) const L2_OFFSET_MASK: u64 = 0x00ff_ffff_ffff_fe00;
/// Extended L2 entries: a cluster has 32 subclusters; this mask covers the bitmap's
/// allocation bits (0-31; the zero bits are the same shifted by 32).
pub(super) const SUB_ALL: u64 = 0xffff_ffff;
/// Subclusters per cluster with extended L2 entries.
pub(super) const SUBCLUSTERS: u64 = 32;

/// The bits of subclusters `first..first + n` (of 32) in one half of a bitmap.
pub(super) fn sub_mask(first: u64, n: u64) -> u64 {
    if n == 0 {
        return 0;
    }
    (SUB_ALL >> (SUBCLUSTERS - n)) << first
}

/// A compressed cluster descriptor's host offset and its 512-byte sectors: x = 62 -
/// (cluster_bits - 8) offset bits, then the number of additional sectors.
pub(super) fn compressed_span(entry: u64, cluster_bits: u32) -> (u64, u64) {
    let x = 62 - (cluster_bits - 8);
    let host = entry & ((1u64 << x) - 1);
    let sectors = ((entry & !L2_COMPRESSED) >> x) + 1;
    (host, sectors)
}

/// The L2 entry of a compressed chunk of `len` bytes at `host`.
pub(super) fn compressed_entry(host: u64, len: u64, cluster_bits: u32) -> u64 {
    let x = 62 - (cluster_bits - 8);
    let extra = ((host + len - 1) >> 9) - (host >> 9);
    L2_COMPRESSED | (extra << x) | host
}

/// What a run of guest bytes maps to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Extent {
    /// `len` bytes at `host_offset` in the image file.
    Data { host_offset: u64, len: u64 },
    /// Reads as zeroes (zero flag).
    Zero { len: u64 },
    /// Not allocated here: reads fall through to the backing file, or zeroes without one.
    Unallocated { len: u64 },
    /// Part of a compressed cluster: `skip` bytes into the decompressed cluster.
    Compressed {
        host_offset: u64,
        compressed_len: u64,
        skip: u64,
        len: u64,
    },
}

impl Extent {
    pub fn len(&self) -> u64 {
        match *self {
            Extent::Data { len, .. }
            | Extent::Zero { len }
            | Extent::Unallocated { len }
            | Extent::Compressed { len, .. } => len,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Append `ext` to `out`, merging it into the last extent where they continue each other.
fn push_extent(out: &mut Vec<Extent>, ext: Extent) {
    match (out.last_mut(), ext) {
        (
            Some(Extent::Data { host_offset, len }),
            Extent::Data {
                host_offset: h,
                len: l,
            },
        ) if *host_offset + *len == h => *len += l,
        (Some(Extent::Zero { len }), Extent::Zero { len: l }) => *len += l,
        (Some(Extent::Unallocated { len }), Extent::Unallocated { len: l }) => *len += l,
        _ => out.push(ext),
    }
}

impl Qcow2Image {
    /// Index of `guest_offset`'s cluster in its L2 table.
    pub(super) fn l2_index(&self, guest_offset: u64) -> usize {
        ((guest_offset >> self.cluster_bits) & ((1 << self.l2_bits) - 1)) as usize
    }

    /// The (validated) L2 table offset for `guest_offset`; None when the L1 entry is empty.
    pub(super) fn l2_table_offset(&self, guest_offset: u64) -> Result<Option<u64>, ImageError> {
        let l1_index = (guest_offset >> (self.cluster_bits + self.l2_bits)) as usize;
        let Some(l1e) = self.l1.read_locked().get(l1_index).copied() else {
            return Err(ImageError::Corrupt("guest offset beyond the L1 table"));
        };
        let l2_offset = l1e & L1_OFFSET_MASK;
        if l2_offset == 0 {
            return Ok(None);
        }
        let cluster = self.cluster_size();
        if !l2_offset.is_multiple_of(cluster) || l2_offset + cluster > self.file_len() {
            return Err(ImageError::Corrupt(
                "L2 table offset unaligned or outside the file",
            ));
        }
        Ok(Some(l2_offset))
    }

    /// Map [offset, offset + len) of the guest disk to extents, in order, merging
    /// contiguous data. The caller checked the range is inside the image.
    pub fn map(
        &self,
        file: &dyn Storage,
        offset: u64,
        len: u64,
        out: &mut Vec<Extent>,
    ) -> Result<(), ImageError> {
        out.clear();
        let cluster = self.cluster_size();
        let mut pos = offset;
        let end = offset + len;
        while pos < end {
            let in_cluster = pos & (cluster - 1);
            let n = (cluster - in_cluster).min(end - pos);
            let (e, bitmap) = self.l2_raw(file, pos)?;
            if e & L2_COMPRESSED != 0 {
                let (host_offset, sectors) = compressed_span(e, self.cluster_bits);
                let compressed_len = (sectors * 512).saturating_sub(host_offset & 511);
                let file_size = self.file_len();
                if host_offset >= file_size {
                    return Err(ImageError::Corrupt("compressed cluster outside the file"));
                }
                push_extent(
                    out,
                    Extent::Compressed {
                        host_offset,
                        compressed_len: compressed_len.min(file_size - host_offset),
                        skip: in_cluster,
                        len: n,
                    },
                );
            } else if self.extended_l2 {
                self.map_subclusters(e, bitmap, in_cluster, n, out)?;
            } else {
                let host = e & L2_OFFSET_MASK;
                let ext = if e & L2_ZERO != 0 && self.version >= 3 {
                    Extent::Zero { len: n }
                } else if host == 0 {
                    Extent::Unallocated { len: n }
                } else {
                    self.check_data_cluster(host)?;
                    Extent::Data {
                        host_offset: host + in_cluster,
                        len: n,
                    }
                };
                push_extent(out, ext);
            }
            pos += n;
        }
        Ok(())
    }

    /// A data cluster's host offset must be aligned and inside the file.
    fn check_data_cluster(&self, host: u64) -> Result<(), ImageError> {
        let cluster = self.cluster_size();
        if !host.is_multiple_of(cluster)
            || host + cluster > self.file_len().next_multiple_of(cluster)
        {
            return Err(ImageError::Corrupt(
                "data cluster unaligned or outside the file",
            ));
        }
        Ok(())
    }

    /// [in_cluster, in_cluster + n) of a cluster with extended L2 entry (`e`, `bitmap`): a
    /// subcluster is data at its place in the host cluster when allocated, zeroes when its
    /// zero bit is set, else unallocated (the backing file shows through).
    fn map_subclusters(
        &self,
        e: u64,
        bitmap: u64,
        in_cluster: u64,
        n: u64,
        out: &mut Vec<Extent>,
    ) -> Result<(), ImageError> {
        let (alloc, zero) = (bitmap & SUB_ALL, bitmap >> 32);
        if alloc & zero != 0 {
            return Err(ImageError::Corrupt(
                "a subcluster both allocated and zero in its L2 bitmap",
            ));
        }
        let host = e & L2_OFFSET_MASK;
        if alloc != 0 {
            if host == 0 {
                return Err(ImageError::Corrupt(
                    "allocated subclusters without a host cluster",
                ));
            }
            self.check_data_cluster(host)?;
        }
        let sub = self.cluster_size() / SUBCLUSTERS;
        let mut at = in_cluster;
        let end = in_cluster + n;
        while at < end {
            let k = at / sub;
            let m = ((k + 1) * sub).min(end) - at;
            let ext = if alloc >> k & 1 != 0 {
                Extent::Data {
                    host_offset: host + at,
                    len: m,
                }
            } else if zero >> k & 1 != 0 {
                Extent::Zero { len: m }
            } else {
                Extent::Unallocated { len: m }
            };
            push_extent(out, ext);
            at += m;
        }
        Ok(())
    }

    /// If [offset, offset + len) lies in clusters this image owns alone (allocated, COPIED,
    /// not compressed, not zero) that are contiguous in the file, their host offset: such a
    /// write can go in place, asynchronously, with no metadata change.
    pub fn owned_extent(
        &self,
        file: &dyn Storage,
        offset: u64,
        len: u64,
    ) -> Result<Option<u64>, ImageError> {
        let c = self.cluster_size();
        let mut pos = offset;
        let end = offset + len;
        let mut start_host = None;
        while pos < end {
            let cl_start = pos & !(c - 1);
            let here = if self.extended_l2 {
                let n = (cl_start + c).min(end) - pos;
                match self.owned_subclusters(file, pos, n)? {
                    Some(h) => h,
                    None => return Ok(None),
                }
            } else {
                let e = self.l2_entry(file, cl_start)?;
                let host = e & L2_OFFSET_MASK;
                if e & L2_COMPRESSED != 0 || e & L2_COPIED == 0 || e & L2_ZERO != 0 || host == 0 {
                    return Ok(None);
                }
                if self.is_metadata(host) {
                    return Err(ImageError::Corrupt("a data cluster overlaps metadata"));
                }
                host + (pos - cl_start)
            };
            match start_host {
                None => start_host = Some(here),
                Some(h) if h + (pos - offset) != here => return Ok(None),
                Some(_) => {}
            }
            pos = cl_start + c;
        }
        Ok(start_host)
    }

    /// The L2 table for `guest_offset`, allocating an empty one if the L1 entry is empty.
    pub(super) fn ensure_l2(
        &self,
        ws: &mut WriteState,
        file: &dyn Storage,
        guest_offset: u64,
    ) -> Result<u64, ImageError> {
        let l1_index = (guest_offset >> (self.cluster_bits + self.l2_bits)) as usize;
        let l1e = self
            .l1
            .read_locked()
            .get(l1_index)
            .copied()
            .ok_or(ImageError::Corrupt("guest offset beyond the L1 table"))?;
        let l2 = l1e & L1_OFFSET_MASK;
        if l2 != 0 {
            if l1e & L2_COPIED == 0 {
                return self.copy_shared_l2(ws, file, l1_index, l2);
            }
            return Ok(l2);
        }
        let new = self.alloc_zeroed_cluster(ws, file)?;
        self.note_metadata(new);
        let words = (self.cluster_size() / 8) as usize;
        self.install_l2(ws, file, l1_index, new, vec![0u64; words])?;
        Ok(new)
    }

    /// An L2 table shared with a snapshot (its L1 entry is not COPIED): give the active image
    /// its own copy (COPIED flags cleared: its clusters are shared), move the L1 entry to the
    /// copy, and drop the active image's reference to the shared table.
    pub(super) fn copy_shared_l2(
        &self,
        ws: &mut WriteState,
        file: &dyn Storage,
        l1_index: usize,
        old_l2: u64,
    ) -> Result<u64, ImageError> {
        let c = self.cluster_size();
        // The cached copy may hold entries not written back yet.
        let cached = {
            let cache = self.lock_l2();
            cache
                .tables
                .iter()
                .find(|t| t.offset == old_l2)
                .map(|t| t.entries.clone())
        };
        let mut entries = match cached {
            Some(e) => e,
            None => self.read_l2(file, old_l2)?,
        };
        // Snapshot creation already counted the snapshot's references to these clusters
        // (refcounts count references per L1 table, not per L2 copy): nothing to add, but no
        // cluster is owned alone any more.
        for e in entries.iter_mut().step_by(self.l2_stride()) {
            if *e & L2_COMPRESSED == 0 {
                *e &= !L2_COPIED;
            }
        }
        let new = self.alloc_cluster(ws, file)?;
        self.note_metadata(new);
        let mut bytes = vec![0u8; c as usize];
        for (i, e) in entries.iter().enumerate() {
            bytes[i * 8..i * 8 + 8].copy_from_slice(&e.to_be_bytes());
        }
        write_all_aligned(file, new, &bytes).map_err(ImageError::Io)?;
        self.install_l2(ws, file, l1_index, new, entries)?;
        ws.pending_decs.push(old_l2);
        Ok(new)
    }

    /// Make the L2 table just written at `new` (with `entries`) the active one for
    /// `l1_index`: its refcount reaches the file first, then it is cached and the L1 entry
    /// points at it (on disk, then in memory).
    pub(super) fn install_l2(
        &self,
        ws: &mut WriteState,
        file: &dyn Storage,
        l1_index: usize,
        new: u64,
        entries: Vec<u64>,
    ) -> Result<(), ImageError> {
        self.write_dirty_refcounts(ws, file)?;
        file.sync_data().map_err(ImageError::Io)?;
        loop {
            let mut cache = self.lock_l2();
            if cache.make_room() {
                cache.tables.push_back(self.new_table(new, entries));
                break;
            }
            drop(cache);
            self.write_back(ws, file)?;
        }
        let entry = new | L2_COPIED;
        write_unaligned(
            file,
            self.l1_offset.load(std::sync::atomic::Ordering::Acquire) + l1_index as u64 * 8,
            &entry.to_be_bytes(),
            self.meta_chunk(),
        )
        .map_err(ImageError::Io)?;
        if let Some(e) = self.l1.write_locked().get_mut(l1_index) {
            *e = entry;
        }
        Ok(())
    }
}
