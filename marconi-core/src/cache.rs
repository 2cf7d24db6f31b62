//! The prefix cache: lookup, plan, admit, release, stats. Eviction (the
//! policies and the mechanics) is in `eviction`.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::sync::Arc;

use serde::Serialize;

use crate::config::{AdmissionPolicy, AlphaMode, CacheConfig};
use crate::error::CacheError;
use crate::eviction::{self, Eviction, Freed};
use crate::index::Index;
use crate::log::{Decision, DecisionLog, PlanReason};
use crate::tree::{NodeId, StateRef, Tree, Walk, NIL};
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

/// What a lookup found.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Lookup {
    /// The lease pinning what this request reuses; release it when done.
    pub lease: LeaseId,
    /// Leading tokens the engine may skip: the deepest matched position that
    /// has a recurrent state (any page-aligned matched position for
    /// attention-only models), and always less than the input length, so the
    /// last input token is recomputed to produce the first output's logits.
    pub hit_tokens: u32,
    /// Leading tokens whose KV is cached (page-aligned). `kv_matched_tokens −
    /// hit_tokens` is KV that matched but cannot be used: the silent miss.
    pub kv_matched_tokens: u32,
    /// The state slot to resume from (copy it into the request's own slot),
    /// when a state-based hit has an engine slot id.
    pub state_slot: Option<u32>,
    /// KV page ids of the first `hit_tokens` tokens, when the engine tracks pages.
    pub kv_pages: Vec<u32>,
    /// Positions at which the engine should save recurrent states during
    /// this prefill (ascending). The final state (after the last decoded
    /// token) is always admissible and is not listed.
    pub plan: Vec<u32>,
}

/// A state the engine saved, offered to the cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct SavedState {
    /// Tokens the state covers.
    pub position: u32,
    /// The engine's slot holding it, if the engine tracks slots.
    pub slot: Option<u32>,
}

/// What an admission did. Ownership of the slots in `states_taken` and of
/// the pages `kv_pages_taken` passed to the cache; everything else stays the
/// engine's.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct AdmitOutcome {
    /// Positions whose states the cache now holds (their slots are the cache's).
    pub states_taken: Vec<u32>,
    /// Slots the cache did not take (already cached there, or rejected).
    pub slots_returned: Vec<u32>,
    /// Indices into the admitted page list of the pages the cache took
    /// (a range: `start..end`; empty when no page list was given).
    pub kv_pages_taken: std::ops::Range<u32>,
    /// Tokens of KV newly cached.
    pub new_kv_tokens: u32,
    /// Set when nothing could be cached (the sequence does not fit even after
    /// evicting every unleased entry).
    pub rejected: Option<String>,
    /// Set when only a prefix of the tokens could be cached: its length
    /// (`None` when every token is cached, even if some states were not:
    /// their slots are in `slots_returned`).
    pub truncated_to: Option<u32>,
}

/// Counters and gauges.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Stats {
    /// Lookups served.
    pub requests: u64,
    /// Lookups with a non-zero hit.
    pub hit_requests: u64,
    /// Input tokens looked up.
    pub input_tokens: u64,
    /// Tokens skipped thanks to the cache (usable hits).
    pub hit_tokens: u64,
    /// Tokens whose KV matched but could not be used because no state
    /// existed there (the "silent miss"; excludes each request's last token,
    /// which is always recomputed).
    pub kv_matched_unusable_tokens: u64,
    /// Prefill FLOPs saved by hits.
    pub flops_saved: f64,
    /// Prefill FLOPs the inputs would cost with no cache.
    pub flops_total: f64,
    /// Bytes charged for cached tokens: their KV, or [`TOKEN_ID_BYTES`] a
    /// token for models without attention layers.
    pub kv_bytes: u64,
    /// Bytes of cached states.
    pub state_bytes: u64,
    /// The byte budget.
    pub capacity_bytes: u64,
    /// Cached states.
    pub states: u64,
    /// Tree nodes (roots excluded).
    pub nodes: u64,
    /// Nodes evicted.
    pub evictions: u64,
    /// States admitted.
    pub states_admitted: u64,
    /// Admissions refused for lack of space.
    pub admissions_rejected: u64,
    /// Admissions that cached only part of what they offered for lack of
    /// space: a prefix of the tokens, or some of the new states.
    pub admissions_truncated: u64,
    /// Leases outstanding.
    pub leases: u64,
    /// The α in force.
    pub alpha: f64,
    /// α tuning rounds run.
    pub tuning_rounds: u32,
}

impl Stats {
    /// Hit tokens / input tokens.
    pub fn token_hit_rate(&self) -> f64 {
        ratio(self.hit_tokens as f64, self.input_tokens as f64)
    }
    /// Requests with a hit / requests.
    pub fn request_hit_rate(&self) -> f64 {
        ratio(self.hit_requests as f64, self.requests as f64)
    }
    /// FLOPs saved / FLOPs with no cache.
    pub fn flop_savings_rate(&self) -> f64 {
        ratio(self.flops_saved, self.flops_total)
    }
}

fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 {
        a / b
    } else {
        0.0
    }
}

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
    ns: u64,
    /// Deepest pinned node (its ancestors are pinned too); NIL if none.
    pinned: NodeId,
    input_len: u32,
    input_fingerprint: u64,
    plan: Vec<u32>,
    /// The longest sequence admitted under this lease (kept only while the
    /// tuner records a window).
    admitted: Option<Vec<u32>>,
}

/// Everything but the tuner: the state a tuning replay clones.
#[derive(Clone, Debug)]
pub(crate) struct Core {
    pub(crate) cfg: CacheConfig,
    /// The eviction policy `cfg.eviction` names.
    pub(crate) eviction: Arc<dyn Eviction>,
    /// Bytes charged per cached token and per state.
    pub(crate) kv_bpt: u64,
    pub(crate) state_b: u64,
    pub(crate) tree: Tree,
    pub(crate) index: Index,
    pub(crate) alpha: f64,
    /// Logical time: one tick per lookup and per admission.
    pub(crate) clock: u64,
    next_lease: LeaseId,
    leases: BTreeMap<LeaseId, LeaseInfo>,
    /// Total tokens on edges and total states, for byte accounting.
    pub(crate) kv_tokens: u64,
    pub(crate) states: u64,
    /// Engine slots and pages the cache owns.
    pub(crate) slot_owner: HashSet<u32>,
    pub(crate) page_owner: HashSet<u32>,
    /// Whether admitted sequences carry page ids (fixed by the first admission).
    tracks_pages: Option<bool>,
    pub(crate) freed: Freed,
    pub(crate) stats: Stats,
    pub(crate) log: DecisionLog,
}

