//! # marconi-events
//!
//! libmarconi's cache events as vLLM KV cache events, so that the routers
//! that read vLLM's stream read a libmarconi engine's too, plus the
//! recurrent-state events a hybrid-aware router needs. `docs/events.md` is
//! the wire contract; this crate implements it:
//!
//! - [`hash`]: vLLM's chained block hashes (`sha256_cbor`, seed
//!   `"vllm-none-hash"` by default);
//! - [`wire`]: `BlockStored` / `BlockRemoved` / `AllBlocksCleared` in a
//!   `KVEventBatch`, MessagePack byte for byte as msgspec writes them (map
//!   or legacy array layout), and a decoder for subscribers;
//! - [`Encoder`]: from `marconi_core::CacheEvent`s (drained from a cache
//!   built with `CacheConfig::events`) to wire events; [`Mirror`]: the set a
//!   subscriber rebuilds;
//! - `Publisher` (feature `publisher`, default on): ZeroMQ PUB `[topic, seq, payload]` and a ROUTER that
//!   replays from a sequence number (vLLM's `ZmqEventPublisher` framing).
//!
//! ```
//! use marconi_core::{CacheConfig, ModelSpec, PrefixCache};
//! use marconi_events::{decode_batch, Encoder, EncoderConfig, Mirror};
//!
//! let mut cfg = CacheConfig::marconi(ModelSpec::preset("paper-7b").unwrap(), 10_000_000_000);
//! cfg.events = true;
//! let mut cache = PrefixCache::new(cfg).unwrap();
//! cache.serve(0, &[1, 2, 3, 4, 5, 6, 7, 8], &[9, 10]).unwrap();
//!
//! let mut enc = Encoder::new(EncoderConfig::new(cache.config().page_size)).unwrap();
//! let payload = enc.encode(1.0, &cache.drain_events());
//! let batch = decode_batch(&payload).unwrap();
//! let mut view = Mirror::default();
//! view.apply(&batch.events);
//! assert_eq!(view.set.len(), 10 + 1); // ten 1-token blocks and the final state
//! ```
#![forbid(unsafe_code)]

mod encoder;
pub mod hash;
#[cfg(feature = "publisher")]
mod publisher;
pub mod wire;

pub use encoder::{to_decoded, ConfigError, Encoder, EncoderConfig, Mirror};
pub use hash::{external, BlockHasher, Digest32, Namespaces, DEFAULT_SEED};
#[cfg(feature = "publisher")]
pub use publisher::{PublishError, Publisher, PublisherConfig, PublisherStats, END_SEQ};
pub use wire::{
    decode_batch, encode_batch, DecodeError, DecodedBatch, DecodedEvent, HashFormat, Layout,
    WireEvent, WireOptions, GROUP_KV, GROUP_STATE,
};
