//! The NBD client driver: exports (`--blk-file nbd://HOST[:PORT]/EXPORT` or
//! `nbd+unix:///EXPORT?socket=PATH`) served like raw images. Its options (here), opening
//! (here: connect once to learn the export's size, flags and block sizes, check them, and
//! disconnect), the engine each queue runs its requests on (`engine`: one connection per
//! queue; `rx`: the replies), and one connection shared by all queues where the server
//! allows only one (`shared`). The image layer wraps an [`NbdDisk`] (`image::remote`).

mod engine;
mod shared;

pub use engine::NbdEngine;
pub use shared::{NbdConnection, NbdQueue};

use std::time::Duration;

use log::info;

use crate::nbd::wire::*;
use crate::nbd::{Export, NbdTarget};

/// `--nbd-timeout`, `--nbd-reconnect-delay`, `--nbd-reconnect-timeout`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NbdOptions {
    /// One connection attempt (connect and handshake) gives up after this long.
    pub timeout: Duration,
    /// Between reconnection attempts.
    pub reconnect_delay: Duration,
    /// Requests wait this long for a lost server to come back, then fail.
    pub reconnect_timeout: Duration,
}

impl Default for NbdOptions {
    fn default() -> Self {
        NbdOptions {
            timeout: Duration::from_secs(10),
            reconnect_delay: Duration::from_secs(2),
            reconnect_timeout: Duration::from_secs(60),
        }
    }
}

/// An NBD export being served: where it is, what it offers, how to reach it again.
pub struct NbdDisk {
    pub target: NbdTarget,
    pub export: Export,
    pub opts: NbdOptions,
    /// Served read-only (asked for, or the export is).
    pub read_only: bool,
    /// The server keeps written data in a cache until FLUSH (`SEND_FLUSH`).
    pub cached: bool,
}

/// Why an export cannot be served as the options ask.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    /// Unreachable, not NBD, no such export.
    #[error("{0}")]
    Connect(String),
    /// An option that does not fit the export (exit status 2).
    #[error("{0}")]
    Option(String),
}

/// Connect to `target`, check its export against the options (`read_only`, the guest's
/// `logical_block_size`), and disconnect.
pub fn open(
    target: NbdTarget,
    opts: NbdOptions,
    read_only: bool,
    logical_block_size: u32,
) -> Result<NbdDisk, OpenError> {
    let name = target.to_string();
    let (sock, export) = crate::nbd::connect(&target, opts.timeout)
        .map_err(|e| OpenError::Connect(e.to_string()))?;
    crate::nbd::disconnect(sock);
    let lbs = logical_block_size;
    if export.min_block > lbs {
        return Err(OpenError::Option(format!(
            "{name}: the server's minimum block size is {} bytes: serve it with \
             --logical-block-size {}",
            export.min_block,
            export.min_block.max(4096)
        )));
    }
    if export.size < u64::from(lbs) {
        return Err(OpenError::Option(format!(
            "{name}: {} bytes, smaller than one {lbs}-byte block",
            export.size
        )));
    }
    let read_only = read_only || export.has(FLAG_READ_ONLY);
    let cached = export.has(FLAG_SEND_FLUSH);
    info!(
        "{name}: {} bytes, {}, flags {:#x} (flush {}, fua {}, trim {}, write-zeroes {}, \
         multi-conn {}), block sizes {}/{}/{}",
        export.size,
        if read_only { "read-only" } else { "read-write" },
        export.flags,
        export.has(FLAG_SEND_FLUSH),
        export.has(FLAG_SEND_FUA),
        export.has(FLAG_SEND_TRIM),
        export.has(FLAG_SEND_WRITE_ZEROES),
        export.has(FLAG_CAN_MULTI_CONN),
        export.min_block,
        export.preferred_block,
        export.max_block
    );
    Ok(NbdDisk {
        target,
        export,
        opts,
        read_only,
        cached,
    })
}
