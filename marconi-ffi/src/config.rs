//! The cache configuration as C sees it: a model description, a versioned
//! config struct (it carries its own size), and the policy enums.

use std::ffi::{c_char, CStr};

use marconi_core::{
    AdmissionPolicy, AlphaAdoption, AlphaMode, CacheConfig, EvictionPolicy, ModelSpec,
    ShadowConfig, TunerConfig, TuningObjective,
};

use crate::status::{
    boundary, check_ptr, in_slice, init_struct, init_struct_as, marconi_status, require, versioned,
    FfiError, FfiResult,
};

/// Which recurrent states the cache asks for and accepts
/// (values of marconi_cache_config.admission).
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum marconi_admission {
    /// Marconi's judicious admission: a state at the branch point found by
    /// speculative insertion, and the final state.
    Marconi = 0,
    /// A state every block_size tokens (the vLLM+ baseline).
    AllBlocks = 1,
    /// Every position is usable and no state bytes are charged (a ceiling
    /// for measurements, with an unbounded capacity).
    Oracle = 2,
}

/// Which entries are evicted first (values of marconi_cache_config.eviction).
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum marconi_eviction {
    /// Least recently used leaf first (the SGLang+ baseline).
    Lru = 0,
    /// Marconi's FLOP-aware eviction: recency + alpha * FLOP efficiency.
    FlopAware = 1,
}

/// How alpha is chosen (values of marconi_cache_config.alpha_mode).
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum marconi_alpha_mode {
    /// alpha is marconi_cache_config.alpha.
    Fixed = 0,
    /// alpha is tuned online (the tuner_* fields).
    Auto = 1,
}

/// What alpha tuning maximises (values of marconi_cache_config.tuner_objective).
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum marconi_tuning_objective {
    /// Prefill FLOPs saved.
    FlopsSaved = 0,
    /// Tokens hit.
    TokenHits = 1,
}

/// When the result of a background alpha search is adopted (values of
/// marconi_cache_config.tuner_adoption).
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum marconi_alpha_adoption {
    /// By the first request that finds the search done; no request ever
    /// waits for tuning (engines). The default.
    WhenReady = 0,
    /// Exactly a fixed number of requests after the window closed,
    /// waiting for the search there: the same trace gives the same decisions
    /// on any machine (replays that are compared, tests). The adopting
    /// request can stall for the rest of the search: on a large cache, seconds.
    Deterministic = 1,
}

/// A model's layer composition and dimensions (see marconi-core's ModelSpec
/// for the meaning and the FLOP and byte formulas). Fill it field by field, or
/// from a preset with marconi_model_spec_preset.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct marconi_model_spec {
    /// Attention layers (each keeps a KV cache).
    pub attn_layers: u32,
    /// Recurrent layers (Mamba/SSM, linear attention), each with one state.
    pub ssm_layers: u32,
    /// Dense MLP layers.
    pub mlp_layers: u32,
    /// MoE MLP layers.
    pub moe_layers: u32,
    /// Experts run per token in a MoE layer.
    pub moe_top_k: u32,
    /// Reserved, must be 0.
    pub reserved: u32,
    /// Hidden size D.
    pub d_model: u64,
    /// Query heads of an attention layer.
    pub n_heads: u64,
    /// KV heads of an attention layer (grouped-query attention).
    pub kv_heads: u64,
    /// Dimension of one attention head.
    pub head_dim: u64,
    /// Inner size of one MLP or expert.
    pub ffn_dim: u64,
    /// Weight matrices of one MLP: 2 (plain) or 3 (gated).
    pub ffn_matrices: u64,
    /// Inner width E of an SSM mixer (expand * D).
    pub ssm_inner: u64,
    /// State size N of an SSM layer.
    pub d_state: u64,
    /// Channels of the recurrent state tensor (ssm_state_channels * N numbers).
    pub ssm_state_channels: u64,
    /// Channels of the causal-conv state.
    pub conv_channels: u64,
    /// Columns of conv state per channel (the conv kernel width).
    pub conv_kernel: u64,
    /// Bytes per KV element.
    pub dtype_bytes: u64,
    /// Bytes per recurrent-state element.
    pub state_dtype_bytes: u64,
}

impl marconi_model_spec {
    pub(crate) fn from_core(m: &ModelSpec) -> Self {
        marconi_model_spec {
            attn_layers: m.attn_layers,
            ssm_layers: m.ssm_layers,
            mlp_layers: m.mlp_layers,
            moe_layers: m.moe_layers,
            moe_top_k: m.moe_top_k,
            reserved: 0,
            d_model: m.d_model,
            n_heads: m.n_heads,
            kv_heads: m.kv_heads,
            head_dim: m.head_dim,
            ffn_dim: m.ffn_dim,
            ffn_matrices: m.ffn_matrices,
            ssm_inner: m.ssm_inner,
            d_state: m.d_state,
            ssm_state_channels: m.ssm_state_channels,
            conv_channels: m.conv_channels,
            conv_kernel: m.conv_kernel,
            dtype_bytes: m.dtype_bytes,
            state_dtype_bytes: m.state_dtype_bytes,
        }
    }

    /// The core's model spec of these dimensions, named `name`: what a
    /// cache or a plan built from this struct runs on.
    pub fn to_core(self, name: &str) -> ModelSpec {
        ModelSpec {
            name: name.to_owned(),
            attn_layers: self.attn_layers,
            ssm_layers: self.ssm_layers,
            mlp_layers: self.mlp_layers,
            moe_layers: self.moe_layers,
            moe_top_k: self.moe_top_k,
            d_model: self.d_model,
            n_heads: self.n_heads,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            ffn_dim: self.ffn_dim,
            ffn_matrices: self.ffn_matrices,
            ssm_inner: self.ssm_inner,
            d_state: self.d_state,
            ssm_state_channels: self.ssm_state_channels,
            conv_channels: self.conv_channels,
            conv_kernel: self.conv_kernel,
            dtype_bytes: self.dtype_bytes,
            state_dtype_bytes: self.state_dtype_bytes,
        }
    }
}

