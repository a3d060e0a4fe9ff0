//! Nothing a frontend does hangs the daemon or a request (issue 28): a test frontend (vhost's
//! `Frontend`, memfd guest memory, split rings built by hand, one per queue) against a real
//! vublk process.
//! - SIGTERM ends a busy-polling daemon while the frontend keeps kicking;
//! - while the frontend logs dirty pages (a live migration), stopping one queue hands
//!   nothing over and the other queues go on serving; the last queue's stop hands over;
//! - a take-back that fails (another process took the image's lock after the handover)
//!   fails the requests with IOERR instead of holding them, without spinning, and serves
//!   again once the image is free;
//! - a frontend that holds the backend channel but never reads or answers it costs the
//!   resize notification, not the control socket.

mod common;

use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use vhost::vhost_user::message::{
    VhostUserHeaderFlag, VhostUserProtocolFeatures, VhostUserVirtioFeatures,
};
use vhost::vhost_user::{Frontend, VhostUserFrontend};
use vhost::{VhostBackend, VringConfigData};
use vm_memory::{Bytes, GuestAddress};
use vmm_sys_util::eventfd::EventFd;

use common::*;

/// Each queue's part of guest memory (offsets from GPA): its rings, headers and status
/// bytes at `q * QUEUE_SPAN`, its data buffers at `DATA + q * QUEUE_SPAN`.
const QUEUE_SPAN: u64 = 0x10_0000;
const RING_DESC: u64 = 0;
const RING_AVAIL: u64 = 0x1000;
const RING_USED: u64 = 0x2000;
const HDRS: u64 = 0x3000;
const DATA: u64 = 0x80_0000;
/// Requests per queue (3 descriptors each).
const SLOTS: u16 = QSIZE / 3;

const VIRTIO_BLK_T_IN: u32 = 0;
const VIRTIO_BLK_T_OUT: u32 = 1;

/// Queue `q`'s rings in `g`.
struct Ring<'a> {
    g: &'a Guest,
    q: usize,
}

