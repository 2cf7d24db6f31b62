//! The paper comparison (Figs. 7–9): box statistics and a small run.

use marconi_core::ModelSpec;
use marconi_sim::paper::{self, PaperConfig, POLICIES};
use marconi_sim::plot::five_numbers;
use marconi_sim::replay::Policy;
use marconi_sim::synth::SynthKind;

#[test]
fn five_numbers_are_interpolated_quantiles() {
    let v: Vec<f64> = (0..=100).map(f64::from).collect();
    assert_eq!(five_numbers(&v), Some([5.0, 25.0, 50.0, 75.0, 95.0]));
    assert_eq!(five_numbers(&[3.0]), Some([3.0; 5]));
    assert_eq!(five_numbers(&[f64::NAN]), None);
    assert_eq!(five_numbers(&[]), None);
    // Order does not matter.
    assert_eq!(
        five_numbers(&[4.0, 1.0, 3.0, 2.0]),
        five_numbers(&[1.0, 2.0, 3.0, 4.0])
    );
}

#[test]
fn a_small_run_has_one_point_per_trace_and_capacity_and_writes_three_figures() {
    let cfg = PaperConfig {
        workloads: vec![(SynthKind::Chat, vec![500_000_000, 2_000_000_000])],
        seeds: 2,
        rate_factors: vec![1.0],
        sessions: 8,
        model: ModelSpec::preset("paper-7b").unwrap(),
        threads: 2,
    };
    let points = paper::run(&cfg, &|_| {}).unwrap();
    assert_eq!(points.len(), 2 * 2);
    for p in &points {
        assert_eq!(p.reports.len(), POLICIES.len());
        assert_eq!(p.hit(Policy::NoCache), 0.0);
        // All policies saw the same trace.
        let inputs: Vec<u64> = p.reports.iter().map(|r| r.input_tokens).collect();
        assert!(inputs.windows(2).all(|w| w[0] == w[1]), "{inputs:?}");
        let win = p.win_over_sglang();
        let (m, s) = (p.hit(Policy::Marconi), p.hit(Policy::SglangPlus));
        assert!((win - 100.0 * (m - s) / s).abs() < 1e-9);
        assert!(p.p95_ttft_vs_no_cache(Policy::Marconi) <= 1.0 + 1e-9);
    }
    // More capacity never hurts marconi on the same trace here.
    assert!(points[1].hit(Policy::Marconi) >= points[0].hit(Policy::Marconi));
    let dir = std::env::temp_dir().join(format!("marconi-paper-test-{}", std::process::id()));
    let files = paper::figures(&dir, &points).unwrap();
    assert_eq!(files.len(), 3);
    for f in &files {
        let svg = std::fs::read_to_string(f).unwrap();
        assert!(svg.starts_with("<svg"), "{f}");
        assert!(svg.contains("paper Fig."), "{f}");
    }
    let table = paper::table(&points);
    assert!(table.contains("win over sglang+ %"));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn compare_draws_the_fig_10a_difference_only_when_both_policies_ran() {
    use marconi_sim::compare::{figures, policy_jobs, run_jobs};
    use marconi_sim::replay::ReplayConfig;
    use marconi_sim::synth::{generate, SynthConfig};
    let mut sc = SynthConfig::new(SynthKind::Chat);
    sc.sessions = 8;
    let trace = generate(&sc);
    let base = ReplayConfig::new(
        Policy::Marconi,
        ModelSpec::preset("paper-7b").unwrap(),
        1_000_000_000,
    );
    let dir = std::env::temp_dir().join(format!("marconi-fig10-test-{}", std::process::id()));
    let both = run_jobs(
        &trace,
        &policy_jobs(&base, &[Policy::Marconi, Policy::SglangPlus]),
        2,
        &|_| {},
    )
    .unwrap();
    let files = figures(&dir, "t", &both).unwrap();
    assert_eq!(files.len(), 4);
    assert!(files[3].ends_with("hit_diff_by_length.svg"));
    // Bins are named by their bounds, the context line is under every title.
    let svg = std::fs::read_to_string(&files[3]).unwrap();
    assert!(
        svg.contains("paper Fig. 10a") && svg.contains("\nt\n"),
        "{svg}"
    );
    assert!(svg.contains("0–1k") || svg.contains("1k–2k"), "{svg}");
    let one = run_jobs(&trace, &policy_jobs(&base, &[Policy::Marconi]), 1, &|_| {}).unwrap();
    assert_eq!(figures(&dir, "t", &one).unwrap().len(), 3);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn input_length_bins_are_named_by_their_bounds() {
    use marconi_sim::compare::{bin_labels, LENGTH_BINS};
    let labels = bin_labels(&LENGTH_BINS);
    assert_eq!(labels.first().unwrap(), "0–1k");
    assert_eq!(labels[4], "7k–10k");
    assert_eq!(labels.last().unwrap(), "45k+");
}
