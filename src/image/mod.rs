//! Disk images behind one interface. [`Image`] is what the data plane sees: it maps a read,
//! plans a write, zeroes or discards a range, writes back and closes, whatever the format.
//! Formats know nothing of virtio or io_uring: for raw images the guest's byte N is the
//! file's byte N, so there is nothing to plan; qcow2 and parallels map guest ranges to host
//! extents and allocate, and do the writes that must be ordered with their metadata
//! themselves (through [`Storage`]).
//!
//! An image is a [`Disk`]: a local file in a format, or a remote disk (an NBD export, an RBD
//! image) that its driver (`nbd::client`, `rbd`) serves like a raw one. The image makes each
//! queue's engine and binds it to its storage ([`Image::queue_engines`], [`Image::bind`]):
//! the data plane never asks what kind of disk it serves.
//!
//! Rooms: `options` (what opening is told, and why it fails), `probe` (formats by magic),
//! `open` (opening a local image in its format), `raw`, `qcow2/`, `parallels/`, `chain`
//! (backing files), `piece` (what a read resolves to), `prealloc` (the preallocation planner, executor and background thread),
//! `durable` (metadata written back later, releases after it is durable), `handover` (giving
//! the image to another process during a live migration and taking it back), `grow` (online
//! resize), `report` (counters for stats and logs), `create` (`vublk create`), `engine` (the
//! per-queue engines), `fills` (the fill protocol's waits), `remote` (remote disks: opening them through their drivers, and what
//! they do instead of a file), `lock` (QEMU's image locks), `bitmaps` (which disks keep dirty
//! bitmaps in their file, and the calls that keep them there), `reader` (synchronous reads
//! off the data path, and the disk's allocation: backups), `fuzz` (fuzzing entry points).

mod bitmaps;
pub mod chain;
mod commit;
pub mod create;
pub mod durable;
pub mod engine;
mod fills;
#[cfg(any(test, feature = "testing"))]
pub mod fuzz;
mod grow;
pub mod handover;
pub mod lock;
mod luks;
mod open;
mod options;
pub mod parallels;
mod piece;
pub mod prealloc;
mod probe;
pub mod qcow2;
mod raw;
mod reader;
mod remote;
mod report;
mod stream;

use std::fs::File;
use std::io;
use std::sync::atomic::Ordering;

pub use engine::{Engine, EngineChoice};
pub use grow::GrowError;
pub use options::{CompressChoice, Format, ImageOpenError, ImageOptions, PreallocChoice, RawFacts};
pub use piece::Piece;
pub use probe::{probe, probe_bytes};
pub use qcow2::FillGate;
pub use raw::{open_raw, OpenError, RawImage};
pub use reader::{Allocation, Reader};

use crate::locks::Locked;
use crate::offload::Pool;
use chain::Layer;
use parallels::ParallelsImage;
use qcow2::{CowInstall, Qcow2Image};

/// A data-path failure of an image format (host side: never the guest's fault).
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    #[error("I/O on the image file failed")]
    Io(#[source] io::Error),
    #[error("corrupt image metadata: {0}")]
    Corrupt(&'static str),
    #[error("the image is read-only")]
    ReadOnly,
    #[error("the image is full: a host offset would not fit its table entries")]
    Full,
    #[error("an earlier write of the compressed-write cache failed: compressed data was lost")]
    CompressedDataLost,
    #[error("{0}")]
    Unsupported(String),
    #[error(
        "the image is not active here (handed over to another process, or not yet taken over \
         from one: live migration)"
    )]
    Inactive,
}

impl From<io::Error> for ImageError {
    fn from(e: io::Error) -> Self {
        ImageError::Io(e)
    }
}

/// How DISCARD, WRITE_ZEROES and detected zero writes treat whole clusters of a format.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ZeroMode {
    /// Zeroes, keeping an owned allocation (WRITE_ZEROES without unmap, detect-zeroes on).
    Keep,
    /// Zeroes, releasing the space (WRITE_ZEROES with unmap and `--discard unmap`).
    Unmap,
    /// Unallocate; partial clusters are left as they are (DISCARD with `--discard unmap`).
    Discard,
}

