//! Host tier memory: a pool of KV pages and state slots in host RAM, with
//! handles from the same registry as the device pools, and the moves that
//! copy units between a device pool and the host pool.
//!
//! [`HostPool`] is a static two-pool layout ([`DualPool`]) over one memfd
//! ([`MemfdBackend`]): its handles carry their own pool id, so a device pool
//! refuses a host handle and the host pool refuses a device handle
//! ([`AllocError::ForeignHandle`]); a freed unit's handle is stale for good,
//! as in every pool. In builds with the `cuda` feature, where a driver and a
//! device exist, both mappings are page-locked with `cuMemHostRegister`
//! (portable), so the engine's asynchronous copies reach them at full PCIe
//! speed; elsewhere the pool is ordinary shared memory ([`HostPool::pinned`]
//! says which).
//!
//! [`HostPool::demote`] (device → host) and [`HostPool::promote`] (host →
//! device) take `(src, dst)` handle pairs. Every pair is checked before any
//! byte moves (both handles live in their pools, same kind, same unit size,
//! no destination twice), so a batch either moves entirely or not at all.
//! Over a host-backed device pool (the memfd backend standing in for device
//! memory) they are plain memcpys; a CUDA device pool's units are not host
//! addressable, and its copies are the engine's (see `docs/tiers.md`).

use std::collections::HashMap;

use crate::alloc::{DualPool, DualPoolConfig, Location, MigrationPolicy, PoolAllocator};
use crate::error::AllocError;
use crate::handle::{PoolKind, VirtualHandle};
use crate::phys::{BackedPool, MemfdBackend, PhysError, PhysicalMemory, DEFAULT_GRANULARITY};

/// What a [`HostPool`] holds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HostPoolConfig {
    /// Host bytes of both kinds together; rounded down to whole chunks.
    pub capacity_bytes: u64,
    /// Share of the capacity given to state slots, strictly between 0 and
    /// 1; rounded to whole chunks (each kind keeps at least one).
    pub state_fraction: f64,
    /// Bytes of one KV page (the device pool's page size).
    pub page_bytes: u64,
    /// Bytes of one state slot (the device pool's slot size).
    pub state_bytes: u64,
    /// Chunk size of the memfd backing, a multiple of the page size; 0 for
    /// 2 MiB.
    pub chunk_bytes: u64,
}

impl HostPoolConfig {
    /// A pool of `capacity_bytes` split evenly, 2 MiB chunks.
    #[must_use]
    pub fn new(capacity_bytes: u64, page_bytes: u64, state_bytes: u64) -> Self {
        HostPoolConfig {
            capacity_bytes,
            state_fraction: 0.5,
            page_bytes,
            state_bytes,
            chunk_bytes: 0,
        }
    }
}

/// Gauges and counters of a [`HostPool`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct HostPoolStats {
    /// Bytes of both kinds (after rounding to chunks).
    pub capacity_bytes: u64,
    /// KV pages the pool holds.
    pub page_capacity: u32,
    /// State slots the pool holds.
    pub state_capacity: u32,
    /// KV pages allocated.
    pub pages_live: u32,
    /// State slots allocated.
    pub states_live: u32,
    /// Bytes copied into the pool by [`HostPool::demote`].
    pub bytes_demoted: u64,
    /// Bytes copied out of the pool by [`HostPool::promote`].
    pub bytes_promoted: u64,
    /// Units copied either way.
    pub units_moved: u64,
    /// Host bytes committed (pages touched so far).
    pub resident_bytes: u64,
    /// Whether the pool is page-locked for a CUDA device.
    pub pinned: bool,
}

/// Which side of a move pair a refused handle was on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// The unit read.
    Source,
    /// The unit written.
    Destination,
}

/// Why a move batch was refused; nothing was copied.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MoveError {
    /// A handle is not a live unit of the pool it was given to (foreign,
    /// stale, freed, or of the other side's pool).
    #[error("pair {index}: {side:?} handle refused: {error}")]
    Handle {
        /// Position of the pair.
        index: usize,
        /// Which handle.
        side: Side,
        /// What the pool said.
        error: AllocError,
    },
    /// The pair copies a KV page into a state slot or the reverse.
    #[error("pair {index}: {src} unit into a {dst} unit")]
    KindMismatch {
        /// Position of the pair.
        index: usize,
        /// Kind read.
        src: PoolKind,
        /// Kind written.
        dst: PoolKind,
    },
    /// The two units differ in size.
    #[error("pair {index}: {src_bytes}-byte unit into a {dst_bytes}-byte unit")]
    SizeMismatch {
        /// Position of the pair.
        index: usize,
        /// Bytes of the unit read.
        src_bytes: u64,
        /// Bytes of the unit written.
        dst_bytes: u64,
    },
    /// Two pairs write the same unit.
    #[error("pairs {first} and {second} write the same unit")]
    DuplicateDestination {
        /// First pair writing it.
        first: usize,
        /// Second pair writing it.
        second: usize,
    },
}

