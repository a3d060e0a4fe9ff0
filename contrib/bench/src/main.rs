//! vublk-bench: the same libblkio client, the same image file, three backends side by side:
//! (a) the file itself through libblkio's io_uring driver with O_DIRECT (the limit), (b) vublk,
//! (c) qemu-storage-daemon. Backends alternate run by run; medians and ratios are reported.
//!
//! The client pre-allocates everything (one memory region, per-slot buffers, completion
//! arrays, latency samples) so that nothing is allocated per request.

mod alternate;
mod args;
mod backends;
mod hop;
mod images;
mod procstat;
mod report;
mod seed_check;
mod server;

use std::fmt::Write as _;
use std::fs::{self, File};
use std::mem::MaybeUninit;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use blkio::{Blkio, Blkioq, ReqFlags};
use clap::Parser;

use alternate::{alternate, Order};
use args::Opts;
use backends::{resolve_backends, Backend, BackendKind};
use images::prepare_image;
use procstat::{cpu_ns, proc_writes, rss_kib, self_cpu_ns, start_write_count, stop_write_count};
use report::{median, median_by};
use server::{start_server, Server};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Pattern {
    Random,
    Sequential,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Dir {
    Read,
    Write,
}

#[derive(Clone, Debug)]
struct Workload {
    name: String,
    pattern: Pattern,
    dir: Dir,
    bs: usize,
    depth: usize,
    queues: usize,
}

fn wl(name: &str, pattern: Pattern, dir: Dir, bs: usize, depth: usize, queues: usize) -> Workload {
    Workload {
        name: name.to_owned(),
        pattern,
        dir,
        bs,
        depth,
        queues,
    }
}

fn standard_workloads() -> Vec<Workload> {
    use Dir::*;
    use Pattern::*;
    vec![
        wl("randread-4k-qd1", Random, Read, 4096, 1, 1),
        wl("randread-4k-qd32", Random, Read, 4096, 32, 1),
        wl("randwrite-4k-qd32", Random, Write, 4096, 32, 1),
        wl("seqwrite-64k-qd8", Sequential, Write, 64 << 10, 8, 1),
        wl("seqwrite-1m-qd4", Sequential, Write, 1 << 20, 4, 1),
        wl("randread-4k-2q-qd16", Random, Read, 4096, 16, 2),
    ]
}

/// Not in the default set: the preallocation seed's cases (sequential writes at depth 64),
/// and the network-storage set (depth 16: RBD).
fn extra_workloads() -> Vec<Workload> {
    use Dir::*;
    use Pattern::*;
    vec![
        wl("seqwrite-16k-qd64", Sequential, Write, 16 << 10, 64, 1),
        wl("seqwrite-64k-qd64", Sequential, Write, 64 << 10, 64, 1),
        wl("randread-4k-qd16", Random, Read, 4096, 16, 1),
        wl("randwrite-4k-qd16", Random, Write, 4096, 16, 1),
        wl("seqwrite-64k-qd16", Sequential, Write, 64 << 10, 16, 1),
    ]
}

fn scaling_workloads() -> Vec<Workload> {
    [1, 2, 4]
        .iter()
        .map(|&q| {
            wl(
                &format!("scaling-randread-4k-{q}q-qd16"),
                Pattern::Random,
                Dir::Read,
                4096,
                16,
                q,
            )
        })
        .collect()
}

/// One measured run.
#[derive(Clone, Debug, Default)]
struct RunResult {
    ios: u64,
    bytes: u64,
    secs: f64,
    p50_us: f64,
    p99_us: f64,
    backend_cpu_ns: Option<u64>,
    client_cpu_ns: u64,
    rss_load_kib: Option<u64>,
    startup: Duration,
    rss_idle_kib: Option<u64>,
}

impl RunResult {
    fn iops(&self) -> f64 {
        self.ios as f64 / self.secs
    }
    fn mbps(&self) -> f64 {
        self.bytes as f64 / self.secs / 1e6
    }
    fn cpu_us_per_io(&self) -> Option<f64> {
        self.backend_cpu_ns
            .map(|ns| ns as f64 / 1000.0 / self.ios.max(1) as f64)
    }
}

struct QueueRun {
    ios: u64,
    bytes: u64,
    lat_ns: Vec<u32>,
}

/// Drive one queue: keep `depth` requests in flight until `end`; measure after `measure_from`.
#[allow(clippy::too_many_arguments)]
fn drive_queue(
    q: &mut Blkioq,
    wl: &Workload,
    buf_base: usize,
    capacity: u64,
    seed: u64,
    measure_from: Instant,
    end: Instant,
    max_samples: usize,
    smoke_ios: Option<u64>,
) -> QueueRun {
    let depth = wl.depth;
    let bs = wl.bs;
    let blocks = capacity / bs as u64;
    let mut rng = seed | 1;
    let mut seq_next: u64 = (seed % blocks.max(1)) * bs as u64;
    let mut started = vec![Instant::now(); depth];
    let mut completions: Vec<MaybeUninit<blkio::Completion>> =
        (0..depth).map(|_| MaybeUninit::uninit()).collect();
    let mut lat_ns: Vec<u32> = Vec::with_capacity(max_samples);
    let mut ios = 0u64;
    let mut bytes = 0u64;
    let mut issued = 0u64;
    let mut in_flight = 0usize;
    let mut submit = |q: &mut Blkioq, slot: usize, started: &mut [Instant], issued: &mut u64| {
        let off = match wl.pattern {
            Pattern::Random => {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                (rng % blocks) * bs as u64
            }
            Pattern::Sequential => {
                let o = seq_next;
                seq_next += bs as u64;
                if seq_next + bs as u64 > capacity {
                    seq_next = 0;
                }
                o
            }
        };
        let buf = (buf_base + slot * bs) as *mut u8;
        started[slot] = Instant::now();
        match wl.dir {
            Dir::Read => q.read(off, buf, bs, slot, ReqFlags::empty()),
            Dir::Write => q.write(off, buf, bs, slot, ReqFlags::empty()),
        }
        *issued += 1;
    };
    for slot in 0..depth {
        submit(q, slot, &mut started, &mut issued);
        in_flight += 1;
    }
    loop {
        let n = q
            .do_io(&mut completions, 1, None, None)
            .expect("do_io failed");
        let now = Instant::now();
        let stop = now >= end || smoke_ios.is_some_and(|s| issued >= s);
        for c in completions.iter().take(n) {
            // SAFETY: do_io initialised the first n entries.
            let c = unsafe { c.assume_init_ref() };
            assert_eq!(c.ret, 0, "request failed: errno {}", -c.ret);
            let slot = c.user_data;
            in_flight -= 1;
            if now >= measure_from {
                ios += 1;
                bytes += bs as u64;
                if lat_ns.len() < max_samples {
                    let d = now.duration_since(started[slot]).as_nanos();
                    lat_ns.push(d.min(u32::MAX as u128) as u32);
                }
            }
            if !stop {
                submit(q, slot, &mut started, &mut issued);
                in_flight += 1;
            }
        }
        if stop && in_flight == 0 {
            break;
        }
    }
    QueueRun { ios, bytes, lat_ns }
}

fn percentile(sorted: &[u32], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i] as f64 / 1000.0
}