impl Ring<'_> {
    fn at(&self, off: u64) -> u64 {
        self.q as u64 * QUEUE_SPAN + off
    }

    fn desc(&self, i: u16, addr: u64, len: u32, flags: u16, next: u16) {
        let d = self.at(RING_DESC) + u64::from(i) * 16;
        self.g.w(d, addr);
        self.g.w(d + 8, len);
        self.g.w(d + 12, flags);
        self.g.w(d + 14, next);
    }

    /// Request slot `k`: 4 KiB of `fill` written to (or read from) `sector`; its head.
    fn request(&self, k: u16, ty: u32, sector: u64, fill: u8) -> u16 {
        let hdr = self.at(HDRS) + u64::from(k) * 32;
        let data = DATA + self.q as u64 * QUEUE_SPAN + u64::from(k) * 4096;
        self.g.w(hdr, ty);
        self.g.w(hdr + 4, 0u32);
        self.g.w(hdr + 8, sector);
        self.g.w(hdr + 16, 0xffu8);
        self.g
            .mem
            .write_slice(&[fill; 4096], GuestAddress(GPA + data))
            .unwrap();
        let head = k * 3;
        let write_only = if ty == VIRTIO_BLK_T_IN { 2 } else { 0 };
        self.desc(head, GPA + hdr, 16, 1, head + 1);
        self.desc(head + 1, GPA + data, 4096, 1 | write_only, head + 2);
        self.desc(head + 2, GPA + hdr + 16, 1, 2, 0);
        head
    }

    fn status(&self, k: u16) -> u8 {
        self.g.r::<u8>(self.at(HDRS) + u64::from(k) * 32 + 16)
    }

    /// Make `head` available at position `pos` (the avail index becomes `pos + 1`).
    fn publish(&self, pos: u16, head: u16) {
        self.g
            .w(self.at(RING_AVAIL) + 4 + 2 * u64::from(pos % QSIZE), head);
        self.g.w(self.at(RING_AVAIL) + 2, pos.wrapping_add(1));
    }

    fn used_idx(&self) -> u16 {
        self.g.r::<u16>(self.at(RING_USED) + 2)
    }

    /// Wait until the used index reaches `n`.
    fn wait_used(&self, n: u16, within: Duration, what: &str) {
        let deadline = Instant::now() + within;
        while self.used_idx() != n {
            assert!(
                Instant::now() < deadline,
                "{what}: queue {} used index {} after {within:?}, expected {n}",
                self.q,
                self.used_idx()
            );
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// Set the queue up (SET_VRING_BASE `base`) and enable it; its kick and call eventfds.
    fn start(&self, fe: &mut Frontend, base: u16) -> (EventFd, EventFd) {
        let q = self.q;
        fe.set_vring_num(q, QSIZE).unwrap();
        let config = VringConfigData {
            queue_max_size: QSIZE,
            queue_size: QSIZE,
            flags: 0,
            desc_table_addr: self.g.hva + self.at(RING_DESC),
            used_ring_addr: self.g.hva + self.at(RING_USED),
            avail_ring_addr: self.g.hva + self.at(RING_AVAIL),
            log_addr: None,
        };
        fe.set_vring_addr(q, &config).unwrap();
        fe.set_vring_base(q, base).unwrap();
        let kick = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        let call = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        fe.set_vring_call(q, &call).unwrap();
        fe.set_vring_kick(q, &kick).unwrap();
        fe.set_vring_enable(q, true).unwrap();
        (kick, call)
    }
}

/// A frontend for `queues` queues: every feature but VHOST_F_LOG_ALL (the tests turn it on
/// when they migrate), the protocol features in `proto` that vublk offers, NEED_REPLY on
/// every message when REPLY_ACK is among them.
fn connect(socket: &Path, queues: u64, proto: VhostUserProtocolFeatures) -> Frontend {
    let mut fe = Frontend::connect(socket, queues).unwrap();
    fe.set_owner().unwrap();
    let features = fe.get_features().unwrap() & !VhostUserVirtioFeatures::LOG_ALL.bits();
    fe.set_features(features).unwrap();
    let offered = fe.get_protocol_features().unwrap();
    let proto = offered & proto;
    fe.set_protocol_features(proto).unwrap();
    if proto.contains(VhostUserProtocolFeatures::REPLY_ACK) {
        fe.set_hdr_flags(VhostUserHeaderFlag::NEED_REPLY);
    }
    fe
}

/// The frontend starts migrating: VHOST_F_LOG_ALL acked.
fn log_all(fe: &mut Frontend) {
    let all = fe.get_features().unwrap();
    fe.set_features(all).unwrap();
}

fn raw_image(dir: &TestDir) -> std::path::PathBuf {
    let img = dir.join("img.raw");
    create_pattern_image(&img, 16 * MIB, 11);
    img
}

/// CPU time (user + system) the process has used.
fn cpu_time(pid: libc::pid_t) -> Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // Fields after the command name (which is in parentheses): utime and stime are the
    // 12th and 13th of them.
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as u64;
    let ticks: u64 = f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap();
    Duration::from_millis(ticks * 1000 / hz)
}

