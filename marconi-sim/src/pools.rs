//! The joined system in simulation: one trace through the
//! prefix cache over real pool layouts (`marconi_gpu::pooled`) at a fixed
//! memory budget, beside today's single byte budget.
//!
//! Layouts ([`PoolSpec`]): `single` (core's one byte budget, no pools: the
//! reference), `static:F` (two pools, a fraction F of the budget for state
//! slots, never moved), `avmp` / `avmp:F` (two pools starting at F, 0.5 by
//! default, capacity migrating on demand), `unified` (one padded table).
//! Each request runs the whole cycle sequentially: lookup, reserve its
//! working pages (past the hit) and state slots, admit, free the rest,
//! release. A request whose working memory cannot be found even after
//! eviction is refused for lack of memory (counted; its prefill is not
//! cached). The experiment: does migration raise the hit rate over the
//! best static split (found by sweeping F)?

use std::fmt::Write as _;

use marconi_core::CacheConfig;
use marconi_gpu::plan::ssm_fraction_of;
use marconi_gpu::pooled::{build_pool, PoolLayout, PooledCache};
use serde::Serialize;

use crate::trace::Trace;

/// One memory layout of the experiment.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub enum PoolSpec {
    /// Core's single byte budget (no pools).
    Single,
    /// A pool layout.
    Pools(PoolLayout),
}

impl PoolSpec {
    /// `single`, `static:F`, `avmp`, `avmp:F` or `unified`.
    pub fn parse(s: &str) -> Result<Self, String> {
        let frac = |f: &str| -> Result<f64, String> {
            let x: f64 = f.parse().map_err(|e| format!("{s}: fraction {f:?}: {e}"))?;
            if x > 0.0 && x < 1.0 {
                Ok(x)
            } else {
                Err(format!("{s}: the state fraction must be in (0, 1)"))
            }
        };
        Ok(match s.split_once(':') {
            None if s == "single" => PoolSpec::Single,
            None if s == "avmp" => PoolSpec::Pools(PoolLayout::Avmp { ssm_fraction: 0.5 }),
            None if s == "unified" => PoolSpec::Pools(PoolLayout::Unified),
            Some(("static", f)) => PoolSpec::Pools(PoolLayout::Static {
                ssm_fraction: frac(f)?,
            }),
            Some(("avmp", f)) => PoolSpec::Pools(PoolLayout::Avmp {
                ssm_fraction: frac(f)?,
            }),
            _ => {
                return Err(format!(
                    "unknown layout {s:?}: single, static:F, avmp, avmp:F or unified"
                ))
            }
        })
    }

    /// The name in tables (`static:0.30`, `avmp:0.50`...).
    pub fn name(&self) -> String {
        match self {
            PoolSpec::Single => "single".into(),
            PoolSpec::Pools(PoolLayout::Static { ssm_fraction }) => {
                format!("static:{ssm_fraction:.2}")
            }
            PoolSpec::Pools(PoolLayout::Avmp { ssm_fraction }) => format!("avmp:{ssm_fraction:.2}"),
            PoolSpec::Pools(PoolLayout::Unified) => "unified".into(),
        }
    }
}

/// One layout's result on one trace.
#[derive(Debug, Clone, Serialize)]
pub struct PoolsRow {
    /// The layout.
    pub layout: String,
    /// Requests.
    pub requests: u64,
    /// Hit tokens / input tokens.
    pub token_hit_rate: f64,
    /// Prefill FLOPs saved / FLOPs without a cache.
    pub flop_savings: f64,
    /// Requests refused for lack of memory.
    pub refused: u64,
    /// Admissions that cached nothing.
    pub rejected: u64,
    /// Capacity migrations.
    pub migrations: u64,
    /// Bytes the donor pools gave up.
    pub bytes_migrated: u64,
    /// Evictions (all of core's: for memory, and at admission).
    pub evictions: u64,
    /// Evictions a reservation made that freed only the other pool's kind
    /// (AVMP's whole-cache utility order; 0 for static splits).
    pub evictions_other_kind: u64,
    /// The state pool's share of the pools' bytes at the end (None for single).
    pub final_ssm_fraction: Option<f64>,
}

