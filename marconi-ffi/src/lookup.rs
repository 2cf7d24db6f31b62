//! The one lookup of a `marconi_cache`, whatever its configuration:
//! `marconi_cache_lookup_with` takes a versioned request (the token width,
//! flags, hints, the request's own slot, a store to probe) and writes a
//! versioned result. Every other lookup entry point (over ids the engine
//! owns, the tier view, over pools) is this function with its request
//! fixed and its result narrowed to its own struct.

use std::ffi::c_void;

use marconi_core::{LookupOptions, Tier};
use marconi_gpu::VirtualHandle;

use crate::cache::{
    handle, lookup_flags_with, marconi_cache, marconi_copy_order, marconi_lookup, new_lease_id,
    no_pools, no_tiers, pooled_instead, tokens_len_ok, Core, Inner, Lease, TokenSource,
    MARCONI_NO_SLOT,
};
use crate::pooled::{marconi_pooled_lookup, pooled_err, PoolLease};
use crate::status::{
    boundary, check_ptr, in_slice, init_struct, marconi_status, read_struct, require, versioned,
    write_versioned, FfiError, FfiResult,
};
use crate::store::{marconi_store, probe_states};
use crate::tiered::{lookup_tiers, marconi_tiered_hit, tier_code};

/// How a caller's array holds ids (marconi_lookup_request.token_width,
/// marconi_admit_request.token_width and .page_width).
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum marconi_id_width {
    /// uint32_t ids.
    U32 = 0,
    /// int64_t ids, each in [0, 2^32 - 1] (Python's array('q'), torch's
    /// int64 tensors), read in place.
    I64 = 1,
    /// uint64_t: pool handles (a cache over pools), or ids below 2^32.
    /// Pages only.
    U64 = 2,
}

/// marconi_cache_lookup_with on a cache with lower tiers: the device's view
/// only (no lower-tier hit chosen, pinned or counted; the lease loads
/// nothing), as marconi_cache_lookup gives it.
pub const MARCONI_LOOKUP_DEVICE_ONLY: u32 = 4;

/// What marconi_cache_lookup_with looks up. Versioned by size: initialise
/// it with marconi_lookup_request_init, then set the fields.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct marconi_lookup_request {
    /// sizeof(marconi_lookup_request) as the caller compiled it.
    pub struct_size: u32,
    /// A marconi_id_width value: what `tokens` points to. Default
    /// MARCONI_ID_WIDTH_U32.
    pub token_width: u32,
    /// The namespace (a LoRA id or cache salt). Default 0.
    pub ns: u64,
    /// n_tokens ids of token_width. Default NULL.
    pub tokens: *const c_void,
    /// Default 0 (MARCONI_STATUS_EMPTY_TOKENS).
    pub n_tokens: usize,
    /// Application checkpoint hints, as marconi_cache_lookup_hinted takes
    /// them (NULL with 0: none). Default none.
    pub checkpoints: *const u32,
    /// Default 0.
    pub n_checkpoints: usize,
    /// A bitwise OR of MARCONI_LOOKUP_WHOLE_INPUT,
    /// MARCONI_LOOKUP_NO_KV_PAGES (ids the engine owns only; over pools the
    /// hit's handles are always listed) and MARCONI_LOOKUP_DEVICE_ONLY.
    /// Default 0.
    pub flags: u32,
    /// The request's own state slot (ids the engine owns), or
    /// MARCONI_NO_SLOT (the default): as marconi_cache_lookup's dst_slot.
    pub dst_slot: u32,
    /// A store shared with other processes to probe (a cache with lower
    /// tiers over ids the engine owns; as marconi_cache_lookup_tiered's
    /// `store`), or NULL (the default).
    pub store: *const marconi_store,
}
versioned!(
    marconi_lookup_request,
    std::mem::size_of::<marconi_lookup_request>()
);

impl marconi_lookup_request {
    fn defaults() -> Self {
        marconi_lookup_request {
            struct_size: std::mem::size_of::<marconi_lookup_request>() as u32,
            token_width: marconi_id_width::U32 as u32,
            ns: 0,
            tokens: std::ptr::null(),
            n_tokens: 0,
            checkpoints: std::ptr::null(),
            n_checkpoints: 0,
            flags: 0,
            dst_slot: MARCONI_NO_SLOT,
            store: std::ptr::null(),
        }
    }
}

