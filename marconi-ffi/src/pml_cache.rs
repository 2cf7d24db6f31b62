//! The module store from C (marconi-pml's `ModuleCache`): register a
//! schema (its module entries pinned in the budget), look a prompt's layout
//! up (per segment: how it is served and by which entry), admit what the
//! engine computed, drain evicted entries, read counters.

use std::sync::{Mutex, MutexGuard};

use marconi_pml::{
    EntryId, Layout, ModuleCache, ModuleId, ModuleModel, ModuleRef, ReuseMode, SchemaId, Segment,
    SegmentKind, Served, StoreError,
};

use crate::handle::{borrow, handle_kind, publish, release};
use crate::pml::{marconi_pml_schema, marconi_pml_segment, marconi_pml_segment_kind};
use crate::status::{
    boundary, check_ptr, init_struct, marconi_status, out_slice, read_struct, require, versioned,
    write_versioned, FfiError, FfiResult,
};

/// The most segments one call takes (a larger count is refused).
pub const MARCONI_PML_MAX_SEGMENTS: usize = 1 << 20;

/// How a module store is sized. Versioned by size: set it with
/// marconi_pml_cache_config_init, then change fields.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct marconi_pml_cache_config {
    /// sizeof(marconi_pml_cache_config) as the caller compiled it.
    pub struct_size: u32,
    /// Reserved, 0.
    pub reserved: u32,
    /// The byte budget (required, > 0).
    pub capacity_bytes: u64,
    /// KV bytes of one token across every attention layer (required, > 0).
    pub kv_bytes_per_token: u64,
    /// Recurrent-state bytes of every SSM layer at one position (0:
    /// attention-only model).
    pub state_bytes: u64,
    /// Transition-operator bytes of one module across SSM layers (hybrids).
    pub operator_bytes: u64,
    /// Prefill FLOPs of n tokens: flops_per_token * n +
    /// flops_per_token_squared * n^2, for eviction's FLOPs saved per byte
    /// (default 1 and 0: tokens). Finite, >= 0.
    pub flops_per_token: f64,
    /// See flops_per_token (default 0).
    pub flops_per_token_squared: f64,
}
versioned!(
    marconi_pml_cache_config,
    std::mem::size_of::<marconi_pml_cache_config>()
);

impl marconi_pml_cache_config {
    fn defaults() -> Self {
        marconi_pml_cache_config {
            struct_size: std::mem::size_of::<Self>() as u32,
            reserved: 0,
            capacity_bytes: 0,
            kv_bytes_per_token: 0,
            state_bytes: 0,
            operator_bytes: 0,
            flops_per_token: 1.0,
            flops_per_token_squared: 0.0,
        }
    }
}

/// A reuse mode (the `mode` argument of marconi_pml_cache_lookup).
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum marconi_pml_reuse_mode {
    /// Attention-only models: every resident module's KV at its positions.
    Attention = 0,
    /// Exact: the leading run (cached, from position 0, no gap) from exact
    /// entries; cached segments after it recomputed.
    Exact = 1,
    /// Hybrids, approximate: the run exact, later modules' KV and a
    /// composed state with `window` tokens recomputed.
    Composed = 2,
}

/// How a segment is served.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum marconi_pml_served_how {
    /// An exact entry: KV of every layer and the state at its end.
    Exact = 0,
    /// A module entry's KV at the schema's positions.
    Attention = 1,
    /// A module entry's KV and a composed state; `recomputed` leading tokens
    /// computed again.
    Composed = 2,
    /// Cacheable, but not reused in this mode (exact, after the run).
    Recomputed = 3,
    /// Cacheable and not resident: compute it, then admit it
    /// (marconi_pml_cache_admit_exact in the run, else marconi_pml_cache_admit).
    Miss = 4,
    /// Never cached: an argument or the prompt's own text.
    Computed = 5,
}

/// One segment's answer.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct marconi_pml_served {
    /// How it is served.
    pub how: marconi_pml_served_how,
    /// The segment's kind (as in the layout).
    pub kind: marconi_pml_segment_kind,
    /// First position id.
    pub start: u32,
    /// Token count.
    pub len: u32,
    /// Tokens recomputed at its start (COMPOSED), else 0.
    pub recomputed: u32,
    /// Its module: the module index for MODULE and PARAM, the anonymous
    /// text's index (among the schema's anonymous texts) for ANONYMOUS, -1
    /// for TEXT. With `kind`, the arguments of marconi_pml_cache_admit.
    pub module: i32,
    /// Whether it is in the layout's exact leading run (cached, from
    /// position 0, no gap): a MISS there is admitted with
    /// marconi_pml_cache_admit_exact, elsewhere with marconi_pml_cache_admit.
    pub in_run: bool,
    /// The entry serving it (EXACT, ATTENTION, COMPOSED), else 0. Entry ids
    /// are never reused.
    pub entry: u64,
}

