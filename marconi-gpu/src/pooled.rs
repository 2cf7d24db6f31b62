//! The prefix cache over real pools: [`PooledCache`] joins a
//! [`marconi_core::PrefixCache`] (the decisions) with a [`PoolAllocator`] (the
//! memory: [`crate::DualPool`] static split or AVMP migration,
//! [`crate::PaddedUnified`], or [`crate::phys::BackedPool`] over memfd or CUDA).
//!
//! Core stays pure: it never sees the allocator. The ids it tracks are the
//! handles' unit indices ([`PoolAllocator::unit_index`]; a unit the cache
//! holds is live, so its pool's [`PoolAllocator::live_handle_at`] rebuilds
//! the handle, generation included), and its capacity is
//! the pools' own, handed to it as a [`UnitBudget`] (KV pages and state
//! slots, or both in one shared table) after every change: the pools'
//! capacities less the units held outside the cache (by requests in
//! flight). The byte capacity of the cache's configuration is set to the
//! pools' total bytes, which cannot bind before the unit budget does (every
//! unit is at least as large as what core charges for it), so there is no
//! second budget that could disagree with the pools.
//!
//! # The request cycle
//!
//! 1. [`lookup`](PooledCache::lookup): the hit, its pages and state slot as
//!    handles (the cache's: read them, never free them), a lease, the plan.
//! 2. [`reserve`](PooledCache::reserve): working memory for the request (KV
//!    pages past the hit, a slot per state to save). When a pool is short,
//!    capacity is found as described below; if it cannot be, the request is
//!    refused for lack of memory ([`PooledError::OutOfMemory`]).
//! 3. [`admit`](PooledCache::admit) the sequence with its pages and saved
//!    states: the cache takes the units it keeps; the others stay the
//!    caller's ([`PooledAdmit::returned`]). Every handle passed is one the
//!    caller holds, except that a page position may carry the page the
//!    cache holds there for this lease (the lookup's hit pages, and the
//!    pages an earlier admit of the lease took), so a cached page is never
//!    handed back as the caller's.
//! 4. [`free`](PooledCache::free) the caller's units, [`release`](PooledCache::release)
//!    the lease. Evicted units go back to their pool at once; their handles
//!    are listed by [`drain_freed`](PooledCache::drain_freed).
//!
//! [`serve`](PooledCache::serve) runs the whole cycle for simulation.
//!
//! # When a pool is full: migrate or evict
//!
//! A reservation short of `d` units in pool K (the other pool: D) is met in
//! this order, re-checked after each step:
//!
//! 1. **Migrate free capacity** (layouts that migrate): D's free tail, less
//!    what this same reservation needs from D, moves to K in steps of one
//!    physical chunk ([`PoolAllocator::migration_step_bytes`]: 2 MiB on a
//!    GPU), sized to the deficit, largest free tail first. Free capacity serves nobody, so moving it
//!    loses no cached entry.
//! 2. **Evict by utility.** With a layout that migrates, the victim is the
//!    lowest-utility candidate of the whole cache (its eviction order:
//!    FLOP-aware or LRU), whichever kind it frees: if it frees D units, step
//!    1 runs again and may move them (the allocation order keeps live units
//!    low in each pool, so freed units gather at the tail). Such evictions
//!    are bounded per reservation by the donor units the deficit needs (plus
//!    one step); past that bound, and always for a static split, the victim
//!    is the lowest-utility candidate that frees a unit of K. With one shared
//!    table any victim helps.
//!
//! So utility decides what leaves memory, and migration decides where the
//! freed capacity goes. [`PooledStats`] counts migrations, bytes moved,
//! evictions made for memory and those that freed only the other kind.
//!
//! # Invariants (checked by [`check_invariants`](PooledCache::check_invariants))
//!
//! - every handle the cache holds is live in its pool, and the cache holds
//!   exactly as many pages and states as core counts;
//! - units held by the cache plus units held by the caller are the pools'
//!   live units (nothing leaks, nothing is counted twice);
//! - the unit budget core sees is the pools' capacity less the caller's
//!   units, and what is cached fits it.

use std::collections::{HashMap, HashSet};

use marconi_core::{
    AdmitOutcome, CacheConfig, CacheError, Freed, LeaseId, Lookup, LookupOptions, ModelSpec,
    PrefixCache, SavedState, Stats, Tier, TierConfig, TierOp, TieredCache, TieredLookup,
    UnitBudget, UnitKind, UnitUse, WriteMode,
};
use serde::Serialize;

use crate::alloc::{
    align_up, DualPool, DualPoolConfig, Location, MigrationPolicy, PaddedUnified, PoolAllocator,
    UNIT_ALIGN,
};
use crate::error::AllocError;
use crate::handle::{PoolKind, VirtualHandle};

/// Unit sizes of the two pools for `model` with `page_size`-token pages:
/// `(kv_page_bytes, state_slot_bytes)`, each aligned to 128 bytes. A state
/// slot holds one whole checkpoint (every recurrent layer). A model without
/// attention layers still has pages (of token ids, 4 bytes a token, as core
/// charges them); one without recurrent layers has no state slots (0).
#[must_use]
pub fn unit_sizes(model: &ModelSpec, page_size: u32) -> (u64, u64) {
    let per_token = match model.kv_bytes_per_token() {
        0 => marconi_core::TOKEN_ID_BYTES,
        b => b,
    };
    let kv = per_token.saturating_mul(u64::from(page_size));
    let state = model.state_bytes();
    (
        align_up(kv, UNIT_ALIGN),
        if state == 0 {
            0
        } else {
            align_up(state, UNIT_ALIGN)
        },
    )
}

