//! AES-XTS (IEEE 1619) over whole sectors, the cipher of `aes-xts-plain64`: each sector is
//! one data unit whose tweak is its 64-bit sector number (little-endian, zero-padded to 16
//! bytes). Sectors are whole multiples of 16 bytes, so ciphertext stealing never applies.
//!
//! Written over the `aes` crate rather than taken from a mode crate: the crate's backends
//! (AES-NI, and VAES over 256 or 512-bit registers where the CPU has them, chosen at run
//! time) encrypt many blocks per instruction only when given many blocks per call, so XTS
//! XORs a whole batch of sectors with their tweaks, runs one AES call over the batch, and
//! XORs again; the published XTS crates encrypt one block at a time.

use aes::cipher::{BlockCipherDecrypt, BlockCipherEncrypt, KeyInit};
use aes::{Aes128, Aes256};

/// One AES block.
type Block = aes::Block;

/// The largest sector (LUKS2's largest encryption sector).
pub const MAX_SECTOR: usize = 4096;

/// Bytes per batch (one AES call over them all; at least one sector).
const BATCH_BYTES: usize = 32 << 10;

/// Sectors in the largest batch (of the smallest sectors).
const MAX_BATCH_SECTORS: usize = BATCH_BYTES / 512;

/// The two AES keys of XTS: data (K1) and tweak (K2). Both wipe their round keys when
/// dropped (the `aes` crate's `zeroize` feature). Not boxed: the value lives in a locked
/// region of its own (`secret::Locked`), whatever its size.
#[allow(clippy::large_enum_variant)]
enum Keys {
    Aes128(Aes128, Aes128),
    Aes256(Aes256, Aes256),
}

/// An AES-XTS key: 32 bytes (AES-128) or 64 bytes (AES-256).
pub struct Xts {
    keys: Keys,
}

/// The key length is not one of XTS's (32 or 64 bytes).
#[derive(Debug, thiserror::Error)]
#[error("an aes-xts key is 32 or 64 bytes (256 or 512 bits), not {0} bytes")]
pub struct BadKeyLength(pub usize);

impl Xts {
    pub fn new(key: &[u8]) -> Result<Xts, BadKeyLength> {
        let keys = match key.len() {
            32 => Keys::Aes128(
                Aes128::new_from_slice(&key[..16]).expect("16 bytes"),
                Aes128::new_from_slice(&key[16..]).expect("16 bytes"),
            ),
            64 => Keys::Aes256(
                Aes256::new_from_slice(&key[..32]).expect("32 bytes"),
                Aes256::new_from_slice(&key[32..]).expect("32 bytes"),
            ),
            n => return Err(BadKeyLength(n)),
        };
        Ok(Xts { keys })
    }

    /// Key bits (256 or 512), for messages.
    pub fn key_bits(&self) -> u32 {
        match self.keys {
            Keys::Aes128(..) => 256,
            Keys::Aes256(..) => 512,
        }
    }

    /// Encrypt `buf` in place: whole sectors of `sector` bytes, the first with tweak
    /// `first_iv`, each next one `iv_step` more (in 512-byte units: `sector / 512` for
    /// dm-crypt's and QEMU's numbering).
    pub fn encrypt(&self, buf: &mut [u8], sector: usize, first_iv: u64, iv_step: u64) {
        self.run(buf, sector, first_iv, iv_step, true)
    }

    /// Decrypt `buf` in place (see [`Self::encrypt`]).
    pub fn decrypt(&self, buf: &mut [u8], sector: usize, first_iv: u64, iv_step: u64) {
        self.run(buf, sector, first_iv, iv_step, false)
    }

