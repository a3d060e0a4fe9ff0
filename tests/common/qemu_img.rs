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

/// `qemu-img create -q -f FMT PATH SIZE` (SIZE as qemu-img takes it: `16M`, bytes), which must
/// succeed.
pub fn qemu_img_create(path: &Path, fmt: &str, size: &str) {
    run_ok(
        std::process::Command::new("qemu-img")
            .args(["create", "-q", "-f", fmt])
            .arg(path)
            .arg(size),
    );
}

/// After a killed writer: `qemu-img check` finds no corruption (leaked clusters, exit status
/// 3, are allowed).
pub fn assert_check_allows_leaks(path: &Path, fmt: &str, what: &str) {
    let o = std::process::Command::new("qemu-img")
        .args(["check", "-f", fmt])
        .arg(path)
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&o.stdout).into_owned() + &String::from_utf8_lossy(&o.stderr);
    assert!(
        matches!(o.status.code(), Some(0) | Some(3)) && !text.contains("ERROR"),
        "qemu-img check {what}:\n{text}"
    );
}

/// `qemu-img info`: the image's virtual size is `size` bytes.
pub fn assert_virtual_size(path: &Path, size: u64) {
    let info = run_ok(
        std::process::Command::new("qemu-img")
            .args(["info", "--output=json"])
            .arg(path),
    );
    assert!(
        info.contains(&format!("\"virtual-size\": {size}")),
        "{}: not {size} bytes:\n{info}",
        path.display()
    );
}

/// `qemu-img convert` of the `fmt` image at `path` into the raw file `raw`.
pub fn convert_to_raw(path: &Path, fmt: &str, raw: &Path) {
    run_ok(
        std::process::Command::new("qemu-img")
            .args(["convert", "-f", fmt, "-O", "raw"])
            .arg(path)
            .arg(raw),
    );
}

/// The dirty extents (adjacent ones joined) of the persistent bitmap `name` in the qcow2
/// image `img`, as QEMU reads them: `qemu-nbd -r -B NAME` under
/// `nbdinfo --map=qemu:dirty-bitmap:NAME` (nbdinfo starts and stops the server).
pub fn nbd_dirty_map(img: &Path, name: &str) -> Vec<(u64, u64)> {
    let out = run_ok(
        std::process::Command::new("nbdinfo")
            .arg(format!("--map=qemu:dirty-bitmap:{name}"))
            .args(["--", "[", "qemu-nbd", "-r", "-f", "qcow2", "-B", name])
            .arg(img)
            .arg("]"),
    );
    let mut v: Vec<(u64, u64)> = Vec::new();
    for line in out.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() < 4 || f[3] != "dirty" {
            continue;
        }
        let (o, l): (u64, u64) = (f[0].parse().unwrap(), f[1].parse().unwrap());
        match v.last_mut() {
            Some(last) if last.0 + last.1 == o => last.1 += l,
            _ => v.push((o, l)),
        }
    }
    v
}
