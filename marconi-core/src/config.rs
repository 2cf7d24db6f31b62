//! Cache configuration: budget, page and checkpoint grids, and the policies.

use serde::{Deserialize, Serialize};

use crate::error::CacheError;
use crate::model::ModelSpec;

/// Which recurrent states the cache asks the engine to save and accepts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum AdmissionPolicy {
    /// Marconi's judicious admission (paper §4.1): before prefill, a
    /// speculative insertion of the input finds whether it would create a
    /// branch node; if so one checkpoint is planned at the branch position
    /// (rounded down to the checkpoint grid when the branch lies inside the
    /// prefill). The state after the last decoded token is always admitted.
    /// At most two new states per request.
    ///
    /// Use it for hybrid models. Not useful for attention-only models, where
    /// every prefix of the KV is reusable and no states exist.
    Marconi,
    /// A state at every block boundary (the vLLM+ baseline of paper §5.1).
    /// Floods the cache with large, rarely hit states: a baseline, not a
    /// policy to deploy.
    AllBlocks {
        /// Tokens per block (default 32); a multiple of the page size.
        block_size: u32,
    },
    /// The ceiling: every position counts as having a state (no state bytes
    /// are charged). Only meaningful with an unbounded capacity, to measure
    /// the best hit rate any policy could reach on a trace.
    Oracle,
}

/// Which cached entries are evicted first when space is needed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum EvictionPolicy {
    /// Least recently used leaf first (the SGLang+ baseline): a hit refreshes
    /// the whole matched path, as SGLang's radix cache does.
    Lru,
    /// Marconi's FLOP-aware eviction (paper §4.2–4.3): candidates are unleased
    /// nodes with at most one child; the lowest
    /// `recency + α · flop_efficiency` (both min-max normalised over the
    /// candidates) goes first. A hit refreshes only the node used.
    FlopAware,
}

/// What α tuning maximises when it replays a window.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum TuningObjective {
    /// Prefill FLOPs saved (the default: what the cache is for).
    FlopsSaved,
    /// Tokens hit.
    TokenHits,
}

/// The α weight of FLOP efficiency in [`EvictionPolicy::FlopAware`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum AlphaMode {
    /// A fixed α.
    Fixed(f64),
    /// α tuned online by replaying recent windows (paper §4.2 "Managing the
    /// balance"), see [`TunerConfig`].
    Auto(TunerConfig),
}

/// When the result of a background α search is adopted.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum AlphaAdoption {
    /// Exactly [`TunerConfig::apply_after`] requests after the window
    /// closed, waiting for the search there if it is not done: the same
    /// trace gives the same α at the same request on any machine and with
    /// any thread count (simulation, decision-log snapshots, replays that
    /// are compared). The adopting request can stall for the rest of the
    /// search: on a large cache, seconds. The default, so that
    /// [`crate::PrefixCache`] stays deterministic unless asked otherwise.
    #[default]
    Deterministic,
    /// At the first finished request that finds the search done; until
    /// then every request is served with the α in force and only polls the
    /// result (never waits). For engines: no request stalls on tuning, but
    /// when α changes depends on the machine's speed, so decisions are not
    /// reproducible run to run. [`TunerConfig::apply_after`] is ignored.
    WhenReady,
}

