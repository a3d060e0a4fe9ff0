//! Power loss under a guest file system (docs/crash-consistency.md): a Linux guest (QEMU,
//! TCG) runs a file-system workload on ext4 on a vublk disk recorded by the FUSE recorder
//! (`vublk_crash`), and every crash state built from the recording is checked:
//!
//! - `qemu-img check` finds no corruption (qcow2), vublk opens the state read-write and
//!   serves it, and what it serves is what `qemu-img convert` reads from the image;
//! - the file system is clean after journal replay: `e2fsck -E journal_only -y`, then
//!   `e2fsck -fn` finds nothing (on the raw data, no loop mount);
//! - every file the guest made durable (fsync or fdatasync of the file, fsync of the
//!   directory for its name) is there, read with `debugfs rdump`, and each of its sectors
//!   holds what the guest last made durable there or a later write to it.
//!
//! The workload is `contrib/guest/crash-fs.c` (create, append, overwrite, fsync, rename over,
//! unlink, a database-like fdatasync loop). It prints each operation before it starts, and
//! after each durability point waits for the host to mark the recording and answer, so each
//! mark sits exactly between the operations before a durability point and those after it.
//!
//! Environment: `VUBLK_E2E_REQUIRE=1` fails instead of skipping when QEMU or the guest kernel
//! is missing; `VUBLK_CRASH_STATES=N` (states per row, CI: 150) and `VUBLK_CRASH_STEPS=N`
//! (the workload's steps, CI: 80) make the long run.

mod common;
mod vm;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use vublk_crash::Recording;

const CI_STATES: usize = 150;
const CI_STEPS: usize = 80;
/// The guest's disk: an ext4 with 4 KiB blocks and a 4 MiB journal.
const FS_MIB: u64 = 32;

/// Guest runs one at a time (two TCG guests on two cores slow each other down).
static ONE_GUEST_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// The ext4 the guest mounts, made on the host with an empty directory `d` (where the
/// workload works), written to `raw`.
fn make_ext4(raw: &Path) {
    let src = raw.with_extension("src");
    fs::create_dir_all(src.join("d")).unwrap();
    let out = Command::new("mke2fs")
        .args(["-q", "-F", "-t", "ext4", "-b", "4096", "-J", "size=4"])
        .args(["-E", "lazy_itable_init=0,lazy_journal_init=0,nodiscard"])
        .arg("-d")
        .arg(&src)
        .arg(raw)
        .arg(format!("{FS_MIB}M"))
        .output()
        .expect("run mke2fs");
    assert!(
        out.status.success(),
        "mke2fs: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    fs::remove_dir_all(&src).unwrap();
}

fn row(name: &'static str, format: &'static str) -> CrashRow {
    let image = if format == "raw" {
        "disk.raw"
    } else {
        "disk.qcow2"
    };
    CrashRow {
        name,
        image,
        check_images: format != "raw",
        qemu_key: None,
        ctl: false,
        args: Vec::new(),
        initial: Initial::Any,
        // The host keeps each aligned 4 KiB block whole, as the guest's ext4 assumes of its
        // disk: its 1 KiB superblock spans two sectors under one checksum, and a 32 MiB
        // ext4 has no backup. (vublk's own writes tear at 512 bytes in tests/crash_states.rs.)
        tear_unit: 4096,
        setup: Box::new(move |dir: &Path| {
            if format == "raw" {
                make_ext4(&dir.join(image));
            } else {
                let scratch = TestDir::new(&format!("{name}-mkfs"));
                let raw = scratch.join("fs.raw");
                make_ext4(&raw);
                qemu_img(&["convert", "-f", "raw", "-O", format])
                    .arg(&raw)
                    .arg(dir.join(image))
                    .status()
                    .map(|s| assert!(s.success(), "qemu-img convert"))
                    .expect("run qemu-img");
            }
        }),
    }
}

fn qemu_img(args: &[&str]) -> Command {
    let mut c = Command::new("qemu-img");
    c.args(args);
    c
}

/// One operation of the guest's workload, as it printed it (contrib/guest/crash-fs.c).
#[derive(Clone, Debug, PartialEq, Eq)]
enum Ev {
    Create {
        fid: u32,
        path: String,
    },
    Write {
        wid: u32,
        fid: u32,
        at: u32,
        n: u32,
    },
    Rename {
        from: String,
        to: String,
    },
    Unlink {
        path: String,
    },
    /// fsync or fdatasync of a file returned (durability point `seq`).
    SyncFile {
        seq: u32,
        fid: u32,
    },
    /// fsync of the directory returned.
    SyncDir {
        seq: u32,
    },
}

fn parse_event(m: &str) -> Option<Ev> {
    let w: Vec<&str> = m.strip_prefix("CF ")?.split(' ').collect();
    let num = |i: usize| -> u32 {
        w.get(i)
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("guest line {m:?}: field {i}"))
    };
    Some(match w[0] {
        "C" => Ev::Create {
            fid: num(1),
            path: w[2].to_string(),
        },
        "W" => Ev::Write {
            wid: num(1),
            fid: num(2),
            at: num(3),
            n: num(4),
        },
        "R" => Ev::Rename {
            from: w[1].to_string(),
            to: w[2].to_string(),
        },
        "U" => Ev::Unlink {
            path: w[1].to_string(),
        },
        "S" => Ev::SyncFile {
            seq: num(1),
            fid: num(2),
        },
        "D" => Ev::SyncDir { seq: num(1) },
        _ => return None,
    })
}

