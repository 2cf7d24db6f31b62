//! `marconi-sim route`: the command line of the multi-engine experiment
//! ([`crate::route`]).

use std::path::{Path, PathBuf};
use std::time::Instant;

use clap::Args;
use marconi_core::ModelSpec;

use crate::plot::{self, number, XAxis};
use crate::replay::Policy;
use crate::route::{self, RouteConfig, RouteReport, Routing};
use crate::synth::{self, SynthConfig, SynthKind};
use crate::trace::Trace;
use crate::ttft::TtftModel;
use crate::units::{format_bytes, parse_bytes};

/// Arguments of `marconi-sim route`.
#[derive(Args, Debug)]
pub struct RouteArgs {
    /// Trace file; default: a built-in synthetic workload (`--workload`).
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Built-in workload when no trace is given.
    #[arg(long, value_enum, default_value_t = SynthKind::Agentic)]
    pub workload: SynthKind,
    /// Sessions of the built-in workload (default: the generator's).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    pub sessions: Option<u32>,
    /// Session arrivals per second of the built-in workload (default: the
    /// generator's × engines, so that each engine sees the generator's load).
    #[arg(long)]
    pub session_rate: Option<f64>,
    /// Seed of the built-in workload.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Engines (1..=64).
    #[arg(long, default_value_t = 8)]
    pub engines: usize,
    /// Caching policy of every engine.
    #[arg(long, value_enum, default_value_t = Policy::Marconi)]
    pub policy: Policy,
    /// Model preset.
    #[arg(long, default_value = "paper-7b")]
    pub model: String,
    /// Cache capacity of each engine (GB = 10^9, GiB = 2^30).
    #[arg(long, default_value = "5GB")]
    pub capacity: String,
    /// Tokens per KV page: the block size of the published hashes.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..))]
    pub page_size: u32,
    /// Weights of the load term (comma-separated), per queued prefill token.
    #[arg(long, value_delimiter = ',', default_values_t = [0.0, 0.25, 1.0])]
    pub lambda: Vec<f64>,
    /// Fixed α for marconi (default: tuned online).
    #[arg(long)]
    pub alpha: Option<f64>,
    /// Directory for the figures (SVG).
    #[arg(long, default_value = "out")]
    pub out_dir: PathBuf,
    /// Threads (0: one per core).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// Print the reports as JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// No progress display.
    #[arg(long, short)]
    pub quiet: bool,
}

/// Runs the experiment and prints its table.
pub fn run(a: RouteArgs) -> Result<(), String> {
    let model = ModelSpec::preset(&a.model).ok_or_else(|| {
        format!(
            "unknown model {:?}; presets: {}",
            a.model,
            marconi_core::PRESET_NAMES.join(", ")
        )
    })?;
    let capacity = parse_bytes(&a.capacity)?;
    if capacity == 0 {
        return Err("--capacity 0 holds nothing".into());
    }
    if a.lambda.is_empty() || a.lambda.iter().any(|l| !(l.is_finite() && *l >= 0.0)) {
        return Err(format!("--lambda {:?}: give finite values >= 0", a.lambda));
    }
    let base = RouteConfig {
        engines: a.engines,
        policy: a.policy,
        model,
        capacity_bytes: capacity,
        page_size: a.page_size,
        alpha: a.alpha,
        lambda: 0.0,
        ttft: TtftModel::default(),
        routing: Routing::RoundRobin,
    };
    let (trace, name) = match &a.trace {
        Some(p) => (
            Trace::load(p).map_err(|e| format!("{}: {e}", p.display()))?,
            p.display().to_string(),
        ),
        None => {
            let mut c = SynthConfig::new(a.workload);
            if let Some(s) = a.sessions {
                c.sessions = s;
            }
            c.session_rate = match a.session_rate {
                Some(r) if r.is_finite() && r > 0.0 => r,
                Some(r) => return Err(format!("--session-rate {r} is not > 0")),
                None => c.session_rate * a.engines as f64,
            };
            c.seed = a.seed;
            let name = format!(
                "built-in {} ({} sessions at {}/s, seed {})",
                a.workload, c.sessions, c.session_rate, a.seed
            );
            (synth::generate(&c), name)
        }
    };
    let jobs = route::jobs(&base, &a.lambda);
    let t0 = Instant::now();
    let sp = crate::progress::spinner(&format!("routing ({} runs)", jobs.len()), a.quiet);
    let reports = route::run_all(&trace, &jobs, a.threads).map_err(|e| e.to_string());
    sp.finish_and_clear();
    let reports = reports?;
    let wall = t0.elapsed().as_secs_f64();
    let setup = format!(
        "{} engines ({}, {} each, {}-token pages), {}",
        a.engines,
        a.policy,
        format_bytes(capacity),
        a.page_size,
        base.model.name,
    );
    let files = figures(&a.out_dir, &format!("{setup} on {name}"), &reports)?;
    if a.json {
        let out = serde_json::to_string_pretty(&reports).map_err(|e| e.to_string())?;
        println!("{out}");
        return Ok(());
    }
    println!(
        "trace: {name}: {} requests, {} input tokens; {setup}",
        number(trace.len() as f64),
        number(reports.first().map_or(0, |r| r.input_tokens) as f64),
    );
    print!("{}", route::table(&reports));
    println!("{}", route::COLUMNS);
    println!(
        "{} runs in {wall:.1}s wall; figures: {}",
        reports.len(),
        files.join(", ")
    );
    Ok(())
}

