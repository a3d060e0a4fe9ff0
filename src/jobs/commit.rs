//! `commit [--top NODE] [--base NODE]`: merge the layers from NODE `top` (default: the
//! image served, the active layer) down to, not including, NODE `base` (default: the
//! bottom of the chain) into `base`, while the guest runs; the merged layers leave the
//! chain.
//!
//! The base is opened read-write by the job (a second handle: the chain's handle stays
//! read-only, locked as QEMU locks a backing file, so another process that holds the base
//! for writing or refuses to share it makes the commit fail at its start). Every cluster a
//! merged layer holds (data, compressed data or a zero flag) is written into the base as the
//! top layer reads it; nothing else is. What the guest reads does not change while the job
//! copies: every cluster written into the base is held by a layer above it.
//!
//! - Below the active layer (`--top` a backing file): those layers are read-only, so one
//!   pass copies them; then, between two guest requests, the base is synced, the chain
//!   state file updated if `--blk-file` leaves the chain, and the layer above `top` gets
//!   the base as its backing file (one header write), and the image is opened again.
//! - The active layer (QEMU's active commit): the job records what the guest writes from its
//!   start (a bitmap of its own), copies every cluster the layers hold, then again and again
//!   what the guest dirtied meanwhile, until little is left; then, with the guest paused, it
//!   copies the rest, syncs the base, names the base in the chain state file and serves the
//!   base from then on (the old top is left as it was: delete it when you like). With
//!   `--manual-complete` it waits in `ready` (copying what the guest dirties) until
//!   `job-complete`.
//!
//! A SIGKILL at any moment leaves the old chain, whole (the base holds extra copies of
//! clusters that layers above it hold: invisible) until the state file or the header names
//! the new one, which is complete on disk by then. A commit started again redoes the copy.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::copy::{
    close_image, converge, copy_extents, track_granularity, Active, Route, CHUNK, WINDOW,
};
use super::switch::{relink, switch_to, Switch};
use super::{Host, Job, JobInfo, Jobs};
use crate::image::{Format, Image, ImageOptions};
use crate::snapshot::state;

/// What `commit` was asked for.
pub struct Request {
    pub top: Option<String>,
    pub base: Option<String>,
    /// Wait in `ready` for `job-complete` (active commit only).
    pub manual_complete: bool,
    /// How an active job keeps up with the guest's writes.
    pub copy_mode: super::CopyMode,
    pub id: Option<String>,
    pub speed: u64,
}

/// The job's plan, decided at its start.
struct Plan {
    /// Chain layers: 0 the image served, i its backing file i - 1.
    top: usize,
    base: usize,
    top_size: u64,
    /// The base: path, format, and how the job (and, after an active commit, the device)
    /// opens it.
    base_path: PathBuf,
    base_format: &'static str,
    base_opts: ImageOptions,
    /// The served image's options (reopened after a commit below it).
    served: ImageOptions,
    /// Every layer's path, 0 first.
    paths: Vec<PathBuf>,
    formats: Vec<&'static str>,
    manual_complete: bool,
    copy_mode: super::CopyMode,
}

