//! What a read of the guest disk resolves to: pieces of the image, of its backing files,
//! zeroes, or compressed clusters (planned by the formats and the chain, read by the data
//! plane).

/// A resolved piece of a read: which file (0 = the image itself, i = backing layer i - 1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Piece {
    Data {
        layer: usize,
        host_offset: u64,
        len: u64,
    },
    Zero {
        len: u64,
    },
    Compressed {
        layer: usize,
        host_offset: u64,
        compressed_len: u64,
        skip: u64,
        len: u64,
    },
}

impl Piece {
    pub fn len(&self) -> u64 {
        match *self {
            Piece::Data { len, .. } | Piece::Zero { len } | Piece::Compressed { len, .. } => len,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
