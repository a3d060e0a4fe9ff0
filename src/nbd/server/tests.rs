//! The server against vublk's own client and against hostile bytes (the stock clients,
//! nbdinfo, nbdcopy and qemu-img, are in tests/backup.rs).

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::Duration;

use super::*;
use crate::nbd::uri::{NbdAddr, NbdTarget};
use crate::nbd::wire::*;

/// 1 MiB: byte i is i % 251; the second half is zeroes.
struct Mem(Vec<u8>);

impl Export for Mem {
    fn name(&self) -> &str {
        "mem"
    }
    fn size(&self) -> u64 {
        self.0.len() as u64
    }
    fn read(&self, offset: u64, dst: &mut [u8]) -> Result<(), ExportError> {
        let o = offset as usize;
        dst.copy_from_slice(&self.0[o..o + dst.len()]);
        Ok(())
    }
    fn meta_contexts(&self) -> Vec<String> {
        vec!["base:allocation".into()]
    }
    fn block_status(&self, _: &str, offset: u64, len: u32) -> Result<Vec<(u32, u32)>, ExportError> {
        let half = self.size() / 2;
        Ok(if offset < half {
            vec![((half - offset).min(u64::from(len)) as u32, 0)]
        } else {
            vec![(len, STATE_HOLE | STATE_ZERO)]
        })
    }
}

fn server() -> (crate::testing::TempDir, Server, std::path::PathBuf) {
    let dir = crate::testing::TempDir::new("t").unwrap();
    let path = dir.path().join("nbd.sock");
    let mut data: Vec<u8> = (0..1u32 << 20).map(|i| (i % 251) as u8).collect();
    data[1 << 19..].fill(0);
    let s = Server::start(Listen::Unix(path.clone()), Arc::new(Mem(data))).unwrap();
    (dir, s, path)
}

fn request(s: &mut impl Write, kind: u16, handle: u64, offset: u64, len: u32) {
    let r = Request {
        flags: 0,
        kind,
        handle,
        offset,
        len,
    };
    s.write_all(&r.encode()).unwrap();
}

#[test]
fn vublks_own_client_reads_the_export_and_gets_errors_for_bad_requests() {
    let (_d, server, path) = server();
    let target = NbdTarget {
        addr: NbdAddr::Unix(path),
        export: "mem".into(),
    };
    let (mut s, export) = crate::nbd::connect(&target, Duration::from_secs(5)).unwrap();
    assert_eq!(export.size, 1 << 20);
    assert!(export.has(FLAG_READ_ONLY));
    // Structured replies were negotiated by the client: one data chunk, DONE.
    request(&mut s, CMD_READ, 7, 1000, 4096);
    let mut h = [0u8; CHUNK_HEADER_LEN];
    s.read_exact(&mut h).unwrap();
    let (hdr, _) = decode_reply(&h).unwrap().unwrap();
    assert_eq!(
        hdr,
        ReplyHeader::Chunk {
            handle: 7,
            flags: REPLY_FLAG_DONE,
            kind: REPLY_TYPE_OFFSET_DATA,
            len: 8 + 4096
        }
    );
    let mut body = vec![0u8; 8 + 4096];
    s.read_exact(&mut body).unwrap();
    assert_eq!(u64::from_be_bytes(body[..8].try_into().unwrap()), 1000);
    assert!(body[8..]
        .iter()
        .enumerate()
        .all(|(i, &b)| b == ((1000 + i) % 251) as u8));
    // Past the end, and a write: error chunks; the connection stays usable.
    for (kind, offset, len, code) in [
        (CMD_READ, (1 << 20) - 512, 1024, EINVAL),
        (CMD_READ, u64::MAX - 10, 512, EINVAL),
        (CMD_TRIM, 0, 512, EPERM),
        (CMD_BLOCK_STATUS, 0, 512, EINVAL),
        (99, 0, 0, EINVAL),
    ] {
        request(&mut s, kind, 9, offset, len);
        s.read_exact(&mut h).unwrap();
        let (hdr, _) = decode_reply(&h).unwrap().unwrap();
        let ReplyHeader::Chunk {
            kind: k, len: l, ..
        } = hdr
        else {
            panic!("{hdr:?}")
        };
        assert_eq!(k, REPLY_TYPE_ERROR);
        let mut body = vec![0u8; l as usize];
        s.read_exact(&mut body).unwrap();
        assert_eq!(u32::from_be_bytes(body[..4].try_into().unwrap()), code);
    }
    // A zero half reads as a hole.
    request(&mut s, CMD_READ, 10, 1 << 19, 65536);
    s.read_exact(&mut h).unwrap();
    let (hdr, _) = decode_reply(&h).unwrap().unwrap();
    assert!(matches!(
        hdr,
        ReplyHeader::Chunk {
            kind: REPLY_TYPE_OFFSET_HOLE,
            len: 12,
            ..
        }
    ));
    let mut body = [0u8; 12];
    s.read_exact(&mut body).unwrap();
    assert_eq!(server.clients().len(), 1);
    crate::nbd::disconnect(s);
}