    /// Never inlined: its frame and its callees' (where the round keys may be spilled)
    /// lie below the caller's, which wipes them (`crypt::scrub_stack`).
    #[inline(never)]
    fn run(&self, buf: &mut [u8], sector: usize, first_iv: u64, iv_step: u64, enc: bool) {
        assert!(
            (16..=MAX_SECTOR).contains(&sector)
                && sector.is_multiple_of(16)
                && buf.len().is_multiple_of(sector),
            "XTS over whole sectors of whole blocks"
        );
        let mut tweaks = [Block::default(); MAX_BATCH_SECTORS];
        // The tweak of every block of a batch, kept for the second XOR: computing the
        // sequence is the serial part, XORing with a stored one is not. Written before read.
        let mut seq = [std::mem::MaybeUninit::<u128>::uninit(); BATCH_BYTES / 16];
        let per_batch = (BATCH_BYTES / sector).clamp(1, MAX_BATCH_SECTORS);
        let mut iv = first_iv;
        for batch in buf.chunks_mut(sector * per_batch) {
            let n = batch.len() / sector;
            for t in tweaks.iter_mut().take(n) {
                t.copy_from_slice(&u128::from(iv).to_le_bytes());
                iv = iv.wrapping_add(iv_step);
            }
            self.tweak_key_encrypt(&mut tweaks[..n]);
            let seq = &mut seq[..batch.len() / 16];
            Self::xor_tweaks(batch, seq, sector, &tweaks[..n]);
            // One AES call over the whole batch: the cipher's wide (VAES) backends want
            // many blocks per call.
            let blocks = as_blocks(batch);
            match (&self.keys, enc) {
                (Keys::Aes128(k1, _), true) => k1.encrypt_blocks(blocks),
                (Keys::Aes128(k1, _), false) => k1.decrypt_blocks(blocks),
                (Keys::Aes256(k1, _), true) => k1.encrypt_blocks(blocks),
                (Keys::Aes256(k1, _), false) => k1.decrypt_blocks(blocks),
            }
            for (b, t) in batch.chunks_exact_mut(16).zip(seq.iter()) {
                // SAFETY: `xor_tweaks` wrote every element of `seq` (one per block).
                xor_block(b, unsafe { t.assume_init() });
            }
        }
        // The AES backends' frames lay below this one: wipe them, and the registers.
        super::scrub_stack_after_cipher();
    }

    fn tweak_key_encrypt(&self, blocks: &mut [Block]) {
        match &self.keys {
            Keys::Aes128(_, k2) => k2.encrypt_blocks(blocks),
            Keys::Aes256(_, k2) => k2.encrypt_blocks(blocks),
        }
    }

    /// XOR every block of each sector with its tweak (the sector's encrypted IV, times
    /// alpha once per block), writing each block's tweak into `seq`. A sector's tweaks are
    /// one serial chain of multiplications; [`LANES`] sectors at a time run their chains
    /// side by side, so the chain's latency is not paid per block.
    fn xor_tweaks(
        batch: &mut [u8],
        seq: &mut [std::mem::MaybeUninit<u128>],
        sector: usize,
        tweaks: &[Block],
    ) {
        let per = sector / 16;
        let groups = if cfg!(target_arch = "x86_64") {
            tweaks.len() / LANES
        } else {
            0
        };
        let done = groups * LANES;
        #[cfg(target_arch = "x86_64")]
        for g in 0..groups {
            let (d, q) = (g * LANES * sector, g * LANES * per);
            // SAFETY: group g's LANES sectors lie inside `batch` and their LANES * per
            // tweak slots inside `seq` (`done` sectors of each are whole groups).
            unsafe {
                xor_group(
                    batch[d..d + LANES * sector].as_mut_ptr(),
                    seq[q..q + LANES * per].as_mut_ptr().cast(),
                    per,
                    &tweaks[g * LANES..g * LANES + LANES],
                )
            };
        }
        // The sectors left over (a batch of fewer than LANES sectors), one at a time.
        for ((data, sq), t) in batch[done * sector..]
            .chunks_exact_mut(sector)
            .zip(seq[done * per..].chunks_exact_mut(per))
            .zip(&tweaks[done..])
        {
            let mut t = u128::from_le_bytes((*t).into());
            for (b, q) in data.chunks_exact_mut(16).zip(sq.iter_mut()) {
                q.write(t);
                xor_block(b, t);
                t = mul_alpha(t);
            }
        }
    }
}

/// Sectors whose tweak chains run side by side.
const LANES: usize = 4;

/// [`Xts::xor_tweaks`] of LANES sectors of `per` blocks at `data`, their tweaks to `seq`,
/// in SSE2 registers (every x86-64 has them): the tweak chains of the LANES sectors are
/// independent, so the processor overlaps them.
///
/// # Safety
/// `data` is valid for reads and writes of LANES * per blocks, `seq` for writes of as many
/// u128s; `tweaks` holds LANES blocks.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn xor_group(data: *mut u8, seq: *mut u128, per: usize, tweaks: &[Block]) {
    use std::arch::x86_64::*;
    // SAFETY: SSE2 is part of x86-64; the pointers are the caller's promise, every access
    // is one of the LANES * per blocks.
    unsafe {
        // alpha: each 64-bit half shifted left by one; the low half's top bit carried into
        // the high half, the high half's reduced into the low (x^128 = x^7 + x^2 + x + 1).
        let poly = _mm_set_epi32(0, 1, 0, 0x87);
        let mut t: [__m128i; LANES] =
            std::array::from_fn(|k| _mm_loadu_si128(tweaks[k].as_ptr().cast()));
        for j in 0..per {
            for (k, t) in t.iter_mut().enumerate() {
                let b = k * per + j;
                let p = data.add(b * 16).cast::<__m128i>();
                _mm_storeu_si128(seq.add(b).cast(), *t);
                _mm_storeu_si128(p, _mm_xor_si128(_mm_loadu_si128(p), *t));
                let carry = _mm_and_si128(_mm_shuffle_epi32(_mm_srai_epi32(*t, 31), 0x13), poly);
                *t = _mm_xor_si128(_mm_add_epi64(*t, *t), carry);
            }
        }
    }
}