/// How a device budget is laid out as pools.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub enum PoolLayout {
    /// Two pools, a fixed split: `ssm_fraction` of the budget for state
    /// slots (SGLang's hand-chosen fraction).
    Static {
        /// Fraction of the budget given to state slots, in (0, 1).
        ssm_fraction: f64,
    },
    /// Two pools starting at `ssm_fraction`, capacity migrating on demand
    /// (AVMP, with the migrate-or-evict rule of this module).
    Avmp {
        /// Fraction of the budget given to state slots at start, in (0, 1).
        ssm_fraction: f64,
    },
    /// One table of padded units shared by pages and slots (vLLM's layout).
    Unified,
}

/// The [`DualPool`] of a two-pool layout for `model` (units from
/// [`unit_sizes`]), allocating lowest units first. `Unified` is refused here
/// (see [`build_pool`]).
pub fn dual_pool(
    model: &ModelSpec,
    page_size: u32,
    total_bytes: u64,
    layout: PoolLayout,
) -> Result<DualPool, AllocError> {
    let (kv_unit, ssm_unit) = unit_sizes(model, page_size);
    let (ssm_ratio, policy) = match layout {
        PoolLayout::Static { ssm_fraction } => (ssm_fraction, MigrationPolicy::Static),
        PoolLayout::Avmp { ssm_fraction } => (ssm_fraction, MigrationPolicy::forced(1)),
        PoolLayout::Unified => {
            return Err(AllocError::InvalidConfig(
                "the unified layout is not a dual pool".into(),
            ))
        }
    };
    let mut pool = DualPool::new(
        match layout {
            PoolLayout::Static { .. } => "static",
            _ => "avmp",
        },
        DualPoolConfig {
            total_bytes,
            ssm_ratio,
            kv_unit,
            ssm_unit,
            policy,
        },
    )?;
    pool.set_lowest_first();
    Ok(pool)
}

/// The allocator of any layout, boxed (host-only bookkeeping, no backing:
/// for simulation and planning; back a [`DualPool`] with
/// [`crate::phys::BackedPool`] for real memory).
pub fn build_pool(
    model: &ModelSpec,
    page_size: u32,
    total_bytes: u64,
    layout: PoolLayout,
) -> Result<Box<dyn PoolAllocator + Send>, AllocError> {
    Ok(match layout {
        PoolLayout::Unified => {
            let (kv_unit, ssm_unit) = unit_sizes(model, page_size);
            Box::new(PaddedUnified::new(total_bytes, kv_unit, ssm_unit)?)
        }
        _ => Box::new(dual_pool(model, page_size, total_bytes, layout)?),
    })
}

fn kind_of(pool: PoolKind) -> UnitKind {
    match pool {
        PoolKind::Kv => UnitKind::Page,
        PoolKind::Ssm => UnitKind::State,
    }
}

/// Why a call on a [`PooledCache`] was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PooledError {
    /// The cache refused the call (nothing changed).
    #[error(transparent)]
    Cache(#[from] CacheError),
    /// The allocator failed.
    #[error(transparent)]
    Alloc(#[from] AllocError),
    /// A reservation could not be met even after migrating what could move
    /// and evicting every unleased entry: the request is refused for lack of
    /// memory. Nothing was allocated; entries evicted on the way stay
    /// evicted (each eviction was a valid step; their handles are in
    /// [`PooledCache::drain_freed`]).
    #[error("out of memory: {requested} units of the {pool} pool requested, {free} free")]
    OutOfMemory {
        /// The pool that stayed short.
        pool: PoolKind,
        /// Units requested from it.
        requested: u32,
        /// Units it had free at the end.
        free: u32,
    },
    /// A handle passed in is not one the caller holds (never reserved,
    /// already freed, taken by the cache, of another pool, or a page the
    /// cache holds for another position or prefix).
    #[error("handle {handle:#018x} is not a {expected} unit the caller holds")]
    NotCallers {
        /// The raw handle.
        handle: u64,
        /// The pool it was expected in.
        expected: PoolKind,
    },
    /// A handle is listed twice in one call.
    #[error("{kind} handle {handle:#018x} listed twice")]
    Duplicate {
        /// The raw handle.
        handle: u64,
        /// Its pool kind.
        kind: PoolKind,
    },
    /// The cache cannot run over these pools.
    #[error("invalid pooled configuration: {0}")]
    InvalidConfig(String),
}

/// A state the engine saved into a slot it reserved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PooledState {
    /// Tokens the state covers.
    pub position: u32,
    /// The slot holding it (from [`PooledCache::reserve`]).
    pub slot: VirtualHandle,
}

/// What [`PooledCache::lookup`] found, with handles.
#[derive(Debug, Clone, PartialEq)]
pub struct PooledLookup {
    /// Core's lookup (ids are the handles' unit indices).
    pub lookup: Lookup,
    /// The cache's pages of the first `hit_tokens` tokens (read-only for the
    /// caller, valid while the lease is held).
    pub kv_pages: Vec<VirtualHandle>,
    /// The cache's state slot to resume from (copy it into a slot of the
    /// request's own), when there is a device hit.
    pub state_slot: Option<VirtualHandle>,
    /// With lower tiers ([`PooledCache::with_tiers`]): the lookup of every
    /// tier. Its `hit_tokens` may pass the device's (a host or store hit):
    /// the engine then carries out its `loads` into units it reserved, and
    /// its `plan` (not the device's) says which states to save. Its KV
    /// loads start where `kv_pages` ends (KV the device matched past its
    /// hit is loaded too: the engine holds no handle for it). `None`
    /// without tiers.
    pub tiered: Option<TieredLookup>,
}

/// Units reserved for a request: the caller's until admitted or freed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Reserved {
    /// KV pages.
    pub kv_pages: Vec<VirtualHandle>,
    /// State slots.
    pub state_slots: Vec<VirtualHandle>,
}

