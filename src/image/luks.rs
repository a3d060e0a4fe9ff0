//! LUKS images: raw data encrypted under a LUKS1 or LUKS2 header (`crypt`). Opening parses
//! the header and unlocks a key slot; the guest's byte N is then the file's byte
//! `data_offset + N`, encrypted in sectors of the volume's size. Reads and writes through
//! the engine are decrypted and encrypted by the worker ([`Image::cipher`]); what goes
//! through the image here (writes off the engine, zeroes, read-modify-write) is encrypted
//! here. Zeroes are written as encrypted zeroes, so that they read back as zeroes; discards
//! are not passed down (like dm-crypt without `allow_discards`: where the guest's data is
//! stays hidden, and a discarded range reads back what it held).

use std::fs::File;
use std::time::Instant;

use log::info;

use super::{ImageError, ImageOpenError, ImageOptions};
use crate::crypt::{self, LuksError, Volume};
use crate::io::aligned::{read_aligned, write_all_aligned};

/// A LUKS image's state: the unlocked volume.
pub(super) struct LuksDisk {
    pub vol: Volume,
}

/// Zeroes are encrypted and written in pieces of this many bytes.
const ZERO_PIECE: usize = 1 << 20;

/// Open the LUKS volume in `file` (`file_size` bytes): the guest-visible size with it.
pub(super) fn open(
    file: &File,
    opts: &ImageOptions,
    file_size: u64,
) -> Result<(LuksDisk, u64), ImageOpenError> {
    let err = |source: LuksError| ImageOpenError::Luks {
        path: opts.path.clone(),
        source,
    };
    let Some(key) = &opts.key else {
        return Err(ImageOpenError::Option(format!(
            "{} is a LUKS image: give its passphrase with --key-secret (or serve the encrypted \
             bytes as they are with --format raw)",
            opts.path.display()
        )));
    };
    let mut read = |off: u64, len: usize| read_aligned(file, off, len);
    let header = crypt::parse(file_size, &mut read).map_err(err)?;
    let sector = header.sector_size;
    if opts.logical_block_size < sector || !opts.logical_block_size.is_multiple_of(sector) {
        return Err(ImageOpenError::Option(format!(
            "{}: the volume encrypts {sector}-byte sectors: serve it with \
             --logical-block-size {sector} (or a multiple), not {}",
            opts.path.display(),
            opts.logical_block_size
        )));
    }
    let t = Instant::now();
    let vol = Volume::unlock(header, key, &mut read);
    // The key schedules and KDF state the unlock left on this thread's stack.
    crypt::scrub_stack();
    let vol = vol
        .and_then(|v| v.with_threads(opts.crypt_threads))
        .map_err(err)?;
    let h = &vol.header;
    let end = match h.data_size {
        Some(n) => h.data_offset.checked_add(n),
        None => Some(file_size),
    };
    let size = match end {
        Some(end) if end <= file_size && end >= h.data_offset => end - h.data_offset,
        _ => {
            return Err(err(LuksError::Truncated {
                need: end.unwrap_or(u64::MAX),
                have: file_size,
            }))
        }
    };
    let size = size / u64::from(sector) * u64::from(sector);
    info!(
        "{}: {}, unlocked in {} ms; {size} bytes of data; {} encryption helper threads",
        opts.path.display(),
        vol.describe(),
        t.elapsed().as_millis(),
        vol.threads()
    );
    Ok((LuksDisk { vol }, size))
}

/// Unlock the LUKS header of an encrypted qcow2 image (at `region`: offset, length in the
/// file): its volume, whose IVs are host offsets.
pub(super) fn unlock_qcow2(
    file: &File,
    opts: &ImageOptions,
    region: (u64, u64),
) -> Result<Volume, ImageOpenError> {
    let err = |source: LuksError| ImageOpenError::Luks {
        path: opts.path.clone(),
        source,
    };
    let Some(key) = &opts.key else {
        return Err(ImageOpenError::Option(format!(
            "{} is an encrypted qcow2 image: give its passphrase with --key-secret",
            opts.path.display()
        )));
    };
    let (base, len) = region;
    let mut read = |off: u64, n: usize| {
        if off.checked_add(n as u64).is_none_or(|end| end > len) {
            return Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof));
        }
        read_aligned(file, base + off, n)
    };
    let header = crypt::parse(len, &mut read).map_err(err)?;
    if header.sector_size != 512 || header.iv_tweak != 0 {
        return Err(err(LuksError::Unsupported(
            "an encrypted qcow2 image's LUKS header with sectors other than 512 bytes".into(),
        )));
    }
    let t = Instant::now();
    let vol = Volume::unlock(header, key, &mut read);
    // The key schedules and KDF state the unlock left on this thread's stack.
    crypt::scrub_stack();
    let vol = vol
        .map(|v| v.with_iv_base(0))
        .and_then(|v| v.with_threads(opts.crypt_threads))
        .map_err(err)?;
    info!(
        "{}: qcow2 encrypted with {}, unlocked in {} ms; {} encryption helper threads",
        opts.path.display(),
        vol.describe(),
        t.elapsed().as_millis(),
        vol.threads()
    );
    Ok(vol)
}