/// Online α tuning.
///
/// α is 0 until the first eviction. The first window holds
/// `bootstrap_factor ×` the requests seen before that eviction (at least
/// `min_window`); at its end every α of `grid` is replayed from a snapshot of
/// the tree taken at the window's start, in parallel threads, and the best is
/// adopted (smallest α on ties). With `retune`, later windows of the same
/// length (one in `retune_every`) are tuned again over α = 0, the current α
/// and its grid neighbours, so α follows a drifting workload. An α other than
/// 0 is adopted only if it beats α = 0 on the window by `min_gain`
/// (relative to α = 0's score on the window), so tuning never picks an α that did worse than LRU. With
/// `retune` (and without `tune_rules`), a round moves away from the α in
/// force only if the move gains on both halves of its window (a sign test
/// against one noisy burst of requests; see docs/results.md, "Battery"), or if it
/// returns to α = 0 with the better total (a large α adopted on a lucky
/// window must be able to go back).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TunerConfig {
    /// Candidate α values.
    pub grid: Vec<f64>,
    /// Window length as a multiple of the requests seen before the first eviction.
    pub bootstrap_factor: u32,
    /// Smallest window, in requests.
    pub min_window: u32,
    /// Longest window, in requests (0: no limit, the paper's rule). The
    /// bootstrap rule makes the window 5× the requests before the first
    /// eviction: on a large cache that is more requests than a workload
    /// phase lasts, and α and the rules stay untuned until it ends; a cap
    /// starts tuning after a representative sample instead.
    #[serde(default)]
    pub max_window: u32,
    /// Keep tuning on later windows.
    pub retune: bool,
    /// On windows after the first, replay only α = 0, the current α and its
    /// `retune_neighbours` nearest grid values on each side (0: the whole
    /// grid every window). Bounds the replay cost of continuous tuning.
    pub retune_neighbours: u32,
    /// Re-tune on one window out of this many (1: every window). Replaying
    /// costs about `grid values × window`; spacing rounds bounds the total
    /// tuning work to a fraction of serving.
    pub retune_every: u32,
    /// What the replay maximises.
    pub objective: TuningObjective,
    /// The grid search runs in the background; with
    /// [`AlphaAdoption::Deterministic`] its α is adopted this many requests
    /// after its window closed (waiting for it then if needed), 0 searching
    /// synchronously in the request that closes the window. Any value gives
    /// deterministic results.
    pub apply_after: u32,
    /// When a search's result is adopted: at a fixed request (default,
    /// deterministic) or as soon as it is ready (engines, never waits).
    #[serde(default)]
    pub adoption: AlphaAdoption,
    /// Relative gain over α = 0 that a non-zero α must reach to be adopted,
    /// measured on the window: the best candidate's objective gained over
    /// the window must exceed α = 0's by this fraction of α = 0's (what was
    /// scored before the window does not count). Default 0: the grid
    /// includes α = 0, so an adopted α never did worse than LRU on its
    /// window; a margin trades responsiveness for stability.
    pub min_gain: f64,
    /// Threads for the grid search (0: one per available core).
    pub threads: u32,
    /// Also tune the eviction rules, as α is tuned: every round replays
    /// its α values with `protect_branch_states` on and off, and plain LRU
    /// (SGLang+'s rules: leaves only, a hit refreshes its whole path), and
    /// adopts the best. No fixed rule wins on every workload (protecting
    /// shared prompts helps chat traces with popular system prompts and
    /// costs on real ShareGPT conversations; FLOP-aware merging can lose to
    /// LRU's leaf order), so the choice is made per workload from its own
    /// recent requests. A round that tunes the rules adopts its best
    /// candidate as it is (no sign test, see [`Self::retune`]). Default on
    /// (it was off before): judged per workload and capacity over many seeds
    /// (`marconi-sim battery --seeds 0..40`, docs/results.md "Per cell, over many
    /// seeds"), it is the only setting measured that never loses on any
    /// cell of three sets of 40 seeds; without it marconi lost the
    /// longout 5 % cell on two of them (−0.30 and −0.42 points against
    /// marconi-paper). Doubles the replays of a round, plus one; a round
    /// that changes the rules rebuilds the eviction index (O(nodes log
    /// nodes), on the request that adopts it). The paper's preset
    /// ([`CacheConfig::marconi_paper`]) tunes α only.
    #[serde(default = "default_tune_rules")]
    pub tune_rules: bool,
    /// Choose the eviction rules and α with shadow caches instead of
    /// replaying windows (`None`: the window tuner). See [`ShadowConfig`].
    #[serde(default)]
    pub shadows: Option<ShadowConfig>,
}

