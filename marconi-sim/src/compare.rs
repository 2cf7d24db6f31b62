//! Several replays of one trace in parallel: the policy comparison, the
//! capacity and model sweeps (paper Figs. 7–12), tables and figures.

use std::fmt::Write as _;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use marconi_core::ModelSpec;

use crate::plot;
use crate::replay::{hit_rate_by_length, replay, Policy, Replay, ReplayConfig, ReplayError};
use crate::trace::Trace;
use crate::units::format_bytes;

/// Runs every job on `trace` on up to `threads` threads (0: one per core),
/// returning the replays in job order. `tick` receives request counts as
/// jobs progress (from any thread). Every job's configuration is checked
/// before any runs.
pub fn run_jobs(
    trace: &Trace,
    jobs: &[ReplayConfig],
    threads: usize,
    tick: &(dyn Fn(u64) + Sync),
) -> Result<Vec<Replay>, ReplayError> {
    // Every configuration before any replay: a bad sweep point must not
    // surface after the others ran.
    for j in jobs {
        j.validate()?;
    }
    let threads = if threads == 0 {
        std::thread::available_parallelism().map_or(1, |n| n.get())
    } else {
        threads
    }
    .min(jobs.len())
    .max(1);
    let next = AtomicUsize::new(0);
    let results: Mutex<Vec<Option<Result<Replay, ReplayError>>>> =
        Mutex::new((0..jobs.len()).map(|_| None).collect());
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(job) = jobs.get(i) else { break };
                let mut last = 0u64;
                let r = replay(trace, job, &mut |n| {
                    tick(n - last);
                    last = n;
                });
                results.lock().expect("no panic while held")[i] = Some(r);
            });
        }
    });
    results
        .into_inner()
        .expect("no panic while held")
        .into_iter()
        .map(|r| r.expect("every job ran"))
        .collect()
}

/// The jobs of a comparison: `base` under each policy.
pub fn policy_jobs(base: &ReplayConfig, policies: &[Policy]) -> Vec<ReplayConfig> {
    policies
        .iter()
        .map(|&p| ReplayConfig {
            policy: p,
            ..base.clone()
        })
        .collect()
}

/// What each column of [`table`] means (`compare --help`, `replay --help`
/// and docs/simulator.md print this).
pub const COLUMNS: &str = "\
Columns of the table:
  policy      the caching policy replayed
  capacity    the cache's byte budget (GB = 10^9 bytes); - for no-cache,
              unbounded for the oracle
  tok hit%    input tokens served from the cache / all input tokens
  req hit%    requests that reused at least one token / all requests
  FLOP sv%    prefill FLOPs saved by the reused tokens / prefill FLOPs
              without a cache
  TTFT p50    median estimated time to first token (prefill of the tokens
              not reused; see --ttft)
  TTFT p95    95th percentile of the same
  evictions   cache nodes evicted to make room
  rejected    admissions refused whole: the request's new KV and states did
              not fit even after evicting everything not in use
  alpha       marconi's FLOP-efficiency weight α in force at the end (tuned
              online unless --alpha); - for policies without one
  wall s      seconds the simulator took for this policy
  sim req/s   the simulator's own speed (requests replayed per second of
              its wall time), not a serving throughput
  sim Mtok/s  the same in millions of input tokens per second";

/// A plain-text table of reports (columns: [`COLUMNS`]).
pub fn table(replays: &[Replay]) -> String {
    let mut s = String::new();
    // The name column fits the longest policy name ("marconi-shadow").
    let w = replays
        .iter()
        .map(|r| r.report.policy.len())
        .max()
        .unwrap_or(0)
        .max(12);
    let _ = writeln!(
        s,
        "{:<w$} {:>10} {:>9} {:>9} {:>9} {:>10} {:>10} {:>9} {:>8} {:>6} {:>8} {:>10} {:>10}",
        "policy",
        "capacity",
        "tok hit%",
        "req hit%",
        "FLOP sv%",
        "TTFT p50",
        "TTFT p95",
        "evictions",
        "rejected",
        "alpha",
        "wall s",
        "sim req/s",
        "sim Mtok/s"
    );
    for r in replays {
        let p = &r.report;
        let alpha = if p.policy.starts_with(Policy::Marconi.name()) {
            format!("{:.2}", p.alpha)
        } else {
            "-".into()
        };
        let _ = writeln!(
            s,
            "{:<w$} {:>10} {:>9.2} {:>9.2} {:>9.2} {:>8.1}ms {:>8.1}ms {:>9} {:>8} {:>6} {:>8.3} {:>10.0} {:>10.1}",
            p.policy,
            if p.policy == Policy::NoCache.name() {
                "-".into()
            } else {
                format_bytes(p.capacity_bytes)
            },
            100.0 * p.token_hit_rate,
            100.0 * p.request_hit_rate,
            100.0 * p.flop_savings_rate,
            p.ttft_p50_ms,
            p.ttft_p95_ms,
            p.evictions,
            p.admissions_rejected,
            alpha,
            p.wall_s,
            p.requests as f64 / p.wall_s.max(1e-9),
            p.input_tokens as f64 / p.wall_s.max(1e-9) / 1e6,
        );
    }
    s
}

