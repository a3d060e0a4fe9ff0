//! Mirror jobs (docs/snapshots.md#mirror): `vublk ctl mirror` under a libblkio writer. The
//! job copies the running disk to a new image, waits in `ready` while still copying what
//! the guest writes, and on `job-complete` switches the guest to the target (the write
//! lock moves with it; the disk reads the same; a restart serves the target); `--sync top`
//! shares the backing chain; `--bitmap` brings an older copy up to date; `job-cancel`
//! leaves the guest on the source; refusals say why.

mod common;

use std::path::Path;
use std::time::Duration;

use common::*;
use serde_json::Value;

const SIZE: u64 = 32 * MIB;
const STOP: Duration = Duration::from_secs(10);

fn status(sock: &Path) -> Value {
    ctl_ok(sock, "status", &[])
}

/// Mirror `src_fmt` disks to new targets under a writer: full to the same format, full to
/// another, and (after a snapshot) top; `ready` before the switch, the guest still on the
/// source; after `job-complete` the target is served, holds the write lock, equals the
/// disk, passes `qemu-img check`, and a restart serves it.
#[test]
fn a_mirror_under_writes_switches_the_guest_on_job_complete() {
    if skip_chain_test("mirror jobs") {
        return;
    }
    for (src_fmt, target_fmt, sync, mode) in [
        ("raw", None, "full", "auto"),
        ("qcow2", Some("raw"), "full", "write-through"),
        ("parallels", Some("qcow2"), "full", "auto"),
        ("raw", None, "top", "write-through"),
    ] {
        let what = format!("{src_fmt} -> {target_fmt:?} sync {sync} copy-mode {mode}");
        let dir = TestDir::new(&format!("mirror-{src_fmt}-{sync}"));
        let img = make_disk(&dir, src_fmt, SIZE);
        let (backend, sock) = start_with_control(&dir, &img, 2, &[]);
        let writer = Writer::start(connect_queues(&backend.socket, 2), 21);
        writer.run_for(50);
        let mut source = img.clone();
        if sync == "top" {
            source = dir.join("s1.qcow2");
            ctl_ok(
                &sock,
                "snapshot",
                &["--overlay", &source.display().to_string()],
            );
            writer.run_for(50);
        }
        let target = dir.join("target.img");
        let mut args = vec![
            "--id",
            "m",
            "--target",
            target.to_str().unwrap(),
            "--sync",
            sync,
            "--copy-mode",
            mode,
        ];
        if let Some(f) = target_fmt {
            args.extend(["--format", f]);
        }
        let j = ctl_ok(&sock, "mirror", &args);
        assert_eq!(j["type"], "mirror", "{j}");
        let j = wait_state(&sock, "m", "ready");
        println!("[{what}] ready: {j}");
        writer.run_for(100);
        // Still the source until job-complete.
        assert_eq!(status(&sock)["serving"], source.display().to_string());
        assert!(holds_write(&source), "{what}: the source lost its lock");
        ctl_ok(&sock, "job-complete", &["m"]);
        let j = wait_job(&sock, "m");
        assert!(j["error"].is_null(), "{what}: {j}");
        let st = status(&sock);
        assert_eq!(st["serving"], target.display().to_string(), "{st}");
        let layers = st["chain"].as_array().unwrap().len();
        assert_eq!(layers, if sync == "top" { 2 } else { 1 }, "{what}: {st}");
        // The lock moved with the guest.
        assert!(holds_write(&target), "{what}: the target is not held");
        assert!(!holds_write(&source), "{what}: the source is still held");
        writer.run_for(50);
        let mut c = writer.stop();
        assert_eq!(c.submit(0, Op::Flush), 0);
        let end = c.read_all(0);
        drop(c);
        if mode == "write-through" {
            // The guest's writes went to the target as they completed.
            let log = backend.log_contents();
            let through = written_through(&log);
            println!("[{what}] guest writes written through: {through:?}");
            assert!(through.is_some_and(|n| n > 0), "{what}: {log}");
        }
        assert_eq!(backend.sigterm_and_wait(STOP).code(), Some(0));
        let r = dir.join("end.raw");
        std::fs::write(&r, &end).unwrap();
        assert_compare(&target, &r, &format!("{what}: the target"));
        let info = qemu_img(&["info", "--output=json"], &[&target]);
        let fmt = serde_json::from_str::<Value>(&info).unwrap()["format"]
            .as_str()
            .unwrap()
            .to_owned();
        let expected = match (target_fmt, sync) {
            (Some(f), _) => f,
            (None, "top") => "qcow2",
            (None, _) => src_fmt,
        };
        assert_eq!(fmt, expected, "{what}");
        if fmt != "raw" {
            assert_check_allows_leaks(&target, &fmt, &what);
        }
        if sync == "top" {
            let ch = chain(&target);
            assert_eq!(ch.len(), 2, "{what}: {ch:?}");
            assert!(ch[1].0.ends_with("disk.raw"), "{what}: {ch:?}");
        } else {
            assert_eq!(chain(&target).len(), 1, "{what}: a stand-alone image");
        }
        // A restart with the same command line serves the target.
        let (backend, sock) = start_with_control(&dir, &img, 1, &[]);
        assert_eq!(status(&sock)["serving"], target.display().to_string());
        let mut c = connect(&backend.socket, ClientOpts::default());
        assert_same(&c.read_all(0), &end, &format!("{what}: after the restart"));
        drop(c);
        assert_eq!(backend.sigterm_and_wait(STOP).code(), Some(0));
    }
}

