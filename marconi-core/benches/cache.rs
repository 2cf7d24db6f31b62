//! Lookup, serve and eviction cost against tree size.
//!
//! `cargo bench -p marconi-core --bench cache`. The tree is built from
//! sessions that share a system prompt and grow turn by turn (the agentic
//! shape of the paper), so it has the branching of a real cache.

#![expect(
    missing_docs,
    reason = "criterion_group! generates an undocumented function"
)]

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use marconi_core::{AlphaMode, CacheConfig, ModelSpec, PrefixCache};

mod common;
use common::Lcg;

/// `sessions` sessions of `turns` turns after a 2,000-token shared prompt.
fn workload(sessions: u32, turns: u32) -> Vec<(Vec<u32>, Vec<u32>)> {
    let mut rng = Lcg(42);
    let system: Vec<u32> = (0..2000).map(|_| rng.next() % 50_000).collect();
    let mut hist: Vec<Vec<u32>> = vec![system; sessions as usize];
    let mut reqs = Vec::new();
    for _ in 0..turns {
        for h in hist.iter_mut() {
            let n = 50 + rng.next() % 200;
            h.extend((0..n).map(|_| rng.next() % 50_000));
            let out: Vec<u32> = (0..(20 + rng.next() % 80))
                .map(|_| rng.next() % 50_000)
                .collect();
            reqs.push((h.clone(), out.clone()));
            h.extend(out);
        }
    }
    reqs
}

fn filled(cfg: CacheConfig, reqs: &[(Vec<u32>, Vec<u32>)]) -> PrefixCache {
    let mut c = PrefixCache::new(cfg).unwrap();
    for (i, o) in reqs {
        c.serve(0, i, o).unwrap();
    }
    c
}

fn bench(c: &mut Criterion) {
    let model = ModelSpec::preset("paper-7b").unwrap();
    let mut g = c.benchmark_group("core");
    for sessions in [100u32, 1000, 4000] {
        let reqs = workload(sessions, 4);
        let big = CacheConfig {
            alpha: AlphaMode::Fixed(
                std::env::var("BENCH_ALPHA").map_or(1.0, |a| a.parse().unwrap()),
            ),
            ..CacheConfig::marconi(model.clone(), u64::MAX / 2)
        };
        let used = filled(big.clone(), &reqs).used_bytes();
        // The same tree in a cache that is exactly full.
        let cache = filled(
            CacheConfig {
                capacity_bytes: used,
                ..big
            },
            &reqs,
        );
        let nodes = cache.stats().nodes;
        eprintln!("tree with {sessions} sessions: {nodes} nodes");

        // Lookup + release of an existing conversation's next turn.
        let probes: Vec<Vec<u32>> = reqs
            .iter()
            .rev()
            .take(64)
            .map(|(i, o)| {
                let mut v = i.clone();
                v.extend(o);
                v.push(7);
                v
            })
            .collect();
        g.throughput(Throughput::Elements(1));
        g.bench_function(format!("lookup_release/{nodes}_nodes"), |b| {
            let mut cache = cache.clone();
            let mut k = 0;
            b.iter(|| {
                let l = cache.lookup(0, &probes[k % probes.len()]).unwrap();
                cache.release(l.lease).unwrap();
                k += 1;
                l.hit_tokens
            })
        });

        // One eviction round freeing 64 nodes' worth of bytes, FLOP-aware, α = 1.
        let state = model.state_bytes();
        g.throughput(Throughput::Elements(64));
        g.bench_function(format!("evict_64_states/{nodes}_nodes"), |b| {
            b.iter_batched(
                || cache.clone(),
                |mut c| {
                    c.evict(64 * state);
                    c
                },
                BatchSize::LargeInput,
            )
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
