//! Running under a service manager: systemd's readiness and status notification
//! (`Type=notify`), socket activation (`LISTEN_FDS`), `--pidfile`, and the limit of open
//! files. Each is a no-op where the environment does not ask for it, so the same binary runs
//! by hand, under systemd, or under another supervisor.

use std::fs::File;
use std::io::{self, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use log::{info, warn};
use sd_notify::NotifyState;

use crate::locks::Locked;

/// Raise the soft limit of open files to the hard limit, as systemd advises for programs that
/// do not use select(2) (vublk does not): the soft limit (1024 under systemd and in most
/// shells) is a compatibility default, and the descriptors a frontend's set-up needs (memory
/// regions, eventfds) should not run out long before the administrator's limit. Logged when
/// raised; a failure only costs the higher limit.
pub fn raise_fd_limit() {
    let mut l = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit fills the rlimit struct it is given.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut l) } != 0 {
        return;
    }
    // An unlimited hard limit still cannot exceed the kernel's per-process maximum.
    let target = if l.rlim_max == libc::RLIM_INFINITY {
        std::fs::read_to_string("/proc/sys/fs/nr_open")
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(1 << 20)
    } else {
        l.rlim_max
    };
    if l.rlim_cur >= target {
        return;
    }
    let old = l.rlim_cur;
    l.rlim_cur = target;
    // SAFETY: setrlimit reads the rlimit struct it is given.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &l) } == 0 {
        info!("limit of open files raised from {old} to {target} (the hard limit)");
    } else {
        warn!(
            "limit of open files stays {old}: raising it to {target} failed ({})",
            io::Error::last_os_error()
        );
    }
}

/// The listening socket systemd passed (`LISTEN_PID` is this process, `LISTEN_FDS`=1): its
/// descriptor, or None when the process was not socket-activated. Read once: the variables
/// are removed so that children do not inherit them.
pub fn activation_socket() -> Result<Option<RawFd>, String> {
    let fds: Vec<RawFd> = sd_notify::listen_fds()
        .map_err(|e| format!("socket activation (LISTEN_FDS): {e}"))?
        .collect();
    match fds[..] {
        [] => Ok(None),
        [fd] => Ok(Some(fd)),
        _ => Err(format!(
            "socket activation passed {} sockets; vublk serves one (one unit per image)",
            fds.len()
        )),
    }
}

/// Tell the service manager something, if one listens (`NOTIFY_SOCKET`); a failure is
/// logged once per kind and otherwise ignored (serving matters more than the status line).
fn notify(states: &[NotifyState]) {
    if std::env::var_os("NOTIFY_SOCKET").is_none() {
        return;
    }
    if let Err(e) = sd_notify::notify(false, states) {
        crate::log_limited!(log::Level::Warn, "service manager notification failed: {e}");
    }
}

/// Listening: `READY=1` and the status.
pub fn ready(status: &str) {
    STATUS.locked().0 = status.to_owned();
    notify(&[NotifyState::Ready, NotifyState::Status(status)]);
}

/// The last status line given, and what the error policy holds (shown before it).
static STATUS: std::sync::Mutex<(String, Option<String>)> =
    std::sync::Mutex::new((String::new(), None));

/// The status line with the held requests first, if any.
fn status_line(s: &(String, Option<String>)) -> String {
    match &s.1 {
        Some(h) => format!("{h}; {}", s.0),
        None => s.0.clone(),
    }
}

/// A new status line (`systemctl status` shows it).
pub fn status(status: &str) {
    let line = {
        let mut s = STATUS.locked();
        s.0 = status.to_owned();
        status_line(&s)
    };
    notify(&[NotifyState::Status(&line)]);
}

/// The error policy holds requests (what, for the status line) or no longer (None).
pub fn holding(what: Option<&str>) {
    let line = {
        let mut s = STATUS.locked();
        s.1 = what.map(str::to_owned);
        status_line(&s)
    };
    notify(&[NotifyState::Status(&line)]);
}

/// Shutting down: `STOPPING=1`.
pub fn stopping(status: &str) {
    notify(&[NotifyState::Stopping, NotifyState::Status(status)]);
}

/// `--pidfile`: the file holds this process's id and a write lock on it (an OFD lock, held
/// as long as the file stays open) for as long as the daemon runs, as qemu-storage-daemon's
/// does; a second daemon with the same pidfile fails to start while the first lives. A file
/// left behind by a process that died is taken over (nobody holds its lock). Removed on a
/// clean exit.
#[derive(Debug)]
pub struct PidFile {
    path: PathBuf,
    file: File,
}

impl PidFile {
    pub fn create(path: &Path) -> io::Result<PidFile> {
        use std::os::unix::fs::OpenOptionsExt;
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o644)
            .custom_flags(libc::O_CLOEXEC | libc::O_NOFOLLOW)
            .open(path)?;
        if let Err(e) = crate::image::lock::try_lock_whole_file(file.as_raw_fd()) {
            return Err(match e.raw_os_error() {
                Some(libc::EAGAIN) | Some(libc::EACCES) => io::Error::new(
                    io::ErrorKind::WouldBlock,
                    "locked by another process (is another vublk using it?)",
                ),
                _ => e,
            });
        }
        // Another process may have removed and recreated the file between the open and the
        // lock: the lock must be on the file the path names now.
        let (ours, named) = (file.metadata()?, std::fs::metadata(path)?);
        if ours.dev() != named.dev() || ours.ino() != named.ino() {
            return Err(io::Error::new(
                io::ErrorKind::WouldBlock,
                "replaced while being locked (is another vublk starting?)",
            ));
        }
        file.set_len(0)?;
        (&file).write_all(format!("{}\n", std::process::id()).as_bytes())?;
        Ok(PidFile {
            path: path.to_owned(),
            file,
        })
    }
}

impl Drop for PidFile {
    /// Remove the file if the path still names it (the lock goes with the descriptor).
    fn drop(&mut self) {
        let same = match (self.file.metadata(), std::fs::metadata(&self.path)) {
            (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
            _ => false,
        };
        if same {
            if let Err(e) = std::fs::remove_file(&self.path) {
                warn!("removing pidfile {}: {e}", self.path.display());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pidfile_holds_the_pid_is_exclusive_and_goes_away() {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/unit-tmp");
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join(format!("pidfile-{}", std::process::id()));
        // A stale file (nobody holds its lock) is taken over.
        std::fs::write(&p, "999999\n").unwrap();
        let pf = PidFile::create(&p).unwrap();
        assert_eq!(
            std::fs::read_to_string(&p).unwrap(),
            format!("{}\n", std::process::id())
        );
        // A second holder (another open file description) is refused.
        let e = PidFile::create(&p).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::WouldBlock, "{e}");
        drop(pf);
        assert!(!p.exists());
    }
}
