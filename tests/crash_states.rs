//! Power loss at any moment loses nothing flushed (docs/crash-consistency.md).
//!
//! Each test records a workload on vublk through the FUSE recorder, builds crash states from
//! the recording (every write that was not durable may be lost, in any subset, and torn at
//! 512-byte sectors), and checks every state: `qemu-img check` finds no corruption in any
//! qcow2 or parallels file, vublk opens the state read-write and serves it, and every sector
//! holds what the workload's log allows (what it saw flushed, or a later write to it).
//!
//! CI checks a few hundred states per row; the long run behind the table in the docs is
//! `VUBLK_CRASH_STATES=10000 VUBLK_CRASH_BATCHES=200 cargo test --release --test crash_states`.

mod common;

use std::path::{Path, PathBuf};
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

/// A row without hooks: `image` in the directory `setup` fills, served with `a`.
fn row(
    name: &'static str,
    image: &'static str,
    initial: Initial,
    a: &[&str],
    setup: impl Fn(&Path) + Sync + 'static,
) -> CrashRow {
    CrashRow {
        name,
        image,
        check_images: true,
        qemu_key: None,
        ctl: false,
        args: args(a),
        initial,
        tear_unit: 512,
        setup: Box::new(setup),
    }
}

/// A qcow2 row (`disk.qcow2`) whose hooks drive vublk through its control socket.
fn ctl_row(
    name: &'static str,
    initial: Initial,
    setup: impl Fn(&Path) + Sync + 'static,
) -> CrashRow {
    let mut r = row(name, "disk.qcow2", initial, &["--format", "qcow2"], setup);
    r.ctl = true;
    r
}

fn create(fmt: &'static str, name: &'static str) -> impl Fn(&Path) + Sync + 'static {
    move |d: &Path| vublk(&["create", "--format", fmt, "--size", "8M", name], d)
}

/// `disk.qcow2` over `base.raw`, which holds the pattern.
fn overlay_over_pattern(d: &Path) {
    overlay_over_pattern_with(d, &[]);
}

/// The same with extended L2 entries: 32 subclusters of 2 KiB per cluster, each allocated
/// on its own.
fn extl2_overlay_over_pattern(d: &Path) {
    overlay_over_pattern_with(d, &["-o", "extended_l2=on"]);
}

/// `disk.qcow2` over `base.raw` (the pattern), made by `qemu-img create` with `opts`.
fn overlay_over_pattern_with(d: &Path, opts: &[&str]) {
    std::fs::write(d.join("base.raw"), pattern_disk()).unwrap();
    let mut a = vec!["create", "-q", "-f", "qcow2"];
    a.extend(opts);
    a.extend(["-b", "base.raw", "-F", "raw", "disk.qcow2"]);
    qemu_img_in(d, &a);
}

/// Records the random mix (`batches` of it, set up further by `tune`) on `row` and checks up
/// to `budget` crash states.
fn record_and_check(
    row: &CrashRow,
    batches: usize,
    budget: usize,
    tag: &str,
    tune: impl FnOnce(&mut Mix),
) -> (Recording, WorkloadLog, Summary) {
    let dir = TestDir::new(&format!("crash-{}{tag}", row.name));
    let seed = 0xc0ffee ^ row.name.len() as u64;
    let (rec, model) = record_row(row, &dir, |c, rec, backend| {
        let mut mix = Mix::new(seed, batches, row.initial);
        tune(&mut mix);
        random_mix(c, rec, backend, mix)
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
fn run_row_with(row: CrashRow, tune: impl FnOnce(&mut Mix)) {
    if skip() {
        return;
    }
    let (rec, _, s) = record_and_check(
        &row,
        crash_batches(CI_BATCHES),
        crash_budget(CI_STATES),
        "",
        tune,
    );
    assert!(s.durability_points > 0, "nothing was ever synced");
    assert!(s.states >= s.crash_points, "{s:?}");
    assert!(
        s.failures.is_empty(),
        "{} failures, the first:\n{}",
        s.failed,
        s.failures.join("\n")
    );
    drop(rec);
}

fn run_row(row: CrashRow) {
    run_row_with(row, |_| {});
}

/// The control socket and the directory of the image the recorded vublk serves.
fn ctl_and_dir(b: &Backend) -> (PathBuf, PathBuf) {
    (
        b.socket.with_file_name("ctl.sock"),
        b.image.parent().unwrap().to_path_buf(),
    )
}

/// A hook that runs a control method and checks it succeeded.
fn ctl_hook<'a>(method: &'static str, a: Vec<String>) -> Hook<'a> {
    Box::new(move |b: &Backend| {
        let (sock, dir) = ctl_and_dir(b);
        let a: Vec<String> = a
            .iter()
            .map(|x| x.replace("{dir}", dir.to_str().unwrap()))
            .collect();
        let a: Vec<&str> = a.iter().map(String::as_str).collect();
        ctl_ok(&sock, method, &a);
        None
    })
}

/// A hook that waits for job `id` to conclude (completing it when it waits in `ready`).
fn finish_job<'a>(id: &'static str, complete: bool) -> Hook<'a> {
    Box::new(move |b: &Backend| {
        let (sock, _) = ctl_and_dir(b);
        if complete {
            wait_state(&sock, id, "ready");
            ctl_ok(&sock, "job-complete", &[id]);
        }
        let j = wait_job(&sock, id);
        assert!(j["error"].is_null(), "job {id}: {j}");
        None
    })
}

