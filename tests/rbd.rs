//! Ceph RBD images (cargo feature `rbd`) against a throwaway single-node cluster
//! (tests/common/ceph.rs: one monitor on 127.0.0.1, one memstore OSD), started and stopped
//! (by PID) by each test:
//! - vublk's librbd module on its own: asynchronous I/O completing into an inbox equals
//!   `rbd export`; a snapshot opens read-only; missing images and pools fail with librbd's
//!   reason; a cluster nobody answers fails within the timeout;
//! - vublk serving `rbd:POOL/IMAGE` to libblkio: a randomized model check of every request
//!   type that must equal `rbd export` afterwards; a snapshot served read-only; a resize in
//!   the cluster noticed and `vublk ctl resize` resizing the image; the exclusive lock keeping
//!   a second vublk out; a stalled cluster giving I/O errors within `--ceph-op-timeout`
//!   instead of a hang, and serving again when it answers; start-up failures exiting 1 with
//!   the reason in bounded time.

#![cfg(feature = "rbd")]

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use vublk::io::Completion;
use vublk::offload::Inbox;
use vublk::rbd::{Cluster, ConnectOptions, RbdImage, RbdSpec};

const CLUSTER_BYTES: u64 = 768 << 20;

fn connect_opts(conf: &Path, timeout: Duration) -> ConnectOptions {
    ConnectOptions {
        conf: conf.to_owned(),
        id: "admin".into(),
        keyring: None,
        timeout,
        op_timeout: Duration::from_secs(30),
        settings: Vec::new(),
    }
}

/// An inbox over a fresh eventfd, and a way to wait for `n` completions.
struct Waiter {
    inbox: Arc<Inbox>,
    _efd: vmm_sys_util::eventfd::EventFd,
}

impl Waiter {
    fn new() -> Waiter {
        use std::os::fd::AsRawFd;
        let efd = vmm_sys_util::eventfd::EventFd::new(libc::EFD_NONBLOCK).unwrap();
        Waiter {
            inbox: Inbox::new(efd.as_raw_fd()).unwrap(),
            _efd: efd,
        }
    }

    fn wait(&self, n: usize) -> Vec<(u64, i32)> {
        let mut out: Vec<Completion> = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(30);
        while out.len() < n {
            assert!(
                Instant::now() < deadline,
                "{} of {n} completions",
                out.len()
            );
            self.inbox.wait(Duration::from_millis(100));
            self.inbox.take(&mut out);
        }
        let mut v: Vec<_> = out.iter().map(|c| (c.user_data, c.result)).collect();
        v.sort_unstable();
        v
    }
}

