//! Parallels images (Virtuozzo's format, QEMU's `parallels` driver): a 64-byte header, a block
//! allocation table (BAT) of little-endian u32 entries mapping each guest cluster to a host
//! cluster (0: not allocated, reads as zeroes), then data clusters. The old magic stores host
//! offsets in 512-byte sectors, the new one in clusters.
//!
//! The image grows by whole clusters. Extending the file one cluster at a time costs an inode
//! update each time, so growth happens in chunks of the clusters needed plus
//! `--prealloc-size`, either allocated (`falloc`) or only sized (`truncate`); a clean close
//! truncates the file to the end of the last used cluster. The header's in-use field is set
//! while the image is open read-write; when a start finds it still set (a crash), the image is
//! checked: the leaked tail is trimmed, and BAT entries that point outside the file or at the
//! same cluster twice make the open fail (never served; `qemu-img check -r all` repairs them).
//!
//! Free clusters inside the file (from discards) are reused first, then the preallocated tail,
//! then the file grows. A discarded cluster becomes reusable only once the BAT that no longer
//! names it is durable, so a crash can never leave two entries naming one cluster.
//!
//! What a header may make vublk allocate is bounded: the header and the BAT (held in memory)
//! must lie in the file and the BAT may have at most [`MAX_BAT_ENTRIES`] (QEMU's limit, a BAT
//! under 2 GiB); the padding before the data offset is never read; and the clusters in use
//! are one bit each, up to the last one a BAT entry names (a file's holes after it cost
//! nothing).

use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use super::durable::{AfterDurable, DirtyChunks};
use super::piece::Piece;
use super::prealloc::preallocate;
pub use super::prealloc::PreallocMode;
use super::{ImageError, ZeroMode};
use crate::io::aligned::{read_aligned, write_all_aligned, write_unaligned};
use crate::io::Storage;
use crate::locks::Locked;
use used::UsedClusters;

pub const MAGIC_OLD: &[u8; 16] = b"WithoutFreeSpace";
pub const MAGIC_EXT: &[u8; 16] = b"WithouFreSpacExt";
const VERSION: u32 = 2;
const HEADER_LEN: u64 = 64;
/// The header's in-use field while open read-write, and after a clean close.
pub const INUSE_OPEN: u32 = 0x746F_6E59;
pub const INUSE_CLOSED: u32 = 0x312e_3276;
/// Format-extension cluster magic.
pub const EXT_MAGIC: u64 = 0xAB23_4CEF_23DC_EA87;
/// Largest cluster: QEMU's limit on tracks (sectors per cluster) keeps this far below.
const MAX_CLUSTER: u64 = 1 << 30;
/// Most BAT entries an image may have: QEMU's limit (its BAT is one allocation of less than
/// 2 GiB), so no image QEMU opens is refused. The BAT is held in memory, so this bounds what
/// a header can make vublk allocate for it.
pub const MAX_BAT_ENTRIES: u64 = i32::MAX as u64 / 4;
/// Growth is rounded to this: O_DIRECT I/O racing a size change to a non-page multiple
/// fails with EIO on some file systems.
const GROW_ALIGN: u64 = 4096;

/// Why an image cannot be opened.
#[derive(Debug, thiserror::Error)]
pub enum ParallelsError {
    #[error("reading the parallels header or BAT failed")]
    Io(#[source] io::Error),
    #[error("not a parallels image: {0}")]
    Header(String),
    #[error(
        "the parallels image is inconsistent ({0}); it is never served like this: repair it \
         with `qemu-img check -r all -f parallels FILE` first"
    )]
    NeedsRepair(String),
    #[error("{0}")]
    Unsupported(String),
}

/// Counters for the shutdown log.
#[derive(Debug, Default)]
pub struct ParallelsStats {
    /// Clusters allocated, and of those reused from free space inside the file.
    pub allocated: AtomicU64,
    pub reused: AtomicU64,
    /// File growths, and bytes added by them.
    pub grows: AtomicU64,
    pub grown_bytes: AtomicU64,
    /// Clusters freed by discard / unmapping write-zeroes.
    pub freed: AtomicU64,
}

