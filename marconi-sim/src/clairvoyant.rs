//! The clairvoyant reference at equal capacity: a simulator-only policy
//! that knows every future request, so the headroom of the
//! deployable policies at a given byte budget shows. Not deployable, and
//! not a proven optimum (see "What it assumes").
//!
//! # How it works
//!
//! Two passes over the trace.
//!
//! 1. **Hindsight.** Every request's full sequence (input + output) goes
//!    into an unbounded radix trie, in order. Before request `k` is
//!    inserted, its input (less its last token, which is always recomputed)
//!    is walked: the deepest matched position `p_k` is the longest prefix
//!    that any earlier sequence covers, the most any policy can reuse for
//!    `k` (the unbounded `oracle`'s hit). The walk splits the trie there, so
//!    `p_k` ends a node, and `k` is recorded as a *use* of every node on the
//!    path to `p_k` (their KV is needed) and as a *state use* of the node
//!    ending at `p_k` (a state there is what `k` resumes from).
//! 2. **Targets.** Each request aims at a state at `p_k`; or, for a
//!    budget fraction `f` of [`TARGET_BUDGETS`], at the deepest position
//!    whose chain (KV to there plus one state) fits in `f ×` the capacity:
//!    either exactly there (a checkpoint inside an edge) or at the node
//!    boundary above (often the end of a shared prefix). A request `k` is
//!    a use of the KV of every node on the path to its target and of the
//!    state at the target. Each choice also runs two *fallback* variants
//!    (`Fallback`): a request also uses the state at the deepest branch
//!    point above its target (where sequences of the trace diverge, such
//!    as a shared prompt's end: the state LRU keeps when no session's own
//!    chain fits), and, in the second, also the state at the deepest
//!    earlier request's target above it (a session's previous resume
//!    point: the state a policy falls back to when the newest chain does
//!    not fit).
//! 3. **Bounded replay.** Requests in order under the byte budget, charged
//!    as the core charges them (KV bytes per token on edges, one state's
//!    bytes per checkpoint). A request hits the deepest cached state on its
//!    path under a fully cached KV chain. Then every item it computed (the
//!    KV of the nodes of its sequence past its hit, and the states at the
//!    targets of future requests on it: checkpoints placed with hindsight)
//!    is offered, an item with no future use is never kept, and while the
//!    cache is over budget an item goes: the one whose next use is
//!    furthest (Belady; ties to the deeper node, and a state before its
//!    node's KV, so a chain is cut from its end: a node's uses include its
//!    descendants'), or, in the size-aware rule, the state or chain end of
//!    largest `bytes × time to next use`. Optionally KV that no state below
//!    it can use any more is dropped at once.
//!
//! Every combination (target choice × fallback × eviction rule × dropping) is a
//! schedule that fits the same capacity; the reported one is the best by
//! tokens hit, itself a schedule chosen with hindsight.
//!
//! # What it assumes
//!
//! - The whole trace is known in advance (the bound's reason to exist).
//! - The engine can save a state at any position it computes (prefill or
//!   decode), as many per request as it likes: no checkpoint grid, page
//!   size 1, the states of one request cost nothing beyond their bytes.
//! - Sequential serving (one request at a time, as `replay` without
//!   `--concurrent`): no leases pin anything.
//!
//! # Why it bounds the deployable policies, and where it may not
//!
//! No policy can reuse more than `p_k` tokens for request `k` (nothing
//! cached covers more), and the clairvoyant places states only where they
//! will be resumed from, so none of its bytes are spent on states or KV
//! that are never used again; a deployable policy spends budget on both.
//! With an unbounded budget it hits exactly `p_k` on every request (the
//! oracle's hit rate, tested). Under a budget, though, Belady's rule is
//! optimal only for items of equal size and independent use: here items
//! differ in size (a state is worth many tokens of KV) and a state is
//! worthless without its KV chain, and the offline optimum of that problem
//! is NP-hard. So this is a **clairvoyant heuristic**, not a proven upper
//! bound: the battery checks on every row that it is at least every
//! deployable policy, and reports a row where it is not.

use std::collections::BTreeSet;
use std::time::Instant;

