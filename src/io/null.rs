//! The null engine, behind `--blk-file null:SIZE` (a disk that stores nothing, for measuring
//! the backend alone and for tests; `image::remote`): writes, flushes, discards and zeroing
//! succeed at once without touching memory; reads fill their buffers with zeroes, or with
//! `read-zeroes=off` leave them untouched. With a latency, each operation completes that
//! long after it was pushed, a timerfd waking the queue: QEMU's `null-co`/`null-aio` and
//! SPDK's null bdev do the same.

use std::collections::VecDeque;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::time::{Duration, Instant};

use super::{Completion, Op};

/// What a null disk does (parsed from `null:SIZE?...`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NullOptions {
    /// Reads fill their buffers with zeroes (else the buffers keep what they held).
    pub read_zeroes: bool,
    /// Every operation completes this long after it was pushed (zero: at once).
    pub latency: Duration,
}

impl Default for NullOptions {
    fn default() -> Self {
        NullOptions {
            read_zeroes: true,
            latency: Duration::ZERO,
        }
    }
}

/// A queue's engine on a null disk.
pub struct NullEngine {
    opts: NullOptions,
    done: VecDeque<Completion>,
    /// With a latency: operations pushed and when each completes (in push order, so their
    /// deadlines ascend).
    waiting: VecDeque<(Instant, Completion)>,
    /// With a latency: armed for the first waiting operation's deadline.
    timer: Option<OwnedFd>,
}

impl NullEngine {
    pub fn new(opts: NullOptions) -> io::Result<NullEngine> {
        let timer = if opts.latency.is_zero() {
            None
        } else {
            // SAFETY: plain system call; the descriptor it returns is ours alone.
            let fd = unsafe {
                libc::timerfd_create(
                    libc::CLOCK_MONOTONIC,
                    libc::TFD_NONBLOCK | libc::TFD_CLOEXEC,
                )
            };
            if fd < 0 {
                return Err(io::Error::last_os_error());
            }
            // SAFETY: fd was just created and is owned by nothing else.
            Some(unsafe { OwnedFd::from_raw_fd(fd) })
        };
        Ok(NullEngine {
            opts,
            done: VecDeque::new(),
            waiting: VecDeque::new(),
            timer,
        })
    }

    /// # Safety
    /// Every pointer in `op` must stay valid, and the buffers it describes must not be
    /// touched by anything else, until the completion with `user_data` has been reaped.
    pub unsafe fn push(&mut self, op: &Op, user_data: u64) -> io::Result<()> {
        let bytes = |iov: *const libc::iovec, n: u32| -> usize {
            // SAFETY: the caller guarantees iov points at n valid iovecs.
            let iovs = unsafe { std::slice::from_raw_parts(iov, n as usize) };
            iovs.iter().map(|v| v.iov_len).sum()
        };
        let result = match *op {
            Op::Readv { iov, iovcnt, .. } => {
                if self.opts.read_zeroes {
                    // SAFETY: as above; the buffers are writable and ours until completion.
                    let iovs = unsafe { std::slice::from_raw_parts(iov, iovcnt as usize) };
                    for v in iovs {
                        // SAFETY: each iovec describes a writable buffer of iov_len bytes.
                        unsafe { std::ptr::write_bytes(v.iov_base.cast::<u8>(), 0, v.iov_len) };
                    }
                }
                bytes(iov, iovcnt)
            }
            Op::Writev { iov, iovcnt, .. } => bytes(iov, iovcnt),
            Op::Fdatasync | Op::Fallocate { .. } | Op::Discard { .. } => 0,
        };
        let c = Completion {
            user_data,
            result: i32::try_from(result).unwrap_or(i32::MAX),
        };
        if self.timer.is_none() {
            self.done.push_back(c);
        } else {
            let first = self.waiting.is_empty();
            self.waiting
                .push_back((Instant::now() + self.opts.latency, c));
            if first {
                self.arm()?;
            }
        }
        Ok(())
    }

