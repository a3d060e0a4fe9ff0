//! The backend under test as a process: started with its options, watched by a watchdog,
//! signalled, waited for, and its log read.

use std::fs::{self, File};
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use super::*;

#[derive(Clone, Debug, Default)]
pub struct BackendOpts {
    /// Number of queues the backend offers (default 1).
    pub num_queues: Option<u32>,
    pub read_only: bool,
    /// Extra vublk arguments (ignored, with a note, under qemu-storage-daemon).
    pub extra_args: Vec<String>,
    /// Run the backend under a seccomp filter that fails io_uring_setup with EPERM, as
    /// container runtimes do.
    pub deny_io_uring: bool,
    /// Run the backend under a seccomp filter that fails plain `fallocate(fd, 0, ...)` (the
    /// call that preallocates) with this errno: a file system without it, or a full one.
    pub fail_fallocate: Option<i32>,
    /// Run the backend under a seccomp filter that fails `fcntl(F_OFD_SETLK)` with this
    /// errno: a file system without OFD locks.
    pub fail_ofd_locks: Option<i32>,
    /// Let the backend dump core (RLIMIT_CORE unlimited), in the test directory (its
    /// working directory then).
    pub core_dumps: bool,
    /// Environment variables for the backend (e.g. NOTIFY_SOCKET).
    pub env: Vec<(String, String)>,
}

/// A running backend. Dropping it kills the process (SIGKILL) and reaps it.
pub struct Backend {
    pub kind: BackendKind,
    pub socket: PathBuf,
    pub image: PathBuf,
    pub log: PathBuf,
    pid: libc::pid_t,
    // The lock serialises reaping against signalling, so no signal can reach a recycled pid
    // (std's `Child::kill` is a no-op once the child has been reaped).
    child: Arc<Mutex<Child>>,
    watchdog: Option<(Sender<()>, JoinHandle<()>)>,
}

