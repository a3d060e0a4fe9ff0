//! `--stream`, `--commit` and `--mirror`: a block job over the running disk, vublk (`vublk
//! ctl stream`, `commit`, `mirror` with `job-complete` once ready) against
//! qemu-storage-daemon (QMP `block-stream`, `block-commit`, `drive-mirror`, with
//! `block-job-complete` once ready) on the same images: a qcow2 overlay over a fully
//! written raw image of --size, served by each in turn. For a stream the overlay is new
//! (empty: the job copies the base up into it); for a commit and a mirror it is fully
//! written first with `qemu-io` (a commit copies all of it down into the base, then the
//! guest is switched to the base; a mirror copies the whole disk to a new raw image and
//! switches the guest to it).
//!
//! Each run: 4 KiB random writes at depth 32 on the overlay for --seconds without a job (the
//! baseline), then the same writes start again and, half a second later, the job
//! (unlimited speed, both daemons' default); they go on until it concludes, or until
//! `--job-limit` seconds have passed (then the job is cancelled and reported as not
//! concluded). Reported: the guest's write IOPS without and during the job, and the job's
//! rate (the disk's size over its time). `--qsd-copy-mode write-blocking` runs
//! qemu-storage-daemon's mirror in its active mode.

use std::fs::{self, File};
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::args::Opts;
use crate::backends::{Backend, BackendKind};
use crate::images::prepare_image;
use crate::modes::backup::{run_during, writes, DuringResult};
use crate::server::{qsd_blockdev, qsd_export, spawn, start_server, Server};

/// A QMP connection to qemu-storage-daemon, capabilities negotiated.
struct Qmp {
    r: BufReader<UnixStream>,
    w: UnixStream,
}

