//! Power-loss crash states for vublk's tests (issue 35, docs/crash-consistency.md).
//!
//! A power cut may lose every write that was not yet durable, in any subset and order, and
//! tear a multi-sector write at sector boundaries. vublk must leave images that open cleanly
//! and keep everything the guest saw flushed. This crate finds out whether it does:
//!
//! - [`Recorder`] mounts a FUSE file system over a directory of image files. vublk serves an
//!   image from the mount, and every operation that changes a file (write, fallocate in every
//!   mode, truncate, create, rename, unlink) and every durability point (fsync, fdatasync, a
//!   write with O_DSYNC or RWF_DSYNC, a directory fsync) is recorded in order with its data,
//!   together with the test's own marks (what the workload saw complete). vublk itself is not
//!   changed: the recorder sits where the host file system would.
//! - [`Replay`] turns a [`Recording`] into crash states: for each durability point, the files
//!   as of every operation durable by then, plus subsets of the operations not yet durable
//!   (none, all, each single one, each prefix, random subsets, and writes torn at 512-byte
//!   sectors), up to a state count.
//!
//! The oracles (qemu-img check, vublk opening and serving the state, the workload's durable
//! log) live in the tests (tests/crash_states.rs).

mod image;
mod record;
mod recorder;
mod replay;

pub use image::{FileImage, Files, SECTOR};
pub use record::{FileId, Op, Record, Recording};
pub use recorder::Recorder;
pub use replay::{Replay, State, Tear};
