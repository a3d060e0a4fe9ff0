//! Temporary directories, images, data patterns, a PRNG, and assertions on bytes and files.

use std::fs::{self, File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::thread;

use super::MIB;

/// A fresh directory under `CARGO_TARGET_TMPDIR`, removed on drop unless the test panicked (then
/// it is kept, and its path printed, for post-mortem).
pub struct TestDir {
    pub path: PathBuf,
}

impl TestDir {
    pub fn new(name: &str) -> TestDir {
        let mut base = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
        // sun_path is 108 bytes; keep the socket path well inside it.
        if base.as_os_str().len() + name.len() + 40 > 100 {
            base = std::env::temp_dir();
        }
        let path = base.join(format!("vublk-it-{}-{}", name, std::process::id()));
        let _ = fs::remove_dir_all(&path);
        fs::create_dir_all(&path).unwrap_or_else(|e| panic!("mkdir {}: {e}", path.display()));
        TestDir { path }
    }

    pub fn join(&self, name: &str) -> PathBuf {
        self.path.join(name)
    }
}

impl Drop for TestDir {
    fn drop(&mut self) {
        if thread::panicking() {
            eprintln!("keeping test directory {}", self.path.display());
        } else {
            let _ = fs::remove_dir_all(&self.path);
        }
    }
}

/// A sparse image of `size` bytes.
pub fn create_sparse_image(path: &Path, size: u64) {
    let f = File::create(path).unwrap_or_else(|e| panic!("create {}: {e}", path.display()));
    f.set_len(size).unwrap();
}

/// A fully allocated image of `size` bytes whose content is `pattern_fill(_, 0, seed)`.
pub fn create_pattern_image(path: &Path, size: u64, seed: u64) {
    let mut f = File::create(path).unwrap_or_else(|e| panic!("create {}: {e}", path.display()));
    let mut buf = vec![0u8; MIB as usize];
    let mut off = 0;
    while off < size {
        let n = (size - off).min(MIB) as usize;
        pattern_fill(&mut buf[..n], off, seed);
        f.write_all(&buf[..n]).unwrap();
        off += n as u64;
    }
    f.sync_all().unwrap();
}

/// A fully allocated image of `size` bytes, every byte `byte`.
pub fn create_filled_image(path: &Path, size: u64, byte: u8) {
    let mut f = File::create(path).unwrap_or_else(|e| panic!("create {}: {e}", path.display()));
    let buf = vec![byte; MIB as usize];
    let mut off = 0;
    while off < size {
        let n = (size - off).min(MIB) as usize;
        f.write_all(&buf[..n]).unwrap();
        off += n as u64;
    }
    f.sync_all().unwrap();
}

/// Deterministic position-dependent content: byte `i` of `buf` is the content of absolute
/// offset `offset + i` for this `seed`, so misplaced data is detected.
pub fn pattern_fill(buf: &mut [u8], offset: u64, seed: u64) {
    for (i, b) in buf.iter_mut().enumerate() {
        let o = offset + i as u64;
        let word = splitmix64((o >> 3) ^ seed.rotate_left(17));
        *b = (word >> ((o & 7) * 8)) as u8;
    }
}

pub fn pattern(len: usize, offset: u64, seed: u64) -> Vec<u8> {
    let mut v = vec![0u8; len];
    pattern_fill(&mut v, offset, seed);
    v
}

pub fn read_file(path: &Path) -> Vec<u8> {
    fs::read(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

pub fn read_file_range(path: &Path, offset: u64, len: usize) -> Vec<u8> {
    let mut f = File::open(path).unwrap();
    f.seek(SeekFrom::Start(offset)).unwrap();
    let mut v = vec![0u8; len];
    f.read_exact(&mut v).unwrap();
    v
}

pub fn write_file_range(path: &Path, offset: u64, data: &[u8]) {
    let mut f = OpenOptions::new().write(true).open(path).unwrap();
    f.seek(SeekFrom::Start(offset)).unwrap();
    f.write_all(data).unwrap();
    f.sync_all().unwrap();
}

/// Allocated 512-byte blocks of a file (`st_blocks`).
pub fn allocated_blocks(path: &Path) -> u64 {
    fs::metadata(path).unwrap().blocks()
}

pub fn file_size(path: &Path) -> u64 {
    fs::metadata(path).unwrap().len()
}

/// Index of the first differing byte, for readable assertion messages on big buffers.
pub fn first_difference(a: &[u8], b: &[u8]) -> Option<usize> {
    if a.len() != b.len() {
        return Some(a.len().min(b.len()));
    }
    a.iter().zip(b).position(|(x, y)| x != y)
}

#[track_caller]
pub fn assert_same(actual: &[u8], expected: &[u8], what: &str) {
    if let Some(i) = first_difference(actual, expected) {
        panic!(
            "{what}: first difference at byte {i} (lengths {} vs {}): got {:?}, expected {:?}",
            actual.len(),
            expected.len(),
            actual.get(i..(i + 16).min(actual.len())),
            expected.get(i..(i + 16).min(expected.len())),
        );
    }
}

#[track_caller]
pub fn assert_all_zero(data: &[u8], what: &str) {
    if let Some(i) = data.iter().position(|&b| b != 0) {
        panic!(
            "{what}: byte {i} of {} is {:#04x}, expected zero",
            data.len(),
            data[i]
        );
    }
}

pub fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// splitmix64 sequence generator.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        splitmix64(self.0)
    }

    /// Uniform in `0..n` (n > 0; the modulo bias is irrelevant here).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }

    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi - lo + 1)
    }

    pub fn fill(&mut self, buf: &mut [u8]) {
        for chunk in buf.chunks_mut(8) {
            let w = self.next_u64().to_le_bytes();
            chunk.copy_from_slice(&w[..chunk.len()]);
        }
    }
}
