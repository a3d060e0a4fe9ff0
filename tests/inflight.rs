//! Inflight I/O tracking over a real socket: a test frontend (vhost's `Frontend`, memfd
//! guest memory, a hand-built split ring) keeps the inflight region across vublk processes
//! as QEMU does. The region is read and written by the test in the layout vublk documents
//! (src/inflight.rs): a process that completes requests leaves nothing marked; a new
//! process resubmits what a killed one left marked, in the order it was taken, then takes
//! new requests from the right place; a completion the dead process had already published
//! is not run again.

mod common;

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::time::{Duration, Instant};

use vhost::vhost_user::message::{VhostUserInflight, VhostUserProtocolFeatures};
use vhost::vhost_user::{Frontend, VhostUserFrontend};
use vhost::VhostBackend;
use vm_memory::{Bytes, GuestAddress};

use common::*;

/// Headers, status bytes and data of request `k` (its own 4 KiB buffer).
const HDRS: u64 = 0x3000;
const DATA: u64 = 0x10_0000;
/// The region's layout (src/inflight.rs), queue 0.
const OFF_LAST_BATCH_HEAD: usize = 12;
const OFF_USED_IDX: usize = 14;
const DESC0: usize = 16;

/// A mapping of the region's file, as the frontend (QEMU) holds it.
struct Region {
    file: File,
    info: VhostUserInflight,
    map: memmap_like::Map,
}

mod memmap_like {
    /// A shared mapping of a whole file, unmapped on drop.
    pub struct Map {
        pub ptr: *mut u8,
        pub len: usize,
    }
    impl Map {
        pub fn new(fd: i32, len: usize) -> Map {
            // SAFETY: a new shared mapping of a file of at least `len` bytes.
            let ptr = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_SHARED,
                    fd,
                    0,
                )
            };
            assert_ne!(ptr, libc::MAP_FAILED);
            Map {
                ptr: ptr.cast(),
                len,
            }
        }
    }
    impl Drop for Map {
        fn drop(&mut self) {
            // SAFETY: our own mapping.
            unsafe { libc::munmap(self.ptr.cast(), self.len) };
        }
    }
}

impl Region {
    fn u8_at(&self, off: usize) -> u8 {
        assert!(off < self.map.len);
        // SAFETY: inside the mapping.
        unsafe { self.map.ptr.add(off).read_volatile() }
    }
    fn u16_at(&self, off: usize) -> u16 {
        assert!(off + 2 <= self.map.len);
        // SAFETY: inside the mapping, 2-byte aligned offsets only.
        unsafe { self.map.ptr.add(off).cast::<u16>().read_volatile() }
    }
    fn set_u8(&self, off: usize, v: u8) {
        assert!(off < self.map.len);
        // SAFETY: inside the mapping.
        unsafe { self.map.ptr.add(off).write_volatile(v) }
    }
    fn set_u16(&self, off: usize, v: u16) {
        assert!(off + 2 <= self.map.len);
        // SAFETY: inside the mapping, aligned.
        unsafe { self.map.ptr.add(off).cast::<u16>().write_volatile(v) }
    }
    fn set_u64(&self, off: usize, v: u64) {
        assert!(off + 8 <= self.map.len);
        // SAFETY: inside the mapping, aligned.
        unsafe { self.map.ptr.add(off).cast::<u64>().write_volatile(v) }
    }
    fn inflight(&self, head: u16) -> u8 {
        self.u8_at(DESC0 + 16 * usize::from(head))
    }
    /// Record `head` as taken with `counter`, as a process that then died would have.
    fn mark(&self, head: u16, counter: u64) {
        let d = DESC0 + 16 * usize::from(head);
        self.set_u64(d + 8, counter);
        self.set_u8(d, 1);
    }
}

fn get_region(fe: &mut Frontend) -> Region {
    let (info, file) = fe
        .get_inflight_fd(&VhostUserInflight::new(0, 0, 1, QSIZE))
        .unwrap();
    assert_eq!(info.num_queues, 1);
    assert_eq!(info.queue_size, QSIZE);
    assert!(info.mmap_size >= 16 + 16 * u64::from(QSIZE));
    let map = memmap_like::Map::new(file.as_raw_fd(), info.mmap_size as usize);
    Region { file, info, map }
}

