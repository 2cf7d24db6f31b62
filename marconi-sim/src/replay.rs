//! Replaying a trace through a caching policy.
//!
//! Sequential (the default, as in the paper's simulator): requests in
//! arrival order, each one's output admitted before the next is looked up.
//! Concurrent: requests overlap by arrival time and an estimated prefill +
//! decode duration, holding their leases while in flight, so the effect of
//! in-flight pinning on the hit rate shows.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::fmt;
use std::time::Instant;

use marconi_core::{CacheConfig, CacheError, Lookup, ModelSpec, PrefixCache, Stats};
use serde::Serialize;

use crate::trace::{Request, SharedSequence, Trace};
use crate::ttft::TtftModel;

/// A caching policy (paper §5.1).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Policy {
    /// Marconi: judicious admission, FLOP-aware eviction, α tuned online.
    Marconi,
    /// Marconi with the paper's exact rules (`CacheConfig::marconi_paper`).
    MarconiPaper,
    /// Marconi whose tuning also picks the eviction rules
    /// (`CacheConfig::marconi_tuned`).
    MarconiTuned,
    /// Marconi whose rules and α follow the best of its shadow caches
    /// (`CacheConfig::marconi_shadow`).
    MarconiShadow,
    /// Marconi (`CacheConfig::marconi`) with application checkpoints
    /// (`Trace::hints`): a trace file's per-record `checkpoints`, and the
    /// end of each prefix the workload's application knows is shared
    /// (`Trace::app_prefixes`: the generators' system prompts) an input
    /// starts with, go to `PrefixCache::lookup_hinted`. The same as
    /// `marconi` on a trace without hints (e.g. ShareGPT).
    MarconiHinted,
    /// SGLang+: Marconi's admission with LRU eviction.
    SglangPlus,
    /// vLLM+: a state every block (`--block-size`), LRU eviction.
    VllmPlus,
    /// No prefix caching: every token is prefilled.
    NoCache,
    /// The ceiling: unbounded capacity, a usable state at every token.
    Oracle,
    /// Knows the future: Belady eviction and checkpoints placed with
    /// hindsight at the same capacity (sequential; see `clairvoyant`).
    Clairvoyant,
}

impl Policy {
    /// Every policy `compare` runs by default, in table order
    /// (`marconi-shadow` only when named: it is opt-in and its shadows
    /// make it the slowest to replay).
    pub const ALL: [Policy; 8] = [
        Policy::Marconi,
        Policy::SglangPlus,
        Policy::VllmPlus,
        Policy::NoCache,
        Policy::Oracle,
        Policy::MarconiPaper,
        Policy::Clairvoyant,
        Policy::MarconiTuned,
    ];

    /// The name used on the command line and in reports.
    pub fn name(self) -> &'static str {
        match self {
            Policy::Marconi => "marconi",
            Policy::MarconiPaper => "marconi-paper",
            Policy::MarconiTuned => "marconi-tuned",
            Policy::MarconiShadow => "marconi-shadow",
            Policy::MarconiHinted => "marconi-hinted",
            Policy::Clairvoyant => "clairvoyant",
            Policy::SglangPlus => "sglang-plus",
            Policy::VllmPlus => "vllm-plus",
            Policy::NoCache => "no-cache",
            Policy::Oracle => "oracle",
        }
    }
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Everything a replay needs besides the trace.
#[derive(Clone, Debug)]
pub struct ReplayConfig {
    /// The policy.
    pub policy: Policy,
    /// The model whose KV and states are cached.
    pub model: ModelSpec,
    /// Byte budget (ignored by `oracle` and `no-cache`).
    pub capacity_bytes: u64,
    /// A fixed α for `marconi` instead of online tuning.
    pub alpha: Option<f64>,
    /// Block size of `vllm-plus`.
    pub block_size: u32,
    /// Overlap requests in time instead of running them one after another.
    pub concurrent: bool,
    /// Prefill latency model for TTFT.
    pub ttft: TtftModel,
    /// Decode time per output token in ms (concurrent mode's durations).
    pub decode_ms_per_token: f64,
    /// Host and store tiers below the device (`--tiers`; the device's size
    /// is then `tiers.sizes.device`). `None`: one tier, as always.
    pub tiers: Option<crate::tiers::TierSim>,
}

impl ReplayConfig {
    /// Defaults: 32-token blocks, sequential, the linear TTFT fit, 20 ms per
    /// decoded token.
    pub fn new(policy: Policy, model: ModelSpec, capacity_bytes: u64) -> Self {
        ReplayConfig {
            policy,
            model,
            capacity_bytes,
            alpha: None,
            block_size: 32,
            concurrent: false,
            ttft: TtftModel::default(),
            decode_ms_per_token: 20.0,
            tiers: None,
        }
    }

