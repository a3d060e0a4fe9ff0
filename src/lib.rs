//! vublk: a vhost-user-blk backend daemon.
//!
//! Map of the crate, one line per module (a request's path: `worker` -> `virtio_blk` ->
//! `zero` -> `image` -> `io` -> `worker`):
//! - `args`: clap definitions only.
//! - `config`: validated configuration; every option conflict is rejected here.
//! - `daemon`: opens the device; listener or `--fd`, one frontend after another, signals.
//! - `backend`: the `VhostUserBackend` impl: features, config space, event dispatch.
//! - `worker`: the per-queue data plane: pop, parse, plan, submit, reap, complete.
//! - `device`: the virtio-blk device model (limits, config space, write cache) over an image.
//! - `guest_memory`: the frontend's memory checked when it changes, and the SIGBUS guard.
//! - `inflight`: the inflight region (vhost-user INFLIGHT_SHMFD): which requests a queue has
//!   taken, kept by the frontend across restarts, and their recovery.
//! - `virtio_blk`: request parsing and the status of guest faults (no image, no io_uring).
//! - `zero`: all-zero detection over guest memory (detect-zeroes).
//! - `image`: disk images behind one `Image` interface (raw, qcow2, parallels, backing files).
//! - `io`: I/O engines, O_DIRECT alignment, bounce buffers, raw system calls (no formats).
//! - `offload`: thread pools for writes too slow for a queue thread.
//! - `metrics`, `http`: the Prometheus endpoint, and its small HTTP server with bounded
//!   connections, request heads and time.
//! - `logging`: rate-limited logging for the data path, error chains on one line.
//! - `testing`: test doubles (in-memory and crash-simulating disks), tests and fuzzing only.

pub mod args;
pub mod assets;
pub mod backend;
pub mod config;
pub mod control;
pub mod daemon;
pub mod device;
pub mod guest_memory;
pub mod http;
pub mod image;
pub mod inflight;
pub mod io;
pub mod locks;
pub mod logging;
pub mod metrics;
pub mod nbd;
pub mod offload;
pub mod rbd;
pub mod service;
pub mod stats;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
pub mod throttle;
pub mod top;
pub mod virtio_blk;
pub mod watchdog;
pub mod worker;
pub mod zero;
