//! [`PhysicalMemory`] over the CUDA virtual memory API: the GPU twin of
//! [`crate::phys::MemfdBackend`], built from the RAII types of [`super::vmm`].

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::result;

use super::vmm::{self, Mapping, PhysicalChunk, Reservation};
use super::{CudaError, Device};
use crate::phys::{ChunkId, PhysError, PhysicalMemory, ReservationId};

/// Physical memory on one GPU: reservations of device address space, chunks of
/// one granularity each (created ahead of time by the caller's `create_chunk`
/// calls), and mappings between them.
#[derive(Debug)]
pub struct CudaPhysical {
    device: Arc<Device>,
    granularity: usize,
    max_chunks: usize,
    next_id: u32,
    reservations: HashMap<u32, Arc<Reservation>>,
    /// Chunks not mapped anywhere.
    idle: HashMap<u32, PhysicalChunk>,
    /// Live mappings: (reservation, offset) → (chunk id, mapping).
    mapped: HashMap<(u32, usize), (u32, Mapping)>,
}

fn phys_err(e: CudaError) -> PhysError {
    match e {
        CudaError::Driver { call, error } => PhysError::Os {
            op: call,
            errno: error.0 as i32,
        },
        other => {
            tracing::error!("CUDA physical backend: {other}");
            PhysError::Os {
                op: "cuda",
                errno: -1,
            }
        }
    }
}

impl CudaPhysical {
    /// A backend on `device` that creates at most `max_chunks` chunks.
    ///
    /// # Errors
    /// [`CudaError::InvalidArgument`] when the device lacks virtual memory
    /// management; driver failures.
    pub fn new(device: &Arc<Device>, max_chunks: usize) -> Result<Self, CudaError> {
        if !device.supports_vmm()? {
            return Err(CudaError::InvalidArgument(
                "device does not support virtual memory management".into(),
            ));
        }
        let granularity = vmm::granularity(device)?;
        Ok(Self {
            device: Arc::clone(device),
            granularity,
            max_chunks,
            next_id: 0,
            reservations: HashMap::new(),
            idle: HashMap::new(),
            mapped: HashMap::new(),
        })
    }

    /// Device address of a reservation's first byte, for kernels and
    /// [`super::snapshot::CudaStateArena`] planes.
    ///
    /// # Errors
    /// [`PhysError::UnknownReservation`].
    pub fn base(&self, r: ReservationId) -> Result<u64, PhysError> {
        Ok(self.reservation(r)?.base())
    }

    fn fresh_id(&mut self) -> u32 {
        self.next_id = self.next_id.wrapping_add(1);
        self.next_id
    }

    fn reservation(&self, r: ReservationId) -> Result<&Arc<Reservation>, PhysError> {
        self.reservations
            .get(&r.raw())
            .ok_or(PhysError::UnknownReservation(r.raw()))
    }

    fn chunk_count(&self) -> usize {
        self.idle.len() + self.mapped.len()
    }

    /// Splits `[offset, offset + len)` of `r` into mapped pieces (device address,
    /// length), failing on the first unmapped chunk.
    fn pieces(
        &self,
        r: ReservationId,
        offset: usize,
        len: usize,
    ) -> Result<Vec<(u64, usize)>, PhysError> {
        let res = self.reservation(r)?;
        if offset.checked_add(len).is_none_or(|end| end > res.size()) {
            return Err(PhysError::OutOfRange {
                offset,
                len,
                size: res.size(),
            });
        }
        let g = self.granularity;
        let mut out = Vec::new();
        let mut at = offset;
        while at < offset + len {
            let chunk_start = at - at % g;
            if !self.mapped.contains_key(&(r.raw(), chunk_start)) {
                return Err(PhysError::NotMapped(chunk_start));
            }
            let n = (chunk_start + g).min(offset + len) - at;
            out.push((res.base() + at as u64, n));
            at += n;
        }
        Ok(out)
    }
}

impl PhysicalMemory for CudaPhysical {
    fn granularity(&self) -> usize {
        self.granularity
    }

    fn reserve(&mut self, bytes: usize) -> Result<ReservationId, PhysError> {
        if bytes == 0 || bytes % self.granularity != 0 {
            return Err(PhysError::Unaligned(bytes));
        }
        let res = Reservation::new(&self.device, bytes).map_err(phys_err)?;
        let id = self.fresh_id();
        self.reservations.insert(id, res);
        Ok(ReservationId::from_raw(id))
    }

