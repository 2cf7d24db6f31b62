//! Counters and gauges.

use serde::Serialize;

use crate::cache::Core;

/// Counters and gauges.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Stats {
    /// Lookups served.
    pub requests: u64,
    /// Lookups with a non-zero hit.
    pub hit_requests: u64,
    /// Input tokens looked up.
    pub input_tokens: u64,
    /// Tokens skipped thanks to the cache (usable hits).
    pub hit_tokens: u64,
    /// Tokens whose KV matched but could not be used because no state
    /// existed there (the "silent miss"; excludes each request's last token,
    /// which is always recomputed).
    pub kv_matched_unusable_tokens: u64,
    /// Prefill FLOPs saved by hits.
    pub flops_saved: f64,
    /// Prefill FLOPs the inputs would cost with no cache.
    pub flops_total: f64,
    /// Bytes charged for cached tokens: their KV, or [`crate::TOKEN_ID_BYTES`] a
    /// token for models without attention layers.
    pub kv_bytes: u64,
    /// Bytes of cached states.
    pub state_bytes: u64,
    /// The byte budget.
    pub capacity_bytes: u64,
    /// Cached states.
    pub states: u64,
    /// Tree nodes (roots excluded).
    pub nodes: u64,
    /// Nodes evicted.
    pub evictions: u64,
    /// States admitted.
    pub states_admitted: u64,
    /// Admissions refused for lack of space.
    pub admissions_rejected: u64,
    /// Admissions that cached only part of what they offered for lack of
    /// space: a prefix of the tokens, or some of the new states.
    pub admissions_truncated: u64,
    /// Leases outstanding.
    pub leases: u64,
    /// The α in force.
    pub alpha: f64,
    /// α tuning rounds run.
    pub tuning_rounds: u32,
}

impl Stats {
    /// Hit tokens / input tokens.
    pub fn token_hit_rate(&self) -> f64 {
        ratio(self.hit_tokens as f64, self.input_tokens as f64)
    }
    /// Requests with a hit / requests.
    pub fn request_hit_rate(&self) -> f64 {
        ratio(self.hit_requests as f64, self.requests as f64)
    }
    /// FLOPs saved / FLOPs with no cache.
    pub fn flop_savings_rate(&self) -> f64 {
        ratio(self.flops_saved, self.flops_total)
    }
}

fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 {
        a / b
    } else {
        0.0
    }
}

impl Core {
    pub(crate) fn stats(&self) -> Stats {
        let mut s = self.stats.clone();
        s.kv_bytes = self.kv_tokens.saturating_mul(self.kv_bpt);
        s.state_bytes = self.states.saturating_mul(self.state_b);
        s.states = self.states;
        s.nodes = (self.tree.live_count() - self.tree.roots.len()) as u64;
        s.leases = self.leases.len() as u64;
        s.alpha = self.alpha;
        s
    }
}
