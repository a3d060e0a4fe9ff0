//! Persistent dirty bitmaps kept in the qcow2 file (the specification's bitmaps extension;
//! `bitmaps` reads its parts): loaded at open, written back whole after every change of the
//! set (`save`), and kept current on the data path (`persist_marks`).
//!
//! The rule that keeps a bitmap in the file valid at every moment, so that a SIGKILL or a
//! crash never leaves it in use (QEMU marks its bitmaps in use while it runs, and a crash
//! leaves them inconsistent): every bitmap this process keeps has all its data clusters
//! allocated, and a bit newly set in memory is written into its data cluster before the
//! request that set it completes (as a qcow2 allocation is published before completion). The
//! file's copy is then always a superset of what the guest saw complete; FLUSH makes it
//! durable with the data. The "in use" flag is never needed, so it is never set: a clean
//! exit, a handover and a FLUSH find nothing to write back.
//!
//! A save writes new clusters (tables, data, directory), makes them durable, then switches
//! the header's extension to them in one write, then frees the old ones: a crash at any
//! point leaves the old set or the new one (and leaked clusters at most).

use std::sync::Arc;

use super::bitmaps::{self as reader, Entry, FLAG_AUTO, FLAG_IN_USE, TYPE_DIRTY_TRACKING};
use super::header::{self, be32, be64, put32, put64, Header, AUTOCLEAR_BITMAPS, EXT_BITMAPS};
use super::{ImageError, Qcow2Image, WriteState};
use crate::bitmaps::{DirtyBitmap, Mark, Persistent};
use crate::io::aligned::{read_aligned, write_all_aligned, write_unaligned};
use crate::io::Storage;
use crate::locks::Locked;

/// The persistent bitmaps as the file holds them now.
#[derive(Debug, Default)]
pub(super) struct Stored {
    entries: Vec<StoredEntry>,
    /// The directory's clusters (offset, bytes); None: the file has no bitmaps extension.
    dir: Option<(u64, u64)>,
}

#[derive(Debug, Clone)]
struct StoredEntry {
    bitmap: Arc<DirtyBitmap>,
    /// An inconsistent bitmap (in use by a writer that stopped, unknown extra data, or a file
    /// a program without bitmap support wrote): kept as the directory had it, flagged in use.
    kept: Option<Vec<u8>>,
    table_offset: u64,
    table_size: u32,
    /// Host offsets of its data clusters (every one allocated for the bitmaps this process
    /// keeps; only the allocated ones of a kept bitmap).
    data: Vec<u64>,
}

impl StoredEntry {
    /// Every cluster it owns: its table's and its data's.
    fn clusters(&self, cluster_size: u64) -> Vec<u64> {
        let table_clusters = (u64::from(self.table_size) * 8).div_ceil(cluster_size);
        (0..table_clusters)
            .map(|i| self.table_offset + i * cluster_size)
            .chain(self.data.iter().copied())
            .collect()
    }
}

/// What [`load`] found.
pub(super) struct Loaded {
    pub stored: Stored,
    /// Why the bitmaps could not be read (the image opens without them; a read-write open
    /// refuses, so that they are not lost).
    pub problem: Option<String>,
}

/// Read the bitmaps named by the header (in `first`, the image's first bytes): consistent ones
/// with their bits, the rest (in use, unusable, or every one when the autoclear bit is off)
/// empty and inconsistent. Nothing is trusted: a damaged extension is a problem, not a panic.
pub(super) fn load(file: &dyn Storage, h: &Header, first: &[u8], file_size: u64) -> Loaded {
    let mut loaded = Loaded {
        stored: Stored::default(),
        problem: None,
    };
    let Some(data) = h.extension_data(first, EXT_BITMAPS) else {
        return loaded;
    };
    let cluster = 1u64 << h.cluster_bits;
    let r = (|| -> Result<Stored, String> {
        let ext = reader::parse_extension(data)?;
        let entries = reader::read_directory(file, &ext, h.size_bytes, cluster, file_size)?;
        let consistent = h.autoclear_features & AUTOCLEAR_BITMAPS != 0;
        let mut out = Vec::with_capacity(entries.len());
        for e in &entries {
            out.push(load_entry(
                file,
                e,
                h.size_bytes,
                cluster,
                file_size,
                consistent,
            )?);
        }
        Ok(Stored {
            entries: out,
            dir: Some((ext.directory_offset, ext.directory_size)),
        })
    })();
    match r {
        Ok(s) => loaded.stored = s,
        Err(e) => loaded.problem = Some(e),
    }
    loaded
}

