//! Tiers below the device: with none, a `TieredCache` is its device cache
//! decision for decision; with a host and a store, after every request no
//! tier holds more than its capacity, a hit's loads make it complete (the
//! KV the device lacks, then the state, from a tier that holds it), a
//! lower tier never shadows a device hit, and a load that recomputing beats
//! is declined.

use marconi_core::{
    AlphaMode, CacheConfig, CacheError, CacheEvent, LoadWhat, ModelSpec, PrefixCache, Tier,
    TierConfig, TierSpec, TieredCache, WriteMode,
};
use proptest::prelude::*;

fn model() -> ModelSpec {
    ModelSpec::preset("paper-7b").unwrap()
}

/// Bytes of `tokens` cached tokens plus one state.
fn chain_bytes(tokens: u64) -> u64 {
    let m = model();
    tokens * m.kv_bytes_per_token() + m.state_bytes()
}

fn spec(cache: CacheConfig, gbps: f64) -> TierSpec {
    TierSpec {
        cache,
        bandwidth_bytes_per_s: gbps * 1e9,
        latency_s: 10e-6,
    }
}

/// Conversations: session `s` turn `t` is the session's previous sequence
/// plus a fresh suffix (a shared system prompt first).
fn workload(sessions: u32, turns: u32, seed: u32) -> Vec<(Vec<u32>, Vec<u32>)> {
    let mut x = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
    let mut rnd = || {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        x
    };
    let system: Vec<u32> = (0..40).map(|i| 1_000_000 + i).collect();
    let mut hist: Vec<Vec<u32>> = vec![system.clone(); sessions as usize];
    let mut out = Vec::new();
    for _ in 0..turns {
        for h in hist.iter_mut() {
            let n = 10 + rnd() % 60;
            h.extend((0..n).map(|_| rnd() % 50_000));
            let reply: Vec<u32> = (0..(5 + rnd() % 30)).map(|_| rnd() % 50_000).collect();
            out.push((h.clone(), reply.clone()));
            h.extend(reply);
        }
    }
    out
}

#[test]
fn without_lower_tiers_it_is_the_device_cache() {
    let cap = chain_bytes(2_000);
    let mut plain = PrefixCache::new(CacheConfig::marconi(model(), cap)).unwrap();
    let mut tiered = TieredCache::new(
        CacheConfig::marconi(model(), cap),
        TierConfig::marconi(None, None),
    )
    .unwrap();
    for (input, output) in workload(12, 6, 7) {
        let a = plain.serve(0, &input, &output).unwrap();
        let mut full = input.clone();
        full.extend(&output);
        let b = tiered.serve_full(0, input.len(), &full).unwrap();
        assert_eq!(a.hit_tokens, b.hit_tokens);
        assert_eq!(a.kv_matched_tokens, b.device.kv_matched_tokens);
        assert_eq!(a.planned, b.device.plan);
        assert!(b.loads.is_empty() && b.tier == Tier::Device);
    }
    assert_eq!(plain.stats(), tiered.device().stats());
    assert_eq!(plain.used_bytes(), tiered.device().used_bytes());
}

fn tiered(dev: u64, host: u64, store: u64, write: WriteMode, gbps: f64) -> TieredCache {
    let mut t = TierConfig::marconi(
        Some(spec(CacheConfig::marconi(model(), host), gbps)),
        Some(spec(CacheConfig::marconi(model(), store), gbps / 5.0)),
    );
    t.write = write;
    TieredCache::new(CacheConfig::marconi(model(), dev), t).unwrap()
}

