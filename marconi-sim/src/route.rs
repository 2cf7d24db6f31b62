//! The multi-engine experiment (`marconi-sim route`): N engines, each with
//! its own prefix cache, behind a router that sends every request of a
//! shared trace to one of them by
//!
//! - **round robin**;
//! - **KV overlap**: the engine holding the most leading KV blocks of the
//!   request (what KV-aware routers do today, blind to recurrent states);
//! - **resumable overlap**: the engine holding the deepest recurrent state
//!   within its KV match (what a hybrid model can actually skip),
//!
//! the last two with a load term: `score = overlap − λ · queued prefill
//! tokens`, highest score wins (ties: fewer queued tokens, then lower
//! engine number). The overlaps come from a [`marconi_router::Index`] fed
//! by the engines' cache events (see [`route_feed`](crate::route_feed)),
//! and every routed request checks the index against its engine's lookup.
//!
//! Timing: each engine prefills one request at a time in arrival order
//! (a FIFO prefill server); a request's TTFT is its wait plus its prefill
//! time under the TTFT model, for the tokens its engine could not skip.
//! Decode runs beside prefill (continuous batching) and does not delay the
//! queue. Each request is admitted to its engine's cache when routed (the
//! sequential simulator's order), so a session's next turn finds it.

use std::collections::VecDeque;
use std::fmt::Write as _;
use std::time::Instant;

use marconi_core::{CacheError, ModelSpec, PrefixCache};
use marconi_router::hash::{ChainHasher, DEFAULT_SEED};
use marconi_router::{EngineId, Index, IndexError, Overlap};
use serde::Serialize;

use crate::replay::{percentile, Policy, ReplayConfig};
use crate::route_feed::EngineFeed;
use crate::trace::Trace;
use crate::ttft::TtftModel;

/// How the router picks an engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Routing {
    /// Engines in turn, blind to caches and load.
    RoundRobin,
    /// Most leading KV tokens cached, minus the load term.
    KvOverlap,
    /// Deepest resumable state within the KV match, minus the load term.
    Resumable,
}

impl Routing {
    /// Every routing, in table order.
    pub const ALL: [Routing; 3] = [Routing::RoundRobin, Routing::KvOverlap, Routing::Resumable];

    /// Name on the command line and in reports.
    pub fn name(self) -> &'static str {
        match self {
            Routing::RoundRobin => "round-robin",
            Routing::KvOverlap => "kv-overlap",
            Routing::Resumable => "resumable",
        }
    }

    /// Whether λ changes anything.
    pub fn uses_lambda(self) -> bool {
        self != Routing::RoundRobin
    }
}

/// One run's parameters.
#[derive(Clone, Debug)]
pub struct RouteConfig {
    /// Engines (1..=64).
    pub engines: usize,
    /// Caching policy of every engine.
    pub policy: Policy,
    /// Model.
    pub model: ModelSpec,
    /// Cache capacity of each engine, bytes.
    pub capacity_bytes: u64,
    /// Tokens per KV page (the published block size).
    pub page_size: u32,
    /// A fixed α for marconi instead of online tuning.
    pub alpha: Option<f64>,
    /// Weight of the load term (per queued prefill token).
    pub lambda: f64,
    /// Prefill latency model.
    pub ttft: TtftModel,
    /// The routing.
    pub routing: Routing,
}

/// Why a run could not be done.
#[derive(Debug, thiserror::Error)]
pub enum RouteError {
    /// A bad parameter.
    #[error("{0}")]
    Config(String),
    /// An engine's cache refused a call.
    #[error("request {id}: {source}")]
    Cache {
        /// The request.
        id: u64,
        /// The cache's error.
        #[source]
        source: CacheError,
    },
    /// The index refused an event (a feed bug).
    #[error("request {id}: index: {source}")]
    Index {
        /// The request.
        id: u64,
        /// The index's error.
        #[source]
        source: IndexError,
    },
}

