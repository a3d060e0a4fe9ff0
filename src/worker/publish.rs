//! The used ring: reaping finished operations, putting requests on the ring (the image's
//! metadata first: `publish_used`), batching where that costs a sync (`hold_for_batch`),
//! and signalling the guest as EVENT_IDX allows.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use vhost_user_backend::VringT;
use virtio_queue::QueueT;
use vm_memory::GuestAddressSpace;

use super::{ring_bytes, QueueWorker, Vring, VringState};
use crate::log_limited;

/// How long finished requests may wait for the pool's other jobs in flight, so that one
/// publish covers them all, where publishing costs a sync (`Image::publishes_in_batches`),
/// and how many may wait (a deep queue that keeps the pool busy publishes anyway).
const BATCH_HOLD: Duration = Duration::from_millis(10);
const BATCH_MAX: usize = 64;

impl QueueWorker {
    /// Put finished requests on the used ring, each accounted in the inflight region; the
    /// image's metadata they depend on reaches the file first (a process killed after this
    /// leaves nothing the guest was told is written only in its memory).
    pub(super) fn publish_used(&mut self, state: &mut VringState) {
        let index = self.index;
        if self.recorder.has_marks() {
            // Changed-block tracking: bits newly set in persistent bitmaps reach the file
            // before the requests that set them complete.
            let marks = self.recorder.take_marks();
            if let Err(e) = self.image.persist_marks(&marks) {
                log_limited!(
                    log::Level::Error,
                    "queue {index}: writing dirty bitmap bits to the image: {}",
                    crate::logging::error_chain(&e)
                );
            }
        }
        if self.deferred_used.is_empty() {
            return;
        }
        self.held_since = None;
        if let Some(o) = self.order.as_mut() {
            // VIRTIO_F_IN_ORDER: only the run that continues the used ring goes on it.
            o.reorder(&mut self.deferred_used);
            if self.deferred_used.is_empty() {
                return;
            }
        }
        if let Err(e) = self.image.publish() {
            log_limited!(
                log::Level::Error,
                "queue {index}: writing image metadata: {}",
                crate::logging::error_chain(&e)
            );
        }
        for (head, len) in self.deferred_used.drain(..) {
            let mut publish = || match state.add_used(head, len) {
                Ok(()) => Some(state.get_queue().next_used()),
                Err(e) => {
                    log_limited!(log::Level::Warn, "queue {index}: add_used: {e}");
                    None
                }
            };
            match self.inflight.as_mut() {
                Some(t) => t.complete(head, publish),
                None => {
                    publish();
                }
            }
        }
        // The used ring's writes went through guest memory, which logged them at the ring's
        // address; the frontend may have asked for them at another.
        if let Some(at) = self.used_log {
            if self.dev.dirty_log.load(Ordering::Acquire) {
                let (_, _, used_bytes) = ring_bytes(state.get_queue().size());
                let mem = self.mem.memory();
                crate::guest_memory::mark_dirty(&mem, vm_memory::GuestAddress(at), used_bytes);
            }
        }
    }

    pub(super) fn reap_and_complete(&mut self, vring: &Vring) {
        loop {
            self.reap_deferred();
            // Completions may have queued follow-up operations (write-through syncs); the
            // blocking engine finishes them at once, so reap again until nothing is ready.
            self.submit_engine();
            if !self.engine.has_completions() && !self.inbox_ready() {
                break;
            }
        }
        if self.deferred_used.is_empty() || self.hold_for_batch() {
            return;
        }
        self.publish_and_signal(vring);
    }

    /// Put every finished request on the used ring and signal the guest.
    pub(super) fn publish_and_signal(&mut self, vring: &Vring) {
        if self.deferred_used.is_empty() {
            return;
        }
        let mut state = vring.get_mut();
        self.publish_used(&mut state);
        drop(state);
        self.signal(vring);
    }

    /// Hold finished requests back while the pool still has jobs of this queue in flight,
    /// where each publish costs a sync: one publish then covers the batch (the queue's
    /// depth of compressed writes instead of the one or two each completion brings), at
    /// most [`BATCH_HOLD`] and [`BATCH_MAX`] requests (a pool job in flight wakes the queue
    /// when it is done).
    pub(super) fn hold_for_batch(&mut self) -> bool {
        if self.offloaded == 0
            || self.deferred_used.len() >= BATCH_MAX
            || !self.image.publishes_in_batches()
        {
            self.held_since = None;
            return false;
        }
        let since = *self.held_since.get_or_insert_with(Instant::now);
        if since.elapsed() >= BATCH_HOLD {
            self.held_since = None;
            return false;
        }
        true
    }

    /// Reap the engine and the inbox and account completions; finished requests wait in
    /// `deferred_used` for the caller to put them on the used ring.
    pub(super) fn reap_deferred(&mut self) {
        self.engine.reap(&mut self.completions);
        if let Some(inbox) = &self.inbox {
            inbox.take(&mut self.completions);
        }
        while !self.completions.is_empty() {
            let mut done = std::mem::take(&mut self.completions);
            for c in done.drain(..) {
                if let Some(x) = self.complete_op(c) {
                    self.deferred_used.push(x);
                }
            }
            // complete_op never queues completions itself, but keep any that appeared.
            done.append(&mut self.completions);
            if done.is_empty() {
                self.completions = done;
                break;
            }
            self.completions = done;
        }
    }

    pub(super) fn inbox_ready(&self) -> bool {
        self.inbox.as_ref().is_some_and(|i| i.has())
    }

    pub(super) fn signal(&self, vring: &Vring) {
        match vring.needs_notification() {
            Ok(true) | Err(_) => {
                if let Err(e) = vring.signal_used_queue() {
                    log::debug!("queue {}: signal: {e}", self.index);
                }
            }
            Ok(false) => {}
        }
    }
}
