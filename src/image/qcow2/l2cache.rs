//! The bounded L2 table cache: tables by file offset, least recently used first out, dirty
//! tables (entries changed in memory) never dropped before they are written back.

use std::collections::VecDeque;

use super::header::be64;
use super::map::{L2_COMPRESSED, L2_COPIED, L2_OFFSET_MASK, L2_ZERO, SUB_ALL};
use super::{ImageError, Qcow2Image, WriteState};
use crate::io::aligned::read_aligned;
use crate::io::bounce::AlignedBuf;
use crate::io::Storage;

/// One cached L2 table.
pub(super) struct L2Table {
    pub(super) offset: u64,
    pub(super) entries: Vec<u64>,
    /// Per metadata chunk: differs from the file.
    pub(super) dirty: Vec<bool>,
    /// Per metadata chunk: changes so far (wrapping), so that a write-back that copied a
    /// chunk marks it clean only if it did not change while being written.
    pub(super) version: Vec<u32>,
}

/// The dirty chunks of the cached L2 tables as they were when copied under the cache lock,
/// written without it ([`Qcow2Image::write_chunk_copies`]): one buffer for all of them, and
/// per chunk its table, index and version.
#[derive(Default)]
pub(super) struct ChunkCopies {
    bytes: Option<AlignedBuf>,
    chunks: Vec<(u64, usize, u32)>,
}

impl ChunkCopies {
    #[cfg(test)]
    pub(super) fn is_empty(&self) -> bool {
        self.chunks.is_empty()
    }
}

impl L2Table {
    fn is_dirty(&self) -> bool {
        self.dirty.iter().any(|&d| d)
    }
}

pub(super) struct L2Cache {
    /// Most recently used at the back. Dirty tables are never evicted without being written.
    pub(super) tables: VecDeque<L2Table>,
    pub(super) capacity: usize,
}

impl L2Cache {
    pub(super) fn dirty_tables(&self) -> usize {
        self.tables.iter().filter(|t| t.is_dirty()).count()
    }

    /// Drop the least recently used clean table if the cache is full; false if every
    /// table is dirty (the caller writes them back first, or does not cache).
    pub(super) fn make_room(&mut self) -> bool {
        if self.tables.len() < self.capacity {
            return true;
        }
        match self.tables.iter().position(|t| !t.is_dirty()) {
            Some(i) => {
                self.tables.remove(i);
                true
            }
            None => false,
        }
    }
}

impl Qcow2Image {
    /// An L2 table from the file. At the normal I/O priority even on a block job's thread
    /// (idle class): tables are loaded under the cache lock, which the guest's requests
    /// take too, and must not wait behind the guest's own I/O (`io::priority`).
    pub(super) fn read_l2(
        &self,
        file: &dyn Storage,
        l2_offset: u64,
    ) -> Result<Vec<u64>, ImageError> {
        let _normal = crate::io::priority::normal();
        let raw =
            read_aligned(file, l2_offset, self.cluster_size() as usize).map_err(ImageError::Io)?;
        Ok(raw.chunks_exact(8).map(|c| be64(c, 0)).collect())
    }

    pub(super) fn new_table(&self, offset: u64, entries: Vec<u64>) -> L2Table {
        let chunks = (self.cluster_size() / self.meta_chunk()) as usize;
        L2Table {
            offset,
            entries,
            dirty: vec![false; chunks],
            version: vec![0; chunks],
        }
    }

    /// Words per L2 entry: 2 with extended L2 entries (descriptor, subcluster bitmap).
    pub(super) fn l2_stride(&self) -> usize {
        1 + usize::from(self.extended_l2)
    }

