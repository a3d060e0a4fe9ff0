//! Online resize under a running Linux guest (QEMU, TCG): the guest writes its disk's last
//! block, the host grows the disk with `vublk ctl resize`, and the guest must see the new
//! size within a second (vublk sends VHOST_USER_BACKEND_CONFIG_CHANGE_MSG, QEMU re-reads the
//! config space and interrupts the guest), write and read back its new last block, and
//! still read the old one. Raw and qcow2 (then `qemu-img check` clean), and an RBD image
//! resized in the cluster with `rbd resize` (cargo feature `rbd`).
//!
//! Environment: `VUBLK_E2E_REQUIRE=1` fails instead of skipping when QEMU or the guest
//! kernel is missing; `VUBLK_E2E_KEEP=1` keeps the run directory.

mod common;
mod vm;

use std::env;
use std::fs;
use std::path::Path;
use std::process::Command;
use std::thread;
use std::time::{Duration, Instant};

use vm::{read_log, ScratchDir, MARK};

const DISK: u64 = 512 << 20;
const GROWN: u64 = DISK + (64 << 20);

static ONE_GUEST_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn run(fmt: &str) {
    let Some((qemu, guest)) = vm::guest_prerequisites(&["qemu-img"]) else {
        return;
    };
    let tmp = Path::new(env!("CARGO_TARGET_TMPDIR"));
    let mut run = ScratchDir::new(tmp, &format!("vm-resize-{fmt}-{}", std::process::id())).unwrap();
    run.keep = env::var("VUBLK_E2E_KEEP").is_ok_and(|v| v == "1");
    // An RBD disk is resized in the cluster (`rbd resize`), the others with `vublk ctl`.
    #[cfg(feature = "rbd")]
    let ceph = if fmt == "rbd" {
        let Some(ceph) = common::Ceph::with_disk(&run.path, DISK) else {
            return;
        };
        Some(ceph)
    } else {
        None
    };
    let image = if fmt == "rbd" {
        std::path::PathBuf::from("rbd:rbd/disk")
    } else {
        let image = run.path.join(format!("disk.{fmt}"));
        common::qemu_img_create(&image, fmt, &DISK.to_string());
        image
    };
    let sock = env::temp_dir().join(format!("vublk-resize-{fmt}-{}.sock", std::process::id()));
    let ctl = run.path.join("ctl.sock");
    let _ = fs::remove_file(&sock);
    let log = run.path.join("vublk.log");
    #[allow(unused_mut, clippy::useless_vec)]
    let mut args = vec!["--control-socket".to_string(), ctl.display().to_string()];
    #[cfg(feature = "rbd")]
    if let Some(ceph) = &ceph {
        args.extend(ceph.args());
    }
    let args: Vec<&str> = args.iter().map(|s| s.as_str()).collect();
    let mut vublk = vm::spawn_vublk("vublk", &log, &sock, &image, 1, &args);
    vm::wait_for_socket(&sock, &mut vublk, Duration::from_secs(20)).unwrap();
    let (mut q, mut serial) = vm::start_one_queue_guest(
        &qemu,
        &guest,
        &sock,
        "console=ttyS0 panic=-1 loglevel=4 E2E_MODE=resize E2E_LBS=512",
        &run.path,
    );
    let deadline = Instant::now() + Duration::from_secs(300);
    let mut resized_at = None;
    let status = loop {
        for l in serial.poll() {
            if l.contains(&format!("{MARK}RESIZE-WAIT")) && resized_at.is_none() && fmt == "rbd" {
                #[cfg(feature = "rbd")]
                if let Some(ceph) = &ceph {
                    ceph.rbd(&["resize", "rbd/disk", "--size", &format!("{}M", GROWN >> 20)]);
                }
                resized_at = Some(Instant::now());
            } else if l.contains(&format!("{MARK}RESIZE-WAIT")) && resized_at.is_none() {
                let o = Command::new(env!("CARGO_BIN_EXE_vublk"))
                    .arg("ctl")
                    .arg("--control-socket")
                    .arg(&ctl)
                    .arg("resize")
                    .arg(GROWN.to_string())
                    .output()
                    .unwrap();
                let out = String::from_utf8_lossy(&o.stdout);
                assert!(
                    o.status.success() && out.contains("\"frontend_notified\": true"),
                    "resize: {out}{}\n{}",
                    String::from_utf8_lossy(&o.stderr),
                    read_log(&log)
                );
                resized_at = Some(Instant::now());
            }
        }
        if let Some(st) = q.try_wait().unwrap() {
            break Some(st);
        }
        if Instant::now() > deadline {
            break None;
        }
        thread::sleep(Duration::from_millis(20));
    };
    let lines = serial.finish();
    let marks = vm::assert_passed(status.is_some(), &lines, &log, &run.path);
    let dump = || vm::dump(&lines, &log, &run.path);
    let resized = marks
        .iter()
        .find_map(|m| m.strip_prefix("RESIZED "))
        .unwrap_or_else(|| panic!("no RESIZED\n{}", dump()));
    assert!(
        resized.contains(&format!("sectors={}", GROWN / 512)),
        "{resized}\n{}",
        dump()
    );
    // "after=S.CCs": how long the guest waited for the new size after it asked.
    let after: f64 = resized
        .split("after=")
        .nth(1)
        .and_then(|s| s.trim_end_matches('s').parse().ok())
        .unwrap_or(f64::MAX);
    println!("[resize] {fmt}: the guest saw {GROWN} bytes {after:.2} s after it started waiting");
    assert!(
        after < 1.0,
        "the guest saw the new size after {after} s\n{}",
        dump()
    );
    let st = vublk.terminate(Duration::from_secs(30));
    assert_eq!(st.and_then(|s| s.code()), Some(0), "{}", read_log(&log));
    if fmt == "rbd" {
        // The update watch saw the resize and vublk told QEMU.
        assert!(
            read_log(&log).contains("the frontend told"),
            "{}",
            read_log(&log)
        );
    } else if fmt == "qcow2" {
        let o = Command::new("qemu-img")
            .args(["check", "-f", "qcow2"])
            .arg(&image)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stdout));
    } else {
        assert_eq!(fs::metadata(&image).unwrap().len(), GROWN);
    }
    let _ = fs::remove_file(&sock);
}

#[test]
fn a_raw_disk_grows_under_a_running_guest() {
    let _one = ONE_GUEST_AT_A_TIME
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    run("raw");
}

/// An RBD image resized in the cluster (`rbd resize`): librbd's update watch, then the
/// same config-change path.
#[cfg(feature = "rbd")]
#[test]
fn an_rbd_disk_resized_in_the_cluster_grows_under_a_running_guest() {
    let _one = ONE_GUEST_AT_A_TIME
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    run("rbd");
}

#[test]
fn a_qcow2_disk_grows_under_a_running_guest() {
    let _one = ONE_GUEST_AT_A_TIME
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    run("qcow2");
}