/// Everything a cache is built from. Versioned by size: set struct_size to
/// sizeof(marconi_cache_config) (marconi_cache_config_init does), so that a
/// later library that appends fields still reads an older caller's struct
/// (missing fields take their defaults). Initialise it with
/// marconi_cache_config_init, then change what you need.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct marconi_cache_config {
    /// sizeof(marconi_cache_config) as the caller compiled it.
    pub struct_size: u32,
    /// Tokens per KV page: cached lengths and split points are multiples of
    /// it. Default 1.
    pub page_size: u32,
    /// NUL-terminated preset name ("paper-7b", "jamba-1.5-mini", ...; see
    /// marconi_model_spec_preset), or NULL to use `model`. Read only during
    /// marconi_cache_new. Default NULL.
    pub model_preset: *const c_char,
    /// The model, used when model_preset is NULL. Default: the "paper-7b"
    /// preset's numbers.
    pub model: marconi_model_spec,
    /// Byte budget for KV and states together; must be > 0. Default 0, so it
    /// must be set.
    pub capacity_bytes: u64,
    /// A checkpoint inside a prefill is rounded down to a multiple of it (the
    /// chunk size of chunked state passing; 1 = exact). Default 1.
    pub checkpoint_grid: u32,
    /// A marconi_admission value. Default MARCONI_ADMISSION_MARCONI.
    pub admission: u32,
    /// Tokens per block for MARCONI_ADMISSION_ALL_BLOCKS (a multiple of
    /// page_size). Default 32.
    pub block_size: u32,
    /// A marconi_eviction value. Default MARCONI_EVICTION_FLOP_AWARE.
    pub eviction: u32,
    /// A marconi_alpha_mode value. Default MARCONI_ALPHA_MODE_AUTO.
    pub alpha_mode: u32,
    /// Non-zero: keep a decision log (marconi_cache_drain_log). Default 0.
    pub decision_log: u32,
    /// Non-zero (FLOP-aware eviction): a node that has ever had two children
    /// loses its state only once it is a leaf, not as soon as it is down to
    /// one child; 0 reproduces the paper's rule exactly. Default 1.
    pub protect_branch_states: u32,
    /// Reserved, must be 0.
    pub reserved: u32,
    /// alpha for MARCONI_ALPHA_MODE_FIXED (finite, >= 0). Default 0.
    pub alpha: f64,
    /// Candidate alphas for auto tuning, or NULL for the default grid
    /// 0.0, 0.1, ..., 2.0. Read only during marconi_cache_new.
    pub tuner_grid: *const f64,
    /// Length of tuner_grid (0 with NULL).
    pub tuner_grid_len: usize,
    /// Tuning window as a multiple of the requests before the first
    /// eviction. Default 5.
    pub tuner_bootstrap_factor: u32,
    /// Smallest tuning window, in requests. Default 16.
    pub tuner_min_window: u32,
    /// Non-zero: keep retuning on later windows. Default 1.
    pub tuner_retune: u32,
    /// A marconi_tuning_objective value. Default MARCONI_TUNING_OBJECTIVE_FLOPS_SAVED.
    pub tuner_objective: u32,
    /// Threads for the grid search (0: one per core). Default 0.
    pub tuner_threads: u32,
    /// On windows after the first, replay only alpha = 0, the current alpha
    /// and this many nearest grid values on each side (0: the whole grid
    /// every window). Default 2.
    pub tuner_retune_neighbours: u32,
    /// Relative gain over alpha = 0, on the tuning window's own score, that
    /// a non-zero alpha must reach. Default 0.
    pub tuner_min_gain: f64,
    /// A marconi_alpha_adoption value. Default MARCONI_ALPHA_ADOPTION_WHEN_READY
    /// (also for callers built against the first version of this struct).
    /// Added in version 2 of the struct.
    pub tuner_adoption: u32,
    /// Reserved, must be 0. Added in version 2 of the struct.
    pub reserved2: u32,
    /// Longest tuning window, in requests (0: no limit, the paper's rule);
    /// the bootstrap window is otherwise 5x the requests before the first
    /// eviction, longer than a workload phase on a large cache. Default 0.
    /// Added in version 3 of the struct (as every field below).
    pub tuner_max_window: u32,
    /// Retune on one window out of this many (> 0). Default 4.
    pub tuner_retune_every: u32,
    /// With MARCONI_ALPHA_ADOPTION_DETERMINISTIC, a search's alpha is
    /// adopted this many requests after its window closed (0: searched in
    /// the request that closes it). Default 16.
    pub tuner_apply_after: u32,
    /// Non-zero: each tuning round also tries protect_branch_states flipped
    /// and plain LRU, and adopts the best rules with the best alpha.
    /// Default 1 (0 in earlier versions of this header; the
    /// "marconi-paper" and "marconi-shadow" presets set 0). Ignored with a
    /// fixed alpha.
    pub tuner_tune_rules: u32,
    /// Non-zero: the eviction rules and alpha are chosen by shadow caches
    /// (the shadow_* fields) instead of the window tuner. Needs
    /// MARCONI_ALPHA_MODE_AUTO. Default 0.
    pub shadows: u32,
    /// Non-zero: a shadow per protect_branch_states whose alpha is tuned by
    /// the window tuner (the tuner_* fields). Default 1.
    pub shadow_tuned: u32,
    /// Non-zero: also a shadow with plain LRU. Default 0.
    pub shadow_lru: u32,
    /// Half-life of a shadow's score, in requests (0: no decay). Default 200.
    pub shadow_half_life: u32,
    /// Fixed alphas of further shadows (each with protection on and off),
    /// or NULL for none (finite, >= 0). Read only during marconi_cache_new.
    /// Default NULL.
    pub shadow_alphas: *const f64,
    /// Length of shadow_alphas (0 with NULL).
    pub shadow_alphas_len: usize,
    /// Relative lead a shadow's score needs over the rules in force to be
    /// adopted (finite, >= 0). Default 0.
    pub shadow_hysteresis: f64,
    /// Capacity up to which the shadows see every request; above, they see
    /// a hashed sample at a scaled capacity (> 0). Default 16 GiB.
    pub shadow_exact_bytes: u64,
    /// Leading tokens hashed to sample a request (> 0). Default 64.
    pub shadow_sample_tokens: u32,
    /// The shallowest prefix treated as shared, in tokens: Marconi
    /// admission plans no branch checkpoint shallower and
    /// protect_branch_states protects no branch point shallower (0: every
    /// branch point, the paper's rule, as the marconi-paper and sglang-plus
    /// presets set). Default 16: on real conversations most branch points
    /// are the first tokens unrelated prompts share by chance, not worth a
    /// whole state.
    pub min_branch_depth: u32,
    /// FLOP-aware eviction: a superseded state (the leaf a request resumed
    /// from, once the request's own chain is admitted below it) counts as
    /// this many mean turn gaps older than its last use (finite, >= 0; 0:
    /// the paper's rule, as the marconi-paper and sglang-plus presets set).
    /// Default 1. Added in version 4 of the struct.
    pub superseded_age: f64,
    /// The lower tiers (host, store) below this cache, or NULL for none
    /// (the default). Initialise them with marconi_tier_options_init; read
    /// only during marconi_cache_new. With tiers, every marconi_cache_* call
    /// works on the device tier as without, and the tier calls
    /// (marconi_cache_lookup_tiered, marconi_cache_lease_loads,
    /// marconi_cache_drain_ops, ...) are available. Added in version 5 of
    /// the struct: a caller whose struct ends before it gets NULL.
    pub tiers: *const crate::tiered::marconi_tier_options,
    /// The memory the cache lives in: NULL (the default) for ids the engine
    /// owns (KV page ids and state slot ids passed to marconi_cache_admit),
    /// or the library's pools (initialise them with
    /// marconi_pool_config_init; read only during marconi_cache_new). With
    /// pools, capacity_bytes is ignored (the pools' budget is the
    /// capacity), the model must have recurrent layers, and the request
    /// cycle runs over pool handles: marconi_cache_lookup_pooled,
    /// marconi_cache_reserve, marconi_cache_admit_pooled,
    /// marconi_cache_free_units, marconi_cache_drain_freed_units, ...; the
    /// calls that take engine ids refuse with MARCONI_STATUS_UNSUPPORTED.
    /// With pools and tiers, the tiers are written through
    /// (MARCONI_TIER_WRITE_THROUGH; write-back or defer_moves is
    /// MARCONI_STATUS_INVALID_CONFIG: an eviction's copy would read units
    /// the same marconi_cache_reserve hands out): marconi_cache_lookup_pooled
    /// gives the hit of every tier, marconi_cache_lease_loads its loads, and
    /// marconi_cache_drain_ops the writes of each admission (see there).
    /// Added in version 6 of the struct: a caller whose struct ends before
    /// it gets NULL.
    pub pools: *const crate::pool::marconi_pool_config,
}

