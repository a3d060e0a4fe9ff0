//! Completing requests: account each finished engine or pool operation, apply the fallbacks
//! a result calls for (short reads at the end of a format's file, zeroing where the file
//! system lacks ZERO_RANGE), and when a request's last operation is done write its status
//! byte and give back everything it held.

use std::io;
use std::sync::atomic::Ordering;

use vm_memory::Bytes;

use crate::io::Completion;
use crate::log_limited;
use crate::virtio_blk::{status, RequestType};

use super::failure::Failure;
use super::slot::{decode, OpKind, SlotId, SlotState, Then};
use super::QueueWorker;

impl QueueWorker {
    /// Account one finished operation; Some((head, used_len)) when its request is done.
    pub(super) fn complete_op(&mut self, mut c: Completion) -> Option<(u16, u32)> {
        let (id, kind, range) = decode(c.user_data);
        if kind == Some(OpKind::Encrypted) {
            // A helper's part of an encrypted write: it replaces itself by the part's write
            // (or, failed, counts as a failed operation below).
            match self.encrypted(id, range as usize, c.result) {
                Ok(()) => return None,
                Err(e) => c.result = e,
            }
        }
        if kind == Some(OpKind::Offload) {
            self.offloaded = self.offloaded.saturating_sub(1);
        }
        if kind == Some(OpKind::Copied) {
            self.offloaded = self.offloaded.saturating_sub(1);
            return self.copied(id);
        }
        let short_reads_are_zeroes = self.image.short_reads_are_zeroes();
        let slot = self.slots.get_mut(id)?;
        let SlotState::Busy(r) = &mut slot.state else {
            log_limited!(
                log::Level::Error,
                "queue {}: completion for idle slot {id}",
                self.index
            );
            return None;
        };
        if r.pending == 0 {
            log_limited!(
                log::Level::Error,
                "queue {}: completion for idle slot {id}",
                self.index
            );
            return None;
        }
        let mut res = c.result;
        if short_reads_are_zeroes && matches!(kind, Some(OpKind::Read) | Some(OpKind::ReadPart)) {
            // A format's file may end inside its last cluster (the rest of it was never
            // written): a short read there is the end of the file, and the rest reads as
            // zeroes.
            let iovs = if kind == Some(OpKind::Read) {
                &slot.iov[..]
            } else {
                slot.iov
                    .get(range as usize..range as usize + 1)
                    .unwrap_or(&[])
            };
            let want: usize = iovs.iter().map(|v| v.iov_len).sum();
            if res >= 0 && (res as usize) < want {
                let mut skip = res as usize;
                for v in iovs {
                    if skip >= v.iov_len {
                        skip -= v.iov_len;
                        continue;
                    }
                    // SAFETY: the iovec points into guest memory or a bounce buffer that the
                    // request keeps alive, and the kernel is done with it (this is its
                    // completion).
                    unsafe {
                        std::ptr::write_bytes(
                            v.iov_base.cast::<u8>().add(skip),
                            0,
                            v.iov_len - skip,
                        )
                    };
                    skip = 0;
                }
                res = want as i32;
            }
        }
        let mut failure = None;
        match kind {
            Some(OpKind::ReadPart) | Some(OpKind::WritePart)
                if res >= 0
                    && slot.iov.get(range as usize).map(|v| v.iov_len as u64)
                        != Some(res as u64) =>
            {
                failure = Some(format!("short {kind:?}: {res} bytes"));
                res = short_errno(kind);
            }
            Some(OpKind::Read) | Some(OpKind::Write)
                if res >= 0 && res as u64 != r.expect_bytes =>
            {
                failure = Some(format!(
                    "short {kind:?} of {res} bytes, expected {}",
                    r.expect_bytes
                ));
                res = short_errno(kind);
            }
            Some(OpKind::Discard) if res == -libc::EOPNOTSUPP => {
                // Discard is a hint (5.2.6.2: the device may do nothing).
                res = 0;
            }
            Some(OpKind::ZeroRange) | Some(OpKind::PunchZero) if res == -libc::EOPNOTSUPP => {
                if kind == Some(OpKind::ZeroRange) {
                    self.dev.no_zero_range.store(true, Ordering::Relaxed);
                }
                res = match slot.req.ranges.get(range as usize) {
                    Some(z) => self.image.write_zeroes_by_hand(
                        z.offset_bytes,
                        z.len_bytes,
                        &mut self.bounce,
                    ),
                    None => -libc::EIO,
                };
            }
            _ => {}
        }
        let mut failed = None;
        if res < 0 {
            self.stats.errors += 1;
            r.status = status::IOERR;
            r.note_failure(Some(-res));
            failed = Some(Failure::Op {
                kind,
                source: io::Error::from_raw_os_error(-res),
            });
        } else if matches!(kind, Some(OpKind::Discard) | Some(OpKind::PunchZero)) && c.result == 0 {
            if let Some(z) = slot.req.ranges.get(range as usize) {
                self.dev
                    .zero_stats
                    .unmapped_bytes
                    .fetch_add(z.len_bytes, Ordering::Relaxed);
            }
        }
        r.pending -= 1;
        let done = r.pending == 0;
        let head = r.head;
        // Write-through: the zeroing becomes durable before the request completes.
        let sync_first = done && r.then == Then::SyncFirst && r.status == status::OK;
        if sync_first {
            r.then = Then::Finish;
        }
        if failure.is_some() || failed.is_some() {
            // Logged unless the error policy will hold the request (that has its line).
            if !self.would_hold(id, Some(-res)) {
                if let Some(msg) = failure {
                    log_limited!(log::Level::Warn, "queue {}: {msg}", self.index);
                }
                if let Some(f) = failed {
                    self.report(&f);
                }
            }
        }
        if !done {
            return None;
        }
        if sync_first {
            if self.push_sync(id).is_ok() {
                return None;
            }
            if let Some(r) = self.slots.busy(id) {
                r.status = status::IOERR;
            }
        }
        self.finish(id).map(|used| (head, used))
    }

