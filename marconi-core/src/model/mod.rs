//! The model description: layer composition and dimensions, and the FLOP and
//! byte formulas the cache needs (Marconi appendix A, Table 1, generalised to
//! grouped-query attention, the Mamba expand factor, MoE and the conv state).

pub mod gguf;
pub mod hf_config;

/// Checks of the dimensions a model file gives that a [`ModelSpec`] no
/// longer holds, shared by both readers (each names its own key in the
/// error). Each returns the reason a value is impossible.
pub(crate) mod dims {
    /// A convolution width (`d_conv`, `conv_kernel`, llama.cpp's
    /// `ssm.conv_kernel`): at least 1.
    pub(crate) fn conv_width(width: u64) -> Result<u64, String> {
        if width == 0 {
            return Err("a convolution of width 0".into());
        }
        Ok(width)
    }

    /// The Mamba-2 group count (B and C are shared within a group): at
    /// least 1.
    pub(crate) fn groups(groups: u64) -> Result<u64, String> {
        if groups == 0 {
            return Err("0 groups: Mamba-2 has at least one B/C group".into());
        }
        Ok(groups)
    }

    /// Experts a token (`used`) out of `count` routed experts (`None` where
    /// the file does not say): at least 1, at most the count.
    pub(crate) fn experts_used(used: u64, count: Option<u64>) -> Result<u64, String> {
        if used == 0 {
            return Err("0 experts a token".into());
        }
        match count {
            Some(count) if used > count => {
                Err(format!("{used} experts a token out of {count} experts"))
            }
            _ => Ok(used),
        }
    }
}

use serde::{Deserialize, Serialize};

/// What the cache needs to know about a model: how many layers of each kind,
/// their dimensions, and the width of the stored numbers.
///
/// The formulas follow the Marconi paper's appendix (Table 1):
/// attention `8LD² + 4L²D`, MLP `16LD²`, SSM `12LD² + 16LDN + 10LD` FLOPs per
/// layer for `L` tokens, generalised so that real models fit:
///
/// * attention projections use the query width (`n_heads · head_dim`) and the
///   KV width (`kv_heads · head_dim`) separately (grouped-query attention);
///   the quadratic term uses the query width;
/// * the SSM mixer uses its inner width `E` (`expand · D`):
///   `6LDE + 8LEN + 5LE`, which is the paper's formula for `E = 2D`;
/// * MLP layers use `ffn_matrices · 2 · D · ffn_dim` per token (2 matrices for
///   a plain MLP, 3 for a gated one), and MoE layers count `moe_top_k` experts.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelSpec {
    /// A short name (the preset name for presets).
    pub name: String,
    /// Number of attention layers (each keeps a KV cache).
    pub attn_layers: u32,
    /// Number of recurrent layers (Mamba/SSM, linear attention): each keeps one
    /// fixed-size state.
    pub ssm_layers: u32,
    /// Number of dense MLP layers.
    pub mlp_layers: u32,
    /// Number of MoE MLP layers (each runs `moe_top_k` experts per token).
    pub moe_layers: u32,
    /// Experts run per token in a MoE layer.
    pub moe_top_k: u32,
    /// Hidden size `D`.
    pub d_model: u64,
    /// Query heads of an attention layer.
    pub n_heads: u64,
    /// KV heads of an attention layer (grouped-query attention).
    pub kv_heads: u64,
    /// Dimension of one attention head.
    pub head_dim: u64,
    /// Inner (intermediate) size of one MLP or expert.
    pub ffn_dim: u64,
    /// Weight matrices of one MLP: 2 (plain) or 3 (gated, e.g. SwiGLU).
    pub ffn_matrices: u64,
    /// Inner width `E` of an SSM mixer (`expand · D`; Mamba uses expand 2).
    pub ssm_inner: u64,
    /// State size `N` of an SSM layer.
    pub d_state: u64,
    /// Channels of the recurrent state tensor, which holds
    /// `ssm_state_channels · N` numbers (Mamba: `E`; the Marconi paper's 7B
    /// model counts `D`).
    pub ssm_state_channels: u64,
    /// Channels of the causal-conv state (Mamba-1: `E`; Mamba-2: `E + 2·groups·N`).
    pub conv_channels: u64,
    /// Columns of conv state kept per channel (the conv kernel width).
    pub conv_kernel: u64,
    /// Bytes per KV element (2 for fp16/bf16).
    pub dtype_bytes: u64,
    /// Bytes per recurrent-state element (2 for fp16/bf16, 4 for fp32).
    pub state_dtype_bytes: u64,
}

/// The preset names [`ModelSpec::preset`] accepts.
pub const PRESET_NAMES: &[&str] = &[
    "paper-7b",
    "paper-7b-attn",
    "paper-7b-ssm",
    "jamba-1.5-mini",
    "nemotron-h-8b",
];

