//! The engine a queue runs its requests on: io_uring or blocking system calls for local
//! images (`io`), an NBD connection (`nbd::client`), librbd (`rbd`, cargo feature), nothing
//! at all for a null disk (`io::NullEngine`). All take
//! the same [`Op`]s and report through the same [`Completion`]s, so the worker has one
//! completion path. The image makes each queue's engine and binds it to its own storage
//! ([`super::Image::queue_engines`], [`super::Image::bind`]): an operation names a file of the
//! disk by index (0: the image; n: its nth backing file), never a descriptor.

use std::io;
use std::os::fd::RawFd;

use std::sync::atomic::{AtomicBool, Ordering};

use super::{Disk, ImageError, Kind};
use crate::io::{AioMode, Completion, NullEngine, Op, SyncEngine, UringEngine};
use crate::nbd::client::{NbdEngine, NbdQueue};
#[cfg(feature = "rbd")]
use crate::rbd::RbdEngine;

/// How a local image's engines are made (`--aio`, the ring's size).
#[derive(Clone, Copy, Debug)]
pub struct EngineChoice {
    pub aio: AioMode,
    /// Submission slots of an io_uring ring.
    pub entries: u32,
}

/// A local image's engine: io_uring, falling back to threads where io_uring is not allowed
/// (said once per process, in one warning line).
pub(super) fn local(choice: EngineChoice) -> io::Result<Engine> {
    static WARNED: AtomicBool = AtomicBool::new(false);
    if choice.aio == AioMode::Threads {
        return Ok(Engine::Sync(SyncEngine::new()));
    }
    match UringEngine::new(choice.entries) {
        Ok(e) => Ok(Engine::Uring(e)),
        Err(e) if matches!(e.raw_os_error(), Some(libc::EPERM) | Some(libc::ENOSYS)) => {
            if !WARNED.swap(true, Ordering::Relaxed) {
                log::warn!("io_uring is not available ({e}); falling back to --aio threads");
            }
            Ok(Engine::Sync(SyncEngine::new()))
        }
        Err(e) => Err(e),
    }
}

/// Which engine a queue uses. One per queue, never moved on the hot path: size is no issue.
#[allow(clippy::large_enum_variant)]
pub enum Engine {
    Uring(UringEngine),
    Sync(SyncEngine),
    /// An NBD connection (one file: the export).
    Nbd(NbdEngine),
    /// A queue's share of one NBD connection (one file: the export).
    NbdShared(NbdQueue),
    /// librbd's asynchronous calls (one file: the image).
    #[cfg(feature = "rbd")]
    Rbd(RbdEngine),
    /// A null disk: nothing stored (one file: the disk).
    Null(NullEngine),
}

impl Engine {
    /// Start `op` on file `file` of the disk (0: the image; n: its nth backing file; a
    /// remote disk has only 0).
    ///
    /// # Safety
    /// Every pointer in `op` must stay valid, and the buffers it describes must not be
    /// touched by anything else, until the completion with `user_data` has been reaped.
    pub unsafe fn push(&mut self, file: usize, op: &Op, user_data: u64) -> io::Result<()> {
        let remote_file = |file: usize| {
            if file == 0 {
                Ok(())
            } else {
                Err(io::Error::from_raw_os_error(libc::EBADF))
            }
        };
        match self {
            // SAFETY: forwarded contract.
            Engine::Uring(e) => unsafe { e.push(file, op, user_data) },
            // SAFETY: forwarded contract.
            Engine::Sync(e) => unsafe { e.push(file, op, user_data) },
            Engine::Nbd(e) => {
                remote_file(file)?;
                // SAFETY: forwarded contract.
                unsafe { e.push(op, user_data) }
            }
            Engine::NbdShared(e) => {
                remote_file(file)?;
                // SAFETY: forwarded contract.
                unsafe { e.push(op, user_data) }
            }
            #[cfg(feature = "rbd")]
            Engine::Rbd(e) => {
                remote_file(file)?;
                // SAFETY: forwarded contract.
                unsafe { e.push(op, user_data) }
            }
            Engine::Null(e) => {
                remote_file(file)?;
                // SAFETY: forwarded contract.
                unsafe { e.push(op, user_data) }
            }
        }
    }

