//! `vublk ctl top`: what the disk is doing, per queue and in total, from two `stats` answers
//! an interval apart (like `iostat -x 1`): IOPS, read and write throughput, latency p50/p99
//! over the interval (from the histograms' differences) and requests in flight. A live
//! terminal view refreshed every interval (ratatui; `q`, Esc or Ctrl-C quits), or with
//! `--once` one frame as plain text for scripts.

use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::stats::OPS;

/// One queue's (or the total's) rates over an interval.
#[derive(Clone, Debug, PartialEq)]
pub struct Row {
    /// The queue's index; None: the total.
    pub queue: Option<usize>,
    pub iops: f64,
    pub read_bps: f64,
    pub write_bps: f64,
    /// Upper bounds of the histogram buckets the quantiles fall in (None: no request).
    pub p50_us: Option<u64>,
    pub p99_us: Option<u64>,
    pub in_flight: u64,
}

/// A `stats` answer with histograms, and when it was taken.
struct Sample {
    at: Instant,
    v: Value,
}

fn sample(socket: &Path) -> Result<Sample, String> {
    let v = crate::control::client(socket, "stats", json!({"histograms": true}))?;
    Ok(Sample {
        at: Instant::now(),
        v,
    })
}

fn num(v: &Value) -> u64 {
    v.as_u64().unwrap_or(0)
}

/// The rows between two answers (`a` before `b`): every queue, then the total.
fn rows(a: &Value, b: &Value, dt: Duration) -> Vec<Row> {
    let secs = dt.as_secs_f64().max(1e-3);
    let row = |queue: Option<usize>, qa: &Value, qb: &Value| {
        let d = |f: &dyn Fn(&Value) -> u64| num_delta(f(qb), f(qa));
        let requests: u64 = OPS
            .iter()
            .filter(|&&op| op != "get_id")
            .map(|op| d(&|q: &Value| num(&q["requests"][*op]["requests"])))
            .sum();
        // Latency of reads and writes together, over the interval.
        let mut buckets = Vec::new();
        for op in ["read", "write"] {
            let (ba, bb) = (
                &qa["requests"][op]["latency_buckets"],
                &qb["requests"][op]["latency_buckets"],
            );
            let bb = bb.as_array().map(Vec::as_slice).unwrap_or(&[]);
            if buckets.len() < bb.len() {
                buckets.resize(bb.len(), 0);
            }
            for (i, x) in bb.iter().enumerate() {
                buckets[i] += num_delta(num(x), num(&ba[i]));
            }
        }
        Row {
            queue,
            iops: requests as f64 / secs,
            read_bps: d(&|q: &Value| num(&q["bytes_read"])) as f64 / secs,
            write_bps: d(&|q: &Value| num(&q["bytes_written"])) as f64 / secs,
            p50_us: quantile_us(&buckets, 0.5),
            p99_us: quantile_us(&buckets, 0.99),
            in_flight: num(&qb["in_flight"]),
        }
    };
    let empty = Vec::new();
    let qa = a["queues"].as_array().unwrap_or(&empty);
    let qb = b["queues"].as_array().unwrap_or(&empty);
    let mut out: Vec<Row> = qb
        .iter()
        .enumerate()
        .map(|(i, q)| row(Some(i), qa.get(i).unwrap_or(&Value::Null), q))
        .collect();
    out.push(row(None, &a["total"], &b["total"]));
    out
}

/// A counter's growth (a daemon restarted in between counts from zero again).
fn num_delta(now: u64, before: u64) -> u64 {
    now.checked_sub(before).unwrap_or(now)
}

/// The upper bound (us) of the bucket holding quantile `q`; bucket `i` counts requests under
/// 2^i us.
pub fn quantile_us(buckets: &[u64], q: f64) -> Option<u64> {
    let n: u64 = buckets.iter().sum();
    if n == 0 {
        return None;
    }
    let rank = ((n as f64) * q).ceil().max(1.0) as u64;
    let mut seen = 0;
    for (i, c) in buckets.iter().enumerate() {
        seen += c;
        if seen >= rank {
            return Some(1u64 << i.min(62));
        }
    }
    Some(1u64 << (buckets.len().min(63) - 1))
}

fn cells(r: &Row) -> [String; 7] {
    let q = |v: Option<u64>| v.map_or("-".to_owned(), |u| format!("<{u}"));
    [
        r.queue.map_or("total".to_owned(), |i| i.to_string()),
        format!("{:.0}", r.iops),
        format!("{:.1}", r.read_bps / 1e6),
        format!("{:.1}", r.write_bps / 1e6),
        q(r.p50_us),
        q(r.p99_us),
        r.in_flight.to_string(),
    ]
}

