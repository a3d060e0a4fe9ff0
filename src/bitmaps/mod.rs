//! Changed-block tracking: the disk's dirty bitmaps (docs/changed-block-tracking.md).
//!
//! A bitmap records which granules of the disk changed while it was enabled: every request
//! that changes what the guest reads (a write, WRITE_ZEROES, a DISCARD that deallocates, a
//! write detect-zeroes turned into zeroes) marks its range in every enabled bitmap before
//! the guest sees it complete; reads and flushes do not. Rooms: `bitmap` (one bitmap: atomic
//! bits in shared chunks), `control` (the `bitmap-*` control methods).
//!
//! The data path takes no lock shared by the queues: each queue keeps a [`Recorder`] with
//! its own view of the bitmaps, taken again only when the set changed (a bitmap added or
//! removed: a generation counter the queues only read) or a bitmap grew.

mod bitmap;
pub mod control;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

pub use bitmap::{DirtyBitmap, View, DEFAULT_GRANULARITY, MAX_GRANULARITY, MIN_GRANULARITY};

use crate::locks::Locked;

/// Longest bitmap name, in bytes (as qcow2's bitmap directory allows).
pub const MAX_NAME_BYTES: usize = 1023;
/// Most bitmaps a disk keeps (as qcow2 allows).
pub const MAX_BITMAPS: usize = 65535;

/// Why a bitmap operation is refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum BitmapError {
    #[error("bitmap {0:?} exists")]
    Exists(String),
    #[error("no bitmap {0:?}")]
    NotFound(String),
    #[error("bitmap name {0:?}: 1 to 1023 bytes of printable characters (no control characters)")]
    BadName(String),
    #[error("granularity {0}: a power of two from 512 bytes to 2 GiB")]
    BadGranularity(u64),
    #[error(
        "bitmap {target:?} ({target_g} bytes) and {other:?} ({other_g} bytes): merged bitmaps \
         need the same granularity"
    )]
    GranularityMismatch {
        target: String,
        target_g: u64,
        other: String,
        other_g: u64,
    },
    #[error("bitmap {0:?} is inconsistent (its writer stopped without writing it back): it can only be removed")]
    Inconsistent(String),
    #[error("persistent bitmaps: {0}")]
    NotPersistent(String),
    #[error("this disk has the most bitmaps it can keep ({MAX_BITMAPS})")]
    TooMany,
    #[error("writing the persistent bitmaps to the image: {0}")]
    Save(String),
}

/// What `bitmap-list` says of a bitmap.
#[derive(Debug, Clone, serde::Serialize, PartialEq, Eq)]
pub struct BitmapInfo {
    pub name: String,
    pub granularity: u64,
    /// Writes are recorded (enabled).
    pub recording: bool,
    /// Kept in the image file across restarts (qcow2); false: in memory only.
    pub persistent: bool,
    /// Its writer stopped without writing it back: not a valid record; remove it.
    pub inconsistent: bool,
    pub dirty_bytes: u64,
    /// The disk size it covers.
    pub size_bytes: u64,
}

/// A bitmap with what the set keeps about it.
#[derive(Debug)]
struct Entry {
    bitmap: Arc<DirtyBitmap>,
    persistent: bool,
    inconsistent: bool,
    /// A block job's own record of what the guest changes (`track`): not listed, not
    /// reachable by name, never persistent.
    internal: bool,
}

/// The disk's bitmaps.
#[derive(Debug)]
pub struct Bitmaps {
    entries: Mutex<Vec<Entry>>,
    /// Bumped (after the change) whenever a bitmap is added or removed.
    generation: AtomicU64,
    /// The disk size new bitmaps cover.
    size: AtomicU64,
    /// Why persistent bitmaps cannot be kept for this disk (None: they can).
    /// (Set again when the image is taken over: a migration destination learns it then.)
    no_persistence: Mutex<Option<String>>,
}

