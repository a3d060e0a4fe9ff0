//! Persistent dirty bitmaps in qcow2 files (docs/changed-block-tracking.md, "Persistence"),
//! checked with QEMU's own tools: bitmaps qemu-img made are loaded with their bits, gain
//! every write vublk serves and stay valid (never "in use") in the file, also after a
//! SIGKILL; `qemu-nbd -B` with `nbdinfo --map=qemu:dirty-bitmap:NAME` reads exactly the
//! written granules; the control methods on persistent bitmaps reach the file, and an online
//! resize grows them there.

mod common;

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;

use common::*;
use serde_json::Value;

const K64: u64 = 64 << 10;

fn have_tools() -> bool {
    if skip_unless_vublk("vublk's persistent bitmaps") || !have_qemu_img() {
        return false;
    }
    for (tool, pkg) in [("nbdinfo", "libnbd-bin"), ("qemu-nbd", "qemu-utils")] {
        let found = Command::new("sh")
            .args(["-c", &format!("command -v {tool}")])
            .output()
            .is_ok_and(|o| o.status.success());
        if !found {
            skip_or_fail::<()>(&format!("{tool} is not installed (apt-get install {pkg})"));
            return false;
        }
    }
    true
}

/// The bitmaps `qemu-img info` lists: (name, flags, granularity).
fn qemu_bitmaps(img: &Path) -> Vec<(String, Vec<String>, u64)> {
    let out = run_ok(
        Command::new("qemu-img")
            .args(["info", "--output=json"])
            .arg(img),
    );
    let v: Value = serde_json::from_str(&out).unwrap();
    let Some(list) = v["format-specific"]["data"]["bitmaps"].as_array() else {
        return Vec::new();
    };
    list.iter()
        .map(|b| {
            (
                b["name"].as_str().unwrap().to_owned(),
                b["flags"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|f| f.as_str().unwrap().to_owned())
                    .collect(),
                b["granularity"].as_u64().unwrap(),
            )
        })
        .collect()
}

/// Extents of the granules (of `g` bytes) that the ranges touch.
fn expected(ranges: &[(u64, u64)], g: u64) -> Vec<(u64, u64)> {
    let granules: BTreeSet<u64> = ranges
        .iter()
        .flat_map(|&(o, l)| (o / g)..=((o + l - 1) / g))
        .collect();
    let mut out: Vec<(u64, u64)> = Vec::new();
    for i in granules {
        match out.last_mut() {
            Some(l) if l.0 + l.1 == i * g => l.1 += g,
            _ => out.push((i * g, g)),
        }
    }
    out
}

/// The granules (of `g` bytes) of extents.
fn granules_in(extents: &[(u64, u64)], g: u64) -> BTreeSet<u64> {
    extents
        .iter()
        .flat_map(|&(o, l)| (o / g)..(o + l).div_ceil(g))
        .collect()
}

fn bitmap_add(img: &Path, name: &str, extra: &[&str]) {
    run_ok(
        Command::new("qemu-img")
            .args(["bitmap", "--add"])
            .args(extra)
            .arg(img)
            .arg(name),
    );
}

fn qemu_io_write(img: &Path, writes: &[(u64, u64)]) {
    let mut c = Command::new("qemu-io");
    c.args(["-f", "qcow2"]);
    for (o, l) in writes {
        c.args(["-c", &format!("write {o} {l}")]);
    }
    run_ok(c.arg(img));
}

/// (name -> (persistent, recording, inconsistent, dirty bytes)) from `bitmap-list`.
fn listed(sock: &Path) -> Vec<(String, bool, bool, bool, u64)> {
    let v = ctl_ok(sock, "bitmap-list", &[]);
    v["bitmaps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| {
            (
                b["name"].as_str().unwrap().to_owned(),
                b["persistent"].as_bool().unwrap(),
                b["recording"].as_bool().unwrap(),
                b["inconsistent"].as_bool().unwrap(),
                b["dirty_bytes"].as_u64().unwrap(),
            )
        })
        .collect()
}

