//! End-to-end test with a real Linux guest: QEMU (TCG) boots a busybox initramfs whose
//! workload (contrib/guest/e2e-workload.sh) runs mkfs.ext4, e2fsck, file write/verify and raw
//! O_DIRECT pattern I/O on a vhost-user-blk disk served by the backend under test.
//!
//! Environment:
//! - `VUBLK_E2E_BACKEND` = `vublk` (default) or `qsd` (qemu-storage-daemon, to validate the
//!   harness itself)
//! - `VUBLK_E2E_BACKEND_ARGS`: extra whitespace-separated arguments for the backend (vublk only)
//! - `VUBLK_E2E_DISK_SIZE`: disk size, e.g. `1G` (default), `512M`, bytes; at least 256 MiB
//! - `VUBLK_E2E_TIMEOUT`: seconds before QEMU is killed (default 900)
//! - `VUBLK_E2E_REQUIRE=1`: missing prerequisites fail the test instead of skipping it (CI)
//! - `VUBLK_E2E_FILL=1`: also fill the filesystem with copies of the pattern and verify them
//! - `VUBLK_E2E_KEEP=1`: keep the run directory (image, logs) even on success
//! - `VUBLK_E2E_QEMU`, `VUBLK_E2E_QSD`, `VUBLK_E2E_E2FSCK`: program overrides
//! - `VUBLK_E2E_KVER`, `VUBLK_E2E_KERNEL`: guest kernel choice (see build-initramfs.sh)
//!
//! Run: `cargo test --test vm_e2e -- --nocapture` (prints the guest's timings as they come).

mod common;
mod vm;

use std::env;
use std::ffi::OsStr;
use std::fs::{self, File};
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use vm::{
    build_guest, env_or, find_program, markers, parse_size, read_log, skip, ChildGuard,
    LineCollector, ScratchDir, MARK,
};

const NUM_QUEUES: u32 = 2;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Backend {
    Vublk,
    Qsd,
}

/// "uptime=12.34s" in the marker starting with `prefix`.
fn uptime_of(markers: &[String], prefix: &str) -> Option<f64> {
    markers
        .iter()
        .find(|m| m.starts_with(prefix))?
        .split_whitespace()
        .find_map(|w| w.strip_prefix("uptime="))?
        .trim_end_matches('s')
        .parse()
        .ok()
}

/// Compare the image ranges named by the guest's REGION markers with pattern.bin.
fn check_regions(markers: &[String], image: &Path, pattern: &Path) -> Result<usize, String> {
    let img = File::open(image).map_err(|e| format!("{}: {e}", image.display()))?;
    let pat = File::open(pattern).map_err(|e| format!("{}: {e}", pattern.display()))?;
    let mut n = 0;
    for m in markers.iter().filter(|m| m.starts_with("REGION ")) {
        let field = |k: &str| -> u64 {
            m.split_whitespace()
                .find_map(|w| w.strip_prefix(k).and_then(|r| r.strip_prefix('=')))
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("malformed marker {m:?}"))
        };
        let (dev_off, pat_off, len) = (field("dev_off"), field("pat_off"), field("len"));
        let mut a = vec![0u8; len as usize];
        let mut b = vec![0u8; len as usize];
        img.read_exact_at(&mut a, dev_off)
            .map_err(|e| format!("reading image at {dev_off}: {e}"))?;
        pat.read_exact_at(&mut b, pat_off)
            .map_err(|e| format!("reading pattern at {pat_off}: {e}"))?;
        if let Some(i) = a.iter().zip(&b).position(|(x, y)| x != y) {
            return Err(format!(
                "image byte {} differs from pattern byte {} (region {m:?})",
                dev_off + i as u64,
                pat_off + i as u64
            ));
        }
        n += 1;
    }
    Ok(n)
}

fn tail(s: &str, n: usize) -> String {
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// One guest run's device configuration.
struct Variant {
    name: &'static str,
    /// Extra vublk options (the variant is skipped under qemu-storage-daemon if non-empty).
    vublk_args: &'static [&'static str],
    /// `--serial`, checked in the guest's /sys/block/vda/serial.
    serial: Option<&'static str>,
    /// Logical block size the guest must see.
    logical_block: u32,
    /// A zero-write mode of the workload (`zero-dd`, `zero-mkfs`) instead of the full run.
    mode: Option<&'static str>,
    /// Extra `vhost-user-blk-pci` properties, e.g. `,write-zeroes=off`.
    device_props: &'static str,
    /// Builds the image to serve in the run directory (default: a sparse raw file).
    prepare: Option<fn(&Path, u64) -> PathBuf>,
    /// Serve an RBD image of a throwaway Ceph cluster instead (checked through `rbd export`).
    rbd: bool,
    /// Serve the image through qemu-nbd (a UNIX socket) as an NBD export.
    nbd: bool,
}

