//! Running vublk the way a service manager does: systemd's socket activation (through
//! `systemd-socket-activate`, no running systemd needed), readiness and status notification
//! (a notify socket the test listens on), `--pidfile`, and `--log-format json`.

mod common;

use std::os::unix::net::UnixDatagram;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

/// A process started here, killed (by its PID) and reaped on drop.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Proc {
    fn pid(&self) -> i32 {
        self.0.id() as i32
    }

    fn sigterm_and_wait(&mut self) -> std::process::ExitStatus {
        // SAFETY: kill(2) on our own child, not yet reaped.
        unsafe { libc::kill(self.pid(), libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(s) = self.0.try_wait().unwrap() {
                return s;
            }
            assert!(
                Instant::now() < deadline,
                "vublk did not exit after SIGTERM"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

fn vublk() -> Command {
    Command::new(env!("CARGO_BIN_EXE_vublk"))
}

/// vublk serving `img` on `sock`.
fn serve(sock: &Path, img: &Path) -> Command {
    let mut c = vublk();
    c.arg("--socket-path").arg(sock).arg("--blk-file").arg(img);
    c
}

fn wait_for(path: &Path) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !path.exists() {
        assert!(
            Instant::now() < deadline,
            "{} never appeared",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The notifications received within `timeout` until one contains `want`.
fn recv_until(sock: &UnixDatagram, want: &str, timeout: Duration) -> Vec<String> {
    let deadline = Instant::now() + timeout;
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while Instant::now() < deadline {
        sock.set_read_timeout(Some(Duration::from_millis(100)))
            .unwrap();
        if let Ok(n) = sock.recv(&mut buf) {
            let m = String::from_utf8_lossy(&buf[..n]).into_owned();
            let done = m.contains(want);
            got.push(m);
            if done {
                return got;
            }
        }
    }
    panic!("no notification with {want:?} within {timeout:?}; got {got:?}");
}

#[test]
fn socket_activation_serves_the_passed_socket() {
    let activate = "systemd-socket-activate";
    if Command::new(activate).arg("--version").output().is_err() {
        return skip_or_fail("systemd-socket-activate is not installed (apt-get install systemd)")
            .unwrap_or(());
    }
    let dir = TestDir::new("svc-activate");
    let img = dir.join("disk.img");
    create_pattern_image(&img, 16 * MIB, 7);
    let sock = dir.join("activated.sock");
    let log = std::fs::File::create(dir.join("vublk.log")).unwrap();
    // No --socket-path or --fd: the listening socket comes as fd 3 (LISTEN_FDS=1), and
    // systemd-socket-activate becomes vublk (same PID) on the first connection.
    let _p = Proc(
        Command::new(activate)
            .arg("-l")
            .arg(&sock)
            .arg(env!("CARGO_BIN_EXE_vublk"))
            .arg("--blk-file")
            .arg(&img)
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap(),
    );
    wait_for(&sock);
    let mut c = connect_queues(&sock, 1);
    assert_eq!(c.capacity(), 16 * MIB);
    let got = c.read_at(0, 4096, 4096).unwrap();
    assert_same(
        &got,
        &pattern(4096, 4096, 7),
        "read through the activated socket",
    );
    let data = vec![0x5a; 4096];
    assert_eq!(c.write_at(0, 8192, &data), 0);
    assert_same(&c.read_at(0, 8192, 4096).unwrap(), &data, "write then read");
    let log = std::fs::read_to_string(dir.join("vublk.log")).unwrap();
    assert!(log.contains("listening on inherited fd 3"), "{log}");
}

#[test]
fn readiness_status_and_stopping_reach_the_notify_socket() {
    let dir = TestDir::new("svc-notify");
    let img = dir.join("disk.img");
    create_sparse_image(&img, 16 * MIB);
    let notify = dir.join("notify.sock");
    let listener = UnixDatagram::bind(&notify).unwrap();
    let sock = dir.join("vublk.sock");
    let mut p = Proc(
        serve(&sock, &img)
            .env("NOTIFY_SOCKET", &notify)
            .stdin(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let got = recv_until(&listener, "READY=1", Duration::from_secs(10));
    let ready = got.last().unwrap();
    assert!(ready.contains("STATUS=waiting for a frontend"), "{ready}");
    // READY comes once the socket listens: a client connects at once.
    let c = connect_queues(&sock, 1);
    let got = recv_until(
        &listener,
        "STATUS=frontend connected",
        Duration::from_secs(10),
    );
    assert!(got.last().unwrap().contains("disk.img"), "{got:?}");
    drop(c);
    recv_until(
        &listener,
        "STATUS=waiting for a frontend",
        Duration::from_secs(10),
    );
    // SAFETY: kill(2) on our own child, not yet reaped.
    unsafe { libc::kill(p.pid(), libc::SIGTERM) };
    let got = recv_until(&listener, "STOPPING=1", Duration::from_secs(10));
    assert!(got.last().unwrap().contains("SIGTERM"), "{got:?}");
    assert!(p.sigterm_and_wait().success());
}

#[test]
fn pidfile_is_written_locked_and_removed() {
    let dir = TestDir::new("svc-pidfile");
    let img = dir.join("disk.img");
    create_sparse_image(&img, 16 * MIB);
    let pidfile = dir.join("vublk.pid");
    let start = |sock: &str, img: &Path| {
        serve(&dir.join(sock), img)
            .arg("--pidfile")
            .arg(&pidfile)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let mut first = Proc(start("a.sock", &img));
    wait_for(&dir.join("a.sock"));
    let text = std::fs::read_to_string(&pidfile).unwrap();
    assert_eq!(text, format!("{}\n", first.pid()));
    // A second daemon (another image, another socket) with the same pidfile refuses to start
    // and leaves the file as it was.
    let img2 = dir.join("other.img");
    create_sparse_image(&img2, 16 * MIB);
    let second = start("b.sock", &img2).wait_with_output().unwrap();
    assert!(!second.status.success());
    let err = String::from_utf8_lossy(&second.stderr);
    assert!(err.contains("pidfile") && err.contains("locked"), "{err}");
    assert_eq!(std::fs::read_to_string(&pidfile).unwrap(), text);
    assert!(first.sigterm_and_wait().success());
    assert!(!pidfile.exists(), "pidfile left behind after a clean exit");
}

#[test]
fn json_logs_are_one_object_per_line() {
    let dir = TestDir::new("svc-json");
    let img = dir.join("disk.img");
    create_sparse_image(&img, 16 * MIB);
    let sock = dir.join("vublk.sock");
    let log = dir.join("vublk.log");
    let mut p = Proc(
        serve(&sock, &img)
            .args(["--log-format", "json", "--log-level", "debug"])
            .stdin(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap(),
    );
    let mut c = connect_queues(&sock, 1);
    assert_eq!(c.write_at(0, 0, &[1u8; 4096]), 0);
    drop(c);
    assert!(p.sigterm_and_wait().success());
    let text = std::fs::read_to_string(&log).unwrap();
    let mut messages = Vec::new();
    for line in text.lines() {
        let v: serde_json::Value = serde_json::from_str(line)
            .unwrap_or_else(|e| panic!("not a JSON object: {line:?}: {e}"));
        for k in ["timestamp", "level", "target", "message"] {
            assert!(v[k].is_string(), "{k} missing in {line}");
        }
        messages.push(v["message"].as_str().unwrap().to_owned());
    }
    assert!(
        messages.iter().any(|m| m.starts_with("listening on")),
        "{text}"
    );
    assert!(messages.iter().any(|m| m == "frontend connected"), "{text}");
}

/// Started with a soft limit of 256 open files (the hard limit as it is), vublk raises the
/// soft limit to the hard one and says so.
#[test]
fn the_soft_limit_of_open_files_is_raised_to_the_hard_one() {
    use std::os::unix::process::CommandExt;
    let dir = TestDir::new("svc-nofile");
    let img = dir.join("disk.img");
    create_sparse_image(&img, 16 * MIB);
    let sock = dir.join("vublk.sock");
    let log = dir.join("vublk.log");
    let mut cmd = serve(&sock, &img);
    // SAFETY: the hook only calls getrlimit/setrlimit (async-signal-safe) between fork and
    // exec.
    unsafe {
        cmd.pre_exec(|| {
            let mut l = libc::rlimit {
                rlim_cur: 0,
                rlim_max: 0,
            };
            if libc::getrlimit(libc::RLIMIT_NOFILE, &mut l) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            l.rlim_cur = 256;
            if libc::setrlimit(libc::RLIMIT_NOFILE, &l) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut p = Proc(
        cmd.stdin(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap(),
    );
    wait_for(&sock);
    let limits = std::fs::read_to_string(format!("/proc/{}/limits", p.pid())).unwrap();
    let nofile: Vec<&str> = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .unwrap()
        .split_whitespace()
        .collect();
    let (soft, hard) = (nofile[3], nofile[4]);
    assert_eq!(soft, hard, "{limits}");
    assert!(p.sigterm_and_wait().success());
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(
        text.contains(&format!("limit of open files raised from 256 to {hard}")),
        "{text}"
    );
}
