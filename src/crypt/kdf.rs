//! The key-slot key derivation functions (PBKDF2 over SHA-1/SHA-256/SHA-512, Argon2i and
//! Argon2id), the hashes LUKS names, and the limits that bound what a header may ask for.

use sha1::Sha1;
use sha2::{Digest, Sha256, Sha512};
use zeroize::Zeroizing;

use super::LuksError;

/// The most PBKDF2 iterations a key slot or digest may ask for: about 30 s of one core
/// for SHA-512 (cryptsetup's 2 s calibration gives a few million).
pub const MAX_PBKDF2_ITERATIONS: u32 = 100_000_000;
/// The most memory an Argon2 key slot may ask for: cryptsetup's own maximum (4 GiB).
pub const MAX_ARGON2_MEMORY_KIB: u32 = 4 * 1024 * 1024;
/// The most Argon2 passes over memory (memory x time), 32 passes over 4 GiB.
pub const MAX_ARGON2_WORK_KIB: u64 = 32 * 4 * 1024 * 1024;
/// The most Argon2 lanes (cryptsetup uses at most 4).
pub const MAX_ARGON2_LANES: u32 = 16;

/// A hash LUKS names (key slots, the anti-forensic splitter, digests).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Hash {
    Sha1,
    Sha256,
    Sha512,
}

impl Hash {
    pub fn parse(name: &str) -> Result<Hash, LuksError> {
        match name.to_ascii_lowercase().as_str() {
            "sha1" => Ok(Hash::Sha1),
            "sha256" => Ok(Hash::Sha256),
            "sha512" => Ok(Hash::Sha512),
            _ => Err(LuksError::Unsupported(format!(
                "hash {name:?} (vublk supports sha1, sha256 and sha512)"
            ))),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Hash::Sha1 => "sha1",
            Hash::Sha256 => "sha256",
            Hash::Sha512 => "sha512",
        }
    }

    pub fn digest_len(self) -> usize {
        match self {
            Hash::Sha1 => 20,
            Hash::Sha256 => 32,
            Hash::Sha512 => 64,
        }
    }

    /// The hash of the concatenation of `parts`, into `out` (at most [`Self::len`] bytes:
    /// the digest's prefix).
    pub fn digest_into(self, parts: &[&[u8]], out: &mut [u8]) {
        fn run<D: Digest>(parts: &[&[u8]], out: &mut [u8]) {
            let mut d = D::new();
            for p in parts {
                d.update(p);
            }
            let h = Zeroizing::new(d.finalize().to_vec());
            out.copy_from_slice(&h[..out.len()]);
        }
        match self {
            Hash::Sha1 => run::<Sha1>(parts, out),
            Hash::Sha256 => run::<Sha256>(parts, out),
            Hash::Sha512 => run::<Sha512>(parts, out),
        }
    }

    /// PBKDF2-HMAC with this hash.
    pub fn pbkdf2(
        self,
        password: &[u8],
        salt: &[u8],
        iterations: u32,
        out: &mut [u8],
    ) -> Result<(), LuksError> {
        if iterations == 0 || iterations > MAX_PBKDF2_ITERATIONS {
            return Err(LuksError::Limit(format!(
                "{iterations} PBKDF2 iterations (vublk allows 1 to {MAX_PBKDF2_ITERATIONS})"
            )));
        }
        match self {
            Hash::Sha1 => pbkdf2::pbkdf2_hmac::<Sha1>(password, salt, iterations, out),
            Hash::Sha256 => pbkdf2::pbkdf2_hmac::<Sha256>(password, salt, iterations, out),
            Hash::Sha512 => pbkdf2::pbkdf2_hmac::<Sha512>(password, salt, iterations, out),
        }
        Ok(())
    }
}

/// A key slot's KDF with its parameters.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Kdf {
    Pbkdf2 {
        hash: Hash,
        iterations: u32,
        salt: Vec<u8>,
    },
    Argon2 {
        id: bool,
        time: u32,
        memory_kib: u32,
        lanes: u32,
        salt: Vec<u8>,
    },
}

impl Kdf {
    /// Check the parameters against the limits before any work is done.
    pub fn check(&self) -> Result<(), LuksError> {
        match *self {
            Kdf::Pbkdf2 { iterations, .. } => {
                if iterations == 0 || iterations > MAX_PBKDF2_ITERATIONS {
                    return Err(LuksError::Limit(format!(
                        "{iterations} PBKDF2 iterations (vublk allows 1 to \
                         {MAX_PBKDF2_ITERATIONS})"
                    )));
                }
            }
            Kdf::Argon2 {
                time,
                memory_kib,
                lanes,
                ..
            } => {
                if memory_kib > MAX_ARGON2_MEMORY_KIB
                    || u64::from(memory_kib) * u64::from(time) > MAX_ARGON2_WORK_KIB
                    || lanes == 0
                    || lanes > MAX_ARGON2_LANES
                    || time == 0
                {
                    return Err(LuksError::Limit(format!(
                        "argon2 with {memory_kib} KiB, {time} passes, {lanes} lanes (vublk \
                         allows at most {MAX_ARGON2_MEMORY_KIB} KiB, {} KiB x passes, \
                         {MAX_ARGON2_LANES} lanes)",
                        MAX_ARGON2_WORK_KIB
                    )));
                }
            }
        }
        Ok(())
    }

