//! The control socket (`--control-socket PATH`): JSON-RPC 2.0 over a UNIX stream socket, one
//! JSON object per line each way, several clients at once, each on its own thread. And its
//! client, `vublk ctl`.
//!
//! Requests are untrusted: a line longer than [`MAX_LINE`] gets an error and the connection
//! is closed, malformed JSON or a bad request gets a JSON-RPC error object. Nothing a client
//! sends reaches the data path except through the methods (a limit change, a flush).
//!
//! Nor can clients lock the operator out: a client that sends no complete request line for
//! the idle timeout (`--control-idle-timeout`; half a line counts as idle) is closed, as is
//! one that does not read its answers for as long; and when [`MAX_CLIENTS`] are connected, a
//! new client takes the place of the one idle the longest, which is closed with an error line
//! saying why. Every close of that kind sends a JSON-RPC error ([`CLOSING`]) first.
//!
//! Methods: `version`, `status`, `stats`, `flush`, `set-throttle` (params: the limits to set,
//! the others unchanged; 0 = unlimited), `get-throttle`, `resume` and `stop-holding` (the
//! error policy's held requests: `hold`), and those of `jobs` and the other modules.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::Shutdown;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use log::info;
use serde_json::{json, Value};

mod client;
mod hold;
mod jobs;

pub use client::{client, request_of};

use crate::device::Device;
use crate::locks::Locked;
use crate::stats::QueueSnapshot;
use crate::throttle::Limits;
use jobs::image_busy;

/// Longest request line accepted (bytes, newline excluded).
pub const MAX_LINE: usize = 64 * 1024;
/// Most clients connected at once; when all places are taken, the client idle the longest
/// is closed to make room for a new one.
pub const MAX_CLIENTS: usize = 64;
/// The pause after a failed accept (out of file descriptors or memory), so the loop does not
/// spin while the connection waits in the backlog.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// JSON-RPC 2.0 error codes.
const PARSE_ERROR: i64 = -32700;
const INVALID_REQUEST: i64 = -32600;
const METHOD_NOT_FOUND: i64 = -32601;
const INVALID_PARAMS: i64 = -32602;
const INTERNAL_ERROR: i64 = -32603;
/// A server error (the implementation-defined range): the server closes the connection (idle
/// too long, or closed to make room for a new client).
pub const CLOSING: i64 = -32000;
/// A server error: the daemon refuses the operation as asked (a bitmap that exists or does
/// not, a name or granularity out of range); the message says why.
pub const REFUSED: i64 = -32001;

/// What the methods see.
pub struct Context {
    pub dev: Arc<Device>,
    /// `--blk-file`.
    pub image_path: PathBuf,
    /// The chain's state file (`snapshot::state`; None: nowhere to keep it).
    pub chain_state: Option<PathBuf>,
    pub started: Instant,
}

/// Why the control socket cannot be set up.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error("control socket {}: {source}", .path.display())]
    Bind {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("control socket {}: something else is listening there", .0.display())]
    Busy(PathBuf),
    #[error("control socket {}: not a socket", .0.display())]
    NotASocket(PathBuf),
    #[error("--control-group {0}: no such group")]
    NoGroup(String),
}

