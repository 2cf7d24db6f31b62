//! The tiered cache through the C ABI (docs/tiers.md): a device cache with
//! a host and a store tier below it. The library decides (which hit to
//! resume from, which loads to make, what to copy into which tier, which
//! copies to free); the engine moves the bytes. A store shared by several
//! engine processes is probed at lookup (one existence query on the state
//! keys of the input's candidate positions), so that an entry another
//! process wrote is weighed like any lower-tier hit; a store that is down
//! or slow gives an empty probe within its timeout.

use std::collections::HashMap;

use marconi_core::{
    AdmitOutcome, CacheConfig, CacheError, Freed, LoadWhat, Lookup, LookupOptions, SavedState,
    StoreProbe, Tier, TierConfig, TierOp, TierSpec, TieredCache, TieredLookup, WriteMode,
};

use crate::cache::{
    handle, lookup_flags, marconi_admit_result, marconi_cache, marconi_cache_admit,
    marconi_cache_check, marconi_cache_drain_freed, marconi_cache_free,
    marconi_cache_lease_kv_pages, marconi_cache_lease_plan, marconi_cache_release,
    marconi_saved_state, new_handle, unknown_lease, Core, Inner, Lease, TokenSource,
    MARCONI_NO_SLOT,
};
use crate::config::{marconi_cache_config, to_core_config};
use crate::lookup::{answer, hints_in, marconi_lookup_result, tier_fields, Ask, Entry};
use crate::pooled::Pools;
use crate::status::{
    boundary, check_ptr, copy_list, init_struct, marconi_status, out_slice, read_struct, require,
    versioned, write_versioned, FfiError, FfiResult,
};
use crate::store::marconi_store;

/// A tier: where an entry lives.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum marconi_tier {
    /// The engine's GPU memory: the device cache.
    Device = 0,
    /// Host memory.
    Host = 1,
    /// A store (local disk, Redis/Valkey), possibly shared by processes.
    Store = 2,
}

pub(crate) fn tier_code(t: Tier) -> u32 {
    match t {
        Tier::Device => marconi_tier::Device as u32,
        Tier::Host => marconi_tier::Host as u32,
        Tier::Store => marconi_tier::Store as u32,
    }
}

/// When a lower tier receives an entry.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum marconi_tier_write {
    /// When the tier above evicts it (demotion). The default.
    Back = 0,
    /// As soon as the tier above stores it.
    Through = 1,
}

/// One lower tier. Absent when capacity_bytes is 0.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct marconi_tier_spec {
    /// Bytes of KV and states the tier may hold (0: no such tier). Its
    /// policy is the device's (admission, eviction, alpha, page size).
    pub capacity_bytes: u64,
    /// Bytes per second from this tier into the device (finite, > 0).
    pub bandwidth_bytes_per_s: f64,
    /// Fixed cost of one load from this tier, seconds (finite, >= 0).
    pub latency_s: f64,
}

/// Configuration of a tiered cache. Versioned by size: fill it with
/// marconi_tiered_config_init(&cfg, sizeof cfg), then set fields.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct marconi_tiered_config {
    /// sizeof(marconi_tiered_config) as the caller compiled it.
    pub struct_size: u32,
    /// A marconi_tier_write value. Default MARCONI_TIER_WRITE_BACK.
    pub write_mode: u32,
    /// The device cache's configuration (initialised by
    /// marconi_cache_config_init). Required; read only during
    /// marconi_tiered_new.
    pub device: *const marconi_cache_config,
    /// The host tier. Default absent (capacity 0), 25 GB/s, 10 us.
    pub host: marconi_tier_spec,
    /// The store tier (needs a host tier). Default absent, 5 GB/s, 1 ms.
    pub store: marconi_tier_spec,
    /// Effective prefill FLOP/s of the device: what a skipped token is
    /// worth in time. Default 989e12 x 0.4.
    pub compute_flops: f64,
    /// Non-zero: save the state of a lower-tier hit on the device too.
    /// Default 0.
    pub promote: u32,
    /// Non-zero: load every longer lower-tier hit, however slow. Default 0.
    pub always_load: u32,
    /// Non-zero: plan on the device the branch checkpoints the lower tiers
    /// see. Default 1.
    pub lower_plans: u32,
    /// Non-zero: moves into the lower tiers wait for marconi_tiered_settle
    /// (call it off the request path, before the next lookup). Default 0.
    pub defer_moves: u32,
    /// Most state positions one store probe asks about (the longest first).
    /// Default 1024.
    pub max_store_probe: u32,
    /// Non-zero: the engine's state objects in the store carry the KV of
    /// their prefix too (a whole-sequence snapshot), so a probed state
    /// needs no KV blocks; 0: a probe also asks for the store's KV prefix
    /// (marconi_store_kv_prefix) and uses only states it covers. Default 0.
    pub store_states_hold_kv: u32,
    /// Non-zero: exclusive tiers. Once a host or store hit was loaded and
    /// the device admitted the request's state at or beyond it, that tier
    /// drops the chain (a MARCONI_TIER_OP_KIND_DROP op; the device's
    /// eviction writes it down again later). 0: inclusive tiers (a lower
    /// tier keeps a copy of what it served). Default 1. Added after the
    /// first version: a caller whose struct ends before it gets 1.
    pub exclusive: u32,
}
versioned!(marconi_tiered_config, CONFIG_MIN_SIZE);

impl marconi_tiered_config {
    fn defaults() -> Self {
        let t = TierConfig::marconi(None, None);
        marconi_tiered_config {
            struct_size: std::mem::size_of::<marconi_tiered_config>() as u32,
            write_mode: marconi_tier_write::Back as u32,
            device: std::ptr::null(),
            host: marconi_tier_spec {
                capacity_bytes: 0,
                bandwidth_bytes_per_s: 25e9,
                latency_s: 10e-6,
            },
            store: marconi_tier_spec {
                capacity_bytes: 0,
                bandwidth_bytes_per_s: 5e9,
                latency_s: 1e-3,
            },
            compute_flops: t.compute_flops,
            promote: u32::from(t.promote),
            always_load: u32::from(t.always_load),
            lower_plans: u32::from(t.lower_plans),
            defer_moves: u32::from(t.defer_moves),
            max_store_probe: 1024,
            store_states_hold_kv: 0,
            exclusive: u32::from(t.exclusive),
        }
    }
}

/// The first version's size of marconi_tiered_config (up to `exclusive`).
const CONFIG_MIN_SIZE: usize = std::mem::offset_of!(marconi_tiered_config, exclusive);