/// Where a write goes.
#[derive(Debug)]
pub enum WritePlan {
    /// Through the engine, like a raw write.
    Engine(EngineWrite),
    /// Through the format (allocation, copy-on-write, compression), which orders the data
    /// with its metadata: [`Image::write_through_format`], on a pool thread when
    /// [`Image::pool`] has one for this kind.
    Format(Offload),
}

/// A write through the engine into the image file.
#[derive(Debug)]
pub struct EngineWrite {
    /// Host offset of the write's first byte.
    pub host: u64,
    /// Write this whole host range instead (start, length): new clusters written whole,
    /// zeroes around the data.
    pub whole: Option<(u64, u64)>,
    /// Hand back to [`Image::end_write`] once the write has completed, before the guest
    /// sees the request complete.
    pub ticket: Option<WriteTicket>,
    /// An overwrite of clusters the image owns: hold the range with
    /// [`Image::hold_overwrite`] before it goes to the engine.
    pub overwrite: bool,
}

/// Which thread a write through the format runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Offload {
    /// The compression pool (`--compress-threads`).
    Compress,
    /// The copy-on-write pool (`--cow-threads`).
    Cow,
    /// The queue thread.
    Inline,
}

/// What an asynchronous write holds until it completes.
#[derive(Debug)]
pub struct WriteTicket(Ticket);

#[derive(Debug)]
enum Ticket {
    /// A fill (whole-cluster first write of fresh clusters): its range key.
    Fill(u64),
    /// New clusters whose L2 entries are installed on completion.
    Install(CowInstall),
    /// A shared range held by an in-place overwrite while fills are in flight.
    Overwrite(u64),
}

/// A guest read, planned: the pieces of the image and its backing files it consists of.
#[derive(Debug, Default)]
pub struct ReadPlan {
    pub pieces: Vec<Piece>,
    scratch: Vec<qcow2::Extent>,
}

/// Where an image's data lives. One per image, never moved on the data path: its size is
/// no issue.
#[allow(clippy::large_enum_variant)]
enum Disk {
    /// A file on this host, in a format.
    Local(Local),
    /// Elsewhere (an NBD export, an RBD image): its driver's engines serve it like a raw
    /// image; there is no file here.
    Remote(remote::Remote),
}

/// A local image: its file and its format.
struct Local {
    file: File,
    kind: Kind,
}

/// The format of a local image, with its state. One per image, never moved on the data
/// path: its size is no issue.
#[allow(clippy::large_enum_variant)]
enum Kind {
    Raw,
    /// Raw data encrypted under a LUKS header.
    Luks(luks::LuksDisk),
    Qcow2(Qcow2Disk),
    Parallels(ParallelsImage),
}

/// A qcow2 image with its backing chain and the pools its writes through the format use.
struct Qcow2Disk {
    q: Qcow2Image,
    /// The backing chain below it, nearest first.
    backing: Vec<Layer>,
    /// `--cow-threads` (None: on the queue threads).
    cow_pool: Option<Pool>,
    /// `--compress-threads` (None: on the queue threads).
    compress_pool: Option<Pool>,
}

/// An open disk image.
pub struct Image {
    disk: Disk,
    /// The guest-visible size (grows with [`Image::grow`]).
    size_bytes: std::sync::atomic::AtomicU64,
    read_only: bool,
    /// The image file is a block device (its size is its own).
    block_device: bool,
    /// `--prealloc on`: a raw file grown online is allocated (fallocate), not sparse.
    prealloc_raw: bool,
    /// The format was probed as raw: refuse guest writes that would make the image probe as
    /// another format next time (a guest planting a qcow2 header naming a host file).
    guard_header: bool,
    /// The local file's locks, held while it is open (or until `release_locks`).
    lock: std::sync::Mutex<lock::ImageLock>,
    /// False for an image handed over to another process, or not yet taken over from one
    /// (`handover`): nothing is read, planned or written through it, not even on drop.
    active: std::sync::atomic::AtomicBool,
}

