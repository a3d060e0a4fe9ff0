//! Encrypted writes: the guest's data is gathered and encrypted into a bounce buffer (guest
//! memory is never changed by a write) and written part by part, each part as soon as it
//! is encrypted, so the disk writes one part while the next is encrypted.
//!
//! A large write's parts are dealt out between the queue thread and the crypt helpers: a
//! helper encrypts its parts and posts each through the queue's inbox
//! ([`OpKind::Encrypted`]), the queue thread encrypts and writes its own, writes the helpers'
//! when they come back, and goes on with the next request without waiting for them. Each
//! write's encryption is shared (its latency halved with one helper), and nobody spins:
//! the synchronous split used before had the queue thread wait for the helper's half, and
//! handing whole writes to the helper left each write's latency whole.

use std::io;
use std::sync::Arc;

use crate::crypt::pool::SPLIT_MIN;
use crate::guest_memory::lost_pages;
use crate::image::Image;
use crate::io::{Completion, Op};
use crate::offload::Inbox;
use crate::watchdog::Wait;

use super::slot::{decode, user_data, Bounce, OpKind, Req, SlotId, SlotState};
use super::QueueWorker;

impl QueueWorker {
    /// Encrypt and write the request whose guest iovecs are in its slot, at `file_offset`
    /// of the image file. True when operations are in flight.
    pub(super) fn push_encrypted_write(&mut self, req: Req, file_offset: u64) -> io::Result<bool> {
        let block = self.dev.params.align.offset;
        let writeback = self.dev.writeback();
        let n = req.len as usize;
        let slot = self.slots.get(req.id);
        let SlotState::Busy(r) = &mut slot.state else {
            return Ok(false);
        };
        if slot.iov.iter().map(|v| v.iov_len).sum::<usize>() != n {
            return Err(io::Error::from(io::ErrorKind::InvalidInput));
        }
        let image = self.image.clone();
        let Some(v) = image.cipher() else {
            return Err(io::Error::from(io::ErrorKind::InvalidInput));
        };
        let mut buf = self.bounce.get(n)?;
        let part = write_part_len(n, block);
        let parts = n.div_ceil(part);
        let guest = GuestIovecs(std::mem::take(&mut slot.iov));
        self.stats.bounced += 1;
        if !writeback {
            self.stats.durable_writes += 1;
        }
        let base = buf.as_mut_ptr() as usize;
        r.bounce = Some(Bounce { buf, skip: 0 });
        r.write_at = file_offset;
        for i in 0..parts {
            let (a, b) = (i * part, ((i + 1) * part).min(n));
            slot.iov.push(libc::iovec {
                iov_base: (base + a) as *mut libc::c_void,
                iov_len: b - a,
            });
        }
        // The parts are dealt out: with h helpers (and an inbox for them to report to), part
        // i goes to helper i mod (h + 1) (0: this thread). Nobody waits for anybody: this
        // thread writes its own parts as it encrypts them, and the helpers' as they come
        // back, here or in the ordinary completion path.
        let guest = Arc::new(guest);
        let share = match &self.inbox {
            Some(_) if n >= SPLIT_MIN => v.threads().min(parts - 1),
            _ => 0,
        };
        if let (true, Some(inbox)) = (share > 0, &self.inbox) {
            for k in 1..=share {
                let task = EncryptTask {
                    image: image.clone(),
                    guest: guest.clone(),
                    base,
                    n,
                    part,
                    first: k,
                    step: share + 1,
                    at: file_offset,
                    inbox: inbox.clone(),
                    id: req.id,
                };
                let theirs = (k..parts).step_by(share + 1).count();
                r.pending += theirs as u32;
                self.offloaded += theirs;
                // The pool is gone only while the process ends: then here (the parts reach
                // the inbox all the same).
                if let Err(task) = v.spawn(Box::new(move || task.run())) {
                    task();
                }
            }
        }
        if share > 0 {
            // Until its last part is written (`encrypted`).
            self.watch().wait(req.id.get(), Wait::Pool);
        }
        // Helpers never split a part with this thread: it would wait (spinning) for them.
        let alone = share > 0;
        let lost = lost_pages();
        for i in (0..parts).step_by(share + 1) {
            let (a, b) = (i * part, ((i + 1) * part).min(n));
            // SAFETY: [a, b) is inside the request's bounce buffer (n bytes), which the slot
            // keeps until its completions are reaped; the guest iovecs point into memory the
            // request's snapshot keeps mapped (a page the frontend takes away reads as
            // zeroes: checked below).
            unsafe {
                let dst = std::slice::from_raw_parts_mut((base + a) as *mut u8, b - a);
                v.encrypt_gather_at(&guest.0, a, dst, file_offset + a as u64, alone);
            }
            if lost_pages() != lost {
                // Parts already pushed finish on their own; the request fails.
                if let Some(r) = self.slots.busy(req.id) {
                    r.status = crate::virtio_blk::status::IOERR;
                }
                break;
            }
            self.push_write_part(req.id, i)?;
            if let Some(r) = self.slots.busy(req.id) {
                r.pending += 1;
            }
            // Parts the helpers encrypted meanwhile go out too: this thread's own
            // encryption must not hold back the disk's work on them.
            self.push_helper_parts();
            self.engine.submit()?;
        }
        Ok(self.slots.busy(req.id).is_some_and(|r| r.pending > 0))
    }

