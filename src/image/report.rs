//! What an image tells about itself: its format's counters for `stats` and the shutdown
//! log.

use std::sync::atomic::Ordering;

use super::{Image, Kind};

impl Image {
    /// The format's counters, for `stats` (an empty object for raw images).
    pub fn counters(&self) -> serde_json::Value {
        let n = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
        match self.local_kind() {
            None | Some(Kind::Raw) => serde_json::json!({}),
            Some(Kind::Luks(l)) => {
                let h = &l.vol.header;
                serde_json::json!({
                    "encryption": format!("luks{}", h.version),
                    "cipher": crate::crypt::header::CIPHER,
                    "key_bits": h.key_bytes * 8,
                    "sector_size": h.sector_size,
                    "data_offset": h.data_offset,
                })
            }
            Some(Kind::Parallels(p)) => serde_json::json!({
                "clusters_allocated": n(&p.stats.allocated),
                "clusters_reused": n(&p.stats.reused),
                "clusters_freed": n(&p.stats.freed),
                "file_grows": n(&p.stats.grows),
                "file_grown_bytes": n(&p.stats.grown_bytes),
            }),
            Some(Kind::Qcow2(d)) => {
                let q = &d.q;
                let (done, skipped) = q.prealloc_counts();
                let (writes, bytes) = q.compressed_file_writes();
                serde_json::json!({
                    "preallocations": done,
                    "preallocations_skipped": skipped,
                    "copy_on_writes_unlocked": n(&q.stats.cow_unlocked),
                    "extended_l2": q.extended_l2(),
                    "subcluster_writes": n(&q.stats.subcluster_writes),
                    "clusters_reused": n(&q.stats.reused_clusters),
                    "compressed_clusters": n(&q.stats.compressed_clusters),
                    "uncompressible_clusters": n(&q.stats.uncompressible_clusters),
                    "compressed_file_writes": writes,
                    "compressed_file_bytes": bytes,
                    "l2_cache_hits": n(&q.stats.l2_hits),
                    "l2_cache_misses": n(&q.stats.l2_misses),
                    "encryption": q.crypt().map(|v| format!("luks{}", v.header.version)),
                })
            }
        }
    }

    /// One line per counter group, for the shutdown log.
    pub fn stats_lines(&self) -> Vec<String> {
        let n = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
        let mut out = Vec::new();
        match self.local_kind() {
            Some(Kind::Parallels(p)) if p.writable() => out.push(format!(
                "parallels: {} clusters allocated ({} reused from free space), {} freed, file \
                 grown {} times by {} MiB",
                n(&p.stats.allocated),
                n(&p.stats.reused),
                n(&p.stats.freed),
                n(&p.stats.grows),
                n(&p.stats.grown_bytes) >> 20
            )),
            Some(Kind::Qcow2(d)) if d.q.writable() => {
                let q = &d.q;
                let (done, skipped) = q.prealloc_counts();
                out.push(format!("preallocation: {done} done, {skipped} skipped"));
                out.push(format!(
                    "qcow2: {} copy-on-writes done without the allocation lock, {} writes \
                     of single subclusters",
                    n(&q.stats.cow_unlocked),
                    n(&q.stats.subcluster_writes)
                ));
                if q.compress_writes() {
                    out.push(format!(
                        "compressed writes: {} clusters compressed, {} stored normally (did \
                         not compress)",
                        n(&q.stats.compressed_clusters),
                        n(&q.stats.uncompressible_clusters)
                    ));
                    let (writes, bytes) = q.compressed_file_writes();
                    out.push(format!(
                        "compressed writes: {writes} writes of {bytes} bytes reached the file"
                    ));
                }
            }
            _ => {}
        }
        out
    }
}
