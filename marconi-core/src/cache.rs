//! The prefix cache: [`PrefixCache`], the public face, over `Core`, the
//! state a tuning replay clones (tree, index, leases, accounting, the two
//! policies). `Core`'s work is split by step: `lookup` (what is reusable,
//! the lease, the plan), `admission` (the admission policies and the
//! admission itself), `eviction` (the eviction policies and the eviction
//! mechanics), `stats`, `invariants`; here are its construction, the
//! leases' pins and release, and the whole-request path of simulation.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;

use serde::Serialize;

use crate::admission::{self, Admission, AdmitOutcome, SavedState};
use crate::config::{AlphaMode, CacheConfig};
use crate::error::CacheError;
use crate::events::{CacheEvent, CachedChains, EventLog};
use crate::eviction::{self, Eviction, Freed, UnitBudget, UnitKind, UnitUse};
use crate::idset::IdSet;
use crate::index::Index;
use crate::log::{Decision, DecisionLog};
use crate::lookup::{Lookup, LookupOptions, Peek};
use crate::shadow::Shadows;
use crate::stats::Stats;
use crate::tree::{NodeId, Span, Tree, NIL};
use crate::tuner::Tuner;

/// Bytes charged for each cached token of a model without attention layers,
/// which has no KV: the token id the tree keeps on the edge. Without it
/// nodes that carry no state would cost nothing, so no eviction would ever
/// reclaim them and the budget would not bound their number. Models with
/// attention layers are charged their KV bytes per token (always more).
pub const TOKEN_ID_BYTES: u64 = std::mem::size_of::<u32>() as u64;

/// Identifies a lease: the pin a lookup puts on the nodes a request reuses.
/// Ids are never reused, so a released lease cannot reach a later one.
pub type LeaseId = u64;

/// One request's outcome through [`PrefixCache::serve`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Served {
    /// Tokens skipped.
    pub hit_tokens: u32,
    /// Tokens whose KV matched.
    pub kv_matched_tokens: u32,
    /// Checkpoints planned.
    pub planned: Vec<u32>,
    /// Whether the admission was refused for lack of space.
    pub rejected: bool,
}

#[derive(Clone, Debug)]
pub(crate) struct LeaseInfo {
    pub(crate) ns: u64,
    /// Deepest pinned node (its ancestors are pinned too); NIL if none.
    pub(crate) pinned: NodeId,
    /// The pinned node's last access before the lookup's hit refreshed it.
    pub(crate) pinned_before_hit: u64,
    pub(crate) input_len: u32,
    /// Leading input tokens that the pinned path spells (the hit; 0 when
    /// nothing is pinned): the path cannot change while pinned, so an
    /// admission checks them against the tree, which its walk reads anyway.
    pub(crate) pinned_tokens: u32,
    /// Fingerprint of the rest of the input, `input[pinned_tokens..]`: the
    /// only part an admission hashes again.
    pub(crate) input_fingerprint: u64,
    pub(crate) plan: Vec<u32>,
    /// The longest sequence admitted under this lease (kept only while the
    /// tuner records a window).
    pub(crate) admitted: Option<Vec<u32>>,
    /// The application checkpoint hints the lookup was given (kept only
    /// while the tuner or the shadows record: their replays pass them on;
    /// the tuner's window keeps those within the input). Empty without
    /// hints: no allocation.
    pub(crate) hints: Vec<u32>,
}

/// Everything but the tuner: the state a tuning replay clones.
#[derive(Clone, Debug)]
pub(crate) struct Core {
    pub(crate) cfg: CacheConfig,
    /// The admission policy `cfg.admission` names.
    pub(crate) admission: Arc<dyn Admission>,
    /// The eviction policy `cfg.eviction` names.
    pub(crate) eviction: Arc<dyn Eviction>,
    /// Whether every matched position is usable without a state (the
    /// admission policy says so, or the model has no recurrent layers).
    stateless: bool,
    /// Bytes charged per cached token and per state.
    pub(crate) kv_bpt: u64,
    pub(crate) state_b: u64,
    pub(crate) tree: Tree,
    pub(crate) index: Index,
    /// Nodes whose index entry awaits re-derivation (`refresh`), synced
    /// before the index is searched.
    pub(crate) dirty: Vec<NodeId>,
    pub(crate) alpha: f64,
    /// Logical time: one tick per lookup and per admission.
    pub(crate) clock: u64,
    pub(crate) next_lease: LeaseId,
    pub(crate) leases: BTreeMap<LeaseId, LeaseInfo>,
    /// Total tokens on edges and total states, for byte accounting.
    pub(crate) kv_tokens: u64,
    pub(crate) states: u64,
    /// Engine slots and pages the cache owns.
    pub(crate) slot_owner: HashSet<u32>,
    pub(crate) page_owner: IdSet,
    /// Whether admitted sequences carry page ids (fixed by the first admission).
    pub(crate) tracks_pages: Option<bool>,
    /// The budget in engine units, for a cache over two pools (None: the
    /// byte capacity alone).
    pub(crate) units: Option<UnitBudget>,
    pub(crate) freed: Freed,
    pub(crate) stats: Stats,
    pub(crate) log: DecisionLog,
    /// Pending cache events, when the configuration enables them.
    pub(crate) events: Option<EventLog>,
    /// The gaps between a state's previous use and the hit that
    /// supersedes it (`Core::age_superseded`).
    pub(crate) turn_gaps: MeanGap,
    /// Holds whole chains only (a lower tier): KV no state of it covers
    /// (a stateless leaf) is removed as soon as it appears, so that the
    /// bytes charged are exactly those of the chains it holds.
    pub(crate) chains_only: bool,
}

