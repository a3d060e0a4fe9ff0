//! Per-queue data plane. Each queue has its own thread (the vhost-user-backend epoll loop)
//! and its own worker; the only shared state is the [`Device`] and its image.
//!
//! One request, in order:
//! 1. `process_queue` (here) pops a descriptor chain;
//! 2. `submit::start_request` parses it (`virtio_blk`) into the slot's [`slot::InFlight`];
//!    from there its [`slot::Req`] (slot id and parsed fields) is what the submission path
//!    passes on, and the slot is looked up only for what it owns (`slot::Slots`);
//! 3. reads and writes: the header guard and the zero check (`zero`), then the image plans
//!    (`read`: one extent or pieces; `write`: through the engine, or through the format on
//!    a pool or inline); DISCARD and WRITE_ZEROES are zeroed (`zero`);
//! 4. the engine executes (`submit::push_rw`: iovecs into guest memory, bounce buffers
//!    where O_DIRECT needs them, read-modify-write of sub-block writes);
//! 5. completions are reaped here and accounted in `complete`, which writes the status
//!    byte, gives back what the image lent (`end_write`), and frees the slot;
//! 6. the used ring is updated (the image's metadata first) and the guest signalled as
//!    EVENT_IDX allows (`publish`).
//!
//! Host failures go through `failure`, the one place that maps them to a status and logs
//! them (rate-limited). A queue's start (taking the image, inflight recovery) is in
//! `start`; requests waiting for the I/O limits in `throttle`.

mod complete;
mod crypt;
mod failure;
#[cfg(any(test, feature = "testing"))]
pub mod fuzz;
mod hold;
mod in_order;
pub mod poll;
mod publish;
mod read;
mod slot;
mod start;
mod submit;
pub mod thread;
mod throttle;
mod write;
mod zero;

#[cfg(test)]
mod tests;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use log::warn;
use vhost_user_backend::{VringRwLock, VringT};
use virtio_queue::{QueueOwnedT, QueueT};
use vm_memory::{GuestAddressSpace, GuestMemoryAtomic};

use crate::device::Device;
use crate::image::Engine;
use crate::image::{Image, ReadPlan};
use crate::inflight::QueueInflight;
use crate::io::bounce::BouncePool;
use crate::io::Completion;
use crate::log_limited;
use crate::offload::Inbox;
use crate::virtio_blk::Desc;
use slot::{Req, Slots};

use crate::guest_memory::Mem;
type Vring = VringRwLock<GuestMemoryAtomic<Mem>>;
type VringState = vhost_user_backend::VringState<GuestMemoryAtomic<Mem>>;

/// Per-queue counters, for logs and later stats.
#[derive(Default, Debug, Clone, Copy)]
pub struct QueueStats {
    pub requests: u64,
    pub errors: u64,
    pub bounced: u64,
    pub read_modify_writes: u64,
    /// Writes made durable before completion (write-through: WCE=0).
    pub durable_writes: u64,
    pub flushes: u64,
}

