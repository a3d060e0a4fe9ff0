//! Image locking, in QEMU's protocol, so that vublk, QEMU, qemu-img, qemu-io, qemu-nbd and
//! qemu-storage-daemon refuse each other where two users would corrupt an image.
//!
//! The protocol (QEMU's `file` driver; observed with `/proc/locks`, no QEMU code): shared
//! (read) open-file-description locks on single bytes of the image file. Each permission
//! bit `i` (0 consistent read, 1 write, 2 write unchanged, 3 resize) has a byte at
//! `100 + i`, locked by every user that holds the permission, and a byte at `200 + i`,
//! locked by every user that does not share it with others. A user may take a permission
//! only when nobody else locks its "not shared" byte, and may refuse to share one only when
//! nobody else locks its permission byte. Locks are taken first, then the others' are
//! checked (`F_OFD_GETLK` sees only other open file descriptions), so two users starting at
//! once both see each other.
//!
//! What vublk takes, as QEMU takes for the same use: a served image read-write holds
//! consistent read, write and resize and shares neither write nor resize; `--read-only`
//! holds consistent read and shares neither write nor resize (QEMU's read-only exports);
//! with `--force-share` it shares everything (like `qemu-img -U`); backing files hold
//! consistent read and share everything (QEMU's backing children). The locks live as long
//! as the file stays open: for the whole life of the process. [`ImageLock::set`] changes
//! them in place (a migration destination can wait without write and take it later).

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::path::PathBuf;

/// QEMU's permission bits.
pub mod perm {
    pub const CONSISTENT_READ: u8 = 1 << 0;
    pub const WRITE: u8 = 1 << 1;
    pub const WRITE_UNCHANGED: u8 = 1 << 2;
    pub const RESIZE: u8 = 1 << 3;
    pub const ALL: u8 = CONSISTENT_READ | WRITE | WRITE_UNCHANGED | RESIZE;
}

/// How long a conflicting lock is retried at start-up (see [`ImageLock::take`]).
const KILLED_HOLDER_GRACE: std::time::Duration = std::time::Duration::from_secs(1);

/// Byte of permission bit `i`.
const PERM_BASE: u64 = 100;
/// Byte of "not shared" bit `i`.
const SHARED_BASE: u64 = 200;
/// Permission bits QEMU defines.
const BITS: u32 = 4;

/// The names QEMU's messages use.
fn perm_name(bit: u32) -> &'static str {
    match bit {
        0 => "consistent read",
        1 => "write",
        2 => "write unchanged",
        _ => "resize",
    }
}

/// Permissions held and shared.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Perms {
    pub held: u8,
    pub shared: u8,
}

impl Perms {
    /// A served image, read-write.
    pub const READ_WRITE: Perms = Perms {
        held: perm::CONSISTENT_READ | perm::WRITE | perm::RESIZE,
        shared: perm::CONSISTENT_READ | perm::WRITE_UNCHANGED,
    };
    /// A served image, read-only.
    pub const READ_ONLY: Perms = Perms {
        held: perm::CONSISTENT_READ,
        shared: perm::CONSISTENT_READ | perm::WRITE_UNCHANGED,
    };
    /// Read-only, sharing everything (`--force-share`, `qemu-img -U`).
    pub const FORCE_SHARE: Perms = Perms {
        held: perm::CONSISTENT_READ,
        shared: perm::ALL,
    };
    /// A backing file.
    pub const BACKING: Perms = Perms {
        held: perm::CONSISTENT_READ,
        shared: perm::ALL,
    };
}

/// `--locking` (QEMU's names).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Locking {
    /// Lock; where the file system has no OFD locks, go on unlocked with one warning.
    Auto,
    /// Lock, or refuse to serve.
    On,
    /// No locks (the operator's override: nothing stops a second user corrupting the image).
    Off,
}

/// Why an image cannot be locked.
#[derive(Debug, thiserror::Error)]
pub enum LockError {
    #[error(
        "image {} is in use by another process: cannot get the {}\"{}\" lock (is another \
         vublk, QEMU, qemu-nbd or qemu-storage-daemon using it? qemu-img -U reads it anyway; \
         --locking off overrides, at the risk of corrupting the image)",
        .path.display(),
        if *.shared { "shared " } else { "" },
        perm_name(*.bit)
    )]
    InUse {
        path: PathBuf,
        /// The permission bit.
        bit: u32,
        /// The conflict is over not sharing it (another user holds it), not holding it.
        shared: bool,
    },
    #[error("cannot lock image {} (--locking on)", .path.display())]
    Lock {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

/// What locking an image did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Locked {
    Yes,
    /// The file system has no OFD locks (`--locking auto`): unlocked.
    Unsupported,
    /// `--locking off`.
    Off,
}

/// The locks vublk holds on one open image file.
#[derive(Debug)]
pub struct ImageLock {
    perms: Option<Perms>,
}

