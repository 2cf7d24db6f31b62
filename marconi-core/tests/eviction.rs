//! Eviction order on small trees, engine ids reported on eviction, leases.

use insta::assert_snapshot;
use marconi_core::{
    AlphaMode, CacheConfig, EvictionPolicy, Freed, ModelSpec, PrefixCache, SavedState,
};

fn range(a: u32, b: u32) -> Vec<u32> {
    (a..b).collect()
}

fn cat(parts: &[Vec<u32>]) -> Vec<u32> {
    parts.concat()
}

fn paper() -> ModelSpec {
    ModelSpec::preset("paper-7b").unwrap()
}

const KV: u64 = 65_536;
const STATE: u64 = 26_787_840;

fn cache(eviction: EvictionPolicy, alpha: f64, capacity: u64) -> PrefixCache {
    PrefixCache::new(CacheConfig {
        eviction,
        alpha: AlphaMode::Fixed(alpha),
        decision_log: true,
        ..CacheConfig::marconi(paper(), capacity)
    })
    .unwrap()
}

/// Serves the requests and renders only the eviction records.
fn evictions(mut c: PrefixCache, reqs: &[Vec<u32>]) -> String {
    let mut out = String::new();
    for r in reqs {
        c.serve(0, r, &[]).unwrap();
        c.check_invariants();
        for d in c.drain_log() {
            let line = d.to_string();
            if line.starts_with("evict") {
                out += &line;
                out.push('\n');
            }
        }
    }
    out
}

/// A (0..100, state at 100) extended by B (to 150), then an unrelated C:
/// A is a one-child node with a state, B and C are leaves.
fn three_entries() -> Vec<Vec<u32>> {
    vec![
        range(0, 100),
        cat(&[range(0, 100), range(1000, 1050)]),
        range(5000, 5100),
    ]
}

/// Room for the three entries and a fourth that needs one state's worth more.
fn tight() -> u64 {
    250 * KV + 3 * STATE + (100 * KV + STATE) - 1
}

#[test]
fn alpha_zero_is_lru_over_nodes_with_at_most_one_child() {
    // The oldest candidate is A, whose state is superseded by B: FLOP-aware
    // eviction with α = 0 drops A's state and merges its edge into B; nothing
    // else goes.
    let mut reqs = three_entries();
    reqs.push(range(9000, 9100));
    assert_snapshot!(evictions(cache(EvictionPolicy::FlopAware, 0.0, tight()), &reqs), @"evict   Merge depth=100 edge=100 recency=0.000 eff=1.000 utility=0.000 freed=26787840");
}

#[test]
fn lru_baseline_evicts_leaves_only() {
    // SGLang+ cannot touch A (not a leaf): it evicts the oldest leaf, B,
    // losing the conversation's latest state.
    let mut reqs = three_entries();
    reqs.push(range(9000, 9100));
    assert_snapshot!(evictions(cache(EvictionPolicy::Lru, 0.0, tight()), &reqs), @"evict   Leaf depth=150 edge=50 recency=0.000 eff=0.000 utility=0.000 freed=30064640");
}

/// A's state (0..100) is used by its next turn B (0..150) after an
/// unrelated C was admitted: the hit refreshes A, though B's own state now
/// serves the conversation. The paper's rules (`superseded_age` 0) then
/// evict C, the oldest leaf; by default A counts one turn gap older than
/// the hit (the gap from A's admission to B's lookup, the only one seen),
/// as old as before C, so A's state goes and C stays.
fn superseded_after_a_leaf() -> Vec<Vec<u32>> {
    vec![
        range(0, 100),
        range(5000, 5100),
        cat(&[range(0, 100), range(1000, 1050)]),
        range(9000, 9100),
    ]
}

#[test]
fn a_superseded_state_goes_before_an_older_leaf() {
    let reqs = superseded_after_a_leaf();
    assert_snapshot!(evictions(cache(EvictionPolicy::FlopAware, 0.0, tight()), &reqs), @"evict   Merge depth=100 edge=100 recency=0.000 eff=1.000 utility=0.000 freed=26787840");
}

#[test]
fn without_superseded_age_the_hit_keeps_the_superseded_state() {
    let c = PrefixCache::new(CacheConfig {
        alpha: AlphaMode::Fixed(0.0),
        decision_log: true,
        superseded_age: 0.0,
        ..CacheConfig::marconi(paper(), tight())
    })
    .unwrap();
    assert_snapshot!(evictions(c, &superseded_after_a_leaf()), @"evict   Leaf depth=100 edge=100 recency=0.000 eff=0.645 utility=0.000 freed=33341440");
}

