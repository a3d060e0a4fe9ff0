//! `--compress-writes on`: clusters written whole are stored compressed (zlib and zstd),
//! partial writes to unallocated clusters are merged into whole compressed clusters, writes
//! over compressed clusters copy-on-write, incompressible clusters are stored normally; the
//! image passes `qemu-img check`, equals the expected data by `qemu-img compare`, and reads
//! back through vublk before and after a restart.

mod common;

use std::path::Path;
use std::process::Command;

use common::*;

const MIB: u64 = 1 << 20;
const SIZE: u64 = 16 * MIB;

/// The "compressed clusters" percentage that `qemu-img check` reports.
fn compressed_percent(img: &Path) -> f64 {
    let out = run_ok(
        Command::new("qemu-img")
            .args(["check", "-f", "qcow2"])
            .arg(img),
    );
    out.split("fragmented, ")
        .nth(1)
        .and_then(|r| r.split('%').next())
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no compressed percentage in:\n{out}"))
}

/// Text-like data: compresses well, but is not a constant.
fn compressible(len: usize, seed: u64) -> Vec<u8> {
    let mut v = Vec::with_capacity(len);
    let mut i = seed;
    while v.len() < len {
        v.extend_from_slice(format!("line {i:08} of the compressible pattern, ").as_bytes());
        i += 1;
    }
    v.truncate(len);
    v
}

fn serve_and_check(dir: &TestDir, img: &Path, expected: &[u8]) {
    let opts = BackendOpts {
        read_only: true,
        ..Default::default()
    };
    let backend = Backend::start(dir, img, &opts);
    let mut c = connect(
        &backend.socket,
        ClientOpts {
            read_only: true,
            ..Default::default()
        },
    );
    assert_same(&c.read_all(0), expected, "after a restart");
    drop(c);
    assert_eq!(backend.sigterm_and_wait(EXIT_DEADLINE).code(), Some(0));
}

#[test]
fn compressed_writes_are_interchangeable_with_qemu_img() {
    if skip_unless_vublk("compressed writes are vublk's") || !have_qemu_img() {
        return;
    }
    let dir = TestDir::new("compress");
    let mut file_writes = Vec::new();
    // The last case compresses on the queue thread and writes each host cluster as it fills.
    let one_by_one = ["--compress-threads", "0", "--compressed-cache-size", "64K"];
    for (ctype, cache, more) in [
        ("zlib", "on", &[][..]),
        ("zstd", "on", &[][..]),
        ("zlib", "off", &[][..]),
        ("zstd", "off", &[][..]),
        ("zlib", "one", &one_by_one[..]),
    ] {
        let img = dir.join(&format!("{ctype}-cache-{cache}.qcow2"));
        run_ok(
            Command::new(env!("CARGO_BIN_EXE_vublk"))
                .args(["create", "--format", "qcow2", "--size", "16M"])
                .args(["--compression-type", ctype])
                .arg(&img),
        );
        let opts = BackendOpts {
            extra_args: ["--compress-writes", "on", "--compressed-cache"]
                .iter()
                .chain([if cache == "off" { "off" } else { "on" }].iter())
                .chain(more)
                .map(|s| s.to_string())
                .collect(),
            ..Default::default()
        };
        let backend = Backend::start(&dir, &img, &opts);
        let mut c = connect_queues(&backend.socket, 1);
        let mut model = vec![0u8; SIZE as usize];
        let text = compressible(8 * MIB as usize, 1);
        for (i, chunk) in text.chunks(MIB as usize).enumerate() {
            assert_eq!(c.write_at(0, i as u64 * MIB, chunk), 0);
        }
        model[..8 * MIB as usize].copy_from_slice(&text);
        // Incompressible data: stored as normal clusters.
        let noise = pattern(MIB as usize, 9 * MIB, 7);
        assert_eq!(c.write_at(0, 9 * MIB, &noise), 0);
        model[9 * MIB as usize..10 * MIB as usize].copy_from_slice(&noise);
        // A partial write into an unallocated cluster: merged with zeroes, compressed.
        let part = compressible(4096, 99);
        assert_eq!(c.write_at(0, 12 * MIB + 8192, &part), 0);
        model[(12 * MIB + 8192) as usize..(12 * MIB + 12288) as usize].copy_from_slice(&part);
        // A partial write over a compressed cluster: copy-on-write, compressed again.
        let over = compressible(1024, 5000);
        assert_eq!(c.write_at(0, MIB + 512, &over), 0);
        model[(MIB + 512) as usize..(MIB + 1536) as usize].copy_from_slice(&over);
        assert_eq!(c.submit(0, Op::Flush), 0);
        assert_same(
            &c.read_all(0),
            &model,
            &format!("{ctype}: reads while serving"),
        );
        drop(c);
        assert_eq!(backend.sigterm_and_wait(EXIT_DEADLINE).code(), Some(0));
        let log = std::fs::read_to_string(&backend.log).unwrap();
        assert!(log.contains("compressed writes: on"), "{log}");
        if cache == "one" {
            assert!(
                log.contains("cache on, 1 clusters, 0 compression threads"),
                "{log}"
            );
        }
        let writes: u64 = log
            .split("compressed writes: ")
            .filter_map(|r| r.split(" writes of").next()?.parse().ok())
            .next()
            .unwrap_or_else(|| panic!("no write counter:\n{log}"));
        eprintln!("{ctype} cache {cache}: {writes} compressed writes reached the file");
        file_writes.push((ctype, cache, writes));
        // 128 + 1 compressible clusters written (the overwrite replaced one), 16 did not
        // compress.
        assert!(
            log.contains("clusters compressed, 16 stored normally"),
            "{ctype}: counters:\n{log}"
        );
        run_ok(
            Command::new("qemu-img")
                .args(["check", "-q", "-f", "qcow2"])
                .arg(&img),
        );
        let pct = compressed_percent(&img);
        eprintln!("{ctype}: {pct}% compressed clusters");
        // 129 compressed of 145 allocated.
        assert!(pct > 85.0, "{ctype}: only {pct}% compressed");
        let raw = dir.join("expected.raw");
        std::fs::write(&raw, &model).unwrap();
        qemu_compare(&raw, &img);
        // The image is far smaller than its data.
        let size = file_size(&img);
        eprintln!("{ctype}: image {size} bytes for 9 MiB of data");
        assert!(size < 4 * MIB, "{ctype}: image of {size} bytes");
        serve_and_check(&dir, &img, &model);
    }
    // The cache writes each host cluster once instead of once per chunk.
    for ctype in ["zlib", "zstd"] {
        let w = |cache| {
            file_writes
                .iter()
                .find(|(t, c, _)| *t == ctype && *c == cache)
                .unwrap()
                .2
        };
        assert!(
            w("on") * 10 <= w("off"),
            "{ctype}: the cache did not cut writes 10x: {} with, {} without",
            w("on"),
            w("off")
        );
    }
    // A run of 16 host clusters is written at once; one cluster at a time takes more writes.
    let w = |cache| file_writes.iter().find(|(_, c, _)| *c == cache).unwrap().2;
    assert!(
        w("on") < w("one"),
        "16-cluster runs: {} writes, one cluster at a time: {}",
        w("on"),
        w("one")
    );
}