/// Checks one served request against the tiers as they were before it.
fn check_hit(l: &marconi_core::TieredLookup, input: &[u32], holds: &[bool; 3]) {
    let d = l.device.hit_tokens;
    // Never shadowed: at least the device's hit, and a device hit has no loads.
    assert!(l.hit_tokens >= d);
    if l.tier == Tier::Device {
        assert_eq!(l.hit_tokens, d);
        assert!(l.loads.is_empty());
        return;
    }
    assert!(l.hit_tokens > d);
    assert!(
        holds[l.tier.index()],
        "the hit's tier held no state at the hit"
    );
    // The KV loads tile [the device hit's pages, hit), then the state at
    // the hit: KV the device matched past its hit has no page the engine
    // knows (a lease names its hit's pages only), so it is loaded too.
    let page = CacheConfig::marconi(model(), 1).page_size;
    let mut at = (d / page * page).min(l.device.kv_matched_tokens);
    let (last, kv) = l.loads.split_last().unwrap();
    for o in kv {
        match &o.what {
            LoadWhat::Kv { start, end, .. } => {
                assert_eq!(*start, at);
                assert!(end > start);
                at = *end;
                assert_eq!(o.bytes, (end - start) as u64 * model().kv_bytes_per_token());
            }
            LoadWhat::State { .. } => panic!("a state load before the KV loads"),
        }
    }
    assert_eq!(at, l.hit_tokens, "the KV loads do not reach the hit");
    assert_eq!(last.tier, l.tier);
    assert_eq!(
        last.what,
        LoadWhat::State {
            position: l.hit_tokens,
            slot: None
        }
    );
    assert!(
        l.load_s < l.recompute_s,
        "a load slower than recomputing was taken"
    );
    assert!(l.hit_tokens < input.len() as u32);
}

/// Whether each tier holds a state at `input[..hit]` for every hit length
/// the lookup might choose (checked after the fact against the tier's
/// chains taken before the request).
fn holds_state(c: &TieredCache, input: &[u32], hit: u32) -> [bool; 3] {
    let mut out = [false; 3];
    for t in [Tier::Device, Tier::Host, Tier::Store] {
        if let Some(cache) = c.tier(t) {
            out[t.index()] = cache
                .cached_chains()
                .states
                .iter()
                .any(|(ns, s)| *ns == 0 && s.len() == hit as usize && input.starts_with(s));
        }
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, .. ProptestConfig::default() })]

    #[test]
    fn tiers_hold_their_capacity_and_hits_are_complete(
        seed in 0u32..1000,
        dev in 200u64..1500,
        host_mult in 1u64..8,
        store_mult in 1u64..4,
        through in any::<bool>(),
        gbps in prop_oneof![Just(0.001f64), Just(25.0), Just(1e6)],
    ) {
        let dev_b = chain_bytes(dev);
        let host_b = dev_b * host_mult;
        let write = if through { WriteMode::Through } else { WriteMode::Back };
        let mut c = tiered(dev_b, host_b, host_b * store_mult, write, gbps);
        for (input, output) in workload(8, 5, seed) {
            let mut full = input.clone();
            full.extend(&output);
            // What the tiers held before the request, for the longest
            // hit any of them could give.
            let before = c.clone_chains_for_check(&input);
            let l = c.serve_full(0, input.len(), &full).unwrap();
            let holds = before.iter().find(|(h, _)| *h == l.hit_tokens).map(|(_, h)| *h)
                .unwrap_or([true, false, false]);
            check_hit(&l, &input, &holds);
            c.check_invariants();
            let used = c.used_bytes();
            let cap = c.capacity_bytes();
            for i in 0..3 {
                prop_assert!(used[i] <= cap[i], "tier {} holds {} > {}", i, used[i], cap[i]);
            }
        }
        let s = c.stats();
        prop_assert_eq!(
            s.hit_tokens,
            s.hit_tokens_by_tier.iter().sum::<u64>()
        );
    }
}

/// Test-only helper: for each candidate hit length (every prefix length of
/// `input` with a state in some tier), which tiers hold that state.
trait ChainsForCheck {
    fn clone_chains_for_check(&self, input: &[u32]) -> Vec<(u32, [bool; 3])>;
}

impl ChainsForCheck for TieredCache {
    fn clone_chains_for_check(&self, input: &[u32]) -> Vec<(u32, [bool; 3])> {
        let mut lens: Vec<u32> = Vec::new();
        for t in [Tier::Device, Tier::Host, Tier::Store] {
            if let Some(cache) = self.tier(t) {
                for (_, s) in cache.cached_chains().states {
                    if s.len() < input.len() && input.starts_with(&s) {
                        lens.push(s.len() as u32);
                    }
                }
            }
        }
        lens.sort_unstable();
        lens.dedup();
        lens.into_iter()
            .map(|h| (h, holds_state(self, input, h)))
            .collect()
    }
}