/// Request `k`: a 4 KiB write of byte `fill` at sector `sector`, chain at heads 3k..3k+2.
fn write_request(g: &Guest, k: u16, sector: u64, fill: u8) -> u16 {
    let hdr = HDRS + u64::from(k) * 32;
    let data = DATA + u64::from(k) * 4096;
    g.w(hdr, 1u32); // VIRTIO_BLK_T_OUT
    g.w(hdr + 4, 0u32);
    g.w(hdr + 8, sector);
    g.w(hdr + 16, 0xffu8); // status, to be overwritten
    g.mem
        .write_slice(&[fill; 4096], GuestAddress(GPA + data))
        .unwrap();
    let head = k * 3;
    g.desc(head, GPA + hdr, 16, 1, head + 1);
    g.desc(head + 1, GPA + data, 4096, 1, head + 2);
    g.desc(head + 2, GPA + hdr + 16, 1, 2, 0);
    head
}

fn status(g: &Guest, k: u16) -> u8 {
    g.r::<u8>(HDRS + u64::from(k) * 32 + 16)
}

fn opts() -> BackendOpts {
    BackendOpts {
        // The blocking engine completes in submission order: the used ring shows the
        // order requests were started in.
        extra_args: vec!["--aio".into(), "threads".into()],
        ..BackendOpts::default()
    }
}

/// Requests completed by a process leave nothing marked; the region's used index follows
/// the used ring.
#[test]
fn completed_requests_leave_the_region_clean() {
    if skip_unless_vublk("inflight tracking is vublk's") {
        return;
    }
    let dir = TestDir::new("inflight-clean");
    let img = dir.join("img.raw");
    create_pattern_image(&img, 16 * MIB, 3);
    let backend = Backend::start(&dir, &img, &opts());
    // `frontend` takes every protocol feature offered, INFLIGHT_SHMFD among them.
    let mut fe = frontend(&backend.socket);
    assert!(fe
        .get_protocol_features()
        .unwrap()
        .contains(VhostUserProtocolFeatures::INFLIGHT_SHMFD));
    let region = get_region(&mut fe);
    fe.set_inflight_fd(&region.info, region.file.as_raw_fd())
        .unwrap();
    let g = guest();
    fe.set_mem_table(&[g.region()]).unwrap();
    let heads: Vec<u16> = (0..4)
        .map(|k| write_request(&g, k, 8 * u64::from(k), 0x40 + k as u8))
        .collect();
    publish_heads(&g, &heads);
    let _kicks = start_queue(&mut fe, &g, USED);
    wait_used(&g, 4, 10, "first process");
    for k in 0..4 {
        assert_eq!(status(&g, k), 0, "request {k}");
        assert_eq!(
            region.inflight(heads[usize::from(k)]),
            0,
            "head {} still marked",
            heads[usize::from(k)]
        );
    }
    assert_eq!(region.u16_at(OFF_USED_IDX), 4);
    drop(fe);
    assert_eq!(backend.sigterm_and_wait(EXIT_DEADLINE).code(), Some(0));
    let f = read_file(&img);
    for k in 0..4usize {
        assert!(f[k * 4096..(k + 1) * 4096]
            .iter()
            .all(|&b| b == 0x40 + k as u8));
    }
}