impl Backend {
    /// Starts the selected backend on `image`, listening on `<dir>/backend.sock`, and waits
    /// until the socket exists.
    pub fn start(dir: &TestDir, image: &Path, opts: &BackendOpts) -> Backend {
        let kind = backend_kind();
        let socket = dir.join("backend.sock");
        let log = dir.join("backend.log");
        let _ = fs::remove_file(&socket);
        let num_queues = opts.num_queues.unwrap_or(1);

        let mut cmd = match kind {
            BackendKind::Vublk => {
                let mut cmd = Command::new(env!("CARGO_BIN_EXE_vublk"));
                cmd.arg("--socket-path")
                    .arg(&socket)
                    .arg("--blk-file")
                    .arg(image)
                    .arg("--num-queues")
                    .arg(num_queues.to_string());
                if opts.read_only {
                    cmd.arg("--read-only");
                }
                cmd.args(&opts.extra_args);
                cmd
            }
            BackendKind::Qsd => {
                if !opts.extra_args.is_empty() {
                    eprintln!(
                        "note: qemu-storage-daemon ignores vublk arguments {:?}",
                        opts.extra_args
                    );
                }
                let img = image.to_str().expect("utf-8 image path");
                let sock = socket.to_str().expect("utf-8 socket path");
                assert!(!img.contains(',') && !sock.contains(','), "commas in paths");
                // discard=unmap makes QSD punch holes for DISCARD and for WRITE_ZEROES with the
                // UNMAP flag, which is what the tests expect of vublk.
                let ro = if opts.read_only {
                    ",read-only=on"
                } else {
                    ",discard=unmap"
                };
                let mut cmd = Command::new("qemu-storage-daemon");
                cmd.arg("--blockdev")
                    .arg(format!(
                        "driver=file,node-name=file0,filename={img},cache.direct=on,aio=io_uring{ro}"
                    ))
                    .arg("--export")
                    .arg(format!(
                        "type=vhost-user-blk,id=exp0,node-name=file0,addr.type=unix,\
                         addr.path={sock},writable={},num-queues={num_queues}",
                        if opts.read_only { "off" } else { "on" }
                    ));
                cmd
            }
        };

        if opts.deny_io_uring {
            use std::os::unix::process::CommandExt;
            // SAFETY: the hook only calls async-signal-safe prctl() between fork and exec.
            unsafe {
                cmd.pre_exec(deny_io_uring_setup);
            }
        }
        if let Some(errno) = opts.fail_ofd_locks {
            use std::os::unix::process::CommandExt;
            // SAFETY: the hook only calls async-signal-safe prctl() between fork and exec.
            unsafe {
                cmd.pre_exec(move || fail_ofd_setlk(errno));
            }
        }
        if opts.core_dumps {
            use std::os::unix::process::CommandExt;
            cmd.current_dir(dir.join(""));
            // SAFETY: the hook only calls async-signal-safe setrlimit() between fork and
            // exec.
            unsafe {
                cmd.pre_exec(|| {
                    let unlimited = libc::rlimit {
                        rlim_cur: libc::RLIM_INFINITY,
                        rlim_max: libc::RLIM_INFINITY,
                    };
                    if libc::setrlimit(libc::RLIMIT_CORE, &unlimited) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        }
        if let Some(errno) = opts.fail_fallocate {
            use std::os::unix::process::CommandExt;
            // SAFETY: the hook only calls async-signal-safe prctl() between fork and exec.
            unsafe {
                cmd.pre_exec(move || fail_fallocate_mode0(errno));
            }
        }
        cmd.envs(opts.env.iter().map(|(k, v)| (k, v)));
        let log_file = File::create(&log).unwrap();
        cmd.stdin(Stdio::null())
            .stdout(log_file.try_clone().unwrap())
            .stderr(log_file);
        if kind == BackendKind::Vublk && !opts.extra_args.iter().any(|a| a == "--log-level") {
            cmd.arg("--log-level").arg("debug");
        }
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {:?}: {e}", cmd.get_program()));
        let pid = child.id() as libc::pid_t;
        let child = Arc::new(Mutex::new(child));

        let (tx, rx) = mpsc::channel::<()>();
        let wd_child = Arc::clone(&child);
        let handle = thread::spawn(move || {
            if let Err(RecvTimeoutError::Timeout) = rx.recv_timeout(BACKEND_WATCHDOG) {
                eprintln!("watchdog: backend pid {pid} still alive after {BACKEND_WATCHDOG:?}, killing it");
                let _ = wd_child.lock().unwrap().kill();
            }
        });

        let backend = Backend {
            kind,
            socket,
            image: image.to_path_buf(),
            log,
            pid,
            child,
            watchdog: Some((tx, handle)),
        };
        backend.wait_for_socket(SOCKET_DEADLINE);
        backend
    }

    pub fn pid(&self) -> libc::pid_t {
        self.pid
    }

    /// The process's peak resident memory so far (VmHWM in /proc), in bytes.
    pub fn peak_rss_bytes(&self) -> u64 {
        self.status_kib("VmHWM:") * 1024
    }

    /// The process's peak virtual memory so far (VmPeak in /proc: every allocation counts,
    /// touched or not), in bytes.
    pub fn peak_virtual_bytes(&self) -> u64 {
        self.status_kib("VmPeak:") * 1024
    }

    /// A "Field:   N kB" line of /proc/PID/status.
    fn status_kib(&self, field: &str) -> u64 {
        let status = fs::read_to_string(format!("/proc/{}/status", self.pid))
            .unwrap_or_else(|e| panic!("/proc/{}/status: {e}", self.pid));
        status
            .lines()
            .find_map(|l| l.strip_prefix(field))
            .and_then(|v| v.trim().strip_suffix("kB"))
            .and_then(|v| v.trim().parse::<u64>().ok())
            .unwrap_or_else(|| panic!("no {field} in /proc/{}/status", self.pid))
    }

    pub fn log_contents(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// `Some(status)` once the process has exited (reaping it).
    pub fn try_wait(&self) -> Option<ExitStatus> {
        self.child.lock().unwrap().try_wait().expect("waitpid")
    }

    /// Polls until the socket file exists; panics (with the backend's log) if the process exits
    /// first or the deadline passes.
    pub fn wait_for_socket(&self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        loop {
            if let Ok(md) = fs::symlink_metadata(&self.socket) {
                if md.file_type().is_socket() {
                    return;
                }
            }
            if let Some(status) = self.try_wait() {
                panic!(
                    "backend exited ({status}) before creating {}; log:\n{}",
                    self.socket.display(),
                    self.log_contents()
                );
            }
            if Instant::now() >= deadline {
                panic!(
                    "socket {} did not appear within {timeout:?}; log:\n{}",
                    self.socket.display(),
                    self.log_contents()
                );
            }
            thread::sleep(Duration::from_millis(5));
        }
    }

    /// Sends `sig` unless the process has already exited.
    pub fn signal(&self, sig: libc::c_int) {
        let mut child = self.child.lock().unwrap();
        if child.try_wait().expect("waitpid").is_none() {
            // SAFETY: kill(2) has no memory-safety preconditions; the pid is our unreaped child
            // (we hold the lock that serialises reaping), so it cannot have been recycled.
            let rc = unsafe { libc::kill(self.pid, sig) };
            assert_eq!(
                rc,
                0,
                "kill({}, {sig}): {}",
                self.pid,
                std::io::Error::last_os_error()
            );
        }
    }

    /// Polls for the process to exit; on timeout kills it and panics.
    pub fn wait_exit(&self, timeout: Duration) -> ExitStatus {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.try_wait() {
                // A killed backend's io_uring holds the image (and its locks) a few
                // milliseconds after the process is gone; the next user of the image waits.
                // (A clean exit gives its locks up itself.)
                use std::os::unix::process::ExitStatusExt;
                if status.signal().is_some() {
                    wait_unlocked(&self.image, Duration::from_secs(2));
                }
                return status;
            }
            if Instant::now() >= deadline {
                let _ = self.child.lock().unwrap().kill();
                panic!(
                    "backend did not exit within {timeout:?}; killed it; log:\n{}",
                    self.log_contents()
                );
            }
            thread::sleep(Duration::from_millis(5));
        }
    }

    /// SIGTERM, then wait (with a deadline) for the exit status.
    pub fn sigterm_and_wait(&self, timeout: Duration) -> ExitStatus {
        self.signal(libc::SIGTERM);
        self.wait_exit(timeout)
    }

    /// Asserts the backend is still running (it did not crash on what the test just did).
    #[track_caller]
    pub fn assert_running(&self) {
        if let Some(status) = self.try_wait() {
            panic!(
                "backend exited unexpectedly ({status}); log:\n{}",
                self.log_contents()
            );
        }
    }
}

impl Drop for Backend {
    fn drop(&mut self) {
        if let Some((tx, handle)) = self.watchdog.take() {
            let _ = tx.send(());
            let _ = handle.join();
        }
        let mut child = self.child.lock().unwrap();
        let _ = child.kill();
        let _ = child.wait();
        if thread::panicking() {
            eprintln!("---- backend log ({}) ----\n{}", self.log.display(), {
                fs::read_to_string(&self.log).unwrap_or_default()
            });
        }
    }
}

/// Starts vublk on `image` expecting a refusal: it must exit by itself within 15 s, never
/// serve. Returns the exit code and everything it printed (stdout and stderr).
pub fn vublk_refuses(dir: &TestDir, image: &Path, extra: &[&str]) -> (Option<i32>, String) {
    let out = dir.join("refused.log");
    let log = File::create(&out).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_vublk"))
        .arg("--socket-path")
        .arg(dir.join("refused.sock"))
        .arg("--blk-file")
        .arg(image)
        .args(extra)
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(15);
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "vublk {extra:?} served {} instead of refusing it:\n{}",
                image.display(),
                fs::read_to_string(&out).unwrap_or_default()
            );
        }
        thread::sleep(Duration::from_millis(10));
    };
    (status.code(), fs::read_to_string(&out).unwrap_or_default())
}