    /// Copy bounced read data out, give back what the image lent, write the status byte,
    /// free the slot. Returns the used length; None when the error policy holds the
    /// request instead (`hold`).
    pub(super) fn finish(&mut self, id: SlotId) -> Option<u32> {
        if self.must_hold(id) {
            self.hold(id);
            return None;
        }
        let slot = self.slots.get(id);
        let SlotState::Busy(mut r) = std::mem::replace(&mut slot.state, SlotState::Free) else {
            return Some(0);
        };
        let is_read = slot.req.kind == RequestType::In;
        // Changed-block tracking: what changes what the guest reads is in every enabled
        // bitmap before the guest sees it complete (failed requests too: more, never less).
        let bitmaps = &self.dev.bitmaps;
        match slot.req.kind {
            RequestType::Out => {
                self.recorder
                    .mark(bitmaps, slot.req.offset_bytes(), slot.req.data_len)
            }
            RequestType::WriteZeroes => {
                for z in &slot.req.ranges {
                    self.recorder.mark(bitmaps, z.offset_bytes, z.len_bytes);
                }
            }
            RequestType::Discard if self.dev.params.discard_unmap => {
                for z in &slot.req.ranges {
                    self.recorder.mark(bitmaps, z.offset_bytes, z.len_bytes);
                }
            }
            _ => {}
        }
        if let Some((wt, token, start)) = r.through.take() {
            through(&wt, token, start, &slot.req, &r);
        }
        if is_read && self.dev.dirty_log.load(Ordering::Acquire) {
            // The kernel (or a piece read) wrote these buffers, not vm-memory: log them for
            // a migrating frontend. (Bounced data is copied below through vm-memory, which
            // logs it itself.)
            for seg in &slot.req.data {
                crate::guest_memory::mark_dirty(&r.mem, seg.addr, seg.len as usize);
            }
        }
        if let (Some(host), true) = (r.decrypt_at, r.status == status::OK) {
            decrypt_read(&self.image, &slot.iov, &mut r, host);
        }
        if !r.decrypt_pieces.is_empty() && r.status == status::OK {
            decrypt_pieces(&self.image, &slot.iov, &mut r);
        }
        if let Some(b) = r.bounce.take() {
            if is_read && r.status == status::OK {
                let mut done = b.skip;
                for seg in &slot.req.data {
                    let n = seg.len as usize;
                    let copied = b
                        .buf
                        .as_slice()
                        .get(done..done + n)
                        .is_some_and(|src| r.mem.write_slice(src, seg.addr).is_ok());
                    if !copied {
                        r.status = status::IOERR;
                        break;
                    }
                    done += n;
                }
            }
            self.bounce.put(b.buf);
        }
        if r.status != status::OK && is_read {
            r.used_len = 1;
        }
        let mut failure = None;
        if let Some(t) = r.ticket.take() {
            // The data is in the file: now new clusters may replace what was there (before
            // the guest sees the write complete).
            if let Err(e) = self.image.end_write(t, r.status == status::OK) {
                r.status = status::IOERR;
                failure = Some(Failure::Image {
                    what: "installing new clusters",
                    offset: 0,
                    source: e,
                });
            }
        }
        let _ = r.mem.write_obj(r.status, slot.req.status_addr);
        if let Some(c) = self.dev.queue_stats.get(usize::from(self.index)) {
            let bytes = match slot.req.kind {
                RequestType::In | RequestType::Out => slot.req.data_len,
                _ => 0,
            };
            c.record(
                slot.req.kind,
                r.status,
                bytes,
                r.started.elapsed().as_micros() as u64,
            );
        }
        if let (Some(k), Some(ranges)) = (r.range_key.take(), self.dev.write_ranges.as_ref()) {
            ranges.release(k);
        }
        slot.iov.clear();
        self.slots.release(id);
        self.watch().end(id.get());
        self.count_in_flight();
        if let Some(f) = failure {
            self.report(&f);
        }
        if r.was_held {
            self.dev.holds.release(1);
        }
        Some(r.used_len)
    }
}