/// Replays `trace` through `cfg` (its `capacity_bytes` is the budget) laid
/// out as `spec`.
pub fn run(trace: &Trace, cfg: &CacheConfig, spec: PoolSpec) -> Result<PoolsRow, String> {
    let budget = cfg.capacity_bytes;
    match spec {
        PoolSpec::Single => {
            let mut c = marconi_core::PrefixCache::new(cfg.clone()).map_err(|e| e.to_string())?;
            let mut err = None;
            trace.for_each(|r| {
                if err.is_none() {
                    if let Err(e) = c.serve_full(0, r.input_len, r.full) {
                        err = Some(format!("request {}: {e}", r.id));
                    }
                }
            });
            if let Some(e) = err {
                return Err(e);
            }
            let s = c.stats();
            Ok(PoolsRow {
                layout: spec.name(),
                requests: s.requests,
                token_hit_rate: s.token_hit_rate(),
                flop_savings: s.flop_savings_rate(),
                refused: 0,
                rejected: s.admissions_rejected,
                migrations: 0,
                bytes_migrated: 0,
                evictions: s.evictions,
                evictions_other_kind: 0,
                final_ssm_fraction: None,
            })
        }
        PoolSpec::Pools(layout) => {
            let pool = build_pool(&cfg.model, cfg.page_size, budget, layout)
                .map_err(|e| format!("{}: {e}", spec.name()))?;
            let mut c = PooledCache::new(cfg.clone(), pool).map_err(|e| e.to_string())?;
            let mut err = None;
            let mut requests = 0u64;
            trace.for_each(|r| {
                if err.is_none() {
                    requests += 1;
                    if let Err(e) = c.serve(0, r.input_len, r.full) {
                        err = Some(format!("request {}: {e}", r.id));
                    }
                }
            });
            if let Some(e) = err {
                return Err(e);
            }
            let s = c.cache().stats();
            let p = c.stats();
            Ok(PoolsRow {
                layout: spec.name(),
                // Refused requests never reached core's counters.
                requests,
                token_hit_rate: s.token_hit_rate(),
                flop_savings: s.flop_savings_rate(),
                refused: p.refused,
                rejected: s.admissions_rejected,
                migrations: p.migrations,
                bytes_migrated: p.bytes_migrated,
                evictions: s.evictions,
                evictions_other_kind: p.evictions_other_kind,
                final_ssm_fraction: match layout {
                    PoolLayout::Unified => None,
                    _ => Some(ssm_fraction_of(c.pool())),
                },
            })
        }
    }
}

/// Runs every layout on `trace`, `threads` at a time, in the given order.
pub fn run_all(
    trace: &Trace,
    cfg: &CacheConfig,
    specs: &[PoolSpec],
    threads: usize,
) -> Result<Vec<PoolsRow>, String> {
    let threads = threads.max(1);
    let mut out: Vec<Option<Result<PoolsRow, String>>> = vec![None; specs.len()];
    for (chunk_i, chunk) in specs.chunks(threads).enumerate() {
        let results: Vec<Result<PoolsRow, String>> = std::thread::scope(|s| {
            let hs: Vec<_> = chunk
                .iter()
                .map(|&spec| s.spawn(move || run(trace, cfg, spec)))
                .collect();
            hs.into_iter()
                .map(|h| h.join().unwrap_or_else(|_| Err("a replay panicked".into())))
                .collect()
        });
        for (k, r) in results.into_iter().enumerate() {
            out[chunk_i * threads + k] = Some(r);
        }
    }
    out.into_iter()
        .map(|r| r.unwrap_or_else(|| Err("not run".into())))
        .collect()
}

/// What each column of [`table`] means (`pools --help` prints this).
pub const COLUMNS: &str = "\
Columns of the table:
  layout      static:F (two pools, the state pool holding fraction F of the
              budget, never moved), avmp (two pools starting at 0.5, free
              capacity migrating to the pool that is short), unified (one
              pool of units padded to the larger kind), single (one byte
              budget, no pools: an upper reference)
  tok hit     input tokens served from the cache / all input tokens
  FLOP sav    prefill FLOPs saved / prefill FLOPs without a cache
  refused     requests refused for lack of memory: their working pages and
              state slots could not be reserved even after eviction
  rejected    admissions that cached nothing
  migrations  capacity migrations between the two pools (avmp)
  moved       bytes the donor pools gave up over those migrations
  evictions   cache entries evicted (for memory and at admission)
  ssm frac    the state pool's share of the pools' bytes at the end
              (- for single)
";

/// The table: every layout, then the best static split and how AVMP and
/// unified compare with it (token hit rate, percentage points).
pub fn table(rows: &[PoolsRow]) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{:<12} {:>9} {:>9} {:>8} {:>8} {:>10} {:>12} {:>9} {:>9}",
        "layout",
        "tok hit",
        "FLOP sav",
        "refused",
        "rejected",
        "migrations",
        "moved",
        "evictions",
        "ssm frac"
    );
    for r in rows {
        let _ = writeln!(
            s,
            "{:<12} {:>8.2}% {:>8.2}% {:>8} {:>8} {:>10} {:>12} {:>9} {:>9}",
            r.layout,
            100.0 * r.token_hit_rate,
            100.0 * r.flop_savings,
            r.refused,
            r.rejected,
            r.migrations,
            crate::units::format_bytes(r.bytes_migrated),
            r.evictions,
            r.final_ssm_fraction
                .map_or("-".into(), |f| format!("{f:.3}")),
        );
    }
    let best_static = rows
        .iter()
        .filter(|r| r.layout.starts_with("static:"))
        .max_by(|a, b| a.token_hit_rate.total_cmp(&b.token_hit_rate));
    if let Some(b) = best_static {
        let _ = writeln!(
            s,
            "best static split: {} ({:.2}% token hits)",
            b.layout,
            100.0 * b.token_hit_rate
        );
        for r in rows
            .iter()
            .filter(|r| r.layout.starts_with("avmp") || r.layout == "unified")
        {
            let _ = writeln!(
                s,
                "{} vs best static: {:+.2} points of token hit rate ({:+.1}% relative)",
                r.layout,
                100.0 * (r.token_hit_rate - b.token_hit_rate),
                if b.token_hit_rate > 0.0 {
                    100.0 * (r.token_hit_rate / b.token_hit_rate - 1.0)
                } else {
                    0.0
                }
            );
        }
    }
    s
}
