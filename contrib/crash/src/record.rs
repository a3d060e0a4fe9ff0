//! What the recorder saw, in order, and its file format (for the recorded cases kept as
//! regression tests).

use std::fs;
use std::io::{self, Read, Write};
use std::path::Path;

use crate::image::{FileImage, Files};

/// A file's identity in a recording (its inode number in the recorder).
pub type FileId = u64;

/// One operation on the directory or a file in it, or a mark.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    /// A new file under `name` (a directory entry: durable with the next directory sync).
    Create {
        file: FileId,
        name: String,
    },
    Rename {
        from: String,
        to: String,
    },
    Unlink {
        name: String,
    },
    /// `dsync`: written with O_DSYNC/O_SYNC or RWF_DSYNC: durable when it completed.
    Write {
        file: FileId,
        offset: u64,
        data: Vec<u8>,
        dsync: bool,
    },
    /// truncate/ftruncate
    SetLen {
        file: FileId,
        len: u64,
    },
    /// fallocate in any mode (libc FALLOC_FL_* bits)
    Fallocate {
        file: FileId,
        offset: u64,
        len: u64,
        mode: i32,
    },
    /// fsync (`data_only`: fdatasync) of a file: every operation on it so far is durable.
    Sync {
        file: FileId,
        data_only: bool,
    },
    /// fsync of the directory: every create, rename and unlink so far is durable.
    SyncDir,
    /// The test's own note, in order with the operations: what the workload saw complete.
    Mark(String),
}

impl Op {
    /// The file whose data the operation changes.
    pub fn data_file(&self) -> Option<FileId> {
        match self {
            Op::Write { file, .. } | Op::SetLen { file, .. } | Op::Fallocate { file, .. } => {
                Some(*file)
            }
            _ => None,
        }
    }

    /// Whether it changes the directory.
    pub fn is_namespace(&self) -> bool {
        matches!(
            self,
            Op::Create { .. } | Op::Rename { .. } | Op::Unlink { .. }
        )
    }
}

/// One recorded operation and when it happened (nanoseconds since the mount).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    pub at_ns: u64,
    pub op: Op,
}

/// A recording: the directory as it was mounted, and everything done to it.
#[derive(Clone, Debug, Default)]
pub struct Recording {
    pub initial: Files,
    pub records: Vec<Record>,
}

const MAGIC: &[u8; 8] = b"VUBLKREC";

impl Recording {
    /// The directory as of every operation (what the recorder's backing directory holds at
    /// the end, if nothing was lost).
    pub fn replay_all(&self) -> Files {
        let mut f = self.initial.clone();
        for r in &self.records {
            f.apply(&r.op);
        }
        f
    }

    /// The marks, with their positions in `records`.
    pub fn marks(&self) -> impl Iterator<Item = (usize, &str)> {
        self.records
            .iter()
            .enumerate()
            .filter_map(|(i, r)| match &r.op {
                Op::Mark(m) => Some((i, m.as_str())),
                _ => None,
            })
    }

    pub fn save(&self, path: &Path) -> io::Result<()> {
        let mut out = Vec::new();
        out.extend_from_slice(MAGIC);
        put(&mut out, self.initial.names.len() as u64);
        for (name, id) in &self.initial.names {
            put_str(&mut out, name);
            put(&mut out, *id);
            let empty = FileImage::default();
            let img = self.initial.files.get(id).unwrap_or(&empty);
            put(&mut out, img.len());
            // Only the non-zero 4 KiB chunks: images are mostly holes.
            let chunks: Vec<u64> = (0..img.len().div_ceil(4096))
                .filter(|&c| img.read(c * 4096, 4096).iter().any(|&b| b != 0))
                .collect();
            put(&mut out, chunks.len() as u64);
            for c in chunks {
                put(&mut out, c * 4096);
                put_bytes(&mut out, &img.read(c * 4096, 4096));
            }
        }
        put(&mut out, self.records.len() as u64);
        for r in &self.records {
            put(&mut out, r.at_ns);
            match &r.op {
                Op::Create { file, name } => {
                    out.push(1);
                    put(&mut out, *file);
                    put_str(&mut out, name);
                }
                Op::Rename { from, to } => {
                    out.push(2);
                    put_str(&mut out, from);
                    put_str(&mut out, to);
                }
                Op::Unlink { name } => {
                    out.push(3);
                    put_str(&mut out, name);
                }
                Op::Write {
                    file,
                    offset,
                    data,
                    dsync,
                } => {
                    out.push(4);
                    put(&mut out, *file);
                    put(&mut out, *offset);
                    put(&mut out, u64::from(*dsync));
                    put_bytes(&mut out, data);
                }
                Op::SetLen { file, len } => {
                    out.push(5);
                    put(&mut out, *file);
                    put(&mut out, *len);
                }
                Op::Fallocate {
                    file,
                    offset,
                    len,
                    mode,
                } => {
                    out.push(6);
                    put(&mut out, *file);
                    put(&mut out, *offset);
                    put(&mut out, *len);
                    put(&mut out, *mode as u64);
                }
                Op::Sync { file, data_only } => {
                    out.push(7);
                    put(&mut out, *file);
                    put(&mut out, u64::from(*data_only));
                }
                Op::SyncDir => out.push(8),
                Op::Mark(m) => {
                    out.push(9);
                    put_str(&mut out, m);
                }
            }
        }
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
        gz.write_all(&out)?;
        fs::write(path, gz.finish()?)
    }