/// The data plane of one virtqueue.
pub struct QueueWorker {
    index: u16,
    dev: Arc<Device>,
    /// The image this queue serves: the device's, taken again at each start (it changes when
    /// a live migration hands it over and back: `image::handover`).
    image: Arc<Image>,
    engine: Engine,
    /// This queue's view of the dirty bitmaps (changed-block tracking).
    recorder: crate::bitmaps::Recorder,
    mem: GuestMemoryAtomic<Mem>,
    slots: Slots,
    vring: Option<Vring>,
    completions: Vec<Completion>,
    /// Requests finished while the vring was not at hand: (head, used_len) to add.
    deferred_used: Vec<(u16, u32)>,
    /// VIRTIO_F_IN_ORDER negotiated when the queue started: finished requests wait here for
    /// those taken before them.
    order: Option<in_order::InOrder>,
    /// Scratch for read plans, and the (file, host offset) of each piece read through the
    /// engine.
    read_plan: ReadPlan,
    piece_reads: Vec<(usize, u64)>,
    /// We stopped popping because every slot is in use; resume on the next completion.
    stalled: bool,
    bounce: BouncePool,
    pub stats: QueueStats,
    /// How long to busy-poll the avail ring and the completion ring after the last work
    /// before sleeping again (`--poll-us`: fixed, or adapted to the gaps between work).
    poll: poll::Poller,
    /// Set by another thread (queue stop) to end a poll loop early.
    poll_abort: Arc<AtomicBool>,
    /// `--queue-cpus`: the CPU this queue's thread runs on.
    cpu: Option<usize>,
    /// The queue thread has been named and pinned (`thread::set_up`).
    thread_set_up: bool,
    /// Where the image's pools report this queue's writes (None: no pools, or an engine
    /// without an eventfd: those writes run on this thread).
    inbox: Option<Arc<Inbox>>,
    /// Scratch for the encrypted parts taken from the inbox mid-request (`crypt`).
    helper_parts: Vec<Completion>,
    /// Requests on a pool.
    offloaded: usize,
    /// Finished requests held back for a batch since (`hold_for_batch`).
    held_since: Option<Instant>,
    /// The driver broke the ring (why): it is not processed again until the queue is
    /// stopped and set up anew.
    broken: Option<&'static str>,
    /// Guest memory pages lost to bus errors when this queue last looked.
    lost_pages: u64,
    /// This queue's part of the frontend's inflight region (INFLIGHT_SHMFD), if it gave one.
    inflight: Option<QueueInflight>,
    /// The queue has started in this connection (see `start`); false again once stopped.
    started: bool,
    /// Heads the inflight region says were in flight when the previous process ended, to
    /// resubmit before anything new (last first: popped from the end).
    resubmit: Vec<u16>,
    /// Signal the guest once after a start, for completions a previous process put on the
    /// used ring without signalling.
    signal_on_start: bool,
    /// When taking the image over last failed (None: it did not): requests fail until a
    /// later try succeeds (`start`).
    take_failed: Option<Instant>,
    /// The daemon is stopping: take no more requests (the next process will).
    quiesced: bool,
    /// Parsed requests waiting for the device's I/O limits (`throttle`), oldest first.
    throttled: std::collections::VecDeque<Req>,
    /// Wakes the queue when the limits admit the first of them (None: no timer, retried on
    /// the next event).
    timer: Option<vmm_sys_util::timerfd::TimerFd>,
    /// Where the frontend logs this queue's used-ring writes (VHOST_VRING_F_LOG).
    used_log: Option<u64>,
    /// Requests the error policy holds here (`hold`).
    holds: hold::QueueHolds,
}

impl QueueWorker {
    pub fn new(
        index: u16,
        dev: Arc<Device>,
        mut engine: Engine,
        mem: GuestMemoryAtomic<Mem>,
    ) -> Self {
        let n = usize::from(dev.params.queue_size);
        let bounce = BouncePool::new(dev.params.align.bounce_align());
        let image = dev.image.get();
        image.bind(&mut engine);
        let inbox = new_inbox(index, &image, &engine);
        if let Some(c) = dev.queue_stats.get(usize::from(index)) {
            c.watch.set_engine(engine.name());
        }
        QueueWorker {
            image,
            inbox,
            helper_parts: Vec::new(),
            offloaded: 0,
            held_since: None,
            broken: None,
            inflight: None,
            started: false,
            resubmit: Vec::new(),
            recorder: crate::bitmaps::Recorder::default(),
            signal_on_start: false,
            take_failed: None,
            quiesced: false,
            throttled: std::collections::VecDeque::new(),
            timer: vmm_sys_util::timerfd::TimerFd::new()
                .map_err(|e| warn!("queue {index}: no throttle timer ({e})"))
                .ok(),
            used_log: None,
            holds: hold::QueueHolds::default(),
            lost_pages: crate::guest_memory::lost_pages(),
            poll: poll::Poller::default(),
            poll_abort: Arc::new(AtomicBool::new(false)),
            cpu: None,
            thread_set_up: false,
            index,
            dev,
            engine,
            mem,
            slots: Slots::new(n),
            vring: None,
            completions: Vec::with_capacity(n),
            deferred_used: Vec::with_capacity(n),
            order: None,
            read_plan: ReadPlan::default(),
            piece_reads: Vec::new(),
            stalled: false,
            bounce,
            stats: QueueStats::default(),
        }
    }

    /// Enable bounded busy-polling; `abort` ends a poll loop from another thread.
    pub fn set_polling(&mut self, poll: poll::Poller, abort: Arc<AtomicBool>) {
        self.poll = poll;
        self.poll_abort = abort;
    }

    /// Pin this queue's thread to `cpu` (done on its first event).
    pub fn set_cpu(&mut self, cpu: Option<usize>) {
        self.cpu = cpu;
    }

    /// Called on the queue thread before each event: the first time, name and pin it.
    pub fn on_queue_thread(&mut self) {
        if !self.thread_set_up {
            self.thread_set_up = true;
            thread::set_up(self.index, self.cpu);
        }
    }