    /// Push the writes of the parts helpers have encrypted and posted (failed ones are left
    /// for the ordinary completion path).
    fn push_helper_parts(&mut self) {
        let Some(inbox) = self.inbox.clone() else {
            return;
        };
        let mut ready = std::mem::take(&mut self.helper_parts);
        inbox.take_where(&mut ready, |c| {
            c.result >= 0 && decode(c.user_data).1 == Some(OpKind::Encrypted)
        });
        for c in ready.drain(..) {
            let (id, _, i) = decode(c.user_data);
            if self.encrypted(id, i as usize, 0).is_err() {
                // Its write could not be pushed: it fails the ordinary way.
                self.offloaded += 1;
                inbox.post(Completion {
                    user_data: c.user_data,
                    result: -libc::EIO,
                });
            }
        }
        self.helper_parts = ready;
    }

    /// Part `i` of an encrypted write (its iovec `i`, from the bounce buffer) to the engine.
    fn push_write_part(&mut self, id: SlotId, i: usize) -> io::Result<()> {
        let dsync = !self.dev.writeback();
        let slot = self.slots.get(id);
        let SlotState::Busy(r) = &slot.state else {
            return Err(io::Error::from(io::ErrorKind::NotFound));
        };
        let (Some(first), Some(iov)) = (slot.iov.first(), slot.iov.get(i)) else {
            return Err(io::Error::from(io::ErrorKind::InvalidInput));
        };
        let op = Op::Writev {
            iov,
            iovcnt: 1,
            offset: r.write_at + (iov.iov_base as u64 - first.iov_base as u64),
            dsync,
        };
        // SAFETY: the iovec points into the request's bounce buffer, which the slot keeps
        // (and slot.iov does not change) until every part's completion is reaped.
        unsafe {
            self.engine
                .push(0, &op, user_data(id, OpKind::WritePart, i as u32))
        }
    }

    /// A helper encrypted part `i` of a write (`result` 0) or could not (negative): write
    /// it now. Err(errno) when the operation fails instead (it counts as done).
    pub(super) fn encrypted(&mut self, id: SlotId, i: usize, result: i32) -> Result<(), i32> {
        self.offloaded = self.offloaded.saturating_sub(1);
        if result < 0 {
            return Err(result);
        }
        if let Err(e) = self.push_write_part(id, i) {
            return Err(-e.raw_os_error().unwrap_or(libc::EIO));
        }
        if self.slots.get(id).iov.len() == i + 1 {
            self.watch().wait(id.get(), Wait::Engine);
        }
        Ok(())
    }
}

/// The part length of an encrypted write of `n` bytes: four parts of at least 64 KiB (a
/// multiple of the direct-I/O block), or one part for a small write.
fn write_part_len(n: usize, block: usize) -> usize {
    const MIN: usize = 64 << 10;
    if n < 2 * MIN {
        return n;
    }
    let block = block.max(4096);
    (n / 4).max(MIN).next_multiple_of(block)
}

/// A request's guest iovecs, moved to a helper thread.
struct GuestIovecs(Vec<libc::iovec>);

// SAFETY: the iovecs point into guest memory the request's memory snapshot keeps mapped
// until the request is finished, which waits for every part the tasks post; the memory is
// only read (by the queue thread and the helpers, each its own parts).
unsafe impl Send for GuestIovecs {}
// SAFETY: as above.
unsafe impl Sync for GuestIovecs {}

/// A crypt helper's share of a write: parts `first`, `first + step`, ...
struct EncryptTask {
    image: Arc<Image>,
    guest: Arc<GuestIovecs>,
    /// The bounce buffer (`n` bytes), owned by the request's slot.
    base: usize,
    n: usize,
    part: usize,
    first: usize,
    step: usize,
    at: u64,
    inbox: Arc<Inbox>,
    id: SlotId,
}

impl EncryptTask {
    /// Encrypt its parts one after the other, posting each (after a failure the rest fail
    /// too).
    fn run(self) {
        let lost = lost_pages();
        let mut ok = true;
        for i in (self.first..self.n.div_ceil(self.part)).step_by(self.step) {
            let (a, b) = (i * self.part, ((i + 1) * self.part).min(self.n));
            if let (true, Some(v)) = (ok, self.image.cipher()) {
                // SAFETY: [a, b) is this part of the bounce buffer, which the request's
                // slot keeps until every part is posted and written; nothing else touches
                // it meanwhile. The guest iovecs: see `GuestIovecs`.
                unsafe {
                    let dst = std::slice::from_raw_parts_mut((self.base + a) as *mut u8, b - a);
                    v.encrypt_gather_at(&self.guest.0, a, dst, self.at + a as u64, true);
                }
                ok = lost_pages() == lost;
            } else {
                ok = false;
            }
            self.inbox.post(Completion {
                user_data: user_data(self.id, OpKind::Encrypted, i as u32),
                result: if ok { 0 } else { -libc::EIO },
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::write_part_len;

    #[test]
    fn parts_are_whole_blocks() {
        assert_eq!(write_part_len(4096, 512), 4096);
        assert_eq!(write_part_len(1 << 20, 512), 256 << 10);
        assert_eq!(write_part_len(192 << 10, 4096), 64 << 10);
        assert_eq!(write_part_len(130 << 10, 4096), 64 << 10);
    }
}
