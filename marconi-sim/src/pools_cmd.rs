//! The `pools` and `plan` subcommands.

use std::path::PathBuf;
use std::time::Instant;

use clap::Args;
use marconi_core::{AlphaMode, CacheConfig};
use marconi_gpu::plan::{self as mplan, MemoryPlan};
use marconi_gpu::pooled::PoolLayout;
use marconi_sim::plot::number;
use marconi_sim::pools::{self, PoolSpec};
use marconi_sim::synth::{self, SynthConfig, SynthKind};
use marconi_sim::trace::Trace;
use marconi_sim::units::format_bytes;

use super::{capacity, preset, print_json, progress, CmdResult};

/// Which requests to replay.
#[derive(Args, Clone)]
pub(crate) struct Workload {
    /// Trace file (JSON lines); default: the built-in `--workload`.
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Built-in synthetic workload (seed 0) when no `--trace` is given.
    #[arg(long, value_enum, default_value_t = SynthKind::Agentic)]
    workload: SynthKind,
    /// Sessions of the built-in workload (default per kind).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    sessions: Option<u32>,
}

impl Workload {
    fn load(&self) -> Result<(Trace, String), String> {
        match &self.trace {
            Some(p) => Ok((
                Trace::load(p).map_err(|e| format!("{}: {e}", p.display()))?,
                p.display().to_string(),
            )),
            None => {
                let mut c = SynthConfig::new(self.workload);
                if let Some(s) = self.sessions {
                    c.sessions = s;
                }
                Ok((
                    synth::generate(&c),
                    format!(
                        "built-in {:?} (synth seed 0, {} sessions)",
                        self.workload, c.sessions
                    )
                    .to_lowercase(),
                ))
            }
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum PooledPolicy {
    /// Marconi: judicious admission, FLOP-aware eviction (α fixed by --alpha, else tuned).
    Marconi,
    /// SGLang+: Marconi admission, LRU eviction.
    SglangPlus,
}

#[derive(Args)]
pub(crate) struct PoolsArgs {
    #[command(flatten)]
    workload: Workload,
    /// Model preset.
    #[arg(long, default_value = "jamba-1.5-mini")]
    model: String,
    /// Memory budget of both pools together (GB = 10^9, GiB = 2^30).
    #[arg(long, default_value = "10GB", value_parser = capacity)]
    capacity: u64,
    /// Tokens per KV page.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..))]
    page_size: u32,
    /// Eviction policy of the cache.
    #[arg(long, value_enum, default_value_t = PooledPolicy::Marconi)]
    policy: PooledPolicy,
    /// Fixed α for marconi (default: tuned online).
    #[arg(long)]
    alpha: Option<f64>,
    /// Layouts besides the static sweep: single, avmp, avmp:F, unified, static:F (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "single,avmp,unified", value_parser = PoolSpec::parse)]
    pools: Vec<PoolSpec>,
    /// State fractions of the static splits to sweep (comma-separated; empty: none).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "0.05,0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9"
    )]
    fractions: Vec<f64>,
    /// Replays run at a time (0: one per core).
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// Print the rows as JSON.
    #[arg(long)]
    json: bool,
    /// No progress display.
    #[arg(long, short)]
    quiet: bool,
}

fn cache_config(
    model: &str,
    policy: PooledPolicy,
    alpha: Option<f64>,
    budget: u64,
    page: u32,
) -> Result<CacheConfig, String> {
    let m = preset(model)?;
    let mut c = match policy {
        PooledPolicy::Marconi => CacheConfig::marconi(m, budget),
        PooledPolicy::SglangPlus => CacheConfig::sglang_plus(m, budget),
    };
    c.page_size = page;
    if let (PooledPolicy::Marconi, Some(a)) = (policy, alpha) {
        c.alpha = AlphaMode::Fixed(a);
    }
    c.validate().map_err(|e| e.to_string())?;
    Ok(c)
}

pub(crate) fn pools(a: PoolsArgs) -> CmdResult {
    let cfg = cache_config(&a.model, a.policy, a.alpha, a.capacity, a.page_size)?;
    let mut specs = Vec::new();
    for &f in &a.fractions {
        specs.push(PoolSpec::parse(&format!("static:{f}"))?);
    }
    specs.extend(a.pools.iter().copied());
    if specs.is_empty() {
        return Err("nothing to run: give --pools or --fractions".into());
    }
    let (trace, name) = a.workload.load()?;
    let threads = match a.threads {
        0 => std::thread::available_parallelism().map_or(1, usize::from),
        n => n,
    };
    let t0 = Instant::now();
    let sp = progress::spinner(&format!("replaying {} layouts", specs.len()), a.quiet);
    let rows = pools::run_all(&trace, &cfg, &specs, threads);
    sp.finish_and_clear();
    let rows = rows?;
    if a.json {
        return print_json(&rows);
    }
    println!(
        "trace: {name} ({} requests); {} at {}, page {} tokens, {:?}; {} replays in {:.1}s",
        number(trace.len() as f64),
        cfg.model.name,
        format_bytes(a.capacity),
        a.page_size,
        a.policy,
        rows.len(),
        t0.elapsed().as_secs_f64()
    );
    print!("{}", pools::table(&rows));
    Ok(())
}

#[derive(Args)]
pub(crate) struct PlanArgs {
    /// Model preset.
    #[arg(long, default_value = "jamba-1.5-mini")]
    model: String,
    /// Device memory budget for both pools (GB = 10^9, GiB = 2^30).
    #[arg(long, default_value = "10GB", value_parser = capacity)]
    budget: u64,
    /// Tokens per KV page.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..))]
    page_size: u32,
    /// State fractions of the static splits to list.
    #[arg(long, value_delimiter = ',', default_value = "0.1,0.2,0.3,0.5,0.7")]
    fractions: Vec<f64>,
    /// Context lengths (tokens) for the largest batch.
    #[arg(long, value_delimiter = ',', default_value = "4096,32768,131072")]
    contexts: Vec<u64>,
    /// Also replay a workload through AVMP (starting at --start) and report the split it reaches.
    #[arg(long)]
    converge: bool,
    /// AVMP's starting state fraction for --converge.
    #[arg(long, default_value_t = 0.5)]
    start: f64,
    #[command(flatten)]
    workload: Workload,
    /// Print the plan as JSON.
    #[arg(long)]
    json: bool,
}

#[derive(serde::Serialize)]
struct PlanOut {
    plan: MemoryPlan,
    splits: Vec<mplan::SplitPlan>,
    batches: Vec<BatchRow>,
    converged: Option<mplan::ConvergedSplit>,
}

#[derive(serde::Serialize)]
struct BatchRow {
    context: u64,
    ideal_ssm_fraction: f64,
    avmp: u64,
    unified: u64,
    statics: Vec<(f64, u64)>,
}

pub(crate) fn plan(a: PlanArgs) -> CmdResult {
    let model = preset(&a.model)?;
    let p = mplan::plan(&model, a.page_size, a.budget).map_err(|e| e.to_string())?;
    let splits = a
        .fractions
        .iter()
        .map(|&f| p.split(f))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| e.to_string())?;
    let mut batches = Vec::new();
    for &c in &a.contexts {
        let mut statics = Vec::new();
        for &f in &a.fractions {
            statics.push((
                f,
                p.max_batch(c, PoolLayout::Static { ssm_fraction: f })
                    .map_err(|e| e.to_string())?,
            ));
        }
        batches.push(BatchRow {
            context: c,
            ideal_ssm_fraction: p.fraction_for_context(c),
            avmp: p
                .max_batch(c, PoolLayout::Avmp { ssm_fraction: 0.5 })
                .map_err(|e| e.to_string())?,
            unified: p
                .max_batch(c, PoolLayout::Unified)
                .map_err(|e| e.to_string())?,
            statics,
        });
    }
    let converged = if a.converge {
        if !(a.start > 0.0 && a.start < 1.0) {
            return Err(format!("--start {} is not in (0, 1)", a.start));
        }
        let (trace, _) = a.workload.load()?;
        let mut cfg = CacheConfig::marconi(model.clone(), a.budget);
        cfg.page_size = a.page_size;
        let mut seqs: Vec<(usize, Vec<u32>)> = Vec::with_capacity(trace.len());
        trace.for_each(|r| seqs.push((r.input_len, r.full.to_vec())));
        Some(
            mplan::converged_split(
                &cfg,
                a.budget,
                a.start,
                seqs.iter().map(|(n, s)| (*n, s.as_slice())),
            )
            .map_err(|e| e.to_string())?,
        )
    } else {
        None
    };
    let out = PlanOut {
        plan: p,
        splits,
        batches,
        converged,
    };
    if a.json {
        return print_json(&out);
    }
    println!(
        "{} at {}, page {} tokens: KV {} B/token, page {} B, state slot {} B",
        model.name,
        format_bytes(a.budget),
        a.page_size,
        p.kv_bytes_per_token,
        p.kv_page_bytes,
        p.state_slot_bytes
    );
    println!(
        "all KV: {} tokens; all states: {} slots; unified: {} units of {} B",
        p.max_kv_tokens, p.max_state_slots, p.unified_units, p.unified_unit_bytes
    );
    println!(
        "{:>9} {:>10} {:>12} {:>12}",
        "ssm frac", "KV pages", "KV tokens", "state slots"
    );
    for s in &out.splits {
        println!(
            "{:>9.2} {:>10} {:>12} {:>12}",
            s.ssm_fraction, s.kv_pages, s.kv_tokens, s.state_slots
        );
    }
    println!("largest batch per context (sequences of that many tokens, one state slot each):");
    for b in &out.batches {
        let st: Vec<String> = b
            .statics
            .iter()
            .map(|(f, n)| format!("static:{f:.2}={n}"))
            .collect();
        println!(
            "  context {:>7}: avmp {} (state fraction {:.3}), unified {}, {}",
            b.context,
            b.avmp,
            b.ideal_ssm_fraction,
            b.unified,
            st.join(" ")
        );
    }
    if let Some(c) = &out.converged {
        println!(
            "AVMP on the workload: state fraction {:.3} -> {:.3} (mean over the second half {:.3}), {} migrations, {} moved, token hit rate {:.2}%",
            c.start_fraction,
            c.final_fraction,
            c.settled_fraction,
            c.stats.migrations,
            format_bytes(c.stats.bytes_migrated),
            100.0 * c.token_hit_rate
        );
    }
    Ok(())
}
