//! State snapshot operations: copy, fork and promote recurrent states between
//! slots of a state arena, as batched orders over `(src, dst)` slot lists.
//!
//! A recurrent (Mamba/SSM) layer overwrites its state in place, so a prefix cache
//! keeps *snapshots*: the state at a checkpoint is copied into a cache slot, and
//! on a hit the cached state is copied into the request's own slot before the
//! request updates it (copy-on-write, as SGLang does). Speculative
//! decoding gives each candidate token its own slot (a *fork* of the request's
//! state into k slots) and, once the verifier accepts a candidate, *promotes* that
//! slot to be the request's state: a handle swap where the engine allows it, a
//! single copy where the engine needs the state at a fixed slot.
//!
//! The semantics live here, once, and each backend only runs validated copy
//! batches ([`SnapshotBackend::copy`]):
//!
//! - [`CopyBatch`] validates a pair list against the arena's slot count:
//!   every slot in range, no pair copying a slot onto itself, no slot written
//!   twice, and no slot both read and written in the same batch. A validated batch
//!   therefore has one result whatever order (or parallelism) the copies run in.
//! - [`StateArena`] is the host backend: slots laid out over one or more byte
//!   *planes* (one per layer, or conv and SSM tensors separately, or everything in
//!   one plane), copied with a parallel memcpy. It sits on any mapped byte region:
//!   a heap buffer, or the mapping of a memfd-backed SSM pool.
//! - The CUDA backend (`cuda::snapshot`, feature `cuda`) runs the same batches as
//!   one kernel launch.

mod host;

pub use host::StateArena;

/// One copy order: the state in slot `src` is copied into slot `dst` (every plane
/// of the arena).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SlotPair {
    /// Slot read.
    pub src: u32,
    /// Slot written.
    pub dst: u32,
}

impl SlotPair {
    /// A copy order from `src` into `dst`.
    pub const fn new(src: u32, dst: u32) -> Self {
        Self { src, dst }
    }
}

/// Why a snapshot operation was refused. Nothing was copied when one is returned.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SnapshotError {
    /// A pair names a slot the arena does not hold.
    #[error("slot {slot} (pair {index}) is out of range: the arena holds {slots} slots")]
    SlotOutOfRange {
        /// Position of the offending pair in the list.
        index: usize,
        /// The slot named.
        slot: u32,
        /// Slots in the arena.
        slots: u32,
    },
    /// A pair copies a slot onto itself.
    #[error("pair {index} copies slot {slot} onto itself")]
    SelfCopy {
        /// Position of the offending pair in the list.
        index: usize,
        /// The slot named twice.
        slot: u32,
    },
    /// Two pairs write the same slot: the result would depend on their order.
    #[error("slot {slot} is the destination of pairs {first} and {second}: the result would depend on their order")]
    DuplicateDestination {
        /// The slot written twice.
        slot: u32,
        /// First pair writing it.
        first: usize,
        /// Second pair writing it.
        second: usize,
    },
    /// A slot is written by one pair and read by another in the same batch: the
    /// reader would see the old or the new state depending on timing.
    #[error("slot {slot} is written by pair {dst_index} and read by pair {src_index} in the same batch; split the batch")]
    DestinationIsSource {
        /// The slot both written and read.
        slot: u32,
        /// Pair writing it.
        dst_index: usize,
        /// Pair reading it.
        src_index: usize,
    },
    /// A promotion named a candidate that does not exist.
    #[error("accepted candidate {accepted} out of range: {candidates} candidates")]
    AcceptedOutOfRange {
        /// Index given.
        accepted: usize,
        /// Number of candidates.
        candidates: usize,
    },
    /// A promotion listed the same slot twice among the request's slot and its candidates.
    #[error("slot {slot} appears twice among the request's slot and its candidate slots")]
    DuplicateSlot {
        /// The repeated slot.
        slot: u32,
    },
    /// The batch was validated against more slots than this arena holds.
    #[error("batch validated for {batch_slots} slots, arena holds {arena_slots}")]
    ArenaMismatch {
        /// Slot count the batch was validated against.
        batch_slots: u32,
        /// Slot count of the arena asked to run it.
        arena_slots: u32,
    },
    /// The arena's layout is unusable (zero slots, sizes that do not divide,
    /// overlapping planes, null or misaligned bases).
    #[error("invalid state layout: {0}")]
    InvalidLayout(String),
}

/// A validated list of copy orders for an arena of `slots` slots.
///
/// Construction checks, in one pass over the list and two bitmaps of `slots`
/// bits: every slot `< slots`; `src != dst`; no `dst` repeated; no `dst` that is
/// also some pair's `src`. Sources may repeat (that is a fork). A batch that
/// passes has a single well-defined result, so backends may run its pairs in any
/// order and in parallel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CopyBatch {
    pairs: Vec<SlotPair>,
    slots: u32,
}

