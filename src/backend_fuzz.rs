//! Fuzzing entry point for the vhost-user protocol side: arbitrary bytes sent, as a stream of
//! messages (some carrying a memfd, as SET_MEM_TABLE and friends do), to a real
//! `VhostUserDaemon` running vublk's backend over an in-memory image. The connection must end
//! (no hang), nothing may panic, and the daemon must give its queue workers back cleanly.

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::net::UnixListener;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use vhost_user_backend::VhostUserDaemon;
use vm_memory::GuestMemoryAtomic;
use vmm_sys_util::sock_ctrl_msg::ScmSocket;

use crate::backend::VhostUserBlkBackend;
use crate::device::CacheMode;
use crate::device::{Device, DeviceParams};
use crate::image::Engine;
use crate::image::Image;
use crate::io::align::DioAlign;
use crate::io::SyncEngine;
use crate::worker::QueueWorker;
use crate::zero::DetectZeroes;

/// Size of the memfd attached to messages (guest memory for SET_MEM_TABLE / ADD_MEM_REG).
const MEMFD_LEN: u64 = 1 << 20;

fn memfd(len: u64) -> Option<File> {
    // SAFETY: plain system call with a valid C string; the result is checked.
    let fd = unsafe { libc::memfd_create(c"vublk-fuzz".as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return None;
    }
    // SAFETY: a fresh descriptor nothing else owns.
    let f = unsafe { File::from_raw_fd(fd) };
    f.set_len(len).ok()?;
    Some(f)
}

fn vmmsys_eventfd() -> Option<vmm_sys_util::eventfd::EventFd> {
    vmm_sys_util::eventfd::EventFd::new(libc::EFD_NONBLOCK).ok()
}

/// Send `data` as chunks: each starts with a byte whose low 6 bits + 1 are the chunk's
/// length; bit 6 attaches an eventfd to it (kick, call, err fds), bit 7 a memfd (guest
/// memory).
pub fn messages(data: &[u8]) {
    static N: AtomicU64 = AtomicU64::new(0);
    // No SIGBUS guard here (the daemon has one): an access to memory beyond a region's
    // file is a bug even where the guard would catch it, and the fuzzer must see it.
    let path = std::env::temp_dir().join(format!(
        "vublk-fuzz-{}-{}.sock",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_file(&path);
    let Ok(listener) = UnixListener::bind(&path) else {
        return;
    };
    let Some(image) = memfd(1 << 20) else {
        return;
    };
    let params = DeviceParams {
        logical_block_size: 512,
        read_only: false,
        num_queues: 1,
        queue_size: 16,
        cache: CacheMode::Writeback,
        align: DioAlign::NONE,
        serial: b"fuzz".to_vec(),
        detect_zeroes: DetectZeroes::Off,
        discard_unmap: false,
        is_block_device: false,
    };
    let dev = Arc::new(Device::new(Image::raw(image, 1 << 20, false), params));
    let mem = GuestMemoryAtomic::new(crate::guest_memory::Mem::new());
    let worker = QueueWorker::new(0, dev.clone(), Engine::Sync(SyncEngine::new()), mem.clone());
    let backend = Arc::new(VhostUserBlkBackend::new(
        dev,
        vec![worker],
        crate::worker::poll::Poller::default(),
    ));
    let Ok(mut daemon) = VhostUserDaemon::new("vublk-fuzz".into(), backend.clone(), mem) else {
        let _ = std::fs::remove_file(&path);
        return;
    };
    let started = path
        .to_str()
        .is_some_and(|p| daemon.start_client(p).is_ok());
    let accepted = listener.accept();
    let _ = std::fs::remove_file(&path);
    let (Ok((mut stream, _)), true) = (accepted, started) else {
        return;
    };
    // Replies are read on another thread, so the daemon never blocks writing one.
    let reader = stream.try_clone().ok().map(|mut r| {
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while matches!(r.read(&mut buf), Ok(n) if n > 0) {}
        })
    });
    let fd = memfd(MEMFD_LEN);
    let event = vmmsys_eventfd();
    let mut rest = data;
    while let Some((&head, tail)) = rest.split_first() {
        let n = (usize::from(head & 0x3f) + 1).min(tail.len());
        let (chunk, after) = tail.split_at(n);
        rest = after;
        let attach = if head & 0x80 != 0 {
            fd.as_ref().map(|f| f.as_raw_fd())
        } else if head & 0x40 != 0 {
            event.as_ref().map(|e| e.as_raw_fd())
        } else {
            None
        };
        let sent = match attach {
            Some(raw) => stream.send_with_fds(&[chunk], &[raw]).is_ok(),
            None => stream.write_all(chunk).is_ok(),
        };
        if !sent {
            break;
        }
    }
    let _ = stream.shutdown(std::net::Shutdown::Write);
    let _ = daemon.wait();
    drop(stream);
    if let Some(r) = reader {
        let _ = r.join();
    }
    backend.drain_all();
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// One vhost-user message: header (request, flags: version 1, payload size), payload.
    fn msg(req: u32, payload: &[u8]) -> Vec<u8> {
        let mut m = req.to_le_bytes().to_vec();
        m.extend_from_slice(&1u32.to_le_bytes());
        m.extend_from_slice(&(payload.len() as u32).to_le_bytes());
        m.extend_from_slice(payload);
        m
    }

    /// Chunks for [`messages`]: each message in chunks of up to 64 bytes, the fd kind
    /// (0x80 memfd, 0x40 eventfd) on its first.
    fn chunks(msgs: &[(Vec<u8>, u8)]) -> Vec<u8> {
        let mut out = Vec::new();
        for (m, fd) in msgs {
            for (i, part) in m.chunks(64).enumerate() {
                out.push((part.len() - 1) as u8 | if i == 0 { *fd } else { 0 });
                out.extend_from_slice(part);
            }
        }
        out
    }

    /// A plausible session: features, owner, a memory table over the memfd, a queue.
    pub(crate) fn session() -> Vec<u8> {
        let u64p = |v: u64| v.to_le_bytes().to_vec();
        let state = |i: u32, n: u32| [i.to_le_bytes(), n.to_le_bytes()].concat();
        let mut table = 1u32.to_le_bytes().to_vec();
        table.extend_from_slice(&0u32.to_le_bytes());
        for v in [0x10_0000u64, MEMFD_LEN, 0x7f00_0000_0000, 0] {
            table.extend_from_slice(&v.to_le_bytes());
        }
        let mut addr = 0u32.to_le_bytes().to_vec();
        addr.extend_from_slice(&0u32.to_le_bytes());
        for v in [0x7f00_0000_0000u64, 0x7f00_0000_2000, 0x7f00_0000_1000, 0] {
            addr.extend_from_slice(&v.to_le_bytes());
        }
        chunks(&[
            (msg(1, &[]), 0),                      // GET_FEATURES
            (msg(3, &[]), 0),                      // SET_OWNER
            (msg(2, &u64p(1 << 32 | 1 << 30)), 0), // SET_FEATURES
            (msg(15, &[]), 0),                     // GET_PROTOCOL_FEATURES
            (msg(16, &u64p(0x203)), 0),            // SET_PROTOCOL_FEATURES
            (msg(5, &table), 0x80),                // SET_MEM_TABLE
            (msg(8, &state(0, 16)), 0),            // SET_VRING_NUM
            (msg(9, &addr), 0),                    // SET_VRING_ADDR
            (msg(10, &state(0, 0)), 0),            // SET_VRING_BASE
            (msg(12, &u64p(0)), 0x40),             // SET_VRING_KICK
            (msg(13, &u64p(0)), 0x40),             // SET_VRING_CALL
            (msg(18, &state(0, 1)), 0),            // SET_VRING_ENABLE
            (msg(11, &state(0, 0)), 0),            // GET_VRING_BASE
        ])
    }

    #[test]
    fn a_plausible_session_ends_cleanly() {
        messages(&session());
        messages(&[]);
        messages(&[0x7f; 200]);
    }

    /// Regression (found by the fuzz target): a memory table with a region beyond its file
    /// sent while a vring was enabled; vhost-user-backend installed the table before vublk
    /// could refuse it, and the vring thread's next look at the ring raised SIGBUS. Now the
    /// table is refused before it is installed.
    #[test]
    fn regression_region_beyond_its_file_while_a_vring_runs() {
        messages(include_bytes!(
            "../fuzz/regressions/vhost_user-fd-as-memory-region"
        ));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]
        /// A session corrupted anywhere: the connection ends, nothing panics or hangs.
        #[test]
        fn corrupted_sessions_never_panic(
            edits in proptest::collection::vec((0usize..600, any::<u8>()), 1..16),
            cut in 0usize..700,
        ) {
            let mut s = session();
            for (at, v) in edits {
                if let Some(b) = s.get_mut(at) {
                    *b = v;
                }
            }
            s.truncate(cut.max(1));
            messages(&s);
        }
    }
}
