//! A [`ModelSpec`] read from a Hugging Face `config.json`, so that an engine
//! never types a model's dimensions by hand.
//!
//! Pure: the caller reads the file; this module parses the text. The layer
//! pattern of each hybrid family gives the layer counts, the family's field
//! names give the dimensions, and `torch_dtype` (or `dtype`) the element
//! width.
//!
//! | `model_type` | layer pattern | recurrent layers |
//! | --- | --- | --- |
//! | `nemotron_h` | `hybrid_override_pattern`: `M` Mamba-2, `*` attention, `-` MLP, `E` MoE (or transformers 5's `layers_block_type` list) | Mamba-2 |
//! | `bamba` | `attn_layer_indices`; every layer has a gated MLP | Mamba-2 |
//! | `granitemoehybrid` | `layer_types` (`mamba` / `attention`); every layer has a MoE and a shared MLP | Mamba-2 |
//! | `falcon_h1` | every layer runs attention and Mamba-2 in parallel, then a gated MLP | Mamba-2 |
//! | `zamba2` | `layers_block_type`: every layer is Mamba-2, `hybrid` ones also run the shared attention block | Mamba-2 |
//! | `jamba` | `attn_layer_period`/`_offset`, `expert_layer_period`/`_offset` | Mamba-1 |
//! | `mamba2`, `mamba` | every layer recurrent, no attention | Mamba-2, Mamba-1 |
//!
//! Layer lists accept the old names (`mamba`, `attention`) and transformers
//! 5's (`linear_attention`, `full_attention`). A config that nests the language model (`text_config`) is read from
//! there. The byte formulas this feeds are [`ModelSpec::kv_bytes_per_token`]
//! and [`ModelSpec::state_bytes`]: K and V of `kv_heads · head_dim` per
//! attention layer and token; per recurrent layer, the SSM state
//! (`heads · head_dim · d_state`, Mamba-1: `inner · d_state`) plus the conv
//! state (`(inner + 2 · groups · d_state) · conv_kernel`, Mamba-1:
//! `inner · conv_kernel`), all in the config's dtype, which is what
//! transformers' caches hold.
//!
//! FLOPs: a MoE layer's work is folded into `ffn_dim` (routed experts run
//! per token plus shared experts, as one MLP of that width) when the model
//! has no dense MLP of another width; otherwise `moe_top_k` is the number of
//! dense-MLP equivalents a MoE layer runs, rounded. Only the FLOP estimate
//! depends on this, never a byte size.

use serde_json::{Map, Value};

use crate::model::{dims, ModelSpec};

/// Why a `config.json` could not be turned into a [`ModelSpec`].
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum HfConfigError {
    /// The text is not a JSON object.
    #[error("config.json is not valid JSON: {0}")]
    Json(String),
    /// `model_type` is missing or names a family this module does not read.
    #[error("unsupported model_type {0:?} (supported: {supported})", supported = HF_MODEL_TYPES.join(", "))]
    UnsupportedModelType(String),
    /// A field the family needs is absent (or null).
    #[error("{model_type}: field {field:?} is missing")]
    MissingField {
        /// The family.
        model_type: String,
        /// The missing field.
        field: String,
    },
    /// A field has the wrong type or an impossible value.
    #[error("{model_type}: field {field:?}: {reason}")]
    BadField {
        /// The family.
        model_type: String,
        /// The field.
        field: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The dimensions were read but cannot drive a cache
    /// ([`ModelSpec::validate`]).
    #[error("{model_type}: {reason}")]
    Invalid {
        /// The family.
        model_type: String,
        /// The validation failure.
        reason: String,
    },
}

/// The `model_type` values [`ModelSpec::from_hf_config`] reads.
pub const HF_MODEL_TYPES: &[&str] = &[
    "nemotron_h",
    "bamba",
    "granitemoehybrid",
    "falcon_h1",
    "zamba2",
    "jamba",
    "mamba2",
    "mamba",
];

/// Field access with errors that name the family and the field.
struct Fields<'a> {
    obj: &'a Map<String, Value>,
    model_type: &'a str,
}

impl<'a> Fields<'a> {
    fn missing(&self, field: &str) -> HfConfigError {
        HfConfigError::MissingField {
            model_type: self.model_type.to_owned(),
            field: field.to_owned(),
        }
    }

    fn bad(&self, field: &str, reason: impl Into<String>) -> HfConfigError {
        HfConfigError::BadField {
            model_type: self.model_type.to_owned(),
            field: field.to_owned(),
            reason: reason.into(),
        }
    }

