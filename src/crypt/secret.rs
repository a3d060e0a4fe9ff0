//! Secrets in memory: passphrases and volume keys live in their own anonymous mappings,
//! locked out of swap (`mlock`, where the limit allows) and out of core dumps
//! (`MADV_DONTDUMP`), wiped before they are unmapped. And where a secret comes from:
//! `--key-secret file:PATH | fd:N | credential:NAME`.

use std::io::{self, Read};
use std::os::fd::FromRawFd;
use std::path::PathBuf;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, Ordering};

/// The longest passphrase or key file read (cryptsetup's default key-file limit).
pub const MAX_SECRET: usize = 8 << 20;

/// A page-aligned anonymous mapping, kept out of core dumps and (if allowed) swap.
struct Region {
    ptr: NonNull<u8>,
    map_len: usize,
}

// SAFETY: the region is plain memory owned by this value.
unsafe impl Send for Region {}
// SAFETY: shared access only reads.
unsafe impl Sync for Region {}

static MLOCK_WARNED: AtomicBool = AtomicBool::new(false);

impl Region {
    fn new(len: usize) -> io::Result<Region> {
        // SAFETY: sysconf has no preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(4096) as usize;
        let map_len = len.max(1).div_ceil(page) * page;
        // SAFETY: a fresh private anonymous mapping; the result is checked.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: the mapping just made, its whole length.
        if unsafe { libc::madvise(p, map_len, libc::MADV_DONTDUMP) } != 0 {
            let e = io::Error::last_os_error();
            // SAFETY: as above.
            unsafe { libc::munmap(p, map_len) };
            return Err(e);
        }
        // SAFETY: as above. Failing (RLIMIT_MEMLOCK) leaves the pages swappable only.
        if unsafe { libc::mlock(p, map_len) } != 0 && !MLOCK_WARNED.swap(true, Ordering::Relaxed) {
            log::warn!(
                "keys: mlock failed ({}): key pages may be swapped (raise LimitMEMLOCK)",
                io::Error::last_os_error()
            );
        }
        Ok(Region {
            ptr: NonNull::new(p.cast()).expect("mmap never returns null on success"),
            map_len,
        })
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: the mapping is ours and no borrow of it outlives self; volatile writes so
        // the wipe is not optimised away.
        unsafe {
            for i in 0..self.map_len {
                std::ptr::write_volatile(self.ptr.as_ptr().add(i), 0);
            }
            libc::munlock(self.ptr.as_ptr().cast(), self.map_len);
            libc::munmap(self.ptr.as_ptr().cast(), self.map_len);
        }
    }
}

/// Secret bytes (a passphrase, a volume key) in a protected region.
pub struct SecretBuf {
    region: Region,
    len: usize,
}

impl std::fmt::Debug for SecretBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "<secret, {} bytes>", self.len)
    }
}

impl SecretBuf {
    /// `len` zero bytes.
    pub fn zeroed(len: usize) -> io::Result<SecretBuf> {
        Ok(SecretBuf {
            region: Region::new(len)?,
            len,
        })
    }

    pub fn from_slice(b: &[u8]) -> io::Result<SecretBuf> {
        let mut s = SecretBuf::zeroed(b.len())?;
        s.as_mut().copy_from_slice(b);
        Ok(s)
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl AsRef<[u8]> for SecretBuf {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: len <= the mapping's length; the mapping lives as long as self.
        unsafe { std::slice::from_raw_parts(self.region.ptr.as_ptr(), self.len) }
    }
}

impl AsMut<[u8]> for SecretBuf {
    fn as_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, borrowed mutably through self.
        unsafe { std::slice::from_raw_parts_mut(self.region.ptr.as_ptr(), self.len) }
    }
}

/// A value (a cipher's round keys) in a protected region; dropped in place, then wiped.
pub struct Locked<T> {
    region: Region,
    _owns: std::marker::PhantomData<T>,
}

// SAFETY: Locked<T> owns a T.
unsafe impl<T: Send> Send for Locked<T> {}
// SAFETY: shared access gives &T only.
unsafe impl<T: Sync> Sync for Locked<T> {}

impl<T> Locked<T> {
    pub fn new(v: T) -> io::Result<Locked<T>> {
        assert!(std::mem::align_of::<T>() <= 4096);
        let region = Region::new(std::mem::size_of::<T>())?;
        // SAFETY: the region is page-aligned (so aligned for T), large enough, and unused.
        unsafe { region.ptr.as_ptr().cast::<T>().write(v) };
        Ok(Locked {
            region,
            _owns: std::marker::PhantomData,
        })
    }
}

impl<T> std::ops::Deref for Locked<T> {
    type Target = T;
    fn deref(&self) -> &T {
        // SAFETY: a T was written there in `new` and lives until drop.
        unsafe { &*self.region.ptr.as_ptr().cast::<T>() }
    }
}

impl<T> Drop for Locked<T> {
    fn drop(&mut self) {
        // SAFETY: the T written in `new`, dropped once; the region wipes itself after.
        unsafe { std::ptr::drop_in_place(self.region.ptr.as_ptr().cast::<T>()) };
    }
}

