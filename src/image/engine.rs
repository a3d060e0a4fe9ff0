//! The engine a queue runs its requests on: io_uring or blocking system calls for local
//! images (`io`), an NBD connection (`nbd::client`), librbd (`rbd`, cargo feature). All take
//! the same [`Op`]s and report through the same [`Completion`]s, so the worker has one
//! completion path.

use std::io;
use std::os::fd::RawFd;

use crate::io::{Completion, Op, SyncEngine, UringEngine};
use crate::nbd::client::{NbdEngine, NbdQueue};
#[cfg(feature = "rbd")]
use crate::rbd::RbdEngine;

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
