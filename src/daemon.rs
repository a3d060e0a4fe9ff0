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
use vm_memory::GuestMemoryAtomic;
use vmm_sys_util::epoll::EventSet;

use crate::backend::{completion_event_id, VhostUserBlkBackend};
use crate::config::{Config, Socket};
use crate::device::{Device, DeviceParams};
use crate::image::{EngineChoice, Image, ImageOpenError};
use crate::locks::Locked;
use crate::worker::QueueWorker;

/// Start-up failures; each names what the operator should check.
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    #[error(transparent)]
    Image(#[from] ImageOpenError),
    #[error("socket path {0} is in use by another process (is another vublk serving it?)")]
    SocketBusy(PathBuf),
    #[error("socket path {0} exists and is not a socket; refusing to replace it")]
    NotASocket(PathBuf),
    #[error("pidfile {path}")]
    PidFile {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot remove the stale socket {path}")]
    RemoveStale {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot listen on {path}")]
    Listen {
        path: PathBuf,
        #[source]
        source: vhost::vhost_user::Error,
    },
    #[error("--fd {0} is not an open socket")]
    BadFd(i32),
    #[error("cannot create the I/O engine")]
    Engine(#[source] io::Error),
    /// (vhost-user-backend's error is not a `std::error::Error`: it can only be shown.)
    #[error("cannot set up the vhost-user daemon: {0}")]
    Vhost(vhost_user_backend::Error),
    #[error("cannot watch the I/O engine's completion eventfd")]
    RegisterCompletions(#[source] io::Error),
    #[error("cannot start the serving thread")]
    Spawn(#[source] io::Error),
    #[error("the serving thread panicked")]
    ServeThreadPanicked,
    #[error("cannot set up signal handling")]
    Signals(#[source] io::Error),
    #[error(transparent)]
    Control(#[from] crate::control::ControlError),
    #[error(transparent)]
    Metrics(#[from] crate::metrics::MetricsError),
    /// An option that does not fit the image (exit status 2, like other bad options).
    #[error("{0}")]
    Usage(String),
}

/// Open the image and build the shared device.
pub fn open_device(cfg: &Config) -> Result<Arc<Device>, DaemonError> {
    let mut opts = cfg.image_options();
    // After a snapshot the top of the chain is served, not --blk-file (snapshot::state).
    let top = crate::snapshot::state::top(&cfg.blk_file, cfg.chain_state.as_deref())
        .map_err(DaemonError::Usage)?;
    if let Some(r) = &top {
        info!(
            "serving {} (the top of {}'s chain, as the chain state file {} says)",
            r.top.display(),
            cfg.blk_file.display(),
            cfg.chain_state
                .as_deref()
                .unwrap_or(Path::new("?"))
                .display()
        );
        opts.path = r.top.clone();
        // The top's format (an active commit may leave a raw or parallels base on top).
        opts.format = Some(match r.format.as_str() {
            "raw" => crate::image::Format::Raw,
            "parallels" => crate::image::Format::Parallels,
            _ => crate::image::Format::Qcow2,
        });
        opts.follow_backing = true;
    }
    let opened = if cfg.incoming {
        Image::incoming(&opts)
    } else {
        Image::open(&opts)
    };
    let (image, dio, facts) = match opened {
        Ok(x) => x,
        Err(ImageOpenError::Option(msg)) => return Err(DaemonError::Usage(msg)),
        Err(e) => return Err(e.into()),
    };
    if let (Some(r), false) = (top.as_ref().filter(|r| !r.detached), cfg.incoming) {
        let below = image.backing_paths();
        if !below
            .iter()
            .any(|p| crate::snapshot::state::same_file(p, &cfg.blk_file))
        {
            return Err(DaemonError::Usage(format!(
                "the chain state file {} names {} as the top of {}'s chain, but its backing                  chain ({}) does not hold {}: remove the state file to serve --blk-file                  itself",
                cfg.chain_state.as_deref().unwrap_or(Path::new("?")).display(),
                r.top.display(),
                cfg.blk_file.display(),
                below
                    .iter()
                    .map(|p| p.display().to_string())
                    .collect::<Vec<_>>()
                    .join(" <- "),
                cfg.blk_file.display()
            )));
        }
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
        None => default_serial(facts.dev_ino),
    };
    // Storage that says itself whether it caches writes (librbd) sets the guest's write
    // cache: writeback (WCE 1, FLUSH empties it) or writethrough (WCE 0).
    let cache = match facts.write_cache {
        None => cfg.cache,
        Some(true) => crate::device::CacheMode::Writeback,
        Some(false) => crate::device::CacheMode::Writethrough,
    };
    let params = DeviceParams {
        logical_block_size: cfg.logical_block_size,
        // An RBD snapshot is read-only whatever the options say (a migration destination's
        // image is read-only only until it is taken over).
        read_only: cfg.read_only || (image.read_only() && !cfg.incoming),
        num_queues: cfg.num_queues,
        queue_size: cfg.queue_size,
        cache,
        align: dio,
        serial,
        detect_zeroes: cfg.detect_zeroes,
        discard_unmap: cfg.discard == crate::device::DiscardMode::Unmap,
        is_block_device: facts.is_block_device,
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
        opts.path.display(),
        facts.file_size_bytes,
        cfg.cache,
        if cfg.read_only {
            "read-only"
        } else {
            "read-write"
        }
    );
    let dev = Arc::new(Device::with_reopen(image, params, Some(opts)));
    if !cfg.throttle.unlimited() {
        info!("I/O limits: {:?} (0: unlimited)", cfg.throttle);
        dev.throttle.set(cfg.throttle);
    }
    dev.holds
        .set_policy(cfg.werror, cfg.rerror, cfg.error_retry);
    watch_resizes(&dev)?;
    Ok(dev)
}

/// A disk resized elsewhere (an RBD image by `rbd resize` in the cluster) grows as `vublk
/// ctl resize` does: the driver's watch wakes a thread that reads the new size and tells the
/// frontend. Shrinking is refused (logged): the guest keeps its size.
fn watch_resizes(dev: &Arc<Device>) -> Result<(), DaemonError> {
    if dev.params.read_only {
        return Ok(());
    }
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let watched = dev
        .image
        .get()
        .watch_resizes(Arc::new(move || {
            let _ = tx.send(());
        }))
        .map_err(|e| DaemonError::Image(ImageOpenError::Remote(e)))?;
    if !watched {
        return Ok(());
    }
    // Updates that come first wait in the channel.
    let weak = Arc::downgrade(dev);
    std::thread::Builder::new()
        .name("vublk-resize-watch".into())
        .spawn(move || {
            while rx.recv().is_ok() {
                // One look for a burst of updates.
                while rx.try_recv().is_ok() {}
                let Some(dev) = weak.upgrade() else { return };
                if let Err(e) = dev.resize(None) {
                    warn!("the disk changed size elsewhere: {e}");
                }
            }
        })
        .map_err(DaemonError::Spawn)?;
    Ok(())
}

/// Serial derived from the file's identity: stable across restarts, distinct per file.
fn default_serial((dev, ino): (u64, u64)) -> Vec<u8> {
    let mut s = format!("vublk{:x}{:x}", dev, ino).into_bytes();
    s.truncate(crate::config::SERIAL_MAX_BYTES);
    s
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
                std::fs::remove_file(path).map_err(|source| DaemonError::RemoveStale {
                    path: path.to_owned(),
                    source,
                })
            }
        },
    }
}

fn listen(socket: &Socket) -> Result<Listener, DaemonError> {
    match socket {
        Socket::Path(p) => {
            prepare_socket_path(p)?;
            let l = Listener::new(p, true).map_err(|source| DaemonError::Listen {
                path: p.clone(),
                source,
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
    connection: Option<(ShutdownHandle, Arc<VhostUserBlkBackend>)>,
}

/// Run until SIGTERM/SIGINT. Returns Ok on a clean shutdown.
pub fn run(cfg: Config) -> Result<(), DaemonError> {
    // Block the signals in every thread; the main thread waits for them with sigwait.
    let sigs = block_signals().map_err(DaemonError::Signals)?;
    // First, as qemu-storage-daemon does: a second daemon for the same pidfile stops here.
    let _pidfile =
        match &cfg.pidfile {
            Some(path) => Some(crate::service::PidFile::create(path).map_err(|source| {
                DaemonError::PidFile {
                    path: path.clone(),
                    source,
                }
            })?),
            None => None,
        };
    crate::service::raise_fd_limit();
    if let Err(e) = crate::guest_memory::install_sigbus_guard() {
        warn!("no SIGBUS guard ({e}): a frontend that shrinks its guest memory kills vublk");
    }
    let dev = open_device(&cfg)?;
    if let Some(path) = &cfg.control_socket {
        let ctx = crate::control::Context {
            dev: dev.clone(),
            image_path: cfg.blk_file.clone(),
            chain_state: cfg.chain_state.clone(),
            started: std::time::Instant::now(),
        };
        crate::control::serve(
            path,
            cfg.control_group.as_deref(),
            cfg.control_idle_timeout,
            ctx,
        )?;
    }
    for (name, g) in &cfg.bitmaps {
        // Names and granularities were checked with the options.
        match dev
            .bitmaps
            .add(name, *g, false, true, &|l| dev.save_bitmaps(l))
        {
            Ok(()) => info!(
                "bitmap {name:?} ({g}-byte granularity, in memory) records from the first request"
            ),
            Err(e) => warn!("--bitmap {name}: {e}"),
        }
    }
    for (name, g) in &cfg.persistent_bitmaps {
        if cfg.incoming {
            // The image is read at the take-over: its bitmaps are the source's.
            info!("bitmap {name:?}: the image file's, as the source leaves it");
            continue;
        }
        if dev
            .bitmaps
            .persistent()
            .iter()
            .any(|p| p.bitmap.name() == name)
        {
            info!("bitmap {name:?}: kept from the image file");
            continue;
        }
        dev.bitmaps
            .add(name, *g, true, true, &|l| dev.save_bitmaps(l))
            .map_err(|e| DaemonError::Usage(format!("--persistent-bitmap {name}: {e}")))?;
        info!("bitmap {name:?} ({g}-byte granularity) added to the image file");
    }
    if let Err(e) = dev.spawn_watchdog(cfg.stuck_request) {
        warn!("no stuck-request watchdog ({e})");
    }
    if let Some(addr) = &cfg.metrics_addr {
        crate::metrics::serve(addr, dev.clone())?;
    }
    let mut listener = listen(&cfg.socket)?;
    crate::service::ready(&format!(
        "waiting for a frontend; serving {}",
        cfg.blk_file.display()
    ));
    let phase = Arc::new(Mutex::new(Phase::default()));

    let serve_phase = phase.clone();
    let serve_dev = dev.clone();
    let serve_cfg = cfg.clone();
    let server = std::thread::Builder::new()
        .name("vublk-serve".into())
        .spawn(move || serve_loop(&serve_cfg, serve_dev, &mut listener, &serve_phase))
        .map_err(DaemonError::Spawn)?;

    let sig = wait_signal(&sigs);
    info!("received {}, shutting down", signal_name(sig));
    crate::service::stopping(&format!(
        "{}: finishing the requests in flight",
        signal_name(sig)
    ));
    {
        let mut p = phase.locked();
        p.stop = true;
        match p.connection.take() {
            Some((h, backend)) => {
                // Complete what is in flight and tell the guest while the connection is
                // up; only then close it. (Closing first would leave completions the
                // frontend never sees: the next process would run them again and the
                // guest would wait for them for ever.)
                backend.quiesce();
                h.shutdown();
            }
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
        .map_err(|_| DaemonError::ServeThreadPanicked)?;
    flush(&dev);
    log_device_stats(&dev);
    info!("exiting");
    r
}

/// Log the counters that outlive connections.
fn log_device_stats(dev: &Device) {
    info!("detect-zeroes/discard: {}", dev.zero_stats.summary());
    for line in dev.image.get().stats_lines() {
        info!("{line}");
    }
}

/// The clean end: everything written back and synced, the file trimmed, then the locks given
/// up (before the process is gone: its io_uring rings may hold the file a little longer).
fn flush(dev: &Device) {
    if !dev.params.read_only {
        if let Err(e) = dev.image.get().close() {
            error!("final flush failed: {}", crate::logging::error_chain(&e));
        }
    }
    let image = dev.image.get();
    image.release_locks();
    image.disconnect();
}

fn serve_loop(
    cfg: &Config,
    dev: Arc<Device>,
    listener: &mut Listener,
    phase: &Mutex<Phase>,
) -> Result<(), DaemonError> {
    let mut first = true;
    let choice = EngineChoice {
        aio: cfg.aio,
        entries: u32::from(cfg.queue_size) * 2,
    };
    loop {
        let mem = GuestMemoryAtomic::new(crate::guest_memory::Mem::new());
        let mut workers = Vec::with_capacity(usize::from(cfg.num_queues));
        let engines = dev
            .image
            .get()
            .queue_engines(cfg.num_queues, choice)
            .map_err(DaemonError::Engine)?;
        for (q, engine) in (0..cfg.num_queues).zip(engines) {
            if q == 0 && first {
                info!("I/O engine: {}", engine.name());
            }
            let mut w = QueueWorker::new(q, dev.clone(), engine, mem.clone());
            if !cfg.queue_cpus.is_empty() {
                w.set_cpu(Some(cfg.queue_cpus[usize::from(q) % cfg.queue_cpus.len()]));
            }
            workers.push(w);
        }
        first = false;
        let backend = Arc::new(VhostUserBlkBackend::new(dev.clone(), workers, cfg.poll));
        // Before any request: a backup's begin pauses this connection's queues.
        let pause: Arc<dyn crate::device::QueuePause> = backend.clone();
        dev.set_queue_pause(Some(Arc::downgrade(&pause)));
        let mut daemon = VhostUserDaemon::new("vublk".into(), backend.clone(), mem)
            .map_err(DaemonError::Vhost)?;
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
                .map_err(DaemonError::RegisterCompletions)?;
            }
        }
        // A job that moves the guest to another kind of disk gives the queues new engines.
        let weak: Vec<_> = handlers.iter().map(Arc::downgrade).collect();
        let id = completion_event_id(cfg.num_queues);
        backend.set_engine_maker(
            choice,
            Box::new(move |i, fd| match weak.get(i).and_then(|h| h.upgrade()) {
                Some(h) => h.register_listener(fd, EventSet::IN | EventSet::EDGE_TRIGGERED, id),
                None => Err(std::io::Error::from_raw_os_error(libc::ENODEV)),
            }),
        );
        for (i, fd) in backend.timer_fds().into_iter().enumerate() {
            if let (Some(fd), Some(h)) = (fd, handlers.get(i)) {
                h.register_listener(fd, EventSet::IN, completion_event_id(cfg.num_queues) + 1)
                    .map_err(DaemonError::RegisterCompletions)?;
            }
        }
        if let Err(e) = daemon.start(listener) {
            error!("accepting a connection failed: {e}");
            continue;
        }
        {
            let mut p = phase.locked();
            if p.stop {
                daemon.request_shutdown();
            } else {
                p.connection = daemon.shutdown_handle().map(|h| (h, backend.clone()));
            }
        }
        info!("frontend connected");
        crate::service::status(&format!(
            "frontend connected; serving {}",
            cfg.blk_file.display()
        ));
        dev.frontend_connected
            .store(true, std::sync::atomic::Ordering::Relaxed);
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
        dev.frontend_connected
            .store(false, std::sync::atomic::Ordering::Relaxed);
        dev.frontend_channel.locked().0 = None;
        backend.drain_all();
        dev.set_queue_pause(None);
        backend.log_stats();
        let stop = {
            let mut p = phase.locked();
            p.connection = None;
            p.stop
        };
        if stop {
            return Ok(());
        }
        crate::service::status(&format!(
            "waiting for a frontend; serving {}",
            cfg.blk_file.display()
        ));
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
