//! The prefix cache over pools (`marconi_gpu::pooled`): the request cycle
//! with handles, eviction back into the pools, migrate-or-evict, refusals,
//! and a property test of the whole cycle over memfd-backed pools with the
//! joined invariants checked after every step.

use marconi_core::{AlphaMode, CacheConfig, ModelSpec};
use marconi_gpu::phys::{BackedPool, MemfdBackend, PhysicalMemory};
use marconi_gpu::pooled::{
    build_pool, dual_pool, unit_sizes, PoolLayout, PooledCache, PooledError, PooledState,
    PooledStats,
};
use marconi_gpu::{PoolAllocator, PoolKind, VirtualHandle};
use proptest::prelude::*;

mod common;
use common::tiny;

const PAGE: u32 = 4;

fn cfg(lru: bool) -> CacheConfig {
    let mut c = if lru {
        CacheConfig::sglang_plus(tiny(), 1)
    } else {
        CacheConfig::marconi(tiny(), 1)
    };
    c.page_size = PAGE;
    // Branch checkpoints at any depth: these requests share prefixes of a
    // few pages, which the default min_branch_depth would not checkpoint.
    c.min_branch_depth = 0;
    if !lru {
        c.alpha = AlphaMode::Fixed(1.0);
    }
    c
}

#[test]
fn unit_sizes_follow_the_model() {
    // 4 tokens × 128 B = 512 B a page; 2048 B a state; both 128-aligned.
    assert_eq!(unit_sizes(&tiny(), PAGE), (512, 2048));
    assert_eq!(unit_sizes(&tiny(), 3), (384, 2048));
    let mut odd = tiny();
    odd.conv_kernel = 4; // (512 + 256) · 2 = 1536 B, already aligned
    odd.kv_heads = 1; // 64 B a token: 3 · 64 = 192 -> 256
    assert_eq!(unit_sizes(&odd, 3), (256, 1536));
}

#[test]
fn a_second_turn_reuses_the_cached_handles() {
    let pool = dual_pool(
        &tiny(),
        PAGE,
        64 << 10,
        PoolLayout::Static { ssm_fraction: 0.5 },
    )
    .unwrap();
    let mut c = PooledCache::new(cfg(true), pool).unwrap();
    let prompt: Vec<u32> = (0..20).collect();
    let l = c.lookup(0, &prompt).unwrap();
    assert_eq!(l.lookup.hit_tokens, 0);
    // 20 input + 4 decoded tokens: 6 pages, one final state at 24.
    let mut full = prompt.clone();
    full.extend(100..104);
    let r = c.reserve(6, 1).unwrap();
    assert_eq!((r.kv_pages.len(), r.state_slots.len()), (6, 1));
    assert!(r.kv_pages.iter().all(|h| h.pool() == PoolKind::Kv));
    assert!(r.state_slots.iter().all(|h| h.pool() == PoolKind::Ssm));
    let a = c
        .admit(
            l.lookup.lease,
            &full,
            &[PooledState {
                position: 24,
                slot: r.state_slots[0],
            }],
            &r.kv_pages,
        )
        .unwrap();
    assert_eq!(a.taken.len(), 7);
    assert!(a.returned.is_empty());
    c.release(l.lookup.lease).unwrap();
    c.check_invariants();
    // The next turn resumes at 24 with the same handles.
    full.extend(200..210);
    let l2 = c.lookup(0, &full).unwrap();
    assert_eq!(l2.lookup.hit_tokens, 24);
    assert_eq!(l2.kv_pages, r.kv_pages);
    assert_eq!(l2.state_slot, Some(r.state_slots[0]));
    for h in &l2.kv_pages {
        assert!(c.resolve(*h).is_ok());
    }
    // The cache's handles are not the caller's to free.
    assert!(matches!(
        c.free(&[r.kv_pages[0]]),
        Err(PooledError::NotCallers { .. })
    ));
    c.release(l2.lookup.lease).unwrap();
    c.check_invariants();
}

