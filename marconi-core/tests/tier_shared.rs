//! A store shared by several processes, and the engine's record of what
//! each lower tier holds.
//!
//! - The ops ([`TieredCache::drain_ops`]) replayed by an engine keep its
//!   copies exactly equal to what each lower tier holds, after every
//!   request (no leaked copy, no missing one).
//! - A second process with a fresh cache resumes from the states the first
//!   wrote into the shared store, through a probe of that store, and only
//!   where the probe says the state and its KV are there.

#[path = "common/chat.rs"]
mod chat;

use std::collections::BTreeSet;

use marconi_core::{
    CacheConfig, LoadWhat, ModelSpec, StoreProbe, Tier, TierConfig, TierOp, TierSpec, TieredCache,
    WriteMode,
};

fn model() -> ModelSpec {
    ModelSpec::preset("paper-7b").unwrap()
}

fn chain_bytes(tokens: u64) -> u64 {
    let m = model();
    tokens * m.kv_bytes_per_token() + m.state_bytes()
}

fn cache(dev: u64, host: u64, store: u64) -> TieredCache {
    cache_with(dev, host, store, |_| {})
}

/// [`cache`] with Marconi's tier configuration changed by `f`.
fn cache_with(dev: u64, host: u64, store: u64, f: impl FnOnce(&mut TierConfig)) -> TieredCache {
    let spec = |bytes: u64, gbps: f64| TierSpec {
        cache: CacheConfig::marconi(model(), bytes),
        bandwidth_bytes_per_s: gbps * 1e9,
        latency_s: 10e-6,
    };
    let mut t = TierConfig::marconi(Some(spec(host, 25.0)), Some(spec(store, 20.0)));
    f(&mut t);
    let mut c = TieredCache::new(CacheConfig::marconi(model(), dev), t).unwrap();
    c.record_ops(true);
    c
}

/// Chat sessions ([`chat::sessions`]) as (input, reply).
fn workload(sessions: u32, turns: u32, seed: u32) -> Vec<(Vec<u32>, Vec<u32>)> {
    chat::sessions(sessions, turns, seed)
        .into_iter()
        .map(|(_, input, reply)| (input, reply))
        .collect()
}

type Chain = (u64, Vec<u32>);

/// Serves `input` + `output` (states at the plan and at the end).
fn serve(c: &mut TieredCache, input: &[u32], output: &[u32]) -> marconi_core::TieredLookup {
    let mut full = input.to_vec();
    full.extend_from_slice(output);
    c.serve_full(0, input.len(), &full).unwrap()
}

/// Applies `ops` to the engine's copies: host and store chains.
fn apply(ops: Vec<TierOp>, host: &mut BTreeSet<Chain>, store: &mut BTreeSet<Chain>) {
    for op in ops {
        match op {
            TierOp::Write {
                to,
                ns,
                position,
                prefix,
                ..
            } => {
                assert_eq!(prefix.len(), position as usize);
                let set = if to == Tier::Host {
                    &mut *host
                } else {
                    // Written from the engine's host copy.
                    assert!(
                        host.contains(&(ns, prefix.clone())),
                        "store write of a chain the host copy lacks"
                    );
                    &mut *store
                };
                set.insert((ns, prefix));
            }
            TierOp::Drop {
                from, ns, prefix, ..
            } => {
                let set = if from == Tier::Host {
                    &mut *host
                } else {
                    &mut *store
                };
                assert!(set.remove(&(ns, prefix)), "a drop of a chain never written");
            }
        }
    }
}

fn states_of(c: &TieredCache, t: Tier) -> BTreeSet<Chain> {
    c.tier(t)
        .unwrap()
        .cached_chains()
        .states
        .into_iter()
        .collect()
}

