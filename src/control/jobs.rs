//! The control methods of block jobs (stream, commit, mirror, jobs, job-cancel,
//! job-complete) and
//! what they and snapshots need: why the image cannot be switched now, the device as a
//! job's `Host`, and the parameters every job takes.

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use serde_json::Value;

use serde_json::json;

use super::{CallResult, Context, INVALID_PARAMS, METHOD_NOT_FOUND, REFUSED};
use crate::device::Device;

/// Why the served image cannot be switched now (a backup's view holds it, a migration).
pub(super) fn image_busy(dev: &Device) -> Option<String> {
    if dev.backups.any() {
        Some("a backup is running over the image served now: end it first (backup-end)".into())
    } else if dev.dirty_log.load(Ordering::Acquire) {
        Some("the frontend is migrating the guest: wait for the migration to end".into())
    } else {
        None
    }
}

/// What a block job needs of the device (`jobs::Host`).
struct JobHost {
    dev: Arc<Device>,
    base: PathBuf,
    state: Option<PathBuf>,
}

impl crate::jobs::Host for JobHost {
    fn slot(&self) -> &crate::image::handover::ImageSlot {
        &self.dev.image
    }
    fn paused(&self, f: &mut dyn FnMut()) {
        self.dev.with_queues_paused(f)
    }
    fn bitmaps(&self) -> &crate::bitmaps::Bitmaps {
        &self.dev.bitmaps
    }
    fn busy(&self) -> Option<String> {
        image_busy(&self.dev)
    }
    fn write_through(&self) -> &crate::jobs::active::ThroughSlot {
        &self.dev.write_through
    }
    fn base(&self) -> &std::path::Path {
        &self.base
    }
    fn chain_state(&self) -> Option<&std::path::Path> {
        self.state.as_deref()
    }
}

/// The parameters every job takes: `id` (optional) and `speed` (bytes per second, 0:
/// unlimited); `extra` names the job's own (strings).
struct JobParams {
    id: Option<String>,
    speed: u64,
}

impl JobParams {
    /// `extra`: the job's own string parameters; `flags`: its own true/false ones.
    fn parse(params: &Value, extra: &[&str], flags: &[&str]) -> Result<Self, (i64, String)> {
        let m = match params {
            Value::Null => return Ok(JobParams { id: None, speed: 0 }),
            Value::Object(m) => m,
            _ => return Err((INVALID_PARAMS, "a job takes an object of parameters".into())),
        };
        if let Some(k) = m.keys().find(|k| {
            !["id", "speed"].contains(&k.as_str())
                && !extra.contains(&k.as_str())
                && !flags.contains(&k.as_str())
        }) {
            return Err((INVALID_PARAMS, format!("unknown parameter {k:?}")));
        }
        for k in flags {
            if m.get(*k).is_some_and(|v| !v.is_boolean()) {
                return Err((INVALID_PARAMS, format!("{k}: true or false")));
            }
        }
        for k in extra {
            if m.get(*k).is_some_and(|v| !v.is_string()) {
                return Err((INVALID_PARAMS, format!("{k}: a string")));
            }
        }
        let id = match m.get("id") {
            None => None,
            Some(Value::String(s)) => Some(s.clone()),
            Some(_) => return Err((INVALID_PARAMS, "id: a string".into())),
        };
        let speed = match m.get("speed") {
            None => 0,
            Some(v) => v.as_u64().ok_or((
                INVALID_PARAMS,
                "speed: bytes per second, a non-negative integer".to_owned(),
            ))?,
        };
        Ok(JobParams { id, speed })
    }
}

/// The `copy_mode` parameter of an active job (default: auto).
fn copy_mode(params: &Value) -> Result<crate::jobs::CopyMode, (i64, String)> {
    use crate::jobs::CopyMode;
    match params.get("copy_mode").and_then(Value::as_str) {
        None | Some("auto") => Ok(CopyMode::Auto),
        Some("background") => Ok(CopyMode::Background),
        Some("write-through") => Ok(CopyMode::WriteThrough),
        Some(o) => Err((
            INVALID_PARAMS,
            format!("--copy-mode {o}: background, write-through or auto"),
        )),
    }
}

/// The block job methods: `stream`, `commit`, `mirror`, `jobs`, `job-cancel`,
/// `job-complete`.
pub(super) fn call(method: &str, params: &Value, ctx: &Context) -> CallResult {
    let dev = &ctx.dev;
    match method {
        "stream" => {
            let p = JobParams::parse(params, &["base"], &[])?;
            let host = Arc::new(JobHost {
                dev: dev.clone(),
                base: ctx.image_path.clone(),
                state: ctx.chain_state.clone(),
            });
            let base = params.get("base").and_then(Value::as_str);
            crate::jobs::stream::start(&dev.jobs, host, base, p.id, p.speed)
                .map(|j| serde_json::to_value(j).unwrap_or(Value::Null))
                .map_err(|e| (REFUSED, e))
        }
        "commit" => {
            let p = JobParams::parse(params, &["top", "base", "copy_mode"], &["manual_complete"])?;
            let manual = params
                .get("manual_complete")
                .and_then(Value::as_bool)
                .unwrap_or(false);
            let host = Arc::new(JobHost {
                dev: dev.clone(),
                base: ctx.image_path.clone(),
                state: ctx.chain_state.clone(),
            });
            let text = |k: &str| params.get(k).and_then(Value::as_str).map(str::to_owned);
            let req = crate::jobs::commit::Request {
                top: text("top"),
                base: text("base"),
                manual_complete: manual,
                copy_mode: copy_mode(params)?,
                id: p.id,
                speed: p.speed,
            };
            crate::jobs::commit::start(&dev.jobs, host, req)
                .map(|j| serde_json::to_value(j).unwrap_or(Value::Null))
                .map_err(|e| (REFUSED, e))
        }
        "mirror" => {
            let p = JobParams::parse(
                params,
                &["target", "format", "sync", "bitmap", "copy_mode"],
                &[],
            )?;
            let text = |k: &str| params.get(k).and_then(Value::as_str).map(str::to_owned);
            let target = text("target")
                .ok_or_else(|| (INVALID_PARAMS, "mirror takes {\"target\": PATH}".to_owned()))?;
            let host = Arc::new(JobHost {
                dev: dev.clone(),
                base: ctx.image_path.clone(),
                state: ctx.chain_state.clone(),
            });
            let req = crate::jobs::mirror::Request {
                target,
                format: text("format"),
                sync: text("sync"),
                bitmap: text("bitmap"),
                copy_mode: copy_mode(params)?,
                id: p.id,
                speed: p.speed,
            };
            crate::jobs::mirror::start(&dev.jobs, host, req)
                .map(|j| serde_json::to_value(j).unwrap_or(Value::Null))
                .map_err(|e| (REFUSED, e))
        }
        "jobs" => {
            super::no_params(params)?;
            Ok(json!({ "jobs": dev.jobs.list() }))
        }
        "job-cancel" | "job-complete" => {
            let id = params
                .get("id")
                .and_then(Value::as_str)
                .ok_or_else(|| (INVALID_PARAMS, format!("{method} takes {{\"id\": ID}}")))?;
            let r = if method == "job-cancel" {
                dev.jobs.cancel(id)
            } else {
                dev.jobs.complete(id)
            };
            r.map(|j| serde_json::to_value(j).unwrap_or(Value::Null))
                .map_err(|e| (REFUSED, e))
        }
        _ => Err((METHOD_NOT_FOUND, format!("unknown method {method:?}"))),
    }
}
