//! Mirrors onto remote disks (docs/snapshots.md#mirror): an NBD export served by qemu-nbd
//! (a raw file, UNIX socket) or nbdkit (its memory plugin, 127.0.0.1), and an RBD image in
//! a throwaway cluster. Under a libblkio writer the job copies the whole disk (holes as
//! zeroes: the target held other data before), waits in `ready`, and on `job-complete` the
//! queues are given engines for the remote disk and go on serving the guest from it; the
//! target equals what the guest reads, and a restart serves it. `job-cancel` leaves the
//! guest on the source; a target too small, read-only or of another format is refused.

mod common;

use std::path::Path;
use std::time::Duration;

use common::*;
use serde_json::Value;

const SIZE: u64 = 32 * MIB;
const STOP: Duration = Duration::from_secs(10);

fn status(sock: &Path) -> Value {
    ctl_ok(sock, "status", &[])
}

/// Mirror a `src_fmt` disk under a writer onto `uri`, complete, write on: the guest is
/// served from `uri`; returns what the guest read at the end (after a flush), with the
/// daemon stopped; then a restart with the same command line serves `uri` again and reads
/// the same.
fn mirror_and_complete(dir: &TestDir, src_fmt: &str, uri: &str, extra: &[&str]) -> Vec<u8> {
    let img = make_disk(dir, src_fmt, SIZE);
    let (backend, sock) = start_with_control(dir, &img, 2, extra);
    let writer = Writer::start(connect_queues(&backend.socket, 2), 23);
    writer.run_for(50);
    let j = ctl_ok(&sock, "mirror", &["--id", "m", "--target", uri]);
    assert_eq!(j["type"], "mirror", "{j}");
    let j = wait_state(&sock, "m", "ready");
    println!("[{uri}] ready: {j}");
    writer.run_for(100);
    assert_eq!(status(&sock)["serving"], img.display().to_string());
    ctl_ok(&sock, "job-complete", &["m"]);
    let j = wait_job(&sock, "m");
    assert!(j["error"].is_null(), "{uri}: {j}");
    let st = status(&sock);
    assert_eq!(st["serving"], uri, "{st}");
    // The guest goes on, on the remote disk's engines.
    writer.run_for(100);
    let mut c = writer.stop();
    assert_eq!(c.submit(0, Op::Flush), 0);
    let end = c.read_all(0);
    drop(c);
    let log = backend.log_contents();
    assert!(
        log.contains("I/O engine nbd") || log.contains("I/O engine librbd"),
        "{log}"
    );
    assert_eq!(backend.sigterm_and_wait(STOP).code(), Some(0));
    // The source is let go.
    assert!(!holds_write(&img), "{uri}: the source is still held");
    let (backend, sock) = start_with_control(dir, &img, 1, extra);
    assert_eq!(status(&sock)["serving"], uri);
    let mut c = connect(&backend.socket, ClientOpts::default());
    assert_same(&c.read_all(0), &end, &format!("{uri}: after the restart"));
    drop(c);
    assert_eq!(backend.sigterm_and_wait(STOP).code(), Some(0));
    end
}

/// qemu-nbd exporting a raw file that held other data, and nbdkit's memory plugin: the
/// guest moves onto the export; the export's file (qemu-nbd) and a copy read off nbdkit
/// (nbdcopy) equal what the guest read.
#[test]
fn a_mirror_onto_nbd_exports_moves_the_guest_there() {
    if skip_chain_test("mirror jobs") {
        return;
    }
    // qemu-nbd: the target file is full of 0xee, so every hole of the disk must be written.
    let dir = TestDir::new("mirror-qemu-nbd");
    let file = dir.join("remote.raw");
    std::fs::write(&file, vec![0xee; SIZE as usize]).unwrap();
    let Some((server, sock)) = qemu_nbd(&dir, &file) else {
        return;
    };
    let uri = format!("nbd+unix:///disk?socket={}", sock.display());
    let end = mirror_and_complete(&dir, "qcow2", &uri, &[]);
    drop(server);
    assert_same(&std::fs::read(&file).unwrap(), &end, "the export's file");

    let dir = TestDir::new("mirror-nbdkit");
    let Some((server, port)) = nbdkit_memory(&format!("{SIZE}")) else {
        return;
    };
    let uri = format!("nbd://127.0.0.1:{port}");
    let end = mirror_and_complete(&dir, "raw", &uri, &[]);
    let copy = dir.join("copy.raw");
    nbdcopy_ok(&uri, &copy);
    assert_same(&std::fs::read(&copy).unwrap(), &end, "nbdkit's memory");
    drop(server);
}

