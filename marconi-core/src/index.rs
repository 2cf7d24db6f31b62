//! The eviction index: finds the candidate of lowest utility without
//! rescanning the candidates.
//!
//! Utility (paper §4.2, eq. 2) is `norm(recency) + α · norm(efficiency)`, each
//! min-max normalised over the current candidates. Candidates sit in the
//! leaves of a segment tree (in insertion order, which is close to time
//! order) whose inner nodes keep the min and max of both keys below them.
//! The root gives the normalisation bounds in O(1); the minimum is found by
//! branch and bound: a subtree's utility is at least `norm(min time) +
//! α · norm(min efficiency)`, so subtrees whose bound exceeds the best leaf
//! seen are skipped. Inserting and removing cost O(log n); a search visits
//! O(log n) subtrees when the keys are spread and degrades gracefully (never
//! beyond O(n)) when they are adversarially interleaved. The public
//! prototype rescans every candidate, walking to the root for each, for every
//! evicted node.

use crate::tree::NodeId;

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

/// Min and max of both keys over a subtree.
#[derive(Clone, Copy, Debug)]
struct Agg {
    t_lo: u64,
    t_hi: u64,
    e_lo: f64,
    e_hi: f64,
}

const EMPTY: Agg = Agg {
    t_lo: u64::MAX,
    t_hi: 0,
    e_lo: f64::INFINITY,
    e_hi: f64::NEG_INFINITY,
};

impl Agg {
    fn join(a: Agg, b: Agg) -> Agg {
        Agg {
            t_lo: a.t_lo.min(b.t_lo),
            t_hi: a.t_hi.max(b.t_hi),
            e_lo: a.e_lo.min(b.e_lo),
            e_hi: a.e_hi.max(b.e_hi),
        }
    }

    fn is_empty(&self) -> bool {
        self.t_lo > self.t_hi
    }
}

#[derive(Clone, Debug, Default)]
pub(crate) struct Index {
    /// Leaf count of the segment tree (a power of two, or 0).
    cap: usize,
    /// Segment tree, 1-based: node `i` has children `2i`, `2i+1`; leaves at `cap..2cap`.
    agg: Vec<Agg>,
    /// What each leaf holds.
    slots: Vec<Option<(NodeId, CandKey)>>,
    /// Next leaf to fill.
    next: usize,
    /// Leaf of each indexed node (by node id), `usize::MAX` if none.
    pos_of: Vec<usize>,
    live: usize,
}

fn norm(x: f64, lo: f64, hi: f64) -> f64 {
    if hi > lo {
        (x - lo) / (hi - lo)
    } else {
        0.0
    }
}

impl Index {
    fn leaf_agg(k: CandKey) -> Agg {
        Agg {
            t_lo: k.time,
            t_hi: k.time,
            e_lo: k.eff,
            e_hi: k.eff,
        }
    }

    fn set_leaf(&mut self, pos: usize, v: Option<(NodeId, CandKey)>) {
        self.slots[pos] = v;
        let mut i = pos + self.cap;
        self.agg[i] = v.map_or(EMPTY, |(_, k)| Self::leaf_agg(k));
        while i > 1 {
            i /= 2;
            self.agg[i] = Agg::join(self.agg[2 * i], self.agg[2 * i + 1]);
        }
    }

    /// Repacks the live entries at the front, growing the tree if more than
    /// half full. O(n), amortised over the inserts that filled it.
    fn rebuild(&mut self) {
        let live: Vec<(NodeId, CandKey)> = self.slots.iter().flatten().copied().collect();
        self.cap = (2 * live.len()).max(64).next_power_of_two();
        self.agg = vec![EMPTY; 2 * self.cap];
        self.slots = vec![None; self.cap];
        for (pos, &(id, k)) in live.iter().enumerate() {
            self.slots[pos] = Some((id, k));
            self.agg[self.cap + pos] = Self::leaf_agg(k);
            self.pos_of[id as usize] = pos;
        }
        for i in (1..self.cap).rev() {
            self.agg[i] = Agg::join(self.agg[2 * i], self.agg[2 * i + 1]);
        }
        self.next = live.len();
    }

