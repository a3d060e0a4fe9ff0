//! What the control methods of block jobs and snapshots need: why the image cannot be
//! switched now, the device as a job's `Host`, and the parameters every job takes.

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use serde_json::Value;

use super::INVALID_PARAMS;
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
pub(super) struct JobHost {
    pub(super) dev: Arc<Device>,
    pub(super) base: PathBuf,
    pub(super) state: Option<PathBuf>,
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
    fn base(&self) -> &std::path::Path {
        &self.base
    }
    fn chain_state(&self) -> Option<&std::path::Path> {
        self.state.as_deref()
    }
}

/// The parameters every job takes: `id` (optional) and `speed` (bytes per second, 0:
/// unlimited); `extra` names the job's own (strings).
pub(super) struct JobParams {
    pub(super) id: Option<String>,
    pub(super) speed: u64,
}

impl JobParams {
    pub(super) fn parse(params: &Value, extra: &[&str]) -> Result<Self, (i64, String)> {
        let m = match params {
            Value::Null => return Ok(JobParams { id: None, speed: 0 }),
            Value::Object(m) => m,
            _ => return Err((INVALID_PARAMS, "a job takes an object of parameters".into())),
        };
        if let Some(k) = m
            .keys()
            .find(|k| !["id", "speed"].contains(&k.as_str()) && !extra.contains(&k.as_str()))
        {
            return Err((INVALID_PARAMS, format!("unknown parameter {k:?}")));
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
