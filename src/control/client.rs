//! The client side: `vublk ctl`'s methods as requests, and one request sent and answered.

use std::io::{BufRead, BufReader};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use serde_json::{json, Value};

use super::reply;

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

/// The request `vublk ctl METHOD ...` sends: the method's name and its parameters.
pub fn request_of(m: &crate::args::CtlMethod) -> Result<(String, Value), String> {
    use crate::args::CtlMethod as M;
    let name = |n: &str| n.to_owned();
    Ok(match m {
        M::Version => (name("version"), Value::Null),
        M::Status => (name("status"), Value::Null),
        M::Stats { histograms } => (
            name("stats"),
            if *histograms {
                json!({"histograms": true})
            } else {
                Value::Null
            },
        ),
        M::Flush => (name("flush"), Value::Null),
        M::Resume { report } => (
            name("resume"),
            if *report {
                json!({"report": true})
            } else {
                Value::Null
            },
        ),
        M::StopHolding => (name("stop-holding"), Value::Null),
        M::Resize { size } => (
            name("resize"),
            match size {
                Some(s) => json!({ "size": s }),
                None => Value::Null,
            },
        ),
        M::GetThrottle => (name("get-throttle"), Value::Null),
        M::SetThrottle(t) => {
            let mut p = serde_json::Map::new();
            for (k, v) in [
                ("iops", t.iops),
                ("bps", t.bps),
                ("read_iops", t.read_iops),
                ("write_iops", t.write_iops),
                ("read_bps", t.read_bps),
                ("write_bps", t.write_bps),
            ] {
                if let Some(v) = v {
                    p.insert(k.into(), v.into());
                }
            }
            (name("set-throttle"), Value::Object(p))
        }
        M::Top { .. } => return Err("top is not a request".into()),
        M::Bitmap(b) => bitmap_request(b)?,
        M::Backup(b) => backup_request(b)?,
        M::Snapshot {
            overlay,
            extended_l2,
        } => {
            // As the daemon sees it (its working directory is not ours).
            let abs = std::path::absolute(overlay)
                .map_or_else(|_| overlay.clone(), |a| a.display().to_string());
            let mut p = json!({ "overlay": abs });
            if *extended_l2 {
                p["extended_l2"] = json!(true);
            }
            ("snapshot".to_owned(), p)
        }
        M::Stream { base, job } => {
            let mut p = job_params(job)?;
            if let Some(b) = base {
                p.insert("base".into(), json!(b));
            }
            ("stream".to_owned(), Value::Object(p))
        }
        M::Commit {
            top,
            base,
            manual_complete,
            copy_mode,
            job,
        } => {
            let mut p = job_params(job)?;
            for (k, v) in [("top", top), ("base", base), ("copy_mode", copy_mode)] {
                if let Some(v) = v {
                    p.insert(k.into(), json!(v));
                }
            }
            if *manual_complete {
                p.insert("manual_complete".into(), json!(true));
            }
            ("commit".to_owned(), Value::Object(p))
        }
        M::Mirror {
            target,
            format,
            sync,
            bitmap,
            copy_mode,
            job,
        } => {
            let mut p = job_params(job)?;
            p.insert("target".into(), json!(target));
            for (k, v) in [
                ("format", format),
                ("sync", sync),
                ("bitmap", bitmap),
                ("copy_mode", copy_mode),
            ] {
                if let Some(v) = v {
                    p.insert(k.into(), json!(v));
                }
            }
            ("mirror".to_owned(), Value::Object(p))
        }
        M::Jobs => ("jobs".to_owned(), Value::Null),
        M::JobCancel { id } => ("job-cancel".to_owned(), json!({ "id": id })),
        M::JobComplete { id } => ("job-complete".to_owned(), json!({ "id": id })),
        M::Other(words) => {
            let (method, args) = words.split_first().ok_or_else(|| "no method".to_owned())?;
            (method.clone(), params_from_args(args)?)
        }
    })
}

/// The parameters every job takes (`--speed` with K, M, G becomes bytes per second).
fn job_params(j: &crate::args::JobArgs) -> Result<serde_json::Map<String, Value>, String> {
    let mut p = serde_json::Map::new();
    let speed = crate::args::parse_size(&j.speed)
        .ok_or_else(|| format!("--speed {:?}: bytes per second, or with K, M or G", j.speed))?;
    p.insert("speed".into(), json!(speed));
    if let Some(id) = &j.id {
        p.insert("id".into(), json!(id));
    }
    Ok(p)
}

