//! Shared helpers for the integration tests: temporary directories and images, spawning the
//! backend under test (vublk, or qemu-storage-daemon when `VUBLK_TEST_BACKEND=qsd`), and a small
//! synchronous libblkio client.
//!
//! Nothing here sleeps for a fixed time to "let things settle": every wait polls a condition
//! against a deadline, and every backend process is guarded by a watchdog that kills it if a test
//! hangs (a killed backend makes the blocked libblkio call fail, so the test fails instead of
//! hanging).

#![allow(dead_code)] // each test binary uses a different subset

use std::fs::{self, File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::mem::MaybeUninit;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use blkio::{Blkio, Blkioq, Completion, MemoryRegion, ReqFlags};

/// How long a backend may live before the watchdog kills it.
pub const BACKEND_WATCHDOG: Duration = Duration::from_secs(120);
/// How long to wait for the backend's socket to appear.
pub const SOCKET_DEADLINE: Duration = Duration::from_secs(20);
/// How long to keep retrying a client connection.
pub const CONNECT_DEADLINE: Duration = Duration::from_secs(20);
/// How long one batch of requests may take.
pub const IO_DEADLINE: Duration = Duration::from_secs(30);
/// How long the backend may take to exit after SIGTERM.
pub const EXIT_DEADLINE: Duration = Duration::from_secs(20);

pub const MIB: u64 = 1024 * 1024;

// ---------------------------------------------------------------------------------------------
// Which backend
// ---------------------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendKind {
    Vublk,
    Qsd,
}

/// The backend selected by `VUBLK_TEST_BACKEND` (`vublk`, the default, or `qsd`).
pub fn backend_kind() -> BackendKind {
    match std::env::var("VUBLK_TEST_BACKEND").as_deref() {
        Err(_) | Ok("") | Ok("vublk") => BackendKind::Vublk,
        Ok("qsd") => BackendKind::Qsd,
        Ok(other) => panic!("VUBLK_TEST_BACKEND={other:?}: expected `vublk` or `qsd`"),
    }
}

pub fn is_qsd() -> bool {
    backend_kind() == BackendKind::Qsd
}

/// For checks that only hold for vublk: returns true (and prints a note) under QSD.
pub fn skip_unless_vublk(what: &str) -> bool {
    if is_qsd() {
        eprintln!("note: skipping vublk-specific check under qemu-storage-daemon: {what}");
        true
    } else {
        false
    }
}

// ---------------------------------------------------------------------------------------------
// Temporary directories and images
// ---------------------------------------------------------------------------------------------

/// A fresh directory under `CARGO_TARGET_TMPDIR`, removed on drop unless the test panicked (then
/// it is kept, and its path printed, for post-mortem).
pub struct TestDir {
    pub path: PathBuf,
}

impl TestDir {
    pub fn new(name: &str) -> TestDir {
        let mut base = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
        // sun_path is 108 bytes; keep the socket path well inside it.
        if base.as_os_str().len() + name.len() + 40 > 100 {
            base = std::env::temp_dir();
        }
        let path = base.join(format!("vublk-it-{}-{}", name, std::process::id()));
        let _ = fs::remove_dir_all(&path);
        fs::create_dir_all(&path).unwrap_or_else(|e| panic!("mkdir {}: {e}", path.display()));
        TestDir { path }
    }

    pub fn join(&self, name: &str) -> PathBuf {
        self.path.join(name)
    }
}

impl Drop for TestDir {
    fn drop(&mut self) {
        if thread::panicking() {
            eprintln!("keeping test directory {}", self.path.display());
        } else {
            let _ = fs::remove_dir_all(&self.path);
        }
    }
}

/// A sparse image of `size` bytes.
pub fn create_sparse_image(path: &Path, size: u64) {
    let f = File::create(path).unwrap_or_else(|e| panic!("create {}: {e}", path.display()));
    f.set_len(size).unwrap();
}

