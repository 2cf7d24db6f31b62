//! Application checkpoint hints (`PrefixCache::lookup_hinted`): a state at
//! the end of a shared prompt from its first request on; hints that cannot
//! be honoured are dropped; plans stay valid; no hints changes nothing.

use marconi_core::{
    AdmissionPolicy, AlphaMode, CacheConfig, Decision, ModelSpec, PlanReason, PrefixCache,
    SavedState,
};
use proptest::prelude::*;

fn cfg(capacity: u64) -> CacheConfig {
    CacheConfig {
        alpha: AlphaMode::Fixed(0.0),
        decision_log: true,
        ..CacheConfig::marconi(ModelSpec::preset("paper-7b").unwrap(), capacity)
    }
}

/// A system prompt of 1,000 tokens followed by a user message.
fn request(user: u32) -> Vec<u32> {
    (0..1_000)
        .chain(10_000 * (user + 1)..10_000 * (user + 1) + 50)
        .collect()
}

fn plans(log: &[Decision]) -> Vec<(Vec<u32>, PlanReason)> {
    log.iter()
        .filter_map(|d| match d {
            Decision::Plan {
                positions, reason, ..
            } => Some((positions.clone(), *reason)),
            _ => None,
        })
        .collect()
}

/// Without a hint, the second request of a new system prompt finds no
/// state (Marconi plans the branch point only when it sees the branch);
/// with one, the first request leaves a state at the prompt's end and the
/// second request reuses it.
#[test]
fn a_hint_makes_the_second_request_hit_the_shared_prompt() {
    let mut plain = PrefixCache::new(cfg(10_000_000_000)).unwrap();
    let mut hinted = PrefixCache::new(cfg(10_000_000_000)).unwrap();
    plain.serve(0, &request(0), &[7, 8]).unwrap();
    let first = hinted.lookup_hinted(0, &request(0), &[1_000]).unwrap();
    assert_eq!(first.plan, vec![1_000]);
    assert_eq!(
        plans(&hinted.drain_log()),
        vec![(vec![1_000], PlanReason::AppCheckpoint)]
    );
    let mut full = request(0);
    full.extend([7, 8]);
    let states = hinted.states_to_save(&first, full.len());
    assert_eq!(
        states.iter().map(|s| s.position).collect::<Vec<_>>(),
        vec![1_000, 1_052]
    );
    let out = hinted.admit(first.lease, &full, &states, &[]).unwrap();
    assert_eq!(out.states_taken, vec![1_000, 1_052]);
    hinted.release(first.lease).unwrap();

    assert_eq!(plain.serve(0, &request(1), &[9]).unwrap().hit_tokens, 0);
    let second = hinted.lookup_hinted(0, &request(1), &[1_000]).unwrap();
    assert_eq!(second.hit_tokens, 1_000);
    // Already cached: the hint is dropped, nothing is planned.
    assert!(second.plan.is_empty());
    hinted.release(second.lease).unwrap();
    hinted.check_invariants();
}

/// Hints are rounded down to the checkpoint grid and dropped when at or
/// below the hit, past the input, already cached or already planned; the
/// log names the policy's positions and the hints' apart.
#[test]
fn hints_are_rounded_and_filtered() {
    let mut c = PrefixCache::new(CacheConfig {
        page_size: 16,
        checkpoint_grid: 64,
        ..cfg(10_000_000_000)
    })
    .unwrap();
    // A 640-token sequence cached with its final state.
    let base: Vec<u32> = (0..640).collect();
    c.serve(0, &base, &[]).unwrap();
    c.drain_log();
    // Branches off at 500: Marconi plans 448 (500 rounded to 64).
    let input: Vec<u32> = (0..500).chain(90_000..90_400).collect();
    let l = c
        .lookup_hinted(0, &input, &[0, 448, 450, 700, 899, 900, 901, 5_000, 700])
        .unwrap();
    assert_eq!(l.hit_tokens, 0);
    // 0: not above the hit; 448 and 450 (-> 448): planned by the policy;
    // 700 -> 640; 899, 900 -> 896; 901 -> 896; 5,000: past the input.
    assert_eq!(l.plan, vec![448, 640, 896]);
    assert_eq!(
        plans(&c.drain_log()),
        vec![
            (vec![448], PlanReason::NewBranch),
            (vec![640, 896], PlanReason::AppCheckpoint)
        ]
    );
    let states = c.states_to_save(&l, input.len());
    let out = c.admit(l.lease, &input, &states, &[]).unwrap();
    assert_eq!(out.states_taken, vec![448, 640, 896]);
    c.release(l.lease).unwrap();
    // The same input again: 896 is the hit, every hint at or below it and
    // the cached ones are dropped.
    let l = c.lookup_hinted(0, &input, &[448, 640, 896, 899]).unwrap();
    assert_eq!(l.hit_tokens, 896);
    assert!(l.plan.is_empty());
    c.release(l.lease).unwrap();
    c.check_invariants();
}