/// A queue's view of the bitmaps, for the data path.
#[derive(Debug, Default)]
pub struct Recorder {
    generation: u64,
    /// Each enabled bitmap's view, and whether it is kept in the image file.
    views: Vec<(View, bool)>,
    /// Words of persistent bitmaps newly set since the last [`Recorder::take_marks`]: they
    /// reach the file before the requests that set them complete.
    marks: Vec<Mark>,
}

/// Words [first, last] of a persistent bitmap that changed in memory and must reach the file.
#[derive(Debug, Clone)]
pub struct Mark {
    pub bitmap: Arc<DirtyBitmap>,
    pub first_word: u64,
    pub last_word: u64,
}

/// A persistent bitmap as the image file keeps it.
#[derive(Debug, Clone)]
pub struct Persistent {
    pub bitmap: Arc<DirtyBitmap>,
    /// Its writer stopped without writing it back (its bits mean nothing).
    pub inconsistent: bool,
}

/// Writes the disk's persistent bitmaps to its file after a change (the directory, and each
/// bitmap's bits as memory holds them now); `Err`: why it could not.
pub type Save<'a> = &'a dyn Fn(&[Persistent]) -> Result<(), String>;

/// A bitmap name as the control socket may give it.
pub fn check_name(name: &str) -> Result<(), BitmapError> {
    if name.is_empty() || name.len() > MAX_NAME_BYTES || name.chars().any(char::is_control) {
        return Err(BitmapError::BadName(name.chars().take(64).collect()));
    }
    Ok(())
}

/// A granularity as the control socket may give it.
pub fn check_granularity(g: u64) -> Result<(), BitmapError> {
    if g.is_power_of_two() && (MIN_GRANULARITY..=MAX_GRANULARITY).contains(&g) {
        Ok(())
    } else {
        Err(BitmapError::BadGranularity(g))
    }
}

impl Bitmaps {
    /// No bitmaps, for a disk of `size` bytes; `no_persistence`: why this disk cannot keep
    /// bitmaps in its file (None: it can).
    pub fn new(size: u64, no_persistence: Option<String>) -> Self {
        Bitmaps {
            entries: Mutex::new(Vec::new()),
            generation: AtomicU64::new(1),
            size: AtomicU64::new(size),
            no_persistence: Mutex::new(no_persistence),
        }
    }

    fn changed(&self) {
        self.generation.fetch_add(1, Ordering::AcqRel);
    }

    /// The persistent bitmaps of `entries`, for a [`Save`].
    fn persistent_of(entries: &[Entry]) -> Vec<Persistent> {
        entries
            .iter()
            .filter(|x| x.persistent)
            .map(|x| Persistent {
                bitmap: x.bitmap.clone(),
                inconsistent: x.inconsistent,
            })
            .collect()
    }

    /// The persistent bitmaps now.
    pub fn persistent(&self) -> Vec<Persistent> {
        Self::persistent_of(&self.entries.locked())
    }

    /// Take the image's persistent bitmaps (at open, and when the image is taken over from
    /// another process): they replace the persistent bitmaps kept so far; memory-only ones
    /// stay. Nothing changes when the set holds exactly these already.
    pub fn adopt(&self, loaded: Vec<Persistent>, memory_only: Option<String>) {
        *self.no_persistence.locked() = memory_only;
        let mut e = self.entries.locked();
        let same = {
            let mine: Vec<&Entry> = e.iter().filter(|x| x.persistent).collect();
            mine.len() == loaded.len()
                && mine
                    .iter()
                    .zip(&loaded)
                    .all(|(a, b)| Arc::ptr_eq(&a.bitmap, &b.bitmap))
        };
        if same {
            return;
        }
        e.retain(|x| !x.persistent);
        // A memory-only bitmap of the same name gives way to the file's.
        e.retain(|x| !loaded.iter().any(|l| l.bitmap.name() == x.bitmap.name()));
        for l in loaded {
            e.push(Entry {
                bitmap: l.bitmap,
                persistent: true,
                inconsistent: l.inconsistent,
                internal: false,
            });
        }
        drop(e);
        self.changed();
    }

