//! detect-zeroes and discard through a real client: for each option combination, all-zero
//! writes into a sparse and into a fully written image, checked for contents, allocation
//! (st_blocks) and vublk's counters; partly-zero writes must go out as written.

mod common;

use common::*;

const SIZE: u64 = 16 * MIB;
const ZERO_OFF: u64 = 4 * MIB;
const ZERO_LEN: u64 = 4 * MIB;

struct Case {
    name: &'static str,
    args: &'static [&'static str],
    /// Blocks of the zeroed range stay allocated (on a fully written image).
    keeps_allocation: bool,
    /// Writes are converted (counters move).
    converts: bool,
}

const CASES: &[Case] = &[
    Case {
        name: "off",
        args: &[],
        keeps_allocation: true,
        converts: false,
    },
    Case {
        name: "on",
        args: &["--detect-zeroes", "on"],
        keeps_allocation: true,
        converts: true,
    },
    Case {
        name: "on-discard-unmap",
        args: &["--detect-zeroes", "on", "--discard", "unmap"],
        keeps_allocation: true,
        converts: true,
    },
    Case {
        name: "unmap",
        args: &["--detect-zeroes", "unmap", "--discard", "unmap"],
        keeps_allocation: false,
        converts: true,
    },
];

/// Write ZERO_LEN bytes of zeroes at ZERO_OFF in 1 MiB requests.
fn write_zeroes_as_data(c: &mut Client) {
    c.mem_mut()[..MIB as usize].fill(0);
    let mut off = ZERO_OFF;
    while off < ZERO_OFF + ZERO_LEN {
        let ret = c.submit(
            0,
            Op::Write {
                offset: off,
                buf: 0,
                len: MIB as usize,
            },
        );
        assert_eq!(ret, 0, "zero write at {off}: {}", errno_name(ret));
        off += MIB;
    }
}

fn run_case(case: &Case, fully_written: bool) {
    if skip_unless_vublk("--detect-zeroes here is vublk's option") {
        return;
    }
    let tag = format!(
        "dz-{}-{}",
        case.name,
        if fully_written { "full" } else { "sparse" }
    );
    let dir = TestDir::new(&tag);
    let img = dir.join("disk.img");
    if fully_written {
        create_filled_image(&img, SIZE, 0xab);
    } else {
        create_sparse_image(&img, SIZE);
    }
    let before = allocated_blocks(&img);
    let opts = BackendOpts {
        extra_args: case.args.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    };
    let backend = Backend::start(&dir, &img, &opts);
    let mut c = connect_queues(&backend.socket, 1);
    write_zeroes_as_data(&mut c);
    // A write that is zero but for its last byte is data, not a zero write.
    let mut partial = vec![0u8; 64 * 1024];
    *partial.last_mut().unwrap() = 0x42;
    assert_eq!(c.write_at(0, 12 * MIB, &partial), 0);
    assert_eq!(c.submit(0, Op::Flush), 0);
    assert_all_zero(
        &c.read_at(0, ZERO_OFF, ZERO_LEN as usize).unwrap(),
        "zeroed range via vublk",
    );
    drop(c);
    assert_eq!(backend.sigterm_and_wait(EXIT_DEADLINE).code(), Some(0));

    let file = read_file(&img);
    assert_all_zero(
        &file[ZERO_OFF as usize..(ZERO_OFF + ZERO_LEN) as usize],
        "zeroed range in the file",
    );
    assert_same(
        &file[12 * MIB as usize..12 * MIB as usize + partial.len()],
        &partial,
        "partly-zero write",
    );
    if fully_written {
        assert!(
            file[..ZERO_OFF as usize].iter().all(|&b| b == 0xab),
            "data before the range"
        );
    }
    let after = allocated_blocks(&img);
    let zero_blocks = ZERO_LEN / 512;
    eprintln!("{tag}: st_blocks {before} -> {after}");
    if fully_written {
        if case.keeps_allocation {
            assert!(after >= before, "{tag}: blocks freed ({before} -> {after})");
        } else {
            assert!(
                after + zero_blocks <= before + 8,
                "{tag}: the zeroed range was not deallocated ({before} -> {after})"
            );
        }
    } else if !case.keeps_allocation {
        // Sparse image, unmap: the zero writes allocate nothing; only the 64 KiB data write.
        assert!(
            after <= 256,
            "{tag}: zero writes allocated space: {after} blocks"
        );
    } else if !case.converts {
        assert!(
            after >= zero_blocks,
            "{tag}: plain zero writes must allocate: {after} blocks"
        );
    }
    let log = backend.log_contents();
    let detected = logged_count(&log, " zero writes detected");
    let converted = logged_count(&log, " bytes written as zero operations");
    let unmapped = logged_count(&log, " bytes deallocated");
    if case.converts {
        assert_eq!(detected, ZERO_LEN / MIB, "{tag}: {log}");
        assert_eq!(converted, ZERO_LEN, "{tag}");
    } else {
        assert_eq!(detected, 0, "{tag}: scanned although off");
    }
    assert_eq!(
        unmapped,
        if case.keeps_allocation { 0 } else { ZERO_LEN },
        "{tag}: {log}"
    );
}

