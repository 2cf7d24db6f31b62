//! Every refused call names its reason and leaves the cache unchanged.

use marconi_core::{CacheConfig, CacheError, ModelSpec, PrefixCache, SavedState, Stats};

fn cache() -> PrefixCache {
    // Branch checkpoints at any depth: the calls below need a plan at 8.
    PrefixCache::new(CacheConfig {
        min_branch_depth: 0,
        ..CacheConfig::marconi(ModelSpec::preset("paper-7b").unwrap(), 1_000_000_000)
    })
    .unwrap()
}

/// A call that is expected to fail.
type Call = Box<dyn Fn(&mut PrefixCache) -> Result<(), CacheError>>;

fn st(position: u32, slot: u32) -> SavedState {
    SavedState {
        position,
        slot: Some(slot),
    }
}

/// Observable state: stats (minus the request counters a failed call may not
/// touch either) and bytes.
fn snapshot(c: &PrefixCache) -> (Stats, u64) {
    (c.stats(), c.used_bytes())
}

#[test]
fn bad_configs_are_refused() {
    let m = ModelSpec::preset("paper-7b").unwrap();
    let err = |cfg: CacheConfig| PrefixCache::new(cfg).unwrap_err().to_string();
    assert!(err(CacheConfig::marconi(m.clone(), 0)).contains("capacity_bytes is 0"));
    let c = CacheConfig {
        page_size: 0,
        ..CacheConfig::marconi(m.clone(), 1)
    };
    assert!(err(c).contains("page_size is 0"));
    let c = CacheConfig {
        checkpoint_grid: 0,
        ..CacheConfig::marconi(m.clone(), 1)
    };
    assert!(err(c).contains("checkpoint_grid"));
    let c = CacheConfig {
        alpha: marconi_core::AlphaMode::Fixed(f64::NAN),
        ..CacheConfig::marconi(m.clone(), 1)
    };
    assert!(err(c).contains("alpha"));
    let mut bad = m;
    bad.ssm_layers = 0;
    bad.attn_layers = 0;
    assert!(err(CacheConfig::marconi(bad, 1)).contains("neither attention nor SSM"));
}

#[test]
fn bad_calls_change_nothing() {
    let mut c = cache();
    c.serve(0, &(0..20).collect::<Vec<_>>(), &[]).unwrap();
    let input: Vec<u32> = (0..8).chain(100..112).collect();
    let l = c.lookup(0, &input).unwrap();
    assert_eq!(l.plan, vec![8]);
    let before = snapshot(&c);

    let cases: Vec<(CacheError, Call)> = vec![
        (
            CacheError::EmptyTokens,
            Box::new(|c| c.lookup(0, &[]).map(drop)),
        ),
        (
            CacheError::UnknownLease(999),
            Box::new(|c| c.admit(999, &[1], &[], &[]).map(drop)),
        ),
        (CacheError::UnknownLease(999), Box::new(|c| c.release(999))),
        (
            CacheError::PrefixMismatch { input_len: 20 },
            Box::new(move |c| c.admit(l.lease, &[1, 2, 3], &[], &[]).map(drop)),
        ),
        (
            CacheError::PrefixMismatch { input_len: 20 },
            Box::new(move |c| {
                let mut other: Vec<u32> = (0..8).chain(100..112).collect();
                other[3] = 77;
                c.admit(l.lease, &other, &[], &[]).map(drop)
            }),
        ),
        (
            CacheError::NotPlanned {
                position: 5,
                allowed: "planned [8] or the final position 20".into(),
            },
            Box::new({
                let input = input.clone();
                move |c| c.admit(l.lease, &input, &[st(5, 1)], &[]).map(drop)
            }),
        ),
        (
            CacheError::PositionOutOfRange {
                position: 21,
                len: 20,
            },
            Box::new({
                let input = input.clone();
                move |c| c.admit(l.lease, &input, &[st(21, 1)], &[]).map(drop)
            }),
        ),
        (
            CacheError::DuplicatePosition(8),
            Box::new({
                let input = input.clone();
                move |c| {
                    let s = [st(8, 1), st(8, 2)];
                    c.admit(l.lease, &input, &s, &[]).map(drop)
                }
            }),
        ),
        (
            CacheError::DuplicateSlot(1),
            Box::new({
                let input = input.clone();
                move |c| {
                    let s = [st(8, 1), st(20, 1)];
                    c.admit(l.lease, &input, &s, &[]).map(drop)
                }
            }),
        ),
        (
            CacheError::BadPageList {
                expected: 20,
                got: 3,
            },
            Box::new({
                let input = input.clone();
                move |c| c.admit(l.lease, &input, &[], &[1, 2, 3]).map(drop)
            }),
        ),
    ];
    for (want, call) in cases {
        assert_eq!(call(&mut c).unwrap_err(), want);
        assert_eq!(snapshot(&c), before, "after {want}");
        c.check_invariants();
    }
    // The valid admission still works, and then the slot is the cache's:
    // offering it again is refused.
    c.admit(l.lease, &input, &[st(8, 1), st(20, 2)], &[])
        .unwrap();
    c.release(l.lease).unwrap();
    assert_eq!(c.release(l.lease), Err(CacheError::UnknownLease(l.lease)));
    let l2 = c.lookup(0, &[500, 501]).unwrap();
    assert_eq!(
        c.admit(l2.lease, &[500, 501], &[st(2, 1)], &[]),
        Err(CacheError::DuplicateSlot(1))
    );
    c.release(l2.lease).unwrap();
    c.check_invariants();
}

