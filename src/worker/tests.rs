//! Whole-queue tests: a hand-built split ring in real guest memory, driven through the
//! worker with both engines. The driver side here is written from the virtio spec (2.7).

use std::fs::OpenOptions;
use std::path::PathBuf;
use std::sync::Arc;

use proptest::prelude::*;
use vhost_user_backend::{VringRwLock, VringT};
use vm_memory::{Bytes, GuestAddress, GuestMemoryAtomic};

use crate::guest_memory::Mem;

use super::QueueWorker;
use crate::device::CacheMode;
use crate::device::{Device, DeviceParams};
use crate::image::Engine;
use crate::image::Image as DiskImage;
use crate::io::align::DioAlign;
use crate::io::{SyncEngine, UringEngine};
use crate::virtio_blk::{req_type, status};

const QSIZE: u16 = 16;
const DESC: u64 = 0x0;
const AVAIL: u64 = 0x1000;
const USED: u64 = 0x2000;
const HDRS: u64 = 0x1_0000;
const DATA: u64 = 0x10_0000;
const MEM: usize = 0x40_0000;
const VIRTQ_DESC_F_NEXT: u16 = 1;
const VIRTQ_DESC_F_WRITE: u16 = 2;
const VIRTQ_DESC_F_INDIRECT: u16 = 4;

/// The driver side of one split virtqueue.
struct Driver {
    mem: Mem,
    atomic: GuestMemoryAtomic<Mem>,
    vring: VringRwLock<GuestMemoryAtomic<Mem>>,
    next_desc: u16,
    avail_idx: u16,
    hdr_next: u64,
}

impl Driver {
    fn new() -> Self {
        let mem = Mem::from_ranges(&[(GuestAddress(0), MEM)]).unwrap();
        let atomic = GuestMemoryAtomic::new(mem.clone());
        let vring = VringRwLock::new(atomic.clone(), QSIZE).unwrap();
        vring.set_queue_size(QSIZE);
        vring.set_queue_info(DESC, AVAIL, USED).unwrap();
        vring.set_queue_ready(true);
        vring.set_enabled(true);
        Driver {
            mem,
            atomic,
            vring,
            next_desc: 0,
            avail_idx: 0,
            hdr_next: HDRS,
        }
    }

    fn write_desc(&self, i: u16, addr: u64, len: u32, flags: u16, next: u16) {
        let at = GuestAddress(DESC + u64::from(i) * 16);
        self.mem.write_obj(addr, at).unwrap();
        self.mem.write_obj(len, GuestAddress(at.0 + 8)).unwrap();
        self.mem.write_obj(flags, GuestAddress(at.0 + 12)).unwrap();
        self.mem.write_obj(next, GuestAddress(at.0 + 14)).unwrap();
    }

    fn publish(&mut self, head: u16) {
        let slot = AVAIL + 4 + u64::from(self.avail_idx % QSIZE) * 2;
        self.mem.write_obj(head, GuestAddress(slot)).unwrap();
        self.avail_idx = self.avail_idx.wrapping_add(1);
        self.mem
            .write_obj(self.avail_idx, GuestAddress(AVAIL + 2))
            .unwrap();
    }

    /// A chain of (addr, len, device-writable) descriptors; returns its head.
    fn add_chain(&mut self, descs: &[(u64, u32, bool)]) -> u16 {
        let head = self.next_desc;
        for (k, &(addr, len, w)) in descs.iter().enumerate() {
            let i = (head + k as u16) % QSIZE;
            let last = k + 1 == descs.len();
            let flags =
                if w { VIRTQ_DESC_F_WRITE } else { 0 } | if last { 0 } else { VIRTQ_DESC_F_NEXT };
            self.write_desc(i, addr, len, flags, (i + 1) % QSIZE);
        }
        self.next_desc = (head + descs.len() as u16) % QSIZE;
        self.publish(head);
        head
    }

