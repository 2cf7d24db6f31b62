//! Eviction: which cached entries go first when space is needed.
//!
//! A policy is a type behind [`Eviction`], one file per policy: its rules
//! (which nodes are candidates, the α its search uses, what a hit
//! refreshes). The mechanics every policy shares are `Core`'s methods here:
//! the candidate index (`crate::index`, which finds the lowest
//! `norm(recency) + α · norm(efficiency)` exactly), FLOP efficiency (paper
//! Appendix A), freeing a leaf or merging a one-child node into its child,
//! the byte accounting and the engine ids freed.
//!
//! Policies: [`Lru`] (SGLang+, §5.1) and [`FlopAware`] (Marconi, §4.2–4.3).
//!
//! # Adding a policy
//!
//! 1. A new file here with a type implementing [`Eviction`]; its doc cites
//!    what it implements and says when not to use it.
//! 2. A `mod` line and a `pub(crate) use` here.
//! 3. A variant of the configuration enum [`crate::EvictionPolicy`] and one
//!    arm in [`from_config`] that builds the type. The other policies, the
//!    index and the rest of the cache do not change. To reach it from C,
//!    marconi-ffi's configuration gets a new policy number (header
//!    regenerated); from the simulator, a `Policy` name.
//! 4. A decision-log snapshot test of a small trace where it differs from
//!    the others (`tests/decision_log.rs`), and the policy in the property
//!    tests' configurations (`tests/properties.rs`).
//!
//! A policy whose order is not `recency + α · efficiency` needs its own
//! key in the index first: the index is the one place that orders
//! candidates, and its exactness is property-tested.

mod flop_aware;
mod lru;

use std::sync::Arc;

use serde::Serialize;

use crate::cache::Core;
use crate::config::{CacheConfig, EvictionPolicy};
use crate::index::CandKey;
use crate::log::{Decision, EvictKind};
use crate::tree::{Node, NodeId, NIL};

pub(crate) use flop_aware::FlopAware;
pub(crate) use lru::Lru;

/// Which last-access times a hit refreshes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum HitRefresh {
    /// The node that carries the hit and every ancestor up to the root.
    Path,
    /// Only the node that carries the hit.
    HitNode,
}

/// The rules of an eviction policy.
///
/// A policy is immutable once built (`&self` everywhere) and shared by the
/// cache and its tuning replays (`Send + Sync`, cloned as an `Arc`): what
/// it needs to know about a node is on the node (children, state, last
/// access, `was_branch`). Every hook is O(1); none may touch the tree.
pub(crate) trait Eviction: std::fmt::Debug + Send + Sync {
    /// Whether `node` is an eviction candidate.
    ///
    /// The caller guarantees that `node` is live, not a root and not
    /// leased, and asks again whenever any of its fields changes, so the
    /// answer MUST depend on the node's own fields only (not on its
    /// neighbours or on time). It MUST be false for a node with two or more
    /// children, and for a node with one child and no state: evicting a
    /// leaf frees its edge's KV and its state, evicting a one-child node
    /// frees only its state and merges its edge into the child, and no
    /// other shape can be evicted (`check_invariants` asserts it). Called
    /// on every change to a node (lookups, admissions, evictions).
    fn is_candidate(&self, node: &Node) -> bool;

    /// The α the candidate search weighs FLOP efficiency with, given the α
    /// in force (fixed or tuned). MUST be finite and ≥ 0; 0 makes the
    /// search pure LRU over the candidates. Called once per eviction.
    fn alpha(&self, tuned: f64) -> f64;

    /// Which nodes a hit refreshes. Called once per lookup with a hit.
    fn on_hit(&self) -> HitRefresh;

    /// How much older than its last use a superseded state counts, in mean
    /// turn gaps (see [`crate::CacheConfig::superseded_age`]): a state a
    /// request resumed from and was then admitted below. MUST be finite
    /// and ≥ 0; 0 (the default, for a policy that evicts only leaves, whose
    /// inner nodes' times never count) leaves the hit's refresh as it is.
    /// Called once per admission that supersedes a state.
    fn superseded_age(&self) -> f64 {
        0.0
    }

    /// Whether online α tuning ([`crate::AlphaMode::Auto`]) applies (only
    /// when [`alpha`](Self::alpha) uses the α it is given). Called once,
    /// when the cache is built.
    fn tunes_alpha(&self) -> bool;
}