    /// Save the persistent bitmaps of `e` if `persistent` (the changed bitmap is one).
    fn save_if(e: &[Entry], persistent: bool, save: Save) -> Result<(), BitmapError> {
        if !persistent {
            return Ok(());
        }
        save(&Self::persistent_of(e)).map_err(BitmapError::Save)
    }

    /// Add a clean bitmap (a persistent one is in the file when this returns).
    pub fn add(
        &self,
        name: &str,
        granularity: u64,
        persistent: bool,
        recording: bool,
        save: Save,
    ) -> Result<(), BitmapError> {
        check_name(name)?;
        check_granularity(granularity)?;
        if persistent {
            if let Some(why) = self.memory_only() {
                return Err(BitmapError::NotPersistent(why));
            }
        }
        let mut e = self.entries.locked();
        if e.iter().any(|x| x.bitmap.name() == name) {
            return Err(BitmapError::Exists(name.to_owned()));
        }
        if e.len() >= MAX_BITMAPS {
            return Err(BitmapError::TooMany);
        }
        let size = self.size.load(Ordering::Acquire);
        e.push(Entry {
            bitmap: Arc::new(DirtyBitmap::new(name, granularity, size, recording)),
            persistent,
            inconsistent: false,
            internal: false,
        });
        if let Err(err) = Self::save_if(&e, persistent, save) {
            e.pop();
            return Err(err);
        }
        drop(e);
        self.changed();
        Ok(())
    }

    /// Remove a bitmap (a persistent one is gone from the file when this returns).
    pub fn remove(&self, name: &str, save: Save) -> Result<(), BitmapError> {
        let mut e = self.entries.locked();
        let i = e
            .iter()
            .position(|x| !x.internal && x.bitmap.name() == name)
            .ok_or_else(|| BitmapError::NotFound(name.to_owned()))?;
        let gone = e.remove(i);
        if let Err(err) = Self::save_if(&e, gone.persistent, save) {
            e.insert(i, gone);
            return Err(err);
        }
        drop(e);
        self.changed();
        Ok(())
    }

    /// The bitmap `name`, if it is consistent, and whether it is persistent.
    fn usable_in(e: &[Entry], name: &str) -> Result<(Arc<DirtyBitmap>, bool), BitmapError> {
        let x = e
            .iter()
            .find(|x| !x.internal && x.bitmap.name() == name)
            .ok_or_else(|| BitmapError::NotFound(name.to_owned()))?;
        if x.inconsistent {
            return Err(BitmapError::Inconsistent(name.to_owned()));
        }
        Ok((x.bitmap.clone(), x.persistent))
    }

    fn usable(&self, name: &str) -> Result<Arc<DirtyBitmap>, BitmapError> {
        Self::usable_in(&self.entries.locked(), name).map(|(b, _)| b)
    }

    /// Clear a bitmap (writes completing after this returns are recorded; a persistent
    /// bitmap is clear in the file when this returns).
    pub fn clear(&self, name: &str, save: Save) -> Result<(), BitmapError> {
        let e = self.entries.locked();
        let (b, persistent) = Self::usable_in(&e, name)?;
        b.clear();
        Self::save_if(&e, persistent, save)
    }

    /// Start or stop recording (kept in the file for a persistent bitmap: its "auto" flag).
    pub fn set_recording(&self, name: &str, on: bool, save: Save) -> Result<(), BitmapError> {
        let e = self.entries.locked();
        let (b, persistent) = Self::usable_in(&e, name)?;
        let was = b.recording();
        b.set_recording(on);
        let r = Self::save_if(&e, persistent && was != on, save);
        if r.is_err() {
            b.set_recording(was);
        }
        r
    }

