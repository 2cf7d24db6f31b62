//! Lookup: what an input can reuse, the lease that pins it, and the
//! checkpoints the admission policy plans for its prefill.

use std::collections::BTreeSet;

use serde::Serialize;

use crate::admission::PlanInput;
use crate::cache::{fingerprint, round_down, Core, LeaseId, LeaseInfo};
use crate::error::CacheError;
use crate::log::{Decision, PlanReason};
use crate::tree::{NodeId, Walk, NIL};

/// What a lookup found.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Lookup {
    /// The lease pinning what this request reuses; release it when done.
    pub lease: LeaseId,
    /// Leading tokens the engine may skip: the deepest matched position that
    /// has a recurrent state (any page-aligned matched position for
    /// attention-only models), and less than the input length, so the last
    /// input token is recomputed to produce the first output's logits
    /// (at most the input length with [`LookupOptions::whole_input`]).
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

/// What a lookup would find ([`crate::PrefixCache::peek`]), without the
/// lookup's effects: no lease, no refresh, no counters.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Peek {
    /// Leading tokens a lookup would let the engine skip (as
    /// [`Lookup::hit_tokens`]).
    pub hit_tokens: u32,
    /// Leading tokens whose KV is cached, page-aligned (as
    /// [`Lookup::kv_matched_tokens`]).
    pub kv_matched_tokens: u32,
    /// The positions the admission policy would plan (as [`Lookup::plan`]
    /// without hints), when asked for; empty otherwise.
    pub plan: Vec<u32>,
}

/// How a lookup reads its input ([`crate::PrefixCache::lookup_with`]); the
/// default is [`crate::PrefixCache::lookup`]'s behaviour.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LookupOptions {
    /// The hit may cover the whole input. By default the last input token
    /// is always left to compute (its logits start decoding); a caller that
    /// passes exactly the prefix it wants matched (SGLang's tree cache)
    /// sets this. With a hit of the whole input nothing is planned.
    pub whole_input: bool,
    /// Leave [`Lookup::kv_pages`] empty: the caller asks for the hit's page
    /// ids later, if at all ([`crate::PrefixCache::lease_kv_pages`]).
    pub skip_kv_pages: bool,
}

/// The usable part of a match.
struct UsableHit {
    /// Tokens that can be skipped.
    hit: u32,
    /// The node that carries the hit (NIL for none).
    node: NodeId,
    /// Depths of the states on the matched path.
    state_depths: BTreeSet<u32>,
}