/// What marconi_tiered_lookup found.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct marconi_tiered_hit {
    /// The lease: pass it to marconi_tiered_admit and release it with
    /// marconi_tiered_release. Never 0, never valid in another handle.
    pub lease: u64,
    /// Leading tokens the engine may skip once the loads are done.
    pub hit_tokens: u32,
    /// The marconi_tier whose state the hit resumes from.
    pub tier: u32,
    /// The device's own usable hit (what the engine falls back to when a
    /// load fails).
    pub device_hit_tokens: u32,
    /// Leading tokens whose KV the device holds.
    pub device_kv_tokens: u32,
    /// The device slot of the device's hit state, or MARCONI_NO_SLOT.
    pub device_state_slot: u32,
    /// Load orders (marconi_tiered_lease_loads); 0 for a device hit.
    pub n_loads: u32,
    /// Checkpoint positions for this prefill (marconi_tiered_lease_plan).
    pub n_plan: u32,
    /// KV page ids of the device's hit (marconi_tiered_lease_kv_pages).
    pub n_kv_pages: u32,
    /// 1 when the hit's state is one only the shared store probe knew of
    /// (another process wrote it).
    pub shared: u32,
    /// The marconi_tier of a longer hit left unused because recomputing is
    /// faster (meaningful when declined_tokens > 0).
    pub declined_tier: u32,
    /// That hit's length, or 0 when none was declined.
    pub declined_tokens: u32,
    /// Reserved, 0.
    pub reserved: u32,
    /// Modelled seconds of the loads.
    pub load_s: f64,
    /// Modelled seconds to recompute the tokens the loads skip.
    pub recompute_s: f64,
}

/// What a load order moves.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum marconi_load_kind {
    /// The KV of tokens start..end.
    Kv = 0,
    /// The recurrent state at `position`.
    State = 1,
}

/// One load the engine carries out before prefilling from the hit: from
/// `tier` into the request's own device pages and state slot. The lower
/// tiers track no engine ids: an entry there is named by the namespace and
/// the tokens it covers (tokens[0..position]), as the store's keys are.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct marconi_load_order {
    /// The marconi_tier read.
    pub tier: u32,
    /// A marconi_load_kind value.
    pub kind: u32,
    /// First token (KV); the position (STATE).
    pub start: u32,
    /// End of the tokens, exclusive (KV); the position (STATE).
    pub end: u32,
    /// The entry's position: the state's, or the end of the KV range.
    pub position: u32,
    /// The tier's slot id, or MARCONI_NO_SLOT (the lower tiers track none).
    pub slot: u32,
    /// Bytes moved.
    pub bytes: u64,
}

/// What a tier op asks of the engine.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum marconi_tier_op_kind {
    /// Copy the chain (the state at `position` and the KV of its tokens)
    /// into `tier`: from the device's copy when `tier` is the host, from
    /// the host's copy when it is the store.
    Write = 0,
    /// `tier` no longer holds the chain: the engine may free its copy
    /// (in a shared store, other processes may still read it).
    Drop = 1,
}

/// One op of marconi_tiered_drain_ops, in the order the tiers decided
/// them: carry them out in this order.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct marconi_tier_op {
    /// A marconi_tier_op_kind value.
    pub kind: u32,
    /// The marconi_tier written or dropped from.
    pub tier: u32,
    /// The namespace.
    pub ns: u64,
    /// The chain's position: its tokens are `position` long.
    pub position: u32,
    /// Reserved, 0.
    pub reserved: u32,
    /// Where the chain's tokens start in the tokens buffer of the drain.
    pub tokens_offset: u64,
    /// Bytes the tier charges anew (WRITE), 0 (DROP).
    pub bytes: u64,
}

/// Counters and gauges of a tiered cache, per tier where an array (index
/// marconi_tier). Versioned by size: set struct_size to
/// sizeof(marconi_tiered_stats) first.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct marconi_tiered_stats {
    /// sizeof(marconi_tiered_stats) as the caller compiled it.
    pub struct_size: u32,
    /// Reserved, 0.
    pub reserved: u32,
    /// Lookups.
    pub requests: u64,
    /// Input tokens looked up.
    pub input_tokens: u64,
    /// Tokens skipped, all tiers.
    pub hit_tokens: u64,
    /// Tokens skipped, by the tier of the state resumed from.
    pub hit_tokens_by_tier: [u64; 3],
    /// Requests whose hit resumed from each tier.
    pub hits_by_tier: [u64; 3],
    /// Bytes loaded from each tier (as ordered).
    pub bytes_loaded: [u64; 3],
    /// Bytes written into each tier.
    pub bytes_written: [u64; 3],
    /// Entries written into each tier.
    pub writes: [u64; 3],
    /// Entries not demoted: reloading them would cost more than recomputing.
    pub demotions_skipped: u64,
    /// Longer lower-tier hits declined: recomputing was faster.
    pub loads_declined: u64,
    /// Hits on a state only the shared store probe knew of.
    pub shared_hits: u64,
    /// Tokens those hits skipped.
    pub shared_hit_tokens: u64,
    /// Store probes run.
    pub store_probes: u64,
    /// Store probes that failed (store down or slow): treated as empty.
    pub store_probe_failures: u64,
    /// Loads the engine reported failed (marconi_tiered_report_load_failure).
    pub load_failures: u64,
    /// Bytes each tier holds.
    pub used_bytes: [u64; 3],
    /// Each tier's capacity (0 where absent).
    pub capacity_bytes: [u64; 3],
    /// Modelled load seconds, all requests.
    pub load_s: f64,
}

/// The first version's size of marconi_tiered_stats (up to `requests`).
const STATS_MIN_SIZE: usize = 16;

/// The lower tiers of a cache (marconi_cache_config.tiers): what the
/// tiered core and the C leases over it need. Versioned by size: fill it
/// with marconi_tier_options_init(&opts, sizeof opts), then set fields.
/// The device tier is the cache's own configuration.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct marconi_tier_options {
    /// sizeof(marconi_tier_options) as the caller compiled it.
    pub struct_size: u32,
    /// A marconi_tier_write value. Default MARCONI_TIER_WRITE_BACK.
    pub write_mode: u32,
    /// The host tier. Default absent (capacity 0), 25 GB/s, 10 us.
    pub host: marconi_tier_spec,
    /// The store tier (needs a host tier). Default absent, 5 GB/s, 1 ms.
    pub store: marconi_tier_spec,
    /// Effective prefill FLOP/s of the device: what a skipped token is
    /// worth in time. Default 989e12 x 0.4.
    pub compute_flops: f64,
    /// Non-zero: save the state of a lower-tier hit on the device too.
    /// Default 0.
    pub promote: u32,
    /// Non-zero: load every longer lower-tier hit, however slow. Default 0.
    pub always_load: u32,
    /// Non-zero: plan on the device the branch checkpoints the lower tiers
    /// see. Default 1.
    pub lower_plans: u32,
    /// Non-zero: moves into the lower tiers wait for marconi_cache_settle
    /// (call it off the request path, before the next lookup). Default 0.
    pub defer_moves: u32,
    /// Most state positions one store probe asks about (the longest first).
    /// Default 1024.
    pub max_store_probe: u32,
    /// Non-zero: the engine's state objects in the store carry the KV of
    /// their prefix too (see marconi_tiered_config). Default 0.
    pub store_states_hold_kv: u32,
    /// Non-zero: exclusive tiers (see marconi_tiered_config). Default 1.
    pub exclusive: u32,
    /// Reserved, 0.
    pub reserved: u32,
}
versioned!(marconi_tier_options, OPTIONS_MIN_SIZE);

