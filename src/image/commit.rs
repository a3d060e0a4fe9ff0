//! What the commit job needs of an image (`jobs::commit`): which clusters the layers above
//! the base hold, what a given layer of the chain reads, and writes of whole clusters into
//! the base (any format), zeroes as zeroes.

use super::chain;
use super::piece::Piece;
use super::qcow2::Extent;
use super::{Disk, Image, ImageError, Kind, Local, Qcow2Disk, ReadPlan, ZeroMode};

impl Image {
    /// Read [cl_start, cl_start + buf.len()) as chain layer `layer` sees it (0: the image,
    /// through its whole chain; i: backing file i - 1 and what is below it), synchronously.
    /// Past the layer's size it reads zeroes.
    pub(super) fn read_layer_cluster(
        &self,
        d: &Qcow2Disk,
        layer: usize,
        cl_start: u64,
        buf: &mut [u8],
    ) -> Result<(), ImageError> {
        let file = self.layer_file(0).ok_or(ImageError::Corrupt("bad layer"))?;
        let size = match layer {
            0 => d.q.size_bytes(),
            n => {
                d.backing
                    .get(n - 1)
                    .ok_or(ImageError::Corrupt("bad layer"))?
                    .size_bytes
            }
        };
        // The last cluster may extend past the virtual size: only map what exists.
        let len = (buf.len() as u64).min(size.saturating_sub(cl_start));
        buf.fill(0);
        if len == 0 {
            return Ok(());
        }
        let mut plan = ReadPlan::default();
        if layer == 0 {
            chain::resolve_read(
                &d.q,
                file,
                &d.backing,
                cl_start,
                len,
                &mut plan.scratch,
                &mut plan.pieces,
            )?;
        } else {
            chain::resolve_from_layer(
                &d.backing,
                layer,
                cl_start,
                len,
                &mut plan.scratch,
                &mut plan.pieces,
            )?;
        }
        let mut pos = 0usize;
        let mut cluster_buf = Vec::new();
        for p in &plan.pieces {
            let n = p.len() as usize;
            let dst = buf
                .get_mut(pos..pos + n)
                .ok_or(ImageError::Corrupt("plan longer than the cluster"))?;
            match *p {
                Piece::Zero { .. } => {}
                Piece::Data {
                    layer, host_offset, ..
                } => {
                    let file = self
                        .layer_file(layer)
                        .ok_or(ImageError::Corrupt("bad layer"))?;
                    let data = crate::io::aligned::read_aligned(file, host_offset, n)?;
                    dst.copy_from_slice(&data);
                    if let (0, Some(v)) = (layer, self.cipher()) {
                        v.decrypt(dst, host_offset);
                    }
                }
                Piece::Compressed { .. } => self.read_piece(p, dst, &mut cluster_buf)?,
            }
            pos += n;
        }
        Ok(())
    }

    /// [`Self::read_layer_cluster`] for the commit job: `buf` gets what chain layer `layer`
    /// reads at `offset` (a qcow2 image and its chain only).
    pub fn read_layer(&self, layer: usize, offset: u64, buf: &mut [u8]) -> Result<(), ImageError> {
        self.check_active()?;
        let (_, d) = self
            .qcow2()
            .ok_or(ImageError::Unsupported("not a qcow2 image".into()))?;
        self.read_layer_cluster(d, layer, offset, buf)
    }

    /// The virtual size of chain layer `layer` (0: the image; i: backing file i - 1).
    pub fn layer_size(&self, layer: usize) -> Option<u64> {
        match layer {
            0 => Some(self.size_bytes()),
            n => self
                .qcow2()
                .and_then(|(_, d)| d.backing.get(n - 1).map(|l| l.size_bytes)),
        }
    }

    /// Does any of chain layers [from, to) (0: the image; i: backing file i - 1) hold
    /// something of [offset, offset + len) itself: data, compressed data or a zero flag
    /// (what a commit of those layers into layer `to` must copy)?
    pub fn held_in_layers(
        &self,
        offset: u64,
        len: u64,
        from: usize,
        to: usize,
    ) -> Result<bool, ImageError> {
        self.check_active()?;
        let Some((file, d)) = self.qcow2() else {
            return Ok(from == 0 && to > 0);
        };
        let mut scratch = Vec::new();
        for layer in from..to {
            let (q, f, size) = if layer == 0 {
                (&d.q, file, d.q.size_bytes())
            } else {
                let l = d
                    .backing
                    .get(layer - 1)
                    .ok_or(ImageError::Corrupt("bad layer"))?;
                match &l.qcow2 {
                    Some(q) => (q, &l.file, l.size_bytes),
                    // Only the bottom of a chain can be another format: all of it counts.
                    None => return Ok(true),
                }
            };
            if offset >= size {
                continue;
            }
            q.map(f, offset, len.min(size - offset), &mut scratch)?;
            if scratch
                .iter()
                .any(|e| !matches!(e, Extent::Unallocated { .. }))
            {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// Write `data` at `offset` through the format for a block job (the image is not one a
    /// guest writes through this handle): all-zero data as zeroes where the format can
    /// record them (qcow2's zero flag, parallels), so that a copied hole stays sparse.
    pub fn job_write(&self, offset: u64, data: &[u8]) -> Result<(), ImageError> {
        let whole = matches!(
            &self.disk,
            Disk::Local(Local {
                kind: Kind::Qcow2(_) | Kind::Parallels(_),
                ..
            })
        );
        if whole && crate::zero::is_zero(data) {
            return self.zero_range(offset, data.len() as u64, ZeroMode::Keep);
        }
        self.write_through_format(offset, data, false)
    }
}
