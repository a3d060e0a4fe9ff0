//! The error policy under a running Linux guest (QEMU, TCG): the disk's raw image lives on a
//! small tmpfs the test mounts (root), mostly taken by a filler file. The guest makes an
//! ext4 and writes files onto it (E2E_MODE=hold in contrib/guest/e2e-workload.sh) until
//! the host file system is full: vublk (the default `--werror enospc`) holds the writes
//! and `ctl status` shows them; the guest waits. The test frees space a few seconds later;
//! the guest must then finish with no I/O error, no ext4 error and no read-only remount in
//! its dmesg, its files verified, and `e2fsck` clean on the host.
//!
//! Environment: `VUBLK_E2E_REQUIRE=1` fails instead of skipping when QEMU or the guest
//! kernel is missing; `VUBLK_E2E_KEEP=1` keeps the run directory; `VUBLK_HOLD_SECS=N` holds
//! the guest N seconds instead of 4.

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
/// The tmpfs and the filler that leaves about 80 MiB of it: enough for mkfs, not for the
/// guest's 96 MiB of files.
const FS: u64 = 256 << 20;
const FILLER: u64 = 176 << 20;
/// How long the guest is kept waiting once writes are held (`VUBLK_HOLD_SECS`, default 4).
fn held_for() -> Duration {
    Duration::from_secs(
        env::var("VUBLK_HOLD_SECS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(4),
    )
}

#[test]
fn a_guest_rides_out_a_full_host_file_system() {
    let Some((qemu, guest)) = vm::guest_prerequisites(&["e2fsck"]) else {
        return;
    };
    let tmp = Path::new(env!("CARGO_TARGET_TMPDIR"));
    let mut run = ScratchDir::new(tmp, &format!("vm-hold-{}", std::process::id())).unwrap();
    run.keep = env::var("VUBLK_E2E_KEEP").is_ok_and(|v| v == "1");
    let Some(tmpfs) = common::Tmpfs::mount(&run.path.join("fs"), FS) else {
        return;
    };
    let image = tmpfs.join("disk.raw");
    common::create_sparse_image(&image, DISK);
    let filler = tmpfs.join("filler");
    fs::write(&filler, vec![0x3c; FILLER as usize]).unwrap();
    let sock = env::temp_dir().join(format!("vublk-hold-{}.sock", std::process::id()));
    let _ = fs::remove_file(&sock);
    let ctl = run.path.join("ctl.sock");
    let log = run.path.join("vublk.log");
    let ctl_arg = ctl.display().to_string();
    let mut vublk = vm::spawn_vublk(
        "vublk",
        &log,
        &sock,
        &image,
        1,
        &["--control-socket", &ctl_arg, "--error-retry-interval", "1"],
    );
    vm::wait_for_socket(&sock, &mut vublk, Duration::from_secs(20)).unwrap();
    let (mut q, mut serial) = vm::start_one_queue_guest(
        &qemu,
        &guest,
        &sock,
        "console=ttyS0 panic=-1 loglevel=4 E2E_MODE=hold E2E_HOLD_COPIES=4",
        &run.path,
    );
    let held = || -> serde_json::Value {
        let o = Command::new(env!("CARGO_BIN_EXE_vublk"))
            .args(["ctl", "--control-socket", &ctl_arg, "status"])
            .output()
            .unwrap();
        serde_json::from_slice::<serde_json::Value>(&o.stdout).unwrap_or_default()["error_policy"]
            ["held"]
            .clone()
    };
    let deadline = Instant::now() + Duration::from_secs(600);
    let mut seen_held: Option<(Instant, serde_json::Value)> = None;
    let mut freed = false;
    let mut lines_seen = Vec::new();
    let status = loop {
        lines_seen.extend(serial.poll());
        let writing = lines_seen
            .iter()
            .any(|l| l.contains(&format!("{MARK}HOLD-WRITING")));
        if writing && seen_held.is_none() {
            let h = held();
            if h["requests"].as_u64().unwrap_or(0) > 0 {
                seen_held = Some((Instant::now(), h));
            }
        }
        if let Some((at, _)) = &seen_held {
            if !freed && at.elapsed() >= held_for() {
                // Still held (the guest waits, nothing failed): free the space.
                let h = held();
                assert!(
                    h["requests"].as_u64().unwrap_or(0) > 0,
                    "no longer held with no space freed: {h}\n{}",
                    read_log(&log)
                );
                assert!(
                    !lines_seen
                        .iter()
                        .any(|l| l.contains(&format!("{MARK}HOLD-WRITTEN"))),
                    "the guest finished writing while writes were held"
                );
                fs::remove_file(&filler).unwrap();
                freed = true;
            }
        }
        if let Some(st) = q.try_wait().unwrap() {
            break Some(st);
        }
        if Instant::now() > deadline {
            break None;
        }
        thread::sleep(Duration::from_millis(100));
    };
    lines_seen.extend(serial.finish());
    vm::assert_passed(status.is_some(), &lines_seen, &log, &run.path);
    let (_, h) = seen_held.unwrap_or_else(|| {
        panic!(
            "nothing was ever held\n{}",
            vm::dump(&lines_seen, &log, &run.path)
        )
    });
    assert_eq!(h["errno"], libc::ENOSPC, "{h}");
    println!("[hold] held: {h}; freed after {:?}", held_for());
    let st = vublk.terminate(Duration::from_secs(30));
    assert_eq!(st.and_then(|s| s.code()), Some(0), "{}", read_log(&log));
    let vlog = read_log(&log);
    assert!(vlog.contains("holding writes that failed"), "{vlog}");
    assert!(vlog.contains("no request held any more"), "{vlog}");
    let o = Command::new("e2fsck")
        .args(["-fn"])
        .arg(&image)
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "e2fsck on the image: {}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    let _ = fs::remove_file(&sock);
}