/// An old long sequence and a recent short one; a third needs room for one.
fn long_and_short() -> (Vec<Vec<u32>>, u64) {
    let reqs = vec![range(0, 4000), range(10_000, 10_050), range(20_000, 20_050)];
    let cap = 4050 * KV + 2 * STATE + (50 * KV + STATE) - 1;
    (reqs, cap)
}

#[test]
fn small_alpha_evicts_the_old_long_prefix() {
    let (reqs, cap) = long_and_short();
    assert_snapshot!(evictions(cache(EvictionPolicy::FlopAware, 0.5, cap), &reqs), @"evict   Leaf depth=4000 edge=4000 recency=0.000 eff=1.000 utility=0.500 freed=288931840");
}

#[test]
fn large_alpha_keeps_the_long_expensive_prefix() {
    // With α = 5 the long prefix's FLOP efficiency outweighs its age: the
    // recent short entry goes instead.
    let (reqs, cap) = long_and_short();
    assert_snapshot!(evictions(cache(EvictionPolicy::FlopAware, 5.0, cap), &reqs), @"evict   Leaf depth=50 edge=50 recency=1.000 eff=0.000 utility=1.000 freed=30064640");
}

#[test]
fn evictions_report_engine_ids_and_merge_edges() {
    // Engine-level cycle with slot and page ids (page size 1).
    let mut c = cache(EvictionPolicy::FlopAware, 0.0, tight());
    let mut next_page = 0u32;
    let mut run = |c: &mut PrefixCache, input: &[u32], slot: u32| {
        let l = c.lookup(0, input).unwrap();
        let pages: Vec<u32> = (next_page..next_page + input.len() as u32).collect();
        next_page += input.len() as u32;
        let final_state = SavedState {
            position: input.len() as u32,
            slot: Some(slot),
        };
        let out = c.admit(l.lease, input, &[final_state], &pages).unwrap();
        c.release(l.lease).unwrap();
        (l, out)
    };
    let reqs = three_entries();
    let (_, a) = run(&mut c, &reqs[0], 10);
    assert_eq!(a.kv_pages_taken, 0..100);
    let (l, b) = run(&mut c, &reqs[1], 11);
    assert_eq!((l.hit_tokens, l.state_slot), (100, Some(10)));
    assert_eq!(l.kv_pages, (0..100).collect::<Vec<_>>());
    // B's first 100 pages duplicate A's: the cache keeps only the new 50.
    assert_eq!(b.kv_pages_taken, 100..150);
    run(&mut c, &reqs[2], 12);
    assert_eq!(c.drain_freed(), Freed::default());
    run(&mut c, &range(9000, 9100), 13);
    // A's state (slot 10) was freed; its KV merged into B, so no page is freed.
    assert_eq!(
        c.drain_freed(),
        Freed {
            kv_pages: vec![],
            state_slots: vec![10]
        }
    );
    // B still resumes from its own state with all 150 tokens of KV:
    // 100 of A's pages (merged) then B's own 50.
    let mut next = reqs[1].clone();
    next.push(1);
    let l = c.lookup(0, &next).unwrap();
    assert_eq!((l.hit_tokens, l.state_slot), (150, Some(11)));
    let mut want: Vec<u32> = (0..100).collect();
    want.extend(200..250);
    assert_eq!(l.kv_pages, want);
    c.release(l.lease).unwrap();
    c.check_invariants();
}

#[test]
fn leased_entries_are_never_evicted() {
    let mut c = cache(EvictionPolicy::FlopAware, 1.0, 100 * KV + STATE);
    c.serve(0, &range(0, 100), &[]).unwrap();
    let mut held = range(0, 100);
    held.push(7);
    let l = c.lookup(0, &held).unwrap();
    assert_eq!(l.hit_tokens, 100);
    // Everything is pinned: a new sequence cannot be admitted.
    let s = c.serve(0, &range(500, 600), &[]).unwrap();
    assert!(s.rejected);
    assert_eq!(c.stats().evictions, 0);
    assert_eq!(c.stats().admissions_rejected, 1);
    c.check_invariants();
    c.release(l.lease).unwrap();
    // Released: the old entry can now make way.
    let s = c.serve(0, &range(500, 600), &[]).unwrap();
    assert!(!s.rejected);
    assert_eq!(c.stats().evictions, 1);
    c.check_invariants();
}

