//! The eviction index: finds the candidate of lowest utility without
//! rescanning the candidates.
//!
//! Utility (paper §4.2, eq. 2) is `norm(recency) + α · norm(efficiency)`, each
//! min-max normalised over the current candidates. Candidates are kept in
//! one global ordered set by efficiency (the efficiency bounds) and in a few
//! buckets by efficiency (quantiles fixed at the last rebuild), each ordered
//! by last access (the time bounds are the buckets' ends). Within a bucket
//! the efficiency range is narrow, so its oldest entries are its best: a
//! search walks each bucket from its oldest entry and stops as soon as
//! `norm(time) + α · norm(bucket's lower cut)` exceeds the best utility
//! found, which is a lower bound for everything left in the bucket. The
//! result is exact (the victim a full rescan would pick, checked by a
//! property test); a search costs about `BUCKETS` ordered-set steps whatever
//! the number of candidates (a few dozen entries at α = 0.5 on the
//! decision-latency workload; one at α = 0), and an insert or a removal two
//! ordered-set operations, O(log n): every pin, release and admission pays
//! them for each node whose candidacy changes, so they are kept to two. The
//! public prototype rescans every candidate, walking to the root for each,
//! for every evicted node.

use std::collections::BTreeSet;

use crate::tree::NodeId;

/// Efficiency buckets.
const BUCKETS: usize = 32;

/// A total order over f64 (efficiencies are never NaN).
#[derive(Clone, Copy, Debug)]
struct Key(f64);
impl PartialEq for Key {
    fn eq(&self, other: &Self) -> bool {
        self.0.total_cmp(&other.0).is_eq()
    }
}
impl Eq for Key {}
impl PartialOrd for Key {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Key {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.0.total_cmp(&other.0)
    }
}

/// Where a candidate sits in the index; stored on the node so it can be removed.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct CandKey {
    pub(crate) time: u64,
    pub(crate) eff: f64,
}

/// The victim chosen, with the scores that chose it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Choice {
    pub(crate) node: NodeId,
    pub(crate) recency: f64,
    pub(crate) efficiency: f64,
    pub(crate) utility: f64,
}

/// A bucket: its candidates ordered by last access. Its lowest efficiency
/// is bounded below by its lower cut (no ordered set by efficiency per
/// bucket: a looser bound costs a search a few more steps, a second set
/// would cost every insert and removal two more ordered-set operations).
type Bucket = BTreeSet<Entry>;

/// A bucket's entry: last access, node.
type Entry = (u64, NodeId);

#[derive(Clone, Debug, Default)]
pub(crate) struct Index {
    /// Every candidate by efficiency: the normalisation bounds, and the
    /// quantiles a rebuild cuts at.
    by_eff: BTreeSet<(Key, NodeId)>,
    /// Upper bounds of the buckets but the last (ascending): bucket `b`
    /// holds efficiencies in `[cuts[b - 1], cuts[b])`.
    cuts: Vec<f64>,
    buckets: Vec<Bucket>,
    /// The first and last entry of each bucket (`None` when empty), kept
    /// beside the sets: a search reads this one array instead of descending
    /// into every bucket's set for its ends (two descents per bucket, each
    /// a few cache lines: most of a search's memory traffic, and what makes
    /// an eviction slow on a cold cache).
    ends: Vec<Option<(Entry, Entry)>>,
    /// The lowest and highest entries by efficiency (the normalisation
    /// bounds), kept as `ends` is.
    eff_ends: Option<((Key, NodeId), (Key, NodeId))>,
    /// Bucket of each indexed node, by node id.
    bucket_of: Vec<u8>,
    /// Candidate count at the last rebuild.
    built_at: usize,
}

fn norm(x: f64, lo: f64, hi: f64) -> f64 {
    if hi > lo {
        (x - lo) / (hi - lo)
    } else {
        0.0
    }
}

impl Index {
    fn bucket_for(&self, eff: f64) -> usize {
        self.cuts.partition_point(|&c| c <= eff)
    }

    /// Inserts into bucket `b`'s set, extending its ends.
    fn bucket_insert(&mut self, b: usize, e: Entry) {
        self.buckets[b].insert(e);
        self.ends[b] = Some(match self.ends[b] {
            None => (e, e),
            Some((first, last)) => (first.min(e), last.max(e)),
        });
    }

    /// Removes from bucket `b`'s set; its ends are read again from the set
    /// only when the entry was one of them.
    fn bucket_remove(&mut self, b: usize, e: Entry) {
        let set = &mut self.buckets[b];
        set.remove(&e);
        if self.ends[b].is_some_and(|(first, last)| e == first || e == last) {
            self.ends[b] = set.first().copied().zip(set.last().copied());
        }
    }