    /// Set in `target` every bit set in any of `sources`.
    pub fn merge(&self, target: &str, sources: &[String], save: Save) -> Result<(), BitmapError> {
        let e = self.entries.locked();
        let (t, persistent) = Self::usable_in(&e, target)?;
        let srcs = sources
            .iter()
            .map(|s| Self::usable_in(&e, s).map(|(b, _)| b))
            .collect::<Result<Vec<_>, _>>()?;
        for s in &srcs {
            if s.granularity() != t.granularity() {
                return Err(BitmapError::GranularityMismatch {
                    target: target.to_owned(),
                    target_g: t.granularity(),
                    other: s.name().to_owned(),
                    other_g: s.granularity(),
                });
            }
        }
        for s in &srcs {
            if !Arc::ptr_eq(s, &t) {
                t.merge_from(s);
            }
        }
        Self::save_if(&e, persistent, save)
    }

    /// Every bitmap, in the order they were added.
    pub fn list(&self) -> Vec<BitmapInfo> {
        self.entries
            .locked()
            .iter()
            .filter(|x| !x.internal)
            .map(|x| BitmapInfo {
                name: x.bitmap.name().to_owned(),
                granularity: x.bitmap.granularity(),
                recording: x.bitmap.recording() && !x.inconsistent,
                persistent: x.persistent,
                inconsistent: x.inconsistent,
                dirty_bytes: if x.inconsistent {
                    0
                } else {
                    x.bitmap.dirty_bytes()
                },
                size_bytes: x.bitmap.size(),
            })
            .collect()
    }

    /// A bitmap of its own for a block job (a commit, a mirror): recording from now on
    /// everything the guest changes, as the named ones do, but not listed, not reachable by
    /// name and never saved. [`Self::untrack`] drops it.
    pub fn track(&self, granularity: u64) -> Arc<DirtyBitmap> {
        let g = granularity
            .clamp(MIN_GRANULARITY, MAX_GRANULARITY)
            .next_power_of_two();
        let b = Arc::new(DirtyBitmap::new(
            "\u{1}job",
            g,
            self.size.load(Ordering::Acquire),
            true,
        ));
        self.entries.locked().push(Entry {
            bitmap: b.clone(),
            persistent: false,
            inconsistent: false,
            internal: true,
        });
        self.changed();
        b
    }

    /// Stop recording into a job's bitmap.
    pub fn untrack(&self, b: &Arc<DirtyBitmap>) {
        self.entries
            .locked()
            .retain(|x| !(x.internal && Arc::ptr_eq(&x.bitmap, b)));
        self.changed();
    }

    /// The bitmap `name` (for reading its extents).
    pub fn get(&self, name: &str) -> Result<Arc<DirtyBitmap>, BitmapError> {
        self.usable(name)
    }

    /// The disk grew to `size` bytes: every bitmap covers it (before the guest may write
    /// there).
    pub fn grow(&self, size: u64) {
        let e = self.entries.locked();
        self.size.fetch_max(size, Ordering::AcqRel);
        for x in e.iter() {
            x.bitmap.grow(size);
        }
    }

    /// Why this disk's bitmaps live in memory only (None: they can be kept in its file).
    pub fn memory_only(&self) -> Option<String> {
        self.no_persistence.locked().clone()
    }

    /// Is any bitmap kept at all?
    pub fn is_empty(&self) -> bool {
        self.entries.locked().iter().all(|x| x.internal)
    }
}

impl Recorder {
    /// Mark [offset, offset + len) in every enabled bitmap of `set`. Without bitmaps: one
    /// load of a counter the queues only read.
    pub fn mark(&mut self, set: &Bitmaps, offset: u64, len: u64) {
        let g = set.generation.load(Ordering::Acquire);
        if g != self.generation {
            let e = set.entries.locked();
            self.views = e
                .iter()
                .filter(|x| !x.inconsistent)
                .map(|x| (x.bitmap.view(), x.persistent))
                .collect();
            self.generation = g;
        }
        for (v, persistent) in &mut self.views {
            if let Some((first_word, last_word)) = v.mark(offset, len) {
                if *persistent {
                    self.marks.push(Mark {
                        bitmap: v.bitmap().clone(),
                        first_word,
                        last_word,
                    });
                }
            }
        }
    }

