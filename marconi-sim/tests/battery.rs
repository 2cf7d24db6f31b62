//! The battery and the clairvoyant reference: the clairvoyant equals the
//! unbounded oracle when nothing is evicted and is at least every policy
//! at equal capacity on the synthetic rows.

use marconi_core::ModelSpec;
use marconi_sim::battery::{self, BatteryConfig, POLICIES};
use marconi_sim::replay::{replay, Policy, ReplayConfig};

fn model() -> ModelSpec {
    ModelSpec::preset("paper-7b").unwrap()
}

/// The CI battery: every synthetic workload, two seeds, small traces.
fn small_battery() -> Vec<battery::Row> {
    let mut cfg = BatteryConfig::new(model());
    for (_, n) in &mut cfg.synth {
        *n = (*n / 2).max(4);
    }
    let traces = battery::synth_traces(&cfg);
    battery::run(&cfg, &traces, &|_| {}).unwrap()
}

#[test]
fn clairvoyant_without_eviction_is_the_oracle() {
    let cfg = BatteryConfig::new(model());
    for t in battery::synth_traces(&cfg).iter().step_by(2) {
        let run = |p| {
            let c = ReplayConfig::new(p, model(), u64::MAX / 4);
            replay(&t.trace, &c, &mut |_| {}).unwrap().report
        };
        let (c, o) = (run(Policy::Clairvoyant), run(Policy::Oracle));
        assert_eq!(c.hit_tokens, o.hit_tokens, "{}", t.workload);
        assert_eq!(c.evictions, 0);
        assert!(c.hit_tokens > 0);
    }
}

#[test]
fn clairvoyant_at_least_every_policy() {
    let rows = small_battery();
    assert_eq!(rows.len(), 3 * 2 * 3);
    for r in &rows {
        assert_eq!(r.reports.len(), POLICIES.len());
        assert!(
            r.bound_holds(),
            "{}: clairvoyant below a policy\n{}",
            r.label(),
            battery::markdown(&rows)
        );
        // Everything is contended: the capacities are below the working set.
        assert!(r.reports.iter().all(|p| p.used_bytes <= r.capacity_bytes));
    }
}
