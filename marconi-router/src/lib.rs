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
//!
//! One engine caches 4 blocks of 16 tokens and a state after the second;
//! a request sharing those 64 tokens (and going on) can skip 32 of them on
//! a hybrid model, although 64 match in KV:
//!
//! ```
//! use marconi_router::hash::{ChainHasher, DEFAULT_SEED};
//! use marconi_router::{Index, IndexEvent};
//!
//! let mut index = Index::new(16)?; // block size = the engines' page size
//! let e = index.add_engine("engine-0")?;
//! let hasher = ChainHasher::new(DEFAULT_SEED, 16);
//! let cached: Vec<u32> = (0..64).collect();
//! let mut blocks = Vec::new();
//! hasher.wire_hashes(&cached, 0, &mut blocks);
//! // Events as the engine's stream carries them (decoded by `wire`).
//! index.apply(e, &IndexEvent::BlocksStored { block_hashes: blocks.clone(), block_size: 16 })?;
//! index.apply(e, &IndexEvent::StateStored { block_hash: blocks[1] })?;
//!
//! let request: Vec<u32> = (0..100).collect();
//! let (mut hashes, mut out) = (Vec::new(), Vec::new());
//! hasher.wire_hashes(&request, 0, &mut hashes);
//! index.overlap_hashes(&hashes, request.len(), &mut out);
//! assert_eq!((out[0].kv_matched_tokens, out[0].resumable_tokens), (64, 32));
//! # Ok::<(), marconi_router::IndexError>(())
//! ```

pub mod hash;
pub mod index;
pub mod serve;
pub mod sub;
pub mod wire;

pub use index::{
    BlockHash, EngineId, EngineStats, Index, IndexError, IndexEvent, Overlap, MAX_ENGINES,
};