/// The policy a configuration names.
pub(crate) fn from_config(cfg: &CacheConfig) -> Arc<dyn Eviction> {
    match cfg.eviction {
        EvictionPolicy::Lru => Arc::new(Lru),
        EvictionPolicy::FlopAware => Arc::new(FlopAware {
            protect_branch_states: cfg.protect_branch_states,
            min_branch_depth: cfg.min_branch_depth,
            superseded_age: cfg.superseded_age,
        }),
    }
}

/// The two kinds of engine memory a cache entry holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
pub enum UnitKind {
    /// A KV page of `page_size` tokens.
    Page,
    /// A recurrent-state slot (one checkpoint: every recurrent layer).
    State,
}

/// A budget in engine units, for a cache whose memory is two pools (KV
/// pages and state slots) rather than one byte budget: set with
/// [`crate::PrefixCache::set_unit_budget`]. While one is set, admission
/// evicts (and truncates) until the pages and states it keeps fit the
/// budget as well as the byte capacity, and eviction for a short kind takes
/// only candidates that free that kind, lowest utility first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum UnitBudget {
    /// Two pools: at most `pages` KV pages and `states` state slots.
    Split {
        /// KV pages.
        pages: u64,
        /// State slots.
        states: u64,
    },
    /// One pool shared by both kinds (a padded unified layout): at most
    /// `units` pages and states together.
    Shared {
        /// Pages plus states.
        units: u64,
    },
}

/// Engine units in use (or freed): KV pages and state slots.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct UnitUse {
    /// KV pages.
    pub pages: u64,
    /// State slots.
    pub states: u64,
}

impl UnitBudget {
    /// Whether `used` fits.
    pub fn fits(&self, used: UnitUse) -> bool {
        match *self {
            UnitBudget::Split { pages, states } => used.pages <= pages && used.states <= states,
            UnitBudget::Shared { units } => used.pages.saturating_add(used.states) <= units,
        }
    }

    /// Whether freeing a unit of `kind` brings `used` closer to fitting.
    pub fn short_of(&self, used: UnitUse, kind: UnitKind) -> bool {
        match *self {
            UnitBudget::Split { pages, states } => match kind {
                UnitKind::Page => used.pages > pages,
                UnitKind::State => used.states > states,
            },
            UnitBudget::Shared { .. } => !self.fits(used),
        }
    }
}

/// Engine ids freed by evictions since the last drain: the engine may reuse them.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Freed {
    /// KV page ids.
    pub kv_pages: Vec<u32>,
    /// State slot ids.
    pub state_slots: Vec<u32>,
}

impl Core {
    /// Puts other eviction rules in force: the policy is rebuilt from
    /// `eviction` and `protect_branch_states` (with the configuration's
    /// `min_branch_depth`) and the candidate index
    /// re-derived (which nodes are candidates depends on the rules).
    /// O(nodes log nodes); nothing when the rules are already in force.
    pub(crate) fn set_eviction_rules(&mut self, eviction: EvictionPolicy, protect: bool) {
        if self.cfg.eviction == eviction && self.cfg.protect_branch_states == protect {
            return;
        }
        self.cfg.eviction = eviction;
        self.cfg.protect_branch_states = protect;
        self.eviction = from_config(&self.cfg);
        self.index.clear();
        for id in 0..self.tree.nodes.len() as NodeId {
            self.tree.node_mut(id).cand = None;
        }
        for id in 0..self.tree.nodes.len() as NodeId {
            if self.tree.node(id).live {
                self.refresh(id);
            }
        }
    }

    /// Whether `id` belongs in the eviction index: an unleased live node
    /// that is not a root and that the policy accepts.
    pub(crate) fn eligible(&self, id: NodeId) -> bool {
        let n = self.tree.node(id);
        if n.parent == NIL || n.leases > 0 || !n.live {
            return false;
        }
        self.eviction.is_candidate(n)
    }

