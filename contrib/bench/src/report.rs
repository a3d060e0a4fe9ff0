//! What the runs leave: medians, the Markdown report every mode prints (the machine first,
//! then how it measured, then its tables) and `--report`'s copy of it, and the workloads'
//! tables (every backend, the ratios between the three, each vublk variant against vublk,
//! the servers' start-up and memory).

use std::fmt::Write as _;
use std::fs;

use crate::args::Opts;
use crate::backends::{Backend, BackendKind};
use crate::client::RunResult;
use crate::workloads::Workload;

/// The median of `v`; NaN when it is empty (a cell with no value).
pub fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// "N x CPU model, Linux RELEASE".
fn machine_description() -> String {
    let cpu = fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines().find_map(|l| {
                l.strip_prefix("model name")
                    .map(|r| r.trim_start_matches([' ', '\t', ':']).to_owned())
            })
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let ncpu = std::thread::available_parallelism().map_or(0, |n| n.get());
    let kernel = fs::read_to_string("/proc/sys/kernel/osrelease")
        .unwrap_or_default()
        .trim()
        .to_owned();
    format!("{ncpu} x {cpu}, Linux {kernel}")
}

/// The median of `f` over `rs`.
pub fn median_by<T>(rs: &[T], f: impl Fn(&T) -> f64) -> f64 {
    median(rs.iter().map(f).collect())
}

/// The head of every report: an empty line, the machine, `how` (what was measured, how
/// often, what the columns mean), an empty line.
pub fn preamble(how: &str) -> String {
    format!("\nMachine: {}\n{how}\n\n", machine_description())
}

/// A report of one table: the preamble, the table's `header` and `align` lines, its `rows`
/// (each ending in a newline).
pub fn table(how: &str, header: &str, align: &str, rows: &str) -> String {
    format!("{}{header}\n{align}\n{rows}", preamble(how))
}

/// Print `report`, and write it to `--report` when given.
pub fn emit(opts: &Opts, report: &str) {
    print!("{report}");
    if let Some(p) = &opts.report {
        fs::write(p, report).unwrap_or_else(|e| panic!("writing {}: {e}", p.display()));
    }
}

/// The workloads' report from `results[workload][backend]` (every run of that pair).
/// A run whose backend CPU per request is more than this many times the median of the same
/// backend on the same workload is flagged.
pub const CPU_OUTLIER: f64 = 3.0;

/// The flagged runs: "workload backend run N: X us/IO, median Y".
pub fn cpu_outliers(
    workloads: &[Workload],
    backends: &[Backend],
    results: &[Vec<Vec<RunResult>>],
) -> Vec<String> {
    let mut out = Vec::new();
    for (wi, wl) in workloads.iter().enumerate() {
        for (bi, b) in backends.iter().enumerate() {
            let rs = &results[wi][bi];
            let m = median_by(rs, |r| r.cpu_us_per_io().unwrap_or(f64::NAN));
            if rs.len() < 3 || m.is_nan() {
                continue;
            }
            for (k, r) in rs.iter().enumerate() {
                // Half a microsecond of slack: tiny medians wobble by more than 3x.
                match r.cpu_us_per_io() {
                    Some(c) if c > CPU_OUTLIER * m && c > m + 0.5 => out.push(format!(
                        "{} {} run {}: {c:.2} us/IO, median {m:.2} ({:.0} IOPS)",
                        wl.name,
                        b.name(),
                        k + 1,
                        r.iops()
                    )),
                    _ => {}
                }
            }
        }
    }
    out
}