impl marconi_tier_options {
    fn defaults() -> Self {
        let d = marconi_tiered_config::defaults();
        marconi_tier_options {
            struct_size: std::mem::size_of::<marconi_tier_options>() as u32,
            reserved: 0,
            ..Self::from_tiered(&d)
        }
    }

    /// The tier options of a marconi_tiered_config (all but `device`).
    fn from_tiered(c: &marconi_tiered_config) -> Self {
        marconi_tier_options {
            struct_size: std::mem::size_of::<marconi_tier_options>() as u32,
            write_mode: c.write_mode,
            host: c.host,
            store: c.store,
            compute_flops: c.compute_flops,
            promote: c.promote,
            always_load: c.always_load,
            lower_plans: c.lower_plans,
            defer_moves: c.defer_moves,
            max_store_probe: c.max_store_probe,
            store_states_hold_kv: c.store_states_hold_kv,
            exclusive: c.exclusive,
            reserved: 0,
        }
    }
}

/// The first version's size of marconi_tier_options: all of it.
const OPTIONS_MIN_SIZE: usize = std::mem::size_of::<marconi_tier_options>();

/// Fills `*opts` with the defaults (documented per field) and sets
/// `opts->struct_size`. MARCONI_STATUS_UNSUPPORTED_STRUCT_SIZE when
/// struct_size is smaller than the first version's.
#[no_mangle]
pub unsafe extern "C" fn marconi_tier_options_init(
    opts: *mut marconi_tier_options,
    struct_size: usize,
) -> marconi_status {
    // SAFETY: opts is NULL or has struct_size writable bytes (contract).
    boundary("marconi_tier_options_init", || unsafe {
        init_struct(opts, struct_size, "opts")
    })
}

/// The tiered part of a cache with lower tiers over ids the engine owns.
pub(crate) struct Tiers {
    pub(crate) cache: TieredCache,
    /// The tiered lookup of each outstanding lease, by C id (its device
    /// lookup's page list moved to the cache's lease).
    pub(crate) leases: HashMap<u64, TieredLookup>,
    pub(crate) book: TierBook,
}

/// What the C calls keep beside the tiers, on either core with tiers
/// (over ids the engine owns, or over pools).
#[derive(Default)]
pub(crate) struct TierBook {
    /// Ops drained from the core, not yet delivered.
    pub(crate) ops: Vec<TierOp>,
    max_probe: usize,
    states_hold_kv: bool,
    store_probes: u64,
    store_probe_failures: u64,
    load_failures: u64,
}

/// The tiers of a cache, whichever its memory: the tier calls' one view.
pub(crate) enum TierSide<'a> {
    /// Over ids the engine owns.
    Own(&'a mut Tiers),
    /// Over pools, with the cache's C leases (to find the core lease).
    Pooled(&'a mut Pools, &'a HashMap<u64, Lease>),
}

impl TierSide<'_> {
    pub(crate) fn book(&mut self) -> &mut TierBook {
        match self {
            TierSide::Own(t) => &mut t.book,
            TierSide::Pooled(p, _) => p.tier_book(),
        }
    }

    /// The tiered cache (read only: its counters and capacities).
    pub(crate) fn cache(&self) -> &TieredCache {
        match self {
            TierSide::Own(t) => &t.cache,
            TierSide::Pooled(p, _) => p.tiers(),
        }
    }

    /// The tiered lookup of C lease `lease`, if outstanding.
    pub(crate) fn lookup(&self, lease: u64) -> Option<&TieredLookup> {
        match self {
            TierSide::Own(t) => t.leases.get(&lease),
            TierSide::Pooled(p, leases) => p.tiered_lookup(leases.get(&lease)?.core),
        }
    }

    /// Runs what the tiers left waiting.
    pub(crate) fn settle(&mut self) -> FfiResult {
        match self {
            TierSide::Own(t) => Ok(t.cache.settle()?),
            TierSide::Pooled(p, _) => p.settle(),
        }
    }

    /// Moves the core's ops into the book (over pools: the ids the engine
    /// owns are collected with them by `Inner::collect_freed`).
    pub(crate) fn collect_ops(&mut self) {
        if let TierSide::Pooled(p, _) = self {
            p.collect_tier_ops();
        }
    }
}

// The tiered arms of the marconi_cache_* calls, out of line and cold: the
// plain cache's request path keeps its code as it was.
impl Tiers {
    /// The device's view of a lookup (marconi_cache_lookup on a cache with
    /// tiers): a longer hit in a lower tier is neither chosen nor pinned
    /// (the engine would have to load it first; marconi_cache_lookup_tiered
    /// offers it with its loads). Keeps the tiered lookup under C id `id`.
    #[cold]
    #[inline(never)]
    pub(crate) fn device_lookup(
        &mut self,
        id: u64,
        ns: u64,
        tokens: &[u32],
        hints: &[u32],
        opts: LookupOptions,
    ) -> Result<Lookup, CacheError> {
        let mut tl = self
            .cache
            .lookup_opts(ns, tokens, hints, None, opts, true)?;
        let placeholder = Lookup {
            lease: tl.device.lease,
            hit_tokens: 0,
            kv_matched_tokens: 0,
            state_slot: None,
            kv_pages: Vec::new(),
            plan: Vec::new(),
        };
        // Only the device lease of the kept lookup is read later.
        let l = std::mem::replace(&mut tl.device, placeholder);
        self.leases.insert(id, tl);
        Ok(l)
    }

