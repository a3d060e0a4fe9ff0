//! Stuck requests, seen: each queue notes, per slot, when its request was taken from the ring
//! and what it waits for now (the engine, a pool thread, the I/O limits), and what its thread
//! itself is blocked on (another write's fill or range, taking the image over). The queue
//! thread only stores into its own table (relaxed stores, a few per request: no lock, no
//! read-modify-write); anyone reads it: `stats` and the metrics show each queue's oldest
//! request's age, and the watchdog thread logs a request in flight longer than
//! `--stuck-request-secs`, with what it waits for: one line per queue when it first sees
//! one, again at most once per period while one stays, and one when none is left.

use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// What a request, or a queue thread, waits for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Wait {
    /// Nothing (a free slot, a thread at work).
    Nothing = 0,
    /// Being started on the queue thread.
    Start = 1,
    /// The I/O engine (io_uring, the blocking thread, NBD, librbd).
    Engine = 2,
    /// A pool thread writing through the format (copy-on-write, compression).
    Pool = 3,
    /// The I/O limits (`--throttle-*`).
    Throttle = 4,
    /// Another write's fill of the same clusters.
    Fill = 5,
    /// Another write's range of the file (read-modify-write).
    Range = 6,
    /// Taking the image over (a live migration's destination, or its take-back).
    TakeOver = 7,
    /// Held by the error policy (`--werror`, `--rerror`): not reported as stuck.
    Held = 8,
}

impl Wait {
    fn from_u8(v: u8) -> Wait {
        match v {
            1 => Wait::Start,
            2 => Wait::Engine,
            3 => Wait::Pool,
            4 => Wait::Throttle,
            5 => Wait::Fill,
            6 => Wait::Range,
            7 => Wait::TakeOver,
            8 => Wait::Held,
            _ => Wait::Nothing,
        }
    }

    /// How a log line says it.
    pub fn describe(self, engine: &str) -> String {
        match self {
            Wait::Nothing => "nothing".into(),
            Wait::Start => "being started".into(),
            Wait::Engine => format!("the I/O engine ({engine})"),
            Wait::Pool => "a pool thread writing through the image format".into(),
            Wait::Throttle => "the I/O limits (--throttle-*)".into(),
            Wait::Fill => "another write's fill of the same clusters".into(),
            Wait::Range => "another write to the same blocks".into(),
            Wait::TakeOver => "taking the image over (locks held by another process)".into(),
            Wait::Held => "a retry (held by the error policy)".into(),
        }
    }
}

/// Microseconds since the process's first look at the clock, plus one (0: none).
pub fn now_us() -> u64 {
    at_us(Instant::now())
}

/// [`now_us`] of a time already read (one clock read serves a request's start and its
/// latency).
pub fn at_us(t: Instant) -> u64 {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    let epoch = *EPOCH.get_or_init(|| t);
    t.saturating_duration_since(epoch).as_micros() as u64 + 1
}

/// One slot's request as the watchdog sees it.
#[derive(Debug, Default)]
struct SlotWatch {
    /// When it was taken from the ring ([`now_us`]; 0: free).
    since_us: AtomicU64,
    /// Its type (`virtio_blk::OPS` index) and first sector, packed: `op << 56 | sector`.
    what: AtomicU64,
    wait: AtomicU8,
}

/// A queue's in-flight table.
#[derive(Debug, Default)]
pub struct QueueWatch {
    slots: Box<[SlotWatch]>,
    /// What the queue thread itself is blocked on, and since when.
    thread_wait: AtomicU8,
    thread_since_us: AtomicU64,
    /// The queue's engine, for the log line (set by the queue's worker).
    engine: OnceLock<&'static str>,
}

/// The oldest request of a queue, read at one moment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Oldest {
    pub age: Duration,
    pub op: usize,
    pub sector: u64,
    pub wait: Wait,
}

impl QueueWatch {
    /// A table for `slots` requests.
    pub fn new(slots: usize) -> Self {
        QueueWatch {
            slots: (0..slots).map(|_| SlotWatch::default()).collect(),
            ..QueueWatch::default()
        }
    }

    pub fn set_engine(&self, name: &'static str) {
        let _ = self.engine.set(name);
    }

    /// Slot `i` took a request of type `op` at `sector`, `since` ([`now_us`]).
    pub fn start(&self, i: u16, op: usize, sector: u64, since: u64) {
        if let Some(s) = self.slots.get(usize::from(i)) {
            s.what.store(
                ((op as u64) << 56) | (sector & ((1 << 56) - 1)),
                Ordering::Relaxed,
            );
            s.wait.store(Wait::Start as u8, Ordering::Relaxed);
            s.since_us.store(since, Ordering::Release);
        }
    }

    /// Slot `i`'s request now waits for `w`.
    pub fn wait(&self, i: u16, w: Wait) {
        if let Some(s) = self.slots.get(usize::from(i)) {
            s.wait.store(w as u8, Ordering::Relaxed);
        }
    }

    /// What slot `i`'s request waits for.
    pub fn waits_for(&self, i: u16) -> Wait {
        self.slots.get(usize::from(i)).map_or(Wait::Nothing, |s| {
            Wait::from_u8(s.wait.load(Ordering::Relaxed))
        })
    }

    /// Slot `i` is free again.
    pub fn end(&self, i: u16) {
        if let Some(s) = self.slots.get(usize::from(i)) {
            s.since_us.store(0, Ordering::Release);
            s.wait.store(Wait::Nothing as u8, Ordering::Relaxed);
        }
    }

