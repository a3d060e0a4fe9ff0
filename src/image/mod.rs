//! Disk images. Formats know nothing of virtio or io_uring: for raw images the guest's byte
//! N is the file's byte N, so there is nothing to plan; qcow2 maps guest ranges to extents.

pub mod chain;
pub mod create;
pub mod qcow2;
mod raw;

pub use raw::{open_raw, OpenError, RawImage};
