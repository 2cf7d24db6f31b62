//! The cache handle and the request cycle: lookup, plan, admit, release,
//! eviction reports, stats and the decision log.

use std::borrow::Cow;
use std::collections::{HashMap, HashSet, VecDeque};
use std::ffi::c_char;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};

use marconi_core::{Decision, LookupOptions, PrefixCache, SavedState};

use crate::config::{marconi_cache_config, to_core_config};
use crate::handle::{borrow, handle_kind, publish, release};
use crate::lookup::{answer, hints_in, Ask, Entry};
use crate::pooled::Pools;
use crate::status::{
    boundary, boundary_or, check_ptr, copy_list, in_slice, marconi_status, out_slice, read_struct,
    require, write_versioned, FfiError, FfiResult,
};
use crate::tiered::{TierSide, Tiers};

/// The slot id meaning "no slot": in marconi_lookup.state_slot (the hit has
/// no engine slot, or there is no hit), in marconi_saved_state.slot (the
/// engine does not track slots), and as the dst_slot of marconi_cache_lookup
/// (no copy order wanted). UINT32_MAX is therefore never a valid slot id.
pub const MARCONI_NO_SLOT: u32 = u32::MAX;

/// marconi_cache_lookup_i64_flags: the hit may cover all n_tokens tokens
/// (by default the last token is always left to compute, as its logits
/// start decoding). For a caller that passes exactly the prefix it wants
/// matched, as SGLang's tree cache does. With the whole input a hit,
/// nothing is planned.
pub const MARCONI_LOOKUP_WHOLE_INPUT: u32 = 1;

/// marconi_cache_lookup_i64_flags: the hit's KV page ids are not copied
/// at the lookup; `out->n_kv_pages` is 0 and marconi_cache_lease_kv_pages
/// computes them when asked (the same ids, as the lease pins them).
pub const MARCONI_LOOKUP_NO_KV_PAGES: u32 = 2;

/// Every flag marconi_cache_lookup_i64_flags knows.
const LOOKUP_FLAGS: u32 = MARCONI_LOOKUP_WHOLE_INPUT | MARCONI_LOOKUP_NO_KV_PAGES;

/// The sequence C lease ids are drawn from, shared by every cache of the
/// process. Why: a lease id must never be valid in another cache, live or
/// freed. An id made of a per-cache tag and a per-cache number repeats once
/// the tag wraps (a 24-bit generation did after 2^24 caches); an id drawn
/// once from a process-wide sequence that refuses to wrap is issued at most
/// once per process, and each cache accepts only the ids it issued and has
/// not seen released (`Inner::leases`), so no other cache can accept it.
pub(crate) static NEXT_LEASE: AtomicU64 = AtomicU64::new(1);

/// The next C lease id from `counter`, or None once the 2^64 − 1 ids are
/// spent (the counter stays there: it never wraps). Never 0.
pub(crate) fn next_lease_id(counter: &AtomicU64) -> Option<u64> {
    // A compare-exchange loop rather than `fetch_update`, which nightly
    // deprecates (renamed `try_update`, not in the minimum Rust version).
    let mut n = counter.load(Ordering::Relaxed);
    loop {
        let next = n.checked_add(1)?;
        match counter.compare_exchange_weak(n, next, Ordering::Relaxed, Ordering::Relaxed) {
            Ok(_) => return Some(scramble(n)),
            Err(now) => n = now,
        }
    }
}

/// A bijection of u64 (SplitMix64's finaliser: each xor-shift and each
/// multiplication by an odd constant is invertible) with scramble(0) == 0.
/// Ids stay unique and non-zero, and a made-up or off-by-one id (12345, a
/// valid id + 1) is almost never one a cache issued.
fn scramble(n: u64) -> u64 {
    let mut z = n;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A prefix cache handle: opaque to C. Create with marconi_cache_new, free
/// with marconi_cache_free.
pub struct marconi_cache {
    inner: Mutex<Inner>,
    /// Whether the cache lives in the library's pools (fixed at creation):
    /// read without the lock.
    pooled: bool,
}
handle_kind!(marconi_cache, Cache, "marconi_cache");

/// The core a cache runs on: the device cache alone over ids the engine
/// owns, the device cache with lower tiers below it
/// (marconi_cache_config.tiers), or the cache over the library's pools
/// (marconi_cache_config.pools). The plain cache stays inline: no
/// indirection more than before on its request path.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Core {
    Plain(PrefixCache),
    Tiered(Box<Tiers>),
    Pooled(Box<Pools>),
}

/// An outstanding lease, by its C id.
pub(crate) struct Lease {
    /// The core's lease number (the device's, on a tiered cache).
    pub(crate) core: u64,
    /// KV page ids of its hit; None when the lookup skipped them (computed
    /// from the core's lease when asked).
    pub(crate) pages: Option<Vec<u32>>,
}

/// What the lock protects: the core cache and the outputs waiting to be
/// drained by the engine.
pub(crate) struct Inner {
    pub(crate) core: Core,
    /// Outstanding leases by C id: the only ids this cache accepts.
    pub(crate) leases: HashMap<u64, Lease>,
    /// C id of each outstanding core lease, kept only with the decision log
    /// on (records name core leases; the engine sees C ids).
    pub(crate) c_of_core: Option<HashMap<u64, u64>>,
    /// State slots the cache owns (taken by admissions, not yet freed).
    owned_slots: HashSet<u32>,
    freed_pages: Vec<u32>,
    freed_slots: Vec<u32>,
    /// Decision records as JSON lines, each ending in '\n'.
    log: VecDeque<String>,
    log_bytes: usize,
}

impl Inner {
    /// The device cache.
    pub(crate) fn device(&self) -> &PrefixCache {
        match &self.core {
            Core::Plain(c) => c,
            Core::Tiered(t) => t.cache.device(),
            Core::Pooled(p) => p.device(),
        }
    }

    /// The freed ids waiting for the engine (KV pages, state slots), as
    /// far as [`collect_freed`](Self::collect_freed) has moved them.
    pub(crate) fn freed_ids(&mut self) -> (&mut Vec<u32>, &mut Vec<u32>) {
        (&mut self.freed_pages, &mut self.freed_slots)
    }

    /// Whether `slot` holds a state the cache owns (admitted, not yet
    /// freed by an eviction).
    pub(crate) fn owns_slot(&self, slot: u32) -> bool {
        self.owned_slots.contains(&slot)
    }

    /// The pools, or MARCONI_STATUS_UNSUPPORTED naming `what` on a cache
    /// configured without them.
    pub(crate) fn pools(&mut self, what: &str) -> FfiResult<&mut Pools> {
        match &mut self.core {
            Core::Pooled(p) => Ok(p),
            _ => Err(no_pools(what)),
        }
    }

    /// MARCONI_STATUS_UNSUPPORTED on a cache over pools for `what`, a call
    /// over ids the engine owns, naming `instead`, its pooled counterpart.
    pub(crate) fn not_pooled(&self, what: &str, instead: &str) -> FfiResult {
        match self.core {
            Core::Pooled(_) => Err(pooled_instead(what, instead)),
            _ => Ok(()),
        }
    }

