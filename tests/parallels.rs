//! Parallels images (`--format parallels`, or probed by magic): images made and written by
//! qemu-img / qemu-io read back identically (new and old magic), random I/O matches a model and
//! leaves images `qemu-img check` accepts, preallocation grows and trims the file as documented,
//! a SIGKILL leaves a dirty image that the next start checks and trims, corrupt BATs are refused,
//! `--read-only` never touches the file, `vublk create --format parallels` makes images qemu
//! accepts, and a format-extension cluster is never allocated over.

mod common;

use std::fs;
use std::path::Path;
use std::process::{Command, Output};

use common::*;

/// The address-space limit `vublk create` runs under in the no-big-table tests: the
/// binary and its shared libraries (librbd and Ceph's with the `rbd` feature) fit, a table
/// the size of a large image does not.
const AS_LIMIT: u64 = 256 * MIB;

const OLD_MAGIC: &[u8] = b"WithoutFreeSpace";
const NEW_MAGIC: &[u8] = b"WithouFreSpacExt";
/// The header's `inuse` field while open read-write (so after a crash), and after a clean close.
const IN_USE: u32 = 0x746F_6E59;
const CLOSED: u32 = 0x312E_3276;
const EXT_MAGIC: u64 = 0xAB23_4CEF_23DC_EA87;
const K64: u64 = 64 * 1024;

fn le32(b: &[u8], o: usize) -> u32 {
    u32::from_le_bytes(b[o..o + 4].try_into().unwrap())
}

fn le64(b: &[u8], o: usize) -> u64 {
    u64::from_le_bytes(b[o..o + 8].try_into().unwrap())
}

/// The header fields and BAT the tests look at; offsets in bytes.
#[derive(Debug)]
struct Header {
    old_magic: bool,
    cluster: u64,
    virtual_size: u64,
    in_use: u32,
    data_off: u64,
    ext_off: u64,
    bat: Vec<u32>,
}

impl Header {
    fn read(img: &Path) -> Header {
        let h = read_file_range(img, 0, 64);
        let magic = &h[..16];
        assert!(
            magic == NEW_MAGIC || magic == OLD_MAGIC,
            "{}: no parallels magic: {:?}",
            img.display(),
            String::from_utf8_lossy(magic)
        );
        let n = le32(&h, 32) as usize;
        let bat = read_file_range(img, 64, n * 4);
        Header {
            old_magic: magic == OLD_MAGIC,
            cluster: le32(&h, 28) as u64 * 512,
            virtual_size: le64(&h, 36) * 512,
            in_use: le32(&h, 44),
            data_off: le32(&h, 48) as u64 * 512,
            ext_off: le64(&h, 56) * 512,
            bat: (0..n).map(|i| le32(&bat, i * 4)).collect(),
        }
    }

    /// Host offset of guest cluster `i`, None if unallocated.
    fn host(&self, i: usize) -> Option<u64> {
        match self.bat[i] as u64 {
            0 => None,
            e if self.old_magic => Some(e * 512),
            e => Some(e * self.cluster),
        }
    }

    fn allocated(&self) -> u64 {
        self.bat.iter().filter(|&&e| e != 0).count() as u64
    }

    /// End of the last used cluster (data or format extension): where a clean close trims to.
    fn used_end(&self) -> u64 {
        let data = (0..self.bat.len()).filter_map(|i| self.host(i)).max();
        let ext = (self.ext_off != 0).then_some(self.ext_off);
        let last = data.into_iter().chain(ext).max();
        last.map_or(self.data_off, |o| (o + self.cluster).max(self.data_off))
    }
}

fn have_qemu_tools() -> bool {
    if !have_qemu_img() {
        return false;
    }
    let io = Command::new("qemu-io").arg("--version").output();
    if io.is_ok_and(|o| o.status.success()) {
        return true;
    }
    skip_or_fail::<()>("qemu-io not installed");
    false
}

fn qemu_img_create(img: &Path, size: &str, cluster: &str) {
    let args = format!("create -q -f parallels -o cluster_size={cluster}");
    qemu_img_ok(&args, &[img, Path::new(size)], "qemu-img create");
}

fn qemu_io(img: &Path, cmds: &[&str]) {
    let mut io = Command::new("qemu-io");
    io.args(["-f", "parallels"]);
    for c in cmds {
        io.args(["-c", c]);
    }
    run_ok(io.arg(img));
}