impl ModelSpec {
    /// A named preset, or `None` if the name is unknown (see [`PRESET_NAMES`]).
    ///
    /// * `paper-7b`: the Marconi paper's 7B hybrid (24 SSM, 4 attention,
    ///   28 MLP, D = 4096, N = 128, fp16).
    /// * `paper-7b-attn`: its attention-only sibling (32 attention + 32 MLP).
    /// * `paper-7b-ssm`: its SSM-only sibling (the hybrid with every attention
    ///   layer replaced by an SSM layer: 28 SSM + 28 MLP).
    /// * `jamba-1.5-mini`: 32 layers, attention every 8th (4), 28 Mamba-1
    ///   (d_state 16, expand 2, conv 4), MoE every other layer (16 experts,
    ///   top-2), GQA 32/8 heads × 128, bf16.
    /// * `nemotron-h-8b`: 52 layers: 24 Mamba-2 (128 heads × 64, d_state 128,
    ///   8 groups, conv 4), 4 attention (32/8 heads × 128), 24 MLP
    ///   (squared-ReLU, 21504), bf16.
    pub fn preset(name: &str) -> Option<ModelSpec> {
        let d = 4096;
        let paper = |name: &str, attn, ssm, mlp| ModelSpec {
            name: name.to_owned(),
            attn_layers: attn,
            ssm_layers: ssm,
            mlp_layers: mlp,
            moe_layers: 0,
            moe_top_k: 0,
            d_model: d,
            n_heads: 32,
            kv_heads: 32,
            head_dim: 128,
            ffn_dim: 4 * d,
            ffn_matrices: 2,
            ssm_inner: 2 * d,
            d_state: 128,
            ssm_state_channels: d,
            conv_channels: 2 * d + 2 * 128,
            conv_kernel: 4,
            dtype_bytes: 2,
            state_dtype_bytes: 2,
        };
        Some(match name {
            "paper-7b" => paper(name, 4, 24, 28),
            "paper-7b-attn" => paper(name, 32, 0, 32),
            "paper-7b-ssm" => paper(name, 0, 28, 28),
            "jamba-1.5-mini" => ModelSpec {
                name: name.to_owned(),
                attn_layers: 4,
                ssm_layers: 28,
                mlp_layers: 16,
                moe_layers: 16,
                moe_top_k: 2,
                d_model: 4096,
                n_heads: 32,
                kv_heads: 8,
                head_dim: 128,
                ffn_dim: 14336,
                ffn_matrices: 3,
                ssm_inner: 8192,
                d_state: 16,
                ssm_state_channels: 8192,
                conv_channels: 8192,
                conv_kernel: 4,
                dtype_bytes: 2,
                state_dtype_bytes: 2,
            },
            "nemotron-h-8b" => ModelSpec {
                name: name.to_owned(),
                attn_layers: 4,
                ssm_layers: 24,
                mlp_layers: 24,
                moe_layers: 0,
                moe_top_k: 0,
                d_model: 4096,
                n_heads: 32,
                kv_heads: 8,
                head_dim: 128,
                ffn_dim: 21504,
                ffn_matrices: 2,
                ssm_inner: 8192,
                d_state: 128,
                ssm_state_channels: 8192,
                conv_channels: 8192 + 2 * 8 * 128,
                conv_kernel: 4,
                dtype_bytes: 2,
                state_dtype_bytes: 2,
            },
            _ => return None,
        })
    }