/// The summary of one run.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RouteReport {
    /// Routing name.
    pub routing: String,
    /// λ (0 for round robin).
    pub lambda: f64,
    /// Engines.
    pub engines: usize,
    /// Caching policy of the engines.
    pub policy: String,
    /// Requests routed.
    pub requests: u64,
    /// Input tokens.
    pub input_tokens: u64,
    /// Tokens skipped (the engines' lookups).
    pub hit_tokens: u64,
    /// hit_tokens / input_tokens.
    pub token_hit_rate: f64,
    /// KV the routed engine held of the request beyond what it could skip:
    /// what a KV-only view counts as a hit and is not.
    pub kv_unusable_tokens: u64,
    /// Requests whose index answer for the routed engine differed from the
    /// engine's own lookup (0: the index is exact).
    pub index_mismatches: u64,
    /// Median TTFT, ms.
    pub ttft_p50_ms: f64,
    /// 95th percentile TTFT, ms.
    pub ttft_p95_ms: f64,
    /// 99th percentile TTFT, ms.
    pub ttft_p99_ms: f64,
    /// Mean TTFT, ms.
    pub ttft_mean_ms: f64,
    /// Mean wait in an engine's prefill queue, ms.
    pub queue_mean_ms: f64,
    /// Prefill time of the busiest engine over the mean (1 = balanced).
    pub busy_imbalance: f64,
    /// Requests of the busiest engine over the mean.
    pub request_imbalance: f64,
    /// Requests per engine.
    pub requests_per_engine: Vec<u64>,
    /// Evictions, all engines.
    pub evictions: u64,
    /// Wall-clock seconds of the run.
    pub wall_s: f64,
}

struct Job {
    start_ms: f64,
    end_ms: f64,
    tokens: f64,
}

/// One engine: its cache, the feed that publishes its changes, and its
/// prefill queue.
struct Engine {
    id: EngineId,
    cache: PrefixCache,
    feed: EngineFeed,
    jobs: VecDeque<Job>,
    busy_until_ms: f64,
    busy_ms: f64,
    requests: u64,
}

impl Engine {
    /// Prefill tokens still to do at `now`.
    fn queued_tokens(&mut self, now: f64) -> f64 {
        while self.jobs.front().is_some_and(|j| j.end_ms <= now) {
            self.jobs.pop_front();
        }
        self.jobs
            .iter()
            .map(|j| {
                let d = j.end_ms - j.start_ms;
                if d <= 0.0 {
                    0.0
                } else {
                    j.tokens * ((j.end_ms - now.max(j.start_ms)) / d).min(1.0)
                }
            })
            .sum()
    }
}

impl RouteConfig {
    fn validate(&self) -> Result<(), RouteError> {
        let bad = |s: String| Err(RouteError::Config(s));
        if self.engines == 0 || self.engines > marconi_router::MAX_ENGINES {
            return bad(format!(
                "engines must be 1..={}, not {}",
                marconi_router::MAX_ENGINES,
                self.engines
            ));
        }
        if !(self.lambda.is_finite() && self.lambda >= 0.0) {
            return bad(format!("λ {} is not finite and >= 0", self.lambda));
        }
        if matches!(
            self.policy,
            Policy::NoCache | Policy::Oracle | Policy::Clairvoyant
        ) {
            return bad(format!(
                "policy {} has no bounded cache to route to",
                self.policy
            ));
        }
        Ok(())
    }

    fn replay_config(&self) -> ReplayConfig {
        let mut r = ReplayConfig::new(self.policy, self.model.clone(), self.capacity_bytes);
        r.alpha = self.alpha;
        r.block_size = r.block_size.max(self.page_size);
        r.block_size -= r.block_size % self.page_size.max(1);
        r.ttft = self.ttft.clone();
        r
    }
}

