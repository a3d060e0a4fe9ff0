//! Backups of the running disk (docs/backups.md): a point-in-time view kept by
//! copy-before-write (`view`), exported read-only over NBD (`crate::nbd::server`) with the
//! meta contexts `base:allocation` and `qemu:dirty-bitmap:FROM`, and started at one moment
//! between two guest requests together with its checkpoint bitmap (`control`: the
//! `backup-begin`, `backup-end` and `backup-list` methods).
//!
//! The `Device` owns the set of running backups; every queue calls
//! [`Backups::before_write`] before it starts a write-type request, which costs one atomic
//! load while no backup runs.

pub mod control;
pub mod view;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Instant;

use crate::bitmaps::DirtyBitmap;
use crate::image::Allocation;
use crate::locks::{Locked, RwLocked};
use crate::nbd::server::{ClientInfo, Export, ExportError, Server};
use crate::nbd::wire::{STATE_DIRTY, STATE_HOLE, STATE_ZERO};
pub use view::View;

/// Backups running at once at most.
pub const MAX_BACKUPS: usize = 4;

/// Threads of the pool that copies before writes (made at the first backup).
pub const COPY_THREADS: usize = 4;

/// The running backups of one disk.
#[derive(Debug, Default)]
pub struct Backups {
    /// How many are in `list` (read by every write before anything else).
    active: AtomicUsize,
    list: RwLock<Vec<Arc<Backup>>>,
    /// Where the queues' copies before writes run, so that a queue keeps its other
    /// requests going while one waits for its copy.
    pool: std::sync::OnceLock<crate::offload::Pool>,
}

/// One running backup.
pub struct Backup {
    /// The checkpoint (bitmap) started at the view's moment.
    pub checkpoint: String,
    /// The checkpoint whose changes up to the view the export's dirty bitmap shows.
    pub incremental: Option<String>,
    pub export: String,
    pub uri: String,
    pub view: Arc<View>,
    server: Mutex<Option<Server>>,
    started: Instant,
}

impl std::fmt::Debug for Backup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Backup")
            .field("checkpoint", &self.checkpoint)
            .field("uri", &self.uri)
            .finish()
    }
}

/// What `backup-list` shows of one backup.
#[derive(Debug, Clone, serde::Serialize)]
pub struct BackupInfo {
    pub checkpoint: String,
    pub incremental: Option<String>,
    pub export: String,
    pub uri: String,
    pub size: u64,
    pub granule: u64,
    pub seconds: f64,
    pub clients: Vec<ClientInfo>,
    pub clients_refused: u64,
    pub bytes_read: u64,
    pub copied_bytes: u64,
    pub scratch_used: u64,
    pub failed: Option<String>,
}

impl Backup {
    pub fn info(&self) -> BackupInfo {
        let s = self.server.locked();
        BackupInfo {
            checkpoint: self.checkpoint.clone(),
            incremental: self.incremental.clone(),
            export: self.export.clone(),
            uri: self.uri.clone(),
            size: self.view.size(),
            granule: self.view.granule(),
            seconds: self.started.elapsed().as_secs_f64(),
            clients: s.as_ref().map(|s| s.clients()).unwrap_or_default(),
            clients_refused: s.as_ref().map_or(0, |s| s.refused()),
            bytes_read: s.as_ref().map_or(0, |s| s.bytes_read()),
            copied_bytes: self.view.copied_bytes(),
            scratch_used: self.view.scratch_used(),
            failed: self.view.failure(),
        }
    }
}

impl Backups {
    /// Before a guest write of [offset, offset + len) starts: every view copies what it
    /// still needs of the range.
    #[inline]
    pub fn before_write(&self, offset: u64, len: u64) {
        if self.active.load(Ordering::Acquire) == 0 {
            return;
        }
        for b in self.list.read_locked().iter() {
            b.view.before_write(offset, len);
        }
    }

    /// Does a write of [offset, offset + len) have anything to copy first?
    #[inline]
    pub fn needs_copy(&self, offset: u64, len: u64) -> bool {
        self.active.load(Ordering::Acquire) > 0
            && self
                .list
                .read_locked()
                .iter()
                .any(|b| b.view.needs_copy(offset, len))
    }

    /// Run a copy on the backup pool; the job back if there is no pool.
    pub fn submit(&self, job: crate::offload::Job) -> Result<(), crate::offload::Job> {
        match self.pool.get() {
            Some(p) => p.submit(job),
            None => Err(job),
        }
    }

    /// Make the copy pool if there is none yet (at a backup's begin).
    fn ensure_pool(&self) -> std::io::Result<()> {
        if self.pool.get().is_none() {
            let p = crate::offload::Pool::new(COPY_THREADS, "vublk-copy")?;
            let _ = self.pool.set(p);
        }
        Ok(())
    }

    /// Is a backup running?
    pub fn any(&self) -> bool {
        self.active.load(Ordering::Acquire) > 0
    }

    pub fn list(&self) -> Vec<BackupInfo> {
        self.list.read_locked().iter().map(|b| b.info()).collect()
    }

    fn find(&self, checkpoint: &str) -> Option<Arc<Backup>> {
        self.list
            .read_locked()
            .iter()
            .find(|b| b.checkpoint == checkpoint)
            .cloned()
    }

