//! The memory pools of `marconi-gpu` through the C ABI: `marconi_pool_*`
//! (two pools of fixed-size units, KV pages and recurrent-state slots, over
//! one byte budget, with a static split or AVMP capacity migration, backed
//! by nothing, a Linux memfd or CUDA virtual memory) and the snapshot
//! operations (copy batches, fork, promote) over a pool's state slots or a
//! caller's buffer.
//!
//! Handles are `marconi-gpu`'s 64-bit virtual handles (the guarantees are
//! written on `marconi_pool`, in the header).

use std::collections::HashSet;
use std::sync::{Mutex, MutexGuard};

use marconi_gpu::phys::{BackedPool, MemfdBackend, PhysicalMemory, DEFAULT_GRANULARITY};
use marconi_gpu::snapshot::{
    plan_promotion, CopyBatch, PromoteMode, SlotPair, SnapshotBackend, SnapshotError, StateArena,
};
use marconi_gpu::{
    AllocError, DualPool, DualPoolConfig, MigrationPolicy, PoolAllocator, PoolKind, VirtualHandle,
};

use crate::cache::marconi_copy_order;
use crate::handle::{borrow, handle_kind, publish, release};
use crate::status::{
    boundary, boundary_or, check_ptr, in_slice, init_struct, marconi_status, out_slice,
    read_struct, require, versioned, write_versioned, FfiError, FfiResult,
};

/// What backs a pool's units.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum marconi_pool_backend {
    /// No memory: handles and byte offsets only (the engine maps offsets onto
    /// its own tensors). Snapshot operations on such a pool are
    /// MARCONI_STATUS_UNSUPPORTED (use marconi_snapshot_* on the buffer).
    None = 0,
    /// Host memory: one Linux memfd, mapped per pool into an address range
    /// as large as the budget; physical memory follows the pools' capacity
    /// (never more than the budget, a migration included).
    Memfd = 1,
    /// CUDA virtual memory (cuMemCreate/cuMemMap) on device `cuda_device`:
    /// resolved addresses are device pointers. A library built without the
    /// `cuda` feature, or a machine without a usable driver, refuses it with
    /// MARCONI_STATUS_UNSUPPORTED.
    Cuda = 2,
}

/// When capacity moves between the two pools.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum marconi_pool_migration {
    /// Never: the split given at creation stays (SGLang's static split).
    Static = 0,
    /// AVMP (paper §3.2): an allocation that does not fit in its pool moves
    /// migration_batch_units units' worth of capacity from the other pool's
    /// free tail, then retries once.
    Avmp = 1,
}

/// The two pools.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum marconi_pool_kind {
    /// Attention KV pages.
    Kv = 0,
    /// Recurrent (Mamba/SSM) state slots.
    State = 1,
}

/// How marconi_snapshot_promote / marconi_pool_promote_state make the
/// accepted candidate the request's state.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum marconi_promote_mode {
    /// No bytes move: the request's state is now the candidate's slot (the
    /// engine updates its request -> slot table).
    Swap = 0,
    /// The candidate's state is copied into the request's slot.
    CopyInto = 1,
}

/// Everything a pool is built from. Versioned by size: set struct_size with
/// marconi_pool_config_init, then change fields.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct marconi_pool_config {
    /// sizeof(marconi_pool_config) as the caller compiled it.
    pub struct_size: u32,
    /// A marconi_pool_backend value (default MARCONI_POOL_BACKEND_MEMFD).
    pub backend: u32,
    /// Bytes of both pools together. Memfd and CUDA round it down to whole
    /// chunks (chunk_bytes); at least one chunk.
    pub budget_bytes: u64,
    /// Bytes of one KV page (all attention layers' K and V of page_size
    /// tokens, as the engine lays them out). Not 0.
    pub kv_page_bytes: u64,
    /// Bytes of one recurrent-state slot (all recurrent layers). Not 0.
    pub state_slot_bytes: u64,
    /// Share of the budget given to the state pool at creation, strictly
    /// between 0 and 1 (default 0.5). Memfd and CUDA round the state share
    /// down to whole chunks.
    pub state_fraction: f64,
    /// A marconi_pool_migration value (default MARCONI_POOL_MIGRATION_AVMP).
    pub migration: u32,
    /// Donor units moved per AVMP migration; 0 means 128 (the paper's).
    pub migration_batch_units: u32,
    /// Memfd chunk size (a multiple of the OS page size); 0 means 2 MiB.
    /// CUDA uses the device's granularity and ignores it.
    pub chunk_bytes: u64,
    /// CUDA device ordinal (backend CUDA only).
    pub cuda_device: u32,
    /// Must be 0.
    pub reserved: u32,
}
versioned!(marconi_pool_config, POOL_CONFIG_V1_SIZE);

impl marconi_pool_config {
    fn defaults() -> Self {
        marconi_pool_config {
            struct_size: std::mem::size_of::<Self>() as u32,
            backend: marconi_pool_backend::Memfd as u32,
            budget_bytes: 0,
            kv_page_bytes: 0,
            state_slot_bytes: 0,
            state_fraction: 0.5,
            migration: marconi_pool_migration::Avmp as u32,
            migration_batch_units: 0,
            chunk_bytes: 0,
            cuda_device: 0,
            reserved: 0,
        }
    }
}

/// Smallest struct_size of marconi_pool_config (its first version).
const POOL_CONFIG_V1_SIZE: usize = std::mem::size_of::<marconi_pool_config>();

/// Where a live handle's unit is.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct marconi_unit_location {
    /// The unit's first byte: a host address (memfd), a device address
    /// (CUDA), or 0 (backend NONE). Valid while the handle is live: a
    /// migration never moves or unmaps a live unit; freeing the handle or
    /// the pool ends it.
    pub address: u64,
    /// Byte offset of the unit from the start of its pool's range.
    pub byte_offset: u64,
    /// Bytes of the unit.
    pub unit_bytes: u64,
    /// A marconi_pool_kind value.
    pub kind: u32,
    /// The unit's index in its pool (byte_offset / unit_bytes).
    pub index: u32,
}

/// The outcome of one capacity migration.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct marconi_migration {
    /// A marconi_pool_kind value: the pool that gave capacity.
    pub donor: u32,
    /// Units removed from the donor's tail.
    pub donor_units: u32,
    /// Units appended to the other pool.
    pub recipient_units: u32,
    /// Must be ignored (padding made explicit).
    pub reserved: u32,
    /// Bytes the donor gave up.
    pub donor_bytes: u64,
}

