//! `--seed-check`: the four gains vublk exists for (its "seeds"), measured in one run, each
//! against its target, so that a gain that is lost does not go unnoticed (issue 28; two were
//! once lost that way).
//!
//! Every row is the workload of its BENCHMARKS.md section, run through the same per-run
//! function as that section's mode (`--fresh-qcow2` workloads, `--fresh-file`, `--zero-fill`,
//! `--compress-fill`, `--parallels-fill`): only the two or three vublk configurations a target
//! compares, alternating run by run (`--rotate` rotates their order), medians of `--runs`.
//! All of them run the vublk binary given by `--vublk`, so two builds are checked by running
//! the check once per build.
//!
//! Every ratio is a speed-up: how many times faster the seed's configuration is than its
//! baseline (IOPS over IOPS, or the baseline's time over the seed's), so every target reads
//! "at least" or "more than".

use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};

use crate::alternate::{self, Order};
use crate::args::Opts;
use crate::backends::{Backend, BackendKind};
use crate::client::run_once;
use crate::modes::fresh_file::{self, FreshSpace, FRESH_FILE_BYTES};
use crate::modes::{compress_fill, parallels_fill, zero_fill};
use crate::report::{self, median};
use crate::workloads::extra_workloads;

/// Seed 000: `--prealloc on` over `--prealloc off`, IOPS (BENCHMARKS.md, "Preallocation
/// (issue 6, seed 000)": the seed measured +36% for QEMU's filter, vublk's target is 1.4x).
const PREALLOC_MIN_SPEEDUP: f64 = 1.4;
/// Seed 002: `--detect-zeroes unmap` over off, on zero writes into a sparse image
/// (BENCHMARKS.md, "detect-zeroes (issue 4, seed 002)").
const DETECT_ZEROES_MIN_SPEEDUP: f64 = 3.0;
/// Seed 002: what the image may hold after 1 GiB of zeroes with `unmap`: the zeroes must
/// become holes, not data (the seed's target; 1.6% of what plain writes allocate).
const DETECT_ZEROES_MAX_ALLOCATED_BYTES: u64 = 16 << 20;
/// Seed 003: the compressed-write cache must be faster (strictly) than the page cache and
/// than O_DIRECT without it (BENCHMARKS.md, "Compressed writes (issue 7, seed 003)").
const COMPRESSED_CACHE_MIN_SPEEDUP: f64 = 1.0;
/// Seed 004: `--prealloc-mode falloc` over `--prealloc off` at depth 1 (BENCHMARKS.md,
/// "Parallels expansion preallocation (issue 8, seed 004)": the seed saw ~15%).
const PARALLELS_MIN_SPEEDUP: f64 = 1.15;

/// The seeds' sizes; `--smoke` shrinks what is written, not the images (a sparse image of
/// 16 or 64 GiB costs nothing to make).
struct Sizes {
    /// Seed 000: the fresh qcow2's virtual size.
    prealloc_image_bytes: u64,
    /// Seed 000: written per run of the file system's own ceiling.
    fresh_file_bytes: u64,
    /// Seed 002: zeroes written.
    zero_bytes: u64,
    /// Seed 003: constant bytes written.
    compress_bytes: u64,
    /// Seed 004: written into the 64 GiB parallels image.
    parallels_bytes: u64,
}

impl Sizes {
    fn new(smoke: bool) -> Sizes {
        // Smoke: a few hundred 64 KiB writes per run, enough to go through every path.
        const SMOKE_BYTES: u64 = 16 << 20;
        let full = |bytes: u64| if smoke { SMOKE_BYTES } else { bytes };
        Sizes {
            prealloc_image_bytes: 16 << 30,
            fresh_file_bytes: full(FRESH_FILE_BYTES),
            zero_bytes: full(1 << 30),
            compress_bytes: full(1000 << 20),
            parallels_bytes: full(1 << 30),
        }
    }
}

/// One row of the table.
struct Row {
    seed: &'static str,
    gain: &'static str,
    workload: String,
    measured: String,
    target: String,
    /// Seed 000: the file system's own gain from preallocation, measured alongside.
    fs_gain: Option<f64>,
    fs_measured: String,
    ok: bool,
}

