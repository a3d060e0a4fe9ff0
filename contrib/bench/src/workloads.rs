//! The workloads (the default mode): the list of them (`--list`), the ones a run measures
//! (`--workloads`, `--scaling`), and the runs themselves, every workload on every backend,
//! backends alternating, then the report.

use std::path::Path;

use crate::alternate::Order;
use crate::args::Opts;
use crate::backends::Backend;
use crate::client::{run_once, RunResult};
use crate::images::prepare_image;
use crate::report;

/// Where each request goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pattern {
    Random,
    /// Each request after the last, wrapping at the end of the image.
    Sequential,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dir {
    Read,
    Write,
}

/// One workload: `queues` queues, each keeping `depth` requests of `bs` bytes in flight.
#[derive(Clone, Debug)]
pub struct Workload {
    pub name: String,
    pub pattern: Pattern,
    pub dir: Dir,
    pub bs: usize,
    pub depth: usize,
    pub queues: usize,
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

/// The default set.
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
pub fn extra_workloads() -> Vec<Workload> {
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

/// `--scaling`: 4k random reads at depth 16 per queue, on 1, 2 and 4 queues.
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

/// `--null-matrix`: the backend's own cost on a null disk (`--image null:SIZE`): 4k random
/// reads and writes at depth 1, 32 and 128 per queue on 1, 2 and 4 queues.
fn null_matrix() -> Vec<Workload> {
    let mut out = Vec::new();
    for (dir, name) in [(Dir::Read, "randread"), (Dir::Write, "randwrite")] {
        for q in [1, 2, 4] {
            for d in [1, 32, 128] {
                out.push(wl(
                    &format!("{name}-4k-{q}q-qd{d}"),
                    Pattern::Random,
                    dir,
                    4096,
                    d,
                    q,
                ));
            }
        }
    }
    out
}

/// Every workload: the standard set, the scaling set, the extra ones.
fn all_workloads() -> Vec<Workload> {
    standard_workloads()
        .into_iter()
        .chain(scaling_workloads())
        .chain(extra_workloads())
        .chain(null_matrix())
        .collect()
}

/// `--list`: every workload, one a line.
pub fn print_list() {
    for w in all_workloads() {
        println!(
            "{:28} {:?} {:?} bs={} depth={} queues={}",
            w.name, w.pattern, w.dir, w.bs, w.depth, w.queues
        );
    }
}

/// The workloads `--workloads` names, in its order; without it the standard set, and the
/// scaling set too with `--scaling`; with `--null-matrix`, the null disk's matrix. Panics on
/// a name that is not a workload.
pub fn selected(opts: &Opts) -> Vec<Workload> {
    if opts.null_matrix && opts.workloads.is_empty() {
        return null_matrix();
    }
    if opts.workloads.is_empty() {
        let mut workloads = standard_workloads();
        if opts.scaling {
            workloads.extend(scaling_workloads());
        }
        return workloads;
    }
    let all = all_workloads();
    opts.workloads
        .iter()
        .map(|n| {
            all.iter()
                .find(|w| &w.name == n)
                .unwrap_or_else(|| panic!("unknown workload {n} (see --list)"))
                .clone()
        })
        .collect()
}

/// Measure every workload on every backend, `--runs` rounds (each round every workload, and
/// in it every backend in `--rotate`'s order), print each run's line to stderr, then print
/// the report.
pub fn run(opts: &Opts, workloads: &[Workload], backends: &[Backend], vublk: &Path, work: &Path) {
    // Only fresh qcow2 images: the raw benchmark image is not needed (and may be large).
    let only_fresh = opts.fresh_qcow2
        && backends.iter().all(|b| {
            b.image
                .as_ref()
                .is_some_and(|i| i.extension().is_some_and(|e| e == "qcow2"))
        });
    // A null disk (`--image null:SIZE`) has no file to fill.
    let null = opts.image.to_str().is_some_and(|s| s.starts_with("null:"));
    if null {
        assert!(
            backends
                .iter()
                .all(|b| b.kind != crate::backends::BackendKind::File),
            "the file backend has no null disk: --backends vublk,qsd with --image null:SIZE"
        );
    }
    if !only_fresh && !null {
        prepare_image(&opts.image, opts.size);
    }

    // results[workload][backend] = runs
    let mut results: Vec<Vec<Vec<RunResult>>> =
        vec![vec![Vec::new(); backends.len()]; workloads.len()];
    for run in 0..opts.runs {
        for (wi, wl) in workloads.iter().enumerate() {
            for bi in Order::of(opts).round(run, backends.len()) {
                let backend = &backends[bi];
                let r = run_once(backend, wl, opts, vublk, work);
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
        opts,
        &report::workloads_report(opts, workloads, backends, &results),
    );
}
