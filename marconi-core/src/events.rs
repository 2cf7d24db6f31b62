//! The event stream: every change of what the cache holds, in order, for
//! an engine to publish (`marconi-events` encodes it as vLLM's KV cache
//! events; `docs/events.md` is the wire contract).
//!
//! Opt-in ([`crate::CacheConfig::events`]): when off, the hooks test one
//! `Option` and do nothing else. When on, the stream starts with
//! [`CacheEvent::AllCleared`] (a subscriber drops what it knew of an
//! earlier incarnation of this cache), then follows the cache: the KV an
//! admission inserts, the states it places, the states and KV each eviction
//! removes. Splits and merges of edges change nothing cached and emit
//! nothing; neither do lookups, leases and tuning replays.

use std::sync::Arc;

use serde::Serialize;

use crate::cache::Core;
use crate::tree::{NodeId, Span, NIL};

/// One change of what the cache holds.
///
/// Every variant carries the chain it applies to: `prefix` holds the tokens
/// from position 0 of namespace `ns` up to the change's end (at least `end`
/// or `position` tokens), so that a consumer can derive content hashes
/// without a copy of the tree. Events of one admission or eviction share
/// one `prefix`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CacheEvent {
    /// The KV of `prefix[start..end]` entered the cache (whole pages; the
    /// tokens before `start` were cached already).
    KvStored {
        /// Namespace (the `ns` of the lookup).
        ns: u64,
        /// First new token (a multiple of the page size).
        start: u32,
        /// End of the new tokens (a multiple of the page size).
        end: u32,
        /// Tokens from 0 to at least `end`.
        prefix: Arc<[u32]>,
    },
    /// The KV of `prefix[start..end]` left the cache (a leaf: nothing
    /// deeper on this chain is cached).
    KvRemoved {
        /// Namespace.
        ns: u64,
        /// First removed token.
        start: u32,
        /// End of the removed tokens.
        end: u32,
        /// Tokens from 0 to at least `end`.
        prefix: Arc<[u32]>,
    },
    /// A recurrent state at `position` entered the cache (its KV is cached).
    StateStored {
        /// Namespace.
        ns: u64,
        /// Tokens the state covers.
        position: u32,
        /// Tokens from 0 to at least `position`.
        prefix: Arc<[u32]>,
    },
    /// The recurrent state at `position` left the cache.
    StateRemoved {
        /// Namespace.
        ns: u64,
        /// Tokens the state covered.
        position: u32,
        /// Tokens from 0 to at least `position`.
        prefix: Arc<[u32]>,
    },
    /// Nothing is cached (the start of the stream).
    AllCleared,
}

/// What [`crate::PrefixCache::cached_chains`] returns.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct CachedChains {
    /// One entry per leaf: its namespace and the tokens from 0 to its end.
    pub kv: Vec<(u64, Vec<u32>)>,
    /// One entry per state: its namespace and the tokens it covers.
    pub states: Vec<(u64, Vec<u32>)>,
}

/// The pending events of a cache whose configuration enables them.
#[derive(Clone, Debug, Default)]
pub(crate) struct EventLog {
    pending: Vec<CacheEvent>,
    /// Only the states removed are recorded, into `removed` (a tier below
    /// that demotes what is evicted needs no more): admissions record
    /// nothing and `pending` stays empty.
    removals_only: bool,
    removed: Vec<RemovedState>,
}

/// A state removed from a cache whose log records removals only: its
/// chain as the edges' token ranges (shared with the tree, no copy).
#[derive(Clone, Debug)]
pub(crate) struct RemovedState {
    pub(crate) ns: u64,
    pub(crate) position: u32,
    edges: Vec<Span>,
}

impl RemovedState {
    /// The tokens from 0 to the state.
    pub(crate) fn tokens(&self) -> Arc<[u32]> {
        let mut v = Vec::with_capacity(self.position as usize);
        for e in &self.edges {
            v.extend_from_slice(e);
        }
        v.into()
    }
}

