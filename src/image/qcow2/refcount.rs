//! Refcounts: blocks of 1- to 64-bit counters per host cluster, found through the refcount
//! table; changed in a cache of block chunks and written back (`writeback`), with new blocks
//! and a grown table made durable before anything names them.

use super::header::set_refcount_table;
use super::{ImageError, Qcow2Image, WriteState, MAX_REFCOUNT_TABLE_BYTES};
use crate::io::aligned::{read_aligned, write_all_aligned, write_unaligned};
use crate::io::bounce::AlignedBuf;
use crate::io::Storage;
use std::sync::atomic::Ordering;

/// Dirty refcount chunks kept before they are written (each at most 4 KiB).
pub(super) const MAX_DIRTY_REFCOUNT_CHUNKS: usize = 1024;
/// Refcount chunks cached (dirty or clean) before clean ones are dropped.
const MAX_REFCOUNT_CHUNKS: usize = 4096;

/// A change to one cluster's refcount.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum RefChange {
    Set(u64),
    Inc,
    Dec,
}

/// The largest refcount `1 << order` bits hold.
pub(super) fn refcount_max(order: u32) -> u64 {
    let bits = 1u32 << order;
    if bits == 64 {
        u64::MAX
    } else {
        (1u64 << bits) - 1
    }
}

impl Qcow2Image {
    /// Change a cluster's refcount in the refcount cache (any width from 1 to 64 bits),
    /// allocating the refcount block (and growing the table) if needed; the new refcount.
    pub(super) fn set_refcount(
        &self,
        ws: &mut WriteState,
        file: &dyn Storage,
        host: u64,
        change: RefChange,
    ) -> Result<u64, ImageError> {
        let c = self.cluster_size();
        let bits = 1u64 << ws.refcount_order;
        let per_block = c * 8 / bits;
        let idx = host / c;
        let ti = (idx / per_block) as usize;
        if ti >= ws.refcount_table.len() {
            self.grow_refcount_table(ws, file, ti)?;
        }
        let Some(&rb) = ws.refcount_table.get(ti) else {
            return Err(ImageError::Corrupt("refcount table too small"));
        };
        let rb = if rb == 0 {
            self.new_refcount_block(ws, file, ti)?
        } else {
            if rb % c != 0 {
                return Err(ImageError::Corrupt("refcount block offset unaligned"));
            }
            rb
        };
        let chunk_size = self.meta_chunk();
        let per_chunk = chunk_size * 8 / bits;
        let j = idx % per_block;
        let chunk = rb + (j / per_chunk) * chunk_size;
        let i = (j % per_chunk) as usize;
        if !ws.refcount_chunks.contains_key(&chunk) {
            if ws.refcount_chunks.len() >= MAX_REFCOUNT_CHUNKS {
                self.write_dirty_refcounts(ws, file)?;
                ws.refcount_chunks.clear();
            }
            let b = read_aligned(file, chunk, chunk_size as usize).map_err(ImageError::Io)?;
            ws.refcount_chunks.insert(chunk, b);
        }
        let buf = ws
            .refcount_chunks
            .get_mut(&chunk)
            .ok_or(ImageError::Corrupt("refcount chunk vanished"))?;
        let old = refcount_get(buf, i, ws.refcount_order);
        let max = refcount_max(ws.refcount_order);
        let new = match change {
            RefChange::Set(v) if v <= max => v,
            RefChange::Set(_) => return Err(ImageError::Corrupt("refcount overflow")),
            RefChange::Inc if old < max => old + 1,
            RefChange::Inc => return Err(ImageError::Corrupt("refcount overflow")),
            RefChange::Dec => old.saturating_sub(1),
        };
        if new == old {
            // Nothing to write (a cluster reserved ahead being allocated, say).
            return Ok(new);
        }
        refcount_put(buf, i, ws.refcount_order, new);
        ws.dirty_chunks.mark(chunk);
        if ws.dirty_chunks.len() >= MAX_DIRTY_REFCOUNT_CHUNKS {
            self.write_dirty_refcounts(ws, file)?;
        }
        Ok(new)
    }

