//! Opening a qcow2 image: the header, the L1 table, and for a read-write open the refcount
//! table, the refusal of tables that overlap or lie outside the file (a hostile image could
//! point one table at another), and the trim of a tail a crash left behind.
//!
//! What a header asks for is bounded twice: every table must lie inside the file, and none
//! may be larger than QEMU allows (L1 tables 32 MiB, the refcount table 8 MiB, 65,536
//! snapshots in at most 64 MiB of snapshot table). Tables are read whole only where vublk
//! uses them (the active L1 and the refcount table); snapshots' L1 tables are only placed,
//! one entry each, and the scans at open read a bounded number of L2 tables. So an open
//! costs at most about 130 MB of memory (an image at every limit at once), whatever the
//! header claims.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, RwLock};

use super::header::{self, be64, Header, SnapshotEntry};
use super::map::{compressed_span, L1_OFFSET_MASK, L2_COMPRESSED, L2_OFFSET_MASK};
use super::metadata::MetadataMap;
use super::refcount::RefChange;
use super::{
    compress, cow, l2cache, ImageError, Qcow2Error, Qcow2Image, Qcow2Options, Qcow2Stats,
    WriteState, DEFAULT_L2_CACHE_BYTES, DEFAULT_L2_COVERAGE, MAX_L1_BYTES,
    MAX_REFCOUNT_TABLE_BYTES,
};
use crate::image::prealloc::{Background, Prealloc};
use crate::io::aligned::read_aligned;
use crate::io::Storage;
use crate::locks::{Locked, RwLocked};

/// Most internal snapshots an image may have (QEMU's limit).
const MAX_SNAPSHOTS: u32 = 65536;
/// Most bytes the snapshot table may take: QEMU's limit (1 KiB per snapshot on average, for
/// ids, names and extra data).
const MAX_SNAPSHOT_TABLE_BYTES: u64 = 64 << 20;
/// Tables are read in windows of this size.
const TABLE_WINDOW: u64 = 64 << 10;
/// At a read-write open, a tail past the last refcounted cluster is only cut off after
/// checking that no active L2 entry points into it, which reads every L2 table: not for
/// images with more tables than this (1 TiB of guest data at 64 KiB clusters).
const MAX_TAIL_SCAN_TABLES: usize = 2048;
/// ... and never more than this many bytes of them (64 tables of 2 MiB clusters).
const MAX_TAIL_SCAN_BYTES: u64 = 128 << 20;
/// The tail scan looks at most at this many clusters from the end of the file.
const MAX_TAIL_SCAN_CLUSTERS: u64 = 1 << 20;
/// The header is read as one block of this size (the backing file name lives in it).
const HEADER_READ: usize = 4096;

impl Qcow2Image {
    /// The default L2 cache for an image: [`DEFAULT_L2_CACHE_BYTES`], or enough for
    /// [`DEFAULT_L2_COVERAGE`] when that is more, capped at all of the image's L2 tables
    /// (whose entries are 16 bytes with extended L2 entries, else 8).
    pub fn default_l2_cache_bytes(cluster_bits: u32, size_bytes: u64, extended_l2: bool) -> u64 {
        let entry_bits = 3 + u32::from(extended_l2);
        let coverage = DEFAULT_L2_COVERAGE >> (cluster_bits - entry_bits);
        let whole_image = size_bytes.div_ceil(1 << cluster_bits) << entry_bits;
        DEFAULT_L2_CACHE_BYTES
            .max(coverage)
            .min(whole_image.next_multiple_of(1 << cluster_bits))
    }

    /// Open read-only with the default L2 cache (backing files, tests).
    pub fn open_read_only(file: &dyn Storage) -> Result<Self, Qcow2Error> {
        Self::open(file, Qcow2Options::default())
    }

