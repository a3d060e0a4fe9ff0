//! Fuzzing entry points (`fuzz/` runs them under libFuzzer with `cargo +nightly fuzz`; the
//! test suite runs them on generated inputs). Each opens arbitrary bytes as an image in
//! memory and uses it: nothing may panic, no read may start past the end of the file, the
//! file may only grow by what allocation needs, and memory stays bounded (a huge L1 or
//! refcount table is refused, never allocated).

use std::io;
use std::sync::Mutex;

use super::qcow2::{Extent, Qcow2Image, ZeroMode};
use super::storage::Storage;

/// How much an image may grow while being fuzzed.
const MAX_GROWTH: u64 = 64 << 20;

/// An image file in memory that checks how it is used.
pub struct MemStorage {
    bytes: Mutex<Vec<u8>>,
    limit: u64,
}

impl MemStorage {
    pub fn new(bytes: Vec<u8>) -> Self {
        let limit = bytes.len() as u64 + MAX_GROWTH;
        MemStorage {
            bytes: Mutex::new(bytes),
            limit,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<u8>> {
        self.bytes.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Storage for MemStorage {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        let b = self.lock();
        // Reads are 4 KiB-aligned, so they may start up to one block before the end; a read
        // starting further out followed a pointer that was never checked.
        assert!(
            offset <= (b.len() as u64).next_multiple_of(4096),
            "read at {offset:#x} past the end of a {:#x}-byte file",
            b.len()
        );
        let start = (offset as usize).min(b.len());
        let n = buf.len().min(b.len() - start);
        buf[..n].copy_from_slice(&b[start..start + n]);
        Ok(n)
    }

    fn write_all_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        let end = offset
            .checked_add(buf.len() as u64)
            .filter(|&e| e <= self.limit)
            .ok_or_else(|| io::Error::from_raw_os_error(libc::ENOSPC))?;
        let mut b = self.lock();
        if (b.len() as u64) < end {
            b.resize(end as usize, 0);
        }
        b[offset as usize..end as usize].copy_from_slice(buf);
        Ok(())
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        if len > self.limit {
            return Err(io::Error::from_raw_os_error(libc::ENOSPC));
        }
        self.lock().resize(len as usize, 0);
        Ok(())
    }

    fn size(&self) -> io::Result<u64> {
        Ok(self.lock().len() as u64)
    }

    fn sync_data(&self) -> io::Result<()> {
        Ok(())
    }

    fn allocate(&self, offset: u64, len: u64) -> io::Result<()> {
        let end = offset
            .checked_add(len)
            .filter(|&e| e <= self.limit)
            .ok_or_else(|| io::Error::from_raw_os_error(libc::ENOSPC))?;
        let mut b = self.lock();
        if (b.len() as u64) < end {
            b.resize(end as usize, 0);
        }
        Ok(())
    }

    fn punch_hole(&self, offset: u64, len: u64) -> io::Result<()> {
        let mut b = self.lock();
        let end = offset.saturating_add(len).min(b.len() as u64);
        if offset < end {
            b[offset as usize..end as usize].fill(0);
        }
        Ok(())
    }
}

/// Open `data` as a qcow2 image read-only and read-write; map, read, write, zero and flush
/// a few ranges chosen from the input's last bytes.
pub fn qcow2_open(data: &[u8]) {
    let (ops, image) = data.split_at(data.len().min(16));
    let pick = |i: usize| {
        u64::from_le_bytes(std::array::from_fn(|k| {
            ops.get(i * 8 + k).copied().unwrap_or(0)
        }))
    };
    for writable in [false, true] {
        let disk = MemStorage::new(image.to_vec());
        let Ok(q) = Qcow2Image::open_with_cache(&disk, writable, Some(0)) else {
            continue;
        };
        q.set_prealloc(Some((1 << 20, 1 << 16, 512)));
        let size = q.size_bytes;
        if size == 0 {
            continue;
        }
        let c = q.cluster_size();
        let mut extents = Vec::new();
        for i in 0..2 {
            let off = (pick(i) % size) & !511;
            let len = (size - off).min(4 * c).min(1 << 20);
            if q.map(&disk, off, len, &mut extents).is_err() {
                continue;
            }
            assert_eq!(extents.iter().map(|e| e.len()).sum::<u64>(), len);
            let mut cluster = vec![0u8; c as usize];
            for e in &extents {
                if let Extent::Compressed {
                    host_offset,
                    compressed_len,
                    ..
                } = *e
                {
                    let _ = q.decompress(&disk, host_offset, compressed_len, &mut cluster);
                }
            }
            if writable {
                let data = vec![0xa5u8; len.min(3 * c) as usize];
                let mut fill = |_: u64, buf: &mut [u8]| {
                    buf.fill(0);
                    Ok(())
                };
                let _ = q.write(&disk, off, &data, &mut fill);
                if let Ok(Some(fw)) = q.plan_fresh_write(&disk, off, len, false) {
                    if let Some(f) = fw.fill {
                        q.end_fill(f.key);
                    }
                }
                let mode = [ZeroMode::Keep, ZeroMode::Unmap, ZeroMode::Discard][i % 3];
                let _ = q.zero_range(
                    &disk,
                    off & !(c - 1),
                    c.min(size - (off & !(c - 1))),
                    mode,
                    false,
                    &mut fill,
                );
            }
        }
        let _ = q.close(&disk);
    }
}

/// Open `data` as a parallels image read-only and read-write; map, write, zero, flush and
/// close a few ranges chosen from the input's first bytes.
pub fn parallels_open(data: &[u8]) {
    use super::parallels::{ParallelsImage, PreallocMode};
    let (ops, image) = data.split_at(data.len().min(16));
    let pick = |i: usize| {
        u64::from_le_bytes(std::array::from_fn(|k| {
            ops.get(i * 8 + k).copied().unwrap_or(0)
        }))
    };
    for writable in [false, true] {
        let disk = MemStorage::new(image.to_vec());
        let Ok(p) = ParallelsImage::open(&disk, writable, 512) else {
            continue;
        };
        let mode = if pick(0) & 1 == 0 {
            PreallocMode::Falloc
        } else {
            PreallocMode::Truncate
        };
        p.set_prealloc((pick(1) & 2 == 0).then_some((mode, 1 << 20)));
        let size = p.size_bytes;
        if size == 0 {
            continue;
        }
        let c = p.cluster_size;
        let mut pieces = Vec::new();
        for i in 0..2 {
            let off = (pick(i) % size) & !511;
            let len = (size - off).min(3 * c).min(1 << 20) & !511;
            if len == 0 {
                continue;
            }
            p.map(off, len, &mut pieces);
            assert_eq!(pieces.iter().map(|x| x.len()).sum::<u64>(), len);
            for x in &pieces {
                if let super::chain::Piece::Data {
                    host_offset, len, ..
                } = *x
                {
                    let mut b = vec![0u8; len as usize];
                    let _ = super::qcow2::read_aligned(&disk, host_offset, b.len())
                        .map(|v| b.copy_from_slice(&v));
                }
            }
            if writable {
                let _ = p.write(&disk, off, &vec![0x5au8; len as usize]);
                let _ = p.zero_range(&disk, off & !(c - 1), c, i == 0, false);
                let _ = p.flush(&disk);
            }
        }
        let _ = p.close(&disk);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A small valid image to mutate: 64 KiB clusters, two allocated data clusters.
    fn seed_image() -> Vec<u8> {
        static SEED: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
        SEED.get_or_init(make_seed).clone()
    }

    /// A fresh 8 MiB qcow2 image with 64 KiB clusters made by `vublk create`, at a temporary
    /// path (the caller removes it).
    pub(super) fn fresh_image(tag: &str) -> std::path::PathBuf {
        fresh_image_with(tag, crate::image::qcow2::Compression::Zlib)
    }

    /// The same with a given compression type.
    pub(super) fn fresh_image_with(
        tag: &str,
        compression: crate::image::qcow2::Compression,
    ) -> std::path::PathBuf {
        let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/unit-tmp");
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join(format!("fuzz-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_file(&p);
        let params = crate::image::create::CreateParams {
            parallels_cluster: None,
            qcow2: true,
            size_bytes: 8 << 20,
            cluster_bits: 16,
            compression,
            backing: None,
        };
        crate::image::create::create(&p, &params).unwrap();
        p
    }

    fn make_seed() -> Vec<u8> {
        let p = fresh_image("seed");
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&p)
            .unwrap();
        let q = Qcow2Image::open(&f, true).unwrap();
        let mut fill = |_: u64, buf: &mut [u8]| {
            buf.fill(0);
            Ok(())
        };
        q.write(&f, 0, &[7u8; 4096], &mut fill).unwrap();
        q.write(&f, 3 << 20, &[9u8; 65536], &mut fill).unwrap();
        q.close(&f).unwrap();
        drop(q);
        let b = std::fs::read(&p).unwrap();
        std::fs::remove_file(&p).unwrap();
        b
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]
        /// Mutations of a valid image (bytes overwritten anywhere in the metadata).
        #[test]
        fn mutated_images_never_panic(
            ops in proptest::collection::vec(any::<u8>(), 16),
            edits in proptest::collection::vec((0usize..0x60000, any::<u64>()), 1..12),
        ) {
            let mut img = seed_image();
            for (at, v) in edits {
                if at + 8 <= img.len() {
                    img[at..at + 8].copy_from_slice(&v.to_be_bytes());
                }
            }
            let mut input = ops;
            input.extend_from_slice(&img);
            qcow2_open(&input);
        }

        /// Arbitrary short inputs (headers with random fields).
        #[test]
        fn arbitrary_bytes_never_panic(data in proptest::collection::vec(any::<u8>(), 0..4096)) {
            let mut d = data;
            if d.len() > 20 {
                d[16..20].copy_from_slice(&super::super::qcow2::MAGIC);
            }
            qcow2_open(&d);
        }
    }
}

#[cfg(test)]
mod directed {
    use super::*;

    fn be64(b: &[u8], o: usize) -> u64 {
        u64::from_be_bytes(b[o..o + 8].try_into().unwrap())
    }

    fn seed() -> Vec<u8> {
        let p = super::tests::fresh_image("directed");
        let b = std::fs::read(&p).unwrap();
        std::fs::remove_file(&p).unwrap();
        b
    }

    /// Refcount table entries pointing outside the file, at the header, at the L1 table or
    /// at the refcount table itself: refused at a read-write open, or at least never
    /// followed outside the file and never written over other metadata.
    #[test]
    fn hostile_refcount_table_entries() {
        let base = seed();
        let rt = be64(&base, 48) as usize;
        let l1 = be64(&base, 40);
        for target in [1u64 << 40, 0x200, l1, rt as u64, 0x10000 + 0x1000] {
            let mut img = base.clone();
            img[rt..rt + 8].copy_from_slice(&target.to_be_bytes());
            let mut input = vec![0u8; 16];
            input.extend_from_slice(&img);
            qcow2_open(&input);
            // If it opens writable, the header and the L1 table are intact after writes.
            let disk = MemStorage::new(img.clone());
            if let Ok(q) = Qcow2Image::open(&disk, true) {
                let mut fill = |_: u64, buf: &mut [u8]| {
                    buf.fill(0);
                    Ok(())
                };
                let _ = q.write(&disk, 0, &[1u8; 65536], &mut fill);
                let _ = q.close(&disk);
                let after = disk.lock().clone();
                assert_eq!(
                    &after[..104],
                    &img[..104],
                    "target {target:#x}: header overwritten"
                );
                assert_eq!(
                    &after[l1 as usize..l1 as usize + 8],
                    &img[l1 as usize..l1 as usize + 8],
                    "target {target:#x}: L1 overwritten"
                );
            }
        }
    }
}

#[cfg(test)]
mod tail {
    use super::*;

    /// A read-write open cuts off a tail that nothing uses, but never a cluster an L2 entry
    /// points at, even when its refcount says it is free (broken refcounts).
    #[test]
    fn open_keeps_referenced_clusters_past_the_last_refcount() {
        let p = super::tests::fresh_image("tail");
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&p)
            .unwrap();
        let q = Qcow2Image::open(&f, true).unwrap();
        let mut fill = |_: u64, buf: &mut [u8]| {
            buf.fill(0);
            Ok(())
        };
        // Guest cluster 0 allocates its data and the L2 table; guest cluster 1's data is
        // then the last cluster of the file.
        q.write(&f, 0, &[0x11; 65536], &mut fill).unwrap();
        q.write(&f, 65536, &[0x5a; 65536], &mut fill).unwrap();
        q.close(&f).unwrap();
        drop(q);
        let mut img = std::fs::read(&p).unwrap();
        std::fs::remove_file(&p).unwrap();
        let be64 = |b: &[u8], o: usize| u64::from_be_bytes(b[o..o + 8].try_into().unwrap());
        const MASK: u64 = 0x00ff_ffff_ffff_fe00;
        let l2 = (be64(&img, be64(&img, 40) as usize) & MASK) as usize;
        let last = (be64(&img, l2 + 8) & MASK) as usize;
        assert_eq!(
            last + 65536,
            img.len(),
            "guest cluster 1 is not the last cluster"
        );
        // Its 16-bit refcount says free: refcount table -> first block.
        let rt = be64(&img, 48) as usize;
        let rb = be64(&img, rt) as usize;
        let at = rb + last / 65536 * 2;
        img[at..at + 2].fill(0);
        // And a 1 MiB tail of zeroes after it that nothing uses.
        let len = img.len();
        img.resize(len + (1 << 20), 0);
        let disk = MemStorage::new(img);
        let q = Qcow2Image::open(&disk, true).unwrap();
        q.close(&disk).unwrap();
        let after = disk.lock().clone();
        assert!(
            after.len() >= len,
            "referenced data was cut off: {}",
            after.len()
        );
        assert!(after[last..last + 65536].iter().all(|&b| b == 0x5a));
        assert_eq!(after.len(), len, "the unused tail was not cut off");
    }
}

#[cfg(test)]
mod packing {
    use super::*;
    use crate::image::qcow2::Compression;

    fn image(compression: Compression) -> Vec<u8> {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let p =
            super::tests::fresh_image_with(&format!("packing-{compression:?}-{n}"), compression);
        let b = std::fs::read(&p).unwrap();
        std::fs::remove_file(&p).unwrap();
        b
    }

    /// A cluster of text-like data that compresses to a few KiB (different per `k`).
    fn cluster_data(k: u64) -> Vec<u8> {
        let mut v = Vec::with_capacity(65536);
        let mut i = k * 7919;
        while v.len() < 65536 {
            v.extend_from_slice(format!("{i:x}-{}|", i * i % 1_000_003).as_bytes());
            i += 1;
        }
        v.truncate(65536);
        v
    }

    /// Chunks are packed back to back in allocation order, their L2 descriptors count the
    /// 512-byte sectors they touch, one spills into the next host cluster, and everything
    /// reads back; for zlib and zstd, with and without the cache.
    #[test]
    fn chunks_are_packed_back_to_back() {
        for compression in [Compression::Zlib, Compression::Zstd] {
            for cache in [true, false] {
                let disk = MemStorage::new(image(compression));
                let q = Qcow2Image::open(&disk, true).unwrap();
                q.set_compress_writes(true);
                q.set_compressed_cache(cache);
                let mut fill = |_: u64, buf: &mut [u8]| {
                    buf.fill(0);
                    Ok(())
                };
                let mut lens = Vec::new();
                for k in 0..40u64 {
                    let data = cluster_data(k);
                    lens.push(q.compress_cluster(&data).unwrap().len() as u64);
                    q.write(&disk, k * 65536, &data, &mut fill).unwrap();
                }
                let mut ext = Vec::new();
                let mut hosts = Vec::new();
                for k in 0..40u64 {
                    q.map(&disk, k * 65536, 65536, &mut ext).unwrap();
                    let [Extent::Compressed {
                        host_offset,
                        compressed_len,
                        ..
                    }] = ext[..]
                    else {
                        panic!("cluster {k} not compressed: {ext:?}");
                    };
                    // The descriptor's sectors cover the chunk, from its offset's sector.
                    let len = lens[k as usize];
                    let sectors = ((host_offset + len - 1) >> 9) - (host_offset >> 9) + 1;
                    assert_eq!(
                        compressed_len,
                        sectors * 512 - (host_offset & 511),
                        "{compression:?} cache {cache}: sector count of chunk {k}"
                    );
                    hosts.push(host_offset);
                }
                let mut spills = 0;
                for k in 1..40usize {
                    let prev_end = hosts[k - 1] + lens[k - 1];
                    let same_run = hosts[k] == prev_end;
                    let new_cluster = hosts[k] % 65536 == 0;
                    assert!(
                        same_run || new_cluster,
                        "{compression:?} cache {cache}: chunk {k} at {:#x} neither follows \
                         chunk {} (ends {prev_end:#x}) nor starts a cluster",
                        hosts[k],
                        k - 1
                    );
                    if same_run && hosts[k] / 65536 != (hosts[k] + lens[k] - 1) / 65536 {
                        spills += 1;
                    }
                }
                assert!(
                    spills > 0,
                    "{compression:?} cache {cache}: no chunk spilled into the next cluster"
                );
                // Everything reads back through decompression (from the cache or the file).
                let mut buf = vec![0u8; 65536];
                for k in 0..40u64 {
                    q.map(&disk, k * 65536, 65536, &mut ext).unwrap();
                    let Extent::Compressed {
                        host_offset,
                        compressed_len,
                        ..
                    } = ext[0]
                    else {
                        panic!("cluster {k}: {:?}", ext[0]);
                    };
                    q.decompress(&disk, host_offset, compressed_len, &mut buf)
                        .unwrap();
                    assert!(buf == cluster_data(k), "{compression:?} cache {cache}: {k}");
                }
                q.close(&disk).unwrap();
            }
        }
    }

    /// Incompressible data (a xorshift stream), different per `k`.
    fn noise(k: u64) -> Vec<u8> {
        let mut x = k.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        (0..65536)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    }

    fn zero_fill(_: u64, buf: &mut [u8]) -> Result<(), crate::image::qcow2::MapError> {
        buf.fill(0);
        Ok(())
    }

    fn assert_reads(q: &Qcow2Image, disk: &MemStorage, k: u64, want: &[u8], what: &str) {
        let mut ext = Vec::new();
        q.map(disk, k * 65536, 65536, &mut ext).unwrap();
        let mut buf = vec![0u8; 65536];
        match ext[..] {
            [Extent::Compressed {
                host_offset,
                compressed_len,
                ..
            }] => q
                .decompress(disk, host_offset, compressed_len, &mut buf)
                .unwrap(),
            [Extent::Data { host_offset, .. }] => {
                disk.read_at(&mut buf, host_offset).unwrap();
            }
            _ => panic!("{what}: cluster {k}: {ext:?}"),
        }
        assert!(buf == want, "{what}: cluster {k} reads back wrong");
    }

    /// `--compressed-cache-size`: the cache holds a run of up to N contiguous host clusters
    /// and writes it as one aligned write when the run is full; a bound of one cluster writes
    /// each host cluster when it fills. Both give the same image contents.
    #[test]
    fn the_cache_writes_runs_of_up_to_its_bound() {
        let n = 120u64;
        let mut results = Vec::new();
        for clusters in [1usize, 4] {
            let disk = MemStorage::new(image(Compression::Zlib));
            let q = Qcow2Image::open(&disk, true).unwrap();
            q.set_compress_writes(true);
            q.set_compressed_cache(true);
            q.set_compressed_cache_clusters(clusters);
            let mut fill = zero_fill;
            let mut total = 0;
            for k in 0..n {
                let data = cluster_data(k);
                total += q.compress_cluster(&data).unwrap().len() as u64;
                q.write(&disk, k * 65536, &data, &mut fill).unwrap();
            }
            let (writes, bytes) = q.compressed_file_writes();
            let host_clusters = total.div_ceil(65536);
            eprintln!(
                "bound {clusters}: {writes} writes of {bytes} bytes, {host_clusters} host clusters"
            );
            // Before any flush, full runs reached the file, each as one write; one run may
            // have been cut short when a new L2 table was allocated right after it.
            let run = 65536 * clusters as u64;
            assert!(writes > 0, "bound {clusters}: nothing written");
            assert!(
                bytes <= writes * run && bytes > (writes - 1) * run,
                "bound {clusters}: {writes} writes of {bytes} bytes are not full runs"
            );
            let full_runs = total / run;
            assert!(
                (full_runs.saturating_sub(1)..=full_runs + 1).contains(&writes),
                "bound {clusters}: {writes} writes for {host_clusters} host clusters of chunks"
            );
            for k in 0..n {
                assert_reads(&q, &disk, k, &cluster_data(k), "before close");
            }
            q.close(&disk).unwrap();
            let q = Qcow2Image::open(&disk, false).unwrap();
            for k in 0..n {
                assert_reads(&q, &disk, k, &cluster_data(k), "after reopen");
            }
            results.push(writes);
        }
        assert!(
            results[0] >= 3 * results[1],
            "a 4-cluster cache did not cut writes: {results:?}"
        );
    }

    /// A host cluster whose chunks are all overwritten is freed and reused for other data;
    /// the cache must never write its stale copy of that cluster over the new data.
    #[test]
    fn a_freed_cluster_is_never_rewritten_from_the_cache() {
        let disk = MemStorage::new(image(Compression::Zlib));
        let q = Qcow2Image::open(&disk, true).unwrap();
        q.set_compress_writes(true);
        q.set_compressed_cache(true);
        q.set_punch_freed(true);
        let mut fill = zero_fill;
        // Enough chunks to fill two host clusters and start a third (one run in the cache).
        let mut k = 0u64;
        let mut hosts = Vec::new();
        let mut ext = Vec::new();
        loop {
            let data = cluster_data(k);
            let len = q.compress_cluster(&data).unwrap().len() as u64;
            q.write(&disk, k * 65536, &data, &mut fill).unwrap();
            q.map(&disk, k * 65536, 65536, &mut ext).unwrap();
            let Extent::Compressed { host_offset, .. } = ext[0] else {
                panic!("{:?}", ext[0]);
            };
            hosts.push((host_offset, len));
            k += 1;
            // The first chunk that starts a host cluster after the L2 table was allocated
            // starts the run.
            let run = hosts
                .iter()
                .skip(1)
                .find(|h| h.0 % 65536 == 0)
                .map(|h| h.0 / 65536);
            if run.is_some_and(|r| host_offset / 65536 == r + 2) {
                break;
            }
        }
        q.flush(&disk).unwrap();
        // Overwrite every chunk in the middle host cluster with incompressible data: that
        // cluster is freed at the next write-back and reused by the next normal cluster.
        let run = hosts.iter().skip(1).find(|h| h.0 % 65536 == 0).unwrap().0 / 65536;
        let middle = run + 1;
        let mut want: Vec<Vec<u8>> = (0..k).map(cluster_data).collect();
        for (i, &(h, len)) in hosts.iter().enumerate() {
            if h / 65536 == middle || (h + len - 1) / 65536 == middle {
                want[i] = noise(i as u64);
                q.write(&disk, i as u64 * 65536, &want[i], &mut fill)
                    .unwrap();
            }
        }
        q.flush(&disk).unwrap();
        q.flush(&disk).unwrap();
        let reuse = k + 10;
        let fresh = noise(reuse);
        q.set_compress_writes(false);
        q.write(&disk, reuse * 65536, &fresh, &mut fill).unwrap();
        q.map(&disk, reuse * 65536, 65536, &mut ext).unwrap();
        assert!(
            matches!(ext[..], [Extent::Data { host_offset, .. }] if host_offset / 65536 == middle),
            "the freed cluster was not reused: {ext:?}"
        );
        q.set_compress_writes(true);
        // Small chunks appended to the run's last cluster, then everything written back.
        for j in k..k + 5 {
            want.push(vec![j as u8; 65536]);
            q.write(&disk, j * 65536, &want[j as usize], &mut fill)
                .unwrap();
        }
        q.flush(&disk).unwrap();
        for (i, w) in want.iter().enumerate() {
            assert_reads(&q, &disk, i as u64, w, "after reuse");
        }
        assert_reads(&q, &disk, reuse, &fresh, "the reused cluster");
        q.close(&disk).unwrap();
        let (allocated, _) = strict_check(&disk, "after reuse");
        assert!(allocated > 0);
        // Discarding every chunk frees every host cluster: refcounts stay exact (no leak,
        // nothing allocated).
        let q = Qcow2Image::open(&disk, true).unwrap();
        let used = want.len() as u64;
        for k in (0..used).chain([reuse]) {
            q.zero_range(&disk, k * 65536, 65536, ZeroMode::Discard, false, &mut fill)
                .unwrap();
        }
        q.close(&disk).unwrap();
        let (allocated, check) = strict_check(&disk, "after discarding everything");
        assert_eq!(allocated, 0, "clusters still allocated:\n{check}");
    }

    /// `qemu-img check --output=json` must find nothing (no corruption, no leak); returns the
    /// allocated cluster count and the report. Without qemu-img: (1, "").
    fn strict_check(disk: &MemStorage, what: &str) -> (u64, String) {
        let have = std::process::Command::new("qemu-img")
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success());
        if !have {
            return (1, String::new());
        }
        let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/unit-tmp");
        std::fs::create_dir_all(&dir).unwrap();
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let p = dir.join(format!(
            "strict-{}-{}",
            std::process::id(),
            N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        ));
        std::fs::write(&p, &*disk.lock()).unwrap();
        let o = std::process::Command::new("qemu-img")
            .args(["check", "--output=json", "-f", "qcow2"])
            .arg(&p)
            .output()
            .unwrap();
        std::fs::remove_file(&p).unwrap();
        let out = String::from_utf8_lossy(&o.stdout).into_owned();
        assert_eq!(o.status.code(), Some(0), "{what}: qemu-img check:\n{out}");
        let allocated = out
            .split("\"allocated-clusters\":")
            .nth(1)
            .map(|r| {
                r.trim()
                    .split([',', '\n'])
                    .next()
                    .and_then(|v| v.trim().parse().ok())
                    .unwrap_or_else(|| panic!("{what}: bad allocated-clusters in:\n{out}"))
            })
            // qemu-img leaves the field out when nothing is allocated.
            .unwrap_or(0);
        (allocated, out)
    }

    /// While a writer through the format holds the fill gate (a write on a pool thread may
    /// write in place into any allocated cluster), no new fill starts: a fill writes its
    /// whole cluster and could land over those bytes. Without the gate, fills start again.
    #[test]
    fn no_fill_starts_while_the_gate_is_raised() {
        use std::sync::atomic::Ordering::SeqCst;
        let p = super::tests::fresh_image("fill-gate");
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&p)
            .unwrap();
        let q = Qcow2Image::open(&file, true).unwrap();
        q.fill_gate.fetch_add(1, SeqCst);
        let fw = q
            .plan_fresh_write(&file, 4096, 4096, false)
            .unwrap()
            .unwrap();
        assert!(fw.fill.is_none(), "a fill started behind the gate");
        assert_eq!(q.fills_in_flight.load(SeqCst), 0);
        q.fill_gate.fetch_sub(1, SeqCst);
        let fw = q
            .plan_fresh_write(&file, 65536 + 4096, 4096, false)
            .unwrap()
            .unwrap();
        let f = fw.fill.expect("no fill without the gate");
        assert_eq!(q.fills_in_flight.load(SeqCst), 1);
        q.end_fill(f.key);
        q.close(&file).unwrap();
        std::fs::remove_file(&p).unwrap();
    }