#[test]
fn librbd_aio_completes_into_the_inbox_and_matches_rbd_export() {
    let dir = TestDir::new("rbd-aio");
    let Some(ceph) = Ceph::start(&dir.path, 512 << 20) else {
        return;
    };
    ceph.rbd(&["create", "rbd/disk", "--size", "64M"]);
    let cluster = Cluster::connect(&connect_opts(&ceph.conf, Duration::from_secs(10))).unwrap();
    let spec = RbdSpec::parse("rbd:rbd/disk").unwrap().unwrap();
    let img = RbdImage::open(cluster.clone(), &spec, false).unwrap();
    assert_eq!(img.size().unwrap(), 64 * MIB);
    let w = Waiter::new();
    let to = &w.inbox;

    // Writes of a pattern from two buffers (one request), at 1 MiB.
    let a = pattern(8192, 0, 9);
    let b = pattern(4096, 8192, 9);
    let iov = [
        libc::iovec {
            iov_base: a.as_ptr() as *mut _,
            iov_len: a.len(),
        },
        libc::iovec {
            iov_base: b.as_ptr() as *mut _,
            iov_len: b.len(),
        },
    ];
    // 64 KiB of pattern at 4 MiB and at 8 MiB, to be zeroed and discarded below.
    let big = pattern(65536, 0, 10);
    let biov = [libc::iovec {
        iov_base: big.as_ptr() as *mut _,
        iov_len: big.len(),
    }];
    // SAFETY: the buffers live until the completions are taken below.
    unsafe {
        img.writev(&iov, MIB, to, 1).unwrap();
        img.writev(&biov, 4 * MIB, to, 6).unwrap();
        img.writev(&biov, 8 * MIB, to, 7).unwrap();
    }
    assert_eq!(w.wait(3), vec![(1, 12288), (6, 65536), (7, 65536)]);
    img.write_zeroes(4 * MIB, 65536, false, to, 2).unwrap();
    assert_eq!(w.wait(1), vec![(2, 0)]);
    img.flush(to, 3).unwrap();
    assert_eq!(w.wait(1), vec![(3, 0)]);
    let mut back = vec![0u8; 12288];
    let riov = [libc::iovec {
        iov_base: back.as_mut_ptr().cast(),
        iov_len: back.len(),
    }];
    // SAFETY: `back` lives until the completion.
    unsafe { img.readv(&riov, MIB, to, 4).unwrap() };
    assert_eq!(w.wait(1), vec![(4, 12288)]);
    assert_same(&back[..8192], &a, "read back");
    assert_same(&back[8192..], &b, "read back");
    // librbd ignores discards smaller than its granularity (64 KiB): a whole one here.
    img.discard(8 * MIB, 65536, to, 5).unwrap();
    assert_eq!(w.wait(1), vec![(5, 0)]);
    drop(img);

    let e = ceph.export("rbd/disk", &dir.join("export.raw"));
    assert_eq!(e.len() as u64, 64 * MIB);
    let m = MIB as usize;
    assert_same(&e[m..m + 8192], &a, "exported");
    assert_same(&e[m + 8192..m + 12288], &b, "exported");
    assert_all_zero(&e[4 * m..4 * m + 65536], "zeroed");
    assert_all_zero(&e[8 * m..8 * m + 65536], "discarded");

    // A snapshot opens read-only.
    ceph.rbd(&["snap", "create", "rbd/disk@s1"]);
    let snap = RbdImage::open(
        cluster.clone(),
        &RbdSpec::parse("rbd:rbd/disk@s1").unwrap().unwrap(),
        false,
    )
    .unwrap();
    assert!(snap.read_only);
    // Missing image and pool: librbd's reason, naming what was opened.
    let e = RbdImage::open(
        cluster.clone(),
        &RbdSpec::parse("rbd:rbd/nope").unwrap().unwrap(),
        false,
    )
    .err()
    .unwrap();
    assert!(
        e.to_string().contains("rbd/nope") && e.errno == libc::ENOENT,
        "{e}"
    );
    let e = RbdImage::open(
        cluster,
        &RbdSpec::parse("rbd:nopool/disk").unwrap().unwrap(),
        false,
    )
    .err()
    .unwrap();
    assert!(e.to_string().contains("nopool"), "{e}");
    drop(snap);
}

/// Run vublk until it exits (at most `limit`): its status, stderr and how long it took.
fn vublk_fails(
    dir: &TestDir,
    blk: &str,
    extra: &[String],
    limit: Duration,
) -> (i32, String, Duration) {
    let sock = dir.join("fail.sock");
    let t0 = Instant::now();
    let mut child = Command::new(env!("CARGO_BIN_EXE_vublk"))
        .arg("--socket-path")
        .arg(&sock)
        .arg("--blk-file")
        .arg(blk)
        .args(extra)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        if t0.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!("vublk --blk-file {blk} still running after {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut err = String::new();
    use std::io::Read;
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    (status.code().unwrap_or(-1), err, t0.elapsed())
}

/// A configuration naming a monitor nobody runs: connecting fails within the timeout, and
/// vublk exits 1 with the reason instead of hanging at start-up.
#[test]
fn a_cluster_that_does_not_answer_fails_in_bounded_time() {
    let dir = TestDir::new("rbd-dead");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let conf = dir.join("ceph.conf");
    std::fs::write(
        &conf,
        format!(
            "[global]\nmon host = v1:127.0.0.1:{port}\nauth client required = none\n\
             log file = {}\n",
            dir.join("client.log").display()
        ),
    )
    .unwrap();
    let t = Instant::now();
    let r = Cluster::connect(&connect_opts(&conf, Duration::from_secs(3)));
    assert!(r.is_err());
    assert!(
        t.elapsed() < Duration::from_secs(20),
        "connecting took {:?}",
        t.elapsed()
    );
    let (code, err, took) = vublk_fails(
        &dir,
        "rbd:rbd/disk",
        &[
            "--ceph-conf".into(),
            conf.display().to_string(),
            "--ceph-timeout".into(),
            "3".into(),
        ],
        Duration::from_secs(30),
    );
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("connecting to the cluster") && err.contains("--ceph-conf"),
        "{err}"
    );
    println!(
        "an unreachable cluster: exit 1 after {took:?}: {}",
        err.trim()
    );
    // A configuration file that is not there.
    let (code, err, _) = vublk_fails(
        &dir,
        "rbd:rbd/disk",
        &["--ceph-conf".into(), "/nonexistent/ceph.conf".into()],
        Duration::from_secs(30),
    );
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("/nonexistent/ceph.conf"), "{err}");
}