    /// Open and validate. `file` may be opened O_DIRECT: metadata is read with aligned
    /// buffers.
    pub fn open(file: &dyn Storage, opts: Qcow2Options) -> Result<Self, Qcow2Error> {
        let writable = opts.writable;
        let file_size = file.size().map_err(Qcow2Error::ReadHeader)?;
        let first = read_aligned(file, 0, HEADER_READ).map_err(Qcow2Error::ReadHeader)?;
        let h = Header::parse(&first)?;
        let crypt_region = if h.crypt_method == super::header::CRYPT_LUKS {
            if !opts.encrypted {
                return Err(Qcow2Error::Encrypted);
            }
            let ext = h
                .extension_data(&first, super::header::EXT_CRYPTO)
                .filter(|e| e.len() >= 16)
                .ok_or(Qcow2Error::CryptoHeader)?;
            let (off, len) = (be64(ext, 0), be64(ext, 8));
            let c = 1u64 << h.cluster_bits;
            // QEMU's LUKS1 header with eight slots of 512-bit keys is about 2 MiB.
            if off == 0
                || off % c != 0
                || len == 0
                || len > 16 << 20
                || off.checked_add(len).is_none_or(|end| end > file_size)
            {
                return Err(Qcow2Error::CryptoHeader);
            }
            Some((off, len))
        } else {
            None
        };
        if writable && h.is_corrupt() {
            return Err(Qcow2Error::Corrupt);
        }
        if writable && h.is_dirty() {
            return Err(Qcow2Error::Dirty);
        }
        let backing_file = h.backing_file(&first)?;
        let cluster_bits = h.cluster_bits;
        let cluster_size = 1u64 << cluster_bits;
        let extended_l2 = h.extended_l2();
        let l2_bits = cluster_bits - 3 - u32::from(extended_l2);
        let per_l1 = 1u64 << (cluster_bits + l2_bits);
        let l1_size = u64::from(h.l1_size);
        let l1_offset = h.l1_table_offset;
        if l1_size * 8 > MAX_L1_BYTES || l1_size < h.size_bytes.div_ceil(per_l1) {
            return Err(Qcow2Error::L1Size(l1_size));
        }
        if l1_size > 0
            && (l1_offset % cluster_size != 0
                || l1_offset
                    .checked_add(l1_size * 8)
                    .is_none_or(|end| end > file_size))
        {
            return Err(Qcow2Error::L1Offset(l1_offset));
        }
        let l1 = if l1_size > 0 {
            read_table(file, l1_offset, l1_size * 8)?
        } else {
            Vec::new()
        };
        let rt_offset = h.refcount_table_offset;
        let rt_len = u64::from(h.refcount_table_clusters) * cluster_size;
        let write = if writable {
            if rt_len > MAX_REFCOUNT_TABLE_BYTES {
                return Err(Qcow2Error::Limit("a refcount table larger than 8 MiB"));
            }
            if rt_offset % cluster_size != 0
                || rt_len == 0
                || rt_offset
                    .checked_add(rt_len)
                    .is_none_or(|end| end > file_size)
            {
                return Err(Qcow2Error::RefcountTable);
            }
            Some(WriteState {
                refcount_table: read_table(file, rt_offset, rt_len)?,
                refcount_table_offset: rt_offset,
                refcount_order: h.refcount_order,
                next_free: file_size.next_multiple_of(cluster_size),
                covered: file_size,
                prealloc: None,
                comp_pos: 0,
                free_cursor: 0,
                free_run_hint: u64::MAX,
                refcount_chunks: Default::default(),
                dirty_chunks: Default::default(),
                pending_decs: Default::default(),
                unsynced_refcounts: false,
                unsynced_data: false,
                reserved_end: 0,
            })
        } else {
            None
        };
        let metadata = metadata_clusters(file, &h, &l1, write.as_ref(), file_size)?;
        let loaded = super::bitmap_store::load(file, &h, &first, file_size);
        if let Some(why) = &loaded.problem {
            if writable {
                return Err(Qcow2Error::Bitmaps(why.clone()));
            }
            log::warn!("qcow2: the image's persistent bitmaps are not shown: {why}");
        }
        let bitmaps_known = loaded.problem.is_none();
        let stored = loaded.stored;
        if writable && stored.is_empty() && h.autoclear_features != 0 {
            clear_autoclear(file)?;
        }
        let cache_bytes = opts.l2_cache_bytes.unwrap_or_else(|| {
            Self::default_l2_cache_bytes(cluster_bits, h.size_bytes, extended_l2)
        });
        let capacity = (cache_bytes >> cluster_bits).clamp(4, 1 << 22) as usize;
        let img = Qcow2Image {
            version: h.version,
            cluster_bits,
            l2_bits,
            extended_l2,
            size: AtomicU64::new(h.size_bytes),
            compression: h.compression,
            backing_file,
            l1_offset: AtomicU64::new(l1_offset),
            file_size: AtomicU64::new(file_size),
            l1: RwLock::new(l1),
            metadata: RwLock::new(metadata),
            l2_cache: Mutex::new(l2cache::L2Cache {
                // Filled as tables are read: nothing is reserved up front for a capacity
                // that the header's size chose.
                tables: VecDeque::new(),
                capacity,
            }),
            write: write.map(Mutex::new),
            fills: Default::default(),
            cow: cow::CowClusters::default(),
            compress_writes: opts.compress.is_some() && writable,
            comp: compress::CompCache::new(opts.compress),
            prealloc_bg: Background::default(),
            punch_freed: opts.punch_freed,
            unpublished: Default::default(),
            write_back_io: Mutex::new(()),
            data_sync: Default::default(),
            stats: Qcow2Stats::default(),
            stored: Mutex::new(stored),
            crypt_region,
            crypt: std::sync::OnceLock::new(),
        };
        for host in img.stored.locked().clusters(cluster_size) {
            img.note_metadata(host);
        }
        // The LUKS header's clusters are metadata: no data cluster may overlap them.
        if let Some((off, len)) = crypt_region {
            for host in (off..off + len).step_by(cluster_size as usize) {
                img.note_metadata(host);
            }
        }
        // A crash leaves the clusters reserved ahead (`alloc::reserve`) with refcount 1 and
        // nothing referencing them: given back below, unless something other than the
        // active L2 tables may reference clusters (internal snapshots, bitmaps).
        // The bitmaps' clusters are known (and marked as metadata) when their directory
        // was read.
        let reclaim = h.nb_snapshots == 0
            && (!h.has_extension(&first, super::header::EXT_BITMAPS) || bitmaps_known);
        img.find_data_end(file, reclaim)?;
        let rewrite = {
            let st = img.stored.locked();
            !st.is_empty()
                && (!st.fully_allocated() || h.autoclear_features != header::AUTOCLEAR_BITMAPS)
        };
        if writable && rewrite {
            // Every bitmap kept by this process gets all its data clusters (the data path
            // then only writes into them), and the autoclear bit stays set.
            let list = img.persistent_bitmaps();
            img.save_bitmaps(file, &list)
                .map_err(Qcow2Error::SaveBitmaps)?;
        }
        if let (Some(p), Ok(mut ws)) = (opts.prealloc, img.lock_write()) {
            let mut state = Prealloc::new(ws.covered, p.size, p.align, p.file_align);
            // The data ends at the last allocated cluster; a tail after it (left by a crash
            // while preallocated) is not known to read as zeroes.
            state.data_end = ws.next_free.min(ws.covered);
            if let Some(f) = opts.prealloc_file {
                img.prealloc_bg.spawn(f);
                // The first step right away: done before the first write gets there.
                if let Some((s, e)) = state.plan_ahead(state.data_end) {
                    if img.prealloc_bg.start(s, e) {
                        state.busy = true;
                    }
                }
            }
            ws.prealloc = Some(state);
        }
        Ok(img)
    }

