//! Shared helpers for the integration tests: temporary directories and images, spawning the
//! backend under test (vublk, or qemu-storage-daemon when `VUBLK_TEST_BACKEND=qsd`), and a small
//! synchronous libblkio client.
//!
//! Nothing here sleeps for a fixed time to "let things settle": every wait polls a condition
//! against a deadline, and every backend process is guarded by a watchdog that kills it if a test
//! hangs (a killed backend makes the blocked libblkio call fail, so the test fails instead of
//! hanging).

#![allow(dead_code)] // each test binary uses a different subset

#[cfg(feature = "rbd")]
mod ceph;
mod chain;
mod client;
mod crash;
mod files;
mod frontend;
mod loopdev;
mod model;
mod nbd_server;
mod process;
mod qemu_img;
mod seccomp;
mod skip_log;
mod tmpfs;
mod writer;

// Each test binary uses a different subset.
#[cfg(feature = "rbd")]
#[allow(unused_imports)]
pub use ceph::*;
#[allow(unused_imports)]
pub use chain::*;
#[allow(unused_imports)]
pub use client::*;
#[allow(unused_imports)]
pub use crash::*;
#[allow(unused_imports)]
pub use files::*;
#[allow(unused_imports)]
pub use frontend::*;
#[allow(unused_imports)]
pub use loopdev::*;
#[allow(unused_imports)]
pub use model::*;
#[allow(unused_imports)]
pub use nbd_server::*;
#[allow(unused_imports)]
pub use process::*;
#[allow(unused_imports)]
pub use qemu_img::*;
#[allow(unused_imports)]
pub use seccomp::*;
pub use skip_log::log_skip;
#[allow(unused_imports)]
pub use tmpfs::*;
#[allow(unused_imports)]
pub use writer::*;

use std::time::Duration;

/// How long a backend may live before the watchdog kills it.
pub const BACKEND_WATCHDOG: Duration = Duration::from_secs(120);
/// How long to wait for the backend's socket to appear.
pub const SOCKET_DEADLINE: Duration = Duration::from_secs(20);
/// How long to keep retrying a client connection.
pub const CONNECT_DEADLINE: Duration = Duration::from_secs(20);
/// How long one batch of requests may take.
pub const IO_DEADLINE: Duration = Duration::from_secs(30);
/// How long the backend may take to exit after SIGTERM.
pub const EXIT_DEADLINE: Duration = Duration::from_secs(20);

pub const MIB: u64 = 1024 * 1024;

// ---------------------------------------------------------------------------------------------
// Which backend
// ---------------------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendKind {
    Vublk,
    Qsd,
}

/// The backend selected by `VUBLK_TEST_BACKEND` (`vublk`, the default, or `qsd`).
pub fn backend_kind() -> BackendKind {
    match std::env::var("VUBLK_TEST_BACKEND").as_deref() {
        Err(_) | Ok("") | Ok("vublk") => BackendKind::Vublk,
        Ok("qsd") => BackendKind::Qsd,
        Ok(other) => panic!("VUBLK_TEST_BACKEND={other:?}: expected `vublk` or `qsd`"),
    }
}

pub fn is_qsd() -> bool {
    backend_kind() == BackendKind::Qsd
}

/// For checks that only hold for vublk: returns true (and prints a note) under QSD.
pub fn skip_unless_vublk(what: &str) -> bool {
    if is_qsd() {
        eprintln!("note: skipping vublk-specific check under qemu-storage-daemon: {what}");
        log_skip(&format!("under qemu-storage-daemon: {what}"));
        true
    } else {
        false
    }
}

/// Skip where the machine lacks something, except under CI (`CI=true`), which must run it.
pub fn skip_or_fail<T>(why: &str) -> Option<T> {
    if std::env::var("CI").is_ok_and(|v| v == "true") {
        panic!("{why} (CI must run this test)");
    }
    println!("skipped: {why}");
    log_skip(why);
    None
}