/// Hit rate, mean TTFT and p95 TTFT against λ, one line per routing
/// (round robin flat).
pub fn figures(dir: &Path, context: &str, reports: &[RouteReport]) -> Result<Vec<String>, String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let lambdas: Vec<f64> = {
        let mut v: Vec<f64> = reports
            .iter()
            .filter(|r| r.routing != "round-robin")
            .map(|r| r.lambda)
            .collect();
        v.sort_by(f64::total_cmp);
        v.dedup();
        v
    };
    let series = |f: &dyn Fn(&RouteReport) -> f64| -> Vec<(String, Vec<(f64, f64)>)> {
        Routing::ALL
            .iter()
            .map(|r| {
                let name = r.name();
                let pts: Vec<(f64, f64)> = if r.uses_lambda() {
                    reports
                        .iter()
                        .filter(|x| x.routing == name)
                        .map(|x| (x.lambda, f(x)))
                        .collect()
                } else {
                    let y = reports
                        .iter()
                        .find(|x| x.routing == name)
                        .map_or(f64::NAN, f);
                    lambdas.iter().map(|&l| (l, y)).collect()
                };
                // Round robin ignores λ: one value, drawn flat and named so.
                let label = if r.uses_lambda() {
                    name.to_string()
                } else {
                    format!("{name} (no λ)") // plotted as a reference line
                };
                (label, pts)
            })
            .collect()
    };
    let x = XAxis {
        label: "λ (load weight per queued prefill token)",
        log: false,
        ticks: lambdas.clone(),
    };
    let mut files = Vec::new();
    for (file, title, y, f) in [
        (
            "route_hit_rate.svg",
            "Token hit rate by routing",
            "tokens skipped (%)",
            &(|r: &RouteReport| 100.0 * r.token_hit_rate) as &dyn Fn(&RouteReport) -> f64,
        ),
        (
            "route_ttft_mean.svg",
            "Mean TTFT by routing",
            "mean TTFT (ms)",
            &|r: &RouteReport| r.ttft_mean_ms,
        ),
        (
            "route_ttft_p95.svg",
            "P95 TTFT by routing",
            "P95 TTFT (ms)",
            &|r: &RouteReport| r.ttft_p95_ms,
        ),
        (
            "route_busy_imbalance.svg",
            "Load imbalance by routing",
            "busiest engine's prefill time / mean",
            &|r: &RouteReport| r.busy_imbalance,
        ),
    ] {
        let path = dir.join(file);
        let opts = plot::LineOpts {
            references: Routing::ALL
                .iter()
                .filter(|r| !r.uses_lambda())
                .map(|r| format!("{} (no λ)", r.name()))
                .collect(),
            ..plot::LineOpts::default()
        };
        plot::lines_with(&path, title, context, &x, y, &series(f), &opts)
            .map_err(|e| format!("{}: {e}", path.display()))?;
        files.push(path.display().to_string());
    }
    Ok(files)
}
