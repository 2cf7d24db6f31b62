//! The unit budget (a cache over two pools): admission and eviction count KV
//! pages and state slots against it, per kind.

use marconi_core::{
    CacheConfig, ModelSpec, PrefixCache, SavedState, UnitBudget, UnitKind, UnitUse,
};

fn cache() -> PrefixCache {
    let mut c = CacheConfig::sglang_plus(ModelSpec::preset("paper-7b").unwrap(), u64::MAX / 4);
    c.page_size = 4;
    PrefixCache::new(c).unwrap()
}

/// Serves one request of `len` fresh tokens starting at `base` (a final
/// state at `len`, page ids `base..`).
fn admit(c: &mut PrefixCache, base: u32, len: u32) {
    let toks: Vec<u32> = (base..base + len).collect();
    let l = c.lookup(0, &toks).unwrap();
    let pages: Vec<u32> = (base..base + len / 4).collect();
    c.admit(
        l.lease,
        &toks,
        &[SavedState {
            position: len,
            slot: Some(base),
        }],
        &pages,
    )
    .unwrap();
    c.release(l.lease).unwrap();
}

#[test]
fn a_budget_below_what_is_cached_is_refused_without_change() {
    let mut c = cache();
    admit(&mut c, 0, 8);
    assert_eq!(
        c.used_units(),
        UnitUse {
            pages: 2,
            states: 1
        }
    );
    let small = UnitBudget::Split {
        pages: 1,
        states: 5,
    };
    assert!(c.set_unit_budget(Some(small)).is_err());
    assert_eq!(c.unit_budget(), None);
    assert!(c.evict_to_fit(small));
    assert_eq!(
        c.used_units(),
        UnitUse {
            pages: 0,
            states: 0
        }
    );
    assert_eq!(c.drain_freed().kv_pages, vec![0, 1]);
    c.set_unit_budget(Some(small)).unwrap();
    c.check_invariants();
}

#[test]
fn admission_evicts_the_kind_that_is_short() {
    let mut c = cache();
    // Room for 4 pages and 10 states: two 8-token requests fill the pages.
    c.set_unit_budget(Some(UnitBudget::Split {
        pages: 4,
        states: 10,
    }))
    .unwrap();
    admit(&mut c, 100, 8);
    admit(&mut c, 200, 8);
    assert_eq!(
        c.used_units(),
        UnitUse {
            pages: 4,
            states: 2
        }
    );
    // A third needs 2 pages: the oldest entry (pages and its state) goes.
    admit(&mut c, 300, 8);
    assert_eq!(
        c.used_units(),
        UnitUse {
            pages: 4,
            states: 2
        }
    );
    let f = c.drain_freed();
    assert_eq!((f.kv_pages, f.state_slots), (vec![100, 101], vec![100]));
    c.check_invariants();
    // Short of states only: one state per request, budget of 2.
    c.set_unit_budget(Some(UnitBudget::Split {
        pages: 100,
        states: 2,
    }))
    .unwrap();
    admit(&mut c, 400, 4);
    assert_eq!(c.used_units().states, 2);
    c.check_invariants();
}

#[test]
fn a_shared_budget_counts_pages_and_states_together() {
    let mut c = cache();
    c.set_unit_budget(Some(UnitBudget::Shared { units: 7 }))
        .unwrap();
    admit(&mut c, 0, 8); // 3 units
    admit(&mut c, 100, 8); // 6 units
    admit(&mut c, 200, 8); // 9 > 7: the oldest goes
    assert_eq!(
        c.used_units(),
        UnitUse {
            pages: 4,
            states: 2
        }
    );
    c.check_invariants();
    // One eviction restricted to a kind frees that kind.
    let freed = c.evict_lowest(Some(UnitKind::State)).unwrap();
    assert_eq!(freed.states, 1);
    assert!(c.evict_lowest(Some(UnitKind::Page)).is_some());
    assert!(c.evict_lowest(None).is_none());
    c.check_invariants();
}

#[test]
fn a_truncated_admission_fits_the_unit_budget() {
    let mut c = cache();
    c.set_unit_budget(Some(UnitBudget::Split {
        pages: 3,
        states: 4,
    }))
    .unwrap();
    // 16 tokens need 4 pages: nothing evictable, only a state-ending prefix
    // could be kept, and the only offered state is at 16: rejected.
    let toks: Vec<u32> = (0..16).collect();
    let l = c.lookup(0, &toks).unwrap();
    let out = c
        .admit(
            l.lease,
            &toks,
            &[SavedState {
                position: 16,
                slot: Some(9),
            }],
            &[0, 1, 2, 3],
        )
        .unwrap();
    assert!(out.rejected.is_some());
    assert_eq!(out.slots_returned, vec![9]);
    c.release(l.lease).unwrap();
    assert_eq!(c.used_units(), UnitUse::default());
    c.check_invariants();
}
