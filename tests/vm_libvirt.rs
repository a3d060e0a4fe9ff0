//! libvirt for real: a domain of type `qemu` (TCG) whose disk is `<disk type='vhostuser'>` on
//! vublk's socket with `<reconnect>`, memfd shared memory and two queues
//! (`contrib/libvirt/vublk-domain.xml`), defined and started with `virsh`; the guest runs the
//! end-to-end workload (mkfs, files, fsck, checksums; `contrib/guest/e2e-workload.sh`) while
//! the test kills vublk twice (SIGKILL after mkfs, SIGTERM while files are written) and starts
//! it again at once: QEMU, configured by libvirt, reconnects and the guest goes on. Then the
//! domain is destroyed and undefined, vublk stops cleanly, and the image's file system is
//! clean on the host (`e2fsck -fn`).
//!
//! Needs libvirt (`libvirt-daemon-system`, `libvirt-clients`), root, QEMU and the guest
//! kernel. Where no libvirtd answers on `qemu:///system`, the test starts one (with virtlogd)
//! and stops both by PID at the end. `VUBLK_E2E_REQUIRE=1` fails instead of skipping.

mod common;
mod vm;

use std::fs::{self, File};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use vm::{markers, read_log, skip, wait_listening, ChildGuard, ScratchDir, MARK};

const QUEUES: u32 = 2;
const URI: &str = "qemu:///system";

fn virsh(args: &[&str]) -> std::process::Output {
    Command::new("virsh")
        .arg("-c")
        .arg(URI)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("running virsh")
}

