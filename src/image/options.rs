//! What opening an image is told ([`ImageOptions`], every option passed once), what it
//! learns of the file ([`RawFacts`]), and why it fails ([`ImageOpenError`]).

use std::path::PathBuf;

use super::chain::ChainError;
use super::lock::{LockError, Locking};
use super::parallels::{ParallelsError, PreallocMode};
use super::qcow2::Qcow2Error;
use super::OpenError;
use crate::rbd::CephOptions;

/// Image formats (`--format`, `vublk create --format`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// Raw image: guest sector N is byte N*512 of the file.
    Raw,
    /// qcow2 (versions 2 and 3).
    Qcow2,
    /// Parallels (Virtuozzo) images, both magics.
    Parallels,
    /// LUKS1 or LUKS2 encryption (aes-xts-plain64) of raw data: needs --key-secret.
    Luks,
}

/// `--prealloc`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum PreallocChoice {
    On,
    Off,
    /// On when the file system's block device says it is not rotational, or is a virtual
    /// disk (virtio-blk, Xen) that cannot know.
    Auto,
}

/// Everything about how an image is opened and served, decided once.
#[derive(Clone, Debug)]
pub struct ImageOptions {
    pub path: PathBuf,
    /// None: probe by magic (then guest writes that would plant a format header are refused).
    pub format: Option<Format>,
    /// The secret of an encrypted image (`--key-secret`).
    pub key: Option<crate::crypt::Key>,
    /// Helper threads for the encryption of large requests.
    pub crypt_threads: usize,
    pub read_only: bool,
    /// O_DIRECT (`--cache none`).
    pub direct: bool,
    /// The guest's block size: a raw image must hold at least one.
    pub logical_block_size: u32,
    /// Follow qcow2 backing files (else refuse images that have one).
    pub follow_backing: bool,
    /// `--locking`: QEMU's image locks on the image and its backing files.
    pub locking: Locking,
    /// With `read_only`: share everything (`--force-share`).
    pub force_share: bool,
    /// qcow2 L2 cache bytes (None: the image's default).
    pub l2_cache_bytes: Option<u64>,
    /// Clusters freed by discards are punched (`--discard unmap`).
    pub discard_unmap: bool,
    pub prealloc: PreallocChoice,
    pub prealloc_size: u64,
    pub prealloc_align: u64,
    /// Parallels growth mode.
    pub prealloc_mode: PreallocMode,
    /// `--compress-writes on` (qcow2).
    pub compress: Option<CompressChoice>,
    /// `--cow-threads`.
    pub cow_threads: usize,
    /// How an RBD image (`rbd:POOL/IMAGE`) is reached and cached.
    pub ceph: CephOptions,
    /// How an NBD export is reached.
    pub nbd: crate::nbd::client::NbdOptions,
}

/// `--compressed-cache`, `--compressed-cache-size` and `--compress-threads`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CompressChoice {
    pub cache: bool,
    /// None: [`qcow2::DEFAULT_COMPRESSED_CACHE_CLUSTERS`].
    pub cache_bytes: Option<u64>,
    pub threads: usize,
}

/// Why an image cannot be served.
#[derive(Debug, thiserror::Error)]
pub enum ImageOpenError {
    #[error(transparent)]
    File(#[from] OpenError),
    #[error(transparent)]
    Chain(#[from] ChainError),
    #[error(transparent)]
    Lock(#[from] LockError),
    #[error("image {}", .path.display())]
    Qcow2 {
        path: PathBuf,
        #[source]
        source: Qcow2Error,
    },
    #[error("image {}", .path.display())]
    Parallels {
        path: PathBuf,
        #[source]
        source: ParallelsError,
    },
    #[error("image {}", .path.display())]
    Luks {
        path: PathBuf,
        #[source]
        source: crate::crypt::LuksError,
    },
    /// An option that does not fit this image (like other bad options: exit status 2).
    #[error("{0}")]
    Option(String),
    /// A Ceph cluster, RBD image or NBD server that cannot be served: the reason, what to
    /// check.
    #[error("{0}")]
    Remote(String),
}

/// Facts about the image file the device model needs.
#[derive(Clone, Copy, Debug)]
pub struct RawFacts {
    /// DISCARD uses BLKDISCARD.
    pub is_block_device: bool,
    /// st_dev and st_ino, for a stable default serial.
    pub dev_ino: (u64, u64),
    /// The file's (or block device's) own size.
    pub file_size_bytes: u64,
    /// Whether the storage keeps written data in a volatile cache, where the image says so
    /// itself (RBD: librbd's cache); None: as `--cache` says.
    pub write_cache: Option<bool>,
}
