//! The cache over pools through the C ABI: a `marconi_cache` created with
//! `marconi_cache_config.pools` runs marconi-gpu's `PooledCache` (the
//! prefix cache deciding over a pool's KV pages and state slots, whose
//! capacity is the pools') through the request cycle lookup / reserve /
//! admit / free / release / drain, with handles as ids. The pool
//! configuration chooses the memory: backend NONE, MEMFD or CUDA. The
//! `marconi_pooled_cache_*` entry points are deprecated forwarders onto the
//! `marconi_cache_*` calls (a `marconi_pooled_cache` is a `marconi_cache`
//! with pools).

use std::collections::HashMap;

use marconi_core::{
    CacheConfig, CacheError, Decision, LookupOptions, PrefixCache, Stats, TierConfig, TieredCache,
    TieredLookup,
};
use marconi_gpu::phys::{BackedPool, MemfdBackend, PhysicalMemory};
use marconi_gpu::pooled::{
    unit_sizes, PooledCache, PooledError, PooledLookup, PooledState, PooledStats,
};
use marconi_gpu::snapshot::SlotPair;
use marconi_gpu::{DualPool, PoolAllocator, PoolKind, VirtualHandle};

use crate::cache::{
    build_core, handle, marconi_admit_result, marconi_cache, marconi_cache_check,
    marconi_cache_free, marconi_cache_lease_plan, marconi_cache_release, new_handle, unknown_lease,
    TokenSource,
};
use crate::config::marconi_cache_config;
use crate::lookup::{answer, hints_in, Ask, Entry};
use crate::pool::{
    alloc_err, at_handle, chunked_dual_pool, copy_states_in, location, marconi_pool_backend,
    marconi_pool_config, marconi_state_copy, marconi_unit_location, state_index, Backing,
};
use crate::status::{
    boundary, check_ptr, copy_list, in_slice, marconi_status, out_slice, read_struct, require,
    write_versioned, FfiError, FfiResult,
};
use crate::tiered::{marconi_tier_options, tier_config, TierBook};

enum Joined {
    Plain(PooledCache<DualPool>),
    Memfd(PooledCache<BackedPool<MemfdBackend>>),
    #[cfg(feature = "cuda")]
    Cuda(
        PooledCache<BackedPool<marconi_gpu::cuda::phys::CudaPhysical>>,
        crate::pool::CudaCopier,
    ),
}

/// Runs `$body` with `$c` bound to the `PooledCache` of any backend.
macro_rules! with {
    ($j:expr, $c:ident => $body:expr) => {
        match $j {
            Joined::Plain($c) => $body,
            Joined::Memfd($c) => $body,
            #[cfg(feature = "cuda")]
            Joined::Cuda($c, _) => $body,
        }
    };
}

/// What a lease of marconi_cache_lookup_pooled gives out.
pub(crate) struct PoolLease {
    /// The hit's KV page handles.
    pub(crate) pages: Vec<u64>,
    /// The checkpoints planned.
    pub(crate) plan: Vec<u32>,
}

/// The core of a cache over pools (`Core::Pooled`): the joined cache and
/// what its calls give out. The C lease ids and the decision log are the
/// handle's, as for every core.
pub(crate) struct Pools {
    joined: Joined,
    /// Per outstanding C lease id (also in `Inner::leases`).
    pub(crate) leases: HashMap<u64, PoolLease>,
    backend: marconi_pool_backend,
    /// Evicted handles not yet drained by the engine.
    pub(crate) freed: Vec<u64>,
    /// With lower tiers (marconi_cache_config.tiers): what the tier calls
    /// keep.
    tiers: Option<TierBook>,
}

impl Pools {
    /// The prefix cache deciding over the pools.
    pub(crate) fn device(&self) -> &PrefixCache {
        with!(&self.joined, c => c.cache())
    }

    /// Core's decision records since the last call.
    pub(crate) fn drain_log(&mut self) -> Vec<Decision> {
        with!(&mut self.joined, c => c.drain_log())
    }

    /// Turns the event stream on.
    pub(crate) fn enable_events(&mut self) -> FfiResult {
        let r = with!(&mut self.joined, c => c.enable_events()).map_err(pooled_err);
        // With tiers, turning them on runs the moves left waiting.
        self.collect_tier_ops();
        r
    }

    /// Turns the event stream off.
    pub(crate) fn disable_events(&mut self) {
        with!(&mut self.joined, c => c.disable_events());
    }

    /// The events since the last drain.
    pub(crate) fn drain_events(&mut self) -> Vec<marconi_core::CacheEvent> {
        with!(&mut self.joined, c => c.drain_events())
    }

    /// The plan of C lease `lease`, if outstanding.
    pub(crate) fn plan(&self, lease: u64) -> Option<&[u32]> {
        self.leases.get(&lease).map(|l| &l.plan[..])
    }

    /// Releases C lease `lease` (core lease `core`).
    pub(crate) fn release(&mut self, lease: u64, core: u64) -> Result<(), CacheError> {
        with!(&mut self.joined, c => c.release(core))
            .map_err(|_| CacheError::UnknownLease(core))?;
        self.leases.remove(&lease);
        Ok(())
    }

    /// Checks the joined invariants (panics on a violation, as core's).
    pub(crate) fn check_invariants(&self) {
        with!(&self.joined, c => c.check_invariants());
    }

    /// Looks `input` up (PooledCache::lookup_opts).
    pub(crate) fn lookup(
        &mut self,
        ns: u64,
        input: &[u32],
        hints: &[u32],
        opts: LookupOptions,
        device_only: bool,
    ) -> Result<PooledLookup, PooledError> {
        with!(&mut self.joined, c => c.lookup_opts(ns, input, hints, opts, device_only))
    }

    /// Moves the handles evicted since the last call into `freed`.
    pub(crate) fn collect_freed(&mut self) {
        let more = with!(&mut self.joined, c => c.drain_freed());
        self.freed.extend(more.iter().map(|h| h.raw()));
    }

    /// Whether lower tiers were configured.
    pub(crate) fn has_tiers(&self) -> bool {
        self.tiers.is_some()
    }

    /// The tier calls' book; only called with tiers (`TierSide::Pooled`).
    pub(crate) fn tier_book(&mut self) -> &mut TierBook {
        self.tiers.get_or_insert_with(TierBook::default)
    }