struct State {
    /// Header and BAT as in the file, up to the end of the BAT's last metadata chunk (never
    /// past the data offset; the BAT is changed here and written back by chunks).
    meta: Vec<u8>,
    /// Chunks of `meta` (by offset) that differ from the file.
    dirty: DirtyChunks,
    /// Host clusters in use, from the data offset (up to the end of the file once open).
    used: UsedClusters,
    /// Lowest index that may be free.
    free_hint: usize,
    /// End of the last used cluster (bytes).
    data_end: u64,
    /// The file's size as we made it.
    file_end: u64,
    /// Host clusters whose BAT entry was cleared but not yet written and synced: free only
    /// after that.
    pending_free: AfterDurable<usize>,
    /// Preallocation: mode and bytes beyond the clusters needed (None: grow cluster by cluster).
    prealloc: Option<(PreallocMode, u64)>,
    /// fallocate is not supported: extend by size only.
    falloc_unsupported: bool,
}

/// An open parallels image.
pub struct ParallelsImage {
    pub size_bytes: u64,
    pub cluster_size: u64,
    /// Host offset of BAT entry value 1, in bytes (512 for the old magic, the cluster size for
    /// the new one).
    unit: u64,
    /// Data area start (bytes).
    pub data_off: u64,
    /// The format-extension cluster, if any (host bytes): kept as it is.
    pub ext_cluster: Option<u64>,
    nb_bat: usize,
    writable: bool,
    /// Metadata write granularity (the file's direct-I/O alignment).
    chunk: u64,
    state: Mutex<State>,
    /// BAT entries changed in memory and not yet in the file (see [`ParallelsImage::publish`]).
    unpublished: crate::image::durable::Publication,
    pub stats: ParallelsStats,
    /// The image was not closed cleanly (in-use set at open).
    pub was_in_use: bool,
    /// Bytes of leaked tail cut off at open.
    pub trimmed_at_open: u64,
}

impl std::fmt::Debug for ParallelsImage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ParallelsImage")
            .field("size_bytes", &self.size_bytes)
            .field("cluster_size", &self.cluster_size)
            .field("data_off", &self.data_off)
            .finish()
    }
}

fn le32(b: &[u8], off: usize) -> u32 {
    u32::from_le_bytes([b[off], b[off + 1], b[off + 2], b[off + 3]])
}

fn le64(b: &[u8], off: usize) -> u64 {
    let mut v = [0u8; 8];
    v.copy_from_slice(&b[off..off + 8]);
    u64::from_le_bytes(v)
}

/// How the image is served, fixed at open.
#[derive(Clone, Copy, Debug, Default)]
pub struct ParallelsOptions {
    pub writable: bool,
    /// Granularity of metadata writes: the file's direct-I/O alignment (at least 512).
    pub chunk: u64,
    /// Growth beyond the clusters needed (`--prealloc-mode`, `--prealloc-size`; at least one
    /// cluster). None: the file grows cluster by cluster.
    pub prealloc: Option<(PreallocMode, u64)>,
}

impl ParallelsImage {
    /// Open and validate. Read-write opens set the in-use field (durably) and cut off a tail
    /// no cluster uses.
    /// The disk size a header (`HEADER_LEN` bytes from the file's start) states, if it is a
    /// parallels header (nothing else is checked: a migration destination shows the size
    /// before it may read the rest).
    pub fn header_size(h: &[u8]) -> Option<u64> {
        if h.len() < HEADER_LEN as usize {
            return None;
        }
        let sectors = if h[..16] == MAGIC_OLD[..] {
            u64::from(le32(h, 36))
        } else if h[..16] == MAGIC_EXT[..] {
            le64(h, 36)
        } else {
            return None;
        };
        sectors.checked_mul(512)
    }

