//! vublk killed and restarted under a running Linux guest (QEMU, TCG), the guest connected
//! with `reconnect-ms`: several writers write numbered 4 KiB blocks with O_DIRECT and
//! O_DSYNC for a minute while the test kills vublk with SIGKILL three times and SIGTERM
//! once at random moments, starting a new vublk at once each time. The guest must see no
//! I/O error (dmesg clean) and not hang; every block it wrote must be in the image (qcow2:
//! `qemu-img check` clean too); the longest write it saw is reported. A control run
//! without restarts checks the harness.
//!
//! Environment: `VUBLK_E2E_REQUIRE=1` fails instead of skipping when QEMU or the guest
//! kernel is missing; `VUBLK_RESTART_SEED=N` replays a kill schedule; `VUBLK_E2E_KEEP=1`
//! keeps the run directory.

mod common;
mod vm;

use std::env;
use std::fs::{self, File};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use vm::{
    check_blocks, markers, read_log, wait_listening, ChildGuard, LineCollector, ScratchDir, MARK,
};

const NUM_QUEUES: u32 = 2;
const WRITERS: u64 = 4;
const DISK_BYTES: u64 = 1 << 30;

/// Guest runs one at a time (two TCG guests on two cores slow each other down).
static ONE_GUEST_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Event {
    Kill,
    Term,
}

/// One vublk process on the run's socket, its log in `backend-N.log`.
fn start_vublk(run: &Path, sock: &Path, image: &Path, n: usize) -> (ChildGuard, PathBuf) {
    let log = run.join(format!("backend-{n}.log"));
    // A LUKS volume: its passphrase is in the run directory.
    let key = format!("--key-secret=file:{}", run.join("pass").display());
    let extra: &[&str] = if image.extension().is_some_and(|e| e == "luks") {
        &[key.as_str()]
    } else {
        &[]
    };
    (
        vm::spawn_vublk(&format!("vublk-{n}"), &log, sock, image, NUM_QUEUES, extra),
        log,
    )
}

/// QEMU's copy of the inflight region (vublk made it with memfd_create("vublk-inflight")),
/// opened through /proc and mapped read-only: the test watches for requests vublk has
/// taken, to kill it while it holds some.
struct InflightView {
    ptr: *const u8,
    len: usize,
}

impl InflightView {
    fn find(qemu_pid: u32) -> Option<InflightView> {
        for e in fs::read_dir(format!("/proc/{qemu_pid}/fd")).ok()?.flatten() {
            let target = fs::read_link(e.path()).ok()?;
            if !target.to_string_lossy().contains("memfd:vublk-inflight") {
                continue;
            }
            let f = File::open(e.path()).ok()?;
            let len = f.metadata().ok()?.len() as usize;
            // SAFETY: a new read-only shared mapping of the whole memfd (sealed against
            // shrinking by vublk), unmapped on drop.
            let ptr = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_READ,
                    libc::MAP_SHARED,
                    std::os::fd::AsRawFd::as_raw_fd(&f),
                    0,
                )
            };
            if ptr == libc::MAP_FAILED {
                return None;
            }
            return Some(InflightView {
                ptr: ptr.cast(),
                len,
            });
        }
        None
    }

    /// Requests marked in flight in any queue (layout: src/inflight.rs; 128-entry queues).
    fn marked(&self) -> usize {
        let queue_bytes = (16 + 16 * 128usize).next_multiple_of(64);
        let mut n = 0;
        for q in 0..NUM_QUEUES as usize {
            for i in 0..128 {
                let off = q * queue_bytes + 16 + 16 * i;
                if off < self.len {
                    // SAFETY: inside the mapping.
                    n += usize::from(unsafe { self.ptr.add(off).read_volatile() } != 0);
                }
            }
        }
        n
    }
}

impl Drop for InflightView {
    fn drop(&mut self) {
        // SAFETY: our own mapping.
        unsafe { libc::munmap(self.ptr as *mut libc::c_void, self.len) };
    }
}

