//! Encryption at rest: LUKS images made by the real tools (`qemu-img create -f luks`,
//! `cryptsetup luksFormat --type luks1|luks2`, PBKDF2 and Argon2id, 512 and 4096-byte
//! sectors) served by vublk to a libblkio client, and checked both ways: what vublk wrote
//! decrypts with QEMU (`qemu-img convert` through its luks driver) or with an independent
//! AES-XTS (`tests/luks/xts.py`, OpenSSL through Python's `cryptography`) under the volume
//! key `cryptsetup luksDump --dump-volume-key` gives; what QEMU wrote, vublk reads. And
//! the refusals: a wrong passphrase, a wrong raw key, corrupt and truncated headers,
//! absurd KDF parameters, all in bounded time.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::*;

const PASS: &str = "correct horse battery staple";

fn tools(names: &[&str]) -> bool {
    for n in names {
        let ok = Command::new(n)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success());
        if !ok {
            skip_or_fail::<()>(&format!("{n} not installed"));
            return false;
        }
    }
    let py = Command::new("python3")
        .args(["-c", "import cryptography"])
        .status()
        .is_ok_and(|s| s.success());
    if !py {
        skip_or_fail::<()>("python3-cryptography not installed");
        return false;
    }
    true
}

fn setup(name: &str, need: &[&str]) -> Option<TestDir> {
    if skip_unless_vublk("LUKS is served by vublk") || !tools(need) {
        return None;
    }
    Some(TestDir::new(name))
}

fn key_file(dir: &TestDir) -> PathBuf {
    let p = dir.join("pass");
    std::fs::write(&p, PASS).unwrap();
    p
}

fn serve(dir: &TestDir, img: &Path, extra: &[&str]) -> (Backend, Client) {
    let k = key_file(dir);
    let mut args = vec![format!("--key-secret=file:{}", k.display())];
    args.extend(extra.iter().map(|s| s.to_string()));
    let opts = BackendOpts {
        extra_args: args,
        ..Default::default()
    };
    start_and_connect(dir, img, &opts, ClientOpts::default())
}

/// Writes at offsets that exercise whole and split sectors and the disk's ends, and the
/// model of what the disk then holds (`size` bytes; untouched bytes None).
fn write_pattern(c: &mut Client, size: u64, align: u64, seed: u64) -> Vec<(u64, Vec<u8>)> {
    let mut out = Vec::new();
    let offsets = [0, align, 64 << 10, 1 << 20, size / 2, size - 128 * 1024];
    for (i, &off) in offsets.iter().enumerate() {
        let len = [align as usize, 4096, 64 << 10, 128 << 10][i % 4].max(align as usize);
        let data = pattern(len, off, seed + i as u64);
        assert_eq!(c.write_at(0, off, &data), 0, "write at {off}");
        out.push((off, data));
    }
    // Read back through vublk first: it must decrypt what it encrypted.
    for (off, data) in &out {
        let back = c.read_at(0, *off, data.len()).unwrap();
        assert_same(&back, data, &format!("read back at {off}"));
    }
    out
}

fn check_plain(plain: &[u8], written: &[(u64, Vec<u8>)], what: &str) {
    for (off, data) in written {
        let o = *off as usize;
        assert_same(&plain[o..o + data.len()], data, &format!("{what} at {off}"));
    }
}

fn qemu_secret_args(k: &Path) -> Vec<String> {
    vec![
        "--object".into(),
        format!("secret,id=s0,file={}", k.display()),
    ]
}

/// `qemu-img convert` of a LUKS image to raw through QEMU's own luks driver.
fn qemu_decrypt(img: &Path, k: &Path, out: &Path) -> Vec<u8> {
    run_ok(
        Command::new("qemu-img")
            .arg("convert")
            .args(qemu_secret_args(k))
            .arg("--image-opts")
            .arg(format!(
                "driver=luks,key-secret=s0,file.filename={}",
                img.display()
            ))
            .args(["-O", "raw"])
            .arg(out),
    );
    read_file(out)
}

/// `qemu-img create -f luks` of `size` bytes of data (cheap key slot), `disk.luks`.
fn qemu_luks_image(dir: &TestDir, k: &Path, size: u64) -> PathBuf {
    let img = dir.join("disk.luks");
    run_ok(
        Command::new("qemu-img")
            .arg("create")
            .args(qemu_secret_args(k))
            .args(["-f", "luks", "-o", "key-secret=s0,iter-time=10"])
            .arg(&img)
            .arg(size.to_string()),
    );
    img
}

