//! Request counters, per queue, for the control socket (`stats`) and the metrics endpoint.
//!
//! Each queue has its own [`QueueCounters`], written only by that queue's thread and read by
//! anyone: plain atomic loads and stores (no read-modify-write, no lock, no shared cache
//! line between queues), so counting costs the data path a few stores per request. Readers
//! see each counter exactly; counters taken together may be a request apart.

use std::sync::atomic::{AtomicU64, Ordering};

use serde::Serialize;

use crate::virtio_blk::{status, RequestType};

/// Request types by name, in the order of [`QueueCounters::ops`]; a type's index.
pub use crate::virtio_blk::{op_index, OPS};

/// Latency histogram buckets: bucket `i` counts requests that took less than `2^i`
/// microseconds (the last one: any longer, i.e. 2^(BUCKETS-2) us = 33 s and more).
pub const BUCKETS: usize = 27;

/// Completion statuses counted: OK, IOERR, UNSUPP.
pub const STATUSES: [&str; 3] = ["ok", "ioerr", "unsupp"];

/// Add `n` to a counter only this thread writes.
fn bump(c: &AtomicU64, n: u64) {
    c.store(c.load(Ordering::Relaxed).wrapping_add(n), Ordering::Relaxed);
}

/// One request type's counters on one queue.
#[derive(Default, Debug)]
pub struct OpCounters {
    pub requests: AtomicU64,
    /// Bytes transferred by requests that completed OK (reads and writes).
    pub bytes: AtomicU64,
    pub latency_buckets: [AtomicU64; BUCKETS],
    /// Sum and maximum of latencies, microseconds.
    pub latency_sum_us: AtomicU64,
    pub latency_max_us: AtomicU64,
}

/// One queue's counters.
#[derive(Default, Debug)]
pub struct QueueCounters {
    pub ops: [OpCounters; 6],
    /// Requests by completion status ([`STATUSES`]).
    pub statuses: [AtomicU64; 3],
    /// Requests taken from the ring and not yet completed.
    pub in_flight: AtomicU64,
    /// Times the queue thread was woken by an event (a guest kick, a completion signal).
    pub wakeups: AtomicU64,
    /// Times busy-polling found work (each one a wake-up saved).
    pub poll_hits: AtomicU64,
    /// The poll window now, microseconds (`--poll-us`; adapted with `auto`).
    pub poll_window_us: AtomicU64,
    /// Each in-flight request's start and what it waits for (the stuck-request watchdog).
    pub watch: crate::watchdog::QueueWatch,
}

impl QueueCounters {
    /// Counters for a queue of `slots` requests.
    pub fn with_slots(slots: usize) -> Self {
        QueueCounters {
            watch: crate::watchdog::QueueWatch::new(slots),
            ..QueueCounters::default()
        }
    }

    /// A request of `kind` completed with `st` after `us` microseconds, `bytes` transferred.
    pub fn record(&self, kind: RequestType, st: u8, bytes: u64, us: u64) {
        let o = &self.ops[op_index(kind)];
        bump(&o.requests, 1);
        if st == status::OK {
            bump(&o.bytes, bytes);
        }
        let b = (64 - us.leading_zeros() as usize).min(BUCKETS - 1);
        bump(&o.latency_buckets[b], 1);
        bump(&o.latency_sum_us, us);
        if us > o.latency_max_us.load(Ordering::Relaxed) {
            o.latency_max_us.store(us, Ordering::Relaxed);
        }
        let s = match st {
            status::OK => 0,
            status::IOERR => 1,
            _ => 2,
        };
        bump(&self.statuses[s], 1);
    }

    /// A chain refused before its type was known (or with a status but no request).
    pub fn record_refused(&self, st: u8) {
        bump(&self.statuses[if st == status::UNSUPP { 2 } else { 1 }], 1);
    }

    pub fn set_in_flight(&self, n: usize) {
        self.in_flight.store(n as u64, Ordering::Relaxed);
    }

