//! Replay numbers: pinned by snapshot on a small trace, the oracle bounds
//! every policy, no-cache hits nothing, hand-made traces give exact hits.

use std::fmt::Write as _;

use marconi_core::ModelSpec;
use marconi_sim::compare::{policy_jobs, run_jobs};
use marconi_sim::replay::{replay, Policy, Replay, ReplayConfig};
use marconi_sim::synth::{generate, SynthConfig, SynthKind};
use marconi_sim::trace::Trace;

fn small_agentic() -> Trace {
    let mut c = SynthConfig::new(SynthKind::Agentic);
    c.sessions = 8;
    c.max_input = 20_000;
    c.session_rate = 0.2;
    generate(&c)
}

fn run_all(trace: &Trace, capacity: u64, concurrent: bool) -> Vec<Replay> {
    let mut base = ReplayConfig::new(
        Policy::Marconi,
        ModelSpec::preset("paper-7b").unwrap(),
        capacity,
    );
    base.concurrent = concurrent;
    // The clairvoyant reference replays sequentially only.
    let policies: Vec<Policy> = Policy::ALL
        .into_iter()
        .filter(|&p| !(concurrent && p == Policy::Clairvoyant))
        .collect();
    run_jobs(trace, &policy_jobs(&base, &policies), 0, &|_| {}).unwrap()
}

/// Reports without the wall clock, one line per policy.
fn render(replays: &[Replay]) -> String {
    let mut s = String::new();
    for r in replays {
        let p = &r.report;
        let _ = writeln!(
            s,
            "{:<11} req {} in {} hit {} ({:.4}) req_hit {:.4} unusable {} flops_saved {:.4e} ({:.4}) \
             ttft p50 {:.2} p95 {:.2} evictions {} states {} alpha {:.1}",
            p.policy,
            p.requests,
            p.input_tokens,
            p.hit_tokens,
            p.token_hit_rate,
            p.request_hit_rate,
            p.kv_matched_unusable_tokens,
            p.flops_saved,
            p.flop_savings_rate,
            p.ttft_p50_ms,
            p.ttft_p95_ms,
            p.evictions,
            p.states_admitted,
            p.alpha
        );
    }
    s
}

#[test]
fn small_trace_numbers_are_pinned() {
    let t = small_agentic();
    // 3 GB: about 45 K tokens of KV for paper-7b, contended for this trace.
    let seq = run_all(&t, 3_000_000_000, false);
    insta::assert_snapshot!("sequential_3gb", render(&seq));
    let conc = run_all(&t, 3_000_000_000, true);
    insta::assert_snapshot!("concurrent_3gb", render(&conc));
    // Parallel and one-at-a-time runs agree (replays are deterministic).
    let mut base = ReplayConfig::new(
        Policy::Marconi,
        ModelSpec::preset("paper-7b").unwrap(),
        3_000_000_000,
    );
    let one = replay(&t, &base, &mut |_| {}).unwrap();
    assert_eq!(render(&[one]), render(&seq[..1]));
    base.policy = Policy::VllmPlus;
    let one = replay(&t, &base, &mut |_| {}).unwrap();
    assert_eq!(render(&[one]), render(&seq[2..3]));
}

#[test]
fn oracle_bounds_every_policy_and_no_cache_is_zero() {
    let t = small_agentic();
    for concurrent in [false, true] {
        for cap in [1_000_000_000, 3_000_000_000, 20_000_000_000] {
            let rs = run_all(&t, cap, concurrent);
            let get = |p: Policy| rs.iter().find(|r| r.report.policy == p.name()).unwrap();
            let oracle = get(Policy::Oracle).report.hit_tokens;
            for r in &rs {
                assert!(
                    r.report.hit_tokens <= oracle,
                    "{} ({cap}, concurrent {concurrent}): {} > oracle {oracle}",
                    r.report.policy,
                    r.report.hit_tokens
                );
                assert_eq!(r.report.requests, t.len() as u64);
                assert_eq!(r.outcomes.len(), t.len());
            }
            let none = &get(Policy::NoCache).report;
            assert_eq!((none.hit_tokens, none.flops_saved), (0, 0.0));
            assert_eq!(none.token_hit_rate, 0.0);
            assert!(get(Policy::NoCache)
                .outcomes
                .iter()
                .all(|o| o.hit_tokens == 0));
            assert!(oracle > 0);
        }
    }
}

