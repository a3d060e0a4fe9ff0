//! One dirty bitmap: a bit per granule of the disk (`granularity` bytes, a power of two), set
//! when a request changes what the guest reads there.
//!
//! The bits live in fixed-size chunks of atomic words shared through `Arc`s: a queue marks
//! through its own list of the chunks (a [`View`]), without a lock; growing the bitmap (an
//! online resize) appends chunks to a new list and keeps the old ones, so a mark through a
//! list taken before the growth lands in the same words as one taken after. Nothing is ever
//! lost to a concurrent growth, clear or merge: every operation is a per-word atomic.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::locks::Locked;

/// Words per chunk: 64 KiB of bits (524,288 granules; 32 GiB of disk at 64 KiB).
pub const CHUNK_WORDS: usize = 8192;
const CHUNK_BITS: u64 = (CHUNK_WORDS * 64) as u64;

/// Smallest and largest granularity (as QEMU's: 512 bytes to 2 GiB).
pub const MIN_GRANULARITY: u64 = 512;
pub const MAX_GRANULARITY: u64 = 1 << 31;
/// The default granularity (QEMU's for a disk of this kind).
pub const DEFAULT_GRANULARITY: u64 = 64 << 10;

type Chunk = Arc<[AtomicU64]>;

fn new_chunk() -> Chunk {
    (0..CHUNK_WORDS).map(|_| AtomicU64::new(0)).collect()
}

/// A dirty bitmap.
#[derive(Debug)]
pub struct DirtyBitmap {
    name: String,
    /// log2 of the granularity.
    shift: u32,
    /// Writes are recorded (`bitmap-enable`, `bitmap-disable`).
    recording: AtomicBool,
    /// The disk size it covers, in bytes.
    size: AtomicU64,
    /// Every chunk, in order; a view is a copy of this list (growth only appends).
    chunks: Mutex<Vec<Chunk>>,
}

/// A queue's list of a bitmap's chunks, to mark without a lock.
#[derive(Debug)]
pub struct View {
    bitmap: Arc<DirtyBitmap>,
    chunks: Vec<Chunk>,
}

