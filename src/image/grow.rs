//! Growing a disk online (`vublk ctl resize`): raw files, block devices, qcow2 and RBD images;
//! the refusals, with their reasons.

use std::io;
use std::sync::atomic::Ordering;

use std::os::fd::AsRawFd;

use super::{Disk, Image, ImageError, Kind, Local};

/// Why an online resize was refused.
#[derive(Debug, thiserror::Error)]
pub enum GrowError {
    #[error("the image is not active here (live migration): resize it where it is served")]
    Inactive,
    #[error("the image is served read-only")]
    ReadOnly,
    #[error("no size given")]
    NoSize,
    #[error("shrinking is not supported ({new} bytes < {old} bytes): the guest may have data at the end")]
    Shrink { old: u64, new: u64 },
    #[error("{0} bytes: the size must be a multiple of 512 bytes")]
    Unaligned(u64),
    #[error(
        "the image is a block device of {device} bytes: grow the device itself (e.g. \
         lvextend), then resize without a size (or with {device}); {asked} was asked"
    )]
    BlockDevice { asked: u64, device: u64 },
    #[error(
        "parallels images cannot grow online (their BAT sits before the data clusters; QEMU \
         cannot resize them either): convert to qcow2 or raw to grow"
    )]
    Parallels,
    #[error("extending the image file: {0}")]
    Io(#[source] io::Error),
    #[error("growing the qcow2 image: {0}")]
    Image(#[source] ImageError),
    #[error("resizing the RBD image: {0}")]
    Rbd(String),
    #[error("an NBD export cannot be resized from the client (resize it on the server)")]
    Nbd,
}

/// A new size must not shrink the disk and must be whole sectors.
fn check(old: u64, new: u64) -> Result<(), GrowError> {
    if new < old {
        return Err(GrowError::Shrink { old, new });
    }
    if !new.is_multiple_of(512) {
        return Err(GrowError::Unaligned(new));
    }
    Ok(())
}

impl Image {
    /// Grow the disk online to `new` bytes (a block device: to the device's size, which
    /// `new`, if given, must equal); returns the new size. Shrinking is refused. Raw files
    /// are extended (allocated with `--prealloc on`, else sparse), qcow2 images get a larger
    /// L1 table where needed and a new header, crash-safe; parallels images are refused.
    pub fn grow(&self, new: Option<u64>) -> Result<u64, GrowError> {
        if !self.is_active() {
            return Err(GrowError::Inactive);
        }
        if self.read_only {
            return Err(GrowError::ReadOnly);
        }
        let old = self.size_bytes();
        let (file, kind) = match &self.disk {
            Disk::Local(Local { file, kind }) => (file, kind),
            Disk::Remote(r) => {
                // Resized by the driver (or refused) before the checks.
                let new = r.grow(new)?;
                check(old, new)?;
                self.size_bytes.store(new, Ordering::Release);
                return Ok(new);
            }
        };
        let new = match (kind, self.block_device) {
            (Kind::Raw, true) => {
                let dev =
                    crate::io::sys::block_device_size(file.as_raw_fd()).map_err(GrowError::Io)?;
                if let Some(n) = new.filter(|&n| n != dev) {
                    return Err(GrowError::BlockDevice {
                        asked: n,
                        device: dev,
                    });
                }
                dev
            }
            _ => new.ok_or(GrowError::NoSize)?,
        };
        check(old, new)?;
        if new == old {
            return Ok(old);
        }
        match kind {
            Kind::Raw if self.block_device => {}
            Kind::Raw => {
                let fd = file.as_raw_fd();
                let allocated =
                    self.prealloc_raw && crate::io::sys::fallocate(fd, 0, old, new - old).is_ok();
                if !allocated {
                    file.set_len(new).map_err(GrowError::Io)?;
                }
                // The new size must survive a crash before the guest is told.
                file.sync_all().map_err(GrowError::Io)?;
            }
            Kind::Qcow2(d) => d.q.resize(file, new).map_err(GrowError::Image)?,
            Kind::Parallels(_) => return Err(GrowError::Parallels),
            Kind::Luks(l) => l.grow(file, new, self.block_device)?,
        }
        self.size_bytes.store(new, Ordering::Release);
        Ok(new)
    }

    pub fn read_only(&self) -> bool {
        self.read_only
    }

    /// Must guest writes at offset 0 be checked with [`probe_bytes`]?
    pub fn guards_format_header(&self) -> bool {
        self.guard_header
    }
}
