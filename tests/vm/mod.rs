//! Process and file helpers for the QEMU guest end-to-end test (std only).
//!
//! Every spawned process is owned by a [`ChildGuard`], which kills and reaps it when dropped,
//! so nothing outlives the test even when it panics.

#![allow(dead_code)]

pub mod qmp;
pub mod writing;

use std::env;
use std::ffi::OsStr;
use std::fs::{self, File};
use std::io::{self, BufRead, BufReader, Read};
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

/// Outcome of a prerequisite check: `Err(reason)` means "skip the test".
pub type Prereq<T> = Result<T, String>;

/// Skip (print `skipped: <why>`) or, with `VUBLK_E2E_REQUIRE=1`, fail.
pub fn skip(why: &str) {
    if env::var("VUBLK_E2E_REQUIRE").is_ok_and(|v| v == "1") {
        panic!("VUBLK_E2E_REQUIRE=1 but the test cannot run: {why}");
    }
    println!("skipped: {why}");
    crate::common::log_skip(why);
}

/// Find an executable: an explicit override (env var) or a search of `PATH` plus sbin dirs.
pub fn find_program(name: &str, override_var: &str) -> Prereq<PathBuf> {
    if let Some(p) = env::var_os(override_var) {
        let p = PathBuf::from(p);
        return if is_executable(&p) {
            Ok(p)
        } else {
            Err(format!(
                "{override_var}={} is not an executable",
                p.display()
            ))
        };
    }
    let path = env::var_os("PATH").unwrap_or_default();
    let extra = [
        PathBuf::from("/usr/sbin"),
        PathBuf::from("/sbin"),
        PathBuf::from("/usr/bin"),
    ];
    env::split_paths(&path)
        .chain(extra)
        .map(|d| d.join(name))
        .find(|p| is_executable(p))
        .ok_or_else(|| format!("{name} not found in PATH (or set {override_var})"))
}

fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// Parse sizes like `1073741824`, `512M`, `1G`, `1GiB`.
pub fn parse_size(s: &str) -> Option<u64> {
    let s = s.trim();
    let digits = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, suffix) = s.split_at(digits);
    let n: u64 = num.parse().ok()?;
    let shift = match suffix.trim().to_ascii_uppercase().as_str() {
        "" | "B" => 0,
        "K" | "KB" | "KIB" => 10,
        "M" | "MB" | "MIB" => 20,
        "G" | "GB" | "GIB" => 30,
        "T" | "TB" | "TIB" => 40,
        _ => return None,
    };
    n.checked_mul(1u64 << shift)
}

/// Owns a child process; kills (SIGKILL) and reaps it on drop unless it already exited.
pub struct ChildGuard {
    name: String,
    child: Option<Child>,
}

impl ChildGuard {
    pub fn spawn(name: &str, cmd: &mut Command) -> io::Result<Self> {
        let child = cmd
            .spawn()
            .map_err(|e| io::Error::new(e.kind(), format!("spawning {name} ({cmd:?}): {e}")))?;
        Ok(Self {
            name: name.to_owned(),
            child: Some(child),
        })
    }

    pub fn id(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
    }

    pub fn child_mut(&mut self) -> &mut Child {
        self.child.as_mut().expect("child already reaped")
    }

    /// Non-blocking: `Some(status)` once the process has exited.
    pub fn try_wait(&mut self) -> io::Result<Option<ExitStatus>> {
        match self.child.as_mut() {
            Some(c) => c.try_wait(),
            None => Ok(None),
        }
    }

    /// Wait for exit until `deadline`; `Ok(None)` on timeout (the process keeps running).
    pub fn wait_until(&mut self, deadline: Instant) -> io::Result<Option<ExitStatus>> {
        loop {
            if let Some(st) = self.try_wait()? {
                return Ok(Some(st));
            }
            let now = Instant::now();
            if now >= deadline {
                return Ok(None);
            }
            thread::sleep((deadline - now).min(Duration::from_millis(50)));
        }
    }