impl DirtyBitmap {
    /// A clean bitmap of `size` bytes at `granularity` (a power of two between
    /// [`MIN_GRANULARITY`] and [`MAX_GRANULARITY`]; checked by the caller).
    pub fn new(name: &str, granularity: u64, size: u64, recording: bool) -> Self {
        debug_assert!(granularity.is_power_of_two());
        let b = DirtyBitmap {
            name: name.to_owned(),
            shift: granularity.trailing_zeros(),
            recording: AtomicBool::new(recording),
            size: AtomicU64::new(0),
            chunks: Mutex::new(Vec::new()),
        };
        b.grow(size);
        b
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn granularity(&self) -> u64 {
        1 << self.shift
    }

    pub fn size(&self) -> u64 {
        self.size.load(Ordering::Acquire)
    }

    pub fn recording(&self) -> bool {
        self.recording.load(Ordering::Acquire)
    }

    pub fn set_recording(&self, on: bool) {
        self.recording.store(on, Ordering::Release);
    }

    /// Granules of `size` bytes.
    fn bits_for(&self, size: u64) -> u64 {
        size.div_ceil(self.granularity())
    }

    /// Cover `size` bytes (never shrinks): chunks for the new granules, clean.
    pub fn grow(&self, size: u64) {
        let mut chunks = self.chunks.locked();
        let need = self.bits_for(size).div_ceil(CHUNK_BITS) as usize;
        while chunks.len() < need {
            chunks.push(new_chunk());
        }
        self.size.fetch_max(size, Ordering::AcqRel);
    }

    /// The chunks now, for a queue to mark through.
    pub fn view(self: &Arc<Self>) -> View {
        View {
            bitmap: self.clone(),
            chunks: self.chunks.locked().clone(),
        }
    }

    /// Mark [offset, offset + len) dirty (taking the chunk list: not for the data path,
    /// which marks through a [`View`]).
    pub fn mark(self: &Arc<Self>, offset: u64, len: u64) {
        self.view().mark(offset, len);
    }

    /// The granules [first, last] of [offset, offset + len), within the bitmap; None if
    /// empty.
    fn granules(&self, offset: u64, len: u64) -> Option<(u64, u64)> {
        let end = offset.saturating_add(len).min(self.size());
        if len == 0 || offset >= end {
            return None;
        }
        Some((offset >> self.shift, (end - 1) >> self.shift))
    }

    /// Is the granule holding byte `offset` dirty?
    pub fn is_dirty(&self, offset: u64) -> bool {
        let bit = offset >> self.shift;
        let chunks = self.chunks.locked();
        word(&chunks, bit / 64).is_some_and(|w| w.load(Ordering::Acquire) & (1 << (bit % 64)) != 0)
    }

    /// Words of the bitmap (64 granules each, as they lie in memory).
    pub fn words(&self) -> u64 {
        self.bits_for(self.size()).div_ceil(64)
    }

    /// Copy the words from `first` on into `out` as little-endian bytes (qcow2's layout:
    /// bit k of byte i is granule 8i + k), zeroes past the end.
    pub fn copy_le(&self, first: u64, out: &mut [u8]) {
        let chunks = self.chunks.locked().clone();
        for (i, dst) in out.chunks_mut(8).enumerate() {
            let v = word(&chunks, first + i as u64).map_or(0, |w| w.load(Ordering::Acquire));
            let b = v.to_le_bytes();
            dst.copy_from_slice(&b[..dst.len()]);
        }
    }

    /// Clear the granules that lie wholly inside [offset, offset + len) (a job's bitmap,
    /// for a range the guest's write was also written to the job's target: that granule
    /// holds the same on both). The chunk list is taken: not for the data path's fast
    /// case.
    pub fn clear_within(&self, offset: u64, len: u64) {
        let g = self.granularity();
        let first = offset.div_ceil(g);
        let end = offset.saturating_add(len).min(self.size());
        // Granules [first, last): the last one may end at the disk's end.
        let last = if end == self.size() {
            end.div_ceil(g)
        } else {
            end / g
        };
        if first >= last {
            return;
        }
        let chunks = self.chunks.locked().clone();
        for bit in first..last {
            if let Some(w) = word(&chunks, bit / 64) {
                w.fetch_and(!(1 << (bit % 64)), Ordering::AcqRel);
            }
        }
    }

    /// Clear every bit.
    pub fn clear(&self) {
        for c in self.chunks.locked().iter() {
            for w in c.iter() {
                w.store(0, Ordering::Release);
            }
        }
    }

    /// Set every bit `other` has set (both have the same granularity; bits beyond this
    /// bitmap's size are not taken).
    pub fn merge_from(&self, other: &DirtyBitmap) {
        debug_assert_eq!(self.shift, other.shift);
        let mine = self.chunks.locked().clone();
        let theirs = other.chunks.locked().clone();
        let words = self.bits_for(self.size()).div_ceil(64);
        for i in 0..words {
            let (Some(w), Some(o)) = (word(&mine, i), word(&theirs, i)) else {
                break;
            };
            let mut v = o.load(Ordering::Acquire);
            if i == words - 1 {
                v &= tail_mask(self.bits_for(self.size()));
            }
            if v != 0 {
                w.fetch_or(v, Ordering::AcqRel);
            }
        }
    }

    /// Dirty bytes: the dirty granules' bytes, the last one cut at the disk's end.
    pub fn dirty_bytes(&self) -> u64 {
        let size = self.size();
        let bits = self.bits_for(size);
        let chunks = self.chunks.locked().clone();
        let words = bits.div_ceil(64);
        let mut n = 0u64;
        for i in 0..words {
            let mut v = word(&chunks, i).map_or(0, |w| w.load(Ordering::Acquire));
            if i == words - 1 {
                v &= tail_mask(bits);
            }
            n += u64::from(v.count_ones());
        }
        let mut bytes = n << self.shift;
        if bits > 0
            && !size.is_multiple_of(self.granularity())
            && self.is_dirty((bits - 1) << self.shift)
        {
            bytes -= self.granularity() - size % self.granularity();
        }
        bytes
    }

    /// The dirty extents (offset, length in bytes) from byte `from` on, at most `max` of
    /// them; and where the next call would go on (None: the end was reached).
    pub fn dirty_extents(&self, from: u64, max: usize) -> (Vec<(u64, u64)>, Option<u64>) {
        let size = self.size();
        let chunks = self.chunks.locked().clone();
        let bits = self.bits_for(size);
        let mut out: Vec<(u64, u64)> = Vec::new();
        let mut bit = from >> self.shift;
        while bit < bits {
            let w = word(&chunks, bit / 64).map_or(0, |w| w.load(Ordering::Acquire));
            let k = bit % 64;
            let rest = w >> k;
            if rest == 0 {
                bit += 64 - k;
                continue;
            }
            bit += u64::from(rest.trailing_zeros());
            if bit >= bits {
                break;
            }
            // The run of set bits from `bit` in this word.
            let run = u64::from((!(w >> (bit % 64))).trailing_zeros()).min(bits - bit);
            let start = bit << self.shift;
            let end = ((bit + run) << self.shift).min(size);
            if let Some(last) = out.last_mut().filter(|l| l.0 + l.1 == start) {
                last.1 = end - last.0;
            } else if out.len() == max {
                return (out, Some(start));
            } else {
                out.push((start, end - start));
            }
            bit += run;
        }
        (out, None)
    }
}

impl DirtyBitmap {
    /// Clear the dirty granules from byte `from` on and return them as extents (offset,
    /// length in bytes), at most `max_bytes` of them (at least one granule when any is
    /// dirty); and where the next call would go on (None: the end was reached). Each word is
    /// taken with one atomic swap: a bit set after the swap is left for the next call (a
    /// block job copies what it took, and what the guest changes meanwhile comes again).
    pub fn take_extents(&self, from: u64, max_bytes: u64) -> (Vec<(u64, u64)>, Option<u64>) {
        let size = self.size();
        let chunks = self.chunks.locked().clone();
        let bits = self.bits_for(size);
        let g = self.granularity();
        let mut out: Vec<(u64, u64)> = Vec::new();
        let mut taken = 0u64;
        let mut i = (from >> self.shift) / 64;
        let words = bits.div_ceil(64);
        while i < words {
            if taken >= max_bytes {
                return (out, Some(i * 64 * g));
            }
            let Some(w) = word(&chunks, i) else { break };
            let v = if w.load(Ordering::Relaxed) == 0 {
                0
            } else {
                w.swap(0, Ordering::AcqRel)
            };
            let mut v = v;
            while v != 0 {
                let k = u64::from(v.trailing_zeros());
                v &= v - 1;
                let bit = i * 64 + k;
                if bit >= bits {
                    break;
                }
                let start = bit << self.shift;
                let end = (start + g).min(size);
                taken += end - start;
                match out.last_mut() {
                    Some(l) if l.0 + l.1 == start => l.1 = end - l.0,
                    _ => out.push((start, end - start)),
                }
            }
            i += 1;
        }
        (out, None)
    }
}

/// Word `i` of the bitmap, if its chunk exists.
fn word(chunks: &[Chunk], i: u64) -> Option<&AtomicU64> {
    let c = chunks.get(usize::try_from(i / CHUNK_WORDS as u64).ok()?)?;
    c.get((i % CHUNK_WORDS as u64) as usize)
}

/// The bits of the last word below `bits` (all when `bits` is a multiple of 64).
fn tail_mask(bits: u64) -> u64 {
    match bits % 64 {
        0 => u64::MAX,
        n => (1 << n) - 1,
    }
}

impl View {
    pub fn bitmap(&self) -> &Arc<DirtyBitmap> {
        &self.bitmap
    }