/// Connect the libblkio client to a backend (or to the file itself).
fn connect_client(
    backend: &Backend,
    server: &Server,
    image: &Path,
    queues: usize,
) -> (Blkio, Vec<Blkioq>) {
    let (driver, path) = match backend.kind {
        BackendKind::File => ("io_uring", image.to_path_buf()),
        _ => ("virtio-blk-vhost-user", server.socket.clone()),
    };
    let mut b = Blkio::new(driver).expect("libblkio driver");
    b.set_str("path", path.to_str().expect("utf-8 path"))
        .expect("path");
    if backend.kind == BackendKind::File {
        b.set_bool("direct", true).expect("direct");
    }
    if backend
        .extra
        .iter()
        .any(|a| a == "--read-only" || a.contains("read-only=on"))
    {
        b.set_bool("read-only", true).expect("read-only");
    }
    b.connect().expect("connect");
    b.set_i32("num-queues", queues as i32).expect("num-queues");
    let started = b.start().expect("start");
    (b, started.queues)
}

fn run_once(backend: &Backend, wl: &Workload, opts: &Opts, vublk: &Path, work: &Path) -> RunResult {
    let image = backend.image.as_deref().unwrap_or(&opts.image);
    if opts.fresh_qcow2 && image.extension().is_some_and(|e| e == "qcow2") {
        images::fresh_qcow2(image, opts, vublk);
    }
    let server = start_server(backend, image, opts, vublk, work);
    let (mut b, queues) = connect_client(backend, &server, image, wl.queues);
    let capacity = b.get_u64("capacity").expect("capacity");
    let region_len = wl.queues * wl.depth * wl.bs;
    let region = b.alloc_mem_region(region_len).expect("alloc region");
    b.map_mem_region(&region).expect("map region");
    // SAFETY: the region is ours, region_len bytes long.
    unsafe { std::ptr::write_bytes(region.addr as *mut u8, 0x5a, region_len) };

    let warmup = Duration::from_millis(if opts.smoke { 0 } else { opts.warmup_ms });
    let t0 = Instant::now();
    let measure_from = t0 + warmup;
    let end = measure_from + Duration::from_secs_f64(opts.seconds);
    let smoke_ios = opts.smoke.then_some(300);
    let max_samples = 4 << 20;
    let pid = server.pid();

    let mut cpu0: Option<u64> = None;
    let mut client0 = 0;
    let results: Vec<QueueRun> = std::thread::scope(|s| {
        let handles: Vec<_> = queues
            .into_iter()
            .enumerate()
            .map(|(i, mut q)| {
                let wl = wl.clone();
                let base = region.addr + i * wl.depth * wl.bs;
                s.spawn(move || {
                    let seed = 0x1234_5678_9abc_def1u64.wrapping_mul(i as u64 + 1);
                    let r = drive_queue(
                        &mut q,
                        &wl,
                        base,
                        capacity,
                        seed,
                        measure_from,
                        end,
                        max_samples,
                        smoke_ios,
                    );
                    drop(q);
                    r
                })
            })
            .collect();
        // Sample CPU counters at the start and end of the measured window.
        let now = Instant::now();
        if measure_from > now {
            std::thread::sleep(measure_from - now);
        }
        cpu0 = pid.and_then(cpu_ns);
        client0 = self_cpu_ns();
        handles
            .into_iter()
            .map(|h| h.join().expect("queue thread"))
            .collect()
    });
    let secs = if opts.smoke {
        t0.elapsed().as_secs_f64()
    } else {
        end.duration_since(measure_from).as_secs_f64()
    };
    let cpu1 = pid.and_then(cpu_ns);
    let client_cpu_ns = self_cpu_ns().saturating_sub(client0);
    let rss_load_kib = pid.and_then(rss_kib);
    let mut lat: Vec<u32> = Vec::new();
    let mut ios = 0;
    let mut bytes = 0;
    for r in results {
        ios += r.ios;
        bytes += r.bytes;
        lat.extend_from_slice(&r.lat_ns);
    }
    lat.sort_unstable();
    drop(b);
    RunResult {
        ios,
        bytes,
        secs,
        p50_us: percentile(&lat, 0.50),
        p99_us: percentile(&lat, 0.99),
        backend_cpu_ns: match (cpu0, cpu1) {
            (Some(a), Some(b)) => Some(b.saturating_sub(a)),
            _ => None,
        },
        client_cpu_ns,
        rss_load_kib,
        startup: server.startup,
        rss_idle_kib: server.rss_idle_kib,
    }
}

