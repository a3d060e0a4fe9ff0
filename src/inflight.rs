//! Inflight I/O tracking (vhost-user `INFLIGHT_SHMFD`, split rings): a region of shared
//! memory the frontend keeps across back-end restarts, in which each queue records which
//! requests it has taken from the available ring and not yet put on the used ring. A new
//! vublk process that gets the region back (`SET_INFLIGHT_FD`) resubmits those requests, in
//! the order they were taken, before any new one: a crash or `kill -9` loses no request.
//!
//! The layout is the vhost-user specification's ("Inflight I/O tracking", split
//! virtqueues). Per queue, 64-byte aligned, one after the other:
//!
//! ```text
//! offset  size  field
//!      0     8  features         (0: none defined)
//!      8     2  version          (1)
//!     10     2  desc_num         (entries below: the queue size)
//!     12     2  last_batch_head  (head of the last batch put on the used ring)
//!     14     2  used_idx         (the used ring's idx once that batch was accounted)
//!     16  16*n  desc[n]: inflight u8, padding [u8; 5], next u16, counter u64
//! ```
//!
//! The protocol, for a crash at any instruction (batches of one: virtio-queue publishes
//! each used entry with its own idx update, so a batch could be published in part):
//! - taking head `i`: `desc[i].counter = counter++`, then `desc[i].inflight = 1`, before
//!   the request is started. A crash before the flag leaves the request on the available
//!   ring beyond where recovery restarts, so it is taken again.
//! - completing head `i`: `last_batch_head = i`; put it on the used ring (entry, then idx);
//!   `desc[i].inflight = 0`; `used_idx = ` the ring's idx. A crash after the ring's idx
//!   moved but before `used_idx` did is seen at recovery as `used_idx != used->idx`: the
//!   last batch is then cleared, because the guest has it.
//! - recovery (the queue's first start in a process): repair the last batch as above, then
//!   every entry still marked is in flight; the available ring position is the used ring's
//!   idx plus their number, and they are resubmitted in counter order.
//!
//! The region is the frontend's, and untrusted like guest memory: every index read from it
//! is bounds-checked, walks are bounded by the queue size, and a region too small for what
//! it claims is refused when it is handed over.

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd};
use std::sync::atomic::{AtomicU16, AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;

/// Bytes of a queue's header (features, version, desc_num, last_batch_head, used_idx).
const HEADER_BYTES: usize = 16;
/// Bytes of one descriptor's state.
const DESC_BYTES: usize = 16;
/// Queue regions start 64-byte aligned (a cache line: queues on different threads do not
/// share one).
const QUEUE_ALIGN: usize = 64;
/// The region layout version this module writes and reads.
const VERSION: u16 = 1;

const OFF_VERSION: usize = 8;
const OFF_DESC_NUM: usize = 10;
const OFF_LAST_BATCH_HEAD: usize = 12;
const OFF_USED_IDX: usize = 14;
const DESC_OFF_INFLIGHT: usize = 0;
const DESC_OFF_NEXT: usize = 6;
const DESC_OFF_COUNTER: usize = 8;

/// Bytes of one queue's region for queues of `queue_size` entries.
pub fn queue_region_bytes(queue_size: u16) -> usize {
    (HEADER_BYTES + DESC_BYTES * usize::from(queue_size)).next_multiple_of(QUEUE_ALIGN)
}

/// Bytes of the whole region.
pub fn region_bytes(num_queues: u16, queue_size: u16) -> usize {
    usize::from(num_queues) * queue_region_bytes(queue_size)
}

/// Why a region is refused.
#[derive(Debug, thiserror::Error)]
pub enum InflightError {
    #[error("inflight region for {num_queues} queues of {queue_size} entries is not supported")]
    Shape { num_queues: u16, queue_size: u16 },
    #[error("inflight region of {size} bytes is too small: {num_queues} queues of {queue_size} entries need {need}")]
    TooSmall {
        size: u64,
        num_queues: u16,
        queue_size: u16,
        need: usize,
    },
    #[error("inflight region offset {0} is not page-aligned")]
    Offset(u64),
    #[error("the inflight region's file has {file_len} bytes, fewer than its offset {offset} plus size {size}")]
    BeyondFile {
        file_len: u64,
        offset: u64,
        size: u64,
    },
    #[error("cannot create the inflight region")]
    Create(#[source] io::Error),
    #[error("cannot map the inflight region")]
    Map(#[source] io::Error),
}

/// The largest split ring (virtio 1.2, 2.7: Queue Size at most 32768).
const MAX_QUEUE_SIZE: u16 = 32768;

fn check_shape(num_queues: u16, queue_size: u16) -> Result<(), InflightError> {
    if num_queues == 0
        || queue_size == 0
        || !queue_size.is_power_of_two()
        || queue_size > MAX_QUEUE_SIZE
    {
        return Err(InflightError::Shape {
            num_queues,
            queue_size,
        });
    }
    Ok(())
}

/// Memory a queue's tracker reads and writes: the shared mapping in production, a simulated
/// one (that can "crash" after any store) in tests.
pub trait Cells: Send + Sync {
    fn load_u8(&self, off: usize) -> u8;
    fn load_u16(&self, off: usize) -> u16;
    fn load_u64(&self, off: usize) -> u64;
    fn store_u8(&self, off: usize, v: u8);
    fn store_u16(&self, off: usize, v: u16);
    fn store_u64(&self, off: usize, v: u64);
}

/// The region, mapped shared. Every access is an atomic operation at a naturally aligned
/// offset (checked by [`QueueInflight::new`]); the frontend and a later process see every
/// store made before a crash, in program order.
pub struct InflightRegion {
    ptr: *mut u8,
    len: usize,
    num_queues: u16,
    queue_size: u16,
}

// SAFETY: the mapping is shared memory accessed only through atomics; it lives until Drop.
unsafe impl Send for InflightRegion {}
// SAFETY: as above: concurrent access is through atomics only.
unsafe impl Sync for InflightRegion {}

impl InflightRegion {
    /// A new, zeroed region for `num_queues` queues of `queue_size` entries (GET_INFLIGHT_FD):
    /// a memfd sealed against shrinking (a frontend cannot take the memory away under this
    /// process's mapping) with each queue's header written. Returns the file for the
    /// frontend and the region's size.
    pub fn create(num_queues: u16, queue_size: u16) -> Result<(File, u64), InflightError> {
        check_shape(num_queues, queue_size)?;
        let len = region_bytes(num_queues, queue_size);
        // SAFETY: a NUL-terminated name and flags; the result is checked.
        let fd = unsafe {
            libc::memfd_create(
                c"vublk-inflight".as_ptr(),
                libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
            )
        };
        if fd < 0 {
            return Err(InflightError::Create(io::Error::last_os_error()));
        }
        // SAFETY: a fresh descriptor we own.
        let file = unsafe { File::from_raw_fd(fd) };
        file.set_len(len as u64).map_err(InflightError::Create)?;
        // SAFETY: fcntl on our own memfd; the result is checked.
        let r = unsafe {
            libc::fcntl(
                file.as_raw_fd(),
                libc::F_ADD_SEALS,
                libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL,
            )
        };
        if r < 0 {
            return Err(InflightError::Create(io::Error::last_os_error()));
        }
        let region = Self::map(&file, len as u64, 0, num_queues, queue_size)?;
        for q in 0..num_queues {
            let base = usize::from(q) * queue_region_bytes(queue_size);
            region.store_u16(base + OFF_VERSION, VERSION);
            region.store_u16(base + OFF_DESC_NUM, queue_size);
        }
        Ok((file, len as u64))
    }

    /// Map the region the frontend handed over (SET_INFLIGHT_FD), after checking that the
    /// file holds it.
    pub fn map(
        file: &File,
        size: u64,
        offset: u64,
        num_queues: u16,
        queue_size: u16,
    ) -> Result<InflightRegion, InflightError> {
        check_shape(num_queues, queue_size)?;
        let need = region_bytes(num_queues, queue_size);
        if size < need as u64 {
            return Err(InflightError::TooSmall {
                size,
                num_queues,
                queue_size,
                need,
            });
        }
        // SAFETY: sysconf has no preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(4096) as u64;
        if !offset.is_multiple_of(page) {
            return Err(InflightError::Offset(offset));
        }
        let file_len = file.metadata().map_err(InflightError::Map)?.len();
        if offset.checked_add(size).is_none_or(|end| end > file_len) {
            return Err(InflightError::BeyondFile {
                file_len,
                offset,
                size,
            });
        }
        // Map only what the queues use: a frontend's oversized claim costs nothing.
        let len = need;
        // SAFETY: a new shared mapping of a file checked to hold [offset, offset + len);
        // the result is checked. (If the frontend shrinks the file later, the SIGBUS guard
        // in `guest_memory` replaces the lost pages, as for guest memory.)
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                offset as libc::off_t,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(InflightError::Map(io::Error::last_os_error()));
        }
        Ok(InflightRegion {
            ptr: ptr.cast(),
            len,
            num_queues,
            queue_size,
        })
    }

    pub fn num_queues(&self) -> u16 {
        self.num_queues
    }

    pub fn queue_size(&self) -> u16 {
        self.queue_size
    }

    fn at<T>(&self, off: usize) -> *const T {
        assert!(
            off.is_multiple_of(std::mem::align_of::<T>())
                && off + std::mem::size_of::<T>() <= self.len,
            "inflight region access out of bounds"
        );
        // SAFETY: `off` is inside the mapping (checked above).
        unsafe { self.ptr.add(off).cast() }
    }
}

impl Cells for InflightRegion {
    // SAFETY (all six): `at` checks bounds and alignment; the mapping is live and shared,
    // and every access to it is atomic.
    fn load_u8(&self, off: usize) -> u8 {
        // SAFETY: see above.
        unsafe { &*self.at::<AtomicU8>(off) }.load(Ordering::Acquire)
    }
    fn load_u16(&self, off: usize) -> u16 {
        // SAFETY: see above.
        unsafe { &*self.at::<AtomicU16>(off) }.load(Ordering::Acquire)
    }
    fn load_u64(&self, off: usize) -> u64 {
        // SAFETY: see above.
        unsafe { &*self.at::<AtomicU64>(off) }.load(Ordering::Acquire)
    }
    fn store_u8(&self, off: usize, v: u8) {
        // SAFETY: see above.
        unsafe { &*self.at::<AtomicU8>(off) }.store(v, Ordering::Release)
    }
    fn store_u16(&self, off: usize, v: u16) {
        // SAFETY: see above.
        unsafe { &*self.at::<AtomicU16>(off) }.store(v, Ordering::Release)
    }
    fn store_u64(&self, off: usize, v: u64) {
        // SAFETY: see above.
        unsafe { &*self.at::<AtomicU64>(off) }.store(v, Ordering::Release)
    }
}

impl Drop for InflightRegion {
    fn drop(&mut self) {
        // SAFETY: our own mapping, unmapped once; no tracker outlives the region (each
        // holds an Arc).
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// What recovery found on a queue.
#[derive(Debug, PartialEq, Eq)]
pub struct Recovered {
    /// Heads still in flight, in the order they were taken: resubmit them first.
    pub resubmit: Vec<u16>,
    /// Entries of the last batch cleared because the used ring already had them.
    pub repaired: u16,
}

/// One queue's part of the region, and the counter that orders its requests.
pub struct QueueInflight {
    cells: Arc<dyn Cells>,
    base: usize,
    desc_num: u16,
    counter: u64,
}

impl QueueInflight {
    /// Queue `index` of a region of `queue_size`-entry queues, or None beyond its queues.
    pub fn new(region: &Arc<InflightRegion>, index: u16) -> Option<QueueInflight> {
        if index >= region.num_queues {
            return None;
        }
        let cells: Arc<dyn Cells> = region.clone();
        Some(Self::over(
            cells,
            usize::from(index) * queue_region_bytes(region.queue_size),
            region.queue_size,
        ))
    }

    /// A tracker over any `Cells` (tests model the region with one).
    pub fn over(cells: Arc<dyn Cells>, base: usize, desc_num: u16) -> QueueInflight {
        debug_assert!(base.is_multiple_of(QUEUE_ALIGN));
        QueueInflight {
            cells,
            base,
            desc_num,
            counter: 0,
        }
    }

    /// Entries this queue's region tracks: heads at or above it cannot be tracked.
    pub fn desc_num(&self) -> u16 {
        self.desc_num
    }

    fn desc(&self, head: u16) -> usize {
        self.base + HEADER_BYTES + usize::from(head) * DESC_BYTES
    }

    /// Head `head` was taken from the available ring; call before the request starts.
    pub fn taken(&mut self, head: u16) {
        if head >= self.desc_num {
            return;
        }
        let d = self.desc(head);
        self.cells.store_u64(d + DESC_OFF_COUNTER, self.counter);
        self.counter += 1;
        self.cells.store_u8(d + DESC_OFF_INFLIGHT, 1);
    }

    /// Put `head` on the used ring through `publish`, which returns the used ring's idx
    /// after it (None: nothing was published, the head stays in flight).
    pub fn complete(&mut self, head: u16, publish: impl FnOnce() -> Option<u16>) {
        if head >= self.desc_num {
            publish();
            return;
        }
        let d = self.desc(head);
        self.cells.store_u16(d + DESC_OFF_NEXT, head);
        self.cells.store_u16(self.base + OFF_LAST_BATCH_HEAD, head);
        let Some(used_idx) = publish() else {
            return;
        };
        self.cells.store_u8(d + DESC_OFF_INFLIGHT, 0);
        self.cells.store_u16(self.base + OFF_USED_IDX, used_idx);
    }

    /// The queue starts in this process and the used ring's idx is `ring_used_idx`: repair
    /// the last batch, and return the heads still in flight (only those below `queue_size`,
    /// the ring's size now; others are cleared) in the order they were taken. The counter
    /// continues after the highest one found.
    pub fn recover(&mut self, ring_used_idx: u16, queue_size: u16) -> Recovered {
        let mut repaired = 0;
        let used_idx = self.cells.load_u16(self.base + OFF_USED_IDX);
        if used_idx != ring_used_idx {
            // The used ring has entries the region did not account: the last batch, which
            // starts at last_batch_head and is chained by `next`.
            let batch = ring_used_idx.wrapping_sub(used_idx).min(self.desc_num);
            let mut head = self.cells.load_u16(self.base + OFF_LAST_BATCH_HEAD);
            for _ in 0..batch {
                if head >= self.desc_num {
                    break;
                }
                let d = self.desc(head);
                self.cells.store_u8(d + DESC_OFF_INFLIGHT, 0);
                repaired += 1;
                let next = self.cells.load_u16(d + DESC_OFF_NEXT);
                if next == head {
                    break;
                }
                head = next;
            }
            self.cells
                .store_u16(self.base + OFF_USED_IDX, ring_used_idx);
        }
        let mut marked = Vec::new();
        let mut max_counter = None::<u64>;
        for head in 0..self.desc_num {
            let d = self.desc(head);
            if self.cells.load_u8(d + DESC_OFF_INFLIGHT) == 0 {
                continue;
            }
            if head >= queue_size {
                self.cells.store_u8(d + DESC_OFF_INFLIGHT, 0);
                continue;
            }
            let c = self.cells.load_u64(d + DESC_OFF_COUNTER);
            max_counter = Some(max_counter.map_or(c, |m| m.max(c)));
            marked.push((c, head));
        }
        marked.sort_unstable();
        self.counter = max_counter.map_or(0, |m| m.wrapping_add(1));
        Recovered {
            resubmit: marked.into_iter().map(|(_, h)| h).collect(),
            repaired,
        }
    }
}

#[cfg(test)]
mod tests;