use marconi_core::{ModelSpec, TOKEN_ID_BYTES};

use crate::replay::{percentile, Outcome, Replay, ReplayConfig, Report};
use crate::trace::Trace;

/// A node of the hindsight trie.
#[derive(Clone, Debug, Default)]
struct TNode {
    parent: u32,
    /// Position at the end of the edge.
    depth: u32,
    /// Edge tokens.
    tokens: Vec<u32>,
    /// Children by first token, sorted (page size 1: one per token).
    children: Vec<(u32, u32)>,
}

const ROOT: u32 = 0;
const NONE: u32 = u32::MAX;

/// The unbounded trie of every sequence of the trace, with uses.
#[derive(Clone, Debug, Default)]
struct Hindsight {
    nodes: Vec<TNode>,
    /// Per request: the node ending at its reusable prefix `p_k` (ROOT when 0).
    hit_end: Vec<u32>,
    /// Per request: the node ending at the end of its full sequence.
    full_end: Vec<u32>,
}

impl Hindsight {
    fn build(trace: &Trace) -> Self {
        let mut h = Hindsight {
            nodes: vec![TNode {
                parent: NONE,
                ..TNode::default()
            }],
            hit_end: Vec::with_capacity(trace.len()),
            full_end: Vec::with_capacity(trace.len()),
        };
        trace.for_each(|r| {
            let reusable = r.input_len.saturating_sub(1);
            let end = h.walk_split(&r.full[..reusable]);
            h.hit_end.push(end);
            let full_end = h.insert(r.full);
            h.full_end.push(full_end);
        });
        h
    }

    fn child(&self, cur: u32, token: u32) -> Option<u32> {
        let c = &self.nodes[cur as usize].children;
        c.binary_search_by_key(&token, |&(t, _)| t)
            .ok()
            .map(|i| c[i].1)
    }

    /// Splits `id`'s edge after `at` tokens (0 < at < edge length); the new
    /// head node is returned. Everyone who used `id` used the head too.
    fn split(&mut self, id: u32, at: usize) -> u32 {
        let new = self.nodes.len() as u32;
        let n = &mut self.nodes[id as usize];
        let tail = n.tokens.split_off(at);
        let head = std::mem::replace(&mut n.tokens, tail);
        let parent = n.parent;
        let depth = n.depth - n.tokens.len() as u32;
        let second = n.tokens[0];
        n.parent = new;
        self.nodes.push(TNode {
            parent,
            depth,
            tokens: head,
            children: vec![(second, id)],
        });
        let p = &mut self.nodes[parent as usize];
        let slot = p
            .children
            .iter_mut()
            .find(|(_, c)| *c == id)
            .expect("child link");
        slot.1 = new;
        new
    }

    /// Walks `seq` from the root as far as the trie covers it, splitting the
    /// edge where the walk stops inside one; returns the node ending there.
    fn walk_split(&mut self, seq: &[u32]) -> u32 {
        let (mut cur, mut pos) = (ROOT, 0usize);
        while pos < seq.len() {
            let Some(c) = self.child(cur, seq[pos]) else {
                break;
            };
            let edge = &self.nodes[c as usize].tokens;
            let (n, edge_len) = (common_prefix(edge, &seq[pos..]), edge.len());
            if n < edge_len {
                return self.split(c, n);
            }
            pos += n;
            cur = c;
        }
        cur
    }

    /// Inserts `seq`; returns the node ending at its end.
    fn insert(&mut self, seq: &[u32]) -> u32 {
        let (mut cur, mut pos) = (ROOT, 0usize);
        while pos < seq.len() {
            match self.child(cur, seq[pos]) {
                None => {
                    let id = self.nodes.len() as u32;
                    let depth = self.nodes[cur as usize].depth + (seq.len() - pos) as u32;
                    self.nodes.push(TNode {
                        parent: cur,
                        depth,
                        tokens: seq[pos..].to_vec(),
                        ..TNode::default()
                    });
                    let ch = &mut self.nodes[cur as usize].children;
                    let i = ch.partition_point(|&(t, _)| t < seq[pos]);
                    ch.insert(i, (seq[pos], id));
                    return id;
                }
                Some(c) => {
                    let edge = &self.nodes[c as usize].tokens;
                    let (n, edge_len) = (common_prefix(edge, &seq[pos..]), edge.len());
                    if n < edge_len {
                        let head = self.split(c, n);
                        pos += n;
                        cur = head;
                    } else {
                        pos += n;
                        cur = c;
                    }
                }
            }
        }
        cur
    }

