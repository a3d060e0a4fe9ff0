//! The documentation names only what the repository has (issue 29): every relative link in
//! README.md, ARCHITECTURE.md, BENCHMARKS.md, docs/**/*.md and vendor/PATCHES.md leads to a
//! file or directory of the repository, no link leaves it (`../` past its root), and every
//! backtick-quoted token that looks like a repository path (`src/...`, `tests/...`,
//! `Cargo.toml`, ...) exists. Placeholders (`vendor/NAME`, `fuzz/corpus/TARGET`, `<...>`,
//! `*`, `...`) are skipped, and paths outside the listed directories (`target/...`, which a
//! build makes, or `/usr/...`) are not checked. vendor/PATCHES.md names the patched crates'
//! own files (`src/handler.rs`): those may be in any `vendor/CRATE/`. Only std: the test
//! reads files and compares strings.

use std::collections::BTreeSet;
use std::path::{Component, Path, PathBuf};

/// The repository's root (the crate's manifest directory).
fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The documents checked, relative to the root.
fn documents() -> Vec<PathBuf> {
    let mut docs: Vec<PathBuf> = [
        "README.md",
        "ARCHITECTURE.md",
        "BENCHMARKS.md",
        "vendor/PATCHES.md",
    ]
    .iter()
    .map(PathBuf::from)
    .collect();
    let mut stack = vec![PathBuf::from("docs")];
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(root().join(&dir)) else {
            continue;
        };
        for e in entries {
            let e = e.unwrap();
            let rel = dir.join(e.file_name());
            if e.file_type().unwrap().is_dir() {
                stack.push(rel);
            } else if rel.extension().is_some_and(|x| x == "md") {
                docs.push(rel);
            }
        }
    }
    docs.sort();
    docs
}

/// Markdown link targets: `](target)` and reference definitions `[name]: target`.
fn link_targets(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(i) = rest.find("](") {
        rest = &rest[i + 2..];
        let end = rest.find(')').unwrap_or(rest.len());
        let target = rest[..end].split_whitespace().next().unwrap_or("");
        out.push(target.trim_matches(|c| c == '<' || c == '>').to_owned());
    }
    for line in text.lines() {
        let l = line.trim_start();
        if let (true, Some(i)) = (l.starts_with('['), l.find("]: ")) {
            if let Some(t) = l[i + 3..].split_whitespace().next() {
                out.push(t.to_owned());
            }
        }
    }
    out
}

/// The text between single backticks, outside fenced code blocks.
fn code_spans(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut fenced = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        let parts: Vec<&str> = line.split('`').collect();
        // Odd indices are inside backticks (an unmatched last one is not a span).
        for (i, p) in parts.iter().enumerate() {
            if i % 2 == 1 && i + 1 < parts.len() {
                out.push((*p).to_owned());
            }
        }
    }
    out
}

const DIRS: [&str; 8] = [
    "src/", "tests/", "contrib/", "docs/", "vendor/", "fuzz/", "debian/", ".ci/",
];
const TOP_FILES: [&str; 5] = [
    "Cargo.toml",
    "Cargo.lock",
    "README.md",
    "ARCHITECTURE.md",
    "BENCHMARKS.md",
];

/// A code span that names a repository path, as the path (a trailing `:LINE`, `/` or
/// punctuation dropped); None for anything else, placeholders included.
fn repository_path(span: &str) -> Option<String> {
    let token = span.split_whitespace().next()?;
    let whole = span.trim();
    // A command line (`contrib/test.sh --setup`, `bash vendor/update.sh`): its first word
    // that is a path.
    let token = if whole.contains(' ') {
        whole
            .split_whitespace()
            .find(|w| DIRS.iter().any(|d| w.starts_with(d)) || TOP_FILES.contains(w))?
    } else {
        token
    };
    if !(DIRS.iter().any(|d| token.starts_with(d)) || TOP_FILES.contains(&token)) {
        return None;
    }
    // Placeholders and globs.
    const PLACEHOLDERS: [&str; 9] = ["*", "<", ">", "...", "NAME", "TARGET", "VERSION", "{", "$"];
    if PLACEHOLDERS.iter().any(|p| token.contains(p)) {
        return None;
    }
    let mut path = token.trim_end_matches([',', '.', ';', ':', ')']).to_owned();
    // `src/foo.rs:123` or `src/foo.rs:fn_name`.
    if let Some(i) = path.find(':') {
        path.truncate(i);
    }
    // `src/image/qcow2/mod.rs#anchor`
    if let Some(i) = path.find('#') {
        path.truncate(i);
    }
    Some(path.trim_end_matches('/').to_owned())
}

