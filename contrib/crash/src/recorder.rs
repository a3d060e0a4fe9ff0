//! The recorder: a pass-through FUSE file system over one flat directory that records every
//! change and durability point before it answers.
//!
//! It runs on one thread, so the order of the records is the order the operations happened
//! in, and a record is in the log before the caller (vublk) sees its operation complete.
//! Every open file is in direct-I/O mode (FOPEN_DIRECT_IO): nothing is cached in the kernel,
//! each write reaches the recorder as the caller issued it (split at most at the kernel's
//! maximum FUSE write size), and O_DIRECT opens work as on a disk file system.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use fuser::{
    BackgroundSession, Config, Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags,
    Generation, INodeNo, LockOwner, MountOption, OpenFlags, RenameFlags, ReplyAttr, ReplyCreate,
    ReplyData, ReplyDirectory, ReplyEmpty, ReplyEntry, ReplyLseek, ReplyOpen, ReplyStatfs,
    ReplyWrite, Request, TimeOrNow, WriteFlags,
};

use crate::image::{FileImage, Files};
use crate::record::{Op, Record, Recording};

/// Attributes are never cached: sizes change under the kernel's feet otherwise.
const TTL: Duration = Duration::ZERO;

struct Log {
    start: Instant,
    records: Vec<Record>,
}

impl Log {
    fn push(&mut self, op: Op) {
        let at_ns = self.start.elapsed().as_nanos() as u64;
        self.records.push(Record { at_ns, op });
    }
}

/// A mounted recorder. Dropping it unmounts (lazily, if something still has files open).
pub struct Recorder {
    session: Option<BackgroundSession>,
    mountpoint: PathBuf,
    log: Arc<Mutex<Log>>,
    initial: Files,
}