    /// Checks everything a replay uses: the model (also used by `no-cache`,
    /// for FLOPs), the core configuration of the policy, the TTFT model and
    /// the decode time. [`replay`] calls it before any request.
    pub fn validate(&self) -> Result<(), ReplayError> {
        let bad = |s: String| Err(ReplayError::Config(CacheError::InvalidConfig(s)));
        if let Err(e) = self.model.validate() {
            return bad(format!("model {:?}: {e}", self.model.name));
        }
        if let Some(c) = self.cache_config() {
            c.validate().map_err(ReplayError::Config)?;
        }
        if self.policy == Policy::Clairvoyant && self.concurrent {
            return bad(
                "clairvoyant replays requests one at a time; it has no --concurrent mode".into(),
            );
        }
        if let Err(e) = self.ttft.validate() {
            return bad(format!("TTFT model: {e}"));
        }
        let d = self.decode_ms_per_token;
        if !(d.is_finite() && d >= 0.0) {
            return bad(format!(
                "decode time per token {d} ms is not finite and >= 0"
            ));
        }
        Ok(())
    }

    /// The core configuration of the policy (`None` for `no-cache` and
    /// `clairvoyant`, which is the simulator's own).
    pub fn cache_config(&self) -> Option<CacheConfig> {
        let m = self.model.clone();
        let c = self.capacity_bytes;
        let mut cfg = match self.policy {
            Policy::Marconi | Policy::MarconiHinted => CacheConfig::marconi(m, c),
            Policy::MarconiPaper => CacheConfig::marconi_paper(m, c),
            Policy::MarconiTuned => CacheConfig::marconi_tuned(m, c),
            Policy::MarconiShadow => CacheConfig::marconi_shadow(m, c),
            Policy::SglangPlus => CacheConfig::sglang_plus(m, c),
            Policy::VllmPlus => CacheConfig::vllm_plus(m, c, self.block_size),
            Policy::Oracle => CacheConfig::oracle(m),
            Policy::NoCache | Policy::Clairvoyant => return None,
        };
        if let (
            Policy::Marconi
            | Policy::MarconiPaper
            | Policy::MarconiTuned
            | Policy::MarconiShadow
            | Policy::MarconiHinted,
            Some(a),
        ) = (self.policy, self.alpha)
        {
            cfg.alpha = marconi_core::AlphaMode::Fixed(a);
        }
        Some(cfg)
    }
}

/// One request's outcome.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Outcome {
    /// Input length.
    pub input_len: u32,
    /// Tokens reused.
    pub hit_tokens: u32,
    /// Estimated TTFT, ms.
    pub ttft_ms: f64,
}

/// The summary of one replay.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Report {
    /// Policy name.
    pub policy: String,
    /// Model name.
    pub model: String,
    /// Byte budget (`u64::MAX` for the oracle).
    pub capacity_bytes: u64,
    /// Whether requests overlapped in time.
    pub concurrent: bool,
    /// Requests replayed.
    pub requests: u64,
    /// Input tokens.
    pub input_tokens: u64,
    /// Tokens reused.
    pub hit_tokens: u64,
    /// hit_tokens / input_tokens.
    pub token_hit_rate: f64,
    /// Requests with a hit / requests.
    pub request_hit_rate: f64,
    /// KV that matched but had no state to resume from (silent misses).
    pub kv_matched_unusable_tokens: u64,
    /// Prefill FLOPs saved.
    pub flops_saved: f64,
    /// flops_saved / prefill FLOPs with no cache.
    pub flop_savings_rate: f64,
    /// Median TTFT, ms.
    pub ttft_p50_ms: f64,
    /// 95th percentile TTFT, ms.
    pub ttft_p95_ms: f64,
    /// Mean TTFT, ms.
    pub ttft_mean_ms: f64,
    /// Nodes evicted.
    pub evictions: u64,
    /// States admitted.
    pub states_admitted: u64,
    /// Admissions refused whole for lack of space (the sequence's new KV
    /// and states did not fit even after evicting every unleased entry).
    pub admissions_rejected: u64,
    /// Admissions cut to the longest prefix that fit.
    pub admissions_truncated: u64,
    /// α in force at the end.
    pub alpha: f64,
    /// α tuning rounds.
    pub tuning_rounds: u32,
    /// Bytes in use at the end.
    pub used_bytes: u64,
    /// Wall-clock seconds of the replay.
    pub wall_s: f64,
    /// Per-tier figures of a `--tiers` replay (absent otherwise).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tiers: Option<crate::tiers::TierReport>,
}

