//! Which host clusters of the data area are in use: one bit each, from the data offset up to
//! the last cluster in use (not to the end of the file: a sparse file's apparent size costs
//! nothing), grown with the file.

/// Host clusters in use, by index from the data offset.
#[derive(Debug, Default)]
pub(super) struct UsedClusters {
    words: Vec<u64>,
    len: usize,
}

impl UsedClusters {
    /// `len` clusters, none in use.
    pub(super) fn new(len: usize) -> Self {
        UsedClusters {
            words: vec![0; len.div_ceil(64)],
            len,
        }
    }

    pub(super) fn len(&self) -> usize {
        self.len
    }

    /// Is cluster `i` in use? (false past the end)
    pub(super) fn get(&self, i: usize) -> bool {
        i < self.len && self.words[i / 64] & (1 << (i % 64)) != 0
    }

    /// Mark cluster `i` (below [`Self::len`]) in use; false if it was already.
    pub(super) fn set(&mut self, i: usize) -> bool {
        let was = self.get(i);
        self.words[i / 64] |= 1 << (i % 64);
        !was
    }

    /// Mark cluster `i` free (nothing past the end).
    pub(super) fn clear(&mut self, i: usize) {
        if i < self.len {
            self.words[i / 64] &= !(1 << (i % 64));
        }
    }

    /// Cover `len` clusters: new ones free, those past `len` forgotten.
    pub(super) fn resize(&mut self, len: usize) {
        for i in len..self.len.min(len.next_multiple_of(64)) {
            self.clear(i);
        }
        self.words.resize(len.div_ceil(64), 0);
        self.len = len;
    }

    /// The first free cluster at or after `from`.
    pub(super) fn first_free_from(&self, from: usize) -> Option<usize> {
        let mut i = from;
        while i < self.len {
            let w = self.words[i / 64] | ((1u64 << (i % 64)) - 1);
            if w != u64::MAX {
                let found = i / 64 * 64 + w.trailing_ones() as usize;
                return (found < self.len).then_some(found);
            }
            i = (i / 64 + 1) * 64;
        }
        None
    }

    /// The last cluster in use.
    pub(super) fn last_used(&self) -> Option<usize> {
        let (k, w) = self.words.iter().enumerate().rev().find(|(_, &w)| w != 0)?;
        Some(k * 64 + 63 - w.leading_zeros() as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn set_clear_and_search() {
        let mut u = UsedClusters::new(130);
        assert_eq!(u.first_free_from(0), Some(0));
        assert_eq!(u.last_used(), None);
        for i in 0..70 {
            assert!(u.set(i));
        }
        assert!(!u.set(3), "already in use");
        assert_eq!(u.first_free_from(0), Some(70));
        assert_eq!(u.first_free_from(100), Some(100));
        assert!(u.set(129));
        assert_eq!(u.last_used(), Some(129));
        u.clear(5);
        assert_eq!(u.first_free_from(2), Some(5));
        assert_eq!(u.first_free_from(130), None);
        u.clear(1000);
        assert!(!u.get(1000));
    }

    #[test]
    fn a_full_map_has_no_free_cluster() {
        let mut u = UsedClusters::new(64);
        (0..64).for_each(|i| {
            u.set(i);
        });
        assert_eq!(u.first_free_from(0), None);
        u.resize(65);
        assert_eq!(u.first_free_from(0), Some(64));
    }

    #[test]
    fn shrinking_forgets_and_growing_is_free() {
        let mut u = UsedClusters::new(10);
        u.set(8);
        u.set(2);
        u.resize(5);
        assert_eq!(u.last_used(), Some(2));
        u.resize(200);
        assert!(!u.get(8), "a cluster past the old end comes back free");
        assert_eq!(u.first_free_from(3), Some(3));
        assert_eq!(u.len(), 200);
    }
}
