//! Host tier memory through the C ABI: `marconi_host_pool_*` (KV pages and
//! state slots in host RAM, a memfd, page-locked for CUDA in builds with
//! the `cuda` feature where a device exists) and the moves between a device
//! pool's handles and the host pool's (demote: device → host, promote:
//! host → device), all or nothing.

use std::sync::{Mutex, MutexGuard};

use marconi_gpu::host::{HostPool, HostPoolConfig, MoveError, Side};
use marconi_gpu::VirtualHandle;

use crate::handle::{borrow, handle_kind, publish, release};
use crate::pool::{
    alloc_count, alloc_err, at_handle, kind_of, kind_value, marconi_pool, marconi_unit_location,
    with_memfd,
};
use crate::status::{
    boundary, boundary_or, check_ptr, in_slice, init_struct, marconi_status, out_slice,
    read_struct, require, versioned, write_versioned, FfiError, FfiResult,
};

/// What a host pool is built from. Versioned by size: set struct_size with
/// marconi_host_pool_config_init, then change fields.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct marconi_host_pool_config {
    /// sizeof(marconi_host_pool_config) as the caller compiled it.
    pub struct_size: u32,
    /// Must be 0.
    pub reserved: u32,
    /// Host bytes of pages and states together, rounded down to whole
    /// chunks; at least two chunks.
    pub capacity_bytes: u64,
    /// Bytes of one KV page: the device pool's kv_page_bytes, so that pages
    /// move between them. Not 0.
    pub page_bytes: u64,
    /// Bytes of one state slot: the device pool's state_slot_bytes. Not 0.
    pub state_bytes: u64,
    /// Share of the capacity given to state slots, strictly between 0 and 1
    /// (default 0.5), rounded to whole chunks.
    pub state_fraction: f64,
    /// Memfd chunk size (a multiple of the OS page size); 0 means 2 MiB.
    pub chunk_bytes: u64,
}
versioned!(marconi_host_pool_config, HOST_CONFIG_V1_SIZE);

impl marconi_host_pool_config {
    fn defaults() -> Self {
        marconi_host_pool_config {
            struct_size: std::mem::size_of::<Self>() as u32,
            reserved: 0,
            capacity_bytes: 0,
            page_bytes: 0,
            state_bytes: 0,
            state_fraction: 0.5,
            chunk_bytes: 0,
        }
    }
}

const HOST_CONFIG_V1_SIZE: usize = std::mem::size_of::<marconi_host_pool_config>();

/// Gauges and counters of a host pool. Versioned by size: set struct_size
/// to sizeof(marconi_host_pool_stats) before calling
/// marconi_host_pool_get_stats.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct marconi_host_pool_stats {
    /// sizeof(marconi_host_pool_stats) as the caller compiled it.
    pub struct_size: u32,
    /// 1 when the pool is page-locked for CUDA (cuda builds with a device),
    /// else 0.
    pub pinned: u32,
    /// Bytes of pages and states together (after rounding to chunks).
    pub capacity_bytes: u64,
    /// KV pages the pool holds.
    pub page_capacity: u64,
    /// KV pages allocated.
    pub pages_live: u64,
    /// State slots the pool holds.
    pub state_capacity: u64,
    /// State slots allocated.
    pub states_live: u64,
    /// Bytes copied into the pool by marconi_host_pool_demote.
    pub bytes_demoted: u64,
    /// Bytes copied out by marconi_host_pool_promote.
    pub bytes_promoted: u64,
    /// Units copied either way.
    pub units_moved: u64,
    /// Host bytes committed now (pages touched).
    pub resident_bytes: u64,
}

const HOST_STATS_MIN_SIZE: usize = 16;

/// One unit move: the unit behind handle src into the unit behind handle
/// dst (same kind, same size).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct marconi_unit_move {
    /// The handle read.
    pub src: u64,
    /// The handle written.
    pub dst: u64,
}

/// A host pool handle: opaque to C. Create with marconi_host_pool_new,
/// free with marconi_host_pool_free.
///
/// Its handles (uint64_t) follow marconi_pool's rules: never 0, below 2^63,
/// accepted only by the pool that issued them (a device pool refuses a host
/// handle and the host pool a device handle, MARCONI_STATUS_UNKNOWN_HANDLE),
/// refused once freed.
pub struct marconi_host_pool {
    inner: Mutex<HostPool>,
}
handle_kind!(marconi_host_pool, HostPool, "marconi_host_pool");

impl marconi_host_pool {
    fn lock(&self) -> FfiResult<MutexGuard<'_, HostPool>> {
        self.inner.lock().map_err(|_| {
            FfiError::new(
                marconi_status::Poisoned,
                "the host pool is unusable after an earlier internal panic",
            )
        })
    }
}

