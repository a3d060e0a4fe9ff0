//! The `backup-*` control methods (docs/backups.md): their parameters (untrusted JSON) and
//! the one atomic step of `backup-begin`.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use serde_json::{json, Value};

use super::{Backup, BackupExport, View, MAX_BACKUPS};
use crate::bitmaps::control::{number, object, string};
use crate::image::Image;
use crate::nbd::server::{Export, ExportError, Listen, Server};

/// Why a call fails.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    /// The parameters do not fit the method.
    #[error("{0}")]
    Params(String),
    /// Refused as asked (a checkpoint that exists, a disk that cannot, a socket in use).
    #[error("{0}")]
    Refused(String),
    #[error("unknown method {0:?}")]
    Unknown(String),
}

impl From<crate::bitmaps::control::CallError> for CallError {
    fn from(e: crate::bitmaps::control::CallError) -> Self {
        CallError::Params(e.to_string())
    }
}

/// The copy granule. A format with clusters: the cluster (a copy must hold every guest range
/// that shares a host cluster, which a write elsewhere in it may move). A raw file: 4 KiB,
/// so that a small guest write copies little (BENCHMARKS.md, "Backups"), but no finer than
/// 2^28 granules (32 MiB of marks). A remote disk: 64 KiB (its reads cost a round trip).
fn granule_of(unit: u64, local: bool, size: u64) -> u64 {
    let floor = (size >> 28).max(1).next_power_of_two();
    match (unit, local) {
        (0, true) => (4u64 << 10).max(floor),
        (0, false) => (64u64 << 10).max(floor),
        (u, _) => u.max(floor).next_power_of_two(),
    }
}

/// An export that answers nothing until its view is frozen.
struct Gated {
    ready: AtomicBool,
    inner: BackupExport,
}

impl Gated {
    fn check(&self) -> Result<(), ExportError> {
        if self.ready.load(Ordering::Acquire) {
            Ok(())
        } else {
            Err(ExportError::io("the backup is not started yet"))
        }
    }
}

impl Export for Gated {
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn read(&self, offset: u64, dst: &mut [u8]) -> Result<(), ExportError> {
        self.check()?;
        self.inner.read(offset, dst)
    }
    fn meta_contexts(&self) -> Vec<String> {
        self.inner.meta_contexts()
    }
    fn block_status(&self, c: &str, offset: u64, len: u32) -> Result<Vec<(u32, u32)>, ExportError> {
        self.check()?;
        self.inner.block_status(c, offset, len)
    }
}

/// A size in bytes (`vublk ctl` turns K, M, G into bytes before it asks).
fn size(m: &serde_json::Map<String, Value>, key: &str) -> Result<Option<u64>, CallError> {
    Ok(number(m, key)?)
}

/// What the methods need of the device; the control socket makes it from the `Device`
/// (this module does not reach up to it).
pub struct Disk<'a> {
    pub backups: &'a super::Backups,
    pub bitmaps: &'a crate::bitmaps::Bitmaps,
    pub image: Arc<Image>,
    /// The guest-visible size now.
    pub size: u64,
    /// Where the default scratch goes (the image's directory).
    pub image_path: &'a Path,
    /// Run a step between two guest requests (`Device::with_queues_paused`).
    pub paused: &'a dyn Fn(&mut dyn FnMut()),
    /// Write the persistent bitmaps (`Device::save_bitmaps`).
    pub save: crate::bitmaps::Save<'a>,
}

fn opt_string(m: &serde_json::Map<String, Value>, key: &str) -> Result<Option<String>, CallError> {
    if m.contains_key(key) {
        Ok(Some(string(m, key)?))
    } else {
        Ok(None)
    }
}

/// Answer the backup method `method`.
pub fn call(method: &str, params: &Value, dev: &Disk<'_>) -> Result<Value, CallError> {
    match method {
        "backup-begin" => begin(params, dev),
        "backup-end" => {
            let m = object(params, method, &["checkpoint"])?;
            let name = string(&m, "checkpoint")?;
            let b = dev
                .backups
                .remove(&name)
                .ok_or_else(|| CallError::Refused(format!("no backup of checkpoint {name:?}")))?;
            let info = b.info();
            log::info!(
                "backup {name:?} ended: {} bytes read, {} bytes copied before writes{}",
                info.bytes_read,
                info.copied_bytes,
                info.failed
                    .as_ref()
                    .map(|f| format!(", failed: {f}"))
                    .unwrap_or_default()
            );
            Ok(serde_json::to_value(info).unwrap_or(Value::Null))
        }
        "backup-list" => {
            object(params, method, &[])?;
            Ok(json!({ "backups": dev.backups.list() }))
        }
        _ => Err(CallError::Unknown(method.to_owned())),
    }
}