#[test]
fn evicted_handles_return_to_their_pool_and_go_stale() {
    // 16 KiB static split in half: 16 pages, 4 state slots.
    let pool = dual_pool(
        &tiny(),
        PAGE,
        16 << 10,
        PoolLayout::Static { ssm_fraction: 0.5 },
    )
    .unwrap();
    let mut c = PooledCache::new(cfg(true), pool).unwrap();
    let mut evicted = Vec::new();
    for s in 0..20u32 {
        let full: Vec<u32> = (0..16).map(|t| s * 1000 + t).collect();
        let out = c.serve(0, 12, &full).unwrap();
        assert!(!out.refused);
        c.check_invariants();
        evicted.extend(c.drain_freed());
    }
    assert!(!evicted.is_empty());
    for h in &evicted {
        // Stale or reused by a later owner: never live under the old handle.
        assert!(c.pool().resolve(*h).is_err(), "{h:?} still resolves");
    }
    // Everything the pools hold is the cache's.
    let used = c.cache().used_units();
    assert_eq!(
        u64::from(c.pool().capacity(PoolKind::Kv) - c.pool().free_units(PoolKind::Kv)),
        used.pages
    );
    assert!(c.stats().evictions_for_memory > 0);
}

#[test]
fn avmp_moves_free_capacity_to_the_short_pool() {
    // Start with 90% of 32 KiB for states: 7 pages (3.2 KiB), 14 slots. Long
    // sequences need pages; the free state slots migrate.
    let pool = dual_pool(
        &tiny(),
        PAGE,
        32 << 10,
        PoolLayout::Avmp { ssm_fraction: 0.9 },
    )
    .unwrap();
    let mut pool = pool;
    pool.set_migration_step_bytes(4096);
    let mut c = PooledCache::new(cfg(false), pool).unwrap();
    let kv0 = c.pool().capacity(PoolKind::Kv);
    for s in 0..6u32 {
        let full: Vec<u32> = (0..40).map(|t| s * 1000 + t).collect();
        let out = c.serve(0, 36, &full).unwrap();
        assert!(!out.refused, "request {s} refused");
        c.check_invariants();
    }
    assert!(c.pool().capacity(PoolKind::Kv) > kv0);
    assert!(c.stats().migrations > 0);
    assert!(c.stats().bytes_migrated > 0);
    // A static split of the same budget cannot hold one such request
    // (10 pages > 7): it is refused for lack of memory.
    let pool = dual_pool(
        &tiny(),
        PAGE,
        32 << 10,
        PoolLayout::Static { ssm_fraction: 0.9 },
    )
    .unwrap();
    let mut s = PooledCache::new(cfg(false), pool).unwrap();
    let full: Vec<u32> = (0..40).collect();
    assert!(s.serve(0, 36, &full).unwrap().refused);
    assert_eq!(s.stats().refused, 1);
    s.check_invariants();
}

#[test]
fn bad_handles_and_impossible_reservations_are_refused_without_change() {
    let pool = build_pool(&tiny(), PAGE, 16 << 10, PoolLayout::Unified).unwrap();
    let mut c = PooledCache::new(cfg(true), pool).unwrap();
    // More than the whole table: refused up front.
    assert!(matches!(
        c.reserve(1000, 0),
        Err(PooledError::OutOfMemory { .. })
    ));
    let r = c.reserve(2, 1).unwrap();
    // A slot offered as a page, a handle never issued, a double free.
    let l = c.lookup(0, &[1, 2, 3, 4, 5, 6, 7, 8, 9]).unwrap();
    let toks: Vec<u32> = (1..=9).collect();
    assert!(matches!(
        c.admit(
            l.lookup.lease,
            &toks,
            &[],
            &[r.state_slots[0], r.kv_pages[0]]
        ),
        Err(PooledError::NotCallers { .. })
    ));
    assert!(c
        .admit(
            l.lookup.lease,
            &toks,
            &[],
            &[VirtualHandle::from_raw(0x1234_5678), r.kv_pages[0]]
        )
        .is_err());
    c.check_invariants();
    c.free(&r.kv_pages).unwrap();
    assert!(c.free(&r.kv_pages).is_err());
    c.free(&r.state_slots).unwrap();
    c.release(l.lookup.lease).unwrap();
    assert!(c.release(l.lookup.lease).is_err());
    c.check_invariants();
    // A model without recurrent layers has nothing to put in a state pool.
    let attn = ModelSpec::preset("paper-7b-attn").unwrap();
    let pool = build_pool(&attn, PAGE, 64 << 20, PoolLayout::Unified);
    assert!(
        pool.is_err() || {
            let mut c = CacheConfig::sglang_plus(attn, 1);
            c.page_size = PAGE;
            PooledCache::new(c, pool.unwrap()).is_err()
        }
    );
}