#[test]
fn raw() {
    run_row(row(
        "raw",
        "disk.raw",
        Initial::Zero,
        &["--format", "raw"],
        |d| create_sparse_image(&d.join("disk.raw"), CRASH_DISK),
    ));
}

/// The write cache off: every write completes durable.
#[test]
fn raw_writethrough() {
    run_row_with(
        row(
            "raw-writethrough",
            "disk.raw",
            Initial::Zero,
            &["--format", "raw", "--cache", "writethrough"],
            |d| create_sparse_image(&d.join("disk.raw"), CRASH_DISK),
        ),
        |m| m.writethrough = true,
    );
}

/// Through the host's page cache (FLUSH = fdatasync).
#[test]
fn raw_writeback() {
    run_row(row(
        "raw-writeback",
        "disk.raw",
        Initial::Zero,
        &["--format", "raw", "--cache", "writeback"],
        |d| create_sparse_image(&d.join("disk.raw"), CRASH_DISK),
    ));
}

#[test]
fn qcow2_fresh() {
    run_row(row(
        "qcow2-fresh",
        "disk.qcow2",
        Initial::Zero,
        &["--format", "qcow2"],
        create("qcow2", "disk.qcow2"),
    ));
}

#[test]
fn qcow2_overlay() {
    run_row(row(
        "qcow2-overlay",
        "disk.qcow2",
        Initial::Pattern,
        &["--format", "qcow2"],
        overlay_over_pattern,
    ));
}

/// An overlay with subclusters: single subclusters written through the ring (marked
/// allocated when their write completes) or the pool (partial ones merged), zeroes and
/// discards, over the backing file.
#[test]
fn qcow2_extl2_overlay() {
    run_row(row(
        "qcow2-extl2-overlay",
        "disk.qcow2",
        Initial::Pattern,
        &["--format", "qcow2"],
        extl2_overlay_over_pattern,
    ));
}

/// A stream job into an overlay with subclusters that holds some of them.
#[test]
fn qcow2_extl2_stream() {
    run_row_with(
        ctl_row(
            "qcow2-extl2-stream",
            Initial::Pattern,
            extl2_overlay_over_pattern,
        ),
        stream_tune,
    );
}

/// Zero clusters: all-zero writes turned into zero clusters, write-zeroes and discards
/// that deallocate, over a backing file they must not uncover.
#[test]
fn qcow2_zero_clusters() {
    run_row(row(
        "qcow2-zero",
        "disk.qcow2",
        Initial::Pattern,
        &[
            "--format",
            "qcow2",
            "--detect-zeroes",
            "unmap",
            "--discard",
            "unmap",
        ],
        overlay_over_pattern,
    ));
}

/// Compressed clusters: an image converted with -c, overwritten, with the compressed-write
/// cache storing whole clusters compressed.
#[test]
fn qcow2_compressed() {
    run_row_with(
        row(
            "qcow2-compressed",
            "disk.qcow2",
            Initial::Pattern,
            &["--format", "qcow2", "--compress-writes", "on"],
            |d| {
                std::fs::write(d.join("base.raw"), pattern_disk()).unwrap();
                qemu_img_in(
                    d,
                    &[
                        "convert",
                        "-q",
                        "-c",
                        "-f",
                        "raw",
                        "-O",
                        "qcow2",
                        "base.raw",
                        "disk.qcow2",
                    ],
                );
                std::fs::remove_file(d.join("base.raw")).unwrap();
            },
        ),
        |m| m.big_writes = true,
    );
}

