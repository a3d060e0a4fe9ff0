//! One in-flight request: its slot in the queue's table, everything the kernel may reference
//! until it completes, and how its engine operations are named in io_uring `user_data`.
//! The table ([`Slots`]) is the one place a [`SlotId`] becomes a slot.

use std::sync::Arc;

use crate::image::WriteTicket;
use crate::io::bounce::AlignedBuf;
use crate::virtio_blk::{status, Request, RequestType};

use super::Mem;

/// What an engine operation was, packed into io_uring user_data with the slot index.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[repr(u8)]
pub(super) enum OpKind {
    Read = 1,
    Write = 2,
    Flush = 3,
    Discard = 4,
    ZeroRange = 5,
    PunchZero = 6,
    /// One piece of a planned read, into the bounce buffer; `range` is its iovec index.
    ReadPart = 7,
    /// A write done on a pool thread (result 0 or a negative errno).
    Offload = 8,
    /// A backup's copy before the request's write, done on the backup pool: the request's
    /// own operations start now.
    Copied = 9,
    /// One part of an encrypted write, from the bounce buffer; `range` is its iovec index.
    WritePart = 10,
    /// Part `range` of an encrypted write, encrypted by a crypt helper (result 0) or not
    /// (negative): its write goes out now.
    Encrypted = 11,
}

impl OpKind {
    fn from_u8(v: u8) -> Option<Self> {
        Some(match v {
            1 => OpKind::Read,
            2 => OpKind::Write,
            3 => OpKind::Flush,
            4 => OpKind::Discard,
            5 => OpKind::ZeroRange,
            6 => OpKind::PunchZero,
            7 => OpKind::ReadPart,
            8 => OpKind::Offload,
            9 => OpKind::Copied,
            10 => OpKind::WritePart,
            11 => OpKind::Encrypted,
            _ => return None,
        })
    }
}

/// Names a slot of the queue's table where a name must outlive a borrow: in io_uring
/// `user_data`, the throttle queue, the watchdog's table. Only [`Slots`] hands them out (and
/// [`decode`] reads them back, unchecked: [`Slots::get_mut`] is the look-up for those).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) struct SlotId(u16);

impl SlotId {
    /// The slot's number (the watchdog's table and log lines use it).
    pub fn get(self) -> u16 {
        self.0
    }
}

impl std::fmt::Display for SlotId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

/// What the submission path needs of a parsed request, read from its slot once when it
/// starts and handed down from there: the slot is looked up again only for what it owns
/// (the guest's segments, the iovecs, the request's progress in [`InFlight`]).
#[derive(Clone, Copy, Debug)]
pub(super) struct Req {
    pub id: SlotId,
    /// The chain's head descriptor (what the used ring gets back).
    pub head: u16,
    pub kind: RequestType,
    /// Where on the device, in bytes.
    pub offset: u64,
    /// Bytes of data (reads, writes, GET_ID).
    pub len: u64,
}

impl Req {
    /// The summary of `req`, parsed from chain `head` into slot `id`.
    pub fn new(id: SlotId, head: u16, req: &Request) -> Self {
        Req {
            id,
            head,
            kind: req.kind,
            offset: req.offset_bytes(),
            len: req.data_len,
        }
    }
}

/// `user_data` of operation `kind` of slot `slot`; `range` is the operation's index within
/// the request (a discard range, a read piece).
pub(super) fn user_data(slot: SlotId, kind: OpKind, range: u32) -> u64 {
    u64::from(slot.0) | (u64::from(kind as u8) << 16) | (u64::from(range) << 32)
}

/// The slot, kind and index a completion's `user_data` names (kind None: not ours).
pub(super) fn decode(ud: u64) -> (SlotId, Option<OpKind>, u32) {
    (
        SlotId(ud as u16),
        OpKind::from_u8((ud >> 16) as u8),
        (ud >> 32) as u32,
    )
}

/// A slot of the queue's table. `req` and `iov` are buffers reused from request to request
/// (no allocation per request); `state` says whether a request owns the slot.
pub(super) struct Slot {
    pub req: Request,
    /// The iovecs handed to the kernel (guest memory or the bounce buffer).
    pub iov: Vec<libc::iovec>,
    pub state: SlotState,
}

// SAFETY: the raw pointers in `iov` point into guest memory kept mapped by the request's
// `mem`, or into its bounce buffer; a slot is only used by its queue's thread (the worker
// sits behind the backend's per-queue mutex).
unsafe impl Send for Slot {}

// Slots live in a table made once (`Slots`): a free one taking a busy one's room costs
// nothing, and boxing the busy one would cost an allocation per request.
#[allow(clippy::large_enum_variant)]
pub(super) enum SlotState {
    Free,
    Busy(InFlight),
}

/// Data bounced through an aligned buffer.
pub(super) struct Bounce {
    pub buf: AlignedBuf,
    /// Where the request's data starts inside `buf` (sub-block reads read whole blocks).
    pub skip: usize,
}

/// What happens when the request's last operation has completed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Then {
    Finish,
    /// Write-through: make the request's zeroing durable (fdatasync) first.
    SyncFirst,
}

