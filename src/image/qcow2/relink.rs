//! Changing a qcow2 image's backing file in its header (a stream job's last step), with the
//! image closed, then synced.
//!
//! Dropping the link changes only the two fixed fields that point at the name (offset and
//! length, in the first 512-byte sector): one sector, so a power cut leaves the old header
//! or the new one, never a mix (the crash states of tests/crash_states.rs tear writes at
//! sectors; a rewrite of the whole header once left the old offset pointing at a zeroed
//! name). The stale name and backing format extension stay behind, unreferenced and
//! ignored without a backing file, until the header is next rebuilt. A new link rewrites
//! the header's first cluster in one write (the fixed fields, the backing format extension
//! and the name; every other extension kept), as QEMU does.

use std::fs::OpenOptions;
use std::os::unix::fs::FileExt;
use std::path::Path;

use super::header::{self, Header, EXT_BACKING_FORMAT};

/// Make `path`'s backing file `backing` (name as stored, relative to the image, and
/// format), or none.
pub fn set_backing(path: &Path, backing: Option<(&str, &str)>) -> Result<(), String> {
    let err = |e: std::io::Error| format!("{}: {e}", path.display());
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .map_err(err)?;
    let mut first = vec![0u8; 4096];
    f.read_exact_at(&mut first, 0).map_err(err)?;
    let h = Header::parse(&first).map_err(|e| format!("{}: {e}", path.display()))?;
    if backing.is_none() {
        let mut sector = first[..512].to_vec();
        // backing_file_offset (8 bytes at 8) and backing_file_size (4 bytes at 16).
        sector[8..20].fill(0);
        f.write_all_at(&sector, 0).map_err(err)?;
        return f.sync_all().map_err(err);
    }
    let mut old = vec![0u8; 1usize << h.cluster_bits];
    f.read_exact_at(&mut old, 0).map_err(err)?;
    if let Some((name, _)) = backing {
        if name.is_empty() || name.len() > header::MAX_BACKING_NAME {
            return Err(format!("backing file name {name:?}: 1 to 1023 bytes"));
        }
    }
    let ext = backing.map(|(_, fmt)| (EXT_BACKING_FORMAT, fmt.as_bytes()));
    let new = header::rebuild(
        &old,
        &h,
        EXT_BACKING_FORMAT,
        ext,
        Some(backing.map(|(n, _)| n.as_bytes())),
    )
    .map_err(|e| format!("{}: {e}", path.display()))?;
    f.write_all_at(&new, 0).map_err(err)?;
    f.sync_all().map_err(err)
}
