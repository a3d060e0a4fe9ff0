//! The queue's side of the error policy (`crate::hold`): a request whose host error the
//! policy holds is not completed. What its attempt took (a write ticket, a bounce buffer,
//! a write range, a job's write-through) is given back, and the request keeps its slot,
//! its parsed chain and its place in the inflight region. While anything is held, no queue
//! takes new requests. The queue's timer ticks every [`TICK`]: it retries the held
//! requests every retry interval and on `resume` (the whole request again, from the start:
//! writes are idempotent), answers them with IOERR on `stop-holding`, and takes new
//! requests again once nothing is held anywhere. A queue that stops (disconnect, SIGTERM)
//! leaves them marked in the inflight region for the next start to retry, or answers them
//! with IOERR where the frontend gave no region.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crate::device::CacheMode;
use crate::virtio_blk::{status, RequestType};
use crate::watchdog::Wait;

use super::failure::Failure;
use super::slot::{InFlight, Req, SlotId};
use super::{QueueWorker, Vring};

/// How often a queue looks again while requests are held (for `resume`, `stop-holding`,
/// the retry interval, and the end of another queue's hold).
pub(super) const TICK: Duration = Duration::from_millis(50);

/// The queue's held requests and what it has seen of the device's.
#[derive(Debug)]
pub(super) struct QueueHolds {
    /// Held here, in the order they were held.
    held: Vec<SlotId>,
    /// The device's (resume, stop-holding) generations when last looked at.
    seen: (u64, u64),
    last_retry: Instant,
    /// Held requests are being answered with IOERR: nothing is held again meanwhile.
    giving_up: bool,
    /// The queue stopped taking requests for a hold: look at its ring once it ends.
    paused: bool,
}

impl Default for QueueHolds {
    fn default() -> Self {
        QueueHolds {
            held: Vec::new(),
            seen: (0, 0),
            last_retry: Instant::now(),
            giving_up: false,
            paused: false,
        }
    }
}

impl QueueHolds {
    pub fn len(&self) -> usize {
        self.held.len()
    }
}

/// How the first log line names a request of `kind`.
fn what(kind: RequestType) -> &'static str {
    match kind {
        RequestType::In => "reads",
        RequestType::Flush => "flushes",
        RequestType::WriteZeroes => "write-zeroes requests",
        RequestType::Discard => "discards",
        _ => "writes",
    }
}

impl QueueWorker {
    /// Would the error policy hold request `id` if it fails with host `errno` (None: a
    /// failure no retry fixes)?
    pub(super) fn would_hold(&mut self, id: SlotId, errno: Option<i32>) -> bool {
        let Some(errno) = errno else {
            return false;
        };
        if self.holds.giving_up || self.timer.is_none() {
            // Nothing could retry it (no timer), or the operator gave up.
            return false;
        }
        let kind = self.slots.get(id).req.kind;
        if kind == RequestType::Flush && self.dev.params.cache != CacheMode::None {
            // A failed flush through the page cache may have dropped the dirty pages it
            // was to write (Linux marks them clean): a retry that succeeds would claim
            // data durable that is gone.
            return false;
        }
        self.slots.busy(id).is_some_and(|r| !r.unholdable) && self.dev.holds.holds(kind, errno)
    }

    /// Is the request in slot `id`, finished with an error, to be held?
    pub(super) fn must_hold(&mut self, id: SlotId) -> bool {
        let errno = match self.slots.busy(id) {
            Some(r) if r.status != status::OK && !r.unholdable && r.host_errno != 0 => {
                Some(r.host_errno)
            }
            _ => return false,
        };
        self.would_hold(id, errno)
    }

    /// Hold the request in slot `id` (its operations all done, it failed): give back what
    /// this attempt took, keep the slot.
    pub(super) fn hold(&mut self, id: SlotId) {
        let kind = self.slots.get(id).req.kind;
        let Some(r) = self.slots.busy(id) else {
            return;
        };
        let (ticket, bounce, key, through) = (
            r.ticket.take(),
            r.bounce.take(),
            r.range_key.take(),
            r.through.take(),
        );
        let first = !std::mem::replace(&mut r.was_held, true);
        let errno = r.host_errno;
        if let Some((wt, token, start)) = through {
            wt.end(token, start, None);
        }
        if let Some(t) = ticket {
            if let Err(e) = self.image.end_write(t, false) {
                self.report(&Failure::Image {
                    what: "giving back a held write's clusters",
                    offset: 0,
                    source: e,
                });
            }
        }
        if let Some(b) = bounce {
            self.bounce.put(b.buf);
        }
        if let (Some(k), Some(ranges)) = (key, self.dev.write_ranges.as_ref()) {
            ranges.release(k);
        }
        if self.holds.held.is_empty() {
            self.holds.last_retry = Instant::now();
            self.holds.seen = self.dev.holds.generations();
        }
        self.holds.held.push(id);
        self.holds.paused = true;
        self.watch().wait(id.get(), Wait::Held);
        if first {
            self.dev.holds.hold(errno, what(kind));
        }
        self.arm_hold_tick();
    }

