//! The error policy (`--werror`, `--rerror`, `--error-retry-interval`): which host errors
//! *hold* a request instead of failing it, and the device-wide state of the requests held.
//!
//! A held request keeps its slot and is not completed; while any is held, no queue takes a
//! new request from its ring (the device pauses, as QEMU pauses the VM on `werror=enospc`),
//! so nothing the guest sends later can be overtaken by a held write's retry. The queues
//! retry their held requests every retry interval and on `ctl resume`; `ctl stop-holding`
//! answers them with IOERR. The queue side is `worker::hold`; docs/error-policy.md is the
//! user's page.

use std::sync::atomic::{AtomicI32, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::virtio_blk::RequestType;

/// `--werror`: which host errors of writes, write-zeroes, discards and flushes are held.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
#[repr(u8)]
pub enum WritePolicy {
    /// None: every host error is the guest's IOERR.
    Report = 0,
    /// "No space left on device" (ENOSPC) and "Disk quota exceeded" (EDQUOT).
    Enospc = 1,
    /// Every host error.
    Hold = 2,
}

/// `--rerror`: which host errors of reads are held.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
#[repr(u8)]
pub enum ReadPolicy {
    /// None.
    Report = 0,
    /// Every host error.
    Hold = 2,
}

/// The default `--error-retry-interval`.
pub const DEFAULT_RETRY: Duration = Duration::from_secs(5);

/// The device's error policy and the requests it holds now, over all queues.
#[derive(Debug)]
pub struct Holds {
    werror: AtomicU8,
    rerror: AtomicU8,
    /// Milliseconds between retries (0: only on `resume`).
    retry_ms: AtomicU64,
    /// Requests held now (a retried one counts until it completes).
    count: AtomicUsize,
    /// The errno that started the episode (0: none held).
    errno: AtomicI32,
    /// When it started, in milliseconds since the Unix epoch (0: none held).
    since_ms: AtomicU64,
    /// Bumped by `resume` and `stop-holding`: the queues act when they see it change.
    resume_gen: AtomicU64,
    give_up_gen: AtomicU64,
    /// Episodes (from the first request held to none held), requests ever held, held
    /// requests answered with IOERR (`stop-holding`), retries.
    pub episodes: AtomicU64,
    pub held_total: AtomicU64,
    pub given_up: AtomicU64,
    pub retries: AtomicU64,
}

impl Default for Holds {
    fn default() -> Self {
        Holds {
            werror: AtomicU8::new(WritePolicy::Enospc as u8),
            rerror: AtomicU8::new(ReadPolicy::Report as u8),
            retry_ms: AtomicU64::new(DEFAULT_RETRY.as_millis() as u64),
            count: AtomicUsize::new(0),
            errno: AtomicI32::new(0),
            since_ms: AtomicU64::new(0),
            resume_gen: AtomicU64::new(0),
            give_up_gen: AtomicU64::new(0),
            episodes: AtomicU64::new(0),
            held_total: AtomicU64::new(0),
            given_up: AtomicU64::new(0),
            retries: AtomicU64::new(0),
        }
    }
}

/// What `status`, the metrics and the service status show.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Held {
    pub requests: usize,
    pub errno: i32,
    /// Milliseconds since the Unix epoch.
    pub since_ms: u64,
}

impl Held {
    /// How the errno reads ("No space left on device").
    pub fn error(&self) -> String {
        errno_text(self.errno)
    }

    /// Seconds since the episode started.
    pub fn seconds(&self) -> f64 {
        now_ms().saturating_sub(self.since_ms) as f64 / 1000.0
    }
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// The C library's text for `errno`, without the "(os error N)" std adds.
pub fn errno_text(errno: i32) -> String {
    let s = std::io::Error::from_raw_os_error(errno).to_string();
    match s.find(" (os error") {
        Some(i) => s[..i].to_owned(),
        None => s,
    }
}

impl Holds {
    pub fn set_policy(&self, werror: WritePolicy, rerror: ReadPolicy, retry: Duration) {
        self.werror.store(werror as u8, Ordering::Relaxed);
        self.rerror.store(rerror as u8, Ordering::Relaxed);
        self.retry_ms
            .store(retry.as_millis() as u64, Ordering::Relaxed);
    }

    pub fn werror(&self) -> WritePolicy {
        match self.werror.load(Ordering::Relaxed) {
            0 => WritePolicy::Report,
            2 => WritePolicy::Hold,
            _ => WritePolicy::Enospc,
        }
    }

    pub fn rerror(&self) -> ReadPolicy {
        match self.rerror.load(Ordering::Relaxed) {
            2 => ReadPolicy::Hold,
            _ => ReadPolicy::Report,
        }
    }

    /// The retry interval (None: only on `resume`).
    pub fn retry_interval(&self) -> Option<Duration> {
        match self.retry_ms.load(Ordering::Relaxed) {
            0 => None,
            ms => Some(Duration::from_millis(ms)),
        }
    }

    /// Does the policy hold a request of `kind` that failed on the host with `errno`?
    pub fn holds(&self, kind: RequestType, errno: i32) -> bool {
        match kind {
            RequestType::In => self.rerror() == ReadPolicy::Hold,
            RequestType::Out
            | RequestType::Flush
            | RequestType::WriteZeroes
            | RequestType::Discard => match self.werror() {
                WritePolicy::Report => false,
                WritePolicy::Enospc => errno == libc::ENOSPC || errno == libc::EDQUOT,
                WritePolicy::Hold => true,
            },
            _ => false,
        }
    }

