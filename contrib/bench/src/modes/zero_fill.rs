//! `--zero-fill`: zeroes written through each backend as 1 MiB writes at depth 4 into a
//! fresh sparse image and into a fully written one: the time to the FLUSH and the space the
//! image holds afterwards (what detect-zeroes and discard save).

use std::fmt::Write as _;
use std::fs::{self, File};
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::time::Instant;

use crate::alternate::{alternate, Order};
use crate::args::Opts;
use crate::backends::Backend;
use crate::client::{self, connect_client};
use crate::images::prepare_image;
use crate::report::{self, median_by};
use crate::server::start_server;

/// One `--zero-fill` run's result.
pub struct FillResult {
    /// From the first write to the FLUSH's completion.
    pub secs: f64,
    /// The image's allocated bytes (st_blocks) after the backend exited.
    pub allocated: u64,
}

/// One `--zero-fill` run: `opts.size` bytes of zeroes through `backend` into `image`, made
/// afresh (sparse, or fully written when `full`); the time to the FLUSH and the space the
/// image holds once the backend has exited. Panics if the image does not read back as zeroes.
pub fn measure(
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
    client::write_zeroes(&mut b, &mut queues[0], opts.size);
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
pub fn run(opts: &Opts, backends: &[Backend], vublk: &Path, work: &Path) {
    let image = work.join("zero-fill.img");
    let mut rows = String::new();
    for full in [false, true] {
        // The backends as listed in every round: this mode has never rotated them.
        let results = alternate(
            opts.runs,
            Order::Listed,
            backends,
            |b| measure(b, &image, full, opts, vublk, work),
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