    /// A request with a header at a fresh address; returns (head, status address).
    fn request(&mut self, type_: u32, sector: u64, data: &[(u64, u32, bool)]) -> (u16, u64) {
        let hdr = self.hdr_next;
        self.hdr_next += 32;
        self.mem.write_obj(type_, GuestAddress(hdr)).unwrap();
        self.mem.write_obj(0u32, GuestAddress(hdr + 4)).unwrap();
        self.mem.write_obj(sector, GuestAddress(hdr + 8)).unwrap();
        let status_addr = hdr + 16;
        self.mem
            .write_obj(0xffu8, GuestAddress(status_addr))
            .unwrap();
        let mut v = vec![(hdr, 16, false)];
        v.extend_from_slice(data);
        v.push((status_addr, 1, true));
        (self.add_chain(&v), status_addr)
    }

    fn status(&self, addr: u64) -> u8 {
        self.mem.read_obj(GuestAddress(addr)).unwrap()
    }

    fn used(&self) -> Vec<(u32, u32)> {
        let idx: u16 = self.mem.read_obj(GuestAddress(USED + 2)).unwrap();
        (0..idx)
            .map(|i| {
                let at = USED + 4 + u64::from(i % QSIZE) * 8;
                (
                    self.mem.read_obj(GuestAddress(at)).unwrap(),
                    self.mem.read_obj(GuestAddress(at + 4)).unwrap(),
                )
            })
            .collect()
    }
}

struct Image {
    path: PathBuf,
}

