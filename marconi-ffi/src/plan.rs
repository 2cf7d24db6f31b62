//! Memory planning through the C ABI: `marconi_plan` turns a model, a page
//! size and a device budget into the numbers an engine needs at start-up
//! (marconi-gpu's `plan`): unit sizes, KV tokens and state slots of a static
//! split, and the largest batch x context under a static split, AVMP and a
//! padded unified table.

use std::ffi::c_char;

use marconi_core::ModelSpec;
use marconi_gpu::plan::plan;
use marconi_gpu::pooled::PoolLayout;
use marconi_gpu::AllocError;

use crate::config::{marconi_model_spec, preset_named};
use crate::status::{
    boundary, check_ptr, init_struct, marconi_status, read_struct, require, versioned,
    write_versioned, FfiError, FfiResult,
};

/// What to plan for. Versioned by size: set struct_size with
/// marconi_plan_request_init, then change fields.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct marconi_plan_request {
    /// sizeof(marconi_plan_request) as the caller compiled it.
    pub struct_size: u32,
    /// Tokens per KV page (default 16).
    pub page_size: u32,
    /// A preset name (NUL-terminated), or NULL to use `model`.
    pub model_preset: *const c_char,
    /// The model when model_preset is NULL (default: "paper-7b").
    pub model: marconi_model_spec,
    /// Device bytes for both pools.
    pub budget_bytes: u64,
    /// State share of a static split, strictly between 0 and 1 (default 0.5).
    pub state_fraction: f64,
    /// Tokens per running sequence for the max_batch_* figures (0: not asked).
    pub context_tokens: u64,
    /// Running sequences for the max_context_* figures (0: not asked).
    pub batch: u64,
}
versioned!(
    marconi_plan_request,
    std::mem::size_of::<marconi_plan_request>()
);

/// The start-up numbers (out->struct_size set by the caller; the library
/// writes only that many bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct marconi_memory_plan {
    /// sizeof(marconi_memory_plan) as the caller compiled it.
    pub struct_size: u32,
    /// Tokens per KV page.
    pub page_size: u32,
    /// Device bytes for both pools.
    pub budget_bytes: u64,
    /// KV bytes per token (all attention layers).
    pub kv_bytes_per_token: u64,
    /// Bytes of one KV page (128-aligned): pool unit of the KV pool.
    pub kv_page_bytes: u64,
    /// Bytes of one state slot: one checkpoint of every recurrent layer
    /// (128-aligned).
    pub state_slot_bytes: u64,
    /// KV tokens if the whole budget held KV.
    pub max_kv_tokens: u64,
    /// State slots if the whole budget held states.
    pub max_state_slots: u64,
    /// Unit of a padded unified table (the larger unit, vLLM's layout).
    pub unified_unit_bytes: u64,
    /// Units of that table.
    pub unified_units: u64,
    /// The static split's state fraction (the request's).
    pub state_fraction: f64,
    /// KV pages of that split.
    pub split_kv_pages: u64,
    /// KV tokens of that split.
    pub split_kv_tokens: u64,
    /// State slots of that split.
    pub split_state_slots: u64,
    /// The state fraction a batch of context_tokens-token sequences uses,
    /// in (0, 1] (0 when context_tokens is 0).
    pub fraction_for_context: f64,
    /// Largest batch of context_tokens-token sequences: static split at
    /// state_fraction, AVMP (capacity follows demand), unified table (0 when
    /// context_tokens is 0 or not one such sequence fits, whatever its
    /// length).
    pub max_batch_static: u64,
    /// As max_batch_static, AVMP.
    pub max_batch_avmp: u64,
    /// As max_batch_static, padded unified table.
    pub max_batch_unified: u64,
    /// Longest context for `batch` sequences each, in whole pages' tokens:
    /// static split (0 when batch is 0).
    pub max_context_static: u64,
    /// As max_context_static, AVMP.
    pub max_context_avmp: u64,
    /// As max_context_static, padded unified table.
    pub max_context_unified: u64,
}

/// Smallest struct_size of marconi_memory_plan accepted (up to budget_bytes).
const PLAN_MIN_SIZE: usize = 16;

