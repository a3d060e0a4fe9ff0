//! NBD servers for the tests that talk to them (the NBD client, mirrors onto exports):
//! qemu-nbd on a UNIX socket, nbdkit on 127.0.0.1, each killed by PID when dropped.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::*;

/// A server process, killed (by PID) and reaped when dropped.
pub struct Server(pub Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

pub fn have(tool: &str) -> bool {
    Command::new(tool)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

pub fn wait_until(what: &str, mut ok: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !ok() {
        assert!(t0.elapsed() < Duration::from_secs(20), "{what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// qemu-nbd serving `file` (raw) as export `disk` on a UNIX socket in `dir`.
pub fn qemu_nbd(dir: &TestDir, file: &Path) -> Option<(Server, PathBuf)> {
    if !have("qemu-nbd") {
        return skip_or_fail("qemu-nbd missing (apt-get install qemu-utils)");
    }
    let sock = dir.join("nbd.sock");
    let child = Command::new("qemu-nbd")
        .arg("--socket")
        .arg(&sock)
        .args(["--export-name", "disk", "--format", "raw", "--persistent"])
        .args(["--shared", "0", "--cache", "none", "--aio", "io_uring"])
        .arg(file)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let s = Server(child);
    wait_until("qemu-nbd's socket", || sock.exists());
    Some((s, sock))
}

/// nbdkit with `args` (filters, plugin, parameters) on 127.0.0.1 at a free port.
pub fn nbdkit(args: &[&str]) -> Option<(Server, u16)> {
    if !have("nbdkit") {
        return skip_or_fail("nbdkit missing (apt-get install nbdkit)");
    }
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let child = Command::new("nbdkit")
        .args([
            "--foreground",
            "--exit-with-parent",
            "-i",
            "127.0.0.1",
            "-p",
        ])
        .arg(port.to_string())
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let s = Server(child);
    wait_until("nbdkit listening", || {
        std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
    });
    Some((s, port))
}

/// nbdkit's memory plugin (`size`).
pub fn nbdkit_memory(size: &str) -> Option<(Server, u16)> {
    nbdkit(&["memory", size])
}
