//! The host tier's bytes: carries out `marconi_core::TieredCache` decisions
//! (its [`Move`]s into the host tier and the [`LoadOrder`]s read from it)
//! over a [`HostPool`].
//!
//! Core's host tier is a `PrefixCache` that tracks no page or slot ids of
//! its own (its entries are admitted without ids, so its load orders carry
//! none): an entry is a chain, `(namespace, tokens[..position])`, holding
//! the state at `position` and the KV of `0..position`. [`HostTier`] keys
//! its host units by that chain:
//!
//! - [`HostTier::demote`] runs one [`Move`] to the host: it allocates a state
//!   slot and the chain's KV pages in the host pool and copies the device's
//!   state and pages into them (one batch, all or nothing).
//! - [`HostTier::load`] runs a lookup's host [`LoadOrder`]s: the state from
//!   the entry at the hit, each KV range from an entry whose chain covers it
//!   (the first chain in order that starts with the range's tokens), copied
//!   into the request's device slot and pages in one batch. An order for
//!   which no entry is held is refused ([`TierMoveError::Missing`]): the
//!   engine recomputes, it never reads another chain's bytes.
//! - [`HostTier::sync`] frees the units of chains core's host tier no longer
//!   holds (its evictions), read from `PrefixCache::cached_chains`.
//!
//! An engine that owns its device memory (CUDA, its own allocator) takes
//! the same decisions as orders and copies on its own stream:
//! [`HostTier::demote_units`] gives the host units a move fills,
//! [`HostTier::load_units`] the `(host unit, device target)` copies of a
//! load; `pool().address(..)` is where each host unit lies.
//!
//! Entries do not share pages: a chain's pages are its own, so the host
//! pool needs room for every held chain's full KV (more than the tier's
//! byte count, which charges a shared prefix once).

use std::collections::{BTreeMap, HashSet};

use marconi_core::{CacheEvent, LoadOrder, LoadWhat, Move, PrefixCache, Tier, WriteMode};

use crate::error::AllocError;
use crate::handle::{PoolKind, VirtualHandle};
use crate::host::{HostPool, MoveError, UnitMemory};

/// The host units of one chain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostEntry {
    /// The state slot holding the state at the chain's end.
    pub state: VirtualHandle,
    /// The KV pages of tokens `0..position`, page `i` holding tokens
    /// `i * page_tokens..`.
    pub pages: Vec<VirtualHandle>,
}

/// Where a host load writes on the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoadTarget {
    /// The request's state slot.
    State,
    /// The request's KV page at this index (page `i` holds tokens
    /// `i * page_tokens..`).
    Page(u32),
}

/// One copy of a host load ([`HostTier::load_units`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoadCopy {
    /// The host unit read.
    pub from: VirtualHandle,
    /// Where it goes.
    pub to: LoadTarget,
}

/// Why a tier move was refused; nothing was copied or changed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TierMoveError {
    /// The move is into another tier than the host.
    #[error("a move into the {0:?} tier is not the host tier's")]
    NotHost(Tier),
    /// The chain given does not have the move's length.
    #[error("move at position {position} given a chain of {tokens} tokens")]
    ChainLength {
        /// The move's position.
        position: u32,
        /// Tokens given.
        tokens: usize,
    },
    /// The page list does not cover the tokens it must.
    #[error("{given} pages given, {needed} needed")]
    PageCount {
        /// Pages needed.
        needed: usize,
        /// Pages given.
        given: usize,
    },
    /// The host pool could not hold the chain (out of capacity).
    #[error("host pool: {0}")]
    Alloc(AllocError),
    /// A copy pair was refused (bad, foreign or stale handle, wrong size).
    #[error(transparent)]
    Move(#[from] MoveError),
    /// A host load for which no chain is held.
    #[error("no host entry in namespace {ns} covers tokens 0..{end}")]
    Missing {
        /// Namespace.
        ns: u64,
        /// End of the tokens looked for.
        end: u32,
    },
    /// An order lies outside the input it was looked up with.
    #[error("order up to token {end} beyond an input of {len} tokens")]
    BeyondInput {
        /// End of the order.
        end: u32,
        /// Input length.
        len: usize,
    },
}

