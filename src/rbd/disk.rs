//! An RBD image being served: connected, opened and locked, librbd's cache set from `--cache`,
//! watched for resizes made in the cluster; and the synchronous parts: flush, resize, close,
//! giving the lock up. Its data goes through the librbd engine (`engine`), one per queue.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use log::{info, warn};

use super::librbd::{Cluster, ConnectOptions, RbdError, RbdImage, UpdateFn};
use super::{CephOptions, RbdCache, RbdSpec};
use crate::locks::Locked;

/// Why an RBD image cannot be served.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    /// An option that does not fit this image.
    #[error("{0}")]
    Option(String),
    /// The cluster or the image: the reason, what to check.
    #[error("{0}")]
    Remote(String),
}

/// Whether the exclusive lock is taken (`--locking`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LockPolicy {
    /// Not taken.
    Off,
    /// Taken where the image has the exclusive-lock feature; a warning where not.
    Auto,
    /// Taken; an image without the feature is refused.
    On,
}

/// How to open an image.
#[derive(Clone, Debug)]
pub struct OpenRequest<'a> {
    pub spec: RbdSpec,
    /// The image as the user named it, for messages.
    pub name: String,
    pub ceph: &'a CephOptions,
    pub read_only: bool,
    pub lock: LockPolicy,
    /// The guest's block size: the image must hold at least one.
    pub block_size: u32,
    /// A migration destination's image: a read-only handle, no lock (taken over later).
    pub incoming: bool,
}

/// An RBD image being served.
pub struct RbdDisk {
    pub img: Arc<RbdImage>,
    /// librbd's write-back cache is on (the guest sees a volatile write cache).
    pub cached: bool,
    /// The size when opened.
    pub size: u64,
    /// Opened read-only (asked, a snapshot, or incoming).
    pub read_only: bool,
    /// This process holds the exclusive lock (released by `release_lock`).
    locked: AtomicBool,
    pub name: String,
    /// What the update watch calls (kept for the handle a live migration's take-over opens).
    on_update: Mutex<Option<UpdateFn>>,
}

fn rbd_err(e: RbdError) -> OpenError {
    OpenError::Remote(e.to_string())
}

/// librbd's options for a `--cache` mode (QEMU's mapping: `none` turns librbd's cache off).
fn cache_settings(c: RbdCache) -> Vec<(String, String)> {
    let kv = |k: &str, v: &str| (k.to_owned(), v.to_owned());
    match c {
        RbdCache::Off => vec![kv("rbd_cache", "false")],
        RbdCache::Writeback => vec![kv("rbd_cache", "true")],
        // A cache that never holds dirty data: reads cached, writes through.
        RbdCache::Writethrough => vec![kv("rbd_cache", "true"), kv("rbd_cache_max_dirty", "0")],
    }
}

fn connect(c: &CephOptions) -> Result<Arc<Cluster>, OpenError> {
    Cluster::connect(&ConnectOptions {
        conf: c.conf.clone(),
        id: c.id.clone(),
        keyring: c.keyring.clone(),
        timeout: c.timeout,
        op_timeout: c.op_timeout,
        settings: cache_settings(c.cache),
    })
    .map_err(rbd_err)
}

/// Does librbd, as configured now, keep dirty data in its cache?
fn caches_writes(cluster: &Cluster) -> Result<bool, OpenError> {
    let on = cluster.conf_get("rbd_cache").map_err(rbd_err)? == "true";
    let max_dirty = cluster.conf_get("rbd_cache_max_dirty").map_err(rbd_err)?;
    Ok(on && max_dirty.trim() != "0")
}

