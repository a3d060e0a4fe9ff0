//! Live external snapshots (docs/snapshots.md): `vublk ctl snapshot --overlay PATH` under a
//! libblkio writer, for raw, qcow2 and parallels disks: the disk the guest reads never
//! changes at the switch, the old image holds exactly the disk at the switch, qemu-img sees
//! the chain (`info --backing-chain`, `check`, `compare`), a restart with the same command
//! line serves the overlay (the chain's state file) with the old image held only as a
//! backing file; refusals with their reasons; and SIGKILLs at random moments of a snapshot lose
//! nothing the guest flushed.

mod common;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::*;

const SIZE: u64 = 32 * MIB;
const STOP: Duration = Duration::from_secs(10);

/// A snapshot under a writer, for a disk of `fmt`; then a restart that serves the overlay.
fn snapshot_under_writes(fmt: &str) {
    snapshot_under_writes_with(fmt, &[]);
}

/// [`snapshot_under_writes`] with more `snapshot` arguments.
fn snapshot_under_writes_with(fmt: &str, more: &[&str]) {
    if skip_chain_test("snapshots") {
        return;
    }
    let dir = TestDir::new(&format!("snapshot-{fmt}{}", more.len()));
    let img = make_disk(&dir, fmt, SIZE);
    let (backend, sock) = start_with_control(&dir, &img, 2, &[]);
    let writer = Writer::start(connect_queues(&backend.socket, 2), 3);
    writer.run_for(100);
    assert!(holds_write(&img), "the disk is served read-write");
    let overlay = dir.join("s1.qcow2");
    let ov = overlay.display().to_string();
    // Paused between two writes: the disk now is what the old image must keep.
    let (at_switch, answer) = writer.paused(|c| {
        let r = c.read_all(1);
        let mut a = vec!["--overlay", ov.as_str()];
        a.extend(more);
        let a = ctl_ok(&sock, "snapshot", &a);
        // The guest reads the same disk right after the switch.
        assert_same(&c.read_all(0), &r, "the disk right after the switch");
        (r, a)
    });
    assert_eq!(answer["backing_name"], format!("disk.{fmt}"), "{answer}");
    assert_eq!(answer["backing_format"], fmt, "{answer}");
    let status = ctl_ok(&sock, "status", &[]);
    assert_eq!(status["serving"], ov, "{status}");
    assert_eq!(status["chain"][1], img.display().to_string(), "{status}");
    // From the switch on, the old image is a backing file: held for reading only (as QEMU
    // holds a backing file), so qemu-img may open it without -U.
    assert!(
        !holds_write(&img),
        "the old image is still opened for writing"
    );
    writer.run_for(300);
    let mut c = writer.stop();
    assert_eq!(c.submit(0, Op::Flush), 0);
    let end = c.read_all(0);
    drop(c);
    assert_eq!(backend.sigterm_and_wait(STOP).code(), Some(0));

    // The old image holds the disk at the switch; the chain holds the disk at the end.
    let r0 = dir.join("at-switch.raw");
    let r1 = dir.join("end.raw");
    std::fs::write(&r0, &at_switch).unwrap();
    std::fs::write(&r1, &end).unwrap();
    assert_compare(&img, &r0, "the old image");
    assert_compare(&overlay, &r1, "the chain");
    assert_eq!(
        chain(&overlay),
        [
            ("s1.qcow2".to_owned(), "qcow2".to_owned()),
            (format!("disk.{fmt}"), fmt.to_owned())
        ]
    );
    assert_check_allows_leaks(&overlay, "qcow2", "the overlay");
    let info = qemu_img(&["info", "-U", "--output=json"], &[&overlay]);
    let extended = more.contains(&"--extended-l2");
    assert_eq!(
        info.contains("\"extended-l2\": true"),
        extended,
        "the overlay's extended L2 entries: {info}"
    );
    if fmt != "raw" {
        assert_check_allows_leaks(&img, fmt, "the old image");
    }

    // A restart with the same command line serves the overlay, the old image opened only
    // as its backing file.
    let (backend, sock) = start_with_control(&dir, &img, 1, &[]);
    let status = ctl_ok(&sock, "status", &[]);
    assert_eq!(status["serving"], ov, "{status}");
    let mut c = connect(&backend.socket, ClientOpts::default());
    assert_same(&c.read_all(0), &end, "the disk after the restart");
    assert!(
        !holds_write(&img),
        "the old image is still opened for writing"
    );
    // A second snapshot stacks on the first.
    let s2 = dir.join("s2.qcow2");
    ctl_ok(&sock, "snapshot", &["--overlay", &s2.display().to_string()]);
    assert_eq!(c.write_at(0, 0, &[0x5au8; 4096]), 0);
    drop(c);
    assert_eq!(backend.sigterm_and_wait(STOP).code(), Some(0));
    assert_eq!(chain(&s2).len(), 3);
    let (backend, sock) = start_with_control(&dir, &img, 1, &[]);
    assert_eq!(
        ctl_ok(&sock, "status", &[])["serving"],
        s2.display().to_string()
    );
    let mut c = connect(&backend.socket, ClientOpts::default());
    assert_eq!(c.read_at(0, 0, 4096).unwrap(), vec![0x5au8; 4096]);
    drop(c);
    assert_eq!(backend.sigterm_and_wait(STOP).code(), Some(0));
}