    /// The tiers of a cache over ids the engine owns or over pools, or
    /// MARCONI_STATUS_UNSUPPORTED naming `what` on a cache without them.
    pub(crate) fn tier_side(&mut self, what: &str) -> FfiResult<TierSide<'_>> {
        let Inner { core, leases, .. } = self;
        match core {
            Core::Tiered(t) => Ok(TierSide::Own(t)),
            Core::Pooled(p) if p.has_tiers() => Ok(TierSide::Pooled(p, leases)),
            _ => Err(no_tiers(what)),
        }
    }

    /// Moves what the core freed since the last call into the pending lists
    /// (on a tiered cache, the tier ops first: they are ordered before the
    /// ids they read).
    pub(crate) fn collect_freed(&mut self) {
        let f = match &mut self.core {
            Core::Plain(c) => c.drain_freed(),
            Core::Tiered(t) => t.drain_freed(),
            // The pooled core returns what it evicts to its pools itself;
            // the handles wait in Pools for marconi_cache_drain_freed_units.
            Core::Pooled(_) => return,
        };
        for s in &f.state_slots {
            self.owned_slots.remove(s);
        }
        self.freed_pages.extend(f.kv_pages);
        self.freed_slots.extend(f.state_slots);
    }

    /// Moves the core's decision records into the pending JSON lines. Runs
    /// after every call that can log a lease while the lease's C id is still
    /// known, so records keep their order and name the ids the engine saw.
    pub(crate) fn collect_log(&mut self) {
        let Some(c_of_core) = &self.c_of_core else {
            return;
        };
        let records = match &mut self.core {
            Core::Plain(c) => c.drain_log(),
            Core::Tiered(t) => t.cache.drain_device_log(),
            Core::Pooled(p) => p.drain_log(),
        };
        for mut d in records {
            match &mut d {
                Decision::Lookup { lease, .. }
                | Decision::Plan { lease, .. }
                | Decision::Admit { lease, .. }
                | Decision::Release { lease } => {
                    *lease = c_of_core.get(lease).copied().unwrap_or(0)
                }
                _ => {}
            }
            let mut line = serde_json::to_string(&d).unwrap_or_else(|e| {
                serde_json::json!({ "kind": "unserialisable", "error": e.to_string() }).to_string()
            });
            line.push('\n');
            self.log_bytes += line.len();
            self.log.push_back(line);
        }
    }

    /// The core lease number of C lease id `lease`, if this cache issued it
    /// and it is outstanding.
    pub(crate) fn core_lease(&self, lease: u64) -> FfiResult<u64> {
        self.leases
            .get(&lease)
            .map(|l| l.core)
            .ok_or_else(|| unknown_lease(lease))
    }

    /// Records C lease `id` (from new_lease_id) over `lease`, whatever the
    /// core that issued it.
    pub(crate) fn issue_lease(&mut self, id: u64, lease: Lease) {
        if let Some(m) = &mut self.c_of_core {
            m.insert(lease.core, id);
        }
        self.leases.insert(id, lease);
    }
}

/// MARCONI_STATUS_UNKNOWN_LEASE for a lease id this cache did not issue or
/// already released.
pub(crate) fn unknown_lease(lease: u64) -> FfiError {
    FfiError::new(
        marconi_status::UnknownLease,
        format!("lease {lease} was not issued by this cache or is already released"),
    )
}

/// A new C lease id, drawn before a lookup changes anything (so that
/// running out changes nothing).
pub(crate) fn new_lease_id() -> FfiResult<u64> {
    next_lease_id(&NEXT_LEASE).ok_or_else(|| {
        FfiError::new(
            marconi_status::InvalidArgument,
            "this process has issued 2^64 - 1 lease ids",
        )
    })
}

/// The result of marconi_cache_lookup.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct marconi_lookup {
    /// The lease pinning what this request reuses: pass it to
    /// marconi_cache_admit and release it with marconi_cache_release. Never 0,
    /// never reused, and never valid in another cache (ids come once each
    /// from one process-wide sequence).
    pub lease: u64,
    /// Leading tokens the engine may skip. Always less than the input length:
    /// the last input token is recomputed to produce the first logits.
    pub hit_tokens: u32,
    /// Leading tokens whose KV is cached (page-aligned). kv_matched_tokens -
    /// hit_tokens is KV that matched but cannot be used (no state there).
    pub kv_matched_tokens: u32,
    /// The cached state slot to resume from, or MARCONI_NO_SLOT.
    pub state_slot: u32,
    /// KV page ids of the first hit_tokens tokens (fetch them with
    /// marconi_cache_lease_kv_pages); 0 when the engine does not pass pages.
    pub n_kv_pages: u32,
    /// Checkpoint positions for this prefill (fetch them with
    /// marconi_cache_lease_plan).
    pub n_plan: u32,
    /// 1 when copy_order holds an order, else 0.
    pub n_copy_orders: u32,
    /// When n_copy_orders is 1: copy the cached state in src_slot into the
    /// request's slot dst_slot before resuming (the cache keeps src_slot).
    pub copy_order: marconi_copy_order,
}

/// An order to copy a recurrent state from one engine slot to another, run
/// by the engine on its own stream.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct marconi_copy_order {
    /// The slot to read (owned by the cache).
    pub src_slot: u32,
    /// The slot to write (owned by the request).
    pub dst_slot: u32,
}

impl Default for marconi_copy_order {
    fn default() -> Self {
        marconi_copy_order {
            src_slot: MARCONI_NO_SLOT,
            dst_slot: MARCONI_NO_SLOT,
        }
    }
}

/// A recurrent state the engine saved, offered to marconi_cache_admit.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct marconi_saved_state {
    /// Tokens the state covers (a planned position, or the final position:
    /// the admitted length rounded down to the page size).
    pub position: u32,
    /// The engine slot holding it, or MARCONI_NO_SLOT.
    pub slot: u32,
}

/// The result of marconi_cache_admit.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct marconi_admit_result {
    /// States the cache took (their slots are now the cache's).
    pub states_taken: u32,
    /// Offered states with a slot that the cache did not take (already
    /// cached there, or rejected): those slots stay the engine's.
    pub slots_returned: u32,
    /// The cache took the KV pages kv_pages[kv_pages_taken_start ..
    /// kv_pages_taken_end) of the admitted page list; the others stay the
    /// engine's. Both 0 when no page list was given.
    pub kv_pages_taken_start: u32,
    /// End (exclusive) of the taken page range.
    pub kv_pages_taken_end: u32,
    /// Tokens of KV newly cached.
    pub new_kv_tokens: u32,
    /// When only a prefix of the sequence fitted (after evicting every
    /// unleased entry): the length of the prefix cached; 0 when the whole
    /// sequence was cached or nothing was (see `rejected`).
    pub truncated_to: u32,
    /// True when nothing was cached: not even a prefix fits after evicting
    /// every unleased entry (see the decision log for the reason).
    pub rejected: bool,
}

impl marconi_admit_result {
    /// The result of an admission with outcome `o`: `states_taken` of the
    /// offered states kept and `slots_returned` left to the caller; the
    /// taken page range only when a page list was given (`pages`).
    pub(crate) fn of(
        o: &marconi_core::AdmitOutcome,
        states_taken: u32,
        slots_returned: u32,
        pages: bool,
    ) -> Self {
        let taken = if pages {
            o.kv_pages_taken.clone()
        } else {
            0..0
        };
        Self {
            states_taken,
            slots_returned,
            kv_pages_taken_start: taken.start,
            kv_pages_taken_end: taken.end,
            new_kv_tokens: o.new_kv_tokens,
            truncated_to: o.truncated_to.unwrap_or(0),
            rejected: o.rejected.is_some(),
        }
    }
}

/// Counters and gauges of a cache. Versioned by size: set struct_size to
/// sizeof(marconi_stats) before calling marconi_cache_stats; the library
/// writes only that many bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct marconi_stats {
    /// sizeof(marconi_stats) as the caller compiled it.
    pub struct_size: u32,
    /// alpha tuning rounds run.
    pub tuning_rounds: u32,
    /// Lookups served.
    pub requests: u64,
    /// Lookups with a non-zero hit.
    pub hit_requests: u64,
    /// Input tokens looked up.
    pub input_tokens: u64,
    /// Tokens skipped thanks to the cache (usable hits).
    pub hit_tokens: u64,
    /// Tokens whose KV matched but could not be used because no state existed
    /// there (the silent miss).
    pub kv_matched_unusable_tokens: u64,
    /// Prefill FLOPs saved by hits.
    pub flops_saved: f64,
    /// Prefill FLOPs the inputs would cost with no cache.
    pub flops_total: f64,
    /// Bytes of cached KV.
    pub kv_bytes: u64,
    /// Bytes of cached states.
    pub state_bytes: u64,
    /// The byte budget.
    pub capacity_bytes: u64,
    /// Cached states.
    pub states: u64,
    /// Tree nodes.
    pub nodes: u64,
    /// Nodes evicted.
    pub evictions: u64,
    /// States admitted.
    pub states_admitted: u64,
    /// Admissions refused for lack of space.
    pub admissions_rejected: u64,
    /// Admissions cut to a prefix for lack of space.
    pub admissions_truncated: u64,
    /// Leases outstanding.
    pub leases: u64,
    /// The alpha in force.
    pub alpha: f64,
    /// Bytes in use (KV + states).
    pub used_bytes: u64,
    /// Bytes unleased entries hold, which eviction could free now.
    pub evictable_bytes: u64,
    /// KV bytes per cached token (the model's).
    pub kv_bytes_per_token: u64,
    /// Bytes of one cached recurrent state (all recurrent layers).
    pub state_bytes_per_entry: u64,
    /// Tokens of KV that eviction could free now (held by no lease: what
    /// leases pin is the union of their paths).
    pub evictable_kv_tokens: u64,
    /// States that eviction could free now (held by no lease).
    pub evictable_states: u64,
}

