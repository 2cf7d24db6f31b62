//! From the cache's events (`marconi_core::CacheEvent`) to wire events:
//! blocks of `block_size` tokens, chained digests, state keys
//! (docs/events.md §1, §3, §4); and the mirror a subscriber rebuilds.

use std::collections::hash_map::Entry;
use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasher, BuildHasherDefault, Hasher};
use std::sync::Arc;

use xxhash_rust::xxh3::Xxh3;

use marconi_core::{CacheEvent, CachedChains};

use crate::hash::{external, BlockHasher, Digest32};
use crate::wire::{encode_batch, DecodedEvent, WireEvent, WireOptions, GROUP_KV, GROUP_STATE};

/// What an [`Encoder`] is built from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EncoderConfig {
    /// Tokens per block: the cache's page size.
    pub block_size: u32,
    /// The `NONE_HASH` seed (vLLM's `PYTHONHASHSEED`, or its default).
    pub seed: String,
    /// Whether state events (group 1) are published.
    pub states: bool,
    /// How batches are written.
    pub wire: WireOptions,
}

impl EncoderConfig {
    /// Defaults for a cache of `block_size`-token pages: seed
    /// `"vllm-none-hash"`, states on, integer hashes, map layout, medium GPU.
    pub fn new(block_size: u32) -> Self {
        EncoderConfig {
            block_size,
            seed: crate::hash::DEFAULT_SEED.into(),
            states: true,
            wire: WireOptions::default(),
        }
    }
}

/// Why an encoder cannot be built.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ConfigError {
    /// `block_size` is 0.
    #[error("block_size is 0")]
    ZeroBlockSize,
}

/// Most block digests the encoder remembers (about 80 bytes each); past
/// it the memo starts over (the next events rehash their chains once).
const MEMO_CAP: usize = 1 << 20;

/// Turns cache events into wire events.
///
/// Every event carries its whole chain of tokens, but only its own blocks
/// are new: the digests of the blocks before them were computed when those
/// blocks were stored. The encoder remembers the digest of every block it
/// saw stored (until it sees it removed), keyed by a 128-bit XXH3 of the
/// namespace and the tokens from 0 to the block's end under a secret drawn
/// at random per encoder, so an event costs one pass of XXH3 over its chain
/// (memory speed) plus SHA-256 of its new blocks only, instead of SHA-256
/// of the whole chain (about 1 µs per block). What goes on the wire is
/// always the SHA-256 chain; the XXH3 key only finds it. Two chains with
/// the same key would make an event carry the other chain's hash: with a
/// random secret and 128 bits, not a concern short of 2^64 blocks.
pub struct Encoder {
    cfg: EncoderConfig,
    hasher: BlockHasher,
    secret: [u8; 192],
    /// XXH3 key of a chain prefix ending on a block boundary → the digest
    /// of its last block.
    memo: HashMap<u128, Digest32, BuildHasherDefault<KeyHasher>>,
    /// Blocks hashed with SHA-256 so far.
    hashed: u64,
    /// Times the memo lacked a parent and a chain was hashed from block 0.
    cold: u64,
}

impl std::fmt::Debug for Encoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Encoder")
            .field("cfg", &self.cfg)
            .field("memo_blocks", &self.memo.len())
            .finish_non_exhaustive()
    }
}

/// The memo's keys are XXH3 outputs already: their low 64 bits index the
/// table, with no second hash.
#[derive(Default)]
struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        // Only u128 keys are hashed (write_u128); a fallback for others.
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }
    fn write_u128(&mut self, k: u128) {
        self.0 = k as u64;
    }
}

/// 192 random bytes from the process's random hash keys.
fn random_secret() -> [u8; 192] {
    let state = std::collections::hash_map::RandomState::new();
    let mut out = [0u8; 192];
    for (i, chunk) in out.chunks_exact_mut(8).enumerate() {
        let mut h = state.build_hasher();
        h.write_usize(i);
        chunk.copy_from_slice(&h.finish().to_le_bytes());
    }
    out
}

