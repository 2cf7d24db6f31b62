//! What the tiers cost the request path: per request, the tiered lookup
//! (peeks at the host and the store, the device's lookup, the choice of
//! the hit, the lease of the tier it loads from and its load orders) and
//! the tiered admission + release, against the same calls on the device
//! cache alone; p50, p99 and max, and the cost per demotion.
//!
//! The tiers defer their moves (`TierConfig::defer_moves`): `admit` and
//! `release` only record what the device evicted and queue the lower
//! tiers' lease releases and exclusive discards; `settle`, timed on its
//! own, does them and moves the chains down, as an engine would between
//! decode steps.
//!
//! `cargo bench -p marconi-core --bench tier_decision` (under a minute;
//! `-- --requests N` measures N requests). The device holds 100 k tokens,
//! the host 800 k, the store 3.2 M (fixed α, so that the figures are the
//! tiers', not the tuner's); the workload is `decision_latency`'s agentic
//! sessions (8 system prompts of 1.5–3 k tokens, 64 sessions in flight).

use std::time::{Duration, Instant};

use marconi_core::{
    AlphaMode, CacheConfig, ModelSpec, PrefixCache, TierConfig, TierSpec, TieredCache,
};

mod common;
use common::Workload;

fn config(tokens: u64) -> CacheConfig {
    let model = ModelSpec::preset("paper-7b").expect("preset");
    let kv = model.kv_bytes_per_token();
    CacheConfig {
        alpha: AlphaMode::Fixed(1.0),
        ..CacheConfig::marconi(model, tokens * kv)
    }
}

fn spec(tokens: u64, gbps: f64) -> TierSpec {
    TierSpec {
        cache: config(tokens),
        bandwidth_bytes_per_s: gbps * 1e9,
        latency_s: 10e-6,
    }
}

fn quantiles(mut v: Vec<Duration>) -> String {
    if v.is_empty() {
        return "-".into();
    }
    v.sort_unstable();
    let q = |p: f64| v[((v.len() - 1) as f64 * p).round() as usize];
    format!(
        "p50 {:>7.2} µs  p99 {:>7.2} µs  max {:>8.2} µs  (n = {})",
        q(0.5).as_secs_f64() * 1e6,
        q(0.99).as_secs_f64() * 1e6,
        v[v.len() - 1].as_secs_f64() * 1e6,
        v.len()
    )
}

fn main() {
    let mut requests = 4000usize;
    let args: Vec<String> = std::env::args().collect();
    if let Some(i) = args.iter().position(|a| a == "--requests") {
        requests = args
            .get(i + 1)
            .and_then(|s| s.parse().ok())
            .unwrap_or(requests);
    }
    let dev = 100_000;
    let mut tiers = TierConfig::marconi(Some(spec(8 * dev, 25.0)), Some(spec(32 * dev, 5.0)));
    tiers.defer_moves = true;
    let mut tiered = TieredCache::new(config(dev), tiers).expect("tiered cache");
    let mut plain = PrefixCache::new(config(dev)).expect("cache");
    let mut w = Workload::new();
    let mut full = Vec::new();
    // Warm up: fill every tier.
    for _ in 0..3000 {
        let n = w.next(&mut full);
        tiered.serve_full(0, n, &full).expect("serve");
        tiered.settle().expect("settle");
        plain.serve_full(0, n, &full).expect("serve");
    }
    let (mut t_lookup, mut t_admit, mut p_lookup, mut p_admit) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut per_move = Vec::new();
    let mut t_settle = Vec::new();
    let mut moves = 0usize;
    let mut lower_hits = 0usize;
    for _ in 0..requests {
        let n = w.next(&mut full);
        tiered.drain_moves();
        let t0 = Instant::now();
        let l = tiered.lookup(0, &full[..n]).expect("lookup");
        let t1 = Instant::now();
        let mut states = tiered.device().states_to_save(&l.device, full.len());
        states.retain(|s| s.position > l.hit_tokens || l.plan.contains(&s.position));
        let t2 = Instant::now();
        tiered.admit(&l, &full, &states, &[]).expect("admit");
        tiered.release(&l).expect("release");
        let t3 = Instant::now();
        tiered.settle().expect("settle");
        let t4 = Instant::now();
        t_lookup.push(t1 - t0);
        t_admit.push(t3 - t2);
        t_settle.push(t4 - t3);
        let m = tiered.drain_moves().len();
        if m > 0 {
            per_move.push((t4 - t3) / m as u32);
            moves += m;
        }
        lower_hits += usize::from(!l.loads.is_empty());

        let t0 = Instant::now();
        let pl = plain.lookup(0, &full[..n]).expect("lookup");
        let t1 = Instant::now();
        let states = plain.states_to_save(&pl, full.len());
        let t2 = Instant::now();
        plain.admit(pl.lease, &full, &states, &[]).expect("admit");
        plain.release(pl.lease).expect("release");
        let t3 = Instant::now();
        p_lookup.push(t1 - t0);
        p_admit.push(t3 - t2);
    }
    println!("tier_decision: {requests} requests, device 100k tokens, host 800k, store 3.2M");
    println!("  lookup, device alone        {}", quantiles(p_lookup));
    println!("  lookup, tiered (probes+choice) {}", quantiles(t_lookup));
    println!("  admit+release, device alone {}", quantiles(p_admit));
    println!("  admit+release, tiered       {}", quantiles(t_admit));
    println!("  settle (moves, off the path) {}", quantiles(t_settle));
    println!(
        "  per demotion (settle of requests that demoted / their demotions) {}",
        quantiles(per_move)
    );
    println!("  demotions: {moves}; requests resumed from a lower tier: {lower_hits}");
}
