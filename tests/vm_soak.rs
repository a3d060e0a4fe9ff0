//! Soak (issue 28): a QEMU guest (TCG, one vCPU, as in the hang once seen under load) and a
//! libblkio client, each on its own vublk, while a CPU hog keeps both host cores busy, with
//! restarts (SIGKILL and SIGTERM, a new vublk at once: the image handed from process to
//! process) and online resizes interleaved:
//! - the guest runs aio-verify (native AIO random 4 KiB writes at depth 16 with O_DIRECT,
//!   then every block read back and checked, like fio's libaio engine with verify) on a
//!   fresh qcow2, rounds after rounds; it must finish every round (no STALL: an I/O
//!   outstanding for 30 s), with no I/O error in dmesg; `qemu-img check` is clean after;
//! - the libblkio client writes, reads and checks against a model on two queues, the
//!   vublk under it restarted and resized between rounds; the image equals the model;
//! - neither vublk logs a request in flight longer than `--stuck-request-secs 10`.
//!
//! CI size: 3 guest rounds of 40,000 writes (about two minutes under the hog). A longer run:
//! `VUBLK_SOAK_ROUNDS=30 VUBLK_SOAK_WRITES=20000 cargo test --test vm_soak -- --nocapture`
//! (BENCHMARKS.md, "Soak"); `VUBLK_SOAK_EVENTS=0` leaves the guest's vublk alone (no
//! restart or resize to hide a lost notification). `VUBLK_E2E_REQUIRE=1` fails instead of skipping where QEMU or
//! the guest kernel is missing; `VUBLK_E2E_KEEP=1` keeps the run directory.

mod common;
mod vm;

use std::env;
use std::fs::{self, File};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use common::{connect_queues, Op, Rng, MIB};
use vm::{markers, read_log, wait_listening, ChildGuard, LineCollector, ScratchDir, MARK};

/// The guest's disk, and the client's.
const GUEST_DISK: u64 = 2 << 30;
const CLIENT_DISK: u64 = 64 * MIB;
/// A request in flight this long is logged by vublk; the test fails on such a line.
const STUCK_SECS: &str = "10";

