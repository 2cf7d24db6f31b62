//! The ceiling: a usable state at every position.

use super::{Admission, PlanInput};
use crate::log::PlanReason;

/// The ceiling: every matched position counts as having a state, and no
/// state bytes are charged, so the cache behaves as an attention-only
/// prefix cache (the "oracle" bound of the simulator, not a paper policy;
/// it bounds what §4.1's admission could reach with perfect placement).
///
/// Meaningful only with an unbounded capacity, to measure the best hit
/// rate any policy could reach on a trace; at a real capacity it is not a
/// bound (it charges no state bytes) and says nothing. It accepts no
/// states from the engine.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Oracle;

impl Admission for Oracle {
    fn every_position_usable(&self) -> bool {
        true
    }

    fn plan(&self, _input: &PlanInput<'_>) -> Option<(Vec<u32>, PlanReason)> {
        None
    }

    fn admissible(&self, _position: u32, _plan: &[u32], _aligned: u32) -> bool {
        false
    }

    fn describe_admissible(&self, _plan: &[u32], _aligned: u32) -> String {
        "none: the oracle keeps no states".into()
    }

    fn states_to_save(&self, _plan: &[u32], _hit: u32, _len: u32, _aligned: u32) -> Vec<u32> {
        Vec::new()
    }
}
