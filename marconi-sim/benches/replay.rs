//! Replay throughput per policy on a synthetic agentic trace (50 sessions,
//! about 1,700 requests). The full-size figures come from
//! `marconi-sim compare --threads 1`, which prints requests/s per policy.
#![expect(
    missing_docs,
    reason = "criterion_group! generates an undocumented function"
)]

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use marconi_core::ModelSpec;
use marconi_sim::replay::{replay, Policy, ReplayConfig};
use marconi_sim::synth::{generate, SynthConfig, SynthKind};

fn bench(c: &mut Criterion) {
    let mut sc = SynthConfig::new(SynthKind::Agentic);
    sc.sessions = 50;
    let trace = generate(&sc);
    let mut g = c.benchmark_group("replay_agentic_50_sessions");
    g.sample_size(10);
    g.throughput(Throughput::Elements(trace.len() as u64));
    for policy in Policy::ALL {
        let cfg = ReplayConfig::new(
            policy,
            ModelSpec::preset("paper-7b").unwrap(),
            10_000_000_000,
        );
        g.bench_function(policy.name(), |b| {
            b.iter(|| replay(&trace, &cfg, &mut |_| {}).unwrap().report.hit_tokens)
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