fn main() -> ExitCode {
    let mut opts = Opts::parse();
    let mut workloads = standard_workloads();
    if opts.list {
        for w in standard_workloads()
            .iter()
            .chain(scaling_workloads().iter())
            .chain(extra_workloads().iter())
        {
            println!(
                "{:28} {:?} {:?} bs={} depth={} queues={}",
                w.name, w.pattern, w.dir, w.bs, w.depth, w.queues
            );
        }
        return ExitCode::SUCCESS;
    }
    if opts.scaling {
        workloads.extend(scaling_workloads());
    }
    if !opts.workloads.is_empty() {
        let all: Vec<Workload> = standard_workloads()
            .into_iter()
            .chain(scaling_workloads())
            .chain(extra_workloads())
            .collect();
        workloads = opts
            .workloads
            .iter()
            .map(|n| {
                all.iter()
                    .find(|w| &w.name == n)
                    .unwrap_or_else(|| panic!("unknown workload {n} (see --list)"))
                    .clone()
            })
            .collect();
    }
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
        return if seed_check::seed_check(&opts, &vublk, &work) {
            ExitCode::SUCCESS
        } else {
            // A row below its target (a panic, when the check could not run, exits with 101).
            ExitCode::FAILURE
        };
    }
    if opts.zero_scan {
        zero_scan();
        return ExitCode::SUCCESS;
    }
    if opts.hop {
        hop::hop();
        return ExitCode::SUCCESS;
    }
    if opts.fresh_file {
        fresh_file(&opts, &work);
        return ExitCode::SUCCESS;
    }
    if opts.zero_fill {
        zero_fill(&opts, &backends, &vublk, &work);
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
    // Only fresh qcow2 images: the raw benchmark image is not needed (and may be large).
    let only_fresh = opts.fresh_qcow2
        && backends.iter().all(|b| {
            b.image
                .as_ref()
                .is_some_and(|i| i.extension().is_some_and(|e| e == "qcow2"))
        });
    if !only_fresh {
        prepare_image(&opts.image, opts.size);
    }

    // results[workload][backend] = runs
    let mut results: Vec<Vec<Vec<RunResult>>> =
        vec![vec![Vec::new(); backends.len()]; workloads.len()];
    for run in 0..opts.runs {
        for (wi, wl) in workloads.iter().enumerate() {
            for bi in Order::of(&opts).round(run, backends.len()) {
                let backend = &backends[bi];
                let r = run_once(backend, wl, &opts, &vublk, &work);
                eprintln!(
                    "run {} {:28} {:6} {:>10.0} IOPS {:>8.1} MB/s p50 {:>7.1} us p99 {:>7.1} us{}",
                    run + 1,
                    wl.name,
                    backend.name(),
                    r.iops(),
                    r.mbps(),
                    r.p50_us,
                    r.p99_us,
                    r.cpu_us_per_io()
                        .map_or(String::new(), |c| format!(" cpu {c:.2} us/IO"))
                );
                results[wi][bi].push(r);
            }
        }
    }

    report::emit(
        &opts,
        &report::workloads_report(&opts, &workloads, &backends, &results),
    );
    ExitCode::SUCCESS
}
/// The all-zero scanner on host buffers: GB/s on all-zero buffers (the whole buffer is read)
/// and the cost of rejecting non-zero data (usually the first sampled byte).
fn zero_scan() {
    use vublk::zero::{is_zero, scanner_name};
    println!("\nScanner: {}\n", scanner_name());
    println!("| buffer | all-zero GB/s | random data ns/call | one non-zero byte at 3/4 GB/s |");
    println!("|---:|---:|---:|---:|");
    for size in [4096usize, 64 << 10, 1 << 20] {
        let zero = vec![0u8; size];
        let mut data = vec![0u8; size];
        let mut x = 0x2545_f491_4f6c_dd1du64;
        for b in data.iter_mut() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            *b = (x as u8) | 1;
        }
        // Past the three sampled bytes (first, middle, last): forces a scan of 3/4.
        let mut last = vec![0u8; size];
        last[size * 3 / 4] = 1;
        let rate = |buf: &[u8], expect: bool| -> (f64, f64) {
            let t0 = Instant::now();
            let mut n = 0u64;
            while t0.elapsed() < Duration::from_millis(300) {
                for _ in 0..64 {
                    assert_eq!(is_zero(std::hint::black_box(buf)), expect);
                }
                n += 64;
            }
            let s = t0.elapsed().as_secs_f64();
            (n as f64 * buf.len() as f64 / s / 1e9, s * 1e9 / n as f64)
        };
        let (gbs, _) = rate(&zero, true);
        let (_, ns) = rate(&data, false);
        let (gbs_last, _) = rate(&last, false);
        println!(
            "| {} KiB | {gbs:.1} | {ns:.1} | {:.1} |",
            size >> 10,
            gbs_last * 0.75
        );
    }
    // Cache-cold: 64 KiB pieces of a 512 MiB zero buffer, as a guest write usually is.
    let big = vec![0u8; 512 << 20];
    // Touch it so pages exist (zero pages would all map one shared page).
    let mut big = big;
    for p in big.chunks_mut(4096) {
        p[0] = 1;
        p[0] = 0;
    }
    let t0 = Instant::now();
    let mut bytes = 0u64;
    while t0.elapsed() < Duration::from_millis(500) {
        for c in big.chunks(64 << 10) {
            assert!(is_zero(std::hint::black_box(c)));
            bytes += c.len() as u64;
        }
    }
    println!(
        "| 64 KiB pieces of 512 MiB (cache-cold) | {:.1} | | |",
        bytes as f64 / t0.elapsed().as_secs_f64() / 1e9
    );
}

