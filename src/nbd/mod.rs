//! NBD, vublk's own (no C library). The protocol library: URIs (`uri`), the fixed newstyle
//! handshake with structured replies and block-size constraints (`handshake`), and the
//! transmission phase's messages (`wire`); and the client driver that serves an export as a
//! disk (`client`: its options, opening, the per-queue engine, a shared connection); and
//! the server that exports a backup's point-in-time view (`server`), read-only.

pub mod client;
pub mod handshake;
pub mod server;
pub mod uri;
pub mod wire;

pub use handshake::{connect, disconnect, ConnectError, Export, Stream};
pub use uri::{is_nbd_uri, NbdAddr, NbdTarget};