/// Rule choice by shadow caches (`crate::shadow`): metadata-only copies of
/// the cache, one per candidate rule set (FLOP-aware eviction with
/// `protect_branch_states` on and off, α tuned by the window tuner
/// and/or fixed at each of `alphas`; optionally plain LRU), fed every
/// request the cache serves from the first one, each making its own
/// decisions at the same capacity. The cache adopts the rules and α of the
/// shadow with the best decayed score (the tuner's [`TuningObjective`]),
/// with hysteresis; the cache's own window tuner is off (a tuned shadow
/// tunes). Each request costs one more lookup and admission per shadow.
/// Above `exact_bytes` the shadows are sampled (SHARDS, Waldspurger et al.
/// ATC'17): a shadow sees only requests whose first `sample_tokens` tokens
/// hash into a sample of rate `exact_bytes / capacity`, at that fraction of
/// the capacity.
///
/// The default (two window-tuned shadows, protection on and off, scores
/// halved every 200 requests) is the best of the variants measured on the
/// battery of `marconi-sim battery` (docs/results.md, "Battery"): adding plain LRU
/// or α = 0 shadows made the cache switch more and lose more rows.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ShadowConfig {
    /// Fixed α values of FLOP-aware shadows (each with protection on and
    /// off; default none).
    pub alphas: Vec<f64>,
    /// Also a shadow with each `protect_branch_states` whose α is tuned by
    /// the window tuner (this [`TunerConfig`], without shadows); the cache
    /// then takes that shadow's α while its rules are in force.
    pub tuned: bool,
    /// Also a shadow with plain LRU (SGLang+'s rules).
    pub lru: bool,
    /// Half-life of a shadow's score, in requests (0: no decay).
    pub half_life: u32,
    /// Relative lead a shadow's score needs over the rules in force to be
    /// adopted.
    pub hysteresis: f64,
    /// Capacity up to which the shadows see every request at full
    /// capacity; above, they are sampled.
    pub exact_bytes: u64,
    /// Leading tokens hashed (with the namespace) to sample a request.
    pub sample_tokens: u32,
}

impl Default for ShadowConfig {
    fn default() -> Self {
        ShadowConfig {
            alphas: Vec::new(),
            tuned: true,
            lru: false,
            half_life: 200,
            hysteresis: 0.0,
            exact_bytes: 16 << 30,
            sample_tokens: 64,
        }
    }
}

impl Default for TunerConfig {
    fn default() -> Self {
        TunerConfig {
            grid: (0..=20).map(|i| f64::from(i) / 10.0).collect(),
            bootstrap_factor: 5,
            min_window: 16,
            max_window: 0,
            retune: true,
            retune_neighbours: 2,
            retune_every: 4,
            objective: TuningObjective::FlopsSaved,
            apply_after: 16,
            adoption: AlphaAdoption::Deterministic,
            min_gain: 0.0,
            threads: 0,
            tune_rules: default_tune_rules(),
            shadows: None,
        }
    }
}

/// [`TunerConfig::tune_rules`]'s default, also for configurations stored
/// without the field.
fn default_tune_rules() -> bool {
    true
}

/// The default [`CacheConfig::min_branch_depth`], in tokens.
pub const DEFAULT_MIN_BRANCH_DEPTH: u32 = 16;

fn default_min_branch_depth() -> u32 {
    DEFAULT_MIN_BRANCH_DEPTH
}

/// The default [`CacheConfig::superseded_age`], in mean turn gaps.
pub const DEFAULT_SUPERSEDED_AGE: f64 = 1.0;

fn default_superseded_age() -> f64 {
    DEFAULT_SUPERSEDED_AGE
}

