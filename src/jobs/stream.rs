//! `stream [--base NODE]`: copy into the image served (a qcow2 image with a backing chain)
//! what it reads from its backing chain, down to NODE (exclusive) or all of it, then change
//! its backing link to NODE or drop it: one header write between two guest requests.
//!
//! Each cluster is copied by `Image::stream_chunk` (the chain read a megabyte at a time), serialised with guest writes of the
//! same cluster by the format (a cluster the guest wrote meanwhile is left alone), so the
//! guest keeps writing at full speed. The copies are ordinary allocations (crash safe as
//! guest writes are); the last step closes the image (everything written back and synced),
//! writes the chain state file if the link to `--blk-file` goes, rewrites the header and
//! opens the image again. A SIGKILL before that step leaves the same chain, partly copied
//! (a new `stream` goes on where the copies are); after it, the new one.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::{Host, JobInfo, Jobs};

/// Bytes read from the chain at once (rounded to whole clusters).
const CHUNK: u64 = 1 << 20;
/// Threads copying chunks at once.
const COPIERS: usize = 1;
use crate::snapshot::state;

/// Start a stream job; what `jobs` lists for it.
pub fn start(
    jobs: &Jobs,
    host: Arc<dyn Host>,
    base: Option<&str>,
    id: Option<String>,
    speed: u64,
) -> Result<JobInfo, String> {
    let image = host.slot().get();
    let opts = host
        .slot()
        .options()
        .ok_or("the image was not opened from a path")?;
    if !image.is_active() {
        return Err("the image is not served by this process now (a migration)".into());
    }
    let chain = image.backing_layers();
    if image.cluster_size().is_none() || chain.is_empty() {
        return Err(format!(
            "{} has no backing file: nothing to stream",
            opts.path.display()
        ));
    }
    let keep = match base {
        None => None,
        Some(b) => Some(chain.iter().position(|(p, _)| names(p, b)).ok_or_else(|| {
            format!(
                "--base {b}: not in the backing chain of {} ({})",
                opts.path.display(),
                chain
                    .iter()
                    .map(|(p, _)| p.display().to_string())
                    .collect::<Vec<_>>()
                    .join(" <- ")
            )
        })?),
    };
    if let Some(why) = host.busy() {
        return Err(why);
    }
    let top = opts.path.clone();
    let job = jobs.start("stream", id, speed, move |job| {
        run(job, &*host, keep, &top, &chain, opts)
    })?;
    Ok(job.info())
}

/// Does `base` (a path, or a file name) name `p`?
pub(super) fn names(p: &Path, base: &str) -> bool {
    let b = Path::new(base);
    state::same_file(p, b) || (b.components().count() == 1 && p.file_name() == Some(b.as_os_str()))
}

fn run(
    job: &super::Job,
    host: &dyn Host,
    keep: Option<usize>,
    top: &Path,
    chain: &[(PathBuf, &'static str)],
    opts: crate::image::ImageOptions,
) -> Result<(), String> {
    let image = host.slot().get();
    let size = image.size_bytes();
    let c = image.cluster_size().unwrap_or(65536);
    let step = CHUNK.max(c) / c * c;
    job.set_total(size);
    // Chunks taken in turn by a few threads, so that one's read of the chain overlaps
    // another's write into the image (each chunk is independent; the format serialises
    // what must be).
    let next = std::sync::atomic::AtomicU64::new(0);
    let copied = std::sync::atomic::AtomicU64::new(0);
    let failed = std::sync::Mutex::new(None::<String>);
    std::thread::scope(|s| {
        for _ in 0..COPIERS {
            s.spawn(|| loop {
                let at = next.fetch_add(step, std::sync::atomic::Ordering::Relaxed);
                if at >= size || job.cancelled() || failed.lock().is_ok_and(|f| f.is_some()) {
                    return;
                }
                if !Arc::ptr_eq(&host.slot().get(), &image) {
                    let _ = failed
                        .lock()
                        .map(|mut f| *f = Some("the image was switched while the job ran".into()));
                    return;
                }
                let n = step.min(size - at);
                match image.stream_chunk(at, n, keep) {
                    Ok(k) => {
                        copied.fetch_add(k, std::sync::atomic::Ordering::Relaxed);
                        job.advance(n);
                    }
                    Err(e) => {
                        let _ = failed.lock().map(|mut f| {
                            *f = Some(format!(
                                "copying the clusters at {at}: {}",
                                crate::logging::error_chain(&e)
                            ))
                        });
                        return;
                    }
                }
            });
        }
    });
    let copied = copied.into_inner();
    if let Some(e) = failed.into_inner().unwrap_or_else(|p| p.into_inner()) {
        return Err(e);
    }
    if job.cancelled() {
        return Err(format!("cancelled after copying {copied} bytes"));
    }
    // The new link: the kept backing file (relative to the image, with its format), or none.
    let dir = top.parent().unwrap_or(Path::new("/"));
    let link = match keep {
        None => None,
        Some(k) => {
            let (p, fmt) = &chain[k];
            let rel = state::relative(dir, p);
            let name = rel
                .to_str()
                .ok_or_else(|| format!("{}: not a UTF-8 path", rel.display()))?
                .to_owned();
            Some((name, *fmt))
        }
    };
    // The chain state: marked detached when --blk-file leaves the chain.
    let still_holds = keep.is_some_and(|k| {
        chain[k..]
            .iter()
            .any(|(p, _)| state::same_file(p, host.base()))
    });
    super::switch::relink(
        host,
        "stream",
        &opts,
        top,
        link.as_ref().map(|(n, f)| (n.as_str(), *f)),
        None,
        !still_holds,
    )?;
    log::info!(
        "stream: {copied} bytes copied into {}; its backing file is now {}",
        top.display(),
        link.as_ref()
            .map_or_else(|| "none".to_owned(), |(n, f)| format!("{n} ({f})"))
    );
    Ok(())
}
