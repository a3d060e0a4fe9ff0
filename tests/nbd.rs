//! vublk's NBD client against real servers (qemu-nbd on a UNIX socket, nbdkit's memory
//! plugin on 127.0.0.1), started and stopped by PID by each test: the handshake (size,
//! transmission flags, block sizes, structured replies), requests and replies on the wire
//! (a write, a structured read back, flush, trim, write-zeroes, checked on the served file),
//! and the refusals (no such export, nothing listening, not an NBD server) within bounded
//! time.

mod common;

use std::io::{Read, Write};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use common::*;
use vublk::nbd::wire::*;
use vublk::nbd::{connect as nbd_connect, NbdTarget, Stream};

fn send(s: &mut Stream, r: Request, data: &[u8]) {
    s.write_all(&r.encode()).unwrap();
    s.write_all(data).unwrap();
}

/// Read one complete reply to `handle` (simple, or structured chunks up to DONE) into `buf`
/// (a read's destination): Ok(()) or the NBD error.
fn reply(s: &mut Stream, handle: u64, offset: u64, buf: &mut [u8]) -> Result<(), u32> {
    loop {
        let mut h = [0u8; 20];
        s.read_exact(&mut h[..4]).unwrap();
        let need = if u32::from_be_bytes(h[..4].try_into().unwrap()) == SIMPLE_REPLY_MAGIC {
            SIMPLE_REPLY_LEN
        } else {
            CHUNK_HEADER_LEN
        };
        s.read_exact(&mut h[4..need]).unwrap();
        match decode_reply(&h[..need]).unwrap().unwrap().0 {
            ReplyHeader::Simple { handle: hd, error } => {
                assert_eq!(hd, handle);
                if error != 0 {
                    return Err(error);
                }
                s.read_exact(buf).unwrap();
                return Ok(());
            }
            ReplyHeader::Chunk {
                handle: hd,
                flags,
                kind,
                len,
            } => {
                assert_eq!(hd, handle);
                let mut p = vec![0u8; len as usize];
                s.read_exact(&mut p).unwrap();
                let at =
                    |o: &[u8]| (u64::from_be_bytes(o[..8].try_into().unwrap()) - offset) as usize;
                match kind {
                    REPLY_TYPE_OFFSET_DATA => {
                        let o = at(&p);
                        buf[o..o + p.len() - 8].copy_from_slice(&p[8..]);
                    }
                    REPLY_TYPE_OFFSET_HOLE => {
                        let o = at(&p);
                        let n = u32::from_be_bytes(p[8..12].try_into().unwrap()) as usize;
                        buf[o..o + n].fill(0);
                    }
                    REPLY_TYPE_ERROR | REPLY_TYPE_ERROR_OFFSET => {
                        return Err(u32::from_be_bytes(p[..4].try_into().unwrap()))
                    }
                    _ => {}
                }
                if flags & REPLY_FLAG_DONE != 0 {
                    return Ok(());
                }
            }
        }
    }
}

fn req(kind: u16, flags: u16, handle: u64, offset: u64, len: u32) -> Request {
    Request {
        flags,
        kind,
        handle,
        offset,
        len,
    }
}

/// Write, read back (structured), write-zeroes, trim and flush on the wire, against `s`.
fn round_trip(s: &mut Stream, structured: bool) -> Vec<u8> {
    let data = pattern(65536, 0, 19);
    send(s, req(CMD_WRITE, 0, 1, MIB, 65536), &data);
    reply(s, 1, MIB, &mut []).unwrap();
    send(
        s,
        req(CMD_WRITE_ZEROES, CMD_FLAG_NO_HOLE, 2, MIB + 4096, 4096),
        &[],
    );
    reply(s, 2, 0, &mut []).unwrap();
    send(s, req(CMD_FLUSH, 0, 3, 0, 0), &[]);
    reply(s, 3, 0, &mut []).unwrap();
    let mut back = vec![0x5au8; 3 * 65536];
    send(s, req(CMD_READ, 0, 4, MIB - 65536, 3 * 65536), &[]);
    reply(s, 4, MIB - 65536, &mut back).unwrap();
    assert!(structured, "the server did not agree to structured replies");
    assert_all_zero(&back[..65536], "before the write");
    assert_same(&back[65536..65536 + 4096], &data[..4096], "read back");
    assert_all_zero(&back[65536 + 4096..65536 + 8192], "write-zeroes");
    assert_same(&back[65536 + 8192..131072], &data[8192..], "read back");
    assert_all_zero(&back[131072..], "after the write");
    // A read past the end is the server's error, for that request only.
    send(s, req(CMD_READ, 0, 5, 1 << 40, 512), &[]);
    assert!(reply(s, 5, 1 << 40, &mut [0u8; 512]).is_err());
    send(s, req(CMD_TRIM, 0, 6, 8 * MIB, 65536), &[]);
    reply(s, 6, 0, &mut []).unwrap();
    send(s, req(CMD_DISC, 0, 7, 0, 0), &[]);
    data
}

