//! Requests waiting for the device's I/O limits (`crate::throttle`): parsed and held in
//! their slots, oldest first, released when the shared buckets admit them; the queue's
//! timerfd wakes the queue for that.

use std::time::Duration;

use super::slot::Req;
use super::QueueWorker;

impl QueueWorker {
    /// The throttle timer's descriptor, to register with the queue's epoll loop.
    pub fn timer_fd(&self) -> Option<i32> {
        use std::os::fd::AsRawFd;
        self.timer.as_ref().map(|t| t.as_raw_fd())
    }

    /// The timer fired: start what the limits admit now, and look at held requests.
    pub fn handle_timer(&mut self) {
        if let Some(t) = self.timer.as_mut() {
            let _ = t.clear();
        }
        let Some(vring) = self.vring.clone() else {
            return;
        };
        self.release_throttled();
        self.submit_engine();
        self.reap_and_complete(&vring);
        // The error policy's tick shares the timer (`hold`).
        self.hold_tick(&vring);
        if self.stalled {
            self.process_queue(&vring, true);
        }
    }

    /// Must `req` wait for the I/O limits? (Requests behind a waiting one wait too.)
    pub(super) fn must_wait_for_throttle(&mut self, req: Req) -> bool {
        if !self.throttled.is_empty() {
            return true;
        }
        if !self.dev.throttle.on() {
            return false;
        }
        match self.throttle_admit(req) {
            Ok(()) => false,
            Err(wait) => {
                self.arm_timer(wait);
                true
            }
        }
    }

    pub(super) fn throttle_admit(&self, req: Req) -> Result<(), Duration> {
        use crate::throttle::Dir;
        use crate::virtio_blk::RequestType;
        let dir = match req.kind {
            RequestType::In => Dir::Read,
            RequestType::Out => Dir::Write,
            _ => return Ok(()),
        };
        self.dev.throttle.admit(dir, req.len)
    }

    /// Wake up after `wait` (at most 50 ms: limits changed meanwhile take effect soon).
    pub(super) fn arm_timer(&mut self, wait: Duration) {
        let wait = wait.clamp(Duration::from_micros(100), Duration::from_millis(50));
        if let Some(t) = self.timer.as_mut() {
            let _ = t.reset(wait, None);
        }
    }

    /// Start the waiting requests the limits admit now, oldest first (all of them with
    /// `force`: the queue is stopping and everything taken must complete).
    pub(super) fn release_throttled_inner(&mut self, force: bool) {
        while let Some(&req) = self.throttled.front() {
            if !force && self.dev.throttle.on() {
                if let Err(wait) = self.throttle_admit(req) {
                    self.arm_timer(wait);
                    return;
                }
            }
            self.throttled.pop_front();
            if let Some(used) = self.launch(req) {
                self.deferred_used.push((req.head, used));
            }
        }
    }

    pub(super) fn release_throttled(&mut self) {
        self.release_throttled_inner(false);
    }
}