/// A state at a hinted position may be admitted; an unplanned position is
/// still refused.
#[test]
fn only_kept_hints_are_admissible() {
    let mut c = PrefixCache::new(cfg(10_000_000_000)).unwrap();
    let input = request(0);
    let l = c.lookup_hinted(0, &input, &[300]).unwrap();
    assert_eq!(l.plan, vec![300]);
    let bad = [SavedState {
        position: 400,
        slot: None,
    }];
    assert!(c.admit(l.lease, &input, &bad, &[]).is_err());
    let good = [
        SavedState {
            position: 300,
            slot: Some(1),
        },
        SavedState {
            position: 1_050,
            slot: Some(2),
        },
    ];
    let out = c.admit(l.lease, &input, &good, &[]).unwrap();
    assert_eq!(out.states_taken, vec![300, 1_050]);
    c.release(l.lease).unwrap();
    c.check_invariants();
}

/// Where hits need no states (the oracle, attention-only models) hints are
/// dropped; under all-blocks admission a hint off the block grid is
/// planned and admitted with the block boundaries.
#[test]
fn hints_under_other_policies() {
    let model = ModelSpec::preset("paper-7b").unwrap();
    let mut o = PrefixCache::new(CacheConfig::oracle(model.clone())).unwrap();
    let l = o.lookup_hinted(0, &request(0), &[500]).unwrap();
    assert!(l.plan.is_empty());
    o.release(l.lease).unwrap();

    let attn = ModelSpec::preset("paper-7b-attn").unwrap();
    let mut a = PrefixCache::new(CacheConfig::marconi(attn, 10_000_000_000)).unwrap();
    let l = a.lookup_hinted(0, &request(0), &[500]).unwrap();
    assert!(l.plan.is_empty());
    a.release(l.lease).unwrap();

    let mut b = PrefixCache::new(CacheConfig {
        admission: AdmissionPolicy::AllBlocks { block_size: 256 },
        ..cfg(10_000_000_000)
    })
    .unwrap();
    let input = request(0);
    let l = b.lookup_hinted(0, &input, &[1_000, 512]).unwrap();
    assert_eq!(l.plan, vec![256, 512, 768, 1_000, 1_024]);
    let states = b.states_to_save(&l, input.len());
    assert_eq!(
        states.iter().map(|s| s.position).collect::<Vec<_>>(),
        vec![256, 512, 768, 1_000, 1_024]
    );
    let out = b.admit(l.lease, &input, &states, &[]).unwrap();
    assert_eq!(out.states_taken, vec![256, 512, 768, 1_000, 1_024]);
    b.release(l.lease).unwrap();
    b.check_invariants();
}

/// The state admitted at a hint is an ordinary checkpoint: under pressure
/// from other requests it is evicted like any other.
#[test]
fn a_hinted_state_is_evicted_like_any_other() {
    // Room for about 3 states and their KV.
    let mut c = PrefixCache::new(cfg(100_000_000)).unwrap();
    let input = request(0);
    let l = c.lookup_hinted(0, &input, &[1_000]).unwrap();
    let states = c.states_to_save(&l, input.len());
    c.admit(l.lease, &input, &states, &[]).unwrap();
    c.release(l.lease).unwrap();
    for k in 0..10u32 {
        let other: Vec<u32> = (1_000_000 * (k + 1)..1_000_000 * (k + 1) + 200).collect();
        c.serve(0, &other, &[]).unwrap();
    }
    let l = c.lookup(0, &request(1)).unwrap();
    assert_eq!(l.hit_tokens, 0, "the hinted state was evicted");
    c.release(l.lease).unwrap();
    c.check_invariants();
}