/// One step of the property test.
#[derive(Debug, Clone)]
enum Op {
    /// Look up a new request: a shared prefix (`prefix` of 3), `len` own
    /// tokens, `out` decoded tokens.
    Start { prefix: u8, len: u8, out: u8 },
    /// Reserve the working units of in-flight request `i`.
    Reserve(usize),
    /// Admit in-flight request `i` (reserving first if needed).
    Admit(usize),
    /// Finish in-flight request `i`: free its units, release its lease.
    Finish(usize),
    /// Drain the evicted handles.
    Drain,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0u8..3, 1u8..30, 0u8..12).prop_map(|(prefix, len, out)| Op::Start { prefix, len, out }),
        2 => any::<usize>().prop_map(Op::Reserve),
        3 => any::<usize>().prop_map(Op::Admit),
        2 => any::<usize>().prop_map(Op::Finish),
        1 => Just(Op::Drain),
    ]
}

struct Flight {
    lease: u64,
    full: Vec<u32>,
    hit_pages: Vec<VirtualHandle>,
    positions: Vec<u32>,
    pages: Vec<VirtualHandle>,
    slots: Vec<VirtualHandle>,
    reserved: bool,
    admitted: bool,
}

/// Drives `ops` through a cache over `pool`; `bytes` reads the physical
/// bytes in use (st_blocks for memfd) and `budget` bounds them.
fn drive<A: PoolAllocator>(
    mut c: PooledCache<A>,
    ops: &[Op],
    physical: impl Fn(&PooledCache<A>) -> Option<u64>,
    write: impl Fn(&mut PooledCache<A>, VirtualHandle),
    budget: u64,
) -> Result<PooledStats, TestCaseError> {
    let prefixes: [Vec<u32>; 3] = [(0..8).collect(), (50..70).collect(), (90..94).collect()];
    let mut flights: Vec<Flight> = Vec::new();
    let mut next_tok = 10_000u32;
    for op in ops {
        match op {
            Op::Start { prefix, len, out } => {
                let mut full = prefixes[*prefix as usize].clone();
                full.extend(next_tok..next_tok + u32::from(*len));
                let input_len = full.len();
                full.extend(next_tok + 500..next_tok + 500 + u32::from(*out));
                next_tok += 1000;
                let l = c.lookup(0, &full[..input_len]).unwrap();
                let positions = c
                    .cache()
                    .states_to_save(&l.lookup, full.len())
                    .iter()
                    .map(|s| s.position)
                    .collect();
                flights.push(Flight {
                    lease: l.lookup.lease,
                    full,
                    hit_pages: l.kv_pages,
                    positions,
                    pages: Vec::new(),
                    slots: Vec::new(),
                    reserved: false,
                    admitted: false,
                });
            }
            Op::Reserve(i) | Op::Admit(i) if !flights.is_empty() => {
                let i = i % flights.len();
                let f = &mut flights[i];
                if !f.reserved {
                    let pages = f.full.len() / PAGE as usize - f.hit_pages.len();
                    match c.reserve(pages as u32, f.positions.len() as u32) {
                        Ok(r) => {
                            f.pages = r.kv_pages;
                            f.slots = r.state_slots;
                            f.reserved = true;
                            for &h in f.pages.iter().chain(&f.slots) {
                                write(&mut c, h);
                            }
                        }
                        Err(PooledError::OutOfMemory { .. }) => {
                            let f = flights.swap_remove(i);
                            c.release(f.lease).unwrap();
                        }
                        Err(e) => return Err(TestCaseError::fail(format!("reserve: {e}"))),
                    }
                } else if matches!(op, Op::Admit(_)) && !f.admitted {
                    f.admitted = true;
                    let mut pages = f.hit_pages.clone();
                    pages.extend_from_slice(&f.pages);
                    let states: Vec<PooledState> = f
                        .positions
                        .iter()
                        .zip(&f.slots)
                        .map(|(&position, &slot)| PooledState { position, slot })
                        .collect();
                    let a = c.admit(f.lease, &f.full, &states, &pages).unwrap();
                    // Taken units are the cache's now; the rest stay ours.
                    for h in &a.taken {
                        prop_assert!(!a.returned.contains(h));
                    }
                    f.pages.retain(|h| a.returned.contains(h));
                    f.slots.retain(|h| a.returned.contains(h));
                    f.positions.clear();
                }
            }
            Op::Finish(i) if !flights.is_empty() => {
                let f = flights.swap_remove(i % flights.len());
                let mut mine = f.pages.clone();
                mine.extend_from_slice(&f.slots);
                c.free(&mine).unwrap();
                for h in &mine {
                    // Freed handles come back: no longer valid under this name.
                    prop_assert!(c.pool().resolve(*h).is_err());
                }
                c.release(f.lease).unwrap();
            }
            Op::Drain => {
                for h in c.drain_freed() {
                    prop_assert!(c.pool().resolve(h).is_err(), "evicted {h:?} resolves");
                }
            }
            _ => {}
        }
        c.check_invariants();
        if let Some(b) = physical(&c) {
            prop_assert!(b <= budget, "physical {b} > budget {budget}");
        }
    }
    for f in flights {
        let mut mine = f.pages;
        mine.extend_from_slice(&f.slots);
        c.free(&mine).unwrap();
        c.release(f.lease).unwrap();
    }
    c.check_invariants();
    Ok(c.stats())
}