    /// Are there newly set words of persistent bitmaps to write to the file?
    pub fn has_marks(&self) -> bool {
        !self.marks.is_empty()
    }

    /// The newly set words of persistent bitmaps, for the file.
    pub fn take_marks(&mut self) -> Vec<Mark> {
        std::mem::take(&mut self.marks)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nosave(_: &[Persistent]) -> Result<(), String> {
        Ok(())
    }

    #[test]
    fn names_and_granularities_are_checked() {
        let s = Bitmaps::new(
            1 << 30,
            Some("raw images keep bitmaps in memory only".into()),
        );
        for bad in ["", "a\nb", "tab\there", &"x".repeat(1024)] {
            assert!(matches!(
                s.add(bad, 65536, false, true, &nosave),
                Err(BitmapError::BadName(_))
            ));
        }
        for g in [0, 256, 3 << 10, 1 << 32] {
            assert_eq!(
                s.add("b", g, false, true, &nosave),
                Err(BitmapError::BadGranularity(g))
            );
        }
        assert!(matches!(
            s.add("b", 65536, true, true, &nosave),
            Err(BitmapError::NotPersistent(_))
        ));
        s.add("b", 512, false, true, &nosave).unwrap();
        s.add("c", 1 << 31, false, false, &nosave).unwrap();
        assert_eq!(
            s.add("b", 512, false, true, &nosave),
            Err(BitmapError::Exists("b".into()))
        );
        assert_eq!(
            s.remove("x", &nosave),
            Err(BitmapError::NotFound("x".into()))
        );
        assert!(matches!(
            s.merge("b", &["c".into()], &nosave),
            Err(BitmapError::GranularityMismatch { .. })
        ));
    }

    #[test]
    fn a_recorder_sees_bitmaps_added_after_it_started() {
        let s = Bitmaps::new(1 << 30, None);
        let mut r = Recorder::default();
        r.mark(&s, 0, 4096);
        s.add("b", 65536, false, true, &nosave).unwrap();
        r.mark(&s, 1 << 20, 4096);
        let l = s.list();
        assert_eq!(l[0].dirty_bytes, 65536);
        s.set_recording("b", false, &nosave).unwrap();
        r.mark(&s, 2 << 20, 4096);
        assert_eq!(s.list()[0].dirty_bytes, 65536);
        assert!(!s.list()[0].recording);
        s.remove("b", &nosave).unwrap();
        r.mark(&s, 3 << 20, 4096);
        assert!(s.list().is_empty());
    }

    #[test]
    fn growth_covers_new_space_for_old_and_new_bitmaps() {
        let s = Bitmaps::new(1 << 20, None);
        s.add("a", 512, false, true, &nosave).unwrap();
        let mut r = Recorder::default();
        r.mark(&s, 0, 512);
        s.grow(1 << 30);
        s.add("b", 512, false, true, &nosave).unwrap();
        r.mark(&s, (1 << 30) - 512, 512);
        for i in s.list() {
            assert_eq!(i.size_bytes, 1 << 30);
        }
        assert_eq!(s.list()[0].dirty_bytes, 1024);
        assert_eq!(s.list()[1].dirty_bytes, 512);
    }

    #[test]
    fn a_job_bitmap_records_but_is_hidden() {
        let s = Bitmaps::new(1 << 30, None);
        let mut r = Recorder::default();
        let t = s.track(65536);
        r.mark(&s, 1 << 20, 4096);
        assert!(s.list().is_empty());
        assert!(s.is_empty());
        assert!(matches!(s.get("\u{1}job"), Err(BitmapError::NotFound(_))));
        assert_eq!(t.dirty_bytes(), 65536);
        s.untrack(&t);
        r.mark(&s, 2 << 20, 4096);
        assert_eq!(t.dirty_bytes(), 65536);
    }
}
