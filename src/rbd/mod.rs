//! Ceph RBD images through librbd (cargo feature `rbd`): connecting to a cluster with bounded
//! timeouts, opening an image (or a snapshot, read-only), and asynchronous I/O whose
//! completions are collected on the caller's thread: librbd signals an eventfd
//! (`rbd_set_image_notification`) and [`RbdImage::poll`] takes the finished operations
//! (`rbd_poll_io_events`), so no librbd thread ever touches vublk's rings.
//!
//! Groundwork for serving `--blk-file rbd:POOL/IMAGE[@SNAPSHOT]` (issue 18): the engine and
//! image integration are not written yet.

pub mod ffi;

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::path::Path;
use std::ptr;
use std::sync::Arc;
use std::time::Duration;

use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

/// `rbd:POOL/IMAGE[@SNAPSHOT]`, QEMU's pseudo-protocol.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RbdSpec {
    pub pool: String,
    pub image: String,
    pub snapshot: Option<String>,
}

impl RbdSpec {
    /// Parse `rbd:POOL/IMAGE[@SNAPSHOT]`; None if `s` does not start with `rbd:`.
    pub fn parse(s: &str) -> Option<Result<RbdSpec, String>> {
        let rest = s.strip_prefix("rbd:")?;
        let bad = || Err(format!("{s}: expected rbd:POOL/IMAGE[@SNAPSHOT]"));
        let Some((pool, image)) = rest.split_once('/') else {
            return Some(bad());
        };
        let (image, snapshot) = match image.split_once('@') {
            Some((i, s)) => (i, Some(s.to_owned())),
            None => (image, None),
        };
        let ok = |x: &str| !x.is_empty() && !x.contains(['/', '@', ':', '\0']);
        if !ok(pool) || !ok(image) || snapshot.as_deref().is_some_and(|s| !ok(s)) {
            return Some(bad());
        }
        Some(Ok(RbdSpec {
            pool: pool.to_owned(),
            image: image.to_owned(),
            snapshot,
        }))
    }
}

/// A librados/librbd failure: what was being done and the errno it gave.
#[derive(Debug, thiserror::Error)]
#[error("{what}: {}", io::Error::from_raw_os_error(*.errno))]
pub struct RbdError {
    pub what: String,
    pub errno: i32,
}

fn check(r: i32, what: impl FnOnce() -> String) -> Result<(), RbdError> {
    if r < 0 {
        Err(RbdError {
            what: what(),
            errno: -r,
        })
    } else {
        Ok(())
    }
}

fn cstr(s: &str) -> Result<CString, RbdError> {
    CString::new(s).map_err(|_| RbdError {
        what: format!("{s:?} contains a NUL byte"),
        errno: libc::EINVAL,
    })
}

/// A connected cluster handle (shut down when the last user goes).
pub struct Cluster {
    h: ffi::rados_t,
}

// SAFETY: librados handles are thread-safe (the C API is documented for concurrent use).
unsafe impl Send for Cluster {}
// SAFETY: as above.
unsafe impl Sync for Cluster {}

impl Cluster {
    /// Connect as client `id` with the configuration file `conf` (and `keyring`), giving up
    /// after `timeout` instead of waiting for the monitors for ever.
    pub fn connect(
        conf: &Path,
        id: &str,
        keyring: Option<&Path>,
        timeout: Duration,
    ) -> Result<Arc<Cluster>, RbdError> {
        let cluster_name = cstr("ceph")?;
        let name = cstr(&format!("client.{id}"))?;
        let mut h: ffi::rados_t = ptr::null_mut();
        // SAFETY: valid out pointer and C strings.
        let r = unsafe { ffi::rados_create2(&mut h, cluster_name.as_ptr(), name.as_ptr(), 0) };
        check(r, || format!("creating a cluster handle for client.{id}"))?;
        let c = Cluster { h };
        let path = cstr(&conf.display().to_string())?;
        // SAFETY: a handle from rados_create2, a C string.
        let r = unsafe { ffi::rados_conf_read_file(c.h, path.as_ptr()) };
        check(r, || {
            format!("reading the Ceph configuration {}", conf.display())
        })?;
        let secs = timeout.as_secs().max(1).to_string();
        let set = |k: &str, v: &str| -> Result<(), RbdError> {
            let (k, v) = (cstr(k)?, cstr(v)?);
            // SAFETY: a handle not connected yet, C strings.
            let r = unsafe { ffi::rados_conf_set(c.h, k.as_ptr(), v.as_ptr()) };
            check(r, || "setting a librados option".into())
        };
        set("client_mount_timeout", &secs)?;
        set("rados_mon_op_timeout", &secs)?;
        if let Some(k) = keyring {
            set("keyring", &k.display().to_string())?;
        }
        // SAFETY: a configured handle.
        let r = unsafe { ffi::rados_connect(c.h) };
        check(r, || {
            format!(
                "connecting to the cluster of {} as client.{id} (is a monitor up, and the \
                 keyring right?)",
                conf.display()
            )
        })?;
        Ok(Arc::new(c))
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        // SAFETY: our handle; every image and io context using it is gone (they hold an Arc).
        unsafe { ffi::rados_shutdown(self.h) };
    }
}

