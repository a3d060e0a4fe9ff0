//! The NBD engine: one connection to an NBD server per queue (servers that allow several,
//! `NBD_FLAG_CAN_MULTI_CONN`), driven on the queue's own loop. Requests are encoded and sent
//! as they are pushed (pipelined, matched by handle); the socket sits in the engine's own
//! epoll set, whose descriptor is the engine's event fd: the queue's epoll loop wakes when
//! replies arrive or when output that did not fit the socket can go on, and [`NbdEngine::reap`]
//! moves both directions forward without blocking.
//!
//! Requests larger than the server's maximum block size are split; writes with `dsync` use
//! FUA where the server offers it, else a flush after them; zeroing without
//! `SEND_WRITE_ZEROES` writes zeroes; discards without `SEND_TRIM` and flushes without
//! `SEND_FLUSH` complete at once. A server error reply fails that request only. Replies are
//! read through a buffer and copied into the request's buffers.
//!
//! A lost connection (the server restarted, the network gone) is made again: every
//! `reconnect_delay` for up to `reconnect_timeout`, on the queue's thread (its requests wait,
//! new ones are not taken meanwhile); then everything not answered is sent again. Past the
//! timeout what is in flight fails with EIO, and so does everything after. When the engine
//! goes (the queue stopped) it flushes the server and ends the session.

use std::collections::{HashMap, VecDeque};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

mod rx;

use rx::sub_iov;

use super::NbdOptions;
use crate::io::{sys, Completion, Op};
use crate::nbd::wire::*;
use crate::nbd::{Export, NbdTarget, Stream};

/// Bytes of the receive buffer (a read reply's data passes through it).
const RX_BUF: usize = 256 << 10;
/// Zeroes for servers without WRITE_ZEROES (one write per this many bytes).
static ZEROES: [u8; 64 << 10] = [0; 64 << 10];

/// One NBD request in flight (a part of a pushed operation).
struct Part {
    user_data: u64,
    kind: u16,
    offset: u64,
    len: u32,
    /// Reads: where the data goes (the part's own slice of the operation's buffers).
    dst: Vec<libc::iovec>,
    /// The encoded header, sent from here.
    header: Box<[u8; REQUEST_LEN]>,
    /// Writes: the data's iovecs.
    src: Vec<libc::iovec>,
}

/// An operation split into parts: how many are left, and the first error.
struct Agg {
    left: usize,
    result: i32,
    /// A write-through write on a server without FUA: flush once the parts are done.
    flush_after: bool,
}

enum Rx {
    /// Waiting for a reply header.
    Header,
    /// A simple reply's read data for `handle`: `done` of the part's length copied.
    SimpleData { handle: u64, done: usize },
    /// A structured chunk's payload, `len` bytes: metadata gathered in `meta`, or data
    /// copied to `handle`'s buffers from `at` (bytes into the part).
    Chunk {
        handle: u64,
        flags: u16,
        kind: u16,
        len: usize,
        got: usize,
        meta: Vec<u8>,
        at: Option<usize>,
    },
}

pub struct NbdEngine {
    sock: Stream,
    export: Export,
    epoll: OwnedFd,
    next_handle: u64,
    parts: HashMap<u64, Part>,
    ops: HashMap<u64, Agg>,
    /// Iovecs of requests not yet (fully) sent, in order.
    out: VecDeque<libc::iovec>,
    want_out: bool,
    rx: Vec<u8>,
    rx_start: usize,
    rx_end: usize,
    state: Rx,
    done: Vec<Completion>,
    /// The connection failed for good: why (everything since fails with EIO).
    broken: Option<String>,
    /// Where to connect again when the connection is lost (None: never).
    target: Option<(NbdTarget, NbdOptions)>,
    /// Since when the server has not answered properly (a loss, and any reconnection that
    /// did not bring an answer): the reconnect timeout runs from here, so a server that
    /// accepts and then misbehaves cannot keep requests waiting for ever.
    lost_since: Option<std::time::Instant>,
}

// SAFETY: the raw pointers are iovecs into buffers the queue's in-flight slots own (guest
// memory, bounce buffers) and into the parts' own headers; the engine moves with its queue
// worker and is only used from the thread that owns that worker.
unsafe impl Send for NbdEngine {}

