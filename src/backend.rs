//! vhost-user glue: features, protocol features, config space, and event dispatch to the
//! per-queue workers.

use std::fs::File;
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::worker::poll::Poller;

use log::{error, info};
use vhost::vhost_user::message::{
    VhostUserInflight, VhostUserProtocolFeatures, VhostUserVirtioFeatures,
};
use vhost_user_backend::{VhostUserBackend, VringRwLock};
use virtio_bindings::virtio_blk::*;
use virtio_bindings::virtio_config::{VIRTIO_F_IN_ORDER, VIRTIO_F_VERSION_1};
use virtio_bindings::virtio_ring::{VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC};
use vm_memory::GuestMemoryAtomic;
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::event::{
    new_event_consumer_and_notifier, EventConsumer, EventFlag, EventNotifier,
};

use crate::device::Device;
use crate::inflight::{InflightRegion, QueueInflight};
use crate::worker::QueueWorker;

use crate::guest_memory::Mem;
use crate::locks::Locked;

#[cfg(any(test, feature = "testing"))]
#[path = "backend_fuzz.rs"]
pub mod fuzz;

/// How long a migration's handover waits for the jobs to finish (a ready mirror's last
/// copy, a cancelled job's last step).
const HANDOVER_JOBS: std::time::Duration = std::time::Duration::from_secs(30);

/// Event id of a queue's engine completion eventfd. vhost-user-backend reserves
/// 0..=num_queues on every worker thread (queues, then the exit event).
pub fn completion_event_id(num_queues: u16) -> u64 {
    u64::from(num_queues) + 1
}

/// Register queue `i`'s new engine completion eventfd with that queue's event loop.
pub type ListenFn = Box<dyn Fn(usize, i32) -> io::Result<()> + Send + Sync>;

/// The vhost-user-blk backend for one connection.
pub struct VhostUserBlkBackend {
    dev: Arc<Device>,
    workers: Vec<Mutex<QueueWorker>>,
    /// Per queue: ask a busy-polling queue thread to let go of its worker.
    poll_abort: Vec<Arc<AtomicBool>>,
    acked_features: AtomicU64,
    /// How the queues' engines are made again when a job moves the guest to another kind
    /// of disk (a mirror onto an NBD export), and how their eventfds reach the event loops.
    engines: Mutex<Option<(crate::image::EngineChoice, ListenFn)>>,
}

impl crate::device::QueuePause for VhostUserBlkBackend {
    fn paused(&self, f: &mut dyn FnMut()) {
        // Every queue's worker, in queue order (nobody else holds two), busy-poll loops
        // told to let go first; then what each has launched completes.
        for a in &self.poll_abort {
            a.store(true, Ordering::Relaxed);
        }
        let mut held: Vec<MutexGuard<'_, QueueWorker>> = (0..self.workers.len())
            .filter_map(|i| self.worker(i))
            .collect();
        for w in &mut held {
            w.settle();
        }
        f();
        // `f` may have switched the image (a snapshot): each queue serves the new one, on
        // new engines if the new one is another kind of disk (a mirror onto an NBD export).
        let image = self.dev.image.get();
        if image.is_active() && held.iter().any(|w| !w.engine_fits(&image)) {
            self.new_engines(&image, &mut held);
        }
        for w in &mut held {
            w.follow_image();
        }
        drop(held);
        for a in &self.poll_abort {
            a.store(false, Ordering::Relaxed);
        }
    }
}

impl VhostUserBlkBackend {
    pub fn new(dev: Arc<Device>, workers: Vec<QueueWorker>, poll: Poller) -> Self {
        let poll_abort: Vec<Arc<AtomicBool>> = workers
            .iter()
            .map(|_| Arc::new(AtomicBool::new(false)))
            .collect();
        let workers = workers
            .into_iter()
            .zip(&poll_abort)
            .map(|(mut w, abort)| {
                w.set_polling(poll, abort.clone());
                Mutex::new(w)
            })
            .collect();
        // A new connection: logging is off until its frontend asks for it.
        dev.dirty_log.store(false, Ordering::Release);
        VhostUserBlkBackend {
            dev,
            workers,
            poll_abort,
            acked_features: AtomicU64::new(0),
            engines: Mutex::new(None),
        }
    }

