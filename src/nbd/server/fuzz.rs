//! Fuzzing entry point (tests and `--features testing`): arbitrary bytes from a client, through
//! the handshake and the transmission phase, against an export in memory. Nothing may panic
//! or hang, and the replies stay bounded (the client end is read to the end by a thread).

use std::io::Read;
use std::os::unix::net::UnixStream;
use std::time::Duration;

use super::{conn, handshake, ClientStats, Export, ExportError};
use crate::nbd::handshake::Stream;
use crate::nbd::wire::{STATE_DIRTY, STATE_HOLE, STATE_ZERO};

/// 1 MiB: byte i is i % 251 in the first half, zeroes in the second; every other 64 KiB dirty.
pub struct MemExport(pub Vec<u8>);

impl MemExport {
    pub fn new() -> Self {
        let mut data: Vec<u8> = (0..1u32 << 20).map(|i| (i % 251) as u8).collect();
        data[1 << 19..].fill(0);
        MemExport(data)
    }
}

impl Default for MemExport {
    fn default() -> Self {
        Self::new()
    }
}

impl Export for MemExport {
    fn name(&self) -> &str {
        "mem"
    }
    fn size(&self) -> u64 {
        self.0.len() as u64
    }
    fn read(&self, offset: u64, dst: &mut [u8]) -> Result<(), ExportError> {
        let o = usize::try_from(offset).map_err(|_| ExportError::io("offset"))?;
        let src = self
            .0
            .get(o..o + dst.len())
            .ok_or_else(|| ExportError::io("outside"))?;
        dst.copy_from_slice(src);
        Ok(())
    }
    fn meta_contexts(&self) -> Vec<String> {
        vec!["base:allocation".into(), "qemu:dirty-bitmap:b".into()]
    }
    fn block_status(&self, c: &str, offset: u64, len: u32) -> Result<Vec<(u32, u32)>, ExportError> {
        let half = self.size() / 2;
        if c == "base:allocation" {
            return Ok(if offset < half {
                vec![((half - offset).min(u64::from(len)) as u32, 0)]
            } else {
                vec![(len, STATE_HOLE | STATE_ZERO)]
            });
        }
        let g = 65536;
        let n = (g - offset % g).min(u64::from(len)) as u32;
        Ok(vec![(
            n,
            if (offset / g) % 2 == 1 {
                STATE_DIRTY
            } else {
                0
            },
        )])
    }
}

/// One client session made of `data`.
pub fn session(data: &[u8]) {
    let Ok((server, mut client)) = UnixStream::pair() else {
        return;
    };
    let Ok(mut reader) = client.try_clone() else {
        return;
    };
    // The client's replies are read on one thread while its bytes are written on another
    // (neither side may block the other).
    let input = data.to_vec();
    let w = std::thread::spawn(move || {
        use std::io::Write;
        let _ = client.write_all(&input);
        let _ = client.shutdown(std::net::Shutdown::Write);
    });
    let t = std::thread::spawn(move || {
        let mut sink = [0u8; 65536];
        while let Ok(n) = reader.read(&mut sink) {
            if n == 0 {
                break;
            }
        }
    });
    let mut s = Stream::Unix(server);
    let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
    let _ = s.set_write_timeout(Some(Duration::from_secs(5)));
    static EXPORT: std::sync::LazyLock<MemExport> = std::sync::LazyLock::new(MemExport::new);
    let export = &*EXPORT;
    if let Ok(Some(session)) = handshake::negotiate(&mut s, export) {
        let stats = ClientStats::default();
        let total = std::sync::atomic::AtomicU64::new(0);
        let _ = conn::transmission(&mut s, export, &session, &stats, &total);
    }
    drop(s);
    let _ = w.join();
    let _ = t.join();
}
