//! Power-loss crash states (docs/crash-consistency.md): record a workload on vublk through
//! the FUSE recorder (`vublk_crash`), build crash states from the recording, and check each
//! with the oracles: `qemu-img check` finds no corruption, vublk opens the state read-write
//! and serves it, and every sector reads back as the workload's log allows.

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use vublk_crash::{Op as RecOp, Recorder, Recording, Replay, State};

use super::*;

/// The workload's disk.
pub const CRASH_DISK: u64 = 8 * MIB;
const SECTORS: usize = (CRASH_DISK / 512) as usize;

/// How many crash states a row checks: `VUBLK_CRASH_STATES`, else `ci`.
pub fn crash_budget(ci: usize) -> usize {
    env_usize("VUBLK_CRASH_STATES").unwrap_or(ci)
}

/// How many batches the libblkio workload runs: `VUBLK_CRASH_BATCHES`, else `ci`.
pub fn crash_batches(ci: usize) -> usize {
    env_usize("VUBLK_CRASH_BATCHES").unwrap_or(ci)
}

fn env_usize(name: &str) -> Option<usize> {
    std::env::var(name).ok().map(|v| {
        v.parse()
            .unwrap_or_else(|_| panic!("{name}={v}: not a number"))
    })
}

/// A scratch directory in /dev/shm (crash states are many small files), removed on drop.
pub fn shm_dir(name: &str) -> TestDir {
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let path = PathBuf::from(format!(
        "/dev/shm/vublk-crash-{name}-{}-{n}",
        std::process::id()
    ));
    let _ = fs::remove_dir_all(&path);
    fs::create_dir_all(&path).unwrap_or_else(|e| panic!("mkdir {}: {e}", path.display()));
    TestDir { path }
}

/// One row of the table: an image set-up and how vublk serves it.
pub struct CrashRow {
    pub name: &'static str,
    /// The image vublk serves (a file name in the directory).
    pub image: &'static str,
    /// `qemu-img check -f FORMAT` on every state (None: raw, nothing to check).
    pub check_format: Option<&'static str>,
    /// vublk's options while recording and when serving a state.
    pub args: Vec<String>,
    /// The disk starts with the pattern (an overlay over a filled backing file); else zeroes.
    pub initial_pattern: bool,
    /// Creates the files in the (empty) directory.
    pub setup: Box<dyn Fn(&Path) + Sync>,
}

/// What one sector may hold: a write's stamp or zeroes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Stamp,
    Zero,
    Discard,
}

/// The workload's log: every request, and per epoch (a mark in the recording) what was
/// durable and how far requests had been issued.
pub struct WorkloadLog {
    initial_pattern: bool,
    /// By request id; id 0 is the disk's initial content.
    kinds: Vec<Kind>,
    /// Per sector, the ids that touched it, in order.
    touch: Vec<Vec<u32>>,
    /// Per epoch: the durable id of every sector, and the last id issued before the next
    /// epoch's mark.
    epochs: Vec<(Arc<Vec<u32>>, u32)>,
    /// The last id issued before the first mark.
    first_batch_last: u32,
    pub requests: usize,
    pub flushes: usize,
    pub fua: usize,
}

const STAMP_MAGIC: u64 = 0x5642_4c4b_4352_5348;

/// Sector `s` as written by request `id` (id 0: the initial pattern).
pub fn stamp(s: u64, id: u32, out: &mut [u8]) {
    out[..8].copy_from_slice(&(STAMP_MAGIC ^ s).to_le_bytes());
    out[8..12].copy_from_slice(&id.to_le_bytes());
    let mut z = (s << 32) | u64::from(id);
    for chunk in out[12..512].chunks_mut(8) {
        z = splitmix64(z);
        chunk.copy_from_slice(&z.to_le_bytes()[..chunk.len()]);
    }
}

/// The initial pattern over a whole disk (for a backing file).
pub fn pattern_disk() -> Vec<u8> {
    let mut d = vec![0u8; CRASH_DISK as usize];
    for (s, sec) in d.chunks_mut(512).enumerate() {
        stamp(s as u64, 0, sec);
    }
    d
}

#[derive(Debug, PartialEq, Eq)]
enum Seen {
    Zero,
    Stamp(u32),
    Garbage,
}

fn decode(s: u64, sec: &[u8]) -> Seen {
    if sec.iter().all(|&b| b == 0) {
        return Seen::Zero;
    }
    let id = u32::from_le_bytes(sec[8..12].try_into().unwrap());
    let mut want = [0u8; 512];
    stamp(s, id, &mut want);
    if sec == want {
        Seen::Stamp(id)
    } else {
        Seen::Garbage
    }
}