    fn get(&self, field: &str) -> Option<&'a Value> {
        self.obj.get(field).filter(|v| !v.is_null())
    }

    /// A non-negative integer field, or `None` when absent or null.
    fn opt_u64(&self, field: &str) -> Result<Option<u64>, HfConfigError> {
        match self.get(field) {
            None => Ok(None),
            Some(v) => v.as_u64().map(Some).ok_or_else(|| {
                self.bad(field, format!("expected a non-negative integer, got {v}"))
            }),
        }
    }

    fn u64(&self, field: &str) -> Result<u64, HfConfigError> {
        self.opt_u64(field)?.ok_or_else(|| self.missing(field))
    }

    /// The first of `fields` that is present.
    fn u64_any(&self, fields: &[&str]) -> Result<u64, HfConfigError> {
        for f in fields {
            if let Some(v) = self.opt_u64(f)? {
                return Ok(v);
            }
        }
        Err(self.missing(&fields.join("\" or \"")))
    }

    /// A convolution width (`model::dims::conv_width`).
    fn conv_width(&self, field: &str) -> Result<u64, HfConfigError> {
        dims::conv_width(self.u64(field)?).map_err(|r| self.bad(field, r))
    }

    /// A Mamba-2 group count (`model::dims::groups`).
    fn groups(&self, field: &str) -> Result<u64, HfConfigError> {
        dims::groups(self.u64(field)?).map_err(|r| self.bad(field, r))
    }

    /// `num_experts_per_tok`, checked against the expert count `count_field`
    /// when the config has it (`model::dims::experts_used`).
    fn experts_used(&self, count_field: &str) -> Result<u64, HfConfigError> {
        let field = "num_experts_per_tok";
        dims::experts_used(self.u64(field)?, self.opt_u64(count_field)?)
            .map_err(|r| self.bad(field, r))
    }

    /// A count that must fit a layer counter.
    fn u32_of(&self, field: &str, v: u64) -> Result<u32, HfConfigError> {
        u32::try_from(v).map_err(|_| self.bad(field, format!("{v} layers is absurd")))
    }

    fn str(&self, field: &str) -> Result<&'a str, HfConfigError> {
        let v = self.get(field).ok_or_else(|| self.missing(field))?;
        v.as_str()
            .ok_or_else(|| self.bad(field, format!("expected a string, got {v}")))
    }

    fn array(&self, field: &str) -> Result<&'a Vec<Value>, HfConfigError> {
        let v = self.get(field).ok_or_else(|| self.missing(field))?;
        v.as_array()
            .ok_or_else(|| self.bad(field, format!("expected an array, got {v}")))
    }

    /// Bytes per element of the model's dtype: `torch_dtype` (transformers
    /// 4) or `dtype` (transformers 5); absent or null means float32, the
    /// dtype transformers builds a model in when none is given.
    fn dtype_bytes(&self) -> Result<u64, HfConfigError> {
        let field = if self.get("dtype").is_some() {
            "dtype"
        } else {
            "torch_dtype"
        };
        let Some(v) = self.get(field) else {
            return Ok(4);
        };
        let s = v
            .as_str()
            .ok_or_else(|| self.bad(field, format!("expected a string, got {v}")))?;
        let s = s.strip_prefix("torch.").unwrap_or(s);
        Ok(match s {
            "float32" | "float" => 4,
            "bfloat16" | "float16" | "half" => 2,
            "float64" | "double" => 8,
            "float8_e4m3fn" | "float8_e5m2" | "int8" | "uint8" => 1,
            _ => return Err(self.bad(field, format!("unknown dtype {s:?}"))),
        })
    }

    /// Attention dimensions: (query heads, KV heads, head dim).
    fn attention(&self, head_dim_fields: &[&str]) -> Result<(u64, u64, u64), HfConfigError> {
        let n_heads = self.u64("num_attention_heads")?;
        let kv_heads = self.opt_u64("num_key_value_heads")?.unwrap_or(n_heads);
        let mut head_dim = None;
        for f in head_dim_fields {
            if let Some(v) = self.opt_u64(f)? {
                head_dim = Some(v);
                break;
            }
        }
        let head_dim = match head_dim {
            Some(h) => h,
            None => {
                let d = self.u64("hidden_size")?;
                if n_heads == 0 || d % n_heads != 0 {
                    return Err(self.bad(
                        "num_attention_heads",
                        format!("{n_heads} heads do not divide hidden_size {d} (and no head_dim)"),
                    ));
                }
                d / n_heads
            }
        };
        Ok((n_heads, kv_heads, head_dim))
    }
}

/// The Mamba-2 mixer's dimensions.
struct Mamba2 {
    heads: u64,
    head_dim: u64,
    d_state: u64,
    groups: u64,
    conv_kernel: u64,
}

impl Mamba2 {
    fn inner(&self) -> Option<u64> {
        self.heads.checked_mul(self.head_dim)
    }

    /// Writes the recurrent-layer fields of `m`.
    fn fill(&self, f: &Fields<'_>, m: &mut ModelSpec) -> Result<(), HfConfigError> {
        let overflow = || HfConfigError::Invalid {
            model_type: f.model_type.to_owned(),
            reason: "Mamba dimensions overflow 64 bits".into(),
        };
        let inner = self.inner().ok_or_else(overflow)?;
        m.ssm_inner = inner;
        m.d_state = self.d_state;
        m.ssm_state_channels = inner;
        m.conv_channels = self
            .groups
            .checked_mul(2)
            .and_then(|g| g.checked_mul(self.d_state))
            .and_then(|g| g.checked_add(inner))
            .ok_or_else(overflow)?;
        m.conv_kernel = self.conv_kernel;
        Ok(())
    }
}

impl ModelSpec {
    /// Reads a Hugging Face `config.json` (its text) into a model
    /// description: layer counts from the family's layer pattern, dimensions
    /// and dtype from its fields (see the [module docs](crate::hf_config) for
    /// the families read). The result passes [`validate`](Self::validate).
    pub fn from_hf_config(json: &str) -> Result<ModelSpec, HfConfigError> {
        let root: Value =
            serde_json::from_str(json).map_err(|e| HfConfigError::Json(e.to_string()))?;
        let obj = root
            .as_object()
            .ok_or_else(|| HfConfigError::Json("the top level is not an object".into()))?;
        let mut obj = obj;
        // A composite model (vision-language, ...) keeps its language model
        // in text_config.
        if !obj
            .get("model_type")
            .and_then(Value::as_str)
            .is_some_and(|t| HF_MODEL_TYPES.contains(&t))
        {
            if let Some(text) = obj.get("text_config").and_then(Value::as_object) {
                obj = text;
            }
        }
        let model_type = obj
            .get("model_type")
            .and_then(Value::as_str)
            .ok_or_else(|| HfConfigError::UnsupportedModelType(String::new()))?;
        let f = Fields { obj, model_type };
        let mut m = match model_type {
            "nemotron_h" => nemotron_h(&f)?,
            "bamba" => bamba(&f)?,
            "granitemoehybrid" => granite_moe_hybrid(&f)?,
            "falcon_h1" => falcon_h1(&f)?,
            "zamba2" => zamba2(&f)?,
            "jamba" => jamba(&f)?,
            "mamba2" => mamba2(&f)?,
            "mamba" => mamba(&f)?,
            other => return Err(HfConfigError::UnsupportedModelType(other.to_owned())),
        };
        let dtype = f.dtype_bytes()?;
        m.dtype_bytes = dtype;
        m.state_dtype_bytes = dtype;
        m.validate().map_err(|reason| HfConfigError::Invalid {
            model_type: model_type.to_owned(),
            reason,
        })?;
        Ok(m)
    }
}

