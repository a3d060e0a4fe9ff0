//! Live-migration support over a real socket, with a test frontend (vhost's `Frontend`,
//! memfd guest memory, a hand-built split ring) in QEMU's place:
//! - dirty-page logging (`VHOST_F_LOG_ALL`, `LOG_SHMFD`): while the frontend logs, vublk
//!   marks exactly the guest pages it wrote for a request: the data pages of a read (written
//!   by the kernel through io_uring, not through vm-memory), the status byte's page, the
//!   used ring (at the ring and at the log address of SET_VRING_ADDR); not the pages it only
//!   read; nothing once LOG_ALL is switched off; a log beyond its file is refused;
//! - the image handover between two vublk processes (`--incoming`): the destination starts
//!   beside a serving source without taking locks, takes the image when its queues start
//!   after the source's stopped while logging, and sees every write the source completed
//!   (new qcow2 clusters included); the source writes nothing after it.

mod common;

use std::fs::File;
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use vhost::vhost_user::message::{VhostUserProtocolFeatures, VhostUserVirtioFeatures};
use vhost::vhost_user::{Frontend, VhostUserFrontend};
use vhost::{VhostBackend, VhostUserDirtyLogRegion, VringConfigData};
use vm_memory::{Bytes, GuestAddress};
use vmm_sys_util::eventfd::EventFd;

use common::*;

const PAGE: u64 = 4096;
/// Request headers (16 bytes each, 64 apart) and, one page further, status bytes.
const HDRS: u64 = 0x4000;
const STATUS: u64 = 0x6000;
/// Data buffers.
const DATA: u64 = 0x10_0000;
/// Where the test asks for used-ring writes to be logged (not the used ring itself).
const USED_LOG: u64 = 0x9000;
/// Bytes of dirty log covering guest memory: one bit per page of GPA + MEM_LEN.
const LOG_BYTES: u64 = (GPA + MEM_LEN) / PAGE / 8;

/// The frontend's dirty log: a memfd the test reads.
struct Log {
    file: File,
    ptr: *mut u8,
}

impl Log {
    fn new() -> Log {
        let file = memfd(LOG_BYTES);
        // SAFETY: a new shared mapping of the whole file.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                LOG_BYTES as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        assert_ne!(ptr, libc::MAP_FAILED);
        Log {
            file,
            ptr: ptr.cast(),
        }
    }

    fn region(&self) -> VhostUserDirtyLogRegion {
        VhostUserDirtyLogRegion {
            mmap_size: LOG_BYTES,
            mmap_offset: 0,
            mmap_handle: self.file.as_raw_fd(),
        }
    }

    /// Guest pages (offsets from GPA, in pages) marked dirty.
    fn dirty_pages(&self) -> Vec<u64> {
        let mut out = Vec::new();
        for byte in 0..LOG_BYTES {
            // SAFETY: inside the mapping.
            let b = unsafe { self.ptr.add(byte as usize).read_volatile() };
            for bit in 0..8 {
                if b & (1 << bit) != 0 {
                    let page = byte * 8 + bit;
                    out.push(page - GPA / PAGE);
                }
            }
        }
        out
    }

    fn clear(&self) {
        // SAFETY: inside the mapping.
        unsafe { std::ptr::write_bytes(self.ptr, 0, LOG_BYTES as usize) };
    }
}

impl Drop for Log {
    fn drop(&mut self) {
        // SAFETY: our own mapping.
        unsafe { libc::munmap(self.ptr.cast(), LOG_BYTES as usize) };
    }
}

/// Page number (from GPA) of guest offset `off`.
fn page(off: u64) -> u64 {
    off / PAGE
}

/// Request `k` (heads 4k..): type `ty` at `sector` over data segments (offset, length),
/// device-writable for reads.
fn request(g: &Guest, k: u16, ty: u32, sector: u64, segs: &[(u64, u32)]) -> u16 {
    let hdr = HDRS + u64::from(k) * 64;
    g.w(hdr, ty);
    g.w(hdr + 4, 0u32);
    g.w(hdr + 8, sector);
    g.w(STATUS + u64::from(k), 0xffu8);
    let head = k * 4;
    let write_only: u16 = if ty == 0 { 2 } else { 0 };
    g.desc(head, GPA + hdr, 16, 1, head + 1);
    for (i, &(off, len)) in segs.iter().enumerate() {
        let d = head + 1 + i as u16;
        g.desc(d, GPA + off, len, 1 | write_only, d + 1);
    }
    let last = head + 1 + segs.len() as u16;
    g.desc(last, GPA + STATUS + u64::from(k), 1, 2, 0);
    head
}

