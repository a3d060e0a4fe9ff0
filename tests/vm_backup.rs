//! A backup under a running Linux guest (QEMU, TCG; docs/backups.md): the guest's `restart`
//! workload writes 4 KiB and 1 MiB blocks all over its raw disk; the test pauses the VM
//! (QMP `stop`: QEMU stops the vhost-user device, vublk completes what it had), copies the
//! image file as the reference, calls `backup-begin`, resumes the VM (`cont`), and copies
//! the export with `nbdcopy` while the guest goes on writing: the copy equals the
//! reference, the guest finishes its workload (PASS, every block it wrote verified in the
//! image), and the export was read after the guest had changed the disk (bytes copied
//! before writes).
//!
//! Environment: `VUBLK_E2E_REQUIRE=1` fails instead of skipping when QEMU, the guest kernel
//! or nbdcopy is missing; `VUBLK_E2E_KEEP=1` keeps the run directory.

mod common;
mod vm;

use std::fs;
use std::thread;
use std::time::Duration;

use vm::check_blocks;
use vm::writing::Rig;

const DISK: u64 = 512 << 20;
const WRITERS: u64 = 2;
const SECONDS: u64 = 40;

#[test]
fn a_backup_under_a_writing_guest_is_its_disk_at_the_begin() {
    let Some(Rig {
        run,
        image,
        ctl: ctl_sock,
        mut vublk,
        guest,
        mut g,
    }) = Rig::start(
        "vm-backup",
        &["qemu-img", "nbdcopy"],
        DISK,
        WRITERS,
        SECONDS,
    )
    else {
        return;
    };
    // Let it write, then pause it between two requests and take the reference.
    thread::sleep(Duration::from_secs(5));
    g.qmp.ok(r#"{"execute":"stop"}"#);
    let reference = fs::read(&image).unwrap();
    let nbd = run.path.join("nbd.sock");
    let uri = common::backup_begin(
        &ctl_sock,
        &["--checkpoint", "vm", "--socket", &nbd.display().to_string()],
    );
    g.qmp.ok(r#"{"execute":"cont"}"#);
    // The guest writes on while the export is copied.
    thread::sleep(Duration::from_secs(3));
    let out = run.path.join("backup.raw");
    common::nbdcopy_ok(&uri, &out);
    let list = common::ctl_ok(&ctl_sock, "backup-list", &[]);
    let copied = list["backups"][0]["copied_bytes"].as_u64().unwrap();
    assert!(
        copied > 0,
        "the guest wrote nothing during the backup: {list}"
    );
    common::assert_same(
        &fs::read(&out).unwrap(),
        &reference,
        "the backup under the guest",
    );
    println!("[backup] the export equals the disk at the begin; {copied} bytes copied before guest writes");
    common::ctl_ok(&ctl_sock, "backup-end", &["--checkpoint", "vm"]);
    // The guest finishes its workload (PASS) and powers off.
    let marks = g.finish();
    vublk.terminate(Duration::from_secs(20));
    let checked = check_blocks(&marks, &image, &guest.pattern, WRITERS, DISK);
    assert!(checked > 0, "no block checked");
}