    pub fn open(file: &dyn Storage, opts: ParallelsOptions) -> Result<Self, ParallelsError> {
        let ParallelsOptions {
            writable,
            chunk,
            prealloc,
        } = opts;
        let chunk = chunk.max(512);
        let file_size = file.size().map_err(ParallelsError::Io)?;
        let h = read_aligned(file, 0, HEADER_LEN as usize).map_err(ParallelsError::Io)?;
        if file_size < HEADER_LEN {
            return Err(ParallelsError::Header("shorter than its header".into()));
        }
        let old = if h[..16] == MAGIC_OLD[..] {
            true
        } else if h[..16] == MAGIC_EXT[..] {
            false
        } else {
            return Err(ParallelsError::Header("no parallels magic".into()));
        };
        let version = le32(&h, 16);
        if version != VERSION {
            return Err(ParallelsError::Unsupported(format!(
                "parallels version {version} (only 2 exists)"
            )));
        }
        let tracks = u64::from(le32(&h, 28));
        let cluster = tracks * 512;
        if tracks == 0 || cluster > MAX_CLUSTER {
            return Err(ParallelsError::Header(format!(
                "cluster of {tracks} sectors"
            )));
        }
        let nb_bat = le32(&h, 32) as usize;
        if nb_bat as u64 > MAX_BAT_ENTRIES {
            return Err(ParallelsError::Unsupported(format!(
                "a BAT of {nb_bat} entries: vublk (like QEMU) opens at most {MAX_BAT_ENTRIES}"
            )));
        }
        let nb_sectors = if old {
            u64::from(le32(&h, 36))
        } else {
            le64(&h, 36)
        };
        let size_bytes = nb_sectors
            .checked_mul(512)
            .ok_or_else(|| ParallelsError::Header("size overflows".into()))?;
        if (nb_bat as u64).saturating_mul(cluster) < size_bytes {
            return Err(ParallelsError::Header(format!(
                "{nb_bat} BAT entries do not cover {size_bytes} bytes"
            )));
        }
        let bat_end = HEADER_LEN + nb_bat as u64 * 4;
        // The BAT must be in the file (and at most MAX_BAT_ENTRIES long): it is held in memory.
        if bat_end > file_size {
            return Err(ParallelsError::Header(format!(
                "a BAT of {nb_bat} entries does not fit in a {file_size}-byte file"
            )));
        }
        let mut data_off = u64::from(le32(&h, 48)) * 512;
        if data_off == 0 && old {
            data_off = bat_end.next_multiple_of(512);
        }
        if data_off < bat_end || data_off > file_size {
            return Err(ParallelsError::NeedsRepair(format!(
                "data offset {data_off} is not between the end of the BAT ({bat_end}) and the \
                 end of the file ({file_size})"
            )));
        }
        if !old && data_off % cluster != 0 {
            return Err(ParallelsError::NeedsRepair(format!(
                "data offset {data_off} is not a multiple of the cluster size {cluster}"
            )));
        }
        if writable && data_off % chunk != 0 {
            return Err(ParallelsError::Unsupported(format!(
                "the BAT ends inside a {chunk}-byte block shared with data (data offset \
                 {data_off}); serve it read-only or with --cache writeback"
            )));
        }
        let unit = if old { 512 } else { cluster };
        // Only the header and the BAT: the padding up to the data offset is never used.
        let meta_len = bat_end.next_multiple_of(chunk).min(data_off);
        let meta = read_aligned(file, 0, meta_len as usize).map_err(ParallelsError::Io)?;
        let in_use = le32(&meta, 44);
        let was_in_use = in_use == INUSE_OPEN;

        let ext_off = le64(&meta, 56);
        let ext_cluster = if ext_off != 0 {
            Some(
                ext_off
                    .checked_mul(512)
                    .ok_or_else(|| ParallelsError::NeedsRepair("format extension offset".into()))?,
            )
        } else {
            None
        };
        let layout = DataArea {
            data_off,
            cluster,
            file_size,
        };
        let used = layout.used_clusters(&meta, nb_bat, unit, ext_cluster)?;
        let data_end = used
            .last_used()
            .map_or(data_off, |i| data_off + (i as u64 + 1) * cluster);
        let mut img = ParallelsImage {
            size_bytes,
            cluster_size: cluster,
            unit,
            data_off,
            ext_cluster,
            nb_bat,
            writable,
            chunk,
            state: Mutex::new(State {
                meta,
                dirty: DirtyChunks::default(),
                used,
                free_hint: 0,
                data_end,
                file_end: file_size,
                pending_free: AfterDurable::default(),
                // At least one cluster ahead (QEMU: MAX(tracks, prealloc-size)).
                prealloc: prealloc.map(|(m, n)| (m, n.max(cluster))),
                falloc_unsupported: false,
            }),
            unpublished: Default::default(),
            stats: ParallelsStats::default(),
            was_in_use,
            trimmed_at_open: 0,
        };
        if writable {
            let st = img
                .state
                .get_mut()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            // Nothing past the last used cluster is referenced: a tail a crash left behind
            // (or an old preallocation) goes.
            if file_size > st.data_end {
                file.set_len(st.data_end).map_err(ParallelsError::Io)?;
                img.trimmed_at_open = file_size - st.data_end;
                st.file_end = st.data_end;
                let slots = ((st.data_end - data_off) / cluster) as usize;
                st.used.resize(slots);
            }
            st.meta[44..48].copy_from_slice(&INUSE_OPEN.to_le_bytes());
            let chunk0 = st.meta[..chunk.min(data_off) as usize].to_vec();
            write_all_aligned(file, 0, &chunk0).map_err(ParallelsError::Io)?;
            file.sync_data().map_err(ParallelsError::Io)?;
        }
        Ok(img)
    }

