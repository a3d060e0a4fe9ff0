//! One in-flight request: its slot in the queue's table, everything the kernel may reference
//! until it completes, and how its engine operations are named in io_uring `user_data`.

use std::sync::Arc;

use crate::image::WriteTicket;
use crate::io::bounce::AlignedBuf;
use crate::virtio_blk::{status, Request};

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
            _ => return None,
        })
    }
}

/// `user_data` of operation `kind` of slot `slot`; `range` is the operation's index within
/// the request (a discard range, a read piece).
pub(super) fn user_data(slot: u16, kind: OpKind, range: u32) -> u64 {
    u64::from(slot) | (u64::from(kind as u8) << 16) | (u64::from(range) << 32)
}

/// The slot, kind and index a completion's `user_data` names (kind None: not ours).
pub(super) fn decode(ud: u64) -> (u16, Option<OpKind>, u32) {
    (
        ud as u16,
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
}

impl InFlight {
    pub fn new(head: u16, mem: Arc<Mem>) -> Self {
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
            started: std::time::Instant::now(),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn user_data_round_trips() {
        let ud = user_data(513, OpKind::ReadPart, 31);
        assert_eq!(decode(ud), (513, Some(OpKind::ReadPart), 31));
        assert_eq!(decode(0).1, None, "kind 0 is nobody's");
    }
}