#[test]
fn a_sequence_larger_than_the_cache_is_rejected_whole() {
    let mut c = cache(EvictionPolicy::FlopAware, 1.0, 10 * KV);
    let s = c.serve(0, &range(0, 100), &[]).unwrap();
    assert!(s.rejected);
    assert_eq!(c.used_bytes(), 0);
    c.check_invariants();
}

#[test]
fn explicit_evict_frees_what_is_asked() {
    let mut c = cache(EvictionPolicy::FlopAware, 1.0, u64::MAX / 4);
    for i in 0..10 {
        c.serve(0, &range(i * 1000, i * 1000 + 100), &[]).unwrap();
    }
    let used = c.used_bytes();
    assert_eq!(used, 10 * (100 * KV + STATE));
    assert_eq!(c.evictable_bytes(), used);
    let free = c.evict(c.config().capacity_bytes - used + 3 * (100 * KV + STATE));
    assert_eq!(c.used_bytes(), 7 * (100 * KV + STATE));
    assert_eq!(free, c.config().capacity_bytes - c.used_bytes());
    c.check_invariants();
}

#[test]
fn a_sequence_that_does_not_fit_whole_is_cached_up_to_the_last_state_that_fits() {
    // All-blocks (every 32 tokens) with room for 2 states and 200 tokens: a
    // 320-token sequence offers 10 states; the cache keeps the prefix up to
    // the deepest state that fits (64) and returns the other slots.
    let cfg = CacheConfig::vllm_plus(paper(), 2 * STATE + 200 * KV, 32);
    let mut c = PrefixCache::new(cfg).unwrap();
    let seq = range(0, 320);
    let l = c.lookup(0, &seq).unwrap();
    let states: Vec<SavedState> = (1..=10)
        .map(|k| SavedState {
            position: 32 * k,
            slot: Some(k),
        })
        .collect();
    let out = c.admit(l.lease, &seq, &states, &[]).unwrap();
    c.release(l.lease).unwrap();
    assert_eq!(out.truncated_to, Some(64));
    assert_eq!(out.states_taken, vec![32, 64]);
    assert_eq!(out.slots_returned, (3..=10).collect::<Vec<_>>());
    assert_eq!(out.new_kv_tokens, 64);
    assert_eq!(c.used_bytes(), 2 * STATE + 64 * KV);
    assert_eq!(c.stats().admissions_truncated, 1);
    c.check_invariants();
    let mut again = range(0, 320);
    again.push(1);
    assert_eq!(c.lookup(0, &again).unwrap().hit_tokens, 64);
}

