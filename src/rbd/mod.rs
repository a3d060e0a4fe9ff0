//! The Ceph RBD driver (`--blk-file rbd:POOL/IMAGE[@SNAPSHOT]`): images served like raw ones
//! (the guest's byte N is the image's byte N) through librbd. Rooms:
//! - `options`: the image spec and how the cluster is reached and cached (always built, so
//!   that a build without librbd parses the options and refuses an RBD image with the reason).
//! - `librbd` (cargo feature `rbd`, over the C API in `ffi`): cluster and image handles,
//!   the exclusive lock, the update watch, asynchronous I/O.
//! - `disk`: an image being served: open, lock, watch, flush, resize, close.
//! - `engine`: a queue's engine, reaping librbd's completions on the queue thread.
//!
//! Completions: one image handle serves every queue (librbd's cache and exclusive lock are
//! per handle), so each operation names the queue's `Inbox` it reports to. librbd runs the
//! completion callback on one of its own threads; the callback only takes the result,
//! releases the completion, and posts `(user_data, result)` to that inbox, which signals the
//! queue's eventfd. Nothing of librbd's ever touches a virtqueue: the queue thread reaps the
//! inbox on its own epoll loop, like io_uring completions. (`rbd_set_image_notification`
//! gives one eventfd per image, which several queues would have to share and route.)

mod options;

pub use options::{CephOptions, RbdCache, RbdSpec};

#[cfg(feature = "rbd")]
mod disk;
#[cfg(feature = "rbd")]
mod engine;
#[cfg(feature = "rbd")]
pub mod ffi;
#[cfg(feature = "rbd")]
mod librbd;

#[cfg(feature = "rbd")]
pub use disk::{open, LockPolicy, OpenError, OpenRequest, RbdDisk};
#[cfg(feature = "rbd")]
pub use engine::RbdEngine;
#[cfg(feature = "rbd")]
pub use librbd::{Cluster, ConnectOptions, RbdError, RbdImage, UpdateFn};