    /// How to make the queues' engines again (see [`Self::new_engines`]).
    pub fn set_engine_maker(&self, choice: crate::image::EngineChoice, listen: ListenFn) {
        *self.engines.locked() = Some((choice, listen));
    }

    /// Give every (paused, settled) queue a new engine for `image`, registered with its
    /// event loop. If they cannot be made, each queue gets an engine bound to nothing, on
    /// which every request fails (IOERR): never one still aimed at the files of the image
    /// that was closed.
    fn new_engines(&self, image: &crate::image::Image, held: &mut [MutexGuard<'_, QueueWorker>]) {
        let maker = self.engines.locked();
        let made = match maker.as_ref() {
            Some((choice, _)) => image
                .queue_engines(held.len() as u16, *choice)
                .map_err(|e| e.to_string()),
            None => Err("this connection cannot make engines".into()),
        };
        let engines = match made {
            Ok(e) => e,
            Err(e) => {
                error!("the queues cannot reach the disk they were switched to: {e}; requests fail (IOERR)");
                (0..held.len())
                    .map(|_| crate::image::Engine::Sync(crate::io::SyncEngine::new()))
                    .collect()
            }
        };
        for (i, (w, e)) in held.iter_mut().zip(engines).enumerate() {
            let fd = e.event_fd();
            info!("queue {i}: I/O engine {} now", e.name());
            w.replace_engine(e);
            if let (Some(fd), Some((_, listen))) = (fd, maker.as_ref()) {
                if let Err(e) = listen(i, fd) {
                    error!("queue {i}: its new engine's completions go unseen: {e}");
                }
            }
        }
    }

    fn worker(&self, i: usize) -> Option<MutexGuard<'_, QueueWorker>> {
        // A poisoned worker means a bug already logged by the panic; keep serving others.
        self.workers.get(i).map(|w| w.locked())
    }

    /// Throttle timers to register with each queue's epoll loop.
    pub fn timer_fds(&self) -> Vec<Option<i32>> {
        (0..self.workers.len())
            .map(|i| self.worker(i).and_then(|w| w.timer_fd()))
            .collect()
    }

    /// Engine eventfds to register with each queue's epoll loop.
    pub fn engine_event_fds(&self) -> Vec<Option<i32>> {
        (0..self.workers.len())
            .map(|i| self.worker(i).and_then(|w| w.engine_event_fd()))
            .collect()
    }

    /// Finish every in-flight request on every queue.
    pub fn drain_all(&self) {
        for i in 0..self.workers.len() {
            self.drain_queue(i);
        }
    }

    /// Run `f` on queue `i`'s worker, ending a busy-poll loop that holds it first.
    fn with_worker<R>(&self, i: usize, f: impl FnOnce(&mut QueueWorker) -> R) -> Option<R> {
        let abort = self.poll_abort.get(i)?;
        abort.store(true, Ordering::Relaxed);
        let r = self.worker(i).map(|mut w| f(&mut w));
        abort.store(false, Ordering::Relaxed);
        r
    }

    /// A graceful stop: every queue stops taking requests and completes those in flight
    /// (their completions reach the guest before the connection closes).
    pub fn quiesce(&self) {
        for i in 0..self.workers.len() {
            self.with_worker(i, |w| w.quiesce());
        }
        if let Err(e) = self.dev.image.get().write_back() {
            error!(
                "writing back image metadata: {}",
                crate::logging::error_chain(&e)
            );
        }
    }