/// vublk serving `rbd:rbd/NAME` of `ceph` with `extra` options.
fn serve(dir: &TestDir, ceph: &Ceph, name: &str, extra: &[&str], read_only: bool) -> Backend {
    let mut args = ceph.args();
    args.extend(extra.iter().map(|s| s.to_string()));
    Backend::start(
        dir,
        Path::new(&format!("rbd:rbd/{name}")),
        &BackendOpts {
            read_only,
            extra_args: args,
            ..Default::default()
        },
    )
}

/// The randomized model check on an RBD image: writes (some all zeroes), reads, WRITE_ZEROES
/// with and without UNMAP, DISCARD, FLUSH; every read and the whole disk at the end equal
/// the model, and so does `rbd export` of the image after vublk exited.
fn model_check(name: &str, extra: &[&str]) {
    const SIZE: u64 = 32 * MIB;
    const OPS: usize = 400;
    let dir = TestDir::new(name);
    let Some(ceph) = Ceph::start(&dir.path, CLUSTER_BYTES) else {
        return;
    };
    ceph.rbd(&["create", "rbd/disk", "--size", "32M"]);
    let mut extra = extra.to_vec();
    extra.extend(["--discard", "unmap"]);
    let backend = serve(&dir, &ceph, "disk", &extra, false);
    let mut c = connect(&backend.socket, ClientOpts::default());
    assert_eq!(c.capacity(), SIZE);
    let m = random_requests(&mut c, SIZE, OPS, 0x5eed_0018);
    let all = c.read_all(0);
    m.check(&all, 0, "the whole disk through vublk");
    drop(c);
    let st = backend.sigterm_and_wait(EXIT_DEADLINE);
    assert!(st.success(), "{st}\n{}", backend.log_contents());
    let e = ceph.export("rbd/disk", &dir.join("export.raw"));
    assert_eq!(e.len() as u64, SIZE);
    // What the guest read is what the cluster has.
    assert_same(&e, &all, "rbd export after vublk exited");
}

#[test]
fn served_rbd_image_matches_model_and_rbd_export() {
    model_check("rbd-model", &[]);
}

/// librbd's write-back cache: WCE 1, FLUSH is rbd_aio_flush; detect-zeroes converts zero
/// writes.
#[test]
fn served_rbd_image_with_librbd_cache_and_detect_zeroes_matches_model() {
    model_check(
        "rbd-model-cache",
        &["--cache", "writeback", "--detect-zeroes", "on"],
    );
}

