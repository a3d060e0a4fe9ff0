//! DISCARD, WRITE_ZEROES and detected zero writes, and the detect-zeroes scan itself. Raw
//! images: one fallocate per range through the engine (BLKDISCARD on block devices);
//! formats: zero flags and unallocation through the image, synchronously. Deallocation only
//! where the operator allowed it (`--discard unmap`).

use std::io;

use std::sync::atomic::Ordering;
use vm_memory::GuestMemoryBackend;

use crate::image::ZeroMode;
use crate::io::ranges::Holder;
use crate::io::{sys, Completion, Op};
use crate::virtio_blk::RequestType;

use super::failure::Failure;
use super::slot::{user_data, OpKind, Req, Slot, SlotId, SlotState, Then};
use super::QueueWorker;

impl Slot {
    /// detect-zeroes: is the whole write all zero? Reads guest memory in place.
    /// Memory that went away during the scan reads as zero pages: then the write is not
    /// zero (it goes to the engine, which finds the memory missing and fails it).
    pub(super) fn write_is_zero(&self) -> bool {
        let Some(r) = self.busy_ref() else {
            return false;
        };
        let lost = crate::guest_memory::lost_pages();
        let zero = self.req.data.iter().all(|seg| {
            r.mem
                .get_slices(seg.addr, seg.len as usize)
                .all(|vs| match vs {
                    // SAFETY: the slice is mapped guest memory of vs.len() bytes, kept mapped
                    // by the request's memory snapshot for the duration of the call.
                    Ok(vs) => unsafe {
                        crate::zero::is_zero_raw(vs.ptr_guard().as_ptr(), vs.len())
                    },
                    Err(_) => false,
                })
        });
        zero && crate::guest_memory::lost_pages() == lost
    }
}

impl QueueWorker {
    /// Zero the request's ranges. Ok(false) when there is nothing to wait for.
    pub(super) fn submit_zero_ranges(&mut self, req: Req) -> io::Result<bool> {
        let id = req.id;
        let discard_unmap = self.dev.params.discard_unmap;
        let discard = req.kind == RequestType::Discard;
        if discard && !discard_unmap {
            // --discard ignore: DISCARD is a hint the device may ignore (5.2.6.2).
            return Ok(false);
        }
        if self.image.zeroes_through_format() {
            self.zero_through_format(id, discard, discard_unmap);
            return Ok(false);
        }
        let range_key = if self.dev.write_ranges.is_some() {
            let r = &self.slots.get(id).req.ranges;
            let lo = r.iter().map(|r| r.offset_bytes).min().unwrap_or(0);
            let hi = r
                .iter()
                .map(|r| r.offset_bytes + r.len_bytes)
                .max()
                .unwrap_or(0);
            self.acquire_range(lo, hi, Holder::Write)
        } else {
            None
        };
        let no_zero_range = self.dev.no_zero_range.load(Ordering::Relaxed);
        let block_device = self.dev.params.is_block_device;
        let writeback = self.dev.writeback();
        let slot = self.slots.get(id);
        let SlotState::Busy(r) = &mut slot.state else {
            return Ok(false);
        };
        r.range_key = range_key;
        // Write-through: zeroed blocks must be durable when the request completes.
        if !discard && !writeback {
            r.then = Then::SyncFirst;
        }
        for (i, range) in slot.req.ranges.iter().enumerate() {
            let (mode, kind) = if discard && block_device {
                // A real discard (BLKDISCARD); synchronous: io_uring has no portable opcode.
                r.pending += 1;
                self.completions.push(Completion {
                    user_data: user_data(id, OpKind::Discard, i as u32),
                    result: self
                        .image
                        .discard_block_device(range.offset_bytes, range.len_bytes),
                });
                continue;
            } else if discard {
                let op = Op::Discard {
                    offset: range.offset_bytes,
                    len: range.len_bytes,
                };
                // SAFETY: no buffers.
                unsafe {
                    self.engine
                        .push(0, &op, user_data(id, OpKind::Discard, i as u32))?
                };
                r.pending += 1;
                continue;
            } else if range.unmap && discard_unmap {
                (sys::PUNCH_HOLE, OpKind::PunchZero)
            } else if no_zero_range {
                // Known unsupported: go straight to the fallback at completion.
                r.pending += 1;
                self.completions.push(Completion {
                    user_data: user_data(id, OpKind::ZeroRange, i as u32),
                    result: -libc::EOPNOTSUPP,
                });
                continue;
            } else {
                (sys::ZERO_RANGE, OpKind::ZeroRange)
            };
            let op = Op::Fallocate {
                mode,
                offset: range.offset_bytes,
                len: range.len_bytes,
            };
            // SAFETY: no buffers.
            unsafe { self.engine.push(0, &op, user_data(id, kind, i as u32))? };
            r.pending += 1;
        }
        Ok(r.pending > 0)
    }

    /// Zeroing through the format: zero flags and unallocation for whole clusters, zero
    /// data for partial ones (synchronous), durable before completion in write-through mode.
    fn zero_through_format(&mut self, id: SlotId, discard: bool, discard_unmap: bool) {
        let gate = self.fence_fills();
        let dev = self.dev.clone();
        let image = self.image.clone();
        let mut failed = None;
        for range in &self.slots.get(id).req.ranges {
            let mode = if discard {
                ZeroMode::Discard
            } else if range.unmap && discard_unmap {
                ZeroMode::Unmap
            } else {
                ZeroMode::Keep
            };
            if let Err(e) = image.zero_range(range.offset_bytes, range.len_bytes, mode) {
                failed = Some(Failure::Image {
                    what: "zeroing",
                    offset: range.offset_bytes,
                    source: e,
                });
                break;
            }
            if mode != ZeroMode::Keep {
                dev.zero_stats
                    .unmapped_bytes
                    .fetch_add(range.len_bytes, Ordering::Relaxed);
            }
        }
        drop(gate);
        if failed.is_none() && !dev.writeback() {
            if let Err(e) = image.sync() {
                failed = Some(Failure::Image {
                    what: "sync after zeroing",
                    offset: 0,
                    source: e,
                });
            }
        }
        if let Some(f) = failed {
            self.fail(id, f);
        }
    }
}
