//! Arbitrary bytes from an NBD client through vublk's NBD server (the handshake, then the
//! transmission phase) against an export in memory: no panic, no hang, bounded replies. See
//! vublk::nbd::server::fuzz.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    vublk::nbd::server::fuzz::session(data);
});
