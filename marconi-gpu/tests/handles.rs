//! Handles identify their pool and never come back stale: two live pools
//! (and two caches over pools) refuse each other's handles, a unit reused
//! thousands of times never accepts an earlier handle, and a cache over
//! pools admits only handles the caller holds (or the lease's own cached
//! pages, at their own positions).

use marconi_core::CacheConfig;
use marconi_gpu::pooled::{dual_pool, PoolLayout, PooledCache, PooledError, PooledState};
use marconi_gpu::{AllocError, DualPool, DualPoolConfig, MigrationPolicy, PoolAllocator, PoolKind};

mod common;
use common::tiny;

fn pool(units: u64) -> DualPool {
    DualPool::new(
        "p",
        DualPoolConfig {
            total_bytes: units * 2 * 128,
            ssm_ratio: 0.5,
            kv_unit: 128,
            ssm_unit: 128,
            policy: MigrationPolicy::Static,
        },
    )
    .unwrap()
}

#[test]
fn two_live_pools_refuse_each_others_handles() {
    let (mut a, mut b) = (pool(8), pool(8));
    let (mut ha, mut hb) = (Vec::new(), Vec::new());
    a.allocate(PoolKind::Kv, 4, &mut ha).unwrap();
    b.allocate(PoolKind::Kv, 4, &mut hb).unwrap();
    for (&x, &y) in ha.iter().zip(&hb) {
        assert_ne!(x, y, "two pools issued the same handle value");
        assert_eq!(b.resolve(x), Err(AllocError::ForeignHandle(x.raw())));
        assert_eq!(b.free(x), Err(AllocError::ForeignHandle(x.raw())));
    }
    // Nothing of b's was freed by a's handles, and a still owns its units.
    assert_eq!(b.free_units(PoolKind::Kv), b.capacity(PoolKind::Kv) - 4);
    for h in ha.into_iter().chain(hb) {
        if a.resolve(h).is_ok() {
            a.free(h).unwrap();
        } else {
            b.free(h).unwrap();
        }
    }
}

/// The generation used to have only the bits the unit index left over: in a
/// pool of 524,288 units a handle came back after 2,047 cycles of one unit.
#[test]
fn a_unit_reused_many_times_never_accepts_an_earlier_handle() {
    let mut p = pool(524_288);
    let mut seen = std::collections::HashSet::new();
    let mut old = Vec::new();
    let mut out = Vec::new();
    for _ in 0..5_000 {
        out.clear();
        p.allocate(PoolKind::Kv, 1, &mut out).unwrap();
        let h = out[0];
        assert!(seen.insert(h.raw()), "handle {h:?} issued twice");
        // The allocator hands out the unit it was just given back.
        if let Some(&prev) = old.last() {
            assert_eq!(p.unit_index(prev), p.unit_index(h));
        }
        for &stale in old.iter().rev().take(3) {
            assert_eq!(p.resolve(stale), Err(AllocError::StaleHandle(stale.raw())));
        }
        p.free(h).unwrap();
        old.push(h);
    }
    out.clear();
    p.allocate(PoolKind::Kv, 1, &mut out).unwrap();
    for &stale in &old {
        assert!(p.resolve(stale).is_err(), "stale {stale:?} accepted");
        assert!(p.free(stale).is_err(), "stale {stale:?} freed");
    }
    assert!(p.resolve(out[0]).is_ok());
}

const PAGE: u32 = 4;

fn cache() -> PooledCache<DualPool> {
    let mut c = CacheConfig::sglang_plus(tiny(), 1);
    c.page_size = PAGE;
    c.min_branch_depth = 0;
    let pool = dual_pool(
        &tiny(),
        PAGE,
        64 << 10,
        PoolLayout::Static { ssm_fraction: 0.5 },
    )
    .unwrap();
    PooledCache::new(c, pool).unwrap()
}

/// Admits `full` (input `full[..input]`) with a final state, the whole cycle.
fn serve(c: &mut PooledCache<DualPool>, input: usize, full: &[u32]) {
    assert!(!c.serve(0, input, full).unwrap().refused);
}