#[test]
fn qemu_nbd_handshake_and_requests_on_the_wire() {
    let dir = TestDir::new("nbd-qemu");
    let img = dir.join("disk.raw");
    create_sparse_image(&img, 64 * MIB);
    let Some((_srv, sock)) = qemu_nbd(&dir, &img) else {
        return;
    };
    let uri = format!("nbd+unix:///disk?socket={}", sock.display());
    let t = NbdTarget::parse(&uri).unwrap();
    let (mut s, e) = nbd_connect(&t, Duration::from_secs(5)).unwrap();
    println!("qemu-nbd: {e:?}");
    assert_eq!(e.size, 64 * MIB);
    for f in [
        FLAG_SEND_FLUSH,
        FLAG_SEND_FUA,
        FLAG_SEND_TRIM,
        FLAG_SEND_WRITE_ZEROES,
    ] {
        assert!(e.has(f), "flag {f:#x} missing: {:#x}", e.flags);
    }
    assert!(!e.has(FLAG_READ_ONLY));
    assert!(e.min_block >= 1 && e.max_block >= 65536, "{e:?}");
    let data = round_trip(&mut s, e.structured);
    drop(s);
    let f = read_file_range(&img, MIB, 65536);
    assert_same(&f[..4096], &data[..4096], "the served file");
    assert_all_zero(&f[4096..8192], "the served file, zeroed");

    // An export that is not there: the server's answer, named.
    let t = NbdTarget::parse(&format!("nbd+unix:///nope?socket={}", sock.display())).unwrap();
    let err = nbd_connect(&t, Duration::from_secs(5))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("nope") && err.contains("no such export"),
        "{err}"
    );
}

#[test]
fn nbdkit_memory_over_tcp() {
    let Some((_srv, port)) = nbdkit_memory("64M") else {
        return;
    };
    let t = NbdTarget::parse(&format!("nbd://127.0.0.1:{port}/")).unwrap();
    let (mut s, e) = nbd_connect(&t, Duration::from_secs(5)).unwrap();
    println!("nbdkit memory: {e:?}");
    assert_eq!(e.size, 64 * MIB);
    assert!(e.has(FLAG_CAN_MULTI_CONN), "{:#x}", e.flags);
    round_trip(&mut s, e.structured);
}

#[test]
fn unreachable_and_foreign_servers_fail_in_bounded_time() {
    // Nothing listening.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let t = NbdTarget::parse(&format!("nbd://127.0.0.1:{port}/x")).unwrap();
    let err = nbd_connect(&t, Duration::from_secs(2))
        .unwrap_err()
        .to_string();
    assert!(err.contains("connecting to"), "{err}");
    // A server that accepts and says nothing: the deadline.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = silent.local_addr().unwrap().port();
    let t = NbdTarget::parse(&format!("nbd://127.0.0.1:{port}/x")).unwrap();
    let t0 = Instant::now();
    let err = nbd_connect(&t, Duration::from_secs(1))
        .unwrap_err()
        .to_string();
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    assert!(err.contains("handshake"), "{err}");
    // A server that speaks something else.
    let other = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = other.local_addr().unwrap().port();
    let h = std::thread::spawn(move || {
        let (mut c, _) = other.accept().unwrap();
        let _ = c.write_all(b"HTTP/1.1 400 Bad Request\r\n\r\n");
        std::thread::sleep(Duration::from_millis(200));
    });
    let t = NbdTarget::parse(&format!("nbd://127.0.0.1:{port}/x")).unwrap();
    let err = nbd_connect(&t, Duration::from_secs(2))
        .unwrap_err()
        .to_string();
    assert!(err.contains("not an NBD server"), "{err}");
    h.join().unwrap();
    drop(silent);
}