    fn free_reservation(&mut self, r: ReservationId) -> Result<(), PhysError> {
        self.reservation(r)?;
        let offsets: Vec<usize> = self
            .mapped
            .keys()
            .filter(|k| k.0 == r.raw())
            .map(|k| k.1)
            .collect();
        for offset in offsets {
            self.unmap(r, offset)?;
        }
        // The last Arc: dropping it frees the address range.
        self.reservations.remove(&r.raw());
        Ok(())
    }

    fn create_chunk(&mut self) -> Result<ChunkId, PhysError> {
        if self.chunk_count() >= self.max_chunks {
            return Err(PhysError::OutOfChunks(self.max_chunks));
        }
        let chunk = PhysicalChunk::new(&self.device, self.granularity).map_err(phys_err)?;
        let id = self.fresh_id();
        self.idle.insert(id, chunk);
        Ok(ChunkId::from_raw(id))
    }

    fn release_chunk(&mut self, c: ChunkId) -> Result<(), PhysError> {
        if self.mapped.values().any(|(id, _)| *id == c.raw()) {
            return Err(PhysError::ChunkMapped(c.raw()));
        }
        // Dropping the chunk calls cuMemRelease.
        self.idle
            .remove(&c.raw())
            .map(drop)
            .ok_or(PhysError::UnknownChunk(c.raw()))
    }

    fn map(&mut self, r: ReservationId, offset: usize, c: ChunkId) -> Result<(), PhysError> {
        let res = Arc::clone(self.reservation(r)?);
        if offset % self.granularity != 0 {
            return Err(PhysError::Unaligned(offset));
        }
        if offset
            .checked_add(self.granularity)
            .is_none_or(|end| end > res.size())
        {
            return Err(PhysError::OutOfRange {
                offset,
                len: self.granularity,
                size: res.size(),
            });
        }
        if self.mapped.contains_key(&(r.raw(), offset)) {
            return Err(PhysError::AlreadyMapped(offset));
        }
        if self.mapped.values().any(|(id, _)| *id == c.raw()) {
            return Err(PhysError::ChunkMapped(c.raw()));
        }
        let chunk = self
            .idle
            .remove(&c.raw())
            .ok_or(PhysError::UnknownChunk(c.raw()))?;
        match Mapping::new(&res, offset, chunk) {
            Ok(mapping) => {
                self.mapped.insert((r.raw(), offset), (c.raw(), mapping));
                Ok(())
            }
            Err(failed) => {
                self.idle.insert(c.raw(), failed.chunk);
                Err(phys_err(failed.error))
            }
        }
    }

    fn unmap(&mut self, r: ReservationId, offset: usize) -> Result<ChunkId, PhysError> {
        self.reservation(r)?;
        let (id, mapping) = self
            .mapped
            .remove(&(r.raw(), offset))
            .ok_or(PhysError::NotMapped(offset))?;
        let chunk = mapping.unmap().map_err(phys_err)?;
        self.idle.insert(id, chunk);
        Ok(ChunkId::from_raw(id))
    }

    fn write(&mut self, r: ReservationId, offset: usize, data: &[u8]) -> Result<(), PhysError> {
        let pieces = self.pieces(r, offset, data.len())?;
        self.device.bind().map_err(phys_err)?;
        let mut rest = data;
        for (ptr, n) in pieces {
            let (head, tail) = rest.split_at(n);
            // SAFETY: `ptr..ptr+n` lies in a live, read-write mapping (checked by
            // `pieces`); the copy is synchronous.
            unsafe { result::memcpy_htod_sync(ptr, head) }.map_err(|e| PhysError::Os {
                op: "cuMemcpyHtoD",
                errno: e.0 as i32,
            })?;
            rest = tail;
        }
        Ok(())
    }

    fn read(&self, r: ReservationId, offset: usize, out: &mut [u8]) -> Result<(), PhysError> {
        let pieces = self.pieces(r, offset, out.len())?;
        self.device.bind().map_err(phys_err)?;
        let mut rest = out;
        for (ptr, n) in pieces {
            let (head, tail) = rest.split_at_mut(n);
            // SAFETY: as in `write`.
            unsafe { result::memcpy_dtoh_sync(head, ptr) }.map_err(|e| PhysError::Os {
                op: "cuMemcpyDtoH",
                errno: e.0 as i32,
            })?;
            rest = tail;
        }
        Ok(())
    }

    fn physical_bytes(&self) -> Result<u64, PhysError> {
        Ok((self.chunk_count() * self.granularity) as u64)
    }
}

impl Drop for CudaPhysical {
    fn drop(&mut self) {
        // Mappings first (they wait for the context and unmap), then chunks and
        // reservations drop with the maps.
        self.mapped.clear();
    }
}
