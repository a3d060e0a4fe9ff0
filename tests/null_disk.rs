//! The null disk (`--blk-file null:SIZE[?read-zeroes=on|off][&latency-ns=N]`): a disk that
//! stores nothing, for measuring the backend alone (docs/benchmarking.md). Through libblkio:
//! its capacity, writes dropped and reads of zeroes (or buffers left untouched with
//! `read-zeroes=off`), every other request type completing, the injected latency, several
//! queues, an online resize; and the specs vublk refuses.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::*;

fn serve(dir: &TestDir, spec: &str, queues: u32) -> (Backend, std::path::PathBuf) {
    start_with_control(dir, Path::new(spec), queues, &[])
}

#[test]
fn writes_are_dropped_and_reads_return_zeroes() {
    if skip_unless_vublk("vublk's null disk") {
        return;
    }
    let dir = TestDir::new("null-zeroes");
    let (backend, _) = serve(&dir, "null:64M", 2);
    let mut c = connect_queues(&backend.socket, 2);
    assert_eq!(c.capacity(), 64 * MIB);
    for q in 0..2 {
        assert_eq!(c.write_at(q, 4096, &vec![0x5a; 65536]), 0);
        c.mem_mut()[..65536].fill(0xa5);
        assert_eq!(c.read_at(q, 0, 65536).unwrap(), vec![0; 65536], "queue {q}");
        let r = c.submit_batch(
            q,
            &[
                Op::Flush,
                Op::Discard {
                    offset: 0,
                    len: MIB,
                },
                Op::WriteZeroes {
                    offset: MIB,
                    len: MIB,
                    flags: blkio::ReqFlags::empty(),
                },
                Op::WriteFua {
                    offset: 63 * MIB,
                    buf: 0,
                    len: 4096,
                },
            ],
        );
        assert_eq!(r, vec![0; 4], "queue {q}");
    }
    // The last sector is served; past it, an error.
    assert!(c.read_at(0, 64 * MIB - 512, 512).is_ok());
    assert!(c.read_at(0, 64 * MIB, 512).is_err());
    disconnect_and_stop(&backend, c);
}

#[test]
fn read_zeroes_off_leaves_the_buffers_untouched() {
    if skip_unless_vublk("vublk's null disk") {
        return;
    }
    let dir = TestDir::new("null-untouched");
    let (backend, _) = serve(&dir, "null:1G?read-zeroes=off", 1);
    let mut c = connect(&backend.socket, ClientOpts::default());
    assert_eq!(c.capacity(), 1 << 30);
    c.mem_mut()[..8192].fill(0xa5);
    assert_eq!(c.read_at(0, 12345 * 512, 8192).unwrap(), vec![0xa5; 8192]);
    disconnect_and_stop(&backend, c);
}

#[test]
fn latency_holds_every_request() {
    if skip_unless_vublk("vublk's null disk") {
        return;
    }
    let dir = TestDir::new("null-latency");
    // 20 ms: far above the backend's own cost, so the lower bound says it all.
    let (backend, _) = serve(&dir, "null:16M?latency-ns=20000000", 1);
    let mut c = connect(&backend.socket, ClientOpts::default());
    for op in [
        Op::Read {
            offset: 0,
            buf: 0,
            len: 4096,
        },
        Op::Write {
            offset: 0,
            buf: 0,
            len: 4096,
        },
        Op::Flush,
    ] {
        let t = Instant::now();
        assert_eq!(c.submit(0, op.clone()), 0);
        let took = t.elapsed();
        assert!(took >= Duration::from_millis(20), "{op:?} took {took:?}");
    }
    // A batch of 32 waits about once, not 32 times over.
    let batch: Vec<Op> = (0..32)
        .map(|i| Op::Read {
            offset: i * 4096,
            buf: (i * 4096) as usize,
            len: 4096,
        })
        .collect();
    let t = Instant::now();
    assert_eq!(c.submit_batch(0, &batch), vec![0; 32]);
    let took = t.elapsed();
    assert!(
        took >= Duration::from_millis(20) && took < Duration::from_millis(500),
        "32 reads took {took:?}"
    );
    disconnect_and_stop(&backend, c);
}

#[test]
fn grows_online() {
    if skip_unless_vublk("vublk's null disk") {
        return;
    }
    let dir = TestDir::new("null-resize");
    let (backend, sock) = serve(&dir, "null:16M", 1);
    let c = connect(&backend.socket, ClientOpts::default());
    ctl_ok(&sock, "resize", &["32M"]);
    let (ok, _, text) = ctl(&sock, "resize", &["8M"]);
    assert!(!ok && text.contains("shrink"), "{text}");
    drop(c);
    let c = connect(&backend.socket, ClientOpts::default());
    assert_eq!(c.capacity(), 32 * MIB);
    disconnect_and_stop(&backend, c);
}

#[test]
fn bad_specs_are_refused() {
    if skip_unless_vublk("vublk's null disk") {
        return;
    }
    let dir = TestDir::new("null-refused");
    for (spec, extra, says) in [
        ("null:0", &[][..], "multiple of 512"),
        ("null:1000", &[], "multiple of 512"),
        ("null:", &[], "multiple of 512"),
        ("null:1G?size=2", &[], "read-zeroes=on|off and latency-ns"),
        ("null:1G?read-zeroes=maybe", &[], "read-zeroes=on|off"),
        ("null:1G?latency-ns=20000000000", &[], "up to 10 s"),
        ("null:1G", &["--format", "qcow2"], "served as raw"),
    ] {
        let (code, out) = vublk_refuses(&dir, Path::new(spec), extra);
        assert!(
            code.is_some_and(|c| c != 0) && out.contains(says),
            "{spec} {extra:?}: exit {code:?}: {out}"
        );
    }
}