/// A module store's counters. Set struct_size to
/// sizeof(marconi_pml_cache_stats) before the call.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct marconi_pml_cache_stats {
    /// sizeof(marconi_pml_cache_stats) as the caller compiled it.
    pub struct_size: u32,
    /// Reserved, 0.
    pub reserved: u32,
    /// Lookups answered.
    pub lookups: u64,
    /// Segments served by an entry.
    pub hits: u64,
    /// Cacheable segments not resident.
    pub misses: u64,
    /// Cacheable segments recomputed by the mode (exact, after the run).
    pub recomputed: u64,
    /// Entries admitted.
    pub admissions: u64,
    /// Registrations and admissions refused for lack of room.
    pub refused: u64,
    /// Entries evicted.
    pub evictions: u64,
    /// Resident entries.
    pub entries: u64,
    /// Bytes of resident entries.
    pub resident_bytes: u64,
    /// Bytes reserved by registered schemas (never evicted).
    pub pinned_bytes: u64,
    /// Bytes counted against the budget (pinned + resident unpinned).
    pub used_bytes: u64,
    /// The budget.
    pub capacity_bytes: u64,
    /// Registered schemas.
    pub schemas: u64,
}

/// The first version's size of marconi_pml_cache_stats.
const STATS_MIN_SIZE: usize = 8;

/// A module store: opaque to C. Create with marconi_pml_cache_new, free with
/// marconi_pml_cache_free. Safe to call from several threads at once
/// (internal lock).
pub struct marconi_pml_cache {
    _private: [u8; 0],
}

struct CacheHandle {
    cache: Mutex<ModuleCache>,
}
handle_kind!(CacheHandle, PmlCache, "marconi_pml_cache");

/// # Safety
///
/// `cache` is NULL or any pointer: only a live handle is dereferenced.
unsafe fn handle<'a>(cache: *const marconi_pml_cache) -> FfiResult<&'a CacheHandle> {
    let h = cache.cast::<CacheHandle>();
    // SAFETY: the registry check reads nothing behind the pointer.
    unsafe { borrow(h, "cache") }
}

fn lock(h: &CacheHandle) -> FfiResult<MutexGuard<'_, ModuleCache>> {
    h.cache.lock().map_err(|_| {
        FfiError::new(
            marconi_status::Poisoned,
            "a panic left the module store's lock poisoned",
        )
    })
}

fn store_error(e: StoreError) -> FfiError {
    let status = match e {
        StoreError::ZeroCapacity | StoreError::ZeroKvBytes => marconi_status::InvalidConfig,
        StoreError::OverBudget { .. } | StoreError::DoesNotFit { .. } => {
            marconi_status::OutOfMemory
        }
        StoreError::ModeNotApplicable { .. } => marconi_status::Unsupported,
        StoreError::UnknownSchema(_)
        | StoreError::UnknownModule(_)
        | StoreError::NoModuleNamed(_)
        | StoreError::ForeignLayout { .. }
        | StoreError::NotInExactRun { .. } => marconi_status::InvalidArgument,
    };
    FfiError::new(status, e.to_string())
}

/// Writes the default configuration (capacity and KV bytes 0: set them)
/// into `cfg`, a struct of `struct_size` bytes (sizeof as the caller
/// compiled it). MARCONI_STATUS_UNSUPPORTED_STRUCT_SIZE when struct_size is
/// smaller than this library's struct.
#[no_mangle]
pub unsafe extern "C" fn marconi_pml_cache_config_init(
    cfg: *mut marconi_pml_cache_config,
    struct_size: usize,
) -> marconi_status {
    // SAFETY: cfg is NULL or has struct_size writable bytes (contract).
    boundary("marconi_pml_cache_config_init", || unsafe {
        init_struct(cfg, struct_size, "cfg")
    })
}