/// What a zero-write run may leave allocated in the image, in bytes.
fn zero_mode_allocation_limit(variant: &Variant, disk_size: u64) -> (u64, u64) {
    let unmap = variant.vublk_args.contains(&"unmap");
    match (variant.mode, unmap) {
        // dd of zeroes over the whole disk: plain writes allocate (nearly) all of it; with
        // detect-zeroes=unmap almost nothing (seed 002: < 16 MiB).
        (Some("zero-dd"), false) => (disk_size / 10 * 9, u64::MAX),
        (Some("zero-dd"), true) => (0, 16 << 20),
        // mke2fs writing real zeroes: with unmap only the non-zero metadata stays.
        (Some("zero-mkfs"), true) => (0, 16 << 20),
        _ => (0, u64::MAX),
    }
}

/// Guest runs one at a time: two TCG guests on two cores would only slow each other down.
static ONE_GUEST_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[test]
fn guest_mkfs_fsck_and_pattern_io() {
    run_guest(&Variant {
        name: "default",
        vublk_args: &[],
        serial: Some("vublk-e2e-serial-01"),
        logical_block: 512,
        mode: None,
        device_props: "",
        prepare: None,
        rbd: false,
        nbd: false,
    });
}

/// 4096-byte logical blocks, the blocking engine and the page cache.
#[test]
fn guest_on_4k_blocks_with_threads_engine_and_page_cache() {
    run_guest(&Variant {
        name: "4k-threads-writeback",
        vublk_args: &[
            "--logical-block-size",
            "4096",
            "--aio",
            "threads",
            "--cache",
            "writeback",
        ],
        serial: None,
        logical_block: 4096,
        mode: None,
        device_props: "",
        prepare: None,
        rbd: false,
        nbd: false,
    });
}

/// detect-zeroes in a guest (seed 002): `dd if=/dev/zero` over the whole disk and mke2fs
/// writing real zeroes (the device offers no WRITE_ZEROES), with detect-zeroes off and unmap;
/// the image's allocation tells whether the zero writes were turned into holes.
#[test]
fn guest_zero_writes_with_and_without_detect_zeroes() {
    for mode in ["zero-dd", "zero-mkfs"] {
        for (name, args) in [
            ("off", &[][..]),
            (
                "unmap",
                &["--detect-zeroes", "unmap", "--discard", "unmap"][..],
            ),
        ] {
            let name: &'static str = Box::leak(format!("{mode}-{name}").into_boxed_str());
            run_guest(&Variant {
                name,
                vublk_args: args,
                serial: None,
                logical_block: 512,
                mode: Some(mode),
                device_props: ",write-zeroes=off",
                prepare: None,
                rbd: false,
                nbd: false,
            });
        }
    }
}