    /// Derive `out.len()` bytes from `password`.
    pub fn derive(&self, password: &[u8], out: &mut [u8]) -> Result<(), LuksError> {
        self.check()?;
        match self {
            Kdf::Pbkdf2 {
                hash,
                iterations,
                salt,
            } => hash.pbkdf2(password, salt, *iterations, out),
            Kdf::Argon2 {
                id,
                time,
                memory_kib,
                lanes,
                salt,
            } => {
                let params = argon2::Params::new(*memory_kib, *time, *lanes, Some(out.len()))
                    .map_err(|e| LuksError::Corrupt(format!("argon2 parameters: {e}")))?;
                let alg = if *id {
                    argon2::Algorithm::Argon2id
                } else {
                    argon2::Algorithm::Argon2i
                };
                argon2::Argon2::new(alg, argon2::Version::V0x13, params)
                    .hash_password_into(password, salt, out)
                    .map_err(|e| LuksError::Corrupt(format!("argon2: {e}")))
            }
        }
    }
}

/// The anti-forensic merge (LUKS's AF splitter, reversed): `stripes` stripes of
/// `key.len()` bytes in `material` give back the key.
pub fn af_merge(material: &[u8], stripes: usize, hash: Hash, key: &mut [u8]) {
    let n = key.len();
    key.fill(0);
    for (i, stripe) in material.chunks_exact(n).take(stripes).enumerate() {
        for (k, s) in key.iter_mut().zip(stripe) {
            *k ^= s;
        }
        if i + 1 < stripes {
            diffuse(key, hash);
        }
    }
}

/// The anti-forensic split: `material` (stripes x key length) filled so that
/// [`af_merge`] gives `key` back; all stripes but the last are random.
pub fn af_split(
    key: &[u8],
    stripes: usize,
    hash: Hash,
    material: &mut [u8],
) -> Result<(), LuksError> {
    let n = key.len();
    let mut d = Zeroizing::new(vec![0u8; n]);
    let (random, last) = material.split_at_mut(n * (stripes - 1));
    getrandom::getrandom(random)
        .map_err(|e| LuksError::Io(std::io::Error::other(e.to_string())))?;
    for stripe in random.chunks_exact(n) {
        for (k, s) in d.iter_mut().zip(stripe) {
            *k ^= s;
        }
        diffuse(&mut d, hash);
    }
    for ((l, k), dd) in last[..n].iter_mut().zip(key).zip(d.iter()) {
        *l = k ^ dd;
    }
    Ok(())
}

/// Each hash-sized piece of `buf` replaced by the hash of its index (big-endian u32) and
/// itself; a shorter last piece by its hash's prefix.
fn diffuse(buf: &mut [u8], hash: Hash) {
    let mut out = Zeroizing::new([0u8; 64]);
    for (i, piece) in buf.chunks_mut(hash.digest_len()).enumerate() {
        let iv = (i as u32).to_be_bytes();
        hash.digest_into(&[&iv, piece], &mut out[..piece.len()]);
        piece.copy_from_slice(&out[..piece.len()]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn af_split_merge_round_trip() {
        for hash in [Hash::Sha1, Hash::Sha256, Hash::Sha512] {
            let key: Vec<u8> = (0..64u8).collect();
            let mut m = vec![0u8; 64 * 40];
            af_split(&key, 40, hash, &mut m).unwrap();
            let mut back = vec![0u8; 64];
            af_merge(&m, 40, hash, &mut back);
            assert_eq!(back, key, "{hash:?}");
        }
    }

    /// RFC 6070's PBKDF2-HMAC-SHA1 vector.
    #[test]
    fn pbkdf2_sha1_rfc6070() {
        let mut out = [0u8; 20];
        Hash::Sha1
            .pbkdf2(b"password", b"salt", 4096, &mut out)
            .unwrap();
        assert_eq!(
            out,
            [
                0x4b, 0x00, 0x79, 0x01, 0xb7, 0x65, 0x48, 0x9a, 0xbe, 0xad, 0x49, 0xd9, 0x26, 0xf7,
                0x21, 0xd0, 0x65, 0xa4, 0x29, 0xc1
            ]
        );
    }

    #[test]
    fn absurd_parameters_are_refused_before_any_work() {
        let big = Kdf::Argon2 {
            id: true,
            time: 4,
            memory_kib: u32::MAX,
            lanes: 4,
            salt: vec![0; 32],
        };
        let t = std::time::Instant::now();
        assert!(matches!(
            big.derive(b"x", &mut [0; 64]),
            Err(LuksError::Limit(_))
        ));
        let slow = Kdf::Pbkdf2 {
            hash: Hash::Sha256,
            iterations: u32::MAX,
            salt: vec![0; 32],
        };
        assert!(matches!(
            slow.derive(b"x", &mut [0; 64]),
            Err(LuksError::Limit(_))
        ));
        assert!(t.elapsed() < std::time::Duration::from_millis(100));
    }
}