/// Smallest struct_size accepted by marconi_cache_stats (up to `requests`).
const STATS_MIN_SIZE: usize = 16;

/// The refusal of a pool operation on a cache configured without pools.
pub(crate) fn no_pools(what: &str) -> FfiError {
    FfiError::new(
        marconi_status::Unsupported,
        format!(
            "{what} needs pools, and this cache has none (its memory is ids the engine \
             owns): create it with marconi_cache_config.pools pointing to a \
             marconi_pool_config (marconi_pool_config_init, then set budget_bytes)"
        ),
    )
}

/// The refusal of a call over ids the engine owns on a cache over pools.
pub(crate) fn pooled_instead(what: &str, instead: &str) -> FfiError {
    FfiError::new(
        marconi_status::Unsupported,
        format!(
            "{what} takes or gives ids the engine owns, and this cache lives in pools \
             (marconi_cache_config.pools): use {instead}"
        ),
    )
}

/// The refusal of a tier operation on a cache configured without tiers.
pub(crate) fn no_tiers(what: &str) -> FfiError {
    FfiError::new(
        marconi_status::Unsupported,
        format!(
            "{what} needs lower tiers, and this cache has none: create it with \
             marconi_cache_config.tiers pointing to a marconi_tier_options \
             (marconi_tier_options_init, then set host.capacity_bytes)"
        ),
    )
}

impl marconi_cache {
    /// The device's page size (the events handle's block size).
    pub(crate) fn page_size(&self) -> FfiResult<u32> {
        Ok(self.lock()?.device().config().page_size)
    }

    /// Turns the device's event stream on (the events handle's way in).
    pub(crate) fn enable_events(&self) -> FfiResult {
        let mut g = self.lock()?;
        match &mut g.core {
            Core::Plain(c) => c.enable_events(),
            Core::Tiered(t) => t.cache.enable_device_events()?,
            Core::Pooled(p) => p.enable_events()?,
        }
        // Moves run to turn them on may have freed ids.
        g.collect_freed();
        Ok(())
    }

    /// Turns the device's event stream off.
    pub(crate) fn disable_events(&self) -> FfiResult {
        let mut g = self.lock()?;
        match &mut g.core {
            Core::Plain(c) => c.disable_events(),
            Core::Tiered(t) => t.cache.disable_device_events(),
            Core::Pooled(p) => p.disable_events(),
        }
        Ok(())
    }

    /// Drains the device's events.
    pub(crate) fn drain_events(&self) -> FfiResult<Vec<marconi_core::CacheEvent>> {
        let mut g = self.lock()?;
        Ok(match &mut g.core {
            Core::Plain(c) => c.drain_events(),
            Core::Tiered(t) => t.cache.drain_device_events(),
            Core::Pooled(p) => p.drain_events(),
        })
    }

    /// The device's content as chains.
    pub(crate) fn cached_chains(&self) -> FfiResult<marconi_core::CachedChains> {
        Ok(self.lock()?.device().cached_chains())
    }

    /// Whether the cache lives in the library's pools.
    pub(crate) fn pooled(&self) -> bool {
        self.pooled
    }

    pub(crate) fn lock(&self) -> FfiResult<MutexGuard<'_, Inner>> {
        self.inner.lock().map_err(|_| {
            FfiError::new(
                marconi_status::Poisoned,
                "the cache is unusable after an earlier internal panic",
            )
        })
    }
}

/// Checks the cache pointer and borrows the handle.
///
/// # Safety
///
/// `cache` is NULL or any pointer (only a live cache is dereferenced).
pub(crate) unsafe fn handle<'a>(cache: *const marconi_cache) -> FfiResult<&'a marconi_cache> {
    // SAFETY: the registry check reads nothing behind the pointer.
    unsafe { borrow(cache, "cache") }
}

pub(crate) fn tokens_len_ok(n: usize, what: &str) -> FfiResult {
    if n >= u32::MAX as usize {
        return Err(FfiError::new(
            marconi_status::TooManyTokens,
            format!("{what} has {n} tokens, more than the 4294967295 a sequence may hold"),
        ));
    }
    Ok(())
}

/// Creates a cache from `*cfg` and writes the handle to `*out` (caller frees
/// it with marconi_cache_free). MARCONI_STATUS_INVALID_CONFIG (with the
/// reason in marconi_last_error) for a configuration that cannot drive a
/// cache, e.g. capacity_bytes 0 (without pools). With cfg->pools the cache
/// lives in the library's pools (marconi_cache_lookup_pooled and the other
/// pool calls); with cfg->tiers it has lower tiers; both at once is
/// MARCONI_STATUS_UNSUPPORTED.
#[no_mangle]
pub unsafe extern "C" fn marconi_cache_new(
    cfg: *const marconi_cache_config,
    out: *mut *mut marconi_cache,
) -> marconi_status {
    boundary("marconi_cache_new", || {
        require!(cfg);
        require!(out);
        check_ptr!(cfg);
        check_ptr!(out);
        // SAFETY: cfg is non-NULL and aligned; its size contract is the caller's.
        let c = unsafe { read_struct(cfg) }?;
        // SAFETY: the pointers inside c follow the documented contracts.
        let core = unsafe { build_core(c) }?;
        // SAFETY: out is non-NULL, aligned (checked) and writable (contract).
        unsafe { new_handle(core, out) };
        Ok(())
    })
}

/// The core a configuration asks for: over pools (`c.pools`, with lower
/// tiers below them when `c.tiers` is set too), with lower tiers over ids
/// the engine owns (`c.tiers`), or plain.
///
/// # Safety
///
/// The pointers inside `c` follow the documented contracts of
/// marconi_cache_config.
pub(crate) unsafe fn build_core(c: marconi_cache_config) -> FfiResult<Core> {
    let (tiers, pools) = (c.tiers, c.pools);
    let mut c = c;
    if !pools.is_null() && c.capacity_bytes == 0 {
        // Ignored with pools (their budget is the capacity), but core
        // refuses 0 before it is replaced.
        c.capacity_bytes = 1;
    }
    // SAFETY: the pointers inside c follow the documented contracts.
    let core_cfg = unsafe { to_core_config(&c) }?;
    Ok(if !pools.is_null() {
        check_ptr!(pools);
        // SAFETY: non-NULL and aligned (checked); initialised by
        // marconi_pool_config_init (contract).
        let p = unsafe { read_struct(pools) }?;
        let t = if tiers.is_null() {
            None
        } else {
            check_ptr!(tiers);
            // SAFETY: non-NULL and aligned (checked); initialised by
            // marconi_tier_options_init (contract).
            Some(unsafe { read_struct(tiers) }?)
        };
        Core::Pooled(Box::new(crate::pooled::build(core_cfg, &p, t.as_ref())?))
    } else if tiers.is_null() {
        Core::Plain(PrefixCache::new(core_cfg)?)
    } else {
        check_ptr!(tiers);
        // SAFETY: non-NULL and aligned (checked); initialised by
        // marconi_tier_options_init (contract).
        let o = unsafe { read_struct(tiers) }?;
        Core::Tiered(Box::new(crate::tiered::build_tiers(core_cfg, &o)?))
    })
}

