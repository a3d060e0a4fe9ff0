//! Changed-block tracking (docs/changed-block-tracking.md): the `bitmap-*` control methods
//! through `vublk ctl`, and what a libblkio client's requests leave in the bitmaps: writes,
//! WRITE_ZEROES, deallocating DISCARDs and detect-zeroes conversions are recorded, reads and
//! flushes are not; a randomized run of every method against a model of the bitmaps.

mod common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

use blkio::ReqFlags;
use common::*;

const STOP: Duration = Duration::from_secs(10);

fn start(dir: &TestDir, img: &Path, queues: u32, extra: &[&str]) -> (Backend, PathBuf) {
    start_with_control(dir, img, queues, extra)
}

fn refused(sock: &Path, method: &str, args: &[&str]) -> String {
    let (ok, _, err) = ctl(sock, method, args);
    assert!(!ok, "vublk ctl {method} {args:?} succeeded");
    err
}

/// Every dirty extent of `name`, paging through `bitmap-ranges`.
fn extents(sock: &Path, name: &str) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    let mut from = 0u64;
    loop {
        let v = ctl_ok(
            sock,
            "bitmap-ranges",
            &[name, "--offset", &from.to_string(), "--max", "7"],
        );
        for e in v["extents"].as_array().unwrap() {
            out.push((e[0].as_u64().unwrap(), e[1].as_u64().unwrap()));
        }
        match v["next_offset"].as_u64() {
            Some(n) => {
                assert!(n > from, "no progress: {v}");
                from = n;
            }
            None => return out,
        }
    }
}

/// Extents of a set of granules.
fn granule_extents(granules: &BTreeSet<u64>, g: u64, size: u64) -> Vec<(u64, u64)> {
    let mut out: Vec<(u64, u64)> = Vec::new();
    for &i in granules {
        let (start, len) = (i * g, g.min(size - i * g));
        match out.last_mut() {
            Some(l) if l.0 + l.1 == start => l.1 += len,
            _ => out.push((start, len)),
        }
    }
    out
}

fn granules_of(offset: u64, len: u64, g: u64) -> impl Iterator<Item = u64> {
    (offset / g)..=((offset + len - 1) / g)
}

