//! Files in memory: what a crash state holds before it is written out to a directory.

use std::collections::{BTreeMap, HashMap};
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;

use crate::record::{FileId, Op};

/// The unit a power cut may tear a write at.
pub const SECTOR: u64 = 512;

const CHUNK: u64 = 4096;

/// One file's bytes: a length and 4 KiB chunks (absent chunks read as zeroes). Chunks are
/// shared between clones until one of them writes (crash states start from a common base).
#[derive(Clone, Debug, Default)]
pub struct FileImage {
    len: u64,
    chunks: BTreeMap<u64, Arc<[u8; CHUNK as usize]>>,
}

impl FileImage {
    /// Reads a file, keeping only its non-zero chunks.
    pub fn load(path: &Path) -> io::Result<FileImage> {
        let mut f = File::open(path)?;
        let mut img = FileImage {
            len: f.metadata()?.len(),
            chunks: BTreeMap::new(),
        };
        let mut buf = vec![0u8; 1 << 20];
        let mut off = 0u64;
        loop {
            let n = read_full(&mut f, &mut buf)?;
            if n == 0 {
                break;
            }
            img.write(off, &buf[..n]);
            off += n as u64;
        }
        img.len = off.max(img.len);
        Ok(img)
    }

    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Writes `data` at `offset`, extending the file.
    pub fn write(&mut self, offset: u64, data: &[u8]) {
        let mut done = 0usize;
        while done < data.len() {
            let pos = offset + done as u64;
            let (idx, within) = (pos / CHUNK, (pos % CHUNK) as usize);
            let n = (CHUNK as usize - within).min(data.len() - done);
            let part = &data[done..done + n];
            if part.iter().all(|&b| b == 0) {
                if let Some(c) = self.chunks.get_mut(&idx) {
                    Arc::make_mut(c)[within..within + n].fill(0);
                }
            } else {
                let c = self
                    .chunks
                    .entry(idx)
                    .or_insert_with(|| Arc::new([0; CHUNK as usize]));
                Arc::make_mut(c)[within..within + n].copy_from_slice(part);
            }
            done += n;
        }
        self.len = self.len.max(offset + data.len() as u64);
    }

    /// Zeroes `[offset, offset + len)` within the file (punching or zeroing a range).
    pub fn zero(&mut self, offset: u64, len: u64) {
        let end = (offset + len).min(self.len);
        let mut pos = offset;
        while pos < end {
            let (idx, within) = (pos / CHUNK, pos % CHUNK);
            let n = (CHUNK - within).min(end - pos);
            if within == 0 && n == CHUNK {
                self.chunks.remove(&idx);
            } else if let Some(c) = self.chunks.get_mut(&idx) {
                Arc::make_mut(c)[within as usize..(within + n) as usize].fill(0);
            }
            pos += n;
        }
    }

    pub fn set_len(&mut self, len: u64) {
        if len < self.len {
            self.zero(len, self.len - len);
            let first_gone = len.div_ceil(CHUNK);
            self.chunks.split_off(&first_gone);
        }
        self.len = len;
    }

    /// `len` bytes at `offset` (zeroes past the end).
    pub fn read(&self, offset: u64, len: usize) -> Vec<u8> {
        let mut out = vec![0u8; len];
        let mut done = 0usize;
        while done < len {
            let pos = offset + done as u64;
            let (idx, within) = (pos / CHUNK, (pos % CHUNK) as usize);
            let n = (CHUNK as usize - within).min(len - done);
            if let Some(c) = self.chunks.get(&idx) {
                out[done..done + n].copy_from_slice(&c[within..within + n]);
            }
            done += n;
        }
        out
    }

    /// Writes the file out: its length, then its non-zero chunks (the rest stays a hole).
    pub fn store(&self, path: &Path) -> io::Result<()> {
        let f = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .open(path)?;
        f.set_len(self.len)?;
        for (&idx, c) in &self.chunks {
            let off = idx * CHUNK;
            let n = CHUNK.min(self.len.saturating_sub(off)) as usize;
            f.write_all_at(&c[..n], off)?;
        }
        Ok(())
    }
}

fn read_full(f: &mut File, buf: &mut [u8]) -> io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match f.read(&mut buf[n..])? {
            0 => break,
            k => n += k,
        }
    }
    Ok(n)
}

/// A directory of files: names (what a directory entry points at) and the files by identity
/// (a file's data survives renames, and an unlinked file's data is simply unnamed).
#[derive(Clone, Debug, Default)]
pub struct Files {
    pub names: BTreeMap<String, FileId>,
    pub files: HashMap<FileId, FileImage>,
}

impl Files {
    /// Applies one recorded operation (marks and durability points change nothing).
    pub fn apply(&mut self, op: &Op) {
        match op {
            Op::Create { file, name } => {
                self.names.insert(name.clone(), *file);
                self.files.entry(*file).or_default();
            }
            Op::Rename { from, to } => {
                if let Some(id) = self.names.remove(from) {
                    self.names.insert(to.clone(), id);
                }
            }
            Op::Unlink { name } => {
                self.names.remove(name);
            }
            Op::Write {
                file, offset, data, ..
            } => self.file(*file).write(*offset, data),
            Op::SetLen { file, len } => self.file(*file).set_len(*len),
            Op::Fallocate {
                file,
                offset,
                len,
                mode,
            } => {
                let f = self.file(*file);
                let keep_size = mode & libc::FALLOC_FL_KEEP_SIZE != 0;
                if mode & (libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_ZERO_RANGE) != 0 {
                    f.zero(*offset, *len);
                }
                if !keep_size && offset + len > f.len() {
                    f.set_len(offset + len);
                }
            }
            Op::Sync { .. } | Op::SyncDir | Op::Mark(_) => {}
        }
    }

    fn file(&mut self, id: FileId) -> &mut FileImage {
        self.files.entry(id).or_default()
    }

    /// The file a name points at.
    pub fn get(&self, name: &str) -> Option<&FileImage> {
        self.names.get(name).and_then(|id| self.files.get(id))
    }

    /// Writes every named file into `dir`, after removing what `dir` held.
    pub fn store(&self, dir: &Path) -> io::Result<()> {
        if dir.exists() {
            fs::remove_dir_all(dir)?;
        }
        fs::create_dir_all(dir)?;
        for (name, id) in &self.names {
            let empty = FileImage::default();
            self.files
                .get(id)
                .unwrap_or(&empty)
                .store(&dir.join(name))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_zeroes_and_truncation_read_back() {
        let mut f = FileImage::default();
        f.write(4000, &[7u8; 200]);
        assert_eq!(f.len(), 4200);
        assert_eq!(f.read(3999, 3), vec![0, 7, 7]);
        let shared = f.clone();
        f.zero(4090, 10);
        assert_eq!(f.read(4089, 12), [&[7u8][..], &[0; 10], &[7]].concat());
        assert_eq!(shared.read(4090, 1), vec![7], "a clone keeps its own bytes");
        f.set_len(4095);
        f.set_len(8192);
        assert_eq!(
            f.read(4094, 2),
            vec![0, 0],
            "truncated bytes read as zero again"
        );
        f.write(0, &[0u8; 4096]);
        assert_eq!(f.read(0, 4096), vec![0u8; 4096]);
    }
}