/// Open an RBD image as `req` says.
pub fn open(req: OpenRequest<'_>) -> Result<RbdDisk, OpenError> {
    let OpenRequest {
        spec, name, ceph, ..
    } = req;
    let t0 = Instant::now();
    let cluster = connect(ceph)?;
    let cached = caches_writes(&cluster)?;
    let read_only = req.read_only || req.incoming || spec.snapshot.is_some();
    let img = RbdImage::open(cluster, &spec, read_only).map_err(rbd_err)?;
    let size = img.size().map_err(rbd_err)?;
    if size < u64::from(req.block_size) {
        return Err(OpenError::Option(format!(
            "{name}: {size} bytes, smaller than one {}-byte block",
            req.block_size
        )));
    }
    let locked = if read_only || req.lock == LockPolicy::Off {
        false
    } else {
        lock(&img, &name, req.lock, ceph.lock_wait)?
    };
    info!(
        "{name}: connected as client.{} and opened in {} ms ({size} bytes, librbd cache {}{})",
        ceph.id,
        t0.elapsed().as_millis(),
        match ceph.cache {
            RbdCache::Off => "off",
            RbdCache::Writeback => "write-back",
            RbdCache::Writethrough => "write-through",
        },
        if locked { ", exclusive lock held" } else { "" }
    );
    Ok(RbdDisk {
        img: Arc::new(img),
        cached,
        size,
        read_only,
        locked: AtomicBool::new(locked),
        name,
        on_update: Mutex::new(None),
    })
}

/// Take the exclusive lock, waiting a while for another client to give it up. Images without
/// the exclusive-lock feature cannot be locked: `--locking on` refuses them, `auto` warns.
/// (`--ceph-lock-wait`: a migration source handing it over; a killed client's lock is broken
/// once its watch times out, after about 30 s.)
fn lock(img: &RbdImage, name: &str, mode: LockPolicy, wait: Duration) -> Result<bool, OpenError> {
    if !img.has_exclusive_lock_feature().map_err(rbd_err)? {
        let why = format!(
            "{name} has no exclusive-lock feature: nothing stops a second writer (rbd \
             feature enable {} exclusive-lock)",
            name.trim_start_matches("rbd:")
        );
        if mode == LockPolicy::On {
            return Err(OpenError::Remote(format!("{why} (--locking on)")));
        }
        warn!("{why}");
        return Ok(false);
    }
    let t0 = Instant::now();
    let mut said = false;
    loop {
        match img.lock_exclusive() {
            Ok(()) => return Ok(true),
            Err(e)
                if matches!(e.errno, libc::EBUSY | libc::EROFS | libc::EAGAIN)
                    && t0.elapsed() < wait =>
            {
                if !said {
                    info!("{name}: another client holds the exclusive lock; waiting for it");
                    said = true;
                }
                std::thread::sleep(Duration::from_millis(200));
            }
            Err(e) => {
                return Err(OpenError::Remote(format!(
                    "{name}: in use by another client: {e} (`rbd lock ls` and `rbd status` \
                     show who; --locking off serves it anyway, at the risk of two writers)"
                )))
            }
        }
    }
}

impl RbdDisk {
    /// Call `f` (on a librbd thread) whenever the image's header changes in the cluster.
    pub fn watch(&self, f: UpdateFn) -> Result<(), String> {
        self.img.watch(f.clone()).map_err(|e| e.to_string())?;
        *self.on_update.locked() = Some(f);
        Ok(())
    }

    pub fn watcher(&self) -> Option<UpdateFn> {
        self.on_update.locked().clone()
    }

    /// Everything completed so far in the cluster.
    pub fn sync(&self) -> std::io::Result<()> {
        self.img.flush_sync().map_err(std::io::Error::from)
    }

    /// Close librbd's handle and the cluster connection (a clean exit).
    pub fn disconnect(&self) {
        self.img.close();
        info!(
            "{}: closed (watch removed, cluster connection shut down)",
            self.name
        );
    }

    pub fn release_lock(&self) {
        if self.locked.swap(false, Ordering::AcqRel) {
            if let Err(e) = self.img.unlock() {
                warn!("{}: {e}", self.name);
            }
        }
    }

    /// The size to grow to: `new`, or (None) the image's size in the cluster now; the
    /// image is resized when it is smaller.
    pub fn grow(&self, new: Option<u64>) -> Result<u64, String> {
        let now = self.img.size().map_err(|e| e.to_string())?;
        match new {
            None => Ok(now),
            Some(n) if n > now => {
                self.img.resize(n).map_err(|e| e.to_string())?;
                Ok(n)
            }
            Some(n) => Ok(n),
        }
    }
}

impl From<RbdError> for std::io::Error {
    fn from(e: RbdError) -> Self {
        std::io::Error::new(
            std::io::Error::from_raw_os_error(e.errno).kind(),
            e.to_string(),
        )
    }
}