#[test]
fn writes_zeroes_and_deallocating_discards_are_recorded_reads_and_flushes_are_not() {
    if skip_unless_vublk("vublk's dirty bitmaps") {
        return;
    }
    let dir = TestDir::new("bitmaps-record");
    let img = dir.join("img.raw");
    let size = 64 * MIB;
    create_pattern_image(&img, size, 3);
    let (backend, sock) = start(
        &dir,
        &img,
        2,
        &["--discard", "unmap", "--detect-zeroes", "on"],
    );
    ctl_ok(&sock, "bitmap-add", &["b0"]);
    ctl_ok(&sock, "bitmap-add", &["fine", "--granularity", "512"]);
    let mut c = connect_queues(&backend.socket, 2);
    // Not recorded: reads and flushes.
    c.read_at(0, 0, 1 << 20).unwrap();
    assert_eq!(c.submit(1, Op::Flush), 0);
    assert_eq!(
        ctl_ok(&sock, "bitmap-list", &[])["bitmaps"][0]["dirty_bytes"],
        0
    );
    // Recorded: a write on each queue, WRITE_ZEROES, a DISCARD that deallocates, a zero
    // write detect-zeroes turns into zeroes.
    assert_eq!(c.write_at(0, MIB + 512, &[1u8; 1024]), 0);
    assert_eq!(c.write_at(1, 5 * MIB, &[2u8; 8192]), 0);
    assert_eq!(
        c.submit(
            0,
            Op::WriteZeroes {
                offset: 8 * MIB,
                len: 128 << 10,
                flags: ReqFlags::empty()
            }
        ),
        0
    );
    assert_eq!(
        c.submit(
            1,
            Op::Discard {
                offset: 16 * MIB,
                len: 64 << 10
            }
        ),
        0
    );
    assert_eq!(c.write_at(0, 20 * MIB + 4096, &[0u8; 4096]), 0);
    // The last sector of the disk.
    assert_eq!(c.write_at(1, size - 512, &[9u8; 512]), 0);
    let k64 = 64 << 10;
    assert_eq!(
        extents(&sock, "b0"),
        [
            (MIB, k64),
            (5 * MIB, k64),
            (8 * MIB, 2 * k64),
            (16 * MIB, k64),
            (20 * MIB, k64),
            (size - k64, k64)
        ]
    );
    assert_eq!(
        extents(&sock, "fine"),
        [
            (MIB + 512, 1024),
            (5 * MIB, 8192),
            (8 * MIB, 128 << 10),
            (16 * MIB, 64 << 10),
            (20 * MIB + 4096, 4096),
            (size - 512, 512)
        ]
    );
    let list = ctl_ok(&sock, "bitmap-list", &[]);
    let b0 = &list["bitmaps"][0];
    assert_eq!(b0["name"], "b0");
    assert_eq!(b0["granularity"], k64);
    assert_eq!(b0["recording"], true);
    assert_eq!(b0["persistent"], false);
    assert_eq!(b0["inconsistent"], false);
    assert_eq!(b0["dirty_bytes"], 7 * k64);
    assert_eq!(b0["size_bytes"], size);
    // A raw image keeps its bitmaps in memory only, and says so.
    assert!(list["memory_only"]
        .as_str()
        .is_some_and(|w| w.contains("in memory only")));
    assert_eq!(
        list["bitmaps"][1]["dirty_bytes"],
        1024 + 8192 + (192 << 10) + 4096 + 512
    );
    // A disabled bitmap records nothing until enabled again; a cleared one starts over.
    ctl_ok(&sock, "bitmap-disable", &["b0"]);
    assert_eq!(c.write_at(0, 40 * MIB, &[3u8; 4096]), 0);
    assert!(!extents(&sock, "b0").contains(&(40 * MIB, k64)));
    ctl_ok(&sock, "bitmap-enable", &["b0"]);
    ctl_ok(&sock, "bitmap-clear", &["fine"]);
    assert_eq!(c.write_at(1, 41 * MIB, &[3u8; 4096]), 0);
    assert!(extents(&sock, "b0").contains(&(41 * MIB, k64)));
    assert_eq!(extents(&sock, "fine"), [(41 * MIB, 4096)]);
    drop(c);
    assert!(backend.sigterm_and_wait(STOP).success());
}

#[test]
fn without_deallocation_a_discard_changes_nothing_and_is_not_recorded() {
    if skip_unless_vublk("vublk's dirty bitmaps") {
        return;
    }
    let dir = TestDir::new("bitmaps-discard-ignore");
    let img = dir.join("img.raw");
    create_pattern_image(&img, 16 * MIB, 4);
    let (backend, sock) = start(&dir, &img, 1, &["--discard", "ignore"]);
    ctl_ok(&sock, "bitmap-add", &["b"]);
    let mut c = connect_queues(&backend.socket, 1);
    assert_eq!(
        c.submit(
            0,
            Op::Discard {
                offset: MIB,
                len: MIB
            }
        ),
        0
    );
    assert_eq!(c.read_at(0, MIB, 4096).unwrap(), pattern(4096, MIB, 4));
    assert_eq!(extents(&sock, "b"), []);
    drop(c);
    assert!(backend.sigterm_and_wait(STOP).success());
}