impl CopyBatch {
    /// Validates `pairs` for an arena of `slots` slots.
    ///
    /// # Errors
    /// The first violation found, naming the pair(s) involved.
    pub fn new(pairs: Vec<SlotPair>, slots: u32) -> Result<Self, SnapshotError> {
        validate(&pairs, slots)?;
        Ok(Self { pairs, slots })
    }

    /// One source state into several destinations (one per speculative
    /// candidate, for instance).
    ///
    /// # Errors
    /// As [`CopyBatch::new`]: a destination equal to the source, a repeated
    /// destination, or a slot out of range.
    pub fn fork(src: u32, dsts: &[u32], slots: u32) -> Result<Self, SnapshotError> {
        Self::new(
            dsts.iter().map(|&dst| SlotPair::new(src, dst)).collect(),
            slots,
        )
    }

    /// The validated pairs, in the order given.
    pub fn pairs(&self) -> &[SlotPair] {
        &self.pairs
    }

    /// Slot count the batch was validated against.
    pub fn slots(&self) -> u32 {
        self.slots
    }

    /// Number of copy orders.
    pub fn len(&self) -> usize {
        self.pairs.len()
    }

    /// Whether the batch copies nothing.
    pub fn is_empty(&self) -> bool {
        self.pairs.is_empty()
    }
}

fn validate(pairs: &[SlotPair], slots: u32) -> Result<(), SnapshotError> {
    let words = (slots as usize).div_ceil(64);
    let mut written = vec![0u64; words];
    let bit = |slot: u32| (slot as usize / 64, 1u64 << (slot % 64));
    for (index, pair) in pairs.iter().enumerate() {
        for slot in [pair.src, pair.dst] {
            if slot >= slots {
                return Err(SnapshotError::SlotOutOfRange { index, slot, slots });
            }
        }
        if pair.src == pair.dst {
            return Err(SnapshotError::SelfCopy {
                index,
                slot: pair.src,
            });
        }
        let (w, b) = bit(pair.dst);
        if written[w] & b != 0 {
            let first = pairs[..index]
                .iter()
                .position(|p| p.dst == pair.dst)
                .unwrap_or(0);
            return Err(SnapshotError::DuplicateDestination {
                slot: pair.dst,
                first,
                second: index,
            });
        }
        written[w] |= b;
    }
    for (src_index, pair) in pairs.iter().enumerate() {
        let (w, b) = bit(pair.src);
        if written[w] & b != 0 {
            let dst_index = pairs.iter().position(|p| p.dst == pair.src).unwrap_or(0);
            return Err(SnapshotError::DestinationIsSource {
                slot: pair.src,
                dst_index,
                src_index,
            });
        }
    }
    Ok(())
}

/// How a promotion makes the accepted candidate the request's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PromoteMode {
    /// Hand the candidate's slot over: the request's state slot becomes the
    /// candidate's, no bytes move. The engine updates its request → slot table.
    Swap,
    /// Copy the candidate's state into the request's existing slot; for engines
    /// that need the state at a fixed slot (CUDA graphs captured over slot
    /// indices, for instance).
    CopyInto,
}

/// The outcome of a promotion: where the request's state now lives and which
/// slots the engine may free.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Promotion {
    /// Slot holding the request's state after the promotion.
    pub state_slot: u32,
    /// Slots no longer needed: the request's old slot (on a swap) and every
    /// candidate slot other than the one now holding the state.
    pub released: Vec<u32>,
    /// The copy that was run ([`PromoteMode::CopyInto`]), if any.
    pub copied: Option<SlotPair>,
}

/// Plans a promotion without touching memory: checks the slots and returns the
/// promotion and the copy batch to run (empty for a swap).
///
/// # Errors
/// `accepted` out of range, a slot out of range, or a slot listed twice among
/// `state_slot` and `candidates`.
pub fn plan_promotion(
    state_slot: u32,
    candidates: &[u32],
    accepted: usize,
    mode: PromoteMode,
    slots: u32,
) -> Result<(Promotion, CopyBatch), SnapshotError> {
    let Some(&winner) = candidates.get(accepted) else {
        return Err(SnapshotError::AcceptedOutOfRange {
            accepted,
            candidates: candidates.len(),
        });
    };
    let mut all: Vec<u32> = Vec::with_capacity(candidates.len() + 1);
    all.push(state_slot);
    all.extend_from_slice(candidates);
    for (index, &slot) in all.iter().enumerate() {
        if slot >= slots {
            return Err(SnapshotError::SlotOutOfRange { index, slot, slots });
        }
    }
    let mut sorted = all.clone();
    sorted.sort_unstable();
    if let Some(w) = sorted.windows(2).find(|w| w[0] == w[1]) {
        return Err(SnapshotError::DuplicateSlot { slot: w[0] });
    }
    let others = candidates.iter().copied().filter(|&c| c != winner);
    Ok(match mode {
        PromoteMode::Swap => (
            Promotion {
                state_slot: winner,
                released: std::iter::once(state_slot).chain(others).collect(),
                copied: None,
            },
            CopyBatch {
                pairs: Vec::new(),
                slots,
            },
        ),
        PromoteMode::CopyInto => {
            let pair = SlotPair::new(winner, state_slot);
            (
                Promotion {
                    state_slot,
                    released: candidates.to_vec(),
                    copied: Some(pair),
                },
                CopyBatch::new(vec![pair], slots)?,
            )
        }
    })
}