    /// A read-write open after a crash may find a tail past the last cluster in use (space
    /// preallocated, or data whose metadata never reached the file): nothing references it,
    /// so it is truncated and allocation starts after the last cluster with a refcount.
    /// Bounded: looks at most at [`MAX_TAIL_SCAN_CLUSTERS`] from the end.
    fn find_data_end(&self, file: &dyn Storage, reclaim: bool) -> Result<(), Qcow2Error> {
        let Ok(mut ws) = self.lock_write() else {
            return Ok(());
        };
        let c = self.cluster_size();
        let mut end = ws.next_free;
        let mut looked = 0;
        while end > c && looked < MAX_TAIL_SCAN_CLUSTERS {
            let cl = end - c;
            let rc = self
                .get_refcount(&mut ws, file, cl)
                .map_err(Qcow2Error::ReadRefcounts)?;
            if rc != 0 || self.is_metadata(cl) {
                break;
            }
            end = cl;
            looked += 1;
        }
        // Refcounts say the tail is free; never cut off what an L2 entry still points at (an
        // image with broken refcounts). Bounded: with more L2 tables than this, keep the tail.
        if end < ws.next_free {
            let most = self.tail_scan_tables();
            let tables: Vec<u64> = self
                .l1
                .read_locked()
                .iter()
                .map(|e| e & L1_OFFSET_MASK)
                .filter(|&t| t != 0)
                .take(most + 1)
                .collect();
            if tables.len() > most {
                end = ws.next_free;
            }
            for &t in tables.iter().take(most) {
                if t + c > self.file_len() {
                    continue;
                }
                let Ok(entries) = self.read_l2(file, t) else {
                    end = ws.next_free;
                    break;
                };
                for e in entries.into_iter().step_by(self.l2_stride()) {
                    let last = if e & L2_COMPRESSED != 0 {
                        let (host, sectors) = compressed_span(e, self.cluster_bits);
                        host + sectors * 512
                    } else if e & L2_OFFSET_MASK != 0 {
                        (e & L2_OFFSET_MASK) + c
                    } else {
                        0
                    };
                    end = end.max(last.next_multiple_of(c).min(ws.next_free));
                }
            }
        }
        if reclaim {
            end = self
                .reclaim_reserved_tail(&mut ws, file, end)
                .map_err(Qcow2Error::ReadRefcounts)?;
        }
        // Cut the tail off now: a new cluster must read as zeroes wherever it is not written
        // (stale data from before the crash must not show through).
        let len = file.size().map_err(Qcow2Error::ReadHeader)?;
        if len > end {
            file.set_len(end).map_err(Qcow2Error::ReadHeader)?;
            ws.covered = end;
        }
        ws.next_free = end;
        self.file_size.store(end, Ordering::Release);
        Ok(())
    }
}

