//! `--parallels-fill`: the parallels preallocation table. Sequential 64 KiB writes at depth
//! 1 and 8 through each backend into a fresh 64 GiB parallels image: the time to the FLUSH,
//! and the file's size while the backend runs and after it closed the image.

use std::fmt::Write as _;
use std::fs;
use std::path::Path;
use std::time::Instant;

use crate::alternate::{alternate, Order};
use crate::args::Opts;
use crate::backends::Backend;
use crate::client::{self, connect_client};
use crate::images;
use crate::report::{self, median_by};
use crate::server::start_server;

/// `--parallels-fill` data: `len` bytes that are neither zero nor the same everywhere.
pub fn data(len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u64).wrapping_mul(0x9e37_79b9) as u8 | 1)
        .collect()
}

/// One `--parallels-fill` run's result.
pub struct ParallelsResult {
    /// From the first write to the FLUSH's completion.
    pub secs: f64,
    /// The file's size just before the backend closed it (preallocated tail included).
    pub running_bytes: u64,
    /// The file's size after the backend closed it.
    pub closed_bytes: u64,
}

/// One `--parallels-fill` run: `data` as sequential 64 KiB writes at `depth` through
/// `backend` into a fresh 64 GiB parallels image (64 KiB clusters), then FLUSH.
pub fn measure(
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
pub fn run(opts: &Opts, backends: &[Backend], vublk: &Path, work: &Path) {
    let size = opts.size - opts.size % (64 << 10);
    let data = data(size as usize);
    let mut rows = String::new();
    for depth in [1usize, 8] {
        // The backends as listed in every round: this mode has never rotated them.
        let results = alternate(
            opts.runs,
            Order::Listed,
            backends,
            |b| measure(b, &data, depth, opts, vublk, work),
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
