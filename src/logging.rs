//! Logging helpers. Rate-limited logging for the data path: a guest (or a failing disk)
//! that triggers a million errors must not fill the host's disk with log lines. Each call
//! site of [`log_limited!`] may log [`BURST`] lines per [`WINDOW`]; the rest are counted,
//! and the next line logged after the window says how many were suppressed. And
//! [`error_chain`]: an error with all its sources on one line (messages never repeat their
//! source, so logging only the top one would lose the cause).

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
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
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
