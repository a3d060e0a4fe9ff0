//! Several writes at once from a thread that otherwise does blocking I/O (the metadata
//! write-back before requests complete): a small io_uring per thread, made on first use, so
//! that N independent writes cost about one round trip to the disk instead of N.

use std::cell::RefCell;
use std::io;
use std::os::fd::RawFd;
use std::os::unix::fs::FileExt;
use std::time::Duration;

use io_uring::{opcode, types, IoUring};

/// Writes per submission (and the ring's size).
const ENTRIES: usize = 32;

thread_local! {
    /// Made on first use; `Some(None)`: none could be made (or it failed) on this thread.
    static RING: RefCell<Option<Option<IoUring>>> = const { RefCell::new(None) };
}

/// Write every `(bytes, offset)` to `file` in full, up to [`ENTRIES`] at a time; without a
/// ring on this thread, one at a time.
pub(super) fn write_all(
    file: &std::fs::File,
    fd: RawFd,
    writes: &[(&[u8], u64)],
) -> io::Result<()> {
    let one_by_one = |w: &[(&[u8], u64)]| {
        w.iter()
            .try_for_each(|(buf, offset)| file.write_all_at(buf, *offset))
    };
    RING.with(|cell| {
        let mut cell = cell.borrow_mut();
        let Some(ring) = cell
            .get_or_insert_with(|| IoUring::new(ENTRIES as u32).ok())
            .as_mut()
        else {
            return one_by_one(writes);
        };
        for batch in writes.chunks(ENTRIES) {
            match write_batch(ring, fd, batch) {
                Some(short) => {
                    // Short or failed writes: the rest of each one at a time (which
                    // reports the error, if it persists).
                    for (i, done) in short {
                        let (buf, offset) = batch[i];
                        file.write_all_at(&buf[done..], offset + done as u64)?;
                    }
                }
                None => {
                    // The ring took none of the batch: drop it (nothing it holds runs)
                    // and write the rest one at a time from now on.
                    *cell = Some(None);
                    let at = batch.as_ptr() as usize - writes.as_ptr() as usize;
                    let at = at / std::mem::size_of::<(&[u8], u64)>();
                    return one_by_one(&writes[at..]);
                }
            }
        }
        Ok(())
    })
}

/// One batch (at most [`ENTRIES`]) through an empty ring: Some(the writes that did not write
/// everything, with how much they wrote) once every one has completed; None if the ring
/// took none of them.
fn write_batch(
    ring: &mut IoUring,
    fd: RawFd,
    batch: &[(&[u8], u64)],
) -> Option<Vec<(usize, usize)>> {
    let mut short = Vec::new();
    let mut queued = 0;
    {
        let mut sq = ring.submission();
        for (i, (buf, offset)) in batch.iter().enumerate() {
            // Larger than a u32: written one at a time below.
            let Ok(len) = u32::try_from(buf.len()) else {
                short.push((i, 0));
                continue;
            };
            let e = opcode::Write::new(types::Fd(fd), buf.as_ptr(), len)
                .offset(*offset)
                .build()
                .user_data(i as u64);
            // SAFETY: `buf` outlives the operation: this function returns only after every
            // operation it queued has completed (or, when the ring took none, after the
            // ring that holds them is dropped unsubmitted).
            if unsafe { sq.push(&e) }.is_err() {
                short.push((i, 0));
                continue;
            }
            queued += 1;
        }
    }
    let mut submitted = false;
    let mut done = 0;
    while done < queued {
        match ring.submit_and_wait(queued - done) {
            Ok(_) => submitted = true,
            Err(e) if !submitted && !retryable(&e) => return None,
            // Interrupted, or short of kernel resources: the queued writes still reference
            // their buffers, so wait for them whatever it takes.
            Err(_) => std::thread::sleep(Duration::from_micros(100)),
        }
        for cqe in ring.completion() {
            done += 1;
            let i = cqe.user_data() as usize;
            let want = batch.get(i).map_or(0, |(b, _)| b.len());
            let got = usize::try_from(cqe.result()).unwrap_or(0);
            if got < want {
                short.push((i, got));
            }
        }
    }
    Some(short)
}

fn retryable(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EINTR) | Some(libc::EAGAIN) | Some(libc::EBUSY)
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    #[test]
    fn many_writes_land_where_they_were_asked_to() {
        let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/unit-tmp");
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join(format!("batch-{}", std::process::id()));
        let f = std::fs::OpenOptions::new()
            .create(true)
            .truncate(true)
            .read(true)
            .write(true)
            .open(&p)
            .unwrap();
        // More than one batch, in no order.
        let bufs: Vec<Vec<u8>> = (0..70u8).map(|i| vec![i + 1; 512]).collect();
        let writes: Vec<(&[u8], u64)> = bufs
            .iter()
            .enumerate()
            .map(|(i, b)| (&b[..], ((i * 37) % 70) as u64 * 512))
            .collect();
        write_all(&f, f.as_raw_fd(), &writes).unwrap();
        let got = std::fs::read(&p).unwrap();
        std::fs::remove_file(&p).unwrap();
        for (i, b) in bufs.iter().enumerate() {
            let at = (i * 37) % 70 * 512;
            assert_eq!(&got[at..at + 512], &b[..], "write {i}");
        }
    }
}