/// Counters and gauges of a pool. Versioned by size: set struct_size to
/// sizeof(marconi_pool_stats) before calling marconi_pool_get_stats.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct marconi_pool_stats {
    /// sizeof(marconi_pool_stats) as the caller compiled it.
    pub struct_size: u32,
    /// The marconi_pool_backend in use.
    pub backend: u32,
    /// The budget in force (after rounding to chunks).
    pub budget_bytes: u64,
    /// Bytes of a KV unit and of a state unit.
    pub kv_unit_bytes: u64,
    /// Bytes of a state unit.
    pub state_unit_bytes: u64,
    /// KV pool capacity in units.
    pub kv_capacity: u64,
    /// KV units free.
    pub kv_free: u64,
    /// State pool capacity in units.
    pub state_capacity: u64,
    /// State units free.
    pub state_free: u64,
    /// Migrations done.
    pub migrations: u64,
    /// Bytes the donors gave up over all migrations.
    pub bytes_migrated: u64,
    /// Physical chunks moved from one pool to the other (memfd, CUDA).
    pub chunks_moved: u64,
    /// Chunks mapped now (memfd, CUDA; 0 for NONE).
    pub mapped_chunks: u64,
    /// Chunks the budget holds (memfd, CUDA; 0 for NONE).
    pub budget_chunks: u64,
    /// Physical bytes committed now: the memfd's st_blocks * 512 (memory
    /// actually written), created chunks on CUDA, 0 for NONE. Never more
    /// than budget_bytes.
    pub physical_bytes: u64,
    /// Allocate and free calls served (the allocator's logical clock).
    pub ops: u64,
    /// KV units retired: freed at their last generation, never allocated
    /// again (not counted in kv_capacity).
    pub kv_retired: u64,
    /// State units retired (not counted in state_capacity).
    pub state_retired: u64,
}

/// One state copy between two state handles of a pool (or of a cache over
/// pools): the state behind src_state into the unit behind dst_state.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct marconi_state_copy {
    /// The state handle to read.
    pub src_state: u64,
    /// The state handle to write.
    pub dst_state: u64,
}

/// Smallest struct_size accepted by marconi_pool_get_stats (up to budget_bytes).
const POOL_STATS_MIN_SIZE: usize = 16;

/// The state buffer of marconi_snapshot_*: a layer-major tensor
/// `[layers][slots][slot_bytes]` of host memory (layers 1: one plane). Slot
/// `s`'s state is its slot_bytes in every layer.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct marconi_state_buffer {
    /// First byte of the tensor; layers * slots * slot_bytes bytes.
    pub base: *mut u8,
    /// Bytes of one slot in one layer.
    pub slot_bytes: usize,
    /// Slots per layer.
    pub slots: u32,
    /// Layers (planes); at least 1.
    pub layers: u32,
}

pub(crate) enum Backing {
    Plain(DualPool),
    Memfd(BackedPool<MemfdBackend>),
    #[cfg(feature = "cuda")]
    Cuda(BackedPool<CudaPhysical>, CudaCopier),
}

/// A pool as built from a marconi_pool_config (shared with the cache over
/// pools, which wraps the same backings).
pub(crate) type Built = Backing;

impl Backing {
    fn alloc(&self) -> &dyn PoolAllocator {
        match self {
            Backing::Plain(p) => p,
            Backing::Memfd(p) => p,
            #[cfg(feature = "cuda")]
            Backing::Cuda(p, _) => p,
        }
    }

    /// The logical two-pool allocator under the backing.
    fn dual(&self) -> &DualPool {
        match self {
            Backing::Plain(p) => p,
            Backing::Memfd(p) => p.pool(),
            #[cfg(feature = "cuda")]
            Backing::Cuda(p, _) => p.pool(),
        }
    }

    fn alloc_mut(&mut self) -> &mut dyn PoolAllocator {
        match self {
            Backing::Plain(p) => p,
            Backing::Memfd(p) => p,
            #[cfg(feature = "cuda")]
            Backing::Cuda(p, _) => p,
        }
    }
}

/// A pool handle: opaque to C. Create with marconi_pool_new, free with
/// marconi_pool_free.
///
/// Unit handles (uint64_t; the same for a cache over pools) are opaque
/// values; their layout is not part of the ABI. What holds, for the life of
/// the process:
///  - 0 is never a live handle, and every handle is below 2^63 (it fits an
///    int64_t, e.g. a torch.int64 tensor);
///  - a handle is accepted only by the pool (or cache over pools) that
///    issued it: every live pool has its own pool id inside its handles, so
///    a handle given to another live pool is MARCONI_STATUS_UNKNOWN_HANDLE
///    and the other pool's units are untouched. Pool ids are reused only
///    after 2^20 - 1 pools have been created in the process, the longest
///    freed first; a handle of a freed pool must not be used anyway;
///  - a handle whose unit was freed (or evicted) is refused: as
///    MARCONI_STATUS_DOUBLE_FREE until the unit is allocated again, then as
///    MARCONI_STATUS_UNKNOWN_HANDLE, however many times the unit is reused.
///    Each unit has at least 2^10 - 1 generations (2^42 handles per pool,
///    split between unit index and generation); a unit freed at its last
///    generation is retired, never allocated again, and no longer counted
///    in its pool's capacity (marconi_pool_stats.kv_retired,
///    state_retired). A handle value is therefore never issued twice by one
///    pool.
pub struct marconi_pool {
    inner: Mutex<PoolInner>,
}
handle_kind!(marconi_pool, Pool, "marconi_pool");

struct PoolInner {
    backing: Backing,
    backend: marconi_pool_backend,
    budget: u64,
}

impl marconi_pool {
    fn lock(&self) -> FfiResult<MutexGuard<'_, PoolInner>> {
        self.inner.lock().map_err(|_| {
            FfiError::new(
                marconi_status::Poisoned,
                "the pool is unusable after an earlier internal panic",
            )
        })
    }
}

/// The marconi_status of an allocator error.
pub(crate) fn alloc_err(e: AllocError) -> FfiError {
    let status = match &e {
        AllocError::OutOfCapacity { .. } => marconi_status::OutOfMemory,
        AllocError::StaleHandle(_)
        | AllocError::ForeignHandle(_)
        | AllocError::WrongPool { .. } => marconi_status::UnknownHandle,
        AllocError::DoubleFree(_) => marconi_status::DoubleFree,
        AllocError::MigrationRefused { .. } => marconi_status::OutOfMemory,
        AllocError::Physical(_) => marconi_status::BackendFailure,
        AllocError::InvalidConfig(_) => marconi_status::InvalidConfig,
    };
    FfiError::new(status, e.to_string())
}

/// The error of `handles[i]`: its status, the detail prefixed with the index.
pub(crate) fn at_handle(i: usize, e: FfiError) -> FfiError {
    FfiError::new(e.status, format!("handles[{i}]: {}", e.detail))
}

/// The count of an allocation of `n` units into a buffer of `cap`:
/// MARCONI_STATUS_BUFFER_TOO_SMALL when it does not hold them,
/// MARCONI_STATUS_INVALID_ARGUMENT past u32; None for 0 (nothing to do).
pub(crate) fn alloc_count(n: usize, cap: usize) -> FfiResult<Option<u32>> {
    if cap < n {
        return Err(FfiError::new(
            marconi_status::BufferTooSmall,
            format!("out holds {cap} handles, {n} asked for"),
        ));
    }
    let n32 = u32::try_from(n).map_err(|_| {
        FfiError::new(
            marconi_status::InvalidArgument,
            format!("n {n} is more units than a pool can hold"),
        )
    })?;
    Ok((n32 > 0).then_some(n32))
}

fn snap_err(e: SnapshotError) -> FfiError {
    FfiError::new(marconi_status::InvalidArgument, e.to_string())
}

pub(crate) fn kind_of(kind: u32) -> FfiResult<PoolKind> {
    match kind {
        0 => Ok(PoolKind::Kv),
        1 => Ok(PoolKind::Ssm),
        k => Err(FfiError::new(
            marconi_status::InvalidArgument,
            format!("kind {k} is not a marconi_pool_kind (0 KV, 1 STATE)"),
        )),
    }
}

