//! qcow2 images (QEMU's docs/interop/qcow2.rst; no QEMU code): header validation, the L1
//! table, a bounded L2 cache, refcounts, and the mapping of guest ranges to host extents.
//! The format plans; the worker executes the data I/O, except for the writes that must
//! be ordered with metadata (copy-on-write, compressed clusters), which the format does
//! itself through [`Storage`].
//!
//! Rooms:
//! - `header`: the header's fields at named offsets, parsed and serialised.
//! - `open`: open and validate (overlapping tables, snapshots, a crash's tail).
//! - `map`: L1/L2 entries and guest-to-host mapping; new and copied L2 tables.
//! - `l2cache`: the bounded L2 table cache.
//! - `refcount`: refcount blocks and the refcount table.
//! - `alloc`: where new clusters come from (free space, the end of the file, preallocation).
//! - `cow`: writes into fresh clusters through the engine, and copy-on-write off the lock.
//! - `write`: writes and zeroing through the format.
//! - `compress`: compressed clusters and the compressed-write cache.
//! - `subcluster`: extended L2 entries' writes of single subclusters.
//! - `writeback`: metadata write-back in dependency order, flush and close.
//! - `bitmaps`, `bitmap_store`: persistent dirty bitmaps, read and kept current.
//!
//! # Locks
//!
//! Taken in this order, never the reverse (a thread holding a later one never waits for an
//! earlier one):
//! 0. `stored`: the persistent bitmaps as the file holds them (`bitmap_store`); held while
//!    they are saved (which allocates) and while the data path writes newly set bits.
//! 1. `write` ([`WriteState`], "the allocation lock"): refcounts, the free-space cursor, the
//!    end of the allocations, preallocation state, and every change of an L1 or L2 entry.
//!    Held across metadata I/O, never across guest data I/O (except the synchronous
//!    write paths, which write the data of clusters they allocate under it).
//! 2. `cow.busy`: guest clusters being copied on write without the allocation lock. A
//!    writer that finds its cluster busy drops the allocation lock before it waits.
//! 3. `comp.cache`: the compressed-write cache.
//! 4. `l2_cache`: cached L2 tables; held for a lookup or an update (and the read of a
//!    missing table, so no writer changes it meanwhile), and while dirty tables are written.
//! 5. Leaves, held for a lookup or an update only: `l1`, `metadata`, the fill ranges in
//!    `fills`, and the background preallocation's mailbox.

mod alloc;
mod bitmap_store;
pub mod bitmaps;
mod compress;
mod cow;
mod crypt;
pub mod header;
mod l2cache;
mod map;
mod metadata;
mod open;
mod refcount;
pub mod relink;
mod resize;
mod subcluster;
mod write;
mod writeback;

#[cfg(test)]
mod compress_tests;
#[cfg(test)]
mod crash_tests;
#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::fs::File;
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use super::prealloc::{Background, Prealloc, PreallocParams};
use super::ImageError;
use crate::locks::{Locked, RwLocked};

pub use compress::DEFAULT_COMPRESSED_CACHE_CLUSTERS;
pub use cow::{CowInstall, Fill, FillGate, FreshWrite, SubInstall};
pub use header::{Compression, MAGIC};
pub use map::Extent;

/// Refuse L1 tables larger than this (QEMU's limit, for the active table and each snapshot's):
/// 32 MiB of L1 maps 2^22 L2 tables, 128 GiB of guest space at 512-byte clusters and 2 PiB at
/// 64 KiB; an image claiming more is hostile or broken.
pub(crate) const MAX_L1_BYTES: u64 = 32 << 20;
/// Refuse refcount tables larger than this, and never grow one past it (QEMU's limit): 8 MiB
/// of refcount table covers 128 GiB of file at 512-byte clusters and 2 PiB at 64 KiB.
const MAX_REFCOUNT_TABLE_BYTES: u64 = 8 << 20;
/// Default L2 cache: 32 MiB, or what covers 64 GiB of guest data when that is more (small
/// clusters), never more than the image's own L2 tables.
pub const DEFAULT_L2_CACHE_BYTES: u64 = 32 << 20;
/// Guest bytes the default L2 cache covers at least.
pub const DEFAULT_L2_COVERAGE: u64 = 64 << 30;