impl WorkloadLog {
    /// Checks a whole disk read back from a crash state whose last mark was `epoch`.
    pub fn check(&self, epoch: Option<usize>, disk: &[u8]) -> Result<(), String> {
        let zeros = Arc::new(vec![0u32; SECTORS]);
        let (durable, issued) = match epoch {
            Some(e) => (&self.epochs[e].0, self.epochs[e].1),
            None => (&zeros, self.first_batch_last),
        };
        let mut bad = Vec::new();
        for (s, sec) in disk.chunks(512).enumerate() {
            let seen = decode(s as u64, sec);
            let d = durable[s];
            if !self.allowed(s, d, issued, &seen) {
                bad.push(format!(
                    "sector {s}: {seen:?}, durable request {d} ({:?}), requests since: {:?}",
                    self.kinds[d as usize],
                    self.touch[s]
                        .iter()
                        .filter(|&&w| w > d && w <= issued)
                        .collect::<Vec<_>>()
                ));
            }
        }
        if bad.is_empty() {
            Ok(())
        } else {
            let n = bad.len();
            bad.truncate(4);
            Err(format!(
                "{n} sectors hold what the log does not allow (epoch {epoch:?}): {}",
                bad.join("; ")
            ))
        }
    }

    fn content_is(&self, s: usize, id: u32, seen: &Seen) -> bool {
        match (id, self.kinds[id as usize], seen) {
            (0, _, Seen::Stamp(0)) => self.initial_pattern,
            (0, _, Seen::Zero) => !self.initial_pattern,
            (_, Kind::Stamp, Seen::Stamp(w)) => *w == id,
            (_, Kind::Zero, Seen::Zero) => true,
            // A discarded sector reads as zeroes or as anything it held before.
            (_, Kind::Discard, Seen::Zero) => true,
            (_, Kind::Discard, other) => {
                self.content_is(s, 0, other)
                    || self.touch[s]
                        .iter()
                        .take_while(|&&w| w < id)
                        .any(|&w| self.content_is(s, w, other))
            }
            _ => false,
        }
    }

    fn allowed(&self, s: usize, durable: u32, issued: u32, seen: &Seen) -> bool {
        if *seen == Seen::Garbage {
            return false;
        }
        self.content_is(s, durable, seen)
            || self.touch[s]
                .iter()
                .filter(|&&w| w > durable && w <= issued)
                .any(|&w| self.content_is(s, w, seen))
    }

    /// The epoch named by the mark at `record` ("epoch N").
    pub fn epoch_of(rec: &Recording, record: Option<usize>) -> Option<usize> {
        record.map(|i| match &rec.records[i].op {
            RecOp::Mark(m) => m
                .strip_prefix("epoch ")
                .and_then(|n| n.parse().ok())
                .unwrap_or_else(|| panic!("mark {m:?} is not an epoch")),
            other => panic!("record {i} is not a mark: {other:?}"),
        })
    }
}

