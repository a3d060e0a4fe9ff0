//! Disks without a file here: an NBD export (`nbd::client`) or a Ceph RBD image (`rbd`,
//! cargo feature), opened through their drivers and served like raw images (the guest's
//! byte N is the disk's byte N) by the drivers' engines; and the null disk
//! (`null:SIZE[?OPTIONS]`), which stores nothing, for measuring the backend alone. What a
//! local image does with its file (sync, close, locks, resize) a remote disk does through its
//! driver.

use std::io;

use super::engine::Engine;
use super::{Disk, GrowError, Image, ImageError, ImageOpenError, ImageOptions, RawFacts};
use crate::io::align::DioAlign;
use crate::io::{NullEngine, NullOptions};
use crate::nbd::client::{NbdConnection, NbdDisk, NbdEngine, OpenError as NbdOpenError};
use crate::nbd::NbdTarget;

/// A remote disk being served.
pub(super) enum Remote {
    Nbd(NbdDisk),
    #[cfg(feature = "rbd")]
    Rbd(crate::rbd::RbdDisk),
    Null(NullOptions),
}

/// The largest null disk (QEMU's and the virtio capacity's bound, in bytes: 2^63).
const NULL_MAX: u64 = 1 << 63;
/// The longest latency a null disk injects.
const NULL_MAX_LATENCY_NS: u64 = 10_000_000_000;

/// `null:SIZE[?read-zeroes=on|off][&latency-ns=N]`: the size and options of a null disk, if
/// `s` names one.
pub fn parse_null(s: &str) -> Option<Result<(u64, NullOptions), String>> {
    let rest = s.strip_prefix("null:")?;
    let bad = |m: String| Some(Err(format!("{s}: {m}")));
    let (size, query) = rest.split_once('?').unwrap_or((rest, ""));
    let size = match crate::units::parse_size(size) {
        Some(n) if n > 0 && n % 512 == 0 && n <= NULL_MAX => n,
        _ => {
            return bad(format!(
                "the size {size:?} must be a multiple of 512 bytes from 512 to 8E (e.g. \
                 null:64G)"
            ))
        }
    };
    let mut opts = NullOptions::default();
    for kv in query.split('&').filter(|kv| !kv.is_empty()) {
        match kv.split_once('=') {
            Some(("read-zeroes", "on")) => opts.read_zeroes = true,
            Some(("read-zeroes", "off")) => opts.read_zeroes = false,
            Some(("latency-ns", n)) => match n.parse::<u64>() {
                Ok(n) if n <= NULL_MAX_LATENCY_NS => {
                    opts.latency = std::time::Duration::from_nanos(n)
                }
                _ => {
                    return bad(format!(
                        "latency-ns={n}: a number of nanoseconds up to 10 s"
                    ))
                }
            },
            _ => {
                return bad(format!(
                    "{kv:?}: the options are read-zeroes=on|off and latency-ns=N"
                ))
            }
        }
    }
    Some(Ok((size, opts)))
}

/// Open the remote disk `opts.path` names, if it names one (an NBD URI, `rbd:...`).
/// `incoming`: a live migration's destination, which serves nothing until it takes the disk
/// over.
pub(super) fn open(
    opts: &ImageOptions,
    incoming: bool,
) -> Option<Result<(Image, DioAlign, RawFacts), ImageOpenError>> {
    let s = opts.path.to_str()?;
    if let Some(null) = parse_null(s) {
        return Some(
            null.map_err(ImageOpenError::Option)
                .map(|(size, null)| open_null(s, size, null, opts.read_only, incoming)),
        );
    }
    if crate::nbd::is_nbd_uri(s) {
        return Some(
            NbdTarget::parse(s)
                .map_err(ImageOpenError::Option)
                .and_then(|t| open_nbd(opts, t, incoming)),
        );
    }
    let spec = crate::rbd::RbdSpec::parse(s)?;
    Some(
        spec.map_err(ImageOpenError::Option)
            .and_then(|spec| open_rbd(opts, spec, incoming)),
    )
}

fn open_null(
    name: &str,
    size: u64,
    null: NullOptions,
    read_only: bool,
    incoming: bool,
) -> (Image, DioAlign, RawFacts) {
    let facts = RawFacts {
        is_block_device: false,
        dev_ino: identity(name),
        file_size_bytes: size,
        // A volatile cache, as QEMU's null-co shows: the guest flushes, which cost nothing.
        write_cache: Some(true),
    };
    (
        Image::remote(Remote::Null(null), size, read_only, !incoming),
        DioAlign::NONE,
        facts,
    )
}