impl ImageLock {
    /// Lock `file` (the image at `path`) with `perms` as `mode` says.
    pub fn take(
        file: &File,
        path: &std::path::Path,
        perms: Perms,
        mode: Locking,
    ) -> Result<(ImageLock, Locked), LockError> {
        if mode == Locking::Off {
            return Ok((ImageLock { perms: None }, Locked::Off));
        }
        let mut lock = ImageLock { perms: None };
        // A process killed a moment ago still holds its locks until the kernel has torn down
        // what it left (its io_uring holds the file a few milliseconds longer): a restart
        // right after `kill -9` waits for that instead of failing.
        let deadline = std::time::Instant::now() + KILLED_HOLDER_GRACE;
        let mut r = lock.set(file, path, perms);
        while matches!(r, Err(LockError::InUse { .. })) && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(10));
            r = lock.set(file, path, perms);
        }
        match r {
            Ok(()) => Ok((lock, Locked::Yes)),
            Err(LockError::Lock { source, .. })
                if mode == Locking::Auto && unsupported(&source) =>
            {
                Ok((ImageLock { perms: None }, Locked::Unsupported))
            }
            Err(e) => Err(e),
        }
    }

    /// Drop every lock now (a clean exit: the file may stay referenced a little longer,
    /// e.g. by an io_uring's fixed-file table, and the next user must not wait for that).
    pub fn release(&mut self, file: &File) {
        if self.perms.take().is_some() {
            let _ = apply(file.as_raw_fd(), NONE);
        }
    }

    /// No locks (images opened by tools and tests).
    pub fn unlocked() -> Self {
        ImageLock { perms: None }
    }

    /// The permissions held (None: not locked).
    pub fn perms(&self) -> Option<Perms> {
        self.perms
    }

    /// Hold `perms` instead of what is held now, or fail leaving the old locks as they were.
    pub fn set(
        &mut self,
        file: &File,
        path: &std::path::Path,
        perms: Perms,
    ) -> Result<(), LockError> {
        let fd = file.as_raw_fd();
        let lock_err = |source| LockError::Lock {
            path: path.to_owned(),
            source,
        };
        // Take the new bytes first (dropping none yet), then check the others' locks.
        apply(fd, union(self.perms, perms)).map_err(lock_err)?;
        if let Err(e) = check(fd, path, perms) {
            let _ = apply(fd, self.perms.unwrap_or(NONE));
            return Err(e);
        }
        apply(fd, perms).map_err(lock_err)?;
        self.perms = Some(perms);
        Ok(())
    }
}

/// No permission held, everything shared: no byte locked.
const NONE: Perms = Perms {
    held: 0,
    shared: perm::ALL,
};

/// Bytes locked for either set (during a change).
fn union(old: Option<Perms>, new: Perms) -> Perms {
    match old {
        None => new,
        Some(o) => Perms {
            held: o.held | new.held,
            shared: o.shared & new.shared,
        },
    }
}

/// Errors that mean "this file system has no OFD locks".
fn unsupported(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EINVAL) | Some(libc::ENOTSUP) | Some(libc::ENOLCK) | Some(libc::ENOSYS)
    )
}

/// One byte's lock request (`l_type` F_RDLCK, F_UNLCK or, to test, F_WRLCK).
fn flock(byte: u64, l_type: i32) -> libc::flock {
    // SAFETY: flock is plain data; all-zero is a valid value.
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = l_type as libc::c_short;
    fl.l_whence = libc::SEEK_SET as libc::c_short;
    fl.l_start = byte as libc::off_t;
    fl.l_len = 1;
    fl
}

/// An exclusive OFD lock on the whole of `fd`'s file, without waiting (EAGAIN or EACCES when
/// another open file description holds a lock on it): the pidfile's.
pub(crate) fn try_lock_whole_file(fd: i32) -> io::Result<()> {
    let mut fl = flock(0, libc::F_WRLCK);
    fl.l_len = 0;
    fcntl_lock(fd, libc::F_OFD_SETLK, &mut fl)
}

