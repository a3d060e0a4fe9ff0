//! Header and mapping checks on hand-built images; the engine's model and crash tests are
//! in `crash_tests` and `model_tests`.

use super::header::off;
use super::*;
use crate::image::fuzz::qcow2_open;
use crate::image::ImageError;
use crate::testing::MemStorage;
use proptest::prelude::*;
use std::fs::File;
use std::path::PathBuf;

fn temp(tag: &str, bytes: &[u8]) -> (PathBuf, File) {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/unit-tmp");
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join(format!("qcow2-{tag}-{}", std::process::id()));
    std::fs::write(&p, bytes).unwrap();
    let f = File::open(&p).unwrap();
    (p, f)
}

/// A minimal valid v3 header: 64 KiB clusters, 512 MiB (one L1 entry), L1 at 0x30000
/// with one entry pointing at an L2 table at 0x40000.
fn header() -> Vec<u8> {
    let mut h = vec![0u8; 0x50000];
    let put32 = |h: &mut [u8], at: usize, v: u32| h[at..at + 4].copy_from_slice(&v.to_be_bytes());
    let put64 = |h: &mut [u8], at: usize, v: u64| h[at..at + 8].copy_from_slice(&v.to_be_bytes());
    h[off::MAGIC..off::MAGIC + 4].copy_from_slice(&MAGIC);
    put32(&mut h, off::VERSION, 3);
    put32(&mut h, off::CLUSTER_BITS, 16); // 64 KiB clusters
    put64(&mut h, off::SIZE, 1 << 29); // 512 MiB: one L1 entry
    put32(&mut h, off::L1_SIZE, 1);
    put64(&mut h, off::L1_TABLE_OFFSET, 0x30000);
    put32(&mut h, off::HEADER_LENGTH, 104);
    // L1[0] -> the L2 table at 0x40000.
    put64(&mut h, 0x30000, 0x40000);
    h
}

#[test]
fn valid_header_maps_unallocated_and_allocated_clusters() {
    let mut h = header();
    // Guest cluster 1 -> host cluster at 0x40000 (the L2 table itself, fine for mapping).
    h[0x40008..0x40010].copy_from_slice(&0x40000u64.to_be_bytes());
    // Guest cluster 2: zero flag.
    h[0x40010..0x40018].copy_from_slice(&1u64.to_be_bytes());
    let (p, f) = temp("valid", &h);
    let q = Qcow2Image::open_read_only(&f).unwrap();
    let mut out = Vec::new();
    q.map(&f, 0, 3 * 65536, &mut out).unwrap();
    assert_eq!(
        out,
        vec![
            Extent::Unallocated { len: 65536 },
            Extent::Data {
                host_offset: 0x40000,
                len: 65536
            },
            Extent::Zero { len: 65536 },
        ]
    );
    std::fs::remove_file(p).unwrap();
}

#[test]
fn huge_l1_is_refused_not_allocated() {
    let mut h = header();
    h[off::L1_SIZE..off::L1_SIZE + 4].copy_from_slice(&u32::MAX.to_be_bytes());
    let (p, f) = temp("huge-l1", &h);
    assert!(matches!(
        Qcow2Image::open_read_only(&f),
        Err(Qcow2Error::L1Size(_))
    ));
    std::fs::remove_file(p).unwrap();
}