#[test]
fn bad_names_granularities_and_requests_are_refused_and_the_daemon_serves_on() {
    if skip_unless_vublk("vublk's dirty bitmaps") {
        return;
    }
    let dir = TestDir::new("bitmaps-refused");
    let img = dir.join("img.raw");
    create_pattern_image(&img, 16 * MIB, 5);
    let (backend, sock) = start(&dir, &img, 1, &[]);
    let long = "x".repeat(1024);
    for (args, says) in [
        (vec!["", "--granularity", "64K"], "1 to 1023 bytes"),
        (vec![long.as_str()], "1 to 1023 bytes"),
        (vec!["a\nb"], "no control characters"),
        (
            vec!["a", "--granularity", "1000"],
            "a power of two from 512 bytes to 2 GiB",
        ),
        (vec!["a", "--granularity", "256"], "a power of two"),
        (vec!["a", "--granularity", "4G"], "a power of two"),
        (vec!["a", "--granularity", "lots"], "--granularity"),
        (vec!["a", "--persistent"], "in memory only"),
    ] {
        let err = refused(&sock, "bitmap-add", &args);
        assert!(err.contains(says), "{args:?}: {err}");
    }
    ctl_ok(&sock, "bitmap-add", &["a"]);
    ctl_ok(&sock, "bitmap-add", &["big", "--granularity", "2G"]);
    assert!(refused(&sock, "bitmap-add", &["a"]).contains("exists"));
    for m in [
        "bitmap-remove",
        "bitmap-clear",
        "bitmap-enable",
        "bitmap-disable",
    ] {
        assert!(
            refused(&sock, m, &["nope"]).contains("no bitmap \"nope\""),
            "{m}"
        );
    }
    assert!(refused(&sock, "bitmap-merge", &["--target", "a", "big"]).contains("same granularity"));
    assert!(refused(&sock, "bitmap-merge", &["--target", "a", "nope"]).contains("no bitmap"));
    assert!(refused(&sock, "bitmap-ranges", &["nope"]).contains("no bitmap"));
    // Still serving, and the bitmaps as they were.
    let mut c = connect_queues(&backend.socket, 1);
    assert_eq!(c.write_at(0, 0, &[1u8; 4096]), 0);
    let l = ctl_ok(&sock, "bitmap-list", &[]);
    let names: Vec<&str> = l["bitmaps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["a", "big"]);
    assert_eq!(l["bitmaps"][1]["dirty_bytes"], 16 * MIB);
    drop(c);
    assert!(backend.sigterm_and_wait(STOP).success());
}

#[test]
fn an_online_resize_grows_the_bitmaps() {
    if skip_unless_vublk("vublk's dirty bitmaps") {
        return;
    }
    let dir = TestDir::new("bitmaps-resize");
    let img = dir.join("img.raw");
    create_pattern_image(&img, 16 * MIB, 6);
    let (backend, sock) = start(&dir, &img, 1, &[]);
    ctl_ok(&sock, "bitmap-add", &["b", "--granularity", "1M"]);
    ctl_ok(&sock, "resize", &["48M"]);
    let mut c = connect_queues(&backend.socket, 1);
    assert_eq!(c.capacity(), 48 * MIB);
    assert_eq!(c.write_at(0, 40 * MIB, &[1u8; 4096]), 0);
    assert_eq!(extents(&sock, "b"), [(40 * MIB, MIB)]);
    assert_eq!(
        ctl_ok(&sock, "bitmap-list", &[])["bitmaps"][0]["size_bytes"],
        48 * MIB
    );
    drop(c);
    assert!(backend.sigterm_and_wait(STOP).success());
}

/// A model of one bitmap.
struct Model {
    name: String,
    g: u64,
    recording: bool,
    granules: BTreeSet<u64>,
}

/// Random control methods and writes, each checked against a model: every bitmap's extents
/// and `bitmap-list` after each step, and each refusal predicted.
#[test]
fn control_methods_match_a_model_of_the_bitmaps() {
    if skip_unless_vublk("vublk's dirty bitmaps") {
        return;
    }
    let dir = TestDir::new("bitmaps-model");
    let img = dir.join("img.raw");
    let size = 32 * MIB;
    create_pattern_image(&img, size, 7);
    let (backend, sock) = start(&dir, &img, 2, &[]);
    let mut c = connect_queues(&backend.socket, 2);
    let mut rng = Rng::new(0xb17);
    let names = ["a", "b", "c", "d"];
    let grans = [512u64, 4096, 65536, 1 << 20];
    let mut model: Vec<Model> = Vec::new();
    for step in 0..160 {
        let name = names[rng.below(names.len() as u64) as usize];
        let at = model.iter().position(|m| m.name == name);
        match rng.below(8) {
            0 => {
                let g = grans[rng.below(grans.len() as u64) as usize];
                let disabled = rng.below(4) == 0;
                let gs = g.to_string();
                let mut args = vec![name, "--granularity", gs.as_str()];
                if disabled {
                    args.push("--disabled");
                }
                if at.is_some() {
                    assert!(refused(&sock, "bitmap-add", &args).contains("exists"));
                } else {
                    ctl_ok(&sock, "bitmap-add", &args);
                    model.push(Model {
                        name: name.into(),
                        g,
                        recording: !disabled,
                        granules: BTreeSet::new(),
                    });
                }
            }
            1 => match at {
                Some(i) => {
                    ctl_ok(&sock, "bitmap-remove", &[name]);
                    model.remove(i);
                }
                None => {
                    refused(&sock, "bitmap-remove", &[name]);
                }
            },
            2 => match at {
                Some(i) => {
                    ctl_ok(&sock, "bitmap-clear", &[name]);
                    model[i].granules.clear();
                }
                None => {
                    refused(&sock, "bitmap-clear", &[name]);
                }
            },
            3 => {
                let on = rng.below(2) == 0;
                let m = if on {
                    "bitmap-enable"
                } else {
                    "bitmap-disable"
                };
                match at {
                    Some(i) => {
                        ctl_ok(&sock, m, &[name]);
                        model[i].recording = on;
                    }
                    None => {
                        refused(&sock, m, &[name]);
                    }
                }
            }
            4 => {
                let src = names[rng.below(names.len() as u64) as usize];
                let si = model.iter().position(|m| m.name == src);
                let args = ["--target", name, src];
                match (at, si) {
                    (Some(t), Some(s)) if model[t].g == model[s].g => {
                        ctl_ok(&sock, "bitmap-merge", &args);
                        let add: Vec<u64> = model[s].granules.iter().copied().collect();
                        model[t].granules.extend(add);
                    }
                    (Some(_), Some(_)) => {
                        assert!(refused(&sock, "bitmap-merge", &args).contains("same granularity"));
                    }
                    _ => {
                        assert!(refused(&sock, "bitmap-merge", &args).contains("no bitmap"));
                    }
                }
            }
            _ => {
                // A write of 512 bytes to 256 KiB somewhere, on either queue.
                let len = 512 * rng.range(1, 512);
                let offset = 512 * rng.below((size - len) / 512 + 1);
                let q = rng.below(2) as usize;
                assert_eq!(c.write_at(q, offset, &vec![step as u8; len as usize]), 0);
                for m in model.iter_mut().filter(|m| m.recording) {
                    m.granules.extend(granules_of(offset, len, m.g));
                }
            }
        }
        let list = ctl_ok(&sock, "bitmap-list", &[]);
        let got = list["bitmaps"].as_array().unwrap();
        assert_eq!(got.len(), model.len(), "step {step}: {list}");
        for (g, m) in got.iter().zip(&model) {
            assert_eq!(g["name"], m.name.as_str());
            assert_eq!(g["granularity"], m.g);
            assert_eq!(g["recording"], m.recording, "step {step}: {g}");
            let want = granule_extents(&m.granules, m.g, size);
            assert_eq!(
                g["dirty_bytes"],
                want.iter().map(|e| e.1).sum::<u64>(),
                "step {step}: {}",
                m.name
            );
            if step % 8 == 0 {
                assert_eq!(extents(&sock, &m.name), want, "step {step}: {}", m.name);
            }
        }
    }
    drop(c);
    assert!(backend.sigterm_and_wait(STOP).success());
}

/// `--bitmap NAME[:GRANULARITY]` starts with bitmaps that record from the first request; bad
/// ones are refused with the options (exit status 2).
#[test]
fn bitmaps_given_at_start_record_from_the_first_request() {
    if skip_unless_vublk("vublk's dirty bitmaps") {
        return;
    }
    let dir = TestDir::new("bitmaps-option");
    let img = dir.join("img.raw");
    create_pattern_image(&img, 16 * MIB, 8);
    for (arg, says) in [
        ("a:1000", "power of two"),
        ("a:big", "GRANULARITY"),
        (":64K", "1 to 1023 bytes"),
    ] {
        let o = std::process::Command::new(env!("CARGO_BIN_EXE_vublk"))
            .args(["--socket-path"])
            .arg(dir.join("never.sock"))
            .arg("--blk-file")
            .arg(&img)
            .args(["--bitmap", arg])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "--bitmap {arg}: {err}");
        assert!(
            err.contains("--bitmap") && err.contains(says),
            "--bitmap {arg}: {err}"
        );
    }
    let (backend, sock) = start(&dir, &img, 1, &["--bitmap", "b0", "--bitmap", "fine:4K"]);
    let mut c = connect_queues(&backend.socket, 1);
    assert_eq!(c.write_at(0, 3 * MIB, &[5u8; 512]), 0);
    assert_eq!(extents(&sock, "b0"), [(3 * MIB, 64 << 10)]);
    assert_eq!(extents(&sock, "fine"), [(3 * MIB, 4096)]);
    drop(c);
    assert!(backend.sigterm_and_wait(STOP).success());
}