/// A snapshot is served read-only with the data it was taken with; writes are refused;
/// a bad image or pool exits 1 with librbd's reason.
#[test]
fn snapshot_served_read_only_and_bad_names_refused() {
    let dir = TestDir::new("rbd-snap");
    let Some(ceph) = Ceph::start(&dir.path, 512 << 20) else {
        return;
    };
    ceph.rbd(&["create", "rbd/disk", "--size", "16M"]);
    let data = pattern(4 * MIB as usize, 0, 18);
    let src = dir.join("pattern.raw");
    std::fs::write(&src, &data).unwrap();
    // `rbd import` of a 4 MiB pattern over the start of the disk.
    ceph.rbd(&["rm", "rbd/disk"]);
    ceph.rbd(&["import", src.to_str().unwrap(), "rbd/disk"]);
    ceph.rbd(&["resize", "rbd/disk", "--size", "16M"]);
    ceph.rbd(&["snap", "create", "rbd/disk@before"]);
    // Overwritten after the snapshot: not what the snapshot serves.
    ceph.rbd(&[
        "bench",
        "--io-type",
        "write",
        "--io-size",
        "64K",
        "--io-total",
        "4M",
        "--io-pattern",
        "seq",
        "rbd/disk",
    ]);

    let backend = serve(&dir, &ceph, "disk@before", &[], false);
    let mut c = connect(
        &backend.socket,
        ClientOpts {
            read_only: true,
            ..Default::default()
        },
    );
    assert_eq!(c.capacity(), 16 * MIB);
    assert!(
        c.blkio.get_bool("read-only").unwrap_or(false),
        "the snapshot is not read-only"
    );
    let got = c.read_at(0, 0, MIB as usize).unwrap();
    assert_same(&got, &data[..MIB as usize], "snapshot read");
    let ret = c.write_at(0, 0, &[1u8; 4096]);
    assert_ne!(ret, 0, "a write to a snapshot succeeded");
    drop(c);
    assert!(backend.sigterm_and_wait(EXIT_DEADLINE).success());

    for (blk, want) in [
        ("rbd:rbd/nope", "rbd/nope"),
        ("rbd:nopool/disk", "nopool"),
        ("rbd:rbd/disk@nosnap", "disk@nosnap"),
        ("rbd:rbd", "expected rbd:POOL/IMAGE"),
    ] {
        let (code, err, took) = vublk_fails(&dir, blk, &ceph.args(), Duration::from_secs(30));
        assert!(code == 1 || code == 2, "{blk}: exit {code}: {err}");
        assert!(err.contains(want), "{blk}: {err}");
        println!("{blk}: exit {code} after {took:?}: {}", err.trim());
    }
}

/// A cluster with a new 32 MiB image `rbd/disk` served by a vublk with a control socket:
/// (the cluster, the backend, the control socket), or None where Ceph is missing (skipped).
fn serve_new_disk_with_control(dir: &TestDir) -> Option<(Ceph, Backend, PathBuf)> {
    let ceph = Ceph::start(&dir.path, 512 << 20)?;
    ceph.rbd(&["create", "rbd/disk", "--size", "32M"]);
    let sock = dir.join("ctl.sock");
    let sock_arg = sock.display().to_string();
    let backend = serve(dir, &ceph, "disk", &["--control-socket", &sock_arg], false);
    Some((ceph, backend, sock))
}

fn rbd_size(ceph: &Ceph, image: &str) -> u64 {
    let v: serde_json::Value =
        serde_json::from_str(&ceph.rbd(&["info", image, "--format", "json"])).unwrap();
    v["size"].as_u64().unwrap()
}

