//! The cache configuration as C sees it: a model description, a versioned
//! config struct (it carries its own size), and the policy enums.

use std::ffi::{c_char, CStr};

use marconi_core::{
    AdmissionPolicy, AlphaAdoption, AlphaMode, CacheConfig, EvictionPolicy, ModelSpec, TunerConfig,
    TuningObjective,
};

use crate::status::{boundary, check_ptr, in_slice, marconi_status, require, FfiError, FfiResult};

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

    pub(crate) fn to_core(self, name: &str) -> ModelSpec {
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
    /// Relative gain over alpha = 0 a non-zero alpha must reach. Default 0.001.
    pub tuner_min_gain: f64,
    /// A marconi_alpha_adoption value. Default MARCONI_ALPHA_ADOPTION_WHEN_READY
    /// (also for callers built against the first version of this struct).
    /// Added in version 2 of the struct.
    pub tuner_adoption: u32,
    /// Reserved, must be 0. Added in version 2 of the struct.
    pub reserved2: u32,
}

/// The size of the first version of marconi_cache_config (up to
/// tuner_min_gain): the smallest struct_size accepted. Fields after it take
/// their defaults when a caller's struct is shorter.
const CONFIG_V1_SIZE: usize = std::mem::offset_of!(marconi_cache_config, tuner_adoption);

impl marconi_cache_config {
    fn defaults() -> Self {
        let tuner = TunerConfig::default();
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
        }
    }
}

fn bad_config(detail: String) -> FfiError {
    FfiError::new(marconi_status::InvalidConfig, detail)
}

/// Reads a caller's config (any struct_size this library accepts) into the
/// current layout, filling fields the caller's version lacks with defaults.
///
/// # Safety
///
/// `cfg` is non-NULL, aligned, and points to at least `struct_size` readable
/// bytes, where struct_size is its first field.
pub(crate) unsafe fn read_config(
    cfg: *const marconi_cache_config,
) -> FfiResult<marconi_cache_config> {
    // SAFETY: cfg is non-NULL and aligned (checked by the caller) and every
    // version of the struct starts with the u32 struct_size.
    let size = unsafe { cfg.cast::<u32>().read() } as usize;
    if size < CONFIG_V1_SIZE {
        return Err(FfiError::new(
            marconi_status::UnsupportedStructSize,
            format!(
                "config struct_size is {size}, smaller than the first version ({CONFIG_V1_SIZE}); use marconi_cache_config_init"
            ),
        ));
    }
    let ours = std::mem::size_of::<marconi_cache_config>();
    if size > ours {
        // SAFETY: the caller's struct has `size` readable bytes.
        let extra = unsafe { std::slice::from_raw_parts(cfg.cast::<u8>().add(ours), size - ours) };
        if extra.iter().any(|&b| b != 0) {
            return Err(FfiError::new(
                marconi_status::UnsupportedStructSize,
                format!(
                    "config struct_size is {size} and sets fields this library ({} bytes) does not know",
                    ours
                ),
            ));
        }
    }
    if size < ours {
        // An older caller: its fields over the defaults of the rest.
        let mut out = marconi_cache_config::defaults();
        // SAFETY: the caller's struct has `size` readable bytes, `out` has
        // `ours` > size writable ones, and every field is plain data (any
        // bit pattern of the caller's fields is a valid value).
        unsafe {
            std::ptr::copy_nonoverlapping(
                cfg.cast::<u8>(),
                std::ptr::addr_of_mut!(out).cast::<u8>(),
                size,
            );
        }
        return Ok(out);
    }
    // SAFETY: size >= ours, so a whole current struct is readable.
    Ok(unsafe { cfg.read() })
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
    if c.alpha_mode == marconi_alpha_mode::Auto as u32 {
        require!(tuner_grid, len = c.tuner_grid_len);
    }
    if c.reserved != 0 || c.reserved2 != 0 || c.model.reserved != 0 {
        return Err(bad_config("reserved fields must be 0".into()));
    }
    let model = if c.model_preset.is_null() {
        c.model.to_core("custom")
    } else {
        // SAFETY: model_preset is non-NULL and, by contract, NUL-terminated.
        let name = unsafe { CStr::from_ptr(c.model_preset) };
        let name = name.to_str().map_err(|_| {
            FfiError::new(marconi_status::UnknownPreset, "model_preset is not UTF-8")
        })?;
        ModelSpec::preset(name).ok_or_else(|| {
            FfiError::new(
                marconi_status::UnknownPreset,
                format!(
                    "unknown model preset {name:?} (known: {})",
                    marconi_core::PRESET_NAMES.join(", ")
                ),
            )
        })?
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
                retune: c.tuner_retune != 0,
                objective,
                min_gain: c.tuner_min_gain,
                retune_neighbours: c.tuner_retune_neighbours,
                ..TunerConfig::default()
            };
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
    cfg.validate()?;
    Ok(cfg)
}

/// Fills `*cfg` with the defaults (documented per field) and sets
/// `cfg->struct_size`. `struct_size` is the caller's
/// sizeof(marconi_cache_config); only that many bytes are written. Set
/// capacity_bytes (and the model) afterwards.
///
/// Thread safety: touches only `*cfg`.
///
/// # Safety
///
/// `cfg` is NULL or points to `struct_size` writable bytes.
#[no_mangle]
pub unsafe extern "C" fn marconi_cache_config_init(
    cfg: *mut marconi_cache_config,
    struct_size: usize,
) -> marconi_status {
    boundary("marconi_cache_config_init", || {
        check_ptr!(cfg);
        let ours = std::mem::size_of::<marconi_cache_config>();
        if struct_size < CONFIG_V1_SIZE || struct_size > u32::MAX as usize {
            return Err(FfiError::new(
                marconi_status::UnsupportedStructSize,
                format!("struct_size {struct_size} is smaller than the first version ({CONFIG_V1_SIZE})"),
            ));
        }
        let mut d = marconi_cache_config::defaults();
        d.struct_size = struct_size as u32;
        let written = struct_size.min(ours);
        // SAFETY: cfg has struct_size writable bytes (caller contract): an
        // older caller gets the first struct_size bytes of the defaults; a
        // newer one gets all of them and its tail past our fields is zeroed
        // so that its unknown fields read as "not set".
        unsafe {
            std::ptr::copy_nonoverlapping(
                std::ptr::addr_of!(d).cast::<u8>(),
                cfg.cast::<u8>(),
                written,
            );
            std::ptr::write_bytes(cfg.cast::<u8>().add(written), 0, struct_size - written);
        }
        Ok(())
    })
}

/// Writes the dimensions of the model preset `name` (NUL-terminated:
/// "paper-7b", "paper-7b-attn", "paper-7b-ssm", "jamba-1.5-mini",
/// "nemotron-h-8b") into `*out`. MARCONI_STATUS_UNKNOWN_PRESET for any other
/// name.
///
/// Thread safety: touches only `*out`.
///
/// # Safety
///
/// `name` is NULL or a NUL-terminated string; `out` is NULL or writable.
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
        let n = unsafe { CStr::from_ptr(name) }.to_string_lossy();
        let m = ModelSpec::preset(&n).ok_or_else(|| {
            FfiError::new(
                marconi_status::UnknownPreset,
                format!(
                    "unknown model preset {n:?} (known: {})",
                    marconi_core::PRESET_NAMES.join(", ")
                ),
            )
        })?;
        // SAFETY: out is non-NULL and aligned (checked) and writable by contract.
        unsafe { out.write(marconi_model_spec::from_core(&m)) };
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let mut c = unsafe { read_config(cfg) }.unwrap();
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
}