/// A fully allocated image of `size` bytes whose content is `pattern_fill(_, 0, seed)`.
pub fn create_pattern_image(path: &Path, size: u64, seed: u64) {
    let mut f = File::create(path).unwrap_or_else(|e| panic!("create {}: {e}", path.display()));
    let mut buf = vec![0u8; MIB as usize];
    let mut off = 0;
    while off < size {
        let n = (size - off).min(MIB) as usize;
        pattern_fill(&mut buf[..n], off, seed);
        f.write_all(&buf[..n]).unwrap();
        off += n as u64;
    }
    f.sync_all().unwrap();
}

/// A fully allocated image of `size` bytes, every byte `byte`.
pub fn create_filled_image(path: &Path, size: u64, byte: u8) {
    let mut f = File::create(path).unwrap_or_else(|e| panic!("create {}: {e}", path.display()));
    let buf = vec![byte; MIB as usize];
    let mut off = 0;
    while off < size {
        let n = (size - off).min(MIB) as usize;
        f.write_all(&buf[..n]).unwrap();
        off += n as u64;
    }
    f.sync_all().unwrap();
}

/// Deterministic position-dependent content: byte `i` of `buf` is the content of absolute
/// offset `offset + i` for this `seed`, so misplaced data is detected.
pub fn pattern_fill(buf: &mut [u8], offset: u64, seed: u64) {
    for (i, b) in buf.iter_mut().enumerate() {
        let o = offset + i as u64;
        let word = splitmix64((o >> 3) ^ seed.rotate_left(17));
        *b = (word >> ((o & 7) * 8)) as u8;
    }
}

pub fn pattern(len: usize, offset: u64, seed: u64) -> Vec<u8> {
    let mut v = vec![0u8; len];
    pattern_fill(&mut v, offset, seed);
    v
}