    /// Complete queue `i`'s in-flight requests.
    fn drain_queue(&self, i: usize) {
        self.with_worker(i, |w| w.drain());
        // The front end may be going away: leave the image's metadata complete on disk.
        if let Err(e) = self.dev.image.get().write_back() {
            error!(
                "queue {i}: writing back image metadata: {}",
                crate::logging::error_chain(&e)
            );
        }
    }

    pub fn log_stats(&self) {
        for i in 0..self.workers.len() {
            if let Some(w) = self.worker(i) {
                let s = w.stats;
                if s.requests > 0 {
                    info!(
                        "queue {i}: {} requests, {} errors, {} bounced, {} read-modify-writes, \
                         {} durable writes, {} flushes",
                        s.requests,
                        s.errors,
                        s.bounced,
                        s.read_modify_writes,
                        s.durable_writes,
                        s.flushes
                    );
                }
            }
        }
    }

    pub fn device_features(&self) -> u64 {
        let mut f = (1 << VIRTIO_F_VERSION_1)
            | (1 << VIRTIO_RING_F_EVENT_IDX)
            | (1 << VIRTIO_RING_F_INDIRECT_DESC)
            | (1 << VIRTIO_F_IN_ORDER)
            | (1 << VIRTIO_BLK_F_SIZE_MAX)
            | (1 << VIRTIO_BLK_F_SEG_MAX)
            | (1 << VIRTIO_BLK_F_BLK_SIZE)
            | (1 << VIRTIO_BLK_F_TOPOLOGY)
            | (1 << VIRTIO_BLK_F_FLUSH)
            | (1 << VIRTIO_BLK_F_CONFIG_WCE)
            | (1 << VIRTIO_BLK_F_MQ)
            | (1 << VIRTIO_BLK_F_DISCARD)
            | (1 << VIRTIO_BLK_F_WRITE_ZEROES)
            | VhostUserVirtioFeatures::LOG_ALL.bits()
            | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits();
        if self.dev.params.read_only {
            f |= 1 << VIRTIO_BLK_F_RO;
        }
        f
    }
}

impl VhostUserBackend for VhostUserBlkBackend {
    type Bitmap = vhost_user_backend::bitmap::BitmapMmapRegion;
    type Vring = VringRwLock<GuestMemoryAtomic<Mem>>;

    fn num_queues(&self) -> usize {
        self.workers.len()
    }

    fn max_queue_size(&self) -> usize {
        usize::from(self.dev.params.queue_size)
    }

    fn features(&self) -> u64 {
        self.device_features()
    }

    fn acked_features(&self, features: u64) {
        self.acked_features.store(features, Ordering::Relaxed);
        log::debug!("frontend acked features {features:#x}");
        // Each driver (firmware first, then the OS) negotiates anew: the write cache starts in
        // the mode the operator chose, except that a driver without FLUSH cannot make writes
        // durable, so it gets write-through (5.2.5.1).
        let flush = features & (1 << VIRTIO_BLK_F_FLUSH) != 0;
        self.dev.reset_writeback(flush);
        // VIRTIO_F_IN_ORDER: queues started from now on use buffers in the available order.
        let in_order = features & (1 << VIRTIO_F_IN_ORDER) != 0;
        if self.dev.in_order.swap(in_order, Ordering::AcqRel) != in_order {
            info!(
                "VIRTIO_F_IN_ORDER {}",
                if in_order {
                    "negotiated: buffers are used in the order they were made available"
                } else {
                    "not negotiated"
                }
            );
        }
        // VHOST_F_LOG_ALL: the frontend is migrating the guest and wants every page vublk
        // writes in its log, including those the kernel writes for us.
        let log = features & VhostUserVirtioFeatures::LOG_ALL.bits() != 0;
        if self.dev.dirty_log.swap(log, Ordering::AcqRel) != log {
            info!(
                "dirty-page logging {} (the frontend {} migrating the guest)",
                if log { "on" } else { "off" },
                if log { "is" } else { "stopped" }
            );
        }
    }