#[test]
fn a_load_that_recomputing_beats_is_not_made() {
    let dev = chain_bytes(150);
    // 1 MB/s: no chain is worth demoting, nothing is loaded.
    let mut slow = tiered(dev, dev * 20, dev * 40, WriteMode::Back, 0.001);
    // 5 ms per load: a long chain is worth keeping, but a hit only a few
    // tokens past the device's is faster to recompute.
    let mut far = tiered(dev, dev * 20, dev * 40, WriteMode::Back, 25.0);
    let mut t = far.config().clone();
    for s in [&mut t.host, &mut t.store].into_iter().flatten() {
        s.latency_s = 5e-3;
    }
    far = TieredCache::new(CacheConfig::marconi(model(), dev), t).unwrap();
    let mut declined = 0;
    for (input, output) in workload(10, 4, 3) {
        let mut full = input.clone();
        full.extend(&output);
        let l = slow.serve_full(0, input.len(), &full).unwrap();
        assert_eq!(l.tier, Tier::Device);
        let l = far.serve_full(0, input.len(), &full).unwrap();
        if let Some((_, h)) = l.declined {
            declined += 1;
            assert!(h > l.hit_tokens);
        }
        if l.tier != Tier::Device {
            assert!(l.load_s < l.recompute_s);
        }
    }
    assert_eq!(slow.stats().bytes_loaded, [0, 0, 0]);
    assert_eq!(slow.stats().bytes_written, [0, 0, 0]);
    assert!(slow.stats().demotions_skipped > 0);
    assert!(declined > 0);
    assert_eq!(far.stats().loads_declined, declined);
    assert!(far.stats().bytes_loaded[Tier::Host.index()] > 0);
}

#[test]
fn the_host_turns_device_evictions_into_hits() {
    let dev = chain_bytes(300);
    let load = workload(16, 5, 11);
    let mut one = PrefixCache::new(CacheConfig::marconi(model(), dev)).unwrap();
    let mut two = tiered(dev, dev * 8, dev * 16, WriteMode::Back, 25.0);
    for (input, output) in &load {
        one.serve(0, input, output).unwrap();
        let mut full = input.clone();
        full.extend(output);
        two.serve_full(0, input.len(), &full).unwrap();
    }
    let s = two.stats();
    assert!(s.hit_tokens_by_tier[Tier::Host.index()] > 0);
    assert!(s.bytes_written[Tier::Host.index()] > 0);
    assert!(s.bytes_loaded[Tier::Host.index()] > 0);
    assert!(
        s.token_hit_rate() > one.stats().token_hit_rate() + 0.1,
        "tiers {} vs device alone {}",
        s.token_hit_rate(),
        one.stats().token_hit_rate()
    );
}

#[test]
fn a_sequence_larger_than_the_device_reaches_the_host() {
    // The device holds 20 tokens: every conversation is refused there.
    let mut c = tiered(
        chain_bytes(20),
        chain_bytes(4_000),
        chain_bytes(8_000),
        WriteMode::Back,
        25.0,
    );
    let mut hits = 0;
    for (input, output) in workload(4, 3, 5) {
        let mut full = input.clone();
        full.extend(&output);
        let l = c.serve_full(0, input.len(), &full).unwrap();
        hits += l.hit_tokens;
    }
    assert!(hits > 0);
    assert!(c.stats().hits_by_tier[Tier::Host.index()] > 0);
}

#[test]
fn bad_tier_configurations_are_refused() {
    let dev = CacheConfig::marconi(model(), 1 << 30);
    let host = || spec(CacheConfig::marconi(model(), 1 << 32), 25.0);
    let cases: Vec<TierConfig> = vec![
        TierConfig::marconi(None, Some(host())),
        TierConfig {
            compute_flops: 0.0,
            ..TierConfig::marconi(Some(host()), None)
        },
        TierConfig::marconi(
            Some(TierSpec {
                bandwidth_bytes_per_s: f64::NAN,
                ..host()
            }),
            None,
        ),
        TierConfig::marconi(
            Some(TierSpec {
                latency_s: -1.0,
                ..host()
            }),
            None,
        ),
        TierConfig::marconi(
            Some(spec(
                CacheConfig::marconi(ModelSpec::preset("paper-7b-attn").unwrap(), 1 << 32),
                25.0,
            )),
            None,
        ),
        TierConfig::marconi(Some(spec(CacheConfig::marconi(model(), 0), 25.0)), None),
    ];
    for t in cases {
        assert!(
            matches!(
                TieredCache::new(dev.clone(), t.clone()),
                Err(CacheError::InvalidConfig(_))
            ),
            "accepted {t:?}"
        );
    }
}

