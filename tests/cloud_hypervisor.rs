//! cloud-hypervisor's vhost-user-blk frontend, reproduced message by message with the API it
//! uses (rust-vmm's `vhost::vhost_user::Frontend`). cloud-hypervisor cannot run on machines
//! without hardware KVM (these); what it sends a backend is this, read from cloud-hypervisor
//! commit ae44c2971c83dd2b1bd704fa81102ec0dec4e7d4:
//! - `virtio-devices/src/vhost_user/blk.rs`: `Blk::new` (the virtio and protocol features it
//!   asks for, GET_QUEUE_NUM, GET_CONFIG of 60 bytes), `activate`, `add_memory_region`;
//! - `virtio-devices/src/vhost_user/vu_common_ctrl.rs`: `connect_vhost_user`,
//!   `negotiate_features_vhost_user`, `setup_vhost_user` (the activation),
//!   `reinitialize_vhost_user` (after a reconnect), `add_memory_region` (ADD_MEM_REG),
//!   `start_dirty_log`, `dirty_log`, `pause_vhost_user`;
//! - `virtio-devices/src/vhost_user/mod.rs`: the default virtio features, the reconnect on
//!   the socket's hang-up.
//!
//! Guest I/O runs on two queues at once through split rings of 128 entries that the test
//! builds in its own memfd memory, with each request checked against a model of the disk, and
//! the image compared with the model at the end. IN_ORDER is acked (cloud-hypervisor offers
//! it, and a guest with in-order support takes it): every batch must come back in the order it
//! was made available.

mod common;

use std::fs::File;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use vhost::vhost_user::message::{
    VhostUserConfigFlags, VhostUserHeaderFlag, VhostUserInflight, VhostUserProtocolFeatures,
};
use vhost::vhost_user::{Frontend, VhostUserFrontend};
use vhost::{VhostBackend, VhostUserMemoryRegionInfo, VringConfigData};
use vm_memory::{Bytes, FileOffset, GuestAddress, GuestMemoryBackend, GuestMemoryMmap};
use vmm_sys_util::eventfd::EventFd;

use common::*;

const QUEUES: usize = 2;
/// cloud-hypervisor's default `queue_size` (vmm/src/vm_config.rs).
const QSIZE: u16 = 128;
const DISK: u64 = 64 * MIB;
const BLOCK: u64 = 4096;
/// Requests a queue has in flight at most (one batch).
const DEPTH: u16 = 16;
/// Boot memory (one memfd region, as `--memory size=...,shared=on` gives) and the region a
/// memory hotplug adds (`hotplug_size=`).
const RAM_GPA: u64 = 0;
const RAM_LEN: u64 = 32 * MIB;
const HOT_GPA: u64 = 1 << 32;
const HOT_LEN: u64 = 16 * MIB;

/// Feature bits (virtio 1.2 and the vhost-user spec).
const fn bit(n: u32) -> u64 {
    1 << n
}
/// What cloud-hypervisor offers the guest of a vhost-user-blk device, where the backend offers
/// it (blk.rs `Blk::new`, mod.rs `DEFAULT_VIRTIO_FEATURES`): SIZE_MAX, SEG_MAX, GEOMETRY, RO,
/// BLK_SIZE, FLUSH, TOPOLOGY, CONFIG_WCE, MQ, DISCARD, WRITE_ZEROES; INDIRECT_DESC,
/// EVENT_IDX, VERSION_1, IN_ORDER, ORDER_PLATFORM, NOTIFICATION_DATA; LOG_ALL and
/// PROTOCOL_FEATURES (0x5974007e76).
const CH_FEATURES: u64 = bit(1)
    | bit(2)
    | bit(4)
    | bit(5)
    | bit(6)
    | bit(9)
    | bit(10)
    | bit(11)
    | bit(12)
    | bit(13)
    | bit(14)
    | bit(26)
    | bit(28)
    | bit(29)
    | bit(30)
    | bit(32)
    | bit(35)
    | bit(36)
    | bit(38);
const PROTOCOL_FEATURES: u64 = bit(30);
const LOG_ALL: u64 = bit(26);
const IN_ORDER: u64 = bit(35);

/// What cloud-hypervisor asks of the protocol (blk.rs): 0x8920b.
fn ch_protocol() -> VhostUserProtocolFeatures {
    VhostUserProtocolFeatures::CONFIG
        | VhostUserProtocolFeatures::MQ
        | VhostUserProtocolFeatures::CONFIGURE_MEM_SLOTS
        | VhostUserProtocolFeatures::REPLY_ACK
        | VhostUserProtocolFeatures::INFLIGHT_SHMFD
        | VhostUserProtocolFeatures::LOG_SHMFD
        | VhostUserProtocolFeatures::DEVICE_STATE
}

/// One memfd region of guest memory, mapped in the test (cloud-hypervisor's "ch_ram").
struct Ram {
    gpa: u64,
    len: u64,
    mem: GuestMemoryMmap<()>,
    hva: u64,
}