/// Boxes a cache over `core` and writes the handle to `*out`.
///
/// # Safety
///
/// `out` is non-NULL, aligned and writable.
pub(crate) unsafe fn new_handle(core: Core, out: *mut *mut marconi_cache) {
    let decision_log = match &core {
        Core::Plain(c) => c.config().decision_log,
        Core::Tiered(t) => t.cache.device().config().decision_log,
        Core::Pooled(p) => p.device().config().decision_log,
    };
    let c_of_core = decision_log.then(HashMap::new);
    let pooled = matches!(core, Core::Pooled(_));
    let handle = marconi_cache {
        pooled,
        inner: Mutex::new(Inner {
            core,
            leases: HashMap::new(),
            c_of_core,
            owned_slots: HashSet::new(),
            freed_pages: Vec::new(),
            freed_slots: Vec::new(),
            log: VecDeque::new(),
            log_bytes: 0,
        }),
    };
    // SAFETY: out is non-NULL, aligned and writable (contract).
    unsafe { publish(handle, out) };
}

/// Frees a cache and everything it holds. NULL is a no-op. Every lease of the
/// cache becomes invalid; a stale lease passed to another cache is refused
/// with MARCONI_STATUS_UNKNOWN_LEASE (a lease id is issued once per process).
#[no_mangle]
pub unsafe extern "C" fn marconi_cache_free(cache: *mut marconi_cache) {
    boundary_or("marconi_cache_free", (), || {
        // SAFETY: no other call runs on it (contract); anything but a live
        // cache is left alone.
        unsafe { release(cache) };
    })
}

/// Looks up `tokens[0..n_tokens]` in namespace `ns` (a LoRA id or cache
/// salt; 0 by default) and writes what can be reused to `*out`: the usable
/// hit, the KV-matched length, the state slot to resume from, the counts of
/// KV pages and planned checkpoints, and a lease that pins what is reused
/// until marconi_cache_release.
///
/// `dst_slot` is the request's own state slot, or MARCONI_NO_SLOT. When the
/// hit resumes from a cached slot and dst_slot is given, `out->copy_order`
/// is {state_slot, dst_slot}: the engine copies the cached state before
/// resuming. A dst_slot that holds a state owned by the cache (admitted and
/// not yet freed by an eviction) is MARCONI_STATUS_INVALID_ARGUMENT, and
/// nothing changes: the engine would overwrite a cached state.
///
/// On a cache with lower tiers (marconi_cache_config.tiers) this and every
/// other marconi_cache_lookup* call give the device tier's view: the
/// device's own hit, slot and pages, with no lower-tier hit chosen, pinned
/// or counted (the lease loads nothing). marconi_cache_lookup_tiered
/// weighs every tier.
///
/// On a cache over pools (marconi_cache_config.pools) this and every other
/// marconi_cache_lookup* call over engine ids returns
/// MARCONI_STATUS_UNSUPPORTED: use marconi_cache_lookup_pooled.
///
/// Errors: MARCONI_STATUS_EMPTY_TOKENS for n_tokens 0,
/// MARCONI_STATUS_NULL_ARGUMENT for tokens NULL with n_tokens > 0.
#[no_mangle]
pub unsafe extern "C" fn marconi_cache_lookup(
    cache: *const marconi_cache,
    ns: u64,
    tokens: *const u32,
    n_tokens: usize,
    dst_slot: u32,
    out: *mut marconi_lookup,
) -> marconi_status {
    boundary("marconi_cache_lookup", || {
        require!(cache);
        require!(tokens, len = n_tokens);
        require!(out);
        let tokens = TokenSource::U32(tokens, n_tokens);
        let ask = Ask::new(Entry::Ids, "marconi_cache_lookup", ns, tokens);
        // SAFETY: forwarded caller contract.
        unsafe { answer(cache, Ask { dst_slot, ..ask }, out) }
    })
}

/// marconi_cache_lookup with application checkpoint hints:
/// `checkpoints[0..n_checkpoints]` are positions of the input the
/// application expects later requests to share (the end of a system
/// prompt, of tool definitions, of a document). Marconi admission saves a
/// state at a shared prefix only once a second request branches there; a
/// hint saves one on the first request. Each hint is rounded down to the
/// checkpoint grid and added to the plan (marconi_cache_lease_plan; the
/// decision log names it "AppCheckpoint") when it is greater than the hit,
/// at most n_tokens and not already cached or planned; other hints are
/// dropped silently (in any order, duplicates allowed). The state admitted
/// there is an ordinary checkpoint that eviction treats like any other.
/// With n_checkpoints 0 this is marconi_cache_lookup.
///
/// Errors: those of marconi_cache_lookup, and MARCONI_STATUS_NULL_ARGUMENT
/// for checkpoints NULL with n_checkpoints > 0, MARCONI_STATUS_TOO_MANY_TOKENS
/// for n_checkpoints >= 2^32 - 1 (refused before the array is read).
#[no_mangle]
pub unsafe extern "C" fn marconi_cache_lookup_hinted(
    cache: *const marconi_cache,
    ns: u64,
    tokens: *const u32,
    n_tokens: usize,
    checkpoints: *const u32,
    n_checkpoints: usize,
    dst_slot: u32,
    out: *mut marconi_lookup,
) -> marconi_status {
    boundary("marconi_cache_lookup_hinted", || {
        require!(cache);
        require!(tokens, len = n_tokens);
        require!(checkpoints, len = n_checkpoints);
        require!(out);
        // SAFETY: buffer contract of the header.
        let hints = unsafe { hints_in(checkpoints, n_checkpoints) }?;
        let tokens = TokenSource::U32(tokens, n_tokens);
        let ask = Ask::new(Entry::Ids, "marconi_cache_lookup_hinted", ns, tokens);
        // SAFETY: forwarded caller contract.
        unsafe {
            answer(
                cache,
                Ask {
                    hints,
                    dst_slot,
                    ..ask
                },
                out,
            )
        }
    })
}

/// marconi_cache_lookup with the tokens as int64 ids (`tokens[0..n_tokens]`),
/// as Python's `array('q')` and torch's int64 tensors hold them (SGLang's
/// `RadixKey.token_ids`): read in place, with no conversion by the caller.
/// Every id must be in [0, 2^32 - 1] (the ids marconi_cache_lookup takes);
/// one outside is MARCONI_STATUS_INVALID_ARGUMENT, naming the first such
/// `tokens[i]`, and nothing changes.
///
/// Errors: those of marconi_cache_lookup.
#[no_mangle]
pub unsafe extern "C" fn marconi_cache_lookup_i64(
    cache: *const marconi_cache,
    ns: u64,
    tokens: *const i64,
    n_tokens: usize,
    dst_slot: u32,
    out: *mut marconi_lookup,
) -> marconi_status {
    boundary("marconi_cache_lookup_i64", || {
        require!(cache);
        require!(tokens, len = n_tokens);
        require!(out);
        let tokens = TokenSource::I64(tokens, n_tokens);
        let ask = Ask::new(Entry::Ids, "marconi_cache_lookup_i64", ns, tokens);
        // SAFETY: forwarded caller contract.
        unsafe { answer(cache, Ask { dst_slot, ..ask }, out) }
    })
}

/// marconi_cache_lookup_i64 with `flags`, a bitwise OR of
/// MARCONI_LOOKUP_WHOLE_INPUT (the hit may cover all n_tokens tokens) and
/// MARCONI_LOOKUP_NO_KV_PAGES (the hit's page ids are computed only when
/// marconi_cache_lease_kv_pages asks; `out->n_kv_pages` is 0). With flags 0
/// this is marconi_cache_lookup_i64.
///
/// Errors: those of marconi_cache_lookup_i64, and
/// MARCONI_STATUS_INVALID_ARGUMENT for a flag bit this library does not
/// know (refused before anything is read; nothing changes).
#[no_mangle]
pub unsafe extern "C" fn marconi_cache_lookup_i64_flags(
    cache: *const marconi_cache,
    ns: u64,
    tokens: *const i64,
    n_tokens: usize,
    dst_slot: u32,
    flags: u32,
    out: *mut marconi_lookup,
) -> marconi_status {
    boundary("marconi_cache_lookup_i64_flags", || {
        require!(cache);
        require!(tokens, len = n_tokens);
        require!(out);
        let opts = lookup_flags(flags)?;
        let tokens = TokenSource::I64(tokens, n_tokens);
        let ask = Ask::new(Entry::Ids, "marconi_cache_lookup_i64_flags", ns, tokens);
        // SAFETY: forwarded caller contract.
        unsafe {
            answer(
                cache,
                Ask {
                    dst_slot,
                    opts,
                    ..ask
                },
                out,
            )
        }
    })
}