/// A running mean of logical-time gaps.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct MeanGap {
    sum: u64,
    n: u64,
}

impl MeanGap {
    pub(crate) fn add(&mut self, gap: u64) {
        self.sum = self.sum.saturating_add(gap);
        self.n += 1;
    }

    /// The mean, 0 before the first gap.
    pub(crate) fn mean(&self) -> f64 {
        if self.n == 0 {
            0.0
        } else {
            self.sum as f64 / self.n as f64
        }
    }
}

/// Fingerprint of a token sequence: checks that an admission extends the
/// looked-up input without keeping a copy of it.
pub(crate) fn fingerprint(tokens: &[u32]) -> u64 {
    // Four independent multiply-xor lanes, so the multiplies overlap
    // (a single chain costs ~2 ns a token, a lookup of 60 K tokens 0.1 ms).
    const K: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut lanes = [0xcbf2_9ce4_8422_2325 ^ tokens.len() as u64, 1, 2, 3];
    let chunks = tokens.chunks_exact(4);
    let rest = chunks.remainder();
    for c in chunks {
        for (h, &t) in lanes.iter_mut().zip(c) {
            *h = (*h ^ u64::from(t)).wrapping_mul(K);
        }
    }
    for (h, &t) in lanes.iter_mut().zip(rest) {
        *h = (*h ^ u64::from(t) ^ 0xff).wrapping_mul(K);
    }
    lanes
        .iter()
        .fold(0u64, |acc, &h| (acc ^ h ^ (h >> 29)).wrapping_mul(K))
}

pub(crate) fn round_down(x: u32, grid: u32) -> u32 {
    x - x % grid
}

impl Core {
    pub(crate) fn new(cfg: CacheConfig) -> Result<Self, CacheError> {
        cfg.validate()?;
        let admission = admission::from_config(&cfg);
        let eviction = eviction::from_config(&cfg);
        let stateless = admission.every_position_usable() || cfg.model.ssm_layers == 0;
        let alpha = match &cfg.alpha {
            AlphaMode::Fixed(a) => *a,
            AlphaMode::Auto(_) => 0.0,
        };
        Ok(Core {
            kv_bpt: match cfg.model.kv_bytes_per_token() {
                0 => TOKEN_ID_BYTES,
                kv => kv,
            },
            // A policy under which positions need no states keeps none.
            state_b: if admission.every_position_usable() {
                0
            } else {
                cfg.model.state_bytes()
            },
            stats: Stats {
                capacity_bytes: cfg.capacity_bytes,
                alpha,
                ..Stats::default()
            },
            log: DecisionLog::new(cfg.decision_log),
            events: cfg.events.then(EventLog::new),
            cfg,
            admission,
            eviction,
            stateless,
            tree: Tree::default(),
            index: Index::default(),
            dirty: Vec::new(),
            alpha,
            clock: 0,
            next_lease: 1,
            leases: BTreeMap::new(),
            kv_tokens: 0,
            states: 0,
            slot_owner: HashSet::new(),
            page_owner: IdSet::default(),
            tracks_pages: None,
            units: None,
            freed: Freed::default(),
            turn_gaps: MeanGap::default(),
            chains_only: false,
        })
    }

    pub(crate) fn used_bytes(&self) -> u64 {
        (self.kv_tokens.saturating_mul(self.kv_bpt))
            .saturating_add(self.states.saturating_mul(self.state_b))
    }

    /// Whether every matched position is usable without a state.
    pub(crate) fn stateless_hits(&self) -> bool {
        self.stateless
    }

    /// The cut for a checkpoint inside the prefill: page and checkpoint grid.
    pub(crate) fn inner_grid(&self) -> u32 {
        let (a, b) = (self.cfg.page_size, self.cfg.checkpoint_grid);
        let g = gcd(a, b);
        (a / g).saturating_mul(b)
    }

    // ---- pins ---------------------------------------------------------

    pub(crate) fn pin(&mut self, id: NodeId) {
        let mut cur = id;
        while cur != NIL {
            let n = self.tree.node_mut(cur);
            n.leases += 1;
            // Only a node in the index leaves it: one that is not (and not
            // marked) has no entry to lose (a marked one is re-derived
            // anyway).
            let leaves_index = n.leases == 1 && n.cand.is_some();
            let parent = n.parent;
            if leaves_index {
                self.refresh(cur);
            }
            cur = parent;
        }
    }

    pub(crate) fn unpin(&mut self, id: NodeId) {
        let mut cur = id;
        while cur != NIL {
            let n = self.tree.node_mut(cur);
            debug_assert!(n.leases > 0);
            n.leases -= 1;
            // Only a node the policy would take can enter the index (its
            // answer depends on the node's own fields, not on leases).
            let may_enter = n.leases == 0 && self.eviction.is_candidate(n);
            let parent = n.parent;
            if may_enter {
                self.refresh(cur);
            }
            cur = parent;
        }
        // A chains-only cache keeps no KV without a state: an eviction
        // under a pinned node (a lookup's hit, an admission's anchor) may
        // have left it a stateless leaf, kept only while pinned.
        let n = self.tree.node(id);
        if self.chains_only
            && n.live
            && n.parent != NIL
            && n.leases == 0
            && n.children.is_empty()
            && n.state.is_none()
        {
            self.remove_entry(id);
        }
    }

