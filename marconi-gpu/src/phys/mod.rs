//! Physical backing of the pools, shaped like the CUDA virtual memory API.
//!
//! | [`PhysicalMemory`]      | CUDA driver                                 | Linux host ([`MemfdBackend`])                     |
//! |-------------------------|---------------------------------------------|---------------------------------------------------|
//! | `granularity`           | `cuMemGetAllocationGranularity`             | 2 MiB by default                                  |
//! | `reserve`               | `cuMemAddressReserve`                       | `mmap(PROT_NONE)`                                 |
//! | `create_chunk`          | `cuMemCreate`                               | a free chunk-sized slot of one memfd              |
//! | `map`                   | `cuMemMap` + `cuMemSetAccess`               | `mmap(MAP_FIXED \| MAP_SHARED, memfd, slot)`      |
//! | `unmap`                 | `cuMemUnmap`                                | `mmap(MAP_FIXED, PROT_NONE)` over the range       |
//! | `release_chunk`         | `cuMemRelease`                              | `fallocate(PUNCH_HOLE)` of the slot               |
//! | `free_reservation`      | `cuMemAddressFree`                          | `munmap` of the whole reservation                 |
//!
//! [`BackedPool`] puts a [`crate::DualPool`] on top: each pool owns one reservation
//! as large as the whole budget, the mapped prefix covers its capacity, and a
//! migration unmaps chunks from the donor's tail and maps the same chunks into the
//! recipient, so the physical footprint never exceeds the budget (the prototype
//! sizes both pools at the full budget: 2×).

mod memfd;

pub use memfd::MemfdBackend;

use crate::alloc::{AllocStats, DualPool, Location, Migration, MigrationPolicy, PoolAllocator};
use crate::error::{AllocError, MigrationRefusal};
use crate::handle::{PoolKind, VirtualHandle};

/// The GPU's VMM granularity and the host backend's default chunk size.
pub const DEFAULT_GRANULARITY: usize = 2 << 20;

/// A reserved virtual address range.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ReservationId(pub(crate) u32);

/// A physical chunk of exactly one granularity.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ChunkId(pub(crate) u32);

impl ReservationId {
    /// Wraps a backend's own index (for backends outside this module).
    #[must_use]
    pub fn from_raw(raw: u32) -> Self {
        ReservationId(raw)
    }

    /// The backend's index.
    #[must_use]
    pub fn raw(self) -> u32 {
        self.0
    }
}

impl ChunkId {
    /// Wraps a backend's own index (for backends outside this module).
    #[must_use]
    pub fn from_raw(raw: u32) -> Self {
        ChunkId(raw)
    }

    /// The backend's index.
    #[must_use]
    pub fn raw(self) -> u32 {
        self.0
    }
}

/// Failures of the physical layer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PhysError {
    /// A system or driver call failed.
    #[error("{op} failed: errno {errno}")]
    Os {
        /// The call.
        op: &'static str,
        /// `errno` (or the driver's status code).
        errno: i32,
    },
    /// An offset or size is not a multiple of the granularity.
    #[error("{0} is not a multiple of the granularity")]
    Unaligned(usize),
    /// An offset or range lies outside the reservation.
    #[error("range {offset}+{len} outside the reservation of {size} bytes")]
    OutOfRange {
        /// Start.
        offset: usize,
        /// Length.
        len: usize,
        /// Reservation size.
        size: usize,
    },
    /// The reservation has no chunk mapped at this offset.
    #[error("nothing mapped at offset {0}")]
    NotMapped(usize),
    /// The reservation already has a chunk mapped at this offset.
    #[error("offset {0} already mapped")]
    AlreadyMapped(usize),
    /// The chunk is mapped somewhere and cannot be mapped again or released.
    #[error("chunk {0} is mapped")]
    ChunkMapped(u32),
    /// No such reservation (freed or from another backend).
    #[error("unknown reservation {0}")]
    UnknownReservation(u32),
    /// No such chunk (released or from another backend).
    #[error("unknown chunk {0}")]
    UnknownChunk(u32),
    /// The backend's physical capacity is exhausted.
    #[error("physical capacity of {0} chunks exhausted")]
    OutOfChunks(usize),
    /// The logical layout needs more chunks than the budget holds.
    #[error("layout needs {needed} chunks, budget holds {budget}")]
    OverBudget {
        /// Chunks needed.
        needed: usize,
        /// Chunks the budget holds.
        budget: usize,
    },
}

