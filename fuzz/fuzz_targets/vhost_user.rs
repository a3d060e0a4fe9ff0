//! Arbitrary vhost-user message streams (some carrying a memfd or an eventfd) sent to a real
//! VhostUserDaemon running vublk's backend: the connection ends, nothing panics or hangs.
//! See vublk::backend::fuzz.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    vublk::backend::fuzz::messages(data);
});