/// `vublk create --format parallels ARGS IMG` (args separated by spaces).
fn vublk_create(img: &Path, args: &str) -> Output {
    Command::new(env!("CARGO_BIN_EXE_vublk"))
        .args(["create", "--format", "parallels"])
        .args(args.split_whitespace())
        .arg(img)
        .output()
        .unwrap()
}

/// `qemu-img ARGS PATHS`, which must succeed (`check`: clean, `compare`: identical).
#[track_caller]
fn qemu_img_ok(args: &str, paths: &[&Path], what: &str) -> Vec<u8> {
    let o = Command::new("qemu-img")
        .args(args.split_whitespace())
        .args(paths)
        .output()
        .unwrap();
    let out = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(
        o.status.success(),
        "{what}: qemu-img {args} failed ({}):\n{out}",
        o.status
    );
    o.stdout
}

#[track_caller]
fn check_clean(img: &Path, what: &str) {
    qemu_img_ok("check -f parallels", &[img], what);
}

fn to_raw(img: &Path, raw: &Path) -> Vec<u8> {
    let _ = fs::remove_file(raw);
    qemu_img_ok(
        "convert -f parallels -O raw",
        &[img, raw],
        "qemu-img convert",
    );
    read_file(raw)
}

/// `qemu-img compare`: the parallels image holds exactly `model`.
#[track_caller]
fn compare_with_model(dir: &TestDir, img: &Path, model: &[u8], what: &str) {
    let raw = dir.join("model.raw");
    fs::write(&raw, model).unwrap();
    qemu_img_ok("compare -f raw -F parallels", &[&raw, img], what);
}

/// Backend options from vublk arguments separated by spaces.
fn opts(extra: &str) -> BackendOpts {
    BackendOpts {
        extra_args: extra.split_whitespace().map(String::from).collect(),
        ..Default::default()
    }
}

/// SIGTERM; the backend must exit 0.
#[track_caller]
fn stop(backend: &Backend, what: &str) {
    let status = backend.sigterm_and_wait(EXIT_DEADLINE);
    assert_eq!(status.code(), Some(0), "{what}: exit status after SIGTERM");
}

/// A request's result must be success.
#[track_caller]
fn ok(ret: i32, what: &str) {
    assert_eq!(ret, 0, "{what}: {}", errno_name(ret));
}

/// Writes of every kind to a 32 MiB image: a whole 1 MiB, small ones, one across a 1 MiB
/// boundary, zeroes, one not aligned to 4 KiB, 3 MiB, and the last 4 KiB.
const QEMU_IO_WRITES: &[&str] = &[
    "write -P 0xaa 0 1M",
    "write -P 0xbb 3M 4k",
    "write -P 0xcc 6189056 200k",
    "write -z 8M 128k",
    "write -P 0xee 10485248 7168",
    "write -P 0x77 16M 3M",
    "write -P 0x55 33550336 4k",
];

/// Serves `img` read-only, checks capacity, the whole disk and reads that start and end inside
/// clusters, and that the file is byte for byte unchanged afterwards.
fn read_through_vublk(dir: &TestDir, img: &Path, expected: &[u8], extra: &str, what: &str) {
    let before = read_file(img);
    let mut o = opts(extra);
    o.read_only = true;
    let backend = Backend::start(dir, img, &o);
    let ro = ClientOpts {
        read_only: true,
        ..Default::default()
    };
    let mut c = connect(&backend.socket, ro);
    assert_eq!(c.capacity(), expected.len() as u64, "{what}: capacity");
    assert_same(&c.read_all(0), expected, &format!("{what}: whole disk"));
    for (off, len) in [
        (K64 - 512, 1024usize),
        (MIB - 4096, 12288),
        (6 * MIB - 4096, 8192),
        (10485248 - 512, 9216),
        (19 * MIB - 512, 4096),
        (32 * MIB - 4096, 4096),
    ] {
        if off as usize + len > expected.len() {
            continue;
        }
        let what = format!("{what}: read {len} at {off}");
        let got = c
            .read_at(0, off, len)
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        assert_same(&got, &expected[off as usize..off as usize + len], &what);
    }
    drop(c);
    stop(&backend, what);
    let unchanged = read_file(img) == before;
    assert!(unchanged, "{what}: serving read-only modified the file");
}