/// The bytes of a token slice (native order: the key never leaves the
/// process).
fn token_bytes(t: &[u32]) -> &[u8] {
    bytemuck::cast_slice(t)
}

impl Encoder {
    /// An encoder; fails on a zero block size.
    pub fn new(cfg: EncoderConfig) -> Result<Self, ConfigError> {
        if cfg.block_size == 0 {
            return Err(ConfigError::ZeroBlockSize);
        }
        Ok(Encoder {
            hasher: BlockHasher::new(&cfg.seed).with_namespaces(cfg.wire.namespaces),
            cfg,
            secret: random_secret(),
            memo: HashMap::default(),
            hashed: 0,
            cold: 0,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &EncoderConfig {
        &self.cfg
    }

    /// Block digests the encoder remembers: those of the blocks it saw
    /// stored and not yet removed (at most about a million; past that it
    /// starts over).
    pub fn remembered_blocks(&self) -> usize {
        self.memo.len()
    }

    /// Blocks hashed with SHA-256 so far, and how many times a chain was
    /// hashed from its first block because the memo lacked its parent.
    pub fn hash_counts(&self) -> (u64, u64) {
        (self.hashed, self.cold)
    }

    /// The hasher (for consumers computing the same hashes).
    pub fn hasher(&self) -> &BlockHasher {
        &self.hasher
    }

    /// The XXH3 stream over `ns` and `prefix[..lo * bs]`.
    fn stream(&self, ns: u64, prefix: &[u32], lo: usize) -> Xxh3 {
        let mut h = Xxh3::with_secret(self.secret);
        h.update(&ns.to_le_bytes());
        h.update(token_bytes(&prefix[..lo * self.cfg.block_size as usize]));
        h
    }

    /// The digests of blocks `lo..hi` of `prefix` and their memo keys,
    /// from the memo where it has them (the digest of block `lo - 1`
    /// included), hashing only the blocks it lacks.
    fn keyed_digests(
        &mut self,
        ns: u64,
        prefix: &[u32],
        lo: usize,
        hi: usize,
    ) -> Vec<(u128, Digest32)> {
        let bs = self.cfg.block_size as usize;
        let mut h = self.stream(ns, prefix, lo);
        let mut parent = if lo == 0 {
            None
        } else {
            match self.memo.get(&h.digest128()) {
                Some(d) => Some(*d),
                None => {
                    // The block before `lo` was never seen stored (a memo
                    // started over, or events turned on for a hand-made
                    // stream): hash the chain from block 0 once.
                    self.cold += 1;
                    let all = self.keyed_digests(ns, prefix, 0, hi);
                    return all[lo..].to_vec();
                }
            }
        };
        if self.memo.len() + (hi - lo) > MEMO_CAP {
            self.memo.clear();
        }
        self.memo.reserve(hi.saturating_sub(lo));
        let mut out = Vec::with_capacity(hi.saturating_sub(lo));
        for j in lo..hi {
            let block = &prefix[j * bs..(j + 1) * bs];
            h.update(token_bytes(block));
            let key = h.digest128();
            let d = match self.memo.entry(key) {
                Entry::Occupied(e) => *e.get(),
                Entry::Vacant(e) => {
                    self.hashed += 1;
                    *e.insert(self.hasher.hash_block(parent.as_ref(), block, ns))
                }
            };
            out.push((key, d));
            parent = Some(d);
        }
        out
    }

    /// The digests of blocks `lo..hi` of `prefix`.
    fn digests(&mut self, ns: u64, prefix: &[u32], lo: usize, hi: usize) -> Vec<Digest32> {
        self.keyed_digests(ns, prefix, lo, hi)
            .into_iter()
            .map(|(_, d)| d)
            .collect()
    }

    /// The state key of `position` on `prefix` (docs/events.md §4): the
    /// digest over the tokens from its block's start to `position`, its
    /// parent, and those tokens' start.
    fn state_key(
        &mut self,
        ns: u64,
        prefix: &Arc<[u32]>,
        position: u32,
    ) -> (Digest32, Option<Digest32>, usize) {
        let bs = self.cfg.block_size as usize;
        let p = position as usize;
        let k = p.div_ceil(bs); // the block holding token p-1 is k-1
        let start = (k - 1) * bs;
        let full = p == k * bs;
        // Block k - 2 is the parent; block k - 1 is the key when whole.
        let ds = self.digests(
            ns,
            prefix,
            k.saturating_sub(2),
            if full { k } else { k - 1 },
        );
        let parent = (k >= 2).then(|| ds[0]);
        let key = if full {
            ds[ds.len() - 1]
        } else {
            self.hasher
                .hash_block(parent.as_ref(), &prefix[start..p], ns)
        };
        (key, parent, start)
    }

    /// The wire events of `events`, in order.
    pub fn translate(&mut self, events: &[CacheEvent]) -> Vec<WireEvent> {
        let mut out = Vec::with_capacity(events.len());
        for e in events {
            self.translate_one(e, &mut out);
        }
        out
    }

    fn translate_one(&mut self, e: &CacheEvent, out: &mut Vec<WireEvent>) {
        let bs = self.cfg.block_size as usize;
        match e {
            CacheEvent::KvStored {
                ns,
                start,
                end,
                prefix,
            } => {
                let (first, last) = ((*start as usize).div_ceil(bs), *end as usize / bs);
                if first >= last {
                    return;
                }
                let lo = first.saturating_sub(1);
                let ds = self.digests(*ns, prefix, lo, last);
                let (parent, new) = if first == 0 {
                    (None, &ds[..])
                } else {
                    (Some(ds[0]), &ds[1..])
                };
                out.push(WireEvent::BlockStored {
                    block_hashes: new.to_vec(),
                    parent_block_hash: parent,
                    token_ids: prefix[first * bs..last * bs].to_vec(),
                    block_size: self.cfg.block_size,
                    ns: *ns,
                    group_idx: GROUP_KV,
                    state_position: None,
                });
            }
            CacheEvent::KvRemoved {
                ns,
                start,
                end,
                prefix,
            } => {
                let (first, last) = ((*start as usize).div_ceil(bs), *end as usize / bs);
                if first >= last {
                    return;
                }
                let ds = self.keyed_digests(*ns, prefix, first, last);
                // Gone from the cache: forget them (stored again, they are
                // hashed again).
                for (key, _) in &ds {
                    self.memo.remove(key);
                }
                out.push(WireEvent::BlockRemoved {
                    block_hashes: ds.iter().map(|(_, d)| *d).collect(),
                    group_idx: GROUP_KV,
                });
            }
            CacheEvent::StateStored {
                ns,
                position,
                prefix,
            } if self.cfg.states && *position > 0 => {
                let (key, parent, start) = self.state_key(*ns, prefix, *position);
                out.push(WireEvent::BlockStored {
                    block_hashes: vec![key],
                    parent_block_hash: parent,
                    token_ids: prefix[start..*position as usize].to_vec(),
                    block_size: self.cfg.block_size,
                    ns: *ns,
                    group_idx: GROUP_STATE,
                    state_position: Some(*position),
                });
            }
            CacheEvent::StateRemoved {
                ns,
                position,
                prefix,
            } if self.cfg.states && *position > 0 => {
                let (key, _, _) = self.state_key(*ns, prefix, *position);
                out.push(WireEvent::BlockRemoved {
                    block_hashes: vec![key],
                    group_idx: GROUP_STATE,
                });
            }
            CacheEvent::StateStored { .. } | CacheEvent::StateRemoved { .. } => {}
            CacheEvent::AllCleared => out.push(WireEvent::AllBlocksCleared),
        }
    }

    /// A batch that brings a subscriber from any view to the cache's
    /// current content: `AllBlocksCleared`, then every cached block (each
    /// once, parents first) and every state. For resynchronisation after a
    /// loss the replay buffer cannot cover.
    pub fn snapshot(&mut self, chains: &CachedChains) -> Vec<WireEvent> {
        let bs = self.cfg.block_size as usize;
        let mut out = vec![WireEvent::AllBlocksCleared];
        let mut seen: HashSet<(u64, Digest32)> = HashSet::new();
        for (ns, tokens) in &chains.kv {
            let prefix: Arc<[u32]> = Arc::from(tokens.as_slice());
            let blocks = tokens.len() / bs;
            let ds = self.digests(*ns, &prefix, 0, blocks);
            let first = ds.iter().position(|d| !seen.contains(&(*ns, *d)));
            let Some(first) = first else { continue };
            seen.extend(ds[first..].iter().map(|d| (*ns, *d)));
            out.push(WireEvent::BlockStored {
                block_hashes: ds[first..].to_vec(),
                parent_block_hash: first.checked_sub(1).map(|i| ds[i]),
                token_ids: tokens[first * bs..blocks * bs].to_vec(),
                block_size: self.cfg.block_size,
                ns: *ns,
                group_idx: GROUP_KV,
                state_position: None,
            });
        }
        for (ns, tokens) in &chains.states {
            let prefix: Arc<[u32]> = Arc::from(tokens.as_slice());
            self.translate_one(
                &CacheEvent::StateStored {
                    ns: *ns,
                    position: tokens.len() as u32,
                    prefix,
                },
                &mut out,
            );
        }
        out
    }

    /// [`translate`](Self::translate) then [`encode_batch`].
    pub fn encode(&mut self, ts: f64, events: &[CacheEvent]) -> Vec<u8> {
        let wire = self.translate(events);
        encode_batch(ts, &wire, &self.cfg.wire)
    }

    /// [`encode`](Self::encode), or `None` when no event reaches the wire
    /// (state events off and only states changed, stores of less than a
    /// block): a drain or a publisher then has no batch to hand on, rather
    /// than an empty one.
    pub fn encode_changes(&mut self, ts: f64, events: &[CacheEvent]) -> Option<Vec<u8>> {
        let wire = self.translate(events);
        (!wire.is_empty()).then(|| encode_batch(ts, &wire, &self.cfg.wire))
    }
}

/// The cached set a subscriber rebuilds: `(group_idx, hash)` pairs, hashes
/// in vLLM's integer form.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Mirror {
    /// The cached blocks and states.
    pub set: HashSet<(u32, u64)>,
    /// Removals of pairs not in the set (a stream with a loss, or a bug).
    pub unknown_removals: u64,
}

impl Mirror {
    /// Applies decoded events in order.
    pub fn apply(&mut self, events: &[DecodedEvent]) {
        for e in events {
            match e {
                DecodedEvent::BlockStored {
                    block_hashes,
                    group_idx,
                    ..
                } => self
                    .set
                    .extend(block_hashes.iter().map(|&h| (*group_idx, h))),
                DecodedEvent::BlockRemoved {
                    block_hashes,
                    group_idx,
                } => {
                    for &h in block_hashes {
                        if !self.set.remove(&(*group_idx, h)) {
                            self.unknown_removals += 1;
                        }
                    }
                }
                DecodedEvent::AllBlocksCleared => self.set.clear(),
            }
        }
    }

    /// Applies wire events (no encoding round trip).
    pub fn apply_wire(&mut self, events: &[WireEvent]) {
        let decoded: Vec<DecodedEvent> = events.iter().map(to_decoded).collect();
        self.apply(&decoded);
    }
}

/// A wire event as a decoder reads it back.
pub fn to_decoded(e: &WireEvent) -> DecodedEvent {
    match e {
        WireEvent::BlockStored {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
            group_idx,
            state_position,
            ..
        } => DecodedEvent::BlockStored {
            block_hashes: block_hashes.iter().map(external).collect(),
            parent_block_hash: parent_block_hash.as_ref().map(external),
            token_ids: token_ids.clone(),
            block_size: *block_size,
            group_idx: *group_idx,
            state_position: *state_position,
        },
        WireEvent::BlockRemoved {
            block_hashes,
            group_idx,
        } => DecodedEvent::BlockRemoved {
            block_hashes: block_hashes.iter().map(external).collect(),
            group_idx: *group_idx,
        },
        WireEvent::AllBlocksCleared => DecodedEvent::AllBlocksCleared,
    }
}