/// A spec with the name and hidden size set, everything else zero.
fn blank(f: &Fields<'_>) -> Result<ModelSpec, HfConfigError> {
    Ok(ModelSpec {
        name: f.model_type.to_owned(),
        attn_layers: 0,
        ssm_layers: 0,
        mlp_layers: 0,
        moe_layers: 0,
        moe_top_k: 0,
        d_model: f.u64("hidden_size")?,
        n_heads: 0,
        kv_heads: 0,
        head_dim: 0,
        ffn_dim: 0,
        ffn_matrices: 0,
        ssm_inner: 0,
        d_state: 0,
        ssm_state_channels: 0,
        conv_channels: 0,
        conv_kernel: 0,
        dtype_bytes: 0,
        state_dtype_bytes: 0,
    })
}

/// Weight matrices of an MLP with activation `act`: 2 for the plain
/// (up, down) MLPs of squared-ReLU / GELU models, else 3 (gated).
fn mlp_matrices(act: Option<&str>) -> u64 {
    match act {
        Some("relu2" | "relu" | "gelu" | "gelu_new" | "gelu_pytorch_tanh") => 2,
        _ => 3,
    }
}

/// Sets attention fields when the model has attention layers.
fn set_attention(m: &mut ModelSpec, (n, kv, hd): (u64, u64, u64)) {
    m.n_heads = n;
    m.kv_heads = kv;
    m.head_dim = hd;
}

/// Expects `num_hidden_layers` (when present) to equal the pattern's length.
fn check_layers(f: &Fields<'_>, field: &str, len: usize) -> Result<(), HfConfigError> {
    if let Some(n) = f.opt_u64("num_hidden_layers")? {
        if n != len as u64 {
            return Err(f.bad(
                field,
                format!("describes {len} layers but num_hidden_layers is {n}"),
            ));
        }
    }
    Ok(())
}

/// MoE work per token as one MLP width: routed experts run per token plus
/// shared experts.
fn moe_width(f: &Fields<'_>, top_k: u64, routed: u64, shared: u64) -> Result<u64, HfConfigError> {
    top_k
        .checked_mul(routed)
        .and_then(|r| r.checked_add(shared))
        .ok_or_else(|| f.bad("num_experts_per_tok", "MoE width overflows 64 bits"))
}

/// One layer of a layer list.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Layer {
    Recurrent,
    Attention,
    Mlp,
    Moe,
    /// Zamba2: Mamba-2 after the shared attention block.
    Hybrid,
}

/// The first of `names` that is present (the list's field), or a missing
/// `fallback` error naming them all.
fn list_field<'n>(
    f: &Fields<'_>,
    names: &[&'n str],
    fallback: &str,
) -> Result<&'n str, HfConfigError> {
    names
        .iter()
        .find(|n| f.get(n).is_some())
        .copied()
        .ok_or_else(|| f.missing(&format!("{fallback}\" or \"{}", names.join("\" or \""))))
}

/// A list of layer type names, old spellings (`mamba`, `attention`) and
/// transformers 5's (`linear_attention`, `full_attention`) alike.
fn layer_list(f: &Fields<'_>, field: &str) -> Result<Vec<Layer>, HfConfigError> {
    f.array(field)?
        .iter()
        .enumerate()
        .map(|(i, t)| {
            Ok(match t.as_str() {
                Some("mamba" | "mamba2" | "linear_attention" | "M") => Layer::Recurrent,
                Some("attention" | "full_attention" | "*") => Layer::Attention,
                Some("mlp" | "-") => Layer::Mlp,
                Some("moe" | "E") => Layer::Moe,
                Some("hybrid") => Layer::Hybrid,
                _ => {
                    return Err(f.bad(
                        field,
                        format!("layer {i} is {t} (expected mamba/linear_attention, attention/full_attention, mlp, moe or hybrid)"),
                    ))
                }
            })
        })
        .collect()
}