    /// Hand queued operations to the kernel.
    pub fn submit(&mut self) -> io::Result<()> {
        match self {
            Engine::Uring(e) => e.submit(),
            _ => Ok(()),
        }
    }

    /// Submit and block until at least one operation completes (used when draining).
    pub fn wait_one(&mut self) -> io::Result<()> {
        match self {
            Engine::Uring(e) => e.wait_one(),
            Engine::Sync(_) => Ok(()),
            Engine::Nbd(e) => e.wait_one(),
            Engine::NbdShared(e) => e.wait_one(),
            #[cfg(feature = "rbd")]
            Engine::Rbd(e) => e.wait_one(),
            Engine::Null(e) => e.wait_one(),
        }
    }

    /// Move finished operations into `out`.
    pub fn reap(&mut self, out: &mut Vec<Completion>) {
        match self {
            Engine::Uring(e) => e.reap(out),
            Engine::Sync(e) => e.reap(out),
            Engine::Nbd(e) => e.reap(out),
            Engine::NbdShared(e) => e.reap(out),
            #[cfg(feature = "rbd")]
            Engine::Rbd(e) => e.reap(out),
            Engine::Null(e) => e.reap(out),
        }
    }

    /// Completions are ready to reap without blocking.
    pub fn has_completions(&mut self) -> bool {
        match self {
            Engine::Uring(e) => e.has_completions(),
            Engine::Sync(e) => e.has_completions(),
            Engine::Nbd(e) => e.has_completions(),
            Engine::NbdShared(e) => e.has_completions(),
            #[cfg(feature = "rbd")]
            Engine::Rbd(e) => e.has_completions(),
            Engine::Null(e) => e.has_completions(),
        }
    }

    /// Suppress completion signals while the queue thread polls.
    pub fn set_event_enabled(&mut self, enabled: bool) {
        if let Engine::Uring(e) = self {
            e.set_event_enabled(enabled);
        }
    }

    /// Serve the local files `files` (by index; see [`Self::push`]). Remote engines reach
    /// their disk themselves and ignore this.
    pub(crate) fn bind_files(&mut self, files: &[RawFd]) {
        match self {
            Engine::Uring(e) => e.bind_files(files),
            Engine::Sync(e) => e.bind_files(files),
            _ => {}
        }
    }

    /// The eventfd signalled on completions, if the engine completes asynchronously.
    pub fn event_fd(&self) -> Option<RawFd> {
        match self {
            Engine::Uring(e) => Some(e.event_fd()),
            Engine::Sync(_) => None,
            Engine::Nbd(e) => Some(e.event_fd()),
            Engine::NbdShared(e) => Some(e.event_fd()),
            #[cfg(feature = "rbd")]
            Engine::Rbd(e) => Some(e.event_fd()),
            Engine::Null(e) => e.event_fd(),
        }
    }

    /// An eventfd that wakes the queue when written (what an `offload::Inbox` signals): an
    /// io_uring's or librbd's; None for an NBD engine, whose event fd is an epoll set.
    pub fn wake_fd(&self) -> Option<RawFd> {
        match self {
            Engine::Uring(e) => Some(e.event_fd()),
            #[cfg(feature = "rbd")]
            Engine::Rbd(e) => Some(e.event_fd()),
            Engine::Sync(_) | Engine::Nbd(_) | Engine::NbdShared(_) | Engine::Null(_) => None,
        }
    }

    pub fn name(&self) -> &'static str {
        match self {
            Engine::Uring(_) => "io_uring",
            Engine::Sync(_) => "threads",
            Engine::Nbd(_) => "nbd",
            Engine::NbdShared(_) => "nbd (one connection for all queues)",
            #[cfg(feature = "rbd")]
            Engine::Rbd(_) => "librbd",
            Engine::Null(_) => "null",
        }
    }
}