    /// Kill (if still running) and reap; returns the exit status.
    /// SIGTERM, then wait up to `timeout` for the exit (SIGKILL after that).
    pub fn terminate(&mut self, timeout: std::time::Duration) -> Option<ExitStatus> {
        let child = self.child.as_mut()?;
        if let Ok(Some(st)) = child.try_wait() {
            self.child = None;
            return Some(st);
        }
        // SAFETY: signalling our own, not yet reaped child.
        unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
        let deadline = std::time::Instant::now() + timeout;
        while std::time::Instant::now() < deadline {
            if let Ok(Some(st)) = child.try_wait() {
                self.child = None;
                return Some(st);
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        self.kill()
    }

    pub fn kill(&mut self) -> Option<ExitStatus> {
        let mut child = self.child.take()?;
        if let Ok(Some(st)) = child.try_wait() {
            return Some(st);
        }
        let _ = child.kill();
        child.wait().ok()
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if let Some(st) = self.kill() {
            if thread::panicking() {
                eprintln!("[vm] {} stopped ({st})", self.name);
            }
        }
    }
}

/// Poll until `path` is a UNIX socket; fail early if `owner` exits, or at the deadline.
pub fn wait_for_socket(
    path: &Path,
    owner: &mut ChildGuard,
    timeout: Duration,
) -> Result<(), String> {
    let deadline = Instant::now() + timeout;
    loop {
        if fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_socket()) {
            return Ok(());
        }
        match owner.try_wait() {
            Ok(Some(st)) => {
                return Err(format!(
                    "{} exited ({st}) before creating {}",
                    owner.name,
                    path.display()
                ))
            }
            Ok(None) => {}
            Err(e) => return Err(format!("waiting for {}: {e}", owner.name)),
        }
        if Instant::now() >= deadline {
            return Err(format!(
                "{} did not create {} within {timeout:?}",
                owner.name,
                path.display()
            ));
        }
        thread::sleep(Duration::from_millis(20));
    }
}

/// Collect a child's output line by line on a thread; lines are also sent to a channel so the
/// caller can echo progress while it waits.
pub struct LineCollector {
    rx: mpsc::Receiver<String>,
    handle: Option<thread::JoinHandle<()>>,
    lines: Vec<String>,
}

impl LineCollector {
    pub fn new<R: Read + Send + 'static>(reader: R, tee: Option<File>) -> Self {
        let (tx, rx) = mpsc::channel();
        let handle = thread::spawn(move || {
            let mut tee = tee;
            let mut r = BufReader::new(reader);
            let mut buf = Vec::new();
            loop {
                buf.clear();
                match r.read_until(b'\n', &mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(_) => {
                        if let Some(f) = tee.as_mut() {
                            use std::io::Write;
                            let _ = f.write_all(&buf);
                        }
                        let line = String::from_utf8_lossy(&buf);
                        let line = line.trim_end_matches(['\n', '\r']).to_owned();
                        if tx.send(line).is_err() {
                            break;
                        }
                    }
                }
            }
        });
        Self {
            rx,
            handle: Some(handle),
            lines: Vec::new(),
        }
    }

    /// Lines that arrived since the last call (non-blocking).
    pub fn poll(&mut self) -> Vec<String> {
        let new: Vec<String> = self.rx.try_iter().collect();
        self.lines.extend(new.iter().cloned());
        new
    }

    /// Wait for EOF (the writer has exited) and return everything collected.
    pub fn finish(mut self) -> Vec<String> {
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
        self.poll();
        std::mem::take(&mut self.lines)
    }
}

/// A scratch directory removed on drop unless the test failed or `keep` is set.
pub struct ScratchDir {
    pub path: PathBuf,
    pub keep: bool,
}

impl ScratchDir {
    pub fn new(parent: &Path, name: &str) -> io::Result<Self> {
        let path = parent.join(name);
        if path.exists() {
            fs::remove_dir_all(&path)?;
        }
        fs::create_dir_all(&path)?;
        Ok(Self { path, keep: false })
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        if self.keep || thread::panicking() {
            eprintln!("[vm] kept {}", self.path.display());
        } else {
            let _ = fs::remove_dir_all(&self.path);
        }
    }
}