fn load_entry(
    file: &dyn Storage,
    e: &Entry,
    disk_size: u64,
    cluster: u64,
    file_size: u64,
    consistent: bool,
) -> Result<StoredEntry, String> {
    // Its data clusters, from its table (each checked to lie in the file).
    let table = read_aligned(file, e.table_offset, e.table_size as usize * 8)
        .map_err(|err| format!("bitmap {:?}: reading its table: {err}", e.name))?;
    let mut data = Vec::new();
    for raw in table.chunks_exact(8) {
        let host = be64(raw, 0) & reader::ENTRY_OFFSET_MASK;
        if host != 0 {
            if !host.is_multiple_of(cluster) || host + cluster > file_size {
                return Err(format!(
                    "bitmap {:?}: a data cluster outside the file",
                    e.name
                ));
            }
            data.push(host);
        }
    }
    let g = 1u64 << e.granularity_bits;
    if e.in_use || e.unusable || !consistent {
        let mut raw = e.raw.clone();
        let flags = be32(&raw, 12) | FLAG_IN_USE;
        put32(&mut raw, 12, flags);
        return Ok(StoredEntry {
            bitmap: Arc::new(DirtyBitmap::new(&e.name, g, disk_size, false)),
            kept: Some(raw),
            table_offset: e.table_offset,
            table_size: e.table_size,
            data,
        });
    }
    let bitmap = reader::load(file, e, disk_size, cluster, file_size)?;
    bitmap.set_recording(e.auto);
    Ok(StoredEntry {
        bitmap,
        kept: None,
        table_offset: e.table_offset,
        table_size: e.table_size,
        data,
    })
}

impl Stored {
    /// The entry of `bitmap`, kept (inconsistent) or this process's.
    fn find(&self, bitmap: &Arc<DirtyBitmap>, kept: bool) -> Option<&StoredEntry> {
        self.entries
            .iter()
            .find(|e| e.kept.is_some() == kept && Arc::ptr_eq(&e.bitmap, bitmap))
    }

    /// The bitmaps, for the device's set.
    pub(super) fn persistent(&self) -> Vec<Persistent> {
        self.entries
            .iter()
            .map(|e| Persistent {
                bitmap: e.bitmap.clone(),
                inconsistent: e.kept.is_some(),
            })
            .collect()
    }

    /// Every cluster the bitmaps use (directory, tables, data).
    pub(super) fn clusters(&self, cluster_size: u64) -> Vec<u64> {
        let mut v: Vec<u64> = self
            .entries
            .iter()
            .flat_map(|e| e.clusters(cluster_size))
            .collect();
        if let Some((at, len)) = self.dir {
            v.extend((0..len.div_ceil(cluster_size)).map(|i| at + i * cluster_size));
        }
        v
    }

    pub(super) fn is_empty(&self) -> bool {
        self.entries.is_empty() && self.dir.is_none()
    }

    /// Is every consistent bitmap's every data cluster allocated (as this process leaves
    /// them)? Then a read-write open keeps the file's layout (a live migration's take-over
    /// rewrites nothing).
    pub(super) fn fully_allocated(&self) -> bool {
        self.entries
            .iter()
            .all(|e| e.kept.is_some() || e.data.len() == e.table_size as usize)
    }
}