/// The size of the first version of marconi_cache_config (up to
/// tuner_min_gain): the smallest struct_size accepted. Fields after it take
/// their defaults when a caller's struct is shorter.
const CONFIG_V1_SIZE: usize = std::mem::offset_of!(marconi_cache_config, tuner_adoption);
versioned!(marconi_cache_config, CONFIG_V1_SIZE);

/// The size of version 2 (up to reserved2): fields from tuner_max_window on
/// take their defaults when a caller's struct is this short.
#[cfg(test)]
const CONFIG_V2_SIZE: usize = std::mem::offset_of!(marconi_cache_config, tuner_max_window);

/// The size of version 5 (up to tiers): pools takes its default (NULL)
/// when a caller's struct is this short.
#[cfg(test)]
const CONFIG_V5_SIZE: usize = std::mem::offset_of!(marconi_cache_config, pools);

/// The size of version 4 (up to superseded_age): tiers takes its default
/// (NULL) when a caller's struct is this short.
#[cfg(test)]
const CONFIG_V4_SIZE: usize = std::mem::offset_of!(marconi_cache_config, tiers);

/// The size of version 3 (up to min_branch_depth): superseded_age takes its
/// default when a caller's struct is this short.
#[cfg(test)]
const CONFIG_V3_SIZE: usize = std::mem::offset_of!(marconi_cache_config, superseded_age);

impl marconi_cache_config {
    fn defaults() -> Self {
        let tuner = TunerConfig::default();
        let shadow = ShadowConfig::default();
        let model = ModelSpec::preset("paper-7b").expect("built-in preset");
        let base = CacheConfig::marconi(model.clone(), 1);
        marconi_cache_config {
            struct_size: std::mem::size_of::<marconi_cache_config>() as u32,
            page_size: 1,
            model_preset: std::ptr::null(),
            model: marconi_model_spec::from_core(&model),
            capacity_bytes: 0,
            checkpoint_grid: 1,
            admission: marconi_admission::Marconi as u32,
            block_size: 32,
            eviction: marconi_eviction::FlopAware as u32,
            alpha_mode: marconi_alpha_mode::Auto as u32,
            decision_log: 0,
            protect_branch_states: u32::from(base.protect_branch_states),
            reserved: 0,
            alpha: 0.0,
            tuner_grid: std::ptr::null(),
            tuner_grid_len: 0,
            tuner_bootstrap_factor: tuner.bootstrap_factor,
            tuner_min_window: tuner.min_window,
            tuner_retune: u32::from(tuner.retune),
            tuner_objective: marconi_tuning_objective::FlopsSaved as u32,
            tuner_threads: tuner.threads,
            tuner_retune_neighbours: tuner.retune_neighbours,
            tuner_min_gain: tuner.min_gain,
            tuner_adoption: marconi_alpha_adoption::WhenReady as u32,
            reserved2: 0,
            tuner_max_window: tuner.max_window,
            tuner_retune_every: tuner.retune_every,
            tuner_apply_after: tuner.apply_after,
            tuner_tune_rules: u32::from(tuner.tune_rules),
            shadows: u32::from(tuner.shadows.is_some()),
            shadow_tuned: u32::from(shadow.tuned),
            shadow_lru: u32::from(shadow.lru),
            shadow_half_life: shadow.half_life,
            shadow_alphas: std::ptr::null(),
            shadow_alphas_len: 0,
            shadow_hysteresis: shadow.hysteresis,
            shadow_exact_bytes: shadow.exact_bytes,
            shadow_sample_tokens: shadow.sample_tokens,
            min_branch_depth: base.min_branch_depth,
            superseded_age: base.superseded_age,
            tiers: std::ptr::null(),
            pools: std::ptr::null(),
        }
    }

