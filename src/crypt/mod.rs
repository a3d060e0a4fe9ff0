//! Encryption at rest: LUKS1 and LUKS2 volumes (`aes-xts-plain64`), unlocked with a
//! passphrase or the volume key itself, and the sector cipher the data path runs.
//!
//! Rooms: `header` (both header versions parsed and checked into one `Header`), `kdf` (the
//! key-slot KDFs, the hashes, the anti-forensic splitter, and the limits on what a header
//! may ask for), `xts` (AES-XTS over whole sectors), `secret` (where secrets come from,
//! and memory kept out of swap and core dumps), `format` (new LUKS headers for
//! `vublk create --encrypt`). Knows nothing of images or the data path: the image room
//! opens a volume through [`Volume::unlock`] and calls [`Volume::encrypt`] and
//! [`Volume::decrypt`].

pub mod format;
#[cfg(any(test, feature = "testing"))]
pub mod fuzz;
pub mod header;
pub mod kdf;
pub mod pool;
pub mod secret;
pub mod xts;

use std::io;

pub use header::Header;
pub use secret::{KeySource, Locked, SecretBuf};
use xts::Xts;

/// Why a LUKS volume cannot be opened. No variant carries a secret.
#[derive(Debug, thiserror::Error)]
pub enum LuksError {
    #[error("no key slot matches the passphrase")]
    NoKeySlotMatches,
    #[error("the raw volume key does not match the header's digest")]
    WrongVolumeKey,
    #[error("corrupt LUKS header: {0}")]
    Corrupt(String),
    #[error("unsupported LUKS volume: {0}")]
    Unsupported(String),
    #[error("refused: {0}")]
    Limit(String),
    #[error("the file is truncated: the LUKS header needs {need} bytes, the file has {have}")]
    Truncated { need: u64, have: u64 },
    #[error("reading the LUKS header")]
    Io(#[from] io::Error),
}

/// A secret and how to use it: a passphrase for a key slot, or (`raw`) the volume key.
#[derive(Clone)]
pub struct Key {
    pub secret: std::sync::Arc<SecretBuf>,
    pub raw: bool,
}

impl std::fmt::Debug for Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Key {{ <secret>, raw: {} }}", self.raw)
    }
}

/// An unlocked volume: its header and the volume key's cipher.
pub struct Volume {
    pub header: Header,
    xts: Locked<Xts>,
    /// Helpers for large requests (`--crypt-threads`; None: the calling thread alone).
    pool: Option<pool::CryptPool>,
    /// The file offset where IV 0 would be (raw LUKS: the data segment; qcow2: 0, its IV
    /// is the host offset).
    iv_base: u64,
}

impl std::fmt::Debug for Volume {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Volume")
            .field("version", &self.header.version)
            .field("key_bits", &(self.header.key_bytes * 8))
            .field("sector_size", &self.header.sector_size)
            .finish()
    }
}

/// Bytes of data read per call of `read` while unlocking (offset, length).
pub type ReadAt<'a> = &'a mut dyn FnMut(u64, usize) -> io::Result<Vec<u8>>;

/// Parse the LUKS header at the start of a file of `file_size` bytes.
pub fn parse(file_size: u64, read: ReadAt<'_>) -> Result<Header, LuksError> {
    if file_size < 4096 {
        return Err(LuksError::Truncated {
            need: 4096,
            have: file_size,
        });
    }
    let first = read(0, 4096)?;
    match header::version(&first) {
        Some(1) => header::parse_luks1(&first, file_size),
        Some(2) => header::parse_luks2(file_size, read),
        Some(v) => Err(LuksError::Unsupported(format!("LUKS version {v}"))),
        None => Err(LuksError::Corrupt("no LUKS magic".into())),
    }
}

impl Volume {
    /// Unlock: derive each active key slot's key from the passphrase until one gives a
    /// volume key that matches the digest (or, `raw`, check the volume key given). Never
    /// inlined: its frame (which held key schedules) is below the caller's, where
    /// [`scrub_stack`] reaches it.
    #[inline(never)]
    pub fn unlock(header: Header, key: &Key, read: ReadAt<'_>) -> Result<Volume, LuksError> {
        let h = &header;
        let mut vk = SecretBuf::zeroed(h.key_bytes)?;
        let found = if key.raw {
            if key.secret.len() != h.key_bytes {
                return Err(LuksError::Unsupported(format!(
                    "a raw volume key of {} bytes: this volume's key is {} bytes",
                    key.secret.len(),
                    h.key_bytes
                )));
            }
            vk.as_mut().copy_from_slice((*key.secret).as_ref());
            digest_matches(h, vk.as_ref())?
        } else {
            let mut found = false;
            for slot in &h.slots {
                if try_slot(h, slot, (*key.secret).as_ref(), read, vk.as_mut())? {
                    found = true;
                    break;
                }
            }
            found
        };
        if !found {
            return Err(if key.raw {
                LuksError::WrongVolumeKey
            } else {
                LuksError::NoKeySlotMatches
            });
        }
        let xts = Xts::new(vk.as_ref()).map_err(|e| LuksError::Unsupported(e.to_string()))?;
        let iv_base = header.data_offset;
        Ok(Volume {
            header,
            xts: Locked::new(xts)?,
            pool: None,
            iv_base,
        })
    }