/// Host units of the host tier's chains, over a [`HostPool`].
#[derive(Debug)]
pub struct HostTier {
    pool: HostPool,
    page_tokens: u32,
    entries: BTreeMap<(u64, Vec<u32>), HostEntry>,
}

impl HostTier {
    /// A host tier over `pool`, whose KV pages hold `page_tokens` tokens
    /// each (the device's page size).
    ///
    /// # Errors
    /// [`AllocError::InvalidConfig`] when `page_tokens` is 0.
    pub fn new(pool: HostPool, page_tokens: u32) -> Result<Self, AllocError> {
        if page_tokens == 0 {
            return Err(AllocError::InvalidConfig("page_tokens 0".into()));
        }
        Ok(HostTier {
            pool,
            page_tokens,
            entries: BTreeMap::new(),
        })
    }

    /// The host pool.
    #[must_use]
    pub fn pool(&self) -> &HostPool {
        &self.pool
    }

    /// Chains held.
    #[must_use]
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether no chain is held.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The units of chain `(ns, chain)`, if held.
    #[must_use]
    pub fn entry(&self, ns: u64, chain: &[u32]) -> Option<&HostEntry> {
        self.entries.get(&(ns, chain.to_vec()))
    }

    fn pages_for(&self, tokens: u32) -> usize {
        tokens.div_ceil(self.page_tokens) as usize
    }

    /// Carries out `mv`: copies the device's `state` slot and `pages` (the
    /// chain's KV pages, `ceil(position / page_tokens)` of them) into host
    /// units kept for `(mv.ns, chain)`, `chain` being the move's tokens
    /// (`prefix[..position]` of the device's `StateRemoved`/`StateStored`
    /// event). A chain already held is overwritten in place. Returns the
    /// bytes copied.
    ///
    /// # Errors
    /// [`TierMoveError`]; nothing is allocated or copied then.
    pub fn demote<D: UnitMemory>(
        &mut self,
        mv: &Move,
        chain: &[u32],
        device: &D,
        state: VirtualHandle,
        pages: &[VirtualHandle],
    ) -> Result<u64, TierMoveError> {
        self.check_move(mv, chain)?;
        let needed = self.pages_for(mv.position);
        if pages.len() != needed {
            return Err(TierMoveError::PageCount {
                needed,
                given: pages.len(),
            });
        }
        let key = (mv.ns, chain.to_vec());
        let (entry, fresh) = match self.entries.get(&key) {
            Some(e) => (e.clone(), false),
            None => (self.allocate(needed)?, true),
        };
        let pairs: Vec<_> = std::iter::once((state, entry.state))
            .chain(pages.iter().copied().zip(entry.pages.iter().copied()))
            .collect();
        match self.pool.demote(device, &pairs) {
            Ok(bytes) => {
                self.entries.insert(key, entry);
                Ok(bytes)
            }
            Err(e) => {
                if fresh {
                    self.release(&entry);
                }
                Err(e.into())
            }
        }
    }

    /// For an engine that owns its device memory (CUDA, its own
    /// allocator): the host units that receive `mv`'s chain, allocated (or
    /// the ones already held for it), without copying. The engine copies
    /// the chain's state and its `ceil(position / page_tokens)` pages, in
    /// order, to `pool().address(..)` of each before it reuses its own
    /// units or loads this chain.
    ///
    /// # Errors
    /// [`TierMoveError::NotHost`], [`TierMoveError::ChainLength`],
    /// [`TierMoveError::Alloc`]; nothing is allocated then.
    pub fn demote_units(&mut self, mv: &Move, chain: &[u32]) -> Result<HostEntry, TierMoveError> {
        self.check_move(mv, chain)?;
        let key = (mv.ns, chain.to_vec());
        if let Some(e) = self.entries.get(&key) {
            return Ok(e.clone());
        }
        let entry = self.allocate(self.pages_for(mv.position))?;
        self.entries.insert(key, entry.clone());
        Ok(entry)
    }

    fn check_move(&self, mv: &Move, chain: &[u32]) -> Result<(), TierMoveError> {
        if mv.to != Tier::Host {
            return Err(TierMoveError::NotHost(mv.to));
        }
        if chain.len() != mv.position as usize {
            return Err(TierMoveError::ChainLength {
                position: mv.position,
                tokens: chain.len(),
            });
        }
        Ok(())
    }

