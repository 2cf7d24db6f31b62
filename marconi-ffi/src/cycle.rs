//! The one admit and the one drain of a `marconi_cache`, whatever its
//! configuration: `marconi_cache_admit_with` takes the token and page
//! widths as options of a versioned request and the units (slot ids or
//! pool handles) as 64-bit values; `marconi_cache_drain_with` hands out,
//! in one call and in the order the contract needs, the tier ops and then
//! the freed KV pages and state slots (ids or handles).

use std::ffi::c_void;

use marconi_gpu::{PoolKind, VirtualHandle};

use crate::cache::{
    admit_ids, handle, marconi_admit_result, marconi_cache, marconi_saved_state, Core, TokenSource,
    MARCONI_NO_SLOT,
};
use crate::pooled::{admit_units, marconi_pooled_state};
use crate::status::{
    boundary, check_ptr, in_slice, init_struct, marconi_status, out_slice, read_struct, require,
    versioned, write_versioned, FfiError, FfiResult,
};
use crate::tiered::{marconi_tier_op, ops_need, write_ops};

/// A state the engine saved, offered to marconi_cache_admit_with.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct marconi_admit_state {
    /// Tokens the state covers (a planned position or the final one).
    pub position: u32,
    /// Must be 0.
    pub reserved: u32,
    /// Where it is: a state slot id (ids the engine owns; MARCONI_NO_SLOT
    /// for none) or a state handle from marconi_cache_reserve (pools).
    pub unit: u64,
}

/// What marconi_cache_admit_with admits. Versioned by size: initialise it
/// with marconi_admit_request_init, then set the fields.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct marconi_admit_request {
    /// sizeof(marconi_admit_request) as the caller compiled it.
    pub struct_size: u32,
    /// A marconi_id_width value for `tokens`: MARCONI_ID_WIDTH_U32 (the
    /// default) or MARCONI_ID_WIDTH_I64.
    pub token_width: u32,
    /// The lease of the lookup (any lookup of this cache).
    pub lease: u64,
    /// The looked-up input, then the decoded output: n_tokens ids of
    /// token_width.
    pub tokens: *const c_void,
    /// Default 0.
    pub n_tokens: usize,
    /// The states saved. Default none.
    pub states: *const marconi_admit_state,
    /// Default 0.
    pub n_states: usize,
    /// A marconi_id_width value for `kv_pages`: U32 (the default) or I64
    /// (ids the engine owns), U64 (pool handles, or ids).
    pub page_width: u32,
    /// Reserved, 0.
    pub reserved: u32,
    /// One KV page per full page of tokens, from token 0 (the hit's pages,
    /// then the engine's); over ids the engine owns, none at all is
    /// allowed (an engine that tracks no pages). Default none.
    pub kv_pages: *const c_void,
    /// Default 0.
    pub n_kv_pages: usize,
    /// NULL (the default), or n_states writable bytes: `taken[i]` is set
    /// to 1 when the cache took the unit of `states[i]`, else 0.
    pub taken: *mut u8,
}
versioned!(
    marconi_admit_request,
    std::mem::size_of::<marconi_admit_request>()
);

impl marconi_admit_request {
    fn defaults() -> Self {
        marconi_admit_request {
            struct_size: std::mem::size_of::<marconi_admit_request>() as u32,
            token_width: 0,
            lease: 0,
            tokens: std::ptr::null(),
            n_tokens: 0,
            states: std::ptr::null(),
            n_states: 0,
            page_width: 0,
            reserved: 0,
            kv_pages: std::ptr::null(),
            n_kv_pages: 0,
            taken: std::ptr::null_mut(),
        }
    }
}

/// Fills `*req` with the defaults (documented per field) and sets
/// `req->struct_size`. MARCONI_STATUS_UNSUPPORTED_STRUCT_SIZE when
/// struct_size is smaller than the first version's.
#[no_mangle]
pub unsafe extern "C" fn marconi_admit_request_init(
    req: *mut marconi_admit_request,
    struct_size: usize,
) -> marconi_status {
    // SAFETY: req is NULL or has struct_size writable bytes (contract).
    boundary("marconi_admit_request_init", || unsafe {
        init_struct(req, struct_size, "req")
    })
}