pub(crate) fn kind_value(kind: PoolKind) -> u32 {
    match kind {
        PoolKind::Kv => marconi_pool_kind::Kv as u32,
        PoolKind::Ssm => marconi_pool_kind::State as u32,
    }
}

fn invalid_config(detail: impl Into<String>) -> FfiError {
    FfiError::new(marconi_status::InvalidConfig, detail)
}

/// The checked DualPool configuration of `c` for chunks of `chunk` bytes
/// (None: no rounding), and the budget in force.
fn dual_config(c: &marconi_pool_config, chunk: Option<u64>) -> FfiResult<(DualPoolConfig, u64)> {
    if c.reserved != 0 {
        return Err(invalid_config("reserved must be 0"));
    }
    if c.kv_page_bytes == 0 || c.state_slot_bytes == 0 {
        return Err(invalid_config(format!(
            "kv_page_bytes {} and state_slot_bytes {} must both be non-zero",
            c.kv_page_bytes, c.state_slot_bytes
        )));
    }
    if !(c.state_fraction > 0.0 && c.state_fraction < 1.0) {
        return Err(invalid_config(format!(
            "state_fraction {} is not strictly between 0 and 1",
            c.state_fraction
        )));
    }
    // Budgets past 2^52 bytes would lose exactness in the split's f64.
    if c.budget_bytes == 0 || c.budget_bytes > 1 << 52 {
        return Err(invalid_config(format!(
            "budget_bytes {} is not in 1..=2^52",
            c.budget_bytes
        )));
    }
    // A unit larger than the whole budget would leave its pool at capacity 0
    // for ever.
    if c.kv_page_bytes > c.budget_bytes || c.state_slot_bytes > c.budget_bytes {
        return Err(invalid_config(format!(
            "kv_page_bytes {} and state_slot_bytes {} must each fit budget_bytes {}",
            c.kv_page_bytes, c.state_slot_bytes, c.budget_bytes
        )));
    }
    let policy = match c.migration {
        0 => MigrationPolicy::Static,
        1 => MigrationPolicy::forced(if c.migration_batch_units == 0 {
            128
        } else {
            c.migration_batch_units
        }),
        m => {
            return Err(invalid_config(format!(
                "migration {m} is not a marconi_pool_migration (0 STATIC, 1 AVMP)"
            )))
        }
    };
    let (total, ratio) = match chunk {
        None => (c.budget_bytes, c.state_fraction),
        Some(g) => {
            let chunks = c.budget_bytes / g;
            if chunks < 2 {
                return Err(invalid_config(format!(
                    "budget_bytes {} holds {chunks} chunks of {g} bytes; two pools need at least 2",
                    c.budget_bytes
                )));
            }
            #[expect(
                clippy::cast_possible_truncation,
                clippy::cast_sign_loss,
                clippy::cast_precision_loss,
                reason = "chunk counts are far below 2^52; floor of a positive product"
            )]
            let state_chunks =
                ((chunks as f64 * c.state_fraction).floor() as u64).clamp(1, chunks - 1);
            // DualPool takes floor(total * ratio) bytes for the state pool:
            // half a byte above the chunk boundary floors onto it exactly.
            #[expect(
                clippy::cast_precision_loss,
                reason = "byte counts are at most 2^52, exact in f64"
            )]
            let ratio = ((state_chunks * g) as f64 + 0.5) / (chunks * g) as f64;
            (chunks * g, ratio)
        }
    };
    Ok((
        DualPoolConfig {
            total_bytes: total,
            ssm_ratio: ratio,
            kv_unit: c.kv_page_bytes,
            ssm_unit: c.state_slot_bytes,
            policy,
        },
        total,
    ))
}

/// Builds the backing a marconi_pool_config describes. `lowest_first`:
/// allocate the lowest free units first (the cache over pools wants freed
/// units to gather at each pool's tail, where migration takes them).
pub(crate) fn chunked_dual_pool(
    c: &marconi_pool_config,
    lowest_first: bool,
) -> FfiResult<(marconi_pool_backend, Built)> {
    let backend = match c.backend {
        0 => marconi_pool_backend::None,
        1 => marconi_pool_backend::Memfd,
        2 => marconi_pool_backend::Cuda,
        b => {
            return Err(invalid_config(format!(
                "backend {b} is not a marconi_pool_backend (0 NONE, 1 MEMFD, 2 CUDA)"
            )))
        }
    };
    let new_dual = |cfg: DualPoolConfig| -> FfiResult<DualPool> {
        let mut d = DualPool::new("pool", cfg).map_err(alloc_err)?;
        if lowest_first {
            d.set_lowest_first();
        }
        Ok(d)
    };
    let backing = match backend {
        marconi_pool_backend::None => {
            let (cfg, _) = dual_config(c, None)?;
            Backing::Plain(new_dual(cfg)?)
        }
        marconi_pool_backend::Memfd => {
            let g = if c.chunk_bytes == 0 {
                DEFAULT_GRANULARITY as u64
            } else {
                c.chunk_bytes
            };
            let g_usize = usize::try_from(g)
                .map_err(|_| invalid_config(format!("chunk_bytes {g} is absurd")))?;
            let (cfg, total) = dual_config(c, Some(g))?;
            let chunks = usize::try_from(total / g).unwrap_or(usize::MAX);
            let mem = MemfdBackend::with_granularity(chunks, g_usize).map_err(|e| {
                FfiError::new(
                    marconi_status::InvalidConfig,
                    format!("memfd backend with {chunks} chunks of {g} bytes: {e}"),
                )
            })?;
            Backing::Memfd(BackedPool::new(new_dual(cfg)?, mem).map_err(|e| {
                FfiError::new(
                    marconi_status::BackendFailure,
                    format!("memfd backing: {e}"),
                )
            })?)
        }
        marconi_pool_backend::Cuda => cuda_backing(c, &new_dual)?,
    };
    Ok((backend, backing))
}

fn build(c: &marconi_pool_config) -> FfiResult<PoolInner> {
    let (backend, backing) = chunked_dual_pool(c, false)?;
    let budget = backing.dual().total_bytes();
    Ok(PoolInner {
        backing,
        backend,
        budget,
    })
}

#[cfg(not(feature = "cuda"))]
fn cuda_backing(
    c: &marconi_pool_config,
    _: &dyn Fn(DualPoolConfig) -> FfiResult<DualPool>,
) -> FfiResult<Backing> {
    // The other fields are still checked, so a config is judged the same way
    // whatever the build.
    dual_config(c, None)?;
    Err(FfiError::new(
        marconi_status::Unsupported,
        "backend CUDA: this libmarconi was built without the `cuda` feature",
    ))
}

#[cfg(feature = "cuda")]
fn cuda_backing(
    c: &marconi_pool_config,
    new_dual: &dyn Fn(DualPoolConfig) -> FfiResult<DualPool>,
) -> FfiResult<Backing> {
    dual_config(c, None)?;
    let (pool, copier) = cuda::new_pool(c, new_dual)?;
    Ok(Backing::Cuda(pool, copier))
}

#[cfg(feature = "cuda")]
pub(crate) use cuda::CudaCopier;
#[cfg(feature = "cuda")]
use marconi_gpu::cuda::phys::CudaPhysical;