    pub fn engine_event_fd(&self) -> Option<i32> {
        self.engine.event_fd()
    }

    pub fn in_flight(&self) -> usize {
        self.slots.in_use()
    }

    /// This queue's in-flight table (the stuck-request watchdog's view).
    fn watch(&self) -> &crate::watchdog::QueueWatch {
        static NONE: std::sync::LazyLock<crate::watchdog::QueueWatch> =
            std::sync::LazyLock::new(Default::default);
        self.dev
            .queue_stats
            .get(usize::from(self.index))
            .map_or(&NONE, |c| &c.watch)
    }

    /// Publish the number of requests in flight to the queue's counters.
    fn count_in_flight(&self) {
        if let Some(c) = self.dev.queue_stats.get(usize::from(self.index)) {
            c.set_in_flight(self.in_flight());
        }
    }

    pub fn set_memory(&mut self, mem: GuestMemoryAtomic<Mem>) {
        self.mem = mem;
    }

    /// Track this queue's requests in `t` from its next start (SET_INFLIGHT_FD comes before
    /// the rings are set up). Refused while the queue runs: requests in flight would be
    /// recorded in one region and completed in another.
    pub fn set_inflight(&mut self, t: Option<QueueInflight>) -> Result<(), &'static str> {
        if self.started {
            return Err("the queue is running");
        }
        self.inflight = t;
        Ok(())
    }

    /// Take no new request from now on and complete those in flight, signalling the guest,
    /// while the connection is still up (a graceful stop: the next process starts from the
    /// used ring, where everything taken has been put back).
    pub fn quiesce(&mut self) {
        self.quiesced = true;
        self.drain();
    }

    /// SET_VRING_ADDR's log address of the used ring (None: not logged there).
    pub fn set_used_log(&mut self, addr: Option<u64>) {
        self.used_log = addr;
    }

    /// Has the queue started in this connection?
    pub fn started(&self) -> bool {
        self.started
    }

    /// The guest kicked: process every available chain.
    pub fn handle_kick(&mut self, vring: &Vring) {
        if self.vring.is_none() {
            self.vring = Some(vring.clone());
        }
        self.woke();
        self.process_queue(vring, true);
        self.poll_for_work(vring);
    }

    /// The engine's eventfd fired: reap and complete.
    pub fn handle_completions(&mut self) {
        let Some(vring) = self.vring.clone() else {
            return;
        };
        self.woke();
        // The eventfd is watched edge-triggered: no need to read (clear) it.
        self.reap_and_complete(&vring);
        if self.stalled {
            self.process_queue(&vring, true);
        }
        self.poll_for_work(&vring);
    }

    /// An event woke the queue thread: let an adaptive poll window learn from the gap.
    fn woke(&mut self) {
        if let Some(c) = self.dev.queue_stats.get(usize::from(self.index)) {
            c.record_wakeup();
        }
        if self.poll.is_auto() {
            self.poll.woke(Instant::now());
        }
    }

    /// A poll loop reads the clock once every this many turns without work (a turn without
    /// work takes tens of nanoseconds: the window stretches by at most a microsecond or two).
    const CLOCK_EVERY: u32 = 16;

    /// Busy-poll for new requests and completions, with guest kicks and completion signals
    /// off, until the poll window has passed without work. Saves the guest's kick and our
    /// wake-ups at low queue depth, at the price of CPU time while polling.
    fn poll_for_work(&mut self, vring: &Vring) {
        let window = self.poll.window();
        if window.is_zero() || self.quiesced {
            if self.poll.is_auto() {
                self.poll.idle(Instant::now());
                if let Some(c) = self.dev.queue_stats.get(usize::from(self.index)) {
                    c.record_poll(0, window);
                }
            }
            return;
        }
        let mem = self.mem.memory().into_inner();
        self.engine.set_event_enabled(false);
        if let Err(e) = vring.get_mut().disable_notification() {
            log_limited!(
                log::Level::Warn,
                "queue {}: disable notification: {e}",
                self.index
            );
        }
        let mut last_work = Instant::now();
        let mut hits = 0;
        // Idle turns since the last look at the clock, and whether work came since: the
        // clock is read every CLOCK_EVERY idle turns, not on every turn (at a million
        // requests a second the reads were a tenth of the queue thread's time).
        let (mut idle_turns, mut worked_since) = (0u32, false);
        while !self.poll_abort.load(Ordering::Relaxed) {
            let mut worked = false;
            if self.engine.has_completions() || self.inbox_ready() {
                self.reap_and_complete(vring);
                worked = true;
            }
            if !self.throttled.is_empty() {
                // The timer's wake-up is not seen while polling: retry here.
                self.release_throttled();
                self.submit_engine();
            }
            // Work is what was taken: a ring this queue may not take from (disabled,
            // stopped, quiesced) must not keep the loop spinning (it would never end, and
            // a stop waiting for the worker would wait for ever).
            if self.slots.has_free()
                && self.broken.is_none()
                && avail_pending(vring, &mem)
                && self.process_queue(vring, false) > 0
            {
                worked = true;
            }
            if worked {
                hits += 1;
                idle_turns = 0;
                worked_since = true;
                continue;
            }
            idle_turns += 1;
            if idle_turns % Self::CLOCK_EVERY == 0 {
                let now = Instant::now();
                if worked_since {
                    // The window runs from here: at most CLOCK_EVERY turns after the work.
                    last_work = now;
                    worked_since = false;
                } else if now.saturating_duration_since(last_work) >= window {
                    break;
                }
            }
            std::hint::spin_loop();
        }
        // Back to sleeping: signals on, then pick up whatever raced with re-arming (the
        // eventfd did not fire for completions that landed while it was off).
        self.engine.set_event_enabled(true);
        self.process_queue(vring, true);
        self.reap_and_complete(vring);
        if hits == 0 {
            self.poll.missed();
        } else {
            self.poll.hit();
        }
        self.poll.idle(last_work);
        if let Some(c) = self.dev.queue_stats.get(usize::from(self.index)) {
            c.record_poll(hits, self.poll.window());
        }
    }

    /// Wait for every request launched and complete it, publishing the completions (and
    /// their bitmap marks), but keep the queue running: requests waiting for the I/O
    /// limits stay waiting (a backup's begin, between two guest requests).
    pub fn settle(&mut self) {
        let Some(vring) = self.vring.clone() else {
            return;
        };
        loop {
            self.reap_and_complete(&vring);
            if self.in_flight() <= self.throttled.len() + self.held_here() {
                break;
            }
            if !self.wait_for_completion() {
                break;
            }
        }
        self.publish_and_signal(&vring);
    }

    /// Wait for every in-flight request and complete it (queue stop, disconnect, shutdown).
    pub fn drain(&mut self) {
        let Some(vring) = self.vring.clone() else {
            return;
        };
        // Requests waiting for the limits were taken from the ring: they complete now.
        self.release_throttled_inner(true);
        loop {
            // Completions already known (including synthetic ones) first: waiting with
            // nothing in the kernel would block for ever.
            self.reap_and_complete(&vring);
            // Held requests wait for nothing in the kernel either.
            self.leave_held();
            if self.in_flight() == 0 {
                break;
            }
            if !self.wait_for_completion() {
                break;
            }
        }
        // Nothing may stay held back for a batch (`hold_for_batch`).
        self.publish_and_signal(&vring);
        self.stalled = false;
        // The frontend stops a queue before it sets it up again: a broken ring gets a new
        // chance then, and the next start reads the rings (and the inflight region) anew.
        // Requests not yet resubmitted stay marked in the region for that start.
        self.broken = None;
        self.started = false;
        self.resubmit.clear();
        self.order = None;
    }

    /// Block until something in flight may have completed; false if waiting failed.
    fn wait_for_completion(&mut self) -> bool {
        if self.offloaded > 0 {
            // The pools report through the inbox, not the ring.
            if let Some(inbox) = &self.inbox {
                inbox.wait(Duration::from_millis(5));
            }
            return true;
        }
        match self.engine.wait_one() {
            Ok(()) => true,
            Err(e) => {
                log::error!(
                    "queue {}: waiting for in-flight requests failed: {e}",
                    self.index
                );
                false
            }
        }
    }

    /// Pop and start every available chain; returns how many were taken. With `rearm`,
    /// guest notifications are enabled again at the end (closing the race with EVENT_IDX);
    /// while polling they stay off.
    fn process_queue(&mut self, vring: &Vring, rearm: bool) -> usize {
        let mut taken = self.process_pass(vring, rearm);
        // A pass that stopped for want of a slot relies on the next completion to take
        // the rest (notifications stay off meanwhile); if those completions were reaped
        // in the pass itself (the blocking engine), no event will come: go on here.
        while self.stalled && rearm && self.slots.has_free() && !self.quiesced {
            taken += self.process_pass(vring, rearm);
        }
        taken
    }

    /// One pass of [`QueueWorker::process_queue`].
    fn process_pass(&mut self, vring: &Vring, rearm: bool) -> usize {
        if self.quiesced {
            return 0;
        }
        let mem = self.mem.memory().into_inner();
        let mut state = vring.get_mut();
        // A queue starts once it is set up and enabled: not again between a stop's drain
        // (SET_VRING_ENABLE 0, which disables it) and GET_VRING_BASE, where a start would take
        // back an image just handed over.
        if !self.started && state.get_queue().ready() && state.is_enabled() {
            self.start(state.get_queue_mut(), &mem);
        } else if self.started {
            // The image could not be taken at the start: try again now and then.
            self.retry_take_image();
        }
        // A disabled ring passes no data (vhost-user): nothing new is taken from it. (A
        // handed-over image is taken back at the queue's next start; if that fails, the
        // requests fail with IOERR rather than wait: `start_request`.)
        let enabled = state.is_enabled();
        let mut taken = 0;
        // Stalled is this pass's finding (no free slot): a stall that ended must not keep
        // notifications off for good (with EVENT_IDX the driver then stops kicking).
        self.stalled = false;
        loop {
            if self.broken.is_some() || self.memory_lost() || !enabled || self.held_back() {
                break;
            }
            if let Some(why) = ring_problem(state.get_queue(), &mem) {
                self.mark_broken(why);
                break;
            }
            if let Err(e) = state.disable_notification() {
                log_limited!(
                    log::Level::Warn,
                    "queue {}: disable notification: {e}",
                    self.index
                );
            }
            if !self.resubmit.is_empty() {
                self.resubmit_recovered(state.get_queue(), &mem);
            }
            if !self.throttled.is_empty() {
                self.release_throttled();
            }
            loop {
                if !self.slots.has_free() || !self.resubmit.is_empty() {
                    self.stalled = true;
                    break;
                }
                if self.held_back() {
                    break;
                }
                if self.memory_lost() {
                    break;
                }
                let popped = match state.get_queue_mut().iter(&*mem) {
                    Ok(mut chains) => chains.next(),
                    Err(_) => None,
                };
                // `None` is the end of what the driver had published when `iter` read its
                // index. It is not a broken ring: the driver may publish more at any moment
                // (re-reading the index here would race with it), and everything that can
                // be wrong with the ring was checked against this same memory snapshot at
                // the top of the loop, which checks it again before `enable_notification`
                // says there is more. (`iter` fails on an index that jumped meanwhile; the
                // check at the top then stops the queue.)
                let Some(chain) = popped else {
                    break;
                };
                let head = chain.head_index();
                taken += 1;
                if let Some(t) = self.inflight.as_mut() {
                    t.taken(head);
                }
                if let Some(o) = self.order.as_mut() {
                    o.taken(head);
                }
                let descs = chain.map(|d| Desc {
                    addr: d.addr().0,
                    len: d.len(),
                    write_only: d.is_write_only(),
                });
                if let Some(used) = self.start_request(head, descs, &mem) {
                    // Finished without asynchronous I/O (error, GET_ID, no-op flush, RMW).
                    self.deferred_used.push((head, used));
                }
            }
            if self.stalled || !rearm || self.broken.is_some() {
                break;
            }
            match state.enable_notification() {
                Ok(true) => continue,
                Ok(false) => break,
                Err(e) => {
                    log_limited!(
                        log::Level::Warn,
                        "queue {}: enable notification: {e}",
                        self.index
                    );
                    break;
                }
            }
        }
        self.submit_engine();
        // (Held back, with the rest, while a batch forms: `hold_for_batch`.)
        let completed = !self.deferred_used.is_empty() && !self.hold_for_batch();
        if completed {
            self.publish_used(&mut state);
        }
        drop(state);
        if std::mem::take(&mut self.signal_on_start) {
            // Unconditionally, as libvhost-user does at a queue's start: a previous process
            // may have put completions on the used ring and died before signalling them,
            // and with EVENT_IDX `needs_notification` knows nothing of those (nothing was
            // added here yet): the guest would wait for them for ever.
            if let Err(e) = vring.signal_used_queue() {
                log::debug!("queue {}: signal at start: {e}", self.index);
            }
        } else if completed {
            self.signal(vring);
        }
        // The blocking engine has finished already; complete without waiting for an event.
        self.reap_and_complete(vring);
        // A pass that stopped for want of a slot relies on the next completion to take
        // the rest (notifications stay off meanwhile); if those completions were reaped
        // just now (the blocking engine), no event will come: go on here.
        taken
    }

    /// Is this queue running: set up by the frontend, started and enabled (a stopped or
    /// disabled ring takes no requests)?
    pub fn running(&self) -> bool {
        self.vring.as_ref().is_some_and(|v| {
            let s = v.get_ref();
            s.get_queue().ready() && s.is_enabled()
        })
    }

    /// Has guest memory gone away under its mappings since this queue last looked (see
    /// `guest_memory`)? Then the frontend is broken: the queue stops, so that nothing more
    /// is read from or written to memory that now holds zero pages.
    fn memory_lost(&mut self) -> bool {
        let lost = crate::guest_memory::lost_pages();
        if lost != self.lost_pages {
            self.lost_pages = lost;
            self.mark_broken("guest memory went away: the frontend's memory file shrank");
        }
        self.broken.is_some()
    }

    /// Stop processing a ring the driver broke (one line, rate-limited); requests in flight
    /// still complete.
    fn mark_broken(&mut self, why: &'static str) {
        self.broken = Some(why);
        log_limited!(
            log::Level::Error,
            "queue {}: the driver broke the ring ({why}): not processing it until the queue \
             is set up again",
            self.index
        );
    }

    /// Hand queued operations to the kernel.
    fn submit_engine(&mut self) {
        if let Err(e) = self.engine.submit() {
            log_limited!(log::Level::Error, "queue {}: submit: {e}", self.index);
        }
    }

    /// While this queue waits for something another request holds (often one of its own):
    /// submit and reap its own operations.
    fn pump(&mut self) {
        self.submit_engine();
        self.reap_deferred();
    }
}

