//! Marconi's judicious admission (paper §4.1).

use super::{round_down, Admission, PlanInput};
use crate::log::PlanReason;

/// Marconi's judicious admission (paper §4.1): before prefill, a
/// speculative insertion of the input finds whether it would create a
/// branch node (a "purely input" prefix shared with an earlier request); if
/// so, one checkpoint is planned there, rounded down to the checkpoint grid
/// when it lies inside the prefill (§4.1 "Obtaining states during
/// prefill"). The state after the last decoded token (the "input and
/// output" prefix a conversation's next turn extends) is always
/// admissible. At most two new states per request.
///
/// A shared prefix is reused from its third occurrence on (the second
/// identifies it), a cost the paper accepts (§4.1 "Tradeoffs"). Not useful
/// for attention-only models, whose every KV prefix is reusable without
/// states; and for workloads that branch at unpredictable points of long
/// documents, finer checkpoints may hit more if memory allows.
///
/// Beyond the paper, no branch checkpoint is planned shallower than
/// `min_branch_depth` tokens ([`crate::CacheConfig::min_branch_depth`]): the
/// first token or two that unrelated prompts share is not a shared prompt,
/// and a state there costs a whole state's bytes to save a few tokens.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Marconi {
    /// The shallowest branch checkpoint planned, in tokens.
    pub(crate) min_branch_depth: u32,
}

impl Admission for Marconi {
    fn plan(&self, input: &PlanInput<'_>) -> Option<(Vec<u32>, PlanReason)> {
        let w = input.walk?;
        let (len, hit) = (input.len, input.hit);
        let m = w.matched;
        if m == 0 {
            return None;
        }
        let (pos, reason) = match w.partial {
            // The input ends inside a cached edge: the branch is the end of
            // the prompt, where the state after prefill is exact even for
            // chunked-state kernels.
            Some(_) if m == len => (round_down(len, input.page_size), PlanReason::PromptEnd),
            // The input diverges inside an edge: a new branch node at m.
            Some(_) => (round_down(m, input.inner_grid), PlanReason::NewBranch),
            None => {
                let &last = w.path.last()?;
                let n = input.tree.node(last);
                if m == len || n.children.is_empty() || n.state.is_some() {
                    // Input fully cached as a node, or a plain extension of a
                    // leaf (a conversation's next turn: the final state covers it).
                    return None;
                }
                (round_down(m, input.inner_grid), PlanReason::ExistingBranch)
            }
        };
        if reason != PlanReason::PromptEnd && pos < self.min_branch_depth {
            return None;
        }
        (pos > hit && pos > 0 && !input.state_depths.contains(&pos)).then(|| (vec![pos], reason))
    }

    fn admissible(&self, position: u32, plan: &[u32], aligned: u32) -> bool {
        plan.contains(&position) || position == aligned
    }

    fn describe_admissible(&self, plan: &[u32], aligned: u32) -> String {
        format!("planned {plan:?} or the final position {aligned}")
    }

    fn states_to_save(&self, plan: &[u32], _hit: u32, _len: u32, aligned: u32) -> Vec<u32> {
        let mut v = plan.to_vec();
        if aligned > 0 && !plan.contains(&aligned) {
            v.push(aligned);
        }
        v
    }
}