    /// Nodes from the root's child down to `end` (empty for the root).
    fn path(&self, end: u32, out: &mut Vec<u32>) {
        out.clear();
        let mut cur = end;
        while cur != ROOT {
            out.push(cur);
            cur = self.nodes[cur as usize].parent;
        }
        out.reverse();
    }
}

/// Length of the common prefix of two slices (whole chunks compared as
/// slices first: matches run to tens of thousands of tokens).
fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    const CHUNK: usize = 32;
    let n = a.len().min(b.len());
    let mut i = 0;
    while i + CHUNK <= n && a[i..i + CHUNK] == b[i..i + CHUNK] {
        i += CHUNK;
    }
    i + a[i..n]
        .iter()
        .zip(&b[i..n])
        .take_while(|(x, y)| x == y)
        .count()
}

/// The first entry of `list` after `now`, advancing `cursor` past the
/// others; `NONE` when there is none.
fn next_after(list: &[u32], cursor: &mut u32, now: u32) -> u32 {
    while (*cursor as usize) < list.len() && list[*cursor as usize] <= now {
        *cursor += 1;
    }
    list.get(*cursor as usize).copied().unwrap_or(NONE)
}

/// Item kinds, ordered so that a node's state goes before its KV.
const KV: u8 = 0;
const STATE: u8 = 1;

/// Cache state of one trie node in the bounded replay.
#[derive(Clone, Copy, Debug, Default)]
struct Cached {
    /// Eviction keys of the node's KV and state when cached.
    kv: Option<u32>,
    state: Option<u32>,
    kv_cursor: u32,
    state_cursor: u32,
}

/// Which requests use each node, for one choice of targets: the KV of
/// every node on the path to a request's target ([`kv_uses`], the same for
/// every fallback), the state at the target and the fallback's.
struct Uses<'a> {
    kv: &'a [Vec<u32>],
    state: Vec<Vec<u32>>,
}

/// Targets: for each request, its reusable prefix cut to the deepest
/// position whose chain (KV to there plus one state) takes at most
/// `budget` bytes. A cut inside an edge splits the trie there (the engine
/// can checkpoint at any position it computes) when `inside`, or falls
/// back to the node boundary above it (often the end of a shared prefix)
/// when not. ROOT for a request with nothing to reuse.
fn targets(h: &mut Hindsight, kv_bpt: u64, state_b: u64, budget: u64, inside: bool) -> Vec<u32> {
    let max_depth = if budget == u64::MAX {
        u32::MAX
    } else {
        u32::try_from(budget.saturating_sub(state_b) / kv_bpt.max(1)).unwrap_or(u32::MAX)
    };
    let mut path = Vec::new();
    let mut targets = Vec::with_capacity(h.hit_end.len());
    for k in 0..h.hit_end.len() {
        h.path(h.hit_end[k], &mut path);
        let n = path
            .iter()
            .take_while(|&&id| h.nodes[id as usize].depth <= max_depth)
            .count();
        let target = match path.get(n) {
            // The cut falls inside the next node's edge.
            Some(&id)
                if inside && max_depth > h.nodes[h.nodes[id as usize].parent as usize].depth =>
            {
                let start = h.nodes[h.nodes[id as usize].parent as usize].depth;
                h.split(id, (max_depth - start) as usize)
            }
            _ if n > 0 => path[n - 1],
            _ => ROOT,
        };
        targets.push(target);
    }
    targets
}

