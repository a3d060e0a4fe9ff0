//! One NBD connection shared by every queue, for servers that allow only one
//! (no `NBD_FLAG_CAN_MULTI_CONN`). A connection thread owns the [`NbdEngine`]; each queue's
//! engine ([`NbdQueue`]) hands its operations over (a short list and an eventfd, taken by
//! that one thread: no lock held on the data path while anything waits) and gets its
//! completions back through its own [`Inbox`], which signals the queue's eventfd, like
//! librbd's. Requests of all queues are multiplexed on the connection by handle.

use std::collections::HashMap;
use std::io;
use std::os::fd::AsRawFd;
use std::sync::{Arc, Mutex};

use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use super::NbdEngine;
use crate::io::{Completion, Op};
use crate::locks::Locked;
use crate::offload::{Inbox, Mailbox};

/// An operation on its way to the connection thread.
struct Handed {
    op: Op,
    user_data: u64,
    to: Arc<Inbox>,
}

// SAFETY: the operation's pointers name buffers its queue keeps alive and untouched until
// the completion comes back (the contract of `Engine::push`); only the connection thread
// uses them meanwhile.
unsafe impl Send for Handed {}

struct Shared {
    queue: Mutex<Vec<Handed>>,
    wake: EventFd,
}

/// The connection thread's handle: queues are made from it; the thread ends when the last
/// queue is gone (its connection flushed and closed).
#[derive(Clone)]
pub struct NbdConnection {
    shared: Arc<Shared>,
}

impl NbdConnection {
    /// Start the thread over `engine` (the one connection).
    pub fn start(engine: NbdEngine) -> io::Result<NbdConnection> {
        let shared = Arc::new(Shared {
            queue: Mutex::new(Vec::new()),
            wake: EventFd::new(EFD_NONBLOCK)?,
        });
        let weak = Arc::downgrade(&shared);
        let wake = shared.wake.try_clone()?;
        std::thread::Builder::new()
            .name("vublk-nbd".into())
            .spawn(move || run(engine, weak, wake))?;
        Ok(NbdConnection { shared })
    }

    /// A queue's engine on this connection.
    pub fn queue(&self) -> io::Result<NbdQueue> {
        Ok(NbdQueue {
            conn: self.shared.clone(),
            mailbox: Mailbox::new()?,
        })
    }
}

fn run(mut engine: NbdEngine, shared: std::sync::Weak<Shared>, wake: EventFd) {
    let mut ids: HashMap<u64, (u64, Arc<Inbox>)> = HashMap::new();
    let mut next = 0u64;
    let mut got = Vec::new();
    let mut taken = Vec::new();
    loop {
        let mut fds = [
            libc::pollfd {
                fd: wake.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: engine.event_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: two valid pollfds. A timeout so that a connection whose queues all went
        // away is noticed.
        unsafe { libc::poll(fds.as_mut_ptr(), 2, 200) };
        let _ = wake.read();
        let Some(s) = shared.upgrade() else {
            if ids.is_empty() {
                return;
            }
            engine.reap(&mut got);
            route(&mut got, &mut ids);
            continue;
        };
        std::mem::swap(&mut *s.queue.locked(), &mut taken);
        drop(s);
        for h in taken.drain(..) {
            next = next.wrapping_add(1);
            ids.insert(next, (h.user_data, h.to));
            // SAFETY: the queue's contract, handed on (see `Handed`).
            if let Err(e) = unsafe { engine.push(&h.op, next) } {
                if let Some((ud, to)) = ids.remove(&next) {
                    to.post(Completion {
                        user_data: ud,
                        result: -e.raw_os_error().unwrap_or(libc::EIO),
                    });
                }
            }
        }
        engine.reap(&mut got);
        route(&mut got, &mut ids);
    }
}

fn route(got: &mut Vec<Completion>, ids: &mut HashMap<u64, (u64, Arc<Inbox>)>) {
    for c in got.drain(..) {
        if let Some((ud, to)) = ids.remove(&c.user_data) {
            to.post(Completion {
                user_data: ud,
                result: c.result,
            });
        }
    }
}

/// A queue's engine on a shared connection.
pub struct NbdQueue {
    conn: Arc<Shared>,
    mailbox: Mailbox,
}

impl NbdQueue {
    /// # Safety
    /// See [`super::Engine::push`].
    pub unsafe fn push(&mut self, op: &Op, user_data: u64) -> io::Result<()> {
        self.conn.queue.locked().push(Handed {
            op: *op,
            user_data,
            to: self.mailbox.inbox().clone(),
        });
        self.conn.wake.write(1)
    }

    pub fn wait_one(&mut self) -> io::Result<()> {
        self.mailbox.wait();
        Ok(())
    }

    pub fn has_completions(&mut self) -> bool {
        self.mailbox.has()
    }

    pub fn reap(&mut self, out: &mut Vec<Completion>) {
        self.mailbox.take(out);
    }

    pub fn event_fd(&self) -> i32 {
        self.mailbox.event_fd()
    }
}