/// Physical memory with separately managed address ranges and chunks, the shape
/// of the CUDA virtual memory management API.
///
/// Contract: every method returns a typed error instead of panicking; `map` and
/// `unmap` work on exactly one chunk at a granularity-aligned offset; a chunk is
/// mapped at most once at a time; unmapping never loses the chunk's contents
/// (mapping it again, anywhere, shows the same bytes) until `release_chunk`;
/// dropping the backend releases everything it still holds.
pub trait PhysicalMemory {
    /// Chunk size and alignment of every offset.
    fn granularity(&self) -> usize;
    /// Reserves `bytes` (a multiple of the granularity) of address space, no memory.
    fn reserve(&mut self, bytes: usize) -> Result<ReservationId, PhysError>;
    /// Frees a reservation, unmapping whatever is still mapped in it (chunks stay).
    fn free_reservation(&mut self, r: ReservationId) -> Result<(), PhysError>;
    /// Creates one physical chunk.
    fn create_chunk(&mut self) -> Result<ChunkId, PhysError>;
    /// Releases an unmapped chunk; its memory goes back to the system.
    fn release_chunk(&mut self, c: ChunkId) -> Result<(), PhysError>;
    /// Maps chunk `c` at `offset` of reservation `r`, readable and writable.
    fn map(&mut self, r: ReservationId, offset: usize, c: ChunkId) -> Result<(), PhysError>;
    /// Unmaps the chunk at `offset` of `r` and returns it.
    fn unmap(&mut self, r: ReservationId, offset: usize) -> Result<ChunkId, PhysError>;
    /// Copies `data` into mapped memory at `offset` of `r` (may span chunks).
    fn write(&mut self, r: ReservationId, offset: usize, data: &[u8]) -> Result<(), PhysError>;
    /// Copies mapped memory at `offset` of `r` into `out`.
    fn read(&self, r: ReservationId, offset: usize, out: &mut [u8]) -> Result<(), PhysError>;
    /// Physical bytes actually committed right now (memfd blocks on the host,
    /// created chunks on a GPU).
    fn physical_bytes(&self) -> Result<u64, PhysError>;
}

/// Per-pool backing: a reservation and the chunks mapped at its start.
#[derive(Debug)]
struct PoolBacking {
    reservation: ReservationId,
    mapped: Vec<ChunkId>,
}

/// A [`DualPool`] whose two pools are backed by physical chunks of `B`.
///
/// Invariant: `mapped chunks(KV) + mapped chunks(SSM) <= budget chunks`
/// (`floor(total_bytes / granularity)`) at every point, including inside a
/// migration (the donor unmaps before the recipient maps, and the recipient reuses
/// the donor's chunks).
#[derive(Debug)]
pub struct BackedPool<B: PhysicalMemory> {
    pool: DualPool,
    backend: B,
    backing: [PoolBacking; 2],
    budget_chunks: usize,
    chunks_moved: u64,
}

fn chunks_for(bytes: u64, g: usize) -> usize {
    usize::try_from(bytes.div_ceil(g as u64)).unwrap_or(usize::MAX)
}

impl<B: PhysicalMemory> BackedPool<B> {
    /// Reserves one budget-sized range per pool and maps the chunks covering each
    /// pool's initial capacity.
    pub fn new(pool: DualPool, mut backend: B) -> Result<Self, PhysError> {
        let g = backend.granularity();
        let budget_chunks = usize::try_from(pool.total_bytes() / g as u64).unwrap_or(usize::MAX);
        let span = budget_chunks.max(1) * g;
        let mut backing = Vec::with_capacity(2);
        for _ in PoolKind::ALL {
            backing.push(PoolBacking {
                reservation: backend.reserve(span)?,
                mapped: Vec::new(),
            });
        }
        let [kv, ssm]: [PoolBacking; 2] = backing
            .try_into()
            .map_err(|_| PhysError::UnknownReservation(0))?;
        let mut me = BackedPool {
            pool,
            backend,
            backing: [kv, ssm],
            budget_chunks,
            chunks_moved: 0,
        };
        let need = me.needs(me.pool.extent(PoolKind::Kv), me.pool.extent(PoolKind::Ssm));
        if need[0] + need[1] > budget_chunks {
            return Err(PhysError::OverBudget {
                needed: need[0] + need[1],
                budget: budget_chunks,
            });
        }
        me.sync(need)?;
        Ok(me)
    }