/// What the guest's file system must hold after a crash whose last mark was durability
/// point `seq`.
struct Durable {
    /// The names made durable (by a directory fsync) and their files.
    names: BTreeMap<String, u32>,
    /// Per file, the write id durable in each sector (its length: the durable size).
    files: HashMap<u32, Vec<u32>>,
    /// Names the operations since the last directory fsync, up to the next durability
    /// point, touched: each may or may not be there, holding any of its files.
    unsettled: BTreeSet<String>,
    /// The last write issued before the next durability point.
    issued: u32,
}

/// The guest workload's log: what each durability point made durable.
struct FsLog {
    /// Per (file, sector), the write ids that wrote it, in order.
    touch: HashMap<(u32, u32), Vec<u32>>,
    /// By durability point.
    points: Vec<Durable>,
    /// Before the first durability point.
    before: Durable,
    mount: PathBuf,
    writes: usize,
}

impl FsLog {
    fn new(events: &[Ev], mount: PathBuf) -> FsLog {
        let mut touch: HashMap<(u32, u32), Vec<u32>> = HashMap::new();
        let mut names: BTreeMap<String, u32> = BTreeMap::new();
        let mut files: HashMap<u32, Vec<u32>> = HashMap::new();
        let mut durable = Durable {
            names: BTreeMap::new(),
            files: HashMap::new(),
            unsettled: BTreeSet::new(),
            issued: 0,
        };
        // Names touched since the last directory fsync.
        let mut touched: BTreeSet<String> = BTreeSet::new();
        let mut points: Vec<Durable> = Vec::new();
        let mut before = None;
        let mut writes = 0;
        // Close the window of the previous point (or of the start) at each durability point.
        let close = |d: &mut Durable, touched: &BTreeSet<String>, issued: u32| {
            d.unsettled.extend(touched.iter().cloned());
            d.issued = issued;
        };
        let mut last_wid = 0;
        for ev in events {
            match ev {
                Ev::Create { fid, path } => {
                    names.insert(path.clone(), *fid);
                    files.insert(*fid, Vec::new());
                    touched.insert(path.clone());
                }
                Ev::Write { wid, fid, at, n } => {
                    let f = files.get_mut(fid).expect("a write to a file never created");
                    for s in *at..at + n {
                        if f.len() <= s as usize {
                            f.resize(s as usize + 1, 0);
                        }
                        f[s as usize] = *wid;
                        touch.entry((*fid, s)).or_default().push(*wid);
                    }
                    last_wid = *wid;
                    writes += 1;
                }
                Ev::Rename { from, to } => {
                    let fid = names.remove(from).expect("rename of a name never made");
                    names.insert(to.clone(), fid);
                    touched.insert(from.clone());
                    touched.insert(to.clone());
                }
                Ev::Unlink { path } => {
                    names.remove(path);
                    touched.insert(path.clone());
                }
                Ev::SyncFile { seq, .. } | Ev::SyncDir { seq } => {
                    assert_eq!(
                        *seq as usize,
                        points.len(),
                        "durability points out of order"
                    );
                    let prev = match points.last_mut() {
                        Some(p) => p,
                        None => before.get_or_insert(Durable {
                            names: BTreeMap::new(),
                            files: HashMap::new(),
                            unsettled: BTreeSet::new(),
                            issued: 0,
                        }),
                    };
                    close(prev, &touched, last_wid);
                    if let Ev::SyncFile { fid, .. } = ev {
                        durable.files.insert(*fid, files[fid].clone());
                    } else {
                        durable.names = names.clone();
                        touched.clear();
                    }
                    points.push(Durable {
                        names: durable.names.clone(),
                        files: durable.files.clone(),
                        unsettled: touched.clone(),
                        issued: 0,
                    });
                }
            }
        }
        if let Some(last) = points.last_mut() {
            close(last, &touched, last_wid);
        }
        let mut before = before.unwrap_or(Durable {
            names: BTreeMap::new(),
            files: HashMap::new(),
            unsettled: BTreeSet::new(),
            issued: 0,
        });
        if points.is_empty() {
            close(&mut before, &touched, last_wid);
        }
        FsLog {
            touch,
            points,
            before,
            mount,
            writes,
        }
    }

