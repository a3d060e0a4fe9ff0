//! `mirror --target PATH [--format F] [--sync full|top] [--bitmap NAME]`: copy the running
//! disk to another image while the guest runs, keep copying what the guest dirties, wait in
//! `ready` once little is left, and on `job-complete` switch the guest to the target (the
//! locks go with it); `job-cancel` leaves the guest on the source.
//!
//! - `--sync full` (the default): a new image of `--format` (default: the disk's own) with
//!   no backing file gets everything the guest reads: what the disk's allocation says is
//!   data (holes and zeroes are already zeroes in a new image).
//! - `--sync top`: a new qcow2 image whose backing file is the disk's (relative, with its
//!   format) gets what the served image itself holds; the backing chain is shared.
//! - `--bitmap NAME`: the target exists already and holds an older copy of the disk (an
//!   earlier mirror or a full backup, as of when the bitmap was created or cleared): only
//!   what the bitmap marks is copied first.
//!
//! The source is read as the guest reads it (any format, the whole chain); the target is
//! written through the format like a guest write, by the job's own handle (through the page
//! cache), and synced before the chain state file names it. A SIGKILL before that leaves
//! the guest's disk as it was; the partial target is left for the operator to remove, as
//! QEMU leaves it.

use std::path::PathBuf;
use std::sync::Arc;

use super::copy::{
    close_image, converge, copy_extents, track_granularity, Active, Route, CHUNK, WINDOW,
};
use super::switch::{switch_to, Switch};
use super::{Host, Job, JobInfo, Jobs};
use crate::image::create::{create, CreateParams};
use crate::image::{Allocation, Format, Image, ImageOptions};
use crate::snapshot::state;

/// What `mirror` was asked for.
pub struct Request {
    pub target: String,
    pub format: Option<String>,
    pub sync: Option<String>,
    pub bitmap: Option<String>,
    /// How an active job keeps up with the guest's writes.
    pub copy_mode: super::CopyMode,
    pub id: Option<String>,
    pub speed: u64,
}

/// What the first pass copies.
enum First {
    /// What the disk's allocation calls data.
    Full,
    /// What the served qcow2 image itself holds.
    Top,
    /// What the bitmap marks.
    Bitmap(Arc<crate::bitmaps::DirtyBitmap>),
    /// The whole disk (a target that may hold anything: holes are written as zeroes).
    Everything,
}

struct Plan {
    target: PathBuf,
    format: &'static str,
    /// How the device opens the target after the switch.
    serve: ImageOptions,
    size: u64,
    first: First,
    holds_blk: bool,
    copy_mode: super::CopyMode,
}

fn format_name(f: Format) -> &'static str {
    match f {
        Format::Raw => "raw",
        Format::Qcow2 => "qcow2",
        Format::Parallels => "parallels",
        Format::Luks => "luks",
    }
}

/// Start a mirror job; what `jobs` lists for it.
pub fn start(jobs: &Jobs, host: Arc<dyn Host>, req: Request) -> Result<JobInfo, String> {
    let image = host.slot().get();
    let served = host
        .slot()
        .options()
        .ok_or("the image was not opened from a path")?;
    if !image.is_active() {
        return Err("the image is not served by this process now (a migration)".into());
    }
    let t = req.target.as_str();
    if t.is_empty() {
        return Err("--target: a path, an NBD URI or an RBD image".into());
    }
    let remote = crate::nbd::is_nbd_uri(t) || t.starts_with("rbd:");
    let (plan, dst) = if remote {
        remote_plan(jobs, &*host, &image, served, &req)?
    } else {
        file_plan(jobs, &*host, &image, served, &req)?
    };
    let job = jobs.start("mirror", req.id, req.speed, move |job| {
        run(job, &*host, &image, plan, dst)
    })?;
    Ok(job.info())
}