/// The file grows ahead of the writes, from the background preallocation thread.
#[test]
fn qcow2_prealloc() {
    run_row(row(
        "qcow2-prealloc",
        "disk.qcow2",
        Initial::Zero,
        &[
            "--format",
            "qcow2",
            "--prealloc",
            "on",
            "--prealloc-size",
            "1M",
        ],
        create("qcow2", "disk.qcow2"),
    ));
}

/// A persistent dirty bitmap in the image, recording every write.
#[test]
fn qcow2_bitmap() {
    run_row(row(
        "qcow2-bitmap",
        "disk.qcow2",
        Initial::Zero,
        &["--format", "qcow2", "--persistent-bitmap", "b0:65536"],
        create("qcow2", "disk.qcow2"),
    ));
}

/// Grown online from 8 to 16 MiB halfway through.
#[test]
fn qcow2_resize() {
    let r = ctl_row("qcow2-resize", Initial::Zero, create("qcow2", "disk.qcow2"));
    run_row_with(r, |m| {
        let at = m.batches / 2;
        m.hooks.push((
            at,
            Box::new(|b: &Backend| {
                let (sock, _) = ctl_and_dir(b);
                ctl_ok(&sock, "resize", &["16M"]);
                Some(2 * CRASH_DISK)
            }),
        ));
    });
}

/// An external snapshot a third of the way through: the rest goes to the overlay.
#[test]
fn qcow2_snapshot() {
    let r = ctl_row(
        "qcow2-snapshot",
        Initial::Zero,
        create("qcow2", "disk.qcow2"),
    );
    run_row_with(r, |m| {
        let at = m.batches / 3;
        m.hooks.push((
            at,
            ctl_hook("snapshot", args(&["--overlay", "{dir}/snap.qcow2"])),
        ));
    });
}

fn stream_row() -> CrashRow {
    ctl_row("qcow2-stream", Initial::Pattern, overlay_over_pattern)
}

/// A job started with `method` a third of the way through, waited for (completed first
/// when `complete`) two thirds of the way.
fn job_hooks(m: &mut Mix, method: &'static str, a: &[&str], id: &'static str, complete: bool) {
    let (start, end) = (m.batches / 3, 2 * m.batches / 3);
    let mut a = args(a);
    a.extend(args(&["--id", id]));
    m.hooks.push((start, ctl_hook(method, a)));
    m.hooks.push((end, finish_job(id, complete)));
}

fn stream_tune(m: &mut Mix) {
    job_hooks(m, "stream", &["--speed", "8M"], "s0", false);
}

/// A stream job copies the backing file into the overlay while the guest writes, then
/// drops the backing link.
#[test]
fn qcow2_stream() {
    run_row_with(stream_row(), stream_tune);
}

/// A commit job merges the overlay into its qcow2 base while the guest writes, and
/// switches the guest to the base.
#[test]
fn qcow2_commit() {
    let r = ctl_row("qcow2-commit", Initial::Pattern, |d| {
        std::fs::write(d.join("base.raw"), pattern_disk()).unwrap();
        qemu_img_in(
            d,
            &[
                "convert",
                "-q",
                "-f",
                "raw",
                "-O",
                "qcow2",
                "base.raw",
                "base.qcow2",
            ],
        );
        std::fs::remove_file(d.join("base.raw")).unwrap();
        qemu_img_in(
            d,
            &[
                "create",
                "-q",
                "-f",
                "qcow2",
                "-b",
                "base.qcow2",
                "-F",
                "qcow2",
                "disk.qcow2",
            ],
        );
    });
    run_row_with(r, |m| {
        job_hooks(m, "commit", &["--speed", "8M"], "c0", false)
    });
}

/// A mirror job copies the disk to a new qcow2 image while the guest writes, and on
/// job-complete switches the guest to it.
#[test]
fn qcow2_mirror() {
    let r = ctl_row("qcow2-mirror", Initial::Zero, create("qcow2", "disk.qcow2"));
    run_row_with(r, |m| {
        let target = ["--target", "{dir}/mirror.qcow2", "--format", "qcow2"];
        job_hooks(m, "mirror", &target, "m0", true)
    });
}

