//! The last steps of jobs, with the guest paused: moving the guest to another image (an
//! active commit, a mirror: the rest copied, the image synced, named in the chain state
//! file and served from then on; persistent bitmaps go on in it), and rewriting a backing
//! link in the chain (a stream, a commit below the active layer).

use std::path::Path;
use std::sync::Arc;

use super::copy::{close_image, copy_extents, Route, CHUNK};
use super::{Host, Job};
use crate::bitmaps::DirtyBitmap;
use crate::image::{Image, ImageOptions};
use crate::snapshot::state;

/// Where the guest goes.
pub(super) struct Switch<'a> {
    /// The job's type, for messages.
    pub(super) kind: &'static str,
    /// What the image is ("the base"), for messages.
    pub(super) to: &'static str,
    pub(super) path: &'a Path,
    pub(super) format: &'static str,
    /// How the device opens it.
    pub(super) opts: ImageOptions,
    /// The disk's size when the job started (a resize since fails the switch).
    pub(super) size: u64,
    /// Its backing chain holds `--blk-file` (else the state file says `detached`).
    pub(super) holds_blk: bool,
}

/// Copy the rest with the guest paused, sync `target` (the job's handle) and serve
/// `sw.path`; how long the guest was paused (ms).
pub(super) fn switch_to(
    job: &Job,
    host: &dyn Host,
    sw: &Switch,
    target: Arc<Image>,
    tracker: &Arc<DirtyBitmap>,
    pending: Vec<(u64, u64)>,
) -> Result<f64, String> {
    let image = host.slot().get();
    let c = image.cluster_size().unwrap_or(65536);
    let Some(state_path) = host.chain_state().map(Path::to_path_buf) else {
        return Err("no chain state file".into());
    };
    let previous = state::read(&state_path)?;
    let blk = state::absolute(host.base());
    // The image is --blk-file itself: no record (it is served as the command line says).
    let record = (!state::same_file(sw.path, &blk)).then(|| state::Record {
        image: blk.clone(),
        top: sw.path.to_path_buf(),
        format: sw.format.to_owned(),
        detached: !sw.holds_blk,
    });
    let mut target = Some(target);
    let mut pending = Some(pending);
    let mut outcome = None;
    let t0 = std::time::Instant::now();
    host.paused(&mut || {
        // Nothing is in flight: the guest's writes stop going to the target here (the
        // rest is copied below).
        let counted = host.write_through().get();
        host.write_through().set(None);
        if let Some(wt) = counted {
            let (through, left, full) = wt.counts();
            log::info!(
                "{}: {through} guest writes went through to {} in write-through mode, {left} \
                 were left to the job ({full} of them when the queue was full, the rest \
                 overlapped)",
                sw.kind,
                sw.to
            );
        }
        let r = (|| {
            if let Some(why) = host.busy() {
                return Err(format!("the last step (the switch to {}): {why}", sw.to));
            }
            if image.size_bytes() != sw.size {
                return Err("the disk was resized while the job ran".into());
            }
            let Some(t) = target.take() else {
                return Err(format!("{} is gone", sw.to));
            };
            let mut rest = pending.take().unwrap_or_default();
            rest.extend(tracker.take_extents(0, u64::MAX).0);
            job.add_total(rest.iter().map(|e| e.1).sum());
            let route = Route {
                src: &image,
                layer: None,
                dst: &t,
                c,
                to: sw.to,
                through: None,
                guest_paused: true,
            };
            let step = CHUNK.max(c) / c * c;
            let failed = copy_extents(
                &route,
                &rest,
                step,
                &|n| {
                    job.count(n);
                },
                &|| false,
            )
            .err();
            let synced = close_image(t, sw.to);
            if let Some(e) = failed.or(synced) {
                return Err(e);
            }
            let r = host.slot().switch(
                sw.opts.clone(),
                || match &record {
                    Some(r) => state::write(&state_path, r),
                    None => state::remove(&state_path),
                },
                || {
                    let undone = match &previous {
                        Some(p) => state::write(&state_path, p),
                        None => state::remove(&state_path),
                    };
                    if let Err(e) = undone {
                        log::warn!(
                            "{} failed, and the chain state file could not be restored: {e}",
                            sw.kind
                        );
                    }
                },
            );
            let new = r.map_err(|e| crate::logging::error_chain(&e))?;
            // The persistent bitmaps go on in the new image's file.
            let list = host.bitmaps().persistent();
            if !list.is_empty() && new.bitmaps_memory_only().is_none() {
                if let Err(e) = new.save_bitmaps(&list) {
                    log::warn!(
                        "{}: the persistent bitmaps could not be written to {} (they go on in \
                         memory): {}",
                        sw.kind,
                        sw.to,
                        crate::logging::error_chain(&e)
                    );
                }
            }
            host.bitmaps()
                .adopt(new.persistent_bitmaps(), new.bitmaps_memory_only());
            Ok(())
        })();
        outcome = Some(r);
    });
    outcome.unwrap_or_else(|| Err("the queues could not be paused".into()))?;
    Ok(t0.elapsed().as_secs_f64() * 1000.0)
}

/// A backing link: the name as stored (relative to the image that holds it) and the format.
pub(super) type Link<'a> = Option<(&'a str, &'static str)>;

/// The last step of a job that changes a backing link (a stream, a commit below the active
/// layer): between two guest requests, `image`'s header gets the backing file `new` (None:
/// none), the chain state file is marked `detached` if `detaches` (`--blk-file` leaves the
/// chain), and the chain is opened again with `opts`. If that fails, the state file is
/// restored, and the header too when `undo` names the old link.
pub(super) fn relink(
    host: &dyn Host,
    kind: &str,
    opts: &ImageOptions,
    image: &Path,
    new: Link,
    undo: Option<Link>,
    detaches: bool,
) -> Result<(), String> {
    let state_path = host.chain_state().map(Path::to_path_buf);
    let previous = match &state_path {
        Some(p) => state::read(p)?,
        None => None,
    };
    let mut outcome = None;
    host.paused(&mut || {
        if let Some(why) = host.busy() {
            outcome = Some(Err(format!("the last step (the new backing link): {why}")));
            return;
        }
        let r = host.slot().switch(
            opts.clone(),
            || {
                if let (Some(p), Some(prev), true) = (&state_path, &previous, detaches) {
                    let mut r = prev.clone();
                    r.detached = true;
                    state::write(p, &r)?;
                }
                crate::image::qcow2::relink::set_backing(image, new)
            },
            || {
                if let Some(old) = undo {
                    if let Err(e) = crate::image::qcow2::relink::set_backing(image, old) {
                        log::warn!(
                            "{kind}: the backing link of {} could not be restored: {e}",
                            image.display()
                        );
                    }
                }
                if let (Some(p), Some(prev)) = (&state_path, &previous) {
                    if let Err(e) = state::write(p, prev) {
                        log::warn!("{kind}: the chain state file could not be restored: {e}");
                    }
                }
            },
        );
        if let Ok(new) = &r {
            host.bitmaps()
                .adopt(new.persistent_bitmaps(), new.bitmaps_memory_only());
        }
        outcome = Some(r.map(|_| ()).map_err(|e| crate::logging::error_chain(&e)));
    });
    outcome.unwrap_or_else(|| Err("the queues could not be paused".into()))
}