#[test]
fn zero_writes_into_a_sparse_image() {
    for case in CASES {
        run_case(case, false);
    }
}

#[test]
fn zero_writes_over_a_fully_written_image() {
    for case in CASES {
        run_case(case, true);
    }
}

/// --discard unmap without detect-zeroes: DISCARD deallocates and is counted.
#[test]
fn discard_unmap_counts_deallocated_bytes() {
    if skip_unless_vublk("counters are vublk's") {
        return;
    }
    let dir = TestDir::new("dz-discard-count");
    let img = dir.join("disk.img");
    create_filled_image(&img, SIZE, 0xab);
    let opts = BackendOpts {
        extra_args: vec!["--discard".into(), "unmap".into()],
        ..Default::default()
    };
    let backend = Backend::start(&dir, &img, &opts);
    let mut c = connect_queues(&backend.socket, 1);
    assert_eq!(
        c.submit(
            0,
            Op::Discard {
                offset: MIB,
                len: 2 * MIB
            }
        ),
        0
    );
    drop(c);
    assert_eq!(backend.sigterm_and_wait(EXIT_DEADLINE).code(), Some(0));
    let log = backend.log_contents();
    assert_eq!(logged_count(&log, " bytes deallocated"), 2 * MIB, "{log}");
    assert_eq!(logged_count(&log, " zero writes detected"), 0, "{log}");
}

/// A block device as --blk-file (a loop device over a file): DISCARD is a BLKDISCARD, zero
/// writes and WRITE_ZEROES go through the kernel's block-device zero-out, and with unmap the
/// space is given back in the backing file.
#[test]
fn block_device_discard_and_zero_writes() {
    if skip_unless_vublk("--discard/--detect-zeroes here are vublk's options") {
        return;
    }
    let dir = TestDir::new("dz-blockdev");
    let backing = dir.join("backing.img");
    create_filled_image(&backing, SIZE, 0xab);
    let Some(lo) = LoopDev::new(&backing, 512) else {
        return;
    };
    let before = allocated_blocks(&backing);
    let opts = BackendOpts {
        extra_args: ["--discard", "unmap", "--detect-zeroes", "unmap"]
            .iter()
            .map(|s| s.to_string())
            .collect(),
        ..Default::default()
    };
    let backend = Backend::start(&dir, std::path::Path::new(&lo.0), &opts);
    let mut c = connect_queues(&backend.socket, 1);
    assert_eq!(
        c.submit(
            0,
            Op::Discard {
                offset: MIB,
                len: 2 * MIB
            }
        ),
        0,
        "discard"
    );
    write_zeroes_as_data(&mut c); // ZERO_OFF..+ZERO_LEN, converted to punched zeroes
    let wz = Op::WriteZeroes {
        offset: 12 * MIB,
        len: MIB,
        flags: blkio::ReqFlags::NO_UNMAP,
    };
    assert_eq!(c.submit(0, wz), 0, "write zeroes");
    assert_eq!(c.submit(0, Op::Flush), 0);
    let all = c.read_all(0);
    assert_all_zero(
        &all[ZERO_OFF as usize..(ZERO_OFF + ZERO_LEN) as usize],
        "zero writes",
    );
    assert_all_zero(&all[12 * MIB as usize..13 * MIB as usize], "write zeroes");
    assert!(
        all[8 * MIB as usize..12 * MIB as usize]
            .iter()
            .all(|&b| b == 0xab),
        "untouched data"
    );
    drop(c);
    assert_eq!(backend.sigterm_and_wait(EXIT_DEADLINE).code(), Some(0));
    let log = backend.log_contents();
    assert_eq!(
        logged_count(&log, " zero writes detected"),
        ZERO_LEN / MIB,
        "{log}"
    );
    assert!(
        logged_count(&log, " bytes deallocated") >= ZERO_LEN + 2 * MIB,
        "{log}"
    );
    drop(lo);
    let after = allocated_blocks(&backing);
    eprintln!("backing file st_blocks {before} -> {after}");
    assert!(
        after + (ZERO_LEN + 2 * MIB) / 512 <= before + 64,
        "the loop device's backing file kept the discarded and zeroed space: {before} -> {after}"
    );
}