    /// Checks that the description can drive a cache: at least one stateful
    /// layer, non-zero dimensions where a layer kind is present, no more KV
    /// heads than query heads, at least one expert a token where MoE layers
    /// are present, and sizes that do not overflow. Both model readers
    /// ([`from_hf_config`](Self::from_hf_config),
    /// [`from_gguf`](Self::from_gguf)) end with it, and every cache
    /// ([`crate::CacheConfig::validate`]) and plan starts with it, so a spec
    /// a reader accepts always builds a cache. What a spec no longer holds
    /// (the convolution width before llama.cpp drops a column, the Mamba-2
    /// group count, the expert count) is checked by the readers with
    /// the checks of the crate's `model::dims`, shared by both.
    pub fn validate(&self) -> Result<(), String> {
        if self.attn_layers == 0 && self.ssm_layers == 0 {
            return Err("model has neither attention nor SSM layers: nothing to cache".into());
        }
        if self.d_model == 0 {
            return Err("d_model is 0".into());
        }
        if self.attn_layers > 0 && (self.kv_heads == 0 || self.head_dim == 0 || self.n_heads == 0) {
            return Err("attention layers need n_heads, kv_heads and head_dim > 0".into());
        }
        if self.ssm_layers > 0 && (self.d_state == 0 || self.ssm_state_channels == 0) {
            return Err("SSM layers need d_state and ssm_state_channels > 0".into());
        }
        if self.dtype_bytes == 0 || self.state_dtype_bytes == 0 {
            return Err("dtype sizes must be > 0".into());
        }
        // Every integer product the byte and FLOP formulas form, checked,
        // whether or not the model has layers of that kind: the formulas are
        // public and must not wrap (or panic with overflow checks on).
        if self.state_bytes_checked().is_none() {
            return Err("state size overflows 64 bits".into());
        }
        if self.kv_bytes_per_token_checked().is_none() {
            return Err("KV size overflows 64 bits".into());
        }
        if self.n_heads.checked_mul(self.head_dim).is_none() {
            return Err("query width n_heads * head_dim overflows 64 bits".into());
        }
        if self.attn_layers > 0 && self.kv_heads > self.n_heads {
            return Err(format!(
                "{} KV heads for {} query heads: each KV head serves one or more query heads",
                self.kv_heads, self.n_heads
            ));
        }
        if self.moe_layers > 0 && self.moe_top_k == 0 {
            return Err("MoE layers with 0 experts a token".into());
        }
        Ok(())
    }

    fn kv_bytes_per_token_layer_checked(&self) -> Option<u64> {
        self.kv_heads
            .checked_mul(2)?
            .checked_mul(self.head_dim)?
            .checked_mul(self.dtype_bytes)
    }

    fn kv_bytes_per_token_checked(&self) -> Option<u64> {
        self.kv_bytes_per_token_layer_checked()?
            .checked_mul(u64::from(self.attn_layers))
    }

    fn state_bytes_per_layer_checked(&self) -> Option<u64> {
        self.ssm_state_channels
            .checked_mul(self.d_state)?
            .checked_add(self.conv_channels.checked_mul(self.conv_kernel)?)?
            .checked_mul(self.state_dtype_bytes)
    }

    fn state_bytes_checked(&self) -> Option<u64> {
        self.state_bytes_per_layer_checked()?
            .checked_mul(u64::from(self.ssm_layers))
    }

    /// KV bytes of one token in one attention layer (K and V). Saturates at
    /// `u64::MAX` for dimensions [`validate`](Self::validate) refuses.
    pub fn kv_bytes_per_token_layer(&self) -> u64 {
        self.kv_bytes_per_token_layer_checked().unwrap_or(u64::MAX)
    }

    /// KV bytes of one token across all attention layers. Saturates at
    /// `u64::MAX` for dimensions [`validate`](Self::validate) refuses.
    pub fn kv_bytes_per_token(&self) -> u64 {
        self.kv_bytes_per_token_checked().unwrap_or(u64::MAX)
    }

    /// Bytes of one SSM layer's state (recurrent state plus conv state).
    /// Saturates at `u64::MAX` for dimensions [`validate`](Self::validate)
    /// refuses.
    pub fn state_bytes_per_layer(&self) -> u64 {
        self.state_bytes_per_layer_checked().unwrap_or(u64::MAX)
    }

    /// Bytes of one checkpoint: the states of every SSM layer at one position.
    /// Zero for attention-only models. Saturates at `u64::MAX` for dimensions
    /// [`validate`](Self::validate) refuses.
    pub fn state_bytes(&self) -> u64 {
        self.state_bytes_checked().unwrap_or(u64::MAX)
    }

    /// FLOPs to prefill tokens `cached..end` when the first `cached` tokens
    /// are reused, by layer kind.
    pub fn prefill_flops_by_layer(&self, cached: u64, end: u64) -> LayerFlops {
        if end <= cached {
            return LayerFlops::default();
        }
        let (p, q) = (cached as f64, end as f64);
        let n = q - p;
        let d = self.d_model as f64;
        // In floating point: no wrap, even for dimensions `validate` refuses.
        let q_dim = self.n_heads as f64 * self.head_dim as f64;
        let kv_dim = self.kv_heads as f64 * self.head_dim as f64;
        let attn_linear = 2.0 * n * (2.0 * d * q_dim + 2.0 * d * kv_dim);
        // The quadratic term of the new tokens attends over the prefix too:
        // 4·(q² − p²)·width, the paper's 4L²D counted against the prefix.
        let attn_quadratic = 4.0 * (q * q - p * p) * q_dim;
        let e = self.ssm_inner as f64;
        let nst = self.d_state as f64;
        let ssm = n * (6.0 * d * e + 8.0 * e * nst + 5.0 * e);
        let mlp_one = 2.0 * n * d * self.ffn_dim as f64 * self.ffn_matrices as f64;
        let mlp_passes =
            f64::from(self.mlp_layers) + f64::from(self.moe_layers) * f64::from(self.moe_top_k);
        LayerFlops {
            attention: f64::from(self.attn_layers) * (attn_linear + attn_quadratic),
            ssm: f64::from(self.ssm_layers) * ssm,
            mlp: mlp_passes * mlp_one,
        }
    }

