//! One conformance suite run against every engine: the same operations must give the same
//! results and the same file contents through io_uring and through the blocking engine.

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::PathBuf;

use super::bounce::AlignedBuf;
use super::{Completion, Op, SyncEngine, UringEngine};
use crate::image::Engine;

struct TempFile {
    path: PathBuf,
    file: File,
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

fn temp_file(tag: &str, size: u64, direct: bool) -> TempFile {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("target")
        .join("unit-tmp");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(format!("{tag}-{}", std::process::id()));
    let mut o = OpenOptions::new();
    o.read(true).write(true).create(true).truncate(true);
    if direct {
        o.custom_flags(libc::O_DIRECT);
    }
    let file = o.open(&path).unwrap();
    file.set_len(size).unwrap();
    TempFile { path, file }
}

fn engines() -> Vec<Engine> {
    let mut v = vec![Engine::Sync(SyncEngine::new())];
    match UringEngine::new(64) {
        Ok(u) => v.push(Engine::Uring(u)),
        Err(e) => crate::testing::note_skip(&format!("io_uring engine: {e}")),
    }
    v
}

/// Run one op to completion.
fn run(e: &mut Engine, fd: i32, op: Op) -> i32 {
    // SAFETY (below): every buffer referenced by op lives on the caller's stack until we
    // return, and we return only after the completion is reaped.
    e.bind_files(&[fd]);
    // SAFETY: as above.
    unsafe { e.push(0, &op, 7).unwrap() };
    e.submit().unwrap();
    let mut out: Vec<Completion> = Vec::new();
    loop {
        e.reap(&mut out);
        if let Some(c) = out.pop() {
            assert_eq!(c.user_data, 7);
            return c.result;
        }
        e.wait_one().unwrap();
    }
}

fn iov(b: &mut AlignedBuf, off: usize, len: usize) -> libc::iovec {
    libc::iovec {
        iov_base: b.as_mut_slice()[off..off + len].as_mut_ptr().cast(),
        iov_len: len,
    }
}

#[test]
fn write_then_read_back_through_two_iovecs() {
    for mut e in engines() {
        let t = temp_file(&format!("rw-{}", e.name()), 1 << 20, true);
        let fd = t.file.as_raw_fd();
        let mut w = AlignedBuf::new(8192, 4096).unwrap();
        for (i, b) in w.as_mut_slice().iter_mut().enumerate() {
            *b = (i % 251) as u8;
        }
        let v = [iov(&mut w, 0, 4096), iov(&mut w, 4096, 4096)];
        let op = Op::Writev {
            iov: v.as_ptr(),
            iovcnt: 2,
            offset: 65536,
            dsync: false,
        };
        assert_eq!(run(&mut e, fd, op), 8192, "{}", e.name());
        let mut r = AlignedBuf::new(8192, 4096).unwrap();
        let v = [iov(&mut r, 0, 8192)];
        let op = Op::Readv {
            iov: v.as_ptr(),
            iovcnt: 1,
            offset: 65536,
        };
        assert_eq!(run(&mut e, fd, op), 8192, "{}", e.name());
        assert_eq!(r.as_slice(), w.as_slice(), "{}", e.name());
        assert_eq!(run(&mut e, fd, Op::Fdatasync), 0, "{}", e.name());
    }
}

#[test]
fn dsync_write_succeeds() {
    for mut e in engines() {
        let t = temp_file(&format!("dsync-{}", e.name()), 1 << 20, false);
        let mut w = AlignedBuf::new(4096, 4096).unwrap();
        w.as_mut_slice().fill(0xab);
        let v = [iov(&mut w, 0, 4096)];
        let op = Op::Writev {
            iov: v.as_ptr(),
            iovcnt: 1,
            offset: 0,
            dsync: true,
        };
        assert_eq!(run(&mut e, t.file.as_raw_fd(), op), 4096);
        assert_eq!(std::fs::read(&t.path).unwrap()[..4096], [0xab; 4096]);
    }
}

#[test]
fn punch_hole_and_zero_range_zero_the_data() {
    for mut e in engines() {
        let t = temp_file(&format!("falloc-{}", e.name()), 0, false);
        std::fs::write(&t.path, vec![0x5au8; 1 << 20]).unwrap();
        let fd = t.file.as_raw_fd();
        let blocks_before = std::fs::metadata(&t.path).unwrap().blocks();
        let punch = Op::Fallocate {
            mode: libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            offset: 0,
            len: 512 << 10,
        };
        assert_eq!(run(&mut e, fd, punch), 0, "{}", e.name());
        let zero = Op::Fallocate {
            mode: libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE,
            offset: 512 << 10,
            len: 256 << 10,
        };
        assert_eq!(run(&mut e, fd, zero), 0, "{}", e.name());
        let data = std::fs::read(&t.path).unwrap();
        assert_eq!(data.len(), 1 << 20);
        assert!(data[..768 << 10].iter().all(|&b| b == 0));
        assert!(data[768 << 10..].iter().all(|&b| b == 0x5a));
        let blocks_after = std::fs::metadata(&t.path).unwrap().blocks();
        assert!(
            blocks_after < blocks_before,
            "{} punch freed nothing",
            e.name()
        );
    }
}

#[test]
fn errors_come_back_as_negative_errno() {
    for mut e in engines() {
        let t = temp_file(&format!("err-{}", e.name()), 1 << 20, true);
        // PUNCH_HOLE without KEEP_SIZE is an invalid combination: EOPNOTSUPP from both.
        let op = Op::Fallocate {
            mode: libc::FALLOC_FL_PUNCH_HOLE,
            offset: 0,
            len: 4096,
        };
        assert_eq!(
            run(&mut e, t.file.as_raw_fd(), op),
            -libc::EOPNOTSUPP,
            "{}",
            e.name()
        );
        // A write to a read-only descriptor: EBADF from both.
        let ro = File::open(&t.path).unwrap();
        let mut w = AlignedBuf::new(4096, 4096).unwrap();
        let v = [iov(&mut w, 0, 4096)];
        let op = Op::Writev {
            iov: v.as_ptr(),
            iovcnt: 1,
            offset: 0,
            dsync: false,
        };
        assert_eq!(
            run(&mut e, ro.as_raw_fd(), op),
            -libc::EBADF,
            "{}",
            e.name()
        );
    }
}