#[test]
fn qemu_written_images_read_back_identically() {
    if skip_unless_vublk("parallels is served by vublk") || !have_qemu_tools() {
        return;
    }
    let dir = TestDir::new("par-interop");
    for (name, cluster) in [("c64k", "64k"), ("c1m", "1M")] {
        let img = dir.join(&format!("{name}.img"));
        qemu_img_create(&img, "32M", cluster);
        qemu_io(&img, QEMU_IO_WRITES);
        let expected = to_raw(&img, &dir.join(&format!("{name}.raw")));
        let h = Header::read(&img);
        assert!(!h.old_magic, "setup: qemu-img made an old-magic image");
        // The same data with the old magic: BAT entries in sectors instead of clusters.
        let old = dir.join(&format!("{name}-old.img"));
        let mut bytes = read_file(&img);
        bytes[..16].copy_from_slice(OLD_MAGIC);
        for (i, &e) in h.bat.iter().enumerate().filter(|(_, e)| **e != 0) {
            let sectors = e * (h.cluster / 512) as u32;
            bytes[64 + 4 * i..68 + 4 * i].copy_from_slice(&sectors.to_le_bytes());
        }
        fs::write(&old, &bytes).unwrap();
        compare_with_model(&dir, &old, &expected, "setup: old-magic conversion");
        for (img, kind) in [(&img, "new magic"), (&old, "old magic")] {
            let what = format!("{name} {kind}");
            read_through_vublk(&dir, img, &expected, "--format parallels", &what);
            read_through_vublk(&dir, img, &expected, "", &format!("{what}, probed"));
        }
    }
}

/// Random writes, WRITE_ZEROES (unmap allowed), cluster-aligned DISCARDs, reads and flushes
/// with `--discard unmap`, on a qemu-img image and on `vublk create` ones: reads match the model
/// while serving, clusters zeroed or discarded whole lose their BAT entry, and after SIGTERM the
/// image is clean, trimmed, marked closed, equal to the model, and reads back after a restart.
#[test]
fn random_io_matches_model_and_qemu_img() {
    if skip_unless_vublk("parallels is served by vublk") || !have_qemu_tools() {
        return;
    }
    let dir = TestDir::new("par-model");
    const SIZE: u64 = 16 * MIB;
    for (name, create) in [
        ("qemu-64k", None),
        ("vublk-default", Some("--size 16M")),
        ("vublk-64k", Some("--size 16M --cluster-size 64K")),
    ] {
        let img = dir.join(&format!("{name}.img"));
        match create {
            None => qemu_img_create(&img, "16M", "64k"),
            Some(args) => {
                let o = vublk_create(&img, args);
                assert!(o.status.success(), "vublk create {args}: {o:?}");
            }
        }
        let cl = Header::read(&img).cluster;
        let nclusters = (SIZE / cl) as usize;
        let o = opts("--discard unmap --prealloc-size 1M");
        let backend = Backend::start(&dir, &img, &o);
        let mut c = connect_queues(&backend.socket, 1);
        let mut model = vec![0u8; SIZE as usize];
        // Guest clusters whose last change freed them whole (their BAT entry must be 0).
        let mut freed = vec![false; nclusters];
        let mut rng = Rng::new(0x9a7a_0001 ^ name.len() as u64);
        for i in 0..120 {
            // Zeroes up to 2 MiB (to cover 1 MiB clusters whole), writes up to 256 KiB.
            let kind = rng.below(10);
            let mut len = rng.range(1, if kind == 6 { 4096 } else { 512 }) * 512;
            let mut off = rng.below((SIZE - len) / 512 + 1) * 512;
            if kind == 7 {
                let n = rng.range(1, 3);
                (off, len) = (rng.below(nclusters as u64 - n + 1) * cl, n * cl);
            }
            let range = off as usize..(off + len) as usize;
            let clusters = (off / cl) as usize..=((off + len - 1) / cl) as usize;
            let what = format!("{name} op {i} ({kind}): {len} at {off}");
            match kind {
                0..=5 => {
                    let mut data = vec![0u8; len as usize];
                    rng.fill(&mut data);
                    ok(c.write_at(0, off, &data), &format!("write {what}"));
                    model[range].copy_from_slice(&data);
                    freed[clusters].fill(false);
                }
                6 | 7 => {
                    let op = if kind == 6 {
                        let flags = blkio::ReqFlags::empty();
                        Op::WriteZeroes {
                            offset: off,
                            len,
                            flags,
                        }
                    } else {
                        Op::Discard { offset: off, len }
                    };
                    ok(c.submit(0, op), &what);
                    model[range].fill(0);
                    for k in clusters {
                        // Partly covered clusters may stay allocated.
                        freed[k] = off <= k as u64 * cl && (k as u64 + 1) * cl <= off + len;
                    }
                }
                8 => {
                    let got = c.read_at(0, off, len as usize).unwrap();
                    assert_same(&got, &model[range], &format!("read {what}"));
                }
                _ => ok(c.submit(0, Op::Flush), &format!("flush {what}")),
            }
        }
        assert!(freed.contains(&true), "{name}: setup: nothing freed");
        ok(c.submit(0, Op::Flush), &format!("{name}: final flush"));
        let what = format!("{name}: whole disk while serving");
        assert_same(&c.read_all(0), &model, &what);
        drop(c);
        stop(&backend, name);
        let h = Header::read(&img);
        let mapped: Vec<usize> = (0..nclusters)
            .filter(|&k| freed[k] && h.bat[k] != 0)
            .collect();
        assert!(
            mapped.is_empty(),
            "{name}: clusters freed whole still mapped: {mapped:?}"
        );
        assert_eq!(h.in_use, CLOSED, "{name}: inuse after a clean shutdown");
        let (size, end) = (file_size(&img), h.used_end());
        assert_eq!(size, end, "{name}: not trimmed to the last cluster");
        check_clean(&img, name);
        compare_with_model(&dir, &img, &model, name);
        let backend = Backend::start(&dir, &img, &o);
        let mut c = connect_queues(&backend.socket, 1);
        assert_same(&c.read_all(0), &model, &format!("{name}: after a restart"));
        drop(c);
        stop(&backend, &format!("{name}: restart"));
        check_clean(&img, &format!("{name}: after the restart"));
    }
}