/// The lookup options of a marconi_cache_lookup_i64_flags `flags` word;
/// MARCONI_STATUS_INVALID_ARGUMENT for a bit this library does not know.
pub(crate) fn lookup_flags(flags: u32) -> FfiResult<LookupOptions> {
    Ok(lookup_flags_with(flags, 0)?.0)
}

/// [`lookup_flags`] that also knows the bit `extra`, and says whether it
/// is set.
pub(crate) fn lookup_flags_with(flags: u32, extra: u32) -> FfiResult<(LookupOptions, bool)> {
    let known = LOOKUP_FLAGS | extra;
    if flags & !known != 0 {
        return Err(FfiError::new(
            marconi_status::InvalidArgument,
            format!("flags {flags:#x}: unknown bits {:#x}", flags & !known),
        ));
    }
    let opts = LookupOptions {
        whole_input: flags & MARCONI_LOOKUP_WHOLE_INPUT != 0,
        skip_kv_pages: flags & MARCONI_LOOKUP_NO_KV_PAGES != 0,
    };
    Ok((opts, extra != 0 && flags & extra != 0))
}

/// A caller's id array: uint32 ids (read in place) or int64 ids (checked
/// and narrowed, in one pass).
#[derive(Clone, Copy)]
pub(crate) enum TokenSource {
    U32(*const u32, usize),
    I64(*const i64, usize),
}

impl TokenSource {
    /// The ids, after the length check (tokens_len_ok) and the buffer
    /// checks; `what` names the argument in errors.
    ///
    /// # Safety
    ///
    /// The pointer has its length in readable elements, or is NULL.
    pub(crate) unsafe fn read<'a>(self, what: &str) -> FfiResult<Cow<'a, [u32]>> {
        let (TokenSource::U32(_, n) | TokenSource::I64(_, n)) = self;
        tokens_len_ok(n, what)?;
        // SAFETY: forwarded caller contract.
        unsafe { self.ids(what) }
    }

    /// The ids, after the buffer checks only (page lists).
    ///
    /// # Safety
    ///
    /// As [`TokenSource::read`].
    pub(crate) unsafe fn ids<'a>(self, what: &str) -> FfiResult<Cow<'a, [u32]>> {
        match self {
            // SAFETY: forwarded caller contract.
            TokenSource::U32(p, n) => Ok(Cow::Borrowed(unsafe { in_slice(p, n, what) }?)),
            TokenSource::I64(p, n) => {
                // SAFETY: forwarded caller contract.
                let ids = unsafe { in_slice(p, n, what) }?;
                narrow_ids(ids, what).map(Cow::Owned)
            }
        }
    }
}

/// int64 ids as uint32 ids; MARCONI_STATUS_INVALID_ARGUMENT naming the first
/// id outside [0, 2^32 - 1]. The common case is one pass that vectorises:
/// every id fits iff no id, read as 64 unsigned bits, has a bit above 31.
pub(crate) fn narrow_ids(ids: &[i64], what: &str) -> FfiResult<Vec<u32>> {
    if ids.iter().fold(0u64, |acc, &t| acc | t as u64) >> 32 == 0 {
        return Ok(ids.iter().map(|&t| t as u32).collect());
    }
    let (i, t) = ids
        .iter()
        .enumerate()
        .find(|(_, &t)| u32::try_from(t).is_err())
        .map_or((0, 0), |(i, &t)| (i, t));
    Err(FfiError::new(
        marconi_status::InvalidArgument,
        format!("{what}[{i}] = {t} is not an id in [0, 4294967295]"),
    ))
}

/// Writes the KV page ids of a lease's hit (the engine's pages holding the
/// first hit_tokens tokens, in order) into `buf[0..cap]` and their number to
/// `*out_len`. With a buffer too small (NULL with cap 0 is a size query), returns
/// MARCONI_STATUS_BUFFER_TOO_SMALL and writes only the needed count to
/// `*out_len`. On a cache over pools: MARCONI_STATUS_UNSUPPORTED (its
/// pages are handles: marconi_cache_lease_kv_handles).
#[no_mangle]
pub unsafe extern "C" fn marconi_cache_lease_kv_pages(
    cache: *const marconi_cache,
    lease: u64,
    buf: *mut u32,
    cap: usize,
    out_len: *mut usize,
) -> marconi_status {
    boundary("marconi_cache_lease_kv_pages", || {
        require!(cache);
        require!(buf, cap = cap);
        require!(out_len);
        // SAFETY: the caller passes a live handle or NULL.
        let h = unsafe { handle(cache) }?;
        // SAFETY: buffer contract of the header.
        let buf = unsafe { out_slice(buf, cap, "buf") }?;
        check_ptr!(out_len);
        let g = h.lock()?;
        g.not_pooled(
            "marconi_cache_lease_kv_pages",
            "marconi_cache_lease_kv_handles",
        )?;
        let core_lease = g.core_lease(lease)?;
        match &g.leases[&lease].pages {
            Some(pages) => copy_list(pages, buf, out_len),
            None => {
                let pages = g
                    .device()
                    .lease_kv_pages(core_lease)
                    .map_err(|_| FfiError::from(marconi_core::CacheError::UnknownLease(lease)))?;
                copy_list(&pages, buf, out_len)
            }
        }
    })
}

/// Writes the checkpoint positions planned for a lease (ascending: save the
/// recurrent state after each of these many tokens during prefill) into
/// `buf[0..cap]` and their number to `*out_len`. The final state is always
/// admissible and is not listed. A buffer too small behaves as in
/// marconi_cache_lease_kv_pages. Works on every cache (a lease of
/// marconi_cache_lookup_pooled too).
#[no_mangle]
pub unsafe extern "C" fn marconi_cache_lease_plan(
    cache: *const marconi_cache,
    lease: u64,
    buf: *mut u32,
    cap: usize,
    out_len: *mut usize,
) -> marconi_status {
    boundary("marconi_cache_lease_plan", || {
        require!(cache);
        require!(buf, cap = cap);
        require!(out_len);
        // SAFETY: the caller passes a live handle or NULL.
        let h = unsafe { handle(cache) }?;
        // SAFETY: buffer contract of the header.
        let buf = unsafe { out_slice(buf, cap, "buf") }?;
        check_ptr!(out_len);
        let g = h.lock()?;
        let core_lease = g.core_lease(lease)?;
        let plan = match &g.core {
            Core::Plain(c) => c.plan(core_lease),
            Core::Tiered(t) => t
                .leases
                .get(&lease)
                .map(|l| &l.plan[..])
                .ok_or(marconi_core::CacheError::UnknownLease(core_lease)),
            Core::Pooled(p) => p
                .plan(lease)
                .ok_or(marconi_core::CacheError::UnknownLease(core_lease)),
        }
        .map_err(|_| FfiError::from(marconi_core::CacheError::UnknownLease(lease)))?;
        copy_list(plan, buf, out_len)
    })
}