struct FillResult {
    secs: f64,
    allocated: u64,
}

/// Write `size` bytes of zeroes at depth 4 in 1 MiB requests, then flush.
fn write_zeroes_through(b: &mut Blkio, q: &mut Blkioq, size: u64) {
    const BS: usize = 1 << 20;
    const DEPTH: usize = 4;
    let region = b.alloc_mem_region(BS * DEPTH).expect("alloc region");
    b.map_mem_region(&region).expect("map region");
    // SAFETY: the region is ours, BS * DEPTH bytes long.
    unsafe { std::ptr::write_bytes(region.addr as *mut u8, 0, BS * DEPTH) };
    let mut completions: Vec<MaybeUninit<blkio::Completion>> =
        (0..DEPTH).map(|_| MaybeUninit::uninit()).collect();
    let mut next = 0u64;
    let mut in_flight = 0;
    for slot in 0..DEPTH {
        if next < size {
            q.write(
                next,
                (region.addr + slot * BS) as *const u8,
                BS,
                slot,
                ReqFlags::empty(),
            );
            next += BS as u64;
            in_flight += 1;
        }
    }
    while in_flight > 0 {
        let n = q.do_io(&mut completions, 1, None, None).expect("do_io");
        for c in completions.iter().take(n) {
            // SAFETY: do_io initialised the first n entries.
            let c = unsafe { c.assume_init_ref() };
            assert_eq!(c.ret, 0, "zero write failed: errno {}", -c.ret);
            in_flight -= 1;
            if next < size {
                let slot = c.user_data;
                q.write(
                    next,
                    (region.addr + slot * BS) as *const u8,
                    BS,
                    slot,
                    ReqFlags::empty(),
                );
                next += BS as u64;
                in_flight += 1;
            }
        }
    }
    q.flush(0, ReqFlags::empty());
    let n = q.do_io(&mut completions, 1, None, None).expect("flush");
    assert_eq!(n, 1);
}

