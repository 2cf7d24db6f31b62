//! From the cache's events (`marconi_core::CacheEvent`) to wire events:
//! blocks of `block_size` tokens, chained digests, state keys
//! (docs/events.md §1, §3, §4); and the mirror a subscriber rebuilds.

use std::collections::HashSet;
use std::sync::Arc;

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

/// Turns cache events into wire events, hashing each chain once per event
/// group (events that share a `prefix` reuse its digests).
#[derive(Debug)]
pub struct Encoder {
    cfg: EncoderConfig,
    hasher: BlockHasher,
    /// The prefix last hashed, its namespace, and the digests of its blocks
    /// computed so far.
    memo: Option<(Arc<[u32]>, u64, Vec<Digest32>)>,
}

impl Encoder {
    /// An encoder; fails on a zero block size.
    pub fn new(cfg: EncoderConfig) -> Result<Self, ConfigError> {
        if cfg.block_size == 0 {
            return Err(ConfigError::ZeroBlockSize);
        }
        Ok(Encoder {
            hasher: BlockHasher::new(&cfg.seed),
            cfg,
            memo: None,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &EncoderConfig {
        &self.cfg
    }

    /// The hasher (for consumers computing the same hashes).
    pub fn hasher(&self) -> &BlockHasher {
        &self.hasher
    }

    /// Digests of the first `blocks` blocks of `prefix`.
    fn digests(&mut self, ns: u64, prefix: &Arc<[u32]>, blocks: usize) -> &[Digest32] {
        let bs = self.cfg.block_size as usize;
        let reuse = matches!(&self.memo, Some((p, n, _)) if Arc::ptr_eq(p, prefix) && *n == ns);
        if !reuse {
            self.memo = Some((Arc::clone(prefix), ns, Vec::new()));
        }
        let (_, _, ds) = self.memo.as_mut().expect("set above");
        while ds.len() < blocks {
            let i = ds.len();
            let d = self
                .hasher
                .hash_block(ds.last(), &prefix[i * bs..(i + 1) * bs], ns);
            ds.push(d);
        }
        &ds[..blocks]
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
        let parent = (k >= 2).then(|| self.digests(ns, prefix, k - 1)[k - 2]);
        let key = if p == k * bs {
            self.digests(ns, prefix, k)[k - 1]
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
                let ds = self.digests(*ns, prefix, last);
                out.push(WireEvent::BlockStored {
                    block_hashes: ds[first..last].to_vec(),
                    parent_block_hash: first.checked_sub(1).map(|i| ds[i]),
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
                let ds = self.digests(*ns, prefix, last);
                out.push(WireEvent::BlockRemoved {
                    block_hashes: ds[first..last].to_vec(),
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
            let ds = self.digests(*ns, &prefix, blocks).to_vec();
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
