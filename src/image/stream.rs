//! What the stream job needs of an image (`jobs::stream`): its backing files, and copies of
//! what the chain holds into the image itself, placed by the format as guest writes are.

use std::fs::File;

use super::chain;
use super::piece::Piece;
use super::{Image, ImageError, Qcow2Disk, ReadPlan};

impl Image {
    /// The backing files below the image, nearest first (none for raw, parallels and
    /// remote disks).
    pub fn backing_paths(&self) -> Vec<std::path::PathBuf> {
        self.backing_layers().into_iter().map(|(p, _)| p).collect()
    }

    /// The backing files with their formats ("qcow2", "parallels", "raw"), nearest first.
    pub fn backing_layers(&self) -> Vec<(std::path::PathBuf, &'static str)> {
        match self.qcow2() {
            Some((_, d)) => d
                .backing
                .iter()
                .map(|l| (l.path.clone(), l.format_name()))
                .collect(),
            None => Vec::new(),
        }
    }

    /// A stream job's step over the clusters of [offset, offset + len) (cluster-aligned):
    /// each is copied into the image (see `Qcow2Image::populate`) unless the image holds it
    /// already, or unless every byte of it comes from chain layer `keep` or below (`keep`:
    /// the index in `backing_paths()` of the backing file that stays; None: everything is
    /// copied). What the chain holds for the chunk is read once, with one plan. The bytes
    /// copied.
    pub fn stream_chunk(
        &self,
        offset: u64,
        len: u64,
        keep: Option<usize>,
    ) -> Result<u64, ImageError> {
        self.check_active()?;
        let Some((file, d)) = self.qcow2() else {
            return Ok(0);
        };
        let c = d.q.cluster_size();
        let end = (offset + len).min(d.q.size_bytes());
        // The clusters to copy, as far as the maps say now (populate checks again).
        let mut plan = ReadPlan::default();
        let mut wanted = Vec::new();
        let mut cl = offset & !(c - 1);
        while cl < end {
            let n = c.min(end - cl);
            chain::resolve_read(
                &d.q,
                file,
                &d.backing,
                cl,
                n,
                &mut plan.scratch,
                &mut plan.pieces,
            )?;
            // Layer 0 is the image; layer i + 1 is backing file i. Zeroes may come from a
            // layer above `keep` (a zero flag): copied.
            let mine = plan.pieces.iter().any(|p| {
                matches!(
                    *p,
                    Piece::Data { layer: 0, .. } | Piece::Compressed { layer: 0, .. }
                )
            }) && !(d.q.extended_l2()
                // Subclusters: the image may hold part of a cluster and not the rest.
                && plan.pieces.iter().any(|p| match *p {
                    Piece::Data { layer, .. } | Piece::Compressed { layer, .. } => layer > 0,
                    Piece::Zero { .. } => false,
                }));
            let below = keep.is_some_and(|k| {
                plan.pieces.iter().all(|p| match *p {
                    Piece::Data { layer, .. } | Piece::Compressed { layer, .. } => layer > k,
                    Piece::Zero { .. } => false,
                })
            });
            if !mine && !below {
                wanted.push(cl);
            }
            cl += c;
        }
        let (Some(&first), Some(&last)) = (wanted.first(), wanted.last()) else {
            return Ok(0);
        };
        let span = (last + c - first) as usize;
        let mut data = crate::io::bounce::AlignedBuf::new(span, 4096)?;
        self.read_guest_cluster(d, first, data.as_mut_slice())?;
        let data = data.as_mut_slice();
        let cluster = |cl: u64| {
            let at = (cl - first) as usize;
            &data[at..at + c as usize]
        };
        let mut copied = 0;
        // Runs of neighbouring clusters with data: new clusters allocated together and
        // written with one write, installed when it is done (as a guest's whole-cluster
        // write over the backing file is); all-zero clusters get the zero flag.
        let mut i = 0;
        while i < wanted.len() {
            let start = wanted[i];
            let mut n = 0u64;
            while i + (n as usize) < wanted.len()
                && wanted[i + n as usize] == start + n * c
                && !crate::zero::is_zero(cluster(start + n * c))
            {
                n += 1;
            }
            if n == 0 {
                copied += self.populate_one(d, file, start, cluster(start))?;
                i += 1;
                continue;
            }
            let at = (start - first) as usize;
            let run = &data[at..at + (n * c) as usize];
            match d.q.plan_fresh_write(file, start, n * c, true)? {
                Some(w) => {
                    let written = crate::io::aligned::write_all_aligned(file, w.host, run);
                    if let Some(f) = w.fill {
                        d.q.end_fill(f.key);
                    }
                    if let Some(install) = w.install {
                        d.q.finish_cow(file, install, written.is_ok())?;
                    }
                    written?;
                    copied += n * c;
                }
                // A guest write got to one of them, or one is being copied: one at a time.
                None => {
                    for k in 0..n {
                        let cl = start + k * c;
                        copied += self.populate_one(d, file, cl, cluster(cl))?;
                    }
                }
            }
            i += n as usize;
        }
        Ok(copied)
    }

    /// `Qcow2Image::populate` of one cluster with `src` (what the chain holds for it): the
    /// bytes copied (0 or the cluster size).
    fn populate_one(
        &self,
        d: &Qcow2Disk,
        file: &File,
        cl: u64,
        src: &[u8],
    ) -> Result<u64, ImageError> {
        let mut fill = |_: u64, buf: &mut [u8]| {
            buf.copy_from_slice(src);
            Ok(())
        };
        Ok(if d.q.populate(file, cl, &mut fill)? {
            src.len() as u64
        } else {
            0
        })
    }

    /// The qcow2 cluster size (None: not a qcow2 image).
    pub fn cluster_size(&self) -> Option<u64> {
        self.qcow2().map(|(_, d)| d.q.cluster_size())
    }
}