    /// A volume whose IVs count from file offset `base` (qcow2: 0, the IV is the host
    /// offset).
    pub fn with_iv_base(mut self, base: u64) -> Volume {
        self.iv_base = base;
        self
    }

    /// Spread large requests over `threads` helper threads besides the caller (0: none).
    pub fn with_threads(mut self, threads: usize) -> Result<Volume, LuksError> {
        self.pool = match threads {
            0 => None,
            n => Some(pool::CryptPool::new(n)?),
        };
        Ok(self)
    }

    /// Helper threads (0: the calling thread alone).
    pub fn threads(&self) -> usize {
        self.pool.as_ref().map_or(0, |p| p.threads())
    }

    /// Queue `task` for the helper threads (see [`pool::CryptPool::spawn`]); gives it back
    /// when there are none.
    pub fn spawn(&self, task: pool::Task) -> Result<(), pool::Task> {
        match &self.pool {
            Some(p) => p.spawn(task),
            None => Err(task),
        }
    }

    pub fn sector_size(&self) -> u32 {
        self.header.sector_size
    }

    /// The IV of the sector at file offset `host`.
    fn iv(&self, host: u64) -> u64 {
        (host.wrapping_sub(self.iv_base) / 512).wrapping_add(self.header.iv_tweak)
    }

    fn step(&self) -> u64 {
        u64::from(self.header.sector_size / 512)
    }

    /// Encrypt `buf` (whole sectors) that goes to file offset `host` (a sector boundary).
    pub fn encrypt(&self, buf: &mut [u8], host: u64) {
        self.spread(buf, host, true)
    }

    /// Decrypt `buf` (whole sectors) read from file offset `host`.
    pub fn decrypt(&self, buf: &mut [u8], host: u64) {
        self.spread(buf, host, false)
    }

    fn one(&self, buf: &mut [u8], host: u64, enc: bool) {
        let s = self.header.sector_size as usize;
        if enc {
            self.xts.encrypt(buf, s, self.iv(host), self.step());
        } else {
            self.xts.decrypt(buf, s, self.iv(host), self.step());
        }
    }

    /// Gather the data described by `src` into `dst` (its length) and encrypt it there for
    /// file offset `host`: copy and encryption together, piece by piece on the helpers for
    /// a large request, so that neither is left to one thread.
    ///
    /// # Safety
    /// Each iovec must describe memory valid for reads for the call, not overlapping `dst`.
    pub unsafe fn encrypt_gather(&self, src: &[libc::iovec], dst: &mut [u8], host: u64) {
        // SAFETY: the caller's promise.
        unsafe { self.encrypt_gather_at(src, 0, dst, host, false) }
    }

    /// [`Self::encrypt_gather`] of `dst.len()` bytes from byte `from` of the iovecs' data.
    ///
    /// # Safety
    /// As [`Self::encrypt_gather`]; the iovecs hold at least `from + dst.len()` bytes.
    pub unsafe fn encrypt_gather_at(
        &self,
        src: &[libc::iovec],
        from: usize,
        dst: &mut [u8],
        host: u64,
        alone: bool,
    ) {
        let s = self.header.sector_size as usize;
        let len = dst.len();
        let n = if alone {
            1
        } else {
            self.pool.as_ref().map_or(1, |p| p.pieces(len))
        };
        let per = (len / s).div_ceil(n).max(1) * s;
        let base = dst.as_mut_ptr() as usize;
        let (iov_addr, iov_len) = (src.as_ptr() as usize, src.len());
        let piece = |i: usize| {
            let (a, b) = ((i * per).min(len), ((i + 1) * per).min(len));
            if a >= b {
                return;
            }
            // SAFETY: [a, b) is this piece's own part of `dst` (borrowed mutably by the
            // call, which waits for every piece); the iovecs are the caller's.
            unsafe {
                let out = std::slice::from_raw_parts_mut((base + a) as *mut u8, b - a);
                let iov = std::slice::from_raw_parts(iov_addr as *const libc::iovec, iov_len);
                gather(iov, from + a, out);
                self.one(out, host + a as u64, true);
            }
        };
        match self.pool.as_ref().filter(|_| n > 1) {
            Some(pool) => pool.run(n, &piece),
            None => piece(0),
        }
    }