pub fn read_file(path: &Path) -> Vec<u8> {
    fs::read(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

pub fn read_file_range(path: &Path, offset: u64, len: usize) -> Vec<u8> {
    let mut f = File::open(path).unwrap();
    f.seek(SeekFrom::Start(offset)).unwrap();
    let mut v = vec![0u8; len];
    f.read_exact(&mut v).unwrap();
    v
}

pub fn write_file_range(path: &Path, offset: u64, data: &[u8]) {
    let mut f = OpenOptions::new().write(true).open(path).unwrap();
    f.seek(SeekFrom::Start(offset)).unwrap();
    f.write_all(data).unwrap();
    f.sync_all().unwrap();
}

/// Is qemu-img installed? If not, "skipped: why" (a failure under CI).
pub fn have_qemu_img() -> bool {
    if std::process::Command::new("qemu-img")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
    {
        return true;
    }
    skip_or_fail::<()>("qemu-img not installed");
    false
}

/// Run a command that must succeed; its stdout.
pub fn run_ok(cmd: &mut std::process::Command) -> String {
    let o = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        o.status.success(),
        "{cmd:?} failed:\n{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// `qemu-img compare`: the qcow2 image holds exactly the raw file's data.
pub fn qemu_compare(raw: &Path, qcow2: &Path) {
    run_ok(
        std::process::Command::new("qemu-img")
            .args(["compare", "-q", "-f", "raw", "-F", "qcow2"])
            .arg(raw)
            .arg(qcow2),
    );
}

/// Allocated 512-byte blocks of a file (`st_blocks`).
pub fn allocated_blocks(path: &Path) -> u64 {
    fs::metadata(path).unwrap().blocks()
}

pub fn file_size(path: &Path) -> u64 {
    fs::metadata(path).unwrap().len()
}

/// Index of the first differing byte, for readable assertion messages on big buffers.
pub fn first_difference(a: &[u8], b: &[u8]) -> Option<usize> {
    if a.len() != b.len() {
        return Some(a.len().min(b.len()));
    }
    a.iter().zip(b).position(|(x, y)| x != y)
}

#[track_caller]
pub fn assert_same(actual: &[u8], expected: &[u8], what: &str) {
    if let Some(i) = first_difference(actual, expected) {
        panic!(
            "{what}: first difference at byte {i} (lengths {} vs {}): got {:?}, expected {:?}",
            actual.len(),
            expected.len(),
            actual.get(i..(i + 16).min(actual.len())),
            expected.get(i..(i + 16).min(expected.len())),
        );
    }
}

#[track_caller]
pub fn assert_all_zero(data: &[u8], what: &str) {
    if let Some(i) = data.iter().position(|&b| b != 0) {
        panic!(
            "{what}: byte {i} of {} is {:#04x}, expected zero",
            data.len(),
            data[i]
        );
    }
}

// ---------------------------------------------------------------------------------------------
// PRNG (no extra crates)
// ---------------------------------------------------------------------------------------------

pub fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// splitmix64 sequence generator.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        splitmix64(self.0)
    }

    /// Uniform in `0..n` (n > 0; the modulo bias is irrelevant here).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }

    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi - lo + 1)
    }

    pub fn fill(&mut self, buf: &mut [u8]) {
        for chunk in buf.chunks_mut(8) {
            let w = self.next_u64().to_le_bytes();
            chunk.copy_from_slice(&w[..chunk.len()]);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The backend process
// ---------------------------------------------------------------------------------------------

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
        if let Some(errno) = opts.fail_fallocate {
            use std::os::unix::process::CommandExt;
            // SAFETY: the hook only calls async-signal-safe prctl() between fork and exec.
            unsafe {
                cmd.pre_exec(move || fail_fallocate_mode0(errno));
            }
        }
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

const BPF_LD_W_ABS: u16 = 0x20;
const BPF_JMP_JEQ_K: u16 = 0x15;
const BPF_RET_K: u16 = 0x06;
const SECCOMP_RET_ALLOW: u32 = 0x7fff_0000;
const SECCOMP_RET_ERRNO: u32 = 0x0005_0000;
const AUDIT_ARCH_X86_64: u32 = 0xc000_003e;

/// Install a seccomp filter program in this process (between fork and exec: only
/// async-signal-safe prctl calls).
fn install_seccomp(prog: &[libc::sock_filter]) -> std::io::Result<()> {
    let fprog = libc::sock_fprog {
        len: prog.len() as u16,
        filter: prog.as_ptr() as *mut libc::sock_filter,
    };
    // SAFETY: plain prctl calls with a valid filter program that outlives them.
    unsafe {
        if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0
            || libc::prctl(libc::PR_SET_SECCOMP, 2, &fprog as *const libc::sock_fprog) != 0
        {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Install a seccomp filter making io_uring_setup fail with EPERM (x86_64 syscall 425).
pub fn deny_io_uring_setup() -> std::io::Result<()> {
    const NR_IO_URING_SETUP: u32 = 425;
    let f = |code, jt, jf, k| libc::sock_filter { code, jt, jf, k };
    let prog = [
        // seccomp_data.arch at offset 4: only filter x86_64 calls.
        f(BPF_LD_W_ABS, 0, 0, 4),
        f(BPF_JMP_JEQ_K, 0, 3, AUDIT_ARCH_X86_64),
        // seccomp_data.nr at offset 0.
        f(BPF_LD_W_ABS, 0, 0, 0),
        f(BPF_JMP_JEQ_K, 0, 1, NR_IO_URING_SETUP),
        f(BPF_RET_K, 0, 0, SECCOMP_RET_ERRNO | libc::EPERM as u32),
        f(BPF_RET_K, 0, 0, SECCOMP_RET_ALLOW),
    ];
    install_seccomp(&prog)
}

/// Install a seccomp filter making `fallocate` with mode 0 fail with `errno` (x86_64 syscall
/// 285; other modes, such as punching holes, still work).
pub fn fail_fallocate_mode0(errno: i32) -> std::io::Result<()> {
    const NR_FALLOCATE: u32 = 285;
    let f = |code, jt, jf, k| libc::sock_filter { code, jt, jf, k };
    let prog = [
        f(BPF_LD_W_ABS, 0, 0, 4),
        f(BPF_JMP_JEQ_K, 0, 5, AUDIT_ARCH_X86_64),
        f(BPF_LD_W_ABS, 0, 0, 0),
        f(BPF_JMP_JEQ_K, 0, 3, NR_FALLOCATE),
        // seccomp_data.args[1] (mode), low half, at offset 16 + 8.
        f(BPF_LD_W_ABS, 0, 0, 24),
        f(BPF_JMP_JEQ_K, 0, 1, 0),
        f(BPF_RET_K, 0, 0, SECCOMP_RET_ERRNO | errno as u32),
        f(BPF_RET_K, 0, 0, SECCOMP_RET_ALLOW),
    ];
    install_seccomp(&prog)
}

// ---------------------------------------------------------------------------------------------
// libblkio client
// ---------------------------------------------------------------------------------------------

/// One request. Buffers are given as byte ranges of the client's memory region.
#[derive(Clone, Debug)]
pub enum Op {
    Read {
        offset: u64,
        buf: usize,
        len: usize,
    },
    Write {
        offset: u64,
        buf: usize,
        len: usize,
    },
    /// (region offset, length) segments
    Readv {
        offset: u64,
        iov: Vec<(usize, usize)>,
    },
    Writev {
        offset: u64,
        iov: Vec<(usize, usize)>,
    },
    Flush,
    Discard {
        offset: u64,
        len: u64,
    },
    WriteZeroes {
        offset: u64,
        len: u64,
        flags: ReqFlags,
    },
}

#[derive(Clone, Copy, Debug)]
pub struct ClientOpts {
    pub num_queues: i32,
    /// libblkio's "read-only" property (needed to start on a read-only device).
    pub read_only: bool,
    /// Size of the one memory region shared with the backend.
    pub mem_size: usize,
}

impl Default for ClientOpts {
    fn default() -> Self {
        ClientOpts {
            num_queues: 1,
            read_only: false,
            mem_size: 4 * MIB as usize,
        }
    }
}

/// A started libblkio `virtio-blk-vhost-user` instance with one mapped memory region.
pub struct Client {
    // Field order is drop order: queues, then the instance (whose drop closes the socket).
    pub queues: Vec<Blkioq>,
    pub blkio: Blkio,
    pub mem: MemoryRegion,
}

/// Connects libblkio to `socket`, retrying while the connection is refused (the socket file may
/// exist a moment before the backend listens), up to `CONNECT_DEADLINE`. Errors after the
/// connection was established are returned as they are.
pub fn try_connect(socket: &Path, opts: ClientOpts) -> Result<Client, blkio::Error> {
    let deadline = Instant::now() + CONNECT_DEADLINE;
    let path = socket.to_str().expect("utf-8 socket path");
    let mut blkio = loop {
        let mut b = Blkio::new("virtio-blk-vhost-user")?;
        b.set_str("path", path)?;
        if opts.read_only {
            b.set_bool("read-only", true)?;
        }
        match b.connect() {
            Ok(()) => break b,
            Err(e) if Instant::now() < deadline => {
                let _ = e;
                thread::sleep(Duration::from_millis(10));
            }
            Err(e) => return Err(e),
        }
    };
    blkio.set_i32("num-queues", opts.num_queues)?;
    let started = blkio.start()?;
    let mem = blkio.alloc_mem_region(opts.mem_size)?;
    blkio.map_mem_region(&mem)?;
    Ok(Client {
        queues: started.queues,
        blkio,
        mem,
    })
}

/// `try_connect`, panicking on error.
pub fn connect(socket: &Path, opts: ClientOpts) -> Client {
    try_connect(socket, opts).unwrap_or_else(|e| {
        panic!(
            "libblkio connect to {}: {e} (errno {:?})",
            socket.display(),
            e.errno()
        )
    })
}

/// `connect` with `num_queues` queues and default options.
pub fn connect_queues(socket: &Path, num_queues: i32) -> Client {
    connect(
        socket,
        ClientOpts {
            num_queues,
            ..ClientOpts::default()
        },
    )
}

impl Client {
    pub fn capacity(&self) -> u64 {
        self.blkio.get_u64("capacity").expect("capacity property")
    }

    pub fn mem(&self) -> &[u8] {
        // SAFETY: the region is a live shared mapping of `len` bytes owned by `self.blkio`
        // until it is dropped; the borrow of `self` keeps it alive. The backend only writes to
        // it during requests, which `submit` waits for while holding `&mut self`.
        unsafe { std::slice::from_raw_parts(self.mem.addr as *const u8, self.mem.len) }
    }

    pub fn mem_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `mem`; `&mut self` makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.mem.addr as *mut u8, self.mem.len) }
    }

    /// Submits one request on queue `q` and waits for it: 0 or a negative errno.
    pub fn submit(&mut self, q: usize, op: Op) -> i32 {
        self.submit_batch(q, &[op])[0]
    }

    /// Submits all requests on queue `q` at once and waits for all; results in order.
    pub fn submit_batch(&mut self, q: usize, ops: &[Op]) -> Vec<i32> {
        let mem = MemView {
            addr: self.mem.addr,
            len: self.mem.len,
        };
        run_batch(&mut self.queues[q], mem, ops)
    }

    /// Writes `data` at disk `offset` from the start of the memory region.
    pub fn write_at(&mut self, q: usize, offset: u64, data: &[u8]) -> i32 {
        self.mem_mut()[..data.len()].copy_from_slice(data);
        self.submit(
            q,
            Op::Write {
                offset,
                buf: 0,
                len: data.len(),
            },
        )
    }

    /// Reads `len` bytes at disk `offset` into the start of the memory region.
    pub fn read_at(&mut self, q: usize, offset: u64, len: usize) -> Result<Vec<u8>, i32> {
        match self.submit(
            q,
            Op::Read {
                offset,
                buf: 0,
                len,
            },
        ) {
            0 => Ok(self.mem()[..len].to_vec()),
            err => Err(err),
        }
    }

    /// Reads the whole disk in chunks of at most the region size.
    pub fn read_all(&mut self, q: usize) -> Vec<u8> {
        let cap = self.capacity();
        let chunk = (self.mem.len as u64).min(MIB);
        let mut out = Vec::with_capacity(cap as usize);
        let mut off = 0;
        while off < cap {
            let n = (cap - off).min(chunk) as usize;
            let data = self
                .read_at(q, off, n)
                .unwrap_or_else(|e| panic!("read {n} bytes at {off}: errno {e}"));
            out.extend_from_slice(&data);
            off += n as u64;
        }
        out
    }

    /// Moves the queues out (e.g. to drive them from other threads) with a view of the memory
    /// region; the region stays valid as long as `self` (the `Blkio`) lives.
    pub fn take_queues(&mut self) -> (Vec<Blkioq>, MemView) {
        (
            std::mem::take(&mut self.queues),
            MemView {
                addr: self.mem.addr,
                len: self.mem.len,
            },
        )
    }
}

/// The client's memory region as address and length (Send, for use from other threads).
#[derive(Clone, Copy, Debug)]
pub struct MemView {
    pub addr: usize,
    pub len: usize,
}

impl MemView {
    /// A mutable view of `len` bytes at `off` of the region.
    ///
    /// # Safety
    /// The region must still be mapped (its `Client` alive), no request may be using these
    /// bytes, and no other live reference may overlap them.
    pub unsafe fn slice_mut<'a>(&self, off: usize, len: usize) -> &'a mut [u8] {
        assert!(
            off + len <= self.len,
            "{off}+{len} beyond region of {}",
            self.len
        );
        // SAFETY: in bounds (checked above); the rest is the caller's contract.
        unsafe { std::slice::from_raw_parts_mut((self.addr + off) as *mut u8, len) }
    }
}

/// Submits `ops` on `q` (buffers are ranges of `mem`) and waits for all of them with a deadline.
/// Returns each request's result (0 or a negative errno), in order.
pub fn run_batch(q: &mut Blkioq, mem: MemView, ops: &[Op]) -> Vec<i32> {
    let check = |buf: usize, len: usize| {
        assert!(
            buf + len <= mem.len,
            "buffer {buf}+{len} beyond region of {}",
            mem.len
        );
        (mem.addr + buf) as *mut u8
    };
    // iovec arrays must stay alive until their requests complete.
    let mut iovecs: Vec<Vec<libc::iovec>> = Vec::new();
    for (i, op) in ops.iter().enumerate() {
        match op {
            Op::Read { offset, buf, len } => {
                q.read(*offset, check(*buf, *len), *len, i, ReqFlags::empty())
            }
            Op::Write { offset, buf, len } => {
                q.write(*offset, check(*buf, *len), *len, i, ReqFlags::empty())
            }
            Op::Readv { offset, iov } | Op::Writev { offset, iov } => {
                let v: Vec<libc::iovec> = iov
                    .iter()
                    .map(|&(b, l)| libc::iovec {
                        iov_base: check(b, l).cast(),
                        iov_len: l,
                    })
                    .collect();
                iovecs.push(v);
                let v = iovecs.last().unwrap();
                if matches!(op, Op::Readv { .. }) {
                    q.readv(*offset, v.as_ptr(), v.len() as u32, i, ReqFlags::empty());
                } else {
                    q.writev(*offset, v.as_ptr(), v.len() as u32, i, ReqFlags::empty());
                }
            }
            Op::Flush => q.flush(i, ReqFlags::empty()),
            Op::Discard { offset, len } => q.discard(*offset, *len, i, ReqFlags::empty()),
            Op::WriteZeroes { offset, len, flags } => q.write_zeroes(*offset, *len, i, *flags),
        }
    }

    let mut results: Vec<Option<i32>> = vec![None; ops.len()];
    let mut done = 0;
    let deadline = Instant::now() + IO_DEADLINE;
    let mut completions: Vec<MaybeUninit<Completion>> = Vec::with_capacity(ops.len());
    completions.resize_with(ops.len(), MaybeUninit::uninit);
    while done < ops.len() {
        let mut timeout = deadline.saturating_duration_since(Instant::now());
        let n = q
            .do_io(
                &mut completions[..ops.len() - done],
                1,
                Some(&mut timeout),
                None,
            )
            .unwrap_or_else(|e| {
                panic!(
                    "do_io with {} of {} requests outstanding: {e} (errno {:?}); ops: {ops:?}",
                    ops.len() - done,
                    ops.len(),
                    e.errno()
                )
            });
        for c in &completions[..n] {
            // SAFETY: do_io initialised the first `n` elements.
            let c = unsafe { c.assume_init_ref() };
            assert!(
                results[c.user_data].is_none(),
                "duplicate completion {}",
                c.user_data
            );
            results[c.user_data] = Some(c.ret);
        }
        done += n;
    }
    drop(iovecs);
    results.into_iter().map(Option::unwrap).collect()
}

/// Negative errno values as libblkio reports them for virtio-blk status codes.
pub const EIO: i32 = -libc::EIO; // VIRTIO_BLK_S_IOERR
pub const ENOTSUP: i32 = -libc::ENOTSUP; // VIRTIO_BLK_S_UNSUPP
pub const EPROTO: i32 = -libc::EPROTO; // any other status byte

pub fn errno_name(ret: i32) -> String {
    if ret == 0 {
        "success".into()
    } else {
        format!("{ret} ({})", std::io::Error::from_raw_os_error(-ret))
    }
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

/// Skip where the machine lacks something, except under CI (`CI=true`), which must run it.
pub fn skip_or_fail<T>(why: &str) -> Option<T> {
    if std::env::var("CI").is_ok_and(|v| v == "true") {
        panic!("{why} (CI must run this test)");
    }
    println!("skipped: {why}");
    None
}

/// A loop device with `sector`-byte sectors, or None (with the reason printed) where the machine
/// cannot make one.
pub struct LoopDev(pub String);

impl LoopDev {
    pub fn new(backing: &Path, sector: u32) -> Option<LoopDev> {
        let o = Command::new("losetup")
            .args([
                "--sector-size",
                &sector.to_string(),
                "--direct-io=on",
                "-f",
                "--show",
            ])
            .arg(backing)
            .output();
        match o {
            Ok(o) if o.status.success() => Some(LoopDev(
                String::from_utf8_lossy(&o.stdout).trim().to_string(),
            )),
            Ok(o) => skip_or_fail(&format!(
                "cannot create a loop device: {}",
                String::from_utf8_lossy(&o.stderr).trim()
            )),
            Err(e) => skip_or_fail(&format!("losetup not available: {e}")),
        }
    }
}

impl Drop for LoopDev {
    fn drop(&mut self) {
        let _ = Command::new("losetup").args(["-d", &self.0]).status();
    }
}