#[test]
fn a_snapshot_of_a_raw_disk_under_writes() {
    snapshot_under_writes("raw");
}

#[test]
fn a_snapshot_of_a_qcow2_disk_under_writes() {
    snapshot_under_writes("qcow2");
}

#[test]
fn a_snapshot_of_a_parallels_disk_under_writes() {
    snapshot_under_writes("parallels");
}

/// `snapshot --extended-l2`: the overlay has subclusters, and the guest's writes after the
/// switch land in them.
#[test]
fn a_snapshot_with_subclusters_under_writes() {
    snapshot_under_writes_with("raw", &["--extended-l2"]);
}

/// Persistent bitmaps go on recording in the overlay: a change after the snapshot is in
/// the bitmap the restarted daemon loads.
#[test]
fn persistent_bitmaps_move_into_the_overlay() {
    if skip_chain_test("snapshots") {
        return;
    }
    let dir = TestDir::new("snapshot-bitmaps");
    let img = make_disk(&dir, "qcow2", SIZE);
    let (backend, sock) = start_with_control(&dir, &img, 1, &[]);
    ctl_ok(&sock, "bitmap-add", &["b", "--persistent"]);
    let mut c = connect(&backend.socket, ClientOpts::default());
    assert_eq!(c.write_at(0, 0, &[1u8; 65536]), 0);
    let ov = dir.join("s1.qcow2").display().to_string();
    ctl_ok(&sock, "snapshot", &["--overlay", &ov]);
    assert_eq!(c.write_at(0, 8 * MIB, &[2u8; 65536]), 0);
    drop(c);
    assert_eq!(backend.sigterm_and_wait(STOP).code(), Some(0));
    let (_backend, sock) = start_with_control(&dir, &img, 1, &[]);
    let ranges = ctl_ok(&sock, "bitmap-ranges", &["b"]);
    let text = ranges.to_string();
    assert!(
        text.contains(&(8 * MIB).to_string()),
        "the write after the snapshot is missing from the bitmap: {text}"
    );
    assert!(
        text.contains("\"offset\":0") || text.contains("[0,"),
        "{text}"
    );
}

