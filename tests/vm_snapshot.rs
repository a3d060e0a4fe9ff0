//! A snapshot, a stream and a commit under a running Linux guest (QEMU, TCG;
//! docs/snapshots.md): the guest's `restart` workload writes 4 KiB and 1 MiB blocks all
//! over its raw disk and verifies them; the test pauses the VM (QMP `stop`), copies the
//! image file as the reference, takes a snapshot, resumes the VM, and after a while streams
//! the chain into the overlay while the guest goes on writing; then it takes a second
//! snapshot and commits it back into the first overlay (an active commit: the guest is
//! switched back to the first overlay). The guest finishes its workload (PASS); the old
//! image is still the disk at the snapshot, the first overlay stands alone (no backing
//! file, `qemu-img check` clean), and every block the guest wrote is in it.
//!
//! Environment: `VUBLK_E2E_REQUIRE=1` fails instead of skipping when QEMU or the guest
//! kernel is missing; `VUBLK_E2E_KEEP=1` keeps the run directory.

mod common;
mod vm;

use std::fs;
use std::process::Command;
use std::thread;
use std::time::{Duration, Instant};

use vm::check_blocks;
use vm::writing::Rig;

const DISK: u64 = 512 << 20;
const WRITERS: u64 = 2;
const SECONDS: u64 = 40;

#[test]
fn a_snapshot_a_stream_and_a_commit_under_a_writing_guest() {
    let Some(Rig {
        run,
        image,
        ctl: ctl_sock,
        mut vublk,
        guest,
        mut g,
    }) = Rig::start("vm-snapshot", &["qemu-img"], DISK, WRITERS, SECONDS)
    else {
        return;
    };
    // Let it write, then pause it between two requests, take the reference and snapshot.
    thread::sleep(Duration::from_secs(5));
    g.qmp.ok(r#"{"execute":"stop"}"#);
    let reference = fs::read(&image).unwrap();
    let overlay = run.path.join("s1.qcow2");
    let snap = common::ctl_ok(
        &ctl_sock,
        "snapshot",
        &["--overlay", &overlay.display().to_string()],
    );
    g.qmp.ok(r#"{"execute":"cont"}"#);
    println!("[snapshot] {snap}");
    // The guest writes into the overlay; then the chain is streamed into it meanwhile.
    thread::sleep(Duration::from_secs(5));
    common::ctl_ok(&ctl_sock, "stream", &["--id", "vm"]);
    let t0 = Instant::now();
    let job = loop {
        let v = common::ctl_ok(&ctl_sock, "jobs", &[]);
        let j = v["jobs"][0].clone();
        if j["state"] == "concluded" {
            break j;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(300),
            "the stream runs on: {v}"
        );
        thread::sleep(Duration::from_millis(100));
    };
    assert!(job["error"].is_null(), "{job}");
    println!("[stream] {job}");
    let status = common::ctl_ok(&ctl_sock, "status", &[]);
    assert_eq!(status["chain"].as_array().unwrap().len(), 1, "{status}");
    // A second snapshot, written into for a while, then committed back into the first
    // overlay while the guest writes on: the guest is served the first overlay again.
    let s2 = run.path.join("s2.qcow2");
    common::ctl_ok(
        &ctl_sock,
        "snapshot",
        &["--overlay", &s2.display().to_string()],
    );
    thread::sleep(Duration::from_secs(3));
    common::ctl_ok(&ctl_sock, "commit", &["--id", "merge"]);
    let t0 = Instant::now();
    let job = loop {
        let v = common::ctl_ok(&ctl_sock, "jobs", &[]);
        let j = v["jobs"]
            .as_array()
            .unwrap()
            .iter()
            .find(|j| j["id"] == "merge")
            .cloned()
            .unwrap();
        if j["state"] == "concluded" {
            break j;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(300),
            "the commit runs on: {v}"
        );
        thread::sleep(Duration::from_millis(100));
    };
    assert!(job["error"].is_null(), "{job}");
    println!("[commit] {job}");
    let status = common::ctl_ok(&ctl_sock, "status", &[]);
    assert!(
        status["serving"]
            .as_str()
            .is_some_and(|p| p.ends_with("/s1.qcow2")),
        "{status}"
    );
    assert_eq!(status["chain"].as_array().unwrap().len(), 1, "{status}");
    // The guest finishes its workload (PASS) and powers off.
    let marks = g.finish();
    vublk.terminate(Duration::from_secs(20));
    // The old image is the disk at the snapshot; the overlay stands alone and holds every
    // block the guest wrote.
    common::assert_same(&fs::read(&image).unwrap(), &reference, "the old image");
    let info = common::run_ok(Command::new("qemu-img").arg("info").arg(&overlay));
    assert!(!info.contains("backing file"), "{info}");
    common::assert_check_allows_leaks(&overlay, "qcow2", "the streamed overlay");
    // The committed overlay is left as it was at the switch, consistent.
    common::assert_check_allows_leaks(&s2, "qcow2", "the committed overlay (left)");
    let flat = run.path.join("flat.raw");
    common::convert_to_raw(&overlay, "qcow2", &flat);
    let checked = check_blocks(&marks, &flat, &guest.pattern, WRITERS, DISK);
    assert!(checked > 0, "no block checked");
    println!("[check] {checked} blocks the guest wrote are in the overlay");
}
