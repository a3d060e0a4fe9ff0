//! A small synchronous libblkio client (`virtio-blk-vhost-user`) with a memory region of
//! buffers, batches of requests, and the errno values libblkio reports for statuses.

use std::mem::MaybeUninit;
use std::path::Path;
use std::thread;
use std::time::{Duration, Instant};

use blkio::{Blkio, Blkioq, Completion, MemoryRegion, ReqFlags};

use super::*;

/// One request. Buffers are given as byte ranges of the client's memory region.
#[derive(Clone, Debug)]
pub enum Op {
    Read {
        offset: u64,
        buf: usize,
        len: usize,
    },
    Write {
        offset: u64,
        buf: usize,
        len: usize,
    },
    /// A write with BLKIO_REQ_FUA (libblkio's virtio-blk driver follows it with a flush).
    WriteFua {
        offset: u64,
        buf: usize,
        len: usize,
    },
    /// (region offset, length) segments
    Readv {
        offset: u64,
        iov: Vec<(usize, usize)>,
    },
    Writev {
        offset: u64,
        iov: Vec<(usize, usize)>,
    },
    Flush,
    Discard {
        offset: u64,
        len: u64,
    },
    WriteZeroes {
        offset: u64,
        len: u64,
        flags: ReqFlags,
    },
}

#[derive(Clone, Copy, Debug)]
pub struct ClientOpts {
    pub num_queues: i32,
    /// libblkio's "read-only" property (needed to start on a read-only device).
    pub read_only: bool,
    /// Size of the one memory region shared with the backend.
    pub mem_size: usize,
}

impl Default for ClientOpts {
    fn default() -> Self {
        ClientOpts {
            num_queues: 1,
            read_only: false,
            mem_size: 4 * MIB as usize,
        }
    }
}

/// A started libblkio `virtio-blk-vhost-user` instance with one mapped memory region.
pub struct Client {
    // Field order is drop order: queues, then the instance (whose drop closes the socket).
    pub queues: Vec<Blkioq>,
    pub blkio: Blkio,
    pub mem: MemoryRegion,
}

/// Connects libblkio to `socket`, retrying while the connection is refused (the socket file may
/// exist a moment before the backend listens), up to `CONNECT_DEADLINE`. Errors after the
/// connection was established are returned as they are.
pub fn try_connect(socket: &Path, opts: ClientOpts) -> Result<Client, blkio::Error> {
    let deadline = Instant::now() + CONNECT_DEADLINE;
    let path = socket.to_str().expect("utf-8 socket path");
    let mut blkio = loop {
        let mut b = Blkio::new("virtio-blk-vhost-user")?;
        b.set_str("path", path)?;
        if opts.read_only {
            b.set_bool("read-only", true)?;
        }
        match b.connect() {
            Ok(()) => break b,
            Err(e) if Instant::now() < deadline => {
                let _ = e;
                thread::sleep(Duration::from_millis(10));
            }
            Err(e) => return Err(e),
        }
    };
    blkio.set_i32("num-queues", opts.num_queues)?;
    let started = blkio.start()?;
    let mem = blkio.alloc_mem_region(opts.mem_size)?;
    blkio.map_mem_region(&mem)?;
    Ok(Client {
        queues: started.queues,
        blkio,
        mem,
    })
}

/// `try_connect`, panicking on error.
pub fn connect(socket: &Path, opts: ClientOpts) -> Client {
    try_connect(socket, opts).unwrap_or_else(|e| {
        panic!(
            "libblkio connect to {}: {e} (errno {:?})",
            socket.display(),
            e.errno()
        )
    })
}

/// `connect` with `num_queues` queues and default options.
pub fn connect_queues(socket: &Path, num_queues: i32) -> Client {
    connect(
        socket,
        ClientOpts {
            num_queues,
            ..ClientOpts::default()
        },
    )
}

impl Client {
    pub fn capacity(&self) -> u64 {
        self.blkio.get_u64("capacity").expect("capacity property")
    }

