//! RAII types over the virtual memory driver calls: a [`Reservation`] of address
//! space, a [`PhysicalChunk`] of device memory, and a [`Mapping`] of one chunk
//! into a reservation. Each undoes itself on drop.
//!
//! Ownership encodes the driver's rules:
//! - a [`Mapping`] owns its chunk (so a chunk is mapped at most once) and an
//!   `Arc` of its reservation (so the range is never freed while mapped);
//! - a mapping's access is set as part of creating it, before anyone can use it;
//! - unmapping covers exactly the mapped range and first waits for the context
//!   to be idle, since `cuMemUnmap` must not pull memory from under running work.
//!
//! Chunk creation is the slow call (about 200 µs per 2 MiB): create chunks ahead
//! of time and keep only map / unmap on the migration path.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};

use cudarc::driver::sys;

use super::{driver, CallContext, CudaError, Device};

/// Granularity of physical chunks and mappings on `device` (the recommended one,
/// 2 MiB on current GPUs).
///
/// # Errors
/// Driver failure.
pub fn granularity(device: &Device) -> Result<usize, CudaError> {
    device.bind()?;
    let prop = driver::device_allocation_prop(device.ordinal());
    // SAFETY: the driver is initialised (a Device exists) and `prop` is valid.
    unsafe {
        driver::get_allocation_granularity(
            &prop,
            sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
        )
    }
    .call("cuMemGetAllocationGranularity")
}

/// A range of device virtual address space with nothing behind it until chunks
/// are mapped. Freed on drop; [`Mapping`]s hold an `Arc` to it, so that happens
/// only once every mapping in it is gone.
#[derive(Debug)]
pub struct Reservation {
    device: Arc<Device>,
    base: sys::CUdeviceptr,
    size: usize,
    granularity: usize,
    /// Mapped ranges: offset → size.
    mapped: Mutex<BTreeMap<usize, usize>>,
}

impl Reservation {
    /// Reserves `size` bytes, a positive multiple of the device's granularity.
    ///
    /// # Errors
    /// [`CudaError::InvalidArgument`] for a bad size; driver failure.
    pub fn new(device: &Arc<Device>, size: usize) -> Result<Arc<Self>, CudaError> {
        let granularity = granularity(device)?;
        if size == 0 || size % granularity != 0 {
            return Err(CudaError::InvalidArgument(format!(
                "reservation of {size} bytes: not a positive multiple of the {granularity}-byte granularity"
            )));
        }
        device.bind()?;
        // SAFETY: a context is current and `size` is granularity-aligned; the
        // range is freed exactly once, in drop.
        let base = unsafe { driver::address_reserve(size, 0) }.call("cuMemAddressReserve")?;
        Ok(Arc::new(Self {
            device: Arc::clone(device),
            base,
            size,
            granularity,
            mapped: Mutex::new(BTreeMap::new()),
        }))
    }

    /// First device address of the range.
    pub fn base(&self) -> sys::CUdeviceptr {
        self.base
    }

    /// Size of the range in bytes.
    pub fn size(&self) -> usize {
        self.size
    }

    /// The granularity every offset and size in this range is aligned to.
    pub fn granularity(&self) -> usize {
        self.granularity
    }

    /// Whether `offset` is the start of a live mapping.
    pub fn is_mapped_at(&self, offset: usize) -> bool {
        self.lock().contains_key(&offset)
    }

    fn lock(&self) -> MutexGuard<'_, BTreeMap<usize, usize>> {
        // The map stays consistent under panic (single inserts and removes).
        self.mapped.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if let Err(e) = self.device.bind() {
            tracing::error!("cannot bind context to free a reservation: {e}");
            return;
        }
        // SAFETY: the range came from cuMemAddressReserve with this size and is
        // freed once; every Mapping holds an Arc to us, so none is left.
        if let Err(e) = unsafe { driver::address_free(self.base, self.size) } {
            tracing::error!("cuMemAddressFree failed: {e}");
        }
    }
}

/// Physical device memory (one or more granules), not mapped anywhere. Released
/// on drop.
#[derive(Debug)]
pub struct PhysicalChunk {
    device: Arc<Device>,
    handle: sys::CUmemGenericAllocationHandle,
    size: usize,
}

impl PhysicalChunk {
    /// Creates `size` bytes of device memory, a positive multiple of the
    /// granularity. Slow (about 200 µs per 2 MiB): do it ahead of time.
    ///
    /// # Errors
    /// [`CudaError::InvalidArgument`] for a bad size; driver failure (out of
    /// memory included).
    pub fn new(device: &Arc<Device>, size: usize) -> Result<Self, CudaError> {
        let granularity = granularity(device)?;
        if size == 0 || size % granularity != 0 {
            return Err(CudaError::InvalidArgument(format!(
                "chunk of {size} bytes: not a positive multiple of the {granularity}-byte granularity"
            )));
        }
        device.bind()?;
        let prop = driver::device_allocation_prop(device.ordinal());
        // SAFETY: a context is current, `size` is aligned; released once in drop.
        let handle = unsafe { driver::create(size, &prop) }.call("cuMemCreate")?;
        Ok(Self {
            device: Arc::clone(device),
            handle,
            size,
        })
    }

    /// Size in bytes.
    pub fn size(&self) -> usize {
        self.size
    }
}