/// One `--zero-fill` run: `opts.size` bytes of zeroes through `backend` into `image`, made
/// afresh (sparse, or fully written when `full`); the time to the FLUSH and the space the
/// image holds once the backend has exited. Panics if the image does not read back as zeroes.
fn zero_fill_run(
    backend: &Backend,
    image: &Path,
    full: bool,
    opts: &Opts,
    vublk: &Path,
    work: &Path,
) -> FillResult {
    let _ = fs::remove_file(image);
    if full {
        prepare_image(image, opts.size);
    } else {
        File::create(image)
            .and_then(|f| f.set_len(opts.size))
            .expect("sparse image");
    }
    let server = start_server(backend, image, opts, vublk, work);
    let (mut b, mut queues) = connect_client(backend, &server, image, 1);
    let t0 = Instant::now();
    write_zeroes_through(&mut b, &mut queues[0], opts.size);
    let secs = t0.elapsed().as_secs_f64();
    drop(queues);
    drop(b);
    drop(server);
    let allocated = fs::metadata(image).expect("image").blocks() * 512;
    // Everything reads back as zero, whatever the backend did with the space.
    let data = fs::read(image).expect("read image");
    assert!(
        data.iter().all(|&x| x == 0),
        "{}: image not all zero after the zero writes",
        backend.name()
    );
    FillResult { secs, allocated }
}

/// `--zero-fill`: both images (fresh sparse, fully written), every backend, `--runs` times.
fn zero_fill(opts: &Opts, backends: &[Backend], vublk: &Path, work: &Path) {
    let image = work.join("zero-fill.img");
    let mut rows = String::new();
    for full in [false, true] {
        // The backends as listed in every round: this mode has never rotated them.
        let results = alternate(
            opts.runs,
            Order::Listed,
            backends,
            |b| zero_fill_run(b, &image, full, opts, vublk, work),
            |run, b, r| {
                format!(
                    "run {run} {} {:8} {:.3} s, {} MiB allocated",
                    if full { "fully-written" } else { "sparse" },
                    b.name(),
                    r.secs,
                    r.allocated >> 20
                )
            },
        );
        for (backend, rs) in backends.iter().zip(&results) {
            let secs = median_by(rs, |r| r.secs);
            let alloc = median_by(rs, |r| r.allocated as f64);
            let _ = writeln!(
                rows,
                "| {} | {} | {secs:.3} | {:.0} | {:.1} |",
                if full {
                    "fully written"
                } else {
                    "fresh sparse"
                },
                backend.name(),
                opts.size as f64 / secs / 1e6,
                alloc / (1 << 20) as f64
            );
        }
    }
    let _ = fs::remove_file(&image);
    let how = format!(
        "{} MiB of zeroes in 1 MiB writes at depth 4, then FLUSH; {} runs, medians; \
         allocation = st_blocks after the backend exited.",
        opts.size >> 20,
        opts.runs
    );
    report::emit(
        opts,
        &report::table(
            &how,
            "| image | backend | time (s) | MB/s | allocated after (MiB) |",
            "|---|---|---:|---:|---:|",
            &rows,
        ),
    );
}