/// The NBD engine alone, as a queue drives it: batches of up to 16 operations on disjoint
/// ranges in flight together (reads, writes in 1-3 segments, some write-through, zeroing
/// with and without unmap, discards, flushes), reaped through the engine's event fd; every
/// read equals the model. Returns the model (discarded bytes: either old data or zero).
fn engine_model_check(target: &str) -> Option<(Vec<u8>, Vec<bool>)> {
    use vublk::image::Engine;
    use vublk::io::{Completion, Op};
    use vublk::nbd::client::NbdEngine;
    const SIZE: u64 = 32 * MIB;
    let t = NbdTarget::parse(target).unwrap();
    let (s, e) = nbd_connect(&t, Duration::from_secs(5)).unwrap();
    assert!(e.size >= SIZE);
    let mut eng = Engine::Nbd(NbdEngine::new(s, e).unwrap());
    let mut model = vec![0u8; SIZE as usize];
    let mut unknown = vec![false; SIZE as usize];
    let mut rng = Rng::new(0x5eed_0019);
    let mut counts = [0usize; 6];
    for round in 0..60 {
        // Disjoint ranges: each op takes its own 1 MiB slot of the disk.
        let mut slots: Vec<u64> = (0..SIZE / MIB).collect();
        // (user_data, buffer, its iovecs, what, offset, length)
        #[allow(clippy::type_complexity)]
        let mut bufs: Vec<(u64, Vec<u8>, Vec<libc::iovec>, usize, u64, u64)> = Vec::new();
        for ud in 0..16u64 {
            let i = rng.below(slots.len() as u64) as usize;
            let slot = slots.swap_remove(i);
            let len = (rng.range(1, 2048) * 512).min(MIB) as usize;
            let off = slot * MIB + rng.below((MIB - len as u64) / 512 + 1) * 512;
            let what = rng.below(10) as usize;
            let mut buf = vec![0u8; len];
            if what <= 3 {
                rng.fill(&mut buf);
            }
            // 1-3 segments.
            let cut1 = (rng.below(len as u64 / 512 + 1) * 512) as usize;
            let cut2 = cut1 + ((rng.below(((len - cut1) / 512) as u64 + 1)) * 512) as usize;
            let p = buf.as_mut_ptr();
            let iov: Vec<libc::iovec> = [(0, cut1), (cut1, cut2), (cut2, len)]
                .iter()
                .filter(|(a, b)| b > a)
                .map(|&(a, b)| libc::iovec {
                    // SAFETY: inside `buf`.
                    iov_base: unsafe { p.add(a) }.cast(),
                    iov_len: b - a,
                })
                .collect();
            bufs.push((ud, buf, iov, what, off, len as u64));
        }
        for (ud, buf, iov, what, off, len) in &bufs {
            let (off, len) = (*off, *len);
            let r = off as usize..(off + len) as usize;
            let op = match what {
                0..=3 => {
                    counts[0] += 1;
                    model[r.clone()].copy_from_slice(buf);
                    unknown[r].fill(false);
                    Op::Writev {
                        iov: iov.as_ptr(),
                        iovcnt: iov.len() as u32,
                        offset: off,
                        dsync: *what == 3,
                    }
                }
                4..=6 => {
                    counts[1] += 1;
                    Op::Readv {
                        iov: iov.as_ptr(),
                        iovcnt: iov.len() as u32,
                        offset: off,
                    }
                }
                7 => {
                    counts[2] += 1;
                    model[r.clone()].fill(0);
                    unknown[r].fill(false);
                    let mode = if rng.below(2) == 0 {
                        vublk::io::sys::ZERO_RANGE
                    } else {
                        vublk::io::sys::PUNCH_HOLE
                    };
                    Op::Fallocate {
                        mode,
                        offset: off,
                        len,
                    }
                }
                8 => {
                    counts[3] += 1;
                    unknown[r].fill(true);
                    Op::Discard { offset: off, len }
                }
                _ => {
                    counts[4] += 1;
                    Op::Fdatasync
                }
            };
            // SAFETY: `bufs` (buffers and iovec arrays) lives until every completion of the
            // round has been reaped below.
            unsafe { eng.push(0, &op, *ud).unwrap() };
        }
        eng.submit().unwrap();
        let mut done: Vec<Completion> = Vec::new();
        let t0 = Instant::now();
        while done.len() < bufs.len() {
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "round {round}: {done:?}"
            );
            let mut p = libc::pollfd {
                fd: eng.event_fd().unwrap(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid pollfd.
            unsafe { libc::poll(&mut p, 1, 100) };
            eng.reap(&mut done);
        }
        for c in &done {
            let (_, buf, _, what, off, len) = &bufs[c.user_data as usize];
            let want = if *what <= 6 { *len as i32 } else { 0 };
            assert_eq!(c.result, want, "round {round}: op {what} of {len} at {off}");
            if (4..=6).contains(what) {
                let r = *off as usize..(*off + *len) as usize;
                for (i, (&g, (&m, &u))) in buf
                    .iter()
                    .zip(model[r.clone()].iter().zip(&unknown[r]))
                    .enumerate()
                {
                    assert!(
                        g == m || (u && g == 0),
                        "round {round}: read of {len} at {off}: byte {i}: {g:#x}, expected {m:#x}"
                    );
                }
            }
        }
    }
    println!(
        "{} writes, {} reads, {} zeroings, {} discards, {} flushes",
        counts[0], counts[1], counts[2], counts[3], counts[4]
    );
    Some((model, unknown))
}

#[test]
fn the_nbd_engine_matches_the_model_on_qemu_nbd_and_the_file() {
    let dir = TestDir::new("nbd-engine-qemu");
    let img = dir.join("disk.raw");
    create_sparse_image(&img, 32 * MIB);
    let Some((srv, sock)) = qemu_nbd(&dir, &img) else {
        return;
    };
    let (model, unknown) =
        engine_model_check(&format!("nbd+unix:///disk?socket={}", sock.display())).unwrap();
    drop(srv);
    let f = read_file(&img);
    for (i, (&g, (&m, &u))) in f.iter().zip(model.iter().zip(&unknown)).enumerate() {
        assert!(
            g == m || (u && g == 0),
            "the served file: byte {i}: {g:#x}, expected {m:#x}"
        );
    }
}

/// nbdkit with a 64 KiB maximum block size: requests up to 1 MiB are split (a request over
/// the maximum is an error with `blocksize-error-policy=error`).
#[test]
fn the_nbd_engine_splits_requests_for_nbdkit_block_limits() {
    let Some((_srv, port)) = nbdkit(&[
        "--filter=blocksize-policy",
        "memory",
        "64M",
        "blocksize-preferred=4096",
        "blocksize-maximum=65536",
        "blocksize-error-policy=error",
    ]) else {
        return;
    };
    let t = format!("nbd://127.0.0.1:{port}/");
    let (_, e) = nbd_connect(&NbdTarget::parse(&t).unwrap(), Duration::from_secs(5)).unwrap();
    assert_eq!(e.max_block, 65536, "{e:?}");
    engine_model_check(&t).unwrap();
}

/// vublk serving the NBD URI `uri` with `extra` options.
fn serve(dir: &TestDir, uri: &str, queues: u32, extra: &[&str]) -> Backend {
    Backend::start(
        dir,
        Path::new(uri),
        &BackendOpts {
            num_queues: Some(queues),
            extra_args: extra.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        },
    )
}

/// The randomized model check through vublk (libblkio, every request type) on qemu-nbd
/// serving a file over a UNIX socket: every read, the whole disk and the file afterwards
/// equal the model.
#[test]
fn served_qemu_nbd_export_matches_the_model_and_the_file() {
    let dir = TestDir::new("nbd-serve-qemu");
    let img = dir.join("disk.raw");
    create_sparse_image(&img, 32 * MIB);
    let Some((srv, sock)) = qemu_nbd(&dir, &img) else {
        return;
    };
    let uri = format!("nbd+unix:///disk?socket={}", sock.display());
    let backend = serve(&dir, &uri, 2, &["--discard", "unmap"]);
    let mut c = connect(&backend.socket, ClientOpts::default());
    assert_eq!(c.capacity(), 32 * MIB);
    let m = random_requests(&mut c, 32 * MIB, 400, 0x5eed_0191);
    let all = c.read_all(0);
    m.check(&all, 0, "the whole disk through vublk");
    drop(c);
    let st = backend.sigterm_and_wait(EXIT_DEADLINE);
    assert!(st.success(), "{st}\n{}", backend.log_contents());
    drop(srv);
    assert_same(&read_file(&img), &all, "the served file");
}

/// The same on nbdkit's memory plugin over TCP (127.0.0.1), two queues.
#[test]
fn served_nbdkit_memory_export_matches_the_model() {
    let dir = TestDir::new("nbd-serve-nbdkit");
    let Some((_srv, port)) = nbdkit_memory("32M") else {
        return;
    };
    let uri = format!("nbd://127.0.0.1:{port}/");
    let backend = serve(
        &dir,
        &uri,
        2,
        &["--discard", "unmap", "--cache", "writethrough"],
    );
    let mut c = connect(&backend.socket, ClientOpts::default());
    let m = random_requests(&mut c, 32 * MIB, 400, 0x5eed_0192);
    let all = c.read_all(0);
    m.check(&all, 0, "the whole disk through vublk");
    drop(c);
    assert!(backend.sigterm_and_wait(EXIT_DEADLINE).success());
}

/// qemu-nbd killed and started again a second later while the guest side writes and reads:
/// requests wait for the reconnection and none fails; the data is all there.
#[test]
fn a_server_restarted_under_load_fails_no_request() {
    let dir = TestDir::new("nbd-restart");
    let img = dir.join("disk.raw");
    create_sparse_image(&img, 16 * MIB);
    let Some((srv, sock)) = qemu_nbd(&dir, &img) else {
        return;
    };
    let uri = format!("nbd+unix:///disk?socket={}", sock.display());
    let backend = serve(&dir, &uri, 1, &["--nbd-reconnect-delay", "1"]);
    let socket = backend.socket.clone();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stop2 = stop.clone();
    let io = std::thread::spawn(move || {
        let mut c = connect(&socket, ClientOpts::default());
        let mut n = 0u64;
        while !stop2.load(std::sync::atomic::Ordering::Relaxed) || n < 20 {
            let off = (n % 200) * 65536;
            let data = pattern(65536, off, n);
            let r = c.write_at(0, off, &data);
            assert_eq!(r, 0, "write {n}: {}", errno_name(r));
            let back = c
                .read_at(0, off, 65536)
                .unwrap_or_else(|e| panic!("read {n}: {e}"));
            assert_same(&back, &data, &format!("read {n}"));
            n += 1;
        }
        n
    });
    std::thread::sleep(Duration::from_millis(500));
    drop(srv);
    let _ = std::fs::remove_file(&sock);
    let t0 = Instant::now();
    std::thread::sleep(Duration::from_secs(1));
    let (srv, _) = qemu_nbd(&dir, &img).unwrap();
    std::thread::sleep(Duration::from_millis(1500));
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let n = io.join().expect("a request failed across the restart");
    println!(
        "{n} write+read pairs across a restart of {:?}",
        t0.elapsed()
    );
    backend.assert_running();
    let log = backend.log_contents();
    assert!(log.contains("connected again"), "{log}");
    drop(srv);
    drop(backend);
}

/// nbdkit's error filter fails a fifth of the requests: those get IOERR, the rest succeed,
/// vublk keeps serving.
#[test]
fn server_errors_fail_only_their_requests() {
    let dir = TestDir::new("nbd-errors");
    let Some((_srv, port)) = nbdkit(&[
        "--filter=error",
        "memory",
        "16M",
        "error-rate=20%",
        "error=EIO",
    ]) else {
        return;
    };
    let backend = serve(&dir, &format!("nbd://127.0.0.1:{port}/"), 1, &[]);
    let mut c = connect(&backend.socket, ClientOpts::default());
    let (mut ok, mut failed) = (0, 0);
    for i in 0..200u64 {
        let r = if i % 2 == 0 {
            c.write_at(0, i * 4096, &[i as u8; 4096])
        } else {
            c.read_at(0, (i - 1) * 4096, 4096)
                .map(|_| 0)
                .unwrap_or_else(|e| e)
        };
        match r {
            0 => ok += 1,
            e if e == -libc::EIO => failed += 1,
            e => panic!("request {i}: {}", errno_name(e)),
        }
    }
    println!("{ok} succeeded, {failed} failed with EIO");
    assert!(failed > 10 && ok > 100, "{ok} ok, {failed} failed");
    backend.assert_running();
    drop(c);
    assert!(backend.sigterm_and_wait(EXIT_DEADLINE).success());
}

/// nbdkit's delay filter (reads 150 ms): the latency shows in `vublk ctl stats`, nothing
/// times out.
#[test]
fn server_latency_shows_in_stats() {
    let dir = TestDir::new("nbd-delay");
    let Some((_srv, port)) = nbdkit(&["--filter=delay", "memory", "16M", "rdelay=150ms"]) else {
        return;
    };
    let ctl = dir.join("ctl.sock");
    let ctl_arg = ctl.display().to_string();
    let backend = serve(
        &dir,
        &format!("nbd://127.0.0.1:{port}/"),
        1,
        &["--control-socket", &ctl_arg],
    );
    let mut c = connect(&backend.socket, ClientOpts::default());
    for i in 0..5 {
        c.read_at(0, i * 4096, 4096).unwrap();
    }
    let o = Command::new(env!("CARGO_BIN_EXE_vublk"))
        .args(["ctl", "--control-socket", &ctl_arg, "stats"])
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let read = &v["total"]["requests"]["read"];
    println!("read stats: {read}");
    let mean = read["latency_us"]["mean"].as_u64().unwrap();
    assert!(read["requests"].as_u64().unwrap() >= 5, "{v}");
    assert!(
        (150_000..2_000_000).contains(&mean),
        "mean read latency {mean} us: {v}"
    );
    drop(c);
    assert!(backend.sigterm_and_wait(EXIT_DEADLINE).success());
}

/// Start-up against nothing listening, or a server that never answers: exit 1 with the
/// reason within `--nbd-timeout`.
#[test]
fn an_unreachable_server_at_start_up_is_exit_1_in_bounded_time() {
    let dir = TestDir::new("nbd-unreachable");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let silent_port = silent.local_addr().unwrap().port();
    for (uri, want) in [
        (format!("nbd://127.0.0.1:{port}/x"), "connecting to"),
        (format!("nbd://127.0.0.1:{silent_port}/x"), "handshake"),
        ("nbds://127.0.0.1/x".to_string(), "TLS"),
        (
            format!("nbd+unix:///x?socket={}", dir.join("none.sock").display()),
            "connecting to",
        ),
    ] {
        let t0 = Instant::now();
        let o = Command::new(env!("CARGO_BIN_EXE_vublk"))
            .arg("--socket-path")
            .arg(dir.join("v.sock"))
            .args(["--blk-file", &uri, "--nbd-timeout", "2"])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        println!(
            "{uri}: {:?} after {:?}: {}",
            o.status.code(),
            t0.elapsed(),
            err.trim()
        );
        assert!(matches!(o.status.code(), Some(1) | Some(2)), "{uri}: {err}");
        assert!(err.contains(want), "{uri}: {err}");
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "{uri}: {:?}",
            t0.elapsed()
        );
    }
    drop(silent);
}

