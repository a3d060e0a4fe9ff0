//! librbd through vublk's FFI module (cargo feature `rbd`) against a throwaway single-node
//! Ceph cluster (contrib/ceph/cluster.sh: one monitor on 127.0.0.1, one memstore OSD),
//! started and stopped (by PID) by the test: asynchronous writes, reads, write-zeroes,
//! discard and flush complete through the image's eventfd and equal `rbd export`; a
//! snapshot opens read-only; a missing image or pool fails with librbd's reason, and a
//! cluster nobody answers for fails within the timeout instead of hanging.

#![cfg(feature = "rbd")]

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::*;
use vublk::rbd::{Cluster, RbdImage, RbdSpec};

/// A running cluster, stopped when dropped.
struct Ceph {
    dir: PathBuf,
    conf: PathBuf,
}

impl Ceph {
    fn start(dir: &TestDir) -> Option<Ceph> {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("contrib/ceph/cluster.sh");
        let cdir = dir.join("ceph");
        let o = Command::new("bash")
            .arg(&script)
            .arg("start")
            .arg(&cdir)
            .arg((512u64 << 20).to_string())
            .output()
            .unwrap();
        if o.status.code() == Some(77) {
            return skip_or_fail(&format!(
                "no Ceph here: {}",
                String::from_utf8_lossy(&o.stderr).trim()
            ));
        }
        assert!(
            o.status.success(),
            "starting the cluster: {}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
        Some(Ceph {
            conf: cdir.join("ceph.conf"),
            dir: cdir,
        })
    }

    fn rbd(&self, args: &[&str]) -> String {
        run_ok(Command::new("rbd").arg("-c").arg(&self.conf).args(args))
    }
}

impl Drop for Ceph {
    fn drop(&mut self) {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("contrib/ceph/cluster.sh");
        let _ = Command::new("bash")
            .arg(script)
            .arg("stop")
            .arg(&self.dir)
            .status();
    }
}

/// Wait for `n` completions on `img`.
fn wait(img: &RbdImage, n: usize) -> Vec<(u64, i64)> {
    let mut out = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    while out.len() < n {
        assert!(
            Instant::now() < deadline,
            "{} of {n} completions",
            out.len()
        );
        let mut p = libc::pollfd {
            fd: img.event_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd.
        unsafe { libc::poll(&mut p, 1, 100) };
        img.poll(&mut out);
    }
    out
}

#[test]
fn aio_through_librbd_matches_rbd_export() {
    let dir = TestDir::new("rbd-aio");
    let Some(ceph) = Ceph::start(&dir) else {
        return;
    };
    ceph.rbd(&["create", "rbd/disk", "--size", "64M"]);
    let cluster = Cluster::connect(&ceph.conf, "admin", None, Duration::from_secs(10)).unwrap();
    let spec = RbdSpec::parse("rbd:rbd/disk").unwrap().unwrap();
    let img = RbdImage::open(cluster.clone(), &spec, false).unwrap();
    assert_eq!(img.size().unwrap(), 64 * MIB);

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
        img.writev(&iov, MIB, 1).unwrap();
        img.writev(&biov, 4 * MIB, 6).unwrap();
        img.writev(&biov, 8 * MIB, 7).unwrap();
    }
    let done = wait(&img, 3);
    assert!(done.iter().all(|&(_, r)| r >= 0), "{done:?}");
    img.write_zeroes(4 * MIB, 65536, 2).unwrap();
    assert_eq!(wait(&img, 1), vec![(2, 0)]);
    img.flush(3).unwrap();
    assert_eq!(wait(&img, 1), vec![(3, 0)]);
    let mut back = vec![0u8; 12288];
    let riov = [libc::iovec {
        iov_base: back.as_mut_ptr().cast(),
        iov_len: back.len(),
    }];
    // SAFETY: `back` lives until the completion.
    unsafe { img.readv(&riov, MIB, 4).unwrap() };
    let r = wait(&img, 1);
    assert_eq!(r, vec![(4, 12288)]);
    assert_same(&back[..8192], &a, "read back");
    assert_same(&back[8192..], &b, "read back");
    // librbd ignores discards smaller than its granularity (64 KiB): a whole one here.
    img.discard(8 * MIB, 65536, 5).unwrap();
    assert_eq!(wait(&img, 1), vec![(5, 0)]);
    drop(img);

    let out = dir.join("export.raw");
    ceph.rbd(&["export", "rbd/disk", out.to_str().unwrap()]);
    let e = read_file(&out);
    assert_eq!(e.len() as u64, 64 * MIB);
    assert_same(&e[MIB as usize..MIB as usize + 8192], &a, "exported");
    assert_all_zero(&e[4 * MIB as usize..4 * MIB as usize + 65536], "zeroed");
    assert_all_zero(&e[8 * MIB as usize..8 * MIB as usize + 65536], "discarded");
    assert_same(
        &e[MIB as usize + 8192..MIB as usize + 12288],
        &b,
        "exported",
    );

    // A snapshot opens read-only and keeps what was there.
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

/// A configuration naming a monitor nobody runs: connecting fails within the timeout.
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
    let r = Cluster::connect(&conf, "admin", None, Duration::from_secs(3));
    assert!(r.is_err());
    assert!(
        t.elapsed() < Duration::from_secs(20),
        "connecting took {:?}",
        t.elapsed()
    );
}
