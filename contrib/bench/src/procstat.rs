//! What the kernel says about a process: its resident memory and CPU time (/proc), the
//! client's own CPU time (getrusage), its write system calls (/proc/PID/io) and, through
//! `perf stat`, its positioned writes. Every reader returns None where the number is not
//! available, so that a missing counter leaves a cell empty rather than ending the run.

use std::fs;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// Resident set size from /proc/PID/status.
pub fn rss_kib(pid: i32) -> Option<u64> {
    let s = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    s.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// user + system CPU time of a process, in nanoseconds (from /proc/PID/stat).
pub fn cpu_ns(pid: i32) -> Option<u64> {
    let s = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the parenthesised command name; utime and stime are fields 14 and 15.
    let rest = &s[s.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let utime: u64 = f.get(11)?.parse().ok()?;
    let stime: u64 = f.get(12)?.parse().ok()?;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    Some((utime + stime) * 1_000_000_000 / hz)
}

/// This process's own CPU time (the client), in nanoseconds.
pub fn self_cpu_ns() -> u64 {
    // SAFETY: getrusage writes into the struct we pass.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: valid pointer.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let tv = |t: libc::timeval| t.tv_sec as u64 * 1_000_000_000 + t.tv_usec as u64 * 1000;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// write system calls and bytes of a process so far (/proc/PID/io: syscw, wchar).
pub fn proc_writes(pid: i32) -> Option<(u64, u64)> {
    let s = fs::read_to_string(format!("/proc/{pid}/io")).ok()?;
    let field = |k: &str| -> Option<u64> {
        s.lines()
            .find_map(|l| l.strip_prefix(k))?
            .trim()
            .parse()
            .ok()
    };
    Some((field("syscw:")?, field("wchar:")?))
}

/// Count a process's positioned writes (pwrite64, pwritev, pwritev2: the image file's
/// writes; eventfd signals are plain write(2) and not counted) with `perf stat`, threads
/// created later included. None where perf or its syscall tracepoints are missing.
pub fn start_write_count(pid: i32, out: &Path) -> Option<Child> {
    let mut c = Command::new("perf")
        .args(["stat", "-x", ",", "-e"])
        .arg(
            "syscalls:sys_enter_pwrite64,syscalls:sys_enter_pwritev,\
             syscalls:sys_enter_pwritev2",
        )
        .arg("-p")
        .arg(pid.to_string())
        .arg("-o")
        .arg(out)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .ok()?;
    // perf attaches asynchronously: give it a moment.
    std::thread::sleep(Duration::from_millis(300));
    if let Ok(Some(_)) = c.try_wait() {
        return None;
    }
    Some(c)
}

/// Stop a count `start_write_count` started and read it: the positioned writes, None where
/// perf's output holds none.
pub fn stop_write_count(mut c: Child, out: &Path) -> Option<u64> {
    // SAFETY: signalling our own child process.
    unsafe { libc::kill(c.id() as i32, libc::SIGINT) };
    c.wait().ok()?;
    let s = fs::read_to_string(out).ok()?;
    let mut total = 0;
    let mut seen = false;
    for l in s.lines().filter(|l| l.contains("syscalls:")) {
        total += l.split(',').next()?.trim().parse::<u64>().ok()?;
        seen = true;
    }
    seen.then_some(total)
}
