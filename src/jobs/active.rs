//! The write-blocking copy mode of an active job (a mirror, an active commit): once it is
//! on, a guest write that completes on the disk is also written to the job's target before
//! the guest sees it complete, so the job's bitmap stops growing with it and the job
//! converges however fast the guest writes (QEMU's `copy-mode=write-blocking`).
//!
//! A write is copied through only when nothing else touches its range meanwhile, so that
//! the target cannot end up with an older version than the disk holds: every guest
//! request that changes the disk registers its range when it is launched, and a copying
//! thread registers the range it reads and writes. At a write's completion, if another
//! guest request or a copying thread overlaps it (either may have put another version on
//! the target), the write is not copied through: its granules stay marked in the job's
//! bitmap (as they were marked at completion) and the job copies them again from the
//! disk; an overlapping guest request is marked the same way, so that it is not copied
//! through either. Otherwise the data goes to the target (through its format, on the
//! queue's thread) and the granules it wholly covers are cleared from the job's bitmap.
//!
//! The mode is switched on and off with the queues paused (nothing in flight), so every
//! request in flight while it is on was registered.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use crate::bitmaps::DirtyBitmap;
use crate::image::Image;
use crate::locks::Locked;

/// Who holds a range.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Holder {
    /// A guest request (its token); `tainted`: another one overlapped it.
    Guest { token: u64, tainted: bool },
    /// A copying thread.
    Copier,
}

#[derive(Debug)]
struct Range {
    start: u64,
    end: u64,
    holder: Holder,
}

/// An active job's write-through to its target.
#[derive(Debug)]
pub struct WriteThrough {
    target: Arc<Image>,
    tracker: Arc<DirtyBitmap>,
    ranges: Mutex<Vec<Range>>,
    next: AtomicU64,
    /// Writes copied through, and those left to the job (an overlap, an error).
    pub through: AtomicU64,
    pub left: AtomicU64,
    /// A write to the target failed (said once in the log; the job copies those again).
    failed: AtomicBool,
}

impl WriteThrough {
    pub fn new(target: Arc<Image>, tracker: Arc<DirtyBitmap>) -> Self {
        WriteThrough {
            target,
            tracker,
            ranges: Mutex::new(Vec::new()),
            next: AtomicU64::new(1),
            through: AtomicU64::new(0),
            left: AtomicU64::new(0),
            failed: AtomicBool::new(false),
        }
    }

    /// A guest request that changes [offset, offset + len) is launched: its token.
    pub fn begin(&self, offset: u64, len: u64) -> u64 {
        let token = self.next.fetch_add(1, Ordering::Relaxed);
        self.ranges.locked().push(Range {
            start: offset,
            end: offset.saturating_add(len),
            holder: Holder::Guest {
                token,
                tainted: false,
            },
        });
        token
    }

    /// The guest request `token` completed: `data` is what it wrote at `offset` (None: not
    /// a data write, or it failed). Copies it through if nothing overlapped it.
    pub fn end(&self, token: u64, offset: u64, data: Option<&[u8]>) {
        let clean = {
            let mut ranges = self.ranges.locked();
            let Some(i) = ranges
                .iter()
                .position(|r| matches!(r.holder, Holder::Guest { token: t, .. } if t == token))
            else {
                return;
            };
            let me = ranges.swap_remove(i);
            let mut clean = !matches!(me.holder, Holder::Guest { tainted: true, .. });
            for r in ranges.iter_mut() {
                if r.start < me.end && me.start < r.end {
                    clean = false;
                    if let Holder::Guest { tainted, .. } = &mut r.holder {
                        *tainted = true;
                    }
                }
            }
            // Held while copying through: a copying thread starting meanwhile sees it.
            if clean && data.is_some() {
                ranges.push(Range {
                    start: me.start,
                    end: me.end,
                    holder: Holder::Copier,
                });
            }
            clean
        };
        let Some(data) = data else { return };
        if !clean {
            self.left.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let r = self.target.job_write(offset, data);
        self.release(offset, offset + data.len() as u64);
        match r {
            Ok(()) => {
                self.tracker.clear_within(offset, data.len() as u64);
                self.through.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => {
                self.left.fetch_add(1, Ordering::Relaxed);
                if !self.failed.swap(true, Ordering::Relaxed) {
                    log::warn!(
                        "writing a guest write through to the job's target at {offset}: {} \
                         (the job copies it again)",
                        crate::logging::error_chain(&e)
                    );
                }
            }
        }
    }

    /// A copying thread takes [start, end).
    pub fn hold(&self, start: u64, end: u64) {
        self.ranges.locked().push(Range {
            start,
            end,
            holder: Holder::Copier,
        });
    }

    /// A copying thread (or a write-through) is done with [start, end).
    pub fn release(&self, start: u64, end: u64) {
        let mut ranges = self.ranges.locked();
        if let Some(i) = ranges
            .iter()
            .position(|r| r.holder == Holder::Copier && r.start == start && r.end == end)
        {
            ranges.swap_remove(i);
        }
    }
}

/// The device's write-through, if an active job has one on: what the queues look at.
#[derive(Debug, Default)]
pub struct ThroughSlot {
    on: AtomicBool,
    current: RwLock<Option<Arc<WriteThrough>>>,
}

impl ThroughSlot {
    /// The write-through on now, if any (one atomic load when none).
    pub fn get(&self) -> Option<Arc<WriteThrough>> {
        if !self.on.load(Ordering::Acquire) {
            return None;
        }
        self.current
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Switch it (with the queues paused).
    pub fn set(&self, wt: Option<Arc<WriteThrough>>) {
        let on = wt.is_some();
        *self.current.write().unwrap_or_else(|p| p.into_inner()) = wt;
        self.on.store(on, Ordering::Release);
    }
}