/// A note for the table when marconi's α was left to online tuning and no
/// tuning round ran (a trace too small to tune on), `None` otherwise.
pub fn alpha_note(replays: &[Replay], alpha_fixed: bool) -> Option<String> {
    if alpha_fixed {
        return None;
    }
    let r = replays
        .iter()
        .find(|r| r.report.policy == Policy::Marconi.name())?;
    if r.report.tuning_rounds > 0 {
        return None;
    }
    let why = if r.report.evictions == 0 {
        "nothing was evicted, and tuning starts at the first eviction"
    } else {
        "the trace ended before the first tuning round (a round replays a window \
         of 5x the requests seen before the first eviction, at least 16)"
    };
    Some(format!(
        "note: marconi's alpha was never tuned: {why}; it stayed at {}. \
         --alpha X fixes one.",
        r.report.alpha
    ))
}

/// Input-length bin edges for Fig. 10a (tokens).
pub const LENGTH_BINS: [u32; 10] = [
    0, 1_000, 2_000, 4_000, 7_000, 10_000, 15_000, 20_000, 30_000, 45_000,
];

/// Below this many requests, an input-length bin's label gives its count.
const FEW_REQUESTS: u64 = 30;

/// `1k`-style token counts for bin labels.
fn kilo(v: u32) -> String {
    if v >= 1_000 && v % 1_000 == 0 {
        format!("{}k", v / 1_000)
    } else {
        v.to_string()
    }
}

/// Labels of the bins that `edges` start: `0–1k`, …, `45k+`.
pub fn bin_labels(edges: &[u32]) -> Vec<String> {
    edges
        .iter()
        .enumerate()
        .map(|(i, &e)| match edges.get(i + 1) {
            Some(&next) => format!("{}–{}", kilo(e), kilo(next)),
            None => format!("{}+", kilo(e)),
        })
        .collect()
}