impl Drop for QueueWorker {
    /// The kernel may still be writing into guest memory or bounce buffers that this worker
    /// keeps alive: never let them go before every operation has completed.
    fn drop(&mut self) {
        self.drain();
        loop {
            self.reap_deferred();
            self.deferred_used.clear();
            if self.in_flight() == 0 || !self.wait_for_completion() {
                break;
            }
        }
    }
}

/// Where pool threads report this queue's writes through `image`, if it has pools and the
/// engine an eventfd.
fn new_inbox(index: u16, image: &Image, engine: &Engine) -> Option<Arc<Inbox>> {
    match (image.has_pools(), engine.event_fd()) {
        (true, Some(fd)) => Inbox::new(fd)
            .map_err(|e| warn!("queue {index}: format writes on the queue thread ({e})"))
            .ok(),
        _ => None,
    }
}

/// Bytes of a split ring's parts for `size` entries (2.7): descriptor table, available
/// ring (flags, idx, ring, used_event), used ring (flags, idx, ring, avail_event).
fn ring_bytes(size: u16) -> (usize, usize, usize) {
    let n = usize::from(size);
    (16 * n, 6 + 2 * n, 6 + 8 * n)
}

/// What is wrong with a ready queue as the driver set it up, if anything: its parts must lie
/// in guest memory, and the driver can be at most a ring's worth ahead of the device
/// (2.7.13.3: the available index runs at most `size` entries ahead).
fn ring_problem(q: &virtio_queue::Queue, mem: &Mem) -> Option<&'static str> {
    use vm_memory::{GuestAddress, GuestMemoryBackend};
    if !q.ready() {
        return None;
    }
    let (desc, avail, used) = ring_bytes(q.size());
    if !mem.check_range(GuestAddress(q.desc_table()), desc) {
        return Some("the descriptor table is not in guest memory");
    }
    if !mem.check_range(GuestAddress(q.avail_ring()), avail) {
        return Some("the available ring is not in guest memory");
    }
    if !mem.check_range(GuestAddress(q.used_ring()), used) {
        return Some("the used ring is not in guest memory");
    }
    match q.avail_idx(mem, Ordering::Acquire) {
        Ok(idx) if idx.0.wrapping_sub(q.next_avail()) > q.size() => {
            Some("the available index runs more than the queue size ahead of the device")
        }
        Ok(_) => None,
        Err(_) => Some("the available index is not readable"),
    }
}

/// Has the driver made chains available that we have not popped?
fn avail_pending(vring: &Vring, mem: &Mem) -> bool {
    let state = vring.get_ref();
    let q = state.get_queue();
    q.ready()
        && q.avail_idx(mem, Ordering::Acquire)
            .is_ok_and(|i| i.0 != q.next_avail())
}
