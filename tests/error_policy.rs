//! The error policy (`--werror`, `--rerror`, `--error-retry-interval`, `ctl resume`,
//! `ctl stop-holding`; docs/error-policy.md) against a host file system that really fills
//! up: the image on a small tmpfs the test mounts (root), a libblkio writer that writes
//! past the space left. Held writes must not fail, must show in `ctl status` and the
//! metrics, and must complete with the right data once space is freed; `--werror report`
//! fails them as before; `stop-holding` answers them with IOERR.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::*;

/// Bytes of each write.
const W: u64 = MIB;

/// The tmpfs: 24 MiB, 16 of them taken by a filler file the test deletes to free space.
const FS: u64 = 24 * MIB;
const FILLER: u64 = 16 * MIB;
/// Writes enough for twice the space left.
const WRITES: u64 = 16;

/// The held requests `ctl status` shows (0: none).
fn held(ctl: &Path) -> (u64, serde_json::Value) {
    let v = ctl_ok(ctl, "status", &[]);
    let h = v["error_policy"]["held"].clone();
    (h["requests"].as_u64().unwrap_or(0), h)
}

/// Wait until `cond` holds of `ctl status`'s held requests.
fn wait_held(ctl: &Path, what: &str, cond: impl Fn(u64) -> bool) -> serde_json::Value {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (n, h) = held(ctl);
        if cond(n) {
            return h;
        }
        assert!(Instant::now() < deadline, "{what}: held {n}: {h}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A filesystem with `FILLER` bytes taken, an empty raw image of 32 MiB, and vublk on it
/// with `args` and a control socket.
struct Setup {
    // Field order is drop order: the backend goes before the mount.
    backend: Backend,
    ctl: std::path::PathBuf,
    img: std::path::PathBuf,
    filler: std::path::PathBuf,
    _fs: Tmpfs,
    _dir: TestDir,
}

fn setup(name: &str, format: &str, args: &[&str]) -> Option<Setup> {
    setup_with(name, format, args, BackendOpts::default())
}

fn setup_with(name: &str, format: &str, args: &[&str], opts: BackendOpts) -> Option<Setup> {
    let dir = TestDir::new(name);
    let fs = Tmpfs::mount(&dir.join("fs"), FS)?;
    let img = fs.join(&format!("disk.{format}"));
    let size = (32 * MIB).to_string();
    match format {
        "raw" => create_sparse_image(&img, 32 * MIB),
        _ => qemu_img_create(&img, format, &size),
    }
    let filler = fs.join("filler");
    std::fs::write(&filler, vec![0x5a; FILLER as usize]).unwrap();
    let ctl = dir.join("ctl.sock");
    let mut extra: Vec<String> = vec![
        "--control-socket".into(),
        ctl.display().to_string(),
        "--format".into(),
        format.into(),
    ];
    extra.extend(args.iter().map(|s| s.to_string()));
    let backend = Backend::start(
        &dir,
        &img,
        &BackendOpts {
            extra_args: extra,
            ..opts
        },
    );
    Some(Setup {
        backend,
        ctl,
        img,
        filler,
        _fs: fs,
        _dir: dir,
    })
}

/// The data of write `i`.
fn data(i: u64) -> Vec<u8> {
    pattern(W as usize, i * W, 0x34)
}

/// Write `WRITES` MiB (four at a time, each from a buffer of its own) on a thread, while
/// `during` runs here; the writes' results.
fn write_all_while(c: &mut Client, during: impl FnOnce(&mut Client)) -> Vec<i32> {
    let mut ops = Vec::new();
    for i in 0..WRITES {
        let buf = (i * W) as usize;
        c.mem_mut()[buf..buf + W as usize].copy_from_slice(&data(i));
        ops.push(Op::Write {
            offset: i * W,
            buf,
            len: W as usize,
        });
    }
    let (mut queues, mem) = c.take_queues();
    let mut q = queues.remove(0);
    c.queues = queues;
    let results = std::thread::scope(|s| {
        let h = s.spawn(move || {
            set_io_deadline_for_this_thread(Duration::from_secs(60));
            let mut results = Vec::new();
            for chunk in ops.chunks(4) {
                results.extend(run_batch(&mut q, mem, chunk));
            }
            (results, q)
        });
        during(&mut *c);
        let (r, q) = h.join().unwrap();
        c.queues.insert(0, q);
        r
    });
    results
}

fn client(s: &Setup) -> Client {
    client_queues(s, 1)
}

fn client_queues(s: &Setup, num_queues: i32) -> Client {
    connect(
        &s.backend.socket,
        ClientOpts {
            num_queues,
            mem_size: (WRITES * W) as usize,
            ..ClientOpts::default()
        },
    )
}

/// Every write reads back (through vublk, and in the file for raw images).
fn check_data(c: &mut Client, s: &Setup, raw: bool) {
    for i in 0..WRITES {
        let got = c.read_at(0, i * W, W as usize).unwrap();
        assert_same(&got, &data(i), &format!("write {i} read back"));
        if raw {
            let f = read_file_range(&s.img, i * W, W as usize);
            assert_same(&f, &data(i), &format!("write {i} in the file"));
        }
    }
}

/// The space runs out: no write fails; `status`, the metrics and the service status
/// (NOTIFY_SOCKET) show them held (ENOSPC); a flush sent on the other queue meanwhile waits
/// (nothing new is taken while anything is held); freed, everything completes within the
/// retry interval and reads back right. One log line says they are held, none reports
/// them as errors.
fn held_writes_complete_once_space_is_freed(format: &str) {
    if skip_unless_vublk("the error policy is vublk's") {
        return;
    }
    let dir = TestDir::new(&format!("hold-{format}-notify"));
    let notify = dir.join("notify.sock");
    let listener = std::os::unix::net::UnixDatagram::bind(&notify).unwrap();
    listener.set_nonblocking(true).unwrap();
    let addr = format!("127.0.0.1:{}", free_port());
    let Some(s) = setup_with(
        &format!("hold-{format}"),
        format,
        &["--error-retry-interval", "1", "--metrics-addr", &addr],
        BackendOpts {
            num_queues: Some(2),
            env: vec![("NOTIFY_SOCKET".into(), notify.display().to_string())],
            ..BackendOpts::default()
        },
    ) else {
        return;
    };
    let statuses = || {
        let mut out = Vec::new();
        let mut buf = [0u8; 4096];
        while let Ok(n) = listener.recv(&mut buf) {
            out.push(String::from_utf8_lossy(&buf[..n]).into_owned());
        }
        out
    };
    let mut c = client_queues(&s, 2);
    let results = write_all_while(&mut c, |c| {
        let h = wait_held(&s.ctl, "the disk filled", |n| n > 0);
        assert_eq!(h["errno"], libc::ENOSPC, "{h}");
        assert_eq!(h["error"], "No space left on device", "{h}");
        let m = parse_metrics(&http_get(&addr, "/metrics"));
        assert!(m["vublk_held_requests"] > 0.0, "{m:?}");
        assert_eq!(m["vublk_held_errno"], f64::from(libc::ENOSPC));
        assert!(m["vublk_holds_total"] >= 1.0, "{m:?}");
        let st = statuses();
        assert!(
            st.iter()
                .any(|s| s.contains("STATUS=holding requests since")
                    && s.contains("No space left on device")),
            "{st:?}"
        );
        // A flush on the other queue is not taken while writes are held.
        let q1 = &mut c.queues[0];
        q1.flush(0, blkio::ReqFlags::empty());
        let mut done = [std::mem::MaybeUninit::<blkio::Completion>::uninit()];
        let mut wait = Duration::from_millis(1500);
        assert!(
            q1.do_io(&mut done, 1, Some(&mut wait), None).is_err(),
            "a flush completed while writes were held"
        );
        // Held, not failed: still held (retries fail: still no space).
        let (n, h) = held(&s.ctl);
        assert!(n > 0, "nothing held any more with no space freed: {h}");
        let v = ctl_ok(&s.ctl, "status", &[]);
        assert_eq!(v["error_policy"]["werror"], "enospc", "{v}");
        std::fs::remove_file(&s.filler).unwrap();
        let mut wait = Duration::from_secs(10);
        assert_eq!(q1.do_io(&mut done, 1, Some(&mut wait), None).ok(), Some(1));
        // SAFETY: do_io filled the first completion.
        let flushed = unsafe { done[0].assume_init_ref() }.ret;
        assert_eq!(flushed, 0, "the flush failed");
        let freed = Instant::now();
        wait_held(&s.ctl, "after space was freed", |n| n == 0);
        assert!(
            freed.elapsed() < Duration::from_secs(3),
            "held writes took {:?} after space was freed (retry interval 1 s)",
            freed.elapsed()
        );
    });
    for (i, r) in results.iter().enumerate() {
        assert_eq!(*r, 0, "write {i} failed: {}", errno_name(*r));
    }
    check_data(&mut c, &s, format == "raw");
    let log = s.backend.log_contents();
    let lines = |what: &str| log.lines().filter(|l| l.contains(what)).count();
    assert_eq!(lines("holding writes that failed on the host"), 1, "{log}");
    assert_eq!(lines("No space left on device"), 1, "{log}");
    assert!(log.contains("no request held any more"), "{log}");
    let m = parse_metrics(&http_get(&addr, "/metrics"));
    assert_eq!(m["vublk_held_requests"], 0.0);
    assert!(m["vublk_held_total"] >= 1.0, "{m:?}");
    assert!(m["vublk_held_retries_total"] >= 1.0, "{m:?}");
    let st = statuses();
    assert!(
        st.last().is_some_and(|s| !s.contains("holding")),
        "the service status still says holding: {st:?}"
    );
    drop(c);
    assert_eq!(s.backend.sigterm_and_wait(EXIT_DEADLINE).code(), Some(0));
    if format != "raw" {
        assert_check_allows_leaks(&s.img, format, "after the held writes");
    }
}

#[test]
fn raw_held_writes_complete_once_space_is_freed() {
    held_writes_complete_once_space_is_freed("raw");
}

#[test]
fn qcow2_held_writes_complete_once_space_is_freed() {
    held_writes_complete_once_space_is_freed("qcow2");
}

/// `--werror report`: the writes past the space fail with IOERR, as without a policy.
#[test]
fn werror_report_fails_them() {
    if skip_unless_vublk("the error policy is vublk's") {
        return;
    }
    let Some(s) = setup("hold-report", "raw", &["--werror", "report"]) else {
        return;
    };
    let mut c = client(&s);
    let results = write_all_while(&mut c, |_| {});
    let failed = results.iter().filter(|&&r| r == EIO).count();
    assert!(failed > 0, "no write failed on a full disk: {results:?}");
    assert_eq!(
        failed,
        results.iter().filter(|&&r| r != 0).count(),
        "{results:?}"
    );
    assert_eq!(held(&s.ctl).0, 0);
}

/// `resume` with no space holds them again; `resume --report` and `stop-holding` answer
/// what is held with IOERR and the disk takes requests again (the writer's next batch is
/// held anew while there is still no space); `resume` with nothing held is no error.
#[test]
fn stop_holding_answers_them_with_an_error() {
    if skip_unless_vublk("the error policy is vublk's") {
        return;
    }
    // Retried only on resume.
    let Some(s) = setup("hold-give-up", "raw", &["--error-retry-interval", "0"]) else {
        return;
    };
    let mut c = client(&s);
    let results = write_all_while(&mut c, |_| {
        wait_held(&s.ctl, "the disk filled", |n| n > 0);
        // A resume with no space: held again.
        let v = ctl_ok(&s.ctl, "resume", &[]);
        assert!(v["retrying"].as_u64().unwrap() > 0, "{v}");
        std::thread::sleep(Duration::from_millis(300));
        assert!(held(&s.ctl).0 > 0);
        // Given up on: the writer's next batch comes, and is held (still no space).
        let v = ctl_ok(&s.ctl, "resume", &["--report"]);
        assert!(v["answered"].as_u64().unwrap() > 0, "{v}");
        wait_held(&s.ctl, "the next batch", |n| n > 0);
        // Space for the writes not sent yet; what is held is not retried (interval 0).
        std::fs::remove_file(&s.filler).unwrap();
        let v = ctl_ok(&s.ctl, "stop-holding", &[]);
        assert!(v["answered"].as_u64().unwrap() > 0, "{v}");
        assert_eq!(v["held"], 0, "{v}");
    });
    let failed = results.iter().filter(|&&r| r == EIO).count();
    assert!(failed >= 2, "two batches were given up on: {results:?}");
    assert_eq!(held(&s.ctl).0, 0);
    // Taking requests again: what fitted reads back.
    assert_eq!(c.read_at(0, 0, W as usize).unwrap(), data(0));
    let v = ctl_ok(&s.ctl, "resume", &[]);
    assert_eq!(v["retrying"], 0, "{v}");
}
