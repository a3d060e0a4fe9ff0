//! qcow2 images (QEMU's docs/interop/qcow2.rst; no QEMU code): header validation, the L1
//! table, a bounded L2 cache, and the mapping of guest ranges to host extents. The format
//! plans; the worker executes the data I/O. This increment serves images read-only.

use super::storage::Storage;
use std::collections::VecDeque;
use std::fs::File;
use std::io;
use std::sync::Mutex;

/// "QFI\xfb".
pub const MAGIC: [u8; 4] = *b"QFI\xfb";
/// Incompatible feature bits (header offset 72, v3).
const INCOMPAT_DIRTY: u64 = 1 << 0;
const INCOMPAT_CORRUPT: u64 = 1 << 1;
const INCOMPAT_DATA_FILE: u64 = 1 << 2;
const INCOMPAT_COMPRESSION: u64 = 1 << 3;
const INCOMPAT_EXTL2: u64 = 1 << 4;
const INCOMPAT_KNOWN: u64 =
    INCOMPAT_DIRTY | INCOMPAT_CORRUPT | INCOMPAT_DATA_FILE | INCOMPAT_COMPRESSION | INCOMPAT_EXTL2;
/// L2 entry bits.
const L2_COMPRESSED: u64 = 1 << 62;
/// `--compressed-cache-size` default, in host clusters.
pub const DEFAULT_COMPRESSED_CACHE_CLUSTERS: usize = 16;
const L2_ZERO: u64 = 1;
/// "Copied": the refcount is exactly 1, so the cluster may be written in place.
const L2_COPIED: u64 = 1 << 63;
const L2_OFFSET_MASK: u64 = 0x00ff_ffff_ffff_fe00;
/// L1 entry: offset of the L2 table.
const L1_OFFSET_MASK: u64 = 0x00ff_ffff_ffff_fe00;
/// Refuse L1 tables larger than this: 32 MiB of L1 maps 2^22 L2 tables, petabytes of guest
/// space at any cluster size; an image claiming more is hostile or broken.
const MAX_L1_BYTES: u64 = 32 << 20;
/// Most internal snapshots an image may have (QEMU's limit).
const MAX_SNAPSHOTS: u32 = 65536;
/// Default L2 cache: 32 MiB, or what covers 64 GiB of guest data when that is more (small
/// clusters), never more than the image's own L2 tables.
pub const DEFAULT_L2_CACHE_BYTES: u64 = 32 << 20;
/// Guest bytes the default L2 cache covers at least.
pub const DEFAULT_L2_COVERAGE: u64 = 64 << 30;
/// At a read-write open, a tail past the last refcounted cluster is only cut off after
/// checking that no active L2 entry points into it, which reads every L2 table: not for
/// images with more tables than this (1 TiB of guest data at 64 KiB clusters).
const MAX_TAIL_SCAN_TABLES: usize = 2048;
/// While serving, the file is grown in steps of this (never to a size that is not a multiple
/// of the page size, see `extend_to`).
const SIZE_STEP: u64 = 1 << 20;
/// Dirty refcount chunks kept before they are written (each at most 4 KiB).
const MAX_DIRTY_REFCOUNT_CHUNKS: usize = 1024;
/// Refcount chunks cached (dirty or clean) before clean ones are dropped.
const MAX_REFCOUNT_CHUNKS: usize = 4096;

