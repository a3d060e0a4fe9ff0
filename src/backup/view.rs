//! A point-in-time view of the disk, kept by copy-before-write: before a guest write changes
//! a granule of the view that was not copied yet, its old contents go to a scratch file (at
//! the same offset: the file is sparse, and a granule of zeroes is not written at all); the
//! view reads copied granules from the scratch, the others from the disk.
//!
//! A guest write to a granule starts only once the granule's copy is in the scratch and
//! marked copied. Copies of one granule exclude each other through a lock per granule (a set
//! of busy granules; a copy holds one at a time). Reads of the view take no lock: they read
//! each granule as its mark says, and a granule read from the disk that is marked copied
//! afterwards is read again from the scratch (a guest write may have changed it during the
//! read, never before the mark). So a read never sees a guest write, and a copy never waits
//! for a reader.
//!
//! The guest never fails because of the view: when the scratch is full (`--scratch-max`, or
//! the file system) or a read or write fails, the view is marked failed with the reason,
//! guest writes go on without copies, and every later read of the view gets an error.

use std::collections::HashSet;
use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use crate::image::{Allocation, Image, Reader};
use crate::io::bounce::AlignedBuf;
use crate::locks::Locked;

/// A view's failure, for its readers and `backup-list`.
pub type Failed = String;

/// A point-in-time view of one disk.
pub struct View {
    image: Arc<Image>,
    size: u64,
    granule: u64,
    /// One bit per granule: copied to the scratch.
    copied: Vec<AtomicU64>,
    busy: Mutex<HashSet<u64>>,
    freed: Condvar,
    scratch: File,
    scratch_max: Option<u64>,
    scratch_used: AtomicU64,
    /// Bytes copied before guest writes (zero granules included, which take no scratch).
    copied_bytes: AtomicU64,
    failed: AtomicBool,
    why: Mutex<Option<Failed>>,
    /// Readers of the disk, one taken per copy or read at a time.
    readers: Mutex<Vec<Reader>>,
}

impl std::fmt::Debug for View {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("View")
            .field("size", &self.size)
            .field("granule", &self.granule)
            .field("failed", &self.failed.load(Ordering::Relaxed))
            .finish()
    }
}

/// Open an unnamed scratch file in `dir` (O_TMPFILE: nothing to clean up after a crash).
fn scratch_file(dir: &Path) -> io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    match std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .mode(0o600)
        .custom_flags(libc::O_TMPFILE)
        .open(dir)
    {
        Ok(f) => Ok(f),
        // A file system without O_TMPFILE: a named file, unlinked at once.
        Err(e)
            if matches!(
                e.raw_os_error(),
                Some(libc::EOPNOTSUPP) | Some(libc::EISDIR)
            ) =>
        {
            let p = dir.join(format!(".vublk-scratch-{}", std::process::id()));
            let f = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&p)?;
            std::fs::remove_file(&p)?;
            Ok(f)
        }
        Err(e) => Err(e),
    }
}

/// Holds granules [first, last] of a view.
struct Held<'a> {
    view: &'a View,
    first: u64,
    last: u64,
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        let mut b = self.view.busy.locked();
        for g in self.first..=self.last {
            b.remove(&g);
        }
        drop(b);
        self.view.freed.notify_all();
    }
}

impl View {
    /// A view of `image` (its first `size` bytes) with copies of `granule` bytes (a power
    /// of two, at least the format's cluster) in a scratch file in `scratch_dir`.
    pub fn new(
        image: Arc<Image>,
        size: u64,
        granule: u64,
        scratch_dir: &Path,
        scratch_max: Option<u64>,
    ) -> io::Result<View> {
        let scratch = scratch_file(scratch_dir)?;
        // Sparse: what was never written reads as zeroes, to the end of the view.
        scratch.set_len(size)?;
        let granules = size.div_ceil(granule);
        let reader = image.reader()?;
        Ok(View {
            image,
            size,
            granule,
            copied: (0..granules.div_ceil(64))
                .map(|_| AtomicU64::new(0))
                .collect(),
            busy: Mutex::new(HashSet::new()),
            freed: Condvar::new(),
            scratch,
            scratch_max,
            scratch_used: AtomicU64::new(0),
            copied_bytes: AtomicU64::new(0),
            failed: AtomicBool::new(false),
            why: Mutex::new(None),
            readers: Mutex::new(vec![reader]),
        })
    }

    pub fn size(&self) -> u64 {
        self.size
    }

    pub fn granule(&self) -> u64 {
        self.granule
    }

    /// Scratch bytes written.
    pub fn scratch_used(&self) -> u64 {
        self.scratch_used.load(Ordering::Relaxed)
    }

    /// Bytes copied before guest writes.
    pub fn copied_bytes(&self) -> u64 {
        self.copied_bytes.load(Ordering::Relaxed)
    }