/// Admits `tokens[0..n_tokens]` (the looked-up input, optionally followed by
/// decoded output) under `lease`, with the states the engine saved
/// (`states[0..n_states]`: planned positions and the final position) and,
/// when the engine tracks KV pages, one page id per full page of tokens
/// (`kv_pages[0..n_kv_pages]`, or none at all). Evicts as needed. May be
/// called more than once per lease (after prefill, after decode).
///
/// Ownership: the slots of the states the cache takes and the pages
/// `kv_pages[out->kv_pages_taken_start .. out->kv_pages_taken_end)` pass to the
/// cache (they come back through marconi_cache_drain_freed); the rest stay
/// the engine's. When `taken` is not NULL it has n_states bytes and `taken[i]`
/// is set to 1 if `states[i]` was taken, else 0.
///
/// Errors (nothing changes): MARCONI_STATUS_UNKNOWN_LEASE, _PREFIX_MISMATCH,
/// _NOT_PLANNED (a position the cache never planned), _DUPLICATE_SLOT (a slot
/// given twice or already the cache's), _DUPLICATE_POSITION, _DUPLICATE_PAGE,
/// _BAD_PAGE_LIST, _POSITION_OUT_OF_RANGE, _EMPTY_TOKENS, _NULL_ARGUMENT;
/// _UNSUPPORTED on a cache over pools (use marconi_cache_admit_pooled).
#[no_mangle]
pub unsafe extern "C" fn marconi_cache_admit(
    cache: *const marconi_cache,
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
    boundary("marconi_cache_admit", || {
        require!(cache);
        require!(tokens, len = n_tokens);
        require!(states, len = n_states);
        require!(kv_pages, len = n_kv_pages);
        require!(out);
        // SAFETY: forwarded caller contract.
        unsafe {
            admit_ids(
                cache,
                lease,
                TokenSource::U32(tokens, n_tokens),
                (states, n_states),
                TokenSource::U32(kv_pages, n_kv_pages),
                taken,
                out,
            )
        }
    })
}

/// marconi_cache_admit with the tokens and the KV page ids as int64 ids
/// (`tokens[0..n_tokens]`, `kv_pages[0..n_kv_pages]`), as Python's
/// `array('q')` and torch's int64 tensors hold them (SGLang's
/// `RadixKey.token_ids` and KV indices): read in place, with no conversion
/// by the caller. Every id must be in [0, 2^32 - 1]; one outside is
/// MARCONI_STATUS_INVALID_ARGUMENT, naming the first such `tokens[i]` or
/// `kv_pages[i]`, and nothing changes.
///
/// Ownership and errors: those of marconi_cache_admit.
#[no_mangle]
pub unsafe extern "C" fn marconi_cache_admit_i64(
    cache: *const marconi_cache,
    lease: u64,
    tokens: *const i64,
    n_tokens: usize,
    states: *const marconi_saved_state,
    n_states: usize,
    kv_pages: *const i64,
    n_kv_pages: usize,
    taken: *mut u8,
    out: *mut marconi_admit_result,
) -> marconi_status {
    boundary("marconi_cache_admit_i64", || {
        require!(cache);
        require!(tokens, len = n_tokens);
        require!(states, len = n_states);
        require!(kv_pages, len = n_kv_pages);
        require!(out);
        // SAFETY: forwarded caller contract.
        unsafe {
            admit_ids(
                cache,
                lease,
                TokenSource::I64(tokens, n_tokens),
                (states, n_states),
                TokenSource::I64(kv_pages, n_kv_pages),
                taken,
                out,
            )
        }
    })
}

/// The body of marconi_cache_admit(_i64) (and of marconi_cache_admit_with
/// over ids), after the NULL checks.
///
/// # Safety
///
/// As marconi_cache_admit.
pub(crate) unsafe fn admit_ids(
    cache: *const marconi_cache,
    lease: u64,
    tokens: TokenSource,
    (states, n_states): (*const marconi_saved_state, usize),
    kv_pages: TokenSource,
    taken: *mut u8,
    out: *mut marconi_admit_result,
) -> FfiResult {
    // SAFETY: the caller passes a live handle or NULL.
    let h = unsafe { handle(cache) }?;
    // SAFETY: buffer contracts of the header.
    let tokens = unsafe { tokens.read("tokens") }?;
    let tokens = &tokens[..];
    // SAFETY: as above.
    let states = unsafe { in_slice(states, n_states, "states") }?;
    // SAFETY: as above.
    let kv_pages = unsafe { kv_pages.ids("kv_pages") }?;
    let kv_pages = &kv_pages[..];
    let taken = if taken.is_null() {
        None
    } else {
        // SAFETY: taken has n_states writable bytes (contract).
        Some(unsafe { out_slice(taken, n_states, "taken") }?)
    };
    check_ptr!(out);
    let saved: Vec<SavedState> = states
        .iter()
        .map(|s| SavedState {
            position: s.position,
            slot: (s.slot != MARCONI_NO_SLOT).then_some(s.slot),
        })
        .collect();
    let mut g = h.lock()?;
    g.not_pooled("marconi_cache_admit", "marconi_cache_admit_pooled")?;
    let core_lease = g.core_lease(lease)?;
    let o = match &mut g.core {
        Core::Plain(c) => c.admit(core_lease, tokens, &saved, kv_pages),
        Core::Tiered(t) => t.admit(lease, core_lease, tokens, &saved, kv_pages),
        Core::Pooled(_) => {
            return Err(pooled_instead(
                "marconi_cache_admit",
                "marconi_cache_admit_pooled",
            ))
        }
    };
    // Moves into the lower tiers run even when the admission failed.
    let o = o.map_err(|e| match e {
        marconi_core::CacheError::UnknownLease(_) => {
            FfiError::from(marconi_core::CacheError::UnknownLease(lease))
        }
        e => FfiError::from(e),
    });
    if o.is_err() {
        g.collect_freed();
    }
    let o = o?;
    for s in &saved {
        if let (Some(slot), true) = (s.slot, o.states_taken.contains(&s.position)) {
            g.owned_slots.insert(slot);
        }
    }
    // Evictions during the admission may have freed slots.
    g.collect_freed();
    g.collect_log();
    if let Some(t) = taken {
        for (flag, s) in t.iter_mut().zip(states) {
            *flag = u8::from(o.states_taken.contains(&s.position));
        }
    }
    // Without a page list there is nothing to index.
    let res = marconi_admit_result::of(
        &o,
        o.states_taken.len() as u32,
        o.slots_returned.len() as u32,
        !kv_pages.is_empty(),
    );
    // SAFETY: out is non-NULL and aligned (checked) and writable.
    unsafe { out.write(res) };
    Ok(())
}

/// Releases `lease` (of any lookup of this cache: marconi_cache_lookup,
/// _lookup_tiered or _lookup_pooled): what it pinned becomes evictable
/// again. MARCONI_STATUS_UNKNOWN_LEASE for a lease never issued by this
/// cache or already released.
#[no_mangle]
pub unsafe extern "C" fn marconi_cache_release(
    cache: *const marconi_cache,
    lease: u64,
) -> marconi_status {
    boundary("marconi_cache_release", || {
        // SAFETY: the caller passes a live handle or NULL.
        let h = unsafe { handle(cache) }?;
        let mut g = h.lock()?;
        let core_lease = g.core_lease(lease)?;
        let r = match &mut g.core {
            Core::Plain(c) => c.release(core_lease),
            Core::Tiered(t) => t.release(lease, core_lease),
            Core::Pooled(p) => p.release(lease, core_lease),
        };
        if matches!(g.core, Core::Tiered(_)) {
            // Releasing runs the moves into the lower tiers.
            g.collect_freed();
        }
        r.map_err(|_| FfiError::from(marconi_core::CacheError::UnknownLease(lease)))?;
        g.collect_log();
        g.leases.remove(&lease);
        if let Some(m) = &mut g.c_of_core {
            m.remove(&core_lease);
        }
        Ok(())
    })
}

