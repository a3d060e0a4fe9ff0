//! Live migration of a Linux guest (QEMU, TCG) whose disk vublk serves, while the guest
//! writes: QEMU 1 on vublk A migrates (loopback TCP, QMP `migrate`) to QEMU 2 on vublk B
//! (`--incoming`, same image), then QEMU 2 migrates back to QEMU 3 on vublk A (which handed
//! the image over and takes it back). The guest's writers (numbered 4 KiB blocks, O_DIRECT
//! and O_DSYNC, and 1 MiB bulk writes) run across both migrations; at the end, on QEMU 3,
//! it re-reads its first and last blocks through the device and checks dmesg; the host
//! checks every block it reported in the image (qcow2: `qemu-img check` clean, no leak).
//! Downtime and total time of each migration are reported, and the same run is done with
//! qemu-storage-daemon serving both sides (one process, two exports of one node).
//!
//! Environment: `VUBLK_E2E_REQUIRE=1` fails instead of skipping when QEMU or the guest
//! kernel is missing; `VUBLK_E2E_KEEP=1` keeps the run directory.

mod common;
mod vm;

use std::env;
use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use vm::qmp::{field, Qmp};
use vm::{check_blocks, markers, read_log, ChildGuard, Guest, LineCollector, ScratchDir, MARK};

const NUM_QUEUES: u32 = 2;
const WRITERS: u64 = 4;
const DISK_BYTES: u64 = 1 << 30;
/// How long the guest writes: long enough for both migrations and some writing after each.
const SECONDS: u64 = 50;
/// Guest writing before each migration starts.
const BEFORE_MIGRATION: Duration = Duration::from_secs(8);

/// Guest runs one at a time (TCG guests on two cores slow each other down).
static ONE_GUEST_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// One QEMU process running (or receiving) the guest.
struct Vm {
    proc: ChildGuard,
    qmp: Qmp,
    serial: LineCollector,
}

/// A loopback port nobody listens on now.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn start_qemu(
    qemu: &Path,
    guest: &Guest,
    run: &Path,
    name: &str,
    sock: &Path,
    incoming: Option<u16>,
) -> Vm {
    let append = format!(
        "console=ttyS0 panic=-1 loglevel=4 E2E_QUEUES={NUM_QUEUES} E2E_LBS=512 E2E_MODE=restart \
         E2E_WRITERS={WRITERS} E2E_SECONDS={SECONDS} E2E_VERIFY_FIRST=32"
    );
    let qmp_path = run.join(format!("{name}.qmp"));
    let mut cmd = vm::guest_command(
        qemu,
        guest,
        "1G",
        NUM_QUEUES,
        &format!("path={}", sock.display()),
        &format!(",num-queues={NUM_QUEUES}"),
        &append,
    );
    cmd.arg("-qmp")
        .arg(format!("unix:{},server=on,wait=off", qmp_path.display()));
    if let Some(port) = incoming {
        cmd.arg("-incoming").arg(format!("tcp:127.0.0.1:{port}"));
    }
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(File::create(run.join(format!("{name}.log"))).unwrap());
    let mut proc = ChildGuard::spawn(name, &mut cmd).unwrap();
    let stdout = proc.child_mut().stdout.take().unwrap();
    let serial = LineCollector::new(
        stdout,
        File::create(run.join(format!("{name}.serial"))).ok(),
    );
    let qmp = Qmp::connect(&qmp_path, &mut proc);
    Vm { proc, qmp, serial }
}

/// The backends: two vublk processes, or one qemu-storage-daemon with two exports.
enum Backends {
    Vublk {
        a: ChildGuard,
        b: ChildGuard,
        logs: [PathBuf; 2],
    },
    Qsd {
        qsd: ChildGuard,
        log: PathBuf,
    },
}

fn wait_for(log: &Path, what: &str, p: &mut ChildGuard) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !read_log(log).contains(what) {
        if let Ok(Some(st)) = p.try_wait() {
            panic!("backend exited ({st}):\n{}", read_log(log));
        }
        assert!(
            Instant::now() < deadline,
            "no `{what}` in {}:\n{}",
            log.display(),
            read_log(log)
        );
        thread::sleep(Duration::from_millis(10));
    }
}

