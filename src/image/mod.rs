//! Disk images behind one interface. [`Image`] is what the data plane sees: it maps a read,
//! plans a write, zeroes or discards a range, writes back and closes, whatever the format.
//! Formats know nothing of virtio or io_uring: for raw images the guest's byte N is the
//! file's byte N, so there is nothing to plan; qcow2 and parallels map guest ranges to host
//! extents and allocate, and do the writes that must be ordered with their metadata
//! themselves (through [`Storage`]).
//!
//! Rooms: `open` (options, probing by magic, opening a format), `raw`, `qcow2/`,
//! `parallels/`, `chain` (backing files), `prealloc` (the preallocation planner, executor
//! and background thread), `durable` (metadata written back later, releases after it is
//! durable), `handover` (giving the image to another process during a live migration and
//! taking it back), `grow` (online resize), `report` (counters for stats and logs), `create` (`vublk create`), `fuzz` (fuzzing entry points), `rbd` (Ceph RBD images through librbd) and `nbd` (NBD exports), served like raw
//! images by their engines, with what they share in `remote`.

pub mod chain;
pub mod create;
pub mod durable;
pub mod engine;
#[cfg(any(test, feature = "testing"))]
pub mod fuzz;
mod grow;
pub mod handover;
pub mod lock;
mod open;
pub mod parallels;
pub mod prealloc;
pub mod qcow2;
mod raw;
#[cfg(feature = "rbd")]
mod rbd;
mod remote;
mod report;

use std::fs::File;
use std::io;
use std::sync::atomic::Ordering;

pub use chain::Piece;
pub use engine::Engine;
pub use grow::GrowError;
pub use open::{
    probe, probe_bytes, CephOptions, CompressChoice, Format, ImageOpenError, ImageOptions,
    PreallocChoice, RawFacts, RbdCache,
};
pub use qcow2::FillGate;
pub use raw::{open_raw, OpenError, RawImage};

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
    /// An overwrite of clusters the image owns: while fills are in flight
    /// ([`Image::fills_in_flight`]) the range must be held ([`Image::try_hold_overwrite`]).
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

