//! LUKS headers, both versions, parsed into one [`Header`]: the data segment (where the
//! encrypted data starts, its sector size and IV offset), the key slots (KDF, where their
//! key material is, its anti-forensic stripes) and the digest that tells the right volume
//! key. Everything in a header is untrusted: sizes and offsets are checked against the
//! file, every parameter against vublk's limits, before anything is read or computed.
//!
//! LUKS1: the 592-byte header of the LUKS1 on-disk format (cryptsetup's and QEMU's). LUKS2:
//! the binary header (4 KiB) and its JSON area, twice (primary at 0, secondary after it);
//! a header whose checksum fails is not used, the valid one with the higher sequence id is.

use base64::Engine as _;
use serde_json::Value;

use super::kdf::{Hash, Kdf};
use super::LuksError;

pub const MAGIC: &[u8; 6] = b"LUKS\xba\xbe";
const MAGIC2_SECONDARY: &[u8; 6] = b"SKUL\xba\xbe";
/// LUKS1's header length.
pub const LUKS1_HEADER: usize = 592;
/// LUKS1's anti-forensic stripes (the on-disk format fixes them).
pub const LUKS_STRIPES: u32 = 4000;
const LUKS1_SLOTS: usize = 8;
const LUKS1_SLOT_ACTIVE: u32 = 0x00AC_71F3;
const LUKS1_SLOT_INACTIVE: u32 = 0x0000_DEAD;
/// LUKS2's binary header length.
const LUKS2_BINARY: usize = 4096;
/// LUKS2 header sizes (binary + JSON) the format allows.
const LUKS2_SIZES: [u64; 9] = [
    16 << 10,
    32 << 10,
    64 << 10,
    128 << 10,
    256 << 10,
    512 << 10,
    1 << 20,
    2 << 20,
    4 << 20,
];

/// The one cipher vublk serves.
pub const CIPHER: &str = "aes-xts-plain64";

/// A parsed LUKS header.
#[derive(Clone, Debug)]
pub struct Header {
    pub version: u8,
    /// Volume key bytes (32: AES-128-XTS, 64: AES-256-XTS).
    pub key_bytes: usize,
    /// Where the encrypted data starts in the file (bytes).
    pub data_offset: u64,
    /// Its length, None: to the end of the file.
    pub data_size: Option<u64>,
    /// Encryption sector (512 to 4096 bytes).
    pub sector_size: u32,
    /// Added to every sector's IV (LUKS2 `iv_tweak`, in 512-byte units).
    pub iv_tweak: u64,
    pub slots: Vec<Slot>,
    pub digest: KeyDigest,
    pub uuid: String,
}

/// One active key slot.
#[derive(Clone, Debug)]
pub struct Slot {
    pub index: u32,
    pub kdf: Kdf,
    /// Where its encrypted key material starts in the file (bytes), and its length.
    pub area_offset: u64,
    pub area_size: u64,
    /// The volume key's length (bytes): the material is that many bytes per stripe.
    pub key_bytes: usize,
    /// The key material's own aes-xts key length (bytes).
    pub area_key_bytes: usize,
    pub stripes: u32,
    pub af_hash: Hash,
}

/// What the right volume key gives through PBKDF2.
#[derive(Clone, Debug)]
pub struct KeyDigest {
    pub hash: Hash,
    pub iterations: u32,
    pub salt: Vec<u8>,
    pub digest: Vec<u8>,
}

fn corrupt(what: impl Into<String>) -> LuksError {
    LuksError::Corrupt(what.into())
}

/// A NUL-terminated string field.
fn c_str(b: &[u8]) -> String {
    let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
    String::from_utf8_lossy(&b[..end]).into_owned()
}

fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn be64(b: &[u8], at: usize) -> u64 {
    u64::from_be_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// Refuse every cipher but aes-xts-plain64, naming it.
fn check_cipher(cipher: &str, key_bytes: usize) -> Result<(), LuksError> {
    if !cipher.eq_ignore_ascii_case(CIPHER) {
        return Err(LuksError::Unsupported(format!(
            "cipher {cipher:?} (vublk serves {CIPHER} only)"
        )));
    }
    if key_bytes != 32 && key_bytes != 64 {
        return Err(LuksError::Unsupported(format!(
            "a {}-bit {CIPHER} key (vublk serves 256 and 512-bit keys: AES-128 and AES-256)",
            key_bytes * 8
        )));
    }
    Ok(())
}

/// The LUKS version in the first bytes of a file, if it is LUKS at all.
pub fn version(first: &[u8]) -> Option<u16> {
    (first.len() >= 8 && &first[..6] == MAGIC).then(|| u16::from_be_bytes([first[6], first[7]]))
}

/// Parse a LUKS1 header (its first [`LUKS1_HEADER`] bytes); `file_size` bounds offsets.
pub fn parse_luks1(b: &[u8], file_size: u64) -> Result<Header, LuksError> {
    if b.len() < LUKS1_HEADER || version(b) != Some(1) {
        return Err(corrupt("not a LUKS1 header"));
    }
    let cipher = format!("{}-{}", c_str(&b[8..40]), c_str(&b[40..72]));
    let hash = Hash::parse(&c_str(&b[72..104]))?;
    let data_offset = u64::from(be32(b, 104)) * 512;
    let key_bytes = be32(b, 108) as usize;
    check_cipher(&cipher, key_bytes)?;
    let digest = KeyDigest {
        hash,
        iterations: be32(b, 164),
        salt: b[132..164].to_vec(),
        digest: b[112..132].to_vec(),
    };
    let mut slots = Vec::new();
    for i in 0..LUKS1_SLOTS {
        let s = &b[208 + i * 48..208 + (i + 1) * 48];
        match be32(s, 0) {
            LUKS1_SLOT_INACTIVE => continue,
            LUKS1_SLOT_ACTIVE => {}
            other => return Err(corrupt(format!("key slot {i}: state {other:#x}"))),
        }
        let stripes = be32(s, 44);
        let slot = Slot {
            index: i as u32,
            kdf: Kdf::Pbkdf2 {
                hash,
                iterations: be32(s, 4),
                salt: s[8..40].to_vec(),
            },
            area_offset: u64::from(be32(s, 40)) * 512,
            area_size: (key_bytes as u64 * u64::from(stripes)).div_ceil(512) * 512,
            key_bytes,
            area_key_bytes: key_bytes,
            stripes,
            af_hash: hash,
        };
        check_slot(&slot, data_offset, file_size)?;
        slots.push(slot);
    }
    let header = Header {
        version: 1,
        key_bytes,
        data_offset,
        data_size: None,
        sector_size: 512,
        iv_tweak: 0,
        slots,
        digest,
        uuid: c_str(&b[168..208]),
    };
    check_header(&header, file_size)?;
    Ok(header)
}

/// A key slot's material inside the file and below the data; sane stripes.
fn check_slot(s: &Slot, data_offset: u64, file_size: u64) -> Result<(), LuksError> {
    if s.stripes == 0 || s.stripes > LUKS_STRIPES {
        return Err(corrupt(format!(
            "key slot {}: {} anti-forensic stripes (1 to {LUKS_STRIPES})",
            s.index, s.stripes
        )));
    }
    let need = s.key_bytes as u64 * u64::from(s.stripes);
    let end = s.area_offset.checked_add(s.area_size);
    if s.area_size < need || end.is_none_or(|e| e > file_size || e > data_offset) {
        return Err(corrupt(format!(
            "key slot {}: key material at {} ({} bytes) outside the header area or the file",
            s.index, s.area_offset, s.area_size
        )));
    }
    if s.area_offset < LUKS1_HEADER as u64 {
        return Err(corrupt(format!(
            "key slot {}: key material inside the header",
            s.index
        )));
    }
    s.kdf.check()?;
    Ok(())
}

fn check_header(h: &Header, file_size: u64) -> Result<(), LuksError> {
    if h.data_offset > file_size {
        return Err(LuksError::Truncated {
            need: h.data_offset,
            have: file_size,
        });
    }
    if h.digest.iterations == 0 || h.digest.iterations > super::kdf::MAX_PBKDF2_ITERATIONS {
        return Err(LuksError::Limit(format!(
            "{} PBKDF2 iterations for the volume key digest",
            h.digest.iterations
        )));
    }
    if h.digest.digest.is_empty() || h.digest.digest.len() > 64 {
        return Err(corrupt("volume key digest length"));
    }
    Ok(())
}

/// Parse a LUKS2 header from the file's first bytes (`head`: at least 4 KiB; `read` reads
/// more of the file: offset, length).
pub fn parse_luks2(
    file_size: u64,
    read: &mut dyn FnMut(u64, usize) -> std::io::Result<Vec<u8>>,
) -> Result<Header, LuksError> {
    let mut best: Option<(u64, Vec<u8>)> = None;
    let mut first_error = None;
    // The primary at 0, then the secondary at each offset the format allows (its own
    // header says which, but the primary may be the damaged one).
    let mut candidates = vec![0u64];
    candidates.extend(LUKS2_SIZES);
    for at in candidates {
        if at + LUKS2_BINARY as u64 > file_size {
            break;
        }
        match read_luks2_area(at, file_size, read) {
            Ok(Some((seqid, json))) => {
                if best.as_ref().is_none_or(|(s, _)| seqid > *s) {
                    best = Some((seqid, json));
                }
            }
            Ok(None) => {}
            Err(e) => {
                first_error.get_or_insert(e);
            }
        }
    }
    let Some((_, json)) = best else {
        return Err(first_error.unwrap_or_else(|| corrupt("no valid LUKS2 header")));
    };
    parse_luks2_json(&json, file_size)
}

/// The header at `at` (primary or secondary): Some((seqid, JSON bytes)) when its magic,
/// size and checksum are right.
fn read_luks2_area(
    at: u64,
    file_size: u64,
    read: &mut dyn FnMut(u64, usize) -> std::io::Result<Vec<u8>>,
) -> Result<Option<(u64, Vec<u8>)>, LuksError> {
    let bin = read(at, LUKS2_BINARY)?;
    let magic: &[u8; 6] = if at == 0 { MAGIC } else { MAGIC2_SECONDARY };
    if &bin[..6] != magic || u16::from_be_bytes([bin[6], bin[7]]) != 2 {
        return Ok(None);
    }
    let hdr_size = be64(&bin, 8);
    if !LUKS2_SIZES.contains(&hdr_size) {
        return Err(corrupt(format!("LUKS2 header size {hdr_size}")));
    }
    if be64(&bin, 256) != at {
        return Err(corrupt("LUKS2 header offset does not match where it is"));
    }
    if at + hdr_size > file_size {
        return Err(LuksError::Truncated {
            need: at + hdr_size,
            have: file_size,
        });
    }
    let mut all = bin;
    all.extend(read(
        at + LUKS2_BINARY as u64,
        hdr_size as usize - LUKS2_BINARY,
    )?);
    let alg = c_str(&all[72..104]);
    let hash = Hash::parse(&alg)?;
    let stored = all[448..448 + hash.digest_len()].to_vec();
    all[448..512].fill(0);
    let mut sum = vec![0u8; hash.digest_len()];
    hash.digest_into(&[&all], &mut sum);
    if sum != stored {
        return Err(corrupt(format!("LUKS2 header at {at}: checksum mismatch")));
    }
    let seqid = be64(&all, 16);
    let json = &all[LUKS2_BINARY..];
    let end = json.iter().position(|&c| c == 0).unwrap_or(json.len());
    Ok(Some((seqid, json[..end].to_vec())))
}

/// A JSON number or a decimal string (LUKS2 writes 64-bit values as strings).
fn num(v: &Value, what: &str) -> Result<u64, LuksError> {
    match v {
        Value::Number(n) => n.as_u64(),
        Value::String(s) => s.parse().ok(),
        _ => None,
    }
    .ok_or_else(|| corrupt(format!("LUKS2 {what}: not a number")))
}

fn field<'a>(v: &'a Value, key: &str, what: &str) -> Result<&'a Value, LuksError> {
    v.get(key)
        .ok_or_else(|| corrupt(format!("LUKS2 {what}: no {key:?}")))
}

