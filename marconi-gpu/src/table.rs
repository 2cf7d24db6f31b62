//! One pool of equal-size units: a free list with the prototype's exact order,
//! per-slot generations (a unit is retired once its last generation is
//! freed), and tail shrink / grow for capacity migration.

use std::collections::BTreeSet;

use crate::error::AllocError;
use crate::handle::{HandleLayout, PoolKind, VirtualHandle};

#[derive(Debug, Clone, Copy, Default)]
struct Slot {
    generation: u64,
    live: bool,
    /// Freed at its last generation: never allocated again.
    retired: bool,
    /// Pool tag the unit was last allocated under (differs from the table's kind
    /// only in the padded unified layout, where both kinds share one table).
    tag: Option<PoolKind>,
}

/// The free units: the prototype's stack, or lowest index first.
#[derive(Debug, Clone)]
enum FreeList {
    /// Pops from the end; frees push (last freed, first reused).
    Stack(Vec<u32>),
    /// Always the lowest free index: live units stay packed at the bottom,
    /// so freed capacity gathers at the tail, where migration takes it.
    Lowest(BTreeSet<u32>),
}

impl FreeList {
    fn len(&self) -> usize {
        match self {
            FreeList::Stack(v) => v.len(),
            FreeList::Lowest(b) => b.len(),
        }
    }
    fn pop(&mut self) -> Option<u32> {
        match self {
            FreeList::Stack(v) => v.pop(),
            FreeList::Lowest(b) => b.pop_first(),
        }
    }
    fn push(&mut self, i: u32) {
        match self {
            FreeList::Stack(v) => v.push(i),
            FreeList::Lowest(b) => {
                b.insert(i);
            }
        }
    }
    fn retain_below(&mut self, new: u32) {
        match self {
            FreeList::Stack(v) => v.retain(|&i| i < new),
            FreeList::Lowest(b) => b.retain(|&i| i < new),
        }
    }
    fn extend(&mut self, r: impl Iterator<Item = u32>) {
        match self {
            FreeList::Stack(v) => v.extend(r),
            FreeList::Lowest(b) => b.extend(r),
        }
    }
    #[cfg(feature = "strict-checks")]
    fn iter(&self) -> Box<dyn Iterator<Item = u32> + '_> {
        match self {
            FreeList::Stack(v) => Box::new(v.iter().copied()),
            FreeList::Lowest(b) => Box::new(b.iter().copied()),
        }
    }
}

/// A table of `extent` unit indices of `unit_bytes` each, indexable up to
/// `max_units`; its capacity is the extent less its retired units.
///
/// Free-list order is part of the contract (the AVMP replay depends on it): it
/// starts as `[n-1, ..., 1, 0]` and pops from the end (lowest ids first), frees
/// append, shrink filters keeping order, grow appends the new ids ascending
/// (retired ones left out).
#[derive(Debug, Clone)]
pub(crate) struct UnitTable {
    pub(crate) kind: PoolKind,
    pub(crate) unit_bytes: u64,
    extent: u32,
    free: FreeList,
    slots: Vec<Slot>,
    live: u32,
    /// Retired units below `extent`.
    retired: u32,
    /// Units ever retired (below the extent or not).
    retired_total: u64,
}

impl UnitTable {
    pub(crate) fn new(kind: PoolKind, unit_bytes: u64, capacity: u32, max_units: u32) -> Self {
        debug_assert!(capacity <= max_units);
        UnitTable {
            kind,
            unit_bytes,
            extent: capacity,
            free: FreeList::Stack((0..capacity).rev().collect()),
            slots: vec![Slot::default(); max_units as usize],
            live: 0,
            retired: 0,
            retired_total: 0,
        }
    }

    /// Switches to lowest-index-first allocation (keeps the free units).
    pub(crate) fn set_lowest_first(&mut self) {
        if let FreeList::Stack(v) = &self.free {
            self.free = FreeList::Lowest(v.iter().copied().collect());
        }
    }

    /// Units that can be allocated: the extent less the retired units.
    pub(crate) fn capacity(&self) -> u32 {
        self.extent - self.retired
    }

    /// Unit indices `0..extent` belong to the table (retired ones included).
    pub(crate) fn extent(&self) -> u32 {
        self.extent
    }

    /// Units ever retired (their last generation was freed).
    pub(crate) fn retired_total(&self) -> u64 {
        self.retired_total
    }

    pub(crate) fn max_units(&self) -> u32 {
        // Cannot truncate: built from a u32.
        self.slots.len() as u32
    }

    pub(crate) fn free_units(&self) -> u32 {
        // Cannot truncate: the free list never holds more than `extent` ids.
        self.free.len() as u32
    }

    pub(crate) fn live_units(&self) -> u32 {
        self.live
    }

    /// All-or-nothing: either `n` handles are appended to `out` or nothing changes.
    pub(crate) fn alloc(
        &mut self,
        layout: HandleLayout,
        tag: PoolKind,
        n: u32,
        out: &mut Vec<VirtualHandle>,
    ) -> Result<(), AllocError> {
        if n as usize > self.free.len() {
            return Err(AllocError::OutOfCapacity {
                pool: self.kind,
                requested: n,
                free: self.free_units(),
                capacity: self.capacity(),
            });
        }
        out.reserve(n as usize);
        for _ in 0..n {
            let Some(idx) = self.free.pop() else {
                unreachable!("length checked above")
            };
            let slot = &mut self.slots[idx as usize];
            // Never wraps: a unit at its last generation was retired, not freed.
            slot.generation += 1;
            debug_assert!(slot.generation <= layout.max_generation());
            slot.live = true;
            slot.tag = Some(tag);
            out.push(layout.encode(tag, idx, slot.generation));
        }
        self.live += n;
        self.check();
        Ok(())
    }