/// A request in flight. Built afresh for each request, so nothing is reset by hand.
pub(super) struct InFlight {
    pub head: u16,
    /// Keeps guest memory mapped while the kernel uses it, even if the frontend removes the
    /// region meanwhile.
    pub mem: Arc<Mem>,
    /// Operations not completed yet.
    pub pending: u32,
    pub status: u8,
    /// Bytes written into device-writable buffers, status byte included.
    pub used_len: u32,
    /// Bytes the single read or write operation must transfer.
    pub expect_bytes: u64,
    pub bounce: Option<Bounce>,
    /// Key of the write range this request holds (see `io::ranges`).
    pub range_key: Option<u64>,
    /// What the image lent this write until it completes.
    pub ticket: Option<WriteTicket>,
    pub then: Then,
    /// When the request was taken from the ring (latency statistics).
    pub started: std::time::Instant,
    /// The active job's write-through this request registered with, its token and the
    /// start of the range it registered (`jobs::active`).
    pub through: Option<(std::sync::Arc<crate::jobs::active::WriteThrough>, u64, u64)>,
    /// An encrypted image's read: the file offset of the data, decrypted when it is in.
    pub decrypt_at: Option<u64>,
    /// An encrypted image's read in pieces: each piece's (iovec index) file offset in the
    /// image file, decrypted when they are in (`u64::MAX`: a backing file's, as it is).
    pub decrypt_pieces: Vec<u64>,
    /// An encrypted write: the file offset of its first part (`worker::crypt`).
    pub write_at: u64,
    /// The first host error (errno) of this attempt, which the error policy may hold it
    /// for (`hold`; 0: none).
    pub host_errno: i32,
    /// It also failed for a reason no retry fixes (the guest's fault, a corrupt image): it
    /// is never held.
    pub unholdable: bool,
    /// It has been held (counted in the device's holds until it completes).
    pub was_held: bool,
}

impl InFlight {
    /// A request taken at `started`.
    pub fn new(head: u16, mem: Arc<Mem>, started: std::time::Instant) -> Self {
        InFlight {
            head,
            mem,
            pending: 0,
            status: status::OK,
            used_len: 1,
            expect_bytes: 0,
            bounce: None,
            range_key: None,
            ticket: None,
            then: Then::Finish,
            started,
            through: None,
            decrypt_at: None,
            decrypt_pieces: Vec::new(),
            write_at: 0,
            host_errno: 0,
            unholdable: false,
            was_held: false,
        }
    }

    /// Note why an operation of this request failed: a host `errno`, or (None) a reason
    /// the error policy never holds.
    pub fn note_failure(&mut self, errno: Option<i32>) {
        match errno {
            Some(e) => {
                if self.host_errno == 0 {
                    self.host_errno = e;
                }
            }
            None => self.unholdable = true,
        }
    }
}

impl Slot {
    pub fn new() -> Self {
        Slot {
            req: Request::default(),
            iov: Vec::new(),
            state: SlotState::Free,
        }
    }

    /// The request in this slot (None: free).
    pub fn busy_ref(&self) -> Option<&InFlight> {
        match &self.state {
            SlotState::Busy(f) => Some(f),
            SlotState::Free => None,
        }
    }

    /// The request in this slot, to change (None: free).
    pub fn busy(&mut self) -> Option<&mut InFlight> {
        match &mut self.state {
            SlotState::Busy(f) => Some(f),
            SlotState::Free => None,
        }
    }
}

/// The queue's table of slots and which of them are free.
pub(super) struct Slots {
    table: Vec<Slot>,
    /// Taken from the end.
    free: Vec<SlotId>,
}

impl Slots {
    /// A table of `n` free slots (at most 65536: a queue's size).
    pub fn new(n: usize) -> Self {
        Slots {
            table: (0..n).map(|_| Slot::new()).collect(),
            free: (0..n as u16).rev().map(SlotId).collect(),
        }
    }

    /// A free slot, now taken (None: all are in use).
    pub fn take(&mut self) -> Option<SlotId> {
        self.free.pop()
    }

    /// Give slot `id` back (its request is finished, or never started).
    pub fn release(&mut self, id: SlotId) {
        self.free.push(id);
    }

    /// Free slot `id` without finishing its request (the error policy leaves a held one in
    /// the inflight region: `hold`).
    pub fn free(&mut self, id: SlotId) {
        if let Some(s) = self.table.get_mut(usize::from(id.0)) {
            if matches!(s.state, SlotState::Busy(_)) {
                s.state = SlotState::Free;
                self.free.push(id);
            }
        }
    }

    pub fn has_free(&self) -> bool {
        !self.free.is_empty()
    }

    /// Slots taken.
    pub fn in_use(&self) -> usize {
        self.table.len() - self.free.len()
    }

    /// Slot `id`, which this table handed out.
    pub fn get(&mut self, id: SlotId) -> &mut Slot {
        &mut self.table[usize::from(id.0)]
    }

    /// Slot `id`, if there is one (an id read back from a completion may be anything).
    pub fn get_mut(&mut self, id: SlotId) -> Option<&mut Slot> {
        self.table.get_mut(usize::from(id.0))
    }

    /// The request in slot `id`, to change (None: no such slot, or it is free).
    pub fn busy(&mut self, id: SlotId) -> Option<&mut InFlight> {
        self.get_mut(id).and_then(Slot::busy)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn user_data_round_trips() {
        let ud = user_data(SlotId(513), OpKind::ReadPart, 31);
        assert_eq!(decode(ud), (SlotId(513), Some(OpKind::ReadPart), 31));
        assert_eq!(decode(0).1, None, "kind 0 is nobody's");
    }
}