    /// FLOP efficiency: prefill FLOPs lost by evicting the node (its edge,
    /// given its parent's prefix; zero when nothing could resume at its end)
    /// per byte freed.
    fn efficiency(&self, id: NodeId) -> f64 {
        let n = self.tree.node(id);
        let parent_depth = self.tree.node(n.parent).depth;
        let freed = self.freed_bytes(id);
        let usable_end = n.state.is_some() || self.stateless_hits();
        if freed == 0 || !usable_end {
            return 0.0;
        }
        self.cfg
            .model
            .prefill_flops(u64::from(parent_depth), u64::from(n.depth))
            / freed as f64
    }

    fn freed_bytes(&self, id: NodeId) -> u64 {
        let n = self.tree.node(id);
        let state = if n.state.is_some() { self.state_b } else { 0 };
        if n.children.is_empty() {
            (n.tokens.len() as u64)
                .saturating_mul(self.kv_bpt)
                .saturating_add(state)
        } else {
            state
        }
    }

    /// Takes `id` out of the eviction index, if it is there.
    fn unindex(&mut self, id: NodeId) {
        if let Some(k) = self.tree.node_mut(id).cand.take() {
            self.index.remove(id, k);
        }
    }

    /// Marks `id`'s place in the eviction index for re-derivation after any
    /// change to it. Deferred: the index is brought up to date
    /// ([`sync_index`](Self::sync_index)) before it is searched, so a node
    /// whose place ends where it began between two searches (pinned by a
    /// lookup and released, refreshed twice by one admission) costs no
    /// ordered-set operation. The index a search sees is the one the
    /// immediate upkeep gave (same entries, same keys), so no decision
    /// changes.
    pub(crate) fn refresh(&mut self, id: NodeId) {
        let n = self.tree.node_mut(id);
        if !n.dirty {
            n.dirty = true;
            self.dirty.push(id);
            // A node released and reused between two searches may be
            // listed twice; the list never grows past a few times the tree.
            if self.dirty.len() > 2 * self.tree.nodes.len() + 64 {
                self.sync_index();
            }
        }
    }

    /// Re-derives the index entry of every node marked since the last
    /// search: O(marked) key computations, and ordered-set operations only
    /// for the entries that changed.
    pub(crate) fn sync_index(&mut self) {
        let mut dirty = std::mem::take(&mut self.dirty);
        for &id in &dirty {
            self.tree.node_mut(id).dirty = false;
            self.reindex(id);
        }
        dirty.clear();
        self.dirty = dirty;
    }

    /// The key `id` belongs in the index under now, if it is a candidate.
    pub(crate) fn wanted_key(&self, id: NodeId) -> Option<CandKey> {
        self.eligible(id).then(|| CandKey {
            time: self.tree.node(id).last_access,
            eff: self.efficiency(id),
        })
    }

    /// Puts `id` in the index under the key it belongs under now (or takes
    /// it out), touching the index only if that changed.
    pub(crate) fn reindex(&mut self, id: NodeId) {
        let want = self.wanted_key(id);
        let have = self.tree.node(id).cand;
        match (have, want) {
            (h, w) if h == w => return,
            (Some(h), Some(w)) => self.index.update(id, h, w),
            (Some(h), None) => self.index.remove(id, h),
            (None, Some(w)) => self.index.insert(id, w),
            (None, None) => {}
        }
        self.tree.node_mut(id).cand = want;
    }

    pub(crate) fn touch(&mut self, id: NodeId) {
        self.tree.node_mut(id).last_access = self.clock;
        self.refresh(id);
    }

    /// Ages `node`, a state that the admission under way supersedes (its
    /// request's lookup hit it, refreshing it from `before_hit`, and the
    /// request's new chain now hangs below it): the gap from `before_hit`
    /// to the hit joins the mean turn gap, and the node's last access moves
    /// back by the policy's `superseded_age` × that mean (paper §4.3 (1):
    /// a one-child node's state is unlikely to be reused). O(log n): one
    /// re-index.
    pub(crate) fn age_superseded(&mut self, node: NodeId, before_hit: u64) {
        let k = self.eviction.superseded_age();
        if k <= 0.0 {
            return;
        }
        let hit = self.tree.node(node).last_access;
        self.turn_gaps.add(hit.saturating_sub(before_hit));
        let back = (k * self.turn_gaps.mean()).min(u64::MAX as f64) as u64;
        self.tree.node_mut(node).last_access = hit.saturating_sub(back);
        self.refresh(node);
    }