fn nemotron_h(f: &Fields<'_>) -> Result<ModelSpec, HfConfigError> {
    // Hub configs spell the layers as a pattern string; transformers 5
    // writes a list (`layers_block_type`).
    let (field, kinds) = if f.get("hybrid_override_pattern").is_some() {
        let field = "hybrid_override_pattern";
        let mut kinds = Vec::new();
        for (i, c) in f.str(field)?.chars().enumerate() {
            kinds.push(match c {
                'M' => Layer::Recurrent,
                '*' => Layer::Attention,
                '-' => Layer::Mlp,
                'E' => Layer::Moe,
                _ => {
                    return Err(f.bad(field, format!("layer {i} is {c:?} (expected M, *, - or E)")))
                }
            });
        }
        (field, kinds)
    } else {
        let field = list_field(
            f,
            &["layers_block_type", "layer_types"],
            "hybrid_override_pattern",
        )?;
        (field, layer_list(f, field)?)
    };
    let count = |k: Layer| kinds.iter().filter(|&&x| x == k).count() as u64;
    let (attn, ssm, mlp, moe) = (
        count(Layer::Attention),
        count(Layer::Recurrent),
        count(Layer::Mlp),
        count(Layer::Moe),
    );
    if kinds.contains(&Layer::Hybrid) {
        return Err(f.bad(field, "a \"hybrid\" layer is a Zamba2 layer type"));
    }
    check_layers(f, field, kinds.len())?;
    let mut m = blank(f)?;
    m.attn_layers = f.u32_of(field, attn)?;
    m.ssm_layers = f.u32_of(field, ssm)?;
    m.mlp_layers = f.u32_of(field, mlp)?;
    m.moe_layers = f.u32_of(field, moe)?;
    if attn > 0 {
        set_attention(&mut m, f.attention(&["head_dim", "attention_head_dim"])?);
    }
    let act = f.get("mlp_hidden_act").and_then(Value::as_str);
    m.ffn_matrices = mlp_matrices(act);
    let dense = if mlp > 0 {
        f.u64("intermediate_size")?
    } else {
        0
    };
    m.ffn_dim = dense;
    if moe > 0 {
        let top_k = f.experts_used("n_routed_experts")?;
        let routed = f.u64("moe_intermediate_size")?;
        let shared = f
            .opt_u64("moe_shared_expert_intermediate_size")?
            .unwrap_or(0)
            .saturating_mul(f.opt_u64("n_shared_experts")?.unwrap_or(1));
        let width = moe_width(f, top_k, routed, shared)?;
        if dense == 0 {
            m.ffn_dim = width;
            m.moe_top_k = 1;
        } else {
            let k = (width as f64 / dense as f64).round().max(1.0);
            m.moe_top_k = k.min(f64::from(u32::MAX)) as u32;
        }
    }
    if ssm > 0 {
        Mamba2 {
            heads: f.u64("mamba_num_heads")?,
            head_dim: f.u64("mamba_head_dim")?,
            d_state: f.u64("ssm_state_size")?,
            groups: f.groups("n_groups")?,
            conv_kernel: f.conv_width("conv_kernel")?,
        }
        .fill(f, &mut m)?;
    }
    Ok(m)
}

/// Bamba / GraniteMoeHybrid / FalconH1 Mamba-2 fields (`mamba_` prefix);
/// the head dim may be absent (inner / heads, inner = expand · hidden).
fn mamba2_prefixed(f: &Fields<'_>, inner_field: Option<&str>) -> Result<Mamba2, HfConfigError> {
    let heads = f.u64("mamba_n_heads")?;
    let head_dim = match f.opt_u64("mamba_d_head")? {
        Some(h) => h,
        None => {
            let inner = match inner_field.map(|x| f.opt_u64(x)).transpose()?.flatten() {
                Some(i) => i,
                None => f
                    .u64("mamba_expand")?
                    .checked_mul(f.u64("hidden_size")?)
                    .ok_or_else(|| f.bad("mamba_expand", "inner width overflows 64 bits"))?,
            };
            if heads == 0 || inner % heads != 0 {
                return Err(f.bad(
                    "mamba_n_heads",
                    format!("{heads} heads do not divide the inner width {inner}"),
                ));
            }
            inner / heads
        }
    };
    Ok(Mamba2 {
        heads,
        head_dim,
        d_state: f.u64("mamba_d_state")?,
        groups: f.groups("mamba_n_groups")?,
        conv_kernel: f.conv_width("mamba_d_conv")?,
    })
}

fn bamba(f: &Fields<'_>) -> Result<ModelSpec, HfConfigError> {
    let layers = f.u64("num_hidden_layers")?;
    let field = "attn_layer_indices";
    let mut attn = std::collections::BTreeSet::new();
    if let Some(v) = f.get(field) {
        let list = v
            .as_array()
            .ok_or_else(|| f.bad(field, format!("expected an array, got {v}")))?;
        for x in list {
            let i = x
                .as_u64()
                .filter(|&i| i < layers)
                .ok_or_else(|| f.bad(field, format!("{x} is not a layer index below {layers}")))?;
            attn.insert(i);
        }
    }
    let attn = attn.len() as u64;
    let mut m = blank(f)?;
    m.attn_layers = f.u32_of(field, attn)?;
    m.ssm_layers = f.u32_of("num_hidden_layers", layers - attn)?;
    m.mlp_layers = f.u32_of("num_hidden_layers", layers)?;
    m.ffn_dim = f.u64("intermediate_size")?;
    m.ffn_matrices = 3;
    if attn > 0 {
        set_attention(&mut m, f.attention(&["head_dim"])?);
    }
    if layers > attn {
        mamba2_prefixed(f, None)?.fill(f, &mut m)?;
    }
    Ok(m)
}

fn granite_moe_hybrid(f: &Fields<'_>) -> Result<ModelSpec, HfConfigError> {
    let field = list_field(f, &["layer_types", "layers_block_type"], "layer_types")?;
    let types = layer_list(f, field)?;
    let (mut attn, mut ssm) = (0u64, 0u64);
    for (i, t) in types.iter().enumerate() {
        match t {
            Layer::Recurrent => ssm += 1,
            Layer::Attention => attn += 1,
            _ => {
                return Err(f.bad(
                    field,
                    format!("layer {i} is {t:?} (expected mamba or attention)"),
                ))
            }
        }
    }
    check_layers(f, field, types.len())?;
    let layers = attn + ssm;
    let mut m = blank(f)?;
    m.attn_layers = f.u32_of(field, attn)?;
    m.ssm_layers = f.u32_of(field, ssm)?;
    m.ffn_matrices = 3;
    let experts = f.opt_u64("num_local_experts")?.unwrap_or(0);
    let shared = f.opt_u64("shared_intermediate_size")?.unwrap_or(0);
    if experts > 0 {
        // Every layer: a MoE block plus the shared MLP, folded into one width.
        let top_k = f.experts_used("num_local_experts")?;
        m.moe_layers = f.u32_of(field, layers)?;
        m.moe_top_k = 1;
        m.ffn_dim = moe_width(f, top_k, f.u64("intermediate_size")?, shared)?;
    } else {
        m.mlp_layers = f.u32_of(field, layers)?;
        m.ffn_dim = if shared > 0 {
            shared
        } else {
            f.u64("intermediate_size")?
        };
    }
    if attn > 0 {
        set_attention(&mut m, f.attention(&["head_dim"])?);
    }
    if ssm > 0 {
        mamba2_prefixed(f, None)?.fill(f, &mut m)?;
    }
    Ok(m)
}

