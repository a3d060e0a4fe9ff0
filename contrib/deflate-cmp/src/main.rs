//! Compress qcow2 clusters (64 KiB) the way vublk's zlib compression type needs them: raw
//! deflate that QEMU inflates with a 4 KiB window (`inflateInit2(-12)`), at the default
//! level. One implementation per build (see README.md in this directory); prints one
//! Markdown row per data set: single-thread MB/s, compressed size, and how many clusters a
//! 4 KiB-window inflate reads back correctly.
//!
//! Usage: deflate-cmp [MiB of data, default 256]

use std::fs;
use std::path::PathBuf;
use std::time::Instant;

const CLUSTER: usize = 64 << 10;

/// The same data as vublk-bench --compress-fill: a constant byte, or /usr's files in path order.
fn data(kind: &str, len: usize) -> Vec<u8> {
    if kind == "ones" {
        return vec![1u8; len];
    }
    let mut dirs = vec![PathBuf::from("/usr")];
    let mut files = Vec::new();
    while let Some(d) = dirs.pop() {
        let Ok(rd) = fs::read_dir(&d) else { continue };
        for e in rd.filter_map(Result::ok) {
            match e.file_type() {
                Ok(t) if t.is_dir() => dirs.push(e.path()),
                Ok(t) if t.is_file() => files.push(e.path()),
                _ => {}
            }
        }
    }
    files.sort();
    let mut out = Vec::with_capacity(len);
    'outer: loop {
        for f in &files {
            if let Ok(b) = fs::read(f) {
                let n = b.len().min(len - out.len());
                out.extend_from_slice(&b[..n]);
                if out.len() == len {
                    break 'outer;
                }
            }
        }
    }
    out
}

#[cfg(feature = "zlib-rs-memlevel9")]
fn name() -> &'static str {
    "zlib-rs, memLevel 9 (QEMU's parameters)"
}

#[cfg(feature = "zlib-rs-memlevel9")]
fn compress(input: &[u8], out: &mut Vec<u8>) -> bool {
    use zlib_rs::{compress_slice, DeflateConfig, Method, Strategy};
    let config = DeflateConfig {
        level: 6,
        method: Method::Deflated,
        window_bits: -12,
        mem_level: 9,
        strategy: Strategy::Default,
    };
    out.resize(CLUSTER + 1024, 0);
    let (z, rc) = compress_slice(out, input, config);
    let n = z.len();
    out.truncate(n);
    rc == zlib_rs::ReturnCode::Ok
}

#[cfg(not(any(feature = "libdeflate", feature = "zlib-rs-memlevel9")))]
fn name() -> &'static str {
    if cfg!(feature = "zlib-ng") {
        "zlib-ng (flate2 zlib-ng)"
    } else if cfg!(feature = "zlib") {
        "zlib (system libz)"
    } else {
        "zlib-rs (flate2 zlib-rs)"
    }
}

#[cfg(not(any(feature = "libdeflate", feature = "zlib-rs-memlevel9")))]
fn compress(input: &[u8], out: &mut Vec<u8>) -> bool {
    out.clear();
    let mut z = flate2::Compress::new_with_window_bits(flate2::Compression::default(), false, 12);
    matches!(
        z.compress_vec(input, out, flate2::FlushCompress::Finish),
        Ok(flate2::Status::StreamEnd)
    )
}

#[cfg(feature = "libdeflate")]
fn name() -> &'static str {
    "libdeflate (32 KiB window only)"
}

#[cfg(feature = "libdeflate")]
fn compress(input: &[u8], out: &mut Vec<u8>) -> bool {
    thread_local! {
        static C: std::cell::RefCell<libdeflater::Compressor> =
            std::cell::RefCell::new(libdeflater::Compressor::new(libdeflater::CompressionLvl::default()));
    }
    out.resize(out.capacity(), 0);
    C.with(|c| match c.borrow_mut().deflate_compress(input, out) {
        Ok(n) => {
            out.truncate(n);
            true
        }
        Err(_) => false,
    })
}

/// What QEMU does to read a compressed cluster: raw inflate with a 4 KiB window.
fn inflates_with_4k_window(z: &[u8], want: &[u8]) -> bool {
    let mut d = flate2::Decompress::new_with_window_bits(false, 12);
    let mut out = Vec::with_capacity(CLUSTER);
    matches!(
        d.decompress_vec(z, &mut out, flate2::FlushDecompress::Finish),
        Ok(flate2::Status::StreamEnd) | Ok(flate2::Status::Ok)
    ) && out == want
}

fn main() {
    let mib: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(256);
    for kind in ["ones", "mix"] {
        let input = data(kind, mib << 20);
        let mut out = Vec::with_capacity(CLUSTER);
        let mut chunks = Vec::with_capacity(input.len() / CLUSTER);
        let t0 = Instant::now();
        for c in input.chunks(CLUSTER) {
            // Stored normally when it does not compress below the cluster size.
            let ok = compress(c, &mut out) && out.len() < CLUSTER;
            chunks.push(ok.then(|| out.clone()));
        }
        let secs = t0.elapsed().as_secs_f64();
        let stored: usize = chunks
            .iter()
            .map(|c| c.as_ref().map_or(CLUSTER, Vec::len))
            .sum();
        let readable = chunks
            .iter()
            .zip(input.chunks(CLUSTER))
            .filter(|(z, c)| z.as_ref().is_none_or(|z| inflates_with_4k_window(z, c)))
            .count();
        println!(
            "| {} | {kind} | {:.0} | {:.1} | {} of {} |",
            name(),
            input.len() as f64 / secs / 1e6,
            stored as f64 / (1 << 20) as f64,
            readable,
            chunks.len()
        );
    }
}
