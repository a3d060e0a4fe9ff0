//! Block jobs (docs/snapshots.md): long copies over the running disk, each on a thread of its
//! own, off the queue threads. A job has an id, a type, a state named as QEMU names job
//! states (created, running, paused, ready, concluded, aborting), bytes done of a total, a
//! speed limit (`--speed BYTES/S`, 0: none) and, when it ended badly, an error. `jobs` lists
//! them, `job-cancel ID` stops one, `job-complete ID` finishes one that waits in `ready`.
//! One job runs at a time per disk (two jobs on one chain would race for its layers).
//!
//! The job types live in their own files: `stream`, `commit`. A job reaches the device through
//! [`Host`], which the device implements (so that this room does not reach up to it).

pub mod active;
pub mod commit;
mod copy;
pub mod mirror;
pub mod stream;
mod switch;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::image::handover::ImageSlot;
use crate::locks::Locked;

/// Concluded jobs kept in the list for `jobs` (the oldest go first).
const KEEP_CONCLUDED: usize = 16;

/// What a job needs of the device.
pub trait Host: Send + Sync {
    /// The image served and how to switch it.
    fn slot(&self) -> &ImageSlot;
    /// Run `f` between two guest requests (`Device::with_queues_paused`).
    fn paused(&self, f: &mut dyn FnMut());
    /// The device's bitmaps (the persistent ones follow the image across a switch).
    fn bitmaps(&self) -> &crate::bitmaps::Bitmaps;
    /// Why the image cannot be switched now (a backup's view, a migration), if so.
    fn busy(&self) -> Option<String>;
    /// `--blk-file` and the chain's state file.
    fn base(&self) -> &std::path::Path;
    fn chain_state(&self) -> Option<&std::path::Path>;
    /// Where an active job's write-through is put for the queues (`active`).
    fn write_through(&self) -> &active::ThroughSlot;
}

/// How an active job (a mirror, an active commit) keeps up with the guest's writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CopyMode {
    /// Copy again what the guest dirtied, pass after pass (QEMU's background mode).
    Background,
    /// From the end of the first pass, each guest write is also sent to the target as it
    /// completes (`active`): the passes only shrink.
    WriteThrough,
    /// Background, then write-through once the passes stop shrinking fast.
    Auto,
}

/// A job's state, as QEMU names them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum State {
    Created,
    Running,
    Paused,
    Ready,
    Concluded,
    Aborting,
}

/// One job.
#[derive(Debug)]
pub struct Job {
    pub id: String,
    pub kind: &'static str,
    state: Mutex<State>,
    done: AtomicU64,
    total: AtomicU64,
    /// Bytes per second (0: unlimited).
    speed: AtomicU64,
    cancel: AtomicBool,
    /// `job-complete` was asked for (a job in the ready state).
    complete: AtomicBool,
    /// The disk is being handed over to a live migration's destination: a ready mirror
    /// copies the rest and concludes without moving the guest ([`Jobs::before_handover`]).
    handover: AtomicBool,
    error: Mutex<Option<String>>,
    started: Instant,
}

/// A job as `jobs` lists it.
#[derive(Clone, Debug, Serialize)]
pub struct JobInfo {
    pub id: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub state: State,
    pub bytes_done: u64,
    pub bytes_total: u64,
    /// The limit (0: none).
    pub speed: u64,
    pub seconds: f64,
    pub error: Option<String>,
}

impl Job {
    fn new(id: String, kind: &'static str, speed: u64) -> Self {
        Job {
            id,
            kind,
            state: Mutex::new(State::Created),
            done: AtomicU64::new(0),
            total: AtomicU64::new(0),
            speed: AtomicU64::new(speed),
            cancel: AtomicBool::new(false),
            complete: AtomicBool::new(false),
            handover: AtomicBool::new(false),
            error: Mutex::new(None),
            started: Instant::now(),
        }
    }

    pub fn state(&self) -> State {
        *self.state.locked()
    }

    fn set_state(&self, s: State) {
        let mut st = self.state.locked();
        // An asked-for cancel stays visible until the job ends.
        if *st != State::Aborting || s == State::Concluded {
            *st = s;
        }
    }