    /// Sets the policy fields (admission, eviction, alpha, tuning, shadows,
    /// protect_branch_states) to those of `cfg`, a core preset; the model,
    /// capacity, page size, checkpoint grid, decision log and tuner_adoption
    /// are kept. Presets use the default alpha grid and no fixed shadow
    /// alphas (what NULL grids mean here).
    fn set_policy(&mut self, cfg: &CacheConfig) {
        let (admission, block_size) = match cfg.admission {
            AdmissionPolicy::Marconi => (marconi_admission::Marconi, self.block_size),
            AdmissionPolicy::AllBlocks { block_size } => (marconi_admission::AllBlocks, block_size),
            AdmissionPolicy::Oracle => (marconi_admission::Oracle, self.block_size),
        };
        self.admission = admission as u32;
        self.block_size = block_size;
        self.eviction = match cfg.eviction {
            EvictionPolicy::Lru => marconi_eviction::Lru,
            EvictionPolicy::FlopAware => marconi_eviction::FlopAware,
        } as u32;
        self.protect_branch_states = u32::from(cfg.protect_branch_states);
        self.min_branch_depth = cfg.min_branch_depth;
        self.superseded_age = cfg.superseded_age;
        let t = match &cfg.alpha {
            AlphaMode::Fixed(a) => {
                self.alpha_mode = marconi_alpha_mode::Fixed as u32;
                self.alpha = *a;
                return;
            }
            AlphaMode::Auto(t) => t,
        };
        debug_assert_eq!(
            t.grid,
            TunerConfig::default().grid,
            "presets use the default grid"
        );
        self.alpha_mode = marconi_alpha_mode::Auto as u32;
        self.tuner_grid = std::ptr::null();
        self.tuner_grid_len = 0;
        self.tuner_bootstrap_factor = t.bootstrap_factor;
        self.tuner_min_window = t.min_window;
        self.tuner_max_window = t.max_window;
        self.tuner_retune = u32::from(t.retune);
        self.tuner_retune_neighbours = t.retune_neighbours;
        self.tuner_retune_every = t.retune_every;
        self.tuner_objective = match t.objective {
            TuningObjective::FlopsSaved => marconi_tuning_objective::FlopsSaved,
            TuningObjective::TokenHits => marconi_tuning_objective::TokenHits,
        } as u32;
        self.tuner_apply_after = t.apply_after;
        self.tuner_min_gain = t.min_gain;
        self.tuner_threads = t.threads;
        self.tuner_tune_rules = u32::from(t.tune_rules);
        self.shadows = u32::from(t.shadows.is_some());
        let sh = t.shadows.clone().unwrap_or_default();
        debug_assert!(sh.alphas.is_empty(), "presets have no fixed shadow alphas");
        self.shadow_tuned = u32::from(sh.tuned);
        self.shadow_lru = u32::from(sh.lru);
        self.shadow_half_life = sh.half_life;
        self.shadow_alphas = std::ptr::null();
        self.shadow_alphas_len = 0;
        self.shadow_hysteresis = sh.hysteresis;
        self.shadow_exact_bytes = sh.exact_bytes;
        self.shadow_sample_tokens = sh.sample_tokens;
    }
}

/// A core preset: the configuration for a model under a capacity.
type PresetFn = fn(ModelSpec, u64) -> CacheConfig;

/// The policy presets marconi_cache_config_preset knows, with the core
/// configuration each stands for.
const POLICY_PRESETS: [(&str, PresetFn); 6] = [
    ("marconi", CacheConfig::marconi),
    ("marconi-paper", CacheConfig::marconi_paper),
    ("marconi-tuned", CacheConfig::marconi_tuned),
    ("marconi-shadow", CacheConfig::marconi_shadow),
    ("sglang-plus", CacheConfig::sglang_plus),
    ("vllm-plus", |m, c| CacheConfig::vllm_plus(m, c, 32)),
];

fn bad_config(detail: String) -> FfiError {
    FfiError::new(marconi_status::InvalidConfig, detail)
}

