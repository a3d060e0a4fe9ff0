//! Compressed clusters and the compressed-write cache on an in-memory disk: packing, L2
//! descriptors, runs of up to the cache's bound, freed clusters, failed cache writes, and
//! concurrent writers.

use std::io;

use super::*;
use crate::image::ZeroMode;
use crate::io::Storage;
use crate::testing::MemStorage;

/// Open read-write with compressed writes on (`cache`: the compressed-write cache, of
/// `clusters` host clusters), and `punch` freed clusters.
fn compressed(disk: &dyn Storage, cache: bool, clusters: usize, punch: bool) -> Qcow2Image {
    let opts = Qcow2Options {
        writable: true,
        punch_freed: punch,
        compress: Some(CompressOptions {
            cache,
            cache_clusters: clusters,
        }),
        ..Qcow2Options::default()
    };
    Qcow2Image::open(disk, opts).unwrap()
}

fn rw() -> Qcow2Options {
    Qcow2Options {
        writable: true,
        ..Qcow2Options::default()
    }
}

fn image(compression: Compression) -> Vec<u8> {
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let p = crate::testing::fresh_qcow2(&format!("packing-{compression:?}-{n}"), compression);
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
            let q = compressed(&disk, cache, DEFAULT_COMPRESSED_CACHE_CLUSTERS, false);
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

fn zero_fill(_: u64, buf: &mut [u8]) -> Result<(), crate::image::ImageError> {
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
        let q = compressed(&disk, true, clusters, false);
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
        let q = Qcow2Image::open_read_only(&disk).unwrap();
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
    let q = compressed(&disk, true, DEFAULT_COMPRESSED_CACHE_CLUSTERS, true);
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
    // Incompressible data is stored as a normal cluster, taken from free space first.
    q.write(&disk, reuse * 65536, &fresh, &mut fill).unwrap();
    q.map(&disk, reuse * 65536, 65536, &mut ext).unwrap();
    assert!(
        matches!(ext[..], [Extent::Data { host_offset, .. }] if host_offset / 65536 == middle),
        "the freed cluster was not reused: {ext:?}"
    );
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
    let q = Qcow2Image::open(&disk, rw()).unwrap();
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
    let p = crate::testing::fresh_qcow2("fill-gate", Compression::Zlib);
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&p)
        .unwrap();
    let q = Qcow2Image::open(&file, rw()).unwrap();
    let gate = q.raise_fill_gate();
    let fw = q
        .plan_fresh_write(&file, 4096, 4096, false)
        .unwrap()
        .unwrap();
    assert!(fw.fill.is_none(), "a fill started behind the gate");
    assert_eq!(q.fill_count(), 0);
    drop(gate);
    let fw = q
        .plan_fresh_write(&file, 65536 + 4096, 4096, false)
        .unwrap()
        .unwrap();
    let f = fw.fill.expect("no fill without the gate");
    assert_eq!(q.fill_count(), 1);
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
    let q = compressed(&disk, true, DEFAULT_COMPRESSED_CACHE_CLUSTERS, false);
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
    let q = compressed(&disk, true, 2, false);
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
    let q = Qcow2Image::open_read_only(&disk).unwrap();
    for t in 0..4u64 {
        for i in 0..30u64 {
            let k = t * 100 + i;
            assert_reads(&q, &disk, k, &cluster_data(k), "after reopen");
        }
    }
    strict_check(&disk, "after concurrent writers");
}
