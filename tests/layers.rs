//! The crate's module structure, as ARCHITECTURE.md states it: no import circle between the
//! top-level modules nor between the rooms of `src/image/` and `src/nbd/`, and no arrow
//! from a lower layer (local I/O, the drivers, the image) to a higher one (the data plane,
//! the vhost-user glue, the configuration). Production code only: test modules, test
//! doubles and fuzzing entry points may reach anywhere.
//!
//! Read from the source text: `crate::NAME` paths name top-level modules; `super::NAME` and
//! `super::{NAME, ...}` inside a room name its siblings. Comments are skipped.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

type Graph = BTreeMap<String, BTreeSet<String>>;

/// Files that are tests, test doubles or fuzzing entry points.
fn is_test_file(name: &str) -> bool {
    matches!(
        name,
        "tests.rs" | "testing.rs" | "conformance.rs" | "fuzz.rs" | "backend_fuzz.rs"
    ) || name.ends_with("_tests.rs")
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The production text of a file: without its `#[cfg(test)] mod tests` and comments.
fn production_text(path: &Path) -> String {
    let s = std::fs::read_to_string(path).unwrap();
    let s = match s.find("#[cfg(test)]\nmod tests") {
        Some(i) => &s[..i],
        None => &s[..],
    };
    s.lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The identifiers that follow each `prefix` in `text` (one, or each of a `{...}` list).
fn names_after(text: &str, prefix: &str) -> Vec<String> {
    let ident = |s: &str| -> String {
        s.chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect()
    };
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(i) = rest.find(prefix) {
        // Not the tail of a longer path (`super::super::x` counts once, from the start).
        let before = rest[..i].chars().last();
        rest = &rest[i + prefix.len()..];
        if before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':') {
            continue;
        }
        if let Some(list) = rest.strip_prefix('{') {
            let end = list.find('}').unwrap_or(list.len());
            out.extend(list[..end].split(',').map(|p| ident(p.trim())));
        } else {
            out.push(ident(rest));
        }
    }
    out.retain(|n| !n.is_empty());
    out
}

/// Module path of a file under `src/` (`image/qcow2/mod.rs` -> ["image", "qcow2"]).
fn module_of(src: &Path, file: &Path) -> Vec<String> {
    let rel = file.strip_prefix(src).unwrap().with_extension("");
    let mut parts: Vec<String> = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if matches!(
        parts.last().map(String::as_str),
        Some("mod" | "lib" | "main")
    ) {
        parts.pop();
    }
    parts
}

fn graphs() -> (Graph, BTreeMap<String, Graph>) {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let tops: BTreeSet<String> = files
        .iter()
        .filter_map(|f| module_of(&src, f).first().cloned())
        .collect();
    let mut top = Graph::new();
    let mut rooms: BTreeMap<String, Graph> = BTreeMap::new();
    for f in &files {
        let name = f.file_name().unwrap().to_string_lossy();
        if is_test_file(&name) {
            continue;
        }
        let m = module_of(&src, f);
        let Some(here) = m.first() else { continue };
        let text = production_text(f);
        for n in names_after(&text, "crate::") {
            if &n != here && tops.contains(&n) {
                top.entry(here.clone()).or_default().insert(n);
            }
        }
        // A room of a top-level module: src/TOP/ROOM.rs or src/TOP/ROOM/mod.rs.
        let is_room_root = m.len() == 2
            && (f.ends_with(format!("{}/{}.rs", m[0], m[1]))
                || f.ends_with(format!("{}/{}/mod.rs", m[0], m[1])));
        if is_room_root {
            let siblings: BTreeSet<String> = files
                .iter()
                .map(|g| module_of(&src, g))
                .filter(|g| g.len() >= 2 && g[0] == m[0])
                .map(|g| g[1].clone())
                .collect();
            let own = format!("crate::{}::", m[0]);
            let mut refs = names_after(&text, "super::");
            refs.extend(names_after(&text, &own));
            for n in refs {
                if n != m[1] && siblings.contains(&n) {
                    rooms
                        .entry(m[0].clone())
                        .or_default()
                        .entry(m[1].clone())
                        .or_default()
                        .insert(n);
                }
            }
        }
    }
    (top, rooms)
}

/// A cycle of `g`, if it has one.
fn cycle(g: &Graph) -> Option<Vec<String>> {
    fn visit(
        g: &Graph,
        u: &str,
        state: &mut BTreeMap<String, u8>,
        stack: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        state.insert(u.to_owned(), 1);
        stack.push(u.to_owned());
        for v in g.get(u).into_iter().flatten() {
            match state.get(v) {
                Some(1) => {
                    let i = stack.iter().position(|s| s == v).unwrap();
                    let mut c = stack[i..].to_vec();
                    c.push(v.clone());
                    return Some(c);
                }
                Some(_) => {}
                None => {
                    if let Some(c) = visit(g, v, state, stack) {
                        return Some(c);
                    }
                }
            }
        }
        stack.pop();
        state.insert(u.to_owned(), 2);
        None
    }
    let mut state = BTreeMap::new();
    for u in g.keys() {
        if !state.contains_key(u) {
            if let Some(c) = visit(g, u, &mut state, &mut Vec::new()) {
                return Some(c);
            }
        }
    }
    None
}

#[test]
fn no_import_circle_between_modules_or_rooms() {
    let (top, rooms) = graphs();
    // The scan sees what it should (a broken scan finds no circle).
    assert!(top["daemon"].contains("worker"), "{top:?}");
    assert!(top["worker"].contains("image"), "{top:?}");
    assert!(rooms["image"]["open"].contains("chain"), "{rooms:?}");
    if let Some(c) = cycle(&top) {
        panic!("top-level modules import each other: {}", c.join(" -> "));
    }
    for (module, g) in &rooms {
        if let Some(c) = cycle(g) {
            panic!("rooms of {module} import each other: {}", c.join(" -> "));
        }
    }
}

#[test]
fn lower_layers_do_not_reach_up() {
    let (top, _) = graphs();
    let higher = [
        "worker", "backend", "daemon", "config", "args", "control", "device",
    ];
    // Local I/O, the drivers and the small leaves know no disk model and no data plane.
    for low in [
        "io",
        "nbd",
        "rbd",
        "offload",
        "zero",
        "virtio_blk",
        "locks",
        "throttle",
        "units",
    ] {
        let reach: Vec<_> = top
            .get(low)
            .into_iter()
            .flatten()
            .filter(|m| higher.contains(&m.as_str()) || *m == "image")
            .collect();
        assert!(reach.is_empty(), "{low} imports {reach:?}");
    }
    // The image knows its drivers and local I/O, not who serves it.
    let reach: Vec<_> = top["image"]
        .iter()
        .filter(|m| higher.contains(&m.as_str()) || ["stats", "watchdog"].contains(&m.as_str()))
        .collect();
    assert!(reach.is_empty(), "image imports {reach:?}");
}

#[test]
fn the_scanner_reads_paths_and_lists() {
    assert_eq!(
        names_after(
            "use super::{open, chain::X};\nlet x = super::probe(f);",
            "super::"
        ),
        ["open", "chain", "probe"]
    );
    assert_eq!(names_after("crate::io::Op; a::crate::x", "crate::"), ["io"]);
}
