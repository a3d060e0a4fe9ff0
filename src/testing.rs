//! Test doubles, compiled only for tests and fuzzing (`--features testing`): image files in
//! memory that check how they are used ([`MemStorage`]) or lose what was not synced when
//! they "crash" ([`SimDisk`]), and a fresh qcow2 image to start from.

use std::io;
use std::path::PathBuf;
use std::sync::Mutex;

use crate::io::Storage;
use crate::locks::Locked;

/// How much an image may grow while being fuzzed.
const MAX_GROWTH: u64 = 64 << 20;

/// An image file in memory that checks how it is used.
pub struct MemStorage {
    bytes: Mutex<Vec<u8>>,
    limit: u64,
}

impl MemStorage {
    pub fn new(bytes: Vec<u8>) -> Self {
        let limit = bytes.len() as u64 + MAX_GROWTH;
        MemStorage {
            bytes: Mutex::new(bytes),
            limit,
        }
    }

    /// The bytes as they are now.
    pub fn lock(&self) -> std::sync::MutexGuard<'_, Vec<u8>> {
        self.bytes.locked()
    }
}

impl Storage for MemStorage {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        let b = self.lock();
        // Reads are 4 KiB-aligned, so they may start up to one block before the end; a read
        // starting further out followed a pointer that was never checked.
        assert!(
            offset <= (b.len() as u64).next_multiple_of(4096),
            "read at {offset:#x} past the end of a {:#x}-byte file",
            b.len()
        );
        let start = (offset as usize).min(b.len());
        let n = buf.len().min(b.len() - start);
        buf[..n].copy_from_slice(&b[start..start + n]);
        Ok(n)
    }

    fn write_all_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        let end = offset
            .checked_add(buf.len() as u64)
            .filter(|&e| e <= self.limit)
            .ok_or_else(|| io::Error::from_raw_os_error(libc::ENOSPC))?;
        let mut b = self.lock();
        if (b.len() as u64) < end {
            b.resize(end as usize, 0);
        }
        b[offset as usize..end as usize].copy_from_slice(buf);
        Ok(())
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        if len > self.limit {
            return Err(io::Error::from_raw_os_error(libc::ENOSPC));
        }
        self.lock().resize(len as usize, 0);
        Ok(())
    }

    fn size(&self) -> io::Result<u64> {
        Ok(self.lock().len() as u64)
    }

    fn sync_data(&self) -> io::Result<()> {
        Ok(())
    }

    fn allocate(&self, offset: u64, len: u64) -> io::Result<()> {
        let end = offset
            .checked_add(len)
            .filter(|&e| e <= self.limit)
            .ok_or_else(|| io::Error::from_raw_os_error(libc::ENOSPC))?;
        let mut b = self.lock();
        if (b.len() as u64) < end {
            b.resize(end as usize, 0);
        }
        Ok(())
    }

    fn punch_hole(&self, offset: u64, len: u64) -> io::Result<()> {
        let mut b = self.lock();
        let end = offset.saturating_add(len).min(b.len() as u64);
        if offset < end {
            b[offset as usize..end as usize].fill(0);
        }
        Ok(())
    }
}

/// A disk with a volatile write cache.
pub struct SimDisk {
    state: Mutex<SimState>,
}

struct SimState {
    /// What survives a crash for certain.
    durable: Vec<u8>,
    /// What reads see.
    current: Vec<u8>,
    /// Writes and size changes since the last sync, in order.
    pending: Vec<Pending>,
    /// `sync_data` calls so far.
    syncs: u64,
}

enum Pending {
    Write(u64, Vec<u8>),
    SetLen(u64),
}

fn apply(img: &mut Vec<u8>, p: &Pending) {
    match p {
        Pending::Write(off, data) => {
            let end = *off as usize + data.len();
            if img.len() < end {
                img.resize(end, 0);
            }
            img[*off as usize..end].copy_from_slice(data);
        }
        Pending::SetLen(len) => img.resize(*len as usize, 0),
    }
}

impl SimDisk {
    pub fn new(bytes: Vec<u8>) -> Self {
        SimDisk {
            state: Mutex::new(SimState {
                durable: bytes.clone(),
                current: bytes,
                pending: Vec::new(),
                syncs: 0,
            }),
        }
    }

    /// How many times the disk was synced.
    pub fn syncs(&self) -> u64 {
        self.state.locked().syncs
    }