    /// A disk whose writes fail while `fail` is set.
    struct FlakyDisk {
        inner: MemStorage,
        fail: std::sync::atomic::AtomicBool,
    }

    impl Storage for FlakyDisk {
        fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
            self.inner.read_at(buf, offset)
        }
        fn write_all_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
            if self.fail.load(std::sync::atomic::Ordering::Relaxed) {
                return Err(io::Error::from_raw_os_error(libc::EIO));
            }
            self.inner.write_all_at(buf, offset)
        }
        fn set_len(&self, len: u64) -> io::Result<()> {
            self.inner.set_len(len)
        }
        fn size(&self) -> io::Result<u64> {
            self.inner.size()
        }
        fn sync_data(&self) -> io::Result<()> {
            self.inner.sync_data()
        }
        fn punch_hole(&self, offset: u64, len: u64) -> io::Result<()> {
            self.inner.punch_hole(offset, len)
        }
    }

    /// A failed cache write loses the chunks in it: the FLUSH that hit it fails, and so does
    /// every later one, even once the disk works again; nothing claims durability again.
    #[test]
    fn a_failed_cache_write_fails_every_later_flush() {
        let disk = FlakyDisk {
            inner: MemStorage::new(image(Compression::Zstd)),
            fail: std::sync::atomic::AtomicBool::new(false),
        };
        let q = Qcow2Image::open(&disk, true).unwrap();
        q.set_compress_writes(true);
        q.set_compressed_cache(true);
        let mut fill = zero_fill;
        for k in 0..3 {
            q.write(&disk, k * 65536, &cluster_data(k), &mut fill)
                .unwrap();
        }
        q.flush(&disk).unwrap();
        // Chunks that sit in the cache (the unfinished cluster) when the disk fails.
        for k in 3..6 {
            q.write(&disk, k * 65536, &cluster_data(k), &mut fill)
                .unwrap();
        }
        disk.fail.store(true, std::sync::atomic::Ordering::Relaxed);
        assert!(
            q.flush(&disk).is_err(),
            "the flush that lost data succeeded"
        );
        disk.fail.store(false, std::sync::atomic::Ordering::Relaxed);
        for attempt in 0..3 {
            assert!(
                q.flush(&disk).is_err(),
                "flush {attempt} after the lost cache write succeeded"
            );
        }
        assert!(
            q.write(&disk, 10 * 65536, &cluster_data(10), &mut fill)
                .is_err(),
            "a compressed write after the lost cache write succeeded"
        );
        // What was flushed before the failure is still there.
        for k in 0..3 {
            let mut ext = Vec::new();
            q.map(&disk, k * 65536, 65536, &mut ext).unwrap();
            let Extent::Compressed {
                host_offset,
                compressed_len,
                ..
            } = ext[0]
            else {
                panic!("{:?}", ext[0]);
            };
            let mut buf = vec![0u8; 65536];
            q.decompress(&disk, host_offset, compressed_len, &mut buf)
                .unwrap();
            assert!(buf == cluster_data(k), "flushed cluster {k}");
        }
    }

    /// Several threads write compressed clusters at once (runs are written outside the
    /// allocation lock) while each reads back what it wrote at once and others flush: every
    /// read sees its data, whether it is in the cache, being written, or in the file.
    #[test]
    fn concurrent_writers_read_back_their_chunks() {
        let disk = MemStorage::new(image(Compression::Zstd));
        let q = Qcow2Image::open(&disk, true).unwrap();
        q.set_compress_writes(true);
        q.set_compressed_cache(true);
        q.set_compressed_cache_clusters(2);
        std::thread::scope(|s| {
            for t in 0..4u64 {
                let (q, disk) = (&q, &disk);
                s.spawn(move || {
                    let mut fill = zero_fill;
                    for i in 0..30u64 {
                        let k = t * 100 + i;
                        q.write(disk, k * 65536, &cluster_data(k), &mut fill)
                            .unwrap();
                        assert_reads(q, disk, k, &cluster_data(k), "right after the write");
                        if i % 10 == 9 {
                            q.flush(disk).unwrap();
                        }
                    }
                });
            }
        });
        q.close(&disk).unwrap();
        let q = Qcow2Image::open(&disk, false).unwrap();
        for t in 0..4u64 {
            for i in 0..30u64 {
                let k = t * 100 + i;
                assert_reads(&q, &disk, k, &cluster_data(k), "after reopen");
            }
        }
        strict_check(&disk, "after concurrent writers");
    }
}

