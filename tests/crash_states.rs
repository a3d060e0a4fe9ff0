//! Power loss at any moment loses nothing flushed (docs/crash-consistency.md).
//!
//! Each test records a workload on vublk through the FUSE recorder, builds crash states from
//! the recording (every write that was not durable may be lost, in any subset, and torn at
//! 512-byte sectors), and checks every state: `qemu-img check` finds no corruption, vublk
//! opens it read-write and serves it, and every sector holds what the workload's log allows
//! (what it saw flushed, or a later write to it).
//!
//! CI checks a few hundred states per row; the long run behind the table in the docs is
//! `VUBLK_CRASH_STATES=10000 VUBLK_CRASH_BATCHES=200 cargo test --release --test crash_states`.

mod common;

use std::path::Path;
use std::process::Command;

use common::*;
use vublk_crash::Recording;

const CI_STATES: usize = 300;
const CI_BATCHES: usize = 40;

fn vublk(args: &[&str], dir: &Path) {
    let out = Command::new(env!("CARGO_BIN_EXE_vublk"))
        .args(args)
        .current_dir(dir)
        .output()
        .expect("run vublk");
    assert!(
        out.status.success(),
        "vublk {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn qemu_img_in(dir: &Path, args: &[&str]) {
    let out = Command::new("qemu-img")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("run qemu-img");
    assert!(
        out.status.success(),
        "qemu-img {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn args(a: &[&str]) -> Vec<String> {
    a.iter().map(|s| s.to_string()).collect()
}

/// Records the random mix (`batches` of it) on `row` and checks up to `budget` crash states.
fn record_and_check(
    row: &CrashRow,
    batches: usize,
    budget: usize,
    tag: &str,
) -> (Recording, WorkloadLog, Summary) {
    let dir = TestDir::new(&format!("crash-{}{tag}", row.name));
    let seed = 0xc0ffee ^ row.name.len() as u64;
    let (rec, model) = record_row(row, &dir, |c, rec, _| {
        random_mix(c, rec, seed, batches, row.initial_pattern)
    });
    eprintln!(
        "{}: {} requests ({} with FUA), {} flushes, {} records",
        row.name,
        model.requests,
        model.fua,
        model.flushes,
        rec.records.len()
    );
    if let Ok(d) = std::env::var("VUBLK_CRASH_SAVE_DIR") {
        let p = Path::new(&d).join(format!("{}.rec", row.name));
        rec.save(&p).expect("save the recording");
        eprintln!("saved {}", p.display());
    }
    let s = check_row(row, &rec, &model, budget);
    (rec, model, s)
}

/// Whether this machine can run the recorder (a FUSE mount, as root); else the test skips
/// (and fails under CI).
fn skip() -> bool {
    if skip_unless_vublk("crash states need vublk") {
        return true;
    }
    if !Path::new("/dev/fuse").exists() {
        return skip_or_fail::<()>("no /dev/fuse: the recorder is a FUSE file system").is_none();
    }
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return skip_or_fail::<()>("the recorder mounts FUSE directly, which needs root").is_none();
    }
    false
}

/// Records the random mix on `row` and checks its crash states; fails on any failure.
fn run_row(row: CrashRow) {
    if skip() {
        return;
    }
    let (_, _, s) = record_and_check(&row, crash_batches(CI_BATCHES), crash_budget(CI_STATES), "");
    assert!(s.durability_points > 0, "nothing was ever synced");
    assert!(s.states >= s.crash_points, "{s:?}");
    assert!(
        s.failures.is_empty(),
        "{} failures, the first:\n{}",
        s.failed,
        s.failures.join("\n")
    );
}

/// A case this test found, kept: the recording of the build that had the bug must still
/// fail the oracles, and the same workload on this build must pass them, every state of it.
fn regression(row: CrashRow, batches: usize, recorded: &str, symptom: &str) {
    if skip() {
        return;
    }
    let (_, model, now) = record_and_check(&row, batches, CI_STATES, "-regression");
    assert!(
        now.failures.is_empty(),
        "{} failures now:\n{}",
        now.failed,
        now.failures.join("\n")
    );
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/crash-cases")
        .join(recorded);
    let old = Recording::load(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let then = check_row(&row, &old, &model, CI_STATES);
    assert!(
        then.failed > 0 && then.failures.iter().all(|f| f.contains(symptom)),
        "the recording of the faulty build must fail with {symptom:?}: {then:?}"
    );
}

fn parallels_row() -> CrashRow {
    CrashRow {
        name: "parallels",
        image: "disk.hds",
        check_format: Some("parallels"),
        args: args(&["--format", "parallels"]),
        initial_pattern: false,
        setup: Box::new(|d| {
            vublk(
                &[
                    "create",
                    "--format",
                    "parallels",
                    "--size",
                    "8M",
                    "disk.hds",
                ],
                d,
            )
        }),
    }
}

/// Found by this test: vublk grew a parallels file (the expansion preallocation) and wrote
/// a BAT entry pointing into the new space before the growth was durable; a power cut that
/// kept the BAT write but not the growth left clusters outside the file (qemu-img check:
/// "cluster N is outside image"). The growth is synced now.
#[test]
fn parallels_bat_waits_for_the_file_growth() {
    regression(
        parallels_row(),
        1,
        "parallels-bat-before-growth.rec",
        "is outside image",
    );
}

#[test]
fn raw() {
    run_row(CrashRow {
        name: "raw",
        image: "disk.raw",
        check_format: None,
        args: args(&["--format", "raw"]),
        initial_pattern: false,
        setup: Box::new(|d| create_sparse_image(&d.join("disk.raw"), CRASH_DISK)),
    });
}

#[test]
fn qcow2_fresh() {
    run_row(CrashRow {
        name: "qcow2-fresh",
        image: "disk.qcow2",
        check_format: Some("qcow2"),
        args: args(&["--format", "qcow2"]),
        initial_pattern: false,
        setup: Box::new(|d| {
            vublk(
                &["create", "--format", "qcow2", "--size", "8M", "disk.qcow2"],
                d,
            )
        }),
    });
}

#[test]
fn qcow2_overlay() {
    run_row(CrashRow {
        name: "qcow2-overlay",
        image: "disk.qcow2",
        check_format: Some("qcow2"),
        args: args(&["--format", "qcow2"]),
        initial_pattern: true,
        setup: Box::new(|d| {
            std::fs::write(d.join("base.raw"), pattern_disk()).unwrap();
            qemu_img_in(
                d,
                &[
                    "create",
                    "-q",
                    "-f",
                    "qcow2",
                    "-b",
                    "base.raw",
                    "-F",
                    "raw",
                    "disk.qcow2",
                ],
            );
        }),
    });
}

#[test]
fn parallels() {
    run_row(parallels_row());
}
