//! Backups of a running disk (docs/backups.md): `backup-begin` between two guest requests,
//! the point-in-time view over NBD read with stock tools (nbdcopy, qemu-img convert,
//! nbdinfo) while a libblkio writer keeps writing, incremental backups from the export's
//! `qemu:dirty-bitmap:`, `base:allocation` against `qemu-img map`, a scratch that fills, and
//! hostile NBD clients.

mod common;

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::*;
use serde_json::Value;

const STOP: Duration = Duration::from_secs(10);
const SIZE: u64 = 32 * MIB;

fn have_tools() -> bool {
    ["nbdcopy", "nbdinfo", "qemu-img"].iter().all(|t| {
        Command::new(t)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
    })
}

/// Skip (saying why) unless vublk and the NBD tools are here.
fn skip(what: &str) -> bool {
    if skip_unless_vublk(what) {
        return true;
    }
    if !have_tools() {
        return skip_or_fail::<()>("nbdcopy, nbdinfo or qemu-img missing (libnbd-bin, qemu-utils)")
            .is_none();
    }
    false
}

fn write_file(path: &Path, data: &[u8]) {
    std::fs::write(path, data).unwrap();
}

/// `qemu-img compare` of two raw files: identical.
fn assert_compare(a: &Path, b: &Path) {
    let o = Command::new("qemu-img")
        .args(["compare", "-f", "raw", "-F", "raw"])
        .args([a, b])
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "qemu-img compare {} {}: {}{}",
        a.display(),
        b.display(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
}

/// `nbdinfo --map=CONTEXT URI`: (offset, length, type) per line.
fn nbd_map(uri: &str, context: &str) -> Vec<(u64, u64, u32)> {
    let out = run_ok(
        Command::new("nbdinfo")
            .arg(format!("--map={context}"))
            .arg(uri),
    );
    out.lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            Some((
                f.first()?.parse().ok()?,
                f.get(1)?.parse().ok()?,
                f.get(2)?.parse().ok()?,
            ))
        })
        .collect()
}

/// A full backup of a disk under a writer: the export equals the disk at the begin, read
/// while the writer goes on.
fn full_backup_under_writes(name: &str, img: &Path, fmt_args: &[&str], tool: &str) {
    let dir = TestDir::new(&format!("backup-full-{name}"));
    let (backend, sock) = start_with_control(&dir, img, 2, fmt_args);
    let writer = Writer::start(connect_queues(&backend.socket, 2), 7);
    writer.run_for(200);
    let nbd = dir.join("nbd.sock");
    let nbd_s = nbd.display().to_string();
    let (reference, uri) = writer.paused(|c| {
        let r = c.read_all(1);
        let uri = backup_begin(&sock, &["--checkpoint", "c1", "--socket", &nbd_s]);
        (r, uri)
    });
    assert!(uri.starts_with("nbd+unix:///c1?socket="), "{uri}");
    // The writer changes the disk while the export is read.
    writer.run_for(300);
    let refp = dir.join("ref.raw");
    write_file(&refp, &reference);
    let out = dir.join("backup.raw");
    if tool == "nbdcopy" {
        nbdcopy_ok(&uri, &out);
    } else {
        run_ok(
            Command::new("qemu-img")
                .args(["convert", "-f", "raw", "-O", "raw", &uri])
                .arg(&out),
        );
    }
    assert_compare(&out, &refp);
    let list = ctl_ok(&sock, "backup-list", &[]);
    let b = &list["backups"][0];
    assert_eq!(b["checkpoint"], "c1");
    assert!(b["bytes_read"].as_u64().unwrap() >= SIZE, "{list}");
    assert!(b["copied_bytes"].as_u64().unwrap() > 0, "{list}");
    assert!(b["failed"].is_null(), "{list}");
    let end = ctl_ok(&sock, "backup-end", &["--checkpoint", "c1"]);
    assert_eq!(end["checkpoint"], "c1");
    // The checkpoint stays, recording.
    let bl = ctl_ok(&sock, "bitmap-list", &[]);
    assert_eq!(bl["bitmaps"][0]["name"], "c1", "{bl}");
    assert_eq!(bl["bitmaps"][0]["recording"], true, "{bl}");
    let c = writer.stop();
    drop(c);
    assert!(
        !nbd.exists(),
        "the export's socket is removed at backup-end"
    );
    backend.sigterm_and_wait(STOP);
}

#[test]
fn a_full_backup_of_a_raw_disk_is_its_state_at_the_begin() {
    if skip("backups") {
        return;
    }
    let dir = TestDir::new("backup-raw");
    let img = dir.join("img.raw");
    create_pattern_image(&img, SIZE, 5);
    full_backup_under_writes("raw", &img, &[], "nbdcopy");
}