#[cfg(feature = "cuda")]
mod cuda {
    //! The CUDA backend: a BackedPool over cuMemMap and the snapshot kernel.
    use std::sync::Arc;

    use marconi_gpu::cuda::phys::CudaPhysical;
    use marconi_gpu::cuda::snapshot::{CudaStateArena, DevicePlane, SnapshotKernels};
    use marconi_gpu::cuda::{driver_available, CudaError, Device, Stream};
    use marconi_gpu::phys::{BackedPool, PhysicalMemory};
    use marconi_gpu::snapshot::{CopyBatch, SlotPair, SnapshotBackend};
    use marconi_gpu::{DualPool, DualPoolConfig, PoolAllocator, PoolKind};

    use super::{dual_config, marconi_pool_config, snap_err};
    use crate::status::{marconi_status, FfiError, FfiResult};

    /// The snapshot kernel and its stream, for copies between state units.
    pub(crate) struct CudaCopier {
        kernels: Arc<SnapshotKernels>,
        stream: Arc<Stream>,
    }

    fn unsupported(e: &CudaError) -> FfiError {
        FfiError::new(marconi_status::Unsupported, format!("backend CUDA: {e}"))
    }

    fn failure(e: &CudaError) -> FfiError {
        FfiError::new(marconi_status::BackendFailure, format!("backend CUDA: {e}"))
    }

    pub(super) fn new_pool(
        c: &marconi_pool_config,
        new_dual: &dyn Fn(DualPoolConfig) -> FfiResult<DualPool>,
    ) -> FfiResult<(BackedPool<CudaPhysical>, CudaCopier)> {
        driver_available().map_err(|e| unsupported(&e))?;
        let device = Device::open(c.cuda_device as usize).map_err(|e| unsupported(&e))?;
        if !device.supports_vmm().map_err(|e| failure(&e))? {
            return Err(FfiError::new(
                marconi_status::Unsupported,
                "backend CUDA: the device does not support virtual memory management",
            ));
        }
        // The granularity is the device's: probe it with a backend of one chunk.
        let g = CudaPhysical::new(&device, 1)
            .map_err(|e| failure(&e))?
            .granularity() as u64;
        let (cfg, total) = dual_config(c, Some(g))?;
        let chunks = usize::try_from(total / g).unwrap_or(usize::MAX);
        let phys = CudaPhysical::new(&device, chunks).map_err(|e| failure(&e))?;
        let pool = BackedPool::new(new_dual(cfg)?, phys).map_err(|e| {
            FfiError::new(marconi_status::BackendFailure, format!("CUDA backing: {e}"))
        })?;
        let kernels = SnapshotKernels::load(&device).map_err(|e| failure(&e))?;
        let stream = Arc::new(Stream::new(&device).map_err(|e| failure(&e))?);
        Ok((pool, CudaCopier { kernels, stream }))
    }

    impl CudaCopier {
        /// Runs a batch of (src, dst) state-unit indices of `pool` and waits
        /// for it.
        pub(crate) fn copy(
            &self,
            pool: &BackedPool<CudaPhysical>,
            pairs: Vec<SlotPair>,
        ) -> FfiResult {
            let slots = pool.extent(PoolKind::Ssm);
            let batch = CopyBatch::new(pairs, slots).map_err(snap_err)?;
            if batch.is_empty() {
                return Ok(());
            }
            let base = pool
                .backend()
                .base(pool.reservation(PoolKind::Ssm))
                .map_err(|e| FfiError::new(marconi_status::BackendFailure, e.to_string()))?;
            let slot_bytes = usize::try_from(pool.unit_bytes(PoolKind::Ssm))
                .map_err(|_| FfiError::new(marconi_status::InvalidArgument, "unit too large"))?;
            // SAFETY: the state pool's first `slots` units are mapped device
            // memory of this context (BackedPool maps its capacity), and the
            // arena lives only for this call, under the owner's lock, which
            // also keeps migrations from unmapping them meanwhile.
            let mut arena = unsafe {
                CudaStateArena::new(
                    &self.kernels,
                    &self.stream,
                    vec![DevicePlane { base, slot_bytes }],
                    slots,
                )
            }
            .map_err(|e| failure(&e))?;
            arena.copy(&batch).map_err(|e| failure(&e))?;
            arena.synchronize().map_err(|e| failure(&e))
        }
    }
}

/// Runs a batch of (src, dst) state-unit indices of a memfd pool on the
/// host (a StateArena over the state pool's mapping).
pub(crate) fn copy_states_in(p: &BackedPool<MemfdBackend>, pairs: Vec<SlotPair>) -> FfiResult {
    let slots = p.extent(PoolKind::Ssm);
    let batch = CopyBatch::new(pairs, slots).map_err(snap_err)?;
    if batch.is_empty() {
        return Ok(());
    }
    let base = p
        .backend()
        .base(p.reservation(PoolKind::Ssm))
        .map_err(|e| FfiError::new(marconi_status::BackendFailure, e.to_string()))?;
    let slot_bytes = usize::try_from(p.unit_bytes(PoolKind::Ssm))
        .map_err(|_| FfiError::new(marconi_status::InvalidArgument, "state unit too large"))?;
    // SAFETY: the state pool's first `slots` units are mapped read-write
    // (BackedPool maps chunks covering its extent); the arena lives only
    // for this call, under the owner's lock, so no migration unmaps them
    // meanwhile. The engine's own accesses to the slots named here are its
    // business, as with memcpy.
    let mut arena = unsafe { StateArena::from_raw_parts(&[(base as *mut u8, slot_bytes)], slots) }
        .map_err(snap_err)?;
    arena.copy(&batch).map_err(snap_err)
}

/// Where the live handle `raw` of `a` is; `address(kind, offset)` maps a
/// unit's offset to its address.
pub(crate) fn location(
    a: &dyn PoolAllocator,
    raw: u64,
    address: &dyn Fn(PoolKind, u64) -> u64,
) -> FfiResult<marconi_unit_location> {
    let h = VirtualHandle::from_raw(raw);
    let loc = a.resolve(h).map_err(alloc_err)?;
    Ok(marconi_unit_location {
        address: address(loc.table, loc.byte_offset),
        byte_offset: loc.byte_offset,
        unit_bytes: loc.unit_bytes,
        kind: kind_value(h.pool()),
        index: a.unit_index(h),
    })
}

/// The state-unit index of `raw` in `a`, after checking it is a live handle
/// of the state pool; `what` names it in errors.
pub(crate) fn state_index(
    a: &dyn PoolAllocator,
    raw: u64,
    what: std::fmt::Arguments<'_>,
) -> FfiResult<u32> {
    let h = VirtualHandle::from_raw(raw);
    if h.pool() != PoolKind::Ssm {
        return Err(FfiError::new(
            marconi_status::UnknownHandle,
            format!("{what}: handle {raw:#018x} is a KV page, not a state slot"),
        ));
    }
    a.resolve(h).map_err(|e| {
        let e = alloc_err(e);
        FfiError::new(e.status, format!("{what}: {}", e.detail))
    })?;
    Ok(a.unit_index(h))
}

