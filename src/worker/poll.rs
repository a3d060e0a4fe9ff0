//! How long a queue busy-polls after its last work before it sleeps (`--poll-us`).
//!
//! A fixed window polls that long after every piece of work, whatever the load: at low queue
//! depth it spends the whole time between requests spinning. `auto` adapts the window to
//! the gaps it sees: a gap is the time from the queue running out of work (the start of its
//! poll) to the next work. A gap the window did not cover but a poll of at most the maximum
//! would have doubles the window (from 4 us); a gap longer than the maximum, or a poll that
//! ended without finding work, halves it (below 4 us: no polling). So the queue polls while
//! requests and completions follow each other faster than a sleep and wake-up cost, stops
//! when its polls keep missing, and stops within a few gaps once the guest goes quiet: an
//! idle queue sleeps.

use std::time::{Duration, Instant};

/// `--poll-us auto`'s largest window: about the cost of a sleep and wake-up round trip
/// through the guest's kick and our eventfd on this class of machine (BENCHMARKS.md).
pub const AUTO_MAX: Duration = Duration::from_micros(50);

/// The smallest window `auto` polls with; it stops polling rather than shrink below it.
const AUTO_MIN: Duration = Duration::from_micros(4);

/// A queue's polling policy and, for `auto`, its current window.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Poller {
    /// None: the window is fixed. Some(max): adaptive up to `max`.
    auto_max: Option<Duration>,
    window: Duration,
    /// When the queue last ran out of work and went to poll or sleep.
    idle_since: Option<Instant>,
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
        }
    }

    /// Adapt the window to the gaps between work, up to `max`; start without polling.
    pub fn auto(max: Duration) -> Self {
        Poller {
            auto_max: Some(max),
            window: Duration::ZERO,
            idle_since: None,
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

    /// A poll of the whole window found no work (the queue then slept): the window was
    /// spent for nothing, so it shrinks.
    pub fn missed(&mut self) {
        if self.auto_max.is_some() {
            self.shrink();
        }
    }

    fn shrink(&mut self) {
        self.window /= 2;
        if self.window < AUTO_MIN {
            self.window = Duration::ZERO;
        }
    }

    /// Work arrived at `now` after a sleep (an event woke the queue thread): adapt.
    pub fn woke(&mut self, now: Instant) {
        let (Some(max), Some(since)) = (self.auto_max, self.idle_since.take()) else {
            return;
        };
        let gap = now.saturating_duration_since(since);
        if gap > max {
            // Polling would not have caught it: polling costs more than it saves.
            self.shrink();
        } else if gap > self.window {
            // A poll of `gap` would have caught it without a sleep and a wake-up.
            self.window = (self.window * 2).max(AUTO_MIN).min(max);
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
    fn auto_grows_on_short_gaps_up_to_the_maximum() {
        let mut p = Poller::auto(AUTO_MAX);
        assert_eq!(p.window(), Duration::ZERO);
        assert_eq!(run(&mut p, &[10; 6]), [4, 8, 16, 16, 16, 16]);
        // Gaps that still fit the maximum push the window up to it, never beyond.
        assert_eq!(run(&mut p, &[45; 4]), [32, 50, 50, 50]);
    }

    #[test]
    fn auto_stops_polling_when_the_queue_goes_quiet() {
        let mut p = Poller::auto(AUTO_MAX);
        run(&mut p, &[45; 6]);
        assert_eq!(p.window(), AUTO_MAX);
        // An idle guest: every gap is long. Halved each time, then off.
        assert_eq!(run(&mut p, &[100_000; 5]), [25, 12, 6, 0, 0]);
    }

    #[test]
    fn auto_ignores_wake_ups_without_an_idle_period() {
        let mut p = Poller::auto(AUTO_MAX);
        p.woke(Instant::now());
        assert_eq!(p.window(), Duration::ZERO);
        // A second event of the same wake-up finds no idle period to measure.
        run(&mut p, &[10]);
        p.woke(Instant::now() + Duration::from_secs(1));
        assert_eq!(p.window(), AUTO_MIN);
    }

    #[test]
    fn auto_shrinks_when_polls_miss() {
        let mut p = Poller::auto(AUTO_MAX);
        run(&mut p, &[45; 6]);
        assert_eq!(p.window(), AUTO_MAX);
        p.missed();
        assert_eq!(p.window(), AUTO_MAX / 2);
        for _ in 0..4 {
            p.missed();
        }
        assert_eq!(p.window(), Duration::ZERO);
        // A fixed window does not move.
        let mut f = Poller::fixed(20 * US);
        f.missed();
        assert_eq!(f.window(), 20 * US);
    }

    #[test]
    fn fixed_never_changes() {
        let mut p = Poller::fixed(20 * US);
        assert_eq!(run(&mut p, &[1, 1000, 100_000]), [20, 20, 20]);
        assert!(!p.is_auto());
    }
}
