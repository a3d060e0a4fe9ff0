//! An NBD client of vublk's own (no C library): URIs (`uri`), the fixed newstyle handshake
//! with structured replies and block-size constraints (`handshake`), and the transmission
//! phase's messages (`wire`).
//!
//! The engine that runs requests on each queue's own loop is `io::NbdEngine`; the image kind
//! (size, flags, options) is `image::nbd`.

pub mod handshake;
pub mod uri;
pub mod wire;

pub use handshake::{connect, disconnect, ConnectError, Export, Stream};
pub use uri::{is_nbd_uri, NbdAddr, NbdTarget};