/// A process killed with requests marked after it completed one out of order: the next one
/// (a new vublk, the same region and guest memory, SET_VRING_BASE = the used index as QEMU
/// sends after a crash) resubmits the marked ones in the order they were taken, then takes
/// the request behind them from the available ring, and runs nothing twice. (Taking the
/// ring from SET_VRING_BASE instead would run the completed one again and lose the first.)
#[test]
fn a_new_process_resubmits_what_the_killed_one_had_in_flight() {
    if skip_unless_vublk("inflight tracking is vublk's") {
        return;
    }
    let dir = TestDir::new("inflight-resubmit");
    let img = dir.join("img.raw");
    create_pattern_image(&img, 16 * MIB, 3);
    let original = read_file(&img);
    let g = guest();
    // Four requests published in the order heads 6, 0, 3, 9; the dead process had taken
    // the first three (counters 10, 11, 12) and completed head 0 (request 0) only.
    let heads: Vec<u16> = (0..4)
        .map(|k| write_request(&g, k, 8 * u64::from(k), 0x60 + k as u8))
        .collect();
    publish_heads(&g, &[heads[2], heads[0], heads[1], heads[3]]);
    g.w(USED + 4, u32::from(heads[0]));
    g.w(USED + 8, 1u32);
    g.w(USED + 2, 1u16);
    g.w(HDRS + 16, 0u8);

    let first = Backend::start(&dir, &img, &opts());
    let mut fe = frontend(&first.socket);
    let region = get_region(&mut fe);
    drop(fe);
    first.signal(libc::SIGKILL);
    first.wait_exit(EXIT_DEADLINE);
    wait_unlocked(&img, Duration::from_secs(5));
    region.mark(heads[2], 10);
    region.mark(heads[1], 12);
    region.set_u16(OFF_USED_IDX, 1);
    region.set_u16(OFF_LAST_BATCH_HEAD, heads[0]);

    let second = Backend::start(&dir, &img, &opts());
    let mut fe = frontend(&second.socket);
    fe.set_inflight_fd(&region.info, region.file.as_raw_fd())
        .unwrap();
    fe.set_mem_table(&[g.region()]).unwrap();
    let _kicks = start_queue_at(&mut fe, &g, USED, 1);
    wait_used(&g, 4, 10, "after the restart");
    assert_eq!(used_heads(&g), vec![heads[0], heads[2], heads[1], heads[3]]);
    for k in 1..4 {
        assert_eq!(status(&g, k), 0, "request {k}");
    }
    for h in &heads {
        assert_eq!(region.inflight(*h), 0);
    }
    drop(fe);
    assert_eq!(second.sigterm_and_wait(EXIT_DEADLINE).code(), Some(0));
    let f = read_file(&img);
    for k in 1..4usize {
        assert!(
            f[k * 4096..(k + 1) * 4096]
                .iter()
                .all(|&b| b == 0x60 + k as u8),
            "request {k} not written"
        );
    }
    // Request 0 (completed by the "dead process", which in this test never wrote it) did
    // not run again.
    assert_same(&f[..4096], &original[..4096], "request 0 ran again");
    assert_same(&f[4 * 4096..], &original[4 * 4096..], "beyond the requests");
}

/// The dead process had put request 1 on the used ring but died before clearing its mark
/// (the region's used index is behind the ring's): it is not run again. The request still
/// marked is.
#[test]
fn a_completion_the_dead_process_published_is_not_run_again() {
    if skip_unless_vublk("inflight tracking is vublk's") {
        return;
    }
    let dir = TestDir::new("inflight-repair");
    let img = dir.join("img.raw");
    create_pattern_image(&img, 16 * MIB, 5);
    let original = read_file(&img);
    let g = guest();
    let heads: Vec<u16> = (0..2)
        .map(|k| write_request(&g, k, 8 * u64::from(k), 0x70 + k as u8))
        .collect();
    publish_heads(&g, &heads);
    // The used ring holds request 1 (its status written, as the dead process did).
    g.w(USED + 4, u32::from(heads[1]));
    g.w(USED + 8, 1u32);
    g.w(USED + 2, 1u16);
    g.w(HDRS + 32 + 16, 0u8);

    let first = Backend::start(&dir, &img, &opts());
    let mut fe = frontend(&first.socket);
    let region = get_region(&mut fe);
    drop(fe);
    first.signal(libc::SIGKILL);
    first.wait_exit(EXIT_DEADLINE);
    wait_unlocked(&img, Duration::from_secs(5));
    region.mark(heads[0], 0);
    region.mark(heads[1], 1);
    region.set_u16(OFF_LAST_BATCH_HEAD, heads[1]);
    region.set_u16(DESC0 + 16 * usize::from(heads[1]) + 6, heads[1]);
    region.set_u16(OFF_USED_IDX, 0);

    let second = Backend::start(&dir, &img, &opts());
    let mut fe = frontend(&second.socket);
    fe.set_inflight_fd(&region.info, region.file.as_raw_fd())
        .unwrap();
    fe.set_mem_table(&[g.region()]).unwrap();
    let _kicks = start_queue_at(&mut fe, &g, USED, 1);
    wait_used(&g, 2, 10, "after the restart");
    assert_eq!(used_heads(&g), vec![heads[1], heads[0]]);
    assert_eq!(region.u16_at(OFF_USED_IDX), 2);
    drop(fe);
    assert_eq!(second.sigterm_and_wait(EXIT_DEADLINE).code(), Some(0));
    let f = read_file(&img);
    assert!(
        f[..4096].iter().all(|&b| b == 0x70),
        "the marked request was not resubmitted"
    );
    // Request 1 was not written again (the "dead process" never wrote it: the image keeps
    // the pattern, which a second run would have replaced).
    assert_same(&f[4096..], &original[4096..], "request 1 ran again");
}

