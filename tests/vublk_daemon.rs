//! vublk-specific behaviour: the command-line contract, start-up errors, the io_uring
//! fallback, the truthful write cache, memory regions coming and going while queues run, an
//! inherited listening socket, and read-modify-write on a 4096-byte-sector device.

mod common;

use std::os::fd::AsRawFd;
use std::os::unix::net::UnixListener;
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::sync::{Arc, Barrier};
use std::thread;

use common::*;

fn vublk(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_vublk"))
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run vublk")
}

fn stderr_of(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Bad values and conflicts: status 2, exactly one line, naming the option.
#[test]
fn bad_options_exit_2_with_one_line_naming_the_option() {
    let cases: &[(&[&str], &str)] = &[
        (
            &["--socket-path", "/x.sock", "--fd", "3", "--blk-file", "/f"],
            "--fd",
        ),
        (&["--blk-file", "/f"], "--socket-path"),
        (&["--socket-path", "/x.sock"], "--blk-file"),
        (
            &[
                "--socket-path",
                "/x.sock",
                "--blk-file",
                "/f",
                "--num-queues",
                "17",
            ],
            "--num-queues",
        ),
        (
            &[
                "--socket-path",
                "/x.sock",
                "--blk-file",
                "/f",
                "--num-queues",
                "x",
            ],
            "--num-queues",
        ),
        (
            &[
                "--socket-path",
                "/x.sock",
                "--blk-file",
                "/f",
                "--queue-size",
                "2048",
            ],
            "--queue-size",
        ),
        (
            &[
                "--socket-path",
                "/x.sock",
                "--blk-file",
                "/f",
                "--queue-size",
                "300",
            ],
            "--queue-size",
        ),
        (
            &[
                "--socket-path",
                "/x.sock",
                "--blk-file",
                "/f",
                "--logical-block-size",
                "1024",
            ],
            "--logical-block-size",
        ),
        (
            &[
                "--socket-path",
                "/x.sock",
                "--blk-file",
                "/f",
                "--serial",
                "this-serial-is-too-long",
            ],
            "--serial",
        ),
        (
            &[
                "--socket-path",
                "/x.sock",
                "--blk-file",
                "/f",
                "--cache",
                "always",
            ],
            "--cache",
        ),
        (
            &[
                "--socket-path",
                "/x.sock",
                "--blk-file",
                "/f",
                "--aio",
                "native",
            ],
            "--aio",
        ),
        (
            &[
                "--socket-path",
                "/x.sock",
                "--blk-file",
                "/f",
                "--format",
                "vmdk",
            ],
            "--format",
        ),
        (
            &[
                "--socket-path",
                "/x.sock",
                "--blk-file",
                "/f",
                "--log-level",
                "chatty",
            ],
            "--log-level",
        ),
        (
            &[
                "--socket-path",
                "/x.sock",
                "--blk-file",
                "/f",
                "--no-such-option",
            ],
            "--no-such-option",
        ),
        (
            &[
                "--socket-path",
                "/x.sock",
                "--blk-file",
                "/f",
                "--detect-zeroes",
                "unmap",
            ],
            "--discard unmap",
        ),
        (
            &[
                "--socket-path",
                "/x.sock",
                "--blk-file",
                "/f",
                "--detect-zeroes",
                "yes",
            ],
            "--detect-zeroes",
        ),
        (
            &[
                "--socket-path",
                "/x.sock",
                "--blk-file",
                "/f",
                "--discard",
                "on",
            ],
            "--discard",
        ),
        (
            &[
                "--socket-path",
                "/x.sock",
                "--blk-file",
                "/f",
                "--poll-us",
                "20000",
            ],
            "--poll-us",
        ),
        (
            &[
                "--socket-path",
                "/x.sock",
                "--blk-file",
                "/f",
                "--l2-cache-size",
                "lots",
            ],
            "--l2-cache-size",
        ),
        (
            &[
                "--socket-path",
                "/x.sock",
                "--blk-file",
                "/f",
                "--l2-cache-size",
                "8G",
            ],
            "--l2-cache-size",
        ),
    ];
    for (args, opt) in cases {
        let o = vublk(args);
        let err = stderr_of(&o);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert_eq!(
            err.trim_end().lines().count(),
            1,
            "{args:?}: not one line:\n{err}"
        );
        assert!(
            err.contains(opt),
            "{args:?}: message does not name {opt}: {err}"
        );
    }
}

#[test]
fn print_capabilities_is_the_vhost_user_json() {
    let o = vublk(&["--print-capabilities"]);
    assert!(o.status.success());
    let out = String::from_utf8(o.stdout).unwrap();
    let compact: String = out.chars().filter(|c| !c.is_whitespace()).collect();
    assert_eq!(
        compact,
        r#"{"type":"block","features":["read-only","blk-file","migration"]}"#
    );
}

fn start_error(dir: &TestDir, blk: &Path, sock: &Path) -> (Option<i32>, String) {
    let o = vublk(&[
        "--socket-path",
        sock.to_str().unwrap(),
        "--blk-file",
        blk.to_str().unwrap(),
    ]);
    let _ = dir;
    (o.status.code(), stderr_of(&o))
}

#[test]
fn missing_image_and_directory_give_clear_errors() {
    let dir = TestDir::new("start-errors");
    let sock = dir.join("s.sock");
    let (code, err) = start_error(&dir, &dir.join("missing.img"), &sock);
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("does not exist") && err.contains("missing.img"),
        "{err}"
    );
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    let (code, err) = start_error(&dir, &dir.join(""), &sock);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("is a directory"), "{err}");
    assert!(
        !sock.exists(),
        "no socket is left behind on a start-up error"
    );
}