fn run_guest(variant: &Variant) {
    let _one = ONE_GUEST_AT_A_TIME
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    let t_start = Instant::now();
    if !cfg!(all(target_os = "linux", target_arch = "x86_64")) {
        return skip("the guest test needs an x86_64 Linux host");
    }
    let backend = match env_or("VUBLK_E2E_BACKEND", "vublk").as_str() {
        "vublk" => Backend::Vublk,
        "qsd" | "qemu-storage-daemon" => Backend::Qsd,
        other => panic!("VUBLK_E2E_BACKEND={other}: expected vublk or qsd"),
    };
    let qemu = match find_program("qemu-system-x86_64", "VUBLK_E2E_QEMU") {
        Ok(p) => p,
        Err(e) => return skip(&e),
    };
    let qsd = match backend {
        Backend::Qsd => match find_program("qemu-storage-daemon", "VUBLK_E2E_QSD") {
            Ok(p) => Some(p),
            Err(e) => return skip(&e),
        },
        Backend::Vublk => None,
    };
    if backend == Backend::Qsd && !variant.vublk_args.is_empty() {
        println!(
            "[vm] variant {} uses vublk options: not run under qemu-storage-daemon",
            variant.name
        );
        return;
    }
    let disk_size = parse_size(&env_or("VUBLK_E2E_DISK_SIZE", "1G"))
        .expect("VUBLK_E2E_DISK_SIZE: expected e.g. 1G, 512M or a byte count");
    assert!(
        disk_size >= 256 << 20,
        "VUBLK_E2E_DISK_SIZE must be at least 256 MiB"
    );
    let timeout = Duration::from_secs(
        env_or("VUBLK_E2E_TIMEOUT", "900")
            .parse()
            .expect("VUBLK_E2E_TIMEOUT: seconds"),
    );

    // ---- guest kernel + initramfs (cached under target/)
    let tmp = Path::new(env!("CARGO_TARGET_TMPDIR"));
    let t_build = Instant::now();
    let guest = match build_guest(&tmp.join("vm-e2e-guest")) {
        Ok(g) => g,
        Err(e) => return skip(&e),
    };
    let build_time = t_build.elapsed();
    println!(
        "[vm] guest kernel {} ({}), initramfs {}",
        guest.kver,
        guest.kernel_kind,
        guest.initrd.display()
    );

    // ---- run directory, sparse image, socket
    let backend_name = match backend {
        Backend::Vublk => "vublk",
        Backend::Qsd => "qsd",
    };
    let mut run = ScratchDir::new(
        tmp,
        &format!(
            "vm-e2e-run-{backend_name}-{}-{}",
            variant.name,
            std::process::id()
        ),
    )
    .expect("creating run directory");
    run.keep = env::var("VUBLK_E2E_KEEP").is_ok_and(|v| v == "1");
    #[cfg(feature = "rbd")]
    let ceph = if variant.rbd {
        let Some(ceph) = common::Ceph::with_disk(&run.path, disk_size) else {
            return;
        };
        Some(ceph)
    } else {
        None
    };
    let file_image = match variant.prepare {
        _ if variant.rbd => PathBuf::from("rbd:rbd/disk"),
        Some(prepare) => prepare(&run.path, disk_size),
        None => {
            let image = run.path.join("disk.img");
            File::create(&image)
                .and_then(|f| f.set_len(disk_size))
                .expect("creating sparse disk image");
            image
        }
    };
    // An NBD export of the file: qemu-nbd on a UNIX socket, one connection per queue.
    let mut nbd_server = None;
    let image = if variant.nbd {
        let nsock = run.path.join("nbd.sock");
        let mut cmd = Command::new("qemu-nbd");
        cmd.arg("--socket")
            .arg(&nsock)
            .args(["--export-name", "disk", "--format", "raw", "--persistent"])
            .args(["--shared", "8", "--cache", "none", "--aio", "io_uring"])
            .arg(&file_image)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(File::create(run.path.join("qemu-nbd.log")).unwrap());
        let mut p = ChildGuard::spawn("qemu-nbd", &mut cmd).expect("starting qemu-nbd");
        vm::wait_for_socket(&nsock, &mut p, Duration::from_secs(20)).unwrap();
        nbd_server = Some(p);
        PathBuf::from(format!("nbd+unix:///disk?socket={}", nsock.display()))
    } else {
        file_image.clone()
    };
    let mut sock = run.path.join("vhost-user-blk.sock");
    if sock.as_os_str().len() > 100 {
        // sun_path holds 108 bytes
        sock = env::temp_dir().join(format!(
            "vublk-e2e-{}-{}.sock",
            variant.name,
            std::process::id()
        ));
        let _ = fs::remove_file(&sock);
    }
    let backend_log = run.path.join("backend.log");
    let serial_log = run.path.join("serial.log");
    let qemu_log = run.path.join("qemu.log");

    // ---- backend
    let log_file = File::create(&backend_log).expect("creating backend.log");
    let mut cmd;
    match backend {
        Backend::Vublk => {
            cmd = Command::new(env!("CARGO_BIN_EXE_vublk"));
            // In the run directory: a variant's options may name files in it (a key).
            cmd.current_dir(&run.path);
            cmd.arg("--socket-path")
                .arg(&sock)
                .arg("--blk-file")
                .arg(&image)
                .arg("--num-queues")
                .arg(NUM_QUEUES.to_string())
                .args(variant.vublk_args);
            #[cfg(feature = "rbd")]
            if let Some(ceph) = &ceph {
                cmd.args(ceph.args());
            }
            if let Some(serial) = variant.serial {
                cmd.args(["--serial", serial]);
            }
            if let Ok(extra) = env::var("VUBLK_E2E_BACKEND_ARGS") {
                cmd.args(extra.split_whitespace());
            }
        }
        Backend::Qsd => {
            cmd = Command::new(qsd.as_ref().unwrap());
            // Image formats through QEMU's own drivers (raw files as the file itself).
            let blockdev = match image.extension().and_then(|e| e.to_str()) {
                Some(f @ ("qcow2" | "parallels")) => format!(
                    "driver={f},node-name=file0,read-only={},file.driver=file,\
                     file.filename={},file.cache.direct=on,file.aio=io_uring",
                    if variant.vublk_args.contains(&"--read-only") {
                        "on"
                    } else {
                        "off"
                    },
                    image.display()
                ),
                _ => format!(
                    "driver=file,node-name=file0,filename={},cache.direct=on,aio=io_uring",
                    image.display()
                ),
            };
            cmd.arg("--blockdev")
                .arg(blockdev)
                .arg("--export")
                .arg(format!(
                    "type=vhost-user-blk,id=exp0,node-name=file0,addr.type=unix,addr.path={},\
                     writable=on,num-queues={NUM_QUEUES}",
                    sock.display()
                ));
        }
    }
    cmd.stdin(Stdio::null())
        .stdout(log_file.try_clone().expect("dup log fd"))
        .stderr(log_file);
    println!("[vm] backend: {cmd:?}");
    let t_backend = Instant::now();
    let mut backend_proc = ChildGuard::spawn(backend_name, &mut cmd).expect("starting backend");
    if let Err(e) = vm::wait_for_socket(&sock, &mut backend_proc, Duration::from_secs(30)) {
        panic!("{e}\n--- backend log:\n{}", read_log(&backend_log));
    }
    let backend_ready = t_backend.elapsed();

    // ---- QEMU
    let mem = "1G";
    let fill = env_or("VUBLK_E2E_FILL", "0");
    let mut append = format!(
        "console=ttyS0 panic=-1 loglevel=4 E2E_QUEUES={NUM_QUEUES} E2E_FILL={fill} E2E_LBS={}",
        variant.logical_block
    );
    if let Some(mode) = variant.mode {
        append.push_str(&format!(" E2E_MODE={mode}"));
    }
    if let (Backend::Vublk, Some(serial)) = (backend, variant.serial) {
        append.push_str(&format!(" E2E_SERIAL={serial}"));
    }
    let mut qcmd = vm::guest_command(
        &qemu,
        &guest,
        mem,
        NUM_QUEUES,
        &format!("path={}", sock.display()),
        &format!(",num-queues={NUM_QUEUES}{}", variant.device_props),
        &append,
    );
    qcmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(File::create(&qemu_log).expect("creating qemu.log"));
    println!("[vm] qemu: {qcmd:?}");
    let t_qemu = Instant::now();
    let mut qemu_proc = ChildGuard::spawn("qemu", &mut qcmd).expect("starting qemu");
    let stdout = qemu_proc.child_mut().stdout.take().expect("qemu stdout");
    let mut serial = LineCollector::new(stdout, File::create(&serial_log).ok());

    let deadline = t_qemu + timeout;
    let mut backend_died = None;
    let mut seen = 0;
    let qemu_status = loop {
        let new = serial.poll();
        seen += new.len();
        for l in new {
            if let Some(i) = l.find(MARK) {
                println!(
                    "[guest {:6.1}s] {}",
                    t_qemu.elapsed().as_secs_f64(),
                    &l[i..]
                );
            }
        }
        if let Some(st) = qemu_proc.try_wait().expect("waiting for qemu") {
            break Some(st);
        }
        if backend_died.is_none() {
            if let Some(st) = backend_proc.try_wait().expect("waiting for backend") {
                // The guest would hang on I/O: give QEMU a moment to exit by itself, then stop.
                backend_died = Some(st);
                if let Ok(Some(st)) = qemu_proc.wait_until(Instant::now() + Duration::from_secs(5))
                {
                    break Some(st);
                }
                qemu_proc.kill();
                break None;
            }
        }
        if Instant::now() >= deadline {
            qemu_proc.kill();
            break None;
        }
        thread::sleep(Duration::from_millis(100));
    };
    let qemu_time = t_qemu.elapsed();
    let lines = serial.finish();
    // lines that arrived between the last poll and EOF
    for l in &lines[seen..] {
        if let Some(i) = l.find(MARK) {
            println!("[guest {:6.1}s] {}", qemu_time.as_secs_f64(), &l[i..]);
        }
    }
    let marks = markers(&lines);
    // Stop the backend before looking at the image: vublk must finish, flush and exit 0 on
    // SIGTERM; qemu-storage-daemon is just killed.
    let backend_status = match backend {
        Backend::Vublk => backend_proc.terminate(Duration::from_secs(30)),
        Backend::Qsd => backend_proc.kill(),
    };

    let failures: Vec<&String> = marks.iter().filter(|m| m.starts_with("FAIL")).collect();
    let passed = marks.iter().any(|m| m.starts_with("PASS"));
    let why = match (backend_died, qemu_status) {
        (Some(st), _) => Some(format!("backend exited while the guest was running ({st})")),
        (None, None) => Some(format!("timeout: guest did not finish within {timeout:?}")),
        _ if !failures.is_empty() => Some(format!("guest reported {}", failures[0])),
        _ if !passed => Some("guest printed no PASS marker".to_owned()),
        (None, Some(st)) if !st.success() => Some(format!("qemu exited with {st}")),
        _ => None,
    };
    if let Some(why) = why {
        panic!(
            "{why}\n--- serial console ({}):\n{}\n--- qemu stderr:\n{}\n--- backend log (last 100 lines):\n{}\n",
            serial_log.display(),
            lines.join("\n"),
            read_log(&qemu_log),
            tail(&read_log(&backend_log), 100)
        );
    }

    if let Some(mode) = variant.mode {
        let allocated = fs::metadata(&image).map(|m| m.blocks() * 512).unwrap_or(0);
        let time = marks
            .iter()
            .find_map(|m| m.strip_prefix(&format!("TIME {mode} ")))
            .unwrap_or("?");
        println!(
            "[vm] {}: {mode} took {time}, image allocation {} MiB of {} MiB",
            variant.name,
            allocated >> 20,
            disk_size >> 20
        );
        if backend == Backend::Vublk {
            let log = read_log(&backend_log);
            if let Some(l) = log
                .lines()
                .rev()
                .find(|l| l.contains("detect-zeroes/discard:"))
            {
                println!("[vm] {}: {}", variant.name, l.trim());
            }
            if mode == "ro-verify" {
                assert!(
                    log.contains("qcow2 v3") && log.contains("backing file"),
                    "not served as a qcow2 chain:\n{}",
                    tail(&log, 20)
                );
            }
            let (min, max) = zero_mode_allocation_limit(variant, disk_size);
            assert!(
                (min..=max).contains(&allocated),
                "{}: image allocation {allocated} bytes outside [{min}, {max}]",
                variant.name
            );
        }
        return;
    }

    if backend == Backend::Vublk {
        let log = read_log(&backend_log);
        assert_eq!(
            backend_status.and_then(|s| s.code()),
            Some(0),
            "vublk did not exit 0 on SIGTERM: {backend_status:?}\n{}",
            tail(&log, 50)
        );
        // The guest flipped its write cache through the config space (WCE): vublk must
        // have seen both changes.
        for mode in ["writethrough", "writeback"] {
            assert!(
                log.contains(&format!("guest set write cache to {mode}")),
                "vublk never saw the guest switch to {mode}:\n{}",
                tail(&log, 50)
            );
        }
        // ... and acted on it: writes made durable while write-through, and FLUSHes sent
        // while write-back.
        let count = |what: &str| common::logged_count(&log, what);
        assert!(
            count("durable writes") > 0,
            "no durable writes under write-through:\n{}",
            tail(&log, 20)
        );
        assert!(
            count("flushes") > 0,
            "no flushes under write-back:\n{}",
            tail(&log, 20)
        );
        println!(
            "[vm] vublk: {} durable writes (write-through phase), {} flushes",
            count("durable writes"),
            count("flushes")
        );
    }

    // ---- host-side checks on the image the guest wrote
    // An NBD export: the file qemu-nbd served, once it is gone.
    if let Some(mut p) = nbd_server.take() {
        p.terminate(Duration::from_secs(10));
    }
    let image = if variant.nbd { file_image } else { image };
    // An RBD image: what the cluster has, exported.
    #[cfg(feature = "rbd")]
    let image = match &ceph {
        Some(ceph) => {
            let raw = run.path.join("exported.raw");
            ceph.rbd(&["export", "rbd/disk", raw.to_str().unwrap()]);
            println!(
                "[vm] rbd export: {} MiB",
                fs::metadata(&raw).unwrap().len() >> 20
            );
            raw
        }
        None => image,
    };
    // A qcow2 or parallels image: qemu-img check it, then compare through a raw conversion.
    let format = match image.extension().and_then(|e| e.to_str()) {
        Some("qcow2") => Some("qcow2"),
        Some("parallels") => Some("parallels"),
        _ => None,
    };
    // An encrypted qcow2 image: checked and decrypted by QEMU's qcow2 driver with its key.
    let image = if image.extension().is_some_and(|e| e == "eqcow2") {
        let secret = format!("secret,id=s0,file={}", run.path.join("pass").display());
        let opts = format!(
            "driver=qcow2,encrypt.key-secret=s0,file.filename={}",
            image.display()
        );
        let o = Command::new("qemu-img")
            .args(["check", "--object", &secret, "--image-opts", &opts])
            .output()
            .expect("qemu-img check");
        assert!(
            o.status.success(),
            "qemu-img check of the encrypted qcow2 image failed:\n{}",
            String::from_utf8_lossy(&o.stdout)
        );
        let raw = run.path.join("decrypted.raw");
        let st = Command::new("qemu-img")
            .args([
                "convert",
                "--object",
                &secret,
                "--image-opts",
                &opts,
                "-O",
                "raw",
            ])
            .arg(&raw)
            .status()
            .expect("qemu-img convert");
        assert!(
            st.success(),
            "QEMU could not decrypt the guest's qcow2 image"
        );
        println!("[vm] qemu-img check: clean; decrypted by QEMU's qcow2 driver");
        raw
    } else {
        image
    };
    // A LUKS image: decrypted by QEMU's own luks driver, then compared like raw.
    let image = if image.extension().is_some_and(|e| e == "luks") {
        let raw = run.path.join("decrypted.raw");
        vm::luks_to_raw(&image, &run.path.join("pass"), &raw);
        println!("[vm] decrypted by QEMU's luks driver");
        raw
    } else {
        image
    };
    let image = if let Some(format) = format {
        let o = Command::new("qemu-img")
            .args(["check", "-f", format])
            .arg(&image)
            .output()
            .expect("running qemu-img check");
        assert!(
            o.status.success(),
            "qemu-img check of the guest's {format} image failed:\n{}",
            String::from_utf8_lossy(&o.stdout)
        );
        println!("[vm] qemu-img check: clean");
        if backend == Backend::Vublk && variant.vublk_args.contains(&"--compress-writes") {
            // The guest's whole-cluster writes (mkfs, files) were stored compressed.
            let out = String::from_utf8_lossy(&o.stdout).into_owned();
            let pct: f64 = out
                .split("fragmented, ")
                .nth(1)
                .and_then(|r| r.split('%').next()?.trim().parse().ok())
                .unwrap_or_else(|| panic!("no compressed percentage in:\n{out}"));
            println!("[vm] compressed clusters: {pct}%");
            assert!(pct > 1.0, "no compressed clusters:\n{out}");
        }
        let raw = run.path.join("converted.raw");
        let st = Command::new("qemu-img")
            .args(["convert", "-f", format, "-O", "raw"])
            .arg(&image)
            .arg(&raw)
            .status()
            .expect("qemu-img convert");
        assert!(st.success());
        raw
    } else {
        image
    };
    let regions = check_regions(&marks, &image, &guest.pattern)
        .unwrap_or_else(|e| panic!("host check of raw regions failed: {e}"));
    assert_eq!(regions, 3, "expected 3 REGION markers from the guest");
    match find_program("e2fsck", "VUBLK_E2E_E2FSCK") {
        Ok(e2fsck) => {
            let (st, out, err) = vm::run_capture(&e2fsck, &[OsStr::new("-fn"), image.as_os_str()])
                .expect("running e2fsck");
            assert!(
                st.success(),
                "host e2fsck -fn of the image failed ({st}):\n{out}\n{err}"
            );
            println!("[vm] host e2fsck -fn: clean");
        }
        Err(e) => println!("[vm] note: no host e2fsck check: {e}"),
    }

    let boot = uptime_of(&marks, "BOOTED");
    let done = uptime_of(&marks, "PASS");
    let mkfs = marks
        .iter()
        .find_map(|m| m.strip_prefix("TIME mkfs "))
        .unwrap_or("?");
    println!(
        "[vm] summary: backend={backend_name} disk={} MiB guest-build={:.1}s backend-ready={:.2}s \
         guest-boot={}s mkfs={mkfs} guest-uptime-at-pass={}s qemu-wall={:.1}s total={:.1}s \
         backend-exit={}",
        disk_size >> 20,
        build_time.as_secs_f64(),
        backend_ready.as_secs_f64(),
        boot.map_or("?".into(), |v| format!("{v:.2}")),
        done.map_or("?".into(), |v| format!("{v:.2}")),
        qemu_time.as_secs_f64(),
        t_start.elapsed().as_secs_f64(),
        backend_status.map_or("?".into(), |s| s.to_string()),
    );
    if sock.parent() != Some(run.path.as_path()) {
        let _ = fs::remove_file(&sock);
    }
}

