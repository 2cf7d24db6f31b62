//! The memfd host backend and physical migration, measured on the real memfd
//! (`st_blocks`): the footprint never exceeds the budget, not even inside a
//! migration, and falls when chunks are released.

use std::cell::Cell;

use marconi_gpu::phys::{
    BackedPool, ChunkId, MemfdBackend, PhysError, PhysicalMemory, ReservationId,
};
use marconi_gpu::{
    DualPool, DualPoolConfig, MigrationPolicy, PoolAllocator, PoolKind, VirtualHandle,
};

const MIB: usize = 1 << 20;

#[test]
fn contents_survive_unmap_and_remap_elsewhere() {
    let mut b = MemfdBackend::new(4).unwrap();
    assert_eq!(b.granularity(), 2 * MIB);
    let r1 = b.reserve(4 * MIB).unwrap();
    let r2 = b.reserve(4 * MIB).unwrap();
    let c = b.create_chunk().unwrap();
    b.map(r1, 2 * MIB, c).unwrap();
    b.write(r1, 2 * MIB + 100, b"state after token 1000")
        .unwrap();
    assert_eq!(b.map(r2, 0, c), Err(PhysError::ChunkMapped(c.raw())));
    assert_eq!(b.unmap(r1, 2 * MIB).unwrap(), c);
    assert_eq!(
        b.read(r1, 2 * MIB, &mut [0; 4]),
        Err(PhysError::NotMapped(2 * MIB))
    );
    // Remapped at another offset of another reservation: same bytes.
    b.map(r2, 0, c).unwrap();
    let mut out = [0u8; 22];
    b.read(r2, 100, &mut out).unwrap();
    assert_eq!(&out, b"state after token 1000");
    assert_eq!(b.map(r2, 0, c), Err(PhysError::ChunkMapped(c.raw())));
    assert_eq!(b.release_chunk(c), Err(PhysError::ChunkMapped(c.raw())));
    assert_eq!(b.map(r1, 1, c), Err(PhysError::ChunkMapped(c.raw())));
    assert!(matches!(
        b.unmap(r1, 6 * MIB),
        Err(PhysError::OutOfRange { .. })
    ));
    assert_eq!(b.reserve(MIB), Err(PhysError::Unaligned(MIB)));
}

#[test]
fn release_punches_the_memory_back() {
    let mut b = MemfdBackend::new(8).unwrap();
    let r = b.reserve(16 * MIB).unwrap();
    assert_eq!(b.physical_bytes().unwrap(), 0, "reserving commits nothing");
    let mut chunks = vec![];
    for k in 0..8 {
        let c = b.create_chunk().unwrap();
        b.map(r, k * 2 * MIB, c).unwrap();
        b.write(r, k * 2 * MIB, &vec![0xAB; 2 * MIB]).unwrap();
        chunks.push(c);
    }
    assert!(matches!(b.create_chunk(), Err(PhysError::OutOfChunks(8))));
    assert_eq!(b.physical_bytes().unwrap(), 16 * MIB as u64);
    for k in (4..8).rev() {
        let before = b.physical_bytes().unwrap();
        let c = b.unmap(r, k * 2 * MIB).unwrap();
        // Unmapped but not released: still committed (contents kept).
        assert_eq!(b.physical_bytes().unwrap(), before);
        b.release_chunk(c).unwrap();
        assert_eq!(b.physical_bytes().unwrap(), before - 2 * MIB as u64);
    }
    assert_eq!(b.physical_bytes().unwrap(), 8 * MIB as u64);
    // A recreated chunk is zero (the hole was punched).
    let c = b.create_chunk().unwrap();
    b.map(r, 4 * 2 * MIB, c).unwrap();
    let mut out = vec![1u8; 4096];
    b.read(r, 4 * 2 * MIB, &mut out).unwrap();
    assert!(out.iter().all(|&x| x == 0));
    b.free_reservation(r).unwrap();
    assert_eq!(b.free_reservation(r), Err(PhysError::UnknownReservation(0)));
}

