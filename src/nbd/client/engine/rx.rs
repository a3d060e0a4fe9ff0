//! Receiving: replies read through a buffer, parsed (simple replies, structured chunks:
//! data, holes, errors), checked against the request they answer (a reply a server had no
//! business sending breaks the connection), and copied into the request's buffers.

use std::io::{self, Read};

use super::{NbdEngine, Rx};
use crate::nbd::wire::*;

/// Split `iov` at byte `at`, taking `len` bytes: the iovecs of that range.
pub(super) fn sub_iov(iov: &[libc::iovec], mut at: usize, mut len: usize) -> Vec<libc::iovec> {
    let mut out = Vec::new();
    for v in iov {
        if len == 0 {
            break;
        }
        if at >= v.iov_len {
            at -= v.iov_len;
            continue;
        }
        let n = (v.iov_len - at).min(len);
        out.push(libc::iovec {
            // SAFETY: pointer arithmetic inside the iovec's own buffer.
            iov_base: unsafe { v.iov_base.cast::<u8>().add(at) }.cast(),
            iov_len: n,
        });
        len -= n;
        at = 0;
    }
    out
}

/// Copy `src` into `dst` iovecs starting `at` bytes in.
///
/// # Safety
/// `dst` must describe writable memory owned by the request.
unsafe fn copy_into(dst: &[libc::iovec], at: usize, src: &[u8]) {
    let mut pos = 0;
    for v in sub_iov(dst, at, src.len()) {
        // SAFETY: the caller's buffers; `v` lies inside them (sub_iov) and `src` holds
        // `pos + v.iov_len` bytes (sub_iov gives at most `src.len()` in all).
        unsafe { std::ptr::copy_nonoverlapping(src[pos..].as_ptr(), v.iov_base.cast(), v.iov_len) };
        pos += v.iov_len;
    }
}

/// Zero `len` bytes of `dst` from `at`.
///
/// # Safety
/// As for [`copy_into`].
unsafe fn zero_into(dst: &[libc::iovec], at: usize, len: usize) {
    for v in sub_iov(dst, at, len) {
        // SAFETY: inside the caller's buffers.
        unsafe { std::ptr::write_bytes(v.iov_base.cast::<u8>(), 0, v.iov_len) };
    }
}

impl NbdEngine {
    /// Read what arrived and handle the replies in it.
    pub(super) fn receive(&mut self) {
        loop {
            if self.broken.is_some() {
                return;
            }
            if self.rx_start == self.rx_end {
                self.rx_start = 0;
                self.rx_end = 0;
            } else if self.rx_end == self.rx.len() {
                self.rx.copy_within(self.rx_start..self.rx_end, 0);
                self.rx_end -= self.rx_start;
                self.rx_start = 0;
            }
            let r = self.sock.read(&mut self.rx[self.rx_end..]);
            match r {
                Ok(0) => return self.fail("the server closed the connection".into()),
                Ok(n) => self.rx_end += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return self.fail(format!("receiving: {e}")),
            }
            if let Err(why) = self.parse() {
                return self.fail(why);
            }
        }
    }

    /// Handle every complete message in the receive buffer.
    fn parse(&mut self) -> Result<(), String> {
        loop {
            let avail = &self.rx[self.rx_start..self.rx_end];
            match &mut self.state {
                Rx::Header => {
                    let Some((h, n)) = decode_reply(avail)? else {
                        return Ok(());
                    };
                    self.rx_start += n;
                    match h {
                        ReplyHeader::Simple { handle, error } => {
                            let p = self
                                .parts
                                .get(&handle)
                                .ok_or(format!("a reply to unknown handle {handle}"))?;
                            // The server answers properly again.
                            self.lost_since = None;
                            if error == 0 && p.kind == CMD_READ && p.len > 0 {
                                self.state = Rx::SimpleData { handle, done: 0 };
                            } else {
                                let r = if error == 0 { 0 } else { -errno_of(error) };
                                self.finish_part(handle, r);
                            }
                        }
                        ReplyHeader::Chunk {
                            handle,
                            flags,
                            kind,
                            len,
                        } => {
                            if !self.parts.contains_key(&handle) {
                                return Err(format!("a chunk for unknown handle {handle}"));
                            }
                            if len > 64 << 20 {
                                return Err(format!("a chunk of {len} bytes"));
                            }
                            self.state = Rx::Chunk {
                                handle,
                                flags,
                                kind,
                                len: len as usize,
                                got: 0,
                                meta: Vec::new(),
                                at: None,
                            };
                        }
                    }
                }
                Rx::SimpleData { handle, done } => {
                    let (handle, d) = (*handle, *done);
                    let p = self.parts.get(&handle).ok_or("a read part vanished")?;
                    let n = (p.len as usize - d).min(avail.len());
                    // SAFETY: the part's destination, inside the request's buffers.
                    unsafe { copy_into(&p.dst, d, &avail[..n]) };
                    self.rx_start += n;
                    if d + n == p.len as usize {
                        self.state = Rx::Header;
                        self.finish_part(handle, 0);
                    } else {
                        self.state = Rx::SimpleData {
                            handle,
                            done: d + n,
                        };
                        return Ok(());
                    }
                }
                Rx::Chunk { .. } => {
                    if !self.chunk_step()? {
                        return Ok(());
                    }
                }
            }
        }
    }