    /// The tiers; only called with tiers (`TierSide::Pooled`).
    pub(crate) fn tiers(&self) -> &TieredCache {
        with!(&self.joined, c => c.tiers()).expect("a cache over pools with a tier book has tiers")
    }

    /// The tiered lookup of core lease `core`.
    pub(crate) fn tiered_lookup(&self, core: u64) -> Option<&TieredLookup> {
        with!(&self.joined, c => c.tiered_lookup(core))
    }

    /// Runs what the tiers left waiting; the ops it decides go to the book.
    pub(crate) fn settle(&mut self) -> FfiResult {
        let r = with!(&mut self.joined, c => c.settle()).map_err(pooled_err);
        self.collect_tier_ops();
        r
    }

    /// Moves the tiers' ops into the book.
    pub(crate) fn collect_tier_ops(&mut self) {
        let ops = with!(&mut self.joined, c => c.drain_tier_ops());
        if let Some(b) = self.tiers.as_mut() {
            b.ops.extend(ops);
        }
    }
}

/// The marconi_status of a joined-cache error.
pub(crate) fn pooled_err(e: PooledError) -> FfiError {
    match e {
        PooledError::Cache(c) => FfiError::from(c),
        PooledError::Alloc(a) => alloc_err(a),
        e @ PooledError::OutOfMemory { .. } => {
            FfiError::new(marconi_status::OutOfMemory, e.to_string())
        }
        e @ PooledError::NotCallers { .. } => {
            FfiError::new(marconi_status::UnknownHandle, e.to_string())
        }
        e @ PooledError::Duplicate {
            kind: PoolKind::Kv, ..
        } => FfiError::new(marconi_status::DuplicatePage, e.to_string()),
        e @ PooledError::Duplicate {
            kind: PoolKind::Ssm,
            ..
        } => FfiError::new(marconi_status::DuplicateSlot, e.to_string()),
        e @ PooledError::InvalidConfig(_) => {
            FfiError::new(marconi_status::InvalidConfig, e.to_string())
        }
    }
}

/// The core over pools of `p` for the policy and model of `core`, with the
/// lower tiers of `tiers` below them when given (written through:
/// MARCONI_STATUS_INVALID_CONFIG for MARCONI_TIER_WRITE_BACK or
/// defer_moves, see PooledCache::with_tiers).
pub(crate) fn build(
    core: CacheConfig,
    p: &marconi_pool_config,
    tiers: Option<&marconi_tier_options>,
) -> FfiResult<Pools> {
    let (kv_need, state_need) = unit_sizes(&core.model, core.page_size);
    let mut p = *p;
    if p.kv_page_bytes == 0 {
        p.kv_page_bytes = kv_need;
    }
    if p.state_slot_bytes == 0 {
        p.state_slot_bytes = state_need;
    }
    if p.state_slot_bytes == 0 {
        return Err(FfiError::new(
            marconi_status::InvalidConfig,
            "the model has no recurrent layers: a cache over pools needs a state pool; \
             create the cache without marconi_cache_config.pools",
        ));
    }
    let tiers = tiers.map(|t| tier_config(&core, t)).transpose()?;
    let (backend, backing) = chunked_dual_pool(&p, true)?;
    fn joined<A: PoolAllocator>(
        core: CacheConfig,
        tiers: Option<TierConfig>,
        pool: A,
    ) -> FfiResult<PooledCache<A>> {
        let mut c = match tiers {
            None => PooledCache::new(core, pool),
            Some(t) => PooledCache::with_tiers(core, t, pool),
        }
        .map_err(pooled_err)?;
        c.record_tier_ops(true);
        Ok(c)
    }
    let (tcfg, book) = match tiers {
        Some((t, b)) => (Some(t), Some(b)),
        None => (None, None),
    };
    let joined = match backing {
        Backing::Plain(d) => Joined::Plain(joined(core, tcfg, d)?),
        Backing::Memfd(b) => Joined::Memfd(joined(core, tcfg, b)?),
        #[cfg(feature = "cuda")]
        Backing::Cuda(b, copier) => Joined::Cuda(joined(core, tcfg, b)?, copier),
    };
    Ok(Pools {
        joined,
        leases: HashMap::new(),
        backend,
        freed: Vec::new(),
        tiers: book,
    })
}

/// The result of marconi_cache_lookup_pooled.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct marconi_pooled_lookup {
    /// The lease pinning what the request reuses (never 0, never reused,
    /// never valid in another cache): pass it to marconi_cache_admit_pooled
    /// and release it with marconi_cache_release.
    pub lease: u64,
    /// Leading tokens the engine may skip (< the input length). With
    /// lower tiers, a host or store hit may pass what the pools hold: the
    /// engine skips them once it has carried out the lease's loads
    /// (marconi_cache_lease_loads) into units it reserved.
    pub hit_tokens: u32,
    /// Leading tokens whose KV the pools hold (page-aligned): the
    /// n_kv_pages pages of the hit.
    pub kv_matched_tokens: u32,
    /// The cache's state-slot handle to resume from (copy it into a slot
    /// the request reserved, e.g. with marconi_cache_copy_states),
    /// or 0 when there is no hit or the hit's state is loaded from a lower
    /// tier.
    pub state_handle: u64,
    /// The cache's KV page handles of the first hit_tokens tokens
    /// (marconi_cache_lease_kv_handles): read them, never free them;
    /// valid while the lease is held.
    pub n_kv_pages: u32,
    /// Checkpoint positions for this prefill (marconi_cache_lease_plan).
    pub n_plan: u32,
}

/// A recurrent state the engine saved into a state slot it reserved,
/// offered to marconi_cache_admit_pooled.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct marconi_pooled_state {
    /// Tokens the state covers (a planned position or the final one).
    pub position: u32,
    /// Must be 0.
    pub reserved: u32,
    /// The state-slot handle holding it (from marconi_cache_reserve).
    pub state_handle: u64,
}