impl Qcow2Image {
    /// How many L2 tables a scan at open may read: [`MAX_TAIL_SCAN_TABLES`], fewer when
    /// they would be more than [`MAX_TAIL_SCAN_BYTES`].
    fn tail_scan_tables(&self) -> usize {
        MAX_TAIL_SCAN_TABLES.min((MAX_TAIL_SCAN_BYTES >> self.cluster_bits) as usize)
    }

    /// After a crash, the file can end in clusters reserved ahead of the allocations
    /// (refcount 1, referenced by nothing, reading as zeroes): set their refcounts back to 0
    /// and return where the file's data really ends. Only looked into when the last
    /// cluster looks like one (refcount 1, not metadata, all zeroes); then every active L2
    /// table is read (at most [`Self::tail_scan_tables`]) to find the last cluster in use.
    fn reclaim_reserved_tail(
        &self,
        ws: &mut WriteState,
        file: &dyn Storage,
        end: u64,
    ) -> Result<u64, ImageError> {
        let c = self.cluster_size();
        let last = end.saturating_sub(c);
        if end <= c || self.is_metadata(last) || self.get_refcount(ws, file, last)? != 1 {
            return Ok(end);
        }
        let tail = read_aligned(file, last, c as usize).map_err(ImageError::Io)?;
        if tail.iter().any(|&b| b != 0) {
            return Ok(end);
        }
        let tables: Vec<u64> = self
            .l1
            .read_locked()
            .iter()
            .map(|e| e & L1_OFFSET_MASK)
            .filter(|&t| t != 0)
            .take(self.tail_scan_tables() + 1)
            .collect();
        if tables.len() > self.tail_scan_tables() {
            return Ok(end);
        }
        // The end of the last cluster anything refers to: metadata, or an L2 entry.
        let mut in_use = self.metadata.read_locked().end().max(c);
        for &t in &tables {
            for e in self.read_l2(file, t)?.into_iter().step_by(self.l2_stride()) {
                let end_of = if e & L2_COMPRESSED != 0 {
                    let (host, sectors) = compressed_span(e, self.cluster_bits);
                    (host + sectors * 512).next_multiple_of(c)
                } else if e & L2_OFFSET_MASK != 0 {
                    (e & L2_OFFSET_MASK) + c
                } else {
                    0
                };
                in_use = in_use.max(end_of);
            }
        }
        let mut new_end = end;
        let mut looked = 0;
        while new_end - c >= in_use && looked < MAX_TAIL_SCAN_CLUSTERS {
            let cl = new_end - c;
            if self.is_metadata(cl) || self.get_refcount(ws, file, cl)? > 1 {
                break;
            }
            self.set_refcount(ws, file, cl, RefChange::Set(0))?;
            new_end = cl;
            looked += 1;
        }
        if new_end < end {
            self.write_dirty_refcounts(ws, file)?;
            log::info!(
                "qcow2: gave back {} clusters reserved before a crash (refcount 1, unused)",
                (end - new_end) / c
            );
        }
        Ok(new_end)
    }
}