    /// marconi_cache_admit's core call on a cache with tiers.
    #[cold]
    #[inline(never)]
    pub(crate) fn admit(
        &mut self,
        lease: u64,
        core_lease: u64,
        tokens: &[u32],
        saved: &[SavedState],
        kv_pages: &[u32],
    ) -> Result<AdmitOutcome, CacheError> {
        let Some(l) = self.leases.remove(&lease) else {
            return Err(CacheError::UnknownLease(core_lease));
        };
        let o = self.cache.admit(&l, tokens, saved, kv_pages);
        self.leases.insert(lease, l);
        o
    }

    /// marconi_cache_release's core call on a cache with tiers.
    #[cold]
    #[inline(never)]
    pub(crate) fn release(&mut self, lease: u64, core_lease: u64) -> Result<(), CacheError> {
        match self.leases.remove(&lease) {
            Some(l) => self.cache.release(&l),
            None => Err(CacheError::UnknownLease(core_lease)),
        }
    }

    /// The ops decided so far, kept for marconi_cache_drain_ops, then the
    /// freed ids (the ops are ordered before the ids they read).
    #[cold]
    #[inline(never)]
    pub(crate) fn drain_freed(&mut self) -> Freed {
        let ops = self.cache.drain_ops();
        self.book.ops.extend(ops);
        self.cache.drain_freed()
    }
}

/// Builds the tiers over a device configured by `dev`.
/// MARCONI_STATUS_INVALID_CONFIG for a store tier without a host tier, a
/// bandwidth that is not finite and positive, a latency that is not finite
/// and at least 0, compute_flops not finite and positive, an unknown
/// write_mode, a flag other than 0 or 1, max_store_probe 0 or reserved not
/// 0.
pub(crate) fn build_tiers(dev: CacheConfig, c: &marconi_tier_options) -> FfiResult<Tiers> {
    let (t, book) = tier_config(&dev, c)?;
    let mut cache = TieredCache::new(dev, t)?;
    cache.record_ops(true);
    Ok(Tiers {
        cache,
        leases: HashMap::new(),
        book,
    })
}

/// The core's tier configuration of `c` for a device configured by `dev`,
/// with the book the C calls keep; errors as [`build_tiers`] (the core
/// checks the tiers against the device when it builds them).
pub(crate) fn tier_config(
    dev: &CacheConfig,
    c: &marconi_tier_options,
) -> FfiResult<(TierConfig, TierBook)> {
    let write = match c.write_mode {
        0 => WriteMode::Back,
        1 => WriteMode::Through,
        v => return Err(bad_config(format!("write_mode {v} is unknown"))),
    };
    if c.max_store_probe == 0 {
        return Err(bad_config("max_store_probe is 0"));
    }
    if c.reserved != 0 {
        return Err(bad_config("tier options: reserved must be 0"));
    }
    let spec = |s: &marconi_tier_spec| {
        (s.capacity_bytes > 0).then(|| {
            let mut cache = dev.clone();
            cache.capacity_bytes = s.capacity_bytes;
            cache.decision_log = false;
            cache.events = false;
            TierSpec {
                cache,
                bandwidth_bytes_per_s: s.bandwidth_bytes_per_s,
                latency_s: s.latency_s,
            }
        })
    };
    let mut t = TierConfig::marconi(spec(&c.host), spec(&c.store));
    t.write = write;
    t.compute_flops = c.compute_flops;
    t.promote = flag(c.promote, "promote")?;
    t.always_load = flag(c.always_load, "always_load")?;
    t.lower_plans = flag(c.lower_plans, "lower_plans")?;
    t.defer_moves = flag(c.defer_moves, "defer_moves")?;
    t.exclusive = flag(c.exclusive, "exclusive")?;
    let states_hold_kv = flag(c.store_states_hold_kv, "store_states_hold_kv")?;
    Ok((
        t,
        TierBook {
            ops: Vec::new(),
            max_probe: c.max_store_probe as usize,
            states_hold_kv,
            store_probes: 0,
            store_probe_failures: 0,
            load_failures: 0,
        },
    ))
}

fn bad_config(s: impl Into<String>) -> FfiError {
    FfiError::new(marconi_status::InvalidConfig, s)
}

fn flag(v: u32, what: &str) -> FfiResult<bool> {
    match v {
        0 => Ok(false),
        1 => Ok(true),
        v => Err(bad_config(format!("{what} is {v}, not 0 or 1"))),
    }
}

/// Looks up `tokens[0..n_tokens]` in namespace `ns` in every tier of a
/// cache with lower tiers and writes the hit to resume from to `*out`,
/// with a lease pinning it until marconi_cache_release (use it with every
/// marconi_cache_* call that takes a lease). `checkpoints[0..n_checkpoints]`
/// are application checkpoint hints (as marconi_cache_lookup_hinted; none:
/// NULL, 0). marconi_cache_lookup and its variants on such a cache return
/// the device's view only (a longer lower-tier hit is neither chosen nor
/// pinned); this lookup weighs every tier and gives the loads
/// (marconi_cache_lease_loads) that make a lower-tier hit usable.
///
/// `store` (NULL: none) is a store handle shared with other processes:
/// the lookup first asks it (one existence query, bounded by the store's
/// timeout) which of the input's candidate positions have a state, and
/// weighs the longest usable one like any store-tier hit (this needs a
/// store tier for its bandwidth; without one the probe is skipped). The
/// probe asks for the keys of namespace `ns` (as
/// marconi_store_get_state_ns(store, ns, ...)), whatever the store handle's
/// configured ns. A store that is down or slow gives an empty probe,
/// bounded by the store's timeout as a whole (counted in
/// store_probe_failures), never an error. The probe is a hint: when the
/// engine's read of the state then misses, it resumes from the device's hit
/// (device_hit_tokens, device_state_slot) and reports it with
/// marconi_cache_report_load_failure.
///
/// Errors: MARCONI_STATUS_UNSUPPORTED on a cache without lower tiers (the
/// reason in marconi_last_error), MARCONI_STATUS_EMPTY_TOKENS for n_tokens
/// 0, MARCONI_STATUS_NULL_ARGUMENT for a NULL array with a length > 0,
/// MARCONI_STATUS_TOO_MANY_TOKENS, MARCONI_STATUS_INVALID_ARGUMENT for a
/// handle (cache or store) that is not one.
#[no_mangle]
pub unsafe extern "C" fn marconi_cache_lookup_tiered(
    cache: *const marconi_cache,
    ns: u64,
    tokens: *const u32,
    n_tokens: usize,
    checkpoints: *const u32,
    n_checkpoints: usize,
    store: *const marconi_store,
    out: *mut marconi_tiered_hit,
) -> marconi_status {
    boundary("marconi_cache_lookup_tiered", || {
        require!(cache);
        require!(tokens, len = n_tokens);
        require!(checkpoints, len = n_checkpoints);
        require!(out);
        // SAFETY: buffer contract of the header.
        let hints = unsafe { hints_in(checkpoints, n_checkpoints) }?;
        let tokens = TokenSource::U32(tokens, n_tokens);
        let ask = Ask::new(Entry::Tiers, "marconi_cache_lookup_tiered", ns, tokens);
        // SAFETY: forwarded caller contract.
        unsafe {
            answer(
                cache,
                Ask {
                    hints,
                    store,
                    ..ask
                },
                out,
            )
        }
    })
}

