//! A smoke run of the benchmark (a few hundred I/Os per workload and backend): the tool, the
//! client and the backends work together. Not a performance test.

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
        "{} is missing: run the suite with `cargo test --workspace`, which builds it",
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
