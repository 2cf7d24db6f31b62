//! The index: which engine holds which block, and where states are.
//!
//! One flat hash map keyed by block hash (chained, so a hash names a whole
//! prefix), each entry two 64-bit engine sets: engines holding the block's
//! KV, and engines holding a recurrent state at the block's last token. A
//! query walks the request's block hashes once, intersecting the set of
//! engines still matching, so its cost is one map probe per block whatever
//! the number of engines.

use std::fmt;

use rustc_hash::FxHashMap;

/// A block hash as it travels in events (vLLM's `ExternalBlockHash` as an
/// integer: the low 64 bits of the chained hash).
pub type BlockHash = u64;

/// The most engines one index tracks (one bit each in a `u64`).
pub const MAX_ENGINES: usize = 64;

/// An engine of the index: its slot, `0..engines()`. Slots are handed out
/// in order; a slot freed by [`Index::remove_engine`] is handed out again.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EngineId(u8);

impl EngineId {
    /// The engine's position, `0..engines()`.
    pub fn index(self) -> usize {
        usize::from(self.0)
    }

    fn bit(self) -> u64 {
        1u64 << self.0
    }
}

impl fmt::Display for EngineId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "engine {}", self.0)
    }
}

/// One change of an engine's cache, as the index applies it (decoded from
/// the wire, or built in process).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum IndexEvent {
    /// KV blocks cached, in chain order (`BlockStored`).
    BlocksStored {
        /// Hashes of the blocks, each chained on the one before.
        block_hashes: Vec<BlockHash>,
        /// Tokens per block.
        block_size: u32,
    },
    /// KV blocks dropped (`BlockRemoved`); a state at the end of one of them
    /// goes with it.
    BlocksRemoved {
        /// Hashes of the blocks.
        block_hashes: Vec<BlockHash>,
    },
    /// Everything the engine cached is gone (`AllBlocksCleared`).
    AllCleared,
    /// A recurrent state cached at the last token of a block.
    StateStored {
        /// The block whose last token the state covers.
        block_hash: BlockHash,
    },
    /// That state dropped (its block's KV may stay).
    StateRemoved {
        /// The block whose last token the state covered.
        block_hash: BlockHash,
    },
}

/// What one engine has cached of a request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Overlap {
    /// Leading tokens whose KV the engine holds (whole blocks).
    pub kv_matched_tokens: u32,
    /// The deepest position within that match where the engine holds a
    /// state, below the request's last token (which is always recomputed):
    /// the tokens a hybrid model can actually skip. 0 when none.
    pub resumable_tokens: u32,
}

/// Why the index refused an event or a call. A refused call changes nothing.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum IndexError {
    /// Block size 0.
    #[error("block size must be > 0")]
    ZeroBlockSize,
    /// [`MAX_ENGINES`] engines already.
    #[error("an index tracks at most {MAX_ENGINES} engines")]
    TooManyEngines,
    /// An engine id from another index, or of a removed engine.
    #[error("unknown engine {0}")]
    UnknownEngine(usize),
    /// An engine publishes blocks of another size than the index's.
    #[error("block size {got} differs from the index's {expected}")]
    BlockSizeMismatch {
        /// The index's block size.
        expected: u32,
        /// The event's.
        got: u32,
    },
    /// A state event names a block the engine does not hold: the stream is
    /// out of order or an event was lost.
    #[error("state at block {0:#018x} of a block the engine does not hold")]
    StateWithoutBlock(BlockHash),
}

/// Per-engine figures of the index.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EngineStats {
    /// The name given at [`Index::add_engine`].
    pub name: String,
    /// Blocks held.
    pub blocks: u64,
    /// States held.
    pub states: u64,
    /// Removals of blocks or states the engine did not hold (harmless:
    /// vLLM may repeat a removal; counted to show a drifting stream).
    pub unknown_removals: u64,
}

#[derive(Clone, Copy, Default)]
struct Entry {
    /// Engines holding the block's KV.
    kv: u64,
    /// Engines holding a state at the block's last token (a subset of `kv`).
    state: u64,
}