#[test]
fn two_caches_over_pools_refuse_each_others_handles() {
    let (mut a, mut b) = (cache(), cache());
    let ra = a.reserve(2, 1).unwrap();
    let rb = b.reserve(2, 1).unwrap();
    for (&x, &y) in ra.kv_pages.iter().zip(&rb.kv_pages) {
        assert_ne!(x, y);
        assert!(b.resolve(x).is_err());
        assert!(matches!(b.free(&[x]), Err(PooledError::NotCallers { .. })));
    }
    b.check_invariants();
    a.free(&ra.kv_pages).unwrap();
    a.free(&ra.state_slots).unwrap();
    b.free(&rb.kv_pages).unwrap();
    b.free(&rb.state_slots).unwrap();
    a.check_invariants();
    b.check_invariants();
}

/// In the pages where KV matched beyond the usable hit, a page the cache
/// holds for another position used to be accepted (and stayed "the
/// caller's" by the contract).
#[test]
fn admit_refuses_a_cached_page_outside_the_leases_own_positions() {
    let mut c = cache();
    let first: Vec<u32> = (0..24).collect();
    serve(&mut c, 20, &first);
    let cached = c.held_handles();
    // Shares 3 pages, then diverges: KV matches 12 tokens, no state there.
    let mut second: Vec<u32> = (0..12).collect();
    second.extend(900..912);
    let l = c.lookup(0, &second).unwrap();
    assert_eq!(l.lookup.kv_matched_tokens, 12);
    assert_eq!(l.lookup.hit_tokens, 0);
    let r = c.reserve(6, 1).unwrap();
    let cached_page = *cached
        .iter()
        .find(|h| h.pool() == PoolKind::Kv)
        .expect("the first request cached pages");
    let state = [PooledState {
        position: 24,
        slot: r.state_slots[0],
    }];
    let mut pages = r.kv_pages.clone();
    pages[0] = cached_page;
    assert!(matches!(
        c.admit(l.lookup.lease, &second, &state, &pages),
        Err(PooledError::NotCallers { handle, .. }) if handle == cached_page.raw()
    ));
    c.check_invariants();
    // Listed twice: a reserved page, a reserved slot.
    let mut twice = r.kv_pages.clone();
    twice[1] = twice[0];
    assert!(matches!(
        c.admit(l.lookup.lease, &second, &state, &twice),
        Err(PooledError::Duplicate {
            kind: PoolKind::Kv,
            ..
        })
    ));
    let two_states = [
        state[0],
        PooledState {
            position: 12,
            slot: r.state_slots[0],
        },
    ];
    assert!(matches!(
        c.admit(l.lookup.lease, &second, &two_states, &r.kv_pages),
        Err(PooledError::Duplicate {
            kind: PoolKind::Ssm,
            ..
        })
    ));
    c.check_invariants();
    // The caller's own pages are accepted, and what is returned is its own.
    let a = c
        .admit(l.lookup.lease, &second, &state, &r.kv_pages)
        .unwrap();
    for h in &a.returned {
        assert!(r.kv_pages.contains(h) || r.state_slots.contains(h));
    }
    // A second admit of the lease may name the pages its first one took
    // (and the caller's returned ones, reused).
    let mut longer = second.clone();
    longer.extend(950..954);
    let r2 = c.reserve(1, 1).unwrap();
    let mut pages2 = r.kv_pages.clone();
    pages2.push(r2.kv_pages[0]);
    let a2 = c
        .admit(
            l.lookup.lease,
            &longer,
            &[PooledState {
                position: 28,
                slot: r2.state_slots[0],
            }],
            &pages2,
        )
        .unwrap();
    let mut mine: Vec<_> = a.returned.clone();
    mine.extend(a2.returned.iter().filter(|h| !a.returned.contains(h)));
    mine.retain(|h| !a2.taken.contains(h));
    c.free(&mine).unwrap();
    c.release(l.lookup.lease).unwrap();
    c.check_invariants();
}