/// Start a commit job; what `jobs` lists for it.
pub fn start(jobs: &Jobs, host: Arc<dyn Host>, req: Request) -> Result<JobInfo, String> {
    let image = host.slot().get();
    let served = host
        .slot()
        .options()
        .ok_or("the image was not opened from a path")?;
    if !image.is_active() {
        return Err("the image is not served by this process now (a migration)".into());
    }
    if served.read_only {
        return Err("the disk is served read-only: a commit writes".into());
    }
    let chain = image.backing_layers();
    if image.cluster_size().is_none() || chain.is_empty() {
        return Err(format!(
            "{} has no backing file: nothing to commit",
            served.path.display()
        ));
    }
    let mut paths = vec![served.path.clone()];
    let mut formats = vec!["qcow2"];
    for (p, f) in &chain {
        paths.push(p.clone());
        formats.push(f);
    }
    let listing = || {
        paths
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(" <- ")
    };
    let find = |what: &str, n: &str| {
        paths
            .iter()
            .position(|p| super::stream::names(p, n))
            .ok_or_else(|| format!("--{what} {n}: not in the chain ({})", listing()))
    };
    let top = match &req.top {
        None => 0,
        Some(n) => find("top", n)?,
    };
    let base = match &req.base {
        None => paths.len() - 1,
        Some(n) => find("base", n)?,
    };
    if base <= top {
        return Err(format!(
            "--base {} is not below --top {} in the chain ({})",
            paths[base].display(),
            paths[top].display(),
            listing()
        ));
    }
    if req.manual_complete && top != 0 {
        return Err(
            "--manual-complete is for a commit of the active layer (a commit below it \
             finishes by itself)"
                .into(),
        );
    }
    if top == 0 && host.chain_state().is_none() {
        return Err(format!(
            "{} is not a regular file: start vublk with --chain-state PATH, so that a restart \
             serves the base after the commit",
            host.base().display()
        ));
    }
    if let Some(why) = host.busy() {
        return Err(why);
    }
    // Before the base is opened (a running commit holds it).
    jobs.free()?;
    let top_size = image.layer_size(top).ok_or("no such layer")?;
    let base_format = formats[base];
    let mut base_opts = served.clone();
    base_opts.path = paths[base].clone();
    base_opts.format = Some(match base_format {
        "qcow2" => Format::Qcow2,
        "parallels" => Format::Parallels,
        _ => Format::Raw,
    });
    base_opts.follow_backing = true;
    base_opts.compress = None;
    let plan = Plan {
        top,
        base,
        top_size,
        base_path: paths[base].clone(),
        base_format,
        base_opts,
        served,
        paths,
        formats,
        manual_complete: req.manual_complete,
        copy_mode: req.copy_mode,
    };
    // The base, read-write: refused here if another process holds it.
    let target = open_base(&plan)?;
    if target.size_bytes() < top_size {
        close_image(target, "the base");
        return Err(format!(
            "the base {} is {} bytes, smaller than {} ({top_size} bytes): grow it first \
             (qemu-img resize while vublk is stopped)",
            plan.base_path.display(),
            plan.base_path.metadata().map(|m| m.len()).unwrap_or(0),
            plan.paths[top].display()
        ));
    }
    let job = jobs.start("commit", req.id, req.speed, move |job| {
        run(job, &*host, &image, plan, target)
    })?;
    Ok(job.info())
}

/// The job's own handle on the base: through the page cache whatever the disk's cache
/// mode (the job's writes then cost a copy, not a wait for the disk, and the kernel writes
/// them back in large runs); [`close_image`](super::copy::close_image) syncs it before anything names the base.
fn open_base(plan: &Plan) -> Result<Image, String> {
    let mut opts = plan.base_opts.clone();
    opts.direct = false;
    Image::open(&opts).map(|(i, _, _)| i).map_err(|e| {
        format!(
            "cannot open the base {} for writing: {}",
            plan.base_path.display(),
            crate::logging::error_chain(&e)
        )
    })
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
    // What the guest writes from now on (an active commit only: the layers below the
    // active one do not change).
    let tracker = (plan.top == 0).then(|| host.bitmaps().track(track_granularity(plan.top_size)));
    let result = (|| {
        job.set_total(plan.top_size);
        let switched = || !Arc::ptr_eq(&host.slot().get(), image);
        // Every cluster the merged layers hold, in runs, a window at a time.
        let route = Route {
            src: image,
            layer: Some(plan.top),
            dst: &target,
            c,
            to: "the base",
            through: None,
            guest_paused: false,
        };
        let stop = || job.cancelled() || switched();
        let mut at = 0u64;
        let mut copied = 0u64;
        while at < plan.top_size {
            if job.cancelled() {
                return Err(format!("cancelled after copying {copied} bytes"));
            }
            if switched() {
                return Err("the image was switched while the job ran".into());
            }
            let n = WINDOW.min(plan.top_size - at);
            let mut runs: Vec<(u64, u64)> = Vec::new();
            let mut cl = at;
            while cl < at + n {
                let len = c.min(plan.top_size - cl);
                let held = image
                    .held_in_layers(cl, len, plan.top, plan.base)
                    .map_err(|e| crate::logging::error_chain(&e))?;
                if held {
                    match runs.last_mut() {
                        Some(r) if r.0 + r.1 == cl => r.1 += len,
                        _ => runs.push((cl, len)),
                    }
                }
                cl += c;
            }
            let held: u64 = runs.iter().map(|r| r.1).sum();
            copy_extents(&route, &runs, step, &|k| job.advance(k), &stop)?;
            job.advance(n - held);
            copied += held;
            at += n;
        }
        let Some(tracker) = &tracker else {
            return finish_below(job, host, &plan, target, copied);
        };
        // The active layer: again what the guest dirtied, until little is left.
        let route = Route {
            src: image,
            layer: Some(0),
            dst: &target,
            c,
            to: "the base",
            through: None,
            guest_paused: false,
        };
        let active = Active {
            host,
            target: &target,
            tracker,
            mode: plan.copy_mode,
        };
        let pending = converge(job, &route, &active, step, plan.manual_complete, &stop)?;
        finish_active(job, host, &plan, target, tracker, pending)
    })();
    if host.write_through().get().is_some() {
        super::copy::set_write_through(host, None);
    }
    if let Some(t) = &tracker {
        host.bitmaps().untrack(t);
    }
    result
}