/// The router-side index over the caches of up to [`MAX_ENGINES`] engines.
#[derive(Clone)]
pub struct Index {
    block_size: u32,
    blocks: FxHashMap<BlockHash, Entry>,
    engines: Vec<EngineStats>,
    /// Engines in use (removed ones are not).
    all: u64,
}

impl fmt::Debug for Index {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Index")
            .field("block_size", &self.block_size)
            .field("distinct_blocks", &self.blocks.len())
            .field("engines", &self.engines)
            .finish()
    }
}

impl Index {
    /// An empty index for engines caching `block_size`-token blocks.
    pub fn new(block_size: u32) -> Result<Self, IndexError> {
        if block_size == 0 {
            return Err(IndexError::ZeroBlockSize);
        }
        Ok(Index {
            block_size,
            blocks: FxHashMap::default(),
            engines: Vec::new(),
            all: 0,
        })
    }

    /// Tokens per block.
    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    /// Adds an engine holding nothing yet, in the lowest free slot (a slot
    /// of a removed engine first, else the next one).
    pub fn add_engine(&mut self, name: impl Into<String>) -> Result<EngineId, IndexError> {
        let stats = EngineStats {
            name: name.into(),
            ..EngineStats::default()
        };
        let n = self.engines.len();
        let used = if n >= 64 { u64::MAX } else { (1u64 << n) - 1 };
        let free = used & !self.all;
        let id = if free != 0 {
            let slot = free.trailing_zeros() as usize;
            self.engines[slot] = stats;
            EngineId(slot as u8)
        } else if n < MAX_ENGINES {
            self.engines.push(stats);
            EngineId(n as u8)
        } else {
            return Err(IndexError::TooManyEngines);
        };
        self.all |= id.bit();
        Ok(id)
    }

    /// Removes engine `e`: everything it held is forgotten and its slot is
    /// free for the next [`Index::add_engine`] (its id then names that
    /// engine). Visits every entry, as [`Index::clear_engine`].
    pub fn remove_engine(&mut self, e: EngineId) -> Result<(), IndexError> {
        self.clear_engine(e)?;
        self.all &= !e.bit();
        self.engines[e.index()] = EngineStats::default();
        Ok(())
    }

    /// Engine slots handed out so far, removed engines' included: the
    /// length of [`Index::overlap_hashes`]' answer.
    pub fn engines(&self) -> usize {
        self.engines.len()
    }

    /// Engines in use.
    pub fn live_engines(&self) -> usize {
        self.all.count_ones() as usize
    }

    /// The engine in slot `index`, if one is in use there.
    pub fn engine(&self, index: usize) -> Result<EngineId, IndexError> {
        if index < self.engines.len() && self.all & (1u64 << index) != 0 {
            Ok(EngineId(index as u8))
        } else {
            Err(IndexError::UnknownEngine(index))
        }
    }

    /// Per-engine figures.
    pub fn stats(&self, e: EngineId) -> &EngineStats {
        &self.engines[e.index()]
    }

    /// Distinct blocks held by at least one engine.
    pub fn distinct_blocks(&self) -> usize {
        self.blocks.len()
    }

    fn check(&self, e: EngineId) -> Result<(), IndexError> {
        if e.index() < self.engines.len() && self.all & e.bit() != 0 {
            Ok(())
        } else {
            Err(IndexError::UnknownEngine(e.index()))
        }
    }

    /// Applies one event of engine `e`.
    pub fn apply(&mut self, e: EngineId, event: &IndexEvent) -> Result<(), IndexError> {
        match event {
            IndexEvent::BlocksStored {
                block_hashes,
                block_size,
            } => self.store_blocks(e, *block_size, block_hashes),
            IndexEvent::BlocksRemoved { block_hashes } => self.remove_blocks(e, block_hashes),
            IndexEvent::AllCleared => self.clear_engine(e),
            IndexEvent::StateStored { block_hash } => self.store_state(e, *block_hash),
            IndexEvent::StateRemoved { block_hash } => self.remove_state(e, *block_hash),
        }
    }

