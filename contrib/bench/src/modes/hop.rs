//! `--hop`: what one wake-up across CPUs costs on this machine, the part of the vhost-user
//! hop no backend can avoid while the client sleeps. Two threads pinned to the first two
//! CPUs this process may use ping-pong through two eventfds, 20,000 round trips, three ways:
//! both sleep in `read`, the responder spins on a non-blocking eventfd, both spin.

use std::time::Instant;

const ROUNDS: usize = 20_000;

fn pin(cpu: usize) {
    // SAFETY: a zeroed cpu_set_t is valid; `cpu` comes from the allowed set (< CPU_SETSIZE).
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of_val(&set), &set);
    }
}

fn allowed() -> Vec<usize> {
    // SAFETY: as in `pin`; sched_getaffinity fills the set.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of_val(&set), &mut set) != 0 {
            return Vec::new();
        }
        (0..libc::CPU_SETSIZE as usize)
            .filter(|&c| libc::CPU_ISSET(c, &set))
            .collect()
    }
}

fn eventfd(spin: bool) -> i32 {
    // SAFETY: plain system call.
    let fd = unsafe { libc::eventfd(0, if spin { libc::EFD_NONBLOCK } else { 0 }) };
    assert!(fd >= 0, "eventfd: {}", std::io::Error::last_os_error());
    fd
}

fn signal(fd: i32) {
    let one = 1u64;
    // SAFETY: 8 bytes from a live u64.
    unsafe { libc::write(fd, (&one as *const u64).cast(), 8) };
}

fn wait(fd: i32) {
    let mut v = 0u64;
    // SAFETY: 8 bytes into a live u64; a non-blocking fd returns EAGAIN until signalled.
    while unsafe { libc::read(fd, (&mut v as *mut u64).cast(), 8) } != 8 {
        std::hint::spin_loop();
    }
}

/// Round trips in microseconds, sorted.
fn ping_pong(cpus: (usize, usize), responder_spins: bool, caller_spins: bool) -> Vec<f64> {
    let (to, back) = (eventfd(responder_spins), eventfd(caller_spins));
    let responder = std::thread::spawn(move || {
        pin(cpus.1);
        for _ in 0..ROUNDS {
            wait(to);
            signal(back);
        }
    });
    pin(cpus.0);
    std::thread::sleep(std::time::Duration::from_millis(10));
    let mut rtt: Vec<f64> = (0..ROUNDS)
        .map(|_| {
            let t0 = Instant::now();
            signal(to);
            wait(back);
            t0.elapsed().as_secs_f64() * 1e6
        })
        .collect();
    responder.join().unwrap();
    // SAFETY: both fds are ours and no longer used.
    unsafe {
        libc::close(to);
        libc::close(back);
    }
    rtt.sort_by(f64::total_cmp);
    rtt
}

/// `--hop`: print the table (exits with status 2 where fewer than two CPUs are allowed).
pub fn run() {
    let cpus = allowed();
    if cpus.len() < 2 {
        eprintln!("--hop needs two CPUs (this process may use {cpus:?})");
        std::process::exit(2);
    }
    let pair = (cpus[0], cpus[1]);
    println!(
        "eventfd ping-pong between CPUs {} and {}, {ROUNDS} round trips\n",
        pair.0, pair.1
    );
    println!("| both sleep | responder spins | both spin |");
    println!("|---:|---:|---:|");
    let cell = |r: &[f64]| {
        format!(
            "{:.1} us (p90 {:.1}, p99 {:.1})",
            r[r.len() / 2],
            r[r.len() * 9 / 10],
            r[r.len() * 99 / 100]
        )
    };
    let sleep = ping_pong(pair, false, false);
    let one = ping_pong(pair, true, false);
    let both = ping_pong(pair, true, true);
    println!("| {} | {} | {} |", cell(&sleep), cell(&one), cell(&both));
}
