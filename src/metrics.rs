//! `--metrics-addr HOST:PORT`: the request counters ([`crate::stats`]) in the Prometheus /
//! OpenMetrics text format at `GET /metrics`, read at each scrape (nothing is kept or
//! computed between scrapes, and the data path does not know the endpoint exists).

use std::fmt;
use std::net::TcpListener;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use log::info;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;

use crate::device::Device;
use crate::http;
use crate::stats::{QueueSnapshot, BUCKETS, OPS, STATUSES};

/// Why the endpoint cannot be served.
#[derive(Debug, thiserror::Error)]
#[error("--metrics-addr {addr}: {message}")]
pub struct MetricsError {
    addr: String,
    message: String,
}

/// The collector: reads the device's counters at each scrape.
struct Vublk {
    dev: Arc<Device>,
}

impl fmt::Debug for Vublk {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Vublk")
    }
}

/// A counter value read once (prometheus-client encodes metrics, we have numbers).
struct Value(u64, MetricType);

impl EncodeMetric for Value {
    fn encode(&self, mut e: MetricEncoder) -> Result<(), fmt::Error> {
        match self.1 {
            MetricType::Counter => e.encode_counter::<NoLabelSet, _, u64>(&self.0, None),
            _ => e.encode_gauge(&(self.0 as i64)),
        }
    }

    fn metric_type(&self) -> MetricType {
        self.1
    }
}