/// QEMU's bitmaps are loaded with QEMU's bits (the same dirty bytes in `bitmap-list`), gain
/// exactly the granules vublk's writes touch, and are valid (not in use) after a clean stop:
/// qemu-nbd reads them as expected and `qemu-img check` is clean.
#[test]
fn qemu_bitmaps_gain_vublk_writes_and_stay_valid() {
    if !have_tools() {
        return;
    }
    let dir = TestDir::new("bitmaps-qcow2-qemu");
    let img = dir.join("img.qcow2");
    qemu_img_create(&img, "qcow2", "64M");
    bitmap_add(&img, "b0", &[]);
    bitmap_add(&img, "fine", &["--granularity", "4096"]);
    bitmap_add(&img, "off", &["--disable"]);
    let by_qemu = [(MIB, 65536), (10 * MIB, 4096)];
    qemu_io_write(&img, &by_qemu);

    let (backend, sock) = start_with_control(&dir, &img, 2, &[]);
    let l = listed(&sock);
    assert_eq!(
        l,
        [
            ("b0".to_owned(), true, true, false, 2 * K64),
            ("fine".to_owned(), true, true, false, K64 + 4096),
            ("off".to_owned(), true, false, false, 0),
        ],
        "QEMU's bitmaps as vublk loaded them"
    );
    let mut c = connect_queues(&backend.socket, 2);
    let by_vublk = [
        (20 * MIB, 4096),
        (30 * MIB + 3 * K64 - 512, 1024),
        (63 * MIB, MIB),
    ];
    for (i, &(o, l)) in by_vublk.iter().enumerate() {
        assert_eq!(c.write_at(i % 2, o, &vec![0x77u8; l as usize]), 0);
    }
    let all: Vec<(u64, u64)> = by_qemu.iter().chain(&by_vublk).copied().collect();
    disconnect_and_stop(&backend, c);

    assert_eq!(
        qemu_bitmaps(&img),
        [
            ("b0".to_owned(), vec!["auto".to_owned()], K64),
            ("fine".to_owned(), vec!["auto".to_owned()], 4096),
            ("off".to_owned(), vec![], K64),
        ],
        "qemu-img info: the bitmaps, none in use"
    );
    assert_eq!(nbd_dirty_map(&img, "b0"), expected(&all, K64));
    assert_eq!(nbd_dirty_map(&img, "fine"), expected(&all, 4096));
    assert_eq!(nbd_dirty_map(&img, "off"), []);
    run_ok(Command::new("qemu-img").args(["check", "-q"]).arg(&img));
    let b = std::fs::read(&img).unwrap();
    assert_eq!(b[95] & 1, 1, "the bitmaps autoclear bit is set");
}

/// add, merge, clear, disable and remove on persistent bitmaps, and an online resize, reach
/// the file: after the stop QEMU sees exactly the bitmaps left, with their flags and bits;
/// a memory-only bitmap is not there. A restarted vublk lists the same.
#[test]
fn control_methods_and_resize_on_persistent_bitmaps_reach_the_file() {
    if !have_tools() {
        return;
    }
    let dir = TestDir::new("bitmaps-qcow2-methods");
    let img = dir.join("img.qcow2");
    qemu_img_create(&img, "qcow2", "64M");
    let (backend, sock) = start_with_control(&dir, &img, 1, &[]);
    ctl_ok(
        &sock,
        "bitmap-add",
        &["p1", "--persistent", "--granularity", "4096"],
    );
    ctl_ok(&sock, "bitmap-add", &["p2", "--persistent", "--disabled"]);
    ctl_ok(&sock, "bitmap-add", &["gone", "--persistent"]);
    ctl_ok(&sock, "bitmap-add", &["mem"]);
    ctl_ok(
        &sock,
        "bitmap-add",
        &["p3", "--persistent", "--granularity", "4096", "--disabled"],
    );
    let mut c = connect_queues(&backend.socket, 1);
    assert_eq!(c.write_at(0, MIB, &[1u8; 4096]), 0);
    ctl_ok(&sock, "bitmap-remove", &["gone"]);
    ctl_ok(&sock, "bitmap-merge", &["--target", "p3", "p1"]);
    ctl_ok(&sock, "bitmap-clear", &["p1"]);
    assert_eq!(c.write_at(0, 2 * MIB, &[2u8; 4096]), 0);
    ctl_ok(&sock, "resize", &["128M"]);
    assert_eq!(c.write_at(0, 100 * MIB, &[3u8; 4096]), 0);
    disconnect_and_stop(&backend, c);

    assert_virtual_size(&img, 128 * MIB);
    assert_eq!(
        qemu_bitmaps(&img),
        [
            ("p1".to_owned(), vec!["auto".to_owned()], 4096),
            ("p2".to_owned(), vec![], K64),
            ("p3".to_owned(), vec![], 4096),
        ],
    );
    assert_eq!(
        nbd_dirty_map(&img, "p1"),
        [(2 * MIB, 4096), (100 * MIB, 4096)]
    );
    assert_eq!(nbd_dirty_map(&img, "p2"), []);
    assert_eq!(nbd_dirty_map(&img, "p3"), [(MIB, 4096)]);
    run_ok(Command::new("qemu-img").args(["check", "-q"]).arg(&img));

    let (backend, sock) = start_with_control(&dir, &img, 1, &[]);
    assert_eq!(
        listed(&sock),
        [
            ("p1".to_owned(), true, true, false, 8192),
            ("p2".to_owned(), true, false, false, 0),
            ("p3".to_owned(), true, false, false, 4096),
        ]
    );
    assert_eq!(backend.sigterm_and_wait(EXIT_DEADLINE).code(), Some(0));
}

