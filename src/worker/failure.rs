//! The one place a request's failure becomes a virtio status and a log line. Guest faults
//! (a malformed chain, `RequestError`) carry their own status and are logged at debug;
//! host faults are IOERR and logged at error. Every line is rate-limited per call site, so
//! a guest or a failing disk cannot flood the log.

use std::io;

use log::Level;

use crate::image::ImageError;
use crate::log_limited;
use crate::logging::error_chain as chain;
use crate::virtio_blk::{status, RequestError};

use super::slot::{OpKind, SlotId};
use super::QueueWorker;

/// Why a request failed on the host side.
#[derive(Debug, thiserror::Error)]
pub(super) enum Failure {
    #[error("{what} at {offset} failed")]
    Image {
        what: &'static str,
        offset: u64,
        #[source]
        source: ImageError,
    },
    #[error("{what} failed")]
    Io {
        what: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("{kind:?} failed")]
    Op {
        kind: Option<OpKind>,
        #[source]
        source: io::Error,
    },
    #[error("{what} of {len} bytes at {offset} needs file blocks past the end of the image")]
    PastEnd {
        what: &'static str,
        offset: u64,
        len: u64,
    },
    #[error("a planned read does not cover the request")]
    BadPlan,
    #[error("the request's guest memory went away (the frontend's memory file shrank)")]
    GuestMemoryGone,
    #[error(
        "refused a guest write that would make this probed raw image look like another \
         format (use --format raw to allow it)"
    )]
    PlantedHeader,
}

impl Failure {
    /// The status byte the guest gets (5.2.6: IOERR for every device or driver error that
    /// is not an unsupported request).
    pub fn status(&self) -> u8 {
        status::IOERR
    }

    /// The host errno behind it, for the error policy (None: the guest's fault or one no
    /// retry fixes: never held).
    pub fn errno(&self) -> Option<i32> {
        match self {
            Failure::Image { source, .. } => image_errno(source),
            Failure::Io { source, .. } | Failure::Op { source, .. } => source.raw_os_error(),
            Failure::PastEnd { .. }
            | Failure::BadPlan
            | Failure::GuestMemoryGone
            | Failure::PlantedHeader => None,
        }
    }

    fn level(&self) -> Level {
        match self {
            // The guest's doing, and the operator can lift it.
            Failure::PlantedHeader => Level::Warn,
            _ => Level::Error,
        }
    }
}

/// The errno of an image error the error policy may hold (None: the image's state, which
/// no retry changes).
pub(super) fn image_errno(e: &ImageError) -> Option<i32> {
    match e {
        ImageError::Io(e) => Some(e.raw_os_error().unwrap_or(libc::EIO)),
        ImageError::CompressedDataLost => Some(libc::EIO),
        ImageError::Corrupt(_)
        | ImageError::ReadOnly
        | ImageError::Full
        | ImageError::Unsupported(_)
        | ImageError::Inactive => None,
    }
}

impl QueueWorker {
    /// Fail the request in slot `id` with `f` (its status set, the failure noted for the
    /// error policy and logged, unless the policy will hold it: `hold` logs that).
    pub(super) fn fail(&mut self, id: SlotId, f: Failure) {
        let errno = f.errno();
        if !self.would_hold(id, errno) {
            self.report(&f);
        }
        if let Some(r) = self.slots.busy(id) {
            r.status = f.status();
            r.note_failure(errno);
        }
    }

    /// Log a host failure of this queue (rate-limited).
    pub(super) fn report(&self, f: &Failure) {
        let line = chain(f);
        match f.level() {
            Level::Warn => log_limited!(Level::Warn, "queue {}: {line}", self.index),
            _ => log_limited!(Level::Error, "queue {}: {line}", self.index),
        }
    }

    /// Log a request the guest got wrong (rate-limited, at debug).
    pub(super) fn report_guest(&self, head: u16, e: &RequestError) {
        log_limited!(
            Level::Debug,
            "queue {}: request {head} refused: {e}",
            self.index
        );
    }
}

/// A pool thread's failure (no queue worker at hand), rate-limited like the others.
pub(super) fn report_offloaded(queue: u16, f: &Failure) {
    log_limited!(Level::Error, "queue {queue}: {}", chain(f));
}
