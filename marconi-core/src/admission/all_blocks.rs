//! A state at every block boundary: the vLLM+ baseline (paper §5.1).

use super::{Admission, PlanInput};
use crate::log::PlanReason;

/// A state at every block boundary past the hit (the vLLM+ baseline of
/// paper §5.1: vLLM's block-granular prefix caching extended to hybrid
/// models, the fine-grained checkpointing §4.1 argues against).
///
/// Every prefix at a block boundary becomes reusable, at the price of one
/// state per block: for a 7B hybrid a state is tens of MB, so the cache
/// fills with large, rarely hit states and evicts useful entries. A
/// baseline, not a policy to deploy; it can make sense only for small
/// states and plentiful memory.
#[derive(Clone, Copy, Debug)]
pub(crate) struct AllBlocks {
    /// Tokens per block: a positive multiple of the page size (checked by
    /// [`crate::CacheConfig::validate`]).
    pub(crate) block_size: u32,
}

impl Admission for AllBlocks {
    fn plan(&self, input: &PlanInput<'_>) -> Option<(Vec<u32>, PlanReason)> {
        let plan: Vec<u32> = block_positions(input.hit, self.block_size, input.len)
            .filter(|p| !input.state_depths.contains(p))
            .collect();
        (!plan.is_empty()).then_some((plan, PlanReason::Blocks))
    }

    // A planned position off the block grid is an application checkpoint
    // (`PrefixCache::lookup_hinted`); this policy's own plan holds block
    // boundaries only. The final state (the admitted length rounded down to
    // the page size) is admissible under every policy that keeps states,
    // also where the block is larger than the page and the final position
    // falls between two block boundaries.
    fn admissible(&self, position: u32, plan: &[u32], aligned: u32) -> bool {
        position % self.block_size == 0 || position == aligned || plan.contains(&position)
    }

    fn describe_admissible(&self, plan: &[u32], aligned: u32) -> String {
        let hinted: Vec<u32> = plan
            .iter()
            .copied()
            .filter(|p| p % self.block_size != 0)
            .collect();
        if hinted.is_empty() {
            format!(
                "multiples of the block size {} or the final position {aligned}",
                self.block_size
            )
        } else {
            format!(
                "multiples of the block size {}, the application checkpoints {hinted:?} \
                 or the final position {aligned}",
                self.block_size
            )
        }
    }

    fn states_to_save(&self, plan: &[u32], hit: u32, len: u32, _aligned: u32) -> Vec<u32> {
        let mut v: Vec<u32> = block_positions(hit, self.block_size, len).collect();
        let before = v.len();
        v.extend(plan.iter().copied().filter(|p| p % self.block_size != 0));
        if v.len() > before {
            v.sort_unstable();
        }
        v
    }
}

/// The block boundaries past `hit` up to `len` (`block`, `2·block`, …),
/// counted in u64 so that no multiple wraps near 2^32.
fn block_positions(hit: u32, block: u32, len: u32) -> impl Iterator<Item = u32> {
    let block = u64::from(block.max(1));
    let first = (u64::from(hit) / block + 1) * block;
    (first..=u64::from(len))
        .step_by(usize::try_from(block).unwrap_or(usize::MAX))
        // Every position is at most `len`, a u32.
        .map(|p| u32::try_from(p).unwrap_or(u32::MAX))
}
