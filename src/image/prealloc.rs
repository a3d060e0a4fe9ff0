//! Preallocation ahead of the end of a growing image file (QEMU's preallocate filter; no QEMU
//! code). A write that ends past the file's end first extends the file with `fallocate` to
//! ALIGN_UP(end + size, align), so the following writes land in allocated blocks inside the
//! file instead of each extending it. The format sees `data_end` as the file's length; the
//! preallocated tail is trimmed on close.
//!
//! State: `data_end` (the largest end of any write, or the length at open: truncating to it
//! never loses data), `zero_start` (from there to `file_end` the file is known to read as
//! zeroes), `file_end` (the file's real length). This module only decides; the caller does
//! the fallocate and reports back, so it is testable without a file.

use std::fs::File;
use std::io;
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::io::Storage;
use crate::locks::Locked;

/// What a write needs before it is issued.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Plan {
    /// Extend the file over [start, end) with fallocate first (best effort).
    pub extend: Option<(u64, u64)>,
    /// A zero write that needs no I/O at all: the range already reads as zeroes. Valid only
    /// if `extend` is None or succeeds.
    pub merged: bool,
}

/// The filter's state for one image file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Prealloc {
    /// Bytes to preallocate past the end of a write (0: only round up to `align`).
    pub size: u64,
    /// File lengths are rounded up to this (a multiple of `file_align`).
    pub align: u64,
    /// The file's I/O alignment (direct-I/O block).
    pub file_align: u64,
    pub data_end: u64,
    pub zero_start: u64,
    pub file_end: u64,
    /// fallocate is not supported here: never try again.
    pub unsupported: bool,
    /// An extension is being done by someone else: skip rather than wait.
    pub busy: bool,
}

fn align_up(v: u64, a: u64) -> u64 {
    if a <= 1 {
        v
    } else {
        v.div_ceil(a).saturating_mul(a)
    }
}

impl Prealloc {
    /// State for a file of `len` bytes.
    pub fn new(len: u64, size: u64, align: u64, file_align: u64) -> Self {
        Prealloc {
            size,
            // Never a length that is not a multiple of the page size (see qcow2's extend_to).
            align: align.max(file_align).max(4096),
            file_align,
            data_end: len,
            zero_start: len,
            file_end: len,
            unsupported: false,
            busy: false,
        }
    }

    /// A write of [offset, offset + len) is about to be issued; `zero` if it writes zeroes
    /// and could be skipped where the file already reads as zeroes.
    pub fn handle_write(&mut self, offset: u64, len: u64, zero: bool) -> Plan {
        let end = offset.saturating_add(len);
        let none = Plan {
            extend: None,
            merged: false,
        };
        // Data ending past zero_start makes everything before its end non-zero, even when
        // it starts inside [zero_start, data_end) (QEMU's later fix: otherwise a later zero
        // write there could be skipped over live data).
        if !zero && end > self.zero_start {
            self.zero_start = end;
        }
        if end <= self.data_end {
            return none;
        }
        self.data_end = end;
        if !zero {
            self.zero_start = end;
        }
        if end <= self.file_end {
            // Already preallocated: a zero write inside the known-zero area is a no-op.
            return Plan {
                extend: None,
                merged: zero && offset >= self.zero_start,
            };
        }
        if self.unsupported || self.busy {
            return none;
        }
        let start = align_up(
            if zero {
                offset.min(self.file_end)
            } else {
                self.file_end
            },
            self.file_align,
        );
        let stop = align_up(start.max(end).saturating_add(self.size), self.align);
        Plan {
            extend: Some((start, stop)),
            merged: zero && start <= offset,
        }
    }

    /// The fallocate of a planned extension finished: Ok, or the error's errno. `file_len`
    /// is the file's length now (re-read after a failure).
    pub fn extended(&mut self, end: u64, result: Result<(), i32>, file_len: u64) -> bool {
        match result {
            Ok(()) => {
                self.file_end = end.max(file_len);
                true
            }
            Err(e) => {
                if e == libc::EOPNOTSUPP || e == libc::ENOSYS {
                    self.unsupported = true;
                }
                self.file_end = file_len;
                false
            }
        }
    }