/// A memory that runs validated copy batches over its slots. Implemented by the
/// host [`StateArena`] and, with feature `cuda`, by the CUDA state arena; the
/// provided methods give both the same fork and promote semantics.
pub trait SnapshotBackend {
    /// Error type of the backend; snapshot validation errors convert into it.
    type Error: From<SnapshotError>;

    /// Number of slots in the arena.
    fn slots(&self) -> u32;

    /// Bytes of one slot's state, over all planes.
    fn slot_bytes(&self) -> usize;

    /// Runs every pair of `batch`. When this returns `Ok` on a host backend the
    /// copies are done; a device backend may return once they are ordered on its
    /// stream (its docs say which).
    ///
    /// # Errors
    /// [`SnapshotError::ArenaMismatch`] when `batch` was validated for more slots
    /// than this arena holds; backend failures.
    fn copy(&mut self, batch: &CopyBatch) -> Result<(), Self::Error>;

    /// Copies slot `src` into every slot of `dsts` in one batch.
    ///
    /// # Errors
    /// Validation errors of [`CopyBatch::fork`]; backend failures.
    fn fork(&mut self, src: u32, dsts: &[u32]) -> Result<(), Self::Error> {
        let batch = CopyBatch::fork(src, dsts, self.slots())?;
        self.copy(&batch)
    }

    /// Makes `candidates[accepted]` the request's state (see [`PromoteMode`]).
    ///
    /// # Errors
    /// Validation errors of [`plan_promotion`]; backend failures. Nothing is
    /// copied on error.
    fn promote(
        &mut self,
        state_slot: u32,
        candidates: &[u32],
        accepted: usize,
        mode: PromoteMode,
    ) -> Result<Promotion, Self::Error> {
        let (promotion, batch) =
            plan_promotion(state_slot, candidates, accepted, mode, self.slots())?;
        if !batch.is_empty() {
            self.copy(&batch)?;
        }
        Ok(promotion)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pairs(list: &[(u32, u32)]) -> Vec<SlotPair> {
        list.iter().map(|&(s, d)| SlotPair::new(s, d)).collect()
    }

    #[test]
    fn validation_names_the_offending_pairs() {
        assert_eq!(
            CopyBatch::new(pairs(&[(0, 1), (2, 9)]), 8),
            Err(SnapshotError::SlotOutOfRange {
                index: 1,
                slot: 9,
                slots: 8
            })
        );
        assert_eq!(
            CopyBatch::new(pairs(&[(3, 3)]), 8),
            Err(SnapshotError::SelfCopy { index: 0, slot: 3 })
        );
        assert_eq!(
            CopyBatch::new(pairs(&[(0, 1), (2, 3), (4, 1)]), 8),
            Err(SnapshotError::DuplicateDestination {
                slot: 1,
                first: 0,
                second: 2
            })
        );
        assert_eq!(
            CopyBatch::new(pairs(&[(0, 1), (1, 2)]), 8),
            Err(SnapshotError::DestinationIsSource {
                slot: 1,
                dst_index: 0,
                src_index: 1
            })
        );
        // Chains are rejected whatever their order in the list.
        assert_eq!(
            CopyBatch::new(pairs(&[(1, 2), (0, 1)]), 8),
            Err(SnapshotError::DestinationIsSource {
                slot: 1,
                dst_index: 1,
                src_index: 0
            })
        );
        assert!(CopyBatch::new(pairs(&[(0, 1), (0, 2), (3, 4)]), 8).is_ok());
        assert!(CopyBatch::new(Vec::new(), 0).is_ok());
    }

    #[test]
    fn promotion_plans() {
        let (p, b) = plan_promotion(0, &[5, 6, 7], 1, PromoteMode::Swap, 8).unwrap();
        assert_eq!(
            p,
            Promotion {
                state_slot: 6,
                released: vec![0, 5, 7],
                copied: None
            }
        );
        assert!(b.is_empty());
        let (p, b) = plan_promotion(0, &[5, 6, 7], 2, PromoteMode::CopyInto, 8).unwrap();
        assert_eq!(
            p,
            Promotion {
                state_slot: 0,
                released: vec![5, 6, 7],
                copied: Some(SlotPair::new(7, 0))
            }
        );
        assert_eq!(b.pairs(), &[SlotPair::new(7, 0)]);
        assert_eq!(
            plan_promotion(0, &[5, 0], 0, PromoteMode::Swap, 8),
            Err(SnapshotError::DuplicateSlot { slot: 0 })
        );
        assert_eq!(
            plan_promotion(0, &[5], 1, PromoteMode::Swap, 8),
            Err(SnapshotError::AcceptedOutOfRange {
                accepted: 1,
                candidates: 1
            })
        );
    }
}
