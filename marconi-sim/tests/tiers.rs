//! `--tiers` replays: hits from every tier count in `token_hit_rate` and
//! add up by tier, no tier ends over its capacity, a host turns the
//! device's evictions into hits, and marconi's tiers are not below the
//! HiCache-like baseline on a contended chat trace.

use marconi_core::ModelSpec;
use marconi_sim::replay::{replay, Policy, ReplayConfig};
use marconi_sim::synth::{generate, SynthConfig, SynthKind};
use marconi_sim::tiers::{parse_tiers, TierPolicy, TierSim};

#[test]
fn tiered_replays_report_every_tier() {
    let mut c = SynthConfig::new(SynthKind::Chat);
    c.sessions = 80;
    c.seed = 4;
    let trace = generate(&c);
    let model = ModelSpec::preset("paper-7b").unwrap();
    let sizes = parse_tiers("device:200MB,host:1600MB,store:4GB").unwrap();
    let one = replay(
        &trace,
        &ReplayConfig::new(Policy::Marconi, model.clone(), sizes.device),
        &mut |_| {},
    )
    .unwrap()
    .report;
    assert!(one.tiers.is_none());
    let mut rates = Vec::new();
    for (policy, tp) in [
        (Policy::Marconi, TierPolicy::Marconi),
        (Policy::SglangPlus, TierPolicy::Hicache),
    ] {
        let mut cfg = ReplayConfig::new(policy, model.clone(), sizes.device);
        let mut sim = TierSim::new(sizes);
        sim.policy = tp;
        cfg.tiers = Some(sim);
        let r = replay(&trace, &cfg, &mut |_| {}).unwrap();
        let t = r.report.tiers.as_ref().expect("a tiers report");
        let by_tier: f64 = t.token_hit_rate_by_tier.iter().sum();
        assert!((by_tier - r.report.token_hit_rate).abs() < 1e-12);
        for (used, cap) in t.used_bytes.iter().zip(t.capacity_bytes) {
            assert!(*used <= cap);
        }
        assert!(t.hits_by_tier[1] > 0 && t.bytes_loaded[1] > 0 && t.bytes_written[1] > 0);
        assert_eq!(r.outcomes.len() as u64, r.report.requests);
        let hits: u64 = r.outcomes.iter().map(|o| o.hit_tokens as u64).sum();
        assert_eq!(hits, r.report.hit_tokens);
        rates.push(r.report.token_hit_rate);
    }
    assert!(
        rates[0] > one.token_hit_rate + 0.2,
        "{rates:?} vs {}",
        one.token_hit_rate
    );
    assert!(
        rates[0] >= rates[1],
        "marconi {} < hicache {}",
        rates[0],
        rates[1]
    );
    // Concurrent replays with tiers are refused, not run single-tier.
    let mut cfg = ReplayConfig::new(Policy::Marconi, model, sizes.device);
    cfg.tiers = Some(TierSim::new(sizes));
    cfg.concurrent = true;
    assert!(replay(&trace, &cfg, &mut |_| {}).is_err());
}