fn falcon_h1(f: &Fields<'_>) -> Result<ModelSpec, HfConfigError> {
    let layers = f.u64("num_hidden_layers")?;
    let n = f.u32_of("num_hidden_layers", layers)?;
    let mut m = blank(f)?;
    m.attn_layers = n;
    m.ssm_layers = n;
    m.mlp_layers = n;
    m.ffn_dim = f.u64("intermediate_size")?;
    m.ffn_matrices = 3;
    set_attention(&mut m, f.attention(&["head_dim"])?);
    mamba2_prefixed(f, Some("mamba_d_ssm"))?.fill(f, &mut m)?;
    Ok(m)
}

fn zamba2(f: &Fields<'_>) -> Result<ModelSpec, HfConfigError> {
    let field = "layers_block_type";
    let types = layer_list(f, field)?;
    let mut hybrid = 0u64;
    for (i, t) in types.iter().enumerate() {
        match t {
            Layer::Recurrent => {}
            Layer::Hybrid => hybrid += 1,
            _ => {
                return Err(f.bad(
                    field,
                    format!("layer {i} is {t:?} (expected mamba or hybrid)"),
                ))
            }
        }
    }
    check_layers(f, field, types.len())?;
    let mut m = blank(f)?;
    // Every layer has a Mamba-2 mixer; a hybrid layer first runs the shared
    // transformer block (attention over [hidden, embeddings], 2·D wide, and
    // its MLP), whose KV is cached per hybrid layer.
    m.ssm_layers = f.u32_of(field, types.len() as u64)?;
    m.attn_layers = f.u32_of(field, hybrid)?;
    m.mlp_layers = f.u32_of(field, hybrid)?;
    m.ffn_dim = f.u64("intermediate_size")?;
    m.ffn_matrices = 2;
    if hybrid > 0 {
        set_attention(&mut m, f.attention(&["attention_head_dim"])?);
        if f.opt_u64("attention_head_dim")?.is_none() {
            // transformers: attention_head_dim = 2 · hidden / heads.
            m.head_dim = m.head_dim.saturating_mul(2);
        }
    }
    let d = m.d_model;
    let heads = f.u64("n_mamba_heads")?;
    let head_dim = match f.opt_u64("mamba_headdim")? {
        Some(h) => h,
        None => {
            let inner = f.u64("mamba_expand")?.saturating_mul(d);
            if heads == 0 || inner % heads != 0 {
                return Err(f.bad("n_mamba_heads", "heads do not divide the inner width"));
            }
            inner / heads
        }
    };
    Mamba2 {
        heads,
        head_dim,
        d_state: f.u64("mamba_d_state")?,
        groups: f.groups("mamba_ngroups")?,
        conv_kernel: f.conv_width("mamba_d_conv")?,
    }
    .fill(f, &mut m)?;
    Ok(m)
}

/// Layer `i` is selected by a (period, offset) pair.
fn periodic(f: &Fields<'_>, layers: u64, period: &str, offset: &str) -> Result<u64, HfConfigError> {
    let p = f.u64(period)?;
    let o = f.u64(offset)?;
    if p == 0 || o >= p {
        return Err(f.bad(offset, format!("offset {o} is not below the period {p}")));
    }
    // Layers o, o + p, o + 2p, ... below `layers` (counted, not iterated:
    // the layer count comes from the file).
    Ok(if layers > o {
        (layers - 1 - o) / p + 1
    } else {
        0
    })
}

fn jamba(f: &Fields<'_>) -> Result<ModelSpec, HfConfigError> {
    let layers = f.u64("num_hidden_layers")?;
    if layers > u64::from(u32::MAX) {
        return Err(f.bad("num_hidden_layers", format!("{layers} layers is absurd")));
    }
    let attn = periodic(f, layers, "attn_layer_period", "attn_layer_offset")?;
    let experts = f.opt_u64("num_experts")?.unwrap_or(1);
    let moe = if experts > 1 {
        periodic(f, layers, "expert_layer_period", "expert_layer_offset")?
    } else {
        0
    };
    let mut m = blank(f)?;
    m.attn_layers = f.u32_of("attn_layer_period", attn)?;
    m.ssm_layers = f.u32_of("num_hidden_layers", layers - attn)?;
    m.moe_layers = f.u32_of("expert_layer_period", moe)?;
    m.mlp_layers = f.u32_of("num_hidden_layers", layers - moe)?;
    m.moe_top_k = if moe > 0 {
        f.u32_of("num_experts_per_tok", f.experts_used("num_experts")?)?
    } else {
        0
    };
    m.ffn_dim = f.u64("intermediate_size")?;
    m.ffn_matrices = 3;
    if attn > 0 {
        set_attention(&mut m, f.attention(&[])?);
    }
    if layers > attn {
        mamba1(
            f,
            &mut m,
            f.u64("mamba_expand")?,
            "mamba_d_state",
            "mamba_d_conv",
        )?;
    }
    Ok(m)
}