    /// The L2 entry for the cluster containing `guest_offset` as a plain entry (0 =
    /// unallocated). With extended L2 entries, a cluster whose subclusters agree is shown as
    /// the plain entry that reads the same (all allocated: data; all zero: the zero flag;
    /// none and no host cluster: unallocated), and one whose subclusters differ as a
    /// cluster that every write path copies whole (its host cluster, not COPIED; without
    /// one, unallocated over a backing file, else zero): [`Self::l2_raw`] has the truth.
    pub(super) fn l2_entry(
        &self,
        file: &dyn Storage,
        guest_offset: u64,
    ) -> Result<u64, ImageError> {
        let (d, bitmap) = self.l2_raw(file, guest_offset)?;
        if !self.extended_l2 || d & L2_COMPRESSED != 0 {
            return Ok(d);
        }
        let host = d & L2_OFFSET_MASK;
        let (alloc, zero) = (bitmap & SUB_ALL, bitmap >> 32);
        Ok(match (alloc, zero) {
            (0, 0) if host == 0 => 0,
            (SUB_ALL, 0) if host != 0 => d & !L2_ZERO,
            (0, SUB_ALL) => d | L2_ZERO,
            _ if host != 0 => d & !(L2_COPIED | L2_ZERO),
            _ if self.backing_file.is_some() => 0,
            _ => L2_ZERO,
        })
    }

    /// The L2 entry for the cluster containing `guest_offset` as stored: its descriptor and,
    /// with extended L2 entries, its subcluster bitmap (else 0). From the cache (which holds
    /// entries not yet written back), else from the file.
    pub(super) fn l2_raw(
        &self,
        file: &dyn Storage,
        guest_offset: u64,
    ) -> Result<(u64, u64), ImageError> {
        let stride = self.l2_stride();
        let w = self.l2_index(guest_offset) * stride;
        let Some(l2_offset) = self.l2_table_offset(guest_offset)? else {
            return Ok((0, 0));
        };
        let pair = |e: &[u64]| (e[w], if stride == 2 { e[w + 1] } else { 0 });
        let mut cache = self.lock_l2();
        let hit = cache.tables.iter().position(|t| t.offset == l2_offset);
        if let Some(t) = hit.and_then(|pos| cache.tables.remove(pos)) {
            let e = pair(&t.entries);
            cache.tables.push_back(t);
            // Under the cache lock already: the counter adds no contention of its own.
            self.stats
                .l2_hits
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            return Ok(e);
        }
        self.stats
            .l2_misses
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        // Loaded under the cache lock, so a writer cannot change the table in between.
        let entries = self.read_l2(file, l2_offset)?;
        let e = pair(&entries);
        if cache.make_room() {
            cache.tables.push_back(self.new_table(l2_offset, entries));
        }
        Ok(e)
    }

    /// Change one L2 entry in the cached table (loading it if needed); written back later.
    /// `entry` is a plain entry: with extended L2 entries it stands for all 32 subclusters
    /// (data: all allocated; the zero flag: all zero; else none).
    pub(super) fn write_l2_entry(
        &self,
        ws: &mut WriteState,
        file: &dyn Storage,
        l2: u64,
        index: usize,
        entry: u64,
    ) -> Result<(), ImageError> {
        let pair = if !self.extended_l2 || entry & L2_COMPRESSED != 0 {
            (entry, 0)
        } else if entry & L2_ZERO != 0 {
            (entry & !L2_ZERO, SUB_ALL << 32)
        } else if entry & L2_OFFSET_MASK != 0 {
            (entry, SUB_ALL)
        } else {
            (0, 0)
        };
        self.write_l2_raw(ws, file, l2, index, pair)
    }