impl Row {
    fn verdict(&self) -> String {
        match (self.ok, self.fs_gain) {
            (true, _) => "ok".into(),
            (false, Some(g)) if g < PREALLOC_MIN_SPEEDUP => {
                format!("BELOW TARGET (the file system itself gains only {g:.2}x here)")
            }
            (false, Some(g)) => {
                format!("BELOW TARGET (the file system itself gains {g:.2}x here)")
            }
            (false, None) => "BELOW TARGET".into(),
        }
    }
}

/// A vublk configuration; `image` where the mode's default image would not do.
fn variant(name: &str, image: Option<PathBuf>, args: &str) -> Backend {
    Backend {
        name: name.to_owned(),
        kind: BackendKind::Vublk,
        extra: args.split_whitespace().map(str::to_owned).collect(),
        image,
        binary: None,
    }
}

/// "1 GiB" or "1000 MiB".
fn size_text(bytes: u64) -> String {
    if bytes.is_multiple_of(1 << 30) {
        format!("{} GiB", bytes >> 30)
    } else {
        format!("{} MiB", bytes >> 20)
    }
}

/// Run `measure(backend)` for every backend, `opts.runs` rounds, in `--rotate`'s order; print
/// each run's line; every backend's results in the order of `backends`.
fn seed_runs<T>(
    opts: &Opts,
    seed: &str,
    backends: &[Backend],
    measure: impl FnMut(&Backend) -> T,
    describe: impl Fn(&T) -> String,
) -> Vec<Vec<T>> {
    alternate::alternate(
        opts.runs,
        Order::of(opts),
        backends,
        measure,
        |run, b, r| format!("seed {seed} run {run} {:18} {}", b.name(), describe(r)),
    )
}

/// Seed 000: a fresh 16 GiB qcow2 per run (`vublk create`, then the `--fresh-qcow2` sync and
/// pause), sequential 16 KiB writes at depth 64, `--prealloc on` over `off`; and beside it
/// the file system's own gain, writes into fallocated space over writes into holes.
fn preallocation(opts: &Opts, sizes: &Sizes, vublk: &Path, work: &Path) -> Row {
    let row_opts = Opts {
        size: sizes.prealloc_image_bytes,
        fresh_qcow2: true,
        fresh_backing: None,
        ..opts.clone()
    };
    let image = work.join("seed-prealloc.qcow2");
    let backends = [
        variant("seed000-off", Some(image.clone()), "--prealloc off"),
        variant("seed000-on", Some(image.clone()), "--prealloc on"),
    ];
    let wl = extra_workloads()
        .into_iter()
        .find(|w| w.name == "seqwrite-16k-qd64")
        .expect("the preallocation seed's workload is among the extra workloads");
    let iops = seed_runs(
        opts,
        "000",
        &backends,
        |b| run_once(b, &wl, &row_opts, vublk, work).iops(),
        |iops| format!("{iops:.0} IOPS"),
    );
    let _ = fs::remove_file(&image);

    // The file system's own ceiling, as `--fresh-file` measures it (16 KiB, depth 64).
    let probe = work.join("seed-fresh-file.img");
    let fs_iops = alternate::alternate(
        opts.runs,
        Order::of(opts),
        &[FreshSpace::Holes, FreshSpace::Fallocated],
        |&space| fresh_file::iops(&probe, 16 << 10, space, sizes.fresh_file_bytes),
        |run, space, r| {
            format!(
                "seed 000 run {run} {:18} {r:.0} IOPS",
                format!("file-{space:?}").to_lowercase()
            )
        },
    );
    let _ = fs::remove_file(&probe);

    let off = median(iops[0].clone());
    let on = median(iops[1].clone());
    let holes = median(fs_iops[0].clone());
    let falloc = median(fs_iops[1].clone());
    let gain = on / off;
    let fs_gain = falloc / holes;
    let amount = if opts.smoke {
        "300 writes".to_owned()
    } else {
        format!("{} s", opts.seconds)
    };
    Row {
        seed: "000",
        gain: "preallocation: `--prealloc on` over `off`",
        workload: format!(
            "fresh {} qcow2 per run, sequential 16 KiB writes at depth 64, {amount}",
            size_text(sizes.prealloc_image_bytes)
        ),
        measured: format!("{gain:.2}x ({on:.0} vs {off:.0} IOPS)"),
        target: format!(">= {PREALLOC_MIN_SPEEDUP:.2}x"),
        fs_gain: Some(fs_gain),
        fs_measured: format!(
            "{fs_gain:.2}x (fallocated {falloc:.0} vs holes {holes:.0} IOPS, {} per run)",
            size_text(sizes.fresh_file_bytes)
        ),
        ok: gain >= PREALLOC_MIN_SPEEDUP,
    }
}