/// Connect and read the greeting.
fn hello(path: &std::path::Path) -> UnixStream {
    let mut c = UnixStream::connect(path).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut g = [0u8; 18];
    c.read_exact(&mut g).unwrap();
    c
}

/// The server closes `c` (EOF or reset) within the read timeout.
fn closed(c: &mut UnixStream) -> bool {
    let mut b = [0u8; 4096];
    loop {
        match c.read(&mut b) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return true,
            Err(_) => return false,
        }
    }
}

#[test]
fn hostile_handshakes_are_closed_and_leave_the_export_serving() {
    let (_d, server, path) = server();
    // Garbage instead of client flags and options.
    let mut c = hello(&path);
    c.write_all(&[0xff; 64]).unwrap();
    assert!(closed(&mut c));
    // A huge option length.
    let mut c = hello(&path);
    c.write_all(&FLAG_C_FIXED_NEWSTYLE.to_be_bytes()).unwrap();
    let mut o = IHAVEOPT.to_be_bytes().to_vec();
    o.extend_from_slice(&OPT_GO.to_be_bytes());
    o.extend_from_slice(&u32::MAX.to_be_bytes());
    c.write_all(&o).unwrap();
    assert!(closed(&mut c));
    // An unknown option gets ERR_UNSUP, a malformed GO ERR_INVALID; then a bad magic closes.
    let mut c = hello(&path);
    c.write_all(&FLAG_C_FIXED_NEWSTYLE.to_be_bytes()).unwrap();
    for (opt, data) in [(77u32, vec![1u8, 2, 3]), (OPT_GO, vec![0, 0, 0, 9])] {
        let mut o = IHAVEOPT.to_be_bytes().to_vec();
        o.extend_from_slice(&opt.to_be_bytes());
        o.extend_from_slice(&(data.len() as u32).to_be_bytes());
        o.extend_from_slice(&data);
        c.write_all(&o).unwrap();
        let mut r = [0u8; 20];
        c.read_exact(&mut r).unwrap();
        let kind = u32::from_be_bytes(r[12..16].try_into().unwrap());
        let len = u32::from_be_bytes(r[16..20].try_into().unwrap());
        assert_eq!(
            kind,
            if opt == 77 {
                REP_ERR_UNSUP
            } else {
                REP_ERR_INVALID
            }
        );
        let mut m = vec![0u8; len as usize];
        c.read_exact(&mut m).unwrap();
    }
    c.write_all(&[0u8; 16]).unwrap();
    assert!(closed(&mut c));
    // More clients than places: the extra ones are closed, the first ones keep theirs.
    let idle: Vec<UnixStream> = (0..MAX_CLIENTS).map(|_| hello(&path)).collect();
    let mut extra = UnixStream::connect(&path).unwrap();
    extra
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    assert!(closed(&mut extra));
    assert!(server.refused() >= 1);
    drop(idle);
    // And a well-behaved client is served afterwards.
    let target = NbdTarget {
        addr: NbdAddr::Unix(path.clone()),
        export: String::new(),
    };
    let mut tries = 0;
    let (s, e) = loop {
        match crate::nbd::connect(&target, Duration::from_secs(5)) {
            Ok(x) => break x,
            // The idle clients' threads are still leaving.
            Err(_) if tries < 50 => {
                tries += 1;
                std::thread::sleep(Duration::from_millis(100));
            }
            Err(e) => panic!("{e}"),
        }
    };
    assert_eq!(e.size, 1 << 20);
    crate::nbd::disconnect(s);
}