/// Mamba-1 state: `inner · d_state` SSM numbers and `inner · conv_kernel`
/// conv numbers per layer, inner = expand · hidden.
fn mamba1(
    f: &Fields<'_>,
    m: &mut ModelSpec,
    expand: u64,
    d_state: &str,
    conv: &str,
) -> Result<(), HfConfigError> {
    let inner = expand
        .checked_mul(m.d_model)
        .ok_or_else(|| f.bad("expand", "inner width overflows 64 bits"))?;
    m.ssm_inner = inner;
    m.ssm_state_channels = inner;
    m.conv_channels = inner;
    m.d_state = f.u64(d_state)?;
    m.conv_kernel = f.conv_width(conv)?;
    Ok(())
}

fn mamba2(f: &Fields<'_>) -> Result<ModelSpec, HfConfigError> {
    let layers = f.u64("num_hidden_layers")?;
    let mut m = blank(f)?;
    m.ssm_layers = f.u32_of("num_hidden_layers", layers)?;
    let heads = f.u64("num_heads")?;
    let head_dim = f.u64("head_dim")?;
    Mamba2 {
        heads,
        head_dim,
        d_state: f.u64("state_size")?,
        groups: f.groups("n_groups")?,
        conv_kernel: f.conv_width("conv_kernel")?,
    }
    .fill(f, &mut m)?;
    Ok(m)
}

