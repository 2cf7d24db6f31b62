//! Random request sequences: after every step the byte accounting equals a
//! recount, the tree is a valid radix tree, lease counts match the
//! outstanding leases and no leased node was evicted (all checked by
//! `check_invariants`), and a held lease keeps its hit reusable.

use marconi_core::{
    AdmissionPolicy, AlphaMode, CacheConfig, Decision, EvictionPolicy, ModelSpec, PrefixCache,
    SavedState, TunerConfig,
};
use proptest::prelude::*;

#[derive(Clone, Debug)]
enum Op {
    /// A whole request: family prefix length, suffix seed, output length.
    Serve {
        family: u8,
        shared: u16,
        tail: u8,
        seed: u8,
        out: u8,
    },
    /// A whole request whose input is the first `cut`/256 of what a `Serve`
    /// with the same fields admits and whose output is the rest: inputs
    /// ending inside cached pages, outputs continuing along cached edges.
    Continue {
        family: u8,
        shared: u16,
        tail: u8,
        seed: u8,
        out: u8,
        cut: u8,
    },
    /// Look up and keep the lease open.
    Hold {
        family: u8,
        shared: u16,
        tail: u8,
        seed: u8,
    },
    /// Admit the input of the oldest held lease, with its plan and final state.
    AdmitHeld,
    /// Release the oldest held lease.
    ReleaseHeld,
    /// Evict some bytes.
    Evict { states: u8 },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0u8..3, 0u16..300, 0u8..40, any::<u8>(), 0u8..30)
            .prop_map(|(family, shared, tail, seed, out)| Op::Serve { family, shared, tail, seed, out }),
        4 => (0u8..3, 0u16..300, 0u8..40, any::<u8>(), 0u8..30, any::<u8>())
            .prop_map(|(family, shared, tail, seed, out, cut)| Op::Continue { family, shared, tail, seed, out, cut }),
        2 => (0u8..3, 0u16..300, 1u8..40, any::<u8>())
            .prop_map(|(family, shared, tail, seed)| Op::Hold { family, shared, tail, seed }),
        1 => Just(Op::AdmitHeld),
        2 => Just(Op::ReleaseHeld),
        1 => (1u8..4).prop_map(|states| Op::Evict { states }),
    ]
}

/// Inputs: a prefix of one of three long "documents", then a tail that is
/// a function of the seed (so tails repeat and branch).
fn input(family: u8, shared: u16, tail: u8, seed: u8) -> Vec<u32> {
    let base = u32::from(family) * 100_000;
    let mut v: Vec<u32> = (base..base + u32::from(shared)).collect();
    let s = u32::from(seed % 8) * 1000 + 50_000;
    v.extend(s..s + u32::from(tail));
    if v.is_empty() {
        v.push(base);
    }
    v
}

fn output(seed: u8, out: u8) -> Vec<u32> {
    (0..u32::from(out))
        .map(|k| 90_000 + k * 7 + u32::from(seed))
        .collect()
}

