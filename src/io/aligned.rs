//! Positional I/O through 4 KiB-aligned copies, so that it works on files opened O_DIRECT:
//! whole aligned reads, aligned writes, and the one read-modify-write helper every format
//! (and the raw path's sub-block writes) uses to change bytes inside a block.

use std::io;

use super::bounce::AlignedBuf;
use super::storage::Storage;

/// Memory and length alignment of every buffer handed to the file: enough for O_DIRECT on
/// any device with blocks of at most 4 KiB.
const ALIGN: u64 = 4096;

/// Read `len` bytes at `offset` with a 4 KiB-aligned buffer and length; returns exactly the
/// bytes asked for (zero-padded past the end of the file).
pub fn read_aligned(file: &dyn Storage, offset: u64, len: usize) -> io::Result<Vec<u8>> {
    let start = offset / ALIGN * ALIGN;
    let end = (offset + len as u64).div_ceil(ALIGN) * ALIGN;
    let span = (end - start) as usize;
    let mut buf = AlignedBuf::new(span, ALIGN as usize)?;
    let mut done = 0usize;
    while done < span {
        match file.read_at(&mut buf.as_mut_slice()[done..], start + done as u64) {
            Ok(0) => break,
            // A short read only happens at the end of the file (and the next O_DIRECT read
            // would be unaligned): the rest reads as zeroes.
            Ok(n) if n < span - done => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    let skip = (offset - start) as usize;
    Ok(buf.as_slice()[skip..skip + len].to_vec())
}

/// pwrite `data` at `offset` through an aligned copy (offset and length must suit the file:
/// multiples of its direct-I/O block when it is O_DIRECT).
pub fn write_all_aligned(file: &dyn Storage, offset: u64, data: &[u8]) -> io::Result<()> {
    let mut buf = AlignedBuf::new(data.len().max(1), ALIGN as usize)?;
    buf.as_mut_slice()[..data.len()].copy_from_slice(data);
    file.write_all_at(&buf.as_slice()[..data.len()], offset)
}

/// Write `data` at any byte offset: read the `chunk`-aligned blocks around it, patch them,
/// write them back. The caller makes sure nothing else writes those blocks meanwhile (a
/// lock, or `chunk` no larger than the structure being changed).
pub fn write_unaligned(file: &dyn Storage, offset: u64, data: &[u8], chunk: u64) -> io::Result<()> {
    let start = offset & !(chunk - 1);
    let end = (offset + data.len() as u64).next_multiple_of(chunk);
    let mut buf = read_aligned(file, start, (end - start) as usize)?;
    let at = (offset - start) as usize;
    buf[at..at + data.len()].copy_from_slice(data);
    write_all_aligned(file, start, &buf)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::MemStorage;

    #[test]
    fn unaligned_write_patches_only_its_bytes() {
        let disk = MemStorage::new(vec![7u8; 8192]);
        write_unaligned(&disk, 1000, &[1, 2, 3], 512).unwrap();
        let all = read_aligned(&disk, 0, 8192).unwrap();
        assert_eq!(&all[1000..1003], &[1, 2, 3]);
        assert!(all[..1000].iter().chain(&all[1003..]).all(|&b| b == 7));
    }

    #[test]
    fn reads_past_the_end_are_zero_padded() {
        let disk = MemStorage::new(vec![9u8; 5000]);
        let v = read_aligned(&disk, 4096, 4096).unwrap();
        assert!(v[..904].iter().all(|&b| b == 9));
        assert!(v[904..].iter().all(|&b| b == 0));
    }
}
