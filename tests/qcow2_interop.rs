//! qcow2 interop: images made and written by qemu-img / qemu-io (allocated, compressed with
//! zlib and zstd, zero clusters, partial clusters, v2 and v3) read through vublk with libblkio
//! must equal what `qemu-img convert -O raw` makes of them.

mod common;

use std::path::Path;
use std::process::Command;

use common::*;

/// The address-space limit `vublk create` runs under in the no-big-table tests: the
/// binary and its shared libraries (librbd and Ceph's with the `rbd` feature) fit, a table
/// the size of a large image does not.
const AS_LIMIT: u64 = 256 * MIB;

fn have_qemu_tools() -> bool {
    let ok = |p: &str| {
        Command::new(p)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
    };
    if ok("qemu-img") && ok("qemu-io") {
        return true;
    }
    skip_or_fail::<()>("qemu-img/qemu-io not installed");
    false
}

fn run(cmd: &mut Command) {
    run_ok(cmd);
}

/// Why most tests here skip under qemu-storage-daemon.
const QCOW2_BY_VUBLK: &str = "qcow2 is served by vublk";
/// Why the `vublk create` tests skip under qemu-storage-daemon.
const CREATE_BY_VUBLK: &str = "vublk create is vublk's";

/// The set-up of a test that needs vublk (skipped under qemu-storage-daemon, `why`) and
/// qemu-img/qemu-io: `None` if it is skipped, else a fresh test directory `name`.
fn setup(why: &str, name: &str) -> Option<TestDir> {
    if skip_unless_vublk(why) || !have_qemu_tools() {
        return None;
    }
    Some(TestDir::new(name))
}

/// vublk serving `img` read-write (one queue, default options but for the vublk arguments
/// `extra`) to a connected libblkio client with one queue.
fn serve(dir: &TestDir, img: &Path, extra: &[&str]) -> (Backend, Client) {
    let opts = BackendOpts {
        extra_args: extra.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    };
    start_and_connect(dir, img, &opts, ClientOpts::default())
}

/// `vublk create --format qcow2 ARGS` run in the test directory (names in ARGS are relative
/// to it), which must succeed.
fn vublk_create_qcow2(dir: &TestDir, args: &[&str]) {
    run(Command::new(env!("CARGO_BIN_EXE_vublk"))
        .current_dir(dir.join(""))
        .args(["create", "--format", "qcow2"])
        .args(args));
}

/// `qemu-img check -q`: the image is clean (no leaks, no corruption).
fn check_clean(img: &Path) {
    run(Command::new("qemu-img").args(["check", "-q"]).arg(img));
}

/// `qemu-img convert -O raw`, the format probed.
fn to_raw(img: &Path, raw: &Path) {
    run(Command::new("qemu-img")
        .args(["convert", "-O", "raw"])
        .arg(img)
        .arg(raw));
}

/// `qemu-img compare`: the qcow2 image holds exactly `model` (written to `dir/name` first).
fn compare_with_model(dir: &TestDir, name: &str, model: &[u8], img: &Path) {
    let raw = dir.join(name);
    std::fs::write(&raw, model).unwrap();
    qemu_compare(&raw, img);
}

/// Patterns: plain data, compressed clusters, zero clusters, partial clusters, data across
/// cluster boundaries, and untouched (unallocated) space.
/// Compressed writes must cover whole clusters of `cluster` bytes.
fn qemu_io_writes(cluster: u64) -> Vec<String> {
    let c = cluster.max(64 << 10);
    vec![
        "write -P 0xaa 0 1M".into(),
        format!("write -c -P 0xbb {} {}", 24 * MIB, c),
        format!("write -c -P 0x11 {} {}", 26 * MIB, 2 * c),
        "write -z 3M 128k".into(),
        "write -P 0xcc 3M 4k".into(),
        "write -P 0xdd 5M 4k".into(),
        "write -P 0xee 10485248 7168".into(),
        "write -P 0x77 16M 3M".into(),
    ]
}

fn make_image(
    dir: &TestDir,
    name: &str,
    create_opts: &str,
    cluster: u64,
) -> (std::path::PathBuf, Vec<u8>) {
    let img = dir.join(&format!("{name}.qcow2"));
    run(Command::new("qemu-img")
        .args(["create", "-q", "-f", "qcow2", "-o", create_opts])
        .arg(&img)
        .arg("32M"));
    let mut io = Command::new("qemu-io");
    io.args(["-f", "qcow2"]);
    for w in qemu_io_writes(cluster) {
        io.args(["-c", &w]);
    }
    run(io.arg(&img));
    let raw = dir.join(&format!("{name}.raw"));
    convert_to_raw(&img, "qcow2", &raw);
    let expected = read_file(&raw);
    (img, expected)
}

fn check_through_vublk(dir: &TestDir, img: &Path, expected: &[u8], extra: &[&str]) {
    let opts = BackendOpts {
        read_only: true,
        extra_args: extra.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    };
    let client = ClientOpts {
        read_only: true,
        ..Default::default()
    };
    let (backend, mut c) = start_and_connect(dir, img, &opts, client);
    assert_eq!(
        c.capacity(),
        expected.len() as u64,
        "capacity is the virtual size"
    );
    // Whole disk in 1 MiB reads (many extents each), then reads that start and end inside
    // clusters of every kind.
    assert_same(&c.read_all(0), expected, "whole disk");
    for (off, len) in [
        (0u64, 4096usize),
        (2 * MIB - 4096, 12288),
        (24 * MIB + 65536 - 4096, 8192),
        (26 * MIB - 512, 4096),
        (3 * MIB - 512, 8192),
        (10485248 - 512, 9216),
        (8 * MIB + 65536 - 512, 1024),
        (5 * MIB, 512),
        (20 * MIB, 65536),
    ] {
        if off as usize + len > expected.len() {
            continue;
        }
        let got = c
            .read_at(0, off, len)
            .unwrap_or_else(|e| panic!("read {len} at {off}: {e}"));
        assert_same(
            &got,
            &expected[off as usize..off as usize + len],
            &format!("read {len} at {off}"),
        );
    }
    disconnect_and_stop(&backend, c);
    assert!(
        backend.log_contents().contains("qcow2 v"),
        "not served as qcow2"
    );
}