/// Creates a module store sized by `*cfg`; writes the handle to `*out`
/// (caller frees with marconi_pml_cache_free).
///
/// MARCONI_STATUS_INVALID_CONFIG: capacity_bytes or kv_bytes_per_token is 0,
/// or a FLOPs coefficient is negative or not finite.
#[no_mangle]
pub unsafe extern "C" fn marconi_pml_cache_new(
    cfg: *const marconi_pml_cache_config,
    out: *mut *mut marconi_pml_cache,
) -> marconi_status {
    boundary("marconi_pml_cache_new", || {
        require!(cfg);
        require!(out);
        check_ptr!(cfg);
        check_ptr!(out);
        // SAFETY: non-NULL, aligned; struct_size readable bytes (contract).
        let c = unsafe { read_struct(cfg) }?;
        let flops_ok = |x: f64| x.is_finite() && x >= 0.0;
        if !flops_ok(c.flops_per_token) || !flops_ok(c.flops_per_token_squared) {
            return Err(FfiError::new(
                marconi_status::InvalidConfig,
                "flops_per_token and flops_per_token_squared must be finite and >= 0",
            ));
        }
        let model = ModuleModel {
            kv_bytes_per_token: c.kv_bytes_per_token,
            state_bytes: c.state_bytes,
            operator_bytes: c.operator_bytes,
            flops_per_token: c.flops_per_token,
            flops_per_token_squared: c.flops_per_token_squared,
        };
        let cache = ModuleCache::new(model, c.capacity_bytes).map_err(store_error)?;
        let h = CacheHandle {
            cache: Mutex::new(cache),
        };
        // SAFETY: out is non-NULL, aligned and writable (checked, contract).
        unsafe { publish(h, out.cast::<*mut CacheHandle>()) };
        Ok(())
    })
}

/// Frees a module store. NULL is a no-op (MARCONI_STATUS_OK). A pointer
/// that is not a live handle (freed already, or never one) is
/// MARCONI_STATUS_INVALID_ARGUMENT and nothing is freed or read.
#[no_mangle]
pub unsafe extern "C" fn marconi_pml_cache_free(cache: *mut marconi_pml_cache) -> marconi_status {
    boundary("marconi_pml_cache_free", || {
        if cache.is_null() {
            return Ok(());
        }
        // SAFETY: no other call runs on it (contract); only a live module
        // store is freed, and nothing else is read.
        if !unsafe { release(cache.cast::<CacheHandle>()) } {
            return Err(FfiError::new(
                marconi_status::InvalidArgument,
                "cache is not a live marconi_pml_cache handle (freed already, or foreign)",
            ));
        }
        Ok(())
    })
}

/// Registers `schema` (from marconi_pml_schema_new): reserves and pins all
/// its module entries, evicting unpinned entries to make room; writes its
/// id (> 0) to `*schema_id`. Module entries still resident from an earlier
/// registration of the same schema (same namespace) are served at once.
/// Registering a registered schema returns its id and counts once more.
///
/// MARCONI_STATUS_OUT_OF_MEMORY: its modules and those already pinned
/// exceed the budget (nothing is evicted then).
#[no_mangle]
pub unsafe extern "C" fn marconi_pml_cache_register(
    cache: *mut marconi_pml_cache,
    schema: *const marconi_pml_schema,
    schema_id: *mut u64,
) -> marconi_status {
    boundary("marconi_pml_cache_register", || {
        require!(cache);
        require!(schema);
        require!(schema_id);
        check_ptr!(schema);
        check_ptr!(schema_id);
        // SAFETY: only a live handle is dereferenced.
        let h = unsafe { handle(cache) }?;
        // SAFETY: a live schema handle (caller contract), checked non-NULL.
        let s = unsafe { crate::pml::schema_ref(schema) }?;
        let id = lock(h)?.register(s.encoded()).map_err(store_error)?;
        // SAFETY: checked non-NULL and aligned; writable by contract.
        unsafe { schema_id.write(id.0) };
        Ok(())
    })
}

/// Drops one registration of `schema_id`; at the last, its module entries
/// become unpinned (resident until the budget needs room).
/// MARCONI_STATUS_INVALID_ARGUMENT: not registered (also a second
/// unregister).
#[no_mangle]
pub unsafe extern "C" fn marconi_pml_cache_unregister(
    cache: *mut marconi_pml_cache,
    schema_id: u64,
) -> marconi_status {
    boundary("marconi_pml_cache_unregister", || {
        require!(cache);
        // SAFETY: only a live handle is dereferenced.
        let h = unsafe { handle(cache) }?;
        lock(h)?
            .unregister(SchemaId(schema_id))
            .map_err(store_error)
    })
}

