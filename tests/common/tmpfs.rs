//! A small tmpfs mounted for one test (root only): a host file system that fills up.

use std::path::{Path, PathBuf};
use std::process::Command;

use super::skip_or_fail;

/// A tmpfs of a given size mounted at a directory; unmounted on drop.
pub struct Tmpfs(PathBuf);

impl Tmpfs {
    /// Mount a tmpfs of `size` bytes at `dir` (created), or None (with the reason printed)
    /// where the machine cannot.
    pub fn mount(dir: &Path, size: u64) -> Option<Tmpfs> {
        std::fs::create_dir_all(dir).unwrap();
        let o = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "vublk-test"])
            .arg(dir)
            .output();
        match o {
            Ok(o) if o.status.success() => Some(Tmpfs(dir.to_owned())),
            Ok(o) => skip_or_fail(&format!(
                "cannot mount a tmpfs (needs root): {}",
                String::from_utf8_lossy(&o.stderr).trim()
            )),
            Err(e) => skip_or_fail(&format!("mount not available: {e}")),
        }
    }

    pub fn path(&self) -> &Path {
        &self.0
    }

    pub fn join(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        // Lazily, so that a backend a failing test left running cannot keep it mounted.
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}