/// SIGKILL during writes: the bitmaps in the file are valid (not in use) and cover every
/// write the client saw complete, granule for granule, and nothing nobody wrote.
#[test]
fn a_sigkilled_vublk_leaves_valid_bitmaps_covering_every_completed_write() {
    if !have_tools() {
        return;
    }
    let dir = TestDir::new("bitmaps-qcow2-kill");
    let img = dir.join("img.qcow2");
    qemu_img_create(&img, "qcow2", "256M");
    bitmap_add(&img, "b0", &["--granularity", "4096"]);
    bitmap_add(&img, "coarse", &[]);
    let mut rng = Rng::new(35);
    let mut done: Vec<(u64, u64)> = Vec::new();
    // Writes not seen complete: they may have landed, or not.
    let mut unseen: Vec<(u64, u64)> = Vec::new();
    for round in 0..3 {
        let backend = Backend::start(
            &dir,
            &img,
            &BackendOpts {
                num_queues: Some(2),
                ..BackendOpts::default()
            },
        );
        let mut c = connect_queues(&backend.socket, 2);
        for i in 0..40 {
            let len = 512 * (1 + rng.below(64));
            let off = rng.below(256 * MIB - len) / 512 * 512;
            assert_eq!(c.write_at(i % 2, off, &vec![round as u8; len as usize]), 0);
            done.push((off, len));
        }
        // Then 64 writes at once, and the kill once half of them are seen complete: the
        // rest may be in flight, half-published or done unseen (in the bitmap or not).
        let (mut queues, mem) = c.take_queues();
        let q = &mut queues[0];
        let ranges: Vec<(u64, u64)> = (0..64)
            .map(|_| {
                let len = 4096 * (1 + rng.below(16));
                (rng.below(256 * MIB - len) / 4096 * 4096, len)
            })
            .collect();
        for (i, &(off, len)) in ranges.iter().enumerate() {
            let at = (mem.addr) as *mut u8;
            q.write(off, at, len as usize, i, blkio::ReqFlags::empty());
        }
        let mut seen = 0;
        let mut comps: Vec<std::mem::MaybeUninit<blkio::Completion>> = Vec::new();
        comps.resize_with(64, std::mem::MaybeUninit::uninit);
        while seen < 32 {
            let mut t = std::time::Duration::from_secs(10);
            let n = q.do_io(&mut comps, 1, Some(&mut t), None).unwrap();
            assert!(n > 0, "no completion in 10 s");
            for c in &comps[..n] {
                // SAFETY: do_io initialised the first `n` completions.
                let c = unsafe { c.assume_init_ref() };
                assert_eq!(c.ret, 0);
                done.push(ranges[c.user_data]);
            }
            seen += n;
        }
        backend.signal(libc::SIGKILL);
        let _ = backend.wait_exit(EXIT_DEADLINE);
        drop(queues);
        drop(c);
        assert_eq!(
            qemu_bitmaps(&img)
                .iter()
                .map(|b| b.1.clone())
                .collect::<Vec<_>>(),
            [vec!["auto".to_owned()], vec!["auto".to_owned()]],
            "round {round}: a bitmap is in use after SIGKILL"
        );
        assert_check_allows_leaks(&img, "qcow2", &format!("round {round}: after SIGKILL"));
        // Every granule a write seen complete touched is there; the others only where a
        // write the client did not see complete went.
        unseen.extend(&ranges);
        let all: Vec<(u64, u64)> = done.iter().chain(&unseen).copied().collect();
        for (name, g) in [("b0", 4096), ("coarse", K64)] {
            let got = granules_in(&nbd_dirty_map(&img, name), g);
            let must = granules_in(&expected(&done, g), g);
            let may = granules_in(&expected(&all, g), g);
            assert!(
                must.is_subset(&got),
                "round {round}: {name} lacks a completed write"
            );
            assert!(
                got.is_subset(&may),
                "round {round}: {name} has granules nobody wrote"
            );
        }
    }
}

