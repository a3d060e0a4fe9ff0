//! Guest memory is the frontend's to give, and untrusted: a region may claim more bytes than
//! its file has (the first access beyond the file's end raises SIGBUS, which kills a process
//! that does not handle it), the frontend may shrink its memfd later, and it may send far
//! more regions than it was told it may.
//!
//! Two defences. [`check`] refuses a memory table whose regions are not inside their files
//! or that has too many regions, before any vring can see it (the backend's `check_memory`,
//! a hook of the vendored vhost-user-backend: vendor/PATCHES.md); the message fails and the
//! table in use stays. And [`install_sigbus_guard`] handles SIGBUS from memory that went away after it
//! was checked: the faulting page is replaced by a private zero page, so the access that
//! faulted completes (reads zeroes, writes go nowhere), the daemon lives on, and
//! [`lost_pages`] counts it for the log. vublk maps no file of its own, so every
//! "nonexistent address" bus error in it is guest memory.

use std::io;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use vm_memory::bitmap::Bitmap;
use vm_memory::{GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion};

/// Guest memory as vublk maps it: every region carries a dirty-page bitmap that logs into
/// the frontend's log while it migrates the guest (`SET_LOG_BASE`); writes through
/// vm-memory mark it themselves, writes by the kernel (io_uring reads into guest buffers)
/// are marked with [`mark_dirty`].
pub type Mem = GuestMemoryMmap<vhost_user_backend::bitmap::BitmapMmapRegion>;

/// Most memory regions a frontend may share: what vhost-user-backend answers to
/// GET_MAX_MEM_SLOTS.
pub const MAX_REGIONS: usize = 509;

/// Pages of guest memory replaced by zero pages after a bus error.
static LOST_PAGES: AtomicU64 = AtomicU64::new(0);
static PAGE_SIZE: AtomicUsize = AtomicUsize::new(4096);

/// Why a memory table is refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum MemoryError {
    #[error("{0} memory regions, more than the {MAX_REGIONS} this backend takes")]
    TooManyRegions(usize),
    #[error(
        "the memory region at guest address {gpa:#x} maps {len} bytes at offset {offset} of a \
         file of {file_len} bytes"
    )]
    BeyondFile {
        gpa: u64,
        len: u64,
        offset: u64,
        file_len: u64,
    },
    #[error("the file of the memory region at guest address {0:#x} cannot be examined")]
    Unreadable(u64),
}

/// Is every region of `mem` inside its file, and are there few enough of them?
pub fn check(mem: &Mem) -> Result<(), MemoryError> {
    if mem.num_regions() > MAX_REGIONS {
        return Err(MemoryError::TooManyRegions(mem.num_regions()));
    }
    for r in mem.iter() {
        let Some(fo) = r.file_offset() else {
            continue;
        };
        let gpa = r.start_addr().0;
        let file_len = fo
            .file()
            .metadata()
            .map_err(|_| MemoryError::Unreadable(gpa))?
            .len();
        let len = r.len();
        if fo.start().checked_add(len).is_none_or(|end| end > file_len) {
            return Err(MemoryError::BeyondFile {
                gpa,
                len,
                offset: fo.start(),
                file_len,
            });
        }
    }
    Ok(())
}

/// Mark [addr, addr + len) of guest memory dirty in the migration log (a no-op while the
/// frontend is not logging; parts outside guest memory are skipped).
pub fn mark_dirty(mem: &Mem, addr: GuestAddress, len: usize) {
    for vs in mem.get_slices(addr, len).flatten() {
        vs.bitmap().mark_dirty(0, vs.len());
    }
}

/// Pages lost to bus errors so far (see the module docs).
pub fn lost_pages() -> u64 {
    LOST_PAGES.load(Ordering::Relaxed)
}

