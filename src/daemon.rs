//! The daemon: open the image, listen (path or inherited fd), serve one frontend at a time
//! and the next after it disconnects, and shut down cleanly on SIGTERM/SIGINT.

use std::io;
use std::os::fd::FromRawFd;
use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use log::{error, info, warn};
use vhost::vhost_user::Listener;
use vhost_user_backend::{ShutdownHandle, VhostUserDaemon};
use vm_memory::{GuestMemoryAtomic, GuestMemoryMmap};
use vmm_sys_util::epoll::EventSet;

use crate::args::{AioMode, CacheMode, Format};
use crate::backend::{completion_event_id, VhostUserBlkBackend};
use crate::config::{Config, Socket};
use crate::device::{Device, DeviceParams};
use crate::image::chain::{open_chain, ChainError};
use crate::image::qcow2::{self, Qcow2Error, Qcow2Image};
use crate::image::{open_raw, OpenError};
use crate::io::align::{self, ProbeSource};
use crate::io::{Engine, SyncEngine, UringEngine};
use crate::worker::QueueWorker;

/// Start-up failures; each names what the operator should check.
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    #[error(transparent)]
    Image(#[from] OpenError),
    #[error(transparent)]
    Chain(#[from] ChainError),
    #[error("image {}", .path.display())]
    Qcow2 { path: PathBuf, source: Qcow2Error },
    #[error("image {}", .path.display())]
    Parallels {
        path: PathBuf,
        source: crate::image::parallels::ParallelsError,
    },
    #[error("socket path {0} is in use by another process (is another vublk serving it?)")]
    SocketBusy(PathBuf),
    #[error("socket path {0} exists and is not a socket; refusing to replace it")]
    NotASocket(PathBuf),
    #[error("cannot listen on {path}")]
    Listen {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("--fd {0} is not an open socket")]
    BadFd(i32),
    #[error("cannot create the I/O engine")]
    Engine(#[source] io::Error),
    #[error("vhost-user daemon error: {0}")]
    Vhost(String),
    #[error("cannot set up signal handling")]
    Signals(#[source] io::Error),
    /// An option that does not fit the image (exit status 2, like other bad options).
    #[error("{0}")]
    Usage(String),
}

/// Open the image and build the shared device.
pub fn open_device(cfg: &Config) -> Result<Arc<Device>, DaemonError> {
    let direct = cfg.cache == CacheMode::None;
    let img = open_raw(&cfg.blk_file, cfg.read_only, direct, cfg.logical_block_size)?;
    let (dio, source) = align::probe(&img.file, direct);
    if source != ProbeSource::NotDirect {
        info!(
            "O_DIRECT alignment: memory {} bytes, offset {} bytes (from {:?})",
            dio.mem, dio.offset, source
        );
    }
    if dio.offset > cfg.logical_block_size as usize {
        warn!(
            "the image needs {}-byte aligned direct I/O but the guest is told {}-byte blocks: \
             smaller writes are read-modify-written (slow); consider --logical-block-size {}",
            dio.offset,
            cfg.logical_block_size,
            dio.offset.min(4096)
        );
    }
    let serial = match &cfg.serial {
        Some(s) => s.as_bytes().to_vec(),
        None => default_serial(img.dev_ino),
    };
    let format = cfg.format.unwrap_or_else(|| {
        if qcow2::probe(&img.file) {
            Format::Qcow2
        } else if crate::image::parallels::probe(&img.file) {
            Format::Parallels
        } else {
            Format::Raw
        }
    });
    let mut parallels = None;
    let (qcow2, size_bytes) = match format {
        Format::Raw => (None, img.size_bytes),
        Format::Parallels => {
            // Metadata is written in blocks of the file's direct-I/O alignment.
            let chunk = if direct { dio.offset as u64 } else { 512 };
            let p = crate::image::parallels::ParallelsImage::open(&img.file, !cfg.read_only, chunk)
                .map_err(|source| DaemonError::Parallels {
                    path: cfg.blk_file.clone(),
                    source,
                })?;
            if p.was_in_use && p.writable() {
                warn!(
                    "parallels: {} was not closed cleanly (in-use set): checked it: every BAT \
                     entry inside the file and used once, {} bytes of leaked tail cut off",
                    cfg.blk_file.display(),
                    p.trimmed_at_open
                );
            }
            info!(
                "parallels: {} bytes, {} KiB clusters, {} clusters allocated, data at {}{}",
                p.size_bytes,
                p.cluster_size >> 10,
                p.allocated_clusters(),
                p.data_off,
                if p.ext_cluster.is_some() {
                    ", format extension cluster kept"
                } else {
                    ""
                }
            );
            let size = p.size_bytes;
            parallels = Some(p);
            (None, size)
        }
        Format::Qcow2 => {
            let q = Qcow2Image::open_with_cache(&img.file, !cfg.read_only, cfg.l2_cache_bytes)
                .map_err(|source| DaemonError::Qcow2 {
                    path: cfg.blk_file.clone(),
                    source,
                })?;
            info!(
                "qcow2 v{}: {} bytes, {} KiB clusters, {:?} compression, L2 cache {} KiB (maps {} MiB)",
                q.version,
                q.size_bytes,
                q.cluster_size() >> 10,
                q.compression,
                q.l2_cache_bytes().0 >> 10,
                q.l2_cache_bytes().1 >> 20
            );
            let size = q.size_bytes;
            (Some(q), size)
        }
    };
    let backing = match &qcow2 {
        Some(q) => open_chain(
            &cfg.blk_file,
            q.backing_file.as_deref(),
            cfg.follow_backing,
            direct,
        )?,
        None => Vec::new(),
    };
    for l in &backing {
        info!(
            "backing file {} ({}, read-only)",
            l.path.display(),
            if l.qcow2.is_some() { "qcow2" } else { "raw" }
        );
    }
    let params = DeviceParams {
        size_bytes,
        logical_block_size: cfg.logical_block_size,
        read_only: cfg.read_only,
        num_queues: cfg.num_queues,
        queue_size: cfg.queue_size,
        cache: cfg.cache,
        align: dio,
        serial,
        detect_zeroes: cfg.detect_zeroes,
        discard_unmap: cfg.discard == crate::args::DiscardMode::Unmap,
        is_block_device: img.is_block_device,
        probed_raw: cfg.format.is_none() && format == Format::Raw,
    };
    if cfg.detect_zeroes != crate::zero::DetectZeroes::Off {
        info!(
            "detect-zeroes {:?} (scanner: {}), discard {:?}",
            cfg.detect_zeroes,
            crate::zero::scanner_name(),
            cfg.discard
        );
    }
    info!(
        "serving {} ({} bytes, cache={:?}, {})",
        cfg.blk_file.display(),
        img.size_bytes,
        cfg.cache,
        if cfg.read_only {
            "read-only"
        } else {
            "read-write"
        }
    );
    let img_file_meta = img.file.metadata().map_err(|e| {
        DaemonError::Image(OpenError::Open {
            path: cfg.blk_file.clone(),
            source: e,
        })
    })?;
    let mut dev = Device::new(img.file, params);
    if let Some(p) = parallels.as_ref().filter(|p| p.writable()) {
        use crate::image::parallels::PreallocMode;
        let on = cfg.prealloc != crate::args::PreallocArg::Off;
        let mode = match cfg.prealloc_mode {
            crate::args::PreallocModeArg::Falloc => PreallocMode::Falloc,
            crate::args::PreallocModeArg::Truncate => PreallocMode::Truncate,
        };
        p.set_prealloc(on.then_some((mode, cfg.prealloc_size)));
        if on {
            info!(
                "preallocation: {:?}, {} MiB ahead of the data (auto is on for parallels)",
                mode,
                cfg.prealloc_size.max(p.cluster_size) >> 20
            );
        } else {
            info!("preallocation: off (the file grows cluster by cluster)");
        }
    }
    dev.parallels = parallels;
    if cfg.compress_writes && !qcow2.as_ref().is_some_and(|q| q.writable()) {
        return Err(DaemonError::Usage(
            "--compress-writes on: needs a qcow2 image opened read-write".into(),
        ));
    }
    if let Some(q) = qcow2.as_ref().filter(|q| q.writable()) {
        q.set_punch_freed(cfg.discard == crate::args::DiscardMode::Unmap);
        if cfg.cow_threads > 0 {
            match crate::offload::Pool::new(cfg.cow_threads, "vublk-cow") {
                Ok(p) => dev.cow_pool = Some(p),
                Err(e) => warn!("copy-on-write on the queue threads (no thread pool: {e})"),
            }
        }
        if cfg.compress_writes {
            q.set_compress_writes(true);
            q.set_compressed_cache(cfg.compressed_cache);
            let c = q.cluster_size();
            let clusters = match cfg.compressed_cache_bytes {
                None => crate::image::qcow2::DEFAULT_COMPRESSED_CACHE_CLUSTERS,
                Some(n) if n >= c => (n / c) as usize,
                Some(n) => {
                    return Err(DaemonError::Usage(format!(
                        "--compressed-cache-size {n}: smaller than one cluster ({c} bytes)"
                    )))
                }
            };
            q.set_compressed_cache_clusters(clusters);
            if cfg.compress_threads > 0 {
                match crate::offload::Pool::new(cfg.compress_threads, "vublk-compress") {
                    Ok(p) => dev.compress_pool = Some(p),
                    Err(e) => warn!("compressing on the queue threads (no thread pool: {e})"),
                }
            }
            info!(
                "compressed writes: on ({:?}, cache {}, {} compression threads): clusters \
                 written whole are stored compressed",
                q.compression,
                if cfg.compressed_cache {
                    format!("on, {clusters} clusters")
                } else {
                    "off".into()
                },
                cfg.compress_threads
            );
        }
        let file_align = dio.offset as u64;
        if cfg.prealloc_align % file_align != 0 {
            return Err(DaemonError::Usage(format!(
                "--prealloc-align {}: must be a multiple of the file's alignment ({file_align} bytes)",
                cfg.prealloc_align
            )));
        }
        let (on, why) = match cfg.prealloc {
            crate::args::PreallocArg::On => (true, "--prealloc on".to_owned()),
            crate::args::PreallocArg::Off => (false, "--prealloc off".to_owned()),
            crate::args::PreallocArg::Auto => match rotational(&img_file_meta) {
                Some((dev, false)) => (true, format!("auto: {dev} is not rotational")),
                Some((dev, true)) => (false, format!("auto: {dev} is rotational")),
                None => (
                    false,
                    "auto: the file system's block device is unknown".to_owned(),
                ),
            },
        };
        if on {
            q.set_prealloc(Some((cfg.prealloc_size, cfg.prealloc_align, file_align)));
            match dev.file.try_clone() {
                Ok(f) => q.set_prealloc_thread(f),
                Err(e) => warn!("preallocation on the queue threads (no second handle: {e})"),
            }
            info!(
                "preallocation: on ({why}): {} MiB ahead, lengths rounded to {} KiB",
                cfg.prealloc_size >> 20,
                cfg.prealloc_align >> 10
            );
        } else {
            info!("preallocation: off ({why})");
        }
    }
    dev.qcow2 = qcow2;
    dev.backing = backing;
    Ok(Arc::new(dev))
}

/// Is the block device holding this file rotational? (`/sys/dev/block/MAJ:MIN`, or its
/// parent disk for a partition.) None for files on no block device (tmpfs, network).
fn rotational(meta: &std::fs::Metadata) -> Option<(String, bool)> {
    use std::os::unix::fs::MetadataExt;
    let dev = meta.dev();
    let (major, minor) = (libc::major(dev), libc::minor(dev));
    if major == 0 {
        return None;
    }
    let base = PathBuf::from(format!("/sys/dev/block/{major}:{minor}"));
    for q in [
        base.join("queue/rotational"),
        base.join("../queue/rotational"),
    ] {
        if let Ok(s) = std::fs::read_to_string(&q) {
            let name = std::fs::canonicalize(&base)
                .ok()
                .and_then(|p| {
                    p.file_name()
                        .map(|n| format!("/dev/{}", n.to_string_lossy()))
                })
                .unwrap_or_else(|| format!("block device {major}:{minor}"));
            return Some((name, s.trim() == "1"));
        }
    }
    None
}

/// Serial derived from the file's identity: stable across restarts, distinct per file.
fn default_serial((dev, ino): (u64, u64)) -> Vec<u8> {
    let mut s = format!("vublk{:x}{:x}", dev, ino).into_bytes();
    s.truncate(crate::config::SERIAL_MAX_BYTES);
    s
}

/// Pick the engine; io_uring falls back to threads (once, with one warning line).
pub fn make_engine(aio: AioMode, entries: u32, warned: &mut bool) -> Result<Engine, DaemonError> {
    if aio == AioMode::Threads {
        return Ok(Engine::Sync(SyncEngine::new()));
    }
    match UringEngine::new(entries) {
        Ok(e) => Ok(Engine::Uring(e)),
        Err(e) if matches!(e.raw_os_error(), Some(libc::EPERM) | Some(libc::ENOSYS)) => {
            if !*warned {
                warn!("io_uring is not available ({e}); falling back to --aio threads");
                *warned = true;
            }
            Ok(Engine::Sync(SyncEngine::new()))
        }
        Err(e) => Err(DaemonError::Engine(e)),
    }
}

/// Check the socket path: refuse a live socket or a non-socket; remove a stale socket.
fn prepare_socket_path(path: &Path) -> Result<(), DaemonError> {
    match std::fs::symlink_metadata(path) {
        Err(_) => Ok(()),
        Ok(m) if !m.file_type().is_socket() => Err(DaemonError::NotASocket(path.to_owned())),
        Ok(_) => match UnixStream::connect(path) {
            Ok(_) => Err(DaemonError::SocketBusy(path.to_owned())),
            Err(_) => {
                info!("removing stale socket {}", path.display());
                std::fs::remove_file(path).map_err(|e| DaemonError::Listen {
                    path: path.to_owned(),
                    source: e,
                })
            }
        },
    }
}

fn listen(socket: &Socket) -> Result<Listener, DaemonError> {
    match socket {
        Socket::Path(p) => {
            prepare_socket_path(p)?;
            let l = Listener::new(p, true).map_err(|e| DaemonError::Listen {
                path: p.clone(),
                source: io::Error::other(e.to_string()),
            })?;
            info!("listening on {}", p.display());
            Ok(l)
        }
        Socket::Fd(fd) => {
            // SAFETY: fstat on an arbitrary integer is harmless; we only adopt the fd if it is
            // an open socket.
            let mut st: libc::stat = unsafe { std::mem::zeroed() };
            // SAFETY: valid out pointer.
            let ok = unsafe { libc::fstat(*fd, &mut st) } == 0
                && (st.st_mode & libc::S_IFMT) == libc::S_IFSOCK;
            if !ok {
                return Err(DaemonError::BadFd(*fd));
            }
            info!("listening on inherited fd {fd}");
            // SAFETY: the operator handed us this descriptor (--fd) and it is a socket; we
            // take ownership of it.
            Ok(unsafe { Listener::from_raw_fd(*fd) })
        }
    }
}

/// Shared between the serving thread and the signal thread.
#[derive(Default)]
struct Phase {
    stop: bool,
    connection: Option<ShutdownHandle>,
}

/// Run until SIGTERM/SIGINT. Returns Ok on a clean shutdown.
pub fn run(cfg: Config) -> Result<(), DaemonError> {
    // Block the signals in every thread; the main thread waits for them with sigwait.
    let sigs = block_signals().map_err(DaemonError::Signals)?;
    let dev = open_device(&cfg)?;
    let mut listener = listen(&cfg.socket)?;
    let phase = Arc::new(Mutex::new(Phase::default()));

    let serve_phase = phase.clone();
    let serve_dev = dev.clone();
    let serve_cfg = cfg.clone();
    let server = std::thread::Builder::new()
        .name("vublk-serve".into())
        .spawn(move || serve_loop(&serve_cfg, serve_dev, &mut listener, &serve_phase))
        .map_err(|e| DaemonError::Vhost(e.to_string()))?;

    let sig = wait_signal(&sigs);
    info!("received {}, shutting down", signal_name(sig));
    {
        let mut p = phase.lock().unwrap_or_else(|e| e.into_inner());
        p.stop = true;
        match p.connection.take() {
            Some(h) => h.shutdown(),
            None => {
                // Idle: nothing in flight. Flush and leave; the serving thread may be blocked
                // in accept().
                flush(&dev);
                log_device_stats(&dev);
                info!("exiting");
                return Ok(());
            }
        }
    }
    let r = server
        .join()
        .map_err(|_| DaemonError::Vhost("serving thread panicked".into()))?;
    flush(&dev);
    log_device_stats(&dev);
    info!("exiting");
    r
}

/// Log the counters that outlive connections.
fn log_device_stats(dev: &Device) {
    info!("detect-zeroes/discard: {}", dev.zero_stats.summary());
    if let Some(p) = dev.parallels.as_ref().filter(|p| p.writable()) {
        let n = |a: &std::sync::atomic::AtomicU64| a.load(std::sync::atomic::Ordering::Relaxed);
        info!(
            "parallels: {} clusters allocated ({} reused from free space), {} freed, file \
             grown {} times by {} MiB",
            n(&p.stats.allocated),
            n(&p.stats.reused),
            n(&p.stats.freed),
            n(&p.stats.grows),
            n(&p.stats.grown_bytes) >> 20
        );
    }
    if let Some(q) = dev.qcow2.as_ref().filter(|q| q.writable()) {
        let (done, skipped) = q.prealloc_counts();
        info!("preallocation: {done} done, {skipped} skipped");
        info!(
            "qcow2: {} copy-on-writes done without the allocation lock",
            q.cow_unlocked.load(std::sync::atomic::Ordering::Relaxed)
        );
        if q.compress_writes() {
            info!(
                "compressed writes: {} clusters compressed, {} stored normally (did not compress)",
                q.compress_stats
                    .0
                    .load(std::sync::atomic::Ordering::Relaxed),
                q.compress_stats
                    .1
                    .load(std::sync::atomic::Ordering::Relaxed)
            );
            let (writes, bytes) = q.compressed_file_writes();
            info!("compressed writes: {writes} writes of {bytes} bytes reached the file");
        }
    }
}

fn flush(dev: &Device) {
    if !dev.params.read_only {
        if let Err(e) = dev.close() {
            error!("final flush failed: {e}");
        }
    }
}

fn serve_loop(
    cfg: &Config,
    dev: Arc<Device>,
    listener: &mut Listener,
    phase: &Mutex<Phase>,
) -> Result<(), DaemonError> {
    let mut warned = false;
    let mut first = true;
    loop {
        let mem = GuestMemoryAtomic::new(GuestMemoryMmap::<()>::new());
        let mut workers = Vec::with_capacity(usize::from(cfg.num_queues));
        for q in 0..cfg.num_queues {
            let engine = make_engine(cfg.aio, u32::from(cfg.queue_size) * 2, &mut warned)?;
            if q == 0 && first {
                info!("I/O engine: {}", engine.name());
            }
            workers.push(QueueWorker::new(q, dev.clone(), engine, mem.clone()));
        }
        first = false;
        let poll = std::time::Duration::from_micros(u64::from(cfg.poll_us));
        let backend = Arc::new(VhostUserBlkBackend::new(dev.clone(), workers, poll));
        let mut daemon = VhostUserDaemon::new("vublk".into(), backend.clone(), mem)
            .map_err(|e| DaemonError::Vhost(e.to_string()))?;
        let handlers = daemon.get_epoll_handlers();
        for (i, fd) in backend.engine_event_fds().into_iter().enumerate() {
            if let (Some(fd), Some(h)) = (fd, handlers.get(i)) {
                // Edge-triggered: each completion signal wakes the queue thread once, and the
                // eventfd never needs a read() (one system call less per completion batch).
                h.register_listener(
                    fd,
                    EventSet::IN | EventSet::EDGE_TRIGGERED,
                    completion_event_id(cfg.num_queues),
                )
                .map_err(|e| DaemonError::Vhost(format!("register completion eventfd: {e}")))?;
            }
        }
        if let Err(e) = daemon.start(listener) {
            error!("accepting a connection failed: {e}");
            continue;
        }
        {
            let mut p = phase.lock().unwrap_or_else(|e| e.into_inner());
            if p.stop {
                daemon.request_shutdown();
            } else {
                p.connection = daemon.shutdown_handle();
            }
        }
        info!("frontend connected");
        match daemon.wait() {
            Ok(()) => info!("frontend disconnected"),
            // libblkio and QEMU just close the socket when they are done.
            Err(vhost_user_backend::Error::HandleRequest(
                vhost::vhost_user::Error::Disconnected | vhost::vhost_user::Error::PartialMessage,
            )) => info!("frontend disconnected"),
            Err(e) => warn!("frontend session ended: {e}"),
        }
        // Stop the queue threads first (no new requests can start), then complete what was in
        // flight while the guest memory is still mapped.
        drop(daemon);
        backend.drain_all();
        backend.log_stats();
        let stop = {
            let mut p = phase.lock().unwrap_or_else(|e| e.into_inner());
            p.connection = None;
            p.stop
        };
        if stop {
            return Ok(());
        }
    }
}

fn block_signals() -> io::Result<libc::sigset_t> {
    // SAFETY: sigset manipulation on a local, then pthread_sigmask for this thread (inherited
    // by threads spawned afterwards).
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::sigaddset(&mut set, libc::SIGINT);
        let r = libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        if r != 0 {
            return Err(io::Error::from_raw_os_error(r));
        }
        Ok(set)
    }
}

fn wait_signal(set: &libc::sigset_t) -> i32 {
    loop {
        let mut sig: libc::c_int = 0;
        // SAFETY: set is initialised, sig is a valid out pointer.
        let r = unsafe { libc::sigwait(set, &mut sig) };
        if r == 0 {
            return sig;
        }
    }
}

fn signal_name(sig: i32) -> &'static str {
    match sig {
        libc::SIGTERM => "SIGTERM",
        libc::SIGINT => "SIGINT",
        _ => "signal",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_serial_fits_get_id() {
        let s = default_serial((u64::MAX, u64::MAX));
        assert!(s.len() <= 20);
        assert!(s.starts_with(b"vublk"));
        assert_ne!(default_serial((1, 2)), default_serial((1, 3)));
    }

    #[test]
    fn non_socket_path_is_refused() {
        let p = std::env::temp_dir().join(format!("vublk-notsock-{}", std::process::id()));
        std::fs::write(&p, b"x").unwrap();
        assert!(matches!(
            prepare_socket_path(&p),
            Err(DaemonError::NotASocket(_))
        ));
        std::fs::remove_file(&p).unwrap();
    }

    #[test]
    fn live_socket_is_busy_and_stale_one_is_removed() {
        let p = std::env::temp_dir().join(format!("vublk-sock-{}", std::process::id()));
        let _ = std::fs::remove_file(&p);
        let l = std::os::unix::net::UnixListener::bind(&p).unwrap();
        assert!(matches!(
            prepare_socket_path(&p),
            Err(DaemonError::SocketBusy(_))
        ));
        drop(l);
        prepare_socket_path(&p).unwrap();
        assert!(!p.exists());
    }
}