/// vendor/PATCHES.md names the files of the patched crates as their crate does
/// (`src/handler.rs`): such a path is in some `vendor/CRATE/`.
fn in_a_vendored_crate(doc: &Path, path: &str) -> bool {
    if !doc.starts_with("vendor") {
        return false;
    }
    let Ok(entries) = std::fs::read_dir(root().join("vendor")) else {
        return false;
    };
    entries
        .flatten()
        .any(|e| e.path().is_dir() && e.path().join(path).exists())
}

/// `base/target` with `.` and `..` resolved; None when it climbs above the root.
fn resolve(base: &Path, target: &str) -> Option<PathBuf> {
    let mut parts: Vec<String> = Vec::new();
    for c in base.join(target).components() {
        match c {
            Component::Normal(p) => parts.push(p.to_string_lossy().into_owned()),
            Component::ParentDir => {
                parts.pop()?;
            }
            Component::CurDir => {}
            Component::RootDir | Component::Prefix(_) => return None,
        }
    }
    Some(parts.iter().collect())
}

#[test]
fn every_path_the_docs_name_exists() {
    let root = root();
    let mut problems = BTreeSet::new();
    let docs = documents();
    assert!(docs.len() > 5, "no docs/ pages found: {docs:?}");
    for doc in &docs {
        let text = match std::fs::read_to_string(root.join(doc)) {
            Ok(text) => text,
            Err(e) => {
                problems.insert(format!("{}: {e}", doc.display()));
                continue;
            }
        };
        let dir = doc.parent().unwrap_or(Path::new(""));
        for target in link_targets(&text) {
            let target = target.split('#').next().unwrap_or("");
            if target.is_empty()
                || target.starts_with("http://")
                || target.starts_with("https://")
                || target.starts_with("mailto:")
            {
                continue;
            }
            if target.starts_with('/') || target.contains("://") {
                problems.insert(format!(
                    "{}: link outside the repository: {target}",
                    doc.display()
                ));
                continue;
            }
            match resolve(dir, target) {
                None => {
                    problems.insert(format!(
                        "{}: link leaves the repository: {target}",
                        doc.display()
                    ));
                }
                Some(p) if !root.join(&p).exists() => {
                    problems.insert(format!(
                        "{}: link to a missing path: {target} ({})",
                        doc.display(),
                        p.display()
                    ));
                }
                Some(_) => {}
            }
        }
        for span in code_spans(&text) {
            if span.contains("../") {
                problems.insert(format!(
                    "{}: names a path outside the repository: `{span}`",
                    doc.display()
                ));
                continue;
            }
            if let Some(p) = repository_path(&span) {
                if !root.join(&p).exists() && !in_a_vendored_crate(doc, &p) {
                    problems.insert(format!("{}: names a missing path: `{p}`", doc.display()));
                }
            }
        }
    }
    assert!(
        problems.is_empty(),
        "{} problem(s) in the docs:\n{}",
        problems.len(),
        problems.into_iter().collect::<Vec<_>>().join("\n")
    );
}

#[test]
fn the_path_scanner_finds_what_it_should() {
    let text = "See [a](docs/a.md#x), [b](https://x), `src/lib.rs`, `contrib/test.sh --setup`,\n\
                `vendor/NAME`, `src/*.rs`, `--blk-file`, `Cargo.toml`.\n```\n`src/not/in/fence.rs`\n```\n";
    assert_eq!(link_targets(text), ["docs/a.md#x", "https://x"]);
    let paths: Vec<String> = code_spans(text)
        .iter()
        .filter_map(|s| repository_path(s))
        .collect();
    assert_eq!(paths, ["src/lib.rs", "contrib/test.sh", "Cargo.toml"]);
    assert_eq!(
        resolve(Path::new("docs"), "../src/lib.rs"),
        Some(PathBuf::from("src/lib.rs"))
    );
    assert_eq!(resolve(Path::new("docs"), "../../shared/DESIGN.md"), None);
}