impl Drop for Image {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

fn image(tag: &str, data: &[u8]) -> Image {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/unit-tmp");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(format!("worker-{tag}-{}", std::process::id()));
    std::fs::write(&path, data).unwrap();
    Image { path }
}

fn device(img: &Image, read_only: bool) -> Arc<Device> {
    let file = OpenOptions::new()
        .read(true)
        .write(!read_only)
        .open(&img.path)
        .unwrap();
    let size_bytes = file.metadata().unwrap().len();
    Arc::new(Device::new(
        DiskImage::raw(file, size_bytes, read_only).guard_format_header(true),
        DeviceParams {
            logical_block_size: 512,
            read_only,
            num_queues: 1,
            queue_size: QSIZE,
            cache: CacheMode::Writeback,
            align: DioAlign::NONE,
            serial: b"worker-test".to_vec(),
            detect_zeroes: crate::zero::DetectZeroes::Off,
            discard_unmap: true,
            is_block_device: false,
        },
    ))
}

fn engines() -> Vec<Engine> {
    let mut v = vec![Engine::Sync(SyncEngine::new())];
    if let Ok(u) = UringEngine::new(64) {
        v.push(Engine::Uring(u));
    }
    v
}

fn run(d: &Driver, dev: Arc<Device>, engine: Engine) -> QueueWorker {
    let mut w = QueueWorker::new(0, dev, engine, d.atomic.clone());
    w.handle_kick(&d.vring);
    w.drain();
    w
}

#[test]
fn read_write_roundtrip_through_the_queue() {
    for engine in engines() {
        let name = engine.name();
        let img = image(&format!("rw-{name}"), &vec![0u8; 1 << 20]);
        let mut d = Driver::new();
        d.mem
            .write_slice(&[0x42u8; 4096], GuestAddress(DATA))
            .unwrap();
        let (_, st_w) = d.request(
            req_type::OUT,
            8,
            &[(DATA, 2048, false), (DATA + 2048, 2048, false)],
        );
        let mut w = QueueWorker::new(0, device(&img, false), engine, d.atomic.clone());
        w.handle_kick(&d.vring);
        w.drain();
        assert_eq!(d.status(st_w), status::OK, "{name}");
        // In-flight requests have no order (virtio): read only after the write completed.
        let (_, st_r) = d.request(req_type::IN, 8, &[(DATA + 8192, 4096, true)]);
        w.handle_kick(&d.vring);
        w.drain();
        assert_eq!(d.status(st_r), status::OK, "{name}");
        let mut back = [0u8; 4096];
        d.mem
            .read_slice(&mut back, GuestAddress(DATA + 8192))
            .unwrap();
        assert!(back.iter().all(|&b| b == 0x42), "{name}: read back differs");
        let used = d.used();
        assert_eq!(used.len(), 2);
        assert_eq!(used[1].1, 4097, "{name}: read used length is data + status");
        assert_eq!(w.in_flight(), 0);
        let f = std::fs::read(&img.path).unwrap();
        assert!(
            f[4096..8192].iter().all(|&b| b == 0x42),
            "{name}: file differs"
        );
    }
}

#[test]
fn multi_range_discard_and_write_zeroes_zero_every_range() {
    for engine in engines() {
        let name = engine.name();
        let img = image(&format!("ranges-{name}"), &vec![0x77u8; 1 << 20]);
        let mut d = Driver::new();
        // Three ranges: sectors 8..16, 64..72 (discard), 200..208 (write zeroes, unmap).
        let put = |d: &Driver, at: u64, sector: u64, n: u32, flags: u32| {
            d.mem.write_obj(sector, GuestAddress(at)).unwrap();
            d.mem.write_obj(n, GuestAddress(at + 8)).unwrap();
            d.mem.write_obj(flags, GuestAddress(at + 12)).unwrap();
        };
        put(&d, DATA, 8, 8, 0);
        put(&d, DATA + 16, 64, 8, 0);
        put(&d, DATA + 32, 200, 8, 1);
        put(&d, DATA + 48, 300, 8, 0);
        let (_, st_d) = d.request(req_type::DISCARD, 0, &[(DATA, 32, false)]);
        let (_, st_z) = d.request(req_type::WRITE_ZEROES, 0, &[(DATA + 32, 32, false)]);
        run(&d, device(&img, false), engine);
        assert_eq!(d.status(st_d), status::OK, "{name}");
        assert_eq!(d.status(st_z), status::OK, "{name}");
        let f = std::fs::read(&img.path).unwrap();
        for (start, end) in [(8, 16), (64, 72), (200, 208), (300, 308)] {
            assert!(
                f[start * 512..end * 512].iter().all(|&b| b == 0),
                "{name}: {start}..{end}"
            );
        }
        assert!(
            f[16 * 512..64 * 512].iter().all(|&b| b == 0x77),
            "{name}: untouched data"
        );
    }
}

#[test]
fn read_only_device_refuses_writes_at_the_queue() {
    let img = image("ro", &vec![0x11u8; 1 << 20]);
    let mut d = Driver::new();
    d.mem
        .write_slice(&[0x99u8; 512], GuestAddress(DATA))
        .unwrap();
    let (_, st_w) = d.request(req_type::OUT, 0, &[(DATA, 512, false)]);
    d.mem.write_obj(0u64, GuestAddress(DATA + 4096)).unwrap();
    d.mem.write_obj(8u32, GuestAddress(DATA + 4104)).unwrap();
    d.mem.write_obj(0u32, GuestAddress(DATA + 4108)).unwrap();
    let (_, st_d) = d.request(req_type::DISCARD, 0, &[(DATA + 4096, 16, false)]);
    let (_, st_z) = d.request(req_type::WRITE_ZEROES, 0, &[(DATA + 4096, 16, false)]);
    let (_, st_r) = d.request(req_type::IN, 0, &[(DATA + 8192, 512, true)]);
    run(&d, device(&img, true), Engine::Sync(SyncEngine::new()));
    assert_eq!(d.status(st_w), status::IOERR);
    assert_eq!(d.status(st_d), status::IOERR);
    assert_eq!(d.status(st_z), status::IOERR);
    assert_eq!(d.status(st_r), status::OK);
    assert!(std::fs::read(&img.path).unwrap().iter().all(|&b| b == 0x11));
}

#[test]
fn get_id_unknown_type_and_missing_status() {
    let img = image("misc", &vec![0u8; 1 << 20]);
    let mut d = Driver::new();
    let (_, st_id) = d.request(req_type::GET_ID, 0, &[(DATA, 20, true)]);
    let (_, st_x) = d.request(0x1234, 0, &[]);
    let h = d.add_chain(&[(HDRS + 0x8000, 16, false)]);
    run(&d, device(&img, false), Engine::Sync(SyncEngine::new()));
    assert_eq!(d.status(st_id), status::OK);
    let mut id = [0u8; 20];
    d.mem.read_slice(&mut id, GuestAddress(DATA)).unwrap();
    assert_eq!(&id[..11], b"worker-test");
    assert_eq!(d.status(st_x), status::UNSUPP);
    let used = d.used();
    assert_eq!(used.len(), 3);
    assert_eq!(
        used[2],
        (u32::from(h), 0),
        "no status byte: nothing written"
    );
}

/// Descriptors as a hostile driver might write them.
#[derive(Debug, Clone)]
struct RawDesc {
    addr: u64,
    len: u32,
    flags: u16,
    next: u16,
}

fn raw_desc() -> impl Strategy<Value = RawDesc> {
    (
        prop_oneof![
            Just(HDRS),
            Just(DATA),
            Just(MEM as u64 - 8),
            any::<u64>(),
            0u64..MEM as u64
        ],
        prop_oneof![Just(16u32), Just(1), Just(512), Just(4096), any::<u32>()],
        0u16..8,
        0u16..QSIZE + 2,
    )
        .prop_map(|(addr, len, flags, next)| RawDesc {
            addr,
            len,
            flags,
            next,
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]
    /// Whatever the descriptor table and avail ring hold, the worker neither panics nor hangs,
    /// and every used entry names a valid head.
    #[test]
    fn hostile_descriptor_tables_never_panic_or_hang(
        descs in proptest::collection::vec(raw_desc(), QSIZE as usize),
        heads in proptest::collection::vec(0u16..QSIZE + 4, 1..QSIZE as usize),
        header_type in prop_oneof![Just(req_type::IN), Just(req_type::OUT), Just(req_type::DISCARD), Just(req_type::WRITE_ZEROES), any::<u32>()],
        sector in prop_oneof![Just(0u64), Just(2040u64), any::<u64>()],
    ) {
        let img = image("fuzz", &vec![0u8; 1 << 20]);
        let mut d = Driver::new();
        for (i, r) in descs.iter().enumerate() {
            d.write_desc(i as u16, r.addr, r.len, r.flags & (VIRTQ_DESC_F_NEXT | VIRTQ_DESC_F_WRITE | VIRTQ_DESC_F_INDIRECT), r.next);
        }
        d.mem.write_obj(header_type, GuestAddress(HDRS)).unwrap();
        d.mem.write_obj(sector, GuestAddress(HDRS + 8)).unwrap();
        d.mem.write_obj(1u64, GuestAddress(DATA)).unwrap();
        d.mem.write_obj(8u32, GuestAddress(DATA + 8)).unwrap();
        for &h in &heads {
            d.publish(h);
        }
        let w = run(&d, device(&img, false), Engine::Sync(SyncEngine::new()));
        prop_assert_eq!(w.in_flight(), 0);
        for (id, _) in d.used() {
            prop_assert!(id < u32::from(QSIZE));
        }
        prop_assert_eq!(std::fs::metadata(&img.path).unwrap().len(), 1 << 20, "image never grows");
    }
}

/// tmpfs has no FALLOC_FL_ZERO_RANGE: WRITE_ZEROES falls back to punch + allocate, and the
/// device remembers not to try ZERO_RANGE again.
#[test]
fn write_zeroes_falls_back_where_zero_range_is_missing() {
    let shm = std::path::Path::new("/dev/shm");
    if !shm.is_dir() {
        crate::testing::note_skip("no /dev/shm (tmpfs) to test the fallback on");
        return;
    }
    for engine in engines() {
        let name = engine.name();
        let path = shm.join(format!("vublk-zr-{name}-{}", std::process::id()));
        std::fs::write(&path, vec![0x55u8; 1 << 20]).unwrap();
        let img = Image { path };
        let dev = device(&img, false);
        let mut d = Driver::new();
        for (i, sector) in [16u64, 64].iter().enumerate() {
            let at = DATA + i as u64 * 16;
            d.mem.write_obj(*sector, GuestAddress(at)).unwrap();
            d.mem.write_obj(8u32, GuestAddress(at + 8)).unwrap();
            d.mem.write_obj(0u32, GuestAddress(at + 12)).unwrap();
        }
        let (_, st1) = d.request(req_type::WRITE_ZEROES, 0, &[(DATA, 16, false)]);
        let mut w = QueueWorker::new(0, dev.clone(), engine, d.atomic.clone());
        w.handle_kick(&d.vring);
        w.drain();
        assert_eq!(d.status(st1), status::OK, "{name}");
        assert!(
            dev.no_zero_range.load(std::sync::atomic::Ordering::Relaxed),
            "{name}"
        );
        let (_, st2) = d.request(req_type::WRITE_ZEROES, 0, &[(DATA + 16, 16, false)]);
        w.handle_kick(&d.vring);
        w.drain();
        assert_eq!(d.status(st2), status::OK, "{name}");
        let f = std::fs::read(&img.path).unwrap();
        assert!(f[16 * 512..24 * 512].iter().all(|&b| b == 0), "{name}");
        assert!(f[64 * 512..72 * 512].iter().all(|&b| b == 0), "{name}");
        assert!(f[24 * 512..64 * 512].iter().all(|&b| b == 0x55), "{name}");
    }
}

/// A probed raw image: a guest write that would make sector 0 look like qcow2 is refused
/// (next start would serve the image as qcow2); other writes to sector 0 go through.
#[test]
fn probed_raw_refuses_planting_a_format_header() {
    let img = image("plant", &vec![0u8; 1 << 20]);
    let mut d = Driver::new();
    let mut hdr = [0u8; 512];
    hdr[..4].copy_from_slice(b"QFI\xfb");
    d.mem.write_slice(&hdr, GuestAddress(DATA)).unwrap();
    let (_, st_bad) = d.request(req_type::OUT, 0, &[(DATA, 512, false)]);
    d.mem
        .write_slice(&[7u8; 512], GuestAddress(DATA + 4096))
        .unwrap();
    let (_, st_ok) = d.request(req_type::OUT, 1, &[(DATA + 4096, 512, false)]);
    run(&d, device(&img, false), Engine::Sync(SyncEngine::new()));
    assert_eq!(d.status(st_bad), status::IOERR);
    assert_eq!(d.status(st_ok), status::OK);
    let f = std::fs::read(&img.path).unwrap();
    assert!(
        f[..512].iter().all(|&b| b == 0),
        "the header must not reach the file"
    );
    assert!(f[512..1024].iter().all(|&b| b == 7));
}

/// Run `f` on another thread; fail (instead of hanging the suite) if it takes longer than
/// `secs` seconds: a queue that spins never returns from a kick.
fn within<T: Send + 'static>(secs: u64, what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(std::time::Duration::from_secs(secs))
        .unwrap_or_else(|_| panic!("{what}: no return within {secs} s (spinning?)"))
}

/// Avail indexes the device cannot follow: far ahead (one kick with idx 60000), one chain
/// more than the ring holds, the device's own index moved (SET_VRING_BASE) while the driver's
/// stays. The kick returns, nothing is processed, and once the queue is stopped and set up
/// again it serves requests.
#[test]
fn an_avail_index_too_far_ahead_stops_the_queue_instead_of_spinning() {
    for case in ["far ahead", "one ring too many", "device index moved"] {
        let img = image("broken-avail", &vec![0u8; 1 << 20]);
        let dev = device(&img, false);
        let mut d = Driver::new();
        let (_, st) = d.request(req_type::IN, 0, &[(DATA, 512, true)]);
        match case {
            "far ahead" => d.mem.write_obj(60000u16, GuestAddress(AVAIL + 2)).unwrap(),
            "one ring too many" => d.mem.write_obj(QSIZE + 1, GuestAddress(AVAIL + 2)).unwrap(),
            _ => d.vring.set_queue_next_avail(1000),
        }
        let (vring, atomic) = (d.vring.clone(), d.atomic.clone());
        let w = within(10, case, move || {
            let mut w = QueueWorker::new(0, dev, Engine::Sync(SyncEngine::new()), atomic);
            w.handle_kick(&vring);
            w.handle_kick(&vring);
            w
        });
        assert_eq!(d.status(st), 0xff, "{case}: a request was processed");
        assert!(d.used().is_empty(), "{case}: used ring written");
        assert!(w.broken.is_some(), "{case}: not marked broken");
        // The frontend stops the queue (GET_VRING_BASE drains) and sets it up again.
        let mut w = w;
        w.drain();
        assert!(w.broken.is_none());
        d.vring.set_queue_next_avail(0);
        d.mem.write_obj(1u16, GuestAddress(AVAIL + 2)).unwrap();
        w.handle_kick(&d.vring);
        w.drain();
        assert_eq!(
            d.status(st),
            status::OK,
            "{case}: not served after the reset"
        );
    }
}

/// Rings whose parts do not lie in guest memory are never processed (no read of the ring,
/// no write to the used ring outside memory), and the kick returns.
#[test]
fn rings_outside_guest_memory_are_not_processed() {
    for (what, desc, avail, used) in [
        ("descriptor table", MEM as u64 - 16, AVAIL, USED),
        ("available ring", DESC, MEM as u64 - 8, USED),
        ("used ring", DESC, AVAIL, MEM as u64 - 16),
    ] {
        let img = image("ring-outside", &vec![0u8; 1 << 20]);
        let mut d = Driver::new();
        let (_, st) = d.request(req_type::IN, 0, &[(DATA, 512, true)]);
        d.vring.set_queue_info(desc, avail, used).unwrap();
        let (vring, atomic, dev) = (d.vring.clone(), d.atomic.clone(), device(&img, false));
        let w = within(10, what, move || {
            let mut w = QueueWorker::new(0, dev, Engine::Sync(SyncEngine::new()), atomic);
            w.handle_kick(&vring);
            w
        });
        assert!(w.broken.is_some(), "{what}: not marked broken");
        assert_eq!(d.status(st), 0xff, "{what}: a request was processed");
    }
}

/// A chain cut short (a data descriptor outside guest memory, more descriptors than
/// seg_max) has no known status byte: nothing is written, in particular not the status byte
/// of the request before it, and it completes with used length 0.
#[test]
fn a_chain_cut_short_writes_no_status_anywhere() {
    let img = image("cut-short", &vec![0u8; 1 << 20]);
    let dev = device(&img, false);
    let mut d = Driver::new();
    let (_, st_ok) = d.request(req_type::IN, 0, &[(DATA, 512, true)]);
    let mut w = QueueWorker::new(0, dev, Engine::Sync(SyncEngine::new()), d.atomic.clone());
    w.handle_kick(&d.vring);
    w.drain();
    assert_eq!(d.status(st_ok), status::OK);
    // The guest reuses the first request's status byte for something else.
    d.mem.write_obj(0x5au8, GuestAddress(st_ok)).unwrap();
    let (_, st_bad) = d.request(req_type::IN, 0, &[(MEM as u64 - 256, 512, true)]);
    w.handle_kick(&d.vring);
    w.drain();
    assert_eq!(
        d.status(st_ok),
        0x5a,
        "the previous request's status byte was written"
    );
    assert_eq!(
        d.status(st_bad),
        0xff,
        "a status was written for a chain cut short"
    );
    assert_eq!(d.used().last().map(|u| u.1), Some(0));
}

/// A read whose data buffer is device-readable would transfer nothing: it fails.
#[test]
fn a_read_into_a_device_readable_buffer_fails() {
    let img = image("read-readable", &vec![0x11u8; 1 << 20]);
    let mut d = Driver::new();
    let (_, st) = d.request(req_type::IN, 0, &[(DATA, 512, false)]);
    run(&d, device(&img, false), Engine::Sync(SyncEngine::new()));
    assert_eq!(d.status(st), status::IOERR);
}

/// A driver that publishes requests while the device pops them (a guest with several vCPUs)
/// is not a broken ring: reaching the end of what was published when the device read the
/// index is the normal end of a batch. (Found as a guest hang in `vm_e2e`: mkfs on two vCPUs
/// stopped the queue when the driver published between the device's two reads of the index.)
#[test]
fn a_driver_publishing_while_the_device_pops_does_not_break_the_ring() {
    const CHAINS: u16 = 5;
    const TOTAL: u32 = 200_000; // the index wraps three times
    let img = image("racing-driver", &vec![0u8; 1 << 20]);
    let d = Driver::new();
    // Five GET_ID chains (header, 20-byte id buffer, status), never rewritten: the driver
    // only republishes their heads once the device has used them.
    for c in 0..CHAINS {
        let (i, hdr) = (c * 3, HDRS + u64::from(c) * 32);
        d.mem
            .write_obj(req_type::GET_ID, GuestAddress(hdr))
            .unwrap();
        d.write_desc(i, hdr, 16, VIRTQ_DESC_F_NEXT, i + 1);
        d.write_desc(
            i + 1,
            DATA + u64::from(c) * 32,
            20,
            VIRTQ_DESC_F_WRITE | VIRTQ_DESC_F_NEXT,
            i + 2,
        );
        d.write_desc(i + 2, hdr + 16, 1, VIRTQ_DESC_F_WRITE, 0);
    }
    let mem = d.mem.clone();
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let driver_done = done.clone();
    let driver = std::thread::spawn(move || {
        let (mut published, mut count) = (0u16, 0u32);
        while count < TOTAL {
            let used: u16 = mem
                .load(GuestAddress(USED + 2), std::sync::atomic::Ordering::Acquire)
                .unwrap();
            if published.wrapping_sub(used) < CHAINS {
                let slot = AVAIL + 4 + u64::from(published % QSIZE) * 2;
                mem.write_obj((published % CHAINS) * 3, GuestAddress(slot))
                    .unwrap();
                published = published.wrapping_add(1);
                count += 1;
                mem.store(
                    published,
                    GuestAddress(AVAIL + 2),
                    std::sync::atomic::Ordering::Release,
                )
                .unwrap();
            }
            std::hint::spin_loop();
        }
        driver_done.store(true, std::sync::atomic::Ordering::Release);
    });
    let mut w = QueueWorker::new(
        0,
        device(&img, false),
        Engine::Sync(SyncEngine::new()),
        d.atomic.clone(),
    );
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        w.handle_kick(&d.vring);
        assert!(
            w.broken.is_none(),
            "a racing driver was taken for a broken ring: {:?}",
            w.broken
        );
        let used: u16 = d.mem.read_obj(GuestAddress(USED + 2)).unwrap();
        if done.load(std::sync::atomic::Ordering::Acquire) && used == TOTAL as u16 {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "only {used} used");
    }
    driver.join().unwrap();
}