/// `job-cancel` in `ready` leaves the guest on the source (the export keeps what was
/// copied); refusals: a target smaller than the disk, another format, `--sync top`, an
/// export nobody serves.
#[test]
fn a_remote_mirror_cancels_and_refuses_what_cannot_work() {
    if skip_chain_test("mirror jobs") {
        return;
    }
    let dir = TestDir::new("mirror-nbd-refusals");
    let img = make_disk(&dir, "raw", SIZE);
    let (backend, sock) = start_with_control(&dir, &img, 1, &[]);
    let refused = |args: &[&str], why: &str| {
        let (ok, _, err) = ctl(&sock, "mirror", args);
        assert!(!ok && err.contains(why), "mirror {args:?}: {err}");
    };
    let Some((small, port)) = nbdkit_memory(&format!("{}", SIZE / 2)) else {
        return;
    };
    refused(
        &["--target", &format!("nbd://127.0.0.1:{port}")],
        "smaller than the disk",
    );
    drop(small);
    let Some((server, port)) = nbdkit_memory(&format!("{SIZE}")) else {
        return;
    };
    let uri = format!("nbd://127.0.0.1:{port}");
    refused(&["--target", &uri, "--format", "qcow2"], "holds raw data");
    refused(&["--target", &uri, "--sync", "top"], "no backing file");
    let nobody = format!("nbd://127.0.0.1:{}", free_port());
    refused(&["--target", &nobody], "cannot open the target");
    let writer = Writer::start(connect_queues(&backend.socket, 1), 43);
    ctl_ok(&sock, "mirror", &["--id", "m", "--target", &uri]);
    wait_state(&sock, "m", "ready");
    writer.run_for(50);
    ctl_ok(&sock, "job-cancel", &["m"]);
    let j = wait_job(&sock, "m");
    assert!(!j["error"].is_null() || j["state"] == "concluded", "{j}");
    assert_eq!(status(&sock)["serving"], img.display().to_string());
    writer.run_for(50);
    let mut c = writer.stop();
    assert_eq!(c.submit(0, Op::Flush), 0);
    let end = c.read_all(0);
    drop(c);
    assert_eq!(backend.sigterm_and_wait(STOP).code(), Some(0));
    assert_same(&std::fs::read(&img).unwrap(), &end, "the source");
    drop(server);
}

/// An RBD image (created beforehand, as an operator would) in a throwaway cluster: the
/// guest moves from a qcow2 file onto it; `rbd export` equals what the guest read.
#[cfg(feature = "rbd")]
#[test]
fn a_mirror_onto_an_rbd_image_moves_the_guest_there() {
    if skip_chain_test("mirror jobs") {
        return;
    }
    let dir = TestDir::new("mirror-rbd");
    let Some(ceph) = Ceph::start(&dir.path, 512 << 20) else {
        return;
    };
    ceph.rbd(&[
        "create",
        "rbd/target",
        "--size",
        &format!("{}M", SIZE >> 20),
    ]);
    let extra: Vec<String> = ceph.args();
    let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
    let end = mirror_and_complete(&dir, "qcow2", "rbd:rbd/target", &extra);
    let got = ceph.export("rbd/target", &dir.join("export.raw"));
    assert_same(&got, &end, "the RBD image");
}
