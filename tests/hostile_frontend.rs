//! A hostile frontend over a real socket: memory tables that lie about their files, guest
//! memory taken away after set-up, avail indexes the device cannot follow, rings outside
//! memory, more regions than offered, garbage messages. After each probe the daemon must be
//! alive, the next honest client (libblkio) served correctly, and the image unchanged.

mod common;

use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use vhost::vhost_user::VhostUserFrontend;
use vhost::VhostBackend;

use common::*;

const HDR: u64 = 0x3000;
const STATUS: u64 = 0x3100;
const DATA: u64 = 0x10_0000;

/// A 4 KiB request of `type_` at sector 0 with its data at `data` (a guest address) and
/// its status at `status`; published as avail entry 0 with avail index `idx`.
fn request(g: &Guest, type_: u32, data: u64, status: u64, idx: u16) {
    g.w(HDR, type_);
    g.w(HDR + 4, 0u32);
    g.w(HDR + 8, 0u64);
    let write_flag = if type_ == 0 { 2 } else { 0 };
    g.desc(0, GPA + HDR, 16, 1, 1);
    g.desc(1, data, 4096, 1 | write_flag, 2);
    g.desc(2, status, 1, 2, 0);
    g.w(AVAIL + 4, 0u16);
    g.w(AVAIL + 2, idx);
}

/// After a probe: the daemon is alive, serves an honest client, and the image holds what
/// it held.
fn still_serving(backend: &Backend, img: &Path, original: &[u8], probe: &str) {
    std::thread::sleep(Duration::from_millis(100));
    backend.assert_running();
    let mut c = connect_queues(&backend.socket, 1);
    let got = c
        .read_at(0, 0, 65536)
        .unwrap_or_else(|e| panic!("{probe}: read: {e}"));
    assert_same(&got, &original[..65536], probe);
    drop(c);
    backend.assert_running();
    assert_same(
        &read_file(img),
        original,
        &format!("{probe}: image changed"),
    );
}

#[test]
fn hostile_frontends_never_take_the_daemon_down() {
    if skip_unless_vublk("probes vublk's own handling") {
        return;
    }
    let dir = TestDir::new("hostile");
    let img = dir.join("img.raw");
    create_pattern_image(&img, 16 * MIB, 7);
    let original = read_file(&img);
    let opts = BackendOpts {
        extra_args: vec!["--detect-zeroes".into(), "on".into()],
        ..BackendOpts::default()
    };
    let backend = Backend::start(&dir, &img, &opts);
    let log_lines = || backend.log_contents().lines().count();

    // 1. A region claiming more than its file holds: refused.
    for (size, offset) in [(1u64 << 30, 0u64), (MEM_LEN, 1 << 30)] {
        let g = guest();
        let mut fe = frontend(&backend.socket);
        let mut r = g.region();
        r.memory_size = size;
        r.mmap_offset = offset;
        assert!(
            fe.set_mem_table(&[r]).is_err(),
            "a region beyond its file was accepted"
        );
        request(&g, 1, GPA + (40 << 20), GPA + STATUS, 1);
        let _kicks = start_queue(&mut fe, &g, USED);
        drop(fe);
        still_serving(&backend, &img, &original, "region beyond its file");
    }

    // 2. Guest memory taken away after set-up (the memfd shrunk): the status byte and the
    //    data are gone; the daemon survives the bus errors.
    {
        let g = guest();
        let mut fe = frontend(&backend.socket);
        fe.set_mem_table(&[g.region()]).unwrap();
        request(&g, 1, GPA + DATA, GPA + DATA + 8192, 1);
        g.file.set_len(0x4000).unwrap();
        let (_k, call) = start_queue(&mut fe, &g, USED);
        let _ = call;
        std::thread::sleep(Duration::from_millis(200));
        drop(fe);
        still_serving(&backend, &img, &original, "memfd shrunk");
        assert!(
            backend.log_contents().contains("went away"),
            "{}",
            backend.log_contents()
        );
    }

    // 3. Avail indexes the device cannot follow: far ahead; one entry more than the ring.
    for idx in [60000u16, QSIZE + 1] {
        let before = log_lines();
        let g = guest();
        let mut fe = frontend(&backend.socket);
        fe.set_mem_table(&[g.region()]).unwrap();
        request(&g, 1, GPA + DATA, GPA + STATUS, idx);
        let (kick, _call) = start_queue(&mut fe, &g, USED);
        for _ in 0..100 {
            kick.write(1).unwrap();
        }
        std::thread::sleep(Duration::from_millis(300));
        drop(fe);
        still_serving(&backend, &img, &original, "avail index ahead");
        let added = log_lines() - before;
        assert!(added < 60, "avail index {idx}: {added} log lines");
    }

    // 4. A used ring past the end of guest memory.
    {
        let g = guest();
        let mut fe = frontend(&backend.socket);
        fe.set_mem_table(&[g.region()]).unwrap();
        request(&g, 1, GPA + DATA, GPA + STATUS, 1);
        let _kicks = start_queue(&mut fe, &g, MEM_LEN - 16);
        std::thread::sleep(Duration::from_millis(100));
        drop(fe);
        still_serving(&backend, &img, &original, "used ring outside memory");
    }

    // 5. More memory regions than GET_MAX_MEM_SLOTS allows.
    {
        let mut fe = frontend(&backend.socket);
        let slots = fe.get_max_mem_slots().unwrap();
        let f = memfd(4096);
        let mut refused = 0;
        for i in 0..slots + 20 {
            let addr = GPA + i * 0x10_0000;
            // SAFETY: a fresh shared mapping of the memfd, unmapped below.
            let hva = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    4096,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_SHARED,
                    f.as_raw_fd(),
                    0,
                )
            };
            let r = region(addr, 4096, hva as u64, f.as_raw_fd());
            if fe.add_mem_region(&r).is_err() {
                refused += 1;
            }
            // SAFETY: unmaps the mapping made above.
            unsafe { libc::munmap(hva, 4096) };
        }
        assert!(refused >= 20, "{refused} of {} regions refused", slots + 20);
        drop(fe);
        still_serving(&backend, &img, &original, "too many regions");
    }

    // 6. A ring size that is not a power of two is refused, not silently ignored.
    {
        let g = guest();
        let fe = frontend(&backend.socket);
        fe.set_mem_table(&[g.region()]).unwrap();
        // Refused (and, as every refused message, the session ends).
        assert!(
            fe.set_vring_num(0, 3).is_err(),
            "SET_VRING_NUM 3 was accepted"
        );
        drop(fe);
        still_serving(&backend, &img, &original, "ring size 3");
    }

    // 7. Garbage and truncated messages.
    for junk in [
        &[0xffu8; 64][..],
        &[1, 0, 0, 0, 1, 0, 0, 0, 0xff, 0xff, 0xff, 0x7f][..],
        &[3u8][..],
    ] {
        let mut s = UnixStream::connect(&backend.socket).unwrap();
        let _ = s.write_all(junk);
        drop(s);
        still_serving(&backend, &img, &original, "garbage message");
    }

    assert_eq!(backend.sigterm_and_wait(EXIT_DEADLINE).code(), Some(0));
    assert_same(&read_file(&img), &original, "image after the probes");
}