    /// `buf` cut into pieces of whole sectors, one per thread (large buffers only).
    fn spread(&self, buf: &mut [u8], host: u64, enc: bool) {
        let s = self.header.sector_size as usize;
        let n = self.pool.as_ref().map_or(1, |p| p.pieces(buf.len()));
        let Some(pool) = self.pool.as_ref().filter(|_| n > 1) else {
            return self.one(buf, host, enc);
        };
        let len = buf.len();
        let per = (len / s).div_ceil(n) * s;
        let base = buf.as_mut_ptr() as usize;
        pool.run(n, &|i| {
            let (a, b) = ((i * per).min(len), ((i + 1) * per).min(len));
            if a < b {
                // SAFETY: pieces [a, b) are disjoint parts of `buf`, which this call
                // borrows mutably until every piece is done (`run` waits).
                let piece = unsafe { std::slice::from_raw_parts_mut((base + a) as *mut u8, b - a) };
                self.one(piece, host + a as u64, enc);
            }
        });
    }

    /// Decrypt in place data read from file offset `host` into memory described by `iov`
    /// (whole sectors in all, split anywhere): a few sectors at a time through a small
    /// staging buffer, so that a sector split between two buffers is whole when decrypted.
    ///
    /// # Safety
    /// Each iovec must describe memory valid for reads and writes for the call.
    pub unsafe fn decrypt_iovecs(&self, iov: &[libc::iovec], host: u64) {
        let sector = self.header.sector_size as usize;
        let total: usize = iov.iter().map(|v| v.iov_len).sum();
        let total = total / sector * sector;
        let n = self.pool.as_ref().map_or(1, |p| p.pieces(total));
        let Some(pool) = self.pool.as_ref().filter(|_| n > 1) else {
            // SAFETY: the caller's promise.
            return unsafe { self.decrypt_iovec_range(iov, 0, total, host) };
        };
        let per = (total / sector).div_ceil(n) * sector;
        let iov_addr = iov.as_ptr() as usize;
        let iov_len = iov.len();
        pool.run(n, &|i| {
            let (a, b) = ((i * per).min(total), ((i + 1) * per).min(total));
            if a < b {
                // SAFETY: the caller's iovecs (borrowed for this call, which waits for
                // every piece); the pieces are disjoint byte ranges of them.
                unsafe {
                    let iov = std::slice::from_raw_parts(iov_addr as *const libc::iovec, iov_len);
                    self.decrypt_iovec_range(iov, a, b, host);
                }
            }
        });
    }

    /// [`Self::decrypt_iovecs`] of bytes [from, to) of the iovecs' data (sector boundaries).
    ///
    /// # Safety
    /// As [`Self::decrypt_iovecs`].
    unsafe fn decrypt_iovec_range(&self, iov: &[libc::iovec], from: usize, to: usize, host: u64) {
        const STAGE: usize = 16 << 10;
        let mut stage = [0u8; STAGE];
        let sector = self.header.sector_size as usize;
        let total = to;
        let chunk = STAGE / sector * sector;
        // Find where byte `from` is.
        let (mut vi, mut vo) = (0usize, from);
        while vi < iov.len() && vo >= iov[vi].iov_len {
            vo -= iov[vi].iov_len;
            vi += 1;
        }
        let mut done = from;
        while done < total {
            let n = chunk.min(total - done);
            // Gather n bytes starting at (vi, vo).
            let (mut gi, mut go, mut got) = (vi, vo, 0usize);
            while got < n {
                let v = &iov[gi];
                let take = (v.iov_len - go).min(n - got);
                // SAFETY: inside the caller's iovec and the stage.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        v.iov_base.cast::<u8>().add(go),
                        stage.as_mut_ptr().add(got),
                        take,
                    )
                };
                got += take;
                go += take;
                if go == v.iov_len {
                    gi += 1;
                    go = 0;
                }
            }
            self.one(&mut stage[..n], host + done as u64, false);
            // Scatter them back.
            let mut put = 0usize;
            while put < n {
                let v = &iov[vi];
                let take = (v.iov_len - vo).min(n - put);
                // SAFETY: as above.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        stage.as_ptr().add(put),
                        v.iov_base.cast::<u8>().add(vo),
                        take,
                    )
                };
                put += take;
                vo += take;
                if vo == v.iov_len {
                    vi += 1;
                    vo = 0;
                }
            }
            done += n;
        }
        zeroize::Zeroize::zeroize(&mut stage[..]);
    }

    /// One line about the volume for logs and `stats` (never the key).
    pub fn describe(&self) -> String {
        format!(
            "LUKS{} {} {}-bit, {}-byte sectors, data at {}",
            self.header.version,
            header::CIPHER,
            self.header.key_bytes * 8,
            self.header.sector_size,
            self.header.data_offset
        )
    }
}