#[test]
fn a_former_branch_point_keeps_its_state_until_it_is_a_leaf() {
    // S = 0..100 is shared by two requests (a branch with a state at 100);
    // the older branch is evicted, leaving S one child. With branch
    // protection (the default) S's state survives the next eviction, which
    // takes the unrelated old entry instead; with the paper's rule, S's
    // state is merged away first (it is the oldest candidate).
    let reqs = vec![
        cat(&[range(0, 100), range(1000, 1100)]),
        cat(&[range(0, 100), range(2000, 2100)]),
        range(5000, 5100),
        cat(&[range(0, 100), range(2000, 2100), range(3000, 3010)]),
        range(7000, 7100),
    ];
    let run = |protect: bool| {
        let cfg = CacheConfig {
            alpha: AlphaMode::Fixed(0.0),
            protect_branch_states: protect,
            decision_log: true,
            // The fourth request supersedes the state at 200: aging it
            // would add a merge; this test isolates branch protection.
            superseded_age: 0.0,
            // Room for what the first three requests leave, so that the
            // fourth (10 new tokens and a state) evicts.
            ..CacheConfig::marconi(paper(), 400 * KV + 4 * STATE + 5 * KV)
        };
        evictions(PrefixCache::new(cfg).unwrap(), &reqs)
    };
    assert_snapshot!(run(true), @r"
    evict   Leaf depth=200 edge=100 recency=0.000 eff=1.000 utility=0.000 freed=33341440
    evict   Leaf depth=100 edge=100 recency=0.000 eff=0.781 utility=0.000 freed=33341440
    ");
    assert_snapshot!(run(false), @r"
    evict   Leaf depth=200 edge=100 recency=0.000 eff=1.000 utility=0.000 freed=33341440
    evict   Merge depth=100 edge=100 recency=0.000 eff=0.999 utility=0.000 freed=26787840
    evict   Leaf depth=100 edge=100 recency=0.000 eff=0.371 utility=0.000 freed=33341440
    ");
}

#[test]
fn a_branch_point_shallower_than_min_branch_depth_is_not_protected() {
    // S = 0..100 is cached whole first (its final state at 100), then
    // extended twice (S becomes a branch point with a state), then the
    // scenario above: the older branch goes, leaving S one child, and the
    // next eviction merges S's state away unless S is protected, which it
    // is only when `min_branch_depth` is at most its depth.
    let reqs = vec![
        range(0, 100),
        cat(&[range(0, 100), range(1000, 1100)]),
        cat(&[range(0, 100), range(2000, 2100)]),
        range(5000, 5100),
        cat(&[range(0, 100), range(2000, 2100), range(3000, 3010)]),
        range(7000, 7100),
    ];
    let run = |protect: bool, min_branch_depth: u32| {
        let cfg = CacheConfig {
            alpha: AlphaMode::Fixed(0.0),
            decision_log: true,
            protect_branch_states: protect,
            min_branch_depth,
            // As above: branch protection alone.
            superseded_age: 0.0,
            ..CacheConfig::marconi(paper(), 400 * KV + 4 * STATE + 5 * KV)
        };
        evictions(PrefixCache::new(cfg).unwrap(), &reqs)
    };
    let paper_rules = run(false, 0);
    assert!(paper_rules.contains("Merge depth=100"), "{paper_rules}");
    assert_eq!(run(true, 101), paper_rules);
    assert_ne!(run(true, 100), paper_rules);
    assert!(!run(true, 100).contains("Merge"));
    assert_eq!(run(true, 0), run(true, 100));
}

#[test]
fn no_branch_checkpoint_is_planned_shallower_than_min_branch_depth() {
    // Two requests share their first 100 tokens: the second plans a
    // checkpoint at the branch (100), which a third request sharing the
    // same 100 tokens resumes from, unless 100 is below `min_branch_depth`.
    let hit = |min_branch_depth: u32| {
        let mut c = PrefixCache::new(CacheConfig {
            min_branch_depth,
            ..CacheConfig::marconi(paper(), 1 << 40)
        })
        .unwrap();
        c.serve(0, &cat(&[range(0, 100), range(1000, 1100)]), &[])
            .unwrap();
        c.serve(0, &cat(&[range(0, 100), range(2000, 2100)]), &[])
            .unwrap();
        c.check_invariants();
        let l = c
            .lookup(0, &cat(&[range(0, 100), range(3000, 3100)]))
            .unwrap();
        l.hit_tokens
    };
    assert_eq!(hit(0), 100);
    assert_eq!(hit(100), 100);
    assert_eq!(hit(101), 0);
    assert_eq!(
        CacheConfig::marconi(paper(), 1).min_branch_depth,
        marconi_core::DEFAULT_MIN_BRANCH_DEPTH
    );
    assert_eq!(CacheConfig::marconi_paper(paper(), 1).min_branch_depth, 0);
    assert_eq!(CacheConfig::sglang_plus(paper(), 1).min_branch_depth, 0);
}

/// `discard` drops a state (and the KV only it kept) whatever its utility,
/// as an eviction of it would, with the removal events; it leaves leased
/// entries, branch points and positions without a state alone, and the
/// eviction counters and log do not see it.
#[test]
fn discard_drops_one_entry_and_nothing_else() {
    let mut c = PrefixCache::new(CacheConfig {
        alpha: AlphaMode::Fixed(0.0),
        decision_log: true,
        events: true,
        ..CacheConfig::marconi(paper(), 1 << 40)
    })
    .unwrap();
    let shared = range(0, 64);
    let a = cat(&[shared.clone(), range(1000, 1064)]);
    let b = cat(&[shared.clone(), range(2000, 2064)]);
    let d = range(5000, 5100);
    for s in [&a, &b, &d] {
        c.serve(0, s, &[]).unwrap();
    }
    // The branch point at 64 got a state (b's lookup planned it).
    assert!(c.cached_chains().states.contains(&(0, shared.clone())));
    c.drain_events();
    c.drain_log();
    let evictions = c.stats().evictions;
    // No state there, a branch point, another namespace: nothing.
    assert_eq!(c.discard(0, &a[..100]), 0);
    assert_eq!(c.discard(0, &shared), 0);
    assert_eq!(c.discard(1, &a), 0);
    // Leased: nothing; released: the leaf goes (its 64 tokens and state).
    let l = c.lookup(0, &cat(&[d.clone(), range(9000, 9010)])).unwrap();
    assert_eq!(l.hit_tokens, 100);
    assert_eq!(c.discard(0, &d), 0);
    c.release(l.lease).unwrap();
    c.drain_log();
    let used = c.used_bytes();
    assert_eq!(c.discard(0, &a), 64 * KV + STATE);
    assert_eq!(c.used_bytes(), used - 64 * KV - STATE);
    assert!(!c.cached_chains().states.contains(&(0, a.clone())));
    let ev = c.drain_events();
    assert_eq!(ev.len(), 2, "{ev:?}");
    assert_eq!(c.stats().evictions, evictions);
    assert!(c.drain_log().is_empty());
    c.check_invariants();
    // The branch point now has one child: its state can go, the KV stays.
    assert_eq!(c.discard(0, &shared), STATE);
    let k = c.peek(0, &b, false).unwrap();
    assert_eq!((k.hit_tokens, k.kv_matched_tokens), (0, 128));
    c.check_invariants();
}

/// `peek` finds what `lookup` finds (hit, KV match, plan) and changes
/// nothing: the counters, the decision log and what a later lookup finds
/// are those of a cache that was never peeked at.
#[test]
fn peek_is_a_lookup_without_its_effects() {
    let mk = || cache(EvictionPolicy::FlopAware, 1.0, tight());
    let (mut peeked, mut plain) = (mk(), mk());
    let reqs = three_entries();
    let mut probe = reqs.clone();
    probe.push(cat(&[range(0, 40), range(7000, 7100)]));
    for r in &reqs {
        for p in &probe {
            let k = peeked.peek(0, p, true).unwrap();
            let l = peeked.lookup(0, p).unwrap();
            assert_eq!(
                (k.hit_tokens, k.kv_matched_tokens, &k.plan),
                (l.hit_tokens, l.kv_matched_tokens, &l.plan)
            );
            peeked.release(l.lease).unwrap();
            let l = plain.lookup(0, p).unwrap();
            plain.release(l.lease).unwrap();
        }
        assert!(peeked.peek(0, &[], false).is_err());
        peeked.serve(0, r, &[]).unwrap();
        plain.serve(0, r, &[]).unwrap();
    }
    assert_eq!(peeked.stats(), plain.stats());
    assert_eq!(peeked.drain_log(), plain.drain_log());
    assert_eq!(peeked.cached_chains(), plain.cached_chains());
}

#[test]
fn what_leases_protect_is_the_union_of_their_paths() {
    // Two leases on separate cached prefixes of 100 and 60 tokens: both
    // protected (160 tokens, 2 states), nothing evictable; then one lease
    // more on the first prefix changes nothing, and releasing the leases
    // one by one gives back exactly what no other lease holds.
    let mut c = cache(EvictionPolicy::FlopAware, 1.0, u64::MAX / 4);
    c.serve(0, &range(0, 100), &[]).unwrap();
    c.serve(0, &range(1000, 1060), &[]).unwrap();
    assert_eq!(c.evictable_split(), (160, 2));
    let whole = |r: Vec<u32>| {
        let mut v = r;
        v.push(9_999_999);
        v
    };
    let a = c.lookup(0, &whole(range(0, 100))).unwrap();
    let b = c.lookup(0, &whole(range(1000, 1060))).unwrap();
    assert_eq!((a.hit_tokens, b.hit_tokens), (100, 60));
    assert_eq!(c.evictable_split(), (0, 0));
    assert_eq!(c.evictable_bytes(), 0);
    let a2 = c.lookup(0, &whole(range(0, 100))).unwrap();
    assert_eq!(c.evictable_split(), (0, 0));
    c.release(a.lease).unwrap();
    assert_eq!(c.evictable_split(), (0, 0));
    c.release(a2.lease).unwrap();
    assert_eq!(c.evictable_split(), (100, 1));
    assert_eq!(c.evictable_bytes(), 100 * KV + STATE);
    c.release(b.lease).unwrap();
    assert_eq!(c.evictable_split(), (160, 2));
    c.check_invariants();
}