#[test]
fn stale_leases_never_reach_new_requests() {
    let mut c = cache();
    let a = c.lookup(0, &[1, 2, 3]).unwrap().lease;
    c.release(a).unwrap();
    let b = c.lookup(0, &[1, 2, 3]).unwrap().lease;
    assert_ne!(a, b);
    assert_eq!(c.release(a), Err(CacheError::UnknownLease(a)));
    c.release(b).unwrap();
}

#[test]
fn messages_are_sentences_with_the_numbers() {
    assert_eq!(
        CacheError::BadPageList {
            expected: 4,
            got: 2
        }
        .to_string(),
        "kv page list has 2 ids, expected 4 (one per full page of the admitted tokens; none at all in a cache that does not track pages)"
    );
    assert_eq!(
        CacheError::UnknownLease(7).to_string(),
        "lease 7 is unknown or already released"
    );
}

#[test]
fn pages_the_cache_owns_cannot_be_handed_over_again() {
    let mut c = cache();
    let l = c.lookup(0, &[1, 2, 3, 4]).unwrap();
    let out = c
        .admit(l.lease, &[1, 2, 3, 4], &[], &[10, 11, 12, 13])
        .unwrap();
    assert_eq!(out.kv_pages_taken, 0..4);
    c.release(l.lease).unwrap();
    let before = snapshot(&c);
    let l = c.lookup(0, &[7, 8]).unwrap();
    let after_lookup = snapshot(&c);
    assert_eq!(
        c.admit(l.lease, &[7, 8], &[], &[20, 12]),
        Err(CacheError::DuplicatePage(12))
    );
    assert_eq!(snapshot(&c), after_lookup);
    // Pages of the reused prefix are the cache's own and are not taken again.
    c.release(l.lease).unwrap();
    let l = c.lookup(0, &[1, 2, 3, 4, 5]).unwrap();
    let out = c
        .admit(l.lease, &[1, 2, 3, 4, 5], &[], &[10, 11, 12, 13, 14])
        .unwrap();
    assert_eq!(out.kv_pages_taken, 4..5);
    c.release(l.lease).unwrap();
    assert_ne!(snapshot(&c), before);
    c.check_invariants();
}

#[test]
fn namespaces_never_share_entries() {
    // The same tokens under another namespace (a LoRA id, a cache salt) are a
    // different prefix: no hit, no KV match, its own entries.
    let mut c = cache();
    let seq: Vec<u32> = (0..50).collect();
    c.serve(7, &seq, &[]).unwrap();
    let mut next = seq.clone();
    next.push(99);
    let other = c.lookup(8, &next).unwrap();
    assert_eq!((other.hit_tokens, other.kv_matched_tokens), (0, 0));
    c.release(other.lease).unwrap();
    let same = c.lookup(7, &next).unwrap();
    assert_eq!((same.hit_tokens, same.kv_matched_tokens), (50, 50));
    c.release(same.lease).unwrap();
    c.serve(8, &seq, &[]).unwrap();
    assert_eq!(c.stats().kv_bytes, 2 * 50 * 65_536);
    c.check_invariants();
}
