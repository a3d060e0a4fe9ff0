//! The dozen librados/librbd functions vublk uses, declared by hand from Ceph 16's
//! `rados/librados.h` and `rbd/librbd.h` (Debian `librbd-dev`); linked by `build.rs` when the
//! `rbd` feature is on. Handles are opaque pointers; every function returns 0 or a negative
//! errno unless noted.

#![allow(non_camel_case_types)]

use std::os::raw::{c_char, c_int, c_void};

pub type rados_t = *mut c_void;
pub type rados_ioctx_t = *mut c_void;
pub type rbd_image_t = *mut c_void;
pub type rbd_completion_t = *mut c_void;
pub type rbd_callback_t = Option<unsafe extern "C" fn(cb: rbd_completion_t, arg: *mut c_void)>;

/// `rbd_set_image_notification` type: signal an eventfd when completions are ready.
pub const EVENT_TYPE_EVENTFD: c_int = 2;

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
    pub fn rados_connect(cluster: rados_t) -> c_int;
    pub fn rados_shutdown(cluster: rados_t);
    pub fn rados_ioctx_create(
        cluster: rados_t,
        pool: *const c_char,
        io: *mut rados_ioctx_t,
    ) -> c_int;
    pub fn rados_ioctx_destroy(io: rados_ioctx_t);
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
    pub fn rbd_set_image_notification(image: rbd_image_t, fd: c_int, type_: c_int) -> c_int;
    pub fn rbd_poll_io_events(
        image: rbd_image_t,
        comps: *mut rbd_completion_t,
        numcomp: c_int,
    ) -> c_int;
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
}