/// A second state a request also uses besides its target's (so that a
/// replay short of room for the request's own chain can still keep a
/// shallower state to resume from), or none.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fallback {
    /// Only the target's state.
    None,
    /// The state at the deepest branch point above the target (a node where
    /// sequences of the trace diverge: the end of a shared prefix). Without
    /// it, a budget that cuts each request's target inside its own session
    /// never targets the shared prefix's end, and plain LRU, which keeps
    /// that state, hits more (agentic at 5 % of the working set: every
    /// request 210 tokens short of the 5,000-token prefix).
    Branch,
    /// Both the branch point's state and the state at the deepest earlier
    /// request's target above the target (in a session, the previous
    /// turn's resume point). Without the latter, a state is kept only for
    /// the requests that target it, and a policy that keeps the previous
    /// turn's state hits more when the newest one does not fit
    /// (`marconi-hinted` on agentic at 15 %, `--quick` seed 10: 6,030
    /// tokens against the shared prefix's 5,000). A variant of its own, as
    /// a second state kept per request is room taken from the chains.
    BranchAndEarlier,
}

const FALLBACKS: [Fallback; 3] = [Fallback::None, Fallback::Branch, Fallback::BranchAndEarlier];

/// The KV uses of one choice of `targets` (one per request, from
/// [`targets`]): a request uses the KV of every node on the path to its
/// target.
fn kv_uses(h: &Hindsight, targets: &[u32]) -> Vec<Vec<u32>> {
    let mut kv = vec![Vec::new(); h.nodes.len()];
    for (k, &t) in targets.iter().enumerate() {
        let mut cur = t;
        while cur != ROOT {
            kv[cur as usize].push(k as u32);
            cur = h.nodes[cur as usize].parent;
        }
    }
    kv
}

impl<'a> Uses<'a> {
    /// The uses of one choice of `targets` with its KV uses `kv` (from
    /// [`kv_uses`]): a request also uses the state at its target, and the
    /// state the `fallback` names.
    fn of(h: &Hindsight, kv: &'a [Vec<u32>], targets: &[u32], fallback: Fallback) -> Self {
        let mut state = vec![Vec::new(); h.nodes.len()];
        let mut targeted = vec![false; h.nodes.len()];
        let want_earlier = fallback == Fallback::BranchAndEarlier;
        for (k, &t) in targets.iter().enumerate() {
            if t == ROOT {
                continue;
            }
            let k = k as u32;
            state[t as usize].push(k);
            if fallback == Fallback::None {
                continue;
            }
            let (mut branch, mut earlier) = (None, None);
            let mut cur = h.nodes[t as usize].parent;
            while cur != ROOT && (branch.is_none() || (want_earlier && earlier.is_none())) {
                if branch.is_none() && h.nodes[cur as usize].children.len() > 1 {
                    branch = Some(cur);
                }
                if want_earlier && earlier.is_none() && targeted[cur as usize] {
                    earlier = Some(cur);
                }
                cur = h.nodes[cur as usize].parent;
            }
            for b in [branch, earlier.filter(|&e| Some(e) != branch)]
                .into_iter()
                .flatten()
            {
                state[b as usize].push(k);
            }
            targeted[t as usize] = true;
        }
        Uses { kv, state }
    }
}

/// How the bounded replay picks what to evict.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Rule {
    /// Furthest next use first (Belady).
    Belady,
    /// Largest `bytes × time to next use` first, among states and the ends
    /// of KV chains (size-aware Belady: a large item needed late frees
    /// the most for the longest).
    SizeAware,
}

/// The bounded replay.
struct Bounded<'a> {
    h: &'a Hindsight,
    u: &'a Uses<'a>,
    rule: Rule,
    stateless: bool,
    /// Whether unusable KV is dropped at once (`prune_up`).
    prune: bool,
    cached: Vec<Cached>,
    /// (next use, depth, kind, node): the last is evicted first.
    order: BTreeSet<(u32, u32, u8, u32)>,
    used: u64,
    capacity: u64,
    kv_bpt: u64,
    state_b: u64,
    evictions: u64,
    states_admitted: u64,
}