impl marconi_plan_request {
    fn defaults() -> Self {
        // A preset that always exists (core's tests pin the list).
        let m = ModelSpec::preset("paper-7b")
            .map(|m| marconi_model_spec::from_core(&m))
            .unwrap_or_default();
        marconi_plan_request {
            struct_size: std::mem::size_of::<Self>() as u32,
            page_size: 16,
            model_preset: std::ptr::null(),
            model: m,
            budget_bytes: 0,
            state_fraction: 0.5,
            context_tokens: 0,
            batch: 0,
        }
    }
}

/// Writes the default request into `*req` (page_size 16, the "paper-7b"
/// model, state_fraction 0.5, budget 0: the caller sets it) and sets
/// req->struct_size to `struct_size`, the caller's sizeof.
#[no_mangle]
pub unsafe extern "C" fn marconi_plan_request_init(
    req: *mut marconi_plan_request,
    struct_size: usize,
) -> marconi_status {
    // SAFETY: req is NULL or has struct_size writable bytes (contract).
    boundary("marconi_plan_request_init", || unsafe {
        init_struct(req, struct_size, "req")
    })
}

fn plan_err(e: AllocError) -> FfiError {
    FfiError::new(marconi_status::InvalidConfig, e.to_string())
}

/// The model a request names.
///
/// # Safety
///
/// r.model_preset is NULL or NUL-terminated.
unsafe fn model_of(r: &marconi_plan_request) -> FfiResult<ModelSpec> {
    if r.model_preset.is_null() {
        if r.model.reserved != 0 {
            return Err(FfiError::new(
                marconi_status::InvalidConfig,
                "model.reserved must be 0",
            ));
        }
        return Ok(r.model.to_core("custom"));
    }
    // SAFETY: non-NULL and NUL-terminated by contract.
    unsafe { preset_named(r.model_preset, "model_preset") }
}

/// The struct_size an output struct declares, refused below `min`.
///
/// # Safety
///
/// `out` is non-NULL and aligned, its first u32 its struct_size.
unsafe fn out_struct_size(out: *const u32, min: usize, what: &str) -> FfiResult<usize> {
    // SAFETY: contract of this function.
    let size = unsafe { out.read() } as usize;
    if size < min {
        return Err(FfiError::new(
            marconi_status::UnsupportedStructSize,
            format!("{what} struct_size {size} is below {min}"),
        ));
    }
    Ok(size)
}

/// Plans the pools for `*req` and writes the numbers to `*out` (only
/// out->struct_size bytes, at least 16). MARCONI_STATUS_INVALID_CONFIG for
/// a model without recurrent layers, page_size 0, a budget below one page
/// and one slot, or a state_fraction outside (0, 1); the detail says which.
#[no_mangle]
pub unsafe extern "C" fn marconi_plan(
    req: *const marconi_plan_request,
    out: *mut marconi_memory_plan,
) -> marconi_status {
    boundary("marconi_plan", || {
        require!(req);
        require!(out);
        check_ptr!(req);
        check_ptr!(out);
        // SAFETY: req non-NULL and aligned (checked), initialised (contract).
        let r = unsafe { read_struct(req) }?;
        // SAFETY: out non-NULL and aligned (checked).
        let out_size = unsafe { out_struct_size(out.cast(), PLAN_MIN_SIZE, "plan") }?;
        // SAFETY: model_preset contract.
        let model = unsafe { model_of(&r) }?;
        let p = plan(&model, r.page_size, r.budget_bytes).map_err(plan_err)?;
        let f = r.state_fraction;
        let split = p.split(f).map_err(plan_err)?;
        let layouts = [
            PoolLayout::Static { ssm_fraction: f },
            PoolLayout::Avmp { ssm_fraction: f },
            PoolLayout::Unified,
        ];
        let mut batch = [0u64; 3];
        let mut context = [0u64; 3];
        for (i, l) in layouts.into_iter().enumerate() {
            if r.context_tokens > 0 {
                batch[i] = p.max_batch(r.context_tokens, l).map_err(plan_err)?;
            }
            if r.batch > 0 {
                context[i] = p.max_context(r.batch, l).map_err(plan_err)?;
            }
        }
        let s = marconi_memory_plan {
            struct_size: out_size.min(u32::MAX as usize) as u32,
            page_size: p.page_size,
            budget_bytes: p.budget_bytes,
            kv_bytes_per_token: p.kv_bytes_per_token,
            kv_page_bytes: p.kv_page_bytes,
            state_slot_bytes: p.state_slot_bytes,
            max_kv_tokens: p.max_kv_tokens,
            max_state_slots: p.max_state_slots,
            unified_unit_bytes: p.unified_unit_bytes,
            unified_units: p.unified_units,
            state_fraction: split.ssm_fraction,
            split_kv_pages: split.kv_pages,
            split_kv_tokens: split.kv_tokens,
            split_state_slots: split.state_slots,
            fraction_for_context: if r.context_tokens > 0 {
                p.fraction_for_context(r.context_tokens)
            } else {
                0.0
            },
            max_batch_static: batch[0],
            max_batch_avmp: batch[1],
            max_batch_unified: batch[2],
            max_context_static: context[0],
            max_context_avmp: context[1],
            max_context_unified: context[2],
        };
        // SAFETY: out has out_size writable bytes (contract), checked above.
        unsafe { write_versioned(&s, out, out_size) };
        Ok(())
    })
}