/// Routes every request of `trace` under `cfg`.
pub fn route(trace: &Trace, cfg: &RouteConfig) -> Result<RouteReport, RouteError> {
    let start = Instant::now();
    cfg.validate()?;
    let rc = cfg.replay_config();
    rc.validate()
        .map_err(|e| RouteError::Config(e.to_string()))?;
    let mut cache_cfg = rc
        .cache_config()
        .ok_or_else(|| RouteError::Config("no cache".into()))?;
    cache_cfg.page_size = cfg.page_size;
    cache_cfg
        .validate()
        .map_err(|e| RouteError::Config(e.to_string()))?;
    let mut index = Index::new(cfg.page_size).map_err(|e| RouteError::Config(e.to_string()))?;
    let hasher = ChainHasher::new(DEFAULT_SEED, cfg.page_size);
    let mut engines = Vec::with_capacity(cfg.engines);
    for i in 0..cfg.engines {
        let id = index
            .add_engine(format!("engine-{i}"))
            .map_err(|e| RouteError::Config(e.to_string()))?;
        engines.push(Engine {
            id,
            cache: PrefixCache::new(cache_cfg.clone())
                .map_err(|e| RouteError::Config(e.to_string()))?,
            feed: EngineFeed::new(cfg.page_size),
            jobs: VecDeque::new(),
            busy_until_ms: 0.0,
            busy_ms: 0.0,
            requests: 0,
        });
    }
    let mut hashes = Vec::new();
    let mut overlaps: Vec<Overlap> = Vec::new();
    let mut ttfts = Vec::with_capacity(trace.len());
    let (mut input_tokens, mut hit_tokens, mut kv_unusable, mut mismatches) = (0u64, 0, 0, 0);
    let mut queue_ms = 0.0;
    let mut rr = 0usize;
    let mut err = None;
    trace.for_each(|r| {
        if err.is_some() {
            return;
        }
        let now = r.arrival_s * 1000.0;
        // Hashes of every whole block of the sequence: the input's are its
        // first blocks (the query), all of them feed the index.
        hashes.clear();
        hasher.wire_hashes(r.full, 0, &mut hashes);
        let input_blocks = r.input_len / cfg.page_size as usize;
        index.overlap_hashes(&hashes[..input_blocks], r.input_len, &mut overlaps);
        let pick = match cfg.routing {
            Routing::RoundRobin => {
                rr = (rr + 1) % engines.len();
                (rr + engines.len() - 1) % engines.len()
            }
            Routing::KvOverlap | Routing::Resumable => {
                let mut best = (f64::NEG_INFINITY, f64::INFINITY, 0usize);
                for (i, e) in engines.iter_mut().enumerate() {
                    let o = overlaps[e.id.index()];
                    let ov = if cfg.routing == Routing::KvOverlap {
                        o.kv_matched_tokens
                    } else {
                        o.resumable_tokens
                    };
                    let q = e.queued_tokens(now);
                    let score = f64::from(ov) - cfg.lambda * q;
                    if score > best.0 || (score == best.0 && q < best.1) {
                        best = (score, q, i);
                    }
                }
                best.2
            }
        };
        let e = &mut engines[pick];
        let predicted = overlaps[e.id.index()];
        let served = match e.feed.serve(&mut e.cache, r.input_len, r.full, &hashes) {
            Ok(s) => s,
            Err(source) => {
                err = Some(RouteError::Cache { id: r.id, source });
                return;
            }
        };
        if served.hit_tokens != predicted.resumable_tokens
            || served.kv_matched_tokens != predicted.kv_matched_tokens
        {
            mismatches += 1;
        }
        for ev in e.feed.drain() {
            if let Err(source) = index.apply(e.id, &ev) {
                err = Some(RouteError::Index { id: r.id, source });
                return;
            }
        }
        let hit = served.hit_tokens as usize;
        let prefill = cfg.ttft.ttft_ms(&cfg.model, hit, r.input_len);
        let begin = now.max(e.busy_until_ms);
        e.busy_until_ms = begin + prefill;
        e.busy_ms += prefill;
        e.requests += 1;
        e.jobs.push_back(Job {
            start_ms: begin,
            end_ms: begin + prefill,
            tokens: (r.input_len - hit) as f64,
        });
        queue_ms += begin - now;
        ttfts.push(begin - now + prefill);
        input_tokens += r.input_len as u64;
        hit_tokens += u64::from(served.hit_tokens);
        kv_unusable += u64::from(served.kv_matched_tokens.saturating_sub(served.hit_tokens));
    });
    if let Some(e) = err {
        return Err(e);
    }
    ttfts.sort_by(f64::total_cmp);
    let n = ttfts.len().max(1) as f64;
    let ratio = |v: Vec<f64>| {
        let mean = v.iter().sum::<f64>() / v.len() as f64;
        let max = v.iter().copied().fold(0.0, f64::max);
        if mean > 0.0 {
            max / mean
        } else {
            1.0
        }
    };
    Ok(RouteReport {
        routing: cfg.routing.name().into(),
        lambda: if cfg.routing.uses_lambda() {
            cfg.lambda
        } else {
            0.0
        },
        engines: cfg.engines,
        policy: cfg.policy.name().into(),
        requests: ttfts.len() as u64,
        input_tokens,
        hit_tokens,
        token_hit_rate: if input_tokens > 0 {
            hit_tokens as f64 / input_tokens as f64
        } else {
            0.0
        },
        kv_unusable_tokens: kv_unusable,
        index_mismatches: mismatches,
        ttft_p50_ms: percentile(&ttfts, 0.50),
        ttft_p95_ms: percentile(&ttfts, 0.95),
        ttft_p99_ms: percentile(&ttfts, 0.99),
        ttft_mean_ms: ttfts.iter().sum::<f64>() / n,
        queue_mean_ms: queue_ms / n,
        busy_imbalance: ratio(engines.iter().map(|e| e.busy_ms).collect()),
        request_imbalance: ratio(engines.iter().map(|e| e.requests as f64).collect()),
        requests_per_engine: engines.iter().map(|e| e.requests).collect(),
        evictions: engines.iter().map(|e| e.cache.stats().evictions).sum(),
        wall_s: start.elapsed().as_secs_f64(),
    })
}

