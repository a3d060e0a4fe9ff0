//! What the block jobs that copy share: copying extents from a chain's layer into another
//! image with several threads, the job bitmap's granularity, and an active job's passes
//! over what the guest dirtied until little is left (a commit of the active layer, a
//! mirror).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::active::WriteThrough;
use super::{CopyMode, Host, Job};
use crate::bitmaps::DirtyBitmap;
use crate::image::{Image, Reader};
use crate::io::bounce::AlignedBuf;
use crate::locks::Locked;

/// Bytes copied at once (rounded to whole clusters).
pub(super) const CHUNK: u64 = 1 << 20;
/// Threads that copy at once (QEMU's mirror keeps as many requests in flight). One at a
/// time, each of the job's reads waits behind the guest's queue (32 requests deep in the
/// benchmark): under 4 KiB random writes the job copied 45 MB/s, no faster than the guest
/// dirtied, and an active commit never converged; 4 and 8 threads did not either on the
/// test machine (65 and 83 MB/s), 16 did (149 MB/s, BENCHMARKS.md).
const COPIERS: usize = 16;
/// A copy writes a local destination (through the page cache) in pieces of this much at
/// most, or of a cluster where clusters are larger. Larger writes make the kernel cache
/// the file in larger folios (up to the write's size, Linux 6.x with ext4 and XFS), and
/// each 4 KiB write into such a folio costs a walk over all its blocks: the write-through
/// threads' 4 KiB writes into a 1 MiB-written target spent a third of their time in
/// `ext4_block_write_begin` (perf, BENCHMARKS.md "Jobs that give way to the guest's
/// I/O"), 14% with 64 KiB pieces.
const LOCAL_WRITE: u64 = 64 << 10;
/// The first pass looks at this much of the disk at a time (then copies what the layers
/// hold there with the copiers).
pub(super) const WINDOW: u64 = 64 << 20;
/// After this many passes in a row without less to copy, the log says the job is not
/// converging.
const NOT_CONVERGING: u32 = 4;
/// An active job (commit, mirror) switches once at most this much is left to copy with the
/// guest paused.
const CONVERGED: u64 = 4 << 20;

/// The granularity of an active job's own bitmap: 4 KiB (a guest's 4 KiB write costs
/// the job 4 KiB, not a cluster: random small writes would otherwise dirty 16 times what
/// they wrote with 64 KiB clusters, faster than the job copies), coarser on disks over
/// 256 GiB so that the bitmap stays within 8 MiB.
pub(super) fn track_granularity(size: u64) -> u64 {
    (size >> 26).next_power_of_two().max(4096)
}

/// Everything the job wrote to `target` written back and synced, the locks given up;
/// `what` names it in the message.
pub(super) fn close_image(target: impl Into<Arc<Image>>, what: &str) -> Option<String> {
    let target: Arc<Image> = target.into();
    let r = target.close();
    target.release_locks();
    drop(target);
    r.err()
        .map(|e| format!("syncing {what}: {}", crate::logging::error_chain(&e)))
}

/// Where a copy reads and writes: chain layer `layer` of `src` (as it reads), into `dst`;
/// `c` the cluster size.
#[derive(Clone, Copy)]
pub(super) struct Route<'a> {
    pub(super) src: &'a Image,
    /// The chain layer read (a qcow2 image's); None: the disk as the guest reads it, in any
    /// format (through a [`Reader`] per copying thread).
    pub(super) layer: Option<usize>,
    pub(super) dst: &'a Image,
    pub(super) c: u64,
    /// What `dst` is, for messages ("the base").
    pub(super) to: &'static str,
    /// The write-through on (write-through mode): each copy holds its range there.
    pub(super) through: Option<&'a WriteThrough>,
    /// The copy runs with the guest's queues paused: at the normal I/O priority.
    pub(super) guest_paused: bool,
}

/// A copying thread's own I/O: a reader of the source (the guest's view), and where the
/// destination is remote, a connection to it (a local destination is written through its
/// format by the job's handle).
#[derive(Default)]
struct ThreadIo {
    reader: Option<Reader>,
    writer: Option<Reader>,
}

impl ThreadIo {
    /// What this thread wrote to a remote destination made durable (each connection flushes
    /// its own writes).
    fn flush(&mut self, dst: &Image, to: &str) -> Result<(), String> {
        match &mut self.writer {
            Some(w) => w
                .flush_remote(dst)
                .map_err(|e| format!("flushing {to}: {}", crate::logging::error_chain(&e))),
            None => Ok(()),
        }
    }
}

