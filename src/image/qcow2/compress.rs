//! Compressed clusters (`--compress-writes on`): compression with the image's type, the
//! placement of chunks back to back in host clusters, and the compressed-write cache, which
//! packs chunks in memory and writes whole runs of host clusters as one aligned write, so
//! O_DIRECT never read-modify-writes a partial cluster. Decompression for reads, which
//! takes bytes still in the cache before the file's.

use std::io::Read;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use super::map::{compressed_entry, L2_COPIED};
use super::refcount::{refcount_max, RefChange};
use super::{CompressOptions, Compression, ImageError, Qcow2Image, WriteState};
use crate::io::aligned::{read_aligned, write_all_aligned, write_unaligned};
use crate::io::Storage;
use crate::locks::Locked;

/// `--compressed-cache-size` default, in host clusters.
pub const DEFAULT_COMPRESSED_CACHE_CLUSTERS: usize = 16;

/// Compressed chunks packed in memory: `data` is the run of host clusters from `start`,
/// filled up to `used`; it reaches the file whole when full, or up to `used` (rounded up to
/// the file's alignment) before any L2 entry naming its chunks is written.
#[derive(Default)]
pub(super) struct CacheState {
    on: bool,
    /// Bound of the run of host clusters held (`--compressed-cache-size`), in clusters.
    cap_clusters: usize,
    start: u64,
    data: Vec<u8>,
    used: usize,
    /// `data[..written]` is in the file as it is here (chunks are only appended, so only
    /// the blocks from the one holding `written` on change): a publish writes just those.
    written: usize,
    /// `data` has bytes the file does not.
    dirty: bool,
    /// A cache write failed: that data is lost, and every later FLUSH fails.
    failed: bool,
    /// Runs taken out of the cache and being written by the thread that filled them,
    /// outside the allocation lock: (file offset, bytes). Reads still find their chunks
    /// here; metadata write-back waits until they are in the file.
    writing: Vec<(u64, Arc<Vec<u8>>)>,
    /// Writes of compressed data that reached the file, and their bytes.
    file_writes: u64,
    file_bytes: u64,
}

/// The compressed-write cache, locked after the allocation lock (never before it).
#[derive(Default)]
pub(super) struct CompCache {
    state: Mutex<CacheState>,
    /// Signalled when a run leaves `CacheState::writing`.
    written: Condvar,
}