/// A pass that takes a request into every slot (the driver filled the ring) must still
/// re-arm notifications once slots are free again: with EVENT_IDX the driver kicks only
/// when its avail index passes `avail_event`, so a stale one means it never kicks again and
/// the next request waits for ever (`stalled` once stayed set for good).
#[test]
fn a_full_ring_does_not_leave_notifications_off() {
    for engine in engines() {
        let name = engine.name();
        let img = image(&format!("full-{name}"), &vec![0u8; 1 << 20]);
        let mut d = Driver::new();
        d.vring.set_queue_event_idx(true);
        // QSIZE flushes: one chain made available QSIZE times (slots = QSIZE).
        let (head, _) = d.request(req_type::FLUSH, 0, &[]);
        for _ in 1..QSIZE {
            d.publish(head);
        }
        let mut w = QueueWorker::new(0, device(&img, false), engine, d.atomic.clone());
        w.handle_kick(&d.vring);
        // Completions arrive as events (io_uring), or were reaped in the same pass (the
        // blocking engine): either way the queue is processed again once slots are free.
        let t0 = std::time::Instant::now();
        while d.used().len() < usize::from(QSIZE) {
            assert!(
                t0.elapsed().as_secs() < 10,
                "{name}: requests never completed"
            );
            std::thread::sleep(std::time::Duration::from_millis(1));
            w.handle_completions();
        }
        let avail_event: u16 = d
            .mem
            .read_obj(GuestAddress(USED + 4 + 8 * u64::from(QSIZE)))
            .unwrap();
        // The driver adds one more: does it kick? (virtio 2.7.10: it kicks when the new
        // index passes avail_event.)
        let (old, new) = (d.avail_idx, d.avail_idx.wrapping_add(1));
        let kicks = new.wrapping_sub(avail_event).wrapping_sub(1) < new.wrapping_sub(old);
        assert!(
            kicks,
            "{name}: avail_event {avail_event} after {old} requests: the driver would never \
             kick again"
        );
    }
}

