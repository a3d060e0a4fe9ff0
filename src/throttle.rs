//! I/O limits: token buckets shared by all queues of a device.
//!
//! Each limit (I/O per second and bytes per second, for reads and writes together and for
//! each alone) is a bucket that fills at its rate and holds at most one second's worth (the
//! burst). A read or write takes one token from each I/O bucket that applies and its length
//! from each byte bucket; when a bucket lacks them, the request waits in the backend (it is
//! parsed and held in its slot, not failed) until the bucket has refilled, and the requests
//! behind it on that queue wait behind it. A request larger than a byte bucket's burst goes
//! when the bucket is full. FLUSH, DISCARD, WRITE_ZEROES and GET_ID are not limited. All
//! queues take from the same buckets, first come first served: a queue waiting for tokens
//! retries when its timer says they are there, as do the others, so none is starved.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::locks::Locked;
use serde::{Deserialize, Serialize};

/// The limits, 0 meaning unlimited.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Limits {
    pub iops: u64,
    pub bps: u64,
    pub read_iops: u64,
    pub write_iops: u64,
    pub read_bps: u64,
    pub write_bps: u64,
}

impl Limits {
    pub fn unlimited(&self) -> bool {
        *self == Limits::default()
    }
}

/// The direction of a limited request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dir {
    Read,
    Write,
}

#[derive(Debug, Clone, Copy)]
struct Bucket {
    /// Per second; 0: no limit.
    rate: u64,
    tokens: f64,
}

impl Bucket {
    fn new(rate: u64) -> Self {
        Bucket {
            rate,
            tokens: rate as f64,
        }
    }

    fn refill(&mut self, secs: f64) {
        if self.rate > 0 {
            self.tokens = (self.tokens + secs * self.rate as f64).min(self.rate as f64);
        }
    }

    /// How long until `cost` can be taken (zero: now). A cost beyond the burst goes when
    /// the bucket is full.
    fn wait(&self, cost: u64) -> Duration {
        if self.rate == 0 {
            return Duration::ZERO;
        }
        let need = (cost as f64).min(self.rate as f64);
        if self.tokens >= need {
            Duration::ZERO
        } else {
            Duration::from_secs_f64((need - self.tokens) / self.rate as f64)
        }
    }

    fn take(&mut self, cost: u64) {
        if self.rate > 0 {
            self.tokens -= cost as f64;
        }
    }
}

#[derive(Debug)]
struct Buckets {
    limits: Limits,
    iops: Bucket,
    bps: Bucket,
    read_iops: Bucket,
    write_iops: Bucket,
    read_bps: Bucket,
    write_bps: Bucket,
    last: Instant,
}

impl Buckets {
    fn new(l: Limits) -> Self {
        Buckets {
            limits: l,
            iops: Bucket::new(l.iops),
            bps: Bucket::new(l.bps),
            read_iops: Bucket::new(l.read_iops),
            write_iops: Bucket::new(l.write_iops),
            read_bps: Bucket::new(l.read_bps),
            write_bps: Bucket::new(l.write_bps),
            last: Instant::now(),
        }
    }
}

/// A device's limits and buckets.
#[derive(Debug)]
pub struct Throttle {
    /// Some limit is set (checked without the lock on every request).
    on: AtomicBool,
    buckets: Mutex<Buckets>,
}

impl Default for Throttle {
    fn default() -> Self {
        Throttle::new(Limits::default())
    }
}

impl Throttle {
    pub fn new(l: Limits) -> Self {
        Throttle {
            on: AtomicBool::new(!l.unlimited()),
            buckets: Mutex::new(Buckets::new(l)),
        }
    }

    /// New limits, in effect for the next request (buckets start full).
    pub fn set(&self, l: Limits) {
        let mut b = self.buckets.locked();
        *b = Buckets::new(l);
        self.on.store(!l.unlimited(), Ordering::Release);
    }

    pub fn limits(&self) -> Limits {
        self.buckets.locked().limits
    }

    /// Is any limit set?
    pub fn on(&self) -> bool {
        self.on.load(Ordering::Acquire)
    }

    /// Admit a request of `bytes` in direction `dir` (its tokens are taken), or say how long
    /// until it could be admitted.
    pub fn admit(&self, dir: Dir, bytes: u64) -> Result<(), Duration> {
        if !self.on() {
            return Ok(());
        }
        let mut b = self.buckets.locked();
        let now = Instant::now();
        let secs = now.duration_since(b.last).as_secs_f64();
        b.last = now;
        let (dir_iops, dir_bps) = match dir {
            Dir::Read => (b.read_iops, b.read_bps),
            Dir::Write => (b.write_iops, b.write_bps),
        };
        let mut all = [b.iops, b.bps, dir_iops, dir_bps];
        for x in &mut all {
            x.refill(secs);
        }
        let costs = [1, bytes, 1, bytes];
        let wait = all
            .iter()
            .zip(costs)
            .map(|(x, c)| x.wait(c))
            .max()
            .unwrap_or(Duration::ZERO);
        if wait.is_zero() {
            for (x, c) in all.iter_mut().zip(costs) {
                x.take(c);
            }
        }
        b.iops = all[0];
        b.bps = all[1];
        match dir {
            Dir::Read => {
                b.read_iops = all[2];
                b.read_bps = all[3];
            }
            Dir::Write => {
                b.write_iops = all[2];
                b.write_bps = all[3];
            }
        }
        if wait.is_zero() {
            Ok(())
        } else {
            Err(wait)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unlimited_admits_everything() {
        let t = Throttle::default();
        for _ in 0..10_000 {
            assert_eq!(t.admit(Dir::Write, 1 << 20), Ok(()));
        }
    }

    #[test]
    fn the_burst_is_one_second_then_the_rate() {
        let t = Throttle::new(Limits {
            iops: 100,
            ..Limits::default()
        });
        for i in 0..100 {
            assert_eq!(t.admit(Dir::Read, 4096), Ok(()), "request {i} of the burst");
        }
        let w = t.admit(Dir::Read, 4096).unwrap_err();
        assert!(w <= Duration::from_millis(11), "{w:?}");
        std::thread::sleep(Duration::from_millis(30));
        assert_eq!(t.admit(Dir::Read, 4096), Ok(()));
    }

    #[test]
    fn direction_limits_apply_to_their_direction_only() {
        let t = Throttle::new(Limits {
            write_bps: 8192,
            ..Limits::default()
        });
        assert_eq!(t.admit(Dir::Write, 8192), Ok(()));
        assert!(t.admit(Dir::Write, 4096).is_err());
        assert_eq!(t.admit(Dir::Read, 1 << 20), Ok(()));
        // Larger than the burst: admitted when the bucket is full.
        t.set(Limits {
            write_bps: 8192,
            ..Limits::default()
        });
        assert_eq!(t.admit(Dir::Write, 1 << 20), Ok(()));
        assert!(t.admit(Dir::Write, 512).is_err());
        t.set(Limits::default());
        assert_eq!(t.admit(Dir::Write, 1 << 20), Ok(()));
    }
}
