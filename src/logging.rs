//! Logging helpers. Rate-limited logging for the data path: a guest (or a failing disk)
//! that triggers a million errors must not fill the host's disk with log lines. Each call
//! site of [`log_limited!`] may log [`BURST`] lines per [`WINDOW`]; the rest are counted,
//! and the next line logged after the window says how many were suppressed. And
//! [`error_chain`]: an error with all its sources on one line (messages never repeat their
//! source, so logging only the top one would lose the cause).

use crate::locks::Locked;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// `e` and every source, colon-separated.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut msg = e.to_string();
    let mut src = e.source();
    while let Some(s) = src {
        msg.push_str(": ");
        msg.push_str(&s.to_string());
        src = s.source();
    }
    msg
}

/// Lines per call site and window.
pub const BURST: u32 = 10;
/// The window.
pub const WINDOW: Duration = Duration::from_secs(10);

/// One call site's budget.
#[derive(Debug)]
pub struct RateLimit {
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    window_start: Option<Instant>,
    in_window: u32,
    suppressed: u64,
}

impl Default for RateLimit {
    fn default() -> Self {
        Self::new()
    }
}

impl RateLimit {
    pub const fn new() -> Self {
        RateLimit {
            state: Mutex::new(State {
                window_start: None,
                in_window: 0,
                suppressed: 0,
            }),
        }
    }

    /// May a line be logged now? Some(n): yes, and `n` lines were suppressed before it.
    pub fn check(&self) -> Option<u64> {
        self.check_at(Instant::now())
    }

    fn check_at(&self, now: Instant) -> Option<u64> {
        let mut st = self.state.locked();
        let start = *st.window_start.get_or_insert(now);
        if now.duration_since(start) >= WINDOW {
            st.window_start = Some(now);
            st.in_window = 0;
        }
        if st.in_window >= BURST {
            st.suppressed += 1;
            return None;
        }
        st.in_window += 1;
        Some(std::mem::take(&mut st.suppressed))
    }
}

/// `log::log!` with a per-call-site budget (see the module docs).
#[macro_export]
macro_rules! log_limited {
    ($level:expr, $($arg:tt)+) => {{
        static LIMIT: $crate::logging::RateLimit = $crate::logging::RateLimit::new();
        if log::log_enabled!($level) {
            if let Some(suppressed) = LIMIT.check() {
                if suppressed > 0 {
                    log::log!($level, "({suppressed} similar messages suppressed)");
                }
                log::log!($level, $($arg)+);
            }
        }
    }};
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_then_silence_then_the_suppressed_count() {
        let l = RateLimit::new();
        let t0 = Instant::now();
        for _ in 0..BURST {
            assert_eq!(l.check_at(t0), Some(0));
        }
        for _ in 0..1000 {
            assert_eq!(l.check_at(t0 + Duration::from_secs(1)), None);
        }
        assert_eq!(l.check_at(t0 + WINDOW), Some(1000));
        assert_eq!(l.check_at(t0 + WINDOW), Some(0));
    }
}

/// `--log-format json`: one JSON object per line (timestamp, level, target, message, and
/// `queue` when the line is about one queue: its message starts "queue N:").
pub fn json_format(
    buf: &mut env_logger::fmt::Formatter,
    record: &log::Record,
) -> std::io::Result<()> {
    use std::io::Write;
    let line = json_line(&buf.timestamp_micros().to_string(), record);
    writeln!(buf, "{line}")
}

fn json_line(timestamp: &str, record: &log::Record) -> String {
    let message = record.args().to_string();
    let mut o = serde_json::Map::new();
    o.insert("timestamp".into(), timestamp.into());
    o.insert(
        "level".into(),
        record.level().as_str().to_ascii_lowercase().into(),
    );
    o.insert("target".into(), record.target().into());
    let queue = message
        .strip_prefix("queue ")
        .and_then(|m| m.split(':').next())
        .and_then(|n| n.parse::<u64>().ok());
    if let Some(q) = queue {
        o.insert("queue".into(), q.into());
    }
    o.insert("message".into(), message.into());
    serde_json::Value::Object(o).to_string()
}

#[cfg(test)]
mod json_tests {
    #[test]
    fn a_json_line_has_the_fields_and_escapes_the_message() {
        let line = super::json_line(
            "2026-12-02T10:00:00.000001Z",
            &log::Record::builder()
                .level(log::Level::Warn)
                .target("vublk::worker")
                .args(format_args!("queue 3: add_used: \"bad\"\nindex"))
                .build(),
        );
        assert!(!line.contains('\n'));
        let v: serde_json::Value = serde_json::from_str(&line).unwrap();
        assert_eq!(v["timestamp"], "2026-12-02T10:00:00.000001Z");
        assert_eq!(v["level"], "warn");
        assert_eq!(v["target"], "vublk::worker");
        assert_eq!(v["queue"], 3);
        assert_eq!(v["message"], "queue 3: add_used: \"bad\"\nindex");
    }
}