fn start_backends(
    qsd: bool,
    run: &Path,
    image: &Path,
    socks: &[PathBuf; 2],
    extra: &[String],
) -> Backends {
    if qsd {
        let log = run.join("qsd.log");
        let mut cmd = Command::new("qemu-storage-daemon");
        let fmt = if image.extension().is_some_and(|e| e == "qcow2") {
            "qcow2"
        } else {
            "raw"
        };
        cmd.arg("--blockdev")
            .arg(format!(
                "driver=file,node-name=file0,filename={},cache.direct=on,aio=io_uring",
                image.display()
            ))
            .arg("--blockdev")
            .arg(format!("driver={fmt},node-name=disk0,file=file0"));
        for (i, s) in socks.iter().enumerate() {
            cmd.arg("--export").arg(format!(
                "type=vhost-user-blk,id=exp{i},node-name=disk0,addr.type=unix,addr.path={},\
                 writable=on,num-queues={NUM_QUEUES}",
                s.display()
            ));
        }
        let f = File::create(&log).unwrap();
        cmd.stdin(Stdio::null())
            .stdout(f.try_clone().unwrap())
            .stderr(f);
        let mut p = ChildGuard::spawn("qsd", &mut cmd).unwrap();
        for s in socks {
            vm::wait_for_socket(s, &mut p, Duration::from_secs(20)).unwrap();
        }
        return Backends::Qsd { qsd: p, log };
    }
    let start = |name: &str, sock: &Path, more: &[&str]| {
        let log = run.join(format!("vublk-{name}.log"));
        let mut args: Vec<&str> = extra.iter().map(|s| s.as_str()).collect();
        args.extend(more);
        let mut p = vm::spawn_vublk(
            &format!("vublk-{name}"),
            &log,
            sock,
            image,
            NUM_QUEUES,
            &args,
        );
        wait_for(&log, "listening on", &mut p);
        (p, log)
    };
    let (a, la) = start("a", &socks[0], &[]);
    // B starts while A serves (and holds the image's locks): --incoming takes none.
    let (b, lb) = start("b", &socks[1], &["--incoming"]);
    Backends::Vublk {
        a,
        b,
        logs: [la, lb],
    }
}

/// Migrate `from` to a QEMU listening on `port`; returns (downtime ms, total ms).
fn migrate(from: &mut Vm, port: u16) -> (u64, u64) {
    from.qmp.ok(
        r#"{"execute":"migrate-set-parameters","arguments":{"max-bandwidth":4294967296,"downtime-limit":300}}"#,
    );
    from.qmp.ok(&format!(
        r#"{{"execute":"migrate","arguments":{{"uri":"tcp:127.0.0.1:{port}"}}}}"#
    ));
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let r = from.qmp.ok(r#"{"execute":"query-migrate"}"#);
        if r.contains("\"status\": \"completed\"") {
            return (
                field(&r, "downtime").unwrap_or(0),
                field(&r, "total-time").unwrap_or(0),
            );
        }
        assert!(
            !r.contains("\"status\": \"failed\"") && !r.contains("\"status\": \"cancelled\""),
            "migration failed: {r}"
        );
        assert!(Instant::now() < deadline, "migration did not complete: {r}");
        thread::sleep(Duration::from_millis(100));
    }
}

/// Quit a QEMU whose guest has moved away.
fn quit(vm: Vm, lines: &mut Vec<String>) {
    let Vm {
        mut proc,
        mut qmp,
        serial,
    } = vm;
    // A QEMU may be gone already (it has nothing left to run); a write to its socket then
    // fails, which is fine: it must have exited.
    let _ = qmp.writer.write_all(b"{\"execute\":\"quit\"}\n");
    assert!(
        proc.wait_until(Instant::now() + Duration::from_secs(30))
            .unwrap()
            .is_some(),
        "QEMU did not quit"
    );
    lines.extend(serial.finish());
}

struct Outcome {
    marks: Vec<String>,
    /// (downtime, total) per migration, ms.
    times: Vec<(u64, u64)>,
}