impl Ram {
    fn new(gpa: u64, len: u64) -> Arc<Ram> {
        let file = memfd(len);
        let mem = GuestMemoryMmap::<()>::from_ranges_with_files(&[(
            GuestAddress(gpa),
            len as usize,
            Some(FileOffset::new(file, 0)),
        )])
        .unwrap();
        let hva = mem.get_host_address(GuestAddress(gpa)).unwrap() as u64;
        Arc::new(Ram { gpa, len, mem, hva })
    }

    /// The region as SET_MEM_TABLE and ADD_MEM_REG carry it: the VMM's own address.
    fn info(&self) -> VhostUserMemoryRegionInfo {
        let r = self.mem.find_region(GuestAddress(self.gpa)).unwrap();
        let fd = r.file_offset().unwrap().file().as_raw_fd();
        region(self.gpa, self.len, self.hva, fd)
    }

    fn w<T: vm_memory::ByteValued>(&self, gpa: u64, v: T) {
        self.mem.write_obj(v, GuestAddress(gpa)).unwrap();
    }

    fn r<T: vm_memory::ByteValued>(&self, gpa: u64) -> T {
        self.mem.read_obj(GuestAddress(gpa)).unwrap()
    }
}

/// Where queue `q`'s rings live in boot memory.
fn desc_at(q: usize) -> u64 {
    RAM_GPA + 0x1_0000 + q as u64 * 0x8000
}
fn avail_at(q: usize) -> u64 {
    desc_at(q) + 0x1000
}
fn used_at(q: usize) -> u64 {
    desc_at(q) + 0x2000
}
/// Request `k` of queue `q`: its header, its status byte (on pages of their own: the guest
/// writes headers, the device status bytes), and its data buffer: writes' and reads' apart
/// (the guest fills the one, the device the other), in boot memory or in the hotplugged
/// region.
fn hdr_at(q: usize, k: u16) -> u64 {
    RAM_GPA + 0x4_0000 + q as u64 * 0x1000 + u64::from(k) * 32
}
fn status_at(q: usize, k: u16) -> u64 {
    RAM_GPA + 0x5_0000 + q as u64 * 0x1000 + u64::from(k)
}
fn data_at(q: usize, k: u16, read: bool, hot: bool) -> u64 {
    let base = if hot { HOT_GPA } else { RAM_GPA + 0x10_0000 };
    base + u64::from(read) * 0x40_0000 + q as u64 * 0x10_0000 + u64::from(k) * BLOCK
}

/// The pages the guest's vCPUs write (what KVM's dirty log would give the VMM): descriptor
/// tables, available rings, headers, write buffers in boot memory.
fn guest_written_pages() -> Vec<(u64, u64)> {
    let mut v = Vec::new();
    for q in 0..QUEUES {
        v.push((desc_at(q), 0x2000));
        v.push((RAM_GPA + 0x4_0000 + q as u64 * 0x1000, 0x1000));
        v.push((data_at(q, 0, false, false), u64::from(DEPTH) * BLOCK));
    }
    v
}

/// SET_VRING_ADDR's rings of queue `q`: the VMM's own addresses of the rings in boot memory;
/// `logged`: with VHOST_VRING_F_LOG and the used ring's guest address as the log address
/// (`set_vring_logging`).
fn ring_config(ram: &Ram, q: usize, logged: bool) -> VringConfigData {
    VringConfigData {
        queue_max_size: QSIZE,
        queue_size: QSIZE,
        flags: u32::from(logged),
        desc_table_addr: ram.hva + desc_at(q) - ram.gpa,
        used_ring_addr: ram.hva + used_at(q) - ram.gpa,
        avail_ring_addr: ram.hva + avail_at(q) - ram.gpa,
        log_addr: logged.then(|| used_at(q)),
    }
}

/// A tiny deterministic generator (the test must replay the same way every run).
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// What the driver threads share with the test's frontend (the VMM).
struct Shared {
    /// Finish the batch in flight and stop.
    stop: AtomicBool,
    /// The vCPUs are paused: stop at once, a batch in flight stays in flight.
    pause: AtomicBool,
    /// Put data buffers in the hotplugged region too.
    use_hot: AtomicBool,
    /// Batches each queue has finished.
    batches: [AtomicU64; QUEUES],
}

/// A request of a batch: head, type, block, fill byte, buffer in the hotplugged region.
#[derive(Clone, Copy)]
struct Planned {
    head: u16,
    kind: u32,
    block: u64,
    fill: u8,
    hot: bool,
}

/// A batch made available and not yet seen used.
struct Batch {
    plan: Vec<Planned>,
    used_before: u16,
}