/// What [`PooledCache::admit`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PooledAdmit {
    /// Core's outcome (ids are the handles' unit indices).
    pub outcome: AdmitOutcome,
    /// Pages and slots the cache took (now the cache's).
    pub taken: Vec<VirtualHandle>,
    /// Pages and slots passed in that stay the caller's (free or reuse them).
    pub returned: Vec<VirtualHandle>,
}

/// One simulated request through [`PooledCache::serve`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct PooledServed {
    /// Tokens skipped.
    pub hit_tokens: u32,
    /// Whether the request was refused for lack of memory (its working
    /// pages and slots could not be reserved).
    pub refused: bool,
    /// Whether the admission cached nothing.
    pub rejected: bool,
}

/// Counters of the joined system.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct PooledStats {
    /// Reservations made.
    pub reservations: u64,
    /// Reservations refused for lack of memory.
    pub refused: u64,
    /// Capacity migrations made by reservations.
    pub migrations: u64,
    /// Bytes the donor pools gave up in those migrations.
    pub bytes_migrated: u64,
    /// Evictions made to meet reservations.
    pub evictions_for_memory: u64,
    /// Of those, evictions that freed only units of the other pool (a
    /// migrating layout's utility-ordered victims; they help only when their
    /// units can migrate).
    pub evictions_other_kind: u64,
}

/// A prefix cache whose memory is a [`PoolAllocator`]'s two pools. See the
/// module documentation for the cycle, the migrate-or-evict rule and the
/// invariants.
#[derive(Debug)]
pub struct PooledCache<A: PoolAllocator> {
    cache: Device,
    pool: A,
    page_size: u32,
    /// Raw handles the cache holds.
    held: HashSet<u64>,
    /// Raw handles the caller holds (reserved, not yet admitted or freed).
    callers: HashSet<u64>,
    /// Per open lease, the raw handle of the page the cache holds at each
    /// page position of its sequence (0: none known): the lookup's hit
    /// pages, then the pages its admits took.
    lease_pages: HashMap<LeaseId, Vec<u64>>,
    /// Units the caller holds, by pool.
    callers_units: [u64; 2],
    /// Handles evicted (already back in their pool) since the last drain.
    freed: Vec<VirtualHandle>,
    stats: PooledStats,
}

/// The cache deciding over the pools: the device cache alone, or with
/// lower tiers (its lookups kept per lease: admit and release need them).
#[expect(
    clippy::large_enum_variant,
    reason = "the plain cache stays inline: no indirection on its request path"
)]
enum Device {
    Plain(PrefixCache),
    Tiered(Box<TieredCache>, HashMap<LeaseId, TieredLookup>),
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Plain(c) => f.debug_tuple("Plain").field(c).finish(),
            Device::Tiered(t, l) => f
                .debug_struct("Tiered")
                .field("device", t.device())
                .field("leases", &l.len())
                .finish(),
        }
    }
}

impl Device {
    fn get(&self) -> &PrefixCache {
        match self {
            Device::Plain(c) => c,
            Device::Tiered(t, _) => t.device(),
        }
    }

    fn set_unit_budget(&mut self, b: UnitBudget) -> Result<(), CacheError> {
        match self {
            Device::Plain(c) => c.set_unit_budget(Some(b)),
            Device::Tiered(t, _) => t.set_device_unit_budget(Some(b)),
        }
    }

    fn evict_lowest(&mut self, kind: Option<UnitKind>) -> Result<Option<UnitUse>, CacheError> {
        match self {
            Device::Plain(c) => Ok(c.evict_lowest(kind)),
            Device::Tiered(t, _) => t.evict_lowest(kind),
        }
    }

    fn drain_freed(&mut self) -> Freed {
        match self {
            Device::Plain(c) => c.drain_freed(),
            Device::Tiered(t, _) => t.drain_freed(),
        }
    }
}

impl<A: PoolAllocator> PooledCache<A> {
    /// A cache built from `cfg` over `pool`. `cfg.capacity_bytes` is
    /// replaced by the pools' total bytes (the pools are the capacity).
    /// Refused when a pool's units are smaller than what core charges for a
    /// page (`page_size` × KV bytes per token) or a state, or when the model
    /// has no recurrent layers (a cache over two pools needs both kinds), or
    /// when the pools hold live units already.
    pub fn new(cfg: CacheConfig, pool: A) -> Result<Self, PooledError> {
        Self::build(cfg, None, pool)
    }

    /// [`new`](Self::new) with lower tiers below the pools
    /// ([`TieredCache`]; `tiers.host` and `tiers.store` keep their own
    /// byte capacities). The tiers are written through
    /// ([`WriteMode::Through`]): a chain goes down when it is admitted,
    /// so the units an eviction frees hold nothing still to copy and go
    /// back to their pool at once. (Written back, an eviction's copy would
    /// read units the same [`reserve`](Self::reserve) hands out again.) A
    /// host `Write` of [`drain_tier_ops`](Self::drain_tier_ops) after an
    /// [`admit`](Self::admit) copies a chain of that admission: the state
    /// in the slot given for its position, the KV in the first
    /// `ceil(position / page_size)` pages given; the engine carries it out
    /// before it frees or reuses those units.
    ///
    /// # Errors
    /// As [`new`](Self::new), and [`PooledError::InvalidConfig`] for
    /// write-back tiers or [`TierConfig::defer_moves`] (the moves are made
    /// at admission).
    pub fn with_tiers(cfg: CacheConfig, tiers: TierConfig, pool: A) -> Result<Self, PooledError> {
        if tiers.host.is_some() && tiers.write != WriteMode::Through {
            return Err(PooledError::InvalidConfig(
                "tiers below pools are written through (WriteMode::Through): written back, an \
                 eviction's copy would read units the same reservation hands out"
                    .into(),
            ));
        }
        if tiers.defer_moves {
            return Err(PooledError::InvalidConfig(
                "tiers below pools move at admission: defer_moves is not supported".into(),
            ));
        }
        Self::build(cfg, Some(tiers), pool)
    }