/// Everything a [`crate::PrefixCache`] is built from.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CacheConfig {
    /// The model whose states are cached.
    pub model: ModelSpec,
    /// Byte budget for KV and states together (for models without attention
    /// layers, tokens are charged [`crate::TOKEN_ID_BYTES`] each instead of KV).
    pub capacity_bytes: u64,
    /// Tokens per KV page: cached lengths and split points are multiples of it.
    pub page_size: u32,
    /// Chunk size of chunked state passing: a checkpoint inside a prefill is
    /// rounded down to a multiple of it (1 = exact positions).
    pub checkpoint_grid: u32,
    /// Which states are saved.
    pub admission: AdmissionPolicy,
    /// What is evicted first.
    pub eviction: EvictionPolicy,
    /// α for [`EvictionPolicy::FlopAware`] (ignored by LRU).
    pub alpha: AlphaMode,
    /// Keep a decision log (drained with [`crate::PrefixCache::drain_log`]).
    pub decision_log: bool,
    /// FLOP-aware eviction only: a node that has ever had two children (a
    /// prefix shared by several requests) loses its state only once it is a
    /// leaf, instead of as soon as it is down to one child (paper §4.3). The
    /// paper's rule lets a shared system prompt's state be merged away when
    /// the eviction of its other branches leaves it one child; on chat traces
    /// with a few popular system prompts that cost FLOP-aware eviction its
    /// edge over plain LRU. Default on; off reproduces the paper exactly.
    pub protect_branch_states: bool,
    /// The shallowest prefix treated as shared, in tokens (default
    /// [`DEFAULT_MIN_BRANCH_DEPTH`]; 0: every branch point, the paper's
    /// rules). Marconi admission plans no branch checkpoint shallower (the
    /// final state of a request is admitted whatever its depth), and
    /// `protect_branch_states` protects no branch point shallower. On real
    /// conversations most branch points are the first token or two that
    /// unrelated prompts share by chance ("What", "Write a"): a state there
    /// costs a whole state's bytes to save a few tokens per hit. On the
    /// ShareGPT rows of `marconi-sim battery` skipping them raised marconi's
    /// token hit rate by 0.4 to 1.8 points (protecting them had cost up to
    /// 0.8 points), while the shared system prompts checkpoints are for are
    /// tens to thousands of tokens long. Any value from 8 to 32 gives the
    /// same battery table (4 keeps one ShareGPT branch state too many; 64
    /// drops the longout generator's 40-token system prompt); 16 sits in
    /// the middle. The baselines (`marconi_paper`, `sglang_plus`) use 0.
    #[serde(default = "default_min_branch_depth")]
    pub min_branch_depth: u32,
    /// FLOP-aware eviction only: how much older than its last use a
    /// *superseded* state counts, in mean turn gaps (default
    /// [`DEFAULT_SUPERSEDED_AGE`], one turn; 0: the paper's rules). A state
    /// is superseded when the request that resumed from it (the leaf its
    /// lookup hit) takes a deeper state below it: the conversation's next
    /// turn will resume from the new state, so the old one is now an
    /// intermediate node with one child, which the paper itself calls
    /// "unlikely to be reused" (§4.3 (1)). Yet the hit refreshed it (§4.3
    /// (2)), so it competed with the newest state of every conversation as
    /// if just used. Its last access is moved back by `superseded_age` ×
    /// the mean gap between a state's previous use and the hit that
    /// supersedes it (logical time, measured on every such hit): with 1 it
    /// counts about as if the hit had not refreshed it. A later hit on it
    /// (a branch from that turn) refreshes it as any hit does. Measured on
    /// `marconi-sim battery` over 120 seeds (docs/results.md, "Superseded states"):
    /// 1 raises marconi's mean token hit rate by 0.7 to 0.8 points; 2 and
    /// 3 by 1.3 to 1.6, but lose the chat 5 % cell (tuning noise at that
    /// capacity, which they shift against marconi).
    #[serde(default = "default_superseded_age")]
    pub superseded_age: f64,
    /// Record every change of what is cached (drained with
    /// [`crate::PrefixCache::drain_events`]; `docs/events.md`). Off by
    /// default: no cost when off.
    #[serde(default)]
    pub events: bool,
}