#[cfg(test)]
mod parallels_tests {
    use super::*;
    use crate::image::chain::Piece;
    use crate::image::parallels::{new_image, ParallelsError, ParallelsImage, PreallocMode};
    use proptest::prelude::*;

    const C: u64 = 65536;

    fn read_guest(p: &ParallelsImage, disk: &MemStorage, off: u64, len: u64) -> Vec<u8> {
        let mut pieces = Vec::new();
        p.map(off, len, &mut pieces);
        let mut out = Vec::new();
        for x in &pieces {
            match *x {
                Piece::Data {
                    host_offset, len, ..
                } => out.extend(
                    super::super::qcow2::read_aligned(disk, host_offset, len as usize).unwrap(),
                ),
                Piece::Zero { len } => out.extend(std::iter::repeat_n(0u8, len as usize)),
                _ => panic!("{x:?}"),
            }
        }
        out
    }

    /// Writes, discards that free clusters, reuse of freed clusters only after the BAT is
    /// written, growth by cluster + preallocation, and a clean close that trims the file;
    /// with 64 KiB clusters, 63-sector clusters (not a power of two), and the old magic
    /// (BAT entries in sectors).
    #[test]
    fn a_model_of_writes_discards_and_reuse() {
        for (cluster, old) in [(C, false), (63 * 512, false), (4096, true)] {
            model_run(cluster, old);
        }
    }