#[test]
fn ops_keep_the_engine_copies_equal_to_each_tier() {
    let mut c = cache(chain_bytes(300), chain_bytes(900), chain_bytes(2_000));
    let (mut host, mut store) = (BTreeSet::new(), BTreeSet::new());
    let (mut writes, mut drops) = (0, 0);
    for (input, output) in workload(10, 6, 3) {
        serve(&mut c, &input, &output);
        let ops = c.drain_ops();
        writes += ops
            .iter()
            .filter(|o| matches!(o, TierOp::Write { .. }))
            .count();
        drops += ops
            .iter()
            .filter(|o| matches!(o, TierOp::Drop { .. }))
            .count();
        apply(ops, &mut host, &mut store);
        assert_eq!(host, states_of(&c, Tier::Host));
        assert_eq!(store, states_of(&c, Tier::Store));
    }
    assert!(
        writes > 0 && drops > 0,
        "the workload must demote and evict below the device ({writes} writes, {drops} drops)"
    );
}

/// Serves 3 sessions of 8 turns on `c`, replaying the ops after every
/// request and after `settle` when moves are deferred (a state the device
/// could not hold goes to the host on the request path even then): the
/// copies must equal each tier's states throughout. Returns (lower-tier
/// hits, drops, drops made by `settle`, writes).
fn replay_in_step(mut c: TieredCache) -> (u64, usize, usize, usize) {
    let (mut host, mut store) = (BTreeSet::new(), BTreeSet::new());
    let (mut writes, mut drops, mut settled) = (0, 0, 0);
    let count = |ops: &[TierOp]| {
        let w = ops
            .iter()
            .filter(|o| matches!(o, TierOp::Write { .. }))
            .count();
        (w, ops.len() - w)
    };
    for (input, output) in workload(3, 8, 3) {
        serve(&mut c, &input, &output);
        for settle in [false, true] {
            if settle {
                if !c.config().defer_moves {
                    continue;
                }
                c.settle().unwrap();
            }
            let ops = c.drain_ops();
            let (w, d) = count(&ops);
            writes += w;
            drops += d;
            if settle {
                settled += d;
            }
            apply(ops, &mut host, &mut store);
            assert_eq!(host, states_of(&c, Tier::Host));
            assert_eq!(store, states_of(&c, Tier::Store));
        }
        c.check_invariants();
    }
    let s = c.stats();
    let lower = s.hits_by_tier[Tier::Host.index()] + s.hits_by_tier[Tier::Store.index()];
    (lower, drops, settled, writes)
}

/// Tier sizes where the device holds a session's state, so that a lower
/// tier's hit is taken in and exclusive tiers discard it.
fn sized(f: impl FnOnce(&mut TierConfig)) -> TieredCache {
    let c = chain_bytes(300);
    cache_with(2 * c, 3 * c, 6 * c, f)
}

#[test]
fn exclusive_discards_are_drops_in_step_with_each_tier() {
    let excl = replay_in_step(sized(|t| assert!(t.exclusive)));
    let incl = replay_in_step(sized(|t| t.exclusive = false));
    assert!(excl.0 > 0, "the workload must hit below the device");
    // The chains exclusive tiers served are dropped there: more drops per
    // write than the inclusive tiers make.
    assert!(
        excl.1 * incl.3 > incl.1 * excl.3,
        "exclusive (hits, drops, -, writes) {excl:?}, inclusive {incl:?}"
    );
}

#[test]
fn deferred_exclusive_discards_stay_in_step() {
    let (lower, drops, settled, writes) = replay_in_step(sized(|t| t.defer_moves = true));
    assert!(lower > 0 && writes > 0);
    assert!(
        settled > 0 && drops >= settled,
        "the discards are settle's ({settled} of {drops} drops)"
    );
}

#[test]
fn write_through_exclusive_ops_stay_in_step() {
    for defer in [false, true] {
        let (lower, drops, _, writes) = replay_in_step(sized(|t| {
            t.write = WriteMode::Through;
            t.defer_moves = defer;
        }));
        assert!(
            lower > 0 && writes > 0 && drops > 0,
            "defer {defer}: {lower} lower hits, {writes} writes, {drops} drops"
        );
    }
}