/// The guest driver of queue `q`: batches of up to DEPTH reads, writes and flushes on the
/// blocks it owns (block % QUEUES == q, so the queues never race on a block), each batch
/// checked when it is used: every status OK, reads equal to the model, the used ring in the
/// available order. A driver paused with a batch in flight (a migration) resumes on other
/// memory and another device, where the batch must complete.
struct Driver {
    q: usize,
    ram: Arc<Ram>,
    hot: Arc<Ram>,
    kick: EventFd,
    next_avail: u16,
    model: Vec<u8>,
    rng: Rng,
    pending: Option<Batch>,
}

impl Driver {
    fn run(mut self, shared: Arc<Shared>) -> Driver {
        let deadline = Duration::from_secs(60);
        let mut since = Instant::now();
        loop {
            if shared.pause.load(Ordering::Acquire) {
                return self;
            }
            if self.pending.is_none() {
                if shared.stop.load(Ordering::Acquire) {
                    return self;
                }
                let hot = shared.use_hot.load(Ordering::Acquire);
                self.start_batch(hot);
                since = Instant::now();
            }
            if self.batch_done() {
                shared.batches[self.q].fetch_add(1, Ordering::AcqRel);
                continue;
            }
            assert!(
                since.elapsed() < deadline,
                "queue {}: a batch not used after 60 s",
                self.q
            );
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    fn mem(&self, hot: bool) -> &Ram {
        if hot {
            &self.hot
        } else {
            &self.ram
        }
    }

    fn start_batch(&mut self, hot_allowed: bool) {
        let q = self.q;
        let n = 1 + self.rng.below(u64::from(DEPTH)) as u16;
        let blocks_per_queue = DISK / BLOCK / QUEUES as u64;
        let mut plan = Vec::new();
        let mut taken = std::collections::HashSet::new();
        for k in 0..n {
            let mut block = QUEUES as u64 * self.rng.below(blocks_per_queue) + q as u64;
            while !taken.insert(block) {
                block = QUEUES as u64 * self.rng.below(blocks_per_queue) + q as u64;
            }
            let kind = match self.rng.below(10) {
                0 => 4u32,  // FLUSH
                1..=5 => 1, // OUT
                _ => 0,     // IN
            };
            let p = Planned {
                head: k * 3,
                kind,
                block,
                fill: self.rng.next() as u8,
                hot: hot_allowed && self.rng.below(2) == 0,
            };
            let (hdr, st, data) = (
                hdr_at(q, k),
                status_at(q, k),
                data_at(q, k, kind == 0, p.hot),
            );
            let ram = &self.ram;
            ram.w(hdr, kind);
            ram.w(hdr + 4, 0u32);
            ram.w(hdr + 8, if kind == 4 { 0 } else { block * BLOCK / 512 });
            let desc = |i: u16, addr: u64, len: u32, flags: u16, next: u16| {
                let at = desc_at(q) + u64::from(i) * 16;
                ram.w(at, addr);
                ram.w(at + 8, len);
                ram.w(at + 12, flags);
                ram.w(at + 14, next);
            };
            let head = p.head;
            if kind == 4 {
                desc(head, hdr, 16, 1, head + 1);
                desc(head + 1, st, 1, 2, 0);
            } else {
                if kind == 1 {
                    let mut buf = vec![p.fill; BLOCK as usize];
                    buf[..8].copy_from_slice(&block.to_le_bytes());
                    self.mem(p.hot)
                        .mem
                        .write_slice(&buf, GuestAddress(data))
                        .unwrap();
                }
                let dflags = if kind == 0 { 1 | 2 } else { 1 };
                desc(head, hdr, 16, 1, head + 1);
                desc(head + 1, data, BLOCK as u32, dflags, head + 2);
                desc(head + 2, st, 1, 2, 0);
            }
            plan.push(p);
        }
        // Publish the batch, then kick (always: the test does not read avail_event).
        for (i, p) in plan.iter().enumerate() {
            let slot = u64::from(self.next_avail.wrapping_add(i as u16) % QSIZE);
            self.ram.w(avail_at(q) + 4 + 2 * slot, p.head);
        }
        std::sync::atomic::fence(Ordering::SeqCst);
        let used_before: u16 = self.ram.r(used_at(q) + 2);
        self.next_avail = self.next_avail.wrapping_add(n);
        self.ram.w(avail_at(q) + 2, self.next_avail);
        std::sync::atomic::fence(Ordering::SeqCst);
        self.kick.write(1).unwrap();
        self.pending = Some(Batch { plan, used_before });
    }

    /// Check the batch in flight if it has been used whole; true then.
    fn batch_done(&mut self) -> bool {
        let q = self.q;
        let Some(b) = self.pending.as_ref() else {
            return false;
        };
        let n = b.plan.len() as u16;
        let used: u16 = self.ram.r(used_at(q) + 2);
        let got = used.wrapping_sub(b.used_before);
        if got < n {
            return false;
        }
        assert_eq!(got, n, "queue {q}: more used than made available");
        std::sync::atomic::fence(Ordering::SeqCst);
        let b = self.pending.take().unwrap();
        for (i, p) in b.plan.iter().enumerate() {
            let slot = u64::from(b.used_before.wrapping_add(i as u16) % QSIZE);
            let id: u32 = self.ram.r(used_at(q) + 4 + 8 * slot);
            assert_eq!(
                id,
                u32::from(p.head),
                "queue {q}: used entry {i} of the batch is head {id}, not {} (IN_ORDER)",
                p.head
            );
            let st: u8 = self.ram.r(status_at(q, i as u16));
            assert_eq!(st, 0, "queue {q}: request {i} (type {}) status", p.kind);
            let at = (p.block * BLOCK) as usize;
            match p.kind {
                1 => {
                    self.model[at..at + BLOCK as usize].fill(p.fill);
                    self.model[at..at + 8].copy_from_slice(&p.block.to_le_bytes());
                }
                0 => {
                    let mut got = vec![0u8; BLOCK as usize];
                    self.mem(p.hot)
                        .mem
                        .read_slice(&mut got, GuestAddress(data_at(q, i as u16, true, p.hot)))
                        .unwrap();
                    assert!(
                        got == self.model[at..at + BLOCK as usize],
                        "queue {q}: read of block {} differs from the model{}",
                        p.block,
                        if p.hot {
                            " (buffer in the hotplugged region)"
                        } else {
                            ""
                        }
                    );
                }
                _ => {}
            }
        }
        true
    }
}

/// cloud-hypervisor's device: the frontend, the queues' eventfds, the inflight region, the
/// features it settled on.
struct Device {
    fe: Frontend,
    kicks: Vec<EventFd>,
    calls: Vec<EventFd>,
    inflight: Option<(VhostUserInflight, File)>,
    acked: u64,
    protocol: VhostUserProtocolFeatures,
}

/// `Blk::new` → `connect_vhost_user`: SET_OWNER, GET_FEATURES, GET_PROTOCOL_FEATURES,
/// SET_PROTOCOL_FEATURES (without NEED_REPLY; NEED_REPLY on every message after it once
/// REPLY_ACK is agreed), GET_QUEUE_NUM, GET_CONFIG (offset 0, 60 bytes, WRITABLE). No
/// SET_FEATURES yet.
fn create(socket: &std::path::Path) -> Device {
    let mut fe = Frontend::connect(socket, QUEUES as u64).unwrap();
    fe.set_owner().unwrap();
    let backend = fe.get_features().unwrap();
    let acked = CH_FEATURES & backend;
    assert_ne!(
        acked & PROTOCOL_FEATURES,
        0,
        "PROTOCOL_FEATURES not offered"
    );
    assert_ne!(acked & IN_ORDER, 0, "IN_ORDER not offered");
    assert_ne!(
        acked & LOG_ALL,
        0,
        "LOG_ALL not offered: cloud-hypervisor refuses to migrate"
    );
    let protocol = ch_protocol() & fe.get_protocol_features().unwrap();
    fe.set_protocol_features(protocol).unwrap();
    if protocol.contains(VhostUserProtocolFeatures::REPLY_ACK) {
        fe.set_hdr_flags(VhostUserHeaderFlag::NEED_REPLY);
    }
    // Migration needs LOG_SHMFD (`update_supported_features`).
    assert!(protocol.contains(VhostUserProtocolFeatures::LOG_SHMFD));
    let queues = fe.get_queue_num().unwrap();
    assert!(queues >= QUEUES as u64, "{queues} queues");
    let (_, config) = fe
        .get_config(0, 60, VhostUserConfigFlags::WRITABLE, &[0; 60])
        .unwrap();
    assert_eq!(
        u64::from_le_bytes(config[..8].try_into().unwrap()),
        DISK / 512,
        "capacity"
    );
    Device {
        fe,
        kicks: Vec::new(),
        calls: Vec::new(),
        inflight: None,
        acked,
        protocol,
    }
}

/// The guest's driver accepts every feature offered but the vhost-user ones.
fn guest_acked(acked: u64) -> u64 {
    acked & !(PROTOCOL_FEATURES | LOG_ALL)
}

impl Device {
    /// `setup_vhost_user` (the activation, and the replay after a reconnect): SET_FEATURES,
    /// SET_MEM_TABLE with every region (also with CONFIGURE_MEM_SLOTS), SET_VRING_NUM for
    /// every queue, GET_INFLIGHT_FD (unless one is held) and SET_INFLIGHT_FD, then per queue
    /// SET_VRING_ADDR (the VMM's addresses), SET_VRING_BASE `bases[q]`, SET_VRING_CALL,
    /// SET_VRING_KICK; then SET_VRING_ENABLE for every queue.
    fn activate(&mut self, regions: &[&Ram], ram: &Ram, bases: &[u16]) {
        let fe = &mut self.fe;
        fe.set_features(guest_acked(self.acked) | PROTOCOL_FEATURES)
            .unwrap();
        let infos: Vec<_> = regions.iter().map(|r| r.info()).collect();
        fe.set_mem_table(&infos).unwrap();
        for q in 0..QUEUES {
            fe.set_vring_num(q, QSIZE).unwrap();
        }
        if self
            .protocol
            .contains(VhostUserProtocolFeatures::INFLIGHT_SHMFD)
        {
            if self.inflight.is_none() {
                self.inflight = Some(
                    fe.get_inflight_fd(&VhostUserInflight::new(0, 0, QUEUES as u16, QSIZE))
                        .unwrap(),
                );
            }
            let (info, file) = self.inflight.as_ref().unwrap();
            fe.set_inflight_fd(info, file.as_raw_fd()).unwrap();
        }
        self.kicks.clear();
        self.calls.clear();
        for (q, &base) in bases.iter().enumerate().take(QUEUES) {
            let config = ring_config(ram, q, false);
            fe.set_vring_addr(q, &config).unwrap();
            fe.set_vring_base(q, base).unwrap();
            let call = EventFd::new(0).unwrap();
            let kick = EventFd::new(0).unwrap();
            fe.set_vring_call(q, &call).unwrap();
            fe.set_vring_kick(q, &kick).unwrap();
            self.calls.push(call);
            self.kicks.push(kick);
        }
        for q in 0..QUEUES {
            fe.set_vring_enable(q, true).unwrap();
        }
    }
}

/// SET_VRING_BASE as cloud-hypervisor sends it: each queue's avail index in guest memory.
fn avail_indices(ram: &Ram) -> Vec<u16> {
    (0..QUEUES).map(|q| ram.r(avail_at(q) + 2)).collect()
}

type Threads = Vec<std::thread::JoinHandle<Driver>>;

/// The image, the model of it, the guest's memory and the drivers' shared state.
struct Run {
    img: std::path::PathBuf,
    ram: Arc<Ram>,
    hot: Arc<Ram>,
    shared: Arc<Shared>,
    model: Vec<u8>,
}

fn run_setup(dir: &TestDir, seed: u64) -> Run {
    let img = dir.join("disk.raw");
    create_pattern_image(&img, DISK, seed);
    Run {
        model: read_file(&img),
        img,
        ram: Ram::new(RAM_GPA, RAM_LEN),
        hot: Ram::new(HOT_GPA, HOT_LEN),
        shared: Arc::new(Shared {
            stop: AtomicBool::new(false),
            pause: AtomicBool::new(false),
            use_hot: AtomicBool::new(false),
            batches: Default::default(),
        }),
    }
}

impl Run {
    /// The guest's drivers, one thread per queue, kicking through `dev`'s eventfds.
    fn start_drivers(&self, dev: &Device) -> Threads {
        let drivers = (0..QUEUES)
            .map(|q| Driver {
                q,
                ram: self.ram.clone(),
                hot: self.hot.clone(),
                kick: dev.kicks[q].try_clone().unwrap(),
                next_avail: self.ram.r(avail_at(q) + 2),
                model: self.model.clone(),
                rng: Rng(0x9e37_79b9_7f4a_7c15 ^ (q as u64 + 1)),
                pending: None,
            })
            .collect();
        self.spawn(drivers)
    }

    fn spawn(&self, drivers: Vec<Driver>) -> Threads {
        drivers
            .into_iter()
            .map(|d| {
                let shared = self.shared.clone();
                std::thread::spawn(move || d.run(shared))
            })
            .collect()
    }

    /// Wait until every queue has finished `more` batches past where it is now.
    fn wait_batches(&self, more: u64) {
        let now: Vec<u64> = self
            .shared
            .batches
            .iter()
            .map(|b| b.load(Ordering::Acquire))
            .collect();
        let deadline = Instant::now() + Duration::from_secs(120);
        for (q, b) in self.shared.batches.iter().enumerate() {
            while b.load(Ordering::Acquire) < now[q] + more {
                assert!(Instant::now() < deadline, "queue {q} made no progress");
                std::thread::sleep(Duration::from_millis(5));
            }
        }
    }

    /// Pause the drivers (the vCPUs) where they are, batches in flight included.
    fn pause_drivers(&self, threads: Threads) -> Vec<Driver> {
        self.shared.pause.store(true, Ordering::Release);
        let drivers = threads
            .into_iter()
            .map(|t| t.join().expect("a driver failed"))
            .collect();
        self.shared.pause.store(false, Ordering::Release);
        drivers
    }

    /// Stop the drivers after their batches in flight and merge their models (each owns its
    /// blocks).
    fn stop_drivers(&mut self, threads: Threads) {
        self.shared.stop.store(true, Ordering::Release);
        for (q, t) in threads.into_iter().enumerate() {
            let d = t.join().expect("a driver failed");
            assert!(d.pending.is_none());
            let m = d.model;
            for b in (q as u64..DISK / BLOCK).step_by(QUEUES) {
                let at = (b * BLOCK) as usize;
                self.model[at..at + BLOCK as usize].copy_from_slice(&m[at..at + BLOCK as usize]);
            }
        }
        self.shared.stop.store(false, Ordering::Release);
    }

    fn check_image(&self) {
        let f = read_file(&self.img);
        assert_same(&f, &self.model, "the image against the model");
    }
}

fn opts() -> BackendOpts {
    BackendOpts {
        num_queues: Some(QUEUES as u32),
        ..BackendOpts::default()
    }
}

/// Start-up, I/O on two queues, a memory hotplug while the I/O runs (ADD_MEM_REG, then
/// buffers in the new region), and the region's removal (REM_MEM_REG, which libblkio sends
/// and cloud-hypervisor does not) once no buffer is in it.
#[test]
fn cloud_hypervisor_start_up_io_and_memory_hotplug() {
    if skip_unless_vublk("cloud-hypervisor's sequence against vublk") {
        return;
    }
    let dir = TestDir::new("ch-start");
    let mut run = run_setup(&dir, 11);
    let backend = Backend::start(&dir, &run.img, &opts());
    let mut dev = create(&backend.socket);
    assert_eq!(guest_acked(dev.acked) & IN_ORDER, IN_ORDER);
    let bases = avail_indices(&run.ram);
    dev.activate(&[&run.ram], &run.ram, &bases);
    let drivers = run.start_drivers(&dev);
    run.wait_batches(20);
    // `hotplug_ram_region` → `update_memory` → ADD_MEM_REG, with I/O running; the guest
    // uses the memory only after.
    assert!(dev
        .protocol
        .contains(VhostUserProtocolFeatures::CONFIGURE_MEM_SLOTS));
    dev.fe.add_mem_region(&run.hot.info()).unwrap();
    run.shared.use_hot.store(true, Ordering::Release);
    run.wait_batches(40);
    run.shared.use_hot.store(false, Ordering::Release);
    // A batch begun after the flag and finished: nothing is in the region any more.
    run.wait_batches(2);
    dev.fe.remove_mem_region(&run.hot.info()).unwrap();
    run.wait_batches(20);
    run.stop_drivers(drivers);
    drop(dev);
    assert_eq!(backend.sigterm_and_wait(EXIT_DEADLINE).code(), Some(0));
    run.check_image();
    let log = backend.log_contents();
    assert!(
        log.contains("VIRTIO_F_IN_ORDER negotiated"),
        "vublk did not log IN_ORDER:\n{log}"
    );
}

/// vublk killed under I/O and started again: cloud-hypervisor sees the socket hang up and
/// reconnects (`reinitialize_vhost_user`): SET_OWNER, GET_FEATURES, SET_PROTOCOL_FEATURES
/// with the set agreed before (no GET_PROTOCOL_FEATURES, GET_QUEUE_NUM or GET_CONFIG), then
/// the activation again with the same inflight region, the memory as it is now (the
/// hotplugged region included) and each queue's base the avail index in guest memory. It
/// kicks nothing: vublk must find the requests on its own (the inflight region's, and those
/// still in the available ring). The guest's drivers wait; every request completes once.
#[test]
fn cloud_hypervisor_reconnects_to_a_restarted_vublk() {
    if skip_unless_vublk("cloud-hypervisor's sequence against vublk") {
        return;
    }
    let dir = TestDir::new("ch-reconnect");
    let mut run = run_setup(&dir, 12);
    let first = Backend::start(&dir, &run.img, &opts());
    let mut dev = create(&first.socket);
    dev.activate(&[&run.ram], &run.ram, &avail_indices(&run.ram));
    dev.fe.add_mem_region(&run.hot.info()).unwrap();
    run.shared.use_hot.store(true, Ordering::Release);
    let drivers = run.start_drivers(&dev);
    // Three kills, each under I/O (the drivers always have a batch out; whether vublk has
    // taken it yet is the moment's).
    let mut backend = first;
    let mut resubmitted = Vec::new();
    for _ in 0..3 {
        run.wait_batches(10);
        backend.signal(libc::SIGKILL);
        backend.wait_exit(EXIT_DEADLINE);
        wait_unlocked(&run.img, Duration::from_secs(10));
        backend = Backend::start(&dir, &run.img, &opts());
        // The reconnect, on the new socket.
        dev.fe = connect_again(&backend.socket, dev.acked, dev.protocol).fe;
        reactivate(&mut dev, &run);
        run.wait_batches(10);
        resubmitted.extend(
            backend
                .log_contents()
                .lines()
                .filter(|l| l.contains("resubmitting"))
                .map(str::to_owned),
        );
    }
    run.wait_batches(10);
    run.stop_drivers(drivers);
    drop(dev);
    assert_eq!(backend.sigterm_and_wait(EXIT_DEADLINE).code(), Some(0));
    run.check_image();
    println!("after the kills: {resubmitted:?}");
}

/// The activation replayed on a new connection with the device's own eventfds (the VMM's
/// ioeventfds and irqfds outlive the backend; the drivers kick the same ones).
fn reactivate(dev: &mut Device, run: &Run) {
    let (kicks, calls) = (&dev.kicks, &dev.calls);
    let fe = &mut dev.fe;
    fe.set_features(guest_acked(dev.acked) | PROTOCOL_FEATURES)
        .unwrap();
    fe.set_mem_table(&[run.ram.info(), run.hot.info()]).unwrap();
    for q in 0..QUEUES {
        fe.set_vring_num(q, QSIZE).unwrap();
    }
    let (info, file) = dev.inflight.as_ref().expect("no inflight region");
    fe.set_inflight_fd(info, file.as_raw_fd()).unwrap();
    let bases = avail_indices(&run.ram);
    for q in 0..QUEUES {
        let ram = &run.ram;
        let config = ring_config(ram, q, false);
        fe.set_vring_addr(q, &config).unwrap();
        fe.set_vring_base(q, bases[q]).unwrap();
        fe.set_vring_call(q, &calls[q]).unwrap();
        fe.set_vring_kick(q, &kicks[q]).unwrap();
    }
    for q in 0..QUEUES {
        fe.set_vring_enable(q, true).unwrap();
    }
}

/// A new connection as cloud-hypervisor makes it to a backend it has met before (a
/// reconnect, or a migration's destination with the source's settings): SET_OWNER,
/// GET_FEATURES, SET_PROTOCOL_FEATURES with the set agreed before, NEED_REPLY after it. No
/// GET_PROTOCOL_FEATURES, GET_QUEUE_NUM or GET_CONFIG.
fn connect_again(
    socket: &std::path::Path,
    acked: u64,
    protocol: VhostUserProtocolFeatures,
) -> Device {
    let mut fe = Frontend::connect(socket, QUEUES as u64).unwrap();
    fe.set_owner().unwrap();
    let offered = fe.get_features().unwrap();
    assert_eq!(offered & acked, acked, "features changed");
    fe.set_protocol_features(protocol).unwrap();
    fe.set_hdr_flags(VhostUserHeaderFlag::NEED_REPLY);
    Device {
        fe,
        kicks: Vec::new(),
        calls: Vec::new(),
        inflight: None,
        acked,
        protocol,
    }
}

/// The dirty log cloud-hypervisor hands the backend (`start_dirty_log`, `dirty_log`): one
/// bit per 4 KiB page from GPA 0 to the end of guest memory, a fresh memfd for every pass.
struct DirtyLog {
    file: File,
    ptr: *mut u8,
    len: u64,
}

impl DirtyLog {
    fn new(ram_end: u64) -> DirtyLog {
        let len = ram_end / (4096 * 8) + 1;
        let file = memfd(len);
        // SAFETY: a new shared mapping of the whole file.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        assert_ne!(ptr, libc::MAP_FAILED);
        DirtyLog {
            file,
            ptr: ptr.cast(),
            len,
        }
    }

    fn region(&self) -> vhost::VhostUserDirtyLogRegion {
        vhost::VhostUserDirtyLogRegion {
            mmap_size: self.len,
            mmap_offset: 0,
            mmap_handle: self.file.as_raw_fd(),
        }
    }

    /// The guest physical addresses of the pages marked.
    fn pages(&self) -> Vec<u64> {
        let mut out = Vec::new();
        for byte in 0..self.len {
            // SAFETY: inside the mapping.
            let b = unsafe { self.ptr.add(byte as usize).read_volatile() };
            for bit in 0..8 {
                if b & (1 << bit) != 0 {
                    out.push((byte * 8 + bit) * 4096);
                }
            }
        }
        out
    }
}

impl Drop for DirtyLog {
    fn drop(&mut self) {
        // SAFETY: our own mapping.
        unsafe { libc::munmap(self.ptr.cast(), self.len as usize) };
    }
}

fn copy(from: &Ram, to: &Ram, gpa: u64, len: u64) {
    let mut buf = vec![0u8; len as usize];
    from.mem.read_slice(&mut buf, GuestAddress(gpa)).unwrap();
    to.mem.write_slice(&buf, GuestAddress(gpa)).unwrap();
}

/// A precopy pass: what the backend logged (`log`) and what the guest wrote (KVM's log,
/// here the pages the drivers write), from the source's memory to the destination's.
fn copy_pass(from: &Ram, to: &Ram, log: &DirtyLog) -> usize {
    let mut n = 0;
    for gpa in log.pages() {
        if gpa >= from.gpa && gpa + 4096 <= from.gpa + from.len {
            copy(from, to, gpa, 4096);
            n += 1;
        }
    }
    for (gpa, len) in guest_written_pages() {
        copy(from, to, gpa, len);
    }
    n
}

/// cloud-hypervisor's live migration (`send_migration`), vublk on both sides over one image
/// (shared storage: the destination's vublk starts with `--incoming`):
/// - source, with I/O running: SET_LOG_BASE (a memfd), SET_FEATURES with LOG_ALL, each
///   queue's SET_VRING_ADDR with the log flag and the used ring's guest address; the memory
///   copied whole, then passes that each hand vublk a new log and copy what the old one
///   marked;
/// - the pause: the vCPUs, then SET_VRING_ENABLE(0) on every queue (no GET_VRING_BASE:
///   vublk offers no DEVICE_STATE), vublk completing what it took and handing the image
///   over at the last; two more log passes; the socket closed;
/// - destination: the connection with the source's settings, the activation (bases: the
///   avail indices in the memory received; a new inflight region), SET_VRING_ENABLE(1) again
///   at the resume.
///
/// The destination's memory must equal the source's (every page vublk wrote was logged),
/// the batches in flight at the pause complete on the destination (requests the source never
/// took included), in order, and the image ends equal to the model.
#[test]
fn cloud_hypervisor_migrates_the_guest_to_another_vublk() {
    if skip_unless_vublk("cloud-hypervisor's sequence against vublk") {
        return;
    }
    let dir_a = TestDir::new("ch-migrate-a");
    let dir_b = TestDir::new("ch-migrate-b");
    let mut run = run_setup(&dir_a, 13);
    let a = Backend::start(&dir_a, &run.img, &opts());
    let b = Backend::start(
        &dir_b,
        &run.img,
        &BackendOpts {
            extra_args: vec!["--incoming".into()],
            ..opts()
        },
    );
    let mut src = create(&a.socket);
    src.activate(&[&run.ram], &run.ram, &avail_indices(&run.ram));
    let threads = run.start_drivers(&src);
    run.wait_batches(10);

    // start_dirty_log.
    let ram_end = RAM_GPA + RAM_LEN;
    let mut log = DirtyLog::new(ram_end);
    src.fe.set_log_base(0, Some(log.region())).unwrap();
    src.fe
        .set_features(guest_acked(src.acked) | PROTOCOL_FEATURES | LOG_ALL)
        .unwrap();
    let ram = run.ram.clone();
    for q in 0..QUEUES {
        let config = ring_config(&ram, q, true);
        src.fe.set_vring_addr(q, &config).unwrap();
    }
    // Precopy: everything, then passes while the guest runs.
    let dest = Ram::new(RAM_GPA, RAM_LEN);
    copy(&ram, &dest, RAM_GPA, RAM_LEN);
    let mut logged = 0;
    let mut pass = |src: &mut Device, log: &mut DirtyLog| {
        let next = DirtyLog::new(ram_end);
        src.fe.set_log_base(0, Some(next.region())).unwrap();
        let old = std::mem::replace(log, next);
        logged += copy_pass(&ram, &dest, &old);
    };
    for _ in 0..3 {
        run.wait_batches(5);
        pass(&mut src, &mut log);
    }
    // The pause: vCPUs first (batches stay in flight), then every queue.
    let mut drivers = run.pause_drivers(threads);
    let in_flight = drivers.iter().filter(|d| d.pending.is_some()).count();
    for q in 0..QUEUES {
        src.fe.set_vring_enable(q, false).unwrap();
    }
    pass(&mut src, &mut log);
    pass(&mut src, &mut log);
    let (acked, protocol) = (src.acked, src.protocol);
    drop(src);
    assert!(logged > 0, "vublk logged no page");
    // Every page vublk wrote reached the destination.
    for page in (0..RAM_LEN).step_by(4096) {
        let (mut x, mut y) = (vec![0u8; 4096], vec![0u8; 4096]);
        ram.mem
            .read_slice(&mut x, GuestAddress(RAM_GPA + page))
            .unwrap();
        dest.mem
            .read_slice(&mut y, GuestAddress(RAM_GPA + page))
            .unwrap();
        assert!(
            x == y,
            "guest page {:#x} differs on the destination: written and not logged",
            RAM_GPA + page
        );
    }
    assert!(
        a.log_contents().contains("handed the image over"),
        "{}",
        a.log_contents()
    );

    // The destination.
    let mut dst = connect_again(&b.socket, acked, protocol);
    run.ram = dest.clone();
    dst.activate(&[&dest], &dest, &avail_indices(&dest));
    for q in 0..QUEUES {
        dst.fe.set_vring_enable(q, true).unwrap();
    }
    for d in drivers.iter_mut() {
        d.ram = dest.clone();
        d.kick = dst.kicks[d.q].try_clone().unwrap();
    }
    let threads = run.spawn(drivers);
    run.wait_batches(20);
    run.stop_drivers(threads);
    assert!(
        b.log_contents().contains("took the image over"),
        "{}",
        b.log_contents()
    );
    drop(dst);
    assert_eq!(b.sigterm_and_wait(EXIT_DEADLINE).code(), Some(0));
    assert_eq!(a.sigterm_and_wait(EXIT_DEADLINE).code(), Some(0));
    run.check_image();
    println!("migrated with {in_flight} batches in flight, {logged} logged pages copied");
}
