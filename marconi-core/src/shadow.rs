//! Rule choice by shadow caches ([`crate::ShadowConfig`]).
//!
//! No fixed eviction rule set wins on every workload: protecting the
//! states of shared prompts (`protect_branch_states`) helps chat traces
//! with a few popular system prompts and costs on real conversations;
//! plain LRU's leaf order sometimes beats FLOP-aware merging. The window
//! tuner (`crate::tuner`) cannot choose between them on a small cache: its
//! first window is five times the requests before the first eviction, so
//! on most traces it never runs. Shadow caches choose from the first
//! request instead.
//!
//! # Contract
//!
//! - One shadow per candidate: FLOP-aware eviction with
//!   `protect_branch_states` on and off at each α of
//!   [`ShadowConfig::alphas`](crate::ShadowConfig::alphas), and plain LRU.
//!   A shadow is a `Core` of the same model and admission policy, fixed α,
//!   no decision log, no events, no engine ids: metadata only (token ids,
//!   tree, index), no tensors.
//! - Every finished request the cache serves is replayed whole (lookup,
//!   admission of the planned states and the final state, release) on
//!   every shadow, in finishing order, each shadow making its own
//!   decisions. A request served through the engine's separate calls is
//!   replayed at its release with the longest sequence admitted; requests
//!   that overlap in the engine are serialised in the shadows (their
//!   order of release). A request's application checkpoint hints (its
//!   lookup's) are replayed with it, so a shadow plans as the cache did.
//! - Each shadow's score is the tuner's objective (FLOPs saved or tokens
//!   hit) of the requests it served, decayed by half every
//!   [`half_life`](crate::ShadowConfig::half_life) requests. After every
//!   request the cache adopts the rules and α of the best-scoring shadow
//!   when its score exceeds that of the shadow of the rules in force by
//!   the relative [`hysteresis`](crate::ShadowConfig::hysteresis); ties
//!   keep the rules in force. Adopting costs one rebuild of the eviction
//!   index (O(nodes log nodes)) when the rules change, nothing when only α
//!   does. A shadow never changes what the cache holds: it changes only
//!   which candidate the cache's own next eviction picks.
//! - Cost: with `capacity ≤ exact_bytes` every shadow serves every
//!   request at the cache's capacity, so a request costs one lookup and
//!   admission per shadow more (the default three shadows: about four
//!   times the decision time). Above, the shadows are sampled as SHARDS
//!   does (Waldspurger et al., ATC'17): rate `R = exact_bytes / capacity`,
//!   a shadow sees only requests whose namespace and first
//!   `sample_tokens` tokens hash below `R`, at capacity `R × capacity`;
//!   requests that share their first tokens (the turns of one
//!   conversation, the users of one system prompt) are sampled together.
//!   Deterministic: no clock, no thread, no randomness.

use crate::cache::{Core, PrefixCache};
use crate::config::{
    AlphaMode, CacheConfig, EvictionPolicy, ShadowConfig, TunerConfig, TuningObjective,
};
use crate::log::Decision;

/// One candidate rule set and the shadow that scores it.
#[derive(Clone, Debug)]
struct Arm {
    eviction: EvictionPolicy,
    protect: bool,
    /// Whether the shadow tunes α with the window tuner (else its α is fixed).
    tuned: bool,
    cache: PrefixCache,
    score: f64,
}

impl Arm {
    fn rules(&self) -> (EvictionPolicy, bool) {
        (self.eviction, self.protect)
    }
}

/// The shadows of one cache.
#[derive(Clone, Debug)]
pub(crate) struct Shadows {
    cfg: ShadowConfig,
    objective: TuningObjective,
    arms: Vec<Arm>,
    /// The arm whose rules are in force.
    current: usize,
    /// Per-request decay of the scores.
    decay: f64,
    /// A request is sampled when its hash is at most this (`u64::MAX`:
    /// every request).
    threshold: u64,
    switches: u32,
    requests: u64,
}

/// Hash of the namespace and the first `n` tokens (FNV-1a over 32-bit
/// words, then a final mix).
fn sample_hash(ns: u64, tokens: &[u32], n: usize) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325 ^ ns.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    for &t in tokens.iter().take(n) {
        h = (h ^ u64::from(t)).wrapping_mul(0x0000_0100_0000_01b3);
    }
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^= h >> 33;
    h
}