#[test]
fn a_shared_hit_drops_nothing_from_the_own_store() {
    // The own store holds the session's early chain; the shared store a
    // longer one, another process's. Taking the shared one must not drop
    // the own store's chain (this store tier did not serve it).
    let input: Vec<u32> = (0..400).collect();
    let mut c = cache(chain_bytes(450), chain_bytes(450), chain_bytes(100_000));
    // Fill: the chain at 100 goes device -> host -> store.
    serve(&mut c, &input[..100], &[]);
    for k in 0..4u32 {
        let other: Vec<u32> = (0..140).map(|i| 1_000_000 * (k + 1) + i).collect();
        serve(&mut c, &other, &[]);
    }
    let own: BTreeSet<Chain> = states_of(&c, Tier::Store);
    assert!(
        own.contains(&(0, input[..100].to_vec())),
        "the setup must leave the early chain in the store"
    );
    drop(c.drain_ops());
    let probe = StoreProbe {
        kv_tokens: 400,
        states: vec![300],
    };
    let l = c.lookup_probed(0, &input, &[], Some(&probe)).unwrap();
    assert!(l.shared && l.tier == Tier::Store && l.hit_tokens == 300);
    let states = c.device().states_to_save(&l.device, input.len());
    let mut states: Vec<_> = states.into_iter().filter(|s| s.position > 300).collect();
    if states.is_empty() {
        states.push(marconi_core::SavedState {
            position: 400,
            slot: None,
        });
    }
    c.admit(&l, &input, &states, &[]).unwrap();
    c.release(&l).unwrap();
    let dropped: Vec<TierOp> = c
        .drain_ops()
        .into_iter()
        .filter(|o| {
            matches!(
                o,
                TierOp::Drop {
                    from: Tier::Store,
                    ..
                }
            )
        })
        .collect();
    assert!(dropped.is_empty(), "the own store dropped {dropped:?}");
    assert!(states_of(&c, Tier::Store).contains(&(0, input[..100].to_vec())));
}

#[test]
fn a_second_process_resumes_from_the_shared_store() {
    // Process A: a small device, so that chains reach its store.
    let reqs = workload(8, 5, 11);
    let mut a = cache(chain_bytes(300), chain_bytes(600), chain_bytes(100_000));
    let (mut host, mut shared) = (BTreeSet::new(), BTreeSet::new());
    for (input, output) in &reqs {
        serve(&mut a, input, output);
        apply(a.drain_ops(), &mut host, &mut shared);
    }
    assert!(!shared.is_empty(), "A wrote nothing to the store");

    // Process B: fresh, serves the last turn of each session again.
    let mut b = cache(chain_bytes(300), chain_bytes(600), chain_bytes(100_000));
    let probe_of = |b: &TieredCache, input: &[u32]| StoreProbe {
        kv_tokens: input.len() as u32,
        states: b
            .store_probe_positions(input.len(), 4096)
            .into_iter()
            .filter(|&p| shared.contains(&(0, input[..p as usize].to_vec())))
            .collect(),
    };
    let mut resumed = 0;
    for (input, _) in reqs.iter().rev().take(8) {
        let probe = probe_of(&b, input);
        let best = probe.states.iter().copied().max().unwrap_or(0);
        // Without the probe a fresh process has nothing.
        let plain = b.lookup(0, input).unwrap();
        assert_eq!(plain.hit_tokens, 0);
        b.release(&plain).unwrap();
        let l = b.lookup_probed(0, input, &[], Some(&probe)).unwrap();
        assert_eq!(l.hit_tokens, best, "the longest probed state is the hit");
        if best > 0 {
            assert!(l.shared && l.tier == Tier::Store);
            assert_eq!(
                l.loads.last().unwrap().what,
                LoadWhat::State {
                    position: best,
                    slot: None
                }
            );
            resumed += 1;
        }
        b.release(&l).unwrap();
    }
    assert!(resumed > 0);
    assert_eq!(b.stats().shared_hits, resumed);
}

