//! Starting a request: parse the chain, dispatch by type, and push the engine operations
//! of a read or write (zero-copy iovecs into guest memory, bounced where O_DIRECT needs it).

use std::io;
use std::sync::Arc;

use vm_memory::{Bytes, GuestMemoryBackend};

use crate::io::align::iovecs_aligned;
use crate::io::Op;
use crate::virtio_blk::{parse_request, status, Desc, RequestType, Segment};
use crate::watchdog::Wait;

use super::failure::Failure;
use super::slot::{user_data, Bounce, InFlight, OpKind, Req, SlotId, SlotState};
use super::{Mem, QueueWorker};

impl QueueWorker {
    /// Parse and submit one chain. Returns Some(used_len) when it completed immediately.
    pub(super) fn start_request(
        &mut self,
        head: u16,
        descs: impl Iterator<Item = Desc>,
        mem: &Arc<Mem>,
    ) -> Option<u32> {
        self.stats.requests += 1;
        let id = self.slots.take()?;
        let slot = self.slots.get(id);
        slot.iov.clear();
        if let Err(e) = parse_request(&**mem, descs, &self.dev.limits(), &mut slot.req) {
            self.stats.errors += 1;
            // A chain cut short (too long, outside guest memory) has no status byte known:
            // nothing is written for it (not the previous request's status address).
            let used = if e.status_known() {
                let _ = mem.write_obj(e.status(), slot.req.status_addr);
                1
            } else {
                0
            };
            self.report_guest(head, &e);
            self.slots.release(id);
            if let Some(c) = self.dev.queue_stats.get(usize::from(self.index)) {
                c.record_refused(e.status());
            }
            return Some(used);
        }
        let now = std::time::Instant::now();
        slot.state = SlotState::Busy(InFlight::new(head, mem.clone(), now));
        let (req, sector) = (Req::new(id, head, &slot.req), slot.req.sector);
        self.watch().start(
            id.get(),
            crate::stats::op_index(req.kind),
            sector,
            crate::watchdog::at_us(now),
        );
        if !self.image.is_active() && req.kind != RequestType::GetId {
            // The image could not be taken over (a migration destination whose source did
            // not let go): the guest gets an error, not a hang.
            self.fail(
                id,
                Failure::Image {
                    what: "serving the request",
                    offset: req.offset,
                    source: crate::image::ImageError::Inactive,
                },
            );
            return self.finish(id);
        }
        self.count_in_flight();
        if self.must_wait_for_throttle(req) {
            self.watch().wait(id.get(), Wait::Throttle);
            self.throttled.push_back(req);
            return None;
        }
        self.launch(req)
    }

    /// Submit a parsed request's operations; Some(used length) when it finished at once.
    pub(super) fn launch(&mut self, req: Req) -> Option<u32> {
        if let Some(wt) = self.dev.write_through.get() {
            self.register_through(&wt, req.id);
        }
        if self.dev.backups.any() && self.copy_before_write(req) {
            // On the backup pool; `copied` submits it when the copy is done.
            return None;
        }
        self.submit_launched(req)
    }

    /// Register a request that changes the disk with the active job's write-through
    /// (`jobs::active`).
    #[cold]
    #[inline(never)]
    fn register_through(&mut self, wt: &Arc<crate::jobs::active::WriteThrough>, id: SlotId) {
        let slot = self.slots.get(id);
        let ranges: Vec<(u64, u64)> = match slot.req.kind {
            RequestType::Out => vec![(slot.req.offset_bytes(), slot.req.data_len)],
            RequestType::WriteZeroes | RequestType::Discard => slot
                .req
                .ranges
                .iter()
                .map(|z| (z.offset_bytes, z.len_bytes))
                .collect(),
            _ => return,
        };
        let (lo, hi) = ranges.iter().fold((u64::MAX, 0), |(lo, hi), &(o, l)| {
            (lo.min(o), hi.max(o + l))
        });
        if lo >= hi {
            return;
        }
        let token = wt.begin(lo, hi - lo);
        if let SlotState::Busy(r) = &mut slot.state {
            r.through = Some((wt.clone(), token, lo));
        }
    }