/// The runs of an experiment: round robin once, the other routings at
/// every λ.
pub fn jobs(base: &RouteConfig, lambdas: &[f64]) -> Vec<RouteConfig> {
    let mut out = Vec::new();
    for routing in Routing::ALL {
        let ls: &[f64] = if routing.uses_lambda() {
            lambdas
        } else {
            &[0.0]
        };
        for &lambda in ls {
            out.push(RouteConfig {
                routing,
                lambda,
                ..base.clone()
            });
        }
    }
    out
}

/// Runs `jobs` on up to `threads` threads (0: one per core), results in
/// job order.
pub fn run_all(
    trace: &Trace,
    jobs: &[RouteConfig],
    threads: usize,
) -> Result<Vec<RouteReport>, RouteError> {
    for j in jobs {
        j.validate()?;
    }
    let threads = if threads == 0 {
        std::thread::available_parallelism().map_or(1, |n| n.get())
    } else {
        threads
    }
    .clamp(1, jobs.len().max(1));
    let next = std::sync::atomic::AtomicUsize::new(0);
    let results = std::sync::Mutex::new(
        (0..jobs.len())
            .map(|_| None)
            .collect::<Vec<Option<Result<RouteReport, RouteError>>>>(),
    );
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some(job) = jobs.get(i) else { break };
                let r = route(trace, job);
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

/// The table of an experiment.
pub fn table(reports: &[RouteReport]) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{:<12} {:>6} {:>9} {:>12} {:>10} {:>10} {:>10} {:>10} {:>9} {:>9} {:>9}",
        "routing",
        "λ",
        "hit rate",
        "KV unusable",
        "TTFT p50",
        "TTFT p95",
        "TTFT mean",
        "queue",
        "busy max",
        "reqs max",
        "idx miss"
    );
    let _ = writeln!(
        s,
        "{:<12} {:>6} {:>9} {:>12} {:>10} {:>10} {:>10} {:>10} {:>9} {:>9} {:>9}",
        "", "", "(tokens)", "(tokens)", "(ms)", "(ms)", "(ms)", "(ms)", "/mean", "/mean", ""
    );
    for r in reports {
        let _ = writeln!(
            s,
            "{:<12} {:>6} {:>8.1}% {:>12} {:>10.1} {:>10.1} {:>10.1} {:>10.1} {:>9.2} {:>9.2} {:>9}",
            r.routing,
            if r.routing == "round-robin" {
                "-".to_string()
            } else {
                format!("{}", r.lambda)
            },
            100.0 * r.token_hit_rate,
            r.kv_unusable_tokens,
            r.ttft_p50_ms,
            r.ttft_p95_ms,
            r.ttft_mean_ms,
            r.queue_mean_ms,
            r.busy_imbalance,
            r.request_imbalance,
            r.index_mismatches
        );
    }
    s
}

