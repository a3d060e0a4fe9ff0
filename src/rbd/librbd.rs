//! librados and librbd through their C API (`ffi`): a cluster connection with bounded
//! timeouts, an image handle (or a snapshot's, read-only), its exclusive lock, size and update
//! watch, and asynchronous I/O straight from the caller's iovecs.

use super::ffi;
use super::RbdSpec;

use std::ffi::{CStr, CString};
use std::io;
use std::os::raw::{c_int, c_void};
use std::ptr;
use std::sync::{Arc, Mutex, RwLock, RwLockReadGuard};
use std::time::Duration;

use crate::io::Completion;
use crate::locks::{Locked, RwLocked};
use crate::offload::Inbox;
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

/// A connected cluster handle (shut down when the last user goes, or by the last image's
/// `close`).
pub struct Cluster {
    h: ffi::rados_t,
    /// `rados_shutdown` has run (by [`RbdImage::close`]): the handle is gone.
    shut_down: std::sync::atomic::AtomicBool,
}

// SAFETY: librados handles are thread-safe (the C API is documented for concurrent use).
unsafe impl Send for Cluster {}
// SAFETY: as above.
unsafe impl Sync for Cluster {}

/// How to reach a cluster.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConnectOptions {
    /// The configuration file (`--ceph-conf`).
    pub conf: std::path::PathBuf,
    /// The client name without `client.` (`--ceph-id`).
    pub id: String,
    /// `--ceph-keyring` (None: what the configuration says).
    pub keyring: Option<std::path::PathBuf>,
    /// Connecting and monitor operations give up after this long.
    pub timeout: Duration,
    /// OSD operations (the data path) fail with ETIMEDOUT after this long instead of
    /// waiting for the cluster for ever (zero: wait for ever, librados' default).
    pub op_timeout: Duration,
    /// More librados/librbd options, set after the configuration file is read.
    pub settings: Vec<(String, String)>,
}

impl Cluster {
    /// Connect as `opts` say, giving up after `opts.timeout` instead of waiting for the
    /// monitors for ever.
    pub fn connect(opts: &ConnectOptions) -> Result<Arc<Cluster>, RbdError> {
        let id = &opts.id;
        let conf = &opts.conf;
        let cluster_name = cstr("ceph")?;
        let name = cstr(&format!("client.{id}"))?;
        let mut h: ffi::rados_t = ptr::null_mut();
        // SAFETY: valid out pointer and C strings.
        let r = unsafe { ffi::rados_create2(&mut h, cluster_name.as_ptr(), name.as_ptr(), 0) };
        check(r, || format!("creating a cluster handle for client.{id}"))?;
        let c = Cluster {
            h,
            shut_down: std::sync::atomic::AtomicBool::new(false),
        };
        let path = cstr(&conf.display().to_string())?;
        // SAFETY: a handle from rados_create2, a C string.
        let r = unsafe { ffi::rados_conf_read_file(c.h, path.as_ptr()) };
        check(r, || {
            format!(
                "reading the Ceph configuration {} (--ceph-conf)",
                conf.display()
            )
        })?;
        let secs = opts.timeout.as_secs().max(1).to_string();
        c.set("client_mount_timeout", &secs)?;
        c.set("rados_mon_op_timeout", &secs)?;
        c.set(
            "rados_osd_op_timeout",
            &opts.op_timeout.as_secs().to_string(),
        )?;
        if let Some(k) = &opts.keyring {
            c.set("keyring", &k.display().to_string())?;
        }
        for (k, v) in &opts.settings {
            c.set(k, v)?;
        }
        // SAFETY: a configured handle.
        let r = unsafe { ffi::rados_connect(c.h) };
        check(r, || {
            format!(
                "connecting to the cluster of {} as client.{id} (are its monitors up and \
                 reachable, is the keyring right? --ceph-conf, --ceph-id, --ceph-keyring)",
                conf.display()
            )
        })?;
        Ok(Arc::new(c))
    }

    fn set(&self, k: &str, v: &str) -> Result<(), RbdError> {
        let (ck, cv) = (cstr(k)?, cstr(v)?);
        // SAFETY: our handle, C strings.
        let r = unsafe { ffi::rados_conf_set(self.h, ck.as_ptr(), cv.as_ptr()) };
        check(r, || format!("setting the librados option {k} = {v}"))
    }