fn virsh_ok(args: &[&str]) -> String {
    let out = virsh(args);
    assert!(
        out.status.success(),
        "virsh {args:?} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A libvirtd (and the virtlogd it logs QEMU's output through) the test started because
/// none answered; stopped by PID when dropped. Empty when the machine's own daemon runs.
struct Daemons(Vec<ChildGuard>);

fn libvirt_daemons(run: &Path) -> Result<Daemons, String> {
    if virsh(&["version"]).status.success() {
        return Ok(Daemons(Vec::new()));
    }
    let mut started = Vec::new();
    for name in ["virtlogd", "libvirtd"] {
        let bin = vm::find_program(name, "VUBLK_E2E_NONE").map_err(|e| e.to_string())?;
        let log = File::create(run.join(format!("{name}.log"))).unwrap();
        let mut cmd = Command::new(bin);
        cmd.stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log);
        started.push(ChildGuard::spawn(name, &mut cmd).map_err(|e| format!("{name}: {e}"))?);
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while !virsh(&["version"]).status.success() {
        if Instant::now() > deadline {
            return Err(format!(
                "libvirtd started but does not answer on {URI}:\n{}",
                read_log(&run.join("libvirtd.log"))
            ));
        }
        thread::sleep(Duration::from_millis(100));
    }
    Ok(Daemons(started))
}

impl Drop for Daemons {
    fn drop(&mut self) {
        // libvirtd first (it holds virtlogd's socket).
        for d in self.0.iter_mut().rev() {
            d.terminate(Duration::from_secs(10));
        }
    }
}

/// The domain XML from `contrib/libvirt/vublk-domain.xml` with its @NAMES@ filled in.
fn domain_xml(fill: &[(&str, String)]) -> String {
    let mut xml = fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("contrib/libvirt/vublk-domain.xml"),
    )
    .unwrap();
    for (k, v) in fill {
        xml = xml.replace(&format!("@{k}@"), v);
    }
    // Every @NAME@ is filled.
    let parts: Vec<&str> = xml.split('@').collect();
    let unfilled = parts[1..parts.len().saturating_sub(1)]
        .iter()
        .find(|w| !w.is_empty() && w.chars().all(|c| c.is_ascii_uppercase() || c == '_'));
    assert!(
        unfilled.is_none(),
        "unfilled @{unfilled:?}@ in the domain XML:\n{xml}"
    );
    xml
}

/// The domain, destroyed (if still running) and undefined when dropped.
struct Domain(String);

impl Drop for Domain {
    fn drop(&mut self) {
        let _ = virsh(&["destroy", &self.0]);
        let _ = virsh(&["undefine", &self.0]);
    }
}

fn domstate(name: &str) -> String {
    virsh_ok(&["domstate", name]).trim().to_owned()
}

#[test]
fn a_libvirt_domain_on_vublk_survives_vublk_restarts() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return skip("libvirt's system daemon needs root");
    }
    if let Err(e) = vm::find_program("virsh", "VUBLK_E2E_VIRSH") {
        return skip(&format!("{e} (libvirt-clients)"));
    }
    if let Err(e) = vm::find_program("libvirtd", "VUBLK_E2E_LIBVIRTD") {
        return skip(&format!("{e} (libvirt-daemon-system)"));
    }
    let Some((qemu, guest)) = vm::guest_prerequisites(&["e2fsck"]) else {
        return;
    };
    let tmp = Path::new(env!("CARGO_TARGET_TMPDIR"));
    let mut run = ScratchDir::new(tmp, &format!("vm-libvirt-{}", std::process::id()))
        .expect("creating the run directory");
    run.keep = std::env::var("VUBLK_E2E_KEEP").is_ok_and(|v| v == "1");
    let daemons = match libvirt_daemons(&run.path) {
        Ok(d) => d,
        Err(e) => return skip(&e),
    };

    let image = run.path.join("disk.img");
    File::create(&image)
        .and_then(|f| f.set_len(1 << 30))
        .expect("creating the image");
    let sock = std::env::temp_dir().join(format!("vublk-libvirt-{}.sock", std::process::id()));
    let _ = fs::remove_file(&sock);
    let serial_log = run.path.join("serial.log");
    let mut n = 0;
    let start_vublk = |n: &mut usize| -> (ChildGuard, PathBuf) {
        *n += 1;
        let log = run.path.join(format!("vublk-{n}.log"));
        let mut p = vm::spawn_vublk(&format!("vublk-{n}"), &log, &sock, &image, QUEUES, &[]);
        wait_listening(&mut p, &log);
        (p, log)
    };
    let (mut vublk, mut vublk_log) = start_vublk(&mut n);

    let name = format!("vublk-test-{}", std::process::id());
    let xml = domain_xml(&[
        ("DOMAIN_TYPE", "qemu".into()),
        ("NAME", name.clone()),
        ("MEMORY_MIB", "1024".into()),
        ("KERNEL", guest.kernel.display().to_string()),
        ("INITRD", guest.initrd.display().to_string()),
        (
            "CMDLINE",
            format!(
                "console=ttyS0 panic=-1 loglevel=4 E2E_QUEUES={QUEUES} E2E_FILL=0 E2E_LBS=512 \
                 E2E_HOLD=1"
            ),
        ),
        ("EMULATOR", qemu.display().to_string()),
        ("QUEUES", QUEUES.to_string()),
        ("SOCKET", sock.display().to_string()),
        ("SERIAL_LOG", serial_log.display().to_string()),
    ]);
    let xml_path = run.path.join("domain.xml");
    fs::write(&xml_path, &xml).unwrap();
    virsh_ok(&["define", &xml_path.display().to_string()]);
    let domain = Domain(name.clone());
    virsh_ok(&["start", &name]);
    let qemu_log = PathBuf::from(format!("/var/log/libvirt/qemu/{name}.log"));
    let dump = |why: &str, vublk_log: &Path| -> String {
        format!(
            "{why}\n--- serial:\n{}\n--- QEMU (libvirt's log):\n{}\n--- vublk:\n{}",
            read_log(&serial_log),
            read_log(&qemu_log),
            read_log(vublk_log)
        )
    };

    // Restarts at three points of the workload (a phase's TIME line ends it; the next one
    // runs while the test reacts): SIGKILL while files are written, SIGTERM while they are
    // read back, SIGKILL while fstrim discards.
    let mut restarts: Vec<(&str, libc::c_int)> = vec![
        ("TIME write-cache", libc::SIGKILL),
        ("TIME fsck-after-write", libc::SIGTERM),
        ("TIME fsck-fresh", libc::SIGKILL),
    ];
    let deadline = Instant::now() + Duration::from_secs(900);
    let mut done = false;
    while !done {
        let lines: Vec<String> = read_log(&serial_log).lines().map(str::to_owned).collect();
        let marks = markers(&lines);
        if let Some(f) = marks.iter().find(|m| m.starts_with("FAIL")) {
            panic!("{}", dump(&format!("the guest reported {f}"), &vublk_log));
        }
        if let Some(&(at, sig)) = restarts.last() {
            if marks.iter().any(|m| m.starts_with(at)) {
                println!("[libvirt] {at}: vublk gets signal {sig} and starts again");
                // SAFETY: a plain kill(2) of our child.
                unsafe { libc::kill(vublk.id() as i32, sig) };
                let st = vublk.wait_until(Instant::now() + Duration::from_secs(30));
                assert!(
                    matches!(st, Ok(Some(_))),
                    "{}",
                    dump("vublk did not exit on the signal", &vublk_log)
                );
                if sig == libc::SIGTERM {
                    assert!(
                        st.as_ref().unwrap().unwrap().success(),
                        "{}",
                        dump("vublk did not exit 0 on SIGTERM", &vublk_log)
                    );
                }
                (vublk, vublk_log) = start_vublk(&mut n);
                restarts.pop();
            }
        }
        if marks.iter().any(|m| m.starts_with("PASS")) {
            done = true;
        }
        assert!(
            domstate(&name) == "running" || done,
            "{}",
            dump("the domain stopped before the guest passed", &vublk_log)
        );
        assert!(
            Instant::now() < deadline,
            "{}",
            dump("the guest did not finish in 900 s", &vublk_log)
        );
        thread::sleep(Duration::from_millis(20));
    }
    assert!(
        restarts.is_empty(),
        "{}",
        dump("not every restart happened", &vublk_log)
    );
    for l in read_log(&serial_log).lines().filter(|l| l.contains(MARK)) {
        println!("[guest] {l}");
    }
    // The guest holds (E2E_HOLD=1) once it passed: destroy the running domain.
    assert_eq!(domstate(&name), "running");
    virsh_ok(&["destroy", &name]);
    assert_eq!(domstate(&name), "shut off");
    // What libvirt made of the disk element.
    let cmdline = read_log(&qemu_log);
    let disk: Vec<&str> = cmdline
        .lines()
        .filter(|l| l.contains("vu-virtio-disk0"))
        .collect();
    println!("[libvirt] QEMU's disk options:\n{}", disk.join("\n"));
    assert!(
        disk.iter().any(|l| l.contains("reconnect"))
            && disk.iter().any(|l| l.contains("\"num-queues\":2")),
        "libvirt's QEMU command line:\n{cmdline}"
    );
    virsh_ok(&["undefine", &name]);
    assert!(!virsh_ok(&["list", "--all", "--name"])
        .lines()
        .any(|l| l.trim() == name));
    drop(domain);
    // QEMU connected to every vublk: the restarted ones served the guest.
    for i in 1..=n {
        let log = read_log(&run.path.join(format!("vublk-{i}.log")));
        assert!(
            log.contains("frontend connected"),
            "QEMU did not connect to vublk {i}:\n{log}"
        );
    }
    let log = read_log(&vublk_log);
    let st = vublk.terminate(Duration::from_secs(30));
    assert_eq!(st.and_then(|s| s.code()), Some(0), "vublk's exit:\n{log}");
    let fsck = Command::new("e2fsck")
        .args(["-fn"])
        .arg(&image)
        .output()
        .expect("running e2fsck");
    assert!(
        fsck.status.success(),
        "e2fsck -fn on the host: {}{}",
        String::from_utf8_lossy(&fsck.stdout),
        String::from_utf8_lossy(&fsck.stderr)
    );
    let _ = fs::remove_file(&sock);
    drop(daemons);
}
