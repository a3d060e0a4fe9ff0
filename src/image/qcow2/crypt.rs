//! LUKS-encrypted qcow2 images (QEMU's `encrypt.format=luks`): the LUKS header lives in
//! clusters of the file (the header extension says where); each data cluster is encrypted
//! in 512-byte sectors whose IV is the sector's host offset / 512. Metadata is not
//! encrypted. The image is unlocked by its opener (`image::open`) and handed its volume.

use std::sync::Arc;

use super::Qcow2Image;
use crate::crypt::Volume;
use crate::image::ImageError;
use crate::io::aligned::write_all_aligned;
use crate::io::bounce::AlignedBuf;
use crate::io::Storage;

impl Qcow2Image {
    /// Where the LUKS header is (offset, length), for an encrypted image.
    pub fn crypt_region(&self) -> Option<(u64, u64)> {
        self.crypt_region
    }

    /// Hand an encrypted image its unlocked volume (once).
    pub fn set_crypt(&self, vol: Arc<Volume>) {
        let _ = self.crypt.set(vol);
    }

    /// The volume of an encrypted image.
    pub fn crypt(&self) -> Option<&Volume> {
        self.crypt.get().map(|v| &**v)
    }

    /// Write guest data at host offset `host`: encrypted first in an encrypted image.
    pub(super) fn put_data(
        &self,
        file: &dyn Storage,
        host: u64,
        data: &[u8],
    ) -> Result<(), ImageError> {
        match self.crypt() {
            None => write_all_aligned(file, host, data).map_err(ImageError::Io),
            Some(v) => {
                let mut buf = AlignedBuf::new(data.len().max(1), 4096).map_err(ImageError::Io)?;
                let b = &mut buf.as_mut_slice()[..data.len()];
                b.copy_from_slice(data);
                v.encrypt(b, host);
                file.write_all_at(b, host).map_err(ImageError::Io)
            }
        }
    }

    /// Is this image encrypted (data clusters must be written whole: a hole in one would
    /// read back as noise, not zeroes)?
    pub(super) fn encrypted(&self) -> bool {
        self.crypt_region.is_some()
    }
}
