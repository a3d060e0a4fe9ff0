//! Parser tests: byte fixtures in a small guest memory, one behaviour per test, and a proptest
//! that corrupts a valid chain one way at a time.

use proptest::prelude::*;
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use super::*;
use crate::virtio_blk::{req_type, status, RANGE_FLAG_UNMAP};

const MEM_SIZE: usize = 0x10_0000;
const HDR: u64 = 0x1000;
const DATA: u64 = 0x2000;
const STATUS: u64 = 0x9000;

fn mem() -> GuestMemoryMmap<()> {
    GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MEM_SIZE)]).unwrap()
}

fn limits() -> DeviceLimits {
    DeviceLimits {
        capacity_sectors: 2048,
        logical_block_size: 512,
        read_only: false,
        seg_max: 126,
        max_discard_sectors: 1024,
        max_discard_seg: 4,
        max_write_zeroes_sectors: 1024,
        max_write_zeroes_seg: 4,
    }
}

/// Header: type (le32), reserved (le32), sector (le64).
fn write_header(m: &GuestMemoryMmap<()>, type_: u32, sector: u64) {
    m.write_obj(type_.to_le(), GuestAddress(HDR)).unwrap();
    m.write_obj(0u32, GuestAddress(HDR + 4)).unwrap();
    m.write_obj(sector.to_le(), GuestAddress(HDR + 8)).unwrap();
}

fn d(addr: u64, len: u32, write_only: bool) -> Desc {
    Desc {
        addr,
        len,
        write_only,
    }
}

fn parse(
    m: &GuestMemoryMmap<()>,
    descs: &[Desc],
    l: &DeviceLimits,
) -> (Result<(), RequestError>, Request) {
    let mut r = Request::default();
    let res = parse_request(m, descs.iter().copied(), l, &mut r);
    (res, r)
}

#[test]
fn parse_read_with_three_descriptors() {
    let m = mem();
    write_header(&m, req_type::IN, 8);
    let (res, r) = parse(
        &m,
        &[d(HDR, 16, false), d(DATA, 4096, true), d(STATUS, 1, true)],
        &limits(),
    );
    res.unwrap();
    assert_eq!(r.kind, RequestType::In);
    assert_eq!(r.sector, 8);
    assert_eq!(
        r.data,
        vec![Segment {
            addr: GuestAddress(DATA),
            len: 4096
        }]
    );
    assert_eq!(r.data_len, 4096);
    assert_eq!(r.status_addr, GuestAddress(STATUS));
}

#[test]
fn parse_write_with_header_data_and_status_in_one_descriptor_each_side() {
    // Header and data share one readable descriptor; data and status share one writable one
    // for a read: the parser must not assume any framing.
    let m = mem();
    write_header(&m, req_type::OUT, 0);
    let (res, r) = parse(
        &m,
        &[d(HDR, 16 + 512, false), d(STATUS, 1, true)],
        &limits(),
    );
    res.unwrap();
    assert_eq!(r.kind, RequestType::Out);
    assert_eq!(
        r.data,
        vec![Segment {
            addr: GuestAddress(HDR + 16),
            len: 512
        }]
    );

    write_header(&m, req_type::IN, 0);
    let (res, r) = parse(&m, &[d(HDR, 16, false), d(DATA, 513, true)], &limits());
    res.unwrap();
    assert_eq!(
        r.data,
        vec![Segment {
            addr: GuestAddress(DATA),
            len: 512
        }]
    );
    assert_eq!(r.status_addr, GuestAddress(DATA + 512));
}

#[test]
fn parse_header_split_across_descriptors() {
    let m = mem();
    write_header(&m, req_type::IN, 16);
    let (res, r) = parse(
        &m,
        &[
            d(HDR, 5, false),
            d(HDR + 5, 11, false),
            d(DATA, 512, true),
            d(STATUS, 1, true),
        ],
        &limits(),
    );
    res.unwrap();
    assert_eq!(r.sector, 16);
}