    /// A cluster's refcount (0 where no refcount block exists).
    pub(super) fn get_refcount(
        &self,
        ws: &mut WriteState,
        file: &dyn Storage,
        host: u64,
    ) -> Result<u64, ImageError> {
        let c = self.cluster_size();
        let bits = 1u64 << ws.refcount_order;
        let per_block = c * 8 / bits;
        let idx = host / c;
        let rb = match ws.refcount_table.get((idx / per_block) as usize) {
            Some(&rb) if rb != 0 => rb,
            _ => return Ok(0),
        };
        let chunk_size = self.meta_chunk();
        let per_chunk = chunk_size * 8 / bits;
        let j = idx % per_block;
        let chunk = rb + (j / per_chunk) * chunk_size;
        let i = (j % per_chunk) as usize;
        if let Some(b) = ws.refcount_chunks.get(&chunk) {
            return Ok(refcount_get(b, i, ws.refcount_order));
        }
        if ws.refcount_chunks.len() >= MAX_REFCOUNT_CHUNKS {
            self.write_dirty_refcounts(ws, file)?;
            ws.refcount_chunks.clear();
        }
        let b = read_aligned(file, chunk, chunk_size as usize).map_err(ImageError::Io)?;
        let v = refcount_get(&b, i, ws.refcount_order);
        ws.refcount_chunks.insert(chunk, b);
        Ok(v)
    }

    /// A new, zeroed refcount block for refcount table entry `ti` at the end of the file. Its
    /// own refcount reaches the file before the table entry that names it.
    pub(super) fn new_refcount_block(
        &self,
        ws: &mut WriteState,
        file: &dyn Storage,
        ti: usize,
    ) -> Result<u64, ImageError> {
        let c = self.cluster_size();
        let block = ws.next_free;
        ws.next_free += c;
        self.note_metadata(block);
        self.file_size.fetch_max(ws.next_free, Ordering::AcqRel);
        if !self.grow(ws, file, block, block + c, true) {
            let zero = AlignedBuf::new(c as usize, 4096).map_err(ImageError::Io)?;
            write_all_aligned(file, block, zero.as_slice()).map_err(ImageError::Io)?;
        }
        // Forget cached chunks of whatever was at this offset before (nothing should be).
        ws.refcount_chunks
            .retain(|&k, _| k < block || k >= block + c);
        ws.dirty_chunks.retain(|&k| k < block || k >= block + c);
        ws.refcount_table[ti] = block;
        self.set_refcount(ws, file, block, RefChange::Set(1))?;
        self.write_dirty_refcounts(ws, file)?;
        file.sync_data().map_err(ImageError::Io)?;
        write_unaligned(
            file,
            ws.refcount_table_offset + ti as u64 * 8,
            &block.to_be_bytes(),
            self.meta_chunk(),
        )
        .map_err(ImageError::Io)?;
        Ok(block)
    }