    fn eff_insert(&mut self, e: (Key, NodeId)) {
        self.by_eff.insert(e);
        self.eff_ends = Some(match self.eff_ends {
            None => (e, e),
            Some((lo, hi)) => (lo.min(e), hi.max(e)),
        });
    }

    fn eff_remove(&mut self, e: (Key, NodeId)) {
        self.by_eff.remove(&e);
        if self.eff_ends.is_some_and(|(lo, hi)| e == lo || e == hi) {
            self.eff_ends = self
                .by_eff
                .first()
                .copied()
                .zip(self.by_eff.last().copied());
        }
    }

    /// Two ordered-set insertions (the global set by efficiency, the
    /// bucket's set by time), O(log n); now and then a rebuild, amortised.
    pub(crate) fn insert(&mut self, id: NodeId, k: CandKey) {
        self.eff_insert((Key(k.eff), id));
        if self.bucket_of.len() <= id as usize {
            self.bucket_of.resize(id as usize + 1, 0);
        }
        let n = self.by_eff.len();
        // Re-cut the buckets when the count doubled or fell to a quarter.
        if self.buckets.is_empty() || n > 2 * self.built_at.max(32) || 4 * n < self.built_at {
            self.rebuild_with(id, k);
            return;
        }
        let b = self.bucket_for(k.eff);
        self.bucket_insert(b, (k.time, id));
        self.bucket_of[id as usize] = b as u8;
    }

    /// Re-cuts the buckets at the efficiency quantiles of the current
    /// candidates, knowing the keys of the node just inserted (the others'
    /// times are read from the buckets they sit in). O(n log n), amortised
    /// over the inserts since the last rebuild.
    fn rebuild_with(&mut self, id: NodeId, k: CandKey) {
        let mut times: Vec<(NodeId, u64)> = Vec::with_capacity(self.by_eff.len());
        for b in &self.buckets {
            times.extend(b.iter().map(|&(t, i)| (i, t)));
        }
        times.push((id, k.time));
        times.sort_unstable();
        let n = self.by_eff.len();
        self.cuts = self
            .by_eff
            .iter()
            .enumerate()
            .filter(|(i, _)| *i > 0 && i * BUCKETS / n != (i - 1) * BUCKETS / n)
            .map(|(_, (Key(e), _))| *e)
            .collect();
        self.cuts.dedup();
        self.buckets = vec![Bucket::default(); self.cuts.len() + 1];
        let entries: Vec<(Key, NodeId)> = self.by_eff.iter().copied().collect();
        for (Key(e), i) in entries {
            let b = self.bucket_for(e);
            let t = times[times.binary_search_by_key(&i, |x| x.0).expect("indexed")].1;
            self.buckets[b].insert((t, i));
            self.bucket_of[i as usize] = b as u8;
        }
        self.ends = self
            .buckets
            .iter()
            .map(|b| b.first().copied().zip(b.last().copied()))
            .collect();
        self.built_at = n;
    }

    /// Two ordered-set removals, O(log n).
    pub(crate) fn remove(&mut self, id: NodeId, k: CandKey) {
        self.eff_remove((Key(k.eff), id));
        self.bucket_remove(usize::from(self.bucket_of[id as usize]), (k.time, id));
    }

    /// Moves `id` from key `old` to key `new`: when the efficiency stays
    /// and so does the bucket (a refreshed access time, the usual change),
    /// one removal and one insertion in the bucket's set only; otherwise
    /// [`remove`](Self::remove) then [`insert`](Self::insert).
    pub(crate) fn update(&mut self, id: NodeId, old: CandKey, new: CandKey) {
        if old.eff.to_bits() == new.eff.to_bits() {
            let b = usize::from(self.bucket_of[id as usize]);
            self.bucket_remove(b, (old.time, id));
            self.bucket_insert(b, (new.time, id));
            return;
        }
        self.remove(id, old);
        self.insert(id, new);
    }

