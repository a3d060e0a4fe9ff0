//! vublk-bench: the same libblkio client, the same image file, three backends side by side:
//! (a) the file itself through libblkio's io_uring driver with O_DIRECT (the limit), (b) vublk,
//! (c) qemu-storage-daemon. Backends alternate run by run; medians and ratios are reported.
//!
//! The client pre-allocates everything (one memory region, per-slot buffers, completion
//! arrays, latency samples) so that nothing is allocated per request.

mod alternate;
mod args;
mod backends;
mod client;
mod images;
mod modes;
mod procstat;
mod report;
mod server;
mod workloads;

use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use clap::Parser;

use alternate::{alternate, Order};
use args::Opts;
use backends::{resolve_backends, Backend};
use client::connect_client;
use procstat::{proc_writes, start_write_count, stop_write_count};
use report::median_by;
use server::start_server;

fn main() -> ExitCode {
    let mut opts = Opts::parse();
    if opts.list {
        workloads::print_list();
        return ExitCode::SUCCESS;
    }
    let workloads = workloads::selected(&opts);
    if opts.smoke {
        opts.runs = 1;
    }
    let backends = resolve_backends(&opts);
    let vublk = opts.vublk.clone().unwrap_or_else(|| {
        std::env::current_exe()
            .expect("own path")
            .with_file_name("vublk")
    });
    let work = opts
        .image
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."));
    if opts.seed_check {
        return if modes::seed_check::run(&opts, &vublk, &work) {
            ExitCode::SUCCESS
        } else {
            // A row below its target (a panic, when the check could not run, exits with 101).
            ExitCode::FAILURE
        };
    }
    if opts.zero_scan {
        modes::zero_scan::run();
        return ExitCode::SUCCESS;
    }
    if opts.hop {
        modes::hop::run();
        return ExitCode::SUCCESS;
    }
    if opts.fresh_file {
        modes::fresh_file::run(&opts, &work);
        return ExitCode::SUCCESS;
    }
    if opts.zero_fill {
        modes::zero_fill::run(&opts, &backends, &vublk, &work);
        return ExitCode::SUCCESS;
    }
    if opts.compress_fill {
        compress_fill(&opts, &backends, &vublk, &work);
        return ExitCode::SUCCESS;
    }
    if opts.parallels_fill {
        parallels_fill(&opts, &backends, &vublk, &work);
        return ExitCode::SUCCESS;
    }
    workloads::run(&opts, &workloads, &backends, &vublk, &work);
    ExitCode::SUCCESS
}
/// `--compress-fill` data: `len` bytes of a constant byte, or of the files under /usr.
fn fill_data(kind: &str, len: usize) -> Vec<u8> {
    match kind {
        "ones" => vec![1u8; len],
        "mix" => {
            let mut out = Vec::with_capacity(len);
            let mut dirs = vec![PathBuf::from("/usr")];
            let mut files = Vec::new();
            while let Some(d) = dirs.pop() {
                let Ok(rd) = fs::read_dir(&d) else { continue };
                let mut entries: Vec<_> = rd.filter_map(Result::ok).collect();
                entries.sort_by_key(|e| e.path());
                for e in entries.into_iter().rev() {
                    match e.file_type() {
                        Ok(t) if t.is_dir() => dirs.push(e.path()),
                        Ok(t) if t.is_file() => files.push(e.path()),
                        _ => {}
                    }
                }
            }
            files.sort();
            'outer: loop {
                for f in &files {
                    if let Ok(b) = fs::read(f) {
                        let n = b.len().min(len - out.len());
                        out.extend_from_slice(&b[..n]);
                        if out.len() == len {
                            break 'outer;
                        }
                    }
                }
                assert!(!out.is_empty(), "no readable files under /usr");
            }
            out
        }
        other => panic!("--fill-data {other}: ones or mix"),
    }
}

struct CompressResult {
    secs: f64,
    image_bytes: u64,
    syscw: u64,
    wchar: u64,
    /// vublk's own count of compressed writes reaching the file, and their bytes.
    cache_writes: Option<(u64, u64)>,
}

