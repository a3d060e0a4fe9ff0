//! The write-through copy mode of an active job (a mirror, an active commit): once it is
//! on, each guest write that completes on the disk is also queued for the job's target
//! (its data copied out of guest memory) and written there by threads of the job, so the
//! job's bitmap stops growing with the guest's writes and the job converges however fast
//! the guest writes. Unlike QEMU's `write-blocking` mode the guest's write does not wait
//! for the target: it costs the queue a copy of the data, not a second write.
//!
//! A write is sent through only when nothing else touches its range meanwhile, so that the
//! target never ends up with an older version than the disk holds:
//!
//! - every guest request that changes the disk registers its range when it is launched,
//!   and a copying thread holds the range it reads and writes;
//! - at a write's completion, if another guest request, a copying thread or a queued
//!   write-through overlaps it, it is not sent (its granules stay marked in the job's
//!   bitmap, as the completion marked them, and the job copies them again from the disk),
//!   and an overlapping guest request or queued write is tainted the same way;
//! - a queued write holds its range until it is written; then, unless it was tainted or a
//!   guest request or copying thread overlaps it, the granules it wholly covers are cleared
//!   from the job's bitmap.
//!
//! The mode is switched on and off with the queues paused (nothing in flight), so every
//! request in flight while it is on was registered; switching it off writes what is queued
//! first. At most [`MAX_QUEUED`] bytes wait: beyond that a write is left to the job.

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, RwLock};

use crate::bitmaps::DirtyBitmap;
use crate::image::Image;
use crate::locks::Locked;

/// Threads that write the queued guest writes (queued writes never overlap: any order
/// is right). One thread wrote about 17,000 4 KiB writes a second into a raw base's page
/// cache on the test machine, less than the benchmark's guest writes, while the copying
/// threads wrote 1 MiB pieces (large folios: see `copy::LOCAL_WRITE`); four then spent
/// much of their time spinning on the file's lock. Two with 64 KiB pieces kept up
/// (BENCHMARKS.md, "Jobs that give way to the guest's I/O").
const WRITERS: usize = 2;

/// Bytes of guest writes queued for the target at most.
const MAX_QUEUED: u64 = 16 << 20;

/// Who holds a range.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Holder {
    /// A guest request in flight.
    Guest,
    /// A copying thread.
    Copier,
    /// A guest write queued for the target.
    Queued,
}

#[derive(Debug)]
struct Range {
    end: u64,
    holder: Holder,
    /// Something overlapped it: its data must not be trusted to be the newest.
    tainted: bool,
}

/// The ranges held, by (start, token): an overlap query looks from `start - longest`.
#[derive(Debug, Default)]
struct Ranges {
    map: BTreeMap<(u64, u64), Range>,
    longest: u64,
}

impl Ranges {
    fn insert(&mut self, start: u64, token: u64, r: Range) {
        self.longest = self.longest.max(r.end - start);
        self.map.insert((start, token), r);
    }

    fn remove(&mut self, start: u64, token: u64) -> Option<Range> {
        self.map.remove(&(start, token))
    }

    /// The ranges overlapping [start, end).
    fn overlapping(&mut self, start: u64, end: u64) -> impl Iterator<Item = &mut Range> {
        let from = start.saturating_sub(self.longest);
        self.map
            .range_mut((from, 0)..(end, 0))
            .filter(move |(_, r)| r.end > start)
            .map(|(_, r)| r)
    }
}

#[derive(Debug, Default)]
struct State {
    ranges: Ranges,
    queue: VecDeque<(u64, u64, Vec<u8>)>,
    queued_bytes: u64,
    stop: bool,
}

#[derive(Debug)]
struct Shared {
    target: Arc<Image>,
    tracker: Arc<DirtyBitmap>,
    state: Mutex<State>,
    wake: Condvar,
    next: AtomicU64,
    through: AtomicU64,
    left: AtomicU64,
    /// Of those left: because the queue was full.
    full: AtomicU64,
    failed: AtomicBool,
}

/// An active job's write-through to its target.
#[derive(Debug)]
pub struct WriteThrough {
    shared: Arc<Shared>,
    writers: Mutex<Vec<std::thread::JoinHandle<()>>>,
}