    pub fn load(path: &Path) -> io::Result<Recording> {
        let raw = fs::read(path)?;
        let mut buf = Vec::new();
        if raw.starts_with(&[0x1f, 0x8b]) {
            flate2::read::GzDecoder::new(&raw[..]).read_to_end(&mut buf)?;
        } else {
            buf = raw;
        }
        let mut r = Reader { buf: &buf, pos: 0 };
        if r.take(8)? != MAGIC {
            return Err(bad("not a vublk-crash recording"));
        }
        let mut rec = Recording::default();
        for _ in 0..r.u64()? {
            let name = r.string()?;
            let id = r.u64()?;
            let len = r.u64()?;
            let mut img = FileImage::default();
            for _ in 0..r.u64()? {
                let at = r.u64()?;
                img.write(at, r.bytes()?);
            }
            img.set_len(len);
            rec.initial.names.insert(name, id);
            rec.initial.files.insert(id, img);
        }
        for _ in 0..r.u64()? {
            let at_ns = r.u64()?;
            let op = match r.take(1)?[0] {
                1 => Op::Create {
                    file: r.u64()?,
                    name: r.string()?,
                },
                2 => Op::Rename {
                    from: r.string()?,
                    to: r.string()?,
                },
                3 => Op::Unlink { name: r.string()? },
                4 => Op::Write {
                    file: r.u64()?,
                    offset: r.u64()?,
                    dsync: r.u64()? != 0,
                    data: r.bytes()?.to_vec(),
                },
                5 => Op::SetLen {
                    file: r.u64()?,
                    len: r.u64()?,
                },
                6 => Op::Fallocate {
                    file: r.u64()?,
                    offset: r.u64()?,
                    len: r.u64()?,
                    mode: r.u64()? as i32,
                },
                7 => Op::Sync {
                    file: r.u64()?,
                    data_only: r.u64()? != 0,
                },
                8 => Op::SyncDir,
                9 => Op::Mark(r.string()?),
                k => return Err(bad(&format!("unknown record kind {k}"))),
            };
            rec.records.push(Record { at_ns, op });
        }
        Ok(rec)
    }
}

fn put(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(&v.to_le_bytes());
}

fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
    put(out, b.len() as u64);
    out.extend_from_slice(b);
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    put_bytes(out, s.as_bytes());
}

fn bad(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.to_string())
}

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> io::Result<&'a [u8]> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.buf.len())
            .ok_or_else(|| bad("recording cut short"))?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn u64(&mut self) -> io::Result<u64> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().unwrap()))
    }

    fn bytes(&mut self) -> io::Result<&'a [u8]> {
        let n = usize::try_from(self.u64()?).map_err(|_| bad("length"))?;
        self.take(n)
    }

    fn string(&mut self) -> io::Result<String> {
        String::from_utf8(self.bytes()?.to_vec()).map_err(|_| bad("name is not UTF-8"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_saved_recording_loads_the_same() {
        let mut r = Recording::default();
        r.initial.apply(&Op::Create {
            file: 2,
            name: "a".into(),
        });
        r.initial.files.get_mut(&2).unwrap().write(8192, &[5; 100]);
        r.initial.files.get_mut(&2).unwrap().set_len(1 << 20);
        let ops = vec![
            Op::Write {
                file: 2,
                offset: 3,
                data: vec![1, 2, 3],
                dsync: true,
            },
            Op::SetLen { file: 2, len: 77 },
            Op::Fallocate {
                file: 2,
                offset: 4096,
                len: 8192,
                mode: libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            },
            Op::Sync {
                file: 2,
                data_only: false,
            },
            Op::Create {
                file: 3,
                name: "b".into(),
            },
            Op::Rename {
                from: "b".into(),
                to: "c".into(),
            },
            Op::Unlink { name: "a".into() },
            Op::SyncDir,
            Op::Mark("epoch 0".into()),
        ];
        r.records = ops
            .into_iter()
            .enumerate()
            .map(|(i, op)| Record {
                at_ns: i as u64,
                op,
            })
            .collect();
        let p = std::env::temp_dir().join(format!("vublk-crash-rec-{}", std::process::id()));
        r.save(&p).unwrap();
        let l = Recording::load(&p).unwrap();
        std::fs::remove_file(&p).unwrap();
        assert_eq!(l.records, r.records);
        let (a, b) = (r.initial.get("a").unwrap(), l.initial.get("a").unwrap());
        assert_eq!(a.len(), b.len());
        assert_eq!(a.read(0, 1 << 20), b.read(0, 1 << 20));
    }
}
