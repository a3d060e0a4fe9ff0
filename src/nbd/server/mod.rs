//! vublk's NBD server: one read-only export (a backup's point-in-time view), on a UNIX socket
//! or a TCP address, for stock clients (qemu-img, nbdcopy, nbdinfo, libnbd).
//!
//! Clients are untrusted. Each has its own thread; at most [`MAX_CLIENTS`] at once (the next
//! one is closed at once). The handshake must end within [`HANDSHAKE_TIMEOUT`], a client that
//! sends no request for [`IDLE_TIMEOUT`] or does not take a reply for [`WRITE_TIMEOUT`] is
//! closed, and a client's memory is bounded: option data up to [`MAX_OPTION`], replies
//! streamed in pieces of at most [`CHUNK`]. The disk's own I/O never waits for a client: the
//! export reads the disk through a reader of its own (see `backup`).
//!
//! Rooms: `handshake` (the fixed newstyle negotiation: EXPORT_NAME, ABORT, LIST, INFO, GO,
//! STRUCTURED_REPLY, LIST_META_CONTEXT, SET_META_CONTEXT), `conn` (the transmission phase:
//! READ, BLOCK_STATUS, DISC, errors for everything else).

mod conn;
#[cfg(any(test, feature = "testing"))]
pub mod fuzz;
mod handshake;

use std::io;
use std::net::{SocketAddr, TcpListener};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use log::warn;

use super::handshake::Stream;
use crate::locks::Locked;

/// Most clients connected to one export at once.
pub const MAX_CLIENTS: usize = 16;
/// The handshake's time limit.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// A client that sends no request for this long is closed.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(300);
/// A client that takes no reply bytes for this long is closed.
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(30);
/// Longest option data read.
pub const MAX_OPTION: u32 = 64 << 10;
/// Longest READ and the block-size maximum advertised.
pub const MAX_REQUEST: u32 = 32 << 20;
/// Replies are read from the disk and sent in pieces of at most this many bytes (larger
/// pieces hold the disk's queue longer against the guest's requests).
pub const CHUNK: usize = 1 << 20;

/// An error an export answers a client with (an NBD error code and why, for the log and
/// the structured reply's message).
#[derive(Debug, Clone)]
pub struct ExportError {
    pub code: u32,
    pub message: String,
}

impl ExportError {
    pub fn io(message: impl Into<String>) -> Self {
        ExportError {
            code: super::wire::EIO,
            message: message.into(),
        }
    }
}

/// What an NBD server serves.
pub trait Export: Send + Sync {
    /// Its name (clients ask for it; the empty name means this one too).
    fn name(&self) -> &str;
    /// Its size in bytes.
    fn size(&self) -> u64;
    /// Fill `dst` with [offset, offset + dst.len()), which is inside the export.
    fn read(&self, offset: u64, dst: &mut [u8]) -> Result<(), ExportError>;
    /// The meta contexts it has (`base:allocation`, `qemu:dirty-bitmap:NAME`).
    fn meta_contexts(&self) -> Vec<String>;
    /// Context `context`'s extents (length, flags) from `offset` on, covering at least one
    /// byte and at most `len`.
    fn block_status(
        &self,
        context: &str,
        offset: u64,
        len: u32,
    ) -> Result<Vec<(u32, u32)>, ExportError>;
}

/// Where a server listens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Listen {
    Unix(PathBuf),
    Tcp(SocketAddr),
}

impl Listen {
    /// The NBD URI of export `name` here.
    pub fn uri(&self, name: &str) -> String {
        match self {
            Listen::Unix(p) => format!("nbd+unix:///{name}?socket={}", p.display()),
            Listen::Tcp(a) if a.is_ipv6() => format!("nbd://[{}]:{}/{name}", a.ip(), a.port()),
            Listen::Tcp(a) => format!("nbd://{}:{}/{name}", a.ip(), a.port()),
        }
    }
}

/// One connected client, as `backup-list` shows it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ClientInfo {
    pub id: u64,
    pub peer: String,
    pub bytes_read: u64,
    pub requests: u64,
}

/// A client's counters, shared with its thread.
#[derive(Debug, Default)]
struct ClientStats {
    bytes_read: AtomicU64,
    requests: AtomicU64,
}

struct Client {
    id: u64,
    peer: String,
    stream: Stream,
    stats: Arc<ClientStats>,
}

/// What the accept thread and the client threads share.
struct Shared {
    export: Arc<dyn Export>,
    stop: AtomicBool,
    clients: Mutex<Vec<Client>>,
    next_id: AtomicU64,
    /// Bytes read by every client so far, those gone included.
    bytes_read: AtomicU64,
    /// Clients turned away (too many at once).
    refused: AtomicU64,
}

/// A running server. Dropping it stops it: no new clients, the connected ones closed.
pub struct Server {
    shared: Arc<Shared>,
    listen: Listen,
    accept: Option<std::thread::JoinHandle<()>>,
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server")
            .field("listen", &self.listen)
            .finish()
    }
}

enum Listener {
    Unix(UnixListener),
    Tcp(TcpListener),
}

