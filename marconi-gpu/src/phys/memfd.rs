//! Linux host backend: one memfd is the physical pool, `mmap` does the mapping.
//!
//! Chunk `i` is the byte range `[i·g, (i+1)·g)` of the memfd. A reservation is a
//! private `PROT_NONE` anonymous mapping; mapping a chunk replaces one granule of
//! it with `MAP_FIXED | MAP_SHARED` of the memfd; unmapping replaces it again with
//! `PROT_NONE` anonymous memory (never `munmap` of a sub-range, which would open a
//! hole another `mmap` could take). Releasing a chunk punches a hole in the memfd
//! (`fallocate(PUNCH_HOLE)`): `MADV_DONTNEED` would not give shmem pages back.
//! Pages are committed on first touch, so [`PhysicalMemory::physical_bytes`]
//! (the memfd's `st_blocks`) counts what was actually written.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use super::{ChunkId, PhysError, PhysicalMemory, ReservationId, DEFAULT_GRANULARITY};

#[derive(Debug)]
struct Reservation {
    /// Start address; kept as an integer so the backend is `Send`.
    base: usize,
    len: usize,
    /// Chunk mapped at each granule.
    mapped: Vec<Option<ChunkId>>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ChunkState {
    Free,
    Created,
    Mapped,
}

/// Host implementation of [`PhysicalMemory`] over one memfd.
#[derive(Debug)]
pub struct MemfdBackend {
    fd: OwnedFd,
    granularity: usize,
    chunks: Vec<ChunkState>,
    free_slots: Vec<u32>,
    reservations: Vec<Option<Reservation>>,
}

fn os_err(op: &'static str) -> PhysError {
    PhysError::Os {
        op,
        errno: std::io::Error::last_os_error().raw_os_error().unwrap_or(0),
    }
}

impl MemfdBackend {
    /// A backend able to create up to `max_chunks` chunks of 2 MiB.
    pub fn new(max_chunks: usize) -> Result<Self, PhysError> {
        Self::with_granularity(max_chunks, DEFAULT_GRANULARITY)
    }

    /// A backend with chunks of `granularity` bytes (a multiple of the page size).
    pub fn with_granularity(max_chunks: usize, granularity: usize) -> Result<Self, PhysError> {
        // SAFETY: sysconf has no memory-safety preconditions.
        let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096);
        if granularity == 0 || granularity % page != 0 {
            return Err(PhysError::Unaligned(granularity));
        }
        let size = max_chunks
            .checked_mul(granularity)
            .and_then(|s| libc::off_t::try_from(s).ok())
            .ok_or(PhysError::OutOfChunks(max_chunks))?;
        let max_u32 = u32::try_from(max_chunks).map_err(|_| PhysError::OutOfChunks(max_chunks))?;
        // SAFETY: the name is a valid NUL-terminated string; the flags are valid.
        let raw = unsafe { libc::memfd_create(c"marconi-phys".as_ptr(), libc::MFD_CLOEXEC) };
        if raw < 0 {
            return Err(os_err("memfd_create"));
        }
        // SAFETY: `raw` is a fresh descriptor nobody else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: `fd` is a valid memfd; a sparse size commits no memory.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), size) } != 0 {
            return Err(os_err("ftruncate"));
        }
        Ok(MemfdBackend {
            fd,
            granularity,
            chunks: vec![ChunkState::Free; max_chunks],
            free_slots: (0..max_u32).rev().collect(),
            reservations: Vec::new(),
        })
    }

    /// Host address of a reservation's first byte (the twin of
    /// `CudaPhysical::base`): mapped granules are readable and writable
    /// there, the others are `PROT_NONE`. Stable until the reservation is
    /// freed.
    ///
    /// # Errors
    /// [`PhysError::UnknownReservation`].
    pub fn base(&self, r: ReservationId) -> Result<usize, PhysError> {
        Ok(self.res(r)?.base)
    }

    fn res(&self, r: ReservationId) -> Result<&Reservation, PhysError> {
        self.reservations
            .get(r.0 as usize)
            .and_then(Option::as_ref)
            .ok_or(PhysError::UnknownReservation(r.0))
    }

    fn granule(&self, res: &Reservation, offset: usize) -> Result<usize, PhysError> {
        if offset % self.granularity != 0 {
            return Err(PhysError::Unaligned(offset));
        }
        if offset >= res.len {
            return Err(PhysError::OutOfRange {
                offset,
                len: self.granularity,
                size: res.len,
            });
        }
        Ok(offset / self.granularity)
    }

    /// Checks that `[offset, offset+len)` of `r` is entirely mapped; returns its base.
    fn mapped_range(
        &self,
        r: ReservationId,
        offset: usize,
        len: usize,
    ) -> Result<usize, PhysError> {
        let res = self.res(r)?;
        let end =
            offset
                .checked_add(len)
                .filter(|&e| e <= res.len)
                .ok_or(PhysError::OutOfRange {
                    offset,
                    len,
                    size: res.len,
                })?;
        if len > 0 {
            for g in offset / self.granularity..=(end - 1) / self.granularity {
                if res.mapped[g].is_none() {
                    return Err(PhysError::NotMapped(g * self.granularity));
                }
            }
        }
        Ok(res.base)
    }

    /// Replaces `[addr, addr+len)` with inaccessible anonymous memory.
    fn protect_none(addr: usize, len: usize) -> Result<(), PhysError> {
        // SAFETY: the caller passes a range inside one of our reservations, which we
        // own exclusively; MAP_FIXED over it replaces only our own mapping.
        let p = unsafe {
            libc::mmap(
                addr as *mut libc::c_void,
                len,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE | libc::MAP_FIXED,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(os_err("mmap(PROT_NONE)"));
        }
        Ok(())
    }
}