#[test]
fn a_probe_is_used_only_where_it_is_usable() {
    let mut c = cache(chain_bytes(300), chain_bytes(600), chain_bytes(2_000));
    let input: Vec<u32> = (0..200).collect();
    let mut lookup = |probe: StoreProbe| {
        let l = c.lookup_probed(0, &input, &[], Some(&probe)).unwrap();
        c.release(&l).unwrap();
        (l.hit_tokens, l.shared)
    };
    // A state past the KV the store holds (and no tier holds it) is unusable.
    assert_eq!(
        lookup(StoreProbe {
            kv_tokens: 50,
            states: vec![120]
        }),
        (0, false)
    );
    // The whole input is never a hit: its last token gives the first logits.
    assert_eq!(
        lookup(StoreProbe {
            kv_tokens: 200,
            states: vec![200]
        }),
        (0, false)
    );
    // The longest covered position wins.
    assert_eq!(
        lookup(StoreProbe {
            kv_tokens: 150,
            states: vec![40, 150, 120, 180]
        }),
        (150, true)
    );

    // Without a store tier, a probe has no bandwidth to be weighed by.
    let host = TierSpec {
        cache: CacheConfig::marconi(model(), chain_bytes(600)),
        bandwidth_bytes_per_s: 25e9,
        latency_s: 10e-6,
    };
    let mut h = TieredCache::new(
        CacheConfig::marconi(model(), chain_bytes(300)),
        TierConfig::marconi(Some(host), None),
    )
    .unwrap();
    let l = h
        .lookup_probed(
            0,
            &input,
            &[],
            Some(&StoreProbe {
                kv_tokens: 200,
                states: vec![150],
            }),
        )
        .unwrap();
    assert_eq!((l.hit_tokens, l.shared), (0, false));
    h.release(&l).unwrap();
}

#[test]
fn a_slow_store_declines_a_shared_hit() {
    let spec = |gbps: f64, lat: f64| TierSpec {
        cache: CacheConfig::marconi(model(), chain_bytes(2_000)),
        bandwidth_bytes_per_s: gbps * 1e9,
        latency_s: lat,
    };
    let t = TierConfig::marconi(Some(spec(25.0, 10e-6)), Some(spec(0.001, 1.0)));
    let mut c = TieredCache::new(CacheConfig::marconi(model(), chain_bytes(300)), t).unwrap();
    let input: Vec<u32> = (0..200).collect();
    let l = c
        .lookup_probed(
            0,
            &input,
            &[],
            Some(&StoreProbe {
                kv_tokens: 200,
                states: vec![160],
            }),
        )
        .unwrap();
    assert_eq!(l.hit_tokens, 0);
    assert_eq!(l.declined, Some((Tier::Store, 160)));
    c.release(&l).unwrap();
}

#[test]
fn probe_positions_are_page_aligned_longest_first() {
    let mut cfg = CacheConfig::marconi(model(), chain_bytes(300));
    cfg.page_size = 16;
    let mut lower = cfg.clone();
    lower.capacity_bytes = chain_bytes(600);
    let host = TierSpec {
        cache: lower,
        bandwidth_bytes_per_s: 25e9,
        latency_s: 10e-6,
    };
    let c = TieredCache::new(cfg, TierConfig::marconi(Some(host), None)).unwrap();
    assert_eq!(c.store_probe_positions(50, 10), vec![48, 32, 16]);
    assert_eq!(c.store_probe_positions(49, 2), vec![48, 32]);
    assert_eq!(c.store_probe_positions(48, 10), vec![32, 16]);
    assert!(c.store_probe_positions(16, 10).is_empty());
    assert!(c.store_probe_positions(0, 10).is_empty());
}