/// A mirror onto a file: what the job does and its handle on the target, a new image
/// (never over an existing file) or, with `--bitmap`, the existing one.
fn file_plan(
    jobs: &Jobs,
    host: &dyn Host,
    image: &Image,
    served: ImageOptions,
    req: &Request,
) -> Result<(Plan, Image), String> {
    let t = req.target.as_str();
    let sync_top = match req.sync.as_deref() {
        None | Some("full") => false,
        Some("top") => true,
        Some(o) => return Err(format!("--sync {o}: full or top")),
    };
    let format = match req.format.as_deref() {
        None => None,
        Some("raw") => Some(Format::Raw),
        Some("qcow2") => Some(Format::Qcow2),
        Some("parallels") => Some(Format::Parallels),
        Some(o) => return Err(format!("--format {o}: raw, qcow2 or parallels")),
    };
    if host.chain_state().is_none() {
        return Err(format!(
            "{} is not a regular file: start vublk with --chain-state PATH, so that a restart \
             serves the target after the mirror",
            host.base().display()
        ));
    }
    let chain = image.backing_layers();
    if sync_top && chain.is_empty() {
        return Err(format!(
            "--sync top: {} has no backing file; use --sync full",
            served.path.display()
        ));
    }
    if sync_top && req.bitmap.is_some() {
        return Err("--bitmap and --sync top: one or the other".into());
    }
    let target = state::absolute(std::path::Path::new(t));
    let blk = state::absolute(host.base());
    if std::iter::once(&served.path)
        .chain(chain.iter().map(|(p, _)| p))
        .any(|p| state::same_file(p, &target))
    {
        return Err(format!(
            "--target {}: that is the disk's own image",
            target.display()
        ));
    }
    if let Some(why) = host.busy() {
        return Err(why);
    }
    jobs.free()?;
    let size = image.size_bytes();
    let first = match &req.bitmap {
        Some(name) => First::Bitmap(host.bitmaps().get(name).map_err(|e| e.to_string())?),
        None if sync_top => First::Top,
        None => First::Full,
    };
    // A new target (never over an existing file), or, with --bitmap, the existing one.
    let created = req.bitmap.is_none();
    let format = if created {
        let f = match (format, sync_top) {
            (Some(Format::Qcow2) | None, true) => Format::Qcow2,
            (Some(_), true) => return Err("--sync top makes a qcow2 target".into()),
            (Some(f), false) => f,
            (None, false) if image.cipher().is_some() => {
                return Err(
                    "an encrypted (LUKS) disk is mirrored to a target of another \
                            format only, which then holds its data decrypted: give \
                            --format raw or qcow2 if that is what you want"
                        .into(),
                )
            }
            (None, false) => image.format(),
        };
        let dir = target
            .parent()
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("/"));
        let backing = match (sync_top, chain.first()) {
            (true, Some((p, f))) => {
                let rel = state::relative(&dir, p);
                let name = rel
                    .to_str()
                    .ok_or_else(|| format!("{}: not a UTF-8 path", rel.display()))?
                    .to_owned();
                Some((name, *f))
            }
            _ => None,
        };
        create(
            &target,
            &CreateParams {
                qcow2: f == Format::Qcow2,
                parallels_cluster: (f == Format::Parallels).then_some(1 << 20),
                size_bytes: size,
                cluster_bits: 16,
                compression: crate::image::qcow2::Compression::Zlib,
                extended_l2: false,
                backing,
                encrypt: None,
            },
        )
        .map_err(|e| format!("--target: {}", crate::logging::error_chain(&e)))?;
        if let Err(e) = state::sync_dir(&dir) {
            let _ = std::fs::remove_file(&target);
            return Err(format!("cannot sync {}: {e}", dir.display()));
        }
        Some(f)
    } else {
        format
    };
    let remove = |why: String| {
        if created {
            let _ = std::fs::remove_file(&target);
        }
        why
    };
    let mut serve = served.clone();
    serve.path = target.clone();
    serve.format = format;
    serve.follow_backing = true;
    serve.compress = None;
    let mut own = serve.clone();
    own.direct = false;
    own.read_only = false;
    let dst = Image::open(&own).map(|(i, _, _)| i).map_err(|e| {
        remove(format!(
            "cannot open the target {} for writing: {}",
            target.display(),
            crate::logging::error_chain(&e)
        ))
    })?;
    if dst.size_bytes() < size {
        close_image(dst, "the target");
        return Err(remove(format!(
            "the target {} is {} bytes, smaller than the disk ({size} bytes)",
            target.display(),
            target.metadata().map(|m| m.len()).unwrap_or(0)
        )));
    }
    let format = format_name(dst.format());
    serve.format = Some(dst.format());
    let holds_blk = sync_top && chain.iter().any(|(p, _)| state::same_file(p, &blk));
    let plan = Plan {
        target,
        format,
        serve,
        size,
        first,
        holds_blk,
        copy_mode: req.copy_mode,
    };
    Ok((plan, dst))
}