    /// A request whose copy before write (see `launch`) is done: submit it now. Some((head,
    /// used length)) when it finished at once.
    #[cold]
    #[inline(never)]
    pub(super) fn copied(&mut self, id: SlotId) -> Option<(u16, u32)> {
        let slot = self.slots.get(id);
        let r = slot.busy()?;
        r.pending = 0;
        let head = r.head;
        let req = Req::new(id, head, &slot.req);
        self.submit_launched(req).map(|used| (head, used))
    }

    /// Submit a parsed request's operations (its copies before write done).
    fn submit_launched(&mut self, req: Req) -> Option<u32> {
        let id = req.id;
        match self.submit_request(req) {
            Ok(true) => {
                // On the engine, unless a pool thread has it.
                if self.watch().waits_for(id.get()) != Wait::Pool {
                    self.watch().wait(id.get(), Wait::Engine);
                }
                None
            }
            // Nothing to submit (or failed before any operation): complete now.
            Ok(false) => self.finish(id),
            Err(e) => {
                self.fail(
                    id,
                    Failure::Io {
                        what: "submitting the request",
                        source: e,
                    },
                );
                let pending = self.slots.busy(id).map_or(0, |r| r.pending);
                if pending == 0 {
                    self.finish(id)
                } else {
                    None
                }
            }
        }
    }

    /// A running backup's view keeps what this request is about to change (see `backup`):
    /// where a range still has granules to copy, the copy goes to the backup pool and the
    /// request waits for it (true). Without an inbox for the pool to report to, the copy is
    /// done here, synchronously.
    #[cold]
    #[inline(never)]
    fn copy_before_write(&mut self, req: Req) -> bool {
        let ranges: Vec<(u64, u64)> = match req.kind {
            RequestType::Out => vec![(req.offset, req.len)],
            RequestType::WriteZeroes => self.ranges_of(req.id),
            RequestType::Discard if self.dev.params.discard_unmap => self.ranges_of(req.id),
            _ => return false,
        };
        let backups = self.dev.backups.clone();
        if !ranges.iter().any(|&(o, l)| backups.needs_copy(o, l)) {
            return false;
        }
        if self.inbox.is_none() {
            // Only an eventfd can wake the queue (an NBD engine's event fd is an epoll set:
            // its copies are done here).
            self.inbox = self
                .engine
                .wake_fd()
                .and_then(|fd| crate::offload::Inbox::new(fd).ok());
        }
        let Some(inbox) = self.inbox.clone() else {
            for (o, l) in ranges {
                backups.before_write(o, l);
            }
            return false;
        };
        let ud = user_data(req.id, OpKind::Copied, 0);
        let job: crate::offload::Job = Box::new(move || {
            for (o, l) in ranges {
                backups.before_write(o, l);
            }
            inbox.post(crate::io::Completion {
                user_data: ud,
                result: 0,
            });
        });
        if let Err(job) = self.dev.backups.submit(job) {
            // No pool thread left: here, then (the job posts its completion).
            job();
        }
        if let Some(r) = self.slots.busy(req.id) {
            r.pending = 1;
        }
        self.offloaded += 1;
        self.watch().wait(req.id.get(), Wait::Pool);
        true
    }

    fn ranges_of(&mut self, id: SlotId) -> Vec<(u64, u64)> {
        self.slots
            .get(id)
            .req
            .ranges
            .iter()
            .map(|r| (r.offset_bytes, r.len_bytes))
            .collect()
    }

    /// Push the request's operations. Ok(false) when there is nothing to wait for.
    fn submit_request(&mut self, req: Req) -> io::Result<bool> {
        match req.kind {
            RequestType::In | RequestType::Out => self.submit_rw(req),
            RequestType::Flush => self.submit_flush(req.id),
            RequestType::GetId => {
                self.get_id(req.id);
                Ok(false)
            }
            RequestType::Discard | RequestType::WriteZeroes => self.submit_zero_ranges(req),
        }
    }

    /// FLUSH: format metadata written back (in dependency order), then one fdatasync
    /// through the engine makes it and every completed write durable.
    fn submit_flush(&mut self, id: SlotId) -> io::Result<bool> {
        self.stats.flushes += 1;
        if !self.dev.writeback() {
            // Write-through: every completed write is already durable.
            return Ok(false);
        }
        if let Err(e) = self.image.write_back() {
            self.fail(
                id,
                Failure::Image {
                    what: "metadata write-back for FLUSH",
                    offset: 0,
                    source: e,
                },
            );
            return Ok(false);
        }
        self.push_sync(id)?;
        Ok(true)
    }

