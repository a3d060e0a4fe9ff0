//! Preallocation beneath qcow2 (`--prealloc`): the file grows ahead of the writes while vublk
//! serves it, is trimmed to the end of its data on shutdown, survives fallocate being
//! unsupported or failing, and a SIGKILL with the tail present leaves a clean image.

mod common;

use std::path::Path;
use std::process::Command;

use common::*;

const MIB: u64 = 1 << 20;

fn create(img: &Path, size: &str) {
    let o = Command::new(env!("CARGO_BIN_EXE_vublk"))
        .args(["create", "--format", "qcow2", "--size", size])
        .arg(img)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

/// `qemu-img check --output=json`: (exit status, image end offset).
fn check(img: &Path) -> (i32, u64) {
    let o = Command::new("qemu-img")
        .args(["check", "-f", "qcow2", "--output=json"])
        .arg(img)
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    let end = out
        .split("\"image-end-offset\":")
        .nth(1)
        .and_then(|r| r.trim_start().split([',', '\n', '}']).next())
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no image-end-offset in {out}"));
    (o.status.code().unwrap_or(-1), end)
}

fn opts(extra: &[&str]) -> BackendOpts {
    BackendOpts {
        extra_args: extra.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    }
}

/// Write `n` MiB of a pattern at the start of the disk, flush, and return the data.
fn write_mib(c: &mut Client, n: u64, seed: u64) -> Vec<u8> {
    let data = pattern((n * MIB) as usize, 0, seed);
    for (i, chunk) in data.chunks(MIB as usize).enumerate() {
        assert_eq!(c.write_at(0, i as u64 * MIB, chunk), 0);
    }
    assert_eq!(c.submit(0, Op::Flush), 0);
    data
}

#[test]
fn tail_is_present_while_serving_and_trimmed_on_shutdown() {
    if skip_unless_vublk("preallocation is vublk's") || !have_qemu_img() {
        return;
    }
    let dir = TestDir::new("prealloc-tail");
    let img = dir.join("p.qcow2");
    create(&img, "64M");
    let backend = Backend::start(
        &dir,
        &img,
        &opts(&[
            "--prealloc",
            "on",
            "--prealloc-size",
            "8M",
            "--prealloc-align",
            "1M",
        ]),
    );
    let mut c = connect_queues(&backend.socket, 1);
    let data = write_mib(&mut c, 3, 11);
    let during = file_size(&img);
    let blocks = allocated_blocks(&img);
    eprintln!("during: {during} bytes, {} KiB allocated", blocks / 2);
    // The first step was taken at open: 8 MiB past the fresh image's end, rounded to 1 MiB.
    assert!(during >= 9 * MIB, "no preallocated tail: {during}");
    assert_eq!(during % MIB, 0, "length not rounded to --prealloc-align");
    assert!(
        blocks * 512 >= during - MIB,
        "the tail is not allocated (fallocate, not a sparse truncate): {blocks} blocks"
    );
    // More data in the first half of the preallocated area does not grow the file.
    let more = pattern(3 * MIB as usize, 3 * MIB, 12);
    assert_eq!(c.write_at(0, 3 * MIB, &more[..MIB as usize]), 0);
    assert_eq!(file_size(&img), during, "grew inside the preallocated area");
    // Data past its middle starts the next step ahead of the writes (in the background).
    assert_eq!(c.write_at(0, 4 * MIB, &more[MIB as usize..]), 0);
    let t0 = std::time::Instant::now();
    while file_size(&img) < during + 8 * MIB && t0.elapsed() < EXIT_DEADLINE {
        assert_eq!(c.submit(0, Op::Flush), 0);
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    assert!(
        file_size(&img) >= during + 8 * MIB,
        "no step ahead: {} bytes",
        file_size(&img)
    );
    assert_same(&c.read_at(0, 0, 3 * MIB as usize).unwrap(), &data, "data");
    drop(c);
    assert_eq!(backend.sigterm_and_wait(EXIT_DEADLINE).code(), Some(0));
    let after = file_size(&img);
    let (code, end) = check(&img);
    eprintln!("after shutdown: {after} bytes, image end offset {end}");
    assert_eq!(code, 0, "qemu-img check after a clean shutdown");
    assert_eq!(after, end, "not trimmed to the end of the data");
    let log = std::fs::read_to_string(&backend.log).unwrap();
    assert!(log.contains("preallocation: on (--prealloc on)"), "{log}");
}

#[test]
fn off_means_no_tail_and_auto_says_why() {
    if skip_unless_vublk("preallocation is vublk's") || !have_qemu_img() {
        return;
    }
    let dir = TestDir::new("prealloc-off");
    for (mode, expect) in [
        ("off", "preallocation: off (--prealloc off)"),
        ("auto", "(auto: "),
    ] {
        let img = dir.join(&format!("{mode}.qcow2"));
        create(&img, "64M");
        let backend = Backend::start(&dir, &img, &opts(&["--prealloc", mode]));
        let mut c = connect_queues(&backend.socket, 1);
        write_mib(&mut c, 2, 13);
        // Space allocated to the file (its length may run ahead as holes: the clusters whose
        // refcounts are reserved ahead).
        let during = {
            use std::os::unix::fs::MetadataExt;
            std::fs::metadata(&img).unwrap().blocks() * 512
        };
        drop(c);
        assert_eq!(backend.sigterm_and_wait(EXIT_DEADLINE).code(), Some(0));
        let log = std::fs::read_to_string(&backend.log).unwrap();
        assert!(log.contains(expect), "{mode}: {log}");
        if mode == "off" {
            assert!(during <= 3 * MIB, "off: {during} bytes allocated ahead");
        }
        assert_eq!(check(&img).0, 0);
    }
}

/// fallocate unsupported (simulated with seccomp): logged once, never retried, writes work.
/// ENOSPC (simulated): skipped each time, writes work.
#[test]
fn fallocate_unsupported_or_failing_never_fails_writes() {
    if skip_unless_vublk("preallocation is vublk's") || !have_qemu_img() {
        return;
    }
    let dir = TestDir::new("prealloc-fail");
    for (name, errno) in [("unsupported", libc::EOPNOTSUPP), ("enospc", libc::ENOSPC)] {
        let img = dir.join(&format!("{name}.qcow2"));
        create(&img, "64M");
        let mut o = opts(&["--prealloc", "on", "--prealloc-size", "1M"]);
        o.fail_fallocate = Some(errno);
        let backend = Backend::start(&dir, &img, &o);
        let mut c = connect_queues(&backend.socket, 1);
        let data = write_mib(&mut c, 4, 14);
        assert_same(&c.read_at(0, 0, data.len()).unwrap(), &data, name);
        let during = file_size(&img);
        drop(c);
        assert_eq!(backend.sigterm_and_wait(EXIT_DEADLINE).code(), Some(0));
        let log = std::fs::read_to_string(&backend.log).unwrap();
        // 4 MiB of data and metadata, sized in 1 MiB steps: at most 5 MiB without a tail.
        assert!(
            during <= 5 * MIB,
            "{name}: a tail exists although fallocate failed ({during})"
        );
        let warnings = log.matches("fallocate is not supported").count();
        let skipped: u64 = log
            .split("preallocation: 0 done, ")
            .nth(1)
            .and_then(|r| r.split(' ').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("{name}: no preallocation counters:\n{log}"));
        eprintln!("{name}: {warnings} warnings, {skipped} skipped");
        if errno == libc::EOPNOTSUPP {
            assert_eq!(warnings, 1, "unsupported: warned {warnings} times:\n{log}");
            assert_eq!(skipped, 1, "unsupported: tried again");
        } else {
            assert_eq!(warnings, 0, "{log}");
            assert!(skipped > 1, "ENOSPC: not tried again ({skipped})");
        }
        assert_eq!(check(&img).0, 0, "{name}");
    }
}

/// SIGKILL while the tail is there: qemu-img check finds no corruption, flushed data is
/// intact, and the next read-write open drops the tail.
#[test]
fn sigkill_with_a_tail_leaves_a_clean_image() {
    if skip_unless_vublk("preallocation is vublk's") || !have_qemu_img() {
        return;
    }
    let dir = TestDir::new("prealloc-kill");
    let img = dir.join("k.qcow2");
    create(&img, "64M");
    let o = opts(&["--prealloc", "on", "--prealloc-size", "16M"]);
    let backend = Backend::start(&dir, &img, &o);
    let mut c = connect_queues(&backend.socket, 1);
    let data = write_mib(&mut c, 2, 15);
    let during = file_size(&img);
    // The first step is taken at open: 16 MiB past the end of the fresh image.
    assert!(during >= 16 * MIB, "no tail: {during}");
    backend.signal(libc::SIGKILL);
    let _ = backend.wait_exit(EXIT_DEADLINE);
    drop(c);
    assert_eq!(
        file_size(&img),
        during,
        "the tail is still there after SIGKILL"
    );
    let (code, end) = check(&img);
    assert!(
        code == 0 || code == 3,
        "qemu-img check after SIGKILL: exit {code}"
    );
    let backend = Backend::start(&dir, &img, &o);
    let mut c = connect_queues(&backend.socket, 1);
    assert_same(&c.read_at(0, 0, data.len()).unwrap(), &data, "flushed data");
    drop(c);
    assert_eq!(backend.sigterm_and_wait(EXIT_DEADLINE).code(), Some(0));
    let (code, end2) = check(&img);
    assert_eq!(code, 0);
    assert!(end2 <= end, "image end grew from {end} to {end2}");
    assert_eq!(file_size(&img), end2, "the tail was not dropped");
}

#[test]
fn bad_prealloc_options_exit_2() {
    for args in [
        ["--prealloc-align", "1000"],
        ["--prealloc-align", "0"],
        ["--prealloc-size", "lots"],
        ["--prealloc", "sometimes"],
    ] {
        let o = Command::new(env!("CARGO_BIN_EXE_vublk"))
            .args([
                "--socket-path",
                "/nonexistent/x.sock",
                "--blk-file",
                "/nonexistent/f",
            ])
            .args(args)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(args[0]), "{args:?}: {err}");
        assert_eq!(err.trim_end().lines().count(), 1, "{args:?}: {err}");
    }
}
