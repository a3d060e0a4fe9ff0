//! Crash consistency of the qcow2 engine on a simulated disk: writes since the last sync sit
//! in a volatile cache, and a crash keeps an arbitrary subset of them (in order). After
//! every crash the image must pass `qemu-img check` (leaks allowed) and hold everything
//! written before the last FLUSH; then serving goes on from the crashed image.

use std::path::PathBuf;
use std::process::Command;

use super::{CompressOptions, Extent, Qcow2Image, Qcow2Options, DEFAULT_COMPRESSED_CACHE_CLUSTERS};
use crate::image::prealloc::PreallocParams;
use crate::image::{ImageError, ZeroMode};
use crate::io::aligned::read_aligned;
use crate::io::Storage;
use crate::testing::SimDisk;

use crate::testing::XorShift as Rng;

fn tmp(tag: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/unit-tmp");
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(format!("crash-{tag}-{}", std::process::id()))
}

fn have_qemu_img() -> bool {
    Command::new("qemu-img")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

/// A fresh qcow2 image: made by qemu-img when there is one (any refcount width), else by
/// vublk create (16-bit refcounts).
fn fresh_image(tag: &str, size: u64, cluster: u64, refcount_bits: u32) -> Vec<u8> {
    let p = tmp(tag);
    let _ = std::fs::remove_file(&p);
    if have_qemu_img() {
        let o = Command::new("qemu-img")
            .args(["create", "-q", "-f", "qcow2", "-o"])
            .arg(format!(
                "cluster_size={cluster},refcount_bits={refcount_bits}"
            ))
            .arg(&p)
            .arg(size.to_string())
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    } else {
        let params = crate::image::create::CreateParams {
            parallels_cluster: None,
            qcow2: true,
            size_bytes: size,
            cluster_bits: cluster.trailing_zeros(),
            compression: super::Compression::Zlib,
            extended_l2: false,
            backing: None,
            encrypt: None,
        };
        crate::image::create::create(&p, &params).unwrap();
    }
    let b = std::fs::read(&p).unwrap();
    std::fs::remove_file(&p).unwrap();
    b
}

/// The image on `disk`, writable, with the default options.
fn open_writable(disk: &SimDisk) -> Qcow2Image {
    Qcow2Image::open(
        disk,
        Qcow2Options {
            writable: true,
            ..Qcow2Options::default()
        },
    )
    .unwrap()
}

/// A fresh qcow2 image (64 KiB clusters) over a raw backing file named `base.raw` (never
/// opened: the tests read the backing data through their own fill function).
fn fresh_overlay(tag: &str, size: u64) -> Vec<u8> {
    let p = tmp(tag);
    let _ = std::fs::remove_file(&p);
    let params = crate::image::create::CreateParams {
        parallels_cluster: None,
        qcow2: true,
        size_bytes: size,
        cluster_bits: 16,
        compression: super::Compression::Zlib,
        extended_l2: false,
        backing: Some(("base.raw".into(), "raw")),
        encrypt: None,
    };
    crate::image::create::create(&p, &params).unwrap();
    let b = std::fs::read(&p).unwrap();
    std::fs::remove_file(&p).unwrap();
    b
}

/// `qemu-img check`: Ok for a clean image or leaks only.
fn qemu_check(tag: &str, bytes: &[u8]) -> Result<(), String> {
    if !have_qemu_img() {
        return Ok(());
    }
    let o = qemu_check_output(tag, bytes);
    match o.status.code() {
        Some(0) | Some(3) => Ok(()),
        c => Err(format!(
            "qemu-img check exit {c:?}:\n{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        )),
    }
}

/// `qemu-img check` of `bytes` (written to a temporary file).
fn qemu_check_output(tag: &str, bytes: &[u8]) -> std::process::Output {
    let p = tmp(tag);
    std::fs::write(&p, bytes).unwrap();
    let o = Command::new("qemu-img")
        .args(["check", "-f", "qcow2"])
        .arg(&p)
        .output()
        .unwrap();
    std::fs::remove_file(&p).unwrap();
    o
}

/// Read guest bytes through the image's mapping (no backing file).
fn read_guest(
    q: &Qcow2Image,
    disk: &dyn Storage,
    off: u64,
    buf: &mut [u8],
) -> Result<(), ImageError> {
    let mut ext = Vec::new();
    q.map(disk, off, buf.len() as u64, &mut ext)?;
    let mut pos = 0usize;
    let mut cluster = vec![0u8; q.cluster_size() as usize];
    for e in ext {
        let n = e.len() as usize;
        match e {
            Extent::Data { host_offset, .. } => {
                let d = read_aligned(disk, host_offset, n).map_err(ImageError::Io)?;
                buf[pos..pos + n].copy_from_slice(&d);
            }
            Extent::Zero { .. } | Extent::Unallocated { .. } => buf[pos..pos + n].fill(0),
            Extent::Compressed {
                host_offset,
                compressed_len,
                skip,
                ..
            } => {
                q.decompress(disk, host_offset, compressed_len, &mut cluster)?;
                buf[pos..pos + n].copy_from_slice(&cluster[skip as usize..skip as usize + n]);
            }
        }
        pos += n;
    }
    Ok(())
}

/// One write the way the worker does it: in place or into fresh clusters through the
/// "ring" (here: straight to the disk), else the synchronous copy-on-write path.
fn guest_write(q: &Qcow2Image, disk: &SimDisk, off: u64, data: &[u8]) {
    let len = data.len() as u64;
    if q.compress_writes() {
        // As the worker does: compressed clusters are built by the format.
        let mut fill = |cl: u64, buf: &mut [u8]| {
            let n = (buf.len() as u64).min(q.size_bytes() - cl) as usize;
            buf.fill(0);
            read_guest(q, disk, cl, &mut buf[..n])
        };
        q.write(disk, off, data, &mut fill).unwrap();
        return;
    }
    let host = match q.owned_extent(disk, off, len).unwrap() {
        Some(h) => Some(h),
        None => match q.plan_fresh_write(disk, off, len, false).unwrap() {
            // A fill writes the new clusters whole: zeroes around the data.
            Some(fw) if fw.fill.is_some() => {
                let f = fw.fill.unwrap();
                let mut whole = vec![0u8; f.len as usize];
                let at = (fw.host - f.start) as usize;
                whole[at..at + data.len()].copy_from_slice(data);
                disk.write_all_at(&whole, f.start).unwrap();
                q.end_fill(f.key);
                return;
            }
            other => other.map(|fw| fw.host),
        },
    };
    match host {
        Some(h) => disk.write_all_at(data, h).unwrap(),
        None => {
            let mut fill = |cl: u64, buf: &mut [u8]| {
                let n = (buf.len() as u64).min(q.size_bytes() - cl) as usize;
                buf.fill(0);
                read_guest(q, disk, cl, &mut buf[..n])
            };
            q.write(disk, off, data, &mut fill).unwrap();
        }
    }
}

/// Returns how many clusters were allocated from free space. Each write is published as
/// the worker does before the request completes. `killed`: the crash is the process's, not
/// the host's (every write survives in the page cache, synced or not), and everything
/// completed must read back, not only what was flushed.
fn run_crash_model(seed: u64, cluster: u64, refcount_bits: u32, killed: bool) -> u64 {
    const SIZE: u64 = 4 << 20;
    const SECTOR: usize = 512;
    let tag = format!("{cluster}-{refcount_bits}-{seed}");
    let mut rng = Rng(seed);
    let mut bytes = fresh_image(&tag, SIZE, cluster, refcount_bits);
    // The guest disk as of the last FLUSH, and which sectors were written since.
    let mut flushed = vec![0u8; SIZE as usize];
    let mut reused = 0;
    for round in 0..8 {
        let disk = SimDisk::new(bytes);
        // Every third round with the smallest L2 cache (4 tables): dirty tables get written
        // back under pressure, not only on FLUSH.
        let cache = (round % 3 == 0).then_some(0);
        let opts = Qcow2Options {
            writable: true,
            l2_cache_bytes: cache,
            punch_freed: round % 2 == 1,
            // Rounds 2 and 6 store what they write compressed (round 2 through the cache).
            compress: (round % 4 == 2).then_some(CompressOptions {
                cache: round == 2,
                cache_clusters: DEFAULT_COMPRESSED_CACHE_CLUSTERS,
            }),
            // Odd rounds preallocate (small steps: big ones only cost copies here).
            prealloc: (round % 2 == 1).then_some(PreallocParams {
                size: 64 << 10,
                align: 4096,
                file_align: 512,
            }),
            prealloc_file: None,
            encrypted: false,
        };
        let q = Qcow2Image::open(&disk, opts).unwrap();
        let mut now = flushed.clone();
        let mut touched = vec![false; SIZE as usize / SECTOR];
        let ops = 20 + rng.below(60);
        for _ in 0..ops {
            match rng.below(10) {
                0..=5 => {
                    let len = (1 + rng.below(3 * cluster / SECTOR as u64 + 8)) as usize * SECTOR;
                    let len = len.min(256 << 10);
                    let off = rng.below((SIZE - len as u64) / SECTOR as u64 + 1) * SECTOR as u64;
                    let tag = rng.next_u64().to_le_bytes();
                    let data: Vec<u8> = (0..len).map(|i| tag[i % 8] ^ (i / 512) as u8).collect();
                    guest_write(&q, &disk, off, &data);
                    q.publish(&disk).unwrap();
                    now[off as usize..off as usize + len].copy_from_slice(&data);
                    touched[off as usize / SECTOR..(off as usize + len) / SECTOR].fill(true);
                }
                6 | 7 => {
                    let n = 1 + rng.below(4);
                    let off = rng.below(SIZE / cluster - n + 1) * cluster;
                    let len = n * cluster;
                    let mode =
                        [ZeroMode::Keep, ZeroMode::Unmap, ZeroMode::Discard][rng.below(3) as usize];
                    let mut fill = |_: u64, buf: &mut [u8]| {
                        buf.fill(0);
                        Ok(())
                    };
                    q.zero_range(&disk, off, len, mode, false, &mut fill)
                        .unwrap();
                    q.publish(&disk).unwrap();
                    now[off as usize..(off + len) as usize].fill(0);
                    touched[off as usize / SECTOR..(off + len) as usize / SECTOR].fill(true);
                }
                _ => {
                    q.flush(&disk).unwrap();
                    disk.sync_data().unwrap();
                    flushed.clone_from(&now);
                    touched.fill(false);
                }
            }
        }
        // Everything reads back before the crash.
        let mut got = vec![0u8; SIZE as usize];
        read_guest(&q, &disk, 0, &mut got).unwrap();
        assert!(got == now, "{tag} round {round}: reads before the crash");
        let crashed = if killed {
            disk.crash(|| true)
        } else {
            disk.crash(|| rng.below(2) == 0)
        };
        reused += q
            .stats
            .reused_clusters
            .load(std::sync::atomic::Ordering::Relaxed);
        if q.compress_writes() {
            let n = q
                .stats
                .compressed_clusters
                .load(std::sync::atomic::Ordering::Relaxed);
            assert!(n > 0, "{tag} round {round}: nothing was stored compressed");
        }
        drop(q);
        if let Err(e) = qemu_check(&tag, &crashed) {
            panic!("{tag} round {round}: {e}");
        }
        let disk = SimDisk::new(crashed.clone());
        let q = Qcow2Image::open_read_only(&disk).unwrap();
        read_guest(&q, &disk, 0, &mut got).unwrap();
        if killed {
            assert!(
                got == now,
                "{tag} round {round}: a completed write was lost with the process"
            );
        }
        for (s, &t) in touched.iter().enumerate() {
            let r = s * SECTOR..(s + 1) * SECTOR;
            if !t {
                assert!(
                    got[r.clone()] == flushed[r.clone()],
                    "{tag} round {round}: flushed sector {s} lost"
                );
            }
        }
        // What the crash left is the new baseline.
        flushed = got;
        bytes = crashed;
    }
    reused
}

#[test]
fn flushed_data_survives_crashes_that_drop_unsynced_writes() {
    for (i, &(cluster, bits)) in [
        (65536u64, 16u32),
        (4096, 16),
        (512, 16),
        (4096, 1),
        (4096, 64),
        (65536, 8),
    ]
    .iter()
    .enumerate()
    {
        let mut reused = 0;
        for seed in 1..=3u64 {
            reused += run_crash_model(seed * 7919 + i as u64, cluster, bits, false);
        }
        // Discarded and leaked clusters are allocated again (free space before the end).
        assert!(reused > 0, "{cluster}-byte clusters: no cluster was reused");
    }
}

/// A killed vublk (SIGKILL, a crash of the process, not of the host): every write that
/// completed is found by the next process, flushed or not, because its metadata was put
/// into the file before it completed; and the image checks clean (leaks allowed).
#[test]
fn completed_writes_survive_a_killed_process() {
    for (i, &(cluster, bits)) in [(65536u64, 16u32), (4096, 16), (512, 64)]
        .iter()
        .enumerate()
    {
        for seed in 1..=3u64 {
            run_crash_model(seed * 104_729 + i as u64, cluster, bits, true);
        }
    }
}

/// Refcounts reserved ahead: writes into fresh clusters, each published as the worker does,
/// cost a sync per reservation (8 MiB), not one each; a killed process leaves the unused
/// reservation behind, and the next read-write open gives it back (no leaks).
#[test]
fn reserved_refcounts_spare_syncs_and_a_crash_leaks_nothing_for_long() {
    const SIZE: u64 = 64 << 20;
    let tag = "reserve";
    let disk = SimDisk::new(fresh_image(tag, SIZE, 65536, 16));
    let opts = || Qcow2Options {
        writable: true,
        ..Qcow2Options::default()
    };
    let q = Qcow2Image::open(&disk, opts()).unwrap();
    let mut rng = Rng(99);
    let clusters = SIZE / 65536;
    let mut order: Vec<u64> = (0..clusters).collect();
    for i in (1..order.len()).rev() {
        order.swap(i, rng.below(i as u64 + 1) as usize);
    }
    let before = disk.syncs();
    let n = 256;
    for &cl in &order[..n] {
        guest_write(&q, &disk, cl * 65536 + 4096, &[0x5a; 4096]);
        q.publish(&disk).unwrap();
    }
    let syncs = disk.syncs() - before;
    // 256 new clusters (16 MiB) are two or three reservations and a few L2 tables.
    assert!(syncs <= 12, "{syncs} syncs for {n} allocating writes");
    // A killed process: everything written is in the file, the reservation too.
    let killed = disk.crash(|| true);
    drop(q);
    qemu_check(tag, &killed).unwrap();
    let disk = SimDisk::new(killed);
    let q = Qcow2Image::open(&disk, opts()).unwrap();
    let reopened = disk.crash(|| true);
    let mut got = vec![0u8; 4096];
    read_guest(&q, &disk, order[0] * 65536 + 4096, &mut got).unwrap();
    assert!(got.iter().all(|&b| b == 0x5a));
    drop(q);
    if have_qemu_img() {
        let o = qemu_check_output(tag, &reopened);
        assert_eq!(
            o.status.code(),
            Some(0),
            "leaks after the reopen:\n{}",
            String::from_utf8_lossy(&o.stdout)
        );
    }
}

/// Copy-on-write over a backing file: a new cluster keeps the backing file's bytes around
/// the guest's data, so its L2 entry may only become durable after that copy (else a power
/// failure could show the backing data as lost). Writes through the unlocked path (the pool
/// threads') and the locked one, each published; then crashes that keep any subset of what
/// was not synced: every sector the guest did not write reads as the backing file's.
#[test]
fn copies_of_backing_data_are_durable_before_their_l2_entries() {
    const SIZE: u64 = 8 << 20;
    let c = 65536u64;
    let backing = |off: u64, buf: &mut [u8]| {
        for (i, b) in buf.iter_mut().enumerate() {
            *b = ((off as usize + i) / 512 % 251) as u8 | 1;
        }
    };
    let fresh = fresh_overlay("cow-backing", SIZE);
    for seed in 1..=6u64 {
        let mut rng = Rng(seed * 31);
        let disk = SimDisk::new(fresh.clone());
        let q = open_writable(&disk);
        assert!(q.backing_file.is_some());
        let mut written = vec![false; (SIZE / 512) as usize];
        for _ in 0..40 {
            let cl = rng.below(SIZE / c) * c;
            let off = cl + rng.below(c / 512 - 8) * 512;
            let data = vec![0u8; 4096];
            let mut fill = |at: u64, buf: &mut [u8]| {
                backing(at, buf);
                Ok(())
            };
            q.write(&disk, off, &data, &mut fill).unwrap();
            q.publish(&disk).unwrap();
            written[(off / 512) as usize..((off + 4096) / 512) as usize].fill(true);
        }
        let crashed = disk.crash(|| rng.below(2) == 0);
        drop(q);
        let disk = SimDisk::new(crashed);
        let q = Qcow2Image::open_read_only(&disk).unwrap();
        let mut ext = Vec::new();
        q.map(&disk, 0, SIZE, &mut ext).unwrap();
        let mut pos = 0u64;
        for e in ext {
            let n = e.len();
            if let Extent::Data { host_offset, .. } = e {
                let got = read_aligned(&disk, host_offset, n as usize).unwrap();
                let mut want = vec![0u8; n as usize];
                backing(pos, &mut want);
                for s in 0..(n / 512) as usize {
                    let sector = (pos / 512) as usize + s;
                    if !written[sector] {
                        assert!(
                            got[s * 512..(s + 1) * 512] == want[s * 512..(s + 1) * 512],
                            "seed {seed}: sector {sector} lost its backing data"
                        );
                    }
                }
            }
            pos += n;
        }
    }
}

/// A publish writes the L2 chunks it copied without the allocation lock: a chunk changed
/// meanwhile must stay dirty (and be written by the next write-back), not be marked clean
/// with the older copy in the file.
#[test]
fn a_chunk_changed_while_its_copy_is_written_stays_dirty() {
    let disk = SimDisk::new(fresh_image("chunk-race", 4 << 20, 65536, 16));
    let q = open_writable(&disk);
    let c = q.cluster_size();
    let killed_view = |disk: &SimDisk| {
        let d = SimDisk::new(disk.crash(|| true));
        let r = Qcow2Image::open_read_only(&d).unwrap();
        let mut ext = Vec::new();
        r.map(&d, 0, 2 * c, &mut ext).unwrap();
        ext.iter()
            .map(|e| matches!(e, Extent::Data { .. }))
            .collect::<Vec<_>>()
    };
    guest_write(&q, &disk, 0, &[1u8; 4096]);
    let copies = q.copy_dirty_tables().unwrap();
    assert!(!copies.is_empty());
    // Another thread installs an entry in the same chunk while the copy is being written.
    guest_write(&q, &disk, c, &[2u8; 4096]);
    q.write_chunk_copies(&disk, copies).unwrap();
    assert_eq!(killed_view(&disk), vec![true, false]);
    assert_eq!(
        q.lock_l2().dirty_tables(),
        1,
        "the changed chunk was marked clean"
    );
    q.publish(&disk).unwrap();
    assert_eq!(killed_view(&disk), vec![true, true]);
    assert_eq!(q.lock_l2().dirty_tables(), 0);
}

/// Copy-on-write from several threads at once, each publishing after its write as the pool
/// does: every write is in the file afterwards (what a killed process leaves), whatever
/// order the publishes ran and overlapped in.
#[test]
fn concurrent_copies_and_publishes_lose_no_mapping() {
    const SIZE: u64 = 16 << 20;
    let disk = SimDisk::new(fresh_overlay("cow-threads", SIZE));
    let q = open_writable(&disk);
    let c = q.cluster_size();
    let threads = 4u64;
    let per = SIZE / c / threads;
    std::thread::scope(|s| {
        for t in 0..threads {
            let (q, disk) = (&q, &disk);
            s.spawn(move || {
                for k in 0..per {
                    // Interleaved clusters: the threads' entries share L2 chunks.
                    let cl = (k * threads + t) * c;
                    let mut fill = |_: u64, buf: &mut [u8]| {
                        buf.fill(0xbb);
                        Ok(())
                    };
                    q.write(disk, cl + 512, &[t as u8 + 1; 512], &mut fill)
                        .unwrap();
                    q.publish(disk).unwrap();
                }
            });
        }
    });
    let d = SimDisk::new(disk.crash(|| true));
    let r = Qcow2Image::open_read_only(&d).unwrap();
    for cl in 0..SIZE / c {
        let mut ext = Vec::new();
        r.map(&d, cl * c, c, &mut ext).unwrap();
        let [Extent::Data { host_offset, .. }] = ext[..] else {
            panic!("guest cluster {cl} is not mapped after its write was published: {ext:?}");
        };
        let got = read_aligned(&d, host_offset + 512, 512).unwrap();
        assert_eq!(got, vec![(cl % threads) as u8 + 1; 512], "cluster {cl}");
    }
}