    /// One fdatasync of the image file for the request in slot `id`.
    pub(super) fn push_sync(&mut self, id: SlotId) -> io::Result<()> {
        // SAFETY: no buffers.
        unsafe {
            self.engine
                .push(0, &Op::Fdatasync, user_data(id, OpKind::Flush, 0))?
        };
        if let Some(r) = self.slots.busy(id) {
            r.pending += 1;
        }
        Ok(())
    }

    /// GET_ID: the serial, into the guest's buffers, as far as they reach.
    fn get_id(&mut self, id: SlotId) {
        let serial = self.dev.id_bytes();
        let slot = self.slots.get(id);
        let Some(r) = slot.busy_ref() else {
            return;
        };
        let mem = r.mem.clone();
        let mut done = 0usize;
        let mut ok = true;
        for seg in &slot.req.data {
            if done == serial.len() {
                break;
            }
            let n = (seg.len as usize).min(serial.len() - done);
            if mem.write_slice(&serial[done..done + n], seg.addr).is_err() {
                ok = false;
                break;
            }
            done += n;
        }
        if let Some(r) = slot.busy() {
            r.used_len = done as u32 + 1;
            if !ok {
                r.status = status::IOERR;
            }
        }
    }

    /// Read or write: planned by the image, then through the engine (or the format).
    fn submit_rw(&mut self, req: Req) -> io::Result<bool> {
        let is_read = req.kind == RequestType::In;
        let len = req.len;
        if let Some(r) = self.slots.busy(req.id) {
            r.used_len = if is_read { len as u32 + 1 } else { 1 };
            r.expect_bytes = len;
        }
        if len == 0 {
            return Ok(false);
        }
        if is_read {
            match self.plan_read(req) {
                Ok(host) => self.push_rw(req, host, None),
                Err(done) => done,
            }
        } else {
            self.submit_write(req)
        }
    }