impl WriteThrough {
    /// A write-through to `target`, its writer thread started; `tracker` is the job's
    /// bitmap.
    pub fn start(target: Arc<Image>, tracker: Arc<DirtyBitmap>) -> Result<Self, String> {
        let shared = Arc::new(Shared {
            target,
            tracker,
            state: Mutex::new(State::default()),
            wake: Condvar::new(),
            next: AtomicU64::new(1),
            through: AtomicU64::new(0),
            left: AtomicU64::new(0),
            full: AtomicU64::new(0),
            failed: AtomicBool::new(false),
        });
        let mut writers = Vec::new();
        for _ in 0..WRITERS {
            let s = shared.clone();
            match std::thread::Builder::new()
                .name("vublk-through".into())
                .spawn(move || s.write_queued())
            {
                Ok(w) => writers.push(w),
                Err(e) => {
                    let wt = WriteThrough {
                        shared,
                        writers: Mutex::new(writers),
                    };
                    wt.finish();
                    return Err(format!("cannot start the write-through threads: {e}"));
                }
            }
        }
        Ok(WriteThrough {
            shared,
            writers: Mutex::new(writers),
        })
    }

    /// Guest writes written to the target, those left to the job, and of those the ones
    /// left because the queue was full.
    pub fn counts(&self) -> (u64, u64, u64) {
        (
            self.shared.through.load(Ordering::Relaxed),
            self.shared.left.load(Ordering::Relaxed),
            self.shared.full.load(Ordering::Relaxed),
        )
    }

    /// A guest request that changes [offset, offset + len) is launched: its token.
    pub fn begin(&self, offset: u64, len: u64) -> u64 {
        let token = self.shared.next.fetch_add(1, Ordering::Relaxed);
        let r = Range {
            end: offset.saturating_add(len),
            holder: Holder::Guest,
            tainted: false,
        };
        self.shared.state.locked().ranges.insert(offset, token, r);
        token
    }

    /// The guest request `token` (launched over a range from `start`) completed: `data`
    /// is what it wrote at `start` (None: not a data write, or it failed). Queues it for
    /// the target if nothing overlapped it.
    pub fn end(&self, token: u64, start: u64, data: Option<Vec<u8>>) {
        let mut st = self.shared.state.locked();
        let Some(me) = st.ranges.remove(start, token) else {
            return;
        };
        let mut clean = !me.tainted;
        for r in st.ranges.overlapping(start, me.end) {
            clean = false;
            r.tainted = true;
        }
        let Some(data) = data else { return };
        let len = data.len() as u64;
        if !clean || st.stop || st.queued_bytes + len > MAX_QUEUED {
            self.shared.left.fetch_add(1, Ordering::Relaxed);
            if clean && !st.stop {
                self.shared.full.fetch_add(1, Ordering::Relaxed);
            }
            return;
        }
        let q = self.shared.next.fetch_add(1, Ordering::Relaxed);
        let r = Range {
            end: start + len,
            holder: Holder::Queued,
            tainted: false,
        };
        st.ranges.insert(start, q, r);
        st.queued_bytes += len;
        st.queue.push_back((q, start, data));
        drop(st);
        self.shared.wake.notify_one();
    }

    /// A copying thread takes [start, end): its token for [`Self::release`].
    pub fn hold(&self, start: u64, end: u64) -> u64 {
        let token = self.shared.next.fetch_add(1, Ordering::Relaxed);
        let r = Range {
            end,
            holder: Holder::Copier,
            tainted: false,
        };
        self.shared.state.locked().ranges.insert(start, token, r);
        token
    }

    /// A copying thread is done with what it held from `start` (`token`).
    pub fn release(&self, start: u64, token: u64) {
        self.shared.state.locked().ranges.remove(start, token);
    }

    /// Write what is queued and stop the writer (with the queues paused: nothing is added).
    pub fn finish(&self) {
        self.shared.state.locked().stop = true;
        self.shared.wake.notify_all();
        let writers = std::mem::take(&mut *self.writers.locked());
        for w in writers {
            let _ = w.join();
        }
    }
}

impl Drop for WriteThrough {
    fn drop(&mut self) {
        self.finish();
    }
}

