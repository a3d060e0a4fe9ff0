//! A queue's start in a connection: the image taken (over, after a live-migration
//! handover), the used index read from the ring, and with an inflight region the recovery
//! of what a previous process left in flight, resubmitted before anything new.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use virtio_queue::QueueT;

use super::{new_inbox, ring_problem, Mem, QueueWorker};
use crate::image::{Engine, Image};
use crate::virtio_blk::Desc;

/// How often a started queue whose image could not be taken tries again.
pub(super) const TAKE_RETRY: Duration = Duration::from_secs(1);

impl QueueWorker {
    /// The queue's first processing after it was set up: the device's used index is the
    /// used ring's (SET_VRING_BASE sets only the available side, and a previous process
    /// may have published more than the frontend knows); with an inflight region, its
    /// last batch is repaired, the available position is the used index plus the requests
    /// still marked, and those are queued for resubmission in the order they were taken.
    pub(super) fn start(&mut self, q: &mut virtio_queue::Queue, mem: &Mem) {
        self.started = true;
        self.signal_on_start = true;
        self.order = self
            .dev
            .in_order
            .load(Ordering::Acquire)
            .then(|| super::in_order::InOrder::new(q.size()));
        self.take_image(crate::image::handover::TAKE_OVER_WAIT);
        if let Some(why) = ring_problem(q, mem) {
            self.mark_broken(why);
            return;
        }
        let used = match q.used_idx(mem, Ordering::Acquire) {
            Ok(u) => u.0,
            Err(_) => {
                self.mark_broken("the used ring is not in guest memory");
                return;
            }
        };
        q.set_next_used(used);
        // The frontend's base (SET_VRING_BASE) is what the previous backend had taken; after
        // a clean stop (or a migration) it equals the used index. After a crash it may be
        // ahead (requests taken and not completed: the inflight region has them).
        let base = q.next_avail();
        if base != used {
            log::warn!(
                "queue {}: the used index is {used}, the frontend's base {base}",
                self.index
            );
        }
        let Some(t) = self.inflight.as_mut() else {
            return;
        };
        if q.size() > t.desc_num() {
            log::error!(
                "queue {}: the inflight region tracks {} entries but the ring has {}: \
                 requests on this queue are not tracked",
                self.index,
                t.desc_num(),
                q.size()
            );
            self.inflight = None;
            return;
        }
        let r = t.recover(used, q.size());
        if !r.resubmit.is_empty() || r.repaired > 0 {
            log::info!(
                "queue {}: resubmitting {} requests the previous process had in flight \
                 ({} completions it had published accounted)",
                self.index,
                r.resubmit.len(),
                r.repaired
            );
        }
        q.set_next_avail(used.wrapping_add(r.resubmit.len() as u16));
        self.resubmit = r.resubmit;
        self.resubmit.reverse();
    }

    /// Serve the device's active image, taking it over first if it is inactive (a migration
    /// destination, or a source whose migration failed after it handed the image over),
    /// waiting up to `wait` for another process to let go of it. If it cannot be taken, the
    /// queue's requests fail (IOERR, `submit`) and the take is tried again, without
    /// waiting, at most every [`TAKE_RETRY`] while the queue runs (`retry_take_image`).
    pub(super) fn take_image(&mut self, wait: Duration) {
        if !self.image.is_active() {
            self.watch().thread_waits(crate::watchdog::Wait::TakeOver);
        }
        let taken = self.dev.image.take_over(self.dev.size_bytes(), wait);
        self.watch().thread_waits(crate::watchdog::Wait::Nothing);
        match taken {
            Ok(image) => {
                self.take_failed = None;
                if Arc::ptr_eq(&image, &self.image) {
                    return;
                }
                image.bind(&mut self.engine);
                if self.inbox.is_none() {
                    self.inbox = new_inbox(self.index, &image, &self.engine);
                }
                // The file's persistent bitmaps as the other process left them (once for
                // all queues: the set keeps the same ones).
                self.dev
                    .bitmaps
                    .adopt(image.persistent_bitmaps(), image.bitmaps_memory_only());
                self.image = image;
            }
            Err(e) => {
                let first = self.take_failed.is_none();
                self.take_failed = Some(Instant::now());
                if first {
                    log::error!(
                        "queue {}: cannot take the image over: {}; requests fail (IOERR) \
                         until it can be taken (tried again every {} s while requests come)",
                        self.index,
                        crate::logging::error_chain(&e),
                        TAKE_RETRY.as_secs()
                    );
                } else {
                    crate::log_limited!(
                        log::Level::Warn,
                        "queue {}: still cannot take the image over: {}",
                        self.index,
                        crate::logging::error_chain(&e)
                    );
                }
            }
        }
    }

    /// Can this queue's engine serve `image` (see [`Image::engine_fits`])?
    pub fn engine_fits(&self, image: &Image) -> bool {
        std::ptr::eq(image, &*self.image) || image.engine_fits(&self.engine)
    }

    /// Run this (settled) queue on `engine` from now on: a job moved the guest to another
    /// kind of disk. The old engine has nothing in flight; `follow_image` binds the new one.
    pub fn replace_engine(&mut self, engine: Engine) {
        debug_assert_eq!(self.in_flight(), 0);
        if let Some(c) = self.dev.queue_stats.get(usize::from(self.index)) {
            c.watch.set_engine(engine.name());
        }
        self.engine = engine;
        self.inbox = None;
    }

    /// Serve the device's image if it was switched while this queue was paused (a
    /// snapshot's overlay, `ImageSlot::switch`): nothing of the old one is in flight.
    pub fn follow_image(&mut self) {
        let image = self.dev.image.get();
        if Arc::ptr_eq(&image, &self.image) || !image.is_active() {
            return;
        }
        image.bind(&mut self.engine);
        if self.inbox.is_none() {
            self.inbox = new_inbox(self.index, &image, &self.engine);
        }
        self.image = image;
    }

    /// A started queue whose image could not be taken: try again (one attempt, no wait) if
    /// the last try is [`TAKE_RETRY`] old, so that requests are served again once the other
    /// process lets go, and a storm of kicks does not become a storm of opens.
    pub(super) fn retry_take_image(&mut self) {
        if self.image.is_active() {
            return;
        }
        if self.take_failed.is_some_and(|at| at.elapsed() < TAKE_RETRY) {
            return;
        }
        self.take_image(Duration::ZERO);
        if self.image.is_active() {
            log::info!(
                "queue {}: took the image over on a later try; serving requests again",
                self.index
            );
        }
    }

    /// Start the requests recovery found in flight, oldest first, as far as slots allow.
    pub(super) fn resubmit_recovered(&mut self, q: &virtio_queue::Queue, mem: &Arc<Mem>) {
        while !self.resubmit.is_empty() && self.slots.has_free() && !self.dev.holds.paused() {
            let Some(head) = self.resubmit.pop() else {
                break;
            };
            if let Some(o) = self.order.as_mut() {
                o.taken(head);
            }
            let chain = virtio_queue::DescriptorChain::new(
                &**mem,
                vm_memory::GuestAddress(q.desc_table()),
                q.size(),
                head,
            );
            let descs = chain.map(|d| Desc {
                addr: d.addr().0,
                len: d.len(),
                write_only: d.is_write_only(),
            });
            if let Some(used) = self.start_request(head, descs, mem) {
                self.deferred_used.push((head, used));
            }
        }
    }
}