fn env_u64(key: &str, default: u64) -> u64 {
    env::var(key)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A vublk on `sock` with a control socket at `ctl`, its log `NAME-N.log` in `dir`.
fn start(
    dir: &Path,
    name: &str,
    n: usize,
    sock: &Path,
    ctl: &Path,
    image: &Path,
    queues: u32,
) -> (ChildGuard, PathBuf) {
    let log = dir.join(format!("{name}-{n}.log"));
    let ctl_s = ctl.display().to_string();
    let mut p = vm::spawn_vublk(
        &format!("{name}-{n}"),
        &log,
        sock,
        image,
        queues,
        &[
            "--control-socket",
            &ctl_s,
            "--stuck-request-secs",
            STUCK_SECS,
        ],
    );
    wait_listening(&mut p, &log);
    (p, log)
}

/// `vublk ctl resize SIZE` on `ctl_sock`: the new size.
fn resize(ctl_sock: &Path, size: u64) -> u64 {
    let (ok, v, err) = common::ctl(ctl_sock, "resize", &[&size.to_string()]);
    assert!(ok, "resize to {size}: {err}");
    v["size_bytes"].as_u64().unwrap()
}

/// The CPU hog: one busy loop per host CPU, stopped (SIGKILL) when dropped.
fn cpu_hog() -> Vec<ChildGuard> {
    let n = thread::available_parallelism().map_or(2, |n| n.get());
    (0..n)
        .map(|i| {
            ChildGuard::spawn(
                &format!("hog-{i}"),
                Command::new("sh")
                    .args(["-c", "while :; do :; done"])
                    .stdin(Stdio::null()),
            )
            .unwrap()
        })
        .collect()
}

/// Sets the flag when dropped (on the way out of a panic too).
struct StopOnDrop<'a>(&'a AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// What the libblkio side did.
struct ClientOutcome {
    rounds: u64,
    ops: u64,
    restarts: u64,
    resizes: u64,
    logs: Vec<PathBuf>,
}

/// The libblkio client's rounds until `stop`: each round connects (two queues), makes 200
/// requests (writes of random data, reads checked against the model) and disconnects;
/// between rounds its vublk is restarted (SIGTERM and SIGKILL in turn) or resized.
fn client_side(dir: &Path, stop: &AtomicBool) -> ClientOutcome {
    let image = dir.join("client.raw");
    File::create(&image).unwrap().set_len(CLIENT_DISK).unwrap();
    let sock = dir.join("client.sock");
    let ctl = dir.join("client.ctl");
    let mut logs = Vec::new();
    let (mut backend, log) = start(dir, "client-vublk", 0, &sock, &ctl, &image, 2);
    logs.push(log);
    let mut model = vec![0u8; CLIENT_DISK as usize];
    let mut rng = Rng::new(0x50a4);
    let (mut rounds, mut ops, mut restarts, mut resizes) = (0, 0, 0, 0);
    while !stop.load(Ordering::Relaxed) {
        let mut c = connect_queues(&sock, 2);
        let size = model.len() as u64;
        assert_eq!(c.capacity(), size, "round {rounds}: capacity");
        for i in 0..200 {
            let q = i % 2;
            let len = rng.range(1, 16) as usize * 4096;
            let offset = rng.below((size - len as u64) / 4096 + 1) * 4096;
            if rng.below(2) == 0 {
                let mut data = vec![0u8; len];
                rng.fill(&mut data);
                c.mem_mut()[..len].copy_from_slice(&data);
                let r = c.submit(
                    q,
                    Op::Write {
                        offset,
                        buf: 0,
                        len,
                    },
                );
                assert_eq!(r, 0, "round {rounds} op {i}: write {len} at {offset}");
                model[offset as usize..offset as usize + len].copy_from_slice(&data);
            } else {
                let got = c.read_at(q, offset, len).unwrap_or_else(|e| {
                    panic!("round {rounds} op {i}: read {len} at {offset}: {e}")
                });
                assert!(
                    got == model[offset as usize..offset as usize + len],
                    "round {rounds} op {i}: read {len} at {offset} differs from the model"
                );
            }
            ops += 1;
        }
        drop(c);
        rounds += 1;
        match rounds % 3 {
            // A resize: 4 MiB more, seen at the next connection.
            0 => {
                let now = resize(&ctl, model.len() as u64 + 4 * MIB);
                model.resize(now as usize, 0);
                resizes += 1;
            }
            // A restart: SIGTERM, or SIGKILL (nothing in flight: the client waits for
            // every request); the next vublk serves the same image at once.
            k => {
                if k == 1 {
                    let st = backend.terminate(Duration::from_secs(30));
                    assert_eq!(st.and_then(|s| s.code()), Some(0), "SIGTERM exit");
                } else {
                    backend.kill();
                }
                let (b, log) = start(dir, "client-vublk", logs.len(), &sock, &ctl, &image, 2);
                backend = b;
                logs.push(log);
                restarts += 1;
            }
        }
    }
    let st = backend.terminate(Duration::from_secs(30));
    assert_eq!(st.and_then(|s| s.code()), Some(0), "the last vublk's exit");
    let file = fs::read(&image).unwrap();
    assert_eq!(file.len(), model.len(), "the client image's size");
    assert!(file == model, "the client image differs from the model");
    ClientOutcome {
        rounds,
        ops,
        restarts,
        resizes,
        logs,
    }
}

#[test]
fn soak_under_cpu_load_with_restarts_and_resizes() {
    let Some((qemu, guest)) = vm::guest_prerequisites(&["qemu-img"]) else {
        return;
    };
    let rounds = env_u64("VUBLK_SOAK_ROUNDS", 3);
    let writes = env_u64("VUBLK_SOAK_WRITES", 40000);
    let tmp = Path::new(env!("CARGO_TARGET_TMPDIR"));
    let mut run = ScratchDir::new(tmp, &format!("vm-soak-{}", std::process::id())).unwrap();
    run.keep = env::var("VUBLK_E2E_KEEP").is_ok_and(|v| v == "1");
    let dir = run.path.clone();
    let image = dir.join("guest.qcow2");
    let st = Command::new("qemu-img")
        .args(["create", "-q", "-f", "qcow2"])
        .arg(&image)
        .arg(GUEST_DISK.to_string())
        .status()
        .unwrap();
    assert!(st.success());
    // The vhost-user socket outside the run directory (UNIX socket paths are short).
    let sock = env::temp_dir().join(format!("vublk-soak-{}.sock", std::process::id()));
    let ctl = dir.join("guest.ctl");
    let _ = fs::remove_file(&sock);

    let hog = cpu_hog();
    let stop = AtomicBool::new(false);
    let t0 = Instant::now();
    let (guest_result, client) = thread::scope(|s| {
        let client = s.spawn(|| client_side(&dir, &stop));
        // The client stops when the guest side ends, also when it fails.
        let _stop = StopOnDrop(&stop);
        let r = guest_side(&qemu, &guest, &dir, &image, &sock, &ctl, rounds, writes);
        drop(_stop);
        (r, client.join())
    });
    drop(hog);
    let _ = fs::remove_file(&sock);
    let client = client.unwrap_or_else(|e| std::panic::resume_unwind(e));
    let g = guest_result;
    println!(
        "[soak] {:.0} s: guest {} rounds of {writes} writes, {} restarts, {} resizes; \
         client {} rounds, {} requests, {} restarts, {} resizes",
        t0.elapsed().as_secs_f64(),
        g.rounds_done,
        g.restarts,
        g.resizes,
        client.rounds,
        client.ops,
        client.restarts,
        client.resizes
    );
    for l in g.logs.iter().chain(&client.logs) {
        let text = read_log(l);
        assert!(
            !text.contains("has been in flight for"),
            "{} logged a stuck request:\n{text}",
            l.display()
        );
    }
    assert!(client.rounds >= 2, "the client side hardly ran");
    let check = Command::new("qemu-img")
        .args(["check", "-f", "qcow2"])
        .arg(&image)
        .output()
        .unwrap();
    // Exit 0: clean; 3: leaked clusters only (a SIGKILL may leak).
    assert!(
        matches!(check.status.code(), Some(0) | Some(3)),
        "qemu-img check: {}",
        String::from_utf8_lossy(&check.stdout)
    );
}

/// What the guest side did.
struct GuestOutcome {
    rounds_done: u64,
    restarts: u64,
    resizes: u64,
    logs: Vec<PathBuf>,
}

/// The guest's rounds of aio-verify on `image`, with a restart or a resize of its vublk
/// every few seconds while they run; fails the test if the guest fails, stalls or does not
/// finish within the deadline.
#[allow(clippy::too_many_arguments)]
fn guest_side(
    qemu: &Path,
    guest: &vm::Guest,
    dir: &Path,
    image: &Path,
    sock: &Path,
    ctl: &Path,
    rounds: u64,
    writes: u64,
) -> GuestOutcome {
    // VUBLK_SOAK_EVENTS=0: no restarts or resizes of the guest's vublk (a hang they would
    // hide, by signalling and kicking anew at each start, shows then).
    let events = env_u64("VUBLK_SOAK_EVENTS", 1) != 0;
    let mut logs = Vec::new();
    let (mut backend, log) = start(dir, "guest-vublk", 0, sock, ctl, image, 1);
    logs.push(log);
    let append = format!(
        "console=ttyS0 panic=-1 loglevel=4 E2E_QUEUES=1 E2E_MODE=aio-verify \
         E2E_AIO_ROUNDS={rounds} E2E_AIO_WRITES={writes} E2E_AIO_DEPTH=16"
    );
    let mut qcmd = vm::guest_command(
        qemu,
        guest,
        "512M",
        1,
        &format!("path={},reconnect-ms=1000", sock.display()),
        ",num-queues=1",
        &append,
    );
    qcmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(File::create(dir.join("qemu.log")).unwrap());
    let mut q = ChildGuard::spawn("qemu", &mut qcmd).unwrap();
    let stdout = q.child_mut().stdout.take().unwrap();
    let mut serial = LineCollector::new(stdout, File::create(dir.join("serial.log")).ok());
    // Ten minutes per round under the hog is a hang, not a slow machine.
    let deadline = Instant::now() + Duration::from_secs(120 + 600 * rounds);
    let mut started = false;
    let mut next_event = None::<Instant>;
    let (mut n_events, mut restarts, mut resizes, mut size) = (0u64, 0, 0, GUEST_DISK);
    let status = loop {
        for l in serial.poll() {
            if let Some(i) = l.find(MARK) {
                println!("[guest] {}", &l[i..]);
                if l[i..].starts_with("VUBLK-E2E: AIO-ROUND") && !started {
                    started = true;
                    next_event = Some(Instant::now() + Duration::from_secs(2));
                }
            }
        }
        if let Some(st) = q.try_wait().unwrap() {
            break Some(st);
        }
        if events && next_event.is_some_and(|t| Instant::now() >= t) {
            // In turn: a resize, a SIGKILL, a resize, a SIGTERM; each a few seconds apart.
            match n_events % 4 {
                0 | 2 => {
                    size = resize(ctl, size + 64 * MIB);
                    resizes += 1;
                }
                k => {
                    if k == 1 {
                        backend.kill();
                    } else {
                        let st = backend.terminate(Duration::from_secs(30));
                        assert_eq!(
                            st.and_then(|s| s.code()),
                            Some(0),
                            "guest's vublk: SIGTERM exit:\n{}",
                            read_log(logs.last().unwrap())
                        );
                    }
                    let (b, log) = start(dir, "guest-vublk", logs.len(), sock, ctl, image, 1);
                    backend = b;
                    logs.push(log);
                    restarts += 1;
                }
            }
            n_events += 1;
            next_event = Some(Instant::now() + Duration::from_secs(3));
        }
        if Instant::now() >= deadline {
            break None;
        }
        thread::sleep(Duration::from_millis(50));
    };
    let lines = serial.finish();
    let marks = markers(&lines);
    let dump = || {
        let mut s = format!("--- serial console:\n{}\n", lines.join("\n"));
        for l in &logs {
            s.push_str(&format!("--- {}:\n{}\n", l.display(), read_log(l)));
        }
        s
    };
    assert!(
        status.is_some(),
        "the guest did not finish in time (a hang)\n{}",
        dump()
    );
    if let Some(f) = marks.iter().find(|m| m.starts_with("FAIL")) {
        panic!("guest reported {f}\n{}", dump());
    }
    assert!(
        !marks.iter().any(|m| m.starts_with("STALL")),
        "an I/O was outstanding for 30 s\n{}",
        dump()
    );
    assert!(
        marks.iter().any(|m| m.starts_with("PASS")),
        "no PASS\n{}",
        dump()
    );
    let st = backend.terminate(Duration::from_secs(30));
    assert_eq!(
        st.and_then(|s| s.code()),
        Some(0),
        "guest's last vublk exit"
    );
    let rounds_done = marks.iter().filter(|m| m.starts_with("AIO-ROUND")).count() as u64;
    assert_eq!(rounds_done, rounds, "rounds the guest ran");
    assert!(
        !events || restarts + resizes >= 2,
        "the guest finished before the events"
    );
    GuestOutcome {
        rounds_done,
        restarts,
        resizes,
        logs,
    }
}
