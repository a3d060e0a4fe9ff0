//! NBD exports (`--blk-file nbd://HOST[:PORT]/EXPORT` or `nbd+unix:///EXPORT?socket=PATH`):
//! served like raw images by the NBD engine (`io::NbdEngine`), one connection per queue
//! (or one shared by all queues, `io::NbdConnection`, where the server allows only one).
//! Opening connects once to learn the export's size, flags and block sizes, checks them
//! against the options, and disconnects; each queue connects on its own when a frontend
//! starts it.

use std::time::Duration;

use log::info;

use super::{Image, ImageOpenError, ImageOptions, Kind, RawFacts};
use crate::io::align::DioAlign;
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

/// An NBD export being served.
pub(super) struct NbdDisk {
    pub(super) target: NbdTarget,
    pub(super) export: Export,
    pub(super) opts: NbdOptions,
}

/// Connect to `target` and check its export against `opts`.
pub(super) fn open(
    opts: &ImageOptions,
    target: NbdTarget,
) -> Result<(Image, DioAlign, RawFacts), ImageOpenError> {
    let name = target.to_string();
    let (sock, export) = crate::nbd::connect(&target, opts.nbd.timeout)
        .map_err(|e| ImageOpenError::Remote(format!("{e} (is the server up? --blk-file)")))?;
    crate::nbd::disconnect(sock);
    let lbs = opts.logical_block_size;
    if export.min_block > lbs {
        return Err(ImageOpenError::Option(format!(
            "{name}: the server's minimum block size is {} bytes: serve it with \
             --logical-block-size {}",
            export.min_block,
            export.min_block.max(4096)
        )));
    }
    if export.size < u64::from(lbs) {
        return Err(ImageOpenError::Option(format!(
            "{name}: {} bytes, smaller than one {lbs}-byte block",
            export.size
        )));
    }
    let read_only = opts.read_only || export.has(FLAG_READ_ONLY);
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
    let facts = RawFacts {
        is_block_device: false,
        dev_ino: super::remote::identity(&name),
        file_size_bytes: export.size,
        // A server that takes FLUSH may hold written data in a cache until then.
        write_cache: Some(cached),
    };
    let size = export.size;
    let kind = Kind::Nbd(NbdDisk {
        target,
        export,
        opts: opts.nbd,
    });
    Ok((
        Image::remote(kind, size, read_only, true)?,
        DioAlign::NONE,
        facts,
    ))
}