#[test]
fn qemu_luks1_both_ways() {
    let Some(dir) = setup("luks-qemu", &["qemu-img", "qemu-io"]) else {
        return;
    };
    let k = key_file(&dir);
    let size = 16 * MIB;
    let img = qemu_luks_image(&dir, &k, size);
    // QEMU writes, vublk reads.
    let qemu_data = [(3 * MIB, 0xa5u8, 64 * 1024), (size - 4096, 0x5a, 4096)];
    for (off, byte, len) in qemu_data {
        run_ok(
            Command::new("qemu-io")
                .args(qemu_secret_args(&k))
                .arg("--image-opts")
                .arg(format!(
                    "driver=luks,key-secret=s0,file.filename={}",
                    img.display()
                ))
                .args(["-c", &format!("write -P {byte} {off} {len}")]),
        );
    }
    let (backend, mut c) = serve(&dir, &img, &[]);
    assert_eq!(c.capacity(), size, "the guest sees the data segment");
    for (off, byte, len) in qemu_data {
        let got = c.read_at(0, off, len).unwrap();
        assert!(got.iter().all(|&b| b == byte), "QEMU's write at {off}");
    }
    // vublk writes, QEMU reads.
    let written = write_pattern(&mut c, size, 512, 1);
    // WRITE_ZEROES reads back as zeroes (encrypted zeroes, not a hole).
    assert_eq!(c.submit(0, blkio_write_zeroes(2 * MIB, 128 * 1024)), 0);
    assert_all_zero(&c.read_at(0, 2 * MIB, 128 * 1024).unwrap(), "zeroed range");
    disconnect_and_stop(&backend, c);
    let plain = qemu_decrypt(&img, &k, &dir.join("plain.raw"));
    assert_eq!(plain.len() as u64, size);
    check_plain(&plain, &written, "QEMU's decryption of vublk's write");
    assert_all_zero(
        &plain[2 * MIB as usize..(2 * MIB + 128 * 1024) as usize],
        "QEMU's view of the zeroed range",
    );
    assert!(
        plain[3 * MIB as usize..3 * MIB as usize + 65536]
            .iter()
            .all(|&b| b == 0xa5),
        "QEMU's own write survived"
    );
    let log = backend.log_contents();
    assert!(!log.contains(PASS), "the passphrase reached the log");
}

fn blkio_write_zeroes(offset: u64, len: u64) -> Op {
    Op::WriteZeroes {
        offset,
        len,
        flags: blkio::ReqFlags::empty(),
    }
}

/// cryptsetup's volume key, from `luksDump --dump-volume-key`.
fn dump_volume_key(img: &Path, k: &Path) -> String {
    let out = run_ok(
        Command::new("cryptsetup")
            .args([
                "luksDump",
                "--dump-volume-key",
                "--batch-mode",
                "--key-file",
            ])
            .arg(k)
            .arg(img),
    );
    let mut hex = String::new();
    let mut on = false;
    for line in out.lines() {
        let rest = if let Some(r) = line
            .strip_prefix("MK dump:")
            .or_else(|| line.strip_prefix("Volume key:"))
        {
            on = true;
            r
        } else if on {
            line
        } else {
            continue;
        };
        let bytes: Vec<&str> = rest.split_whitespace().collect();
        if bytes.is_empty() || !bytes.iter().all(|b| b.len() == 2) {
            if on && !hex.is_empty() {
                break;
            }
            continue;
        }
        hex.extend(bytes);
    }
    assert!(
        hex.len() == 64 || hex.len() == 128,
        "volume key from:\n{out}"
    );
    hex
}

