//! Writes: the header guard and detect-zeroes, then the image's plan: through the engine
//! (in place, or into fresh clusters, holding what the image lends until completion), or
//! through the format, on one of the image's pools or on this thread; and the raw path's
//! read-modify-write of writes smaller than the file's direct-I/O block.

use std::io;
use std::sync::atomic::Ordering;

use crate::image::{probe_bytes, EngineWrite, FillGate, Offload, WritePlan};
use crate::io::ranges::Holder;
use crate::io::Completion;
use crate::virtio_blk::Range;
use crate::watchdog::Wait;
use crate::zero::DetectZeroes;

use super::failure::{report_offloaded, Failure};
use super::slot::{user_data, OpKind};
use super::submit::{block_span, copy_from_guest, copy_from_guest_prefix};
use super::QueueWorker;

/// What the checks of a write's data found.
enum Checked {
    Refused,
    Zero,
    Data,
}

/// Bytes of a write at offset 0 looked at for a format's magic.
const MAGIC_PROBE_BYTES: usize = 16;

impl QueueWorker {
    pub(super) fn submit_write(&mut self, idx: u16, offset: u64, len: u64) -> io::Result<bool> {
        let lost = crate::guest_memory::lost_pages();
        let checked = self.check_write(idx, offset, len);
        if crate::guest_memory::lost_pages() != lost {
            // Reading the data faulted: it is gone, and zero pages stand in its place.
            self.fail(idx, Failure::GuestMemoryGone);
            return Ok(false);
        }
        match checked {
            Checked::Refused => Ok(false),
            Checked::Zero => self.submit_zero_ranges(idx),
            Checked::Data => self.plan_and_submit_write(idx, offset, len),
        }
    }

    /// The header guard and detect-zeroes (both read the guest's data in place).
    fn check_write(&mut self, idx: u16, offset: u64, len: u64) -> Checked {
        if offset == 0 && self.image.guards_format_header() && self.plants_format_header(idx) {
            self.fail(idx, Failure::PlantedHeader);
            return Checked::Refused;
        }
        if self.dev.params.detect_zeroes != DetectZeroes::Off && self.write_is_zero(idx) {
            // Only whole-request zero writes are converted (partial ones go out as written).
            let unmap = self.dev.params.detect_zeroes == DetectZeroes::Unmap;
            let zs = &self.dev.zero_stats;
            zs.zero_writes.fetch_add(1, Ordering::Relaxed);
            zs.zero_write_bytes.fetch_add(len, Ordering::Relaxed);
            let req = &mut self.slots[usize::from(idx)].req;
            req.ranges.clear();
            req.ranges.push(Range {
                offset_bytes: offset,
                len_bytes: len,
                unmap,
            });
            return Checked::Zero;
        }
        Checked::Data
    }

    fn plan_and_submit_write(&mut self, idx: u16, offset: u64, len: u64) -> io::Result<bool> {
        match self.image.plan_write(offset, len, self.dev.writeback()) {
            Ok(WritePlan::Engine(w)) => self.engine_write(idx, w),
            Ok(WritePlan::Format(offload)) => Ok(self.format_write(idx, offload)),
            Err(e) => {
                self.fail(
                    idx,
                    Failure::Image {
                        what: "write",
                        offset,
                        source: e,
                    },
                );
                Ok(false)
            }
        }
    }

    /// Would this write (at offset 0) start the image with a format's magic?
    fn plants_format_header(&self, idx: u16) -> bool {
        let slot = &self.slots[usize::from(idx)];
        let Some(r) = slot.busy_ref() else {
            return false;
        };
        let n = (slot.req.data_len as usize).min(MAGIC_PROBE_BYTES);
        let mut magic = [0u8; MAGIC_PROBE_BYTES];
        copy_from_guest_prefix(&r.mem, &slot.req.data, &mut magic[..n])
            && probe_bytes(&magic[..n]).is_some()
    }