/// Wipe the stack below the caller's frame: what deeper calls left there (AES key
/// schedules built on the stack before they moved into a protected region, KDF state) must
/// not reach a core dump. Call it after the call that handled key material returned.
#[inline(never)]
pub fn scrub_stack() {
    let mut below = [0u8; 256 << 10];
    zeroize::Zeroize::zeroize(&mut below[..]);
    std::hint::black_box(&below);
    clear_vector_registers();
}

/// Zero the vector registers the cipher works in: round keys left there would be saved into
/// a signal frame on the stack, or into a core dump's register notes. The `aes` crate picks
/// AES-NI (xmm0-15) or VAES over ymm or zmm registers at run time: all of them are cleared
/// (`vzeroall` for the first 16 whole, and zmm16-31 where AVX-512 exists).
#[inline(always)]
fn clear_vector_registers() {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512 (checked); only registers are zeroed.
            unsafe { clear_avx512() }
        } else if std::arch::is_x86_feature_detected!("avx") {
            // SAFETY: the CPU has AVX (checked); only registers are zeroed.
            unsafe { clear_avx() }
        } else {
            // SAFETY: SSE2 is part of x86_64; only registers are zeroed.
            unsafe { clear_sse() }
        }
    }
}

/// # Safety
/// The CPU must have AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn clear_avx512() {
    // SAFETY: zeroes registers only, each declared clobbered; no memory, no stack.
    unsafe {
        std::arch::asm!(
            "vzeroall",
            "vpxord zmm16, zmm16, zmm16", "vpxord zmm17, zmm17, zmm17",
            "vpxord zmm18, zmm18, zmm18", "vpxord zmm19, zmm19, zmm19",
            "vpxord zmm20, zmm20, zmm20", "vpxord zmm21, zmm21, zmm21",
            "vpxord zmm22, zmm22, zmm22", "vpxord zmm23, zmm23, zmm23",
            "vpxord zmm24, zmm24, zmm24", "vpxord zmm25, zmm25, zmm25",
            "vpxord zmm26, zmm26, zmm26", "vpxord zmm27, zmm27, zmm27",
            "vpxord zmm28, zmm28, zmm28", "vpxord zmm29, zmm29, zmm29",
            "vpxord zmm30, zmm30, zmm30", "vpxord zmm31, zmm31, zmm31",
            out("zmm0") _, out("zmm1") _, out("zmm2") _, out("zmm3") _,
            out("zmm4") _, out("zmm5") _, out("zmm6") _, out("zmm7") _,
            out("zmm8") _, out("zmm9") _, out("zmm10") _, out("zmm11") _,
            out("zmm12") _, out("zmm13") _, out("zmm14") _, out("zmm15") _,
            out("zmm16") _, out("zmm17") _, out("zmm18") _, out("zmm19") _,
            out("zmm20") _, out("zmm21") _, out("zmm22") _, out("zmm23") _,
            out("zmm24") _, out("zmm25") _, out("zmm26") _, out("zmm27") _,
            out("zmm28") _, out("zmm29") _, out("zmm30") _, out("zmm31") _,
            options(nomem, nostack, preserves_flags),
        )
    };
}

/// # Safety
/// The CPU must have AVX.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
unsafe fn clear_avx() {
    // SAFETY: zeroes registers only, each declared clobbered; no memory, no stack.
    unsafe {
        std::arch::asm!(
            "vzeroall",
            out("ymm0") _, out("ymm1") _, out("ymm2") _, out("ymm3") _,
            out("ymm4") _, out("ymm5") _, out("ymm6") _, out("ymm7") _,
            out("ymm8") _, out("ymm9") _, out("ymm10") _, out("ymm11") _,
            out("ymm12") _, out("ymm13") _, out("ymm14") _, out("ymm15") _,
            options(nomem, nostack, preserves_flags),
        )
    };
}

