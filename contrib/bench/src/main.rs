//! vublk-bench: the same libblkio client, the same image file, three backends side by side:
//! (a) the file itself through libblkio's io_uring driver with O_DIRECT (the limit), (b) vublk,
//! (c) qemu-storage-daemon. Backends alternate run by run; medians and ratios are reported.
//!
//! This file only picks the mode. The map:
//! - `args`: the command line (clap).
//! - `workloads`: the workload sets and the default mode, every workload on every backend.
//! - `backends`: `--backends` and `--variant`; `server`: starting and stopping vublk and
//!   qemu-storage-daemon; `images`: the images they serve.
//! - `client`: the libblkio client, its timed runs and what they measure; `procstat`: a
//!   process's memory, CPU time and writes.
//! - `alternate`: runs alternating round by round; `report`: medians, the Markdown report,
//!   `--report`.
//! - `modes`: the other modes, one a module (`--zero-scan`, `--zero-fill`, `--fresh-file`,
//!   `--compress-fill`, `--parallels-fill`, `--hop`, `--seed-check`, `--backup`, `--stream`, `--commit`, `--mirror`).

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

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;

use args::Opts;
use backends::resolve_backends;

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
    // Sockets and logs go beside the image; a null disk's (`null:SIZE`) to target/bench.
    let work = match opts.image.parent() {
        _ if opts.image.to_str().is_some_and(|s| s.starts_with("null:")) => {
            let w = PathBuf::from("target/bench");
            std::fs::create_dir_all(&w).expect("target/bench");
            w
        }
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
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
    if opts.xts_speed {
        modes::xts_speed::run();
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
    if opts.backup {
        modes::backup::run(&opts, &backends, &vublk, &work);
        return ExitCode::SUCCESS;
    }
    if opts.stream {
        modes::stream::run(&opts, &backends, &vublk, &work, modes::stream::Job::Stream);
        return ExitCode::SUCCESS;
    }
    if opts.mirror {
        modes::stream::run(&opts, &backends, &vublk, &work, modes::stream::Job::Mirror);
        return ExitCode::SUCCESS;
    }
    if opts.commit {
        modes::stream::run(&opts, &backends, &vublk, &work, modes::stream::Job::Commit);
        return ExitCode::SUCCESS;
    }
    if opts.zero_fill {
        modes::zero_fill::run(&opts, &backends, &vublk, &work);
        return ExitCode::SUCCESS;
    }
    if opts.compress_fill {
        modes::compress_fill::run(&opts, &backends, &vublk, &work);
        return ExitCode::SUCCESS;
    }
    if opts.parallels_fill {
        modes::parallels_fill::run(&opts, &backends, &vublk, &work);
        return ExitCode::SUCCESS;
    }
    workloads::run(&opts, &workloads, &backends, &vublk, &work);
    ExitCode::SUCCESS
}
