//! The installed Debian package (`contrib/package.sh`, then `dpkg -i`; `.ci/run` does both
//! before the tests): its files are where Debian and QEMU look for them, they describe the
//! installed binary, and the installed binary serves an image.

mod common;

use std::io::Read;
use std::path::Path;
use std::process::{Command, Stdio};

use common::*;

const BIN: &str = "/usr/bin/vublk";

fn installed() -> bool {
    let o = Command::new("dpkg-query")
        .args(["-W", "-f=${Status}", "vublk"])
        .output();
    o.is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("install ok installed"))
}

#[test]
fn the_installed_package_has_its_files_and_serves() {
    if !installed() {
        return skip_or_fail("the vublk Debian package is not installed (contrib/package.sh, then dpkg -i target/debian/vublk_*.deb)")
            .unwrap_or(());
    }
    for f in [
        BIN,
        "/lib/systemd/system/vublk@.service",
        "/lib/systemd/system/vublk@.socket",
        "/usr/share/bash-completion/completions/vublk",
        "/usr/share/zsh/vendor-completions/_vublk",
        "/usr/share/fish/vendor_completions.d/vublk.fish",
        // The README links ARCHITECTURE.md and the pages of docs/.
        "/usr/share/doc/vublk/README.md",
        "/usr/share/doc/vublk/ARCHITECTURE.md",
        "/usr/share/doc/vublk/docs/README.md",
        "/usr/share/doc/vublk/docs/operations.md",
    ] {
        assert!(Path::new(f).is_file(), "{f} is not installed");
    }
    // The man page: `man` finds it.
    let mut page = String::new();
    gunzip("/usr/share/man/man1/vublk.1.gz", &mut page);
    assert!(page.contains(".TH vublk 1"), "{page:.200}");
    // QEMU's backend descriptor names the installed binary, and its type is the binary's.
    let d: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string("/usr/share/qemu/vhost-user/50-vublk.json").unwrap(),
    )
    .unwrap();
    assert_eq!(d["binary"], BIN);
    let caps = Command::new(BIN)
        .arg("--print-capabilities")
        .output()
        .unwrap();
    assert!(caps.status.success());
    let caps: serde_json::Value = serde_json::from_slice(&caps.stdout).unwrap();
    assert_eq!(d["type"], caps["type"]);
    assert_eq!(d["type"], "block");
    // The unit starts the installed binary.
    let unit = std::fs::read_to_string("/lib/systemd/system/vublk@.service").unwrap();
    assert!(unit.contains(&format!("ExecStart={BIN} ")), "{unit}");

    // The installed binary serves an image.
    let dir = TestDir::new("package");
    let img = dir.join("disk.img");
    create_pattern_image(&img, 16 * MIB, 3);
    let sock = dir.join("vublk.sock");
    let mut child = Command::new(BIN)
        .arg("--socket-path")
        .arg(&sock)
        .arg("--blk-file")
        .arg(&img)
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let pid = child.id() as i32;
    let result = std::panic::catch_unwind(|| {
        let mut c = connect_queues(&sock, 1);
        assert_eq!(c.capacity(), 16 * MIB);
        assert_same(
            &c.read_at(0, 8192, 4096).unwrap(),
            &pattern(4096, 8192, 3),
            "read through the installed binary",
        );
    });
    // SAFETY: kill(2) on our own child, not yet reaped.
    unsafe { libc::kill(pid, libc::SIGTERM) };
    let status = child.wait().unwrap();
    if let Err(e) = result {
        std::panic::resume_unwind(e);
    }
    assert!(status.success(), "{status}");
}

/// `gzip -dc`, so the test needs no compression crate of its own.
fn gunzip(path: &str, out: &mut String) {
    let mut c = Command::new("gzip")
        .args(["-dc", path])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    c.stdout.take().unwrap().read_to_string(out).unwrap();
    assert!(c.wait().unwrap().success(), "gzip -dc {path}");
}
