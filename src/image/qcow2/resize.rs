//! Growing a qcow2 image online: the header's size, and the L1 table where the new size
//! needs more entries, crash-safe at every step (a crash leaves the old size, or the new one
//! with everything it needs, never a header naming an L1 table too small for its size).

use std::sync::atomic::Ordering;

use super::header::off;
use super::{ImageError, Qcow2Image, MAX_L1_BYTES};
use crate::io::aligned::{write_all_aligned, write_unaligned};
use crate::io::bounce::AlignedBuf;
use crate::io::Storage;
use crate::locks::{Locked, RwLocked};

impl Qcow2Image {
    /// Grow the guest-visible size to `new` bytes (larger than now; the caller checks).
    ///
    /// The allocation lock is held throughout, so no L2 table is installed meanwhile. Where
    /// the L1 table's clusters have room for the entries the new size needs, those entries
    /// are zeroed there; else a new L1 table is allocated at the end of the file, the old
    /// entries copied into it, and its refcounts written. Each of these is synced, then one
    /// write of the header's size, L1 size and L1 offset (all in its first sector: the new
    /// size never appears without the L1 table that covers it) is synced, then the table,
    /// its place and the size change in memory, and the old table's clusters are released
    /// (after the next sync, as every release is). A crash before the header write leaks the
    /// new table's clusters at most.
    pub fn resize(&self, file: &dyn Storage, new: u64) -> Result<(), ImageError> {
        let mut st = self.stored.locked();
        let mut ws = self.lock_write()?;
        let (bitmaps, inconsistent) = Self::stored_bitmaps(&st);
        if inconsistent {
            return Err(ImageError::Unsupported(
                "the image has inconsistent persistent bitmaps: remove them first \
                 (vublk ctl bitmap-remove)"
                    .into(),
            ));
        }
        let per_l1 = 1u64 << (self.cluster_bits + self.l2_bits);
        let needed = new.div_ceil(per_l1);
        if needed * 8 > MAX_L1_BYTES {
            return Err(ImageError::Unsupported(format!(
                "{new} bytes need an L1 table of {} MiB, more than {} MiB",
                (needed * 8) >> 20,
                MAX_L1_BYTES >> 20
            )));
        }
        let cluster = self.cluster_size();
        let old: Vec<u64> = self.l1.read_locked().clone();
        let old_len = old.len() as u64;
        let old_clusters = (old_len * 8).div_ceil(cluster).max(1);
        let room = old_clusters * cluster / 8;
        let chunk = self.meta_chunk();
        let old_offset = self.l1_offset.load(Ordering::Acquire);
        let l1_size = needed.max(old_len);
        let offset = if l1_size <= room {
            if l1_size > old_len {
                let zeros = vec![0u8; ((l1_size - old_len) * 8) as usize];
                write_unaligned(file, old_offset + old_len * 8, &zeros, chunk)
                    .map_err(ImageError::Io)?;
                file.sync_data().map_err(ImageError::Io)?;
            }
            old_offset
        } else {
            let clusters = (l1_size * 8).div_ceil(cluster);
            let at = self.alloc_zeroed_cluster(&mut ws, file)?;
            self.note_metadata(at);
            for i in 1..clusters {
                let c = self.alloc_zeroed_cluster(&mut ws, file)?;
                if c != at + i * cluster {
                    return Err(ImageError::Corrupt("new L1 clusters not contiguous"));
                }
                self.note_metadata(c);
            }
            let mut buf =
                AlignedBuf::new((clusters * cluster) as usize, 4096).map_err(ImageError::Io)?;
            for (i, e) in old.iter().enumerate() {
                buf.as_mut_slice()[i * 8..i * 8 + 8].copy_from_slice(&e.to_be_bytes());
            }
            write_all_aligned(file, at, buf.as_slice()).map_err(ImageError::Io)?;
            // The new table's refcounts (and the file's length) in the file, then durable.
            self.write_back(&mut ws, file)?;
            file.sync_data().map_err(ImageError::Io)?;
            at
        };
        // size (24..32), crypt method (32..36: 0, encrypted images are not served), L1 size
        // (36..40), L1 offset (40..48): one write inside the first sector.
        let mut fields = [0u8; 24];
        fields[..8].copy_from_slice(&new.to_be_bytes());
        let l1s = off::L1_SIZE - off::SIZE;
        fields[l1s..l1s + 4].copy_from_slice(&(l1_size as u32).to_be_bytes());
        let l1o = off::L1_TABLE_OFFSET - off::SIZE;
        fields[l1o..l1o + 8].copy_from_slice(&offset.to_be_bytes());
        if bitmaps {
            // The bitmaps' tables sized for the new disk, switched to in the same header
            // write as the size (a header naming tables of the wrong size is refused).
            let list = st.persistent();
            let patch = |h: &mut Vec<u8>| {
                h[off::SIZE..off::SIZE + fields.len()].copy_from_slice(&fields);
            };
            self.save_locked(&mut st, &mut ws, file, &list, new, &patch)?;
        } else {
            write_unaligned(file, off::SIZE as u64, &fields, chunk).map_err(ImageError::Io)?;
            file.sync_data().map_err(ImageError::Io)?;
        }
        {
            let mut l1 = self.l1.write_locked();
            l1.resize(l1_size as usize, 0);
            self.l1_offset.store(offset, Ordering::Release);
        }
        self.size.store(new, Ordering::Release);
        if offset != old_offset {
            for i in 0..old_clusters {
                ws.pending_decs.push(old_offset + i * cluster);
            }
        }
        Ok(())
    }
}