/// Starts the backend on `image` with `opts` and connects a libblkio client with `client`.
/// Bind the pair as `let (backend, c) = ...`: the client is dropped (disconnected) before the
/// backend (killed, if it still runs).
pub fn start_and_connect(
    dir: &TestDir,
    image: &Path,
    opts: &BackendOpts,
    client: ClientOpts,
) -> (Backend, Client) {
    let backend = Backend::start(dir, image, opts);
    let c = connect(&backend.socket, client);
    (backend, c)
}

/// Disconnects the client, then SIGTERMs the backend, which must exit 0 within
/// `EXIT_DEADLINE`. The backend stays for its log.
#[track_caller]
pub fn disconnect_and_stop(backend: &Backend, client: Client) {
    drop(client);
    assert_eq!(backend.sigterm_and_wait(EXIT_DEADLINE).code(), Some(0));
}

/// Serves `image` read-only, reads its first 4 KiB through libblkio, and stops the backend;
/// panics unless the read works and the backend exits 0 on SIGTERM.
pub fn serve_read_only_once(dir: &TestDir, image: &Path) {
    let opts = BackendOpts {
        read_only: true,
        ..BackendOpts::default()
    };
    let client = ClientOpts {
        read_only: true,
        ..ClientOpts::default()
    };
    let (backend, mut c) = start_and_connect(dir, image, &opts, client);
    assert!(c.read_at(0, 0, 4096).is_ok(), "read-only read failed");
    disconnect_and_stop(&backend, c);
}

