//! qcow2 extended L2 entries (subclusters, `extended_l2=on`): images QEMU wrote read back
//! through vublk as `qemu-img convert` reads them; vublk's writes into such images (single
//! subclusters over a backing file, into clusters QEMU left half-allocated, zeroes) match
//! a model, pass `qemu-img check`, and read back in QEMU; `vublk create --extended-l2`.

mod common;

use std::path::Path;
use std::process::Command;

use common::*;

const WHY: &str = "qcow2 is served by vublk";
const STOP: std::time::Duration = std::time::Duration::from_secs(10);

fn setup(name: &str) -> Option<TestDir> {
    if skip_unless_vublk(WHY) {
        return None;
    }
    let ok = |p: &str| {
        Command::new(p)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
    };
    if !ok("qemu-img") || !ok("qemu-io") {
        return skip_or_fail("qemu-img/qemu-io not installed");
    }
    Some(TestDir::new(name))
}

fn qemu_io(img: &Path, cmds: &[&str]) {
    let mut io = Command::new("qemu-io");
    io.args(["-f", "qcow2"]);
    for c in cmds {
        io.args(["-c", c]);
    }
    run_ok(io.arg(img));
}

/// `qemu-img create -f qcow2 -o OPTS` (relative names resolved in `dir`).
fn qemu_create(dir: &TestDir, name: &str, opts: &str, size: &str, backing: Option<&str>) {
    let mut cmd = Command::new("qemu-img");
    cmd.current_dir(dir.join(""))
        .args(["create", "-q", "-f", "qcow2", "-o", opts]);
    if let Some(b) = backing {
        cmd.args(["-F", "raw", "-b", b]);
    }
    run_ok(cmd.args([name, size]));
}

fn expected(dir: &TestDir, img: &Path) -> Vec<u8> {
    let raw = dir.join("expected.raw");
    convert_to_raw(img, "qcow2", &raw);
    read_file(&raw)
}

fn serve(dir: &TestDir, img: &Path, read_only: bool) -> (Backend, Client) {
    let opts = BackendOpts {
        read_only,
        ..Default::default()
    };
    let client = ClientOpts {
        read_only,
        ..Default::default()
    };
    start_and_connect(dir, img, &opts, client)
}

/// Read the whole disk and reads that start and end inside subclusters; all must equal
/// `want`.
fn check_reads(c: &mut Client, want: &[u8], what: &str) {
    assert_same(&c.read_all(0), want, &format!("{what}: whole disk"));
    let mut rng = Rng::new(0x5b_c1u64 ^ want.len() as u64);
    for _ in 0..200 {
        let len = (rng.range(1, 64) * 512) as usize;
        let off = rng.below((want.len() - len) as u64 / 512 + 1) * 512;
        let got = c.read_at(0, off, len).unwrap();
        assert_same(
            &got,
            &want[off as usize..off as usize + len],
            &format!("{what}: read {len} at {off}"),
        );
    }
}

/// What QEMU writes into single subclusters, zeroes by subcluster, discards and compresses
/// reads back through vublk as qemu-img reads it: 64 KiB clusters over a backing file
/// (2 KiB subclusters), 2 MiB clusters with zstd (64 KiB subclusters), 16 KiB clusters (the
/// smallest: 512-byte subclusters).
#[test]
fn qemu_written_subclusters_read_back_identically() {
    let Some(dir) = setup("subclusters-read") else {
        return;
    };
    create_pattern_image(&dir.join("base.raw"), 16 * MIB, 41);
    for (name, opts, backing) in [
        ("c64k", "extended_l2=on,cluster_size=64k", Some("base.raw")),
        (
            "c2m",
            "extended_l2=on,cluster_size=2M,compression_type=zstd",
            None,
        ),
        ("c16k", "extended_l2=on,cluster_size=16k", Some("base.raw")),
    ] {
        let file = format!("{name}.qcow2");
        qemu_create(&dir, &file, opts, "16M", backing);
        let img = dir.join(&file);
        qemu_io(
            &img,
            &[
                "write -P 0x11 4096 2048",
                "write -P 0x12 70000 1000",
                "write -P 0x13 1M 192k",
                "write -z 1114112 8192",
                "write -z 3M 2048",
                "discard 4M 64k",
                "write -c -P 0x14 6M 2M",
                "write -P 0x15 9437696 512",
                "write -z -u 10M 1M",
            ],
        );
        let want = expected(&dir, &img);
        let (backend, mut c) = serve(&dir, &img, true);
        check_reads(&mut c, &want, name);
        disconnect_and_stop(&backend, c);
        assert!(backend.log_contents().contains("qcow2 v3"), "{name}");
    }
}