fn mamba(f: &Fields<'_>) -> Result<ModelSpec, HfConfigError> {
    let layers = f.u64("num_hidden_layers")?;
    let mut m = blank(f)?;
    m.ssm_layers = f.u32_of("num_hidden_layers", layers)?;
    let inner = f.u64_any(&["intermediate_size"])?;
    let d = m.d_model;
    if d == 0 || inner % d != 0 {
        return Err(f.bad(
            "intermediate_size",
            format!("{inner} is not a multiple of hidden_size {d}"),
        ));
    }
    mamba1(f, &mut m, inner / d, "state_size", "conv_kernel").map(|()| m)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// NVIDIA-Nemotron-H-8B-Base-8K's config.json, abridged to the fields
    /// read (values as published).
    const NEMOTRON_H_8B: &str = r#"{
        "architectures": ["NemotronHForCausalLM"],
        "model_type": "nemotron_h",
        "hidden_size": 4096,
        "num_hidden_layers": 52,
        "hybrid_override_pattern": "M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-M-M-M-M-M-M-",
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 21504,
        "mlp_hidden_act": "relu2",
        "mamba_num_heads": 128,
        "mamba_head_dim": 64,
        "ssm_state_size": 128,
        "n_groups": 8,
        "conv_kernel": 4,
        "expand": 2,
        "torch_dtype": "bfloat16"
    }"#;

    #[test]
    fn nemotron_h_8b_equals_the_preset() {
        let m = ModelSpec::from_hf_config(NEMOTRON_H_8B).unwrap();
        let mut preset = ModelSpec::preset("nemotron-h-8b").unwrap();
        preset.name = "nemotron_h".into();
        assert_eq!(m, preset);
    }

    #[test]
    fn transformers_5_layer_lists_equal_the_pattern() {
        let list = NEMOTRON_H_8B.replace(
            r#""hybrid_override_pattern": "M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-M-M-M-M-M-M-""#,
            &format!(
                r#""layers_block_type": {:?}"#,
                "M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-M-M-M-M-M-M-"
                    .chars()
                    .map(|c| match c {
                        'M' => "linear_attention",
                        '*' => "full_attention",
                        _ => "mlp",
                    })
                    .collect::<Vec<_>>()
            ),
        );
        assert_ne!(list, NEMOTRON_H_8B);
        assert_eq!(
            ModelSpec::from_hf_config(&list).unwrap(),
            ModelSpec::from_hf_config(NEMOTRON_H_8B).unwrap()
        );
        let hybrid = list.replacen("\"mlp\"", "\"hybrid\"", 1);
        assert!(matches!(
            ModelSpec::from_hf_config(&hybrid),
            Err(HfConfigError::BadField { .. })
        ));
    }

    #[test]
    fn a_nested_text_config_is_read() {
        let outer = format!(r#"{{"model_type": "llava_next", "text_config": {NEMOTRON_H_8B}}}"#);
        assert_eq!(
            ModelSpec::from_hf_config(&outer).unwrap(),
            ModelSpec::from_hf_config(NEMOTRON_H_8B).unwrap()
        );
    }

    #[test]
    fn jamba_mini_equals_the_preset() {
        let json = JAMBA_MINI;
        let m = ModelSpec::from_hf_config(json).unwrap();
        let mut preset = ModelSpec::preset("jamba-1.5-mini").unwrap();
        preset.name = "jamba".into();
        assert_eq!(m, preset);
    }

    #[test]
    fn bamba_counts_attention_indices() {
        let json = BAMBA;
        let m = ModelSpec::from_hf_config(json).unwrap();
        assert_eq!((m.attn_layers, m.ssm_layers, m.mlp_layers), (3, 29, 32));
        assert_eq!(m.kv_bytes_per_token(), 3 * 2 * 8 * 128 * 2);
        let per_layer = (128 * 64 * 128 + (8192 + 2 * 128) * 4) * 2;
        assert_eq!(m.state_bytes(), 29 * per_layer);
    }

    #[test]
    fn granite_folds_moe_and_shared_mlp_into_one_width() {
        let json = r#"{
            "model_type": "granitemoehybrid", "hidden_size": 64, "num_hidden_layers": 4,
            "layer_types": ["mamba", "attention", "mamba", "mamba"],
            "num_attention_heads": 4, "num_key_value_heads": 2,
            "intermediate_size": 32, "shared_intermediate_size": 96,
            "num_local_experts": 8, "num_experts_per_tok": 2,
            "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_d_state": 16,
            "mamba_n_groups": 1, "mamba_d_conv": 4, "mamba_expand": 2
        }"#;
        let m = ModelSpec::from_hf_config(json).unwrap();
        assert_eq!((m.attn_layers, m.ssm_layers, m.moe_layers), (1, 3, 4));
        assert_eq!((m.ffn_dim, m.moe_top_k), (2 * 32 + 96, 1));
        assert_eq!(m.head_dim, 16);
        let new_names = json
            .replace("\"mamba\"", "\"linear_attention\"")
            .replace("\"attention\"", "\"full_attention\"");
        assert_eq!(ModelSpec::from_hf_config(&new_names).unwrap(), m);
        // No dtype given: float32.
        assert_eq!((m.dtype_bytes, m.state_dtype_bytes), (4, 4));
    }

    #[test]
    fn falcon_h1_runs_both_mixers_in_every_layer() {
        let json = r#"{
            "model_type": "falcon_h1", "hidden_size": 64, "num_hidden_layers": 3,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "intermediate_size": 128, "mamba_n_heads": 8, "mamba_d_head": 16,
            "mamba_d_state": 16, "mamba_n_groups": 1, "mamba_d_conv": 4,
            "mamba_expand": 2, "mamba_d_ssm": null, "dtype": "float16"
        }"#;
        let m = ModelSpec::from_hf_config(json).unwrap();
        assert_eq!((m.attn_layers, m.ssm_layers, m.mlp_layers), (3, 3, 3));
        assert_eq!(m.conv_channels, 128 + 2 * 16);
        assert_eq!(m.dtype_bytes, 2);
    }

    #[test]
    fn zamba2_hybrid_layers_cache_the_shared_attention() {
        let json = r#"{
            "model_type": "zamba2", "hidden_size": 64, "num_hidden_layers": 4,
            "layers_block_type": ["mamba", "hybrid", "mamba", "hybrid"],
            "num_attention_heads": 4, "num_key_value_heads": 4,
            "intermediate_size": 256, "n_mamba_heads": 8, "mamba_headdim": 16,
            "mamba_d_state": 16, "mamba_ngroups": 1, "mamba_d_conv": 4,
            "mamba_expand": 2, "torch_dtype": "float32"
        }"#;
        let m = ModelSpec::from_hf_config(json).unwrap();
        assert_eq!((m.attn_layers, m.ssm_layers), (2, 4));
        assert_eq!(m.head_dim, 32); // 2 · hidden / heads
    }

    #[test]
    fn pure_mamba_models_have_no_kv() {
        let m2 = r#"{"model_type": "mamba2", "hidden_size": 64, "num_hidden_layers": 2,
            "num_heads": 8, "head_dim": 16, "state_size": 16, "n_groups": 1,
            "conv_kernel": 4, "expand": 2}"#;
        let m = ModelSpec::from_hf_config(m2).unwrap();
        assert_eq!(m.kv_bytes_per_token(), 0);
        assert_eq!(m.state_bytes(), 2 * (128 * 16 + 160 * 4) * 4);
        let m1 = r#"{"model_type": "mamba", "hidden_size": 64, "num_hidden_layers": 2,
            "intermediate_size": 128, "state_size": 16, "conv_kernel": 4}"#;
        let m = ModelSpec::from_hf_config(m1).unwrap();
        assert_eq!(m.state_bytes(), 2 * (128 * 16 + 128 * 4) * 4);
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(256))]

        /// Any text: an error or a valid spec, never a panic (overflow
        /// checks are on in the test builds).
        #[test]
        fn arbitrary_text_never_panics(text in ".{0,200}") {
            if let Ok(m) = ModelSpec::from_hf_config(&text) {
                proptest::prop_assert!(m.validate().is_ok());
            }
        }

        /// Real configs with one numeric field set to an extreme or random
        /// value: an error or a spec that validates, never a panic.
        #[test]
        fn extreme_numbers_never_panic(
            which in 0usize..3,
            field in 0usize..64,
            value in proptest::prop_oneof![
                proptest::strategy::Just(0u64),
                proptest::strategy::Just(1u64),
                proptest::strategy::Just(u64::from(u32::MAX)),
                proptest::strategy::Just(u64::MAX),
                proptest::prelude::any::<u64>(),
            ],
        ) {
            let base = [NEMOTRON_H_8B, JAMBA_MINI, BAMBA][which];
            let mut v: serde_json::Value = serde_json::from_str(base).unwrap();
            let obj = v.as_object_mut().unwrap();
            let numeric: Vec<String> =
                obj.iter().filter(|(_, x)| x.is_u64()).map(|(k, _)| k.clone()).collect();
            let key = &numeric[field % numeric.len()];
            obj.insert(key.clone(), value.into());
            if let Ok(m) = ModelSpec::from_hf_config(&v.to_string()) {
                proptest::prop_assert!(m.validate().is_ok(), "{key} = {value}");
            }
        }
    }

    /// AI21-Jamba-1.5-Mini's config.json, abridged to the fields read.
    const JAMBA_MINI: &str = r#"{
        "model_type": "jamba", "hidden_size": 4096, "num_hidden_layers": 32,
        "attn_layer_period": 8, "attn_layer_offset": 4,
        "expert_layer_period": 2, "expert_layer_offset": 1,
        "num_experts": 16, "num_experts_per_tok": 2,
        "num_attention_heads": 32, "num_key_value_heads": 8,
        "intermediate_size": 14336, "mamba_d_state": 16, "mamba_d_conv": 4,
        "mamba_expand": 2, "torch_dtype": "bfloat16"
    }"#;

    /// `json` with `field` set to `value`.
    fn with(json: &str, field: &str, value: Value) -> String {
        let mut v: Value = serde_json::from_str(json).unwrap();
        v.as_object_mut().unwrap().insert(field.into(), value);
        v.to_string()
    }

    #[test]
    fn impossible_models_are_refused_naming_the_field() {
        let granite = r#"{
            "model_type": "granitemoehybrid", "hidden_size": 64, "num_hidden_layers": 4,
            "layer_types": ["mamba", "attention", "mamba", "mamba"],
            "num_attention_heads": 4, "num_key_value_heads": 2,
            "intermediate_size": 32, "num_local_experts": 8, "num_experts_per_tok": 2,
            "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_d_state": 16,
            "mamba_n_groups": 1, "mamba_d_conv": 4, "mamba_expand": 2
        }"#;
        // (config, field, value, the field the error names)
        let cases = [
            (NEMOTRON_H_8B, "n_groups", 0, "n_groups"),
            (NEMOTRON_H_8B, "conv_kernel", 0, "conv_kernel"),
            (NEMOTRON_H_8B, "num_key_value_heads", 64, ""),
            (JAMBA_MINI, "mamba_d_conv", 0, "mamba_d_conv"),
            (JAMBA_MINI, "num_experts_per_tok", 0, "num_experts_per_tok"),
            (JAMBA_MINI, "num_experts_per_tok", 17, "num_experts_per_tok"),
            (JAMBA_MINI, "num_key_value_heads", 33, ""),
            (BAMBA, "mamba_n_groups", 0, "mamba_n_groups"),
            (BAMBA, "mamba_d_conv", 0, "mamba_d_conv"),
            (granite, "num_experts_per_tok", 0, "num_experts_per_tok"),
            (granite, "num_experts_per_tok", 9, "num_experts_per_tok"),
            (granite, "mamba_n_groups", 0, "mamba_n_groups"),
        ];
        for (json, field, value, named) in cases {
            assert!(ModelSpec::from_hf_config(json).is_ok(), "{json}");
            let e = ModelSpec::from_hf_config(&with(json, field, value.into())).unwrap_err();
            match &e {
                HfConfigError::BadField { field: f, .. } => assert_eq!(f, named, "{e}"),
                HfConfigError::Invalid { reason, .. } => {
                    assert!(named.is_empty() && reason.contains("KV heads"), "{e}")
                }
                _ => panic!("{field} = {value}: {e}"),
            }
        }
    }

    /// A Bamba-9B-shaped config (32 layers, attention at 9, 18, 27).
    const BAMBA: &str = r#"{
        "model_type": "bamba", "hidden_size": 4096, "num_hidden_layers": 32,
        "attn_layer_indices": [9, 18, 27], "num_attention_heads": 32,
        "num_key_value_heads": 8, "intermediate_size": 14336,
        "mamba_n_heads": 128, "mamba_d_head": 64, "mamba_d_state": 128,
        "mamba_n_groups": 1, "mamba_d_conv": 4, "mamba_expand": 2,
        "torch_dtype": "bfloat16"
    }"#;

    #[test]
    fn periodic_layers_are_counted_without_iterating() {
        let huge = JAMBA_MINI.replace(
            "\"num_hidden_layers\": 32",
            "\"num_hidden_layers\": 4294967295",
        );
        // Counted in O(1): 4294967295 layers, attention every 8th from 4.
        let m = ModelSpec::from_hf_config(&huge).unwrap();
        assert_eq!(m.attn_layers, 536_870_912);
        assert_eq!(m.moe_layers, 2_147_483_647);
    }

    #[test]
    fn bad_input_is_a_clear_error() {
        use HfConfigError as E;
        assert!(matches!(ModelSpec::from_hf_config(""), Err(E::Json(_))));
        assert!(matches!(ModelSpec::from_hf_config("[1]"), Err(E::Json(_))));
        assert!(
            matches!(ModelSpec::from_hf_config("{}"), Err(E::UnsupportedModelType(t)) if t.is_empty())
        );
        let e = ModelSpec::from_hf_config(r#"{"model_type": "llama"}"#).unwrap_err();
        assert!(e.to_string().contains("nemotron_h"), "{e}");
        let no_pattern = NEMOTRON_H_8B.replace("hybrid_override_pattern", "x");
        assert!(matches!(
            ModelSpec::from_hf_config(&no_pattern),
            Err(E::MissingField { field, .. }) if field.contains("hybrid_override_pattern")
        ));
        let bad_char = NEMOTRON_H_8B.replace("\"M-M-M-M*", "\"M-Q-M-M*");
        assert!(matches!(
            ModelSpec::from_hf_config(&bad_char),
            Err(E::BadField { .. })
        ));
        let bad_count =
            NEMOTRON_H_8B.replace("\"num_hidden_layers\": 52", "\"num_hidden_layers\": 51");
        assert!(matches!(
            ModelSpec::from_hf_config(&bad_count),
            Err(E::BadField { .. })
        ));
        let negative = NEMOTRON_H_8B.replace("\"n_groups\": 8", "\"n_groups\": -8");
        assert!(matches!(
            ModelSpec::from_hf_config(&negative),
            Err(E::BadField { .. })
        ));
        let huge = NEMOTRON_H_8B.replace(
            "\"ssm_state_size\": 128",
            "\"ssm_state_size\": 18446744073709551615",
        );
        assert!(matches!(
            ModelSpec::from_hf_config(&huge),
            Err(E::Invalid { .. })
        ));
        let dtype = NEMOTRON_H_8B.replace("bfloat16", "complex32");
        assert!(matches!(
            ModelSpec::from_hf_config(&dtype),
            Err(E::BadField { .. })
        ));
        let no_state = NEMOTRON_H_8B.replace("\"ssm_state_size\": 128", "\"ssm_state_size\": 0");
        assert!(matches!(
            ModelSpec::from_hf_config(&no_state),
            Err(E::Invalid { .. })
        ));
        let attention_only = r#"{"model_type": "nemotron_h", "hidden_size": 8,
            "hybrid_override_pattern": "---", "intermediate_size": 16}"#;
        assert!(matches!(
            ModelSpec::from_hf_config(attention_only),
            Err(E::Invalid { .. })
        ));
    }
}