    fn build(
        mut cfg: CacheConfig,
        tiers: Option<TierConfig>,
        pool: A,
    ) -> Result<Self, PooledError> {
        let (kv, state) = unit_sizes(&cfg.model, cfg.page_size);
        if state == 0 {
            return Err(PooledError::InvalidConfig(
                "the model has no recurrent layers: use a plain PrefixCache".into(),
            ));
        }
        for (p, need) in [(PoolKind::Kv, kv), (PoolKind::Ssm, state)] {
            let have = pool.unit_bytes(p);
            if have < need {
                return Err(PooledError::InvalidConfig(format!(
                    "{p} units are {have} bytes, need at least {need} for this model and page size"
                )));
            }
        }
        for p in PoolKind::ALL {
            if pool.free_units(p) != pool.capacity(p) {
                return Err(PooledError::InvalidConfig(format!(
                    "the {p} pool already has live units"
                )));
            }
        }
        cfg.capacity_bytes = pool.total_bytes().max(1);
        let page_size = cfg.page_size;
        let cache = match tiers {
            None => Device::Plain(PrefixCache::new(cfg)?),
            Some(t) => Device::Tiered(Box::new(TieredCache::new(cfg, t)?), HashMap::new()),
        };
        let mut me = PooledCache {
            cache,
            pool,
            page_size,
            held: HashSet::new(),
            callers: HashSet::new(),
            lease_pages: HashMap::new(),
            callers_units: [0; 2],
            freed: Vec::new(),
            stats: PooledStats::default(),
        };
        me.update_budget()?;
        Ok(me)
    }

    /// The cache (its statistics, configuration, invariants); with tiers,
    /// the device's.
    pub fn cache(&self) -> &PrefixCache {
        self.cache.get()
    }

    /// The tiers, when built [`with_tiers`](Self::with_tiers) (read only:
    /// their counters, capacities and lower caches).
    pub fn tiers(&self) -> Option<&TieredCache> {
        match &self.cache {
            Device::Plain(_) => None,
            Device::Tiered(t, _) => Some(t),
        }
    }

    /// The tiered lookup of an outstanding `lease` (its loads, tier and
    /// plan), with tiers.
    pub fn tiered_lookup(&self, lease: LeaseId) -> Option<&TieredLookup> {
        match &self.cache {
            Device::Plain(_) => None,
            Device::Tiered(_, l) => l.get(&lease),
        }
    }

    /// Records the tiers' writes and drops for
    /// [`drain_tier_ops`](Self::drain_tier_ops) ([`TieredCache::record_ops`]);
    /// a no-op without tiers.
    pub fn record_tier_ops(&mut self, on: bool) {
        if let Device::Tiered(t, _) = &mut self.cache {
            t.record_ops(on);
        }
    }

    /// The tiers' writes and drops since the last call, in order (empty
    /// without tiers or unless recorded). See [`with_tiers`](Self::with_tiers)
    /// for what a host write reads.
    pub fn drain_tier_ops(&mut self) -> Vec<TierOp> {
        match &mut self.cache {
            Device::Plain(_) => Vec::new(),
            Device::Tiered(t, _) => t.drain_ops(),
        }
    }

    /// Runs what the tiers left waiting ([`TieredCache::settle`]); a no-op
    /// without tiers.
    pub fn settle(&mut self) -> Result<(), PooledError> {
        if let Device::Tiered(t, _) = &mut self.cache {
            t.settle()?;
        }
        self.collect_evicted()
    }

    /// The allocator (resolve handles, read capacities and counters).
    pub fn pool(&self) -> &A {
        &self.pool
    }

    /// The allocator, mutably (for backends that write units, such as
    /// [`crate::phys::BackedPool::write_unit`]). Allocating or freeing
    /// through it directly breaks the accounting: use
    /// [`reserve`](Self::reserve) and [`free`](Self::free).
    pub fn pool_mut(&mut self) -> &mut A {
        &mut self.pool
    }

    /// Core's counters.
    pub fn cache_stats(&self) -> Stats {
        self.cache.get().stats()
    }

    /// Core's decision records since the last call (empty unless
    /// `CacheConfig::decision_log` is set); draining them changes no unit.
    pub fn drain_log(&mut self) -> Vec<marconi_core::Decision> {
        match &mut self.cache {
            Device::Plain(c) => c.drain_log(),
            Device::Tiered(t, _) => t.drain_device_log(),
        }
    }

    /// Turns the cache's event stream on (see
    /// [`PrefixCache::enable_events`]): the next drain starts with the
    /// current content. Events speak of tokens only, never of units, so a
    /// subscriber sees the same stream as over ids an engine owns.
    ///
    /// # Errors
    /// With tiers, an error of the moves it runs first
    /// ([`TieredCache::enable_device_events`]).
    pub fn enable_events(&mut self) -> Result<(), PooledError> {
        match &mut self.cache {
            Device::Plain(c) => c.enable_events(),
            Device::Tiered(t, _) => t.enable_device_events()?,
        }
        Ok(())
    }

    /// Turns the event stream off and drops the pending events.
    pub fn disable_events(&mut self) {
        match &mut self.cache {
            Device::Plain(c) => c.disable_events(),
            Device::Tiered(t, _) => t.disable_device_events(),
        }
    }

    /// The events since the last drain (empty while the stream is off);
    /// draining them changes no unit.
    pub fn drain_events(&mut self) -> Vec<marconi_core::CacheEvent> {
        match &mut self.cache {
            Device::Plain(c) => c.drain_events(),
            Device::Tiered(t, _) => t.drain_device_events(),
        }
    }

    /// The joined system's counters.
    pub fn stats(&self) -> PooledStats {
        self.stats
    }

    /// Resolves a live handle (the cache's or the caller's) to its location.
    pub fn resolve(&self, h: VirtualHandle) -> Result<Location, PooledError> {
        Ok(self.pool.resolve(h)?)
    }