/// A directory entry for a bitmap this process keeps.
fn directory_entry(b: &DirtyBitmap, table_offset: u64, table_size: u32) -> Vec<u8> {
    let name = b.name().as_bytes();
    let mut e = vec![0u8; 24];
    put64(&mut e, 0, table_offset);
    put32(&mut e, 8, table_size);
    put32(&mut e, 12, if b.recording() { FLAG_AUTO } else { 0 });
    e[16] = TYPE_DIRTY_TRACKING;
    e[17] = b.granularity().trailing_zeros() as u8;
    e[18..20].copy_from_slice(&(name.len() as u16).to_be_bytes());
    e.extend_from_slice(name);
    e
}

/// The header's first cluster `old` with the bitmaps extension pointing at `dir` (count,
/// bytes, offset; None: no extension) and the autoclear bits set to match: other extensions
/// are kept in their order, the backing file name moves after the list. Err: no room.
fn rebuild_header(old: &[u8], h: &Header, dir: Option<(u32, u64, u64)>) -> Result<Vec<u8>, String> {
    let mut ext_data = [0u8; 24];
    let add = dir.map(|(count, size, offset)| {
        put32(&mut ext_data, 0, count);
        put64(&mut ext_data, 8, size);
        put64(&mut ext_data, 16, offset);
        (EXT_BITMAPS, &ext_data[..])
    });
    let mut out = header::rebuild(old, h, EXT_BITMAPS, add, None)?;
    let autoclear = if dir.is_some() { AUTOCLEAR_BITMAPS } else { 0 };
    put64(&mut out, header::off::AUTOCLEAR_FEATURES, autoclear);
    Ok(out)
}

impl Qcow2Image {
    /// The persistent bitmaps the file holds now.
    pub fn persistent_bitmaps(&self) -> Vec<Persistent> {
        self.stored.locked().persistent()
    }

    /// Write the persistent bitmaps `list` to the file (see the module's note), replacing
    /// what it held: new clusters, made durable, then the header, then the old clusters
    /// freed. An inconsistent bitmap is kept as the file had it.
    pub fn save_bitmaps(&self, file: &dyn Storage, list: &[Persistent]) -> Result<(), ImageError> {
        let mut st = self.stored.locked();
        let mut ws = self.lock_write()?;
        let disk = self.size_bytes();
        self.save_locked(&mut st, &mut ws, file, list, disk, &|_| {})
    }

    /// Are there persistent bitmaps in the file, and is one of them inconsistent? (An online
    /// resize rewrites the first; the second must be removed before the disk can grow.)
    pub(super) fn stored_bitmaps(st: &Stored) -> (bool, bool) {
        (
            !st.entries.is_empty(),
            st.entries.iter().any(|e| e.kept.is_some()),
        )
    }