impl Core {
    pub(crate) fn check_tokens(tokens: &[u32]) -> Result<(), CacheError> {
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

    pub(crate) fn lookup_with(
        &mut self,
        ns: u64,
        input: &[u32],
        opts: LookupOptions,
    ) -> Result<Lookup, CacheError> {
        self.lookup_walk_opts(ns, input, true, &[], opts)
            .map(|(l, _)| l)
    }

    /// [`lookup`](Self::lookup), also returning its walk of the input so that
    /// an admission right after it (nothing changed in between) can resume it.
    pub(crate) fn lookup_walk(
        &mut self,
        ns: u64,
        input: &[u32],
        with_fingerprint: bool,
    ) -> Result<(Lookup, Option<Walk>), CacheError> {
        self.lookup_walk_hinted(ns, input, with_fingerprint, &[])
    }

    /// [`lookup_walk_opts`](Self::lookup_walk_opts) with the default options.
    pub(crate) fn lookup_walk_hinted(
        &mut self,
        ns: u64,
        input: &[u32],
        with_fingerprint: bool,
        hints: &[u32],
    ) -> Result<(Lookup, Option<Walk>), CacheError> {
        self.lookup_walk_opts(ns, input, with_fingerprint, hints, LookupOptions::default())
    }

    /// [`lookup_walk`](Self::lookup_walk) with application checkpoint
    /// hints added to the plan (see [`crate::admission::app_checkpoints`])
    /// and the given options.
    pub(crate) fn lookup_walk_opts(
        &mut self,
        ns: u64,
        input: &[u32],
        with_fingerprint: bool,
        hints: &[u32],
        opts: LookupOptions,
    ) -> Result<(Lookup, Option<Walk>), CacheError> {
        Self::check_tokens(input)?;
        self.clock += 1;
        let len = input.len() as u32;
        let page = self.cfg.page_size;
        let walk = self.tree.root(ns).map(|r| self.tree.walk(r, input, page));
        let matched = walk.as_ref().map_or(0, |w| w.matched);
        let kv_matched = round_down(matched, page);
        // The last input token is recomputed (its logits start decoding),
        // unless the caller asks for a hit of the whole input.
        let limit = if opts.whole_input { len } else { len - 1 };
        let usable = self.usable_hit(walk.as_ref(), matched, limit);
        let hit = usable.hit;
        let plan_input = PlanInput {
            tree: &self.tree,
            walk: walk.as_ref(),
            len,
            hit,
            state_depths: &usable.state_depths,
            page_size: page,
            inner_grid: self.inner_grid(),
        };
        // A policy plans only below the input's end (hit < len): with the
        // whole input a hit, there is nothing left to plan.
        let plan = if hit < len {
            self.admission.plan(&plan_input)
        } else {
            None
        };
        let (mut plan, reason) = match plan {
            Some((p, r)) => (p, Some(r)),
            None => (Vec::new(), None),
        };
        let hinted = if hints.is_empty() || self.stateless_hits() {
            Vec::new()
        } else {
            crate::admission::app_checkpoints(&plan_input, &plan, hints)
        };
        if !hinted.is_empty() {
            plan.extend_from_slice(&hinted);
            plan.sort_unstable();
        }
        let (state_slot, kv_pages, before_hit) =
            self.take_hit(usable.node, hit, !opts.skip_kv_pages);
        // The hit's tokens are the pinned path's: an admission checks them
        // against the tree; only the rest is hashed, here and at admission.
        let pinned_tokens = if usable.node == NIL { 0 } else { hit };
        let fp = if with_fingerprint {
            // Only an engine's own admit checks it (the simulator's
            // whole-request path skips the hash).
            fingerprint(&input[pinned_tokens as usize..])
        } else {
            0
        };
        let lease = self.open_lease(
            ns,
            (usable.node, before_hit),
            (len, pinned_tokens),
            fp,
            plan.clone(),
        );
        let lookup = Lookup {
            lease,
            hit_tokens: hit,
            kv_matched_tokens: kv_matched,
            state_slot,
            kv_pages,
            plan,
        };
        self.record_lookup(ns, (len, limit), &lookup, reason, &hinted);
        Ok((lookup, walk))
    }

    /// What [`lookup`](Self::lookup) would find for `input` (its hit, KV
    /// match and, with `with_plan`, its plan without hints), changing
    /// nothing: no clock tick, lease, refresh, counter or log entry.
    pub(crate) fn peek(&self, ns: u64, input: &[u32], with_plan: bool) -> Result<Peek, CacheError> {
        self.peek_node(ns, input, with_plan).map(|(p, _)| p)
    }

    /// [`peek`](Self::peek), with the node that carries the hit (NIL for
    /// none), for [`lease_peeked`](Self::lease_peeked).
    pub(crate) fn peek_node(
        &self,
        ns: u64,
        input: &[u32],
        with_plan: bool,
    ) -> Result<(Peek, NodeId), CacheError> {
        Self::check_tokens(input)?;
        let Some(root) = self.tree.root(ns) else {
            return Ok((Peek::default(), NIL));
        };
        let len = input.len() as u32;
        let page = self.cfg.page_size;
        let walk = self.tree.walk(root, input, page);
        let limit = len - 1;
        // As `usable_hit`, without collecting the path's state depths: the
        // plan is filtered against them afterwards (every policy's plan
        // leaves out positions already holding a state).
        let state_at = |id: NodeId| self.tree.node(id).state.is_some();
        let (hit, node) = if self.stateless_hits() {
            let usable = self.usable_hit(Some(&walk), walk.matched, limit);
            (usable.hit, usable.node)
        } else {
            walk.path
                .iter()
                .rev()
                .copied()
                .find(|&id| state_at(id) && self.tree.node(id).depth <= limit)
                .map_or((0, NIL), |id| (self.tree.node(id).depth, id))
        };
        let mut plan = Vec::new();
        if with_plan {
            let none = BTreeSet::new();
            let plan_input = PlanInput {
                tree: &self.tree,
                walk: Some(&walk),
                len,
                hit,
                state_depths: &none,
                page_size: page,
                inner_grid: self.inner_grid(),
            };
            if let Some((p, _)) = self.admission.plan(&plan_input) {
                plan = p;
                if !self.stateless_hits() {
                    plan.retain(|&d| {
                        !walk
                            .path
                            .iter()
                            .any(|&id| state_at(id) && self.tree.node(id).depth == d)
                    });
                }
            }
        }
        Ok((
            Peek {
                hit_tokens: hit,
                kv_matched_tokens: round_down(walk.matched, page),
                plan,
            },
            node,
        ))
    }

    /// The lookup a peek of an input of `len` tokens found (its hit on
    /// `node`, its KV match), on the tree as the peek saw it: the lease
    /// pinning the hit, counted and logged as a lookup, without walking
    /// the input again (a lease that only pins: no plan, no fingerprint).
    pub(crate) fn lease_peeked(&mut self, ns: u64, len: u32, peek: &Peek, node: NodeId) -> Lookup {
        self.clock += 1;
        let hit = peek.hit_tokens;
        let (state_slot, kv_pages, before_hit) = self.take_hit(node, hit, true);
        let pinned_tokens = if node == NIL { 0 } else { hit };
        let lease = self.open_lease(ns, (node, before_hit), (len, pinned_tokens), 0, Vec::new());
        let lookup = Lookup {
            lease,
            hit_tokens: hit,
            kv_matched_tokens: peek.kv_matched_tokens,
            state_slot,
            kv_pages,
            plan: Vec::new(),
        };
        // A peek leaves the last token to compute, as a default lookup.
        self.record_lookup(ns, (len, len.saturating_sub(1)), &lookup, None, &[]);
        lookup
    }

    /// The deepest usable position of the match (below `limit`) and the
    /// node that carries it: the deepest state on the path, or any matched
    /// page where hits need no states.
    fn usable_hit(&self, walk: Option<&Walk>, matched: u32, limit: u32) -> UsableHit {
        let mut usable = UsableHit {
            hit: 0,
            node: NIL,
            state_depths: BTreeSet::new(),
        };
        let Some(w) = walk else {
            return usable;
        };
        if self.stateless_hits() {
            let h = round_down(matched.min(limit), self.cfg.page_size);
            if h > 0 {
                usable.hit = h;
                // The node whose edge contains position h.
                usable.node = w
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
                    usable.state_depths.insert(n.depth);
                    if n.depth <= limit {
                        usable.hit = n.depth;
                        usable.node = id;
                    }
                }
            }
        }
        usable
    }