/// SIGKILL `backend` at a moment it holds requests: when the region shows some marked,
/// stop the process (SIGSTOP: it can complete nothing more) and look again; still marked,
/// kill it; else let it go on and wait for the next. Gives up after 5 s (kills anyway).
/// Returns the requests marked at the kill.
fn kill_holding_requests(backend: &mut ChildGuard, view: Option<&InflightView>) -> usize {
    let pid = backend.id() as i32;
    let until = Instant::now() + Duration::from_secs(5);
    let mut marked = 0;
    while let Some(v) = view {
        if Instant::now() >= until {
            break;
        }
        if v.marked() == 0 {
            std::hint::spin_loop();
            continue;
        }
        // SAFETY: signalling our own child by its PID.
        unsafe { libc::kill(pid, libc::SIGSTOP) };
        while !fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|st| {
            st.rsplit(')')
                .next()
                .is_some_and(|r| r.trim_start().starts_with('T'))
        }) {
            std::hint::spin_loop();
        }
        marked = v.marked();
        if marked > 0 {
            break;
        }
        // SAFETY: as above.
        unsafe { libc::kill(pid, libc::SIGCONT) };
    }
    backend.kill();
    marked
}

struct Outcome {
    marks: Vec<String>,
    /// SIGKILLs that found requests marked in flight (each must be resubmitted or
    /// accounted by the next process).
    kills_in_flight: usize,
    restarts: Vec<(Event, Duration)>,
    logs: Vec<PathBuf>,
}