/// # Safety
///
/// `pool` is NULL or a live handle from marconi_host_pool_new.
unsafe fn host_ref<'a>(pool: *const marconi_host_pool) -> FfiResult<&'a marconi_host_pool> {
    // SAFETY: the registry check reads nothing behind the pointer.
    unsafe { borrow(pool, "pool") }
}

fn move_err(e: MoveError) -> FfiError {
    let status = match &e {
        MoveError::Handle { error, .. } => alloc_err(error.clone()).status,
        _ => marconi_status::InvalidArgument,
    };
    let detail = match &e {
        MoveError::Handle { index, side, error } => {
            let what = match side {
                Side::Source => "src",
                Side::Destination => "dst",
            };
            format!("pairs[{index}].{what}: {error}")
        }
        other => other.to_string(),
    };
    FfiError::new(status, detail)
}

/// Writes the default configuration into `*cfg` (state_fraction 0.5, chunk
/// 2 MiB; capacity_bytes, page_bytes and state_bytes 0: the caller sets
/// them) and sets cfg->struct_size to `struct_size`, the caller's
/// sizeof(marconi_host_pool_config). Bytes past this library's struct are
/// zeroed.
#[no_mangle]
pub unsafe extern "C" fn marconi_host_pool_config_init(
    cfg: *mut marconi_host_pool_config,
    struct_size: usize,
) -> marconi_status {
    // SAFETY: cfg is NULL or has struct_size writable bytes (contract).
    boundary("marconi_host_pool_config_init", || unsafe {
        init_struct(cfg, struct_size, "cfg")
    })
}

/// Creates a host pool from `*cfg` and writes the handle to `*out` (free it
/// with marconi_host_pool_free). MARCONI_STATUS_INVALID_CONFIG with the
/// reason in marconi_last_error for a configuration that cannot make one (a
/// zero unit, fewer than two chunks, a unit larger than its share, a
/// state_fraction outside (0, 1), reserved not 0);
/// MARCONI_STATUS_BACKEND_FAILURE when the system refuses the memfd or its
/// mapping. Pinning is attempted only in cuda builds and its failure leaves
/// the pool pageable (marconi_host_pool_stats.pinned says which).
#[no_mangle]
pub unsafe extern "C" fn marconi_host_pool_new(
    cfg: *const marconi_host_pool_config,
    out: *mut *mut marconi_host_pool,
) -> marconi_status {
    boundary("marconi_host_pool_new", || {
        require!(cfg);
        require!(out);
        check_ptr!(cfg);
        check_ptr!(out);
        // SAFETY: cfg is non-NULL and aligned; its size contract is the caller's.
        let c = unsafe { read_struct(cfg) }?;
        if c.reserved != 0 {
            return Err(FfiError::new(
                marconi_status::InvalidConfig,
                "reserved must be 0",
            ));
        }
        let pool = HostPool::new(HostPoolConfig {
            capacity_bytes: c.capacity_bytes,
            state_fraction: c.state_fraction,
            page_bytes: c.page_bytes,
            state_bytes: c.state_bytes,
            chunk_bytes: c.chunk_bytes,
        })
        .map_err(alloc_err)?;
        let handle = marconi_host_pool {
            inner: Mutex::new(pool),
        };
        // SAFETY: out is non-NULL, aligned and writable (checked, contract).
        unsafe { publish(handle, out) };
        Ok(())
    })
}

/// Frees a host pool and its memory (every address it resolved becomes
/// invalid). NULL is a no-op.
#[no_mangle]
pub unsafe extern "C" fn marconi_host_pool_free(pool: *mut marconi_host_pool) {
    boundary_or("marconi_host_pool_free", (), || {
        // SAFETY: no other call runs on it (contract); anything but a live
        // handle of its kind is left alone.
        unsafe { release(pool) };
    })
}

/// Allocates `n` units of `kind` (a marconi_pool_kind: KV pages or state
/// slots) and writes their handles to `out[0..n]`; all or nothing.
/// MARCONI_STATUS_OUT_OF_MEMORY when they are not there (nothing
/// allocated), MARCONI_STATUS_BUFFER_TOO_SMALL when cap < n. n 0 succeeds.
#[no_mangle]
pub unsafe extern "C" fn marconi_host_pool_allocate(
    pool: *const marconi_host_pool,
    kind: u32,
    n: usize,
    out: *mut u64,
    cap: usize,
) -> marconi_status {
    boundary("marconi_host_pool_allocate", || {
        require!(pool);
        require!(out, cap = cap);
        // SAFETY: the caller passes a live handle or NULL.
        let p = unsafe { host_ref(pool) }?;
        // SAFETY: buffer contract of the header.
        let out = unsafe { out_slice(out, cap, "out") }?;
        let kind = kind_of(kind)?;
        let Some(n32) = alloc_count(n, out.len())? else {
            return Ok(());
        };
        let mut got = Vec::with_capacity(n);
        p.lock()?.allocate(kind, n32, &mut got).map_err(alloc_err)?;
        for (o, h) in out.iter_mut().zip(&got) {
            *o = h.raw();
        }
        Ok(())
    })
}