/// Where `--key-secret` reads the secret from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KeySource {
    /// `file:PATH`: the whole file, as cryptsetup's `--key-file` and QEMU's `secret`
    /// object with `file=` read it (a trailing newline is part of it).
    File(PathBuf),
    /// `fd:N`: read until end of file, then closed.
    Fd(i32),
    /// `credential:NAME`: `$CREDENTIALS_DIRECTORY/NAME` (systemd's `LoadCredential=`).
    Credential(String),
}

impl std::str::FromStr for KeySource {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let (kind, rest) = s
            .split_once(':')
            .ok_or_else(|| format!("{s:?}: expected file:PATH, fd:N or credential:NAME"))?;
        match kind {
            "file" if !rest.is_empty() => Ok(KeySource::File(PathBuf::from(rest))),
            "fd" => rest
                .parse::<i32>()
                .ok()
                .filter(|&fd| fd >= 3)
                .map(KeySource::Fd)
                .ok_or_else(|| format!("fd:{rest}: expected a file descriptor number >= 3")),
            "credential"
                if !rest.is_empty() && !rest.contains('/') && rest != "." && rest != ".." =>
            {
                Ok(KeySource::Credential(rest.to_string()))
            }
            _ => Err(format!(
                "{kind}:...: expected file:PATH, fd:N or credential:NAME (a plain file name)"
            )),
        }
    }
}

impl std::fmt::Display for KeySource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            KeySource::File(p) => write!(f, "file:{}", p.display()),
            KeySource::Fd(n) => write!(f, "fd:{n}"),
            KeySource::Credential(n) => write!(f, "credential:{n}"),
        }
    }
}

impl KeySource {
    /// Read the secret (at most [`MAX_SECRET`] bytes). Errors name the source, never the
    /// contents.
    pub fn read(&self) -> io::Result<SecretBuf> {
        let file = match self {
            KeySource::File(p) => std::fs::File::open(p)?,
            KeySource::Credential(name) => {
                let dir = std::env::var_os("CREDENTIALS_DIRECTORY").ok_or_else(|| {
                    io::Error::other(
                        "$CREDENTIALS_DIRECTORY is not set (credential: is for systemd's \
                         LoadCredential= or SetCredentialEncrypted=)",
                    )
                })?;
                std::fs::File::open(PathBuf::from(dir).join(name))?
            }
            KeySource::Fd(fd) => {
                // SAFETY: fcntl on any number is harmless; an fd that is not open is refused.
                if unsafe { libc::fcntl(*fd, libc::F_GETFD) } < 0 {
                    return Err(io::Error::last_os_error());
                }
                // SAFETY: the descriptor was handed to vublk for the secret alone (the
                // option says so); it is taken over and closed after reading.
                unsafe { std::fs::File::from_raw_fd(*fd) }
            }
        };
        read_secret(file)
    }
}

fn read_secret(mut f: std::fs::File) -> io::Result<SecretBuf> {
    let mut buf = SecretBuf::zeroed(4096)?;
    let mut len = 0usize;
    loop {
        if len == buf.len() {
            if buf.len() > MAX_SECRET {
                return Err(io::Error::other(format!("longer than {MAX_SECRET} bytes")));
            }
            let mut bigger = SecretBuf::zeroed(buf.len() * 2)?;
            bigger.as_mut()[..len].copy_from_slice(&buf.as_ref()[..len]);
            buf = bigger;
        }
        match f.read(&mut buf.as_mut()[len..]) {
            Ok(0) => break,
            Ok(n) => len += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    if len > MAX_SECRET {
        return Err(io::Error::other(format!("longer than {MAX_SECRET} bytes")));
    }
    let out = SecretBuf::from_slice(&buf.as_ref()[..len])?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sources_parse_and_read() {
        assert!("file:".parse::<KeySource>().is_err());
        assert!("fd:1".parse::<KeySource>().is_err());
        assert!("credential:../x".parse::<KeySource>().is_err());
        assert!("pass:x".parse::<KeySource>().is_err());
        let dir = tempfile_dir();
        let p = dir.join("k");
        std::fs::write(&p, b"pass\n").unwrap();
        let s = KeySource::File(p).read().unwrap();
        assert_eq!(s.as_ref(), b"pass\n", "the whole file, newline included");
        assert_eq!(format!("{s:?}"), "<secret, 5 bytes>");
        let big = vec![b'x'; 100_000];
        std::fs::write(dir.join("big"), &big).unwrap();
        assert_eq!(
            KeySource::File(dir.join("big")).read().unwrap().as_ref(),
            &big[..]
        );
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn locked_values_drop() {
        let v = Locked::new(vec![1u8, 2, 3]).unwrap();
        assert_eq!(v.len(), 3);
        drop(v);
    }

    fn tempfile_dir() -> PathBuf {
        let d = std::env::temp_dir().join(format!("vublk-secret-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        d
    }
}