    fn needs(&self, kv_units: u32, ssm_units: u32) -> [usize; 2] {
        let g = self.backend.granularity();
        [
            chunks_for(u64::from(kv_units) * self.pool.unit_bytes(PoolKind::Kv), g),
            chunks_for(
                u64::from(ssm_units) * self.pool.unit_bytes(PoolKind::Ssm),
                g,
            ),
        ]
    }

    /// Brings the mappings to `need`: shrinking pools unmap their tail chunks first,
    /// growing pools map those chunks (creating new ones only while under budget),
    /// and chunks nobody needs are released.
    fn sync(&mut self, need: [usize; 2]) -> Result<(), PhysError> {
        let g = self.backend.granularity();
        let mut spare = Vec::new();
        for (p, &n) in need.iter().enumerate() {
            while self.backing[p].mapped.len() > n {
                let off = (self.backing[p].mapped.len() - 1) * g;
                let c = self.backend.unmap(self.backing[p].reservation, off)?;
                self.backing[p].mapped.pop();
                spare.push(c);
            }
        }
        for (p, &n) in need.iter().enumerate() {
            while self.backing[p].mapped.len() < n {
                let c = match spare.pop() {
                    Some(c) => {
                        self.chunks_moved += 1;
                        c
                    }
                    None => {
                        if self.mapped_chunks() >= self.budget_chunks {
                            return Err(PhysError::OverBudget {
                                needed: need[0] + need[1],
                                budget: self.budget_chunks,
                            });
                        }
                        self.backend.create_chunk()?
                    }
                };
                let off = self.backing[p].mapped.len() * g;
                self.backend.map(self.backing[p].reservation, off, c)?;
                self.backing[p].mapped.push(c);
            }
        }
        for c in spare {
            self.backend.release_chunk(c)?;
        }
        Ok(())
    }

    /// Chunks mapped in both pools.
    #[must_use]
    pub fn mapped_chunks(&self) -> usize {
        self.backing[0].mapped.len() + self.backing[1].mapped.len()
    }

    /// Chunks the budget holds.
    #[must_use]
    pub fn budget_chunks(&self) -> usize {
        self.budget_chunks
    }

    /// Chunks moved from one pool to the other by migrations so far.
    #[must_use]
    pub fn chunks_moved(&self) -> u64 {
        self.chunks_moved
    }

    /// The logical allocator.
    #[must_use]
    pub fn pool(&self) -> &DualPool {
        &self.pool
    }

    /// The reservation holding `pool`'s units: the unit at
    /// [`Location::byte_offset`] lies at that offset from the reservation's
    /// base (`MemfdBackend::base`, `CudaPhysical::base`). The reservation
    /// spans the whole budget and never moves, so a live unit's address is
    /// stable until the unit is freed (a migration only moves free tail units).
    #[must_use]
    pub fn reservation(&self, pool: PoolKind) -> ReservationId {
        self.backing[pool.index()].reservation
    }

    /// The physical backend.
    #[must_use]
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// Writes `data` into the unit behind `h` at `offset` within the unit.
    pub fn write_unit(
        &mut self,
        h: VirtualHandle,
        offset: u64,
        data: &[u8],
    ) -> Result<(), AllocError> {
        let (r, at) = self.locate(h, offset, data.len())?;
        self.backend.write(r, at, data).map_err(phys_to_alloc)
    }

    /// Reads the unit behind `h` at `offset` within the unit into `out`.
    pub fn read_unit(
        &self,
        h: VirtualHandle,
        offset: u64,
        out: &mut [u8],
    ) -> Result<(), AllocError> {
        let (r, at) = self.locate(h, offset, out.len())?;
        self.backend.read(r, at, out).map_err(phys_to_alloc)
    }