/// `--prealloc` on (falloc), auto (= on), truncate and off: how big the file is while serving
/// and after a clean shutdown, and whether its tail is allocated.
#[test]
fn file_grows_ahead_while_serving_and_is_trimmed_on_close() {
    if skip_unless_vublk("preallocation is vublk's") || !have_qemu_tools() {
        return;
    }
    let dir = TestDir::new("par-prealloc");
    let truncate = "--prealloc on --prealloc-mode truncate --prealloc-size 16M";
    for (name, extra) in [
        ("falloc", "--prealloc on --prealloc-size 16M"),
        ("auto", "--prealloc-size 16M"),
        ("truncate", truncate),
        ("off", "--prealloc off"),
    ] {
        let img = dir.join(&format!("{name}.img"));
        qemu_img_create(&img, "32M", "64k");
        let d = Header::read(&img).data_off;
        let backend = Backend::start(&dir, &img, &opts(extra));
        let mut c = connect_queues(&backend.socket, 1);
        let mut model = vec![0u8; 32 * MIB as usize];
        let mut write = |c: &mut Client, off: u64, len: u64| {
            let data = pattern(len as usize, off, 0x7a11);
            let what = format!("{name}: write {len} at {off}");
            ok(c.write_at(0, off, &data), &what);
            model[off as usize..(off + len) as usize].copy_from_slice(&data);
            ok(c.submit(0, Op::Flush), &what);
        };
        // One cluster, then 2 MiB more (falloc: 18 MiB, so the first 16 MiB tail runs out).
        let mib = if name == "falloc" { 18 } else { 2 };
        let mut sizes = Vec::new();
        for (stage, used) in [(0, 1), (1, 1 + mib * 16)] {
            if stage == 0 {
                write(&mut c, 0, K64);
            } else {
                (0..mib).for_each(|i| write(&mut c, K64 + i * MIB, MIB));
            }
            let (size, blocks) = (file_size(&img), allocated_blocks(&img) * 512);
            sizes.push(size);
            let end = d + used * K64;
            eprintln!("{name}: {used} clusters: {size} bytes, {blocks} allocated, end {end}");
            // The first tail: the file never shrinks while serving.
            let tail = size >= d + K64 + 16 * MIB;
            let (fine, expected) = match (name, stage) {
                ("off", _) => ((end..end + 4096).contains(&size), "the used end, within 4K"),
                ("truncate", _) => (tail && blocks < 4 * MIB, "a sparse 16 MiB tail"),
                // The 258th cluster found none free: the file grew by at least it + 16 MiB.
                ("falloc", 1) => {
                    let grew = size >= d + 258 * K64 + 16 * MIB;
                    (grew && blocks + MIB >= size, "an allocated second tail")
                }
                _ => (tail && blocks + MIB >= size, "an allocated 16 MiB tail"),
            };
            let got = format!("{size} bytes ({blocks} allocated) after {used} clusters");
            assert!(fine, "{name}: {got}, expected {expected}");
        }
        if name == "auto" || name == "truncate" {
            let same = sizes[0] == sizes[1];
            assert!(same, "{name}: grew inside the preallocated tail: {sizes:?}");
        }
        drop(c);
        stop(&backend, name);
        let h = Header::read(&img);
        let end = d + (1 + mib * 16) * K64;
        assert_eq!(
            (h.allocated(), h.used_end(), file_size(&img)),
            (1 + mib * 16, end, end),
            "{name}: (allocated clusters, end of the last, file size) after a clean shutdown"
        );
        check_clean(&img, name);
        compare_with_model(&dir, &img, &model, name);
    }
}