/// Why a qcow2 image cannot be served; each names the problem.
#[derive(Debug, thiserror::Error)]
pub enum Qcow2Error {
    #[error("cannot read the qcow2 header")]
    ReadHeader(#[source] io::Error),
    #[error("cannot update the qcow2 header")]
    WriteHeader(#[source] io::Error),
    #[error("not a qcow2 image (bad magic)")]
    BadMagic,
    #[error("qcow2 version {0} is not supported (only 2 and 3)")]
    Version(u32),
    #[error("qcow2 cluster size 2^{0} is outside 512 B..2 MiB")]
    ClusterBits(u32),
    #[error(
        "encrypted qcow2 images are supported with LUKS (encrypt.format=luks) only, as the \
         image served (not as a backing file)"
    )]
    Encrypted,
    #[error("the encryption header pointer of an encrypted image is missing or outside the file")]
    CryptoHeader,
    #[error("qcow2 images with an external data file are not supported")]
    ExternalDataFile,
    #[error(
        "qcow2 extended L2 entries (subclusters) need clusters of 16 KiB at least, not 2^{0} bytes"
    )]
    ExtendedL2(u32),
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
    #[error("cannot read the qcow2 refcounts")]
    ReadRefcounts(#[source] ImageError),
    #[error("qcow2 metadata is inconsistent ({0}): serve it with --read-only or repair it with qemu-img check -r all")]
    Metadata(&'static str),
    #[error("qcow2 image has {0}, more than vublk (like QEMU) accepts")]
    Limit(&'static str),
    #[error("qcow2 persistent bitmaps cannot be read ({0}): serve it with --read-only, or remove them (qemu-img bitmap --remove) or repair it (qemu-img check -r all)")]
    Bitmaps(String),
    #[error("qcow2 persistent bitmaps cannot be written")]
    SaveBitmaps(#[source] ImageError),
}

/// How the image is served, fixed at open.
#[derive(Debug, Default)]
pub struct Qcow2Options {
    pub writable: bool,
    /// The L2 cache bound in bytes (None: [`Qcow2Image::default_l2_cache_bytes`]); at least
    /// 4 tables.
    pub l2_cache_bytes: Option<u64>,
    /// Punch the host range of clusters whose refcount drops to 0 (`--discard unmap`).
    pub punch_freed: bool,
    /// Preallocate ahead of the end of the file (None: off; the file is still sized over
    /// new clusters, as holes).
    pub prealloc: Option<PreallocParams>,
    /// A second handle of the image file for a background preallocation thread (None:
    /// preallocations run on the thread that allocates).
    pub prealloc_file: Option<File>,
    /// Store clusters written whole compressed (`--compress-writes on`).
    pub compress: Option<CompressOptions>,
    /// Accept a LUKS-encrypted image (the caller unlocks it: [`Qcow2Image::set_crypt`]);
    /// false: refuse it.
    pub encrypted: bool,
}

/// `--compress-writes on` and its cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CompressOptions {
    /// Pack chunks in memory and write whole host clusters (`--compressed-cache on`).
    pub cache: bool,
    /// The cache's bound in host clusters (at least 1).
    pub cache_clusters: usize,
}

/// Counters, readable at any time.
#[derive(Debug, Default)]
pub struct Qcow2Stats {
    /// Data clusters allocated from free space (refcount 0) instead of the end of the file.
    pub reused_clusters: AtomicU64,
    /// Copy-on-writes done without the allocation lock.
    pub cow_unlocked: AtomicU64,
    /// Extended L2 entries: writes that wrote only the subclusters they touch.
    pub subcluster_writes: AtomicU64,
    /// Clusters stored compressed, and written normally because they did not compress.
    pub compressed_clusters: AtomicU64,
    pub uncompressible_clusters: AtomicU64,
    /// Preallocations done, and skipped (failed or unsupported).
    pub preallocs_done: AtomicU64,
    pub preallocs_skipped: AtomicU64,
    /// L2 table lookups served from the cache, and read from the file.
    pub l2_hits: AtomicU64,
    pub l2_misses: AtomicU64,
}

/// Fills a cluster buffer with the guest disk's current contents at a cluster-aligned guest
/// offset (through the backing chain): what a copy-on-write keeps around new data.
pub type FillOld<'a> = dyn FnMut(u64, &mut [u8]) -> Result<(), ImageError> + 'a;

/// Allocation state of a writable image, behind the allocation lock. Metadata is written
/// back, not through: refcount chunks and L2 entries change in memory and reach the file in
/// dependency order on [`Qcow2Image::flush`] (refcount increases, barrier, L2 tables,
/// barrier, then the decrements those L2 changes allow), or earlier when the caches fill up.
struct WriteState {
    refcount_table: Vec<u64>,
    refcount_table_offset: u64,
    /// log2 of the refcount width in bits (0..=6).
    refcount_order: u32,
    /// Next cluster to allocate at the end of the file.
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
    prealloc: Option<Prealloc>,
    /// Refcount block chunks (min(4 KiB, cluster) each) by file offset: the current contents.
    refcount_chunks: HashMap<u64, Vec<u8>>,
    /// Chunks of `refcount_chunks` that differ from the file. They only ever hold increases
    /// or decreases whose L2 change is already durable, so they may be written at any time.
    dirty_chunks: crate::image::durable::DirtyChunks,
    /// Host clusters that lost a reference in an L2 change not yet durable: decremented
    /// after the L2 tables are written and synced (a crash before leaks, never corrupts).
    pending_decs: crate::image::durable::AfterDurable<u64>,
    /// Refcount chunks (or the file's new length: `extend_to`, preallocation) were written
    /// since the last sync: an L2 chunk that may name what they describe must wait for a
    /// sync.
    unsynced_refcounts: bool,
    /// An L2 entry changed since the last sync replaces a mapping whose contents mattered
    /// (see `write_l2_entry`): the data written into its new cluster must be durable before
    /// the entry is written back.
    unsynced_data: bool,
    /// Clusters in [next_free, reserved_end) have their refcount set to 1 ahead of being
    /// allocated (`alloc::reserve`), so that allocating them changes no refcount and the L2
    /// entries naming them wait for no sync. A crash leaks the unused ones (`qemu-img check
    /// -r leaks`); a clean close gives them back.
    reserved_end: u64,
}

/// An open qcow2 image.
pub struct Qcow2Image {
    pub version: u32,
    cluster_bits: u32,
    l2_bits: u32,
    /// Extended L2 entries (`extended_l2=on`): each L2 entry is two words, the cluster's
    /// descriptor and a bitmap of its 32 subclusters (bits 0-31 allocated, 32-63 zero).
    extended_l2: bool,
    /// The guest-visible size (grows with `grow`).
    size: AtomicU64,
    pub compression: Compression,
    /// The backing file name as stored in the header (relative to the image's directory).
    pub backing_file: Option<String>,
    /// Where the L1 table is (moves when an online resize needs a larger one).
    l1_offset: AtomicU64,
    /// Grows as clusters are allocated.
    file_size: AtomicU64,
    l1: RwLock<Vec<u64>>,
    /// Clusters holding metadata (header, tables, L2 tables, refcount blocks): a data write
    /// must never land in one (a hostile image could point an L2 entry at its own metadata).
    metadata: RwLock<metadata::MetadataMap>,
    l2_cache: Mutex<l2cache::L2Cache>,
    /// Present when opened writable: allocation state, behind the allocation lock.
    write: Option<Mutex<WriteState>>,
    /// First writes into fresh clusters in flight through the engine.
    fills: Arc<cow::Fills>,
    /// Guest clusters being copied on write without the allocation lock.
    cow: cow::CowClusters,
    /// `--compress-writes on`: clusters written whole are stored compressed.
    compress_writes: bool,
    comp: compress::CompCache,
    /// The background preallocation thread, when there is one.
    prealloc_bg: Background,
    /// Punch the host range of clusters whose refcount drops to 0 (`--discard unmap`).
    punch_freed: bool,
    /// L2 entries changed in the cache and not yet in the file (see [`Qcow2Image::publish`]).
    unpublished: crate::image::durable::Publication,
    /// The copy-on-write pool's data syncs (a new cluster's data before its entry), one
    /// `fdatasync` shared by the threads waiting at once.
    data_sync: crate::image::durable::GroupSync,
    /// Held by a write-back from copying the dirty L2 chunks until they are written (a
    /// publish writes them without the allocation lock), so that write-backs reach the file
    /// one at a time, in the order they copied. Taken after the allocation lock.
    write_back_io: Mutex<()>,
    pub stats: Qcow2Stats,
    /// Where the LUKS header is (offset, length), for an encrypted image.
    crypt_region: Option<(u64, u64)>,
    /// The unlocked volume of an encrypted image: data clusters are encrypted with it, the
    /// IV being the host offset (QEMU's `encrypt.format=luks`).
    crypt: std::sync::OnceLock<std::sync::Arc<crate::crypt::Volume>>,
    /// The persistent dirty bitmaps as the file holds them (`bitmap_store`).
    stored: Mutex<bitmap_store::Stored>,
}

impl std::fmt::Debug for Qcow2Image {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Qcow2Image")
            .field("version", &self.version)
            .field("cluster_bits", &self.cluster_bits)
            .field("size_bytes", &self.size_bytes())
            .finish()
    }
}

impl Qcow2Image {
    /// The guest-visible size in bytes.
    pub fn size_bytes(&self) -> u64 {
        self.size.load(Ordering::Acquire)
    }

    pub fn cluster_size(&self) -> u64 {
        1 << self.cluster_bits
    }

    /// Is the image open for writing?
    pub fn writable(&self) -> bool {
        self.write.is_some()
    }

    /// Does the image have extended L2 entries (subclusters)?
    pub fn extended_l2(&self) -> bool {
        self.extended_l2
    }

    /// Are clusters written whole stored compressed?
    pub fn compress_writes(&self) -> bool {
        self.compress_writes
    }

    /// The L2 cache bound in bytes and the guest bytes it maps.
    pub fn l2_cache_bytes(&self) -> (u64, u64) {
        let tables = self.lock_l2().capacity as u64;
        (
            tables << self.cluster_bits,
            tables << (self.cluster_bits + self.l2_bits),
        )
    }

    /// Preallocations done and skipped (failed or unsupported).
    pub fn prealloc_counts(&self) -> (u64, u64) {
        (
            self.stats.preallocs_done.load(Ordering::Relaxed),
            self.stats.preallocs_skipped.load(Ordering::Relaxed),
        )
    }

    /// The allocation lock (None: read-only image).
    fn lock_write(&self) -> Result<std::sync::MutexGuard<'_, WriteState>, ImageError> {
        let ws = self.write.as_ref().ok_or(ImageError::ReadOnly)?;
        Ok(ws.locked())
    }

    fn lock_l2(&self) -> std::sync::MutexGuard<'_, l2cache::L2Cache> {
        self.l2_cache.locked()
    }

    fn is_metadata(&self, host_cluster: u64) -> bool {
        self.metadata.read_locked().contains(host_cluster)
    }

    fn note_metadata(&self, host_cluster: u64) {
        self.metadata.write_locked().insert(host_cluster);
    }

    /// Metadata is rewritten in blocks of this size: never more than one cluster.
    fn meta_chunk(&self) -> u64 {
        self.cluster_size().min(4096)
    }

    fn file_len(&self) -> u64 {
        self.file_size.load(Ordering::Acquire)
    }
}
