//! The images the backends serve: the fully written raw image of the workloads, and the
//! fresh images some runs make for themselves (a qcow2 by `vublk create` for
//! `--fresh-qcow2`, a qcow2 or parallels image by `qemu-img create` for the fill modes).

use std::fs::{self, OpenOptions};
use std::io::Write as _;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use crate::args::Opts;

/// Make sure the image exists at the requested size with every block written (reads must hit
/// real data, not holes).
pub fn prepare_image(path: &Path, size: u64) {
    if let Some(dir) = path.parent() {
        fs::create_dir_all(dir).expect("image directory");
    }
    if let Ok(m) = fs::metadata(path) {
        if m.len() == size && m.blocks() * 512 >= size {
            return;
        }
    }
    eprintln!(
        "preparing {} ({} MiB, fully written)",
        path.display(),
        size >> 20
    );
    let mut f = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(path)
        .expect("create image");
    let mut buf = vec![0u8; 1 << 20];
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for chunk in buf.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        chunk.copy_from_slice(&x.to_le_bytes()[..chunk.len()]);
    }
    let mut left = size;
    while left > 0 {
        let n = left.min(buf.len() as u64) as usize;
        f.write_all(&buf[..n]).expect("write image");
        buf[0] = buf[0].wrapping_add(1);
        left -= n as u64;
    }
    f.sync_all().expect("sync image");
}

/// `--fresh-qcow2`: replace `image` with an empty qcow2 made by `vublk create`, of `--size`
/// or an overlay over `--fresh-backing`; with extended L2 entries (subclusters) when its
/// file name contains "extl2".
pub fn fresh_qcow2(image: &Path, opts: &Opts, vublk: &Path) {
    remove_settled(image, Duration::from_secs(1));
    let mut create = Command::new(vublk);
    create.args(["create", "--format", "qcow2"]);
    if image
        .file_name()
        .is_some_and(|n| n.to_string_lossy().contains("extl2"))
    {
        create.arg("--extended-l2");
    }
    match &opts.fresh_backing {
        Some(b) => create
            .arg("--backing")
            .arg(fs::canonicalize(b).expect("backing file")),
        None => create.arg("--size").arg(opts.size.to_string()),
    };
    let st = create.arg(image).status().expect("vublk create");
    assert!(st.success(), "vublk create {} failed", image.display());
}

/// Replace `image` with an empty one made by `qemu-img create -f FORMAT -o OPTIONS` of
/// `size` (qemu-img's syntax: "64G", or bytes).
pub fn fresh_qemu_img(image: &Path, format: &str, options: &str, size: &str) {
    remove_settled(image, Duration::from_millis(500));
    let st = Command::new("qemu-img")
        .args(["create", "-q", "-f", format, "-o", options])
        .arg(image)
        .arg(size)
        .status()
        .expect("qemu-img create");
    assert!(st.success(), "qemu-img create {} failed", image.display());
}

/// Delete `path` if it exists, then sync and wait `pause`: deleting the previous run's image
/// frees gigabytes, and on a file system mounted with online discard that work would land
/// in the next measurement. Let it finish first.
fn remove_settled(path: &Path, pause: Duration) {
    if fs::remove_file(path).is_ok() {
        // SAFETY: plain system call.
        unsafe { libc::sync() };
        std::thread::sleep(pause);
    }
}
