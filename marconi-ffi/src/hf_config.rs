//! A model description read from a Hugging Face `config.json`
//! (marconi-core's `ModelSpec::from_hf_config`), for C callers.

use std::ffi::c_char;

use marconi_core::{HfConfigError, ModelSpec};

use crate::config::marconi_model_spec;
use crate::status::{boundary, check_ptr, in_slice, marconi_status, require, FfiError};

/// The longest `config.json` accepted (real ones are a few KiB).
pub(crate) const MAX_HF_CONFIG_BYTES: usize = 16 << 20;

/// Fills `*out` from the text of a Hugging Face `config.json`
/// (`json[0..len]`, UTF-8, no NUL needed): layer counts from the family's
/// layer pattern, dimensions and element width from its fields. Families
/// read (`model_type`): nemotron_h, bamba, granitemoehybrid, falcon_h1,
/// zamba2, jamba, mamba2, mamba; a composite model's `text_config` is read
/// when the top level is not one of them. A missing `torch_dtype`/`dtype`
/// means float32 (what transformers builds without one).
///
/// Errors (`*out` untouched): MARCONI_STATUS_NULL_ARGUMENT (json NULL with
/// len > 0, or out NULL); MARCONI_STATUS_INVALID_ARGUMENT (len 0 or above
/// 16 MiB, not UTF-8, not a JSON object); MARCONI_STATUS_INVALID_CONFIG (an
/// unsupported model_type, a missing or malformed field, or dimensions that
/// cannot drive a cache). marconi_last_error() names the field.
#[no_mangle]
pub unsafe extern "C" fn marconi_model_spec_from_hf_config(
    json: *const c_char,
    len: usize,
    out: *mut marconi_model_spec,
) -> marconi_status {
    boundary("marconi_model_spec_from_hf_config", || {
        require!(json, len = len);
        require!(out);
        check_ptr!(out);
        if len == 0 {
            return Err(FfiError::new(
                marconi_status::InvalidArgument,
                "json is empty (len 0)",
            ));
        }
        if len > MAX_HF_CONFIG_BYTES {
            return Err(FfiError::new(
                marconi_status::InvalidArgument,
                format!("json length {len} is above the {MAX_HF_CONFIG_BYTES} bytes accepted"),
            ));
        }
        // SAFETY: json is non-NULL (len > 0) and has len readable bytes
        // (caller contract); in_slice checks alignment and the size.
        let bytes = unsafe { in_slice(json.cast::<u8>(), len, "json") }?;
        let text = std::str::from_utf8(bytes).map_err(|e| {
            FfiError::new(
                marconi_status::InvalidArgument,
                format!("json is not UTF-8: {e}"),
            )
        })?;
        let m = ModelSpec::from_hf_config(text).map_err(|e| {
            let status = match e {
                HfConfigError::Json(_) => marconi_status::InvalidArgument,
                _ => marconi_status::InvalidConfig,
            };
            FfiError::new(status, e.to_string())
        })?;
        // SAFETY: out is non-NULL and aligned (checked) and writable by contract.
        unsafe { out.write(marconi_model_spec::from_core(&m)) };
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const TINY: &str = r#"{"model_type": "nemotron_h", "hidden_size": 64,
        "hybrid_override_pattern": "M-*-", "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128,
        "mlp_hidden_act": "relu2", "mamba_num_heads": 8, "mamba_head_dim": 16,
        "ssm_state_size": 16, "n_groups": 2, "conv_kernel": 4,
        "torch_dtype": "float32"}"#;

    fn call(json: &[u8], out: &mut marconi_model_spec) -> marconi_status {
        // SAFETY: json and out are valid for the call.
        unsafe { marconi_model_spec_from_hf_config(json.as_ptr().cast(), json.len(), out) }
    }

    #[test]
    fn reads_a_config_and_refuses_bad_input_without_writing() {
        let mut out = marconi_model_spec::default();
        assert_eq!(call(TINY.as_bytes(), &mut out), marconi_status::Ok);
        assert_eq!((out.attn_layers, out.ssm_layers, out.mlp_layers), (1, 1, 2));
        assert_eq!((out.conv_channels, out.state_dtype_bytes), (128 + 64, 4));
        let before = out;
        for (bad, status) in [
            (&b"{not json"[..], marconi_status::InvalidArgument),
            (&b"\xff\xfe"[..], marconi_status::InvalidArgument),
            (
                &br#"{"model_type": "llama"}"#[..],
                marconi_status::InvalidConfig,
            ),
            (
                &br#"{"model_type": "nemotron_h"}"#[..],
                marconi_status::InvalidConfig,
            ),
        ] {
            assert_eq!(call(bad, &mut out), status);
            assert_eq!(out, before, "a refused call writes nothing");
        }
        assert!(crate::status::last_error().contains("hybrid_override_pattern"));
        // SAFETY: NULL pointers and lengths are what is being tested.
        unsafe {
            assert_eq!(
                marconi_model_spec_from_hf_config(std::ptr::null(), 5, &mut out),
                marconi_status::NullArgument
            );
            assert_eq!(
                marconi_model_spec_from_hf_config(
                    TINY.as_ptr().cast(),
                    TINY.len(),
                    std::ptr::null_mut()
                ),
                marconi_status::NullArgument
            );
            assert_eq!(
                marconi_model_spec_from_hf_config(std::ptr::null(), 0, &mut out),
                marconi_status::InvalidArgument
            );
            assert_eq!(
                marconi_model_spec_from_hf_config(
                    TINY.as_ptr().cast(),
                    MAX_HF_CONFIG_BYTES + 1,
                    &mut out
                ),
                marconi_status::InvalidArgument
            );
        }
    }
}