/// SIGKILL leaves the image marked in use with its preallocated tail; the next read-write start
/// checks it, trims the tail and serves the flushed data; a clean shutdown marks it closed.
#[test]
fn sigkill_then_reopen_checks_and_trims() {
    if skip_unless_vublk("parallels is served by vublk") || !have_qemu_tools() {
        return;
    }
    let dir = TestDir::new("par-kill");
    let img = dir.join("k.img");
    qemu_img_create(&img, "32M", "64k");
    let o = opts("--prealloc on --prealloc-size 8M");
    let backend = Backend::start(&dir, &img, &o);
    let mut c = connect_queues(&backend.socket, 1);
    let mut flushed = vec![(0, pattern(MIB as usize, 0, 41))];
    flushed.push((4 * MIB, pattern(MIB as usize, 4 * MIB, 42)));
    for (off, data) in &flushed {
        ok(c.write_at(0, *off, data), &format!("write at {off}"));
    }
    ok(c.submit(0, Op::Flush), "flush");
    // Not flushed: may or may not be there after the kill.
    let unflushed = pattern(512 * 1024, 8 * MIB, 43);
    ok(c.write_at(0, 8 * MIB, &unflushed), "write at 8M");
    let during = file_size(&img);
    let tail = during >= Header::read(&img).data_off + K64 + 8 * MIB;
    assert!(tail, "no preallocated tail while serving: {during} bytes");
    backend.signal(libc::SIGKILL);
    let _ = backend.wait_exit(EXIT_DEADLINE);
    drop(c);
    let h = Header::read(&img);
    assert_eq!(h.in_use, IN_USE, "inuse after SIGKILL");
    let (killed, used_end) = (file_size(&img), h.used_end());
    assert_eq!(killed, during, "the file changed size at SIGKILL");
    let tail = killed >= used_end + 4 * MIB;
    assert!(tail, "tail gone at SIGKILL: {killed} bytes, end {used_end}");

    let backend = Backend::start(&dir, &img, &o);
    let mut c = connect_queues(&backend.socket, 1);
    for (off, data) in &flushed {
        let got = c.read_at(0, *off, data.len()).unwrap();
        let what = format!("after a restart: flushed data at {off}");
        assert_same(&got, data, &what);
    }
    let log = backend.log_contents().to_lowercase();
    assert!(
        log.contains("check") || log.contains("not closed cleanly"),
        "the start after a crash did not say it checked the image:\n{log}"
    );
    let (trimmed, used_end) = (file_size(&img), Header::read(&img).used_end());
    assert_eq!(trimmed, used_end, "not trimmed at start (was {killed})");
    flushed.push((12 * MIB, pattern(K64 as usize, 12 * MIB, 44)));
    let p3 = &flushed[2].1;
    ok(c.write_at(0, 12 * MIB, p3), "write after the restart");
    ok(c.submit(0, Op::Flush), "flush after the restart");
    drop(c);
    stop(&backend, "after the restart");
    let h = Header::read(&img);
    assert_eq!(h.in_use, CLOSED, "inuse after a clean shutdown");
    let size = file_size(&img);
    assert_eq!(size, h.used_end(), "not trimmed after a clean shutdown");
    check_clean(&img, "after the restart and a clean shutdown");
    let raw = to_raw(&img, &dir.join("k.raw"));
    for (off, data) in &flushed {
        let r = *off as usize..*off as usize + data.len();
        assert_same(&raw[r], data, &format!("qemu-img: flushed data at {off}"));
    }
}