/// Turns a C config into the core's, checking enum values and pointers. The
/// core's `validate` checks the rest when the cache is built.
///
/// # Safety
///
/// The pointers inside `c` (model_preset, tuner_grid) follow their documented
/// contracts.
pub(crate) unsafe fn to_core_config(c: &marconi_cache_config) -> FfiResult<CacheConfig> {
    // NULL first, as for arguments.
    let tuner_grid = c.tuner_grid;
    let shadow_alphas = c.shadow_alphas;
    if c.alpha_mode == marconi_alpha_mode::Auto as u32 {
        require!(tuner_grid, len = c.tuner_grid_len);
        if c.shadows != 0 {
            require!(shadow_alphas, len = c.shadow_alphas_len);
        }
    }
    if c.reserved != 0 || c.reserved2 != 0 || c.model.reserved != 0 {
        return Err(bad_config("reserved fields must be 0".into()));
    }
    let model = if c.model_preset.is_null() {
        c.model.to_core("custom")
    } else {
        // SAFETY: model_preset is non-NULL and, by contract, NUL-terminated.
        unsafe { preset_named(c.model_preset, "model_preset") }?
    };
    let admission = match c.admission {
        0 => AdmissionPolicy::Marconi,
        1 => AdmissionPolicy::AllBlocks {
            block_size: c.block_size,
        },
        2 => AdmissionPolicy::Oracle,
        v => {
            return Err(bad_config(format!(
                "admission {v} is not a marconi_admission"
            )))
        }
    };
    let eviction = match c.eviction {
        0 => EvictionPolicy::Lru,
        1 => EvictionPolicy::FlopAware,
        v => {
            return Err(bad_config(format!(
                "eviction {v} is not a marconi_eviction"
            )))
        }
    };
    let alpha = match c.alpha_mode {
        // tuner_tune_rules is on by default: ignored with a fixed alpha,
        // as the other tuner_* fields are.
        0 if c.shadows != 0 => {
            return Err(bad_config(
                "shadows needs alpha_mode MARCONI_ALPHA_MODE_AUTO (alpha is fixed)".to_string(),
            ))
        }
        0 => AlphaMode::Fixed(c.alpha),
        1 => {
            // SAFETY: tuner_grid follows the buffer contract (NULL with 0 allowed).
            let grid = unsafe { in_slice(c.tuner_grid, c.tuner_grid_len, "tuner_grid") }?;
            let objective = match c.tuner_objective {
                0 => TuningObjective::FlopsSaved,
                1 => TuningObjective::TokenHits,
                v => {
                    return Err(bad_config(format!(
                        "tuner_objective {v} is not a marconi_tuning_objective"
                    )))
                }
            };
            // Built from the core's defaults so that tuner fields this ABI
            // version does not expose keep them.
            let mut tuner = TunerConfig {
                bootstrap_factor: c.tuner_bootstrap_factor,
                min_window: c.tuner_min_window,
                max_window: c.tuner_max_window,
                retune: c.tuner_retune != 0,
                retune_every: c.tuner_retune_every,
                objective,
                apply_after: c.tuner_apply_after,
                min_gain: c.tuner_min_gain,
                retune_neighbours: c.tuner_retune_neighbours,
                tune_rules: c.tuner_tune_rules != 0,
                ..TunerConfig::default()
            };
            if c.shadows != 0 {
                // SAFETY: shadow_alphas follows the buffer contract (NULL with 0 allowed).
                let alphas =
                    unsafe { in_slice(c.shadow_alphas, c.shadow_alphas_len, "shadow_alphas") }?;
                tuner.shadows = Some(ShadowConfig {
                    alphas: alphas.to_vec(),
                    tuned: c.shadow_tuned != 0,
                    lru: c.shadow_lru != 0,
                    half_life: c.shadow_half_life,
                    hysteresis: c.shadow_hysteresis,
                    exact_bytes: c.shadow_exact_bytes,
                    sample_tokens: c.shadow_sample_tokens,
                });
            }
            if !grid.is_empty() {
                tuner.grid = grid.to_vec();
            }
            tuner.threads = c.tuner_threads;
            tuner.adoption = match c.tuner_adoption {
                0 => AlphaAdoption::WhenReady,
                1 => AlphaAdoption::Deterministic,
                v => {
                    return Err(bad_config(format!(
                        "tuner_adoption {v} is not a marconi_alpha_adoption"
                    )))
                }
            };
            AlphaMode::Auto(tuner)
        }
        v => {
            return Err(bad_config(format!(
                "alpha_mode {v} is not a marconi_alpha_mode"
            )))
        }
    };
    // Built from Marconi's configuration so that fields this ABI version does
    // not expose keep the core's defaults.
    let mut cfg = CacheConfig::marconi(model, c.capacity_bytes);
    cfg.page_size = c.page_size;
    cfg.checkpoint_grid = c.checkpoint_grid;
    cfg.admission = admission;
    cfg.eviction = eviction;
    cfg.alpha = alpha;
    cfg.decision_log = c.decision_log != 0;
    cfg.protect_branch_states = c.protect_branch_states != 0;
    cfg.min_branch_depth = c.min_branch_depth;
    cfg.superseded_age = c.superseded_age;
    cfg.validate()?;
    Ok(cfg)
}

/// Fills `*cfg` with the defaults (documented per field) and sets
/// `cfg->struct_size`. `struct_size` is the caller's
/// sizeof(marconi_cache_config); only that many bytes are written. Set
/// capacity_bytes (and the model) afterwards.
#[no_mangle]
pub unsafe extern "C" fn marconi_cache_config_init(
    cfg: *mut marconi_cache_config,
    struct_size: usize,
) -> marconi_status {
    boundary("marconi_cache_config_init", || {
        check_ptr!(cfg);
        // SAFETY: forwarded contract (cfg has struct_size writable bytes).
        unsafe { init_struct(cfg, struct_size, "cfg") }
    })
}

/// marconi_cache_config_init, then the policy fields of the named policy
/// preset: "marconi" (the defaults), "marconi-paper" (the paper's exact
/// rules: protect_branch_states 0, alpha tuned once for token hits),
/// "marconi-tuned" (tuner_tune_rules 1, tuner_max_window 100),
/// "marconi-shadow" (shadows 1 with the default shadow settings),
/// "sglang-plus" (LRU eviction, fixed alpha 0) or "vllm-plus" (a state
/// every 32 tokens, LRU). These are marconi-core's CacheConfig presets of
/// the same names, except tuner_adoption, which stays
/// MARCONI_ALPHA_ADOPTION_WHEN_READY (the core's presets adopt
/// deterministically, for simulation). Set capacity_bytes (and the model)
/// afterwards. MARCONI_STATUS_UNKNOWN_PRESET (nothing written) for any
/// other name. A struct_size of an older version gets only the fields it
/// has: a preset whose fields it lacks (marconi-paper, marconi-tuned and
/// marconi-shadow before version 3: they set tuner_tune_rules or the
/// shadows) is MARCONI_STATUS_UNSUPPORTED_STRUCT_SIZE, except
/// min_branch_depth and superseded_age, which such a caller gets at their
/// defaults (16 and 1; marconi-paper and sglang-plus set 0).
#[no_mangle]
pub unsafe extern "C" fn marconi_cache_config_preset(
    cfg: *mut marconi_cache_config,
    struct_size: usize,
    policy: *const c_char,
) -> marconi_status {
    boundary("marconi_cache_config_preset", || {
        require!(cfg);
        require!(policy);
        check_ptr!(cfg);
        check_ptr!(policy);
        // SAFETY: policy is non-NULL and NUL-terminated by contract.
        let name = unsafe { CStr::from_ptr(policy) }.to_string_lossy();
        let make = POLICY_PRESETS
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, f)| f)
            .ok_or_else(|| {
                FfiError::new(
                    marconi_status::UnknownPreset,
                    format!(
                        "unknown policy preset {name:?} (known: {})",
                        POLICY_PRESETS.map(|(n, _)| n).join(", ")
                    ),
                )
            })?;
        let mut d = marconi_cache_config::defaults();
        let model = ModelSpec::preset("paper-7b").expect("built-in preset");
        d.set_policy(&make(model, 1));
        // An older caller gets only its fields: the preset must not need
        // the others (they keep their defaults when it is read back), but
        // min_branch_depth and superseded_age, which only tune the
        // preset, are left at their defaults for a caller without them.
        let ours = std::mem::size_of::<marconi_cache_config>();
        let from = struct_size.clamp(CONFIG_V1_SIZE, ours);
        let mut lacking = marconi_cache_config::defaults();
        lacking.min_branch_depth = d.min_branch_depth;
        lacking.superseded_age = d.superseded_age;
        if config_bytes(&d)[from..] != config_bytes(&lacking)[from..] {
            return Err(FfiError::new(
                marconi_status::UnsupportedStructSize,
                format!(
                    "policy preset {name:?} needs fields a config struct of {struct_size} bytes lacks; rebuild against this marconi.h"
                ),
            ));
        }
        // SAFETY: forwarded contract (cfg has struct_size writable bytes).
        unsafe { init_struct_as(cfg, struct_size, d, "cfg") }
    })
}

