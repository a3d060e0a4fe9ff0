//! O_DIRECT alignment: what offsets, lengths and buffer addresses the file accepts.
//! Probed with statx(STATX_DIOALIGN), else the block device's logical sector size, else trial
//! reads (seed 001: guessing 512 where the device needs 4096 breaks O_DIRECT).

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileTypeExt;

use super::bounce::AlignedBuf;

/// Alignment the file needs for direct I/O. Both are powers of two; 1 means "anything".
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DioAlign {
    /// Buffer addresses and segment lengths.
    pub mem: usize,
    /// File offsets and total lengths.
    pub offset: usize,
}

impl DioAlign {
    /// No constraints (page-cache I/O).
    pub const NONE: DioAlign = DioAlign { mem: 1, offset: 1 };

    /// Alignment for bounce buffers: never less than a page, so they suit any device.
    pub fn bounce_align(&self) -> usize {
        page_size().max(4096).max(self.mem).max(self.offset)
    }
}

/// The system page size.
pub fn page_size() -> usize {
    // SAFETY: sysconf has no memory-safety preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 {
        p as usize
    } else {
        4096
    }
}

/// Where the answer came from, for the start-up log line.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProbeSource {
    NotDirect,
    Statx,
    BlockDevice,
    TrialReads,
    Default,
}

/// Probe the alignment `file` (opened with or without O_DIRECT) needs.
pub fn probe(file: &File, direct: bool) -> (DioAlign, ProbeSource) {
    if !direct {
        return (DioAlign::NONE, ProbeSource::NotDirect);
    }
    if let Some(a) = statx_dioalign(file) {
        return (a, ProbeSource::Statx);
    }
    if let Ok(meta) = file.metadata() {
        if meta.file_type().is_block_device() {
            if let Some(ss) = block_sector_size(file) {
                return (
                    DioAlign {
                        mem: ss,
                        offset: ss,
                    },
                    ProbeSource::BlockDevice,
                );
            }
        }
    }
    if let Some(a) = trial_reads(file) {
        return (a, ProbeSource::TrialReads);
    }
    (
        DioAlign {
            mem: 4096,
            offset: 4096,
        },
        ProbeSource::Default,
    )
}

fn statx_dioalign(file: &File) -> Option<DioAlign> {
    // SAFETY: statx is plain old data; zeroed is a valid value.
    let mut stx: libc::statx = unsafe { std::mem::zeroed() };
    // SAFETY: valid fd, empty path with AT_EMPTY_PATH, and a valid out pointer.
    let r = unsafe {
        libc::statx(
            file.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_EMPTY_PATH,
            libc::STATX_DIOALIGN,
            &mut stx,
        )
    };
    if r != 0 || stx.stx_mask & libc::STATX_DIOALIGN == 0 {
        return None;
    }
    let mem = stx.stx_dio_mem_align as usize;
    let offset = stx.stx_dio_offset_align as usize;
    // Zero means the file does not support direct I/O at all: let the trial reads decide.
    if mem == 0 || offset == 0 || !mem.is_power_of_two() || !offset.is_power_of_two() {
        return None;
    }
    Some(DioAlign { mem, offset })
}

fn block_sector_size(file: &File) -> Option<usize> {
    let mut ss: libc::c_int = 0;
    // SAFETY: BLKSSZGET writes one int through the pointer.
    let r = unsafe { libc::ioctl(file.as_raw_fd(), libc::BLKSSZGET, &mut ss) };
    (r == 0 && ss > 0 && (ss as usize).is_power_of_two()).then_some(ss as usize)
}

const TRIAL_SIZES: [usize; 4] = [512, 1024, 2048, 4096];

fn trial_read(file: &File, buf: *mut u8, len: usize, offset: u64) -> bool {
    // SAFETY: buf points at least len writable bytes (checked by the callers).
    let r = unsafe { libc::pread(file.as_raw_fd(), buf.cast(), len, offset as i64) };
    r >= 0 || io::Error::last_os_error().raw_os_error() != Some(libc::EINVAL)
}

