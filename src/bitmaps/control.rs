//! The `bitmap-*` control methods (docs/changed-block-tracking.md): their parameters, as the
//! control socket gives them (untrusted JSON), and their answers.

use serde_json::{json, Value};

use super::{BitmapError, Bitmaps, Save, DEFAULT_GRANULARITY};

/// Most extents one `bitmap-ranges` answer carries (the control socket bounds its lines).
pub const MAX_EXTENTS: u64 = 1024;

/// Why a call fails.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    /// The parameters do not fit the method.
    #[error("{0}")]
    Params(String),
    /// The bitmaps refuse it.
    #[error(transparent)]
    Refused(#[from] BitmapError),
    /// Not a bitmap method.
    #[error("unknown method {0:?}")]
    Unknown(String),
}

pub(crate) fn object(
    params: &Value,
    method: &str,
    allowed: &[&str],
) -> Result<serde_json::Map<String, Value>, CallError> {
    let m = match params {
        Value::Object(m) => m.clone(),
        Value::Null => serde_json::Map::new(),
        _ => {
            return Err(CallError::Params(format!(
                "{method} takes an object of parameters"
            )))
        }
    };
    if let Some(k) = m.keys().find(|k| !allowed.contains(&k.as_str())) {
        return Err(CallError::Params(format!(
            "{method}: unknown parameter {k:?} (it takes {})",
            if allowed.is_empty() {
                "none".to_owned()
            } else {
                allowed.join(", ")
            }
        )));
    }
    Ok(m)
}

pub(crate) fn string(m: &serde_json::Map<String, Value>, key: &str) -> Result<String, CallError> {
    match m.get(key) {
        Some(Value::String(s)) => Ok(s.clone()),
        Some(_) => Err(CallError::Params(format!("{key}: a string"))),
        None => Err(CallError::Params(format!("{key}: missing"))),
    }
}

pub(crate) fn flag(m: &serde_json::Map<String, Value>, key: &str) -> Result<bool, CallError> {
    match m.get(key) {
        None => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(CallError::Params(format!("{key}: true or false"))),
    }
}

pub(crate) fn number(
    m: &serde_json::Map<String, Value>,
    key: &str,
) -> Result<Option<u64>, CallError> {
    match m.get(key) {
        None => Ok(None),
        Some(Value::Number(n)) => n
            .as_u64()
            .map(Some)
            .ok_or_else(|| CallError::Params(format!("{key}: a non-negative integer"))),
        Some(_) => Err(CallError::Params(format!("{key}: a number of bytes"))),
    }
}

/// Answer the bitmap method `method`; `save` writes the persistent bitmaps to the image
/// after a change to one of them.
pub fn call(method: &str, params: &Value, set: &Bitmaps, save: Save) -> Result<Value, CallError> {
    match method {
        "bitmap-add" => {
            let m = object(
                params,
                method,
                &["name", "granularity", "persistent", "disabled"],
            )?;
            let name = string(&m, "name")?;
            let g = number(&m, "granularity")?.unwrap_or(DEFAULT_GRANULARITY);
            let persistent = flag(&m, "persistent")?;
            let disabled = flag(&m, "disabled")?;
            set.add(&name, g, persistent, !disabled, save)?;
            log::info!(
                "bitmap {name:?} added ({g}-byte granularity, {}{})",
                if persistent {
                    "persistent"
                } else {
                    "in memory"
                },
                if disabled { ", disabled" } else { "" }
            );
            Ok(json!({"name": name, "granularity": g}))
        }
        "bitmap-remove" | "bitmap-clear" | "bitmap-enable" | "bitmap-disable" => {
            let m = object(params, method, &["name"])?;
            let name = string(&m, "name")?;
            match method {
                "bitmap-remove" => set.remove(&name, save)?,
                "bitmap-clear" => set.clear(&name, save)?,
                "bitmap-enable" => set.set_recording(&name, true, save)?,
                _ => set.set_recording(&name, false, save)?,
            }
            log::info!("bitmap {name:?}: {}", &method["bitmap-".len()..]);
            Ok(json!({"name": name}))
        }
        "bitmap-merge" => {
            let m = object(params, method, &["target", "sources"])?;
            let target = string(&m, "target")?;
            let sources: Vec<String> = match m.get("sources") {
                Some(Value::Array(a)) if !a.is_empty() => a
                    .iter()
                    .map(|v| {
                        v.as_str()
                            .map(str::to_owned)
                            .ok_or_else(|| CallError::Params("sources: names".into()))
                    })
                    .collect::<Result<_, _>>()?,
                _ => {
                    return Err(CallError::Params(
                        "sources: a list of one or more names".into(),
                    ))
                }
            };
            set.merge(&target, &sources, save)?;
            Ok(json!({"target": target, "sources": sources}))
        }
        "bitmap-list" => {
            object(params, method, &[])?;
            Ok(json!({ "bitmaps": set.list(), "memory_only": set.memory_only() }))
        }
        "bitmap-ranges" => {
            let m = object(params, method, &["name", "offset", "max"])?;
            let name = string(&m, "name")?;
            let from = number(&m, "offset")?.unwrap_or(0);
            let max = number(&m, "max")?
                .unwrap_or(MAX_EXTENTS)
                .clamp(1, MAX_EXTENTS);
            let b = set.get(&name)?;
            let (extents, next) = b.dirty_extents(from, max as usize);
            Ok(json!({
                "name": name,
                "granularity": b.granularity(),
                "extents": extents.iter().map(|&(o, l)| json!([o, l])).collect::<Vec<_>>(),
                "next_offset": next,
            }))
        }
        _ => Err(CallError::Unknown(method.to_owned())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parameters_are_checked() {
        let s = Bitmaps::new(1 << 30, Some("in memory only".into()));
        let save = |_: &[super::super::Persistent]| -> Result<(), String> { Ok(()) };
        let bad = |m: &str, p: Value| call(m, &p, &s, &save).unwrap_err().to_string();
        assert!(bad("bitmap-add", json!({})).contains("name: missing"));
        assert!(bad("bitmap-add", json!({"name": 3})).contains("name: a string"));
        assert!(bad("bitmap-add", json!({"name": "a", "x": 1})).contains("unknown parameter"));
        assert!(bad("bitmap-add", json!({"name": "a", "granularity": -1})).contains("non-negative"));
        assert!(
            bad("bitmap-add", json!({"name": "a", "granularity": 1000})).contains("power of two")
        );
        assert!(
            bad("bitmap-add", json!({"name": "a", "persistent": true})).contains("in memory only")
        );
        assert!(bad("bitmap-merge", json!({"target": "a", "sources": []})).contains("one or more"));
        assert!(bad("bitmap-list", json!({"x": 1})).contains("takes none"));
        assert!(bad("bitmap-clear", json!({"name": "nope"})).contains("no bitmap"));
        call(
            "bitmap-add",
            &json!({"name": "a", "granularity": 1 << 20}),
            &s,
            &save,
        )
        .unwrap();
        assert_eq!(s.list()[0].granularity, 1 << 20);
    }
}