    /// Handles the cache holds now (order unspecified).
    pub fn held_handles(&self) -> Vec<VirtualHandle> {
        self.held
            .iter()
            .map(|&r| VirtualHandle::from_raw(r))
            .collect()
    }

    /// Handles evicted since the last call; they are already back in their
    /// pool (stale: the allocator refuses them).
    pub fn drain_freed(&mut self) -> Vec<VirtualHandle> {
        std::mem::take(&mut self.freed)
    }

    /// The budget the cache may fill: each pool's capacity less the caller's
    /// units (one shared table: its capacity less all of them).
    fn budget(&self) -> UnitBudget {
        let cap = |p: PoolKind| u64::from(self.pool.capacity(p));
        if self.pool.shares_capacity() {
            UnitBudget::Shared {
                units: cap(PoolKind::Kv)
                    .saturating_sub(self.callers_units[0] + self.callers_units[1]),
            }
        } else {
            UnitBudget::Split {
                pages: cap(PoolKind::Kv).saturating_sub(self.callers_units[0]),
                states: cap(PoolKind::Ssm).saturating_sub(self.callers_units[1]),
            }
        }
    }

    fn update_budget(&mut self) -> Result<(), PooledError> {
        let b = self.budget();
        self.cache.set_unit_budget(b)?;
        Ok(())
    }

    /// The handle of the unit core knows as `id` of `kind`: the live handle at
    /// that index (the cache holds the unit, so it is live).
    fn handle_of(&self, kind: PoolKind, id: u32) -> Result<VirtualHandle, PooledError> {
        self.pool
            .live_handle_at(kind, id)
            .ok_or_else(|| AllocError::ForeignHandle(u64::from(id)).into())
    }

    /// Returns every unit core evicted to its pool.
    fn collect_evicted(&mut self) -> Result<(), PooledError> {
        let f = self.cache.drain_freed();
        let units = f
            .kv_pages
            .into_iter()
            .map(|i| (PoolKind::Kv, i))
            .chain(f.state_slots.into_iter().map(|i| (PoolKind::Ssm, i)));
        for (kind, id) in units {
            let h = self.handle_of(kind, id)?;
            let was_held = self.held.remove(&h.raw());
            debug_assert!(was_held, "core freed a handle it did not hold");
            self.pool.free(h)?;
            self.freed.push(h);
        }
        Ok(())
    }

    /// Looks up `input` in namespace `ns`; see [`PrefixCache::lookup`].
    pub fn lookup(&mut self, ns: u64, input: &[u32]) -> Result<PooledLookup, PooledError> {
        self.lookup_hinted(ns, input, &[])
    }

    /// [`lookup`](Self::lookup) with application checkpoint hints
    /// (`PrefixCache::lookup_hinted`): the kept hints are in the plan, and
    /// their states are reserved and admitted like the others.
    pub fn lookup_hinted(
        &mut self,
        ns: u64,
        input: &[u32],
        checkpoints: &[u32],
    ) -> Result<PooledLookup, PooledError> {
        self.lookup_opts(ns, input, checkpoints, LookupOptions::default(), false)
    }

    /// [`lookup_hinted`](Self::lookup_hinted) with core's lookup options
    /// (`opts.whole_input`; the hit's pages are always given: admissions
    /// check them) and, with tiers, `device_only`: the device's view (no
    /// lower-tier hit chosen, pinned or counted; see
    /// [`TieredCache::lookup_opts`]).
    pub fn lookup_opts(
        &mut self,
        ns: u64,
        input: &[u32],
        checkpoints: &[u32],
        opts: LookupOptions,
        device_only: bool,
    ) -> Result<PooledLookup, PooledError> {
        let opts = LookupOptions {
            skip_kv_pages: false,
            ..opts
        };
        let plain = opts == LookupOptions::default() && checkpoints.is_empty();
        let (lookup, tiered) = match &mut self.cache {
            Device::Plain(c) if plain => (c.lookup(ns, input)?, None),
            Device::Plain(c) => (c.lookup_hinted_with(ns, input, checkpoints, opts)?, None),
            Device::Tiered(t, _) => {
                let tl = t.lookup_opts(ns, input, checkpoints, None, opts, device_only)?;
                (tl.device.clone(), Some(tl))
            }
        };
        let pages: Result<Vec<VirtualHandle>, PooledError> = lookup
            .kv_pages
            .iter()
            .map(|&i| self.handle_of(PoolKind::Kv, i))
            .collect();
        let slot = lookup
            .state_slot
            .map(|i| self.handle_of(PoolKind::Ssm, i))
            .transpose();
        let (kv_pages, state_slot) = match (pages, slot) {
            (Ok(p), Ok(s)) => (p, s),
            (Err(e), _) | (_, Err(e)) => {
                match (&mut self.cache, &tiered) {
                    (Device::Tiered(t, _), Some(tl)) => t.release(tl)?,
                    (c, _) => release_plain(c, lookup.lease)?,
                }
                return Err(e);
            }
        };
        self.lease_pages
            .insert(lookup.lease, kv_pages.iter().map(|h| h.raw()).collect());
        if let (Device::Tiered(_, leases), Some(tl)) = (&mut self.cache, &tiered) {
            leases.insert(lookup.lease, tl.clone());
        }
        Ok(PooledLookup {
            kv_pages,
            state_slot,
            lookup,
            tiered,
        })
    }

    /// The checkpoints planned for `lease`.
    /// With tiers, the tiered lookup's plan.
    pub fn plan(&self, lease: LeaseId) -> Result<&[u32], PooledError> {
        match &self.cache {
            Device::Plain(c) => Ok(c.plan(lease)?),
            Device::Tiered(_, l) => l
                .get(&lease)
                .map(|t| t.plan.as_slice())
                .ok_or_else(|| CacheError::UnknownLease(lease).into()),
        }
    }