/// Compressed writes at depth 8: every publish makes the unfinished run, its refcounts and
/// L2 entries durable (a sync), so finished requests wait for the pool's other jobs in
/// flight and one publish covers them all: the compressed writes that reach the file (one
/// per publish, plus the full runs) are about one per batch of 8, not one or two per
/// completion.
#[test]
fn compressed_writes_at_depth_are_published_in_batches() {
    if skip_unless_vublk("compressed writes are vublk's") || !have_qemu_img() {
        return;
    }
    let dir = TestDir::new("compress-batches");
    let img = dir.join("batches.qcow2");
    // zstd: its C code compresses as fast in a debug build as in a release one, so that a
    // batch's jobs finish within the hold's bound even while other tests load the CPUs.
    run_ok(
        Command::new(env!("CARGO_BIN_EXE_vublk"))
            .args(["create", "--format", "qcow2", "--size", "64M"])
            .args(["--compression-type", "zstd"])
            .arg(&img),
    );
    let opts = BackendOpts {
        extra_args: vec!["--compress-writes".into(), "on".into()],
        ..Default::default()
    };
    let backend = Backend::start(&dir, &img, &opts);
    let mut c = connect_queues(&backend.socket, 1);
    const BATCHES: usize = 32;
    const DEPTH: usize = 8;
    // A constant byte: chunks of a few dozen bytes, so that full runs are rare and the
    // writes counted are the publishes'.
    let data = vec![0x61u8; 64 * 1024];
    for k in 0..DEPTH {
        c.mem_mut()[k * 65536..(k + 1) * 65536].copy_from_slice(&data);
    }
    for b in 0..BATCHES {
        let ops: Vec<Op> = (0..DEPTH)
            .map(|k| Op::Write {
                offset: ((b * DEPTH + k) * 65536) as u64,
                buf: k * 65536,
                len: 65536,
            })
            .collect();
        assert!(c.submit_batch(0, &ops).iter().all(|&r| r == 0));
    }
    assert_eq!(c.submit(0, Op::Flush), 0);
    drop(c);
    assert_eq!(backend.sigterm_and_wait(EXIT_DEADLINE).code(), Some(0));
    let log = std::fs::read_to_string(&backend.log).unwrap();
    let writes: usize = log
        .split("compressed writes: ")
        .filter_map(|r| r.split(" writes of").next()?.parse().ok())
        .next()
        .unwrap_or_else(|| panic!("no write counter:\n{log}"));
    eprintln!(
        "{} requests in batches of {DEPTH}: {writes} compressed writes",
        BATCHES * DEPTH
    );
    // Published as completions come: 79 (zstd) to 239 (zlib) here before batching; in
    // batches, one per batch: 32 (at most one and a half per batch allowed).
    let requests = BATCHES * DEPTH;
    assert!(
        writes * 2 <= BATCHES * 3,
        "{writes} compressed writes for {requests} requests in {BATCHES} batches of {DEPTH}: \
         not published one batch at a time"
    );
    run_ok(
        Command::new("qemu-img")
            .args(["check", "-q", "-f", "qcow2"])
            .arg(&img),
    );
}