    pub fn writable(&self) -> bool {
        self.writable
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.locked()
    }

    /// The preallocation mode in use (`Falloc` once truncate turned out unsupported).
    pub fn prealloc_mode(&self) -> Option<PreallocMode> {
        self.lock().prealloc.map(|p| p.0)
    }

    fn entry(st: &State, g: usize) -> u32 {
        le32(&st.meta, HEADER_LEN as usize + g * 4)
    }

    fn set_entry(&self, st: &mut State, g: usize, v: u32) {
        let at = HEADER_LEN as usize + g * 4;
        st.meta[at..at + 4].copy_from_slice(&v.to_le_bytes());
        st.dirty.mark(at as u64 / self.chunk * self.chunk);
        self.unpublished.note_change();
    }

    /// The host offset of guest cluster `g`, if allocated.
    fn host_of(&self, st: &State, g: usize) -> Option<u64> {
        let e = Self::entry(st, g);
        (e != 0).then(|| u64::from(e) * self.unit)
    }

    /// Map `[offset, offset + len)` to pieces of the image file (layer 0) and zeroes, merging
    /// neighbours that are contiguous.
    pub fn map(&self, offset: u64, len: u64, out: &mut Vec<Piece>) {
        out.clear();
        let st = self.lock();
        let c = self.cluster_size;
        let end = (offset + len).min(self.size_bytes.max(offset));
        let mut pos = offset;
        while pos < offset + len {
            let g = (pos / c) as usize;
            let in_cl = pos % c;
            let n = (c - in_cl).min(offset + len - pos);
            let host = if pos < end && g < self.nb_bat {
                self.host_of(&st, g)
            } else {
                None
            };
            match (host, out.last_mut()) {
                (
                    Some(h),
                    Some(Piece::Data {
                        host_offset, len, ..
                    }),
                ) if *host_offset + *len == h + in_cl => *len += n,
                (Some(h), _) => out.push(Piece::Data {
                    layer: 0,
                    host_offset: h + in_cl,
                    len: n,
                }),
                (None, Some(Piece::Zero { len })) => *len += n,
                (None, _) => out.push(Piece::Zero { len: n }),
            }
            pos += n;
        }
    }

    /// Where `[offset, offset + len)` is, when every cluster of it is allocated and they are
    /// contiguous in the file.
    pub fn owned_extent(&self, offset: u64, len: u64) -> Option<u64> {
        let st = self.lock();
        self.contiguous(&st, offset, len)
    }

    fn contiguous(&self, st: &State, offset: u64, len: u64) -> Option<u64> {
        let c = self.cluster_size;
        if len == 0 || offset + len > self.size_bytes {
            return None;
        }
        let first = (offset / c) as usize;
        let last = ((offset + len - 1) / c) as usize;
        let base = self.host_of(st, first)?;
        for g in first + 1..=last {
            if self.host_of(st, g)? != base + (g - first) as u64 * c {
                return None;
            }
        }
        Some(base + offset % c)
    }