/// Run a command to completion, returning (status, stdout, stderr) as text.
pub fn run_capture(
    program: impl AsRef<OsStr>,
    args: &[&OsStr],
) -> io::Result<(ExitStatus, String, String)> {
    let out = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .output()?;
    Ok((
        out.status,
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    ))
}

/// Contents of a log file, for failure messages (empty if unreadable).
pub fn read_log(path: &Path) -> String {
    fs::read(path)
        .map(|b| String::from_utf8_lossy(&b).into_owned())
        .unwrap_or_default()
}

/// What the guest prints before each of its marker lines.
pub const MARK: &str = "VUBLK-E2E: ";

/// The guest kernel, initramfs and the pattern file baked into it.
pub struct Guest {
    pub kver: String,
    pub kernel: PathBuf,
    pub kernel_kind: String,
    pub initrd: PathBuf,
    pub pattern: PathBuf,
}

/// Build (or reuse) the guest kernel + initramfs. `Err` = skip reason.
pub fn build_guest(out_dir: &Path) -> Result<Guest, String> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("contrib/guest/build-initramfs.sh");
    let out = Command::new("bash")
        .arg(&script)
        .arg(out_dir)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("running {}: {e}", script.display()))?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    for l in stderr.lines() {
        println!("[build] {l}");
    }
    match out.status.code() {
        Some(0) => {}
        Some(77) => return Err(format!("guest prerequisites missing: {}", stderr.trim())),
        _ => panic!("{} failed ({}):\n{stderr}", script.display(), out.status),
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    let get = |key: &str| -> String {
        stdout
            .lines()
            .find_map(|l| l.strip_prefix(key).and_then(|r| r.strip_prefix('=')))
            .unwrap_or_else(|| panic!("build script printed no {key}=:\n{stdout}"))
            .to_owned()
    };
    Ok(Guest {
        kver: get("KVER"),
        kernel: get("KERNEL").into(),
        kernel_kind: get("KERNEL_KIND"),
        initrd: get("INITRD").into(),
        pattern: get("PATTERN").into(),
    })
}

pub fn env_or(key: &str, default: &str) -> String {
    env::var(key).unwrap_or_else(|_| default.to_owned())
}

/// The guest's marker lines (text after "VUBLK-E2E: "), wherever they start in a line.
pub fn markers(lines: &[String]) -> Vec<String> {
    lines
        .iter()
        .filter_map(|l| l.find(MARK).map(|i| l[i + MARK.len()..].to_owned()))
        .collect()
}

/// A one-queue, 512 MiB guest on vublk's socket `sock` with kernel command line `append`,
/// its serial console collected (and kept in `run`/serial.log, QEMU's stderr in
/// `run`/qemu.log).
pub fn start_one_queue_guest(
    qemu: &Path,
    guest: &Guest,
    sock: &Path,
    append: &str,
    run: &Path,
) -> (ChildGuard, LineCollector) {
    let mut qcmd = guest_command(
        qemu,
        guest,
        "512M",
        1,
        &format!("path={}", sock.display()),
        ",num-queues=1",
        append,
    );
    qcmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(File::create(run.join("qemu.log")).unwrap());
    let mut q = ChildGuard::spawn("qemu", &mut qcmd).unwrap();
    let stdout = q.child_mut().stdout.take().unwrap();
    let serial = LineCollector::new(stdout, File::create(run.join("serial.log")).ok());
    (q, serial)
}

/// What a failed guest run prints: its serial lines, vublk's log and QEMU's (`qemu.log` in
/// the run directory).
pub fn dump(lines: &[String], vublk_log: &Path, run: &Path) -> String {
    format!(
        "--- serial:\n{}\n--- vublk:\n{}\n--- qemu:\n{}",
        lines.join("\n"),
        read_log(vublk_log),
        read_log(&run.join("qemu.log"))
    )
}