/// Sum of the per-queue statistics vublk logs at disconnect, e.g. `logged_count(log, " bounced")`
/// over lines like "queue 0: 32 requests, 0 errors, 2 bounced, ...".
pub fn logged_count(log: &str, what: &str) -> u64 {
    log.lines()
        .filter_map(|l| l.split(", ").find(|p| p.ends_with(what)))
        .filter_map(|p| {
            p.strip_suffix(what)?
                .split_whitespace()
                .last()?
                .parse::<u64>()
                .ok()
        })
        .sum()
}

/// Wait (at most `timeout`) until no process holds QEMU-protocol locks on `image` (bytes
/// 100..=103 and 200..=203, OFD locks), as a tool started next would see it.
pub fn wait_unlocked(image: &Path, timeout: Duration) {
    use std::os::fd::AsRawFd;
    let Ok(f) = File::open(image) else {
        return;
    };
    let deadline = Instant::now() + timeout;
    let locked = || {
        [100i64, 101, 102, 103, 200, 201, 202, 203]
            .iter()
            .any(|&b| {
                // SAFETY: flock is plain data; zeroed is valid.
                let mut fl: libc::flock = unsafe { std::mem::zeroed() };
                fl.l_type = libc::F_WRLCK as libc::c_short;
                fl.l_whence = libc::SEEK_SET as libc::c_short;
                fl.l_start = b;
                fl.l_len = 1;
                // SAFETY: F_OFD_GETLK reads and writes one flock through a live pointer.
                let r = unsafe { libc::fcntl(f.as_raw_fd(), libc::F_OFD_GETLK, &mut fl) };
                r == 0 && fl.l_type != libc::F_UNLCK as libc::c_short
            })
    };
    while locked() && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(2));
    }
}

/// Runs `cmd` to completion with the resource limit `resource` (soft and hard) at `value`,
/// set between fork and exec: e.g. `vublk create` under an address-space or file size limit.
pub fn output_with_rlimit(
    cmd: &mut Command,
    resource: libc::__rlimit_resource_t,
    value: u64,
) -> std::process::Output {
    use std::os::unix::process::CommandExt;
    let limit = libc::rlimit {
        rlim_cur: value,
        rlim_max: value,
    };
    // SAFETY: the hook only calls setrlimit, which is async-signal-safe, between fork and
    // exec, on a limit value copied into the closure.
    unsafe {
        cmd.pre_exec(move || {
            if libc::setrlimit(resource, &limit) == 0 {
                Ok(())
            } else {
                Err(std::io::Error::last_os_error())
            }
        });
    }
    cmd.output()
        .unwrap_or_else(|e| panic!("{:?}: {e}", cmd.get_program()))
}

/// `vublk ctl --control-socket SOCK METHOD ARGS...`: (exit 0, the JSON it printed or Null,
/// its stderr).
pub fn ctl(sock: &Path, method: &str, args: &[&str]) -> (bool, serde_json::Value, String) {
    let o = Command::new(env!("CARGO_BIN_EXE_vublk"))
        .arg("ctl")
        .arg("--control-socket")
        .arg(sock)
        .arg(method)
        .args(args)
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    let v = serde_json::from_str(&out).unwrap_or(serde_json::Value::Null);
    (o.status.success(), v, err)
}

/// [`ctl`] that must succeed: the JSON it printed (the test fails with its stderr otherwise).
pub fn ctl_ok(sock: &Path, method: &str, args: &[&str]) -> serde_json::Value {
    let (ok, v, err) = ctl(sock, method, args);
    assert!(ok, "vublk ctl {method} {args:?}: {err}");
    v
}