impl Recorder {
    /// Mounts a recorder of `backing` (a directory of regular files, no subdirectories) on
    /// `mountpoint`. The files as they are now are the recording's starting point.
    pub fn mount(backing: &Path, mountpoint: &Path) -> io::Result<Recorder> {
        let mut dir = Dir {
            backing: backing.to_path_buf(),
            names: HashMap::new(),
            paths: HashMap::new(),
            next_ino: 2,
            handles: HashMap::new(),
            next_fh: 1,
        };
        let mut initial = Files::default();
        let mut entries: Vec<_> = fs::read_dir(backing)?.collect::<Result<_, _>>()?;
        entries.sort_by_key(|e| e.file_name());
        for e in entries {
            let name = e.file_name().into_string().map_err(|_| {
                io::Error::new(io::ErrorKind::InvalidInput, "file name is not UTF-8")
            })?;
            if !e.file_type()?.is_file() {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("{name}: the recorder takes regular files only"),
                ));
            }
            let id = dir.add(&name);
            initial.names.insert(name, id);
            initial.files.insert(id, FileImage::load(&e.path())?);
        }
        let log = Arc::new(Mutex::new(Log {
            start: Instant::now(),
            records: Vec::new(),
        }));
        let fs = RecFs {
            dir: Mutex::new(dir),
            log: log.clone(),
        };
        let mut config = Config::default();
        config.mount_options = vec![
            MountOption::FSName("vublk-crash".into()),
            MountOption::RW,
            MountOption::NoAtime,
        ];
        let session = fuser::spawn_mount(fs, mountpoint, &config)?;
        Ok(Recorder {
            session: Some(session),
            mountpoint: mountpoint.to_path_buf(),
            log,
            initial,
        })
    }

    /// Adds the test's own record, in order with the file operations.
    pub fn mark(&self, text: impl Into<String>) {
        self.log.lock().unwrap().push(Op::Mark(text.into()));
    }

    /// How many records so far.
    pub fn len(&self) -> usize {
        self.log.lock().unwrap().records.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Unmounts (everything using the mount must be stopped first) and returns what was
    /// recorded.
    pub fn finish(mut self) -> io::Result<Recording> {
        if let Some(s) = self.session.take() {
            // A process that just exited may hold its files a few milliseconds longer (an
            // io_uring's last references go asynchronously): retry while the mount is busy.
            let c = std::ffi::CString::new(self.mountpoint.as_os_str().as_encoded_bytes())
                .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
            let deadline = Instant::now() + Duration::from_secs(5);
            loop {
                // SAFETY: a valid C string; umount2 takes no other pointers.
                if unsafe { libc::umount2(c.as_ptr(), 0) } == 0 {
                    break;
                }
                let e = io::Error::last_os_error();
                if e.raw_os_error() != Some(libc::EBUSY) || Instant::now() > deadline {
                    // SAFETY: as above.
                    unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
                    return Err(e);
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            // The session ends once the kernel drops the connection; its own unmount then
            // finds nothing mounted.
            s.join()?;
        }
        let records = std::mem::take(&mut self.log.lock().unwrap().records);
        Ok(Recording {
            initial: std::mem::take(&mut self.initial),
            records,
        })
    }
}

impl Drop for Recorder {
    fn drop(&mut self) {
        if self.session.take().is_some() {
            // The session's own unmount failed or was skipped (busy): detach it.
            if let Ok(c) = std::ffi::CString::new(self.mountpoint.as_os_str().as_encoded_bytes()) {
                // SAFETY: a valid C string; umount2 takes no other pointers.
                unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
            }
        }
    }
}

struct Handle {
    ino: u64,
    file: File,
}

struct Dir {
    backing: PathBuf,
    names: HashMap<String, u64>,
    paths: HashMap<u64, String>,
    next_ino: u64,
    handles: HashMap<u64, Handle>,
    next_fh: u64,
}

impl Dir {
    fn add(&mut self, name: &str) -> u64 {
        let ino = self.next_ino;
        self.next_ino += 1;
        self.names.insert(name.to_string(), ino);
        self.paths.insert(ino, name.to_string());
        ino
    }

    fn path(&self, ino: u64) -> Result<PathBuf, Errno> {
        self.paths
            .get(&ino)
            .map(|n| self.backing.join(n))
            .ok_or(Errno::ENOENT)
    }

    fn attr(&self, ino: u64) -> Result<FileAttr, Errno> {
        let path = if ino == INodeNo::ROOT.0 {
            self.backing.clone()
        } else if let Some(h) = self.handles.values().find(|h| h.ino == ino) {
            return Ok(to_attr(ino, &h.file.metadata().map_err(Errno::from)?));
        } else {
            self.path(ino)?
        };
        Ok(to_attr(ino, &fs::metadata(path).map_err(Errno::from)?))
    }

    fn handle(&self, fh: FileHandle) -> Result<&Handle, Errno> {
        self.handles.get(&fh.0).ok_or(Errno::EBADF)
    }

    fn open(&mut self, ino: u64, file: File) -> FileHandle {
        let fh = self.next_fh;
        self.next_fh += 1;
        self.handles.insert(fh, Handle { ino, file });
        FileHandle(fh)
    }
}

fn to_attr(ino: u64, m: &fs::Metadata) -> FileAttr {
    let time = |s: i64, ns: i64| {
        UNIX_EPOCH + Duration::new(s.max(0) as u64, ns.clamp(0, 999_999_999) as u32)
    };
    FileAttr {
        ino: INodeNo(ino),
        size: m.len(),
        blocks: m.blocks(),
        atime: time(m.atime(), m.atime_nsec()),
        mtime: time(m.mtime(), m.mtime_nsec()),
        ctime: time(m.ctime(), m.ctime_nsec()),
        crtime: SystemTime::UNIX_EPOCH,
        kind: if m.is_dir() {
            FileType::Directory
        } else {
            FileType::RegularFile
        },
        perm: (m.mode() & 0o7777) as u16,
        nlink: m.nlink() as u32,
        uid: m.uid(),
        gid: m.gid(),
        rdev: 0,
        blksize: 4096,
        flags: 0,
    }
}

fn name_of(name: &OsStr) -> Result<&str, Errno> {
    name.to_str()
        .filter(|n| !n.contains('/'))
        .ok_or(Errno::EINVAL)
}

fn check_root(parent: INodeNo) -> Result<(), Errno> {
    if parent == INodeNo::ROOT {
        Ok(())
    } else {
        Err(Errno::ENOENT)
    }
}

/// O_ACCMODE and the flags that matter to a pass-through open; O_DIRECT is dropped (the
/// recorder's own I/O may be unaligned) and O_DSYNC/O_SYNC are recorded instead of done.
fn backing_options(flags: i32) -> OpenOptions {
    let mut o = OpenOptions::new();
    match flags & libc::O_ACCMODE {
        libc::O_RDONLY => o.read(true),
        libc::O_WRONLY => o.write(true),
        _ => o.read(true).write(true),
    };
    o
}

struct RecFs {
    dir: Mutex<Dir>,
    log: Arc<Mutex<Log>>,
}

impl RecFs {
    fn record(&self, op: Op) {
        self.log.lock().unwrap().push(op);
    }
}

impl Filesystem for RecFs {
    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let r = (|| {
            check_root(parent)?;
            let dir = self.dir.lock().unwrap();
            let ino = *dir.names.get(name_of(name)?).ok_or(Errno::ENOENT)?;
            dir.attr(ino)
        })();
        match r {
            Ok(a) => reply.entry(&TTL, &a, Generation(0)),
            Err(e) => reply.error(e),
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, fh: Option<FileHandle>, reply: ReplyAttr) {
        let dir = self.dir.lock().unwrap();
        let r = match fh.map(|fh| dir.handle(fh)) {
            Some(Ok(h)) => h
                .file
                .metadata()
                .map(|m| to_attr(ino.0, &m))
                .map_err(Errno::from),
            _ => dir.attr(ino.0),
        };
        match r {
            Ok(a) => reply.attr(&TTL, &a),
            Err(e) => reply.error(e),
        }
    }

    fn setattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        _mode: Option<u32>,
        _uid: Option<u32>,
        _gid: Option<u32>,
        size: Option<u64>,
        _atime: Option<TimeOrNow>,
        _mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        let r = (|| {
            let dir = self.dir.lock().unwrap();
            if let Some(len) = size {
                match fh.map(|fh| dir.handle(fh)) {
                    Some(Ok(h)) => h.file.set_len(len),
                    _ => OpenOptions::new()
                        .write(true)
                        .open(dir.path(ino.0)?)
                        .and_then(|f| f.set_len(len)),
                }
                .map_err(Errno::from)?;
                self.record(Op::SetLen { file: ino.0, len });
            }
            dir.attr(ino.0)
        })();
        match r {
            Ok(a) => reply.attr(&TTL, &a),
            Err(e) => reply.error(e),
        }
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        let r = (|| {
            let mut dir = self.dir.lock().unwrap();
            let file = backing_options(flags.0)
                .open(dir.path(ino.0)?)
                .map_err(Errno::from)?;
            Ok(dir.open(ino.0, file))
        })();
        match r {
            Ok(fh) => reply.opened(fh, FopenFlags::FOPEN_DIRECT_IO),
            Err(e) => reply.error(e),
        }
    }

    fn create(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        _umask: u32,
        flags: i32,
        reply: ReplyCreate,
    ) {
        let r = (|| {
            check_root(parent)?;
            let name = name_of(name)?;
            let mut dir = self.dir.lock().unwrap();
            let mut o = backing_options(flags);
            o.create(true).mode(mode & 0o7777);
            if flags & libc::O_EXCL != 0 {
                o.create_new(true);
            }
            let file = o.open(dir.backing.join(name)).map_err(Errno::from)?;
            let ino = match dir.names.get(name) {
                Some(&ino) => ino,
                None => {
                    let ino = dir.add(name);
                    self.record(Op::Create {
                        file: ino,
                        name: name.to_string(),
                    });
                    ino
                }
            };
            let attr = to_attr(ino, &file.metadata().map_err(Errno::from)?);
            Ok((attr, dir.open(ino, file)))
        })();
        match r {
            Ok((a, fh)) => reply.created(&TTL, &a, Generation(0), fh, FopenFlags::FOPEN_DIRECT_IO),
            Err(e) => reply.error(e),
        }
    }

    fn read(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let dir = self.dir.lock().unwrap();
        let r = dir.handle(fh).and_then(|h| {
            let mut buf = vec![0u8; size as usize];
            let mut n = 0;
            while n < buf.len() {
                match h.file.read_at(&mut buf[n..], offset + n as u64) {
                    Ok(0) => break,
                    Ok(k) => n += k,
                    Err(e) => return Err(Errno::from(e)),
                }
            }
            buf.truncate(n);
            Ok(buf)
        });
        match r {
            Ok(b) => reply.data(&b),
            Err(e) => reply.error(e),
        }
    }

    fn write(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        let dir = self.dir.lock().unwrap();
        let r = dir.handle(fh).and_then(|h| {
            h.file.write_all_at(data, offset).map_err(Errno::from)?;
            self.record(Op::Write {
                file: ino.0,
                offset,
                data: data.to_vec(),
                dsync: flags.0 & (libc::O_DSYNC | libc::O_SYNC) != 0,
            });
            Ok(data.len() as u32)
        });
        match r {
            Ok(n) => reply.written(n),
            Err(e) => reply.error(e),
        }
    }

    fn flush(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        reply.ok();
    }

    fn release(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        self.dir.lock().unwrap().handles.remove(&fh.0);
        reply.ok();
    }

    fn fsync(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        datasync: bool,
        reply: ReplyEmpty,
    ) {
        // Recorded, not done: what is durable is the recording's business, and the backing
        // directory is scratch space.
        self.record(Op::Sync {
            file: ino.0,
            data_only: datasync,
        });
        reply.ok();
    }

    fn fsyncdir(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        self.record(Op::SyncDir);
        reply.ok();
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        if ino != INodeNo::ROOT {
            return reply.error(Errno::ENOTDIR);
        }
        let dir = self.dir.lock().unwrap();
        let mut entries: Vec<(u64, FileType, String)> = vec![
            (1, FileType::Directory, ".".into()),
            (1, FileType::Directory, "..".into()),
        ];
        let mut names: Vec<_> = dir.names.iter().collect();
        names.sort();
        entries.extend(
            names
                .into_iter()
                .map(|(n, &i)| (i, FileType::RegularFile, n.clone())),
        );
        for (i, (ino, kind, name)) in entries.into_iter().enumerate().skip(offset as usize) {
            if reply.add(INodeNo(ino), (i + 1) as u64, kind, name) {
                break;
            }
        }
        reply.ok();
    }

    fn unlink(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let r = (|| {
            check_root(parent)?;
            let name = name_of(name)?;
            let mut dir = self.dir.lock().unwrap();
            fs::remove_file(dir.backing.join(name)).map_err(Errno::from)?;
            if let Some(ino) = dir.names.remove(name) {
                dir.paths.remove(&ino);
            }
            self.record(Op::Unlink {
                name: name.to_string(),
            });
            Ok(())
        })();
        match r {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn rename(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: RenameFlags,
        reply: ReplyEmpty,
    ) {
        let r = (|| {
            check_root(parent)?;
            check_root(newparent)?;
            if flags.bits() != 0 {
                return Err(Errno::EINVAL);
            }
            let (from, to) = (name_of(name)?, name_of(newname)?);
            let mut dir = self.dir.lock().unwrap();
            fs::rename(dir.backing.join(from), dir.backing.join(to)).map_err(Errno::from)?;
            let ino = dir.names.remove(from).ok_or(Errno::ENOENT)?;
            if let Some(old) = dir.names.insert(to.to_string(), ino) {
                dir.paths.remove(&old);
            }
            dir.paths.insert(ino, to.to_string());
            self.record(Op::Rename {
                from: from.to_string(),
                to: to.to_string(),
            });
            Ok(())
        })();
        match r {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        let dir = self.dir.lock().unwrap();
        let Ok(c) = std::ffi::CString::new(dir.backing.as_os_str().as_encoded_bytes()) else {
            return reply.error(Errno::EINVAL);
        };
        // SAFETY: plain old data, filled in by statvfs below.
        let mut s: libc::statvfs = unsafe { std::mem::zeroed() };
        // SAFETY: a valid C string and a statvfs to fill.
        if unsafe { libc::statvfs(c.as_ptr(), &mut s) } != 0 {
            return reply.error(Errno::from(io::Error::last_os_error()));
        }
        reply.statfs(
            s.f_blocks,
            s.f_bfree,
            s.f_bavail,
            s.f_files,
            s.f_ffree,
            s.f_bsize as u32,
            s.f_namemax as u32,
            s.f_frsize as u32,
        );
    }

    fn fallocate(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        length: u64,
        mode: i32,
        reply: ReplyEmpty,
    ) {
        let dir = self.dir.lock().unwrap();
        let r = dir.handle(fh).and_then(|h| {
            // SAFETY: a valid descriptor; fallocate takes no pointers.
            let rc = unsafe {
                libc::fallocate(
                    h.file.as_raw_fd(),
                    mode,
                    offset as libc::off_t,
                    length as libc::off_t,
                )
            };
            if rc != 0 {
                return Err(Errno::from(io::Error::last_os_error()));
            }
            self.record(Op::Fallocate {
                file: ino.0,
                offset,
                len: length,
                mode,
            });
            Ok(())
        });
        match r {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn lseek(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: i64,
        whence: i32,
        reply: ReplyLseek,
    ) {
        let dir = self.dir.lock().unwrap();
        let r = dir.handle(fh).and_then(|h| {
            // SAFETY: a valid descriptor; lseek takes no pointers.
            let o = unsafe { libc::lseek(h.file.as_raw_fd(), offset, whence) };
            if o < 0 {
                Err(Errno::from(io::Error::last_os_error()))
            } else {
                Ok(o)
            }
        });
        match r {
            Ok(o) => reply.offset(o),
            Err(e) => reply.error(e),
        }
    }
}