/// The bytes of a config (no padding: every field is 4 or 8 bytes, in
/// 8-byte-aligned pairs; checked by a test).
fn config_bytes(c: &marconi_cache_config) -> &[u8] {
    // SAFETY: `c` is a whole, initialised struct without padding bytes.
    unsafe {
        std::slice::from_raw_parts(
            std::ptr::addr_of!(*c).cast::<u8>(),
            std::mem::size_of::<marconi_cache_config>(),
        )
    }
}

/// The model preset named by the C string `name`; MARCONI_STATUS_UNKNOWN_PRESET
/// (naming the presets) for any other name, `what` naming the argument.
///
/// # Safety
///
/// `name` is non-NULL and NUL-terminated.
pub(crate) unsafe fn preset_named(name: *const c_char, what: &str) -> FfiResult<ModelSpec> {
    // SAFETY: forwarded caller contract.
    let name = unsafe { CStr::from_ptr(name) }.to_str().map_err(|_| {
        FfiError::new(
            marconi_status::UnknownPreset,
            format!("{what} is not UTF-8"),
        )
    })?;
    ModelSpec::preset(name).ok_or_else(|| {
        FfiError::new(
            marconi_status::UnknownPreset,
            format!(
                "unknown model preset {name:?} (known: {})",
                marconi_core::PRESET_NAMES.join(", ")
            ),
        )
    })
}