    /// Change one L2 entry (descriptor, and with extended L2 entries its bitmap) in the
    /// cached table (loading it if needed); written back later.
    pub(super) fn write_l2_raw(
        &self,
        ws: &mut WriteState,
        file: &dyn Storage,
        l2: u64,
        index: usize,
        (entry, bitmap): (u64, u64),
    ) -> Result<(), ImageError> {
        let per_chunk = (self.meta_chunk() / 8) as usize;
        let stride = self.l2_stride();
        let w = index * stride;
        loop {
            let mut cache = self.lock_l2();
            if let Some(t) = cache.tables.iter_mut().find(|t| t.offset == l2) {
                if w + stride > t.entries.len() {
                    return Err(ImageError::Corrupt("L2 index out of range"));
                }
                let old = std::mem::replace(&mut t.entries[w], entry);
                let old_bitmap = if stride == 2 {
                    std::mem::replace(&mut t.entries[w + 1], bitmap)
                } else {
                    0
                };
                // Both words of an extended entry lie in one chunk (16-byte aligned).
                t.dirty[w / per_chunk] = true;
                let v = &mut t.version[w / per_chunk];
                *v = v.wrapping_add(1);
                self.unpublished.note_change();
                // The guest cluster read something other than zeroes of fresh space before
                // (data, compressed data, the backing file, or a zero flag over a host
                // cluster), or the entry names compressed data: the data written for it
                // (the new cluster's copy of what is kept, the compressed chunk) must be
                // durable before this entry is, or a crash could show what it replaced as
                // lost, or a chunk that does not decompress. In an encrypted image even
                // fresh space does not read as zeroes (it decrypts to noise): the new data
                // must be durable first there too.
                let compressed = entry & L2_COMPRESSED != 0;
                if (old, old_bitmap) != (entry, bitmap)
                    && (old != 0
                        || old_bitmap != 0
                        || compressed
                        || self.backing_file.is_some()
                        || self.crypt_region.is_some())
                {
                    ws.unsynced_data = true;
                }
                return Ok(());
            }
            if !cache.make_room() {
                drop(cache);
                self.write_back(ws, file)?;
                continue;
            }
            let entries = self.read_l2(file, l2)?;
            let t = self.new_table(l2, entries);
            cache.tables.push_back(t);
        }
    }

    /// Copy every dirty chunk of the cached tables (the caller orders their writing after
    /// what they depend on, see `write_back`), so that they can be written without the
    /// cache lock: mapping goes on meanwhile.
    pub(super) fn copy_dirty_tables(&self) -> Result<ChunkCopies, ImageError> {
        let chunk = self.meta_chunk() as usize;
        let per_chunk = chunk / 8;
        let cache = self.lock_l2();
        let chunks: Vec<(u64, usize, u32)> = cache
            .tables
            .iter()
            .flat_map(|t| {
                (0..t.dirty.len())
                    .filter(|&ci| t.dirty[ci])
                    .map(|ci| (t.offset, ci, t.version[ci]))
            })
            .collect();
        if chunks.is_empty() {
            return Ok(ChunkCopies::default());
        }
        let mut bytes = AlignedBuf::new(chunks.len() * chunk, 4096).map_err(ImageError::Io)?;
        let out = bytes.as_mut_slice();
        let mut at = 0;
        for t in cache.tables.iter() {
            for ci in (0..t.dirty.len()).filter(|&ci| t.dirty[ci]) {
                for e in &t.entries[ci * per_chunk..(ci + 1) * per_chunk] {
                    out[at..at + 8].copy_from_slice(&e.to_be_bytes());
                    at += 8;
                }
            }
        }
        Ok(ChunkCopies {
            bytes: Some(bytes),
            chunks,
        })
    }

    /// Write chunks copied by [`Qcow2Image::copy_dirty_tables`]; each is clean afterwards
    /// unless it changed since it was copied. A failed write leaves them all dirty. Dirty
    /// tables are never evicted, so every copied table is still cached here.
    pub(super) fn write_chunk_copies(
        &self,
        file: &dyn Storage,
        copies: ChunkCopies,
    ) -> Result<(), ImageError> {
        let Some(bytes) = &copies.bytes else {
            return Ok(());
        };
        let chunk = self.meta_chunk() as usize;
        let writes: Vec<(&[u8], u64)> = bytes
            .as_slice()
            .chunks_exact(chunk)
            .zip(&copies.chunks)
            .map(|(b, &(table, ci, _))| (b, table + (ci * chunk) as u64))
            .collect();
        // At once: each is a round trip to the disk (O_DIRECT), and this runs before
        // requests complete.
        file.write_all_many(&writes).map_err(ImageError::Io)?;
        let mut cache = self.lock_l2();
        for &(table, ci, version) in &copies.chunks {
            if let Some(t) = cache.tables.iter_mut().find(|t| t.offset == table) {
                if t.version[ci] == version {
                    t.dirty[ci] = false;
                }
            }
        }
        Ok(())
    }
}
