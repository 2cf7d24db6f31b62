//! Opaque 64-bit virtual handles: pool kind, pool id, unit index and generation.

use std::collections::VecDeque;
use std::fmt;
use std::sync::Mutex;

use crate::error::AllocError;

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

/// Bits of the pool id field.
pub const POOL_ID_BITS: u32 = 20;

/// Largest pool id (ids run `1..=MAX_POOL_ID`; 0 is never issued).
pub const MAX_POOL_ID: u32 = (1 << POOL_ID_BITS) - 1;

/// Bits shared by the unit index and the generation (below the pool id).
pub const UNIT_BITS: u32 = 62 - POOL_ID_BITS;

/// The pool-kind bit (0 KV, 1 SSM); bit 63 is always 0, so a handle fits a
/// signed 64-bit integer (a torch.int64 tensor, an int64_t) unchanged.
const KIND_BIT: u32 = 62;

/// Fewest generation bits a layout may keep (a unit is reused
/// `2^generation_bits - 1` times, then retired).
pub const MIN_GENERATION_BITS: u32 = UNIT_BITS - 32;

/// An opaque 64-bit handle to one allocated unit (a KV page or an SSM block).
///
/// Bit 63 is 0; bit 62 is the pool kind (0 = KV, 1 = SSM); bits 42..=61 the
/// id of the allocator that issued it ([`PoolId`], distinct among live
/// allocators); the low 42 bits hold the unit index (high part) and a generation (low
/// part), split per allocator by [`HandleLayout`] so that the index field fits
/// the largest pool the budget allows and every other bit goes to the
/// generation (at least [`MIN_GENERATION_BITS`]). A generation is never 0, so
/// the raw value 0 never names a live unit and can serve as "null" across the
/// C ABI.
///
/// A handle is only meaningful to the allocator that issued it: another live
/// allocator refuses it ([`crate::AllocError::ForeignHandle`]). Freeing or
/// resolving it after its unit has been freed (or evicted) and reused fails
/// with [`crate::AllocError::StaleHandle`], for the life of the process: a
/// unit whose generation reaches its largest value is retired when freed
/// (never allocated again), so a generation never wraps.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct VirtualHandle(u64);

impl VirtualHandle {
    /// The raw 64-bit value (for the C ABI and for logs).
    #[must_use]
    pub fn raw(self) -> u64 {
        self.0
    }

    /// Rebuilds a handle from its raw value; validity is checked on use.
    #[must_use]
    pub fn from_raw(raw: u64) -> Self {
        VirtualHandle(raw)
    }

    /// The pool encoded in the kind bit (needs no allocator).
    #[must_use]
    pub fn pool(self) -> PoolKind {
        if (self.0 >> KIND_BIT) & 1 == 0 {
            PoolKind::Kv
        } else {
            PoolKind::Ssm
        }
    }

    /// The id of the allocator that issued the handle (needs no allocator).
    #[must_use]
    pub fn pool_id(self) -> u32 {
        // Cannot truncate: 20 bits.
        ((self.0 >> UNIT_BITS) & u64::from(MAX_POOL_ID)) as u32
    }
}

impl fmt::Debug for VirtualHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "VirtualHandle({:#018x}, {})", self.0, self.pool())
    }
}

/// The process-wide registry of pool ids: ids are issued in order
/// `1..=MAX_POOL_ID`; once all were issued, freed ids are reused, the
/// longest freed first.
struct Registry {
    next: u32,
    freed: VecDeque<u32>,
}

static REGISTRY: Mutex<Registry> = Mutex::new(Registry {
    next: 1,
    freed: VecDeque::new(),
});

/// One allocator's id, distinct among the live ones; returned to the
/// registry when dropped.
#[derive(Debug, PartialEq, Eq)]
pub struct PoolId(u32);

impl PoolId {
    /// Takes a fresh id: one never issued before while any remain, else the
    /// longest freed one. Fails only when [`MAX_POOL_ID`] allocators are live.
    pub fn acquire() -> Result<PoolId, AllocError> {
        // The registry holds plain counters: a panic elsewhere cannot leave it
        // half-updated, so a poisoned lock is safe to use.
        let mut r = REGISTRY
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if r.next <= MAX_POOL_ID {
            let id = r.next;
            r.next += 1;
            return Ok(PoolId(id));
        }
        r.freed.pop_front().map(PoolId).ok_or_else(|| {
            AllocError::InvalidConfig(format!("{MAX_POOL_ID} pools are live: no pool id left"))
        })
    }

    /// The id's value (`1..=MAX_POOL_ID`).
    #[must_use]
    pub fn get(&self) -> u32 {
        self.0
    }
}

impl Drop for PoolId {
    fn drop(&mut self) {
        let mut r = REGISTRY
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        r.freed.push_back(self.0);
    }
}

/// How an allocator splits the 42 unit bits between unit index and
/// generation, and the allocator's pool id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HandleLayout {
    index_bits: u32,
    pool_id: u32,
}

