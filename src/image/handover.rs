//! Handing the image over between two vublk processes while QEMU migrates the guest.
//!
//! Both processes serve the same image file, one at a time. The one whose frontend is
//! migrating away (it negotiated `VHOST_F_LOG_ALL`) hands the image over when its queues
//! stop for the switch-over (`GET_VRING_BASE`): every request drained, metadata written back,
//! the file trimmed and synced, its locks released, and from then on nothing is written
//! through that handle again, not at disconnect and not at exit. The other process
//! (started with `--incoming`, or one that handed the image over earlier) holds an
//! *inactive* image: it read the size from the header and nothing else, holds no lock, and
//! writes nothing; when its frontend starts a queue, it takes the image: opens it afresh
//! (locks, metadata read now, after the source wrote its last) and serves it. The same
//! happens on the source when a migration fails and its guest runs on.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use log::info;

use super::lock::LockError;
use super::{Image, ImageError, ImageOpenError, ImageOptions};
use crate::locks::Locked;

/// How long taking the image at a queue's start waits for the other process to give up its
/// lock: QEMU starts the destination's queues after the source's have stopped, so a lock
/// still held this long is somebody else's.
pub const TAKE_OVER_WAIT: Duration = Duration::from_secs(10);

/// Why the image cannot be taken.
#[derive(Debug, thiserror::Error)]
pub enum TakeOverError {
    #[error("the image cannot be opened again (it was not opened from a path)")]
    NoPath,
    #[error(transparent)]
    Open(#[from] ImageOpenError),
    #[error("the image is {now} bytes now, but the guest was shown {shown} bytes: not serving it")]
    SizeChanged { shown: u64, now: u64 },
}

/// Why the served image could not be switched ([`ImageSlot::switch`]).
#[derive(Debug, thiserror::Error)]
pub enum SwitchError {
    #[error("the image is not served by this process now (handed over in a migration)")]
    Inactive,
    #[error("the image cannot be opened again (it was not opened from a path)")]
    NoPath,
    #[error("writing the image's metadata back before the switch")]
    Close(#[source] ImageError),
    #[error("{0}")]
    Commit(String),
    #[error("cannot open the new image; serving the previous one again")]
    Open(#[source] ImageOpenError),
    /// The worst case: the queues' requests fail (IOERR) and the open is retried.
    #[error("{failure}; and the previous image cannot be opened again either: {reopen}")]
    Reopen {
        failure: Box<SwitchError>,
        reopen: ImageOpenError,
    },
}

/// The image a device serves: active, or waiting for (or after) a handover.
#[derive(Debug)]
pub struct ImageSlot {
    current: Mutex<Arc<Image>>,
    /// How to open the image again (the overlay's options after a snapshot).
    opts: Mutex<Option<ImageOptions>>,
    /// Handed over to another process: queues take no request until it is taken back.
    handed_over: AtomicBool,
}

impl ImageSlot {
    /// `image` (active, or [`Image::incoming`]); `opts` say how to open it again.
    pub fn new(image: Image, opts: Option<ImageOptions>) -> Self {
        ImageSlot {
            current: Mutex::new(Arc::new(image)),
            opts: Mutex::new(opts),
            handed_over: AtomicBool::new(false),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Arc<Image>> {
        self.current.locked()
    }

    /// The image as it is now (inactive ones serve nothing).
    pub fn get(&self) -> Arc<Image> {
        self.lock().clone()
    }

    /// How the image is opened again (None: it was not opened from options).
    pub fn options(&self) -> Option<ImageOptions> {
        self.opts.locked().clone()
    }

    /// Serve the image `new` opens from now on instead of the current one (a snapshot's
    /// overlay), between two guest requests: the caller has paused every queue, nothing is
    /// in flight. The current image is closed (metadata written back, the file synced),
    /// then `commit` runs (from then on a restart serves the new image: the chain's state
    /// file), then the current image is given up (deactivated, its locks released: it may
    /// be the new image's backing file, which its open locks for reading) and `new` is
    /// opened. If `commit` or the open fails, the current image is opened again as it was
    /// (after `undo`, when `commit` had run) and the error returned.
    pub fn switch(
        &self,
        new: ImageOptions,
        commit: impl FnOnce() -> Result<(), String>,
        undo: impl FnOnce(),
    ) -> Result<Arc<Image>, SwitchError> {
        let mut cur = self.lock();
        if !cur.is_active() || self.handed_over() {
            return Err(SwitchError::Inactive);
        }
        let old_opts = self.options().ok_or(SwitchError::NoPath)?;
        cur.close().map_err(SwitchError::Close)?;
        let committed = commit();
        cur.deactivate();
        cur.release_locks();
        let failure = match committed {
            Err(e) => SwitchError::Commit(e),
            Ok(()) => match Image::open(&new) {
                Ok((image, _, _)) => {
                    image.inherit_watch(&cur);
                    *cur = Arc::new(image);
                    *self.opts.locked() = Some(new);
                    return Ok(cur.clone());
                }
                Err(e) => {
                    undo();
                    SwitchError::Open(e)
                }
            },
        };
        // Back to the image served before (opened afresh: its handle was given up).
        match Image::open(&old_opts) {
            Ok((image, _, _)) => {
                image.inherit_watch(&cur);
                *cur = Arc::new(image);
                Err(failure)
            }
            Err(e) => Err(SwitchError::Reopen {
                failure: Box::new(failure),
                reopen: e,
            }),
        }
    }

    /// Has this process handed the image over (and not taken it back)?
    pub fn handed_over(&self) -> bool {
        self.handed_over.load(Ordering::Acquire)
    }

    /// The active image, opened now if it is inactive; `shown` is the size the guest sees
    /// (a different one is refused). A lock another process holds is waited for up to
    /// `wait` (zero: one attempt).
    pub fn take_over(&self, shown: u64, wait: Duration) -> Result<Arc<Image>, TakeOverError> {
        let mut cur = self.lock();
        if cur.is_active() {
            return Ok(cur.clone());
        }
        let opts = self.options().ok_or(TakeOverError::NoPath)?;
        let t0 = Instant::now();
        let (image, _, _) = loop {
            match Image::open(&opts) {
                Ok(x) => break x,
                Err(ImageOpenError::Lock(LockError::InUse { .. })) if t0.elapsed() < wait => {
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => return Err(e.into()),
            }
        };
        if image.size_bytes() != shown {
            // Dropping it writes nothing the open did not (nothing was served).
            return Err(TakeOverError::SizeChanged {
                shown,
                now: image.size_bytes(),
            });
        }
        info!(
            "took the image over: locked and its metadata read after {} ms; serving it",
            t0.elapsed().as_millis()
        );
        image.inherit_watch(&cur);
        *cur = Arc::new(image);
        self.handed_over.store(false, Ordering::Release);
        Ok(cur.clone())
    }

    /// Hand the image over: queues stop taking requests, `drain` completes those they hold,
    /// then everything is written back and synced, the locks given up, and nothing is
    /// written through this handle again. False if it was not active (nothing done).
    pub fn hand_over(&self, drain: impl FnOnce()) -> Result<bool, ImageError> {
        // Not held while draining: a queue thread starting meanwhile takes this lock
        // (`take_over`) while the drain waits for that thread.
        let cur = self.get();
        if !cur.is_active() {
            return Ok(false);
        }
        let t0 = Instant::now();
        // First no new request, then the last ones finished: nothing is in flight below.
        self.handed_over.store(true, Ordering::Release);
        drain();
        let r = if cur.read_only() { Ok(()) } else { cur.close() };
        // Whether or not the last write-back worked, this process must not write again: the
        // other may start at any moment.
        cur.deactivate();
        cur.release_locks();
        r?;
        info!(
            "handed the image over: metadata written back and synced, locks released in {} ms \
             (a frontend starting the queues here takes it back)",
            t0.elapsed().as_millis()
        );
        Ok(true)
    }
}
