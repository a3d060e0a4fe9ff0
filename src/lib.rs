//! vublk: a vhost-user-blk backend daemon.
//!
//! Map of the crate, one line per module (a request's path: `worker` -> `virtio_blk` ->
//! `zero` -> `image` -> `io` -> `worker`; ARCHITECTURE.md has the whole map, the
//! invariants and the lock order):
//! - `args`: clap definitions only (validation lives in `config`).
//! - `assets`: the generated files a package installs (man page, shell completions, the
//!   vhost-user backend descriptor), from the same definitions the binary uses.
//! - `backend`: the `VhostUserBackend` impl: features, config space, event dispatch.
//! - `backup`: backups of the running disk: a point-in-time view by copy-before-write,
//!   exported over NBD, begun between two guest requests with its checkpoint.
//! - `bitmaps`: changed-block tracking: the disk's dirty bitmaps, marked by every queue
//!   without a shared lock, and their `bitmap-*` control methods.
//! - `config`: validated configuration; every option conflict is rejected here.
//! - `control`: the control socket (JSON-RPC 2.0, one object per line) and `vublk ctl`.
//! - `crypt`: encryption at rest: LUKS1/LUKS2 headers, key slots and their KDFs, AES-XTS
//!   over sectors, and secrets kept out of swap, core dumps and messages.
//! - `daemon`: opens the device; listener or `--fd`, one frontend after another, signals.
//! - `device`: the virtio-blk device model (limits, config space, write cache) over an image.
//! - `guest_memory`: the frontend's memory checked when it changes, and the SIGBUS guard.
//! - `http`: the metrics endpoint's small HTTP/1.1 server, with bounded connections, request
//!   heads and time.
//! - `image`: disk images behind one `Image` interface (raw, qcow2, parallels, backing files,
//!   and the remote disks: NBD exports, RBD images).
//! - `inflight`: the inflight region (vhost-user INFLIGHT_SHMFD): which requests a queue has
//!   taken, kept by the frontend across restarts, and their recovery.
//! - `io`: I/O engines, O_DIRECT alignment, bounce buffers, raw system calls (no formats).
//! - `locks`: mutexes and read-write locks taken ignoring poisoning, in one place.
//! - `logging`: rate-limited logging for the data path, error chains on one line.
//! - `metrics`: the Prometheus / OpenMetrics endpoint (`--metrics-addr`), read at each scrape.
//! - `nbd`: NBD, vublk's own: the protocol (URIs, handshake, wire), the client driver, and
//!   the read-only server that exports backups.
//! - `offload`: thread pools for work too slow for a queue thread; results come back through
//!   the queue's completion eventfd.
//! - `rbd`: the Ceph RBD driver: its options (always built), and with the feature `rbd`
//!   librbd (connecting, locking, the update watch, asynchronous I/O from the guest's
//!   iovecs), an image being served, and its engine.
//! - `service`: running under a service manager: systemd notification, socket activation,
//!   `--pidfile`, the limit of open files.
//! - `stats`: per-queue request counters for `stats` and the metrics, written by the queue's
//!   thread only.
//! - `testing`: test doubles (in-memory and crash-simulating disks), tests and fuzzing only.
//! - `throttle`: the I/O limits, token buckets shared by all queues of a device.
//! - `top`: `vublk ctl top`, the live per-queue view from two `stats` answers.
//! - `virtio_blk`: request parsing and the status of guest faults (no image, no io_uring).
//! - `watchdog`: each queue's requests in flight, their age and what they wait for, and the
//!   thread that logs stuck ones.
//! - `worker`: the per-queue data plane: pop, parse, plan, submit, reap, complete.
//! - `zero`: all-zero detection over guest memory (detect-zeroes).

pub mod args;
pub mod assets;
pub mod backend;
pub mod backup;
pub mod bitmaps;
pub mod config;
pub mod control;
pub mod crypt;
pub mod daemon;
pub mod device;
pub mod guest_memory;
pub mod hold;
pub mod http;
pub mod image;
pub mod inflight;
pub mod io;
pub mod jobs;
pub mod locks;
pub mod logging;
pub mod metrics;
pub mod nbd;
pub mod offload;
pub mod rbd;
pub mod service;
pub mod snapshot;
pub mod stats;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
pub mod throttle;
pub mod top;
pub mod units;
pub mod virtio_blk;
pub mod watchdog;
pub mod worker;
pub mod zero;
