//! The `tiers` subcommand: the built-in workloads over several seeds, at
//! device capacities that are fractions of each trace's working set, with a
//! host (and optionally a store) tier at a multiple of the device: token
//! hit rate (by tier), mean TTFT and bytes moved per tier variant, against
//! one device tier of the device's size and one of the combined size.

use marconi_core::WriteMode;
use serde::Serialize;

use crate::battery::{synth_traces, BatteryConfig};
use crate::clairvoyant::distinct_kv_bytes;
use crate::compare::run_jobs;
use crate::replay::{Policy, ReplayConfig, Report};
use crate::synth::SynthKind;
use crate::tiers::{TierPolicy, TierSim, TierSizes};

/// Flags of `marconi-sim tiers`.
#[derive(clap::Args, Clone, Debug)]
pub struct TiersArgs {
    /// Model preset.
    #[arg(long, default_value = "paper-7b")]
    pub model: String,
    /// Seeds of every workload (comma list).
    #[arg(long, value_delimiter = ',', default_values_t = [0u64, 1])]
    pub seeds: Vec<u64>,
    /// Workloads.
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = [SynthKind::Agentic, SynthKind::Chat, SynthKind::Longout])]
    pub workloads: Vec<SynthKind>,
    /// Device capacities as fractions of each trace's working set.
    #[arg(long, value_delimiter = ',', default_values_t = [0.05f64, 0.15])]
    pub fractions: Vec<f64>,
    /// Host size as a multiple of the device's.
    #[arg(long, default_value_t = 8.0)]
    pub host_ratio: f64,
    /// Store size as a multiple of the device's (none by default).
    #[arg(long)]
    pub store_ratio: Option<f64>,
    /// Tier variants: `marconi` or `hicache`, optionally followed by
    /// `/back` or `/through` (write mode), `/promote` or `/no-promote`,
    /// `/no-lower-plans`, `/always-load`, `/exclusive` or `/inclusive`.
    #[arg(long, value_delimiter = ',', default_values = ["marconi", "hicache"])]
    pub variants: Vec<String>,
    /// Host → device GB/s.
    #[arg(long, default_value_t = 25.0)]
    pub host_gbps: f64,
    /// Store → device GB/s.
    #[arg(long, default_value_t = 5.0)]
    pub store_gbps: f64,
    /// Latency of one load from the host, µs.
    #[arg(long, default_value_t = 10.0)]
    pub host_latency_us: f64,
    /// Fixed α for the lower tiers (default: tuned online).
    #[arg(long)]
    pub tier_alpha: Option<f64>,
    /// Smaller workloads (a quarter of the sessions), for a smoke run.
    #[arg(long)]
    pub quick: bool,
    /// Threads (0: one per core).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// Print JSON (one object per workload, fraction and seed).
    #[arg(long)]
    pub json: bool,
}

/// One variant of the tiers.
fn variant(name: &str, sizes: TierSizes, a: &TiersArgs) -> Result<(Policy, TierSim), String> {
    let mut parts = name.split('/');
    let mut t = TierSim::new(sizes);
    let policy = match parts.next() {
        Some("marconi") => {
            t.policy = TierPolicy::Marconi;
            Policy::Marconi
        }
        Some("hicache") => {
            t.policy = TierPolicy::Hicache;
            Policy::SglangPlus
        }
        _ => {
            return Err(format!(
                "--variants: {name:?} starts with neither marconi nor hicache"
            ))
        }
    };
    for p in parts {
        match p {
            "back" => t.write = Some(WriteMode::Back),
            "through" => t.write = Some(WriteMode::Through),
            "promote" => t.promote = Some(true),
            "no-promote" => t.promote = Some(false),
            "no-lower-plans" => t.lower_plans = false,
            "always-load" => t.always_load = Some(true),
            "exclusive" => t.exclusive = Some(true),
            "inclusive" => t.exclusive = Some(false),
            _ => {
                return Err(format!(
                    "--variants: {p:?} in {name:?} (back, through, promote, no-promote, no-lower-plans, always-load, exclusive, inclusive)"
                ))
            }
        }
    }
    t.host_bandwidth = a.host_gbps * 1e9;
    t.store_bandwidth = a.store_gbps * 1e9;
    t.host_latency = a.host_latency_us * 1e-6;
    t.lower_alpha = a.tier_alpha;
    Ok((policy, t))
}

/// One workload, fraction and seed.
#[derive(Clone, Debug, Serialize)]
pub struct TierRow {
    /// Workload.
    pub workload: String,
    /// Seed.
    pub seed: u64,
    /// Device capacity as a fraction of the working set.
    pub fraction: f64,
    /// One device tier at the device's size.
    pub device_only: Report,
    /// One device tier at the combined size.
    pub combined: Report,
    /// Each variant, in `--variants` order.
    pub variants: Vec<(String, Report)>,
}