fn arb_policy() -> impl Strategy<Value = (AdmissionPolicy, u32, u32)> {
    (
        prop_oneof![
            Just(AdmissionPolicy::Marconi),
            Just(AdmissionPolicy::AllBlocks { block_size: 32 }),
            Just(AdmissionPolicy::Oracle),
        ],
        prop_oneof![Just(1u32), Just(4), Just(16)],
        prop_oneof![Just(1u32), Just(8), Just(48)],
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Random requests over a few shared prompts, with random hints (any
    /// value, duplicates, unsorted): every plan is ascending, unique,
    /// above the hit, within the input and on the page grid; the states
    /// an engine following it saves are admitted; the invariants hold.
    /// The same requests without hints decide exactly as plain lookups.
    #[test]
    fn hints_never_break_a_plan(
        (admission, page, grid) in arb_policy(),
        capacity in prop_oneof![Just(50_000_000u64), Just(200_000_000), Just(u64::MAX / 2)],
        reqs in proptest::collection::vec(
            (0u32..4, 1u32..300, 0u32..20, proptest::collection::vec(0u32..1_500, 0..5)),
            1..30,
        ),
    ) {
        let base = CacheConfig {
            admission,
            page_size: page,
            checkpoint_grid: grid,
            ..cfg(capacity)
        };
        let base = if admission == AdmissionPolicy::Oracle {
            CacheConfig { capacity_bytes: u64::MAX, ..base }
        } else {
            base
        };
        let base = match admission {
            AdmissionPolicy::AllBlocks { .. } => CacheConfig {
                admission: AdmissionPolicy::AllBlocks { block_size: 32 * page },
                ..base
            },
            _ => base,
        };
        let mut c = PrefixCache::new(base.clone()).unwrap();
        let mut plain = PrefixCache::new(base.clone()).unwrap();
        let mut same = PrefixCache::new(base).unwrap();
        for (i, (prompt, user, out, hints)) in reqs.iter().enumerate() {
            let mut input: Vec<u32> = (prompt * 1_000..prompt * 1_000 + 200 * (prompt + 1)).collect();
            input.extend(100_000 + i as u32 * 1_000..100_000 + i as u32 * 1_000 + user);
            let l = c.lookup_hinted(0, &input, hints).unwrap();
            let len = input.len() as u32;
            prop_assert!(l.plan.windows(2).all(|w| w[0] < w[1]), "{:?}", l.plan);
            for &p in &l.plan {
                prop_assert!(p > l.hit_tokens && p <= len && p % page == 0, "{p} {l:?}");
            }
            let mut full = input.clone();
            full.extend(900_000..900_000 + out);
            let states = c.states_to_save(&l, full.len());
            c.admit(l.lease, &full, &states, &[]).unwrap();
            c.release(l.lease).unwrap();
            c.check_invariants();

            let a = plain.lookup(0, &input).unwrap();
            let b = same.lookup_hinted(0, &input, &[]).unwrap();
            prop_assert_eq!(&a, &b);
            for (cache, l) in [(&mut plain, a), (&mut same, b)] {
                let states = cache.states_to_save(&l, full.len());
                cache.admit(l.lease, &full, &states, &[]).unwrap();
                cache.release(l.lease).unwrap();
            }
            prop_assert_eq!(plain.drain_log(), same.drain_log());
        }
    }
}

/// Pairs of requests: request `2i` and `2i + 1` share a fresh prompt of
/// 1,000 tokens (hinted at its end), each followed by its own message.
/// Without the hint the second request of a pair finds no state at the
/// prompt's end (the branch is seen only then); with it, it hits 1,000.
fn paired(i: u32) -> Vec<u32> {
    let prompt = 1_000_000 * (i / 2 + 1);
    (prompt..prompt + 1_000)
        .chain(prompt + 500_000 + 100 * (i % 2)..prompt + 500_000 + 100 * (i % 2) + 50)
        .collect()
}

/// A cache tuned on windows of 24 requests (token-hit objective, one
/// round), small enough to evict within a few requests.
fn tuned(engine: bool, hinted: bool) -> f64 {
    use marconi_core::{TunerConfig, TuningObjective};
    const STATE: u64 = 26_787_840;
    const KV: u64 = 65_536;
    let cfg = CacheConfig {
        alpha: AlphaMode::Auto(TunerConfig {
            grid: vec![1.0],
            min_window: 24,
            bootstrap_factor: 1,
            retune: false,
            apply_after: 0,
            threads: 1,
            objective: TuningObjective::TokenHits,
            ..TunerConfig::default()
        }),
        decision_log: true,
        ..CacheConfig::marconi(
            ModelSpec::preset("paper-7b").unwrap(),
            4 * STATE + 3_000 * KV,
        )
    };
    let mut c = PrefixCache::new(cfg).unwrap();
    let hints: &[u32] = if hinted { &[1_000] } else { &[] };
    let mut objective = None;
    for i in 0..200u32 {
        let mut full = paired(i);
        full.extend([7, 8, 9]);
        if engine {
            let l = c.lookup_hinted(0, &full[..1_050], hints).unwrap();
            let states = c.states_to_save(&l, full.len());
            c.admit(l.lease, &full, &states, &[]).unwrap();
            c.release(l.lease).unwrap();
        } else {
            c.serve_full_hinted(0, 1_050, &full, hints).unwrap();
        }
        c.check_invariants();
        for d in c.drain_log() {
            if let Decision::Alpha {
                objective_at_zero, ..
            } = d
            {
                objective = objective.or(Some(objective_at_zero));
            }
        }
    }
    let objective = objective.expect("a tuning round within 200 requests");
    // The cache itself hits the hinted prompts.
    assert_eq!(c.stats().hit_tokens > 0, hinted, "engine {engine}");
    objective
}

/// The tuner's window replays pass each request's hints to the same
/// hinted lookup, so the replay at α = 0 scores the cache that runs: the
/// hits only hints give (whole requests and the engine's calls alike).
/// Without hints the same window scores none.
#[test]
fn the_tuners_window_replays_the_hints() {
    for engine in [false, true] {
        assert_eq!(tuned(engine, false), 0.0, "engine {engine}");
        let hinted = tuned(engine, true);
        // 12 pairs in the window: most second requests hit the prompt.
        assert!(hinted >= 6_000.0, "engine {engine}: {hinted}");
    }
}