impl std::fmt::Debug for Image {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Image")
            .field("format", &self.format())
            .field("size_bytes", &self.size_bytes())
            .field("read_only", &self.read_only)
            .field("active", &self.is_active())
            .finish()
    }
}

impl Image {
    /// A raw image over `file` (tests and tools; the daemon uses [`Image::open`]).
    pub fn raw(file: File, size_bytes: u64, read_only: bool) -> Self {
        Image {
            disk: Disk::Local(Local {
                file,
                kind: Kind::Raw,
            }),
            size_bytes: std::sync::atomic::AtomicU64::new(size_bytes),
            read_only,
            block_device: false,
            prealloc_raw: false,
            guard_header: false,
            lock: std::sync::Mutex::new(lock::ImageLock::unlocked()),
            active: std::sync::atomic::AtomicBool::new(true),
        }
    }

    /// Is the image served by this process (see `handover`)?
    pub fn is_active(&self) -> bool {
        self.active.load(Ordering::Acquire)
    }

    /// From now on nothing is read, planned or written through this handle.
    fn deactivate(&self) {
        self.active.store(false, Ordering::Release);
    }

    fn check_active(&self) -> Result<(), ImageError> {
        if self.is_active() {
            Ok(())
        } else {
            Err(ImageError::Inactive)
        }
    }

    /// Refuse guest writes at offset 0 that carry a format's magic (see
    /// [`Self::guards_format_header`]).
    pub fn guard_format_header(mut self, on: bool) -> Self {
        self.guard_header = on;
        self
    }

    pub fn format(&self) -> Format {
        match self.local_kind() {
            // Remote disks hold raw data, in the cluster or on the server.
            None | Some(Kind::Raw) => Format::Raw,
            Some(Kind::Qcow2(_)) => Format::Qcow2,
            Some(Kind::Parallels(_)) => Format::Parallels,
            Some(Kind::Luks(_)) => Format::Luks,
        }
    }

    /// The volume of an encrypted image: what the engine reads is decrypted with it, what
    /// it writes encrypted first (host offsets; whole sectors).
    pub fn cipher(&self) -> Option<&crate::crypt::Volume> {
        match self.local_kind() {
            Some(Kind::Luks(l)) => Some(&l.vol),
            Some(Kind::Qcow2(d)) => d.q.crypt(),
            _ => None,
        }
    }

    /// The local format, None for a remote disk.
    fn local_kind(&self) -> Option<&Kind> {
        match &self.disk {
            Disk::Local(l) => Some(&l.kind),
            Disk::Remote(_) => None,
        }
    }

    /// A local qcow2 image: its file and state.
    fn qcow2(&self) -> Option<(&File, &Qcow2Disk)> {
        match &self.disk {
            Disk::Local(Local {
                file,
                kind: Kind::Qcow2(d),
            }) => Some((file, d)),
            _ => None,
        }
    }

    /// The image file, if the image is a local one.
    pub fn file(&self) -> Option<&File> {
        match &self.disk {
            Disk::Local(l) => Some(&l.file),
            Disk::Remote(_) => None,
        }
    }

    /// The file offset of guest byte `offset` of a raw image (past the header of an
    /// encrypted one).
    pub fn raw_host(&self, offset: u64) -> u64 {
        match self.local_kind() {
            Some(Kind::Luks(l)) => l.host(offset),
            _ => offset,
        }
    }

    /// The guest-visible size in bytes.
    pub fn size_bytes(&self) -> u64 {
        self.size_bytes.load(Ordering::Acquire)
    }