    fn allocate(&mut self, pages: usize) -> Result<HostEntry, TierMoveError> {
        let n = u32::try_from(pages).map_err(|_| {
            TierMoveError::Alloc(AllocError::OutOfCapacity {
                pool: PoolKind::Kv,
                requested: u32::MAX,
                free: self.pool.free_units(PoolKind::Kv),
                capacity: self.pool.capacity(PoolKind::Kv),
            })
        })?;
        let mut state = Vec::with_capacity(1);
        self.pool
            .allocate(PoolKind::Ssm, 1, &mut state)
            .map_err(TierMoveError::Alloc)?;
        let mut kv = Vec::with_capacity(pages);
        if let Err(e) = self.pool.allocate(PoolKind::Kv, n, &mut kv) {
            let _ = self.pool.free(&state);
            return Err(TierMoveError::Alloc(e));
        }
        Ok(HostEntry {
            state: state[0],
            pages: kv,
        })
    }

    fn release(&mut self, e: &HostEntry) {
        // Units this tier allocated and still holds: cannot be refused.
        let _ = self.pool.free(&[e.state]);
        let _ = self.pool.free(&e.pages);
    }

    /// Carries out the host orders of a lookup of `input` in namespace `ns`
    /// (`TieredLookup::loads`; other tiers' orders are left to their
    /// executors): the state into the device slot `state`, each KV range
    /// `start..end` into `pages[start / page_tokens..ceil(end /
    /// page_tokens)]` (`pages` are the request's device pages from token 0).
    /// One batch, all or nothing; returns the bytes copied.
    ///
    /// The last page of a range that ends inside a page is copied whole:
    /// its tokens past `end` are the engine's to overwrite when it prefills
    /// from the hit.
    ///
    /// # Errors
    /// [`TierMoveError`]; nothing is copied then.
    pub fn load<D: UnitMemory>(
        &mut self,
        ns: u64,
        input: &[u32],
        orders: &[LoadOrder],
        device: &mut D,
        state: VirtualHandle,
        pages: &[VirtualHandle],
    ) -> Result<u64, TierMoveError> {
        let copies = self.load_units(ns, input, orders)?;
        let mut pairs = Vec::with_capacity(copies.len());
        for c in copies {
            let dst = match c.to {
                LoadTarget::State => state,
                LoadTarget::Page(p) => *pages.get(p as usize).ok_or(TierMoveError::PageCount {
                    needed: p as usize + 1,
                    given: pages.len(),
                })?,
            };
            pairs.push((c.from, dst));
        }
        Ok(self.pool.promote(device, &pairs)?)
    }

    /// For an engine that owns its device memory: the copies `load` would
    /// run, as orders: each host unit to read (`pool().address(..)`) and
    /// where it goes, the request's state slot or its page at an index
    /// from token 0. Nothing is copied; the units stay held until
    /// [`HostTier::sync`] sees core drop their chain, so copy them before
    /// the next `sync`.
    ///
    /// # Errors
    /// [`TierMoveError::Missing`] or [`TierMoveError::BeyondInput`].
    pub fn load_units(
        &self,
        ns: u64,
        input: &[u32],
        orders: &[LoadOrder],
    ) -> Result<Vec<LoadCopy>, TierMoveError> {
        let mut out = Vec::new();
        for o in orders.iter().filter(|o| o.tier == Tier::Host) {
            match &o.what {
                LoadWhat::State { position, .. } => {
                    let chain = self.prefix(input, *position)?;
                    let e = self
                        .entries
                        .get(&(ns, chain.to_vec()))
                        .ok_or(TierMoveError::Missing { ns, end: *position })?;
                    out.push(LoadCopy {
                        from: e.state,
                        to: LoadTarget::State,
                    });
                }
                LoadWhat::Kv { start, end, .. } => {
                    if end <= start {
                        continue;
                    }
                    let chain = self.prefix(input, *end)?;
                    let e = self
                        .covering(ns, chain)
                        .ok_or(TierMoveError::Missing { ns, end: *end })?;
                    let (first, last) = ((start / self.page_tokens) as usize, self.pages_for(*end));
                    // A covering chain has at least `last` pages.
                    let src = e
                        .pages
                        .get(first..last)
                        .ok_or(TierMoveError::Missing { ns, end: *end })?;
                    out.extend(src.iter().zip(first..).map(|(&from, p)| LoadCopy {
                        from,
                        // Cannot truncate: at most ceil(u32::MAX / page_tokens) pages.
                        to: LoadTarget::Page(p as u32),
                    }));
                }
            }
        }
        Ok(out)
    }

