//! Time-to-first-token models: the estimated prefill latency of the tokens
//! a request could not reuse.

use marconi_core::ModelSpec;

/// How prefill latency is estimated.
#[derive(Clone, Debug, PartialEq)]
pub enum TtftModel {
    /// `base_ms + per_token_ms × (input − hit)`. The default is the public
    /// Marconi artifact's fit to measured Jamba-1.5-Mini prefill latency:
    /// 17.8 ms + 0.053 ms per token.
    Linear {
        /// Fixed cost of a prefill, ms.
        base_ms: f64,
        /// Cost per prefilled token, ms.
        per_token_ms: f64,
    },
    /// `base_ms + FLOPs(hit..input) / (peak × efficiency)`, FLOPs from the
    /// model's formulas ([`ModelSpec::prefill_flops`]).
    Flops {
        /// Fixed cost of a prefill, ms.
        base_ms: f64,
        /// Peak dense FLOP/s of the GPU (e.g. 989e12 for an H100 SXM in bf16).
        peak_flops: f64,
        /// Fraction of peak reached by prefill (model FLOPs utilisation).
        efficiency: f64,
    },
}

impl Default for TtftModel {
    fn default() -> Self {
        TtftModel::Linear {
            base_ms: 17.8,
            per_token_ms: 0.053,
        }
    }
}

impl TtftModel {
    /// The FLOP-based model for an H100 SXM (989 TFLOP/s bf16 dense) at 40 %
    /// utilisation with a 10 ms fixed cost.
    pub fn h100() -> Self {
        TtftModel::Flops {
            base_ms: 10.0,
            peak_flops: 989e12,
            efficiency: 0.4,
        }
    }

    /// Checks that every parameter is finite, the costs >= 0, the peak
    /// FLOP/s > 0 and the efficiency in (0, 1].
    pub fn validate(&self) -> Result<(), String> {
        let check = |ok: bool, what: &str, x: f64, rule: &str| {
            if ok && x.is_finite() {
                Ok(())
            } else {
                Err(format!("{what} {x} is not finite and {rule}"))
            }
        };
        match *self {
            TtftModel::Linear {
                base_ms,
                per_token_ms,
            } => {
                check(base_ms >= 0.0, "base time (ms)", base_ms, ">= 0")?;
                check(
                    per_token_ms >= 0.0,
                    "time per token (ms)",
                    per_token_ms,
                    ">= 0",
                )
            }
            TtftModel::Flops {
                base_ms,
                peak_flops,
                efficiency,
            } => {
                check(base_ms >= 0.0, "base time (ms)", base_ms, ">= 0")?;
                check(peak_flops > 0.0, "peak FLOP/s", peak_flops, "> 0")?;
                check(
                    efficiency > 0.0 && efficiency <= 1.0,
                    "efficiency",
                    efficiency,
                    "in (0, 1]",
                )
            }
        }
    }

    /// Estimated TTFT in ms of an `input_len`-token request whose first
    /// `hit` tokens were reused.
    pub fn ttft_ms(&self, model: &ModelSpec, hit: usize, input_len: usize) -> f64 {
        let miss = input_len.saturating_sub(hit);
        match *self {
            TtftModel::Linear {
                base_ms,
                per_token_ms,
            } => base_ms + per_token_ms * miss as f64,
            TtftModel::Flops {
                base_ms,
                peak_flops,
                efficiency,
            } => {
                let f = model.prefill_flops(hit as u64, input_len as u64);
                base_ms + 1000.0 * f / (peak_flops * efficiency)
            }
        }
    }

    /// Uncached prefill time in ms for trace timing, with no model at hand:
    /// the linear model's own numbers, or the default linear fit.
    pub fn prefill_ms_linear_uncached(&self, input_len: usize) -> f64 {
        let (base, per) = match *self {
            TtftModel::Linear {
                base_ms,
                per_token_ms,
            } => (base_ms, per_token_ms),
            TtftModel::Flops { .. } => (17.8, 0.053),
        };
        base + per * input_len as f64
    }
}