    /// The queue thread woke for an event.
    pub fn record_wakeup(&self) {
        bump(&self.wakeups, 1);
    }

    /// A poll of `window` ended: `hits` times it found work.
    pub fn record_poll(&self, hits: u64, window: std::time::Duration) {
        bump(&self.poll_hits, hits);
        self.poll_window_us
            .store(window.as_micros() as u64, Ordering::Relaxed);
    }

    pub fn snapshot(&self) -> QueueSnapshot {
        let ld = |a: &AtomicU64| a.load(Ordering::Relaxed);
        QueueSnapshot {
            ops: self
                .ops
                .iter()
                .map(|o| OpSnapshot {
                    requests: ld(&o.requests),
                    bytes: ld(&o.bytes),
                    latency_buckets: o.latency_buckets.iter().map(ld).collect(),
                    latency_sum_us: ld(&o.latency_sum_us),
                    latency_max_us: ld(&o.latency_max_us),
                })
                .collect(),
            statuses: self.statuses.iter().map(ld).collect(),
            in_flight: ld(&self.in_flight),
            wakeups: ld(&self.wakeups),
            poll_hits: ld(&self.poll_hits),
            poll_window_us: ld(&self.poll_window_us),
            oldest_in_flight_us: self.watch.oldest_age_us(),
        }
    }
}

/// Counters of one request type, read at one moment.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OpSnapshot {
    pub requests: u64,
    pub bytes: u64,
    pub latency_buckets: Vec<u64>,
    pub latency_sum_us: u64,
    pub latency_max_us: u64,
}

impl OpSnapshot {
    fn add(&mut self, o: &OpSnapshot) {
        self.requests += o.requests;
        self.bytes += o.bytes;
        if self.latency_buckets.len() < o.latency_buckets.len() {
            self.latency_buckets.resize(o.latency_buckets.len(), 0);
        }
        for (a, b) in self.latency_buckets.iter_mut().zip(&o.latency_buckets) {
            *a += b;
        }
        self.latency_sum_us += o.latency_sum_us;
        self.latency_max_us = self.latency_max_us.max(o.latency_max_us);
    }

    /// The latency below which a fraction `q` of the requests completed: the upper bound of
    /// the histogram bucket it falls in (a power of two of microseconds; 0 without requests).
    pub fn quantile_us(&self, q: f64) -> u64 {
        let n: u64 = self.latency_buckets.iter().sum();
        if n == 0 {
            return 0;
        }
        let want = ((n as f64) * q).ceil().max(1.0) as u64;
        let mut seen = 0;
        for (i, c) in self.latency_buckets.iter().enumerate() {
            seen += c;
            if seen >= want {
                return if i + 1 == self.latency_buckets.len() {
                    self.latency_max_us
                } else {
                    (1u64 << i).min(self.latency_max_us.max(1))
                };
            }
        }
        self.latency_max_us
    }

    fn report(&self) -> OpReport {
        OpReport {
            requests: self.requests,
            bytes: self.bytes,
            latency_us: LatencyReport {
                p50: self.quantile_us(0.5),
                p99: self.quantile_us(0.99),
                max: self.latency_max_us,
                mean: self.latency_sum_us.checked_div(self.requests).unwrap_or(0),
            },
        }
    }
}

/// One queue's counters, read at one moment.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct QueueSnapshot {
    pub ops: Vec<OpSnapshot>,
    pub statuses: Vec<u64>,
    pub in_flight: u64,
    pub wakeups: u64,
    pub poll_hits: u64,
    /// A gauge: in a total, the largest of the queues'.
    pub poll_window_us: u64,
    /// The age of the oldest request in flight (0: none); in a total, the largest.
    pub oldest_in_flight_us: u64,
}

