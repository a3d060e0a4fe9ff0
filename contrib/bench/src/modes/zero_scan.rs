//! `--zero-scan`: the all-zero scanner vublk's detect-zeroes uses (`vublk::zero`), on host
//! buffers: GB/s on all-zero buffers of 4 KiB to 1 MiB and on cache-cold 64 KiB pieces, and
//! the cost of rejecting data that is not zero.

use std::time::{Duration, Instant};

use vublk::zero::{is_zero, scanner_name};

/// The all-zero scanner on host buffers: GB/s on all-zero buffers (the whole buffer is read)
/// and the cost of rejecting non-zero data (usually the first sampled byte).
pub fn run() {
    println!("\nScanner: {}\n", scanner_name());
    println!("| buffer | all-zero GB/s | random data ns/call | one non-zero byte at 3/4 GB/s |");
    println!("|---:|---:|---:|---:|");
    for size in [4096usize, 64 << 10, 1 << 20] {
        let zero = vec![0u8; size];
        let mut data = vec![0u8; size];
        let mut x = 0x2545_f491_4f6c_dd1du64;
        for b in data.iter_mut() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            *b = (x as u8) | 1;
        }
        // Past the three sampled bytes (first, middle, last): forces a scan of 3/4.
        let mut last = vec![0u8; size];
        last[size * 3 / 4] = 1;
        let rate = |buf: &[u8], expect: bool| -> (f64, f64) {
            let t0 = Instant::now();
            let mut n = 0u64;
            while t0.elapsed() < Duration::from_millis(300) {
                for _ in 0..64 {
                    assert_eq!(is_zero(std::hint::black_box(buf)), expect);
                }
                n += 64;
            }
            let s = t0.elapsed().as_secs_f64();
            (n as f64 * buf.len() as f64 / s / 1e9, s * 1e9 / n as f64)
        };
        let (gbs, _) = rate(&zero, true);
        let (_, ns) = rate(&data, false);
        let (gbs_last, _) = rate(&last, false);
        println!(
            "| {} KiB | {gbs:.1} | {ns:.1} | {:.1} |",
            size >> 10,
            gbs_last * 0.75
        );
    }
    // Cache-cold: 64 KiB pieces of a 512 MiB zero buffer, as a guest write usually is.
    let big = vec![0u8; 512 << 20];
    // Touch it so pages exist (zero pages would all map one shared page).
    let mut big = big;
    for p in big.chunks_mut(4096) {
        p[0] = 1;
        p[0] = 0;
    }
    let t0 = Instant::now();
    let mut bytes = 0u64;
    while t0.elapsed() < Duration::from_millis(500) {
        for c in big.chunks(64 << 10) {
            assert!(is_zero(std::hint::black_box(c)));
            bytes += c.len() as u64;
        }
    }
    println!(
        "| 64 KiB pieces of 512 MiB (cache-cold) | {:.1} | | |",
        bytes as f64 / t0.elapsed().as_secs_f64() / 1e9
    );
}