/// SIGTERM while the frontend keeps the queue busy (requests published and kicked without
/// pause) and the queue busy-polls: vublk finishes what it took and exits 0. (A quiesced
/// queue once counted a ring it no longer takes from as work and polled it for ever: the
/// daemon never exited.)
#[test]
fn sigterm_ends_a_polling_daemon_while_the_frontend_keeps_kicking() {
    if skip_unless_vublk("vublk's shutdown") {
        return;
    }
    for attempt in 0..6 {
        let dir = TestDir::new(&format!("hang-sigterm-{attempt}"));
        let img = raw_image(&dir);
        let poll = if attempt % 2 == 0 { "50" } else { "auto" };
        let opts = BackendOpts {
            extra_args: vec!["--poll-us".into(), poll.into()],
            ..BackendOpts::default()
        };
        let backend = Backend::start(&dir, &img, &opts);
        let g = guest();
        let mut fe = connect(&backend.socket, 1, VhostUserProtocolFeatures::all());
        fe.set_mem_table(&[g.region()]).unwrap();
        let r = Ring { g: &g, q: 0 };
        let heads: Vec<u16> = (0..SLOTS)
            .map(|k| r.request(k, VIRTIO_BLK_T_IN, 8 * u64::from(k), 0))
            .collect();
        let (kick, _call) = r.start(&mut fe, 0);
        let stop = AtomicBool::new(false);
        let exited = std::thread::scope(|s| {
            let kicker = s.spawn(|| {
                let mut pos: u16 = 0;
                let mut kicks = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    // At most SLOTS - 1 outstanding, so a head is reused only once its
                    // last use is on the used ring.
                    if pos.wrapping_sub(r.used_idx()) < SLOTS - 1 {
                        r.publish(pos, heads[usize::from(pos % SLOTS)]);
                        pos = pos.wrapping_add(1);
                    }
                    let _ = kick.write(1);
                    kicks += 1;
                }
                kicks
            });
            std::thread::sleep(Duration::from_millis(300));
            backend.signal(libc::SIGTERM);
            let deadline = Instant::now() + Duration::from_secs(15);
            let mut status = None;
            while Instant::now() < deadline {
                if let Some(st) = backend.try_wait() {
                    status = Some(st);
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            stop.store(true, Ordering::Relaxed);
            let kicks = kicker.join().unwrap();
            assert!(kicks > 1000, "the frontend kicked only {kicks} times");
            status
        });
        let st = exited.unwrap_or_else(|| {
            panic!(
                "attempt {attempt} (--poll-us {poll}): vublk still running 15 s after SIGTERM \
                 while the frontend kicked; log:\n{}",
                backend.log_contents()
            )
        });
        assert_eq!(st.code(), Some(0), "{}", backend.log_contents());
        assert!(r.used_idx() > 0, "no request was served");
    }
}

/// While the frontend logs dirty pages, stopping queue 0 (GET_VRING_BASE) hands nothing
/// over: queue 1 keeps serving, a write kicked on it right after completes, and the image
/// stays locked by vublk. Stopping queue 1 too is the switch-over: the image is handed over
/// (its locks released).
#[test]
fn stopping_one_queue_while_logging_keeps_the_others_serving() {
    if skip_unless_vublk("vublk's live-migration handover") {
        return;
    }
    let dir = TestDir::new("hang-stop-one");
    let img = raw_image(&dir);
    let opts = BackendOpts {
        num_queues: Some(2),
        ..BackendOpts::default()
    };
    let backend = Backend::start(&dir, &img, &opts);
    let g = guest();
    let mut fe = connect(&backend.socket, 2, VhostUserProtocolFeatures::all());
    fe.set_mem_table(&[g.region()]).unwrap();
    let (q0, q1) = (Ring { g: &g, q: 0 }, Ring { g: &g, q: 1 });
    let (k0, _c0) = q0.start(&mut fe, 0);
    let (k1, _c1) = q1.start(&mut fe, 0);
    for (i, (q, k)) in [(&q0, &k0), (&q1, &k1)].into_iter().enumerate() {
        let h = q.request(0, VIRTIO_BLK_T_OUT, 8 * i as u64, 0x10 + i as u8);
        q.publish(0, h);
        k.write(1).unwrap();
        q.wait_used(1, Duration::from_secs(5), "before migrating");
        assert_eq!(q.status(0), 0);
    }
    log_all(&mut fe);
    fe.get_vring_base(0).unwrap();
    // Queue 1 runs on: a write kicked now completes.
    let h = q1.request(1, VIRTIO_BLK_T_OUT, 64, 0x5a);
    q1.publish(1, h);
    k1.write(1).unwrap();
    q1.wait_used(2, Duration::from_secs(5), "queue 1 after queue 0 stopped");
    assert_eq!(q1.status(1), 0, "queue 1's write failed");
    assert_same(
        &read_file_range(&img, 64 * 512, 4096),
        &[0x5a; 4096],
        "queue 1's write",
    );
    let log = backend.log_contents();
    assert!(
        !log.contains("handed the image over"),
        "stopping queue 0 handed the whole device over while queue 1 ran:\n{log}"
    );
    assert!(
        image_write_locked(&img),
        "the image's locks went while queue 1 still serves"
    );
    // The last queue's stop is the switch-over.
    fe.get_vring_base(1).unwrap();
    assert!(backend.log_contents().contains("handed the image over"));
    assert!(!image_write_locked(&img), "handed over, yet still locked");
    drop(fe);
    assert_eq!(backend.sigterm_and_wait(EXIT_DEADLINE).code(), Some(0));
}

/// Is there a lock on the image's "write" byte (QEMU's layout: 100 + 1), as a served image
/// has?
fn image_write_locked(img: &Path) -> bool {
    let f = std::fs::File::open(img).unwrap();
    // SAFETY: flock is plain data, valid zeroed.
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = libc::F_WRLCK as i16;
    fl.l_whence = libc::SEEK_SET as i16;
    fl.l_start = 101;
    fl.l_len = 1;
    // SAFETY: a valid descriptor and flock.
    let r = unsafe { libc::fcntl(f.as_raw_fd(), libc::F_OFD_GETLK, &mut fl) };
    assert_eq!(r, 0, "F_OFD_GETLK");
    fl.l_type != libc::F_UNLCK as i16
}

/// After the switch-over (both queues stopped while logging) another process takes the
/// image (qemu-io holding it read-write); the frontend then starts queue 1 again (a failed
/// migration's take-back) and writes: the write fails with IOERR within the take-over wait
/// instead of hanging, and with `--poll-us` the queue does not spin meanwhile. Once qemu-io
/// is gone, the next write is served, and the daemon still accepts a new frontend.
#[test]
fn a_take_back_that_fails_fails_requests_and_serves_once_the_image_is_free() {
    if skip_unless_vublk("vublk's live-migration handover") {
        return;
    }
    if !have_qemu_img() {
        skip_or_fail::<()>("needs qemu-io (qemu-utils)");
        return;
    }
    for poll in ["0", "50"] {
        let dir = TestDir::new(&format!("hang-takeback-{poll}"));
        let img = raw_image(&dir);
        let opts = BackendOpts {
            num_queues: Some(2),
            extra_args: vec!["--poll-us".into(), poll.into()],
            ..BackendOpts::default()
        };
        let backend = Backend::start(&dir, &img, &opts);
        let g = guest();
        let mut fe = connect(&backend.socket, 2, VhostUserProtocolFeatures::all());
        fe.set_mem_table(&[g.region()]).unwrap();
        let (q0, q1) = (Ring { g: &g, q: 0 }, Ring { g: &g, q: 1 });
        let (_k0, _c0) = q0.start(&mut fe, 0);
        let (_k1, _c1) = q1.start(&mut fe, 0);
        log_all(&mut fe);
        fe.get_vring_base(0).unwrap();
        let base1 = fe.get_vring_base(1).unwrap() as u16;
        wait_unlocked(&img, Duration::from_secs(5));
        // Another process takes the image read-write and keeps it.
        let mut qemu_io = Command::new("qemu-io")
            .args(["-f", "raw"])
            .arg(&img)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while !image_write_locked(&img) {
            assert!(Instant::now() < deadline, "qemu-io never locked the image");
            std::thread::sleep(Duration::from_millis(20));
        }
        // The migration failed: the frontend starts queue 1 again and writes.
        let (k1, _c1) = q1.start(&mut fe, base1);
        let h = q1.request(0, VIRTIO_BLK_T_OUT, 128, 0x77);
        q1.publish(base1, h);
        k1.write(1).unwrap();
        q1.wait_used(
            base1.wrapping_add(1),
            Duration::from_secs(20),
            "a write while the take-back fails",
        );
        assert_eq!(
            q1.status(0),
            1,
            "expected IOERR while the image is elsewhere"
        );
        // No spinning while it waits for more.
        let before = cpu_time(backend.pid());
        std::thread::sleep(Duration::from_secs(1));
        let spent = cpu_time(backend.pid()) - before;
        assert!(
            spent < Duration::from_millis(300),
            "--poll-us {poll}: vublk used {spent:?} of CPU in 1 s while idle"
        );
        // qemu-io lets go: the next write is served (the take is tried again).
        drop(qemu_io.stdin.take());
        qemu_io.wait().unwrap();
        std::thread::sleep(Duration::from_millis(1100));
        let h = q1.request(1, VIRTIO_BLK_T_OUT, 136, 0x78);
        q1.publish(base1.wrapping_add(1), h);
        k1.write(1).unwrap();
        q1.wait_used(
            base1.wrapping_add(2),
            Duration::from_secs(10),
            "a write once the image is free",
        );
        assert_eq!(q1.status(1), 0, "{}", backend.log_contents());
        assert_same(
            &read_file_range(&img, 136 * 512, 4096),
            &[0x78; 4096],
            "the write after the take-back",
        );
        assert!(backend
            .log_contents()
            .contains("cannot take the image over"));
        drop(fe);
        // A new frontend is served.
        let mut c = connect_queues(&backend.socket, 1);
        assert_eq!(c.read_at(0, 136 * 512, 4096).unwrap(), vec![0x78; 4096]);
        drop(c);
        assert_eq!(backend.sigterm_and_wait(EXIT_DEADLINE).code(), Some(0));
    }
}

fn ctl_resize(ctl_sock: &Path, size: u64) -> (bool, serde_json::Value, Duration) {
    let t0 = Instant::now();
    let (ok, v, _) = ctl(ctl_sock, "resize", &[&size.to_string()]);
    (ok, v, t0.elapsed())
}

/// A frontend that set up a backend channel but never reads it: with REPLY_ACK the first
/// resize's notification times out (the resize still answers, `frontend_notified` false,
/// within the channel's timeout) and later resizes answer at once; without REPLY_ACK,
/// resizes keep answering even once the channel's socket buffer is full.
#[test]
fn a_frontend_that_never_answers_costs_the_notification_not_the_control_socket() {
    if skip_unless_vublk("vublk's control socket") {
        return;
    }
    for reply_ack in [true, false] {
        let dir = TestDir::new(&format!("hang-channel-{reply_ack}"));
        let img = raw_image(&dir);
        let ctl = dir.join("ctl.sock");
        let opts = BackendOpts {
            extra_args: vec!["--control-socket".into(), ctl.display().to_string()],
            ..BackendOpts::default()
        };
        let backend = Backend::start(&dir, &img, &opts);
        let mut proto = VhostUserProtocolFeatures::all();
        if !reply_ack {
            proto.remove(VhostUserProtocolFeatures::REPLY_ACK);
        }
        let mut fe = connect(&backend.socket, 1, proto);
        let (ours, theirs) = UnixStream::pair().unwrap();
        fe.set_backend_request_fd(&theirs).unwrap();
        drop(theirs);
        let mut size = 16 * MIB;
        let rounds = if reply_ack { 3 } else { 1500 };
        let mut slowest = Duration::ZERO;
        for i in 0..rounds {
            size += MIB;
            let (ok, v, took) = ctl_resize(&ctl, size);
            assert!(ok, "resize {i}: {v}");
            assert_eq!(v["size_bytes"], size, "resize {i}");
            slowest = slowest.max(took);
            assert!(
                took < Duration::from_secs(8),
                "resize {i} (REPLY_ACK {reply_ack}) took {took:?}"
            );
            if reply_ack {
                assert_eq!(v["frontend_notified"], false, "resize {i}: {v}");
                if i > 0 {
                    assert!(took < Duration::from_secs(2), "resize {i} took {took:?}");
                }
            }
        }
        assert_eq!(file_size(&img), size);
        // The control socket still answers.
        let (ok, _, took) = ctl_resize(&ctl, size);
        assert!(ok && took < Duration::from_secs(2));
        let log = backend.log_contents();
        assert!(
            log.contains("not using its backend channel again"),
            "REPLY_ACK {reply_ack}: slowest resize {slowest:?}\n{log}"
        );
        drop(ours);
        drop(fe);
        assert_eq!(backend.sigterm_and_wait(EXIT_DEADLINE).code(), Some(0));
    }
}
