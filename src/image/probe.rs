//! Image formats recognised by their magic.

use super::{parallels, qcow2, Format};
use crate::io::Storage;

/// The format whose magic `first_bytes` (the start of an image) carry, if any.
pub fn probe_bytes(first_bytes: &[u8]) -> Option<Format> {
    if first_bytes.starts_with(&qcow2::MAGIC) {
        Some(Format::Qcow2)
    } else if first_bytes.starts_with(crate::crypt::header::MAGIC) {
        Some(Format::Luks)
    } else if first_bytes.starts_with(parallels::MAGIC_OLD)
        || first_bytes.starts_with(parallels::MAGIC_EXT)
    {
        Some(Format::Parallels)
    } else {
        None
    }
}

/// The format of the image in `file`, by its magic (None: no known magic, i.e. raw).
/// Reads with an aligned buffer: the file may be O_DIRECT.
pub fn probe(file: &dyn Storage) -> Option<Format> {
    let first = crate::io::aligned::read_aligned(file, 0, PROBE_BYTES).ok()?;
    probe_bytes(&first)
}

/// Bytes of an image's start that hold every format's magic.
const PROBE_BYTES: usize = 16;
