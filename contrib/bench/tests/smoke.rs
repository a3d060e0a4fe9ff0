//! Smoke runs of the benchmark (a few hundred I/Os per workload and backend, tiny sizes for
//! --seed-check): the tool, the client and the backends work together. Not a performance test.

use std::path::PathBuf;
use std::process::Command;

/// The vublk binary built by the same `cargo test --workspace` run (it sits beside the
/// directory of this test's executable).
fn vublk_binary() -> PathBuf {
    let exe = std::env::current_exe().expect("own path");
    let dir = exe
        .parent()
        .and_then(|d| d.parent())
        .expect("target directory");
    let p = dir.join("vublk");
    assert!(
        p.exists(),
        "{} is missing: run the suite with `cargo test --workspace`, which builds it (or \
         build it first: `cargo build -p vublk`)",
        p.display()
    );
    p
}

#[test]
fn smoke_run_reports_every_workload_for_every_backend() {
    let tmp = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("bench-smoke");
    std::fs::create_dir_all(&tmp).unwrap();
    let image = tmp.join("smoke.img");
    let mut backends = vec!["file", "vublk"];
    let have_qsd = Command::new("qemu-storage-daemon")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if have_qsd {
        backends.push("qsd");
    } else {
        println!("note: no qemu-storage-daemon; smoke run without it");
    }
    let out = Command::new(env!("CARGO_BIN_EXE_vublk-bench"))
        .args(["--smoke", "--size", "64M", "--image"])
        .arg(&image)
        .arg("--vublk")
        .arg(vublk_binary())
        .arg("--backends")
        .arg(backends.join(","))
        .output()
        .expect("run vublk-bench");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "vublk-bench failed:\n{stdout}\n{stderr}"
    );
    for wl in [
        "randread-4k-qd1",
        "randread-4k-qd32",
        "randwrite-4k-qd32",
        "seqwrite-64k-qd8",
        "seqwrite-1m-qd4",
        "randread-4k-2q-qd16",
    ] {
        for b in &backends {
            let row = stdout
                .lines()
                .find(|l| l.starts_with(&format!("| {wl} | {b} |")))
                .unwrap_or_else(|| panic!("no row for {wl} on {b}:\n{stdout}"));
            let iops: f64 = row.split('|').nth(3).unwrap().trim().parse().unwrap();
            assert!(iops > 0.0, "{wl} on {b}: no I/O completed: {row}");
        }
        assert!(
            stdout.contains(&format!("| {wl} | ")) && stdout.contains("vublk / file"),
            "{stdout}"
        );
    }
    let _ = std::fs::remove_dir_all(&tmp);
}

/// The verdict cell of a `--seed-check` table row (its last cell).
fn verdict(row: &str) -> &str {
    row.trim_end()
        .trim_end_matches('|')
        .rsplit('|')
        .next()
        .unwrap()
        .trim()
}

#[test]
fn seed_check_smoke_run_gives_every_seed_row_a_verdict() {
    let tmp = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("bench-seed-check");
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).unwrap();
    let report = tmp.join("seed-check.md");
    let out = Command::new(env!("CARGO_BIN_EXE_vublk-bench"))
        .args(["--seed-check", "--smoke", "--image"])
        .arg(tmp.join("unused.img"))
        .arg("--vublk")
        .arg(vublk_binary())
        .arg("--report")
        .arg(&report)
        .output()
        .expect("run vublk-bench");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    // 0: every row met its target, 1: one did not (smoke sizes decide nothing); anything
    // else is a check that did not run.
    let code = out.status.code();
    assert!(
        code == Some(0) || code == Some(1),
        "vublk-bench --seed-check failed ({:?}):\n{stdout}\n{stderr}",
        out.status
    );
    let mut below = false;
    for (seed, rows) in [("000", 1), ("002", 1), ("003", 2), ("004", 1)] {
        let found: Vec<&str> = stdout
            .lines()
            .filter(|l| l.starts_with(&format!("| {seed} | ")))
            .collect();
        assert_eq!(found.len(), rows, "rows of seed {seed}:\n{stdout}");
        for row in found {
            let v = verdict(row);
            assert!(
                v == "ok" || v.starts_with("BELOW TARGET"),
                "seed {seed}: no verdict in {row}"
            );
            below |= v != "ok";
        }
    }
    assert!(
        stdout.contains("the file system itself gains")
            || verdict(stdout.lines().find(|l| l.starts_with("| 000 |")).unwrap()) == "ok",
        "seed 000 below target without the file system's own gain:\n{stdout}"
    );
    assert_eq!(
        code == Some(1),
        below,
        "exit status and verdicts disagree:\n{stdout}"
    );
    let written = std::fs::read_to_string(&report).expect("the --report file");
    assert_eq!(written, stdout, "--report differs from what was printed");
    let _ = std::fs::remove_dir_all(&tmp);
}

#[test]
fn seed_check_refuses_options_it_would_ignore() {
    let out = Command::new(env!("CARGO_BIN_EXE_vublk-bench"))
        .args(["--seed-check", "--size", "1G"])
        .output()
        .expect("run vublk-bench");
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("'--seed-check' cannot be used with '--size"),
        "{stderr}"
    );
}

/// The null matrix on vublk's null disk and, where it is installed, QEMU's null-co: every
/// workload of the matrix gets a row, with the CPU and latency ratios.
#[test]
fn null_matrix_smoke_run_reports_every_workload() {
    let mut backends = vec!["vublk"];
    if have_qsd() {
        backends.push("qsd");
    }
    let stdout = bench_ok(&[
        "--smoke",
        "--null-matrix",
        "--image",
        "null:64M",
        "--backends",
        &backends.join(","),
    ]);
    for dir in ["randread", "randwrite"] {
        for q in [1, 2, 4] {
            for d in [1, 32, 128] {
                let wl = format!("| {dir}-4k-{q}q-qd{d} |");
                for b in &backends {
                    assert!(
                        stdout.contains(&format!("{wl} {b} |")),
                        "no row for {wl} {b}:\n{stdout}"
                    );
                }
            }
        }
    }
    assert!(stdout.contains("CPU per IO, vublk / QSD"), "{stdout}");
}

fn have_qsd() -> bool {
    Command::new("qemu-storage-daemon")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

/// vublk-bench with `args` and this build's vublk; panics unless it succeeds; its stdout.
fn bench_ok(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_vublk-bench"))
        .args(args)
        .arg("--vublk")
        .arg(vublk_binary())
        .output()
        .expect("run vublk-bench");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "vublk-bench {args:?} failed:\n{stdout}\n{stderr}"
    );
    stdout
}