    fn prefix<'a>(&self, input: &'a [u32], end: u32) -> Result<&'a [u32], TierMoveError> {
        input.get(..end as usize).ok_or(TierMoveError::BeyondInput {
            end,
            len: input.len(),
        })
    }

    /// The first held chain of `ns` (in token order) that starts with
    /// `tokens`: chains sharing a prefix sort together, right after it.
    fn covering(&self, ns: u64, tokens: &[u32]) -> Option<&HostEntry> {
        let ((found_ns, chain), e) = self.entries.range((ns, tokens.to_vec())..).next()?;
        (*found_ns == ns && chain.starts_with(tokens)).then_some(e)
    }

    /// Frees the units of every chain `host` (core's host tier,
    /// `TieredCache::tier(Tier::Host)`) no longer holds a state for.
    /// Returns the chains dropped. Costs `PrefixCache::cached_chains`: call
    /// it after a batch of moves, off the request path.
    pub fn sync(&mut self, host: &PrefixCache) -> usize {
        let held: HashSet<(u64, Vec<u32>)> = host.cached_chains().states.into_iter().collect();
        let gone: Vec<(u64, Vec<u32>)> = self
            .entries
            .keys()
            .filter(|k| !held.contains(*k))
            .cloned()
            .collect();
        for k in &gone {
            if let Some(e) = self.entries.remove(k) {
                self.release(&e);
            }
        }
        gone.len()
    }
}

/// The chain each host move carries, read from the device's events of the
/// same interval (`TieredCache::drain_device_events`, with the device's
/// events on): each move into the host is paired, in order, with the first
/// unpaired `StateRemoved` (write-back) or `StateStored` (write-through)
/// event of its namespace and position, and gets `prefix[..position]`.
/// Moves into the store, and host moves with no such event (a request's
/// states the device could not hold, whose tokens are the request's), get
/// `None`, except that a host move no event explains is a state of the
/// request just admitted that the device could not hold (`TieredCache::admit`
/// writes those straight to the host): with `admitted` (that request's
/// namespace and tokens) it gets `tokens[..position]`.
///
/// A pairing can only go wrong when two chains of one namespace and length
/// leave the device in one interval and core keeps the later one only;
/// the executor then holds the earlier chain's own bytes under its own key,
/// which [`HostTier::sync`] drops: a miss, never another chain's bytes.
#[must_use]
pub fn move_chains<'a>(
    moves: &[Move],
    events: &'a [CacheEvent],
    write: WriteMode,
    admitted: Option<(u64, &'a [u32])>,
) -> Vec<Option<&'a [u32]>> {
    let mut used = vec![false; events.len()];
    let mut from = 0;
    moves
        .iter()
        .map(|m| {
            if m.to != Tier::Host {
                return None;
            }
            let found = events.iter().enumerate().skip(from).find(|(i, e)| {
                !used[*i]
                    && match (e, write) {
                        (CacheEvent::StateRemoved { ns, position, .. }, WriteMode::Back)
                        | (CacheEvent::StateStored { ns, position, .. }, WriteMode::Through) => {
                            *ns == m.ns && *position == m.position
                        }
                        _ => false,
                    }
            });
            let Some((i, e)) = found else {
                return admitted
                    .filter(|(ns, _)| *ns == m.ns)
                    .and_then(|(_, tokens)| tokens.get(..m.position as usize));
            };
            used[i] = true;
            from = i + 1;
            match e {
                CacheEvent::StateRemoved { prefix, .. }
                | CacheEvent::StateStored { prefix, .. } => prefix.get(..m.position as usize),
                _ => None,
            }
        })
        .collect()
}