/// Boot on A, migrate to B and back; the guest's markers and the migration times.
fn run(name: &str, fmt: &str, qsd: bool) -> Option<(Outcome, PathBuf, PathBuf, ScratchDir)> {
    let (qemu, guest) = vm::guest_prerequisites(&["qemu-img", "qemu-storage-daemon"])?;
    let tmp = Path::new(env!("CARGO_TARGET_TMPDIR"));
    let mut run =
        ScratchDir::new(tmp, &format!("vm-migrate-{name}-{}", std::process::id())).unwrap();
    run.keep = env::var("VUBLK_E2E_KEEP").is_ok_and(|v| v == "1");
    // An RBD image lives in a throwaway cluster; both vublk serve it (shared storage).
    #[cfg(feature = "rbd")]
    let ceph = if fmt == "rbd" {
        let ceph = common::Ceph::start(&run.path, DISK_BYTES * 2 + (512 << 20))?;
        ceph.rbd(&[
            "create",
            "rbd/disk",
            "--size",
            &format!("{}M", DISK_BYTES >> 20),
        ]);
        Some(ceph)
    } else {
        None
    };
    #[allow(unused_mut)]
    let mut extra: Vec<String> = Vec::new();
    #[cfg(feature = "rbd")]
    if let Some(ceph) = &ceph {
        extra = ceph.args();
    }
    let image = if fmt == "rbd" {
        PathBuf::from("rbd:rbd/disk")
    } else if fmt == "luks" {
        // A LUKS1 volume; both vublk unlock it (the destination when it takes over).
        let image = run.path.join("disk.luks");
        let pass = run.path.join("pass");
        fs::write(&pass, "migration passphrase").unwrap();
        let key = format!("--key-secret=file:{}", pass.display());
        let st = Command::new(env!("CARGO_BIN_EXE_vublk"))
            .args(["create", "--format", "raw", "--encrypt", "luks1", &key])
            .args(["--kdf-iterations", "1000", "--size"])
            .arg(DISK_BYTES.to_string())
            .arg(&image)
            .status()
            .unwrap();
        assert!(st.success(), "vublk create --encrypt");
        extra.push(key);
        image
    } else {
        let image = run.path.join(format!("disk.{fmt}"));
        common::qemu_img_create(&image, fmt, &DISK_BYTES.to_string());
        if fmt == "qcow2" {
            // A persistent dirty bitmap goes along with the image (`verify`).
            let st = Command::new("qemu-img")
                .args(["bitmap", "--add"])
                .arg(&image)
                .arg("b0")
                .status()
                .unwrap();
            assert!(st.success());
        }
        image
    };
    let socks = ["a", "b"]
        .map(|s| env::temp_dir().join(format!("vublk-mig-{name}-{s}-{}.sock", std::process::id())));
    for s in &socks {
        let _ = fs::remove_file(s);
    }
    let mut backends = start_backends(qsd, &run.path, &image, &socks, &extra);
    let dump = |b: &Backends, lines: &[String]| {
        let mut s = format!("--- serial:\n{}\n", lines.join("\n"));
        let logs: Vec<&PathBuf> = match b {
            Backends::Vublk { logs, .. } => logs.iter().collect(),
            Backends::Qsd { log, .. } => vec![log],
        };
        for l in logs {
            s.push_str(&format!("--- {}:\n{}\n", l.display(), read_log(l)));
        }
        for q in ["qemu1", "qemu2", "qemu3"] {
            let p = run.path.join(format!("{q}.log"));
            s.push_str(&format!("--- {q} stderr:\n{}\n", read_log(&p)));
        }
        s
    };

    let mut lines = Vec::new();
    let mut vm1 = start_qemu(&qemu, &guest, &run.path, "qemu1", &socks[0], None);
    let t0 = Instant::now();
    let started = loop {
        if vm1
            .serial
            .poll()
            .iter()
            .any(|l| l.contains(&format!("{MARK}RESTART-START")))
        {
            break true;
        }
        if vm1.proc.try_wait().unwrap().is_some() || t0.elapsed() > Duration::from_secs(300) {
            break false;
        }
        thread::sleep(Duration::from_millis(50));
    };
    if !started {
        let _ = vm1.proc.kill();
        lines.extend(vm1.serial.finish());
        panic!(
            "the guest did not start writing\n{}",
            dump(&backends, &lines)
        );
    }
    let mut times = Vec::new();
    // A -> B.
    thread::sleep(BEFORE_MIGRATION);
    let port = free_port();
    let mut vm2 = start_qemu(&qemu, &guest, &run.path, "qemu2", &socks[1], Some(port));
    times.push(migrate(&mut vm1, port));
    println!(
        "[migrate] {name}: A -> B at {:.1}s: downtime {} ms, total {} ms",
        t0.elapsed().as_secs_f64(),
        times[0].0,
        times[0].1
    );
    quit(vm1, &mut lines);
    // B -> A (a new QEMU on A's socket).
    thread::sleep(BEFORE_MIGRATION);
    let port = free_port();
    let mut vm3 = start_qemu(&qemu, &guest, &run.path, "qemu3", &socks[0], Some(port));
    times.push(migrate(&mut vm2, port));
    println!(
        "[migrate] {name}: B -> A at {:.1}s: downtime {} ms, total {} ms",
        t0.elapsed().as_secs_f64(),
        times[1].0,
        times[1].1
    );
    quit(vm2, &mut lines);
    // The guest finishes on QEMU 3 and powers off. (qemu-storage-daemon's libvhost-user
    // sometimes dies of its own race in a migration, "vu_panic: Error writing eventfd": then
    // the guest waits for ever; stop at once and say so: `qsd_comparison_run` runs again.)
    let deadline = Instant::now() + Duration::from_secs(600);
    let done = loop {
        let d = vm3
            .proc
            .wait_until(Instant::now() + Duration::from_secs(1))
            .unwrap();
        if d.is_some() || Instant::now() > deadline {
            break d;
        }
        if let Backends::Qsd { log, .. } = &backends {
            if read_log(log).contains("vu_panic") {
                let _ = vm3.proc.kill();
                lines.extend(vm3.serial.finish());
                panic!("{QSD_PANIC}\n{}", dump(&backends, &lines));
            }
        }
    };
    if done.is_none() {
        let _ = vm3.proc.kill();
    }
    lines.extend(vm3.serial.finish());
    let marks = markers(&lines);
    if let Some(f) = marks.iter().find(|m| m.starts_with("FAIL")) {
        panic!("guest reported {f}\n{}", dump(&backends, &lines));
    }
    assert!(
        done.is_some(),
        "the guest hung\n{}",
        dump(&backends, &lines)
    );
    assert!(
        marks.iter().any(|m| m.starts_with("PASS")),
        "no PASS\n{}",
        dump(&backends, &lines)
    );
    match &mut backends {
        Backends::Vublk { a, b, logs } => {
            let (la, lb) = (read_log(&logs[0]), read_log(&logs[1]));
            assert!(
                la.contains("handed the image over") && lb.contains("took the image over"),
                "A -> B handover not in the logs\n{}",
                dump(&backends, &lines)
            );
            assert!(
                lb.contains("handed the image over") && la.contains("took the image over"),
                "B -> A handover not in the logs\n{}",
                dump(&backends, &lines)
            );
            for (p, l) in [(a, &logs[0]), (b, &logs[1])] {
                let st = p.terminate(Duration::from_secs(30));
                assert_eq!(
                    st.and_then(|s| s.code()),
                    Some(0),
                    "vublk did not exit 0:\n{}",
                    read_log(l)
                );
            }
        }
        Backends::Qsd { qsd, .. } => {
            qsd.terminate(Duration::from_secs(30));
        }
    }
    for s in &socks {
        let _ = fs::remove_file(s);
    }
    // What the cluster has, exported, is checked like a raw image.
    #[cfg(feature = "rbd")]
    let image = match &ceph {
        Some(ceph) => {
            let raw = run.path.join("exported.raw");
            ceph.rbd(&["export", "rbd/disk", raw.to_str().unwrap()]);
            raw
        }
        None => image,
    };
    Some((Outcome { marks, times }, image, guest.pattern, run))
}