/// A region that does not hold what it claims is refused, and the daemon goes on.
#[test]
fn bad_regions_are_refused() {
    if skip_unless_vublk("inflight tracking is vublk's") {
        return;
    }
    let dir = TestDir::new("inflight-bad");
    let img = dir.join("img.raw");
    create_pattern_image(&img, 16 * MIB, 5);
    let backend = Backend::start(&dir, &img, &opts());
    let mut fe = frontend(&backend.socket);
    let small = memfd(64);
    for (info, what) in [
        (
            VhostUserInflight::new(1 << 20, 0, 1, QSIZE),
            "beyond its file",
        ),
        (
            VhostUserInflight::new(64, 0, 4, QSIZE),
            "too small for its queues",
        ),
        (
            VhostUserInflight::new(64, 0, 1, 3),
            "queue size not a power of two",
        ),
    ] {
        assert!(
            fe.set_inflight_fd(&info, small.as_raw_fd()).is_err(),
            "{what}: accepted"
        );
        fe = frontend(&backend.socket);
    }
    assert!(
        fe.get_inflight_fd(&VhostUserInflight::new(0, 0, 64, QSIZE))
            .is_err(),
        "64 queues"
    );
    drop(fe);
    backend.assert_running();
    let mut c = connect_queues(&backend.socket, 1);
    assert!(c.read_at(0, 0, 4096).is_ok());
}

/// SET_VRING_ENABLE 0: the ring takes no new request, even from a queue that busy-polls,
/// until it is enabled again; then the request is served once.
#[test]
fn a_disabled_ring_takes_no_requests() {
    if skip_unless_vublk("vublk's ring handling") {
        return;
    }
    let dir = TestDir::new("ring-disabled");
    let img = dir.join("img.raw");
    create_pattern_image(&img, 16 * MIB, 9);
    let opts = BackendOpts {
        extra_args: vec!["--poll-us".into(), "10000".into()],
        ..BackendOpts::default()
    };
    let backend = Backend::start(&dir, &img, &opts);
    let mut fe = frontend(&backend.socket);
    let g = guest();
    fe.set_mem_table(&[g.region()]).unwrap();
    let h0 = write_request(&g, 0, 0, 0x51);
    publish_heads(&g, &[h0]);
    let (kick, _call) = start_queue(&mut fe, &g, USED);
    wait_used(&g, 1, 10, "enabled");
    // Disabled: a second request published and kicked is not taken.
    fe.set_vring_enable(0, false).unwrap();
    let h1 = write_request(&g, 1, 8, 0x52);
    publish_heads(&g, &[h0, h1]);
    kick.write(1).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(used_idx(&g), 1, "a disabled ring was processed");
    assert_eq!(status(&g, 1), 0xff);
    fe.set_vring_enable(0, true).unwrap();
    kick.write(1).unwrap();
    wait_used(&g, 2, 10, "enabled again");
    assert_eq!(status(&g, 1), 0);
    drop(fe);
    assert_eq!(backend.sigterm_and_wait(EXIT_DEADLINE).code(), Some(0));
}