/// `--bitmap`: an older copy of the disk (taken with the bitmap's creation) brought up to
/// date by copying only what the bitmap marks, then the guest switched to it.
#[test]
fn a_bitmap_mirror_brings_an_older_copy_up_to_date() {
    if skip_chain_test("mirror jobs") {
        return;
    }
    let dir = TestDir::new("mirror-bitmap");
    let img = make_disk(&dir, "qcow2", SIZE);
    let (backend, sock) = start_with_control(&dir, &img, 2, &[]);
    // The copy and the bitmap at one moment: no writer connected.
    let mut c = connect(&backend.socket, ClientOpts::default());
    ctl_ok(&sock, "bitmap-add", &["b"]);
    let older = c.read_all(0);
    drop(c);
    let target = dir.join("copy.raw");
    std::fs::write(&target, &older).unwrap();
    let writer = Writer::start(connect_queues(&backend.socket, 2), 31);
    writer.run_for(200);
    let listed = ctl_ok(&sock, "bitmap-list", &[]);
    println!("[bitmap] {listed}");
    ctl_ok(
        &sock,
        "mirror",
        &[
            "--id",
            "m",
            "--target",
            target.to_str().unwrap(),
            "--bitmap",
            "b",
        ],
    );
    let j = wait_state(&sock, "m", "ready");
    // Only what the bitmap marked (and what the guest wrote since) was copied.
    assert!(
        j["bytes_total"].as_u64().unwrap() < SIZE,
        "the whole disk was copied: {j}"
    );
    writer.run_for(50);
    ctl_ok(&sock, "job-complete", &["m"]);
    let j = wait_job(&sock, "m");
    assert!(j["error"].is_null(), "{j}");
    let mut c = writer.stop();
    assert_eq!(c.submit(0, Op::Flush), 0);
    let end = c.read_all(0);
    drop(c);
    assert_eq!(backend.sigterm_and_wait(STOP).code(), Some(0));
    let r = dir.join("end.raw");
    std::fs::write(&r, &end).unwrap();
    assert_compare(&target, &r, "the updated copy");
}

/// `job-cancel` in `ready` leaves the guest on the source; refusals name the reason.
#[test]
fn mirror_cancel_and_refusals() {
    if skip_chain_test("mirror jobs") {
        return;
    }
    let dir = TestDir::new("mirror-refusals");
    let img = make_disk(&dir, "raw", SIZE);
    let (backend, sock) = start_with_control(&dir, &img, 1, &[]);
    let t = |name: &str| dir.join(name).display().to_string();
    let refused = |args: &[&str], why: &str| {
        let (ok, _, err) = ctl(&sock, "mirror", args);
        assert!(!ok && err.contains(why), "mirror {args:?}: {err}");
    };
    std::fs::write(dir.join("exists.raw"), b"x").unwrap();
    refused(&["--target", &t("exists.raw")], "already exists");
    assert_eq!(std::fs::read(dir.join("exists.raw")).unwrap(), b"x");
    refused(
        &["--target", &img.display().to_string()],
        "the disk's own image",
    );
    refused(
        &["--target", &t("a.img"), "--sync", "top"],
        "no backing file",
    );
    refused(&["--target", &t("a.img"), "--sync", "bogus"], "full or top");
    refused(
        &["--target", &t("a.img"), "--copy-mode", "bogus"],
        "background, write-through or auto",
    );
    refused(
        &["--target", &t("a.img"), "--format", "vmdk"],
        "raw, qcow2 or parallels",
    );
    refused(&["--target", &t("exists.raw"), "--bitmap", "nope"], "nope");
    refused(&["--target", &t("missing/a.img")], "missing");
    assert!(!dir.join("a.img").exists());
    // Cancelled in ready: the source stays served and written.
    let writer = Writer::start(connect_queues(&backend.socket, 1), 41);
    ctl_ok(&sock, "mirror", &["--id", "m", "--target", &t("a.img")]);
    wait_state(&sock, "m", "ready");
    // A second job while one runs.
    let (ok, _, err) = ctl(&sock, "commit", &[]);
    assert!(!ok, "{err}");
    ctl_ok(&sock, "job-cancel", &["m"]);
    let j = wait_job(&sock, "m");
    assert!(j["error"].as_str().unwrap().contains("cancelled"), "{j}");
    assert_eq!(status(&sock)["serving"], img.display().to_string());
    assert!(holds_write(&img));
    assert!(!holds_write(&dir.join("a.img")), "the target is still open");
    writer.run_for(50);
    let mut c = writer.stop();
    assert_eq!(c.submit(0, Op::Flush), 0);
    let end = c.read_all(0);
    drop(c);
    assert_eq!(backend.sigterm_and_wait(STOP).code(), Some(0));
    assert_same(
        &std::fs::read(&img).unwrap(),
        &end,
        "the source after the cancel",
    );
}