impl HandleLayout {
    /// A layout whose index field holds `max_units` distinct indices (at least
    /// 1 bit), for the allocator with id `pool_id`. Always fits: an index has
    /// at most 32 bits, which leaves [`MIN_GENERATION_BITS`].
    #[must_use]
    pub fn for_max_units(max_units: u32, pool_id: &PoolId) -> Self {
        let index_bits = (u32::BITS - max_units.saturating_sub(1).leading_zeros()).max(1);
        HandleLayout {
            index_bits,
            pool_id: pool_id.get(),
        }
    }

    /// A layout keeping only `generation_bits` generation bits (tests of
    /// retirement, which real layouts reach after at least 2^10 - 1 reuses).
    #[cfg(test)]
    pub(crate) fn with_generation_bits(generation_bits: u32, pool_id: &PoolId) -> Self {
        HandleLayout {
            index_bits: UNIT_BITS - generation_bits,
            pool_id: pool_id.get(),
        }
    }

    /// Bits of the unit index.
    #[must_use]
    pub fn index_bits(self) -> u32 {
        self.index_bits
    }

    /// Bits of the generation.
    #[must_use]
    pub fn generation_bits(self) -> u32 {
        UNIT_BITS - self.index_bits
    }

    /// The pool id handles of this layout carry.
    #[must_use]
    pub fn pool_id(self) -> u32 {
        self.pool_id
    }

    /// Largest generation value (a unit's generations run `1..=max_generation`;
    /// the unit is retired after its last one).
    #[must_use]
    pub fn max_generation(self) -> u64 {
        (1u64 << self.generation_bits()) - 1
    }

    /// Packs a handle. The caller guarantees `index` fits and `generation` is in
    /// `1..=max_generation`.
    #[must_use]
    pub fn encode(self, pool: PoolKind, index: u32, generation: u64) -> VirtualHandle {
        let tag = match pool {
            PoolKind::Kv => 0,
            PoolKind::Ssm => 1u64 << KIND_BIT,
        };
        VirtualHandle(
            tag | (u64::from(self.pool_id) << UNIT_BITS)
                | (u64::from(index) << self.generation_bits())
                | generation,
        )
    }

    /// The unit index bits of `h`, whichever pool issued it (no check).
    #[must_use]
    pub fn index_of(self, h: VirtualHandle) -> u32 {
        // Cannot truncate: index_bits <= 32.
        ((h.0 & ((1u64 << UNIT_BITS) - 1)) >> self.generation_bits()) as u32
    }

    /// Unpacks `(pool, index, generation)`, or `None` when the handle carries
    /// another pool id.
    #[must_use]
    pub fn decode(self, h: VirtualHandle) -> Option<(PoolKind, u32, u64)> {
        if h.pool_id() != self.pool_id {
            return None;
        }
        let body = h.0 & ((1u64 << UNIT_BITS) - 1);
        // Cannot truncate: index_bits <= 32.
        let index = (body >> self.generation_bits()) as u32;
        Some((h.pool(), index, body & self.max_generation()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_round_trips_and_sizes_fields() {
        let id = PoolId::acquire().unwrap();
        let l = HandleLayout::for_max_units(16_384, &id);
        assert_eq!(l.index_bits(), 14);
        assert_eq!(l.generation_bits(), 28);
        for (pool, idx, g) in [
            (PoolKind::Kv, 0, 1),
            (PoolKind::Ssm, 16_383, l.max_generation()),
        ] {
            let h = l.encode(pool, idx, g);
            assert_eq!(l.decode(h), Some((pool, idx, g)));
            assert_eq!(h.pool(), pool);
            assert_eq!(h.pool_id(), id.get());
        }
        assert_eq!(HandleLayout::for_max_units(1, &id).index_bits(), 1);
        let widest = HandleLayout::for_max_units(u32::MAX, &id);
        assert_eq!(widest.generation_bits(), MIN_GENERATION_BITS);
        let h = widest.encode(PoolKind::Ssm, u32::MAX, widest.max_generation());
        assert_eq!(h.raw() >> 63, 0, "a handle fits an int64");
        assert_eq!(
            widest.decode(h),
            Some((PoolKind::Ssm, u32::MAX, widest.max_generation()))
        );
    }

    #[test]
    fn live_pool_ids_differ_and_a_foreign_handle_does_not_decode() {
        let (a, b) = (PoolId::acquire().unwrap(), PoolId::acquire().unwrap());
        assert_ne!(a.get(), b.get());
        let (la, lb) = (
            HandleLayout::for_max_units(8, &a),
            HandleLayout::for_max_units(8, &b),
        );
        let h = la.encode(PoolKind::Kv, 3, 1);
        assert_eq!(lb.decode(h), None);
        assert_eq!(la.decode(h), Some((PoolKind::Kv, 3, 1)));
    }
}
