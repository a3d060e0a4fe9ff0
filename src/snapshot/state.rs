//! Which image a restarted vublk serves after a snapshot: the chain's state file.
//!
//! `--blk-file` names the disk as the operator set it up. A snapshot puts an overlay on top
//! of it and serves the overlay; from then on the image named on the command line is a
//! backing file and must never be served read-write again under its overlay (its new
//! writes would show through the overlay's holes: the disk would be forked). So a restart
//! with the same command line (systemd's `Restart=`, an operator's `systemctl restart`)
//! must find the top of the chain. vublk keeps it in a small JSON file:
//!
//! - where `--chain-state PATH` says, or by default `.NAME.vublk-chain` beside the image
//!   file NAME (a block device or a remote disk has no default: a snapshot of one needs
//!   `--chain-state`);
//! - written at the moment of each switch, after the old image was closed and before the
//!   new one is opened, atomically (a temporary file, fsync, rename, fsync of the
//!   directory): a crash leaves the old record or the new one, and either names an image
//!   that is complete on disk;
//! - read at start: if it exists, vublk serves the image it names, after checking that the
//!   record is about this `--blk-file` and that the image's backing chain holds it (else
//!   vublk refuses to start and says which file to look at).
//!
//! Removing the file by hand makes the next start serve `--blk-file` itself again (what an
//! operator who threw the overlay away wants).

use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// The longest state file read (a record is a few hundred bytes).
const MAX_BYTES: u64 = 64 << 10;

/// What the state file says.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    /// `--blk-file`, absolute: the disk the chain grew from.
    pub image: PathBuf,
    /// The image served now, the top of the chain (absolute).
    pub top: PathBuf,
    /// The top's format ("qcow2").
    pub format: String,
    /// The top no longer has `image` in its backing chain (a stream job copied what it
    /// read from there and dropped the link): the check at start is not made.
    #[serde(default)]
    pub detached: bool,
}

/// Where a disk's state file is: `explicit` (`--chain-state`), else beside a regular image
/// file; None for a block device or a remote disk without `--chain-state`.
pub fn location(image: &Path, explicit: Option<&Path>) -> Option<PathBuf> {
    if let Some(p) = explicit {
        return Some(absolute(p));
    }
    let meta = fs::metadata(image).ok()?;
    if !meta.file_type().is_file() {
        return None;
    }
    let image = absolute(image);
    let name = image.file_name()?.to_string_lossy().into_owned();
    Some(image.with_file_name(format!(".{name}.vublk-chain")))
}

/// `p` made absolute against the working directory (not resolving symbolic links).
pub fn absolute(p: &Path) -> PathBuf {
    std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf())
}

/// The record in `path`, if the file exists.
pub fn read(path: &Path) -> Result<Option<Record>, String> {
    let f = match File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(format!("chain state file {}: {e}", path.display())),
    };
    let mut text = String::new();
    use std::io::Read;
    f.take(MAX_BYTES)
        .read_to_string(&mut text)
        .map_err(|e| format!("chain state file {}: {e}", path.display()))?;
    serde_json::from_str(&text).map(Some).map_err(|e| {
        format!(
            "chain state file {}: not a record vublk wrote ({e}); remove it to serve \
             --blk-file itself",
            path.display()
        )
    })
}

/// Replace the record in `path` atomically and durably.
pub fn write(path: &Path, r: &Record) -> Result<(), String> {
    let err = |what: &str, e: std::io::Error| format!("{what} {}: {e}", path.display());
    let dir = path.parent().unwrap_or(Path::new("."));
    let tmp = path.with_extension("tmp");
    let mut text = serde_json::to_string_pretty(r).map_err(|e| e.to_string())?;
    text.push('\n');
    let _ = fs::remove_file(&tmp);
    let mut f = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o644)
        .open(&tmp)
        .map_err(|e| err("cannot create", e))?;
    let written = f
        .write_all(text.as_bytes())
        .and_then(|()| f.sync_all())
        .and_then(|()| fs::rename(&tmp, path));
    if let Err(e) = written {
        let _ = fs::remove_file(&tmp);
        return Err(err("cannot write", e));
    }
    sync_dir(dir).map_err(|e| err("cannot sync the directory of", e))
}