impl PhysicalMemory for MemfdBackend {
    fn granularity(&self) -> usize {
        self.granularity
    }

    fn reserve(&mut self, bytes: usize) -> Result<ReservationId, PhysError> {
        if bytes == 0 || bytes % self.granularity != 0 {
            return Err(PhysError::Unaligned(bytes));
        }
        let id = u32::try_from(self.reservations.len())
            .map_err(|_| PhysError::UnknownReservation(u32::MAX))?;
        // SAFETY: a fresh anonymous PROT_NONE mapping at an address the kernel picks.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                bytes,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(os_err("mmap(reserve)"));
        }
        self.reservations.push(Some(Reservation {
            base: p as usize,
            len: bytes,
            mapped: vec![None; bytes / self.granularity],
        }));
        Ok(ReservationId(id))
    }

    fn free_reservation(&mut self, r: ReservationId) -> Result<(), PhysError> {
        let res = self
            .reservations
            .get_mut(r.0 as usize)
            .and_then(Option::take)
            .ok_or(PhysError::UnknownReservation(r.0))?;
        for c in res.mapped.iter().flatten() {
            self.chunks[c.0 as usize] = ChunkState::Created;
        }
        // SAFETY: the whole reservation, which we own and nothing references any more.
        if unsafe { libc::munmap(res.base as *mut libc::c_void, res.len) } != 0 {
            return Err(os_err("munmap"));
        }
        Ok(())
    }

    fn create_chunk(&mut self) -> Result<ChunkId, PhysError> {
        let slot = self
            .free_slots
            .pop()
            .ok_or(PhysError::OutOfChunks(self.chunks.len()))?;
        self.chunks[slot as usize] = ChunkState::Created;
        Ok(ChunkId(slot))
    }

    fn release_chunk(&mut self, c: ChunkId) -> Result<(), PhysError> {
        match self.chunks.get(c.0 as usize) {
            Some(ChunkState::Created) => {}
            Some(ChunkState::Mapped) => return Err(PhysError::ChunkMapped(c.0)),
            _ => return Err(PhysError::UnknownChunk(c.0)),
        }
        let off = libc::off_t::try_from(c.0 as usize * self.granularity)
            .map_err(|_| PhysError::UnknownChunk(c.0))?;
        let len = libc::off_t::try_from(self.granularity)
            .map_err(|_| PhysError::Unaligned(self.granularity))?;
        // SAFETY: punching a hole in our own memfd; no mapping of this chunk exists.
        let rc = unsafe {
            libc::fallocate(
                self.fd.as_raw_fd(),
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                off,
                len,
            )
        };
        if rc != 0 {
            return Err(os_err("fallocate(PUNCH_HOLE)"));
        }
        self.chunks[c.0 as usize] = ChunkState::Free;
        self.free_slots.push(c.0);
        Ok(())
    }

    fn map(&mut self, r: ReservationId, offset: usize, c: ChunkId) -> Result<(), PhysError> {
        match self.chunks.get(c.0 as usize) {
            Some(ChunkState::Created) => {}
            Some(ChunkState::Mapped) => return Err(PhysError::ChunkMapped(c.0)),
            _ => return Err(PhysError::UnknownChunk(c.0)),
        }
        let res = self.res(r)?;
        let g = self.granule(res, offset)?;
        if res.mapped[g].is_some() {
            return Err(PhysError::AlreadyMapped(offset));
        }
        let addr = res.base + offset;
        let file_off = libc::off_t::try_from(c.0 as usize * self.granularity)
            .map_err(|_| PhysError::UnknownChunk(c.0))?;
        // SAFETY: [addr, addr+g) lies inside reservation `r` (checked by `granule`),
        // which we own; MAP_FIXED replaces only our PROT_NONE placeholder there. The
        // file range is chunk `c` of our memfd, within its size.
        let p = unsafe {
            libc::mmap(
                addr as *mut libc::c_void,
                self.granularity,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_FIXED,
                self.fd.as_raw_fd(),
                file_off,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(os_err("mmap(MAP_FIXED|MAP_SHARED)"));
        }
        if let Some(Some(res)) = self.reservations.get_mut(r.0 as usize) {
            res.mapped[g] = Some(c);
        }
        self.chunks[c.0 as usize] = ChunkState::Mapped;
        Ok(())
    }

    fn unmap(&mut self, r: ReservationId, offset: usize) -> Result<ChunkId, PhysError> {
        let res = self.res(r)?;
        let g = self.granule(res, offset)?;
        let c = res.mapped[g].ok_or(PhysError::NotMapped(offset))?;
        Self::protect_none(res.base + offset, self.granularity)?;
        if let Some(Some(res)) = self.reservations.get_mut(r.0 as usize) {
            res.mapped[g] = None;
        }
        self.chunks[c.0 as usize] = ChunkState::Created;
        Ok(c)
    }

    fn write(&mut self, r: ReservationId, offset: usize, data: &[u8]) -> Result<(), PhysError> {
        let base = self.mapped_range(r, offset, data.len())?;
        // SAFETY: every granule of [base+offset, +len) is mapped read-write (checked
        // above) and `data` cannot overlap it (our mappings are never handed out).
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), (base + offset) as *mut u8, data.len());
        }
        Ok(())
    }

    fn read(&self, r: ReservationId, offset: usize, out: &mut [u8]) -> Result<(), PhysError> {
        let base = self.mapped_range(r, offset, out.len())?;
        // SAFETY: every granule of the source range is mapped readable (checked
        // above); `out` is a distinct exclusive buffer.
        unsafe {
            std::ptr::copy_nonoverlapping(
                (base + offset) as *const u8,
                out.as_mut_ptr(),
                out.len(),
            );
        }
        Ok(())
    }

    fn physical_bytes(&self) -> Result<u64, PhysError> {
        let mut st = std::mem::MaybeUninit::<libc::stat>::uninit();
        // SAFETY: `st` is a writable stat buffer; `fd` is valid.
        if unsafe { libc::fstat(self.fd.as_raw_fd(), st.as_mut_ptr()) } != 0 {
            return Err(os_err("fstat"));
        }
        // SAFETY: fstat succeeded, so it initialised `st`.
        let st = unsafe { st.assume_init() };
        // st_blocks is in 512-byte units whatever the filesystem block size.
        Ok(u64::try_from(st.st_blocks).unwrap_or(0) * 512)
    }
}

impl Drop for MemfdBackend {
    fn drop(&mut self) {
        for res in self.reservations.iter().flatten() {
            // SAFETY: each live reservation is a mapping we created and own; nothing
            // borrowed from it outlives the backend (reads and writes copy).
            unsafe {
                libc::munmap(res.base as *mut libc::c_void, res.len);
            }
        }
        // The memfd closes with `fd`, which frees all its pages.
    }
}