/// The errno of a short transfer: a write's is ENOSPC (the file system took what fitted:
/// QEMU's AIO engines answer the same), a read's EIO.
fn short_errno(kind: Option<OpKind>) -> i32 {
    match kind {
        Some(OpKind::Write) | Some(OpKind::WritePart) => -libc::ENOSPC,
        _ => -libc::EIO,
    }
}

/// The end of a request registered with an active job's write-through: a data write that
/// succeeded is copied through to the job's target (see `jobs::active`).
#[cold]
#[inline(never)]
fn through(
    wt: &crate::jobs::active::WriteThrough,
    token: u64,
    start: u64,
    req: &crate::virtio_blk::Request,
    r: &super::slot::InFlight,
) {
    let mut data = None;
    if req.kind == RequestType::Out && r.status == status::OK {
        let mut buf = vec![0u8; req.data_len as usize];
        let mut at = 0usize;
        let mut ok = true;
        for seg in &req.data {
            let n = seg.len as usize;
            let read = buf
                .get_mut(at..at + n)
                .is_some_and(|dst| r.mem.read_slice(dst, seg.addr).is_ok());
            if !read {
                ok = false;
                break;
            }
            at += n;
        }
        if ok && at == buf.len() {
            data = Some(buf);
        }
    }
    // A data write registered its own range: `start` is its offset.
    wt.end(token, start, data);
}

/// An encrypted image's read in pieces is in (in its bounce buffer): decrypt each piece of
/// the image file at its own offset.
fn decrypt_pieces(image: &crate::image::Image, iov: &[libc::iovec], r: &mut super::slot::InFlight) {
    let Some(v) = image.cipher() else {
        r.status = status::IOERR;
        return;
    };
    for (v_iov, &host) in iov.iter().zip(&r.decrypt_pieces) {
        if host == u64::MAX {
            continue;
        }
        // SAFETY: the iovec points into the request's bounce buffer (`submit_pieces`),
        // which the request still holds, and the kernel is done with it.
        let piece =
            unsafe { std::slice::from_raw_parts_mut(v_iov.iov_base.cast::<u8>(), v_iov.iov_len) };
        v.decrypt(piece, host);
    }
}

/// An encrypted image's read is in: decrypt it where it landed, the bounce buffer or the
/// guest's own buffers (in place, through a small staging buffer).
fn decrypt_read(
    image: &crate::image::Image,
    iov: &[libc::iovec],
    r: &mut super::slot::InFlight,
    host: u64,
) {
    let Some(v) = image.cipher() else {
        r.status = status::IOERR;
        return;
    };
    match &mut r.bounce {
        Some(b) => {
            let n = r.expect_bytes as usize;
            let len = n.saturating_sub(b.skip);
            let s = v.sector_size() as usize;
            match b.buf.as_mut_slice().get_mut(b.skip..b.skip + len / s * s) {
                Some(data) => v.decrypt(data, host),
                None => r.status = status::IOERR,
            }
        }
        // SAFETY: the iovecs point into guest memory the request's memory snapshot keeps
        // mapped, and the kernel is done with them (the read completed).
        None => unsafe { v.decrypt_iovecs(iov, host) },
    }
}
