//! How long a queue busy-polls after its last work before it sleeps (`--poll-us`).
//!
//! A fixed window polls that long after every piece of work, whatever the load: at low queue
//! depth it spends the whole time between requests spinning. `auto` polls only while polling
//! pays. A window shorter than the gaps it is meant to cover costs more than no polling at
//! all (measured: 8 and 16 us windows lose 20-30% against 0 and 50 us at queue depth 1 on
//! the project's VM, BENCHMARKS.md), so `auto` has two states, not a sliding window: off, or
//! polling with the whole maximum window. A gap is the time from the queue running out of
//! work (the start of its poll, or its sleep) to the next work. Off turns on after
//! [`SHORT_GAPS`] gaps in a row that a poll of the maximum would have covered; on turns off
//! after [`MISSES`] polls in a row that ended without finding work. So the queue polls while
//! requests and completions follow each other faster than a sleep and wake-up cost, stops
//! when its polls keep missing, and an idle queue sleeps (its first idle poll misses, the
//! next few requests' polls too).

use std::time::{Duration, Instant};

/// `--poll-us auto`'s window: about the cost of a sleep and wake-up round trip through the
/// guest's kick and our eventfd on this class of machine (`vublk-bench --hop`).
pub const AUTO_MAX: Duration = Duration::from_micros(50);

/// Consecutive gaps shorter than the window that turn polling on.
const SHORT_GAPS: u32 = 2;

/// Consecutive polls without work that turn polling off.
const MISSES: u32 = 4;

/// A queue's polling policy and, for `auto`, its state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Poller {
    /// None: the window is fixed. Some(max): `auto`, polling `max` when on.
    auto_max: Option<Duration>,
    window: Duration,
    /// When the queue last ran out of work and went to poll or sleep.
    idle_since: Option<Instant>,
    /// `auto`, off: gaps in a row a poll would have covered. On: polls in a row that missed.
    streak: u32,
}

impl Default for Poller {
    fn default() -> Self {
        Poller::fixed(Duration::ZERO)
    }
}

impl Poller {
    /// Poll `window` after the last work, always (zero: never poll).
    pub fn fixed(window: Duration) -> Self {
        Poller {
            auto_max: None,
            window,
            idle_since: None,
            streak: 0,
        }
    }

    /// Poll `max` while polling pays, else not at all; start off.
    pub fn auto(max: Duration) -> Self {
        Poller {
            auto_max: Some(max),
            window: Duration::ZERO,
            idle_since: None,
            streak: 0,
        }
    }

    /// The window to poll now.
    pub fn window(&self) -> Duration {
        self.window
    }

    pub fn is_auto(&self) -> bool {
        self.auto_max.is_some()
    }

    /// The queue ran out of work at `now` (it polls `window()`, then sleeps).
    pub fn idle(&mut self, now: Instant) {
        if self.auto_max.is_some() {
            self.idle_since = Some(now);
        }
    }

    /// A poll of the whole window found no work (the queue then slept).
    pub fn missed(&mut self) {
        if self.auto_max.is_none() || self.window.is_zero() {
            return;
        }
        self.streak += 1;
        if self.streak >= MISSES {
            self.window = Duration::ZERO;
            self.streak = 0;
        }
    }

    /// A poll found work.
    pub fn hit(&mut self) {
        if self.auto_max.is_some() && !self.window.is_zero() {
            self.streak = 0;
        }
    }

    /// Work arrived at `now` after a sleep (an event woke the queue thread): while off,
    /// count the gaps a poll would have covered.
    pub fn woke(&mut self, now: Instant) {
        let (Some(max), Some(since)) = (self.auto_max, self.idle_since.take()) else {
            return;
        };
        if !self.window.is_zero() {
            return;
        }
        if now.saturating_duration_since(since) <= max {
            self.streak += 1;
            if self.streak >= SHORT_GAPS {
                self.window = max;
                self.streak = 0;
            }
        } else {
            self.streak = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const US: Duration = Duration::from_micros(1);

    /// Feed `gaps` (each: idle, then woken that much later) and return the windows after each.
    fn run(p: &mut Poller, gaps: &[u64]) -> Vec<u64> {
        let mut t = Instant::now();
        gaps.iter()
            .map(|&g| {
                p.idle(t);
                t += Duration::from_micros(g);
                p.woke(t);
                p.window().as_micros() as u64
            })
            .collect()
    }

    #[test]
    fn auto_turns_on_after_short_gaps_with_the_whole_window() {
        let mut p = Poller::auto(AUTO_MAX);
        assert_eq!(p.window(), Duration::ZERO);
        // One short gap is not enough; a long one starts the count again.
        assert_eq!(run(&mut p, &[10, 1000, 10]), [0, 0, 0]);
        assert_eq!(run(&mut p, &[45]), [50]);
        // On: gaps no longer move it (polls' hits and misses do).
        assert_eq!(run(&mut p, &[100_000, 10]), [50, 50]);
    }

    #[test]
    fn auto_turns_off_after_polls_keep_missing() {
        let mut p = Poller::auto(AUTO_MAX);
        run(&mut p, &[10, 10]);
        assert_eq!(p.window(), AUTO_MAX);
        // Misses between hits (the disk's long gaps at queue depth 1) keep it on.
        for _ in 0..10 {
            p.missed();
            p.missed();
            p.hit();
        }
        assert_eq!(p.window(), AUTO_MAX);
        // An idle guest: every poll misses.
        for _ in 0..MISSES {
            p.missed();
        }
        assert_eq!(p.window(), Duration::ZERO);
        // Off, misses mean nothing; short gaps turn it on again.
        p.missed();
        assert_eq!(run(&mut p, &[5, 5]), [0, 50]);
    }

    #[test]
    fn auto_ignores_wake_ups_without_an_idle_period() {
        let mut p = Poller::auto(AUTO_MAX);
        p.woke(Instant::now());
        p.woke(Instant::now());
        assert_eq!(p.window(), Duration::ZERO);
    }

    #[test]
    fn fixed_never_changes() {
        let mut p = Poller::fixed(20 * US);
        assert_eq!(run(&mut p, &[1, 1000, 100_000]), [20, 20, 20]);
        for _ in 0..10 {
            p.missed();
        }
        assert_eq!(p.window(), 20 * US);
        assert!(!p.is_auto());
    }
}
