//! Where the metadata is: the clusters a data write must never land in (a hostile image could
//! point an L2 entry at its own tables), and the overlap checks of a read-write open.
//!
//! Tables of several clusters (L1 tables, the refcount table, the snapshot table) are one
//! byte range each; single clusters (L2 tables, refcount blocks) are kept one by one. So the
//! memory and the work follow the number of tables an image has, never their sizes: an image
//! whose 65,536 internal snapshots each claim a 32 MiB L1 table costs 65,536 ranges, not 2^32
//! clusters (issue 28: such an image once took 1.7 GB and most of a minute to open).

use std::collections::{BTreeMap, HashSet};

/// Host clusters holding metadata.
#[derive(Debug)]
pub(super) struct MetadataMap {
    cluster_size: u64,
    /// Start -> end (exclusive) of each table of several clusters: cluster aligned, disjoint.
    ranges: BTreeMap<u64, u64>,
    /// Cluster-aligned offsets of single metadata clusters (some may also lie in a range).
    clusters: HashSet<u64>,
}

impl MetadataMap {
    pub(super) fn new(cluster_size: u64) -> Self {
        MetadataMap {
            cluster_size,
            ranges: BTreeMap::new(),
            clusters: HashSet::new(),
        }
    }

    fn floor(&self, at: u64) -> u64 {
        at & !(self.cluster_size - 1)
    }

    /// The range holding the cluster at `cl`, if any.
    fn range_at(&self, cl: u64) -> Option<(u64, u64)> {
        let (&start, &end) = self.ranges.range(..=cl).next_back()?;
        (end > cl).then_some((start, end))
    }

    /// Is the cluster holding byte `host` metadata?
    pub(super) fn contains(&self, host: u64) -> bool {
        let cl = self.floor(host);
        self.clusters.contains(&cl) || self.range_at(cl).is_some()
    }

    /// Add the clusters `[start, end)` touches (byte offsets; nothing when `end <= start`).
    /// False if one of them was metadata already: the range is then merged with the tables
    /// it overlaps, so the map stays right for a read-only image that is served anyway.
    pub(super) fn insert_range(&mut self, start: u64, end: u64) -> bool {
        if end <= start {
            return true;
        }
        // Rounded up to a cluster (saturating at the end of the address space, which no
        // file reaches).
        let last = self.floor(end - 1);
        let (mut start, mut end) = (self.floor(start), last.saturating_add(self.cluster_size));
        if end <= start {
            return true;
        }
        let mut clear = !self.has_cluster_in(start, end);
        // Every range that starts before `end` and ends after `start` overlaps.
        while let Some((&s, &e)) = self.ranges.range(..end).next_back() {
            if e <= start {
                break;
            }
            clear = false;
            self.ranges.remove(&s);
            (start, end) = (start.min(s), end.max(e));
        }
        self.ranges.insert(start, end);
        clear
    }

    /// Does a single cluster lie in `[start, end)`? Looks at whichever is smaller: the range's
    /// clusters or the single clusters.
    fn has_cluster_in(&self, start: u64, end: u64) -> bool {
        let n = (end - start) / self.cluster_size;
        if n <= self.clusters.len() as u64 {
            (0..n).any(|i| self.clusters.contains(&(start + i * self.cluster_size)))
        } else {
            self.clusters.iter().any(|&cl| (start..end).contains(&cl))
        }
    }

    /// Room for `n` more single clusters.
    pub(super) fn reserve(&mut self, n: usize) {
        self.clusters.reserve(n);
    }

    /// Add the cluster holding byte `host`; false if it was metadata already.
    pub(super) fn insert(&mut self, host: u64) -> bool {
        let cl = self.floor(host);
        let in_range = self.range_at(cl).is_some();
        self.clusters.insert(cl) && !in_range
    }

    /// The end of the last metadata cluster (0: none).
    pub(super) fn end(&self) -> u64 {
        let ranges = self.ranges.values().next_back().copied().unwrap_or(0);
        let singles = self
            .clusters
            .iter()
            .max()
            .map_or(0, |&cl| cl + self.cluster_size);
        ranges.max(singles)
    }

    /// Entries held (ranges and single clusters): what the map costs.
    #[cfg(test)]
    pub(super) fn entries(&self) -> usize {
        self.ranges.len() + self.clusters.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const C: u64 = 512;

    #[test]
    fn a_range_covers_every_cluster_it_touches() {
        let mut m = MetadataMap::new(C);
        assert!(m.insert_range(C + 8, 3 * C + 1));
        assert!(!m.contains(0));
        assert!(m.contains(C) && m.contains(2 * C) && m.contains(3 * C + 511));
        assert!(!m.contains(4 * C));
        assert_eq!(m.end(), 4 * C);
    }

    #[test]
    fn overlaps_are_reported_and_merged() {
        let mut m = MetadataMap::new(C);
        assert!(m.insert_range(0, C));
        assert!(m.insert_range(4 * C, 8 * C));
        assert!(m.insert_range(C, 2 * C), "adjacent is not overlapping");
        assert!(!m.insert_range(7 * C, 10 * C));
        assert!(!m.insert_range(0, 5 * C));
        assert_eq!(m.entries(), 1, "merged into one range");
        assert!((0..10).all(|i| m.contains(i * C)));
        assert!(!m.contains(10 * C));
    }

    #[test]
    fn single_clusters_overlap_ranges_and_each_other() {
        let mut m = MetadataMap::new(C);
        assert!(m.insert_range(2 * C, 4 * C));
        assert!(m.insert(5 * C));
        assert!(!m.insert(5 * C + 100), "the same cluster twice");
        assert!(!m.insert(3 * C), "inside a range");
        assert!(
            !m.insert_range(5 * C, 6 * C),
            "a range over a single cluster"
        );
        assert!(m.insert(C));
        assert_eq!(m.end(), 6 * C);
    }

    #[test]
    fn an_empty_range_adds_nothing() {
        let mut m = MetadataMap::new(C);
        assert!(m.insert_range(4 * C, 4 * C));
        assert!(m.insert_range(u64::MAX - 3, u64::MAX - 5));
        assert_eq!(m.entries(), 0);
        assert_eq!(m.end(), 0);
    }

    /// Tables of any size cost one entry: 65,536 ranges of 32 MiB each.
    #[test]
    fn huge_tables_cost_one_entry_each() {
        let mut m = MetadataMap::new(C);
        let l1 = 32u64 << 20;
        for i in 0..65_536u64 {
            assert!(m.insert_range(C + i * l1, C + (i + 1) * l1));
        }
        assert_eq!(m.entries(), 65_536);
        assert!(m.contains(C + 70_000 * C));
    }
}
