//! Beyond the paper: a migration policy that acts before eviction.
//!
//! The paper's trigger (§3.2) migrates only after an eviction has already failed
//! to make room, so every migration costs a request its cached state first. This
//! policy looks at the allocation *before* evicting: when the target pool cannot
//! satisfy it and the other pool is mostly free, it moves capacity in 2 MiB steps
//! (the physical chunk granularity, so each step is one `map`/`unmap` on the
//! device) until the request fits or the donor's free tail runs out. The paper's
//! forced path stays behind it as the fallback.

use crate::alloc::PoolAllocator;
use crate::handle::PoolKind;

/// Physical chunk size the steps are sized to.
pub const CHUNK_BYTES: u64 = 2 << 20;

/// The donor must have more than this fraction of its units free.
pub const DONOR_FREE_FRACTION: f64 = 0.5;

/// Before evicting for an allocation of `n` units of `pool`, migrate chunk-sized
/// steps from the other pool while it stays more than half free. Returns the
/// number of steps taken. Refusals (tail in use, budget) just stop the loop.
pub fn proactive_before_evict(alloc: &mut dyn PoolAllocator, pool: PoolKind, n: u32) -> u32 {
    let donor = pool.other();
    let step_units = u32::try_from((CHUNK_BYTES / alloc.unit_bytes(donor)).max(1)).unwrap_or(1);
    let mut steps = 0;
    while alloc.free_units(pool) < n {
        let cap = alloc.capacity(donor);
        let free = alloc.free_units(donor);
        if cap == 0
            || f64::from(free.saturating_sub(step_units)) <= DONOR_FREE_FRACTION * f64::from(cap)
        {
            break;
        }
        if alloc.migrate_units_toward(pool, step_units).is_err() {
            break;
        }
        steps += 1;
    }
    steps
}