/// # Safety
/// None beyond x86_64 (SSE2 is part of it).
#[cfg(target_arch = "x86_64")]
unsafe fn clear_sse() {
    // SAFETY: zeroes registers only, each declared clobbered; no memory, no stack.
    unsafe {
        std::arch::asm!(
            "xorps xmm0, xmm0", "xorps xmm1, xmm1", "xorps xmm2, xmm2", "xorps xmm3, xmm3",
            "xorps xmm4, xmm4", "xorps xmm5, xmm5", "xorps xmm6, xmm6", "xorps xmm7, xmm7",
            "xorps xmm8, xmm8", "xorps xmm9, xmm9", "xorps xmm10, xmm10",
            "xorps xmm11, xmm11", "xorps xmm12, xmm12", "xorps xmm13, xmm13",
            "xorps xmm14, xmm14", "xorps xmm15, xmm15",
            out("xmm0") _, out("xmm1") _, out("xmm2") _, out("xmm3") _,
            out("xmm4") _, out("xmm5") _, out("xmm6") _, out("xmm7") _,
            out("xmm8") _, out("xmm9") _, out("xmm10") _, out("xmm11") _,
            out("xmm12") _, out("xmm13") _, out("xmm14") _, out("xmm15") _,
            options(nomem, nostack, preserves_flags),
        )
    };
}

/// [`scrub_stack`] of the little a cipher call leaves (its frames are a few KiB deep; a
/// debug build's deeper): cheap enough for every request. `xts` calls it after each run of
/// the cipher, whose backends keep round keys in vector registers and spill some (VAES:
/// broadcast copies) to the stack below the caller.
#[inline(never)]
pub(crate) fn scrub_stack_after_cipher() {
    let mut below = [0u8; CIPHER_FRAMES];
    zeroize::Zeroize::zeroize(&mut below[..]);
    std::hint::black_box(&below);
    clear_vector_registers();
}

/// How deep a cipher call's frames reach below its caller's.
const CIPHER_FRAMES: usize = if cfg!(debug_assertions) {
    32 << 10
} else {
    8 << 10
};

/// Copy `out.len()` bytes from byte `from` of the iovecs' data into `out`.
///
/// # Safety
/// The iovecs must be valid for reads and hold at least `from + out.len()` bytes.
unsafe fn gather(iov: &[libc::iovec], from: usize, out: &mut [u8]) {
    let mut skip = from;
    let mut got = 0usize;
    for v in iov {
        if got == out.len() {
            break;
        }
        if skip >= v.iov_len {
            skip -= v.iov_len;
            continue;
        }
        let take = (v.iov_len - skip).min(out.len() - got);
        // SAFETY: inside the iovec (the caller's promise) and inside `out`.
        unsafe {
            std::ptr::copy_nonoverlapping(
                v.iov_base.cast::<u8>().add(skip),
                out.as_mut_ptr().add(got),
                take,
            )
        };
        got += take;
        skip = 0;
    }
}

/// Does `vk` give the header's digest?
fn digest_matches(h: &Header, vk: &[u8]) -> Result<bool, LuksError> {
    let d = &h.digest;
    let mut out = zeroize::Zeroizing::new(vec![0u8; d.digest.len()]);
    d.hash.pbkdf2(vk, &d.salt, d.iterations, &mut out)?;
    // Constant-time comparison.
    Ok(out.iter().zip(&d.digest).fold(0u8, |a, (x, y)| a | (x ^ y)) == 0)
}

/// Try one key slot: Ok(true) with the volume key in `vk` when the passphrase opens it.
fn try_slot(
    h: &Header,
    slot: &header::Slot,
    pass: &[u8],
    read: ReadAt<'_>,
    vk: &mut [u8],
) -> Result<bool, LuksError> {
    let mut slot_key = SecretBuf::zeroed(slot.area_key_bytes)?;
    slot.kdf.derive(pass, slot_key.as_mut())?;
    let split = slot.key_bytes * slot.stripes as usize;
    let len = split.div_ceil(512) * 512;
    let mut material = zeroize::Zeroizing::new(read(slot.area_offset, len)?);
    if material.len() != len {
        return Err(LuksError::Truncated {
            need: slot.area_offset + len as u64,
            have: slot.area_offset + material.len() as u64,
        });
    }
    let xts = Xts::new(slot_key.as_ref()).map_err(|e| LuksError::Unsupported(e.to_string()))?;
    xts.decrypt(&mut material, 512, 0, 1);
    kdf::af_merge(&material[..split], slot.stripes as usize, slot.af_hash, vk);
    digest_matches(h, vk)
}