/// The SIGBUS handler: a bus error at a nonexistent address (a shared mapping beyond the end
/// of its file) gets a private zero page mapped over the faulting page and the access is
/// retried; anything else gets the default action (the process dies, as without a handler).
extern "C" fn on_sigbus(_sig: libc::c_int, info: *mut libc::siginfo_t, _ctx: *mut libc::c_void) {
    // Only async-signal-safe work here: loads, one mmap system call, atomics.
    if !info.is_null() {
        // SAFETY: the kernel passes a valid siginfo_t to an SA_SIGINFO handler.
        let (code, addr) = unsafe { ((*info).si_code, (*info).si_addr() as usize) };
        if code == libc::BUS_ADRERR && addr != 0 {
            let page = PAGE_SIZE.load(Ordering::Relaxed);
            let start = addr & !(page - 1);
            // SAFETY: replaces one page of a mapping that no longer has backing memory with a
            // private anonymous page at the same address (MAP_FIXED); nothing else refers to
            // that page's old contents, which are gone.
            let p = unsafe {
                libc::mmap(
                    start as *mut libc::c_void,
                    page,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_FIXED | libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                )
            };
            if p != libc::MAP_FAILED {
                LOST_PAGES.fetch_add(1, Ordering::Relaxed);
                return;
            }
        }
    }
    // SAFETY: resetting a signal's disposition is async-signal-safe; returning re-runs the
    // faulting access, which now gets the default action.
    unsafe {
        libc::signal(libc::SIGBUS, libc::SIG_DFL);
    }
}

/// Install the SIGBUS handler for the whole process (once, at start-up).
pub fn install_sigbus_guard() -> io::Result<()> {
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if page > 0 {
        PAGE_SIZE.store(page as usize, Ordering::Relaxed);
    }
    // SAFETY: sigaction is plain data; zeroed then filled in; the handler is an extern "C"
    // function with the SA_SIGINFO signature that lives for the whole program.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = on_sigbus as *const () as usize;
        sa.sa_flags = libc::SA_SIGINFO;
        libc::sigemptyset(&mut sa.sa_mask);
        if libc::sigaction(libc::SIGBUS, &sa, std::ptr::null_mut()) != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs::File;
    use std::os::fd::FromRawFd;
    use vm_memory::{FileOffset, GuestAddress, GuestRegionMmap, MmapRegion};

    fn memfd(len: u64) -> File {
        // SAFETY: plain system call with a valid C string; the result is checked.
        let fd = unsafe { libc::memfd_create(c"vublk-test".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0);
        // SAFETY: a fresh descriptor nothing else owns.
        let f = unsafe { File::from_raw_fd(fd) };
        f.set_len(len).unwrap();
        f
    }

    fn mem_over(file: File, offset: u64, len: usize) -> Mem {
        let region = MmapRegion::build(
            Some(FileOffset::new(file, offset)),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
        )
        .unwrap();
        GuestMemoryMmap::from_regions(vec![GuestRegionMmap::new(region, GuestAddress(0)).unwrap()])
            .unwrap()
    }

    #[test]
    fn regions_beyond_their_file_are_refused() {
        assert_eq!(check(&mem_over(memfd(1 << 20), 0, 1 << 20)), Ok(()));
        assert!(matches!(
            check(&mem_over(memfd(1 << 20), 0, 2 << 20)),
            Err(MemoryError::BeyondFile { .. })
        ));
        assert!(matches!(
            check(&mem_over(memfd(1 << 20), 1 << 20, 4096)),
            Err(MemoryError::BeyondFile { .. })
        ));
    }

    /// Memory taken away after it was mapped (the memfd shrunk) faults; the guard maps a
    /// zero page and the access completes.
    #[test]
    fn a_shrunk_memfd_reads_zeroes_instead_of_killing_the_process() {
        use vm_memory::Bytes;
        install_sigbus_guard().unwrap();
        let f = memfd(64 << 10);
        let keep = f.try_clone().unwrap();
        let mem = mem_over(f, 0, 64 << 10);
        mem.write_obj(0x1234_5678u32, GuestAddress(40 << 10))
            .unwrap();
        keep.set_len(4096).unwrap();
        let before = lost_pages();
        let v: u32 = mem.read_obj(GuestAddress(40 << 10)).unwrap();
        assert_eq!(v, 0);
        assert!(lost_pages() > before);
        // Still usable: writes land in the zero page.
        mem.write_obj(7u32, GuestAddress(40 << 10)).unwrap();
        assert_eq!(mem.read_obj::<u32>(GuestAddress(40 << 10)).unwrap(), 7);
    }
}