    pub(crate) fn release(&mut self, lease: LeaseId) -> Result<LeaseInfoOut, CacheError> {
        let info = self
            .leases
            .remove(&lease)
            .ok_or(CacheError::UnknownLease(lease))?;
        if info.pinned != NIL {
            self.unpin(info.pinned);
        }
        self.log.push(|| Decision::Release { lease });
        Ok(LeaseInfoOut {
            ns: info.ns,
            input_len: info.input_len,
            admitted: info.admitted,
            hints: info.hints,
        })
    }

    /// Keeps what the lease admits, and its lookup's `hints`, for the
    /// tuner's window or the shadows.
    pub(crate) fn set_recording(&mut self, lease: LeaseId, hints: &[u32]) {
        if let Some(i) = self.leases.get_mut(&lease) {
            i.admitted = Some(Vec::new());
            i.hints.extend_from_slice(hints);
        }
    }

    /// Turns a plain clone into a copy for replaying a tuning window: no
    /// leases, no log, nothing pending for the engine, no engine page or
    /// slot ids
    /// (replayed requests carry none, as [`serve`](Self::serve) requires),
    /// fresh counters, the index rebuilt. O(nodes · log nodes): the tuner
    /// runs it on the search thread, off the request path (which pays only
    /// the clone), handing the core back every 64 nodes (see
    /// [`crate::tuner`]: a thread that shares the engine's core must not
    /// hold it for the whole rebuild, a millisecond at a million tokens)
    /// when `polite` (when-ready adoption; in deterministic mode a request
    /// waits for the search, and yielding only delays it).
    pub(crate) fn prepare_for_replay(&mut self, polite: bool) {
        let c = self;
        c.leases.clear();
        c.log = DecisionLog::new(false);
        c.events = None;
        c.freed = Freed::default();
        // Replays admit no page ids: a cache whose engine tracks pages would
        // refuse every replayed request (and tune on nothing).
        c.tracks_pages = None;
        c.index.clear();
        c.dirty.clear();
        c.page_owner.clear();
        // Nor slot ids: replayed states carry none (the window snapshot
        // leaves the owners out).
        c.slot_owner.clear();
        for id in 0..c.tree.nodes.len() as NodeId {
            let n = c.tree.node_mut(id);
            n.leases = 0;
            n.cand = None;
            n.dirty = false;
            n.pages = Span::default();
            if let Some(st) = &mut n.state {
                st.slot = None;
            }
            if polite && id % 64 == 63 {
                std::thread::yield_now();
            }
        }
        for id in 0..c.tree.nodes.len() as NodeId {
            if c.tree.node(id).live {
                c.reindex(id);
            }
            if polite && id % 64 == 63 {
                std::thread::yield_now();
            }
        }
        c.stats = Stats::default();
    }

    /// Lookup (with application checkpoint `hints`; none: the plain
    /// lookup), admission of every planned state and the final state,
    /// release: a request that runs to completion before the next one
    /// arrives.
    pub(crate) fn serve_hinted(
        &mut self,
        ns: u64,
        input: &[u32],
        full: &[u32],
        hints: &[u32],
    ) -> Result<(Served, LeaseInfoOut), CacheError> {
        // What the admission would refuse is refused before the lookup, so
        // that a refused request changes nothing (no lease, no counters).
        // The rest of `check_admit` holds by construction here.
        Self::check_tokens(full)?;
        let full_pages = full.len() / self.cfg.page_size as usize;
        if self.tracks_pages == Some(true) && full_pages > 0 {
            return Err(CacheError::BadPageList {
                expected: full_pages,
                got: 0,
            });
        }
        // A whole request admits what it looked up: no fingerprint needed.
        let (l, walk) = self.lookup_walk_hinted(ns, input, false, hints)?;
        let states = self.states_for(&l.plan, l.hit_tokens, full.len());
        let outcome = self.admit_with(l.lease, full, &states, &[], false, walk)?;
        let info = self.release(l.lease)?;
        Ok((
            Served {
                hit_tokens: l.hit_tokens,
                kv_matched_tokens: l.kv_matched_tokens,
                planned: l.plan,
                rejected: outcome.rejected.is_some(),
            },
            info,
        ))
    }
}

/// What a released lease leaves for the tuner.
#[derive(Clone, Debug)]
pub(crate) struct LeaseInfoOut {
    pub(crate) ns: u64,
    pub(crate) input_len: u32,
    pub(crate) admitted: Option<Vec<u32>>,
    /// The lookup's hints, when recorded ([`Core::set_recording`]).
    pub(crate) hints: Vec<u32>,
}

