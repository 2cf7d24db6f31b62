//! marconi-gpu: memory for hybrid-model prefix caches.
//!
//! - [`handle`]: 32-bit generational [`VirtualHandle`]s tagged by pool.
//! - [`alloc`]: the [`PoolAllocator`] trait and its layouts: AVMP [`DualPool`]
//!   (static split or dynamic capacity migration, paper §3.1–3.2) and vLLM's
//!   [`PaddedUnified`] baseline.
//! - [`phys`]: a physical-memory trait shaped like the CUDA virtual memory API, a
//!   Linux memfd host backend, and [`phys::BackedPool`] which backs the two pools
//!   with real chunks and moves them on migration (never more than the budget).
//! - [`avmp`]: the replay harness that reproduces the AVMP paper's Table 1.
//! - [`policy`]: a migration policy beyond the paper.
//! - [`plan`]: start-up memory planning (KV tokens and state slots per split,
//!   largest batch × context, the split AVMP reaches on a trace).
//! - [`pooled`]: the prefix cache over the pools ([`pooled::PooledCache`]):
//!   admission allocates handles, eviction frees them, capacity is the pools'.
//! - [`host`]: host tier memory ([`host::HostPool`]: KV pages and state slots
//!   in a memfd, pinned for CUDA where it can be) and the demote/promote copies
//!   between device and host handles.
//! - [`tiers`]: [`tiers::HostTier`] carries out core's tier decisions (moves
//!   into the host tier, loads from it) over a host pool.
//!
//! Two pools over one budget, a KV page and a state block allocated, the
//! block resolved to its bytes, freed, and a freed handle refused:
//!
//! ```
//! use marconi_gpu::{AllocError, DualPool, DualPoolConfig, MigrationPolicy, PoolAllocator, PoolKind};
//!
//! let mut pools = DualPool::new(
//!     "example",
//!     DualPoolConfig {
//!         total_bytes: 64 << 20,
//!         ssm_ratio: 0.5,
//!         kv_unit: 64 << 10,  // one KV page
//!         ssm_unit: 2 << 20,  // one request's recurrent state
//!         policy: MigrationPolicy::Static,
//!     },
//! )?;
//! let mut handles = Vec::new();
//! pools.allocate(PoolKind::Kv, 1, &mut handles)?;
//! pools.allocate(PoolKind::Ssm, 1, &mut handles)?;
//! let state = pools.resolve(handles[1])?;
//! assert_eq!((state.table, state.unit_bytes), (PoolKind::Ssm, 2 << 20));
//! pools.free(handles[1])?;
//! assert_eq!(pools.free(handles[1]), Err(AllocError::DoubleFree(handles[1].raw())));
//! # Ok::<(), AllocError>(())
//! ```
//!
//! The libmarconi repository's ARCHITECTURE.md maps the code.

pub mod alloc;
pub mod avmp;
#[cfg(feature = "cuda")]
pub mod cuda;
mod error;
pub mod handle;
pub mod host;
pub mod phys;
pub mod plan;
pub mod policy;
pub mod pooled;
pub mod snapshot;
mod table;
pub mod tiers;

pub use alloc::{
    AllocStats, DualPool, DualPoolConfig, Location, Migration, MigrationPolicy, ModelShape,
    PaddedUnified, PoolAllocator, Pressure,
};
pub use error::{AllocError, MigrationRefusal};
pub use handle::{HandleLayout, PoolKind, VirtualHandle};