/// Admits `req->tokens` under `req->lease` on a cache of any
/// configuration, with the states saved and the KV pages, and writes the
/// outcome to `*out`: the one admit. Over ids the engine owns it is
/// marconi_cache_admit (or _admit_i64, with int64 widths); over pools
/// marconi_cache_admit_pooled (page_width must be MARCONI_ID_WIDTH_U64:
/// handles are 64 bits). Ownership, the `taken` flags and the errors are
/// those of the call it stands for; nothing changes on error.
///
/// Errors besides: MARCONI_STATUS_INVALID_ARGUMENT for an unknown width, a
/// reserved field not 0, an int64 id outside [0, 2^32 - 1], or over ids a
/// unit or page of 2^32 or more.
#[no_mangle]
pub unsafe extern "C" fn marconi_cache_admit_with(
    cache: *const marconi_cache,
    req: *const marconi_admit_request,
    out: *mut marconi_admit_result,
) -> marconi_status {
    boundary("marconi_cache_admit_with", || {
        require!(cache);
        require!(req);
        require!(out);
        check_ptr!(req);
        // SAFETY: req is non-NULL and aligned; its size contract is the caller's.
        let r = unsafe { read_struct(req) }?;
        let (tokens, states, kv_pages) = (r.tokens, r.states, r.kv_pages);
        require!(tokens, len = r.n_tokens);
        require!(states, len = r.n_states);
        require!(kv_pages, len = r.n_kv_pages);
        if r.reserved != 0 {
            return Err(invalid("req->reserved must be 0".into()));
        }
        let tokens = match r.token_width {
            0 => TokenSource::U32(tokens.cast(), r.n_tokens),
            1 => TokenSource::I64(tokens.cast(), r.n_tokens),
            w => {
                return Err(invalid(format!(
                    "token_width {w}: tokens are MARCONI_ID_WIDTH_U32 or _I64"
                )))
            }
        };
        // SAFETY: buffer contracts of the request.
        let states = unsafe { in_slice(states, r.n_states, "states") }?;
        if let Some(i) = states.iter().position(|s| s.reserved != 0) {
            return Err(invalid(format!("states[{i}].reserved must be 0")));
        }
        // SAFETY: as above.
        let pages = unsafe { pages_u64(kv_pages, r.n_kv_pages, r.page_width) }?;
        // SAFETY: the caller passes a live handle or NULL.
        if unsafe { handle(cache) }?.pooled() {
            if r.page_width != 2 {
                return Err(invalid(format!(
                    "page_width {}: a cache over pools takes page handles \
                     (MARCONI_ID_WIDTH_U64)",
                    r.page_width
                )));
            }
            let ps: Vec<marconi_pooled_state> = states
                .iter()
                .map(|s| marconi_pooled_state {
                    position: s.position,
                    reserved: 0,
                    state_handle: s.unit,
                })
                .collect();
            let mut scratch = vec![0u8; states.len()];
            let taken = if r.taken.is_null() {
                &mut scratch[..]
            } else {
                // SAFETY: taken has n_states writable bytes (contract).
                unsafe { out_slice(r.taken, r.n_states, "taken") }?
            };
            // SAFETY: forwarded caller contract.
            return unsafe { admit_units(cache, r.lease, tokens, &ps, &pages, taken, out) };
        }
        let saved = states
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let slot = if s.unit == u64::from(MARCONI_NO_SLOT) {
                    MARCONI_NO_SLOT
                } else {
                    id32(s.unit, "states", i, ".unit")?
                };
                Ok(marconi_saved_state {
                    position: s.position,
                    slot,
                })
            })
            .collect::<FfiResult<Vec<_>>>()?;
        let ids = pages
            .iter()
            .enumerate()
            .map(|(i, &p)| id32(p, "kv_pages", i, ""))
            .collect::<FfiResult<Vec<u32>>>()?;
        // SAFETY: forwarded caller contract; the arrays are ours.
        unsafe {
            admit_ids(
                cache,
                r.lease,
                tokens,
                (saved.as_ptr(), saved.len()),
                TokenSource::U32(ids.as_ptr(), ids.len()),
                r.taken,
                out,
            )
        }
    })
}

fn invalid(s: String) -> FfiError {
    FfiError::new(marconi_status::InvalidArgument, s)
}