/// A valid session's bytes: greeting answer, options, requests.
fn valid_session() -> Vec<u8> {
    let mut v = FLAG_C_FIXED_NEWSTYLE.to_be_bytes().to_vec();
    let opt = |v: &mut Vec<u8>, o: u32, d: &[u8]| {
        v.extend_from_slice(&IHAVEOPT.to_be_bytes());
        v.extend_from_slice(&o.to_be_bytes());
        v.extend_from_slice(&(d.len() as u32).to_be_bytes());
        v.extend_from_slice(d);
    };
    opt(&mut v, OPT_STRUCTURED_REPLY, &[]);
    opt(&mut v, OPT_LIST, &[]);
    let mut meta = 3u32.to_be_bytes().to_vec();
    meta.extend_from_slice(b"mem");
    meta.extend_from_slice(&2u32.to_be_bytes());
    for q in ["base:allocation", "qemu:dirty-bitmap:b"] {
        meta.extend_from_slice(&(q.len() as u32).to_be_bytes());
        meta.extend_from_slice(q.as_bytes());
    }
    opt(&mut v, OPT_LIST_META_CONTEXT, &meta);
    opt(&mut v, OPT_SET_META_CONTEXT, &meta);
    let mut go = 3u32.to_be_bytes().to_vec();
    go.extend_from_slice(b"mem");
    go.extend_from_slice(&1u16.to_be_bytes());
    go.extend_from_slice(&INFO_NAME.to_be_bytes());
    opt(&mut v, OPT_GO, &go);
    for (kind, flags, offset, len) in [
        (CMD_READ, 0u16, 0u64, 65536u32),
        (CMD_BLOCK_STATUS, 0, 0, 1 << 20),
        (CMD_BLOCK_STATUS, CMD_FLAG_REQ_ONE, 4096, 8192),
        (CMD_READ, 0, (1 << 20) - 4096, 8192),
        (CMD_WRITE, 0, 0, 16),
    ] {
        let r = Request {
            flags,
            kind,
            handle: 1,
            offset,
            len,
        };
        v.extend_from_slice(&r.encode());
        if kind == CMD_WRITE {
            v.extend_from_slice(&[0u8; 16]);
        }
    }
    v.extend_from_slice(&Request::disc().encode());
    v
}

#[test]
fn mutated_and_random_sessions_neither_panic_nor_hang() {
    let base = valid_session();
    super::fuzz::session(&base);
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let t0 = std::time::Instant::now();
    for i in 0..3000 {
        let mut v = if i % 4 == 0 {
            (0..next() % 256).map(|_| next() as u8).collect()
        } else {
            base.clone()
        };
        for _ in 0..1 + next() % 4 {
            if v.is_empty() {
                break;
            }
            let at = (next() as usize) % v.len();
            match next() % 3 {
                0 => v[at] = next() as u8,
                1 => v.truncate(at),
                _ => v[at] ^= 1 << (next() % 8),
            }
        }
        super::fuzz::session(&v);
    }
    // Each session ends at the input's end, not at a timeout.
    assert!(t0.elapsed() < Duration::from_secs(60), "{:?}", t0.elapsed());
}

#[test]
fn simple_replies_stream_a_read_of_several_pieces_and_report_errors_once() {
    // 2.5 pieces of CHUNK bytes, byte i = i % 251.
    let dir = crate::testing::TempDir::new("t").unwrap();
    let path = dir.path().join("nbd.sock");
    let size = 2 * CHUNK + CHUNK / 2;
    let data: Vec<u8> = (0..size).map(|i| (i % 251) as u8).collect();
    let _server = Server::start(Listen::Unix(path.clone()), Arc::new(Mem(data))).unwrap();
    // The oldest handshake a fixed-newstyle client may do: EXPORT_NAME, no structured replies.
    let mut c = hello(&path);
    c.write_all(&(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES).to_be_bytes())
        .unwrap();
    c.write_all(&IHAVEOPT.to_be_bytes()).unwrap();
    c.write_all(&OPT_EXPORT_NAME.to_be_bytes()).unwrap();
    c.write_all(&3u32.to_be_bytes()).unwrap();
    c.write_all(b"mem").unwrap();
    let mut info = [0u8; 10];
    c.read_exact(&mut info).unwrap();
    assert_eq!(
        u64::from_be_bytes(info[..8].try_into().unwrap()),
        size as u64
    );
    // One simple reply header, then every byte of the three pieces in order.
    let (offset, len) = (100u64, (size - 200) as u32);
    request(&mut c, CMD_READ, 5, offset, len);
    let mut h = [0u8; SIMPLE_REPLY_LEN];
    c.read_exact(&mut h).unwrap();
    let (hdr, _) = decode_reply(&h).unwrap().unwrap();
    assert_eq!(
        hdr,
        ReplyHeader::Simple {
            handle: 5,
            error: 0
        }
    );
    let mut body = vec![0u8; len as usize];
    c.read_exact(&mut body).unwrap();
    assert!(body
        .iter()
        .enumerate()
        .all(|(i, &b)| b == ((offset as usize + i) % 251) as u8));
    // A read past the end: one simple reply with the error and no data; the stream goes on.
    request(&mut c, CMD_READ, 6, size as u64 - 512, 1024);
    c.read_exact(&mut h).unwrap();
    let (hdr, _) = decode_reply(&h).unwrap().unwrap();
    assert_eq!(
        hdr,
        ReplyHeader::Simple {
            handle: 6,
            error: EINVAL
        }
    );
    request(&mut c, CMD_READ, 7, 0, 512);
    c.read_exact(&mut h).unwrap();
    let mut first = [0u8; 512];
    c.read_exact(&mut first).unwrap();
    assert_eq!(first[250..252], [250, 0]);
}