/// Refused, with the reason: an overlay that exists, a read-only disk, a running backup,
/// and at start a state file about another disk or one that is not vublk's.
#[test]
fn refusals_say_why() {
    if skip_chain_test("snapshots") {
        return;
    }
    let dir = TestDir::new("snapshot-refusals");
    let img = make_disk(&dir, "raw", SIZE);
    let (backend, sock) = start_with_control(&dir, &img, 1, &[]);
    let exists = dir.join("exists.qcow2");
    std::fs::write(&exists, b"keep me").unwrap();
    let (ok, _, err) = ctl(
        &sock,
        "snapshot",
        &["--overlay", &exists.display().to_string()],
    );
    assert!(!ok && err.contains("exists"), "{err}");
    assert_eq!(std::fs::read(&exists).unwrap(), b"keep me");
    let (ok, _, err) = ctl(
        &sock,
        "snapshot",
        &["--overlay", "/nonexistent-dir/x.qcow2"],
    );
    assert!(!ok && err.contains("directory"), "{err}");
    let nbd = dir.join("nbd.sock");
    backup_begin(
        &sock,
        &["--checkpoint", "c", "--socket", &nbd.display().to_string()],
    );
    let ov = dir.join("s.qcow2");
    let (ok, _, err) = ctl(&sock, "snapshot", &["--overlay", &ov.display().to_string()]);
    assert!(!ok && err.contains("backup"), "{err}");
    assert!(!ov.exists());
    ctl_ok(&sock, "backup-end", &["--checkpoint", "c"]);
    // 16 snapshots stack; the 17th would make a chain no open follows.
    for i in 1..=16 {
        let ov = dir.join(&format!("d{i}.qcow2")).display().to_string();
        ctl_ok(&sock, "snapshot", &["--overlay", &ov]);
    }
    let ov = dir.join("d17.qcow2").display().to_string();
    let (ok, _, err) = ctl(&sock, "snapshot", &["--overlay", &ov]);
    assert!(!ok && err.contains("deep"), "{err}");
    assert_eq!(backend.sigterm_and_wait(STOP).code(), Some(0));
    // The 16-deep chain opens again at a restart.
    let (backend, sock) = start_with_control(&dir, &img, 1, &[]);
    assert_eq!(
        ctl_ok(&sock, "status", &[])["chain"]
            .as_array()
            .unwrap()
            .len(),
        17
    );
    assert_eq!(backend.sigterm_and_wait(STOP).code(), Some(0));
    std::fs::remove_file(dir.join(".disk.raw.vublk-chain")).unwrap();
    // Read-only.
    let b = Backend::start(
        &dir,
        &img,
        &BackendOpts {
            read_only: true,
            extra_args: vec![
                "--control-socket".into(),
                dir.join("ro.sock").display().to_string(),
            ],
            ..BackendOpts::default()
        },
    );
    let ov = dir.join("ro.qcow2").display().to_string();
    let (ok, _, err) = ctl(&dir.join("ro.sock"), "snapshot", &["--overlay", &ov]);
    assert!(!ok && err.contains("read-only"), "{err}");
    assert_eq!(b.sigterm_and_wait(STOP).code(), Some(0));
    // A state file that is not vublk's, and one about another disk.
    let state = dir.join(".disk.raw.vublk-chain");
    std::fs::write(&state, b"garbage").unwrap();
    let (code, out) = vublk_refuses(&dir, &img, &[]);
    assert_eq!(code, Some(2), "{out}");
    assert!(out.contains("remove it"), "{out}");
    std::fs::write(
        &state,
        format!(
            r#"{{"image": "{}", "top": "{}", "format": "qcow2"}}"#,
            dir.join("other.raw").display(),
            dir.join("s.qcow2").display()
        ),
    )
    .unwrap();
    let (code, out) = vublk_refuses(&dir, &img, &[]);
    assert_eq!(code, Some(2), "{out}");
    assert!(out.contains("is about"), "{out}");
    // A state file naming an image whose chain does not hold --blk-file.
    let stray = dir.join("stray.qcow2");
    qemu_img_create(&stray, "qcow2", &SIZE.to_string());
    std::fs::write(
        &state,
        format!(
            r#"{{"image": "{}", "top": "{}", "format": "qcow2"}}"#,
            img.display(),
            stray.display()
        ),
    )
    .unwrap();
    let (code, out) = vublk_refuses(&dir, &img, &[]);
    assert_eq!(code, Some(2), "{out}");
    assert!(out.contains("does not hold"), "{out}");
}