fn trial_reads(file: &File) -> Option<DioAlign> {
    let mut buf = AlignedBuf::new(3 * 4096, 4096).ok()?;
    let base = buf.as_mut_ptr();
    // Offset alignment: smallest length/offset a page-aligned buffer can read.
    let offset = TRIAL_SIZES
        .iter()
        .copied()
        .find(|&a| trial_read(file, base, a, a as u64))?;
    // Memory alignment: smallest buffer misalignment that still works.
    let mem = TRIAL_SIZES
        .iter()
        .copied()
        .find(|&a| {
            // SAFETY: a <= 4096 and the buffer is 3 pages, so base + a + offset is inside.
            let p = unsafe { base.add(a) };
            trial_read(file, p, offset, 0)
        })
        .unwrap_or(4096);
    Some(DioAlign { mem, offset })
}

/// True when every (address, length) pair and the total suit `align`.
pub fn iovecs_aligned(iov: &[libc::iovec], offset: u64, align: DioAlign) -> bool {
    let m = align.mem - 1;
    let o = align.offset as u64 - 1;
    let mut total = 0u64;
    for v in iov {
        if (v.iov_base as usize) & m != 0 || v.iov_len & m != 0 {
            return false;
        }
        total += v.iov_len as u64;
    }
    offset & o == 0 && total & o == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn iov(addr: usize, len: usize) -> libc::iovec {
        libc::iovec {
            iov_base: addr as *mut libc::c_void,
            iov_len: len,
        }
    }

    #[test]
    fn aligned_iovecs_pass() {
        let a = DioAlign {
            mem: 512,
            offset: 512,
        };
        assert!(iovecs_aligned(
            &[iov(0x1000, 4096), iov(0x3200, 512)],
            1024,
            a
        ));
    }

    #[test]
    fn misaligned_address_length_or_offset_fails() {
        let a = DioAlign {
            mem: 512,
            offset: 4096,
        };
        assert!(!iovecs_aligned(&[iov(0x1001, 4096)], 0, a));
        assert!(!iovecs_aligned(&[iov(0x1000, 4000), iov(0x2000, 96)], 0, a));
        assert!(!iovecs_aligned(&[iov(0x1000, 4096)], 512, a));
        assert!(!iovecs_aligned(&[iov(0x1000, 512)], 0, a));
    }

    #[test]
    fn bounce_alignment_is_at_least_a_page() {
        assert!(
            DioAlign {
                mem: 512,
                offset: 512
            }
            .bounce_align()
                >= 4096
        );
        assert_eq!(
            DioAlign {
                mem: 512,
                offset: 8192
            }
            .bounce_align(),
            8192.max(page_size())
        );
    }

    #[test]
    fn probe_without_direct_has_no_constraints() {
        let f = File::open("/proc/self/exe").unwrap();
        assert_eq!(probe(&f, false).0, DioAlign::NONE);
    }

    #[test]
    fn probe_direct_file_finds_powers_of_two() {
        use std::os::unix::fs::OpenOptionsExt;
        let dir = std::env::temp_dir().join(format!("vublk-align-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("f");
        std::fs::write(&p, vec![0u8; 65536]).unwrap();
        let f = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECT)
            .open(&p);
        if let Ok(f) = f {
            let (a, _) = probe(&f, true);
            assert!(a.mem.is_power_of_two() && a.offset.is_power_of_two());
            assert!(a.offset <= 4096);
            // A trial read at the probed alignment must work.
            let mut buf = AlignedBuf::new(a.offset, a.bounce_align()).unwrap();
            assert!(trial_read(&f, buf.as_mut_ptr(), a.offset, a.offset as u64));
        } else {
            crate::testing::note_skip("temp dir does not support O_DIRECT");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
