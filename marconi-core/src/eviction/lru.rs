//! Least recently used leaf first: the SGLang+ baseline (paper §5.1).

use super::{Eviction, HitRefresh};
use crate::tree::Node;

/// Least recently used leaf first, a hit refreshing the whole matched path
/// as SGLang's radix cache does (the SGLang+ baseline of paper §5.1; the
/// α = 0 end of eq. 2 in §4.2).
///
/// Only leaves are candidates, so an intermediate state stays until every
/// branch below it is gone. Blind to the cost of what it evicts: a 30 MB
/// state that saves a short prefix goes after a small KV edge of the same
/// age that saves a long one. Do not use it for hybrid models when memory
/// is contended (that is [`super::FlopAware`]'s case); it is the baseline,
/// and the right choice for attention-only models, whose entries all have
/// about the same FLOP efficiency.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Lru;

impl Eviction for Lru {
    fn is_candidate(&self, node: &Node) -> bool {
        node.children.is_empty()
    }

    fn alpha(&self, _tuned: f64) -> f64 {
        0.0
    }

    fn on_hit(&self) -> HitRefresh {
        HitRefresh::Path
    }

    fn tunes_alpha(&self) -> bool {
        false
    }
}