#[test]
fn l2_pointing_outside_the_file_is_an_error_not_a_read() {
    let mut h = header();
    h[0x30000..0x30008].copy_from_slice(&(1u64 << 40).to_be_bytes());
    let (p, f) = temp("l2-out", &h);
    let q = Qcow2Image::open_read_only(&f).unwrap();
    let mut out = Vec::new();
    assert!(matches!(
        q.map(&f, 0, 4096, &mut out),
        Err(ImageError::Corrupt(_))
    ));
    std::fs::remove_file(p).unwrap();
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    /// Arbitrary header fields and table entries: opening and mapping never panic, and
    /// every data extent lies inside the file.
    #[test]
    fn arbitrary_images_never_panic(
        fields in proptest::collection::vec((0usize..112, any::<u8>()), 0..24),
        l1e in any::<u64>(),
        l2es in proptest::collection::vec(any::<u64>(), 4),
        off in 0u64..(1 << 30),
    ) {
        let mut h = header();
        for (i, b) in fields {
            if i >= 4 { h[i] = b; }
        }
        if l1e % 3 == 0 { h[0x30000..0x30008].copy_from_slice(&l1e.to_be_bytes()); }
        for (i, e) in l2es.iter().enumerate() {
            h[0x40000 + i * 8..0x40008 + i * 8].copy_from_slice(&e.to_be_bytes());
        }
        let (p, f) = temp("fuzz", &h);
        if let Ok(q) = Qcow2Image::open_read_only(&f) {
            let size = q.size_bytes();
            if size > 0 {
                let start = off % size;
                let len = (size - start).min(4 * 65536);
                let mut out = Vec::new();
                if q.map(&f, start, len, &mut out).is_ok() {
                    let total: u64 = out.iter().map(|e| e.len()).sum();
                    prop_assert_eq!(total, len);
                    for e in &out {
                        if let Extent::Data { host_offset, len } = *e {
                            prop_assert!(host_offset + len <= h.len() as u64 + q.cluster_size());
                        }
                    }
                }
            }
        }
        std::fs::remove_file(p).unwrap();
    }
}

fn rw() -> Qcow2Options {
    Qcow2Options {
        writable: true,
        ..Qcow2Options::default()
    }
}

fn be64(b: &[u8], o: usize) -> u64 {
    u64::from_be_bytes(b[o..o + 8].try_into().unwrap())
}