impl Qmp {
    fn connect(path: &Path) -> Qmp {
        let s = UnixStream::connect(path).expect("QMP socket");
        s.set_read_timeout(Some(Duration::from_secs(30)))
            .expect("timeout");
        let mut q = Qmp {
            r: BufReader::new(s.try_clone().expect("dup")),
            w: s,
        };
        let mut greeting = String::new();
        q.r.read_line(&mut greeting).expect("QMP greeting");
        q.cmd(r#"{"execute":"qmp_capabilities"}"#);
        q
    }

    /// Send `json`; the answer line (events skipped). Panics on an error answer.
    fn cmd(&mut self, json: &str) -> String {
        writeln!(self.w, "{json}").expect("QMP write");
        loop {
            let mut l = String::new();
            assert!(
                self.r.read_line(&mut l).expect("QMP read") > 0,
                "QMP closed"
            );
            if l.contains("\"return\"") {
                return l;
            }
            assert!(!l.contains("\"error\""), "QMP {json}: {l}");
        }
    }
}

/// qemu-storage-daemon serving `top` (its backing file opened from its header) with a QMP
/// monitor on `qmp`.
fn qsd_with_qmp(backend: &Backend, opts: &Opts, top: &Path, work: &Path, qmp: &Path) -> Server {
    let socket = work.join("qsd.sock");
    let _ = fs::remove_file(&socket);
    let _ = fs::remove_file(qmp);
    let log = File::create(work.join("qsd.log")).expect("qsd log");
    let mut c = Command::new(&opts.qsd);
    c.arg("--blockdev")
        .arg(qsd_blockdev(backend, top))
        .arg("--export")
        .arg(qsd_export("file0", &socket, opts.backend_queues))
        .arg("--chardev")
        .arg(format!(
            "socket,id=qmp0,path={},server=on,wait=off",
            qmp.display()
        ))
        .arg("--monitor")
        .arg("chardev=qmp0,mode=control")
        .stdin(Stdio::null())
        .stdout(log.try_clone().expect("dup"))
        .stderr(log);
    spawn(c, socket, "qsd")
}

/// `vublk ctl` with `args`: its standard output (which must be a success).
fn ctl(binary: &Path, sock: &Path, args: &[&str]) -> String {
    let o = Command::new(binary)
        .args(["ctl", "--control-socket"])
        .arg(sock)
        .args(args)
        .output()
        .expect("vublk ctl");
    assert!(
        o.status.success(),
        "vublk ctl {args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// Which job a run measures.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Job {
    Stream,
    Commit,
    /// To a new raw image beside the others, completed once ready.
    Mirror,
}

impl Job {
    fn verb(self) -> &'static str {
        match self {
            Job::Stream => "stream",
            Job::Commit => "commit",
            Job::Mirror => "mirror",
        }
    }
}

/// A new qcow2 overlay `top` over `base`: empty for a stream, fully written for a commit.
fn new_overlay(base: &Path, top: &Path, work: &Path, job: Job, size: u64) {
    let _ = fs::remove_file(top);
    let _ = fs::remove_file(work.join(".stream-top.qcow2.vublk-chain"));
    let st = Command::new("qemu-img")
        .args(["create", "-q", "-f", "qcow2", "-F", "raw", "-b"])
        .arg(base)
        .arg(top)
        .status()
        .expect("qemu-img");
    assert!(st.success(), "qemu-img create of the overlay");
    if job != Job::Stream {
        let st = Command::new("qemu-io")
            .args(["-f", "qcow2", "-c", &format!("write -q -P 0x33 0 {size}")])
            .arg(top)
            .status()
            .expect("qemu-io");
        assert!(st.success(), "qemu-io filling the overlay");
    }
}

/// One run through `backend`: the baseline on one new overlay (its writes copy clusters
/// up from the base), the job on another, so that the job has the whole disk to copy.
fn measure(backend: &Backend, opts: &Opts, vublk: &Path, work: &Path, kind: Job) -> DuringResult {
    let base = work.join("stream-base.raw");
    prepare_image(&base, opts.size);
    let top = work.join("stream-top.qcow2");
    let target = work.join("mirror-target.raw");
    let never = AtomicBool::new(false);
    let ctl_sock = work.join("stream-ctl.sock");
    let qmp_sock = work.join("stream-qmp.sock");
    let binary = backend
        .binary
        .clone()
        .unwrap_or_else(|| vublk.to_path_buf());
    let serve = || match backend.kind {
        BackendKind::Vublk => {
            let mut b = backend.clone();
            b.extra
                .extend(["--control-socket".into(), ctl_sock.display().to_string()]);
            start_server(&b, &top, opts, vublk, work)
        }
        BackendKind::Qsd => qsd_with_qmp(backend, opts, &top, work, &qmp_sock),
        BackendKind::File => panic!("--stream and --commit measure vublk and qsd"),
    };
    new_overlay(&base, &top, work, kind, opts.size);
    let server = serve();
    let until = Instant::now() + Duration::from_secs_f64(opts.seconds);
    let (ios, secs) = writes(backend, &server, &top, &never, Some(until));
    let base_iops = ios as f64 / secs;
    drop(server);
    new_overlay(&base, &top, work, kind, opts.size);
    let _ = fs::remove_file(&target);
    let server = serve();
    let stop = AtomicBool::new(false);
    let ((job_secs, concluded), (ios, secs)) = std::thread::scope(|s| {
        let job = s.spawn(|| {
            // The writer connected and writing first: qemu-storage-daemon 10.0.2 segfaults
            // when a mirror or commit starts while a vhost-user client is connecting.
            std::thread::sleep(Duration::from_millis(500));
            let t0 = Instant::now();
            let over_limit =
                |t0: Instant| opts.job_limit > 0.0 && t0.elapsed().as_secs_f64() > opts.job_limit;
            let concluded = match backend.kind {
                BackendKind::Vublk => {
                    let verb = kind.verb();
                    let target_arg = target.display().to_string();
                    let mut args = vec![verb, "--id", "bench"];
                    if kind == Job::Mirror {
                        args.extend(["--target", &target_arg, "--format", "raw"]);
                    }
                    ctl(&binary, &ctl_sock, &args);
                    let mut completed = false;
                    loop {
                        if over_limit(t0) {
                            ctl(&binary, &ctl_sock, &["job-cancel", "bench"]);
                            break false;
                        }
                        let v: String = ctl(&binary, &ctl_sock, &["jobs"])
                            .chars()
                            .filter(|c| !c.is_whitespace())
                            .collect();
                        if !completed && v.contains(r#""state":"ready""#) {
                            ctl(&binary, &ctl_sock, &["job-complete", "bench"]);
                            completed = true;
                        }
                        if v.contains(r#""state":"concluded""#) {
                            assert!(v.contains(r#""error":null"#), "the {verb} failed: {v}");
                            break true;
                        }
                        std::thread::sleep(Duration::from_millis(10));
                    }
                }
                _ => {
                    let mut q = Qmp::connect(&qmp_sock);
                    if kind == Job::Mirror {
                        q.cmd(&format!(
                            r#"{{"execute":"drive-mirror","arguments":{{"job-id":"bench","device":"file0","target":"{}","format":"raw","sync":"full","mode":"absolute-paths","copy-mode":"{}"}}}}"#,
                            target.display(),
                            opts.qsd_copy_mode
                        ));
                    } else {
                        q.cmd(&format!(
                            r#"{{"execute":"block-{}","arguments":{{"job-id":"bench","device":"file0"}}}}"#,
                            kind.verb()
                        ));
                    }
                    // Auto-dismissed when it concludes: the list empties. An active
                    // commit waits in ready for block-job-complete.
                    let mut completed = false;
                    loop {
                        if over_limit(t0) {
                            q.cmd(r#"{"execute":"block-job-cancel","arguments":{"device":"bench","force":true}}"#);
                            break false;
                        }
                        let l = q.cmd(r#"{"execute":"query-jobs"}"#);
                        if !l.contains("\"bench\"") {
                            break true;
                        }
                        if !completed && l.replace(' ', "").contains("\"status\":\"ready\"") {
                            q.cmd(r#"{"execute":"block-job-complete","arguments":{"device":"bench"}}"#);
                            completed = true;
                        }
                        std::thread::sleep(Duration::from_millis(10));
                    }
                }
            };
            let secs = t0.elapsed().as_secs_f64();
            stop.store(true, Ordering::Relaxed);
            (secs, concluded)
        });
        let w = writes(backend, &server, &top, &stop, None);
        (job.join().expect("job thread"), w)
    });
    drop(server);
    let _ = fs::remove_file(&top);
    let _ = fs::remove_file(&target);
    let _ = fs::remove_file(work.join(".stream-top.qcow2.vublk-chain"));
    DuringResult {
        base_iops,
        iops: ios as f64 / secs,
        // Not concluded within --job-limit: no rate (the table says so).
        mbps: if concluded {
            opts.size as f64 / job_secs / 1e6
        } else {
            f64::NAN
        },
    }
}

/// `--stream` or `--commit`: every backend (vublk and qsd builds), `--runs` times,
/// alternating.
pub fn run(opts: &Opts, backends: &[Backend], vublk: &Path, work: &Path, kind: Job) {
    let (overlay, what) = match kind {
        Job::Stream => ("A new qcow2 overlay", ("the stream", "stream")),
        Job::Commit => ("A fully written qcow2 overlay", ("the commit", "commit")),
        Job::Mirror => (
            "A fully written qcow2 overlay (mirrored to a new raw image, completed once ready)",
            ("the mirror", "mirror"),
        ),
    };
    let how = format!(
        "{overlay} over a fully written {} MiB raw image; 4 KiB random writes at depth 32 \
         (one queue) on the overlay for {} s without a job, then during a {} job (unlimited \
         speed) until it concludes; {} runs, medians.",
        opts.size >> 20,
        opts.seconds,
        what.1,
        opts.runs
    );
    let mut how = how;
    if opts.job_limit > 0.0 {
        how.push_str(&format!(
            " A job not concluded after {} s is cancelled (\"not concluded\"; the IOPS are \
             over those seconds).",
            opts.job_limit
        ));
    }
    if kind == Job::Mirror {
        how.push_str(&format!(
            " qemu-storage-daemon's drive-mirror copy-mode: {}.",
            opts.qsd_copy_mode
        ));
    }
    run_during(opts, backends, what, &how, |b| {
        measure(b, opts, vublk, work, kind)
    });
}