/// Looks up `tokens[0..n_tokens]` in namespace `ns` on a cache over pools
/// and writes the hit, the cache's state handle to resume from, the counts
/// of KV page handles and planned checkpoints, and a lease to `*out` (pass
/// it to marconi_cache_admit_pooled, release it with marconi_cache_release).
/// The pooled counterpart of marconi_cache_lookup, which refuses on a
/// cache over pools. With lower tiers too (marconi_cache_config.tiers),
/// every tier is weighed as marconi_cache_lookup_tiered weighs them (no
/// store probe): a longer host or store hit comes with its loads
/// (marconi_cache_lease_loads), and the plan is the tiered one (it may
/// include the hit's own position: save the loaded state there).
///
/// Errors: those of marconi_cache_lookup, and MARCONI_STATUS_UNSUPPORTED
/// on a cache without pools (marconi_cache_config.pools).
#[no_mangle]
pub unsafe extern "C" fn marconi_cache_lookup_pooled(
    cache: *const marconi_cache,
    ns: u64,
    tokens: *const u32,
    n_tokens: usize,
    out: *mut marconi_pooled_lookup,
) -> marconi_status {
    boundary("marconi_cache_lookup_pooled", || {
        require!(cache);
        require!(tokens, len = n_tokens);
        require!(out);
        let tokens = TokenSource::U32(tokens, n_tokens);
        let ask = Ask::new(Entry::Pools, "marconi_cache_lookup_pooled", ns, tokens);
        // SAFETY: forwarded caller contract.
        unsafe { answer(cache, ask, out) }
    })
}

/// marconi_cache_lookup_pooled with application checkpoint hints
/// (`checkpoints[0..n_checkpoints]`, as marconi_cache_lookup_hinted takes
/// them): the kept hints are in the lease's plan (marconi_cache_lease_plan);
/// reserve a state slot for each.
///
/// Errors: those of marconi_cache_lookup_pooled, MARCONI_STATUS_NULL_ARGUMENT
/// for checkpoints NULL with n_checkpoints > 0, and
/// MARCONI_STATUS_TOO_MANY_TOKENS for n_checkpoints >= 2^32 - 1.
#[no_mangle]
pub unsafe extern "C" fn marconi_cache_lookup_pooled_hinted(
    cache: *const marconi_cache,
    ns: u64,
    tokens: *const u32,
    n_tokens: usize,
    checkpoints: *const u32,
    n_checkpoints: usize,
    out: *mut marconi_pooled_lookup,
) -> marconi_status {
    boundary("marconi_cache_lookup_pooled_hinted", || {
        require!(cache);
        require!(tokens, len = n_tokens);
        require!(checkpoints, len = n_checkpoints);
        require!(out);
        // SAFETY: buffer contract.
        let hints = unsafe { hints_in(checkpoints, n_checkpoints) }?;
        let tokens = TokenSource::U32(tokens, n_tokens);
        let ask = Ask::new(
            Entry::Pools,
            "marconi_cache_lookup_pooled_hinted",
            ns,
            tokens,
        );
        // SAFETY: forwarded caller contract.
        unsafe { answer(cache, Ask { hints, ..ask }, out) }
    })
}

/// Writes the KV page handles of a lease's hit (a lease of
/// marconi_cache_lookup_pooled: the cache's pages, read them, never free
/// them; valid while the lease is held) into `buf[0..cap]` and their number
/// to `*out_len` (MARCONI_STATUS_BUFFER_TOO_SMALL with only the count
/// written when cap is too small; NULL with cap 0 asks for the count). The
/// pooled counterpart of marconi_cache_lease_kv_pages.
/// MARCONI_STATUS_UNSUPPORTED on a cache without pools.
#[no_mangle]
pub unsafe extern "C" fn marconi_cache_lease_kv_handles(
    cache: *const marconi_cache,
    lease: u64,
    buf: *mut u64,
    cap: usize,
    out_len: *mut usize,
) -> marconi_status {
    boundary("marconi_cache_lease_kv_handles", || {
        require!(cache);
        require!(buf, cap = cap);
        require!(out_len);
        // SAFETY: live handle or NULL.
        let h = unsafe { handle(cache) }?;
        // SAFETY: buffer contract.
        let buf = unsafe { out_slice(buf, cap, "buf") }?;
        check_ptr!(out_len);
        let mut g = h.lock()?;
        let p = g.pools("marconi_cache_lease_kv_handles")?;
        let l = p.leases.get(&lease).ok_or_else(|| unknown_lease(lease))?;
        copy_list(&l.pages, buf, out_len)
    })
}

/// Reserves working memory for a request on a cache over pools:
/// `kv_pages` KV pages (for the tokens past the hit) written to
/// `kv_out[0..kv_pages]` and `state_slots` state slots (one per state to
/// save: the plan and the final state) written to `state_out`. When a pool
/// is short, free capacity migrates from the other pool (AVMP) and then the
/// cache evicts by utility; all or nothing. MARCONI_STATUS_OUT_OF_MEMORY
/// when even that cannot make room: nothing is reserved (entries evicted on
/// the way stay evicted; their handles come back through
/// marconi_cache_drain_freed_units). MARCONI_STATUS_BUFFER_TOO_SMALL when a
/// capacity is below its count. The units are the caller's until admitted
/// (marconi_cache_admit_pooled) or freed (marconi_cache_free_units).
/// MARCONI_STATUS_UNSUPPORTED on a cache without pools.
#[no_mangle]
pub unsafe extern "C" fn marconi_cache_reserve(
    cache: *const marconi_cache,
    kv_pages: u32,
    state_slots: u32,
    kv_out: *mut u64,
    kv_cap: usize,
    state_out: *mut u64,
    state_cap: usize,
) -> marconi_status {
    boundary("marconi_cache_reserve", || {
        require!(cache);
        require!(kv_out, cap = kv_cap);
        require!(state_out, cap = state_cap);
        // SAFETY: live handle or NULL.
        let h = unsafe { handle(cache) }?;
        // SAFETY: buffer contracts.
        let kv_out = unsafe { out_slice(kv_out, kv_cap, "kv_out") }?;
        // SAFETY: as above.
        let state_out = unsafe { out_slice(state_out, state_cap, "state_out") }?;
        let mut g = h.lock()?;
        let p = g.pools("marconi_cache_reserve")?;
        if kv_out.len() < kv_pages as usize || state_out.len() < state_slots as usize {
            return Err(FfiError::new(
                marconi_status::BufferTooSmall,
                format!(
                    "kv_out holds {kv_cap} and state_out {state_cap}; {kv_pages} pages and {state_slots} slots asked for"
                ),
            ));
        }
        let r = with!(&mut p.joined, c => c.reserve(kv_pages, state_slots)).map_err(pooled_err)?;
        for (o, h) in kv_out.iter_mut().zip(&r.kv_pages) {
            *o = h.raw();
        }
        for (o, h) in state_out.iter_mut().zip(&r.state_slots) {
            *o = h.raw();
        }
        Ok(())
    })
}

