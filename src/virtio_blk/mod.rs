//! virtio-blk requests: parsing descriptor chains from guest memory into typed requests, and
//! the one mapping from errors to status bytes. Knows virtio, nothing of images or io_uring.
//!
//! References are to the VIRTIO 1.2 specification, section 5.2 (Block Device).

mod request;

pub use request::{
    parse_request, Desc, DeviceLimits, Range, Request, RequestError, RequestType, Segment,
};

/// Request types by name, in the order counters and the watchdog index them ([`op_index`]).
pub const OPS: [&str; 6] = [
    "read",
    "write",
    "flush",
    "discard",
    "write_zeroes",
    "get_id",
];

/// The index in [`OPS`] of a request type.
pub fn op_index(kind: RequestType) -> usize {
    match kind {
        RequestType::In => 0,
        RequestType::Out => 1,
        RequestType::Flush => 2,
        RequestType::Discard => 3,
        RequestType::WriteZeroes => 4,
        RequestType::GetId => 5,
    }
}

/// Sectors in virtio-blk are always 512 bytes, whatever the logical block size (5.2.6).
pub const SECTOR_SHIFT: u32 = 9;
/// Bytes per virtio sector.
pub const SECTOR_SIZE: u64 = 1 << SECTOR_SHIFT;

/// Request header size: type (le32), reserved (le32), sector (le64) (5.2.6).
pub const HEADER_LEN: usize = 16;
/// One discard / write-zeroes range: sector (le64), num_sectors (le32), flags (le32).
pub const RANGE_LEN: usize = 16;
/// GET_ID answers with at most this many bytes (VIRTIO_BLK_ID_BYTES).
pub const ID_BYTES: usize = 20;

/// Request types (5.2.6).
pub mod req_type {
    pub const IN: u32 = 0;
    pub const OUT: u32 = 1;
    pub const FLUSH: u32 = 4;
    pub const GET_ID: u32 = 8;
    pub const DISCARD: u32 = 11;
    pub const WRITE_ZEROES: u32 = 13;
}

/// Status byte values (5.2.6).
pub mod status {
    pub const OK: u8 = 0;
    pub const IOERR: u8 = 1;
    pub const UNSUPP: u8 = 2;
}

/// Flag in a discard / write-zeroes range: the device may deallocate (5.2.6).
pub const RANGE_FLAG_UNMAP: u32 = 1;