    /// Refreshes and pins the node that carries a hit of `hit` tokens;
    /// returns the state slot to resume from, the hit's page ids and the
    /// node's last access before the refresh (0 without a hit).
    fn take_hit(
        &mut self,
        hit_node: NodeId,
        hit: u32,
        with_pages: bool,
    ) -> (Option<u32>, Vec<u32>, u64) {
        let mut state_slot = None;
        let mut kv_pages = Vec::new();
        let mut before_hit = 0;
        if hit_node != NIL {
            before_hit = self.tree.node(hit_node).last_access;
            // Pinned first: the refreshed nodes are then out of the index
            // (leased), so their new access time costs no re-insertion
            // that the pin would undo at once. Same end state either way.
            self.pin(hit_node);
            self.touch_hit(hit_node);
            if !self.stateless_hits() {
                state_slot = self.tree.node(hit_node).state.and_then(|s| s.slot);
            }
            if with_pages && self.tracks_pages == Some(true) {
                kv_pages = self.pages_up_to(hit_node, hit);
            }
        }
        (state_slot, kv_pages, before_hit)
    }

    /// Issues a lease pinning `pinned` (and its ancestors), whose path
    /// spells the first `pinned_tokens` of an input of `input_len` tokens.
    fn open_lease(
        &mut self,
        ns: u64,
        (pinned, pinned_before_hit): (NodeId, u64),
        (input_len, pinned_tokens): (u32, u32),
        input_fingerprint: u64,
        plan: Vec<u32>,
    ) -> LeaseId {
        let lease = self.next_lease;
        self.next_lease += 1;
        self.leases.insert(
            lease,
            LeaseInfo {
                ns,
                pinned,
                pinned_before_hit,
                input_len,
                pinned_tokens,
                input_fingerprint,
                plan,
                admitted: None,
                hints: Vec::new(),
            },
        );
        lease
    }