    /// Move the refcount table to a bigger one at the end of the file (with refcount blocks
    /// for the new clusters where none exist), switch the header to it, then free the old
    /// table. A crash before the header switch leaves only leaked clusters.
    pub(super) fn grow_refcount_table(
        &self,
        ws: &mut WriteState,
        file: &dyn Storage,
        needed: usize,
    ) -> Result<(), ImageError> {
        let c = self.cluster_size();
        let per_block = c * 8 / (1u64 << ws.refcount_order);
        let per_cluster = (c / 8) as usize;
        let new_entries = (ws.refcount_table.len() * 2)
            .max(needed + 1)
            .next_multiple_of(per_cluster);
        if (new_entries * 8) as u64 > MAX_REFCOUNT_TABLE_BYTES {
            return Err(ImageError::Corrupt("refcount table would exceed 8 MiB"));
        }
        let table_clusters = (new_entries / per_cluster) as u64;
        let start = ws.next_free;
        let mut table = ws.refcount_table.clone();
        table.resize(new_entries, 0);
        // New refcount blocks for any part of the new metadata not covered yet, placed after
        // the table (repeat: a new block may itself land in an uncovered range).
        let mut end = start + table_clusters * c;
        let mut new_blocks: Vec<(usize, u64)> = Vec::new();
        loop {
            let first = (start / c / per_block) as usize;
            let last = ((end - 1) / c / per_block) as usize;
            if last >= new_entries {
                return Err(ImageError::Corrupt(
                    "refcount table growth does not converge",
                ));
            }
            let missing: Vec<usize> = (first..=last).filter(|&ti| table[ti] == 0).collect();
            if missing.is_empty() {
                break;
            }
            for ti in missing {
                table[ti] = end;
                new_blocks.push((ti, end));
                end += c;
            }
        }
        ws.next_free = end;
        self.file_size.fetch_max(end, Ordering::AcqRel);
        self.grow(ws, file, start, end, false);
        let mut cl = start;
        while cl < end {
            self.note_metadata(cl);
            cl += c;
        }
        // New blocks carry the refcounts of the new metadata that falls in their range.
        for &(ti, off) in &new_blocks {
            let mut blk = vec![0u8; c as usize];
            let mut cl = start;
            while cl < end {
                if (cl / c / per_block) as usize == ti {
                    let i = ((cl / c) % per_block) as usize;
                    refcount_put(&mut blk, i, ws.refcount_order, 1);
                }
                cl += c;
            }
            write_all_aligned(file, off, &blk).map_err(ImageError::Io)?;
        }
        let old_offset = ws.refcount_table_offset;
        let old_clusters = (ws.refcount_table.len() / per_cluster) as u64;
        ws.refcount_table = table;
        // Metadata clusters in ranges whose blocks already existed.
        let mut cl = start;
        while cl < end {
            let ti = (cl / c / per_block) as usize;
            if !new_blocks.iter().any(|&(t, _)| t == ti) {
                self.set_refcount(ws, file, cl, RefChange::Set(1))?;
            }
            cl += c;
        }
        let mut raw = vec![0u8; (table_clusters * c) as usize];
        for (i, e) in ws.refcount_table.iter().enumerate() {
            raw[i * 8..i * 8 + 8].copy_from_slice(&e.to_be_bytes());
        }
        write_all_aligned(file, start, &raw).map_err(ImageError::Io)?;
        // The new table's own refcounts are in the file before the header names it.
        self.write_dirty_refcounts(ws, file)?;
        file.sync_data().map_err(ImageError::Io)?;
        // Switch the header: offset and clusters sit in one sector.
        let mut hdr = read_aligned(file, 0, self.meta_chunk() as usize).map_err(ImageError::Io)?;
        set_refcount_table(&mut hdr, start, table_clusters as u32);
        write_all_aligned(file, 0, &hdr).map_err(ImageError::Io)?;
        ws.refcount_table_offset = start;
        for i in 0..old_clusters {
            ws.pending_decs.push(old_offset + i * c);
        }
        Ok(())
    }
}

/// Refcount `i` of a refcount block chunk, `1 << order` bits wide (big-endian for 8 bits
/// and more; narrower ones packed from the least significant bit of each byte).
pub(super) fn refcount_get(buf: &[u8], i: usize, order: u32) -> u64 {
    let bits = 1usize << order;
    if bits >= 8 {
        let n = bits / 8;
        buf[i * n..i * n + n]
            .iter()
            .fold(0u64, |acc, &b| (acc << 8) | u64::from(b))
    } else {
        let bit = i * bits;
        u64::from((buf[bit / 8] >> (bit % 8)) & ((1u8 << bits) - 1))
    }
}

pub(super) fn refcount_put(buf: &mut [u8], i: usize, order: u32, v: u64) {
    let bits = 1usize << order;
    if bits >= 8 {
        let n = bits / 8;
        for (k, b) in buf[i * n..i * n + n].iter_mut().enumerate() {
            *b = (v >> (8 * (n - 1 - k))) as u8;
        }
    } else {
        let bit = i * bits;
        let mask = ((1u8 << bits) - 1) << (bit % 8);
        let byte = &mut buf[bit / 8];
        *byte = (*byte & !mask) | (((v as u8) << (bit % 8)) & mask);
    }
}
