//! io_uring engine: one ring per queue, completions signalled on an eventfd that the queue's
//! epoll loop watches.

use std::io;
use std::os::fd::{AsRawFd, RawFd};

use io_uring::{opcode, squeue, types, IoUring};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use super::{Completion, Op};

/// One submission entry for `op` on `$target` (a plain or a fixed file).
macro_rules! build_entry {
    ($target:expr, $op:expr) => {
        match *$op {
            Op::Readv {
                iov,
                iovcnt,
                offset,
            } => opcode::Readv::new($target, iov, iovcnt)
                .offset(offset)
                .build(),
            Op::Writev {
                iov,
                iovcnt,
                offset,
                dsync,
            } => opcode::Writev::new($target, iov, iovcnt)
                .offset(offset)
                .rw_flags(if dsync { libc::RWF_DSYNC } else { 0 })
                .build(),
            Op::Fdatasync => opcode::Fsync::new($target)
                .flags(types::FsyncFlags::DATASYNC)
                .build(),
            Op::Fallocate { mode, offset, len } => opcode::Fallocate::new($target, len)
                .offset(offset)
                .mode(mode)
                .build(),
            Op::Discard { offset, len } => opcode::Fallocate::new($target, len)
                .offset(offset)
                .mode(super::sys::PUNCH_HOLE)
                .build(),
        }
    };
}

/// io_uring engine.
pub struct UringEngine {
    ring: IoUring,
    event: EventFd,
    /// Pushed but not yet submitted.
    queued: usize,
    /// The disk's files, by index (see [`UringEngine::bind_files`]).
    files: Vec<RawFd>,
    /// `files` are registered as the ring's fixed files (saves a file-table lookup per
    /// operation).
    fixed: bool,
    /// Set up with COOP_TASKRUN: completions arriving while the queue thread runs wait for
    /// its next system call instead of interrupting it (an inter-processor interrupt, a VM
    /// exit in a guest); TASKRUN_FLAG tells a polling thread that some wait.
    coop: bool,
}

impl UringEngine {
    /// Create a ring with `entries` submission slots. Fails with the kernel's error (EPERM,
    /// ENOSYS) where io_uring is not allowed; the caller falls back.
    pub fn new(entries: u32) -> io::Result<Self> {
        let build = |coop: bool| {
            let mut b = IoUring::builder();
            // Completions may outnumber submissions in flight (one request can need several
            // operations); the kernel also buffers overflow (IORING_FEAT_NODROP).
            b.setup_cqsize(entries.saturating_mul(4));
            if coop {
                b.setup_coop_taskrun().setup_taskrun_flag();
            }
            b.build(entries)
        };
        // Linux 5.19 and later; older kernels refuse the flags (EINVAL).
        let (ring, coop) = match build(true) {
            Ok(r) => (r, true),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => (build(false)?, false),
            Err(e) => return Err(e),
        };
        let event = EventFd::new(EFD_NONBLOCK)?;
        ring.submitter().register_eventfd(event.as_raw_fd())?;
        Ok(UringEngine {
            ring,
            event,
            queued: 0,
            files: Vec::new(),
            fixed: false,
            coop,
        })
    }

    /// Serve `files` (index 0: the image; n: its nth backing file), registered as fixed
    /// files. Best effort: on failure, operations use the plain descriptors.
    pub fn bind_files(&mut self, files: &[RawFd]) {
        if std::mem::take(&mut self.fixed) {
            let _ = self.ring.submitter().unregister_files();
        }
        self.files = files.to_vec();
        self.fixed = !files.is_empty() && self.ring.submitter().register_files(files).is_ok();
    }

    /// Completions waiting in the ring (no system call, unless some wait as task work: then
    /// one enter, which runs it).
    pub fn has_completions(&mut self) -> bool {
        if !self.ring.completion().is_empty() {
            return true;
        }
        if self.coop && self.ring.submission().taskrun() {
            // Any system call runs the waiting task work on its way back; this one also
            // hands over whatever is queued.
            if self.ring.submit().is_ok() {
                self.queued = 0;
            }
            return !self.ring.completion().is_empty();
        }
        false
    }

    /// Stop (or resume) signalling the eventfd for completions, while the caller polls.
    pub fn set_event_enabled(&mut self, enabled: bool) {
        let cq = self.ring.completion();
        if enabled {
            cq.enable_eventfd();
        } else {
            cq.disable_eventfd();
        }
    }

    pub fn event_fd(&self) -> RawFd {
        self.event.as_raw_fd()
    }

    fn entry(&self, file: usize, op: &Op) -> io::Result<squeue::Entry> {
        let Some(&fd) = self.files.get(file) else {
            return Err(io::Error::from_raw_os_error(libc::EBADF));
        };
        Ok(if self.fixed {
            build_entry!(types::Fixed(file as u32), op)
        } else {
            build_entry!(types::Fd(fd), op)
        })
    }

    /// # Safety
    /// Every pointer in `op` must stay valid, and the buffers it describes must not be
    /// touched by anything else, until the completion with `user_data` has been reaped.
    pub unsafe fn push(&mut self, file: usize, op: &Op, user_data: u64) -> io::Result<()> {
        let entry = self.entry(file, op)?.user_data(user_data);
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

    /// Move finished operations into `out`. Does not touch the eventfd: the epoll loop
    /// watches it edge-triggered, so every completion signal wakes the queue once and no
    /// read() is needed; opportunistic reaps cost no system call.
    pub fn reap(&mut self, out: &mut Vec<Completion>) {
        for cqe in self.ring.completion() {
            out.push(Completion {
                user_data: cqe.user_data(),
                result: cqe.result(),
            });
        }
    }
}