fn text<'a>(v: &'a Value, key: &str, what: &str) -> Result<&'a str, LuksError> {
    field(v, key, what)?
        .as_str()
        .ok_or_else(|| corrupt(format!("LUKS2 {what}: {key:?} is not a string")))
}

fn b64(v: &Value, key: &str, what: &str) -> Result<Vec<u8>, LuksError> {
    base64::engine::general_purpose::STANDARD
        .decode(text(v, key, what)?)
        .map_err(|_| corrupt(format!("LUKS2 {what}: {key:?} is not base64")))
}

fn u32_of(v: &Value, key: &str, what: &str) -> Result<u32, LuksError> {
    u32::try_from(num(field(v, key, what)?, what)?)
        .map_err(|_| LuksError::Limit(format!("LUKS2 {what}: {key} out of range")))
}

fn parse_luks2_json(json: &[u8], file_size: u64) -> Result<Header, LuksError> {
    let v: Value =
        serde_json::from_slice(json).map_err(|e| corrupt(format!("LUKS2 JSON area: {e}")))?;
    if let Some(req) = v.pointer("/config/requirements/mandatory") {
        if req.as_array().is_some_and(|a| !a.is_empty()) {
            return Err(LuksError::Unsupported(format!(
                "LUKS2 requirements {req} (an unfinished reencryption, or a feature vublk \
                 lacks)"
            )));
        }
    }
    let segments = field(&v, "segments", "header")?
        .as_object()
        .ok_or_else(|| corrupt("LUKS2 segments"))?;
    if segments.len() != 1 {
        return Err(LuksError::Unsupported(format!(
            "{} LUKS2 data segments (an unfinished reencryption?): vublk serves one",
            segments.len()
        )));
    }
    let (seg_id, seg) = segments.iter().next().expect("one segment");
    if text(seg, "type", "segment")? != "crypt" {
        return Err(LuksError::Unsupported(format!(
            "a LUKS2 segment of type {:?}",
            text(seg, "type", "segment")?
        )));
    }
    if seg.get("integrity").is_some() {
        return Err(LuksError::Unsupported(
            "LUKS2 with integrity protection (dm-integrity)".into(),
        ));
    }
    let data_offset = num(field(seg, "offset", "segment")?, "segment offset")?;
    let data_size = match field(seg, "size", "segment")? {
        Value::String(s) if s == "dynamic" => None,
        other => Some(num(other, "segment size")?),
    };
    let iv_tweak = num(field(seg, "iv_tweak", "segment")?, "segment iv_tweak")?;
    let sector_size = u32_of(seg, "sector_size", "segment")?;
    if !(512..=4096).contains(&sector_size) || !sector_size.is_power_of_two() {
        return Err(corrupt(format!("LUKS2 sector size {sector_size}")));
    }
    let cipher = text(seg, "encryption", "segment")?;
    // The digest of this segment's volume key, and its key slots.
    let digests = field(&v, "digests", "header")?
        .as_object()
        .ok_or_else(|| corrupt("LUKS2 digests"))?;
    let listed = |d: &Value, key: &str, id: &str| {
        d.get(key)
            .and_then(Value::as_array)
            .is_some_and(|a| a.iter().any(|x| x.as_str() == Some(id)))
    };
    let d = digests
        .values()
        .find(|d| listed(d, "segments", seg_id))
        .ok_or_else(|| corrupt("LUKS2: no digest for the data segment"))?;
    if text(d, "type", "digest")? != "pbkdf2" {
        return Err(LuksError::Unsupported(format!(
            "a LUKS2 digest of type {:?}",
            text(d, "type", "digest")?
        )));
    }
    let digest = KeyDigest {
        hash: Hash::parse(text(d, "hash", "digest")?)?,
        iterations: u32_of(d, "iterations", "digest")?,
        salt: b64(d, "salt", "digest")?,
        digest: b64(d, "digest", "digest")?,
    };
    let keyslots = field(&v, "keyslots", "header")?
        .as_object()
        .ok_or_else(|| corrupt("LUKS2 keyslots"))?;
    let mut key_bytes = None;
    let mut slots = Vec::new();
    for (id, ks) in keyslots {
        if !listed(d, "keyslots", id) {
            continue;
        }
        let what = format!("key slot {id}");
        if text(ks, "type", &what)? != "luks2" {
            continue;
        }
        let kb = u32_of(ks, "key_size", &what)? as usize;
        key_bytes.get_or_insert(kb);
        let area = field(ks, "area", &what)?;
        if text(area, "type", &what)? != "raw" {
            return Err(LuksError::Unsupported(format!(
                "{what}: area type {:?}",
                text(area, "type", &what)?
            )));
        }
        let area_key_bytes = u32_of(area, "key_size", &what)? as usize;
        check_cipher(text(area, "encryption", &what)?, area_key_bytes)?;
        let af = field(ks, "af", &what)?;
        if text(af, "type", &what)? != "luks1" {
            return Err(LuksError::Unsupported(format!(
                "{what}: anti-forensic type"
            )));
        }
        let kdf_v = field(ks, "kdf", &what)?;
        let kdf = match text(kdf_v, "type", &what)? {
            "pbkdf2" => Kdf::Pbkdf2 {
                hash: Hash::parse(text(kdf_v, "hash", &what)?)?,
                iterations: u32_of(kdf_v, "iterations", &what)?,
                salt: b64(kdf_v, "salt", &what)?,
            },
            t @ ("argon2i" | "argon2id") => Kdf::Argon2 {
                id: t == "argon2id",
                time: u32_of(kdf_v, "time", &what)?,
                memory_kib: u32_of(kdf_v, "memory", &what)?,
                lanes: u32_of(kdf_v, "cpus", &what)?,
                salt: b64(kdf_v, "salt", &what)?,
            },
            t => {
                return Err(LuksError::Unsupported(format!("{what}: KDF {t:?}")));
            }
        };
        let slot = Slot {
            index: id.parse().unwrap_or(u32::MAX),
            kdf,
            area_offset: num(field(area, "offset", &what)?, &what)?,
            area_size: num(field(area, "size", &what)?, &what)?,
            key_bytes: kb,
            area_key_bytes,
            stripes: u32_of(af, "stripes", &what)?,
            af_hash: Hash::parse(text(af, "hash", &what)?)?,
        };
        if Some(kb) != key_bytes {
            return Err(corrupt(format!("{what}: a volume key of another length")));
        }
        check_slot(&slot, data_offset, file_size)?;
        slots.push(slot);
    }
    let key_bytes = key_bytes.unwrap_or(64);
    check_cipher(cipher, key_bytes)?;
    let header = Header {
        version: 2,
        key_bytes,
        data_offset,
        data_size,
        sector_size,
        iv_tweak,
        slots,
        digest,
        uuid: String::new(),
    };
    check_header(&header, file_size)?;
    Ok(header)
}