/// The cost of the ring layer alone, per request, as the queue thread pays it through the
/// rust-vmm crates (virtio-queue's chain iterator and `add_used`, vm-memory's accessors on
/// vublk's guest-memory type): pop a 3-descriptor chain, read its descriptors and 16-byte
/// header, write the status byte, add it to the used ring. No parsing, no I/O, no vublk
/// bookkeeping. BENCHMARKS.md compares it with qemu-storage-daemon's whole cost per request
/// on the null disk: `cargo test --release --lib ring_layer_cost -- --ignored --nocapture`.
#[test]
#[ignore = "a measurement, run by hand"]
fn ring_layer_cost() {
    use virtio_queue::QueueOwnedT;
    use vm_memory::GuestAddressSpace;
    let mut d = Driver::new();
    let batch = 5u16; // 15 descriptors of the 16
    let rounds = 400_000u32;
    let mut spent = std::time::Duration::ZERO;
    let mem = d.atomic.memory();
    for _ in 0..rounds {
        d.next_desc = 0;
        d.hdr_next = HDRS;
        for _ in 0..batch {
            d.request(req_type::IN, 0, &[(DATA, 4096, true)]);
        }
        let start = std::time::Instant::now();
        let mut state = d.vring.get_mut();
        let mut n = 0;
        loop {
            let popped = match state.get_queue_mut().iter(&*mem) {
                Ok(mut chains) => chains.next(),
                Err(_) => None,
            };
            let Some(chain) = popped else {
                break;
            };
            let head = chain.head_index();
            let mut descs = [(0u64, 0u32, false); 4];
            let mut k = 0;
            for desc in chain {
                if k < descs.len() {
                    descs[k] = (desc.addr().0, desc.len(), desc.is_write_only());
                    k += 1;
                }
            }
            let hdr: [u8; 16] = mem.read_obj(GuestAddress(descs[0].0)).unwrap();
            std::hint::black_box(hdr);
            mem.write_obj(0u8, GuestAddress(descs[k - 1].0)).unwrap();
            state.add_used(head, 4097).unwrap();
            n += 1;
        }
        drop(state);
        spent += start.elapsed();
        assert_eq!(n, batch);
    }
    let per = spent.as_nanos() as f64 / (f64::from(rounds) * f64::from(batch));
    println!("ring layer: {per:.0} ns per request (pop, descriptors, header, status, add_used)");
}