fn gcd(a: u32, b: u32) -> u32 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// A prefix cache for one model: the radix tree of KV and recurrent states
/// with its admission and eviction policies and α tuning.
///
/// The request cycle (see `DESIGN.md`): [`lookup`](Self::lookup) the input,
/// prefill saving states at the planned positions, decode,
/// [`admit`](Self::admit) the sequence with its saved states and final state,
/// [`release`](Self::release) the lease. Freed engine ids are collected with
/// [`drain_freed`](Self::drain_freed).
///
/// Deterministic: the same calls give the same results and the same log.
/// Not internally synchronised: wrap it in a lock to share it between threads
/// (the C ABI does).
#[derive(Clone, Debug)]
pub struct PrefixCache {
    core: Core,
    tuner: Option<Tuner>,
    /// Rule choice by shadow caches (instead of the tuner), when configured.
    shadows: Option<Box<Shadows>>,
}

impl PrefixCache {
    /// A cache built from `cfg`; fails on an invalid configuration.
    pub fn new(cfg: CacheConfig) -> Result<Self, CacheError> {
        let mut core = Core::new(cfg)?;
        let shadows = match &core.cfg.alpha {
            AlphaMode::Auto(t) => t
                .shadows
                .as_ref()
                .map(|s| Box::new(Shadows::new(&core.cfg, t, s))),
            AlphaMode::Fixed(_) => None,
        };
        let tuner = match &core.cfg.alpha {
            AlphaMode::Auto(t) if shadows.is_none() && core.eviction.tunes_alpha() => {
                Some(Tuner::new(t.clone()))
            }
            _ => None,
        };
        if let Some(s) = &shadows {
            core.alpha = s.initial_alpha();
        }
        Ok(PrefixCache {
            core,
            tuner,
            shadows,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &CacheConfig {
        &self.core.cfg
    }

    /// Looks up `input` in namespace `ns` (a LoRA id, a cache salt; 0 by
    /// default): what can be reused, a lease pinning it, and the checkpoints
    /// to save during prefill. Errors on an empty or oversized input.
    pub fn lookup(&mut self, ns: u64, input: &[u32]) -> Result<Lookup, CacheError> {
        let l = self.core.lookup(ns, input)?;
        if self.shadows.is_some() || self.tuner.as_ref().is_some_and(Tuner::recording) {
            self.core.set_recording(l.lease, &[]);
        }
        Ok(l)
    }

    /// [`lookup`](Self::lookup) with options: a hit that may cover the whole
    /// input, and no page list (fetched later with
    /// [`lease_kv_pages`](Self::lease_kv_pages), if at all). With
    /// `LookupOptions::default()` this is [`lookup`](Self::lookup). α
    /// tuning and shadow caches replay the request as a plain lookup.
    pub fn lookup_with(
        &mut self,
        ns: u64,
        input: &[u32],
        opts: LookupOptions,
    ) -> Result<Lookup, CacheError> {
        let l = self.core.lookup_with(ns, input, opts)?;
        if self.shadows.is_some() || self.tuner.as_ref().is_some_and(Tuner::recording) {
            self.core.set_recording(l.lease, &[]);
        }
        Ok(l)
    }

    /// The KV page ids of the hit of a live `lease` (what its
    /// [`Lookup::kv_pages`] holds, or would hold had the lookup not skipped
    /// them), computed now: O(path) plus the hit's pages.
    pub fn lease_kv_pages(&self, lease: LeaseId) -> Result<Vec<u32>, CacheError> {
        self.core.lease_kv_pages(lease)
    }

    /// [`lookup`](Self::lookup) with application checkpoint hints:
    /// positions of `input` the application expects later requests to
    /// share (the end of a system prompt, of tool definitions, of a
    /// document), so that a state is saved there on the first request
    /// instead of once a second request branches there (Marconi admission
    /// plans a branch point only when it sees the branch, paper §4.1).
    /// Each hint is rounded down to the checkpoint grid (a multiple of the
    /// page size and of `checkpoint_grid`) and added to the plan
    /// ([`Lookup::plan`], logged as [`crate::PlanReason::AppCheckpoint`])
    /// when it is greater than the hit, at most the input length and not
    /// already cached or planned; other hints are dropped silently, as
    /// are all hints where hits need no states (the oracle, models
    /// without recurrent layers). The state admitted there is an ordinary
    /// checkpoint: eviction treats it like any other. With no hints this
    /// is [`lookup`](Self::lookup), decision for decision. α tuning
    /// replays and shadow caches replay the request with its hints (those
    /// within the input), so they score the cache that runs.
    pub fn lookup_hinted(
        &mut self,
        ns: u64,
        input: &[u32],
        checkpoints: &[u32],
    ) -> Result<Lookup, CacheError> {
        let l = self
            .core
            .lookup_walk_hinted(ns, input, true, checkpoints)
            .map(|(l, _)| l)?;
        if self.shadows.is_some() || self.tuner.as_ref().is_some_and(Tuner::recording) {
            self.core.set_recording(l.lease, checkpoints);
        }
        Ok(l)
    }

    /// [`lookup_hinted`](Self::lookup_hinted) with the options of
    /// [`lookup_with`](Self::lookup_with). With `LookupOptions::default()`
    /// this is `lookup_hinted`, decision for decision; with no hints it is
    /// `lookup_with`.
    pub fn lookup_hinted_with(
        &mut self,
        ns: u64,
        input: &[u32],
        checkpoints: &[u32],
        opts: LookupOptions,
    ) -> Result<Lookup, CacheError> {
        let l = self
            .core
            .lookup_walk_opts(ns, input, true, checkpoints, opts)
            .map(|(l, _)| l)?;
        if self.shadows.is_some() || self.tuner.as_ref().is_some_and(Tuner::recording) {
            self.core.set_recording(l.lease, checkpoints);
        }
        Ok(l)
    }

    /// The events that bring a subscriber to the current content
    /// (`AllCleared`, then every block and state), with the stream
    /// switched to a full one from now on. Removals recorded for a lower
    /// tier and not yet read stay recorded. For a tiered cache whose
    /// engine asks for the device's events after construction.
    pub(crate) fn restart_events(&mut self) -> Vec<CacheEvent> {
        self.core.restart_events()
    }

    /// What [`lookup`](Self::lookup) of `input` would find now, without
    /// taking a lease or changing anything (recency, counters, the tuner's
    /// record): its hit, its KV match and, when `with_plan`, the positions
    /// its admission policy would plan. A cheap probe: one walk of the
    /// tree, no hashing of the input. Errors as `lookup` on an empty or
    /// oversized input.
    pub fn peek(&self, ns: u64, input: &[u32], with_plan: bool) -> Result<Peek, CacheError> {
        self.core.peek(ns, input, with_plan)
    }

    /// [`peek`](Self::peek), with the node of the hit, for
    /// [`lease_peeked`](Self::lease_peeked).
    pub(crate) fn peek_node(
        &self,
        ns: u64,
        input: &[u32],
        with_plan: bool,
    ) -> Result<(Peek, NodeId), CacheError> {
        self.core.peek_node(ns, input, with_plan)
    }

    /// The lease of what `peek` (of an input of `len` tokens, returned
    /// with `node` by [`peek_node`](Self::peek_node) on this cache,
    /// unchanged since) found: a lower tier's hit being loaded. Nothing is
    /// admitted under it (no plan, no fingerprint).
    pub(crate) fn lease_peeked(&mut self, ns: u64, len: u32, peek: &Peek, node: NodeId) -> Lookup {
        let l = self.core.lease_peeked(ns, len, peek, node);
        if self.shadows.is_some() || self.tuner.as_ref().is_some_and(Tuner::recording) {
            self.core.set_recording(l.lease, &[]);
        }
        l
    }

    /// The checkpoint positions planned for `lease` (as in its [`Lookup`]).
    pub fn plan(&self, lease: LeaseId) -> Result<&[u32], CacheError> {
        self.core
            .leases
            .get(&lease)
            .map(|i| i.plan.as_slice())
            .ok_or(CacheError::UnknownLease(lease))
    }

    /// Admits `tokens` (the looked-up input, optionally followed by decoded
    /// output) with the states the engine saved: planned positions, and the
    /// final position (`tokens.len()` rounded down to the page size). May be
    /// called more than once per lease (after prefill, after decode).
    ///
    /// `kv_pages` is empty or holds one engine page id per full page of
    /// `tokens`; the cache takes the pages it caches (see
    /// [`AdmitOutcome::kv_pages_taken`]) and the slots of the states it caches.
    /// Evicts as needed. On error nothing changes.
    pub fn admit(
        &mut self,
        lease: LeaseId,
        tokens: &[u32],
        states: &[SavedState],
        kv_pages: &[u32],
    ) -> Result<AdmitOutcome, CacheError> {
        self.core.admit(lease, tokens, states, kv_pages, true)
    }

    /// The states an engine that follows `lookup`'s plan saves for a
    /// sequence of `full_len` tokens (input and output), without slot ids:
    /// the planned positions and the final position (Marconi), or every
    /// block boundary past the hit (all-blocks); none where no states are
    /// needed. What [`serve`](Self::serve) admits; simulators that drive the
    /// request cycle themselves use it to behave the same.
    pub fn states_to_save(&self, lookup: &Lookup, full_len: usize) -> Vec<SavedState> {
        self.core
            .states_for(&lookup.plan, lookup.hit_tokens, full_len)
    }

    /// Releases `lease`: what it pinned becomes evictable again. Errors on an
    /// unknown or already released lease.
    pub fn release(&mut self, lease: LeaseId) -> Result<(), CacheError> {
        let mut out = self.core.release(lease)?;
        // The shadows replay the longest sequence admitted (the tuner may
        // want it too).
        let shadowed = match (&self.shadows, &self.tuner) {
            (None, _) => None,
            (Some(_), Some(_)) => out.admitted.clone(),
            (Some(_), None) => out.admitted.take(),
        }
        .map(|full| (out.ns, out.input_len as usize, full));
        let hints = std::mem::take(&mut out.hints);
        self.after_request(out, None, &hints);
        if let (Some(s), Some((ns, input_len, full))) = (&mut self.shadows, shadowed) {
            s.after_request(&mut self.core, ns, input_len, &full, &hints);
        }
        Ok(())
    }

    /// One whole request, as a sequential simulator runs it: lookup, admit
    /// `input + output` with every planned state and the final state, release.
    pub fn serve(&mut self, ns: u64, input: &[u32], output: &[u32]) -> Result<Served, CacheError> {
        let mut full = Vec::with_capacity(input.len() + output.len());
        full.extend_from_slice(input);
        full.extend_from_slice(output);
        self.serve_full(ns, input.len(), &full)
    }

    /// [`serve`](Self::serve) for a sequence already concatenated:
    /// `full[..input_len]` is the input.
    pub fn serve_full(
        &mut self,
        ns: u64,
        input_len: usize,
        full: &[u32],
    ) -> Result<Served, CacheError> {
        self.serve_full_hinted(ns, input_len, full, &[])
    }

    /// [`serve_full`](Self::serve_full) whose lookup takes application
    /// checkpoint hints (see [`lookup_hinted`](Self::lookup_hinted)); the
    /// states at the kept hints are admitted with the others.
    pub fn serve_full_hinted(
        &mut self,
        ns: u64,
        input_len: usize,
        full: &[u32],
        checkpoints: &[u32],
    ) -> Result<Served, CacheError> {
        if input_len > full.len() {
            return Err(CacheError::PrefixMismatch { input_len });
        }
        let (served, out) = self
            .core
            .serve_hinted(ns, &full[..input_len], full, checkpoints)?;
        // A recording tuner copies `full` and the hints into its window's
        // buffers.
        self.after_request(out, Some(full), checkpoints);
        if let Some(s) = &mut self.shadows {
            s.after_request(&mut self.core, ns, input_len, full, checkpoints);
        }
        Ok(served)
    }

    /// The tuner, for tests of its worker.
    #[cfg(test)]
    pub(crate) fn tuner(&self) -> Option<&Tuner> {
        self.tuner.as_ref()
    }

    /// The tuner, for tests of its worker.
    #[cfg(test)]
    pub(crate) fn tuner_mut(&mut self) -> Option<&mut Tuner> {
        self.tuner.as_mut()
    }

    /// The tuner's turn after a request: `full` is the sequence admitted
    /// when the caller has it (else the lease's record is used); `hints`
    /// the lookup's application checkpoints.
    fn after_request(&mut self, out: LeaseInfoOut, full: Option<&[u32]>, hints: &[u32]) {
        if let Some(t) = &mut self.tuner {
            t.after_request(&mut self.core, out, full, hints);
        }
    }

    /// Evicts until at least `bytes` are free (or nothing evictable is left);
    /// returns the bytes now free. Freed ids go to [`drain_freed`](Self::drain_freed).
    pub fn evict(&mut self, bytes: u64) -> u64 {
        let want = bytes.min(self.core.cfg.capacity_bytes);
        self.core.make_room(want);
        self.core.cfg.capacity_bytes - self.core.used_bytes()
    }

    /// Sets (or clears) the budget in engine units: KV pages and state slots
    /// in two pools, or both in one shared pool. For a cache whose memory is
    /// pools (`marconi_gpu::pooled`): the pools' capacities, less the units
    /// held outside the cache, so that admission never keeps more than the
    /// pools hold. The byte capacity still applies; set it at least as large
    /// as the pools' bytes so that it never binds. Refused (nothing changes)
    /// when what is cached does not fit `budget`: call
    /// [`evict_to_fit`](Self::evict_to_fit) first.
    pub fn set_unit_budget(&mut self, budget: Option<UnitBudget>) -> Result<(), CacheError> {
        if let Some(b) = budget {
            let used = self.core.used_units();
            if !b.fits(used) {
                return Err(CacheError::InvalidConfig(format!(
                    "unit budget {b:?} is below the {} pages and {} states cached",
                    used.pages, used.states
                )));
            }
        }
        self.core.units = budget;
        Ok(())
    }

    /// The budget in engine units, if one is set.
    pub fn unit_budget(&self) -> Option<UnitBudget> {
        self.core.units
    }

    /// KV pages and state slots the cached entries hold.
    pub fn used_units(&self) -> UnitUse {
        self.core.used_units()
    }

    /// Evicts, lowest utility first among the candidates that free a kind
    /// still short, until what is cached fits `budget`; false when the
    /// leased entries alone exceed it (what was evicted stays evicted: each
    /// eviction is a valid step, its ids go to
    /// [`drain_freed`](Self::drain_freed)). Does not set the budget.
    pub fn evict_to_fit(&mut self, budget: UnitBudget) -> bool {
        loop {
            let used = self.core.used_units();
            if budget.fits(used) {
                return true;
            }
            let kinds = [
                budget.short_of(used, UnitKind::Page),
                budget.short_of(used, UnitKind::State),
            ];
            if !self.core.evict_one_freeing(Some(kinds)) {
                return false;
            }
        }
    }

    /// Evicts the one lowest-utility candidate (among those that free a
    /// unit of `kind`, when given) and returns the units it freed; `None`
    /// when there is no such candidate. The ids go to
    /// [`drain_freed`](Self::drain_freed).
    pub fn evict_lowest(&mut self, kind: Option<UnitKind>) -> Option<UnitUse> {
        let before = self.core.used_units();
        let kinds = kind.map(|k| [k == UnitKind::Page, k == UnitKind::State]);
        if !self.core.evict_one_freeing(kinds) {
            return None;
        }
        let after = self.core.used_units();
        Some(UnitUse {
            pages: before.pages - after.pages,
            states: before.states - after.states,
        })
    }

    /// Drops the state cached at the end of `tokens` in namespace `ns`
    /// (and the KV only it kept) now that another cache holds it: a tier
    /// above, after a hit there was loaded from here. Returns the bytes
    /// freed: 0 when no state is cached exactly there, when it is leased,
    /// or when it is a branch point (its node has two or more children;
    /// the state stays). Emits the removal events; freed ids go to
    /// [`drain_freed`](Self::drain_freed). Not an eviction: the eviction
    /// counters and the decision log do not see it, nor do the α tuner's
    /// replays and shadow caches (they replay requests only).
    pub fn discard(&mut self, ns: u64, tokens: &[u32]) -> u64 {
        self.core.discard(ns, tokens)
    }

    /// Releases `lease` (as [`release`](Self::release)) and discards the
    /// state its lookup hit (as [`discard`](Self::discard), found by the
    /// node it pinned: no walk). The bytes freed.
    pub(crate) fn release_discarding(&mut self, lease: LeaseId) -> Result<u64, CacheError> {
        let (node, hit) = self
            .core
            .leases
            .get(&lease)
            .map(|i| (i.pinned, i.pinned_tokens))
            .ok_or(CacheError::UnknownLease(lease))?;
        self.release(lease)?;
        Ok(self.core.discard_node(node, hit))
    }

    /// The states removed since the last call, from a removals-only log.
    pub(crate) fn drain_removed(&mut self) -> Vec<crate::events::RemovedState> {
        self.core.drain_removed()
    }

    /// Bytes held by unleased entries that eviction could free now.
    pub fn evictable_bytes(&self) -> u64 {
        self.core.used_bytes()
            - self
                .core
                .tree
                .nodes
                .iter()
                .filter(|n| n.live && n.leases > 0 && n.parent != NIL)
                .map(|n| {
                    n.tokens.len() as u64 * self.core.kv_bpt
                        + if n.state.is_some() {
                            self.core.state_b
                        } else {
                            0
                        }
                })
                .sum::<u64>()
    }

    /// What eviction could free now, split: (tokens of KV, states) held by
    /// entries no lease pins. A lease pins every entry on the path to its
    /// hit, so what is protected is the union of the leased paths (a prefix
    /// shared by several leases counts once), never one lease's alone.
    /// `evictable_bytes` is their bytes: tokens × KV bytes per token +
    /// states × state bytes.
    pub fn evictable_split(&self) -> (u64, u64) {
        let (mut tokens, mut states) = (0u64, 0u64);
        for n in self.core.tree.nodes.iter() {
            if n.live && n.parent != NIL && n.leases == 0 {
                tokens += n.tokens.len() as u64;
                states += u64::from(n.state.is_some());
            }
        }
        (tokens, states)
    }

    /// Engine ids freed since the last call.
    pub fn drain_freed(&mut self) -> Freed {
        self.core.drain_freed()
    }

    /// Changes of what is cached since the last call, in order (empty
    /// unless [`CacheConfig::events`] is set; the first drain starts with
    /// [`CacheEvent::AllCleared`]). `docs/events.md` gives their wire form.
    pub fn drain_events(&mut self) -> Vec<CacheEvent> {
        self.core.drain_events()
    }

    /// Turns the event stream on (as [`CacheConfig::events`] does at
    /// construction) for a cache that may already hold content: the next
    /// drain starts with [`CacheEvent::AllCleared`] and the current content
    /// as stored events, so a subscriber starting from it rebuilds the cache
    /// exactly. No-op when events are on.
    pub fn enable_events(&mut self) {
        self.core.enable_events();
    }

    /// Makes this cache hold whole chains only (a lower tier): a leaf
    /// left without a state (its last state evicted or discarded, or an
    /// admission that kept KV but not its state) is removed at once, with
    /// its KV, so that `used_bytes` is exactly the bytes of the chains the
    /// states cover.
    pub(crate) fn set_chains_only(&mut self) {
        self.core.chains_only = true;
    }

    /// Removes the stateless, unleased leaves at the end of `tokens` in
    /// `ns` (a chains-only cache after an admission that did not keep its
    /// state). Returns the bytes freed.
    pub(crate) fn prune_stateless_tail(&mut self, ns: u64, tokens: &[u32]) -> u64 {
        self.core.prune_stateless_tail(ns, tokens)
    }

    /// A stream of removals only (see `Core::enable_removal_events`).
    pub(crate) fn enable_removal_events(&mut self) {
        self.core.enable_removal_events();
    }

    /// Turns the event stream off and drops the pending events.
    pub fn disable_events(&mut self) {
        self.core.events = None;
    }

    /// What is cached, as chains of tokens: one `(namespace, tokens from 0
    /// to the leaf's end)` per leaf of the tree (every cached KV token lies
    /// on one), and one `(namespace, tokens up to the state)` per state.
    /// What a consumer of [`drain_events`](Self::drain_events) must have
    /// rebuilt; O(nodes + tokens · depth), for tests and resynchronisation.
    pub fn cached_chains(&self) -> CachedChains {
        self.core.cached_content()
    }

    /// Counters and gauges.
    pub fn stats(&self) -> Stats {
        self.core.stats()
    }

    /// Decision records since the last call (empty unless
    /// [`CacheConfig::decision_log`] is set).
    pub fn drain_log(&mut self) -> Vec<Decision> {
        self.core.log.drain()
    }

    /// The α in force.
    pub fn alpha(&self) -> f64 {
        self.core.alpha
    }

    /// Bytes charged for each cached token: the model's KV bytes per token,
    /// or [`TOKEN_ID_BYTES`] for models without attention layers.
    pub fn token_bytes(&self) -> u64 {
        self.core.kv_bpt
    }

    /// Bytes in use (KV + states).
    pub fn used_bytes(&self) -> u64 {
        self.core.used_bytes()
    }

    /// Panics if an internal invariant is broken (byte accounting, parent
    /// links, lease counts, index membership, capacity). O(nodes + tokens);
    /// for tests and debugging.
    pub fn check_invariants(&self) {
        self.core.check_invariants();
        self.core.check_chains_only();
    }
}

#[cfg(test)]
mod tests {
    use super::fingerprint;
    use crate::{
        AlphaMode, CacheConfig, ModelSpec, PrefixCache, ShadowConfig, TunerConfig, TuningObjective,
    };

    /// Shadow caches serve each request with the hints its lookup was
    /// given (whole requests and the engine's calls alike): pairs of
    /// requests that share a fresh 1,000-token prompt, hinted at its end,
    /// score hits in every shadow; without the hint, none.
    #[test]
    fn shadows_replay_the_hints() {
        const STATE: u64 = 26_787_840;
        const KV: u64 = 65_536;
        for engine in [false, true] {
            for hinted in [false, true] {
                let cfg = CacheConfig {
                    alpha: AlphaMode::Auto(TunerConfig {
                        objective: TuningObjective::TokenHits,
                        shadows: Some(ShadowConfig {
                            alphas: vec![0.0],
                            tuned: false,
                            lru: true,
                            half_life: 0,
                            ..ShadowConfig::default()
                        }),
                        ..TunerConfig::default()
                    }),
                    ..CacheConfig::marconi(
                        ModelSpec::preset("paper-7b").unwrap(),
                        4 * STATE + 3_000 * KV,
                    )
                };
                let mut c = PrefixCache::new(cfg).unwrap();
                let hints: &[u32] = if hinted { &[1_000] } else { &[] };
                for i in 0..40u32 {
                    let prompt = 1_000_000 * (i / 2 + 1);
                    let tail = prompt + 500_000 + 100 * (i % 2);
                    let full: Vec<u32> = (prompt..prompt + 1_000).chain(tail..tail + 53).collect();
                    if engine {
                        let l = c.lookup_hinted(0, &full[..1_050], hints).unwrap();
                        let states = c.states_to_save(&l, full.len());
                        c.admit(l.lease, &full, &states, &[]).unwrap();
                        c.release(l.lease).unwrap();
                    } else {
                        c.serve_full_hinted(0, 1_050, &full, hints).unwrap();
                    }
                }
                let scores = c.shadows.as_ref().unwrap().scores();
                assert!(scores.len() >= 2, "{scores:?}");
                for s in scores {
                    if hinted {
                        // 20 pairs: most second requests hit the prompt.
                        assert!(s >= 10_000.0, "engine {engine}: {s}");
                    } else {
                        assert_eq!(s, 0.0, "engine {engine}");
                    }
                }
            }
        }
    }

    #[test]
    fn fingerprint_sees_every_position_and_the_length() {
        let a: Vec<u32> = (0..37).collect();
        for i in 0..a.len() {
            let mut b = a.clone();
            b[i] += 1;
            assert_ne!(fingerprint(&a), fingerprint(&b), "token {i}");
            if i + 1 < a.len() {
                let mut c = a.clone();
                c.swap(i, i + 1);
                assert_ne!(fingerprint(&a), fingerprint(&c), "swap {i}");
            }
        }
        assert_ne!(fingerprint(&a), fingerprint(&a[..36]));
        assert_eq!(fingerprint(&a), fingerprint(&a.clone()));
    }

    /// A lower tier holds chains only: when an admission's eviction leaves
    /// the node it extends (pinned meanwhile) a stateless leaf, the end of
    /// the admission takes that KV away (no engine copy holds it). Found by
    /// the C-ABI fuzzer: the host tier claimed a token more than the
    /// engine's copies held.
    #[test]
    fn a_chains_only_cache_keeps_no_stateless_leaf_after_an_admission() {
        use crate::SavedState;
        let m = ModelSpec::preset("paper-7b").unwrap();
        let (kv, st) = (m.kv_bytes_per_token(), m.state_bytes());
        let mut c = PrefixCache::new(CacheConfig::marconi(m, 100 * kv + 2 * st)).unwrap();
        c.set_chains_only();
        let common: Vec<u32> = (0..24).collect();
        let seq = |keep: usize, tail: std::ops::Range<u32>| {
            let mut v = common[..keep].to_vec();
            v.extend(tail);
            v
        };
        let admit = |c: &mut PrefixCache, tokens: &[u32]| {
            let l = c.lookup(0, tokens).unwrap();
            let state = [SavedState {
                position: tokens.len() as u32,
                slot: None,
            }];
            let out = c.admit(l.lease, tokens, &state, &[]).unwrap();
            c.release(l.lease).unwrap();
            assert_eq!(out.states_taken, vec![tokens.len() as u32]);
            c.check_invariants();
        };
        // A stateless branch point at 24 tokens with two chains below it.
        admit(&mut c, &seq(24, 1000..1026));
        admit(&mut c, &seq(24, 2000..2026));
        assert_eq!(c.used_bytes(), 76 * kv + 2 * st);
        // A chain that leaves the branch point's edge a token early: the
        // admission pins that edge, evicts both chains below it, splits it.
        admit(&mut c, &seq(23, 3000..3077));
        assert_eq!(c.used_bytes(), 100 * kv + st, "only the new chain is left");
    }
}