/// Reads `n` caller segments field by field (an enum or bool field holding
/// another value is refused, never read as one).
///
/// # Safety
///
/// `segments` is NULL with `n == 0` or points to `n` readable segments.
unsafe fn read_layout(segments: *const marconi_pml_segment, n: usize) -> FfiResult<Layout> {
    if n == 0 {
        return Err(FfiError::new(
            marconi_status::EmptyTokens,
            "n_segments is 0",
        ));
    }
    if n > MARCONI_PML_MAX_SEGMENTS {
        return Err(FfiError::new(
            marconi_status::InvalidArgument,
            format!("n_segments {n} exceeds {MARCONI_PML_MAX_SEGMENTS}"),
        ));
    }
    check_ptr!(segments);
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        // SAFETY: i < n readable, aligned elements (contract, checked); the
        // fields are read as plain integers through raw pointers.
        let (kind, cached, start, len, module) = unsafe {
            let p = segments.add(i);
            (
                std::ptr::addr_of!((*p).kind).cast::<u32>().read(),
                std::ptr::addr_of!((*p).cached).cast::<u8>().read(),
                std::ptr::addr_of!((*p).start).read(),
                std::ptr::addr_of!((*p).len).read(),
                std::ptr::addr_of!((*p).module).read(),
            )
        };
        let bad = |why: &str| {
            FfiError::new(
                marconi_status::InvalidArgument,
                format!("segments[{i}]: {why}"),
            )
        };
        let kind = match kind {
            0 => SegmentKind::Module,
            1 => SegmentKind::Anonymous,
            2 => SegmentKind::Param,
            3 => SegmentKind::Text,
            k => return Err(bad(&format!("kind {k} is not a marconi_pml_segment_kind"))),
        };
        let cached = match cached {
            0 => false,
            1 => true,
            c => return Err(bad(&format!("cached is {c}, not a bool"))),
        };
        if start.checked_add(len).is_none() {
            return Err(bad("start + len overflows"));
        }
        out.push(Segment {
            name: None,
            module: usize::try_from(module).ok().map(ModuleId),
            kind,
            start,
            len,
            cached,
            tokens: Vec::new(),
        });
    }
    Ok(Layout { segments: out })
}

