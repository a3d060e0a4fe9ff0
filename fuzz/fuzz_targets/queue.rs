//! Arbitrary bytes as a guest's virtqueue (ring, headers, data) processed by one queue worker
//! through the real request path against an in-memory image: no panic, no hang, the used
//! ring never ahead of the available one, read-only images never changed. See
//! vublk::worker::fuzz.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    vublk::worker::fuzz::queue(data);
});