/// An open RBD image with its own completion eventfd.
pub struct RbdImage {
    img: ffi::rbd_image_t,
    io: ffi::rados_ioctx_t,
    event: EventFd,
    pub read_only: bool,
    _cluster: Arc<Cluster>,
}

// SAFETY: librbd image handles may be used from several threads (librbd serialises
// internally); vublk uses each from its queue threads and the control thread.
unsafe impl Send for RbdImage {}
// SAFETY: as above.
unsafe impl Sync for RbdImage {}

impl RbdImage {
    /// Open `spec` (a snapshot always read-only).
    pub fn open(cluster: Arc<Cluster>, spec: &RbdSpec, read_only: bool) -> Result<Self, RbdError> {
        let pool = cstr(&spec.pool)?;
        let mut io: ffi::rados_ioctx_t = ptr::null_mut();
        // SAFETY: a connected cluster, a C string, a valid out pointer.
        let r = unsafe { ffi::rados_ioctx_create(cluster.h, pool.as_ptr(), &mut io) };
        check(r, || format!("opening pool {:?}", spec.pool))?;
        let name = cstr(&spec.image)?;
        let snap = spec.snapshot.as_deref().map(cstr).transpose()?;
        let snap_ptr = snap.as_ref().map_or(ptr::null(), |s| s.as_ptr());
        let read_only = read_only || spec.snapshot.is_some();
        let mut img: ffi::rbd_image_t = ptr::null_mut();
        // SAFETY: an io context from above, C strings, a valid out pointer.
        let r = unsafe {
            if read_only {
                ffi::rbd_open_read_only(io, name.as_ptr(), &mut img, snap_ptr)
            } else {
                ffi::rbd_open(io, name.as_ptr(), &mut img, snap_ptr)
            }
        };
        if let Err(e) = check(r, || format!("opening image {}/{}", spec.pool, spec.image)) {
            // SAFETY: the io context from above, not used again.
            unsafe { ffi::rados_ioctx_destroy(io) };
            return Err(e);
        }
        let close = |e: RbdError| {
            // SAFETY: the image and io context from above, not used again.
            unsafe {
                ffi::rbd_close(img);
                ffi::rados_ioctx_destroy(io);
            }
            e
        };
        let event = EventFd::new(EFD_NONBLOCK).map_err(|e| {
            close(RbdError {
                what: "creating the completion eventfd".into(),
                errno: e.raw_os_error().unwrap_or(libc::EIO),
            })
        })?;
        // SAFETY: an open image and a live eventfd (kept as long as the image).
        let r = unsafe {
            ffi::rbd_set_image_notification(img, event.as_raw_fd(), ffi::EVENT_TYPE_EVENTFD)
        };
        check(r, || "asking librbd for completion events".into()).map_err(close)?;
        Ok(RbdImage {
            img,
            io,
            event,
            read_only,
            _cluster: cluster,
        })
    }

    /// The image's size in bytes.
    pub fn size(&self) -> Result<u64, RbdError> {
        let mut s = 0;
        // SAFETY: an open image, a valid out pointer.
        let r = unsafe { ffi::rbd_get_size(self.img, &mut s) };
        check(r, || "reading the image size".into())?;
        Ok(s)
    }

    /// Signalled when operations have completed (then call [`RbdImage::poll`]).
    pub fn event_fd(&self) -> RawFd {
        self.event.as_raw_fd()
    }

    fn completion(&self, user_data: u64) -> io::Result<ffi::rbd_completion_t> {
        let mut c: ffi::rbd_completion_t = ptr::null_mut();
        // SAFETY: the argument is an integer carried as a pointer, never dereferenced.
        let r =
            unsafe { ffi::rbd_aio_create_completion(user_data as usize as *mut _, None, &mut c) };
        if r < 0 {
            return Err(io::Error::from_raw_os_error(-r));
        }
        Ok(c)
    }

