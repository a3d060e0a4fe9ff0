//! I/O on files: the engines for local images (io_uring, blocking system calls on the queue's
//! own thread), the operations every engine takes ([`Op`]) and the completions they report
//! ([`Completion`]; the remote drivers' engines, in `nbd::client` and `rbd`, take and report
//! the same), and the file helpers the formats use (alignment, bounce buffers, positional
//! I/O, range locks, raw system calls). Knows files and iovecs, nothing of image formats,
//! remote disks or virtio.

pub mod align;
pub mod aligned;
mod batch;
pub mod bounce;
mod null;
pub mod priority;
pub mod ranges;
pub mod storage;
mod sync;
pub mod sys;
mod uring;

/// I/O engines.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum AioMode {
    /// One io_uring per queue.
    #[value(name = "io_uring")]
    IoUring,
    /// Blocking system calls on the queue's own thread.
    Threads,
}

pub use null::{NullEngine, NullOptions};
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

#[cfg(test)]
mod conformance;
