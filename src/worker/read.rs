//! Reads the image planned: one run of the image file goes zero-copy through the engine like
//! raw; anything else (several extents, backing files, zero or compressed clusters) is read
//! piece by piece into one bounce buffer that `complete` copies to the guest.

use std::io;

use crate::image::Piece;
use crate::io::Op;

use super::failure::Failure;
use super::slot::{user_data, Bounce, OpKind, Req, SlotState};
use super::QueueWorker;

impl QueueWorker {
    /// Where a read goes in the image file: Ok(host offset) when it is one run of the file;
    /// otherwise its pieces were submitted here and `Err` carries the submission result.
    pub(super) fn plan_read(&mut self, req: Req) -> Result<u64, io::Result<bool>> {
        let image = self.image.clone();
        let mut plan = std::mem::take(&mut self.read_plan);
        let r = match image.plan_read(req.offset, req.len, &mut plan) {
            Ok(Some(host)) => Ok(host),
            Ok(None) => Err(self.submit_pieces(req, &plan.pieces)),
            Err(e) => {
                self.fail(
                    req.id,
                    Failure::Image {
                        what: "read",
                        offset: req.offset,
                        source: e,
                    },
                );
                Err(Ok(false))
            }
        };
        self.read_plan = plan;
        r
    }

    /// A read of several pieces: the pieces in image files are read through the engine into
    /// one bounce buffer, zero pieces are zero-filled and compressed ones decompressed into
    /// it here; `finish` copies the buffer to the guest.
    fn submit_pieces(&mut self, req: Req, pieces: &[Piece]) -> io::Result<bool> {
        let image = self.image.clone();
        let len = req.len as usize;
        if pieces.iter().map(|p| p.len()).sum::<u64>() != len as u64 {
            // Never index the buffer with a plan that does not cover the request exactly.
            self.fail(req.id, Failure::BadPlan);
            return Ok(false);
        }
        let mut buf = self.bounce.get(len)?;
        self.piece_reads.clear();
        let slot = self.slots.get(req.id);
        slot.iov.clear();
        slot.iov.reserve(pieces.len());
        let base = buf.as_mut_ptr();
        let mut cluster_buf: Vec<u8> = Vec::new();
        let mut failed = None;
        let mut pos = 0usize;
        for piece in pieces {
            let n = piece.len() as usize;
            match *piece {
                Piece::Data {
                    layer, host_offset, ..
                } => {
                    if layer >= image.layers() {
                        failed = Some(Failure::BadPlan);
                        break;
                    }
                    slot.iov.push(libc::iovec {
                        // SAFETY: pos + n <= len <= the buffer's length.
                        iov_base: unsafe { base.add(pos) }.cast(),
                        iov_len: n,
                    });
                    self.piece_reads.push((layer, host_offset));
                }
                Piece::Compressed { .. } if image.cipher().is_some() => {
                    // QEMU never compresses an encrypted image's clusters.
                    failed = Some(Failure::Image {
                        what: "read",
                        offset: host_offset_of(piece),
                        source: crate::image::ImageError::Corrupt(
                            "a compressed cluster in an encrypted image",
                        ),
                    });
                    break;
                }
                _ => {
                    let dst = &mut buf.as_mut_slice()[pos..pos + n];
                    if let Err(e) = image.read_piece(piece, dst, &mut cluster_buf) {
                        failed = Some(Failure::Image {
                            what: "read of a compressed cluster",
                            offset: host_offset_of(piece),
                            source: e,
                        });
                        break;
                    }
                }
            }
            pos += n;
        }
        if let Some(f) = failed {
            slot.iov.clear();
            self.bounce.put(buf);
            self.fail(req.id, f);
            return Ok(false);
        }
        let SlotState::Busy(r) = &mut slot.state else {
            self.bounce.put(buf);
            return Ok(false);
        };
        r.bounce = Some(Bounce { buf, skip: 0 });
        if image.cipher().is_some() {
            r.decrypt_pieces = self
                .piece_reads
                .iter()
                .map(|&(layer, host)| if layer == 0 { host } else { u64::MAX })
                .collect();
        }
        for (i, &(layer, host_offset)) in self.piece_reads.iter().enumerate() {
            let op = Op::Readv {
                iov: &slot.iov[i],
                iovcnt: 1,
                offset: host_offset,
            };
            // SAFETY: the iovec points into the request's bounce buffer, which it keeps until
            // the completion is reaped; slot.iov is not resized after this loop started.
            unsafe {
                self.engine
                    .push(layer, &op, user_data(req.id, OpKind::ReadPart, i as u32))?
            };
            r.pending += 1;
        }
        Ok(r.pending > 0)
    }
}

/// Where a piece lies in its file (for messages).
fn host_offset_of(p: &Piece) -> u64 {
    match *p {
        Piece::Data { host_offset, .. } | Piece::Compressed { host_offset, .. } => host_offset,
        Piece::Zero { .. } => 0,
    }
}