    fn model_run(c: u64, old: bool) {
        let size = 8 << 20;
        let mut img = new_image(size, c).unwrap();
        if old {
            img[..16].copy_from_slice(crate::image::parallels::MAGIC_OLD);
        }
        let disk = MemStorage::new(img);
        let p = ParallelsImage::open(&disk, true, 512).unwrap();
        p.set_prealloc(Some((PreallocMode::Falloc, 1 << 20)));
        let mut model = vec![0u8; size as usize];
        let mut seed = 7u64;
        let mut next = || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            seed >> 33
        };
        for round in 0..200 {
            let off = (next() % (size / 512)) * 512;
            let len = ((next() % 256 + 1) * 512).min(size - off);
            match round % 7 {
                0 => {
                    p.zero_range(&disk, off, len, true, false).unwrap();
                    model[off as usize..(off + len) as usize].fill(0);
                }
                1 => p.flush(&disk).unwrap(),
                _ => {
                    let data: Vec<u8> = (0..len).map(|i| (i as u8) ^ (round as u8)).collect();
                    p.write(&disk, off, &data).unwrap();
                    model[off as usize..(off + len) as usize].copy_from_slice(&data);
                }
            }
            if round % 50 == 49 {
                assert!(
                    read_guest(&p, &disk, 0, size) == model,
                    "{c} old {old}: round {round}"
                );
            }
        }
        assert!(p.stats.freed.load(std::sync::atomic::Ordering::Relaxed) > 0);
        assert!(
            p.stats.reused.load(std::sync::atomic::Ordering::Relaxed) > 0,
            "no reuse"
        );
        p.close(&disk).unwrap();
        // Clean close: in-use cleared, the file ends at the last used cluster.
        let b = disk.lock().clone();
        assert_eq!(
            u32::from_le_bytes(b[44..48].try_into().unwrap()),
            0x312e_3276
        );
        let p = ParallelsImage::open(&disk, false, 512).unwrap();
        assert!(read_guest(&p, &disk, 0, size) == model, "after reopen");
        let data_off = p.data_off;
        let unit = if old { 512 } else { c };
        let bat: Vec<u64> = (0..size.div_ceil(c))
            .map(|g| {
                u64::from(u32::from_le_bytes(
                    b[64 + g as usize * 4..][..4].try_into().unwrap(),
                ))
            })
            .collect();
        let end = bat
            .iter()
            .filter(|&&e| e != 0)
            .map(|e| e * unit + c)
            .max()
            .unwrap_or(data_off);
        assert_eq!(
            b.len() as u64,
            end,
            "{c} old {old}: not trimmed to the last used cluster"
        );
    }

    /// Growth: with preallocation the file grows by the cluster plus the preallocation, not
    /// cluster by cluster; without it, by one cluster.
    #[test]
    fn growth_steps() {
        for (prealloc, steps) in [(Some((PreallocMode::Falloc, 1u64 << 20)), 1u64), (None, 16)] {
            let disk = MemStorage::new(new_image(8 << 20, C).unwrap());
            let p = ParallelsImage::open(&disk, true, 512).unwrap();
            p.set_prealloc(prealloc);
            let base = disk.size().unwrap();
            for k in 0..16 {
                p.write(&disk, k * C, &vec![1u8; C as usize]).unwrap();
            }
            let grows = p.stats.grows.load(std::sync::atomic::Ordering::Relaxed);
            assert_eq!(grows, steps, "{prealloc:?}");
            if prealloc.is_some() {
                assert_eq!(disk.size().unwrap(), base + C + (1 << 20));
            } else {
                assert_eq!(disk.size().unwrap(), base + 16 * C);
            }
            p.close(&disk).unwrap();
            assert_eq!(disk.size().unwrap(), base + 16 * C);
        }
    }

    /// One growth covers every cluster the request needs plus the preallocation (QEMU's
    /// `to_allocate * cluster + prealloc_size`).
    #[test]
    fn growth_covers_the_whole_request() {
        let disk = MemStorage::new(new_image(8 << 20, C).unwrap());
        let p = ParallelsImage::open(&disk, true, 512).unwrap();
        p.set_prealloc(Some((PreallocMode::Truncate, 1 << 20)));
        let base = disk.size().unwrap();
        p.write(&disk, 0, &vec![3u8; 1 << 20]).unwrap();
        assert_eq!(p.stats.grows.load(std::sync::atomic::Ordering::Relaxed), 1);
        assert_eq!(disk.size().unwrap(), base + (1 << 20) + (1 << 20));
        p.close(&disk).unwrap();
        assert_eq!(disk.size().unwrap(), base + (1 << 20));
    }

    /// A disk whose fallocate or size-only extension is refused (EOPNOTSUPP).
    struct Refusing {
        inner: MemStorage,
        no_falloc: bool,
        no_truncate_growth: bool,
    }

    impl Storage for Refusing {
        fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
            self.inner.read_at(buf, offset)
        }
        fn write_all_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
            self.inner.write_all_at(buf, offset)
        }
        fn set_len(&self, len: u64) -> io::Result<()> {
            if self.no_truncate_growth && len > self.inner.size()? {
                return Err(io::Error::from_raw_os_error(libc::EOPNOTSUPP));
            }
            self.inner.set_len(len)
        }
        fn size(&self) -> io::Result<u64> {
            self.inner.size()
        }
        fn sync_data(&self) -> io::Result<()> {
            Ok(())
        }
        fn allocate(&self, offset: u64, len: u64) -> io::Result<()> {
            if self.no_falloc {
                return Err(io::Error::from_raw_os_error(libc::EOPNOTSUPP));
            }
            self.inner.allocate(offset, len)
        }
        fn punch_hole(&self, offset: u64, len: u64) -> io::Result<()> {
            self.inner.punch_hole(offset, len)
        }
    }

    /// truncate mode falls back to falloc for good when extending by size is refused;
    /// falloc extends by size where fallocate is unsupported; writes never fail for it.
    #[test]
    fn preallocation_falls_back() {
        for (mode, no_falloc, no_trunc) in [
            (PreallocMode::Truncate, false, true),
            (PreallocMode::Falloc, true, false),
        ] {
            let disk = Refusing {
                inner: MemStorage::new(new_image(8 << 20, C).unwrap()),
                no_falloc,
                no_truncate_growth: no_trunc,
            };
            let p = ParallelsImage::open(&disk, true, 512).unwrap();
            p.set_prealloc(Some((mode, 1 << 20)));
            let base = disk.size().unwrap();
            for k in 0..40 {
                p.write(&disk, k * C, &vec![9u8; C as usize]).unwrap();
            }
            assert!(
                disk.size().unwrap() >= base + 40 * C,
                "{mode:?}: did not grow"
            );
            if no_trunc {
                assert_eq!(p.prealloc_mode(), Some(PreallocMode::Falloc), "no fallback");
            }
            assert_eq!(
                p.stats.grows.load(std::sync::atomic::Ordering::Relaxed),
                3,
                "{mode:?}: growth steps (1 MiB ahead, 64 KiB clusters)"
            );
            p.close(&disk).unwrap();
        }
    }

    /// Entries outside the file, or two entries naming one cluster, are never served.
    #[test]
    fn broken_bats_are_refused() {
        let mut img = new_image(4 << 20, C).unwrap();
        img.resize(img.len() + 2 * C as usize, 0);
        let first = (img.len() as u64 / C - 2) as u32;
        let set = |img: &mut Vec<u8>, g: usize, v: u32| {
            img[64 + g * 4..68 + g * 4].copy_from_slice(&v.to_le_bytes())
        };
        let mut dup = img.clone();
        set(&mut dup, 0, first);
        set(&mut dup, 3, first);
        let mut outside = img.clone();
        set(&mut outside, 1, first + 5);
        for (what, bytes) in [("duplicate", dup), ("outside", outside)] {
            for writable in [false, true] {
                let disk = MemStorage::new(bytes.clone());
                match ParallelsImage::open(&disk, writable, 512) {
                    Err(ParallelsError::NeedsRepair(m)) => {
                        let msg = ParallelsError::NeedsRepair(m).to_string();
                        assert!(msg.contains("qemu-img check -r all"), "{msg}");
                    }
                    other => panic!("{what}: {other:?}"),
                }
                assert!(
                    *disk.lock() == bytes,
                    "{what}: a refused open changed the file"
                );
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]
        #[test]
        fn mutated_parallels_images_never_panic(
            flips in proptest::collection::vec((0usize..1024, any::<u8>()), 1..12),
            ops in proptest::collection::vec(any::<u8>(), 16),
        ) {
            let mut img = new_image(2 << 20, 4096).unwrap();
            img.resize(img.len() + 3 * 4096, 0x11);
            let first = (img.len() as u32 / 4096) - 3;
            img[64..68].copy_from_slice(&first.to_le_bytes());
            for (at, v) in flips {
                if let Some(b) = img.get_mut(at) {
                    *b = v;
                }
            }
            let mut data = ops;
            data.extend_from_slice(&img);
            parallels_open(&data);
        }

        #[test]
        fn arbitrary_bytes_never_panic_as_parallels(
            data in proptest::collection::vec(any::<u8>(), 0..4096)
        ) {
            let mut d = data;
            if d.len() > 32 {
                d[16..32].copy_from_slice(b"WithouFreSpacExt");
            }
            parallels_open(&d);
        }
    }
}