impl Shared {
    /// A writer thread: queued guest writes to the target.
    fn write_queued(&self) {
        loop {
            let (q, offset, data) = {
                let mut st = self.state.locked();
                loop {
                    if let Some(x) = st.queue.pop_front() {
                        break x;
                    }
                    if st.stop {
                        return;
                    }
                    st = self.wake.wait(st).unwrap_or_else(|p| p.into_inner());
                }
            };
            let len = data.len() as u64;
            let r = self.target.job_write(offset, &data);
            let mut st = self.state.locked();
            st.queued_bytes -= len;
            let Some(me) = st.ranges.remove(offset, q) else {
                continue;
            };
            let overlapped = me.tainted
                || st
                    .ranges
                    .overlapping(offset, me.end)
                    .any(|r| r.holder != Holder::Queued);
            match r {
                // Cleared under the lock: a guest write overlapping it registered at its
                // launch, before its completion marked the bitmap, and is seen above.
                Ok(()) if !overlapped => {
                    self.tracker.clear_within(offset, len);
                    self.through.fetch_add(1, Ordering::Relaxed);
                }
                Ok(()) => {
                    self.left.fetch_add(1, Ordering::Relaxed);
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

    /// Switch it (with the queues paused); the one it replaces writes what it has queued
    /// and stops.
    pub fn set(&self, wt: Option<Arc<WriteThrough>>) {
        let on = wt.is_some();
        let old = std::mem::replace(
            &mut *self.current.write().unwrap_or_else(|p| p.into_inner()),
            wt,
        );
        self.on.store(on, Ordering::Release);
        if let Some(old) = old {
            old.finish();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn setup() -> (crate::testing::TempDir, Arc<Image>, Arc<DirtyBitmap>) {
        let dir = crate::testing::TempDir::new("through").unwrap();
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(dir.path().join("t.raw"))
            .unwrap();
        f.set_len(1 << 20).unwrap();
        let image = Arc::new(Image::raw(f, 1 << 20, false));
        let tracker = Arc::new(DirtyBitmap::new("\u{1}job", 4096, 1 << 20, true));
        (dir, image, tracker)
    }

    fn read(image: &Image, at: u64) -> Vec<u8> {
        let mut buf = vec![0u8; 4096];
        std::os::unix::fs::FileExt::read_exact_at(image.file().unwrap(), &mut buf, at).unwrap();
        buf
    }

    #[test]
    fn a_write_alone_goes_through_and_leaves_the_bitmap() {
        let (_d, image, tracker) = setup();
        let wt = WriteThrough::start(image.clone(), tracker.clone()).unwrap();
        tracker.mark(0, 4096);
        let t = wt.begin(0, 4096);
        wt.end(t, 0, Some(vec![7; 4096]));
        wt.finish();
        assert_eq!(read(&image, 0), vec![7; 4096]);
        assert!(!tracker.is_dirty(0));
        assert_eq!(wt.counts(), (1, 0, 0));
    }

    #[test]
    fn overlapping_writes_are_left_to_the_job() {
        let (_d, image, tracker) = setup();
        let wt = WriteThrough::start(image.clone(), tracker.clone()).unwrap();
        // Two guest writes in flight over the same block: neither goes through, whatever
        // order they complete in.
        tracker.mark(8192, 4096);
        let a = wt.begin(8192, 4096);
        let b = wt.begin(8192, 4096);
        wt.end(b, 8192, Some(vec![2; 4096]));
        wt.end(a, 8192, Some(vec![1; 4096]));
        // A copying thread holds a range a write lands in.
        tracker.mark(65536, 4096);
        let h = wt.hold(65536, 65536 + 131072);
        let c = wt.begin(65536, 4096);
        wt.end(c, 65536, Some(vec![3; 4096]));
        wt.release(65536, h);
        wt.finish();
        assert_eq!(read(&image, 8192), vec![0; 4096]);
        assert_eq!(read(&image, 65536), vec![0; 4096]);
        assert!(tracker.is_dirty(8192) && tracker.is_dirty(65536));
        assert_eq!(wt.counts(), (0, 3, 0));
    }

    #[test]
    fn a_discard_in_flight_taints_the_write_it_overlaps() {
        let (_d, image, tracker) = setup();
        let wt = WriteThrough::start(image.clone(), tracker.clone()).unwrap();
        tracker.mark(0, 8192);
        let w = wt.begin(4096, 4096);
        let z = wt.begin(0, 8192);
        wt.end(z, 0, None);
        wt.end(w, 4096, Some(vec![5; 4096]));
        wt.finish();
        assert_eq!(read(&image, 4096), vec![0; 4096]);
        assert!(tracker.is_dirty(4096));
    }
}