fn family<'a>(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    ty: MetricType,
    series: impl IntoIterator<Item = (Vec<(&'a str, String)>, u64)>,
) -> Result<(), fmt::Error> {
    let mut m = enc.encode_descriptor(name, help, None, ty)?;
    let mut series = series.into_iter().peekable();
    if let Some((labels, v)) = series.next_if(|(l, _)| l.is_empty()) {
        // One series without labels.
        let _ = labels;
        return Value(v, ty).encode(m);
    }
    for (labels, v) in series {
        Value(v, ty).encode(m.encode_family(&labels)?)?;
    }
    Ok(())
}

impl Collector for Vublk {
    fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), fmt::Error> {
        let dev = &self.dev;
        let queues: Vec<QueueSnapshot> = dev.queue_stats.iter().map(|q| q.snapshot()).collect();
        let per_op = |pick: fn(&crate::stats::OpSnapshot) -> u64, only_rw: bool| {
            let mut v = Vec::new();
            for (qi, q) in queues.iter().enumerate() {
                for (oi, op) in OPS.iter().enumerate() {
                    if only_rw && oi > 1 {
                        continue;
                    }
                    v.push((
                        vec![("op", (*op).to_owned()), ("queue", qi.to_string())],
                        pick(&q.ops[oi]),
                    ));
                }
            }
            v
        };
        family(
            &mut enc,
            "vublk_requests",
            "Requests completed, by type and queue",
            MetricType::Counter,
            per_op(|o| o.requests, false),
        )?;
        family(
            &mut enc,
            "vublk_bytes",
            "Bytes read and written by requests that completed OK",
            MetricType::Counter,
            per_op(|o| o.bytes, true),
        )?;
        let mut errors = Vec::new();
        for (qi, q) in queues.iter().enumerate() {
            for (si, st) in STATUSES.iter().enumerate().skip(1) {
                errors.push((
                    vec![("status", (*st).to_owned()), ("queue", qi.to_string())],
                    q.statuses[si],
                ));
            }
        }
        family(
            &mut enc,
            "vublk_errors",
            "Requests completed with an error status",
            MetricType::Counter,
            errors,
        )?;
        family(
            &mut enc,
            "vublk_in_flight",
            "Requests taken from the ring and not completed",
            MetricType::Gauge,
            queues
                .iter()
                .enumerate()
                .map(|(qi, q)| (vec![("queue", qi.to_string())], q.in_flight)),
        )?;
        family(
            &mut enc,
            "vublk_queue_wakeups",
            "Times a queue thread was woken by an event (guest kick, completion signal)",
            MetricType::Counter,
            queues
                .iter()
                .enumerate()
                .map(|(qi, q)| (vec![("queue", qi.to_string())], q.wakeups)),
        )?;
        family(
            &mut enc,
            "vublk_poll_hits",
            "Times busy-polling found work (a wake-up saved)",
            MetricType::Counter,
            queues
                .iter()
                .enumerate()
                .map(|(qi, q)| (vec![("queue", qi.to_string())], q.poll_hits)),
        )?;
        family(
            &mut enc,
            "vublk_poll_window_microseconds",
            "A queue's busy-poll window now (--poll-us; adapted with auto)",
            MetricType::Gauge,
            queues
                .iter()
                .enumerate()
                .map(|(qi, q)| (vec![("queue", qi.to_string())], q.poll_window_us)),
        )?;
        // Seconds, as Prometheus measures time (a float gauge).
        let mut m = enc.encode_descriptor(
            "vublk_oldest_request_age_seconds",
            "How long the oldest request in flight on the queue has been (0: none)",
            None,
            MetricType::Gauge,
        )?;
        for (qi, q) in queues.iter().enumerate() {
            let labels = [("queue", qi.to_string())];
            m.encode_family(&labels)?
                .encode_gauge(&(q.oldest_in_flight_us as f64 / 1e6))?;
        }
        family(
            &mut enc,
            "vublk_capacity_bytes",
            "Size of the disk the guest sees",
            MetricType::Gauge,
            [(vec![], dev.size_bytes())],
        )?;
        family(
            &mut enc,
            "vublk_frontend_connected",
            "1 while a frontend is connected",
            MetricType::Gauge,
            [(
                vec![],
                u64::from(dev.frontend_connected.load(Ordering::Relaxed)),
            )],
        )?;
        held(&mut enc, &dev.holds)?;
        let z = &dev.zero_stats;
        family(
            &mut enc,
            "vublk_zero_writes",
            "Guest writes found all-zero and turned into zero operations",
            MetricType::Counter,
            [(vec![], z.zero_writes.load(Ordering::Relaxed))],
        )?;
        // Backups: per checkpoint.
        let backups = dev.backups.list();
        let per_backup = |pick: fn(&crate::backup::BackupInfo) -> u64| {
            backups
                .iter()
                .map(|b| (vec![("checkpoint", b.checkpoint.clone())], pick(b)))
                .collect::<Vec<_>>()
        };
        family(
            &mut enc,
            "vublk_backups",
            "Backups running",
            MetricType::Gauge,
            [(vec![], backups.len() as u64)],
        )?;
        family(
            &mut enc,
            "vublk_backup_read_bytes",
            "Bytes of a backup's export read by its clients",
            MetricType::Counter,
            per_backup(|b| b.bytes_read),
        )?;
        family(
            &mut enc,
            "vublk_backup_size_bytes",
            "Size of a backup's point-in-time view",
            MetricType::Gauge,
            per_backup(|b| b.size),
        )?;
        family(
            &mut enc,
            "vublk_backup_copied_bytes",
            "Bytes a backup copied before guest writes changed them",
            MetricType::Counter,
            per_backup(|b| b.copied_bytes),
        )?;
        family(
            &mut enc,
            "vublk_backup_scratch_bytes",
            "Scratch bytes a backup uses",
            MetricType::Gauge,
            per_backup(|b| b.scratch_used),
        )?;
        family(
            &mut enc,
            "vublk_backup_failed",
            "1 when a backup failed (backup-list says why)",
            MetricType::Gauge,
            per_backup(|b| u64::from(b.failed.is_some())),
        )?;
        // Block jobs: per job.
        let jobs = dev.jobs.list();
        let per_job = |pick: fn(&crate::jobs::JobInfo) -> u64| {
            jobs.iter()
                .map(|j| {
                    (
                        vec![("id", j.id.clone()), ("type", j.kind.to_owned())],
                        pick(j),
                    )
                })
                .collect::<Vec<_>>()
        };
        family(
            &mut enc,
            "vublk_jobs_running",
            "Block jobs running (not concluded)",
            MetricType::Gauge,
            [(
                vec![],
                jobs.iter()
                    .filter(|j| j.state != crate::jobs::State::Concluded)
                    .count() as u64,
            )],
        )?;
        family(
            &mut enc,
            "vublk_job_done_bytes",
            "Bytes of a block job's work done",
            MetricType::Gauge,
            per_job(|j| j.bytes_done),
        )?;
        family(
            &mut enc,
            "vublk_job_total_bytes",
            "Bytes of a block job's work in all",
            MetricType::Gauge,
            per_job(|j| j.bytes_total),
        )?;
        family(
            &mut enc,
            "vublk_job_failed",
            "1 when a concluded block job ended with an error (jobs says which)",
            MetricType::Gauge,
            per_job(|j| u64::from(j.error.is_some())),
        )?;
        // Latency: the queues' histograms summed, per request type.
        let total = QueueSnapshot::total(&queues);
        let mut m = enc.encode_descriptor(
            "vublk_request_duration_seconds",
            "Time from taking a request from the ring to completing it",
            None,
            MetricType::Histogram,
        )?;
        for (oi, op) in OPS.iter().enumerate() {
            let o = &total.ops[oi];
            let buckets: Vec<(f64, u64)> = (0..BUCKETS)
                .map(|i| {
                    let le = if i + 1 == BUCKETS {
                        f64::MAX
                    } else {
                        (1u64 << i) as f64 / 1e6
                    };
                    (le, o.latency_buckets.get(i).copied().unwrap_or(0))
                })
                .collect();
            let count = buckets.iter().map(|b| b.1).sum();
            let labels = [("op", (*op).to_owned())];
            m.encode_family(&labels)?.encode_histogram::<NoLabelSet>(
                o.latency_sum_us as f64 / 1e6,
                count,
                &buckets,
                None,
            )?;
        }
        Ok(())
    }
}