/// Bitmaps QEMU left in use (qemu-nbd serving the image read-write, SIGKILLed: they stay
/// "in use" and QEMU clears the autoclear bit) are listed as inconsistent, record nothing,
/// refuse every method but `bitmap-remove`, and stay in use in the file (never written back
/// as valid) beside a new valid one; a removed one is gone from the file.
#[test]
fn bitmaps_qemu_left_in_use_are_inconsistent_until_removed() {
    if !have_tools() {
        return;
    }
    let dir = TestDir::new("bitmaps-qcow2-in-use");
    let img = dir.join("img.qcow2");
    qemu_img_create(&img, "qcow2", "64M");
    bitmap_add(&img, "stale", &[]);
    bitmap_add(&img, "gone", &[]);
    // QEMU marks its bitmaps in use while it has the image open read-write; killed, it
    // leaves them so. (Its start-up may pass through states where they are not: the kill
    // is repeated until the file, read after it, has both in use.)
    let sock = dir.join("nbd.sock");
    // How many of the image's bitmaps `qemu-img info` shows in use (`force`: -U, beside
    // the qemu-nbd that holds it).
    let in_use = |force: bool| {
        let mut c = Command::new("qemu-img");
        c.arg("info");
        if force {
            c.arg("-U");
        }
        let o = c.args(["--output=json"]).arg(&img).output().unwrap();
        let v: Value = serde_json::from_slice(&o.stdout).unwrap_or(Value::Null);
        v["format-specific"]["data"]["bitmaps"]
            .as_array()
            .map_or(0, |l| {
                l.iter()
                    .filter(|b| b["flags"].to_string().contains("in-use"))
                    .count()
            })
    };
    for attempt in 0.. {
        assert!(attempt < 10, "qemu-nbd never left both bitmaps in use");
        let mut nbd = std::process::Command::new("qemu-nbd")
            .args(["-f", "qcow2", "--socket"])
            .arg(&sock)
            .arg(&img)
            .spawn()
            .unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while in_use(true) < 2 && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        // SAFETY: kill on the pid of a child this test started and has not reaped.
        unsafe { libc::kill(nbd.id() as libc::pid_t, libc::SIGKILL) };
        nbd.wait().unwrap();
        let _ = std::fs::remove_file(&sock);
        if in_use(false) == 2 {
            break;
        }
    }

    let (backend, ctl_sock) = start_with_control(&dir, &img, 1, &[]);
    assert_eq!(
        listed(&ctl_sock),
        [
            ("stale".to_owned(), true, false, true, 0),
            ("gone".to_owned(), true, false, true, 0),
        ]
    );
    ctl_ok(&ctl_sock, "bitmap-add", &["fresh", "--persistent"]);
    let mut c = connect_queues(&backend.socket, 1);
    assert_eq!(c.write_at(0, 5 * MIB, &[9u8; 4096]), 0);
    for (m, args) in [
        ("bitmap-clear", vec!["stale"]),
        ("bitmap-enable", vec!["stale"]),
        ("bitmap-ranges", vec!["stale"]),
        ("bitmap-merge", vec!["--target", "fresh", "stale"]),
    ] {
        let (ok, _, err) = ctl(&ctl_sock, m, &args);
        assert!(!ok && err.contains("inconsistent"), "{m}: {err}");
    }
    assert_eq!(
        listed(&ctl_sock)[0].4,
        0,
        "the stale bitmap recorded a write"
    );
    ctl_ok(&ctl_sock, "bitmap-remove", &["gone"]);
    drop(c);
    assert_eq!(backend.sigterm_and_wait(EXIT_DEADLINE).code(), Some(0));
    let got: Vec<(String, Vec<String>)> =
        qemu_bitmaps(&img).into_iter().map(|b| (b.0, b.1)).collect();
    assert_eq!(
        got,
        [
            (
                "stale".to_owned(),
                vec!["in-use".to_owned(), "auto".to_owned()]
            ),
            ("fresh".to_owned(), vec!["auto".to_owned()]),
        ],
        "the stale bitmap stays in use in the file, the new one is valid"
    );
    assert_eq!(nbd_dirty_map(&img, "fresh"), [(5 * MIB, K64)]);
    run_ok(Command::new("qemu-img").args(["check", "-q"]).arg(&img));
}