/// What the image does for its engines: making and binding them, and the few operations on
/// a local file that no engine runs (a block device's discard, zeroing by hand, a sub-block
/// write).
impl super::Image {
    /// Engines for `queues` queues, each bound to this image ([`Self::bind`]): io_uring or
    /// threads (as `choice` says) for a local image, the driver's for a remote one.
    pub fn queue_engines(&self, queues: u16, choice: EngineChoice) -> io::Result<Vec<Engine>> {
        let mut engines = match &self.disk {
            Disk::Remote(r) => r.queue_engines(queues)?,
            Disk::Local(_) => (0..queues)
                .map(|_| local(choice))
                .collect::<io::Result<_>>()?,
        };
        for e in &mut engines {
            self.bind(e);
        }
        Ok(engines)
    }

    /// Is the disk remote (an NBD export, an RBD image), with no file here?
    pub fn is_remote(&self) -> bool {
        matches!(self.disk, Disk::Remote(_))
    }

    /// Can `engine`, made for another image, serve this one once bound to it
    /// ([`Self::bind`])? A local file's engine serves any local image, a librbd engine any
    /// RBD image; an NBD engine holds a connection to the export it was made for, so never.
    /// A job that moves the guest to another kind of disk (a mirror onto an NBD export or an
    /// RBD image) gives the queues new engines ([`Self::queue_engines`]) when this says no.
    pub fn engine_fits(&self, engine: &Engine) -> bool {
        match (&self.disk, engine) {
            (Disk::Local(_), Engine::Uring(_) | Engine::Sync(_)) => true,
            (Disk::Remote(r), e) => r.engine_fits(e),
            _ => false,
        }
    }

    /// Point `engine` at this image (a queue's engine after the image was replaced: a
    /// live migration's take-over): its files by layer, or its remote handle.
    pub fn bind(&self, engine: &mut Engine) {
        use std::os::fd::AsRawFd;
        match &self.disk {
            Disk::Local(l) => {
                let mut fds = vec![l.file.as_raw_fd()];
                if let Kind::Qcow2(d) = &l.kind {
                    fds.extend(d.backing.iter().map(|b| b.file.as_raw_fd()));
                }
                engine.bind_files(&fds);
            }
            Disk::Remote(r) => r.bind(engine),
        }
    }

    /// Discard [offset, offset + len) of a block device (BLKDISCARD), synchronously: the
    /// result as an engine reports it (0, or a negative errno).
    pub fn discard_block_device(&self, offset: u64, len: u64) -> i32 {
        use std::os::fd::AsRawFd;
        match &self.disk {
            Disk::Local(l) => crate::io::sys::blk_discard(l.file.as_raw_fd(), offset, len),
            Disk::Remote(_) => -libc::EOPNOTSUPP,
        }
    }

    /// Zero [offset, offset + len) of the image file by writing zeroes (through `bounce`),
    /// where the file system cannot zero a range: the result as an engine reports it.
    pub fn write_zeroes_by_hand(
        &self,
        offset: u64,
        len: u64,
        bounce: &mut crate::io::bounce::BouncePool,
    ) -> i32 {
        use std::os::fd::AsRawFd;
        match &self.disk {
            Disk::Local(l) => {
                crate::io::sys::zero_fallback(l.file.as_raw_fd(), offset, len, bounce)
            }
            Disk::Remote(_) => -libc::EOPNOTSUPP,
        }
    }

    /// Write `data` at `offset` of a raw image file whose direct-I/O block (`block`) it does
    /// not fill: read, modify and write the blocks around it, synchronously; `durable`:
    /// synced before it returns.
    pub fn write_sub_block(
        &self,
        offset: u64,
        data: &[u8],
        block: u64,
        durable: bool,
    ) -> io::Result<()> {
        let Disk::Local(l) = &self.disk else {
            return Err(io::Error::from_raw_os_error(libc::EOPNOTSUPP));
        };
        match &l.kind {
            Kind::Luks(c) => {
                c.write_sub_block(&l.file, offset, data, block)
                    .map_err(|e| match e {
                        ImageError::Io(e) => e,
                        other => io::Error::other(other.to_string()),
                    })?
            }
            _ => crate::io::aligned::write_unaligned(&l.file, offset, data, block)?,
        }
        if durable {
            l.file.sync_data()?;
        }
        Ok(())
    }
}