/// Listen on `path` (mode 0600, or 0660 owned by `group`) and serve clients on background
/// threads for the life of the process; a client idle for `idle_timeout` is closed.
pub fn serve(
    path: &Path,
    group: Option<&str>,
    idle_timeout: Duration,
    ctx: Context,
) -> Result<(), ControlError> {
    use std::os::unix::fs::FileTypeExt;
    if let Ok(m) = std::fs::symlink_metadata(path) {
        if !m.file_type().is_socket() {
            return Err(ControlError::NotASocket(path.to_owned()));
        }
        if UnixStream::connect(path).is_ok() {
            return Err(ControlError::Busy(path.to_owned()));
        }
        let _ = std::fs::remove_file(path);
    }
    let gid = match group {
        Some(g) => Some(group_id(g).ok_or_else(|| ControlError::NoGroup(g.to_owned()))?),
        None => None,
    };
    let bind_err = |source| ControlError::Bind {
        path: path.to_owned(),
        source,
    };
    let listener = UnixListener::bind(path).map_err(bind_err)?;
    let mode = if gid.is_some() { 0o660 } else { 0o600 };
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).map_err(bind_err)?;
    if let Some(gid) = gid {
        std::os::unix::fs::chown(path, None, Some(gid)).map_err(bind_err)?;
    }
    info!("control socket on {} (mode {mode:o})", path.display());
    let ctx = Arc::new(ctx);
    std::thread::Builder::new()
        .name("vublk-control".into())
        .spawn(move || accept_loop(&listener, idle_timeout, &ctx))
        .map_err(bind_err)?;
    Ok(())
}

fn accept_loop(listener: &UnixListener, idle_timeout: Duration, ctx: &Arc<Context>) {
    let clients = Arc::new(Clients::default());
    loop {
        let conn = match listener.accept() {
            Ok((conn, _)) => conn,
            Err(e) => {
                crate::log_limited!(
                    log::Level::Warn,
                    "control socket: accepting a client: {e}; trying again in {} ms",
                    ACCEPT_BACKOFF.as_millis()
                );
                std::thread::sleep(ACCEPT_BACKOFF);
                continue;
            }
        };
        let place = match clients.admit(&conn) {
            Ok(place) => place,
            Err(why) => {
                crate::log_limited!(log::Level::Warn, "control socket: a client refused: {why}");
                close_with(&conn, &why);
                continue;
            }
        };
        let ctx = ctx.clone();
        let spawned = std::thread::Builder::new()
            .name("vublk-ctl-client".into())
            .spawn(move || serve_client(conn, &ctx, &place, idle_timeout));
        // A failed spawn drops the closure: the connection is closed and its place freed.
        if let Err(e) = spawned {
            crate::log_limited!(
                log::Level::Warn,
                "control socket: cannot start a client thread: {e}"
            );
        }
    }
}

/// The clients connected now.
#[derive(Default)]
struct Clients {
    table: Mutex<Table>,
}

#[derive(Default)]
struct Table {
    next_id: u64,
    clients: Vec<Connected>,
}

struct Connected {
    id: u64,
    /// A second handle on its socket, to close it from the accept thread.
    conn: UnixStream,
    /// Since when it has sent no request; None while one of its requests is being served.
    idle_since: Option<Instant>,
    /// Closed to make room: its thread is on its way out and its place is free.
    evicted: bool,
}

/// A client's place among the [`MAX_CLIENTS`]; dropped when its thread ends (or could not be
/// started), which gives the place back.
struct Place {
    clients: Arc<Clients>,
    id: u64,
}

impl Clients {
    fn lock(&self) -> std::sync::MutexGuard<'_, Table> {
        self.table.locked()
    }

    /// A place for `conn`: a free one, or the place of the client idle the longest, which is
    /// closed with an error line saying why. Refused (with the reason) when every client is
    /// in the middle of a request, or too many closed ones have not finished leaving.
    fn admit(self: &Arc<Self>, conn: &UnixStream) -> Result<Place, String> {
        let handle = conn
            .try_clone()
            .map_err(|e| format!("no descriptor for another client ({e})"))?;
        let mut t = self.lock();
        let live = t.clients.iter().filter(|c| !c.evicted).count();
        if live >= MAX_CLIENTS {
            // Closed clients leave at once unless a request of theirs is running; this bounds
            // the threads should they not.
            if t.clients.len() >= 2 * MAX_CLIENTS {
                return Err(format!(
                    "more than {MAX_CLIENTS} clients, and the closed ones have not gone yet"
                ));
            }
            let Some(oldest) = t
                .clients
                .iter_mut()
                .filter(|c| !c.evicted && c.idle_since.is_some())
                .min_by_key(|c| c.idle_since)
            else {
                return Err(format!(
                    "{MAX_CLIENTS} clients connected, each in the middle of a request"
                ));
            };
            oldest.evicted = true;
            let idle = oldest.idle_since.map_or(0, |t| t.elapsed().as_secs());
            close_with(
                &oldest.conn,
                &format!(
                    "closed to make room for a new client: {MAX_CLIENTS} clients were \
                     connected, and this one was idle the longest ({idle} s)"
                ),
            );
            crate::log_limited!(
                log::Level::Info,
                "control socket: {MAX_CLIENTS} clients connected; closed the one idle the \
                 longest ({idle} s) to make room for a new one"
            );
        }
        t.next_id += 1;
        let id = t.next_id;
        t.clients.push(Connected {
            id,
            conn: handle,
            idle_since: Some(Instant::now()),
            evicted: false,
        });
        Ok(Place {
            clients: self.clone(),
            id,
        })
    }
}