    /// Engine `e` caches the blocks `hashes` (of `block_size` tokens). A block
    /// it already holds stays as it is.
    pub fn store_blocks(
        &mut self,
        e: EngineId,
        block_size: u32,
        hashes: &[BlockHash],
    ) -> Result<(), IndexError> {
        self.check(e)?;
        if block_size != self.block_size {
            return Err(IndexError::BlockSizeMismatch {
                expected: self.block_size,
                got: block_size,
            });
        }
        let bit = e.bit();
        let mut added = 0;
        for &h in hashes {
            let entry = self.blocks.entry(h).or_default();
            added += u64::from(entry.kv & bit == 0);
            entry.kv |= bit;
        }
        self.engines[e.index()].blocks += added;
        Ok(())
    }

    /// Engine `e` dropped the blocks `hashes`, and any state at their ends.
    pub fn remove_blocks(&mut self, e: EngineId, hashes: &[BlockHash]) -> Result<(), IndexError> {
        self.check(e)?;
        let bit = e.bit();
        let stats = &mut self.engines[e.index()];
        for h in hashes {
            match self.blocks.get_mut(h) {
                Some(entry) if entry.kv & bit != 0 => {
                    stats.blocks -= 1;
                    if entry.state & bit != 0 {
                        stats.states -= 1;
                    }
                    entry.kv &= !bit;
                    entry.state &= !bit;
                    if entry.kv == 0 {
                        self.blocks.remove(h);
                    }
                }
                _ => stats.unknown_removals += 1,
            }
        }
        Ok(())
    }

    /// Engine `e` holds a state at the last token of block `hash`, whose KV
    /// it must hold (else [`IndexError::StateWithoutBlock`], nothing changes).
    pub fn store_state(&mut self, e: EngineId, hash: BlockHash) -> Result<(), IndexError> {
        self.check(e)?;
        let bit = e.bit();
        match self.blocks.get_mut(&hash) {
            Some(entry) if entry.kv & bit != 0 => {
                if entry.state & bit == 0 {
                    entry.state |= bit;
                    self.engines[e.index()].states += 1;
                }
                Ok(())
            }
            _ => Err(IndexError::StateWithoutBlock(hash)),
        }
    }

    /// Engine `e` dropped its state at the end of block `hash`.
    pub fn remove_state(&mut self, e: EngineId, hash: BlockHash) -> Result<(), IndexError> {
        self.check(e)?;
        let bit = e.bit();
        let stats = &mut self.engines[e.index()];
        match self.blocks.get_mut(&hash) {
            Some(entry) if entry.state & bit != 0 => {
                entry.state &= !bit;
                stats.states -= 1;
            }
            _ => stats.unknown_removals += 1,
        }
        Ok(())
    }

    /// Forgets everything engine `e` held (`AllBlocksCleared`, or a gap that
    /// replay could not repair). Visits every entry: rare by nature.
    pub fn clear_engine(&mut self, e: EngineId) -> Result<(), IndexError> {
        self.check(e)?;
        let bit = e.bit();
        self.blocks.retain(|_, entry| {
            entry.kv &= !bit;
            entry.state &= !bit;
            entry.kv != 0
        });
        let s = &mut self.engines[e.index()];
        s.blocks = 0;
        s.states = 0;
        Ok(())
    }

    /// Per engine, what it holds of a request whose full blocks hash to
    /// `hashes` (in chain order) and whose input is `input_len` tokens long:
    /// `out[i]` is engine `i`'s. One map probe per block, stopping at the
    /// first block no engine holds.
    pub fn overlap_hashes(&self, hashes: &[BlockHash], input_len: usize, out: &mut Vec<Overlap>) {
        out.clear();
        out.resize(self.engines.len(), Overlap::default());
        let bs = u64::from(self.block_size);
        // States at or past the last input token are not resumable.
        let limit = (input_len as u64).saturating_sub(1);
        let tokens = |blocks: usize| u32::try_from(blocks as u64 * bs).unwrap_or(u32::MAX);
        let mut active = self.all;
        for (i, h) in hashes.iter().enumerate() {
            let entry = self.blocks.get(h).copied().unwrap_or_default();
            let present = entry.kv & active;
            for e in Bits(active & !present) {
                out[e].kv_matched_tokens = tokens(i);
            }
            active = present;
            if active == 0 {
                return;
            }
            if (i as u64 + 1) * bs <= limit {
                for e in Bits(entry.state & active) {
                    out[e].resumable_tokens = tokens(i + 1);
                }
            }
        }
        for e in Bits(active) {
            out[e].kv_matched_tokens = tokens(hashes.len());
        }
    }