impl Drop for PhysicalChunk {
    fn drop(&mut self) {
        if let Err(e) = self.device.bind() {
            tracing::error!("cannot bind context to release a chunk: {e}");
            return;
        }
        // SAFETY: `handle` came from cuMemCreate and is released once. If it is
        // still mapped (it cannot be: a Mapping owns its chunk), the driver would
        // free the memory at unmap time.
        if let Err(e) = unsafe { driver::release(self.handle) } {
            tracing::error!("cuMemRelease failed: {e}");
        }
    }
}

/// A chunk mapped read-write for its device at an offset of a reservation.
/// Unmapped on drop (after the context is idle); [`Mapping::unmap`] does the same
/// and gives the chunk back for reuse.
#[derive(Debug)]
pub struct Mapping {
    reservation: Arc<Reservation>,
    offset: usize,
    chunk: Option<PhysicalChunk>,
}

/// A failed [`Mapping::new`]: the error, and the chunk handed back unharmed.
#[derive(Debug)]
pub struct MapError {
    /// Why the mapping failed.
    pub error: CudaError,
    /// The chunk, still unmapped.
    pub chunk: PhysicalChunk,
}

impl Mapping {
    /// Maps `chunk` at `offset` of `reservation` and grants the device read-write
    /// access (a new mapping is inaccessible until then).
    ///
    /// # Errors
    /// The chunk comes back in [`MapError`] when the offset is unaligned, the
    /// range leaves the reservation or overlaps a mapping, or the driver fails
    /// (a half-made mapping is unmapped first).
    pub fn new(
        reservation: &Arc<Reservation>,
        offset: usize,
        chunk: PhysicalChunk,
    ) -> Result<Self, MapError> {
        let size = chunk.size;
        let invalid = |msg: String| CudaError::InvalidArgument(msg);
        let check = || -> Result<(), CudaError> {
            if offset % reservation.granularity != 0 {
                return Err(invalid(format!(
                    "offset {offset} not aligned to {}",
                    reservation.granularity
                )));
            }
            if offset
                .checked_add(size)
                .is_none_or(|end| end > reservation.size)
            {
                return Err(invalid(format!(
                    "{offset}+{size} outside a {}-byte reservation",
                    reservation.size
                )));
            }
            Ok(())
        };
        if let Err(error) = check() {
            return Err(MapError { error, chunk });
        }
        let mut mapped = reservation.lock();
        let before = mapped.range(..offset + size).next_back();
        if let Some((&o, &s)) = before.filter(|(&o, &s)| o + s > offset) {
            drop(mapped);
            let error = invalid(format!("{offset}+{size} overlaps the mapping at {o}+{s}"));
            return Err(MapError { error, chunk });
        }
        if let Err(error) = reservation.device.bind() {
            drop(mapped);
            return Err(MapError { error, chunk });
        }
        let ptr = reservation.base + offset as u64;
        // SAFETY: the range is inside the live reservation, aligned, and not
        // mapped (checked under the lock we hold); the chunk is `size` bytes.
        if let Err(e) = unsafe { driver::map(ptr, size, 0, chunk.handle) } {
            drop(mapped);
            return Err(MapError {
                error: CudaError::Driver {
                    call: "cuMemMap",
                    error: e,
                },
                chunk,
            });
        }
        let access = [driver::device_read_write(reservation.device.ordinal())];
        // SAFETY: the range was fully mapped just above.
        if let Err(e) = unsafe { driver::set_access(ptr, size, &access) } {
            // SAFETY: exactly the range mapped above; nothing could use it yet.
            if let Err(u) = unsafe { driver::unmap(ptr, size) } {
                tracing::error!("cuMemUnmap after a failed cuMemSetAccess failed: {u}");
            }
            drop(mapped);
            return Err(MapError {
                error: CudaError::Driver {
                    call: "cuMemSetAccess",
                    error: e,
                },
                chunk,
            });
        }
        mapped.insert(offset, size);
        drop(mapped);
        Ok(Self {
            reservation: Arc::clone(reservation),
            offset,
            chunk: Some(chunk),
        })
    }

    /// Device address of the mapped range.
    pub fn ptr(&self) -> sys::CUdeviceptr {
        self.reservation.base + self.offset as u64
    }

    /// Offset in the reservation.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// Size of the mapped range.
    pub fn size(&self) -> usize {
        self.chunk.as_ref().map_or(0, |c| c.size)
    }

    /// Waits until the context is idle, unmaps the range and returns the chunk
    /// (its contents kept) for mapping elsewhere.
    ///
    /// # Errors
    /// Driver failure; the mapping is then dropped (which retries the unmap).
    pub fn unmap(mut self) -> Result<PhysicalChunk, CudaError> {
        self.unmap_range()?;
        Ok(self.chunk.take().expect("chunk present until unmapped"))
    }

    fn unmap_range(&mut self) -> Result<(), CudaError> {
        let size = self.size();
        if size == 0 {
            return Ok(());
        }
        // cuMemUnmap is synchronous but does not wait for work using the range.
        self.reservation.device.synchronize()?;
        // SAFETY: exactly the range this mapping made; the context is idle, so no
        // queued work touches it.
        unsafe { driver::unmap(self.ptr(), size) }.call("cuMemUnmap")?;
        self.reservation.lock().remove(&self.offset);
        Ok(())
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        if self.chunk.is_some() {
            if let Err(e) = self.unmap_range() {
                tracing::error!("unmapping at offset {} failed: {e}", self.offset);
            }
        }
    }
}