/// Fingerprint of a token sequence: checks that an admission extends the
/// looked-up input without keeping a copy of it.
fn fingerprint(tokens: &[u32]) -> u64 {
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

fn round_down(x: u32, grid: u32) -> u32 {
    x - x % grid
}

/// The block boundaries past `hit` up to `len` (`block`, `2·block`, …),
/// counted in u64 so that no multiple wraps near 2^32.
fn block_positions(hit: u32, block: u32, len: u32) -> impl Iterator<Item = u32> {
    let block = u64::from(block.max(1));
    let first = (u64::from(hit) / block + 1) * block;
    (first..=u64::from(len))
        .step_by(usize::try_from(block).unwrap_or(usize::MAX))
        // Every position is at most `len`, a u32.
        .map(|p| u32::try_from(p).unwrap_or(u32::MAX))
}

impl Core {
    fn new(cfg: CacheConfig) -> Result<Self, CacheError> {
        cfg.validate()?;
        let oracle = cfg.admission == AdmissionPolicy::Oracle;
        let alpha = match &cfg.alpha {
            AlphaMode::Fixed(a) => *a,
            AlphaMode::Auto(_) => 0.0,
        };
        Ok(Core {
            eviction: eviction::from_config(&cfg),
            kv_bpt: match cfg.model.kv_bytes_per_token() {
                0 => TOKEN_ID_BYTES,
                kv => kv,
            },
            state_b: if oracle { 0 } else { cfg.model.state_bytes() },
            stats: Stats {
                capacity_bytes: cfg.capacity_bytes,
                alpha,
                ..Stats::default()
            },
            log: DecisionLog::new(cfg.decision_log),
            cfg,
            tree: Tree::default(),
            index: Index::default(),
            alpha,
            clock: 0,
            next_lease: 1,
            leases: BTreeMap::new(),
            kv_tokens: 0,
            states: 0,
            slot_owner: HashSet::new(),
            page_owner: HashSet::new(),
            tracks_pages: None,
            freed: Freed::default(),
        })
    }

    pub(crate) fn used_bytes(&self) -> u64 {
        (self.kv_tokens.saturating_mul(self.kv_bpt))
            .saturating_add(self.states.saturating_mul(self.state_b))
    }

    /// Whether every matched position is usable without a state.
    pub(crate) fn stateless_hits(&self) -> bool {
        self.cfg.admission == AdmissionPolicy::Oracle || self.cfg.model.ssm_layers == 0
    }

    /// The cut for a checkpoint inside the prefill: page and checkpoint grid.
    fn inner_grid(&self) -> u32 {
        let (a, b) = (self.cfg.page_size, self.cfg.checkpoint_grid);
        let g = gcd(a, b);
        (a / g).saturating_mul(b)
    }

    // ---- pins ---------------------------------------------------------

    fn pin(&mut self, id: NodeId) {
        let mut cur = id;
        while cur != NIL {
            let n = self.tree.node_mut(cur);
            n.leases += 1;
            let first = n.leases == 1;
            let parent = n.parent;
            if first {
                self.refresh(cur);
            }
            cur = parent;
        }
    }

    fn unpin(&mut self, id: NodeId) {
        let mut cur = id;
        while cur != NIL {
            let n = self.tree.node_mut(cur);
            debug_assert!(n.leases > 0);
            n.leases -= 1;
            let last = n.leases == 0;
            let parent = n.parent;
            if last {
                self.refresh(cur);
            }
            cur = parent;
        }
    }

    // ---- lookup ---------------------------------------------------------

    fn check_tokens(tokens: &[u32]) -> Result<(), CacheError> {
        if tokens.is_empty() {
            return Err(CacheError::EmptyTokens);
        }
        if tokens.len() >= u32::MAX as usize {
            return Err(CacheError::TooManyTokens { len: tokens.len() });
        }
        Ok(())
    }

    pub(crate) fn lookup(&mut self, ns: u64, input: &[u32]) -> Result<Lookup, CacheError> {
        self.lookup_walk(ns, input, true).map(|(l, _)| l)
    }

    /// [`lookup`](Self::lookup), also returning its walk of the input so that
    /// an admission right after it (nothing changed in between) can resume it.
    fn lookup_walk(
        &mut self,
        ns: u64,
        input: &[u32],
        with_fingerprint: bool,
    ) -> Result<(Lookup, Option<Walk>), CacheError> {
        Self::check_tokens(input)?;
        self.clock += 1;
        let len = input.len() as u32;
        let page = self.cfg.page_size;
        let root = self.tree.root(ns);
        let walk = root.map(|r| self.tree.walk(r, input, page));
        let matched = walk.as_ref().map_or(0, |w| w.matched);
        let kv_matched = round_down(matched, page);
        // The last input token is always recomputed: its logits start decoding.
        let limit = len - 1;

        // The usable hit and the node that carries it.
        let mut hit = 0u32;
        let mut hit_node = NIL;
        let mut state_depths = BTreeSet::new();
        if let Some(w) = &walk {
            if self.stateless_hits() {
                let h = round_down(matched.min(limit), page);
                if h > 0 {
                    hit = h;
                    // The node whose edge contains position h.
                    hit_node = w
                        .path
                        .iter()
                        .copied()
                        .find(|&id| self.tree.node(id).depth >= h)
                        .or(w.partial.map(|(id, _)| id))
                        .unwrap_or(NIL);
                }
            } else {
                for &id in &w.path {
                    let n = self.tree.node(id);
                    if n.state.is_some() {
                        state_depths.insert(n.depth);
                        if n.depth <= limit {
                            hit = n.depth;
                            hit_node = id;
                        }
                    }
                }
            }
        }

        let plan = match (self.cfg.admission, &walk) {
            (AdmissionPolicy::Marconi, Some(w)) => self.plan_marconi(w, len, hit, &state_depths),
            (AdmissionPolicy::AllBlocks { block_size }, _) => {
                let plan: Vec<u32> = block_positions(hit, block_size, len)
                    .filter(|p| !state_depths.contains(p))
                    .collect();
                (!plan.is_empty()).then_some((plan, PlanReason::Blocks))
            }
            _ => None,
        };

        let mut state_slot = None;
        let mut kv_pages = Vec::new();
        if hit_node != NIL {
            self.touch_hit(hit_node);
            self.pin(hit_node);
            if !self.stateless_hits() {
                state_slot = self.tree.node(hit_node).state.and_then(|s| s.slot);
            }
            if self.tracks_pages == Some(true) {
                kv_pages = self.pages_up_to(hit_node, hit);
            }
        }

        let lease = self.next_lease;
        self.next_lease += 1;
        let (plan, reason) = match plan {
            Some((p, r)) => (p, Some(r)),
            None => (Vec::new(), None),
        };
        self.leases.insert(
            lease,
            LeaseInfo {
                ns,
                pinned: hit_node,
                input_len: len,
                // Only an engine's own admit checks it (the O(n) hash is
                // skipped on the simulator's whole-request path).
                input_fingerprint: if with_fingerprint {
                    fingerprint(input)
                } else {
                    0
                },
                plan: plan.clone(),
                admitted: None,
            },
        );

        let model = &self.cfg.model;
        let s = &mut self.stats;
        s.requests += 1;
        s.input_tokens += u64::from(len);
        s.hit_tokens += u64::from(hit);
        s.hit_requests += u64::from(hit > 0);
        s.kv_matched_unusable_tokens += u64::from(kv_matched.min(limit).saturating_sub(hit));
        s.flops_saved += model.prefill_flops(0, u64::from(hit));
        s.flops_total += model.prefill_flops(0, u64::from(len));
        self.log.push(|| Decision::Lookup {
            lease,
            namespace: ns,
            input: len,
            kv_matched,
            hit,
        });
        if let Some(reason) = reason {
            let positions = plan.clone();
            self.log.push(|| Decision::Plan {
                lease,
                positions,
                reason,
            });
        }
        let lookup = Lookup {
            lease,
            hit_tokens: hit,
            kv_matched_tokens: kv_matched,
            state_slot,
            kv_pages,
            plan,
        };
        Ok((lookup, walk))
    }

    /// Marconi's speculative insertion (paper §4.1): would inserting the
    /// input create a branch node? If so, plan one checkpoint there.
    fn plan_marconi(
        &self,
        w: &crate::tree::Walk,
        len: u32,
        hit: u32,
        state_depths: &BTreeSet<u32>,
    ) -> Option<(Vec<u32>, PlanReason)> {
        let m = w.matched;
        if m == 0 {
            return None;
        }
        let (pos, reason) = match w.partial {
            // The input ends inside a cached edge: the branch is the end of
            // the prompt, where the state after prefill is exact even for
            // chunked-state kernels.
            Some(_) if m == len => (round_down(len, self.cfg.page_size), PlanReason::PromptEnd),
            // The input diverges inside an edge: a new branch node at m.
            Some(_) => (round_down(m, self.inner_grid()), PlanReason::NewBranch),
            None => {
                let &last = w.path.last()?;
                let n = self.tree.node(last);
                if m == len || n.children.is_empty() || n.state.is_some() {
                    // Input fully cached as a node, or a plain extension of a
                    // leaf (a conversation's next turn: the final state covers it).
                    return None;
                }
                (round_down(m, self.inner_grid()), PlanReason::ExistingBranch)
            }
        };
        (pos > hit && pos > 0 && !state_depths.contains(&pos)).then(|| (vec![pos], reason))
    }

    /// Page ids of the first `upto` tokens along the path ending at `node`.
    fn pages_up_to(&self, node: NodeId, upto: u32) -> Vec<u32> {
        let mut chain = Vec::new();
        let mut cur = node;
        while cur != NIL && !self.tree.is_root(cur) {
            chain.push(cur);
            cur = self.tree.node(cur).parent;
        }
        let page = self.cfg.page_size;
        let mut out = Vec::with_capacity((upto / page) as usize);
        for &id in chain.iter().rev() {
            let n = self.tree.node(id);
            let start = n.depth - n.tokens.len() as u32;
            let take = (upto.min(n.depth) - start) / page;
            out.extend_from_slice(&n.pages[..take as usize]);
        }
        out
    }

    // ---- admission ------------------------------------------------------

    fn check_admit(
        &self,
        lease: LeaseId,
        tokens: &[u32],
        states: &[SavedState],
        kv_pages: &[u32],
        verify_prefix: bool,
    ) -> Result<(), CacheError> {
        let info = self
            .leases
            .get(&lease)
            .ok_or(CacheError::UnknownLease(lease))?;
        Self::check_tokens(tokens)?;
        let input_len = info.input_len as usize;
        if tokens.len() < input_len
            || (verify_prefix && fingerprint(&tokens[..input_len]) != info.input_fingerprint)
        {
            return Err(CacheError::PrefixMismatch { input_len });
        }
        let page = self.cfg.page_size;
        let aligned = round_down(tokens.len() as u32, page);
        let full_pages = (aligned / page) as usize;
        if !kv_pages.is_empty() && kv_pages.len() != full_pages {
            return Err(CacheError::BadPageList {
                expected: full_pages,
                got: kv_pages.len(),
            });
        }
        if let Some(tracks) = self.tracks_pages {
            if tracks == kv_pages.is_empty() && full_pages > 0 {
                return Err(CacheError::BadPageList {
                    expected: if tracks { full_pages } else { 0 },
                    got: kv_pages.len(),
                });
            }
        }
        let mut seen_pages = HashSet::new();
        for &p in kv_pages {
            if !seen_pages.insert(p) {
                return Err(CacheError::DuplicatePage(p));
            }
        }
        let mut positions = HashSet::new();
        let mut slots = HashSet::new();
        for s in states {
            if s.position == 0 || s.position as usize > tokens.len() {
                return Err(CacheError::PositionOutOfRange {
                    position: s.position,
                    len: tokens.len(),
                });
            }
            let allowed = match self.cfg.admission {
                AdmissionPolicy::Marconi => {
                    info.plan.contains(&s.position) || s.position == aligned
                }
                AdmissionPolicy::AllBlocks { block_size } => s.position % block_size == 0,
                AdmissionPolicy::Oracle => false,
            };
            if !allowed {
                let allowed = match self.cfg.admission {
                    AdmissionPolicy::Marconi => {
                        format!("planned {:?} or the final position {aligned}", info.plan)
                    }
                    AdmissionPolicy::AllBlocks { block_size } => {
                        format!("multiples of the block size {block_size}")
                    }
                    AdmissionPolicy::Oracle => "none: the oracle keeps no states".into(),
                };
                return Err(CacheError::NotPlanned {
                    position: s.position,
                    allowed,
                });
            }
            if !positions.insert(s.position) {
                return Err(CacheError::DuplicatePosition(s.position));
            }
            if let Some(slot) = s.slot {
                if !slots.insert(slot) || self.slot_owner.contains(&slot) {
                    return Err(CacheError::DuplicateSlot(slot));
                }
            }
        }
        Ok(())
    }

    pub(crate) fn admit(
        &mut self,
        lease: LeaseId,
        tokens: &[u32],
        states: &[SavedState],
        kv_pages: &[u32],
        verify_prefix: bool,
    ) -> Result<AdmitOutcome, CacheError> {
        self.admit_with(lease, tokens, states, kv_pages, verify_prefix, None)
    }

    /// [`admit`](Self::admit), resuming `prior` (the lease's lookup walk on
    /// the unchanged tree) instead of walking the input again.
    fn admit_with(
        &mut self,
        lease: LeaseId,
        tokens: &[u32],
        states: &[SavedState],
        kv_pages: &[u32],
        verify_prefix: bool,
        prior: Option<Walk>,
    ) -> Result<AdmitOutcome, CacheError> {
        self.check_admit(lease, tokens, states, kv_pages, verify_prefix)?;
        let ns = self.leases[&lease].ns;
        let page = self.cfg.page_size;
        let aligned = round_down(tokens.len() as u32, page);
        let seq = &tokens[..aligned as usize];
        let walk = match (self.tree.root(ns), prior) {
            // A walk that stopped at a mismatch inside the input stops there
            // for any extension of the input too. One that stopped because
            // the input ran out (even less than a page into an edge, where
            // `matched` counts nothing) goes on along the extension.
            (Some(_), Some(w)) if !w.ran_out && w.matched <= aligned => w,
            (Some(root), Some(w)) if w.matched <= aligned => {
                self.tree.walk_from(root, w, seq, page)
            }
            (Some(root), _) => self.tree.walk(root, seq, page),
            (None, _) => Walk {
                path: Vec::new(),
                matched: 0,
                partial: None,
                ran_out: true,
            },
        };
        #[cfg(feature = "strict-checks")]
        if let Some(root) = self.tree.root(ns) {
            let fresh = self.tree.walk(root, seq, page);
            assert_eq!(
                (&fresh.path, fresh.matched, fresh.partial),
                (&walk.path, walk.matched, walk.partial),
                "resumed walk differs from a fresh one"
            );
        }
        // Splits happen on page boundaries only.
        let m = round_down(walk.matched, page);
        // The pages the cache would take must not be pages it already owns.
        if !kv_pages.is_empty() {
            let taken = &kv_pages[(m / page) as usize..];
            if let Some(&p) = taken.iter().find(|p| self.page_owner.contains(p)) {
                return Err(CacheError::DuplicatePage(p));
            }
        }
        // Checks done: from here on the call changes the cache.
        self.clock += 1;
        if aligned > 0 && self.tracks_pages.is_none() {
            self.tracks_pages = Some(!kv_pages.is_empty());
        }
        let root = self.tree.root_or_insert(ns);

        // Which offered states are new.
        let mut existing = BTreeSet::new();
        for &id in &walk.path {
            let n = self.tree.node(id);
            if n.state.is_some() {
                existing.insert(n.depth);
            }
        }
        let mut states: Vec<SavedState> = states.to_vec();
        states.sort_by_key(|s| s.position);
        let mut outcome = AdmitOutcome {
            kv_pages_taken: 0..0,
            ..AdmitOutcome::default()
        };
        // Models without recurrent layers need no states: any offered are returned.
        let keep_states = !self.stateless_hits();
        let (mut new_states, dup_states): (Vec<SavedState>, Vec<SavedState>) = states
            .iter()
            .partition(|s| keep_states && s.position <= aligned && !existing.contains(&s.position));
        outcome
            .slots_returned
            .extend(dup_states.iter().filter_map(|s| s.slot));
        let mut aligned = aligned;
        // More than 2^64 bytes fits in no budget: saturate, never wrap (a
        // wrapped small need would be admitted over capacity).
        let needed = u64::from(aligned - m)
            .checked_mul(self.kv_bpt)
            .and_then(|kv| kv.checked_add((new_states.len() as u64).checked_mul(self.state_b)?))
            .unwrap_or(u64::MAX);

        // Pin what we extend so eviction cannot pull it from under us.
        let anchor = match walk.partial {
            Some((id, _)) => Some(id),
            None => walk.path.last().copied(),
        };
        if let Some(a) = anchor {
            self.pin(a);
        }
        if !self.make_room(needed) {
            // Everything evictable is gone and the whole still does not fit:
            // cache the longest prefix that does, ending at a state (any page
            // for models without states), as a paged cache would.
            let avail = self.cfg.capacity_bytes - self.used_bytes();
            let (cut, fit) = self.longest_fitting_prefix(m, aligned, &new_states, avail);
            let dropped = new_states.split_off(fit);
            outcome
                .slots_returned
                .extend(dropped.iter().filter_map(|s| s.slot));
            if cut == m && new_states.is_empty() {
                if let Some(a) = anchor {
                    self.unpin(a);
                }
                let reason = format!(
                    "needs {needed} bytes; {} of {} in use are leased",
                    self.used_bytes(),
                    self.cfg.capacity_bytes
                );
                self.stats.admissions_rejected += 1;
                outcome.rejected = Some(reason.clone());
                self.log.push(|| Decision::Admit {
                    lease,
                    tokens: tokens.len() as u32,
                    new_kv: 0,
                    states: Vec::new(),
                    rejected: Some(reason),
                });
                self.finish_admit(lease, tokens);
                return Ok(outcome);
            }
            self.stats.admissions_truncated += 1;
            // Only a cut of the tokens is a truncation (the C ABI reads 0 as
            // "all cached"); dropped states are in `slots_returned`.
            if cut < aligned {
                outcome.truncated_to = Some(cut);
            }
            aligned = cut;
        }
        let new_kv = aligned - m;
        let seq = &seq[..aligned as usize];

        // Insert the new KV.
        if new_kv > 0 {
            let parent = match walk.partial {
                Some((id, on_edge)) => {
                    let cut = round_down(on_edge, page);
                    if cut > 0 {
                        let s = self.tree.split(id, cut, page);
                        self.refresh(s);
                        self.refresh(id);
                        s
                    } else {
                        self.tree.node(id).parent
                    }
                }
                None => walk.path.last().copied().unwrap_or(root),
            };
            // The new part goes in as a chain cut at the new states' positions,
            // so that no long edge is split again and again.
            let mut cuts: Vec<u32> = new_states
                .iter()
                .map(|s| s.position)
                .filter(|&p| p > m && p < aligned)
                .collect();
            cuts.push(aligned);
            let (mut parent, mut start) = (parent, m);
            for end in cuts {
                let pages = if kv_pages.is_empty() {
                    Vec::new()
                } else {
                    kv_pages[(start / page) as usize..(end / page) as usize].to_vec()
                };
                self.page_owner.extend(pages.iter().copied());
                let node = self.tree.add_leaf(
                    parent,
                    seq[start as usize..end as usize].to_vec(),
                    pages,
                    self.clock,
                );
                self.refresh(node);
                self.refresh(parent);
                (parent, start) = (node, end);
            }
            self.kv_tokens += u64::from(new_kv);
            if !kv_pages.is_empty() {
                outcome.kv_pages_taken = m / page..aligned / page;
            }
            outcome.new_kv_tokens = new_kv;
        }

        // Place the states, splitting edges where a position falls inside one.
        let positions: Vec<u32> = new_states.iter().map(|s| s.position).collect();
        let nodes = self.nodes_ending_at(root, seq, &positions);
        for (s, id) in new_states.iter().zip(nodes) {
            let n = self.tree.node_mut(id);
            debug_assert!(n.state.is_none());
            n.state = Some(StateRef { slot: s.slot });
            self.states += 1;
            self.stats.states_admitted += 1;
            if let Some(slot) = s.slot {
                self.slot_owner.insert(slot);
            }
            outcome.states_taken.push(s.position);
            self.touch(id);
        }
        if let Some(a) = anchor {
            self.unpin(a);
        }
        let positions = outcome.states_taken.clone();
        self.log.push(|| Decision::Admit {
            lease,
            tokens: tokens.len() as u32,
            new_kv,
            states: positions,
            rejected: None,
        });
        self.finish_admit(lease, tokens);
        #[cfg(feature = "strict-checks")]
        self.check_invariants();
        Ok(outcome)
    }

    fn finish_admit(&mut self, lease: LeaseId, tokens: &[u32]) {
        let info = self.leases.get_mut(&lease).expect("checked");
        if let Some(prev) = &mut info.admitted {
            if prev.len() < tokens.len() {
                *prev = tokens.to_vec();
            }
        }
    }

    /// The longest prefix `cut` (`m <= cut <= aligned`) whose new KV and new
    /// states fit in `avail` bytes, ending at a new state (or at any page for
    /// models that need no states), and how many of the (ascending)
    /// `new_states` it keeps.
    fn longest_fitting_prefix(
        &self,
        m: u32,
        aligned: u32,
        new_states: &[SavedState],
        avail: u64,
    ) -> (u32, usize) {
        let page = self.cfg.page_size;
        if self.stateless_hits() {
            let tokens = (avail / self.kv_bpt.max(1)).min(u64::from(aligned - m)) as u32;
            return (m + round_down(tokens, page), 0);
        }
        let (mut cut, mut fit) = (m, 0);
        for (i, s) in new_states.iter().enumerate() {
            let kv = u64::from(s.position.saturating_sub(m)).saturating_mul(self.kv_bpt);
            if kv.saturating_add((i as u64 + 1).saturating_mul(self.state_b)) > avail {
                break;
            }
            (cut, fit) = (cut.max(s.position), i + 1);
        }
        (cut, fit)
    }

    /// The nodes whose edges end exactly at `positions` (ascending) on
    /// `seq`'s path, splitting edges where needed, in one walk down the path.
    /// The path must exist.
    fn nodes_ending_at(&mut self, root: NodeId, seq: &[u32], positions: &[u32]) -> Vec<NodeId> {
        let page = self.cfg.page_size;
        let mut out = Vec::with_capacity(positions.len());
        let (mut cur, mut depth) = (root, 0u32);
        for &p in positions {
            while depth < p {
                let rest = &seq[depth as usize..];
                let child = self.tree.child_on_path(cur, rest, page);
                let child_depth = self.tree.node(child).depth;
                if child_depth <= p {
                    (cur, depth) = (child, child_depth);
                } else {
                    let s = self.tree.split(child, p - depth, page);
                    self.refresh(child);
                    self.refresh(s);
                    (cur, depth) = (s, p);
                }
            }
            out.push(cur);
        }
        out
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
        })
    }

    pub(crate) fn set_recording(&mut self, lease: LeaseId) {
        if let Some(i) = self.leases.get_mut(&lease) {
            i.admitted = Some(Vec::new());
        }
    }

    pub(crate) fn stats(&self) -> Stats {
        let mut s = self.stats.clone();
        s.kv_bytes = self.kv_tokens.saturating_mul(self.kv_bpt);
        s.state_bytes = self.states.saturating_mul(self.state_b);
        s.states = self.states;
        s.nodes = (self.tree.live_count() - self.tree.roots.len()) as u64;
        s.leases = self.leases.len() as u64;
        s.alpha = self.alpha;
        s
    }

    /// Turns a plain clone into a copy for replaying a tuning window: no
    /// leases, no log, nothing pending for the engine, fresh counters, the
    /// index rebuilt. O(nodes · log nodes): the tuner runs it on the search
    /// thread, off the request path (which pays only the clone).
    pub(crate) fn prepare_for_replay(&mut self) {
        let c = self;
        c.leases.clear();
        c.log = DecisionLog::new(false);
        c.freed = Freed::default();
        c.index.clear();
        for id in 0..c.tree.nodes.len() as NodeId {
            let n = c.tree.node_mut(id);
            n.leases = 0;
            n.cand = None;
        }
        for id in 0..c.tree.nodes.len() as NodeId {
            if c.tree.node(id).live {
                c.refresh(id);
            }
        }
        c.stats = Stats::default();
    }

    /// Lookup, admission of every planned state and the final state, release:
    /// a request that runs to completion before the next one arrives.
    pub(crate) fn serve(
        &mut self,
        ns: u64,
        input: &[u32],
        full: &[u32],
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
        let (l, walk) = self.lookup_walk(ns, input, false)?;
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

    /// The states an engine following the plan saves for a sequence of
    /// `full_len` tokens, whose lookup planned `plan` and hit `hit`.
    pub(crate) fn states_for(&self, plan: &[u32], hit: u32, full_len: usize) -> Vec<SavedState> {
        let state = |position| SavedState {
            position,
            slot: None,
        };
        // Longer than a sequence may be (the admission will refuse it): no
        // position beyond u32, and no wrap to the length's low bits.
        let len = u32::try_from(full_len).unwrap_or(u32::MAX);
        let aligned = round_down(len, self.cfg.page_size);
        if self.stateless_hits() {
            return Vec::new();
        }
        match self.cfg.admission {
            AdmissionPolicy::Marconi => {
                let mut v: Vec<SavedState> = plan.iter().map(|&p| state(p)).collect();
                if aligned > 0 && !plan.contains(&aligned) {
                    v.push(state(aligned));
                }
                v
            }
            AdmissionPolicy::AllBlocks { block_size } => {
                block_positions(hit, block_size, len).map(state).collect()
            }
            AdmissionPolicy::Oracle => Vec::new(),
        }
    }

    // ---- invariants -----------------------------------------------------

    /// Checks every structural and accounting invariant; panics with a
    /// description on the first violation. Cost: O(nodes + tokens).
    pub(crate) fn check_invariants(&self) {
        let mut kv = 0u64;
        let mut states = 0u64;
        let mut cands = 0usize;
        let mut pins: Vec<u32> = vec![0; self.tree.nodes.len()];
        for (lease, info) in &self.leases {
            assert!(
                info.pinned == NIL || self.tree.node(info.pinned).live,
                "lease {lease} pins an evicted node"
            );
            let mut cur = info.pinned;
            while cur != NIL {
                pins[cur as usize] += 1;
                cur = self.tree.node(cur).parent;
            }
        }
        for (id, n) in self.tree.nodes.iter().enumerate() {
            let id = id as NodeId;
            if !n.live {
                continue;
            }
            assert_eq!(n.leases, pins[id as usize], "node {id} lease count");
            if n.parent == NIL {
                assert!(n.tokens.is_empty() && n.state.is_none() && n.depth == 0);
            } else {
                let p = self.tree.node(n.parent);
                assert!(p.live, "node {id} has a dead parent");
                assert!(!n.tokens.is_empty(), "node {id} has an empty edge");
                assert!(
                    p.children.contains(&(n.tokens[0], id)),
                    "parent link of {id}"
                );
                assert_eq!(p.depth + n.tokens.len() as u32, n.depth, "depth of {id}");
                assert_eq!(
                    n.tokens.len() as u32 % self.cfg.page_size,
                    0,
                    "edge of {id} not page aligned"
                );
                if !n.pages.is_empty() {
                    assert_eq!(
                        n.pages.len() as u64 * u64::from(self.cfg.page_size),
                        n.tokens.len() as u64
                    );
                }
                kv += n.tokens.len() as u64;
                // Every state's prefix KV is present: the path to a live node
                // is made of live nodes, checked by the parent link above.
            }
            states += u64::from(n.state.is_some());
            assert!(n.children.windows(2).all(|w| w[0].0 <= w[1].0));
            let page = self.cfg.page_size as usize;
            for w in n.children.windows(2) {
                let (a, b) = (
                    &self.tree.node(w[0].1).tokens,
                    &self.tree.node(w[1].1).tokens,
                );
                assert!(
                    crate::tree::common_prefix(a, b) < page,
                    "children of {id} share a whole page"
                );
            }
            for &(t, c) in &n.children {
                let cn = self.tree.node(c);
                assert!(cn.live && cn.parent == id && cn.tokens[0] == t);
            }
            assert_eq!(
                n.cand.is_some(),
                self.eligible(id),
                "index membership of {id}"
            );
            cands += usize::from(n.cand.is_some());
        }
        assert_eq!(kv, self.kv_tokens, "kv token recount");
        assert_eq!(states, self.states, "state recount");
        assert_eq!(cands, self.index.len(), "index size");
        assert!(
            self.used_bytes() <= self.cfg.capacity_bytes,
            "over capacity: {} > {}",
            self.used_bytes(),
            self.cfg.capacity_bytes
        );
    }
}