    /// Host I/O must stay below this offset (raw: the file is the disk); None where the
    /// file may end anywhere (formats: reads past its end are zeroes).
    pub fn host_limit(&self) -> Option<u64> {
        match self.local_kind() {
            None | Some(Kind::Raw) => Some(self.size_bytes()),
            Some(Kind::Luks(l)) => Some(l.host(self.size_bytes())),
            Some(_) => None,
        }
    }

    /// A short read of the image file is its end (a qcow2 file may end inside its last
    /// cluster): the rest reads as zeroes.
    pub fn short_reads_are_zeroes(&self) -> bool {
        self.qcow2().is_some()
    }

    /// The file of chain layer `layer` (0: the image itself).
    fn layer_file(&self, layer: usize) -> Option<&File> {
        match (&self.disk, layer) {
            (Disk::Local(l), 0) => Some(&l.file),
            (Disk::Local(l), n) => match &l.kind {
                Kind::Qcow2(d) => d.backing.get(n - 1).map(|l| &l.file),
                _ => None,
            },
            (Disk::Remote(_), _) => None,
        }
    }

    /// How many files the disk has (its layers: the image and its backing files), which
    /// [`Engine::push`] names by index.
    pub fn layers(&self) -> usize {
        match &self.disk {
            Disk::Local(Local {
                kind: Kind::Qcow2(d),
                ..
            }) => 1 + d.backing.len(),
            _ => 1,
        }
    }

    /// The qcow2 mapping of chain layer `layer`, if it is a qcow2 image.
    fn layer_qcow2(&self, layer: usize) -> Option<&Qcow2Image> {
        match (self.qcow2(), layer) {
            (Some((_, d)), 0) => Some(&d.q),
            (Some((_, d)), n) => d.backing.get(n - 1).and_then(|l| l.qcow2.as_ref()),
            _ => None,
        }
    }

    /// Map a guest read of [offset, offset + len) (inside the image). Some(host offset)
    /// when it is one run of the image file (zero-copy, like raw); else None, with the
    /// pieces in `plan`.
    pub fn plan_read(
        &self,
        offset: u64,
        len: u64,
        plan: &mut ReadPlan,
    ) -> Result<Option<u64>, ImageError> {
        plan.pieces.clear();
        self.check_active()?;
        let Disk::Local(l) = &self.disk else {
            return Ok(Some(offset));
        };
        match &l.kind {
            Kind::Raw => return Ok(Some(offset)),
            Kind::Luks(l) => {
                l.check(offset, len)?;
                return Ok(Some(l.host(offset)));
            }
            Kind::Parallels(p) => p.map(offset, len, &mut plan.pieces),
            Kind::Qcow2(d) => chain::resolve_read(
                &d.q,
                &l.file,
                &d.backing,
                offset,
                len,
                &mut plan.scratch,
                &mut plan.pieces,
            )?,
        }
        Ok(match plan.pieces[..] {
            [Piece::Data {
                layer: 0,
                host_offset,
                ..
            }] => Some(host_offset),
            _ => None,
        })
    }

    /// Fill `dst` (the piece's length) with a piece that is not read through the engine:
    /// zeroes, or a compressed cluster decompressed (through `cluster_buf`).
    pub fn read_piece(
        &self,
        piece: &Piece,
        dst: &mut [u8],
        cluster_buf: &mut Vec<u8>,
    ) -> Result<(), ImageError> {
        match *piece {
            Piece::Zero { .. } => dst.fill(0),
            Piece::Data { .. } => return Err(ImageError::Corrupt("data piece read as zeroes")),
            Piece::Compressed {
                layer,
                host_offset,
                compressed_len,
                skip,
                ..
            } => {
                let (Some(file), Some(q)) = (self.layer_file(layer), self.layer_qcow2(layer))
                else {
                    return Err(ImageError::Corrupt("compressed data in a raw layer"));
                };
                cluster_buf.resize(q.cluster_size() as usize, 0);
                q.decompress(file, host_offset, compressed_len, cluster_buf)?;
                let skip = skip as usize;
                let src = cluster_buf
                    .get(skip..skip + dst.len())
                    .ok_or(ImageError::Corrupt("compressed piece outside its cluster"))?;
                dst.copy_from_slice(src);
            }
        }
        Ok(())
    }