/// A guest run that ended (`exited`: QEMU exited before the test's deadline) must have
/// reported no FAIL and a PASS; its markers.
pub fn assert_passed(exited: bool, lines: &[String], vublk_log: &Path, run: &Path) -> Vec<String> {
    let marks = markers(lines);
    assert!(exited, "the guest hung\n{}", dump(lines, vublk_log, run));
    if let Some(f) = marks.iter().find(|m| m.starts_with("FAIL")) {
        panic!("guest reported {f}\n{}", dump(lines, vublk_log, run));
    }
    assert!(
        marks.iter().any(|m| m.starts_with("PASS")),
        "no PASS\n{}",
        dump(lines, vublk_log, run)
    );
    marks
}

/// Every block each writer of the guest's `restart` workload reported (its WROTE and BULK
/// markers) is in the image, with its pattern block; returns how many blocks were checked.
/// Block i of writer w is at device block (i * writers + w) * 16 (4 KiB blocks).
pub fn check_blocks(
    marks: &[String],
    image: &Path,
    pattern: &Path,
    writers: u64,
    disk_bytes: u64,
) -> u64 {
    use std::os::unix::fs::FileExt;
    const BLOCK: u64 = 4096;
    const STRIDE_BLOCKS: u64 = 16;
    let pat = fs::read(pattern).unwrap();
    let pat_blocks = pat.len() as u64 / BLOCK;
    let img = File::open(image).unwrap();
    let mut total = 0;
    let mut buf = vec![0u8; BLOCK as usize];
    for m in marks.iter().filter_map(|m| m.strip_prefix("WROTE ")) {
        let field = |k: &str| -> u64 {
            m.split_whitespace()
                .find_map(|f| f.strip_prefix(k)?.strip_prefix('='))
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("no {k} in WROTE {m}"))
        };
        let (w, n) = (field("writer"), field("blocks"));
        for i in 0..n {
            let b = i * writers + w;
            img.read_exact_at(&mut buf, b * STRIDE_BLOCKS * BLOCK)
                .unwrap();
            let p = ((b % pat_blocks) * BLOCK) as usize;
            assert!(
                buf == pat[p..p + BLOCK as usize],
                "writer {w} block {i} (device offset {}) does not hold what the guest wrote{}",
                b * STRIDE_BLOCKS * BLOCK,
                if buf.iter().all(|&x| x == 0) {
                    ": zeroes (lost)"
                } else {
                    ""
                }
            );
        }
        total += n;
    }
    assert_eq!(
        marks.iter().filter(|m| m.starts_with("WROTE ")).count() as u64,
        writers
    );
    // The bulk writers' 1 MiB blocks in the upper half; only the last write of each place
    // counts (they wrap around).
    let mib = 1u64 << 20;
    let half_mib = disk_bytes / 2 / mib;
    let mut big = vec![0u8; mib as usize];
    let mut bulk = 0;
    for m in marks.iter().filter_map(|m| m.strip_prefix("BULK ")) {
        let field = |k: &str| -> u64 {
            m.split_whitespace()
                .find_map(|f| f.strip_prefix(k)?.strip_prefix('='))
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("no {k} in BULK {m}"))
        };
        let (k, n) = (field("writer"), field("blocks"));
        for j in n.saturating_sub(half_mib / 2)..n {
            let at = disk_bytes / 2 + ((2 * j + k) % half_mib) * mib;
            img.read_exact_at(&mut big, at).unwrap();
            let p = ((j % 24) * mib) as usize;
            assert!(
                big == pat[p..p + mib as usize],
                "bulk writer {k} block {j} (device offset {at}) does not hold what the guest wrote"
            );
        }
        bulk += n;
    }
    assert_eq!(marks.iter().filter(|m| m.starts_with("BULK ")).count(), 2);
    total + bulk
}

