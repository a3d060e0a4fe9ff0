//! New LUKS headers (`vublk create --encrypt luks1|luks2`), laid out as cryptsetup lays
//! them out, so that cryptsetup and (LUKS1) QEMU open them: a random volume key, one key
//! slot (slot 0) holding it under the passphrase, the volume key's digest, and the data
//! segment after the key-slot area.
//!
//! LUKS1: the 592-byte header, eight slots' material areas from 4 KiB (slot 0 active),
//! data at 2 MiB. LUKS2: the binary header and 12 KiB JSON area twice (at 0 and 16 KiB),
//! the key-slot area from 32 KiB, data at 16 MiB.

use base64::Engine as _;
use serde_json::json;

use super::header::{LUKS1_HEADER, LUKS_STRIPES, MAGIC};
use super::kdf::{af_split, Hash, Kdf};
use super::xts::Xts;
use super::{LuksError, SecretBuf};

/// Which LUKS version to write.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum LuksVersion {
    Luks1,
    Luks2,
}

/// The key-slot KDF of a new volume.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum KdfChoice {
    Pbkdf2,
    Argon2i,
    Argon2id,
}

/// What to write.
#[derive(Clone, Debug)]
pub struct FormatParams {
    pub version: LuksVersion,
    /// Volume key bytes: 32 (AES-128-XTS) or 64 (AES-256-XTS).
    pub key_bytes: usize,
    /// LUKS2 encryption sector (512 to 4096; LUKS1: 512).
    pub sector_size: u32,
    pub kdf: KdfChoice,
    /// Milliseconds a key-slot unlock should take (PBKDF2's iterations are measured for it).
    pub iter_time_ms: u32,
    /// PBKDF2 iterations or Argon2 passes, instead of measuring.
    pub iterations: Option<u32>,
    /// Argon2 memory (KiB) and lanes.
    pub memory_kib: u32,
    pub lanes: u32,
}

/// A formatted header: the bytes to write at the start of the file, and where data starts.
pub struct Formatted {
    pub header: Vec<u8>,
    pub data_offset: u64,
}

const LUKS1_DATA: u64 = 2 << 20;
const LUKS2_HDR: u64 = 16 << 10;
const LUKS2_AREA: u64 = 32 << 10;
const LUKS2_DATA: u64 = 16 << 20;

fn random(n: usize) -> Result<Vec<u8>, LuksError> {
    let mut v = vec![0u8; n];
    getrandom::getrandom(&mut v)
        .map_err(|e| LuksError::Io(std::io::Error::other(e.to_string())))?;
    Ok(v)
}