/// Drains the engine ids freed by evictions since the last drain: KV page
/// ids into `pages[0..pages_cap]` and state slot ids into
/// `slots[0..slots_cap]`, with their counts in `*n_pages` and `*n_slots`.
/// The engine may reuse them. All or nothing: when either buffer is too
/// small (NULL with capacity 0 is a size query), returns
/// MARCONI_STATUS_BUFFER_TOO_SMALL, writes the needed counts to `*n_pages`
/// and `*n_slots`, and drains nothing.
///
/// On a cache with lower tiers, drain the ops (marconi_cache_drain_ops)
/// first: a WRITE to the host reads a slot this returns; every id this
/// returns is the engine's to reuse at once (with defer_moves, ids freed
/// since the last marconi_cache_settle wait for the next one). On a cache
/// over pools: MARCONI_STATUS_UNSUPPORTED (use
/// marconi_cache_drain_freed_units).
///
/// Thread safety: safe to call concurrently on the same cache; each freed id
/// is delivered to exactly one caller.
#[no_mangle]
pub unsafe extern "C" fn marconi_cache_drain_freed(
    cache: *const marconi_cache,
    pages: *mut u32,
    pages_cap: usize,
    n_pages: *mut usize,
    slots: *mut u32,
    slots_cap: usize,
    n_slots: *mut usize,
) -> marconi_status {
    boundary("marconi_cache_drain_freed", || {
        require!(cache);
        require!(pages, cap = pages_cap);
        require!(n_pages);
        require!(slots, cap = slots_cap);
        require!(n_slots);
        // SAFETY: the caller passes a live handle or NULL.
        let h = unsafe { handle(cache) }?;
        // SAFETY: buffer contracts of the header.
        let pages = unsafe { out_slice(pages, pages_cap, "pages") }?;
        // SAFETY: as above.
        let slots = unsafe { out_slice(slots, slots_cap, "slots") }?;
        check_ptr!(n_pages);
        check_ptr!(n_slots);
        let mut g = h.lock()?;
        g.not_pooled(
            "marconi_cache_drain_freed",
            "marconi_cache_drain_freed_units",
        )?;
        g.collect_freed();
        let g = &mut *g;
        // SAFETY: n_pages and n_slots are non-NULL and aligned (checked),
        // writable by the caller's contract.
        unsafe {
            hand_out_freed(
                (&mut g.freed_pages, &mut g.freed_slots),
                (pages, slots),
                (n_pages, n_slots),
            )
        }
    })
}

/// Writes the pending freed ids' counts to `*n_pages`/`*n_slots`, then the
/// ids into `pages`/`slots` and clears them; when either buffer is too
/// small, only the counts are written (BUFFER_TOO_SMALL) and nothing is
/// drained. marconi_cache_drain_freed and marconi_tiered_drain_freed.
///
/// # Safety
///
/// `n_pages` and `n_slots` are non-NULL, aligned and writable.
pub(crate) unsafe fn hand_out_freed(
    (freed_pages, freed_slots): (&mut Vec<u32>, &mut Vec<u32>),
    (pages, slots): (&mut [u32], &mut [u32]),
    (n_pages, n_slots): (*mut usize, *mut usize),
) -> FfiResult {
    let (np, ns) = (freed_pages.len(), freed_slots.len());
    // SAFETY: this function's contract.
    unsafe {
        n_pages.write(np);
        n_slots.write(ns);
    }
    if pages.len() < np || slots.len() < ns {
        return Err(FfiError::new(
            marconi_status::BufferTooSmall,
            format!(
                "{np} page ids and {ns} slot ids are pending; buffers hold {} and {}",
                pages.len(),
                slots.len()
            ),
        ));
    }
    pages[..np].copy_from_slice(freed_pages);
    slots[..ns].copy_from_slice(freed_slots);
    freed_pages.clear();
    freed_slots.clear();
    Ok(())
}

/// Evicts until at least `bytes` are free (or nothing evictable is left) and
/// writes the bytes now free to `*free_bytes`. Freed ids are reported by
/// marconi_cache_drain_freed. On a cache with lower tiers what it evicts
/// moves down as an admission's evictions do (ops in
/// marconi_cache_drain_ops; with defer_moves at the next
/// marconi_cache_settle). On a cache over pools: MARCONI_STATUS_UNSUPPORTED
/// (its reservations evict as needed: marconi_cache_reserve).
#[no_mangle]
pub unsafe extern "C" fn marconi_cache_evict(
    cache: *const marconi_cache,
    bytes: u64,
    free_bytes: *mut u64,
) -> marconi_status {
    boundary("marconi_cache_evict", || {
        require!(cache);
        require!(free_bytes);
        // SAFETY: the caller passes a live handle or NULL.
        let h = unsafe { handle(cache) }?;
        check_ptr!(free_bytes);
        let mut g = h.lock()?;
        let free = match &mut g.core {
            Core::Plain(c) => Ok(c.evict(bytes)),
            Core::Tiered(t) => t.cache.evict(bytes),
            Core::Pooled(_) => {
                return Err(FfiError::new(
                    marconi_status::Unsupported,
                    "marconi_cache_evict: a cache over pools (marconi_cache_config.pools) \
                     evicts when a reservation needs room (marconi_cache_reserve)",
                ))
            }
        };
        g.collect_freed();
        let free = free?;
        // SAFETY: free_bytes is non-NULL, aligned and writable.
        unsafe { free_bytes.write(free) };
        Ok(())
    })
}

/// Writes the cache's counters and gauges to `*out`. Set out->struct_size to
/// sizeof(marconi_stats) first: only that many bytes are written (at least
/// 16), so callers compiled against an older header keep working. On a
/// cache over pools the capacity is the pools' budget, and
/// marconi_cache_pool_stats has the pools' own counters.
#[no_mangle]
pub unsafe extern "C" fn marconi_cache_stats(
    cache: *const marconi_cache,
    out: *mut marconi_stats,
) -> marconi_status {
    boundary("marconi_cache_stats", || {
        require!(cache);
        require!(out);
        // SAFETY: the caller passes a live handle or NULL.
        let h = unsafe { handle(cache) }?;
        check_ptr!(out);
        // SAFETY: out is non-NULL and aligned; its first field is struct_size.
        let size = unsafe { out.cast::<u32>().read() } as usize;
        if size < STATS_MIN_SIZE {
            return Err(FfiError::new(
                marconi_status::UnsupportedStructSize,
                format!("stats struct_size is {size}; set it to sizeof(marconi_stats)"),
            ));
        }
        let g = h.lock()?;
        let c = g.device();
        let s = c.stats();
        let model = &c.config().model;
        let (evictable_kv_tokens, evictable_states) = c.evictable_split();
        let st = marconi_stats {
            struct_size: size as u32,
            tuning_rounds: s.tuning_rounds,
            requests: s.requests,
            hit_requests: s.hit_requests,
            input_tokens: s.input_tokens,
            hit_tokens: s.hit_tokens,
            kv_matched_unusable_tokens: s.kv_matched_unusable_tokens,
            flops_saved: s.flops_saved,
            flops_total: s.flops_total,
            kv_bytes: s.kv_bytes,
            state_bytes: s.state_bytes,
            capacity_bytes: s.capacity_bytes,
            states: s.states,
            nodes: s.nodes,
            evictions: s.evictions,
            states_admitted: s.states_admitted,
            admissions_rejected: s.admissions_rejected,
            admissions_truncated: s.admissions_truncated,
            leases: s.leases,
            alpha: s.alpha,
            used_bytes: c.used_bytes(),
            evictable_bytes: c.evictable_bytes(),
            kv_bytes_per_token: model.kv_bytes_per_token(),
            state_bytes_per_entry: s
                .state_bytes
                .checked_div(s.states)
                .unwrap_or_else(|| model.state_bytes()),
            evictable_kv_tokens,
            evictable_states,
        };
        // SAFETY: out has `size` writable bytes (contract), checked above.
        unsafe { write_versioned(&st, out, size) };
        Ok(())
    })
}