/// One `--compress-fill` run: `data` as 64 KiB writes at depth 8 through `backend` into a
/// fresh qcow2 of its size (64 KiB clusters, compression type `ctype`), then FLUSH; the time to
/// the FLUSH's completion, the image's size and the backend's writes.
fn compress_fill_run(
    backend: &Backend,
    data: &[u8],
    ctype: &str,
    opts: &Opts,
    vublk: &Path,
    work: &Path,
) -> CompressResult {
    let default_image = work.join("compress-fill.qcow2");
    let image = backend.image.as_deref().unwrap_or(&default_image);
    images::fresh_qemu_img(
        image,
        "qcow2",
        &format!("cluster_size=64k,compression_type={ctype}"),
        &data.len().to_string(),
    );
    let server = start_server(backend, image, opts, vublk, work);
    let (mut b, mut queues) = connect_client(backend, &server, image, 1);
    let pid = server.pid().expect("a server process");
    let perf_out = work.join("compress-fill.perf");
    let perf = start_write_count(pid, &perf_out);
    let w0 = proc_writes(pid).unwrap_or_default();
    let t0 = Instant::now();
    client::write_data(&mut b, &mut queues[0], data, 8);
    let secs = t0.elapsed().as_secs_f64();
    let w1 = proc_writes(pid).unwrap_or_default();
    let pwrites = perf.and_then(|p| stop_write_count(p, &perf_out));
    drop(queues);
    drop(b);
    drop(server);
    let log = fs::read_to_string(work.join(format!("{}.log", backend.name()))).unwrap_or_default();
    let cache_writes = log.split("compressed writes: ").find_map(|r| {
        let (w, rest) = r.split_once(" writes of ")?;
        let bytes = rest.split_whitespace().next()?;
        Some((w.parse().ok()?, bytes.parse().ok()?))
    });
    let image_bytes = fs::metadata(image).expect("image").len();
    CompressResult {
        secs,
        image_bytes,
        // perf's count of positioned writes when it works; else every write system call
        // (eventfd signals included).
        syscw: pwrites.unwrap_or(w1.0 - w0.0),
        wchar: w1.1 - w0.1,
        cache_writes,
    }
}

/// `--compress-fill`: every `--fill-data` and `--compression-types`, every backend,
/// `--runs` times.
fn compress_fill(opts: &Opts, backends: &[Backend], vublk: &Path, work: &Path) {
    let size = opts.size - opts.size % (64 << 10);
    let mut rows = String::new();
    for kind in &opts.fill_data {
        let data = fill_data(kind, size as usize);
        for ctype in &opts.compression_types {
            // The backends as listed in every round: this mode has never rotated them.
            let results = alternate(
                opts.runs,
                Order::Listed,
                backends,
                |b| compress_fill_run(b, &data, ctype, opts, vublk, work),
                |run, b, r| {
                    format!(
                        "run {run} {kind} {ctype} {:10} {:.2} s, image {} MiB, {} write calls \
                         ({} MiB), compressed writes to the file {:?}",
                        b.name(),
                        r.secs,
                        r.image_bytes >> 20,
                        r.syscw,
                        r.wchar >> 20,
                        r.cache_writes
                    )
                },
            );
            for (backend, rs) in backends.iter().zip(&results) {
                let secs = median_by(rs, |r| r.secs);
                let img = median_by(rs, |r| r.image_bytes as f64);
                let calls = median_by(rs, |r| r.syscw as f64);
                let wchar = median_by(rs, |r| r.wchar as f64);
                let cw = rs
                    .iter()
                    .find_map(|r| r.cache_writes)
                    .map(|(w, b)| {
                        format!("{w} ({:.1} KiB avg)", b as f64 / w.max(1) as f64 / 1024.0)
                    })
                    .unwrap_or_else(|| "-".into());
                let _ = writeln!(
                    rows,
                    "| {kind} | {ctype} | {} | {secs:.2} | {:.1} | {calls:.0} | {:.1} | {cw} |",
                    backend.name(),
                    img / (1 << 20) as f64,
                    if calls > 0.0 {
                        wchar / calls / 1024.0
                    } else {
                        0.0
                    },
                );
            }
        }
    }
    let how = format!(
        "{} MiB written as 64 KiB requests at depth 8 into a fresh qcow2 (64 KiB clusters), \
         then FLUSH; time to the FLUSH's completion; {} runs, medians; write calls = the \
         backend's pwrite/pwritev calls during the run (perf stat syscall tracepoints: data \
         and metadata writes to the image), avg write = bytes written (/proc/PID/io wchar) / \
         calls.",
        size >> 20,
        opts.runs
    );
    report::emit(
        opts,
        &report::table(
            &how,
            "| data | compression | backend | time (s) | image (MiB) | write calls | avg write (KiB) | compressed writes to the file (vublk) |",
            "|---|---|---|---:|---:|---:|---:|---:|",
            &rows,
        ),
    );
}