/// Admits `tokens[0..n_tokens]` (the looked-up input, then the decoded
/// output) under `lease` (of marconi_cache_lookup_pooled) on a cache over
/// pools, with `kv_pages[0..n_kv_pages]` (one handle per full page of
/// tokens: the lease's hit pages, then pages the caller reserved) and the
/// states saved (`states[i].state_handle`: a state handle the caller
/// reserved). The pooled counterpart of marconi_cache_admit, which refuses
/// on a cache over pools. The cache takes the units it keeps: the pages
/// kv_pages[out->kv_pages_taken_start .. out->kv_pages_taken_end) and the
/// slots of the states with `taken[i] = 1` (`taken` may be NULL when
/// n_states is 0). Every other unit passed in stays the caller's: free it
/// with marconi_cache_free_units (or reuse it). Every handle is checked
/// before anything changes: a page is a page the caller holds, or the page
/// the cache holds at that very position for this lease (the hit pages
/// marconi_cache_lease_kv_handles lists, and pages an earlier admit of the
/// lease took); any other page the cache holds (another prefix's, or the
/// hit's at another position), a handle of another pool or cache, a stale
/// or made-up one is MARCONI_STATUS_UNKNOWN_HANDLE; a page listed twice is
/// MARCONI_STATUS_DUPLICATE_PAGE, a state handle listed twice
/// MARCONI_STATUS_DUPLICATE_SLOT; a state whose reserved field is not 0 is
/// MARCONI_STATUS_INVALID_ARGUMENT. Other errors as marconi_cache_admit;
/// MARCONI_STATUS_UNSUPPORTED on a cache without pools; nothing changes on
/// error.
#[no_mangle]
pub unsafe extern "C" fn marconi_cache_admit_pooled(
    cache: *const marconi_cache,
    lease: u64,
    tokens: *const u32,
    n_tokens: usize,
    states: *const marconi_pooled_state,
    n_states: usize,
    kv_pages: *const u64,
    n_kv_pages: usize,
    taken: *mut u8,
    out: *mut marconi_admit_result,
) -> marconi_status {
    boundary("marconi_cache_admit_pooled", || {
        require!(cache);
        require!(tokens, len = n_tokens);
        require!(states, len = n_states);
        require!(kv_pages, len = n_kv_pages);
        require!(taken, cap = n_states);
        require!(out);
        // SAFETY: buffer contracts.
        let states = unsafe { in_slice(states, n_states, "states") }?;
        // SAFETY: as above.
        let kv_pages = unsafe { in_slice(kv_pages, n_kv_pages, "kv_pages") }?;
        // SAFETY: as above.
        let taken = unsafe { out_slice(taken, n_states, "taken") }?;
        // SAFETY: forwarded caller contract.
        unsafe {
            admit_units(
                cache,
                lease,
                TokenSource::U32(tokens, n_tokens),
                states,
                kv_pages,
                taken,
                out,
            )
        }
    })
}

/// The body of marconi_cache_admit_pooled (and of marconi_cache_admit_with
/// over pools), after the buffer checks.
///
/// # Safety
///
/// `cache` is a live handle or NULL; `tokens` follows its contract; `out`
/// is writable or NULL.
pub(crate) unsafe fn admit_units(
    cache: *const marconi_cache,
    lease: u64,
    tokens: TokenSource,
    states: &[marconi_pooled_state],
    kv_pages: &[u64],
    taken: &mut [u8],
    out: *mut marconi_admit_result,
) -> FfiResult {
    // SAFETY: live handle or NULL.
    let h = unsafe { handle(cache) }?;
    // SAFETY: buffer contract.
    let tokens = unsafe { tokens.read("tokens") }?;
    let tokens = &tokens[..];
    check_ptr!(out);
    let mut g = h.lock()?;
    let g = &mut *g;
    g.pools("marconi_cache_admit_pooled")?;
    let core = g.core_lease(lease)?;
    if let Some(i) = states.iter().position(|s| s.reserved != 0) {
        return Err(FfiError::new(
            marconi_status::InvalidArgument,
            format!("states[{i}].reserved must be 0"),
        ));
    }
    let pstates: Vec<PooledState> = states
        .iter()
        .map(|s| PooledState {
            position: s.position,
            slot: VirtualHandle::from_raw(s.state_handle),
        })
        .collect();
    let pages: Vec<VirtualHandle> = kv_pages
        .iter()
        .map(|&r| VirtualHandle::from_raw(r))
        .collect();
    let p = g.pools("marconi_cache_admit_pooled")?;
    let a =
        with!(&mut p.joined, c => c.admit(core, tokens, &pstates, &pages)).map_err(|e| match e {
            PooledError::Cache(CacheError::UnknownLease(_)) => unknown_lease(lease),
            e => pooled_err(e),
        });
    g.collect_log();
    let a = a?;
    let o = &a.outcome;
    for (t, s) in taken.iter_mut().zip(states) {
        *t = u8::from(
            o.states_taken.contains(&s.position)
                && a.taken.iter().any(|h| h.raw() == s.state_handle),
        );
    }
    let states_taken = taken.iter().filter(|&&t| t == 1).count() as u32;
    let res = marconi_admit_result::of(o, states_taken, states.len() as u32 - states_taken, true);
    // SAFETY: out checked, writable.
    unsafe { out.write(res) };
    Ok(())
}