/// Seed 002: zeroes as 1 MiB writes at depth 4 into a fresh sparse image, then FLUSH:
/// `--detect-zeroes unmap --discard unmap` over detect-zeroes off; and what stays allocated.
fn detect_zeroes(opts: &Opts, sizes: &Sizes, vublk: &Path, work: &Path) -> Row {
    let row_opts = Opts {
        size: sizes.zero_bytes,
        ..opts.clone()
    };
    let image = work.join("seed-zero-fill.img");
    let backends = [
        variant("seed002-off", None, ""),
        variant(
            "seed002-unmap",
            None,
            "--detect-zeroes unmap --discard unmap",
        ),
    ];
    let results = seed_runs(
        opts,
        "002",
        &backends,
        |b| zero_fill::measure(b, &image, false, &row_opts, vublk, work),
        |r| format!("{:.3} s, {} MiB allocated", r.secs, r.allocated >> 20),
    );
    let _ = fs::remove_file(&image);
    let off = median(results[0].iter().map(|r| r.secs).collect());
    let unmap = median(results[1].iter().map(|r| r.secs).collect());
    let allocated = median(results[1].iter().map(|r| r.allocated as f64).collect());
    let gain = off / unmap;
    Row {
        seed: "002",
        gain: "detect-zeroes: `unmap` over off",
        workload: format!(
            "{} of zeroes, 1 MiB writes at depth 4 into a fresh sparse image, then FLUSH",
            size_text(sizes.zero_bytes)
        ),
        measured: format!(
            "{gain:.2}x ({unmap:.3} vs {off:.3} s), {:.1} MiB allocated after",
            allocated / (1 << 20) as f64
        ),
        target: format!(
            ">= {DETECT_ZEROES_MIN_SPEEDUP:.2}x and < {} MiB allocated",
            DETECT_ZEROES_MAX_ALLOCATED_BYTES >> 20
        ),
        fs_gain: None,
        fs_measured: "-".into(),
        ok: gain >= DETECT_ZEROES_MIN_SPEEDUP
            && allocated < DETECT_ZEROES_MAX_ALLOCATED_BYTES as f64,
    }
}

/// Seed 003: a constant byte as 64 KiB writes at depth 8 into a fresh zlib qcow2, then FLUSH:
/// the compressed-write cache (O_DIRECT) over the page cache, and over O_DIRECT without it.
fn compressed_cache(opts: &Opts, sizes: &Sizes, vublk: &Path, work: &Path) -> [Row; 2] {
    // As BENCHMARKS.md's command: one queue (the client uses one).
    let row_opts = Opts {
        backend_queues: 1,
        ..opts.clone()
    };
    let image = work.join("seed-compress.qcow2");
    let backends = [
        variant("seed003-cache", Some(image.clone()), "--compress-writes on"),
        variant(
            "seed003-pagecache",
            Some(image.clone()),
            "--compress-writes on --compressed-cache off --cache writeback",
        ),
        variant(
            "seed003-nocache",
            Some(image.clone()),
            "--compress-writes on --compressed-cache off",
        ),
    ];
    let data = compress_fill::fill_data("ones", sizes.compress_bytes as usize);
    let results = seed_runs(
        opts,
        "003",
        &backends,
        |b| compress_fill::measure(b, &data, "zlib", &row_opts, vublk, work),
        |r| format!("{:.2} s, image {} MiB", r.secs, r.image_bytes >> 20),
    );
    let _ = fs::remove_file(&image);
    let secs: Vec<f64> = results
        .iter()
        .map(|rs| median(rs.iter().map(|r| r.secs).collect()))
        .collect();
    let workload = format!(
        "{} of a constant byte, 64 KiB writes at depth 8 into a fresh zlib qcow2, then FLUSH",
        size_text(sizes.compress_bytes)
    );
    let row = |gain: &'static str, baseline: f64| {
        let speedup = baseline / secs[0];
        Row {
            seed: "003",
            gain,
            workload: workload.clone(),
            measured: format!("{speedup:.2}x ({:.2} vs {baseline:.2} s)", secs[0]),
            target: format!("> {COMPRESSED_CACHE_MIN_SPEEDUP:.2}x"),
            fs_gain: None,
            fs_measured: "-".into(),
            ok: speedup > COMPRESSED_CACHE_MIN_SPEEDUP,
        }
    };
    [
        row(
            "compressed-write cache over the page cache (`--compressed-cache off --cache writeback`)",
            secs[1],
        ),
        row(
            "compressed-write cache over O_DIRECT without it (`--compressed-cache off`)",
            secs[2],
        ),
    ]
}