fn status(g: &Guest, k: u16) -> u8 {
    g.r::<u8>(STATUS + u64::from(k))
}

/// Make `head` available at position `pos`.
fn publish_at(g: &Guest, pos: u16, head: u16) {
    g.w(AVAIL + 4 + 2 * u64::from(pos % QSIZE), head);
    g.w(AVAIL + 2, pos.wrapping_add(1));
}

fn used_idx(g: &Guest) -> u16 {
    g.r::<u16>(USED + 2)
}

fn wait_used(g: &Guest, n: u16, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while used_idx(g) != n {
        assert!(
            Instant::now() < deadline,
            "{what}: used idx {} != {n}",
            used_idx(g)
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Queue 0 over `g` with its used-ring writes logged at `used_log`.
fn start_logged_queue(fe: &mut Frontend, g: &Guest, used_log: Option<u64>) -> (EventFd, EventFd) {
    fe.set_vring_num(0, QSIZE).unwrap();
    let config = VringConfigData {
        queue_max_size: QSIZE,
        queue_size: QSIZE,
        flags: u32::from(used_log.is_some()),
        desc_table_addr: g.hva + DESC,
        used_ring_addr: g.hva + USED,
        avail_ring_addr: g.hva + AVAIL,
        log_addr: used_log.map(|o| GPA + o),
    };
    fe.set_vring_addr(0, &config).unwrap();
    fe.set_vring_base(0, 0).unwrap();
    let kick = EventFd::new(0).unwrap();
    let call = EventFd::new(0).unwrap();
    fe.set_vring_call(0, &call).unwrap();
    fe.set_vring_kick(0, &kick).unwrap();
    fe.set_vring_enable(0, true).unwrap();
    (kick, call)
}

/// Features with VHOST_F_LOG_ALL on or off.
fn set_log_all(fe: &mut Frontend, on: bool) {
    let all = fe.get_features().unwrap();
    assert!(
        all & VhostUserVirtioFeatures::LOG_ALL.bits() != 0,
        "VHOST_F_LOG_ALL not offered"
    );
    let f = if on {
        all
    } else {
        all & !VhostUserVirtioFeatures::LOG_ALL.bits()
    };
    fe.set_features(f).unwrap();
}

/// With LOG_ALL on and a log set, a read marks its data pages (written through io_uring
/// straight into guest memory), its status page and the used ring (at the ring and at the
/// log address): no other page. A write marks only its status page and the used ring. With
/// LOG_ALL off again nothing is marked.
#[test]
fn logging_marks_exactly_the_pages_vublk_wrote() {
    if skip_unless_vublk("vublk's dirty logging") {
        return;
    }
    let dir = TestDir::new("migration-log");
    let img = dir.join("img.raw");
    create_pattern_image(&img, 16 * MIB, 5);
    // The default engine (io_uring) and cache mode (O_DIRECT): aligned reads land in guest
    // memory without vm-memory seeing them.
    let backend = Backend::start(&dir, &img, &BackendOpts::default());
    let mut fe = frontend(&backend.socket);
    assert!(fe
        .get_protocol_features()
        .unwrap()
        .contains(VhostUserProtocolFeatures::LOG_SHMFD));
    let g = guest();
    fe.set_mem_table(&[g.region()]).unwrap();
    let log = Log::new();
    set_log_all(&mut fe, true);
    fe.set_log_base(0, Some(log.region())).unwrap();
    let (kick, _call) = start_logged_queue(&mut fe, &g, Some(USED_LOG));

    // A read of 4 KiB + 8 KiB into pages DATA and DATA+3..DATA+4 (DATA+1, +2 untouched).
    let segs = [(DATA, 4096u32), (DATA + 3 * PAGE, 8192u32)];
    let head = request(&g, 0, 0, 8, &segs);
    log.clear();
    publish_at(&g, 0, head);
    kick.write(1).unwrap();
    wait_used(&g, 1, "read");
    assert_eq!(status(&g, 0), 0);
    let mut got = vec![0u8; 4096];
    g.mem
        .read_slice(&mut got, GuestAddress(GPA + DATA))
        .unwrap();
    assert_same(&got, &pattern(4096, 8 * 512, 5), "read data");
    let mut want = vec![
        page(DATA),
        page(DATA) + 3,
        page(DATA) + 4,
        page(STATUS),
        page(USED),
        page(USED_LOG),
    ];
    want.sort();
    assert_eq!(
        log.dirty_pages(),
        want,
        "read: dirty pages (data {:?}, status {}, used ring {}, used log {})",
        [page(DATA), page(DATA) + 3, page(DATA) + 4],
        page(STATUS),
        page(USED),
        page(USED_LOG)
    );

    // A write reads its data page: only the status byte and the used ring are written.
    g.mem
        .write_slice(&[0x5a; 4096], GuestAddress(GPA + DATA + 8 * PAGE))
        .unwrap();
    let head = request(&g, 1, 1, 64, &[(DATA + 8 * PAGE, 4096)]);
    log.clear();
    publish_at(&g, 1, head);
    kick.write(1).unwrap();
    wait_used(&g, 2, "write");
    assert_eq!(status(&g, 1), 0);
    let mut want = vec![page(STATUS), page(USED), page(USED_LOG)];
    want.sort();
    assert_eq!(log.dirty_pages(), want, "write: dirty pages");
    assert_same(
        &read_file_range(&img, 64 * 512, 4096),
        &[0x5a; 4096],
        "written data",
    );

    // LOG_ALL off (a migration finished or cancelled): nothing is marked any more.
    set_log_all(&mut fe, false);
    let head = request(&g, 2, 0, 16, &[(DATA + 12 * PAGE, 4096)]);
    log.clear();
    publish_at(&g, 2, head);
    kick.write(1).unwrap();
    wait_used(&g, 3, "read without logging");
    assert_eq!(status(&g, 2), 0);
    assert_eq!(log.dirty_pages(), Vec::<u64>::new(), "logging off");
    drop(fe);
    assert_eq!(backend.sigterm_and_wait(EXIT_DEADLINE).code(), Some(0));
}

/// A log region that claims more than its file holds is refused (its pages beyond the file
/// would raise SIGBUS when marked); the daemon goes on serving.
#[test]
fn a_log_beyond_its_file_is_refused() {
    if skip_unless_vublk("vublk's dirty logging") {
        return;
    }
    let dir = TestDir::new("migration-badlog");
    let img = dir.join("img.raw");
    create_pattern_image(&img, 16 * MIB, 6);
    let backend = Backend::start(&dir, &img, &BackendOpts::default());
    let mut fe = frontend(&backend.socket);
    let g = guest();
    fe.set_mem_table(&[g.region()]).unwrap();
    set_log_all(&mut fe, true);
    let small = memfd(PAGE);
    let r = fe.set_log_base(
        0,
        Some(VhostUserDirtyLogRegion {
            mmap_size: LOG_BYTES * 4,
            mmap_offset: 0,
            mmap_handle: small.as_raw_fd(),
        }),
    );
    assert!(r.is_err(), "a log beyond its file was accepted");
    drop(fe);
    backend.assert_running();
    // Still serving: a fresh frontend reads the image.
    let mut fe = frontend(&backend.socket);
    let g = guest();
    fe.set_mem_table(&[g.region()]).unwrap();
    let (kick, _call) = start_logged_queue(&mut fe, &g, None);
    let head = request(&g, 0, 0, 0, &[(DATA, 4096)]);
    publish_at(&g, 0, head);
    kick.write(1).unwrap();
    wait_used(&g, 1, "read after the refusal");
    assert_eq!(status(&g, 0), 0);
    drop(fe);
    assert_eq!(backend.sigterm_and_wait(EXIT_DEADLINE).code(), Some(0));
}

/// One frontend's queue session on `backend`: write `fill` into fresh clusters at the
/// sectors given, each its own request.
fn write_blocks(fe: &mut Frontend, g: &Guest, kick: &EventFd, first: u16, blocks: &[(u64, u8)]) {
    for (i, &(sector, fill)) in blocks.iter().enumerate() {
        let k = first + i as u16;
        let data = DATA + u64::from(k % 64) * PAGE;
        g.mem
            .write_slice(&[fill; 4096], GuestAddress(GPA + data))
            .unwrap();
        let head = request(g, k % 4, 1, sector, &[(data, 4096)]);
        publish_at(g, k, head);
        kick.write(1).unwrap();
        wait_used(g, k + 1, "write");
        assert_eq!(status(g, k % 4), 0, "write {k}");
    }
    let _ = fe;
}

/// Read 4 KiB at `sector` through the queue (position `k`).
fn read_block(g: &Guest, kick: &EventFd, k: u16, sector: u64) -> Vec<u8> {
    let data = DATA + 100 * PAGE;
    let head = request(g, k % 4, 0, sector, &[(data, 4096)]);
    publish_at(g, k, head);
    kick.write(1).unwrap();
    wait_used(g, k + 1, "read");
    assert_eq!(status(g, k % 4), 0, "read {k}");
    let mut out = vec![0u8; 4096];
    g.mem
        .read_slice(&mut out, GuestAddress(GPA + data))
        .unwrap();
    out
}

/// The handover, as QEMU drives it: vublk B starts with `--incoming` beside vublk A, which
/// serves a qcow2 (or parallels) image (locked); A's frontend logs, writes into new clusters and stops its
/// queue (GET_VRING_BASE: the switch-over); B's frontend then starts its queue: B takes the
/// image and reads every block A wrote; B writes more; A, told to exit afterwards, writes
/// nothing (no stale metadata over B's): `qemu-img check` is clean and B's and A's blocks
/// are all in the image.
#[test]
fn an_incoming_vublk_takes_a_qcow2_image_over_at_the_switch_over() {
    handover("qcow2");
}

/// The same with a parallels image (its BAT and in-use flag).
#[test]
fn an_incoming_vublk_takes_a_parallels_image_over_at_the_switch_over() {
    handover("parallels");
}

fn handover(fmt: &str) {
    if skip_unless_vublk("vublk's image handover") {
        return;
    }
    if !have_qemu_img() {
        return;
    }
    let dir_a = TestDir::new(&format!("migration-handover-{fmt}-a"));
    let dir_b = TestDir::new(&format!("migration-handover-{fmt}-b"));
    let img = dir_a.join(&format!("img.{fmt}"));
    run_ok(
        std::process::Command::new("qemu-img")
            .args(["create", "-q", "-f", fmt])
            .arg(&img)
            .arg((64 * MIB).to_string()),
    );
    // qcow2: a persistent bitmap goes along (the destination reports the source's dirty
    // granules and its own).
    let bitmap = fmt == "qcow2";
    if bitmap {
        run_ok(
            std::process::Command::new("qemu-img")
                .args(["bitmap", "--add"])
                .arg(&img)
                .arg("b0"),
        );
    }
    let ctl_b = dir_b.join("ctl.sock");
    let a = Backend::start(&dir_a, &img, &BackendOpts::default());
    let mut fe_a = frontend(&a.socket);
    let g_a = guest();
    fe_a.set_mem_table(&[g_a.region()]).unwrap();
    // B starts while A holds the image's write lock: --incoming takes none.
    let b = Backend::start(
        &dir_b,
        &img,
        &BackendOpts {
            extra_args: vec![
                "--incoming".into(),
                "--control-socket".into(),
                ctl_b.display().to_string(),
            ],
            ..BackendOpts::default()
        },
    );
    b.assert_running();
    let mut fe_b = frontend(&b.socket);
    let cap = |fe: &mut Frontend| {
        use vhost::vhost_user::message::VhostUserConfigFlags;
        let (_, c) = fe
            .get_config(0, 8, VhostUserConfigFlags::WRITABLE, &[0; 8])
            .unwrap();
        u64::from_le_bytes(c[..8].try_into().unwrap())
    };
    assert_eq!(cap(&mut fe_b), 64 * MIB / 512, "B's capacity");
    assert_eq!(cap(&mut fe_a), cap(&mut fe_b));
    let g_b = guest();
    fe_b.set_mem_table(&[g_b.region()]).unwrap();

    // A: logging (the migration started), writes into fresh 64 KiB clusters.
    let log = Log::new();
    set_log_all(&mut fe_a, true);
    fe_a.set_log_base(0, Some(log.region())).unwrap();
    let (kick_a, _call_a) = start_logged_queue(&mut fe_a, &g_a, Some(USED));
    let a_blocks: Vec<(u64, u8)> = (0..12).map(|i| (i * 128 + 8, 0xa0 + i as u8)).collect();
    write_blocks(&mut fe_a, &g_a, &kick_a, 0, &a_blocks);
    // The switch-over: A's queue stops; A hands the image over before it answers.
    let base = fe_a.get_vring_base(0).unwrap();
    assert_eq!(base, 12);
    assert!(
        a.log_contents().contains("handed the image over"),
        "A did not hand the image over:\n{}",
        a.log_contents()
    );

    // B: the queue starts (SET_VRING_BASE from the migration stream), B takes the image.
    let (kick_b, _call_b) = start_logged_queue(&mut fe_b, &g_b, None);
    for (i, &(sector, fill)) in a_blocks.iter().enumerate() {
        let got = read_block(&g_b, &kick_b, i as u16, sector);
        assert!(
            got.iter().all(|&x| x == fill),
            "B reads block {i} (sector {sector}) written by A as {:#x}{}",
            got[0],
            if got.iter().all(|&x| x == 0) {
                ": zeroes, stale metadata"
            } else {
                ""
            }
        );
    }
    assert!(
        b.log_contents().contains("took the image over"),
        "{}",
        b.log_contents()
    );
    // B allocates more clusters.
    let n = a_blocks.len() as u16;
    // Clusters of their own (20..32): new allocations by B.
    let b_blocks: Vec<(u64, u8)> = (0..12)
        .map(|i| ((20 + i) * 128 + 8, 0xb0 + i as u8))
        .collect();
    write_blocks(&mut fe_b, &g_b, &kick_b, n, &b_blocks);
    // The bitmap's 64 KiB granules: every block A and B wrote.
    let granules: Vec<(u64, u64)> = {
        let set: std::collections::BTreeSet<u64> = a_blocks
            .iter()
            .chain(&b_blocks)
            .map(|&(sector, _)| sector * 512 / 65536)
            .collect();
        merged(set.into_iter().map(|g| (g * 65536, 65536)))
    };
    if bitmap {
        let (ok, v, err) = ctl(&ctl_b, "bitmap-ranges", &["b0"]);
        assert!(ok, "{err}");
        let got: Vec<(u64, u64)> = v["extents"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| (e[0].as_u64().unwrap(), e[1].as_u64().unwrap()))
            .collect();
        assert_eq!(got, granules, "B's b0: A's writes and B's");
        // B took a qcow2 image: it can keep more bitmaps in it.
        let (ok, _, err) = ctl(&ctl_b, "bitmap-add", &["b1", "--persistent"]);
        assert!(ok, "bitmap-add --persistent on the destination: {err}");
    }

    // A's frontend goes away and A exits: it must write nothing now.
    drop(fe_a);
    assert_eq!(a.sigterm_and_wait(EXIT_DEADLINE).code(), Some(0));
    drop(fe_b);
    assert_eq!(b.sigterm_and_wait(EXIT_DEADLINE).code(), Some(0));
    // Clean: not even a leak (exit status 0).
    run_ok(
        std::process::Command::new("qemu-img")
            .args(["check", "-q", "-f", fmt])
            .arg(&img),
    );
    if bitmap {
        // In the file, valid: qemu-img lists it (not in use), qemu-nbd reads the same bits.
        let info = run_ok(
            std::process::Command::new("qemu-img")
                .args(["info", "--output=json"])
                .arg(&img),
        );
        assert!(
            info.contains("\"b0\"") && info.contains("\"b1\"") && !info.contains("in-use"),
            "{info}"
        );
        let dirty = nbd_dirty_map(&img, "b0");
        assert_eq!(dirty, granules, "b0 in the file after both stopped");
    }
    let raw = dir_a.join("converted.raw");
    run_ok(
        std::process::Command::new("qemu-img")
            .args(["convert", "-f", fmt, "-O", "raw"])
            .arg(&img)
            .arg(&raw),
    );
    for &(sector, fill) in a_blocks.iter().chain(&b_blocks) {
        let d = read_file_range(&raw, sector * 512, 4096);
        assert!(
            d.iter().all(|&x| x == fill),
            "sector {sector}: {:#x} instead of {fill:#x}",
            d[0]
        );
    }
}

/// A live migration without shared storage (docs/live-migration.md#without-shared-storage),
/// between two vublk processes: the destination's disk is a raw file of other bytes that
/// qemu-nbd exports; the source vublk A mirrors onto the export while its guest writes,
/// the job waits in ready; at the switch-over (the last queue stopped while logging) A
/// copies the rest, flushes the export and concludes the job, then hands over. With
/// qemu-nbd stopped, the destination vublk B (`--incoming` on the file) takes it when its
/// queue starts and reads every block A's guest wrote, before and during the mirror; the
/// file equals A's image (qemu-img compare).
#[test]
fn a_mirror_carries_the_disk_to_the_destination_at_the_handover() {
    if skip_unless_vublk("vublk's mirror and handover") {
        return;
    }
    if !have_qemu_img() {
        return;
    }
    let dir_a = TestDir::new("migration-mirror-a");
    let dir_b = TestDir::new("migration-mirror-b");
    let img = dir_a.join("src.qcow2");
    run_ok(
        std::process::Command::new("qemu-img")
            .args(["create", "-q", "-f", "qcow2"])
            .arg(&img)
            .arg((64 * MIB).to_string()),
    );
    let dst = dir_b.join("dst.raw");
    std::fs::write(&dst, vec![0xeeu8; (64 * MIB) as usize]).unwrap();
    let Some((nbd, nbd_sock)) = qemu_nbd(&dir_b, &dst) else {
        return;
    };
    let uri = format!("nbd+unix:///disk?socket={}", nbd_sock.display());
    let ctl_a = dir_a.join("ctl.sock");
    let a = Backend::start(
        &dir_a,
        &img,
        &BackendOpts {
            extra_args: vec!["--control-socket".into(), ctl_a.display().to_string()],
            ..BackendOpts::default()
        },
    );
    let b = Backend::start(
        &dir_b,
        &dst,
        &BackendOpts {
            extra_args: vec!["--incoming".into()],
            ..BackendOpts::default()
        },
    );
    let mut fe_a = frontend(&a.socket);
    let g_a = guest();
    fe_a.set_mem_table(&[g_a.region()]).unwrap();
    let mut fe_b = frontend(&b.socket);
    let g_b = guest();
    fe_b.set_mem_table(&[g_b.region()]).unwrap();
    // No migration yet: the frontend does not log.
    set_log_all(&mut fe_a, false);
    let (kick_a, _call_a) = start_logged_queue(&mut fe_a, &g_a, Some(USED));
    // Before the mirror, then while it waits in ready and the migration runs (some of the
    // same blocks again).
    let before: Vec<(u64, u8)> = (0..12).map(|i| (i * 128 + 8, 0xa0 + i as u8)).collect();
    write_blocks(&mut fe_a, &g_a, &kick_a, 0, &before);
    ctl_ok(&ctl_a, "mirror", &["--id", "mig", "--target", &uri]);
    let t0 = Instant::now();
    while ctl_ok(&ctl_a, "jobs", &[])["jobs"][0]["state"] != "ready" {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "the mirror is not ready"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // The migration starts: the frontend logs.
    let log = Log::new();
    set_log_all(&mut fe_a, true);
    fe_a.set_log_base(0, Some(log.region())).unwrap();
    let during: Vec<(u64, u8)> = (0..12).map(|i| (i * 256 + 8, 0xc0 + i as u8)).collect();
    write_blocks(&mut fe_a, &g_a, &kick_a, 12, &during);
    // The switch-over.
    assert_eq!(fe_a.get_vring_base(0).unwrap(), 24);
    let la = a.log_contents();
    assert!(la.contains("as the guest left it at the handover"), "{la}");
    assert!(la.contains("handed the image over"), "{la}");
    let jobs = ctl_ok(&ctl_a, "jobs", &[]);
    assert_eq!(jobs["jobs"][0]["state"], "concluded", "{jobs}");
    assert!(jobs["jobs"][0]["error"].is_null(), "{jobs}");
    // The destination's export is stopped before its vublk takes the file.
    drop(nbd);
    run_ok(
        std::process::Command::new("qemu-img")
            .args(["compare", "-f", "qcow2", "-F", "raw"])
            .arg(&img)
            .arg(&dst),
    );
    let (kick_b, _call_b) = start_logged_queue(&mut fe_b, &g_b, None);
    let mut expected: std::collections::BTreeMap<u64, u8> = before.iter().copied().collect();
    expected.extend(during.iter().copied());
    for (k, (&sector, &fill)) in expected.iter().enumerate() {
        let got = read_block(&g_b, &kick_b, k as u16, sector);
        assert!(
            got.iter().all(|&x| x == fill),
            "B reads sector {sector} as {:#x}, A's guest wrote {fill:#x}",
            got[0]
        );
    }
    let lb = b.log_contents();
    assert!(lb.contains("took the image over"), "{lb}");
    drop(fe_a);
    assert_eq!(a.sigterm_and_wait(EXIT_DEADLINE).code(), Some(0));
    drop(fe_b);
    assert_eq!(b.sigterm_and_wait(EXIT_DEADLINE).code(), Some(0));
}

/// Extents with the adjacent ones joined.
fn merged(extents: impl Iterator<Item = (u64, u64)>) -> Vec<(u64, u64)> {
    let mut out: Vec<(u64, u64)> = Vec::new();
    for (o, l) in extents {
        match out.last_mut() {
            Some(last) if last.0 + last.1 == o => last.1 += l,
            _ => out.push((o, l)),
        }
    }
    out
}