impl Bounded<'_> {
    fn item_bytes(&self, node: u32, kind: u8) -> u64 {
        if kind == STATE {
            self.state_b
        } else {
            (self.h.nodes[node as usize].tokens.len() as u64).saturating_mul(self.kv_bpt)
        }
    }

    fn key_of(&self, node: u32, kind: u8) -> Option<u32> {
        let c = &self.cached[node as usize];
        if kind == KV {
            c.kv
        } else {
            c.state
        }
    }

    fn set_key(&mut self, node: u32, kind: u8, key: Option<u32>) {
        let c = &mut self.cached[node as usize];
        if kind == KV {
            c.kv = key;
        } else {
            c.state = key;
        }
    }

    /// The next use of `node`'s item after `now`.
    fn next_use(&mut self, node: u32, kind: u8, now: u32) -> u32 {
        let c = &mut self.cached[node as usize];
        if kind == KV {
            next_after(&self.u.kv[node as usize], &mut c.kv_cursor, now)
        } else {
            next_after(&self.u.state[node as usize], &mut c.state_cursor, now)
        }
    }

    /// Re-keys a cached item after `now` (its use at `now` is past).
    fn rekey(&mut self, node: u32, kind: u8, now: u32) {
        let Some(old) = self.key_of(node, kind) else {
            return;
        };
        let depth = self.h.nodes[node as usize].depth;
        let new = self.next_use(node, kind, now);
        if new != old {
            self.order.remove(&(old, depth, kind, node));
            self.order.insert((new, depth, kind, node));
            self.set_key(node, kind, Some(new));
        }
    }

    /// Offers an item computed at `now`; kept only if it has a future use.
    fn offer(&mut self, node: u32, kind: u8, now: u32) {
        if self.key_of(node, kind).is_some() {
            return;
        }
        let next = self.next_use(node, kind, now);
        if next == NONE {
            return;
        }
        let depth = self.h.nodes[node as usize].depth;
        self.order.insert((next, depth, kind, node));
        self.set_key(node, kind, Some(next));
        self.used = self.used.saturating_add(self.item_bytes(node, kind));
        if kind == STATE {
            self.states_admitted += 1;
        }
    }

    /// Evicts until the budget holds, by the replay's rule.
    fn fit(&mut self, now: u32) {
        while self.used > self.capacity {
            let victim = match self.rule {
                Rule::Belady => self.order.last().copied(),
                Rule::SizeAware => self.size_aware_victim(now),
            };
            let Some(item) = victim else {
                break;
            };
            let (_, _, kind, node) = item;
            self.order.remove(&item);
            debug_assert!(
                kind == STATE || self.is_chain_end(node),
                "a KV chain is cut from its end"
            );
            self.set_key(node, kind, None);
            self.used -= self.item_bytes(node, kind);
            self.evictions += 1;
            let up = if kind == STATE {
                node
            } else {
                self.h.nodes[node as usize].parent
            };
            self.prune_up(up);
        }
    }

    /// Drops KV that no request can use any more, from `node` up: a chain
    /// end without a state. A request resumes from a state and recomputes
    /// everything after it, so KV past the deepest cached state of its
    /// chain is never read (a later request that saves a state there
    /// computes that KV itself). Not for models without recurrent layers,
    /// where every cached position is usable.
    fn prune_up(&mut self, mut node: u32) {
        if self.stateless || !self.prune {
            return;
        }
        while node != ROOT {
            let Some(key) = self.cached[node as usize].kv else {
                return;
            };
            if !self.is_chain_end(node) {
                return;
            }
            let depth = self.h.nodes[node as usize].depth;
            self.order.remove(&(key, depth, KV, node));
            self.set_key(node, KV, None);
            self.used -= self.item_bytes(node, KV);
            node = self.h.nodes[node as usize].parent;
        }
    }

    /// Whether `node`'s KV is the end of a cached chain (no state on it, no
    /// cached child).
    fn is_chain_end(&self, node: u32) -> bool {
        self.cached[node as usize].state.is_none()
            && self.h.nodes[node as usize]
                .children
                .iter()
                .all(|&(_, c)| self.cached[c as usize].kv.is_none())
    }

    /// The state or chain end of largest `bytes × (next use − now)`
    /// (never used again: first, largest first); ties to Belady's order.
    fn size_aware_victim(&self, now: u32) -> Option<(u32, u32, u8, u32)> {
        self.order
            .iter()
            .rev()
            .filter(|&&(_, _, kind, node)| kind == STATE || self.is_chain_end(node))
            .max_by(|&&a, &&b| {
                let score = |(next, _, kind, node): (u32, u32, u8, u32)| {
                    let far = if next == NONE {
                        f64::INFINITY
                    } else {
                        f64::from(next - now)
                    };
                    (far, self.item_bytes(node, kind) as f64 * far.min(1e12))
                };
                let (sa, sb) = (score(a), score(b));
                (sa.0.is_infinite(), sa.1)
                    .partial_cmp(&(sb.0.is_infinite(), sb.1))
                    .unwrap_or(std::cmp::Ordering::Equal)
                    .then(a.cmp(&b))
            })
            .copied()
    }
}