impl PoolInner {
    fn address(&self, kind: PoolKind, byte_offset: u64) -> u64 {
        match &self.backing {
            Backing::Plain(_) => 0,
            Backing::Memfd(p) => p
                .backend()
                .base(p.reservation(kind))
                .map_or(0, |b| b as u64 + byte_offset),
            #[cfg(feature = "cuda")]
            Backing::Cuda(p, _) => p
                .backend()
                .base(p.reservation(kind))
                .map_or(0, |b| b + byte_offset),
        }
    }

    /// The state-unit index of each state handle in `handles`, after checking
    /// every one is live and of the state pool.
    fn state_indices(&self, handles: &[u64], what: &str) -> FfiResult<Vec<u32>> {
        let a = self.backing.alloc();
        handles
            .iter()
            .enumerate()
            .map(|(i, &raw)| state_index(a, raw, format_args!("{what}[{i}]")))
            .collect()
    }

    /// Runs a batch of (src, dst) state-unit indices on the backend.
    fn run_copy(&mut self, pairs: Vec<SlotPair>) -> FfiResult {
        let slots = self.backing.alloc().extent(PoolKind::Ssm);
        // Validated here for every backend, so NONE refuses a bad batch as
        // the others do before saying it cannot copy.
        let batch = CopyBatch::new(pairs, slots).map_err(snap_err)?;
        if batch.is_empty() {
            return Ok(());
        }
        match &mut self.backing {
            Backing::Plain(_) => Err(FfiError::new(
                marconi_status::Unsupported,
                "this pool has no memory (backend NONE): run the copies on your own buffer \
                 (marconi_snapshot_copy)",
            )),
            Backing::Memfd(p) => copy_states_in(p, batch.pairs().to_vec()),
            #[cfg(feature = "cuda")]
            Backing::Cuda(p, copier) => copier.copy(p, batch.pairs().to_vec()),
        }
    }
}

/// Runs `f` on the memfd backing of `pool` under its lock (the host tier's
/// moves read and write a device pool's units there). Backend NONE has no
/// memory and CUDA units are not host addressable: both are
/// MARCONI_STATUS_UNSUPPORTED.
///
/// # Safety
///
/// `pool` is NULL or a live handle from marconi_pool_new.
pub(crate) unsafe fn with_memfd<R>(
    pool: *const marconi_pool,
    f: impl FnOnce(&mut BackedPool<MemfdBackend>) -> FfiResult<R>,
) -> FfiResult<R> {
    // SAFETY: forwarded.
    let p = unsafe { pool_ref(pool) }?;
    let mut g = p.lock()?;
    match &mut g.backing {
        Backing::Memfd(b) => f(b),
        Backing::Plain(_) => Err(FfiError::new(
            marconi_status::Unsupported,
            "device pool has no memory (backend NONE): resolve the host units and copy on your own",
        )),
        #[cfg(feature = "cuda")]
        Backing::Cuda(..) => Err(FfiError::new(
            marconi_status::Unsupported,
            "device pool is CUDA memory: resolve the host units (pinned) and copy them on your stream",
        )),
    }
}

/// Checks the pool pointer and borrows the handle.
///
/// # Safety
///
/// `pool` is NULL or a live handle from marconi_pool_new.
unsafe fn pool_ref<'a>(pool: *const marconi_pool) -> FfiResult<&'a marconi_pool> {
    // SAFETY: the registry check reads nothing behind the pointer.
    unsafe { borrow(pool, "pool") }
}

/// Writes the default configuration into `*cfg` (backend MEMFD, AVMP
/// migration with batches of 128 units, state_fraction 0.5, chunk 2 MiB;
/// budget_bytes, kv_page_bytes and state_slot_bytes 0: the caller sets them)
/// and sets cfg->struct_size to `struct_size`, the caller's
/// sizeof(marconi_pool_config). Bytes past this library's struct are zeroed.
#[no_mangle]
pub unsafe extern "C" fn marconi_pool_config_init(
    cfg: *mut marconi_pool_config,
    struct_size: usize,
) -> marconi_status {
    // SAFETY: cfg is NULL or has struct_size writable bytes (contract).
    boundary("marconi_pool_config_init", || unsafe {
        init_struct(cfg, struct_size, "cfg")
    })
}

/// Creates a pool from `*cfg` and writes the handle to `*out` (free it with
/// marconi_pool_free). MARCONI_STATUS_INVALID_CONFIG with the reason in
/// marconi_last_error for a configuration that cannot make a pool (a zero
/// budget or unit size, a state_fraction outside (0, 1), a budget of fewer
/// than two chunks, a unit larger than the budget, more than 2^32 - 1
/// units, 2^20 - 1 pools live at once, ...);
/// MARCONI_STATUS_UNSUPPORTED for backend CUDA in a build without CUDA or
/// on a machine without a usable driver; MARCONI_STATUS_BACKEND_FAILURE when
/// the operating system or the driver refuses the memory.
#[no_mangle]
pub unsafe extern "C" fn marconi_pool_new(
    cfg: *const marconi_pool_config,
    out: *mut *mut marconi_pool,
) -> marconi_status {
    boundary("marconi_pool_new", || {
        require!(cfg);
        require!(out);
        check_ptr!(cfg);
        check_ptr!(out);
        // SAFETY: cfg is non-NULL and aligned; its size contract is the caller's.
        let c = unsafe { read_struct(cfg) }?;
        let inner = build(&c)?;
        let handle = marconi_pool {
            inner: Mutex::new(inner),
        };
        // SAFETY: out is non-NULL, aligned and writable (checked, contract).
        unsafe { publish(handle, out) };
        Ok(())
    })
}

/// Frees a pool and its memory (every address it resolved becomes invalid).
/// NULL is a no-op.
#[no_mangle]
pub unsafe extern "C" fn marconi_pool_free(pool: *mut marconi_pool) {
    boundary_or("marconi_pool_free", (), || {
        // SAFETY: no other call runs on it (contract); anything but a live
        // handle of its kind is left alone.
        unsafe { release(pool) };
    })
}

/// Allocates `n` units of pool `kind` (a marconi_pool_kind) and writes their
/// handles to `out[0..n]`; all or nothing. With AVMP migration, an
/// allocation that does not fit first moves capacity from the other pool's
/// free tail (only when that makes room for all n), then retries once.
/// MARCONI_STATUS_OUT_OF_MEMORY when the units
/// are not there (nothing allocated, the detail says how many are free);
/// MARCONI_STATUS_BUFFER_TOO_SMALL when cap < n. n 0 succeeds and writes
/// nothing.
#[no_mangle]
pub unsafe extern "C" fn marconi_pool_allocate(
    pool: *const marconi_pool,
    kind: u32,
    n: usize,
    out: *mut u64,
    cap: usize,
) -> marconi_status {
    boundary("marconi_pool_allocate", || {
        require!(pool);
        require!(out, cap = cap);
        // SAFETY: the caller passes a live handle or NULL.
        let p = unsafe { pool_ref(pool) }?;
        // SAFETY: buffer contract of the header.
        let out = unsafe { out_slice(out, cap, "out") }?;
        let kind = kind_of(kind)?;
        let Some(n32) = alloc_count(n, out.len())? else {
            return Ok(());
        };
        let mut g = p.lock()?;
        let mut got = Vec::with_capacity(n);
        // Migrate only when one migration makes room for all n units: a
        // migration followed by a failed allocation would change the pools
        // in a refused call.
        let a = g.backing.alloc();
        let (free, cap) = (a.free_units(kind), a.capacity(kind));
        let room = free >= n32 || {
            let d = g.backing.dual();
            d.policy_allows(kind)
                .and_then(|batch| d.plan_migration(kind, batch))
                .is_ok_and(|(kv, ssm)| {
                    let grown = if kind == PoolKind::Kv { kv } else { ssm };
                    u64::from(free) + u64::from(grown.saturating_sub(cap)) >= u64::from(n32)
                })
        };
        let a = g.backing.alloc_mut();
        if room {
            a.allocate_or_migrate(kind, n32, &mut got).map(drop)
        } else {
            a.allocate(kind, n32, &mut got)
        }
        .map_err(alloc_err)?;
        for (o, h) in out.iter_mut().zip(&got) {
            *o = h.raw();
        }
        Ok(())
    })
}

