//! Admission: which recurrent states the cache asks for and accepts, and
//! the admission of a finished request's tokens and states.
//!
//! A policy is a type behind [`Admission`], one file per policy: the
//! checkpoints planned at lookup, the states accepted at admission, the
//! states a simulated engine saves. The admission itself is the same for
//! every policy and is `Core`'s here, in named steps ([`Core::admit_with`]):
//! check, walk, pick the new states, make room (or truncate, or reject),
//! insert the new KV, place the states.
//!
//! Policies: [`Marconi`] (paper §4.1), [`AllBlocks`] (vLLM+, §5.1) and
//! [`Oracle`] (the unbounded ceiling).
//!
//! Adding a policy: a new file here with a type implementing [`Admission`]
//! (its doc cites what it implements and says when not to use it), a `mod`
//! line, a variant of [`crate::AdmissionPolicy`] and one arm in
//! [`from_config`] (plus a check in `CacheConfig::validate` if it has
//! parameters, a policy number in marconi-ffi's configuration to reach it
//! from C); nothing else changes. Then a decision-log snapshot test of a
//! trace where it plans differently (`tests/decision_log.rs`).

mod all_blocks;
mod marconi;
mod oracle;

use std::collections::{BTreeSet, HashSet};
use std::sync::Arc;

use serde::Serialize;

use crate::cache::{fingerprint, round_down, Core, LeaseId};
use crate::config::{AdmissionPolicy, CacheConfig};
use crate::error::CacheError;
use crate::eviction::UnitUse;
use crate::log::{Decision, PlanReason};
use crate::tree::{NodeId, Span, StateRef, Tree, Walk};

pub(crate) use all_blocks::AllBlocks;
pub(crate) use marconi::Marconi;
pub(crate) use oracle::Oracle;

/// What a lookup knows when it plans checkpoints.
pub(crate) struct PlanInput<'a> {
    /// The tree, as the lookup found it.
    pub(crate) tree: &'a Tree,
    /// The walk of the input from its namespace's root (None when the
    /// namespace has no tree yet).
    pub(crate) walk: Option<&'a Walk>,
    /// Input length.
    pub(crate) len: u32,
    /// The usable hit.
    pub(crate) hit: u32,
    /// Depths of the states on the matched path (empty where hits need no
    /// states).
    pub(crate) state_depths: &'a BTreeSet<u32>,
    /// Tokens per KV page.
    pub(crate) page_size: u32,
    /// The grid of a checkpoint inside the prefill: a multiple of both the
    /// page size and the checkpoint grid.
    pub(crate) inner_grid: u32,
}

/// The rules of an admission policy.
///
/// A policy is immutable once built (`&self` everywhere) and shared by the
/// cache and its tuning replays (`Send + Sync`, cloned as an `Arc`). No
/// hook changes the cache: the planned positions are kept on the lease and
/// handed back to [`admissible`](Self::admissible).
pub(crate) trait Admission: std::fmt::Debug + Send + Sync {
    /// Whether every matched position is usable without a state (and
    /// states cost nothing). Called once, when the cache is built; when
    /// true, offered states are returned to the engine and
    /// [`states_to_save`](Self::states_to_save) is not called.
    fn every_position_usable(&self) -> bool {
        false
    }