/// Copy [offset, offset + len) along `route` in chunks of whole clusters; `each` is told
/// the bytes of every chunk. In write-through mode each chunk holds its range in the
/// write-through while it is read and written (see `active`).
fn copy(
    route: &Route,
    offset: u64,
    len: u64,
    buf: &mut AlignedBuf,
    io: &mut ThreadIo,
    each: &mut dyn FnMut(u64),
) -> Result<(), String> {
    let end = offset + len;
    let mut at = offset;
    while at < end {
        let n = (end - at).min(buf.len() as u64);
        let held = route.through.map(|wt| wt.hold(at, at + n));
        let r = copy_chunk(route, at, n, buf, io);
        if let (Some(wt), Some(token)) = (route.through, held) {
            wt.release(at, token);
        }
        r?;
        each(n);
        at += n;
    }
    Ok(())
}

/// Copy [at, at + n) along `route` (n at most the buffer's length).
fn copy_chunk(
    route: &Route,
    at: u64,
    n: u64,
    buf: &mut AlignedBuf,
    io: &mut ThreadIo,
) -> Result<(), String> {
    let Route {
        src,
        layer,
        dst,
        c,
        to,
        ..
    } = *route;
    let data = &mut buf.as_mut_slice()[..n as usize];
    let read = match layer {
        Some(layer) => src.read_layer(layer, at, data),
        None => {
            if io.reader.is_none() {
                io.reader = Some(
                    src.reader()
                        .map_err(|e| format!("a reader of the disk: {e}"))?,
                );
            }
            match &mut io.reader {
                Some(r) => r.read_into(src, at, data),
                None => Ok(()),
            }
        }
    };
    read.map_err(|e| {
        format!(
            "reading the disk at {at}: {}",
            crate::logging::error_chain(&e)
        )
    })?;
    // Runs of whole clusters with one write each; all-zero clusters in runs of their own,
    // which stay sparse in the destination.
    let piece = |k: u64| (c - (at + k) % c).min(n - k);
    let zero = |k: u64, m: u64| crate::zero::is_zero(&data[k as usize..(k + m) as usize]);
    let mut k = 0u64;
    while k < n {
        let start = k;
        let z = zero(k, piece(k));
        k += piece(k);
        while k < n && zero(k, piece(k)) == z {
            k += piece(k);
        }
        let piece = &data[start as usize..k as usize];
        let written = if dst.is_remote() {
            if io.writer.is_none() {
                io.writer = Some(
                    dst.reader()
                        .map_err(|e| format!("a connection to {to}: {e}"))?,
                );
            }
            match &mut io.writer {
                Some(w) if z => w.zero_remote(dst, at + start, piece.len() as u64),
                Some(w) => w.write_remote(dst, at + start, piece),
                None => Ok(()),
            }
        } else {
            // In pieces of at most LOCAL_WRITE (whole clusters): see there.
            let step = LOCAL_WRITE.max(c) / c * c;
            let mut r = Ok(());
            for (i, p) in piece.chunks(step as usize).enumerate() {
                r = dst.job_write(at + start + i as u64 * step, p);
                if r.is_err() {
                    break;
                }
            }
            r
        };
        written.map_err(|e| {
            format!(
                "writing {to} at {}: {}",
                at + start,
                crate::logging::error_chain(&e)
            )
        })?;
    }
    Ok(())
}

/// Make the calling (copying) thread give way to the guest: the lowest CPU priority
/// (nice 19), so that a job uses the CPU time the guest's requests leave, and with
/// `io` the idle I/O class (`io::priority`), so that its reads and writes wait for the
/// disk until the guest's are served. Without the I/O class, a job's first pass (1 MiB reads and
/// writes from 16 threads) took half the guest's 4 KiB write IOPS on the test disk;
/// with it 0.1 to 0.2 (BENCHMARKS.md, "Jobs that give way to the guest's I/O").
fn yield_to_guest(io: bool) {
    // SAFETY: a plain system call on the calling thread, no memory passed.
    unsafe {
        let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
        libc::setpriority(libc::PRIO_PROCESS, tid, 19);
    }
    if io {
        // Best effort: without it (a seccomp filter), only the CPU priority applies.
        crate::io::priority::set_idle();
    }
}