/// The data segment of a cryptsetup image: (offset, sector size) from `luksDump`.
fn segment(img: &Path) -> (u64, u64) {
    let out = run_ok(Command::new("cryptsetup").arg("luksDump").arg(img));
    if let Some(l) = out.lines().find(|l| l.starts_with("Payload offset:")) {
        let sectors: u64 = l.split(':').nth(1).unwrap().trim().parse().unwrap();
        return (sectors * 512, 512);
    }
    let offset = out
        .lines()
        .find_map(|l| l.trim().strip_prefix("offset:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or_else(|| panic!("no data offset in:\n{out}"));
    let sector = out
        .lines()
        .find_map(|l| l.trim().strip_prefix("sector:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(512);
    (offset, sector)
}

/// `tests/luks/xts.py OP`: decrypt `len` bytes of the data segment at (offset, sector
/// size) of `img` into `file`, or encrypt `file` onto the segment's start, with `key` (hex).
fn xts(img: &Path, op: &str, key: &str, (offset, sector): (u64, u64), len: u64, file: &Path) {
    run_ok(
        Command::new("python3")
            .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/luks/xts.py"))
            .arg(op)
            .arg(img)
            .args([
                key,
                &offset.to_string(),
                &sector.to_string(),
                "0",
                &len.to_string(),
            ])
            .arg(file),
    );
}

/// A loop device over a file, detached when dropped.
struct LoopDev(PathBuf);

impl LoopDev {
    /// `losetup` of `file`; None (with the reason printed) where the machine has no loop
    /// devices.
    fn attach(file: &Path) -> Option<LoopDev> {
        let out = Command::new("losetup")
            .args(["--find", "--show"])
            .arg(file)
            .output()
            .expect("losetup runs");
        if !out.status.success() {
            eprintln!(
                "skipped: no loop device here (losetup: {})",
                String::from_utf8_lossy(&out.stderr).trim()
            );
            return None;
        }
        let dev = String::from_utf8(out.stdout).unwrap().trim().to_string();
        Some(LoopDev(PathBuf::from(dev)))
    }
}

impl Drop for LoopDev {
    fn drop(&mut self) {
        let _ = Command::new("losetup").arg("-d").arg(&self.0).status();
    }
}

fn cryptsetup_case(name: &str, format_args: &[&str]) {
    cryptsetup_case_on(name, format_args, false)
}

/// The cryptsetup round trip on a file, or (`on_loop`) on a loop device over it: vublk then
/// serves the block device.
fn cryptsetup_case_on(name: &str, format_args: &[&str], on_loop: bool) {
    let need: &[&str] = if on_loop {
        &["cryptsetup", "losetup"]
    } else {
        &["cryptsetup"]
    };
    let Some(dir) = setup(name, need) else {
        return;
    };
    let k = key_file(&dir);
    let img = dir.join("disk.img");
    let file_size = 40 * MIB;
    create_sparse_image(&img, file_size);
    run_ok(
        Command::new("cryptsetup")
            .args(["luksFormat", "--batch-mode", "--key-file"])
            .arg(&k)
            .args(format_args)
            .arg(&img),
    );
    let (offset, sector) = segment(&img);
    let size = file_size - offset;
    let lbs = sector.to_string();
    let extra: Vec<&str> = if sector > 512 {
        vec!["--logical-block-size", &lbs]
    } else {
        vec![]
    };
    let dev = if on_loop {
        match LoopDev::attach(&img) {
            Some(d) => Some(d),
            None => return,
        }
    } else {
        None
    };
    let served = dev.as_ref().map_or(img.clone(), |d| d.0.clone());
    let (backend, mut c) = serve(&dir, &served, &extra);
    assert_eq!(c.capacity(), size);
    let mut written = write_pattern(&mut c, size, sector, 7);
    if on_loop {
        // Large writes too (the helper's and the queue thread's paths), and what the
        // device holds through vublk's reads.
        let big = pattern(MIB as usize, 3 * MIB, 8);
        assert_eq!(c.write_at(0, 3 * MIB, &big), 0);
        assert_same(&c.read_at(0, 3 * MIB, big.len()).unwrap(), &big, "1 MiB");
        written.push((3 * MIB, big));
    }
    disconnect_and_stop(&backend, c);
    drop(dev);
    // `cryptsetup luksDump` still reads the header; the volume key decrypts vublk's data.
    let key = dump_volume_key(&img, &k);
    let plain = dir.join("plain.raw");
    xts(&img, "decrypt", &key, (offset, sector), size, &plain);
    check_plain(
        &read_file(&plain),
        &written,
        "an independent AES-XTS decryption of vublk's write",
    );
    // And the other way: data encrypted independently reads right through vublk.
    let mine = pattern(64 * 1024, 0, 99);
    let src = dir.join("mine.raw");
    std::fs::write(&src, &mine).unwrap();
    xts(&img, "encrypt", &key, (offset, sector), 0, &src);
    let (backend, mut c) = serve(&dir, &img, &extra);
    assert_same(
        &c.read_at(0, 0, mine.len()).unwrap(),
        &mine,
        "independent write",
    );
    disconnect_and_stop(&backend, c);
}

#[test]
fn cryptsetup_luks1_pbkdf2() {
    cryptsetup_case(
        "luks-cs1",
        &[
            "--type",
            "luks1",
            "--hash",
            "sha1",
            "--pbkdf-force-iterations",
            "1000",
        ],
    );
}

#[test]
fn cryptsetup_luks2_argon2id() {
    cryptsetup_case(
        "luks-cs2a",
        &[
            "--type",
            "luks2",
            "--pbkdf",
            "argon2id",
            "--pbkdf-memory",
            "32768",
            "--pbkdf-force-iterations",
            "4",
            "--pbkdf-parallel",
            "2",
        ],
    );
}

#[test]
fn cryptsetup_luks2_pbkdf2_sha512_aes128_4k_sectors() {
    cryptsetup_case(
        "luks-cs2p",
        &[
            "--type",
            "luks2",
            "--pbkdf",
            "pbkdf2",
            "--hash",
            "sha512",
            "--pbkdf-force-iterations",
            "1000",
            "--key-size",
            "256",
            "--sector-size",
            "4096",
        ],
    );
}

/// LUKS on a block device (a loop device over the file: device-mapper is not needed):
/// vublk serves the device; the independent AES-XTS checks both directions on the file.
#[test]
fn cryptsetup_luks2_on_a_loop_device() {
    cryptsetup_case_on(
        "luks-loop",
        &[
            "--type",
            "luks2",
            "--pbkdf",
            "pbkdf2",
            "--pbkdf-force-iterations",
            "1000",
        ],
        true,
    );
}

/// A LUKS1 image from cryptsetup with cheap key slots, for the refusal tests.
fn luks1_image(dir: &TestDir) -> PathBuf {
    let k = key_file(dir);
    let img = dir.join("disk.img");
    create_sparse_image(&img, 8 * MIB);
    run_ok(
        Command::new("cryptsetup")
            .args([
                "luksFormat",
                "--batch-mode",
                "--type",
                "luks1",
                "--pbkdf-force-iterations",
                "1000",
                "--key-file",
            ])
            .arg(&k)
            .arg(&img),
    );
    img
}

#[track_caller]
fn refused(dir: &TestDir, img: &Path, extra: &[&str], want: &str) -> String {
    let t = Instant::now();
    let (code, out) = vublk_refuses(dir, img, extra);
    assert!(
        t.elapsed() < Duration::from_secs(10),
        "refusal took {:?}",
        t.elapsed()
    );
    assert_eq!(code, Some(1), "{out}");
    assert!(out.contains(want), "expected {want:?} in:\n{out}");
    assert!(!out.contains(PASS), "the passphrase reached the output");
    out
}

#[test]
fn wrong_keys_corrupt_headers_and_absurd_parameters_are_refused() {
    let Some(dir) = setup("luks-refuse", &["cryptsetup"]) else {
        return;
    };
    let img = luks1_image(&dir);
    let wrong = dir.join("wrong");
    std::fs::write(&wrong, "not the passphrase").unwrap();
    let key_arg = |p: &Path| format!("--key-secret=file:{}", p.display());
    refused(&dir, &img, &[&key_arg(&wrong)], "no key slot matches");
    // A raw key of the right length but the wrong bytes.
    let raw = dir.join("raw");
    std::fs::write(&raw, [7u8; 64]).unwrap();
    refused(
        &dir,
        &img,
        &[&key_arg(&raw), "--key-secret-raw"],
        "raw volume key does not match",
    );
    // No key at all: the option to give.
    let (code, out) = vublk_refuses(&dir, &img, &[]);
    assert_eq!(code, Some(2), "{out}");
    assert!(out.contains("--key-secret"), "{out}");
    // Absurd iterations in key slot 0 (LUKS1: offset 208 + 4): refused before any work.
    let k = key_file(&dir);
    let mut bytes = read_file(&img);
    bytes[212..216].copy_from_slice(&u32::MAX.to_be_bytes());
    let absurd = dir.join("absurd.img");
    std::fs::write(&absurd, &bytes).unwrap();
    refused(&dir, &absurd, &[&key_arg(&k)], "PBKDF2 iterations");
    // An unknown cipher, named.
    let mut bytes = read_file(&img);
    bytes[8..40].fill(0);
    bytes[8..15].copy_from_slice(b"serpent");
    let other = dir.join("serpent.img");
    std::fs::write(&other, &bytes).unwrap();
    refused(&dir, &other, &[&key_arg(&k)], "serpent-xts-plain64");
    // Truncated inside the key material.
    let short = dir.join("short.img");
    std::fs::write(&short, &read_file(&img)[..64 * 1024]).unwrap();
    refused(&dir, &short, &[&key_arg(&k)], "image");
    // A key for an image that is not (or no longer) encrypted: its header overwritten, a
    // plain file, a plain qcow2. Serving it would write the guest's data in the clear.
    let mut bytes = read_file(&img);
    bytes[..4096].fill(0);
    let wiped = dir.join("wiped.img");
    std::fs::write(&wiped, &bytes).unwrap();
    let plain_qcow2 = dir.join("plain.qcow2");
    run_ok(
        Command::new(env!("CARGO_BIN_EXE_vublk"))
            .args(["create", "--format", "qcow2", "--size", "16M"])
            .arg(&plain_qcow2),
    );
    for (file, extra) in [
        (&wiped, &[][..]),
        (&wiped, &["--format", "raw"][..]),
        (&plain_qcow2, &[][..]),
    ] {
        let mut args = vec![key_arg(&k)];
        args.extend(extra.iter().map(|s| s.to_string()));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let (code, out) = vublk_refuses(&dir, file, &args);
        assert_eq!(code, Some(2), "{out}");
        assert!(out.contains("not encrypted"), "{}: {out}", file.display());
    }
    // The same for a migration destination (`--incoming`), before any frontend.
    let (code, out) = vublk_refuses(&dir, &wiped, &[&key_arg(&k), "--incoming"]);
    assert_eq!(code, Some(2), "{out}");
    assert!(out.contains("not encrypted"), "incoming: {out}");
}

/// `vublk create --encrypt ARGS` of a 16 MiB disk, which must succeed.
fn vublk_create(dir: &TestDir, name: &str, args: &[&str]) -> PathBuf {
    let k = key_file(dir);
    let img = dir.join(name);
    run_ok(
        Command::new(env!("CARGO_BIN_EXE_vublk"))
            .args(["create", "--format", "raw", "--size", "16M"])
            .arg(format!("--key-secret=file:{}", k.display()))
            .args(args)
            .arg(&img),
    );
    img
}

/// Images `vublk create --encrypt` made: cryptsetup reads their headers and accepts the
/// passphrase (`--test-passphrase`, no device mapper needed), its dumped volume key
/// decrypts what vublk wrote, and QEMU opens the LUKS1 one.
#[test]
fn vublk_created_volumes_open_in_cryptsetup_and_qemu() {
    let Some(dir) = setup("luks-create", &["cryptsetup", "qemu-img"]) else {
        return;
    };
    let k = key_file(&dir);
    let cases: [(&str, &[&str]); 3] = [
        (
            "v1.img",
            &["--encrypt", "luks1", "--kdf-iterations", "1000"],
        ),
        (
            "v2a.img",
            &[
                "--encrypt",
                "luks2",
                "--kdf-iterations",
                "4",
                "--kdf-memory",
                "32M",
                "--kdf-lanes",
                "2",
            ],
        ),
        (
            "v2p.img",
            &[
                "--encrypt",
                "luks2",
                "--kdf",
                "pbkdf2",
                "--kdf-iterations",
                "1000",
                "--key-bits",
                "256",
                "--sector-size",
                "4096",
            ],
        ),
    ];
    for (name, args) in cases {
        let img = vublk_create(&dir, name, args);
        let (offset, sector) = segment(&img);
        let size = 16 * MIB;
        let lbs = sector.to_string();
        let extra: Vec<&str> = if sector > 512 {
            vec!["--logical-block-size", &lbs]
        } else {
            vec![]
        };
        let (backend, mut c) = serve(&dir, &img, &extra);
        assert_eq!(c.capacity(), size, "{name}");
        let written = write_pattern(&mut c, size, sector, 3);
        disconnect_and_stop(&backend, c);
        run_ok(
            Command::new("cryptsetup")
                .args(["open", "--test-passphrase", "--key-file"])
                .arg(&k)
                .arg(&img),
        );
        let wrong = dir.join("wrong");
        std::fs::write(&wrong, "nope").unwrap();
        let refused = Command::new("cryptsetup")
            .args(["open", "--test-passphrase", "--key-file"])
            .arg(&wrong)
            .arg(&img)
            .output()
            .unwrap();
        assert!(
            !refused.status.success(),
            "{name}: cryptsetup took a wrong passphrase"
        );
        let key = dump_volume_key(&img, &k);
        let plain = dir.join("plain.raw");
        xts(&img, "decrypt", &key, (offset, sector), size, &plain);
        check_plain(&read_file(&plain), &written, name);
        if name == "v1.img" {
            let q = qemu_decrypt(&img, &k, &dir.join("q.raw"));
            check_plain(&q, &written, "QEMU's decryption of a vublk-created volume");
        }
    }
    // What create refuses, naming the option, with no file left behind.
    let base = dir.join("base.raw");
    create_sparse_image(&base, 16 * MIB);
    let refusals: [(&[&str], &str); 4] = [
        (&["--format", "qcow2", "--backing", "base.raw"], "--backing"),
        (
            &["--format", "qcow2", "--sector-size", "4096"],
            "--sector-size",
        ),
        (&["--format", "parallels"], "--encrypt"),
        (&["--format", "raw", "--kdf", "argon2id"], "--kdf"),
    ];
    for (args, want) in refusals {
        let img = dir.join("refused.img");
        let out = Command::new(env!("CARGO_BIN_EXE_vublk"))
            .args(["create", "--size", "16M", "--encrypt", "luks1"])
            .arg(format!("--key-secret=file:{}", k.display()))
            .args(args)
            .arg(&img)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(want), "{args:?}: {err}");
        assert!(!img.exists(), "{args:?} left a file");
    }
    assert!(base.exists());
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

/// The passphrase and the volume key (or any 16-byte piece of it: AES's first round keys
/// are the key itself) appear nowhere a user or a crash can see: the log (debug level),
/// `/proc/PID/environ`, the control socket's answers, a core dump of a SIGABRTed vublk.
#[test]
fn the_key_stays_out_of_logs_environ_control_answers_and_core_dumps() {
    let Some(dir) = setup("luks-secret", &["cryptsetup"]) else {
        return;
    };
    let img = luks1_image(&dir);
    let k = key_file(&dir);
    let vk = unhex(&dump_volume_key(&img, &k));
    let ctl_sock = dir.join("ctl.sock");
    let opts = BackendOpts {
        extra_args: vec![
            format!("--key-secret=file:{}", k.display()),
            "--control-socket".into(),
            ctl_sock.display().to_string(),
        ],
        core_dumps: true,
        ..Default::default()
    };
    let (backend, mut c) = start_and_connect(&dir, &img, &opts, ClientOpts::default());
    let size = c.capacity();
    // Both directions of the data path have run (and a request large enough for the
    // helper threads).
    write_pattern(&mut c, size, 512, 11);
    let big = pattern(1 << 20, 0, 12);
    assert_eq!(c.write_at(0, 2 * MIB, &big), 0);
    assert_same(&c.read_at(0, 2 * MIB, big.len()).unwrap(), &big, "1 MiB");
    let needles: Vec<&[u8]> = std::iter::once(PASS.as_bytes())
        .chain(vk.chunks(16))
        .collect();
    let clean = |what: &str, hay: &[u8]| {
        for n in &needles {
            assert!(!contains(hay, n), "{what} holds a piece of the secret");
        }
    };
    for m in ["status", "stats", "version"] {
        let (ok, v, err) = ctl(&ctl_sock, m, &[]);
        assert!(ok, "ctl {m}: {err}");
        clean(&format!("ctl {m}"), v.to_string().as_bytes());
    }
    let stats = ctl_ok(&ctl_sock, "stats", &[]);
    assert!(
        stats.to_string().contains("luks1"),
        "stats names the encryption: {stats}"
    );
    clean(
        "/proc/PID/environ",
        &std::fs::read(format!("/proc/{}/environ", backend.pid())).unwrap(),
    );
    clean("the log", backend.log_contents().as_bytes());
    // The core dump: the kernel's (core_pattern a file name), else gdb's gcore, which
    // leaves out the same mappings (MADV_DONTDUMP).
    let pattern = std::fs::read_to_string("/proc/sys/kernel/core_pattern").unwrap();
    let core = if pattern.starts_with('|') {
        let out = dir.join("gcore");
        let ok = Command::new("gcore")
            .arg("-o")
            .arg(&out)
            .arg(backend.pid().to_string())
            .output()
            .is_ok_and(|o| o.status.success());
        if !ok {
            skip_or_fail::<()>("core_pattern is a pipe and gcore (gdb) is not installed");
            return;
        }
        drop(c);
        backend.signal(libc::SIGKILL);
        dir.join(&format!("gcore.{}", backend.pid()))
    } else {
        backend.signal(libc::SIGABRT);
        let st = backend.wait_exit(Duration::from_secs(30));
        use std::os::unix::process::ExitStatusExt;
        assert!(
            st.core_dumped(),
            "no core dumped ({st:?}, core_pattern {pattern:?})"
        );
        drop(c);
        let name = pattern.trim().replace("%p", &backend.pid().to_string());
        let p = if name.starts_with('/') {
            PathBuf::from(&name)
        } else {
            dir.join(&name)
        };
        if p.exists() {
            p
        } else {
            dir.join(&format!("{name}.{}", backend.pid()))
        }
    };
    let dump = std::fs::read(&core).unwrap_or_else(|e| panic!("{}: {e}", core.display()));
    // A dump of this process: it holds the image's path, which is in ordinary memory.
    assert!(
        contains(&dump, img.display().to_string().as_bytes()),
        "{} is not a dump of vublk",
        core.display()
    );
    let leaked: Vec<usize> = needles
        .iter()
        .enumerate()
        .filter(|(_, n)| contains(&dump, n))
        .map(|(i, _)| i)
        .collect();
    if leaked.is_empty() {
        let _ = std::fs::remove_file(&core);
    }
    assert!(
        leaked.is_empty(),
        "the core dump {} holds secret pieces {leaked:?} (0: the passphrase, 1..: the volume \
         key)",
        core.display()
    );
}

/// A qcow2 image with `encrypt.format=luks` (QEMU's: the LUKS header in the image's
/// clusters, data clusters encrypted with the host offset as IV): QEMU writes, vublk reads;
/// vublk writes (fresh clusters partly and whole, overwrites, zeroes), and QEMU decrypts
/// exactly that, with zeroes where nothing was written; `qemu-img check` is clean.
#[test]
fn qemu_encrypted_qcow2_both_ways() {
    encrypted_qcow2_case("luks-qcow2", &[], false);
}

/// An encrypted qcow2 image `vublk create --format qcow2 --encrypt luks1` made: QEMU opens
/// it (qemu-io writes, `qemu-img check`, decryption of what vublk wrote).
#[test]
fn vublk_created_encrypted_qcow2_both_ways() {
    encrypted_qcow2_case("luks-qcow2-create", &[], true);
}

/// The same with every write durable (`--cache writethrough`): new clusters are written
/// by the format (copy-on-write, whole encrypted clusters) instead of the engine.
#[test]
fn qemu_encrypted_qcow2_both_ways_writethrough() {
    encrypted_qcow2_case("luks-qcow2-wt", &["--cache", "writethrough"], false);
}

/// The qcow2 round trip on an image QEMU made or (`vublk_made`) vublk did.
fn encrypted_qcow2_case(name: &str, extra: &[&str], vublk_made: bool) {
    let Some(dir) = setup(name, &["qemu-img", "qemu-io"]) else {
        return;
    };
    let k = key_file(&dir);
    let img = dir.join("disk.qcow2");
    let size = 32 * MIB;
    if vublk_made {
        run_ok(
            Command::new(env!("CARGO_BIN_EXE_vublk"))
                .args(["create", "--format", "qcow2", "--size", "32M"])
                .args(["--encrypt", "luks1", "--kdf-iterations", "1000"])
                .arg(format!("--key-secret=file:{}", k.display()))
                .arg(&img),
        );
    } else {
        run_ok(
            Command::new("qemu-img")
                .arg("create")
                .args(qemu_secret_args(&k))
                .args([
                    "-f",
                    "qcow2",
                    "-o",
                    "encrypt.format=luks,encrypt.key-secret=s0,encrypt.iter-time=10",
                ])
                .arg(&img)
                .arg(size.to_string()),
        );
    }
    let opts = format!(
        "driver=qcow2,encrypt.key-secret=s0,file.filename={}",
        img.display()
    );
    let qemu_data = [(3 * MIB, 0xa5u8, 64 * 1024), (9 * MIB + 4096, 0x5a, 4096)];
    for (off, byte, len) in qemu_data {
        run_ok(
            Command::new("qemu-io")
                .args(qemu_secret_args(&k))
                .arg("--image-opts")
                .arg(&opts)
                .args(["-c", &format!("write -P {byte} {off} {len}")]),
        );
    }
    // Without the key: refused, naming the option.
    let (code, out) = vublk_refuses(&dir, &img, &[]);
    assert_eq!(code, Some(2), "{out}");
    assert!(out.contains("--key-secret"), "{out}");
    let (backend, mut c) = serve(&dir, &img, extra);
    assert_eq!(c.capacity(), size);
    for (off, byte, len) in qemu_data {
        let got = c.read_at(0, off, len).unwrap();
        assert!(got.iter().all(|&b| b == byte), "QEMU's write at {off}");
    }
    // QEMU's cluster around its 4 KiB write reads as zeroes elsewhere.
    assert_all_zero(&c.read_at(0, 9 * MIB, 4096).unwrap(), "beside QEMU's write");
    let written = write_pattern(&mut c, size, 512, 21);
    // Overwrite part of QEMU's cluster (in place), zero part of a written one.
    let over = pattern(8192, 0, 22);
    assert_eq!(c.write_at(0, 3 * MIB + 8192, &over), 0);
    assert_eq!(c.submit(0, blkio_write_zeroes(64 << 10, 4096)), 0);
    assert_all_zero(&c.read_at(0, 64 << 10, 4096).unwrap(), "zeroed");
    // Reads spanning written and unwritten clusters (read in pieces).
    let span = c.read_at(0, MIB - 65536, 196608).unwrap();
    assert_same(
        &span[65536..65536 + 65536],
        &written[3].1[..65536],
        "piece read",
    );
    disconnect_and_stop(&backend, c);
    run_ok(
        Command::new("qemu-img")
            .args(["check", "-q"])
            .args(qemu_secret_args(&k))
            .arg("--image-opts")
            .arg(&opts),
    );
    let plain = dir.join("plain.raw");
    run_ok(
        Command::new("qemu-img")
            .arg("convert")
            .args(qemu_secret_args(&k))
            .arg("--image-opts")
            .arg(&opts)
            .args(["-O", "raw"])
            .arg(&plain),
    );
    let plain = read_file(&plain);
    let mut expect: Vec<(u64, Vec<u8>)> = written.clone();
    expect.push((3 * MIB + 8192, over.clone()));
    for (off, data) in &expect {
        let o = *off as usize;
        if (64 << 10..(64 << 10) + 4096).contains(&o) {
            continue;
        }
        let (a, b) = (o, o + data.len());
        // The zeroed 4 KiB may lie inside an earlier write: compare around it.
        let z = (64usize << 10)..(64usize << 10) + 4096;
        for i in a..b {
            if z.contains(&i) {
                assert_eq!(plain[i], 0, "zeroed byte {i}");
            } else {
                assert_eq!(plain[i], data[i - a], "byte {i} of the write at {off}");
            }
        }
    }
    // Unwritten bytes of a cluster vublk wrote partly (cluster 0 holds [0, 4608)) read as
    // zeroes through QEMU.
    assert_all_zero(&plain[4608..65536], "the unwritten rest of a fresh cluster");
    assert!(plain[3 * MIB as usize..3 * MIB as usize + 8192]
        .iter()
        .all(|&b| b == 0xa5));
}

/// Many large writes in flight at once on two queues: the crypt helper encrypts some while
/// the queue threads encrypt others, parts come back and complete in any order, guest
/// buffers are split across segments at odd places (sectors split between segments). What
/// vublk reads back and what QEMU's luks driver decrypts are exactly the last writes.
#[test]
fn concurrent_large_writes_on_the_helper_and_the_queue_threads() {
    let Some(dir) = setup("luks-concurrent", &["qemu-img"]) else {
        return;
    };
    let k = key_file(&dir);
    let size = 24 * MIB;
    let img = qemu_luks_image(&dir, &k, size);
    let opts = BackendOpts {
        num_queues: Some(2),
        extra_args: vec![
            format!("--key-secret=file:{}", k.display()),
            "--crypt-threads=1".into(),
        ],
        ..Default::default()
    };
    let copts = ClientOpts {
        num_queues: 2,
        mem_size: 32 * MIB as usize,
        ..Default::default()
    };
    let (backend, mut c) = start_and_connect(&dir, &img, &opts, copts);
    // 2 MiB slots, each written whole or in part by one request per round.
    let mut model = vec![0u8; size as usize];
    let lens = [
        MIB as usize,
        128 << 10,
        640 << 10,
        2 * MIB as usize,
        256 << 10,
        1536 << 10,
    ];
    for round in 0..6u64 {
        let mut ops = [Vec::new(), Vec::new()];
        let mut buf = 0usize;
        for slot in 0..(size / (2 * MIB)) as usize {
            let len = lens[(slot + round as usize) % lens.len()];
            let off = slot as u64 * 2 * MIB + if len < 2 * MIB as usize { 4096 } else { 0 };
            let mut data = vec![0u8; len];
            pattern_fill(&mut data, off, round * 100 + slot as u64);
            c.mem_mut()[buf..buf + len].copy_from_slice(&data);
            model[off as usize..off as usize + len].copy_from_slice(&data);
            let op = if slot % 3 == 0 {
                // Segments of 1000 bytes, 300,001 bytes and the rest.
                let (a, b) = (1000, 301_001.min(len));
                Op::Writev {
                    offset: off,
                    iov: vec![(buf, a), (buf + a, b - a), (buf + b, len - b)],
                }
            } else {
                Op::Write {
                    offset: off,
                    buf,
                    len,
                }
            };
            ops[slot % 2].push(op);
            buf += len;
        }
        let (queues, mem) = c.take_queues();
        let results: Vec<Vec<i32>> = std::thread::scope(|s| {
            let hs: Vec<_> = queues
                .into_iter()
                .zip(&ops)
                .map(|(mut q, ops)| s.spawn(move || (run_batch(&mut q, mem, ops), q)))
                .collect();
            let mut out = Vec::new();
            for h in hs {
                let (r, q) = h.join().unwrap();
                c.queues.push(q);
                out.push(r);
            }
            out
        });
        for r in results.iter().flatten() {
            assert_eq!(*r, 0, "round {round}: a write failed");
        }
    }
    for off in (0..size).step_by(2 * MIB as usize) {
        let got = c.read_at(0, off, 2 * MIB as usize).unwrap();
        assert_same(
            &got,
            &model[off as usize..(off + 2 * MIB) as usize],
            &format!("vublk's read at {off}"),
        );
    }
    disconnect_and_stop(&backend, c);
    let plain = qemu_decrypt(&img, &k, &dir.join("plain.raw"));
    assert_same(&plain, &model, "QEMU's decryption of the concurrent writes");
}