/// What marconi_cache_lookup_with found. Versioned by size: set
/// struct_size to sizeof(marconi_lookup_result) first; only that many
/// bytes are written.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct marconi_lookup_result {
    /// sizeof(marconi_lookup_result) as the caller compiled it.
    pub struct_size: u32,
    /// A marconi_tier value: where the state the hit resumes from is
    /// (DEVICE on a cache without tiers, or with no hit).
    pub tier: u32,
    /// The lease pinning what the request reuses (never 0, never reused,
    /// never valid in another cache): pass it to the admit calls and
    /// release it with marconi_cache_release.
    pub lease: u64,
    /// Leading tokens the engine may skip (for a HOST or STORE hit, once
    /// it has carried out the lease's loads, marconi_cache_lease_loads).
    pub hit_tokens: u32,
    /// The device's own hit (hit_tokens for a DEVICE hit): where the
    /// engine resumes when a load fails.
    pub device_hit_tokens: u32,
    /// Leading tokens whose KV the device holds (page-aligned).
    pub kv_matched_tokens: u32,
    /// The device's KV pages of the hit: marconi_cache_lease_kv_pages
    /// (ids the engine owns; 0 with MARCONI_LOOKUP_NO_KV_PAGES) or
    /// marconi_cache_lease_kv_handles (pools).
    pub n_kv_pages: u32,
    /// Checkpoint positions for this prefill (marconi_cache_lease_plan).
    pub n_plan: u32,
    /// Loads to carry out before prefill (marconi_cache_lease_loads).
    pub n_loads: u32,
    /// 1 when device_state names the device's state at device_hit_tokens.
    pub has_device_state: u32,
    /// 1 when copy_order is set: the request's dst_slot was given and the
    /// hit resumes from a device state.
    pub has_copy_order: u32,
    /// The device's state to resume from: a state slot id (ids the engine
    /// owns) or a state handle (pools; read it, copy it into a slot the
    /// request reserved).
    pub device_state: u64,
    /// {device_state, dst_slot} when has_copy_order.
    pub copy_order: marconi_copy_order,
    /// 1 when the hit resumes from a state only a shared store probe knew
    /// of.
    pub shared: u32,
    /// A marconi_tier value whose longer hit was declined (recomputing is
    /// faster), or 0 (DEVICE) for none.
    pub declined_tier: u32,
    /// The declined hit's length, or 0.
    pub declined_tokens: u32,
    /// Reserved, 0.
    pub reserved: u32,
    /// Modelled seconds of the loads.
    pub load_s: f64,
    /// Modelled seconds to recompute what the loads bring instead.
    pub recompute_s: f64,
}

impl From<&marconi_lookup_result> for marconi_lookup {
    /// The result narrowed to what marconi_cache_lookup writes.
    fn from(r: &marconi_lookup_result) -> Self {
        marconi_lookup {
            lease: r.lease,
            hit_tokens: r.hit_tokens,
            kv_matched_tokens: r.kv_matched_tokens,
            state_slot: r.device_slot(),
            n_kv_pages: r.n_kv_pages,
            n_plan: r.n_plan,
            n_copy_orders: r.has_copy_order,
            copy_order: if r.has_copy_order == 1 {
                r.copy_order
            } else {
                marconi_copy_order::default()
            },
        }
    }
}

impl From<&marconi_lookup_result> for marconi_tiered_hit {
    /// The result narrowed to what marconi_cache_lookup_tiered writes.
    fn from(r: &marconi_lookup_result) -> Self {
        marconi_tiered_hit {
            lease: r.lease,
            hit_tokens: r.hit_tokens,
            tier: r.tier,
            device_hit_tokens: r.device_hit_tokens,
            device_kv_tokens: r.kv_matched_tokens,
            device_state_slot: r.device_slot(),
            n_loads: r.n_loads,
            n_plan: r.n_plan,
            n_kv_pages: r.n_kv_pages,
            shared: r.shared,
            declined_tier: r.declined_tier,
            declined_tokens: r.declined_tokens,
            reserved: 0,
            load_s: r.load_s,
            recompute_s: r.recompute_s,
        }
    }
}