/// `k` conversations requested round-robin for `rounds` rounds: each
/// starts with `len` tokens of its own and every request extends the
/// previous one by a token.
fn cycle(k: u32, len: u32, rounds: u32) -> Vec<Vec<u32>> {
    let mut chains: Vec<Vec<u32>> = (0..k)
        .map(|c| (0..len).map(|t| 1 + c * 100_000 + t).collect())
        .collect();
    let mut out = Vec::new();
    for r in 0..rounds {
        for c in chains.iter_mut() {
            c.push(50_000 + r);
            out.push(c.clone());
        }
    }
    out
}

fn fixed(cap: u64) -> CacheConfig {
    CacheConfig {
        alpha: AlphaMode::Fixed(0.0),
        ..CacheConfig::marconi(model(), cap)
    }
}

/// Eight chains cycled through a device that holds two and a host that
/// holds six: one cache of the combined size holds all eight, and so do
/// exclusive tiers (a chain the host served moves up and leaves room for
/// the one the device demotes). Inclusive tiers keep a copy of what they
/// served, hold six distinct chains between them, and miss every time.
#[test]
fn exclusive_tiers_hold_what_one_cache_of_their_sum_holds() {
    let (k, len, rounds) = (8u32, 200u32, 6u32);
    let chain = chain_bytes(u64::from(len + rounds));
    let (dev, host) = (2 * chain + chain / 2, 6 * chain + chain / 2);
    let load = cycle(k, len, rounds);
    let mut one = PrefixCache::new(fixed(dev + host)).unwrap();
    let mut hits = [0u64; 3];
    for input in &load {
        hits[0] += u64::from(one.serve(0, input, &[]).unwrap().hit_tokens);
    }
    for (slot, exclusive) in [(1, true), (2, false)] {
        let mut t = TierConfig::marconi(Some(spec(fixed(host), 25.0)), None);
        t.exclusive = exclusive;
        let mut c = TieredCache::new(fixed(dev), t).unwrap();
        for input in &load {
            let l = c.serve_full(0, input.len(), input).unwrap();
            hits[slot] += u64::from(l.hit_tokens);
            c.check_invariants();
        }
    }
    // Every request after the first round resumes from the previous one.
    let want: u64 = load[k as usize..].iter().map(|i| i.len() as u64 - 1).sum();
    assert_eq!(hits[0], want, "one cache of the combined size");
    assert_eq!(hits[1], want, "exclusive tiers");
    assert!(hits[2] < want / 2, "inclusive tiers: {} of {want}", hits[2]);
}

/// Once a host hit is loaded and the device holds the request's state,
/// the host no longer holds that chain (no tier holds a chain twice),
/// unless the tiers are inclusive.
#[test]
fn a_served_chain_leaves_the_host_that_served_it() {
    let chain = chain_bytes(100);
    for exclusive in [true, false] {
        let mut t = TierConfig::marconi(Some(spec(fixed(20 * chain), 25.0)), None);
        t.exclusive = exclusive;
        let mut c = TieredCache::new(fixed(chain + chain / 2), t).unwrap();
        let a: Vec<u32> = (1..=100).collect();
        let b: Vec<u32> = (1001..=1100).collect();
        c.serve_full(0, a.len(), &a).unwrap();
        // b evicts a from the device: a is demoted to the host.
        c.serve_full(0, b.len(), &b).unwrap();
        assert_eq!(holds_state(&c, &a, 100), [false, true, false]);
        let mut next = a.clone();
        next.extend(2001..2050);
        let l = c.serve_full(0, next.len(), &next).unwrap();
        assert_eq!((l.tier, l.hit_tokens), (Tier::Host, 100));
        assert_eq!(holds_state(&c, &a, 100)[Tier::Host.index()], !exclusive);
        c.check_invariants();
    }
}