/// Runs the table's replays.
pub fn rows(a: &TiersArgs) -> Result<Vec<TierRow>, String> {
    let model = marconi_core::ModelSpec::preset(&a.model)
        .ok_or_else(|| format!("--model {}: unknown preset", a.model))?;
    if !(a.host_ratio.is_finite() && a.host_ratio > 0.0) {
        return Err(format!("--host-ratio {} is not > 0", a.host_ratio));
    }
    let mut cfg = BatteryConfig::new(model.clone());
    cfg.synth.retain(|(k, _)| a.workloads.contains(k));
    cfg.synth_seeds = a.seeds.clone();
    if a.quick {
        cfg.quick();
    }
    let mut out = Vec::new();
    for t in synth_traces(&cfg) {
        let ws = distinct_kv_bytes(&t.trace, &model);
        let mut jobs = Vec::new();
        for &f in &a.fractions {
            let dev = ((ws as f64 * f) as u64).max(1);
            let host = ((dev as f64 * a.host_ratio) as u64).max(1);
            let store = a.store_ratio.map(|r| ((dev as f64 * r) as u64).max(1));
            let sizes = TierSizes {
                device: dev,
                host: Some(host),
                store,
            };
            jobs.push(ReplayConfig::new(Policy::Marconi, model.clone(), dev));
            let all = dev + host + store.unwrap_or(0);
            jobs.push(ReplayConfig::new(Policy::Marconi, model.clone(), all));
            for v in &a.variants {
                let (p, sim) = variant(v, sizes, a)?;
                let mut j = ReplayConfig::new(p, model.clone(), dev);
                j.tiers = Some(sim);
                jobs.push(j);
            }
        }
        let replays = run_jobs(&t.trace, &jobs, a.threads, &|_| {}).map_err(|e| e.to_string())?;
        let per = 2 + a.variants.len();
        for (&f, chunk) in a.fractions.iter().zip(replays.chunks(per)) {
            out.push(TierRow {
                workload: t.workload.clone(),
                seed: t.seed,
                fraction: f,
                device_only: chunk[0].report.clone(),
                combined: chunk[1].report.clone(),
                variants: a
                    .variants
                    .iter()
                    .cloned()
                    .zip(chunk[2..].iter().map(|r| r.report.clone()))
                    .collect(),
            });
        }
    }
    Ok(out)
}

/// The markdown table: one line per workload and fraction, means over the
/// seeds: token hit rate (%) of the single tiers and of each variant (with
/// the lower tiers' share in brackets), mean TTFT (ms), GB loaded from the
/// lower tiers per 1000 requests.
pub fn markdown(a: &TiersArgs, rows: &[TierRow]) -> String {
    let mut s = String::from("| workload | device | seeds | device only | combined |");
    for v in &a.variants {
        s.push_str(&format!(" {v} |"));
    }
    s.push_str(" gap to combined |");
    for v in &a.variants {
        s.push_str(&format!(" TTFT {v} |"));
    }
    s.push_str(" TTFT device only | TTFT combined |");
    for v in &a.variants {
        s.push_str(&format!(" GB loaded/1k req {v} |"));
    }
    s.push('\n');
    let cols = 5 + 3 * a.variants.len() + 3;
    s.push_str(&"|---".repeat(cols));
    s.push_str("|\n");
    let mut keys: Vec<(String, u64)> = Vec::new();
    for r in rows {
        let k = (r.workload.clone(), r.fraction.to_bits());
        if !keys.contains(&k) {
            keys.push(k);
        }
    }
    for (w, fb) in keys {
        let sel: Vec<&TierRow> = rows
            .iter()
            .filter(|r| r.workload == w && r.fraction.to_bits() == fb)
            .collect();
        let n = sel.len() as f64;
        let mean = |g: &dyn Fn(&TierRow) -> f64| sel.iter().map(|r| g(r)).sum::<f64>() / n;
        let hit = |r: &Report| 100.0 * r.token_hit_rate;
        let lower = |r: &Report| {
            r.tiers.as_ref().map_or(0.0, |t| {
                100.0 * (t.token_hit_rate_by_tier[1] + t.token_hit_rate_by_tier[2])
            })
        };
        s.push_str(&format!(
            "| {w} | {:.0} % | {} | {:.2} | {:.2} |",
            100.0 * f64::from_bits(fb),
            sel.len(),
            mean(&|r| hit(&r.device_only)),
            mean(&|r| hit(&r.combined)),
        ));
        for i in 0..a.variants.len() {
            s.push_str(&format!(
                " {:.2} ({:.1}) |",
                mean(&|r| hit(&r.variants[i].1)),
                mean(&|r| lower(&r.variants[i].1))
            ));
        }
        s.push_str(&format!(
            " {:+.2} |",
            mean(&|r| hit(&r.variants[0].1) - hit(&r.combined))
        ));
        for i in 0..a.variants.len() {
            s.push_str(&format!(
                " {:.1} |",
                mean(&|r| r.variants[i].1.ttft_mean_ms)
            ));
        }
        s.push_str(&format!(
            " {:.1} | {:.1} |",
            mean(&|r| r.device_only.ttft_mean_ms),
            mean(&|r| r.combined.ttft_mean_ms)
        ));
        for i in 0..a.variants.len() {
            s.push_str(&format!(
                " {:.1} |",
                mean(&|r| {
                    let rep = &r.variants[i].1;
                    rep.tiers.as_ref().map_or(0.0, |t| {
                        (t.bytes_loaded[1] + t.bytes_loaded[2]) as f64 / 1e9 * 1000.0
                            / rep.requests.max(1) as f64
                    })
                })
            ));
        }
        s.push('\n');
    }
    s
}

/// `marconi-sim tiers`.
pub fn run(a: TiersArgs) -> Result<(), String> {
    let rows = rows(&a)?;
    if a.json {
        let text = serde_json::to_string_pretty(&rows).map_err(|e| e.to_string())?;
        println!("{text}");
    } else {
        print!("{}", markdown(&a, &rows));
    }
    Ok(())
}