impl From<&marconi_lookup_result> for marconi_pooled_lookup {
    /// The result narrowed to what marconi_cache_lookup_pooled writes: a
    /// lower tier's hit resumes from the state its loads bring (no
    /// handle).
    fn from(r: &marconi_lookup_result) -> Self {
        marconi_pooled_lookup {
            lease: r.lease,
            hit_tokens: r.hit_tokens,
            kv_matched_tokens: r.kv_matched_tokens,
            state_handle: if r.tier == 0 && r.has_device_state == 1 {
                r.device_state
            } else {
                0
            },
            n_kv_pages: r.n_kv_pages,
            n_plan: r.n_plan,
        }
    }
}

impl marconi_lookup_result {
    /// The device state as an engine slot id, or MARCONI_NO_SLOT.
    fn device_slot(&self) -> u32 {
        if self.has_device_state == 1 {
            self.device_state as u32
        } else {
            MARCONI_NO_SLOT
        }
    }
}

/// The size of the first version of marconi_lookup_result.
const RESULT_MIN_SIZE: usize = std::mem::size_of::<marconi_lookup_result>();

/// Fills `*req` with the defaults (documented per field) and sets
/// `req->struct_size`. MARCONI_STATUS_UNSUPPORTED_STRUCT_SIZE when
/// struct_size is smaller than the first version's.
#[no_mangle]
pub unsafe extern "C" fn marconi_lookup_request_init(
    req: *mut marconi_lookup_request,
    struct_size: usize,
) -> marconi_status {
    // SAFETY: req is NULL or has struct_size writable bytes (contract).
    boundary("marconi_lookup_request_init", || unsafe {
        init_struct(req, struct_size, "req")
    })
}

/// Looks up `req->tokens` on a cache of any configuration and writes what
/// can be reused to `*out`, with a lease that pins it until
/// marconi_cache_release: the one lookup, with the token width, flags,
/// hints, the request's own slot and a store probe as options of the
/// request. Over ids the engine owns it is marconi_cache_lookup (and its
/// `_hinted`, `_i64`, `_i64_flags` variants); with lower tiers, the view of
/// every tier (marconi_cache_lookup_tiered) unless
/// MARCONI_LOOKUP_DEVICE_ONLY; over pools (with or without tiers)
/// marconi_cache_lookup_pooled. Admit with the call that matches the
/// memory: marconi_cache_admit / _admit_i64 (ids) or
/// marconi_cache_admit_pooled (pools).
///
/// Errors: those of the lookup it stands for;
/// MARCONI_STATUS_INVALID_ARGUMENT for an unknown token_width or flag bit,
/// a dst_slot on a cache over pools, or an int64 id outside [0, 2^32 - 1];
/// MARCONI_STATUS_UNSUPPORTED for a store on a cache without lower tiers
/// over ids the engine owns.
#[no_mangle]
pub unsafe extern "C" fn marconi_cache_lookup_with(
    cache: *const marconi_cache,
    req: *const marconi_lookup_request,
    out: *mut marconi_lookup_result,
) -> marconi_status {
    boundary("marconi_cache_lookup_with", || {
        require!(cache);
        require!(req);
        require!(out);
        check_ptr!(req);
        check_ptr!(out);
        // SAFETY: req is non-NULL and aligned; its size contract is the caller's.
        let r = unsafe { read_struct(req) }?;
        // SAFETY: out is non-NULL and aligned; its first field is struct_size.
        let size = unsafe { out.cast::<u32>().read() } as usize;
        if size < RESULT_MIN_SIZE {
            return Err(FfiError::new(
                marconi_status::UnsupportedStructSize,
                format!(
                    "out->struct_size is {size}; set it to sizeof(marconi_lookup_result) ({RESULT_MIN_SIZE})"
                ),
            ));
        }
        let (tokens, checkpoints) = (r.tokens, r.checkpoints);
        require!(tokens, len = r.n_tokens);
        require!(checkpoints, len = r.n_checkpoints);
        let tokens = match r.token_width {
            0 => TokenSource::U32(tokens.cast(), r.n_tokens),
            1 => TokenSource::I64(tokens.cast(), r.n_tokens),
            w => {
                return Err(FfiError::new(
                    marconi_status::InvalidArgument,
                    format!("token_width {w}: tokens are MARCONI_ID_WIDTH_U32 or _I64"),
                ))
            }
        };
        let (opts, device_only) = lookup_flags_with(r.flags, MARCONI_LOOKUP_DEVICE_ONLY)?;
        // SAFETY: buffer contract of the request.
        let hints = unsafe { hints_in(checkpoints, r.n_checkpoints) }?;
        let ask = Ask {
            ns: r.ns,
            tokens,
            hints,
            opts,
            device_only,
            dst_slot: r.dst_slot,
            store: r.store,
            entry: Entry::Any,
            what: "marconi_cache_lookup_with",
        };
        // SAFETY: forwarded caller contracts.
        let mut res = unsafe { lookup_any(cache, ask) }?;
        res.struct_size = size as u32;
        // SAFETY: out has `size` writable bytes (contract), checked above.
        unsafe { write_versioned(&res, out, size) };
        Ok(())
    })
}