/// The header is rewritten when the first bitmap comes and the last one goes: the other
/// extensions (the backing format) and the backing file name survive both, and the autoclear
/// bit follows the extension.
#[test]
fn an_overlay_keeps_its_backing_file_as_bitmaps_come_and_go() {
    if !have_tools() {
        return;
    }
    let dir = TestDir::new("bitmaps-qcow2-overlay");
    let base = dir.join("base.raw");
    create_sparse_image(&base, 64 * MIB);
    let img = dir.join("overlay.qcow2");
    run_ok(
        Command::new("qemu-img")
            .args(["create", "-q", "-f", "qcow2", "-F", "raw", "-b"])
            .arg(&base)
            .arg(&img),
    );
    let backing = |img: &Path| {
        let v: Value = serde_json::from_str(&run_ok(
            Command::new("qemu-img")
                .args(["info", "--output=json"])
                .arg(img),
        ))
        .unwrap();
        (
            v["backing-filename"].as_str().unwrap_or("").to_owned(),
            v["backing-filename-format"]
                .as_str()
                .unwrap_or("")
                .to_owned(),
        )
    };
    let want = (base.display().to_string(), "raw".to_owned());
    assert_eq!(backing(&img), want);
    let autoclear = |p: &Path| std::fs::read(p).unwrap()[95] & 1;
    for (round, add) in [(0, true), (1, false)] {
        let (backend, sock) = start_with_control(&dir, &img, 1, &[]);
        if add {
            ctl_ok(&sock, "bitmap-add", &["p", "--persistent"]);
            let mut c = connect_queues(&backend.socket, 1);
            assert_eq!(c.write_at(0, 3 * MIB, &[4u8; 4096]), 0);
            drop(c);
        } else {
            ctl_ok(&sock, "bitmap-remove", &["p"]);
        }
        assert_eq!(backend.sigterm_and_wait(EXIT_DEADLINE).code(), Some(0));
        assert_eq!(backing(&img), want, "round {round}");
        run_ok(Command::new("qemu-img").args(["check", "-q"]).arg(&img));
        if add {
            assert_eq!(autoclear(&img), 1);
            assert_eq!(nbd_dirty_map(&img, "p"), [(3 * MIB, K64)]);
        } else {
            assert_eq!(autoclear(&img), 0);
            assert!(qemu_bitmaps(&img).is_empty());
        }
    }
}

/// `--persistent-bitmap`: added to the file at the first start, kept (with its bits) at the
/// next; refused where bitmaps live in memory only.
#[test]
fn persistent_bitmap_option_adds_once_and_keeps() {
    if !have_tools() {
        return;
    }
    let dir = TestDir::new("bitmaps-qcow2-option");
    let img = dir.join("img.qcow2");
    qemu_img_create(&img, "qcow2", "64M");
    for (round, at) in [(0u64, MIB), (1, 7 * MIB)] {
        let (backend, sock) =
            start_with_control(&dir, &img, 1, &["--persistent-bitmap", "b9:4096"]);
        let mut c = connect_queues(&backend.socket, 1);
        assert_eq!(c.write_at(0, at, &[5u8; 4096]), 0);
        drop(c);
        assert_eq!(
            listed(&sock)[0],
            ("b9".to_owned(), true, true, false, 4096 * (round + 1))
        );
        assert_eq!(backend.sigterm_and_wait(EXIT_DEADLINE).code(), Some(0));
    }
    assert_eq!(nbd_dirty_map(&img, "b9"), [(MIB, 4096), (7 * MIB, 4096)]);
    let raw = dir.join("img.raw");
    create_sparse_image(&raw, 64 * MIB);
    let (code, log) = vublk_refuses(&dir, &raw, &["--persistent-bitmap", "b9"]);
    assert_eq!(code, Some(2), "{log}");
    assert!(log.contains("memory only"), "{log}");
}