#[test]
fn qemu_written_images_read_back_identically() {
    let Some(dir) = setup(QCOW2_BY_VUBLK, "qcow2-interop") else {
        return;
    };
    for (name, opts, cluster) in [
        ("v3-zlib", "compat=1.1,compression_type=zlib", 64 << 10),
        ("v3-zstd", "compat=1.1,compression_type=zstd", 64 << 10),
        ("v2", "compat=0.10", 64 << 10),
        ("v3-4k-clusters", "compat=1.1,cluster_size=4096", 4096),
        ("v3-2m-clusters", "compat=1.1,cluster_size=2M", 2 << 20),
    ] {
        let (img, expected) = make_image(&dir, name, opts, cluster);
        // Probed by magic, and named explicitly.
        check_through_vublk(&dir, &img, &expected, &[]);
        check_through_vublk(
            &dir,
            &img,
            &expected,
            &["--format", "qcow2", "--aio", "threads"],
        );
    }
}

/// Start vublk expecting a refusal: exit status 1 with a message (never a served socket).
fn start_error(img: &Path, extra: &[&str]) -> String {
    let dir = img.parent().unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_vublk"))
        .arg("--socket-path")
        .arg(dir.join("refused.sock"))
        .arg("--blk-file")
        .arg(img)
        .args(extra)
        .stdin(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "vublk started serving {} instead of refusing it",
                img.display()
            );
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    };
    let mut err = String::new();
    use std::io::Read;
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    assert_eq!(status.code(), Some(1), "{err}");
    err
}

#[test]
fn unsupported_qcow2_features_are_refused_with_a_message() {
    let Some(dir) = setup(QCOW2_BY_VUBLK, "qcow2-refused") else {
        return;
    };
    let base = dir.join("base.qcow2");
    qemu_img_create(&base, "qcow2", "8M");

    let top = dir.join("top.qcow2");
    run(Command::new("qemu-img")
        .args(["create", "-q", "-f", "qcow2", "-F", "qcow2", "-b"])
        .arg(&base)
        .arg(&top));
    let err = start_error(&top, &["--read-only", "--backing", "none"]);
    assert!(err.contains("backing file"), "--backing none: {err}");

    // A header with an impossible cluster size.
    let bad = dir.join("bad.qcow2");
    let mut bytes = std::fs::read(&base).unwrap();
    bytes[20..24].copy_from_slice(&30u32.to_be_bytes());
    std::fs::write(&bad, &bytes).unwrap();
    let err = start_error(&bad, &["--read-only", "--format", "qcow2"]);
    assert!(err.contains("cluster size"), "bad cluster bits: {err}");
    let msgs: Vec<&str> = err.lines().filter(|l| l.starts_with("vublk:")).collect();
    assert_eq!(msgs.len(), 1, "one error line: {err}");
}

fn qemu_io(img: &Path, fmt: &str, cmds: &[&str]) {
    let mut io = Command::new("qemu-io");
    io.args(["-f", fmt]);
    for c in cmds {
        io.args(["-c", c]);
    }
    run(io.arg(img));
}

/// Backing chains as qemu-img makes them: qcow2 over qcow2 over raw, a backing file smaller
/// than the image, relative names; reads fall through to the right layer.
#[test]
fn backing_chains_read_back_identically() {
    let Some(dir) = setup(QCOW2_BY_VUBLK, "qcow2-chain") else {
        return;
    };
    // base.raw (16 MiB) <- mid.qcow2 (24 MiB) <- top.qcow2 (32 MiB)
    let base = dir.join("base.raw");
    create_pattern_image(&base, 16 * MIB, 5);
    let mid = dir.join("mid.qcow2");
    run(Command::new("qemu-img").current_dir(dir.join("")).args([
        "create",
        "-q",
        "-f",
        "qcow2",
        "-F",
        "raw",
        "-b",
        "base.raw",
        "mid.qcow2",
        "24M",
    ]));
    qemu_io(
        &mid,
        "qcow2",
        &[
            "write -P 0x21 1M 64k",
            "write -z 2M 64k",
            "write -c -P 0x22 20M 64k",
        ],
    );
    let top = dir.join("top.qcow2");
    run(Command::new("qemu-img").current_dir(dir.join("")).args([
        "create",
        "-q",
        "-f",
        "qcow2",
        "-F",
        "qcow2",
        "-b",
        "mid.qcow2",
        "top.qcow2",
        "32M",
    ]));
    qemu_io(
        &top,
        "qcow2",
        &[
            "write -P 0x31 1M 4k",
            "write -P 0x32 3M 128k",
            "write -P 0x33 30M 4k",
        ],
    );
    let raw = dir.join("expected.raw");
    convert_to_raw(&top, "qcow2", &raw);
    let expected = read_file(&raw);
    check_through_vublk(&dir, &top, &expected, &[]);
    check_through_vublk(
        &dir,
        &top,
        &expected,
        &["--aio", "threads", "--cache", "writeback"],
    );
}

