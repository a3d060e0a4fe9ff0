//! Reading the disk off the data path, synchronously, on the calling thread (a backup's
//! copy-before-write and its NBD export): the read is planned like a guest's and done through
//! an engine of its own, so it works for every kind of disk (a local file in any format, an
//! NBD export, an RBD image). And what the disk knows of its own allocation (holes and
//! zeroes from the format's metadata: `base:allocation`).

use std::io;
use std::os::fd::AsRawFd;

use super::engine::Engine;
use super::{Disk, Image, ImageError, Kind, Piece, ReadPlan};
use crate::io::bounce::AlignedBuf;
use crate::io::{Op, SyncEngine};

/// What a range of the disk holds, as the format records it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Allocation {
    /// Data (or, where the disk cannot tell, possibly data).
    Data,
    /// Reads as zeroes; allocated (a qcow2 zero cluster) or not.
    Zero { hole: bool },
}

/// A synchronous reader of one image, with its own engine (one per thread that reads).
pub struct Reader {
    engine: Engine,
    plan: ReadPlan,
    cluster_buf: Vec<u8>,
    iov: Vec<libc::iovec>,
}

// SAFETY: the iovecs only point into the caller's buffer during `read`, and are cleared
// before it returns; the engine is owned.
unsafe impl Send for Reader {}

impl std::fmt::Debug for Reader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reader")
            .field("engine", &self.engine.name())
            .finish()
    }
}

/// Reads are done in pieces of at most this many bytes.
const MAX_READ: usize = 4 << 20;

impl Image {
    /// A reader of this image: blocking system calls on its files for a local image, a
    /// connection (NBD) or an engine (RBD) of its own for a remote one.
    pub fn reader(&self) -> io::Result<Reader> {
        let mut engine = match &self.disk {
            Disk::Local(_) => Engine::Sync(SyncEngine::new()),
            Disk::Remote(r) => r
                .queue_engines(1)?
                .pop()
                .ok_or_else(|| io::Error::from_raw_os_error(libc::ENODEV))?,
        };
        self.bind(&mut engine);
        Ok(Reader {
            engine,
            plan: ReadPlan::default(),
            cluster_buf: Vec::new(),
            iov: Vec::new(),
        })
    }

    /// The format's allocation unit (a qcow2 or parallels cluster; 0 for raw and remote
    /// disks): guest ranges inside one unit share its metadata.
    pub fn allocation_unit(&self) -> u64 {
        match &self.disk {
            Disk::Local(l) => match &l.kind {
                Kind::Raw | Kind::Luks(_) => 0,
                Kind::Qcow2(d) => d.q.cluster_size(),
                Kind::Parallels(p) => p.cluster_size,
            },
            Disk::Remote(_) => 0,
        }
    }

    /// What [offset, offset + len) holds, as runs (length, allocation) covering at least
    /// its first byte and at most `len` bytes (the caller asks again for the rest).
    pub fn allocation(&self, offset: u64, len: u64) -> Result<Vec<(u64, Allocation)>, ImageError> {
        self.check_active()?;
        let size = self.size_bytes();
        if offset >= size || len == 0 {
            return Ok(Vec::new());
        }
        // Bounded, so that a huge query costs a bounded plan.
        let len = len.min(size - offset).min(1 << 30);
        let mut out: Vec<(u64, Allocation)> = Vec::new();
        let mut push = |n: u64, a: Allocation| match out.last_mut() {
            Some(last) if last.1 == a => last.0 += n,
            _ => out.push((n, a)),
        };
        let l = match &self.disk {
            Disk::Local(l) => l,
            Disk::Remote(r) => {
                let Some(answer) = r.allocated(offset, len) else {
                    return Ok(vec![(len, Allocation::Data)]);
                };
                let (extents, end) = answer?;
                let mut pos = offset;
                for (o, n) in extents {
                    let (o, e) = (o.max(pos), (o + n).min(end));
                    if e <= o {
                        continue;
                    }
                    if o > pos {
                        push(o - pos, Allocation::Zero { hole: true });
                    }
                    push(e - o, Allocation::Data);
                    pos = e;
                }
                if end > pos {
                    push(end - pos, Allocation::Zero { hole: true });
                }
                if out.is_empty() {
                    // Nothing known from here: data is a safe answer.
                    out.push((len, Allocation::Data));
                }
                return Ok(out);
            }
        };
        match &l.kind {
            // A hole in an encrypted file does not read as zeroes.
            Kind::Luks(_) => push(len, Allocation::Data),
            Kind::Raw => {
                for (n, data) in file_runs(&l.file, offset, len)? {
                    push(
                        n,
                        if data {
                            Allocation::Data
                        } else {
                            Allocation::Zero { hole: true }
                        },
                    );
                }
            }
            _ => {
                let mut plan = ReadPlan::default();
                // A piece list of a bounded range (the plan holds one piece per extent).
                let len = len.min(256 << 20);
                self.plan_read(offset, len, &mut plan)?;
                if plan.pieces.is_empty() {
                    // One run of the image file.
                    push(len, Allocation::Data);
                }
                for p in &plan.pieces {
                    match *p {
                        Piece::Zero { len } => push(len, Allocation::Zero { hole: true }),
                        Piece::Data { .. } | Piece::Compressed { .. } => {
                            push(p.len(), Allocation::Data)
                        }
                    }
                }
            }
        }
        Ok(out)
    }
}

