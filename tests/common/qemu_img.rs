//! qemu-img: is it there, run it, compare an image with a raw file.

use std::path::Path;

use super::skip_or_fail;

/// Is qemu-img installed? If not, "skipped: why" (a failure under CI).
pub fn have_qemu_img() -> bool {
    if std::process::Command::new("qemu-img")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
    {
        return true;
    }
    skip_or_fail::<()>("qemu-img not installed");
    false
}

/// Run a command that must succeed; its stdout.
pub fn run_ok(cmd: &mut std::process::Command) -> String {
    let o = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        o.status.success(),
        "{cmd:?} failed:\n{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// `qemu-img compare`: the qcow2 image holds exactly the raw file's data.
pub fn qemu_compare(raw: &Path, qcow2: &Path) {
    run_ok(
        std::process::Command::new("qemu-img")
            .args(["compare", "-q", "-f", "raw", "-F", "qcow2"])
            .arg(raw)
            .arg(qcow2),
    );
}