    /// Refreshes what a hit on `hit_node` refreshes under the policy.
    pub(crate) fn touch_hit(&mut self, hit_node: NodeId) {
        match self.eviction.on_hit() {
            HitRefresh::Path => {
                let mut cur = hit_node;
                while cur != NIL && !self.tree.is_root(cur) {
                    self.touch(cur);
                    cur = self.tree.node(cur).parent;
                }
            }
            HitRefresh::HitNode => self.touch(hit_node),
        }
    }

    /// Evicts until `needed` more bytes fit; false if they cannot.
    pub(crate) fn make_room(&mut self, needed: u64) -> bool {
        self.make_room_for(needed, UnitUse::default())
    }

    /// Engine units the cached entries hold: pages (edges are whole pages)
    /// and states.
    pub(crate) fn used_units(&self) -> UnitUse {
        UnitUse {
            pages: self.kv_tokens / u64::from(self.cfg.page_size),
            states: self.states,
        }
    }

    /// Units in use plus `extra`, saturating.
    pub(crate) fn units_with(&self, extra: UnitUse) -> UnitUse {
        let u = self.used_units();
        UnitUse {
            pages: u.pages.saturating_add(extra.pages),
            states: u.states.saturating_add(extra.states),
        }
    }

    /// Evicts until `needed` more bytes and `units` more engine units (under
    /// the unit budget, if one is set) fit; false if they cannot. Without a
    /// unit budget this is the byte-only eviction, unchanged; with one, a
    /// short kind is relieved by the lowest-utility candidate that frees it.
    pub(crate) fn make_room_for(&mut self, needed: u64, units: UnitUse) -> bool {
        loop {
            let bytes_short = self.used_bytes().saturating_add(needed) > self.cfg.capacity_bytes;
            let short = self.short_kinds(units);
            if !bytes_short && short.is_none() {
                return true;
            }
            let filter = if bytes_short { None } else { short };
            if !self.evict_one_freeing(filter) {
                return false;
            }
        }
    }

    /// The kinds whose units are short under the unit budget with `extra`
    /// more in use: `None` when everything fits (or no budget is set).
    fn short_kinds(&self, extra: UnitUse) -> Option<[bool; 2]> {
        let b = self.units?;
        let u = self.units_with(extra);
        if b.fits(u) {
            return None;
        }
        Some([
            b.short_of(u, UnitKind::Page),
            b.short_of(u, UnitKind::State),
        ])
    }

    /// Units that evicting candidate `id` frees.
    pub(crate) fn freed_units(&self, id: NodeId) -> UnitUse {
        let n = self.tree.node(id);
        UnitUse {
            pages: if n.children.is_empty() {
                n.tokens.len() as u64 / u64::from(self.cfg.page_size)
            } else {
                0
            },
            states: u64::from(n.state.is_some()),
        }
    }

    /// Evicts the lowest-utility candidate among those that free a unit of
    /// a kind `kinds` marks (`[page, state]`; `None`: any candidate); false
    /// if there is none.
    pub(crate) fn evict_one_freeing(&mut self, kinds: Option<[bool; 2]>) -> bool {
        self.sync_index();
        let alpha = self.eviction.alpha(self.alpha);
        let tree = &self.tree;
        let eff = |id| tree.node(id).cand.expect("indexed").eff;
        let choice = match kinds {
            None => self.index.lowest(alpha, eff),
            Some([pages, states]) => self.index.lowest_where(alpha, eff, |id| {
                let f = self.freed_units(id);
                (pages && f.pages > 0) || (states && f.states > 0)
            }),
        };
        let Some(choice) = choice else {
            return false;
        };
        let id = choice.node;
        let freed_bytes = self.freed_bytes(id);
        let (depth, edge, leaf) = {
            let n = self.tree.node(id);
            (n.depth, n.tokens.len() as u32, n.children.is_empty())
        };
        self.stats.evictions += 1;
        self.remove_entry(id);
        self.log.push(|| Decision::Evict {
            depth,
            edge,
            how: if leaf {
                EvictKind::Leaf
            } else {
                EvictKind::Merge
            },
            recency: choice.recency,
            efficiency: choice.efficiency,
            utility: choice.utility,
            freed_bytes,
        });
        true
    }