/// Delegates to the memfd backend and records the largest footprint seen after
/// every single operation.
struct Watched {
    inner: MemfdBackend,
    peak: Cell<u64>,
}

impl Watched {
    fn note<T>(&self, r: Result<T, PhysError>) -> Result<T, PhysError> {
        let now = self.inner.physical_bytes()?;
        self.peak.set(self.peak.get().max(now));
        r
    }
}

impl PhysicalMemory for Watched {
    fn granularity(&self) -> usize {
        self.inner.granularity()
    }
    fn reserve(&mut self, bytes: usize) -> Result<ReservationId, PhysError> {
        let r = self.inner.reserve(bytes);
        self.note(r)
    }
    fn free_reservation(&mut self, r: ReservationId) -> Result<(), PhysError> {
        let x = self.inner.free_reservation(r);
        self.note(x)
    }
    fn create_chunk(&mut self) -> Result<ChunkId, PhysError> {
        let x = self.inner.create_chunk();
        self.note(x)
    }
    fn release_chunk(&mut self, c: ChunkId) -> Result<(), PhysError> {
        let x = self.inner.release_chunk(c);
        self.note(x)
    }
    fn map(&mut self, r: ReservationId, offset: usize, c: ChunkId) -> Result<(), PhysError> {
        let x = self.inner.map(r, offset, c);
        self.note(x)
    }
    fn unmap(&mut self, r: ReservationId, offset: usize) -> Result<ChunkId, PhysError> {
        let x = self.inner.unmap(r, offset);
        self.note(x)
    }
    fn write(&mut self, r: ReservationId, offset: usize, data: &[u8]) -> Result<(), PhysError> {
        let x = self.inner.write(r, offset, data);
        self.note(x)
    }
    fn read(&self, r: ReservationId, offset: usize, out: &mut [u8]) -> Result<(), PhysError> {
        self.inner.read(r, offset, out)
    }
    fn physical_bytes(&self) -> Result<u64, PhysError> {
        self.inner.physical_bytes()
    }
}

fn fill_all(p: &mut BackedPool<Watched>, pool: PoolKind, tag: u8) -> Vec<VirtualHandle> {
    let n = p.free_units(pool);
    let mut hs = vec![];
    p.allocate(pool, n, &mut hs).unwrap();
    let unit = usize::try_from(p.unit_bytes(pool)).unwrap();
    for (i, &h) in hs.iter().enumerate() {
        let mut data = vec![tag; unit];
        data[..8].copy_from_slice(&(i as u64).to_le_bytes());
        p.write_unit(h, 0, &data).unwrap();
    }
    hs
}