#[test]
fn parse_rejects_chain_without_writable_status() {
    let m = mem();
    write_header(&m, req_type::FLUSH, 0);
    let (res, _) = parse(&m, &[d(HDR, 16, false)], &limits());
    assert_eq!(res, Err(RequestError::NoStatus));
}

#[test]
fn parse_rejects_short_header_with_ioerr() {
    let m = mem();
    let (res, r) = parse(&m, &[d(HDR, 8, false), d(STATUS, 1, true)], &limits());
    assert_eq!(res, Err(RequestError::ShortHeader));
    assert_eq!(res.unwrap_err().status(), status::IOERR);
    assert_eq!(r.status_addr, GuestAddress(STATUS));
}

#[test]
fn parse_rejects_readable_after_writable() {
    let m = mem();
    write_header(&m, req_type::OUT, 0);
    let (res, _) = parse(
        &m,
        &[
            d(HDR, 16, false),
            d(STATUS, 1, true),
            d(DATA, 512, false),
            d(STATUS + 1, 1, true),
        ],
        &limits(),
    );
    assert_eq!(res, Err(RequestError::ReadableAfterWritable));
}

#[test]
fn parse_rejects_descriptor_outside_guest_memory() {
    let m = mem();
    write_header(&m, req_type::IN, 0);
    let (res, _) = parse(
        &m,
        &[
            d(HDR, 16, false),
            d(MEM_SIZE as u64 - 256, 512, true),
            d(STATUS, 1, true),
        ],
        &limits(),
    );
    assert!(matches!(res, Err(RequestError::BadAddress(_))));
}

#[test]
fn unknown_type_is_unsupp() {
    let m = mem();
    write_header(&m, 99, 0);
    let (res, _) = parse(&m, &[d(HDR, 16, false), d(STATUS, 1, true)], &limits());
    assert_eq!(res, Err(RequestError::UnsupportedType(99)));
    assert_eq!(res.unwrap_err().status(), status::UNSUPP);
}

#[test]
fn read_past_capacity_is_ioerr() {
    let m = mem();
    write_header(&m, req_type::IN, 2047);
    let (res, _) = parse(
        &m,
        &[d(HDR, 16, false), d(DATA, 1024, true), d(STATUS, 1, true)],
        &limits(),
    );
    assert!(matches!(res, Err(RequestError::OutOfRange { .. })));
    assert_eq!(res.unwrap_err().status(), status::IOERR);
}

#[test]
fn sector_overflow_is_ioerr_not_panic() {
    let m = mem();
    write_header(&m, req_type::IN, u64::MAX);
    let (res, _) = parse(
        &m,
        &[d(HDR, 16, false), d(DATA, 1024, true), d(STATUS, 1, true)],
        &limits(),
    );
    assert!(matches!(res, Err(RequestError::OutOfRange { .. })));
}

#[test]
fn misaligned_to_4k_logical_block_is_ioerr() {
    let m = mem();
    let l = DeviceLimits {
        logical_block_size: 4096,
        ..limits()
    };
    write_header(&m, req_type::IN, 1);
    let (res, _) = parse(
        &m,
        &[d(HDR, 16, false), d(DATA, 4096, true), d(STATUS, 1, true)],
        &l,
    );
    assert!(matches!(res, Err(RequestError::Misaligned { .. })));
    write_header(&m, req_type::IN, 8);
    let (res, _) = parse(
        &m,
        &[d(HDR, 16, false), d(DATA, 512, true), d(STATUS, 1, true)],
        &l,
    );
    assert!(matches!(res, Err(RequestError::Misaligned { .. })));
}