    pub fn mem(&self) -> &[u8] {
        // SAFETY: the region is a live shared mapping of `len` bytes owned by `self.blkio`
        // until it is dropped; the borrow of `self` keeps it alive. The backend only writes to
        // it during requests, which `submit` waits for while holding `&mut self`.
        unsafe { std::slice::from_raw_parts(self.mem.addr as *const u8, self.mem.len) }
    }

    pub fn mem_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `mem`; `&mut self` makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.mem.addr as *mut u8, self.mem.len) }
    }

    /// Submits one request on queue `q` and waits for it: 0 or a negative errno.
    pub fn submit(&mut self, q: usize, op: Op) -> i32 {
        self.submit_batch(q, &[op])[0]
    }

    /// Submits all requests on queue `q` at once and waits for all; results in order.
    pub fn submit_batch(&mut self, q: usize, ops: &[Op]) -> Vec<i32> {
        let mem = MemView {
            addr: self.mem.addr,
            len: self.mem.len,
        };
        run_batch(&mut self.queues[q], mem, ops)
    }

    /// Writes `data` at disk `offset` from the start of the memory region.
    pub fn write_at(&mut self, q: usize, offset: u64, data: &[u8]) -> i32 {
        self.mem_mut()[..data.len()].copy_from_slice(data);
        self.submit(
            q,
            Op::Write {
                offset,
                buf: 0,
                len: data.len(),
            },
        )
    }

    /// Reads `len` bytes at disk `offset` into the start of the memory region.
    pub fn read_at(&mut self, q: usize, offset: u64, len: usize) -> Result<Vec<u8>, i32> {
        match self.submit(
            q,
            Op::Read {
                offset,
                buf: 0,
                len,
            },
        ) {
            0 => Ok(self.mem()[..len].to_vec()),
            err => Err(err),
        }
    }

    /// Reads the whole disk in chunks of at most the region size.
    pub fn read_all(&mut self, q: usize) -> Vec<u8> {
        let cap = self.capacity();
        let chunk = (self.mem.len as u64).min(MIB);
        let mut out = Vec::with_capacity(cap as usize);
        let mut off = 0;
        while off < cap {
            let n = (cap - off).min(chunk) as usize;
            let data = self
                .read_at(q, off, n)
                .unwrap_or_else(|e| panic!("read {n} bytes at {off}: errno {e}"));
            out.extend_from_slice(&data);
            off += n as u64;
        }
        out
    }

    /// Moves the queues out (e.g. to drive them from other threads) with a view of the memory
    /// region; the region stays valid as long as `self` (the `Blkio`) lives.
    pub fn take_queues(&mut self) -> (Vec<Blkioq>, MemView) {
        (
            std::mem::take(&mut self.queues),
            MemView {
                addr: self.mem.addr,
                len: self.mem.len,
            },
        )
    }
}

/// The client's memory region as address and length (Send, for use from other threads).
#[derive(Clone, Copy, Debug)]
pub struct MemView {
    pub addr: usize,
    pub len: usize,
}

impl MemView {
    /// A mutable view of `len` bytes at `off` of the region.
    ///
    /// # Safety
    /// The region must still be mapped (its `Client` alive), no request may be using these
    /// bytes, and no other live reference may overlap them.
    pub unsafe fn slice_mut<'a>(&self, off: usize, len: usize) -> &'a mut [u8] {
        assert!(
            off + len <= self.len,
            "{off}+{len} beyond region of {}",
            self.len
        );
        // SAFETY: in bounds (checked above); the rest is the caller's contract.
        unsafe { std::slice::from_raw_parts_mut((self.addr + off) as *mut u8, len) }
    }
}

thread_local! {
    /// This thread's deadline for a batch (None: `IO_DEADLINE`).
    static DEADLINE: std::cell::Cell<Option<Duration>> = const { std::cell::Cell::new(None) };
}

/// Give up waiting for a batch after `d` on this thread (a writer whose daemon a test kills
/// gives up soon instead of after `IO_DEADLINE`).
pub fn set_io_deadline_for_this_thread(d: Duration) {
    DEADLINE.with(|c| c.set(Some(d)));
}