    fn protocol_features(&self) -> VhostUserProtocolFeatures {
        VhostUserProtocolFeatures::MQ
            | VhostUserProtocolFeatures::CONFIG
            | VhostUserProtocolFeatures::REPLY_ACK
            | VhostUserProtocolFeatures::CONFIGURE_MEM_SLOTS
            | VhostUserProtocolFeatures::INFLIGHT_SHMFD
            | VhostUserProtocolFeatures::LOG_SHMFD
            | VhostUserProtocolFeatures::BACKEND_REQ
    }

    /// SET_BACKEND_REQ_FD: the channel on which an online resize is announced
    /// (VHOST_USER_BACKEND_CONFIG_CHANGE_MSG).
    fn set_backend_req_fd(&self, backend: vhost::vhost_user::Backend) {
        self.dev.frontend_channel.locked().set(backend);
    }

    /// GET_INFLIGHT_FD: a new region for the frontend to keep (QEMU asks when it holds none:
    /// at its first start and after a guest reset).
    fn get_inflight_fd(&self, req: &VhostUserInflight) -> io::Result<(VhostUserInflight, File)> {
        let refuse = |e: String| {
            crate::log_limited!(log::Level::Error, "refused GET_INFLIGHT_FD: {e}");
            io::Error::new(io::ErrorKind::InvalidInput, e)
        };
        if usize::from(req.num_queues) > self.workers.len() {
            return Err(refuse(format!(
                "{} queues asked for, {} offered",
                req.num_queues,
                self.workers.len()
            )));
        }
        let (file, size) = InflightRegion::create(req.num_queues, req.queue_size)
            .map_err(|e| refuse(crate::logging::error_chain(&e)))?;
        log::debug!(
            "inflight region: {} queues of {} entries, {size} bytes",
            req.num_queues,
            req.queue_size
        );
        Ok((
            VhostUserInflight::new(size, 0, req.num_queues, req.queue_size),
            file,
        ))
    }

    /// SET_INFLIGHT_FD: track requests in this region from now on; at each queue's start,
    /// resubmit what a previous process left marked in it.
    fn set_inflight_fd(&self, msg: &VhostUserInflight, file: File) -> io::Result<()> {
        let refuse = |e: String| {
            crate::log_limited!(log::Level::Error, "refused SET_INFLIGHT_FD: {e}");
            io::Error::new(io::ErrorKind::InvalidInput, e)
        };
        let region = InflightRegion::map(
            &file,
            msg.mmap_size,
            msg.mmap_offset,
            msg.num_queues,
            msg.queue_size,
        )
        .map_err(|e| refuse(crate::logging::error_chain(&e)))?;
        // Each queue's tracker holds the region: it is unmapped when the last goes.
        let region = Arc::new(region);
        if (0..self.workers.len()).any(|i| self.with_worker(i, |w| w.started()) == Some(true)) {
            return Err(refuse("the queues are running".into()));
        }
        info!(
            "inflight tracking: {} queues of {} entries (requests in flight survive a \
             restart of vublk)",
            msg.num_queues, msg.queue_size
        );
        for i in 0..self.workers.len() {
            let t = QueueInflight::new(&region, i as u16);
            if let Some(Err(e)) = self.with_worker(i, |w| w.set_inflight(t)) {
                return Err(refuse(e.into()));
            }
        }
        Ok(())
    }

    fn set_event_idx(&self, _enabled: bool) {}

    /// SET_VRING_ADDR with VHOST_VRING_F_LOG: the used ring's writes are logged at this
    /// guest address too (the frontend's own idea of where the used ring is).
    fn set_vring_log(&self, queue_index: u32, log_guest_addr: Option<u64>) -> io::Result<()> {
        self.with_worker(queue_index as usize, |w| w.set_used_log(log_guest_addr));
        Ok(())
    }

    fn get_config(&self, offset: u32, size: u32) -> Vec<u8> {
        self.dev.read_config(offset, size)
    }