/// SIGKILL at random moments of a mirror (runs: `VUBLK_MIRROR_KILLS`, 6 by default): before
/// `ready`, in it, around `job-complete` and after the switch; raw and qcow2 sources and
/// targets in turn, a writer that flushes after every write. After each kill the restarted
/// daemon serves the source or the target with every flushed write, `qemu-img check`
/// accepts the qcow2 images, and a mirror started again (when the source is served)
/// finishes with the same disk.
#[test]
fn sigkill_during_a_mirror_loses_no_flushed_write() {
    if skip_chain_test("mirror jobs") {
        return;
    }
    let runs: u64 = std::env::var("VUBLK_MIRROR_KILLS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(6);
    let mut rng = Rng::new(0x3177);
    for run in 0..runs {
        let fmt = if run % 2 == 0 { "raw" } else { "qcow2" };
        let target_fmt = if run % 4 < 2 { "qcow2" } else { "raw" };
        let dir = TestDir::new(&format!("mirror-kill-{run}"));
        let img = make_disk(&dir, fmt, SIZE);
        let (backend, sock) = start_with_control(&dir, &img, 1, &[]);
        let writer = FlushingWriter::start(
            connect(&backend.socket, ClientOpts::default()),
            rng.next_u64(),
            SIZE,
        );
        writer.wait_for(50);
        let target = dir.join("t1.img");
        let speed = if run % 3 == 2 { "0" } else { "16M" };
        ctl_ok(
            &sock,
            "mirror",
            &[
                "--id",
                "m",
                "--target",
                target.to_str().unwrap(),
                "--format",
                target_fmt,
                "--speed",
                speed,
            ],
        );
        std::thread::sleep(Duration::from_micros(rng.below(2_000_000)));
        if rng.below(2) == 0 {
            // Complete it if it is ready by now (refused otherwise).
            let _ = ctl(&sock, "job-complete", &["m"]);
            std::thread::sleep(Duration::from_micros(rng.below(300_000)));
        }
        backend.signal(libc::SIGKILL);
        let _ = backend.wait_exit(STOP);
        let writes = writer.stop();
        drop(backend);
        for p in [&img, &target] {
            wait_unlocked(p, STOP);
        }
        for (p, f) in [(&img, fmt), (&target, target_fmt)] {
            if f == "qcow2" && p.exists() {
                assert_check_allows_leaks(p, f, &format!("run {run}: {}", p.display()));
            }
        }
        let (backend, sock) = start_with_control(&dir, &img, 1, &[]);
        let serving = status(&sock)["serving"].as_str().unwrap().to_owned();
        println!("[run {run}] serving {serving} after the kill");
        let mut c = connect(&backend.socket, ClientOpts::default());
        let disk = c.read_all(0);
        writes.check(&disk, &format!("run {run}, after the kill"));
        // Started again from the source, it finishes, and the disk is the same.
        if serving == img.display().to_string() {
            let t2 = dir.join("t2.img");
            ctl_ok(
                &sock,
                "mirror",
                &["--id", "again", "--target", t2.to_str().unwrap()],
            );
            wait_state(&sock, "again", "ready");
            ctl_ok(&sock, "job-complete", &["again"]);
            let j = wait_job(&sock, "again");
            assert!(j["error"].is_null(), "run {run}: {j}");
            assert_eq!(status(&sock)["serving"], t2.display().to_string());
        }
        assert_same(
            &c.read_all(0),
            &disk,
            &format!("run {run}: after the mirror"),
        );
        drop(c);
        assert_eq!(backend.sigterm_and_wait(STOP).code(), Some(0));
    }
}