#[test]
fn migration_moves_chunks_and_never_exceeds_the_budget() {
    const BUDGET: u64 = 64 << 20;
    let pool = DualPool::new(
        "avmp_dynamic",
        DualPoolConfig {
            total_bytes: BUDGET,
            ssm_ratio: 0.5,
            kv_unit: 64 << 10,
            ssm_unit: 256 << 10,
            policy: MigrationPolicy::forced(16), // 4 MiB = 2 chunks per step
        },
    )
    .unwrap();
    let backend = Watched {
        inner: MemfdBackend::new(32).unwrap(),
        peak: Cell::new(0),
    };
    let mut p = BackedPool::new(pool, backend).unwrap();
    assert_eq!((p.budget_chunks(), p.mapped_chunks()), (32, 32));

    // Touch every byte of both pools: the footprint is the whole budget, once.
    let kv = fill_all(&mut p, PoolKind::Kv, 0x11);
    let ssm = fill_all(&mut p, PoolKind::Ssm, 0x22);
    assert_eq!(p.backend().physical_bytes().unwrap(), BUDGET);

    // Free the SSM pool's upper half and move it to KV, 2 chunks per step.
    for &h in &ssm[64..] {
        p.free(h).unwrap();
    }
    for _ in 0..4 {
        let m = p.migrate_toward(PoolKind::Kv).unwrap();
        assert_eq!(m.recipient_units, 64);
        assert!(p.mapped_chunks() <= p.budget_chunks());
    }
    assert_eq!(
        (p.capacity(PoolKind::Kv), p.capacity(PoolKind::Ssm)),
        (768, 64)
    );
    assert_eq!(p.chunks_moved(), 8);
    // The donor's tail is in use now: refused, and nothing moves.
    assert!(p.migrate_toward(PoolKind::Kv).is_err());

    // The new KV pages are real memory: fill them, and every old unit kept its bytes.
    let more = fill_all(&mut p, PoolKind::Kv, 0x33);
    assert_eq!(more.len(), 256);
    for (i, &h) in kv.iter().enumerate() {
        let mut b = [0u8; 9];
        p.read_unit(h, 0, &mut b).unwrap();
        assert_eq!(u64::from_le_bytes(b[..8].try_into().unwrap()), i as u64);
        assert_eq!(b[8], 0x11);
    }
    for (i, &h) in ssm[..64].iter().enumerate() {
        let mut b = [0u8; 9];
        p.read_unit(h, 0, &mut b).unwrap();
        assert_eq!(
            (u64::from_le_bytes(b[..8].try_into().unwrap()), b[8]),
            (i as u64, 0x22)
        );
    }
    assert!(
        p.backend().peak.get() <= BUDGET,
        "peak {} > budget",
        p.backend().peak.get()
    );
    assert_eq!(p.backend().physical_bytes().unwrap(), BUDGET);

    // Stale handles cannot reach memory.
    assert!(p.read_unit(ssm[100], 0, &mut [0; 1]).is_err());

    // Releasing gives the memory back.
    let b = p.into_backend().unwrap();
    assert_eq!(b.physical_bytes().unwrap(), 0);
    assert!(b.peak.get() <= BUDGET);
}

#[test]
fn units_that_straddle_chunks_stay_within_the_budget() {
    // 3 MiB SSM blocks do not divide 2 MiB chunks: 10 blocks = 30 MiB = 15 chunks.
    const BUDGET: u64 = 64 << 20;
    let pool = DualPool::new(
        "straddle",
        DualPoolConfig {
            total_bytes: BUDGET,
            ssm_ratio: 0.5,
            kv_unit: 64 << 10,
            ssm_unit: 3 << 20,
            policy: MigrationPolicy::forced(64), // 4 MiB of KV per step = 1 block
        },
    )
    .unwrap();
    let backend = Watched {
        inner: MemfdBackend::new(32).unwrap(),
        peak: Cell::new(0),
    };
    let mut p = BackedPool::new(pool, backend).unwrap();
    assert_eq!(p.mapped_chunks(), 16 + 15);
    let ssm = fill_all(&mut p, PoolKind::Ssm, 0x44);
    for step in 1..=4u32 {
        let m = p.migrate_toward(PoolKind::Ssm).unwrap();
        assert_eq!((m.donor_units, m.recipient_units), (64, 1));
        assert!(p.mapped_chunks() <= p.budget_chunks(), "step {step}");
        let more = fill_all(&mut p, PoolKind::Ssm, 0x55);
        assert_eq!(more.len(), 1);
    }
    // 14 blocks = 42 MiB = 21 chunks; KV 16 MiB = 8 chunks; 29 of 32 mapped.
    assert_eq!(
        (p.capacity(PoolKind::Ssm), p.capacity(PoolKind::Kv)),
        (14, 256)
    );
    assert_eq!(p.mapped_chunks(), 29);
    for (i, &h) in ssm.iter().enumerate() {
        let mut b = [0u8; 9];
        p.read_unit(h, 0, &mut b).unwrap();
        assert_eq!(
            (u64::from_le_bytes(b[..8].try_into().unwrap()), b[8]),
            (i as u64, 0x44)
        );
    }
    assert!(p.backend().peak.get() <= BUDGET);
    assert!(p.backend().physical_bytes().unwrap() <= BUDGET);
}