#[test]
fn write_to_read_only_device_is_ioerr() {
    let m = mem();
    write_header(&m, req_type::OUT, 0);
    let l = DeviceLimits {
        read_only: true,
        ..limits()
    };
    let (res, _) = parse(
        &m,
        &[d(HDR, 16, false), d(DATA, 512, false), d(STATUS, 1, true)],
        &l,
    );
    assert_eq!(res, Err(RequestError::ReadOnly));
    assert_eq!(res.unwrap_err().status(), status::IOERR);
}

fn write_range(m: &GuestMemoryMmap<()>, i: u64, sector: u64, n: u32, flags: u32) {
    let a = DATA + i * 16;
    m.write_obj(sector.to_le(), GuestAddress(a)).unwrap();
    m.write_obj(n.to_le(), GuestAddress(a + 8)).unwrap();
    m.write_obj(flags.to_le(), GuestAddress(a + 12)).unwrap();
}

#[test]
fn discard_ranges_are_decoded() {
    let m = mem();
    write_header(&m, req_type::DISCARD, 0);
    write_range(&m, 0, 8, 16, 0);
    write_range(&m, 1, 100, 4, 0);
    let (res, r) = parse(
        &m,
        &[d(HDR, 16, false), d(DATA, 32, false), d(STATUS, 1, true)],
        &limits(),
    );
    res.unwrap();
    assert_eq!(
        r.ranges,
        vec![
            Range {
                offset_bytes: 8 * 512,
                len_bytes: 16 * 512,
                unmap: false
            },
            Range {
                offset_bytes: 100 * 512,
                len_bytes: 4 * 512,
                unmap: false
            },
        ]
    );
}

#[test]
fn discard_with_unmap_flag_is_unsupp() {
    let m = mem();
    write_header(&m, req_type::DISCARD, 0);
    write_range(&m, 0, 8, 16, RANGE_FLAG_UNMAP);
    let (res, _) = parse(
        &m,
        &[d(HDR, 16, false), d(DATA, 16, false), d(STATUS, 1, true)],
        &limits(),
    );
    assert_eq!(res.unwrap_err().status(), status::UNSUPP);
}

#[test]
fn write_zeroes_unknown_flag_is_unsupp_and_unmap_is_kept() {
    let m = mem();
    write_header(&m, req_type::WRITE_ZEROES, 0);
    write_range(&m, 0, 8, 16, 2);
    let (res, _) = parse(
        &m,
        &[d(HDR, 16, false), d(DATA, 16, false), d(STATUS, 1, true)],
        &limits(),
    );
    assert_eq!(res.unwrap_err().status(), status::UNSUPP);
    write_range(&m, 0, 8, 16, RANGE_FLAG_UNMAP);
    let (res, r) = parse(
        &m,
        &[d(HDR, 16, false), d(DATA, 16, false), d(STATUS, 1, true)],
        &limits(),
    );
    res.unwrap();
    assert!(r.ranges[0].unmap);
}

#[test]
fn too_many_or_too_long_ranges_are_ioerr() {
    let m = mem();
    write_header(&m, req_type::DISCARD, 0);
    for i in 0..5 {
        write_range(&m, i, i * 8, 8, 0);
    }
    let (res, _) = parse(
        &m,
        &[d(HDR, 16, false), d(DATA, 80, false), d(STATUS, 1, true)],
        &limits(),
    );
    assert_eq!(res, Err(RequestError::TooManyRanges(5)));
    write_range(&m, 0, 0, 1025, 0);
    let (res, _) = parse(
        &m,
        &[d(HDR, 16, false), d(DATA, 16, false), d(STATUS, 1, true)],
        &limits(),
    );
    assert_eq!(res, Err(RequestError::RangeTooLong(1025)));
    let (res, _) = parse(
        &m,
        &[d(HDR, 16, false), d(DATA, 15, false), d(STATUS, 1, true)],
        &limits(),
    );
    assert_eq!(res, Err(RequestError::BadRangeList(15)));
}