const BUDGET: u64 = 24 << 10;
/// A third of the budget for states, rounded so that both pools are whole
/// 4 KiB chunks (8 KiB: 4 slots; 16 KiB less a byte: 31 pages).
const THIRD: f64 = 0.3334;
const GRAN: usize = 4096;

fn backed(layout: PoolLayout) -> BackedPool<MemfdBackend> {
    let pool = dual_pool(&tiny(), PAGE, BUDGET, layout).unwrap();
    let mut pool = pool;
    pool.set_migration_step_bytes(GRAN as u64);
    let chunks = (BUDGET as usize) / GRAN;
    BackedPool::new(pool, MemfdBackend::with_granularity(chunks, GRAN).unwrap()).unwrap()
}

fn st_blocks(c: &PooledCache<BackedPool<MemfdBackend>>) -> Option<u64> {
    Some(c.pool().backend().physical_bytes().unwrap())
}

fn touch(c: &mut PooledCache<BackedPool<MemfdBackend>>, h: VirtualHandle) {
    let n = c.pool().unit_bytes(h.pool()) as usize;
    c.pool_mut().write_unit(h, 0, &vec![0xa5; n]).unwrap();
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn request_cycle_over_memfd_avmp(ops in prop::collection::vec(op(), 1..120), lru in any::<bool>()) {
        let c = PooledCache::new(cfg(lru), backed(PoolLayout::Avmp { ssm_fraction: THIRD })).unwrap();
        drive(c, &ops, st_blocks, touch, BUDGET)?;
    }

    #[test]
    fn request_cycle_over_memfd_static(ops in prop::collection::vec(op(), 1..120), lru in any::<bool>()) {
        let c = PooledCache::new(cfg(lru), backed(PoolLayout::Static { ssm_fraction: THIRD })).unwrap();
        drive(c, &ops, st_blocks, touch, BUDGET)?;
    }

    #[test]
    fn request_cycle_over_the_unified_table(ops in prop::collection::vec(op(), 1..120)) {
        let pool = build_pool(&tiny(), PAGE, BUDGET, PoolLayout::Unified).unwrap();
        let c = PooledCache::new(cfg(false), pool).unwrap();
        drive(c, &ops, |_| None, |_, _| {}, BUDGET)?;
    }
}

/// The driver reaches the paths the property tests are for: with long
/// requests three at a time, the pools fill, entries are evicted for
/// memory, and AVMP migrates.
#[test]
fn the_driver_evicts_and_migrates() {
    let mut ops = Vec::new();
    for k in 0..60usize {
        ops.push(Op::Start {
            prefix: (k % 3) as u8,
            len: 20 + (k % 9) as u8,
            out: (k % 11) as u8,
        });
        ops.push(Op::Admit(k));
        ops.push(Op::Admit(k));
        if k % 3 == 2 {
            ops.push(Op::Finish(0));
            ops.push(Op::Finish(0));
            ops.push(Op::Finish(0));
            ops.push(Op::Drain);
        }
    }
    let c = PooledCache::new(
        cfg(false),
        backed(PoolLayout::Avmp {
            ssm_fraction: THIRD,
        }),
    )
    .unwrap();
    let avmp = drive(c, &ops, st_blocks, touch, BUDGET).unwrap();
    assert!(avmp.evictions_for_memory > 0, "{avmp:?}");
    assert!(avmp.migrations > 0, "{avmp:?}");
    let c = PooledCache::new(
        cfg(false),
        backed(PoolLayout::Static {
            ssm_fraction: THIRD,
        }),
    )
    .unwrap();
    let st = drive(c, &ops, st_blocks, touch, BUDGET).unwrap();
    assert!(st.evictions_for_memory > 0, "{st:?}");
    assert_eq!(st.migrations, 0);
}