/// A BAT entry beyond the end of the file, or two entries for one host cluster: refused, read-
/// write and read-only, pointing at `qemu-img check -r all`. `--read-only` on a good image (and
/// on one with a leaked cluster at its end) serves it without changing a byte.
#[test]
fn corrupt_bats_are_refused_and_read_only_changes_nothing() {
    if skip_unless_vublk("parallels is served by vublk") || !have_qemu_tools() {
        return;
    }
    let dir = TestDir::new("par-corrupt");
    let good = dir.join("good.img");
    qemu_img_create(&good, "16M", "64k");
    qemu_io(&good, &["write -P 0x61 0 128k", "write -P 0x62 1M 64k"]);
    let h = Header::read(&good);
    let clusters_in_file = (file_size(&good) / h.cluster) as u32;
    for (name, entry) in [
        ("beyond-eof", clusters_in_file + 10),
        ("duplicate", h.bat[0]),
    ] {
        let img = dir.join(&format!("{name}.img"));
        let mut bytes = read_file(&good);
        // Guest cluster 5 (unallocated) -> the bad host cluster.
        bytes[64 + 4 * 5..64 + 4 * 6].copy_from_slice(&entry.to_le_bytes());
        fs::write(&img, &bytes).unwrap();
        for extra in ["--format parallels", "--read-only"] {
            let (code, out) =
                vublk_refuses(&dir, &img, &extra.split_whitespace().collect::<Vec<_>>());
            let what = format!("{name} {extra}: exit {code:?}");
            let failed = code.is_some_and(|c| c != 0);
            assert!(failed, "{what}, expected a failure:\n{out}");
            let named = out.contains("qemu-img check -r all");
            assert!(
                named,
                "{what}: the refusal names no `qemu-img check -r all`:\n{out}"
            );
        }
    }

    let expected = to_raw(&good, &dir.join("good.raw"));
    let leaky = dir.join("leaky.img");
    let mut bytes = read_file(&good);
    bytes.resize(bytes.len() + h.cluster as usize, 0);
    fs::write(&leaky, &bytes).unwrap();
    for img in [&good, &leaky] {
        // read_through_vublk asserts the file is unchanged.
        let what = format!("read-only {}", img.display());
        read_through_vublk(&dir, img, &expected, "", &what);
    }
}

/// `vublk create --format parallels`: qemu-img sees a clean parallels image of the asked size
/// and cluster size, qemu-io writes it and vublk reads back what qemu-img does; bad cluster
/// sizes exit 2 without creating anything.
#[test]
fn vublk_create_makes_images_qemu_accepts() {
    if skip_unless_vublk("vublk create is vublk's") || !have_qemu_tools() {
        return;
    }
    let dir = TestDir::new("par-create");
    for (name, args, cluster) in [
        ("default", "--size 32M", MIB),
        ("c64k", "--size 32M --cluster-size 64K", K64),
        ("c4k", "--size 32M --cluster-size 4096", 4096),
    ] {
        let img = dir.join(&format!("{name}.img"));
        let o = vublk_create(&img, args);
        assert!(o.status.success(), "vublk create {args}: {o:?}");
        let info = String::from_utf8(qemu_img_ok("info", &[&img], name)).unwrap();
        assert!(
            info.contains("file format: parallels") && info.contains("(33554432 bytes)"),
            "{name}: qemu-img info:\n{info}"
        );
        check_clean(&img, &format!("{name}: fresh from vublk create"));
        let h = Header::read(&img);
        assert_eq!(
            (h.cluster, h.virtual_size, h.allocated()),
            (cluster, 32 * MIB, 0),
            "{name}: header (cluster size, virtual size, allocated clusters)"
        );
        qemu_io(&img, QEMU_IO_WRITES);
        check_clean(&img, &format!("{name}: written by qemu-io"));
        let expected = to_raw(&img, &dir.join(&format!("{name}.raw")));
        read_through_vublk(&dir, &img, &expected, "", name);
    }
    for bad in ["1000", "0", "lots", "100"] {
        let img = dir.join(&format!("bad-{bad}.img"));
        let o = vublk_create(&img, &format!("--size 32M --cluster-size {bad}"));
        assert_eq!(o.status.code(), Some(2), "--cluster-size {bad}: {o:?}");
        assert!(!img.exists(), "--cluster-size {bad}: created a file anyway");
    }
}