impl Place {
    /// A request arrived: not idle (nor to be closed to make room) until [`Place::idle`].
    /// False if the client was closed to make room meanwhile: leave the request alone.
    fn busy(&self) -> bool {
        let mut t = self.clients.lock();
        match t.clients.iter_mut().find(|c| c.id == self.id) {
            Some(c) if !c.evicted => {
                c.idle_since = None;
                true
            }
            _ => false,
        }
    }

    /// The request is answered: idle from now.
    fn idle(&self) {
        let mut t = self.clients.lock();
        if let Some(c) = t.clients.iter_mut().find(|c| c.id == self.id) {
            c.idle_since = Some(Instant::now());
        }
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        self.clients.lock().clients.retain(|c| c.id != self.id);
    }
}

/// Close a client from another thread: its reads end (end of file), one error line saying
/// `why` is sent if it fits at once (never blocking the caller), then both directions shut.
fn close_with(conn: &UnixStream, why: &str) {
    let _ = conn.shutdown(Shutdown::Read);
    let mut line = error(Value::Null, CLOSING, why).to_string();
    line.push('\n');
    if conn.set_nonblocking(true).is_ok() {
        let _ = (&*conn).write(line.as_bytes());
    }
    let _ = conn.shutdown(Shutdown::Both);
}

fn group_id(name: &str) -> Option<u32> {
    if let Ok(n) = name.parse() {
        return Some(n);
    }
    let c = std::ffi::CString::new(name).ok()?;
    // SAFETY: getgrnam with a valid C string; the result is read at once (this thread only
    // calls it at start-up, before other threads could call getgr* functions).
    let g = unsafe { libc::getgrnam(c.as_ptr()) };
    // SAFETY: a non-null result points to a valid struct group.
    (!g.is_null()).then(|| unsafe { (*g).gr_gid })
}

/// One client: a request per line, an answer per line, until it closes, sends a line too
/// long, a write fails, it is closed to make room, or it sends no complete line (or does not
/// take its answer) for `idle_timeout`.
fn serve_client(conn: UnixStream, ctx: &Context, place: &Place, idle_timeout: Duration) {
    // A client that does not read its answers is idle too.
    if conn.set_write_timeout(Some(idle_timeout)).is_err() {
        return;
    }
    let mut reader = BufReader::new(&conn);
    let mut line = Vec::new();
    let mut deadline = Instant::now() + idle_timeout;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            let secs = idle_timeout.as_secs();
            let why = format!(
                "idle for {secs} s: closed (a client that sends no request for \
                 {secs} s is closed; connect again)"
            );
            let _ = reply(&conn, error(Value::Null, CLOSING, &why));
            return;
        }
        if conn.set_read_timeout(Some(left)).is_err() {
            return;
        }
        // Half a line read before a timeout stays in `line`; the rest follows.
        let room = (MAX_LINE + 1 - line.len()) as u64;
        match (&mut reader).take(room).read_until(b'\n', &mut line) {
            Ok(0) => return,
            Ok(_) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::Interrupted
                        | io::ErrorKind::WouldBlock
                        | io::ErrorKind::TimedOut
                ) =>
            {
                continue
            }
            Err(_) => return,
        }
        if line.last() != Some(&b'\n') {
            if line.len() > MAX_LINE {
                let _ = reply(
                    &conn,
                    error(Value::Null, INVALID_REQUEST, "request too large"),
                );
                return;
            }
            continue;
        }
        let text = String::from_utf8_lossy(&line).trim().to_owned();
        line.clear();
        if text.is_empty() {
            continue;
        }
        if !place.busy() {
            return;
        }
        let answer = handle(&text, ctx);
        place.idle();
        if reply(&conn, answer).is_err() {
            return;
        }
        deadline = Instant::now() + idle_timeout;
    }
}