    /// Plan a guest write of [offset, offset + len) (inside the image). `writeback`: the
    /// guest's write cache is on (write-through needs allocations made durable with the
    /// data, which only the format's own path does).
    pub fn plan_write(
        &self,
        offset: u64,
        len: u64,
        writeback: bool,
    ) -> Result<WritePlan, ImageError> {
        self.check_active()?;
        let engine = |host, overwrite| {
            WritePlan::Engine(EngineWrite {
                host,
                whole: None,
                ticket: None,
                overwrite,
            })
        };
        let Disk::Local(Local { file, kind }) = &self.disk else {
            return Ok(engine(offset, false));
        };
        match kind {
            Kind::Raw => Ok(engine(offset, false)),
            Kind::Luks(l) => {
                l.check(offset, len)?;
                Ok(engine(l.host(offset), false))
            }
            Kind::Parallels(p) => {
                // Allocated and contiguous: in place. Else allocate here (new clusters read
                // as zeroes, so no fill is needed); write-through and scattered clusters
                // take the format's path, which also makes a new allocation durable.
                let host = match p.owned_extent(offset, len) {
                    Some(host) => Some(host),
                    None if writeback => p.allocate(file, offset, len)?,
                    None => None,
                };
                Ok(host.map_or(WritePlan::Format(Offload::Inline), |h| engine(h, false)))
            }
            Kind::Qcow2(d) => {
                let q = &d.q;
                if q.compress_writes() {
                    // Compressed clusters are built, packed and written by the format.
                    return Ok(WritePlan::Format(Offload::Compress));
                }
                // Owned alone and contiguous: in place, like raw.
                if let Some(host) = q.owned_extent(file, offset, len)? {
                    return Ok(engine(host, true));
                }
                // Fresh clusters whose old contents are zeroes (or whole clusters over the
                // backing file): allocated here, written through the engine.
                let fresh = if !writeback {
                    None
                } else if q.extended_l2() && !d.backing.is_empty() {
                    // Subclusters over the backing file: only the ones written.
                    match q.plan_subcluster_write(file, offset, len)? {
                        Some(w) => Some(w),
                        None => q.plan_fresh_write(file, offset, len, true)?,
                    }
                } else {
                    q.plan_fresh_write(file, offset, len, !d.backing.is_empty())?
                };
                let Some(fw) = fresh else {
                    return Ok(WritePlan::Format(Offload::Cow));
                };
                let (whole, ticket) = match (fw.fill, fw.install) {
                    (Some(f), _) => (Some((f.start, f.len)), Some(Ticket::Fill(f.key))),
                    (None, Some(i)) => (None, Some(Ticket::Install(i))),
                    (None, None) => (None, None),
                };
                Ok(WritePlan::Engine(EngineWrite {
                    host: fw.host,
                    whole,
                    ticket: ticket.map(WriteTicket),
                    overwrite: false,
                }))
            }
        }
    }

    /// A planned engine write cannot go through the engine after all (it is smaller than
    /// the file's direct-I/O block): where it goes instead. None: the caller
    /// read-modify-writes it (raw; remote disks take any alignment their block size
    /// allows, so never get here).
    pub fn sub_block_fallback(&self) -> Option<Offload> {
        match self.local_kind() {
            None | Some(Kind::Raw | Kind::Luks(_)) => None,
            Some(Kind::Qcow2(_)) => Some(Offload::Cow),
            Some(Kind::Parallels(_)) => Some(Offload::Inline),
        }
    }