    /// Allocate the clusters of `[offset, offset + len)` that have none; then where the range
    /// is, if contiguous. New clusters read as zeroes (preallocated or grown space, or reused
    /// free space zeroed first), so a partial write needs no fill.
    pub fn allocate(
        &self,
        file: &dyn Storage,
        offset: u64,
        len: u64,
    ) -> Result<Option<u64>, ImageError> {
        if !self.writable {
            return Err(ImageError::ReadOnly);
        }
        let c = self.cluster_size;
        if len == 0 || offset + len > self.size_bytes {
            return Err(ImageError::Corrupt("write past the end of the image"));
        }
        let mut st = self.lock();
        let first = (offset / c) as usize;
        let last = ((offset + len - 1) / c) as usize;
        // Growth covers every cluster this request still needs, plus the preallocation.
        let mut missing = (first..=last)
            .filter(|&g| self.host_of(&st, g).is_none())
            .count() as u64;
        for g in first..=last {
            if self.host_of(&st, g).is_none() {
                let host = self.alloc_cluster(&mut st, file, missing)?;
                missing -= 1;
                let v = host / self.unit;
                let v = u32::try_from(v).map_err(|_| ImageError::Full)?;
                self.set_entry(&mut st, g, v);
            }
        }
        Ok(self.contiguous(&st, offset, len))
    }

    /// A free host cluster, marked used: free space inside the file first, then the tail,
    /// then the file grows.
    fn alloc_cluster(
        &self,
        st: &mut State,
        file: &dyn Storage,
        need: u64,
    ) -> Result<u64, ImageError> {
        let c = self.cluster_size;
        let find = |st: &State| st.used.first_free_from(st.free_hint);
        let i = match find(st) {
            Some(i) => i,
            None => {
                self.grow(st, file, need.max(1))?;
                find(st).ok_or(ImageError::Corrupt("growing the file added no cluster"))?
            }
        };
        let host = self.data_off + i as u64 * c;
        if host < st.data_end {
            // A hole inside the data area (a discarded cluster): make sure it reads as zeroes.
            self.stats.reused.fetch_add(1, Ordering::Relaxed);
            if file.punch_hole(host, c).is_err() {
                write_all_aligned(file, host, &vec![0u8; c as usize])?;
            } else if matches!(st.prealloc, Some((PreallocMode::Falloc, _))) {
                let _ = file.allocate(host, c);
            }
        }
        st.used.set(i);
        st.free_hint = i + 1;
        st.data_end = st.data_end.max(host + c);
        self.stats.allocated.fetch_add(1, Ordering::Relaxed);
        Ok(host)
    }