    /// Does a hold anywhere keep this queue from taking requests? (Then it looks again on
    /// its timer.)
    pub(super) fn held_back(&mut self) -> bool {
        if !self.dev.holds.paused() {
            return false;
        }
        self.holds.paused = true;
        self.arm_hold_tick();
        true
    }

    /// Wake this queue in [`TICK`], unless its timer is already set (the I/O limits may
    /// want it sooner; every timer event ticks).
    pub(super) fn arm_hold_tick(&mut self) {
        if let Some(t) = self.timer.as_mut() {
            if !t.is_armed().unwrap_or(false) {
                let _ = t.reset(TICK, None);
            }
        }
    }

    /// The timer fired: act on `resume`, `stop-holding` and the retry interval, and take
    /// requests again once nothing is held.
    pub(super) fn hold_tick(&mut self, vring: &Vring) {
        let gens = self.dev.holds.generations();
        if !self.holds.held.is_empty() {
            if gens.1 != self.holds.seen.1 {
                let n = self.give_up_held();
                log::warn!(
                    "queue {}: answered {n} held request(s) with an I/O error (stop-holding)",
                    self.index
                );
            } else if gens.0 != self.holds.seen.0
                || self
                    .dev
                    .holds
                    .retry_interval()
                    .is_some_and(|d| self.holds.last_retry.elapsed() >= d)
            {
                self.retry_held();
            }
            self.reap_and_complete(vring);
        }
        self.holds.seen = gens;
        if !self.holds.held.is_empty() || self.dev.holds.paused() {
            self.arm_hold_tick();
        } else if std::mem::take(&mut self.holds.paused) {
            self.process_queue(vring, true);
        }
    }

    /// Run every held request again from the start.
    fn retry_held(&mut self) {
        self.holds.last_retry = Instant::now();
        let ids = std::mem::take(&mut self.holds.held);
        self.dev
            .holds
            .retries
            .fetch_add(ids.len() as u64, Ordering::Relaxed);
        for id in ids {
            let slot = self.slots.get(id);
            slot.iov.clear();
            let Some(r) = slot.busy() else {
                continue;
            };
            let head = r.head;
            let mut fresh = InFlight::new(head, r.mem.clone(), r.started);
            fresh.was_held = true;
            *r = fresh;
            let req = Req::new(id, head, &slot.req);
            let (op, sector) = (crate::stats::op_index(req.kind), slot.req.sector);
            // The watchdog times this attempt (the latency statistics keep the first start).
            self.watch()
                .start(id.get(), op, sector, crate::watchdog::now_us());
            if let Some(used) = self.launch(req) {
                self.deferred_used.push((req.head, used));
            }
        }
        self.submit_engine();
    }

    /// Answer every held request with IOERR; returns how many.
    pub(super) fn give_up_held(&mut self) -> usize {
        let ids = std::mem::take(&mut self.holds.held);
        self.holds.giving_up = true;
        for &id in &ids {
            let Some(head) = self.slots.busy(id).map(|r| {
                r.status = status::IOERR;
                r.head
            }) else {
                continue;
            };
            if let Some(used) = self.finish(id) {
                self.deferred_used.push((head, used));
            }
        }
        self.holds.giving_up = false;
        self.dev
            .holds
            .given_up
            .fetch_add(ids.len() as u64, Ordering::Relaxed);
        ids.len()
    }

    /// The queue stops with requests held: leave them marked in the inflight region, where
    /// the next start (this process's or the next one's) finds and retries them; without a
    /// region nothing would, and they are answered with IOERR.
    pub(super) fn leave_held(&mut self) {
        if self.holds.held.is_empty() {
            return;
        }
        if self.inflight.is_none() {
            let n = self.give_up_held();
            log::warn!(
                "queue {}: stopping with {n} held request(s) and no inflight region to leave \
                 them in: answered with an I/O error",
                self.index
            );
            return;
        }
        let ids = std::mem::take(&mut self.holds.held);
        for &id in &ids {
            self.slots.get(id).iov.clear();
            self.slots.free(id);
            self.watch().end(id.get());
        }
        self.dev.holds.release(ids.len());
        self.count_in_flight();
        log::warn!(
            "queue {}: stopping with {} held request(s): left in the inflight region for the \
             next start to retry",
            self.index,
            ids.len()
        );
    }

    /// Requests held on this queue.
    pub(super) fn held_here(&self) -> usize {
        self.holds.len()
    }
}
