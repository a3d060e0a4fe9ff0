//! Fuzzing entry point for the data plane: arbitrary bytes become a guest's memory (a split
//! ring's descriptor table and available ring, request headers, data and range lists) and
//! the available index; one queue worker processes it through the real request path
//! (parse, header guard, zero check, image plan, engine, completion) against an in-memory
//! raw image (a memfd) with the blocking engine. Nothing may panic or hang, the used ring
//! never claims more entries than were made available, and the image only changes where
//! the input asked for writes (checked: read-only devices never change).

use std::fs::File;
use std::os::fd::FromRawFd;
use std::sync::Arc;

use vhost_user_backend::{VringRwLock, VringT};
use vm_memory::{Bytes, GuestAddress, GuestMemoryAtomic};

use super::QueueWorker;
use crate::device::CacheMode;
use crate::device::{Device, DeviceParams};
use crate::image::Engine;
use crate::image::Image;
use crate::io::align::DioAlign;
use crate::io::SyncEngine;
use crate::zero::DetectZeroes;

/// Guest memory: the first part holds the ring, the rest whatever the input says.
const MEM: usize = 0x4_0000;
const DESC: u64 = 0;
const AVAIL: u64 = 0x1000;
const USED: u64 = 0x2000;
/// Entries of the ring (queue size).
const QSIZE: u16 = 16;
/// The image: small, so that every sector the input names can be checked.
const IMAGE: u64 = 256 << 10;