/// `v` as an id of the engine's (below 2^32), or INVALID_ARGUMENT naming
/// `what[i]field`.
fn id32(v: u64, what: &str, i: usize, field: &str) -> FfiResult<u32> {
    u32::try_from(v).map_err(|_| {
        invalid(format!(
            "{what}[{i}]{field} = {v} is not an id in [0, 4294967295] on a cache over ids \
             the engine owns"
        ))
    })
}

/// The page array of `width` as 64-bit values.
///
/// # Safety
///
/// `p` has `n` readable elements of `width`, or is NULL with 0.
unsafe fn pages_u64(p: *const c_void, n: usize, width: u32) -> FfiResult<Vec<u64>> {
    Ok(match width {
        // SAFETY: forwarded contract.
        0 => unsafe { in_slice(p.cast::<u32>(), n, "kv_pages") }?
            .iter()
            .map(|&v| u64::from(v))
            .collect(),
        // SAFETY: as above.
        1 => unsafe { TokenSource::I64(p.cast(), n).ids("kv_pages") }?
            .iter()
            .map(|&v| u64::from(v))
            .collect(),
        // SAFETY: as above.
        2 => unsafe { in_slice(p.cast::<u64>(), n, "kv_pages") }?.to_vec(),
        w => return Err(invalid(format!("page_width {w} is unknown"))),
    })
}

/// The buffers of marconi_cache_drain_with and what it wrote. Versioned by
/// size: set struct_size to sizeof(marconi_drain) and the buffers (NULL
/// with capacity 0 for a size query), then read the counts.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct marconi_drain {
    /// sizeof(marconi_drain) as the caller compiled it.
    pub struct_size: u32,
    /// Reserved, 0.
    pub reserved: u32,
    /// The tier ops (a cache with lower tiers; none otherwise), as
    /// marconi_cache_drain_ops writes them.
    pub ops: *mut marconi_tier_op,
    /// Capacity of `ops`.
    pub ops_cap: usize,
    /// Written: the ops drained (or pending, with BUFFER_TOO_SMALL).
    pub n_ops: usize,
    /// The ops' chain tokens (each op's `position` tokens from its
    /// tokens_offset).
    pub op_tokens: *mut u32,
    /// Capacity of `op_tokens`.
    pub op_tokens_cap: usize,
    /// Written: the tokens drained (or pending).
    pub n_op_tokens: usize,
    /// The KV pages freed by evictions: ids the engine owns, or pool
    /// handles (already back in their pool: stale).
    pub kv_pages: *mut u64,
    /// Capacity of `kv_pages`.
    pub kv_pages_cap: usize,
    /// Written: the pages drained (or pending).
    pub n_kv_pages: usize,
    /// The state slots freed: ids, or pool handles.
    pub state_slots: *mut u64,
    /// Capacity of `state_slots`.
    pub state_slots_cap: usize,
    /// Written: the slots drained (or pending).
    pub n_state_slots: usize,
}
versioned!(marconi_drain, std::mem::size_of::<marconi_drain>());

impl marconi_drain {
    fn defaults() -> Self {
        Self::default()
    }
}

/// This version's struct_size, no buffers (a size query).
impl Default for marconi_drain {
    fn default() -> Self {
        marconi_drain {
            struct_size: std::mem::size_of::<marconi_drain>() as u32,
            reserved: 0,
            ops: std::ptr::null_mut(),
            ops_cap: 0,
            n_ops: 0,
            op_tokens: std::ptr::null_mut(),
            op_tokens_cap: 0,
            n_op_tokens: 0,
            kv_pages: std::ptr::null_mut(),
            kv_pages_cap: 0,
            n_kv_pages: 0,
            state_slots: std::ptr::null_mut(),
            state_slots_cap: 0,
            n_state_slots: 0,
        }
    }
}

