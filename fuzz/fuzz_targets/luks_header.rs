//! Arbitrary bytes as a LUKS volume (either version): the header parsed and, where it asks
//! for cheap key derivation only, a key slot unlocked and the cipher run: no panic, reads
//! only inside the file, bounded time and memory. See vublk::crypt::fuzz.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    vublk::crypt::fuzz::header(data);
});