/// SIGKILL at random moments around a snapshot (runs: `VUBLK_SNAPSHOT_KILLS`, 6 by default,
/// 20+ for a long run): a writer flushes after every write; after each kill the restarted
/// daemon serves a disk holding every flushed write, qemu-img check accepts every image of
/// the chain, and a snapshot can be taken again.
#[test]
fn sigkill_during_a_snapshot_loses_no_flushed_write() {
    if skip_chain_test("snapshots") {
        return;
    }
    let runs: u64 = std::env::var("VUBLK_SNAPSHOT_KILLS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(6);
    let dir = TestDir::new("snapshot-kill");
    let img = make_disk(&dir, "qcow2", SIZE);
    let mut model = read_disk_via_qemu(&img, &dir);
    let mut rng = Rng::new(0x5eed);
    let mut snapshots = 0;
    for run in 0..runs {
        let (backend, sock) = start_with_control(&dir, &img, 1, &[]);
        let mut c = connect(&backend.socket, ClientOpts::default());
        assert_same(
            &c.read_all(0),
            &model,
            &format!("run {run}: the disk at start"),
        );
        let writer = FlushingWriter::start(c, rng.next_u64(), SIZE);
        writer.wait_for(20);
        let ov = dir.join(&format!("k{run}.qcow2")).display().to_string();
        let sock2 = sock.clone();
        let snap = std::thread::spawn(move || ctl(&sock2, "snapshot", &["--overlay", &ov]).0);
        std::thread::sleep(Duration::from_micros(rng.below(40_000)));
        backend.signal(libc::SIGKILL);
        let _ = backend.wait_exit(STOP);
        let writes = writer.stop();
        if snap.join().unwrap() {
            snapshots += 1;
        }
        drop(backend);
        wait_unlocked(&img, STOP);
        let (backend, sock) = start_with_control(&dir, &img, 1, &[]);
        let serving = ctl_ok(&sock, "status", &[])["serving"]
            .as_str()
            .unwrap()
            .to_owned();
        let mut c = connect(&backend.socket, ClientOpts::default());
        let disk = c.read_all(0);
        writes.check(&disk, &format!("run {run} (serving {serving})"));
        drop(c);
        assert_eq!(backend.sigterm_and_wait(STOP).code(), Some(0));
        model = disk;
        // Every image of the chain passes qemu-img check.
        for (name, fmt) in chain(Path::new(&serving)) {
            assert_check_allows_leaks(&dir.join(&name), &fmt, &format!("run {run}: {name}"));
        }
        // A chain at most a few deep: the served disk flattened into a new base, the state
        // file removed (the operator's way back to serving --blk-file itself).
        if run % 4 == 3 {
            let flat = dir.join("flat.qcow2");
            qemu_img(&["convert", "-O", "qcow2"], &[Path::new(&serving), &flat]);
            std::fs::rename(&flat, &img).unwrap();
            let _ = std::fs::remove_file(dir.join(".disk.qcow2.vublk-chain"));
        }
    }
    // A snapshot after all the kills works.
    let (backend, sock) = start_with_control(&dir, &img, 1, &[]);
    let ov = dir.join("final.qcow2").display().to_string();
    ctl_ok(&sock, "snapshot", &["--overlay", &ov]);
    let mut c = connect(&backend.socket, ClientOpts::default());
    assert_same(&c.read_all(0), &model, "the disk after the last snapshot");
    drop(c);
    assert_eq!(backend.sigterm_and_wait(STOP).code(), Some(0));
    println!("{runs} kills, {snapshots} snapshots completed before their kill");
}

/// The disk `img` holds (its chain followed), read with qemu-img.
/// `stream` under a writer: after a snapshot, the overlay gets everything it read from its
/// backing file and loses the link; with `--base`, the link points at the base.
#[test]
fn stream_copies_the_chain_into_the_top_under_writes() {
    if skip_chain_test("stream jobs") {
        return;
    }
    for fmt in ["raw", "qcow2"] {
        let dir = TestDir::new(&format!("stream-{fmt}"));
        let img = make_disk(&dir, fmt, SIZE);
        let (backend, sock) = start_with_control(&dir, &img, 2, &[]);
        let writer = Writer::start(connect_queues(&backend.socket, 2), 9);
        writer.run_for(50);
        let s1 = dir.join("s1.qcow2");
        let s2 = dir.join("s2.qcow2");
        ctl_ok(&sock, "snapshot", &["--overlay", &s1.display().to_string()]);
        writer.run_for(50);
        ctl_ok(&sock, "snapshot", &["--overlay", &s2.display().to_string()]);
        writer.run_for(50);
        // First down to the base: s1's data moves into s2, which then backs onto the base.
        let base_name = format!("disk.{fmt}");
        let j = ctl_ok(
            &sock,
            "stream",
            &["--base", &base_name, "--id", "down-to-base"],
        );
        assert_eq!(j["type"], "stream", "{j}");
        let j = wait_job(&sock, "down-to-base");
        assert!(j["error"].is_null(), "{j}");
        assert_eq!(j["bytes_done"], j["bytes_total"], "{j}");
        let status = ctl_ok(&sock, "status", &[]);
        assert_eq!(status["chain"].as_array().unwrap().len(), 2, "{status}");
        writer.run_for(50);
        // Then all of it: s2 stands alone.
        ctl_ok(&sock, "stream", &["--id", "all"]);
        writer.run_for(50);
        let j = wait_job(&sock, "all");
        assert!(j["error"].is_null(), "{j}");
        writer.run_for(50);
        let mut c = writer.stop();
        assert_eq!(c.submit(0, Op::Flush), 0);
        let end = c.read_all(0);
        drop(c);
        assert_eq!(backend.sigterm_and_wait(STOP).code(), Some(0));
        assert_eq!(chain(&s2), [("s2.qcow2".to_owned(), "qcow2".to_owned())]);
        let r = dir.join("end.raw");
        std::fs::write(&r, &end).unwrap();
        assert_compare(&s2, &r, "the streamed image");
        assert_check_allows_leaks(&s2, "qcow2", "the streamed image");
        // A restart serves s2 (the chain state says it stands alone now).
        let (backend, sock) = start_with_control(&dir, &img, 1, &[]);
        let status = ctl_ok(&sock, "status", &[]);
        assert_eq!(status["serving"], s2.display().to_string(), "{status}");
        assert_eq!(status["chain"].as_array().unwrap().len(), 1, "{status}");
        let mut c = connect(&backend.socket, ClientOpts::default());
        assert_same(&c.read_all(0), &end, "the disk after the restart");
        drop(c);
        assert_eq!(backend.sigterm_and_wait(STOP).code(), Some(0));
    }
}

/// A job with a speed limit: `jobs` shows it running, `job-cancel` stops it (the chain as it
/// was), a second job and a snapshot are refused while it runs, and a new stream finishes.
#[test]
fn a_slow_stream_is_listed_refuses_company_and_can_be_cancelled_and_run_again() {
    if skip_chain_test("stream jobs") {
        return;
    }
    let dir = TestDir::new("stream-cancel");
    let img = make_disk(&dir, "raw", SIZE);
    let addr = format!("127.0.0.1:{}", free_port());
    let (backend, sock) = start_with_control(&dir, &img, 1, &["--metrics-addr", &addr]);
    let (ok, _, err) = ctl(&sock, "stream", &[]);
    assert!(!ok && err.contains("no backing file"), "{err}");
    let s1 = dir.join("s1.qcow2");
    ctl_ok(&sock, "snapshot", &["--overlay", &s1.display().to_string()]);
    let (ok, _, err) = ctl(&sock, "stream", &["--base", "nope.raw"]);
    assert!(!ok && err.contains("not in the backing chain"), "{err}");
    // 32 MiB at 4 MiB/s: about 8 s.
    ctl_ok(&sock, "stream", &["--speed", "4M", "--id", "slow"]);
    std::thread::sleep(Duration::from_millis(600));
    let v = ctl_ok(&sock, "jobs", &[]);
    let j = &v["jobs"][0];
    assert_eq!(j["state"], "running", "{v}");
    assert_eq!(j["speed"], 4 << 20, "{v}");
    let done = j["bytes_done"].as_u64().unwrap();
    assert!(done > 0 && done < SIZE, "{v}");
    // ctl top and the metrics show it.
    let top = Command::new(env!("CARGO_BIN_EXE_vublk"))
        .args(["ctl", "--control-socket"])
        .arg(&sock)
        .args(["top", "--once", "--interval", "0.2"])
        .output()
        .unwrap();
    let top = String::from_utf8_lossy(&top.stdout).into_owned();
    assert!(top.contains("job slow (stream): running"), "{top}");
    assert!(top.contains("at most 4.0 MiB/s"), "{top}");
    let metrics = http_get(&addr, "/metrics");
    assert!(metrics.contains("vublk_jobs_running 1"), "{metrics}");
    assert!(
        metrics.contains(r#"vublk_job_total_bytes{id="slow",type="stream"} 33554432"#),
        "{metrics}"
    );
    let (ok, _, err) = ctl(&sock, "stream", &[]);
    assert!(!ok && err.contains("one job at a time"), "{err}");
    let ov = dir.join("s2.qcow2").display().to_string();
    let (ok, _, err) = ctl(&sock, "snapshot", &["--overlay", &ov]);
    assert!(!ok && err.contains("job"), "{err}");
    let (ok, _, err) = ctl(&sock, "job-complete", &["slow"]);
    assert!(!ok && err.contains("ready"), "{err}");
    ctl_ok(&sock, "job-cancel", &["slow"]);
    let j = wait_job(&sock, "slow");
    assert!(j["error"].as_str().unwrap().contains("cancelled"), "{j}");
    assert_eq!(
        ctl_ok(&sock, "status", &[])["chain"]
            .as_array()
            .unwrap()
            .len(),
        2
    );
    // Started again, unlimited: it completes.
    ctl_ok(&sock, "stream", &["--id", "again"]);
    let j = wait_job(&sock, "again");
    assert!(j["error"].is_null(), "{j}");
    assert_eq!(
        ctl_ok(&sock, "status", &[])["chain"]
            .as_array()
            .unwrap()
            .len(),
        1
    );
    let mut c = connect(&backend.socket, ClientOpts::default());
    let disk = c.read_all(0);
    drop(c);
    assert_eq!(backend.sigterm_and_wait(STOP).code(), Some(0));
    let r = dir.join("disk-now.raw");
    std::fs::write(&r, &disk).unwrap();
    assert_compare(&img, &r, "the base, never written");
    assert_compare(&s1, &r, "the streamed overlay");
}

/// SIGKILL at random moments of a stream under a writer that flushes after every write
/// (`VUBLK_STREAM_KILLS`, 6 by default): no flushed write lost, the chain passes qemu-img
/// check, and a stream started again completes.
#[test]
fn sigkill_during_a_stream_loses_no_flushed_write() {
    if skip_chain_test("stream jobs") {
        return;
    }
    let runs: u64 = std::env::var("VUBLK_STREAM_KILLS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(6);
    let mut rng = Rng::new(0x57ea);
    for run in 0..runs {
        let dir = TestDir::new(&format!("stream-kill-{run}"));
        let img = make_disk(&dir, "raw", SIZE);
        let (backend, sock) = start_with_control(&dir, &img, 1, &[]);
        let s1 = dir.join("s1.qcow2");
        ctl_ok(&sock, "snapshot", &["--overlay", &s1.display().to_string()]);
        let writer = FlushingWriter::start(
            connect(&backend.socket, ClientOpts::default()),
            rng.next_u64(),
            SIZE,
        );
        // Slow enough to be killed in the middle, or (sometimes) at the very end.
        let speed = if run % 3 == 2 { "0" } else { "16M" };
        ctl_ok(&sock, "stream", &["--speed", speed]);
        std::thread::sleep(Duration::from_micros(rng.below(1_500_000)));
        backend.signal(libc::SIGKILL);
        let _ = backend.wait_exit(STOP);
        let writes = writer.stop();
        drop(backend);
        wait_unlocked(&s1, STOP);
        let (backend, _sock) = start_with_control(&dir, &img, 1, &[]);
        let mut c = connect(&backend.socket, ClientOpts::default());
        let disk = c.read_all(0);
        writes.check(&disk, &format!("run {run}, after the kill"));
        drop(c);
        assert_eq!(backend.sigterm_and_wait(STOP).code(), Some(0));
        for (name, fmt) in chain(&s1).into_iter().filter(|(_, f)| f != "raw") {
            assert_check_allows_leaks(&dir.join(&name), &fmt, &format!("run {run}: {name}"));
        }
        // Started again, it completes, and the disk is the same.
        let (backend, sock) = start_with_control(&dir, &img, 1, &[]);
        let mut c = connect(&backend.socket, ClientOpts::default());
        let chain_len = ctl_ok(&sock, "status", &[])["chain"]
            .as_array()
            .unwrap()
            .len();
        if chain_len > 1 {
            ctl_ok(&sock, "stream", &["--id", "again"]);
            let j = wait_job(&sock, "again");
            assert!(j["error"].is_null(), "run {run}: {j}");
        }
        assert_same(
            &c.read_all(0),
            &disk,
            &format!("run {run}: after the stream"),
        );
        drop(c);
        assert_eq!(backend.sigterm_and_wait(STOP).code(), Some(0));
        assert_eq!(chain(&s1).len(), 1);
        assert_check_allows_leaks(&s1, "qcow2", &format!("run {run}: s1 streamed"));
    }
}