    /// Counts the lookup of `len` tokens (hits up to `limit`) in namespace
    /// `ns` and logs it with
    /// its plan: the policy's positions with their reason, then the
    /// application checkpoints `hinted` (part of `l.plan` too).
    fn record_lookup(
        &mut self,
        ns: u64,
        (len, limit): (u32, u32),
        l: &Lookup,
        reason: Option<PlanReason>,
        hinted: &[u32],
    ) {
        let (lease, kv_matched, hit) = (l.lease, l.kv_matched_tokens, l.hit_tokens);
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
            self.log.push(|| Decision::Plan {
                lease,
                positions: if hinted.is_empty() {
                    l.plan.clone()
                } else {
                    l.plan
                        .iter()
                        .copied()
                        .filter(|p| !hinted.contains(p))
                        .collect()
                },
                reason,
            });
        }
        if !hinted.is_empty() {
            self.log.push(|| Decision::Plan {
                lease,
                positions: hinted.to_vec(),
                reason: PlanReason::AppCheckpoint,
            });
        }
    }

    /// The page ids of the hit of `lease` (as its lookup's
    /// [`Lookup::kv_pages`] would hold them): empty without a hit or where
    /// the cache tracks no pages. The pinned path cannot change meanwhile.
    pub(crate) fn lease_kv_pages(&self, lease: LeaseId) -> Result<Vec<u32>, CacheError> {
        let info = self
            .leases
            .get(&lease)
            .ok_or(CacheError::UnknownLease(lease))?;
        if info.pinned == NIL || self.tracks_pages != Some(true) {
            return Ok(Vec::new());
        }
        Ok(self.pages_up_to(info.pinned, info.pinned_tokens))
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
}

#[cfg(test)]
mod tests {
    use crate::{AlphaMode, CacheConfig, CacheError, ModelSpec, PrefixCache};

    /// The admission checks the hit's tokens against the pinned path and
    /// hashes only the rest: a change anywhere in the input is refused,
    /// also after another request split the pinned path, and the input
    /// itself is admitted.
    #[test]
    fn an_admission_must_repeat_the_input_hit_included() {
        let mut c = PrefixCache::new(CacheConfig {
            alpha: AlphaMode::Fixed(0.0),
            ..CacheConfig::marconi(ModelSpec::preset("paper-7b").unwrap(), 1_000_000_000)
        })
        .unwrap();
        let base: Vec<u32> = (0..100).collect();
        c.serve(0, &base, &[]).unwrap();
        let mut input = base.clone();
        input.extend(1000..1050);
        let l = c.lookup(0, &input).unwrap();
        assert_eq!(l.hit_tokens, 100);
        // Another request branches off the pinned path at 40.
        let other: Vec<u32> = (0..40).chain(5000..5060).collect();
        c.serve(0, &other, &[]).unwrap();
        let refused = CacheError::PrefixMismatch { input_len: 150 };
        for at in [0, 39, 40, 99, 100, 149] {
            let mut bad = input.clone();
            bad[at] += 1_000_000;
            assert_eq!(
                c.admit(l.lease, &bad, &[], &[]),
                Err(refused.clone()),
                "{at}"
            );
        }
        // The other branch's tokens where the input had the pinned ones.
        let mut bad = input.clone();
        bad[40..100].copy_from_slice(&other[40..100]);
        assert_eq!(c.admit(l.lease, &bad, &[], &[]), Err(refused));
        let mut full = input.clone();
        full.extend(7000..7010);
        let out = c.admit(l.lease, &full, &[], &[]).unwrap();
        assert_eq!(out.new_kv_tokens, 60);
        c.check_invariants();
        c.release(l.lease).unwrap();
    }
}