impl EventLog {
    /// A log for a new, empty cache: it starts with `AllCleared`.
    pub(crate) fn new() -> Self {
        EventLog {
            pending: vec![CacheEvent::AllCleared],
            removals_only: false,
            removed: Vec::new(),
        }
    }

    pub(crate) fn drain(&mut self) -> Vec<CacheEvent> {
        std::mem::take(&mut self.pending)
    }
}

impl Core {
    /// Records an admission's new KV `seq[m..]` and the states placed at
    /// `positions` (ascending) on `seq`. No-op when events are off.
    pub(crate) fn events_admitted(&mut self, ns: u64, seq: &[u32], m: u32, positions: &[u32]) {
        let Some(log) = &mut self.events else {
            return;
        };
        if log.removals_only {
            return;
        }
        let end = seq.len() as u32;
        if end == m && positions.is_empty() {
            return;
        }
        let prefix: Arc<[u32]> = Arc::from(seq);
        if end > m {
            log.pending.push(CacheEvent::KvStored {
                ns,
                start: m,
                end,
                prefix: Arc::clone(&prefix),
            });
        }
        for &position in positions {
            log.pending.push(CacheEvent::StateStored {
                ns,
                position,
                prefix: Arc::clone(&prefix),
            });
        }
    }

    /// Records what evicting `id` removes, before the tree changes: its
    /// state, and its edge's KV when it is a leaf. No-op when events are off.
    pub(crate) fn events_evicting(&mut self, id: NodeId) {
        match &self.events {
            None => return,
            Some(l) if l.removals_only => {
                self.removed_state(id);
                return;
            }
            Some(_) => {}
        }
        let (prefix, root) = self.chain_to(id);
        let ns = self
            .tree
            .roots
            .iter()
            .find(|&(_, &r)| r == root)
            .map(|(&ns, _)| ns)
            .expect("every live node hangs under a namespace root");
        let n = self.tree.node(id);
        let (depth, edge, leaf, state) = (
            n.depth,
            n.tokens.len() as u32,
            n.children.is_empty(),
            n.state.is_some(),
        );
        let prefix: Arc<[u32]> = prefix.into();
        let log = self.events.as_mut().expect("checked above");
        if state {
            log.pending.push(CacheEvent::StateRemoved {
                ns,
                position: depth,
                prefix: Arc::clone(&prefix),
            });
        }
        if leaf {
            log.pending.push(CacheEvent::KvRemoved {
                ns,
                start: depth - edge,
                end: depth,
                prefix,
            });
        }
    }

    /// Records the state of `id` (if it has one) as removed, its chain as
    /// the path's edges: no token is copied.
    fn removed_state(&mut self, id: NodeId) {
        let n = self.tree.node(id);
        if n.state.is_none() {
            return;
        }
        let position = n.depth;
        let mut edges = Vec::new();
        let mut cur = id;
        let mut root = id;
        while cur != NIL {
            let n = self.tree.node(cur);
            if n.parent == NIL {
                root = cur;
            } else {
                edges.push(n.tokens.clone());
            }
            cur = n.parent;
        }
        edges.reverse();
        let ns = self.ns_of_root(root);
        if let Some(log) = &mut self.events {
            log.removed.push(RemovedState {
                ns,
                position,
                edges,
            });
        }
    }

    fn ns_of_root(&self, root: NodeId) -> u64 {
        self.tree
            .roots
            .iter()
            .find(|&(_, &r)| r == root)
            .map(|(&ns, _)| ns)
            .expect("every live node hangs under a namespace root")
    }

    /// The tokens from the root to the end of `id`'s edge, and the root.
    fn chain_to(&self, id: NodeId) -> (Vec<u32>, NodeId) {
        let mut edges = Vec::new();
        let mut cur = id;
        let mut root = id;
        while cur != NIL {
            let n = self.tree.node(cur);
            if n.parent == NIL {
                root = cur;
            } else {
                edges.push(cur);
            }
            cur = n.parent;
        }
        let mut out = Vec::with_capacity(self.tree.node(id).depth as usize);
        for &e in edges.iter().rev() {
            out.extend_from_slice(&self.tree.node(e).tokens);
        }
        (out, root)
    }