    /// Grow the file by `clusters` plus the preallocation (or by `clusters` without).
    fn grow(&self, st: &mut State, file: &dyn Storage, clusters: u64) -> Result<(), ImageError> {
        let c = self.cluster_size;
        // The next cluster starts at the end of the last whole cluster in the file.
        let next = self.data_off + st.used.len() as u64 * c;
        let extra = st.prealloc.map_or(0, |(_, n)| n);
        let new_end = (next + clusters * c + extra).next_multiple_of(GROW_ALIGN);
        let old_end = st.file_end.max(next);
        if new_end > old_end {
            let eopnotsupp = |r: &io::Result<()>| matches!(r, Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP));
            let r = match st.prealloc.map(|p| p.0) {
                Some(PreallocMode::Falloc) if !st.falloc_unsupported => {
                    match preallocate(file, PreallocMode::Falloc, old_end, new_end) {
                        r if eopnotsupp(&r) => {
                            log::warn!(
                                "parallels: fallocate is not supported here; growing the file \
                                 by its size only"
                            );
                            st.falloc_unsupported = true;
                            preallocate(file, PreallocMode::Truncate, old_end, new_end)
                        }
                        r => r,
                    }
                }
                Some(PreallocMode::Truncate) => {
                    match preallocate(file, PreallocMode::Truncate, old_end, new_end) {
                        r if eopnotsupp(&r) => {
                            log::warn!(
                                "parallels: extending by truncate is not supported here; \
                                 preallocating with fallocate from now on"
                            );
                            if let Some(p) = st.prealloc.as_mut() {
                                p.0 = PreallocMode::Falloc;
                            }
                            preallocate(file, PreallocMode::Falloc, old_end, new_end)
                        }
                        r => r,
                    }
                }
                _ => preallocate(file, PreallocMode::Truncate, old_end, new_end),
            };
            r?;
            // The new size must be durable before a BAT entry that points into it can be:
            // BAT chunks are written before the requests that changed them complete, and a
            // power cut that kept one of them but not the growth would leave clusters
            // outside the file. Once per growth (the preallocation makes that rare).
            file.sync_data()?;
            self.stats.grows.fetch_add(1, Ordering::Relaxed);
            self.stats
                .grown_bytes
                .fetch_add(new_end - old_end, Ordering::Relaxed);
            st.file_end = new_end;
        }
        let slots = ((st.file_end - self.data_off) / c) as usize;
        if slots > st.used.len() {
            st.used.resize(slots);
        }
        Ok(())
    }

    /// Write `data` at guest `offset` through the format (allocating), synchronously.
    pub fn write(&self, file: &dyn Storage, offset: u64, data: &[u8]) -> Result<(), ImageError> {
        self.allocate(file, offset, data.len() as u64)?;
        let mut pieces = Vec::new();
        self.map(offset, data.len() as u64, &mut pieces);
        let mut pos = 0usize;
        for p in &pieces {
            let n = p.len() as usize;
            match *p {
                Piece::Data { host_offset, .. } => {
                    let a = self.chunk;
                    if host_offset % a == 0 && (n as u64).is_multiple_of(a) {
                        write_all_aligned(file, host_offset, &data[pos..pos + n])?;
                    } else {
                        // Not aligned to the file's direct-I/O block: read-modify-write the
                        // blocks around it, one writer at a time.
                        let _one = self.lock();
                        write_unaligned(file, host_offset, &data[pos..pos + n], a)?;
                    }
                }
                _ => return Err(ImageError::Corrupt("allocated cluster reads as zero")),
            }
            pos += n;
        }
        Ok(())
    }

    /// Zero `[offset, offset + len)`. Unless `mode` keeps allocations, whole allocated
    /// clusters are freed (BAT entry 0, the host cluster punched; it becomes reusable once
    /// the BAT is durable); other allocated parts get zeroes written, except with
    /// `Discard`, which leaves partial clusters as they are. Unallocated parts already read
    /// as zeroes.
    pub fn zero_range(
        &self,
        file: &dyn Storage,
        offset: u64,
        len: u64,
        mode: ZeroMode,
    ) -> Result<(), ImageError> {
        let unmap = mode != ZeroMode::Keep;
        let hint_only = mode == ZeroMode::Discard;
        if !self.writable {
            return Err(ImageError::ReadOnly);
        }
        let c = self.cluster_size;
        let end = (offset + len).min(self.size_bytes);
        let mut st = self.lock();
        let mut pos = offset;
        while pos < end {
            let g = (pos / c) as usize;
            let in_cl = pos % c;
            let n = (c - in_cl).min(end - pos);
            if let Some(host) = self.host_of(&st, g) {
                if unmap && n == c {
                    self.set_entry(&mut st, g, 0);
                    let i = ((host - self.data_off) / c) as usize;
                    st.pending_free.push(i);
                    // Best effort: the space goes back to the file system now; reads of the
                    // guest cluster are zeroes from the BAT already.
                    let _ = file.punch_hole(host, c);
                    self.stats.freed.fetch_add(1, Ordering::Relaxed);
                } else if !hint_only {
                    write_all_aligned(file, host + in_cl, &vec![0u8; n as usize])?;
                }
            }
            pos += n;
        }
        Ok(())
    }

    /// Put the changed BAT chunks into the file, without a sync: called before requests
    /// whose writes changed the BAT complete, so that a new vublk process after a crash
    /// finds them. (A cluster is reused only after the BAT write that freed it was synced,
    /// so an early BAT write never makes two guest clusters share one.)
    pub fn publish(&self, file: &dyn Storage) -> Result<(), ImageError> {
        if !self.writable || !self.unpublished.pending() {
            return Ok(());
        }
        let mut st = self.lock();
        // Written by another queue while this one waited for the lock, perhaps.
        if !self.unpublished.pending() {
            return Ok(());
        }
        self.write_dirty(&mut st, file)
    }

    /// Write the changed BAT chunks (the caller syncs for durability); clusters freed before
    /// become reusable after a sync here.
    pub fn flush(&self, file: &dyn Storage) -> Result<(), ImageError> {
        if !self.writable {
            return Ok(());
        }
        let mut st = self.lock();
        self.write_dirty(&mut st, file)?;
        for i in st.pending_free.release(file)? {
            st.used.clear(i);
            st.free_hint = st.free_hint.min(i);
        }
        Ok(())
    }

    fn write_dirty(&self, st: &mut State, file: &dyn Storage) -> Result<(), ImageError> {
        let chunk = self.chunk;
        let at = self.unpublished.start();
        let meta = &st.meta;
        st.dirty.write_back(file, |at| {
            let end = (at + chunk).min(meta.len() as u64);
            meta.get(at as usize..end as usize)
        })?;
        self.unpublished.finished(at);
        Ok(())
    }

    /// Clean close: the BAT, the in-use field cleared, synced, and the file cut to the end
    /// of the last used cluster.
    pub fn close(&self, file: &dyn Storage) -> Result<(), ImageError> {
        if !self.writable {
            return Ok(());
        }
        let mut st = self.lock();
        self.write_dirty(&mut st, file)?;
        file.sync_data()?;
        for i in st.pending_free.take_durable() {
            st.used.clear(i);
        }
        // The end of the last used cluster (freed clusters at the end give space back too).
        let last = st.used.last_used();
        st.data_end = last.map_or(self.data_off, |i| {
            self.data_off + (i as u64 + 1) * self.cluster_size
        });
        if let Some(e) = self.ext_cluster {
            st.data_end = st.data_end.max(e + self.cluster_size);
        }
        st.meta[44..48].copy_from_slice(&INUSE_CLOSED.to_le_bytes());
        let chunk0 = st.meta[..self.chunk.min(self.data_off) as usize].to_vec();
        write_all_aligned(file, 0, &chunk0)?;
        file.sync_data()?;
        if file.size()? != st.data_end {
            file.set_len(st.data_end)?;
            st.file_end = st.data_end;
        }
        Ok(())
    }

    /// Allocated clusters (for logs and tests).
    pub fn allocated_clusters(&self) -> u64 {
        let st = self.lock();
        (0..self.nb_bat)
            .filter(|&g| Self::entry(&st, g) != 0)
            .count() as u64
    }
}

