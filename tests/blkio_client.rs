//! Integration tests: a real vhost-user-blk frontend (libblkio's `virtio-blk-vhost-user` driver)
//! against the backend under test.
//!
//! By default the backend is vublk; `VUBLK_TEST_BACKEND=qsd` runs the same tests against
//! qemu-storage-daemon, the reference peer (checks that only make sense for vublk say so).
//! `VUBLK_TEST_SEED=N` changes the seed of the randomised tests.

mod common;

use std::path::PathBuf;
use std::sync::{Arc, Barrier};
use std::thread;

use blkio::ReqFlags;
use common::*;

fn seed(default: u64) -> u64 {
    let s = std::env::var("VUBLK_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default);
    eprintln!("seed {s} (set VUBLK_TEST_SEED to change)");
    s
}

fn opts() -> BackendOpts {
    BackendOpts::default()
}

/// `opts()` with these extra vublk arguments.
fn opts_with(extra: &[&str]) -> BackendOpts {
    BackendOpts {
        extra_args: extra.iter().map(|s| s.to_string()).collect(),
        ..opts()
    }
}

/// What a test's image holds when the test starts.
#[derive(Clone, Copy)]
enum Content {
    /// Nothing: a sparse file (`create_sparse_image`).
    Sparse,
    /// `pattern_fill` with this seed, fully allocated (`create_pattern_image`).
    Pattern(u64),
    /// This byte everywhere, fully allocated (`create_filled_image`).
    Filled(u8),
}

/// Every test's set-up: a fresh test directory `name` holding the image `disk.img`, `size`
/// bytes of `content`.
fn test_image(name: &str, size: u64, content: Content) -> (TestDir, PathBuf) {
    let dir = TestDir::new(name);
    let img = dir.join("disk.img");
    match content {
        Content::Sparse => create_sparse_image(&img, size),
        Content::Pattern(seed) => create_pattern_image(&img, size, seed),
        Content::Filled(byte) => create_filled_image(&img, size, byte),
    }
    (dir, img)
}

/// Limits the device reports, used to keep generated requests legal.
struct Limits {
    max_transfer: usize,
    max_segments: usize,
    max_segment_len: usize,
}

fn limits(c: &Client) -> Limits {
    let get = |name: &str| c.blkio.get_i32(name).unwrap_or(0).max(0) as usize;
    let l = Limits {
        max_transfer: get("max-transfer"),
        max_segments: get("max-segments"),
        max_segment_len: get("max-segment-len"),
    };
    eprintln!(
        "device limits: max-transfer {} max-segments {} max-segment-len {}",
        l.max_transfer, l.max_segments, l.max_segment_len
    );
    l
}

/// Splits `len` (a multiple of 512) into random segments of whole sectors that respect the
/// device limits; returns segment lengths.
fn split_segments(rng: &mut Rng, len: usize, lim: &Limits, max_wanted: usize) -> Vec<usize> {
    let max_segs = if lim.max_segments == 0 {
        max_wanted
    } else {
        lim.max_segments.min(max_wanted)
    };
    let max_seg = if lim.max_segment_len == 0 {
        usize::MAX
    } else {
        lim.max_segment_len / 512 * 512
    };
    let sectors = len / 512;
    let want = rng.range(1, max_segs.max(1).min(sectors) as u64) as usize;
    let mut segs = Vec::new();
    let mut left = sectors;
    for i in 0..want {
        let s = if i + 1 == want {
            left
        } else {
            rng.range(1, (left - (want - 1 - i)) as u64) as usize
        };
        segs.push(s * 512);
        left -= s;
    }
    // Honour max-segment-len by cutting big segments; if that makes too many, fall back to
    // uniform max-size pieces (fits because len <= max_transfer).
    let mut out: Vec<usize> = Vec::new();
    for s in segs {
        let mut s = s;
        while s > max_seg {
            out.push(max_seg);
            s -= max_seg;
        }
        out.push(s);
    }
    if lim.max_segments != 0 && out.len() > lim.max_segments {
        out.clear();
        let mut l = len;
        while l > 0 {
            let s = l.min(max_seg);
            out.push(s);
            l -= s;
        }
    }
    out
}

/// Lays segments out in the region starting at `base`, with a 512-byte gap between them so
/// that mixed-up segments are detected. Returns (region offset, len) pairs.
fn layout_segments(base: usize, segs: &[usize]) -> Vec<(usize, usize)> {
    let mut off = base;
    segs.iter()
        .map(|&l| {
            let r = (off, l);
            off += l + 512;
            r
        })
        .collect()
}

#[test]
fn random_reads_and_writes_match_model_and_image_file() {
    random_io_matches_model("random-io", &[]);
}

/// The model check against one vublk configuration (skipped under qemu-storage-daemon).
fn random_io_with_vublk_options(name: &str, extra: &[&str]) {
    if skip_unless_vublk(&format!("{extra:?} are vublk options")) {
        return;
    }
    random_io_matches_model(name, extra);
}

#[test]
fn random_io_with_threads_engine() {
    random_io_with_vublk_options("random-io-threads", &["--aio", "threads"]);
}

#[test]
fn random_io_with_page_cache_writeback() {
    random_io_with_vublk_options("random-io-writeback", &["--cache", "writeback"]);
}

#[test]
fn random_io_with_writethrough_and_threads() {
    random_io_with_vublk_options(
        "random-io-writethrough",
        &["--cache", "writethrough", "--aio", "threads"],
    );
}

#[test]
fn random_io_with_busy_polling() {
    random_io_with_vublk_options("random-io-poll", &["--poll-us", "200"]);
}

#[test]
fn random_io_with_adaptive_polling() {
    random_io_with_vublk_options("random-io-poll-auto", &["--poll-us", "auto"]);
}

#[test]
fn random_io_with_detect_zeroes_on() {
    random_io_with_vublk_options("random-io-dz-on", &["--detect-zeroes", "on"]);
}

#[test]
fn random_io_with_detect_zeroes_unmap() {
    random_io_with_vublk_options(
        "random-io-dz-unmap",
        &["--detect-zeroes", "unmap", "--discard", "unmap"],
    );
}

fn random_io_matches_model(name: &str, extra: &[&str]) {
    const SIZE: u64 = 32 * MIB;
    const OPS: usize = 300;
    let seed = seed(0x5eed_0001);
    let (dir, img) = test_image(name, SIZE, Content::Pattern(seed));
    let mut model = pattern(SIZE as usize, 0, seed);

    let client = ClientOpts {
        mem_size: 4 * MIB as usize,
        ..Default::default()
    };
    let (backend, mut c) = start_and_connect(&dir, &img, &opts_with(extra), client);
    assert_eq!(c.capacity(), SIZE);
    let lim = limits(&c);
    let max_len = if lim.max_transfer == 0 {
        MIB as usize
    } else {
        lim.max_transfer.min(MIB as usize) / 512 * 512
    };

    let mut rng = Rng::new(seed);
    let (mut writes, mut reads, mut bytes) = (0, 0, 0u64);
    for i in 0..OPS {
        let sectors = if rng.below(2) == 0 {
            rng.range(1, 16)
        } else {
            rng.range(1, (max_len / 512) as u64)
        };
        let len = sectors as usize * 512;
        let offset = rng.below((SIZE - len as u64) / 512 + 1) * 512;
        let segs = split_segments(&mut rng, len, &lim, 8);
        let iov = layout_segments(0, &segs);
        bytes += len as u64;
        if rng.below(2) == 0 {
            writes += 1;
            let mut data = vec![0u8; len];
            // One write in four is all zeroes (detect-zeroes converts those), one in eight is
            // zero but for its last byte (must be written as it is).
            match rng.below(8) {
                0 | 1 => {}
                2 => data[len - 1] = 1,
                _ => rng.fill(&mut data),
            }
            let mem = c.mem_mut();
            let mut pos = 0;
            for &(b, l) in &iov {
                mem[b..b + l].copy_from_slice(&data[pos..pos + l]);
                pos += l;
            }
            let ret = c.submit(
                0,
                Op::Writev {
                    offset,
                    iov: iov.clone(),
                },
            );
            assert_eq!(
                ret,
                0,
                "op {i}: writev {len} bytes at {offset} in {} segments: {}",
                iov.len(),
                errno_name(ret)
            );
            model[offset as usize..offset as usize + len].copy_from_slice(&data);
        } else {
            reads += 1;
            // Poison the buffers so stale content cannot pass for read data.
            c.mem_mut()[..2 * MIB as usize].fill(0x5a);
            let ret = c.submit(
                0,
                Op::Readv {
                    offset,
                    iov: iov.clone(),
                },
            );
            assert_eq!(
                ret,
                0,
                "op {i}: readv {len} bytes at {offset} in {} segments: {}",
                iov.len(),
                errno_name(ret)
            );
            let mut got = Vec::with_capacity(len);
            for &(b, l) in &iov {
                got.extend_from_slice(&c.mem()[b..b + l]);
            }
            assert_same(
                &got,
                &model[offset as usize..offset as usize + len],
                &format!("op {i}: readv {len} at {offset}"),
            );
        }
    }
    eprintln!("{writes} writes, {reads} reads, {} MiB", bytes / MIB);

    let all = c.read_all(0);
    assert_same(&all, &model, "whole disk read through the backend");
    drop(c);

    let status = backend.sigterm_and_wait(EXIT_DEADLINE);
    eprintln!("backend exit status: {status}");
    if extra.contains(&"--detect-zeroes") {
        let log = backend.log_contents();
        let detected = logged_count(&log, " zero writes detected");
        assert!(detected > 0, "no zero write was detected:\n{log}");
        eprintln!("{detected} zero writes detected");
    }
    assert_eq!(file_size(&img), SIZE, "image size changed");
    assert_same(
        &read_file(&img),
        &model,
        "image file after the backend exited",
    );
}

#[test]
fn flush_succeeds() {
    let (dir, img) = test_image("flush", 8 * MIB, Content::Sparse);
    let (backend, mut c) = start_and_connect(&dir, &img, &opts(), ClientOpts::default());

    let flush_needed = c.blkio.get_bool("flush-needed").unwrap();
    eprintln!("flush-needed (volatile write cache advertised): {flush_needed}");
    if !skip_unless_vublk("default --cache none advertises a volatile write cache (WCE=1)") {
        // Otherwise libblkio completes FLUSH itself without sending it.
        assert!(
            flush_needed,
            "vublk --cache none must advertise a write-back cache"
        );
    }

    let data = pattern(64 * 1024, 0, 7);
    assert_eq!(c.write_at(0, MIB, &data), 0);
    let ret = c.submit(0, Op::Flush);
    assert_eq!(ret, 0, "flush: {}", errno_name(ret));
    // Flush with nothing dirty, and several flushes in flight at once.
    let rets = c.submit_batch(0, &[Op::Flush, Op::Flush, Op::Flush]);
    assert_eq!(rets, vec![0, 0, 0]);
    assert_same(
        &read_file_range(&img, MIB, data.len()),
        &data,
        "image after flush",
    );
    backend.assert_running();
}

/// Issues `make(offset, len)` requests covering [offset, offset+len) in pieces no larger than
/// `max` (0 = unlimited), asserting each succeeds.
fn in_pieces(c: &mut Client, offset: u64, len: u64, max: u64, make: impl Fn(u64, u64) -> Op) {
    let max = if max == 0 { len } else { max };
    let mut off = offset;
    while off < offset + len {
        let n = (offset + len - off).min(max);
        let op = make(off, n);
        let ret = c.submit(0, op.clone());
        assert_eq!(ret, 0, "{op:?}: {}", errno_name(ret));
        off += n;
    }
}

#[test]
fn discard_punches_hole_in_image_file() {
    const SIZE: u64 = 16 * MIB;
    let (dir, img) = test_image("discard", SIZE, Content::Filled(0xab));
    let before = allocated_blocks(&img);
    assert!(
        before >= SIZE / 512,
        "image not fully allocated ({before} blocks)"
    );

    let o = opts_with(&["--discard", "unmap"]);
    let (backend, mut c) = start_and_connect(&dir, &img, &o, ClientOpts::default());
    let max = c.blkio.get_u64("max-discard-len").unwrap();
    eprintln!(
        "discard-alignment {} max-discard-len {max}",
        c.blkio.get_i32("discard-alignment").unwrap()
    );
    let (off, len) = (4 * MIB, 4 * MIB);
    in_pieces(&mut c, off, len, max, |offset, len| Op::Discard {
        offset,
        len,
    });
    backend.assert_running();

    // Discarded content is unspecified for virtio; what we check is the file: a punched hole.
    let after = allocated_blocks(&img);
    eprintln!("st_blocks before {before}, after {after}");
    assert_all_zero(
        &read_file_range(&img, off, len as usize),
        "discarded range in the image file",
    );
    assert!(
        after + len / 512 <= before + 64,
        "discard of {len} bytes did not deallocate: st_blocks {before} -> {after}"
    );
    let file = read_file(&img);
    assert!(
        file[..off as usize].iter().all(|&b| b == 0xab),
        "data before the discarded range changed"
    );
    assert!(
        file[(off + len) as usize..].iter().all(|&b| b == 0xab),
        "data after the discarded range changed"
    );
    assert_eq!(file.len() as u64, SIZE, "image size changed");
}

/// Shared body of the two WRITE_ZEROES tests; returns st_blocks before and after.
fn write_zeroes_test(name: &str, flags: ReqFlags, extra: &[&str]) -> (u64, u64) {
    const SIZE: u64 = 16 * MIB;
    let (dir, img) = test_image(name, SIZE, Content::Filled(0xcd));
    let before = allocated_blocks(&img);

    let o = opts_with(extra);
    let (backend, mut c) = start_and_connect(&dir, &img, &o, ClientOpts::default());
    let max = c.blkio.get_u64("max-write-zeroes-len").unwrap();
    eprintln!("max-write-zeroes-len {max}");
    // A big aligned range and a small one inside a 4 KiB block.
    let ranges = [(2 * MIB, 4 * MIB), (10 * MIB + 3 * 512, 2 * 512)];
    for &(off, len) in &ranges {
        in_pieces(&mut c, off, len, max, |offset, len| Op::WriteZeroes {
            offset,
            len,
            flags,
        });
    }
    backend.assert_running();

    let mut expected = vec![0xcdu8; SIZE as usize];
    for &(off, len) in &ranges {
        expected[off as usize..(off + len) as usize].fill(0);
        let got = c
            .read_at(0, off, len as usize)
            .unwrap_or_else(|e| panic!("read back: {}", errno_name(e)));
        assert_all_zero(&got, &format!("read back of zeroed range {off}+{len}"));
    }
    assert_same(&c.read_all(0), &expected, "whole disk through the backend");
    assert_same(&read_file(&img), &expected, "image file");
    let after = allocated_blocks(&img);
    eprintln!("st_blocks before {before}, after {after}");
    (before, after)
}

#[test]
fn write_zeroes_with_unmap_reads_back_zero_and_deallocates_with_discard_unmap() {
    let (before, after) = write_zeroes_test("wz-unmap", ReqFlags::empty(), &["--discard", "unmap"]);
    assert!(
        after < before,
        "write-zeroes with UNMAP and --discard unmap kept the blocks: {before} -> {after}"
    );
}

#[test]
fn write_zeroes_with_unmap_keeps_allocation_under_discard_ignore() {
    if skip_unless_vublk("--discard ignore is vublk's default; the QSD helper sets discard=unmap") {
        return;
    }
    let (before, after) = write_zeroes_test("wz-unmap-ignore", ReqFlags::empty(), &[]);
    assert!(
        after >= before,
        "write-zeroes deallocated although --discard ignore: {before} -> {after}"
    );
}

#[test]
fn discard_is_ignored_by_default() {
    if skip_unless_vublk("--discard ignore is vublk's default; the QSD helper sets discard=unmap") {
        return;
    }
    const SIZE: u64 = 8 * MIB;
    let (dir, img) = test_image("discard-ignore", SIZE, Content::Filled(0xab));
    let before = allocated_blocks(&img);
    let (_backend, mut c) = start_and_connect(&dir, &img, &opts(), ClientOpts::default());
    let ret = c.submit(
        0,
        Op::Discard {
            offset: MIB,
            len: 2 * MIB,
        },
    );
    assert_eq!(ret, 0, "discard must succeed: {}", errno_name(ret));
    assert!(
        read_file(&img).iter().all(|&b| b == 0xab),
        "ignored discard changed data"
    );
    assert!(
        allocated_blocks(&img) >= before,
        "ignored discard deallocated"
    );
}

#[test]
fn write_zeroes_no_unmap_reads_back_zero_and_keeps_allocation() {
    let (before, after) =
        write_zeroes_test("wz-no-unmap", ReqFlags::NO_UNMAP, &["--discard", "unmap"]);
    assert!(
        after >= before,
        "write-zeroes with NO_UNMAP deallocated: st_blocks {before} -> {after}"
    );
}

#[test]
fn two_queues_do_concurrent_io_on_disjoint_ranges() {
    const SIZE: u64 = 32 * MIB;
    const HALF: u64 = SIZE / 2;
    const SLOTS: u64 = 4;
    const SLOT: u64 = HALF / SLOTS;
    const MAX_IO: usize = 128 * 1024;
    const ROUNDS: usize = 40;
    let seed = seed(0x5eed_0002);
    let (dir, img) = test_image("two-queues", SIZE, Content::Pattern(seed));

    let o = BackendOpts {
        num_queues: Some(2),
        ..opts()
    };
    let client = ClientOpts {
        num_queues: 2,
        mem_size: 4 * MIB as usize,
        ..Default::default()
    };
    let (backend, mut c) = start_and_connect(&dir, &img, &o, client);
    assert_eq!(
        c.blkio.get_i32("max-queues").unwrap(),
        2,
        "device should offer 2 queues"
    );
    let (queues, mem) = c.take_queues();
    assert_eq!(queues.len(), 2);
    let barrier = Arc::new(Barrier::new(2));

    let handles: Vec<_> = queues
        .into_iter()
        .enumerate()
        .map(|(qi, mut q)| {
            let barrier = Arc::clone(&barrier);
            thread::spawn(move || {
                let mut rng = Rng::new(seed ^ ((qi as u64 + 1) * 0x1234_5678));
                let disk_base = qi as u64 * HALF;
                let mem_base = qi * 2 * MIB as usize; // this queue's half of the region
                let mut model = pattern(HALF as usize, disk_base, seed);
                barrier.wait();
                for round in 0..ROUNDS {
                    // One write per slot, all in flight together, then read them all back.
                    let mut writes = Vec::new();
                    let mut reads = Vec::new();
                    for s in 0..SLOTS as usize {
                        let len = rng.range(1, (MAX_IO / 512) as u64) as usize * 512;
                        let off_in_slot = rng.below((SLOT - len as u64) / 512 + 1) * 512;
                        let rel = s as u64 * SLOT + off_in_slot;
                        let wbuf = mem_base + s * 2 * MAX_IO;
                        let rbuf = wbuf + MAX_IO;
                        // SAFETY: the client outlives this thread (joined below); this range
                        // belongs to this thread only and no request is using it now.
                        let w = unsafe { mem.slice_mut(wbuf, len) };
                        rng.fill(w);
                        model[rel as usize..rel as usize + len].copy_from_slice(w);
                        // SAFETY: as above.
                        unsafe { mem.slice_mut(rbuf, len) }.fill(0x5a);
                        writes.push(Op::Write {
                            offset: disk_base + rel,
                            buf: wbuf,
                            len,
                        });
                        reads.push((
                            Op::Read {
                                offset: disk_base + rel,
                                buf: rbuf,
                                len,
                            },
                            rel,
                            rbuf,
                            len,
                        ));
                    }
                    let rets = run_batch(&mut q, mem, &writes);
                    assert!(
                        rets.iter().all(|&r| r == 0),
                        "queue {qi} round {round}: writes {rets:?}"
                    );
                    let ops: Vec<Op> = reads.iter().map(|r| r.0.clone()).collect();
                    let rets = run_batch(&mut q, mem, &ops);
                    assert!(
                        rets.iter().all(|&r| r == 0),
                        "queue {qi} round {round}: reads {rets:?}"
                    );
                    for (_, rel, rbuf, len) in reads {
                        // SAFETY: as above; the read completed.
                        let got = unsafe { mem.slice_mut(rbuf, len) };
                        assert_same(
                            got,
                            &model[rel as usize..rel as usize + len],
                            &format!("queue {qi} round {round} read at {}", disk_base + rel),
                        );
                    }
                }
                (q, model)
            })
        })
        .collect();

    let mut expected = Vec::new();
    let mut queues = Vec::new();
    for h in handles {
        let (q, model) = h.join().expect("queue thread panicked");
        queues.push(q);
        expected.extend_from_slice(&model);
    }
    c.queues = queues;
    backend.assert_running();
    assert_same(&c.read_all(1), &expected, "whole disk via queue 1");
    assert_same(&read_file(&img), &expected, "image file");
}

#[test]
fn unaligned_buffers_roundtrip() {
    const SIZE: u64 = 8 * MIB;
    let seed = seed(0x5eed_0003);
    let (dir, img) = test_image("unaligned", SIZE, Content::Pattern(seed));
    let client = ClientOpts {
        mem_size: 4 * MIB as usize,
        ..Default::default()
    };
    let (backend, mut c) = start_and_connect(&dir, &img, &opts(), client);
    let mut rng = Rng::new(seed);
    let rbase = 2 * MIB as usize;

    let mut disk_off = 0u64;
    for &mis in &[1usize, 8, 64, 511, 4095] {
        for &len in &[512usize, 4096, 64 * 1024 + 512] {
            let mut data = vec![0u8; len];
            rng.fill(&mut data);
            c.mem_mut()[mis..mis + len].copy_from_slice(&data);
            let ret = c.submit(
                0,
                Op::Write {
                    offset: disk_off,
                    buf: mis,
                    len,
                },
            );
            assert_eq!(
                ret,
                0,
                "write {len} at {disk_off} from buffer offset +{mis}: {}",
                errno_name(ret)
            );

            let rmis = rbase + (mis * 7) % 4096 + 1; // a different odd misalignment for the read
            c.mem_mut()[rmis - 1..rmis + len + 1].fill(0x5a);
            let ret = c.submit(
                0,
                Op::Read {
                    offset: disk_off,
                    buf: rmis,
                    len,
                },
            );
            assert_eq!(
                ret,
                0,
                "read {len} at {disk_off} into buffer offset +{}: {}",
                rmis - rbase,
                errno_name(ret)
            );
            assert_same(
                &c.mem()[rmis..rmis + len],
                &data,
                &format!("read back (write +{mis}, len {len})"),
            );
            assert_eq!(c.mem()[rmis - 1], 0x5a, "read wrote before its buffer");
            assert_eq!(c.mem()[rmis + len], 0x5a, "read wrote past its buffer");
            assert_same(
                &read_file_range(&img, disk_off, len),
                &data,
                &format!("image file (write +{mis}, len {len})"),
            );
            disk_off += len as u64 + 4096;
        }
    }

    // Multi-segment requests whose segments are all misaligned.
    let data = {
        let mut d = vec![0u8; 3 * 4096];
        rng.fill(&mut d);
        d
    };
    let wiov = vec![(3usize, 4096usize), (8192 + 17, 4096), (20000 + 64, 4096)];
    let mut pos = 0;
    for &(b, l) in &wiov {
        c.mem_mut()[b..b + l].copy_from_slice(&data[pos..pos + l]);
        pos += l;
    }
    let off = 5 * MIB;
    let ret = c.submit(
        0,
        Op::Writev {
            offset: off,
            iov: wiov,
        },
    );
    assert_eq!(ret, 0, "misaligned writev: {}", errno_name(ret));
    let riov = vec![(rbase + 1, 8192usize), (rbase + 16384 + 9, 4096)];
    let ret = c.submit(
        0,
        Op::Readv {
            offset: off,
            iov: riov.clone(),
        },
    );
    assert_eq!(ret, 0, "misaligned readv: {}", errno_name(ret));
    let mut got = c.mem()[riov[0].0..riov[0].0 + 8192].to_vec();
    got.extend_from_slice(&c.mem()[riov[1].0..riov[1].0 + 4096]);
    assert_same(&got, &data, "misaligned readv");
    assert_same(
        &read_file_range(&img, off, data.len()),
        &data,
        "image file after misaligned writev",
    );
    backend.assert_running();
    if !skip_unless_vublk("bounce-buffer statistics are vublk's") {
        // O_DIRECT cannot take these buffers: vublk must have bounced them (its per-queue
        // statistics are logged when the client disconnects).
        disconnect_and_stop(&backend, c);
        let log = backend.log_contents();
        let bounced = logged_count(&log, " bounced");
        assert!(bounced > 0, "no request was bounced:\n{log}");
    }
}

#[test]
fn segments_of_odd_lengths_roundtrip() {
    // virtio allows data descriptors of any length as long as the total is whole sectors.
    const SIZE: u64 = 8 * MIB;
    let seed = seed(0x5eed_0004);
    let (dir, img) = test_image("odd-segments", SIZE, Content::Pattern(seed));
    let (backend, mut c) = start_and_connect(&dir, &img, &opts(), ClientOpts::default());
    let mut rng = Rng::new(seed);
    let rbase = 2 * MIB as usize;

    let cases: &[(&[usize], &[usize])] = &[
        (&[1000, 24, 3072], &[7, 505, 3584]),
        (&[1, 511], &[256, 256]),
        (&[4097, 4095, 512], &[8704]),
        (&[65536 + 100, 412], &[1, 1, 1, 65536 + 509]),
    ];
    let mut off = 3 * 512; // deliberately not 4 KiB aligned on the disk either
    for (i, &(wsegs, rsegs)) in cases.iter().enumerate() {
        let len: usize = wsegs.iter().sum();
        assert_eq!(len, rsegs.iter().sum::<usize>());
        let mut data = vec![0u8; len];
        rng.fill(&mut data);
        let wiov = layout_segments(0, wsegs);
        let mut pos = 0;
        for &(b, l) in &wiov {
            c.mem_mut()[b..b + l].copy_from_slice(&data[pos..pos + l]);
            pos += l;
        }
        let ret = c.submit(
            0,
            Op::Writev {
                offset: off,
                iov: wiov,
            },
        );
        assert_eq!(ret, 0, "case {i}: writev {wsegs:?}: {}", errno_name(ret));
        let riov = layout_segments(rbase, rsegs);
        c.mem_mut()[rbase..].fill(0x5a);
        let ret = c.submit(
            0,
            Op::Readv {
                offset: off,
                iov: riov.clone(),
            },
        );
        assert_eq!(ret, 0, "case {i}: readv {rsegs:?}: {}", errno_name(ret));
        let mut got = Vec::new();
        for &(b, l) in &riov {
            got.extend_from_slice(&c.mem()[b..b + l]);
            assert_eq!(c.mem()[b + l], 0x5a, "case {i}: read wrote past a segment");
        }
        assert_same(&got, &data, &format!("case {i}: readv {rsegs:?}"));
        assert_same(
            &read_file_range(&img, off, len),
            &data,
            &format!("case {i}: image file"),
        );
        off += len as u64 + 512 * 9;
    }
    backend.assert_running();
}

#[test]
fn requests_past_capacity_fail_and_daemon_keeps_serving() {
    const SIZE: u64 = 8 * MIB;
    let (dir, img) = test_image("past-capacity", SIZE, Content::Pattern(9));
    let original = read_file(&img);
    let (backend, mut c) = start_and_connect(&dir, &img, &opts(), ClientOpts::default());
    let cap = c.capacity();
    assert_eq!(cap, SIZE);

    c.mem_mut()[..2 * 4096].fill(0xee);
    let bad = [
        Op::Read {
            offset: cap,
            buf: 0,
            len: 512,
        },
        Op::Read {
            offset: cap - 512,
            buf: 0,
            len: 1024,
        },
        Op::Read {
            offset: cap + MIB,
            buf: 0,
            len: 4096,
        },
        Op::Write {
            offset: cap,
            buf: 0,
            len: 512,
        },
        Op::Write {
            offset: cap - 512,
            buf: 0,
            len: 1024,
        },
        Op::Write {
            offset: cap - 4096,
            buf: 0,
            len: 2 * 4096,
        },
        Op::Write {
            offset: u64::MAX / 512 * 512 - 511 * 512,
            buf: 0,
            len: 4096,
        },
    ];
    for op in &bad {
        let ret = c.submit(0, op.clone());
        assert_eq!(
            ret,
            EIO,
            "{op:?} should fail with an I/O error, got {}",
            errno_name(ret)
        );
        backend.assert_running();
    }
    // DISCARD / WRITE_ZEROES straddling the end: any error status will do.
    let bad_dwz = [
        Op::Discard {
            offset: cap - 4096,
            len: 8192,
        },
        Op::WriteZeroes {
            offset: cap - 4096,
            len: 8192,
            flags: ReqFlags::NO_UNMAP,
        },
        Op::WriteZeroes {
            offset: cap,
            len: 4096,
            flags: ReqFlags::empty(),
        },
    ];
    for op in &bad_dwz {
        let ret = c.submit(0, op.clone());
        assert!(ret < 0, "{op:?} should fail, got {}", errno_name(ret));
        backend.assert_running();
    }
    // Nothing was written, not even the in-range part of a straddling request.
    assert_same(&read_file(&img), &original, "image after rejected requests");
    assert_eq!(file_size(&img), SIZE, "image grew");

    // The daemon still serves: the last sector is readable and writable.
    let last = c.read_at(0, cap - 512, 512).expect("read last sector");
    assert_same(&last, &original[(SIZE - 512) as usize..], "last sector");
    let data = pattern(4096, 0, 99);
    assert_eq!(c.write_at(0, cap - 4096, &data), 0, "write last 4 KiB");
    assert_same(
        &c.read_at(0, cap - 4096, 4096).unwrap(),
        &data,
        "last 4 KiB read back",
    );
    assert_same(
        &read_file_range(&img, SIZE - 4096, 4096),
        &data,
        "image file tail",
    );
}

#[test]
fn read_only_device_refuses_a_read_write_client() {
    let (dir, img) = test_image("ro-refuse", 4 * MIB, Content::Pattern(11));
    let backend = Backend::start(
        &dir,
        &img,
        &BackendOpts {
            read_only: true,
            ..opts()
        },
    );
    // libblkio's start() fails with EROFS when the device offers VIRTIO_BLK_F_RO and the client
    // did not set read-only: this is how we see that the backend advertises RO.
    match try_connect(&backend.socket, ClientOpts::default()) {
        Ok(_) => panic!(
            "read-write client started on a --read-only backend: VIRTIO_BLK_F_RO not offered?"
        ),
        Err(e) => assert_eq!(e.errno(), blkio::Errno::ROFS, "unexpected error: {e}"),
    }
    backend.assert_running();
}

#[test]
fn read_only_serves_reads_and_rejects_writes() {
    const SIZE: u64 = 4 * MIB;
    let (dir, img) = test_image("ro", SIZE, Content::Pattern(12));
    let original = read_file(&img);
    let blocks = allocated_blocks(&img);
    let o = BackendOpts {
        read_only: true,
        ..opts()
    };
    let client = ClientOpts {
        read_only: true,
        ..Default::default()
    };
    let (backend, mut c) = start_and_connect(&dir, &img, &o, client);
    assert_eq!(c.capacity(), SIZE);
    assert_same(
        &c.read_all(0),
        &original,
        "read-only disk read through the backend",
    );

    c.mem_mut()[..4096].fill(0x11);
    let ops = [
        Op::Write {
            offset: 0,
            buf: 0,
            len: 4096,
        },
        Op::Writev {
            offset: MIB,
            iov: vec![(0, 512)],
        },
        Op::Discard {
            offset: 0,
            len: MIB,
        },
        Op::WriteZeroes {
            offset: 0,
            len: MIB,
            flags: ReqFlags::empty(),
        },
        Op::WriteZeroes {
            offset: 0,
            len: MIB,
            flags: ReqFlags::NO_UNMAP,
        },
    ];
    for op in &ops {
        let ret = c.submit(0, op.clone());
        // Note: libblkio fails these itself (EBADF) on a read-only instance, and discard /
        // write-zeroes with ENOTSUP if the device does not offer them; it never sends them.
        assert!(ret < 0, "{op:?} succeeded on a read-only device");
        eprintln!("{op:?}: {}", errno_name(ret));
    }
    let ret = c.submit(0, Op::Flush);
    eprintln!("flush on read-only device: {}", errno_name(ret));
    backend.assert_running();
    drop(c);
    drop(backend);
    assert_same(&read_file(&img), &original, "read-only image changed");
    assert_eq!(
        allocated_blocks(&img),
        blocks,
        "read-only image allocation changed"
    );
}

#[test]
fn second_client_sees_data_after_first_disconnects() {
    const SIZE: u64 = 8 * MIB;
    let (dir, img) = test_image("reconnect", SIZE, Content::Sparse);
    let backend = Backend::start(&dir, &img, &opts());
    let pieces = [
        (0u64, 4096usize),
        (3 * MIB + 512, 64 * 1024),
        (SIZE - 8192, 8192),
    ];

    {
        let mut c = connect_queues(&backend.socket, 1);
        for (i, &(off, len)) in pieces.iter().enumerate() {
            let ret = c.write_at(0, off, &pattern(len, off, 20 + i as u64));
            assert_eq!(ret, 0, "first client: write at {off}: {}", errno_name(ret));
        }
        // Dropping the instance closes the socket without any goodbye message.
    }
    backend.assert_running();

    let mut c = connect_queues(&backend.socket, 1);
    assert_eq!(c.capacity(), SIZE);
    for (i, &(off, len)) in pieces.iter().enumerate() {
        let got = c
            .read_at(0, off, len)
            .unwrap_or_else(|e| panic!("second client: read at {off}: {}", errno_name(e)));
        assert_same(
            &got,
            &pattern(len, off, 20 + i as u64),
            &format!("second client: data at {off}"),
        );
    }
    // And the second client can write too.
    assert_eq!(c.write_at(0, MIB, &pattern(4096, MIB, 30)), 0);
    drop(c);

    // And a third connection after that.
    let mut c = connect_queues(&backend.socket, 1);
    assert_same(
        &c.read_at(0, MIB, 4096).unwrap(),
        &pattern(4096, MIB, 30),
        "third client",
    );
}

#[test]
fn sigterm_with_connected_client_exits_zero() {
    const SIZE: u64 = 8 * MIB;
    let (dir, img) = test_image("sigterm-busy", SIZE, Content::Sparse);
    let (backend, mut c) = start_and_connect(&dir, &img, &opts(), ClientOpts::default());
    let data = pattern(128 * 1024, 2 * MIB, 40);
    assert_eq!(c.write_at(0, 2 * MIB, &data), 0);

    let status = backend.sigterm_and_wait(EXIT_DEADLINE);
    assert!(
        status.success(),
        "exit status after SIGTERM with a connected client: {status}; log:\n{}",
        backend.log_contents()
    );
    drop(c);
    assert_same(
        &read_file_range(&img, 2 * MIB, data.len()),
        &data,
        "data written before SIGTERM",
    );
    assert_eq!(file_size(&img), SIZE);
}

#[test]
fn sigterm_while_idle_exits_zero() {
    let (dir, img) = test_image("sigterm-idle", 4 * MIB, Content::Sparse);
    let backend = Backend::start(&dir, &img, &opts());
    let status = backend.sigterm_and_wait(EXIT_DEADLINE);
    assert!(
        status.success(),
        "exit status after SIGTERM while idle: {status}; log:\n{}",
        backend.log_contents()
    );
}

#[test]
fn capacity_equals_file_size() {
    const SIZE: u64 = 24 * MIB;
    let (dir, img) = test_image("capacity", SIZE, Content::Sparse);
    let (_backend, c) = start_and_connect(&dir, &img, &opts(), ClientOpts::default());
    assert_eq!(c.capacity(), SIZE);
    // libblkio re-reads the config space on every query.
    assert_eq!(c.capacity(), SIZE);
}

#[test]
fn capacity_of_file_not_a_multiple_of_4k_is_its_size() {
    const SIZE: u64 = 5 * MIB + 3 * 512;
    let (dir, img) = test_image("capacity-odd", SIZE, Content::Pattern(50));
    let (_backend, mut c) = start_and_connect(&dir, &img, &opts(), ClientOpts::default());
    assert_eq!(c.capacity(), SIZE);
    // The last (partial-4K) sectors are readable and writable.
    let tail = c
        .read_at(0, SIZE - 3 * 512, 3 * 512)
        .unwrap_or_else(|e| panic!("read tail: {}", errno_name(e)));
    assert_same(&tail, &pattern(3 * 512, SIZE - 3 * 512, 50), "tail sectors");
    let data = pattern(1024, 0, 51);
    assert_eq!(
        c.write_at(0, SIZE - 1024, &data),
        0,
        "write the last two sectors"
    );
    assert_same(
        &read_file_range(&img, SIZE - 1024, 1024),
        &data,
        "image tail",
    );
    assert_eq!(file_size(&img), SIZE, "image size changed");
}