/// Frees `handles[0..n]`, units the caller holds on a cache over pools
/// (reserved, not taken by the cache); all or nothing:
/// MARCONI_STATUS_UNKNOWN_HANDLE for a handle the caller does not hold (the
/// cache's, another pool's or cache's, freed, made up),
/// MARCONI_STATUS_DOUBLE_FREE for one listed twice.
/// MARCONI_STATUS_UNSUPPORTED on a cache without pools.
#[no_mangle]
pub unsafe extern "C" fn marconi_cache_free_units(
    cache: *const marconi_cache,
    handles: *const u64,
    n: usize,
) -> marconi_status {
    boundary("marconi_cache_free_units", || {
        require!(cache);
        require!(handles, len = n);
        // SAFETY: live handle or NULL.
        let h = unsafe { handle(cache) }?;
        // SAFETY: buffer contract.
        let handles = unsafe { in_slice(handles, n, "handles") }?;
        let hs: Vec<VirtualHandle> = handles
            .iter()
            .map(|&r| VirtualHandle::from_raw(r))
            .collect();
        let mut g = h.lock()?;
        let p = g.pools("marconi_cache_free_units")?;
        with!(&mut p.joined, c => c.free(&hs)).map_err(|e| match e {
            e @ PooledError::Duplicate { .. } => {
                FfiError::new(marconi_status::DoubleFree, e.to_string())
            }
            e => pooled_err(e),
        })
    })
}

/// Writes the handles a cache over pools evicted since the last call
/// (already back in their pool: stale, the engine must stop using them)
/// into `buf[0..cap]` and their number to `*out_len`; they are removed from
/// the list only when they all fit (MARCONI_STATUS_BUFFER_TOO_SMALL writes
/// the count only). The pooled counterpart of marconi_cache_drain_freed.
/// MARCONI_STATUS_UNSUPPORTED on a cache without pools.
///
/// Thread safety: safe to call concurrently on the same cache; each handle
/// is delivered to exactly one caller.
#[no_mangle]
pub unsafe extern "C" fn marconi_cache_drain_freed_units(
    cache: *const marconi_cache,
    buf: *mut u64,
    cap: usize,
    out_len: *mut usize,
) -> marconi_status {
    boundary("marconi_cache_drain_freed_units", || {
        require!(cache);
        require!(buf, cap = cap);
        require!(out_len);
        // SAFETY: live handle or NULL.
        let h = unsafe { handle(cache) }?;
        // SAFETY: buffer contract.
        let buf = unsafe { out_slice(buf, cap, "buf") }?;
        check_ptr!(out_len);
        let mut g = h.lock()?;
        let p = g.pools("marconi_cache_drain_freed_units")?;
        p.collect_freed();
        copy_list(&p.freed, buf, out_len)?;
        p.freed.clear();
        Ok(())
    })
}

/// Writes the handles a cache over pools holds now (KV pages and state
/// slots, ascending) into `buf[0..cap]` and their number to `*out_len`
/// (MARCONI_STATUS_BUFFER_TOO_SMALL writes the count only). For checks and
/// debugging: O(units held). MARCONI_STATUS_UNSUPPORTED on a cache without
/// pools.
#[no_mangle]
pub unsafe extern "C" fn marconi_cache_held(
    cache: *const marconi_cache,
    buf: *mut u64,
    cap: usize,
    out_len: *mut usize,
) -> marconi_status {
    boundary("marconi_cache_held", || {
        require!(cache);
        require!(buf, cap = cap);
        require!(out_len);
        // SAFETY: live handle or NULL.
        let h = unsafe { handle(cache) }?;
        // SAFETY: buffer contract.
        let buf = unsafe { out_slice(buf, cap, "buf") }?;
        check_ptr!(out_len);
        let mut g = h.lock()?;
        let p = g.pools("marconi_cache_held")?;
        let mut raw: Vec<u64> = with!(&p.joined, c => c.held_handles())
            .iter()
            .map(|h| h.raw())
            .collect();
        raw.sort_unstable();
        copy_list(&raw, buf, out_len)
    })
}

/// Resolves live handles of a cache over pools (the cache's or the
/// caller's) to their units, as marconi_pool_resolve.
/// MARCONI_STATUS_UNSUPPORTED on a cache without pools.
#[no_mangle]
pub unsafe extern "C" fn marconi_cache_resolve(
    cache: *const marconi_cache,
    handles: *const u64,
    n: usize,
    out: *mut marconi_unit_location,
    cap: usize,
) -> marconi_status {
    boundary("marconi_cache_resolve", || {
        require!(cache);
        require!(handles, len = n);
        require!(out, cap = cap);
        // SAFETY: live handle or NULL.
        let h = unsafe { handle(cache) }?;
        // SAFETY: buffer contracts.
        let handles = unsafe { in_slice(handles, n, "handles") }?;
        // SAFETY: as above.
        let out = unsafe { out_slice(out, cap, "out") }?;
        let mut g = h.lock()?;
        let p = g.pools("marconi_cache_resolve")?;
        if out.len() < n {
            return Err(FfiError::new(
                marconi_status::BufferTooSmall,
                format!("out holds {} locations, {n} handles given", out.len()),
            ));
        }
        let locs = match &p.joined {
            Joined::Plain(c) => resolve_all(c.pool(), handles, |_, _| 0),
            Joined::Memfd(c) => resolve_all(c.pool(), handles, |k, off| {
                c.pool()
                    .backend()
                    .base(c.pool().reservation(k))
                    .map_or(0, |b| b as u64 + off)
            }),
            #[cfg(feature = "cuda")]
            Joined::Cuda(c, _) => resolve_all(c.pool(), handles, |k, off| {
                c.pool()
                    .backend()
                    .base(c.pool().reservation(k))
                    .map_or(0, |b| b + off)
            }),
        }?;
        out[..n].copy_from_slice(&locs);
        Ok(())
    })
}

fn resolve_all(
    a: &dyn PoolAllocator,
    handles: &[u64],
    address: impl Fn(PoolKind, u64) -> u64,
) -> FfiResult<Vec<marconi_unit_location>> {
    handles
        .iter()
        .enumerate()
        .map(|(i, &raw)| location(a, raw, &address).map_err(|e| at_handle(i, e)))
        .collect()
}