impl CacheConfig {
    /// Marconi's configuration (judicious admission, FLOP-aware eviction, α
    /// tuned online) for `model` under `capacity_bytes`, exact positions, page
    /// size 1. Beyond the paper: branch states of shared prompts are
    /// protected (`protect_branch_states`), prefixes shared by fewer than
    /// [`DEFAULT_MIN_BRANCH_DEPTH`] tokens are not treated as shared
    /// (`min_branch_depth`), α is re-tuned on later windows, and each
    /// tuning round also chooses the eviction rules
    /// ([`TunerConfig::tune_rules`]: protection on or off, or plain LRU).
    /// α is tuned for prefill FLOPs saved (what the cache exists to cut; a
    /// long prefix hit saves more than its token count says), while
    /// `marconi-sim battery` judges token hit rate (the paper's headline
    /// metric); tuning for token hits instead gave the same token hit rate
    /// on every row of the default battery and of `--seeds 5,6
    /// --sharegpt-seeds 7,8`. Averaged over the seeds of each workload and
    /// capacity (docs/results.md, "Per cell, over many seeds") it is within 0.2
    /// points of the better of sglang-plus and marconi-paper on every cell
    /// of three sets of 40 seeds; on single traces it still loses some
    /// rows, where LRU or the paper's rules keep a few more conversations.
    pub fn marconi(model: ModelSpec, capacity_bytes: u64) -> Self {
        CacheConfig {
            model,
            capacity_bytes,
            page_size: 1,
            checkpoint_grid: 1,
            admission: AdmissionPolicy::Marconi,
            eviction: EvictionPolicy::FlopAware,
            alpha: AlphaMode::Auto(TunerConfig::default()),
            decision_log: false,
            protect_branch_states: true,
            min_branch_depth: DEFAULT_MIN_BRANCH_DEPTH,
            superseded_age: DEFAULT_SUPERSEDED_AGE,
            events: false,
        }
    }

    /// Marconi exactly as the paper describes it: judicious admission,
    /// FLOP-aware eviction whose merge candidates include shared prefixes
    /// (`protect_branch_states` off, §4.3), a branch checkpoint wherever a
    /// branch is found (`min_branch_depth` 0, §4.1), α tuned once on the
    /// bootstrap window for the best token hit rate (§4.2 "Managing the
    /// balance": no re-tuning). The reference the default configuration
    /// must not lose to.
    pub fn marconi_paper(model: ModelSpec, capacity_bytes: u64) -> Self {
        CacheConfig {
            alpha: AlphaMode::Auto(TunerConfig {
                retune: false,
                objective: TuningObjective::TokenHits,
                tune_rules: false,
                ..TunerConfig::default()
            }),
            protect_branch_states: false,
            min_branch_depth: 0,
            superseded_age: 0.0,
            ..Self::marconi(model, capacity_bytes)
        }
    }

    /// The default (whose tuning also picks the eviction rules,
    /// [`TunerConfig::tune_rules`]) with tuning that starts after at most
    /// 100 requests ([`TunerConfig::max_window`]). Not the default: over
    /// 120 seeds of `marconi-sim battery` its mean token hit rate is 0.06
    /// points higher but it loses more rows (1,202 of 1,440 within 0.2
    /// points of the better reference, against 1,239).
    pub fn marconi_tuned(model: ModelSpec, capacity_bytes: u64) -> Self {
        CacheConfig {
            alpha: AlphaMode::Auto(TunerConfig {
                tune_rules: true,
                max_window: 100,
                ..TunerConfig::default()
            }),
            ..Self::marconi(model, capacity_bytes)
        }
    }

    /// Marconi whose eviction rules and α are chosen by shadow caches
    /// ([`ShadowConfig`], default settings): FLOP-aware eviction with
    /// `protect_branch_states` on and off, each α-tuned by the window
    /// tuner, both fed every request from the first; the cache follows the
    /// better (decayed FLOPs saved). On the battery of `marconi-sim
    /// battery` it loses fewer rows than the default, on seeds it was not
    /// developed on too, but it does not meet "never loses" on every row
    /// either (following a leader mixes rule sets, and the mixture can do
    /// worse than both), and every request also serves the two shadows:
    /// opt-in.
    pub fn marconi_shadow(model: ModelSpec, capacity_bytes: u64) -> Self {
        CacheConfig {
            alpha: AlphaMode::Auto(TunerConfig {
                shadows: Some(ShadowConfig::default()),
                tune_rules: false,
                ..TunerConfig::default()
            }),
            ..Self::marconi(model, capacity_bytes)
        }
    }