fn open_nbd(
    opts: &ImageOptions,
    target: NbdTarget,
    incoming: bool,
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
    // An NBD export has no locks nor metadata: what is read now holds when it is taken over.
    Ok((
        Image::remote(Remote::Nbd(disk), size, read_only, !incoming),
        DioAlign::NONE,
        facts,
    ))
}

#[cfg(feature = "rbd")]
fn open_rbd(
    opts: &ImageOptions,
    spec: crate::rbd::RbdSpec,
    incoming: bool,
) -> Result<(Image, DioAlign, RawFacts), ImageOpenError> {
    use super::lock::Locking;
    use crate::rbd::{LockPolicy, OpenError, OpenRequest};
    let name = opts.path.display().to_string();
    let disk = crate::rbd::open(OpenRequest {
        spec,
        name: name.clone(),
        ceph: &opts.ceph,
        read_only: opts.read_only,
        lock: match opts.locking {
            Locking::Off => LockPolicy::Off,
            Locking::Auto => LockPolicy::Auto,
            Locking::On => LockPolicy::On,
        },
        block_size: opts.logical_block_size,
        incoming,
    })
    .map_err(|e| match e {
        OpenError::Option(m) => ImageOpenError::Option(m),
        OpenError::Remote(m) => ImageOpenError::Remote(m),
    })?;
    let facts = RawFacts {
        is_block_device: false,
        dev_ino: identity(&name),
        file_size_bytes: disk.size,
        write_cache: Some(disk.cached),
    };
    let (size, read_only) = (disk.size, disk.read_only);
    Ok((
        Image::remote(Remote::Rbd(disk), size, read_only, !incoming),
        DioAlign::NONE,
        facts,
    ))
}

#[cfg(not(feature = "rbd"))]
fn open_rbd(
    opts: &ImageOptions,
    _: crate::rbd::RbdSpec,
    _: bool,
) -> Result<(Image, DioAlign, RawFacts), ImageOpenError> {
    Err(ImageOpenError::Option(format!(
        "{}: this vublk was built without Ceph RBD support (cargo build --features rbd, with \
         Debian's librbd-dev)",
        opts.path.display()
    )))
}