/// The last step of a commit below the active layer: the layer above `top` gets the base
/// as its backing file.
fn finish_below(
    job: &Job,
    host: &dyn Host,
    plan: &Plan,
    target: Arc<Image>,
    copied: u64,
) -> Result<(), String> {
    if let Some(e) = close_image(target, "the base") {
        return Err(e);
    }
    if job.cancelled() {
        return Err(format!("cancelled after copying {copied} bytes"));
    }
    let above = &plan.paths[plan.top - 1];
    let dir = above.parent().unwrap_or(Path::new("/"));
    let link = |i: usize| -> Result<String, String> {
        let rel = state::relative(dir, &plan.paths[i]);
        rel.to_str()
            .map(str::to_owned)
            .ok_or_else(|| format!("{}: not a UTF-8 path", rel.display()))
    };
    let new_link = link(plan.base)?;
    let old_link = link(plan.top)?;
    // --blk-file leaves the chain: the record no longer asks the top to hold it.
    let leaves = plan.paths[plan.top..plan.base]
        .iter()
        .any(|p| state::same_file(p, host.base()));
    relink(
        host,
        "commit",
        &plan.served,
        above,
        Some((&new_link, plan.base_format)),
        Some(Some((&old_link, plan.formats[plan.top]))),
        leaves,
    )?;
    log::info!(
        "commit: {copied} bytes of {} merged into {}; {} now reads from it",
        plan.paths[plan.top..plan.base]
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(", "),
        plan.base_path.display(),
        above.display()
    );
    Ok(())
}

/// The last step of an active commit: the base served from now on.
fn finish_active(
    job: &Job,
    host: &dyn Host,
    plan: &Plan,
    target: Arc<Image>,
    tracker: &Arc<crate::bitmaps::DirtyBitmap>,
    pending: Vec<(u64, u64)>,
) -> Result<(), String> {
    let blk = state::absolute(host.base());
    let sw = Switch {
        kind: "commit",
        to: "the base",
        path: &plan.base_path,
        format: plan.base_format,
        opts: plan.base_opts.clone(),
        size: plan.top_size,
        holds_blk: plan.paths[plan.base..]
            .iter()
            .any(|p| state::same_file(p, &blk)),
    };
    let paused = switch_to(job, host, &sw, target, tracker, pending)?;
    log::info!(
        "commit: serving {} ({}) now; {} left the chain; guest paused {:.1} ms",
        plan.base_path.display(),
        plan.base_format,
        plan.paths[..plan.base]
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(", "),
        paused
    );
    Ok(())
}