fn reply(mut out: impl Write, v: Value) -> io::Result<()> {
    let mut s = v.to_string();
    s.push('\n');
    out.write_all(s.as_bytes())
}

fn error(id: Value, code: i64, message: &str) -> Value {
    json!({"jsonrpc": "2.0", "error": {"code": code, "message": message}, "id": id})
}

/// Answer one request line.
pub fn handle(text: &str, ctx: &Context) -> Value {
    let req: Value = match serde_json::from_str(text) {
        Ok(v) => v,
        Err(e) => return error(Value::Null, PARSE_ERROR, &format!("parse error: {e}")),
    };
    let id = req.get("id").cloned().unwrap_or(Value::Null);
    let Some(method) = req.get("method").and_then(Value::as_str) else {
        return error(id, INVALID_REQUEST, "no method");
    };
    if req.get("jsonrpc").and_then(Value::as_str) != Some("2.0") {
        return error(id, INVALID_REQUEST, "not a JSON-RPC 2.0 request");
    }
    let params = req.get("params").cloned().unwrap_or(Value::Null);
    match call(method, params, ctx) {
        Ok(result) => json!({"jsonrpc": "2.0", "result": result, "id": id}),
        Err((code, msg)) => error(id, code, &msg),
    }
}

type CallResult = Result<Value, (i64, String)>;

fn no_params(p: &Value) -> Result<(), (i64, String)> {
    match p {
        Value::Null => Ok(()),
        Value::Object(m) if m.is_empty() => Ok(()),
        Value::Array(a) if a.is_empty() => Ok(()),
        _ => Err((INVALID_PARAMS, "this method takes no parameters".into())),
    }
}