/// The libblkio random mix: batches of up to six non-overlapping requests (writes of 1 to
/// 64 sectors, one in five with FUA; write-zeroes; discards), a flush after a third of
/// them, and after each batch a mark in the recording: "epoch N", once everything the
/// batch did is complete.
pub fn random_mix(
    c: &mut Client,
    rec: &Recorder,
    seed: u64,
    batches: usize,
    initial_pattern: bool,
) -> WorkloadLog {
    let mut rng = Rng::new(seed);
    let mut m = WorkloadLog {
        initial_pattern,
        kinds: vec![Kind::Stamp],
        touch: vec![Vec::new(); SECTORS],
        epochs: Vec::new(),
        first_batch_last: 0,
        requests: 0,
        flushes: 0,
        fua: 0,
    };
    let mut durable = vec![0u32; SECTORS];
    let mut unflushed: Vec<(u32, u64, u64)> = Vec::new();
    let (mut queues, mem) = c.take_queues();
    for e in 0..batches {
        let mut ops = Vec::new();
        let mut taken: Vec<(u64, u64)> = Vec::new();
        let mut reqs: Vec<(u32, u64, u64, bool)> = Vec::new();
        let mut buf = 0usize;
        let n = rng.range(1, 7);
        while ops.len() < n as usize {
            let len = if rng.below(4) == 0 {
                rng.range(9, 65)
            } else {
                rng.range(1, 9)
            };
            let start = rng.below(SECTORS as u64 - len);
            if taken.iter().any(|&(s, l)| start < s + l && s < start + len) {
                continue;
            }
            taken.push((start, len));
            let id = m.kinds.len() as u32;
            let r = rng.below(20);
            let (kind, fua) = match r {
                0..=1 => (Kind::Zero, false),
                2 => (Kind::Discard, false),
                3..=6 => (Kind::Stamp, true),
                _ => (Kind::Stamp, false),
            };
            let (offset, bytes) = (start * 512, len * 512);
            ops.push(match kind {
                Kind::Zero => Op::WriteZeroes {
                    offset,
                    len: bytes,
                    flags: blkio::ReqFlags::empty(),
                },
                Kind::Discard => Op::Discard { offset, len: bytes },
                Kind::Stamp => {
                    // SAFETY: the client lives; no request uses the region between batches,
                    // and each request of the batch has its own bytes.
                    let region = unsafe { mem.slice_mut(buf, bytes as usize) };
                    for (k, sec) in region.chunks_mut(512).enumerate() {
                        stamp(start + k as u64, id, sec);
                    }
                    let op = if fua {
                        Op::WriteFua {
                            offset,
                            buf,
                            len: bytes as usize,
                        }
                    } else {
                        Op::Write {
                            offset,
                            buf,
                            len: bytes as usize,
                        }
                    };
                    buf += bytes as usize;
                    op
                }
            });
            m.kinds.push(kind);
            for s in start..start + len {
                m.touch[s as usize].push(id);
            }
            reqs.push((id, start, len, fua));
        }
        let results = run_batch(&mut queues[0], mem, &ops);
        assert!(
            results.iter().all(|&r| r == 0),
            "batch {e}: {results:?} for {ops:?}"
        );
        m.requests += ops.len();
        for &(id, start, len, fua) in &reqs {
            unflushed.push((id, start, len));
            if fua {
                m.fua += 1;
                for s in start..start + len {
                    durable[s as usize] = id;
                }
            }
        }
        if rng.below(3) == 0 {
            let r = run_batch(&mut queues[0], mem, &[Op::Flush]);
            assert_eq!(r, vec![0], "flush after batch {e}");
            m.flushes += 1;
            for (id, start, len) in unflushed.drain(..) {
                for s in start..start + len {
                    durable[s as usize] = id;
                }
            }
        }
        let last = m.kinds.len() as u32 - 1;
        match m.epochs.last_mut() {
            Some(prev) => prev.1 = last,
            None => m.first_batch_last = last,
        }
        m.epochs.push((Arc::new(durable.clone()), last));
        rec.mark(format!("epoch {e}"));
    }
    c.queues = queues;
    m
}

/// What a row's check found.
#[derive(Debug, Default)]
pub struct Summary {
    pub durability_points: usize,
    pub crash_points: usize,
    pub states: usize,
    /// How many states failed.
    pub failed: usize,
    /// The first few failures.
    pub failures: Vec<String>,
}

/// Records `workload` on vublk serving `row` through the recorder, and checks that the
/// recording reproduces the files the recorder's directory ended with.
pub fn record_row(
    row: &CrashRow,
    dir: &TestDir,
    workload: impl FnOnce(&mut Client, &Recorder, &Backend) -> WorkloadLog,
) -> (Recording, WorkloadLog) {
    let backing = shm_dir(&format!("{}-backing", row.name));
    (row.setup)(&backing.path);
    let mnt = dir.join("mnt");
    fs::create_dir_all(&mnt).unwrap();
    let rec = Recorder::mount(&backing.path, &mnt)
        .unwrap_or_else(|e| panic!("mount the recorder on {}: {e}", mnt.display()));
    let backend = Backend::start(
        dir,
        &mnt.join(row.image),
        &BackendOpts {
            extra_args: row.args.clone(),
            ..BackendOpts::default()
        },
    );
    let mut c = connect(&backend.socket, ClientOpts::default());
    assert_eq!(c.capacity(), CRASH_DISK);
    let model = workload(&mut c, &rec, &backend);
    drop(c);
    let st = backend.sigterm_and_wait(Duration::from_secs(30));
    assert!(
        st.success(),
        "vublk exited {st}: {}",
        backend.log_contents()
    );
    drop(backend);
    let recording = rec.finish().expect("unmount the recorder");
    // The recorder saw everything: replaying every record gives the files as they are.
    let all = recording.replay_all();
    for name in all.names.keys() {
        let on_disk = read_file(&backing.join(name));
        let replayed = all.get(name).unwrap();
        assert_eq!(replayed.len(), on_disk.len() as u64, "{name}: size");
        assert!(
            replayed.read(0, on_disk.len()) == on_disk,
            "{name}: the recording does not reproduce the file"
        );
    }
    let names: Vec<String> = fs::read_dir(&backing.path)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(names.len(), all.names.len(), "files: {names:?}");
    (recording, model)
}

