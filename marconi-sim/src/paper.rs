//! The paper's end-to-end comparison (Marconi Figs. 7–9): many traces per
//! workload (seeds × session arrival rates × capacities), every policy on
//! each, and box plots over the traces: token hit rate against vLLM+
//! (Fig. 7), Marconi's win over SGLang+ (Fig. 8), P95 TTFT relative to no
//! prefix caching (Fig. 9).

use std::fmt::Write as _;
use std::path::Path;

use marconi_core::ModelSpec;

use crate::compare::run_jobs;
use crate::plot;
use crate::replay::{Policy, ReplayConfig, ReplayError, Report};
use crate::synth::{generate, SynthConfig, SynthKind};
use crate::units::format_bytes;

/// What to run.
#[derive(Clone, Debug)]
pub struct PaperConfig {
    /// Workloads, with the capacities each is replayed under.
    pub workloads: Vec<(SynthKind, Vec<u64>)>,
    /// Seeds per workload (each a different trace).
    pub seeds: u32,
    /// Session arrival rates, as multiples of the workload's default.
    pub rate_factors: Vec<f64>,
    /// Sessions per trace (0: the generator's default).
    pub sessions: u32,
    /// The model.
    pub model: ModelSpec,
    /// Threads (0: one per core).
    pub threads: usize,
}

impl PaperConfig {
    /// The defaults: ShareGPT-like chats, LMSys-like long outputs and
    /// SWE-agent-like sessions, two capacities each where the cache is
    /// contended, 3 seeds × 2 arrival rates: 12 traces per workload.
    pub fn new(model: ModelSpec) -> Self {
        const GB: u64 = 1_000_000_000;
        PaperConfig {
            workloads: vec![
                (SynthKind::Chat, vec![GB, 2 * GB]),
                (SynthKind::Longout, vec![2 * GB, 5 * GB]),
                (SynthKind::Agentic, vec![3 * GB, 6 * GB]),
            ],
            seeds: 3,
            rate_factors: vec![0.5, 2.0],
            sessions: 60,
            model,
            threads: 0,
        }
    }
}

/// The policies every trace is replayed under.
pub const POLICIES: [Policy; 4] = [
    Policy::Marconi,
    Policy::SglangPlus,
    Policy::VllmPlus,
    Policy::NoCache,
];

/// One trace's results.
#[derive(Clone, Debug)]
pub struct Point {
    /// Workload.
    pub kind: SynthKind,
    /// Generator seed.
    pub seed: u64,
    /// Session arrival rate (sessions per second).
    pub session_rate: f64,
    /// Cache capacity.
    pub capacity_bytes: u64,
    /// One report per policy of [`POLICIES`], in that order.
    pub reports: Vec<Report>,
}

impl Point {
    fn get(&self, p: Policy) -> &Report {
        let i = POLICIES.iter().position(|&q| q == p).expect("known policy");
        &self.reports[i]
    }

    /// Token hit rate (%) of a policy.
    pub fn hit(&self, p: Policy) -> f64 {
        100.0 * self.get(p).token_hit_rate
    }

    /// Marconi's token hit rate over SGLang+'s, in % (the paper's "win").
    pub fn win_over_sglang(&self) -> f64 {
        let s = self.hit(Policy::SglangPlus);
        if s > 0.0 {
            100.0 * (self.hit(Policy::Marconi) - s) / s
        } else {
            0.0
        }
    }

    /// A policy's P95 TTFT relative to no prefix caching.
    pub fn p95_ttft_vs_no_cache(&self, p: Policy) -> f64 {
        let base = self.get(Policy::NoCache).ttft_p95_ms;
        if base > 0.0 {
            self.get(p).ttft_p95_ms / base
        } else {
            1.0
        }
    }
}

/// Generates every trace and replays it under every policy. `tick` gets
/// request counts as replays progress.
pub fn run(cfg: &PaperConfig, tick: &(dyn Fn(u64) + Sync)) -> Result<Vec<Point>, ReplayError> {
    let mut points = Vec::new();
    for (kind, capacities) in &cfg.workloads {
        for seed in 0..u64::from(cfg.seeds) {
            for &factor in &cfg.rate_factors {
                let mut sc = SynthConfig::new(*kind);
                sc.seed = seed;
                sc.session_rate *= factor;
                if cfg.sessions > 0 {
                    sc.sessions = cfg.sessions;
                }
                let trace = generate(&sc);
                for &capacity in capacities {
                    let jobs: Vec<ReplayConfig> = POLICIES
                        .iter()
                        .map(|&p| ReplayConfig::new(p, cfg.model.clone(), capacity))
                        .collect();
                    let replays = run_jobs(&trace, &jobs, cfg.threads, tick)?;
                    points.push(Point {
                        kind: *kind,
                        seed,
                        session_rate: sc.session_rate,
                        capacity_bytes: capacity,
                        reports: replays.into_iter().map(|r| r.report).collect(),
                    });
                }
            }
        }
    }
    Ok(points)
}

fn kind_name(k: SynthKind) -> &'static str {
    match k {
        SynthKind::Chat => "chat (ShareGPT-like)",
        SynthKind::Longout => "longout (LMSys-like)",
        SynthKind::Agentic => "agentic (SWEBench-like)",
    }
}

/// Workloads in first-seen order.
fn kinds(points: &[Point]) -> Vec<SynthKind> {
    let mut ks: Vec<SynthKind> = Vec::new();
    for p in points {
        if !ks.contains(&p.kind) {
            ks.push(p.kind);
        }
    }
    ks
}