    /// Takes `id` (an unleased node with a state, or a leaf, with at most
    /// one child) out of the cache as an eviction does: its state, and its
    /// edge's KV when it is a leaf (else it merges into its child), with
    /// the events and freed ids that go with it.
    pub(crate) fn remove_entry(&mut self, id: NodeId) {
        let (edge, leaf) = {
            let n = self.tree.node(id);
            (n.tokens.len() as u32, n.children.is_empty())
        };
        self.events_evicting(id);
        self.unindex(id);
        if let Some(st) = self.tree.node_mut(id).state.take() {
            self.states -= 1;
            if let Some(slot) = st.slot {
                self.slot_owner.remove(&slot);
                self.freed.state_slots.push(slot);
            }
        }
        if leaf {
            let pages = std::mem::take(&mut self.tree.node_mut(id).pages);
            for &p in pages.iter() {
                self.page_owner.remove(p);
            }
            self.freed.kv_pages.extend_from_slice(&pages);
            self.kv_tokens -= u64::from(edge);
            let parent = self.tree.remove_leaf(id);
            self.after_child_removed(parent);
        } else {
            let child = self.tree.merge_into_child(id);
            self.refresh(child);
        }
    }

    /// Drops the state cached at the end of `tokens` in `ns`, with the KV
    /// only it kept (the edge of a leaf), whatever its utility: the bytes
    /// freed, 0 when no such state is cached, it is leased, or it is a
    /// branch point (two or more children keep its node; its state stays).
    /// Not an eviction: counted and logged as none.
    pub(crate) fn discard(&mut self, ns: u64, tokens: &[u32]) -> u64 {
        let Some(root) = self.tree.root(ns) else {
            return 0;
        };
        let walk = self.tree.walk(root, tokens, self.cfg.page_size);
        match walk.path.last() {
            Some(&id) if walk.partial.is_none() => self.discard_node(id, tokens.len() as u32),
            _ => 0,
        }
    }

    /// [`discard`](Self::discard) of node `id`, if it is live and its
    /// state is at `position`.
    pub(crate) fn discard_node(&mut self, id: NodeId, position: u32) -> u64 {
        if id == NIL || id as usize >= self.tree.nodes.len() {
            return 0;
        }
        let n = self.tree.node(id);
        if !n.live
            || n.parent == NIL
            || n.depth != position
            || n.state.is_none()
            || n.leases > 0
            || n.children.len() > 1
        {
            return 0;
        }
        let before = self.used_bytes();
        self.remove_entry(id);
        before - self.used_bytes()
    }

    /// Keeps the tree compressed after a child went away: a stateless,
    /// unleased inner node left with one child merges into it.
    fn after_child_removed(&mut self, parent: NodeId) {
        let n = self.tree.node(parent);
        if self.chains_only
            && n.parent != NIL
            && n.children.is_empty()
            && n.state.is_none()
            && n.leases == 0
        {
            // A chains-only cache holds no KV that no state covers: the
            // parent's edge belonged to the chain just removed.
            self.remove_entry(parent);
            return;
        }
        if n.parent != NIL && n.children.len() == 1 && n.state.is_none() && n.leases == 0 {
            self.unindex(parent);
            let child = self.tree.merge_into_child(parent);
            self.refresh(child);
        } else {
            self.refresh(parent);
        }
    }

    /// [`PrefixCache::prune_stateless_tail`](crate::PrefixCache): removes
    /// the deepest node on `tokens`' path while it is a stateless, unleased
    /// leaf. The bytes freed.
    pub(crate) fn prune_stateless_tail(&mut self, ns: u64, tokens: &[u32]) -> u64 {
        let Some(root) = self.tree.root(ns) else {
            return 0;
        };
        let walk = self.tree.walk(root, tokens, self.cfg.page_size);
        let last = match walk.partial {
            Some((id, _)) => Some(id),
            None => walk.path.last().copied(),
        };
        let Some(id) = last else {
            return 0;
        };
        let n = self.tree.node(id);
        if n.parent == NIL || !n.children.is_empty() || n.state.is_some() || n.leases > 0 {
            return 0;
        }
        let before = self.used_bytes();
        self.remove_entry(id);
        before - self.used_bytes()
    }

    pub(crate) fn drain_freed(&mut self) -> Freed {
        std::mem::take(&mut self.freed)
    }
}