/// Where capacity migration takes the split on a trace
/// (marconi_plan_converged_split). Versioned by size like marconi_memory_plan.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct marconi_converged_split {
    /// sizeof(marconi_converged_split) as the caller compiled it.
    pub struct_size: u32,
    /// 0.
    pub reserved: u32,
    /// Requests replayed.
    pub requests: u64,
    /// The state fraction the pools started at (the request's state_fraction).
    pub start_fraction: f64,
    /// The state pool's share of the pools' bytes after the last request.
    pub final_fraction: f64,
    /// That share averaged over the second half of the requests (after the
    /// cache filled, where the split settles): the split to start with.
    pub settled_fraction: f64,
    /// Token hit rate of the replay (0 to 1).
    pub token_hit_rate: f64,
    /// Requests refused for lack of memory.
    pub refused: u64,
    /// Capacity migrations between the pools.
    pub migrations: u64,
    /// Bytes those migrations moved.
    pub bytes_migrated: u64,
    /// Entries evicted to make room for a reservation.
    pub evictions_for_memory: u64,
}

/// Smallest struct_size of marconi_converged_split accepted (up to requests).
const CONVERGED_MIN_SIZE: usize = 16;

/// Checks a trace given as flat arrays and returns its requests.
///
/// # Safety
///
/// The pointers have their lengths in readable elements (NULL with length 0).
unsafe fn trace_of<'a>(
    tokens: *const u32,
    n_tokens: usize,
    offsets: *const usize,
    n_offsets: usize,
    input_lens: *const u32,
    n_requests: usize,
) -> FfiResult<Vec<(usize, &'a [u32])>> {
    let bad = |m: String| Err(FfiError::new(marconi_status::InvalidArgument, m));
    if n_requests == 0 {
        return bad("n_requests is 0: the trace has no request".into());
    }
    if n_offsets != n_requests + 1 {
        return bad(format!(
            "n_offsets is {n_offsets}: expected n_requests + 1 = {}",
            n_requests.saturating_add(1)
        ));
    }
    // SAFETY: lengths in readable elements (contract); checked non-NULL
    // (or zero-length) by the caller's require! lines.
    let (tokens, offsets) = unsafe {
        (
            crate::status::in_slice(tokens, n_tokens, "tokens")?,
            crate::status::in_slice(offsets, n_offsets, "offsets")?,
        )
    };
    let input_lens = if input_lens.is_null() {
        None
    } else {
        // SAFETY: as above.
        Some(unsafe { crate::status::in_slice(input_lens, n_requests, "input_lens")? })
    };
    if offsets[0] != 0 || offsets[n_requests] != n_tokens {
        return bad(format!(
            "offsets must start at 0 and end at n_tokens ({n_tokens}); got {} .. {}",
            offsets[0], offsets[n_requests]
        ));
    }
    let mut out = Vec::with_capacity(n_requests);
    for i in 0..n_requests {
        let (a, b) = (offsets[i], offsets[i + 1]);
        if b <= a {
            return bad(format!(
                "request {i} is empty or offsets decrease (offsets[{i}] = {a}, offsets[{}] = {b})",
                i + 1
            ));
        }
        let len = b - a;
        let input = input_lens.map_or(len, |l| l[i] as usize);
        if input == 0 || input > len {
            return bad(format!(
                "input_lens[{i}] is {input}: must be between 1 and the request's {len} tokens"
            ));
        }
        out.push((input, &tokens[a..b]));
    }
    Ok(out)
}