/// Boot the guest on `image` (format `fmt`), run the restart workload for `seconds`,
/// applying `events` at random moments; panics on any failure.
fn run(
    name: &str,
    fmt: &str,
    seconds: u64,
    events: &[Event],
) -> Option<(Outcome, PathBuf, PathBuf, ScratchDir)> {
    let tools: &[&str] = if fmt == "raw" { &[] } else { &["qemu-img"] };
    let (qemu, guest) = vm::guest_prerequisites(tools)?;
    let tmp = Path::new(env!("CARGO_TARGET_TMPDIR"));
    let mut run =
        ScratchDir::new(tmp, &format!("vm-restart-{name}-{}", std::process::id())).unwrap();
    run.keep = env::var("VUBLK_E2E_KEEP").is_ok_and(|v| v == "1");
    let image = run.path.join(format!("disk.{fmt}"));
    if fmt == "qcow2" {
        let st = Command::new("qemu-img")
            .args(["create", "-q", "-f", "qcow2"])
            .arg(&image)
            .arg(DISK_BYTES.to_string())
            .status()
            .unwrap();
        assert!(st.success());
    } else if fmt == "luks" {
        fs::write(run.path.join("pass"), "restart passphrase").unwrap();
        let st = Command::new(env!("CARGO_BIN_EXE_vublk"))
            .args(["create", "--format", "raw", "--encrypt", "luks1"])
            .arg(format!(
                "--key-secret=file:{}",
                run.path.join("pass").display()
            ))
            .args(["--kdf-iterations", "1000", "--size"])
            .arg(DISK_BYTES.to_string())
            .arg(&image)
            .status()
            .unwrap();
        assert!(st.success(), "vublk create --encrypt");
    } else {
        File::create(&image).unwrap().set_len(DISK_BYTES).unwrap();
    }
    let sock = env::temp_dir().join(format!("vublk-restart-{name}-{}.sock", std::process::id()));
    let _ = fs::remove_file(&sock);

    let mut logs = Vec::new();
    let (mut backend, log) = start_vublk(&run.path, &sock, &image, 0);
    wait_listening(&mut backend, &log);
    logs.push(log);

    let append = format!(
        "console=ttyS0 panic=-1 loglevel=4 E2E_QUEUES={NUM_QUEUES} E2E_LBS=512 E2E_MODE=restart \
         E2E_WRITERS={WRITERS} E2E_SECONDS={seconds}"
    );
    let serial_log = run.path.join("serial.log");
    let mut qcmd = vm::guest_command(
        &qemu,
        &guest,
        "1G",
        NUM_QUEUES,
        &format!("path={},reconnect-ms=1000", sock.display()),
        &format!(",num-queues={NUM_QUEUES}"),
        &append,
    );
    qcmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(File::create(run.path.join("qemu.log")).unwrap());
    let mut qemu_proc = ChildGuard::spawn("qemu", &mut qcmd).unwrap();
    let stdout = qemu_proc.child_mut().stdout.take().unwrap();
    let mut serial = LineCollector::new(stdout, File::create(&serial_log).ok());

    let seed = env::var("VUBLK_RESTART_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
                | 1
        });
    println!("[restart] {name}: kill schedule seed {seed} (VUBLK_RESTART_SEED)");
    // Seeded from the clock unless VUBLK_RESTART_SEED says otherwise.
    let mut rng = common::Rng::new(seed);
    let deadline = Instant::now() + Duration::from_secs(600);
    let mut started = None::<Instant>;
    let mut pending: Vec<Event> = events.to_vec();
    let mut next_at = None::<Instant>;
    let mut restarts = Vec::new();
    let mut view = None::<InflightView>;
    let mut kills_in_flight = 0;
    let qemu_status = loop {
        for l in serial.poll() {
            if let Some(i) = l.find(MARK) {
                println!("[guest] {}", &l[i..]);
                if l[i..].contains("RESTART-START") {
                    started = Some(Instant::now());
                }
            }
        }
        if let Some(st) = qemu_proc.try_wait().unwrap() {
            break Some(st);
        }
        if let (Some(t0), None, false) = (started, next_at, pending.is_empty()) {
            // The events fall in the first 5/6 of the workload, 6-12 s apart at the default.
            let span = (seconds * 1000 * 5 / 6) / events.len().max(1) as u64;
            let gap = span / 2 + rng.below((span / 2).max(1));
            let base = restarts.last().map_or(t0, |_| Instant::now());
            next_at = Some(base + Duration::from_millis(gap));
        }
        if next_at.is_some_and(|t| Instant::now() >= t) {
            next_at = None;
            let ev = pending.remove(0);
            let mut in_flight = 0;
            match ev {
                Event::Kill => {
                    if view.is_none() {
                        view = InflightView::find(qemu_proc.id());
                    }
                    in_flight = kill_holding_requests(&mut backend, view.as_ref());
                    kills_in_flight += usize::from(in_flight > 0);
                }
                Event::Term => {
                    let st = backend.terminate(Duration::from_secs(30));
                    assert_eq!(
                        st.and_then(|s| s.code()),
                        Some(0),
                        "SIGTERM: vublk did not exit 0:\n{}",
                        read_log(logs.last().unwrap())
                    );
                }
            }
            let t = Instant::now();
            let (mut b, log) = start_vublk(&run.path, &sock, &image, logs.len());
            wait_listening(&mut b, &log);
            let took = t.elapsed();
            println!(
                "[restart] {name}: {ev:?} at {:.1}s with {in_flight} requests marked in \
                 flight, a new vublk listening {:.0} ms later",
                started.unwrap().elapsed().as_secs_f64(),
                took.as_secs_f64() * 1000.0
            );
            restarts.push((ev, took));
            logs.push(log);
            backend = b;
        }
        if Instant::now() >= deadline {
            qemu_proc.kill();
            break None;
        }
        thread::sleep(Duration::from_millis(20));
    };
    // `finish` returns every line, those polled before included.
    let all_lines = serial.finish();
    let marks = markers(&all_lines);
    let last_status = backend.terminate(Duration::from_secs(30));
    let dump = || {
        let mut s = format!("--- serial console:\n{}\n", all_lines.join("\n"));
        for l in &logs {
            s.push_str(&format!("--- {}:\n{}\n", l.display(), read_log(l)));
        }
        s.push_str(&format!(
            "--- qemu stderr:\n{}\n",
            read_log(&run.path.join("qemu.log"))
        ));
        s
    };
    if let Some(f) = marks.iter().find(|m| m.starts_with("FAIL")) {
        panic!("guest reported {f}\n{}", dump());
    }
    assert!(
        qemu_status.is_some(),
        "the guest hung (no poweroff within 10 min)\n{}",
        dump()
    );
    assert!(
        marks.iter().any(|m| m.starts_with("PASS")),
        "no PASS\n{}",
        dump()
    );
    assert!(
        pending.is_empty(),
        "the workload ended before every restart: {pending:?}\n{}",
        dump()
    );
    assert_eq!(
        last_status.and_then(|s| s.code()),
        Some(0),
        "last vublk did not exit 0\n{}",
        dump()
    );
    let _ = fs::remove_file(&sock);
    Some((
        Outcome {
            marks,
            kills_in_flight,
            restarts,
            logs,
        },
        image,
        guest.pattern,
        run,
    ))
}