fn memfd_image(bytes: &[u8]) -> Option<File> {
    // SAFETY: plain system call with a valid C string; the result is checked.
    let fd = unsafe { libc::memfd_create(c"vublk-fuzz".as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return None;
    }
    // SAFETY: a fresh descriptor nothing else owns.
    let f = unsafe { File::from_raw_fd(fd) };
    std::os::unix::fs::FileExt::write_all_at(&f, bytes, 0).ok()?;
    Some(f)
}

/// Run one input (see the module docs); the used ring's index afterwards. Input: byte 0 flags (bit 0 read-only, bit 1
/// detect-zeroes unmap with discard unmap, bit 2 EVENT_IDX, bit 3 a second kick with the
/// available index moved), bytes 1..3 the available index, the rest guest memory from
/// address 0 (the used ring is the device's: it starts out zero).
pub fn queue(data: &[u8]) -> u16 {
    let Some((&flags, rest)) = data.split_first() else {
        return 0;
    };
    let (idx, guest) = rest.split_at(rest.len().min(2));
    let avail_idx = u16::from_le_bytes([
        idx.first().copied().unwrap_or(0),
        idx.get(1).copied().unwrap_or(0),
    ]);
    let read_only = flags & 1 != 0;
    let unmap = flags & 2 != 0;
    let Ok(mem) = crate::guest_memory::Mem::from_ranges(&[(GuestAddress(0), MEM)]) else {
        return 0;
    };
    let n = guest.len().min(MEM);
    let _ = mem.write_slice(&guest[..n], GuestAddress(0));
    let _ = mem.write_slice(&[0u8; 6 + 8 * QSIZE as usize], GuestAddress(USED));
    let _ = mem.write_obj(avail_idx, GuestAddress(AVAIL + 2));
    let atomic = GuestMemoryAtomic::new(mem.clone());
    let Ok(vring) = VringRwLock::new(atomic.clone(), QSIZE) else {
        return 0;
    };
    vring.set_queue_size(QSIZE);
    if vring.set_queue_info(DESC, AVAIL, USED).is_err() {
        return 0;
    }
    vring.set_queue_event_idx(flags & 4 != 0);
    vring.set_queue_ready(true);
    vring.set_enabled(true);

    let original: Vec<u8> = (0..IMAGE).map(|i| (i * 7 + (i >> 9)) as u8).collect();
    let Some(file) = memfd_image(&original) else {
        return 0;
    };
    let Ok(check) = file.try_clone() else {
        return 0;
    };
    let params = DeviceParams {
        logical_block_size: 512,
        read_only,
        num_queues: 1,
        queue_size: QSIZE,
        cache: CacheMode::Writeback,
        align: DioAlign::NONE,
        serial: b"fuzz".to_vec(),
        detect_zeroes: if unmap {
            DetectZeroes::Unmap
        } else {
            DetectZeroes::On
        },
        discard_unmap: unmap,
        is_block_device: false,
    };
    let image = Image::raw(file, IMAGE, read_only).guard_format_header(true);
    let dev = Arc::new(Device::new(image, params));
    let mut w = QueueWorker::new(0, dev, Engine::Sync(SyncEngine::new()), atomic);
    w.handle_kick(&vring);
    if flags & 8 != 0 {
        let _ = mem.write_obj(avail_idx.wrapping_add(QSIZE), GuestAddress(AVAIL + 2));
        w.handle_kick(&vring);
    }
    w.drain();
    drop(w);

    // The device never claims more chains than the driver made available (and none from a
    // ring whose available index runs more than a ring's worth ahead).
    let used: u16 = mem.read_obj(GuestAddress(USED + 2)).unwrap_or(0);
    let most = if avail_idx > QSIZE {
        0
    } else if flags & 8 != 0 {
        avail_idx + QSIZE
    } else {
        avail_idx
    };
    assert!(
        used <= most,
        "used index {used} for avail index {avail_idx}"
    );
    if read_only {
        let mut now = vec![0u8; IMAGE as usize];
        let _ = std::os::unix::fs::FileExt::read_exact_at(&check, &mut now, 0);
        assert!(now == original, "a read-only device changed the image");
    }
    used
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A valid request in an input: descriptor 0 header, 1 data, 2 status; avail entry 0.
    fn seed(type_: u32, sector: u64, data_len: u32, write: bool) -> Vec<u8> {
        let mut g = vec![0u8; 0x8000];
        let put = |g: &mut Vec<u8>, at: usize, b: &[u8]| g[at..at + b.len()].copy_from_slice(b);
        let desc = |g: &mut Vec<u8>, i: usize, addr: u64, len: u32, flags: u16, next: u16| {
            put(g, i * 16, &addr.to_le_bytes());
            put(g, i * 16 + 8, &len.to_le_bytes());
            put(g, i * 16 + 12, &flags.to_le_bytes());
            put(g, i * 16 + 14, &next.to_le_bytes());
        };
        desc(&mut g, 0, 0x4000, 16, 1, 1);
        desc(
            &mut g,
            1,
            0x5000,
            data_len,
            1 | if write { 0 } else { 2 },
            2,
        );
        desc(&mut g, 2, 0x4100, 1, 2, 0);
        put(&mut g, 0x4000, &type_.to_le_bytes());
        put(&mut g, 0x4008, &sector.to_le_bytes());
        let mut input = vec![0u8, 1, 0];
        input.extend_from_slice(&g);
        input
    }

    #[test]
    fn valid_requests_complete() {
        for (t, write) in [(0u32, false), (1, true), (4, false), (8, false)] {
            assert_eq!(queue(&seed(t, 8, 4096, write)), 1, "type {t}");
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]
        /// Valid chains corrupted anywhere in the ring, the headers and the data, with any
        /// flags and avail index: no panic, no hang.
        #[test]
        fn corrupted_queues_never_panic(
            kind in 0usize..4,
            flags in any::<u8>(),
            idx in any::<u16>(),
            edits in proptest::collection::vec((0usize..0x6000, any::<u8>()), 0..24),
        ) {
            let (t, write) = [(0u32, false), (1, true), (11, true), (13, true)][kind];
            let mut input = seed(t, 8, 4096, write);
            input[0] = flags;
            input[1..3].copy_from_slice(&idx.to_le_bytes());
            for (at, v) in edits {
                if let Some(b) = input.get_mut(3 + at) {
                    *b = v;
                }
            }
            queue(&input);
        }

        /// Arbitrary bytes.
        #[test]
        fn arbitrary_queues_never_panic(data in proptest::collection::vec(any::<u8>(), 0..0x3000)) {
            queue(&data);
        }
    }
}