fn begin(params: &Value, dev: &Disk<'_>) -> Result<Value, CallError> {
    let image_path = dev.image_path;
    let m = object(
        params,
        "backup-begin",
        &[
            "checkpoint",
            "incremental",
            "socket",
            "listen",
            "export",
            "scratch",
            "scratch-max",
            "granularity",
        ],
    )?;
    let checkpoint = string(&m, "checkpoint")?;
    crate::bitmaps::check_name(&checkpoint).map_err(|e| CallError::Params(e.to_string()))?;
    let from = opt_string(&m, "incremental")?;
    let export = opt_string(&m, "export")?.unwrap_or_else(|| checkpoint.clone());
    if export.is_empty() || export.len() > 256 || export.contains(['/', '?', '#', '%']) {
        return Err(CallError::Params(
            "export: a name of 1 to 256 characters without / ? # %".into(),
        ));
    }
    let listen = match (opt_string(&m, "socket")?, opt_string(&m, "listen")?) {
        (Some(p), None) => Listen::Unix(PathBuf::from(p)),
        (None, Some(a)) => {
            let a: SocketAddr = a
                .parse()
                .map_err(|_| CallError::Params(format!("listen {a:?}: ADDRESS:PORT")))?;
            if !a.ip().is_loopback() {
                return Err(CallError::Refused(format!(
                    "listen {a}: the export has no TLS and no authentication; listen on a \
                     loopback address or a UNIX socket (and forward it, e.g. over SSH)"
                )));
            }
            Listen::Tcp(a)
        }
        _ => {
            return Err(CallError::Params(
                "give exactly one of socket (a path) or listen (127.0.0.1:PORT)".into(),
            ))
        }
    };
    // Default: next to a local image; /var/tmp (on disk, unlike /tmp often) for a remote one.
    let local = dev.image.file().is_some();
    let scratch = opt_string(&m, "scratch")?
        .map(PathBuf::from)
        .unwrap_or_else(|| match image_path.parent() {
            Some(p) if local && !p.as_os_str().is_empty() => p.to_path_buf(),
            _ if local => PathBuf::from("."),
            _ => PathBuf::from("/var/tmp"),
        });
    let scratch_max = size(&m, "scratch-max")?;
    let g = size(&m, "granularity")?.unwrap_or(crate::bitmaps::DEFAULT_GRANULARITY);
    crate::bitmaps::check_granularity(g).map_err(|e| CallError::Params(e.to_string()))?;

    let backups = dev.backups;
    if backups.len() >= MAX_BACKUPS {
        return Err(CallError::Refused(format!(
            "{MAX_BACKUPS} backups are running"
        )));
    }
    if backups.find(&checkpoint).is_some() {
        return Err(CallError::Refused(format!(
            "a backup of checkpoint {checkpoint:?} is running"
        )));
    }
    let from_bitmap = match &from {
        Some(f) => {
            let b = dev
                .bitmaps
                .get(f)
                .map_err(|e| CallError::Refused(e.to_string()))?;
            if !b.recording() {
                return Err(CallError::Refused(format!(
                    "checkpoint {f:?} is not recording: it does not hold every change up to now"
                )));
            }
            Some(b)
        }
        None => None,
    };
    let image = dev.image.clone();
    if !image.is_active() {
        return Err(CallError::Refused(
            "the image is not active here (live migration)".into(),
        ));
    }
    dev.backups
        .ensure_pool()
        .map_err(|e| CallError::Refused(format!("the copy threads: {e}")))?;
    let size = dev.size;
    let granule = granule_of(image.allocation_unit(), local, size);
    let view = Arc::new(
        View::new(image, size, granule, &scratch, scratch_max).map_err(|e| {
            CallError::Refused(if e.kind() == std::io::ErrorKind::Unsupported {
                e.to_string()
            } else {
                format!("scratch in {}: {e}", scratch.display())
            })
        })?,
    );
    let gated = Arc::new(Gated {
        ready: AtomicBool::new(false),
        inner: BackupExport {
            name: export.clone(),
            view: view.clone(),
            bitmap: from_bitmap,
        },
    });
    let server = Server::start(listen.clone(), gated.clone()).map_err(|e| {
        CallError::Refused(format!(
            "{}: {e}",
            match &listen {
                Listen::Unix(p) => p.display().to_string(),
                Listen::Tcp(a) => a.to_string(),
            }
        ))
    })?;
    let uri = server.listen().uri(&export);
    let backup = Arc::new(Backup {
        checkpoint: checkpoint.clone(),
        incremental: from.clone(),
        export: export.clone(),
        uri: uri.clone(),
        view,
        server: Mutex::new(Some(server)),
        started: Instant::now(),
    });
    let persistent = dev.bitmaps.memory_only().is_none();
    let save = dev.save;
    // The one step between two guest requests: nothing in flight, nothing starting.
    let t0 = Instant::now();
    let mut r: Result<(), String> = Err("the queues were not paused".into());
    (dev.paused)(&mut || {
        r = (|| {
            dev.bitmaps
                .add(&checkpoint, g, persistent, true, save)
                .map_err(|e| e.to_string())?;
            if let Some(f) = &from {
                if let Err(e) = dev.bitmaps.set_recording(f, false, save) {
                    let _ = dev.bitmaps.remove(&checkpoint, save);
                    return Err(e.to_string());
                }
            }
            dev.backups.insert(backup.clone());
            Ok(())
        })();
    });
    let paused = t0.elapsed();
    if let Err(e) = r {
        if let Some(mut s) = backup.server.lock().ok().and_then(|mut s| s.take()) {
            s.stop();
        }
        return Err(CallError::Refused(e));
    }
    gated.ready.store(true, Ordering::Release);
    log::info!(
        "backup of checkpoint {checkpoint:?}{} exported at {uri} (queues paused {:.1} ms)",
        from.as_ref()
            .map(|f| format!(" (incremental from {f:?})"))
            .unwrap_or_default(),
        paused.as_secs_f64() * 1e3
    );
    Ok(json!({
        "checkpoint": checkpoint,
        "incremental": from,
        "export": export,
        "uri": uri,
        "size": size,
        "granule": granule,
        "persistent": persistent,
        "paused_seconds": paused.as_secs_f64(),
    }))
}