/// Which entry point a lookup came through: it decides the refusals and,
/// on a cache with tiers over ids, the view.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Entry {
    /// marconi_cache_lookup and its variants: over ids, the device's view.
    Ids,
    /// marconi_cache_lookup_tiered and its variant: every tier, over ids.
    Tiers,
    /// marconi_cache_lookup_pooled and its variant.
    Pools,
    /// marconi_cache_lookup_with: whatever the cache is.
    Any,
}

/// A lookup as every entry point asks it.
pub(crate) struct Ask<'a> {
    pub(crate) ns: u64,
    pub(crate) tokens: TokenSource,
    pub(crate) hints: &'a [u32],
    pub(crate) opts: LookupOptions,
    pub(crate) device_only: bool,
    pub(crate) dst_slot: u32,
    pub(crate) store: *const marconi_store,
    pub(crate) entry: Entry,
    /// The entry point, in errors.
    pub(crate) what: &'a str,
}

impl<'a> Ask<'a> {
    /// The lookup of `tokens` in `ns` through `entry` with the defaults:
    /// no hints, no flags, no slot of the request's, no store to probe.
    pub(crate) fn new(entry: Entry, what: &'a str, ns: u64, tokens: TokenSource) -> Self {
        Ask {
            ns,
            tokens,
            hints: &[],
            opts: LookupOptions::default(),
            device_only: entry == Entry::Ids,
            dst_slot: MARCONI_NO_SLOT,
            store: std::ptr::null(),
            entry,
            what,
        }
    }
}

/// The checkpoints of a hinted lookup: their count is refused before
/// anything is read, as an oversized token count is (a model whose hits
/// need no states ignores the hints, so a wild count would otherwise pass
/// there and fault elsewhere).
///
/// # Safety
///
/// `p` has `n` readable u32, or is NULL (refused unless `n` is 0).
pub(crate) unsafe fn hints_in<'a>(p: *const u32, n: usize) -> FfiResult<&'a [u32]> {
    tokens_len_ok(n, "checkpoints")?;
    // SAFETY: forwarded caller contract.
    unsafe { in_slice(p, n, "checkpoints") }
}

/// Runs `ask` and writes its result, narrowed to the entry point's struct,
/// to `*out`; `out` is checked first, so a lease is issued only when it can
/// be written out.
///
/// # Safety
///
/// As [`lookup_any`]; `out` is NULL or writable.
pub(crate) unsafe fn answer<T>(cache: *const marconi_cache, ask: Ask, out: *mut T) -> FfiResult
where
    T: for<'r> From<&'r marconi_lookup_result>,
{
    check_ptr!(out);
    // SAFETY: forwarded caller contract.
    let r = unsafe { lookup_any(cache, ask) }?;
    // SAFETY: out is non-NULL and aligned (checked) and writable by contract.
    unsafe { out.write(T::from(&r)) };
    Ok(())
}

/// How a cache serves a lookup.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Route {
    /// The device's view over ids (a plain cache, or tiers seen from the
    /// device).
    Device,
    /// Every tier, over ids.
    Tiers,
    /// Over pools.
    Pools,
}