/// marconi_cache_lookup_tiered with the tokens as int64 ids (as
/// marconi_cache_lookup_i64) and `flags` (as
/// marconi_cache_lookup_i64_flags: MARCONI_LOOKUP_WHOLE_INPUT,
/// MARCONI_LOOKUP_NO_KV_PAGES, which leaves `out->n_kv_pages` 0 and the
/// device hit's pages to marconi_cache_lease_kv_pages); no hints. SGLang's
/// path through the tiers.
///
/// Errors: those of marconi_cache_lookup_tiered, and
/// MARCONI_STATUS_INVALID_ARGUMENT for an unknown flag bit or an id outside
/// [0, 2^32 - 1] (nothing changes).
#[no_mangle]
pub unsafe extern "C" fn marconi_cache_lookup_tiered_i64_flags(
    cache: *const marconi_cache,
    ns: u64,
    tokens: *const i64,
    n_tokens: usize,
    flags: u32,
    store: *const marconi_store,
    out: *mut marconi_tiered_hit,
) -> marconi_status {
    boundary("marconi_cache_lookup_tiered_i64_flags", || {
        require!(cache);
        require!(tokens, len = n_tokens);
        require!(out);
        let opts = lookup_flags(flags)?;
        let tokens = TokenSource::I64(tokens, n_tokens);
        let ask = Ask::new(
            Entry::Tiers,
            "marconi_cache_lookup_tiered_i64_flags",
            ns,
            tokens,
        );
        // SAFETY: forwarded caller contract.
        unsafe { answer(cache, Ask { opts, store, ..ask }, out) }
    })
}

impl Tiers {
    /// The candidate positions a store probe asks about for an input of
    /// `n` tokens (none without a store tier to weigh them by), and whether
    /// the store's states carry their KV.
    pub(crate) fn probe_positions(&self, n: usize) -> (Vec<u32>, bool) {
        let p = if self.cache.tier(Tier::Store).is_some() {
            self.cache.store_probe_positions(n, self.book.max_probe)
        } else {
            Vec::new()
        };
        (p, self.book.states_hold_kv)
    }
}

/// The tier view over ids (the one lookup's route for a cache with tiers):
/// every tier weighed, with the probe's answer (and whether it failed).
pub(crate) fn lookup_tiers(
    g: &mut Inner,
    id: u64,
    ask: &Ask,
    tokens: &[u32],
    probe: Option<(StoreProbe, bool)>,
) -> FfiResult<marconi_lookup_result> {
    let Core::Tiered(t) = &mut g.core else {
        unreachable!("routed to the tiers")
    };
    if let Some((_, failed)) = &probe {
        t.book.store_probes += 1;
        t.book.store_probe_failures += u64::from(*failed);
    }
    let p = probe.as_ref().map(|(p, _)| p);
    let mut l = t
        .cache
        .lookup_opts(ask.ns, tokens, ask.hints, p, ask.opts, false)?;
    let pages = std::mem::take(&mut l.device.kv_pages);
    let mut res = marconi_lookup_result {
        device_hit_tokens: l.device.hit_tokens,
        kv_matched_tokens: l.device.kv_matched_tokens,
        n_kv_pages: pages.len() as u32,
        has_device_state: u32::from(l.device.state_slot.is_some()),
        device_state: u64::from(l.device.state_slot.unwrap_or(MARCONI_NO_SLOT)),
        ..Default::default()
    };
    tier_fields(&mut res, &l);
    let core = l.device.lease;
    t.leases.insert(id, l);
    g.issue_lease(
        id,
        Lease {
            core,
            pages: (!ask.opts.skip_kv_pages).then_some(pages),
        },
    );
    Ok(res)
}

/// Writes a lease's load orders (KV ranges in token order, then the state)
/// into `buf[0..cap]` and their number to `*out_len`: what the engine reads
/// from the lower tiers before prefilling from the hit of
/// marconi_cache_lookup_tiered or, on a cache over pools with tiers, of
/// marconi_cache_lookup_pooled (none for a device hit, or for a lease of
/// marconi_cache_lookup). Over pools, load into units the request
/// reserved: KV page i (tokens i x page_size..) is the hit's page i when
/// the lookup gave it, else the reserved page i - n_kv_pages. A buffer too small (NULL with cap 0 is a size
/// query) gives MARCONI_STATUS_BUFFER_TOO_SMALL with only the count
/// written. MARCONI_STATUS_UNSUPPORTED on a cache without lower tiers.
#[no_mangle]
pub unsafe extern "C" fn marconi_cache_lease_loads(
    cache: *const marconi_cache,
    lease: u64,
    buf: *mut marconi_load_order,
    cap: usize,
    out_len: *mut usize,
) -> marconi_status {
    boundary("marconi_cache_lease_loads", || {
        require!(cache);
        require!(buf, cap = cap);
        require!(out_len);
        // SAFETY: the caller passes a live handle or NULL.
        let h = unsafe { handle(cache) }?;
        let mut g = h.lock()?;
        let t = g.tier_side("marconi_cache_lease_loads")?;
        // SAFETY: buffer contract of the header.
        let buf = unsafe { out_slice(buf, cap, "buf") }?;
        check_ptr!(out_len);
        let l = t.lookup(lease).ok_or_else(|| unknown_lease(lease))?;
        let list: Vec<marconi_load_order> = l
            .loads
            .iter()
            .map(|o| {
                let (kind, start, end, slot) = match &o.what {
                    LoadWhat::Kv { start, end, .. } => {
                        (marconi_load_kind::Kv, *start, *end, MARCONI_NO_SLOT)
                    }
                    LoadWhat::State { position, slot } => (
                        marconi_load_kind::State,
                        *position,
                        *position,
                        slot.unwrap_or(MARCONI_NO_SLOT),
                    ),
                };
                marconi_load_order {
                    tier: tier_code(o.tier),
                    kind: kind as u32,
                    start,
                    end,
                    position: end,
                    slot,
                    bytes: o.bytes,
                }
            })
            .collect();
        copy_list(&list, buf, out_len)
    })
}