    pub(crate) fn insert(&mut self, id: NodeId, k: CandKey) {
        if self.next == self.cap {
            self.rebuild();
        }
        if self.pos_of.len() <= id as usize {
            self.pos_of.resize(id as usize + 1, usize::MAX);
        }
        debug_assert_eq!(
            self.pos_of[id as usize],
            usize::MAX,
            "node {id} indexed twice"
        );
        let pos = self.next;
        self.next += 1;
        self.pos_of[id as usize] = pos;
        self.set_leaf(pos, Some((id, k)));
        self.live += 1;
    }

    pub(crate) fn remove(&mut self, id: NodeId, k: CandKey) {
        let pos = self.pos_of[id as usize];
        debug_assert_eq!(
            self.slots[pos].map(|(i, kk)| (i, kk.time)),
            Some((id, k.time))
        );
        self.pos_of[id as usize] = usize::MAX;
        self.set_leaf(pos, None);
        self.live -= 1;
    }

    pub(crate) fn len(&self) -> usize {
        self.live
    }

    pub(crate) fn clear(&mut self) {
        *self = Index::default();
    }

    /// The candidate with the lowest utility; ties go to the older access,
    /// then the lower node id (as a full rescan would choose).
    pub(crate) fn lowest(&self, alpha: f64) -> Option<Choice> {
        if self.live == 0 {
            return None;
        }
        let root = self.agg[1];
        let (t_lo, t_hi) = (root.t_lo as f64, root.t_hi as f64);
        let score = |t: u64, e: f64| {
            let r = norm(t as f64, t_lo, t_hi);
            let f = norm(e, root.e_lo, root.e_hi);
            (r, f, r + alpha * f)
        };
        let bound = |a: &Agg| score(a.t_lo, a.e_lo).2;
        // Best so far: (utility, time, node id) and its scores.
        let mut best: Option<(f64, u64, NodeId, Choice)> = None;
        let mut stack = vec![1usize];
        while let Some(i) = stack.pop() {
            let a = self.agg[i];
            if a.is_empty() || best.is_some_and(|b| bound(&a) > b.0) {
                continue;
            }
            if i >= self.cap {
                let (id, k) = self.slots[i - self.cap].expect("non-empty leaf");
                let (recency, efficiency, utility) = score(k.time, k.eff);
                let better = best.is_none_or(|b| {
                    utility
                        .total_cmp(&b.0)
                        .then(k.time.cmp(&b.1))
                        .then(id.cmp(&b.2))
                        .is_lt()
                });
                if better {
                    let c = Choice {
                        node: id,
                        recency,
                        efficiency,
                        utility,
                    };
                    best = Some((utility, k.time, id, c));
                }
                continue;
            }
            // Visit the child with the lower bound first (pushed last).
            let (l, r) = (2 * i, 2 * i + 1);
            let (bl, br) = (bound(&self.agg[l]), bound(&self.agg[r]));
            if bl <= br {
                stack.push(r);
                stack.push(l);
            } else {
                stack.push(l);
                stack.push(r);
            }
        }
        best.map(|b| b.3)
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

    proptest! {
        #[test]
        fn threshold_search_equals_a_full_rescan(
            points in prop::collection::vec((0u64..50, 0u32..40, 0u8..2), 1..200),
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
            // Refreshed candidates come back later with a newer time.
            let mut points = points;
            for (i, p) in points.iter_mut().enumerate() {
                if !live[i] && i % 2 == 0 {
                    p.0 += 100;
                    idx.insert(i as NodeId, CandKey { time: p.0, eff: p.1 });
                    live[i] = true;
                }
            }
            let remaining: Vec<(u64, f64, u8)> =
                points.iter().zip(&live).filter(|p| *p.1).map(|p| *p.0).collect();
            let ids: Vec<usize> = (0..points.len()).filter(|&i| live[i]).collect();
            let want = brute(&remaining, alpha).map(|k| ids[k as usize] as NodeId);
            let got = idx.lowest(alpha).map(|c| c.node);
            prop_assert_eq!(got, want);
        }
    }
}