/// What a released lease leaves for the tuner.
#[derive(Clone, Debug)]
pub(crate) struct LeaseInfoOut {
    pub(crate) ns: u64,
    pub(crate) input_len: u32,
    pub(crate) admitted: Option<Vec<u32>>,
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
}

impl PrefixCache {
    /// A cache built from `cfg`; fails on an invalid configuration.
    pub fn new(cfg: CacheConfig) -> Result<Self, CacheError> {
        let core = Core::new(cfg)?;
        let tuner = match &core.cfg.alpha {
            AlphaMode::Auto(t) if core.eviction.tunes_alpha() => Some(Tuner::new(t.clone())),
            _ => None,
        };
        Ok(PrefixCache { core, tuner })
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
        if self.tuner.as_ref().is_some_and(Tuner::recording) {
            self.core.set_recording(l.lease);
        }
        Ok(l)
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
        let out = self.core.release(lease)?;
        self.after_request(out);
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
        if input_len > full.len() {
            return Err(CacheError::PrefixMismatch { input_len });
        }
        let recording = self.tuner.as_ref().is_some_and(Tuner::recording);
        let (served, mut out) = self.core.serve(ns, &full[..input_len], full)?;
        if recording {
            out.admitted = Some(full.to_vec());
        }
        self.after_request(out);
        Ok(served)
    }

    fn after_request(&mut self, out: LeaseInfoOut) {
        if let Some(t) = &mut self.tuner {
            t.after_request(&mut self.core, out);
        }
    }

    /// Evicts until at least `bytes` are free (or nothing evictable is left);
    /// returns the bytes now free. Freed ids go to [`drain_freed`](Self::drain_freed).
    pub fn evict(&mut self, bytes: u64) -> u64 {
        let want = bytes.min(self.core.cfg.capacity_bytes);
        self.core.make_room(want);
        self.core.cfg.capacity_bytes - self.core.used_bytes()
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

    /// Engine ids freed since the last call.
    pub fn drain_freed(&mut self) -> Freed {
        self.core.drain_freed()
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
    }
}

#[cfg(test)]
mod tests {
    use super::fingerprint;

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
}
