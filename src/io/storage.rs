//! Where an image's bytes live. Formats do their metadata I/O through [`Storage`], so the
//! same code runs on a file and, in tests, on an in-memory or simulated disk that loses
//! unsynced writes (`crate::testing`).

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;

/// Positional I/O on an image file.
pub trait Storage: Sync {
    /// Read at `offset`; fewer bytes only at the end of the file.
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize>;
    fn write_all_at(&self, buf: &[u8], offset: u64) -> io::Result<()>;
    fn set_len(&self, len: u64) -> io::Result<()>;
    /// The file's size in bytes.
    fn size(&self) -> io::Result<u64>;
    /// Make every completed write durable.
    fn sync_data(&self) -> io::Result<()>;
    /// Allocate blocks for a range (reading as zeroes), extending the file over it.
    fn allocate(&self, _offset: u64, _len: u64) -> io::Result<()> {
        Err(io::Error::from_raw_os_error(libc::EOPNOTSUPP))
    }
    /// Deallocate a range (it reads as zeroes afterwards); the size does not change.
    fn punch_hole(&self, offset: u64, len: u64) -> io::Result<()>;
    /// Several independent writes (`(bytes, offset)`, in no particular order among
    /// themselves), all done when this returns Ok. A file runs them at once.
    fn write_all_many(&self, writes: &[(&[u8], u64)]) -> io::Result<()> {
        for (buf, offset) in writes {
            self.write_all_at(buf, *offset)?;
        }
        Ok(())
    }
}

impl Storage for File {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        FileExt::read_at(self, buf, offset)
    }

    fn write_all_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        FileExt::write_all_at(self, buf, offset)
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        File::set_len(self, len)
    }

    fn size(&self) -> io::Result<u64> {
        Ok(self.metadata()?.len())
    }

    fn sync_data(&self) -> io::Result<()> {
        File::sync_data(self)
    }

    fn allocate(&self, offset: u64, len: u64) -> io::Result<()> {
        super::sys::fallocate(self.as_raw_fd(), 0, offset, len)
    }

    fn punch_hole(&self, offset: u64, len: u64) -> io::Result<()> {
        super::sys::fallocate(self.as_raw_fd(), super::sys::PUNCH_HOLE, offset, len)
    }

    fn write_all_many(&self, writes: &[(&[u8], u64)]) -> io::Result<()> {
        if writes.len() < 2 {
            return writes
                .iter()
                .try_for_each(|(buf, offset)| FileExt::write_all_at(self, buf, *offset));
        }
        super::batch::write_all(self, self.as_raw_fd(), writes)
    }
}
