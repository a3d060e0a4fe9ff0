//! Persistent dirty bitmaps in a qcow2 file (the qcow2 specification's "Bitmaps extension"),
//! read: the extension in the header, the bitmap directory, each bitmap's table and data
//! clusters. Everything in them is untrusted: counts, sizes and offsets are bounded and
//! checked against the file and the disk before anything is read or allocated.
//!
//! Layout (big-endian): the extension (type 0x23852875) holds the number of bitmaps, the
//! directory's size and offset. A directory entry: the table's offset (8) and size in
//! entries (4), flags (4: bit 0 in use, bit 1 auto, bit 2 extra data compatible), type (1:
//! 1 = dirty tracking), granularity bits (1), name size (2), extra data size (4), the extra
//! data, the name, padding to 8 bytes. A table entry: the host offset of a data cluster in
//! bits 9-55 (0: all zeroes, or all ones if bit 0 is set). In a data cluster, bit k of byte
//! i is granule i * 8 + k of its part of the disk.

use std::sync::Arc;

use crate::bitmaps::DirtyBitmap;
use crate::io::Storage;

/// Most bitmaps in one image (the specification's limit).
pub const MAX_BITMAPS: u32 = 65535;
/// Largest directory read (QEMU writes at most 64 KiB per 1023-byte-named entry... bounded
/// by the count anyway; this keeps a hostile size from allocating).
pub const MAX_DIRECTORY_BYTES: u64 = 64 << 20;
/// Granularity bits the specification allows (512 bytes to 2 GiB).
const MIN_GRANULARITY_BITS: u8 = 9;
const MAX_GRANULARITY_BITS: u8 = 31;
pub(super) const FLAG_IN_USE: u32 = 1;
pub(super) const FLAG_AUTO: u32 = 2;
const FLAG_EXTRA_DATA_COMPATIBLE: u32 = 4;
pub(super) const TYPE_DIRTY_TRACKING: u8 = 1;
pub(super) const ENTRY_OFFSET_MASK: u64 = 0x00ff_ffff_ffff_fe00;
const ENTRY_ALL_ONES: u64 = 1;

/// The bitmaps extension: where the directory is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extension {
    pub count: u32,
    pub directory_size: u64,
    pub directory_offset: u64,
}

/// One bitmap of the directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub name: String,
    pub granularity_bits: u8,
    pub table_offset: u64,
    pub table_size: u32,
    /// A writer had it open and did not write it back: not a valid record.
    pub in_use: bool,
    /// Enabled (recording) when the image is opened.
    pub auto: bool,
    /// Unknown extra data that forbids using the bitmap.
    pub unusable: bool,
    /// The entry as the directory holds it (header, extra data, name; no padding).
    pub raw: Vec<u8>,
}

fn be16(b: &[u8], o: usize) -> u16 {
    u16::from_be_bytes([b[o], b[o + 1]])
}
fn be32(b: &[u8], o: usize) -> u32 {
    u32::from_be_bytes(b[o..o + 4].try_into().unwrap_or([0; 4]))
}
fn be64(b: &[u8], o: usize) -> u64 {
    u64::from_be_bytes(b[o..o + 8].try_into().unwrap_or([0; 8]))
}

/// The extension's data (as [`super::header::Header::extension_data`] finds it).
pub fn parse_extension(data: &[u8]) -> Result<Extension, String> {
    if data.len() < 24 {
        return Err("bitmaps extension: shorter than 24 bytes".into());
    }
    let e = Extension {
        count: be32(data, 0),
        directory_size: be64(data, 8),
        directory_offset: be64(data, 16),
    };
    if be32(data, 4) != 0 {
        return Err("bitmaps extension: reserved field not zero".into());
    }
    if e.count == 0 || e.count > MAX_BITMAPS {
        return Err(format!("bitmaps extension: {} bitmaps", e.count));
    }
    if e.directory_size == 0 || e.directory_size > MAX_DIRECTORY_BYTES {
        return Err(format!(
            "bitmaps extension: a {}-byte directory",
            e.directory_size
        ));
    }
    Ok(e)
}

/// Table entries a bitmap of `granularity_bits` needs for a disk of `disk_size` bytes.
pub fn table_entries(disk_size: u64, granularity_bits: u8, cluster_size: u64) -> u64 {
    let granules = disk_size.div_ceil(1 << granularity_bits);
    granules.div_ceil(cluster_size * 8)
}