/// Records that a load of `lease`'s orders failed (the engine could not
/// read the entry: a shared store that lost it, was killed, or returned a
/// corrupt object) and that the engine recomputed from the device's hit.
/// Counted in load_failures; the lease stays valid.
/// MARCONI_STATUS_UNSUPPORTED on a cache without lower tiers.
#[no_mangle]
pub unsafe extern "C" fn marconi_cache_report_load_failure(
    cache: *const marconi_cache,
    lease: u64,
) -> marconi_status {
    boundary("marconi_cache_report_load_failure", || {
        // SAFETY: the caller passes a live handle or NULL.
        let h = unsafe { handle(cache) }?;
        let mut g = h.lock()?;
        let mut t = g.tier_side("marconi_cache_report_load_failure")?;
        if t.lookup(lease).is_none() {
            return Err(unknown_lease(lease));
        }
        t.book().load_failures += 1;
        Ok(())
    })
}

/// Runs the moves into the lower tiers that defer_moves left waiting
/// (a no-op otherwise); then drain the ops (marconi_cache_drain_ops).
/// MARCONI_STATUS_UNSUPPORTED on a cache without lower tiers.
#[no_mangle]
pub unsafe extern "C" fn marconi_cache_settle(cache: *const marconi_cache) -> marconi_status {
    boundary("marconi_cache_settle", || {
        // SAFETY: the caller passes a live handle or NULL.
        let h = unsafe { handle(cache) }?;
        let mut g = h.lock()?;
        let r = g.tier_side("marconi_cache_settle")?.settle();
        g.collect_freed();
        g.collect_log();
        r
    })
}

/// Drains the ops the tiers decided since the last drain, in order: each
/// op into `ops[0..ops_cap]` and the tokens of its chain (`position`
/// tokens from `ops[i].tokens_offset`) into `tokens[0..tokens_cap]`, with the
/// counts in `*n_ops` and `*n_tokens`. Carry them out in order: a WRITE to
/// the host copies the chain from the device (before its slot, returned by
/// marconi_cache_drain_freed, is reused), a WRITE to the store copies it
/// from the host copy, a DROP frees a copy. On a cache over pools, a WRITE
/// to the host drained after marconi_cache_admit_pooled copies a chain of
/// that admission: its state is in the slot given for `position`, its KV
/// in the first ceil(position / page_size) pages given; copy it before
/// freeing the returned units or reserving again. All or nothing: when either
/// buffer is too small (NULL with capacity 0 is a size query), returns
/// MARCONI_STATUS_BUFFER_TOO_SMALL with the needed counts and drains
/// nothing. MARCONI_STATUS_UNSUPPORTED on a cache without lower tiers.
///
/// On a cache with lower tiers, marconi_cache_drain_freed hands out only
/// ids no op still to be drained reads: drain the ops first. Every id it
/// returns is the engine's to reuse at once. With defer_moves, the ids the
/// device freed since the last marconi_cache_settle are withheld until the
/// next one (whose WRITEs read them) has run.
///
/// Thread safety: safe to call concurrently on the same handle; each op is
/// delivered to exactly one caller.
#[no_mangle]
pub unsafe extern "C" fn marconi_cache_drain_ops(
    cache: *const marconi_cache,
    ops: *mut marconi_tier_op,
    ops_cap: usize,
    n_ops: *mut usize,
    tokens: *mut u32,
    tokens_cap: usize,
    n_tokens: *mut usize,
) -> marconi_status {
    boundary("marconi_cache_drain_ops", || {
        require!(cache);
        require!(ops, cap = ops_cap);
        require!(n_ops);
        require!(tokens, cap = tokens_cap);
        require!(n_tokens);
        // SAFETY: the caller passes a live handle or NULL.
        let h = unsafe { handle(cache) }?;
        let mut g = h.lock()?;
        g.tier_side("marconi_cache_drain_ops")?;
        // SAFETY: buffer contracts of the header.
        let ops = unsafe { out_slice(ops, ops_cap, "ops") }?;
        // SAFETY: as above.
        let tokens = unsafe { out_slice(tokens, tokens_cap, "tokens") }?;
        check_ptr!(n_ops);
        check_ptr!(n_tokens);
        g.collect_freed();
        let mut side = g.tier_side("marconi_cache_drain_ops")?;
        side.collect_ops();
        let t = side.book();
        let (need_ops, need_tokens) = ops_need(&t.ops);
        // SAFETY: n_ops and n_tokens are non-NULL, aligned and writable.
        unsafe {
            n_ops.write(need_ops);
            n_tokens.write(need_tokens);
        }
        if ops.len() < need_ops || tokens.len() < need_tokens {
            return Err(FfiError::new(
                marconi_status::BufferTooSmall,
                format!(
                    "{need_ops} ops with {need_tokens} tokens are pending; buffers hold {} and {}",
                    ops.len(),
                    tokens.len()
                ),
            ));
        }
        write_ops(&t.ops, ops, tokens);
        t.ops.clear();
        Ok(())
    })
}

/// The ops and tokens a drain of `ops` writes.
pub(crate) fn ops_need(ops: &[TierOp]) -> (usize, usize) {
    (ops.len(), ops.iter().map(|o| op_parts(o).3.len()).sum())
}

/// Writes `ops` into `out` and their chains' tokens into `tokens` (both
/// at least [`ops_need`] long).
pub(crate) fn write_ops(ops: &[TierOp], out: &mut [marconi_tier_op], tokens: &mut [u32]) {
    let mut at = 0usize;
    for (dst, o) in out.iter_mut().zip(ops) {
        let (kind, tier, ns, prefix, position, bytes) = op_parts(o);
        tokens[at..at + prefix.len()].copy_from_slice(prefix);
        *dst = marconi_tier_op {
            kind: kind as u32,
            tier: tier_code(tier),
            ns,
            position,
            reserved: 0,
            tokens_offset: at as u64,
            bytes,
        };
        at += prefix.len();
    }
}

type OpParts<'a> = (marconi_tier_op_kind, Tier, u64, &'a [u32], u32, u64);

fn op_parts(o: &TierOp) -> OpParts<'_> {
    match o {
        TierOp::Write {
            to,
            ns,
            position,
            bytes,
            prefix,
        } => (
            marconi_tier_op_kind::Write,
            *to,
            *ns,
            prefix.as_slice(),
            *position,
            *bytes,
        ),
        TierOp::Drop {
            from,
            ns,
            position,
            prefix,
        } => (
            marconi_tier_op_kind::Drop,
            *from,
            *ns,
            prefix.as_slice(),
            *position,
            0,
        ),
    }
}