    /// Why the view failed (None: it did not).
    pub fn failure(&self) -> Option<Failed> {
        self.why.locked().clone()
    }

    fn fail(&self, why: String) {
        let mut w = self.why.locked();
        if w.is_none() {
            log::error!("backup view failed: {why}; the guest's writes go on without copies");
            *w = Some(why);
        }
        self.failed.store(true, Ordering::Release);
    }

    fn is_copied(&self, g: u64) -> bool {
        self.copied
            .get((g / 64) as usize)
            .is_some_and(|w| w.load(Ordering::Acquire) & (1 << (g % 64)) != 0)
    }

    fn set_copied(&self, g: u64) {
        if let Some(w) = self.copied.get((g / 64) as usize) {
            w.fetch_or(1 << (g % 64), Ordering::AcqRel);
        }
    }

    /// Hold granules [first, last], waiting for each while another thread holds it.
    fn hold(&self, first: u64, last: u64) -> Held<'_> {
        let mut b = self.busy.locked();
        for g in first..=last {
            while b.contains(&g) {
                b = self.freed.wait(b).unwrap_or_else(|p| p.into_inner());
            }
            b.insert(g);
        }
        Held {
            view: self,
            first,
            last,
        }
    }

    fn with_reader<R>(&self, f: impl FnOnce(&mut Reader) -> R) -> io::Result<R> {
        let r = self.readers.locked().pop();
        let mut r = match r {
            Some(r) => r,
            None => self.image.reader()?,
        };
        let out = f(&mut r);
        let mut pool = self.readers.locked();
        if pool.len() < 8 {
            pool.push(r);
        }
        Ok(out)
    }

    /// Read [offset, offset + buf.len()) of the disk (granule-aligned, inside the view).
    fn read_disk(&self, offset: u64, buf: &mut AlignedBuf) -> Result<(), String> {
        self.with_reader(|r| r.read(&self.image, offset, buf))
            .map_err(|e| format!("reading the disk: {e}"))?
            .map_err(|e| format!("reading the disk: {}", crate::logging::error_chain(&e)))
    }

    /// Has a write of [offset, offset + len) granules still to copy?
    pub fn needs_copy(&self, offset: u64, len: u64) -> bool {
        if self.failed.load(Ordering::Acquire) || len == 0 || offset >= self.size {
            return false;
        }
        let end = offset.saturating_add(len).min(self.size);
        (offset / self.granule..=(end - 1) / self.granule).any(|g| !self.is_copied(g))
    }

    /// Before a guest write of [offset, offset + len): copy what the view still needs.
    pub fn before_write(&self, offset: u64, len: u64) {
        if self.failed.load(Ordering::Acquire) || len == 0 || offset >= self.size {
            return;
        }
        let end = offset.saturating_add(len).min(self.size);
        let (first, last) = (offset / self.granule, (end - 1) / self.granule);
        let mut buf: Option<AlignedBuf> = None;
        for g in first..=last {
            if self.is_copied(g) {
                continue;
            }
            let _held = self.hold(g, g);
            if self.is_copied(g) || self.failed.load(Ordering::Acquire) {
                continue;
            }
            if let Err(why) = self.copy(g, &mut buf) {
                self.fail(why);
                return;
            }
            self.set_copied(g);
        }
    }

    /// Copy granule `g` to the scratch.
    fn copy(&self, g: u64, buf: &mut Option<AlignedBuf>) -> Result<(), String> {
        let start = g * self.granule;
        let n = self.granule.min(self.size - start);
        let n_aligned = n.next_multiple_of(512) as usize;
        if buf.as_ref().is_none_or(|b| b.len() != n_aligned) {
            *buf = Some(AlignedBuf::new(n_aligned, 4096).map_err(|e| e.to_string())?);
        }
        let Some(b) = buf.as_mut() else {
            return Err("no buffer".into());
        };
        self.read_disk(start, b)?;
        self.copied_bytes.fetch_add(n, Ordering::Relaxed);
        let data = &b.as_slice()[..n as usize];
        if crate::zero::is_zero(data) {
            // The scratch reads as zeroes where nothing was written.
            return Ok(());
        }
        let used = self.scratch_used.fetch_add(n, Ordering::Relaxed) + n;
        if self.scratch_max.is_some_and(|max| used > max) {
            return Err(format!(
                "the scratch is full ({} bytes used of --scratch-max {})",
                used - n,
                self.scratch_max.unwrap_or(0)
            ));
        }
        self.scratch
            .write_all_at(data, start)
            .map_err(|e| format!("writing the scratch file: {e}"))
    }

    /// Read [offset, offset + dst.len()) of the view (inside it).
    pub fn read(&self, offset: u64, dst: &mut [u8]) -> Result<(), String> {
        let end = offset + dst.len() as u64;
        if end > self.size {
            return Err("read outside the view".into());
        }
        if dst.is_empty() {
            return Ok(());
        }
        if let Some(why) = self.failure() {
            return Err(format!("the backup failed: {why}"));
        }
        let (first, last) = (offset / self.granule, (end - 1) / self.granule);
        // No lock: granules are read as their bits say now, and those read from the disk
        // are checked again afterwards (below).
        let mut from_disk: Vec<(u64, u64)> = Vec::new();
        let mut g = first;
        while g <= last {
            let copied = self.is_copied(g);
            // A run of granules read the same way.
            let mut h = g;
            while h < last && self.is_copied(h + 1) == copied {
                h += 1;
            }
            let run_start = (g * self.granule).max(offset);
            let run_end = ((h + 1) * self.granule).min(end);
            let part = &mut dst[(run_start - offset) as usize..(run_end - offset) as usize];
            if copied {
                self.read_scratch(part, run_start)?;
            } else {
                self.read_disk_into(part, run_start, run_end)?;
                from_disk.push((g, h));
            }
            g = h + 1;
        }
        // A granule copied while it was read from the disk may have been overwritten by the
        // guest meanwhile (its write starts only once the copy is in the scratch, marked):
        // read it again from the scratch.
        for (g, h) in from_disk {
            for x in g..=h {
                if self.is_copied(x) {
                    let s = (x * self.granule).max(offset);
                    let e = ((x + 1) * self.granule).min(end);
                    self.read_scratch(&mut dst[(s - offset) as usize..(e - offset) as usize], s)?;
                }
            }
        }
        // A failure while this read ran may have let a guest write through uncopied.
        if let Some(why) = self.failure() {
            return Err(format!("the backup failed: {why}"));
        }
        Ok(())
    }

    fn read_scratch(&self, part: &mut [u8], at: u64) -> Result<(), String> {
        self.scratch
            .read_exact_at(part, at)
            .map_err(|e| format!("reading the scratch file: {e}"))
    }

    /// Read [start, end) of the disk into `part`: straight into it when it is aligned (the
    /// NBD server's buffers are), else through an aligned copy.
    fn read_disk_into(&self, part: &mut [u8], start: u64, end: u64) -> Result<(), String> {
        if (part.as_ptr() as usize).is_multiple_of(4096)
            && start.is_multiple_of(512)
            && part.len().is_multiple_of(512)
        {
            return self
                .with_reader(|r| r.read_into(&self.image, start, part))
                .map_err(|e| format!("reading the disk: {e}"))?
                .map_err(|e| format!("reading the disk: {}", crate::logging::error_chain(&e)));
        }
        let a = start / 512 * 512;
        let b = end
            .next_multiple_of(512)
            .min(self.size.next_multiple_of(512));
        let mut buf = AlignedBuf::new((b - a) as usize, 4096).map_err(|e| e.to_string())?;
        self.read_disk(a, &mut buf)?;
        let skip = (start - a) as usize;
        part.copy_from_slice(&buf.as_slice()[skip..skip + part.len()]);
        Ok(())
    }

    /// What [offset, offset + len) of the view holds, as runs covering at least its first
    /// byte: what the disk's format says, with granules copied to the scratch as data. One
    /// question to the disk per call, and runs of the same kind joined (a client asks again
    /// after each answer's first run, and a question can cost a walk over the whole file:
    /// SEEK_HOLE on tmpfs).
    pub fn allocation(&self, offset: u64, len: u64) -> Result<Vec<(u64, Allocation)>, String> {
        let end = offset.saturating_add(len).min(self.size);
        if offset >= end {
            return Ok(Vec::new());
        }
        let disk = self
            .image
            .allocation(offset, end - offset)
            .map_err(|e| format!("the disk's allocation: {}", crate::logging::error_chain(&e)))?;
        // Marks read after the disk answered: a granule not copied by now was not written
        // before the answer, which is then the view's.
        let mut out: Vec<(u64, Allocation)> = Vec::new();
        let push = |out: &mut Vec<(u64, Allocation)>, n: u64, a: Allocation| match out.last_mut() {
            Some(l) if l.1 == a => l.0 += n,
            _ => out.push((n, a)),
        };
        let mut pos = offset;
        for (n, a) in disk {
            let run_end = (pos + n).min(end);
            if a == Allocation::Data {
                push(&mut out, run_end - pos, a);
                pos = run_end;
                continue;
            }
            while pos < run_end {
                let g = pos / self.granule;
                let e = ((g + 1) * self.granule).min(run_end);
                push(
                    &mut out,
                    e - pos,
                    if self.is_copied(g) {
                        Allocation::Data
                    } else {
                        a
                    },
                );
                pos = e;
            }
            if out.len() >= 4096 {
                break;
            }
        }
        Ok(out)
    }
}

/// A view shared by the backup and its export.
pub type SharedView = Arc<View>;