/// A qcow2 image with compressed clusters over a raw backing file: ext4 made on the host with
/// files and their checksums (mke2fs -d), converted to a compressed qcow2 whose second half is
/// a qcow2 overlay on a raw base. The guest fscks it and checks every file, read-only.
fn prepare_qcow2_chain(dir: &Path, size: u64) -> PathBuf {
    let files = dir.join("fs-content");
    fs::create_dir_all(&files).unwrap();
    let mut sums = String::new();
    for i in 0..24u64 {
        let name = format!("file-{i:02}");
        let mut data = vec![0u8; (64 << 10) * (i as usize + 1) + i as usize * 777];
        let mut x = 0x1234_5678u64.wrapping_add(i);
        for b in data.iter_mut() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            // Half compressible, half random, so compressed clusters hold real data.
            *b = if (x >> 40) % 2 == 0 {
                (x >> 3) as u8 & 0x0f
            } else {
                x as u8
            };
        }
        fs::write(files.join(&name), &data).unwrap();
        let out = Command::new("sha256sum")
            .arg(&name)
            .current_dir(&files)
            .output()
            .unwrap();
        sums.push_str(&String::from_utf8_lossy(&out.stdout));
    }
    fs::write(files.join("sums.txt"), sums).unwrap();
    let raw = dir.join("fs.raw");
    let st = Command::new("mkfs.ext4")
        .args(["-F", "-q", "-d"])
        .arg(&files)
        .arg(&raw)
        .arg(format!("{}k", size >> 10))
        .status()
        .unwrap();
    assert!(st.success(), "mkfs.ext4 -d failed");
    // base.raw: the filesystem; top.qcow2: a compressed qcow2 copy of it layered over the raw
    // base (unallocated clusters read from the base).
    let base = dir.join("base.raw");
    fs::copy(&raw, &base).unwrap();
    let full = dir.join("full.qcow2");
    let st = Command::new("qemu-img")
        .args([
            "convert",
            "-c",
            "-f",
            "raw",
            "-O",
            "qcow2",
            "-o",
            "compression_type=zstd",
        ])
        .arg(&raw)
        .arg(&full)
        .status()
        .unwrap();
    assert!(st.success());
    // The overlay: compressed qcow2 data for the first half, the base for the rest.
    let top = dir.join("top.qcow2");
    let st = Command::new("qemu-img")
        .current_dir(dir)
        .args([
            "create",
            "-q",
            "-f",
            "qcow2",
            "-F",
            "raw",
            "-b",
            "base.raw",
            "top.qcow2",
        ])
        .status()
        .unwrap();
    assert!(st.success());
    let half = size / 2;
    // Copy the first half of the filesystem into the overlay as compressed clusters:
    // `convert -n` writes into the existing overlay; the second half reads from the base.
    let st = Command::new("qemu-img")
        .args(["convert", "-n", "-c", "-O", "qcow2", "--image-opts"])
        .arg(format!(
            "driver=raw,offset=0,size={half},file.driver=qcow2,file.file.filename={}",
            full.display()
        ))
        .arg(&top)
        .status()
        .unwrap();
    assert!(st.success(), "qemu-img convert -n into the overlay failed");
    let st = Command::new("qemu-img")
        .args(["compare", "-f", "raw", "-F", "qcow2"])
        .arg(&raw)
        .arg(&top)
        .status()
        .unwrap();
    assert!(
        st.success(),
        "the overlay chain differs from the filesystem image"
    );
    top
}