/// Copy `extents` along `route` with up to [`COPIERS`] threads, in pieces of at most
/// `step` bytes; `each` is told the bytes of every chunk; `stop` ends it early (what was
/// copied stays; the caller looks at why).
pub(super) fn copy_extents(
    route: &Route,
    extents: &[(u64, u64)],
    step: u64,
    each: &(dyn Fn(u64) + Sync),
    stop: &(dyn Fn() -> bool + Sync),
) -> Result<(), String> {
    let pieces: Vec<(u64, u64)> = extents
        .iter()
        .flat_map(|&(o, l)| {
            (0..l.div_ceil(step)).map(move |i| (o + i * step, step.min(l - i * step)))
        })
        .collect();
    let next = AtomicUsize::new(0);
    let failed: Mutex<Option<String>> = Mutex::new(None);
    let work = || {
        // With the guest paused (the last step of a switch) there is nothing to give way
        // to, and the pause must not wait behind other disks' I/O.
        yield_to_guest(!route.guest_paused);
        let mut buf = match AlignedBuf::new(step as usize, 4096) {
            Ok(b) => b,
            Err(e) => {
                *failed.locked() = Some(e.to_string());
                return;
            }
        };
        let mut io = ThreadIo::default();
        loop {
            let i = next.fetch_add(1, Ordering::Relaxed);
            let Some(&(o, l)) = pieces.get(i) else { break };
            if stop() || failed.locked().is_some() {
                break;
            }
            if let Err(e) = copy(route, o, l, &mut buf, &mut io, &mut |n| each(n)) {
                failed.locked().get_or_insert(e);
                break;
            }
        }
        if let Err(e) = io.flush(route.dst, route.to) {
            failed.locked().get_or_insert(e);
        }
    };
    let threads = COPIERS.min(pieces.len());
    if threads == 0 {
        return Ok(());
    }
    // Threads of their own even for one piece: they lower their priority, and the job's
    // thread (whose later threads would inherit it) must not.
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(work);
        }
    });
    match failed.into_inner() {
        Ok(None) => Ok(()),
        Ok(Some(e)) => Err(e),
        Err(_) => Err("a copying thread panicked".into()),
    }
}

/// What an active job's passes need besides the route: the device (to switch the
/// write-through on with the queues paused), the target (shared with the queues while
/// the write-through is on), the job's bitmap and the copy mode.
pub(super) struct Active<'a> {
    pub(super) host: &'a dyn Host,
    pub(super) target: &'a Arc<Image>,
    pub(super) tracker: &'a Arc<DirtyBitmap>,
    pub(super) mode: CopyMode,
}

/// Switch the device's write-through (`active`) on or off, between two guest requests.
pub(super) fn set_write_through(host: &dyn Host, wt: Option<Arc<WriteThrough>>) {
    let mut wt = Some(wt);
    host.paused(&mut || {
        if let Some(w) = wt.take() {
            host.write_through().set(w);
        }
    });
    // The queues could not be paused (none is connected): nothing is in flight.
    if let Some(w) = wt {
        host.write_through().set(w);
    }
}

/// An active job's passes: copy again what the guest dirtied (`tracker`) along `route`,
/// until at most [`CONVERGED`] bytes are left; with `manual`, wait in `ready` (still
/// copying) until `job-complete`. In write-through mode (from the start, or in auto mode
/// once passes stop shrinking) the guest's writes also go to the target (`active`), which
/// stays on for the caller's last step (`switch_to` switches it off); on an error it is
/// switched off here. Returns what is left, for the paused last step.
pub(super) fn converge(
    job: &Job,
    route: &Route,
    active: &Active,
    step: u64,
    manual: bool,
    stop: &(dyn Fn() -> bool + Sync),
) -> Result<Vec<(u64, u64)>, String> {
    let mut through: Option<Arc<WriteThrough>> = None;
    let r = passes(job, route, active, step, manual, stop, &mut through);
    if r.is_err() && through.is_some() {
        set_write_through(active.host, None);
    }
    r
}

