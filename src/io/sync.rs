//! The fallback engine: each operation runs as a blocking system call when it is pushed, on
//! the queue's own thread, and completes through the same path as io_uring's.

use std::collections::VecDeque;
use std::io;
use std::os::fd::RawFd;

use super::{Completion, Op};

/// Blocking engine.
#[derive(Default)]
pub struct SyncEngine {
    done: VecDeque<Completion>,
    /// The disk's files, by index (0: the image; n: its nth backing file).
    files: Vec<RawFd>,
}

fn ret(r: isize) -> i32 {
    if r < 0 {
        -io::Error::last_os_error()
            .raw_os_error()
            .unwrap_or(libc::EIO)
    } else {
        i32::try_from(r).unwrap_or(i32::MAX)
    }
}

impl SyncEngine {
    pub fn new() -> Self {
        Self::default()
    }

    /// Serve `files` (index 0: the image; n: its nth backing file).
    pub fn bind_files(&mut self, files: &[RawFd]) {
        self.files = files.to_vec();
    }

    /// # Safety
    /// Every pointer in `op` must stay valid, and the buffers it describes must not be
    /// touched by anything else, until the completion with `user_data` has been reaped.
    pub unsafe fn push(&mut self, file: usize, op: &Op, user_data: u64) -> io::Result<()> {
        let Some(&fd) = self.files.get(file) else {
            return Err(io::Error::from_raw_os_error(libc::EBADF));
        };
        let result = match *op {
            Op::Readv {
                iov,
                iovcnt,
                offset,
            } => {
                // SAFETY: the caller guarantees iov points at iovcnt valid iovecs whose
                // buffers are writable and exclusively ours until completion.
                let r = unsafe { libc::preadv(fd, iov, iovcnt as i32, offset as i64) };
                ret(r)
            }
            Op::Writev {
                iov,
                iovcnt,
                offset,
                dsync,
            } => {
                let flags = if dsync { libc::RWF_DSYNC } else { 0 };
                // SAFETY: as above; the buffers are only read.
                let r = unsafe { libc::pwritev2(fd, iov, iovcnt as i32, offset as i64, flags) };
                ret(r)
            }
            Op::Fdatasync => {
                // SAFETY: plain syscall on a descriptor we own.
                let r = unsafe { libc::fdatasync(fd) };
                ret(r as isize)
            }
            Op::Fallocate { mode, offset, len } => {
                // SAFETY: plain syscall on a descriptor we own.
                let r = unsafe { libc::fallocate(fd, mode, offset as i64, len as i64) };
                ret(r as isize)
            }
            Op::Discard { offset, len } => {
                // SAFETY: plain syscall on a descriptor we own.
                let r = unsafe {
                    libc::fallocate(fd, super::sys::PUNCH_HOLE, offset as i64, len as i64)
                };
                ret(r as isize)
            }
        };
        self.done.push_back(Completion { user_data, result });
        Ok(())
    }

    pub fn has_completions(&self) -> bool {
        !self.done.is_empty()
    }

    pub fn reap(&mut self, out: &mut Vec<Completion>) {
        out.extend(self.done.drain(..));
    }
}
