//! An NBD client of vublk's own (no C library): URIs (`uri`), the fixed newstyle handshake
//! with structured replies and block-size constraints (`handshake`), and the transmission
//! phase's messages (`wire`).
//!
//! Groundwork for serving `--blk-file nbd://...` (issue 19): the engine that runs requests
//! on each queue's own loop is not written yet.

pub mod handshake;
pub mod uri;
pub mod wire;

pub use handshake::{connect, ConnectError, Export, Stream};
pub use uri::{is_nbd_uri, NbdAddr, NbdTarget};
