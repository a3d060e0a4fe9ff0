//! The parallels engine on an in-memory disk: a model of writes, discards and reuse,
//! growth steps, preallocation fallbacks, and refused BATs.

use std::io;

use super::*;
use crate::image::Piece;
use crate::image::ZeroMode;
use crate::testing::MemStorage;

/// Open read-write with 512-byte metadata writes and `prealloc`.
fn rw(disk: &dyn Storage, prealloc: Option<(PreallocMode, u64)>) -> ParallelsImage {
    let opts = ParallelsOptions {
        writable: true,
        chunk: 512,
        prealloc,
    };
    ParallelsImage::open(disk, opts).unwrap()
}

const C: u64 = 65536;

fn read_guest(p: &ParallelsImage, disk: &MemStorage, off: u64, len: u64) -> Vec<u8> {
    let mut pieces = Vec::new();
    p.map(off, len, &mut pieces);
    let mut out = Vec::new();
    for x in &pieces {
        match *x {
            Piece::Data {
                host_offset, len, ..
            } => out.extend(read_aligned(disk, host_offset, len as usize).unwrap()),
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
    let p = rw(&disk, Some((PreallocMode::Falloc, 1 << 20)));
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
                p.zero_range(&disk, off, len, ZeroMode::Unmap).unwrap();
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
    let p = ParallelsImage::open(
        &disk,
        ParallelsOptions {
            chunk: 512,
            ..Default::default()
        },
    )
    .unwrap();
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
        let p = rw(&disk, prealloc);
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
    let p = rw(&disk, Some((PreallocMode::Truncate, 1 << 20)));
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
        let p = rw(&disk, Some((mode, 1 << 20)));
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
            let opts = ParallelsOptions {
                writable,
                chunk: 512,
                prealloc: None,
            };
            match ParallelsImage::open(&disk, opts) {
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

/// A killed vublk: every write and discard that completed (published, as the worker does
/// before it completes them) is found by the next process, without a flush or a close.
#[test]
fn completed_writes_survive_a_killed_process() {
    let size = 8 << 20;
    let disk = MemStorage::new(new_image(size, C).unwrap());
    let p = rw(&disk, Some((PreallocMode::Falloc, 1 << 20)));
    let mut model = vec![0u8; size as usize];
    let mut seed = 11u64;
    let mut next = || {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        seed >> 33
    };
    for round in 0..120 {
        let off = (next() % (size / 512)) * 512;
        let len = ((next() % 256 + 1) * 512).min(size - off);
        if round % 5 == 0 {
            p.zero_range(&disk, off, len, ZeroMode::Unmap).unwrap();
            model[off as usize..(off + len) as usize].fill(0);
        } else {
            let data: Vec<u8> = (0..len).map(|i| (i as u8) ^ (round as u8)).collect();
            p.write(&disk, off, &data).unwrap();
            model[off as usize..(off + len) as usize].copy_from_slice(&data);
        }
        p.publish(&disk).unwrap();
    }
    // The process is gone: what it wrote stays (no flush, no close).
    let after = MemStorage::new(disk.lock().clone());
    drop(p);
    let q = ParallelsImage::open(
        &after,
        ParallelsOptions {
            chunk: 512,
            ..Default::default()
        },
    )
    .unwrap();
    assert!(q.was_in_use);
    assert!(
        read_guest(&q, &after, 0, size) == model,
        "a completed write was lost with the process"
    );
}

/// A sparse file in the unit tests' directory: `bytes`, then holes up to `len` bytes.
fn sparse_file(tag: &str, bytes: &[u8], len: u64) -> (std::path::PathBuf, std::fs::File) {
    let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/unit-tmp");
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join(format!("parallels-{tag}-{}", std::process::id()));
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&p)
        .unwrap();
    std::os::unix::fs::FileExt::write_all_at(&f, bytes, 0).unwrap();
    f.set_len(len).unwrap();
    (p, f)
}

/// Issue 28, item 8: the BAT is held in memory, so a header claiming more entries than QEMU
/// opens is refused before anything that size is read, even in a (sparse) file holding it.
#[test]
fn a_bat_beyond_the_limit_is_refused_before_it_is_read() {
    let mut img = new_image(1 << 20, 512).unwrap();
    let nb_bat = MAX_BAT_ENTRIES + 1;
    let data_off = (HEADER_LEN + nb_bat * 4).next_multiple_of(512);
    img[32..36].copy_from_slice(&(nb_bat as u32).to_le_bytes());
    img[48..52].copy_from_slice(&((data_off / 512) as u32).to_le_bytes());
    let (p, f) = sparse_file("big-bat", &img, data_off);
    let t = std::time::Instant::now();
    let r = ParallelsImage::open(&f, ParallelsOptions::default());
    let took = t.elapsed();
    std::fs::remove_file(p).unwrap();
    match r {
        Err(e @ ParallelsError::Unsupported(_)) => {
            assert!(e.to_string().contains("at most 536870911"), "{e}")
        }
        other => panic!("{other:?}"),
    }
    assert!(took.as_millis() < 500, "the refusal took {took:?}");
}

/// Issue 28, item 8: the map of clusters in use covers the data area up to its last cluster
/// in use, not to the end of the file: 4 TiB of holes after one cluster cost nothing (one
/// flag per cluster to the end of the file was 8 GiB here), and a read-write open trims them.
#[test]
fn a_sparse_tail_costs_no_memory() {
    let mut img = new_image(1 << 20, 512).unwrap();
    let first = img.len() as u32 / 512;
    img[64..68].copy_from_slice(&first.to_le_bytes());
    img.extend_from_slice(&[0x5a; 512]);
    let (p, f) = sparse_file("sparse-tail", &img, 4 << 40);
    let used = |q: &ParallelsImage| q.lock().used.len();
    let ro = ParallelsImage::open(&f, ParallelsOptions::default()).unwrap();
    assert_eq!(used(&ro), 1, "read-only");
    let opts = ParallelsOptions {
        writable: true,
        chunk: 512,
        prealloc: None,
    };
    let q = ParallelsImage::open(&f, opts).unwrap();
    assert_eq!(used(&q), 1, "read-write");
    q.close(&f).unwrap();
    let len = f.metadata().unwrap().len();
    std::fs::remove_file(p).unwrap();
    assert_eq!(len, img.len() as u64, "the holes were not trimmed");
}
