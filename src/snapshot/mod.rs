//! Live external snapshots (docs/snapshots.md): `snapshot --overlay PATH` creates a qcow2
//! overlay whose backing file is the image served now and serves the overlay from then on,
//! switched between two guest requests (every queue paused with nothing in flight, as at a
//! backup's begin); the old image stays open only as the overlay's read-only backing file,
//! locked as QEMU locks a backing file. `state` keeps the top of the chain for restarts.
//!
//! The order of the steps is what makes a crash at any point safe:
//! 1. the overlay is created and synced (and its directory): a crash leaves an unused file;
//! 2. queues paused; the old image is closed: its metadata written back and synced;
//! 3. the state file names the overlay (atomically): from here a restart serves the
//!    overlay, whose backing file holds every write completed before the switch;
//! 4. the old image is given up (its write lock released) and the overlay opened, locking
//!    the old image for reading; the queues go on with the overlay.
//!
//! If a step fails, the state file is restored, the overlay removed and the old image
//! opened again: the guest sees nothing but a pause.

pub mod state;

use std::path::{Path, PathBuf};

use log::{info, warn};
use serde_json::{json, Value};

use crate::image::create::{create, CreateParams};
use crate::image::handover::ImageSlot;
use crate::image::Format;

/// The cluster size of overlays (QEMU's default).
const OVERLAY_CLUSTER_BITS: u32 = 16;

/// What a snapshot needs of the device (built by the control socket).
pub struct Disk<'a> {
    pub slot: &'a ImageSlot,
    /// The guest-visible size.
    pub size: u64,
    pub read_only: bool,
    /// Why not now, if something holds the image as it is (a backup's view, a migration).
    pub busy: Option<String>,
    /// `--blk-file`, for the state record.
    pub base: &'a Path,
    /// The chain's state file (None: nowhere to keep it).
    pub state: Option<&'a Path>,
    /// Run a closure between two guest requests (`Device::with_queues_paused`).
    pub paused: &'a dyn Fn(&mut dyn FnMut()),
    /// The device's bitmaps: the persistent ones move into the overlay.
    pub bitmaps: &'a crate::bitmaps::Bitmaps,
}

/// `snapshot` with its parameters: `{"overlay": PATH, "extended_l2": BOOL}` (the latter
/// optional, default false).
pub fn call(params: &Value, disk: &Disk<'_>) -> Result<Value, CallError> {
    let overlay = params
        .get("overlay")
        .and_then(Value::as_str)
        .filter(|s| !s.is_empty())
        .ok_or_else(|| CallError::Params("snapshot takes {\"overlay\": PATH}".into()))?;
    if let Some(k) = params
        .as_object()
        .and_then(|m| m.keys().find(|k| *k != "overlay" && *k != "extended_l2"))
    {
        return Err(CallError::Params(format!(
            "snapshot: unknown parameter {k:?}"
        )));
    }
    let extended_l2 = match params.get("extended_l2") {
        None => false,
        Some(v) => v.as_bool().ok_or_else(|| {
            CallError::Params("snapshot: \"extended_l2\" must be true or false".into())
        })?,
    };
    take(disk, Path::new(overlay), extended_l2).map_err(CallError::Refused)
}

/// Why a `snapshot` call failed.
#[derive(Debug)]
pub enum CallError {
    Params(String),
    Refused(String),
}