impl QueueSnapshot {
    /// The sum of several queues'.
    pub fn total(queues: &[QueueSnapshot]) -> QueueSnapshot {
        let mut t = QueueSnapshot {
            ops: vec![OpSnapshot::default(); OPS.len()],
            statuses: vec![0; STATUSES.len()],
            ..QueueSnapshot::default()
        };
        for q in queues {
            for (a, b) in t.ops.iter_mut().zip(&q.ops) {
                a.add(b);
            }
            for (a, b) in t.statuses.iter_mut().zip(&q.statuses) {
                *a += b;
            }
            t.in_flight += q.in_flight;
            t.wakeups += q.wakeups;
            t.poll_hits += q.poll_hits;
            t.poll_window_us = t.poll_window_us.max(q.poll_window_us);
            t.oldest_in_flight_us = t.oldest_in_flight_us.max(q.oldest_in_flight_us);
        }
        t
    }

    /// The `stats` answer's shape for this queue (or total).
    pub fn report(&self) -> QueueReport {
        QueueReport {
            requests: OPS
                .iter()
                .zip(&self.ops)
                .map(|(name, o)| ((*name).to_owned(), o.report()))
                .collect(),
            statuses: STATUSES
                .iter()
                .zip(&self.statuses)
                .map(|(name, n)| ((*name).to_owned(), *n))
                .collect(),
            bytes_read: self.ops[0].bytes,
            bytes_written: self.ops[1].bytes,
            in_flight: self.in_flight,
            oldest_in_flight_us: self.oldest_in_flight_us,
            wakeups: self.wakeups,
            poll_hits: self.poll_hits,
            poll_window_us: self.poll_window_us,
        }
    }
}

#[derive(Serialize, Debug)]
pub struct LatencyReport {
    pub p50: u64,
    pub p99: u64,
    pub max: u64,
    pub mean: u64,
}

#[derive(Serialize, Debug)]
pub struct OpReport {
    pub requests: u64,
    pub bytes: u64,
    pub latency_us: LatencyReport,
}

#[derive(Serialize, Debug)]
pub struct QueueReport {
    /// By request type.
    pub requests: std::collections::BTreeMap<String, OpReport>,
    /// Completed requests by status.
    pub statuses: std::collections::BTreeMap<String, u64>,
    pub bytes_read: u64,
    pub bytes_written: u64,
    pub in_flight: u64,
    /// How long the oldest request in flight has been (microseconds; 0: none).
    pub oldest_in_flight_us: u64,
    /// Times the queue thread woke for an event, and times polling found work instead.
    pub wakeups: u64,
    pub poll_hits: u64,
    pub poll_window_us: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_bytes_statuses_and_latency_buckets() {
        let q = QueueCounters::default();
        for us in [1, 3, 100, 100, 5000] {
            q.record(RequestType::In, status::OK, 4096, us);
        }
        q.record(RequestType::Out, status::IOERR, 4096, 10);
        q.record(RequestType::Flush, status::OK, 0, 0);
        let s = q.snapshot();
        assert_eq!(s.ops[0].requests, 5);
        assert_eq!(s.ops[0].bytes, 5 * 4096);
        assert_eq!(s.ops[1].requests, 1);
        assert_eq!(s.ops[1].bytes, 0, "failed writes transfer nothing");
        assert_eq!(s.statuses, vec![6, 1, 0]);
        assert_eq!(s.ops[0].latency_max_us, 5000);
        // 3 of 5 reads took at most 128 us; the 99th percentile is the slowest one's bucket.
        assert_eq!(s.ops[0].quantile_us(0.5), 128);
        assert_eq!(s.ops[0].quantile_us(0.99), 5000);
        let t = QueueSnapshot::total(&[s.clone(), s]);
        assert_eq!(t.ops[0].requests, 10);
        assert_eq!(t.report().bytes_read, 10 * 4096);
    }

    #[test]
    fn huge_latencies_land_in_the_last_bucket() {
        let q = QueueCounters::default();
        q.record(RequestType::In, status::OK, 0, u64::MAX);
        let s = q.snapshot();
        assert_eq!(s.ops[0].latency_buckets[BUCKETS - 1], 1);
        assert_eq!(s.ops[0].quantile_us(0.5), u64::MAX);
    }
}