/// A table of big-endian u64 entries (the L1 or the refcount table; `len` is bounded by the
/// caller), read in windows of [`TABLE_WINDOW`] bytes: the bytes read never take as much
/// memory again as the table.
fn read_table(file: &dyn Storage, offset: u64, len: u64) -> Result<Vec<u64>, Qcow2Error> {
    let mut table = Vec::with_capacity((len / 8) as usize);
    let mut at = 0;
    while at < len {
        let n = (len - at).min(TABLE_WINDOW);
        let raw = read_aligned(file, offset + at, n as usize).map_err(Qcow2Error::ReadL1)?;
        table.extend(raw.chunks_exact(8).map(|c| be64(c, 0)));
        at += n;
    }
    Ok(table)
}

/// Before anything is written, in an image without bitmaps: clear the autoclear feature
/// bits (qcow2 spec: a writer clears those it does not maintain before its first write;
/// bit 0 without a bitmaps extension is an error anyway). Images with bitmaps get the bits
/// they keep from `save_bitmaps`.
fn clear_autoclear(file: &dyn Storage) -> Result<(), Qcow2Error> {
    use super::header::off;
    // One aligned block (the file may be O_DIRECT); nothing else runs during the open.
    crate::io::aligned::write_unaligned(file, off::AUTOCLEAR_FEATURES as u64, &[0u8; 8], 4096)
        .and_then(|()| file.sync_data())
        .map_err(Qcow2Error::WriteHeader)
}

/// Clusters holding metadata. Ranges are clamped to the file, and tables of several clusters
/// are one entry each (see [`MetadataMap`]), so a hostile header cannot make this map large;
/// a read-write open (`write` present) refuses tables that overlap or lie outside the file,
/// and also counts internal snapshots' tables and refcount blocks.
fn metadata_clusters(
    file: &dyn Storage,
    h: &Header,
    l1: &[u64],
    write: Option<&WriteState>,
    file_size: u64,
) -> Result<MetadataMap, Qcow2Error> {
    let writable = write.is_some();
    let cluster_size = 1u64 << h.cluster_bits;
    let file_end = file_size.next_multiple_of(cluster_size);
    let mut map = MetadataMap::new(cluster_size);
    let add_table = |map: &mut MetadataMap, off: u64, len: u64| -> bool {
        map.insert_range(off, off.saturating_add(len).min(file_end))
    };
    add_table(&mut map, 0, cluster_size);
    if !add_table(&mut map, h.l1_table_offset, u64::from(h.l1_size) * 8) && writable {
        return Err(Qcow2Error::Metadata("the L1 table overlaps the header"));
    }
    let rt_len = u64::from(h.refcount_table_clusters) * cluster_size;
    if rt_len <= MAX_REFCOUNT_TABLE_BYTES
        && !add_table(&mut map, h.refcount_table_offset, rt_len)
        && writable
    {
        return Err(Qcow2Error::Metadata(
            "the refcount table overlaps the header or the L1 table",
        ));
    }
    if writable {
        snapshot_tables(file, h, &mut map, file_size)?;
    }
    // Sized once: growing the set would hold its old and new tables at once.
    let rt = write.map_or(&[][..], |ws| &ws.refcount_table[..]);
    map.reserve(l1.iter().chain(rt).filter(|&&e| e != 0).count());
    for &e in l1 {
        let l2 = e & L1_OFFSET_MASK;
        if l2 == 0 {
            continue;
        }
        let inside = l2.is_multiple_of(cluster_size) && l2 + cluster_size <= file_end;
        if l2 < file_end && !map.insert(l2) && writable {
            return Err(Qcow2Error::Metadata(
                "an L2 table overlaps other metadata or another L2 table",
            ));
        }
        if !inside && writable {
            return Err(Qcow2Error::Metadata(
                "an L2 table is unaligned or outside the file",
            ));
        }
    }
    let Some(ws) = write else {
        return Ok(map);
    };
    for &rb in ws.refcount_table.iter().filter(|&&rb| rb != 0) {
        if rb % cluster_size != 0 || rb.saturating_add(cluster_size) > file_end {
            return Err(Qcow2Error::Metadata(
                "a refcount block is unaligned or outside the file",
            ));
        }
        if !map.insert(rb) {
            return Err(Qcow2Error::Metadata(
                "a refcount block overlaps other metadata",
            ));
        }
    }
    Ok(map)
}