/// Copies states between state-slot handles of a cache over pools, as
/// marconi_pool_copy_states: typically the lookup's state_handle into a
/// slot the request reserved, before the request resumes from it. Any live
/// state handle may be read; a destination must be a slot the caller holds
/// (MARCONI_STATUS_UNKNOWN_HANDLE otherwise: the cache's states are never
/// overwritten). Backend NONE is MARCONI_STATUS_UNSUPPORTED, and so is a
/// cache without pools.
#[no_mangle]
pub unsafe extern "C" fn marconi_cache_copy_states(
    cache: *const marconi_cache,
    pairs: *const marconi_state_copy,
    n: usize,
) -> marconi_status {
    boundary("marconi_cache_copy_states", || {
        require!(cache);
        require!(pairs, len = n);
        // SAFETY: live handle or NULL.
        let h = unsafe { handle(cache) }?;
        // SAFETY: buffer contract.
        let pairs = unsafe { in_slice(pairs, n, "pairs") }?;
        let mut g = h.lock()?;
        let p = g.pools("marconi_cache_copy_states")?;
        let held: std::collections::HashSet<u64> = with!(&p.joined, c => c.held_handles())
            .iter()
            .map(|h| h.raw())
            .collect();
        for (i, p) in pairs.iter().enumerate() {
            if held.contains(&p.dst_state) {
                return Err(FfiError::new(
                    marconi_status::UnknownHandle,
                    format!(
                        "pairs[{i}].dst_state {:#018x} is a state the cache holds",
                        p.dst_state
                    ),
                ));
            }
        }
        let to_pairs = |a: &dyn PoolAllocator| -> FfiResult<Vec<SlotPair>> {
            pairs
                .iter()
                .enumerate()
                .map(|(i, p)| {
                    Ok(SlotPair::new(
                        state_index(a, p.src_state, format_args!("pairs[{i}].src_state"))?,
                        state_index(a, p.dst_state, format_args!("pairs[{i}].dst_state"))?,
                    ))
                })
                .collect()
        };
        match &mut p.joined {
            Joined::Plain(_) => Err(FfiError::new(
                marconi_status::Unsupported,
                "this cache's pools have no memory (backend NONE)",
            )),
            Joined::Memfd(c) => {
                let p = to_pairs(c.pool())?;
                copy_states_in(c.pool_mut(), p)
            }
            #[cfg(feature = "cuda")]
            Joined::Cuda(c, copier) => {
                let p = to_pairs(c.pool())?;
                copier.copy(c.pool_mut(), p)
            }
        }
    })
}

/// Counters of a cache over pools. Versioned by size: set struct_size to
/// sizeof(marconi_pooled_stats) before calling marconi_cache_pool_stats.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct marconi_pooled_stats {
    /// sizeof(marconi_pooled_stats) as the caller compiled it.
    pub struct_size: u32,
    /// The marconi_pool_backend in use.
    pub backend: u32,
    /// Lookups served.
    pub requests: u64,
    /// Input tokens looked up.
    pub input_tokens: u64,
    /// Tokens skipped thanks to the cache.
    pub hit_tokens: u64,
    /// Nodes evicted (for memory or by admissions).
    pub evictions: u64,
    /// Admissions that cached nothing.
    pub admissions_rejected: u64,
    /// Reservations made.
    pub reservations: u64,
    /// Reservations refused for lack of memory.
    pub reservations_refused: u64,
    /// Capacity migrations made by reservations.
    pub migrations: u64,
    /// Bytes the donor pools gave up in those migrations.
    pub bytes_migrated: u64,
    /// Evictions made to meet reservations.
    pub evictions_for_memory: u64,
    /// Of those, evictions that freed only units of the other pool.
    pub evictions_other_kind: u64,
    /// KV pages and state slots the cache holds.
    pub held_kv_pages: u64,
    /// State slots the cache holds.
    pub held_state_slots: u64,
    /// KV pool capacity and free units.
    pub kv_capacity: u64,
    /// Free KV units.
    pub kv_free: u64,
    /// State pool capacity.
    pub state_capacity: u64,
    /// Free state units.
    pub state_free: u64,
    /// The pools' budget, bytes.
    pub budget_bytes: u64,
    /// Physical bytes committed (memfd st_blocks * 512; 0 for NONE).
    pub physical_bytes: u64,
    /// Leases outstanding.
    pub leases: u64,
}

/// Writes the pools' counters into `*out` (marconi_cache_stats has the
/// cache's), only out->struct_size bytes (at least 16): set it to
/// sizeof(marconi_pooled_stats) first. MARCONI_STATUS_UNSUPPORTED on a
/// cache without pools.
#[no_mangle]
pub unsafe extern "C" fn marconi_cache_pool_stats(
    cache: *const marconi_cache,
    out: *mut marconi_pooled_stats,
) -> marconi_status {
    boundary("marconi_cache_pool_stats", || {
        require!(cache);
        require!(out);
        // SAFETY: live handle or NULL.
        let h = unsafe { handle(cache) }?;
        let mut g = h.lock()?;
        let p = g.pools("marconi_cache_pool_stats")?;
        check_ptr!(out);
        // SAFETY: starts with its u32 size.
        let size = unsafe { out.cast::<u32>().read() } as usize;
        if size < 16 {
            return Err(FfiError::new(
                marconi_status::UnsupportedStructSize,
                format!("stats struct_size {size} is below 16"),
            ));
        }
        let (cs, ps, held): (Stats, PooledStats, Vec<VirtualHandle>) =
            with!(&p.joined, c => (c.cache_stats(), c.stats(), c.held_handles()));
        let (a, physical): (&dyn PoolAllocator, u64) =
            match &p.joined {
                Joined::Plain(c) => (c.pool(), 0),
                Joined::Memfd(c) => (
                    c.pool(),
                    c.pool().backend().physical_bytes().map_err(|e| {
                        FfiError::new(marconi_status::BackendFailure, e.to_string())
                    })?,
                ),
                #[cfg(feature = "cuda")]
                Joined::Cuda(c, _) => (
                    c.pool(),
                    c.pool().backend().physical_bytes().map_err(|e| {
                        FfiError::new(marconi_status::BackendFailure, e.to_string())
                    })?,
                ),
            };
        let held_kv = held.iter().filter(|h| h.pool() == PoolKind::Kv).count() as u64;
        let s = marconi_pooled_stats {
            struct_size: size.min(u32::MAX as usize) as u32,
            backend: p.backend as u32,
            requests: cs.requests,
            input_tokens: cs.input_tokens,
            hit_tokens: cs.hit_tokens,
            evictions: cs.evictions,
            admissions_rejected: cs.admissions_rejected,
            reservations: ps.reservations,
            reservations_refused: ps.refused,
            migrations: ps.migrations,
            bytes_migrated: ps.bytes_migrated,
            evictions_for_memory: ps.evictions_for_memory,
            evictions_other_kind: ps.evictions_other_kind,
            held_kv_pages: held_kv,
            held_state_slots: held.len() as u64 - held_kv,
            kv_capacity: u64::from(a.capacity(PoolKind::Kv)),
            kv_free: u64::from(a.free_units(PoolKind::Kv)),
            state_capacity: u64::from(a.capacity(PoolKind::Ssm)),
            state_free: u64::from(a.free_units(PoolKind::Ssm)),
            budget_bytes: a.total_bytes(),
            physical_bytes: physical,
            leases: p.leases.len() as u64,
        };
        // SAFETY: out has `size` writable bytes (contract), checked above.
        unsafe { write_versioned(&s, out, size) };
        Ok(())
    })
}

