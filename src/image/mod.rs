//! Disk images. Formats know nothing of virtio or io_uring: for raw images the guest's byte
//! N is the file's byte N, so there is nothing to plan; qcow2 maps guest ranges to extents.

pub mod chain;
#[cfg(test)]
mod crash_tests;
pub mod create;
pub mod fuzz;
pub mod parallels;
pub mod prealloc;
pub mod qcow2;
mod raw;
pub mod storage;

pub use raw::{open_raw, OpenError, RawImage};
