//! Ceph RBD images (`--blk-file rbd:POOL/IMAGE[@SNAPSHOT]`, cargo feature `rbd`): opened
//! through librbd, served like raw images (the guest's byte N is the image's byte N) by the
//! librbd engine (`rbd::RbdEngine`). This room connects, opens and locks, sets librbd's cache
//! from `--cache`, watches the image for resizes made in the cluster, and does the
//! synchronous parts: flush, resize, close, giving the lock up.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use log::{info, warn};

use super::lock::Locking;
use super::open::{CephOptions, RbdCache};
use super::{Image, ImageError, ImageOpenError, ImageOptions, Kind, RawFacts};
use crate::io::align::DioAlign;
use crate::locks::Locked;
use crate::rbd::{Cluster, ConnectOptions, RbdError, RbdImage, RbdSpec};

/// An RBD image being served.
pub(super) struct RbdDisk {
    pub(super) img: Arc<RbdImage>,
    /// librbd's write-back cache is on (the guest sees a volatile write cache).
    pub(super) cached: bool,
    /// This process holds the exclusive lock (released by `release_locks`).
    locked: AtomicBool,
    pub(super) name: String,
    /// What the update watch calls (kept for the handle a live migration's take-over opens).
    pub(super) on_update: Mutex<Option<crate::rbd::UpdateFn>>,
}

/// The spec of `opts.path` if it names an RBD image.
pub(super) fn spec_of(opts: &ImageOptions) -> Option<Result<RbdSpec, ImageOpenError>> {
    let s = opts.path.to_str()?;
    RbdSpec::parse(s).map(|r| r.map_err(ImageOpenError::Option))
}

fn rbd_err(e: RbdError) -> ImageOpenError {
    ImageOpenError::Remote(e.to_string())
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

fn connect(c: &CephOptions) -> Result<Arc<Cluster>, ImageOpenError> {
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
fn caches_writes(cluster: &Cluster) -> Result<bool, ImageOpenError> {
    let on = cluster.conf_get("rbd_cache").map_err(rbd_err)? == "true";
    let max_dirty = cluster.conf_get("rbd_cache_max_dirty").map_err(rbd_err)?;
    Ok(on && max_dirty.trim() != "0")
}

/// Open an RBD image as `opts` say. `incoming`: a migration destination's image (read-only
/// handle, no lock, inactive until taken over).
pub(super) fn open(
    opts: &ImageOptions,
    spec: RbdSpec,
    incoming: bool,
) -> Result<(Image, DioAlign, RawFacts), ImageOpenError> {
    let name = opts.path.display().to_string();
    let t0 = Instant::now();
    let cluster = connect(&opts.ceph)?;
    let cached = caches_writes(&cluster)?;
    let read_only = opts.read_only || incoming || spec.snapshot.is_some();
    let img = RbdImage::open(cluster, &spec, read_only).map_err(rbd_err)?;
    let size = img.size().map_err(rbd_err)?;
    if size < u64::from(opts.logical_block_size) {
        return Err(ImageOpenError::Option(format!(
            "{name}: {size} bytes, smaller than one {}-byte block",
            opts.logical_block_size
        )));
    }
    let locked = if read_only || opts.locking == Locking::Off {
        false
    } else {
        lock(&img, &name, opts.locking, opts.ceph.lock_wait)?
    };
    info!(
        "{name}: connected as client.{} and opened in {} ms ({size} bytes, librbd cache {}{})",
        opts.ceph.id,
        t0.elapsed().as_millis(),
        match opts.ceph.cache {
            RbdCache::Off => "off",
            RbdCache::Writeback => "write-back",
            RbdCache::Writethrough => "write-through",
        },
        if locked { ", exclusive lock held" } else { "" }
    );
    let facts = RawFacts {
        is_block_device: false,
        dev_ino: super::remote::identity(&name),
        file_size_bytes: size,
        write_cache: Some(cached),
    };
    // Nothing reads or writes this: every path of an RBD image goes to librbd. /dev/null,
    // read-only, so that a path that forgot fails loudly instead of losing data.
    let kind = Kind::Rbd(RbdDisk {
        img: Arc::new(img),
        cached,
        locked: AtomicBool::new(locked),
        name,
        on_update: Mutex::new(None),
    });
    Ok((
        Image::remote(kind, size, read_only, !incoming)?,
        DioAlign::NONE,
        facts,
    ))
}

/// Take the exclusive lock, waiting a while for another client to give it up. Images without
/// the exclusive-lock feature cannot be locked: `--locking on` refuses them, `auto` warns.
/// (`--ceph-lock-wait`: a migration source handing it over; a killed client's lock is broken
/// once its watch times out, after about 30 s.)
fn lock(img: &RbdImage, name: &str, mode: Locking, wait: Duration) -> Result<bool, ImageOpenError> {
    if !img.has_exclusive_lock_feature().map_err(rbd_err)? {
        let why = format!(
            "{name} has no exclusive-lock feature: nothing stops a second writer (rbd \
             feature enable {} exclusive-lock)",
            name.trim_start_matches("rbd:")
        );
        if mode == Locking::On {
            return Err(ImageOpenError::Remote(format!("{why} (--locking on)")));
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
                return Err(ImageOpenError::Remote(format!(
                    "{name}: in use by another client: {e} (`rbd lock ls` and `rbd status` \
                     show who; --locking off serves it anyway, at the risk of two writers)"
                )))
            }
        }
    }
}

impl RbdDisk {
    /// Call `f` (on a librbd thread) whenever the image's header changes in the cluster.
    pub(super) fn watch(&self, f: crate::rbd::UpdateFn) -> Result<(), String> {
        self.img.watch(f.clone()).map_err(|e| e.to_string())?;
        *self.on_update.locked() = Some(f);
        Ok(())
    }

    pub(super) fn watcher(&self) -> Option<crate::rbd::UpdateFn> {
        self.on_update.locked().clone()
    }

    /// Everything completed so far in the cluster.
    pub(super) fn sync(&self) -> Result<(), ImageError> {
        self.img.flush_sync().map_err(|e| ImageError::Io(e.into()))
    }

    /// Close librbd's handle and the cluster connection (a clean exit).
    pub(super) fn disconnect(&self) {
        self.img.close();
        info!(
            "{}: closed (watch removed, cluster connection shut down)",
            self.name
        );
    }

    pub(super) fn release_lock(&self) {
        if self.locked.swap(false, Ordering::AcqRel) {
            if let Err(e) = self.img.unlock() {
                warn!("{}: {e}", self.name);
            }
        }
    }

    /// The size to grow to: `new`, or (None) the image's size in the cluster now; the
    /// image is resized when it is smaller.
    pub(super) fn grow(&self, new: Option<u64>) -> Result<u64, String> {
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