    /// [`Qcow2Image::save_bitmaps`] with the locks held, for a disk of `disk` bytes; `patch`
    /// changes the header's first cluster in the same write as the bitmaps extension (an
    /// online resize's size and L1 fields).
    pub(super) fn save_locked(
        &self,
        st: &mut Stored,
        ws: &mut WriteState,
        file: &dyn Storage,
        list: &[Persistent],
        disk: u64,
        patch: &dyn Fn(&mut Vec<u8>),
    ) -> Result<(), ImageError> {
        if self.version < 3 {
            return Err(ImageError::Unsupported(
                "a version 2 qcow2 image cannot keep bitmaps (qemu-img amend -o compat=1.1)".into(),
            ));
        }
        let c = self.cluster_size();
        let mut entries: Vec<StoredEntry> = Vec::with_capacity(list.len());
        let mut dir_bytes: Vec<u8> = Vec::new();
        for p in list {
            let raw = if p.inconsistent {
                let Some(old) = st.find(&p.bitmap, true) else {
                    continue;
                };
                entries.push(old.clone());
                old.kept.clone().unwrap_or_default()
            } else {
                let e = self.write_bitmap(ws, file, &p.bitmap, disk)?;
                let raw = directory_entry(&p.bitmap, e.table_offset, e.table_size);
                entries.push(e);
                raw
            };
            dir_bytes.extend_from_slice(&raw);
            dir_bytes.resize(dir_bytes.len().next_multiple_of(8), 0);
        }
        let dir = if entries.is_empty() {
            None
        } else {
            let n = (dir_bytes.len() as u64).div_ceil(c);
            let at = self.alloc_run(ws, file, n)?;
            let mut buf = dir_bytes.clone();
            buf.resize((n * c) as usize, 0);
            write_all_aligned(file, at, &buf).map_err(ImageError::Io)?;
            Some((at, dir_bytes.len() as u64))
        };
        // The new clusters' refcounts and contents durable before the header names them.
        self.write_back(ws, file)?;
        file.sync_data().map_err(ImageError::Io)?;
        let first_len = c.min(64 << 10) as usize;
        let old = read_aligned(file, 0, first_len).map_err(ImageError::Io)?;
        let h =
            Header::parse(&old).map_err(|_| ImageError::Corrupt("the header no longer parses"))?;
        let mut new = rebuild_header(
            &old,
            &h,
            dir.map(|(at, len)| (entries.len() as u32, len, at)),
        )
        .map_err(ImageError::Unsupported)?;
        patch(&mut new);
        write_unaligned(file, 0, &new, self.meta_chunk()).map_err(ImageError::Io)?;
        file.sync_data().map_err(ImageError::Io)?;
        // The old clusters: freed once the next write-back's sync makes that safe (kept
        // bitmaps still in the list keep theirs).
        let keep: Vec<u64> = entries
            .iter()
            .filter(|e| e.kept.is_some())
            .flat_map(|e| e.clusters(c))
            .collect();
        for host in st.clusters(c) {
            if !keep.contains(&host) {
                ws.pending_decs.push(host);
            }
        }
        st.entries = entries;
        st.dir = dir;
        Ok(())
    }

    /// Write `b` into new clusters (every data cluster allocated) for a disk of `disk` bytes.
    fn write_bitmap(
        &self,
        ws: &mut WriteState,
        file: &dyn Storage,
        b: &Arc<DirtyBitmap>,
        disk: u64,
    ) -> Result<StoredEntry, ImageError> {
        let c = self.cluster_size();
        let n = reader::table_entries(disk, b.granularity().trailing_zeros() as u8, c);
        let table_size = u32::try_from(n)
            .map_err(|_| ImageError::Unsupported("a bitmap table over 2^32 entries".into()))?;
        let table_clusters = (n * 8).div_ceil(c).max(1);
        let table_offset = self.alloc_run(ws, file, table_clusters)?;
        let mut table = vec![0u8; (table_clusters * c) as usize];
        let mut data = Vec::with_capacity(n as usize);
        let mut buf = vec![0u8; c as usize];
        for i in 0..n {
            let host = self.alloc_cluster(ws, file)?;
            self.note_metadata(host);
            b.copy_le(i * c / 8, &mut buf);
            write_all_aligned(file, host, &buf).map_err(ImageError::Io)?;
            table[(i * 8) as usize..(i * 8 + 8) as usize].copy_from_slice(&host.to_be_bytes());
            data.push(host);
        }
        write_all_aligned(file, table_offset, &table).map_err(ImageError::Io)?;
        Ok(StoredEntry {
            bitmap: b.clone(),
            kept: None,
            table_offset,
            table_size,
            data,
        })
    }

    /// `n` contiguous new clusters (a refcount block the allocator needs may land between
    /// them: then the run is given back and taken again after it).
    fn alloc_run(
        &self,
        ws: &mut WriteState,
        file: &dyn Storage,
        n: u64,
    ) -> Result<u64, ImageError> {
        let c = self.cluster_size();
        for _ in 0..4 {
            let at = self.alloc_cluster(ws, file)?;
            self.note_metadata(at);
            let mut got = vec![at];
            for i in 1..n {
                let next = self.alloc_cluster(ws, file)?;
                self.note_metadata(next);
                got.push(next);
                if next != at + i * c {
                    break;
                }
            }
            if got.len() as u64 == n && got.last() == Some(&(at + (n - 1) * c)) {
                return Ok(at);
            }
            for g in got {
                ws.pending_decs.push(g);
            }
        }
        Err(ImageError::Corrupt(
            "no contiguous clusters for a bitmap table",
        ))
    }