    /// Is anything held (no queue takes new requests then)?
    pub fn paused(&self) -> bool {
        self.count.load(Ordering::Acquire) > 0
    }

    /// What is held now (None: nothing).
    pub fn now(&self) -> Option<Held> {
        let requests = self.count.load(Ordering::Acquire);
        (requests > 0).then(|| Held {
            requests,
            errno: self.errno.load(Ordering::Relaxed),
            since_ms: self.since_ms.load(Ordering::Relaxed),
        })
    }

    /// A request failed with `errno` is held from now on.
    pub fn hold(&self, errno: i32, what: &str) {
        self.held_total.fetch_add(1, Ordering::Relaxed);
        if self.count.fetch_add(1, Ordering::AcqRel) == 0 {
            self.errno.store(errno, Ordering::Relaxed);
            self.since_ms.store(now_ms(), Ordering::Relaxed);
            self.episodes.fetch_add(1, Ordering::Relaxed);
            let retry = match self.retry_interval() {
                Some(d) => format!("retried every {} s and on", d.as_secs_f64()),
                None => "retried on".to_owned(),
            };
            crate::log_limited!(
                log::Level::Error,
                "holding {what} that failed on the host ({}): the disk takes no new requests \
                 until they succeed; {retry} `vublk ctl resume`, answered with an I/O error by \
                 `vublk ctl stop-holding` (docs/error-policy.md)",
                errno_text(errno)
            );
            crate::service::holding(Some(&format!(
                "holding requests since {}: {}",
                utc_time(self.since_ms.load(Ordering::Relaxed)),
                errno_text(errno)
            )));
        }
    }

    /// `n` held requests completed (retried, answered with IOERR, or left for the next
    /// process).
    pub fn release(&self, n: usize) {
        if n == 0 {
            return;
        }
        let before = self.count.fetch_sub(n, Ordering::AcqRel);
        if before == n {
            let since = self.since_ms.swap(0, Ordering::Relaxed);
            self.errno.store(0, Ordering::Relaxed);
            crate::log_limited!(
                log::Level::Warn,
                "no request held any more (held for {:.1} s); taking new requests",
                now_ms().saturating_sub(since) as f64 / 1000.0
            );
            crate::service::holding(None);
        }
    }

    /// `ctl resume`: retry now.
    pub fn resume(&self) {
        self.resume_gen.fetch_add(1, Ordering::AcqRel);
    }

    /// `ctl stop-holding`: answer everything held with IOERR.
    pub fn give_up(&self) {
        self.give_up_gen.fetch_add(1, Ordering::AcqRel);
    }

    /// The (resume, stop-holding) generations, for a queue to see them change.
    pub fn generations(&self) -> (u64, u64) {
        (
            self.resume_gen.load(Ordering::Acquire),
            self.give_up_gen.load(Ordering::Acquire),
        )
    }
}

/// `ms` since the epoch as `YYYY-MM-DD HH:MM:SS UTC`.
pub fn utc_time(ms: u64) -> String {
    match i64::try_from(ms).map(jiff::Timestamp::from_millisecond) {
        Ok(Ok(t)) => t.strftime("%Y-%m-%d %H:%M:%S UTC").to_string(),
        _ => format!("{ms} ms after 1970"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policy_decides_what_is_held() {
        let h = Holds::default();
        assert!(h.holds(RequestType::Out, libc::ENOSPC));
        assert!(h.holds(RequestType::Flush, libc::EDQUOT));
        assert!(!h.holds(RequestType::Out, libc::EIO));
        assert!(!h.holds(RequestType::In, libc::ENOSPC));
        assert!(!h.holds(RequestType::GetId, libc::ENOSPC));
        h.set_policy(WritePolicy::Hold, ReadPolicy::Hold, Duration::ZERO);
        assert!(h.holds(RequestType::Discard, libc::EIO));
        assert!(h.holds(RequestType::In, libc::EIO));
        assert_eq!(h.retry_interval(), None);
        h.set_policy(WritePolicy::Report, ReadPolicy::Report, DEFAULT_RETRY);
        assert!(!h.holds(RequestType::Out, libc::ENOSPC));
        assert!(!h.holds(RequestType::In, libc::EIO));
    }

    #[test]
    fn an_episode_starts_and_ends_with_the_count() {
        let h = Holds::default();
        assert_eq!(h.now(), None);
        h.hold(libc::ENOSPC, "a write");
        h.hold(libc::EIO, "a write");
        let held = h.now().unwrap();
        assert_eq!((held.requests, held.errno), (2, libc::ENOSPC));
        assert_eq!(held.error(), "No space left on device");
        assert!(h.paused());
        h.release(1);
        assert!(h.paused());
        h.release(1);
        assert!(!h.paused());
        assert_eq!(h.now(), None);
        assert_eq!(h.episodes.load(Ordering::Relaxed), 1);
        assert_eq!(h.held_total.load(Ordering::Relaxed), 2);
    }

    #[test]
    fn dates_read_as_utc() {
        assert_eq!(utc_time(0), "1970-01-01 00:00:00 UTC");
        assert_eq!(utc_time(1_796_300_000_000), "2026-12-03 12:13:20 UTC");
        assert_eq!(utc_time(951_782_400_000), "2000-02-29 00:00:00 UTC");
    }
}