#[test]
fn too_many_descriptors_is_ioerr() {
    let m = mem();
    write_header(&m, req_type::IN, 0);
    let mut v = vec![d(HDR, 16, false)];
    for i in 0..200 {
        v.push(d(DATA + i * 512, 512, true));
    }
    v.push(d(STATUS, 1, true));
    let (res, _) = parse(&m, &v, &limits());
    assert!(matches!(res, Err(RequestError::TooManyDescriptors(_))));
}

/// A valid chain and the ways to break it one at a time.
#[derive(Debug, Clone)]
enum Corruption {
    None,
    DropDescriptor(usize),
    Truncate(usize, u32),
    FlipDirection(usize),
    MoveOutOfMemory(usize),
    HeaderType(u32),
    HeaderSector(u64),
}

fn corruption() -> impl Strategy<Value = Corruption> {
    prop_oneof![
        Just(Corruption::None),
        (0usize..8).prop_map(Corruption::DropDescriptor),
        (0usize..8, 0u32..600).prop_map(|(i, l)| Corruption::Truncate(i, l)),
        (0usize..8).prop_map(Corruption::FlipDirection),
        (0usize..8).prop_map(Corruption::MoveOutOfMemory),
        any::<u32>().prop_map(Corruption::HeaderType),
        any::<u64>().prop_map(Corruption::HeaderSector),
    ]
}

proptest! {
    /// Whatever is corrupted, parsing never panics, accepted data stays inside guest memory
    /// and inside the device, and a refused request maps to IOERR or UNSUPP.
    #[test]
    fn corrupted_chains_are_refused_or_safe(
        is_write in any::<bool>(),
        nseg in 1usize..5,
        sector in 0u64..2048,
        c in corruption(),
    ) {
        let m = mem();
        write_header(&m, if is_write { req_type::OUT } else { req_type::IN }, sector);
        let mut v = vec![d(HDR, 16, false)];
        for i in 0..nseg {
            v.push(d(DATA + i as u64 * 0x1000, 512, !is_write));
        }
        v.push(d(STATUS, 1, true));
        match c {
            Corruption::None => {}
            Corruption::DropDescriptor(i) => { if i < v.len() { v.remove(i); } }
            Corruption::Truncate(i, l) => { if let Some(x) = v.get_mut(i) { x.len = l; } }
            Corruption::FlipDirection(i) => { if let Some(x) = v.get_mut(i) { x.write_only = !x.write_only; } }
            Corruption::MoveOutOfMemory(i) => { if let Some(x) = v.get_mut(i) { x.addr = MEM_SIZE as u64 - 1; } }
            Corruption::HeaderType(t) => m.write_obj(t, GuestAddress(HDR)).unwrap(),
            Corruption::HeaderSector(s) => m.write_obj(s, GuestAddress(HDR + 8)).unwrap(),
        }
        let (res, r) = parse(&m, &v, &limits());
        match res {
            Ok(()) => {
                let total: u64 = r.data.iter().map(|s| u64::from(s.len)).sum();
                prop_assert_eq!(total, r.data_len);
                for s in &r.data {
                    prop_assert!(s.addr.0 + u64::from(s.len) <= MEM_SIZE as u64);
                }
                if matches!(r.kind, RequestType::In | RequestType::Out) {
                    prop_assert!(r.sector + (r.data_len >> 9) <= 2048);
                    prop_assert_eq!(r.data_len % 512, 0);
                }
                prop_assert!(r.status_addr.0 < MEM_SIZE as u64);
            }
            Err(RequestError::NoStatus) => {}
            Err(e) => {
                prop_assert!(e.status() == status::IOERR || e.status() == status::UNSUPP);
                prop_assert!(r.status_addr.0 < MEM_SIZE as u64);
            }
        }
        // An uncorrupted chain inside the device parses (one that runs past its end is
        // refused, as checked above).
        if matches!(c, Corruption::None) && sector + nseg as u64 <= 2048 {
            prop_assert!(parse(&m, &v, &limits()).0.is_ok());
        }
    }
}