    /// Write the words `marks` newly set into the bitmaps' data clusters (the data path,
    /// before the requests that set them complete). Marks of bitmaps the file does not keep
    /// (removed meanwhile, memory-only) are skipped.
    pub fn persist_marks(&self, file: &dyn Storage, marks: &[Mark]) -> Result<(), ImageError> {
        let st = self.stored.locked();
        let c = self.cluster_size();
        let blk = self.meta_chunk();
        let mut buf = vec![0u8; blk as usize];
        let mut written: Vec<(usize, u64)> = Vec::new();
        for m in marks {
            let Some(e) = st.find(&m.bitmap, false) else {
                continue;
            };
            let i = Arc::as_ptr(&e.bitmap) as usize;
            for block in (m.first_word * 8) / blk..=(m.last_word * 8 + 7) / blk {
                if written.contains(&(i, block)) {
                    continue;
                }
                written.push((i, block));
                let byte = block * blk;
                let Some(&host) = e.data.get((byte / c) as usize) else {
                    return Err(ImageError::Corrupt("a bitmap mark past its stored table"));
                };
                e.bitmap.copy_le(byte / 8, &mut buf);
                write_all_aligned(file, host + byte % c, &buf).map_err(ImageError::Io)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::image::qcow2::header::{Compression, EXT_BACKING_FORMAT};

    fn header_with_backing() -> (Vec<u8>, Header) {
        let mut h = Header::new_v3(16, 1 << 30, Compression::Zlib);
        let mut b = vec![0u8; 4096];
        let at = h.header_length as usize;
        put32(&mut b, at, EXT_BACKING_FORMAT);
        put32(&mut b, at + 4, 3);
        b[at + 8..at + 11].copy_from_slice(b"raw");
        // End marker at at + 16; the name after it.
        h.backing_file_offset = (at + 24) as u64;
        h.backing_file_size = 8;
        h.write_to(&mut b);
        b[at + 24..at + 32].copy_from_slice(b"base.raw");
        (b, h)
    }

    #[test]
    fn the_extension_comes_and_goes_and_the_rest_stays() {
        let (old, h) = header_with_backing();
        let new = rebuild_header(&old, &h, Some((2, 80, 3 << 16))).unwrap();
        let nh = Header::parse(&new).unwrap();
        assert_eq!(nh.autoclear_features, AUTOCLEAR_BITMAPS);
        assert_eq!(nh.backing_file(&new).unwrap().as_deref(), Some("base.raw"));
        assert_eq!(
            nh.extension_data(&new, EXT_BACKING_FORMAT),
            Some(&b"raw"[..])
        );
        let e = reader::parse_extension(nh.extension_data(&new, EXT_BITMAPS).unwrap()).unwrap();
        assert_eq!(
            (e.count, e.directory_size, e.directory_offset),
            (2, 80, 3 << 16)
        );
        let gone = rebuild_header(&new, &nh, None).unwrap();
        let gh = Header::parse(&gone).unwrap();
        assert_eq!(gh.autoclear_features, 0);
        assert!(gh.extension_data(&gone, EXT_BITMAPS).is_none());
        assert_eq!(gh.backing_file(&gone).unwrap().as_deref(), Some("base.raw"));
    }

    #[test]
    fn hostile_headers_are_refused_without_a_panic() {
        let (old, h) = header_with_backing();
        let mut rng = 0x1234_5678_9abc_def0u64;
        for i in 0..20_000 {
            let mut b = old.clone();
            for _ in 0..1 + i % 4 {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                let at = (rng % 200) as usize;
                b[at] = (rng >> 32) as u8;
            }
            let hh = Header::parse(&b).unwrap_or_else(|_| h.clone());
            let _ = rebuild_header(&b, &hh, Some((1, 40, 1 << 16)));
            let _ = rebuild_header(&b[..(rng % 300) as usize], &hh, None);
        }
    }
}