/// The route of `entry` on `core`, or the entry point's refusal.
fn route(core: &Core, entry: Entry, device_only: bool, what: &str) -> FfiResult<Route> {
    let tiers_pooled = || {
        pooled_instead(
            what,
            "marconi_cache_lookup_pooled (its lease's loads: marconi_cache_lease_loads)",
        )
    };
    match (entry, core) {
        (Entry::Ids, Core::Pooled(_)) => Err(pooled_instead(what, "marconi_cache_lookup_pooled")),
        (Entry::Ids, _) => Ok(Route::Device),
        (Entry::Tiers, Core::Tiered(_)) => Ok(Route::Tiers),
        (Entry::Tiers, Core::Pooled(p)) if p.has_tiers() => Err(tiers_pooled()),
        (Entry::Tiers, _) => Err(no_tiers(what)),
        (Entry::Pools, Core::Pooled(_)) | (Entry::Any, Core::Pooled(_)) => Ok(Route::Pools),
        (Entry::Pools, _) => Err(no_pools(what)),
        (Entry::Any, Core::Tiered(_)) if !device_only => Ok(Route::Tiers),
        (Entry::Any, _) => Ok(Route::Device),
    }
}

/// The one lookup: every entry point's body after its own argument checks.
///
/// # Safety
///
/// `cache` is a live handle or NULL; `ask.tokens` and `ask.store` follow
/// their entry point's contracts.
pub(crate) unsafe fn lookup_any(
    cache: *const marconi_cache,
    ask: Ask,
) -> FfiResult<marconi_lookup_result> {
    // SAFETY: the caller passes a live handle or NULL.
    let h = unsafe { handle(cache) }?;
    // The tier lookups, and any with a store to probe, are refused before
    // their arguments are read and choose the probe's positions under the
    // lock (its I/O runs without it); the others read their ids first and
    // lock once, as the request path wants.
    let early = ask.entry == Entry::Tiers || !ask.store.is_null();
    let (known, probe_at) = if early {
        let g = h.lock()?;
        let r = route(&g.core, ask.entry, ask.device_only, ask.what)?;
        let probe_at = match (&g.core, r) {
            (Core::Tiered(t), Route::Tiers) if !ask.store.is_null() => {
                let (TokenSource::U32(_, n) | TokenSource::I64(_, n)) = ask.tokens;
                Some(t.probe_positions(n))
            }
            _ => None,
        };
        if !ask.store.is_null() && r != Route::Tiers {
            return Err(FfiError::new(
                marconi_status::Unsupported,
                format!(
                    "{}: a store is probed only by a cache with lower tiers over ids the \
                     engine owns",
                    ask.what
                ),
            ));
        }
        (Some(r), probe_at)
    } else {
        (None, None)
    };
    // SAFETY: buffer contract of the entry point.
    let tokens = unsafe { ask.tokens.read("tokens") }?;
    let tokens = &tokens[..];
    let probe = match probe_at {
        Some((positions, hold_kv)) => {
            // SAFETY: store is non-NULL here; a live store handle by contract.
            let r = unsafe { probe_states(ask.store, ask.ns, tokens, &positions, hold_kv) }?;
            // Nothing to ask without a store tier to weigh the answer by.
            (!positions.is_empty()).then_some(r)
        }
        None => None,
    };
    let mut g = h.lock()?;
    let route = match known {
        Some(r) => r,
        None => route(&g.core, ask.entry, ask.device_only, ask.what)?,
    };
    if ask.dst_slot != MARCONI_NO_SLOT {
        if route == Route::Pools {
            return Err(FfiError::new(
                marconi_status::InvalidArgument,
                format!(
                    "{}: dst_slot {} on a cache over pools (copy the state with \
                     marconi_cache_copy_states)",
                    ask.what, ask.dst_slot
                ),
            ));
        }
        if g.owns_slot(ask.dst_slot) {
            return Err(FfiError::new(
                marconi_status::InvalidArgument,
                format!(
                    "dst_slot {} holds a cached state owned by the cache",
                    ask.dst_slot
                ),
            ));
        }
    }
    // Drawn first, so that running out changes nothing.
    let id = new_lease_id()?;
    let mut res = match route {
        Route::Device => device(&mut g, id, &ask, tokens),
        Route::Tiers => lookup_tiers(&mut g, id, &ask, tokens, probe),
        Route::Pools => pools(&mut g, id, &ask, tokens),
    }?;
    g.collect_log();
    res.lease = id;
    if ask.dst_slot != MARCONI_NO_SLOT && res.has_device_state == 1 && res.tier == 0 {
        res.has_copy_order = 1;
        res.copy_order = marconi_copy_order {
            src_slot: res.device_state as u32,
            dst_slot: ask.dst_slot,
        };
    }
    Ok(res)
}