#[test]
fn busy_socket_is_refused_and_stale_socket_is_replaced() {
    let dir = TestDir::new("socket-errors");
    let img = dir.join("disk.img");
    create_sparse_image(&img, 8 * MIB);
    let sock = dir.join("s.sock");
    let live = UnixListener::bind(&sock).unwrap();
    let (code, err) = start_error(&dir, &img, &sock);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("in use"), "{err}");
    assert!(
        sock.exists(),
        "the other process's socket must not be removed"
    );
    drop(live); // leaves a stale socket file behind

    let notsock = dir.join("plain-file");
    std::fs::write(&notsock, b"x").unwrap();
    let (code, err) = start_error(&dir, &img, &notsock);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("not a socket"), "{err}");
    assert_eq!(std::fs::read(&notsock).unwrap(), b"x");

    // The stale socket is replaced and served.
    let opts = BackendOpts::default();
    let backend = Backend::start(&dir, &img, &opts);
    let mut c = connect_queues(&backend.socket, 1);
    assert_eq!(c.write_at(0, 0, &[7u8; 4096]), 0);
    drop(c);
    assert_eq!(backend.sigterm_and_wait(EXIT_DEADLINE).code(), Some(0));
}

#[test]
fn io_uring_denied_falls_back_to_threads_with_one_warning() {
    let dir = TestDir::new("uring-denied");
    let img = dir.join("disk.img");
    create_pattern_image(&img, 8 * MIB, 3);
    let opts = BackendOpts {
        num_queues: Some(2),
        deny_io_uring: true,
        ..Default::default()
    };
    let backend = Backend::start(&dir, &img, &opts);
    let mut c = connect_queues(&backend.socket, 2);
    let data = pattern(256 * 1024, 0, 99);
    assert_eq!(c.write_at(1, MIB, &data), 0);
    assert_same(&c.read_at(0, MIB, data.len()).unwrap(), &data, "read back");
    drop(c);
    // A second session creates its queues again: still one warning in all.
    let mut c = connect_queues(&backend.socket, 2);
    assert_same(
        &c.read_at(1, MIB, data.len()).unwrap(),
        &data,
        "second session",
    );
    drop(c);
    assert_eq!(backend.sigterm_and_wait(EXIT_DEADLINE).code(), Some(0));
    let log = backend.log_contents();
    let warnings: Vec<_> = log.lines().filter(|l| l.contains("falling back")).collect();
    assert_eq!(warnings.len(), 1, "log:\n{log}");
    assert!(warnings[0].contains("WARN"), "{}", warnings[0]);
    assert!(log.contains("I/O engine: threads"), "log:\n{log}");
}

/// The guest is told WCE=1 (flush needed) exactly when the host has a volatile cache.
#[test]
fn write_cache_flag_matches_cache_mode() {
    for (mode, expect) in [("none", true), ("writeback", true), ("writethrough", false)] {
        let dir = TestDir::new(&format!("wce-{mode}"));
        let img = dir.join("disk.img");
        create_sparse_image(&img, 8 * MIB);
        let opts = BackendOpts {
            extra_args: vec!["--cache".into(), mode.into()],
            ..Default::default()
        };
        let backend = Backend::start(&dir, &img, &opts);
        let mut c = connect_queues(&backend.socket, 1);
        assert_eq!(
            c.blkio.get_bool("flush-needed").unwrap(),
            expect,
            "--cache {mode}"
        );
        let data = pattern(64 * 1024, 0, 5);
        assert_eq!(c.write_at(0, 0, &data), 0);
        assert_eq!(c.submit(0, Op::Flush), 0);
        assert_same(&read_file_range(&img, 0, data.len()), &data, mode);
    }
}