    fn submitted(r: i32, c: ffi::rbd_completion_t) -> io::Result<()> {
        if r < 0 {
            // SAFETY: a completion librbd did not take.
            unsafe { ffi::rbd_aio_release(c) };
            return Err(io::Error::from_raw_os_error(-r));
        }
        Ok(())
    }

    /// Read into `iov` at `offset`; completes as `user_data`.
    ///
    /// # Safety
    /// The buffers `iov` names must stay valid and untouched until the operation completes
    /// (it is returned by [`RbdImage::poll`]).
    pub unsafe fn readv(&self, iov: &[libc::iovec], offset: u64, user_data: u64) -> io::Result<()> {
        let c = self.completion(user_data)?;
        // SAFETY: the caller keeps the buffers valid until completion; librbd copies the
        // iovec array itself.
        let r = unsafe { ffi::rbd_aio_readv(self.img, iov.as_ptr(), iov.len() as i32, offset, c) };
        Self::submitted(r, c)
    }

    /// Write `iov` at `offset`; completes as `user_data`.
    ///
    /// # Safety
    /// As for [`RbdImage::readv`].
    pub unsafe fn writev(
        &self,
        iov: &[libc::iovec],
        offset: u64,
        user_data: u64,
    ) -> io::Result<()> {
        let c = self.completion(user_data)?;
        // SAFETY: as in readv.
        let r = unsafe { ffi::rbd_aio_writev(self.img, iov.as_ptr(), iov.len() as i32, offset, c) };
        Self::submitted(r, c)
    }

    /// Make every completed write durable; completes as `user_data`.
    pub fn flush(&self, user_data: u64) -> io::Result<()> {
        let c = self.completion(user_data)?;
        // SAFETY: an open image and a fresh completion.
        let r = unsafe { ffi::rbd_aio_flush(self.img, c) };
        Self::submitted(r, c)
    }

    /// Deallocate [offset, offset + len); completes as `user_data`.
    pub fn discard(&self, offset: u64, len: u64, user_data: u64) -> io::Result<()> {
        let c = self.completion(user_data)?;
        // SAFETY: an open image and a fresh completion.
        let r = unsafe { ffi::rbd_aio_discard(self.img, offset, len, c) };
        Self::submitted(r, c)
    }

    /// Zero [offset, offset + len); completes as `user_data`.
    pub fn write_zeroes(&self, offset: u64, len: usize, user_data: u64) -> io::Result<()> {
        let c = self.completion(user_data)?;
        // SAFETY: an open image and a fresh completion.
        let r = unsafe { ffi::rbd_aio_write_zeroes(self.img, offset, len, c, 0, 0) };
        Self::submitted(r, c)
    }

    /// Take the completed operations: (user_data, result: bytes or 0, or a negative errno).
    pub fn poll(&self, out: &mut Vec<(u64, i64)>) {
        let _ = self.event.read();
        let mut comps = [ptr::null_mut(); 32];
        loop {
            // SAFETY: an open image and an array of that many slots.
            let n = unsafe { ffi::rbd_poll_io_events(self.img, comps.as_mut_ptr(), 32) };
            if n <= 0 {
                return;
            }
            for &c in &comps[..n as usize] {
                // SAFETY: completions librbd returned; each is released once, here.
                unsafe {
                    let ud = ffi::rbd_aio_get_arg(c) as usize as u64;
                    let r = ffi::rbd_aio_get_return_value(c) as i64;
                    ffi::rbd_aio_release(c);
                    out.push((ud, r));
                }
            }
            if (n as usize) < comps.len() {
                return;
            }
        }
    }
}

impl Drop for RbdImage {
    fn drop(&mut self) {
        // SAFETY: our image and io context; the caller has waited for its operations (closing
        // waits for librbd's own in-flight work).
        unsafe {
            ffi::rbd_close(self.img);
            ffi::rados_ioctx_destroy(self.io);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_parse_as_qemu_writes_them() {
        assert_eq!(RbdSpec::parse("/img.raw"), None);
        assert_eq!(
            RbdSpec::parse("rbd:pool/disk").unwrap().unwrap(),
            RbdSpec {
                pool: "pool".into(),
                image: "disk".into(),
                snapshot: None
            }
        );
        assert_eq!(
            RbdSpec::parse("rbd:pool/disk@snap1")
                .unwrap()
                .unwrap()
                .snapshot,
            Some("snap1".into())
        );
        for bad in [
            "rbd:",
            "rbd:pool",
            "rbd:/disk",
            "rbd:pool/",
            "rbd:pool/a/b",
            "rbd:p/d@",
        ] {
            assert!(RbdSpec::parse(bad).unwrap().is_err(), "{bad}");
        }
    }
}