/// vublk writes into a fresh extended-L2 overlay made by `vublk create --extended-l2` over
/// a backing file and into one QEMU half-filled: random writes of 512 B to 256 KiB (single
/// subclusters, parts of them, whole clusters), zeroes, reads; the image matches the model
/// in vublk and in QEMU, `qemu-img check` is clean, QEMU can write on and vublk reads that.
/// Small writes into a fresh overlay copy nothing: the file holds far less than the
/// clusters they touched.
#[test]
fn vublk_writes_subclusters_that_qemu_reads() {
    let Some(dir) = setup("subclusters-write") else {
        return;
    };
    const SIZE: u64 = 16 * MIB;
    let base = dir.join("base.raw");
    create_pattern_image(&base, SIZE, 42);
    run_ok(
        Command::new(env!("CARGO_BIN_EXE_vublk"))
            .current_dir(dir.join(""))
            .args(["create", "--format", "qcow2", "--extended-l2"])
            .args(["--backing", "base.raw", "fresh.qcow2"]),
    );
    let info = Command::new("qemu-img")
        .args(["info", "--output=json"])
        .arg(dir.join("fresh.qcow2"))
        .output()
        .unwrap();
    let info = String::from_utf8_lossy(&info.stdout);
    assert!(info.contains("\"extended-l2\": true"), "{info}");
    qemu_create(
        &dir,
        "half.qcow2",
        "extended_l2=on",
        "16M",
        Some("base.raw"),
    );
    qemu_io(
        &dir.join("half.qcow2"),
        &["write -P 0x21 0 8M", "discard 2M 1M", "write -z 5M 4096"],
    );
    for name in ["fresh", "half"] {
        let img = dir.join(&format!("{name}.qcow2"));
        let mut model = expected(&dir, &img);
        // Small writes first: 4 KiB at 1 MiB strides touch 16 clusters.
        let (backend, mut c) = serve(&dir, &img, false);
        let mut rng = Rng::new(0x5b_c2 ^ name.len() as u64);
        for k in 0..16u64 {
            let mut data = vec![0u8; 4096];
            rng.fill(&mut data);
            let off = k * MIB + 8192;
            assert_eq!(c.write_at(0, off, &data), 0);
            model[off as usize..off as usize + 4096].copy_from_slice(&data);
        }
        assert_eq!(c.submit(0, Op::Flush), 0);
        if name == "fresh" {
            // 16 clusters copied whole would be 1 MiB of data.
            // Data in the overlay itself (depth 0), as qemu-img maps it.
            let out = run_ok(
                Command::new("qemu-img")
                    .args(["map", "-U", "--output=json", "-f", "qcow2"])
                    .arg(&img),
            );
            let map: serde_json::Value = serde_json::from_str(&out).unwrap();
            let own: u64 = map
                .as_array()
                .unwrap()
                .iter()
                .filter(|e| e["depth"] == 0 && e["data"] == true)
                .map(|e| e["length"].as_u64().unwrap())
                .sum();
            assert_eq!(own, 16 * 4096, "the overlay's own data: {out}");
        }
        for i in 0..300 {
            let len = if rng.below(8) == 0 {
                rng.range(1, 5) * 65536
            } else {
                rng.range(1, 16) * 512
            } as usize;
            let off = rng.below((SIZE - len as u64) / 512 + 1) * 512;
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
        check_reads(&mut c, &model, name);
        disconnect_and_stop(&backend, c);
        let log = backend.log_contents();
        assert!(
            log.lines()
                .any(|l| l.contains("writes of single subclusters") && !l.contains(" 0 writes")),
            "{name}: no subcluster writes counted:\n{log}"
        );
        run_ok(Command::new("qemu-img").args(["check", "-q"]).arg(&img));
        let raw = dir.join(&format!("{name}.model"));
        std::fs::write(&raw, &model).unwrap();
        qemu_compare(&raw, &img);
        // QEMU writes on; vublk reads what it wrote.
        qemu_io(&img, &["write -P 0x31 12288 2048", "write -z 65536 2048"]);
        let want = expected(&dir, &img);
        let (backend, mut c) = serve(&dir, &img, true);
        check_reads(&mut c, &want, &format!("{name} after qemu-io"));
        disconnect_and_stop(&backend, c);
    }
}

/// `vublk create --extended-l2` refuses what QEMU cannot open.
#[test]
fn create_extended_l2_refuses_small_clusters_and_other_formats() {
    let Some(dir) = setup("subclusters-create") else {
        return;
    };
    for (args, says) in [
        (
            &["--format", "qcow2", "--cluster-size", "4K"][..],
            "16K at least",
        ),
        (&["--format", "raw"][..], "needs --format qcow2"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_vublk"))
            .current_dir(dir.join(""))
            .arg("create")
            .args(args)
            .args(["--extended-l2", "--size", "1M", "x.img"])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains(says),
            "{args:?}: {err}"
        );
        assert!(!dir.join("x.img").exists());
    }
}

/// A stream job over an extended-L2 overlay QEMU half-filled (single subclusters, zeroed
/// subclusters, whole clusters, untouched clusters): the overlay gets only what it lacks and
/// then stands alone, holding what the chain read.
#[test]
fn stream_fills_the_subclusters_an_overlay_lacks() {
    let Some(dir) = setup("subclusters-stream") else {
        return;
    };
    if skip_chain_test("stream jobs") {
        return;
    }
    create_pattern_image(&dir.join("base.raw"), 8 * MIB, 43);
    qemu_create(&dir, "top.qcow2", "extended_l2=on", "8M", Some("base.raw"));
    let img = dir.join("top.qcow2");
    qemu_io(
        &img,
        &[
            "write -P 0x41 4096 2048",
            "write -P 0x42 70000 1000",
            "write -z 200704 6144",
            "write -P 0x43 1M 64k",
            "write -z 2M 64k",
            "write -P 0x44 3145728 512",
        ],
    );
    let want = expected(&dir, &img);
    let (backend, sock) = start_with_control(&dir, &img, 1, &[]);
    ctl_ok(&sock, "stream", &["--id", "all"]);
    let j = wait_job(&sock, "all");
    assert!(j["error"].is_null(), "{j}");
    assert_eq!(backend.sigterm_and_wait(STOP).code(), Some(0));
    assert_eq!(chain(&img), [("top.qcow2".to_owned(), "qcow2".to_owned())]);
    let raw = dir.join("want.raw");
    std::fs::write(&raw, &want).unwrap();
    assert_compare(&img, &raw, "the streamed overlay");
    assert_check_allows_leaks(&img, "qcow2", "the streamed overlay");
}