pub fn workloads_report(
    opts: &Opts,
    workloads: &[Workload],
    backends: &[Backend],
    results: &[Vec<Vec<RunResult>>],
) -> String {
    let what = if opts.fresh_qcow2 {
        "fresh qcow2 images of this size made before every run"
    } else {
        "fully written"
    };
    let mut out = preamble(&format!(
        "Image: {} ({} MiB, {what}), {} runs x {} s per backend and workload, \
         backends alternating{}; medians.",
        opts.image.display(),
        opts.size >> 20,
        opts.runs,
        opts.seconds,
        if opts.rotate {
            " (their order rotated run by run)"
        } else {
            ""
        }
    ));
    let _ = writeln!(
        out,
        "| workload | backend | IOPS | MB/s | p50 us | p99 us | backend CPU us/IO | client CPU % |"
    );
    let _ = writeln!(out, "|---|---|---:|---:|---:|---:|---:|---:|");
    for (wi, wl) in workloads.iter().enumerate() {
        for (bi, kind) in backends.iter().enumerate() {
            let rs = &results[wi][bi];
            let cpu = median_by(rs, |r| r.cpu_us_per_io().unwrap_or(f64::NAN));
            let _ = writeln!(
                out,
                "| {} | {} | {:.0} | {:.1} | {:.1} | {:.1} | {} | {:.0} |",
                wl.name,
                kind.name(),
                median_by(rs, |r| r.iops()),
                median_by(rs, |r| r.mbps()),
                median_by(rs, |r| r.p50_us),
                median_by(rs, |r| r.p99_us),
                if cpu.is_nan() {
                    "-".into()
                } else {
                    format!("{cpu:.2}")
                },
                median_by(rs, |r| r.client_cpu_ns as f64 / 1e9 / r.secs * 100.0),
            );
        }
    }
    let idx = |name: &str| backends.iter().position(|b| b.name == name);
    if let Some(v) = idx("vublk") {
        let _ = writeln!(
            out,
            "\n| workload | vublk / file | vublk / QSD | QSD / file | CPU per IO, vublk / QSD | p50, vublk / QSD |"
        );
        let _ = writeln!(out, "|---|---:|---:|---:|---:|---:|");
        for (wi, wl) in workloads.iter().enumerate() {
            let of = |bi: usize, f: fn(&RunResult) -> f64| median_by(&results[wi][bi], f);
            let ratio = |a: Option<usize>, b: Option<usize>, f: fn(&RunResult) -> f64| match (a, b)
            {
                (Some(a), Some(b)) if of(b, f) > 0.0 && !of(a, f).is_nan() => {
                    format!("{:.2}", of(a, f) / of(b, f))
                }
                _ => "-".into(),
            };
            let iops: fn(&RunResult) -> f64 = |r| r.iops();
            let cpu: fn(&RunResult) -> f64 = |r| r.cpu_us_per_io().unwrap_or(f64::NAN);
            let p50: fn(&RunResult) -> f64 = |r| r.p50_us;
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} | {} | {} |",
                wl.name,
                ratio(Some(v), idx("file"), iops),
                ratio(Some(v), idx("qsd"), iops),
                ratio(idx("qsd"), idx("file"), iops),
                ratio(Some(v), idx("qsd"), cpu),
                ratio(Some(v), idx("qsd"), p50),
            );
        }
    }
    // Runs whose backend CPU per request is far above the same backend's median on the same
    // workload: a backend that fell into a bad state (a poll loop, a wake-up storm).
    let outliers = cpu_outliers(workloads, backends, results);
    if !outliers.is_empty() {
        let _ = writeln!(
            out,
            "\nCPU OUTLIERS (backend CPU per IO over {CPU_OUTLIER}x its median on the workload):"
        );
        for o in outliers {
            let _ = writeln!(out, "- {o}");
        }
    }
    // Variants of vublk against plain vublk (e.g. detect-zeroes on non-zero data).
    if let Some(v) = idx("vublk") {
        for (bi, b) in backends.iter().enumerate() {
            if b.kind != BackendKind::Vublk || b.name == "vublk" {
                continue;
            }
            let _ = writeln!(out, "\n| workload | {} / vublk (IOPS) |", b.name);
            let _ = writeln!(out, "|---|---:|");
            for (wi, wl) in workloads.iter().enumerate() {
                let a = median_by(&results[wi][bi], |r| r.iops());
                let base = median_by(&results[wi][v], |r| r.iops());
                let _ = writeln!(out, "| {} | {:.3} |", wl.name, a / base);
            }
        }
    }
    // Start-up and memory of the vhost-user backends.
    let _ = writeln!(
        out,
        "\n| backend | start-up to listening (ms) | RSS idle (MiB) | RSS under load, max (MiB) |"
    );
    let _ = writeln!(out, "|---|---:|---:|---:|");
    for (bi, kind) in backends.iter().enumerate() {
        if kind.kind == BackendKind::File {
            continue;
        }
        let all: Vec<&RunResult> = results.iter().flat_map(|w| w[bi].iter()).collect();
        let startup = median(
            all.iter()
                .map(|r| r.startup.as_secs_f64() * 1000.0)
                .collect(),
        );
        let idle = median(
            all.iter()
                .filter_map(|r| r.rss_idle_kib)
                .map(|k| k as f64 / 1024.0)
                .collect(),
        );
        let load = all
            .iter()
            .filter_map(|r| r.rss_load_kib)
            .max()
            .map_or(f64::NAN, |k| k as f64 / 1024.0);
        let _ = writeln!(
            out,
            "| {} | {startup:.1} | {idle:.1} | {load:.1} |",
            kind.name()
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backends::{Backend, BackendKind};
    use crate::workloads::{Dir, Pattern, Workload};

    #[test]
    fn a_run_far_above_its_median_cpu_is_flagged() {
        let wl = Workload {
            name: "randread-4k-1q-qd1".into(),
            pattern: Pattern::Random,
            dir: Dir::Read,
            bs: 4096,
            depth: 1,
            queues: 1,
        };
        let b = Backend {
            name: "vublk".into(),
            kind: BackendKind::Vublk,
            extra: Vec::new(),
            image: None,
            binary: None,
        };
        let run = |ios: u64, cpu_us: u64| RunResult {
            ios,
            secs: 1.0,
            backend_cpu_ns: Some(cpu_us * 1000),
            ..RunResult::default()
        };
        // 77 us/IO three times, then 417 us/IO at a fifth of the rate (the case of issue 36).
        let results = vec![vec![vec![
            run(7400, 7400 * 77),
            run(1363, 1363 * 417),
            run(7300, 7300 * 77),
            run(7500, 7500 * 78),
        ]]];
        let flagged = cpu_outliers(
            std::slice::from_ref(&wl),
            std::slice::from_ref(&b),
            &results,
        );
        assert_eq!(flagged.len(), 1, "{flagged:?}");
        assert!(flagged[0].contains("run 2: 417.00 us/IO"), "{flagged:?}");
        // Tiny numbers that wobble are not.
        let results = vec![vec![vec![run(1000, 200), run(1000, 700), run(1000, 250)]]];
        assert!(cpu_outliers(&[wl], &[b], &results).is_empty());
    }
}