/// Frees the `n` handles of `handles`; all or nothing: every handle is
/// checked first (live, of this pool, not listed twice), then all are
/// freed. MARCONI_STATUS_DOUBLE_FREE for a handle already freed (and not
/// reused since) or listed twice; MARCONI_STATUS_UNKNOWN_HANDLE for one that
/// is stale (its unit was reused), not from this pool, or 0. The detail
/// names the first bad index. n 0 succeeds.
#[no_mangle]
pub unsafe extern "C" fn marconi_pool_free_units(
    pool: *const marconi_pool,
    handles: *const u64,
    n: usize,
) -> marconi_status {
    boundary("marconi_pool_free_units", || {
        require!(pool);
        require!(handles, len = n);
        // SAFETY: the caller passes a live handle or NULL.
        let p = unsafe { pool_ref(pool) }?;
        // SAFETY: buffer contract of the header.
        let handles = unsafe { in_slice(handles, n, "handles") }?;
        let mut g = p.lock()?;
        let mut seen = HashSet::with_capacity(handles.len());
        for (i, &raw) in handles.iter().enumerate() {
            if !seen.insert(raw) {
                return Err(FfiError::new(
                    marconi_status::DoubleFree,
                    format!("handles[{i}]: {raw:#018x} is listed twice"),
                ));
            }
            g.backing
                .alloc()
                .resolve(VirtualHandle::from_raw(raw))
                .map_err(|e| at_handle(i, alloc_err(e)))?;
        }
        let a = g.backing.alloc_mut();
        for &raw in handles {
            // Checked live above, under the same lock: cannot fail.
            a.free(VirtualHandle::from_raw(raw)).map_err(alloc_err)?;
        }
        Ok(())
    })
}

/// Resolves each of the `n` handles of `handles` to where its unit lies and
/// writes `out[0..n]` (see marconi_unit_location for how long an address
/// stays valid). All or nothing: a handle that is not live is
/// MARCONI_STATUS_UNKNOWN_HANDLE or MARCONI_STATUS_DOUBLE_FREE (freed) and
/// nothing is written. MARCONI_STATUS_BUFFER_TOO_SMALL when cap < n.
#[no_mangle]
pub unsafe extern "C" fn marconi_pool_resolve(
    pool: *const marconi_pool,
    handles: *const u64,
    n: usize,
    out: *mut marconi_unit_location,
    cap: usize,
) -> marconi_status {
    boundary("marconi_pool_resolve", || {
        require!(pool);
        require!(handles, len = n);
        require!(out, cap = cap);
        // SAFETY: the caller passes a live handle or NULL.
        let p = unsafe { pool_ref(pool) }?;
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
        let a = g.backing.alloc();
        let mut locs = Vec::with_capacity(n);
        for (i, &raw) in handles.iter().enumerate() {
            let loc = location(a, raw, &|k, off| g.address(k, off)).map_err(|e| at_handle(i, e))?;
            locs.push(loc);
        }
        out[..n].copy_from_slice(&locs);
        Ok(())
    })
}

/// Moves capacity toward pool `recipient` (a marconi_pool_kind) from the
/// other pool's free tail: `donor_units` units of the donor, or its AVMP
/// batch when donor_units is 0, and writes what moved to `*out` (may be
/// NULL). MARCONI_STATUS_OUT_OF_MEMORY when the migration is refused (the
/// donor's tail is in use or too small, the recipient would exceed the
/// budget; the detail says which), MARCONI_STATUS_UNSUPPORTED for a static
/// pool. The pools are unchanged on failure.
#[no_mangle]
pub unsafe extern "C" fn marconi_pool_migrate(
    pool: *const marconi_pool,
    recipient: u32,
    donor_units: u32,
    out: *mut marconi_migration,
) -> marconi_status {
    boundary("marconi_pool_migrate", || {
        require!(pool);
        // SAFETY: the caller passes a live handle or NULL.
        let p = unsafe { pool_ref(pool) }?;
        if !out.is_null() {
            check_ptr!(out);
        }
        let recipient = kind_of(recipient)?;
        let mut g = p.lock()?;
        let a = g.backing.alloc_mut();
        let m = if donor_units == 0 {
            a.migrate_toward(recipient)
        } else {
            a.migrate_units_toward(recipient, donor_units)
        };
        let m = m.map_err(|e| {
            if let AllocError::MigrationRefused {
                reason: marconi_gpu::MigrationRefusal::Unsupported,
                ..
            } = e
            {
                FfiError::new(
                    marconi_status::Unsupported,
                    "this pool has a static split (migration STATIC)",
                )
            } else {
                alloc_err(e)
            }
        })?;
        if !out.is_null() {
            // SAFETY: non-NULL and aligned (checked), writable by contract.
            unsafe {
                out.write(marconi_migration {
                    donor: kind_value(m.donor),
                    donor_units: m.donor_units,
                    recipient_units: m.recipient_units,
                    reserved: 0,
                    donor_bytes: m.donor_bytes,
                });
            }
        }
        Ok(())
    })
}

