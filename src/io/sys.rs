//! The raw system calls vublk makes on image files outside the engines: fallocate modes,
//! block-device ioctls, and the zeroing fallbacks. Each returns an `io::Error` (or, where a
//! completion's result is wanted, a negative errno) and never panics.

use std::io;
use std::os::fd::RawFd;

use super::bounce::BouncePool;

/// _IO(0x12, 119): discard a byte range of a block device (linux/fs.h).
const BLKDISCARD: libc::c_ulong = 0x1277;
/// _IOR(0x12, 114, size_t): the block device's size in bytes (linux/fs.h).
const BLKGETSIZE64: libc::c_ulong = 0x8008_1272;

/// Deallocate the range (it reads as zeroes); the file's size does not change.
pub const PUNCH_HOLE: i32 = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
/// Zero the range keeping (or allocating) its blocks; the file's size does not change.
pub const ZERO_RANGE: i32 = libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE;

/// `fallocate(2)` on [offset, offset + len) with `mode`.
pub fn fallocate(fd: RawFd, mode: i32, offset: u64, len: u64) -> io::Result<()> {
    let (Ok(off), Ok(len)) = (i64::try_from(offset), i64::try_from(len)) else {
        return Err(io::Error::from(io::ErrorKind::InvalidInput));
    };
    // SAFETY: plain system call on a descriptor the caller owns; no memory is passed.
    if unsafe { libc::fallocate(fd, mode, off, len) } == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// A negative errno for a failed call (EIO when the error carries none).
pub fn neg_errno(e: &io::Error) -> i32 {
    -e.raw_os_error().unwrap_or(libc::EIO)
}

/// BLKDISCARD on [offset, offset + len): 0 or a negative errno.
pub fn blk_discard(fd: RawFd, offset: u64, len: u64) -> i32 {
    let range: [u64; 2] = [offset, len];
    // SAFETY: BLKDISCARD reads two u64 (start, length) through the pointer, which points at
    // a live local array.
    let r = unsafe { libc::ioctl(fd, BLKDISCARD, range.as_ptr()) };
    if r == 0 {
        0
    } else {
        neg_errno(&io::Error::last_os_error())
    }
}

/// The size of the block device open as `fd`, in bytes.
pub fn block_device_size(fd: RawFd) -> io::Result<u64> {
    let mut size: u64 = 0;
    // SAFETY: BLKGETSIZE64 writes one u64 through the pointer, which points at a live local.
    let r = unsafe { libc::ioctl(fd, BLKGETSIZE64, &mut size) };
    if r == 0 {
        Ok(size)
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Zero a range where the file system lacks FALLOC_FL_ZERO_RANGE (or punch-hole): punch and
/// re-allocate, else write zeroes. 0 or a negative errno. Rare; runs on the queue thread.
pub fn zero_fallback(fd: RawFd, offset: u64, len: u64, pool: &mut BouncePool) -> i32 {
    if punch_and_allocate(fd, offset, len) {
        return 0;
    }
    write_zeroes(fd, offset, len, pool)
}

/// Deallocate then allocate again: zeroes that keep the space (tmpfs lacks ZERO_RANGE).
fn punch_and_allocate(fd: RawFd, offset: u64, len: u64) -> bool {
    fallocate(fd, PUNCH_HOLE, offset, len).is_ok()
        && fallocate(fd, libc::FALLOC_FL_KEEP_SIZE, offset, len).is_ok()
}

/// The last resort: write zeroes, 1 MiB at a time, from an aligned (O_DIRECT-safe) buffer.
/// 0 or a negative errno.
pub fn write_zeroes(fd: RawFd, offset: u64, len: u64, pool: &mut BouncePool) -> i32 {
    /// One pooled bounce buffer's worth.
    const CHUNK: u64 = 1 << 20;
    let mut buf = match pool.get(CHUNK as usize) {
        Ok(b) => b,
        Err(_) => return -libc::ENOMEM,
    };
    buf.as_mut_slice().fill(0);
    let mut off = offset;
    let end = offset.saturating_add(len);
    let mut ret = 0;
    while off < end {
        let n = (end - off).min(CHUNK) as usize;
        // SAFETY: buf holds at least CHUNK bytes, alive for the call.
        let r = unsafe { libc::pwrite(fd, buf.as_mut_ptr().cast(), n, off as i64) };
        if r <= 0 {
            ret = neg_errno(&io::Error::last_os_error());
            break;
        }
        off += r as u64;
    }
    pool.put(buf);
    ret
}

/// What the block device under a file system says about itself, for `--prealloc auto`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DiskInfo {
    /// `/dev/NAME`, or `block device MAJ:MIN`.
    pub name: String,
    /// `queue/rotational`.
    pub rotational: bool,
    /// The disk is virtual (virtio-blk, Xen): its driver cannot know what the host stores it
    /// on, and `rotational` is only the kernel's default (1).
    pub virtual_disk: Option<&'static str>,
}

/// Drivers of virtual disks whose `rotational` flag is a default, not a measurement.
const VIRTUAL_DISK_DRIVERS: &[&str] = &["virtio_blk", "xen_blkfront", "vdc"];

/// The block device holding this file (`/sys/dev/block/MAJ:MIN`, or its parent disk for a
/// partition). None for files on no block device (tmpfs, network).
pub fn disk_info(meta: &std::fs::Metadata) -> Option<DiskInfo> {
    use std::os::unix::fs::MetadataExt;
    let dev = meta.dev();
    let (major, minor) = (libc::major(dev), libc::minor(dev));
    if major == 0 {
        return None;
    }
    disk_info_at(std::path::Path::new("/sys/dev/block"), major, minor)
}

/// [`disk_info`] under another sysfs root (tests).
pub fn disk_info_at(root: &std::path::Path, major: u32, minor: u32) -> Option<DiskInfo> {
    let base = root.join(format!("{major}:{minor}"));
    // A partition's queue and device are its disk's, one level up.
    let disk = [base.clone(), base.join("..")]
        .into_iter()
        .find(|d| d.join("queue/rotational").exists())?;
    let rotational = std::fs::read_to_string(disk.join("queue/rotational")).ok()?;
    let name = std::fs::canonicalize(&base)
        .ok()
        .and_then(|p| {
            p.file_name()
                .map(|n| format!("/dev/{}", n.to_string_lossy()))
        })
        .unwrap_or_else(|| format!("block device {major}:{minor}"));
    Some(DiskInfo {
        name,
        rotational: rotational.trim() == "1",
        virtual_disk: virtual_driver(&disk),
    })
}

/// The virtual-disk driver of `disk` (a sysfs block directory), or of every disk under it
/// when it is stacked (device mapper, md: `slaves/`).
fn virtual_driver(disk: &std::path::Path) -> Option<&'static str> {
    let driver_of = |d: &std::path::Path| {
        let link = std::fs::read_link(d.join("device/driver")).ok()?;
        let name = link.file_name()?.to_string_lossy().into_owned();
        VIRTUAL_DISK_DRIVERS.iter().copied().find(|v| *v == name)
    };
    if let Some(v) = driver_of(disk) {
        return Some(v);
    }
    let slaves: Vec<_> = std::fs::read_dir(disk.join("slaves"))
        .ok()?
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .collect();
    let mut found = None;
    for s in &slaves {
        // A partition under a stacked device: its disk is one level up.
        let v = driver_of(s).or_else(|| driver_of(&s.join("..")))?;
        found = Some(v);
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake sysfs: /sys/dev/block/MAJ:MIN links to a disk directory with `queue/rotational`
    /// and a `device/driver` link.
    fn fake_disk(root: &std::path::Path, id: &str, name: &str, rot: &str, driver: Option<&str>) {
        let disk = root.join("devices").join(name);
        std::fs::create_dir_all(disk.join("queue")).unwrap();
        std::fs::write(disk.join("queue/rotational"), rot).unwrap();
        if let Some(d) = driver {
            std::fs::create_dir_all(disk.join("device")).unwrap();
            std::fs::create_dir_all(root.join("drivers").join(d)).unwrap();
            std::os::unix::fs::symlink(root.join("drivers").join(d), disk.join("device/driver"))
                .unwrap();
        }
        std::fs::create_dir_all(root.join("dev/block")).unwrap();
        std::os::unix::fs::symlink(&disk, root.join("dev/block").join(id)).unwrap();
    }

    #[test]
    fn virtio_disks_are_told_apart_from_rotational_ones() {
        let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join(format!("target/unit-tmp/sysfs-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        fake_disk(&dir, "254:0", "vda", "1\n", Some("virtio_blk"));
        fake_disk(&dir, "8:0", "sda", "1\n", Some("sd"));
        fake_disk(&dir, "259:0", "nvme0n1", "0\n", Some("nvme"));
        // A partition of vda, and a device-mapper volume over it.
        std::fs::create_dir_all(dir.join("devices/vda/vda1")).unwrap();
        std::os::unix::fs::symlink(dir.join("devices/vda/vda1"), dir.join("dev/block/254:1"))
            .unwrap();
        fake_disk(&dir, "253:0", "dm-0", "1\n", None);
        std::fs::create_dir_all(dir.join("devices/dm-0/slaves")).unwrap();
        std::os::unix::fs::symlink(
            dir.join("devices/vda/vda1"),
            dir.join("devices/dm-0/slaves/vda1"),
        )
        .unwrap();
        let root = dir.join("dev/block");
        let info = |maj, min| disk_info_at(&root, maj, min).unwrap();
        assert_eq!(info(254, 0).virtual_disk, Some("virtio_blk"));
        assert!(info(254, 0).rotational);
        assert_eq!(info(254, 1).name, "/dev/vda1");
        assert_eq!(info(254, 1).virtual_disk, Some("virtio_blk"));
        assert_eq!(info(253, 0).virtual_disk, Some("virtio_blk"));
        assert_eq!(
            (info(8, 0).rotational, info(8, 0).virtual_disk),
            (true, None)
        );
        assert_eq!(
            (info(259, 0).rotational, info(259, 0).virtual_disk),
            (false, None)
        );
        assert!(disk_info_at(&root, 7, 7).is_none());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn last_resort_zeroing_writes_zeroes() {
        use std::os::fd::AsRawFd;
        let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/unit-tmp");
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(format!("sys-write-zeroes-{}", std::process::id()));
        std::fs::write(&path, vec![0x33u8; 3 << 20]).unwrap();
        let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        let mut pool = BouncePool::new(4096);
        // More than one 1 MiB chunk, not chunk-aligned.
        assert_eq!(
            write_zeroes(f.as_raw_fd(), 4096, (2 << 20) + 512, &mut pool),
            0
        );
        let data = std::fs::read(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        assert!(data[..4096].iter().all(|&b| b == 0x33));
        assert!(data[4096..4096 + (2 << 20) + 512].iter().all(|&b| b == 0));
        assert!(data[4096 + (2 << 20) + 512..].iter().all(|&b| b == 0x33));
    }
}