/// A read-only qcow2 (compressed clusters over a raw backing file) in a Linux guest.
#[test]
fn guest_reads_a_compressed_qcow2_over_a_raw_backing_file() {
    run_guest(&Variant {
        name: "qcow2-ro",
        vublk_args: &["--read-only"],
        serial: None,
        logical_block: 512,
        mode: Some("ro-verify"),
        device_props: "",
        prepare: Some(prepare_qcow2_chain),
        rbd: false,
        nbd: false,
    });
}

fn prepare_qcow2_fresh(dir: &Path, size: u64) -> PathBuf {
    let img = dir.join("disk.qcow2");
    let st = Command::new(env!("CARGO_BIN_EXE_vublk"))
        .args(["create", "--format", "qcow2", "--size"])
        .arg(size.to_string())
        .arg(&img)
        .status()
        .unwrap();
    assert!(st.success(), "vublk create failed");
    img
}

/// The full guest workload (mkfs, files, fsck, write cache, trim, raw regions) on a fresh
/// qcow2 image, then `qemu-img check` and the host-side comparisons on its raw conversion.
/// QEMU offers the guest VIRTIO_F_IN_ORDER here (`in_order=on`, which vublk offers): a
/// guest kernel without in-order support (virtio_ring gained it in 2026; Debian 12's 6.12
/// lacks it) declines it and the run shows the offer changes nothing; one that takes it
/// runs the workload in order (vublk logs "VIRTIO_F_IN_ORDER negotiated").
/// tests/in_order.rs proves the order itself.
#[test]
fn guest_mkfs_and_files_on_a_fresh_qcow2() {
    run_guest(&Variant {
        name: "qcow2-rw",
        vublk_args: &["--format", "qcow2"],
        serial: None,
        logical_block: 512,
        mode: None,
        device_props: ",in_order=on",
        prepare: Some(prepare_qcow2_fresh),
        rbd: false,
        nbd: false,
    });
}