impl LuksDisk {
    /// The file offset of guest byte `offset`.
    pub fn host(&self, offset: u64) -> u64 {
        self.vol.header.data_offset + offset
    }

    /// Encrypt `data` for guest `offset` and write it (any length of whole sectors).
    pub fn write(&self, file: &File, offset: u64, data: &[u8]) -> Result<(), ImageError> {
        self.check(offset, data.len() as u64)?;
        let host = self.host(offset);
        let mut buf = zeroize::Zeroizing::new(data.to_vec());
        self.vol.encrypt(&mut buf, host);
        write_all_aligned(file, host, &buf)?;
        Ok(())
    }

    /// Write encrypted zeroes over guest [offset, offset + len).
    pub fn zero(&self, file: &File, offset: u64, len: u64) -> Result<(), ImageError> {
        self.check(offset, len)?;
        let mut buf = vec![0u8; ZERO_PIECE.min(len as usize)];
        let mut done = 0u64;
        while done < len {
            let n = (len - done).min(ZERO_PIECE as u64) as usize;
            let host = self.host(offset + done);
            buf[..n].fill(0);
            self.vol.encrypt(&mut buf[..n], host);
            write_all_aligned(file, host, &buf[..n])?;
            done += n as u64;
        }
        Ok(())
    }

    /// Write `data` at guest `offset` where it does not fill the file's direct-I/O blocks:
    /// encrypted first (it is whole sectors), then read-modify-written like raw data.
    pub fn write_sub_block(
        &self,
        file: &File,
        offset: u64,
        data: &[u8],
        block: u64,
    ) -> Result<(), ImageError> {
        self.check(offset, data.len() as u64)?;
        let host = self.host(offset);
        let mut buf = zeroize::Zeroizing::new(data.to_vec());
        self.vol.encrypt(&mut buf, host);
        crate::io::aligned::write_unaligned(file, host, &buf, block)?;
        Ok(())
    }

    /// Guest requests on an encrypted image are whole encryption sectors.
    pub fn check(&self, offset: u64, len: u64) -> Result<(), ImageError> {
        let s = u64::from(self.vol.sector_size());
        if !offset.is_multiple_of(s) || !len.is_multiple_of(s) {
            return Err(ImageError::Unsupported(format!(
                "an encrypted request of {len} bytes at {offset}: not whole {s}-byte sectors"
            )));
        }
        Ok(())
    }
}

impl LuksDisk {
    /// Grow to `new` guest bytes (whole sectors): the file (the data segment is the rest of
    /// it: LUKS2 segments of a fixed size are refused). The new range reads whatever its
    /// bytes decrypt to until the guest writes it, as after `cryptsetup resize`.
    pub fn grow(&self, file: &File, new: u64, block_device: bool) -> Result<(), super::GrowError> {
        use super::GrowError;
        let h = &self.vol.header;
        if h.data_size.is_some() {
            return Err(GrowError::Image(ImageError::Unsupported(
                "this LUKS2 data segment has a fixed size in its header".into(),
            )));
        }
        let s = u64::from(h.sector_size);
        if !new.is_multiple_of(s) {
            return Err(GrowError::Image(ImageError::Unsupported(format!(
                "{new} bytes is not a whole number of the volume's {s}-byte sectors"
            ))));
        }
        if block_device {
            return Err(GrowError::Image(ImageError::Unsupported(
                "an encrypted block device grows with the device".into(),
            )));
        }
        file.set_len(self.host(new)).map_err(GrowError::Io)?;
        file.sync_all().map_err(GrowError::Io)?;
        Ok(())
    }
}