/// The QEMU command line every guest test uses: TCG, `mem` of shared memfd memory (vhost-user
/// needs it), `smp` vCPUs, one vhost-user-blk disk on the `-chardev socket` options `chardev`
/// (`path=...`, `reconnect-ms=...`) with `device_props` (`,num-queues=2...`), serial on
/// stdout, no monitor, no NIC (skips iPXE), virtio-rng (seeds the guest's crng, else
/// mke2fs stalls), the guest kernel and initramfs with kernel command line `append`.
/// Stdin, stdout and stderr are the caller's to set.
pub fn guest_command(
    qemu: &Path,
    guest: &Guest,
    mem: &str,
    smp: u32,
    chardev: &str,
    device_props: &str,
    append: &str,
) -> Command {
    let mut cmd = Command::new(qemu);
    cmd.args(["-accel", "tcg", "-m", mem, "-smp", &smp.to_string()])
        .arg("-object")
        .arg(format!("memory-backend-memfd,id=mem,size={mem},share=on"))
        .args(["-numa", "node,memdev=mem"])
        .arg("-chardev")
        .arg(format!("socket,id=c0,{chardev}"))
        .arg("-device")
        .arg(format!("vhost-user-blk-pci,chardev=c0{device_props}"))
        .args([
            "-nographic",
            "-no-reboot",
            "-serial",
            "stdio",
            "-monitor",
            "none",
        ])
        .args(["-nic", "none", "-device", "virtio-rng-pci"])
        .arg("-kernel")
        .arg(&guest.kernel)
        .arg("-initrd")
        .arg(&guest.initrd)
        .arg("-append")
        .arg(append);
    cmd
}

/// QEMU (`VUBLK_E2E_QEMU` or PATH), the other `tools` the test needs, and the guest kernel
/// and initramfs (built or reused under the target directory); None, with "skipped: why"
/// (a failure under `VUBLK_E2E_REQUIRE=1`), where the machine lacks one.
pub fn guest_prerequisites(tools: &[&str]) -> Option<(PathBuf, Guest)> {
    let qemu = match find_program("qemu-system-x86_64", "VUBLK_E2E_QEMU") {
        Ok(p) => p,
        Err(e) => {
            skip(&e);
            return None;
        }
    };
    for tool in tools {
        if let Err(e) = find_program(tool, "VUBLK_E2E_QEMU_IMG") {
            skip(&e);
            return None;
        }
    }
    let tmp = Path::new(env!("CARGO_TARGET_TMPDIR"));
    match build_guest(&tmp.join("vm-e2e-guest")) {
        Ok(g) => Some((qemu, g)),
        Err(e) => {
            skip(&e);
            None
        }
    }
}

/// Start the vublk under test on `sock` serving `image` with `queues` queues and `extra`
/// options, logging (RUST_LOG=info) to `log`.
pub fn spawn_vublk(
    name: &str,
    log: &Path,
    sock: &Path,
    image: &Path,
    queues: u32,
    extra: &[&str],
) -> ChildGuard {
    let f = File::create(log).unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_vublk"));
    cmd.arg("--socket-path")
        .arg(sock)
        .arg("--blk-file")
        .arg(image)
        .args(["--num-queues", &queues.to_string()])
        .args(extra)
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(f.try_clone().unwrap())
        .stderr(f);
    ChildGuard::spawn(name, &mut cmd).unwrap()
}

/// Wait until the process logging to `log` listens (the socket file of a killed process
/// is still there, so the file alone says nothing).
pub fn wait_listening(p: &mut ChildGuard, log: &Path) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !read_log(log).contains("listening on") {
        if let Ok(Some(st)) = p.try_wait() {
            panic!("vublk exited ({st}) before listening:\n{}", read_log(log));
        }
        assert!(
            Instant::now() < deadline,
            "vublk did not listen:\n{}",
            read_log(log)
        );
        thread::sleep(Duration::from_millis(5));
    }
}

/// Decrypt a LUKS volume with QEMU's own luks driver (`qemu-img convert`, the passphrase in
/// the file `pass`) into the raw file `raw`: the independent view of what vublk wrote.
pub fn luks_to_raw(image: &Path, pass: &Path, raw: &Path) {
    let st = Command::new("qemu-img")
        .arg("convert")
        .arg("--object")
        .arg(format!("secret,id=s0,file={}", pass.display()))
        .arg("--image-opts")
        .arg(format!(
            "driver=luks,key-secret=s0,file.filename={}",
            image.display()
        ))
        .args(["-O", "raw"])
        .arg(raw)
        .status()
        .expect("qemu-img convert");
    assert!(st.success(), "QEMU could not decrypt {}", image.display());
}