/// Seed 004: a fresh 64 GiB parallels image per run, sequential 64 KiB writes at depth 1,
/// then FLUSH: `--prealloc on --prealloc-mode falloc` over `--prealloc off`.
fn parallels(opts: &Opts, sizes: &Sizes, vublk: &Path, work: &Path) -> Row {
    // As BENCHMARKS.md's command: one queue (the client uses one).
    let row_opts = Opts {
        backend_queues: 1,
        ..opts.clone()
    };
    let image = work.join("seed-parallels.img");
    let backends = [
        variant("seed004-off", Some(image.clone()), "--prealloc off"),
        variant(
            "seed004-falloc",
            Some(image.clone()),
            "--prealloc on --prealloc-mode falloc",
        ),
    ];
    let data = parallels_fill::data(sizes.parallels_bytes as usize);
    let results = seed_runs(
        opts,
        "004",
        &backends,
        |b| parallels_fill::measure(b, &data, 1, &row_opts, vublk, work),
        |r| format!("{:.2} s", r.secs),
    );
    let _ = fs::remove_file(&image);
    let off = median(results[0].iter().map(|r| r.secs).collect());
    let falloc = median(results[1].iter().map(|r| r.secs).collect());
    let gain = off / falloc;
    Row {
        seed: "004",
        gain: "parallels expansion: `--prealloc on --prealloc-mode falloc` over `--prealloc off`",
        workload: format!(
            "fresh 64 GiB parallels image per run, {} as sequential 64 KiB writes at depth 1, \
             then FLUSH",
            size_text(sizes.parallels_bytes)
        ),
        measured: format!("{gain:.2}x ({falloc:.2} vs {off:.2} s)"),
        target: format!(">= {PARALLELS_MIN_SPEEDUP:.2}x"),
        fs_gain: None,
        fs_measured: "-".into(),
        ok: gain >= PARALLELS_MIN_SPEEDUP,
    }
}

/// Measure the seed rows, print the table (and write it to `--report`); true when every row
/// meets its target.
pub fn run(opts: &Opts, vublk: &Path, work: &Path) -> bool {
    fs::create_dir_all(work)
        .unwrap_or_else(|e| panic!("creating the work directory {}: {e}", work.display()));
    let sizes = Sizes::new(opts.smoke);
    let mut rows = vec![
        preallocation(opts, &sizes, vublk, work),
        detect_zeroes(opts, &sizes, vublk, work),
    ];
    rows.extend(compressed_cache(opts, &sizes, vublk, work));
    rows.push(parallels(opts, &sizes, vublk, work));

    let mut out = report::preamble(&format!(
        "Seed check: vublk {}; {} runs per configuration, configurations alternating run by \
         run{}; medians. Speed-up: the seed's configuration over its baseline (IOPS, or the \
         baseline's time over the seed's).{}",
        vublk.display(),
        opts.runs,
        if opts.rotate {
            " (their order rotated run by run)"
        } else {
            ""
        },
        if opts.smoke {
            " Smoke run: tiny sizes, the verdicts say nothing."
        } else {
            ""
        }
    ));
    let _ = writeln!(
        out,
        "| seed | gain | workload | measured | target | the file system's own gain | verdict |"
    );
    let _ = writeln!(out, "|---|---|---|---|---|---|---|");
    for r in &rows {
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} | {} |",
            r.seed,
            r.gain,
            r.workload,
            r.measured,
            r.target,
            r.fs_measured,
            r.verdict()
        );
    }
    let below = rows.iter().filter(|r| !r.ok).count();
    if below == 0 {
        let _ = writeln!(out, "\nseed check: every row meets its target");
    } else {
        let mut seeds: Vec<&str> = rows.iter().filter(|r| !r.ok).map(|r| r.seed).collect();
        seeds.dedup();
        let _ = writeln!(
            out,
            "\nseed check: {below} of {} rows below target ({} {})",
            rows.len(),
            if seeds.len() == 1 { "seed" } else { "seeds" },
            seeds.join(", ")
        );
    }
    report::emit(opts, &out);
    below == 0
}