    /// Validates `h` against the slot state and returns its index.
    pub(crate) fn check_live(
        &self,
        layout: HandleLayout,
        h: VirtualHandle,
    ) -> Result<u32, AllocError> {
        let Some((_, idx, generation)) = layout.decode(h) else {
            return Err(AllocError::ForeignHandle(h.raw()));
        };
        let Some(slot) = self.slots.get(idx as usize) else {
            return Err(AllocError::ForeignHandle(h.raw()));
        };
        if generation == 0 {
            return Err(AllocError::ForeignHandle(h.raw()));
        }
        if slot.generation == generation && slot.tag != Some(h.pool()) {
            return Err(AllocError::WrongPool {
                handle: h.raw(),
                expected: slot.tag.unwrap_or(self.kind),
                actual: h.pool(),
            });
        }
        match (slot.generation == generation, slot.live) {
            (true, true) => Ok(idx),
            (true, false) => Err(AllocError::DoubleFree(h.raw())),
            (false, _) => Err(AllocError::StaleHandle(h.raw())),
        }
    }

    pub(crate) fn free(
        &mut self,
        layout: HandleLayout,
        h: VirtualHandle,
    ) -> Result<u32, AllocError> {
        let idx = self.check_live(layout, h)?;
        let slot = &mut self.slots[idx as usize];
        slot.live = false;
        if slot.generation >= layout.max_generation() {
            // Its next handle would repeat an earlier one: retire the unit.
            slot.retired = true;
            self.retired += 1;
            self.retired_total += 1;
            tracing::debug!(pool = %self.kind, index = idx, "unit retired: generations exhausted");
        } else {
            self.free.push(idx);
        }
        self.live -= 1;
        self.check();
        Ok(idx)
    }

    /// The handle currently live at `index`, if any (used to emulate raw page ids).
    pub(crate) fn live_at(&self, layout: HandleLayout, index: u32) -> Option<VirtualHandle> {
        let slot = self.slots.get(index as usize)?;
        let tag = slot.tag?;
        slot.live
            .then(|| layout.encode(tag, index, slot.generation))
    }

    /// True when no unit with index `>= new` is live.
    pub(crate) fn tail_is_free(&self, new: u32) -> bool {
        self.slots[new as usize..self.extent as usize]
            .iter()
            .all(|s| !s.live)
    }

    /// Shrinks to `new` units; fails (unchanged) if a live unit sits at or above `new`.
    pub(crate) fn shrink(&mut self, new: u32) -> bool {
        if new > self.extent || !self.tail_is_free(new) {
            return false;
        }
        self.free.retain_below(new);
        self.retired -= self.retired_in(new, self.extent);
        self.extent = new;
        self.check();
        true
    }

    fn retired_in(&self, from: u32, to: u32) -> u32 {
        // Cannot truncate: at most `max_units` slots.
        self.slots[from as usize..to as usize]
            .iter()
            .filter(|s| s.retired)
            .count() as u32
    }

    /// Grows to `new` units (at most `max_units`), appending `old..new`
    /// ascending, less the retired units.
    pub(crate) fn grow(&mut self, new: u32) -> bool {
        if new < self.extent || new > self.max_units() {
            return false;
        }
        let old = self.extent;
        let slots = &self.slots;
        self.free
            .extend((old..new).filter(|&i| !slots[i as usize].retired));
        self.retired += self.retired_in(old, new);
        self.extent = new;
        self.check();
        true
    }

    /// Recount invariant (strict-checks only): free + live + retired == extent,
    /// and every free id is below the extent, neither live nor retired.
    fn check(&self) {
        #[cfg(feature = "strict-checks")]
        {
            assert_eq!(
                self.free.len() as u32 + self.live + self.retired,
                self.extent
            );
            assert_eq!(
                self.retired_in(0, self.extent),
                self.retired,
                "retired recount"
            );
            let live = self.slots[..self.extent as usize]
                .iter()
                .filter(|s| s.live)
                .count() as u32;
            assert_eq!(live, self.live, "live recount");
            assert!(self.slots[self.extent as usize..].iter().all(|s| !s.live));
            for i in self.free.iter() {
                let s = &self.slots[i as usize];
                assert!(i < self.extent && !s.live && !s.retired);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::handle::PoolId;

    #[test]
    fn a_unit_at_its_last_generation_is_retired_not_reused() {
        let id = PoolId::acquire().unwrap();
        let layout = HandleLayout::with_generation_bits(3, &id);
        let mut t = UnitTable::new(PoolKind::Kv, 128, 2, 4);
        let mut issued = Vec::new();
        let mut out = Vec::new();
        // Unit 0 has generations 1..=7, then retires; unit 1 takes over.
        for _ in 0..10 {
            out.clear();
            t.alloc(layout, PoolKind::Kv, 1, &mut out).unwrap();
            let h = out[0];
            assert!(!issued.contains(&h), "{h:?} issued twice");
            t.free(layout, h).unwrap();
            issued.push(h);
        }
        assert_eq!(t.retired_total(), 1);
        assert_eq!((t.capacity(), t.extent(), t.free_units()), (1, 2, 1));
        for &h in &issued {
            assert!(t.check_live(layout, h).is_err());
        }
        // Shrinking past the retired unit and growing back keeps it retired.
        assert!(t.shrink(0));
        assert!(t.grow(4));
        assert_eq!((t.capacity(), t.extent(), t.free_units()), (3, 4, 3));
        out.clear();
        t.alloc(layout, PoolKind::Kv, 3, &mut out).unwrap();
        assert!(out.iter().all(|&h| layout.index_of(h) != 0));
        assert!(t.alloc(layout, PoolKind::Kv, 1, &mut out).is_err());
    }
}