    /// An asynchronous write holding `ticket` completed (`ok`) or failed: install its
    /// clusters (or give them back) and release what it held.
    pub fn end_write(&self, ticket: WriteTicket, ok: bool) -> Result<(), ImageError> {
        let Some((file, d)) = self.qcow2() else {
            return Ok(());
        };
        match ticket.0 {
            Ticket::Fill(key) => d.q.end_fill(key),
            Ticket::Install(install) => return d.q.finish_cow(file, install, ok),
            Ticket::Overwrite(key) => d.q.release_overwrite(key),
        }
        Ok(())
    }

    /// The pool for writes through the format of this kind, if there is one.
    pub fn pool(&self, offload: Offload) -> Option<&Pool> {
        match (self.qcow2(), offload) {
            (Some((_, d)), Offload::Compress) => d.compress_pool.as_ref(),
            (Some((_, d)), Offload::Cow) => d.cow_pool.as_ref(),
            _ => None,
        }
    }

    /// Does publishing cost a sync nearly every time, so that completions are better
    /// published in batches (`--compress-writes on`: each publish makes the unfinished
    /// compressed run, its refcounts and L2 entries durable in order)?
    pub fn publishes_in_batches(&self) -> bool {
        self.qcow2().is_some_and(|(_, d)| d.q.compress_writes())
    }

    /// Are there pools at all (a queue then needs an inbox for their results)?
    pub fn has_pools(&self) -> bool {
        self.qcow2()
            .is_some_and(|(_, d)| d.cow_pool.is_some() || d.compress_pool.is_some())
            || self.cipher().is_some_and(|v| v.threads() > 0)
    }

    /// Write `data` at guest `offset` through the format (allocating, copying on write,
    /// compressing), synchronously; with `durable`, metadata and data are synced before it
    /// returns (write-through).
    pub fn write_through_format(
        &self,
        offset: u64,
        data: &[u8],
        durable: bool,
    ) -> Result<(), ImageError> {
        self.check_active()?;
        let Disk::Local(Local { file, kind }) = &self.disk else {
            return Err(ImageError::Unsupported(
                "a remote disk is written by its engine".into(),
            ));
        };
        match kind {
            Kind::Raw => crate::io::aligned::write_all_aligned(file, offset, data)?,
            Kind::Luks(l) => l.write(file, offset, data)?,
            Kind::Parallels(p) => p.write(file, offset, data)?,
            Kind::Qcow2(d) => {
                let mut fill_old = |cl: u64, buf: &mut [u8]| self.read_guest_cluster(d, cl, buf);
                d.q.write(file, offset, data, &mut fill_old)?;
            }
        }
        if durable {
            self.sync()?;
        }
        Ok(())
    }

    /// Read a whole cluster of the guest disk (through the backing chain), synchronously:
    /// the old contents a copy-on-write keeps around the new data.
    fn read_guest_cluster(
        &self,
        d: &Qcow2Disk,
        cl_start: u64,
        buf: &mut [u8],
    ) -> Result<(), ImageError> {
        self.read_layer_cluster(d, 0, cl_start, buf)
    }

    /// DISCARD / WRITE_ZEROES go through the format ([`Self::zero_range`]) rather than the
    /// engine's fallocate (raw, remote disks).
    pub fn zeroes_through_format(&self) -> bool {
        matches!(
            self.local_kind(),
            Some(Kind::Qcow2(_) | Kind::Parallels(_) | Kind::Luks(_))
        )
    }

    /// Zero or discard [offset, offset + len) through the format, synchronously.
    pub fn zero_range(&self, offset: u64, len: u64, mode: ZeroMode) -> Result<(), ImageError> {
        self.check_active()?;
        let Disk::Local(Local { file, kind }) = &self.disk else {
            return Err(ImageError::Corrupt(
                "remote disks are zeroed by their engine",
            ));
        };
        match kind {
            Kind::Raw => Err(ImageError::Corrupt("raw images are zeroed by the engine")),
            // Discards are not passed down (see `luks`); zeroes are encrypted zeroes.
            Kind::Luks(_) if mode == ZeroMode::Discard => Ok(()),
            Kind::Luks(l) => l.zero(file, offset, len),
            Kind::Parallels(p) => p.zero_range(file, offset, len, mode),
            Kind::Qcow2(d) => {
                let mut fill_old = |cl: u64, buf: &mut [u8]| self.read_guest_cluster(d, cl, buf);
                d.q.zero_range(
                    file,
                    offset,
                    len,
                    mode,
                    !d.backing.is_empty(),
                    &mut fill_old,
                )
            }
        }
    }

