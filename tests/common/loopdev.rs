//! Loop devices (root only) for tests on real block devices with a given sector size.

use std::path::Path;
use std::process::Command;

use super::skip_or_fail;

/// A loop device with `sector`-byte sectors, or None (with the reason printed) where the machine
/// cannot make one.
pub struct LoopDev(pub String);

impl LoopDev {
    pub fn new(backing: &Path, sector: u32) -> Option<LoopDev> {
        let o = Command::new("losetup")
            .args([
                "--sector-size",
                &sector.to_string(),
                "--direct-io=on",
                "-f",
                "--show",
            ])
            .arg(backing)
            .output();
        match o {
            Ok(o) if o.status.success() => Some(LoopDev(
                String::from_utf8_lossy(&o.stdout).trim().to_string(),
            )),
            Ok(o) => skip_or_fail(&format!(
                "cannot create a loop device: {}",
                String::from_utf8_lossy(&o.stderr).trim()
            )),
            Err(e) => skip_or_fail(&format!("losetup not available: {e}")),
        }
    }
}

impl Drop for LoopDev {
    fn drop(&mut self) {
        let _ = Command::new("losetup").args(["-d", &self.0]).status();
    }
}
