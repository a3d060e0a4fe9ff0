//! A thread's I/O priority: the idle class for the threads of a block job, so that their
//! reads and writes wait while the guest's are queued for the same disk, and a way out of
//! it while the thread holds a lock the guest's requests also take.
//!
//! The idle class (`ioprio_set(2)`) is honoured by the schedulers that know priorities
//! (mq-deadline, bfq; `none`, the usual default for NVMe, ignores it). Under a busy guest
//! an idle request can wait long: mq-deadline serves it after `prio_aging_expire` (10 s
//! by default), bfq at least every 200 ms. A thread that must not be waited for that long
//! (it holds the qcow2 L2 cache lock while it loads a table) runs at the normal priority
//! for that read: [`normal`].

use std::cell::Cell;

/// `IOPRIO_PRIO_VALUE(IOPRIO_CLASS_IDLE, 0)`.
pub(crate) const CLASS_IDLE: libc::c_int = 3 << 13;
/// `IOPRIO_PRIO_VALUE(IOPRIO_CLASS_BE, 4)`: the default's class and level.
const CLASS_BE_DEFAULT: libc::c_int = (2 << 13) | 4;
pub(crate) const WHO_PROCESS: libc::c_int = 1;

thread_local! {
    /// This thread was put in the idle class by [`set_idle`].
    static IDLE: Cell<bool> = const { Cell::new(false) };
}

fn set(class: libc::c_int) -> bool {
    // SAFETY: plain system calls about the calling thread, no memory passed.
    unsafe {
        let tid = libc::syscall(libc::SYS_gettid) as libc::c_int;
        libc::syscall(libc::SYS_ioprio_set, WHO_PROCESS, tid, class) == 0
    }
}

/// Put the calling thread in the idle I/O class. Best effort: where the kernel refuses
/// (a seccomp filter), it stays as it was; false then.
pub fn set_idle() -> bool {
    let ok = set(CLASS_IDLE);
    IDLE.with(|i| i.set(ok));
    ok
}

/// While it lives, the calling thread is back at the normal I/O priority, if it was idle.
pub struct Normal {
    restore: bool,
}

/// The calling thread at the normal I/O priority until the guard drops (nothing to do,
/// no system call, for a thread that is not idle: the queue threads).
pub fn normal() -> Normal {
    let restore = IDLE.with(|i| i.get()) && set(CLASS_BE_DEFAULT);
    Normal { restore }
}

impl Drop for Normal {
    fn drop(&mut self) {
        if self.restore {
            set(CLASS_IDLE);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn class() -> i64 {
        // SAFETY: a plain system call about the calling thread.
        unsafe {
            let tid = libc::syscall(libc::SYS_gettid) as libc::c_int;
            libc::syscall(libc::SYS_ioprio_get, WHO_PROCESS, tid) >> 13
        }
    }

    #[test]
    fn an_idle_thread_is_normal_only_while_the_guard_lives() {
        std::thread::spawn(|| {
            assert!(set_idle());
            assert_eq!(class(), 3);
            {
                let _n = normal();
                assert_eq!(class(), 2, "best effort while the guard lives");
            }
            assert_eq!(class(), 3, "idle again");
        })
        .join()
        .unwrap();
        // A thread that never was idle: the guard changes nothing.
        std::thread::spawn(|| {
            let before = class();
            let _n = normal();
            assert_eq!(class(), before);
        })
        .join()
        .unwrap();
    }
}