/// Remove the record (the disk's own image is served again), durably.
pub fn remove(path: &Path) -> Result<(), String> {
    match fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(format!("cannot remove {}: {e}", path.display())),
    }
    sync_dir(path.parent().unwrap_or(Path::new(".")))
        .map_err(|e| format!("cannot sync the directory of {}: {e}", path.display()))
}

/// Make a directory's entries durable (a new or renamed file in it).
pub fn sync_dir(dir: &Path) -> std::io::Result<()> {
    File::open(dir)?.sync_all()
}

/// The image to serve for `--blk-file image`: the top the state file names (with its
/// format), or None when there is no state file. A record about another image is refused.
pub fn top(image: &Path, state: Option<&Path>) -> Result<Option<Record>, String> {
    let Some(state) = state else {
        return Ok(None);
    };
    let Some(r) = read(state)? else {
        return Ok(None);
    };
    if !same_file(&r.image, image) {
        return Err(format!(
            "chain state file {} is about {}, not --blk-file {}: give this disk its own \
             --chain-state, or remove the file",
            state.display(),
            r.image.display(),
            image.display()
        ));
    }
    Ok(Some(r))
}

/// Do `a` and `b` name the same file (the same inode, or the same path if either is gone)?
pub fn same_file(a: &Path, b: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (fs::metadata(a), fs::metadata(b)) {
        (Ok(x), Ok(y)) => x.dev() == y.dev() && x.ino() == y.ino(),
        _ => absolute(a) == absolute(b),
    }
}

/// `to` relative to the directory `from_dir` (with `..` where needed), when both are
/// absolute and share a first component; else `to` as it is.
pub fn relative(from_dir: &Path, to: &Path) -> PathBuf {
    let a: Vec<_> = from_dir.components().collect();
    let b: Vec<_> = to.components().collect();
    let common = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
    if common <= 1 || !from_dir.is_absolute() || !to.is_absolute() {
        return to.to_path_buf();
    }
    let mut r = PathBuf::new();
    for _ in common..a.len() {
        r.push("..");
    }
    for c in &b[common..] {
        r.push(c);
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relative_paths_climb_and_descend() {
        let r = |a: &str, b: &str| relative(Path::new(a), Path::new(b));
        assert_eq!(r("/v/img", "/v/img/base.raw"), Path::new("base.raw"));
        assert_eq!(
            r("/v/img/snaps", "/v/img/base.raw"),
            Path::new("../base.raw")
        );
        assert_eq!(r("/v/a/b", "/v/c/base.raw"), Path::new("../../c/base.raw"));
        // Nothing in common but the root: absolute.
        assert_eq!(r("/srv/x", "/var/base.raw"), Path::new("/var/base.raw"));
    }

    #[test]
    fn records_round_trip_and_foreign_or_broken_ones_are_refused() {
        let d = crate::testing::TempDir::new("chain-state").unwrap();
        let img = d.path().join("disk.raw");
        fs::write(&img, b"x").unwrap();
        let state = location(&img, None).unwrap();
        assert_eq!(state, d.path().join(".disk.raw.vublk-chain"));
        assert_eq!(top(&img, Some(&state)).unwrap(), None);
        let r = Record {
            image: img.clone(),
            top: d.path().join("s1.qcow2"),
            format: "qcow2".into(),
            detached: false,
        };
        write(&state, &r).unwrap();
        assert_eq!(top(&img, Some(&state)).unwrap(), Some(r.clone()));
        // Another disk's record.
        let other = d.path().join("other.raw");
        fs::write(&other, b"y").unwrap();
        let e = top(&other, Some(&state)).unwrap_err();
        assert!(e.contains("is about"), "{e}");
        // Garbage.
        fs::write(&state, b"{not json").unwrap();
        let e = top(&img, Some(&state)).unwrap_err();
        assert!(e.contains("remove it"), "{e}");
        remove(&state).unwrap();
        remove(&state).unwrap();
        assert_eq!(top(&img, Some(&state)).unwrap(), None);
        // A block device has no default place.
        assert_eq!(location(Path::new("/dev/null"), None), None);
    }
}