fn key_file() -> PathBuf {
    let p = PathBuf::from(format!("/dev/shm/vublk-crash-key-{}", std::process::id()));
    std::fs::write(&p, "crash-test passphrase").unwrap();
    p
}

fn qcow2_luks_row() -> CrashRow {
    let key = key_file();
    let secret: &'static str = Box::leak(format!("file:{}", key.display()).into_boxed_str());
    let mut r = row(
        "qcow2-luks",
        "disk.qcow2",
        Initial::Zero,
        &["--format", "qcow2", "--key-secret", secret],
        move |d| {
            vublk(
                &[
                    "create",
                    "--format",
                    "qcow2",
                    "--size",
                    "8M",
                    "--encrypt",
                    "luks1",
                    "--key-secret",
                    secret,
                    "--kdf-iterations",
                    "1000",
                    "disk.qcow2",
                ],
                d,
            )
        },
    );
    r.qemu_key = Some(key);
    r
}

/// A qcow2 image encrypted as QEMU's encrypt.format=luks.
#[test]
fn qcow2_luks() {
    run_row(qcow2_luks_row());
}

/// A LUKS1 volume over raw data (what is never written reads as anything).
#[test]
fn luks() {
    let key = key_file();
    let secret: &'static str = Box::leak(format!("file:{}", key.display()).into_boxed_str());
    run_row_with(
        row(
            "luks",
            "disk.luks",
            Initial::Any,
            &["--format", "luks", "--key-secret", secret],
            move |d| {
                vublk(
                    &[
                        "create",
                        "--format",
                        "luks",
                        "--size",
                        "8M",
                        "--encrypt",
                        "luks1",
                        "--key-secret",
                        secret,
                        "--kdf-iterations",
                        "1000",
                        "disk.luks",
                    ],
                    d,
                )
            },
        ),
        |m| m.discard_reads_anything = true,
    );
}

fn parallels_row() -> CrashRow {
    row(
        "parallels",
        "disk.hds",
        Initial::Zero,
        &["--format", "parallels"],
        create("parallels", "disk.hds"),
    )
}

#[test]
fn parallels() {
    run_row(parallels_row());
}

/// Discards free clusters (trim), which later writes reuse.
#[test]
fn parallels_trim() {
    run_row(row(
        "parallels-trim",
        "disk.hds",
        Initial::Zero,
        &["--format", "parallels", "--discard", "unmap"],
        create("parallels", "disk.hds"),
    ));
}

/// A case this test found, kept: the recording of the build that had the bug must still
/// fail the oracles, and the same workload on this build must pass them.
fn regression(
    row: CrashRow,
    tune: impl FnOnce(&mut Mix),
    batches: usize,
    recorded: &str,
    symptom: &str,
) {
    if skip() {
        return;
    }
    let (_, model, now) = record_and_check(&row, batches, CI_STATES, "-regression", tune);
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

/// Found by this test: vublk grew a parallels file (the expansion preallocation) and wrote
/// a BAT entry pointing into the new space before the growth was durable; a power cut that
/// kept the BAT write but not the growth left clusters outside the file (qemu-img check:
/// "cluster N is outside image"). The growth is synced now.
#[test]
fn parallels_bat_waits_for_the_file_growth() {
    regression(
        parallels_row(),
        |_| {},
        1,
        "parallels-bat-before-growth.rec",
        "is outside image",
    );
}

/// Found by this test: the last step of a stream job rewrote the header's first cluster in
/// one 536-byte write to drop the backing link; a power cut that tore it (the second sector
/// new, the first old) left the old offset pointing at a zeroed name, and the image named a
/// backing file of NUL bytes. Dropping the link now changes only the first sector.
#[test]
fn qcow2_stream_drops_the_backing_link_in_one_sector() {
    regression(
        stream_row(),
        stream_tune,
        3,
        "qcow2-stream-torn-header.rec",
        "unexpected NUL byte",
    );
}

/// Found by this test: in an encrypted qcow2 image a new cluster's L2 entry could become
/// durable before the guest data written into it; fresh host space decrypts to noise, so
/// a power cut showed noise where the guest had zeroes (its write was not flushed, but
/// the old content must stay). The data is synced before such an entry is written now.
#[test]
fn qcow2_luks_new_cluster_data_before_its_l2_entry() {
    regression(
        qcow2_luks_row(),
        |_| {},
        3,
        "qcow2-luks-l2-before-data.rec",
        "hold what the log does not allow",
    );
}