/// A mirror onto an NBD export or an RBD image, which exists already (vublk creates no
/// remote disk) and is at least the disk's size: raw, `--sync full` (or `--bitmap`); the
/// first pass copies the whole disk, its holes as zeroes (the target may hold anything).
/// What the job does and its handle on the target.
fn remote_plan(
    jobs: &Jobs,
    host: &dyn Host,
    image: &Image,
    served: ImageOptions,
    req: &Request,
) -> Result<(Plan, Image), String> {
    let t = req.target.as_str();
    match req.sync.as_deref() {
        None | Some("full") => {}
        Some("top") => {
            return Err(format!(
                "--sync top: {t} is a remote disk, which has no backing file; use --sync full"
            ))
        }
        Some(o) => return Err(format!("--sync {o}: full or top")),
    }
    match req.format.as_deref() {
        None | Some("raw") => {}
        Some(o) => {
            return Err(format!(
                "--format {o}: {t} is a remote disk, which holds raw data (--format raw)"
            ))
        }
    }
    if host.chain_state().is_none() {
        return Err(format!(
            "{} is not a regular file: start vublk with --chain-state PATH, so that a restart \
             serves the target after the mirror",
            host.base().display()
        ));
    }
    if served.path.to_str() == Some(t) {
        return Err(format!("--target {t}: that is the disk itself"));
    }
    if let Some(why) = host.busy() {
        return Err(why);
    }
    jobs.free()?;
    let size = image.size_bytes();
    let first = match &req.bitmap {
        Some(name) => First::Bitmap(host.bitmaps().get(name).map_err(|e| e.to_string())?),
        None => First::Everything,
    };
    let mut serve = served.clone();
    serve.path = PathBuf::from(t);
    serve.format = Some(Format::Raw);
    serve.follow_backing = false;
    serve.compress = None;
    serve.read_only = false;
    let dst = Image::open(&serve).map(|(i, _, _)| i).map_err(|e| {
        format!(
            "cannot open the target {t} for writing: {}",
            crate::logging::error_chain(&e)
        )
    })?;
    if dst.read_only() {
        close_image(dst, "the target");
        return Err(format!("the target {t} is read-only"));
    }
    if dst.size_bytes() < size {
        let n = dst.size_bytes();
        close_image(dst, "the target");
        return Err(format!(
            "the target {t} is {n} bytes, smaller than the disk ({size} bytes)"
        ));
    }
    let plan = Plan {
        target: PathBuf::from(t),
        format: "raw",
        serve,
        size,
        first,
        holds_blk: false,
        copy_mode: req.copy_mode,
    };
    Ok((plan, dst))
}