/// Internal snapshots: their table and their L1 tables are metadata too (QEMU's default
/// overlap checks); a data write must never land on them. Each table must lie inside the
/// file, overlap nothing, and keep to QEMU's limits ([`MAX_SNAPSHOTS`],
/// [`MAX_SNAPSHOT_TABLE_BYTES`], [`MAX_L1_BYTES`] per L1 table), so the walk is bounded
/// whatever the header claims; the L1 tables themselves are never read.
fn snapshot_tables(
    file: &dyn Storage,
    h: &Header,
    map: &mut MetadataMap,
    file_size: u64,
) -> Result<(), Qcow2Error> {
    let nb = h.nb_snapshots;
    if nb > MAX_SNAPSHOTS {
        return Err(Qcow2Error::Limit("more than 65536 internal snapshots"));
    }
    let cluster_size = 1u64 << h.cluster_bits;
    let file_end = file_size.next_multiple_of(cluster_size);
    let outside = Qcow2Error::Metadata("the snapshot table is unaligned or outside the file");
    let fixed = super::header::snap::FIXED_LEN;
    let table = h.snapshots_offset;
    let mut window = Window::new(file);
    let mut pos = table;
    for _ in 0..nb {
        if !pos.is_multiple_of(8) || pos.saturating_add(fixed as u64) > file_size {
            return Err(outside);
        }
        let e = SnapshotEntry::parse(window.get(pos, fixed).map_err(Qcow2Error::ReadL1)?);
        if e.l1_bytes > MAX_L1_BYTES {
            return Err(Qcow2Error::Limit("a snapshot L1 table larger than 32 MiB"));
        }
        let l1_end = e.l1_table_offset.saturating_add(e.l1_bytes);
        if !e.l1_table_offset.is_multiple_of(cluster_size) || l1_end > file_end {
            return Err(Qcow2Error::Metadata(
                "a snapshot's L1 table is unaligned or outside the file",
            ));
        }
        if !map.insert_range(e.l1_table_offset, l1_end) {
            return Err(Qcow2Error::Metadata(
                "a snapshot's L1 table overlaps other metadata",
            ));
        }
        pos = pos.saturating_add(e.entry_len);
        if pos - table > MAX_SNAPSHOT_TABLE_BYTES {
            return Err(Qcow2Error::Limit("a snapshot table larger than 64 MiB"));
        }
    }
    // The last entry's padding may lie past the end of the file, not its cluster.
    if nb > 0 && pos > file_end {
        return Err(outside);
    }
    if !map.insert_range(table, pos) {
        return Err(Qcow2Error::Metadata(
            "the snapshot table overlaps other metadata",
        ));
    }
    Ok(())
}

/// Reads small entries of a table through one window of [`TABLE_WINDOW`] bytes: walking
/// 65,536 snapshot entries costs about a thousand reads, not one (O_DIRECT) read each.
struct Window<'a> {
    file: &'a dyn Storage,
    start: u64,
    buf: Vec<u8>,
}

impl<'a> Window<'a> {
    fn new(file: &'a dyn Storage) -> Self {
        Window {
            file,
            start: 0,
            buf: Vec::new(),
        }
    }

    /// `len` bytes at `pos` (zeroes past the end of the file).
    fn get(&mut self, pos: u64, len: usize) -> std::io::Result<&[u8]> {
        let end = pos.saturating_add(len as u64);
        if pos < self.start || end > self.start + self.buf.len() as u64 {
            self.start = pos & !(TABLE_WINDOW - 1);
            let n = (end - self.start).max(TABLE_WINDOW);
            self.buf = read_aligned(self.file, self.start, n as usize)?;
        }
        let at = (pos - self.start) as usize;
        Ok(&self.buf[at..at + len])
    }
}