/// A server without NBD_FLAG_CAN_MULTI_CONN (nbdkit's multi-conn filter turning it off, and
/// its noparallel filter letting one connection in at a time): two queues share one
/// connection (its thread) and pass the model check.
#[test]
fn a_server_without_multi_conn_is_shared_by_the_queues() {
    let dir = TestDir::new("nbd-single-conn");
    let Some((_srv, port)) = nbdkit(&[
        "--filter=multi-conn",
        "--filter=noparallel",
        "memory",
        "32M",
        "multi-conn-mode=disable",
        "serialize=connections",
    ]) else {
        return;
    };
    let uri = format!("nbd://127.0.0.1:{port}/");
    let backend = serve(&dir, &uri, 2, &["--discard", "unmap"]);
    let mut c = connect(
        &backend.socket,
        ClientOpts {
            num_queues: 2,
            ..Default::default()
        },
    );
    let m = random_requests(&mut c, 32 * MIB, 200, 0x5eed_0193);
    // The second queue reads what the first wrote, through the same connection.
    let all = {
        let cap = c.capacity();
        let mut out = Vec::new();
        let mut off = 0;
        while off < cap {
            out.extend(c.read_at(1, off, MIB as usize).unwrap());
            off += MIB;
        }
        out
    };
    m.check(&all, 0, "the whole disk through queue 1");
    drop(c);
    assert!(backend.sigterm_and_wait(EXIT_DEADLINE).success());
    assert!(
        backend
            .log_contents()
            .contains("one connection for all queues"),
        "{}",
        backend.log_contents()
    );
}