/// Writes the comparison figures into `dir`: `hit_rate.svg` (token hit rate
/// per policy, Figs. 7–8), `ttft_cdf.svg` (TTFT CDF per policy, Fig. 10b),
/// `hit_by_length.svg` (mean hit rate per input-length bin and policy) and,
/// when both ran, `hit_diff_by_length.svg` (Marconi minus SGLang+ per bin,
/// Fig. 10a). `context` (model, trace, capacity) goes under every title.
/// Returns the files written.
pub fn figures(dir: &Path, context: &str, replays: &[Replay]) -> Result<Vec<String>, String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let mut written = Vec::new();
    // Policies first (the order of the README's table), then the bounds,
    // which are not policies: the clairvoyant and the unbounded oracle.
    let is_bound = |p: &str| p == "clairvoyant" || p == "oracle";
    let rank = |p: &str| {
        let order = [
            "marconi",
            "marconi-paper",
            "marconi-tuned",
            "sglang-plus",
            "vllm-plus",
            "no-cache",
            "clairvoyant",
            "oracle",
        ];
        (
            is_bound(p),
            order.iter().position(|o| *o == p).unwrap_or(order.len()),
        )
    };
    let mut ordered: Vec<&Replay> = replays.iter().collect();
    ordered.sort_by_key(|r| rank(&r.report.policy));
    let bounds_from = ordered.iter().position(|r| is_bound(&r.report.policy));
    let f = dir.join("hit_rate.svg");
    plot::bars(
        &f,
        "Token hit rate by policy",
        context,
        "token hit rate (%)",
        &ordered
            .iter()
            .map(|r| (r.report.policy.clone(), 100.0 * r.report.token_hit_rate))
            .collect::<Vec<_>>(),
        bounds_from,
    )?;
    written.push(f.display().to_string());
    let f = dir.join("ttft_cdf.svg");
    // marconi's variants lie on marconi's curve: dashed on top of it, so
    // that each stays visible.
    let dashed: Vec<String> = ordered
        .iter()
        .map(|r| r.report.policy.clone())
        .filter(|p| p.starts_with("marconi-"))
        .collect();
    plot::cdf(
        &f,
        "TTFT CDF (paper Fig. 10b)",
        context,
        "estimated TTFT (ms, log scale)",
        &ordered
            .iter()
            .map(|r| {
                (
                    r.report.policy.clone(),
                    r.outcomes.iter().map(|o| o.ttft_ms).collect(),
                )
            })
            .collect::<Vec<_>>(),
        &dashed,
    )?;
    written.push(f.display().to_string());
    // Input-length bins are categories: bars, not lines between them.
    let max_len = replays
        .iter()
        .flat_map(|r| r.outcomes.iter().map(|o| o.input_len))
        .max()
        .unwrap_or(0);
    let edges: Vec<u32> = LENGTH_BINS
        .iter()
        .copied()
        .filter(|&e| e <= max_len)
        .collect();
    let per_bin: Vec<Vec<(u32, f64, u64)>> = replays
        .iter()
        .map(|r| hit_rate_by_length(&r.outcomes, &edges))
        .collect();
    // Bins no request fell in are left out.
    let used: Vec<usize> = (0..edges.len())
        .filter(|&b| per_bin.iter().any(|bins| bins[b].2 > 0))
        .collect();
    // Labelled by LENGTH_BINS, not by the used edges: when the longest
    // input is below the next edge, the last used bin still ends there.
    // A bin with few requests says so: its mean is a handful of requests.
    let bin_requests = |b: usize| per_bin.iter().map(|bins| bins[b].2).max().unwrap_or(0);
    let labels: Vec<String> = bin_labels(&LENGTH_BINS)
        .into_iter()
        .enumerate()
        .map(|(b, l)| {
            if b < edges.len() && bin_requests(b) < FEW_REQUESTS {
                format!("{l} (n={})", bin_requests(b))
            } else {
                l
            }
        })
        .collect();
    let groups: Vec<String> = used.iter().map(|&b| labels[b].clone()).collect();
    let f = dir.join("hit_by_length.svg");
    plot::grouped_bars(
        &f,
        "Mean token hit rate by input length (no-cache: 0, not drawn)",
        context,
        "input length (tokens)",
        "mean token hit rate (%)",
        &groups,
        &replays
            .iter()
            .zip(&per_bin)
            // No cache hits nothing by construction: an empty bar per bin.
            .filter(|(r, _)| r.report.policy != Policy::NoCache.name())
            .map(|(r, bins)| {
                let v = used
                    .iter()
                    .map(|&b| (bins[b].2 > 0).then(|| 100.0 * bins[b].1))
                    .collect();
                (r.report.policy.clone(), v)
            })
            .collect::<Vec<_>>(),
        None,
    )?;
    written.push(f.display().to_string());
    // Fig. 10a proper: Marconi's mean hit rate minus SGLang+'s, per bin.
    let by_policy = |name: &str| replays.iter().position(|r| r.report.policy == name);
    if let (Some(m), Some(g)) = (by_policy("marconi"), by_policy("sglang-plus")) {
        let (hm, hg) = (&per_bin[m], &per_bin[g]);
        let both: Vec<usize> = (0..edges.len())
            .filter(|&b| hm[b].2 > 0 && hg[b].2 > 0)
            .collect();
        let f = dir.join("hit_diff_by_length.svg");
        plot::grouped_bars(
            &f,
            "Marconi minus SGLang+ hit rate by input length (paper Fig. 10a)",
            context,
            "input length (tokens)",
            "difference in mean token hit rate (points)",
            &both.iter().map(|&b| labels[b].clone()).collect::<Vec<_>>(),
            &[(
                "marconi - sglang-plus".to_owned(),
                both.iter()
                    .map(|&b| Some(100.0 * (hm[b].1 - hg[b].1)))
                    .collect(),
            )],
            Some(&plot::signed),
        )?;
        written.push(f.display().to_string());
    }
    Ok(written)
}

/// What a sweep varies.
#[derive(Clone, Debug, PartialEq)]
pub enum SweepAxis {
    /// Cache capacity in bytes (paper Fig. 11).
    Capacity(Vec<u64>),
    /// Attention:SSM ratio 1:r of the paper's 7B hybrid, 28 sequence-mixing
    /// layers in all (paper Fig. 12a).
    SsmRatio(Vec<u32>),
    /// SSM state dimension of the paper's 7B hybrid (paper Fig. 12b).
    StateDim(Vec<u64>),
}

