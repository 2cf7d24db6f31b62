//! # marconi-router
//!
//! The router side of libmarconi's cache events: an index of what N
//! engines have cached, fed by their event streams (in process, or over
//! ZeroMQ with gaps repaired by replay), answering per engine how many
//! leading tokens of a request have KV cached (`kv_matched_tokens`, what
//! KV-aware routers use today) and how many can actually be skipped by a
//! hybrid model (`resumable_tokens`: the deepest recurrent state within
//! that match).
//!
//! - [`index`]: the index and its events;
//! - [`hash`]: the chained block hashes, from token ids;
//! - [`wire`]: the `KVEventBatch` payload decoder;
//! - [`sub`]: the ZeroMQ subscriber with replay of gaps;
//! - [`serve`]: NVIDIA Dynamo's standalone indexer HTTP API with
//!   resumable scores (the `marconi-router serve` binary).

pub mod hash;
pub mod index;
pub mod serve;
pub mod sub;
pub mod wire;

pub use index::{
    BlockHash, EngineId, EngineStats, Index, IndexError, IndexEvent, Overlap, MAX_ENGINES,
};
