//! Raw images and block devices.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// Why an image could not be opened; each says what to check.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    #[error("image {0} does not exist (create it, e.g. `truncate -s 8G {0}`)")]
    Missing(PathBuf),
    #[error("image {0} is a directory, not a file or block device")]
    Directory(PathBuf),
    #[error("image {0} is neither a regular file nor a block device")]
    NotAFile(PathBuf),
    #[error("cannot open image {path}")]
    Open {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot open image {0} with O_DIRECT (cache=none); its filesystem may not support it: try --cache writeback")]
    NoDirect(PathBuf),
    #[error("cannot read the size of image {path}")]
    Size {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("image {path} is {size} bytes, smaller than one {block}-byte block")]
    TooSmall {
        path: PathBuf,
        size: u64,
        block: u32,
    },
}

/// An open raw image.
#[derive(Debug)]
pub struct RawImage {
    pub file: File,
    pub size_bytes: u64,
    pub is_block_device: bool,
    /// st_dev and st_ino, for a stable default serial.
    pub dev_ino: (u64, u64),
}

/// Open a raw image or block device.
pub fn open_raw(
    path: &Path,
    read_only: bool,
    direct: bool,
    block: u32,
) -> Result<RawImage, OpenError> {
    let meta = std::fs::metadata(path).map_err(|e| match e.kind() {
        io::ErrorKind::NotFound => OpenError::Missing(path.to_owned()),
        _ => OpenError::Open {
            path: path.to_owned(),
            source: e,
        },
    })?;
    let ft = meta.file_type();
    if ft.is_dir() {
        return Err(OpenError::Directory(path.to_owned()));
    }
    if !ft.is_file() && !ft.is_block_device() {
        return Err(OpenError::NotAFile(path.to_owned()));
    }
    let mut o = OpenOptions::new();
    o.read(true).write(!read_only);
    if direct {
        o.custom_flags(libc::O_DIRECT);
    }
    let file = o.open(path).map_err(|e| {
        if direct && e.raw_os_error() == Some(libc::EINVAL) {
            OpenError::NoDirect(path.to_owned())
        } else {
            OpenError::Open {
                path: path.to_owned(),
                source: e,
            }
        }
    })?;
    let size_bytes = if ft.is_block_device() {
        block_device_size(&file).map_err(|e| OpenError::Size {
            path: path.to_owned(),
            source: e,
        })?
    } else {
        meta.len()
    };
    if size_bytes < u64::from(block) {
        return Err(OpenError::TooSmall {
            path: path.to_owned(),
            size: size_bytes,
            block,
        });
    }
    Ok(RawImage {
        file,
        size_bytes,
        is_block_device: ft.is_block_device(),
        dev_ino: (meta.dev(), meta.ino()),
    })
}

/// _IOR(0x12, 114, size_t): the block device's size in bytes (linux/fs.h).
const BLKGETSIZE64: libc::c_ulong = 0x8008_1272;

fn block_device_size(file: &File) -> io::Result<u64> {
    let mut size: u64 = 0;
    // SAFETY: BLKGETSIZE64 writes one u64 through the pointer.
    let r = unsafe { libc::ioctl(file.as_raw_fd(), BLKGETSIZE64, &mut size) };
    if r == 0 {
        Ok(size)
    } else {
        Err(io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(tag: &str) -> PathBuf {
        let d = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("target/unit-tmp")
            .join(format!("{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn missing_image_says_so() {
        let d = dir("raw-missing");
        let e = open_raw(&d.join("nope.img"), false, false, 512).unwrap_err();
        assert!(matches!(e, OpenError::Missing(_)));
        assert!(e.to_string().contains("does not exist"));
    }

    #[test]
    fn directory_is_refused() {
        let d = dir("raw-dir");
        let e = open_raw(&d, false, false, 512).unwrap_err();
        assert!(matches!(e, OpenError::Directory(_)), "{e}");
    }

    #[test]
    fn too_small_image_is_refused() {
        let d = dir("raw-small");
        let p = d.join("small.img");
        std::fs::write(&p, [0u8; 100]).unwrap();
        assert!(matches!(
            open_raw(&p, false, false, 512),
            Err(OpenError::TooSmall { .. })
        ));
    }

    #[test]
    fn size_comes_from_the_file() {
        let d = dir("raw-size");
        let p = d.join("a.img");
        let f = File::create(&p).unwrap();
        f.set_len(3 << 20).unwrap();
        let img = open_raw(&p, true, false, 512).unwrap();
        assert_eq!(img.size_bytes, 3 << 20);
        assert!(!img.is_block_device);
    }
}