/// Budgets of the target choices tried, as fractions of the capacity
/// (`f64::INFINITY`: every request targets its whole reusable prefix).
/// A request whose whole prefix cannot be kept aims at a shallower,
/// shared position instead; which cut-off is best depends on the trace,
/// so each is replayed and the best kept (all are schedules that fit the
/// same capacity, so the best of them is one too).
pub const TARGET_BUDGETS: [f64; 8] = [f64::INFINITY, 1.0, 0.7, 0.5, 0.35, 0.25, 0.15, 0.08];

/// The eviction rules tried with each target choice.
const RULES: [Rule; 2] = [Rule::Belady, Rule::SizeAware];

/// What one bounded replay gives: hits per request, evictions, states
/// admitted, bytes in use at the end.
type Run = (Vec<u32>, u64, u64, u64);

/// One bounded replay.
#[allow(clippy::too_many_arguments)]
fn bounded_replay(
    h: &Hindsight,
    u: &Uses<'_>,
    variant: (Rule, bool),
    capacity: u64,
    kv_bpt: u64,
    state_b: u64,
    stateless: bool,
) -> Run {
    let mut b = Bounded {
        h,
        u,
        rule: variant.0,
        prune: variant.1,
        stateless,
        cached: vec![Cached::default(); h.nodes.len()],
        order: BTreeSet::new(),
        used: 0,
        capacity,
        kv_bpt,
        state_b,
        evictions: 0,
        states_admitted: 0,
    };
    let mut hits = Vec::with_capacity(h.hit_end.len());
    let mut path = Vec::new();
    for k in 0..h.hit_end.len() as u32 {
        // Lookup: the deepest cached state under a cached KV chain (any
        // cached position for a model without recurrent layers).
        h.path(h.hit_end[k as usize], &mut path);
        let mut hit = 0u32;
        for &id in &path {
            let c = b.cached[id as usize];
            if c.kv.is_none() {
                break;
            }
            if c.state.is_some() || stateless {
                hit = h.nodes[id as usize].depth;
            }
        }
        for &id in &path {
            b.rekey(id, KV, k);
            b.rekey(id, STATE, k);
        }
        // Admission with hindsight: what this request computed, kept where
        // a future request will use it.
        h.path(h.full_end[k as usize], &mut path);
        for &id in &path {
            if h.nodes[id as usize].depth > hit {
                b.offer(id, KV, k);
                if !stateless && b.cached[id as usize].kv.is_some() {
                    b.offer(id, STATE, k);
                }
            }
        }
        if let Some(&end) = path.last() {
            b.prune_up(end);
        }
        b.fit(k);
        hits.push(hit);
    }
    (hits, b.evictions, b.states_admitted, b.used)
}

