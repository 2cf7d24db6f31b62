//! The eviction index: candidates sorted by last access and by FLOP
//! efficiency, so that the lowest utility is found without rescanning.
//!
//! Utility (paper §4.2, eq. 2) is `norm(recency) + α · norm(efficiency)`, each
//! min-max normalised over the current candidates. Because both terms are
//! monotone in their key, the minimum is found with Fagin's threshold
//! algorithm over the two sorted orders: walk both from their low ends; once
//! the score built from the two current keys exceeds the best full score
//! seen, no unseen candidate can do better. On real trees this stops after a
//! handful of steps, so one eviction costs `O(log n)` in practice (`O(n)` in
//! the adversarial worst case), against the prototype's `O(n · depth)`
//! rescan per evicted node.

use std::collections::BTreeSet;

use crate::tree::NodeId;

/// A total order over finite non-negative f64 (efficiencies are never NaN).
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

/// The victim chosen, with the scores that chose it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Choice {
    pub(crate) node: NodeId,
    pub(crate) recency: f64,
    pub(crate) efficiency: f64,
    pub(crate) utility: f64,
}

/// Where a candidate sits in the index; stored on the node so it can be removed.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct CandKey {
    pub(crate) time: u64,
    pub(crate) eff: f64,
    /// 0: leaf, 1: inner node with one child. Leaves and inner nodes form two
    /// clusters (inner nodes free only a state, so they are FLOP-dense, and
    /// they are older than the leaf below them); searching each class apart
    /// keeps the threshold algorithm short where the clusters are
    /// anti-correlated.
    pub(crate) class: u8,
}

#[derive(Clone, Debug, Default)]
struct Class {
    by_time: BTreeSet<(u64, NodeId)>,
    by_eff: BTreeSet<(Key, NodeId)>,
}

#[derive(Clone, Debug, Default)]
pub(crate) struct Index {
    classes: [Class; 2],
}

fn norm(x: f64, lo: f64, hi: f64) -> f64 {
    if hi > lo {
        (x - lo) / (hi - lo)
    } else {
        0.0
    }
}

impl Index {
    pub(crate) fn insert(&mut self, id: NodeId, k: CandKey) {
        let c = &mut self.classes[usize::from(k.class)];
        c.by_time.insert((k.time, id));
        c.by_eff.insert((Key(k.eff), id));
    }

    pub(crate) fn remove(&mut self, id: NodeId, k: CandKey) {
        let c = &mut self.classes[usize::from(k.class)];
        c.by_time.remove(&(k.time, id));
        c.by_eff.remove(&(Key(k.eff), id));
    }

    pub(crate) fn len(&self) -> usize {
        self.classes.iter().map(|c| c.by_time.len()).sum()
    }

    pub(crate) fn clear(&mut self) {
        self.classes = Default::default();
    }

    /// The candidate with the lowest utility; ties go to the older access,
    /// then the lower node id. `key_of` gives a node's keys.
    pub(crate) fn lowest(&self, alpha: f64, key_of: impl Fn(NodeId) -> CandKey) -> Option<Choice> {
        let live = self.classes.iter().filter(|c| !c.by_time.is_empty());
        let (mut t_lo, mut t_hi, mut e_lo, mut e_hi) = (u64::MAX, 0u64, f64::INFINITY, 0f64);
        let mut any = false;
        for c in live {
            any = true;
            t_lo = t_lo.min(c.by_time.first()?.0);
            t_hi = t_hi.max(c.by_time.last()?.0);
            e_lo = e_lo.min(c.by_eff.first()?.0 .0);
            e_hi = e_hi.max(c.by_eff.last()?.0 .0);
        }
        if !any {
            return None;
        }
        let (t_lo, t_hi) = (t_lo as f64, t_hi as f64);
        let score = |t: u64, e: f64| {
            let r = norm(t as f64, t_lo, t_hi);
            let f = norm(e, e_lo, e_hi);
            (r, f, r + alpha * f)
        };
        let choice = |id: NodeId, t: u64, e: f64| {
            let (recency, efficiency, utility) = score(t, e);
            Choice {
                node: id,
                recency,
                efficiency,
                utility,
            }
        };
        let better = |a: &Choice, b: &Choice| {
            a.utility
                .total_cmp(&b.utility)
                .then_with(|| key_of(a.node).time.cmp(&key_of(b.node).time))
                .then_with(|| a.node.cmp(&b.node))
                .is_lt()
        };
        let mut best: Option<Choice> = None;
        let mut offer = |c: Choice| {
            if best.is_none_or(|b| better(&c, &b)) {
                best = Some(c);
            }
        };
        for class in &self.classes {
            if alpha == 0.0 {
                // Pure LRU: the oldest access wins, exactly.
                if let Some(&(t, id)) = class.by_time.first() {
                    offer(choice(id, t, key_of(id).eff));
                }
                continue;
            }
            // Fagin's threshold algorithm within the class.
            let mut class_best: Option<Choice> = None;
            let mut it_t = class.by_time.iter();
            let mut it_e = class.by_eff.iter();
            let (mut t_cur, mut e_cur) = (None, None);
            loop {
                let nt = it_t.next();
                let ne = it_e.next();
                if nt.is_none() && ne.is_none() {
                    break;
                }
                for c in [
                    nt.map(|&(t, id)| {
                        t_cur = Some(t);
                        choice(id, t, key_of(id).eff)
                    }),
                    ne.map(|&(Key(e), id)| {
                        e_cur = Some(e);
                        choice(id, key_of(id).time, e)
                    }),
                ]
                .into_iter()
                .flatten()
                {
                    if class_best.is_none_or(|b| better(&c, &b)) {
                        class_best = Some(c);
                    }
                }
                if let (Some(t), Some(e), Some(b)) = (t_cur, e_cur, class_best) {
                    // Every unseen candidate of the class has time >= t and
                    // efficiency >= e.
                    if score(t, e).2 > b.utility {
                        break;
                    }
                }
            }
            if let Some(c) = class_best {
                offer(c);
            }
        }
        best
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
            let key = |i: usize| CandKey { time: points[i].0, eff: points[i].1, class: points[i].2 };
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
            let remaining: Vec<(u64, f64, u8)> =
                points.iter().zip(&live).filter(|p| *p.1).map(|p| *p.0).collect();
            let ids: Vec<usize> = (0..points.len()).filter(|&i| live[i]).collect();
            let want = brute(&remaining, alpha).map(|k| ids[k as usize] as NodeId);
            let got = idx.lowest(alpha, |id| key(id as usize)).map(|c| c.node);
            prop_assert_eq!(got, want);
        }
    }
}
