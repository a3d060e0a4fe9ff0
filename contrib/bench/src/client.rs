//! The libblkio client: connecting to a backend (virtio-blk-vhost-user on its socket, or
//! io_uring with O_DIRECT on the file itself), driving a workload's queues for a timed run
//! and measuring it (IOPS, throughput, latency percentiles, the backend's and the client's
//! CPU time, the backend's memory), and the plain sequential fills the fill modes write.
//!
//! A timed run pre-allocates everything (one memory region, per-slot buffers, completion
//! arrays, latency samples) so that nothing is allocated per request.

use std::mem::MaybeUninit;
use std::path::Path;
use std::time::{Duration, Instant};

use blkio::{Blkio, Blkioq, ReqFlags};

use crate::args::Opts;
use crate::backends::{Backend, BackendKind};
use crate::images;
use crate::procstat::{cpu_ns, rss_kib, self_cpu_ns};
use crate::server::{start_server, Server};
use crate::workloads::{Dir, Pattern, Workload};

/// One measured run.
#[derive(Clone, Debug, Default)]
pub struct RunResult {
    /// Requests completed in the measured window.
    pub ios: u64,
    pub bytes: u64,
    /// The measured window (with `--smoke`: the whole run).
    pub secs: f64,
    pub p50_us: f64,
    pub p99_us: f64,
    /// The backend process's CPU time in the measured window (None for the file itself).
    pub backend_cpu_ns: Option<u64>,
    /// This process's CPU time (the client's threads) in the measured window.
    pub client_cpu_ns: u64,
    /// The backend's resident memory at the end of the run.
    pub rss_load_kib: Option<u64>,
    /// The server's start-up and idle memory (see `Server`).
    pub startup: Duration,
    pub rss_idle_kib: Option<u64>,
}

impl RunResult {
    pub fn iops(&self) -> f64 {
        self.ios as f64 / self.secs
    }
    pub fn mbps(&self) -> f64 {
        self.bytes as f64 / self.secs / 1e6
    }
    /// The backend's CPU time per request, in microseconds.
    pub fn cpu_us_per_io(&self) -> Option<f64> {
        self.backend_cpu_ns
            .map(|ns| ns as f64 / 1000.0 / self.ios.max(1) as f64)
    }
}

/// What one queue's thread measured.
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

/// The `p` quantile of sorted nanosecond samples, in microseconds (0 with no samples).
fn percentile(sorted: &[u32], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i] as f64 / 1000.0
}

/// Connect the libblkio client to a backend (or to the file itself).
pub fn connect_client(
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

/// One timed run of `wl` through `backend`: start its server (on a fresh qcow2 first with
/// `--fresh-qcow2`), connect, drive every queue on a thread of its own for `--warmup-ms` and
/// `--seconds` (or a few hundred I/Os with `--smoke`), measure, stop the server.
pub fn run_once(
    backend: &Backend,
    wl: &Workload,
    opts: &Opts,
    vublk: &Path,
    work: &Path,
) -> RunResult {
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

/// Write `size` bytes of zeroes at depth 4 in 1 MiB requests, then flush. The buffers are
/// zeroed once, not copied into per request as `write_data` does.
pub fn write_zeroes(b: &mut Blkio, q: &mut Blkioq, size: u64) {
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

/// Write `data` sequentially as 64 KiB requests at `depth`, then FLUSH.
pub fn write_data(b: &mut Blkio, q: &mut Blkioq, data: &[u8], depth: usize) {
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
