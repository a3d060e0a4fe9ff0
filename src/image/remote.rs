//! What images elsewhere (RBD, NBD) share: the stand-in file, their identity for the serial,
//! the options that do not apply to them, and the accessors their engines use.

use std::fs::File;

use super::{Image, ImageOpenError, ImageOptions, Kind, RawFacts};
use crate::io::align::DioAlign;
use crate::nbd::client::OpenError as NbdOpenError;
use crate::nbd::NbdTarget;

/// The NBD export `target` as an image (`nbd::client` connects and checks it).
pub(super) fn open_nbd(
    opts: &ImageOptions,
    target: NbdTarget,
) -> Result<(Image, DioAlign, RawFacts), ImageOpenError> {
    let name = target.to_string();
    let disk = crate::nbd::client::open(target, opts.nbd, opts.read_only, opts.logical_block_size)
        .map_err(|e| match e {
            NbdOpenError::Connect(m) => {
                ImageOpenError::Remote(format!("{m} (is the server up? --blk-file)"))
            }
            NbdOpenError::Option(m) => ImageOpenError::Option(m),
        })?;
    let facts = RawFacts {
        is_block_device: false,
        dev_ino: identity(&name),
        file_size_bytes: disk.export.size,
        // A server that takes FLUSH may hold written data in a cache until then.
        write_cache: Some(disk.cached),
    };
    let (size, read_only) = (disk.export.size, disk.read_only);
    Ok((
        Image::remote(Kind::Nbd(disk), size, read_only, true)?,
        DioAlign::NONE,
        facts,
    ))
}

/// A stable identity for the default serial of an image without a file: its name, hashed
/// (FNV-1a).
pub(super) fn identity(name: &str) -> (u64, u64) {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for b in name.bytes() {
        h = (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
    }
    (0x0072_6264, h)
}

impl Image {
    /// An image elsewhere (RBD, NBD): `file` is /dev/null, which nothing reads or writes
    /// (every path of such an image goes to its engine); read-only, so that a path that
    /// forgot fails loudly instead of losing data.
    pub(super) fn remote(
        kind: Kind,
        size: u64,
        read_only: bool,
        active: bool,
    ) -> Result<Self, ImageOpenError> {
        let file = File::open("/dev/null").map_err(|e| {
            ImageOpenError::Remote(format!("opening /dev/null (stands in for the file): {e}"))
        })?;
        Ok(Image {
            file,
            kind,
            size_bytes: std::sync::atomic::AtomicU64::new(size),
            read_only,
            block_device: false,
            prealloc_raw: false,
            guard_header: false,
            lock: std::sync::Mutex::new(super::lock::ImageLock::unlocked()),
            active: std::sync::atomic::AtomicBool::new(active),
        })
    }

    /// The RBD image this is, with whether librbd caches writes (for the librbd engine).
    #[cfg(feature = "rbd")]
    pub fn rbd(&self) -> Option<(std::sync::Arc<crate::rbd::RbdImage>, bool)> {
        match &self.kind {
            Kind::Rbd(r) => Some((r.img.clone(), r.cached)),
            _ => None,
        }
    }

    /// Call `f` (on a librbd thread) whenever the RBD image's header changes in the cluster.
    #[cfg(feature = "rbd")]
    pub fn watch_rbd_updates(&self, f: crate::rbd::UpdateFn) -> Result<(), String> {
        match &self.kind {
            Kind::Rbd(r) => r.watch(f),
            _ => Ok(()),
        }
    }

    /// The update watch `other` (the handle this one replaces) had, on this one too.
    pub(super) fn inherit_rbd_watch(&self, other: &Image) {
        #[cfg(feature = "rbd")]
        if let (Kind::Rbd(new), Kind::Rbd(old)) = (&self.kind, &other.kind) {
            if let Some(f) = old.watcher() {
                if let Err(e) = new.watch(f) {
                    log::warn!("{}: resizes in the cluster go unseen: {e}", new.name);
                }
            }
        }
        #[cfg(not(feature = "rbd"))]
        let _ = other;
    }

    /// The NBD export this is (for the NBD engine: where to connect, what it offers).
    pub fn nbd(
        &self,
    ) -> Option<(
        &crate::nbd::NbdTarget,
        &crate::nbd::Export,
        crate::nbd::client::NbdOptions,
    )> {
        match &self.kind {
            Kind::Nbd(n) => Some((&n.target, &n.export, n.opts)),
            _ => None,
        }
    }

    /// Is this image elsewhere (RBD, NBD), served by a network engine with raw semantics?
    pub fn is_remote(&self) -> bool {
        matches!(self.kind, Kind::Nbd(_)) || self.is_rbd()
    }

    /// Is this an RBD image (served by the librbd engine, not through a file)?
    pub fn is_rbd(&self) -> bool {
        #[cfg(feature = "rbd")]
        if let Kind::Rbd(_) = self.kind {
            return true;
        }
        false
    }
}