/// `vublk ctl backup-begin ARGS`, which must succeed: the export's NBD URI.
pub fn backup_begin(sock: &Path, args: &[&str]) -> String {
    let v = ctl_ok(sock, "backup-begin", args);
    v["uri"]
        .as_str()
        .unwrap_or_else(|| panic!("backup-begin answered no uri: {v}"))
        .to_owned()
}

/// `nbdcopy URI OUT`: the export as a raw file (the output, for a test that expects failure).
pub fn nbdcopy(uri: &str, out: &Path) -> std::process::Output {
    Command::new("nbdcopy")
        .args([uri, &out.display().to_string()])
        .output()
        .unwrap_or_else(|e| panic!("nbdcopy: {e}"))
}

/// [`nbdcopy`] that must succeed.
pub fn nbdcopy_ok(uri: &str, out: &Path) {
    let o = nbdcopy(uri, out);
    assert!(
        o.status.success(),
        "nbdcopy {uri}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
}

/// A vublk with `queues` queues, `--control-socket DIR/ctl.sock` and `extra` options, serving
/// `img`; returns it and the control socket's path.
pub fn start_with_control(
    dir: &TestDir,
    img: &Path,
    queues: u32,
    extra: &[&str],
) -> (Backend, PathBuf) {
    let sock = dir.join("ctl.sock");
    let mut args = vec!["--control-socket".to_string(), sock.display().to_string()];
    args.extend(extra.iter().map(|s| s.to_string()));
    let b = Backend::start(
        dir,
        img,
        &BackendOpts {
            num_queues: Some(queues),
            extra_args: args,
            ..BackendOpts::default()
        },
    );
    (b, sock)
}

/// Is `byte` of `path` locked by some process (an OFD lock)?
pub fn byte_locked(path: &Path, byte: i64) -> bool {
    use std::os::fd::AsRawFd;
    let f = std::fs::File::open(path).unwrap();
    // SAFETY: flock is plain data; zeroed is valid.
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = libc::F_WRLCK as libc::c_short;
    fl.l_whence = libc::SEEK_SET as libc::c_short;
    fl.l_start = byte;
    fl.l_len = 1;
    // SAFETY: F_OFD_GETLK reads and writes one flock through a live pointer.
    let r = unsafe { libc::fcntl(f.as_raw_fd(), libc::F_OFD_GETLK, &mut fl) };
    assert_eq!(r, 0);
    fl.l_type != libc::F_UNLCK as libc::c_short
}

/// The body of an HTTP GET (status 200), "" otherwise.
pub fn http_get(addr: &str, path: &str) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").unwrap();
    let mut resp = String::new();
    s.read_to_string(&mut resp).unwrap();
    let (head, body) = resp.split_once("\r\n\r\n").unwrap_or((&resp, ""));
    if head.starts_with("HTTP/1.0 200") || head.starts_with("HTTP/1.1 200") {
        body.to_owned()
    } else {
        String::new()
    }
}

/// A local TCP port free a moment ago (for `--metrics-addr 127.0.0.1:PORT`).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// `name{labels} value` lines of the text format, keyed by `name{labels}` (comments skipped;
/// every other line must parse).
pub fn parse_metrics(text: &str) -> std::collections::HashMap<String, f64> {
    let mut m = std::collections::HashMap::new();
    for l in text.lines() {
        if l.starts_with('#') || l.trim().is_empty() {
            continue;
        }
        let (key, value) = l
            .rsplit_once(' ')
            .unwrap_or_else(|| panic!("metrics line without a value: {l:?}"));
        let v: f64 = value
            .parse()
            .unwrap_or_else(|_| panic!("metrics line with a bad value: {l:?}"));
        assert!(
            key.starts_with("vublk_")
                && key.chars().next().is_some_and(|c| c.is_ascii_alphabetic()),
            "{l:?}"
        );
        if let Some(i) = key.find('{') {
            assert!(key.ends_with('}'), "{l:?}");
            assert!(key[i + 1..key.len() - 1]
                .split(',')
                .all(|kv| kv.contains("=\"") && kv.ends_with('"')));
        }
        m.insert(key.to_owned(), v);
    }
    m
}