    /// Turns events on for a cache that may already hold content: the
    /// stream starts with `AllCleared`, then the content as stored events
    /// (each edge once, parents first, then its state). No-op when on.
    /// Turns on a stream of removals only, for an empty cache (the tiers'
    /// demotions read it): no stored events, so an admission copies no
    /// prefix. No-op when events are on.
    pub(crate) fn enable_removal_events(&mut self) {
        if self.events.is_none() {
            self.events = Some(EventLog {
                pending: Vec::new(),
                removals_only: true,
                removed: Vec::new(),
            });
        }
    }

    /// The states removed since the last call, when the log records
    /// removals only (else empty).
    pub(crate) fn drain_removed(&mut self) -> Vec<RemovedState> {
        self.events
            .as_mut()
            .map(|l| std::mem::take(&mut l.removed))
            .unwrap_or_default()
    }

    pub(crate) fn enable_events(&mut self) {
        if self.events.is_some() {
            return;
        }
        let mut log = EventLog::new();
        for (&ns, &root) in &self.tree.roots {
            let mut stack = vec![(root, Vec::<u32>::new())];
            while let Some((id, mut chain)) = stack.pop() {
                let n = self.tree.node(id);
                chain.extend_from_slice(&n.tokens);
                if n.parent != NIL {
                    let prefix: Arc<[u32]> = Arc::from(chain.as_slice());
                    log.pending.push(CacheEvent::KvStored {
                        ns,
                        start: n.depth - n.tokens.len() as u32,
                        end: n.depth,
                        prefix: Arc::clone(&prefix),
                    });
                    if n.state.is_some() {
                        log.pending.push(CacheEvent::StateStored {
                            ns,
                            position: n.depth,
                            prefix,
                        });
                    }
                }
                for &(_, c) in n.children.iter().rev() {
                    stack.push((c, chain.clone()));
                }
            }
        }
        self.events = Some(log);
    }

    /// See [`crate::PrefixCache::restart_events`].
    pub(crate) fn restart_events(&mut self) -> Vec<CacheEvent> {
        let old = self.events.take();
        self.enable_events();
        let snapshot = self.drain_events();
        if let (Some(old), Some(log)) = (old, self.events.as_mut()) {
            // What a lower tier has not read yet, in both forms.
            log.removed = old.removed;
            if !old.removals_only {
                log.pending = old.pending;
            }
        }
        snapshot
    }

    pub(crate) fn drain_events(&mut self) -> Vec<CacheEvent> {
        self.events
            .as_mut()
            .map(EventLog::drain)
            .unwrap_or_default()
    }

    /// The cached content as the event stream describes it, for tests and
    /// consumers that check a rebuilt view: every cached chain's KV extent
    /// (one entry per leaf: namespace, tokens from 0 to the leaf's end) and
    /// every state (namespace, the tokens it covers).
    pub(crate) fn cached_content(&self) -> CachedChains {
        let mut leaves = Vec::new();
        let mut states = Vec::new();
        for (&ns, &root) in &self.tree.roots {
            let mut stack = vec![(root, Vec::<u32>::new())];
            while let Some((id, mut chain)) = stack.pop() {
                let n = self.tree.node(id);
                chain.extend_from_slice(&n.tokens);
                if n.state.is_some() {
                    states.push((ns, chain.clone()));
                }
                if n.children.is_empty() {
                    if n.parent != NIL {
                        leaves.push((ns, chain));
                    }
                } else {
                    for &(_, c) in &n.children {
                        stack.push((c, chain.clone()));
                    }
                }
            }
        }
        CachedChains { kv: leaves, states }
    }
}