/// Frees the `n` handles of `handles`; all or nothing: every handle is
/// checked first (live, of this pool, listed once). MARCONI_STATUS_DOUBLE_FREE
/// for a handle already freed or listed twice, MARCONI_STATUS_UNKNOWN_HANDLE
/// for a stale or foreign one (a device pool's, for instance) or 0; the
/// detail names the first bad index. n 0 succeeds.
#[no_mangle]
pub unsafe extern "C" fn marconi_host_pool_free_units(
    pool: *const marconi_host_pool,
    handles: *const u64,
    n: usize,
) -> marconi_status {
    boundary("marconi_host_pool_free_units", || {
        require!(pool);
        require!(handles, len = n);
        // SAFETY: the caller passes a live handle or NULL.
        let p = unsafe { host_ref(pool) }?;
        // SAFETY: buffer contract of the header.
        let handles = unsafe { in_slice(handles, n, "handles") }?;
        let hs: Vec<VirtualHandle> = handles
            .iter()
            .map(|&r| VirtualHandle::from_raw(r))
            .collect();
        p.lock()?
            .free(&hs)
            .map_err(|(i, e)| at_handle(i, alloc_err(e)))
    })
}

/// Resolves each of the `n` handles to where its unit lies (a host
/// address, valid while the handle is live) and writes `out[0..n]`; all or
/// nothing. MARCONI_STATUS_UNKNOWN_HANDLE / MARCONI_STATUS_DOUBLE_FREE for a
/// handle that is not live here; MARCONI_STATUS_BUFFER_TOO_SMALL when cap < n.
/// An engine that owns its device memory copies between these addresses
/// and its own (cudaMemcpyAsync on its stream: the pool is pinned there).
#[no_mangle]
pub unsafe extern "C" fn marconi_host_pool_resolve(
    pool: *const marconi_host_pool,
    handles: *const u64,
    n: usize,
    out: *mut marconi_unit_location,
    cap: usize,
) -> marconi_status {
    boundary("marconi_host_pool_resolve", || {
        require!(pool);
        require!(handles, len = n);
        require!(out, cap = cap);
        // SAFETY: the caller passes a live handle or NULL.
        let p = unsafe { host_ref(pool) }?;
        // SAFETY: buffer contracts of the header.
        let handles = unsafe { in_slice(handles, n, "handles") }?;
        // SAFETY: as above.
        let out = unsafe { out_slice(out, cap, "out") }?;
        if out.len() < n {
            return Err(FfiError::new(
                marconi_status::BufferTooSmall,
                format!("out holds {} locations, {n} handles given", out.len()),
            ));
        }
        let g = p.lock()?;
        let mut locs = Vec::with_capacity(n);
        for (i, &raw) in handles.iter().enumerate() {
            let h = VirtualHandle::from_raw(raw);
            let named = |e| at_handle(i, alloc_err(e));
            let loc = g.resolve(h).map_err(named)?;
            let address = g.address(h).map_err(named)?;
            locs.push(marconi_unit_location {
                address: address as u64,
                byte_offset: loc.byte_offset,
                unit_bytes: loc.unit_bytes,
                kind: kind_value(h.pool()),
                // Cannot truncate: offsets are below 2^32 units.
                index: u32::try_from(loc.byte_offset / loc.unit_bytes).unwrap_or(u32::MAX),
            });
        }
        out[..n].copy_from_slice(&locs);
        Ok(())
    })
}

/// Writes the host pool's gauges and counters to `*out` (its struct_size
/// set by the caller; older, shorter versions get their fields).
#[no_mangle]
pub unsafe extern "C" fn marconi_host_pool_get_stats(
    pool: *const marconi_host_pool,
    out: *mut marconi_host_pool_stats,
) -> marconi_status {
    boundary("marconi_host_pool_get_stats", || {
        require!(pool);
        require!(out);
        // SAFETY: the caller passes a live handle or NULL.
        let p = unsafe { host_ref(pool) }?;
        check_ptr!(out);
        // SAFETY: out is non-NULL and aligned; it starts with its u32 size.
        let size = unsafe { out.cast::<u32>().read() } as usize;
        if size < HOST_STATS_MIN_SIZE {
            return Err(FfiError::new(
                marconi_status::UnsupportedStructSize,
                format!("stats struct_size {size} is below {HOST_STATS_MIN_SIZE}"),
            ));
        }
        let st = p.lock()?.stats();
        let s = marconi_host_pool_stats {
            struct_size: size.min(u32::MAX as usize) as u32,
            pinned: u32::from(st.pinned),
            capacity_bytes: st.capacity_bytes,
            page_capacity: u64::from(st.page_capacity),
            pages_live: u64::from(st.pages_live),
            state_capacity: u64::from(st.state_capacity),
            states_live: u64::from(st.states_live),
            bytes_demoted: st.bytes_demoted,
            bytes_promoted: st.bytes_promoted,
            units_moved: st.units_moved,
            resident_bytes: st.resident_bytes,
        };
        // SAFETY: out has `size` writable bytes (contract), checked above.
        unsafe { write_versioned(&s, out, size) };
        Ok(())
    })
}