/// A tiered lookup peeks at the lower tiers and looks up (leases) only the
/// tier whose hit it takes: a request served from the device leaves the
/// host's counters and recency as they were.
#[test]
fn only_the_tier_whose_hit_is_taken_is_looked_up() {
    let chain = chain_bytes(100);
    let mut c = TieredCache::new(
        fixed(3 * chain),
        TierConfig::marconi(Some(spec(fixed(20 * chain), 25.0)), None),
    )
    .unwrap();
    let a: Vec<u32> = (1..=100).collect();
    c.serve_full(0, a.len(), &a).unwrap();
    let before = c.tier(Tier::Host).unwrap().stats();
    let mut next = a.clone();
    next.extend(500..540);
    let l = c.serve_full(0, next.len(), &next).unwrap();
    assert_eq!(l.tier, Tier::Device);
    assert_eq!(
        c.tier(Tier::Host).unwrap().stats().requests,
        before.requests
    );
}

/// With `defer_moves`, `admit` and `release` leave the lower tiers as they
/// were (the served chain stays leased in the host) and `settle` drops
/// it; the decisions are those of the tiers that settle at once.
#[test]
fn deferred_moves_discard_in_settle() {
    let chain = chain_bytes(100);
    let mk = |defer: bool| {
        let mut t = TierConfig::marconi(Some(spec(fixed(20 * chain), 25.0)), None);
        t.defer_moves = defer;
        TieredCache::new(fixed(chain + chain / 2), t).unwrap()
    };
    let (mut now, mut later) = (mk(false), mk(true));
    let a: Vec<u32> = (1..=100).collect();
    let b: Vec<u32> = (1001..=1100).collect();
    let mut next = a.clone();
    next.extend(2001..2050);
    for c in [&mut now, &mut later] {
        c.serve_full(0, a.len(), &a).unwrap();
        c.settle().unwrap();
        c.serve_full(0, b.len(), &b).unwrap();
        c.settle().unwrap();
    }
    let l_now = now.serve_full(0, next.len(), &next).unwrap();
    let l_later = later.serve_full(0, next.len(), &next).unwrap();
    assert_eq!((l_later.tier, l_later.hit_tokens), (Tier::Host, 100));
    assert_eq!(l_now.hit_tokens, l_later.hit_tokens);
    assert!(holds_state(&later, &a, 100)[Tier::Host.index()]);
    assert!(!holds_state(&now, &a, 100)[Tier::Host.index()]);
    later.settle().unwrap();
    assert!(!holds_state(&later, &a, 100)[Tier::Host.index()]);
    assert_eq!(
        later.tier(Tier::Host).unwrap().cached_chains(),
        now.tier(Tier::Host).unwrap().cached_chains()
    );
    later.check_invariants();
}

/// A caller that asks for the device's events gets the whole stream (what
/// each admission stored, then what was evicted), and the tiers still
/// demote what the device evicts.
#[test]
fn the_device_stream_is_whole_when_the_caller_wants_it() {
    let chain = chain_bytes(100);
    let dev = CacheConfig {
        events: true,
        ..fixed(chain + chain / 2)
    };
    let mut c = TieredCache::new(
        dev,
        TierConfig::marconi(Some(spec(fixed(20 * chain), 25.0)), None),
    )
    .unwrap();
    let a: Vec<u32> = (1..=100).collect();
    let b: Vec<u32> = (1001..=1100).collect();
    c.serve_full(0, a.len(), &a).unwrap();
    c.serve_full(0, b.len(), &b).unwrap();
    let ev = c.drain_device_events();
    let count = |f: fn(&CacheEvent) -> bool| ev.iter().filter(|e| f(e)).count();
    assert!(matches!(ev.first(), Some(CacheEvent::AllCleared)));
    assert_eq!(count(|e| matches!(e, CacheEvent::StateStored { .. })), 2);
    assert_eq!(count(|e| matches!(e, CacheEvent::KvStored { .. })), 2);
    assert_eq!(count(|e| matches!(e, CacheEvent::StateRemoved { .. })), 1);
    assert_eq!(holds_state(&c, &a, 100), [false, true, false]);
    assert_eq!(c.stats().writes[Tier::Host.index()], 1);
}