    /// Releases `lease`.
    pub fn release(&mut self, lease: LeaseId) -> Result<(), PooledError> {
        match &mut self.cache {
            Device::Plain(c) => c.release(lease)?,
            Device::Tiered(t, l) => {
                let tl = l.remove(&lease).ok_or(CacheError::UnknownLease(lease))?;
                t.release(&tl)?;
            }
        }
        self.lease_pages.remove(&lease);
        self.collect_evicted()
    }

    /// Reserves `kv_pages` pages and `state_slots` slots for a request,
    /// migrating free capacity and evicting by utility as needed (module
    /// documentation); all or nothing. The units are the caller's until
    /// admitted or freed.
    pub fn reserve(&mut self, kv_pages: u32, state_slots: u32) -> Result<Reserved, PooledError> {
        let want = [kv_pages, state_slots];
        // Beyond what the whole budget could ever hold: refused up front,
        // nothing evicted.
        let c = self.callers_units;
        let impossible = if self.pool.shares_capacity() {
            u64::from(kv_pages) + u64::from(state_slots) + c[0] + c[1]
                > u64::from(self.pool.capacity(PoolKind::Kv))
        } else {
            PoolKind::ALL.iter().any(|&p| {
                let limit = if self.pool.migrates() {
                    self.pool.total_bytes() / self.pool.unit_bytes(p).max(1)
                } else {
                    u64::from(self.pool.capacity(p))
                };
                u64::from(want[p.index()]) + c[p.index()] > limit
            })
        };
        self.stats.reservations += 1;
        if impossible {
            self.stats.refused += 1;
            let p = if self.pool.shares_capacity() || kv_pages > 0 {
                PoolKind::Kv
            } else {
                PoolKind::Ssm
            };
            return Err(PooledError::OutOfMemory {
                pool: p,
                requested: want[p.index()],
                free: self.pool.free_units(p),
            });
        }
        if let Err(e) = self.make_free(want) {
            if matches!(e, PooledError::OutOfMemory { .. }) {
                self.stats.refused += 1;
            }
            self.update_budget()?;
            return Err(e);
        }
        let mut out = Reserved::default();
        self.pool
            .allocate(PoolKind::Kv, kv_pages, &mut out.kv_pages)?;
        if let Err(e) = self
            .pool
            .allocate(PoolKind::Ssm, state_slots, &mut out.state_slots)
        {
            for h in out.kv_pages.drain(..) {
                self.pool.free(h)?;
            }
            return Err(e.into());
        }
        for (p, hs) in [(0, &out.kv_pages), (1, &out.state_slots)] {
            self.callers_units[p] += hs.len() as u64;
            self.callers.extend(hs.iter().map(|h| h.raw()));
        }
        self.update_budget()?;
        Ok(out)
    }

    /// Free units of each pool, counting a shared table once for both.
    fn short_pool(&self, want: [u32; 2]) -> Option<(PoolKind, u32)> {
        if self.pool.shares_capacity() {
            let need = want[0].saturating_add(want[1]);
            let free = self.pool.free_units(PoolKind::Kv);
            return (free < need).then(|| (PoolKind::Kv, need - free));
        }
        PoolKind::ALL.iter().find_map(|&p| {
            let free = self.pool.free_units(p);
            (free < want[p.index()]).then(|| (p, want[p.index()] - free))
        })
    }

    /// Migrates and evicts until both pools have `want` free units.
    fn make_free(&mut self, want: [u32; 2]) -> Result<(), PooledError> {
        let migrates = self.pool.migrates() && !self.pool.shares_capacity();
        let mut other_kind_left: Option<u64> = None;
        while let Some((k, deficit)) = self.short_pool(want) {
            if migrates && self.migrate_for(k, deficit, want[k.other().index()]) {
                continue;
            }
            // Evictions that free only the other pool are allowed as long as
            // they could fund the deficit by migration.
            let bound = other_kind_left.get_or_insert_with(|| {
                let (uk, ud) = (self.pool.unit_bytes(k), self.pool.unit_bytes(k.other()));
                (u64::from(deficit) * uk).div_ceil(ud.max(1)) + self.step_units(k)
            });
            let shared = self.pool.shares_capacity();
            let filter = if shared || (migrates && *bound > 0) {
                None
            } else {
                Some(kind_of(k))
            };
            // The cache may fill its budget only: the caller's units count.
            let Some(freed) = self.cache.evict_lowest(filter)? else {
                let free = self.pool.free_units(k);
                return Err(PooledError::OutOfMemory {
                    pool: k,
                    requested: want[k.index()],
                    free,
                });
            };
            self.stats.evictions_for_memory += 1;
            let helps = match k {
                PoolKind::Kv => freed.pages > 0,
                PoolKind::Ssm => freed.states > 0,
            };
            if !helps && !shared {
                self.stats.evictions_other_kind += 1;
                if let Some(b) = other_kind_left.as_mut() {
                    *b = b.saturating_sub(1);
                }
            }
            self.collect_evicted()?;
            self.update_budget()?;
        }
        Ok(())
    }

    /// Moves free capacity from the other pool toward `k` (never what the
    /// same reservation needs there): demand-sized chunk steps, the largest
    /// free tail first. True if anything moved.
    fn migrate_for(&mut self, k: PoolKind, deficit: u32, donor_needs: u32) -> bool {
        let d = k.other();
        let step = self.step_units(k);
        let (uk, ud) = (self.pool.unit_bytes(k), self.pool.unit_bytes(d));
        let spare = u64::from(self.pool.free_units(d).saturating_sub(donor_needs));
        let want = (u64::from(deficit) * uk).div_ceil(ud).div_ceil(step) * step;
        let mut n = want.min(spare / step * step);
        while n >= step {
            let units = u32::try_from(n).unwrap_or(u32::MAX);
            if let Ok(m) = self.pool.migrate_units_toward(k, units) {
                self.stats.migrations += 1;
                self.stats.bytes_migrated += m.donor_bytes;
                // The donor shrank by free units only: the budget still fits.
                if self.update_budget().is_err() {
                    debug_assert!(false, "a migration shrank below what the cache holds");
                }
                return true;
            }
            n = n / 2 / step * step;
        }
        false
    }