/// The same workload with `--compress-writes on` (the backup-target configuration): whole
/// clusters the guest writes are stored compressed through the cache and the thread pool;
/// the image must pass `qemu-img check` and read back identically.
#[test]
fn guest_mkfs_and_files_on_a_compressing_qcow2() {
    run_guest(&Variant {
        name: "qcow2-compress",
        vublk_args: &["--format", "qcow2", "--compress-writes", "on"],
        serial: None,
        logical_block: 512,
        mode: None,
        device_props: "",
        prepare: Some(prepare_qcow2_fresh),
        rbd: false,
        nbd: false,
    });
}

/// The full guest workload on a Ceph RBD image (a throwaway single-node cluster) with
/// librbd's write-back cache (the guest's write-cache switches then exercise both FLUSH and
/// write-through writes), checked on the host through `rbd export`.
#[cfg(feature = "rbd")]
#[test]
fn guest_mkfs_and_files_on_an_rbd_image() {
    run_guest(&Variant {
        name: "rbd",
        vublk_args: &["--cache", "writeback", "--discard", "unmap"],
        serial: None,
        logical_block: 512,
        mode: None,
        device_props: "",
        prepare: None,
        rbd: true,
        nbd: false,
    });
}

/// The full guest workload on an NBD export (qemu-nbd serving a raw file on a UNIX socket,
/// a connection per queue), checked on the file afterwards.
#[test]
fn guest_mkfs_and_files_on_an_nbd_export() {
    run_guest(&Variant {
        name: "nbd",
        vublk_args: &["--discard", "unmap"],
        serial: None,
        logical_block: 512,
        mode: None,
        device_props: "",
        prepare: None,
        rbd: false,
        nbd: true,
    });
}

