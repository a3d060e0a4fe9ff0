//! A model of a disk's contents and the randomized request mix the remote-storage tests
//! (RBD, NBD) run through libblkio against it.

use blkio::ReqFlags;

use super::*;

/// What the disk holds: known bytes, and ranges a discard left unspecified (old data or
/// zeroes: DISCARD may leave data, e.g. librbd below its granularity).
pub struct Model {
    pub data: Vec<u8>,
    pub unknown: Vec<bool>,
}

impl Model {
    pub fn check(&self, got: &[u8], offset: usize, what: &str) {
        for (i, &g) in got.iter().enumerate() {
            let j = offset + i;
            let ok = g == self.data[j] || (self.unknown[j] && g == 0);
            assert!(
                ok,
                "{what}: byte {j}: {g:#x}, expected {:#x}{}",
                self.data[j],
                if self.unknown[j] { " or 0" } else { "" }
            );
        }
    }

    pub fn set(&mut self, offset: usize, bytes: &[u8]) {
        self.data[offset..offset + bytes.len()].copy_from_slice(bytes);
        self.unknown[offset..offset + bytes.len()].fill(false);
    }
}

/// `ops` random requests on queue 0 of `c` (a disk of `size` bytes that reads as zeroes
/// at first), one at a time: writes (a quarter all zeroes), reads checked against the
/// model, WRITE_ZEROES with and without UNMAP, DISCARD, FLUSH. Every request must succeed.
pub fn random_requests(c: &mut Client, size: u64, ops: usize, seed: u64) -> Model {
    let mut m = Model {
        data: vec![0; size as usize],
        unknown: vec![false; size as usize],
    };
    let mut rng = Rng::new(seed);
    let mut counts = [0usize; 6];
    for i in 0..ops {
        let sectors = if rng.below(2) == 0 {
            rng.range(1, 16)
        } else {
            rng.range(1, 2048)
        };
        let len = sectors as usize * 512;
        let offset = (rng.below((size - len as u64) / 512 + 1) * 512) as usize;
        let what = rng.below(16);
        let ret = match what {
            0..=6 => {
                counts[0] += 1;
                let mut data = vec![0u8; len];
                if rng.below(4) != 0 {
                    rng.fill(&mut data);
                }
                c.mem_mut()[..len].copy_from_slice(&data);
                m.set(offset, &data);
                c.submit(
                    0,
                    Op::Write {
                        offset: offset as u64,
                        buf: 0,
                        len,
                    },
                )
            }
            7..=11 => {
                counts[1] += 1;
                c.mem_mut()[..len].fill(0x5a);
                let got = c.read_at(0, offset as u64, len).unwrap_or_else(|e| {
                    panic!("op {i}: read {len} at {offset}: {}", errno_name(e))
                });
                m.check(&got, offset, &format!("op {i}: read {len} at {offset}"));
                0
            }
            12 | 13 => {
                counts[2] += 1;
                let flags = if what == 12 {
                    ReqFlags::empty()
                } else {
                    ReqFlags::NO_UNMAP
                };
                m.set(offset, &vec![0; len]);
                c.submit(
                    0,
                    Op::WriteZeroes {
                        offset: offset as u64,
                        len: len as u64,
                        flags,
                    },
                )
            }
            14 => {
                counts[3] += 1;
                m.unknown[offset..offset + len].fill(true);
                c.submit(
                    0,
                    Op::Discard {
                        offset: offset as u64,
                        len: len as u64,
                    },
                )
            }
            _ => {
                counts[4] += 1;
                c.submit(0, Op::Flush)
            }
        };
        assert_eq!(ret, 0, "op {i} ({what}): {}", errno_name(ret));
    }
    println!(
        "{} writes, {} reads, {} write-zeroes, {} discards, {} flushes",
        counts[0], counts[1], counts[2], counts[3], counts[4]
    );
    m
}

/// One request of the plain model mix on queue 0 of `c` at [off, off + len): a write of
/// random bytes (half of them), write-zeroes (a sixth) or a read checked against `model`
/// (a third); `model` follows.
pub fn model_request(
    c: &mut Client,
    model: &mut [u8],
    rng: &mut Rng,
    off: u64,
    len: usize,
    what: &str,
) {
    let r = off as usize..off as usize + len;
    match rng.below(6) {
        0..=2 => {
            let mut data = vec![0u8; len];
            rng.fill(&mut data);
            assert_eq!(c.write_at(0, off, &data), 0, "{what}: write {len} at {off}");
            model[r].copy_from_slice(&data);
        }
        3 => {
            let op = Op::WriteZeroes {
                offset: off,
                len: len as u64,
                flags: ReqFlags::empty(),
            };
            assert_eq!(c.submit(0, op), 0, "{what}: write zeroes {len} at {off}");
            model[r].fill(0);
        }
        _ => {
            let got = c.read_at(0, off, len).unwrap();
            assert_same(&got, &model[r], &format!("{what}: read {len} at {off}"));
        }
    }
}