fn call(method: &str, params: Value, ctx: &Context) -> CallResult {
    let dev = &ctx.dev;
    match method {
        "version" => {
            no_params(&params)?;
            Ok(json!({"version": env!("CARGO_PKG_VERSION"), "name": "vublk"}))
        }
        "status" => {
            no_params(&params)?;
            let image = dev.image.get();
            let served = dev
                .image
                .options()
                .map_or_else(|| ctx.image_path.clone(), |o| o.path);
            let chain: Vec<String> = crate::snapshot::chain_paths(&served, &image)
                .iter()
                .map(|p| p.display().to_string())
                .collect();
            Ok(json!({
                "image": ctx.image_path.display().to_string(),
                "serving": served.display().to_string(),
                "chain": chain,
                "format": format!("{:?}", image.format()).to_lowercase(),
                "size_bytes": dev.size_bytes(),
                "read_only": dev.params.read_only,
                "cache": format!("{:?}", dev.params.cache).to_lowercase(),
                "active": image.is_active(),
                "frontend_connected": dev.frontend_connected.load(Ordering::Relaxed),
                "queues": dev.params.num_queues,
                "queue_size": dev.params.queue_size,
                "uptime_seconds": ctx.started.elapsed().as_secs_f64(),
                "error_policy": hold::status(dev),
            }))
        }
        "stats" => {
            // `{"histograms": true}`: also each latency histogram's buckets (`vublk ctl top`
            // takes quantiles over an interval from two of them).
            let histograms = match &params {
                Value::Null => false,
                Value::Object(m) if m.keys().all(|k| k == "histograms") => {
                    match m.get("histograms") {
                        None => false,
                        Some(Value::Bool(b)) => *b,
                        Some(Value::Number(n)) => n.as_u64() == Some(1),
                        Some(_) => {
                            return Err((INVALID_PARAMS, "histograms: true or false".into()))
                        }
                    }
                }
                _ => return Err((INVALID_PARAMS, "stats takes only \"histograms\"".into())),
            };
            Ok(stats(dev, histograms))
        }
        "flush" => {
            no_params(&params)?;
            let t0 = Instant::now();
            dev.sync()
                .map_err(|e| (INTERNAL_ERROR, crate::logging::error_chain(&e)))?;
            Ok(json!({"durable": true, "seconds": t0.elapsed().as_secs_f64()}))
        }
        "resize" => {
            let size = match &params {
                Value::Object(m) => match m.get("size") {
                    None => None,
                    Some(Value::Number(n)) => {
                        Some(n.as_u64().ok_or_else(|| {
                            (INVALID_PARAMS, "size: a number of bytes".to_string())
                        })?)
                    }
                    Some(Value::String(s)) => {
                        Some(crate::args::parse_size(s).ok_or_else(|| {
                            (
                                INVALID_PARAMS,
                                format!("size {s:?}: bytes, or with K, M, G or T"),
                            )
                        })?)
                    }
                    Some(_) => return Err((INVALID_PARAMS, "size: a number or a string".into())),
                },
                Value::Null => None,
                _ => return Err((INVALID_PARAMS, "resize takes {\"size\": SIZE}".into())),
            };
            if dev.jobs.any() {
                return Err((
                    REFUSED,
                    "a block job is running: resize after it (or job-cancel it)".into(),
                ));
            }
            let r = dev.resize(size).map_err(|e| (INTERNAL_ERROR, e))?;
            Ok(serde_json::to_value(r).unwrap_or(Value::Null))
        }
        "get-throttle" => {
            no_params(&params)?;
            Ok(serde_json::to_value(dev.throttle.limits()).unwrap_or(Value::Null))
        }
        "set-throttle" => {
            let mut l = dev.throttle.limits();
            let Value::Object(m) = params else {
                return Err((
                    INVALID_PARAMS,
                    "set-throttle takes an object of limits, e.g. {\"iops\": 400}".into(),
                ));
            };
            for (k, v) in m {
                let n = v.as_u64().ok_or_else(|| {
                    (
                        INVALID_PARAMS,
                        format!("{k}: a limit is a non-negative integer (0: unlimited)"),
                    )
                })?;
                let slot = match k.replace('-', "_").as_str() {
                    "iops" => &mut l.iops,
                    "bps" => &mut l.bps,
                    "read_iops" => &mut l.read_iops,
                    "write_iops" => &mut l.write_iops,
                    "read_bps" => &mut l.read_bps,
                    "write_bps" => &mut l.write_bps,
                    _ => return Err((INVALID_PARAMS, format!("unknown limit {k}"))),
                };
                *slot = n;
            }
            dev.throttle.set(l);
            info!("I/O limits set: {l:?} (0: unlimited)");
            Ok(serde_json::to_value::<Limits>(l).unwrap_or(Value::Null))
        }
        m if m.starts_with("bitmap-") => {
            use crate::bitmaps::control::CallError;
            crate::bitmaps::control::call(m, &params, &dev.bitmaps, &|l| dev.save_bitmaps(l))
                .map_err(|e| match e {
                    CallError::Params(m) => (INVALID_PARAMS, m),
                    CallError::Refused(e) => (REFUSED, e.to_string()),
                    CallError::Unknown(m) => (METHOD_NOT_FOUND, format!("unknown method {m:?}")),
                })
        }
        "resume" | "stop-holding" => hold::call(method, &params, ctx),
        "stream" | "commit" | "mirror" | "jobs" | "job-cancel" | "job-complete" => {
            jobs::call(method, &params, ctx)
        }
        "snapshot" => {
            use crate::snapshot::CallError;
            let paused = |f: &mut dyn FnMut()| dev.with_queues_paused(f);
            let busy = image_busy(dev).or_else(|| {
                dev.jobs
                    .any()
                    .then(|| "a block job is running: wait for it, or job-cancel it".to_owned())
            });
            let disk = crate::snapshot::Disk {
                slot: &dev.image,
                size: dev.size_bytes(),
                read_only: dev.params.read_only,
                busy,
                base: &ctx.image_path,
                state: ctx.chain_state.as_deref(),
                paused: &paused,
                bitmaps: &dev.bitmaps,
            };
            crate::snapshot::call(&params, &disk).map_err(|e| match e {
                CallError::Params(m) => (INVALID_PARAMS, m),
                CallError::Refused(m) => (REFUSED, m),
            })
        }
        m if m.starts_with("backup-") => {
            use crate::backup::control::CallError;
            let save = |l: &[crate::bitmaps::Persistent]| dev.save_bitmaps(l);
            let paused = |f: &mut dyn FnMut()| dev.with_queues_paused(f);
            let disk = crate::backup::control::Disk {
                backups: &dev.backups,
                bitmaps: &dev.bitmaps,
                image: dev.image.get(),
                size: dev.size_bytes(),
                image_path: &ctx.image_path,
                paused: &paused,
                save: &save,
            };
            crate::backup::control::call(m, &params, &disk).map_err(|e| match e {
                CallError::Params(m) => (INVALID_PARAMS, m),
                CallError::Refused(e) => (REFUSED, e),
                CallError::Unknown(m) => (METHOD_NOT_FOUND, format!("unknown method {m:?}")),
            })
        }
        _ => Err((METHOD_NOT_FOUND, format!("unknown method {method:?}"))),
    }
}