/// A format-extension cluster right after the (empty) data area: vublk serves the image, writes
/// (with and without preallocation) go around it, and its bytes and ext_off never change.
#[test]
fn format_extension_cluster_is_preserved() {
    if skip_unless_vublk("parallels is served by vublk") || !have_qemu_tools() {
        return;
    }
    let dir = TestDir::new("par-ext");
    let img = dir.join("ext.img");
    qemu_img_create(&img, "16M", "64k");
    let h = Header::read(&img);
    let at = file_size(&img).div_ceil(h.cluster) * h.cluster;
    assert!(at >= h.data_off, "setup: the file ends before data_off");
    // Magic, MD5 of bytes 24.. (QEMU checks it), an end-of-features header, then a pattern.
    let mut ext = pattern(h.cluster as usize, at, 0xe7);
    ext[..8].copy_from_slice(&EXT_MAGIC.to_le_bytes());
    ext[24..48].fill(0);
    let tail = dir.join("ext.tail");
    fs::write(&tail, &ext[24..]).unwrap();
    let md5 = run_ok(Command::new("md5sum").arg(&tail));
    for i in 0..16 {
        ext[8 + i] = u8::from_str_radix(&md5[2 * i..2 * i + 2], 16).unwrap();
    }
    let mut bytes = read_file(&img);
    bytes.resize(at as usize, 0);
    bytes.extend_from_slice(&ext);
    bytes[56..64].copy_from_slice(&(at / 512).to_le_bytes());
    fs::write(&img, &bytes).unwrap();
    // qemu accepts the crafted extension (it checks magic and checksum when read-only).
    qemu_img_ok("info -f parallels", &[&img], "setup: qemu-img info");

    let mut model = vec![0u8; 16 * MIB as usize];
    let sessions = [
        ("--prealloc on --prealloc-size 1M", 0u64),
        ("--prealloc off --format parallels", 8 * MIB),
    ];
    for (round, (extra, base)) in sessions.into_iter().enumerate() {
        let r = format!("round {round}");
        let backend = Backend::start(&dir, &img, &opts(extra));
        let mut c = connect_queues(&backend.socket, 1);
        for (off, len) in [
            (base, K64),
            (base + MIB, 256 * 1024),
            (base + 5 * MIB + 512, 4096),
        ] {
            let data = pattern(len as usize, off, 0xe8 + round as u64);
            let what = format!("{r}: write {len} at {off}");
            ok(c.write_at(0, off, &data), &what);
            model[off as usize..(off + len) as usize].copy_from_slice(&data);
        }
        ok(c.submit(0, Op::Flush), &format!("{r}: flush"));
        assert_same(&c.read_all(0), &model, &format!("{r}: whole disk"));
        drop(c);
        stop(&backend, &r);
        let h = Header::read(&img);
        assert_eq!(h.ext_off, at, "{r}: ext_off changed");
        let now = read_file_range(&img, at, ext.len());
        assert_same(&now, &ext, &format!("{r}: the extension cluster"));
        if let Some(i) = (0..h.bat.len()).find(|&i| h.host(i) == Some(at)) {
            panic!("{r}: guest cluster {i} was allocated over the extension cluster");
        }
        let (size, end) = (file_size(&img), h.used_end());
        assert_eq!(size, end, "{r}: not trimmed to the last cluster");
        compare_with_model(&dir, &img, &model, &r);
    }
}

