//! A vhost-user frontend written for tests (vhost's `Frontend`): memfd guest memory,
//! split rings built by hand at fixed places, a queue set up and kicked.

use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd};
use std::path::Path;

use vhost::vhost_user::message::{VhostUserHeaderFlag, VhostUserProtocolFeatures};
use vhost::vhost_user::{Frontend, VhostUserFrontend};
use vhost::{VhostBackend, VhostUserMemoryRegionInfo, VringConfigData};
use vm_memory::{
    Bytes, FileOffset, GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion,
};
use vmm_sys_util::eventfd::EventFd;

pub const GPA: u64 = 0x10_0000;
pub const MEM_LEN: u64 = 32 << 20;
pub const QSIZE: u16 = 16;
/// Ring layout inside guest memory (offsets from GPA).
pub const DESC: u64 = 0;
pub const AVAIL: u64 = 0x1000;
pub const USED: u64 = 0x2000;

pub fn memfd(len: u64) -> File {
    // SAFETY: plain system call with a valid C string; the result is checked.
    let fd = unsafe { libc::memfd_create(c"vublk-test-guest".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0);
    // SAFETY: a fresh descriptor nothing else owns.
    let f = unsafe { File::from_raw_fd(fd) };
    f.set_len(len).unwrap();
    f
}

/// One region of a memory table.
pub fn region(gpa: u64, len: u64, hva: u64, fd: i32) -> VhostUserMemoryRegionInfo {
    VhostUserMemoryRegionInfo {
        guest_phys_addr: gpa,
        memory_size: len,
        userspace_addr: hva,
        mmap_offset: 0,
        mmap_handle: fd,
    }
}

/// Guest memory the test shares: one memfd region at GPA.
pub struct Guest {
    pub mem: GuestMemoryMmap<()>,
    pub file: File,
    pub hva: u64,
}

pub fn guest() -> Guest {
    let file = memfd(MEM_LEN);
    let mem = GuestMemoryMmap::<()>::from_ranges_with_files(&[(
        GuestAddress(GPA),
        MEM_LEN as usize,
        Some(FileOffset::new(file.try_clone().unwrap(), 0)),
    )])
    .unwrap();
    let hva = mem.get_host_address(GuestAddress(GPA)).unwrap() as u64;
    Guest { mem, file, hva }
}

impl Guest {
    pub fn region(&self) -> VhostUserMemoryRegionInfo {
        let r = self.mem.find_region(GuestAddress(GPA)).unwrap();
        let fd = r.file_offset().unwrap().file().as_raw_fd();
        region(GPA, MEM_LEN, self.hva, fd)
    }

    pub fn w<T: vm_memory::ByteValued>(&self, off: u64, v: T) {
        let _ = self.mem.write_obj(v, GuestAddress(GPA + off));
    }

    pub fn desc(&self, i: u16, addr: u64, len: u32, flags: u16, next: u16) {
        let at = DESC + u64::from(i) * 16;
        self.w(at, addr);
        self.w(at + 8, len);
        self.w(at + 12, flags);
        self.w(at + 14, next);
    }
}

/// A connected frontend with its features and protocol features set (REPLY_ACK: every
/// message is answered, so a refusal is seen).
pub fn frontend(socket: &Path) -> Frontend {
    frontend_acking(socket, |f| f)
}

/// As [`frontend`], acking `ack(offered)` of the virtio features offered.
pub fn frontend_acking(socket: &Path, ack: impl Fn(u64) -> u64) -> Frontend {
    let mut fe = Frontend::connect(socket, 1).unwrap();
    fe.set_owner().unwrap();
    let features = fe.get_features().unwrap();
    fe.set_features(ack(features)).unwrap();
    let proto = fe.get_protocol_features().unwrap();
    fe.set_protocol_features(proto & VhostUserProtocolFeatures::REPLY_ACK | proto)
        .unwrap();
    fe.set_hdr_flags(VhostUserHeaderFlag::NEED_REPLY);
    fe
}

/// Queue 0 set up over `g` (ring addresses are the frontend's virtual addresses), then kicked.
pub fn start_queue(fe: &mut Frontend, g: &Guest, used_off: u64) -> (EventFd, EventFd) {
    start_queue_at(fe, g, used_off, 0)
}

/// As [`start_queue`], with SET_VRING_BASE `base`.
pub fn start_queue_at(
    fe: &mut Frontend,
    g: &Guest,
    used_off: u64,
    base: u16,
) -> (EventFd, EventFd) {
    let _ = fe.set_vring_num(0, QSIZE);
    let config = VringConfigData {
        queue_max_size: QSIZE,
        queue_size: QSIZE,
        flags: 0,
        desc_table_addr: g.hva + DESC,
        used_ring_addr: g.hva + used_off,
        avail_ring_addr: g.hva + AVAIL,
        log_addr: None,
    };
    let _ = fe.set_vring_addr(0, &config);
    let _ = fe.set_vring_base(0, base);
    let kick = EventFd::new(0).unwrap();
    let call = EventFd::new(0).unwrap();
    let _ = fe.set_vring_call(0, &call);
    let _ = fe.set_vring_kick(0, &kick);
    let _ = fe.set_vring_enable(0, true);
    kick.write(1).unwrap();
    (kick, call)
}

impl Guest {
    /// Read a value at offset `off` of guest memory.
    pub fn r<T: vm_memory::ByteValued>(&self, off: u64) -> T {
        self.mem.read_obj(GuestAddress(GPA + off)).unwrap()
    }
}

/// Put `heads` at available positions 0.. and set the available index.
pub fn publish_heads(g: &Guest, heads: &[u16]) {
    for (i, h) in heads.iter().enumerate() {
        g.w(AVAIL + 4 + 2 * i as u64, *h);
    }
    g.w(AVAIL + 2, heads.len() as u16);
}

pub fn used_idx(g: &Guest) -> u16 {
    g.r::<u16>(USED + 2)
}

/// The heads on the used ring so far, in its order.
pub fn used_heads(g: &Guest) -> Vec<u16> {
    (0..used_idx(g))
        .map(|i| g.r::<u32>(USED + 4 + 8 * u64::from(i)) as u16)
        .collect()
}

/// Wait (up to `secs`) until `n` requests are used, then check for 100 ms that no more are.
pub fn wait_used(g: &Guest, n: u16, secs: u64, what: &str) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(secs);
    while used_idx(g) < n {
        assert!(
            std::time::Instant::now() < deadline,
            "{what}: used idx {} < {n}",
            used_idx(g)
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    std::thread::sleep(std::time::Duration::from_millis(100));
    assert_eq!(used_idx(g), n, "{what}: more completions than requests");
}