/// Replays a trace through a marconi cache over AVMP pools of
/// req->budget_bytes starting at req->state_fraction (req->model,
/// req->page_size; context_tokens and batch are ignored) and writes where
/// capacity migration takes the split to `*out` (out->struct_size bytes, at
/// least 16): `settled_fraction` is the split to configure a static pool
/// with, or to start AVMP from.
///
/// The trace: request i is `tokens[offsets[i] .. offsets[i + 1]]` (its
/// whole sequence, prompt then output) whose first `input_lens[i]` tokens
/// are its input (`input_lens` NULL: every request is all input);
/// `n_offsets` = `n_requests` + 1, `offsets[0]` = 0, `offsets[n_requests]` =
/// n_tokens, every request at least one token. Requests are served in
/// order, one at a time. MARCONI_STATUS_INVALID_ARGUMENT for a malformed
/// trace (the detail names the request); MARCONI_STATUS_INVALID_CONFIG as
/// marconi_plan; MARCONI_STATUS_TOO_MANY_TOKENS for a request longer than a
/// cache accepts. Cost: the replay, O(trace tokens) with the cache's
/// per-request work (a 7,000-request trace takes about a second); it
/// allocates no device memory.
#[no_mangle]
pub unsafe extern "C" fn marconi_plan_converged_split(
    req: *const marconi_plan_request,
    tokens: *const u32,
    n_tokens: usize,
    offsets: *const usize,
    n_offsets: usize,
    input_lens: *const u32,
    n_requests: usize,
    out: *mut marconi_converged_split,
) -> marconi_status {
    boundary("marconi_plan_converged_split", || {
        require!(req);
        require!(tokens, len = n_tokens);
        require!(offsets, len = n_offsets);
        require!(out);
        check_ptr!(req);
        check_ptr!(out);
        // SAFETY: req non-NULL, aligned; the same checks as marconi_plan.
        let r = unsafe { read_struct(req) }?;
        // SAFETY: out non-NULL and aligned (checked).
        let out_size =
            unsafe { out_struct_size(out.cast(), CONVERGED_MIN_SIZE, "converged split") }?;
        // SAFETY: buffer contracts of this function.
        let trace =
            unsafe { trace_of(tokens, n_tokens, offsets, n_offsets, input_lens, n_requests) }?;
        // SAFETY: model_preset contract.
        let model = unsafe { model_of(&r) }?;
        let f = r.state_fraction;
        if !(f > 0.0 && f < 1.0) {
            return Err(FfiError::new(
                marconi_status::InvalidConfig,
                format!("state_fraction {f} must be strictly between 0 and 1"),
            ));
        }
        // The budget must hold a page and a slot (the same message as marconi_plan).
        plan(&model, r.page_size, r.budget_bytes).map_err(plan_err)?;
        let mut cfg = marconi_core::CacheConfig::marconi(model, r.budget_bytes);
        cfg.page_size = r.page_size;
        let c = marconi_gpu::plan::converged_split(&cfg, r.budget_bytes, f, trace.into_iter())
            .map_err(crate::pooled::pooled_err)?;
        let s = marconi_converged_split {
            struct_size: out_size.min(u32::MAX as usize) as u32,
            reserved: 0,
            requests: n_requests as u64,
            start_fraction: c.start_fraction,
            final_fraction: c.final_fraction,
            settled_fraction: c.settled_fraction,
            token_hit_rate: c.token_hit_rate,
            refused: c.stats.refused,
            migrations: c.stats.migrations,
            bytes_migrated: c.stats.bytes_migrated,
            evictions_for_memory: c.stats.evictions_for_memory,
        };
        // SAFETY: out has out_size writable bytes (contract), checked above.
        unsafe { write_versioned(&s, out, out_size) };
        Ok(())
    })
}