/// Says how each segment of a prompt's layout (`segments[0..n_segments]`,
/// as marconi_pml_layout wrote them for the schema registered as
/// `schema_id`) is served under `mode` (a marconi_pml_reuse_mode; `window`:
/// tokens recomputed per composed segment, COMPOSED only), and by which
/// entry: `out[0..n_segments]`, in the same order; writes n_segments to
/// `*n_out`. Modes never mix: ATTENTION serves module entries only, EXACT
/// the leading run from exact entries (the rest RECOMPUTED), COMPOSED the
/// run exactly and later modules composed.
///
/// MARCONI_STATUS_UNSUPPORTED: the mode does not apply to the model
/// (ATTENTION with state_bytes > 0, COMPOSED with state_bytes 0).
/// MARCONI_STATUS_INVALID_ARGUMENT: an unknown mode or schema id, a layout
/// not of this schema, more than MARCONI_PML_MAX_SEGMENTS segments.
/// MARCONI_STATUS_BUFFER_TOO_SMALL: out_cap < n_segments (writes
/// n_segments to `*n_out` only). MARCONI_STATUS_EMPTY_TOKENS: n_segments 0.
#[no_mangle]
pub unsafe extern "C" fn marconi_pml_cache_lookup(
    cache: *mut marconi_pml_cache,
    schema_id: u64,
    segments: *const marconi_pml_segment,
    n_segments: usize,
    mode: u32,
    window: u32,
    out: *mut marconi_pml_served,
    out_cap: usize,
    n_out: *mut usize,
) -> marconi_status {
    boundary("marconi_pml_cache_lookup", || {
        require!(cache);
        require!(segments, len = n_segments);
        require!(out, cap = out_cap);
        require!(n_out);
        check_ptr!(n_out);
        // SAFETY: only a live handle is dereferenced.
        let h = unsafe { handle(cache) }?;
        let mode = match mode {
            0 => ReuseMode::Attention,
            1 => ReuseMode::Exact,
            2 => ReuseMode::Composed { window },
            m => {
                return Err(FfiError::new(
                    marconi_status::InvalidArgument,
                    format!("mode {m} is not a marconi_pml_reuse_mode"),
                ))
            }
        };
        // SAFETY: n_segments readable segments (contract).
        let layout = unsafe { read_layout(segments, n_segments) }?;
        // SAFETY: NULL only with capacity 0 (checked); writable by contract.
        let dst = unsafe { out_slice(out, out_cap, "out") }?;
        if dst.len() < n_segments {
            // SAFETY: checked non-NULL and aligned; writable by contract.
            unsafe { n_out.write(n_segments) };
            return Err(FfiError::new(
                marconi_status::BufferTooSmall,
                format!("{n_segments} segments; out holds {out_cap}"),
            ));
        }
        let r = lock(h)?
            .lookup(SchemaId(schema_id), &layout, mode)
            .map_err(store_error)?;
        for (i, ((g, s), o)) in r
            .segments
            .iter()
            .zip(&layout.segments)
            .zip(dst.iter_mut())
            .enumerate()
        {
            let (how, recomputed) = match g.served {
                Served::Exact => (marconi_pml_served_how::Exact, 0),
                Served::Attention => (marconi_pml_served_how::Attention, 0),
                Served::Composed { recomputed } => (marconi_pml_served_how::Composed, recomputed),
                Served::Recomputed => (marconi_pml_served_how::Recomputed, 0),
                Served::Miss => (marconi_pml_served_how::Miss, 0),
                Served::Computed => (marconi_pml_served_how::Computed, 0),
            };
            let module = match g.module {
                Some(ModuleRef::Named(m)) => i32::try_from(m.0).unwrap_or(i32::MAX),
                Some(ModuleRef::Anonymous(i)) => i32::try_from(i).unwrap_or(i32::MAX),
                None => -1,
            };
            *o = marconi_pml_served {
                how,
                kind: match s.kind {
                    SegmentKind::Module => marconi_pml_segment_kind::Module,
                    SegmentKind::Anonymous => marconi_pml_segment_kind::Anonymous,
                    SegmentKind::Param => marconi_pml_segment_kind::Param,
                    SegmentKind::Text => marconi_pml_segment_kind::Text,
                },
                start: s.start,
                len: s.len,
                recomputed,
                module,
                in_run: i < r.exact_run,
                entry: g.entry.map_or(0, |e| e.0),
            };
        }
        // SAFETY: checked non-NULL and aligned; writable by contract.
        unsafe { n_out.write(n_segments) };
        Ok(())
    })
}

/// Admits a module entry once the engine has computed the module (its KV
/// and, for hybrids, its end state from zero and its transition operator):
/// `kind` MODULE with the module's index, or ANONYMOUS with the anonymous
/// text's index (as marconi_pml_served.module gives them). Its bytes were
/// reserved at registration. Writes its entry id to `*entry` (the same id
/// when already resident).
///
/// MARCONI_STATUS_INVALID_ARGUMENT: unknown schema id, kind or index.
#[no_mangle]
pub unsafe extern "C" fn marconi_pml_cache_admit(
    cache: *mut marconi_pml_cache,
    schema_id: u64,
    kind: u32,
    index: u32,
    entry: *mut u64,
) -> marconi_status {
    boundary("marconi_pml_cache_admit", || {
        require!(cache);
        require!(entry);
        check_ptr!(entry);
        // SAFETY: only a live handle is dereferenced.
        let h = unsafe { handle(cache) }?;
        let index = index as usize;
        let m = match kind {
            0 => ModuleRef::Named(ModuleId(index)),
            1 => ModuleRef::Anonymous(index),
            k => {
                return Err(FfiError::new(
                    marconi_status::InvalidArgument,
                    format!("kind {k}: a module entry is MODULE (0) or ANONYMOUS (1)"),
                ))
            }
        };
        let id = lock(h)?
            .admit(SchemaId(schema_id), m)
            .map_err(store_error)?;
        // SAFETY: checked non-NULL and aligned; writable by contract.
        unsafe { entry.write(id.0) };
        Ok(())
    })
}