/// The error policy's families (`crate::hold`).
fn held(enc: &mut DescriptorEncoder, h: &crate::hold::Holds) -> Result<(), fmt::Error> {
    let now = h.now();
    family(
        enc,
        "vublk_held_requests",
        "Requests the error policy holds now (--werror, --rerror)",
        MetricType::Gauge,
        [(vec![], now.map_or(0, |n| n.requests as u64))],
    )?;
    family(
        enc,
        "vublk_held_errno",
        "The host errno that started the hold now (0: nothing held)",
        MetricType::Gauge,
        [(vec![], now.map_or(0, |n| n.errno as u64))],
    )?;
    family(
        enc,
        "vublk_held_seconds",
        "Seconds since the hold now started (0: nothing held)",
        MetricType::Gauge,
        [(vec![], now.map_or(0, |n| n.seconds() as u64))],
    )?;
    for (name, help, v) in [
        (
            "vublk_holds",
            "Hold episodes (from the first request held to none)",
            &h.episodes,
        ),
        (
            "vublk_held",
            "Requests ever held by the error policy",
            &h.held_total,
        ),
        ("vublk_held_retries", "Retries of held requests", &h.retries),
        (
            "vublk_held_given_up",
            "Held requests answered with an I/O error (stop-holding, or a stop without an \
             inflight region)",
            &h.given_up,
        ),
    ] {
        family(
            enc,
            name,
            help,
            MetricType::Counter,
            [(vec![], v.load(Ordering::Relaxed))],
        )?;
    }
    Ok(())
}

/// The text a scrape gets.
pub fn render(dev: &Arc<Device>) -> String {
    let mut r = Registry::default();
    r.register_collector(Box::new(Vublk { dev: dev.clone() }));
    let mut out = String::new();
    if prometheus_client::encoding::text::encode(&mut out, &r).is_err() {
        out.clear();
    }
    out
}

/// The content type of the metrics (the OpenMetrics text format).
const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Serve `GET /metrics` on `addr` for the life of the process, with the limits of
/// [`crate::http`] (connections, request heads, timeouts).
pub fn serve(addr: &str, dev: Arc<Device>) -> Result<(), MetricsError> {
    let err = |message: String| MetricsError {
        addr: addr.to_owned(),
        message,
    };
    let listener = TcpListener::bind(addr).map_err(|e| err(e.to_string()))?;
    info!("metrics on http://{addr}/metrics");
    http::spawn(listener, http::LIMITS, move |req| answer(req, &dev))
        .map_err(|e| err(e.to_string()))
}

/// `GET /metrics`: the metrics; another path: 404; another method: 405.
fn answer(req: &http::Request, dev: &Arc<Device>) -> http::Response {
    if req.path != "/metrics" {
        http::Response::text(404, "not found: the metrics are at /metrics\n")
    } else if req.method != "GET" {
        let mut r = http::Response::text(405, "only GET\n");
        r.headers.push(("Allow", "GET"));
        r
    } else {
        http::Response {
            status: 200,
            content_type: OPENMETRICS,
            headers: Vec::new(),
            body: render(dev),
        }
    }
}
