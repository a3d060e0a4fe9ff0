//! The transmission phase, read-only: READ (streamed in pieces, all-zero pieces as holes
//! with structured replies), BLOCK_STATUS (each selected meta context), CACHE (nothing to
//! do), DISC; writes get EPERM, anything else EINVAL. A request header with a bad magic, or a
//! write whose data is longer than [`MAX_REQUEST`], closes the connection (the stream cannot
//! be followed any more).

use std::io::{self, Read, Write};
use std::sync::atomic::{AtomicU64, Ordering};

use super::handshake::Session;
use super::{ClientStats, Export, ExportError, CHUNK, MAX_REQUEST};
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

/// Serve requests until the client disconnects or breaks the protocol.
pub fn transmission(
    s: &mut Stream,
    export: &dyn Export,
    session: &Session,
    stats: &ClientStats,
    total_read: &AtomicU64,
) -> io::Result<()> {
    let mut buf: Vec<u8> = Vec::new();
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
        let mut r = Replier {
            s,
            structured: session.structured,
        };
        let size = export.size();
        let inside = offset
            .checked_add(u64::from(len))
            .is_some_and(|end| end <= size);
        match kind {
            CMD_DISC => return Ok(()),
            CMD_READ => {
                if !inside || len == 0 {
                    r.error(handle, &err(EINVAL, "read outside the export"))?;
                } else if len > MAX_REQUEST {
                    r.error(
                        handle,
                        &err(EOVERFLOW, "read longer than the maximum block size"),
                    )?;
                } else {
                    read(
                        &mut r, export, handle, offset, len, &mut buf, stats, total_read,
                    )?;
                }
            }
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
            CMD_WRITE => {
                if len > MAX_REQUEST {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        "write data longer than the maximum block size",
                    ));
                }
                // Read the data (to stay in step with the client), then refuse.
                io::copy(&mut (&mut *r.s).take(u64::from(len)), &mut io::sink())?;
                r.error(handle, &err(EPERM, "the export is read-only"))?;
            }
            CMD_TRIM | CMD_WRITE_ZEROES => {
                r.error(handle, &err(EPERM, "the export is read-only"))?;
            }
            _ => r.error(handle, &err(EINVAL, "command not supported"))?,
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn read(
    r: &mut Replier<'_>,
    export: &dyn Export,
    handle: u64,
    offset: u64,
    len: u32,
    buf: &mut Vec<u8>,
    stats: &ClientStats,
    total_read: &AtomicU64,
) -> io::Result<()> {
    let len = len as usize;
    let mut done = 0usize;
    while done < len {
        let n = (len - done).min(CHUNK);
        buf.resize(n, 0);
        let at = offset + done as u64;
        if let Err(e) = export.read(at, buf) {
            crate::log_limited!(
                log::Level::Warn,
                "NBD export {}: read of {n} bytes at {at} failed: {}",
                export.name(),
                e.message
            );
            if done > 0 && !r.structured {
                // Part of a simple reply's data is out: it cannot be an error any more.
                return Err(io::Error::other(e.message));
            }
            return r.error(handle, &e);
        }
        let last = done + n == len;
        if r.structured {
            let flags = if last { REPLY_FLAG_DONE } else { 0 };
            if crate::zero::is_zero(buf) {
                r.chunk_header(handle, flags, REPLY_TYPE_OFFSET_HOLE, 12)?;
                let mut b = [0u8; 12];
                b[0..8].copy_from_slice(&at.to_be_bytes());
                b[8..12].copy_from_slice(&(n as u32).to_be_bytes());
                r.s.write_all(&b)?;
            } else {
                r.chunk_header(handle, flags, REPLY_TYPE_OFFSET_DATA, 8 + n as u32)?;
                r.s.write_all(&at.to_be_bytes())?;
                r.s.write_all(buf)?;
            }
        } else {
            if done == 0 {
                r.simple(handle, 0)?;
            }
            r.s.write_all(buf)?;
        }
        done += n;
        stats.bytes_read.fetch_add(n as u64, Ordering::Relaxed);
        total_read.fetch_add(n as u64, Ordering::Relaxed);
    }
    Ok(())
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