/// The device's view over ids: a plain cache, or tiers seen from the
/// device (no lower-tier hit chosen or pinned).
fn device(g: &mut Inner, id: u64, ask: &Ask, tokens: &[u32]) -> FfiResult<marconi_lookup_result> {
    let (ns, hints, opts) = (ask.ns, ask.hints, ask.opts);
    let l = match &mut g.core {
        Core::Plain(c) if hints.is_empty() => c.lookup_with(ns, tokens, opts)?,
        Core::Plain(c) => c.lookup_hinted_with(ns, tokens, hints, opts)?,
        Core::Tiered(t) => t.device_lookup(id, ns, tokens, hints, opts)?,
        Core::Pooled(_) => unreachable!("routed to the pools"),
    };
    let res = marconi_lookup_result {
        hit_tokens: l.hit_tokens,
        device_hit_tokens: l.hit_tokens,
        kv_matched_tokens: l.kv_matched_tokens,
        n_kv_pages: l.kv_pages.len() as u32,
        n_plan: l.plan.len() as u32,
        has_device_state: u32::from(l.state_slot.is_some()),
        device_state: u64::from(l.state_slot.unwrap_or(MARCONI_NO_SLOT)),
        ..Default::default()
    };
    g.issue_lease(
        id,
        Lease {
            core: l.lease,
            pages: (!opts.skip_kv_pages).then_some(l.kv_pages),
        },
    );
    Ok(res)
}

/// Over pools: the hit's handles, with tiers the hit of every tier.
fn pools(g: &mut Inner, id: u64, ask: &Ask, tokens: &[u32]) -> FfiResult<marconi_lookup_result> {
    let Core::Pooled(p) = &mut g.core else {
        unreachable!("routed to the pools")
    };
    let l = p
        .lookup(ask.ns, tokens, ask.hints, ask.opts, ask.device_only)
        .map_err(pooled_err)?;
    let core = l.lookup.lease;
    let mut res = marconi_lookup_result {
        hit_tokens: l.lookup.hit_tokens,
        device_hit_tokens: l.lookup.hit_tokens,
        kv_matched_tokens: l.lookup.kv_matched_tokens,
        n_kv_pages: l.kv_pages.len() as u32,
        has_device_state: u32::from(l.state_slot.is_some()),
        device_state: l.state_slot.map_or(0, VirtualHandle::raw),
        ..Default::default()
    };
    let plan = match l.tiered {
        Some(t) => {
            tier_fields(&mut res, &t);
            t.plan
        }
        None => l.lookup.plan,
    };
    res.n_plan = plan.len() as u32;
    p.leases.insert(
        id,
        PoolLease {
            pages: l.kv_pages.iter().map(|h| h.raw()).collect(),
            plan,
        },
    );
    g.issue_lease(id, Lease { core, pages: None });
    Ok(res)
}

/// The tier view's fields of `res` from a tiered lookup.
pub(crate) fn tier_fields(res: &mut marconi_lookup_result, t: &marconi_core::TieredLookup) {
    let (declined_tier, declined_tokens) = t.declined.map_or((0, 0), |(t, n)| (tier_code(t), n));
    res.tier = tier_code(t.tier);
    res.hit_tokens = t.hit_tokens;
    res.n_loads = t.loads.len() as u32;
    res.n_plan = t.plan.len() as u32;
    res.shared = u32::from(t.shared);
    res.declined_tier = declined_tier;
    res.declined_tokens = declined_tokens;
    res.load_s = t.load_s;
    res.recompute_s = t.recompute_s;
    debug_assert!(t.tier == Tier::Device || t.hit_tokens > t.device.hit_tokens);
}