    /// The job caught up and waits for `job-complete` (or `job-cancel`), still copying.
    pub fn set_ready(&self) {
        if self.state() == State::Running {
            log::info!(
                "job {} ({}) is ready: job-complete finishes it",
                self.id,
                self.kind
            );
        }
        self.set_state(State::Ready);
    }

    /// Was `job-complete` asked for?
    pub fn completion_requested(&self) -> bool {
        self.complete.load(Ordering::Acquire)
    }

    /// Is the disk being handed over to a migration's destination (finish in place)?
    pub fn handover_requested(&self) -> bool {
        self.handover.load(Ordering::Acquire)
    }

    pub fn set_total(&self, n: u64) {
        self.total.store(n, Ordering::Relaxed);
    }

    /// `n` more bytes to do (what the guest dirtied while the job copied).
    pub fn add_total(&self, n: u64) {
        self.total.fetch_add(n, Ordering::Relaxed);
    }

    /// `n` more bytes done; sleeps as long as the speed limit asks.
    pub fn advance(&self, n: u64) {
        let done = self.count(n);
        let speed = self.speed.load(Ordering::Relaxed);
        if speed == 0 {
            return;
        }
        let due = Duration::from_secs_f64(done as f64 / speed as f64);
        let elapsed = self.started.elapsed();
        if due > elapsed {
            // In slices, so that a cancel is seen soon.
            let mut left = due - elapsed;
            while !left.is_zero() && !self.cancelled() {
                let step = left.min(Duration::from_millis(50));
                std::thread::sleep(step);
                left -= step;
            }
        }
    }

    /// `n` more bytes done, without waiting (a step made while the guest is paused); the
    /// bytes done now.
    pub fn count(&self, n: u64) -> u64 {
        self.done.fetch_add(n, Ordering::Relaxed) + n
    }

    /// Was `job-cancel` asked for?
    pub fn cancelled(&self) -> bool {
        self.cancel.load(Ordering::Relaxed)
    }

    pub fn info(&self) -> JobInfo {
        JobInfo {
            id: self.id.clone(),
            kind: self.kind,
            state: self.state(),
            bytes_done: self.done.load(Ordering::Relaxed),
            bytes_total: self.total.load(Ordering::Relaxed),
            speed: self.speed.load(Ordering::Relaxed),
            seconds: self.started.elapsed().as_secs_f64(),
            error: self.error.locked().clone(),
        }
    }
}

/// The device's jobs.
#[derive(Debug, Default)]
pub struct Jobs {
    list: RwLock<Vec<Arc<Job>>>,
    next: AtomicU64,
}

impl Jobs {
    /// Is a job running (not concluded)?
    pub fn any(&self) -> bool {
        self.list
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .any(|j| j.state() != State::Concluded)
    }