    /// Arm the timer for the first waiting operation (or disarm it: none waits).
    fn arm(&self) -> io::Result<()> {
        let Some(timer) = &self.timer else {
            return Ok(());
        };
        let left = self.waiting.front().map_or(Duration::ZERO, |(at, _)| {
            // A deadline already past still needs a non-zero value (zero disarms).
            at.saturating_duration_since(Instant::now())
                .max(Duration::from_nanos(1))
        });
        let spec = libc::itimerspec {
            it_interval: libc::timespec {
                tv_sec: 0,
                tv_nsec: 0,
            },
            it_value: libc::timespec {
                tv_sec: left.as_secs() as libc::time_t,
                tv_nsec: libc::c_long::from(left.subsec_nanos() as i32),
            },
        };
        // SAFETY: plain system call on our timer with a valid itimerspec.
        if unsafe { libc::timerfd_settime(timer.as_raw_fd(), 0, &spec, std::ptr::null_mut()) } < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    pub fn reap(&mut self, out: &mut Vec<Completion>) {
        if let Some(timer) = &self.timer {
            // Clear the expiry count (the fd is watched edge-triggered; reading keeps it
            // from staying readable).
            let mut n = 0u64;
            // SAFETY: reads 8 bytes into n from our own non-blocking timer.
            let _ = unsafe { libc::read(timer.as_raw_fd(), (&raw mut n).cast(), 8) };
            let now = Instant::now();
            while self.waiting.front().is_some_and(|(at, _)| *at <= now) {
                out.extend(self.waiting.pop_front().map(|(_, c)| c));
            }
            // For the new first one (the timer may have been armed for one reaped early).
            if !self.waiting.is_empty() {
                if let Err(e) = self.arm() {
                    log::error!("null disk: the latency timer cannot be armed: {e}");
                }
            }
        }
        out.extend(self.done.drain(..));
    }

    pub fn has_completions(&self) -> bool {
        !self.done.is_empty()
            || self
                .waiting
                .front()
                .is_some_and(|(at, _)| *at <= Instant::now())
    }

    /// Block until the first waiting operation is due.
    pub fn wait_one(&mut self) -> io::Result<()> {
        if let Some((at, _)) = self.waiting.front() {
            std::thread::sleep(at.saturating_duration_since(Instant::now()));
        }
        Ok(())
    }

    /// The timer that wakes the queue when an operation is due (with a latency).
    pub fn event_fd(&self) -> Option<RawFd> {
        self.timer.as_ref().map(|t| t.as_raw_fd())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read_op(buf: &mut [u8], iov: &mut libc::iovec) -> Op {
        *iov = libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: buf.len(),
        };
        Op::Readv {
            iov,
            iovcnt: 1,
            offset: 0,
        }
    }

    #[test]
    fn reads_zeroes_or_leave_the_buffer_and_writes_complete_at_once() {
        for read_zeroes in [true, false] {
            let mut e = NullEngine::new(NullOptions {
                read_zeroes,
                latency: Duration::ZERO,
            })
            .unwrap();
            assert_eq!(e.event_fd(), None);
            let mut buf = vec![0xaau8; 4096];
            let mut iov = libc::iovec {
                iov_base: std::ptr::null_mut(),
                iov_len: 0,
            };
            let op = read_op(&mut buf, &mut iov);
            // SAFETY: buf and iov outlive the completion, reaped below.
            unsafe { e.push(&op, 7).unwrap() };
            // SAFETY: no buffers.
            unsafe { e.push(&Op::Fdatasync, 8).unwrap() };
            assert!(e.has_completions());
            let mut out = Vec::new();
            e.reap(&mut out);
            assert_eq!(
                out,
                vec![
                    Completion {
                        user_data: 7,
                        result: 4096
                    },
                    Completion {
                        user_data: 8,
                        result: 0
                    }
                ]
            );
            let want = if read_zeroes { 0 } else { 0xaa };
            assert!(buf.iter().all(|&b| b == want), "read_zeroes={read_zeroes}");
        }
    }

    #[test]
    fn a_latency_holds_each_operation_that_long() {
        let latency = Duration::from_millis(20);
        let mut e = NullEngine::new(NullOptions {
            read_zeroes: true,
            latency,
        })
        .unwrap();
        let fd = e.event_fd().expect("a timer");
        let start = Instant::now();
        // SAFETY: no buffers.
        unsafe { e.push(&Op::Fdatasync, 1).unwrap() };
        let mut out = Vec::new();
        e.reap(&mut out);
        assert!(out.is_empty() && !e.has_completions());
        // The timer fires when it is due.
        let mut pfd = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd.
        assert_eq!(unsafe { libc::poll(&mut pfd, 1, 1000) }, 1);
        assert!(start.elapsed() >= latency, "{:?}", start.elapsed());
        e.reap(&mut out);
        assert_eq!(out.len(), 1);
        // Nothing left: the timer stays quiet.
        // SAFETY: as above.
        assert_eq!(unsafe { libc::poll(&mut pfd, 1, 50) }, 0);
    }
}