    /// Checks one file the state holds (`data`, at `name`) against point `d`.
    fn check_file(&self, d: &Durable, name: &str, data: &[u8]) -> Result<(), String> {
        if !data.len().is_multiple_of(512) {
            return Err(format!("{name}: {} bytes, not whole sectors", data.len()));
        }
        let settled = !d.unsettled.contains(name);
        let want = match d.names.get(name) {
            Some(&fid) if settled => Some((fid, d.files.get(&fid).cloned().unwrap_or_default())),
            None if settled => return Err(format!("{name}: there, though never made durable")),
            _ => None,
        };
        if let Some((_, dur)) = &want {
            if data.len() / 512 < dur.len() {
                return Err(format!(
                    "{name}: {} sectors; {} were durable",
                    data.len() / 512,
                    dur.len()
                ));
            }
        }
        let mut file_id = want.as_ref().map(|w| w.0);
        for (s, sec) in data.chunks(512).enumerate() {
            let durable_wid = want
                .as_ref()
                .and_then(|(_, dur)| dur.get(s).copied())
                .unwrap_or(0);
            if sec.iter().all(|&b| b == 0) {
                if durable_wid == 0 {
                    continue;
                }
                return Err(format!(
                    "{name}: sector {s} reads as zeroes; write {durable_wid} was durable there"
                ));
            }
            let Some((fid, at, wid)) = decode(sec) else {
                return Err(format!("{name}: sector {s} holds no write of the workload"));
            };
            if *file_id.get_or_insert(fid) != fid || at as usize != s {
                return Err(format!(
                    "{name}: sector {s} holds sector {at} of file {fid} (expected file {file_id:?})"
                ));
            }
            let ok = wid <= d.issued
                && wid >= durable_wid
                && self.touch.get(&(fid, at)).is_some_and(|w| w.contains(&wid));
            if !ok {
                return Err(format!(
                    "{name}: sector {s} holds write {wid}; write {durable_wid} was durable there, \
                     and writes up to {} were issued",
                    d.issued
                ));
            }
        }
        Ok(())
    }

    fn check_files(&self, d: &Durable, dir: &Path) -> Result<(), String> {
        let mut seen = BTreeSet::new();
        if let Ok(entries) = fs::read_dir(dir) {
            for e in entries {
                let e = e.map_err(|e| e.to_string())?;
                let name = e.file_name().into_string().map_err(|n| format!("{n:?}"))?;
                let data = fs::read(e.path()).map_err(|e| format!("{name}: {e}"))?;
                self.check_file(d, &name, &data)?;
                seen.insert(name);
            }
        }
        for name in d.names.keys() {
            if !seen.contains(name) && !d.unsettled.contains(name) {
                return Err(format!("{name}: gone, though its name was durable"));
            }
        }
        Ok(())
    }
}

const FS_STAMP_MAGIC: u64 = 0x5642_4643_5253_4653;

