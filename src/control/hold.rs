//! The error policy's methods (`crate::hold`): `resume` (params `{"report": true}`: answer
//! with IOERR instead), `stop-holding`, and what `status` shows of it.

use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::{CallResult, Context, INVALID_PARAMS};
use crate::device::Device;

/// How long `stop-holding` waits for the queues to answer what they hold (they look every
/// `worker::hold::TICK`).
const ANSWER_WAIT: Duration = Duration::from_secs(2);

pub(super) fn call(method: &str, params: &Value, ctx: &Context) -> CallResult {
    let dev = &ctx.dev;
    let report = match (method, params) {
        ("stop-holding", Value::Null) => true,
        ("stop-holding", Value::Object(m)) if m.is_empty() => true,
        ("stop-holding", _) => {
            return Err((INVALID_PARAMS, "this method takes no parameters".into()))
        }
        (_, Value::Null) => false,
        (_, Value::Object(m)) if m.keys().all(|k| k == "report") => match m.get("report") {
            None => false,
            Some(Value::Bool(b)) => *b,
            Some(_) => return Err((INVALID_PARAMS, "report: true or false".into())),
        },
        _ => return Err((INVALID_PARAMS, "resume takes only \"report\"".into())),
    };
    let before = dev.holds.now().map_or(0, |h| h.requests);
    if !report {
        dev.holds.resume();
        return Ok(json!({ "retrying": before }));
    }
    dev.holds.give_up();
    let deadline = Instant::now() + ANSWER_WAIT;
    while dev.holds.paused() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    Ok(json!({
        "answered": before,
        "held": dev.holds.now().map_or(0, |h| h.requests),
    }))
}

/// `status`'s `error_policy`: the options, and what is held now (`held`: null when
/// nothing is).
pub(super) fn status(dev: &Device) -> Value {
    let h = &dev.holds;
    let held = h.now().map(|n| {
        json!({
            "requests": n.requests,
            "errno": n.errno,
            "error": n.error(),
            "since": crate::hold::utc_time(n.since_ms),
            "seconds": n.seconds(),
        })
    });
    json!({
        "werror": format!("{:?}", h.werror()).to_lowercase(),
        "rerror": format!("{:?}", h.rerror()).to_lowercase(),
        "retry_interval_seconds": h.retry_interval().map_or(0.0, |d| d.as_secs_f64()),
        "held": held,
    })
}
