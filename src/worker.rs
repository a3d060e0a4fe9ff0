//! Per-queue data plane: pop chains, parse, submit to the queue's engine, reap completions,
//! write status, add to the used ring, and signal the guest as EVENT_IDX allows.
//!
//! Each queue has its own thread (the vhost-user-backend epoll loop) and its own worker; the
//! only shared state is the read-only [`Device`].

use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use log::{debug, error, warn};
use vhost_user_backend::{VringRwLock, VringT};
use virtio_queue::QueueT;
use vm_memory::{Bytes, GuestAddressSpace, GuestMemoryAtomic, GuestMemoryBackend, GuestMemoryMmap};

use crate::device::Device;
use crate::image::chain::{resolve_read, Piece};
use crate::image::qcow2::{Extent, ZeroMode};
use crate::io::align::iovecs_aligned;
use crate::io::bounce::{AlignedBuf, BouncePool};
use crate::io::ranges::Holder;
use crate::io::{Completion, Engine, Op};
use crate::offload::Inbox;
use crate::virtio_blk::{parse_request, status, Desc, Range, Request, RequestError, RequestType};
use crate::zero::DetectZeroes;

type Mem = GuestMemoryMmap<()>;

/// What an engine operation was, packed into io_uring user_data with the slot index.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[repr(u8)]
enum OpKind {
    Read = 1,
    Write = 2,
    Flush = 3,
    Discard = 4,
    ZeroRange = 5,
    PunchZero = 6,
    /// One extent of a qcow2 read, into the bounce buffer; `range` is its iovec index.
    ReadPart = 7,
    /// A write done on the compression pool (result 0 or a negative errno).
    Offload = 8,
}

impl OpKind {
    fn from_u8(v: u8) -> Option<Self> {
        Some(match v {
            1 => OpKind::Read,
            2 => OpKind::Write,
            3 => OpKind::Flush,
            4 => OpKind::Discard,
            5 => OpKind::ZeroRange,
            6 => OpKind::PunchZero,
            7 => OpKind::ReadPart,
            8 => OpKind::Offload,
            _ => return None,
        })
    }
}

fn user_data(slot: u16, kind: OpKind, range: u32) -> u64 {
    u64::from(slot) | (u64::from(kind as u8) << 16) | (u64::from(range) << 32)
}

fn decode(ud: u64) -> (u16, Option<OpKind>, u32) {
    (
        ud as u16,
        OpKind::from_u8((ud >> 16) as u8),
        (ud >> 32) as u32,
    )
}

/// One request in flight. Owns everything the kernel may reference until completion.
struct Slot {
    head: u16,
    req: Request,
    /// Keeps guest memory mapped while the kernel uses it, even if the frontend removes the
    /// region meanwhile.
    mem: Option<Arc<Mem>>,
    iov: Vec<libc::iovec>,
    bounce: Option<AlignedBuf>,
    /// Where the request's data starts inside `bounce` (sub-block reads read whole blocks).
    bounce_skip: usize,
    /// Key of the write range this request holds (see `io::ranges`).
    range_key: Option<u64>,
    /// qcow2: the fill (whole-cluster first write of fresh clusters) this request does, or
    /// the shared range its in-place write holds while fills are in flight: (key, is_fill).
    fill_key: Option<(u64, bool)>,
    /// qcow2: new clusters whose L2 entries are installed when this write completes.
    cow_install: Option<crate::image::qcow2::CowInstall>,
    /// Write-through: make the request's zeroing durable (fdatasync) before completing it.
    sync_after: bool,
    pending: u32,
    status: u8,
    /// Bytes written into device-writable buffers, status byte included.
    used_len: u32,
    expect_bytes: u64,
}

// SAFETY: the raw pointers in `iov` point into guest memory kept alive by `mem`, or into
// `bounce`; the slot is only used by the queue's own thread (behind the worker's mutex).
unsafe impl Send for Slot {}