/// Drains, on a cache of any configuration, what the engine must act on
/// after a call: the tier ops in order (carry them out first: a WRITE
/// reads units freed with it), then the KV pages and state slots freed by
/// evictions (ids the engine reuses at once, or stale pool handles): the
/// one drain, standing for marconi_cache_drain_ops followed by
/// marconi_cache_drain_freed or marconi_cache_drain_freed_units, in one
/// call. All or nothing: when any buffer is too small (NULL with capacity 0
/// is a size query), returns MARCONI_STATUS_BUFFER_TOO_SMALL with every
/// count written and drains nothing.
///
/// Thread safety: safe to call concurrently on the same cache; each op and
/// each freed unit is delivered to exactly one caller.
#[no_mangle]
pub unsafe extern "C" fn marconi_cache_drain_with(
    cache: *const marconi_cache,
    d: *mut marconi_drain,
) -> marconi_status {
    boundary("marconi_cache_drain_with", || {
        require!(cache);
        require!(d);
        check_ptr!(d);
        // SAFETY: d is non-NULL and aligned; its size contract is the caller's.
        let mut v = unsafe { read_struct(d.cast_const()) }?;
        let size = v.struct_size as usize;
        let (ops, op_tokens, kv_pages, state_slots) =
            (v.ops, v.op_tokens, v.kv_pages, v.state_slots);
        require!(ops, cap = v.ops_cap);
        require!(op_tokens, cap = v.op_tokens_cap);
        require!(kv_pages, cap = v.kv_pages_cap);
        require!(state_slots, cap = v.state_slots_cap);
        // SAFETY: buffer contracts of the struct.
        let ops = unsafe { out_slice(ops, v.ops_cap, "ops") }?;
        // SAFETY: as above.
        let op_tokens = unsafe { out_slice(op_tokens, v.op_tokens_cap, "op_tokens") }?;
        // SAFETY: as above.
        let kv_pages = unsafe { out_slice(kv_pages, v.kv_pages_cap, "kv_pages") }?;
        // SAFETY: as above.
        let state_slots = unsafe { out_slice(state_slots, v.state_slots_cap, "state_slots") }?;
        // SAFETY: the caller passes a live handle or NULL.
        let h = unsafe { handle(cache) }?;
        let mut g = h.lock()?;
        let g = &mut *g;
        // The ids first: on a cache with tiers over ids this moves the ops
        // decided with them into the book, before them in order.
        g.collect_freed();
        let (ids_pages, ids_slots) = g.freed_ids();
        let (mut pages, mut slots): (Vec<u64>, Vec<u64>) = (
            ids_pages.iter().map(|&p| u64::from(p)).collect(),
            ids_slots.iter().map(|&s| u64::from(s)).collect(),
        );
        let no_ops = Vec::new();
        let pending = match &mut g.core {
            Core::Plain(_) => &no_ops,
            Core::Tiered(t) => &t.book.ops,
            Core::Pooled(p) => {
                p.collect_freed();
                for &u in &p.freed {
                    match VirtualHandle::from_raw(u).pool() {
                        PoolKind::Kv => pages.push(u),
                        PoolKind::Ssm => slots.push(u),
                    }
                }
                if p.has_tiers() {
                    p.collect_tier_ops();
                    &p.tier_book().ops
                } else {
                    &no_ops
                }
            }
        };
        let (need_ops, need_tokens) = ops_need(pending);
        v.n_ops = need_ops;
        v.n_op_tokens = need_tokens;
        v.n_kv_pages = pages.len();
        v.n_state_slots = slots.len();
        let short = ops.len() < need_ops
            || op_tokens.len() < need_tokens
            || kv_pages.len() < pages.len()
            || state_slots.len() < slots.len();
        if !short {
            write_ops(pending, ops, op_tokens);
            kv_pages[..pages.len()].copy_from_slice(&pages);
            state_slots[..slots.len()].copy_from_slice(&slots);
            match &mut g.core {
                Core::Plain(_) => {}
                Core::Tiered(t) => t.book.ops.clear(),
                Core::Pooled(p) => {
                    p.freed.clear();
                    if p.has_tiers() {
                        p.tier_book().ops.clear();
                    }
                }
            }
            let (a, b) = g.freed_ids();
            a.clear();
            b.clear();
        }
        // SAFETY: d has `size` writable bytes (contract).
        unsafe { write_versioned(&v, d, size) };
        if short {
            return Err(FfiError::new(
                marconi_status::BufferTooSmall,
                format!(
                    "{need_ops} ops with {need_tokens} tokens, {} pages and {} slots are \
                     pending; the buffers hold {}, {}, {} and {}",
                    pages.len(),
                    slots.len(),
                    ops.len(),
                    op_tokens.len(),
                    kv_pages.len(),
                    state_slots.len()
                ),
            ));
        }
        Ok(())
    })
}