mod sealed {
    pub trait Sealed {}
}

/// A pool whose live units are host-addressable memory: the source or
/// destination of [`HostPool::demote`] and [`HostPool::promote`].
///
/// Sealed: implemented by [`HostPool`] and by a memfd-backed device pool
/// (`BackedPool<MemfdBackend>`), whose units are mapped for as long as they
/// are live and never overlap each other or another pool's.
pub trait UnitMemory: sealed::Sealed {
    /// Host address and byte length of the live unit `h`.
    ///
    /// # Errors
    /// `h` is not a live unit of this pool.
    fn unit_span(&self, h: VirtualHandle) -> Result<(usize, u64), AllocError>;
}

impl sealed::Sealed for BackedPool<MemfdBackend> {}

impl UnitMemory for BackedPool<MemfdBackend> {
    fn unit_span(&self, h: VirtualHandle) -> Result<(usize, u64), AllocError> {
        let loc = self.resolve(h)?;
        let base = self
            .backend()
            .base(self.reservation(loc.table))
            .map_err(AllocError::Physical)?;
        let off =
            usize::try_from(loc.byte_offset).map_err(|_| AllocError::ForeignHandle(h.raw()))?;
        Ok((base + off, loc.unit_bytes))
    }
}

/// Page-locks host ranges for CUDA for as long as it lives.
#[cfg(feature = "cuda")]
#[derive(Debug)]
struct Pinned {
    device: std::sync::Arc<crate::cuda::Device>,
    ranges: Vec<usize>,
}

/// Puts back the calling thread's CUDA context (the engine's, or none)
/// when dropped: pinning binds device 0's primary context for its calls
/// only.
#[cfg(feature = "cuda")]
struct RestoreContext(Option<cudarc::driver::sys::CUcontext>);

#[cfg(feature = "cuda")]
impl RestoreContext {
    fn save() -> Self {
        RestoreContext(cudarc::driver::result::ctx::get_current().ok().flatten())
    }
}

#[cfg(feature = "cuda")]
impl Drop for RestoreContext {
    fn drop(&mut self) {
        let ctx = self.0.unwrap_or(std::ptr::null_mut());
        // SAFETY: `ctx` was current on this thread a moment ago (or is
        // null, which unbinds); the driver is loaded (checked before save).
        let _ = unsafe { cudarc::driver::result::ctx::set_current(ctx) };
    }
}

#[cfg(feature = "cuda")]
impl Pinned {
    /// Registers each `(addr, len)` with device 0; `None` where no driver or
    /// device exists or registration fails (the pool then stays pageable).
    fn register(ranges: &[(usize, usize)]) -> Option<Pinned> {
        use cudarc::driver::sys;
        crate::cuda::driver_available().ok()?;
        let _restore = RestoreContext::save();
        let device = crate::cuda::Device::open(0).ok()?;
        device.bind().ok()?;
        let mut me = Pinned {
            device,
            ranges: Vec::new(),
        };
        for &(addr, len) in ranges {
            if len == 0 {
                continue;
            }
            // SAFETY: [addr, addr+len) is a live read-write mapping of the
            // pool's memfd, which outlives this registration (dropped first).
            let rc = unsafe {
                sys::cuMemHostRegister_v2(
                    addr as *mut std::ffi::c_void,
                    len,
                    sys::CU_MEMHOSTREGISTER_PORTABLE,
                )
            };
            if rc != sys::CUresult::CUDA_SUCCESS {
                tracing::warn!(
                    ?rc,
                    len,
                    "cuMemHostRegister failed: host pool stays pageable"
                );
                return None; // `me` unregisters what it registered.
            }
            me.ranges.push(addr);
        }
        Some(me)
    }
}

#[cfg(feature = "cuda")]
impl Drop for Pinned {
    fn drop(&mut self) {
        let _restore = RestoreContext::save();
        let _ = self.device.bind();
        for &addr in &self.ranges {
            // SAFETY: `addr` was registered by `register` and not since.
            let _ =
                unsafe { cudarc::driver::sys::cuMemHostUnregister(addr as *mut std::ffi::c_void) };
        }
    }
}