/// Every block the guest reported is in the image (qcow2: converted to raw first, and
/// `qemu-img check` clean).
fn verify(name: &str, fmt: &str, o: &Outcome, image: &Path, pattern: &Path, run: &ScratchDir) {
    let raw = if fmt == "qcow2" {
        let out = Command::new("qemu-img")
            .args(["check", "-f", "qcow2"])
            .arg(image)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "qemu-img check:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        check_bitmap(image, run);
        let raw = run.path.join("converted.raw");
        let st = Command::new("qemu-img")
            .args(["convert", "-f", "qcow2", "-O", "raw"])
            .arg(image)
            .arg(&raw)
            .status()
            .unwrap();
        assert!(st.success());
        raw
    } else if fmt == "luks" {
        let raw = run.path.join("decrypted.raw");
        vm::luks_to_raw(image, &run.path.join("pass"), &raw);
        raw
    } else {
        image.to_owned()
    };
    let blocks = check_blocks(&o.marks, &raw, pattern, WRITERS, DISK_BYTES);
    let stall = o
        .marks
        .iter()
        .find_map(|m| m.strip_prefix("STALL longest_write="))
        .unwrap_or("?");
    println!(
        "[migrate] {name}: {blocks} blocks written and verified across two migrations \
         (downtime, total ms: {:?}); longest guest write {stall}",
        o.times
    );
}

#[test]
fn raw_image_migrates_there_and_back_under_a_writing_guest() {
    let _one = ONE_GUEST_AT_A_TIME
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    let Some((o, image, pattern, run)) = run("raw", "raw", false) else {
        return;
    };
    verify("raw", "raw", &o, &image, &pattern, &run);
}