    /// Move a structured chunk forward; true when it is complete.
    fn chunk_step(&mut self) -> Result<bool, String> {
        let avail_len = self.rx_end - self.rx_start;
        let Rx::Chunk {
            handle,
            flags,
            kind,
            len,
            got,
            meta,
            at,
        } = &mut self.state
        else {
            return Ok(true);
        };
        let (handle, flags, kind, len) = (*handle, *flags, *kind, *len);
        let p = self.parts.get(&handle).ok_or("a chunk's part vanished")?;
        // OFFSET_DATA: 8 bytes of offset, then data copied as it comes; everything else is
        // small metadata gathered first.
        let meta_len = if kind == REPLY_TYPE_OFFSET_DATA {
            8.min(len)
        } else {
            len.min(4096)
        };
        if meta.len() < meta_len {
            let n = (meta_len - meta.len()).min(avail_len);
            meta.extend_from_slice(&self.rx[self.rx_start..self.rx_start + n]);
            self.rx_start += n;
            *got += n;
            if meta.len() < meta_len {
                return Ok(false);
            }
        }
        let rel = |m: &[u8]| -> Result<usize, String> {
            let o = m
                .get(..8)
                .and_then(|b| b.try_into().ok())
                .map(u64::from_be_bytes)
                .ok_or("a short chunk")?;
            o.checked_sub(p.offset)
                .map(|r| r as usize)
                .ok_or_else(|| "a chunk before its request".to_string())
        };
        if kind == REPLY_TYPE_OFFSET_DATA {
            if p.kind != CMD_READ || len < 8 {
                return Err("data for a request that is not a read".into());
            }
            let start = match *at {
                Some(s) => s,
                None => {
                    let s = rel(meta)?;
                    if s.checked_add(len - 8)
                        .is_none_or(|end| end > p.len as usize)
                    {
                        return Err("a data chunk beyond its request".into());
                    }
                    *at = Some(s);
                    s
                }
            };
            let done = *got - 8;
            let n = (len - *got).min(self.rx_end - self.rx_start);
            // SAFETY: inside the part's destination (checked above).
            unsafe {
                copy_into(
                    &p.dst,
                    start + done,
                    &self.rx[self.rx_start..self.rx_start + n],
                )
            };
            self.rx_start += n;
            *got += n;
            if *got < len {
                return Ok(false);
            }
        } else if *got < len {
            // Skip what is beyond the metadata kept.
            let n = (len - *got).min(self.rx_end - self.rx_start);
            self.rx_start += n;
            *got += n;
            if *got < len {
                return Ok(false);
            }
        }
        let mut result = None;
        match kind {
            REPLY_TYPE_OFFSET_HOLE => {
                if meta.len() < 12 || p.kind != CMD_READ {
                    return Err("a bad hole chunk".into());
                }
                let s = rel(meta)?;
                let n = u32::from_be_bytes(meta[8..12].try_into().unwrap_or([0; 4])) as usize;
                if s.checked_add(n).is_none_or(|end| end > p.len as usize) {
                    return Err("a hole beyond its request".into());
                }
                // SAFETY: inside the part's destination.
                unsafe { zero_into(&p.dst, s, n) };
            }
            REPLY_TYPE_ERROR | REPLY_TYPE_ERROR_OFFSET => {
                let e = meta
                    .get(..4)
                    .map(|b| u32::from_be_bytes(b.try_into().unwrap_or([0; 4])))
                    .unwrap_or(5);
                result = Some(-errno_of(e));
            }
            _ => {}
        }
        self.state = Rx::Header;
        if let Some(r) = result {
            // The first error sticks; the part ends with the chunk marked DONE.
            if let Some(agg) = self
                .parts
                .get(&handle)
                .and_then(|p| self.ops.get_mut(&p.user_data))
            {
                if agg.result >= 0 {
                    agg.result = r;
                }
            }
        }
        if flags & REPLY_FLAG_DONE != 0 {
            self.lost_since = None;
            self.finish_part(handle, 0);
        }
        Ok(true)
    }
}