    /// Blocks engine `e` holds, sorted (for checks against an engine's own
    /// view; visits every entry).
    pub fn engine_blocks(&self, e: EngineId) -> Vec<BlockHash> {
        let bit = e.bit();
        let mut v: Vec<_> = self
            .blocks
            .iter()
            .filter(|(_, x)| x.kv & bit != 0)
            .map(|(&h, _)| h)
            .collect();
        v.sort_unstable();
        v
    }

    /// Per engine slot, the blocks it holds and the blocks at whose end it
    /// holds a state, each sorted: [`Index::engine_blocks`] and
    /// [`Index::engine_states`] of every engine in one visit of the entries.
    pub fn blocks_by_engine(&self) -> Vec<(Vec<BlockHash>, Vec<BlockHash>)> {
        let mut out = vec![(Vec::new(), Vec::new()); self.engines.len()];
        for (&h, x) in &self.blocks {
            for e in Bits(x.kv) {
                out[e].0.push(h);
            }
            for e in Bits(x.state) {
                out[e].1.push(h);
            }
        }
        for (b, s) in &mut out {
            b.sort_unstable();
            s.sort_unstable();
        }
        out
    }

    /// Blocks at whose end engine `e` holds a state, sorted.
    pub fn engine_states(&self, e: EngineId) -> Vec<BlockHash> {
        let bit = e.bit();
        let mut v: Vec<_> = self
            .blocks
            .iter()
            .filter(|(_, x)| x.state & bit != 0)
            .map(|(&h, _)| h)
            .collect();
        v.sort_unstable();
        v
    }
}

/// The set bits of a `u64`, lowest first.
struct Bits(u64);

impl Iterator for Bits {
    type Item = usize;