/// Writes the dimensions of the model preset `name` (NUL-terminated:
/// "paper-7b", "paper-7b-attn", "paper-7b-ssm", "jamba-1.5-mini",
/// "nemotron-h-8b") into `*out`. MARCONI_STATUS_UNKNOWN_PRESET for any other
/// name.
#[no_mangle]
pub unsafe extern "C" fn marconi_model_spec_preset(
    name: *const c_char,
    out: *mut marconi_model_spec,
) -> marconi_status {
    boundary("marconi_model_spec_preset", || {
        require!(name);
        require!(out);
        check_ptr!(name);
        check_ptr!(out);
        // SAFETY: name is non-NULL and NUL-terminated by contract.
        let m = unsafe { preset_named(name, "name") }?;
        // SAFETY: out is non-NULL and aligned (checked) and writable by contract.
        unsafe { out.write(marconi_model_spec::from_core(&m)) };
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::status::read_struct;

    /// A caller built against version 1 of the struct (no tuner_adoption)
    /// gets only its bytes written by init, and engine-mode adoption.
    #[test]
    fn a_version_1_caller_gets_when_ready_adoption_and_no_write_past_its_struct() {
        let v1 = CONFIG_V1_SIZE;
        let ours = std::mem::size_of::<marconi_cache_config>();
        assert!(v1 < ours, "version 2 adds fields");
        // A v1-sized buffer inside a larger, aligned one filled with a canary.
        let mut buf = vec![u64::from_ne_bytes([0xA5; 8]); ours.div_ceil(8) + 1];
        let cfg = buf.as_mut_ptr().cast::<marconi_cache_config>();
        // SAFETY: buf has more than v1 writable, aligned bytes.
        let st = unsafe { marconi_cache_config_init(cfg, v1) };
        assert_eq!(st, marconi_status::Ok);
        let bytes: Vec<u8> = buf.iter().flat_map(|w| w.to_ne_bytes()).collect();
        assert!(
            bytes[v1..].iter().all(|&b| b == 0xA5),
            "init wrote past struct_size"
        );
        // SAFETY: the first v1 bytes were written by init; struct_size says v1.
        let mut c = unsafe { read_struct(cfg) }.unwrap();
        c.capacity_bytes = 1 << 30;
        assert_eq!(c.tuner_adoption, marconi_alpha_adoption::WhenReady as u32);
        // SAFETY: the config holds no pointers (NULL preset and grid).
        let AlphaMode::Auto(t) = unsafe { to_core_config(&c) }.unwrap().alpha else {
            panic!("alpha is tuned by default")
        };
        assert_eq!(t.adoption, AlphaAdoption::WhenReady);
    }

    #[test]
    fn adoption_values_map_and_unknown_ones_are_refused() {
        let mut c = marconi_cache_config::defaults();
        c.capacity_bytes = 1 << 30;
        c.tuner_adoption = marconi_alpha_adoption::Deterministic as u32;
        // SAFETY: the config holds no pointers (NULL preset and grid).
        let AlphaMode::Auto(t) = unsafe { to_core_config(&c) }.unwrap().alpha else {
            panic!("alpha is tuned by default")
        };
        assert_eq!(t.adoption, AlphaAdoption::Deterministic);
        c.tuner_adoption = 2;
        let e = unsafe { to_core_config(&c) }.unwrap_err();
        assert_eq!(e.status, marconi_status::InvalidConfig);
        c.tuner_adoption = 0;
        c.reserved2 = 1;
        assert!(unsafe { to_core_config(&c) }.is_err());
    }

    fn core_of(c: &marconi_cache_config) -> FfiResult<CacheConfig> {
        // SAFETY: the tests' configs hold NULL or live pointers.
        unsafe { to_core_config(c) }
    }

    /// The struct has no padding (config_bytes compares whole structs),
    /// version 3 starts right after version 2 and version 4 after 3.
    #[test]
    fn the_layout_has_no_padding() {
        let ours = std::mem::size_of::<marconi_cache_config>();
        assert_eq!(
            std::mem::offset_of!(marconi_cache_config, pools) + std::mem::size_of::<usize>(),
            ours
        );
        assert_eq!(
            std::mem::offset_of!(marconi_cache_config, tiers) + std::mem::size_of::<usize>(),
            CONFIG_V5_SIZE
        );
        assert_eq!(
            std::mem::offset_of!(marconi_cache_config, superseded_age) + 8,
            CONFIG_V4_SIZE
        );
        assert_eq!(
            std::mem::offset_of!(marconi_cache_config, min_branch_depth) + 4,
            CONFIG_V3_SIZE
        );
        assert_eq!(
            std::mem::offset_of!(marconi_cache_config, reserved2) + 4,
            CONFIG_V2_SIZE
        );
    }

    /// marconi_cache_config_init as a caller whose struct is `size` bytes
    /// (an older version) calls it: only those bytes are written; then the
    /// struct as this library reads it back (the rest at its defaults).
    fn init_as_older(size: usize) -> marconi_cache_config {
        let ours = std::mem::size_of::<marconi_cache_config>();
        let mut buf = vec![u64::from_ne_bytes([0xA5; 8]); ours.div_ceil(8) + 1];
        let cfg = buf.as_mut_ptr().cast::<marconi_cache_config>();
        // SAFETY: buf has more than `size` writable, aligned bytes.
        assert_eq!(
            unsafe { marconi_cache_config_init(cfg, size) },
            marconi_status::Ok
        );
        let bytes: Vec<u8> = buf.iter().flat_map(|w| w.to_ne_bytes()).collect();
        assert!(bytes[size..].iter().all(|&b| b == 0xA5));
        // SAFETY: init wrote the first `size` bytes.
        unsafe { read_struct(cfg) }.unwrap()
    }

    /// A caller built against version 2 gets only its bytes written and
    /// the version-3 fields' defaults (the window tuner, no shadows).
    #[test]
    fn a_version_2_caller_gets_the_tuning_defaults() {
        let mut c = init_as_older(CONFIG_V2_SIZE);
        c.capacity_bytes = 1 << 30;
        let AlphaMode::Auto(t) = core_of(&c).unwrap().alpha else {
            panic!("alpha is tuned by default")
        };
        let d = TunerConfig::default();
        assert_eq!(
            (t.max_window, t.retune_every, t.apply_after, t.tune_rules),
            (d.max_window, d.retune_every, d.apply_after, d.tune_rules)
        );
        assert_eq!(t.shadows, None);
    }

    /// Every policy preset is the core preset of the same name (with
    /// when-ready adoption); an unknown name writes nothing.
    #[test]
    fn policy_presets_are_the_core_presets() {
        let model = ModelSpec::preset("paper-7b").unwrap();
        for (name, make) in POLICY_PRESETS {
            let mut c = marconi_cache_config::defaults();
            let cname = std::ffi::CString::new(name).unwrap();
            let size = std::mem::size_of::<marconi_cache_config>();
            // SAFETY: c is a whole struct; cname is NUL-terminated.
            let st = unsafe { marconi_cache_config_preset(&mut c, size, cname.as_ptr()) };
            assert_eq!(st, marconi_status::Ok, "{name}");
            c.capacity_bytes = 5 << 30;
            let mut got = core_of(&c).unwrap();
            got.model.name = model.name.clone();
            let mut want = make(model.clone(), 5 << 30);
            if let AlphaMode::Auto(t) = &mut want.alpha {
                t.adoption = AlphaAdoption::WhenReady;
            }
            assert_eq!(got, want, "{name}");
        }
        let mut c = marconi_cache_config::defaults();
        c.page_size = 7;
        let size = std::mem::size_of::<marconi_cache_config>();
        // SAFETY: as above.
        let st = unsafe { marconi_cache_config_preset(&mut c, size, c"marconi-exact".as_ptr()) };
        assert_eq!(st, marconi_status::UnknownPreset);
        assert_eq!(c.page_size, 7, "nothing written");
    }

    /// Rule tuning is on by default and means nothing with a fixed alpha:
    /// a caller that fixes alpha on the defaults gets a fixed alpha, not
    /// INVALID_CONFIG.
    #[test]
    fn a_fixed_alpha_ignores_the_default_rule_tuning() {
        let mut c = marconi_cache_config::defaults();
        assert_eq!(c.tuner_tune_rules, 1);
        c.capacity_bytes = 1 << 30;
        c.alpha_mode = marconi_alpha_mode::Fixed as u32;
        c.alpha = 0.5;
        assert_eq!(core_of(&c).unwrap().alpha, AlphaMode::Fixed(0.5));
    }

    /// A version-2 struct can take the presets that need only its fields.
    #[test]
    fn a_short_struct_refuses_a_preset_it_cannot_hold() {
        let mut c = marconi_cache_config::defaults();
        // SAFETY: c is larger than CONFIG_V2_SIZE.
        let st = unsafe {
            marconi_cache_config_preset(&mut c, CONFIG_V2_SIZE, c"marconi-tuned".as_ptr())
        };
        assert_eq!(st, marconi_status::UnsupportedStructSize);
        // marconi-paper turns the default rule tuning off: a version-3 field.
        // SAFETY: as above.
        let st = unsafe {
            marconi_cache_config_preset(&mut c, CONFIG_V2_SIZE, c"marconi-paper".as_ptr())
        };
        assert_eq!(st, marconi_status::UnsupportedStructSize);
        // SAFETY: as above.
        let st =
            unsafe { marconi_cache_config_preset(&mut c, CONFIG_V2_SIZE, c"sglang-plus".as_ptr()) };
        assert_eq!(st, marconi_status::Ok);
        assert_eq!(c.protect_branch_states, 1);
        assert_eq!(c.alpha_mode, marconi_alpha_mode::Fixed as u32);
        assert_eq!(c.struct_size as usize, CONFIG_V2_SIZE);
    }

    /// superseded_age (version 4) maps to the core's, a NaN, infinite or
    /// negative one is refused with INVALID_CONFIG, and a caller built
    /// against version 3 gets only its bytes written and the default.
    #[test]
    fn superseded_age_maps_and_bad_values_are_refused() {
        let mut c = marconi_cache_config::defaults();
        c.capacity_bytes = 1 << 30;
        assert_eq!(
            core_of(&c).unwrap().superseded_age,
            marconi_core::DEFAULT_SUPERSEDED_AGE
        );
        c.superseded_age = 0.5;
        assert_eq!(core_of(&c).unwrap().superseded_age, 0.5);
        for bad in [f64::NAN, f64::INFINITY, -1.0] {
            c.superseded_age = bad;
            let e = core_of(&c).unwrap_err();
            assert_eq!(e.status, marconi_status::InvalidConfig, "{bad}");
        }
        let mut c = init_as_older(CONFIG_V3_SIZE);
        c.capacity_bytes = 1 << 30;
        assert_eq!(
            core_of(&c).unwrap().superseded_age,
            marconi_core::DEFAULT_SUPERSEDED_AGE
        );
    }

    /// A caller of version 4 (no `tiers` field) gets a cache without
    /// lower tiers: the field it lacks reads as NULL, whatever follows its
    /// struct in memory.
    #[test]
    fn a_version_4_caller_gets_no_tiers() {
        let c = init_as_older(CONFIG_V4_SIZE);
        assert!(c.tiers.is_null());
        assert_eq!(
            c.superseded_age,
            marconi_cache_config::defaults().superseded_age
        );
        let mut c = c;
        c.capacity_bytes = 1 << 30;
        assert_eq!(c.struct_size as usize, CONFIG_V4_SIZE);
        // Past the caller's struct: never read.
        c.tiers = std::ptr::NonNull::dangling().as_ptr();
        let mut cache = std::ptr::null_mut();
        // SAFETY: `c` is a whole current struct with struct_size set to
        // version 4's: only that much is read.
        let st = unsafe { crate::cache::marconi_cache_new(&c, &mut cache) };
        assert_eq!(st, marconi_status::Ok);
        // SAFETY: a live handle; a tier call refuses, then it is freed once.
        unsafe {
            assert_eq!(
                crate::tiered::marconi_cache_settle(cache),
                marconi_status::Unsupported
            );
            crate::cache::marconi_cache_free(cache);
        }
    }

    /// A caller of version 5 (no `pools` field) gets a cache over ids the
    /// engine owns: the field it lacks reads as NULL, whatever follows its
    /// struct in memory.
    #[test]
    fn a_version_5_caller_gets_no_pools() {
        let c = init_as_older(CONFIG_V5_SIZE);
        assert!(c.pools.is_null());
        assert!(c.tiers.is_null());
        let mut c = c;
        c.capacity_bytes = 1 << 30;
        assert_eq!(c.struct_size as usize, CONFIG_V5_SIZE);
        // Past the caller's struct: never read.
        c.pools = std::ptr::NonNull::dangling().as_ptr();
        let mut cache = std::ptr::null_mut();
        // SAFETY: `c` is a whole current struct with struct_size set to
        // version 5's: only that much is read.
        let st = unsafe { crate::cache::marconi_cache_new(&c, &mut cache) };
        assert_eq!(st, marconi_status::Ok);
        let mut free = 0u64;
        // SAFETY: a live handle; a pool call refuses, a plain one works,
        // then it is freed once.
        unsafe {
            assert_eq!(
                crate::pooled::marconi_cache_free_units(cache, std::ptr::null(), 0),
                marconi_status::Unsupported
            );
            assert_eq!(
                crate::cache::marconi_cache_evict(cache, 0, &mut free),
                marconi_status::Ok
            );
            crate::cache::marconi_cache_free(cache);
        }
    }

    /// The version-3 fields map to the core's, and bad values are refused
    /// with INVALID_CONFIG (or NULL_ARGUMENT), never accepted silently.
    #[test]
    fn tuning_fields_map_and_bad_ones_are_refused() {
        let alphas = [0.5, 1.5];
        let mut c = marconi_cache_config::defaults();
        c.capacity_bytes = 1 << 30;
        c.tuner_max_window = 300;
        c.tuner_retune_every = 2;
        c.tuner_apply_after = 0;
        c.tuner_tune_rules = 1;
        c.shadows = 1;
        c.shadow_lru = 1;
        c.shadow_half_life = 50;
        c.shadow_alphas = alphas.as_ptr();
        c.shadow_alphas_len = 2;
        c.shadow_hysteresis = 0.25;
        c.shadow_exact_bytes = 1 << 20;
        c.shadow_sample_tokens = 16;
        c.min_branch_depth = 7;
        assert_eq!(core_of(&c).unwrap().min_branch_depth, 7);
        let AlphaMode::Auto(t) = core_of(&c).unwrap().alpha else {
            panic!("auto")
        };
        assert_eq!(
            (t.max_window, t.retune_every, t.apply_after, t.tune_rules),
            (300, 2, 0, true)
        );
        assert_eq!(
            t.shadows,
            Some(ShadowConfig {
                alphas: alphas.to_vec(),
                tuned: true,
                lru: true,
                half_life: 50,
                hysteresis: 0.25,
                exact_bytes: 1 << 20,
                sample_tokens: 16,
            })
        );
        let refused = |f: &dyn Fn(&mut marconi_cache_config)| {
            let mut b = c;
            f(&mut b);
            core_of(&b).unwrap_err()
        };
        let e = refused(&|b| b.shadow_alphas = std::ptr::null());
        assert_eq!(e.status, marconi_status::NullArgument);
        for (what, f) in [
            (
                "retune_every",
                &(|b: &mut marconi_cache_config| b.tuner_retune_every = 0)
                    as &dyn Fn(&mut marconi_cache_config),
            ),
            ("hysteresis", &|b| b.shadow_hysteresis = f64::NAN),
            ("negative hysteresis", &|b| b.shadow_hysteresis = -1.0),
            ("sample_tokens", &|b| b.shadow_sample_tokens = 0),
            ("exact_bytes", &|b| b.shadow_exact_bytes = 0),
            ("no rule set", &|b| {
                b.shadow_alphas_len = 0;
                b.shadow_tuned = 0;
                b.shadow_lru = 0;
            }),
            ("shadows with a fixed alpha", &|b| b.alpha_mode = 0),
        ] {
            let e = refused(f);
            assert_eq!(
                e.status,
                marconi_status::InvalidConfig,
                "{what}: {}",
                e.detail
            );
        }
        let negative = [-0.5];
        let e = refused(&|b| {
            b.shadow_alphas = negative.as_ptr();
            b.shadow_alphas_len = 1;
        });
        assert_eq!(e.status, marconi_status::InvalidConfig, "{}", e.detail);
        // Shadows off: the shadow fields are not read.
        let mut off = c;
        off.shadows = 0;
        off.shadow_alphas = std::ptr::null();
        off.shadow_sample_tokens = 0;
        let AlphaMode::Auto(t) = core_of(&off).unwrap().alpha else {
            panic!("auto")
        };
        assert_eq!(t.shadows, None);
    }
}