    /// Add a backup (its view copies from the next write on).
    fn insert(&self, b: Arc<Backup>) {
        let mut l = self.list.write_locked();
        l.push(b);
        self.active.store(l.len(), Ordering::Release);
    }

    /// Stop a backup: its export closes, its view is dropped once the last reader is done.
    fn remove(&self, checkpoint: &str) -> Option<Arc<Backup>> {
        let mut l = self.list.write_locked();
        let i = l.iter().position(|b| b.checkpoint == checkpoint)?;
        let b = l.remove(i);
        self.active.store(l.len(), Ordering::Release);
        drop(l);
        if let Some(mut s) = b.server.locked().take() {
            s.stop();
        }
        Some(b)
    }

    /// Stop every backup (the daemon is stopping).
    pub fn end_all(&self) {
        let names: Vec<String> = self
            .list
            .read_locked()
            .iter()
            .map(|b| b.checkpoint.clone())
            .collect();
        for n in names {
            self.remove(&n);
        }
    }

    fn len(&self) -> usize {
        self.list.read_locked().len()
    }
}

/// The export of a backup: the view, its allocation, and the incremental bitmap.
struct BackupExport {
    name: String,
    view: Arc<View>,
    /// `qemu:dirty-bitmap:NAME`: the bitmap (not recording any more).
    bitmap: Option<Arc<DirtyBitmap>>,
}

const BASE_ALLOCATION: &str = "base:allocation";
const DIRTY_PREFIX: &str = "qemu:dirty-bitmap:";

impl Export for BackupExport {
    fn name(&self) -> &str {
        &self.name
    }

    fn size(&self) -> u64 {
        self.view.size()
    }

    fn read(&self, offset: u64, dst: &mut [u8]) -> Result<(), ExportError> {
        self.view.read(offset, dst).map_err(ExportError::io)
    }

    fn meta_contexts(&self) -> Vec<String> {
        let mut c = vec![BASE_ALLOCATION.to_string()];
        if let Some(b) = &self.bitmap {
            c.push(format!("{DIRTY_PREFIX}{}", b.name()));
        }
        c
    }

    fn block_status(
        &self,
        context: &str,
        offset: u64,
        len: u32,
    ) -> Result<Vec<(u32, u32)>, ExportError> {
        let len = u64::from(len);
        if context == BASE_ALLOCATION {
            let runs = self.view.allocation(offset, len).map_err(ExportError::io)?;
            return Ok(runs
                .into_iter()
                .map(|(n, a)| {
                    let f = match a {
                        Allocation::Data => 0,
                        Allocation::Zero { hole: true } => STATE_HOLE | STATE_ZERO,
                        Allocation::Zero { hole: false } => STATE_ZERO,
                    };
                    (n as u32, f)
                })
                .collect());
        }
        let Some(b) = self
            .bitmap
            .as_ref()
            .filter(|b| context.strip_prefix(DIRTY_PREFIX) == Some(b.name()))
        else {
            return Err(ExportError::io("no such meta context"));
        };
        Ok(dirty_runs(b, offset, len.min(self.view.size() - offset)))
    }
}

/// The dirty and clean runs of `b` over [offset, offset + len).
fn dirty_runs(b: &DirtyBitmap, offset: u64, len: u64) -> Vec<(u32, u32)> {
    let end = offset + len;
    let mut out: Vec<(u32, u32)> = Vec::new();
    let mut push = |n: u64, f: u32| match out.last_mut() {
        Some(l) if l.1 == f => l.0 += n as u32,
        _ => out.push((n as u32, f)),
    };
    let mut pos = offset;
    // The dirty extents from the granule holding `offset` on.
    let g = b.granularity();
    let (extents, next) = b.dirty_extents(offset / g * g, 4096);
    // Where the extents stop telling (more dirty extents after): no claim past it.
    let known_end = next.map_or(end, |n| n.clamp(offset, end));
    for (o, l) in extents {
        if pos >= end {
            break;
        }
        let (s, e) = (o.max(pos), (o + l).min(end));
        if e <= pos {
            continue;
        }
        if s > pos {
            push(s.min(end) - pos, 0);
            pos = s.min(end);
        }
        if e > pos {
            push(e - pos, STATE_DIRTY);
            pos = e;
        }
    }
    if pos < known_end {
        push(known_end - pos, 0);
    }
    if out.is_empty() {
        out.push((len as u32, 0));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dirty_runs_cover_the_range_exactly() {
        let b = Arc::new(DirtyBitmap::new("c1", 65536, 1 << 20, true));
        b.mark(65536, 1);
        b.mark(3 * 65536, 2 * 65536);
        assert_eq!(
            dirty_runs(&b, 0, 1 << 20),
            vec![
                (65536, 0),
                (65536, STATE_DIRTY),
                (65536, 0),
                (2 * 65536, STATE_DIRTY),
                ((1 << 20) - 5 * 65536, 0)
            ]
        );
        assert_eq!(dirty_runs(&b, 70000, 1000), vec![(1000, STATE_DIRTY)]);
        assert_eq!(dirty_runs(&b, 200000, 100), vec![(100, STATE_DIRTY)]);
        assert_eq!(dirty_runs(&b, 0, 4096), vec![(4096, 0)]);
    }
}
