//! The librbd engine (cargo feature `rbd`): each [`Op`] becomes one asynchronous librbd call
//! on the image every queue shares, straight from the request's iovecs. librbd reports to
//! this queue's [`Inbox`], which signals the engine's eventfd: the queue's epoll loop wakes
//! and reaps as it does for io_uring (see `crate::rbd` for why not one eventfd per image).
//!
//! Write-through (`dsync`) writes: with librbd's cache off, a completed write is in the
//! cluster already; with it on (`--cache writeback` and the guest turned its write cache
//! off), the write is followed by a flush before it completes.

use std::collections::{HashMap, HashSet};
use std::io;
use std::sync::Arc;

use super::RbdImage;
use crate::io::{sys, Completion, Op};
use crate::offload::Mailbox;

pub struct RbdEngine {
    image: Arc<RbdImage>,
    mailbox: Mailbox,
    /// librbd caches writes: a write-through write needs a flush after it.
    cached: bool,
    /// Write-through writes in flight that need a flush when they complete (user_data).
    flush_after: HashSet<u64>,
    /// Their flushes in flight: user_data, and the write's result.
    flushing: HashMap<u64, i32>,
    got: Vec<Completion>,
}

impl RbdEngine {
    /// An engine over `image`; `cached`: librbd's write-back cache is on.
    pub fn new(image: Arc<RbdImage>, cached: bool) -> io::Result<Self> {
        Ok(RbdEngine {
            image,
            mailbox: Mailbox::new()?,
            cached,
            flush_after: HashSet::new(),
            flushing: HashMap::new(),
            got: Vec::new(),
        })
    }

    /// Serve `image` from now on (an image taken over after a live migration's handover is
    /// a new handle). Only between requests: nothing may be in flight.
    pub fn set_image(&mut self, image: Arc<RbdImage>, cached: bool) {
        self.image = image;
        self.cached = cached;
    }

    /// # Safety
    /// See [`super::Engine::push`].
    pub unsafe fn push(&mut self, op: &Op, user_data: u64) -> io::Result<()> {
        let (img, to) = (&self.image, self.mailbox.inbox());
        match *op {
            Op::Readv {
                iov,
                iovcnt,
                offset,
            } => {
                // SAFETY: the caller guarantees `iovcnt` valid iovecs whose buffers stay ours
                // until the completion is reaped.
                let iov = unsafe { std::slice::from_raw_parts(iov, iovcnt as usize) };
                // SAFETY: as above.
                unsafe { img.readv(iov, offset, to, user_data) }
            }
            Op::Writev {
                iov,
                iovcnt,
                offset,
                dsync,
            } => {
                // SAFETY: as for reads.
                let iov = unsafe { std::slice::from_raw_parts(iov, iovcnt as usize) };
                if dsync && self.cached {
                    self.flush_after.insert(user_data);
                }
                // SAFETY: as for reads.
                let r = unsafe { img.writev(iov, offset, to, user_data) };
                if r.is_err() {
                    self.flush_after.remove(&user_data);
                }
                r
            }
            Op::Fdatasync => img.flush(to, user_data),
            Op::Discard { offset, len } => img.discard(offset, len, to, user_data),
            // Zeroes either way; librbd deallocates whole objects it zeroes (unmap), and
            // allocates them (thick) when the space must be kept.
            Op::Fallocate { mode, offset, len } => {
                let thick = mode & libc::FALLOC_FL_PUNCH_HOLE == 0;
                debug_assert!(mode == sys::PUNCH_HOLE || mode == sys::ZERO_RANGE);
                img.write_zeroes(offset, len, thick, to, user_data)
            }
        }
    }

    /// Block until librbd reports something (at most a short while: the caller loops).
    pub fn wait_one(&mut self) -> io::Result<()> {
        self.mailbox.wait();
        Ok(())
    }

    pub fn has_completions(&mut self) -> bool {
        self.mailbox.has()
    }

    pub fn reap(&mut self, out: &mut Vec<Completion>) {
        self.mailbox.take(&mut self.got);
        for c in self.got.drain(..) {
            if let Some(written) = self.flushing.remove(&c.user_data) {
                // The flush after a write-through write: the write completes now, with its
                // own byte count (what the worker checks) or the flush's error.
                let result = if c.result < 0 { c.result } else { written };
                out.push(Completion { result, ..c });
                continue;
            }
            if c.result < 0 || !self.flush_after.remove(&c.user_data) {
                self.flush_after.remove(&c.user_data);
                out.push(c);
                continue;
            }
            match self.image.flush(self.mailbox.inbox(), c.user_data) {
                Ok(()) => {
                    self.flushing.insert(c.user_data, c.result);
                }
                Err(e) => out.push(Completion {
                    user_data: c.user_data,
                    result: -e.raw_os_error().unwrap_or(libc::EIO),
                }),
            }
        }
    }

    pub fn event_fd(&self) -> i32 {
        self.mailbox.event_fd()
    }
}
