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

use super::failure::{image_errno, report_offloaded, Failure};
use super::slot::{user_data, OpKind, Req, Slot, SlotId};
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
    pub(super) fn submit_write(&mut self, req: Req) -> io::Result<bool> {
        let lost = crate::guest_memory::lost_pages();
        let checked = self.check_write(req);
        if crate::guest_memory::lost_pages() != lost {
            // Reading the data faulted: it is gone, and zero pages stand in its place.
            self.fail(req.id, Failure::GuestMemoryGone);
            return Ok(false);
        }
        match checked {
            Checked::Refused => Ok(false),
            Checked::Zero => self.submit_zero_ranges(req),
            Checked::Data => self.plan_and_submit_write(req),
        }
    }

    /// The header guard and detect-zeroes (both read the guest's data in place).
    fn check_write(&mut self, req: Req) -> Checked {
        let (offset, len) = (req.offset, req.len);
        let slot = self.slots.get(req.id);
        if offset == 0 && self.image.guards_format_header() && plants_format_header(slot) {
            self.fail(req.id, Failure::PlantedHeader);
            return Checked::Refused;
        }
        // Not on an encrypted image: its zeroes are encrypted zeroes, written like data.
        if self.dev.params.detect_zeroes != DetectZeroes::Off
            && self.image.cipher().is_none()
            && slot.write_is_zero()
        {
            // Only whole-request zero writes are converted (partial ones go out as written).
            let unmap = self.dev.params.detect_zeroes == DetectZeroes::Unmap;
            let zs = &self.dev.zero_stats;
            zs.zero_writes.fetch_add(1, Ordering::Relaxed);
            zs.zero_write_bytes.fetch_add(len, Ordering::Relaxed);
            slot.req.ranges.clear();
            slot.req.ranges.push(Range {
                offset_bytes: offset,
                len_bytes: len,
                unmap,
            });
            return Checked::Zero;
        }
        Checked::Data
    }

    fn plan_and_submit_write(&mut self, req: Req) -> io::Result<bool> {
        match self
            .image
            .plan_write(req.offset, req.len, self.dev.writeback())
        {
            Ok(WritePlan::Engine(w)) => self.engine_write(req, w),
            Ok(WritePlan::Format(offload)) => Ok(self.format_write(req, offload)),
            Err(e) => {
                self.fail(
                    req.id,
                    Failure::Image {
                        what: "write",
                        offset: req.offset,
                        source: e,
                    },
                );
                Ok(false)
            }
        }
    }

    /// A write the image planned through the engine.
    fn engine_write(&mut self, req: Req, w: EngineWrite) -> io::Result<bool> {
        let len = req.len;
        let block = self.dev.params.align.offset as u64;
        let sub_block =
            self.dev.direct() && (!w.host.is_multiple_of(block) || !len.is_multiple_of(block));
        if sub_block && w.whole.is_none() {
            // Smaller than the file's direct-I/O block: not through the engine after all.
            if let Some(t) = w.ticket {
                // Whatever the image set aside for it (new clusters) goes back.
                if let Err(e) = self.image.end_write(t, false) {
                    self.fail(
                        req.id,
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
                Some(offload) => Ok(self.format_write(req, offload)),
                None => {
                    self.read_modify_write(req);
                    Ok(false)
                }
            };
        }
        // The waits below pump only other requests (this one has nothing in flight yet):
        // what it holds goes into its slot once, after them.
        let range_key = if self.dev.write_ranges.is_some() {
            self.acquire_range(w.host, w.host + len, Holder::Write)
        } else {
            None
        };
        let held = if w.overwrite {
            self.hold_overwrite(w.host, w.host + len)
        } else {
            None
        };
        if let Some(r) = self.slots.busy(req.id) {
            r.ticket = w.ticket;
            r.range_key = range_key;
            if let Some(held) = held {
                r.ticket = Some(held);
            }
        }
        self.push_rw(req, w.host, w.whole)
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
    fn format_write(&mut self, req: Req, offload: Offload) -> bool {
        let (id, offset, len) = (req.id, req.offset, req.len as usize);
        let durable = !self.dev.writeback();
        if durable {
            self.stats.durable_writes += 1;
        }
        // No fill may be in flight while the format writes: it could land over bytes
        // written in place in the same cluster. The gate keeps new fills from starting
        // until the write is done.
        let gate = self.fence_fills();
        let (Some(inbox), Some(_)) = (self.inbox.clone(), self.image.pool(offload)) else {
            self.format_write_inline(id, offset, len, durable);
            drop(gate);
            return false;
        };
        let mut data = vec![0u8; len];
        if let Err(e) = self.slots.get(id).copy_data(&mut data) {
            self.fail(
                id,
                Failure::Io {
                    what: "reading the write from guest memory",
                    source: e,
                },
            );
            return false;
        }
        let image = self.image.clone();
        let ud = user_data(id, OpKind::Offload, 0);
        let queue = self.index;
        let dev = self.dev.clone();
        let job: crate::offload::Job = Box::new(move || {
            let result = match image.write_through_format(offset, &data, durable) {
                Ok(()) => 0,
                Err(e) => {
                    // The errno goes back for the error policy, which logs what it holds.
                    let errno = image_errno(&e).unwrap_or(libc::EIO);
                    if !dev.holds.holds(crate::virtio_blk::RequestType::Out, errno) {
                        report_offloaded(
                            queue,
                            &Failure::Image {
                                what: "write",
                                offset,
                                source: e,
                            },
                        );
                    }
                    -errno
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
            self.format_write_inline(id, offset, len, durable);
            return false;
        }
        if let Some(r) = self.slots.busy(id) {
            r.pending = 1;
        }
        self.offloaded += 1;
        self.watch().wait(id.get(), Wait::Pool);
        true
    }

    /// A write through the format on this thread, synchronously.
    fn format_write_inline(&mut self, id: SlotId, offset: u64, len: usize, durable: bool) {
        let mut buf = match self.bounce.get(len) {
            Ok(b) => b,
            Err(e) => {
                self.fail(
                    id,
                    Failure::Io {
                        what: "a buffer for the write",
                        source: e,
                    },
                );
                return;
            }
        };
        let r = self
            .slots
            .get(id)
            .copy_data(&mut buf.as_mut_slice()[..len])
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
            self.fail(id, f);
        }
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
    fn read_modify_write(&mut self, req: Req) {
        self.stats.read_modify_writes += 1;
        let block = self.dev.params.align.offset as u64;
        let (offset, len) = (req.offset, req.len);
        // The file blocks around it (past an encrypted image's header).
        let (start, end) = block_span(self.image.raw_host(offset), len, block);
        if self.image.host_limit().is_some_and(|limit| end > limit) {
            self.fail(
                req.id,
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
            .slots
            .get(req.id)
            .copy_data(&mut data)
            .and_then(|()| self.image.write_sub_block(offset, &data, block, durable));
        if let (Some(k), Some(ranges)) = (key, self.dev.write_ranges.as_ref()) {
            ranges.release(k);
        }
        if let Err(e) = r {
            self.fail(
                req.id,
                Failure::Io {
                    what: "read-modify-write",
                    source: e,
                },
            );
        }
    }
}

/// Would this write (at offset 0) start the image with a format's magic?
fn plants_format_header(slot: &Slot) -> bool {
    let Some(r) = slot.busy_ref() else {
        return false;
    };
    let n = (slot.req.data_len as usize).min(MAGIC_PROBE_BYTES);
    let mut magic = [0u8; MAGIC_PROBE_BYTES];
    copy_from_guest_prefix(&r.mem, &slot.req.data, &mut magic[..n])
        && probe_bytes(&magic[..n]).is_some()
}

impl Slot {
    /// The request's guest data, gathered into `dst` (its exact length).
    fn copy_data(&self, dst: &mut [u8]) -> io::Result<()> {
        let r = self
            .busy_ref()
            .ok_or_else(|| io::Error::from(io::ErrorKind::InvalidInput))?;
        copy_from_guest(&r.mem, &self.req.data, dst)
    }
}