/// libblkio adds and removes memory regions on a running device (ADD_MEM_REG/REM_MEM_REG).
#[test]
fn memory_regions_come_and_go_while_queues_run() {
    let dir = TestDir::new("mem-regions");
    let img = dir.join("disk.img");
    create_sparse_image(&img, 16 * MIB);
    let backend = Backend::start(&dir, &img, &BackendOpts::default());
    let mut c = connect_queues(&backend.socket, 1);
    for round in 0..20u64 {
        let region = c.blkio.alloc_mem_region(256 * 1024).expect("alloc region");
        c.blkio.map_mem_region(&region).expect("map region");
        let view = MemView {
            addr: region.addr,
            len: region.len,
        };
        let data = pattern(region.len, round, round);
        // SAFETY: the region is mapped and only this test touches it.
        unsafe { view.slice_mut(0, data.len()) }.copy_from_slice(&data);
        let off = round * 256 * 1024;
        let r = run_batch(
            &mut c.queues[0],
            view,
            &[Op::Write {
                offset: off,
                buf: 0,
                len: data.len(),
            }],
        );
        assert_eq!(r, vec![0], "round {round}");
        c.blkio.unmap_mem_region(&region);
        c.blkio.free_mem_region(&region);
        // The original region still works after the other one is gone.
        assert_same(&c.read_at(0, off, data.len()).unwrap(), &data, "read back");
    }
    drop(c);
    assert_eq!(backend.sigterm_and_wait(EXIT_DEADLINE).code(), Some(0));
}