/// Writes the pool's counters into `*out`: the caller sets out->struct_size
/// to sizeof(marconi_pool_stats) and the library writes only that many bytes
/// (struct_size below 16 is MARCONI_STATUS_UNSUPPORTED_STRUCT_SIZE).
#[no_mangle]
pub unsafe extern "C" fn marconi_pool_get_stats(
    pool: *const marconi_pool,
    out: *mut marconi_pool_stats,
) -> marconi_status {
    boundary("marconi_pool_get_stats", || {
        require!(pool);
        require!(out);
        // SAFETY: the caller passes a live handle or NULL.
        let p = unsafe { pool_ref(pool) }?;
        check_ptr!(out);
        // SAFETY: out is non-NULL and aligned; it starts with its u32 size.
        let size = unsafe { out.cast::<u32>().read() } as usize;
        if size < POOL_STATS_MIN_SIZE {
            return Err(FfiError::new(
                marconi_status::UnsupportedStructSize,
                format!("stats struct_size {size} is below {POOL_STATS_MIN_SIZE}"),
            ));
        }
        let g = p.lock()?;
        let a = g.backing.alloc();
        let st = a.stats();
        let (chunks_moved, mapped, budget_chunks, physical) = match &g.backing {
            Backing::Plain(_) => (0, 0, 0, 0),
            Backing::Memfd(b) => (
                b.chunks_moved(),
                b.mapped_chunks() as u64,
                b.budget_chunks() as u64,
                b.backend()
                    .physical_bytes()
                    .map_err(|e| FfiError::new(marconi_status::BackendFailure, e.to_string()))?,
            ),
            #[cfg(feature = "cuda")]
            Backing::Cuda(c, _) => (
                c.chunks_moved(),
                c.mapped_chunks() as u64,
                c.budget_chunks() as u64,
                c.backend()
                    .physical_bytes()
                    .map_err(|e| FfiError::new(marconi_status::BackendFailure, e.to_string()))?,
            ),
        };
        let s = marconi_pool_stats {
            struct_size: size.min(u32::MAX as usize) as u32,
            backend: g.backend as u32,
            budget_bytes: g.budget,
            kv_unit_bytes: a.unit_bytes(PoolKind::Kv),
            state_unit_bytes: a.unit_bytes(PoolKind::Ssm),
            kv_capacity: u64::from(a.capacity(PoolKind::Kv)),
            kv_free: u64::from(a.free_units(PoolKind::Kv)),
            state_capacity: u64::from(a.capacity(PoolKind::Ssm)),
            state_free: u64::from(a.free_units(PoolKind::Ssm)),
            migrations: st.rebalance_count,
            bytes_migrated: st.bytes_migrated,
            chunks_moved,
            mapped_chunks: mapped,
            budget_chunks,
            physical_bytes: physical,
            ops: st.ops,
            kv_retired: a.retired_units(PoolKind::Kv),
            state_retired: a.retired_units(PoolKind::Ssm),
        };
        // SAFETY: out has `size` writable bytes (contract), checked above.
        unsafe { write_versioned(&s, out, size) };
        Ok(())
    })
}

/// Copies state slots of the pool's state pool: for each pair, the state
/// behind handle src_state into the unit behind handle dst_state (both state
/// handles, live). The batch is checked whole before any byte moves: every
/// handle live and a state slot (MARCONI_STATUS_UNKNOWN_HANDLE /
/// MARCONI_STATUS_DOUBLE_FREE), no pair copying onto itself, no destination
/// twice, no destination that another pair reads (MARCONI_STATUS_INVALID_ARGUMENT,
/// the detail names the pairs). Memfd copies on the host (in parallel for
/// large batches) and returns when done; CUDA runs one kernel launch and
/// waits for it; backend NONE is MARCONI_STATUS_UNSUPPORTED.
///
/// Thread safety: safe to call concurrently on the same pool (calls are
/// serialised); the engine must not write the slots named meanwhile.
#[no_mangle]
pub unsafe extern "C" fn marconi_pool_copy_states(
    pool: *const marconi_pool,
    pairs: *const marconi_state_copy,
    n: usize,
) -> marconi_status {
    boundary("marconi_pool_copy_states", || {
        require!(pool);
        require!(pairs, len = n);
        // SAFETY: the caller passes a live handle or NULL.
        let p = unsafe { pool_ref(pool) }?;
        // SAFETY: buffer contract of the header.
        let pairs = unsafe { in_slice(pairs, n, "pairs") }?;
        let mut g = p.lock()?;
        let srcs: Vec<u64> = pairs.iter().map(|p| p.src_state).collect();
        let dsts: Vec<u64> = pairs.iter().map(|p| p.dst_state).collect();
        let s = g.state_indices(&srcs, "pairs.src_state")?;
        let d = g.state_indices(&dsts, "pairs.dst_state")?;
        g.run_copy(
            s.iter()
                .zip(&d)
                .map(|(&s, &d)| SlotPair::new(s, d))
                .collect(),
        )
    })
}

/// Copies the state behind handle `src` into each of the n state handles of
/// `dsts` (one batch: a fork for speculative candidates). Same checks and
/// statuses as marconi_pool_copy_states.
///
/// Thread safety: as marconi_pool_copy_states.
#[no_mangle]
pub unsafe extern "C" fn marconi_pool_fork_state(
    pool: *const marconi_pool,
    src: u64,
    dsts: *const u64,
    n: usize,
) -> marconi_status {
    boundary("marconi_pool_fork_state", || {
        require!(pool);
        require!(dsts, len = n);
        // SAFETY: the caller passes a live handle or NULL.
        let p = unsafe { pool_ref(pool) }?;
        // SAFETY: buffer contract of the header.
        let dsts = unsafe { in_slice(dsts, n, "dsts") }?;
        let mut g = p.lock()?;
        let s = g.state_indices(&[src], "src")?[0];
        let d = g.state_indices(dsts, "dsts")?;
        g.run_copy(d.iter().map(|&d| SlotPair::new(s, d)).collect())
    })
}

fn promote_mode(mode: u32) -> FfiResult<PromoteMode> {
    match mode {
        0 => Ok(PromoteMode::Swap),
        1 => Ok(PromoteMode::CopyInto),
        m => Err(FfiError::new(
            marconi_status::InvalidArgument,
            format!("mode {m} is not a marconi_promote_mode (0 SWAP, 1 COPY_INTO)"),
        )),
    }
}

/// Makes `candidates[accepted]` the request's state after speculative
/// decoding and writes the handle now holding it to `*out_state`: SWAP (a
/// marconi_promote_mode) moves no bytes and writes the candidate's handle;
/// COPY_INTO copies the candidate's state into `state` and writes `state`.
/// Either way the engine frees the handles it no longer needs (SWAP: `state`
/// and the other candidates; COPY_INTO: every candidate). Checked first:
/// accepted < n, no handle listed twice, every handle a live state slot.
///
/// Thread safety: as marconi_pool_copy_states.
#[no_mangle]
pub unsafe extern "C" fn marconi_pool_promote_state(
    pool: *const marconi_pool,
    state: u64,
    candidates: *const u64,
    n: usize,
    accepted: usize,
    mode: u32,
    out_state: *mut u64,
) -> marconi_status {
    boundary("marconi_pool_promote_state", || {
        require!(pool);
        require!(candidates, len = n);
        require!(out_state);
        // SAFETY: the caller passes a live handle or NULL.
        let p = unsafe { pool_ref(pool) }?;
        // SAFETY: buffer contract of the header.
        let candidates = unsafe { in_slice(candidates, n, "candidates") }?;
        check_ptr!(out_state);
        let mode = promote_mode(mode)?;
        let mut g = p.lock()?;
        let s = g.state_indices(&[state], "state")?[0];
        let c = g.state_indices(candidates, "candidates")?;
        let slots = g.backing.alloc().extent(PoolKind::Ssm);
        let (promotion, batch) = plan_promotion(s, &c, accepted, mode, slots).map_err(snap_err)?;
        g.run_copy(batch.pairs().to_vec())?;
        let winner = if promotion.copied.is_some() {
            state
        } else {
            candidates[accepted]
        };
        // SAFETY: non-NULL and aligned (checked), writable by contract.
        unsafe { out_state.write(winner) };
        Ok(())
    })
}