/// A stable identity for the default serial of a disk without a file: its name, hashed
/// (FNV-1a).
fn identity(name: &str) -> (u64, u64) {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for b in name.bytes() {
        h = (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
    }
    (0x0072_6264, h)
}

/// Allocated extents (offset, length), and where the answer that lists them ends.
pub(super) type Allocated = (Vec<(u64, u64)>, u64);

impl Remote {
    /// Engines for `queues` queues: an NBD connection each (one shared by all where the
    /// server allows only one), a librbd engine each on the one image handle.
    pub(super) fn queue_engines(&self, queues: u16) -> io::Result<Vec<Engine>> {
        match self {
            Remote::Nbd(n) => {
                let connect = || NbdEngine::connect(n.target.clone(), n.export, n.opts);
                if queues > 1 && !n.export.has(crate::nbd::wire::FLAG_CAN_MULTI_CONN) {
                    // The thread ends when the last queue's engine is gone.
                    let conn = NbdConnection::start(connect()?)?;
                    (0..queues)
                        .map(|_| conn.queue().map(Engine::NbdShared))
                        .collect()
                } else {
                    (0..queues).map(|_| connect().map(Engine::Nbd)).collect()
                }
            }
            #[cfg(feature = "rbd")]
            Remote::Rbd(r) => (0..queues)
                .map(|_| crate::rbd::RbdEngine::new(r.img.clone(), r.cached).map(Engine::Rbd))
                .collect(),
            Remote::Null(o) => (0..queues)
                .map(|_| NullEngine::new(*o).map(Engine::Null))
                .collect(),
        }
    }

    /// Can `engine`, made for another disk, serve this one once bound to it (see
    /// [`Image::engine_fits`])? A librbd engine can; an NBD one holds a connection to its
    /// own export.
    pub(super) fn engine_fits(&self, engine: &Engine) -> bool {
        match (self, engine) {
            #[cfg(feature = "rbd")]
            (Remote::Rbd(_), Engine::Rbd(_)) => true,
            (Remote::Null(_), Engine::Null(_)) => true,
            _ => false,
        }
    }

    /// Point `engine` at this disk (the handle a live migration's take-over opened).
    pub(super) fn bind(&self, engine: &mut Engine) {
        match (self, engine) {
            #[cfg(feature = "rbd")]
            (Remote::Rbd(r), Engine::Rbd(e)) => e.set_image(r.img.clone(), r.cached),
            // An NBD engine holds its own connection to the same export.
            _ => {}
        }
    }

    pub(super) fn sync(&self) -> Result<(), ImageError> {
        match self {
            // The disk holds no connection: each queue's flushes its own, on the guest's
            // FLUSH and when the queue stops.
            Remote::Nbd(_) => Err(ImageError::Unsupported(
                "an NBD export is flushed by the guest's FLUSH and when its queues stop, not \
                 from here"
                    .into(),
            )),
            #[cfg(feature = "rbd")]
            Remote::Rbd(r) => Ok(r.sync()?),
            Remote::Null(_) => Ok(()),
        }
    }

    /// The allocated extents of [offset, offset + len) and where the answer ends, if the
    /// disk can tell (RBD: librbd's diff walk); None: it cannot (everything counts as data).
    pub(super) fn allocated(&self, offset: u64, len: u64) -> Option<Result<Allocated, ImageError>> {
        match self {
            Remote::Nbd(_) | Remote::Null(_) => {
                let _ = (offset, len);
                None
            }
            #[cfg(feature = "rbd")]
            Remote::Rbd(r) => Some(
                r.img
                    .allocated(offset, len)
                    .map_err(|e| ImageError::Unsupported(e.to_string())),
            ),
        }
    }

    pub(super) fn close(&self) -> Result<(), ImageError> {
        match self {
            // Each queue's connection was flushed when the queue stopped.
            Remote::Nbd(_) | Remote::Null(_) => Ok(()),
            #[cfg(feature = "rbd")]
            Remote::Rbd(r) => Ok(r.sync()?),
        }
    }

    pub(super) fn disconnect(&self) {
        #[cfg(feature = "rbd")]
        if let Remote::Rbd(r) = self {
            r.disconnect();
        }
    }

    pub(super) fn release_lock(&self) {
        #[cfg(feature = "rbd")]
        if let Remote::Rbd(r) = self {
            r.release_lock();
        }
    }

    /// The size to grow to (None: the disk's size now, where its driver can tell); the
    /// disk is resized where it is smaller.
    pub(super) fn grow(&self, new: Option<u64>) -> Result<u64, GrowError> {
        let _ = new;
        match self {
            Remote::Nbd(_) => Err(GrowError::Nbd),
            // Nothing to grow: the disk is its size.
            Remote::Null(_) => new.ok_or(GrowError::NoSize),
            #[cfg(feature = "rbd")]
            Remote::Rbd(r) => r.grow(new).map_err(GrowError::Rbd),
        }
    }
}

impl Image {
    /// A remote disk as an image.
    fn remote(remote: Remote, size: u64, read_only: bool, active: bool) -> Self {
        Image {
            disk: Disk::Remote(remote),
            size_bytes: std::sync::atomic::AtomicU64::new(size),
            read_only,
            block_device: false,
            prealloc_raw: false,
            guard_header: false,
            lock: std::sync::Mutex::new(super::lock::ImageLock::unlocked()),
            active: std::sync::atomic::AtomicBool::new(active),
        }
    }

    /// Call `f` (on a driver's thread) whenever the disk changes size elsewhere (an RBD
    /// image resized in the cluster). False: this disk tells no such thing.
    pub fn watch_resizes(&self, f: std::sync::Arc<dyn Fn() + Send + Sync>) -> Result<bool, String> {
        match &self.disk {
            #[cfg(feature = "rbd")]
            Disk::Remote(Remote::Rbd(r)) => r.watch(f).map(|()| true),
            _ => {
                let _ = f;
                Ok(false)
            }
        }
    }

    /// The resize watch `other` (the handle this one replaces) had, on this one too.
    pub(super) fn inherit_watch(&self, other: &Image) {
        #[cfg(feature = "rbd")]
        if let (Disk::Remote(Remote::Rbd(new)), Disk::Remote(Remote::Rbd(old))) =
            (&self.disk, &other.disk)
        {
            if let Some(f) = old.watcher() {
                if let Err(e) = new.watch(f) {
                    log::warn!("{}: resizes in the cluster go unseen: {e}", new.name);
                }
            }
        }
        #[cfg(not(feature = "rbd"))]
        let _ = other;
    }
}