const HEADER: [&str; 7] = [
    "queue",
    "IOPS",
    "read MB/s",
    "write MB/s",
    "p50 us",
    "p99 us",
    "in flight",
];

/// One frame as text: a header line and a line per row, columns separated by spaces.
pub fn text_frame(rows: &[Row]) -> String {
    let mut out = String::new();
    let line = |c: &[String]| {
        format!(
            "{:<6} {:>10} {:>10} {:>10} {:>9} {:>9} {:>9}\n",
            c[0], c[1], c[2], c[3], c[4], c[5], c[6]
        )
    };
    out.push_str(&line(&HEADER.map(str::to_owned)));
    for r in rows {
        out.push_str(&line(&cells(r)));
    }
    out
}

/// One line per block job in a `stats` answer: type, state, progress, speed limit, error.
pub fn job_lines(v: &Value) -> Vec<String> {
    let empty = Vec::new();
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    v["jobs"]
        .as_array()
        .unwrap_or(&empty)
        .iter()
        .map(|j| {
            let (done, total) = (num(&j["bytes_done"]), num(&j["bytes_total"]).max(1));
            let mut l = format!(
                "job {} ({}): {}, {:.1} of {:.1} MiB ({:.0}%)",
                j["id"].as_str().unwrap_or("?"),
                j["type"].as_str().unwrap_or("?"),
                j["state"].as_str().unwrap_or("?"),
                mib(done),
                mib(total),
                100.0 * done as f64 / total as f64,
            );
            match num(&j["speed"]) {
                0 => {}
                s => l.push_str(&format!(", at most {:.1} MiB/s", mib(s))),
            }
            if let Some(e) = j["error"].as_str() {
                l.push_str(&format!(", ERROR: {e}"));
            }
            l
        })
        .collect()
}

/// One line per running backup in a `stats` answer: progress (bytes read of the size),
/// bytes copied before writes, scratch used, clients, and why it failed.
pub fn backup_lines(v: &Value) -> Vec<String> {
    let empty = Vec::new();
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    v["backups"]
        .as_array()
        .unwrap_or(&empty)
        .iter()
        .map(|b| {
            let (read, size) = (num(&b["bytes_read"]), num(&b["size"]).max(1));
            let mut l = format!(
                "backup {}: read {:.1} of {:.1} MiB ({:.0}%), copied {:.1} MiB, scratch {:.1} MiB, {} client(s)",
                b["checkpoint"].as_str().unwrap_or("?"),
                mib(read),
                mib(size),
                100.0 * read as f64 / size as f64,
                mib(num(&b["copied_bytes"])),
                mib(num(&b["scratch_used"])),
                b["clients"].as_array().map_or(0, Vec::len),
            );
            if let Some(f) = b["failed"].as_str() {
                l.push_str(&format!(", FAILED: {f}"));
            }
            l
        })
        .collect()
}

/// `vublk ctl top`.
pub fn run(socket: &Path, once: bool, interval: Duration) -> Result<(), String> {
    use std::io::IsTerminal;
    if once {
        let a = sample(socket)?;
        std::thread::sleep(interval);
        let b = sample(socket)?;
        print!("{}", text_frame(&rows(&a.v, &b.v, b.at - a.at)));
        for l in backup_lines(&b.v).into_iter().chain(job_lines(&b.v)) {
            println!("{l}");
        }
        return Ok(());
    }
    if !std::io::stdout().is_terminal() {
        return Err("the live view needs a terminal (use --once for one frame as text)".into());
    }
    live(socket, interval)
}