/// `--fresh-file`: bytes written per run and write size (2 GiB: seconds of writing, so that
/// the file system's allocation work, not the set-up, is what is measured).
const FRESH_FILE_BYTES: u64 = 2 << 30;

/// How `--fresh-file` prepares the new file before writing into it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum FreshSpace {
    /// Sized with `ftruncate`: every write fills a hole.
    Holes,
    /// Allocated with `fallocate`: every write lands in allocated (unwritten) space.
    Fallocated,
    /// Left empty: every write extends the file.
    Extending,
}

/// Sequential O_DIRECT writes at depth 64 through io_uring into a fresh file, three ways.
fn fresh_file(opts: &Opts, work: &Path) {
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
            let iops = (0..opts.runs)
                .map(|_| fresh_file_iops(&path, bs, space, FRESH_FILE_BYTES))
                .collect();
            row.push(median(iops));
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
fn fresh_file_iops(path: &Path, bs: usize, space: FreshSpace, total_bytes: u64) -> f64 {
    use io_uring::{opcode, types, IoUring};
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::OpenOptionsExt;
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

/// Write `data` sequentially as 64 KiB requests at depth 8, then FLUSH.
fn write_data_through(b: &mut Blkio, q: &mut Blkioq, data: &[u8]) {
    write_data_at_depth(b, q, data, 8)
}

/// Write `data` sequentially as 64 KiB requests at `depth`, then FLUSH.
fn write_data_at_depth(b: &mut Blkio, q: &mut Blkioq, data: &[u8], depth: usize) {
    const BS: usize = 64 << 10;
    let region = b.alloc_mem_region(BS * depth).expect("alloc region");
    b.map_mem_region(&region).expect("map region");
    let mut completions: Vec<MaybeUninit<blkio::Completion>> =
        (0..depth).map(|_| MaybeUninit::uninit()).collect();
    let mut next = 0usize;
    let mut in_flight = 0;
    let submit = |q: &mut Blkioq, slot: usize, next: &mut usize| {
        let buf = (region.addr + slot * BS) as *mut u8;
        // SAFETY: the slot's buffer is ours and not in flight.
        unsafe { std::ptr::copy_nonoverlapping(data[*next..].as_ptr(), buf, BS) };
        q.write(*next as u64, buf as *const u8, BS, slot, ReqFlags::empty());
        *next += BS;
    };
    for slot in 0..depth {
        if next + BS <= data.len() {
            submit(q, slot, &mut next);
            in_flight += 1;
        }
    }
    while in_flight > 0 {
        let n = q.do_io(&mut completions, 1, None, None).expect("do_io");
        for c in completions.iter().take(n) {
            // SAFETY: do_io initialised the first n entries.
            let c = unsafe { c.assume_init_ref() };
            assert_eq!(c.ret, 0, "write failed: errno {}", -c.ret);
            in_flight -= 1;
            if next + BS <= data.len() {
                submit(q, c.user_data, &mut next);
                in_flight += 1;
            }
        }
    }
    q.flush(0, ReqFlags::empty());
    let n = q.do_io(&mut completions, 1, None, None).expect("flush");
    assert_eq!(n, 1);
    // SAFETY: the first completion was initialised by do_io.
    let flushed = unsafe { completions[0].assume_init_ref() }.ret;
    assert_eq!(flushed, 0, "FLUSH failed");
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
    write_data_through(&mut b, &mut queues[0], data);
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
    write_data_at_depth(&mut b, &mut queues[0], data, depth);
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