fn epoll_ctl(ep: RawFd, op: i32, fd: RawFd, events: u32) -> io::Result<()> {
    let mut ev = libc::epoll_event {
        events,
        u64: fd as u64,
    };
    // SAFETY: plain syscall with a valid event struct.
    if unsafe { libc::epoll_ctl(ep, op, fd, &mut ev) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

impl NbdEngine {
    /// An engine over a connection `connect` made (`sock` is made non-blocking).
    pub fn new(sock: Stream, export: Export) -> io::Result<Self> {
        sock.set_nonblocking(true)?;
        // SAFETY: plain syscall; the result is checked.
        let ep = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if ep < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a fresh descriptor nothing else owns.
        let epoll = unsafe { OwnedFd::from_raw_fd(ep) };
        epoll_ctl(
            ep,
            libc::EPOLL_CTL_ADD,
            sock.as_raw_fd(),
            libc::EPOLLIN as u32,
        )?;
        Ok(NbdEngine {
            sock,
            export,
            epoll,
            next_handle: 1,
            parts: HashMap::new(),
            ops: HashMap::new(),
            out: VecDeque::new(),
            want_out: false,
            rx: vec![0; RX_BUF],
            rx_start: 0,
            rx_end: 0,
            state: Rx::Header,
            done: Vec::new(),
            broken: None,
            target: None,
            lost_since: None,
        })
    }

    /// Connect to `target`, whose export must still be `export` (its size), and keep what
    /// is needed to connect again.
    /// A server that is not there is tried again as a lost one is (`reconnect_delay`, up to
    /// `reconnect_timeout`).
    pub fn connect(target: NbdTarget, export: Export, opts: NbdOptions) -> io::Result<Self> {
        let t0 = std::time::Instant::now();
        let (sock, now) = loop {
            match crate::nbd::connect(&target, opts.timeout) {
                Ok(x) => break x,
                Err(e) if t0.elapsed() + opts.reconnect_delay <= opts.reconnect_timeout => {
                    crate::log_limited!(
                        log::Level::Warn,
                        "{e}; trying again in {:?}",
                        opts.reconnect_delay
                    );
                    std::thread::sleep(opts.reconnect_delay);
                }
                Err(e) => {
                    return Err(io::Error::new(
                        io::ErrorKind::ConnectionRefused,
                        e.to_string(),
                    ))
                }
            }
        };
        if now.size != export.size {
            return Err(io::Error::other(format!(
                "{target}: the export is {} bytes now, the guest was shown {}",
                now.size, export.size
            )));
        }
        let mut e = NbdEngine::new(sock, now)?;
        e.target = Some((target, opts));
        Ok(e)
    }

    pub fn export(&self) -> &Export {
        &self.export
    }

    /// Readable when replies arrived or pending output can go on.
    pub fn event_fd(&self) -> RawFd {
        self.epoll.as_raw_fd()
    }

    fn queue_part(&mut self, user_data: u64, kind: u16, flags: u16, offset: u64, len: u32) -> u64 {
        let handle = self.next_handle;
        self.next_handle = self.next_handle.wrapping_add(1).max(1);
        let header = Box::new(
            Request {
                flags,
                kind,
                handle,
                offset,
                len,
            }
            .encode(),
        );
        self.out.push_back(libc::iovec {
            iov_base: header.as_ptr() as *mut _,
            iov_len: REQUEST_LEN,
        });
        self.parts.insert(
            handle,
            Part {
                user_data,
                kind,
                offset,
                len,
                dst: Vec::new(),
                header,
                src: Vec::new(),
            },
        );
        handle
    }

    /// # Safety
    /// See [`super::Engine::push`].
    pub unsafe fn push(&mut self, op: &Op, user_data: u64) -> io::Result<()> {
        if self.broken.is_some() {
            self.done.push(Completion {
                user_data,
                result: -libc::EIO,
            });
            return Ok(());
        }
        let e = self.export;
        let max = e.max_block.max(e.min_block) as usize;
        let mut n = 0usize;
        let mut flush_after = false;
        match *op {
            Op::Readv {
                iov,
                iovcnt,
                offset,
            }
            | Op::Writev {
                iov,
                iovcnt,
                offset,
                ..
            } => {
                // SAFETY: the caller guarantees `iovcnt` valid iovecs until completion.
                let iov = unsafe { std::slice::from_raw_parts(iov, iovcnt as usize) };
                let total: usize = iov.iter().map(|v| v.iov_len).sum();
                let write = matches!(op, Op::Writev { .. });
                let dsync = matches!(op, Op::Writev { dsync: true, .. });
                let fua = dsync && e.has(FLAG_SEND_FUA);
                flush_after = dsync && !fua && e.has(FLAG_SEND_FLUSH);
                let mut at = 0;
                while at < total || (total == 0 && n == 0) {
                    let len = (total - at).min(max);
                    let kind = if write { CMD_WRITE } else { CMD_READ };
                    let flags = if fua { CMD_FLAG_FUA } else { 0 };
                    let h = self.queue_part(user_data, kind, flags, offset + at as u64, len as u32);
                    let range = sub_iov(iov, at, len);
                    let p = self.parts.get_mut(&h).expect("just queued");
                    if write {
                        self.out.extend(range.iter().copied());
                        p.src = range;
                    } else {
                        p.dst = range;
                    }
                    n += 1;
                    at += len;
                    if total == 0 {
                        break;
                    }
                }
            }
            Op::Fdatasync if e.has(FLAG_SEND_FLUSH) => {
                self.queue_part(user_data, CMD_FLUSH, 0, 0, 0);
                n = 1;
            }
            Op::Discard { offset, len } if e.has(FLAG_SEND_TRIM) => {
                n = self.queue_ranges(user_data, CMD_TRIM, 0, offset, len);
            }
            Op::Fallocate { mode, offset, len } if e.has(FLAG_SEND_WRITE_ZEROES) => {
                let flags = if mode & libc::FALLOC_FL_PUNCH_HOLE == 0 {
                    CMD_FLAG_NO_HOLE
                } else {
                    0
                };
                debug_assert!(mode == sys::PUNCH_HOLE || mode == sys::ZERO_RANGE);
                n = self.queue_ranges(user_data, CMD_WRITE_ZEROES, flags, offset, len);
            }
            Op::Fallocate { offset, len, .. } => {
                // Zeroes written as data.
                let mut at = 0u64;
                while at < len {
                    let l = (len - at).min(ZEROES.len().min(max) as u64) as usize;
                    let h = self.queue_part(user_data, CMD_WRITE, 0, offset + at, l as u32);
                    let z = libc::iovec {
                        iov_base: ZEROES.as_ptr() as *mut _,
                        iov_len: l,
                    };
                    self.out.push_back(z);
                    self.parts.get_mut(&h).expect("just queued").src = vec![z];
                    n += 1;
                    at += l as u64;
                }
            }
            // Nothing to send: a server without flush (or trim) has nothing to do.
            Op::Fdatasync | Op::Discard { .. } => {}
        }
        if n == 0 {
            self.done.push(Completion {
                user_data,
                result: 0,
            });
            return Ok(());
        }
        self.ops.insert(
            user_data,
            Agg {
                left: n,
                result: 0,
                flush_after,
            },
        );
        self.send();
        Ok(())
    }

    /// Ranges of at most the maximum block size for a command without data.
    fn queue_ranges(&mut self, ud: u64, kind: u16, flags: u16, offset: u64, len: u64) -> usize {
        let max = u64::from(self.export.max_block.max(self.export.min_block));
        let mut at = 0;
        let mut n = 0;
        while at < len {
            let l = (len - at).min(max);
            self.queue_part(ud, kind, flags, offset + at, l as u32);
            at += l;
            n += 1;
        }
        n
    }

    /// Send what is queued, as far as the socket takes it.
    fn send(&mut self) {
        while !self.out.is_empty() && self.broken.is_none() {
            let (a, b) = self.out.as_slices();
            let v = if a.is_empty() { b } else { a };
            let cnt = v.len().min(libc::UIO_MAXIOV as usize);
            // SAFETY: iovecs of buffers that live until their requests complete (headers in
            // the parts, data in the caller's buffers).
            let r = unsafe { libc::writev(self.sock.as_raw_fd(), v.as_ptr(), cnt as i32) };
            if r < 0 {
                let e = io::Error::last_os_error();
                match e.kind() {
                    io::ErrorKind::WouldBlock => break,
                    io::ErrorKind::Interrupted => continue,
                    _ => return self.fail(format!("sending: {e}")),
                }
            }
            let mut left = r as usize;
            while left > 0 {
                let Some(front) = self.out.front_mut() else {
                    break;
                };
                if front.iov_len <= left {
                    left -= front.iov_len;
                    self.out.pop_front();
                } else {
                    // SAFETY: advancing inside the iovec's buffer.
                    front.iov_base = unsafe { front.iov_base.cast::<u8>().add(left) }.cast();
                    front.iov_len -= left;
                    left = 0;
                }
            }
        }
        let want = !self.out.is_empty();
        if want != self.want_out && self.broken.is_none() {
            let ev = libc::EPOLLIN as u32 | if want { libc::EPOLLOUT as u32 } else { 0 };
            let fd = self.sock.as_raw_fd();
            if epoll_ctl(self.epoll.as_raw_fd(), libc::EPOLL_CTL_MOD, fd, ev).is_ok() {
                self.want_out = want;
            }
        }
    }

    /// The connection is gone: connect again and resend what is not answered, or (past the
    /// reconnect timeout, or without a target) fail everything in flight.
    fn fail(&mut self, why: String) {
        if self.reconnect(&why) {
            return;
        }
        crate::log_limited!(
            log::Level::Error,
            "NBD connection lost: {why}; failing {} requests",
            self.parts.len()
        );
        self.broken = Some(why);
        self.out.clear();
        let parts: Vec<u64> = self.parts.keys().copied().collect();
        for h in parts {
            self.finish_part(h, -libc::EIO);
        }
        let _ = epoll_ctl(
            self.epoll.as_raw_fd(),
            libc::EPOLL_CTL_DEL,
            self.sock.as_raw_fd(),
            0,
        );
    }

    fn reconnect(&mut self, why: &str) -> bool {
        let Some((target, opts)) = self.target.clone() else {
            return false;
        };
        // A new loss, or the same one going on (the last reconnection brought no answer):
        // then wait before trying again and say nothing new.
        let ongoing = self.lost_since.is_some();
        let t0 = *self.lost_since.get_or_insert_with(std::time::Instant::now);
        if ongoing {
            log::debug!("{target}: lost again ({why})");
        } else {
            crate::log_limited!(
                log::Level::Warn,
                "{target}: connection lost ({why}); reconnecting every {:?} for up to {:?}, {} \
                 requests waiting",
                opts.reconnect_delay,
                opts.reconnect_timeout,
                self.parts.len()
            );
        }
        let _ = epoll_ctl(
            self.epoll.as_raw_fd(),
            libc::EPOLL_CTL_DEL,
            self.sock.as_raw_fd(),
            0,
        );
        let mut first = !ongoing;
        loop {
            if !first {
                if t0.elapsed() + opts.reconnect_delay > opts.reconnect_timeout {
                    crate::log_limited!(
                        log::Level::Error,
                        "{target}: not back after {:?}",
                        t0.elapsed()
                    );
                    return false;
                }
                std::thread::sleep(opts.reconnect_delay);
            }
            first = false;
            let (sock, e) = match crate::nbd::connect(&target, opts.timeout) {
                Ok(x) => x,
                Err(e) => {
                    log::debug!("{target}: {e}");
                    continue;
                }
            };
            if e.size != self.export.size {
                crate::log_limited!(
                    log::Level::Error,
                    "{target}: the export is {} bytes now, the guest was shown {}: not \
                     serving it",
                    e.size,
                    self.export.size
                );
                return false;
            }
            if sock.set_nonblocking(true).is_err()
                || epoll_ctl(
                    self.epoll.as_raw_fd(),
                    libc::EPOLL_CTL_ADD,
                    sock.as_raw_fd(),
                    libc::EPOLLIN as u32,
                )
                .is_err()
            {
                continue;
            }
            self.sock = sock;
            self.export = e;
            self.want_out = false;
            self.rx_start = 0;
            self.rx_end = 0;
            self.state = Rx::Header;
            // Everything not answered, again, in the order it was first sent.
            self.out.clear();
            let mut handles: Vec<u64> = self.parts.keys().copied().collect();
            handles.sort_unstable();
            for h in &handles {
                let p = &self.parts[h];
                self.out.push_back(libc::iovec {
                    iov_base: p.header.as_ptr() as *mut _,
                    iov_len: REQUEST_LEN,
                });
                self.out.extend(p.src.iter().copied());
            }
            if !ongoing {
                crate::log_limited!(
                    log::Level::Info,
                    "{target}: connected again after {:?}; resending {} requests",
                    t0.elapsed(),
                    handles.len()
                );
            }
            return true;
        }
    }

    /// A part ended with `result` (0 or a negative errno).
    fn finish_part(&mut self, handle: u64, result: i32) {
        let Some(p) = self.parts.remove(&handle) else {
            return;
        };
        drop(p.header);
        let Some(agg) = self.ops.get_mut(&p.user_data) else {
            return;
        };
        if result < 0 && agg.result >= 0 {
            agg.result = result;
        }
        if matches!(p.kind, CMD_READ | CMD_WRITE) && result == 0 && agg.result >= 0 {
            agg.result += p.len as i32;
        }
        agg.left -= 1;
        if agg.left > 0 {
            return;
        }
        let agg = self.ops.remove(&p.user_data).expect("present");
        if agg.flush_after && agg.result >= 0 && self.broken.is_none() {
            // Its result is the write's once the flush is done.
            self.queue_part(p.user_data, CMD_FLUSH, 0, 0, 0);
            self.ops.insert(
                p.user_data,
                Agg {
                    left: 1,
                    result: agg.result,
                    flush_after: false,
                },
            );
            self.send();
            return;
        }
        self.done.push(Completion {
            user_data: p.user_data,
            result: agg.result,
        });
    }

    /// Block until something may have completed (at most a short while).
    pub fn wait_one(&mut self) -> io::Result<()> {
        let mut p = libc::pollfd {
            fd: self.epoll.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd.
        unsafe { libc::poll(&mut p, 1, 50) };
        Ok(())
    }

    pub fn has_completions(&mut self) -> bool {
        !self.done.is_empty()
    }

    pub fn reap(&mut self, out: &mut Vec<Completion>) {
        self.send();
        self.receive();
        self.send();
        out.append(&mut self.done);
    }

    /// Requests sent and not answered yet.
    pub fn in_flight(&self) -> usize {
        self.parts.len()
    }
}

impl Drop for NbdEngine {
    /// The queue stopped: what completed is made durable on the server (FLUSH, waited for a
    /// few seconds at most), then the session ends (NBD_CMD_DISC).
    fn drop(&mut self) {
        if self.broken.is_some() {
            return;
        }
        // No reconnecting from here on.
        self.target = None;
        if self.parts.is_empty() && self.export.has(FLAG_SEND_FLUSH) {
            const FLUSH_ID: u64 = u64::MAX;
            self.queue_part(FLUSH_ID, CMD_FLUSH, 0, 0, 0);
            self.ops.insert(
                FLUSH_ID,
                Agg {
                    left: 1,
                    result: 0,
                    flush_after: false,
                },
            );
            let t0 = std::time::Instant::now();
            let mut out = Vec::new();
            while self.broken.is_none()
                && !out.iter().any(|c: &Completion| c.user_data == FLUSH_ID)
                && t0.elapsed() < std::time::Duration::from_secs(5)
            {
                self.send();
                let _ = self.wait_one();
                self.reap(&mut out);
            }
            if let Some(c) = out.iter().find(|c| c.user_data == FLUSH_ID) {
                if c.result < 0 {
                    crate::log_limited!(
                        log::Level::Error,
                        "the final NBD flush failed: {}",
                        io::Error::from_raw_os_error(-c.result)
                    );
                }
            }
        }
        if self.broken.is_none() {
            let _ = self.sock.set_nonblocking(false);
            let _ = std::io::Write::write_all(&mut self.sock, &Request::disc().encode());
        }
    }
}