/// `vublk create` makes images qemu-img accepts (check clean, info as asked), that qemu-io can
/// write and vublk then serves identically.
#[test]
fn vublk_create_makes_images_qemu_accepts() {
    let Some(dir) = setup(CREATE_BY_VUBLK, "qcow2-create") else {
        return;
    };
    let create = |args: &[&str]| {
        let o = Command::new(env!("CARGO_BIN_EXE_vublk"))
            .arg("create")
            .args(args)
            .current_dir(dir.join(""))
            .output()
            .unwrap();
        assert!(
            o.status.success(),
            "vublk create {args:?}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    };
    create(&["--format", "qcow2", "--size", "32M", "a.qcow2"]);
    create(&[
        "--format",
        "qcow2",
        "--size",
        "32M",
        "--compression-type",
        "zstd",
        "--cluster-size",
        "4K",
        "b.qcow2",
    ]);
    create(&["--format", "qcow2", "--backing", "a.qcow2", "c.qcow2"]);
    create(&["--format", "raw", "--size", "32M", "d.raw"]);
    for (img, fmt, cluster) in [
        ("a.qcow2", "qcow2", 65536u64),
        ("b.qcow2", "qcow2", 4096),
        ("d.raw", "raw", 65536),
    ] {
        let p = dir.join(img);
        if fmt == "qcow2" {
            check_clean(&p);
        }
        let mut io = Command::new("qemu-io");
        io.args(["-f", fmt]);
        for w in qemu_io_writes(cluster) {
            if fmt == "raw" && w.contains(" -c ") {
                continue;
            }
            io.args(["-c", &w]);
        }
        run(io.arg(&p));
    }
    let info = Command::new("qemu-img")
        .args(["info"])
        .arg(dir.join("c.qcow2"))
        .output()
        .unwrap();
    let info = String::from_utf8_lossy(&info.stdout);
    assert!(
        info.contains("backing file: a.qcow2") && info.contains("32 MiB"),
        "{info}"
    );
    for img in ["a.qcow2", "b.qcow2", "c.qcow2"] {
        let p = dir.join(img);
        check_clean(&p);
        let raw = dir.join(&format!("{img}.raw"));
        to_raw(&p, &raw);
        check_through_vublk(&dir, &p, &read_file(&raw), &[]);
    }
}

/// Random writes, reads and write-zeroes against a model on qcow2 images (fresh, small and
/// big clusters, over a backing file), then `qemu-img check` clean and `qemu-img compare`
/// identical to the model.
#[test]
fn random_writes_to_qcow2_match_model_and_check_clean() {
    let Some(dir) = setup(QCOW2_BY_VUBLK, "qcow2-writes") else {
        return;
    };
    const SIZE: u64 = 24 * MIB;
    let base = dir.join("base.raw");
    create_pattern_image(&base, SIZE, 77);
    for (name, create_args, with_base) in [
        ("c64k", vec!["--cluster-size", "64K"], false),
        ("c512", vec!["--cluster-size", "512"], false),
        ("c2m", vec!["--cluster-size", "2M"], false),
        ("backed", vec!["--backing", "base.raw"], true),
        // Subclusters: single ones written through the ring or the pool, partial ones
        // merged, zeroes, all over the backing file.
        (
            "extl2-backed",
            vec!["--extended-l2", "--backing", "base.raw"],
            true,
        ),
    ] {
        let file = format!("{name}.qcow2");
        let img = dir.join(&file);
        let mut args = if with_base {
            vec![]
        } else {
            vec!["--size", "24M"]
        };
        args.extend(&create_args);
        args.push(&file);
        vublk_create_qcow2(&dir, &args);
        let mut model = if with_base {
            read_file(&base)
        } else {
            vec![0u8; SIZE as usize]
        };
        let (backend, mut c) = serve(&dir, &img, &[]);
        let mut rng = Rng::new(0x9c0c_0002 ^ name.len() as u64);
        for i in 0..200 {
            let (len, off) = if rng.below(4) == 0 {
                // Whole 64 KiB clusters (over the backing file: installed on completion).
                let len = rng.range(1, 5) * 65536;
                (len as usize, rng.below((SIZE - len) / 65536 + 1) * 65536)
            } else {
                let len = (rng.range(1, 512) * 512) as usize;
                (len, rng.below((SIZE - len as u64) / 512 + 1) * 512)
            };
            model_request(
                &mut c,
                &mut model,
                &mut rng,
                off,
                len,
                &format!("{name} op {i}"),
            );
        }
        assert_eq!(c.submit(0, Op::Flush), 0);
        assert_same(&c.read_all(0), &model, &format!("{name}: whole disk"));
        disconnect_and_stop(&backend, c);
        check_clean(&img);
        compare_with_model(&dir, &format!("{name}.expected"), &model, &img);
        // And vublk reads back what it wrote after a restart.
        check_through_vublk(&dir, &img, &model, &[]);
    }
}

/// The model check with two queues writing at once: each queue owns alternate 4 KiB
/// stripes, so both allocate, copy-on-write and zero inside the same clusters concurrently
/// (fresh images with 64 KiB, 512 B and 2 MiB clusters, over a backing file, and with the
/// smallest L2 cache so dirty tables are written back under pressure).
#[test]
fn two_queue_random_writes_to_qcow2_match_model_and_check_clean() {
    let Some(dir) = setup(QCOW2_BY_VUBLK, "qcow2-2q-model") else {
        return;
    };
    const SIZE: u64 = 8 * MIB;
    const STRIPE: u64 = 4096;
    let base = dir.join("base.raw");
    create_pattern_image(&base, SIZE, 91);
    for (name, create_args, with_base, extra) in [
        ("c64k", vec!["--cluster-size", "64K"], false, vec![]),
        ("c512", vec!["--cluster-size", "512"], false, vec![]),
        ("c2m", vec!["--cluster-size", "2M"], false, vec![]),
        ("backed", vec!["--backing", "base.raw"], true, vec![]),
        (
            "tiny-cache",
            vec!["--cluster-size", "4K"],
            false,
            vec!["--l2-cache-size", "16K"],
        ),
        // Subclusters (512 B at 16 KiB clusters, 2 KiB at 64 KiB): both queues write
        // subclusters of the same clusters at once, over the backing file.
        (
            "extl2-16k",
            vec![
                "--extended-l2",
                "--cluster-size",
                "16K",
                "--backing",
                "base.raw",
            ],
            true,
            vec!["--l2-cache-size", "64K"],
        ),
        (
            "extl2-64k",
            vec!["--extended-l2", "--backing", "base.raw"],
            true,
            vec![],
        ),
    ] {
        let file = format!("{name}.qcow2");
        let img = dir.join(&file);
        let mut args = if with_base {
            vec![]
        } else {
            vec!["--size", "8M"]
        };
        args.extend(&create_args);
        args.push(&file);
        vublk_create_qcow2(&dir, &args);
        let initial = if with_base {
            read_file(&base)
        } else {
            vec![0u8; SIZE as usize]
        };
        let opts = BackendOpts {
            num_queues: Some(2),
            extra_args: extra.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        };
        let client = ClientOpts {
            num_queues: 2,
            mem_size: 4 * MIB as usize,
            ..Default::default()
        };
        let (backend, mut c) = start_and_connect(&dir, &img, &opts, client);
        let (queues, mem) = c.take_queues();
        let handles: Vec<_> = queues
            .into_iter()
            .enumerate()
            .map(|(q, mut queue)| {
                let mut model = initial.clone();
                std::thread::spawn(move || {
                    let mut rng =
                        Rng::new(0x2a0_u64.wrapping_add(q as u64 * 31 + name.len() as u64));
                    let region = q * 2 * MIB as usize;
                    for batch in 0..24 {
                        let mut ops = Vec::new();
                        let mut used = Vec::new();
                        for i in 0..16usize {
                            // A random part of one of this queue's stripes; requests of one
                            // batch run concurrently, so they never overlap.
                            let stripe = loop {
                                let s = rng.below(SIZE / STRIPE / 2) * 2 + q as u64;
                                if !used.contains(&s) {
                                    used.push(s);
                                    break s;
                                }
                            };
                            let first = rng.below(STRIPE / 512);
                            let n = rng.range(1, STRIPE / 512 - first);
                            let off = stripe * STRIPE + first * 512;
                            let len = (n * 512) as usize;
                            if rng.below(5) == 0 {
                                ops.push(Op::WriteZeroes {
                                    offset: off,
                                    len: len as u64,
                                    flags: blkio::ReqFlags::empty(),
                                });
                                model[off as usize..off as usize + len].fill(0);
                            } else {
                                let buf = region + i * STRIPE as usize;
                                // SAFETY: each queue uses its own half of the region; a batch
                                // completes before its buffers are reused.
                                let dst = unsafe { mem.slice_mut(buf, len) };
                                rng.fill(dst);
                                model[off as usize..off as usize + len].copy_from_slice(dst);
                                ops.push(Op::Write {
                                    offset: off,
                                    buf,
                                    len,
                                });
                            }
                        }
                        let r = run_batch(&mut queue, mem, &ops);
                        assert!(
                            r.iter().all(|&r| r == 0),
                            "{name} queue {q} batch {batch}: {r:?}"
                        );
                    }
                    (queue, model)
                })
            })
            .collect();
        let mut expected = initial.clone();
        c.queues = Vec::new();
        for (q, h) in handles.into_iter().enumerate() {
            let (queue, model) = h.join().unwrap();
            c.queues.push(queue);
            for stripe in (q as u64..SIZE / STRIPE).step_by(2) {
                let r = (stripe * STRIPE) as usize..((stripe + 1) * STRIPE) as usize;
                expected[r.clone()].copy_from_slice(&model[r]);
            }
        }
        assert_eq!(c.submit(0, Op::Flush), 0);
        assert_same(&c.read_all(0), &expected, &format!("{name}: whole disk"));
        disconnect_and_stop(&backend, c);
        if name == "tiny-cache" {
            let log = std::fs::read_to_string(&backend.log).unwrap();
            assert!(
                log.contains("L2 cache 16 KiB"),
                "--l2-cache-size not applied:\n{log}"
            );
        }
        check_clean(&img);
        compare_with_model(&dir, &format!("{name}.expected"), &expected, &img);
    }
}

/// Crash consistency: SIGKILL vublk at random points of a qcow2 write workload, many times.
/// After each kill `qemu-img check` finds no corruption (leaked clusters are acceptable) and
/// everything acknowledged by a FLUSH reads back intact.
#[test]
fn sigkill_during_qcow2_writes_leaves_a_consistent_image() {
    let Some(dir) = setup(QCOW2_BY_VUBLK, "qcow2-crash") else {
        return;
    };
    const SIZE: u64 = 16 * MIB;
    let img = dir.join("crash.qcow2");
    vublk_create_qcow2(
        &dir,
        &["--size", "16M", "--cluster-size", "4K", "crash.qcow2"],
    );
    // What has been flushed: the model the image must contain, at least.
    let mut flushed = vec![0u8; SIZE as usize];
    let mut rng = Rng::new(0xc4a5_0001);
    for round in 0..12 {
        let (backend, mut c) = serve(&dir, &img, &[]);
        assert_same(
            &c.read_all(0),
            &flushed,
            &format!("round {round}: flushed data after restart"),
        );
        let mut pending = flushed.clone();
        let kill_after = rng.range(5, 60);
        let mut killed = false;
        let mut in_flight = 0..0usize;
        for i in 0..80u64 {
            let len = (rng.range(1, 64) * 512) as usize;
            let off = rng.below((SIZE - len as u64) / 512 + 1) * 512;
            let mut data = vec![0u8; len];
            rng.fill(&mut data);
            if i == kill_after {
                // Kill with a write in flight: submit without waiting, then SIGKILL.
                c.mem_mut()[..len].copy_from_slice(&data);
                in_flight = off as usize..off as usize + len;
                c.queues[0].write(
                    off,
                    c.mem.addr as *const u8,
                    len,
                    0,
                    blkio::ReqFlags::empty(),
                );
                let mut none: [std::mem::MaybeUninit<blkio::Completion>; 1] =
                    [std::mem::MaybeUninit::uninit()];
                let _ = c.queues[0].do_io(&mut none, 0, None, None);
                backend.signal(libc::SIGKILL);
                killed = true;
                break;
            }
            assert_eq!(c.write_at(0, off, &data), 0, "round {round} op {i}");
            pending[off as usize..off as usize + len].copy_from_slice(&data);
            if i % 7 == 6 {
                assert_eq!(c.submit(0, Op::Flush), 0);
                flushed.clone_from(&pending);
            }
        }
        drop(c);
        assert!(killed);
        let _ = backend.wait_exit(EXIT_DEADLINE);
        let o = Command::new("qemu-img")
            .args(["check", "-f", "qcow2"])
            .arg(&img)
            .output()
            .unwrap();
        let code = o.status.code();
        assert!(
            code == Some(0) || code == Some(3),
            "round {round}: qemu-img check found corruption ({code:?}):\n{}",
            String::from_utf8_lossy(&o.stdout)
        );
        // Writes acknowledged after the last flush may or may not have landed: take what the
        // image holds for those ranges as the new baseline, but flushed data must be there.
        let raw = dir.join("crash.raw");
        let _ = std::fs::remove_file(&raw);
        convert_to_raw(&img, "qcow2", &raw);
        let now = read_file(&raw);
        for (i, (&a, &b)) in now.iter().zip(flushed.iter()).enumerate() {
            // Bytes written after the last flush, or by the write in flight at the kill, may
            // hold either content; everything else must be as flushed.
            if a != b && pending[i] == b && !in_flight.contains(&i) {
                panic!("round {round}: flushed byte {i} lost");
            }
        }
        flushed = now;
    }
}

/// Two queues writing interleaved 4 KiB blocks of the same fresh 64 KiB clusters at the same
/// time: every cluster is allocated once (qemu-img check: no leaks, no corruption) and no
/// write is lost.
#[test]
fn two_queues_allocating_the_same_clusters() {
    let Some(dir) = setup(QCOW2_BY_VUBLK, "qcow2-2q") else {
        return;
    };
    const SIZE: u64 = 8 * MIB;
    let img = dir.join("two.qcow2");
    vublk_create_qcow2(&dir, &["--size", "8M", "two.qcow2"]);
    let opts = BackendOpts {
        num_queues: Some(2),
        ..Default::default()
    };
    let client = ClientOpts {
        num_queues: 2,
        mem_size: 4 * MIB as usize,
        ..Default::default()
    };
    let (backend, mut c) = start_and_connect(&dir, &img, &opts, client);
    let (queues, mem) = c.take_queues();
    let barrier = std::sync::Arc::new(std::sync::Barrier::new(2));
    let handles: Vec<_> = queues
        .into_iter()
        .enumerate()
        .map(|(q, mut queue)| {
            let barrier = barrier.clone();
            std::thread::spawn(move || {
                let base = q * 2 * MIB as usize;
                let mut ops = Vec::new();
                for (i, blk) in (q as u64..SIZE / 4096).step_by(2).enumerate() {
                    let buf = base + (i % 256) * 4096;
                    // SAFETY: each queue uses its own half of the region; buffers are reused
                    // only after the batch below completed.
                    unsafe { mem.slice_mut(buf, 4096) }.fill((blk % 251) as u8 + 1);
                    ops.push(Op::Write {
                        offset: blk * 4096,
                        buf,
                        len: 4096,
                    });
                    if ops.len() == 256 {
                        barrier.wait();
                        assert!(run_batch(&mut queue, mem, &ops).iter().all(|&r| r == 0));
                        ops.clear();
                    }
                }
                queue
            })
        })
        .collect();
    c.queues = handles.into_iter().map(|h| h.join().unwrap()).collect();
    let mut expected = vec![0u8; SIZE as usize];
    for blk in 0..SIZE / 4096 {
        expected[(blk * 4096) as usize..((blk + 1) * 4096) as usize].fill((blk % 251) as u8 + 1);
    }
    assert_same(&c.read_all(0), &expected, "every block of both queues");
    disconnect_and_stop(&backend, c);
    check_clean(&img);
    compare_with_model(&dir, "two.expected", &expected, &img);
}

/// One queue, many requests in flight: a write spanning an allocated and a fresh cluster
/// goes through the format (on the pool), while a later small write into the fresh cluster
/// goes through the ring. Both must land whatever the order; a fill of the fresh cluster
/// (written whole, zeroes around its data) must never run over the pool's bytes.
#[test]
fn writes_through_the_pool_and_the_ring_into_one_cluster() {
    let Some(dir) = setup(QCOW2_BY_VUBLK, "qcow2-pool-ring") else {
        return;
    };
    const C: u64 = 65536;
    const PAIRS: u64 = 60;
    let img = dir.join("pr.qcow2");
    vublk_create_qcow2(&dir, &["--size", "16M", "pr.qcow2"]);
    let client = ClientOpts {
        mem_size: 16 * MIB as usize,
        ..Default::default()
    };
    let (backend, mut c) = start_and_connect(&dir, &img, &BackendOpts::default(), client);
    let mut expected = vec![0u8; 16 * MIB as usize];
    // Allocate every even cluster first.
    for p in 0..PAIRS {
        let data = pattern(C as usize, p * 2 * C, 41);
        assert_eq!(c.write_at(0, p * 2 * C, &data), 0);
        expected[(p * 2 * C) as usize..((p * 2 + 1) * C) as usize].copy_from_slice(&data);
    }
    // Then per pair, in one batch: A = the second half of the even cluster and the first
    // quarter of the odd (fresh) one; B = 4 KiB near the end of the odd cluster.
    let mut ops = Vec::new();
    let mut at = 0usize;
    for p in 0..PAIRS {
        let a_off = p * 2 * C + C / 2;
        let a = pattern((C / 2 + C / 4) as usize, a_off, 42);
        let b_off = (p * 2 + 1) * C + 3 * C / 4 + 4096;
        let b = pattern(4096, b_off, 43);
        for (off, data) in [(a_off, a), (b_off, b)] {
            c.mem_mut()[at..at + data.len()].copy_from_slice(&data);
            expected[off as usize..off as usize + data.len()].copy_from_slice(&data);
            ops.push(Op::Write {
                offset: off,
                buf: at,
                len: data.len(),
            });
            at += data.len();
        }
    }
    assert!(c.submit_batch(0, &ops).iter().all(|&r| r == 0));
    assert_eq!(c.submit(0, Op::Flush), 0);
    assert_same(&c.read_all(0), &expected, "both writes of every pair");
    disconnect_and_stop(&backend, c);
    check_clean(&img);
    compare_with_model(&dir, "pr.expected", &expected, &img);
}

/// Allocated clusters as `qemu-img check` counts them.
fn allocated_clusters(img: &Path) -> u64 {
    let o = Command::new("qemu-img")
        .args(["check"])
        .arg(img)
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "qemu-img check: {}",
        String::from_utf8_lossy(&o.stdout)
    );
    let out = String::from_utf8_lossy(&o.stdout);
    out.lines()
        .find_map(|l| {
            l.split('/')
                .next()?
                .trim()
                .parse::<u64>()
                .ok()
                .filter(|_| l.contains("allocated"))
        })
        .unwrap_or_else(|| panic!("no allocation line in:\n{out}"))
}

/// Zeroes on qcow2: WRITE_ZEROES without unmap sets the zero flag and keeps the clusters;
/// with unmap and --discard unmap, DISCARD, and detect-zeroes=unmap they are released.
#[test]
fn qcow2_zero_flag_keeps_or_releases_clusters() {
    let Some(dir) = setup(QCOW2_BY_VUBLK, "qcow2-zero") else {
        return;
    };
    for (name, args, op, releases) in [
        ("keep", vec![], "wz-no-unmap", false),
        ("unmap-ignored", vec![], "wz", false),
        ("unmap", vec!["--discard", "unmap"], "wz", true),
        ("discard", vec!["--discard", "unmap"], "discard", true),
        (
            "dz-unmap",
            vec!["--discard", "unmap", "--detect-zeroes", "unmap"],
            "zero-data",
            true,
        ),
        ("dz-on", vec!["--detect-zeroes", "on"], "zero-data", false),
    ] {
        let file = format!("{name}.qcow2");
        let img = dir.join(&file);
        vublk_create_qcow2(&dir, &["--size", "4M", &file]);
        let (backend, mut c) = serve(&dir, &img, &args);
        let data = pattern(MIB as usize, 0, 3);
        assert_eq!(c.write_at(0, 0, &data), 0);
        assert_eq!(c.submit(0, Op::Flush), 0);
        let before = {
            disconnect_and_stop(&backend, c);
            allocated_clusters(&img)
        };
        let (backend, mut c) = serve(&dir, &img, &args);
        // Zero 512 KiB = 8 whole 64 KiB clusters, plus a partial cluster.
        let ret = match op {
            "wz-no-unmap" => c.submit(
                0,
                Op::WriteZeroes {
                    offset: 0,
                    len: 512 * 1024 + 4096,
                    flags: blkio::ReqFlags::NO_UNMAP,
                },
            ),
            "wz" => c.submit(
                0,
                Op::WriteZeroes {
                    offset: 0,
                    len: 512 * 1024 + 4096,
                    flags: blkio::ReqFlags::empty(),
                },
            ),
            "discard" => c.submit(
                0,
                Op::Discard {
                    offset: 0,
                    len: 512 * 1024,
                },
            ),
            _ => c.write_at(0, 0, &vec![0u8; 512 * 1024 + 4096]),
        };
        assert_eq!(ret, 0, "{name}: {op}");
        if op != "discard" {
            assert_all_zero(&c.read_at(0, 0, 512 * 1024 + 4096).unwrap(), name);
        }
        assert_same(
            &c.read_at(0, 600 * 1024, 4096).unwrap(),
            &data[600 * 1024..604 * 1024],
            name,
        );
        disconnect_and_stop(&backend, c);
        let after = allocated_clusters(&img);
        eprintln!("{name}: allocated clusters {before} -> {after}");
        if releases {
            assert_eq!(after + 8, before, "{name}: 8 clusters should be released");
        } else {
            assert_eq!(after, before, "{name}: clusters should stay allocated");
        }
    }
}

/// With --discard unmap, discarded clusters give their space back to the host file system
/// (holes punched) and later whole-cluster writes reuse them instead of growing the file; a
/// v2 image (no zero flag) deallocates on WRITE_ZEROES with unmap.
#[test]
fn freed_clusters_are_punched_and_reused() {
    let Some(dir) = setup(QCOW2_BY_VUBLK, "qcow2-reuse") else {
        return;
    };
    for v2 in [false, true] {
        let img = dir.join(if v2 { "v2.qcow2" } else { "v3.qcow2" });
        let mut cmd = Command::new("qemu-img");
        cmd.args(["create", "-q", "-f", "qcow2"]);
        if v2 {
            cmd.args(["-o", "compat=0.10"]);
        }
        run(cmd.arg(&img).arg("16M"));
        let (backend, mut c) = serve(&dir, &img, &["--discard", "unmap"]);
        let mut model = vec![0u8; 16 * MIB as usize];
        let first = pattern(4 * MIB as usize, 0, 5);
        assert_eq!(c.write_at(0, 0, &first), 0);
        model[..4 * MIB as usize].copy_from_slice(&first);
        assert_eq!(c.submit(0, Op::Flush), 0);
        let blocks_full = allocated_blocks(&img);
        let op = if v2 {
            Op::WriteZeroes {
                offset: 0,
                len: 4 * MIB,
                flags: blkio::ReqFlags::empty(),
            }
        } else {
            Op::Discard {
                offset: 0,
                len: 4 * MIB,
            }
        };
        assert_eq!(c.submit(0, op), 0);
        model[..4 * MIB as usize].fill(0);
        // The second flush applies the refcount decrements (after the L2 change is durable).
        assert_eq!(c.submit(0, Op::Flush), 0);
        assert_eq!(c.submit(0, Op::Flush), 0);
        let blocks_freed = allocated_blocks(&img);
        eprintln!("v2={v2}: st_blocks {blocks_full} -> {blocks_freed} after freeing 4 MiB");
        assert!(
            blocks_freed + 4 * MIB / 512 * 9 / 10 <= blocks_full,
            "v2={v2}: freed clusters were not punched: {blocks_full} -> {blocks_freed}"
        );
        // 4 MiB of whole clusters elsewhere: into the freed space.
        let second = pattern(4 * MIB as usize, 0, 6);
        assert_eq!(c.write_at(0, 8 * MIB, &second), 0);
        model[8 * MIB as usize..12 * MIB as usize].copy_from_slice(&second);
        assert_eq!(c.submit(0, Op::Flush), 0);
        assert_same(&c.read_all(0), &model, "after reuse");
        disconnect_and_stop(&backend, c);
        let len = file_size(&img);
        eprintln!("v2={v2}: file length {len} after writing 8 MiB with 4 MiB freed in between");
        assert!(
            len < 6 * MIB,
            "v2={v2}: the file grew to {len}: freed clusters were not reused"
        );
        check_clean(&img);
        compare_with_model(&dir, "reuse.expected", &model, &img);
    }
}

/// A hostile image whose L2 entry points a guest cluster at its own L1 table: a guest write
/// there is refused (I/O error) and the metadata stays intact.
#[test]
fn writes_into_clusters_overlapping_metadata_are_refused() {
    let Some(dir) = setup(QCOW2_BY_VUBLK, "qcow2-overlap") else {
        return;
    };
    let img = dir.join("hostile.qcow2");
    qemu_img_create(&img, "qcow2", "4M");
    qemu_io(&img, "qcow2", &["write -P 0x42 0 64k"]);
    let mut bytes = std::fs::read(&img).unwrap();
    let be64 = |b: &[u8], o: usize| u64::from_be_bytes(b[o..o + 8].try_into().unwrap());
    let l1_offset = be64(&bytes, 40) as usize;
    let l2_offset = (be64(&bytes, l1_offset) & 0x00ff_ffff_ffff_fe00) as usize;
    // Guest cluster 0 -> the L1 table's cluster, "copied" (owned), so a write would go in place.
    let hostile = (l1_offset as u64) | (1 << 63);
    bytes[l2_offset..l2_offset + 8].copy_from_slice(&hostile.to_be_bytes());
    std::fs::write(&img, &bytes).unwrap();
    let l1_before = bytes[l1_offset..l1_offset + 512].to_vec();

    let (backend, mut c) = serve(&dir, &img, &[]);
    let ret = c.write_at(0, 0, &[0xffu8; 4096]);
    assert_eq!(ret, EIO, "a write over metadata must fail");
    assert_eq!(
        c.write_at(0, 65536, &[0x33u8; 4096]),
        0,
        "other writes still work"
    );
    disconnect_and_stop(&backend, c);
    let after = std::fs::read(&img).unwrap();
    assert_eq!(
        &after[l1_offset..l1_offset + 512],
        &l1_before[..],
        "the L1 table was rewritten"
    );
    assert!(
        backend.log_contents().contains("overlaps metadata"),
        "{}",
        backend.log_contents()
    );
}

/// A snapshot's L1 table is metadata too: an active L2 entry pointing at it (as owned data)
/// gets an I/O error, never a write over the snapshot.
#[test]
fn writes_over_a_snapshot_l1_table_are_refused() {
    let Some(dir) = setup(QCOW2_BY_VUBLK, "qcow2-snap-overlap") else {
        return;
    };
    let img = dir.join("hostile.qcow2");
    qemu_img_create(&img, "qcow2", "4M");
    qemu_io(&img, "qcow2", &["write -P 0x42 0 128k"]);
    run(Command::new("qemu-img")
        .args(["snapshot", "-c", "snap1"])
        .arg(&img));
    // The active image gets its own L2 table (the snapshot keeps the old one).
    qemu_io(&img, "qcow2", &["write -P 0x43 64k 64k"]);
    let mut bytes = std::fs::read(&img).unwrap();
    let be64 = |b: &[u8], o: usize| u64::from_be_bytes(b[o..o + 8].try_into().unwrap());
    let snap_table = be64(&bytes, 64) as usize;
    let snap_l1 = be64(&bytes, snap_table) as usize;
    let l1_offset = be64(&bytes, 40) as usize;
    let l2_offset = (be64(&bytes, l1_offset) & 0x00ff_ffff_ffff_fe00) as usize;
    // Guest cluster 1 -> the snapshot's L1 table, "copied" (owned): a write would go in place.
    let hostile = (snap_l1 as u64) | (1 << 63);
    bytes[l2_offset + 8..l2_offset + 16].copy_from_slice(&hostile.to_be_bytes());
    std::fs::write(&img, &bytes).unwrap();
    let before = bytes[snap_l1..snap_l1 + 512].to_vec();

    let (backend, mut c) = serve(&dir, &img, &[]);
    assert_eq!(
        c.write_at(0, 65536, &[0xffu8; 4096]),
        EIO,
        "a write over a snapshot's L1 table must fail"
    );
    assert_eq!(
        c.write_at(0, 2 << 20, &[0x33u8; 4096]),
        0,
        "other writes work"
    );
    disconnect_and_stop(&backend, c);
    let after = std::fs::read(&img).unwrap();
    assert_eq!(
        &after[snap_l1..snap_l1 + 512],
        &before[..],
        "the snapshot's L1 table was overwritten"
    );
}

/// Internal snapshots are preserved: after `qemu-img snapshot -c`, vublk's writes copy the
/// shared L2 tables and data clusters; `qemu-img check` stays clean, the active image has the
/// new data and the snapshot still has the old.
#[test]
fn writes_preserve_internal_snapshots() {
    let Some(dir) = setup(QCOW2_BY_VUBLK, "qcow2-snap") else {
        return;
    };
    let img = dir.join("snap.qcow2");
    qemu_img_create(&img, "qcow2", "4M");
    qemu_io(
        &img,
        "qcow2",
        &["write -P 0xa1 0 1M", "write -c -P 0xa2 2M 64k"],
    );
    let raw_before = dir.join("before.raw");
    to_raw(&img, &raw_before);
    run(Command::new("qemu-img")
        .args(["snapshot", "-c", "snap1"])
        .arg(&img));
    let mut expected = read_file(&raw_before);

    let (backend, mut c) = serve(&dir, &img, &[]);
    for (off, byte) in [
        (0u64, 0xb1u8),
        (512 * 1024, 0xb2),
        (2 * MIB + 4096, 0xb3),
        (3 * MIB, 0xb4),
    ] {
        assert_eq!(c.write_at(0, off, &[byte; 8192]), 0);
        expected[off as usize..off as usize + 8192].fill(byte);
    }
    assert_same(&c.read_all(0), &expected, "active image through vublk");
    disconnect_and_stop(&backend, c);
    check_clean(&img);
    let active = dir.join("active.raw");
    to_raw(&img, &active);
    assert_same(&read_file(&active), &expected, "active image by qemu-img");
    run(Command::new("qemu-img")
        .args(["snapshot", "-a", "snap1"])
        .arg(&img));
    let snap = dir.join("snap.raw");
    to_raw(&img, &snap);
    assert_same(
        &read_file(&snap),
        &read_file(&raw_before),
        "the snapshot kept the old data",
    );
    check_clean(&img);
}

/// A sparse qcow2 file made only of its header's claims: 512-byte clusters, a 512-byte disk,
/// an empty refcount table, and `snapshots` internal snapshots whose L1 tables claim
/// `l1_bytes` each, one after another from 1 MiB past the snapshot table (holes).
fn write_snapshot_bomb(path: &Path, snapshots: u32, l1_bytes: u64) {
    use std::os::unix::fs::FileExt;
    use vublk::image::qcow2::header::{put32, put64, snap, Header};
    const C: u64 = 512;
    let table_at = 3 * C;
    let table_len = u64::from(snapshots) * snap::FIXED_LEN as u64;
    let l1s_at = (table_at + table_len).next_multiple_of(MIB) + MIB;
    let mut h = Header::new_v3(9, C, vublk::image::qcow2::Compression::Zlib);
    (h.l1_size, h.l1_table_offset) = (1, C);
    (h.refcount_table_offset, h.refcount_table_clusters) = (2 * C, 1);
    (h.nb_snapshots, h.snapshots_offset) = (snapshots, table_at);
    let mut bytes = vec![0u8; (table_at + table_len) as usize];
    h.write_to(&mut bytes);
    for i in 0..snapshots as usize {
        let e = &mut bytes[table_at as usize + i * snap::FIXED_LEN..];
        put64(e, snap::L1_TABLE_OFFSET, l1s_at + i as u64 * l1_bytes);
        put32(e, snap::L1_SIZE, (l1_bytes / 8) as u32);
    }
    let f = std::fs::File::create(path).unwrap();
    f.write_all_at(&bytes, 0).unwrap();
    f.set_len(l1s_at + u64::from(snapshots) * l1_bytes).unwrap();
}

/// Issue 28, item 8: a file of a few KiB whose header claims 1,024 internal snapshots with
/// 32 MiB L1 tables each (32 GiB of holes) once took 1.7 GB and over a minute to open
/// read-write. vublk serves it within seconds, at a small peak memory.
#[test]
fn crafted_snapshot_tables_open_quickly_in_bounded_memory() {
    if skip_unless_vublk("vublk's own memory and open time") {
        return;
    }
    let dir = TestDir::new("qcow2-snap-bomb");
    let img = dir.join("bomb.qcow2");
    write_snapshot_bomb(&img, 1024, 32 * MIB);
    let t = std::time::Instant::now();
    let backend = Backend::start(&dir, &img, &BackendOpts::default());
    let took = t.elapsed();
    let peak = backend.peak_rss_bytes();
    assert!(
        took < std::time::Duration::from_secs(5),
        "the open took {took:?}"
    );
    assert!(
        peak < 64 * MIB,
        "peak memory {} MiB while opening",
        peak / MIB
    );
    assert_eq!(backend.sigterm_and_wait(EXIT_DEADLINE).code(), Some(0));
}

/// Issue 28, item 9, the qcow2 side: 128 GiB in 512-byte clusters (a 32 MiB L1 table and 258
/// refcount blocks; vublk once refused anything needing more than one block) is made under
/// a 256 MiB address-space limit (room for the binary and its libraries, librbd's
/// with the `rbd` feature) and checks clean at that size; under a 1 MiB file size limit
/// the creation exits 1 with the reason and leaves no file.
#[test]
fn vublk_create_makes_big_tables_without_building_them() {
    let Some(dir) = setup(CREATE_BY_VUBLK, "qcow2-create-big") else {
        return;
    };
    let img = dir.join("big.qcow2");
    let create = |resource, value| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_vublk"));
        cmd.args(["create", "--format", "qcow2", "--size", "128G"])
            .args(["--cluster-size", "512"])
            .arg(&img);
        output_with_rlimit(&mut cmd, resource, value)
    };
    let o = create(libc::RLIMIT_FSIZE, MIB);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "under a file size limit: {o:?}");
    assert!(err.contains("File too large"), "{err}");
    assert!(!img.exists(), "a failed creation left its file behind");

    let o = create(libc::RLIMIT_AS, AS_LIMIT);
    assert!(o.status.success(), "under a memory limit: {o:?}");
    check_clean(&img);
    assert_virtual_size(&img, 128 << 30);
}
