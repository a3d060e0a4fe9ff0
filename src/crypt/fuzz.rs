//! Fuzzing entry point: arbitrary bytes as the start of a LUKS volume (either version),
//! parsed and, where the header asks only for cheap key derivation, unlocked with a fixed
//! passphrase and its cipher run once. Whatever the bytes: no panic, reads only inside the
//! file, time and memory bounded by the header limits (`kdf`).

use std::io;
use std::sync::Arc;

use super::kdf::Kdf;
use super::{parse, Key, SecretBuf, Volume};

/// `data` as a whole file.
pub fn header(data: &[u8]) {
    header_in(data, data.len() as u64);
}

/// `data` as the first bytes of a file of `size` bytes (zeroes after them).
pub fn header_in(data: &[u8], size: u64) {
    let mut read = |off: u64, len: usize| -> io::Result<Vec<u8>> {
        let end = off
            .checked_add(len as u64)
            .filter(|&e| e <= size)
            .ok_or_else(|| io::Error::from(io::ErrorKind::UnexpectedEof))?;
        let mut out = vec![0u8; len];
        let have = (data.len() as u64).min(end);
        if off < have {
            out[..(have - off) as usize].copy_from_slice(&data[off as usize..have as usize]);
        }
        Ok(out)
    };
    let Ok(h) = parse(size, &mut read) else {
        return;
    };
    assert!(h.data_offset <= size, "a data segment past the file");
    assert!(matches!(h.key_bytes, 32 | 64));
    // The limits allow seconds of work per slot; the fuzzer only unlocks cheap ones.
    let cheap = h.digest.iterations <= 5000
        && h.slots.iter().all(|s| match s.kdf {
            Kdf::Pbkdf2 { iterations, .. } => iterations <= 5000,
            Kdf::Argon2 {
                time, memory_kib, ..
            } => u64::from(time) * u64::from(memory_kib) <= 1 << 16,
        });
    if !cheap {
        return;
    }
    let key = Key {
        secret: Arc::new(SecretBuf::from_slice(b"fuzz passphrase").expect("memory")),
        raw: false,
    };
    if let Ok(v) = Volume::unlock(h, &key, &mut read) {
        let s = v.sector_size() as usize;
        let mut buf = vec![7u8; 2 * s];
        let at = v.header.data_offset;
        v.encrypt(&mut buf, at);
        v.decrypt(&mut buf, at);
        assert!(buf.iter().all(|&b| b == 7), "decrypt(encrypt(x)) != x");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crypt::format::{format, FormatParams, KdfChoice, LuksVersion};
    use proptest::prelude::*;

    fn volume(version: LuksVersion, kdf: KdfChoice) -> (Vec<u8>, u64) {
        let p = FormatParams {
            version,
            key_bytes: 64,
            sector_size: 512,
            kdf,
            iter_time_ms: 1,
            iterations: Some(if kdf == KdfChoice::Pbkdf2 { 1000 } else { 1 }),
            memory_kib: 64,
            lanes: 1,
        };
        let f = format(&p, b"fuzz passphrase").unwrap();
        // The header and the first key slot's material: what a parser reads.
        let head = f.header[..(320 << 10).min(f.header.len())].to_vec();
        (head, f.data_offset + (1 << 20))
    }

    /// The real headers parse and unlock through the entry point.
    #[test]
    fn formatted_volumes_unlock_through_the_entry_point() {
        for (v, k) in [
            (LuksVersion::Luks1, KdfChoice::Pbkdf2),
            (LuksVersion::Luks2, KdfChoice::Argon2id),
        ] {
            let (head, size) = volume(v, k);
            header_in(&head, size);
            let mut read = |off: u64, len: usize| {
                let mut out = vec![0u8; len];
                let have = head.len().min(off as usize + len);
                if (off as usize) < have {
                    out[..have - off as usize].copy_from_slice(&head[off as usize..have]);
                }
                Ok(out)
            };
            let h = parse(size, &mut read).unwrap();
            let key = Key {
                secret: Arc::new(SecretBuf::from_slice(b"fuzz passphrase").unwrap()),
                raw: false,
            };
            Volume::unlock(h, &key, &mut read).unwrap();
        }
    }

    /// The fuzz target's seeds (cryptsetup's volumes, shrunk: data right after the key
    /// slot) open through the entry point's reads.
    #[test]
    fn corpus_seeds_unlock() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus/luks_header");
        for name in ["luks1-aes128", "luks2-aes128-pbkdf2"] {
            let data = std::fs::read(dir.join(name)).unwrap();
            header(&data);
            let size = data.len() as u64;
            let mut read =
                |off: u64, len: usize| Ok(data[off as usize..off as usize + len].to_vec());
            let h = parse(size, &mut read).unwrap();
            let key = Key {
                secret: Arc::new(SecretBuf::from_slice(b"fuzz passphrase").unwrap()),
                raw: false,
            };
            Volume::unlock(h, &key, &mut read).unwrap_or_else(|e| panic!("{name}: {e}"));
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(192))]

        /// Mutated LUKS1 and LUKS2 headers (bytes of the binary header, the JSON area and
        /// the key material): no panic, bounded time.
        #[test]
        fn mutated_headers_never_panic(
            v2 in any::<bool>(),
            edits in proptest::collection::vec((0usize..20_000, any::<u8>()), 1..24),
            cut in proptest::option::of(0usize..400_000),
        ) {
            // Formatted once (formatting measures PBKDF2 for the digest).
            static VOLUMES: std::sync::OnceLock<[(Vec<u8>, u64); 2]> = std::sync::OnceLock::new();
            let vols = VOLUMES.get_or_init(|| {
                [
                    volume(LuksVersion::Luks1, KdfChoice::Pbkdf2),
                    volume(LuksVersion::Luks2, KdfChoice::Pbkdf2),
                ]
            });
            let (mut head, size) = vols[usize::from(v2)].clone();
            for (at, b) in edits {
                let at = if v2 { at } else { at % 4096 };
                if at < head.len() {
                    head[at] = b;
                }
            }
            let size = cut.map_or(size, |c| c as u64);
            let t = std::time::Instant::now();
            header_in(&head, size);
            prop_assert!(t.elapsed() < std::time::Duration::from_secs(5));
        }

        /// Arbitrary bytes behind each magic.
        #[test]
        fn arbitrary_bytes_never_panic(
            version in 0u16..4,
            body in proptest::collection::vec(any::<u8>(), 0..9000),
        ) {
            let mut data = b"LUKS\xba\xbe".to_vec();
            data.extend_from_slice(&version.to_be_bytes());
            data.extend_from_slice(&body);
            header(&data);
        }
    }
}
