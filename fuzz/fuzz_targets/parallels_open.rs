//! Arbitrary bytes opened as a parallels image (read-only and read-write) in memory, then
//! mapped, read, written, zeroed, flushed and closed: no panic, no read past the end of the
//! file, bounded growth and memory. See vublk::image::fuzz.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    vublk::image::fuzz::parallels_open(data);
});