/// Replays `trace` under the clairvoyant policy at `cfg.capacity_bytes`
/// (`cfg.model`, `cfg.ttft`; the other fields do not apply): the best
/// schedule of the family the module doc describes, by tokens hit.
pub fn replay_clairvoyant(trace: &Trace, cfg: &ReplayConfig) -> Replay {
    let start = Instant::now();
    let h = Hindsight::build(trace);
    let model: &ModelSpec = &cfg.model;
    let kv_bpt = match model.kv_bytes_per_token() {
        0 => TOKEN_ID_BYTES,
        kv => kv,
    };
    let stateless = model.ssm_layers == 0;
    let state_b = if stateless { 0 } else { model.state_bytes() };
    let capacity = cfg.capacity_bytes;
    let mut best: Option<(u64, Run)> = None;
    for (f, inside) in TARGET_BUDGETS
        .into_iter()
        .flat_map(|f| [(f, true), (f, false)])
        .filter(|&(f, inside)| f.is_finite() || inside)
    {
        let budget = if f.is_finite() {
            (capacity as f64 * f) as u64
        } else {
            u64::MAX
        };
        // Each choice cuts the trie where it needs, on its own copy.
        let mut h = h.clone();
        let targets = targets(&mut h, kv_bpt, state_b, budget, inside);
        let kv = kv_uses(&h, &targets);
        for fallback in FALLBACKS {
            let u = Uses::of(&h, &kv, &targets, fallback);
            for variant in RULES.into_iter().flat_map(|r| [(r, true), (r, false)]) {
                let run = bounded_replay(&h, &u, variant, capacity, kv_bpt, state_b, stateless);
                let total: u64 = run.0.iter().map(|&x| u64::from(x)).sum();
                if best.as_ref().is_none_or(|(t, _)| total > *t) {
                    best = Some((total, run));
                }
            }
        }
    }
    let (_, (hits, evictions, states_admitted, used)) = best.expect("a target choice ran");
    let mut outcomes = Vec::with_capacity(trace.len());
    let (mut input_tokens, mut hit_tokens, mut hit_requests) = (0u64, 0u64, 0u64);
    let (mut flops_saved, mut flops_total) = (0.0, 0.0);
    let mut k = 0usize;
    trace.for_each(|r| {
        let hit = hits[k];
        let len = r.input_len as u64;
        input_tokens += len;
        hit_tokens += u64::from(hit);
        hit_requests += u64::from(hit > 0);
        flops_saved += model.prefill_flops(0, u64::from(hit));
        flops_total += model.prefill_flops(0, len);
        outcomes.push(Outcome {
            input_len: r.input_len as u32,
            hit_tokens: hit,
            ttft_ms: cfg.ttft.ttft_ms(model, hit as usize, r.input_len),
        });
        k += 1;
    });
    let mut ttfts: Vec<f64> = outcomes.iter().map(|o| o.ttft_ms).collect();
    ttfts.sort_by(f64::total_cmp);
    let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { 0.0 };
    let report = Report {
        policy: cfg.policy.name().into(),
        model: model.name.clone(),
        capacity_bytes: cfg.capacity_bytes,
        concurrent: false,
        requests: outcomes.len() as u64,
        input_tokens,
        hit_tokens,
        token_hit_rate: ratio(hit_tokens as f64, input_tokens as f64),
        request_hit_rate: ratio(hit_requests as f64, outcomes.len() as f64),
        kv_matched_unusable_tokens: 0,
        flops_saved,
        flop_savings_rate: ratio(flops_saved, flops_total),
        ttft_p50_ms: percentile(&ttfts, 0.50),
        ttft_p95_ms: percentile(&ttfts, 0.95),
        ttft_mean_ms: if ttfts.is_empty() {
            0.0
        } else {
            ttfts.iter().sum::<f64>() / ttfts.len() as f64
        },
        evictions,
        states_admitted,
        admissions_rejected: 0,
        admissions_truncated: 0,
        alpha: 0.0,
        tuning_rounds: 0,
        used_bytes: used,
        wall_s: start.elapsed().as_secs_f64(),
        tiers: None,
    };
    Replay { report, outcomes }
}

/// Bytes of the KV of every distinct token of `trace` under `model` (no
/// states): what an unbounded attention cache would hold at the end. The
/// battery sizes its capacities as fractions of it.
pub fn distinct_kv_bytes(trace: &Trace, model: &ModelSpec) -> u64 {
    let mut h = Hindsight::default();
    h.nodes.push(TNode {
        parent: NONE,
        ..TNode::default()
    });
    trace.for_each(|r| {
        h.insert(r.full);
    });
    let tokens: u64 = h.nodes.iter().map(|n| n.tokens.len() as u64).sum();
    let bpt = match model.kv_bytes_per_token() {
        0 => TOKEN_ID_BYTES,
        kv => kv,
    };
    tokens.saturating_mul(bpt)
}