    /// The queue thread blocks on `w` (Nothing: it is at work again).
    pub fn thread_waits(&self, w: Wait) {
        let since = if w == Wait::Nothing { 0 } else { now_us() };
        self.thread_since_us.store(since, Ordering::Relaxed);
        self.thread_wait.store(w as u8, Ordering::Relaxed);
    }

    /// What the queue thread is blocked on, and for how long (None: it is not).
    pub fn thread_blocked(&self, now: u64) -> Option<(Wait, Duration)> {
        let w = Wait::from_u8(self.thread_wait.load(Ordering::Relaxed));
        let since = self.thread_since_us.load(Ordering::Relaxed);
        (w != Wait::Nothing && since != 0)
            .then(|| (w, Duration::from_micros(now.saturating_sub(since))))
    }

    /// The oldest request in flight at `now`, and how many are older than `limit`.
    pub fn oldest(&self, now: u64, limit: Duration) -> (Option<Oldest>, usize) {
        let mut oldest: Option<Oldest> = None;
        let mut over = 0;
        for s in self.slots.iter() {
            let since = s.since_us.load(Ordering::Acquire);
            if since == 0 {
                continue;
            }
            let age = Duration::from_micros(now.saturating_sub(since));
            if age > limit {
                over += 1;
            }
            if oldest.is_none_or(|o| age > o.age) {
                let what = s.what.load(Ordering::Relaxed);
                oldest = Some(Oldest {
                    age,
                    op: (what >> 56) as usize,
                    sector: what & ((1 << 56) - 1),
                    wait: Wait::from_u8(s.wait.load(Ordering::Relaxed)),
                });
            }
        }
        (oldest, over)
    }

    /// The oldest request's age now, in microseconds (0: nothing in flight).
    pub fn oldest_age_us(&self) -> u64 {
        let now = now_us();
        self.oldest(now, Duration::MAX)
            .0
            .map_or(0, |o| o.age.as_micros() as u64)
    }
}

/// How often the watchdog looks for requests older than `limit`: every second, or a
/// quarter of the limit if that is shorter.
pub fn period(limit: Duration) -> Duration {
    (limit / 4).clamp(Duration::from_millis(100), Duration::from_secs(1))
}

/// One look at queue `q`: a line when a request first passes `limit`, again once per
/// `limit` while one does, and one when none does any more.
pub fn check_queue(q: usize, w: &QueueWatch, limit: Duration, last: &mut Option<Instant>) {
    let now = now_us();
    let (oldest, over) = w.oldest(now, limit);
    // Held requests have their own log line (`hold`).
    let stuck = oldest.filter(|o| o.age > limit && o.wait != Wait::Held);
    let Some(o) = stuck else {
        if last.take().is_some() {
            log::info!(
                "queue {q}: no request in flight longer than --stuck-request-secs {} any more",
                limit.as_secs()
            );
        }
        return;
    };
    if last.is_some_and(|t| t.elapsed() < limit.max(Duration::from_secs(1))) {
        return;
    }
    *last = Some(Instant::now());
    let engine = w.engine.get().copied().unwrap_or("none");
    let thread = match w.thread_blocked(now) {
        Some((tw, d)) => format!(
            "; the queue's thread has been waiting for {} for {:.1} s",
            tw.describe(engine),
            d.as_secs_f64()
        ),
        None => String::new(),
    };
    log::warn!(
        "queue {q}: a {} request (sector {}) has been in flight for {:.1} s, waiting for {}; \
         {over} request(s) in flight longer than --stuck-request-secs {}{thread}",
        crate::virtio_blk::OPS.get(o.op).copied().unwrap_or("?"),
        o.sector,
        o.age.as_secs_f64(),
        o.wait.describe(engine),
        limit.as_secs()
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn oldest_and_over_the_limit() {
        let w = QueueWatch::new(4);
        let t = 10_000_000;
        assert_eq!(w.oldest(t, Duration::from_secs(1)), (None, 0));
        w.start(0, 1, 8, t - 500_000);
        w.start(2, 0, 16, t - 3_000_000);
        w.wait(2, Wait::Engine);
        w.start(3, 2, 0, t - 2_000_000);
        let (o, over) = w.oldest(t, Duration::from_secs(1));
        assert_eq!(over, 2);
        assert_eq!(
            o,
            Some(Oldest {
                age: Duration::from_secs(3),
                op: 0,
                sector: 16,
                wait: Wait::Engine
            })
        );
        w.end(2);
        let (o, over) = w.oldest(t, Duration::from_secs(1));
        assert_eq!(
            (o.unwrap().age, o.unwrap().wait, over),
            (Duration::from_secs(2), Wait::Start, 1)
        );
        // Out-of-range slots are ignored, not a panic.
        w.start(9, 0, 0, t);
        w.end(9);
        assert_eq!(w.waits_for(9), Wait::Nothing);
    }

    #[test]
    fn thread_waits_are_timed() {
        let w = QueueWatch::new(1);
        assert_eq!(w.thread_blocked(now_us()), None);
        w.thread_waits(Wait::Fill);
        let (what, _) = w.thread_blocked(now_us()).unwrap();
        assert_eq!(what, Wait::Fill);
        w.thread_waits(Wait::Nothing);
        assert_eq!(w.thread_blocked(now_us()), None);
    }
}