/// Issue 28, item 8: headers that ask for huge allocations. A BAT of more entries than QEMU
/// opens (it is held in memory: 2 GiB here, in a sparse file) is refused at once, naming the
/// limit; an image whose file has 4 TiB of holes after its data is served with little memory
/// (vublk once allocated a flag per cluster of it: 8 GiB).
#[test]
fn crafted_headers_cost_little_memory() {
    use std::os::unix::fs::FileExt;
    use vublk::image::parallels::{new_image, MAX_BAT_ENTRIES};
    if skip_unless_vublk("vublk's own limits and memory") {
        return;
    }
    let dir = TestDir::new("par-crafted");
    let sparse = |name: &str, bytes: &[u8], len: u64| {
        let p = dir.join(name);
        let f = fs::File::create(&p).unwrap();
        f.write_all_at(bytes, 0).unwrap();
        f.set_len(len).unwrap();
        p
    };
    let mut img = new_image(MIB, 512).unwrap();
    let nb_bat = MAX_BAT_ENTRIES + 1;
    let data_off = (64 + nb_bat * 4).next_multiple_of(512);
    img[32..36].copy_from_slice(&(nb_bat as u32).to_le_bytes());
    img[48..52].copy_from_slice(&((data_off / 512) as u32).to_le_bytes());
    let big = sparse("big-bat.img", &img, data_off);
    let (code, out) = vublk_refuses(&dir, &big, &["--read-only"]);
    assert_eq!(code, Some(1), "{out}");
    assert!(out.contains("at most 536870911"), "{out}");

    let img = new_image(MIB, 512).unwrap();
    let holes = sparse("holes.img", &img, 4 << 40);
    let opts = BackendOpts {
        read_only: true,
        ..BackendOpts::default()
    };
    let backend = Backend::start(&dir, &holes, &opts);
    let peak = backend.peak_virtual_bytes();
    assert!(peak < 1 << 30, "peak virtual memory {} MiB", peak / MIB);
    assert_eq!(backend.sigterm_and_wait(EXIT_DEADLINE).code(), Some(0));
}

/// Issue 28, item 9: `vublk create` never builds a table the size of the image. A creation
/// that fails part-way (under a 1 MiB file size limit) exits 1 with the reason and leaves no
/// file; the next attempt, under a 256 MiB address-space limit (room for the binary and its
/// libraries, librbd's with the `rbd` feature, not for a table of 1 GiB), makes the 1 TiB image with
/// 4 KiB clusters (a 1 GiB BAT), which qemu-img checks clean at that size. 1 TiB in
/// 512-byte clusters (a BAT neither vublk nor QEMU opens) is refused naming the options
/// (exit 2) before any file exists, and an existing image is never touched (exit 1).
#[test]
fn vublk_create_builds_no_table_in_memory_and_leaves_nothing_on_failure() {
    if skip_unless_vublk("vublk create is vublk's") || !have_qemu_img() {
        return;
    }
    let dir = TestDir::new("par-create-big");
    let img = dir.join("big.img");
    let create = |args: &str, resource, value| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_vublk"));
        cmd.args(["create", "--format", "parallels"])
            .args(args.split_whitespace())
            .arg(&img);
        output_with_rlimit(&mut cmd, resource, value)
    };
    let o = create("--size 1T --cluster-size 4K", libc::RLIMIT_FSIZE, MIB);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "under a file size limit: {o:?}");
    assert!(err.contains("File too large"), "{err}");
    assert!(!img.exists(), "a failed creation left its file behind");

    let o = create("--size 1T --cluster-size 4K", libc::RLIMIT_AS, AS_LIMIT);
    assert!(o.status.success(), "under a memory limit: {o:?}");
    check_clean(&img, "1 TiB with 4 KiB clusters");
    assert_virtual_size(&img, 1 << 40);

    let tiny = dir.join("tiny-clusters.img");
    let o = vublk_create(&tiny, "--size 1T --cluster-size 512");
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{o:?}");
    assert!(
        err.contains("--cluster-size 512") && err.contains("at most 536870911"),
        "{err}"
    );
    assert!(!tiny.exists(), "a refused creation made a file");

    let o = vublk_create(&img, "--size 1G");
    assert_eq!(o.status.code(), Some(1), "over an existing image: {o:?}");
    assert_virtual_size(&img, 1 << 40);
}
