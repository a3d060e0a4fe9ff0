//! The queue thread's own set-up, done once on its first event (the threads belong to
//! vhost-user-backend, which starts one per queue for each connection): a name operators
//! see in `top -H` and `ps -L` (`vublk-qN`), and the CPU `--queue-cpus` pins it to.

use std::io;

/// Name the calling thread `vublk-q{index}` and pin it to `cpu` if one is given.
pub fn set_up(index: u16, cpu: Option<usize>) {
    let name = format!("vublk-q{index}\0");
    // SAFETY: a NUL-terminated name of at most 16 bytes (PR_SET_NAME truncates longer ones).
    unsafe { libc::prctl(libc::PR_SET_NAME, name.as_ptr() as libc::c_ulong, 0, 0, 0) };
    if let Some(cpu) = cpu {
        match pin(cpu) {
            Ok(()) => log::info!("queue {index}: thread pinned to CPU {cpu}"),
            Err(e) => log::warn!("queue {index}: cannot pin to CPU {cpu}: {e}"),
        }
    }
}

/// Restrict the calling thread to one CPU.
fn pin(cpu: usize) -> io::Result<()> {
    // SAFETY: cpu_set_t is plain data, valid when zeroed.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    if cpu >= libc::CPU_SETSIZE as usize {
        return Err(io::Error::from_raw_os_error(libc::EINVAL));
    }
    // SAFETY: `cpu` is below CPU_SETSIZE (checked above).
    unsafe { libc::CPU_SET(cpu, &mut set) };
    // SAFETY: 0 is the calling thread; `set` is a valid cpu_set_t of the size passed.
    let r = unsafe { libc::sched_setaffinity(0, std::mem::size_of_val(&set), &set) };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The CPUs this process may run on.
pub fn allowed_cpus() -> Vec<usize> {
    // SAFETY: as in `pin`; sched_getaffinity fills the set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: 0 is the calling thread; `set` is valid for the size passed.
    if unsafe { libc::sched_getaffinity(0, std::mem::size_of_val(&set), &mut set) } != 0 {
        return Vec::new();
    }
    (0..libc::CPU_SETSIZE as usize)
        // SAFETY: `c` is below CPU_SETSIZE.
        .filter(|&c| unsafe { libc::CPU_ISSET(c, &set) })
        .collect()
}

/// `--queue-cpus`: comma-separated CPUs and ranges (`0,2-3`), in order, each at most
/// `CPU_SETSIZE`.
pub fn parse_cpu_list(s: &str) -> Result<Vec<usize>, String> {
    let mut cpus = Vec::new();
    for part in s.split(',') {
        let part = part.trim();
        let bad = || format!("{part:?} is not a CPU number or range (e.g. 0,2-3)");
        let (lo, hi) = match part.split_once('-') {
            Some((a, b)) => (a.trim(), b.trim()),
            None => (part, part),
        };
        let lo: usize = lo.parse().map_err(|_| bad())?;
        let hi: usize = hi.parse().map_err(|_| bad())?;
        if lo > hi {
            return Err(format!("{part:?}: the range runs backwards"));
        }
        if hi >= libc::CPU_SETSIZE as usize {
            return Err(format!("CPU {hi} is beyond the largest CPU number"));
        }
        cpus.extend(lo..=hi);
    }
    Ok(cpus)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists() {
        assert_eq!(parse_cpu_list("1").unwrap(), [1]);
        assert_eq!(parse_cpu_list("0,2-4, 1").unwrap(), [0, 2, 3, 4, 1]);
        for bad in ["", "a", "1,", "3-1", "-1", "1-", "99999"] {
            assert!(parse_cpu_list(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn allowed_includes_the_current_cpu() {
        // SAFETY: sched_getcpu has no preconditions.
        let cpu = unsafe { libc::sched_getcpu() };
        assert!(allowed_cpus().contains(&(cpu as usize)));
    }
}
