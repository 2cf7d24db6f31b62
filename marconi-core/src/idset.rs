//! A set of engine ids (KV page ids): which pages the cache owns.
//!
//! An admission of a 10,000-token request checks and records 10,000 page
//! ids, and an eviction forgets as many; with a `HashSet<u32>` (SipHash) that
//! was most of an admission's cost. Engines number their pages densely from
//! 0 (an index into their KV pool), so ids below [`DENSE_LIMIT`] are bits in
//! a bitmap (one bit test per id, the bitmap as long as the largest id seen)
//! and only larger ids, which a dense pool never hands out, go to a hash set.

use std::collections::HashSet;

/// Ids below this are bits in the bitmap: at most 8 MiB of bitmap, for
/// pools of up to 64 Mi pages.
pub(crate) const DENSE_LIMIT: u32 = 1 << 26;

/// A set of `u32` ids, cheap for ids below [`DENSE_LIMIT`].
#[derive(Clone, Debug, Default)]
pub(crate) struct IdSet {
    /// Bit `id % 64` of word `id / 64` is set iff `id` is in the set
    /// (ids below [`DENSE_LIMIT`]).
    bits: Vec<u64>,
    /// Ids at or above [`DENSE_LIMIT`].
    sparse: HashSet<u32>,
    len: usize,
}

impl IdSet {
    /// Whether `id` is in the set.
    pub(crate) fn contains(&self, id: u32) -> bool {
        if id < DENSE_LIMIT {
            let (w, b) = (id as usize / 64, id % 64);
            self.bits.get(w).is_some_and(|word| word & (1 << b) != 0)
        } else {
            self.sparse.contains(&id)
        }
    }

    /// Adds `id`; false if it was there already.
    pub(crate) fn insert(&mut self, id: u32) -> bool {
        let added = if id < DENSE_LIMIT {
            let (w, b) = (id as usize / 64, id % 64);
            if w >= self.bits.len() {
                // Doubling keeps the growth amortised O(1) per id.
                let len = (w + 1).next_power_of_two().max(self.bits.len() * 2);
                self.bits.resize(len.min(DENSE_LIMIT as usize / 64), 0);
            }
            let word = &mut self.bits[w];
            let added = *word & (1 << b) == 0;
            *word |= 1 << b;
            added
        } else {
            self.sparse.insert(id)
        };
        self.len += usize::from(added);
        added
    }

    /// Removes `id`; false if it was not there.
    pub(crate) fn remove(&mut self, id: u32) -> bool {
        let removed = if id < DENSE_LIMIT {
            let (w, b) = (id as usize / 64, id % 64);
            match self.bits.get_mut(w) {
                Some(word) if *word & (1 << b) != 0 => {
                    *word &= !(1 << b);
                    true
                }
                _ => false,
            }
        } else {
            self.sparse.remove(&id)
        };
        self.len -= usize::from(removed);
        removed
    }

    /// Adds every id of `ids`.
    pub(crate) fn extend(&mut self, ids: impl IntoIterator<Item = u32>) {
        for id in ids {
            self.insert(id);
        }
    }

    /// Empties the set (keeping the bitmap's memory, zeroed again as it
    /// grows back).
    pub(crate) fn clear(&mut self) {
        self.bits.clear();
        self.sparse.clear();
        self.len = 0;
    }

    /// The number of ids in the set.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.len
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// The set answers as a HashSet does, for ids on both sides of
        /// DENSE_LIMIT.
        #[test]
        fn behaves_as_a_hash_set(ops in proptest::collection::vec(
            (0u8..3, prop_oneof![0u32..300, (DENSE_LIMIT - 70)..(DENSE_LIMIT + 70), Just(u32::MAX)]),
            0..200,
        )) {
            let mut set = IdSet::default();
            let mut model = HashSet::new();
            for (op, id) in ops {
                match op {
                    0 => prop_assert_eq!(set.insert(id), model.insert(id)),
                    1 => prop_assert_eq!(set.remove(id), model.remove(&id)),
                    _ => {
                        set.clear();
                        model.clear();
                    }
                }
                prop_assert_eq!(set.len(), model.len());
                for probe in [id, id.wrapping_add(1), id.wrapping_sub(1), 0, DENSE_LIMIT - 1, DENSE_LIMIT] {
                    prop_assert_eq!(set.contains(probe), model.contains(&probe), "id {}", probe);
                }
            }
        }
    }

    #[test]
    fn the_bitmap_stops_at_the_dense_limit() {
        let mut set = IdSet::default();
        assert!(set.insert(DENSE_LIMIT - 1));
        assert!(set.insert(DENSE_LIMIT));
        assert_eq!(set.bits.len(), DENSE_LIMIT as usize / 64);
        assert_eq!(set.sparse.len(), 1);
        assert!(set.contains(DENSE_LIMIT - 1) && set.contains(DENSE_LIMIT));
        assert!(!set.insert(DENSE_LIMIT - 1));
        assert_eq!(set.len(), 2);
    }
}