/// The directory `dir` (the extension's count of entries), checked against the disk and the
/// file.
pub fn parse_directory(
    dir: &[u8],
    count: u32,
    disk_size: u64,
    cluster_size: u64,
    file_size: u64,
) -> Result<Vec<Entry>, String> {
    let mut out: Vec<Entry> = Vec::new();
    let mut pos = 0usize;
    for i in 0..count {
        let bad = |what: &str| format!("bitmap directory entry {i}: {what}");
        let h = dir
            .get(pos..pos + 24)
            .ok_or_else(|| bad("past the directory's end"))?;
        let table_offset = be64(h, 0);
        let table_size = be32(h, 8);
        let flags = be32(h, 12);
        let ty = h[16];
        let granularity_bits = h[17];
        let name_size = usize::from(be16(h, 18));
        let extra = be32(h, 20) as usize;
        let name_at = pos + 24 + extra;
        let name = dir
            .get(name_at..name_at + name_size)
            .ok_or_else(|| bad("name past the directory's end"))?;
        let name = String::from_utf8(name.to_vec()).map_err(|_| bad("name not UTF-8"))?;
        if name.is_empty() || name.len() > crate::bitmaps::MAX_NAME_BYTES {
            return Err(bad("name of 0 or over 1023 bytes"));
        }
        if out.iter().any(|e| e.name == name) {
            return Err(bad("a second bitmap of the same name"));
        }
        if ty != TYPE_DIRTY_TRACKING {
            return Err(bad("not a dirty tracking bitmap"));
        }
        if !(MIN_GRANULARITY_BITS..=MAX_GRANULARITY_BITS).contains(&granularity_bits) {
            return Err(bad("granularity out of range"));
        }
        if flags & !(FLAG_IN_USE | FLAG_AUTO | FLAG_EXTRA_DATA_COMPATIBLE) != 0 {
            return Err(bad("unknown flags"));
        }
        let want = table_entries(disk_size, granularity_bits, cluster_size);
        if u64::from(table_size) != want {
            return Err(bad(&format!(
                "a table of {table_size} entries where the disk needs {want}"
            )));
        }
        let table_bytes = u64::from(table_size) * 8;
        if !table_offset.is_multiple_of(cluster_size)
            || table_offset
                .checked_add(table_bytes)
                .is_none_or(|end| end > file_size)
        {
            return Err(bad("table outside the file or not cluster-aligned"));
        }
        out.push(Entry {
            name,
            granularity_bits,
            table_offset,
            table_size,
            in_use: flags & FLAG_IN_USE != 0,
            auto: flags & FLAG_AUTO != 0,
            unusable: extra != 0 && flags & FLAG_EXTRA_DATA_COMPATIBLE == 0,
            raw: dir[pos..name_at + name_size].to_vec(),
        });
        pos = (name_at + name_size).next_multiple_of(8);
    }
    Ok(out)
}

/// The directory of the image in `file`, if it has bitmaps: read through `extension` (from
/// the header), checked.
pub fn read_directory(
    file: &dyn Storage,
    ext: &Extension,
    disk_size: u64,
    cluster_size: u64,
    file_size: u64,
) -> Result<Vec<Entry>, String> {
    if !ext.directory_offset.is_multiple_of(cluster_size)
        || ext
            .directory_offset
            .checked_add(ext.directory_size)
            .is_none_or(|end| end > file_size)
    {
        return Err("bitmap directory outside the file or not cluster-aligned".into());
    }
    let dir =
        crate::io::aligned::read_aligned(file, ext.directory_offset, ext.directory_size as usize)
            .map_err(|e| format!("reading the bitmap directory: {e}"))?;
    parse_directory(&dir, ext.count, disk_size, cluster_size, file_size)
}

/// The bitmap `entry` with its bits, read from its table and data clusters.
pub fn load(
    file: &dyn Storage,
    entry: &Entry,
    disk_size: u64,
    cluster_size: u64,
    file_size: u64,
) -> Result<Arc<DirtyBitmap>, String> {
    let bad = |what: &str| format!("bitmap {:?}: {what}", entry.name);
    let g = 1u64 << entry.granularity_bits;
    let b = Arc::new(DirtyBitmap::new(&entry.name, g, disk_size, true));
    let table =
        crate::io::aligned::read_aligned(file, entry.table_offset, entry.table_size as usize * 8)
            .map_err(|e| bad(&format!("reading its table: {e}")))?;
    let bits_per_cluster = cluster_size * 8;
    let mut view = b.view();
    for (i, raw) in table.chunks_exact(8).enumerate() {
        let e = u64::from_be_bytes(raw.try_into().unwrap_or([0; 8]));
        let first_granule = i as u64 * bits_per_cluster;
        let host = e & ENTRY_OFFSET_MASK;
        if e & !(ENTRY_OFFSET_MASK | ENTRY_ALL_ONES) != 0 {
            return Err(bad("a table entry with reserved bits set"));
        }
        if host == 0 {
            if e & ENTRY_ALL_ONES != 0 {
                view.mark(first_granule * g, bits_per_cluster * g);
            }
            continue;
        }
        if e & ENTRY_ALL_ONES != 0
            || !host.is_multiple_of(cluster_size)
            || host + cluster_size > file_size
        {
            return Err(bad("a data cluster outside the file or misplaced"));
        }
        let data = crate::io::aligned::read_aligned(file, host, cluster_size as usize)
            .map_err(|e| bad(&format!("reading its data: {e}")))?;
        for (byte_i, &byte) in data.iter().enumerate() {
            if byte == 0 {
                continue;
            }
            for k in 0..8 {
                if byte & (1 << k) != 0 {
                    let granule = first_granule + byte_i as u64 * 8 + k;
                    view.mark(granule * g, g);
                }
            }
        }
    }
    Ok(b)
}