    /// Mark [offset, offset + len) dirty if the bitmap records: a relaxed load per word, and
    /// an atomic OR only where a bit is still clear (a rewritten region costs no store).
    /// Returns the words [first, last] where a bit was newly set (None: nothing changed).
    pub fn mark(&mut self, offset: u64, len: u64) -> Option<(u64, u64)> {
        let b = &self.bitmap;
        if !b.recording() {
            return None;
        }
        let (first, last) = b.granules(offset, len)?;
        let mut changed: Option<(u64, u64)> = None;
        if (last / 64) / CHUNK_WORDS as u64 >= self.chunks.len() as u64 {
            // The bitmap grew after this view was taken: take it again.
            self.chunks = b.chunks.locked().clone();
        }
        let mut bit = first;
        while bit <= last {
            let in_word = (last - bit).min(63 - bit % 64) + 1;
            let mask = if in_word == 64 {
                u64::MAX
            } else {
                ((1u64 << in_word) - 1) << (bit % 64)
            };
            if let Some(w) = word(&self.chunks, bit / 64) {
                if w.load(Ordering::Relaxed) & mask != mask
                    && w.fetch_or(mask, Ordering::AcqRel) & mask != mask
                {
                    let i = bit / 64;
                    changed = Some(changed.map_or((i, i), |(f, _)| (f, i)));
                }
            }
            bit += in_word;
        }
        changed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const K: u64 = 1024;

    fn bitmap(g: u64, size: u64) -> Arc<DirtyBitmap> {
        Arc::new(DirtyBitmap::new("b", g, size, true))
    }

    #[test]
    fn marks_round_out_to_granules() {
        let b = bitmap(64 * K, 1 << 30);
        b.mark(100, 1);
        b.mark(64 * K - 1, 2);
        assert_eq!(b.dirty_extents(0, 10).0, [(0, 128 * K)]);
        b.mark(10 * 64 * K, 64 * K);
        assert_eq!(b.dirty_extents(0, 10).0, [(0, 128 * K), (640 * K, 64 * K)]);
        assert_eq!(b.dirty_bytes(), 192 * K);
        assert!(b.is_dirty(65 * K) && !b.is_dirty(128 * K));
    }

    #[test]
    fn long_marks_cross_words_and_chunks() {
        let g = 512;
        let size = 3 * CHUNK_BITS * g + 1000;
        let b = bitmap(g, size);
        let start = CHUNK_BITS * g - 70 * g;
        let len = CHUNK_BITS * g + 200 * g + 1;
        b.mark(start, len);
        assert_eq!(b.dirty_extents(0, 10).0, [(start, len.div_ceil(g) * g)]);
        // The last granule is cut at the disk's end.
        b.mark(size - 1, 1);
        let (e, _) = b.dirty_extents(size - 2000, 10);
        assert_eq!(e, [(size / g * g, size % g)]);
    }

    #[test]
    fn beyond_the_end_and_empty_marks_do_nothing() {
        let b = bitmap(64 * K, 1 << 20);
        b.mark(1 << 20, 4096);
        b.mark(0, 0);
        assert_eq!(b.dirty_bytes(), 0);
        b.mark((1 << 20) - 512, 4096);
        assert_eq!(b.dirty_extents(0, 10).0, [((1 << 20) - 64 * K, 64 * K)]);
    }

    #[test]
    fn disabled_bitmaps_record_nothing() {
        let b = bitmap(64 * K, 1 << 20);
        b.set_recording(false);
        b.mark(0, 4096);
        assert_eq!(b.dirty_bytes(), 0);
        b.set_recording(true);
        b.mark(0, 4096);
        assert_eq!(b.dirty_bytes(), 64 * K);
    }

    #[test]
    fn growth_keeps_bits_and_old_views_still_mark() {
        let b = bitmap(512, CHUNK_BITS * 512);
        let mut old = b.view();
        b.mark(0, 512);
        b.grow(3 * CHUNK_BITS * 512);
        // A view from before the growth marks the same words, and beyond it too.
        old.mark(1024, 512);
        old.mark(2 * CHUNK_BITS * 512, 512);
        assert_eq!(
            b.dirty_extents(0, 10).0,
            [(0, 512), (1024, 512), (2 * CHUNK_BITS * 512, 512)]
        );
        assert_eq!(b.size(), 3 * CHUNK_BITS * 512);
    }

    #[test]
    fn clear_and_merge() {
        let a = bitmap(64 * K, 1 << 30);
        let b = bitmap(64 * K, 1 << 30);
        a.mark(0, 1);
        b.mark(1 << 29, 1);
        a.merge_from(&b);
        assert_eq!(a.dirty_extents(0, 10).0, [(0, 64 * K), (1 << 29, 64 * K)]);
        assert_eq!(b.dirty_bytes(), 64 * K);
        a.clear();
        assert_eq!(a.dirty_bytes(), 0);
    }

    #[test]
    fn extents_page() {
        let b = bitmap(512, 1 << 20);
        for i in 0..10 {
            b.mark(i * 2048, 512);
        }
        let (first, next) = b.dirty_extents(0, 4);
        assert_eq!(first.len(), 4);
        assert_eq!(next, Some(4 * 2048));
        let (rest, next) = b.dirty_extents(next.unwrap(), 100);
        assert_eq!(rest.len(), 6);
        assert_eq!(next, None);
    }

    #[test]
    fn concurrent_marks_lose_nothing() {
        let b = bitmap(512, 64 << 20);
        let threads: Vec<_> = (0..4u64)
            .map(|t| {
                let mut v = b.view();
                std::thread::spawn(move || {
                    for i in 0..20_000u64 {
                        v.mark((i * 4 + t) * 512, 512);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(b.dirty_extents(0, 10).0, [(0, 80_000 * 512)]);
    }

    #[test]
    fn taking_extents_clears_them_and_stops_at_the_limit() {
        let b = bitmap(4096, 64 << 20);
        for i in 0..100u64 {
            b.mark(i * 8192, 4096);
        }
        b.mark(70 << 12, 3 << 12);
        let (first, next) = b.take_extents(0, 10 * 4096);
        // A whole word (64 granules) is taken with one swap, past the limit.
        assert_eq!(next, Some(64 * 4096));
        assert_eq!(first.len(), 32);
        assert_eq!(first[0], (0, 4096));
        assert_eq!(b.dirty_bytes(), (100 - 32) * 4096 + 4096);
        // What the guest dirties again before the next pass comes again.
        b.mark(0, 4096);
        let (rest, next) = b.take_extents(next.unwrap(), u64::MAX);
        assert_eq!(next, None);
        assert_eq!(rest[3], (70 << 12, 3 << 12));
        assert_eq!(rest.iter().map(|e| e.1).sum::<u64>(), (100 - 32 + 1) * 4096);
        assert_eq!(b.take_extents(0, u64::MAX).0, [(0, 4096)]);
        assert_eq!(b.dirty_bytes(), 0);
        assert_eq!(b.take_extents(0, u64::MAX), (vec![], None));
    }
}
