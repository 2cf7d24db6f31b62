//! # marconi-core
//!
//! The logic of a prefix cache for hybrid LLMs, whose recurrent (SSM,
//! linear-attention) layers keep one fixed-size state that cannot be rolled
//! back: a prefix is reusable only where a state was saved at exactly its
//! end. The cache keeps a radix tree of token sequences with their KV and
//! their state checkpoints, decides which states to save (Marconi's
//! judicious admission, paper §4.1), which entries to evict (FLOP-aware
//! eviction, §4.2–4.3) and tunes the balance α online.
//!
//! Pure and deterministic: no I/O, no clock, no randomness, no unsafe. The
//! engine owns device memory; the cache deals in ids and byte sizes.
//!
//! ```
//! use marconi_core::{CacheConfig, ModelSpec, PrefixCache, SavedState};
//!
//! let model = ModelSpec::preset("paper-7b").unwrap();
//! let mut cache = PrefixCache::new(CacheConfig::marconi(model, 10_000_000_000)).unwrap();
//! let prompt: Vec<u32> = (0..100).collect();
//! let l = cache.lookup(0, &prompt).unwrap();
//! assert_eq!(l.hit_tokens, 0);
//! // ... prefill and decode 20 tokens, saving the final state in slot 7 ...
//! let mut seq = prompt.clone();
//! seq.extend(1000..1020);
//! cache.admit(l.lease, &seq, &[SavedState { position: 120, slot: Some(7) }], &[]).unwrap();
//! cache.release(l.lease).unwrap();
//! // The next turn resumes from the state after the last decoded token.
//! seq.extend(2000..2010);
//! let l = cache.lookup(0, &seq).unwrap();
//! assert_eq!((l.hit_tokens, l.state_slot), (120, Some(7)));
//! ```
#![forbid(unsafe_code)]

mod admission;
mod cache;
mod config;
mod error;
mod events;
mod eviction;
mod idset;
mod index;
mod invariants;
mod log;
mod lookup;
mod model;
mod shadow;
mod stats;
mod tiers;
mod tree;
mod tuner;

pub use admission::{AdmitOutcome, SavedState};
pub use cache::{LeaseId, PrefixCache, Served, TOKEN_ID_BYTES};
pub use config::{
    AdmissionPolicy, AlphaAdoption, AlphaMode, CacheConfig, EvictionPolicy, ShadowConfig,
    TunerConfig, TuningObjective, DEFAULT_MIN_BRANCH_DEPTH, DEFAULT_SUPERSEDED_AGE,
};
pub use error::CacheError;
pub use events::{CacheEvent, CachedChains};
pub use eviction::{Freed, UnitBudget, UnitKind, UnitUse};
pub use gguf::{GgufError, GGUF_ARCHITECTURES};
pub use hf_config::{HfConfigError, HF_MODEL_TYPES};
pub use log::{Decision, EvictKind, PlanReason};
pub use lookup::{Lookup, LookupOptions, Peek};
pub use model::{gguf, hf_config};
pub use model::{LayerFlops, ModelSpec, PRESET_NAMES};
pub use stats::Stats;
pub use tiers::{
    LoadOrder, LoadWhat, Move, StoreProbe, Tier, TierConfig, TierOp, TierSpec, TierStats,
    TieredCache, TieredLookup, WriteMode,
};

/// The README's Rust snippet, compiled and run as a doctest so that it stays
/// true (`cargo test -p marconi-core --doc`). Only under `cfg(doctest)`: the
/// README lies outside the published crate.
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
pub struct ReadmeDoctests;
