//! Marconi's FLOP-aware eviction (paper §4.2–4.3, Appendix A).

use super::{Eviction, HitRefresh};
use crate::tree::Node;

/// Marconi's FLOP-aware eviction: the candidate of lowest
/// `norm(recency) + α · norm(flop_efficiency)` goes first (paper §4.2,
/// eq. 2; FLOP efficiency is prefill FLOPs saved per byte, Appendix A),
/// with α tuned online ("Managing the balance", §4.2).
///
/// Candidates are leaves and, per §4.3 (1), nodes with one child that hold a
/// state: evicting those frees the state and merges the edge into the child.
/// A hit refreshes only the node used (§4.3 (2)). Beyond the paper,
/// `protect_branch_states` keeps a node that has ever had two children (a
/// shared prompt) at least `min_branch_depth` tokens deep out of the merge
/// candidates until it is a leaf; a shallower branch point (the first word
/// or two of unrelated prompts, which a real tokenizer makes common) is a
/// merge candidate as in the paper. Also beyond the paper,
/// `superseded_age` moves a superseded state's last access back (a hit
/// that its request then extends; [`crate::CacheConfig::superseded_age`]).
///
/// Do not use it for attention-only models (every entry has about the same
/// efficiency: it only adds cost over [`super::Lru`]), nor when α cannot be
/// tuned and the workload is unknown: a wrong fixed α can do worse than LRU,
/// which tuning guards against by comparing with α = 0.
#[derive(Clone, Copy, Debug)]
pub(crate) struct FlopAware {
    /// See [`crate::CacheConfig::protect_branch_states`].
    pub(crate) protect_branch_states: bool,
    /// See [`crate::CacheConfig::min_branch_depth`].
    pub(crate) min_branch_depth: u32,
    /// See [`crate::CacheConfig::superseded_age`].
    pub(crate) superseded_age: f64,
}

impl Eviction for FlopAware {
    fn is_candidate(&self, node: &Node) -> bool {
        node.children.is_empty()
            || (node.children.len() == 1
                && node.state.is_some()
                && !(self.protect_branch_states
                    && node.was_branch
                    && node.depth >= self.min_branch_depth))
    }

    fn alpha(&self, tuned: f64) -> f64 {
        tuned
    }

    fn on_hit(&self) -> HitRefresh {
        HitRefresh::HitNode
    }

    fn superseded_age(&self) -> f64 {
        self.superseded_age
    }

    fn tunes_alpha(&self) -> bool {
        true
    }
}
