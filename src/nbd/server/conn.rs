//! The transmission phase, read-only: READ (streamed in pieces, all-zero pieces as holes
//! with structured replies), BLOCK_STATUS (each selected meta context), CACHE (nothing to
//! do), DISC; writes get EPERM, anything else EINVAL. A request header with a bad magic, or a
//! write whose data is longer than [`MAX_REQUEST`], closes the connection (the stream cannot
//! be followed any more).

use std::io::{self, Read, Write};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;

use super::handshake::Session;
use super::{ClientStats, Export, ExportError, CHUNK, MAX_REQUEST};
use crate::io::bounce::AlignedBuf;
use crate::locks::Locked;
use crate::nbd::handshake::Stream;
use crate::nbd::wire::*;

/// Descriptors in one BLOCK_STATUS chunk at most.
const MAX_DESCRIPTORS: usize = 8192;

struct Replier<'a> {
    s: &'a mut Stream,
    structured: bool,
}

impl Replier<'_> {
    fn simple(&mut self, handle: u64, error: u32) -> io::Result<()> {
        let mut b = [0u8; SIMPLE_REPLY_LEN];
        b[0..4].copy_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
        b[4..8].copy_from_slice(&error.to_be_bytes());
        b[8..16].copy_from_slice(&handle.to_be_bytes());
        self.s.write_all(&b)
    }

    fn chunk_header(&mut self, handle: u64, flags: u16, kind: u16, len: u32) -> io::Result<()> {
        let mut b = [0u8; CHUNK_HEADER_LEN];
        b[0..4].copy_from_slice(&STRUCTURED_REPLY_MAGIC.to_be_bytes());
        b[4..6].copy_from_slice(&flags.to_be_bytes());
        b[6..8].copy_from_slice(&kind.to_be_bytes());
        b[8..16].copy_from_slice(&handle.to_be_bytes());
        b[16..20].copy_from_slice(&len.to_be_bytes());
        self.s.write_all(&b)
    }

    /// The request failed: a simple error reply, or a final error chunk with the message.
    fn error(&mut self, handle: u64, e: &ExportError) -> io::Result<()> {
        if !self.structured {
            return self.simple(handle, e.code);
        }
        let msg = &e.message.as_bytes()[..e.message.len().min(4096)];
        self.chunk_header(
            handle,
            REPLY_FLAG_DONE,
            REPLY_TYPE_ERROR,
            6 + msg.len() as u32,
        )?;
        let mut b = Vec::with_capacity(6 + msg.len());
        b.extend_from_slice(&e.code.to_be_bytes());
        b.extend_from_slice(&(msg.len() as u16).to_be_bytes());
        b.extend_from_slice(msg);
        self.s.write_all(&b)
    }

    /// Success with nothing to say.
    fn done(&mut self, handle: u64) -> io::Result<()> {
        if self.structured {
            self.chunk_header(handle, REPLY_FLAG_DONE, REPLY_TYPE_NONE, 0)
        } else {
            self.simple(handle, 0)
        }
    }
}

fn err(code: u32, message: &str) -> ExportError {
    ExportError {
        code,
        message: message.to_string(),
    }
}

/// Threads reading the disk for one client with structured replies (its READs are answered
/// in any order, each with its own buffer of at most [`CHUNK`] bytes). Three: a backup
/// read about as fast as qemu-storage-daemon's on a shared disk while the guest keeps twice
/// its write rate (BENCHMARKS.md, "Backups": more readers read faster and take the disk
/// from the guest).
const READERS: usize = 3;

/// One READ for a reader thread.
struct ReadJob {
    handle: u64,
    offset: u64,
    len: u32,
}

/// Serve requests until the client disconnects or breaks the protocol.
pub fn transmission(
    s: &mut Stream,
    export: &dyn Export,
    session: &Session,
    stats: &ClientStats,
    total_read: &AtomicU64,
) -> io::Result<()> {
    if !session.structured {
        // Simple replies cannot be interleaved: one request after the other.
        let mut out = s.try_clone()?;
        let mut buf = Buffer::default();
        return serve(
            s,
            export,
            session,
            stats,
            &mut |job: ReadJob| {
                let mut r = Replier {
                    s: &mut out,
                    structured: false,
                };
                read(&mut r, export, job, &mut buf, stats, total_read)
            },
            &Mutex::new(s.try_clone()?),
        );
    }
    let out = Mutex::new(s.try_clone()?);
    let (tx, rx) = std::sync::mpsc::sync_channel::<ReadJob>(READERS);
    let rx = Mutex::new(rx);
    let broken = AtomicBool::new(false);
    std::thread::scope(|sc| {
        for _ in 0..READERS {
            sc.spawn(|| {
                let mut buf = Buffer::default();
                loop {
                    let job = match rx.locked().recv() {
                        Ok(j) => j,
                        Err(_) => return,
                    };
                    if broken.load(Ordering::Relaxed) {
                        continue;
                    }
                    // The lock is held per chunk only, not while the disk is read.
                    if read_structured(&out, export, job, &mut buf, stats, total_read).is_err() {
                        broken.store(true, Ordering::Relaxed);
                        out.locked().shutdown();
                    }
                }
            });
        }
        let r = serve(
            s,
            export,
            session,
            stats,
            &mut |job| {
                if broken.load(Ordering::Relaxed) {
                    return Err(io::Error::new(io::ErrorKind::BrokenPipe, "client gone"));
                }
                tx.send(job)
                    .map_err(|_| io::Error::new(io::ErrorKind::BrokenPipe, "readers gone"))
            },
            &out,
        );
        drop(tx);
        r
    })
}