    /// An extension ahead of time, for a background thread: when writes have reached the
    /// last half of the preallocated space (or nothing is preallocated yet: `ahead_of` is
    /// the file's data end at open), the next `size` past the file's end, so that the writes
    /// find it done when they get there. None while one runs, or when not needed yet.
    pub fn plan_ahead(&self, ahead_of: u64) -> Option<(u64, u64)> {
        if self.unsupported || self.busy || self.size == 0 {
            return None;
        }
        if ahead_of.saturating_add(self.size / 2) <= self.file_end && self.file_end > self.data_end
        {
            return None;
        }
        let start = align_up(self.file_end, self.file_align);
        let stop = align_up(start.saturating_add(self.size), self.align);
        Some((start, stop))
    }

    /// Where a clean close truncates the file (None: nothing preallocated past the data).
    pub fn trim_to(&self) -> Option<u64> {
        (self.file_end > self.data_end).then_some(self.data_end)
    }
}

/// `--prealloc-size`, `--prealloc-align` and the file's alignment, as a format takes them
/// at open.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PreallocParams {
    /// Bytes to preallocate past the end of a write.
    pub size: u64,
    /// File lengths are rounded up to this.
    pub align: u64,
    /// The file's direct-I/O block.
    pub file_align: u64,
}

/// How the file is grown (`--prealloc-mode`, parallels).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum PreallocMode {
    /// Allocate the blocks (fallocate): the tail reads as zeroes and writes into it do not
    /// allocate.
    Falloc,
    /// Only extend the size (sparse); falls back to falloc where unsupported.
    Truncate,
}

/// Grow `file` over [start, end): allocate the blocks (`Falloc`, extending the file) or
/// only set its size to `end` (`Truncate`). EOPNOTSUPP where the file system cannot do it:
/// the caller decides what then.
pub fn preallocate(file: &dyn Storage, mode: PreallocMode, start: u64, end: u64) -> io::Result<()> {
    match mode {
        PreallocMode::Falloc => file.allocate(start, end.saturating_sub(start)),
        PreallocMode::Truncate => file.set_len(end),
    }
}

/// The errno of a failed preallocation, as [`Prealloc::extended`] takes it.
pub fn errno(e: &io::Error) -> i32 {
    e.raw_os_error().unwrap_or(libc::EIO)
}

/// A finished background extension: its end, and Ok or the errno.
pub type ExtensionDone = (u64, Result<(), i32>);

/// A thread that does one image's preallocations (fallocate), so that the threads that
/// allocate never wait for one; a result waits in a mailbox for the next allocation to take
/// it. The thread ends when this goes away.
#[derive(Debug, Default)]
pub struct Background {
    tx: Mutex<Option<Sender<(u64, u64)>>>,
    done: Arc<Mutex<Option<ExtensionDone>>>,
}

impl Background {
    /// Start the thread on its own handle of the file (without one, [`Self::start`] says no
    /// and the caller preallocates itself).
    pub fn spawn(&self, file: File) {
        let (tx, rx) = channel::<(u64, u64)>();
        let done = self.done.clone();
        let spawned = std::thread::Builder::new()
            .name("vublk-prealloc".into())
            .spawn(move || {
                for (start, end) in rx {
                    let r =
                        preallocate(&file, PreallocMode::Falloc, start, end).map_err(|e| errno(&e));
                    *done.locked() = Some((end, r));
                }
            });
        if spawned.is_ok() {
            *self.tx.locked() = Some(tx);
        }
    }

    pub fn active(&self) -> bool {
        self.tx.locked().is_some()
    }

    /// Hand an extension to the thread; false without one.
    pub fn start(&self, start: u64, end: u64) -> bool {
        self.tx
            .locked()
            .as_ref()
            .is_some_and(|tx| tx.send((start, end)).is_ok())
    }

    pub fn take_done(&self) -> Option<ExtensionDone> {
        self.done.locked().take()
    }