// ---------------------------------------------------------------------------
// The deprecated pooled handle: thin forwarders onto marconi_cache.
// ---------------------------------------------------------------------------

/// A cache over pools: opaque to C. Deprecated (removed in the next
/// release): a marconi_pooled_cache is a marconi_cache created with
/// marconi_cache_config.pools set, and every marconi_pooled_cache_* call
/// forwards to its marconi_cache_* counterpart (so either set of calls
/// takes it, and marconi_cache_free frees it).
pub struct marconi_pooled_cache {
    _private: [u8; 0],
}

fn as_cache(pc: *const marconi_pooled_cache) -> *const marconi_cache {
    pc.cast()
}

/// Deprecated: marconi_cache_new with marconi_cache_config.pools. Creates a
/// cache over pools and writes the handle to `*out` (free it with
/// marconi_pooled_cache_free or marconi_cache_free: it is a marconi_cache).
/// `cache_cfg` chooses the policy, the model and the page size (its
/// capacity_bytes is ignored: the pools are the capacity; its pools field
/// must be NULL); `pool_cfg` the memory (backend, budget, split,
/// migration). pool_cfg->kv_page_bytes and state_slot_bytes may be 0: the
/// model's KV bytes of one page and one state (all recurrent layers),
/// 128-aligned; larger values (an engine's padded layout) are accepted,
/// smaller ones are MARCONI_STATUS_INVALID_CONFIG. A model without
/// recurrent layers is refused.
#[deprecated(
    note = "use marconi_cache_new with marconi_cache_config.pools (removed in the next release)"
)]
#[no_mangle]
pub unsafe extern "C" fn marconi_pooled_cache_new(
    cache_cfg: *const marconi_cache_config,
    pool_cfg: *const marconi_pool_config,
    out: *mut *mut marconi_pooled_cache,
) -> marconi_status {
    boundary("marconi_pooled_cache_new", || {
        require!(cache_cfg);
        require!(pool_cfg);
        require!(out);
        check_ptr!(cache_cfg);
        check_ptr!(pool_cfg);
        check_ptr!(out);
        // SAFETY: non-NULL and aligned; size contracts are the caller's.
        let mut c = unsafe { read_struct(cache_cfg) }?;
        if !c.pools.is_null() {
            return Err(FfiError::new(
                marconi_status::InvalidConfig,
                "the cache configuration of marconi_pooled_cache_new sets pools: use marconi_cache_new",
            ));
        }
        c.pools = pool_cfg;
        // SAFETY: the pointers inside c follow their documented contracts
        // (pools is pool_cfg, initialised by contract).
        let core = unsafe { build_core(c) }?;
        // SAFETY: out is non-NULL, aligned (checked) and writable (contract).
        unsafe { new_handle(core, out.cast()) };
        Ok(())
    })
}

/// Deprecated: marconi_cache_free. Frees a cache over pools and its memory
/// (every handle and address it gave out becomes invalid). NULL is a no-op;
/// a pointer that is not a live cache handle is refused and left alone.
#[deprecated(note = "use marconi_cache_free (removed in the next release)")]
#[no_mangle]
pub unsafe extern "C" fn marconi_pooled_cache_free(pc: *mut marconi_pooled_cache) {
    // SAFETY: forwarded caller contract.
    unsafe { marconi_cache_free(pc.cast()) }
}

/// Deprecated: marconi_cache_lookup_pooled (same arguments, same meaning).
#[deprecated(note = "use marconi_cache_lookup_pooled (removed in the next release)")]
#[no_mangle]
pub unsafe extern "C" fn marconi_pooled_cache_lookup(
    pc: *const marconi_pooled_cache,
    ns: u64,
    tokens: *const u32,
    n_tokens: usize,
    out: *mut marconi_pooled_lookup,
) -> marconi_status {
    // SAFETY: forwarded caller contract.
    unsafe { marconi_cache_lookup_pooled(as_cache(pc), ns, tokens, n_tokens, out) }
}

/// Deprecated: marconi_cache_lookup_pooled_hinted.
#[deprecated(note = "use marconi_cache_lookup_pooled_hinted (removed in the next release)")]
#[no_mangle]
pub unsafe extern "C" fn marconi_pooled_cache_lookup_hinted(
    pc: *const marconi_pooled_cache,
    ns: u64,
    tokens: *const u32,
    n_tokens: usize,
    checkpoints: *const u32,
    n_checkpoints: usize,
    out: *mut marconi_pooled_lookup,
) -> marconi_status {
    // SAFETY: forwarded caller contract.
    unsafe {
        marconi_cache_lookup_pooled_hinted(
            as_cache(pc),
            ns,
            tokens,
            n_tokens,
            checkpoints,
            n_checkpoints,
            out,
        )
    }
}

/// Deprecated: marconi_cache_lease_kv_handles.
#[deprecated(note = "use marconi_cache_lease_kv_handles (removed in the next release)")]
#[no_mangle]
pub unsafe extern "C" fn marconi_pooled_cache_lease_kv_pages(
    pc: *const marconi_pooled_cache,
    lease: u64,
    buf: *mut u64,
    cap: usize,
    out_len: *mut usize,
) -> marconi_status {
    // SAFETY: forwarded caller contract.
    unsafe { marconi_cache_lease_kv_handles(as_cache(pc), lease, buf, cap, out_len) }
}