/// The format of an open image, with its state. One per image, never moved on the data
/// path: its size is no issue.
#[allow(clippy::large_enum_variant)]
enum Kind {
    Raw,
    Qcow2(Qcow2Disk),
    Parallels(ParallelsImage),
    /// An NBD export (`file` is /dev/null, never used: the NBD engine does every access).
    Nbd(crate::nbd::client::NbdDisk),
    /// A Ceph RBD image (`file` is /dev/null, never used: librbd does every access).
    #[cfg(feature = "rbd")]
    Rbd(rbd::RbdDisk),
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
    file: File,
    kind: Kind,
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
    /// The image's locks, held while `file` is open (or until `release_locks`).
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
            file,
            kind: Kind::Raw,
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
        match self.kind {
            Kind::Raw => Format::Raw,
            Kind::Qcow2(_) => Format::Qcow2,
            Kind::Parallels(_) => Format::Parallels,
            // Raw data, in the cluster, or on the server.
            #[cfg(feature = "rbd")]
            Kind::Rbd(_) => Format::Raw,
            Kind::Nbd(_) => Format::Raw,
        }
    }

    /// The image file (layer 0).
    pub fn file(&self) -> &File {
        &self.file
    }

    /// The guest-visible size in bytes.
    pub fn size_bytes(&self) -> u64 {
        self.size_bytes.load(Ordering::Acquire)
    }

    /// Host I/O must stay below this offset (raw: the file is the disk); None where the
    /// file may end anywhere (formats: reads past its end are zeroes).
    pub fn host_limit(&self) -> Option<u64> {
        if matches!(self.kind, Kind::Raw) || self.is_remote() {
            Some(self.size_bytes())
        } else {
            None
        }
    }

    /// A short read of the image file is its end (a qcow2 file may end inside its last
    /// cluster): the rest reads as zeroes.
    pub fn short_reads_are_zeroes(&self) -> bool {
        matches!(self.kind, Kind::Qcow2(_))
    }

    /// The file of chain layer `layer` (0: the image itself).
    pub fn layer_file(&self, layer: usize) -> Option<&File> {
        match (&self.kind, layer) {
            (_, 0) => Some(&self.file),
            (Kind::Qcow2(d), n) => d.backing.get(n - 1).map(|l| &l.file),
            _ => None,
        }
    }

    /// The qcow2 mapping of chain layer `layer`, if it is a qcow2 image.
    fn layer_qcow2(&self, layer: usize) -> Option<&Qcow2Image> {
        match (&self.kind, layer) {
            (Kind::Qcow2(d), 0) => Some(&d.q),
            (Kind::Qcow2(d), n) => d.backing.get(n - 1).and_then(|l| l.qcow2.as_ref()),
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
        match &self.kind {
            Kind::Raw => return Ok(Some(offset)),
            #[cfg(feature = "rbd")]
            Kind::Rbd(_) => return Ok(Some(offset)),
            Kind::Nbd(_) => return Ok(Some(offset)),
            Kind::Parallels(p) => p.map(offset, len, &mut plan.pieces),
            Kind::Qcow2(d) => chain::resolve_read(
                &d.q,
                &self.file,
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
        match &self.kind {
            Kind::Raw => Ok(engine(offset, false)),
            #[cfg(feature = "rbd")]
            Kind::Rbd(_) => Ok(engine(offset, false)),
            Kind::Nbd(_) => Ok(engine(offset, false)),
            Kind::Parallels(p) => {
                // Allocated and contiguous: in place. Else allocate here (new clusters read
                // as zeroes, so no fill is needed); write-through and scattered clusters
                // take the format's path, which also makes a new allocation durable.
                let host = match p.owned_extent(offset, len) {
                    Some(host) => Some(host),
                    None if writeback => p.allocate(&self.file, offset, len)?,
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
                if let Some(host) = q.owned_extent(&self.file, offset, len)? {
                    return Ok(engine(host, true));
                }
                // Fresh clusters whose old contents are zeroes (or whole clusters over the
                // backing file): allocated here, written through the engine.
                let fresh = if writeback {
                    q.plan_fresh_write(&self.file, offset, len, !d.backing.is_empty())?
                } else {
                    None
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
    /// read-modify-writes it (raw).
    pub fn sub_block_fallback(&self) -> Option<Offload> {
        match self.kind {
            Kind::Raw => None,
            Kind::Qcow2(_) => Some(Offload::Cow),
            Kind::Parallels(_) => Some(Offload::Inline),
            // librbd takes any alignment: never smaller than a block.
            #[cfg(feature = "rbd")]
            Kind::Rbd(_) => None,
            // The engine splits and the device's block size is at least the server's.
            Kind::Nbd(_) => None,
        }
    }

    /// An asynchronous write holding `ticket` completed (`ok`) or failed: install its
    /// clusters (or give them back) and release what it held.
    pub fn end_write(&self, ticket: WriteTicket, ok: bool) -> Result<(), ImageError> {
        let Kind::Qcow2(d) = &self.kind else {
            return Ok(());
        };
        match ticket.0 {
            Ticket::Fill(key) => d.q.end_fill(key),
            Ticket::Install(install) => return d.q.finish_cow(&self.file, install, ok),
            Ticket::Overwrite(key) => d.q.release_overwrite(key),
        }
        Ok(())
    }

    /// Stop new fills (first writes of fresh clusters through the engine) until the gate is
    /// dropped; the caller then waits for those in flight ([`FillGate::wait_drained`])
    /// before writing through the format. None: this format has no fills.
    pub fn raise_fill_gate(&self) -> Option<FillGate> {
        match &self.kind {
            Kind::Qcow2(d) => Some(d.q.raise_fill_gate()),
            _ => None,
        }
    }

    /// Is any fill in flight?
    pub fn fills_in_flight(&self) -> bool {
        match &self.kind {
            Kind::Qcow2(d) => d.q.fills_in_flight(),
            _ => false,
        }
    }

    /// Hold [start, end) of the file for an overwrite while fills are in flight; None while
    /// a fill of it is in flight (complete this queue's own work, [`Self::wait_fill_change`],
    /// try again).
    pub fn try_hold_overwrite(&self, start: u64, end: u64) -> Option<WriteTicket> {
        match &self.kind {
            Kind::Qcow2(d) => {
                d.q.try_hold_overwrite(start, end)
                    .map(|k| WriteTicket(Ticket::Overwrite(k)))
            }
            _ => None,
        }
    }

    /// Wait at most `timeout` for a fill to end.
    pub fn wait_fill_change(&self, timeout: std::time::Duration) {
        if let Kind::Qcow2(d) = &self.kind {
            d.q.wait_fill_change(timeout);
        }
    }

    /// The pool for writes through the format of this kind, if there is one.
    pub fn pool(&self, offload: Offload) -> Option<&Pool> {
        match (&self.kind, offload) {
            (Kind::Qcow2(d), Offload::Compress) => d.compress_pool.as_ref(),
            (Kind::Qcow2(d), Offload::Cow) => d.cow_pool.as_ref(),
            _ => None,
        }
    }

    /// Does publishing cost a sync nearly every time, so that completions are better
    /// published in batches (`--compress-writes on`: each publish makes the unfinished
    /// compressed run, its refcounts and L2 entries durable in order)?
    pub fn publishes_in_batches(&self) -> bool {
        matches!(&self.kind, Kind::Qcow2(d) if d.q.compress_writes())
    }

    /// Are there pools at all (a queue then needs an inbox for their results)?
    pub fn has_pools(&self) -> bool {
        matches!(&self.kind, Kind::Qcow2(d) if d.cow_pool.is_some() || d.compress_pool.is_some())
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
        match &self.kind {
            Kind::Raw => crate::io::aligned::write_all_aligned(&self.file, offset, data)?,
            #[cfg(feature = "rbd")]
            Kind::Rbd(_) => {
                return Err(ImageError::Unsupported(
                    "RBD images are written by the librbd engine".into(),
                ))
            }
            Kind::Nbd(_) => {
                return Err(ImageError::Unsupported(
                    "NBD exports are written by the NBD engine".into(),
                ))
            }
            Kind::Parallels(p) => p.write(&self.file, offset, data)?,
            Kind::Qcow2(d) => {
                let mut fill_old = |cl: u64, buf: &mut [u8]| self.read_guest_cluster(d, cl, buf);
                d.q.write(&self.file, offset, data, &mut fill_old)?;
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
        // The last cluster may extend past the virtual size: only map what exists.
        let len = (buf.len() as u64).min(d.q.size_bytes().saturating_sub(cl_start));
        buf.fill(0);
        let mut plan = ReadPlan::default();
        chain::resolve_read(
            &d.q,
            &self.file,
            &d.backing,
            cl_start,
            len,
            &mut plan.scratch,
            &mut plan.pieces,
        )?;
        let mut pos = 0usize;
        let mut cluster_buf = Vec::new();
        for p in &plan.pieces {
            let n = p.len() as usize;
            let dst = buf
                .get_mut(pos..pos + n)
                .ok_or(ImageError::Corrupt("plan longer than the cluster"))?;
            match *p {
                Piece::Zero { .. } => {}
                Piece::Data {
                    layer, host_offset, ..
                } => {
                    let file = self
                        .layer_file(layer)
                        .ok_or(ImageError::Corrupt("bad layer"))?;
                    let data = crate::io::aligned::read_aligned(file, host_offset, n)?;
                    dst.copy_from_slice(&data);
                }
                Piece::Compressed { .. } => self.read_piece(p, dst, &mut cluster_buf)?,
            }
            pos += n;
        }
        Ok(())
    }

    /// DISCARD / WRITE_ZEROES go through the format ([`Self::zero_range`]) rather than the
    /// engine's fallocate (raw).
    pub fn zeroes_through_format(&self) -> bool {
        !matches!(self.kind, Kind::Raw) && !self.is_remote()
    }

    /// Zero or discard [offset, offset + len) through the format, synchronously.
    pub fn zero_range(&self, offset: u64, len: u64, mode: ZeroMode) -> Result<(), ImageError> {
        self.check_active()?;
        match &self.kind {
            Kind::Raw => Err(ImageError::Corrupt("raw images are zeroed by the engine")),
            #[cfg(feature = "rbd")]
            Kind::Rbd(_) => Err(ImageError::Corrupt("RBD images are zeroed by the engine")),
            Kind::Nbd(_) => Err(ImageError::Corrupt("NBD exports are zeroed by the engine")),
            Kind::Parallels(p) => p.zero_range(&self.file, offset, len, mode),
            Kind::Qcow2(d) => {
                let mut fill_old = |cl: u64, buf: &mut [u8]| self.read_guest_cluster(d, cl, buf);
                d.q.zero_range(
                    &self.file,
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
        match &self.kind {
            Kind::Raw => Ok(()),
            #[cfg(feature = "rbd")]
            Kind::Rbd(_) => Ok(()),
            Kind::Nbd(_) => Ok(()),
            Kind::Parallels(p) => p.flush(&self.file),
            Kind::Qcow2(d) => d.q.flush(&self.file),
        }
    }

    /// Metadata that requests about to complete depend on, put into the file (not synced):
    /// what a new process finds after this one is killed. A no-op for raw images and when
    /// nothing changed.
    pub fn publish(&self) -> Result<(), ImageError> {
        if !self.is_active() {
            return Ok(());
        }
        match &self.kind {
            Kind::Raw => Ok(()),
            #[cfg(feature = "rbd")]
            Kind::Rbd(_) => Ok(()),
            Kind::Nbd(_) => Ok(()),
            Kind::Parallels(p) => p.publish(&self.file),
            Kind::Qcow2(d) => d.q.publish(&self.file),
        }
    }

    /// Everything completed so far durable: format metadata, then the file.
    pub fn sync(&self) -> Result<(), ImageError> {
        if !self.is_active() {
            return Ok(());
        }
        #[cfg(feature = "rbd")]
        if let Kind::Rbd(r) = &self.kind {
            return r.sync();
        }
        if let Kind::Nbd(_) = &self.kind {
            // The image holds no connection: each queue's flushes its own, on the guest's
            // FLUSH and when the queue stops.
            return Err(ImageError::Unsupported(
                "an NBD export is flushed by the guest's FLUSH and when its queues stop, not \
                 from here"
                    .into(),
            ));
        }
        self.write_back()?;
        Ok(self.file.sync_data()?)
    }

    /// Clean shutdown: metadata written back, the file trimmed to its data (formats keep
    /// their files ahead of allocations while serving), everything synced.
    pub fn close(&self) -> Result<(), ImageError> {
        if !self.is_active() {
            return Ok(());
        }
        match &self.kind {
            Kind::Raw => {}
            #[cfg(feature = "rbd")]
            Kind::Rbd(r) => return r.sync(),
            // Each queue's connection was flushed when the queue stopped.
            Kind::Nbd(_) => return Ok(()),
            Kind::Parallels(p) => p.close(&self.file)?,
            Kind::Qcow2(d) => d.q.close(&self.file)?,
        }
        Ok(self.file.sync_data()?)
    }

    /// A clean exit, after `close` and `release_locks`: let go of what the image holds
    /// outside this process now rather than when the process is gone (an RBD image's
    /// handle and cluster connection: its watch on the image, which `rbd status` lists, and
    /// its session). Nothing is served through the image afterwards.
    pub fn disconnect(&self) {
        #[cfg(feature = "rbd")]
        if let Kind::Rbd(r) = &self.kind {
            r.disconnect();
        }
    }

    /// Give up the image's and its backing files' locks (a clean exit, after `close`).
    pub fn release_locks(&self) {
        let mut l = self.lock.locked();
        l.release(&self.file);
        #[cfg(feature = "rbd")]
        if let Kind::Rbd(r) = &self.kind {
            r.release_lock();
        }
        if let Kind::Qcow2(d) = &self.kind {
            for layer in &d.backing {
                let mut l = layer.lock.locked();
                l.release(&layer.file);
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
        if let Kind::Qcow2(d) = &self.kind {
            if let Err(e) = d.q.close(&self.file) {
                log::error!(
                    "writing back image metadata: {}",
                    crate::logging::error_chain(&e)
                );
            }
        }
    }
}