fn fcntl_lock(fd: i32, cmd: i32, fl: &mut libc::flock) -> io::Result<()> {
    // SAFETY: F_OFD_SETLK / F_OFD_GETLK read (and GETLK writes) one flock through the
    // pointer, which points at a live local.
    if unsafe { libc::fcntl(fd, cmd, fl as *mut libc::flock) } == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Lock exactly the bytes `perms` asks for (shared read locks), unlock the others.
fn apply(fd: i32, perms: Perms) -> io::Result<()> {
    for bit in 0..BITS {
        let m = 1u8 << bit;
        for (byte, want) in [
            (PERM_BASE + u64::from(bit), perms.held & m != 0),
            (SHARED_BASE + u64::from(bit), perms.shared & m == 0),
        ] {
            let mut fl = flock(byte, if want { libc::F_RDLCK } else { libc::F_UNLCK });
            fcntl_lock(fd, libc::F_OFD_SETLK, &mut fl)?;
        }
    }
    Ok(())
}

/// Does another open file description lock `byte`?
fn locked_by_others(fd: i32, byte: u64) -> io::Result<bool> {
    let mut fl = flock(byte, libc::F_WRLCK);
    fcntl_lock(fd, libc::F_OFD_GETLK, &mut fl)?;
    Ok(fl.l_type != libc::F_UNLCK as libc::c_short)
}

/// Refuse `perms` if another user does not share what they hold, or holds what they do not
/// share.
fn check(fd: i32, path: &std::path::Path, perms: Perms) -> Result<(), LockError> {
    let lock_err = |source| LockError::Lock {
        path: path.to_owned(),
        source,
    };
    for bit in 0..BITS {
        let m = 1u8 << bit;
        let in_use = |shared| LockError::InUse {
            path: path.to_owned(),
            bit,
            shared,
        };
        if perms.held & m != 0
            && locked_by_others(fd, SHARED_BASE + u64::from(bit)).map_err(lock_err)?
        {
            return Err(in_use(false));
        }
        if perms.shared & m == 0
            && locked_by_others(fd, PERM_BASE + u64::from(bit)).map_err(lock_err)?
        {
            return Err(in_use(true));
        }
    }
    Ok(())
}

/// Lock an image or backing file as `mode` says; where the file system has no OFD locks
/// (`auto`) say so once and go on unlocked.
pub(super) fn lock_file(
    file: &std::fs::File,
    path: &std::path::Path,
    perms: Perms,
    mode: Locking,
) -> Result<ImageLock, LockError> {
    let (lock, done) = ImageLock::take(file, path, perms, mode)?;
    match done {
        Locked::Yes => {}
        Locked::Off => log::warn!(
            "image locking is off (--locking off) for {}: nothing stops another process from \
             writing it while it is served",
            path.display()
        ),
        Locked::Unsupported => log::warn!(
            "the file system of {} has no OFD locks: serving it unlocked (--locking auto; \
             --locking on refuses instead)",
            path.display()
        ),
    }
    Ok(lock)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(tag: &str) -> (PathBuf, File, File) {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/unit-tmp");
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join(format!("lock-{tag}-{}", std::process::id()));
        std::fs::write(&p, [0u8; 4096]).unwrap();
        let rw = || {
            std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(&p)
                .unwrap()
        };
        (p.clone(), rw(), rw())
    }

    /// `e` says the write permission (bit 1) is taken, as a permission held (`shared: false`)
    /// or as one another user refuses to share (`shared: true`).
    fn assert_write_in_use(e: &LockError, shared: bool) {
        assert!(
            matches!(e, LockError::InUse { bit: 1, shared: s, .. } if *s == shared),
            "{e}"
        );
    }

    #[test]
    fn two_writers_refuse_each_other_and_readers_coexist() {
        let (p, a, b) = file("writers");
        let (_la, done) = ImageLock::take(&a, &p, Perms::READ_WRITE, Locking::On).unwrap();
        assert_eq!(done, Locked::Yes);
        let e = ImageLock::take(&b, &p, Perms::READ_WRITE, Locking::On).unwrap_err();
        assert_write_in_use(&e, false);
        assert!(e.to_string().contains("in use by another process"), "{e}");
        let e = ImageLock::take(&b, &p, Perms::READ_ONLY, Locking::On).unwrap_err();
        assert_write_in_use(&e, true);
        // Sharing everything goes alongside a writer.
        ImageLock::take(&b, &p, Perms::FORCE_SHARE, Locking::On).unwrap();
        std::fs::remove_file(p).unwrap();
    }

    #[test]
    fn read_only_users_coexist_and_keep_writers_out() {
        let (p, a, b) = file("readers");
        let (_la, _) = ImageLock::take(&a, &p, Perms::READ_ONLY, Locking::On).unwrap();
        let (_lb, _) = ImageLock::take(&b, &p, Perms::READ_ONLY, Locking::On).unwrap();
        let c = File::options().read(true).write(true).open(&p).unwrap();
        let e = ImageLock::take(&c, &p, Perms::READ_WRITE, Locking::On).unwrap_err();
        assert_write_in_use(&e, false);
        std::fs::remove_file(p).unwrap();
    }

    #[test]
    fn a_failed_change_keeps_the_old_locks_and_off_takes_none() {
        let (p, a, b) = file("change");
        let (mut la, _) = ImageLock::take(&a, &p, Perms::READ_ONLY, Locking::On).unwrap();
        let (_lb, _) = ImageLock::take(&b, &p, Perms::READ_ONLY, Locking::On).unwrap();
        // Upgrading to write while another reader does not share write fails ...
        assert!(la.set(&a, &p, Perms::READ_WRITE).is_err());
        assert_eq!(la.perms(), Some(Perms::READ_ONLY));
        // ... and the reader's locks still keep a writer out.
        let c = File::options().read(true).write(true).open(&p).unwrap();
        assert!(ImageLock::take(&c, &p, Perms::READ_WRITE, Locking::On).is_err());
        let (off, done) = ImageLock::take(&c, &p, Perms::READ_WRITE, Locking::Off).unwrap();
        assert_eq!((off.perms(), done), (None, Locked::Off));
        std::fs::remove_file(p).unwrap();
    }
}