    /// A write the image planned through the engine.
    fn engine_write(&mut self, idx: u16, w: EngineWrite) -> io::Result<bool> {
        let len = self.slots[usize::from(idx)].req.data_len;
        let block = self.dev.params.align.offset as u64;
        let sub_block = self.dev.direct() && (w.host % block != 0 || len % block != 0);
        if sub_block && w.whole.is_none() {
            // Smaller than the file's direct-I/O block: not through the engine after all.
            if let Some(t) = w.ticket {
                // Whatever the image set aside for it (new clusters) goes back.
                if let Err(e) = self.image.end_write(t, false) {
                    self.fail(
                        idx,
                        Failure::Image {
                            what: "giving back new clusters",
                            offset: w.host,
                            source: e,
                        },
                    );
                    return Ok(false);
                }
            }
            return match self.image.sub_block_fallback() {
                Some(offload) => Ok(self.format_write(idx, offload)),
                None => {
                    self.read_modify_write(idx);
                    Ok(false)
                }
            };
        }
        if let Some(r) = self.slots[usize::from(idx)].busy() {
            r.ticket = w.ticket;
        }
        if self.dev.write_ranges.is_some() {
            let key = self.acquire_range(w.host, w.host + len, Holder::Write);
            if let Some(r) = self.slots[usize::from(idx)].busy() {
                r.range_key = key;
            }
        }
        if w.overwrite {
            if let Some(held) = self.hold_overwrite(w.host, w.host + len) {
                if let Some(r) = self.slots[usize::from(idx)].busy() {
                    r.ticket = Some(held);
                }
            }
        }
        self.push_rw(idx, w.host, w.whole)
    }

    /// [`crate::image::Image::hold_overwrite`], reaping this queue's own operations while
    /// it waits (the fill waited for may be ours).
    fn hold_overwrite(&mut self, start: u64, end: u64) -> Option<crate::image::WriteTicket> {
        let image = self.image.clone();
        let mut waited = false;
        let held = image.hold_overwrite(start, end, || {
            waited = true;
            self.watch().thread_waits(Wait::Fill);
            self.pump();
        });
        if waited {
            self.watch().thread_waits(Wait::Nothing);
        }
        held
    }

    /// [`crate::image::Image::fence_fills`], reaping this queue's own operations while it
    /// waits (the fills in flight may be ours).
    pub(super) fn fence_fills(&mut self) -> Option<FillGate> {
        let image = self.image.clone();
        let mut waited = false;
        let gate = image.fence_fills(|| {
            waited = true;
            self.watch().thread_waits(Wait::Fill);
            self.pump();
        });
        if waited {
            self.watch().thread_waits(Wait::Nothing);
        }
        gate
    }

    /// A write through the format: on the image's pool for `offload` (the guest data is
    /// copied here, the result comes back through the inbox), else on this thread. Returns
    /// whether the request now waits for the pool (false: it is finished, status set).
    fn format_write(&mut self, idx: u16, offload: Offload) -> bool {
        let (offset, len) = {
            let r = &self.slots[usize::from(idx)].req;
            (r.offset_bytes(), r.data_len as usize)
        };
        let durable = !self.dev.writeback();
        if durable {
            self.stats.durable_writes += 1;
        }
        // No fill may be in flight while the format writes: it could land over bytes
        // written in place in the same cluster. The gate keeps new fills from starting
        // until the write is done.
        let gate = self.fence_fills();
        let (Some(inbox), Some(_)) = (self.inbox.clone(), self.image.pool(offload)) else {
            self.format_write_inline(idx, offset, len, durable);
            drop(gate);
            return false;
        };
        let mut data = vec![0u8; len];
        if let Err(e) = self.copy_request_data(idx, &mut data) {
            self.fail(
                idx,
                Failure::Io {
                    what: "reading the write from guest memory",
                    source: e,
                },
            );
            return false;
        }
        let image = self.image.clone();
        let ud = user_data(idx, OpKind::Offload, 0);
        let queue = self.index;
        let job: crate::offload::Job = Box::new(move || {
            let result = match image.write_through_format(offset, &data, durable) {
                Ok(()) => 0,
                Err(e) => {
                    report_offloaded(
                        queue,
                        &Failure::Image {
                            what: "write",
                            offset,
                            source: e,
                        },
                    );
                    -libc::EIO
                }
            };
            drop(gate);
            inbox.post(Completion {
                user_data: ud,
                result,
            });
        });
        let submitted = self
            .image
            .pool(offload)
            .is_some_and(|pool| pool.submit(job).is_ok());
        if !submitted {
            // Every pool thread is gone (the job and its gate were dropped): here, then.
            let _gate = self.fence_fills();
            self.format_write_inline(idx, offset, len, durable);
            return false;
        }
        if let Some(r) = self.slots[usize::from(idx)].busy() {
            r.pending = 1;
        }
        self.offloaded += 1;
        self.watch().wait(idx, Wait::Pool);
        true
    }