/// Columns of [`table`], for `--help`.
pub const COLUMNS: &str = "Columns: hit rate = input tokens skipped (the engines' own lookups); \
KV unusable = KV the routed engine held beyond its deepest state (a KV-only router's phantom hit); \
TTFT = prefill-queue wait + prefill of the tokens not skipped (TTFT model); queue = mean wait; \
busy max/mean = prefill time of the busiest engine over the mean; reqs max/mean = the same for \
request counts; idx miss = requests where the index's answer differed from the engine's lookup.";

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synth::{generate, SynthConfig, SynthKind};

    fn base(engines: usize, capacity_bytes: u64) -> RouteConfig {
        RouteConfig {
            engines,
            policy: Policy::Marconi,
            model: ModelSpec::preset("paper-7b").expect("preset"),
            capacity_bytes,
            page_size: 16,
            alpha: Some(1.0),
            lambda: 0.0,
            ttft: TtftModel::default(),
            routing: Routing::RoundRobin,
        }
    }

    fn chat(sessions: u32) -> Trace {
        let mut c = SynthConfig::new(SynthKind::Chat);
        c.sessions = sessions;
        c.session_rate = 4.0;
        generate(&c)
    }

    /// Every routing, with evictions: the index, fed only by the engines'
    /// events, answers exactly what each routed engine's lookup finds.
    #[test]
    fn the_index_matches_every_engine_under_eviction() {
        let trace = chat(120);
        let reports = run_all(&trace, &jobs(&base(3, 300_000_000), &[0.0, 1.0]), 1).unwrap();
        assert_eq!(reports.len(), 5);
        for r in &reports {
            assert_eq!(r.index_mismatches, 0, "{}", r.routing);
            assert_eq!(r.requests, trace.len() as u64);
            assert_eq!(r.requests_per_engine.iter().sum::<u64>(), r.requests);
            assert!(r.evictions > 0, "the capacity forces evictions");
            assert!(r.hit_tokens <= r.input_tokens);
        }
    }

    /// With one engine the routing cannot matter.
    #[test]
    fn one_engine_routes_alike() {
        let trace = chat(40);
        let reports = run_all(&trace, &jobs(&base(1, 2_000_000_000), &[0.5]), 1).unwrap();
        let hits: Vec<u64> = reports.iter().map(|r| r.hit_tokens).collect();
        assert!(hits.iter().all(|&h| h == hits[0]), "{hits:?}");
        assert!(hits[0] > 0);
        let ttft: Vec<f64> = reports.iter().map(|r| r.ttft_mean_ms).collect();
        assert!(ttft.iter().all(|&t| t == ttft[0]), "{ttft:?}");
    }

    #[test]
    fn bad_parameters_are_refused() {
        let trace = chat(2);
        for cfg in [
            base(0, 1_000_000_000),
            base(65, 1_000_000_000),
            RouteConfig {
                lambda: f64::NAN,
                ..base(2, 1_000_000_000)
            },
            RouteConfig {
                policy: Policy::NoCache,
                ..base(2, 1_000_000_000)
            },
        ] {
            assert!(matches!(route(&trace, &cfg), Err(RouteError::Config(_))));
        }
    }
}
