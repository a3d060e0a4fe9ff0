//! `--compress-fill`: the compressed-write table. Data (a constant byte, or the files under
//! /usr) written through each backend into a fresh qcow2 with compressed writes on: the
//! time to the FLUSH, the image's size, and the write system calls the backend made.

use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};
use std::time::Instant;

use crate::alternate::{alternate, Order};
use crate::args::Opts;
use crate::backends::Backend;
use crate::client::{self, connect_client};
use crate::images;
use crate::procstat::{proc_writes, start_write_count, stop_write_count};
use crate::report::{self, median_by};
use crate::server::start_server;

/// `--compress-fill` data: `len` bytes of a constant byte, or of the files under /usr.
pub fn fill_data(kind: &str, len: usize) -> Vec<u8> {
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

/// One `--compress-fill` run's result.
pub struct CompressResult {
    /// From the first write to the FLUSH's completion.
    pub secs: f64,
    /// The image file's size after the backend exited.
    pub image_bytes: u64,
    /// The backend's positioned writes (perf), or all its write system calls (/proc).
    pub syscw: u64,
    /// The bytes the backend wrote (/proc/PID/io wchar).
    pub wchar: u64,
    /// vublk's own count of compressed writes reaching the file, and their bytes.
    pub cache_writes: Option<(u64, u64)>,
}

/// One `--compress-fill` run: `data` as 64 KiB writes at depth 8 through `backend` into a
/// fresh qcow2 of its size (64 KiB clusters, compression type `ctype`), then FLUSH; the time to
/// the FLUSH's completion, the image's size and the backend's writes.
pub fn measure(
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
pub fn run(opts: &Opts, backends: &[Backend], vublk: &Path, work: &Path) {
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
                |b| measure(b, &data, ctype, opts, vublk, work),
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