/// SIGKILL with a partly filled cache: no corruption, everything flushed is intact.
#[test]
fn sigkill_with_a_partly_filled_cache() {
    if skip_unless_vublk("compressed writes are vublk's") || !have_qemu_img() {
        return;
    }
    let dir = TestDir::new("compress-kill");
    let img = dir.join("k.qcow2");
    run_ok(
        Command::new(env!("CARGO_BIN_EXE_vublk"))
            .args(["create", "--format", "qcow2", "--size", "16M"])
            .arg(&img),
    );
    let opts = BackendOpts {
        extra_args: vec!["--compress-writes".into(), "on".into()],
        ..Default::default()
    };
    let mut model = vec![0u8; SIZE as usize];
    for round in 0..3u64 {
        let backend = Backend::start(&dir, &img, &opts);
        let mut c = connect_queues(&backend.socket, 1);
        assert_same(
            &c.read_all(0),
            &model,
            &format!("round {round}: after restart"),
        );
        // Flushed: three clusters (the partly filled host cluster is written by the flush).
        let flushed = compressible(3 * 65536, round * 1000);
        let at = round * 4 * MIB;
        assert_eq!(c.write_at(0, at, &flushed), 0);
        assert_eq!(c.submit(0, Op::Flush), 0);
        model[at as usize..at as usize + flushed.len()].copy_from_slice(&flushed);
        // Not flushed: sits in the cache when the daemon dies.
        let pending = compressible(2 * 65536, round * 1000 + 500);
        assert_eq!(c.write_at(0, at + MIB, &pending), 0);
        backend.signal(libc::SIGKILL);
        let _ = backend.wait_exit(EXIT_DEADLINE);
        drop(c);
        let o = Command::new("qemu-img")
            .args(["check", "-f", "qcow2"])
            .arg(&img)
            .output()
            .unwrap();
        let code = o.status.code();
        assert!(
            code == Some(0) || code == Some(3),
            "round {round}: corruption after SIGKILL ({code:?}):\n{}",
            String::from_utf8_lossy(&o.stdout)
        );
        // The unflushed clusters read as before or as written: take what is there.
        let backend = Backend::start(&dir, &img, &BackendOpts::default());
        let mut c = connect_queues(&backend.socket, 1);
        let got = c.read_all(0);
        let r = at as usize..at as usize + flushed.len();
        assert_same(
            &got[r.clone()],
            &model[r],
            &format!("round {round}: flushed data"),
        );
        model = got;
        drop(c);
        assert_eq!(backend.sigterm_and_wait(EXIT_DEADLINE).code(), Some(0));
    }
}

#[test]
fn compress_writes_needs_a_writable_qcow2() {
    if skip_unless_vublk("compressed writes are vublk's") {
        return;
    }
    let dir = TestDir::new("compress-raw");
    let img = dir.join("raw.img");
    std::fs::write(&img, vec![0u8; MIB as usize]).unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_vublk"))
        .args(["--socket-path"])
        .arg(dir.join("s.sock"))
        .args(["--blk-file"])
        .arg(&img)
        .args(["--compress-writes", "on"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("--compress-writes"), "{err}");
    // A cache smaller than one cluster, or a bad size, is refused.
    let qcow2 = dir.join("q.qcow2");
    run_ok(
        Command::new(env!("CARGO_BIN_EXE_vublk"))
            .args(["create", "--format", "qcow2", "--size", "16M"])
            .arg(&qcow2),
    );
    for size in ["4K", "lots", "0"] {
        let o = Command::new(env!("CARGO_BIN_EXE_vublk"))
            .args(["--socket-path"])
            .arg(dir.join("s.sock"))
            .args(["--blk-file"])
            .arg(&qcow2)
            .args(["--compress-writes", "on", "--compressed-cache-size", size])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{size}: {err}");
        assert!(err.contains("--compressed-cache-size"), "{size}: {err}");
    }
}