/// The `stats` answer: totals, per queue, and the features' own counters; `histograms`:
/// also each request type's latency buckets (`latency_buckets`, bucket `i`: under 2^i us),
/// from the same reading of the counters.
pub fn stats(dev: &Device, histograms: bool) -> Value {
    let queues: Vec<QueueSnapshot> = dev.queue_stats.iter().map(|q| q.snapshot()).collect();
    let total = QueueSnapshot::total(&queues);
    let z = &dev.zero_stats;
    let ld = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
    let report = |q: &QueueSnapshot| {
        let mut v = serde_json::to_value(q.report()).unwrap_or(Value::Null);
        if histograms {
            for (name, o) in crate::stats::OPS.iter().zip(&q.ops) {
                v["requests"][*name]["latency_buckets"] = json!(o.latency_buckets);
            }
        }
        v
    };
    json!({
        "total": report(&total),
        "queues": queues.iter().map(report).collect::<Vec<_>>(),
        "features": {
            "zero_writes_detected": ld(&z.zero_writes),
            "zero_write_bytes": ld(&z.zero_write_bytes),
            "unmapped_bytes": ld(&z.unmapped_bytes),
            "image": dev.image.get().counters(),
        },
        "backups": dev.backups.list(),
        "jobs": dev.jobs.list(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `n` connected pairs: the server's ends admitted, the clients' ends returned with their
    /// places.
    fn admit_n(clients: &Arc<Clients>, n: usize) -> Vec<(Place, UnixStream)> {
        (0..n)
            .map(|_| {
                let (server, client) = UnixStream::pair().unwrap();
                (clients.admit(&server).unwrap(), client)
            })
            .collect()
    }

    /// What a client end reads before end of file, or None while it is still open (closing
    /// is synchronous: a closed client's line and end of file are there at once).
    fn read_all(c: &UnixStream) -> Option<String> {
        c.set_nonblocking(true).unwrap();
        let mut s = String::new();
        match (&*c).read_to_string(&mut s) {
            Ok(_) => Some(s),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => None,
            Err(e) => panic!("{e}"),
        }
    }

    #[test]
    fn a_full_table_makes_room_by_closing_the_client_idle_the_longest() {
        let clients = Arc::new(Clients::default());
        let placed = admit_n(&clients, MAX_CLIENTS);
        // The first admitted is idle the longest, unless it has sent a request since.
        placed[0].0.busy();
        placed[0].0.idle();
        let (server, _client) = UnixStream::pair().unwrap();
        let _new = clients.admit(&server).unwrap();
        let line = read_all(&placed[1].1).expect("closed");
        let v: Value = serde_json::from_str(line.trim()).unwrap();
        assert_eq!(v["error"]["code"], CLOSING);
        assert!(v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("make room"));
        assert_eq!(read_all(&placed[0].1), None, "still connected");
        assert_eq!(read_all(&placed[2].1), None, "still connected");
        // The closed client's thread would now find it gone.
        assert!(!placed[1].0.busy());
    }

    #[test]
    fn clients_in_the_middle_of_a_request_are_not_closed_to_make_room() {
        let clients = Arc::new(Clients::default());
        let placed = admit_n(&clients, MAX_CLIENTS);
        for (p, _) in &placed {
            assert!(p.busy());
        }
        let (server, _client) = UnixStream::pair().unwrap();
        let why = clients.admit(&server).err().unwrap();
        assert!(why.contains("middle of a request"), "{why}");
        placed[5].0.idle();
        let _new = clients.admit(&server).unwrap();
        assert!(read_all(&placed[5].1).unwrap().contains("make room"));
    }

    #[test]
    fn a_place_given_up_without_a_thread_is_free_again() {
        // As when spawning the client's thread fails: the closure, and the place in it, drop.
        let clients = Arc::new(Clients::default());
        for _ in 0..3 {
            let placed = admit_n(&clients, MAX_CLIENTS);
            assert_eq!(clients.lock().clients.len(), MAX_CLIENTS);
            for (_, c) in &placed {
                assert_eq!(read_all(c), None, "closed to make room");
            }
        }
        assert!(clients.lock().clients.is_empty());
        let (server, _client) = UnixStream::pair().unwrap();
        let place = clients.admit(&server).unwrap();
        let spawned = std::thread::Builder::new()
            .stack_size(usize::MAX)
            .spawn(move || drop(place));
        assert!(spawned.is_err(), "a thread with an impossible stack");
        assert!(clients.lock().clients.is_empty());
    }

    #[test]
    fn ctl_methods_become_requests() {
        use crate::args::{Args, Command};
        use clap::Parser;
        let req = |words: &[&str]| {
            let a = Args::try_parse_from(
                ["vublk", "ctl", "--control-socket", "/s"]
                    .iter()
                    .chain(words),
            )
            .map_err(|e| e.to_string())?;
            let Some(Command::Ctl(c)) = a.command else {
                return Err("not ctl".into());
            };
            request_of(&c.method)
        };
        assert_eq!(
            req(&["set-throttle", "--iops", "400"]).unwrap(),
            ("set-throttle".into(), json!({"iops": 400}))
        );
        assert_eq!(
            req(&["resize", "10G"]).unwrap(),
            ("resize".into(), json!({"size": "10G"}))
        );
        assert_eq!(
            req(&["stats", "--histograms"]).unwrap(),
            ("stats".into(), json!({"histograms": true}))
        );
        // A method this client does not know goes as it is.
        assert_eq!(
            req(&["new-method", "--some-thing", "7", "--x", "y"]).unwrap(),
            ("new-method".into(), json!({"some_thing": 7, "x": "y"}))
        );
        assert!(req(&["new-method", "loose"]).is_err());
        assert!(req(&["set-throttle", "--bogus", "3"]).is_err());
        assert!(req(&["set-throttle", "--iops", "-3"]).is_err());
        assert!(req(&["stats", "extra"]).is_err());
    }
}