fn seed() -> Vec<u8> {
    let p = crate::testing::fresh_qcow2("directed", Compression::Zlib);
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
        if let Ok(q) = Qcow2Image::open(&disk, rw()) {
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

/// A read-write open cuts off a tail that nothing uses, but never a cluster an L2 entry
/// points at, even when its refcount says it is free (broken refcounts).
#[test]
fn open_keeps_referenced_clusters_past_the_last_refcount() {
    let p = crate::testing::fresh_qcow2("tail", Compression::Zlib);
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&p)
        .unwrap();
    let q = Qcow2Image::open(&f, rw()).unwrap();
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
    let q = Qcow2Image::open(&disk, rw()).unwrap();
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

/// What [`hostile_image`] puts in its file.
struct Hostile {
    snapshots: u32,
    /// Bytes each snapshot's L1 table claims.
    snap_l1_bytes: u64,
    /// Extra data in each snapshot table entry.
    snap_extra: u32,
    refcount_table_clusters: u32,
}

/// A sparse qcow2 file built from its header's claims: 512-byte clusters, a 512-byte disk
/// (one L1 entry, no L2 table), an empty refcount table, and snapshot table entries whose L1
/// tables follow one another from the first MiB after the table. Only the header and the
/// table hold data; the L1 tables are holes.
fn hostile_image(tag: &str, spec: Hostile) -> (PathBuf, File) {
    use super::header::{put32, put64, snap, Header};
    use std::os::unix::fs::FileExt;
    const C: u64 = 512;
    let rt_at = 2 * C;
    let table_at = rt_at + u64::from(spec.refcount_table_clusters) * C;
    let entry_len = (snap::FIXED_LEN as u64 + u64::from(spec.snap_extra)).next_multiple_of(8);
    let table_len = u64::from(spec.snapshots) * entry_len;
    let l1s_at = (table_at + table_len).next_multiple_of(1 << 20) + (1 << 20);
    let mut h = Header::new_v3(9, C, Compression::Zlib);
    h.l1_size = 1;
    h.l1_table_offset = C;
    h.refcount_table_offset = rt_at;
    h.refcount_table_clusters = spec.refcount_table_clusters;
    h.nb_snapshots = spec.snapshots;
    h.snapshots_offset = table_at;
    let mut first = vec![0u8; C as usize];
    h.write_to(&mut first);
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/unit-tmp");
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join(format!("qcow2-{tag}-{}", std::process::id()));
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&p)
        .unwrap();
    f.write_all_at(&first, 0).unwrap();
    // The fixed part of each entry; the extra data is a hole (zeroes).
    let mut e = [0u8; snap::FIXED_LEN];
    for i in 0..u64::from(spec.snapshots) {
        put64(
            &mut e,
            snap::L1_TABLE_OFFSET,
            l1s_at + i * spec.snap_l1_bytes,
        );
        put32(&mut e, snap::L1_SIZE, (spec.snap_l1_bytes / 8) as u32);
        put32(&mut e, snap::EXTRA_DATA_SIZE, spec.snap_extra);
        f.write_all_at(&e, table_at + i * entry_len).unwrap();
    }
    let end = l1s_at + u64::from(spec.snapshots) * spec.snap_l1_bytes;
    f.set_len(end.max(table_at + table_len)).unwrap();
    (p, f)
}

/// Issue 28, item 8: 1,024 internal snapshots whose L1 tables claim 32 MiB each (a 32 GiB
/// sparse file) once took 1.7 GB and over a minute to open read-write (a set entry per
/// claimed cluster). Each table now costs one entry, and the open is quick.
#[test]
fn many_huge_snapshot_l1_tables_open_quickly() {
    let (p, f) = hostile_image(
        "snap-l1",
        Hostile {
            snapshots: 1024,
            snap_l1_bytes: MAX_L1_BYTES,
            snap_extra: 0,
            refcount_table_clusters: 1,
        },
    );
    let t = std::time::Instant::now();
    let q = Qcow2Image::open(&f, rw()).unwrap();
    let took = t.elapsed();
    let entries = q.metadata.read().unwrap().entries();
    std::fs::remove_file(p).unwrap();
    assert!(
        entries <= 1024 + 4,
        "{entries} metadata entries for 1024 tables"
    );
    assert!(took.as_secs() < 5, "the open took {took:?}");
}

/// The limits an image header is held to (QEMU's): each refused at a read-write open, with
/// the limit named, before anything of that size is read or walked. A read-only open does
/// not look at snapshots or the refcount table, and still serves the image.
#[test]
fn header_claims_beyond_the_limits_are_refused() {
    let base = Hostile {
        snapshots: 1,
        snap_l1_bytes: 512,
        snap_extra: 0,
        refcount_table_clusters: 1,
    };
    let cases = [
        (
            "many-snaps",
            Hostile {
                snapshots: 65_537,
                ..base
            },
            "more than 65536 internal snapshots",
        ),
        (
            "big-snap-l1",
            Hostile {
                snap_l1_bytes: MAX_L1_BYTES + 512,
                ..base
            },
            "a snapshot L1 table larger than 32 MiB",
        ),
        (
            "big-snap-table",
            Hostile {
                snapshots: 3,
                snap_extra: 30 << 20,
                ..base
            },
            "a snapshot table larger than 64 MiB",
        ),
        (
            "big-rt",
            Hostile {
                refcount_table_clusters: (8 << 20) / 512 + 1,
                ..base
            },
            "a refcount table larger than 8 MiB",
        ),
    ];
    for (tag, spec, limit) in cases {
        let (p, f) = hostile_image(tag, spec);
        let t = std::time::Instant::now();
        let r = Qcow2Image::open(&f, rw());
        let took = t.elapsed();
        let ro = Qcow2Image::open_read_only(&f).map(|q| q.size_bytes());
        std::fs::remove_file(p).unwrap();
        match r {
            Err(Qcow2Error::Limit(m)) => assert_eq!(m, limit, "{tag}"),
            other => panic!("{tag}: {other:?}"),
        }
        assert!(took.as_secs() < 2, "{tag}: the refusal took {took:?}");
        assert_eq!(ro.unwrap(), 512, "{tag}: read-only");
    }
}

#[test]
fn sub_mask_names_the_subclusters() {
    use super::map::sub_mask;
    assert_eq!(sub_mask(0, 32), 0xffff_ffff);
    assert_eq!(sub_mask(3, 2), 0b11000);
    assert_eq!(sub_mask(31, 1), 1 << 31);
    assert_eq!(sub_mask(5, 0), 0);
}

/// Extended L2 entries on a hand-built image: each subcluster maps as data, zero or
/// unallocated; the plain view of a mixed cluster is one every write path copies; bitmaps
/// that contradict themselves or their entry are refused, not followed.
#[test]
fn extended_l2_entries_map_each_subcluster_and_refuse_contradictions() {
    let mut h = header();
    let put64 = |h: &mut [u8], at: usize, v: u64| h[at..at + 8].copy_from_slice(&v.to_be_bytes());
    put64(&mut h, off::INCOMPATIBLE_FEATURES, header::INCOMPAT_EXTL2);
    // An L2 table of 16-byte entries maps 256 MiB: one L1 entry.
    put64(&mut h, off::SIZE, 1 << 28);
    let copied = 1u64 << 63;
    // Cluster 0: subclusters 0-1 allocated, 2 zero, the rest unallocated.
    put64(&mut h, 0x40000, 0x40000 | copied);
    put64(&mut h, 0x40008, 0b11 | (0b100 << 32));
    // Cluster 1: subcluster 0 both allocated and zero.
    put64(&mut h, 0x40010, 0x40000 | copied);
    put64(&mut h, 0x40018, 1 | (1 << 32));
    // Cluster 2: allocated subclusters without a host cluster.
    put64(&mut h, 0x40028, 0b1);
    // Cluster 3: every subcluster zero, no host cluster.
    put64(&mut h, 0x40038, 0xffff_ffff << 32);
    let (p, f) = temp("extl2", &h);
    let q = Qcow2Image::open_read_only(&f).unwrap();
    assert!(q.extended_l2());
    let mut out = Vec::new();
    q.map(&f, 0, 65536, &mut out).unwrap();
    assert_eq!(
        out,
        vec![
            Extent::Data {
                host_offset: 0x40000,
                len: 4096
            },
            Extent::Zero { len: 2048 },
            Extent::Unallocated { len: 65536 - 6144 },
        ]
    );
    // A read inside one subcluster.
    q.map(&f, 4096 + 512, 1024, &mut out).unwrap();
    assert_eq!(out, vec![Extent::Zero { len: 1024 }]);
    // The plain view: mixed, so not owned (not COPIED) and not zero.
    let view = q.l2_entry(&f, 0).unwrap();
    assert_eq!(view & map::L2_OFFSET_MASK, 0x40000);
    assert_eq!(view & (map::L2_COPIED | map::L2_ZERO), 0);
    assert_eq!(q.l2_entry(&f, 3 * 65536).unwrap(), map::L2_ZERO);
    for cl in [1u64, 2] {
        assert!(matches!(
            q.map(&f, cl * 65536, 4096, &mut out),
            Err(ImageError::Corrupt(_))
        ));
    }
    q.map(&f, 3 * 65536, 65536, &mut out).unwrap();
    assert_eq!(out, vec![Extent::Zero { len: 65536 }]);
    let _ = std::fs::remove_file(p);
}

#[test]
fn extended_l2_needs_16k_clusters() {
    let mut h = header();
    h[off::INCOMPATIBLE_FEATURES..off::INCOMPATIBLE_FEATURES + 8]
        .copy_from_slice(&header::INCOMPAT_EXTL2.to_be_bytes());
    h[off::CLUSTER_BITS..off::CLUSTER_BITS + 4].copy_from_slice(&13u32.to_be_bytes());
    assert!(matches!(
        header::Header::parse(&h),
        Err(Qcow2Error::ExtendedL2(13))
    ));
}
