//! A backup under a running Linux guest (QEMU, TCG; docs/backups.md): the guest's `restart`
//! workload writes 4 KiB and 1 MiB blocks all over its raw disk; the test pauses the VM
//! (QMP `stop`: QEMU stops the vhost-user device, vublk completes what it had), copies the
//! image file as the reference, calls `backup-begin`, resumes the VM (`cont`), and copies
//! the export with `nbdcopy` while the guest goes on writing: the copy equals the
//! reference, the guest finishes its workload (PASS, every block it wrote verified in the
//! image), and the export was read after the guest had changed the disk (bytes copied
//! before writes).
//!
//! Environment: `VUBLK_E2E_REQUIRE=1` fails instead of skipping when QEMU, the guest kernel
//! or nbdcopy is missing; `VUBLK_E2E_KEEP=1` keeps the run directory.

mod common;
mod vm;

use std::env;
use std::fs::{self, File};
use std::path::Path;
use std::process::Stdio;
use std::thread;
use std::time::{Duration, Instant};

use vm::qmp::Qmp;
use vm::{check_blocks, markers, read_log, ChildGuard, LineCollector, ScratchDir, MARK};

const DISK: u64 = 512 << 20;
const WRITERS: u64 = 2;
const SECONDS: u64 = 40;

#[test]
fn a_backup_under_a_writing_guest_is_its_disk_at_the_begin() {
    let Some((qemu, guest)) = vm::guest_prerequisites(&["qemu-img", "nbdcopy"]) else {
        return;
    };
    let tmp = Path::new(env!("CARGO_TARGET_TMPDIR"));
    let mut run = ScratchDir::new(tmp, &format!("vm-backup-{}", std::process::id())).unwrap();
    run.keep = env::var("VUBLK_E2E_KEEP").is_ok_and(|v| v == "1");
    let image = run.path.join("disk.raw");
    common::qemu_img_create(&image, "raw", &DISK.to_string());
    let sock = env::temp_dir().join(format!("vublk-vm-backup-{}.sock", std::process::id()));
    let _ = fs::remove_file(&sock);
    let ctl_sock = run.path.join("ctl.sock");
    let log = run.path.join("vublk.log");
    let ctl_arg = ctl_sock.display().to_string();
    let mut vublk = vm::spawn_vublk(
        "vublk",
        &log,
        &sock,
        &image,
        1,
        &["--control-socket", &ctl_arg],
    );
    vm::wait_for_socket(&sock, &mut vublk, Duration::from_secs(20)).unwrap();
    let qmp_path = run.path.join("qemu.qmp");
    let mut qcmd = vm::guest_command(
        &qemu,
        &guest,
        "512M",
        1,
        &format!("path={}", sock.display()),
        ",num-queues=1",
        &format!(
            "console=ttyS0 panic=-1 loglevel=4 E2E_QUEUES=1 E2E_LBS=512 E2E_MODE=restart \
             E2E_WRITERS={WRITERS} E2E_SECONDS={SECONDS} E2E_VERIFY_FIRST=32"
        ),
    );
    qcmd.arg("-qmp")
        .arg(format!("unix:{},server=on,wait=off", qmp_path.display()));
    qcmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(File::create(run.path.join("qemu.log")).unwrap());
    let mut q = ChildGuard::spawn("qemu", &mut qcmd).unwrap();
    let stdout = q.child_mut().stdout.take().unwrap();
    let mut serial = LineCollector::new(stdout, File::create(run.path.join("serial.log")).ok());
    let mut qmp = Qmp::connect(&qmp_path, &mut q);
    let dump = |lines: &[String]| {
        format!(
            "--- serial:\n{}\n--- vublk:\n{}\n--- qemu:\n{}",
            lines.join("\n"),
            read_log(&log),
            read_log(&run.path.join("qemu.log"))
        )
    };
    let t0 = Instant::now();
    let mut lines = Vec::new();
    loop {
        let new = serial.poll();
        let started = new
            .iter()
            .any(|l| l.contains(&format!("{MARK}RESTART-START")));
        lines.extend(new);
        if started {
            break;
        }
        if q.try_wait().unwrap().is_some() || t0.elapsed() > Duration::from_secs(300) {
            let _ = q.kill();
            lines.extend(serial.finish());
            panic!("the guest did not start writing\n{}", dump(&lines));
        }
        thread::sleep(Duration::from_millis(50));
    }
    // Let it write, then pause it between two requests and take the reference.
    thread::sleep(Duration::from_secs(5));
    qmp.ok(r#"{"execute":"stop"}"#);
    let reference = fs::read(&image).unwrap();
    let nbd = run.path.join("nbd.sock");
    let uri = common::backup_begin(
        &ctl_sock,
        &["--checkpoint", "vm", "--socket", &nbd.display().to_string()],
    );
    qmp.ok(r#"{"execute":"cont"}"#);
    // The guest writes on while the export is copied.
    thread::sleep(Duration::from_secs(3));
    let out = run.path.join("backup.raw");
    common::nbdcopy_ok(&uri, &out);
    let list = common::ctl_ok(&ctl_sock, "backup-list", &[]);
    let copied = list["backups"][0]["copied_bytes"].as_u64().unwrap();
    assert!(
        copied > 0,
        "the guest wrote nothing during the backup: {list}"
    );
    common::assert_same(
        &fs::read(&out).unwrap(),
        &reference,
        "the backup under the guest",
    );
    println!("[backup] the export equals the disk at the begin; {copied} bytes copied before guest writes");
    common::ctl_ok(&ctl_sock, "backup-end", &["--checkpoint", "vm"]);
    // The guest finishes its workload and powers off.
    let deadline = Instant::now() + Duration::from_secs(600);
    let done = q.wait_until(deadline).unwrap();
    if done.is_none() {
        let _ = q.kill();
    }
    lines.extend(serial.finish());
    let marks = markers(&lines);
    if let Some(f) = marks.iter().find(|m| m.starts_with("FAIL")) {
        panic!("guest reported {f}\n{}", dump(&lines));
    }
    assert!(done.is_some(), "the guest hung\n{}", dump(&lines));
    assert!(
        marks.iter().any(|m| m.starts_with("PASS")),
        "no PASS\n{}",
        dump(&lines)
    );
    vublk.terminate(Duration::from_secs(20));
    let checked = check_blocks(&marks, &image, &guest.pattern, WRITERS, DISK);
    assert!(checked > 0, "no block checked\n{}", dump(&lines));
}