    /// Total FLOPs to prefill tokens `cached..end` given a reused prefix of
    /// `cached` tokens: what reusing that prefix saves is
    /// `prefill_flops(0, cached)`.
    pub fn prefill_flops(&self, cached: u64, end: u64) -> f64 {
        self.prefill_flops_by_layer(cached, end).total()
    }
}

/// Prefill FLOPs split by layer kind.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LayerFlops {
    /// Attention layers (projections and the quadratic term).
    pub attention: f64,
    /// SSM layers.
    pub ssm: f64,
    /// MLP and MoE layers.
    pub mlp: f64,
}

impl LayerFlops {
    /// Sum over layer kinds.
    pub fn total(&self) -> f64 {
        self.attention + self.ssm + self.mlp
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn paper() -> ModelSpec {
        ModelSpec::preset("paper-7b").unwrap()
    }

    #[test]
    fn paper_7b_bytes_match_the_issue() {
        let m = paper();
        assert_eq!(m.state_bytes_per_layer(), 1_116_160);
        assert_eq!(m.state_bytes(), 26_787_840);
        assert_eq!(m.kv_bytes_per_token_layer(), 16_384); // 4·D
        assert_eq!(m.kv_bytes_per_token(), 65_536);
    }

    #[test]
    fn paper_7b_flops_match_table_1() {
        let m = paper();
        let d = 4096.0_f64;
        let n = 128.0_f64;
        for &(p, q) in &[(0u64, 1u64), (0, 1000), (100, 2048), (5000, 5001)] {
            let f = m.prefill_flops_by_layer(p, q);
            let (pf, qf) = (p as f64, q as f64);
            let l = qf - pf;
            let attn = 4.0 * (8.0 * l * d * d + 4.0 * (qf * qf - pf * pf) * d);
            let mlp = 28.0 * 16.0 * l * d * d;
            let ssm = 24.0 * (12.0 * l * d * d + 16.0 * l * d * n + 10.0 * l * d);
            assert_eq!(f.attention, attn, "attention {p}..{q}");
            assert_eq!(f.mlp, mlp, "mlp {p}..{q}");
            assert_eq!(f.ssm, ssm, "ssm {p}..{q}");
        }
    }

    #[test]
    fn flops_are_additive_over_splits() {
        for name in PRESET_NAMES {
            let m = ModelSpec::preset(name).unwrap();
            let whole = m.prefill_flops(0, 3000);
            let split = m.prefill_flops(0, 1234) + m.prefill_flops(1234, 3000);
            assert!((whole - split).abs() <= whole * 1e-12, "{name}");
            assert_eq!(m.prefill_flops(10, 10), 0.0);
            assert_eq!(m.prefill_flops(10, 5), 0.0);
        }
    }

    #[test]
    fn real_hybrids_have_published_sizes() {
        let jamba = ModelSpec::preset("jamba-1.5-mini").unwrap();
        // 2 · 8 KV heads · 128 · 2 bytes · 4 attention layers.
        assert_eq!(jamba.kv_bytes_per_token(), 16_384);
        // 8192 · 16 · 2 (SSM) + 8192 · 4 · 2 (conv) per Mamba layer.
        assert_eq!(jamba.state_bytes_per_layer(), 262_144 + 65_536);
        assert_eq!(jamba.state_bytes(), 28 * 327_680);
        let nemo = ModelSpec::preset("nemotron-h-8b").unwrap();
        assert_eq!(nemo.kv_bytes_per_token(), 16_384);
        // 128 heads · 64 · 128 · 2 + (8192 + 2·8·128) · 4 · 2.
        assert_eq!(nemo.state_bytes_per_layer(), 2_097_152 + 81_920);
        for name in PRESET_NAMES {
            ModelSpec::preset(name).unwrap().validate().unwrap();
        }
    }

    #[test]
    fn siblings_and_validation() {
        assert_eq!(ModelSpec::preset("paper-7b-attn").unwrap().state_bytes(), 0);
        assert_eq!(
            ModelSpec::preset("paper-7b-ssm")
                .unwrap()
                .kv_bytes_per_token(),
            0
        );
        assert!(ModelSpec::preset("gpt-9").is_none());
        let mut m = paper();
        m.attn_layers = 0;
        m.ssm_layers = 0;
        assert!(m.validate().is_err());
        let mut m = paper();
        m.d_state = u64::MAX / 2;
        assert!(m.validate().unwrap_err().contains("overflow"));
    }
}