/// Why a qcow2 image cannot be served; each names the problem.
#[derive(Debug, thiserror::Error)]
pub enum Qcow2Error {
    #[error("cannot read the qcow2 header")]
    ReadHeader(#[source] io::Error),
    #[error("not a qcow2 image (bad magic)")]
    BadMagic,
    #[error("qcow2 version {0} is not supported (only 2 and 3)")]
    Version(u32),
    #[error("qcow2 cluster size 2^{0} is outside 512 B..2 MiB")]
    ClusterBits(u32),
    #[error("encrypted qcow2 images are not supported")]
    Encrypted,
    #[error("qcow2 images with an external data file are not supported")]
    ExternalDataFile,
    #[error("qcow2 images with extended L2 entries (subclusters) are not supported")]
    ExtendedL2,
    #[error("qcow2 image uses unknown incompatible features {0:#x}")]
    UnknownFeatures(u64),
    #[error("qcow2 image is marked corrupt: it can only be served with --read-only (repair it with qemu-img check -r all)")]
    Corrupt,
    #[error("qcow2 image is dirty (lazy refcounts): serve it with --read-only or repair it with qemu-img check -r all")]
    Dirty,
    #[error("qcow2 compression type {0} is not supported (zlib = 0, zstd = 1)")]
    CompressionType(u8),
    #[error("qcow2 backing file name is not readable")]
    BackingName,
    #[error("qcow2 L1 table of {0} entries is too large or does not cover the image")]
    L1Size(u64),
    #[error("qcow2 L1 table offset {0:#x} is not cluster aligned or outside the file")]
    L1Offset(u64),
    #[error("cannot read the qcow2 L1 table")]
    ReadL1(#[source] io::Error),
    #[error("qcow2 refcount order {0} is invalid (0..=6: 1 to 64-bit refcounts)")]
    RefcountOrder(u32),
    #[error("qcow2 refcount table is outside the file or empty")]
    RefcountTable,
    #[error("qcow2 metadata is inconsistent ({0}): serve it with --read-only or repair it with qemu-img check -r all")]
    Metadata(&'static str),
}

/// The kind of compression for compressed clusters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Compression {
    Zlib,
    Zstd,
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

/// Errors while mapping: metadata that points somewhere impossible.
#[derive(Debug, thiserror::Error)]
pub enum MapError {
    #[error("I/O on the image file failed: {0}")]
    Io(#[source] io::Error),
    #[error("corrupt qcow2 metadata: {0}")]
    Corrupt(&'static str),
}

/// Fills a cluster buffer with the guest disk's current contents at a cluster-aligned guest
/// offset (through the backing chain): what a copy-on-write keeps around new data.
pub type FillOld<'a> = dyn FnMut(u64, &mut [u8]) -> Result<(), MapError> + 'a;

/// How [`Qcow2Image::zero_range`] treats whole clusters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ZeroMode {
    /// Zero flag, keeping an owned allocation (WRITE_ZEROES without unmap, detect-zeroes on).
    Keep,
    /// Zero flag, releasing the host cluster (WRITE_ZEROES with unmap and --discard unmap).
    Unmap,
    /// Unallocate (DISCARD with --discard unmap).
    Discard,
}

/// Compressed chunks packed in memory: `data` is the host cluster at `start`, filled up to
/// `used`; it reaches the file whole when full, or up to `used` (rounded up to the file's
/// alignment) before any L2 entry naming its chunks is written.
#[derive(Default)]
struct CompCache {
    on: bool,
    /// Bound of the run of host clusters held (`--compressed-cache-size`), in clusters.
    cap_clusters: usize,
    start: u64,
    data: Vec<u8>,
    used: usize,
    /// `data` has bytes the file does not.
    dirty: bool,
    /// A cache write failed: that data is lost, and every later FLUSH fails.
    failed: bool,
    /// Runs taken out of the cache and being written by the thread that filled them,
    /// outside the allocation lock: (file offset, bytes). Reads still find their chunks
    /// here; metadata write-back waits until they are in the file.
    writing: Vec<(u64, std::sync::Arc<Vec<u8>>)>,
    /// Writes of compressed data that reached the file, and their bytes.
    file_writes: u64,
    file_bytes: u64,
}

/// A run of compressed chunks taken out of the cache, to be written.
struct Run {
    start: u64,
    bytes: std::sync::Arc<Vec<u8>>,
}

/// A finished background extension: its end, and Ok or the errno.
type ExtensionDone = (u64, Result<(), i32>);

/// A thread that does preallocations (fallocate) for an image, so that queue threads never
/// wait for one; results wait in a mailbox for the next allocation to take them.
#[derive(Default)]
struct PreallocBg {
    tx: Mutex<Option<std::sync::mpsc::Sender<(u64, u64)>>>,
    done: std::sync::Arc<Mutex<Option<ExtensionDone>>>,
}

impl PreallocBg {
    fn spawn(&self, file: File) {
        let (tx, rx) = std::sync::mpsc::channel::<(u64, u64)>();
        let done = self.done.clone();
        let spawned = std::thread::Builder::new()
            .name("vublk-prealloc".into())
            .spawn(move || {
                // Ends when the image (and with it the sender) goes away.
                for (start, end) in rx {
                    let r = Storage::allocate(&file, start, end - start)
                        .map_err(|e| e.raw_os_error().unwrap_or(libc::EIO));
                    *done.lock().unwrap_or_else(|e| e.into_inner()) = Some((end, r));
                }
            });
        if spawned.is_ok() {
            *self.tx.lock().unwrap_or_else(|e| e.into_inner()) = Some(tx);
        }
    }

    fn active(&self) -> bool {
        self.tx.lock().unwrap_or_else(|e| e.into_inner()).is_some()
    }

    /// Hand an extension to the thread; false without one.
    fn start(&self, start: u64, end: u64) -> bool {
        self.tx
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .is_some_and(|tx| tx.send((start, end)).is_ok())
    }

    fn take_done(&self) -> Option<ExtensionDone> {
        self.done.lock().unwrap_or_else(|e| e.into_inner()).take()
    }

    /// Wait (at most 10 s) for the extension in flight.
    fn wait_done(&self) -> Option<ExtensionDone> {
        for _ in 0..10_000 {
            if let Some(d) = self.take_done() {
                return Some(d);
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        None
    }
}

/// Where a write planned into fresh clusters goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FreshWrite {
    /// Host offset of the write's first byte.
    pub host: u64,
    /// Write the new clusters whole instead: zeroes around the data. The caller must call
    /// [`Qcow2Image::end_fill`] with `key` when that write has completed.
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
}

/// A whole-cluster first write of fresh clusters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fill {
    pub key: u64,
    /// Host range of the new clusters.
    pub start: u64,
    pub len: u64,
}

/// A change to one cluster's refcount.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum RefChange {
    Set(u64),
    Inc,
    Dec,
}

/// Allocation state of a writable image. Metadata is written back, not through: refcount
/// chunks and L2 entries change in memory and reach the file in dependency order on
/// [`Qcow2Image::flush`] (refcount increases, barrier, L2 tables, barrier, then the
/// decrements those L2 changes allow), or earlier when the caches fill up.
struct WriteState {
    refcount_table: Vec<u64>,
    refcount_table_offset: u64,
    /// log2 of the refcount width in bits (0..=6).
    refcount_order: u32,
    /// Next cluster to allocate: the end of the file (clusters freed are leaked for now).
    next_free: u64,
    /// The file is known to be at least this long.
    covered: u64,
    /// Where the scan for free clusters resumes (every cluster below it is in use).
    free_cursor: u64,
    /// No run of free clusters longer than this exists (until something is freed).
    free_run_hint: u64,
    /// Where the next compressed chunk goes: the end of the last one, inside a host cluster
    /// that holds compressed chunks (0: start a new host cluster).
    comp_pos: u64,
    /// Preallocation ahead of the end of the file (None: off, writes extend the file).
    prealloc: Option<crate::image::prealloc::Prealloc>,
    /// Refcount block chunks (min(4 KiB, cluster) each) by file offset: the current contents.
    refcount_chunks: std::collections::HashMap<u64, Vec<u8>>,
    /// Chunks of `refcount_chunks` that differ from the file. They only ever hold increases
    /// or decreases whose L2 change is already durable, so they may be written at any time.
    dirty_chunks: std::collections::BTreeSet<u64>,
    /// Host clusters that lost a reference in an L2 change not yet durable: decremented
    /// after the L2 tables are written and synced (a crash before leaks, never corrupts).
    pending_decs: Vec<u64>,
}

/// One cached L2 table.
struct L2Table {
    offset: u64,
    entries: Vec<u64>,
    /// Per metadata chunk: differs from the file.
    dirty: Vec<bool>,
}

impl L2Table {
    fn is_dirty(&self) -> bool {
        self.dirty.iter().any(|&d| d)
    }
}

struct L2Cache {
    /// Most recently used at the back. Dirty tables are never evicted without being written.
    tables: VecDeque<L2Table>,
    capacity: usize,
}

impl L2Cache {
    fn dirty_tables(&self) -> usize {
        self.tables.iter().filter(|t| t.is_dirty()).count()
    }

    /// Drop the least recently used clean table if the cache is full; false if every
    /// table is dirty (the caller writes them back first, or does not cache).
    fn make_room(&mut self) -> bool {
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

/// An open qcow2 image.
pub struct Qcow2Image {
    pub version: u32,
    cluster_bits: u32,
    l2_bits: u32,
    pub size_bytes: u64,
    /// Grows as clusters are allocated.
    file_size: std::sync::atomic::AtomicU64,
    l1: std::sync::RwLock<Vec<u64>>,
    l1_offset: u64,
    /// Present when opened writable: allocation state, behind one lock.
    write: Option<Mutex<WriteState>>,
    /// Clusters holding metadata (header, tables, L2 tables, refcount blocks): a data write
    /// must never land in one (a hostile image could point an L2 entry at its own metadata).
    metadata: std::sync::RwLock<std::collections::HashSet<u64>>,
    pub compression: Compression,
    /// The backing file name as stored in the header (relative to the image's directory).
    pub backing_file: Option<String>,
    l2_cache: Mutex<L2Cache>,
    /// Host ranges of fresh clusters whose first, whole-cluster write is in flight (held
    /// exclusively; in-place writes take shared ranges while any fill is in flight).
    pub fills: crate::io::ranges::RangeLocks,
    /// Fills in flight (counted before their L2 entries become visible).
    pub fills_in_flight: std::sync::atomic::AtomicU64,
    /// Synchronous writers waiting for fills to drain: no new fills start meanwhile.
    pub fill_gate: std::sync::atomic::AtomicU64,
    /// Data clusters allocated from free space (refcount 0) instead of the end of the file.
    pub reused_clusters: std::sync::atomic::AtomicU64,
    /// Guest clusters being copied on write without the allocation lock (their new cluster
    /// is allocated, its L2 entry not yet installed); locked after the allocation state.
    cow_in_flight: Mutex<std::collections::HashSet<u64>>,
    /// Signalled when a guest cluster leaves `cow_in_flight`.
    cow_done: std::sync::Condvar,
    /// Copy-on-writes done without the allocation lock.
    pub cow_unlocked: std::sync::atomic::AtomicU64,
    /// The compressed-write cache (`--compressed-cache on`): the host cluster being packed.
    /// Locked after the allocation state, never before it.
    comp_cache: Mutex<CompCache>,
    /// Signalled when a run leaves `CompCache::writing`.
    comp_written: std::sync::Condvar,
    /// `--compress-writes on`: clusters written whole are stored compressed.
    compress_writes: std::sync::atomic::AtomicBool,
    /// Clusters stored compressed, and written normally because they did not compress.
    pub compress_stats: (std::sync::atomic::AtomicU64, std::sync::atomic::AtomicU64),
    /// The background preallocation thread, when there is one.
    prealloc_bg: PreallocBg,
    /// Preallocations done and skipped.
    prealloc_stats: (std::sync::atomic::AtomicU64, std::sync::atomic::AtomicU64),
    /// Punch the host range of clusters whose refcount drops to 0 (`--discard unmap`).
    punch_freed: std::sync::atomic::AtomicBool,
}

impl std::fmt::Debug for Qcow2Image {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Qcow2Image")
            .field("version", &self.version)
            .field("cluster_bits", &self.cluster_bits)
            .field("size_bytes", &self.size_bytes)
            .finish()
    }
}

fn be32(b: &[u8], off: usize) -> u32 {
    u32::from_be_bytes([b[off], b[off + 1], b[off + 2], b[off + 3]])
}

fn be64(b: &[u8], off: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[off..off + 8]);
    u64::from_be_bytes(a)
}

/// Does the file start with the qcow2 magic? (Aligned read: the file may be O_DIRECT.)
pub fn probe(file: &dyn Storage) -> bool {
    read_aligned(file, 0, 4).is_ok_and(|m| m == MAGIC)
}

impl Qcow2Image {
    /// Open and validate with the default L2 cache size.
    pub fn open(file: &dyn Storage, writable: bool) -> Result<Self, Qcow2Error> {
        Self::open_with_cache(file, writable, None)
    }

    /// The default L2 cache for an image: [`DEFAULT_L2_CACHE_BYTES`], or enough for
    /// [`DEFAULT_L2_COVERAGE`] when that is more, capped at all of the image's L2 tables.
    pub fn default_l2_cache_bytes(cluster_bits: u32, size_bytes: u64) -> u64 {
        let coverage = DEFAULT_L2_COVERAGE >> (cluster_bits - 3);
        let whole_image = size_bytes.div_ceil(1 << cluster_bits) * 8;
        DEFAULT_L2_CACHE_BYTES
            .max(coverage)
            .min(whole_image.next_multiple_of(1 << cluster_bits))
    }

    /// Open and validate. `file` may be opened O_DIRECT: metadata is read with aligned
    /// buffers. `l2_cache_bytes`: the L2 cache bound (None: the default); at least 4 tables.
    pub fn open_with_cache(
        file: &dyn Storage,
        writable: bool,
        l2_cache_bytes: Option<u64>,
    ) -> Result<Self, Qcow2Error> {
        let file_size = file.size().map_err(Qcow2Error::ReadHeader)?;
        let hdr = read_aligned(file, 0, 4096).map_err(Qcow2Error::ReadHeader)?;
        if hdr.len() < 72 || hdr[0..4] != MAGIC {
            return Err(Qcow2Error::BadMagic);
        }
        let version = be32(&hdr, 4);
        if version != 2 && version != 3 {
            return Err(Qcow2Error::Version(version));
        }
        let backing_offset = be64(&hdr, 8);
        let backing_len = be32(&hdr, 16) as usize;
        let cluster_bits = be32(&hdr, 20);
        if !(9..=21).contains(&cluster_bits) {
            return Err(Qcow2Error::ClusterBits(cluster_bits));
        }
        let size_bytes = be64(&hdr, 24);
        if be32(&hdr, 32) != 0 {
            return Err(Qcow2Error::Encrypted);
        }
        let l1_size = u64::from(be32(&hdr, 36));
        let l1_offset = be64(&hdr, 40);
        let mut compression = Compression::Zlib;
        if version == 3 {
            if hdr.len() < 104 {
                return Err(Qcow2Error::BadMagic);
            }
            let incompat = be64(&hdr, 72);
            if incompat & !INCOMPAT_KNOWN != 0 {
                return Err(Qcow2Error::UnknownFeatures(incompat & !INCOMPAT_KNOWN));
            }
            if incompat & INCOMPAT_DATA_FILE != 0 {
                return Err(Qcow2Error::ExternalDataFile);
            }
            if incompat & INCOMPAT_EXTL2 != 0 {
                return Err(Qcow2Error::ExtendedL2);
            }
            if writable && incompat & INCOMPAT_CORRUPT != 0 {
                return Err(Qcow2Error::Corrupt);
            }
            if writable && incompat & INCOMPAT_DIRTY != 0 {
                return Err(Qcow2Error::Dirty);
            }
            let header_len = be32(&hdr, 100) as usize;
            if incompat & INCOMPAT_COMPRESSION != 0 {
                if header_len < 105 {
                    return Err(Qcow2Error::BadMagic);
                }
                compression = match hdr[104] {
                    0 => Compression::Zlib,
                    1 => Compression::Zstd,
                    t => return Err(Qcow2Error::CompressionType(t)),
                };
            }
        }
        let backing_file = if backing_offset != 0 {
            // The spec bounds the name to 1023 bytes; it lives in the first cluster.
            let name = usize::try_from(backing_offset)
                .ok()
                .filter(|_| backing_len > 0 && backing_len <= 1023)
                .and_then(|o| hdr.get(o..o.checked_add(backing_len)?))
                .ok_or(Qcow2Error::BackingName)?;
            Some(String::from_utf8(name.to_vec()).map_err(|_| Qcow2Error::BackingName)?)
        } else {
            None
        };
        let cluster_size = 1u64 << cluster_bits;
        let l2_bits = cluster_bits - 3;
        let per_l1 = 1u64 << (cluster_bits + l2_bits);
        let needed = size_bytes.div_ceil(per_l1);
        if l1_size * 8 > MAX_L1_BYTES || l1_size < needed {
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
        let raw = if l1_size > 0 {
            read_aligned(file, l1_offset, (l1_size * 8) as usize).map_err(Qcow2Error::ReadL1)?
        } else {
            Vec::new()
        };
        let l1 = raw.chunks_exact(8).map(|c| be64(c, 0)).collect();
        let refcount_order = if version == 3 { be32(&hdr, 96) } else { 4 };
        if refcount_order > 6 {
            return Err(Qcow2Error::RefcountOrder(refcount_order));
        }
        let write = if writable {
            let rt_offset = be64(&hdr, 48);
            let rt_clusters = u64::from(be32(&hdr, 56));
            if rt_offset % cluster_size != 0
                || rt_clusters == 0
                || rt_clusters * cluster_size > MAX_L1_BYTES
                || rt_offset + rt_clusters * cluster_size > file_size
            {
                return Err(Qcow2Error::RefcountTable);
            }
            let rt = read_aligned(file, rt_offset, (rt_clusters * cluster_size) as usize)
                .map_err(Qcow2Error::ReadL1)?;
            Some(Mutex::new(WriteState {
                refcount_table: rt.chunks_exact(8).map(|c| be64(c, 0)).collect(),
                refcount_table_offset: rt_offset,
                refcount_order,
                next_free: file_size.next_multiple_of(cluster_size),
                covered: file_size,
                prealloc: None,
                comp_pos: 0,
                free_cursor: 0,
                free_run_hint: u64::MAX,
                refcount_chunks: std::collections::HashMap::new(),
                dirty_chunks: std::collections::BTreeSet::new(),
                pending_decs: Vec::new(),
            }))
        } else {
            None
        };
        let cache_bytes = l2_cache_bytes
            .unwrap_or_else(|| Self::default_l2_cache_bytes(cluster_bits, size_bytes));
        let capacity = (cache_bytes >> cluster_bits).clamp(4, 1 << 22) as usize;
        // Clusters holding metadata. Ranges are clamped to the file, so a hostile header
        // cannot make this set large; a read-write open refuses tables that overlap.
        let mut metadata = std::collections::HashSet::new();
        let file_end = file_size.next_multiple_of(cluster_size);
        let mut add_range = |off: u64, len: u64| -> bool {
            let end = off.saturating_add(len).min(file_end);
            let mut overlap = false;
            let mut c = off & !(cluster_size - 1);
            while c < end {
                overlap |= !metadata.insert(c);
                c += cluster_size;
            }
            overlap
        };
        add_range(0, cluster_size);
        if add_range(l1_offset, l1_size * 8) && writable {
            return Err(Qcow2Error::Metadata("the L1 table overlaps the header"));
        }
        let rt_len = u64::from(be32(&hdr, 56)) * cluster_size;
        if rt_len <= MAX_L1_BYTES && add_range(be64(&hdr, 48), rt_len) && writable {
            return Err(Qcow2Error::Metadata(
                "the refcount table overlaps the header or the L1 table",
            ));
        }
        for e in raw.chunks_exact(8).map(|c| be64(c, 0)) {
            let l2 = e & L1_OFFSET_MASK;
            if l2 == 0 {
                continue;
            }
            let inside = l2 % cluster_size == 0 && l2 + cluster_size <= file_end;
            if add_range(l2, cluster_size) && writable {
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
        if writable {
            // Internal snapshots: their table and their L1 tables are metadata too (QEMU's
            // default overlap checks); a data write must never land on them.
            let nb = be32(&hdr, 60);
            let table = be64(&hdr, 64);
            if nb > MAX_SNAPSHOTS {
                return Err(Qcow2Error::Metadata("more than 65536 internal snapshots"));
            }
            let mut pos = table;
            for _ in 0..nb {
                if pos % 8 != 0 || pos.saturating_add(40) > file_size {
                    return Err(Qcow2Error::Metadata(
                        "the snapshot table is unaligned or outside the file",
                    ));
                }
                let e = read_aligned(file, pos, 40).map_err(Qcow2Error::ReadL1)?;
                let (l1, l1_len) = (be64(&e, 0), u64::from(be32(&e, 8)) * 8);
                if l1 % cluster_size != 0
                    || l1_len > MAX_L1_BYTES
                    || l1.saturating_add(l1_len) > file_end
                {
                    return Err(Qcow2Error::Metadata(
                        "a snapshot's L1 table is unaligned or outside the file",
                    ));
                }
                if add_range(l1, l1_len) {
                    return Err(Qcow2Error::Metadata(
                        "a snapshot's L1 table overlaps other metadata",
                    ));
                }
                let extra = u64::from(be32(&e, 36));
                let names = u64::from(u16::from_be_bytes([e[12], e[13]]))
                    + u64::from(u16::from_be_bytes([e[14], e[15]]));
                pos = (pos + 40 + extra + names).next_multiple_of(8);
            }
            if nb > 0 && add_range(table, pos - table) {
                return Err(Qcow2Error::Metadata(
                    "the snapshot table overlaps other metadata",
                ));
            }
        }
        if let Some(ws) = &write {
            let ws = ws.lock().unwrap_or_else(|e| e.into_inner());
            for &rb in ws.refcount_table.iter().filter(|&&rb| rb != 0) {
                if rb % cluster_size != 0 || rb.saturating_add(cluster_size) > file_end {
                    return Err(Qcow2Error::Metadata(
                        "a refcount block is unaligned or outside the file",
                    ));
                }
                if add_range(rb, cluster_size) {
                    return Err(Qcow2Error::Metadata(
                        "a refcount block overlaps other metadata",
                    ));
                }
            }
        }
        let img = Qcow2Image {
            version,
            cluster_bits,
            l2_bits,
            size_bytes,
            file_size: std::sync::atomic::AtomicU64::new(file_size),
            l1: std::sync::RwLock::new(l1),
            l1_offset,
            write,
            metadata: std::sync::RwLock::new(metadata),
            compression,
            backing_file,
            punch_freed: std::sync::atomic::AtomicBool::new(false),
            prealloc_stats: Default::default(),
            prealloc_bg: Default::default(),
            compress_writes: std::sync::atomic::AtomicBool::new(false),
            comp_written: std::sync::Condvar::new(),
            comp_cache: Mutex::new(CompCache {
                cap_clusters: DEFAULT_COMPRESSED_CACHE_CLUSTERS,
                ..CompCache::default()
            }),
            compress_stats: Default::default(),
            reused_clusters: std::sync::atomic::AtomicU64::new(0),
            cow_in_flight: Mutex::new(std::collections::HashSet::new()),
            cow_done: std::sync::Condvar::new(),
            cow_unlocked: std::sync::atomic::AtomicU64::new(0),
            fills: Default::default(),
            fills_in_flight: std::sync::atomic::AtomicU64::new(0),
            fill_gate: std::sync::atomic::AtomicU64::new(0),
            l2_cache: Mutex::new(L2Cache {
                tables: VecDeque::with_capacity(capacity),
                capacity,
            }),
        };
        img.find_data_end(file)?;
        Ok(img)
    }

    /// A read-write open after a crash may find a tail past the last cluster in use (space
    /// preallocated, or data whose metadata never reached the file): nothing references it,
    /// so it is truncated and allocation starts after the last cluster with a refcount.
    /// Bounded: looks at most at 1 Mi clusters from the end.
    fn find_data_end(&self, file: &dyn Storage) -> Result<(), Qcow2Error> {
        let Some(ws) = self.write.as_ref() else {
            return Ok(());
        };
        let mut ws = ws.lock().unwrap_or_else(|e| e.into_inner());
        let c = self.cluster_size();
        let mut end = ws.next_free;
        let mut looked = 0;
        while end > c && looked < (1 << 20) {
            let cl = end - c;
            let rc = self
                .get_refcount(&mut ws, file, cl)
                .map_err(|e| Qcow2Error::ReadL1(io::Error::other(e.to_string())))?;
            if rc != 0 || self.is_metadata(cl) {
                break;
            }
            end = cl;
            looked += 1;
        }
        // Refcounts say the tail is free; never cut off what an L2 entry still points at (an
        // image with broken refcounts). Bounded: with more L2 tables than this, keep the tail.
        if end < ws.next_free {
            let l1: Vec<u64> = self.l1.read().unwrap_or_else(|e| e.into_inner()).clone();
            let tables: Vec<u64> = l1
                .iter()
                .map(|e| e & L1_OFFSET_MASK)
                .filter(|&t| t != 0)
                .collect();
            if tables.len() > MAX_TAIL_SCAN_TABLES {
                end = ws.next_free;
            }
            for &t in tables.iter().take(MAX_TAIL_SCAN_TABLES) {
                if t + c > self.file_len() {
                    continue;
                }
                let Ok(entries) = self.read_l2(file, t) else {
                    end = ws.next_free;
                    break;
                };
                for e in entries {
                    let last = if e & L2_COMPRESSED != 0 {
                        let x = 62 - (self.cluster_bits - 8);
                        let host = e & ((1u64 << x) - 1);
                        let sectors = ((e & !L2_COMPRESSED) >> x) + 1;
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
        // Cut the tail off now: a new cluster must read as zeroes wherever it is not written
        // (stale data from before the crash must not show through).
        let len = file.size().map_err(Qcow2Error::ReadHeader)?;
        if len > end {
            file.set_len(end).map_err(Qcow2Error::ReadHeader)?;
            ws.covered = end;
        }
        ws.next_free = end;
        self.file_size
            .store(end, std::sync::atomic::Ordering::Release);
        Ok(())
    }

    fn is_metadata(&self, host_cluster: u64) -> bool {
        self.metadata
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .contains(&host_cluster)
    }

    fn note_metadata(&self, host_cluster: u64) {
        self.metadata
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(host_cluster);
    }

    /// Metadata is rewritten in blocks of this size: never more than one cluster.
    fn meta_chunk(&self) -> u64 {
        self.cluster_size().min(4096)
    }

    fn file_len(&self) -> u64 {
        self.file_size.load(std::sync::atomic::Ordering::Acquire)
    }

    pub fn cluster_size(&self) -> u64 {
        1 << self.cluster_bits
    }

    /// Index of `guest_offset`'s cluster in its L2 table.
    fn l2_index(&self, guest_offset: u64) -> usize {
        ((guest_offset >> self.cluster_bits) & ((1 << self.l2_bits) - 1)) as usize
    }

    /// The (validated) L2 table offset for `guest_offset`; None when the L1 entry is empty.
    fn l2_table_offset(&self, guest_offset: u64) -> Result<Option<u64>, MapError> {
        let l1_index = (guest_offset >> (self.cluster_bits + self.l2_bits)) as usize;
        let Some(l1e) = self
            .l1
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(l1_index)
            .copied()
        else {
            return Err(MapError::Corrupt("guest offset beyond the L1 table"));
        };
        let l2_offset = l1e & L1_OFFSET_MASK;
        if l2_offset == 0 {
            return Ok(None);
        }
        let cluster = self.cluster_size();
        if l2_offset % cluster != 0 || l2_offset + cluster > self.file_len() {
            return Err(MapError::Corrupt(
                "L2 table offset unaligned or outside the file",
            ));
        }
        Ok(Some(l2_offset))
    }

    fn read_l2(&self, file: &dyn Storage, l2_offset: u64) -> Result<Vec<u64>, MapError> {
        let raw =
            read_aligned(file, l2_offset, self.cluster_size() as usize).map_err(MapError::Io)?;
        Ok(raw.chunks_exact(8).map(|c| be64(c, 0)).collect())
    }

    fn new_table(&self, offset: u64, entries: Vec<u64>) -> L2Table {
        let chunks = (self.cluster_size() / self.meta_chunk()) as usize;
        L2Table {
            offset,
            entries,
            dirty: vec![false; chunks],
        }
    }

    /// The L2 entry for the cluster containing `guest_offset` (0 = unallocated): from the
    /// cache (which holds entries not yet written back), else from the file.
    fn l2_entry(&self, file: &dyn Storage, guest_offset: u64) -> Result<u64, MapError> {
        let l2_index = self.l2_index(guest_offset);
        let Some(l2_offset) = self.l2_table_offset(guest_offset)? else {
            return Ok(0);
        };
        let mut cache = self.l2_cache.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(pos) = cache.tables.iter().position(|t| t.offset == l2_offset) {
            let t = cache.tables.remove(pos).expect("position is valid");
            let e = t.entries[l2_index];
            cache.tables.push_back(t);
            return Ok(e);
        }
        // Loaded under the cache lock, so a writer cannot change the table in between.
        let entries = self.read_l2(file, l2_offset)?;
        let e = entries[l2_index];
        if cache.make_room() {
            cache.tables.push_back(self.new_table(l2_offset, entries));
        }
        Ok(e)
    }

    /// Map [offset, offset + len) of the guest disk to extents, in order, merging
    /// contiguous data. The caller checked the range is inside the image.
    pub fn map(
        &self,
        file: &dyn Storage,
        offset: u64,
        len: u64,
        out: &mut Vec<Extent>,
    ) -> Result<(), MapError> {
        out.clear();
        let cluster = self.cluster_size();
        let mut pos = offset;
        let end = offset + len;
        while pos < end {
            let in_cluster = pos & (cluster - 1);
            let n = (cluster - in_cluster).min(end - pos);
            let e = self.l2_entry(file, pos)?;
            let ext = if e & L2_COMPRESSED != 0 {
                // Compressed descriptor: x = 62 - (cluster_bits - 8) offset bits, then the
                // number of additional 512-byte sectors.
                let x = 62 - (self.cluster_bits - 8);
                let host_offset = e & ((1u64 << x) - 1);
                let sectors = ((e & !L2_COMPRESSED) >> x) + 1;
                let compressed_len = (sectors * 512).saturating_sub(host_offset & 511);
                let file_size = self.file_len();
                if host_offset >= file_size {
                    return Err(MapError::Corrupt("compressed cluster outside the file"));
                }
                Extent::Compressed {
                    host_offset,
                    compressed_len: compressed_len.min(file_size - host_offset),
                    skip: in_cluster,
                    len: n,
                }
            } else {
                let host = e & L2_OFFSET_MASK;
                if e & L2_ZERO != 0 && self.version >= 3 {
                    Extent::Zero { len: n }
                } else if host == 0 {
                    Extent::Unallocated { len: n }
                } else {
                    if host % cluster != 0
                        || host + cluster > self.file_len().next_multiple_of(cluster)
                    {
                        return Err(MapError::Corrupt(
                            "data cluster unaligned or outside the file",
                        ));
                    }
                    Extent::Data {
                        host_offset: host + in_cluster,
                        len: n,
                    }
                }
            };
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
            pos += n;
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
    ) -> Result<Option<u64>, MapError> {
        let c = self.cluster_size();
        let mut pos = offset;
        let end = offset + len;
        let mut start_host = None;
        while pos < end {
            let cl_start = pos & !(c - 1);
            let e = self.l2_entry(file, cl_start)?;
            let host = e & L2_OFFSET_MASK;
            if e & L2_COMPRESSED != 0 || e & L2_COPIED == 0 || e & L2_ZERO != 0 || host == 0 {
                return Ok(None);
            }
            if self.is_metadata(host) {
                return Err(MapError::Corrupt("a data cluster overlaps metadata"));
            }
            let here = host + (pos - cl_start);
            match start_host {
                None => start_host = Some(here),
                Some(h) if h + (pos - offset) != here => return Ok(None),
                Some(_) => {}
            }
            pos = cl_start + c;
        }
        Ok(start_host)
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
    ) -> Result<(), MapError> {
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
            let Some(ws) = self.write.as_ref() else {
                return Err(MapError::Corrupt("image is read-only"));
            };
            let mut ws = ws.lock().unwrap_or_else(|e| e.into_inner());
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

    /// Is the image open for writing?
    pub fn writable(&self) -> bool {
        self.write.is_some()
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
    ) -> Result<Option<FreshWrite>, MapError> {
        let Some(ws) = self.write.as_ref() else {
            return Ok(None);
        };
        if len == 0 {
            return Ok(None);
        }
        let mut ws = ws.lock().unwrap_or_else(|e| e.into_inner());
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
                if !whole || self.fill_gate.load(std::sync::atomic::Ordering::SeqCst) > 0 {
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
                self.reused_clusters
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                h
            }
            None => {
                let first = ws.next_free;
                ws.next_free += n * c;
                self.file_size
                    .fetch_max(ws.next_free, std::sync::atomic::Ordering::AcqRel);
                for k in 0..n {
                    self.set_refcount(&mut ws, file, first + k * c, RefChange::Set(1))?;
                }
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
        if reused.is_none() && !whole && offset != first_cl {
            // Counted before the gate is checked (both sequentially consistent): a writer
            // that raises the gate and then waits for the count either sees this fill or
            // stops it.
            self.fills_in_flight
                .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let (start, end) = (first, first + n * c);
            let key = if self.fill_gate.load(std::sync::atomic::Ordering::SeqCst) > 0 {
                None
            } else {
                self.fills
                    .try_acquire(start, end, crate::io::ranges::Holder::Rmw)
            };
            match key {
                Some(key) => {
                    fill = Some(Fill {
                        key,
                        start,
                        len: end - start,
                    })
                }
                None => {
                    self.fills_in_flight
                        .fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
                }
            }
        }
        if defer {
            // Counted as a fill so that synchronous writers drain it first; writers of these
            // guest clusters wait for the install.
            let mut busy = self.cow_in_flight.lock().unwrap_or_else(|e| e.into_inner());
            for k in 0..n {
                busy.insert(first_cl + k * c);
            }
            drop(busy);
            self.fills_in_flight
                .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            return Ok(Some(FreshWrite {
                host: first,
                fill: None,
                install: Some(CowInstall {
                    guest: first_cl,
                    clusters: n,
                    host: first,
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
    ) -> Result<(), MapError> {
        let Some(ws) = self.write.as_ref() else {
            return Err(MapError::Corrupt("image is read-only"));
        };
        let c = self.cluster_size();
        let mut ws = ws.lock().unwrap_or_else(|e| e.into_inner());
        let r = (|| -> Result<(), MapError> {
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
        let mut busy = self.cow_in_flight.lock().unwrap_or_else(|e| e.into_inner());
        for k in 0..install.clusters {
            busy.remove(&(install.guest + k * c));
        }
        drop(busy);
        self.cow_done.notify_all();
        self.fills_in_flight
            .fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
        r?;
        self.maybe_write_back(&mut ws, file)
    }

    /// Store clusters written whole compressed (`--compress-writes on`).
    pub fn set_compress_writes(&self, on: bool) {
        self.compress_writes
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }

    pub fn compress_writes(&self) -> bool {
        self.compress_writes
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// A cluster compressed with the image's compression type, if that comes out below the
    /// cluster size (chunks are packed byte by byte). zlib: raw deflate with QEMU's
    /// parameters (default level, 4 KiB window, memLevel 9; QEMU inflates with a 4 KiB
    /// window), through zlib-rs, the fastest implementation that can limit the window (see
    /// contrib/deflate-cmp); zstd: one frame, the default level, a context per thread.
    pub fn compress_cluster(&self, data: &[u8]) -> Option<Vec<u8>> {
        let limit = data.len().saturating_sub(1);
        let out = match self.compression {
            Compression::Zlib => {
                let config = zlib_rs::DeflateConfig {
                    level: 6,
                    method: zlib_rs::Method::Deflated,
                    window_bits: -12,
                    mem_level: 9,
                    strategy: zlib_rs::Strategy::Default,
                };
                // Output that does not fit below the limit is not worth storing compressed:
                // deflate stops as soon as the buffer is full.
                let mut out = vec![0u8; limit];
                let (z, rc) = zlib_rs::compress_slice(&mut out, data, config);
                if rc != zlib_rs::ReturnCode::Ok {
                    return None;
                }
                let n = z.len();
                out.truncate(n);
                out
            }
            Compression::Zstd => {
                thread_local! {
                    static ZSTD: std::cell::RefCell<Option<zstd::bulk::Compressor<'static>>> =
                        const { std::cell::RefCell::new(None) };
                }
                ZSTD.with(|z| {
                    let mut z = z.borrow_mut();
                    if z.is_none() {
                        *z = zstd::bulk::Compressor::new(0).ok();
                    }
                    let mut out = Vec::with_capacity(limit);
                    z.as_mut()?.compress_to_buffer(data, &mut out).ok()?;
                    Some(out)
                })?
            }
        };
        (out.len() <= limit && !out.is_empty()).then_some(out)
    }

    /// Place a compressed chunk and write it (or keep it in the cache): right after the
    /// previous chunk when it fits in the same host cluster, which then counts one more
    /// reference; with the cache, a chunk may also spill into the next host cluster when that
    /// one is allocated right after it; else it starts a new host cluster at the end of the
    /// file. Returns the chunk's host offset.
    fn place_compressed(
        &self,
        ws: &mut WriteState,
        file: &dyn Storage,
        z: &[u8],
        runs: &mut Vec<Run>,
    ) -> Result<u64, MapError> {
        let c = self.cluster_size();
        let len = z.len() as u64;
        let bits = 1u32 << ws.refcount_order;
        let max = if bits == 64 {
            u64::MAX
        } else {
            (1u64 << bits) - 1
        };
        let pos = ws.comp_pos;
        let cur = pos & !(c - 1);
        // Narrow refcounts (1 bit) cannot count another chunk in the same cluster.
        let can_share = pos % c != 0 && self.get_refcount(ws, file, cur)? < max;
        let mut cache = self.comp_cache.lock().unwrap_or_else(|e| e.into_inner());
        if !cache.on {
            drop(cache);
            let host = if can_share && pos + len <= cur + c {
                self.set_refcount(ws, file, cur, RefChange::Inc)?;
                pos
            } else if can_share && ws.next_free == cur + c {
                // Spill into the next cluster: allocation takes `next_free` first, so the
                // new cluster is the adjacent one.
                self.set_refcount(ws, file, cur, RefChange::Inc)?;
                self.alloc_cluster(ws, file)?;
                pos
            } else {
                self.alloc_cluster(ws, file)?
            };
            ws.comp_pos = host + len;
            write_unaligned(file, host, z, self.meta_chunk()).map_err(MapError::Io)?;
            let mut cache = self.comp_cache.lock().unwrap_or_else(|e| e.into_inner());
            cache.file_writes += 1;
            cache.file_bytes += len;
            return Ok(host);
        }
        if cache.failed {
            return Err(MapError::Io(io::Error::other(
                "an earlier compressed-cache write failed",
            )));
        }
        // The cache holds a run of contiguous host clusters: every one but the last is full.
        let c_us = c as usize;
        let cap = cache.cap_clusters.max(1) * c_us;
        let cache_end = cache.start + cache.data.len() as u64;
        let cached = can_share && !cache.data.is_empty() && cache_end == cur + c;
        if cached && pos + len <= cur + c {
            self.set_refcount(ws, file, cur, RefChange::Inc)?;
            let at = (pos - cache.start) as usize;
            cache.data[at..at + len as usize].copy_from_slice(z);
            cache.used = at + len as usize;
            cache.dirty = true;
            ws.comp_pos = pos + len;
            if pos + len == cur + c && cache.data.len() >= cap {
                // Full: the whole run goes to the file as one aligned write.
                runs.extend(Self::take_run(&mut cache, c));
                ws.comp_pos = 0;
            }
            return Ok(pos);
        }
        if cached && ws.next_free == cur + c {
            // Spill: the end of this cluster, then the start of the next one.
            self.set_refcount(ws, file, cur, RefChange::Inc)?;
            let room = (cur + c - pos) as usize;
            let at = (pos - cache.start) as usize;
            cache.data[at..at + room].copy_from_slice(&z[..room]);
            cache.used = at + room;
            cache.dirty = true;
            let next = self.alloc_cluster(ws, file)?;
            if next != cur + c || cache.data.len() >= cap {
                // The run is full (or, defensively, the next cluster is not adjacent).
                runs.extend(Self::take_run(&mut cache, c));
                cache.data.resize(c_us, 0);
                cache.start = next;
                cache.used = 0;
            } else {
                let grown = cache.data.len() + c_us;
                cache.data.resize(grown, 0);
            }
            let at = (next - cache.start) as usize;
            cache.data[at..at + z.len() - room].copy_from_slice(&z[room..]);
            cache.used = at + z.len() - room;
            cache.dirty = true;
            ws.comp_pos = next + (z.len() - room) as u64;
            return Ok(pos);
        }
        // A new host cluster: appended to the run when it is adjacent and there is room,
        // else the run (its unfinished last cluster rounded up) goes to the file first.
        let host = self.alloc_cluster(ws, file)?;
        let end = cache.start + cache.data.len() as u64;
        if cache.data.is_empty() || host != end || cache.data.len() >= cap {
            runs.extend(Self::take_run(&mut cache, self.meta_chunk()));
            cache.start = host;
        }
        let at = (host - cache.start) as usize;
        cache.data.resize(at + c_us, 0);
        cache.data[at..at + z.len()].copy_from_slice(z);
        cache.used = at + z.len();
        cache.dirty = true;
        ws.comp_pos = host + len;
        Ok(host)
    }

    /// Take the cached run out of the cache (up to what is used, rounded up to `align`) for
    /// the caller to write once it has dropped the allocation lock; the cache is empty after.
    fn take_run(cache: &mut CompCache, align: u64) -> Option<Run> {
        let data = std::mem::take(&mut cache.data);
        if !cache.dirty || data.is_empty() {
            return None;
        }
        cache.dirty = false;
        let n = (cache.used as u64)
            .next_multiple_of(align)
            .min(data.len() as u64) as usize;
        let mut data = data;
        data.truncate(n);
        let bytes = std::sync::Arc::new(data);
        cache.writing.push((cache.start, bytes.clone()));
        Some(Run {
            start: cache.start,
            bytes,
        })
    }

    /// Write runs taken by [`Self::take_run`] (without the allocation lock held).
    fn write_runs(&self, file: &dyn Storage, runs: Vec<Run>) -> Result<(), MapError> {
        let mut result = Ok(());
        for run in runs {
            let r = write_all_aligned(file, run.start, &run.bytes);
            let mut cache = self.comp_cache.lock().unwrap_or_else(|e| e.into_inner());
            cache
                .writing
                .retain(|(_, b)| !std::sync::Arc::ptr_eq(b, &run.bytes));
            match r {
                Ok(()) => {
                    cache.file_writes += 1;
                    cache.file_bytes += run.bytes.len() as u64;
                }
                Err(e) => {
                    log::error!(
                        "compressed-write cache: writing {} bytes at {:#x} failed ({e}); the \
                         compressed clusters in it are lost and every later FLUSH fails",
                        run.bytes.len(),
                        run.start
                    );
                    cache.failed = true;
                    result = Err(MapError::Io(e));
                }
            }
            drop(cache);
            self.comp_written.notify_all();
        }
        result
    }

    /// Write the cached run up to what is used, rounded up to `align`.
    fn write_cache(cache: &mut CompCache, file: &dyn Storage, align: u64) -> Result<(), MapError> {
        if !cache.dirty || cache.data.is_empty() {
            return Ok(());
        }
        let n = (cache.used as u64)
            .next_multiple_of(align)
            .min(cache.data.len() as u64) as usize;
        match write_all_aligned(file, cache.start, &cache.data[..n]) {
            Ok(()) => {
                cache.dirty = false;
                cache.file_writes += 1;
                cache.file_bytes += n as u64;
                Ok(())
            }
            Err(e) => {
                log::error!(
                    "compressed-write cache: writing {n} bytes at {:#x} failed ({e}); the \
                     compressed clusters in it are lost and every later FLUSH fails",
                    cache.start
                );
                cache.failed = true;
                Err(MapError::Io(e))
            }
        }
    }

    /// `--compressed-cache on|off`.
    pub fn set_compressed_cache(&self, on: bool) {
        self.comp_cache.lock().unwrap_or_else(|e| e.into_inner()).on = on;
    }

    /// `--compressed-cache-size`: how many host clusters the cache holds at most (at least 1).
    pub fn set_compressed_cache_clusters(&self, n: usize) {
        self.comp_cache
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .cap_clusters = n.max(1);
    }

    /// Writes of compressed data that reached the file, and their bytes.
    pub fn compressed_file_writes(&self) -> (u64, u64) {
        let c = self.comp_cache.lock().unwrap_or_else(|e| e.into_inner());
        (c.file_writes, c.file_bytes)
    }

    /// End a fill started by [`Self::plan_fresh_write`] (its write completed or failed).
    pub fn end_fill(&self, key: u64) {
        self.fills.release(key);
        self.fills_in_flight
            .fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }

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
    ) -> Result<(), MapError> {
        let Some(ws) = self.write.as_ref() else {
            return Err(MapError::Corrupt("image is read-only"));
        };
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
        if n_cl == 1
            && !self.compress_writes()
            && self.write_cow_unlocked(file, offset, data, fill_old)?
        {
            return Ok(());
        }
        // Never allocate for a cluster another writer is copying without the lock.
        let mut ws_guard = loop {
            let guard = ws.lock().unwrap_or_else(|e| e.into_inner());
            let busy = self.cow_in_flight.lock().unwrap_or_else(|e| e.into_inner());
            if !(0..n_cl).any(|k| busy.contains(&(first_cl + k * c))) {
                drop(busy);
                break guard;
            }
            drop(guard);
            drop(self.cow_done.wait(busy).unwrap_or_else(|e| e.into_inner()));
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
        let mut ws = ws.lock().unwrap_or_else(|e| e.into_inner());
        self.maybe_write_back(&mut ws, file)
    }

    /// A data cluster for a copy-on-write: free space first (counted), else the end of the
    /// file; whether it was reused.
    fn alloc_data_cluster(
        &self,
        ws: &mut WriteState,
        file: &dyn Storage,
    ) -> Result<(u64, bool), MapError> {
        Ok(match self.find_free_run(ws, file, 1)? {
            Some(h) => {
                self.reused_clusters
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                (h, true)
            }
            None => (self.alloc_cluster(ws, file)?, false),
        })
    }

    /// The new contents of the cluster at guest `cl_start` in `buf`: its old contents (when
    /// `src` does not cover it) with `src` at `in_cl`; whether the old bytes around `src`
    /// were all zero.
    fn merge_cluster(
        buf: &mut [u8],
        cl_start: u64,
        in_cl: usize,
        src: &[u8],
        fill_old: &mut FillOld<'_>,
    ) -> Result<bool, MapError> {
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

    /// Is any of the `n` guest clusters from `first` being copied on write? (Called with the
    /// allocation lock held.)
    fn cow_busy(&self, first: u64, n: u64) -> bool {
        let c = self.cluster_size();
        let busy = self.cow_in_flight.lock().unwrap_or_else(|e| e.into_inner());
        !busy.is_empty() && (0..n).any(|k| busy.contains(&(first + k * c)))
    }

    /// A write inside one guest cluster that has no data cluster of its own (unallocated:
    /// its old contents come from the backing file or are zeroes; or a zero cluster): the new
    /// cluster is allocated under the allocation lock, the old contents are read and the
    /// cluster written without it (so writers on other threads overlap their I/O), and the
    /// L2 entry is installed under the lock once the data is in the file. Writers to the same
    /// guest cluster wait meanwhile; readers see the old contents until the entry changes.
    /// Ok(false): not such a write (the caller takes the locked path).
    fn write_cow_unlocked(
        &self,
        file: &dyn Storage,
        offset: u64,
        data: &[u8],
        fill_old: &mut FillOld<'_>,
    ) -> Result<bool, MapError> {
        let Some(ws_lock) = self.write.as_ref() else {
            return Err(MapError::Corrupt("image is read-only"));
        };
        let c = self.cluster_size();
        let cl_start = offset & !(c - 1);
        let in_cl = (offset - cl_start) as usize;
        let n = data.len();
        let (new, reused) = loop {
            let mut ws = ws_lock.lock().unwrap_or_else(|e| e.into_inner());
            let busy = self.cow_in_flight.lock().unwrap_or_else(|e| e.into_inner());
            if busy.contains(&cl_start) {
                drop(ws);
                drop(self.cow_done.wait(busy).unwrap_or_else(|e| e.into_inner()));
                continue;
            }
            drop(busy);
            let e = self.l2_entry(file, cl_start)?;
            if e & L2_OFFSET_MASK != 0 || e & L2_COMPRESSED != 0 {
                return Ok(false);
            }
            let got = self.alloc_data_cluster(&mut ws, file)?;
            self.cow_in_flight
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(cl_start);
            break got;
        };
        // The I/O, without the allocation lock.
        let io = (|| -> Result<(), MapError> {
            let mut cluster =
                crate::io::bounce::AlignedBuf::new(c as usize, 4096).map_err(MapError::Io)?;
            let buf = cluster.as_mut_slice();
            let old_is_zero = Self::merge_cluster(buf, cl_start, in_cl, data, fill_old)?;
            if old_is_zero && n < c as usize && !reused {
                // A fresh cluster past every earlier allocation is a hole: only the data,
                // after allocating the cluster's blocks (reading as zeroes) in one go, so
                // the write is not a hole-filling one that the file system serialises (like
                // QEMU's zero copy-on-write); best effort.
                let _ = file.allocate(new, c);
                write_all_aligned(file, new + in_cl as u64, data).map_err(MapError::Io)
            } else {
                write_all_aligned(file, new, buf).map_err(MapError::Io)
            }
        })();
        let mut ws = ws_lock.lock().unwrap_or_else(|e| e.into_inner());
        let installed = io.and_then(|()| {
            let cur = self.l2_entry(file, cl_start)?;
            let l2 = self.ensure_l2(&mut ws, file, cl_start)?;
            self.write_l2_entry(&mut ws, file, l2, self.l2_index(cl_start), new | L2_COPIED)?;
            // Whatever the entry held by now (a concurrent zeroing may have changed it) is
            // released once the new entry is durable.
            self.release_old(&mut ws, cur);
            Ok(())
        });
        if installed.is_err() {
            // Never referenced: give the cluster back (safe to write at any time).
            let _ = self.set_refcount(&mut ws, file, new, RefChange::Dec);
        }
        self.cow_in_flight
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&cl_start);
        self.cow_done.notify_all();
        installed?;
        self.cow_unlocked
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.maybe_write_back(&mut ws, file)?;
        Ok(true)
    }

    #[allow(clippy::too_many_arguments)]
    fn write_locked(
        &self,
        ws: &mut WriteState,
        file: &dyn Storage,
        offset: u64,
        data: &[u8],
        fill_old: &mut FillOld<'_>,
        mut pre: Vec<Option<Option<Vec<u8>>>>,
        runs: &mut Vec<Run>,
    ) -> Result<(), MapError> {
        let c = self.cluster_size();
        let end = offset + data.len() as u64;
        let mut pos = offset;
        let mut cluster =
            crate::io::bounce::AlignedBuf::new(c as usize, 4096).map_err(MapError::Io)?;
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
                if let Some(z) = z {
                    let at = self.place_compressed(ws, file, &z, runs)?;
                    let l2 = self.ensure_l2(ws, file, cl_start)?;
                    let x = 62 - (self.cluster_bits - 8);
                    let extra = ((at + z.len() as u64 - 1) >> 9) - (at >> 9);
                    let entry = L2_COMPRESSED | (extra << x) | at;
                    self.write_l2_entry(ws, file, l2, self.l2_index(cl_start), entry)?;
                    self.release_old(ws, e);
                    self.compress_stats
                        .0
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    pos += n as u64;
                    continue;
                }
                self.compress_stats
                    .1
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                // Does not compress: a normal cluster with these contents.
                buf[in_cl..in_cl + n].copy_from_slice(src);
                let (new, _) = match self.find_free_run(ws, file, 1)? {
                    Some(h) => (h, true),
                    None => (self.alloc_cluster(ws, file)?, false),
                };
                write_all_aligned(file, new, buf).map_err(MapError::Io)?;
                let l2 = self.ensure_l2(ws, file, cl_start)?;
                self.write_l2_entry(ws, file, l2, self.l2_index(cl_start), new | L2_COPIED)?;
                self.release_old(ws, e);
                pos += n as u64;
                continue;
            }
            if in_place {
                if self.is_metadata(host) {
                    return Err(MapError::Corrupt("a data cluster overlaps metadata"));
                }
                write_all_aligned(file, host + in_cl as u64, src).map_err(MapError::Io)?;
            } else {
                let buf = cluster.as_mut_slice();
                let old_is_zero = Self::merge_cluster(buf, cl_start, in_cl, src, fill_old)?;
                let (new, reused) = self.alloc_data_cluster(ws, file)?;
                if old_is_zero && n < c as usize && !reused {
                    // A fresh cluster past every earlier allocation is a hole: write only
                    // the new data (no copy of zeroes). A reused one is written whole.
                    write_all_aligned(file, new + in_cl as u64, src).map_err(MapError::Io)?;
                } else {
                    write_all_aligned(file, new, buf).map_err(MapError::Io)?;
                }
                let l2 = self.ensure_l2(ws, file, cl_start)?;
                self.write_l2_entry(ws, file, l2, self.l2_index(cl_start), new | L2_COPIED)?;
                self.release_old(ws, e);
            }
            pos += n as u64;
        }
        self.maybe_write_back(ws, file)
    }

    /// Write back dirty metadata in dependency order; the caller syncs the file afterwards
    /// for durability (FLUSH). Read-only images have none.
    pub fn flush(&self, file: &dyn Storage) -> Result<(), MapError> {
        let Some(ws) = self.write.as_ref() else {
            return Ok(());
        };
        let mut ws = ws.lock().unwrap_or_else(|e| e.into_inner());
        self.write_back(&mut ws, file)
    }

    /// New file space [start, end) is about to be written (`zero`: with zeroes): let the
    /// preallocation extend the file ahead of it. True when a zero write there can be
    /// skipped (the range is preallocated and known to read as zeroes).
    fn grow(
        &self,
        ws: &mut WriteState,
        file: &dyn Storage,
        start: u64,
        end: u64,
        zero: bool,
    ) -> bool {
        let Some(p) = ws.prealloc.as_mut() else {
            // No preallocation: still size the file over the new clusters (a hole, no
            // blocks), so the data writes into them do not each extend the file.
            Self::extend_to(ws, file, end);
            return false;
        };
        // With a background thread, zero writes are not merged (that would need the
        // extension's result now): they are written like data.
        let zero = zero && !self.prealloc_bg.active();
        // A background extension finished: take its result first.
        if let Some((e, r)) = self.prealloc_bg.take_done() {
            // Trust the file's real length: it is what reads and the metadata rely on.
            let len = file.size().unwrap_or(0);
            let was_unsupported = p.unsupported;
            let ok = p.extended(e.min(len), r, len);
            p.busy = false;
            self.count_prealloc(ok, p.unsupported && !was_unsupported);
            ws.covered = ws.covered.max(len);
        }
        let Some(p) = ws.prealloc.as_mut() else {
            return false;
        };
        let plan = p.handle_write(start, end - start, zero);
        let Some((s, e)) = plan.extend else {
            if !plan.merged {
                // Past the end while an extension runs (or after one failed): size the
                // file over the new clusters, as without preallocation.
                Self::extend_to(ws, file, end);
            }
            return plan.merged;
        };
        if !zero && self.prealloc_bg.start(s, e) {
            // Off this thread: the write goes on meanwhile without waiting for it.
            p.busy = true;
            Self::extend_to(ws, file, end);
            return false;
        }
        let was_unsupported = p.unsupported;
        let r = file
            .allocate(s, e - s)
            .map_err(|err| err.raw_os_error().unwrap_or(libc::EIO));
        let len = file.size().unwrap_or(0);
        let ok = p.extended(e, r, len);
        self.count_prealloc(ok, p.unsupported && !was_unsupported);
        if ok {
            ws.covered = ws.covered.max(e);
        }
        ok && plan.merged
    }

    /// Make the file at least `end` long (never shorter: a background extension may have
    /// made it longer than `covered` says).
    fn extend_to(ws: &mut WriteState, file: &dyn Storage, end: u64) {
        if end <= ws.covered {
            return;
        }
        // Whole pages, in steps: growing a file whose size is not a multiple of the page size
        // makes the file system zero the old last block through the page cache, which then
        // collides with concurrent direct I/O (EIO). The rounding is holes, trimmed on close.
        let end = end.next_multiple_of(SIZE_STEP);
        match file.size() {
            Ok(len) if len >= end => ws.covered = len,
            Ok(_) => {
                if file.set_len(end).is_ok() {
                    ws.covered = end;
                }
            }
            Err(_) => {}
        }
    }

    fn count_prealloc(&self, ok: bool, newly_unsupported: bool) {
        self.prealloc_stats
            .0
            .fetch_add(u64::from(ok), std::sync::atomic::Ordering::Relaxed);
        self.prealloc_stats
            .1
            .fetch_add(u64::from(!ok), std::sync::atomic::Ordering::Relaxed);
        if newly_unsupported {
            log::warn!(
                "preallocation: fallocate is not supported by this file system; \
                 stopped trying (writes extend the file)"
            );
        }
    }

    /// Do preallocations on a background thread with this handle to the image file (the
    /// daemon's case): queue threads never wait for a fallocate.
    pub fn set_prealloc_thread(&self, file: File) {
        self.prealloc_bg.spawn(file);
    }

    /// Preallocation for writes past the end of the file: `Some((size, align, file_align))`
    /// turns it on, None off. The file's length seen by the format stays the end of its data.
    pub fn set_prealloc(&self, opts: Option<(u64, u64, u64)>) {
        if let Some(ws) = self.write.as_ref() {
            let mut ws = ws.lock().unwrap_or_else(|e| e.into_inner());
            ws.prealloc = opts.map(|(size, align, file_align)| {
                let mut p =
                    crate::image::prealloc::Prealloc::new(ws.covered, size, align, file_align);
                // The data ends at the last allocated cluster; a tail after it (left by a
                // crash while preallocated) is not known to read as zeroes.
                p.data_end = ws.next_free.min(ws.covered);
                p
            });
        }
    }

    /// Preallocations done and skipped (failed or unsupported).
    pub fn prealloc_counts(&self) -> (u64, u64) {
        (
            self.prealloc_stats
                .0
                .load(std::sync::atomic::Ordering::Relaxed),
            self.prealloc_stats
                .1
                .load(std::sync::atomic::Ordering::Relaxed),
        )
    }

    /// The L2 cache bound in bytes and the guest bytes it maps.
    pub fn l2_cache_bytes(&self) -> (u64, u64) {
        let tables = self
            .l2_cache
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .capacity as u64;
        (
            tables << self.cluster_bits,
            tables << (self.cluster_bits + self.l2_bits),
        )
    }

    /// Punch holes where clusters are freed (the operator allowed deallocation).
    pub fn set_punch_freed(&self, on: bool) {
        self.punch_freed
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Clean close: write back metadata and trim the file to the end of the last allocated
    /// cluster.
    pub fn close(&self, file: &dyn Storage) -> Result<(), MapError> {
        let Some(ws) = self.write.as_ref() else {
            return Ok(());
        };
        let mut ws = ws.lock().unwrap_or_else(|e| e.into_inner());
        self.write_back(&mut ws, file)?;
        // The decrements that write-back applied last (clusters the written L2 tables no
        // longer use): written now, or a clean shutdown would leave them leaked.
        if !ws.dirty_chunks.is_empty() {
            self.write_dirty_refcounts(&mut ws, file)?;
        }
        // A background extension still running would extend the file after the trim.
        if let Some(p) = ws.prealloc.as_mut().filter(|p| p.busy) {
            if let Some((e, r)) = self.prealloc_bg.wait_done() {
                let len = file.size().map_err(MapError::Io)?;
                p.extended(e, r, len);
            }
            p.busy = false;
        }
        // Nothing past the last allocated cluster is referenced: drop the preallocated tail
        // (or one a crash left behind).
        let end = ws.next_free;
        if file.size().map_err(MapError::Io)? > end {
            file.set_len(end).map_err(MapError::Io)?;
            ws.covered = end;
            if let Some(p) = ws.prealloc.as_mut() {
                p.file_end = end;
                p.data_end = p.data_end.min(end);
                p.zero_start = p.zero_start.min(end);
            }
        }
        Ok(())
    }

    /// Write back early when the caches hold too much dirty metadata.
    fn maybe_write_back(&self, ws: &mut WriteState, file: &dyn Storage) -> Result<(), MapError> {
        let too_many_tables = {
            let cache = self.l2_cache.lock().unwrap_or_else(|e| e.into_inner());
            // Dirty tables are never evicted: write back early only when the cache could
            // run out of clean ones, not when it holds every table the image can have
            // (then a random write workload would sync every few writes).
            let all_tables = self
                .size_bytes
                .div_ceil(1u64 << (self.cluster_bits + self.l2_bits));
            (cache.capacity as u64) < all_tables && cache.dirty_tables() * 2 >= cache.capacity
        };
        if too_many_tables || ws.dirty_chunks.len() >= MAX_DIRTY_REFCOUNT_CHUNKS {
            self.write_back(ws, file)?;
        }
        Ok(())
    }

    /// Every allocated cluster inside the file (so no L2 entry on disk points past its end),
    /// refcount increases, a barrier, dirty L2 tables, a barrier, then the decrements that
    /// the written L2 changes allow (they become dirty refcount chunks, written next time).
    fn write_back(&self, ws: &mut WriteState, file: &dyn Storage) -> Result<(), MapError> {
        {
            // Compressed chunks reach the file before any L2 entry that names them; after a
            // failed cache write, nothing may claim durability again.
            let mut cache = self.comp_cache.lock().unwrap_or_else(|e| e.into_inner());
            // Runs other writers are writing right now reach the file first (their threads
            // do not need the allocation lock to finish).
            while !cache.writing.is_empty() {
                cache = self
                    .comp_written
                    .wait(cache)
                    .unwrap_or_else(|e| e.into_inner());
            }
            if cache.failed {
                return Err(MapError::Io(io::Error::other(
                    "an earlier compressed-cache write failed: compressed data was lost",
                )));
            }
            Self::write_cache(&mut cache, file, self.meta_chunk())?;
            // Keep only the last cluster of the run (the one chunks may still be appended
            // to): the full ones are in the file now, and one of them may be freed below.
            let c = self.cluster_size() as usize;
            if cache.data.len() > c {
                let drop_n = cache.data.len() - c;
                cache.data.drain(..drop_n);
                cache.start += drop_n as u64;
                cache.used = cache.used.saturating_sub(drop_n);
            }
        }
        let l2_dirty = self
            .l2_cache
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .dirty_tables()
            > 0;
        if l2_dirty || !ws.dirty_chunks.is_empty() {
            if ws.covered < ws.next_free {
                let end = ws.next_free.next_multiple_of(SIZE_STEP);
                if file.size().map_err(MapError::Io)? < ws.next_free {
                    file.set_len(end).map_err(MapError::Io)?;
                }
                ws.covered = ws.covered.max(ws.next_free);
            }
            self.write_dirty_refcounts(ws, file)?;
        }
        if l2_dirty {
            file.sync_data().map_err(MapError::Io)?;
            let chunk = self.meta_chunk() as usize;
            let per_chunk = chunk / 8;
            let mut cache = self.l2_cache.lock().unwrap_or_else(|e| e.into_inner());
            let mut bytes =
                crate::io::bounce::AlignedBuf::new(chunk, 4096).map_err(MapError::Io)?;
            for t in cache.tables.iter_mut() {
                for ci in 0..t.dirty.len() {
                    if !t.dirty[ci] {
                        continue;
                    }
                    let b = bytes.as_mut_slice();
                    for (i, e) in t.entries[ci * per_chunk..(ci + 1) * per_chunk]
                        .iter()
                        .enumerate()
                    {
                        b[i * 8..i * 8 + 8].copy_from_slice(&e.to_be_bytes());
                    }
                    file.write_all_at(&bytes.as_slice()[..chunk], t.offset + (ci * chunk) as u64)
                        .map_err(MapError::Io)?;
                    t.dirty[ci] = false;
                }
            }
        }
        if !ws.pending_decs.is_empty() {
            file.sync_data().map_err(MapError::Io)?;
            for host in std::mem::take(&mut ws.pending_decs) {
                if self.set_refcount(ws, file, host, RefChange::Dec)? == 0 {
                    // Never append compressed chunks to a freed cluster, nor write a cached
                    // copy of it later (it may be reused for other data).
                    let mut cache = self.comp_cache.lock().unwrap_or_else(|e| e.into_inner());
                    let cached = !cache.data.is_empty() && cache.start == host;
                    if cached {
                        cache.data.clear();
                        cache.dirty = false;
                    }
                    drop(cache);
                    if cached || ws.comp_pos & !(self.cluster_size() - 1) == host {
                        ws.comp_pos = 0;
                    }
                    ws.free_cursor = ws.free_cursor.min(host);
                    ws.free_run_hint = u64::MAX;
                    if self.punch_freed.load(std::sync::atomic::Ordering::Relaxed) {
                        // Best effort: give the space back to the host file system.
                        let _ = file.punch_hole(host, self.cluster_size());
                    }
                }
            }
        }
        Ok(())
    }

    /// Write the dirty refcount chunks (any time is safe: see [`WriteState::dirty_chunks`]).
    fn write_dirty_refcounts(
        &self,
        ws: &mut WriteState,
        file: &dyn Storage,
    ) -> Result<(), MapError> {
        while let Some(&chunk) = ws.dirty_chunks.first() {
            if let Some(b) = ws.refcount_chunks.get(&chunk) {
                write_all_aligned(file, chunk, b).map_err(MapError::Io)?;
            }
            ws.dirty_chunks.remove(&chunk);
        }
        Ok(())
    }

    /// Change one L2 entry in the cached table (loading it if needed); written back later.
    fn write_l2_entry(
        &self,
        ws: &mut WriteState,
        file: &dyn Storage,
        l2: u64,
        index: usize,
        entry: u64,
    ) -> Result<(), MapError> {
        let per_chunk = (self.meta_chunk() / 8) as usize;
        loop {
            let mut cache = self.l2_cache.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(t) = cache.tables.iter_mut().find(|t| t.offset == l2) {
                let slot = t
                    .entries
                    .get_mut(index)
                    .ok_or(MapError::Corrupt("L2 index out of range"))?;
                *slot = entry;
                t.dirty[index / per_chunk] = true;
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

    /// The L2 table for `guest_offset`, allocating an empty one if the L1 entry is empty.
    fn ensure_l2(
        &self,
        ws: &mut WriteState,
        file: &dyn Storage,
        guest_offset: u64,
    ) -> Result<u64, MapError> {
        let l1_index = (guest_offset >> (self.cluster_bits + self.l2_bits)) as usize;
        let l1e = self
            .l1
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(l1_index)
            .copied()
            .ok_or(MapError::Corrupt("guest offset beyond the L1 table"))?;
        let l2 = l1e & L1_OFFSET_MASK;
        if l2 != 0 {
            if l1e & L2_COPIED == 0 {
                return self.copy_shared_l2(ws, file, l1_index, l2);
            }
            return Ok(l2);
        }
        let new = self.alloc_zeroed_cluster(ws, file)?;
        self.note_metadata(new);
        self.install_l2(ws, file, l1_index, new, vec![0u64; 1 << self.l2_bits])?;
        Ok(new)
    }

    /// An L2 table shared with a snapshot (its L1 entry is not COPIED): give the active image
    /// its own copy (COPIED flags cleared: its clusters are shared), move the L1 entry to the
    /// copy, and drop the active image's reference to the shared table.
    fn copy_shared_l2(
        &self,
        ws: &mut WriteState,
        file: &dyn Storage,
        l1_index: usize,
        old_l2: u64,
    ) -> Result<u64, MapError> {
        let c = self.cluster_size();
        // The cached copy may hold entries not written back yet.
        let cached = {
            let cache = self.l2_cache.lock().unwrap_or_else(|e| e.into_inner());
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
        for e in entries.iter_mut() {
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
        write_all_aligned(file, new, &bytes).map_err(MapError::Io)?;
        self.install_l2(ws, file, l1_index, new, entries)?;
        ws.pending_decs.push(old_l2);
        Ok(new)
    }

    /// Make the L2 table just written at `new` (with `entries`) the active one for
    /// `l1_index`: its refcount reaches the file first, then it is cached and the L1 entry
    /// points at it (on disk, then in memory).
    fn install_l2(
        &self,
        ws: &mut WriteState,
        file: &dyn Storage,
        l1_index: usize,
        new: u64,
        entries: Vec<u64>,
    ) -> Result<(), MapError> {
        self.write_dirty_refcounts(ws, file)?;
        file.sync_data().map_err(MapError::Io)?;
        loop {
            let mut cache = self.l2_cache.lock().unwrap_or_else(|e| e.into_inner());
            if cache.make_room() {
                cache.tables.push_back(self.new_table(new, entries));
                break;
            }
            drop(cache);
            self.write_back(ws, file)?;
        }
        let entry = new | L2_COPIED;
        write_be64(
            file,
            self.l1_offset + l1_index as u64 * 8,
            entry,
            self.meta_chunk(),
        )
        .map_err(MapError::Io)?;
        if let Some(e) = self
            .l1
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .get_mut(l1_index)
        {
            *e = entry;
        }
        Ok(())
    }

    /// A new cluster at the end of the file, its refcount set to 1 (in the cache).
    fn alloc_cluster(&self, ws: &mut WriteState, file: &dyn Storage) -> Result<u64, MapError> {
        let host = ws.next_free;
        ws.next_free += self.cluster_size();
        self.file_size
            .fetch_max(ws.next_free, std::sync::atomic::Ordering::AcqRel);
        self.set_refcount(ws, file, host, RefChange::Set(1))?;
        self.grow(ws, file, host, host + self.cluster_size(), false);
        Ok(host)
    }

    /// A new cluster at the end of the file that starts out as zeroes (a new table): its
    /// refcount set, and its zeroes written unless it is preallocated space known to read
    /// as zeroes already.
    fn alloc_zeroed_cluster(
        &self,
        ws: &mut WriteState,
        file: &dyn Storage,
    ) -> Result<u64, MapError> {
        let c = self.cluster_size();
        let host = ws.next_free;
        ws.next_free += c;
        self.file_size
            .fetch_max(ws.next_free, std::sync::atomic::Ordering::AcqRel);
        self.set_refcount(ws, file, host, RefChange::Set(1))?;
        if !self.grow(ws, file, host, host + c, true) {
            let zero =
                crate::io::bounce::AlignedBuf::new(c as usize, 4096).map_err(MapError::Io)?;
            write_all_aligned(file, host, zero.as_slice()).map_err(MapError::Io)?;
        }
        Ok(host)
    }

    /// Queue the release of the host cluster(s) an old L2 entry used: applied once the L2
    /// change that dropped them is durable.
    fn release_old(&self, ws: &mut WriteState, e: u64) {
        let c = self.cluster_size();
        if e & L2_COMPRESSED != 0 {
            let x = 62 - (self.cluster_bits - 8);
            let host = e & ((1u64 << x) - 1);
            let sectors = ((e & !L2_COMPRESSED) >> x) + 1;
            let last = host + (sectors * 512).saturating_sub(host & 511).max(1) - 1;
            let mut cl = host & !(c - 1);
            while cl <= (last & !(c - 1)) {
                ws.pending_decs.push(cl);
                cl += c;
            }
        } else if e & L2_OFFSET_MASK != 0 {
            ws.pending_decs.push(e & L2_OFFSET_MASK);
        }
    }

    /// Change a cluster's refcount in the refcount cache (any width from 1 to 64 bits),
    /// allocating the refcount block (and growing the table) if needed; the new refcount.
    fn set_refcount(
        &self,
        ws: &mut WriteState,
        file: &dyn Storage,
        host: u64,
        change: RefChange,
    ) -> Result<u64, MapError> {
        let c = self.cluster_size();
        let bits = 1u64 << ws.refcount_order;
        let per_block = c * 8 / bits;
        let idx = host / c;
        let ti = (idx / per_block) as usize;
        if ti >= ws.refcount_table.len() {
            self.grow_refcount_table(ws, file, ti)?;
        }
        let Some(&rb) = ws.refcount_table.get(ti) else {
            return Err(MapError::Corrupt("refcount table too small"));
        };
        let rb = if rb == 0 {
            self.new_refcount_block(ws, file, ti)?
        } else {
            if rb % c != 0 {
                return Err(MapError::Corrupt("refcount block offset unaligned"));
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
            let b = read_aligned(file, chunk, chunk_size as usize).map_err(MapError::Io)?;
            ws.refcount_chunks.insert(chunk, b);
        }
        let buf = ws
            .refcount_chunks
            .get_mut(&chunk)
            .ok_or(MapError::Corrupt("refcount chunk vanished"))?;
        let old = refcount_get(buf, i, ws.refcount_order);
        let max = if bits == 64 {
            u64::MAX
        } else {
            (1 << bits) - 1
        };
        let new = match change {
            RefChange::Set(v) if v <= max => v,
            RefChange::Set(_) => return Err(MapError::Corrupt("refcount overflow")),
            RefChange::Inc if old < max => old + 1,
            RefChange::Inc => return Err(MapError::Corrupt("refcount overflow")),
            RefChange::Dec => old.saturating_sub(1),
        };
        refcount_put(buf, i, ws.refcount_order, new);
        ws.dirty_chunks.insert(chunk);
        if ws.dirty_chunks.len() >= MAX_DIRTY_REFCOUNT_CHUNKS {
            self.write_dirty_refcounts(ws, file)?;
        }
        Ok(new)
    }

    /// A cluster's refcount (0 where no refcount block exists).
    fn get_refcount(
        &self,
        ws: &mut WriteState,
        file: &dyn Storage,
        host: u64,
    ) -> Result<u64, MapError> {
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
        let b = read_aligned(file, chunk, chunk_size as usize).map_err(MapError::Io)?;
        let v = refcount_get(&b, i, ws.refcount_order);
        ws.refcount_chunks.insert(chunk, b);
        Ok(v)
    }

    /// `n` contiguous free clusters (refcount 0) below the end of the allocations, for a
    /// data write that writes all of them (their old contents are anything); their
    /// refcounts are set. Never used for metadata: a guest write racing the discard that
    /// freed a cluster could still land in it. The scan starts at `free_cursor` (every
    /// cluster below is in use) and a failed scan is not repeated for as long a run until
    /// something is freed, so each cluster is looked at about once.
    fn find_free_run(
        &self,
        ws: &mut WriteState,
        file: &dyn Storage,
        n: u64,
    ) -> Result<Option<u64>, MapError> {
        if n > ws.free_run_hint {
            return Ok(None);
        }
        let c = self.cluster_size();
        let mut pos = ws.free_cursor;
        let mut first_free = None;
        let mut run_start = 0;
        let mut run = 0;
        while pos < ws.next_free {
            if !self.is_metadata(pos) && self.get_refcount(ws, file, pos)? == 0 {
                if run == 0 {
                    run_start = pos;
                }
                first_free.get_or_insert(pos);
                run += 1;
                if run == n {
                    for k in 0..n {
                        self.set_refcount(ws, file, run_start + k * c, RefChange::Set(1))?;
                    }
                    ws.free_cursor = match first_free {
                        Some(f) if f < run_start => f,
                        _ => pos + c,
                    };
                    return Ok(Some(run_start));
                }
            } else {
                run = 0;
            }
            pos += c;
        }
        ws.free_cursor = first_free.unwrap_or(ws.next_free);
        ws.free_run_hint = n - 1;
        Ok(None)
    }

    /// A new, zeroed refcount block for refcount table entry `ti` at the end of the file. Its
    /// own refcount reaches the file before the table entry that names it.
    fn new_refcount_block(
        &self,
        ws: &mut WriteState,
        file: &dyn Storage,
        ti: usize,
    ) -> Result<u64, MapError> {
        let c = self.cluster_size();
        let block = ws.next_free;
        ws.next_free += c;
        self.note_metadata(block);
        self.file_size
            .fetch_max(ws.next_free, std::sync::atomic::Ordering::AcqRel);
        if !self.grow(ws, file, block, block + c, true) {
            let zero =
                crate::io::bounce::AlignedBuf::new(c as usize, 4096).map_err(MapError::Io)?;
            write_all_aligned(file, block, zero.as_slice()).map_err(MapError::Io)?;
        }
        // Forget cached chunks of whatever was at this offset before (nothing should be).
        ws.refcount_chunks
            .retain(|&k, _| k < block || k >= block + c);
        ws.dirty_chunks.retain(|&k| k < block || k >= block + c);
        ws.refcount_table[ti] = block;
        self.set_refcount(ws, file, block, RefChange::Set(1))?;
        self.write_dirty_refcounts(ws, file)?;
        file.sync_data().map_err(MapError::Io)?;
        write_be64(
            file,
            ws.refcount_table_offset + ti as u64 * 8,
            block,
            self.meta_chunk(),
        )
        .map_err(MapError::Io)?;
        Ok(block)
    }

    /// Move the refcount table to a bigger one at the end of the file (with refcount blocks
    /// for the new clusters where none exist), switch the header to it, then free the old
    /// table. A crash before the header switch leaves only leaked clusters.
    fn grow_refcount_table(
        &self,
        ws: &mut WriteState,
        file: &dyn Storage,
        needed: usize,
    ) -> Result<(), MapError> {
        let c = self.cluster_size();
        let per_block = c * 8 / (1u64 << ws.refcount_order);
        let per_cluster = (c / 8) as usize;
        let new_entries = (ws.refcount_table.len() * 2)
            .max(needed + 1)
            .next_multiple_of(per_cluster);
        if (new_entries * 8) as u64 > MAX_L1_BYTES {
            return Err(MapError::Corrupt("refcount table would exceed 32 MiB"));
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
                return Err(MapError::Corrupt("refcount table growth does not converge"));
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
        self.file_size
            .fetch_max(end, std::sync::atomic::Ordering::AcqRel);
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
            write_all_aligned(file, off, &blk).map_err(MapError::Io)?;
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
        write_all_aligned(file, start, &raw).map_err(MapError::Io)?;
        // The new table's own refcounts are in the file before the header names it.
        self.write_dirty_refcounts(ws, file)?;
        file.sync_data().map_err(MapError::Io)?;
        // Switch the header: offset (48) and clusters (56) sit in one sector.
        let mut hdr = read_aligned(file, 0, self.meta_chunk() as usize).map_err(MapError::Io)?;
        hdr[48..56].copy_from_slice(&start.to_be_bytes());
        hdr[56..60].copy_from_slice(&(table_clusters as u32).to_be_bytes());
        write_all_aligned(file, 0, &hdr).map_err(MapError::Io)?;
        ws.refcount_table_offset = start;
        for i in 0..old_clusters {
            ws.pending_decs.push(old_offset + i * c);
        }
        Ok(())
    }

    /// Decompress the cluster of a compressed extent into `cluster_buf` (cluster size).
    pub fn decompress(
        &self,
        file: &dyn Storage,
        host_offset: u64,
        compressed_len: u64,
        cluster_buf: &mut [u8],
    ) -> Result<(), MapError> {
        let start = host_offset & !511;
        let lead = (host_offset - start) as usize;
        // Bytes still in the compressed-write cache are newer than the file's. Take them
        // first: whatever is not in the cache now already is in the file (a run leaves the
        // cache only after its write completed), so the file read below sees it.
        let mut overlays: Vec<(usize, Vec<u8>)> = Vec::new();
        {
            let cache = self.comp_cache.lock().unwrap_or_else(|e| e.into_inner());
            let held = cache
                .writing
                .iter()
                .map(|(start, b)| (*start, &b[..]))
                .chain([(cache.start, &cache.data[..cache.used.min(cache.data.len())])]);
            for (a, bytes) in held {
                let b = a + bytes.len() as u64;
                let (x, y) = (host_offset, host_offset + compressed_len);
                let (lo, hi) = (a.max(x), b.min(y));
                if lo < hi {
                    let src = (lo - a) as usize;
                    overlays.push((
                        lead + (lo - x) as usize,
                        bytes[src..src + (hi - lo) as usize].to_vec(),
                    ));
                }
            }
        }
        let want = lead + compressed_len as usize;
        let mut raw = read_aligned(file, start, want).map_err(MapError::Io)?;
        if raw.len() < want && !overlays.is_empty() {
            raw.resize(want, 0);
        }
        for (dst, bytes) in overlays {
            if let Some(d) = raw.get_mut(dst..dst + bytes.len()) {
                d.copy_from_slice(&bytes);
            }
        }
        let input = raw
            .get(lead..)
            .ok_or(MapError::Corrupt("short compressed cluster"))?;
        match self.compression {
            Compression::Zlib => {
                use std::io::Read;
                let mut d = flate2::read::DeflateDecoder::new(input);
                d.read_exact(cluster_buf)
                    .map_err(|_| MapError::Corrupt("bad deflate data in a compressed cluster"))?;
            }
            Compression::Zstd => {
                // The stream may be followed by padding: decode exactly one cluster.
                let mut d = zstd::stream::read::Decoder::new(input)
                    .map_err(|_| MapError::Corrupt("bad zstd data in a compressed cluster"))?
                    .single_frame();
                use std::io::Read;
                d.read_exact(cluster_buf)
                    .map_err(|_| MapError::Corrupt("bad zstd data in a compressed cluster"))?;
            }
        }
        Ok(())
    }
}

/// Refcount `i` of a refcount block chunk, `1 << order` bits wide (big-endian for 8 bits
/// and more; narrower ones packed from the least significant bit of each byte).
fn refcount_get(buf: &[u8], i: usize, order: u32) -> u64 {
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

fn refcount_put(buf: &mut [u8], i: usize, order: u32, v: u64) {
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

/// Write a big-endian u64 in place: read-modify-write of the `chunk`-byte block around it
/// (`chunk` = min(4 KiB, cluster size), so that the block never covers another cluster,
/// which could be guest data being written concurrently).
fn write_be64(file: &dyn Storage, offset: u64, value: u64, chunk_size: u64) -> io::Result<()> {
    let chunk = offset & !(chunk_size - 1);
    let mut buf = read_aligned(file, chunk, chunk_size as usize)?;
    let i = (offset - chunk) as usize;
    buf[i..i + 8].copy_from_slice(&value.to_be_bytes());
    write_all_aligned(file, chunk, &buf)
}

/// Write `data` at any byte offset: read-modify-write of the `chunk`-aligned blocks around
/// it (the file may be O_DIRECT). Used for compressed chunks, which the allocator places
/// back to back; callers hold the allocation lock, so no other writer shares the blocks.
fn write_unaligned(file: &dyn Storage, offset: u64, data: &[u8], chunk: u64) -> io::Result<()> {
    let start = offset & !(chunk - 1);
    let end = (offset + data.len() as u64).next_multiple_of(chunk);
    let mut buf = read_aligned(file, start, (end - start) as usize)?;
    let at = (offset - start) as usize;
    buf[at..at + data.len()].copy_from_slice(data);
    write_all_aligned(file, start, &buf)
}

/// pwrite `data` at `offset` through an aligned copy (the file may be O_DIRECT; offset and
/// length are multiples of 512 everywhere this is used).
pub(crate) fn write_all_aligned(file: &dyn Storage, offset: u64, data: &[u8]) -> io::Result<()> {
    let mut buf = crate::io::bounce::AlignedBuf::new(data.len().max(1), 4096)?;
    buf.as_mut_slice()[..data.len()].copy_from_slice(data);
    file.write_all_at(&buf.as_slice()[..data.len()], offset)
}

/// Read `len` bytes at `offset` with a 4 KiB-aligned buffer and length (works on O_DIRECT
/// files); returns exactly the bytes asked for (zero-padded past the end of the file).
pub(crate) fn read_aligned(file: &dyn Storage, offset: u64, len: usize) -> io::Result<Vec<u8>> {
    const A: u64 = 4096;
    let start = offset / A * A;
    let end = (offset + len as u64).div_ceil(A) * A;
    let span = (end - start) as usize;
    let mut buf = crate::io::bounce::AlignedBuf::new(span, A as usize)?;
    let mut done = 0usize;
    while done < span {
        match file.read_at(&mut buf.as_mut_slice()[done..], start + done as u64) {
            Ok(0) => break,
            // A short read only happens at the end of the file (and the next O_DIRECT read
            // would be unaligned): the rest reads as zeroes.
            Ok(n) if n < span - done => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    let skip = (offset - start) as usize;
    Ok(buf.as_slice()[skip..skip + len].to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::fs::File;
    use std::path::PathBuf;

    fn temp(tag: &str, bytes: &[u8]) -> (PathBuf, File) {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/unit-tmp");
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join(format!("qcow2-{tag}-{}", std::process::id()));
        std::fs::write(&p, bytes).unwrap();
        let f = File::open(&p).unwrap();
        (p, f)
    }

    /// A minimal valid v3 header: 64 KiB clusters, 512 MiB (one L1 entry), L1 at 0x30000
    /// with one entry pointing at an L2 table at 0x40000.
    fn header() -> Vec<u8> {
        let mut h = vec![0u8; 0x50000];
        h[0..4].copy_from_slice(&MAGIC);
        h[4..8].copy_from_slice(&3u32.to_be_bytes());
        h[20..24].copy_from_slice(&16u32.to_be_bytes());
        h[24..32].copy_from_slice(&(1u64 << 29).to_be_bytes());
        h[36..40].copy_from_slice(&1u32.to_be_bytes());
        h[40..48].copy_from_slice(&0x30000u64.to_be_bytes());
        h[100..104].copy_from_slice(&104u32.to_be_bytes());
        h[0x30000..0x30008].copy_from_slice(&0x40000u64.to_be_bytes());
        h
    }

    #[test]
    fn valid_header_maps_unallocated_and_allocated_clusters() {
        let mut h = header();
        // Guest cluster 1 -> host cluster at 0x40000 (the L2 table itself, fine for mapping).
        h[0x40008..0x40010].copy_from_slice(&0x40000u64.to_be_bytes());
        // Guest cluster 2: zero flag.
        h[0x40010..0x40018].copy_from_slice(&1u64.to_be_bytes());
        let (p, f) = temp("valid", &h);
        let q = Qcow2Image::open(&f, false).unwrap();
        let mut out = Vec::new();
        q.map(&f, 0, 3 * 65536, &mut out).unwrap();
        assert_eq!(
            out,
            vec![
                Extent::Unallocated { len: 65536 },
                Extent::Data {
                    host_offset: 0x40000,
                    len: 65536
                },
                Extent::Zero { len: 65536 },
            ]
        );
        std::fs::remove_file(p).unwrap();
    }

    #[test]
    fn huge_l1_is_refused_not_allocated() {
        let mut h = header();
        h[36..40].copy_from_slice(&u32::MAX.to_be_bytes());
        let (p, f) = temp("huge-l1", &h);
        assert!(matches!(
            Qcow2Image::open(&f, false),
            Err(Qcow2Error::L1Size(_))
        ));
        std::fs::remove_file(p).unwrap();
    }

    #[test]
    fn l2_pointing_outside_the_file_is_an_error_not_a_read() {
        let mut h = header();
        h[0x30000..0x30008].copy_from_slice(&(1u64 << 40).to_be_bytes());
        let (p, f) = temp("l2-out", &h);
        let q = Qcow2Image::open(&f, false).unwrap();
        let mut out = Vec::new();
        assert!(matches!(
            q.map(&f, 0, 4096, &mut out),
            Err(MapError::Corrupt(_))
        ));
        std::fs::remove_file(p).unwrap();
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        /// Arbitrary header fields and table entries: opening and mapping never panic, and
        /// every data extent lies inside the file.
        #[test]
        fn arbitrary_images_never_panic(
            fields in proptest::collection::vec((0usize..112, any::<u8>()), 0..24),
            l1e in any::<u64>(),
            l2es in proptest::collection::vec(any::<u64>(), 4),
            off in 0u64..(1 << 30),
        ) {
            let mut h = header();
            for (i, b) in fields {
                if i >= 4 { h[i] = b; }
            }
            if l1e % 3 == 0 { h[0x30000..0x30008].copy_from_slice(&l1e.to_be_bytes()); }
            for (i, e) in l2es.iter().enumerate() {
                h[0x40000 + i * 8..0x40008 + i * 8].copy_from_slice(&e.to_be_bytes());
            }
            let (p, f) = temp("fuzz", &h);
            if let Ok(q) = Qcow2Image::open(&f, false) {
                let size = q.size_bytes;
                if size > 0 {
                    let start = off % size;
                    let len = (size - start).min(4 * 65536);
                    let mut out = Vec::new();
                    if q.map(&f, start, len, &mut out).is_ok() {
                        let total: u64 = out.iter().map(|e| e.len()).sum();
                        prop_assert_eq!(total, len);
                        for e in &out {
                            if let Extent::Data { host_offset, len } = *e {
                                prop_assert!(host_offset + len <= h.len() as u64 + q.cluster_size());
                            }
                        }
                    }
                }
            }
            std::fs::remove_file(p).unwrap();
        }
    }
}
