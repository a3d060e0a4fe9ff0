//! The NBD protocol's numbers and its transmission-phase messages: the request header, and
//! the two reply headers (simple, and structured-reply chunks), decoded from bytes a server
//! sent (untrusted: every length is checked by the caller against what it asked for).

/// Handshake magics.
pub const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
pub const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
pub const OPTION_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;

/// Handshake flags (server) and client flags.
pub const FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
pub const FLAG_NO_ZEROES: u16 = 1 << 1;
pub const FLAG_C_FIXED_NEWSTYLE: u32 = 1 << 0;
pub const FLAG_C_NO_ZEROES: u32 = 1 << 1;

/// Options and option replies.
pub const OPT_EXPORT_NAME: u32 = 1;
pub const OPT_ABORT: u32 = 2;
pub const OPT_LIST: u32 = 3;
pub const OPT_INFO: u32 = 6;
pub const OPT_GO: u32 = 7;
pub const OPT_STRUCTURED_REPLY: u32 = 8;
pub const OPT_LIST_META_CONTEXT: u32 = 9;
pub const OPT_SET_META_CONTEXT: u32 = 10;
pub const REP_ACK: u32 = 1;
pub const REP_SERVER: u32 = 2;
pub const REP_INFO: u32 = 3;
pub const REP_META_CONTEXT: u32 = 4;
pub const REP_FLAG_ERROR: u32 = 1 << 31;
pub const REP_ERR_UNSUP: u32 = REP_FLAG_ERROR | 1;
pub const REP_ERR_POLICY: u32 = REP_FLAG_ERROR | 2;
pub const REP_ERR_INVALID: u32 = REP_FLAG_ERROR | 3;
pub const REP_ERR_PLATFORM: u32 = REP_FLAG_ERROR | 4;
pub const REP_ERR_TLS_REQD: u32 = REP_FLAG_ERROR | 5;
pub const REP_ERR_UNKNOWN: u32 = REP_FLAG_ERROR | 6;
pub const REP_ERR_SHUTDOWN: u32 = REP_FLAG_ERROR | 7;
pub const REP_ERR_BLOCK_SIZE_REQD: u32 = REP_FLAG_ERROR | 8;
pub const REP_ERR_TOO_BIG: u32 = REP_FLAG_ERROR | 9;
pub const INFO_EXPORT: u16 = 0;
pub const INFO_NAME: u16 = 1;
pub const INFO_BLOCK_SIZE: u16 = 3;

/// Transmission flags of an export.
pub const FLAG_HAS_FLAGS: u16 = 1 << 0;
pub const FLAG_READ_ONLY: u16 = 1 << 1;
pub const FLAG_SEND_FLUSH: u16 = 1 << 2;
pub const FLAG_SEND_FUA: u16 = 1 << 3;
pub const FLAG_SEND_TRIM: u16 = 1 << 5;
pub const FLAG_SEND_WRITE_ZEROES: u16 = 1 << 6;
pub const FLAG_CAN_MULTI_CONN: u16 = 1 << 8;

/// Commands and their flags.
pub const CMD_READ: u16 = 0;
pub const CMD_WRITE: u16 = 1;
pub const CMD_DISC: u16 = 2;
pub const CMD_FLUSH: u16 = 3;
pub const CMD_TRIM: u16 = 4;
pub const CMD_CACHE: u16 = 5;
pub const CMD_WRITE_ZEROES: u16 = 6;
pub const CMD_BLOCK_STATUS: u16 = 7;
pub const CMD_FLAG_FUA: u16 = 1 << 0;
pub const CMD_FLAG_NO_HOLE: u16 = 1 << 1;
/// BLOCK_STATUS: one descriptor per context is enough.
pub const CMD_FLAG_REQ_ONE: u16 = 1 << 3;

/// base:allocation's flags.
pub const STATE_HOLE: u32 = 1 << 0;
pub const STATE_ZERO: u32 = 1 << 1;
/// qemu:dirty-bitmap:NAME's flag.
pub const STATE_DIRTY: u32 = 1 << 0;

pub const REQUEST_MAGIC: u32 = 0x2560_9513;
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
pub const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;
pub const REQUEST_LEN: usize = 28;
pub const SIMPLE_REPLY_LEN: usize = 16;
pub const CHUNK_HEADER_LEN: usize = 20;

/// Structured reply chunk types and flags.
pub const REPLY_FLAG_DONE: u16 = 1 << 0;
pub const REPLY_TYPE_NONE: u16 = 0;
pub const REPLY_TYPE_OFFSET_DATA: u16 = 1;
pub const REPLY_TYPE_OFFSET_HOLE: u16 = 2;
pub const REPLY_TYPE_BLOCK_STATUS: u16 = 5;
pub const REPLY_TYPE_ERROR: u16 = (1 << 15) | 1;
pub const REPLY_TYPE_ERROR_OFFSET: u16 = (1 << 15) | 2;

/// One request header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Request {
    pub flags: u16,
    pub kind: u16,
    pub handle: u64,
    pub offset: u64,
    pub len: u32,
}

impl Request {
    /// NBD_CMD_DISC: the end of the session.
    pub fn disc() -> Request {
        Request {
            flags: 0,
            kind: CMD_DISC,
            handle: 0,
            offset: 0,
            len: 0,
        }
    }