/// Writes the tiers' counters and gauges to `*out` (marconi_cache_stats
/// has the device's). Set out->struct_size to sizeof(marconi_tiered_stats)
/// first: only that many bytes are written (at least 16).
/// MARCONI_STATUS_UNSUPPORTED on a cache without lower tiers.
#[no_mangle]
pub unsafe extern "C" fn marconi_cache_tier_stats(
    cache: *const marconi_cache,
    out: *mut marconi_tiered_stats,
) -> marconi_status {
    boundary("marconi_cache_tier_stats", || {
        require!(cache);
        require!(out);
        // SAFETY: the caller passes a live handle or NULL.
        let h = unsafe { handle(cache) }?;
        let mut g = h.lock()?;
        let mut side = g.tier_side("marconi_cache_tier_stats")?;
        check_ptr!(out);
        // SAFETY: out is non-NULL and aligned; its first field is struct_size.
        let size = unsafe { out.cast::<u32>().read() } as usize;
        if size < STATS_MIN_SIZE {
            return Err(FfiError::new(
                marconi_status::UnsupportedStructSize,
                format!(
                    "tiered stats struct_size is {size}; set it to sizeof(marconi_tiered_stats)"
                ),
            ));
        }
        let b = side.book();
        let (store_probes, store_probe_failures, load_failures) =
            (b.store_probes, b.store_probe_failures, b.load_failures);
        let t = side.cache();
        let s = t.stats();
        let v = marconi_tiered_stats {
            struct_size: size as u32,
            reserved: 0,
            requests: s.requests,
            input_tokens: s.input_tokens,
            hit_tokens: s.hit_tokens,
            hit_tokens_by_tier: s.hit_tokens_by_tier,
            hits_by_tier: s.hits_by_tier,
            bytes_loaded: s.bytes_loaded,
            bytes_written: s.bytes_written,
            writes: s.writes,
            demotions_skipped: s.demotions_skipped,
            loads_declined: s.loads_declined,
            shared_hits: s.shared_hits,
            shared_hit_tokens: s.shared_hit_tokens,
            store_probes,
            store_probe_failures,
            load_failures,
            used_bytes: t.used_bytes(),
            capacity_bytes: t.capacity_bytes(),
            load_s: s.load_s,
        };
        // SAFETY: out has `size` writable bytes (contract), checked above.
        unsafe { write_versioned(&v, out, size) };
        Ok(())
    })
}

// ---------------------------------------------------------------------------
// The deprecated tiered handle: thin forwarders onto marconi_cache.
// ---------------------------------------------------------------------------

/// A tiered cache handle: opaque to C. Deprecated (removed in the next
/// release): a marconi_tiered is a marconi_cache created with
/// marconi_cache_config.tiers set, and every marconi_tiered_* call forwards
/// to its marconi_cache_* counterpart.
pub struct marconi_tiered {
    _private: [u8; 0],
}

fn as_cache(t: *const marconi_tiered) -> *const marconi_cache {
    t.cast()
}

/// Deprecated: marconi_tier_options_init and marconi_cache_config.tiers.
/// Fills `*cfg` with the defaults (documented per field) and sets
/// `cfg->struct_size`: any size from the first version's on (an older
/// caller's struct gets the fields it has). MARCONI_STATUS_UNSUPPORTED_STRUCT_SIZE
/// when struct_size is smaller than the first version's.
#[deprecated(
    note = "use marconi_tier_options_init and marconi_cache_config.tiers (removed in the next release)"
)]
#[no_mangle]
pub unsafe extern "C" fn marconi_tiered_config_init(
    cfg: *mut marconi_tiered_config,
    struct_size: usize,
) -> marconi_status {
    // SAFETY: cfg is NULL or has struct_size writable bytes (contract).
    boundary("marconi_tiered_config_init", || unsafe {
        init_struct(cfg, struct_size, "cfg")
    })
}

/// Deprecated: marconi_cache_new with marconi_cache_config.tiers. Creates a
/// cache with lower tiers from `*cfg` (the device's configuration in
/// `cfg->device`, the tiers in the other fields) and writes the handle to
/// `*out` (free it with marconi_tiered_free or marconi_cache_free: it is a
/// marconi_cache). MARCONI_STATUS_INVALID_CONFIG as marconi_cache_new.
#[deprecated(
    note = "use marconi_cache_new with marconi_cache_config.tiers (removed in the next release)"
)]
#[no_mangle]
pub unsafe extern "C" fn marconi_tiered_new(
    cfg: *const marconi_tiered_config,
    out: *mut *mut marconi_tiered,
) -> marconi_status {
    boundary("marconi_tiered_new", || {
        require!(cfg);
        require!(out);
        check_ptr!(cfg);
        check_ptr!(out);
        // SAFETY: cfg is non-NULL and aligned; its size contract is the caller's.
        let c = unsafe { read_struct(cfg) }?;
        let device = c.device;
        require!(device);
        check_ptr!(device);
        // SAFETY: device is non-NULL and aligned; initialised by contract.
        let d = unsafe { read_struct(device) }?;
        if !d.tiers.is_null() {
            return Err(bad_config(
                "the device configuration of marconi_tiered_new sets tiers: use marconi_cache_new",
            ));
        }
        // SAFETY: the pointers inside d follow their documented contracts.
        let dev = unsafe { to_core_config(&d) }?;
        let t = build_tiers(dev, &marconi_tier_options::from_tiered(&c))?;
        // SAFETY: out is non-NULL, aligned (checked) and writable (contract).
        unsafe { new_handle(Core::Tiered(Box::new(t)), out.cast()) };
        Ok(())
    })
}

/// Deprecated: marconi_cache_free. Frees a tiered cache. NULL is a no-op;
/// a pointer that is not a live cache handle is refused and left alone.
#[deprecated(note = "use marconi_cache_free (removed in the next release)")]
#[no_mangle]
pub unsafe extern "C" fn marconi_tiered_free(t: *mut marconi_tiered) {
    // SAFETY: forwarded caller contract.
    unsafe { marconi_cache_free(t.cast()) }
}

/// Deprecated: marconi_cache_lookup_tiered (same arguments, same meaning).
#[deprecated(note = "use marconi_cache_lookup_tiered (removed in the next release)")]
#[no_mangle]
pub unsafe extern "C" fn marconi_tiered_lookup(
    tiered: *const marconi_tiered,
    ns: u64,
    tokens: *const u32,
    n_tokens: usize,
    checkpoints: *const u32,
    n_checkpoints: usize,
    store: *const marconi_store,
    out: *mut marconi_tiered_hit,
) -> marconi_status {
    // SAFETY: forwarded caller contract.
    unsafe {
        marconi_cache_lookup_tiered(
            as_cache(tiered),
            ns,
            tokens,
            n_tokens,
            checkpoints,
            n_checkpoints,
            store,
            out,
        )
    }
}