fn values(points: &[Point], k: SynthKind, f: impl Fn(&Point) -> f64) -> Vec<f64> {
    points.iter().filter(|p| p.kind == k).map(f).collect()
}

/// One row per trace, then the per-workload distributions (P5, Q1, median,
/// Q3, P95 over the traces).
pub fn table(points: &[Point]) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{:<24} {:>4} {:>7} {:>9} {:>8} {:>8} {:>8} {:>9} {:>10}",
        "workload",
        "seed",
        "rate/s",
        "capacity",
        "marconi",
        "sglang+",
        "vllm+",
        "win %",
        "p95 ttft"
    );
    for p in points {
        let _ = writeln!(
            s,
            "{:<24} {:>4} {:>7.3} {:>9} {:>8.2} {:>8.2} {:>8.2} {:>9.1} {:>10.3}",
            kind_name(p.kind),
            p.seed,
            p.session_rate,
            format_bytes(p.capacity_bytes),
            p.hit(Policy::Marconi),
            p.hit(Policy::SglangPlus),
            p.hit(Policy::VllmPlus),
            p.win_over_sglang(),
            p.p95_ttft_vs_no_cache(Policy::Marconi),
        );
    }
    let _ = writeln!(s, "\ndistribution over traces: P5 / Q1 / median / Q3 / P95");
    for k in kinds(points) {
        let rows: [(&str, Vec<f64>); 5] = [
            (
                "marconi hit %",
                values(points, k, |p| p.hit(Policy::Marconi)),
            ),
            (
                "vllm+ hit %",
                values(points, k, |p| p.hit(Policy::VllmPlus)),
            ),
            (
                "marconi / vllm+",
                values(points, k, |p| {
                    p.hit(Policy::Marconi) / p.hit(Policy::VllmPlus).max(1e-9)
                }),
            ),
            (
                "win over sglang+ %",
                values(points, k, Point::win_over_sglang),
            ),
            (
                "marconi p95 ttft / none",
                values(points, k, |p| p.p95_ttft_vs_no_cache(Policy::Marconi)),
            ),
        ];
        let _ = writeln!(s, "{}:", kind_name(k));
        for (label, v) in rows {
            if let Some(f) = plot::five_numbers(&v) {
                let _ = writeln!(
                    s,
                    "  {label:<24} {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>9.2}",
                    f[0], f[1], f[2], f[3], f[4]
                );
            }
        }
    }
    s
}

/// The line under each figure's title: model, how many traces, the
/// capacities of each workload.
fn context(points: &[Point]) -> String {
    let model = points
        .first()
        .and_then(|p| p.reports.first())
        .map_or("", |r| r.model.as_str());
    let per_kind: Vec<String> = kinds(points)
        .into_iter()
        .map(|k| {
            let mut caps: Vec<u64> = points
                .iter()
                .filter(|p| p.kind == k)
                .map(|p| p.capacity_bytes)
                .collect();
            caps.sort_unstable();
            caps.dedup();
            let caps: Vec<String> = caps.into_iter().map(format_bytes).collect();
            format!("{} {}", format!("{k:?}").to_lowercase(), caps.join(" / "))
        })
        .collect();
    format!(
        "{model}, {} synthetic traces; capacities: {}",
        points.len(),
        per_kind.join(", ")
    )
}

/// Writes the three figures into `dir`; returns their paths.
pub fn figures(dir: &Path, points: &[Point]) -> Result<Vec<String>, String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let context = context(points);
    let ks = kinds(points);
    let groups: Vec<String> = ks.iter().map(|&k| kind_name(k).to_owned()).collect();
    let per = |f: &dyn Fn(&Point) -> f64| -> Vec<Vec<f64>> {
        ks.iter().map(|&k| values(points, k, f)).collect()
    };
    let mut files = Vec::new();
    let f7 = dir.join("fig7_vs_vllm.svg");
    plot::boxes(
        &f7,
        "Token hit rate over traces (paper Fig. 7)",
        &context,
        "token hit rate (%)",
        &groups,
        &[
            ("vllm-plus".into(), per(&|p| p.hit(Policy::VllmPlus))),
            ("marconi".into(), per(&|p| p.hit(Policy::Marconi))),
        ],
    )?;
    files.push(f7.display().to_string());
    let f8 = dir.join("fig8_win_over_sglang.svg");
    plot::boxes(
        &f8,
        "Marconi's token hit rate win over SGLang+ (paper Fig. 8)",
        &context,
        "win (%)",
        &groups,
        &[(
            "marconi vs sglang-plus".into(),
            per(&Point::win_over_sglang),
        )],
    )?;
    files.push(f8.display().to_string());
    let f9 = dir.join("fig9_p95_ttft.svg");
    plot::boxes(
        &f9,
        "P95 TTFT relative to no prefix caching (paper Fig. 9)",
        &context,
        "P95 TTFT / no cache",
        &groups,
        &[
            (
                "vllm-plus".into(),
                per(&|p| p.p95_ttft_vs_no_cache(Policy::VllmPlus)),
            ),
            (
                "sglang-plus".into(),
                per(&|p| p.p95_ttft_vs_no_cache(Policy::SglangPlus)),
            ),
            (
                "marconi".into(),
                per(&|p| p.p95_ttft_vs_no_cache(Policy::Marconi)),
            ),
        ],
    )?;
    files.push(f9.display().to_string());
    Ok(files)
}