/// A LUKS1 volume `vublk create --encrypt luks1` makes, its passphrase in `pass`.
fn prepare_luks(dir: &Path, size: u64) -> PathBuf {
    let img = dir.join("disk.luks");
    fs::write(dir.join("pass"), "guest disk passphrase").unwrap();
    let st = Command::new(env!("CARGO_BIN_EXE_vublk"))
        .current_dir(dir)
        .args(["create", "--format", "raw", "--encrypt", "luks1"])
        .args([
            "--key-secret",
            "file:pass",
            "--kdf-iterations",
            "1000",
            "--size",
        ])
        .arg(size.to_string())
        .arg(&img)
        .status()
        .unwrap();
    assert!(st.success(), "vublk create --encrypt failed");
    img
}

/// The full guest workload on an encrypted disk (a LUKS1 volume vublk made, served with its
/// passphrase), checked on the host through QEMU's luks driver: the raw regions and a
/// host e2fsck on what QEMU decrypts.
#[test]
fn guest_mkfs_and_files_on_a_luks_volume() {
    run_guest(&Variant {
        name: "luks",
        vublk_args: &["--key-secret", "file:pass"],
        serial: None,
        logical_block: 512,
        mode: None,
        device_props: "",
        prepare: Some(prepare_luks),
        rbd: false,
        nbd: false,
    });
}