    /// Donor units of one migration step toward `k`: the allocator's step
    /// bytes, and at least one unit of `k`.
    fn step_units(&self, k: PoolKind) -> u64 {
        let (uk, ud) = (self.pool.unit_bytes(k), self.pool.unit_bytes(k.other()));
        self.pool
            .migration_step_bytes()
            .max(uk)
            .div_ceil(ud.max(1))
            .max(1)
    }

    /// Takes `handles` from the caller's set after checking them all (all or
    /// nothing); `pools[i]` is the pool `handles[i]` must be in.
    fn check_callers(&self, handles: &[(VirtualHandle, PoolKind)]) -> Result<(), PooledError> {
        let mut seen = HashSet::new();
        for &(h, p) in handles {
            if h.pool() != p || !self.callers.contains(&h.raw()) {
                return Err(PooledError::NotCallers {
                    handle: h.raw(),
                    expected: p,
                });
            }
            if !seen.insert(h.raw()) {
                return Err(PooledError::Duplicate {
                    handle: h.raw(),
                    kind: p,
                });
            }
        }
        Ok(())
    }

    fn forget_callers(&mut self, h: VirtualHandle) {
        if self.callers.remove(&h.raw()) {
            self.callers_units[h.pool().index()] -= 1;
        }
    }

    /// Frees units the caller holds (reserved and not taken by the cache);
    /// all or nothing.
    pub fn free(&mut self, handles: &[VirtualHandle]) -> Result<(), PooledError> {
        let typed: Vec<(VirtualHandle, PoolKind)> =
            handles.iter().map(|&h| (h, h.pool())).collect();
        self.check_callers(&typed)?;
        for &h in handles {
            self.pool.free(h)?;
            self.forget_callers(h);
        }
        self.update_budget()
    }

    /// Admits `tokens` (the looked-up input, optionally followed by decoded
    /// output) with its KV pages and the states saved; see
    /// [`PrefixCache::admit`]. `kv_pages` holds one handle per full page of
    /// `tokens`: the lookup's pages for the hit, then the caller's reserved
    /// pages; each state's slot is a reserved slot. The cache takes the
    /// units it keeps ([`PooledAdmit::taken`]); the caller's other units
    /// stay the caller's ([`PooledAdmit::returned`]). The pools already hold
    /// every unit passed in, so the admission evicts nothing. On error
    /// nothing changes.
    pub fn admit(
        &mut self,
        lease: LeaseId,
        tokens: &[u32],
        states: &[PooledState],
        kv_pages: &[VirtualHandle],
    ) -> Result<PooledAdmit, PooledError> {
        // Every page is the caller's, or the page the cache holds at that
        // position for this lease; every slot the caller's. A page listed
        // twice is a duplicate whoever holds it.
        let known = self.lease_pages.get(&lease).map_or(&[][..], Vec::as_slice);
        let mut mine = Vec::with_capacity(kv_pages.len() + states.len());
        let mut seen = HashSet::with_capacity(kv_pages.len());
        for (i, &h) in kv_pages.iter().enumerate() {
            if h.pool() != PoolKind::Kv {
                return Err(PooledError::NotCallers {
                    handle: h.raw(),
                    expected: PoolKind::Kv,
                });
            }
            if !seen.insert(h.raw()) {
                return Err(PooledError::Duplicate {
                    handle: h.raw(),
                    kind: PoolKind::Kv,
                });
            }
            if self.held.contains(&h.raw()) {
                if known.get(i) != Some(&h.raw()) {
                    return Err(PooledError::NotCallers {
                        handle: h.raw(),
                        expected: PoolKind::Kv,
                    });
                }
            } else {
                mine.push((h, PoolKind::Kv));
            }
        }
        mine.extend(states.iter().map(|s| (s.slot, PoolKind::Ssm)));
        self.check_callers(&mine)?;
        // The units offered are in the pools already: let the cache count
        // them as its budget while it admits.
        let offered = [
            mine.iter().filter(|m| m.1 == PoolKind::Kv).count() as u64,
            states.len() as u64,
        ];
        let during = match self.budget() {
            UnitBudget::Split { pages, states } => UnitBudget::Split {
                pages: pages + offered[0],
                states: states + offered[1],
            },
            UnitBudget::Shared { units } => UnitBudget::Shared {
                units: units + offered[0] + offered[1],
            },
        };
        self.cache.set_unit_budget(during)?;
        let raw_pages: Vec<u32> = kv_pages.iter().map(|&h| self.pool.unit_index(h)).collect();
        let saved: Vec<SavedState> = states
            .iter()
            .map(|s| SavedState {
                position: s.position,
                slot: Some(self.pool.unit_index(s.slot)),
            })
            .collect();
        let admitted = match &mut self.cache {
            Device::Plain(c) => c.admit(lease, tokens, &saved, &raw_pages),
            Device::Tiered(t, l) => match l.get(&lease) {
                Some(tl) => t.admit(tl, tokens, &saved, &raw_pages),
                None => Err(CacheError::UnknownLease(lease)),
            },
        };
        let outcome = match admitted {
            Ok(o) => o,
            Err(e) => {
                self.update_budget()?;
                return Err(e.into());
            }
        };
        let mut taken = Vec::new();
        let range = outcome.kv_pages_taken.clone();
        for &h in &kv_pages[range.start as usize..range.end as usize] {
            taken.push(h);
        }
        for s in states {
            if outcome.states_taken.contains(&s.position) {
                taken.push(s.slot);
            }
        }
        for &h in &taken {
            self.forget_callers(h);
            self.held.insert(h.raw());
        }
        if let Some(known) = self.lease_pages.get_mut(&lease) {
            let end = range.end as usize;
            if known.len() < end {
                known.resize(end, 0);
            }
            for (k, h) in known[range.start as usize..end]
                .iter_mut()
                .zip(&kv_pages[range.start as usize..end])
            {
                *k = h.raw();
            }
        }
        let returned = mine
            .iter()
            .map(|m| m.0)
            .filter(|h| !taken.contains(h))
            .collect();
        self.collect_evicted()?;
        self.update_budget()?;
        Ok(PooledAdmit {
            outcome,
            taken,
            returned,
        })
    }