/// `rbd resize` in the cluster reaches the device (librbd's update watch), and `vublk ctl
/// resize` resizes the image in the cluster.
#[test]
fn resizes_in_the_cluster_and_through_ctl() {
    let dir = TestDir::new("rbd-resize");
    let Some((ceph, backend, sock)) = serve_new_disk_with_control(&dir) else {
        return;
    };
    let mut c = connect(&backend.socket, ClientOpts::default());
    let data = pattern(65536, 0, 7);
    assert_eq!(c.write_at(0, 32 * MIB - 65536, &data), 0);

    ceph.rbd(&["resize", "rbd/disk", "--size", "48M"]);
    let t0 = Instant::now();
    let size = |s: &Path| ctl_ok(s, "status", &[])["size_bytes"].as_u64().unwrap();
    while size(&sock) != 48 * MIB {
        assert!(
            t0.elapsed() < Duration::from_secs(15),
            "the device never saw the resize in the cluster:\n{}",
            backend.log_contents()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    println!("rbd resize seen by vublk after {:?}", t0.elapsed());

    let r = ctl_ok(&sock, "resize", &["64M"]);
    assert_eq!(r["size_bytes"].as_u64(), Some(64 * MIB), "{r}");
    assert_eq!(rbd_size(&ceph, "rbd/disk"), 64 * MIB);
    // Shrinking is refused and changes nothing.
    let o = Command::new(env!("CARGO_BIN_EXE_vublk"))
        .args([
            "ctl",
            "--control-socket",
            &sock.display().to_string(),
            "resize",
            "16M",
        ])
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert_eq!(rbd_size(&ceph, "rbd/disk"), 64 * MIB);
    // The old last block is still there; the new end is writable.
    assert_eq!(
        c.read_at(0, 32 * MIB - 65536, 65536).unwrap(),
        data,
        "the old end after the resizes"
    );
    drop(c);
    let mut c = connect(&backend.socket, ClientOpts::default());
    assert_eq!(c.capacity(), 64 * MIB);
    assert_eq!(c.write_at(0, 64 * MIB - 65536, &data), 0);
    assert_eq!(c.read_at(0, 64 * MIB - 65536, 65536).unwrap(), data);
    drop(c);
    assert!(backend.sigterm_and_wait(EXIT_DEADLINE).success());
}

/// vublk holds the image's exclusive lock: a second vublk on the same image waits
/// `--ceph-lock-wait`, then exits 1 saying why; once the first is gone it serves.
#[test]
fn the_exclusive_lock_keeps_a_second_vublk_out() {
    let dir = TestDir::new("rbd-lock");
    let Some(ceph) = Ceph::start(&dir.path, 512 << 20) else {
        return;
    };
    ceph.rbd(&["create", "rbd/disk", "--size", "16M"]);
    let first = serve(&dir, &ceph, "disk", &[], false);
    let mut c = connect(&first.socket, ClientOpts::default());
    assert_eq!(c.write_at(0, 0, &[7u8; 4096]), 0);
    let lockers = ceph.rbd(&["lock", "ls", "rbd/disk"]);
    println!("rbd lock ls: {lockers}");
    let mut args = ceph.args();
    args.extend(["--ceph-lock-wait".into(), "2".into()]);
    let (code, err, took) = vublk_fails(&dir, "rbd:rbd/disk", &args, Duration::from_secs(40));
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("in use by another client"), "{err}");
    println!("second vublk: exit 1 after {took:?}: {}", err.trim());
    // The first still serves.
    assert_eq!(c.write_at(0, 4096, &[8u8; 4096]), 0);
    drop(c);
    assert!(first.sigterm_and_wait(EXIT_DEADLINE).success());
    // Released at exit: the next one takes it at once.
    let second = serve(&dir, &ceph, "disk", &[], false);
    let mut c = connect(&second.socket, ClientOpts::default());
    assert_eq!(
        c.read_at(0, 0, 8192).unwrap()[..],
        [[7u8; 4096], [8u8; 4096]].concat()[..]
    );
    drop(c);
    assert!(second.sigterm_and_wait(EXIT_DEADLINE).success());
    assert!(
        second.log_contents().contains("exclusive lock held"),
        "{}",
        second.log_contents()
    );
}

/// A vublk stopped with SIGTERM closes the image and its cluster connection before it
/// exits: `rbd status` lists no watcher right after (a killed client's watch would linger
/// until the OSD times it out, about 30 s), and the next client takes the exclusive lock at
/// once. Both with a frontend connected at the SIGTERM and with none.
#[test]
fn sigterm_leaves_no_watcher_on_the_image() {
    let dir = TestDir::new("rbd-unwatch");
    let Some(ceph) = Ceph::start(&dir.path, 512 << 20) else {
        return;
    };
    ceph.rbd(&["create", "rbd/disk", "--size", "16M"]);
    for connected in [true, false] {
        let backend = serve(&dir, &ceph, "disk", &[], false);
        let status = ceph.rbd(&["status", "rbd/disk"]);
        assert!(
            status.contains("watcher="),
            "a served image has a watcher: {status}"
        );
        let c = connected.then(|| {
            let mut c = connect(&backend.socket, ClientOpts::default());
            assert_eq!(c.write_at(0, 0, &[9u8; 4096]), 0);
            c
        });
        assert!(backend.sigterm_and_wait(EXIT_DEADLINE).success());
        drop(c);
        let status = ceph.rbd(&["status", "rbd/disk"]);
        assert!(
            status.contains("Watchers: none") && !status.contains("watcher="),
            "frontend connected: {connected}: after SIGTERM `rbd status` says:\n{status}\n{}",
            backend.log_contents()
        );
        assert!(backend
            .log_contents()
            .contains("cluster connection shut down"));
    }
}

/// The cluster stops answering (its daemons SIGSTOPped) under load: requests fail with I/O
/// errors once `--ceph-op-timeout` has passed instead of hanging, vublk keeps running, and
/// once the cluster answers again new requests succeed and the data written before is there.
#[test]
fn a_stalled_cluster_gives_io_errors_and_vublk_recovers() {
    let dir = TestDir::new("rbd-stall");
    let Some(ceph) = Ceph::start(&dir.path, 512 << 20) else {
        return;
    };
    ceph.rbd(&["create", "rbd/disk", "--size", "16M"]);
    let backend = serve(&dir, &ceph, "disk", &["--ceph-op-timeout", "3"], false);
    let mut c = connect(&backend.socket, ClientOpts::default());
    let before = pattern(MIB as usize, 0, 3);
    assert_eq!(c.write_at(0, 0, &before), 0);
    assert_eq!(c.submit(0, Op::Flush), 0);

    ceph.signal_all(libc::SIGSTOP);
    let t0 = Instant::now();
    // A batch of writes and reads in flight together while nobody answers.
    c.mem_mut()[..MIB as usize].fill(0x33);
    let ops: Vec<Op> = (0..8)
        .map(|i| {
            if i % 2 == 0 {
                Op::Write {
                    offset: 2 * MIB + i * 65536,
                    buf: 0,
                    len: 65536,
                }
            } else {
                Op::Read {
                    offset: i * 65536,
                    buf: (i as usize) * 65536,
                    len: 65536,
                }
            }
        })
        .collect();
    let rets = c.submit_batch(0, &ops);
    let took = t0.elapsed();
    println!("while stalled: {rets:?} after {took:?}");
    assert!(
        rets.iter().all(|&r| r == -libc::EIO),
        "requests to a stalled cluster: {rets:?}"
    );
    assert!(
        took >= Duration::from_secs(2),
        "failed before the timeout: {took:?}"
    );
    backend.assert_running();

    ceph.signal_all(libc::SIGCONT);
    let t1 = Instant::now();
    let after = pattern(65536, 0, 4);
    loop {
        let r = c.write_at(0, 4 * MIB, &after);
        if r == 0 {
            break;
        }
        assert!(
            t1.elapsed() < Duration::from_secs(60),
            "still failing {:?} after the cluster came back: {}\n{}",
            t1.elapsed(),
            errno_name(r),
            backend.log_contents()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    println!(
        "serving again {:?} after the cluster came back",
        t1.elapsed()
    );
    assert_eq!(c.read_at(0, 0, MIB as usize).unwrap(), before);
    assert_eq!(c.read_at(0, 4 * MIB, 65536).unwrap(), after);
    drop(c);
    assert!(backend.sigterm_and_wait(EXIT_DEADLINE).success());
    let e = ceph.export("rbd/disk", &dir.join("export.raw"));
    assert_same(&e[..MIB as usize], &before, "exported");
}

/// A backup of an RBD image (docs/backups.md): the export read with nbdcopy after the begin
/// equals the disk at the begin, though the guest rewrote much of it meanwhile (the view's
/// copies before writes come through a librbd engine of its own).
#[test]
fn a_backup_of_an_rbd_image_is_its_state_at_the_begin() {
    if Command::new("nbdcopy").arg("--version").output().is_err()
        && skip_or_fail::<()>("nbdcopy missing (libnbd-bin)").is_none()
    {
        return;
    }
    let dir = TestDir::new("rbd-backup");
    let Some((_ceph, backend, sock)) = serve_new_disk_with_control(&dir) else {
        return;
    };
    let mut c = connect(&backend.socket, ClientOpts::default());
    // The lower half written, the upper half never (holes for base:allocation).
    for i in 0..16u64 {
        assert_eq!(
            c.write_at(0, i * MIB, &pattern(MIB as usize, i * MIB, 3)),
            0
        );
    }
    let reference = c.read_all(0);
    let nbd = dir.join("nbd.sock");
    let uri = backup_begin(
        &sock,
        &["--checkpoint", "b", "--socket", &nbd.display().to_string()],
    );
    // Rewrite every other megabyte of the lower half, and zero some.
    for i in (0..16u64).step_by(2) {
        assert_eq!(c.write_at(0, i * MIB + 4096, &[0xa5u8; 65536]), 0);
    }
    assert_eq!(c.write_at(0, 7 * MIB, &vec![0u8; MIB as usize]), 0);
    let out = dir.join("backup.raw");
    nbdcopy_ok(&uri, &out);
    assert_same(&read_file(&out), &reference, "the backup of the RBD image");
    let l = ctl_ok(&sock, "backup-list", &[]);
    assert!(
        l["backups"][0]["copied_bytes"].as_u64().unwrap() >= 8 * 65536,
        "{l}"
    );
    // base:allocation from librbd's diff walk: the lower half data, the upper half holes.
    let map = Command::new("nbdinfo")
        .args(["--map=base:allocation", &uri])
        .output()
        .unwrap();
    assert!(
        map.status.success(),
        "{}",
        String::from_utf8_lossy(&map.stderr)
    );
    let map = String::from_utf8_lossy(&map.stdout).into_owned();
    let mut kinds = [u32::MAX; 32];
    for line in map.lines() {
        let f: Vec<u64> = line
            .split_whitespace()
            .take(3)
            .filter_map(|x| x.parse().ok())
            .collect();
        if let [o, n, t] = f[..] {
            for m in o / MIB..(o + n) / MIB {
                kinds[m as usize] = t as u32;
            }
        }
    }
    assert!(kinds[..16].iter().all(|&t| t == 0), "{map}");
    assert!(kinds[16..].iter().all(|&t| t == 3), "{map}");
    ctl_ok(&sock, "backup-end", &["--checkpoint", "b"]);
    // And the disk has the new data.
    assert_eq!(c.read_at(0, 4096, 65536).unwrap(), vec![0xa5u8; 65536]);
    drop(c);
    assert!(backend.sigterm_and_wait(EXIT_DEADLINE).success());
}

/// A pool over its quota (`ceph osd pool set-quota`; the cluster's manager reports its use):
/// the cluster answers writes with EDQUOT (vublk asks librados not to wait on a full pool),
/// vublk holds them (the default `--werror enospc`), and completes them with their data
/// once the quota is raised (docs/error-policy.md).
#[test]
fn writes_to_a_pool_over_its_quota_are_held_until_it_is_raised() {
    let dir = TestDir::new("rbd-quota");
    let Some(ceph) = Ceph::start_with_mgr(&dir.path, CLUSTER_BYTES) else {
        return;
    };
    ceph.rbd(&["create", "rbd/disk", "--size", "32M"]);
    ceph.ceph(&["osd", "pool", "set-quota", "rbd", "max_bytes", "4194304"]);
    let ctl = dir.join("ctl.sock");
    let ctl_arg = ctl.display().to_string();
    let backend = serve(
        &dir,
        &ceph,
        "disk",
        &["--control-socket", &ctl_arg, "--error-retry-interval", "1"],
        false,
    );
    let mut c = connect(&backend.socket, ClientOpts::default());
    let data = |i: u64| pattern(MIB as usize, i * MIB, 0x9a);
    // Over the quota (it is checked after the fact): these succeed.
    for i in 0..6 {
        assert_eq!(c.write_at(0, i * MIB, &data(i)), 0, "write {i}");
    }
    let full = || {
        ceph.ceph(&["osd", "pool", "ls", "detail"])
            .contains("full_quota")
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    while !full() {
        assert!(Instant::now() < deadline, "the pool never became full");
        std::thread::sleep(Duration::from_millis(200));
    }
    let held = || ctl_ok(&ctl, "status", &[])["error_policy"]["held"].clone();
    let results = std::thread::scope(|s| {
        let h = s.spawn(|| {
            (6..8)
                .map(|i| c.write_at(0, i * MIB, &data(i)))
                .collect::<Vec<_>>()
        });
        let deadline = Instant::now() + Duration::from_secs(30);
        while held()["errno"] != libc::EDQUOT {
            assert!(Instant::now() < deadline, "nothing held: {}", held());
            std::thread::sleep(Duration::from_millis(50));
        }
        assert_eq!(held()["requests"], 1);
        std::thread::sleep(Duration::from_millis(1500));
        assert_eq!(held()["requests"], 1, "no longer held with the pool full");
        ceph.ceph(&["osd", "pool", "set-quota", "rbd", "max_bytes", "0"]);
        h.join().unwrap()
    });
    assert_eq!(results, vec![0, 0], "a write failed");
    assert_eq!(held(), serde_json::Value::Null);
    let all = c.read_all(0);
    for i in 0..8 {
        assert_same(
            &all[(i * MIB) as usize..((i + 1) * MIB) as usize],
            &data(i),
            &format!("write {i}"),
        );
    }
    drop(c);
    assert!(backend.sigterm_and_wait(EXIT_DEADLINE).success());
    let e = ceph.export("rbd/disk", &dir.join("export.raw"));
    assert_same(&e, &all, "rbd export");
}