/// Admits the exact entry of `segments[segment]` (in the layout's leading
/// run) once the engine has computed the run up to it in context: the
/// segment's KV in every layer and, for hybrids, the state at its end.
/// Evicts unpinned entries by utility to make room (drain them with
/// marconi_pml_cache_evicted). Writes its entry id to `*entry`.
///
/// MARCONI_STATUS_OUT_OF_MEMORY: larger than the unpinned budget (nothing
/// evicted). MARCONI_STATUS_INVALID_ARGUMENT: unknown schema id, a layout
/// not of this schema, a segment outside the run.
#[no_mangle]
pub unsafe extern "C" fn marconi_pml_cache_admit_exact(
    cache: *mut marconi_pml_cache,
    schema_id: u64,
    segments: *const marconi_pml_segment,
    n_segments: usize,
    segment: usize,
    entry: *mut u64,
) -> marconi_status {
    boundary("marconi_pml_cache_admit_exact", || {
        require!(cache);
        require!(segments, len = n_segments);
        require!(entry);
        check_ptr!(entry);
        // SAFETY: only a live handle is dereferenced.
        let h = unsafe { handle(cache) }?;
        // SAFETY: n_segments readable segments (contract).
        let layout = unsafe { read_layout(segments, n_segments) }?;
        let id = lock(h)?
            .admit_exact(SchemaId(schema_id), &layout, segment)
            .map_err(store_error)?;
        // SAFETY: checked non-NULL and aligned; writable by contract.
        unsafe { entry.write(id.0) };
        Ok(())
    })
}

/// Moves the ids of entries evicted since the last call (oldest first) into
/// `out[0..cap]` and writes their count to `*n`; the engine frees their
/// memory. MARCONI_STATUS_BUFFER_TOO_SMALL: more are pending than `cap`
/// (writes the pending count to `*n`, removes nothing; NULL with cap 0 is a
/// size query).
#[no_mangle]
pub unsafe extern "C" fn marconi_pml_cache_evicted(
    cache: *mut marconi_pml_cache,
    out: *mut u64,
    cap: usize,
    n: *mut usize,
) -> marconi_status {
    boundary("marconi_pml_cache_evicted", || {
        require!(cache);
        require!(out, cap = cap);
        require!(n);
        check_ptr!(n);
        // SAFETY: only a live handle is dereferenced.
        let h = unsafe { handle(cache) }?;
        // SAFETY: NULL only with capacity 0 (checked); writable by contract.
        let dst = unsafe { out_slice(out, cap, "out") }?;
        let mut c = lock(h)?;
        if c.evicted_pending() > dst.len() {
            let k = c.evicted_pending();
            // SAFETY: checked non-NULL and aligned; writable by contract.
            unsafe { n.write(k) };
            return Err(FfiError::new(
                marconi_status::BufferTooSmall,
                format!("{k} evicted entries pending; out holds {cap}"),
            ));
        }
        let pending: Vec<EntryId> = c.drain_evicted();
        for (d, e) in dst.iter_mut().zip(&pending) {
            *d = e.0;
        }
        // SAFETY: checked non-NULL and aligned; writable by contract.
        unsafe { n.write(pending.len()) };
        Ok(())
    })
}

/// Writes the store's counters to `*out`. Set out->struct_size to
/// sizeof(marconi_pml_cache_stats) first: only that many bytes are written
/// (at least 8).
#[no_mangle]
pub unsafe extern "C" fn marconi_pml_cache_get_stats(
    cache: *mut marconi_pml_cache,
    out: *mut marconi_pml_cache_stats,
) -> marconi_status {
    boundary("marconi_pml_cache_get_stats", || {
        require!(cache);
        require!(out);
        check_ptr!(out);
        // SAFETY: only a live handle is dereferenced.
        let h = unsafe { handle(cache) }?;
        // SAFETY: out is non-NULL and aligned; its first field is struct_size.
        let size = unsafe { out.cast::<u32>().read() } as usize;
        if size < STATS_MIN_SIZE {
            return Err(FfiError::new(
                marconi_status::UnsupportedStructSize,
                format!("stats struct_size is {size}; set it to sizeof(marconi_pml_cache_stats)"),
            ));
        }
        let s = lock(h)?.stats();
        let v = marconi_pml_cache_stats {
            struct_size: size as u32,
            reserved: 0,
            lookups: s.lookups,
            hits: s.hits,
            misses: s.misses,
            recomputed: s.recomputed,
            admissions: s.admissions,
            refused: s.refused,
            evictions: s.evictions,
            entries: s.entries,
            resident_bytes: s.resident_bytes,
            pinned_bytes: s.pinned_bytes,
            used_bytes: s.used_bytes,
            capacity_bytes: s.capacity_bytes,
            schemas: s.schemas,
        };
        // SAFETY: out has `size` writable bytes (contract), checked above.
        unsafe { write_versioned(&v, out, size) };
        Ok(())
    })
}
