//! vublk: a vhost-user-blk backend daemon.
//!
//! Map of the crate:
//! - `args`: clap definitions only.
//! - `config`: validated configuration; every option conflict is rejected here.
//! - `daemon`: listener / `--fd`, reconnect loop, signals, wiring.
//! - `backend`: `VhostUserBackend` impl: features, config space, event dispatch.
//! - `worker`: per-queue data plane: pop, parse, submit, reap, complete.
//! - `device`: the virtio-blk device model (limits, config space, write cache state).
//! - `virtio_blk`: request parsing and status mapping (no image, no io_uring).
//! - `image`: disk images (raw).
//! - `zero`: all-zero detection over guest memory (detect-zeroes).
//! - `offload`: a thread pool for work too slow for a queue thread (compressed writes).
//! - `io`: I/O engines (io_uring, blocking), O_DIRECT alignment probe, bounce buffers.

pub mod args;
pub mod backend;
pub mod config;
pub mod daemon;
pub mod device;
pub mod image;
pub mod io;
pub mod offload;
pub mod ratelimit;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
pub mod virtio_blk;
pub mod worker;
pub mod zero;
