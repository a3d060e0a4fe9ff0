//! The dozen librados/librbd functions vublk uses, declared by hand from Ceph 16's
//! `rados/librados.h` and `rbd/librbd.h` (Debian `librbd-dev`); linked through the `#[link]` attributes below
//! when the `rbd` feature is on (the `-dev` package brings the unversioned `.so` links). Handles are opaque pointers; every function returns 0 or a negative
//! errno unless noted.

#![allow(non_camel_case_types)]

use std::os::raw::{c_char, c_int, c_void};

pub type rados_t = *mut c_void;
pub type rados_ioctx_t = *mut c_void;
pub type rbd_image_t = *mut c_void;
pub type rbd_completion_t = *mut c_void;
pub type rbd_callback_t = Option<unsafe extern "C" fn(cb: rbd_completion_t, arg: *mut c_void)>;

pub type rbd_update_callback_t = Option<unsafe extern "C" fn(arg: *mut c_void)>;

/// `rbd_lock_acquire` mode: one writer, no automatic hand-over to other clients.
pub const RBD_LOCK_MODE_EXCLUSIVE: c_int = 0;
/// `rbd_aio_write_zeroes` flag: write the zeroes, keeping the space allocated.
pub const RBD_WRITE_ZEROES_FLAG_THICK_PROVISION: c_int = 1;
/// `rbd_get_features` bit of images with an exclusive lock.
pub const RBD_FEATURE_EXCLUSIVE_LOCK: u64 = 1 << 2;

#[link(name = "rados")]
extern "C" {
    pub fn rados_create2(
        cluster: *mut rados_t,
        cluster_name: *const c_char,
        name: *const c_char,
        flags: u64,
    ) -> c_int;
    pub fn rados_conf_read_file(cluster: rados_t, path: *const c_char) -> c_int;
    pub fn rados_conf_set(cluster: rados_t, option: *const c_char, value: *const c_char) -> c_int;
    /// Writes the option's value, NUL-terminated, into `buf` (-ENAMETOOLONG if it is short).
    pub fn rados_conf_get(
        cluster: rados_t,
        option: *const c_char,
        buf: *mut c_char,
        len: usize,
    ) -> c_int;
    pub fn rados_connect(cluster: rados_t) -> c_int;
    pub fn rados_shutdown(cluster: rados_t);
    pub fn rados_ioctx_create(
        cluster: rados_t,
        pool: *const c_char,
        io: *mut rados_ioctx_t,
    ) -> c_int;
    pub fn rados_ioctx_destroy(io: rados_ioctx_t);
    /// Writes to a full pool (quota) or cluster fail with EDQUOT or ENOSPC instead of
    /// waiting in librados (librados 15+).
    pub fn rados_set_pool_full_try(io: rados_ioctx_t);
}

#[link(name = "rbd")]
extern "C" {
    pub fn rbd_open(
        io: rados_ioctx_t,
        name: *const c_char,
        image: *mut rbd_image_t,
        snap_name: *const c_char,
    ) -> c_int;
    pub fn rbd_open_read_only(
        io: rados_ioctx_t,
        name: *const c_char,
        image: *mut rbd_image_t,
        snap_name: *const c_char,
    ) -> c_int;
    pub fn rbd_close(image: rbd_image_t) -> c_int;
    pub fn rbd_get_size(image: rbd_image_t, size: *mut u64) -> c_int;
    pub fn rbd_resize(image: rbd_image_t, size: u64) -> c_int;
    pub fn rbd_get_features(image: rbd_image_t, features: *mut u64) -> c_int;
    pub fn rbd_lock_acquire(image: rbd_image_t, lock_mode: c_int) -> c_int;
    pub fn rbd_lock_release(image: rbd_image_t) -> c_int;
    /// Synchronous flush of librbd's cache.
    pub fn rbd_flush(image: rbd_image_t) -> c_int;
    pub fn rbd_update_watch(
        image: rbd_image_t,
        handle: *mut u64,
        watch_cb: rbd_update_callback_t,
        arg: *mut c_void,
    ) -> c_int;
    pub fn rbd_update_unwatch(image: rbd_image_t, handle: u64) -> c_int;
    pub fn rbd_aio_create_completion(
        cb_arg: *mut c_void,
        complete_cb: rbd_callback_t,
        c: *mut rbd_completion_t,
    ) -> c_int;
    /// The operation's result: bytes or 0, or a negative errno.
    pub fn rbd_aio_get_return_value(c: rbd_completion_t) -> isize;
    pub fn rbd_aio_get_arg(c: rbd_completion_t) -> *mut c_void;
    pub fn rbd_aio_release(c: rbd_completion_t);
    pub fn rbd_aio_readv(
        image: rbd_image_t,
        iov: *const libc::iovec,
        iovcnt: c_int,
        off: u64,
        c: rbd_completion_t,
    ) -> c_int;
    pub fn rbd_aio_writev(
        image: rbd_image_t,
        iov: *const libc::iovec,
        iovcnt: c_int,
        off: u64,
        c: rbd_completion_t,
    ) -> c_int;
    pub fn rbd_aio_flush(image: rbd_image_t, c: rbd_completion_t) -> c_int;
    pub fn rbd_aio_discard(image: rbd_image_t, off: u64, len: u64, c: rbd_completion_t) -> c_int;
    pub fn rbd_aio_write_zeroes(
        image: rbd_image_t,
        off: u64,
        len: usize,
        c: rbd_completion_t,
        zero_flags: c_int,
        op_flags: c_int,
    ) -> c_int;
    /// The extents of [ofs, ofs + len) written since `fromsnapname` (NULL: allocated at
    /// all), reported to `cb` (offset, length, exists, arg); a non-zero return ends the walk.
    pub fn rbd_diff_iterate2(
        image: rbd_image_t,
        fromsnapname: *const c_char,
        ofs: u64,
        len: u64,
        include_parent: u8,
        whole_object: u8,
        cb: Option<extern "C" fn(u64, usize, c_int, *mut c_void) -> c_int>,
        arg: *mut c_void,
    ) -> c_int;
}