/// A replay's summary and per-request outcomes (in trace order).
#[derive(Clone, Debug)]
pub struct Replay {
    /// The summary.
    pub report: Report,
    /// Per-request outcomes.
    pub outcomes: Vec<Outcome>,
}

/// A replay failure.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    /// The configuration cannot drive a replay (always
    /// [`CacheError::InvalidConfig`]); found before any request.
    #[error("{0}")]
    Config(CacheError),
    /// The core rejected a call while serving a request.
    #[error("request {id}: {source}")]
    Request {
        /// The request being served.
        id: u64,
        /// The core's error.
        #[source]
        source: CacheError,
    },
}

/// Replays `trace` under `cfg`; `progress` is called with the number of
/// requests done, now and then.
pub fn replay(
    trace: &Trace,
    cfg: &ReplayConfig,
    progress: &mut dyn FnMut(u64),
) -> Result<Replay, ReplayError> {
    let start = Instant::now();
    cfg.validate()?;
    if let Some(t) = &cfg.tiers {
        if !matches!(
            cfg.policy,
            Policy::NoCache | Policy::Oracle | Policy::Clairvoyant
        ) {
            return crate::tiers::replay_tiered(trace, cfg, t, progress);
        }
    }
    if cfg.policy == Policy::Clairvoyant {
        let r = crate::clairvoyant::replay_clairvoyant(trace, cfg);
        progress(r.outcomes.len() as u64);
        return Ok(r);
    }
    let mut cache = match cfg.cache_config() {
        Some(c) => Some(PrefixCache::new(c).map_err(ReplayError::Config)?),
        None => None,
    };
    let mut outcomes = Vec::with_capacity(trace.len());
    let mut flops_total = 0.0;
    let mut input_tokens = 0u64;
    if let (true, Some(c)) = (cfg.concurrent, cache.as_mut()) {
        concurrent(trace, cfg, c, &mut outcomes, progress)?;
        trace.for_each(|r| {
            flops_total += cfg.model.prefill_flops(0, r.input_len as u64);
            input_tokens += r.input_len as u64;
        });
    } else {
        let mut err = None;
        let mut n = 0u64;
        let hinted = cfg.policy == Policy::MarconiHinted;
        trace.for_each(|r| {
            if err.is_some() {
                return;
            }
            let served = cache.as_mut().map(|c| {
                if hinted {
                    let hints = trace.hints(&r);
                    c.serve_full_hinted(0, r.input_len, r.full, &hints)
                } else {
                    c.serve_full(0, r.input_len, r.full)
                }
            });
            let hit = match served {
                Some(s) => match s {
                    Ok(s) => s.hit_tokens as usize,
                    Err(source) => {
                        err = Some(ReplayError::Request { id: r.id, source });
                        return;
                    }
                },
                None => 0,
            };
            flops_total += cfg.model.prefill_flops(0, r.input_len as u64);
            input_tokens += r.input_len as u64;
            outcomes.push(outcome(cfg, &r, hit));
            n += 1;
            if n % 256 == 0 {
                progress(n);
            }
        });
        if let Some(e) = err {
            return Err(e);
        }
    }
    progress(outcomes.len() as u64);
    let stats = cache
        .as_ref()
        .map(PrefixCache::stats)
        .unwrap_or_else(|| Stats {
            requests: outcomes.len() as u64,
            input_tokens,
            flops_total,
            ..Stats::default()
        });
    let mut ttfts: Vec<f64> = outcomes.iter().map(|o| o.ttft_ms).collect();
    ttfts.sort_by(f64::total_cmp);
    let report = Report {
        policy: cfg.policy.name().into(),
        model: cfg.model.name.clone(),
        capacity_bytes: match cfg.policy {
            Policy::Oracle => u64::MAX,
            Policy::NoCache => 0,
            _ => cfg.capacity_bytes,
        },
        concurrent: cfg.concurrent,
        requests: stats.requests,
        input_tokens: stats.input_tokens,
        hit_tokens: stats.hit_tokens,
        token_hit_rate: stats.token_hit_rate(),
        request_hit_rate: stats.request_hit_rate(),
        kv_matched_unusable_tokens: stats.kv_matched_unusable_tokens,
        flops_saved: stats.flops_saved,
        flop_savings_rate: stats.flop_savings_rate(),
        ttft_p50_ms: percentile(&ttfts, 0.50),
        ttft_p95_ms: percentile(&ttfts, 0.95),
        ttft_mean_ms: if ttfts.is_empty() {
            0.0
        } else {
            ttfts.iter().sum::<f64>() / ttfts.len() as f64
        },
        evictions: stats.evictions,
        states_admitted: stats.states_admitted,
        admissions_rejected: stats.admissions_rejected,
        admissions_truncated: stats.admissions_truncated,
        alpha: stats.alpha,
        tuning_rounds: stats.tuning_rounds,
        used_bytes: cache.as_ref().map_or(0, PrefixCache::used_bytes),
        wall_s: start.elapsed().as_secs_f64(),
        tiers: None,
    };
    Ok(Replay { report, outcomes })
}

