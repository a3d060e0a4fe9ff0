//! I/O engines: io_uring, blocking system calls on the queue's own thread, an NBD connection,
//! and librbd (cargo feature `rbd`). All take the same [`Op`]s and report through the same [`Completion`]s, so
//! the worker has one completion path. Knows files and iovecs, nothing of image formats or virtio.

pub mod align;
pub mod aligned;
mod batch;
pub mod bounce;
mod nbd;
mod nbd_shared;
pub mod ranges;
#[cfg(feature = "rbd")]
mod rbd;
pub mod storage;
mod sync;
pub mod sys;
mod uring;

use std::io;
use std::os::fd::RawFd;

/// I/O engines.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum AioMode {
    /// One io_uring per queue.
    #[value(name = "io_uring")]
    IoUring,
    /// Blocking system calls on the queue's own thread.
    Threads,
}

pub use nbd::NbdEngine;
pub use nbd_shared::{NbdConnection, NbdQueue};
#[cfg(feature = "rbd")]
pub use rbd::RbdEngine;
pub use storage::Storage;
pub use sync::SyncEngine;
pub use uring::UringEngine;

/// One operation on the image file. The pointers inside must stay valid until its
/// completion is reaped (the worker's in-flight slot owns them).
#[derive(Clone, Copy, Debug)]
pub enum Op {
    Readv {
        iov: *const libc::iovec,
        iovcnt: u32,
        offset: u64,
    },
    Writev {
        iov: *const libc::iovec,
        iovcnt: u32,
        offset: u64,
        /// Durable before completion (RWF_DSYNC): write-through.
        dsync: bool,
    },
    Fdatasync,
    Fallocate {
        mode: i32,
        offset: u64,
        len: u64,
    },
    /// Deallocate a range; it may read as anything afterwards (files: a punched hole, which
    /// reads as zeroes; RBD: a discard, which skips parts below librbd's granularity).
    Discard {
        offset: u64,
        len: u64,
    },
}

/// A finished operation: `result` is bytes transferred, 0, or a negative errno.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Completion {
    pub user_data: u64,
    pub result: i32,
}

/// Which engine a queue uses. One per queue, never moved on the hot path: size is no issue.
#[allow(clippy::large_enum_variant)]
pub enum Engine {
    Uring(UringEngine),
    Sync(SyncEngine),
    /// An NBD connection (the `fd` of an operation is not used).
    Nbd(NbdEngine),
    /// A queue's share of one NBD connection (the `fd` of an operation is not used).
    NbdShared(NbdQueue),
    /// librbd's asynchronous calls (the `fd` of an operation is not used).
    #[cfg(feature = "rbd")]
    Rbd(RbdEngine),
}

impl Engine {
    /// # Safety
    /// Every pointer in `op` must stay valid, and the buffers it describes must not be
    /// touched by anything else, until the completion with `user_data` has been reaped.
    pub unsafe fn push(&mut self, fd: RawFd, op: &Op, user_data: u64) -> io::Result<()> {
        match self {
            // SAFETY: forwarded contract.
            Engine::Uring(e) => unsafe { e.push(fd, op, user_data) },
            // SAFETY: forwarded contract.
            Engine::Sync(e) => unsafe { e.push(fd, op, user_data) },
            // SAFETY: forwarded contract.
            Engine::Nbd(e) => unsafe { e.push(op, user_data) },
            // SAFETY: forwarded contract.
            Engine::NbdShared(e) => unsafe { e.push(op, user_data) },
            // SAFETY: forwarded contract.
            #[cfg(feature = "rbd")]
            Engine::Rbd(e) => unsafe { e.push(op, user_data) },
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
        }
    }

    /// Suppress completion signals while the queue thread polls.
    pub fn set_event_enabled(&mut self, enabled: bool) {
        if let Engine::Uring(e) = self {
            e.set_event_enabled(enabled);
        }
    }

    /// Use a registered (fixed) file slot for `fd` where the engine supports it.
    pub fn register_file(&mut self, fd: RawFd) {
        if let Engine::Uring(e) = self {
            e.register_file(fd);
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
        }
    }
}

#[cfg(test)]
mod conformance;