    /// Wait (at most [`BACKGROUND_WAIT`]) for the extension in flight (a clean close).
    pub fn wait_done(&self) -> Option<ExtensionDone> {
        let t0 = Instant::now();
        while t0.elapsed() < BACKGROUND_WAIT {
            if let Some(d) = self.take_done() {
                return Some(d);
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        None
    }
}

/// How long a clean close waits for a background extension: a fallocate of
/// `--prealloc-size` takes milliseconds; one stuck longer is left behind (its tail is
/// trimmed on the next open).
const BACKGROUND_WAIT: Duration = Duration::from_secs(10);

#[cfg(test)]
mod tests {
    use super::*;

    const M: u64 = 1 << 20;

    fn fresh() -> Prealloc {
        // A 256 KiB file, 128 MiB ahead, 1 MiB alignment, 4 KiB file blocks.
        Prealloc::new(256 << 10, 128 * M, M, 4096)
    }

    #[test]
    fn extensions_ahead_start_halfway_and_at_open() {
        let mut p = fresh();
        // At open: nothing preallocated yet.
        assert_eq!(p.plan_ahead(p.data_end), Some((256 << 10, 129 * M)));
        p.extended(129 * M, Ok(()), 256 << 10);
        // Writes in the first half of the preallocated space: nothing more yet.
        assert_eq!(p.handle_write(256 << 10, 60 * M, false).extend, None);
        assert_eq!(p.plan_ahead(p.data_end), None);
        // Past the middle: the next step, from the file's end.
        p.handle_write(61 * M, 10 * M, false);
        assert_eq!(p.plan_ahead(p.data_end), Some((129 * M, 257 * M)));
        p.busy = true;
        assert_eq!(p.plan_ahead(p.data_end), None);
        p.busy = false;
        p.unsupported = true;
        assert_eq!(p.plan_ahead(p.data_end), None);
    }

    /// (description, writes as (offset, len, zero), then the expected plan of the last write
    /// and the state after it: (data_end, zero_start, file_end)).
    #[test]
    fn rules_table() {
        struct Case {
            what: &'static str,
            setup: fn(&mut Prealloc),
            write: (u64, u64, bool),
            plan: Plan,
            after: (u64, u64, u64),
        }
        fn extend_ok(p: &mut Prealloc, off: u64, len: u64, zero: bool) {
            let plan = p.handle_write(off, len, zero);
            if let Some((_, end)) = plan.extend {
                p.extended(end, Ok(()), p.file_end);
            }
        }
        let cases = [
            Case {
                what: "write past the end extends to ALIGN_UP(end + size, align)",
                setup: |_| {},
                write: (256 << 10, 64 << 10, false),
                plan: Plan {
                    extend: Some((256 << 10, 129 * M)),
                    merged: false,
                },
                after: (320 << 10, 320 << 10, 256 << 10),
            },
            Case {
                what: "write inside the data changes nothing",
                setup: |_| {},
                write: (0, 4096, false),
                plan: Plan {
                    extend: None,
                    merged: false,
                },
                after: (256 << 10, 256 << 10, 256 << 10),
            },
            Case {
                what: "write inside the preallocated area needs no extension",
                setup: |p| extend_ok(p, 256 << 10, 64 << 10, false),
                write: (M, 64 << 10, false),
                plan: Plan {
                    extend: None,
                    merged: false,
                },
                after: (M + (64 << 10), M + (64 << 10), 129 * M),
            },
            Case {
                what: "zero write inside the known-zero area is a no-op",
                setup: |p| extend_ok(p, 256 << 10, 64 << 10, false),
                write: (2 * M, 64 << 10, true),
                plan: Plan {
                    extend: None,
                    merged: true,
                },
                after: (2 * M + (64 << 10), 320 << 10, 129 * M),
            },
            Case {
                what: "zero write starting below zero_start is not merged",
                setup: |p| extend_ok(p, 256 << 10, 64 << 10, false),
                write: (300 << 10, 64 << 10, true),
                plan: Plan {
                    extend: None,
                    merged: false,
                },
                after: (364 << 10, 320 << 10, 129 * M),
            },
            Case {
                what: "data write inside [zero_start, data_end) moves zero_start (the fix)",
                setup: |p| {
                    extend_ok(p, 256 << 10, 64 << 10, false);
                    // A merged zero write leaves zero_start below data_end.
                    extend_ok(p, 2 * M, 64 << 10, true);
                },
                write: (M, 4096, false),
                plan: Plan {
                    extend: None,
                    merged: false,
                },
                after: (2 * M + (64 << 10), M + 4096, 129 * M),
            },
            Case {
                what: "after the fix a zero write below the moved zero_start is not merged",
                setup: |p| {
                    extend_ok(p, 256 << 10, 64 << 10, false);
                    extend_ok(p, 2 * M, 64 << 10, true);
                    extend_ok(p, M, 4096, false);
                },
                write: (M, 4096, true),
                plan: Plan {
                    extend: None,
                    merged: false,
                },
                after: (2 * M + (64 << 10), M + 4096, 129 * M),
            },
            Case {
                what: "zero write past the end preallocates from its start and is merged",
                setup: |_| {},
                write: (4 * M, 64 << 10, true),
                plan: Plan {
                    extend: Some((256 << 10, 133 * M)),
                    merged: true,
                },
                after: (4 * M + (64 << 10), 256 << 10, 256 << 10),
            },
            Case {
                what: "size 0 only rounds the end up to align",
                setup: |p| p.size = 0,
                write: (256 << 10, 4096, false),
                plan: Plan {
                    extend: Some((256 << 10, M)),
                    merged: false,
                },
                after: ((256 << 10) + 4096, (256 << 10) + 4096, 256 << 10),
            },
            Case {
                what: "unsupported: never tried again",
                setup: |p| {
                    let plan = p.handle_write(256 << 10, 4096, false);
                    let (_, end) = plan.extend.unwrap();
                    assert!(!p.extended(end, Err(libc::EOPNOTSUPP), (256 << 10) + 4096));
                },
                write: (M, 4096, false),
                plan: Plan {
                    extend: None,
                    merged: false,
                },
                after: (M + 4096, M + 4096, (256 << 10) + 4096),
            },
            Case {
                what: "ENOSPC: skipped, tried again on the next write past the end",
                setup: |p| {
                    let plan = p.handle_write(256 << 10, 4096, false);
                    let (_, end) = plan.extend.unwrap();
                    assert!(!p.extended(end, Err(libc::ENOSPC), (256 << 10) + 4096));
                },
                write: (M, 4096, false),
                plan: Plan {
                    extend: Some(((256 << 10) + 4096, 130 * M)),
                    merged: false,
                },
                after: (M + 4096, M + 4096, (256 << 10) + 4096),
            },
            Case {
                what: "busy (another extension in flight): skipped, not waited for",
                setup: |p| p.busy = true,
                write: (256 << 10, 4096, false),
                plan: Plan {
                    extend: None,
                    merged: false,
                },
                after: ((256 << 10) + 4096, (256 << 10) + 4096, 256 << 10),
            },
        ];
        for c in cases {
            let mut p = fresh();
            (c.setup)(&mut p);
            let (o, l, z) = c.write;
            let plan = p.handle_write(o, l, z);
            assert_eq!(plan, c.plan, "{}", c.what);
            assert_eq!(
                (p.data_end, p.zero_start, p.file_end),
                c.after,
                "{}",
                c.what
            );
        }
    }

    /// Two queues extending at once: the second finds the extension in progress (busy) and
    /// goes on without one; after the first completes, writes inside need none.
    #[test]
    fn concurrent_extending_writes() {
        let mut p = fresh();
        let a = p.handle_write(256 << 10, 64 << 10, false);
        let (_, end) = a.extend.unwrap();
        p.busy = true;
        let b = p.handle_write(320 << 10, 64 << 10, false);
        assert_eq!(b.extend, None);
        p.busy = false;
        assert!(p.extended(end, Ok(()), 384 << 10));
        assert_eq!(p.file_end, 129 * M);
        assert_eq!(p.handle_write(384 << 10, 64 << 10, false).extend, None);
        assert_eq!(p.trim_to(), Some(448 << 10));
    }

    #[test]
    fn trim_only_when_preallocated() {
        let mut p = fresh();
        assert_eq!(p.trim_to(), None);
        let plan = p.handle_write(256 << 10, 4096, false);
        p.extended(plan.extend.unwrap().1, Ok(()), 0);
        assert_eq!(p.trim_to(), Some((256 << 10) + 4096));
    }
}