/// KV pages and state slots in host memory (one memfd), handed out as
/// [`VirtualHandle`]s of their own pool id.
///
/// Capacity is fixed at creation (no migration between the kinds). The
/// units' addresses ([`HostPool::address`]) are stable while they are live.
#[derive(Debug)]
pub struct HostPool {
    /// Dropped first: unregisters before the mappings go.
    #[cfg(feature = "cuda")]
    pinned: Option<Pinned>,
    pool: BackedPool<MemfdBackend>,
    bytes_demoted: u64,
    bytes_promoted: u64,
    units_moved: u64,
}

fn invalid(detail: String) -> AllocError {
    AllocError::InvalidConfig(detail)
}

impl HostPool {
    /// Maps a host pool of `cfg.capacity_bytes` (rounded down to chunks),
    /// and page-locks it where CUDA can (feature `cuda`).
    ///
    /// # Errors
    /// [`AllocError::InvalidConfig`] for a zero unit, a unit larger than the
    /// capacity, a fraction outside (0, 1), fewer than two chunks or a chunk
    /// size that is not a multiple of the page size; [`AllocError::Physical`]
    /// when the memfd cannot be made or mapped.
    pub fn new(cfg: HostPoolConfig) -> Result<Self, AllocError> {
        if cfg.page_bytes == 0 || cfg.state_bytes == 0 {
            return Err(invalid(format!(
                "page_bytes {} and state_bytes {} must both be non-zero",
                cfg.page_bytes, cfg.state_bytes
            )));
        }
        if !(cfg.state_fraction > 0.0 && cfg.state_fraction < 1.0) {
            return Err(invalid(format!(
                "state_fraction {} is not strictly between 0 and 1",
                cfg.state_fraction
            )));
        }
        if cfg.capacity_bytes > 1 << 52 {
            return Err(invalid(format!(
                "capacity_bytes {} is above 2^52",
                cfg.capacity_bytes
            )));
        }
        let g = if cfg.chunk_bytes == 0 {
            DEFAULT_GRANULARITY as u64
        } else {
            cfg.chunk_bytes
        };
        let chunks = cfg.capacity_bytes / g;
        if chunks < 2 {
            return Err(invalid(format!(
                "capacity_bytes {} holds {chunks} chunks of {g} bytes; pages and states need at least 2",
                cfg.capacity_bytes
            )));
        }
        #[expect(
            clippy::cast_possible_truncation,
            clippy::cast_sign_loss,
            clippy::cast_precision_loss,
            reason = "chunk counts are far below 2^52; floor of a positive product"
        )]
        let state_chunks =
            ((chunks as f64 * cfg.state_fraction).floor() as u64).clamp(1, chunks - 1);
        let (state_share, page_share) = (state_chunks * g, (chunks - state_chunks) * g);
        if cfg.page_bytes > page_share || cfg.state_bytes > state_share {
            return Err(invalid(format!(
                "a {}-byte page or a {}-byte state does not fit its share ({page_share} and {state_share} bytes)",
                cfg.page_bytes, cfg.state_bytes
            )));
        }
        // DualPool gives the state pool floor(total * ratio) bytes: half a
        // byte above the chunk boundary floors onto it exactly.
        #[expect(
            clippy::cast_precision_loss,
            reason = "byte counts are at most 2^52, exact in f64"
        )]
        let ratio = (state_share as f64 + 0.5) / (chunks * g) as f64;
        let dual = DualPool::new(
            "host",
            DualPoolConfig {
                total_bytes: chunks * g,
                ssm_ratio: ratio,
                kv_unit: cfg.page_bytes,
                ssm_unit: cfg.state_bytes,
                policy: MigrationPolicy::Static,
            },
        )?;
        let g_usize =
            usize::try_from(g).map_err(|_| invalid(format!("chunk_bytes {g} is absurd")))?;
        let n_chunks =
            usize::try_from(chunks).map_err(|_| invalid(format!("{chunks} chunks is absurd")))?;
        // A chunk size the system cannot map is the caller's configuration.
        let mem = MemfdBackend::with_granularity(n_chunks, g_usize).map_err(|e| match e {
            PhysError::Unaligned(_) | PhysError::OutOfChunks(_) => {
                invalid(format!("chunk_bytes {g}: {e}"))
            }
            e => AllocError::Physical(e),
        })?;
        let pool = BackedPool::new(dual, mem)?;
        #[cfg(feature = "cuda")]
        let pinned = {
            let mut ranges = Vec::new();
            for kind in PoolKind::ALL {
                let base = pool.backend().base(pool.reservation(kind))?;
                let bytes = u64::from(pool.extent(kind)) * pool.unit_bytes(kind);
                let len = usize::try_from(bytes.div_ceil(g) * g).unwrap_or(0);
                ranges.push((base, len));
            }
            Pinned::register(&ranges)
        };
        Ok(HostPool {
            #[cfg(feature = "cuda")]
            pinned,
            pool,
            bytes_demoted: 0,
            bytes_promoted: 0,
            units_moved: 0,
        })
    }

    /// Whether the pool is page-locked for CUDA (only in `cuda` builds on a
    /// machine with a driver and a device).
    #[must_use]
    pub fn pinned(&self) -> bool {
        #[cfg(feature = "cuda")]
        {
            self.pinned.is_some()
        }
        #[cfg(not(feature = "cuda"))]
        {
            false
        }
    }

    /// Bytes of one unit of `kind` (KV page or state slot).
    #[must_use]
    pub fn unit_bytes(&self, kind: PoolKind) -> u64 {
        self.pool.unit_bytes(kind)
    }

    /// Units of `kind` the pool holds.
    #[must_use]
    pub fn capacity(&self, kind: PoolKind) -> u32 {
        self.pool.capacity(kind)
    }

    /// Free units of `kind`.
    #[must_use]
    pub fn free_units(&self, kind: PoolKind) -> u32 {
        self.pool.free_units(kind)
    }

    /// Allocates `n` units of `kind`, appending their handles to `out`; all
    /// or nothing.
    ///
    /// # Errors
    /// [`AllocError::OutOfCapacity`] (nothing allocated).
    pub fn allocate(
        &mut self,
        kind: PoolKind,
        n: u32,
        out: &mut Vec<VirtualHandle>,
    ) -> Result<(), AllocError> {
        self.pool.allocate(kind, n, out)
    }

    /// Frees every handle of `handles`, or none of them: each is checked
    /// live (and listed once) before any is freed.
    ///
    /// # Errors
    /// The first handle refused, with its position.
    pub fn free(&mut self, handles: &[VirtualHandle]) -> Result<(), (usize, AllocError)> {
        let mut seen = HashMap::with_capacity(handles.len());
        for (i, &h) in handles.iter().enumerate() {
            self.pool.resolve(h).map_err(|e| (i, e))?;
            if seen.insert(h, i).is_some() {
                return Err((i, AllocError::DoubleFree(h.raw())));
            }
        }
        for (i, &h) in handles.iter().enumerate() {
            self.pool.free(h).map_err(|e| (i, e))?;
        }
        Ok(())
    }

    /// Where the live unit `h` lies.
    ///
    /// # Errors
    /// `h` is foreign, stale or freed.
    pub fn resolve(&self, h: VirtualHandle) -> Result<Location, AllocError> {
        self.pool.resolve(h)
    }

    /// Host address of the live unit `h` (valid until it is freed).
    ///
    /// # Errors
    /// `h` is foreign, stale or freed.
    pub fn address(&self, h: VirtualHandle) -> Result<usize, AllocError> {
        Ok(self.pool.unit_span(h)?.0)
    }

    /// Writes `data` into unit `h` at `offset`.
    ///
    /// # Errors
    /// A bad handle, or a range past the unit.
    pub fn write_unit(
        &mut self,
        h: VirtualHandle,
        offset: u64,
        data: &[u8],
    ) -> Result<(), AllocError> {
        self.pool.write_unit(h, offset, data)
    }

    /// Reads unit `h` at `offset` into `out`.
    ///
    /// # Errors
    /// A bad handle, or a range past the unit.
    pub fn read_unit(
        &self,
        h: VirtualHandle,
        offset: u64,
        out: &mut [u8],
    ) -> Result<(), AllocError> {
        self.pool.read_unit(h, offset, out)
    }

    /// Gauges and counters.
    #[must_use]
    pub fn stats(&self) -> HostPoolStats {
        HostPoolStats {
            capacity_bytes: self.pool.total_bytes(),
            page_capacity: self.pool.capacity(PoolKind::Kv),
            state_capacity: self.pool.capacity(PoolKind::Ssm),
            pages_live: self.pool.pool().live_units(PoolKind::Kv),
            states_live: self.pool.pool().live_units(PoolKind::Ssm),
            bytes_demoted: self.bytes_demoted,
            bytes_promoted: self.bytes_promoted,
            units_moved: self.units_moved,
            resident_bytes: self.pool.backend().physical_bytes().unwrap_or(0),
            pinned: self.pinned(),
        }
    }

    /// Copies device units into host units: `pairs[i] = (device, host)`.
    /// All or nothing; returns the bytes copied.
    ///
    /// # Errors
    /// [`MoveError`]: nothing was copied.
    pub fn demote<D: UnitMemory>(
        &mut self,
        device: &D,
        pairs: &[(VirtualHandle, VirtualHandle)],
    ) -> Result<u64, MoveError> {
        let jobs = plan(device, &*self, pairs)?;
        // SAFETY: `plan` checked every span is a live unit of its pool, the
        // destinations pairwise distinct (so disjoint: live units of one pool
        // never overlap), and `&mut self` keeps the host units from anyone
        // else; the device pool is another mapping, so no source overlaps a
        // destination.
        let bytes = unsafe { run(&jobs) };
        self.bytes_demoted += bytes;
        self.units_moved += jobs.len() as u64;
        Ok(bytes)
    }

    /// Copies host units into device units: `pairs[i] = (host, device)`.
    /// All or nothing; returns the bytes copied.
    ///
    /// # Errors
    /// [`MoveError`]: nothing was copied.
    pub fn promote<D: UnitMemory>(
        &mut self,
        device: &mut D,
        pairs: &[(VirtualHandle, VirtualHandle)],
    ) -> Result<u64, MoveError> {
        let jobs = plan(&*self, &*device, pairs)?;
        // SAFETY: as in `demote`, with `&mut device` keeping its units ours.
        let bytes = unsafe { run(&jobs) };
        self.bytes_promoted += bytes;
        self.units_moved += jobs.len() as u64;
        Ok(bytes)
    }
}

