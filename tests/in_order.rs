//! VIRTIO_F_IN_ORDER over a real socket: a test frontend (vhost's `Frontend`, memfd guest
//! memory, a hand-built split ring) acks it or not, and puts slow reads (a null disk with a
//! latency) and instant GET_IDs on the ring in turn. Without IN_ORDER the GET_IDs are used
//! first; with it the used ring follows the available ring, also across a vublk killed with
//! a finished request still held behind a slow one (the inflight region keeps it, the next
//! process runs it again in its place).

mod common;

use std::os::fd::AsRawFd;
use std::time::Duration;

use vhost::vhost_user::message::VhostUserInflight;
use vhost::vhost_user::VhostUserFrontend;
use vhost::VhostBackend;

use common::*;

/// virtio 1.1 feature bit 35.
const VIRTIO_F_IN_ORDER: u64 = 1 << 35;
const HDRS: u64 = 0x3000;
const DATA: u64 = 0x10_0000;
const T_IN: u32 = 0;
const T_GET_ID: u32 = 8;

/// Request `k` at heads 3k..3k+2: a 4 KiB read of sector 8k, or a GET_ID.
fn request(g: &Guest, k: u16, kind: u32) -> u16 {
    let hdr = HDRS + u64::from(k) * 32;
    let data = DATA + u64::from(k) * 4096;
    g.w(hdr, kind);
    g.w(hdr + 4, 0u32);
    g.w(hdr + 8, 8 * u64::from(k));
    g.w(hdr + 16, 0xffu8);
    let len = if kind == T_GET_ID { 20 } else { 4096 };
    let head = k * 3;
    g.desc(head, GPA + hdr, 16, 1, head + 1);
    g.desc(head + 1, GPA + data, len, 1 | 2, head + 2);
    g.desc(head + 2, GPA + hdr + 16, 1, 2, 0);
    head
}

fn status(g: &Guest, k: u16) -> u8 {
    g.r::<u8>(HDRS + u64::from(k) * 32 + 16)
}

/// Reads wait `latency_ms` on a null disk; GET_ID completes at once.
fn null_backend(dir: &TestDir, latency_ms: u64) -> Backend {
    let spec = format!("null:64M?latency-ns={}", latency_ms * 1_000_000);
    Backend::start(dir, std::path::Path::new(&spec), &BackendOpts::default())
}

/// Reads and GET_IDs in turn: used in the order they finished without IN_ORDER (the test
/// sees the reordering it checks for), in the available order with it.
#[test]
fn the_used_ring_follows_the_available_ring_once_in_order_is_acked() {
    if skip_unless_vublk("IN_ORDER is vublk's feature") {
        return;
    }
    let dir = TestDir::new("in-order");
    for in_order in [false, true] {
        let backend = null_backend(&dir, 200);
        let mut fe = frontend_acking(&backend.socket, |f| {
            assert_ne!(f & VIRTIO_F_IN_ORDER, 0, "IN_ORDER not offered");
            if in_order {
                f
            } else {
                f & !VIRTIO_F_IN_ORDER
            }
        });
        let g = guest();
        fe.set_mem_table(&[g.region()]).unwrap();
        let kinds = [T_IN, T_GET_ID, T_IN, T_GET_ID, T_GET_ID];
        let heads: Vec<u16> = kinds
            .iter()
            .enumerate()
            .map(|(k, &t)| request(&g, k as u16, t))
            .collect();
        publish_heads(&g, &heads);
        let _kicks = start_queue(&mut fe, &g, USED);
        wait_used(&g, 5, 20, "requests");
        for k in 0..5 {
            assert_eq!(status(&g, k), 0, "request {k} (in_order {in_order})");
        }
        let used = used_heads(&g);
        if in_order {
            assert_eq!(
                used, heads,
                "IN_ORDER acked: used out of the available order"
            );
        } else {
            assert_eq!(
                used,
                vec![heads[1], heads[3], heads[4], heads[0], heads[2]],
                "without IN_ORDER the instant requests are used first (else this test \
                 cannot tell the orders apart)"
            );
        }
        drop(fe);
        assert_eq!(backend.sigterm_and_wait(EXIT_DEADLINE).code(), Some(0));
    }
}

/// IN_ORDER across a crash: the first process finished the GET_ID but held it behind the
/// slow read before it (nothing used yet), and was killed. Its inflight region still marks
/// all three; the next process resubmits them in the order taken and uses them in the
/// available order, each once.
#[test]
fn a_request_held_for_order_survives_a_killed_vublk() {
    if skip_unless_vublk("IN_ORDER is vublk's feature") {
        return;
    }
    let dir = TestDir::new("in-order-restart");
    let g = guest();
    let kinds = [T_IN, T_GET_ID, T_IN];
    let heads: Vec<u16> = kinds
        .iter()
        .enumerate()
        .map(|(k, &t)| request(&g, k as u16, t))
        .collect();
    publish_heads(&g, &heads);

    let first = null_backend(&dir, 3000);
    let mut fe = frontend(&first.socket);
    let (info, region) = fe
        .get_inflight_fd(&VhostUserInflight::new(0, 0, 1, QSIZE))
        .unwrap();
    fe.set_inflight_fd(&info, region.as_raw_fd()).unwrap();
    fe.set_mem_table(&[g.region()]).unwrap();
    let _kicks = start_queue(&mut fe, &g, USED);
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(status(&g, 1), 0, "the GET_ID has not run");
    assert_eq!(
        used_idx(&g),
        0,
        "the GET_ID was used before the read taken before it"
    );
    first.signal(libc::SIGKILL);
    first.wait_exit(EXIT_DEADLINE);
    drop(fe);
    g.w(HDRS + 32 + 16, 0xffu8);

    let second = null_backend(&dir, 50);
    let mut fe = frontend(&second.socket);
    fe.set_inflight_fd(&info, region.as_raw_fd()).unwrap();
    fe.set_mem_table(&[g.region()]).unwrap();
    let _kicks = start_queue_at(&mut fe, &g, USED, 0);
    wait_used(&g, 3, 20, "after the restart");
    assert_eq!(used_heads(&g), heads);
    for k in 0..3 {
        assert_eq!(status(&g, k), 0, "request {k}");
    }
    drop(fe);
    assert_eq!(second.sigterm_and_wait(EXIT_DEADLINE).code(), Some(0));
}