    /// Push the single read or write of the request at `file_offset` of the image file:
    /// zero-copy iovecs into guest memory; `whole` (start, length): write that whole range
    /// instead (new clusters, zeroes around the data); bounced through an aligned buffer
    /// where O_DIRECT needs it (sub-block reads read the whole blocks around the data).
    pub(super) fn push_rw(
        &mut self,
        req: Req,
        file_offset: u64,
        whole: Option<(u64, u64)>,
    ) -> io::Result<bool> {
        let direct = self.dev.direct();
        let align = self.dev.params.align;
        let writeback = self.dev.writeback();
        let host_limit = self.image.host_limit();
        let block = align.offset as u64;
        let is_read = req.kind == RequestType::In;
        let len = req.len;
        let slot = self.slots.get(req.id);
        let SlotState::Busy(r) = &mut slot.state else {
            return Ok(false);
        };
        let mem = r.mem.clone();
        for seg in &slot.req.data {
            for vs in mem.get_slices(seg.addr, seg.len as usize) {
                let vs = vs.map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
                slot.iov.push(libc::iovec {
                    iov_base: vs.ptr_guard_mut().as_ptr().cast(),
                    iov_len: vs.len(),
                });
            }
        }
        let sub_block =
            direct && (!file_offset.is_multiple_of(block) || !len.is_multiple_of(block));
        let mut io_offset = file_offset;
        // An encrypted image: reads are decrypted when they are in; writes go out of a
        // bounce buffer, encrypted there (guest memory is never changed by a write).
        let cipher = self.image.cipher();
        if cipher.is_some() && is_read {
            r.decrypt_at = Some(file_offset);
        }
        if let Some((start, span)) = whole {
            let span = span as usize;
            let mut buf = self.bounce.get(span)?;
            let at = (file_offset - start) as usize;
            buf.as_mut_slice()[..at].fill(0);
            buf.as_mut_slice()[at + len as usize..span].fill(0);
            copy_from_guest(
                &mem,
                &slot.req.data,
                &mut buf.as_mut_slice()[at..at + len as usize],
            )?;
            if let Some(v) = cipher {
                // New clusters of an encrypted image: the zeroes around the data too.
                v.encrypt(&mut buf.as_mut_slice()[..span], start);
            }
            slot.iov.clear();
            slot.iov.push(libc::iovec {
                iov_base: buf.as_mut_ptr().cast(),
                iov_len: span,
            });
            r.bounce = Some(Bounce { buf, skip: at });
            r.expect_bytes = span as u64;
            io_offset = start;
        } else if direct && (sub_block || !iovecs_aligned(&slot.iov, file_offset, align)) {
            self.stats.bounced += 1;
            // Sub-block reads read the whole file blocks around the request.
            let (start, end) = block_span(file_offset, len, block);
            if host_limit.is_some_and(|limit| end > limit) {
                slot.iov.clear();
                let what = if is_read { "read" } else { "write" };
                self.fail(
                    req.id,
                    Failure::PastEnd {
                        what,
                        offset: file_offset,
                        len,
                    },
                );
                return Ok(false);
            }
            let span = (end - start) as usize;
            let mut buf = self.bounce.get(span)?;
            if !is_read {
                copy_from_guest(&mem, &slot.req.data, &mut buf.as_mut_slice()[..span])?;
                if let Some(v) = cipher {
                    // Writes get here whole (sub-block ones are read-modify-written).
                    v.encrypt(&mut buf.as_mut_slice()[..span], start);
                }
            }
            slot.iov.clear();
            slot.iov.push(libc::iovec {
                iov_base: buf.as_mut_ptr().cast(),
                iov_len: span,
            });
            r.bounce = Some(Bounce {
                buf,
                skip: (file_offset - start) as usize,
            });
            r.expect_bytes = span as u64;
            io_offset = start;
        } else if cipher.is_some() && !is_read {
            // Encrypted into a bounce buffer, part by part (`worker::crypt`).
            return self.push_encrypted_write(req, file_offset);
        }
        if !is_read && !writeback {
            self.stats.durable_writes += 1;
        }
        let (op, kind) = if is_read {
            let op = Op::Readv {
                iov: slot.iov.as_ptr(),
                iovcnt: slot.iov.len() as u32,
                offset: io_offset,
            };
            (op, OpKind::Read)
        } else {
            let op = Op::Writev {
                iov: slot.iov.as_ptr(),
                iovcnt: slot.iov.len() as u32,
                offset: io_offset,
                dsync: !writeback,
            };
            (op, OpKind::Write)
        };
        // SAFETY: the iovecs point into guest memory kept mapped by the request's memory
        // snapshot or into its bounce buffer; the slot is not reused until this completion
        // is reaped.
        unsafe { self.engine.push(0, &op, user_data(req.id, kind, 0))? };
        r.pending = 1;
        Ok(true)
    }
}

/// The file blocks of `block` bytes that cover [offset, offset + len).
pub(super) fn block_span(offset: u64, len: u64, block: u64) -> (u64, u64) {
    let start = offset / block * block;
    let end = (offset + len).div_ceil(block) * block;
    (start, end)
}

/// The first `dst.len()` bytes of the segments (false if they are shorter).
pub(super) fn copy_from_guest_prefix(mem: &Mem, segs: &[Segment], dst: &mut [u8]) -> bool {
    let mut done = 0;
    for seg in segs {
        if done == dst.len() {
            break;
        }
        let n = (seg.len as usize).min(dst.len() - done);
        if mem.read_slice(&mut dst[done..done + n], seg.addr).is_err() {
            return false;
        }
        done += n;
    }
    done == dst.len()
}

/// Gather the request's guest segments into `dst` (exactly their total length). Fails if
/// guest memory went away meanwhile (the copy then read zero pages, not the guest's data).
pub(super) fn copy_from_guest(mem: &Mem, segs: &[Segment], dst: &mut [u8]) -> io::Result<()> {
    let lost = crate::guest_memory::lost_pages();
    let mut done = 0usize;
    for seg in segs {
        let n = seg.len as usize;
        let part = dst
            .get_mut(done..done + n)
            .ok_or_else(|| io::Error::from(io::ErrorKind::InvalidInput))?;
        mem.read_slice(part, seg.addr)
            .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        done += n;
    }
    if crate::guest_memory::lost_pages() != lost {
        return Err(io::Error::other("guest memory went away during the copy"));
    }
    Ok(())
}