    /// Write back format metadata (without syncing: FLUSH syncs after it).
    pub fn write_back(&self) -> Result<(), ImageError> {
        if !self.is_active() {
            return Ok(());
        }
        let Disk::Local(Local { file, kind }) = &self.disk else {
            return Ok(());
        };
        match kind {
            Kind::Raw | Kind::Luks(_) => Ok(()),
            Kind::Parallels(p) => p.flush(file),
            Kind::Qcow2(d) => d.q.flush(file),
        }
    }

    /// Metadata that requests about to complete depend on, put into the file (not synced):
    /// what a new process finds after this one is killed. A no-op for raw images and when
    /// nothing changed.
    pub fn publish(&self) -> Result<(), ImageError> {
        if !self.is_active() {
            return Ok(());
        }
        let Disk::Local(Local { file, kind }) = &self.disk else {
            return Ok(());
        };
        match kind {
            Kind::Raw | Kind::Luks(_) => Ok(()),
            Kind::Parallels(p) => p.publish(file),
            Kind::Qcow2(d) => d.q.publish(file),
        }
    }

    /// Everything completed so far durable: format metadata, then the file.
    pub fn sync(&self) -> Result<(), ImageError> {
        if !self.is_active() {
            return Ok(());
        }
        match &self.disk {
            Disk::Remote(r) => r.sync(),
            Disk::Local(l) => {
                self.write_back()?;
                Ok(l.file.sync_data()?)
            }
        }
    }

    /// Clean shutdown: metadata written back, the file trimmed to its data (formats keep
    /// their files ahead of allocations while serving), everything synced.
    pub fn close(&self) -> Result<(), ImageError> {
        if !self.is_active() {
            return Ok(());
        }
        match &self.disk {
            Disk::Remote(r) => r.close(),
            Disk::Local(Local { file, kind }) => {
                match kind {
                    Kind::Raw | Kind::Luks(_) => {}
                    Kind::Parallels(p) => p.close(file)?,
                    Kind::Qcow2(d) => d.q.close(file)?,
                }
                Ok(file.sync_data()?)
            }
        }
    }

    /// A clean exit, after `close` and `release_locks`: let go of what the image holds
    /// outside this process now rather than when the process is gone (an RBD image's
    /// handle and cluster connection: its watch on the image, which `rbd status` lists, and
    /// its session). Nothing is served through the image afterwards.
    pub fn disconnect(&self) {
        if let Disk::Remote(r) = &self.disk {
            r.disconnect();
        }
    }

    /// Give up the image's and its backing files' locks (a clean exit, after `close`).
    pub fn release_locks(&self) {
        match &self.disk {
            Disk::Remote(r) => r.release_lock(),
            Disk::Local(l) => {
                self.lock.locked().release(&l.file);
                if let Kind::Qcow2(d) = &l.kind {
                    for layer in &d.backing {
                        layer.lock.locked().release(&layer.file);
                    }
                }
            }
        }
    }
}

impl Drop for Image {
    /// Never leave format metadata only in memory: whatever path ends the daemon, the image
    /// on disk describes every completed write (made durable only by FLUSH or a sync).
    fn drop(&mut self) {
        if !self.is_active() {
            return;
        }
        if let Some((file, d)) = self.qcow2() {
            if let Err(e) = d.q.close(file) {
                log::error!(
                    "writing back image metadata: {}",
                    crate::logging::error_chain(&e)
                );
            }
        }
    }
}