/// Deprecated: marconi_cache_lease_loads.
#[deprecated(note = "use marconi_cache_lease_loads (removed in the next release)")]
#[no_mangle]
pub unsafe extern "C" fn marconi_tiered_lease_loads(
    tiered: *const marconi_tiered,
    lease: u64,
    buf: *mut marconi_load_order,
    cap: usize,
    out_len: *mut usize,
) -> marconi_status {
    // SAFETY: forwarded caller contract.
    unsafe { marconi_cache_lease_loads(as_cache(tiered), lease, buf, cap, out_len) }
}

/// Deprecated: marconi_cache_lease_plan (a tiered lease's checkpoint
/// positions, ascending).
#[deprecated(note = "use marconi_cache_lease_plan (removed in the next release)")]
#[no_mangle]
pub unsafe extern "C" fn marconi_tiered_lease_plan(
    tiered: *const marconi_tiered,
    lease: u64,
    buf: *mut u32,
    cap: usize,
    out_len: *mut usize,
) -> marconi_status {
    // SAFETY: forwarded caller contract.
    unsafe { marconi_cache_lease_plan(as_cache(tiered), lease, buf, cap, out_len) }
}

/// Deprecated: marconi_cache_lease_kv_pages (the device KV page ids of a
/// lease's device hit).
#[deprecated(note = "use marconi_cache_lease_kv_pages (removed in the next release)")]
#[no_mangle]
pub unsafe extern "C" fn marconi_tiered_lease_kv_pages(
    tiered: *const marconi_tiered,
    lease: u64,
    buf: *mut u32,
    cap: usize,
    out_len: *mut usize,
) -> marconi_status {
    // SAFETY: forwarded caller contract.
    unsafe { marconi_cache_lease_kv_pages(as_cache(tiered), lease, buf, cap, out_len) }
}

/// Deprecated: marconi_cache_admit (on a cache with lower tiers it also
/// moves what the device evicted into them, unless defer_moves: drain the
/// ops before reusing the freed ids).
#[deprecated(note = "use marconi_cache_admit (removed in the next release)")]
#[no_mangle]
pub unsafe extern "C" fn marconi_tiered_admit(
    tiered: *const marconi_tiered,
    lease: u64,
    tokens: *const u32,
    n_tokens: usize,
    states: *const marconi_saved_state,
    n_states: usize,
    kv_pages: *const u32,
    n_kv_pages: usize,
    taken: *mut u8,
    out: *mut marconi_admit_result,
) -> marconi_status {
    // SAFETY: forwarded caller contract.
    unsafe {
        marconi_cache_admit(
            as_cache(tiered),
            lease,
            tokens,
            n_tokens,
            states,
            n_states,
            kv_pages,
            n_kv_pages,
            taken,
            out,
        )
    }
}

/// Deprecated: marconi_cache_release (releases the lease in every tier).
#[deprecated(note = "use marconi_cache_release (removed in the next release)")]
#[no_mangle]
pub unsafe extern "C" fn marconi_tiered_release(
    tiered: *const marconi_tiered,
    lease: u64,
) -> marconi_status {
    // SAFETY: forwarded caller contract.
    unsafe { marconi_cache_release(as_cache(tiered), lease) }
}

/// Deprecated: marconi_cache_report_load_failure.
#[deprecated(note = "use marconi_cache_report_load_failure (removed in the next release)")]
#[no_mangle]
pub unsafe extern "C" fn marconi_tiered_report_load_failure(
    tiered: *const marconi_tiered,
    lease: u64,
) -> marconi_status {
    // SAFETY: forwarded caller contract.
    unsafe { marconi_cache_report_load_failure(as_cache(tiered), lease) }
}

/// Deprecated: marconi_cache_settle.
#[deprecated(note = "use marconi_cache_settle (removed in the next release)")]
#[no_mangle]
pub unsafe extern "C" fn marconi_tiered_settle(tiered: *const marconi_tiered) -> marconi_status {
    // SAFETY: forwarded caller contract.
    unsafe { marconi_cache_settle(as_cache(tiered)) }
}

/// Deprecated: marconi_cache_drain_ops.
#[deprecated(note = "use marconi_cache_drain_ops (removed in the next release)")]
#[no_mangle]
pub unsafe extern "C" fn marconi_tiered_drain_ops(
    tiered: *const marconi_tiered,
    ops: *mut marconi_tier_op,
    ops_cap: usize,
    n_ops: *mut usize,
    tokens: *mut u32,
    tokens_cap: usize,
    n_tokens: *mut usize,
) -> marconi_status {
    // SAFETY: forwarded caller contract.
    unsafe {
        marconi_cache_drain_ops(
            as_cache(tiered),
            ops,
            ops_cap,
            n_ops,
            tokens,
            tokens_cap,
            n_tokens,
        )
    }
}

/// Deprecated: marconi_cache_drain_freed (drain the ops first).
#[deprecated(note = "use marconi_cache_drain_freed (removed in the next release)")]
#[no_mangle]
pub unsafe extern "C" fn marconi_tiered_drain_freed(
    tiered: *const marconi_tiered,
    pages: *mut u32,
    pages_cap: usize,
    n_pages: *mut usize,
    slots: *mut u32,
    slots_cap: usize,
    n_slots: *mut usize,
) -> marconi_status {
    // SAFETY: forwarded caller contract.
    unsafe {
        marconi_cache_drain_freed(
            as_cache(tiered),
            pages,
            pages_cap,
            n_pages,
            slots,
            slots_cap,
            n_slots,
        )
    }
}

/// Deprecated: marconi_cache_tier_stats.
#[deprecated(note = "use marconi_cache_tier_stats (removed in the next release)")]
#[no_mangle]
pub unsafe extern "C" fn marconi_tiered_get_stats(
    tiered: *const marconi_tiered,
    out: *mut marconi_tiered_stats,
) -> marconi_status {
    // SAFETY: forwarded caller contract.
    unsafe { marconi_cache_tier_stats(as_cache(tiered), out) }
}

/// Deprecated: marconi_cache_check (checks every tier's invariants).
#[deprecated(note = "use marconi_cache_check (removed in the next release)")]
#[no_mangle]
pub unsafe extern "C" fn marconi_tiered_check(tiered: *const marconi_tiered) -> marconi_status {
    // SAFETY: forwarded caller contract.
    unsafe { marconi_cache_check(as_cache(tiered)) }
}
