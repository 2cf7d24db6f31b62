//! `marconi-hinted`: the generators' shared prefixes as application
//! checkpoints. Without eviction, hints only add states, so no request hits
//! less than under `marconi`, and the second request of a new system
//! prompt hits it; a trace without prefixes replays exactly as `marconi`.

use marconi_core::ModelSpec;
use marconi_sim::replay::{replay, Policy, Replay, ReplayConfig};
use marconi_sim::synth::{generate, SynthConfig, SynthKind};
use marconi_sim::trace::Trace;

fn run(trace: &Trace, policy: Policy, capacity: u64, concurrent: bool) -> Replay {
    let mut cfg = ReplayConfig::new(policy, ModelSpec::preset("paper-7b").unwrap(), capacity);
    cfg.alpha = Some(0.0);
    cfg.concurrent = concurrent;
    replay(trace, &cfg, &mut |_| {}).unwrap()
}

fn small(kind: SynthKind) -> Trace {
    let mut c = SynthConfig::new(kind);
    c.sessions = 40;
    c.max_input = 12_000;
    generate(&c)
}

#[test]
fn generators_declare_the_prefixes_their_requests_start_with() {
    for kind in [SynthKind::Agentic, SynthKind::Chat, SynthKind::Longout] {
        let t = small(kind);
        assert!(!t.app_prefixes.is_empty(), "{kind}");
        let mut hinted = 0;
        t.for_each(|r| hinted += usize::from(!t.app_checkpoints(r.input()).is_empty()));
        assert!(
            hinted > 0,
            "{kind}: no request starts with a declared prefix"
        );
        if kind == SynthKind::Agentic {
            // Every run starts with the system prompt and demonstration.
            assert_eq!(hinted, t.len());
        }
        // Not part of a trace's identity (a file does not carry them).
        let mut bare = t.clone();
        bare.app_prefixes.clear();
        assert_eq!(bare, t);
    }
}

#[test]
fn app_checkpoints_are_the_lengths_of_the_prefixes_an_input_starts_with() {
    let t = Trace {
        app_prefixes: vec![vec![1, 2, 3], vec![1, 2], vec![9], vec![]],
        ..Trace::default()
    };
    assert_eq!(t.app_checkpoints(&[1, 2, 3, 4]), vec![2, 3]);
    assert_eq!(t.app_checkpoints(&[1, 2, 3]), vec![2]); // not the whole input
    assert_eq!(t.app_checkpoints(&[9, 9]), vec![1]);
    assert!(t.app_checkpoints(&[2, 1]).is_empty());
}

#[test]
fn without_eviction_hints_never_lower_a_hit_and_catch_new_prompts() {
    for kind in [SynthKind::Agentic, SynthKind::Chat, SynthKind::Longout] {
        let t = small(kind);
        for concurrent in [false, true] {
            let plain = run(&t, Policy::Marconi, u64::MAX / 4, concurrent);
            let hinted = run(&t, Policy::MarconiHinted, u64::MAX / 4, concurrent);
            assert_eq!(plain.report.evictions, 0);
            for (i, (a, b)) in plain.outcomes.iter().zip(&hinted.outcomes).enumerate() {
                assert!(
                    b.hit_tokens >= a.hit_tokens,
                    "{kind} concurrent={concurrent} request {i}: {} < {}",
                    b.hit_tokens,
                    a.hit_tokens
                );
            }
            // The second request of each shared prompt now hits it.
            assert!(
                hinted.report.hit_tokens > plain.report.hit_tokens,
                "{kind} concurrent={concurrent}"
            );
        }
    }
}

#[test]
fn a_trace_without_prefixes_replays_as_marconi() {
    let mut t = small(SynthKind::Chat);
    t.app_prefixes.clear();
    for cap in [300_000_000, 2_000_000_000] {
        let mut a = run(&t, Policy::Marconi, cap, false).report;
        let mut b = run(&t, Policy::MarconiHinted, cap, false).report;
        (a.wall_s, b.wall_s) = (0.0, 0.0);
        b.policy = a.policy.clone();
        assert_eq!(a, b);
    }
}