fn outcome(cfg: &ReplayConfig, r: &Request<'_>, hit: usize) -> Outcome {
    Outcome {
        input_len: r.input_len as u32,
        hit_tokens: hit as u32,
        ttft_ms: cfg.ttft.ttft_ms(&cfg.model, hit, r.input_len),
    }
}

/// The `q` quantile of sorted values (nearest rank).
pub fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// Requests overlap: each is looked up at its arrival, holds its lease for
/// its estimated prefill + decode, then is admitted and released.
fn concurrent(
    trace: &Trace,
    cfg: &ReplayConfig,
    cache: &mut PrefixCache,
    outcomes: &mut Vec<Outcome>,
    progress: &mut dyn FnMut(u64),
) -> Result<(), ReplayError> {
    struct InFlight {
        id: u64,
        lookup: Lookup,
        /// Shared with the trace's expander, not copied: in-flight memory
        /// follows the distinct tokens, not the number of requests.
        full: SharedSequence,
    }
    // Completion events: (time in µs, sequence) -> in-flight index.
    let mut heap: BinaryHeap<Reverse<(u64, u64, usize)>> = BinaryHeap::new();
    let mut flights: Vec<Option<InFlight>> = Vec::new();
    let mut free: Vec<usize> = Vec::new();
    let mut seq = 0u64;
    let mut err = None;
    // One contiguous copy at a time, for the core's admission.
    let mut full = Vec::new();
    let mut finish = |cache: &mut PrefixCache, f: InFlight| -> Result<(), ReplayError> {
        let wrap = |source| ReplayError::Request { id: f.id, source };
        f.full.copy_to(&mut full);
        let states = cache.states_to_save(&f.lookup, full.len());
        cache
            .admit(f.lookup.lease, &full, &states, &[])
            .map_err(wrap)?;
        cache.release(f.lookup.lease).map_err(wrap)
    };
    let mut done = 0u64;
    trace.for_each(|r| {
        if err.is_some() {
            return;
        }
        let now = (r.arrival_s * 1e6) as u64;
        while let Some(&Reverse((t, _, i))) = heap.peek() {
            if t > now {
                break;
            }
            heap.pop();
            let f = flights[i].take().expect("in flight");
            free.push(i);
            if let Err(e) = finish(cache, f) {
                err = Some(e);
                return;
            }
        }
        let looked_up = if cfg.policy == Policy::MarconiHinted {
            cache.lookup_hinted(0, r.input(), &trace.hints(&r))
        } else {
            cache.lookup(0, r.input())
        };
        let l = match looked_up {
            Ok(l) => l,
            Err(source) => {
                err = Some(ReplayError::Request { id: r.id, source });
                return;
            }
        };
        let o = outcome(cfg, &r, l.hit_tokens as usize);
        let dur_ms = o.ttft_ms + cfg.decode_ms_per_token * r.output().len() as f64;
        outcomes.push(o);
        let f = InFlight {
            id: r.id,
            lookup: l,
            full: r.share(),
        };
        let i = match free.pop() {
            Some(i) => {
                flights[i] = Some(f);
                i
            }
            None => {
                flights.push(Some(f));
                flights.len() - 1
            }
        };
        heap.push(Reverse((now + (dur_ms * 1e3) as u64, seq, i)));
        seq += 1;
        done += 1;
        if done % 256 == 0 {
            progress(done);
        }
    });
    if let Some(e) = err {
        return Err(e);
    }
    while let Some(Reverse((_, _, i))) = heap.pop() {
        let f = flights[i].take().expect("in flight");
        finish(cache, f)?;
    }
    Ok(())
}

/// Average token hit rate by input-length bin (paper Fig. 10a): bins are
/// `[edges[i], edges[i+1])`, the last one open.
pub fn hit_rate_by_length(outcomes: &[Outcome], edges: &[u32]) -> Vec<(u32, f64, u64)> {
    let mut acc = vec![(0.0f64, 0u64); edges.len()];
    for o in outcomes {
        let b = edges.iter().rposition(|&e| o.input_len >= e).unwrap_or(0);
        acc[b].0 += f64::from(o.hit_tokens) / f64::from(o.input_len.max(1));
        acc[b].1 += 1;
    }
    edges
        .iter()
        .zip(acc)
        .map(|(&e, (s, n))| (e, if n > 0 { s / n as f64 } else { 0.0 }, n))
        .collect()
}