/// Builds up to `budget` crash states and checks each, on two threads.
pub fn check_row(row: &CrashRow, rec: &Recording, model: &WorkloadLog, budget: usize) -> Summary {
    let replay = Replay::new(rec);
    let mut summary = Summary {
        durability_points: rec
            .records
            .iter()
            .filter(|r| {
                matches!(
                    r.op,
                    RecOp::Sync { .. } | RecOp::SyncDir | RecOp::Write { dsync: true, .. }
                )
            })
            .count(),
        crash_points: replay.points().len(),
        ..Summary::default()
    };
    let (tx, rx) = mpsc::sync_channel::<State>(2);
    let rx = Arc::new(Mutex::new(rx));
    let failures = Arc::new(Mutex::new(Vec::new()));
    let checked = Arc::new(Mutex::new(0usize));
    let failed = Arc::new(Mutex::new(0usize));
    let started = Instant::now();
    std::thread::scope(|scope| {
        for w in 0..2 {
            let (rx, failures, checked, failed) = (
                rx.clone(),
                failures.clone(),
                checked.clone(),
                failed.clone(),
            );
            scope.spawn(move || {
                let work = shm_dir(&format!("{}-w{w}", row.name));
                let state_dir = work.join("state");
                loop {
                    let Some(state) = rx.lock().unwrap().recv().ok() else {
                        break;
                    };
                    if let Err(e) = check_state(row, rec, model, &work, &state_dir, &state) {
                        *failed.lock().unwrap() += 1;
                        let mut f = failures.lock().unwrap();
                        if f.len() < 5 {
                            let keep = PathBuf::from(format!(
                                "{}/crash-failure-{}-{}",
                                env!("CARGO_TARGET_TMPDIR"),
                                row.name,
                                f.len()
                            ));
                            let _ = fs::remove_dir_all(&keep);
                            let _ = state.files.store(&keep);
                            f.push(format!(
                                "{}: {e} (state kept in {})",
                                state.what,
                                keep.display()
                            ));
                        }
                    }
                    *checked.lock().unwrap() += 1;
                }
            });
        }
        for state in replay.states(budget, 0x5eed) {
            if tx.send(state).is_err() {
                break;
            }
        }
        drop(tx);
    });
    summary.states = *checked.lock().unwrap();
    summary.failed = *failed.lock().unwrap();
    if !failures.lock().unwrap().is_empty() {
        let keep = PathBuf::from(format!(
            "{}/crash-recording-{}.rec",
            env!("CARGO_TARGET_TMPDIR"),
            row.name
        ));
        rec.save(&keep).expect("save the recording");
        eprintln!(
            "the recording: {} (cargo run -p vublk-crash --example dump -- FILE)",
            keep.display()
        );
    }
    summary.failures = std::mem::take(&mut failures.lock().unwrap());
    eprintln!(
        "CRASH-ROW {} | durability points {} | crash points {} | states {} | failures {} | {:.1} s",
        row.name,
        summary.durability_points,
        summary.crash_points,
        summary.states,
        summary.failed,
        started.elapsed().as_secs_f64()
    );
    summary
}

fn check_state(
    row: &CrashRow,
    rec: &Recording,
    model: &WorkloadLog,
    work: &TestDir,
    state_dir: &Path,
    state: &State,
) -> Result<(), String> {
    state
        .files
        .store(state_dir)
        .map_err(|e| format!("write the state: {e}"))?;
    let image = state_dir.join(row.image);
    if !image.exists() {
        return Err(format!("{} is gone", row.image));
    }
    if let Some(fmt) = row.check_format {
        let out = std::process::Command::new("qemu-img")
            .args(["check", "-f", fmt])
            .arg(&image)
            .output()
            .map_err(|e| format!("qemu-img: {e}"))?;
        // 0: clean; 3: leaked clusters only (allowed after a crash). A parallels image
        // open read-write carries the "in use" flag, as QEMU sets it: after a crash qemu-img
        // counts it as an error ("not closed correctly"), and an open repairs it. That one
        // error is expected; any other is not.
        let text = String::from_utf8_lossy(&out.stdout);
        let unclean_only = fmt == "parallels"
            && out.status.code() == Some(2)
            && text.contains("1 errors were found")
            && text.lines().filter(|l| l.starts_with("ERROR")).all(|l| {
                l.contains("image was not closed correctly")
                    || l.contains("space leaked at the end of the image")
            });
        if !matches!(out.status.code(), Some(0) | Some(3)) && !unclean_only {
            return Err(format!(
                "qemu-img check: {}: {}{}",
                out.status,
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ));
        }
    }
    let backend = Backend::start(
        work,
        &image,
        &BackendOpts {
            extra_args: row.args.clone(),
            ..BackendOpts::default()
        },
    );
    let mut c = match try_connect(&backend.socket, ClientOpts::default()) {
        Ok(c) => c,
        Err(e) => {
            return Err(format!(
                "vublk does not serve the state: {e}; log: {}",
                backend.log_contents()
            ))
        }
    };
    let disk = c.read_all(0);
    drop(c);
    drop(backend);
    model.check(WorkloadLog::epoch_of(rec, state.mark), &disk)
}