fn pairs_of(moves: &[marconi_unit_move]) -> Vec<(VirtualHandle, VirtualHandle)> {
    moves
        .iter()
        .map(|m| {
            (
                VirtualHandle::from_raw(m.src),
                VirtualHandle::from_raw(m.dst),
            )
        })
        .collect()
}

/// Direction of a move batch.
#[derive(Clone, Copy)]
enum Direction {
    Demote,
    Promote,
}

/// # Safety
///
/// As the exported functions: live handles or NULL, `pairs` with n elements.
unsafe fn run_moves(
    name: &str,
    host: *const marconi_host_pool,
    device: *const marconi_pool,
    pairs: *const marconi_unit_move,
    n: usize,
    out_bytes: *mut u64,
    dir: Direction,
) -> marconi_status {
    boundary(name, || {
        require!(host);
        require!(device);
        require!(pairs, len = n);
        if !out_bytes.is_null() {
            check_ptr!(out_bytes);
        }
        // SAFETY: the caller passes a live handle or NULL.
        let h = unsafe { host_ref(host) }?;
        // SAFETY: buffer contract of the header.
        let pairs = unsafe { in_slice(pairs, n, "pairs") }?;
        let pairs = pairs_of(pairs);
        // Lock order: the host pool, then the device pool (no other call
        // holds a device pool's lock while taking a host pool's).
        let mut g = h.lock()?;
        // SAFETY: the caller passes a live device pool or NULL.
        let bytes = unsafe {
            with_memfd(device, |d| match dir {
                Direction::Demote => g.demote(&*d, &pairs).map_err(move_err),
                Direction::Promote => g.promote(d, &pairs).map_err(move_err),
            })
        }?;
        if !out_bytes.is_null() {
            // SAFETY: non-NULL, aligned (checked) and writable (contract).
            unsafe { out_bytes.write(bytes) };
        }
        Ok(())
    })
}

/// Demotes: for each pair, copies the device pool's unit behind src into the
/// host pool's unit behind dst, and writes the bytes copied to `*out_bytes`
/// (may be NULL). The batch is checked whole before any byte moves: src live
/// in `device`, dst live in `host` (MARCONI_STATUS_UNKNOWN_HANDLE /
/// MARCONI_STATUS_DOUBLE_FREE, the detail names the pair and its side), the
/// same kind and unit size, no dst twice (MARCONI_STATUS_INVALID_ARGUMENT).
/// The device pool must be MEMFD (the host stand-in for device memory); a
/// CUDA or NONE pool is MARCONI_STATUS_UNSUPPORTED: resolve both sides and
/// copy on the engine's stream. Returns when the copies are done. n 0
/// succeeds.
///
/// Thread safety: safe to call concurrently with other calls on either
/// pool (serialised by their locks); the engine must not touch the units
/// named meanwhile.
#[no_mangle]
pub unsafe extern "C" fn marconi_host_pool_demote(
    host: *const marconi_host_pool,
    device: *const marconi_pool,
    pairs: *const marconi_unit_move,
    n: usize,
    out_bytes: *mut u64,
) -> marconi_status {
    // SAFETY: forwarded contract.
    unsafe {
        run_moves(
            "marconi_host_pool_demote",
            host,
            device,
            pairs,
            n,
            out_bytes,
            Direction::Demote,
        )
    }
}

/// Promotes: for each pair, copies the host pool's unit behind src into the
/// device pool's unit behind dst; the same checks, all or nothing, and
/// backends as marconi_host_pool_demote.
///
/// Thread safety: as marconi_host_pool_demote.
#[no_mangle]
pub unsafe extern "C" fn marconi_host_pool_promote(
    host: *const marconi_host_pool,
    device: *const marconi_pool,
    pairs: *const marconi_unit_move,
    n: usize,
    out_bytes: *mut u64,
) -> marconi_status {
    // SAFETY: forwarded contract.
    unsafe {
        run_moves(
            "marconi_host_pool_promote",
            host,
            device,
            pairs,
            n,
            out_bytes,
            Direction::Promote,
        )
    }
}