/// `--fd N`: serve a listening socket set up by a supervisor.
#[test]
fn inherited_listening_socket_is_served() {
    use std::os::unix::process::CommandExt;
    let dir = TestDir::new("inherited-fd");
    let img = dir.join("disk.img");
    create_sparse_image(&img, 8 * MIB);
    let sock = dir.join("inherited.sock");
    let listener = UnixListener::bind(&sock).unwrap();
    let fd = listener.as_raw_fd();
    const CHILD_FD: i32 = 10;
    let log = std::fs::File::create(dir.join("vublk.log")).unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_vublk"));
    cmd.args([
        "--fd",
        &CHILD_FD.to_string(),
        "--blk-file",
        img.to_str().unwrap(),
    ])
    .stdin(Stdio::null())
    .stderr(log);
    // SAFETY: dup2 is async-signal-safe; the duplicate has no close-on-exec flag.
    unsafe {
        cmd.pre_exec(move || {
            if libc::dup2(fd, CHILD_FD) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = cmd.spawn().unwrap();
    drop(listener);
    let mut c = connect_queues(&sock, 1);
    let data = pattern(8192, 0, 1);
    assert_eq!(c.write_at(0, 4096, &data), 0);
    assert_same(&c.read_at(0, 4096, data.len()).unwrap(), &data, "read back");
    drop(c);
    // SAFETY: signalling our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    assert_eq!(child.wait().unwrap().code(), Some(0));
}

/// 512-byte guest blocks on a 4096-byte-sector device: sub-block writes are read-modify-
/// written, and two queues writing alternate 512-byte sectors of the same 4096-byte blocks at
/// the same time lose nothing.
#[test]
fn sub_block_writes_on_4k_sector_device_are_read_modify_written_without_lost_updates() {
    const SIZE: u64 = 8 * MIB;
    const BLOCKS: u64 = 64;
    let dir = TestDir::new("rmw-4k");
    let backing = dir.join("backing.img");
    create_pattern_image(&backing, SIZE, 11);
    let Some(lo) = LoopDev::new(&backing, 4096) else {
        return;
    };
    let opts = BackendOpts {
        num_queues: Some(2),
        ..Default::default()
    };
    let backend = Backend::start(&dir, Path::new(&lo.0), &opts);
    let mut c = connect_queues(&backend.socket, 2);
    let mut model = pattern(SIZE as usize, 0, 11);

    // Queue q writes the sectors s with s % 2 == q of each 4096-byte block, all at once.
    let (queues, mem) = c.take_queues();
    let barrier = Arc::new(Barrier::new(2));
    let handles: Vec<_> = queues
        .into_iter()
        .enumerate()
        .map(|(q, mut queue)| {
            let barrier = barrier.clone();
            thread::spawn(move || {
                let base = q * 512 * 1024;
                let mut ops = Vec::new();
                for b in 0..BLOCKS {
                    for s in (q as u64..8).step_by(2) {
                        let i = (b * 4 + s / 2) as usize;
                        let buf = base + i * 512;
                        // SAFETY: each queue uses its own half of the region.
                        unsafe { mem.slice_mut(buf, 512) }
                            .fill((q as u8 + 1) * 0x40 + (b as u8 % 0x3f));
                        ops.push(Op::Write {
                            offset: b * 4096 + s * 512,
                            buf,
                            len: 512,
                        });
                    }
                }
                barrier.wait();
                let r = run_batch(&mut queue, mem, &ops);
                assert!(r.iter().all(|&x| x == 0), "queue {q}: {r:?}");
                queue
            })
        })
        .collect();
    c.queues = handles.into_iter().map(|h| h.join().unwrap()).collect();
    for b in 0..BLOCKS {
        for s in 0..8u64 {
            let q = (s % 2) as u8;
            let at = (b * 4096 + s * 512) as usize;
            model[at..at + 512].fill((q + 1) * 0x40 + (b as u8 % 0x3f));
        }
    }
    // A sub-block read in the middle of a block, and a whole-disk read.
    assert_same(
        &c.read_at(0, 4096 + 1536, 1024).unwrap(),
        &model[4096 + 1536..4096 + 2560],
        "sub-block read",
    );
    assert_same(&c.read_all(1), &model, "whole device");
    drop(c);
    assert_eq!(backend.sigterm_and_wait(EXIT_DEADLINE).code(), Some(0));
    assert!(
        backend.log_contents().contains("offset 4096 bytes"),
        "probe did not find 4096-byte sectors"
    );
    let log = backend.log_contents();
    let rmw = logged_count(&log, " read-modify-writes");
    assert_eq!(
        rmw,
        BLOCKS * 8,
        "every 512-byte write is a read-modify-write:\n{log}"
    );
    assert_same(&read_file(&backing), &model, "backing file");
}

/// Page-aligned guest buffers go to the file as they are: zero copies.
#[test]
fn aligned_buffers_are_never_bounced() {
    let dir = TestDir::new("no-bounce");
    let img = dir.join("disk.img");
    create_sparse_image(&img, 8 * MIB);
    let backend = Backend::start(&dir, &img, &BackendOpts::default());
    let mut c = connect_queues(&backend.socket, 1);
    for i in 0..16u64 {
        let data = pattern(64 * 1024, i, i);
        assert_eq!(c.write_at(0, i * 65536, &data), 0);
        assert_same(
            &c.read_at(0, i * 65536, data.len()).unwrap(),
            &data,
            "read back",
        );
    }
    drop(c);
    assert_eq!(backend.sigterm_and_wait(EXIT_DEADLINE).code(), Some(0));
    let log = backend.log_contents();
    assert!(logged_count(&log, "requests") >= 32, "{log}");
    assert_eq!(logged_count(&log, " bounced"), 0, "{log}");
}

/// A daemon serves one frontend after another for as long as it runs: no connection may
/// leave a descriptor behind (vhost-user-backend leaked one per queue thread per connection
/// before its vendored patch, vendor/PATCHES.md).
#[test]
fn reconnects_leave_no_descriptors_behind() {
    if skip_unless_vublk("counts vublk's descriptors") {
        return;
    }
    let dir = TestDir::new("fd-leak");
    let img = dir.join("disk.img");
    create_sparse_image(&img, 16 * MIB);
    let opts = BackendOpts {
        num_queues: Some(2),
        ..BackendOpts::default()
    };
    let backend = Backend::start(&dir, &img, &opts);
    let fds = || {
        std::fs::read_dir(format!("/proc/{}/fd", backend.pid()))
            .unwrap()
            .count()
    };
    // One full session first (its lasting state, e.g. the logger's, is not a leak).
    drop(connect_queues(&backend.socket, 2));
    std::thread::sleep(std::time::Duration::from_millis(200));
    let before = fds();
    for _ in 0..10 {
        let mut c = connect_queues(&backend.socket, 2);
        assert_eq!(c.write_at(0, 0, &[1u8; 4096]), 0);
        drop(c);
    }
    for _ in 0..20 {
        let mut s = std::os::unix::net::UnixStream::connect(&backend.socket).unwrap();
        use std::io::{Read, Write};
        // GET_FEATURES, version 1, no payload; read the reply, hang up.
        s.write_all(&[1, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0]).unwrap();
        let mut reply = [0u8; 20];
        let _ = s.read(&mut reply);
    }
    // The last session is torn down after its frontend hangs up.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while fds() > before && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    // At most as many as before (the first session may still have been going away when
    // `before` was counted, on a busy machine).
    let after = fds();
    assert!(
        after <= before,
        "descriptors leaked over 30 connections: {before} -> {after}"
    );
    backend.assert_running();
}