/// The extents of [at, at + n) the first pass copies.
fn first_extents(
    image: &Image,
    plan: &Plan,
    at: u64,
    n: u64,
    c: u64,
) -> Result<Vec<(u64, u64)>, String> {
    let err = |e: crate::image::ImageError| crate::logging::error_chain(&e);
    let mut out: Vec<(u64, u64)> = Vec::new();
    let mut push = |o: u64, l: u64| match out.last_mut() {
        Some(r) if r.0 + r.1 == o => r.1 += l,
        _ => out.push((o, l)),
    };
    match plan.first {
        First::Everything => push(at, n),
        First::Top => {
            let mut cl = at;
            while cl < at + n {
                let len = c.min(plan.size - cl);
                if image.held_in_layers(cl, len, 0, 1).map_err(err)? {
                    push(cl, len);
                }
                cl += c;
            }
        }
        _ => {
            let mut pos = at;
            while pos < at + n {
                let runs = image.allocation(pos, at + n - pos).map_err(err)?;
                if runs.is_empty() {
                    break;
                }
                for (len, a) in runs {
                    if a == Allocation::Data {
                        push(pos, len);
                    }
                    pos += len;
                }
            }
        }
    }
    Ok(out)
}

fn run(
    job: &Job,
    host: &dyn Host,
    image: &Arc<Image>,
    plan: Plan,
    target: Image,
) -> Result<(), String> {
    let target = Arc::new(target);
    let c = image.cluster_size().unwrap_or(65536);
    let step = CHUNK.max(c) / c * c;
    // What the guest writes from now on.
    let tracker = host.bitmaps().track(track_granularity(plan.size));
    let result = (|| {
        let switched = || !Arc::ptr_eq(&host.slot().get(), image);
        let stop = || job.cancelled() || switched();
        let route = Route {
            src: image,
            layer: None,
            dst: &target,
            c,
            to: "the target",
            through: None,
            guest_paused: false,
        };
        if let First::Bitmap(b) = &plan.first {
            let mut extents = Vec::new();
            let mut from = Some(0);
            while let Some(f) = from {
                let (more, next) = b.dirty_extents(f, 4096);
                extents.extend(more);
                from = next;
            }
            job.set_total(extents.iter().map(|e| e.1).sum());
            copy_extents(&route, &extents, step, &|k| job.advance(k), &stop)?;
        } else {
            job.set_total(plan.size);
            let mut at = 0u64;
            while at < plan.size {
                if stop() {
                    break;
                }
                let n = WINDOW.min(plan.size - at);
                let runs = first_extents(image, &plan, at, n, c)?;
                let held: u64 = runs.iter().map(|r| r.1).sum();
                copy_extents(&route, &runs, step, &|k| job.advance(k), &stop)?;
                job.advance(n - held);
                at += n;
            }
        }
        let active = Active {
            host,
            target: &target,
            tracker: &tracker,
            mode: plan.copy_mode,
        };
        let mut pending = converge(job, &route, &active, step, true, &stop)?;
        if job.handover_requested() {
            // The queues are stopped and drained: nothing goes through any more.
            host.write_through().set(None);
            // A migration's handover: the queues are stopped and drained; the rest goes to
            // the target, which the destination serves from now on (the guest is not moved
            // here: this process gives the disk up).
            pending.extend(tracker.take_extents(0, u64::MAX).0);
            job.add_total(pending.iter().map(|e| e.1).sum());
            // Part of the migration's downtime: at the normal I/O priority.
            let paused = Route {
                guest_paused: true,
                ..route
            };
            copy_extents(
                &paused,
                &pending,
                step,
                &|k| {
                    job.count(k);
                },
                &|| false,
            )?;
            if let Some(e) = close_image(target, "the target") {
                return Err(e);
            }
            log::info!(
                "mirror: {} holds the disk as the guest left it at the handover",
                plan.target.display()
            );
            return Ok(());
        }
        let sw = Switch {
            kind: "mirror",
            to: "the target",
            path: &plan.target,
            format: plan.format,
            opts: plan.serve.clone(),
            size: plan.size,
            holds_blk: plan.holds_blk,
        };
        let paused = switch_to(job, host, &sw, target, &tracker, pending)?;
        log::info!(
            "mirror: serving {} ({}) now; guest paused {:.1} ms",
            plan.target.display(),
            plan.format,
            paused
        );
        Ok(())
    })();
    if host.write_through().get().is_some() {
        super::copy::set_write_through(host, None);
    }
    host.bitmaps().untrack(&tracker);
    result
}