/// A fake NBD server on 127.0.0.1: a correct handshake (16 MiB, flush), then every read is
/// answered with `bad` (raw bytes after the request's handle is patched in at `at`).
fn hostile_server(bad: Vec<u8>, at: Option<usize>) -> (u16, std::thread::JoinHandle<()>) {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let h = std::thread::spawn(move || {
        l.set_nonblocking(false).unwrap();
        for conn in l.incoming().take(3) {
            let Ok(mut c) = conn else { return };
            let bad = bad.clone();
            std::thread::spawn(move || {
                let mut w = |b: &[u8]| c.write_all(b).is_ok();
                let mut hello = Vec::new();
                hello.extend_from_slice(&NBDMAGIC.to_be_bytes());
                hello.extend_from_slice(&IHAVEOPT.to_be_bytes());
                hello.extend_from_slice(&(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes());
                if !w(&hello) {
                    return;
                }
                let mut c = c;
                let mut buf = [0u8; 4];
                if c.read_exact(&mut buf).is_err() {
                    return;
                }
                loop {
                    let mut h = [0u8; 16];
                    if c.read_exact(&mut h).is_err() {
                        return;
                    }
                    let opt = u32::from_be_bytes(h[8..12].try_into().unwrap());
                    let len = u32::from_be_bytes(h[12..16].try_into().unwrap());
                    let mut data = vec![0u8; len as usize];
                    c.read_exact(&mut data).unwrap();
                    let reply = |c: &mut std::net::TcpStream, kind: u32, d: &[u8]| {
                        let mut r = Vec::new();
                        r.extend_from_slice(&0x0003_e889_0455_65a9u64.to_be_bytes());
                        r.extend_from_slice(&opt.to_be_bytes());
                        r.extend_from_slice(&kind.to_be_bytes());
                        r.extend_from_slice(&(d.len() as u32).to_be_bytes());
                        r.extend_from_slice(d);
                        c.write_all(&r).unwrap();
                    };
                    if opt == OPT_GO {
                        let mut info = vec![0u8, 0];
                        info.extend_from_slice(&(16 * MIB).to_be_bytes());
                        info.extend_from_slice(&(FLAG_HAS_FLAGS | FLAG_SEND_FLUSH).to_be_bytes());
                        reply(&mut c, REP_INFO, &info);
                        reply(&mut c, REP_ACK, &[]);
                        break;
                    }
                    reply(&mut c, REP_ACK, &[]);
                }
                // Transmission: garbage for every read, a correct reply to anything else.
                loop {
                    let mut r = [0u8; REQUEST_LEN];
                    if c.read_exact(&mut r).is_err() {
                        return;
                    }
                    let kind = u16::from_be_bytes(r[6..8].try_into().unwrap());
                    let handle = &r[8..16];
                    let len = u32::from_be_bytes(r[24..28].try_into().unwrap());
                    if kind == CMD_DISC {
                        return;
                    }
                    if kind == CMD_WRITE {
                        let mut d = vec![0u8; len as usize];
                        c.read_exact(&mut d).unwrap();
                    }
                    let out = if kind == CMD_READ {
                        let mut b = bad.clone();
                        if let Some(at) = at {
                            b[at..at + 8].copy_from_slice(handle);
                        }
                        b
                    } else {
                        let mut ok = Vec::new();
                        ok.extend_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
                        ok.extend_from_slice(&0u32.to_be_bytes());
                        ok.extend_from_slice(handle);
                        ok
                    };
                    if c.write_all(&out).is_err() {
                        return;
                    }
                }
            });
        }
    });
    (port, h)
}

fn chunk(kind: u16, flags: u16, payload: &[u8]) -> Vec<u8> {
    let mut b = Vec::new();
    b.extend_from_slice(&STRUCTURED_REPLY_MAGIC.to_be_bytes());
    b.extend_from_slice(&flags.to_be_bytes());
    b.extend_from_slice(&kind.to_be_bytes());
    b.extend_from_slice(&[0u8; 8]);
    b.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    b.extend_from_slice(payload);
    b
}

/// Replies a server has no business sending (data beyond the request, a hole at an offset
/// that overflows, a data chunk too short for its offset, an unknown handle, a bad magic, an
/// error chunk without its fields): the read fails with IOERR, vublk keeps running and
/// serves the next frontend; nothing is written outside the request's buffer.
#[test]
fn hostile_server_replies_fail_the_request_not_the_daemon() {
    let dir = TestDir::new("nbd-hostile");
    let mut data_beyond = (4096u64 * 1000).to_be_bytes().to_vec();
    data_beyond.extend_from_slice(&[0xee; 4096]);
    let mut hole_overflow = u64::MAX.to_be_bytes().to_vec();
    hole_overflow.extend_from_slice(&4096u32.to_be_bytes());
    let mut unknown = Vec::new();
    unknown.extend_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
    unknown.extend_from_slice(&0u32.to_be_bytes());
    unknown.extend_from_slice(&0xdead_beefu64.to_be_bytes());
    let cases: Vec<(&str, Vec<u8>, Option<usize>)> = vec![
        (
            "data beyond",
            chunk(REPLY_TYPE_OFFSET_DATA, REPLY_FLAG_DONE, &data_beyond),
            Some(8),
        ),
        (
            "hole overflow",
            chunk(REPLY_TYPE_OFFSET_HOLE, REPLY_FLAG_DONE, &hole_overflow),
            Some(8),
        ),
        (
            "short data",
            chunk(REPLY_TYPE_OFFSET_DATA, REPLY_FLAG_DONE, &[1, 2, 3, 4]),
            Some(8),
        ),
        ("unknown handle", unknown, None),
        (
            "bad magic",
            vec![0xde, 0xad, 0xbe, 0xef, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
            None,
        ),
        (
            "bare error",
            chunk(REPLY_TYPE_ERROR, REPLY_FLAG_DONE, &[0, 0]),
            Some(8),
        ),
    ];
    for (what, bad, at) in cases {
        let (port, _h) = hostile_server(bad, at);
        let backend = serve(
            &dir,
            &format!("nbd://127.0.0.1:{port}/"),
            1,
            &["--nbd-reconnect-timeout", "0"],
        );
        let mut c = connect(&backend.socket, ClientOpts::default());
        c.mem_mut()[..8192].fill(0x77);
        let r = c.read_at(0, 0, 4096);
        assert_eq!(r.err(), Some(-libc::EIO), "{what}");
        // Past the request's buffer nothing was written.
        assert!(c.mem()[4096..8192].iter().all(|&b| b == 0x77), "{what}");
        backend.assert_running();
        drop(c);
        assert!(backend.sigterm_and_wait(EXIT_DEADLINE).success(), "{what}");
        println!("{what}: IOERR, vublk kept running");
    }
}

/// nbdkit's error filter answers writes with NBD_ENOSPC while a file exists, and reads
/// with EIO while another does: vublk holds the writes (the default `--werror enospc`) and,
/// with `--rerror hold`, the reads, and completes them once the server takes them again
/// (docs/error-policy.md). The guest sees no error.
#[test]
fn server_enospc_is_held_until_the_server_takes_writes_again() {
    if skip_unless_vublk("the error policy is vublk's") {
        return;
    }
    let dir = TestDir::new("nbd-enospc");
    let (inject_w, inject_r) = (dir.join("inject-write"), dir.join("inject-read"));
    std::fs::write(&inject_w, b"").unwrap();
    let (fw, fr) = (
        format!("error-pwrite-file={}", inject_w.display()),
        format!("error-pread-file={}", inject_r.display()),
    );
    let Some((_srv, port)) = nbdkit(&[
        "--filter=error",
        "memory",
        "16M",
        "error-pwrite=ENOSPC",
        "error-pwrite-rate=100%",
        &fw,
        "error-pread=EIO",
        "error-pread-rate=100%",
        &fr,
    ]) else {
        return;
    };
    let ctl = dir.join("ctl.sock");
    let ctl_arg = ctl.display().to_string();
    let backend = serve(
        &dir,
        &format!("nbd://127.0.0.1:{port}/"),
        1,
        &[
            "--control-socket",
            &ctl_arg,
            "--error-retry-interval",
            "1",
            "--rerror",
            "hold",
        ],
    );
    let mut c = connect(&backend.socket, ClientOpts::default());
    let held = || ctl_ok(&ctl, "status", &[])["error_policy"]["held"].clone();
    let wait_held = |errno: i32| {
        wait_until("a request held", || held()["errno"] == errno);
        let h = held();
        assert_eq!(h["requests"], 1, "{h}");
        // Still held a while later: retries fail while the server does.
        std::thread::sleep(Duration::from_millis(1500));
        assert_eq!(held()["requests"], 1);
    };
    let results = std::thread::scope(|s| {
        let h = s.spawn(|| {
            (0..4u64)
                .map(|i| c.write_at(0, i * 4096, &[0xa0 + i as u8; 4096]))
                .collect::<Vec<_>>()
        });
        wait_held(libc::ENOSPC);
        std::fs::remove_file(&inject_w).unwrap();
        h.join().unwrap()
    });
    assert_eq!(results, vec![0; 4], "a write failed");
    assert_eq!(held(), serde_json::Value::Null);
    std::fs::write(&inject_r, b"").unwrap();
    let read = std::thread::scope(|s| {
        let h = s.spawn(|| c.read_at(0, 4096, 4096));
        wait_held(libc::EIO);
        std::fs::remove_file(&inject_r).unwrap();
        h.join().unwrap()
    });
    assert_eq!(read, Ok(vec![0xa1; 4096]));
    backend.assert_running();
    drop(c);
    assert!(backend.sigterm_and_wait(EXIT_DEADLINE).success());
}
