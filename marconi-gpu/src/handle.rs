//! Opaque 32-bit virtual handles: pool tag, unit index and generation.

use std::fmt;

/// The two kinds of cache memory a hybrid model needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
pub enum PoolKind {
    /// Attention KV pages (grow with the sequence).
    Kv,
    /// Recurrent (SSM) state blocks (one per layer per sequence).
    Ssm,
}

impl PoolKind {
    /// Both kinds, KV first.
    pub const ALL: [PoolKind; 2] = [PoolKind::Kv, PoolKind::Ssm];

    /// The other pool (the donor when this one is the recipient).
    #[must_use]
    pub fn other(self) -> PoolKind {
        match self {
            PoolKind::Kv => PoolKind::Ssm,
            PoolKind::Ssm => PoolKind::Kv,
        }
    }

    /// Index 0 for KV, 1 for SSM.
    #[must_use]
    pub fn index(self) -> usize {
        match self {
            PoolKind::Kv => 0,
            PoolKind::Ssm => 1,
        }
    }
}

impl fmt::Display for PoolKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            PoolKind::Kv => "KV",
            PoolKind::Ssm => "SSM",
        })
    }
}

/// An opaque 32-bit handle to one allocated unit (a KV page or an SSM block).
///
/// Bit 31 is the pool tag (0 = KV, 1 = SSM). The remaining 31 bits hold the unit
/// index (high part) and a generation (low part); the split is chosen per allocator
/// by [`HandleLayout`] so that the index field fits the largest pool the budget
/// allows and every other bit goes to the generation. A generation is never 0, so
/// the raw value 0 never names a live unit and can serve as "null" across the C ABI.
///
/// A handle is only meaningful to the allocator that issued it. Freeing or resolving
/// it after its unit has been freed (or evicted) and reused fails with
/// [`crate::AllocError::StaleHandle`]; the check is exact until one unit has been
/// reused `2^generation_bits - 1` times while the stale handle was still held.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct VirtualHandle(u32);

impl VirtualHandle {
    /// The raw 32-bit value (for the C ABI and for logs).
    #[must_use]
    pub fn raw(self) -> u32 {
        self.0
    }

    /// Rebuilds a handle from its raw value; validity is checked on use.
    #[must_use]
    pub fn from_raw(raw: u32) -> Self {
        VirtualHandle(raw)
    }

    /// The pool encoded in the tag bit (needs no allocator).
    #[must_use]
    pub fn pool(self) -> PoolKind {
        if self.0 >> 31 == 0 {
            PoolKind::Kv
        } else {
            PoolKind::Ssm
        }
    }
}

impl fmt::Debug for VirtualHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "VirtualHandle({:#010x}, {})", self.0, self.pool())
    }
}

/// How an allocator splits the 31 non-tag bits between unit index and generation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HandleLayout {
    index_bits: u32,
}

/// Fewest generation bits a layout may keep.
pub const MIN_GENERATION_BITS: u32 = 8;

impl HandleLayout {
    /// A layout whose index field holds `max_units` distinct indices (at least 1 bit).
    /// Returns `None` when that leaves fewer than [`MIN_GENERATION_BITS`] bits.
    #[must_use]
    pub fn for_max_units(max_units: u32) -> Option<Self> {
        let index_bits = (u32::BITS - max_units.saturating_sub(1).leading_zeros()).max(1);
        (index_bits + MIN_GENERATION_BITS <= 31).then_some(HandleLayout { index_bits })
    }

    /// Bits of the unit index.
    #[must_use]
    pub fn index_bits(self) -> u32 {
        self.index_bits
    }

    /// Bits of the generation.
    #[must_use]
    pub fn generation_bits(self) -> u32 {
        31 - self.index_bits
    }

    /// Largest generation value (generations cycle through `1..=max_generation`).
    #[must_use]
    pub fn max_generation(self) -> u32 {
        (1u32 << self.generation_bits()) - 1
    }

    /// The generation that follows `g` (skips 0).
    #[must_use]
    pub fn next_generation(self, g: u32) -> u32 {
        if g >= self.max_generation() {
            1
        } else {
            g + 1
        }
    }

    /// Packs a handle. The caller guarantees `index` fits and `generation` is in
    /// `1..=max_generation`.
    #[must_use]
    pub fn encode(self, pool: PoolKind, index: u32, generation: u32) -> VirtualHandle {
        let tag = match pool {
            PoolKind::Kv => 0,
            PoolKind::Ssm => 1u32 << 31,
        };
        VirtualHandle(tag | (index << self.generation_bits()) | generation)
    }

    /// Unpacks `(pool, index, generation)`.
    #[must_use]
    pub fn decode(self, h: VirtualHandle) -> (PoolKind, u32, u32) {
        let body = h.0 & !(1u32 << 31);
        (
            h.pool(),
            body >> self.generation_bits(),
            body & self.max_generation(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_round_trips_and_sizes_fields() {
        let l = HandleLayout::for_max_units(16_384).unwrap();
        assert_eq!(l.index_bits(), 14);
        assert_eq!(l.generation_bits(), 17);
        for (pool, idx, g) in [
            (PoolKind::Kv, 0, 1),
            (PoolKind::Ssm, 16_383, l.max_generation()),
        ] {
            let h = l.encode(pool, idx, g);
            assert_eq!(l.decode(h), (pool, idx, g));
            assert_eq!(h.pool(), pool);
        }
        assert_eq!(l.next_generation(l.max_generation()), 1);
        assert_eq!(HandleLayout::for_max_units(1).unwrap().index_bits(), 1);
        assert!(HandleLayout::for_max_units(1 << 23).is_some());
        assert!(HandleLayout::for_max_units((1 << 23) + 1).is_none());
    }
}