/// `--parallels-fill` data: `len` bytes that are neither zero nor the same everywhere.
fn parallels_data(len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u64).wrapping_mul(0x9e37_79b9) as u8 | 1)
        .collect()
}

struct ParallelsResult {
    secs: f64,
    /// The file's size just before the backend closed it (preallocated tail included).
    running_bytes: u64,
    /// The file's size after the backend closed it.
    closed_bytes: u64,
}

/// One `--parallels-fill` run: `data` as sequential 64 KiB writes at `depth` through
/// `backend` into a fresh 64 GiB parallels image (64 KiB clusters), then FLUSH.
fn parallels_fill_run(
    backend: &Backend,
    data: &[u8],
    depth: usize,
    opts: &Opts,
    vublk: &Path,
    work: &Path,
) -> ParallelsResult {
    let default_image = work.join("parallels-fill.img");
    let image = backend.image.as_deref().unwrap_or(&default_image);
    images::fresh_qemu_img(image, "parallels", "cluster_size=64k", "64G");
    let server = start_server(backend, image, opts, vublk, work);
    let (mut b, mut queues) = connect_client(backend, &server, image, 1);
    let t0 = Instant::now();
    client::write_data(&mut b, &mut queues[0], data, depth);
    let secs = t0.elapsed().as_secs_f64();
    let running_bytes = fs::metadata(image).expect("image").len();
    drop(queues);
    drop(b);
    drop(server);
    let closed_bytes = fs::metadata(image).expect("image").len();
    ParallelsResult {
        secs,
        running_bytes,
        closed_bytes,
    }
}

/// `--parallels-fill`: depth 1 and depth 8, every backend, `--runs` times.
fn parallels_fill(opts: &Opts, backends: &[Backend], vublk: &Path, work: &Path) {
    let size = opts.size - opts.size % (64 << 10);
    let data = parallels_data(size as usize);
    let mut rows = String::new();
    for depth in [1usize, 8] {
        // The backends as listed in every round: this mode has never rotated them.
        let results = alternate(
            opts.runs,
            Order::Listed,
            backends,
            |b| parallels_fill_run(b, &data, depth, opts, vublk, work),
            |run, b, r| {
                format!(
                    "run {run} qd{depth} {:10} {:.2} s ({:.0} MB/s), file {} MiB while running, \
                     {} MiB after close",
                    b.name(),
                    r.secs,
                    size as f64 / r.secs / 1e6,
                    r.running_bytes >> 20,
                    r.closed_bytes >> 20
                )
            },
        );
        let base = median_by(&results[0], |r| r.secs);
        for (backend, rs) in backends.iter().zip(&results) {
            let secs = median_by(rs, |r| r.secs);
            let closed = median_by(rs, |r| r.closed_bytes as f64);
            let _ = writeln!(
                rows,
                "| {depth} | {} | {secs:.2} | {:.0} | {:.2} | {:.0} |",
                backend.name(),
                size as f64 / secs / 1e6,
                base / secs,
                closed / (1 << 20) as f64
            );
        }
    }
    let how = format!(
        "{} MiB as sequential 64 KiB writes into a fresh 64 GiB parallels image (64 KiB \
         clusters), then FLUSH; {} runs, medians; speed-up against the first backend.",
        size >> 20,
        opts.runs
    );
    report::emit(
        opts,
        &report::table(
            &how,
            "| depth | backend | time (s) | MB/s | speed-up | file after close (MiB) |",
            "|---:|---|---:|---:|---:|---:|",
            &rows,
        ),
    );
}