fn passes(
    job: &Job,
    route: &Route,
    active: &Active,
    step: u64,
    manual: bool,
    stop: &(dyn Fn() -> bool + Sync),
    through: &mut Option<Arc<WriteThrough>>,
) -> Result<Vec<(u64, u64)>, String> {
    // A remote target is written through connections of the copying threads only.
    let mode = if active.target.is_remote() {
        CopyMode::Background
    } else {
        active.mode
    };
    let switch_on = |through: &mut Option<Arc<WriteThrough>>, why: &str| match WriteThrough::start(
        active.target.clone(),
        active.tracker.clone(),
    ) {
        Ok(wt) => {
            let wt = Arc::new(wt);
            set_write_through(active.host, Some(wt.clone()));
            *through = Some(wt);
            log::info!(
                "{} job {}: write-through copy mode on ({why}): each guest write is also \
                     sent to {} as it completes",
                job.kind,
                job.id,
                route.to
            );
        }
        Err(e) => log::warn!(
            "{} job {}: {e}; copying in the background",
            job.kind,
            job.id
        ),
    };
    if mode == CopyMode::WriteThrough {
        switch_on(through, "--copy-mode write-through");
    }
    let tracker = active.tracker;
    let mut pending: Vec<(u64, u64)> = Vec::new();
    // Passes in a row whose dirty bytes did not shrink (said once in the log).
    let (mut last, mut growing, mut warned) = (u64::MAX, 0u32, false);
    let mut pass = Instant::now();
    loop {
        if stop() {
            return Err(if job.cancelled() {
                "cancelled".into()
            } else {
                "the image was switched while the job ran".into()
            });
        }
        let (more, _) = tracker.take_extents(0, u64::MAX);
        pending.extend(more);
        if job.handover_requested() {
            return Ok(pending);
        }
        let dirty: u64 = pending.iter().map(|e| e.1).sum();
        if dirty <= CONVERGED {
            if !manual || job.completion_requested() {
                return Ok(pending);
            }
            job.set_ready();
        } else {
            growing = if dirty >= last { growing + 1 } else { 0 };
            // Auto: the guest dirtied at least half as much as the pass before copied: the
            // passes would take long to converge, if ever.
            if mode == CopyMode::Auto && through.is_none() && last != u64::MAX && dirty >= last / 2
            {
                switch_on(
                    through,
                    &format!(
                        "the guest dirtied {} MiB during the last pass, {} MiB the pass before",
                        dirty >> 20,
                        last >> 20
                    ),
                );
            } else if growing >= NOT_CONVERGING && !warned && through.is_none() {
                warned = true;
                log::warn!(
                    "{} job {}: the guest dirtied {} MiB during the last pass ({:.1} s), no \
                     less than before: it writes about as fast as the job copies, and the job \
                     will not reach its switch until the guest writes less (vublk ctl \
                     set-throttle --write-iops N), the job is cancelled, or it runs with \
                     --copy-mode write-through or auto",
                    job.kind,
                    job.id,
                    dirty >> 20,
                    pass.elapsed().as_secs_f64()
                );
            }
            last = dirty;
        }
        pass = Instant::now();
        job.add_total(dirty);
        let mut r = *route;
        r.through = through.as_deref();
        copy_extents(&r, &pending, step, &|k| job.advance(k), stop)?;
        pending.clear();
        if dirty <= CONVERGED {
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{track_granularity, yield_to_guest};
    use crate::io::priority::{CLASS_IDLE, WHO_PROCESS};

    /// The calling thread's (CPU nice, I/O priority).
    fn priorities() -> (i32, i64) {
        // SAFETY: plain system calls about the calling thread.
        unsafe {
            let tid = libc::syscall(libc::SYS_gettid) as libc::c_int;
            *libc::__errno_location() = 0;
            let nice = libc::getpriority(libc::PRIO_PROCESS, tid as libc::id_t);
            let io = libc::syscall(libc::SYS_ioprio_get, WHO_PROCESS, tid);
            (nice, io)
        }
    }

    /// A new thread's priorities after `yield_to_guest(io)`.
    fn yielded(io: bool) -> (i32, i64) {
        std::thread::spawn(move || {
            yield_to_guest(io);
            priorities()
        })
        .join()
        .unwrap()
    }

    #[test]
    fn copying_threads_give_way_to_the_guest_on_the_cpu_and_the_disk() {
        assert_eq!(
            yielded(true),
            (19, CLASS_IDLE as i64),
            "nice 19, the idle I/O class"
        );
        // With the guest paused: the CPU priority only.
        let (nice, io) = yielded(false);
        assert_eq!(nice, 19);
        assert_ne!(io >> 13, 3, "not the idle class");
        // The test's own thread is untouched.
        assert_ne!(priorities().0, 19);
    }

    #[test]
    fn the_job_bitmap_is_fine_but_bounded() {
        assert_eq!(track_granularity(1 << 30), 4096);
        assert_eq!(track_granularity(256 << 30), 4096);
        assert_eq!(track_granularity(1 << 40), 16384);
        // 64 Mi bits at most: 8 MiB.
        for size in [1u64 << 40, 3 << 40, 1 << 50] {
            assert!(size / track_granularity(size) <= 1 << 26);
        }
    }
}