/// QEMU's persistent bitmaps, read: `qemu-img bitmap` adds them, `qemu-io` dirties them
/// (QEMU writes them back at close), and vublk's reader finds the same names, granularities,
/// flags and dirty ranges.
#[test]
fn qemu_persistent_bitmaps_are_read_as_qemu_wrote_them() {
    use vublk::image::qcow2::{bitmaps, header};
    if !have_qemu_img() {
        skip_or_fail::<()>("qemu-img is not installed");
        return;
    }
    let dir = TestDir::new("bitmaps-qemu-read");
    let img = dir.join("img.qcow2");
    qemu_img_create(&img, "qcow2", "64M");
    for (name, extra) in [
        ("b0", vec![]),
        ("fine", vec!["--granularity", "4096"]),
        ("off", vec!["--disable"]),
    ] {
        let mut c = std::process::Command::new("qemu-img");
        c.args(["bitmap", "--add"]).args(&extra).arg(&img).arg(name);
        run_ok(&mut c);
    }
    run_ok(
        std::process::Command::new("qemu-io")
            .args([
                "-f",
                "qcow2",
                "-c",
                "write 1M 64k",
                "-c",
                "write 10M 4k",
                "-c",
                "write 63M 1M",
            ])
            .arg(&img),
    );
    let f = std::fs::File::open(&img).unwrap();
    let file_size = f.metadata().unwrap().len();
    let first = read_file_range(&img, 0, 65536);
    let h = header::Header::parse(&first).unwrap();
    let cluster = 1u64 << h.cluster_bits;
    let ext =
        bitmaps::parse_extension(h.extension_data(&first, header::EXT_BITMAPS).unwrap()).unwrap();
    assert_eq!(ext.count, 3);
    let entries = bitmaps::read_directory(&f, &ext, h.size_bytes, cluster, file_size).unwrap();
    let names: Vec<&str> = entries.iter().map(|e| e.name.as_str()).collect();
    assert_eq!(names, ["b0", "fine", "off"]);
    assert!(entries.iter().all(|e| !e.in_use && !e.unusable));
    assert_eq!(
        entries.iter().map(|e| e.auto).collect::<Vec<_>>(),
        [true, true, false]
    );
    let k64 = 64 << 10;
    let want: [&[(u64, u64)]; 3] = [
        &[(MIB, k64), (10 * MIB, k64), (63 * MIB, MIB)],
        &[(MIB, k64), (10 * MIB, 4096), (63 * MIB, MIB)],
        &[],
    ];
    for (e, want) in entries.iter().zip(want) {
        let b = bitmaps::load(&f, e, h.size_bytes, cluster, file_size).unwrap();
        assert_eq!(b.dirty_extents(0, 100).0, want, "{}", e.name);
    }
    // A hostile directory: every truncation and many byte flips are refused or read, never
    // a panic.
    let dir_bytes = read_file_range(&img, ext.directory_offset, ext.directory_size as usize);
    for n in 0..dir_bytes.len() {
        let _ =
            bitmaps::parse_directory(&dir_bytes[..n], ext.count, h.size_bytes, cluster, file_size);
    }
    let mut rng = Rng::new(30);
    for _ in 0..2000 {
        let mut d = dir_bytes.clone();
        let i = rng.below(d.len() as u64) as usize;
        d[i] = rng.next_u64() as u8;
        let _ = bitmaps::parse_directory(&d, ext.count, h.size_bytes, cluster, file_size);
    }
}