fn report(name: &str, o: &Outcome, blocks: u64) {
    let stall = o
        .marks
        .iter()
        .find_map(|m| m.strip_prefix("STALL longest_write="))
        .unwrap_or("?");
    // Processes that found requests in flight when their queues started.
    let resubmitted = o
        .logs
        .iter()
        .filter(|l| read_log(l).contains("resubmitting"))
        .count();
    let kills = o.restarts.iter().filter(|(e, _)| *e == Event::Kill).count();
    assert_eq!(
        o.kills_in_flight, kills,
        "{name}: not every SIGKILL found requests in flight"
    );
    assert!(
        resubmitted >= o.kills_in_flight,
        "{name}: {} kills with requests in flight, {resubmitted} recoveries",
        o.kills_in_flight
    );
    println!(
        "[restart] {name}: {blocks} blocks written and verified; {} restarts ({:?}); \
         {} SIGKILLs with requests in flight, {resubmitted} processes resubmitted them; \
         longest guest write {stall}",
        o.restarts.len(),
        o.restarts
            .iter()
            .map(|(e, d)| format!("{e:?} {} ms", d.as_millis()))
            .collect::<Vec<_>>(),
        o.kills_in_flight,
    );
}

const EVENTS: [Event; 4] = [Event::Kill, Event::Kill, Event::Term, Event::Kill];

#[test]
fn raw_image_survives_kills_and_restarts_under_a_writing_guest() {
    let _one = ONE_GUEST_AT_A_TIME
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    let Some((o, image, pattern, _run)) = run("raw", "raw", 60, &EVENTS) else {
        return;
    };
    let blocks = check_blocks(&o.marks, &image, &pattern, WRITERS, DISK_BYTES);
    report("raw", &o, blocks);
}

#[test]
fn qcow2_image_survives_kills_and_restarts_under_a_writing_guest() {
    let _one = ONE_GUEST_AT_A_TIME
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    let Some((o, image, pattern, run)) = run("qcow2", "qcow2", 60, &EVENTS) else {
        return;
    };
    let out = Command::new("qemu-img")
        .args(["check", "-f", "qcow2"])
        .arg(&image)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // Leaked clusters (allocations a killed process made but never recorded) are allowed;
    // corruptions are not (exit status 2; 3 means leaks only).
    assert!(
        matches!(out.status.code(), Some(0) | Some(3)) && !text.contains("ERROR"),
        "qemu-img check:\n{text}"
    );
    let raw = run.path.join("converted.raw");
    let st = Command::new("qemu-img")
        .args(["convert", "-f", "qcow2", "-O", "raw"])
        .arg(&image)
        .arg(&raw)
        .status()
        .unwrap();
    assert!(st.success());
    let blocks = check_blocks(&o.marks, &raw, &pattern, WRITERS, DISK_BYTES);
    report("qcow2", &o, blocks);
}

/// The raw test's kills and restarts on an encrypted disk (a LUKS1 volume): each new vublk
/// unlocks it again and replays what the killed one held; checked through QEMU's luks
/// driver.
#[test]
fn luks_volume_survives_kills_and_restarts_under_a_writing_guest() {
    let _one = ONE_GUEST_AT_A_TIME
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    let Some((o, image, pattern, run)) = run("luks", "luks", 60, &EVENTS) else {
        return;
    };
    let raw = run.path.join("decrypted.raw");
    vm::luks_to_raw(&image, &run.path.join("pass"), &raw);
    let blocks = check_blocks(&o.marks, &raw, &pattern, WRITERS, DISK_BYTES);
    report("luks", &o, blocks);
}

/// The same workload without restarts: the harness and the verification themselves.
#[test]
fn control_run_without_restarts() {
    let _one = ONE_GUEST_AT_A_TIME
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    let Some((o, image, pattern, _run)) = run("control", "raw", 20, &[]) else {
        return;
    };
    let blocks = check_blocks(&o.marks, &image, &pattern, WRITERS, DISK_BYTES);
    assert!(blocks > 0);
    report("control", &o, blocks);
}