#[test]
fn qcow2_image_migrates_there_and_back_under_a_writing_guest() {
    let _one = ONE_GUEST_AT_A_TIME
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    let Some((o, image, pattern, run)) = run("qcow2", "qcow2", false) else {
        return;
    };
    verify("qcow2", "qcow2", &o, &image, &pattern, &run);
}

/// An encrypted disk (a LUKS1 volume) migrated there and back: the destination, started
/// with `--incoming` and the same `--key-secret`, reads the header's size without
/// unlocking, and unlocks the volume when it takes over.
#[test]
fn luks_volume_migrates_there_and_back_under_a_writing_guest() {
    let _one = ONE_GUEST_AT_A_TIME
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    let Some((o, image, pattern, run)) = run("luks", "luks", false) else {
        return;
    };
    verify("luks", "luks", &o, &image, &pattern, &run);
}

/// The same run with qemu-storage-daemon serving both sides: the comparison for downtime
/// (and a check of the harness against a backend that migrates).
/// Shared storage: an RBD image both vublk serve; the handover gives up librbd's exclusive
/// lock, the take-over takes it (and keeps watching for resizes).
#[cfg(feature = "rbd")]
#[test]
fn rbd_image_migrates_there_and_back_under_a_writing_guest() {
    let _one = ONE_GUEST_AT_A_TIME
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    let Some((o, image, pattern, run)) = run("rbd", "rbd", false) else {
        return;
    };
    verify("rbd", "rbd", &o, &image, &pattern, &run);
}

/// What `run` panics with when qemu-storage-daemon itself died (`qsd_comparison_run`).
const QSD_PANIC: &str = "qemu-storage-daemon died of a libvhost-user panic during the migration";

#[test]
fn qsd_comparison_run() {
    let _one = ONE_GUEST_AT_A_TIME
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    // A second run where the first ended in qemu-storage-daemon's own panic (not the
    // harness's, not vublk's): the comparison needs one run where QSD works.
    for attempt in 1..=2 {
        let r = std::panic::catch_unwind(|| run("qsd", "raw", true));
        let r = match r {
            Ok(r) => r,
            Err(e) if attempt == 1 && panic_text(&e).contains(QSD_PANIC) => {
                println!("[migrate] qsd: {QSD_PANIC}; running it again");
                continue;
            }
            Err(e) => std::panic::resume_unwind(e),
        };
        let Some((o, image, pattern, run)) = r else {
            return;
        };
        verify("qsd", "raw", &o, &image, &pattern, &run);
        return;
    }
}

fn panic_text(e: &Box<dyn std::any::Any + Send>) -> String {
    e.downcast_ref::<String>()
        .cloned()
        .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default()
}

/// The persistent bitmap b0 came through both migrations valid (not in use) and records every
/// cluster the guest wrote: each cluster with data in the fresh image (`qemu-img map`) is
/// dirty in it (`qemu-nbd -B b0` under `nbdinfo --map`; 64 KiB granules, 64 KiB clusters).
fn check_bitmap(image: &Path, run: &ScratchDir) {
    let out = |c: &mut Command| {
        let o = c.output().unwrap();
        assert!(
            o.status.success(),
            "{c:?}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        String::from_utf8_lossy(&o.stdout).into_owned()
    };
    let info = out(Command::new("qemu-img")
        .args(["info", "--output=json"])
        .arg(image));
    assert!(
        info.contains("\"b0\"") && !info.contains("in-use"),
        "b0 after the migrations:\n{info}"
    );
    let map: serde_json::Value = serde_json::from_str(&out(Command::new("qemu-img")
        .args(["map", "--output=json", "-f", "qcow2"])
        .arg(image)))
    .unwrap();
    let g = 65536u64;
    let mut written = std::collections::BTreeSet::new();
    for e in map.as_array().unwrap() {
        if e["data"].as_bool() == Some(true) {
            let (o, l) = (e["start"].as_u64().unwrap(), e["length"].as_u64().unwrap());
            written.extend(o / g..(o + l).div_ceil(g));
        }
    }
    let mut dirty = std::collections::BTreeSet::new();
    for (o, l) in common::nbd_dirty_map(image, "b0") {
        dirty.extend(o / g..(o + l).div_ceil(g));
    }
    assert!(!written.is_empty());
    let missing: Vec<u64> = written.difference(&dirty).take(10).copied().collect();
    assert!(
        missing.is_empty(),
        "clusters the guest wrote and b0 lacks (first 10, in 64 KiB units): {missing:?} \
         ({} written, {} dirty; run in {})",
        written.len(),
        dirty.len(),
        run.path.display()
    );
}