    /// A write through the format on this thread, synchronously.
    fn format_write_inline(&mut self, idx: u16, offset: u64, len: usize, durable: bool) {
        let mut buf = match self.bounce.get(len) {
            Ok(b) => b,
            Err(e) => {
                self.fail(
                    idx,
                    Failure::Io {
                        what: "a buffer for the write",
                        source: e,
                    },
                );
                return;
            }
        };
        let r = self
            .copy_request_data(idx, &mut buf.as_mut_slice()[..len])
            .map_err(|source| Failure::Io {
                what: "reading the write from guest memory",
                source,
            })
            .and_then(|()| {
                self.image
                    .write_through_format(offset, &buf.as_slice()[..len], durable)
                    .map_err(|source| Failure::Image {
                        what: "write",
                        offset,
                        source,
                    })
            });
        self.bounce.put(buf);
        if let Err(f) = r {
            self.fail(idx, f);
        }
    }

    /// The request's guest data, gathered into `dst` (its exact length).
    fn copy_request_data(&self, idx: u16, dst: &mut [u8]) -> io::Result<()> {
        let slot = &self.slots[usize::from(idx)];
        let r = slot
            .busy_ref()
            .ok_or_else(|| io::Error::from(io::ErrorKind::InvalidInput))?;
        copy_from_guest(&r.mem, &slot.req.data, dst)
    }

    /// Take a write range, waiting for conflicting holders. While waiting, this queue's own
    /// operations are submitted and reaped, so it never waits on itself.
    pub(super) fn acquire_range(&mut self, start: u64, end: u64, holder: Holder) -> Option<u64> {
        let dev = self.dev.clone();
        let ranges = dev.write_ranges.as_ref()?;
        loop {
            if let Some(k) = ranges.try_acquire(start, end, holder) {
                self.watch().thread_waits(Wait::Nothing);
                return Some(k);
            }
            self.watch().thread_waits(Wait::Range);
            self.pump();
            ranges.wait_change();
        }
    }

    /// A raw write smaller than the file's direct-I/O block: read the surrounding blocks,
    /// patch in the guest data, write the blocks back, with no other write to them
    /// meanwhile. Synchronous on this queue's thread: it is the rare, misconfigured-geometry
    /// path.
    fn read_modify_write(&mut self, idx: u16) {
        self.stats.read_modify_writes += 1;
        let block = self.dev.params.align.offset as u64;
        let (offset, len) = {
            let r = &self.slots[usize::from(idx)].req;
            (r.offset_bytes(), r.data_len)
        };
        let (start, end) = block_span(offset, len, block);
        if self.image.host_limit().is_some_and(|limit| end > limit) {
            self.fail(
                idx,
                Failure::PastEnd {
                    what: "write",
                    offset,
                    len,
                },
            );
            return;
        }
        let key = self.acquire_range(start, end, Holder::Rmw);
        let mut data = vec![0u8; len as usize];
        let durable = !self.dev.writeback();
        let r = self
            .copy_request_data(idx, &mut data)
            .and_then(|()| self.image.write_sub_block(offset, &data, block, durable));
        if let (Some(k), Some(ranges)) = (key, self.dev.write_ranges.as_ref()) {
            ranges.release(k);
        }
        if let Err(e) = r {
            self.fail(
                idx,
                Failure::Io {
                    what: "read-modify-write",
                    source: e,
                },
            );
        }
    }
}