impl sealed::Sealed for HostPool {}

impl UnitMemory for HostPool {
    fn unit_span(&self, h: VirtualHandle) -> Result<(usize, u64), AllocError> {
        self.pool.unit_span(h)
    }
}

/// One checked copy.
struct Job {
    src: usize,
    dst: usize,
    len: usize,
}

/// Checks every pair and turns it into a copy; refuses the whole batch at
/// the first bad pair.
fn plan<S: UnitMemory + ?Sized, D: UnitMemory + ?Sized>(
    src: &S,
    dst: &D,
    pairs: &[(VirtualHandle, VirtualHandle)],
) -> Result<Vec<Job>, MoveError> {
    let mut jobs = Vec::with_capacity(pairs.len());
    let mut written: HashMap<VirtualHandle, usize> = HashMap::with_capacity(pairs.len());
    for (index, &(s, d)) in pairs.iter().enumerate() {
        let (src_at, src_bytes) = src.unit_span(s).map_err(|error| MoveError::Handle {
            index,
            side: Side::Source,
            error,
        })?;
        let (dst_at, dst_bytes) = dst.unit_span(d).map_err(|error| MoveError::Handle {
            index,
            side: Side::Destination,
            error,
        })?;
        if s.pool() != d.pool() {
            return Err(MoveError::KindMismatch {
                index,
                src: s.pool(),
                dst: d.pool(),
            });
        }
        if src_bytes != dst_bytes {
            return Err(MoveError::SizeMismatch {
                index,
                src_bytes,
                dst_bytes,
            });
        }
        if let Some(first) = written.insert(d, index) {
            return Err(MoveError::DuplicateDestination {
                first,
                second: index,
            });
        }
        let len = usize::try_from(src_bytes).map_err(|_| MoveError::SizeMismatch {
            index,
            src_bytes,
            dst_bytes,
        })?;
        jobs.push(Job {
            src: src_at,
            dst: dst_at,
            len,
        });
    }
    Ok(jobs)
}

/// Runs checked copies; returns the bytes copied.
///
/// # Safety
/// Every source is readable and every destination writable for its length,
/// destinations are pairwise disjoint, no source overlaps a destination,
/// and nothing else touches the destinations meanwhile.
unsafe fn run(jobs: &[Job]) -> u64 {
    let mut bytes = 0u64;
    for j in jobs {
        // SAFETY: the caller's contract.
        unsafe { std::ptr::copy_nonoverlapping(j.src as *const u8, j.dst as *mut u8, j.len) };
        bytes += j.len as u64;
    }
    bytes
}