/// A qcow2 image QEMU encrypted (`encrypt.format=luks`), its passphrase in `pass` (named
/// `.eqcow2` so that the host checks know to give QEMU the key).
fn prepare_encrypted_qcow2(dir: &Path, size: u64) -> PathBuf {
    let img = dir.join("disk.eqcow2");
    fs::write(dir.join("pass"), "guest disk passphrase").unwrap();
    let st = Command::new("qemu-img")
        .current_dir(dir)
        .args([
            "create",
            "-q",
            "--object",
            "secret,id=s0,file=pass",
            "-f",
            "qcow2",
        ])
        .args([
            "-o",
            "encrypt.format=luks,encrypt.key-secret=s0,encrypt.iter-time=10",
        ])
        .arg(&img)
        .arg(size.to_string())
        .status()
        .unwrap();
    assert!(st.success(), "qemu-img create (encrypted qcow2) failed");
    img
}

/// The full guest workload on a qcow2 image QEMU encrypted, served with its passphrase;
/// `qemu-img check` and the host comparisons on what QEMU's qcow2 driver decrypts.
#[test]
fn guest_mkfs_and_files_on_an_encrypted_qcow2() {
    run_guest(&Variant {
        name: "qcow2-luks",
        vublk_args: &["--key-secret", "file:pass"],
        serial: None,
        logical_block: 512,
        mode: None,
        device_props: "",
        prepare: Some(prepare_encrypted_qcow2),
        rbd: false,
        nbd: false,
    });
}

fn prepare_parallels_fresh(dir: &Path, size: u64) -> PathBuf {
    let img = dir.join("disk.parallels");
    let st = Command::new(env!("CARGO_BIN_EXE_vublk"))
        .args([
            "create",
            "--format",
            "parallels",
            "--cluster-size",
            "64K",
            "--size",
        ])
        .arg(size.to_string())
        .arg(&img)
        .status()
        .unwrap();
    assert!(st.success(), "vublk create --format parallels failed");
    img
}

/// The full guest workload on a fresh parallels image (64 KiB clusters, preallocated in
/// 16 MiB steps, discards freeing clusters), then `qemu-img check` and the host-side
/// comparisons on its raw conversion.
#[test]
fn guest_mkfs_and_files_on_a_fresh_parallels_image() {
    run_guest(&Variant {
        name: "parallels-rw",
        vublk_args: &[
            "--format",
            "parallels",
            "--prealloc-size",
            "16M",
            "--discard",
            "unmap",
        ],
        serial: None,
        logical_block: 512,
        mode: None,
        device_props: "",
        prepare: Some(prepare_parallels_fresh),
        rbd: false,
        nbd: false,
    });
}
