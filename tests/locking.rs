//! Image locking against the real QEMU tools: while vublk serves an image, qemu-io cannot
//! write it and a second vublk cannot serve it; while qemu-storage-daemon holds one, vublk
//! refuses it; backing files are locked as QEMU locks them; `--locking off|auto|on`.

mod common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

fn have_qemu_tools() -> bool {
    let ok = |p: &str| {
        Command::new(p)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
    };
    if ok("qemu-img") && ok("qemu-io") && ok("qemu-storage-daemon") {
        return true;
    }
    skip_or_fail::<()>("qemu-img, qemu-io or qemu-storage-daemon not installed");
    false
}

/// `qemu-io` with `cmds` on `img`: success and stderr.
fn qemu_io(img: &Path, fmt: &str, read_only: bool, cmd: &str) -> (bool, String) {
    let mut c = Command::new("qemu-io");
    if read_only {
        c.arg("-r");
    }
    let o = c.args(["-f", fmt, "-c", cmd]).arg(img).output().unwrap();
    let out = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    (o.status.success() && !out.contains("Failed to get"), out)
}

/// A child process killed (by its PID) and reaped when dropped, also when a test panics.
struct Reaped(std::process::Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// While vublk serves an image read-write: qemu-io cannot write it (QEMU's lock message),
/// `qemu-img info -U` still reads it, a second vublk exits 1 naming the lock (read-write:
/// "write"; read-only: shared "write"), one with `--read-only --force-share` serves; after the
/// first exits, qemu-io writes again. For qcow2 and raw images.
#[test]
fn a_served_image_keeps_qemu_writers_and_a_second_vublk_out() {
    if skip_unless_vublk("vublk's locking") || !have_qemu_tools() {
        return;
    }
    for fmt in ["qcow2", "raw"] {
        let dir = TestDir::new(&format!("lock-{fmt}"));
        let img = dir.join(&format!("img.{fmt}"));
        run_ok(
            Command::new("qemu-img")
                .args(["create", "-q", "-f", fmt])
                .arg(&img)
                .arg("16M"),
        );
        let backend = Backend::start(&dir, &img, &BackendOpts::default());
        let mut c = connect_queues(&backend.socket, 1);
        assert_eq!(c.write_at(0, 0, &[0x11u8; 65536]), 0);

        let (ok, out) = qemu_io(&img, fmt, false, "write -P 0x55 0 64k");
        assert!(!ok, "{fmt}: qemu-io wrote a served image:\n{out}");
        assert!(out.contains("Failed to get \"write\" lock"), "{fmt}: {out}");
        run_ok(Command::new("qemu-img").args(["info", "-U"]).arg(&img));

        let (code, err) = vublk_refuses(&dir, &img, &[]);
        assert_eq!(code, Some(1), "{fmt}: {err}");
        assert!(
            err.contains("in use by another process") && err.contains("\"write\" lock"),
            "{fmt}: {err}"
        );
        let (code, err) = vublk_refuses(&dir, &img, &["--read-only"]);
        assert_eq!(code, Some(1), "{fmt}: {err}");
        assert!(err.contains("shared \"write\" lock"), "{fmt}: {err}");

        let opts = BackendOpts {
            read_only: true,
            extra_args: vec!["--force-share".into()],
            ..BackendOpts::default()
        };
        let dir2 = TestDir::new(&format!("lock-{fmt}-shared"));
        let reader = Backend::start(&dir2, &img, &opts);
        reader.assert_running();
        assert_eq!(reader.sigterm_and_wait(EXIT_DEADLINE).code(), Some(0));

        // The served data was never touched by the refused writers.
        assert_eq!(c.read_at(0, 0, 65536).unwrap(), vec![0x11u8; 65536]);
        drop(c);
        assert_eq!(backend.sigterm_and_wait(EXIT_DEADLINE).code(), Some(0));
        let (ok, out) = qemu_io(&img, fmt, false, "write -P 0x55 0 64k");
        assert!(ok, "{fmt}: the locks outlived vublk:\n{out}");
        if fmt == "qcow2" {
            run_ok(Command::new("qemu-img").args(["check", "-q"]).arg(&img));
        }
    }
}

/// While qemu-storage-daemon exports an image read-write, vublk refuses it read-write and
/// read-only; while QSD exports it read-only, a read-only vublk serves beside it and a
/// read-write one is refused.
#[test]
fn vublk_refuses_an_image_qemu_storage_daemon_holds() {
    if skip_unless_vublk("vublk's locking") || !have_qemu_tools() {
        return;
    }
    let dir = TestDir::new("lock-qsd");
    let img = dir.join("img.qcow2");
    run_ok(
        Command::new("qemu-img")
            .args(["create", "-q", "-f", "qcow2"])
            .arg(&img)
            .arg("16M"),
    );
    for qsd_writable in [true, false] {
        let sock = dir.join("qsd.sock");
        let ro = if qsd_writable { "" } else { ",read-only=on" };
        let mut qsd = Reaped(
            Command::new("qemu-storage-daemon")
                .arg("--blockdev")
                .arg(format!(
                    "driver=file,node-name=f0,filename={}{ro}",
                    img.display()
                ))
                .arg("--blockdev")
                .arg(format!("driver=qcow2,node-name=q0,file=f0{ro}"))
                .arg("--export")
                .arg(format!(
                    "type=vhost-user-blk,id=e0,node-name=q0,addr.type=unix,addr.path={},\
                 writable={}",
                    sock.display(),
                    if qsd_writable { "on" } else { "off" }
                ))
                .stdin(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap(),
        );
        let t0 = Instant::now();
        while !sock.exists() && t0.elapsed() < SOCKET_DEADLINE {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(sock.exists(), "qemu-storage-daemon did not start");

        let (code, err) = vublk_refuses(&dir, &img, &[]);
        assert_eq!(code, Some(1), "QSD writable={qsd_writable}: {err}");
        assert!(err.contains("in use by another process"), "{err}");
        if qsd_writable {
            let (code, err) = vublk_refuses(&dir, &img, &["--read-only"]);
            assert_eq!(code, Some(1), "{err}");
        } else {
            serve_read_only_once(&dir, &img);
        }
        // SAFETY: plain kill of our own child, by its PID.
        unsafe { libc::kill(qsd.0.id() as i32, libc::SIGTERM) };
        let _ = qsd.0.wait();
        wait_unlocked(&img, Duration::from_secs(5));
    }
}

/// Backing files are locked as QEMU locks them (consistent read held, everything shared),
/// the served overlay as a writer: QEMU's layout bytes, seen from another process.
#[test]
fn backing_files_are_locked_like_qemu_locks_them() {
    if skip_unless_vublk("vublk's locking") || !have_qemu_tools() {
        return;
    }
    let dir = TestDir::new("lock-backing");
    let base = dir.join("base.raw");
    let ov = dir.join("ov.qcow2");
    run_ok(
        Command::new("qemu-img")
            .args(["create", "-q", "-f", "raw"])
            .arg(&base)
            .arg("16M"),
    );
    run_ok(
        Command::new("qemu-img")
            .args(["create", "-q", "-f", "qcow2", "-F", "raw", "-b"])
            .arg(&base)
            .arg(&ov),
    );
    let backend = Backend::start(&dir, &ov, &BackendOpts::default());
    // Overlay: consistent read (100), write (101), resize (103) held; write (201) and
    // resize (203) not shared.
    for (byte, want) in [(100, true), (101, true), (102, false), (103, true)] {
        assert_eq!(byte_locked(&ov, byte), want, "overlay byte {byte}");
    }
    for (byte, want) in [(200, false), (201, true), (202, false), (203, true)] {
        assert_eq!(byte_locked(&ov, byte), want, "overlay byte {byte}");
    }
    // Backing file: consistent read held, everything shared.
    assert!(byte_locked(&base, 100), "base byte 100");
    for byte in [101, 102, 103, 200, 201, 202, 203] {
        assert!(!byte_locked(&base, byte), "base byte {byte}");
    }
    // So QEMU's users of the base see what they would see with QEMU serving the overlay.
    run_ok(Command::new("qemu-img").arg("info").arg(&base));
    assert_eq!(backend.sigterm_and_wait(EXIT_DEADLINE).code(), Some(0));
    assert!(!byte_locked(&base, 100) && !byte_locked(&ov, 101));
}

/// `--locking off` lets a second user in (with a warning); where the file system has no OFD
/// locks, `auto` serves unlocked with one warning and `on` refuses.
#[test]
fn locking_off_auto_and_on() {
    if skip_unless_vublk("vublk's locking") || !have_qemu_tools() {
        return;
    }
    let dir = TestDir::new("lock-modes");
    let img = dir.join("img.raw");
    create_sparse_image(&img, 16 * MIB);
    let first = Backend::start(&dir, &img, &BackendOpts::default());
    let dir2 = TestDir::new("lock-modes-off");
    let opts = BackendOpts {
        read_only: true,
        extra_args: vec!["--locking".into(), "off".into()],
        ..BackendOpts::default()
    };
    let second = Backend::start(&dir2, &img, &opts);
    second.assert_running();
    assert!(second.log_contents().contains("image locking is off"));
    assert_eq!(second.sigterm_and_wait(EXIT_DEADLINE).code(), Some(0));
    assert_eq!(first.sigterm_and_wait(EXIT_DEADLINE).code(), Some(0));

    let opts = BackendOpts {
        fail_ofd_locks: Some(libc::EINVAL),
        ..BackendOpts::default()
    };
    let auto = Backend::start(&dir, &img, &opts);
    let mut c = connect_queues(&auto.socket, 1);
    assert_eq!(c.write_at(0, 0, &[1u8; 4096]), 0);
    drop(c);
    assert_eq!(auto.sigterm_and_wait(EXIT_DEADLINE).code(), Some(0));
    assert!(
        auto.log_contents().contains("has no OFD locks"),
        "{}",
        auto.log_contents()
    );
    assert!(!byte_locked(&img, 101));

    let mut on = Command::new(env!("CARGO_BIN_EXE_vublk"));
    on.arg("--socket-path")
        .arg(dir.join("on.sock"))
        .arg("--blk-file")
        .arg(&img)
        .args(["--locking", "on"])
        .stdin(Stdio::null())
        .stderr(Stdio::piped());
    use std::os::unix::process::CommandExt;
    // SAFETY: the hook only calls async-signal-safe prctl() between fork and exec.
    unsafe {
        on.pre_exec(|| fail_ofd_setlk(libc::EINVAL));
    }
    let o = on.output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("cannot lock image"), "{err}");
}

/// A block device is locked like a file (QEMU locks host devices too): while vublk serves a
/// loop device, qemu-io cannot write it and a second vublk is refused; after a clean exit
/// qemu-io writes it again.
#[test]
fn a_served_block_device_is_locked_too() {
    if skip_unless_vublk("vublk's locking") || !have_qemu_tools() {
        return;
    }
    let dir = TestDir::new("lock-blockdev");
    let backing = dir.join("backing.raw");
    std::fs::write(&backing, vec![0x22u8; 8 << 20]).unwrap();
    let Some(dev) = LoopDev::new(&backing, 512) else {
        return;
    };
    let dev = Path::new(&dev.0).to_path_buf();
    let backend = Backend::start(&dir, &dev, &BackendOpts::default());
    let c = connect(&backend.socket, ClientOpts::default());

    let (ok, out) = qemu_io(&dev, "raw", false, "write -P 0x55 0 64k");
    assert!(!ok, "qemu-io wrote a served block device:\n{out}");
    assert!(out.contains("Failed to get"), "{out}");
    let (code, err) = vublk_refuses(&dir, &dev, &[]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("in use by another process"), "{err}");

    drop(c);
    assert_eq!(backend.sigterm_and_wait(EXIT_DEADLINE).code(), Some(0));
    let (ok, out) = qemu_io(&dev, "raw", false, "write -P 0x55 0 64k");
    assert!(ok, "the locks outlived vublk:\n{out}");
}