    fn locate(
        &self,
        h: VirtualHandle,
        offset: u64,
        len: usize,
    ) -> Result<(ReservationId, usize), AllocError> {
        let loc = self.pool.resolve(h)?;
        if offset + len as u64 > loc.unit_bytes {
            return Err(AllocError::InvalidConfig(format!(
                "access {offset}+{len} beyond a {}-byte unit",
                loc.unit_bytes
            )));
        }
        let at = usize::try_from(loc.byte_offset + offset)
            .map_err(|_| AllocError::ForeignHandle(h.raw()))?;
        Ok((self.backing[loc.table.index()].reservation, at))
    }

    /// Migrates `donor_units` toward `recipient` logically and physically: checked
    /// against the chunk budget first, then the donor unmaps, the recipient maps.
    pub fn migrate_units(
        &mut self,
        recipient: PoolKind,
        donor_units: u32,
    ) -> Result<Migration, AllocError> {
        let (kv, ssm) = self.pool.plan_migration(recipient, donor_units)?;
        let need = self.needs(kv, ssm);
        if need[0] + need[1] > self.budget_chunks {
            return Err(AllocError::MigrationRefused {
                recipient,
                reason: MigrationRefusal::RecipientOverBudget,
            });
        }
        let m = self.pool.migrate_units(recipient, donor_units)?;
        self.sync(need).map_err(phys_to_alloc)?;
        Ok(m)
    }

    /// Unmaps and releases every chunk, frees both reservations and gives the
    /// backend back (dropping a `BackedPool` instead leaves that to the backend's
    /// own `Drop`).
    pub fn into_backend(self) -> Result<B, PhysError> {
        let BackedPool {
            mut backend,
            backing,
            ..
        } = self;
        let g = backend.granularity();
        for b in backing {
            for (k, _) in b.mapped.iter().enumerate().rev() {
                let c = backend.unmap(b.reservation, k * g)?;
                backend.release_chunk(c)?;
            }
            backend.free_reservation(b.reservation)?;
        }
        Ok(backend)
    }
}

fn phys_to_alloc(e: PhysError) -> AllocError {
    AllocError::Physical(e)
}

impl<B: PhysicalMemory> PoolAllocator for BackedPool<B> {
    fn name(&self) -> &str {
        self.pool.name()
    }

    fn unit_bytes(&self, pool: PoolKind) -> u64 {
        self.pool.unit_bytes(pool)
    }

    fn capacity(&self, pool: PoolKind) -> u32 {
        self.pool.capacity(pool)
    }

    fn free_units(&self, pool: PoolKind) -> u32 {
        self.pool.free_units(pool)
    }

    fn extent(&self, pool: PoolKind) -> u32 {
        self.pool.extent(pool)
    }

    fn retired_units(&self, pool: PoolKind) -> u64 {
        self.pool.retired_units(pool)
    }

    fn allocate(
        &mut self,
        pool: PoolKind,
        n: u32,
        out: &mut Vec<VirtualHandle>,
    ) -> Result<(), AllocError> {
        self.pool.allocate(pool, n, out)
    }

    fn free(&mut self, handle: VirtualHandle) -> Result<(), AllocError> {
        self.pool.free(handle)
    }

    fn resolve(&self, handle: VirtualHandle) -> Result<Location, AllocError> {
        self.pool.resolve(handle)
    }

    fn migrate_toward(&mut self, recipient: PoolKind) -> Result<Migration, AllocError> {
        let batch = self.pool.policy_allows(recipient)?;
        self.migrate_units(recipient, batch)
    }

    fn migrate_units_toward(
        &mut self,
        recipient: PoolKind,
        donor_units: u32,
    ) -> Result<Migration, AllocError> {
        if self.pool.policy() == MigrationPolicy::Static {
            return Err(AllocError::MigrationRefused {
                recipient,
                reason: MigrationRefusal::Unsupported,
            });
        }
        self.migrate_units(recipient, donor_units)
    }

    fn stats(&self) -> AllocStats {
        self.pool.stats()
    }

    fn total_bytes(&self) -> u64 {
        self.pool.total_bytes()
    }

    fn migrates(&self) -> bool {
        self.pool.policy() != MigrationPolicy::Static
    }

    fn migration_step_bytes(&self) -> u64 {
        self.backend.granularity() as u64
    }

    fn live_handle_at(&self, pool: PoolKind, index: u32) -> Option<VirtualHandle> {
        self.pool.live_handle_at(pool, index)
    }

    fn unit_index(&self, handle: VirtualHandle) -> u32 {
        self.pool.unit_index(handle)
    }
}