    /// The disk after a power failure: the durable image plus the pending writes (in
    /// order) for which `survives()` says yes.
    pub fn crash(&self, mut survives: impl FnMut() -> bool) -> Vec<u8> {
        let st = self.state.locked();
        let mut img = st.durable.clone();
        for p in &st.pending {
            if survives() {
                apply(&mut img, p);
            }
        }
        img
    }
}

impl Storage for SimDisk {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        let st = self.state.locked();
        let start = (offset as usize).min(st.current.len());
        let n = buf.len().min(st.current.len() - start);
        buf[..n].copy_from_slice(&st.current[start..start + n]);
        Ok(n)
    }

    fn write_all_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        let mut st = self.state.locked();
        let p = Pending::Write(offset, buf.to_vec());
        apply(&mut st.current, &p);
        st.pending.push(p);
        Ok(())
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        let mut st = self.state.locked();
        let p = Pending::SetLen(len);
        apply(&mut st.current, &p);
        st.pending.push(p);
        Ok(())
    }

    fn size(&self) -> io::Result<u64> {
        Ok(self.state.locked().current.len() as u64)
    }

    fn allocate(&self, offset: u64, len: u64) -> io::Result<()> {
        let mut st = self.state.locked();
        let end = offset + len;
        if end > st.current.len() as u64 {
            let p = Pending::SetLen(end);
            apply(&mut st.current, &p);
            st.pending.push(p);
        }
        Ok(())
    }

    fn punch_hole(&self, offset: u64, len: u64) -> io::Result<()> {
        let mut st = self.state.locked();
        let end = (offset + len).min(st.current.len() as u64);
        if offset < end {
            let p = Pending::Write(offset, vec![0; (end - offset) as usize]);
            apply(&mut st.current, &p);
            st.pending.push(p);
        }
        Ok(())
    }

    fn sync_data(&self) -> io::Result<()> {
        let mut st = self.state.locked();
        st.syncs += 1;
        let pending = std::mem::take(&mut st.pending);
        for p in &pending {
            apply(&mut st.durable, p);
        }
        Ok(())
    }
}

/// A fresh 8 MiB qcow2 image with 64 KiB clusters made by `vublk create`, at a temporary
/// path under `target/unit-tmp` (the caller removes it).
pub fn fresh_qcow2(tag: &str, compression: crate::image::qcow2::Compression) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/unit-tmp");
    let _ = std::fs::create_dir_all(&dir);
    let p = dir.join(format!("fresh-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_file(&p);
    let params = crate::image::create::CreateParams {
        parallels_cluster: None,
        qcow2: true,
        size_bytes: 8 << 20,
        cluster_bits: 16,
        compression,
        extended_l2: false,
        backing: None,
        encrypt: None,
    };
    if let Err(e) = crate::image::create::create(&p, &params) {
        panic!("creating {}: {e}", p.display());
    }
    p
}

/// [`fresh_qcow2`]'s bytes (the file removed again).
pub fn fresh_qcow2_bytes(tag: &str, compression: crate::image::qcow2::Compression) -> Vec<u8> {
    let p = fresh_qcow2(tag, compression);
    let b = std::fs::read(&p).unwrap_or_else(|e| panic!("reading {}: {e}", p.display()));
    let _ = std::fs::remove_file(&p);
    b
}

/// xorshift64: a fixed, seedable sequence for randomized tests, without a dependency (the
/// same seed replays the same script).
pub struct XorShift(pub u64);

impl XorShift {
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// In `0..n` (n > 0; the modulo bias does not matter here).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
}

#[path = "../tests/common/skip_log.rs"]
mod skip_log;

/// A test that cannot run here says so: on stdout (shown with `--nocapture`) and in
/// `$VUBLK_SKIP_LOG`, so that the suite's summary lists it instead of counting it as a pass.
pub fn note_skip(why: &str) {
    println!("skipped: {why}");
    skip_log::log_skip(why);
}

/// A directory of its own under the temporary directory, removed with everything in it when
/// dropped.
#[derive(Debug)]
pub struct TempDir(std::path::PathBuf);

impl TempDir {
    pub fn new(what: &str) -> io::Result<TempDir> {
        static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let p = std::env::temp_dir().join(format!("vublk-{what}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p)?;
        Ok(TempDir(p))
    }

    pub fn path(&self) -> &std::path::Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