impl CompCache {
    pub(super) fn new(opts: Option<CompressOptions>) -> Self {
        let (on, cap_clusters) = match opts {
            Some(o) => (o.cache, o.cache_clusters.max(1)),
            None => (false, DEFAULT_COMPRESSED_CACHE_CLUSTERS),
        };
        CompCache {
            state: Mutex::new(CacheState {
                on,
                cap_clusters,
                ..CacheState::default()
            }),
            written: Condvar::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, CacheState> {
        self.state.locked()
    }
}

/// A run of compressed chunks taken out of the cache, to be written.
pub(super) struct Run {
    start: u64,
    bytes: Arc<Vec<u8>>,
}

impl Qcow2Image {
    /// A cluster compressed with the image's compression type, if that comes out below the
    /// cluster size (chunks are packed byte by byte). zlib: raw deflate with QEMU's
    /// parameters (default level, 4 KiB window, memLevel 9; QEMU inflates with a 4 KiB
    /// window), through zlib-rs, the fastest implementation that can limit the window (see
    /// contrib/deflate-cmp); zstd: one frame, the default level, a context per thread.
    pub fn compress_cluster(&self, data: &[u8]) -> Option<Vec<u8>> {
        let limit = data.len().saturating_sub(1);
        let out = match self.compression {
            Compression::Zlib => {
                let config = zlib_rs::DeflateConfig {
                    level: 6,
                    method: zlib_rs::Method::Deflated,
                    window_bits: -12,
                    mem_level: 9,
                    strategy: zlib_rs::Strategy::Default,
                };
                // Output that does not fit below the limit is not worth storing compressed:
                // deflate stops as soon as the buffer is full.
                let mut out = vec![0u8; limit];
                let (z, rc) = zlib_rs::compress_slice(&mut out, data, config);
                if rc != zlib_rs::ReturnCode::Ok {
                    return None;
                }
                let n = z.len();
                out.truncate(n);
                out
            }
            Compression::Zstd => {
                thread_local! {
                    static ZSTD: std::cell::RefCell<Option<zstd::bulk::Compressor<'static>>> =
                        const { std::cell::RefCell::new(None) };
                }
                ZSTD.with(|z| {
                    let mut z = z.borrow_mut();
                    if z.is_none() {
                        *z = zstd::bulk::Compressor::new(0).ok();
                    }
                    let mut out = Vec::with_capacity(limit);
                    z.as_mut()?.compress_to_buffer(data, &mut out).ok()?;
                    Some(out)
                })?
            }
        };
        (out.len() <= limit && !out.is_empty()).then_some(out)
    }

    /// Place a compressed chunk and write it (or keep it in the cache): right after the
    /// previous chunk when it fits in the same host cluster, which then counts one more
    /// reference; with the cache, a chunk may also spill into the next host cluster when that
    /// one is allocated right after it; else it starts a new host cluster at the end of the
    /// file. Returns the chunk's host offset.
    pub(super) fn place_compressed(
        &self,
        ws: &mut WriteState,
        file: &dyn Storage,
        z: &[u8],
        runs: &mut Vec<Run>,
    ) -> Result<u64, ImageError> {
        let c = self.cluster_size();
        let len = z.len() as u64;
        let max = refcount_max(ws.refcount_order);
        let pos = ws.comp_pos;
        let cur = pos & !(c - 1);
        // Narrow refcounts (1 bit) cannot count another chunk in the same cluster.
        let can_share = !pos.is_multiple_of(c) && self.get_refcount(ws, file, cur)? < max;
        let mut cache = self.comp.lock();
        if !cache.on {
            drop(cache);
            let host = if can_share && pos + len <= cur + c {
                self.set_refcount(ws, file, cur, RefChange::Inc)?;
                pos
            } else if can_share && ws.next_free == cur + c {
                // Spill into the next cluster: allocation takes `next_free` first, so the
                // new cluster is the adjacent one.
                self.set_refcount(ws, file, cur, RefChange::Inc)?;
                self.alloc_cluster(ws, file)?;
                pos
            } else {
                self.alloc_cluster(ws, file)?
            };
            ws.comp_pos = host + len;
            write_unaligned(file, host, z, self.meta_chunk()).map_err(ImageError::Io)?;
            let mut cache = self.comp.lock();
            cache.file_writes += 1;
            cache.file_bytes += len;
            return Ok(host);
        }
        if cache.failed {
            return Err(ImageError::CompressedDataLost);
        }
        // The cache holds a run of contiguous host clusters: every one but the last is full.
        let c_us = c as usize;
        let cap = cache.cap_clusters.max(1) * c_us;
        let cache_end = cache.start + cache.data.len() as u64;
        let cached = can_share && !cache.data.is_empty() && cache_end == cur + c;
        if cached && pos + len <= cur + c {
            self.set_refcount(ws, file, cur, RefChange::Inc)?;
            let at = (pos - cache.start) as usize;
            cache.data[at..at + len as usize].copy_from_slice(z);
            cache.used = at + len as usize;
            cache.dirty = true;
            ws.comp_pos = pos + len;
            if pos + len == cur + c && cache.data.len() >= cap {
                // Full: the whole run goes to the file as one aligned write.
                runs.extend(Self::take_run(&mut cache, c));
                ws.comp_pos = 0;
            }
            return Ok(pos);
        }
        if cached && ws.next_free == cur + c {
            // Spill: the end of this cluster, then the start of the next one.
            self.set_refcount(ws, file, cur, RefChange::Inc)?;
            let room = (cur + c - pos) as usize;
            let at = (pos - cache.start) as usize;
            cache.data[at..at + room].copy_from_slice(&z[..room]);
            cache.used = at + room;
            cache.dirty = true;
            let next = self.alloc_cluster(ws, file)?;
            if next != cur + c || cache.data.len() >= cap {
                // The run is full (or, defensively, the next cluster is not adjacent).
                runs.extend(Self::take_run(&mut cache, c));
                cache.data.resize(c_us, 0);
                cache.start = next;
                cache.used = 0;
                cache.written = 0;
            } else {
                let grown = cache.data.len() + c_us;
                cache.data.resize(grown, 0);
            }
            let at = (next - cache.start) as usize;
            cache.data[at..at + z.len() - room].copy_from_slice(&z[room..]);
            cache.used = at + z.len() - room;
            cache.dirty = true;
            ws.comp_pos = next + (z.len() - room) as u64;
            return Ok(pos);
        }
        // A new host cluster: appended to the run when it is adjacent and there is room,
        // else the run (its unfinished last cluster rounded up) goes to the file first.
        let host = self.alloc_cluster(ws, file)?;
        let end = cache.start + cache.data.len() as u64;
        if cache.data.is_empty() || host != end || cache.data.len() >= cap {
            runs.extend(Self::take_run(&mut cache, self.meta_chunk()));
            cache.start = host;
            cache.written = 0;
        }
        let at = (host - cache.start) as usize;
        cache.data.resize(at + c_us, 0);
        cache.data[at..at + z.len()].copy_from_slice(z);
        cache.used = at + z.len();
        cache.dirty = true;
        ws.comp_pos = host + len;
        Ok(host)
    }

    /// Take the cached run out of the cache (up to what is used, rounded up to `align`) for
    /// the caller to write once it has dropped the allocation lock; the cache is empty after.
    pub(super) fn take_run(cache: &mut CacheState, align: u64) -> Option<Run> {
        let data = std::mem::take(&mut cache.data);
        cache.written = 0;
        if !cache.dirty || data.is_empty() {
            return None;
        }
        cache.dirty = false;
        let n = (cache.used as u64)
            .next_multiple_of(align)
            .min(data.len() as u64) as usize;
        let mut data = data;
        data.truncate(n);
        let bytes = Arc::new(data);
        cache.writing.push((cache.start, bytes.clone()));
        Some(Run {
            start: cache.start,
            bytes,
        })
    }

    /// Write runs taken by [`Self::take_run`] (without the allocation lock held).
    pub(super) fn write_runs(&self, file: &dyn Storage, runs: Vec<Run>) -> Result<(), ImageError> {
        let mut result = Ok(());
        for run in runs {
            let r = write_all_aligned(file, run.start, &run.bytes);
            let mut cache = self.comp.lock();
            cache.writing.retain(|(_, b)| !Arc::ptr_eq(b, &run.bytes));
            match r {
                Ok(()) => {
                    cache.file_writes += 1;
                    cache.file_bytes += run.bytes.len() as u64;
                }
                Err(e) => {
                    crate::log_limited!(
                        log::Level::Error,
                        "compressed-write cache: writing {} bytes at {:#x} failed ({e}); the \
                         compressed clusters in it are lost and every later FLUSH fails",
                        run.bytes.len(),
                        run.start
                    );
                    cache.failed = true;
                    result = Err(ImageError::Io(e));
                }
            }
            drop(cache);
            self.comp.written.notify_all();
        }
        result
    }

    /// Write the cached run up to what is used, rounded up to `align`: only the blocks
    /// changed since the last such write (chunks are appended; a publish writes the blocks
    /// of the chunks completed since the last one, not the whole run again).
    pub(super) fn write_cache(
        cache: &mut CacheState,
        file: &dyn Storage,
        align: u64,
    ) -> Result<(), ImageError> {
        if !cache.dirty || cache.data.is_empty() {
            return Ok(());
        }
        let n = (cache.used as u64)
            .next_multiple_of(align)
            .min(cache.data.len() as u64) as usize;
        let from = ((cache.written as u64 / align) * align).min(n as u64) as usize;
        match write_all_aligned(file, cache.start + from as u64, &cache.data[from..n]) {
            Ok(()) => {
                cache.dirty = false;
                cache.written = cache.used;
                cache.file_writes += 1;
                cache.file_bytes += (n - from) as u64;
                Ok(())
            }
            Err(e) => {
                crate::log_limited!(
                    log::Level::Error,
                    "compressed-write cache: writing {n} bytes at {:#x} failed ({e}); the \
                     compressed clusters in it are lost and every later FLUSH fails",
                    cache.start
                );
                cache.failed = true;
                Err(ImageError::Io(e))
            }
        }
    }

    /// Writes of compressed data that reached the file, and their bytes.
    pub fn compressed_file_writes(&self) -> (u64, u64) {
        let c = self.comp.lock();
        (c.file_writes, c.file_bytes)
    }

    /// Store the new contents of the guest cluster at `cl_start` (whose L2 entry was `old`):
    /// compressed (`z`, placed and cached) or, when it did not compress, as a normal
    /// cluster: `buf` holds the old contents around where `src` goes at `in_cl`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn store_compressed(
        &self,
        ws: &mut WriteState,
        file: &dyn Storage,
        cl_start: u64,
        old: u64,
        z: Option<Vec<u8>>,
        (buf, in_cl, src): (&mut [u8], usize, &[u8]),
        runs: &mut Vec<Run>,
    ) -> Result<(), ImageError> {
        let entry = if let Some(z) = z {
            let at = self.place_compressed(ws, file, &z, runs)?;
            self.stats
                .compressed_clusters
                .fetch_add(1, Ordering::Relaxed);
            compressed_entry(at, z.len() as u64, self.cluster_bits)
        } else {
            self.stats
                .uncompressible_clusters
                .fetch_add(1, Ordering::Relaxed);
            buf[in_cl..in_cl + src.len()].copy_from_slice(src);
            let new = match self.find_free_run(ws, file, 1)? {
                Some(h) => h,
                None => self.alloc_cluster(ws, file)?,
            };
            write_all_aligned(file, new, buf).map_err(ImageError::Io)?;
            new | L2_COPIED
        };
        let l2 = self.ensure_l2(ws, file, cl_start)?;
        self.write_l2_entry(ws, file, l2, self.l2_index(cl_start), entry)?;
        self.release_old(ws, old);
        Ok(())
    }

    /// Before metadata write-back: runs other writers are writing reach the file first,
    /// then the cached run (rounded up to `align`), so no L2 entry written next names
    /// compressed bytes the file does not have. Fails for good after a failed cache write.
    pub(super) fn write_back_cache(&self, file: &dyn Storage) -> Result<(), ImageError> {
        let mut cache = self.comp.lock();
        // Their threads do not need the allocation lock to finish.
        while !cache.writing.is_empty() {
            cache = crate::locks::wait(&self.comp.written, cache);
        }
        if cache.failed {
            return Err(ImageError::CompressedDataLost);
        }
        Self::write_cache(&mut cache, file, self.meta_chunk())?;
        // Keep only the last cluster of the run (the one chunks may still be appended to):
        // the full ones are in the file now, and one of them may be freed next.
        let c = self.cluster_size() as usize;
        if cache.data.len() > c {
            let drop_n = cache.data.len() - c;
            cache.data.drain(..drop_n);
            cache.start += drop_n as u64;
            cache.used = cache.used.saturating_sub(drop_n);
            cache.written = cache.written.saturating_sub(drop_n);
        }
        Ok(())
    }

    /// The host cluster at `host` was freed: never append compressed chunks to it, nor
    /// write a cached copy of it later (it may be reused for other data).
    pub(super) fn forget_freed_cluster(&self, ws: &mut WriteState, host: u64) {
        let mut cache = self.comp.lock();
        let cached = !cache.data.is_empty() && cache.start == host;
        if cached {
            cache.data.clear();
            cache.dirty = false;
            cache.written = 0;
        }
        drop(cache);
        if cached || ws.comp_pos & !(self.cluster_size() - 1) == host {
            ws.comp_pos = 0;
        }
    }

    /// Decompress the cluster of a compressed extent into `cluster_buf` (cluster size).
    pub fn decompress(
        &self,
        file: &dyn Storage,
        host_offset: u64,
        compressed_len: u64,
        cluster_buf: &mut [u8],
    ) -> Result<(), ImageError> {
        let start = host_offset & !511;
        let lead = (host_offset - start) as usize;
        // Bytes still in the compressed-write cache are newer than the file's. Take them
        // first: whatever is not in the cache now already is in the file (a run leaves the
        // cache only after its write completed), so the file read below sees it.
        let mut overlays: Vec<(usize, Vec<u8>)> = Vec::new();
        {
            let cache = self.comp.lock();
            let held = cache
                .writing
                .iter()
                .map(|(start, b)| (*start, &b[..]))
                .chain([(cache.start, &cache.data[..cache.used.min(cache.data.len())])]);
            for (a, bytes) in held {
                let b = a + bytes.len() as u64;
                let (x, y) = (host_offset, host_offset + compressed_len);
                let (lo, hi) = (a.max(x), b.min(y));
                if lo < hi {
                    let src = (lo - a) as usize;
                    overlays.push((
                        lead + (lo - x) as usize,
                        bytes[src..src + (hi - lo) as usize].to_vec(),
                    ));
                }
            }
        }
        let want = lead + compressed_len as usize;
        let mut raw = read_aligned(file, start, want).map_err(ImageError::Io)?;
        if raw.len() < want && !overlays.is_empty() {
            raw.resize(want, 0);
        }
        for (dst, bytes) in overlays {
            if let Some(d) = raw.get_mut(dst..dst + bytes.len()) {
                d.copy_from_slice(&bytes);
            }
        }
        let input = raw
            .get(lead..)
            .ok_or(ImageError::Corrupt("short compressed cluster"))?;
        match self.compression {
            Compression::Zlib => {
                let mut d = flate2::read::DeflateDecoder::new(input);
                d.read_exact(cluster_buf)
                    .map_err(|_| ImageError::Corrupt("bad deflate data in a compressed cluster"))?;
            }
            Compression::Zstd => {
                // The stream may be followed by padding: decode exactly one cluster.
                let mut d = zstd::stream::read::Decoder::new(input)
                    .map_err(|_| ImageError::Corrupt("bad zstd data in a compressed cluster"))?
                    .single_frame();
                d.read_exact(cluster_buf)
                    .map_err(|_| ImageError::Corrupt("bad zstd data in a compressed cluster"))?;
            }
        }
        Ok(())
    }
}
