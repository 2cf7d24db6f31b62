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

#[derive(Clone, Debug, Default)]
pub(crate) struct Index {
    by_time: BTreeSet<(u64, NodeId)>,
    by_eff: BTreeSet<(Key, NodeId)>,
}

fn norm(x: f64, lo: f64, hi: f64) -> f64 {
    if hi > lo {
        (x - lo) / (hi - lo)
    } else {
        0.0
    }
}

impl Index {
    pub(crate) fn insert(&mut self, id: NodeId, time: u64, eff: f64) {
        self.by_time.insert((time, id));
        self.by_eff.insert((Key(eff), id));
    }

    pub(crate) fn remove(&mut self, id: NodeId, time: u64, eff: f64) {
        self.by_time.remove(&(time, id));
        self.by_eff.remove(&(Key(eff), id));
    }

    pub(crate) fn len(&self) -> usize {
        self.by_time.len()
    }

    pub(crate) fn clear(&mut self) {
        self.by_time.clear();
        self.by_eff.clear();
    }

    /// The candidate with the lowest utility; ties go to the older access,
    /// then the lower node id. `eff_of` / `time_of` give a node's keys.
    pub(crate) fn lowest(
        &self,
        alpha: f64,
        time_of: impl Fn(NodeId) -> u64,
        eff_of: impl Fn(NodeId) -> f64,
    ) -> Option<Choice> {
        let &(t_lo, first) = self.by_time.first()?;
        let &(t_hi, _) = self.by_time.last()?;
        let &(Key(e_lo), _) = self.by_eff.first()?;
        let &(Key(e_hi), _) = self.by_eff.last()?;
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
        if alpha == 0.0 {
            // Pure LRU: the oldest access wins, exactly.
            return Some(choice(first, time_of(first), eff_of(first)));
        }
        let better = |a: &Choice, b: &Choice| {
            a.utility
                .total_cmp(&b.utility)
                .then_with(|| time_of(a.node).cmp(&time_of(b.node)))
                .then_with(|| a.node.cmp(&b.node))
                .is_lt()
        };
        let mut best: Option<Choice> = None;
        let mut it_t = self.by_time.iter();
        let mut it_e = self.by_eff.iter();
        let (mut t_cur, mut e_cur) = (None, None);
        loop {
            let nt = it_t.next();
            let ne = it_e.next();
            if nt.is_none() && ne.is_none() {
                break;
            }
            if let Some(&(t, id)) = nt {
                t_cur = Some(t);
                let c = choice(id, t, eff_of(id));
                if best.is_none_or(|b| better(&c, &b)) {
                    best = Some(c);
                }
            }
            if let Some(&(Key(e), id)) = ne {
                e_cur = Some(e);
                let c = choice(id, time_of(id), e);
                if best.is_none_or(|b| better(&c, &b)) {
                    best = Some(c);
                }
            }
            if let (Some(t), Some(e), Some(b)) = (t_cur, e_cur, best) {
                // Every unseen candidate has time >= t and efficiency >= e.
                if score(t, e).2 > b.utility {
                    break;
                }
            }
        }
        best
    }
}
