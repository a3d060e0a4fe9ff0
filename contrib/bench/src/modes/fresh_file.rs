//! `--fresh-file`: the file system itself growing a fresh file, the ceiling for writes into
//! fresh image space: sequential O_DIRECT writes of 16 and 64 KiB at depth 64 through
//! io_uring (no backend, no libblkio) into a file sized with holes, into a fallocated one,
//! and extending it write by write.

use std::fs;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::time::Instant;

use io_uring::{opcode, types, IoUring};

use crate::args::Opts;
use crate::report::median;

/// `--fresh-file`: bytes written per run and write size (2 GiB: seconds of writing, so that
/// the file system's allocation work, not the set-up, is what is measured).
pub const FRESH_FILE_BYTES: u64 = 2 << 30;

/// How `--fresh-file` prepares the new file before writing into it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FreshSpace {
    /// Sized with `ftruncate`: every write fills a hole.
    Holes,
    /// Allocated with `fallocate`: every write lands in allocated (unwritten) space.
    Fallocated,
    /// Left empty: every write extends the file.
    Extending,
}

/// Sequential O_DIRECT writes at depth 64 through io_uring into a fresh file, three ways.
pub fn run(opts: &Opts, work: &Path) {
    let path = work.join("fresh-file.img");
    println!("\n| write size | into holes (IOPS) | into fallocated space | extending the file |");
    println!("|---|---:|---:|---:|");
    for bs in [16usize << 10, 64 << 10] {
        let mut row = Vec::new();
        for space in [
            FreshSpace::Holes,
            FreshSpace::Fallocated,
            FreshSpace::Extending,
        ] {
            let runs = (0..opts.runs)
                .map(|_| iops(&path, bs, space, FRESH_FILE_BYTES))
                .collect();
            row.push(median(runs));
        }
        println!(
            "| {} KiB | {:.0} | {:.0} | {:.0} |",
            bs >> 10,
            row[0],
            row[1],
            row[2]
        );
    }
    let _ = fs::remove_file(&path);
}

/// One `--fresh-file` run: `total_bytes` as sequential O_DIRECT writes of `bs` bytes at depth
/// 64 through io_uring into a new file at `path`, prepared as `space` says; IOPS.
pub fn iops(path: &Path, bs: usize, space: FreshSpace, total_bytes: u64) -> f64 {
    const DEPTH: usize = 64;
    let _ = fs::remove_file(path);
    // SAFETY: plain system call.
    unsafe { libc::sync() };
    let f = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .expect("create the probe file");
    match space {
        FreshSpace::Holes => f.set_len(total_bytes).expect("size"),
        FreshSpace::Fallocated => {
            // SAFETY: plain system call on our fd.
            let r = unsafe { libc::fallocate(f.as_raw_fd(), 0, 0, total_bytes as i64) };
            assert_eq!(r, 0, "fallocate");
        }
        FreshSpace::Extending => {}
    }
    let mut ring = IoUring::new(256).expect("io_uring");
    let layout = std::alloc::Layout::from_size_align(bs * DEPTH, 4096).expect("layout");
    // SAFETY: non-zero size; freed below.
    let buf = unsafe { std::alloc::alloc(layout) };
    assert!(!buf.is_null());
    // SAFETY: buf is bs * DEPTH bytes.
    unsafe { std::ptr::write_bytes(buf, 0x5a, bs * DEPTH) };
    let n = total_bytes / bs as u64;
    let (mut next, mut done, mut inflight) = (0u64, 0u64, 0usize);
    let t = Instant::now();
    while done < n {
        while inflight < DEPTH && next < n {
            let slot = (next as usize) % DEPTH;
            // SAFETY: inside buf.
            let p = unsafe { buf.add(slot * bs) };
            let e = opcode::Write::new(types::Fd(f.as_raw_fd()), p, bs as u32)
                .offset(next * bs as u64)
                .build()
                .user_data(next);
            // SAFETY: the buffer outlives the operation (we reap all of them).
            unsafe { ring.submission().push(&e).expect("sq") };
            next += 1;
            inflight += 1;
        }
        ring.submit_and_wait(1).expect("submit");
        for c in ring.completion() {
            assert_eq!(c.result(), bs as i32, "short or failed write");
            done += 1;
            inflight -= 1;
        }
    }
    let iops = n as f64 / t.elapsed().as_secs_f64();
    // SAFETY: allocated above with this layout; no operation is in flight.
    unsafe { std::alloc::dealloc(buf, layout) };
    iops
}