impl Slot {
    fn new() -> Self {
        Slot {
            head: 0,
            req: Request::default(),
            mem: None,
            iov: Vec::new(),
            bounce: None,
            bounce_skip: 0,
            range_key: None,
            fill_key: None,
            cow_install: None,
            sync_after: false,
            pending: 0,
            status: status::OK,
            used_len: 0,
            expect_bytes: 0,
        }
    }
}

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
    engine: Engine,
    mem: GuestMemoryAtomic<Mem>,
    slots: Vec<Slot>,
    free: Vec<u16>,
    vring: Option<VringRwLock<GuestMemoryAtomic<Mem>>>,
    completions: Vec<Completion>,
    /// Requests finished while the vring was not at hand: (head, used_len) to add.
    deferred_used: Vec<(u16, u32)>,
    /// Scratch for qcow2 mappings, resolved pieces, and the host offsets and files of their
    /// data pieces.
    extents: Vec<Extent>,
    pieces: Vec<Piece>,
    extent_offsets: Vec<u64>,
    extent_fds: Vec<i32>,
    /// We stopped popping because every slot is in use; resume on the next completion.
    stalled: bool,
    bounce: BouncePool,
    pub stats: QueueStats,
    /// Busy-poll the avail ring and the completion ring this long after the last work
    /// before sleeping again (0: never poll).
    poll: Duration,
    /// Set by another thread (queue stop) to end a poll loop early.
    poll_abort: Arc<AtomicBool>,
    /// Where the compression pool reports this queue's writes (None: no pool, or an engine
    /// without an eventfd: compress on this thread).
    inbox: Option<Arc<Inbox>>,
    /// Requests on the compression pool.
    offloaded: usize,
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
        engine.register_file(dev.file.as_raw_fd());
        let pools = dev.compress_pool.is_some() || dev.cow_pool.is_some();
        let inbox = match (pools, engine.event_fd()) {
            (true, Some(fd)) => Inbox::new(fd)
                .map_err(|e| warn!("queue {index}: format writes on the queue thread ({e})"))
                .ok(),
            _ => None,
        };
        QueueWorker {
            inbox,
            offloaded: 0,
            poll: Duration::ZERO,
            poll_abort: Arc::new(AtomicBool::new(false)),
            index,
            dev,
            engine,
            mem,
            slots: (0..n).map(|_| Slot::new()).collect(),
            free: (0..n as u16).rev().collect(),
            vring: None,
            completions: Vec::with_capacity(n),
            deferred_used: Vec::with_capacity(n),
            extents: Vec::new(),
            pieces: Vec::new(),
            extent_offsets: Vec::new(),
            extent_fds: Vec::new(),
            stalled: false,
            bounce,
            stats: QueueStats::default(),
        }
    }

    /// Enable bounded busy-polling; `abort` ends a poll loop from another thread.
    pub fn set_polling(&mut self, poll: Duration, abort: Arc<AtomicBool>) {
        self.poll = poll;
        self.poll_abort = abort;
    }

    pub fn engine_event_fd(&self) -> Option<i32> {
        self.engine.event_fd()
    }

    pub fn in_flight(&self) -> usize {
        self.slots.len() - self.free.len()
    }

    pub fn set_memory(&mut self, mem: GuestMemoryAtomic<Mem>) {
        self.mem = mem;
    }

    /// The guest kicked: process every available chain.
    pub fn handle_kick(&mut self, vring: &VringRwLock<GuestMemoryAtomic<Mem>>) {
        if self.vring.is_none() {
            self.vring = Some(vring.clone());
        }
        self.process_queue(vring, true);
        self.poll_for_work(vring);
    }

    /// The engine's eventfd fired: reap and complete.
    pub fn handle_completions(&mut self) {
        let Some(vring) = self.vring.clone() else {
            return;
        };
        // The eventfd is watched edge-triggered: no need to read (clear) it.
        self.reap_and_complete(&vring);
        if self.stalled {
            self.process_queue(&vring, true);
        }
        self.poll_for_work(&vring);
    }

    /// Busy-poll for new requests and completions, with guest kicks and completion signals
    /// off, until `poll` has passed without work. Saves the guest's kick and our wake-ups
    /// at low queue depth, at the price of CPU time while polling.
    fn poll_for_work(&mut self, vring: &VringRwLock<GuestMemoryAtomic<Mem>>) {
        if self.poll.is_zero() {
            return;
        }
        let mem = self.mem.memory().into_inner();
        self.engine.set_event_enabled(false);
        if let Err(e) = vring.get_mut().disable_notification() {
            warn!("queue {}: disable notification: {e}", self.index);
        }
        let mut last_work = Instant::now();
        while !self.poll_abort.load(Ordering::Relaxed) {
            let mut worked = false;
            if self.engine.has_completions() || self.inbox_ready() {
                self.reap_and_complete(vring);
                worked = true;
            }
            if !self.free.is_empty() && avail_pending(vring, &mem) {
                self.process_queue(vring, false);
                worked = true;
            }
            if worked {
                last_work = Instant::now();
            } else if last_work.elapsed() >= self.poll {
                break;
            } else {
                std::hint::spin_loop();
            }
        }
        // Back to sleeping: signals on, then pick up whatever raced with re-arming (the
        // eventfd did not fire for completions that landed while it was off).
        self.engine.set_event_enabled(true);
        self.process_queue(vring, true);
        self.reap_and_complete(vring);
    }

    /// Wait for every in-flight request and complete it (queue stop, disconnect, shutdown).
    pub fn drain(&mut self) {
        let Some(vring) = self.vring.clone() else {
            return;
        };
        loop {
            // Completions already known (including synthetic ones) first: waiting with
            // nothing in the kernel would block for ever.
            self.reap_and_complete(&vring);
            if self.in_flight() == 0 {
                break;
            }
            if self.offloaded > 0 {
                // The pool reports through the inbox, not the ring.
                if let Some(inbox) = &self.inbox {
                    inbox.wait(Duration::from_millis(5));
                }
                continue;
            }
            if let Err(e) = self.engine.wait_one() {
                error!(
                    "queue {}: waiting for in-flight requests failed: {e}",
                    self.index
                );
                break;
            }
        }
        self.stalled = false;
    }

    /// Pop and start every available chain. With `rearm`, guest notifications are enabled
    /// again at the end (closing the race with EVENT_IDX); while polling they stay off.
    fn process_queue(&mut self, vring: &VringRwLock<GuestMemoryAtomic<Mem>>, rearm: bool) {
        let mem = self.mem.memory().into_inner();
        let mut state = vring.get_mut();
        loop {
            if let Err(e) = state.disable_notification() {
                warn!("queue {}: disable notification: {e}", self.index);
            }
            loop {
                if self.free.is_empty() {
                    self.stalled = true;
                    break;
                }
                let Some(chain) = state.get_queue_mut().pop_descriptor_chain(&*mem) else {
                    break;
                };
                let head = chain.head_index();
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
            if self.stalled || !rearm {
                break;
            }
            match state.enable_notification() {
                Ok(true) => continue,
                Ok(false) => break,
                Err(e) => {
                    warn!("queue {}: enable notification: {e}", self.index);
                    break;
                }
            }
        }
        if let Err(e) = self.engine.submit() {
            error!("queue {}: submit: {e}", self.index);
        }
        let completed = !self.deferred_used.is_empty();
        for (head, used) in self.deferred_used.drain(..) {
            if let Err(e) = state.add_used(head, used) {
                warn!("queue {}: add_used: {e}", self.index);
            }
        }
        drop(state);
        if completed {
            self.signal(vring);
        }
        // The blocking engine has finished already; complete without waiting for an event.
        self.reap_and_complete(vring);
    }

    /// Parse and submit one chain. Returns Some(used_len) when it completed immediately.
    fn start_request(
        &mut self,
        head: u16,
        descs: impl Iterator<Item = Desc>,
        mem: &Arc<Mem>,
    ) -> Option<u32> {
        self.stats.requests += 1;
        let idx = self.free.pop()?;
        let slot = &mut self.slots[usize::from(idx)];
        slot.head = head;
        slot.pending = 0;
        slot.status = status::OK;
        slot.used_len = 1;
        slot.expect_bytes = 0;
        slot.bounce_skip = 0;
        slot.range_key = None;
        slot.fill_key = None;
        slot.cow_install = None;
        slot.sync_after = false;
        slot.iov.clear();
        if let Err(e) = parse_request(&**mem, descs, &self.dev.limits, &mut slot.req) {
            self.stats.errors += 1;
            debug!("queue {}: request {head} refused: {e}", self.index);
            let used = match e {
                RequestError::NoStatus => 0,
                _ => {
                    let _ = mem.write_obj(e.status(), slot.req.status_addr);
                    1
                }
            };
            self.free.push(idx);
            return Some(used);
        }
        slot.mem = Some(mem.clone());
        match self.submit_request(idx) {
            Ok(true) => None,
            Ok(false) => {
                // Nothing to submit: complete now.
                Some(self.finish(idx))
            }
            Err(e) => {
                error!("queue {}: submitting request failed: {e}", self.index);
                let slot = &mut self.slots[usize::from(idx)];
                slot.status = status::IOERR;
                if slot.pending == 0 {
                    Some(self.finish(idx))
                } else {
                    None
                }
            }
        }
    }

    /// Push the request's operations. Ok(false) when there is nothing to wait for.
    fn submit_request(&mut self, idx: u16) -> std::io::Result<bool> {
        let fd = self.dev.file.as_raw_fd();
        let writeback = self.dev.writeback();
        let slot = &mut self.slots[usize::from(idx)];
        let Some(mem) = slot.mem.clone() else {
            return Ok(false);
        };
        match slot.req.kind {
            RequestType::In | RequestType::Out => self.submit_rw(idx, mem),
            RequestType::Flush => {
                self.stats.flushes += 1;
                if !writeback {
                    // Write-through: every completed write is already durable.
                    return Ok(false);
                }
                if let Some(q) = self.dev.qcow2.as_ref() {
                    // Metadata first (in dependency order); the sync below makes it durable.
                    if let Err(e) = q.flush(&self.dev.file) {
                        error!("queue {}: qcow2 metadata write-back: {e}", self.index);
                        slot.status = status::IOERR;
                        return Ok(false);
                    }
                }
                if let Some(p) = self.dev.parallels.as_ref() {
                    // The BAT of every completed allocation; the sync below makes it durable.
                    if let Err(e) = p.flush(&self.dev.file) {
                        error!("queue {}: parallels BAT write-back: {e}", self.index);
                        slot.status = status::IOERR;
                        return Ok(false);
                    }
                }
                slot.pending = 1;
                // SAFETY: no buffers.
                unsafe {
                    self.engine
                        .push(fd, &Op::Fdatasync, user_data(idx, OpKind::Flush, 0))?
                };
                Ok(true)
            }
            RequestType::GetId => {
                let id = self.dev.id_bytes();
                let mut done = 0usize;
                for seg in &slot.req.data {
                    if done == id.len() {
                        break;
                    }
                    let n = (seg.len as usize).min(id.len() - done);
                    if mem.write_slice(&id[done..done + n], seg.addr).is_err() {
                        slot.status = status::IOERR;
                        break;
                    }
                    done += n;
                }
                slot.used_len = done as u32 + 1;
                Ok(false)
            }
            RequestType::Discard | RequestType::WriteZeroes => self.submit_zero_ranges(idx),
        }
    }

    /// DISCARD, WRITE_ZEROES and detected zero writes: one fallocate per range. Deallocation
    /// only where the operator allowed it (`--discard unmap`).
    fn submit_zero_ranges(&mut self, idx: u16) -> std::io::Result<bool> {
        let fd = self.dev.file.as_raw_fd();
        let discard_unmap = self.dev.params.discard_unmap;
        let discard = self.slots[usize::from(idx)].req.kind == RequestType::Discard;
        if discard && !discard_unmap {
            // --discard ignore: DISCARD is a hint the device may ignore (5.2.6.2).
            return Ok(false);
        }
        if self.dev.qcow2.is_some() {
            self.qcow2_zero_ranges(idx, discard, discard_unmap);
            return Ok(false);
        }
        if self.dev.parallels.is_some() {
            self.parallels_zero_ranges(idx, discard, discard_unmap);
            return Ok(false);
        }
        if self.dev.write_ranges.is_some() {
            let r = &self.slots[usize::from(idx)].req.ranges;
            let lo = r.iter().map(|r| r.offset_bytes).min().unwrap_or(0);
            let hi = r
                .iter()
                .map(|r| r.offset_bytes + r.len_bytes)
                .max()
                .unwrap_or(0);
            let key = self.acquire_range(lo, hi, Holder::Write);
            self.slots[usize::from(idx)].range_key = key;
        }
        let no_zero_range = self.dev.no_zero_range.load(Ordering::Relaxed);
        let slot = &mut self.slots[usize::from(idx)];
        // Write-through: zeroed blocks must be durable when the request completes.
        slot.sync_after = !discard && !self.dev.writeback();
        for (i, r) in slot.req.ranges.iter().enumerate() {
            let punch = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
            let (mode, kind) = if discard && self.dev.params.is_block_device {
                // A real discard (BLKDISCARD); synchronous: io_uring has no portable opcode.
                slot.pending += 1;
                self.completions.push(Completion {
                    user_data: user_data(idx, OpKind::Discard, i as u32),
                    result: blk_discard(fd, r.offset_bytes, r.len_bytes),
                });
                continue;
            } else if discard {
                (punch, OpKind::Discard)
            } else if r.unmap && discard_unmap {
                (punch, OpKind::PunchZero)
            } else if no_zero_range {
                // Known unsupported: go straight to the fallback at completion.
                slot.pending += 1;
                self.completions.push(Completion {
                    user_data: user_data(idx, OpKind::ZeroRange, i as u32),
                    result: -libc::EOPNOTSUPP,
                });
                continue;
            } else {
                (
                    libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE,
                    OpKind::ZeroRange,
                )
            };
            let op = Op::Fallocate {
                mode,
                offset: r.offset_bytes,
                len: r.len_bytes,
            };
            slot.pending += 1;
            // SAFETY: no buffers.
            unsafe { self.engine.push(fd, &op, user_data(idx, kind, i as u32))? };
        }
        Ok(slot.pending > 0)
    }

    /// Would this write (at offset 0) start the image with a format magic?
    fn plants_format_header(&self, idx: u16, mem: &Mem) -> bool {
        use crate::image::parallels::{MAGIC_EXT, MAGIC_OLD};
        let mut magic = [0u8; 16];
        let data = &self.slots[usize::from(idx)].req.data;
        copy_from_guest_prefix(mem, data, &mut magic[..4])
            && magic[..4] == crate::image::qcow2::MAGIC
            || copy_from_guest_prefix(mem, data, &mut magic)
                && (magic == *MAGIC_OLD || magic == *MAGIC_EXT)
    }

    /// detect-zeroes: is the whole write all zero? Reads guest memory in place.
    fn write_is_zero(&self, idx: u16, mem: &Mem) -> bool {
        let slot = &self.slots[usize::from(idx)];
        slot.req.data.iter().all(|seg| {
            mem.get_slices(seg.addr, seg.len as usize)
                .all(|vs| match vs {
                    // SAFETY: the slice is mapped guest memory of vs.len() bytes, kept mapped by
                    // the slot's memory snapshot for the duration of the call.
                    Ok(vs) => unsafe {
                        crate::zero::is_zero_raw(vs.ptr_guard().as_ptr(), vs.len())
                    },
                    Err(_) => false,
                })
        })
    }

    /// Read or write: zero-copy iovecs into guest memory, bounced where O_DIRECT needs it,
    /// read-modify-written where the guest block is smaller than the file's.
    fn submit_rw(&mut self, idx: u16, mem: Arc<Mem>) -> std::io::Result<bool> {
        let fd = self.dev.file.as_raw_fd();
        let direct = self.dev.direct();
        let align = self.dev.params.align;
        let writeback = self.dev.writeback();
        let (is_read, offset, len) = {
            let slot = &mut self.slots[usize::from(idx)];
            let is_read = slot.req.kind == RequestType::In;
            slot.used_len = if is_read {
                slot.req.data_len as u32 + 1
            } else {
                1
            };
            slot.expect_bytes = slot.req.data_len;
            (is_read, slot.req.offset_bytes(), slot.req.data_len)
        };
        if len == 0 {
            return Ok(false);
        }
        if !is_read
            && offset == 0
            && self.dev.params.probed_raw
            && self.plants_format_header(idx, &mem)
        {
            warn!(
                "queue {}: refused a guest write that would make this probed raw image look \
                 like qcow2 (use --format raw to allow it)",
                self.index
            );
            self.slots[usize::from(idx)].status = status::IOERR;
            return Ok(false);
        }
        if !is_read
            && self.dev.params.detect_zeroes != DetectZeroes::Off
            && self.write_is_zero(idx, &mem)
        {
            // Only whole-request zero writes are converted (partial ones go out as written).
            let unmap = self.dev.params.detect_zeroes == DetectZeroes::Unmap;
            let zs = &self.dev.zero_stats;
            zs.zero_writes.fetch_add(1, Ordering::Relaxed);
            zs.zero_write_bytes.fetch_add(len, Ordering::Relaxed);
            let slot = &mut self.slots[usize::from(idx)];
            slot.req.ranges.clear();
            slot.req.ranges.push(Range {
                offset_bytes: offset,
                len_bytes: len,
                unmap,
            });
            return self.submit_zero_ranges(idx);
        }
        let mut write_offset = offset;
        // First write into fresh qcow2 clusters: written whole (zeroes around the data), so
        // that the writes filling them in later are plain overwrites for the filesystem.
        let mut whole_clusters = None;
        let mut in_place = false;
        if let (false, Some(q)) = (is_read, self.dev.qcow2.as_ref()) {
            if q.compress_writes() {
                // Compressed clusters are built, packed and written by the format, on the
                // compression pool when there is one.
                return Ok(self.offload_qcow2_write(idx, &mem, true));
            }
            // Clusters owned alone and contiguous: write in place through the ring, like raw.
            // Anything else needs allocation: the synchronous metadata path.
            // Fresh clusters whose old contents are zeroes: allocated here, written through
            // the ring (write-back mode only: write-through needs the metadata synced too).
            let planned = match q.owned_extent(&self.dev.file, offset, len) {
                Ok(None) if writeback => q
                    .plan_fresh_write(&self.dev.file, offset, len, !self.dev.backing.is_empty())
                    .map(|fw| {
                        fw.map(|fw| {
                            if let Some(f) = fw.fill {
                                whole_clusters = Some((f.start, f.len));
                                self.slots[usize::from(idx)].fill_key = Some((f.key, true));
                            }
                            self.slots[usize::from(idx)].cow_install = fw.install;
                            fw.host
                        })
                    }),
                Ok(Some(host)) => {
                    in_place = true;
                    Ok(Some(host))
                }
                other => other,
            };
            match planned {
                Ok(Some(host)) => write_offset = host,
                Ok(None) => return Ok(self.offload_qcow2_write(idx, &mem, false)),
                Err(e) => {
                    error!("queue {}: qcow2 write at {offset}: {e}", self.index);
                    self.slots[usize::from(idx)].status = status::IOERR;
                    return Ok(false);
                }
            }
        }
        if let (false, Some(p)) = (is_read, self.dev.parallels.as_ref()) {
            // Allocated and contiguous: in place through the ring. Else allocate here (the
            // new clusters read as zeroes, so no fill is needed) and write through the ring;
            // write-through mode and scattered clusters take the synchronous path, which
            // also makes a new allocation durable.
            let planned = match p.owned_extent(offset, len) {
                Some(host) => Ok(Some(host)),
                None if writeback => p.allocate(&self.dev.file, offset, len),
                None => Ok(None),
            };
            match planned {
                Ok(Some(host)) => write_offset = host,
                Ok(None) => {
                    self.parallels_write(idx, &mem);
                    return Ok(false);
                }
                Err(e) => {
                    error!("queue {}: parallels write at {offset}: {e}", self.index);
                    self.slots[usize::from(idx)].status = status::IOERR;
                    return Ok(false);
                }
            }
        }
        let file_offset = if is_read {
            match self.plan_read(idx, &mem, offset, len) {
                Ok(o) => o,
                Err(done) => return done,
            }
        } else {
            write_offset
        };
        let block = align.offset as u64;
        let sub_block = direct && (file_offset % block != 0 || len % block != 0);
        if sub_block && !is_read && whole_clusters.is_none() {
            if self.dev.qcow2.is_some() {
                // The read-modify-write path works on raw offsets; qcow2 goes the format's
                // way (it writes through aligned buffers).
                return Ok(self.offload_qcow2_write(idx, &mem, false));
            } else if self.dev.parallels.is_some() {
                self.parallels_write(idx, &mem);
            } else {
                self.read_modify_write(idx, &mem);
            }
            return Ok(false);
        }
        if !is_read && self.dev.write_ranges.is_some() {
            let key = self.acquire_range(file_offset, file_offset + len, Holder::Write);
            self.slots[usize::from(idx)].range_key = key;
        }
        if in_place {
            // A fill of these clusters may be in flight (its L2 entries are visible before
            // its write lands): never let its zeroes land over this write.
            let fills = self
                .dev
                .qcow2
                .as_ref()
                .is_some_and(|q| q.fills_in_flight.load(Ordering::SeqCst) > 0);
            if fills {
                if let Some(key) = self.acquire_fill_range(file_offset, file_offset + len) {
                    self.slots[usize::from(idx)].fill_key = Some((key, false));
                }
            }
        }
        let slot = &mut self.slots[usize::from(idx)];
        for seg in &slot.req.data {
            for vs in mem.get_slices(seg.addr, seg.len as usize) {
                let vs = vs.map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
                slot.iov.push(libc::iovec {
                    iov_base: vs.ptr_guard_mut().as_ptr().cast(),
                    iov_len: vs.len(),
                });
            }
        }
        let mut io_offset = file_offset;
        if let Some((start, span)) = whole_clusters {
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
            slot.iov.clear();
            slot.iov.push(libc::iovec {
                iov_base: buf.as_mut_ptr().cast(),
                iov_len: span,
            });
            slot.bounce = Some(buf);
            slot.bounce_skip = at;
            slot.expect_bytes = span as u64;
            io_offset = start;
        } else if direct && (sub_block || !iovecs_aligned(&slot.iov, file_offset, align)) {
            self.stats.bounced += 1;
            // Sub-block reads read the whole file blocks around the request.
            let (start, end) = block_span(file_offset, len, block);
            if self.dev.qcow2.is_none()
                && self.dev.parallels.is_none()
                && end > self.dev.params.size_bytes
            {
                error!("queue {}: read of {len} bytes at {offset} needs file blocks past the end of the image", self.index);
                slot.status = status::IOERR;
                return Ok(false);
            }
            let span = (end - start) as usize;
            let mut buf = self.bounce.get(span)?;
            if !is_read {
                copy_from_guest(&mem, &slot.req.data, &mut buf.as_mut_slice()[..span])?;
            }
            slot.iov.clear();
            slot.iov.push(libc::iovec {
                iov_base: buf.as_mut_ptr().cast(),
                iov_len: span,
            });
            slot.bounce = Some(buf);
            slot.bounce_skip = (file_offset - start) as usize;
            slot.expect_bytes = span as u64;
            io_offset = start;
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
        slot.pending = 1;
        // SAFETY: the iovecs point into guest memory kept mapped by slot.mem or into
        // slot.bounce; the slot is not reused until this completion is reaped.
        unsafe { self.engine.push(fd, &op, user_data(idx, kind, 0))? };
        Ok(true)
    }

    /// Where a read goes in the file. Raw: where it is. qcow2: the host offset when the
    /// request maps to one data extent of the image itself (then it is zero-copy like raw);
    /// otherwise the request is planned piece by piece through the backing chain here and
    /// `Err` carries the submission result.
    fn plan_read(
        &mut self,
        idx: u16,
        mem: &Arc<Mem>,
        offset: u64,
        len: u64,
    ) -> Result<u64, std::io::Result<bool>> {
        let dev = self.dev.clone();
        if let Some(p) = dev.parallels.as_ref() {
            let mut pieces = std::mem::take(&mut self.pieces);
            p.map(offset, len, &mut pieces);
            let r = match pieces.as_slice() {
                [Piece::Data { host_offset, .. }] => Ok(*host_offset),
                _ => Err(self.submit_pieces(idx, mem, &dev, &pieces)),
            };
            self.pieces = pieces;
            return r;
        }
        let Some(q) = dev.qcow2.as_ref() else {
            return Ok(offset);
        };
        let mut scratch = std::mem::take(&mut self.extents);
        let mut pieces = std::mem::take(&mut self.pieces);
        let planned = resolve_read(
            q,
            &dev.file,
            &dev.backing,
            offset,
            len,
            &mut scratch,
            &mut pieces,
        );
        let r = match planned {
            Err(e) => {
                error!("queue {}: qcow2 read at {offset}: {e}", self.index);
                self.slots[usize::from(idx)].status = status::IOERR;
                Err(Ok(false))
            }
            Ok(()) => match pieces.as_slice() {
                [Piece::Data {
                    layer: 0,
                    host_offset,
                    ..
                }] => Ok(*host_offset),
                _ => Err(self.submit_pieces(idx, mem, &dev, &pieces)),
            },
        };
        self.extents = scratch;
        self.pieces = pieces;
        r
    }

    /// A qcow2 read spanning several pieces: data pieces (of the image or of a backing file)
    /// are read into one bounce buffer, zero pieces are zero-filled and compressed ones
    /// decompressed into it; `finish` copies the buffer to the guest.
    fn submit_pieces(
        &mut self,
        idx: u16,
        _mem: &Arc<Mem>,
        dev: &Device,
        pieces: &[Piece],
    ) -> std::io::Result<bool> {
        let len = self.slots[usize::from(idx)].req.data_len as usize;
        if pieces.iter().map(|p| p.len()).sum::<u64>() != len as u64 {
            // Never index the buffer with a plan that does not cover the request exactly.
            error!(
                "queue {}: qcow2 plan does not cover the request",
                self.index
            );
            self.slots[usize::from(idx)].status = status::IOERR;
            return Ok(false);
        }
        let mut buf = self.bounce.get(len)?;
        self.extent_offsets.clear();
        self.extent_fds.clear();
        let slot = &mut self.slots[usize::from(idx)];
        slot.iov.clear();
        slot.iov.reserve(pieces.len());
        let base = buf.as_mut_ptr();
        let mut cluster_buf: Vec<u8> = Vec::new();
        let mut pos = 0usize;
        for piece in pieces {
            let n = piece.len() as usize;
            match *piece {
                Piece::Data {
                    layer, host_offset, ..
                } => {
                    let Some((file, _)) = dev.layer(layer) else {
                        slot.status = status::IOERR;
                        break;
                    };
                    slot.iov.push(libc::iovec {
                        // SAFETY: pos + n <= len <= the buffer's length.
                        iov_base: unsafe { base.add(pos) }.cast(),
                        iov_len: n,
                    });
                    self.extent_offsets.push(host_offset);
                    self.extent_fds.push(file.as_raw_fd());
                }
                Piece::Zero { .. } => buf.as_mut_slice()[pos..pos + n].fill(0),
                Piece::Compressed {
                    layer,
                    host_offset,
                    compressed_len,
                    skip,
                    ..
                } => {
                    let Some((file, Some(q))) = dev.layer(layer) else {
                        slot.status = status::IOERR;
                        break;
                    };
                    cluster_buf.resize(q.cluster_size() as usize, 0);
                    if let Err(e) =
                        q.decompress(file, host_offset, compressed_len, &mut cluster_buf)
                    {
                        error!("queue {}: qcow2 compressed cluster: {e}", self.index);
                        slot.status = status::IOERR;
                        break;
                    }
                    let skip = skip as usize;
                    buf.as_mut_slice()[pos..pos + n].copy_from_slice(&cluster_buf[skip..skip + n]);
                }
            }
            pos += n;
        }
        if slot.status != status::OK {
            slot.iov.clear();
            self.bounce.put(buf);
            return Ok(false);
        }
        slot.bounce = Some(buf);
        slot.bounce_skip = 0;
        for i in 0..slot.iov.len() {
            let op = Op::Readv {
                iov: &slot.iov[i],
                iovcnt: 1,
                offset: self.extent_offsets[i],
            };
            slot.pending += 1;
            // SAFETY: the iovec points into slot.bounce, which the slot keeps until the
            // completion is reaped; slot.iov is not resized after this loop started.
            unsafe {
                self.engine.push(
                    self.extent_fds[i],
                    &op,
                    user_data(idx, OpKind::ReadPart, i as u32),
                )?
            };
        }
        Ok(slot.pending > 0)
    }

    /// qcow2 write, synchronous on this queue's thread (one allocating writer per image at a
    /// time): gather the guest data, let the format allocate and order metadata.
    fn qcow2_write(&mut self, idx: u16, mem: &Arc<Mem>) {
        self.drain_fills();
        let (offset, len) = {
            let r = &self.slots[usize::from(idx)].req;
            (r.offset_bytes(), r.data_len as usize)
        };
        let status = match self.bounce.get(len) {
            Err(_) => status::IOERR,
            Ok(mut buf) => {
                let r = copy_from_guest(
                    mem,
                    &self.slots[usize::from(idx)].req.data,
                    &mut buf.as_mut_slice()[..len],
                )
                .map_err(|e| e.to_string())
                .and_then(|()| self.qcow2_write_bytes(offset, &buf.as_slice()[..len]));
                self.bounce.put(buf);
                match r {
                    Ok(()) => status::OK,
                    Err(e) => {
                        error!("queue {}: qcow2 write at {offset}: {e}", self.index);
                        status::IOERR
                    }
                }
            }
        };
        self.slots[usize::from(idx)].status = status;
    }

    /// qcow2 DISCARD / WRITE_ZEROES / detected zero writes: zero flags and unallocation for
    /// whole clusters, zero data for partial ones (synchronous).
    fn qcow2_zero_ranges(&mut self, idx: u16, discard: bool, discard_unmap: bool) {
        self.drain_fills();
        let dev = self.dev.clone();
        let Some(q) = dev.qcow2.as_ref() else {
            return;
        };
        let ranges: Vec<(u64, u64, bool)> = self.slots[usize::from(idx)]
            .req
            .ranges
            .iter()
            .map(|r| (r.offset_bytes, r.len_bytes, r.unmap))
            .collect();
        for (off, len, unmap) in ranges {
            let mode = if discard {
                ZeroMode::Discard
            } else if unmap && discard_unmap {
                ZeroMode::Unmap
            } else {
                ZeroMode::Keep
            };
            let mut fill_old =
                |cl_start: u64, buf: &mut [u8]| read_old_cluster(&dev, q, cl_start, buf);
            let r = q.zero_range(
                &dev.file,
                off,
                len,
                mode,
                !dev.backing.is_empty(),
                &mut fill_old,
            );
            if let Err(e) = r {
                error!("queue {}: qcow2 zeroing at {off}: {e}", self.index);
                self.slots[usize::from(idx)].status = status::IOERR;
                return;
            }
            if mode != ZeroMode::Keep {
                dev.zero_stats
                    .unmapped_bytes
                    .fetch_add(len, Ordering::Relaxed);
            }
        }
        if !dev.writeback() {
            if let Err(e) = dev.sync() {
                error!("queue {}: sync after qcow2 zeroing: {e}", self.index);
                self.slots[usize::from(idx)].status = status::IOERR;
            }
        }
    }

    fn qcow2_write_bytes(&mut self, offset: u64, data: &[u8]) -> Result<(), String> {
        if !self.dev.writeback() {
            self.stats.durable_writes += 1;
        }
        write_qcow2(&self.dev, offset, data)
    }

    /// A qcow2 write through the format on a pool thread: compressed writes on the
    /// compression pool (`compress`), copy-on-write and other allocating writes on the
    /// copy-on-write pool. The guest data is copied here; the result comes back through the
    /// inbox. Without the pool (or an engine eventfd) the write is done here. Returns whether
    /// the request now waits for the pool (false: it is finished, status set).
    fn offload_qcow2_write(&mut self, idx: u16, mem: &Arc<Mem>, compress: bool) -> bool {
        let dev = self.dev.clone();
        let pool = if compress {
            dev.compress_pool.as_ref()
        } else {
            dev.cow_pool.as_ref()
        };
        let (Some(inbox), Some(pool)) = (self.inbox.clone(), pool) else {
            self.qcow2_write(idx, mem);
            return false;
        };
        // No fill (a first write that writes its whole new cluster, zeroes around its data)
        // may be in flight while the pool writes: it could land over bytes the pool wrote
        // in place in the same cluster. The gate keeps new fills from starting until the
        // job is done; the drain waits for those in flight.
        let gate = dev.qcow2.as_ref().map(|q| {
            q.fill_gate.fetch_add(1, Ordering::SeqCst);
            FillGate(self.dev.clone())
        });
        self.drain_fills();
        let slot = &mut self.slots[usize::from(idx)];
        let (offset, len) = (slot.req.offset_bytes(), slot.req.data_len as usize);
        let mut data = vec![0u8; len];
        if let Err(e) = copy_from_guest(mem, &slot.req.data, &mut data) {
            error!("queue {}: qcow2 write at {offset}: {e}", self.index);
            slot.status = status::IOERR;
            return false;
        }
        let job_dev = self.dev.clone();
        let ud = user_data(idx, OpKind::Offload, 0);
        let queue = self.index;
        let job: crate::offload::Job = Box::new(move || {
            let result = match write_qcow2(&job_dev, offset, &data) {
                Ok(()) => 0,
                Err(e) => {
                    error!("queue {queue}: qcow2 write at {offset}: {e}");
                    -libc::EIO
                }
            };
            drop(gate);
            inbox.post(Completion {
                user_data: ud,
                result,
            });
        });
        if pool.submit(job).is_err() {
            // The job (and its gate) was dropped.
            self.qcow2_write(idx, mem);
            return false;
        }
        if !self.dev.writeback() {
            self.stats.durable_writes += 1;
        }
        self.slots[usize::from(idx)].pending = 1;
        self.offloaded += 1;
        true
    }

    fn inbox_ready(&self) -> bool {
        self.inbox.as_ref().is_some_and(|i| i.has())
    }

    /// parallels write through the format (allocation, scattered clusters, sub-block
    /// writes), synchronous; durable before completion in write-through mode.
    fn parallels_write(&mut self, idx: u16, mem: &Arc<Mem>) {
        let dev = self.dev.clone();
        let Some(p) = dev.parallels.as_ref() else {
            return;
        };
        let (offset, len) = {
            let r = &self.slots[usize::from(idx)].req;
            (r.offset_bytes(), r.data_len as usize)
        };
        let mut data = vec![0u8; len];
        let r = copy_from_guest(mem, &self.slots[usize::from(idx)].req.data, &mut data)
            .map_err(|e| e.to_string())
            .and_then(|()| p.write(&dev.file, offset, &data).map_err(|e| e.to_string()))
            .and_then(|()| {
                if dev.writeback() {
                    Ok(())
                } else {
                    self.stats.durable_writes += 1;
                    dev.sync().map_err(|e| e.to_string())
                }
            });
        if let Err(e) = r {
            error!("queue {}: parallels write at {offset}: {e}", self.index);
            self.slots[usize::from(idx)].status = status::IOERR;
        }
    }

    /// parallels DISCARD / WRITE_ZEROES / detected zero writes: whole clusters freed where
    /// unmapping is allowed, zeroes written elsewhere (synchronous).
    fn parallels_zero_ranges(&mut self, idx: u16, discard: bool, discard_unmap: bool) {
        let dev = self.dev.clone();
        let Some(p) = dev.parallels.as_ref() else {
            return;
        };
        let ranges: Vec<(u64, u64, bool)> = self.slots[usize::from(idx)]
            .req
            .ranges
            .iter()
            .map(|r| (r.offset_bytes, r.len_bytes, r.unmap))
            .collect();
        for (off, len, unmap) in ranges {
            let free = discard || (unmap && discard_unmap);
            if let Err(e) = p.zero_range(&dev.file, off, len, free, discard) {
                error!("queue {}: parallels zeroing at {off}: {e}", self.index);
                self.slots[usize::from(idx)].status = status::IOERR;
                return;
            }
            if free {
                dev.zero_stats
                    .unmapped_bytes
                    .fetch_add(len, Ordering::Relaxed);
            }
        }
        if !dev.writeback() {
            if let Err(e) = dev.sync() {
                error!("queue {}: sync after parallels zeroing: {e}", self.index);
                self.slots[usize::from(idx)].status = status::IOERR;
            }
        }
    }

    /// Take a shared range of the image's fill locks, waiting for a fill of it to complete
    /// (this queue's own operations are reaped meanwhile: the fill may be ours).
    fn acquire_fill_range(&mut self, start: u64, end: u64) -> Option<u64> {
        let dev = self.dev.clone();
        let q = dev.qcow2.as_ref()?;
        loop {
            if let Some(k) = q.fills.try_acquire(start, end, Holder::Write) {
                return Some(k);
            }
            if let Err(e) = self.engine.submit() {
                error!("queue {}: submit: {e}", self.index);
            }
            self.reap_deferred();
            // The fill is usually this queue's own: poll for its completion, briefly.
            std::thread::sleep(Duration::from_micros(20));
        }
    }

    /// Before a synchronous qcow2 write or zeroing: let the fills in flight complete (and
    /// start no new ones meanwhile), since the synchronous path writes in place without
    /// ranges and may free clusters.
    fn drain_fills(&mut self) {
        let dev = self.dev.clone();
        let Some(q) = dev.qcow2.as_ref() else {
            return;
        };
        if q.fills_in_flight.load(Ordering::SeqCst) == 0 {
            return;
        }
        q.fill_gate.fetch_add(1, Ordering::SeqCst);
        while q.fills_in_flight.load(Ordering::SeqCst) > 0 {
            if let Err(e) = self.engine.submit() {
                error!("queue {}: submit: {e}", self.index);
            }
            self.reap_deferred();
            std::thread::sleep(Duration::from_micros(20));
        }
        q.fill_gate.fetch_sub(1, Ordering::SeqCst);
    }

    /// Take a write range, waiting for conflicting holders. While waiting, this queue's own
    /// operations are submitted and reaped, so it never waits on itself.
    fn acquire_range(&mut self, start: u64, end: u64, holder: Holder) -> Option<u64> {
        let dev = self.dev.clone();
        let ranges = dev.write_ranges.as_ref()?;
        loop {
            if let Some(k) = ranges.try_acquire(start, end, holder) {
                return Some(k);
            }
            if let Err(e) = self.engine.submit() {
                error!("queue {}: submit: {e}", self.index);
            }
            self.reap_deferred();
            ranges.wait_change();
        }
    }

    /// A write smaller than the file's direct-I/O block: read the surrounding blocks, patch
    /// in the guest data, write the blocks back, with no other write to them meanwhile.
    /// Synchronous on this queue's thread: it is the rare, misconfigured-geometry path.
    fn read_modify_write(&mut self, idx: u16, mem: &Arc<Mem>) {
        self.stats.read_modify_writes += 1;
        let block = self.dev.params.align.offset as u64;
        let (offset, len) = {
            let r = &self.slots[usize::from(idx)].req;
            (r.offset_bytes(), r.data_len)
        };
        let (start, end) = block_span(offset, len, block);
        let status = if end > self.dev.params.size_bytes {
            error!("queue {}: write of {len} bytes at {offset} needs file blocks past the end of the image", self.index);
            status::IOERR
        } else {
            let key = self.acquire_range(start, end, Holder::Rmw);
            let r = self.rmw_locked(idx, mem, start, end);
            if let (Some(k), Some(ranges)) = (key, self.dev.write_ranges.as_ref()) {
                ranges.release(k);
            }
            match r {
                Ok(()) => status::OK,
                Err(e) => {
                    error!("queue {}: read-modify-write at {offset}: {e}", self.index);
                    status::IOERR
                }
            }
        };
        self.slots[usize::from(idx)].status = status;
    }

    fn rmw_locked(
        &mut self,
        idx: u16,
        mem: &Arc<Mem>,
        start: u64,
        end: u64,
    ) -> std::io::Result<()> {
        let span = (end - start) as usize;
        let mut buf = self.bounce.get(span)?;
        let fd = self.dev.file.as_raw_fd();
        let result = (|| {
            let b = &mut buf.as_mut_slice()[..span];
            // SAFETY: b is span writable bytes.
            let n = unsafe { libc::pread(fd, b.as_mut_ptr().cast(), span, start as i64) };
            if n < 0 {
                return Err(std::io::Error::last_os_error());
            }
            if n as usize != span {
                return Err(std::io::Error::other(format!("short read of {n} bytes")));
            }
            let slot = &self.slots[usize::from(idx)];
            let skip = (slot.req.offset_bytes() - start) as usize;
            copy_from_guest(
                mem,
                &slot.req.data,
                &mut b[skip..skip + slot.req.data_len as usize],
            )?;
            let flags = if self.dev.writeback() {
                0
            } else {
                libc::RWF_DSYNC
            };
            let iov = libc::iovec {
                iov_base: b.as_mut_ptr().cast(),
                iov_len: span,
            };
            // SAFETY: iov describes b, alive for the call.
            let n = unsafe { libc::pwritev2(fd, &iov, 1, start as i64, flags) };
            if n < 0 {
                return Err(std::io::Error::last_os_error());
            }
            if n as usize != span {
                return Err(std::io::Error::other(format!("short write of {n} bytes")));
            }
            Ok(())
        })();
        self.bounce.put(buf);
        result
    }

    fn reap_and_complete(&mut self, vring: &VringRwLock<GuestMemoryAtomic<Mem>>) {
        loop {
            self.reap_deferred();
            // Completions may have queued follow-up operations (write-through syncs); the
            // blocking engine finishes them at once, so reap again until nothing is ready.
            if let Err(e) = self.engine.submit() {
                error!("queue {}: submit: {e}", self.index);
            }
            if !self.engine.has_completions() && !self.inbox_ready() {
                break;
            }
        }
        if self.deferred_used.is_empty() {
            return;
        }
        let mut state = vring.get_mut();
        for (head, used) in self.deferred_used.drain(..) {
            if let Err(e) = state.add_used(head, used) {
                warn!("queue {}: add_used: {e}", self.index);
            }
        }
        drop(state);
        self.signal(vring);
    }

    /// Reap the engine and account completions; finished requests wait in `deferred_used`
    /// for the caller to put them on the used ring.
    fn reap_deferred(&mut self) {
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

    /// Account one finished operation; Some((head, used_len)) when its request is done.
    fn complete_op(&mut self, c: Completion) -> Option<(u16, u32)> {
        let (idx, kind, range) = decode(c.user_data);
        if kind == Some(OpKind::Offload) {
            self.offloaded = self.offloaded.saturating_sub(1);
        }
        let slot = self.slots.get_mut(usize::from(idx))?;
        if slot.pending == 0 {
            error!("queue {}: completion for idle slot {idx}", self.index);
            return None;
        }
        let mut res = c.result;
        if self.dev.qcow2.is_some() && matches!(kind, Some(OpKind::Read) | Some(OpKind::ReadPart)) {
            // A qcow2 file may end inside its last cluster (the rest of it was never written):
            // a short read there is the end of the file, and the rest reads as zeroes.
            let iovs = if kind == Some(OpKind::Read) {
                &slot.iov[..]
            } else {
                slot.iov
                    .get(range as usize..range as usize + 1)
                    .unwrap_or(&[])
            };
            let want: usize = iovs.iter().map(|v| v.iov_len).sum();
            if res >= 0 && (res as usize) < want {
                let mut skip = res as usize;
                for v in iovs {
                    if skip >= v.iov_len {
                        skip -= v.iov_len;
                        continue;
                    }
                    // SAFETY: the iovec points into guest memory or a bounce buffer that the
                    // slot keeps alive, and the kernel is done with it (this is its completion).
                    unsafe {
                        std::ptr::write_bytes(
                            v.iov_base.cast::<u8>().add(skip),
                            0,
                            v.iov_len - skip,
                        )
                    };
                    skip = 0;
                }
                res = want as i32;
            }
        }
        match kind {
            Some(OpKind::ReadPart)
                if res >= 0
                    && slot.iov.get(range as usize).map(|v| v.iov_len as u64)
                        != Some(res as u64) =>
            {
                warn!("queue {}: short qcow2 read part of {res} bytes", self.index);
                res = -libc::EIO;
            }
            Some(OpKind::Read) | Some(OpKind::Write)
                if res >= 0 && res as u64 != slot.expect_bytes =>
            {
                warn!(
                    "queue {}: short {:?} of {res} bytes, expected {}",
                    self.index, kind, slot.expect_bytes
                );
                res = -libc::EIO;
            }
            Some(OpKind::Discard) if res == -libc::EOPNOTSUPP => {
                // Discard is a hint (5.2.6.2: the device may do nothing).
                res = 0;
            }
            Some(OpKind::ZeroRange) | Some(OpKind::PunchZero) if res == -libc::EOPNOTSUPP => {
                if kind == Some(OpKind::ZeroRange) {
                    self.dev
                        .no_zero_range
                        .store(true, std::sync::atomic::Ordering::Relaxed);
                }
                res = match slot.req.ranges.get(range as usize) {
                    Some(r) => {
                        zero_fallback(&self.dev, r.offset_bytes, r.len_bytes, &mut self.bounce)
                    }
                    None => -libc::EIO,
                };
            }
            _ => {}
        }
        if res < 0 {
            let err = std::io::Error::from_raw_os_error(-res);
            error!("queue {}: {:?} failed: {err}", self.index, kind);
            self.stats.errors += 1;
            slot.status = status::IOERR;
        }
        if res >= 0
            && matches!(kind, Some(OpKind::Discard) | Some(OpKind::PunchZero))
            && c.result == 0
        {
            if let Some(r) = slot.req.ranges.get(range as usize) {
                self.dev
                    .zero_stats
                    .unmapped_bytes
                    .fetch_add(r.len_bytes, Ordering::Relaxed);
            }
        }
        slot.pending -= 1;
        if slot.pending > 0 {
            return None;
        }
        if slot.sync_after && slot.status == status::OK {
            // Write-through: the zeroing becomes durable before the request completes.
            slot.sync_after = false;
            slot.pending = 1;
            let fd = self.dev.file.as_raw_fd();
            // SAFETY: no buffers.
            let pushed = unsafe {
                self.engine
                    .push(fd, &Op::Fdatasync, user_data(idx, OpKind::Flush, 0))
            };
            if pushed.is_ok() {
                return None;
            }
            slot.pending = 0;
            slot.status = status::IOERR;
        }
        let head = slot.head;
        Some((head, self.finish(idx)))
    }

    /// Copy bounced read data out, write the status byte, free the slot.
    fn finish(&mut self, idx: u16) -> u32 {
        let slot = &mut self.slots[usize::from(idx)];
        let mem = slot.mem.take();
        if let Some(buf) = slot.bounce.take() {
            if slot.req.kind == RequestType::In && slot.status == status::OK {
                if let Some(mem) = &mem {
                    let mut done = slot.bounce_skip;
                    for seg in &slot.req.data {
                        let n = seg.len as usize;
                        if mem
                            .write_slice(&buf.as_slice()[done..done + n], seg.addr)
                            .is_err()
                        {
                            slot.status = status::IOERR;
                            break;
                        }
                        done += n;
                    }
                }
            }
            self.bounce.put(buf);
        }
        if slot.status != status::OK && slot.req.kind == RequestType::In {
            slot.used_len = 1;
        }
        if let (Some(install), Some(q)) = (slot.cow_install.take(), self.dev.qcow2.as_ref()) {
            // The data is in the file: now the new clusters may replace the backing data
            // (before the guest sees the write complete).
            if let Err(e) = q.finish_cow(&self.dev.file, install, slot.status == status::OK) {
                error!("queue {}: installing new clusters: {e}", self.index);
                slot.status = status::IOERR;
            }
        }
        if let Some(mem) = &mem {
            let _ = mem.write_obj(slot.status, slot.req.status_addr);
        }
        if let (Some(k), Some(ranges)) = (slot.range_key.take(), self.dev.write_ranges.as_ref()) {
            ranges.release(k);
        }
        if let (Some((k, is_fill)), Some(q)) = (slot.fill_key.take(), self.dev.qcow2.as_ref()) {
            if is_fill {
                q.end_fill(k);
            } else {
                q.fills.release(k);
            }
        }
        slot.iov.clear();
        self.free.push(idx);
        slot.used_len
    }

    fn signal(&self, vring: &VringRwLock<GuestMemoryAtomic<Mem>>) {
        match vring.needs_notification() {
            Ok(true) | Err(_) => {
                if let Err(e) = vring.signal_used_queue() {
                    debug!("queue {}: signal: {e}", self.index);
                }
            }
            Ok(false) => {}
        }
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
            if self.in_flight() == 0 {
                break;
            }
            if self.offloaded > 0 {
                if let Some(inbox) = &self.inbox {
                    inbox.wait(Duration::from_millis(5));
                }
                continue;
            }
            if self.engine.wait_one().is_err() {
                break;
            }
        }
    }
}

/// A raised `fill_gate` of the device's qcow2 image, lowered when dropped.
struct FillGate(Arc<Device>);

impl Drop for FillGate {
    fn drop(&mut self) {
        if let Some(q) = self.0.qcow2.as_ref() {
            q.fill_gate.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

/// A qcow2 write through the format (allocation, compression, copy-on-write), made durable
/// before returning in write-through mode.
fn write_qcow2(dev: &Device, offset: u64, data: &[u8]) -> Result<(), String> {
    let Some(q) = dev.qcow2.as_ref() else {
        return Err("not a qcow2 image".into());
    };
    let mut fill_old = |cl_start: u64, buf: &mut [u8]| read_old_cluster(dev, q, cl_start, buf);
    q.write(&dev.file, offset, data, &mut fill_old)
        .map_err(|e| e.to_string())?;
    if !dev.writeback() {
        dev.sync().map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// Has the driver made chains available that we have not popped?
fn avail_pending(vring: &VringRwLock<GuestMemoryAtomic<Mem>>, mem: &Mem) -> bool {
    let state = vring.get_ref();
    let q = state.get_queue();
    q.ready()
        && q.avail_idx(mem, std::sync::atomic::Ordering::Acquire)
            .is_ok_and(|i| i.0 != q.next_avail())
}

/// Read a whole cluster of the guest disk (through the backing chain), synchronously: the
/// old contents a copy-on-write keeps around the new data.
fn read_old_cluster(
    dev: &Device,
    q: &crate::image::qcow2::Qcow2Image,
    cl_start: u64,
    buf: &mut [u8],
) -> Result<(), crate::image::qcow2::MapError> {
    use crate::image::qcow2::MapError;
    let mut scratch = Vec::new();
    let mut pieces = Vec::new();
    // The last cluster may extend past the virtual size: only map what exists.
    let len = (buf.len() as u64).min(q.size_bytes.saturating_sub(cl_start));
    buf.fill(0);
    resolve_read(
        q,
        &dev.file,
        &dev.backing,
        cl_start,
        len,
        &mut scratch,
        &mut pieces,
    )?;
    let mut pos = 0usize;
    let mut cluster_buf = Vec::new();
    for p in &pieces {
        let n = p.len() as usize;
        match *p {
            Piece::Zero { .. } => {}
            Piece::Data {
                layer, host_offset, ..
            } => {
                let (file, _) = dev.layer(layer).ok_or(MapError::Corrupt("bad layer"))?;
                let d = crate::image::qcow2::read_aligned(file, host_offset, n)
                    .map_err(MapError::Io)?;
                buf[pos..pos + n].copy_from_slice(&d);
            }
            Piece::Compressed {
                layer,
                host_offset,
                compressed_len,
                skip,
                ..
            } => {
                let (file, lq) = dev.layer(layer).ok_or(MapError::Corrupt("bad layer"))?;
                let lq = lq.ok_or(MapError::Corrupt("compressed data in a raw layer"))?;
                cluster_buf.resize(lq.cluster_size() as usize, 0);
                lq.decompress(file, host_offset, compressed_len, &mut cluster_buf)?;
                let skip = skip as usize;
                buf[pos..pos + n].copy_from_slice(&cluster_buf[skip..skip + n]);
            }
        }
        pos += n;
    }
    Ok(())
}

/// The file blocks of `block` bytes that cover [offset, offset + len).
fn block_span(offset: u64, len: u64, block: u64) -> (u64, u64) {
    let start = offset / block * block;
    let end = (offset + len).div_ceil(block) * block;
    (start, end)
}

/// The first `dst.len()` bytes of the segments (false if they are shorter).
fn copy_from_guest_prefix(mem: &Mem, segs: &[crate::virtio_blk::Segment], dst: &mut [u8]) -> bool {
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

/// Gather the request's guest segments into `dst` (exactly their total length).
fn copy_from_guest(
    mem: &Mem,
    segs: &[crate::virtio_blk::Segment],
    dst: &mut [u8],
) -> std::io::Result<()> {
    let mut done = 0usize;
    for seg in segs {
        let n = seg.len as usize;
        let part = dst
            .get_mut(done..done + n)
            .ok_or_else(|| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
        mem.read_slice(part, seg.addr)
            .map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
        done += n;
    }
    Ok(())
}

/// _IO(0x12, 119): discard a byte range of a block device (linux/fs.h).
const BLKDISCARD: libc::c_ulong = 0x1277;

/// BLKDISCARD on [offset, offset + len): 0 or a negative errno.
fn blk_discard(fd: i32, offset: u64, len: u64) -> i32 {
    let range: [u64; 2] = [offset, len];
    // SAFETY: BLKDISCARD reads two u64 (start, length) through the pointer.
    let r = unsafe { libc::ioctl(fd, BLKDISCARD, range.as_ptr()) };
    if r == 0 {
        0
    } else {
        -std::io::Error::last_os_error()
            .raw_os_error()
            .unwrap_or(libc::EIO)
    }
}

/// Zero a range when the filesystem lacks FALLOC_FL_ZERO_RANGE (or punch-hole): punch and
/// re-allocate, else write zeroes. Rare; runs on the queue thread.
fn zero_fallback(dev: &Device, offset: u64, len: u64, pool: &mut BouncePool) -> i32 {
    let fd = dev.file.as_raw_fd();
    if punch_and_allocate(fd, offset, len) {
        return 0;
    }
    write_zeroes(fd, offset, len, pool)
}

/// Deallocate then allocate again: zeroes that keep the space (tmpfs lacks ZERO_RANGE).
fn punch_and_allocate(fd: i32, offset: u64, len: u64) -> bool {
    // SAFETY: plain syscalls on our descriptor.
    unsafe {
        libc::fallocate(
            fd,
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            offset as i64,
            len as i64,
        ) == 0
            && libc::fallocate(fd, libc::FALLOC_FL_KEEP_SIZE, offset as i64, len as i64) == 0
    }
}

/// The last resort: write zeroes, 1 MiB at a time, from an aligned (O_DIRECT-safe) buffer.
fn write_zeroes(fd: i32, offset: u64, len: u64, pool: &mut BouncePool) -> i32 {
    const CHUNK: u64 = 1 << 20;
    let mut buf = match pool.get(CHUNK as usize) {
        Ok(b) => b,
        Err(_) => return -libc::ENOMEM,
    };
    buf.as_mut_slice().fill(0);
    let mut off = offset;
    let end = offset + len;
    let mut ret = 0;
    while off < end {
        let n = (end - off).min(CHUNK) as usize;
        // SAFETY: buf holds at least CHUNK bytes.
        let r = unsafe { libc::pwrite(fd, buf.as_mut_ptr().cast(), n, off as i64) };
        if r <= 0 {
            ret = -std::io::Error::last_os_error()
                .raw_os_error()
                .unwrap_or(libc::EIO);
            break;
        }
        off += r as u64;
    }
    pool.put(buf);
    ret
}

#[cfg(test)]
#[path = "worker_tests.rs"]
mod tests;