    /// Panics unless the kept ends are the sets' ends (tests).
    #[cfg(test)]
    fn assert_ends(&self) {
        assert_eq!(
            self.eff_ends,
            self.by_eff
                .first()
                .copied()
                .zip(self.by_eff.last().copied())
        );
        assert_eq!(self.ends.len(), self.buckets.len());
        for (b, e) in self.buckets.iter().zip(&self.ends) {
            assert_eq!(*e, b.first().copied().zip(b.last().copied()));
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.by_eff.len()
    }

    pub(crate) fn clear(&mut self) {
        *self = Index::default();
    }

    /// The candidate with the lowest utility; ties go to the older access,
    /// then the lower node id (as a full rescan would choose). `eff_of`
    /// gives an indexed node's efficiency.
    pub(crate) fn lowest(&self, alpha: f64, eff_of: impl Fn(NodeId) -> f64) -> Option<Choice> {
        self.lowest_where(alpha, eff_of, |_| true)
    }

    /// [`lowest`](Self::lowest) among the candidates `accept` keeps (the
    /// normalisation bounds stay those of every candidate, so a kept
    /// candidate scores as it would in an unfiltered search). Each rejected
    /// candidate costs one step of the walk: O(rejected) more than
    /// [`lowest`](Self::lowest).
    pub(crate) fn lowest_where(
        &self,
        alpha: f64,
        eff_of: impl Fn(NodeId) -> f64,
        accept: impl Fn(NodeId) -> bool,
    ) -> Option<Choice> {
        let ((Key(e_lo), _), (Key(e_hi), _)) = self.eff_ends?;
        // The time bounds: the oldest of the buckets' oldest, the newest of
        // their newest (the kept ends: no set is descended).
        let (mut t_lo, mut t_hi) = (u64::MAX, 0u64);
        for &((first, _), (last, _)) in self.ends.iter().flatten() {
            t_lo = t_lo.min(first);
            t_hi = t_hi.max(last);
        }
        let (t_lo, t_hi) = (t_lo as f64, t_hi as f64);
        let score = |t: u64, e: f64| {
            let r = norm(t as f64, t_lo, t_hi);
            let f = norm(e, e_lo, e_hi);
            (r, f, r + alpha * f)
        };
        let choose = |id: NodeId, t: u64, e: f64| {
            let (recency, efficiency, utility) = score(t, e);
            Choice {
                node: id,
                recency,
                efficiency,
                utility,
            }
        };
        if alpha == 0.0 {
            // Pure LRU: the oldest access wins, exactly: the buckets merged
            // in (time, id) order, up to the first accepted candidate.
            let (t, id) = self.oldest_where(&accept)?;
            return Some(choose(id, t, eff_of(id)));
        }
        // The lowest efficiency a bucket can hold: its lower cut (the first
        // bucket's, and any cut below it, the global lowest).
        let e_min = |i: usize| match i {
            0 => e_lo,
            _ => self.cuts[i - 1].max(e_lo),
        };
        // Buckets in order of their lower bound, so a good victim is found early.
        let mut order: Vec<(f64, usize)> = self
            .ends
            .iter()
            .enumerate()
            .filter_map(|(i, e)| {
                let ((t, _), _) = (*e)?;
                Some((score(t, e_min(i)).2, i))
            })
            .collect();
        order.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
        let mut best: Option<(f64, u64, NodeId, Choice)> = None;
        for (lower, i) in order {
            if best.is_some_and(|b| lower > b.0) {
                break;
            }
            let e_min = e_min(i);
            for &(t, id) in &self.buckets[i] {
                // Everything left in the bucket is at least this old.
                if best.is_some_and(|bb| score(t, e_min).2 > bb.0) {
                    break;
                }
                if !accept(id) {
                    continue;
                }
                let c = choose(id, t, eff_of(id));
                let better = best.is_none_or(|bb| {
                    c.utility
                        .total_cmp(&bb.0)
                        .then(t.cmp(&bb.1))
                        .then(id.cmp(&bb.2))
                        .is_lt()
                });
                if better {
                    best = Some((c.utility, t, id, c));
                }
            }
        }
        best.map(|b| b.3)
    }

    /// The accepted candidate of the oldest access (then the lowest id):
    /// the buckets' time orders merged. Unfiltered, the least of the
    /// buckets' first entries; each rejected candidate costs one step.
    fn oldest_where(&self, accept: impl Fn(NodeId) -> bool) -> Option<(u64, NodeId)> {
        use std::cmp::Reverse;
        let oldest = self.ends.iter().flatten().map(|&(first, _)| first).min()?;
        if accept(oldest.1) {
            return Some(oldest);
        }
        let mut iters: Vec<_> = self.buckets.iter().map(|b| b.iter()).collect();
        let mut heads: std::collections::BinaryHeap<Reverse<((u64, NodeId), usize)>> = iters
            .iter_mut()
            .enumerate()
            .filter_map(|(i, it)| it.next().map(|&e| Reverse((e, i))))
            .collect();
        while let Some(Reverse((e, i))) = heads.pop() {
            if accept(e.1) {
                return Some(e);
            }
            if let Some(&next) = iters[i].next() {
                heads.push(Reverse((next, i)));
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The naive rescan the index replaces.
    fn brute(points: &[(u64, f64, u8)], alpha: f64) -> Option<NodeId> {
        let t_lo = points.iter().map(|p| p.0).min()? as f64;
        let t_hi = points.iter().map(|p| p.0).max()? as f64;
        let e_lo = points.iter().map(|p| p.1).fold(f64::INFINITY, f64::min);
        let e_hi = points.iter().map(|p| p.1).fold(0.0, f64::max);
        let u = |p: &(u64, f64, u8)| norm(p.0 as f64, t_lo, t_hi) + alpha * norm(p.1, e_lo, e_hi);
        (0..points.len())
            .min_by(|&a, &b| {
                u(&points[a])
                    .total_cmp(&u(&points[b]))
                    .then(points[a].0.cmp(&points[b].0))
                    .then(a.cmp(&b))
            })
            .map(|i| i as NodeId)
    }

    /// The naive rescan over `kept` (indices into `points`), normalised over
    /// all of `points`.
    fn brute_within(points: &[(u64, f64, u8)], kept: &[usize], alpha: f64) -> Option<usize> {
        let t_lo = points.iter().map(|p| p.0).min()? as f64;
        let t_hi = points.iter().map(|p| p.0).max()? as f64;
        let e_lo = points.iter().map(|p| p.1).fold(f64::INFINITY, f64::min);
        let e_hi = points.iter().map(|p| p.1).fold(0.0, f64::max);
        let u = |p: &(u64, f64, u8)| norm(p.0 as f64, t_lo, t_hi) + alpha * norm(p.1, e_lo, e_hi);
        kept.iter().copied().min_by(|&a, &b| {
            u(&points[a])
                .total_cmp(&u(&points[b]))
                .then(points[a].0.cmp(&points[b].0))
                .then(a.cmp(&b))
        })
    }

    proptest! {
        #[test]
        fn threshold_search_equals_a_full_rescan(
            points in prop::collection::vec((0u64..50, 0u32..400, 0u8..2), 1..400),
            alpha in prop_oneof![Just(0.0), 0.0f64..3.0, Just(100.0)],
            removed in prop::collection::vec(any::<prop::sample::Index>(), 0..20),
        ) {
            let points: Vec<(u64, f64, u8)> =
                points.into_iter().map(|(t, e, c)| (t, f64::from(e) * 0.37, c)).collect();
            let mut idx = Index::default();
            let key = |i: usize| CandKey { time: points[i].0, eff: points[i].1 };
            for i in 0..points.len() {
                idx.insert(i as NodeId, key(i));
            }
            let mut live: Vec<bool> = vec![true; points.len()];
            for r in removed {
                let i = r.index(points.len());
                if live[i] {
                    idx.remove(i as NodeId, key(i));
                    live[i] = false;
                }
            }
            // Refreshed candidates come back later with a newer time; some
            // indexed ones are moved in place (a new time, or a new
            // efficiency too).
            let mut points = points.clone();
            for (i, p) in points.iter_mut().enumerate() {
                if !live[i] && i % 2 == 0 {
                    p.0 += 100;
                    idx.insert(i as NodeId, CandKey { time: p.0, eff: p.1 });
                    live[i] = true;
                } else if live[i] && i % 3 == 0 {
                    let old = CandKey { time: p.0, eff: p.1 };
                    p.0 += 50 + (i as u64 % 7);
                    if i % 2 == 1 {
                        p.1 = f64::from((i * 37 % 400) as u32) * 0.37;
                    }
                    idx.update(i as NodeId, old, CandKey { time: p.0, eff: p.1 });
                }
            }
            idx.assert_ends();
            let remaining: Vec<(u64, f64, u8)> =
                points.iter().zip(&live).filter(|p| *p.1).map(|p| *p.0).collect();
            let ids: Vec<usize> = (0..points.len()).filter(|&i| live[i]).collect();
            let want = brute(&remaining, alpha).map(|k| ids[k as usize] as NodeId);
            let got = idx.lowest(alpha, |id| points[id as usize].1).map(|c| c.node);
            prop_assert_eq!(got, want);
            // Filtered (class 1 only): the brute force over the kept ones,
            // scored with the bounds of every candidate.
            let kept: Vec<usize> = (0..remaining.len()).filter(|&k| remaining[k].2 == 1).collect();
            let want_kept = brute_within(&remaining, &kept, alpha).map(|k| ids[k] as NodeId);
            let got_kept = idx
                .lowest_where(alpha, |id| points[id as usize].1, |id| points[id as usize].2 == 1)
                .map(|c| c.node);
            prop_assert_eq!(got_kept, want_kept);
        }
    }
}