    /// The SGLang+ baseline: Marconi admission with LRU eviction.
    pub fn sglang_plus(model: ModelSpec, capacity_bytes: u64) -> Self {
        CacheConfig {
            eviction: EvictionPolicy::Lru,
            alpha: AlphaMode::Fixed(0.0),
            min_branch_depth: 0,
            superseded_age: 0.0,
            ..Self::marconi(model, capacity_bytes)
        }
    }

    /// The vLLM+ baseline: a state every `block_size` tokens, LRU eviction.
    pub fn vllm_plus(model: ModelSpec, capacity_bytes: u64, block_size: u32) -> Self {
        CacheConfig {
            admission: AdmissionPolicy::AllBlocks { block_size },
            ..Self::sglang_plus(model, capacity_bytes)
        }
    }

    /// The ceiling: unbounded capacity and a usable state at every token.
    pub fn oracle(model: ModelSpec) -> Self {
        CacheConfig {
            admission: AdmissionPolicy::Oracle,
            ..Self::sglang_plus(model, u64::MAX)
        }
    }

    /// Checks the configuration; every [`crate::PrefixCache`] constructor calls it.
    pub fn validate(&self) -> Result<(), CacheError> {
        let bad = |s: String| Err(CacheError::InvalidConfig(s));
        if let Err(e) = self.model.validate() {
            return bad(format!("model {:?}: {e}", self.model.name));
        }
        if self.capacity_bytes == 0 {
            return bad("capacity_bytes is 0".into());
        }
        if self.page_size == 0 {
            return bad("page_size is 0".into());
        }
        if self.checkpoint_grid == 0 {
            return bad("checkpoint_grid is 0 (use 1 for exact positions)".into());
        }
        if let AdmissionPolicy::AllBlocks { block_size } = self.admission {
            if block_size == 0 || block_size % self.page_size != 0 {
                return bad(format!(
                    "block_size {block_size} must be a positive multiple of page_size {}",
                    self.page_size
                ));
            }
        }
        if !self.superseded_age.is_finite() || self.superseded_age < 0.0 {
            return bad(format!(
                "superseded_age {} must be finite and >= 0",
                self.superseded_age
            ));
        }
        match &self.alpha {
            AlphaMode::Fixed(a) if !a.is_finite() || *a < 0.0 => {
                bad(format!("alpha {a} must be finite and >= 0"))
            }
            AlphaMode::Auto(t) => {
                if t.grid.is_empty() || t.grid.iter().any(|a| !a.is_finite() || *a < 0.0) {
                    return bad("tuner grid must be non-empty, finite and >= 0".into());
                }
                if t.bootstrap_factor == 0 || t.min_window == 0 || t.retune_every == 0 {
                    return bad("tuner windows must be > 0".into());
                }
                if !t.min_gain.is_finite() || t.min_gain < 0.0 {
                    return bad("tuner min_gain must be finite and >= 0".into());
                }
                if let Some(s) = &t.shadows {
                    if s.alphas.iter().any(|a| !a.is_finite() || *a < 0.0) {
                        return bad("shadow alphas must be finite and >= 0".into());
                    }
                    if s.alphas.is_empty() && !s.tuned && !s.lru {
                        return bad("shadows need at least one rule set".into());
                    }
                    if !s.hysteresis.is_finite() || s.hysteresis < 0.0 {
                        return bad("shadow hysteresis must be finite and >= 0".into());
                    }
                    if s.exact_bytes == 0 || s.sample_tokens == 0 {
                        return bad("shadow exact_bytes and sample_tokens must be > 0".into());
                    }
                }
                Ok(())
            }
            AlphaMode::Fixed(_) => Ok(()),
        }
    }
}