/// Take the snapshot (the overlay with extended L2 entries if `extended_l2`): see the
/// module's note.
pub fn take(disk: &Disk<'_>, overlay: &Path, extended_l2: bool) -> Result<Value, String> {
    if !overlay.is_absolute() {
        return Err(format!(
            "--overlay {}: give an absolute path (vublk ctl makes it one)",
            overlay.display()
        ));
    }
    let image = disk.slot.get();
    let opts = disk
        .slot
        .options()
        .ok_or("the image was not opened from a path: nothing to put an overlay on")?;
    if image.file().is_none() {
        return Err(format!(
            "{} is a remote disk: snapshots of RBD images are the cluster's (rbd snap \
             create), of NBD exports the server's",
            opts.path.display()
        ));
    }
    if disk.read_only {
        return Err("the disk is served read-only: a snapshot would change nothing".into());
    }
    if let Some(why) = &disk.busy {
        return Err(why.clone());
    }
    // The overlay's chain is the old image's and the old image: no deeper than an open
    // follows (a restart could not open it).
    let depth = image.backing_paths().len() + 1;
    if depth > crate::image::chain::MAX_BACKING_DEPTH {
        return Err(format!(
            "the chain would be {} images deep below the overlay, more than vublk opens ({}):              merge it first (qemu-img commit or convert while vublk is stopped)",
            depth,
            crate::image::chain::MAX_BACKING_DEPTH
        ));
    }
    let state = disk.state.ok_or_else(|| {
        format!(
            "{} is not a regular file: start vublk with --chain-state PATH to keep the top \
             of the chain across restarts",
            disk.base.display()
        )
    })?;
    let (dir, name) = match (overlay.parent(), overlay.file_name()) {
        (Some(d), Some(n)) => (d, n),
        _ => return Err(format!("--overlay {}: not a file name", overlay.display())),
    };
    let dir = dir
        .canonicalize()
        .map_err(|e| format!("--overlay {}: its directory: {e}", overlay.display()))?;
    let overlay = dir.join(name);
    let current = opts
        .path
        .canonicalize()
        .map_err(|e| format!("{}: {e}", opts.path.display()))?;
    if state::same_file(&overlay, &current) || overlay.exists() {
        return Err(format!(
            "--overlay {}: the file exists; a snapshot never overwrites (remove it or pick \
             another name)",
            overlay.display()
        ));
    }
    if image.cipher().is_some() {
        return Err(
            "snapshots of an encrypted disk are not supported yet: the overlay would \
                    hold the guest's data unencrypted"
                .into(),
        );
    }
    let format = match image.format() {
        Format::Raw => "raw",
        Format::Qcow2 => "qcow2",
        Format::Parallels => "parallels",
        Format::Luks => {
            return Err(
                "snapshots of an encrypted (LUKS) disk are not supported yet: the \
                        overlay would hold the guest's data unencrypted"
                    .into(),
            )
        }
    };
    let backing = state::relative(&dir, &current);
    let backing_name = backing
        .to_str()
        .ok_or_else(|| format!("{}: not a UTF-8 path", backing.display()))?
        .to_owned();
    create(
        &overlay,
        &CreateParams {
            qcow2: true,
            parallels_cluster: None,
            size_bytes: disk.size,
            cluster_bits: OVERLAY_CLUSTER_BITS,
            compression: crate::image::qcow2::Compression::Zlib,
            extended_l2,
            backing: Some((backing_name.clone(), format)),
            encrypt: None,
        },
    )
    .map_err(|e| crate::logging::error_chain(&e))?;
    if let Err(e) = state::sync_dir(&dir) {
        let _ = std::fs::remove_file(&overlay);
        return Err(format!("cannot sync {}: {e}", dir.display()));
    }
    let previous = state::read(state)?;
    let record = state::Record {
        image: state::absolute(disk.base),
        top: overlay.clone(),
        format: "qcow2".into(),
        detached: false,
    };
    let mut new_opts = opts.clone();
    new_opts.path = overlay.clone();
    new_opts.format = Some(Format::Qcow2);
    // The overlay is nothing without its backing file, whatever --backing said.
    new_opts.follow_backing = true;
    let t0 = std::time::Instant::now();
    let mut outcome = None;
    (disk.paused)(&mut || {
        let r = disk.slot.switch(
            new_opts.clone(),
            || state::write(state, &record),
            || {
                let undone = match &previous {
                    Some(p) => state::write(state, p),
                    None => state::remove(state),
                };
                if let Err(e) = undone {
                    warn!("snapshot failed, and the chain state file could not be restored: {e}");
                }
            },
        );
        // The persistent bitmaps go on in the overlay's file, before any guest request
        // marks them there (the file's copy stays a superset of what completed).
        if let Ok(new) = &r {
            let list = disk.bitmaps.persistent();
            if !list.is_empty() && new.bitmaps_memory_only().is_none() {
                if let Err(e) = new.save_bitmaps(&list) {
                    warn!(
                        "snapshot: the persistent bitmaps could not be written to the overlay \
                         (they go on in memory): {}",
                        crate::logging::error_chain(&e)
                    );
                }
            }
            disk.bitmaps
                .adopt(new.persistent_bitmaps(), new.bitmaps_memory_only());
        }
        outcome = Some(r);
    });
    let paused_ms = t0.elapsed().as_secs_f64() * 1000.0;
    match outcome {
        Some(Ok(_)) => {
            info!(
                "snapshot: serving {} (qcow2) over {} ({format}, now its read-only backing \
                 file); guest paused {paused_ms:.1} ms; chain state in {}",
                overlay.display(),
                current.display(),
                state.display()
            );
            Ok(json!({
                "overlay": overlay.display().to_string(),
                "backing": current.display().to_string(),
                "backing_name": backing_name,
                "backing_format": format,
                "chain_state": state.display().to_string(),
                "paused_ms": paused_ms,
            }))
        }
        Some(Err(e)) => {
            let _ = std::fs::remove_file(&overlay);
            Err(format!(
                "snapshot failed: {}",
                crate::logging::error_chain(&e)
            ))
        }
        None => {
            let _ = std::fs::remove_file(&overlay);
            Err("snapshot: the queues could not be paused".into())
        }
    }
}

/// The paths of a chain, top first, for `status` (what is served now and below it).
pub fn chain_paths(top: &Path, image: &crate::image::Image) -> Vec<PathBuf> {
    let mut v = vec![top.to_path_buf()];
    v.extend(image.backing_paths());
    v
}