/// The data and hole runs of a file's [offset, offset + len) (SEEK_DATA/SEEK_HOLE; a file
/// system that does not tell has data everywhere). Past the end of the file: a hole.
fn file_runs(file: &std::fs::File, offset: u64, len: u64) -> io::Result<Vec<(u64, bool)>> {
    let fd = file.as_raw_fd();
    let end = offset + len;
    let mut out = Vec::new();
    let mut pos = offset;
    while pos < end {
        // SAFETY: lseek on a descriptor we own.
        let data = unsafe { libc::lseek(fd, pos as i64, libc::SEEK_DATA) };
        let data = if data < 0 {
            match io::Error::last_os_error().raw_os_error() {
                // No data from here to the end of the file.
                Some(libc::ENXIO) => end,
                Some(libc::EINVAL) | Some(libc::EOPNOTSUPP) => {
                    out.push((end - pos, true));
                    return Ok(out);
                }
                _ => return Err(io::Error::last_os_error()),
            }
        } else {
            (data as u64).min(end)
        };
        if data > pos {
            out.push((data - pos, false));
            pos = data;
            if pos >= end {
                break;
            }
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(fd, pos as i64, libc::SEEK_HOLE) };
        let hole = if hole < 0 {
            end
        } else {
            (hole as u64).min(end)
        };
        let hole = hole.max(pos + 1);
        out.push((hole - pos, true));
        pos = hole;
    }
    Ok(out)
}

impl Reader {
    /// Read [offset, offset + buf.len()) of the disk (inside it) into `buf`, which is
    /// 4 KiB-aligned in memory (O_DIRECT files); `offset` and the length are multiples of
    /// 512.
    pub fn read(
        &mut self,
        image: &Image,
        offset: u64,
        buf: &mut AlignedBuf,
    ) -> Result<(), ImageError> {
        self.read_into(image, offset, buf.as_mut_slice())
    }

    /// [`Reader::read`] into any buffer that starts 4 KiB-aligned in memory.
    pub fn read_into(
        &mut self,
        image: &Image,
        offset: u64,
        dst: &mut [u8],
    ) -> Result<(), ImageError> {
        if !(dst.as_ptr() as usize).is_multiple_of(4096) {
            return Err(ImageError::Io(io::Error::from_raw_os_error(libc::EINVAL)));
        }
        let mut done = 0usize;
        let total = dst.len();
        while done < total {
            let n = (total - done).min(MAX_READ);
            let r = self.read_part(image, offset + done as u64, &mut dst[done..done + n]);
            self.iov.clear();
            r?;
            done += n;
        }
        Ok(())
    }

    fn read_part(&mut self, image: &Image, offset: u64, dst: &mut [u8]) -> Result<(), ImageError> {
        let len = dst.len() as u64;
        let mut plan = std::mem::take(&mut self.plan);
        let r = (|| match image.plan_read(offset, len, &mut plan)? {
            Some(host) => {
                self.read_file(image, 0, host, dst)?;
                if let Some(v) = image.cipher() {
                    v.decrypt(dst, host);
                }
                Ok(())
            }
            None => {
                if plan.pieces.iter().map(|p| p.len()).sum::<u64>() != len {
                    return Err(ImageError::Corrupt(
                        "a read plan that does not cover the read",
                    ));
                }
                let mut pos = 0usize;
                for p in &plan.pieces {
                    let n = p.len() as usize;
                    let part = &mut dst[pos..pos + n];
                    match *p {
                        Piece::Data {
                            layer, host_offset, ..
                        } => {
                            self.read_file(image, layer, host_offset, part)?;
                            if let (0, Some(v)) = (layer, image.cipher()) {
                                v.decrypt(part, host_offset);
                            }
                        }
                        _ => image.read_piece(p, part, &mut self.cluster_buf)?,
                    }
                    pos += n;
                }
                Ok(())
            }
        })();
        self.plan = plan;
        r
    }