    /// One whole request, as a sequential simulator runs it: lookup, reserve
    /// the pages past the hit and a slot per state to save, admit
    /// `full` (`full[..input_len]` is the input) with them, free what the
    /// cache did not take, release. A refused reservation releases the lease
    /// and reports `refused`.
    pub fn serve(
        &mut self,
        ns: u64,
        input_len: usize,
        full: &[u32],
    ) -> Result<PooledServed, PooledError> {
        if input_len > full.len() || input_len == 0 {
            return Err(CacheError::PrefixMismatch { input_len }.into());
        }
        let l = self.lookup(ns, &full[..input_len])?;
        let page = self.page_size as usize;
        let full_pages = full.len() / page;
        // A lower tier's hit is loaded (here: nothing to copy) into pages
        // reserved past the device's.
        let hit_pages = l.kv_pages.len();
        let mut saves = self.cache.get().states_to_save(&l.lookup, full.len());
        let hit = match &l.tiered {
            None => l.lookup.hit_tokens,
            Some(t) => {
                saves.retain(|s| {
                    s.position > t.hit_tokens
                        || (s.position == t.hit_tokens && t.tier != Tier::Device)
                });
                t.hit_tokens
            }
        };
        let positions: Vec<u32> = saves.iter().map(|s| s.position).collect();
        let need_pages = u32::try_from(full_pages - hit_pages).unwrap_or(u32::MAX);
        let need_slots = u32::try_from(positions.len()).unwrap_or(u32::MAX);
        let r = match self.reserve(need_pages, need_slots) {
            Ok(r) => r,
            Err(PooledError::OutOfMemory { .. }) => {
                self.release(l.lookup.lease)?;
                return Ok(PooledServed {
                    hit_tokens: hit,
                    refused: true,
                    rejected: false,
                });
            }
            Err(e) => {
                self.release(l.lookup.lease)?;
                return Err(e);
            }
        };
        let mut pages = l.kv_pages.clone();
        pages.extend_from_slice(&r.kv_pages);
        let states: Vec<PooledState> = positions
            .iter()
            .zip(&r.state_slots)
            .map(|(&position, &slot)| PooledState { position, slot })
            .collect();
        let admitted = self.admit(l.lookup.lease, full, &states, &pages);
        let a = match admitted {
            Ok(a) => a,
            Err(e) => {
                let mut all = r.kv_pages.clone();
                all.extend_from_slice(&r.state_slots);
                self.free(&all)?;
                self.release(l.lookup.lease)?;
                return Err(e);
            }
        };
        self.free(&a.returned)?;
        self.release(l.lookup.lease)?;
        Ok(PooledServed {
            hit_tokens: hit,
            refused: false,
            rejected: a.outcome.rejected.is_some(),
        })
    }

    /// Panics if the joined accounting is broken (module documentation's
    /// invariants), after core's own [`PrefixCache::check_invariants`].
    /// O(units + nodes); for tests and debugging.
    pub fn check_invariants(&self) {
        match &self.cache {
            Device::Plain(c) => c.check_invariants(),
            Device::Tiered(t, l) => {
                t.check_invariants();
                assert_eq!(l.len(), self.lease_pages.len(), "tiered leases");
            }
        }
        let mut held = [0u64; 2];
        for &r in &self.held {
            let h = VirtualHandle::from_raw(r);
            assert!(
                self.pool.resolve(h).is_ok(),
                "cache holds {r:#018x}, not live in its pool"
            );
            assert!(!self.callers.contains(&r), "{r:#018x} held twice");
            held[h.pool().index()] += 1;
        }
        let used = self.cache.get().used_units();
        assert_eq!(
            UnitUse {
                pages: held[0],
                states: held[1]
            },
            used,
            "handles held vs units core counts"
        );
        let mut callers = [0u64; 2];
        for &r in &self.callers {
            let h = VirtualHandle::from_raw(r);
            assert!(self.pool.resolve(h).is_ok(), "caller's {r:#018x} not live");
            callers[h.pool().index()] += 1;
        }
        assert_eq!(callers, self.callers_units, "caller unit counts");
        if self.pool.shares_capacity() {
            let live = self.pool.capacity(PoolKind::Kv) - self.pool.free_units(PoolKind::Kv);
            assert_eq!(
                u64::from(live),
                held.iter().sum::<u64>() + callers.iter().sum::<u64>(),
                "live units of the shared table"
            );
        } else {
            for p in PoolKind::ALL {
                let live = self.pool.capacity(p) - self.pool.free_units(p);
                assert_eq!(
                    u64::from(live),
                    held[p.index()] + callers[p.index()],
                    "live units of the {p} pool"
                );
            }
        }
        assert_eq!(
            self.cache.get().unit_budget(),
            Some(self.budget()),
            "core's unit budget"
        );
    }
}

fn release_plain(c: &mut Device, lease: LeaseId) -> Result<(), CacheError> {
    match c {
        Device::Plain(c) => c.release(lease),
        // Only reached with a tiered lookup in hand (released by it).
        Device::Tiered(..) => Err(CacheError::UnknownLease(lease)),
    }
}
