//! Fuzzing entry points (`fuzz/` runs them under libFuzzer with `cargo +nightly fuzz`; the
//! test suite runs them on generated inputs). Each opens arbitrary bytes as an image in
//! memory and uses it: nothing may panic, no read may start past the end of the file (the
//! in-memory file checks), the file may only grow by what allocation needs, and memory stays
//! bounded (a huge L1 or refcount table is refused, never allocated).

use super::prealloc::PreallocParams;
use super::qcow2::{Extent, Qcow2Image, Qcow2Options};
use super::ZeroMode;
use crate::io::aligned::read_aligned;
use crate::testing::MemStorage;

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
        let opts = Qcow2Options {
            writable,
            l2_cache_bytes: Some(0),
            prealloc: Some(PreallocParams {
                size: 1 << 20,
                align: 1 << 16,
                file_align: 512,
            }),
            ..Qcow2Options::default()
        };
        let Ok(q) = Qcow2Image::open(&disk, opts) else {
            continue;
        };
        let size = q.size_bytes();
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
    use super::parallels::{ParallelsImage, ParallelsOptions, PreallocMode};
    let (ops, image) = data.split_at(data.len().min(16));
    let pick = |i: usize| {
        u64::from_le_bytes(std::array::from_fn(|k| {
            ops.get(i * 8 + k).copied().unwrap_or(0)
        }))
    };
    for writable in [false, true] {
        let disk = MemStorage::new(image.to_vec());
        let mode = if pick(0) & 1 == 0 {
            PreallocMode::Falloc
        } else {
            PreallocMode::Truncate
        };
        let opts = ParallelsOptions {
            writable,
            chunk: 512,
            prealloc: (pick(1) & 2 == 0).then_some((mode, 1 << 20)),
        };
        let Ok(p) = ParallelsImage::open(&disk, opts) else {
            continue;
        };
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
                if let super::Piece::Data {
                    host_offset, len, ..
                } = *x
                {
                    let mut b = vec![0u8; len as usize];
                    let _ =
                        read_aligned(&disk, host_offset, b.len()).map(|v| b.copy_from_slice(&v));
                }
            }
            if writable {
                let _ = p.write(&disk, off, &vec![0x5au8; len as usize]);
                let mode = if i == 0 {
                    ZeroMode::Unmap
                } else {
                    ZeroMode::Keep
                };
                let _ = p.zero_range(&disk, off & !(c - 1), c, mode);
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

    fn make_seed() -> Vec<u8> {
        let p = crate::testing::fresh_qcow2("seed", crate::image::qcow2::Compression::Zlib);
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&p)
            .unwrap();
        let q = Qcow2Image::open(
            &f,
            Qcow2Options {
                writable: true,
                ..Default::default()
            },
        )
        .unwrap();
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
                d[16..20].copy_from_slice(&crate::image::qcow2::MAGIC);
            }
            qcow2_open(&d);
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]
        #[test]
        fn mutated_parallels_images_never_panic(
            flips in proptest::collection::vec((0usize..1024, any::<u8>()), 1..12),
            ops in proptest::collection::vec(any::<u8>(), 16),
        ) {
            let mut img = crate::image::parallels::new_image(2 << 20, 4096).unwrap();
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