/// The host arena over a caller's state buffer.
///
/// # Safety
///
/// `buf` is non-NULL and aligned; buf->base points to layers * slots *
/// slot_bytes bytes nothing else accesses during the call.
unsafe fn caller_arena<'a>(buf: *const marconi_state_buffer) -> FfiResult<StateArena<'a>> {
    // SAFETY: non-NULL and aligned (checked by the caller).
    let b = unsafe { buf.read() };
    let bad = |m: String| FfiError::new(marconi_status::InvalidArgument, m);
    if b.slots == 0 || b.layers == 0 || b.slot_bytes == 0 {
        return Err(bad(format!(
            "state buffer of {} layers x {} slots x {} bytes: none may be 0",
            b.layers, b.slots, b.slot_bytes
        )));
    }
    let len = (b.slot_bytes)
        .checked_mul(b.slots as usize)
        .and_then(|x| x.checked_mul(b.layers as usize))
        .filter(|&x| x <= isize::MAX as usize)
        .ok_or_else(|| {
            bad(format!(
                "state buffer of {} layers x {} slots x {} bytes overflows",
                b.layers, b.slots, b.slot_bytes
            ))
        })?;
    if b.base.is_null() {
        return Err(FfiError::new(
            marconi_status::NullArgument,
            format!("buf->base is NULL but the buffer is {len} bytes"),
        ));
    }
    // SAFETY: base is non-NULL and holds len bytes nothing else touches during
    // the call (caller contract); len fits isize.
    let mem = unsafe { std::slice::from_raw_parts_mut(b.base, len) };
    StateArena::layer_major(mem, b.layers, b.slots).map_err(snap_err)
}

/// Runs a batch of copy orders over a caller's state buffer: for each pair,
/// slot src_slot's state (in every layer) into slot dst_slot. Checked whole
/// first (slots in range, no self copy, no destination twice, no destination
/// that another pair reads: MARCONI_STATUS_INVALID_ARGUMENT naming the
/// pairs); then copied on the host, in parallel for large batches.
///
/// Thread safety: safe from any thread; the caller must not touch the
/// buffer's slots named here during the call.
///
/// # Safety
///
/// Besides the memory rules at the top of marconi.h: `buf->base` holds layers *
/// slots * slot_bytes writable bytes.
#[no_mangle]
pub unsafe extern "C" fn marconi_snapshot_copy(
    buf: *const marconi_state_buffer,
    pairs: *const marconi_copy_order,
    n: usize,
) -> marconi_status {
    boundary("marconi_snapshot_copy", || {
        require!(buf);
        require!(pairs, len = n);
        check_ptr!(buf);
        // SAFETY: buffer contract of the header.
        let pairs = unsafe { in_slice(pairs, n, "pairs") }?;
        // SAFETY: buf checked; its memory contract is the caller's.
        let mut arena = unsafe { caller_arena(buf) }?;
        let batch = CopyBatch::new(
            pairs
                .iter()
                .map(|p| SlotPair::new(p.src_slot, p.dst_slot))
                .collect(),
            arena.slots(),
        )
        .map_err(snap_err)?;
        arena.copy(&batch).map_err(snap_err)
    })
}

/// Copies slot `src`'s state into each of the n slots of `dsts` of a
/// caller's state buffer (a fork); checks as marconi_snapshot_copy.
///
/// Thread safety: as marconi_snapshot_copy.
///
/// # Safety
///
/// Besides the memory rules at the top of marconi.h: `buf->base` holds layers *
/// slots * slot_bytes writable bytes.
#[no_mangle]
pub unsafe extern "C" fn marconi_snapshot_fork(
    buf: *const marconi_state_buffer,
    src: u32,
    dsts: *const u32,
    n: usize,
) -> marconi_status {
    boundary("marconi_snapshot_fork", || {
        require!(buf);
        require!(dsts, len = n);
        check_ptr!(buf);
        // SAFETY: buffer contract of the header.
        let dsts = unsafe { in_slice(dsts, n, "dsts") }?;
        // SAFETY: buf checked; its memory contract is the caller's.
        let mut arena = unsafe { caller_arena(buf) }?;
        arena.fork(src, dsts).map_err(snap_err)
    })
}

/// Promotes `candidates[accepted]` in a caller's state buffer (see
/// marconi_pool_promote_state for SWAP and COPY_INTO) and writes the slot
/// now holding the request's state to `*out_slot`.
///
/// Thread safety: as marconi_snapshot_copy.
///
/// # Safety
///
/// Besides the memory rules at the top of marconi.h: `buf->base` holds layers *
/// slots * slot_bytes writable bytes.
#[no_mangle]
pub unsafe extern "C" fn marconi_snapshot_promote(
    buf: *const marconi_state_buffer,
    state_slot: u32,
    candidates: *const u32,
    n: usize,
    accepted: usize,
    mode: u32,
    out_slot: *mut u32,
) -> marconi_status {
    boundary("marconi_snapshot_promote", || {
        require!(buf);
        require!(candidates, len = n);
        require!(out_slot);
        check_ptr!(buf);
        check_ptr!(out_slot);
        // SAFETY: buffer contract of the header.
        let candidates = unsafe { in_slice(candidates, n, "candidates") }?;
        let mode = promote_mode(mode)?;
        // SAFETY: buf checked; its memory contract is the caller's.
        let mut arena = unsafe { caller_arena(buf) }?;
        let p = arena
            .promote(state_slot, candidates, accepted, mode)
            .map_err(snap_err)?;
        // SAFETY: non-NULL and aligned (checked), writable by contract.
        unsafe { out_slot.write(p.state_slot) };
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(backend: marconi_pool_backend) -> marconi_pool_config {
        let mut c = marconi_pool_config::defaults();
        c.backend = backend as u32;
        c.budget_bytes = 8 << 20;
        c.kv_page_bytes = 64 << 10;
        c.state_slot_bytes = 96 << 10;
        c.chunk_bytes = 1 << 20;
        c
    }

    #[test]
    #[cfg_attr(
        miri,
        ignore = "memfd_create and mmap are foreign calls Miri cannot run"
    )]
    fn memfd_split_is_chunk_aligned_for_any_fraction() {
        for f in [0.01, 0.1, 0.3, 0.33, 0.5, 0.77, 0.99] {
            let mut c = config(marconi_pool_backend::Memfd);
            c.state_fraction = f;
            let inner = build(&c).unwrap_or_else(|e| panic!("fraction {f}: {}", e.detail));
            let Backing::Memfd(b) = &inner.backing else {
                panic!("memfd backing")
            };
            assert!(b.mapped_chunks() <= b.budget_chunks());
            assert_eq!(inner.budget, 8 << 20);
        }
    }

    #[test]
    fn bad_configs_are_refused_with_a_reason() {
        let mut c = config(marconi_pool_backend::Memfd);
        c.budget_bytes = 1 << 20;
        assert_eq!(
            build(&c).err().map(|e| e.status),
            Some(marconi_status::InvalidConfig)
        );
        let mut c = config(marconi_pool_backend::None);
        c.state_fraction = 1.0;
        assert_eq!(
            build(&c).err().map(|e| e.status),
            Some(marconi_status::InvalidConfig)
        );
        let mut c = config(marconi_pool_backend::None);
        c.kv_page_bytes = 0;
        assert_eq!(
            build(&c).err().map(|e| e.status),
            Some(marconi_status::InvalidConfig)
        );
        let mut c = config(marconi_pool_backend::None);
        c.backend = 9;
        assert_eq!(
            build(&c).err().map(|e| e.status),
            Some(marconi_status::InvalidConfig)
        );
        #[cfg(not(feature = "cuda"))]
        {
            let c = config(marconi_pool_backend::Cuda);
            assert_eq!(
                build(&c).err().map(|e| e.status),
                Some(marconi_status::Unsupported)
            );
        }
    }
}
