//! One pool of equal-size units: a free list with the prototype's exact order,
//! per-slot generations, and tail shrink / grow for capacity migration.

use std::collections::BTreeSet;

use crate::error::AllocError;
use crate::handle::{HandleLayout, PoolKind, VirtualHandle};

#[derive(Debug, Clone, Copy, Default)]
struct Slot {
    generation: u32,
    live: bool,
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
    fn extend(&mut self, r: std::ops::Range<u32>) {
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

/// A table of `capacity` units of `unit_bytes` each, indexable up to `max_units`.
///
/// Free-list order is part of the contract (the AVMP replay depends on it): it
/// starts as `[n-1, ..., 1, 0]` and pops from the end (lowest ids first), frees
/// append, shrink filters keeping order, grow appends the new ids ascending.
#[derive(Debug, Clone)]
pub(crate) struct UnitTable {
    pub(crate) kind: PoolKind,
    pub(crate) unit_bytes: u64,
    capacity: u32,
    free: FreeList,
    slots: Vec<Slot>,
    live: u32,
}

impl UnitTable {
    pub(crate) fn new(kind: PoolKind, unit_bytes: u64, capacity: u32, max_units: u32) -> Self {
        debug_assert!(capacity <= max_units);
        UnitTable {
            kind,
            unit_bytes,
            capacity,
            free: FreeList::Stack((0..capacity).rev().collect()),
            slots: vec![Slot::default(); max_units as usize],
            live: 0,
        }
    }

    /// Switches to lowest-index-first allocation (keeps the free units).
    pub(crate) fn set_lowest_first(&mut self) {
        if let FreeList::Stack(v) = &self.free {
            self.free = FreeList::Lowest(v.iter().copied().collect());
        }
    }

    pub(crate) fn capacity(&self) -> u32 {
        self.capacity
    }

    pub(crate) fn max_units(&self) -> u32 {
        // Cannot truncate: built from a u32.
        self.slots.len() as u32
    }

    pub(crate) fn free_units(&self) -> u32 {
        // Cannot truncate: the free list never holds more than `capacity` ids.
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
                capacity: self.capacity,
            });
        }
        out.reserve(n as usize);
        for _ in 0..n {
            let Some(idx) = self.free.pop() else {
                unreachable!("length checked above")
            };
            let slot = &mut self.slots[idx as usize];
            slot.generation = layout.next_generation(slot.generation);
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
        let (_, idx, generation) = layout.decode(h);
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
        self.slots[idx as usize].live = false;
        self.free.push(idx);
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
        self.slots[new as usize..self.capacity as usize]
            .iter()
            .all(|s| !s.live)
    }

    /// Shrinks to `new` units; fails (unchanged) if a live unit sits at or above `new`.
    pub(crate) fn shrink(&mut self, new: u32) -> bool {
        if new > self.capacity || !self.tail_is_free(new) {
            return false;
        }
        self.free.retain_below(new);
        self.capacity = new;
        self.check();
        true
    }

    /// Grows to `new` units (at most `max_units`), appending `old..new` ascending.
    pub(crate) fn grow(&mut self, new: u32) -> bool {
        if new < self.capacity || new > self.max_units() {
            return false;
        }
        self.free.extend(self.capacity..new);
        self.capacity = new;
        self.check();
        true
    }

    /// Recount invariant (strict-checks only): free + live == capacity, and every
    /// free id is below capacity and not live.
    fn check(&self) {
        #[cfg(feature = "strict-checks")]
        {
            assert_eq!(self.free.len() as u32 + self.live, self.capacity);
            let live = self.slots[..self.capacity as usize]
                .iter()
                .filter(|s| s.live)
                .count() as u32;
            assert_eq!(live, self.live, "live recount");
            assert!(self.slots[self.capacity as usize..].iter().all(|s| !s.live));
            for i in self.free.iter() {
                assert!(i < self.capacity && !self.slots[i as usize].live);
            }
        }
    }
}