#[test]
fn a_full_backup_of_a_qcow2_overlay_is_its_state_at_the_begin() {
    if skip("backups") {
        return;
    }
    let dir = TestDir::new("backup-qcow2");
    let base = dir.join("base.raw");
    create_pattern_image(&base, SIZE, 9);
    let img = dir.join("top.qcow2");
    run_ok(
        Command::new("qemu-img")
            .args(["create", "-f", "qcow2", "-F", "raw", "-b"])
            .arg(&base)
            .arg(&img),
    );
    full_backup_under_writes("qcow2", &img, &[], "qemu-img");
}

#[test]
fn a_full_backup_of_a_parallels_disk_is_its_state_at_the_begin() {
    if skip("backups") {
        return;
    }
    let dir = TestDir::new("backup-parallels");
    let img = dir.join("img.parallels");
    run_ok(
        Command::new("qemu-img")
            .args(["create", "-q", "-f", "parallels"])
            .arg(&img)
            .arg(SIZE.to_string()),
    );
    full_backup_under_writes("parallels", &img, &[], "nbdcopy");
}

/// qemu-nbd serving a raw file to several clients, stopped (by PID) when dropped.
struct QemuNbd(std::process::Child);

impl Drop for QemuNbd {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn a_full_backup_of_an_nbd_disk_is_its_state_at_the_begin() {
    if skip("backups") {
        return;
    }
    let dir = TestDir::new("backup-nbd-disk");
    let file = dir.join("export.raw");
    create_pattern_image(&file, SIZE, 21);
    let sock = dir.join("qemu-nbd.sock");
    let _server = QemuNbd(
        Command::new("qemu-nbd")
            .arg("--socket")
            .arg(&sock)
            .args(["--export-name", "disk", "--format", "raw", "--persistent"])
            .args(["--shared", "16", "--cache", "none"])
            .arg(&file)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    let t0 = std::time::Instant::now();
    while !sock.exists() {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "qemu-nbd did not listen"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // vublk serves the export; the backup reads it through connections of its own.
    let uri = format!("nbd+unix:///disk?socket={}", sock.display());
    full_backup_under_writes("nbd", Path::new(&uri), &[], "nbdcopy");
}

/// The granules of the writes in `log`.
fn granules(log: &[(u64, u64)], g: u64) -> BTreeSet<u64> {
    log.iter()
        .flat_map(|&(o, l)| (o / g)..=((o + l - 1) / g))
        .collect()
}

#[test]
fn incremental_backups_over_five_checkpoints_miss_no_write_and_add_none() {
    if skip("backups") {
        return;
    }
    let dir = TestDir::new("backup-incr");
    let img = dir.join("img.qcow2");
    qemu_img_create(&img, "qcow2", &SIZE.to_string());
    let (backend, sock) = start_with_control(&dir, &img, 2, &[]);
    let writer = Writer::start(connect_queues(&backend.socket, 2), 11);
    writer.run_for(100);
    let g = 64 << 10;
    // Full backup at c1.
    let nbd = dir.join("nbd.sock");
    let nbd_s = nbd.display().to_string();
    let (reference, uri) = writer.paused(|c| {
        let r = c.read_all(1);
        let uri = backup_begin(&sock, &["--checkpoint", "c1", "--socket", &nbd_s]);
        writer.take_log();
        (r, uri)
    });
    let mut copy = dir.join("copy.raw");
    let o = nbdcopy(&uri, &copy);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    write_file(&dir.join("ref1.raw"), &reference);
    assert_compare(&copy, &dir.join("ref1.raw"));
    ctl_ok(&sock, "backup-end", &["--checkpoint", "c1"]);
    for i in 2..=5 {
        writer.run_for(150);
        let (prev, cur) = (format!("c{}", i - 1), format!("c{i}"));
        let (reference, uri, written) = writer.paused(|c| {
            let r = c.read_all(1);
            let uri = backup_begin(
                &sock,
                &[
                    "--checkpoint",
                    &cur,
                    "--incremental",
                    &prev,
                    "--socket",
                    &nbd_s,
                ],
            );
            (r, uri, writer.take_log())
        });
        writer.run_for(100);
        // What changed between prev's view and this one, by the export's bitmap.
        let map = nbd_map(&uri, &format!("qemu:dirty-bitmap:{prev}"));
        assert_eq!(map.iter().map(|e| e.1).sum::<u64>(), SIZE, "{map:?}");
        let dirty: Vec<(u64, u64)> = map
            .iter()
            .filter(|e| e.2 & 1 != 0)
            .map(|e| (e.0, e.1))
            .collect();
        // Apply only those extents, read from the export, to a copy of the previous backup,
        // with the shell loop of docs/backups.md (nbdinfo, nbdkit's offset filter, nbdcopy,
        // dd).
        let next = dir.join(&format!("copy{i}.raw"));
        std::fs::copy(&copy, &next).unwrap();
        let script = format!(
            r#"set -e
URI='{uri}'
nbdinfo --map=qemu:dirty-bitmap:{prev} "$URI" | while read -r off len flags desc; do
  [ "$desc" = dirty ] || continue
  nbdkit -U - --filter=offset nbd socket='{sock}' export={cur} offset=$off range=$len \
      --run 'nbdcopy "$uri" -' |
    dd of='{out}' bs=64K iflag=fullblock seek=$off oflag=seek_bytes conv=notrunc status=none
done"#,
            sock = nbd.display(),
            out = next.display(),
        );
        run_ok(Command::new("sh").arg("-c").arg(&script));
        let refp = dir.join(&format!("ref{i}.raw"));
        write_file(&refp, &reference);
        // No missed write: the copy equals the disk at the begin.
        assert_compare(&next, &refp);
        // No extent outside what was written, at the granularity.
        let want = granules(&written, g);
        let got = granules(&dirty, g);
        assert_eq!(
            got, want,
            "checkpoint {prev}: dirty granules differ from those written"
        );
        ctl_ok(&sock, "backup-end", &["--checkpoint", &cur]);
        copy = next;
    }
    writer.stop();
    backend.sigterm_and_wait(STOP);
    // The checkpoints are persistent bitmaps in the image: c1..c4 stopped, c5 recording.
    let info = run_ok(
        Command::new("qemu-img")
            .args(["info", "--output=json"])
            .arg(&img),
    );
    for i in 1..=5 {
        assert!(info.contains(&format!("\"c{i}\"")), "c{i} missing: {info}");
    }
}

#[test]
fn base_allocation_matches_qemu_img_map() {
    if skip("backups") {
        return;
    }
    for fmt in ["raw", "qcow2"] {
        let dir = TestDir::new(&format!("backup-map-{fmt}"));
        let img = dir.join(&format!("img.{fmt}"));
        qemu_img_create(&img, fmt, &SIZE.to_string());
        // Data here and there, a zeroed cluster, a discarded one.
        for (off, cmd) in [
            (0u64, "write -P 1 0 64k"),
            (5 * MIB, "write -P 2 5M 192k"),
            (9 * MIB, "write -z 9M 128k"),
            (20 * MIB, "write -P 3 20M 1M"),
            (20 * MIB, "discard 20M 64k"),
            (SIZE - 65536, "write -P 4 32704k 64k"),
        ] {
            let _ = off;
            run_ok(
                Command::new("qemu-io")
                    .args(["-f", fmt, "-c", cmd])
                    .arg(&img),
            );
        }
        let (backend, sock) = start_with_control(&dir, &img, 1, &[]);
        let nbd = dir.join("nbd.sock");
        let uri = backup_begin(
            &sock,
            &["--checkpoint", "m", "--socket", &nbd.display().to_string()],
        );
        let map = nbd_map(&uri, "base:allocation");
        let q: Value = serde_json::from_str(&run_ok(
            Command::new("qemu-img")
                .args(["map", "--output=json", "-U", "-f", fmt])
                .arg(&img),
        ))
        .unwrap();
        // Per 4 KiB block: (zero, data) from each.
        let blocks = (SIZE / 4096) as usize;
        let mut ours = vec![(false, false); blocks];
        for (o, l, t) in &map {
            for b in (o / 4096)..((o + l) / 4096) {
                ours[b as usize] = (t & 2 != 0, t & 1 == 0);
            }
        }
        let mut theirs = vec![(false, false); blocks];
        for e in q.as_array().unwrap() {
            let (o, l) = (e["start"].as_u64().unwrap(), e["length"].as_u64().unwrap());
            for b in (o / 4096)..((o + l) / 4096) {
                theirs[b as usize] = (e["zero"] == true, e["data"] == true);
            }
        }
        let diff = (0..blocks).find(|&b| ours[b] != theirs[b]);
        assert_eq!(
            diff,
            None,
            "{fmt}: block {:?} (zero, data): ours {:?} qemu-img {:?}\nnbdinfo: {map:?}\nqemu-img map: {q}",
            diff,
            diff.map(|b| ours[b]),
            diff.map(|b| theirs[b])
        );
        ctl_ok(&sock, "backup-end", &["--checkpoint", "m"]);
        backend.sigterm_and_wait(STOP);
    }
}

#[test]
fn a_full_scratch_fails_the_backup_and_not_the_guest() {
    if skip("backups") {
        return;
    }
    let dir = TestDir::new("backup-scratch");
    let img = dir.join("img.raw");
    create_pattern_image(&img, SIZE, 3);
    let (backend, sock) = start_with_control(&dir, &img, 2, &[]);
    let writer = Writer::start(connect_queues(&backend.socket, 2), 13);
    let nbd = dir.join("nbd.sock");
    let uri = writer.paused(|_| {
        backup_begin(
            &sock,
            &[
                "--checkpoint",
                "s",
                "--socket",
                &nbd.display().to_string(),
                "--scratch-max",
                "1M",
            ],
        )
    });
    // Heavy writes: far more than 1 MiB of distinct granules.
    writer.run_for(400);
    let list = ctl_ok(&sock, "backup-list", &[]);
    let failed = list["backups"][0]["failed"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(failed.contains("scratch is full"), "{list}");
    let o = nbdcopy(&uri, &dir.join("out.raw"));
    assert!(!o.status.success(), "nbdcopy of a failed backup succeeded");
    // The guest's writes all completed (the writer asserts each), and read back.
    let log = writer.take_log();
    let mut c = writer.stop();
    let mut model = read_file(&img);
    let _ = &mut model;
    for (o, l) in log.iter().rev().take(20) {
        let got = c.read_at(1, *o, *l as usize).unwrap();
        // The newest write to each place is what reads back: check the last ones only where
        // no later write overlaps.
        let later = log
            .iter()
            .rev()
            .take_while(|x| !std::ptr::eq(*x, &(*o, *l)))
            .any(|x| x.0 < o + l && o < &(x.0 + x.1));
        if !later {
            assert!(
                got.iter().all(|&b| b == got[0] && b != 0),
                "write at {o} lost"
            );
        }
    }
    ctl_ok(&sock, "backup-end", &["--checkpoint", "s"]);
    drop(c);
    backend.sigterm_and_wait(STOP);
}

#[test]
fn hostile_nbd_clients_do_not_stop_the_export_or_the_disk() {
    if skip("backups") {
        return;
    }
    use std::io::{Read, Write};
    let dir = TestDir::new("backup-hostile");
    let img = dir.join("img.raw");
    create_pattern_image(&img, SIZE, 4);
    let (backend, sock) = start_with_control(&dir, &img, 2, &[]);
    let writer = Writer::start(connect_queues(&backend.socket, 2), 17);
    let nbd = dir.join("nbd.sock");
    let (reference, uri) = writer.paused(|c| {
        let r = c.read_all(1);
        (
            r,
            backup_begin(
                &sock,
                &["--checkpoint", "h", "--socket", &nbd.display().to_string()],
            ),
        )
    });
    // A slow reader: a proper client that asks for 64 MiB and never reads its replies
    // (the export's threads for it block on the full socket until the write timeout).
    let target = vublk::nbd::NbdTarget::parse(&uri).unwrap();
    let (mut slow, _) = vublk::nbd::connect(&target, Duration::from_secs(10)).unwrap();
    for i in 0..64u64 {
        let r = vublk::nbd::wire::Request {
            flags: 0,
            kind: vublk::nbd::wire::CMD_READ,
            handle: i,
            offset: (i % 32) * MIB,
            len: MIB as u32,
        };
        slow.write_all(&r.encode()).unwrap();
    }
    // 100 idle connections, garbage, a huge option, a client that never reads its replies.
    let idle: Vec<_> = (0..100)
        .filter_map(|_| std::os::unix::net::UnixStream::connect(&nbd).ok())
        .collect();
    for junk in [vec![0xffu8; 4096], {
        let mut v = vec![0u8; 18];
        v.extend_from_slice(&[0, 0, 0, 1]);
        v.extend_from_slice(b"IHAVEOPT");
        v.extend_from_slice(&7u32.to_be_bytes());
        v.extend_from_slice(&u32::MAX.to_be_bytes());
        v
    }] {
        if let Ok(mut s) = std::os::unix::net::UnixStream::connect(&nbd) {
            let _ = s.write_all(&junk);
            s.set_read_timeout(Some(Duration::from_secs(15))).unwrap();
            let mut b = [0u8; 256];
            while matches!(s.read(&mut b), Ok(n) if n > 0) {}
        }
    }
    // The disk goes on meanwhile.
    writer.run_for(100);
    drop(idle);
    // Places come free as the idle clients' threads end; then a real client reads it all.
    let out = dir.join("out.raw");
    let mut done = false;
    for _ in 0..50 {
        if nbdcopy(&uri, &out).status.success() {
            done = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(done, "nbdcopy never succeeded after the hostile clients");
    write_file(&dir.join("ref.raw"), &reference);
    assert_compare(&out, &dir.join("ref.raw"));
    let list = ctl_ok(&sock, "backup-list", &[]);
    assert!(
        list["backups"][0]["clients_refused"].as_u64().unwrap() > 0,
        "{list}"
    );
    drop(slow);
    ctl_ok(&sock, "backup-end", &["--checkpoint", "h"]);
    writer.stop();
    backend.assert_running();
    backend.sigterm_and_wait(STOP);
}