    /// The checkpoints to save during this prefill, ascending, with the
    /// reason logged; `None` for none.
    ///
    /// The caller guarantees `0 <= input.hit < input.len` and that the walk
    /// is of this input on the unchanged tree. Every position MUST be
    /// greater than the hit, at most the input length, a multiple of the
    /// page size and not in `input.state_depths` (already cached).
    /// Called once per lookup; its cost adds to every lookup's (Marconi's
    /// is O(1) on the walk, all-blocks' O(positions)).
    fn plan(&self, input: &PlanInput<'_>) -> Option<(Vec<u32>, PlanReason)>;

    /// Whether an offered state at `position` is accepted, given the
    /// lease's `plan` and the admitted length rounded down to the page
    /// size (`aligned`). The caller guarantees `0 < position <= tokens`
    /// and accepts `position == aligned` (the final state) without asking,
    /// so a policy's grid never refuses the state an engine always saves.
    /// A refusal fails the whole admission with
    /// [`CacheError::NotPlanned`]. O(plan length), per offered state.
    fn admissible(&self, position: u32, plan: &[u32], aligned: u32) -> bool;

    /// What [`admissible`](Self::admissible) accepts, in words, for the
    /// error message. Called only on a refusal.
    fn describe_admissible(&self, plan: &[u32], aligned: u32) -> String;

    /// The positions whose states an engine that follows the plan saves
    /// for a sequence of `len` tokens (`aligned`: rounded down to the page
    /// size) whose lookup planned `plan` and hit `hit`: what the
    /// simulator's whole-request path admits. Every position MUST be
    /// [`admissible`](Self::admissible). Called once per simulated request.
    fn states_to_save(&self, plan: &[u32], hit: u32, len: u32, aligned: u32) -> Vec<u32>;
}

/// The policy a configuration names.
pub(crate) fn from_config(cfg: &CacheConfig) -> Arc<dyn Admission> {
    match cfg.admission {
        AdmissionPolicy::Marconi => Arc::new(Marconi {
            min_branch_depth: cfg.min_branch_depth,
        }),
        AdmissionPolicy::AllBlocks { block_size } => Arc::new(AllBlocks { block_size }),
        AdmissionPolicy::Oracle => Arc::new(Oracle),
    }
}

/// The application checkpoint hints a lookup adds to the policy's plan
/// `planned` (ascending): each hint rounded down to `input.inner_grid`,
/// kept when it is greater than the hit, at most the input length, not
/// already cached on the matched path (`input.state_depths`) and not
/// already planned; ascending, without duplicates. Every other hint is
/// dropped silently (a hint is advice, and the application cannot know
/// what is cached). The caller skips this where hits need no states.
/// O(h log h) for h hints.
pub(crate) fn app_checkpoints(input: &PlanInput<'_>, planned: &[u32], hints: &[u32]) -> Vec<u32> {
    let mut out: Vec<u32> = hints
        .iter()
        .map(|&h| round_down(h, input.inner_grid))
        .filter(|&p| {
            p > input.hit
                && p <= input.len
                && !input.state_depths.contains(&p)
                && !planned.contains(&p)
        })
        .collect();
    out.sort_unstable();
    out.dedup();
    out
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

impl Core {
    /// Every check of an admission, before anything changes.
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
            || (verify_prefix
                && fingerprint(&tokens[info.pinned_tokens as usize..input_len])
                    != info.input_fingerprint)
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
        if let Some(p) = first_repeated_page(kv_pages) {
            return Err(CacheError::DuplicatePage(p));
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
            // The final state (the admitted length rounded down to the
            // page size) is admissible under every policy; a policy rules
            // on the others.
            if s.position != aligned && !self.admission.admissible(s.position, &info.plan, aligned)
            {
                return Err(CacheError::NotPlanned {
                    position: s.position,
                    allowed: self.admission.describe_admissible(&info.plan, aligned),
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
    pub(crate) fn admit_with(
        &mut self,
        lease: LeaseId,
        tokens: &[u32],
        states: &[SavedState],
        kv_pages: &[u32],
        verify_prefix: bool,
        prior: Option<Walk>,
    ) -> Result<AdmitOutcome, CacheError> {
        if let Err(e) = self.check_admit(lease, tokens, states, kv_pages, verify_prefix) {
            // The fingerprint covers only the input past the pinned hit; the
            // pinned part is checked along the walk below. A call refused for
            // another reason (pages, states) whose pinned prefix also differs
            // reports the mismatch first, as when the whole input was hashed:
            // this path is taken only by refused calls.
            if verify_prefix && refused_after_the_prefix_check(&e) {
                self.check_pinned_prefix_by_path(lease, tokens)?;
            }
            return Err(e);
        }
        let ns = self.leases[&lease].ns;
        let page = self.cfg.page_size;
        let aligned = round_down(tokens.len() as u32, page);
        let seq = &tokens[..aligned as usize];
        let walk = self.admission_walk(ns, seq, prior);
        if verify_prefix {
            self.check_pinned_prefix(lease, tokens, &walk)?;
        }
        // Splits happen on page boundaries only.
        let m = round_down(walk.matched, page);
        self.check_pages_not_owned(kv_pages, m)?;

        // Checks done: from here on the call changes the cache.
        self.clock += 1;
        if aligned > 0 && self.tracks_pages.is_none() {
            self.tracks_pages = Some(!kv_pages.is_empty());
        }
        let root = self.tree.root_or_insert(ns);
        let mut outcome = AdmitOutcome {
            kv_pages_taken: 0..0,
            ..AdmitOutcome::default()
        };
        let mut new_states = self.new_states(&walk, states, aligned, &mut outcome);
        // Pin what we extend so eviction cannot pull it from under us.
        let anchor = match walk.partial {
            Some((id, _)) => Some(id),
            None => walk.path.last().copied(),
        };
        if let Some(a) = anchor {
            self.pin(a);
        }
        let Some(aligned) = self.make_room_or_truncate(m, aligned, &mut new_states, &mut outcome)
        else {
            if let Some(a) = anchor {
                self.unpin(a);
            }
            self.reject(lease, tokens, &mut outcome);
            return Ok(outcome);
        };
        let seq = &seq[..aligned as usize];
        let new_kv = aligned - m;
        // The leaf the lookup resumed from, when this admission extends it
        // (the anchor): superseded by the states the new chain takes.
        let info = &self.leases[&lease];
        let superseded = (walk.partial.is_none()
            && new_kv > 0
            && anchor == Some(info.pinned)
            && self.tree.node(info.pinned).children.is_empty())
        .then(|| {
            let depth = self.tree.node(info.pinned).depth;
            (info.pinned, info.pinned_before_hit, depth)
        });
        if new_kv > 0 {
            self.insert_kv(&walk, root, seq, m, &new_states, kv_pages);
            if !kv_pages.is_empty() {
                outcome.kv_pages_taken = m / page..aligned / page;
            }
            outcome.new_kv_tokens = new_kv;
        }
        self.place_states(root, seq, &new_states, &mut outcome);
        // Superseded only if a deeper state below it was taken (not when
        // the admission was truncated short of one).
        if let Some((node, before_hit, depth)) = superseded {
            if outcome.states_taken.iter().any(|&p| p > depth) {
                self.age_superseded(node, before_hit);
            }
        }
        self.events_admitted(ns, seq, m, &outcome.states_taken);
        if let Some(a) = anchor {
            self.unpin(a);
        }
        // Built only when a log or a tracing subscriber takes it.
        self.log.push(|| Decision::Admit {
            lease,
            tokens: tokens.len() as u32,
            new_kv,
            states: outcome.states_taken.clone(),
            rejected: None,
        });
        self.finish_admit(lease, tokens);
        #[cfg(feature = "strict-checks")]
        self.check_invariants();
        Ok(outcome)
    }

    /// The walk of the admitted sequence `seq`, resuming the lookup's walk
    /// `prior` where it can.
    fn admission_walk(&self, ns: u64, seq: &[u32], prior: Option<Walk>) -> Walk {
        let page = self.cfg.page_size;
        let aligned = seq.len() as u32;
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
        walk
    }

    /// The input's leading tokens that the lease's pinned path spells (the
    /// fingerprint covers only the rest) must be the admitted ones: free
    /// when the admission's walk of `tokens` ran through the pinned node,
    /// else compared along the pinned path.
    fn check_pinned_prefix(
        &self,
        lease: LeaseId,
        tokens: &[u32],
        walk: &Walk,
    ) -> Result<(), CacheError> {
        let info = &self.leases[&lease];
        let (pinned, n) = (info.pinned, info.pinned_tokens);
        if n == 0 {
            return Ok(());
        }
        let walked_through = walk.matched >= n
            && (walk.path.contains(&pinned) || walk.partial.is_some_and(|(id, _)| id == pinned));
        if walked_through || self.tree.path_starts_with(pinned, &tokens[..n as usize]) {
            Ok(())
        } else {
            Err(CacheError::PrefixMismatch {
                input_len: info.input_len as usize,
            })
        }
    }

    /// [`check_pinned_prefix`](Self::check_pinned_prefix) without a walk:
    /// compared along the pinned path (refused calls only).
    fn check_pinned_prefix_by_path(
        &self,
        lease: LeaseId,
        tokens: &[u32],
    ) -> Result<(), CacheError> {
        let Some(info) = self.leases.get(&lease) else {
            return Ok(());
        };
        let n = info.pinned_tokens as usize;
        if n == 0 || (tokens.len() >= n && self.tree.path_starts_with(info.pinned, &tokens[..n])) {
            Ok(())
        } else {
            Err(CacheError::PrefixMismatch {
                input_len: info.input_len as usize,
            })
        }
    }

    /// The pages the cache would take (past the matched `m` tokens) must
    /// not be pages it already owns.
    fn check_pages_not_owned(&self, kv_pages: &[u32], m: u32) -> Result<(), CacheError> {
        if !kv_pages.is_empty() {
            let taken = &kv_pages[(m / self.cfg.page_size) as usize..];
            if let Some(&p) = taken.iter().find(|&&p| self.page_owner.contains(p)) {
                return Err(CacheError::DuplicatePage(p));
            }
        }
        Ok(())
    }

    /// The offered states not cached yet on the walked path, ascending;
    /// the slots of the others go to `outcome.slots_returned`.
    fn new_states(
        &self,
        walk: &Walk,
        states: &[SavedState],
        aligned: u32,
        outcome: &mut AdmitOutcome,
    ) -> Vec<SavedState> {
        let mut existing = BTreeSet::new();
        for &id in &walk.path {
            let n = self.tree.node(id);
            if n.state.is_some() {
                existing.insert(n.depth);
            }
        }
        let mut states: Vec<SavedState> = states.to_vec();
        states.sort_by_key(|s| s.position);
        // Models without recurrent layers need no states: any offered are returned.
        let keep_states = !self.stateless_hits();
        let (new_states, dup_states): (Vec<SavedState>, Vec<SavedState>) = states
            .iter()
            .partition(|s| keep_states && s.position <= aligned && !existing.contains(&s.position));
        outcome
            .slots_returned
            .extend(dup_states.iter().filter_map(|s| s.slot));
        new_states
    }

    /// Evicts until the new KV past `m` and `new_states` fit. When
    /// everything evictable is gone and the whole still does not fit,
    /// keeps the longest prefix that does, ending at a state (any page for
    /// models without states), as a paged cache would: the dropped states'
    /// slots go to `outcome.slots_returned`. Returns the length to cache,
    /// or `None` when nothing fits.
    fn make_room_or_truncate(
        &mut self,
        m: u32,
        aligned: u32,
        new_states: &mut Vec<SavedState>,
        outcome: &mut AdmitOutcome,
    ) -> Option<u32> {
        // More than 2^64 bytes fits in no budget: saturate, never wrap (a
        // wrapped small need would be admitted over capacity).
        let needed = u64::from(aligned - m)
            .checked_mul(self.kv_bpt)
            .and_then(|kv| kv.checked_add((new_states.len() as u64).checked_mul(self.state_b)?))
            .unwrap_or(u64::MAX);
        let units = UnitUse {
            pages: u64::from((aligned - m) / self.cfg.page_size),
            states: new_states.len() as u64,
        };
        if self.make_room_for(needed, units) {
            return Some(aligned);
        }
        let avail = self.cfg.capacity_bytes - self.used_bytes();
        let (cut, fit) = self.longest_fitting_prefix(m, aligned, new_states, avail);
        let dropped = new_states.split_off(fit);
        outcome
            .slots_returned
            .extend(dropped.iter().filter_map(|s| s.slot));
        if cut == m && new_states.is_empty() {
            outcome.rejected = Some(format!(
                "needs {needed} bytes; {} of {} in use are leased",
                self.used_bytes(),
                self.cfg.capacity_bytes
            ));
            return None;
        }
        self.stats.admissions_truncated += 1;
        // Only a cut of the tokens is a truncation (the C ABI reads 0 as
        // "all cached"); dropped states are in `slots_returned`.
        if cut < aligned {
            outcome.truncated_to = Some(cut);
        }
        Some(cut)
    }

    /// Records an admission that cached nothing (`outcome.rejected` set).
    fn reject(&mut self, lease: LeaseId, tokens: &[u32], outcome: &mut AdmitOutcome) {
        self.stats.admissions_rejected += 1;
        let reason = outcome.rejected.clone();
        self.log.push(|| Decision::Admit {
            lease,
            tokens: tokens.len() as u32,
            new_kv: 0,
            states: Vec::new(),
            rejected: reason,
        });
        self.finish_admit(lease, tokens);
    }

    /// Inserts `seq[m..]` below the walk's end (splitting the edge it ended
    /// inside), as a chain cut at the new states' positions so that no long
    /// edge is split again and again, with its pages when the engine gives
    /// them.
    fn insert_kv(
        &mut self,
        walk: &Walk,
        root: NodeId,
        seq: &[u32],
        m: u32,
        new_states: &[SavedState],
        kv_pages: &[u32],
    ) {
        let page = self.cfg.page_size;
        let aligned = seq.len() as u32;
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
        let mut cuts: Vec<u32> = new_states
            .iter()
            .map(|s| s.position)
            .filter(|&p| p > m && p < aligned)
            .collect();
        cuts.push(aligned);
        // One buffer for the chain's tokens and one for its pages, each
        // node a range of them: a later merge of two of these nodes (an
        // eviction of the state between them) copies nothing.
        let chain = Span::from_vec(seq[m as usize..].to_vec());
        let first_page = (m / page) as usize;
        let chain_pages = if kv_pages.is_empty() {
            Span::default()
        } else {
            Span::from_vec(kv_pages[first_page..(aligned / page) as usize].to_vec())
        };
        self.page_owner.extend(chain_pages.iter().copied());
        let (mut parent, mut start) = (parent, m);
        for end in cuts {
            let pages = if chain_pages.is_empty() {
                Span::default()
            } else {
                chain_pages.slice(
                    (start / page) as usize - first_page,
                    (end / page) as usize - first_page,
                )
            };
            let node = self.tree.add_leaf_span(
                parent,
                chain.slice((start - m) as usize, (end - m) as usize),
                pages,
                self.clock,
            );
            self.refresh(node);
            self.refresh(parent);
            (parent, start) = (node, end);
        }
        self.kv_tokens += u64::from(aligned - m);
    }

    /// Places `new_states` on `seq`'s path, splitting edges where a
    /// position falls inside one; their positions go to
    /// `outcome.states_taken`, their slots become the cache's.
    fn place_states(
        &mut self,
        root: NodeId,
        seq: &[u32],
        new_states: &[SavedState],
        outcome: &mut AdmitOutcome,
    ) {
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
        // Under a unit budget, the pages and states must fit it too.
        let units_fit = |tokens: u32, states: u64| {
            self.units.is_none_or(|b| {
                b.fits(self.units_with(UnitUse {
                    pages: u64::from(tokens / page),
                    states,
                }))
            })
        };
        if self.stateless_hits() {
            let mut tokens = round_down(
                (avail / self.kv_bpt.max(1)).min(u64::from(aligned - m)) as u32,
                page,
            );
            while tokens > 0 && !units_fit(tokens, 0) {
                tokens -= page;
            }
            return (m + tokens, 0);
        }
        let (mut cut, mut fit) = (m, 0);
        for (i, s) in new_states.iter().enumerate() {
            let kv = u64::from(s.position.saturating_sub(m)).saturating_mul(self.kv_bpt);
            if kv.saturating_add((i as u64 + 1).saturating_mul(self.state_b)) > avail
                || !units_fit(s.position.saturating_sub(m), i as u64 + 1)
            {
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

    /// The states an engine following the plan saves for a sequence of
    /// `full_len` tokens, whose lookup planned `plan` and hit `hit`.
    pub(crate) fn states_for(&self, plan: &[u32], hit: u32, full_len: usize) -> Vec<SavedState> {
        // Longer than a sequence may be (the admission will refuse it): no
        // position beyond u32, and no wrap to the length's low bits.
        let len = u32::try_from(full_len).unwrap_or(u32::MAX);
        let aligned = round_down(len, self.cfg.page_size);
        if self.stateless_hits() {
            return Vec::new();
        }
        self.admission
            .states_to_save(plan, hit, len, aligned)
            .into_iter()
            .map(|position| SavedState {
                position,
                slot: None,
            })
            .collect()
    }
}

/// Whether `check_admit` returns `e` only after its prefix check passed (the
/// refusals a mismatched pinned prefix must take precedence over).
fn refused_after_the_prefix_check(e: &CacheError) -> bool {
    matches!(
        e,
        CacheError::BadPageList { .. }
            | CacheError::DuplicatePage(_)
            | CacheError::PositionOutOfRange { .. }
            | CacheError::NotPlanned { .. }
            | CacheError::DuplicatePosition(_)
            | CacheError::DuplicateSlot(_)
    )
}

/// The first page of `pages` (in list order) that appears earlier in it too,
/// if any. Engines hand their pages in ascending order most of the time,
/// which one pass confirms. Otherwise, when the pages span a range of at
/// most 1,024 ids per page (a pool's page ids: a request's pages from a
/// free list), one pass over a bitset of that range (128 bytes a page at
/// most) names the first repeat: sorting 10,000 pages costs about 80 µs,
/// clearing a bitset of 2^21 ids about a tenth of it. Over a wider range a
/// sorted copy says whether any repeats (no hashing of every page: an
/// admission of 10,000 pages spent most of its time in a `HashSet` here),
/// and only then a set names the first repeat.
fn first_repeated_page(pages: &[u32]) -> Option<u32> {
    if strictly_ascending(pages) {
        return None;
    }
    let (lo, hi) = pages
        .iter()
        .fold((u32::MAX, 0), |(lo, hi), &p| (lo.min(p), hi.max(p)));
    let span = u64::from(hi - lo) + 1;
    let words = usize::try_from(span.div_ceil(64)).ok();
    if let Some(words) = words.filter(|_| span / 1024 <= pages.len() as u64) {
        let mut seen = vec![0u64; words];
        return pages.iter().copied().find(|&p| {
            let i = (p - lo) as usize;
            let (word, bit) = (&mut seen[i / 64], 1u64 << (i % 64));
            let repeat = *word & bit != 0;
            *word |= bit;
            repeat
        });
    }
    let mut sorted = pages.to_vec();
    sorted.sort_unstable();
    if sorted.windows(2).all(|w| w[0] != w[1]) {
        return None;
    }
    let mut seen = HashSet::with_capacity(pages.len());
    pages.iter().copied().find(|&p| !seen.insert(p))
}

/// Whether every page is above the one before it: blocks of pairs compared
/// without a branch each (the compiler makes them vector compares), as an
/// admission checks every page of a request (thousands, one per token at
/// page size 1).
fn strictly_ascending(pages: &[u32]) -> bool {
    const BLOCK: usize = 64;
    let (Some(head), Some(tail)) = (pages.get(..pages.len().saturating_sub(1)), pages.get(1..))
    else {
        return true;
    };
    head.chunks(BLOCK)
        .zip(tail.chunks(BLOCK))
        .all(|(a, b)| a.iter().zip(b).fold(true, |ok, (x, y)| ok & (x < y)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// The same answer as one pass with a set, ascending or not.
        #[test]
        fn first_repeated_page_is_the_first_repeat_in_list_order(
            pages in proptest::collection::vec(0u32..40, 0..60),
            ascending in any::<bool>(),
            wide in any::<bool>(),
        ) {
            // Wide: ids spread over a range too large for the bitset.
            let spread = if wide { 1 << 24 } else { 1 };
            let mut pages: Vec<u32> = pages.iter().map(|&p| p * spread).collect();
            if ascending {
                pages.sort_unstable();
            }
            let mut seen = HashSet::new();
            let expected = pages.iter().copied().find(|&p| !seen.insert(p));
            prop_assert_eq!(first_repeated_page(&pages), expected);
        }

        /// The same answer as comparing each pair in turn.
        #[test]
        fn strictly_ascending_is_every_pair_ascending(
            pages in proptest::collection::vec(0u32..400, 0..300),
            sort in any::<bool>(),
            at in proptest::option::of(any::<prop::sample::Index>()),
            repeat in any::<bool>(),
        ) {
            let mut pages = pages;
            if sort {
                // Ascending, or but for one pair (in a block or across two):
                // swapped or repeated.
                pages.sort_unstable();
                pages.dedup();
                if let (Some(at), true) = (at, pages.len() >= 2) {
                    let i = at.index(pages.len() - 1);
                    if repeat {
                        pages[i + 1] = pages[i];
                    } else {
                        pages.swap(i, i + 1);
                    }
                }
            }
            let expected = pages.windows(2).all(|w| w[0] < w[1]);
            prop_assert_eq!(strictly_ascending(&pages), expected);
        }
    }
}