/// Is `call` signalled (readable) within `within`?
fn signalled(call: &vmm_sys_util::eventfd::EventFd, within: Duration) -> bool {
    let mut p = libc::pollfd {
        fd: call.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd.
    let r = unsafe { libc::poll(&mut p, 1, within.as_millis() as i32) };
    r == 1 && p.revents & libc::POLLIN != 0
}

/// With EVENT_IDX (Linux guests negotiate it), a process put a completion on the used ring
/// while the driver's `used_event` asked for no interrupt yet, and was killed: the next
/// process interrupts the guest once when the queue starts, as libvhost-user does. (Its
/// `needs_notification` says no at the start, since it added nothing itself: a driver
/// whose last completions were published but never signalled would wait for ever.)
#[test]
fn a_restarted_vublk_interrupts_the_guest_at_queue_start_with_event_idx() {
    if skip_unless_vublk("vublk's queue start") {
        return;
    }
    let dir = TestDir::new("inflight-start-signal");
    let img = dir.join("img.raw");
    create_pattern_image(&img, 16 * MIB, 4);
    let g = guest();
    let first = Backend::start(&dir, &img, &opts());
    let mut fe = frontend(&first.socket);
    let acked = fe.get_features().unwrap();
    assert!(
        acked & (1 << virtio_bindings::virtio_ring::VIRTIO_RING_F_EVENT_IDX) != 0,
        "EVENT_IDX not offered"
    );
    let region = get_region(&mut fe);
    fe.set_inflight_fd(&region.info, region.file.as_raw_fd())
        .unwrap();
    fe.set_mem_table(&[g.region()]).unwrap();
    // used_event: interrupt only once the used index passes 100.
    g.w(AVAIL + 4 + 2 * u64::from(QSIZE), 100u16);
    let (kick, call) = start_queue(&mut fe, &g, USED);
    // The queue's start interrupts once, whatever used_event says; clear it.
    assert!(
        signalled(&call, Duration::from_secs(3)),
        "no signal at the start"
    );
    call.read().unwrap();
    let h = write_request(&g, 0, 0, 0x31);
    publish_heads(&g, &[h]);
    kick.write(1).unwrap();
    wait_used(&g, 1, 10, "first process");
    assert_eq!(status(&g, 0), 0);
    // The window: the completion is on the used ring, and no interrupt came (as asked).
    assert!(
        !signalled(&call, Duration::from_millis(200)),
        "interrupted although used_event said not yet"
    );
    first.signal(libc::SIGKILL);
    first.wait_exit(EXIT_DEADLINE);
    drop(fe);
    wait_unlocked(&img, Duration::from_secs(5));

    let second = Backend::start(&dir, &img, &opts());
    let mut fe = frontend(&second.socket);
    fe.set_inflight_fd(&region.info, region.file.as_raw_fd())
        .unwrap();
    fe.set_mem_table(&[g.region()]).unwrap();
    let (_kick, call) = start_queue_at(&mut fe, &g, USED, 1);
    assert!(
        signalled(&call, Duration::from_secs(3)),
        "the restarted vublk did not interrupt the guest at the queue's start:\n{}",
        second.log_contents()
    );
    drop(fe);
    assert_eq!(second.sigterm_and_wait(EXIT_DEADLINE).code(), Some(0));
}

/// Fill the file system at `dir` to the last byte with a file `name`.
fn fill_up(dir: &Path, name: &str) -> std::path::PathBuf {
    use std::io::Write;
    let p = dir.join(name);
    let mut f = File::create(&p).unwrap();
    let chunk = vec![0x11u8; 64 * 1024];
    while f.write_all(&chunk).is_ok() {}
    for n in [4096, 512, 1] {
        while f.write_all(&chunk[..n]).is_ok() {}
    }
    p
}

/// The error policy's held requests across process ends (docs/error-policy.md): writes to
/// a full file system are held, not completed; a SIGTERM leaves them marked in the region
/// (the daemon still exits at once), a SIGKILL too; a later vublk resubmits them, holds
/// them again while there is no space, and completes them with their data once there is.
#[test]
fn held_requests_stay_in_the_region_for_the_next_process() {
    if skip_unless_vublk("the error policy is vublk's") {
        return;
    }
    let dir = TestDir::new("inflight-held");
    let Some(fs) = Tmpfs::mount(&dir.join("fs"), 2 * MIB) else {
        return;
    };
    let img = fs.join("img.raw");
    create_sparse_image(&img, 16 * MIB);
    let filler = fill_up(fs.path(), "filler");
    let ctl = dir.join("ctl.sock");
    let mut o = opts();
    o.extra_args.extend(
        ["--error-retry-interval", "1", "--control-socket"]
            .iter()
            .map(|s| s.to_string()),
    );
    o.extra_args.push(ctl.display().to_string());
    let held = || {
        ctl_ok(&ctl, "status", &[])["error_policy"]["held"]["requests"]
            .as_u64()
            .unwrap_or(0)
    };
    let wait_held = |n: u64, what: &str| {
        let deadline = Instant::now() + Duration::from_secs(10);
        while held() != n {
            assert!(Instant::now() < deadline, "{what}: held {}", held());
            std::thread::sleep(Duration::from_millis(10));
        }
    };
    let g = guest();
    let heads: Vec<u16> = (0..4)
        .map(|k| write_request(&g, k, 64 * u64::from(k), 0x90 + k as u8))
        .collect();
    publish_heads(&g, &heads);

    // First: held, then a SIGTERM.
    let first = Backend::start(&dir, &img, &o);
    let mut fe = frontend(&first.socket);
    let region = get_region(&mut fe);
    fe.set_inflight_fd(&region.info, region.file.as_raw_fd())
        .unwrap();
    fe.set_mem_table(&[g.region()]).unwrap();
    let _kicks = start_queue(&mut fe, &g, USED);
    wait_held(4, "a full file system");
    let stopped = Instant::now();
    assert_eq!(first.sigterm_and_wait(EXIT_DEADLINE).code(), Some(0));
    assert!(
        stopped.elapsed() < Duration::from_secs(5),
        "{:?}",
        stopped.elapsed()
    );
    drop(fe);
    let log = first.log_contents();
    assert!(log.contains("left in the inflight region"), "{log}");
    assert_eq!(used_idx(&g), 0, "a held request completed");
    for (k, h) in heads.iter().enumerate() {
        assert_eq!(
            region.inflight(*h),
            1,
            "request {k} not marked after SIGTERM"
        );
        assert_eq!(status(&g, k as u16), 0xff, "request {k} got a status");
    }
    wait_unlocked(&img, Duration::from_secs(5));

    // Second: resubmitted, held again (still full), then a SIGKILL.
    let second = Backend::start(&dir, &img, &o);
    let mut fe = frontend(&second.socket);
    fe.set_inflight_fd(&region.info, region.file.as_raw_fd())
        .unwrap();
    fe.set_mem_table(&[g.region()]).unwrap();
    let _kicks = start_queue_at(&mut fe, &g, USED, 0);
    wait_held(4, "resubmitted to a full file system");
    second.signal(libc::SIGKILL);
    second.wait_exit(EXIT_DEADLINE);
    drop(fe);
    assert_eq!(used_idx(&g), 0, "a held request completed");
    for h in &heads {
        assert_eq!(region.inflight(*h), 1);
    }
    wait_unlocked(&img, Duration::from_secs(5));

    // Third, with space: everything completes, in the file.
    std::fs::remove_file(&filler).unwrap();
    let third = Backend::start(&dir, &img, &o);
    let mut fe = frontend(&third.socket);
    fe.set_inflight_fd(&region.info, region.file.as_raw_fd())
        .unwrap();
    fe.set_mem_table(&[g.region()]).unwrap();
    let _kicks = start_queue_at(&mut fe, &g, USED, 0);
    wait_used(&g, 4, 10, "with space again");
    for (k, h) in heads.iter().enumerate() {
        assert_eq!(status(&g, k as u16), 0, "request {k}");
        assert_eq!(region.inflight(*h), 0);
    }
    drop(fe);
    assert_eq!(third.sigterm_and_wait(EXIT_DEADLINE).code(), Some(0));
    for k in 0..4u64 {
        let f = read_file_range(&img, 64 * k * 512, 4096);
        assert!(
            f.iter().all(|&b| b == 0x90 + k as u8),
            "request {k} not in the file"
        );
    }
}