fn uuid() -> Result<String, LuksError> {
    let mut b = random(16)?;
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let h: String = b.iter().map(|x| format!("{x:02x}")).collect();
    Ok(format!(
        "{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    ))
}

/// PBKDF2-SHA256 iterations that take about `ms` for an output of `out_len` bytes.
fn measure_pbkdf2(ms: u32, out_len: usize) -> u32 {
    let mut out = vec![0u8; out_len];
    let probe = 20_000u32;
    let t = std::time::Instant::now();
    let _ = Hash::Sha256.pbkdf2(b"vublk-measure", &[0u8; 32], probe, &mut out);
    let per_ms = f64::from(probe) / t.elapsed().as_secs_f64().max(1e-6) / 1000.0;
    ((per_ms * f64::from(ms)) as u64).clamp(1000, u64::from(super::kdf::MAX_PBKDF2_ITERATIONS) / 2)
        as u32
}

/// The key slot's KDF for `p` (iterations measured unless given).
fn slot_kdf(p: &FormatParams) -> Result<Kdf, LuksError> {
    let salt = random(32)?;
    Ok(match p.kdf {
        KdfChoice::Pbkdf2 => Kdf::Pbkdf2 {
            hash: Hash::Sha256,
            iterations: p
                .iterations
                .unwrap_or_else(|| measure_pbkdf2(p.iter_time_ms, p.key_bytes)),
            salt,
        },
        KdfChoice::Argon2i | KdfChoice::Argon2id => Kdf::Argon2 {
            id: p.kdf == KdfChoice::Argon2id,
            time: p.iterations.unwrap_or(4).max(1),
            memory_kib: p.memory_kib,
            lanes: p.lanes.max(1),
            salt,
        },
    })
}

/// Encrypt the volume key into a key slot's material (stripes x key bytes, padded to
/// whole sectors) under the key the passphrase derives.
fn slot_material(kdf: &Kdf, pass: &[u8], vk: &[u8]) -> Result<Vec<u8>, LuksError> {
    kdf.check()?;
    let mut slot_key = SecretBuf::zeroed(vk.len())?;
    kdf.derive(pass, slot_key.as_mut())?;
    let split = vk.len() * LUKS_STRIPES as usize;
    let mut material = vec![0u8; split.div_ceil(512) * 512];
    af_split(
        vk,
        LUKS_STRIPES as usize,
        Hash::Sha256,
        &mut material[..split],
    )?;
    let xts = Xts::new(slot_key.as_ref()).map_err(|e| LuksError::Unsupported(e.to_string()))?;
    xts.encrypt(&mut material, 512, 0, 1);
    Ok(material)
}

/// The volume key's digest (PBKDF2-SHA256, `len` bytes) with its salt and iterations.
fn key_digest(vk: &[u8], len: usize) -> Result<(Vec<u8>, Vec<u8>, u32), LuksError> {
    let salt = random(32)?;
    let iterations = measure_pbkdf2(125, vk.len()).min(1_000_000);
    let mut d = vec![0u8; len];
    Hash::Sha256.pbkdf2(vk, &salt, iterations, &mut d)?;
    Ok((d, salt, iterations))
}

/// Build a new volume's header (everything before the data) for passphrase `pass`.
pub fn format(p: &FormatParams, pass: &[u8]) -> Result<Formatted, LuksError> {
    if p.key_bytes != 32 && p.key_bytes != 64 {
        return Err(LuksError::Unsupported(format!(
            "a {}-bit key (256 or 512)",
            p.key_bytes * 8
        )));
    }
    let vk = SecretBuf::from_slice(&random(p.key_bytes)?)?;
    let kdf = slot_kdf(p)?;
    let material = slot_material(&kdf, pass, vk.as_ref())?;
    match p.version {
        LuksVersion::Luks1 => luks1(p, &kdf, &material, vk.as_ref()),
        LuksVersion::Luks2 => luks2(p, &kdf, &material, vk.as_ref()),
    }
}

fn luks1(p: &FormatParams, kdf: &Kdf, material: &[u8], vk: &[u8]) -> Result<Formatted, LuksError> {
    let Kdf::Pbkdf2 {
        iterations, salt, ..
    } = kdf
    else {
        return Err(LuksError::Unsupported(
            "LUKS1 key slots use PBKDF2 only (--kdf pbkdf2)".into(),
        ));
    };
    if p.sector_size != 512 {
        return Err(LuksError::Unsupported(
            "LUKS1 encrypts 512-byte sectors".into(),
        ));
    }
    let mut h = vec![0u8; LUKS1_DATA as usize];
    h[..6].copy_from_slice(MAGIC);
    h[6..8].copy_from_slice(&1u16.to_be_bytes());
    h[8..11].copy_from_slice(b"aes");
    h[40..51].copy_from_slice(b"xts-plain64");
    h[72..78].copy_from_slice(b"sha256");
    h[104..108].copy_from_slice(&((LUKS1_DATA / 512) as u32).to_be_bytes());
    h[108..112].copy_from_slice(&(p.key_bytes as u32).to_be_bytes());
    let (digest, dsalt, diter) = key_digest(vk, 20)?;
    h[112..132].copy_from_slice(&digest);
    h[132..164].copy_from_slice(&dsalt);
    h[164..168].copy_from_slice(&diter.to_be_bytes());
    h[168..204].copy_from_slice(uuid()?.as_bytes());
    // Each slot's material on its own 4 KiB-aligned sectors, as cryptsetup places them.
    let slot_sectors = (material.len() as u64 / 512).next_multiple_of(8);
    for i in 0..8u64 {
        let s = 208 + i as usize * 48;
        let km = 8 + i * slot_sectors;
        let (state, iter, slot_salt) = if i == 0 {
            (0x00AC_71F3u32, *iterations, &salt[..])
        } else {
            (0x0000_DEADu32, 0, &[0u8; 32][..])
        };
        h[s..s + 4].copy_from_slice(&state.to_be_bytes());
        h[s + 4..s + 8].copy_from_slice(&iter.to_be_bytes());
        h[s + 8..s + 40].copy_from_slice(slot_salt);
        h[s + 40..s + 44].copy_from_slice(&(km as u32).to_be_bytes());
        h[s + 44..s + 48].copy_from_slice(&LUKS_STRIPES.to_be_bytes());
        if (km + slot_sectors) * 512 > LUKS1_DATA {
            return Err(LuksError::Corrupt("LUKS1 key slots past the data".into()));
        }
    }
    const { assert!(LUKS1_HEADER <= 4096) };
    h[4096..4096 + material.len()].copy_from_slice(material);
    Ok(Formatted {
        header: h,
        data_offset: LUKS1_DATA,
    })
}

fn luks2(p: &FormatParams, kdf: &Kdf, material: &[u8], vk: &[u8]) -> Result<Formatted, LuksError> {
    let b64 = |b: &[u8]| base64::engine::general_purpose::STANDARD.encode(b);
    let area_size = (material.len() as u64).next_multiple_of(4096);
    let kdf_json = match kdf {
        Kdf::Pbkdf2 {
            iterations, salt, ..
        } => json!({"type": "pbkdf2", "hash": "sha256", "iterations": iterations,
                    "salt": b64(salt)}),
        Kdf::Argon2 {
            id,
            time,
            memory_kib,
            lanes,
            salt,
        } => json!({"type": if *id { "argon2id" } else { "argon2i" }, "time": time,
                    "memory": memory_kib, "cpus": lanes, "salt": b64(salt)}),
    };
    let (digest, dsalt, diter) = key_digest(vk, 32)?;
    let json_size = LUKS2_HDR - 4096;
    let doc = json!({
        "keyslots": {"0": {
            "type": "luks2",
            "key_size": p.key_bytes,
            "af": {"type": "luks1", "stripes": LUKS_STRIPES, "hash": "sha256"},
            "area": {"type": "raw", "offset": LUKS2_AREA.to_string(),
                     "size": area_size.to_string(), "encryption": "aes-xts-plain64",
                     "key_size": p.key_bytes},
            "kdf": kdf_json,
        }},
        "tokens": {},
        "segments": {"0": {
            "type": "crypt", "offset": LUKS2_DATA.to_string(), "size": "dynamic",
            "iv_tweak": "0", "encryption": "aes-xts-plain64", "sector_size": p.sector_size,
        }},
        "digests": {"0": {
            "type": "pbkdf2", "keyslots": ["0"], "segments": ["0"], "hash": "sha256",
            "iterations": diter, "salt": b64(&dsalt), "digest": b64(&digest),
        }},
        "config": {"json_size": json_size.to_string(),
                   "keyslots_size": (LUKS2_DATA - LUKS2_AREA).to_string()},
    });
    let text = serde_json::to_vec(&doc).map_err(|e| LuksError::Corrupt(e.to_string()))?;
    if text.len() >= json_size as usize {
        return Err(LuksError::Corrupt("LUKS2 JSON larger than its area".into()));
    }
    let uuid = uuid()?;
    let mut h = vec![0u8; LUKS2_DATA as usize];
    for (copy, at) in [(0usize, 0u64), (1, LUKS2_HDR)] {
        let a = at as usize;
        let hdr = &mut h[a..a + LUKS2_HDR as usize];
        hdr[..6].copy_from_slice(if copy == 0 { MAGIC } else { b"SKUL\xba\xbe" });
        hdr[6..8].copy_from_slice(&2u16.to_be_bytes());
        hdr[8..16].copy_from_slice(&LUKS2_HDR.to_be_bytes());
        hdr[16..24].copy_from_slice(&1u64.to_be_bytes());
        hdr[72..78].copy_from_slice(b"sha256");
        hdr[104..168].copy_from_slice(&random(64)?);
        hdr[168..168 + uuid.len()].copy_from_slice(uuid.as_bytes());
        hdr[256..264].copy_from_slice(&at.to_be_bytes());
        hdr[4096..4096 + text.len()].copy_from_slice(&text);
        let mut sum = [0u8; 32];
        Hash::Sha256.digest_into(&[hdr], &mut sum);
        hdr[448..480].copy_from_slice(&sum);
    }
    let a = LUKS2_AREA as usize;
    h[a..a + material.len()].copy_from_slice(material);
    Ok(Formatted {
        header: h,
        data_offset: LUKS2_DATA,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crypt::{Key, Volume};

    fn params(version: LuksVersion, kdf: KdfChoice) -> FormatParams {
        FormatParams {
            version,
            key_bytes: 64,
            sector_size: 512,
            kdf,
            iter_time_ms: 10,
            iterations: Some(if kdf == KdfChoice::Pbkdf2 { 1000 } else { 1 }),
            memory_kib: 64,
            lanes: 1,
        }
    }

    /// What `format` writes, this crate's parser opens with the passphrase (and refuses
    /// with another).
    #[test]
    fn formatted_headers_unlock() {
        for (v, k) in [
            (LuksVersion::Luks1, KdfChoice::Pbkdf2),
            (LuksVersion::Luks2, KdfChoice::Pbkdf2),
            (LuksVersion::Luks2, KdfChoice::Argon2id),
        ] {
            let f = format(&params(v, k), b"pw").unwrap();
            let mut file = f.header.clone();
            file.resize(f.header.len() + (1 << 20), 0);
            let size = file.len() as u64;
            let mut read =
                |off: u64, len: usize| Ok(file[off as usize..off as usize + len].to_vec());
            let h = crate::crypt::parse(size, &mut read).unwrap();
            assert_eq!(h.data_offset, f.data_offset);
            let key = |s: &[u8]| Key {
                secret: std::sync::Arc::new(SecretBuf::from_slice(s).unwrap()),
                raw: false,
            };
            Volume::unlock(h.clone(), &key(b"pw"), &mut read).unwrap();
            assert!(matches!(
                Volume::unlock(h, &key(b"nope"), &mut read),
                Err(LuksError::NoKeySlotMatches)
            ));
        }
    }
}
