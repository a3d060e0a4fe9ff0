//! io_uring engine: one ring per queue, completions signalled on an eventfd that the queue's
//! epoll loop watches.

use std::io;
use std::os::fd::{AsRawFd, RawFd};

use io_uring::{opcode, squeue, types, IoUring};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use super::{Completion, Op};

/// io_uring engine.
pub struct UringEngine {
    ring: IoUring,
    event: EventFd,
    /// Pushed but not yet submitted.
    queued: usize,
}

impl UringEngine {
    /// Create a ring with `entries` submission slots. Fails with the kernel's error (EPERM,
    /// ENOSYS) where io_uring is not allowed; the caller falls back.
    pub fn new(entries: u32) -> io::Result<Self> {
        let ring = IoUring::builder()
            // Completions may outnumber submissions in flight (one request can need several
            // operations); the kernel also buffers overflow (IORING_FEAT_NODROP).
            .setup_cqsize(entries.saturating_mul(4))
            .build(entries)?;
        let event = EventFd::new(EFD_NONBLOCK)?;
        ring.submitter().register_eventfd(event.as_raw_fd())?;
        Ok(UringEngine {
            ring,
            event,
            queued: 0,
        })
    }

    pub fn event_fd(&self) -> RawFd {
        self.event.as_raw_fd()
    }

    fn entry(fd: RawFd, op: &Op) -> squeue::Entry {
        let fd = types::Fd(fd);
        match *op {
            Op::Readv {
                iov,
                iovcnt,
                offset,
            } => opcode::Readv::new(fd, iov, iovcnt).offset(offset).build(),
            Op::Writev {
                iov,
                iovcnt,
                offset,
                dsync,
            } => {
                let flags = if dsync { libc::RWF_DSYNC } else { 0 };
                opcode::Writev::new(fd, iov, iovcnt)
                    .offset(offset)
                    .rw_flags(flags)
                    .build()
            }
            Op::Fdatasync => opcode::Fsync::new(fd)
                .flags(types::FsyncFlags::DATASYNC)
                .build(),
            Op::Fallocate { mode, offset, len } => opcode::Fallocate::new(fd, len)
                .offset(offset)
                .mode(mode)
                .build(),
        }
    }

    /// # Safety
    /// See [`super::Engine::push`].
    pub unsafe fn push(&mut self, fd: RawFd, op: &Op, user_data: u64) -> io::Result<()> {
        let entry = Self::entry(fd, op).user_data(user_data);
        loop {
            // SAFETY: the caller keeps every buffer the entry references alive and untouched
            // until its completion is reaped.
            let pushed = unsafe { self.ring.submission().push(&entry) };
            if pushed.is_ok() {
                self.queued += 1;
                return Ok(());
            }
            // Submission queue full: hand what we have to the kernel and retry.
            self.submit()?;
        }
    }

    pub fn submit(&mut self) -> io::Result<()> {
        if self.queued == 0 {
            return Ok(());
        }
        loop {
            match self.ring.submit() {
                Ok(_) => {
                    self.queued = 0;
                    return Ok(());
                }
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                // EBUSY/EAGAIN: the completion queue is backed up; the caller reaps and
                // the entries stay queued for the next submit.
                Err(e)
                    if e.raw_os_error() == Some(libc::EBUSY)
                        || e.raw_os_error() == Some(libc::EAGAIN) =>
                {
                    return Ok(())
                }
                Err(e) => return Err(e),
            }
        }
    }

    pub fn wait_one(&mut self) -> io::Result<()> {
        loop {
            match self.ring.submit_and_wait(1) {
                Ok(_) => {
                    self.queued = 0;
                    return Ok(());
                }
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                Err(e) => return Err(e),
            }
        }
    }

    pub fn reap(&mut self, out: &mut Vec<Completion>) {
        // Clear the eventfd before reading the ring, so a completion that lands after this
        // reap signals it again.
        let _ = self.event.read();
        for cqe in self.ring.completion() {
            out.push(Completion {
                user_data: cqe.user_data(),
                result: cqe.result(),
            });
        }
    }
}