impl Server {
    /// Listen on `listen` and serve `export` until dropped. A UNIX socket path must not
    /// exist yet (nothing is removed); a TCP address must be a loopback one only if the
    /// caller wants that (the control method checks).
    pub fn start(listen: Listen, export: Arc<dyn Export>) -> io::Result<Server> {
        let (listener, listen) = match &listen {
            Listen::Unix(p) => {
                let l = UnixListener::bind(p)?;
                use std::os::unix::fs::PermissionsExt;
                std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o600))?;
                (Listener::Unix(l), listen)
            }
            Listen::Tcp(a) => {
                let l = TcpListener::bind(a)?;
                // Port 0: the port the kernel chose.
                let a = l.local_addr()?;
                (Listener::Tcp(l), Listen::Tcp(a))
            }
        };
        let shared = Arc::new(Shared {
            export,
            stop: AtomicBool::new(false),
            clients: Mutex::new(Vec::new()),
            next_id: AtomicU64::new(1),
            bytes_read: AtomicU64::new(0),
            refused: AtomicU64::new(0),
        });
        let s = shared.clone();
        let accept = std::thread::Builder::new()
            .name("vublk-nbd-accept".into())
            .spawn(move || accept_loop(&listener, &s))?;
        Ok(Server {
            shared,
            listen,
            accept: Some(accept),
        })
    }

    /// Where it listens (a TCP port 0 replaced by the port chosen).
    pub fn listen(&self) -> &Listen {
        &self.listen
    }

    /// The clients connected now.
    pub fn clients(&self) -> Vec<ClientInfo> {
        self.shared
            .clients
            .locked()
            .iter()
            .map(|c| ClientInfo {
                id: c.id,
                peer: c.peer.clone(),
                bytes_read: c.stats.bytes_read.load(Ordering::Relaxed),
                requests: c.stats.requests.load(Ordering::Relaxed),
            })
            .collect()
    }

    /// Bytes read by all clients so far.
    pub fn bytes_read(&self) -> u64 {
        self.shared.bytes_read.load(Ordering::Relaxed)
    }

    /// Clients turned away so far because [`MAX_CLIENTS`] were connected.
    pub fn refused(&self) -> u64 {
        self.shared.refused.load(Ordering::Relaxed)
    }

    /// Stop: no new clients; the connected ones are closed.
    pub fn stop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        for c in self.shared.clients.locked().iter() {
            c.stream.shutdown();
        }
        if let Some(t) = self.accept.take() {
            let _ = t.join();
        }
        if let Listen::Unix(p) = &self.listen {
            let _ = std::fs::remove_file(p);
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Accept until stopped (the listener is polled, so that a stop is seen within 100 ms).
fn accept_loop(listener: &Listener, shared: &Arc<Shared>) {
    let fd = match listener {
        Listener::Unix(l) => l.as_raw_fd(),
        Listener::Tcp(l) => l.as_raw_fd(),
    };
    while !shared.stop.load(Ordering::Acquire) {
        let mut pfd = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one pollfd, ours.
        let n = unsafe { libc::poll(&mut pfd, 1, 100) };
        if n <= 0 {
            continue;
        }
        let accepted = match listener {
            Listener::Unix(l) => l
                .accept()
                .map(|(s, _)| (Stream::Unix(s), "unix".to_string())),
            Listener::Tcp(l) => l.accept().map(|(s, a)| {
                let _ = s.set_nodelay(true);
                (Stream::Tcp(s), a.to_string())
            }),
        };
        let (stream, peer) = match accepted {
            Ok(x) => x,
            Err(e) => {
                warn!("NBD export {}: accept failed: {e}", shared.export.name());
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
        };
        admit(shared, stream, peer);
    }
}

/// Give a new client its place and thread, or close it when all places are taken.
fn admit(shared: &Arc<Shared>, stream: Stream, peer: String) {
    let mut clients = shared.clients.locked();
    if clients.len() >= MAX_CLIENTS {
        drop(clients);
        let n = shared.refused.fetch_add(1, Ordering::Relaxed);
        if n < 10 || n.is_power_of_two() {
            warn!(
                "NBD export {}: {MAX_CLIENTS} clients connected; closing a new one ({} so far)",
                shared.export.name(),
                n + 1
            );
        }
        return;
    }
    let Ok(watch) = stream.try_clone() else {
        return;
    };
    let id = shared.next_id.fetch_add(1, Ordering::Relaxed);
    let stats = Arc::new(ClientStats::default());
    clients.push(Client {
        id,
        peer: peer.clone(),
        stream: watch,
        stats: stats.clone(),
    });
    drop(clients);
    let s = shared.clone();
    let spawned = std::thread::Builder::new()
        .name("vublk-nbd-client".into())
        .spawn(move || {
            serve_client(&s, stream, &stats, &peer);
            s.clients.locked().retain(|c| c.id != id);
        });
    if spawned.is_err() {
        shared.clients.locked().retain(|c| c.id != id);
    }
}

fn serve_client(shared: &Shared, mut stream: Stream, stats: &ClientStats, peer: &str) {
    let name = shared.export.name().to_owned();
    let _ = stream.set_read_timeout(Some(HANDSHAKE_TIMEOUT));
    let _ = stream.set_write_timeout(Some(WRITE_TIMEOUT));
    let session = match handshake::negotiate(&mut stream, &*shared.export) {
        Ok(Some(s)) => s,
        Ok(None) => return,
        Err(e) => {
            log_client(&name, peer, "handshake", &e);
            return;
        }
    };
    let _ = stream.set_read_timeout(Some(IDLE_TIMEOUT));
    if shared.stop.load(Ordering::Acquire) {
        return;
    }
    crate::log_limited!(
        log::Level::Info,
        "NBD export {name}: client {peer} connected"
    );
    let r = conn::transmission(
        &mut stream,
        &*shared.export,
        &session,
        stats,
        &shared.bytes_read,
    );
    match r {
        Ok(()) => crate::log_limited!(
            log::Level::Info,
            "NBD export {name}: client {peer} disconnected"
        ),
        Err(e) => log_client(&name, peer, "session", &e),
    }
}

/// A client's failure, logged within a budget (a hostile client must not flood the log).
fn log_client(export: &str, peer: &str, phase: &str, e: &io::Error) {
    crate::log_limited!(
        log::Level::Info,
        "NBD export {export}: client {peer}: {phase} ended: {e}"
    );
}

#[cfg(test)]
mod tests;
