//! A throwaway single-node Ceph cluster for the RBD tests (contrib/ceph/cluster.sh: one
//! monitor on 127.0.0.1, one memstore OSD, auth off, pool `rbd`), stopped by PID when dropped.

use std::path::{Path, PathBuf};
use std::process::Command;

use super::*;

/// A running cluster, stopped when dropped.
pub struct Ceph {
    pub dir: PathBuf,
    pub conf: PathBuf,
}

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("contrib/ceph/cluster.sh")
}

impl Ceph {
    /// Start a cluster in `dir/ceph` with a memstore of `bytes`; None (skipped) where the
    /// Ceph packages are missing, a failure under CI.
    pub fn start(dir: &Path, bytes: u64) -> Option<Ceph> {
        Self::start_with(dir, bytes, false)
    }

    /// [`Ceph::start`] with a manager daemon too (pool statistics, which pool quotas need).
    pub fn start_with_mgr(dir: &Path, bytes: u64) -> Option<Ceph> {
        Self::start_with(dir, bytes, true)
    }

    fn start_with(dir: &Path, bytes: u64, mgr: bool) -> Option<Ceph> {
        let cdir = dir.join("ceph");
        // A start sometimes fails while other clusters run on the machine ("problem getting
        // command descriptions from mon", "wrong fsid"); the script then stops what it
        // started, and a fresh attempt succeeds.
        let mut last = String::new();
        for attempt in 1..=3 {
            let _ = std::fs::remove_dir_all(&cdir);
            let o = Command::new("bash")
                .arg(script())
                .arg("start")
                .arg(&cdir)
                .arg(bytes.to_string())
                .args(mgr.then_some("mgr"))
                .output()
                .unwrap();
            if o.status.code() == Some(77) {
                return skip_or_fail(&format!(
                    "no Ceph here: {}",
                    String::from_utf8_lossy(&o.stderr).trim()
                ));
            }
            if o.status.success() {
                return Some(Ceph {
                    conf: cdir.join("ceph.conf"),
                    dir: cdir,
                });
            }
            last = format!(
                "{}{}",
                String::from_utf8_lossy(&o.stdout),
                String::from_utf8_lossy(&o.stderr)
            );
            eprintln!("starting the cluster (attempt {attempt}) failed: {last}");
        }
        panic!("starting the cluster: {last}");
    }

    /// A cluster with room for an image `rbd/disk` of `disk_bytes` (a whole MiB), created.
    pub fn with_disk(dir: &Path, disk_bytes: u64) -> Option<Ceph> {
        let ceph = Ceph::start(dir, disk_bytes * 2 + (512 << 20))?;
        ceph.rbd(&[
            "create",
            "rbd/disk",
            "--size",
            &format!("{}M", disk_bytes >> 20),
        ]);
        Some(ceph)
    }

    /// Run `rbd -c CONF ARGS`, which must succeed; its stdout.
    pub fn rbd(&self, args: &[&str]) -> String {
        run_ok(Command::new("rbd").arg("-c").arg(&self.conf).args(args))
    }

    /// Run `ceph -c CONF ARGS`, which must succeed; its stdout.
    pub fn ceph(&self, args: &[&str]) -> String {
        run_ok(Command::new("ceph").arg("-c").arg(&self.conf).args(args))
    }

    /// `rbd export` of `image` into `out`; its bytes.
    pub fn export(&self, image: &str, out: &Path) -> Vec<u8> {
        let _ = std::fs::remove_file(out);
        self.rbd(&["export", image, out.to_str().unwrap()]);
        read_file(out)
    }

    /// The PIDs of the cluster's daemons (monitor, OSD).
    pub fn pids(&self) -> Vec<libc::pid_t> {
        let mut out = Vec::new();
        for e in std::fs::read_dir(self.dir.join("run")).unwrap().flatten() {
            if e.path().extension().is_some_and(|x| x == "pid") {
                if let Ok(s) = std::fs::read_to_string(e.path()) {
                    if let Ok(p) = s.trim().parse() {
                        out.push(p);
                    }
                }
            }
        }
        out
    }

    /// Stop (SIGSTOP) or continue (SIGCONT) every daemon: a cluster that stops answering,
    /// and comes back with its data (memstore keeps it only while the OSD lives).
    pub fn signal_all(&self, sig: i32) {
        for p in self.pids() {
            // SAFETY: plain syscall on a PID this cluster's PID file names.
            unsafe { libc::kill(p, sig) };
        }
    }

    /// The vublk options that reach this cluster.
    pub fn args(&self) -> Vec<String> {
        vec!["--ceph-conf".into(), self.conf.display().to_string()]
    }
}

impl Drop for Ceph {
    fn drop(&mut self) {
        self.signal_all(libc::SIGCONT);
        let _ = Command::new("bash")
            .arg(script())
            .arg("stop")
            .arg(&self.dir)
            .status();
    }
}