impl Shadows {
    /// The shadows for a cache built from `cfg` (whose α mode is
    /// `Auto(tuner)` with `tuner.shadows` set); the first arm has the
    /// cache's configured rules.
    pub(crate) fn new(cfg: &CacheConfig, tuner: &TunerConfig, scfg: &ShadowConfig) -> Self {
        let rate = if cfg.capacity_bytes <= scfg.exact_bytes {
            1.0
        } else {
            scfg.exact_bytes as f64 / cfg.capacity_bytes as f64
        };
        let threshold = if rate >= 1.0 {
            u64::MAX
        } else {
            (rate * u64::MAX as f64) as u64
        };
        let shadow_capacity = if rate >= 1.0 {
            cfg.capacity_bytes
        } else {
            ((cfg.capacity_bytes as f64 * rate) as u64).max(1)
        };
        let arm_tuner = TunerConfig {
            shadows: None,
            ..tuner.clone()
        };
        // (eviction, protect, Some(α) fixed or None tuned)
        let mut rules: Vec<(EvictionPolicy, bool, Option<f64>)> = Vec::new();
        if cfg.eviction == EvictionPolicy::Lru {
            rules.push((EvictionPolicy::Lru, cfg.protect_branch_states, Some(0.0)));
        }
        for p in [cfg.protect_branch_states, !cfg.protect_branch_states] {
            if scfg.tuned {
                rules.push((EvictionPolicy::FlopAware, p, None));
            }
            for &a in &scfg.alphas {
                rules.push((EvictionPolicy::FlopAware, p, Some(a)));
            }
        }
        if scfg.lru {
            rules.push((EvictionPolicy::Lru, cfg.protect_branch_states, Some(0.0)));
        }
        let mut arms: Vec<Arm> = Vec::new();
        for (eviction, protect, alpha) in rules {
            if arms.iter().any(|a| {
                a.eviction == eviction
                    && (eviction == EvictionPolicy::Lru
                        || (a.protect == protect
                            && a.tuned == alpha.is_none()
                            && (a.tuned || Some(a.cache.alpha()) == alpha)))
            }) {
                continue;
            }
            let c = CacheConfig {
                capacity_bytes: shadow_capacity,
                eviction,
                protect_branch_states: protect,
                alpha: match alpha {
                    Some(a) => AlphaMode::Fixed(a),
                    None => AlphaMode::Auto(arm_tuner.clone()),
                },
                decision_log: false,
                events: false,
                ..cfg.clone()
            };
            // The cache's own configuration validated; a shadow differs only
            // in fields that stay valid.
            let cache = PrefixCache::new(c).expect("a shadow's configuration is valid");
            arms.push(Arm {
                eviction,
                protect,
                tuned: alpha.is_none(),
                cache,
                score: 0.0,
            });
        }
        let decay = match scfg.half_life {
            0 => 1.0,
            h => 0.5f64.powf(1.0 / f64::from(h)),
        };
        Shadows {
            cfg: scfg.clone(),
            objective: tuner.objective,
            arms,
            current: 0,
            decay,
            threshold,
            switches: 0,
            requests: 0,
        }
    }

    /// The α the cache starts with.
    pub(crate) fn initial_alpha(&self) -> f64 {
        self.arms[0].cache.alpha()
    }

    /// A finished request: `full` (the longest sequence admitted, whose
    /// first `input_len` tokens were looked up) in namespace `ns`, served
    /// by every shadow if sampled with its application checkpoint `hints`;
    /// then the best rules are adopted on `core`. Empty `full` (nothing
    /// admitted): nothing to replay.
    pub(crate) fn after_request(
        &mut self,
        core: &mut Core,
        ns: u64,
        input_len: usize,
        full: &[u32],
        hints: &[u32],
    ) {
        self.requests += 1;
        if full.is_empty() || input_len == 0 || input_len > full.len() {
            return;
        }
        if self.threshold != u64::MAX
            && sample_hash(ns, full, self.cfg.sample_tokens as usize) > self.threshold
        {
            return;
        }
        let objective = self.objective;
        let value = |c: &PrefixCache| {
            let s = c.stats();
            match objective {
                TuningObjective::FlopsSaved => s.flops_saved,
                TuningObjective::TokenHits => s.hit_tokens as f64,
            }
        };
        for arm in &mut self.arms {
            let before = value(&arm.cache);
            // The cache accepted this request; a shadow of the same model,
            // admission and grids accepts it too. Should it refuse, its
            // score simply gains nothing.
            let _ = arm.cache.serve_full_hinted(ns, input_len, full, hints);
            arm.score = arm.score * self.decay + (value(&arm.cache) - before);
        }
        self.adopt_best(core);
        // A tuned shadow's α follows its own tuning.
        core.alpha = self.arms[self.current].cache.alpha();
    }

    /// Each shadow's score, for tests.
    #[cfg(test)]
    pub(crate) fn scores(&self) -> Vec<f64> {
        self.arms.iter().map(|a| a.score).collect()
    }

    fn adopt_best(&mut self, core: &mut Core) {
        let mut best = self.current;
        for (i, a) in self.arms.iter().enumerate() {
            if a.score > self.arms[best].score {
                best = i;
            }
        }
        let now = self.arms[self.current].score;
        if best == self.current || self.arms[best].score <= now * (1.0 + self.cfg.hysteresis) {
            return;
        }
        let (old_rules, old_alpha) = (self.arms[self.current].rules(), core.alpha);
        self.current = best;
        let arm = &self.arms[best];
        core.set_eviction_rules(arm.eviction, arm.protect);
        self.switches += 1;
        let round = self.switches;
        let requests = u32::try_from(self.requests).unwrap_or(u32::MAX);
        if old_rules != arm.rules() {
            let (lru, protect_branch_states) = (arm.eviction == EvictionPolicy::Lru, arm.protect);
            core.log.push(|| Decision::Rules {
                round,
                lru,
                protect_branch_states,
            });
        }
        let new = arm.cache.alpha();
        if old_alpha.to_bits() != new.to_bits() {
            let (at_new, at_now) = (arm.score, now);
            core.log.push(|| Decision::Alpha {
                round,
                requests,
                old: old_alpha,
                new,
                objective_at_zero: at_now,
                objective_at_new: at_new,
            });
        }
        core.stats.tuning_rounds = round;
    }
}

#[cfg(test)]
mod tests {
    use super::sample_hash;

    #[test]
    fn the_sample_hash_reads_only_the_leading_tokens_and_the_namespace() {
        let a: Vec<u32> = (0..100).collect();
        let mut b = a.clone();
        b[80] = 7;
        assert_eq!(sample_hash(3, &a, 64), sample_hash(3, &b, 64));
        b[10] = 7;
        assert_ne!(sample_hash(3, &a, 64), sample_hash(3, &b, 64));
        assert_ne!(sample_hash(3, &a, 64), sample_hash(4, &a, 64));
    }
}