fn configs() -> impl Strategy<Value = CacheConfig> {
    let model = ModelSpec::preset("paper-7b").unwrap();
    let state = model.state_bytes();
    let kv = model.kv_bytes_per_token();
    (
        0usize..4,
        1u64..12,
        prop_oneof![Just(1u32), Just(4), Just(16)],
        0u32..3,
    )
        .prop_map(move |(policy, states, page, alpha)| {
            let cap = states * state + 600 * kv;
            let mut cfg = match policy {
                0 => CacheConfig::marconi(model.clone(), cap),
                1 => CacheConfig::sglang_plus(model.clone(), cap),
                2 => CacheConfig::vllm_plus(model.clone(), cap, 32),
                _ => CacheConfig {
                    alpha: AlphaMode::Fixed(f64::from(alpha)),
                    ..CacheConfig::marconi(model.clone(), cap)
                },
            };
            if policy == 0 {
                cfg.alpha = AlphaMode::Auto(TunerConfig {
                    min_window: 2,
                    bootstrap_factor: 1,
                    apply_after: 2,
                    retune_every: 1,
                    grid: vec![0.0, 0.5, 2.0],
                    threads: 1,
                    ..TunerConfig::default()
                });
            }
            cfg.page_size = page;
            if let AdmissionPolicy::AllBlocks { .. } = cfg.admission {
                cfg.admission = AdmissionPolicy::AllBlocks {
                    block_size: 32.max(page),
                };
            }
            cfg.checkpoint_grid = if page == 1 { 8 } else { 1 };
            // The tuner's replays catch their panics; the log shows them.
            cfg.decision_log = true;
            cfg
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]
    #[test]
    fn invariants_hold_after_every_step(cfg in configs(), ops in prop::collection::vec(op(), 1..60)) {
        let state_bytes = cfg.model.state_bytes();
        let lru = cfg.eviction == EvictionPolicy::Lru;
        let mut c = PrefixCache::new(cfg).unwrap();
        // Held leases: (lease, input, hit at lookup).
        let mut held: Vec<(u64, Vec<u32>, u32, Vec<u32>)> = Vec::new();
        for op in ops {
            match op {
                Op::Serve { family, shared, tail, seed, out } => {
                    let i = input(family, shared, tail, seed);
                    let o = output(seed, out);
                    let s = c.serve(0, &i, &o).unwrap();
                    prop_assert!(s.hit_tokens < i.len() as u32);
                    prop_assert!(s.hit_tokens <= s.kv_matched_tokens);
                }
                Op::Continue { family, shared, tail, seed, out, cut } => {
                    let mut full = input(family, shared, tail, seed);
                    full.extend(output(seed, out));
                    let input_len = (full.len() * usize::from(cut) / 256).max(1);
                    let s = c.serve_full(0, input_len, &full).unwrap();
                    prop_assert!(s.hit_tokens < input_len as u32);
                    prop_assert!(s.hit_tokens <= s.kv_matched_tokens);
                }
                Op::Hold { family, shared, tail, seed } => {
                    let i = input(family, shared, tail, seed);
                    let l = c.lookup(0, &i).unwrap();
                    held.push((l.lease, i, l.hit_tokens, l.plan));
                }
                Op::AdmitHeld => {
                    if let Some((lease, i, _, plan)) = held.first() {
                        let page = c.config().page_size;
                        let fin = (i.len() as u32) / page * page;
                        let mut states: Vec<SavedState> = plan.iter().map(|&p| SavedState { position: p, slot: None }).collect();
                        if fin > 0 && !plan.contains(&fin) {
                            if let AdmissionPolicy::AllBlocks { block_size } = c.config().admission {
                                states.retain(|s| s.position % block_size == 0);
                            } else {
                                states.push(SavedState { position: fin, slot: None });
                            }
                        }
                        c.admit(*lease, i, &states, &[]).unwrap();
                    }
                }
                Op::ReleaseHeld => {
                    if !held.is_empty() {
                        let (lease, ..) = held.remove(0);
                        c.release(lease).unwrap();
                    }
                }
                Op::Evict { states } => {
                    let free = c.config().capacity_bytes - c.used_bytes();
                    c.evict(free + u64::from(states) * state_bytes);
                }
            }
            c.check_invariants();
            for d in c.drain_log() {
                prop_assert!(!matches!(d, Decision::AlphaKept { .. }), "{}", d);
            }
            // A held lease keeps what it hit: looking its input up again
            // finds at least the same hit (LRU refreshes may only add).
            for (_, i, hit, _) in &held {
                let l = c.lookup(0, i).unwrap();
                prop_assert!(l.hit_tokens >= *hit, "held hit {} now {}", hit, l.hit_tokens);
                c.release(l.lease).unwrap();
            }
            let _ = lru;
        }
        for (lease, ..) in held {
            c.release(lease).unwrap();
        }
        c.check_invariants();
        prop_assert_eq!(c.stats().leases, 0);
    }
}