/// Submits `ops` on `q` (buffers are ranges of `mem`) and waits for all of them with a deadline.
/// Returns each request's result (0 or a negative errno), in order.
pub fn run_batch(q: &mut Blkioq, mem: MemView, ops: &[Op]) -> Vec<i32> {
    let check = |buf: usize, len: usize| {
        assert!(
            buf + len <= mem.len,
            "buffer {buf}+{len} beyond region of {}",
            mem.len
        );
        (mem.addr + buf) as *mut u8
    };
    // iovec arrays must stay alive until their requests complete.
    let mut iovecs: Vec<Vec<libc::iovec>> = Vec::new();
    for (i, op) in ops.iter().enumerate() {
        match op {
            Op::Read { offset, buf, len } => {
                q.read(*offset, check(*buf, *len), *len, i, ReqFlags::empty())
            }
            Op::Write { offset, buf, len } => {
                q.write(*offset, check(*buf, *len), *len, i, ReqFlags::empty())
            }
            Op::WriteFua { offset, buf, len } => {
                q.write(*offset, check(*buf, *len), *len, i, ReqFlags::FUA)
            }
            Op::Readv { offset, iov } | Op::Writev { offset, iov } => {
                let v: Vec<libc::iovec> = iov
                    .iter()
                    .map(|&(b, l)| libc::iovec {
                        iov_base: check(b, l).cast(),
                        iov_len: l,
                    })
                    .collect();
                iovecs.push(v);
                let v = iovecs.last().unwrap();
                if matches!(op, Op::Readv { .. }) {
                    q.readv(*offset, v.as_ptr(), v.len() as u32, i, ReqFlags::empty());
                } else {
                    q.writev(*offset, v.as_ptr(), v.len() as u32, i, ReqFlags::empty());
                }
            }
            Op::Flush => q.flush(i, ReqFlags::empty()),
            Op::Discard { offset, len } => q.discard(*offset, *len, i, ReqFlags::empty()),
            Op::WriteZeroes { offset, len, flags } => q.write_zeroes(*offset, *len, i, *flags),
        }
    }

    let mut results: Vec<Option<i32>> = vec![None; ops.len()];
    let mut done = 0;
    let deadline = Instant::now() + DEADLINE.with(|d| d.get()).unwrap_or(IO_DEADLINE);
    let mut completions: Vec<MaybeUninit<Completion>> = Vec::with_capacity(ops.len());
    completions.resize_with(ops.len(), MaybeUninit::uninit);
    while done < ops.len() {
        let mut timeout = deadline.saturating_duration_since(Instant::now());
        let n = q
            .do_io(
                &mut completions[..ops.len() - done],
                1,
                Some(&mut timeout),
                None,
            )
            .unwrap_or_else(|e| {
                panic!(
                    "do_io with {} of {} requests outstanding: {e} (errno {:?}); ops: {ops:?}",
                    ops.len() - done,
                    ops.len(),
                    e.errno()
                )
            });
        for c in &completions[..n] {
            // SAFETY: do_io initialised the first `n` elements.
            let c = unsafe { c.assume_init_ref() };
            assert!(
                results[c.user_data].is_none(),
                "duplicate completion {}",
                c.user_data
            );
            results[c.user_data] = Some(c.ret);
        }
        done += n;
    }
    drop(iovecs);
    results.into_iter().map(Option::unwrap).collect()
}

/// Negative errno values as libblkio reports them for virtio-blk status codes.
pub const EIO: i32 = -libc::EIO; // VIRTIO_BLK_S_IOERR
pub const ENOTSUP: i32 = -libc::ENOTSUP; // VIRTIO_BLK_S_UNSUPP
pub const EPROTO: i32 = -libc::EPROTO; // any other status byte

pub fn errno_name(ret: i32) -> String {
    if ret == 0 {
        "success".into()
    } else {
        format!("{ret} ({})", std::io::Error::from_raw_os_error(-ret))
    }
}