/// Deprecated: marconi_cache_lease_plan (a pooled lease's checkpoint
/// positions, ascending).
#[deprecated(note = "use marconi_cache_lease_plan (removed in the next release)")]
#[no_mangle]
pub unsafe extern "C" fn marconi_pooled_cache_lease_plan(
    pc: *const marconi_pooled_cache,
    lease: u64,
    buf: *mut u32,
    cap: usize,
    out_len: *mut usize,
) -> marconi_status {
    // SAFETY: forwarded caller contract.
    unsafe { marconi_cache_lease_plan(as_cache(pc), lease, buf, cap, out_len) }
}

/// Deprecated: marconi_cache_reserve.
#[deprecated(note = "use marconi_cache_reserve (removed in the next release)")]
#[no_mangle]
pub unsafe extern "C" fn marconi_pooled_cache_reserve(
    pc: *const marconi_pooled_cache,
    kv_pages: u32,
    state_slots: u32,
    kv_out: *mut u64,
    kv_cap: usize,
    state_out: *mut u64,
    state_cap: usize,
) -> marconi_status {
    // SAFETY: forwarded caller contract.
    unsafe {
        marconi_cache_reserve(
            as_cache(pc),
            kv_pages,
            state_slots,
            kv_out,
            kv_cap,
            state_out,
            state_cap,
        )
    }
}

/// Deprecated: marconi_cache_admit_pooled.
#[deprecated(note = "use marconi_cache_admit_pooled (removed in the next release)")]
#[no_mangle]
pub unsafe extern "C" fn marconi_pooled_cache_admit(
    pc: *const marconi_pooled_cache,
    lease: u64,
    tokens: *const u32,
    n_tokens: usize,
    states: *const marconi_pooled_state,
    n_states: usize,
    kv_pages: *const u64,
    n_kv_pages: usize,
    taken: *mut u8,
    out: *mut marconi_admit_result,
) -> marconi_status {
    // SAFETY: forwarded caller contract.
    unsafe {
        marconi_cache_admit_pooled(
            as_cache(pc),
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

/// Deprecated: marconi_cache_free_units.
#[deprecated(note = "use marconi_cache_free_units (removed in the next release)")]
#[no_mangle]
pub unsafe extern "C" fn marconi_pooled_cache_free_units(
    pc: *const marconi_pooled_cache,
    handles: *const u64,
    n: usize,
) -> marconi_status {
    // SAFETY: forwarded caller contract.
    unsafe { marconi_cache_free_units(as_cache(pc), handles, n) }
}

/// Deprecated: marconi_cache_release.
#[deprecated(note = "use marconi_cache_release (removed in the next release)")]
#[no_mangle]
pub unsafe extern "C" fn marconi_pooled_cache_release(
    pc: *const marconi_pooled_cache,
    lease: u64,
) -> marconi_status {
    // SAFETY: forwarded caller contract.
    unsafe { marconi_cache_release(as_cache(pc), lease) }
}

/// Deprecated: marconi_cache_drain_freed_units.
#[deprecated(note = "use marconi_cache_drain_freed_units (removed in the next release)")]
#[no_mangle]
pub unsafe extern "C" fn marconi_pooled_cache_drain_freed(
    pc: *const marconi_pooled_cache,
    buf: *mut u64,
    cap: usize,
    out_len: *mut usize,
) -> marconi_status {
    // SAFETY: forwarded caller contract.
    unsafe { marconi_cache_drain_freed_units(as_cache(pc), buf, cap, out_len) }
}

/// Deprecated: marconi_cache_held.
#[deprecated(note = "use marconi_cache_held (removed in the next release)")]
#[no_mangle]
pub unsafe extern "C" fn marconi_pooled_cache_held(
    pc: *const marconi_pooled_cache,
    buf: *mut u64,
    cap: usize,
    out_len: *mut usize,
) -> marconi_status {
    // SAFETY: forwarded caller contract.
    unsafe { marconi_cache_held(as_cache(pc), buf, cap, out_len) }
}

/// Deprecated: marconi_cache_resolve.
#[deprecated(note = "use marconi_cache_resolve (removed in the next release)")]
#[no_mangle]
pub unsafe extern "C" fn marconi_pooled_cache_resolve(
    pc: *const marconi_pooled_cache,
    handles: *const u64,
    n: usize,
    out: *mut marconi_unit_location,
    cap: usize,
) -> marconi_status {
    // SAFETY: forwarded caller contract.
    unsafe { marconi_cache_resolve(as_cache(pc), handles, n, out, cap) }
}

/// Deprecated: marconi_cache_copy_states.
#[deprecated(note = "use marconi_cache_copy_states (removed in the next release)")]
#[no_mangle]
pub unsafe extern "C" fn marconi_pooled_cache_copy_states(
    pc: *const marconi_pooled_cache,
    pairs: *const marconi_state_copy,
    n: usize,
) -> marconi_status {
    // SAFETY: forwarded caller contract.
    unsafe { marconi_cache_copy_states(as_cache(pc), pairs, n) }
}

/// Deprecated: marconi_cache_pool_stats.
#[deprecated(note = "use marconi_cache_pool_stats (removed in the next release)")]
#[no_mangle]
pub unsafe extern "C" fn marconi_pooled_cache_stats(
    pc: *const marconi_pooled_cache,
    out: *mut marconi_pooled_stats,
) -> marconi_status {
    // SAFETY: forwarded caller contract.
    unsafe { marconi_cache_pool_stats(as_cache(pc), out) }
}

/// Deprecated: marconi_cache_check (checks the joined invariants: core's,
/// every handle the cache holds live in its pool, the caller's and the
/// cache's units are the pools' live units, core's unit budget is the
/// pools' capacity less the caller's units).
#[deprecated(note = "use marconi_cache_check (removed in the next release)")]
#[no_mangle]
pub unsafe extern "C" fn marconi_pooled_cache_check(
    pc: *const marconi_pooled_cache,
) -> marconi_status {
    // SAFETY: forwarded caller contract.
    unsafe { marconi_cache_check(as_cache(pc)) }
}