/// Replays a hand-written trace under `policy` with a large cache and
/// returns the hit of each request.
fn hits(text: &str, policy: Policy) -> Vec<u32> {
    let t = Trace::read(text.as_bytes()).unwrap();
    let cfg = ReplayConfig::new(
        policy,
        ModelSpec::preset("paper-7b").unwrap(),
        100_000_000_000,
    );
    let r = replay(&t, &cfg, &mut |_| {}).unwrap();
    r.outcomes.iter().map(|o| o.hit_tokens).collect()
}

fn seq(range: std::ops::Range<u32>) -> String {
    let v: Vec<String> = range.map(|x| x.to_string()).collect();
    v.join(",")
}

#[test]
fn exact_hits_on_hand_made_traces() {
    // Two sessions share a 64-token prefix; session 0 has a second turn.
    let text = format!(
        "{}\n{}\n{}\n",
        format_args!(
            r#"{{"id":0,"session":0,"arrival_s":0,"input":[{}],"output":[{}]}}"#,
            seq(0..100),
            seq(1000..1010)
        ),
        format_args!(
            r#"{{"id":1,"session":1,"arrival_s":1,"input":[{},{}],"output":[1]}}"#,
            seq(0..64),
            seq(5000..5050)
        ),
        format_args!(
            r#"{{"id":2,"session":0,"arrival_s":2,"extends":0,"append":[{}],"output":[2]}}"#,
            seq(2000..2020)
        ),
    );
    // Marconi admission: nothing on the first request; the second finds no
    // state at the branch (64) but plans one there; the third resumes from
    // the final state of the first (100 input + 10 output).
    assert_eq!(hits(&text, Policy::Marconi), [0, 0, 110]);
    assert_eq!(hits(&text, Policy::SglangPlus), [0, 0, 110]);
    // vLLM+: a state every 32 tokens, so the shared prefix hits at 64, and
    // the third request at the last block boundary, 96.
    assert_eq!(hits(&text, Policy::VllmPlus), [0, 64, 96]);
    // The oracle reuses everything matched (the last input token is always
    // recomputed).
    assert_eq!(hits(&text, Policy::Oracle), [0, 64, 110]);
    // The clairvoyant places a state at 64 with hindsight (the first
    // request saves it) and keeps everything in this large cache.
    assert_eq!(hits(&text, Policy::Clairvoyant), [0, 64, 110]);
    assert_eq!(hits(&text, Policy::NoCache), [0, 0, 0]);
}

#[test]
fn configuration_errors_are_not_request_errors() {
    let t = small_agentic();
    let model = ModelSpec::preset("paper-7b").unwrap();
    let bad = ReplayConfig::new(Policy::Marconi, model.clone(), 0);
    assert_eq!(
        bad.validate().unwrap_err().to_string(),
        "invalid configuration: capacity_bytes is 0"
    );
    let mut calls = 0;
    let e = replay(&t, &bad, &mut |_| calls += 1).unwrap_err();
    assert_eq!(e.to_string(), "invalid configuration: capacity_bytes is 0");
    assert_eq!(calls, 0);
    // Settings the core does not see are checked too.
    let mut c = ReplayConfig::new(Policy::Oracle, model.clone(), 1);
    c.decode_ms_per_token = f64::NAN;
    assert_eq!(
        c.validate().unwrap_err().to_string(),
        "invalid configuration: decode time per token NaN ms is not finite and >= 0"
    );
    let mut c = ReplayConfig::new(Policy::NoCache, model.clone(), 1);
    c.ttft = marconi_sim::ttft::TtftModel::Flops {
        base_ms: 10.0,
        peak_flops: 0.0,
        efficiency: 0.4,
    };
    assert_eq!(
        c.validate().unwrap_err().to_string(),
        "invalid configuration: TTFT model: peak FLOP/s 0 is not finite and > 0"
    );
    // A comparison checks every job before running any.
    let good = ReplayConfig::new(Policy::SglangPlus, model, 1_000_000_000);
    let ticks = std::sync::atomic::AtomicU64::new(0);
    let e = run_jobs(&t, &[good, bad], 1, &|n| {
        ticks.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
    })
    .unwrap_err();
    assert_eq!(e.to_string(), "invalid configuration: capacity_bytes is 0");
    assert_eq!(ticks.into_inner(), 0);
}