impl SweepAxis {
    /// The x-axis label.
    pub fn label(&self) -> &'static str {
        match self {
            SweepAxis::Capacity(_) => "capacity (GB)",
            SweepAxis::SsmRatio(_) => "SSM layers per attention layer",
            SweepAxis::StateDim(_) => "SSM state dimension",
        }
    }

    /// `(x value, config)` for every point, from `base`.
    pub fn points(&self, base: &ReplayConfig) -> Vec<(f64, ReplayConfig)> {
        match self {
            SweepAxis::Capacity(caps) => caps
                .iter()
                .map(|&c| {
                    (
                        c as f64 / 1e9,
                        ReplayConfig {
                            capacity_bytes: c,
                            ..base.clone()
                        },
                    )
                })
                .collect(),
            SweepAxis::SsmRatio(rs) => rs
                .iter()
                .map(|&r| {
                    let mut m = base.model.clone();
                    let total = m.attn_layers + m.ssm_layers;
                    let attn = ((f64::from(total) / f64::from(1 + r)).round() as u32).max(1);
                    m.attn_layers = attn;
                    m.ssm_layers = total - attn;
                    m.name = format!("{}-attn{}-ssm{}", base.model.name, attn, total - attn);
                    (
                        f64::from(r),
                        ReplayConfig {
                            model: m,
                            ..base.clone()
                        },
                    )
                })
                .collect(),
            SweepAxis::StateDim(ds) => ds
                .iter()
                .map(|&d| {
                    let mut m: ModelSpec = base.model.clone();
                    m.d_state = d;
                    m.name = format!("{}-dstate{d}", base.model.name);
                    (
                        d as f64,
                        ReplayConfig {
                            model: m,
                            ..base.clone()
                        },
                    )
                })
                .collect(),
        }
    }
}

/// One point of a sweep.
#[derive(Clone, Debug)]
pub struct SweepPoint {
    /// The swept value.
    pub x: f64,
    /// The replay there.
    pub replay: Replay,
}

/// Replays every policy at every point of `axis`, in parallel.
pub fn sweep(
    trace: &Trace,
    base: &ReplayConfig,
    axis: &SweepAxis,
    policies: &[Policy],
    threads: usize,
    tick: &(dyn Fn(u64) + Sync),
) -> Result<Vec<SweepPoint>, ReplayError> {
    let mut xs = Vec::new();
    let mut jobs = Vec::new();
    for (x, cfg) in axis.points(base) {
        for j in policy_jobs(&cfg, policies) {
            xs.push(x);
            jobs.push(j);
        }
    }
    let replays = run_jobs(trace, &jobs, threads, tick)?;
    Ok(xs
        .into_iter()
        .zip(replays)
        .map(|(x, replay)| SweepPoint { x, replay })
        .collect())
}

/// A sweep's table: one row per point, one token-hit-rate column per policy.
pub fn sweep_table(axis: &SweepAxis, points: &[SweepPoint], policies: &[Policy]) -> String {
    let mut s = String::new();
    let _ = write!(s, "{:<32}", axis.label());
    for p in policies {
        let _ = write!(s, " {:>12}", p.name());
    }
    s.push_str("   (token hit rate %)\n");
    for row in points.chunks(policies.len().max(1)) {
        let r0 = &row[0].replay.report;
        let x = match axis {
            SweepAxis::Capacity(_) => format_bytes(r0.capacity_bytes),
            _ => format!("{} ({})", row[0].x, r0.model),
        };
        let _ = write!(s, "{x:<32}");
        for p in row {
            let _ = write!(s, " {:>12.2}", 100.0 * p.replay.report.token_hit_rate);
        }
        s.push('\n');
    }
    s
}

/// Plots token hit rate against the swept value, one line per policy, a
/// labelled tick at every swept value; state dimensions and layer ratios
/// (doublings) on a log scale. `context` (model, trace, fixed capacity) goes
/// under the title.
pub fn sweep_figure(
    path: &Path,
    context: &str,
    axis: &SweepAxis,
    points: &[SweepPoint],
    policies: &[Policy],
) -> Result<(), String> {
    let series: Vec<(String, Vec<(f64, f64)>)> = policies
        .iter()
        .map(|p| {
            let pts = points
                .iter()
                .filter(|pt| pt.replay.report.policy == p.name())
                .map(|pt| (pt.x, 100.0 * pt.replay.report.token_hit_rate))
                .collect();
            (p.name().to_owned(), pts)
        })
        .collect();
    let mut ticks: Vec<f64> = points.iter().map(|p| p.x).collect();
    ticks.sort_by(f64::total_cmp);
    ticks.dedup();
    let x = plot::XAxis {
        label: axis.label(),
        log: !matches!(axis, SweepAxis::Capacity(_)),
        ticks,
    };
    let title = match axis {
        SweepAxis::Capacity(_) => "Token hit rate by cache capacity (paper Fig. 11)",
        SweepAxis::SsmRatio(_) => "Token hit rate by SSM:attention layer ratio (paper Fig. 12a)",
        SweepAxis::StateDim(_) => "Token hit rate by SSM state dimension (paper Fig. 12b)",
    };
    plot::lines(path, title, context, &x, "token hit rate (%)", &series)
}