/// Drains decision-log records (enable with marconi_cache_config.decision_log)
/// as JSON lines (lease fields carry the lease ids marconi_cache_lookup
/// returned), one object per line ending in '\n', into `buf[0..cap]`, and
/// writes the bytes written to `*out_len`. The text is not NUL-terminated.
/// Writes as many whole lines as fit and keeps the rest for the next call;
/// when lines are pending but not even the first fits (NULL with cap 0 is a
/// size query), returns MARCONI_STATUS_BUFFER_TOO_SMALL and writes the bytes
/// of all pending lines to `*out_len`. 0 bytes with MARCONI_STATUS_OK: nothing
/// pending.
///
/// Thread safety: safe to call concurrently on the same cache; each record is
/// delivered to exactly one caller.
#[no_mangle]
pub unsafe extern "C" fn marconi_cache_drain_log(
    cache: *const marconi_cache,
    buf: *mut c_char,
    cap: usize,
    out_len: *mut usize,
) -> marconi_status {
    boundary("marconi_cache_drain_log", || {
        require!(cache);
        require!(buf, cap = cap);
        require!(out_len);
        // SAFETY: the caller passes a live handle or NULL.
        let h = unsafe { handle(cache) }?;
        // SAFETY: buffer contract of the header.
        let buf = unsafe { out_slice(buf.cast::<u8>(), cap, "buf") }?;
        check_ptr!(out_len);
        let mut g = h.lock()?;
        g.collect_log();
        let mut written = 0usize;
        while let Some(line) = g.log.front() {
            if written + line.len() > buf.len() {
                break;
            }
            buf[written..written + line.len()].copy_from_slice(line.as_bytes());
            written += line.len();
            g.log_bytes -= line.len();
            g.log.pop_front();
        }
        if written == 0 && !g.log.is_empty() {
            let needed = g.log_bytes;
            // SAFETY: out_len is non-NULL, aligned and writable.
            unsafe { out_len.write(needed) };
            return Err(FfiError::new(
                marconi_status::BufferTooSmall,
                format!("{needed} bytes of log lines are pending; the buffer holds {cap}"),
            ));
        }
        // SAFETY: as above.
        unsafe { out_len.write(written) };
        Ok(())
    })
}

/// Checks every internal invariant of the cache (byte accounting, tree
/// links, lease counts, capacity). MARCONI_STATUS_INVARIANT_VIOLATED with
/// the violation in marconi_last_error if one is broken, after which the
/// cache answers MARCONI_STATUS_POISONED. O(cached tokens): for tests.
#[no_mangle]
pub unsafe extern "C" fn marconi_cache_check(cache: *const marconi_cache) -> marconi_status {
    boundary("marconi_cache_check", || {
        // SAFETY: the caller passes a live handle or NULL.
        let h = unsafe { handle(cache) }?;
        let g = h.lock()?;
        let res = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| match &g.core {
            Core::Plain(c) => c.check_invariants(),
            Core::Tiered(t) => t.cache.check_invariants(),
            Core::Pooled(p) => p.check_invariants(),
        }));
        match res {
            Ok(()) => Ok(()),
            Err(p) => {
                let msg = p
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                    .unwrap_or_default();
                // Poison the lock: a cache with a broken invariant must not be
                // used again.
                let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
                    let _g = g;
                    panic!("invariant violated");
                }));
                Err(FfiError::new(
                    marconi_status::InvariantViolated,
                    format!("invariant violated: {msg}"),
                ))
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::marconi_cache_config_init;
    use crate::status::last_error;

    fn new_cache() -> *mut marconi_cache {
        let mut cfg = std::mem::MaybeUninit::<marconi_cache_config>::uninit();
        let size = std::mem::size_of::<marconi_cache_config>();
        // SAFETY: cfg has `size` writable bytes.
        let st = unsafe { marconi_cache_config_init(cfg.as_mut_ptr(), size) };
        assert_eq!(st, marconi_status::Ok);
        // SAFETY: initialised above.
        let mut cfg = unsafe { cfg.assume_init() };
        cfg.capacity_bytes = 1 << 40;
        let mut cache = std::ptr::null_mut();
        // SAFETY: valid config and out pointer.
        assert_eq!(
            unsafe { marconi_cache_new(&cfg, &mut cache) },
            marconi_status::Ok
        );
        cache
    }

    #[test]
    fn a_panic_becomes_a_status_and_poisons_only_its_cache() {
        let cache = new_cache();
        // SAFETY: live handle from new_cache.
        let h = unsafe { &*cache };
        // A bug panicking while the lock is held, as a boundary body would.
        let st = crate::status::boundary("test", || {
            let _g = h.lock()?;
            panic!("simulated bug");
        });
        assert_eq!(st, marconi_status::Panic);
        assert!(
            last_error().contains("panic: simulated bug"),
            "{}",
            last_error()
        );
        let tokens = [1u32, 2, 3];
        let mut out = marconi_lookup::default();
        // SAFETY: live handle, valid buffers.
        let st = unsafe {
            marconi_cache_lookup(cache, 0, tokens.as_ptr(), 3, MARCONI_NO_SLOT, &mut out)
        };
        assert_eq!(st, marconi_status::Poisoned);
        assert_eq!(out, marconi_lookup::default(), "no output on failure");
        let other = new_cache();
        // SAFETY: live handle, valid buffers.
        let st = unsafe {
            marconi_cache_lookup(other, 0, tokens.as_ptr(), 3, MARCONI_NO_SLOT, &mut out)
        };
        assert_eq!(st, marconi_status::Ok);
        // SAFETY: both handles are live and freed once.
        unsafe {
            marconi_cache_free(cache);
            marconi_cache_free(other);
        }
    }

    fn lookup_lease(cache: *const marconi_cache, tokens: &[u32]) -> u64 {
        let mut out = marconi_lookup::default();
        // SAFETY: live handle, valid buffers.
        let st = unsafe {
            marconi_cache_lookup(
                cache,
                0,
                tokens.as_ptr(),
                tokens.len(),
                MARCONI_NO_SLOT,
                &mut out,
            )
        };
        assert_eq!(st, marconi_status::Ok, "{}", last_error());
        out.lease
    }

    /// Regression: lease ids were a 24-bit cache
    /// generation over a per-cache number, so the 2^24-th cache after A
    /// accepted A's leases. Ids now come once from a process-wide sequence
    /// that refuses to wrap: forced to its end, it stops instead of repeating.
    #[test]
    fn the_lease_id_sequence_never_wraps() {
        let counter = AtomicU64::new(u64::MAX - 2);
        let a = next_lease_id(&counter).expect("an id is left");
        let b = next_lease_id(&counter).expect("the last id");
        assert_ne!(a, b);
        assert_eq!(next_lease_id(&counter), None, "spent: refuses, no wrap");
        assert_eq!(next_lease_id(&counter), None, "and stays spent");
        assert_eq!(counter.load(Ordering::Relaxed), u64::MAX);
        let ids: HashSet<u64> = (1..10_000).map(scramble).collect();
        assert_eq!(ids.len(), 9_999, "scramble is injective");
        assert!(!ids.contains(&0), "0 is never an id");
    }

    /// Every cache numbers its core leases from 1, yet no cache accepts
    /// another's lease, live or freed, nor one it released.
    #[test]
    fn a_lease_is_valid_only_in_the_cache_that_issued_it() {
        let a = new_cache();
        let la = lookup_lease(a, &[1, 2, 3]);
        let b = new_cache();
        let lb = lookup_lease(b, &[1, 2, 3]);
        assert_ne!(la, lb);
        // SAFETY: live handles; freed once below.
        unsafe {
            assert_eq!(marconi_cache_release(b, la), marconi_status::UnknownLease);
            assert_eq!(marconi_cache_release(a, lb), marconi_status::UnknownLease);
            assert_eq!(
                marconi_cache_release(a, la.wrapping_add(1)),
                marconi_status::UnknownLease
            );
            marconi_cache_free(a);
            let c = new_cache();
            let lc = lookup_lease(c, &[1, 2, 3]);
            assert_eq!(marconi_cache_release(c, la), marconi_status::UnknownLease);
            assert_eq!(marconi_cache_release(b, lb), marconi_status::Ok);
            assert_eq!(marconi_cache_release(b, lb), marconi_status::UnknownLease);
            assert_eq!(marconi_cache_release(c, lc), marconi_status::Ok);
            assert_eq!(marconi_cache_release(c, 0), marconi_status::UnknownLease);
            marconi_cache_free(b);
            marconi_cache_free(c);
        }
    }
}