    pub fn list(&self) -> Vec<JobInfo> {
        self.list
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|j| j.info())
            .collect()
    }

    fn find(&self, id: &str) -> Option<Arc<Job>> {
        self.list
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .find(|j| j.id == id)
            .cloned()
    }

    /// Refused while a job runs: one job at a time.
    pub fn free(&self) -> Result<(), String> {
        Self::free_in(&self.list.read().unwrap_or_else(|p| p.into_inner()))
    }

    fn free_in(list: &[Arc<Job>]) -> Result<(), String> {
        match list.iter().find(|j| j.state() != State::Concluded) {
            Some(j) => Err(format!(
                "job {} ({}) is running: one job at a time (wait for it, or job-cancel it)",
                j.id, j.kind
            )),
            None => Ok(()),
        }
    }

    /// Start a job of `kind` running `body` on a thread of its own; its id (`id`, or
    /// `job-N`). Refused while another job runs or the id is taken.
    pub fn start(
        &self,
        kind: &'static str,
        id: Option<String>,
        speed: u64,
        body: impl FnOnce(&Job) -> Result<(), String> + Send + 'static,
    ) -> Result<Arc<Job>, String> {
        let mut list = self.list.write().unwrap_or_else(|p| p.into_inner());
        Self::free_in(&list)?;
        let id = match id {
            Some(id) if id.is_empty() || id.len() > 128 || id.chars().any(char::is_control) => {
                return Err("a job id is 1 to 128 characters, no control characters".into())
            }
            Some(id) => id,
            None => format!("job-{}", self.next.fetch_add(1, Ordering::Relaxed)),
        };
        if list.iter().any(|j| j.id == id) {
            return Err(format!("a job named {id:?} exists"));
        }
        let job = Arc::new(Job::new(id, kind, speed));
        let j = job.clone();
        std::thread::Builder::new()
            .name("vublk-job".into())
            .spawn(move || {
                j.set_state(State::Running);
                let r = body(&j);
                if let Err(e) = r {
                    log::error!("job {} ({}): {e}", j.id, j.kind);
                    *j.error.locked() = Some(e);
                } else {
                    log::info!(
                        "job {} ({}) done: {} bytes in {:.1} s",
                        j.id,
                        j.kind,
                        j.done.load(Ordering::Relaxed),
                        j.started.elapsed().as_secs_f64()
                    );
                }
                j.set_state(State::Concluded);
            })
            .map_err(|e| format!("cannot start the job's thread: {e}"))?;
        list.push(job.clone());
        // Forget the oldest concluded jobs beyond the bound.
        while list
            .iter()
            .filter(|j| j.state() == State::Concluded)
            .count()
            > KEEP_CONCLUDED
        {
            if let Some(i) = list.iter().position(|j| j.state() == State::Concluded) {
                list.remove(i);
            }
        }
        Ok(job)
    }

    /// `job-cancel ID`: the job stops at its next step (its state says aborting until then).
    pub fn cancel(&self, id: &str) -> Result<JobInfo, String> {
        let j = self.find(id).ok_or_else(|| format!("no job {id:?}"))?;
        if j.state() == State::Concluded {
            return Err(format!("job {id:?} has concluded"));
        }
        j.cancel.store(true, Ordering::Relaxed);
        j.set_state(State::Aborting);
        Ok(j.info())
    }

    /// The source of a live migration hands the disk over (its queues are stopped and
    /// drained, the image not yet closed): a mirror in `ready` copies what is left, flushes
    /// its target and concludes without moving the guest (the target then holds the disk
    /// as the guest left it: the migration without shared storage,
    /// docs/live-migration.md); any other job is cancelled (it could not finish on an image
    /// this process gives up). Returns once every job has concluded, or after `wait`.
    pub fn before_handover(&self, wait: Duration) {
        let running: Vec<Arc<Job>> = self
            .list
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .filter(|j| j.state() != State::Concluded)
            .cloned()
            .collect();
        for j in &running {
            if j.kind == "mirror" && j.state() == State::Ready {
                log::info!(
                    "job {} (mirror): the disk is handed over; copying the rest to the target",
                    j.id
                );
                j.handover.store(true, Ordering::Release);
            } else {
                log::warn!(
                    "job {} ({}) was {:?} when the disk was handed over to a migration's \
                     destination: cancelled",
                    j.id,
                    j.kind,
                    j.state()
                );
                j.cancel.store(true, Ordering::Relaxed);
                j.set_state(State::Aborting);
            }
        }
        let t0 = Instant::now();
        while running.iter().any(|j| j.state() != State::Concluded) {
            if t0.elapsed() > wait {
                log::error!(
                    "jobs still running {} s after the handover began: the handover goes on",
                    wait.as_secs()
                );
                return;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// `job-complete ID`: a job that waits in `ready` (a mirror, a commit started with
    /// `--manual-complete`) makes its last step (the switch) and concludes.
    pub fn complete(&self, id: &str) -> Result<JobInfo, String> {
        let j = self.find(id).ok_or_else(|| format!("no job {id:?}"))?;
        if j.state() != State::Ready {
            return Err(format!(
                "job {id:?} ({}) is {}: only a job in the ready state can be completed \
                 (a {} job gets there once it has caught up{})",
                j.kind,
                serde_json::to_value(j.state())
                    .ok()
                    .and_then(|v| v.as_str().map(str::to_owned))
                    .unwrap_or_default(),
                j.kind,
                if j.kind == "stream" {
                    "; stream jobs never do: they finish by themselves"
                } else {
                    ""
                }
            ));
        }
        j.complete.store(true, Ordering::Release);
        Ok(j.info())
    }
}