    /// The value of a configuration option as librados has it now.
    pub fn conf_get(&self, option: &str) -> Result<String, RbdError> {
        let k = cstr(option)?;
        let mut buf = vec![0 as std::os::raw::c_char; 256];
        // SAFETY: our handle, a C string, a buffer of that many bytes.
        let r = unsafe { ffi::rados_conf_get(self.h, k.as_ptr(), buf.as_mut_ptr(), buf.len()) };
        check(r, || format!("reading the librados option {option}"))?;
        // SAFETY: librados wrote a NUL-terminated string into the buffer.
        let v = unsafe { CStr::from_ptr(buf.as_ptr()) };
        Ok(v.to_string_lossy().into_owned())
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if *self.shut_down.get_mut() {
            return;
        }
        // SAFETY: our handle; every image and io context using it is gone (they hold an Arc).
        unsafe { ffi::rados_shutdown(self.h) };
    }
}

/// Called (on a librbd thread) when the image's header changes: a resize, a snapshot.
pub type UpdateFn = Arc<dyn Fn() + Send + Sync>;

/// An open RBD image.
pub struct RbdImage {
    img: ffi::rbd_image_t,
    io: ffi::rados_ioctx_t,
    pub read_only: bool,
    /// The update watch: its handle and the callback its argument points to.
    watch: Mutex<Option<(u64, *mut UpdateFn)>>,
    cluster: Arc<Cluster>,
    /// True until [`RbdImage::close`]: every call on the handle holds the read side, so the
    /// handle is closed only when none is in a call, and no call starts after.
    open: RwLock<bool>,
}

// SAFETY: librbd image handles may be used from several threads (librbd serialises
// internally); vublk uses each from its queue threads and the control thread. The watch
// callback pointer is only touched under its mutex.
unsafe impl Send for RbdImage {}
// SAFETY: as above.
unsafe impl Sync for RbdImage {}

/// What a submitted operation carries to its completion callback.
struct Pending {
    inbox: Arc<Inbox>,
    user_data: u64,
    /// The result of a success, where librbd reports 0 for it (writes: the bytes written).
    success: Option<i32>,
}

/// librbd's completion callback: post the result to the operation's inbox.
unsafe extern "C" fn on_complete(c: ffi::rbd_completion_t, arg: *mut c_void) {
    // SAFETY: `arg` is the Box<Pending> leaked when the operation was submitted; librbd calls
    // this once per completion, so it is taken back exactly once.
    let p = unsafe { Box::from_raw(arg.cast::<Pending>()) };
    // SAFETY: a completion librbd hands us; released once, here.
    let r = unsafe {
        let r = ffi::rbd_aio_get_return_value(c);
        ffi::rbd_aio_release(c);
        r
    };
    let result = match (r, p.success) {
        (0, Some(n)) => n,
        _ => r.clamp(i32::MIN as isize, i32::MAX as isize) as i32,
    };
    p.inbox.post(Completion {
        user_data: p.user_data,
        result,
    });
}

/// The update watch's callback.
unsafe extern "C" fn on_update(arg: *mut c_void) {
    // SAFETY: `arg` is the UpdateFn the watch was registered with; it lives until after
    // rbd_update_unwatch returned (see `RbdImage::unwatch`).
    let f = unsafe { &*arg.cast::<UpdateFn>() };
    f();
}

impl RbdImage {
    /// Open `spec` (a snapshot always read-only).
    pub fn open(cluster: Arc<Cluster>, spec: &RbdSpec, read_only: bool) -> Result<Self, RbdError> {
        let pool = cstr(&spec.pool)?;
        let mut io: ffi::rados_ioctx_t = ptr::null_mut();
        // SAFETY: a connected cluster, a C string, a valid out pointer.
        let r = unsafe { ffi::rados_ioctx_create(cluster.h, pool.as_ptr(), &mut io) };
        check(r, || format!("opening pool {:?}", spec.pool))?;
        // A write to a full pool or cluster fails (EDQUOT, ENOSPC) rather than waits in
        // librados unseen: vublk's error policy decides (--werror: held, by default, and
        // retried; or reported).
        // SAFETY: the io context just created.
        unsafe { ffi::rados_set_pool_full_try(io) };
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
        if let Err(e) = check(r, || {
            format!(
                "opening image {}/{}{}",
                spec.pool,
                spec.image,
                spec.snapshot
                    .as_deref()
                    .map(|s| format!("@{s}"))
                    .unwrap_or_default()
            )
        }) {
            // SAFETY: the io context from above, not used again.
            unsafe { ffi::rados_ioctx_destroy(io) };
            return Err(e);
        }
        Ok(RbdImage {
            img,
            io,
            read_only,
            watch: Mutex::new(None),
            cluster,
            open: RwLock::new(true),
        })
    }

