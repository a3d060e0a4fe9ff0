//! A guest running the `restart` workload (4 KiB and 1 MiB blocks written all over its raw
//! disk by `writers` processes for `seconds`, each block verified, `WROTE` markers for the
//! test to check the image afterwards) on one vhost-user-blk queue, with a QMP socket: for
//! tests that change the disk under a writing guest (backups, snapshots, jobs).

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::thread;
use std::time::{Duration, Instant};

use super::qmp::Qmp;
use super::{markers, read_log, ChildGuard, Guest, LineCollector, MARK};

pub struct WritingGuest {
    pub q: ChildGuard,
    pub qmp: Qmp,
    serial: Option<LineCollector>,
    /// What the console printed so far.
    lines: Vec<String>,
    /// vublk's and QEMU's logs, for the dump on failure.
    logs: (PathBuf, PathBuf),
}

impl WritingGuest {
    /// Boot the guest on the vhost-user socket `sock` (`run`: where QEMU's files go,
    /// `vublk_log`: shown on failure) and wait until its writers started.
    pub fn start(
        qemu: &Path,
        guest: &Guest,
        sock: &Path,
        run: &Path,
        vublk_log: &Path,
        writers: u64,
        seconds: u64,
    ) -> Self {
        let qmp_path = run.join("qemu.qmp");
        let mut qcmd = super::guest_command(
            qemu,
            guest,
            "512M",
            1,
            &format!("path={}", sock.display()),
            ",num-queues=1",
            &format!(
                "console=ttyS0 panic=-1 loglevel=4 E2E_QUEUES=1 E2E_LBS=512 E2E_MODE=restart \
                 E2E_WRITERS={writers} E2E_SECONDS={seconds} E2E_VERIFY_FIRST=32"
            ),
        );
        qcmd.arg("-qmp")
            .arg(format!("unix:{},server=on,wait=off", qmp_path.display()));
        qcmd.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(File::create(run.join("qemu.log")).unwrap());
        let mut q = ChildGuard::spawn("qemu", &mut qcmd).unwrap();
        let stdout = q.child_mut().stdout.take().unwrap();
        let serial = LineCollector::new(stdout, File::create(run.join("serial.log")).ok());
        let qmp = Qmp::connect(&qmp_path, &mut q);
        let mut g = WritingGuest {
            q,
            qmp,
            serial: Some(serial),
            lines: Vec::new(),
            logs: (vublk_log.to_path_buf(), run.join("qemu.log")),
        };
        let t0 = Instant::now();
        loop {
            let new = g
                .serial
                .as_mut()
                .map(LineCollector::poll)
                .unwrap_or_default();
            let started = new
                .iter()
                .any(|l| l.contains(&format!("{MARK}RESTART-START")));
            g.lines.extend(new);
            if started {
                return g;
            }
            if g.q.try_wait().unwrap().is_some() || t0.elapsed() > Duration::from_secs(300) {
                let _ = g.q.kill();
                let lines = std::mem::take(&mut g.lines);
                panic!("the guest did not start writing\n{}", g.dump(&lines));
            }
            thread::sleep(Duration::from_millis(50));
        }
    }

    /// The serial console, vublk's and QEMU's logs.
    fn dump(&self, lines: &[String]) -> String {
        format!(
            "--- serial:\n{}\n--- vublk:\n{}\n--- qemu:\n{}",
            lines.join("\n"),
            read_log(&self.logs.0),
            read_log(&self.logs.1)
        )
    }

    /// Wait for the guest to finish its workload and power off: it must report PASS.
    /// Its markers (the `WROTE` ones for `check_blocks`).
    pub fn finish(mut self) -> Vec<String> {
        let deadline = Instant::now() + Duration::from_secs(600);
        let done = self.q.wait_until(deadline).unwrap();
        if done.is_none() {
            let _ = self.q.kill();
        }
        // Everything the console printed, from the start.
        let lines = self
            .serial
            .take()
            .map(LineCollector::finish)
            .unwrap_or_default();
        let marks = markers(&lines);
        if let Some(f) = marks.iter().find(|m| m.starts_with("FAIL")) {
            panic!("guest reported {f}\n{}", self.dump(&lines));
        }
        assert!(done.is_some(), "the guest hung\n{}", self.dump(&lines));
        assert!(
            marks.iter().any(|m| m.starts_with("PASS")),
            "no PASS\n{}",
            self.dump(&lines)
        );
        marks
    }
}

/// The usual set-up around a [`WritingGuest`]: a scratch directory, a raw disk, vublk
/// serving it with a control socket, the guest writing.
pub struct Rig {
    pub run: super::ScratchDir,
    pub image: PathBuf,
    /// vublk's control socket.
    pub ctl: PathBuf,
    pub vublk: ChildGuard,
    pub guest: Guest,
    pub g: WritingGuest,
}

impl Rig {
    /// `name` names the scratch directory and the socket; `tools` are needed besides QEMU
    /// (None: skipped, saying why).
    pub fn start(name: &str, tools: &[&str], disk: u64, writers: u64, seconds: u64) -> Option<Rig> {
        let (qemu, guest) = super::guest_prerequisites(tools)?;
        let tmp = Path::new(env!("CARGO_TARGET_TMPDIR"));
        let mut run =
            super::ScratchDir::new(tmp, &format!("{name}-{}", std::process::id())).unwrap();
        run.keep = std::env::var("VUBLK_E2E_KEEP").is_ok_and(|v| v == "1");
        let image = run.path.join("disk.raw");
        crate::common::qemu_img_create(&image, "raw", &disk.to_string());
        let sock = std::env::temp_dir().join(format!("vublk-{name}-{}.sock", std::process::id()));
        let _ = std::fs::remove_file(&sock);
        let ctl = run.path.join("ctl.sock");
        let log = run.path.join("vublk.log");
        let ctl_arg = ctl.display().to_string();
        let mut vublk = super::spawn_vublk(
            "vublk",
            &log,
            &sock,
            &image,
            1,
            &["--control-socket", &ctl_arg],
        );
        super::wait_for_socket(&sock, &mut vublk, Duration::from_secs(20)).unwrap();
        let g = WritingGuest::start(&qemu, &guest, &sock, &run.path, &log, writers, seconds);
        Some(Rig {
            run,
            image,
            ctl,
            vublk,
            guest,
            g,
        })
    }
}
