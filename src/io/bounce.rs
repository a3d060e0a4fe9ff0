//! Aligned bounce buffers for O_DIRECT, pooled per queue.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::io;
use std::ptr::NonNull;

/// A heap buffer with a chosen alignment.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    layout: Layout,
}

// SAFETY: AlignedBuf owns its allocation exclusively, like a Box<[u8]>.
unsafe impl Send for AlignedBuf {}

impl AlignedBuf {
    /// Allocate `len` zeroed bytes aligned to `align` (a power of two).
    pub fn new(len: usize, align: usize) -> io::Result<Self> {
        let layout = Layout::from_size_align(len.max(1), align)
            .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        // SAFETY: layout has non-zero size.
        let p = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(p).ok_or_else(|| io::Error::from(io::ErrorKind::OutOfMemory))?;
        Ok(AlignedBuf { ptr, layout })
    }

    pub fn len(&self) -> usize {
        self.layout.size()
    }

    pub fn is_empty(&self) -> bool {
        false
    }

    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: we own len initialised (zeroed at allocation) bytes.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.layout.size()) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and &mut self gives exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.layout.size()) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in new() with this layout.
        unsafe { dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

/// Buffers up to this size go back to the pool; larger ones are freed after use.
pub const POOLED_MAX_BYTES: usize = 1 << 20;
/// Pooled buffers kept per queue: bounds the pool to 4 MiB per queue.
pub const POOL_DEPTH: usize = 4;

/// A small per-queue pool of aligned buffers.
pub struct BouncePool {
    align: usize,
    free: Vec<AlignedBuf>,
}

impl BouncePool {
    pub fn new(align: usize) -> Self {
        BouncePool {
            align,
            free: Vec::with_capacity(POOL_DEPTH),
        }
    }

    /// A buffer of at least `len` bytes (rounded up to the alignment).
    pub fn get(&mut self, len: usize) -> io::Result<AlignedBuf> {
        let want = len.div_ceil(self.align).max(1) * self.align;
        if let Some(i) = self.free.iter().position(|b| b.len() >= want) {
            return Ok(self.free.swap_remove(i));
        }
        let size = if want <= POOLED_MAX_BYTES {
            want.next_power_of_two().min(POOLED_MAX_BYTES).max(want)
        } else {
            want
        };
        AlignedBuf::new(size, self.align)
    }

    /// Return a buffer for reuse.
    pub fn put(&mut self, buf: AlignedBuf) {
        if buf.len() <= POOLED_MAX_BYTES && self.free.len() < POOL_DEPTH {
            self.free.push(buf);
        }
    }

    pub fn align(&self) -> usize {
        self.align
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_aligned_and_big_enough() {
        let mut p = BouncePool::new(4096);
        let mut b = p.get(1000).unwrap();
        assert_eq!(b.as_mut_ptr() as usize % 4096, 0);
        assert!(b.len() >= 1000 && b.len().is_multiple_of(4096));
    }

    #[test]
    fn pool_reuses_and_is_bounded() {
        let mut p = BouncePool::new(4096);
        let mut bufs: Vec<_> = (0..10).map(|_| p.get(8192).unwrap()).collect();
        let first = bufs[0].as_mut_ptr();
        for b in bufs.drain(..) {
            p.put(b);
        }
        assert_eq!(p.free.len(), POOL_DEPTH);
        assert!(p.free.iter().any(|b| b.ptr.as_ptr() == first));
        let big = p.get(POOLED_MAX_BYTES * 2).unwrap();
        p.put(big);
        assert_eq!(p.free.len(), POOL_DEPTH);
    }
}