    pub fn encode(&self) -> [u8; REQUEST_LEN] {
        let mut b = [0u8; REQUEST_LEN];
        b[0..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
        b[4..6].copy_from_slice(&self.flags.to_be_bytes());
        b[6..8].copy_from_slice(&self.kind.to_be_bytes());
        b[8..16].copy_from_slice(&self.handle.to_be_bytes());
        b[16..24].copy_from_slice(&self.offset.to_be_bytes());
        b[24..28].copy_from_slice(&self.len.to_be_bytes());
        b
    }
}

/// A reply header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReplyHeader {
    /// A simple reply; a successful read's data (the request's length) follows.
    Simple { handle: u64, error: u32 },
    /// A structured reply chunk; `len` payload bytes follow.
    Chunk {
        handle: u64,
        flags: u16,
        kind: u16,
        len: u32,
    },
}

/// Decode the reply header at the start of `b`: Ok(Some((header, its length))), Ok(None)
/// when more bytes are needed, Err on a bad magic (the connection is then unusable).
pub fn decode_reply(b: &[u8]) -> Result<Option<(ReplyHeader, usize)>, String> {
    if b.len() < 4 {
        return Ok(None);
    }
    let magic = u32::from_be_bytes([b[0], b[1], b[2], b[3]]);
    let be32 = |o: usize| u32::from_be_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
    let be64 = |o: usize| (u64::from(be32(o)) << 32) | u64::from(be32(o + 4));
    match magic {
        SIMPLE_REPLY_MAGIC if b.len() >= SIMPLE_REPLY_LEN => Ok(Some((
            ReplyHeader::Simple {
                error: be32(4),
                handle: be64(8),
            },
            SIMPLE_REPLY_LEN,
        ))),
        STRUCTURED_REPLY_MAGIC if b.len() >= CHUNK_HEADER_LEN => Ok(Some((
            ReplyHeader::Chunk {
                flags: u16::from_be_bytes([b[4], b[5]]),
                kind: u16::from_be_bytes([b[6], b[7]]),
                handle: be64(8),
                len: be32(16),
            },
            CHUNK_HEADER_LEN,
        ))),
        SIMPLE_REPLY_MAGIC | STRUCTURED_REPLY_MAGIC => Ok(None),
        m => Err(format!("bad reply magic {m:#010x}")),
    }
}

/// NBD error codes (a server's replies).
pub const EPERM: u32 = 1;
pub const EIO: u32 = 5;
pub const EINVAL: u32 = 22;
pub const EOVERFLOW: u32 = 75;
pub const ESHUTDOWN: u32 = 108;

/// The errno an NBD error code stands for (the protocol's values are Linux's; anything
/// else is EIO).
pub fn errno_of(nbd_error: u32) -> i32 {
    match nbd_error {
        1 => libc::EPERM,
        5 => libc::EIO,
        12 => libc::ENOMEM,
        22 => libc::EINVAL,
        28 => libc::ENOSPC,
        75 => libc::EOVERFLOW,
        95 => libc::EOPNOTSUPP,
        108 => libc::ESHUTDOWN,
        _ => libc::EIO,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_encode_and_replies_decode_big_endian() {
        let r = Request {
            flags: CMD_FLAG_FUA,
            kind: CMD_WRITE,
            handle: 0x0102_0304_0506_0708,
            offset: 1 << 40,
            len: 4096,
        };
        let b = r.encode();
        assert_eq!(&b[..4], &[0x25, 0x60, 0x95, 0x13]);
        assert_eq!(&b[4..8], &[0, 1, 0, 1]);
        assert_eq!(&b[8..16], &[1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(&b[16..24], &[0, 0, 1, 0, 0, 0, 0, 0]);
        assert_eq!(&b[24..28], &[0, 0, 0x10, 0]);

        let mut simple = Vec::new();
        simple.extend_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
        simple.extend_from_slice(&5u32.to_be_bytes());
        simple.extend_from_slice(&7u64.to_be_bytes());
        assert_eq!(decode_reply(&simple[..10]), Ok(None));
        assert_eq!(
            decode_reply(&simple),
            Ok(Some((
                ReplyHeader::Simple {
                    handle: 7,
                    error: 5
                },
                16
            )))
        );
        let mut chunk = Vec::new();
        chunk.extend_from_slice(&STRUCTURED_REPLY_MAGIC.to_be_bytes());
        chunk.extend_from_slice(&REPLY_FLAG_DONE.to_be_bytes());
        chunk.extend_from_slice(&REPLY_TYPE_OFFSET_DATA.to_be_bytes());
        chunk.extend_from_slice(&9u64.to_be_bytes());
        chunk.extend_from_slice(&4104u32.to_be_bytes());
        assert_eq!(
            decode_reply(&chunk),
            Ok(Some((
                ReplyHeader::Chunk {
                    handle: 9,
                    flags: REPLY_FLAG_DONE,
                    kind: REPLY_TYPE_OFFSET_DATA,
                    len: 4104
                },
                20
            )))
        );
        assert!(decode_reply(&[0xde, 0xad, 0xbe, 0xef, 0, 0, 0, 0]).is_err());
        assert_eq!(errno_of(28), libc::ENOSPC);
        assert_eq!(errno_of(4242), libc::EIO);
    }
}
