//! The control socket (`--control-socket PATH`): JSON-RPC 2.0 over a UNIX stream socket, one
//! JSON object per line each way, several clients at once, each on its own thread. And its
//! client, `vublk ctl`.
//!
//! Requests are untrusted: a line longer than [`MAX_LINE`] gets an error and the connection
//! is closed, malformed JSON or a bad request gets a JSON-RPC error object, more than
//! [`MAX_CLIENTS`] connections at once are refused (closed at once). Nothing a client sends
//! reaches the data path except through the methods (a limit change, a flush).
//!
//! Methods: `version`, `status`, `stats`, `flush`, `set-throttle` (params: the limits to set,
//! the others unchanged; 0 = unlimited), `get-throttle`.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use log::{info, warn};
use serde_json::{json, Value};

use crate::device::Device;
use crate::stats::QueueSnapshot;
use crate::throttle::Limits;

/// Longest request line accepted (bytes, newline excluded).
pub const MAX_LINE: usize = 64 * 1024;
/// Most clients connected at once.
pub const MAX_CLIENTS: usize = 64;

/// JSON-RPC 2.0 error codes.
const PARSE_ERROR: i64 = -32700;
const INVALID_REQUEST: i64 = -32600;
const METHOD_NOT_FOUND: i64 = -32601;
const INVALID_PARAMS: i64 = -32602;
const INTERNAL_ERROR: i64 = -32603;

/// What the methods see.
pub struct Context {
    pub dev: Arc<Device>,
    pub image_path: PathBuf,
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
/// threads for the life of the process.
pub fn serve(path: &Path, group: Option<&str>, ctx: Context) -> Result<(), ControlError> {
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
    let clients = Arc::new(AtomicUsize::new(0));
    std::thread::Builder::new()
        .name("vublk-control".into())
        .spawn(move || {
            for conn in listener.incoming() {
                let Ok(conn) = conn else { continue };
                if clients.fetch_add(1, Ordering::AcqRel) >= MAX_CLIENTS {
                    clients.fetch_sub(1, Ordering::AcqRel);
                    crate::log_limited!(
                        log::Level::Warn,
                        "control socket: more than {MAX_CLIENTS} clients, one refused"
                    );
                    continue;
                }
                let (ctx, clients) = (ctx.clone(), clients.clone());
                let spawned = std::thread::Builder::new()
                    .name("vublk-ctl-client".into())
                    .spawn(move || {
                        serve_client(conn, &ctx);
                        clients.fetch_sub(1, Ordering::AcqRel);
                    });
                if spawned.is_err() {
                    warn!("control socket: cannot start a client thread");
                }
            }
        })
        .map_err(bind_err)?;
    Ok(())
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
/// long, or a write fails.
fn serve_client(conn: UnixStream, ctx: &Context) {
    let Ok(mut out) = conn.try_clone() else {
        return;
    };
    let mut reader = BufReader::new(conn);
    let mut line = Vec::new();
    loop {
        line.clear();
        let n = match (&mut reader)
            .take(MAX_LINE as u64 + 1)
            .read_until(b'\n', &mut line)
        {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if line.last() != Some(&b'\n') && n > MAX_LINE {
            let _ = reply(
                &mut out,
                error(Value::Null, INVALID_REQUEST, "request too large"),
            );
            return;
        }
        let text = String::from_utf8_lossy(&line);
        let text = text.trim();
        if text.is_empty() {
            continue;
        }
        if reply(&mut out, handle(text, ctx)).is_err() {
            return;
        }
    }
}

fn reply(out: &mut UnixStream, v: Value) -> io::Result<()> {
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
            Ok(json!({
                "image": ctx.image_path.display().to_string(),
                "format": format!("{:?}", image.format()).to_lowercase(),
                "size_bytes": dev.size_bytes(),
                "read_only": dev.params.read_only,
                "cache": format!("{:?}", dev.params.cache).to_lowercase(),
                "active": image.is_active(),
                "frontend_connected": dev.frontend_connected.load(Ordering::Relaxed),
                "queues": dev.params.num_queues,
                "queue_size": dev.params.queue_size,
                "uptime_seconds": ctx.started.elapsed().as_secs_f64(),
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
    })
}

/// `vublk ctl`: send one request, print the result (exit 0) or the error message (exit 1).
pub fn client(socket: &Path, method: &str, params: Value) -> Result<Value, String> {
    let mut s = UnixStream::connect(socket)
        .map_err(|e| format!("cannot connect to {}: {e}", socket.display()))?;
    s.set_read_timeout(Some(Duration::from_secs(300)))
        .map_err(|e| e.to_string())?;
    let req = json!({"jsonrpc": "2.0", "method": method, "params": params, "id": 1});
    reply(&mut s, req).map_err(|e| format!("sending the request: {e}"))?;
    let mut line = String::new();
    BufReader::new(s)
        .read_line(&mut line)
        .map_err(|e| format!("reading the answer: {e}"))?;
    let v: Value =
        serde_json::from_str(&line).map_err(|e| format!("not a JSON-RPC answer ({e})"))?;
    if let Some(e) = v.get("error") {
        return Err(e
            .get("message")
            .and_then(Value::as_str)
            .unwrap_or("error")
            .to_owned());
    }
    Ok(v.get("result").cloned().unwrap_or(Value::Null))
}

/// `vublk ctl` arguments after the method: `--name value` pairs become `{"name": value}`
/// (dashes as underscores; integers as numbers), a lone positional argument of `resize`
/// becomes `{"size": ...}`.
pub fn params_from_args(method: &str, args: &[String]) -> Result<Value, String> {
    let mut m = serde_json::Map::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        if let Some(name) = a.strip_prefix("--") {
            let v = it.next().ok_or_else(|| format!("{a}: needs a value"))?;
            let val = v
                .parse::<u64>()
                .map(Value::from)
                .unwrap_or_else(|_| Value::from(v.as_str()));
            m.insert(name.replace('-', "_"), val);
        } else if method == "resize" && !m.contains_key("size") {
            m.insert("size".into(), Value::from(a.as_str()));
        } else {
            return Err(format!("unexpected argument {a:?}"));
        }
    }
    Ok(Value::Object(m))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ctl_arguments_become_params() {
        assert_eq!(
            params_from_args("set-throttle", &["--iops".into(), "400".into()]).unwrap(),
            json!({"iops": 400})
        );
        assert_eq!(
            params_from_args("set-throttle", &["--read-bps".into(), "1M".into()]).unwrap(),
            json!({"read_bps": "1M"})
        );
        assert_eq!(
            params_from_args("resize", &["10G".into()]).unwrap(),
            json!({"size": "10G"})
        );
        assert!(params_from_args("stats", &["x".into()]).is_err());
        assert!(params_from_args("stats", &["--x".into()]).is_err());
    }
}
