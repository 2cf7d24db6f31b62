//! What marconi-gpu's integration tests share: the tiny hybrid model.
//!
//! Cargo builds this module into every test binary that declares
//! `mod common;`.
#![allow(dead_code)]

use marconi_core::ModelSpec;

/// A tiny hybrid: 1 attention layer (KV 2·2 heads·16·2 B = 128 B a token),
/// 1 SSM layer (state (64·8 + 64·8)·2 B = 2048 B): units divide a 4 KiB chunk.
pub(crate) fn tiny() -> ModelSpec {
    ModelSpec {
        name: "tiny".into(),
        attn_layers: 1,
        ssm_layers: 1,
        mlp_layers: 1,
        moe_layers: 0,
        moe_top_k: 0,
        d_model: 64,
        n_heads: 2,
        kv_heads: 2,
        head_dim: 16,
        ffn_dim: 128,
        ffn_matrices: 2,
        ssm_inner: 128,
        d_state: 8,
        ssm_state_channels: 64,
        conv_channels: 64,
        conv_kernel: 8,
        dtype_bytes: 2,
        state_dtype_bytes: 2,
    }
}