/// The file, sector and write a workload sector names, if it is one (crash-fs.c's stamp).
fn decode(sec: &[u8]) -> Option<(u32, u32, u32)> {
    let word = |i: usize| u32::from_le_bytes(sec[i..i + 4].try_into().unwrap());
    if u64::from_le_bytes(sec[..8].try_into().unwrap()) != FS_STAMP_MAGIC {
        return None;
    }
    let (fid, s, wid) = (word(8), word(12), word(16));
    let mut z = (u64::from(fid) << 40) ^ (u64::from(s) << 20) ^ u64::from(wid);
    let body_ok = word(20) == wid
        && sec[24..].chunks(8).all(|c| {
            z = z
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            c == z.to_le_bytes()
        });
    body_ok.then_some((fid, s, wid))
}

fn run(cmd: &mut Command, ok: &[i32], what: &str) -> Result<(), String> {
    let out = cmd.output().map_err(|e| format!("{what}: {e}"))?;
    match out.status.code() {
        Some(c) if ok.contains(&c) => Ok(()),
        _ => Err(format!(
            "{what}: {}: {}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )),
    }
}

impl Oracle for FsLog {
    fn mount(&self) -> &Path {
        &self.mount
    }

    fn assert_recorded_by_me(&self, rec: &Recording) {
        let marks = rec.marks().count();
        assert_eq!(marks, self.points.len(), "one mark per durability point");
    }

    fn check(
        &self,
        mark: Option<&str>,
        image: &Path,
        disk: &[u8],
        work: &Path,
    ) -> Result<(), String> {
        let d = match mark {
            None => &self.before,
            Some(m) => {
                let seq: usize = m
                    .strip_prefix("guest ")
                    .and_then(|s| s.parse().ok())
                    .ok_or_else(|| format!("mark {m:?} is not \"guest N\""))?;
                &self.points[seq]
            }
        };
        let raw = work.join("fs.raw");
        fs::write(&raw, disk).map_err(|e| e.to_string())?;
        if image.extension().is_some_and(|e| e != "raw") {
            // What vublk served is what QEMU's own driver reads from the image. (-U: the
            // killed vublk's io_uring may hold its file, and its lock, a moment longer.)
            let theirs = work.join("qemu.raw");
            run(
                qemu_img(&["convert", "-U", "-O", "raw"])
                    .arg(image)
                    .arg(&theirs),
                &[0],
                "qemu-img convert",
            )?;
            if fs::read(&theirs).map_err(|e| e.to_string())? != disk {
                return Err("vublk serves other data than qemu-img convert reads".into());
            }
        }
        run(
            Command::new("e2fsck")
                .args(["-E", "journal_only", "-y"])
                .arg(&raw),
            &[0, 1],
            "e2fsck -E journal_only (the journal's replay)",
        )?;
        run(
            Command::new("e2fsck").arg("-fn").arg(&raw),
            &[0],
            "e2fsck -fn after the journal's replay",
        )?;
        let out = work.join("rdump");
        let _ = fs::remove_dir_all(&out);
        fs::create_dir_all(&out).map_err(|e| e.to_string())?;
        run(
            Command::new("debugfs")
                .arg("-R")
                .arg(format!("rdump /d {}", out.display()))
                .arg(&raw),
            &[0],
            "debugfs rdump",
        )?;
        if !out.join("d").is_dir() {
            return Err("debugfs rdump: no directory d".into());
        }
        self.check_files(d, &out.join("d"))
    }
}

/// Boots the guest on vublk serving `row` through the recorder, runs the workload
/// (`steps` steps), marks each durability point and answers the guest.
fn record_guest(
    row: &CrashRow,
    dir: &TestDir,
    steps: usize,
    seed: u64,
) -> Option<(Recording, FsLog)> {
    let (qemu, guest) = vm::guest_prerequisites(&["qemu-img", "mke2fs", "e2fsck", "debugfs"])?;
    let (rec, events) = record_served(row, dir, |rec, backend, _| {
        let append = format!(
            "console=ttyS0 panic=-1 loglevel=4 E2E_QUEUES=1 E2E_MODE=crash-fs \
             E2E_STEPS={steps} E2E_SEED={seed}"
        );
        let mut cmd = vm::guest_command(
            &qemu,
            &guest,
            "512M",
            1,
            &format!("path={}", backend.socket.display()),
            ",num-queues=1",
            &append,
        );
        cmd.stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(File::create(dir.join("qemu.log")).unwrap());
        let mut q = vm::ChildGuard::spawn("qemu", &mut cmd).unwrap();
        let mut answers = q.child_mut().stdin.take().unwrap();
        let stdout = q.child_mut().stdout.take().unwrap();
        let mut serial = vm::LineCollector::new(stdout, File::create(dir.join("serial.log")).ok());
        let deadline = Instant::now() + Duration::from_secs(900);
        let exited = loop {
            let new = serial.poll();
            for l in &new {
                let Some(i) = l.find(vm::MARK) else { continue };
                if let Some(Ev::SyncFile { seq, .. } | Ev::SyncDir { seq }) =
                    parse_event(&l[i + vm::MARK.len()..])
                {
                    rec.mark(format!("guest {seq}"));
                    // The guest waits for this answer before its next operation.
                    let _ = writeln!(answers, "{seq}");
                    let _ = answers.flush();
                }
            }
            if q.try_wait().ok().flatten().is_some() {
                break true;
            }
            if Instant::now() > deadline {
                q.kill();
                break false;
            }
            std::thread::sleep(Duration::from_millis(1));
        };
        // Every line, the ones polled above among them.
        let lines = serial.finish();
        let marks = vm::assert_passed(exited, &lines, &backend.log, &dir.path);
        marks
            .iter()
            .filter_map(|m| parse_event(m))
            .collect::<Vec<_>>()
    });
    let log = FsLog::new(&events, dir.join("mnt"));
    eprintln!(
        "{}: the guest made {} writes and {} durability points",
        row.name,
        log.writes,
        log.points.len()
    );
    Some((rec, log))
}

/// The recording vublk would have made had it skipped every fsync and fdatasync: the same
/// writes, none of them durable until the guest powered off.
fn without_syncs(rec: &Recording) -> Recording {
    let mut lost = rec.clone();
    lost.records
        .retain(|r| !matches!(r.op, vublk_crash::Op::Sync { .. }));
    lost
}

fn crash_row(row: CrashRow, check_the_oracle: bool) {
    if skip_unless_vublk("crash states need vublk") {
        return;
    }
    if !Path::new("/dev/fuse").exists() {
        skip_or_fail::<()>("no /dev/fuse: the recorder is a FUSE file system");
        return;
    }
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        skip_or_fail::<()>("the recorder mounts FUSE directly, which needs root");
        return;
    }
    let _one = ONE_GUEST_AT_A_TIME
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    let dir = TestDir::new(row.name);
    let steps = crash_steps(CI_STEPS);
    let Some((rec, log)) = record_guest(&row, &dir, steps, 0x5eed + steps as u64) else {
        return;
    };
    if let Ok(keep) = std::env::var("VUBLK_CRASH_SAVE_DIR") {
        rec.save(&Path::new(&keep).join(format!("{}.rec", row.name)))
            .expect("save the recording");
    }
    let s = check_row(&row, &rec, &log, crash_budget(CI_STATES));
    assert!(s.states > 0, "no crash states");
    assert!(
        s.failures.is_empty(),
        "{} of {} states failed: {:#?}",
        s.failed,
        s.states,
        s.failures
    );
    if check_the_oracle {
        // The oracles fail where they should: without vublk's syncs, what the guest saw
        // flushed is lost in some states.
        let lost = check_row(&row, &without_syncs(&rec), &log, CI_STATES);
        eprintln!(
            "without vublk's syncs: {} of {} states fail, e.g. {:?}",
            lost.failed,
            lost.states,
            lost.failures.first()
        );
        assert!(
            lost.failed > 0,
            "no state failed though vublk's syncs were dropped from the recording"
        );
    }
}

/// How many steps the guest's workload runs: `VUBLK_CRASH_STEPS`, else `ci`.
fn crash_steps(ci: usize) -> usize {
    std::env::var("VUBLK_CRASH_STEPS")
        .ok()
        .map(|v| v.parse().expect("VUBLK_CRASH_STEPS: a number"))
        .unwrap_or(ci)
}

#[test]
fn ext4_on_raw() {
    crash_row(row("ext4-raw", "raw"), true);
}

#[test]
fn ext4_on_qcow2() {
    crash_row(row("ext4-qcow2", "qcow2"), false);
}
