//! Growing a qcow2 image online: the header's size, and the L1 table where the new size
//! needs more entries, crash-safe at every step (a crash leaves the old size, or the new one
//! with everything it needs, never a header naming an L1 table too small for its size).

use std::sync::atomic::Ordering;

use super::header::off;
use super::{ImageError, Qcow2Image};
use crate::io::aligned::write_unaligned;
use crate::io::Storage;

impl Qcow2Image {
    /// Grow the guest-visible size to `new` bytes (larger than now; the caller checks).
    ///
    /// Steps, each made durable before the next: the L1 entries the new size adds are
    /// zeroed in the clusters the L1 table already occupies; then one write of the header's
    /// size and L1 size (both in its first sector: the new size never appears without the
    /// L1 size that covers it); then the table and size in memory. The allocation lock is
    /// held throughout, so no L2 table is installed meanwhile. A new size whose L1 table would
    /// not fit in the table's clusters is refused (moving the L1 table is not done online).
    pub fn resize(&self, file: &dyn Storage, new: u64) -> Result<(), ImageError> {
        let _ws = self.lock_write()?;
        let per_l1 = 1u64 << (self.cluster_bits + self.l2_bits);
        let needed = new.div_ceil(per_l1);
        let cluster = self.cluster_size();
        let old_len = self.l1.read().unwrap_or_else(|e| e.into_inner()).len() as u64;
        let room = (old_len * 8).div_ceil(cluster).max(1) * cluster / 8;
        if needed > room {
            return Err(ImageError::Unsupported(format!(
                "{new} bytes need an L1 table of {needed} entries; the image's holds {room} \
                 (a larger one would have to move: grow it offline with qemu-img resize)"
            )));
        }
        let chunk = self.meta_chunk();
        if needed > old_len {
            let zeros = vec![0u8; ((needed - old_len) * 8) as usize];
            write_unaligned(file, self.l1_offset + old_len * 8, &zeros, chunk)
                .map_err(ImageError::Io)?;
            file.sync_data().map_err(ImageError::Io)?;
        }
        let l1_size = needed.max(old_len) as u32;
        // size (24..32), crypt method (32..36, kept: 0), L1 size (36..40): one sector.
        let mut fields = [0u8; 16];
        fields[..8].copy_from_slice(&new.to_be_bytes());
        fields[off::L1_SIZE - off::SIZE..off::L1_SIZE - off::SIZE + 4]
            .copy_from_slice(&l1_size.to_be_bytes());
        write_unaligned(file, off::SIZE as u64, &fields, chunk).map_err(ImageError::Io)?;
        file.sync_data().map_err(ImageError::Io)?;
        self.l1
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .resize(l1_size as usize, 0);
        self.size.store(new, Ordering::Release);
        Ok(())
    }
}