/// A reader's buffer, 4 KiB-aligned (the disk is read straight into it).
#[derive(Default)]
struct Buffer(Option<AlignedBuf>);

impl Buffer {
    fn get(&mut self, n: usize) -> io::Result<&mut [u8]> {
        if self.0.as_ref().is_none_or(|b| b.len() < n) {
            self.0 = Some(AlignedBuf::new(n.next_multiple_of(4096).max(65536), 4096)?);
        }
        match self.0.as_mut() {
            Some(b) => Ok(&mut b.as_mut_slice()[..n]),
            None => Err(io::Error::from_raw_os_error(libc::ENOMEM)),
        }
    }
}

/// Read requests and answer them; READs go to `read` (which may answer later, on another
/// thread); everything else is answered here through `out`.
fn serve(
    s: &mut Stream,
    export: &dyn Export,
    session: &Session,
    stats: &ClientStats,
    read: &mut dyn FnMut(ReadJob) -> io::Result<()>,
    out: &Mutex<Stream>,
) -> io::Result<()> {
    loop {
        let mut h = [0u8; REQUEST_LEN];
        match s.read_exact(&mut h) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e),
        }
        let be32 = |o: usize| u32::from_be_bytes([h[o], h[o + 1], h[o + 2], h[o + 3]]);
        if be32(0) != REQUEST_MAGIC {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "bad request magic",
            ));
        }
        let flags = u16::from_be_bytes([h[4], h[5]]);
        let kind = u16::from_be_bytes([h[6], h[7]]);
        let handle = u64::from_be_bytes(h[8..16].try_into().unwrap_or_default());
        let offset = u64::from_be_bytes(h[16..24].try_into().unwrap_or_default());
        let len = be32(24);
        stats.requests.fetch_add(1, Ordering::Relaxed);
        let size = export.size();
        let inside = offset
            .checked_add(u64::from(len))
            .is_some_and(|end| end <= size);
        if kind == CMD_READ && inside && len > 0 && len <= MAX_REQUEST {
            read(ReadJob {
                handle,
                offset,
                len,
            })?;
            continue;
        }
        if kind == CMD_WRITE {
            if len > MAX_REQUEST {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    "write data longer than the maximum block size",
                ));
            }
            // Read the data (to stay in step with the client), then refuse.
            io::copy(&mut (&mut *s).take(u64::from(len)), &mut io::sink())?;
        }
        let mut o = out.locked();
        let mut r = Replier {
            s: &mut o,
            structured: session.structured,
        };
        match kind {
            CMD_DISC => return Ok(()),
            CMD_READ if !inside || len == 0 => {
                r.error(handle, &err(EINVAL, "read outside the export"))?
            }
            CMD_READ => r.error(
                handle,
                &err(EOVERFLOW, "read longer than the maximum block size"),
            )?,
            CMD_BLOCK_STATUS => {
                if !inside || len == 0 {
                    r.error(handle, &err(EINVAL, "block status outside the export"))?;
                } else if !session.structured || session.contexts.is_empty() {
                    r.error(handle, &err(EINVAL, "no meta context was selected"))?;
                } else {
                    block_status(&mut r, export, session, handle, flags, offset, len)?;
                }
            }
            CMD_CACHE => {
                if inside {
                    r.done(handle)?;
                } else {
                    r.error(handle, &err(EINVAL, "cache outside the export"))?;
                }
            }
            CMD_WRITE | CMD_TRIM | CMD_WRITE_ZEROES => {
                r.error(handle, &err(EPERM, "the export is read-only"))?;
            }
            _ => r.error(handle, &err(EINVAL, "command not supported"))?,
        }
    }
}

/// Where a piece of a READ lies in it.
struct Piece {
    at: u64,
    first: bool,
    last: bool,
}