    /// Read `dst.len()` bytes of layer `layer`'s file at `host` through the engine; a short
    /// read is the end of the file (zeroes after it).
    fn read_file(
        &mut self,
        image: &Image,
        layer: usize,
        host: u64,
        dst: &mut [u8],
    ) -> Result<(), ImageError> {
        let mut done = 0usize;
        while done < dst.len() {
            let rest = &mut dst[done..];
            self.iov.clear();
            self.iov.push(libc::iovec {
                iov_base: rest.as_mut_ptr().cast(),
                iov_len: rest.len(),
            });
            let op = Op::Readv {
                iov: self.iov.as_ptr(),
                iovcnt: 1,
                offset: host + done as u64,
            };
            let result = self.run(layer, &op)?;
            self.iov.clear();
            if result < 0 {
                return Err(ImageError::Io(io::Error::from_raw_os_error(-result)));
            }
            if result == 0 {
                if image.short_reads_are_zeroes() || matches!(image.disk, Disk::Local(_)) {
                    rest.fill(0);
                    return Ok(());
                }
                return Err(ImageError::Io(io::Error::from_raw_os_error(libc::EIO)));
            }
            done += result as usize;
        }
        Ok(())
    }

    /// Write `data` at `offset` of a remote disk (an NBD export, an RBD image) through this
    /// reader's own engine: a block job's copy into a remote target. Local images are
    /// written through their format ([`Image::job_write`]).
    pub fn write_remote(
        &mut self,
        image: &Image,
        offset: u64,
        data: &[u8],
    ) -> Result<(), ImageError> {
        Self::remote_only(image)?;
        let mut done = 0usize;
        while done < data.len() {
            let rest = &data[done..];
            self.iov.clear();
            self.iov.push(libc::iovec {
                iov_base: rest.as_ptr() as *mut libc::c_void,
                iov_len: rest.len().min(MAX_READ),
            });
            let op = Op::Writev {
                iov: self.iov.as_ptr(),
                iovcnt: 1,
                offset: offset + done as u64,
                dsync: false,
            };
            let result = self.run(0, &op);
            self.iov.clear();
            match result? {
                r if r < 0 => return Err(ImageError::Io(io::Error::from_raw_os_error(-r))),
                0 => return Err(ImageError::Io(io::Error::from_raw_os_error(libc::EIO))),
                r => done += r as usize,
            }
        }
        Ok(())
    }

    /// Zero [offset, offset + len) of a remote disk (the server or the cluster may
    /// deallocate it: it reads as zeroes either way).
    pub fn zero_remote(&mut self, image: &Image, offset: u64, len: u64) -> Result<(), ImageError> {
        Self::remote_only(image)?;
        let op = Op::Fallocate {
            mode: crate::io::sys::PUNCH_HOLE,
            offset,
            len,
        };
        match self.run(0, &op)? {
            r if r < 0 => Err(ImageError::Io(io::Error::from_raw_os_error(-r))),
            _ => Ok(()),
        }
    }

    /// Make what this reader wrote to a remote disk durable (NBD's FLUSH on its own
    /// connection, librbd's flush).
    pub fn flush_remote(&mut self, image: &Image) -> Result<(), ImageError> {
        Self::remote_only(image)?;
        match self.run(0, &Op::Fdatasync)? {
            r if r < 0 => Err(ImageError::Io(io::Error::from_raw_os_error(-r))),
            _ => Ok(()),
        }
    }

    fn remote_only(image: &Image) -> Result<(), ImageError> {
        image.check_active()?;
        match image.disk {
            Disk::Remote(_) => Ok(()),
            Disk::Local(_) => Err(ImageError::Unsupported(
                "a local image is written through its format".into(),
            )),
        }
    }

    /// Run one operation to completion: its result.
    fn run(&mut self, layer: usize, op: &Op) -> Result<i32, ImageError> {
        const TAG: u64 = 0x4241_434b_5550; // only ever one operation in flight
                                           // SAFETY: the buffers `op` points to live until this returns, after the completion
                                           // was reaped; nothing else touches them meanwhile.
        unsafe { self.engine.push(layer, op, TAG)? };
        self.engine.submit()?;
        let mut done = Vec::new();
        loop {
            self.engine.reap(&mut done);
            if let Some(c) = done.iter().find(|c| c.user_data == TAG) {
                return Ok(c.result);
            }
            self.engine.wait_one()?;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sparse_raw_file_reports_its_holes_and_reads_back() {
        let dir = crate::testing::TempDir::new("t").unwrap();
        let path = dir.path().join("d.raw");
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .unwrap();
        f.set_len(4 << 20).unwrap();
        std::os::unix::fs::FileExt::write_all_at(&f, &[7u8; 65536], 1 << 20).unwrap();
        let image = Image::raw(f, 4 << 20, true);
        let runs = image.allocation(0, 4 << 20).unwrap();
        assert_eq!(runs.iter().map(|r| r.0).sum::<u64>(), 4 << 20);
        let data: u64 = runs
            .iter()
            .filter(|r| r.1 == Allocation::Data)
            .map(|r| r.0)
            .sum();
        assert!((65536..4 << 20).contains(&data), "{runs:?}");
        let mut r = image.reader().unwrap();
        let mut buf = AlignedBuf::new(131072, 4096).unwrap();
        r.read(&image, (1 << 20) - 65536, &mut buf).unwrap();
        assert!(buf.as_slice()[..65536].iter().all(|&b| b == 0));
        assert!(buf.as_slice()[65536..].iter().all(|&b| b == 7));
    }
}