/// Where the data area is, for checking the clusters the BAT names.
struct DataArea {
    data_off: u64,
    cluster: u64,
    file_size: u64,
}

impl DataArea {
    /// The index of the data area's cluster at `host`, if it is one inside the file.
    fn index(&self, host: u64, what: &dyn Fn() -> String) -> Result<usize, ParallelsError> {
        let Self {
            data_off,
            cluster,
            file_size,
        } = *self;
        if host < data_off || !(host - data_off).is_multiple_of(cluster) {
            return Err(ParallelsError::NeedsRepair(format!(
                "{} at {host} is not a cluster of the data area",
                what()
            )));
        }
        if host.checked_add(cluster).is_none_or(|end| end > file_size) {
            return Err(ParallelsError::NeedsRepair(format!(
                "{} at {host} lies beyond the end of the file ({file_size} bytes)",
                what()
            )));
        }
        Ok(((host - data_off) / cluster) as usize)
    }

    /// Every cluster in use (the format extension cluster and each BAT entry's), once and
    /// inside the file. Two passes: the first finds the last cluster in use, so the map
    /// covers only up to it.
    fn used_clusters(
        &self,
        meta: &[u8],
        nb_bat: usize,
        unit: u64,
        ext_cluster: Option<u64>,
    ) -> Result<UsedClusters, ParallelsError> {
        let ext = || "the format extension cluster".to_string();
        let entry = |g: usize| u64::from(le32(meta, HEADER_LEN as usize + g * 4)) * unit;
        let mut len = 0;
        if let Some(host) = ext_cluster {
            len = self.index(host, &ext)? + 1;
        }
        for g in (0..nb_bat).filter(|&g| entry(g) != 0) {
            len = len.max(self.index(entry(g), &|| format!("BAT entry {g}"))? + 1);
        }
        let mut used = UsedClusters::new(len);
        if let Some(host) = ext_cluster {
            used.set(self.index(host, &ext)?);
        }
        for g in (0..nb_bat).filter(|&g| entry(g) != 0) {
            if !used.set(self.index(entry(g), &|| String::new())?) {
                return Err(ParallelsError::NeedsRepair(format!(
                    "BAT entry {g} at {} is used twice",
                    entry(g)
                )));
            }
        }
        Ok(used)
    }
}

mod create;
#[cfg(test)]
mod tests;
mod used;

pub use create::{min_cluster, new_header, new_image};