/// A `bitmap-*` method's request (sizes given with K, M, G become bytes here).
fn bitmap_request(b: &crate::args::BitmapMethod) -> Result<(String, Value), String> {
    use crate::args::BitmapMethod as B;
    let one = |m: &str, name: &str| (m.to_owned(), json!({ "name": name }));
    Ok(match b {
        B::BitmapAdd {
            name,
            granularity,
            persistent,
            disabled,
        } => {
            let g = crate::args::parse_size(granularity).ok_or_else(|| {
                format!("--granularity {granularity:?}: bytes, or with K, M or G")
            })?;
            (
                "bitmap-add".to_owned(),
                json!({"name": name, "granularity": g, "persistent": persistent, "disabled": disabled}),
            )
        }
        B::BitmapRemove { name } => one("bitmap-remove", name),
        B::BitmapClear { name } => one("bitmap-clear", name),
        B::BitmapEnable { name } => one("bitmap-enable", name),
        B::BitmapDisable { name } => one("bitmap-disable", name),
        B::BitmapMerge { target, sources } => (
            "bitmap-merge".to_owned(),
            json!({"target": target, "sources": sources}),
        ),
        B::BitmapList => ("bitmap-list".to_owned(), Value::Null),
        B::BitmapRanges { name, offset, max } => (
            "bitmap-ranges".to_owned(),
            json!({"name": name, "offset": offset, "max": max}),
        ),
    })
}

/// A `backup-*` method's request.
fn backup_request(b: &crate::args::BackupMethod) -> Result<(String, Value), String> {
    use crate::args::BackupMethod as B;
    Ok(match b {
        B::BackupBegin {
            checkpoint,
            incremental,
            socket,
            listen,
            export,
            scratch,
            scratch_max,
            granularity,
        } => {
            let mut p = serde_json::Map::new();
            p.insert("checkpoint".into(), json!(checkpoint));
            let g = crate::args::parse_size(granularity).ok_or_else(|| {
                format!("--granularity {granularity:?}: bytes, or with K, M or G")
            })?;
            p.insert("granularity".into(), json!(g));
            // Paths as the daemon sees them (its working directory is not ours).
            let abs = |p: &Option<String>| {
                p.as_ref().map(|p| {
                    std::path::absolute(p).map_or_else(|_| p.clone(), |a| a.display().to_string())
                })
            };
            let (socket, scratch) = (&abs(socket), &abs(scratch));
            if let Some(m) = scratch_max {
                let b = crate::args::parse_size(m)
                    .ok_or_else(|| format!("--scratch-max {m:?}: bytes, or with K, M, G or T"))?;
                p.insert("scratch-max".into(), json!(b));
            }
            for (k, v) in [
                ("incremental", incremental),
                ("socket", socket),
                ("listen", listen),
                ("export", export),
                ("scratch", scratch),
            ] {
                if let Some(v) = v {
                    p.insert(k.into(), json!(v));
                }
            }
            ("backup-begin".to_owned(), Value::Object(p))
        }
        B::BackupEnd { checkpoint } => {
            ("backup-end".to_owned(), json!({ "checkpoint": checkpoint }))
        }
        B::BackupList => ("backup-list".to_owned(), Value::Null),
    })
}

/// Parameters of a method the client does not know (`vublk ctl OTHER --name value ...`):
/// `--name value` pairs become `{"name": value}` (dashes as underscores; integers as
/// numbers).
fn params_from_args(args: &[String]) -> Result<Value, String> {
    let mut m = serde_json::Map::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let Some(name) = a.strip_prefix("--") else {
            return Err(format!(
                "unexpected argument {a:?} (parameters are --name value)"
            ));
        };
        let v = it.next().ok_or_else(|| format!("{a}: needs a value"))?;
        let val = v
            .parse::<u64>()
            .map(Value::from)
            .unwrap_or_else(|_| Value::from(v.as_str()));
        m.insert(name.replace('-', "_"), val);
    }
    Ok(Value::Object(m))
}