/// Read a READ's range in pieces of at most [`CHUNK`] bytes and hand each to `send`, counting
/// what was sent. A failed read is logged and handed on as the last piece.
fn for_each_piece(
    export: &dyn Export,
    job: &ReadJob,
    buf: &mut Buffer,
    stats: &ClientStats,
    total_read: &AtomicU64,
    mut send: impl FnMut(&Piece, Result<&[u8], ExportError>) -> io::Result<()>,
) -> io::Result<()> {
    let len = job.len as usize;
    let mut done = 0usize;
    while done < len {
        let n = (len - done).min(CHUNK);
        let piece = Piece {
            at: job.offset + done as u64,
            first: done == 0,
            last: done + n == len,
        };
        let b = buf.get(n)?;
        if let Err(e) = export.read(piece.at, b) {
            log_read_error(export, n, piece.at, &e);
            return send(&piece, Err(e));
        }
        send(&piece, Ok(b))?;
        done += n;
        stats.bytes_read.fetch_add(n as u64, Ordering::Relaxed);
        total_read.fetch_add(n as u64, Ordering::Relaxed);
    }
    Ok(())
}

/// A READ with structured replies: each piece read, then sent as one chunk under the lock.
fn read_structured(
    out: &Mutex<Stream>,
    export: &dyn Export,
    job: ReadJob,
    buf: &mut Buffer,
    stats: &ClientStats,
    total_read: &AtomicU64,
) -> io::Result<()> {
    let handle = job.handle;
    for_each_piece(export, &job, buf, stats, total_read, |p, data| {
        let mut o = out.locked();
        let mut rep = Replier {
            s: &mut o,
            structured: true,
        };
        let b = match data {
            Ok(b) => b,
            Err(e) => return rep.error(handle, &e),
        };
        let flags = if p.last { REPLY_FLAG_DONE } else { 0 };
        if crate::zero::is_zero(b) {
            rep.chunk_header(handle, flags, REPLY_TYPE_OFFSET_HOLE, 12)?;
            let mut h = [0u8; 12];
            h[0..8].copy_from_slice(&p.at.to_be_bytes());
            h[8..12].copy_from_slice(&(b.len() as u32).to_be_bytes());
            rep.s.write_all(&h)
        } else {
            rep.chunk_header(handle, flags, REPLY_TYPE_OFFSET_DATA, 8 + b.len() as u32)?;
            rep.s.write_all(&p.at.to_be_bytes())?;
            rep.s.write_all(b)
        }
    })
}

fn log_read_error(export: &dyn Export, n: usize, at: u64, e: &ExportError) {
    crate::log_limited!(
        log::Level::Warn,
        "NBD export {}: read of {n} bytes at {at} failed: {}",
        export.name(),
        e.message
    );
}

/// A READ with a simple reply: the header, then the data as it is read (an error after the
/// first piece can only close the connection).
fn read(
    r: &mut Replier<'_>,
    export: &dyn Export,
    job: ReadJob,
    buf: &mut Buffer,
    stats: &ClientStats,
    total_read: &AtomicU64,
) -> io::Result<()> {
    let handle = job.handle;
    for_each_piece(export, &job, buf, stats, total_read, |p, data| match data {
        Err(e) if !p.first => Err(io::Error::other(e.message)),
        Err(e) => r.error(handle, &e),
        Ok(b) => {
            if p.first {
                r.simple(handle, 0)?;
            }
            r.s.write_all(b)
        }
    })
}

fn block_status(
    r: &mut Replier<'_>,
    export: &dyn Export,
    session: &Session,
    handle: u64,
    flags: u16,
    offset: u64,
    len: u32,
) -> io::Result<()> {
    // Every context's answer first: an error is then the whole reply.
    let mut answers = Vec::with_capacity(session.contexts.len());
    for (i, c) in session.contexts.iter().enumerate() {
        match export.block_status(c, offset, len) {
            Ok(mut d) => {
                if d.is_empty() {
                    return r.error(handle, &err(EIO, "no extents"));
                }
                let max = if flags & CMD_FLAG_REQ_ONE != 0 {
                    1
                } else {
                    MAX_DESCRIPTORS
                };
                d.truncate(max);
                answers.push((i as u32 + 1, d));
            }
            Err(e) => return r.error(handle, &e),
        }
    }
    let n = answers.len();
    for (k, (id, d)) in answers.into_iter().enumerate() {
        let fl = if k + 1 == n { REPLY_FLAG_DONE } else { 0 };
        r.chunk_header(handle, fl, REPLY_TYPE_BLOCK_STATUS, 4 + 8 * d.len() as u32)?;
        let mut b = Vec::with_capacity(4 + 8 * d.len());
        b.extend_from_slice(&id.to_be_bytes());
        for (l, f) in d {
            b.extend_from_slice(&l.to_be_bytes());
            b.extend_from_slice(&f.to_be_bytes());
        }
        r.s.write_all(&b)?;
    }
    Ok(())
}