    fn set_config(&self, offset: u32, buf: &[u8]) -> io::Result<()> {
        log::debug!("SET_CONFIG offset {offset} {buf:?}");
        self.dev
            .write_config(offset, buf)
            .map_err(|m| io::Error::new(io::ErrorKind::InvalidInput, m))
    }

    /// Called by the (patched) handler before a new table is installed: a table whose
    /// regions lie beyond their files, or with too many regions, is refused.
    fn check_memory(&self, mem: &Mem) -> io::Result<()> {
        crate::guest_memory::check(mem).map_err(|e| {
            crate::log_limited!(
                log::Level::Error,
                "refused the frontend's memory table: {e}"
            );
            io::Error::new(io::ErrorKind::InvalidInput, e)
        })
    }

    fn update_memory(&self, mem: GuestMemoryAtomic<Mem>) -> io::Result<()> {
        for i in 0..self.workers.len() {
            if let Some(mut w) = self.worker(i) {
                w.set_memory(mem.clone());
            }
        }
        Ok(())
    }

    /// One thread per queue: queue i is handled by thread i.
    fn queues_per_thread(&self) -> Vec<u64> {
        (0..self.workers.len()).map(|i| 1u64 << i).collect()
    }

    fn exit_event(&self, _thread_index: usize) -> Option<(EventConsumer, EventNotifier)> {
        new_event_consumer_and_notifier(EventFlag::NONBLOCK).ok()
    }

    /// GET_VRING_BASE (and SET_VRING_ENABLE 0): answer only after the queue's in-flight
    /// requests have completed. While the frontend logs dirty pages it is migrating the
    /// guest, and the stop of its last running queue is the switch-over: the image is
    /// handed over to the destination's vublk (`image::handover`) before the reply, with
    /// every queue drained. Stopping one queue while others run hands nothing over: those
    /// queues go on serving (a kick on them must not be lost), and the device is handed
    /// over when the last of them stops (QEMU disables, then stops, every queue).
    fn stop_vring(&self, queue_index: u32) -> io::Result<()> {
        let i = queue_index as usize;
        if !self.dev.dirty_log.load(Ordering::Acquire) {
            self.drain_queue(i);
            return Ok(());
        }
        let others_running = (0..self.workers.len())
            .filter(|&j| j != i)
            .any(|j| self.with_worker(j, |w| w.running()) == Some(true));
        if others_running {
            log::debug!("queue {i} stopped while logging; other queues run: no handover yet");
            self.drain_queue(i);
            return Ok(());
        }
        let drain = || {
            for j in 0..self.workers.len() {
                self.with_worker(j, |w| w.drain());
            }
            // A mirror to the destination's disk (a migration without shared storage)
            // copies the rest now; other jobs stop.
            self.dev.jobs.before_handover(HANDOVER_JOBS);
        };
        match self.dev.image.hand_over(drain) {
            Ok(true) => {}
            // Handed over at an earlier queue's stop (or never taken): this one has drained.
            Ok(false) => self.drain_queue(i),
            Err(e) => error!(
                "handing the image over: {} (nothing more is written here)",
                crate::logging::error_chain(&e)
            ),
        }
        Ok(())
    }

    fn reset_device(&self) {
        self.drain_all();
    }

    fn handle_event(
        &self,
        device_event: u16,
        evset: EventSet,
        vrings: &[Self::Vring],
        thread_id: usize,
    ) -> io::Result<()> {
        if evset != EventSet::IN {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "unexpected event set",
            ));
        }
        let Some(mut w) = self.worker(thread_id) else {
            return Ok(());
        };
        w.on_queue_thread();
        let completion = completion_event_id(self.workers.len() as u16);
        if u64::from(device_event) == completion {
            w.handle_completions();
        } else if u64::from(device_event) == completion + 1 {
            w.handle_timer();
        } else if let Some(vring) = vrings.get(usize::from(device_event)) {
            w.handle_kick(vring);
        }
        Ok(())
    }
}