    pub fn cluster(&self) -> &Arc<Cluster> {
        &self.cluster
    }

    /// The handle, held open for the caller's call; an error once the image is closed.
    fn opened(&self) -> Result<RwLockReadGuard<'_, bool>, RbdError> {
        let g = self.open.read_locked();
        if !*g {
            return Err(RbdError {
                what: "the image is closed".into(),
                errno: libc::ESHUTDOWN,
            });
        }
        Ok(g)
    }

    /// [`RbdImage::opened`] for the data path's `io::Result`s.
    fn opened_io(&self) -> io::Result<RwLockReadGuard<'_, bool>> {
        self.opened()
            .map_err(|e| io::Error::from_raw_os_error(e.errno))
    }

    /// Close the image now, as a clean exit must (dropping it may come too late, or never:
    /// other threads hold it until the process ends): the update watch removed, librbd's
    /// handle closed (its header watch and, if held, the exclusive lock go with it: `rbd
    /// status` shows no watcher), and the cluster connection shut down when this image was
    /// its last user. Later calls on the image fail (ESHUTDOWN). Idempotent.
    pub fn close(&self) {
        self.unwatch();
        let mut open = self.open.write_locked();
        if !*open {
            return;
        }
        *open = false;
        // SAFETY: our image and io context, not used again (every call checks `open` under
        // the lock held here); closing waits for librbd's in-flight work.
        unsafe {
            ffi::rbd_close(self.img);
            ffi::rados_ioctx_destroy(self.io);
        }
        if Arc::strong_count(&self.cluster) == 1
            && !self
                .cluster
                .shut_down
                .swap(true, std::sync::atomic::Ordering::AcqRel)
        {
            // SAFETY: the cluster's last user (the Arc held here), and its last io context
            // destroyed above; `shut_down` keeps its Drop from doing it again.
            unsafe { ffi::rados_shutdown(self.cluster.h) };
        }
    }

    /// The image's size in bytes.
    pub fn size(&self) -> Result<u64, RbdError> {
        let mut s = 0;
        let _open = self.opened()?;
        // SAFETY: an open image, a valid out pointer.
        let r = unsafe { ffi::rbd_get_size(self.img, &mut s) };
        check(r, || "reading the image size".into())?;
        Ok(s)
    }

    /// The allocated extents (offset, length) of [offset, offset + len), parent included,
    /// at object granularity where the image has fast-diff (a superset of what was
    /// written: everything outside reads as zeroes). At most `MAX_EXTENTS`; past them the
    /// answer ends where the last one ends (`Err` never means "unallocated").
    pub fn allocated(&self, offset: u64, len: u64) -> Result<(Vec<(u64, u64)>, u64), RbdError> {
        const MAX_EXTENTS: usize = 4096;
        struct Walk {
            extents: Vec<(u64, u64)>,
            /// The answer covers up to here (the walk stopped early when full).
            end: Option<u64>,
        }
        extern "C" fn cb(off: u64, len: usize, exists: c_int, arg: *mut c_void) -> c_int {
            // SAFETY: `arg` is the `Walk` below, alive and not otherwise touched for the
            // walk's duration (librbd calls back on the calling thread).
            let w = unsafe { &mut *(arg as *mut Walk) };
            if exists == 0 {
                return 0;
            }
            if w.extents.len() >= MAX_EXTENTS {
                w.end = Some(off);
                return 1;
            }
            w.extents.push((off, len as u64));
            0
        }
        let mut w = Walk {
            extents: Vec::new(),
            end: None,
        };
        let _open = self.opened()?;
        // SAFETY: an open image; the callback gets `w` back, which outlives the call.
        let r = unsafe {
            ffi::rbd_diff_iterate2(
                self.img,
                std::ptr::null(),
                offset,
                len,
                1,
                1,
                Some(cb),
                (&mut w as *mut Walk).cast(),
            )
        };
        if w.end.is_none() {
            check(r, || format!("walking the allocated extents at {offset}"))?;
        }
        let end = w.end.unwrap_or(offset + len);
        Ok((w.extents, end))
    }

    /// Resize the image in the cluster.
    pub fn resize(&self, bytes: u64) -> Result<(), RbdError> {
        let _open = self.opened()?;
        // SAFETY: an open image.
        let r = unsafe { ffi::rbd_resize(self.img, bytes) };
        check(r, || format!("resizing the image to {bytes} bytes"))
    }

    /// Does the image have the exclusive-lock feature?
    pub fn has_exclusive_lock_feature(&self) -> Result<bool, RbdError> {
        let mut f = 0u64;
        let _open = self.opened()?;
        // SAFETY: an open image, a valid out pointer.
        let r = unsafe { ffi::rbd_get_features(self.img, &mut f) };
        check(r, || "reading the image features".into())?;
        Ok(f & ffi::RBD_FEATURE_EXCLUSIVE_LOCK != 0)
    }

    /// Take the exclusive lock and keep it: other clients cannot write (nor take it) until it
    /// is released or this client is gone.
    pub fn lock_exclusive(&self) -> Result<(), RbdError> {
        let _open = self.opened()?;
        // SAFETY: an open image.
        let r = unsafe { ffi::rbd_lock_acquire(self.img, ffi::RBD_LOCK_MODE_EXCLUSIVE) };
        check(r, || "taking the image's exclusive lock".into())
    }

    pub fn unlock(&self) -> Result<(), RbdError> {
        let _open = self.opened()?;
        // SAFETY: an open image.
        let r = unsafe { ffi::rbd_lock_release(self.img) };
        check(r, || "releasing the image's exclusive lock".into())
    }

    /// Write librbd's cache back and wait (the completed writes are then in the cluster).
    pub fn flush_sync(&self) -> Result<(), RbdError> {
        let _open = self.opened()?;
        // SAFETY: an open image.
        let r = unsafe { ffi::rbd_flush(self.img) };
        check(r, || "flushing the image".into())
    }

    /// Call `f` whenever the image's header changes (one watch per image: later calls keep
    /// the first).
    pub fn watch(&self, f: UpdateFn) -> Result<(), RbdError> {
        let _open = self.opened()?;
        let mut w = self.watch.locked();
        if w.is_some() {
            return Ok(());
        }
        let arg = Box::into_raw(Box::new(f));
        let mut handle = 0u64;
        // SAFETY: an open image; `arg` stays valid until the watch is removed (unwatch).
        let r = unsafe {
            ffi::rbd_update_watch(self.img, &mut handle, Some(on_update), arg.cast::<c_void>())
        };
        if let Err(e) = check(r, || "watching the image for updates".into()) {
            // SAFETY: the box from above; librbd did not take it.
            drop(unsafe { Box::from_raw(arg) });
            return Err(e);
        }
        *w = Some((handle, arg));
        Ok(())
    }

    fn unwatch(&self) {
        let Ok(_open) = self.opened() else { return };
        let mut w = self.watch.locked();
        if let Some((handle, arg)) = w.take() {
            // SAFETY: our image and the handle rbd_update_watch gave; after it returns librbd
            // calls the callback no more, so its argument can go.
            unsafe {
                ffi::rbd_update_unwatch(self.img, handle);
                drop(Box::from_raw(arg));
            }
        }
    }

    fn completion(
        to: &Arc<Inbox>,
        user_data: u64,
        success: Option<i32>,
    ) -> io::Result<ffi::rbd_completion_t> {
        let arg = Box::into_raw(Box::new(Pending {
            inbox: to.clone(),
            user_data,
            success,
        }));
        let mut c: ffi::rbd_completion_t = ptr::null_mut();
        // SAFETY: `arg` is handed to the callback, which takes it back.
        let r = unsafe {
            ffi::rbd_aio_create_completion(arg.cast::<c_void>(), Some(on_complete), &mut c)
        };
        if r < 0 {
            // SAFETY: the box from above; no completion exists to take it.
            drop(unsafe { Box::from_raw(arg) });
            return Err(io::Error::from_raw_os_error(-r));
        }
        Ok(c)
    }

    fn submitted(r: i32, c: ffi::rbd_completion_t) -> io::Result<()> {
        if r < 0 {
            // SAFETY: a completion librbd did not take: its callback never runs, so its
            // argument is freed here.
            unsafe {
                drop(Box::from_raw(ffi::rbd_aio_get_arg(c).cast::<Pending>()));
                ffi::rbd_aio_release(c);
            }
            return Err(io::Error::from_raw_os_error(-r));
        }
        Ok(())
    }

    /// Read into `iov` at `offset`; completes into `to` as `user_data`.
    ///
    /// # Safety
    /// The buffers `iov` names must stay valid and untouched until the operation completes
    /// (its completion is posted to `to`).
    pub unsafe fn readv(
        &self,
        iov: &[libc::iovec],
        offset: u64,
        to: &Arc<Inbox>,
        user_data: u64,
    ) -> io::Result<()> {
        let _open = self.opened_io()?;
        let c = Self::completion(to, user_data, None)?;
        // SAFETY: the caller keeps the buffers valid until completion; librbd copies the
        // iovec array itself.
        let r = unsafe { ffi::rbd_aio_readv(self.img, iov.as_ptr(), iov.len() as i32, offset, c) };
        Self::submitted(r, c)
    }

    /// Write `iov` at `offset`; completes into `to` as `user_data`, with the bytes written.
    ///
    /// # Safety
    /// As for [`RbdImage::readv`] (librbd sends from the buffers without copying them).
    pub unsafe fn writev(
        &self,
        iov: &[libc::iovec],
        offset: u64,
        to: &Arc<Inbox>,
        user_data: u64,
    ) -> io::Result<()> {
        let len: usize = iov.iter().map(|v| v.iov_len).sum();
        let _open = self.opened_io()?;
        let c = Self::completion(to, user_data, Some(i32::try_from(len).unwrap_or(i32::MAX)))?;
        // SAFETY: as in readv.
        let r = unsafe { ffi::rbd_aio_writev(self.img, iov.as_ptr(), iov.len() as i32, offset, c) };
        Self::submitted(r, c)
    }

    /// Make every completed write durable.
    pub fn flush(&self, to: &Arc<Inbox>, user_data: u64) -> io::Result<()> {
        let _open = self.opened_io()?;
        let c = Self::completion(to, user_data, None)?;
        // SAFETY: an open image and a fresh completion.
        let r = unsafe { ffi::rbd_aio_flush(self.img, c) };
        Self::submitted(r, c)
    }

    /// Deallocate [offset, offset + len) (librbd skips parts smaller than its discard
    /// granularity: they keep their data).
    pub fn discard(
        &self,
        offset: u64,
        len: u64,
        to: &Arc<Inbox>,
        user_data: u64,
    ) -> io::Result<()> {
        let _open = self.opened_io()?;
        let c = Self::completion(to, user_data, None)?;
        // SAFETY: an open image and a fresh completion.
        let r = unsafe { ffi::rbd_aio_discard(self.img, offset, len, c) };
        Self::submitted(r, c)
    }

    /// Zero [offset, offset + len): whole objects are deallocated, unless `thick` (then the
    /// zeroes are written and the space stays allocated).
    pub fn write_zeroes(
        &self,
        offset: u64,
        len: u64,
        thick: bool,
        to: &Arc<Inbox>,
        user_data: u64,
    ) -> io::Result<()> {
        let len = usize::try_from(len).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
        let _open = self.opened_io()?;
        let c = Self::completion(to, user_data, None)?;
        let flags = if thick {
            ffi::RBD_WRITE_ZEROES_FLAG_THICK_PROVISION
        } else {
            0
        };
        // SAFETY: an open image and a fresh completion.
        let r = unsafe { ffi::rbd_aio_write_zeroes(self.img, offset, len, c, flags, 0) };
        Self::submitted(r, c)
    }
}

impl Drop for RbdImage {
    fn drop(&mut self) {
        // Closing waits for librbd's in-flight work (the callers waited for theirs: their
        // inboxes are still referenced by the completions).
        self.close();
    }
}