/// Multiply a tweak by the primitive element of GF(2^128) (IEEE 1619's little-endian
/// convention: a shift left by one, reduced by x^128 = x^7 + x^2 + x + 1).
#[inline]
fn mul_alpha(t: u128) -> u128 {
    (t << 1) ^ (((t as i128) >> 127) as u128 & 0x87)
}

#[inline(always)]
fn xor_block(b: &mut [u8], t: u128) {
    let b: &mut [u8; 16] = b.try_into().expect("a 16-byte block");
    let v = u128::from_le_bytes(*b) ^ t;
    *b = v.to_le_bytes();
}

/// View whole 16-byte blocks of `data` as AES blocks.
fn as_blocks(data: &mut [u8]) -> &mut [Block] {
    debug_assert_eq!(data.len() % 16, 0);
    // SAFETY: `GenericArray<u8, U16>` is `repr(transparent)` over a 16-byte array of u8:
    // size 16, alignment 1, every bit pattern valid; the slice covers len / 16 such blocks
    // inside `data`, whose borrow it keeps.
    unsafe { std::slice::from_raw_parts_mut(data.as_mut_ptr().cast::<Block>(), data.len() / 16) }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(s: &str) -> Vec<u8> {
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    /// IEEE 1619-2007 vector 10 (XTS-AES-256, data unit 0xff, 512 bytes).
    #[test]
    fn ieee1619_vector_10() {
        let key = hex(concat!(
            "2718281828459045235360287471352662497757247093699959574966967627",
            "3141592653589793238462643383279502884197169399375105820974944592"
        ));
        let mut data: Vec<u8> = (0..512).map(|i| i as u8).collect();
        let xts = Xts::new(&key).unwrap();
        xts.encrypt(&mut data, 512, 0xff, 1);
        assert_eq!(
            &data[..32],
            &hex("1c3b3a102f770386e4836c99e370cf9bea00803f5e482357a4ae12d414a3e63b")[..]
        );
        assert_eq!(
            &data[496..],
            &hex("c4f36ffda9fcea70b9c6e693e148c151")[..],
            "the last block"
        );
        xts.decrypt(&mut data, 512, 0xff, 1);
        assert!(data.iter().enumerate().all(|(i, &b)| b == i as u8));
    }

    /// IEEE 1619-2007 vector 1 (XTS-AES-128, zero keys, data unit 0, 32 bytes).
    #[test]
    fn ieee1619_vector_1() {
        let xts = Xts::new(&[0u8; 32]).unwrap();
        let mut data = [0u8; 32];
        xts.encrypt(&mut data, 32, 0, 1);
        assert_eq!(
            &data[..],
            &hex("917cf69ebd68b2ec9b9fe9a3eadda692cd43d2f59598ed858c02c2652fbf922e")[..]
        );
    }

    /// Sectors in one call and one at a time agree; a batch longer than the tweak batch too.
    #[test]
    fn many_sectors_match_one_at_a_time() {
        let xts = Xts::new(&[7u8; 64]).unwrap();
        let orig: Vec<u8> = (0..512 * 152).map(|i| (i * 31 % 251) as u8).collect();
        let mut all = orig.clone();
        xts.encrypt(&mut all, 512, 1000, 1);
        for (i, s) in orig.chunks(512).enumerate() {
            let mut one = s.to_vec();
            xts.encrypt(&mut one, 512, 1000 + i as u64, 1);
            assert_eq!(one, all[i * 512..(i + 1) * 512]);
        }
        let mut big = orig.clone();
        xts.encrypt(&mut big, 4096, 8, 8);
        xts.decrypt(&mut big, 4096, 8, 8);
        assert_eq!(big, orig);
        assert!(Xts::new(&[0u8; 48]).is_err());
    }
}