fn live(socket: &Path, interval: Duration) -> Result<(), String> {
    use ratatui::crossterm::event::{self, Event, KeyCode, KeyModifiers};
    use ratatui::layout::Constraint;
    use ratatui::style::{Modifier, Style};
    use ratatui::widgets::{Block, Row as TRow, Table};

    let mut prev = sample(socket)?;
    // SIGTERM, SIGINT and SIGHUP end the view like `q` does, so the terminal is restored
    // (blocked here and taken in the loop below; the raw terminal turns Ctrl-C into a key).
    let quit = block_quit_signals();
    let mut terminal = ratatui::init();
    let result = (|| -> Result<(), String> {
        let mut shown: Vec<Row> = Vec::new();
        let mut status = format!("{}: waiting for the first interval", socket.display());
        loop {
            terminal
                .draw(|f| {
                    let widths = [
                        Constraint::Length(6),
                        Constraint::Length(10),
                        Constraint::Length(10),
                        Constraint::Length(10),
                        Constraint::Length(9),
                        Constraint::Length(9),
                        Constraint::Length(9),
                    ];
                    let rows = shown.iter().map(|r| {
                        let row = TRow::new(cells(r));
                        if r.queue.is_none() {
                            row.style(Style::default().add_modifier(Modifier::BOLD))
                        } else {
                            row
                        }
                    });
                    let t = Table::new(rows, widths)
                        .header(
                            TRow::new(HEADER).style(Style::default().add_modifier(Modifier::BOLD)),
                        )
                        .block(
                            Block::bordered()
                                .title(format!(" vublk top: {status} "))
                                .title_bottom(" q: quit "),
                        );
                    f.render_widget(t, f.area());
                })
                .map_err(|e| e.to_string())?;
            // Wait out the interval, answering keys meanwhile.
            let until = prev.at + interval;
            while let Some(left) = until.checked_duration_since(Instant::now()) {
                if quit_signal_pending(&quit) {
                    return Ok(());
                }
                if event::poll(left.min(Duration::from_millis(100))).map_err(|e| e.to_string())? {
                    if let Event::Key(k) = event::read().map_err(|e| e.to_string())? {
                        let ctrl_c = k.code == KeyCode::Char('c')
                            && k.modifiers.contains(KeyModifiers::CONTROL);
                        if matches!(k.code, KeyCode::Char('q') | KeyCode::Esc) || ctrl_c {
                            return Ok(());
                        }
                    }
                }
            }
            match sample(socket) {
                Ok(next) => {
                    shown = rows(&prev.v, &next.v, next.at - prev.at);
                    status = format!(
                        "{}, every {:.1} s",
                        socket.display(),
                        interval.as_secs_f64()
                    );
                    for l in backup_lines(&next.v) {
                        status.push_str(" | ");
                        status.push_str(&l);
                    }
                    prev = next;
                }
                Err(e) => {
                    // The daemon went away (or restarts): say so and keep trying.
                    status = format!("{}: {e}", socket.display());
                    prev.at = Instant::now();
                }
            }
        }
    })();
    ratatui::restore();
    result
}

/// Block SIGTERM, SIGINT and SIGHUP in this (the only) thread.
fn block_quit_signals() -> libc::sigset_t {
    // SAFETY: sigset manipulation on a local, then pthread_sigmask for this thread.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for s in [libc::SIGTERM, libc::SIGINT, libc::SIGHUP] {
            libc::sigaddset(&mut set, s);
        }
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        set
    }
}

/// Has one of `set` arrived (it is consumed)?
fn quit_signal_pending(set: &libc::sigset_t) -> bool {
    let zero = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: valid set and timeout; no siginfo wanted.
    unsafe { libc::sigtimedwait(set, std::ptr::null_mut(), &zero) > 0 }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(reads: u64, bytes: u64, buckets: &[u64], in_flight: u64) -> Value {
        let q = json!({
            "requests": {
                "read": {"requests": reads, "latency_buckets": buckets},
                "write": {"requests": 0, "latency_buckets": []},
            },
            "bytes_read": bytes, "bytes_written": 0, "in_flight": in_flight,
        });
        json!({"total": q, "queues": [q]})
    }

    #[test]
    fn rates_and_quantiles_cover_the_interval_only() {
        // Before: 100 slow reads (bucket 10: under 1024 us). Then 1000 fast ones in 2 s.
        let a = answer(100, 100 * 4096, &[0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 100], 0);
        let b = answer(1100, 1100 * 4096, &[0, 0, 0, 0, 0, 0, 980, 0, 0, 0, 120], 3);
        let r = rows(&a, &b, Duration::from_secs(2));
        assert_eq!(r.len(), 2);
        assert_eq!(r[1].queue, None);
        for row in &r {
            assert_eq!(row.iops, 500.0);
            assert_eq!(row.read_bps, 500.0 * 4096.0);
            assert_eq!(row.p50_us, Some(64));
            assert_eq!(row.p99_us, Some(1024));
            assert_eq!(row.in_flight, 3);
        }
        let frame = text_frame(&r);
        assert_eq!(frame.lines().count(), 3);
        assert!(frame.lines().nth(2).unwrap().starts_with("total"));
        // Nothing happened: no quantile.
        let idle = rows(&b, &b, Duration::from_secs(1));
        assert_eq!(idle[0].iops, 0.0);
        assert_eq!(idle[0].p50_us, None);
    }
}