    fn next(&mut self) -> Option<usize> {
        if self.0 == 0 {
            return None;
        }
        let i = self.0.trailing_zeros() as usize;
        self.0 &= self.0 - 1;
        Some(i)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn idx(n: usize) -> (Index, Vec<EngineId>) {
        let mut ix = Index::new(4).unwrap();
        let es = (0..n)
            .map(|i| ix.add_engine(format!("e{i}")).unwrap())
            .collect();
        (ix, es)
    }

    #[test]
    fn kv_and_resumable_per_engine() {
        let (mut ix, e) = idx(3);
        ix.store_blocks(e[0], 4, &[1, 2, 3]).unwrap();
        ix.store_state(e[0], 1).unwrap();
        ix.store_blocks(e[1], 4, &[1, 2]).unwrap();
        ix.store_state(e[1], 2).unwrap();
        let mut out = Vec::new();
        ix.overlap_hashes(&[1, 2, 3, 4], 20, &mut out);
        assert_eq!(
            out,
            vec![
                Overlap {
                    kv_matched_tokens: 12,
                    resumable_tokens: 4
                },
                Overlap {
                    kv_matched_tokens: 8,
                    resumable_tokens: 8
                },
                Overlap::default(),
            ]
        );
        // The last input token is recomputed: a state at 8 of an 8-token input is not usable.
        ix.overlap_hashes(&[1, 2], 8, &mut out);
        assert_eq!(out[1].kv_matched_tokens, 8);
        assert_eq!(out[1].resumable_tokens, 0);
        assert_eq!(out[0].resumable_tokens, 4);
    }

    #[test]
    fn a_gap_in_the_chain_ends_the_match() {
        let (mut ix, e) = idx(1);
        ix.store_blocks(e[0], 4, &[1, 3]).unwrap();
        ix.store_state(e[0], 3).unwrap();
        let mut out = Vec::new();
        ix.overlap_hashes(&[1, 2, 3], 100, &mut out);
        assert_eq!(out[0].kv_matched_tokens, 4);
        assert_eq!(out[0].resumable_tokens, 0);
    }

    #[test]
    fn removal_drops_the_state_and_clear_drops_everything() {
        let (mut ix, e) = idx(2);
        ix.store_blocks(e[0], 4, &[1, 2]).unwrap();
        ix.store_blocks(e[1], 4, &[1]).unwrap();
        ix.store_state(e[0], 2).unwrap();
        ix.remove_blocks(e[0], &[2, 99]).unwrap();
        assert_eq!(ix.stats(e[0]).states, 0);
        assert_eq!(ix.stats(e[0]).blocks, 1);
        assert_eq!(ix.stats(e[0]).unknown_removals, 1);
        assert_eq!(ix.engine_states(e[0]), Vec::<u64>::new());
        ix.clear_engine(e[0]).unwrap();
        assert_eq!(ix.engine_blocks(e[0]), Vec::<u64>::new());
        assert_eq!(ix.engine_blocks(e[1]), vec![1]);
        assert_eq!(ix.distinct_blocks(), 1);
    }

    #[test]
    fn refusals_change_nothing() {
        let (mut ix, e) = idx(1);
        assert_eq!(
            ix.store_state(e[0], 5),
            Err(IndexError::StateWithoutBlock(5))
        );
        assert_eq!(
            ix.store_blocks(e[0], 8, &[1]),
            Err(IndexError::BlockSizeMismatch {
                expected: 4,
                got: 8
            })
        );
        assert_eq!(ix.distinct_blocks(), 0);
        assert_eq!(Index::new(0).unwrap_err(), IndexError::ZeroBlockSize);
        let mut other = Index::new(4).unwrap();
        assert_eq!(
            other.store_blocks(e[0], 4, &[1]),
            Err(IndexError::UnknownEngine(0))
        );
        for i in 1..MAX_ENGINES {
            ix.add_engine(format!("{i}")).unwrap();
        }
        assert_eq!(
            ix.add_engine("one too many"),
            Err(IndexError::TooManyEngines)
        );
        assert_eq!(ix.engine(MAX_ENGINES), Err(IndexError::UnknownEngine(64)));
    }

    #[test]
    fn a_removed_engines_slot_is_handed_out_again() {
        let (mut ix, e) = idx(MAX_ENGINES);
        ix.store_blocks(e[3], 4, &[1, 2]).unwrap();
        ix.store_blocks(e[4], 4, &[1]).unwrap();
        ix.remove_engine(e[3]).unwrap();
        assert_eq!(ix.live_engines(), MAX_ENGINES - 1);
        assert_eq!(
            ix.store_blocks(e[3], 4, &[9]),
            Err(IndexError::UnknownEngine(3))
        );
        assert_eq!(ix.engine(3), Err(IndexError::UnknownEngine(3)));
        // Every register/unregister cycle finds a slot.
        for i in 0..70 {
            let n = ix.add_engine(format!("again {i}")).unwrap();
            assert_eq!(n, e[3]);
            assert_eq!(
                ix.engine_blocks(n),
                Vec::<u64>::new(),
                "nothing of the old engine"
            );
            ix.store_blocks(n, 4, &[1, 5]).unwrap();
            let mut out = Vec::new();
            ix.overlap_hashes(&[1, 5], 9, &mut out);
            assert_eq!(out[3].kv_matched_tokens, 8);
            ix.remove_engine(n).unwrap();
        }
        assert_eq!(ix.engine_blocks(e[4]), vec![1]);
        assert_eq!(ix.distinct_blocks(), 1);
        let by = ix.blocks_by_engine();
        assert_eq!(by[4], (vec![1], vec![]));
        assert!(by[3].0.is_empty());
    }
}
