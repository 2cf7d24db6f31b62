//! The invariant checks: structure, accounting, leases and the eviction
//! index, recounted from scratch (tests, `strict-checks`).

use crate::cache::Core;
use crate::tree::{NodeId, NIL};

impl Core {
    /// Checks every structural and accounting invariant; panics with a
    /// description on the first violation. Cost: O(nodes + tokens).
    pub(crate) fn check_invariants(&self) {
        let mut kv = 0u64;
        let mut states = 0u64;
        let mut cands = 0usize;
        let mut pins: Vec<u32> = vec![0; self.tree.nodes.len()];
        let mut listed = vec![false; self.tree.nodes.len()];
        for &id in &self.dirty {
            listed[id as usize] = true;
        }
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
            // Membership and key are current but for nodes awaiting
            // re-derivation (synced before any search).
            if n.dirty {
                assert!(listed[id as usize], "{id} marked but not listed");
            } else {
                assert_eq!(n.cand, self.wanted_key(id), "index entry of {id}");
            }
            // The eviction policy's contract: only shapes eviction can free
            // (asked of the policy: an entry awaiting re-derivation may be
            // stale until the next sync).
            assert!(
                !self.eligible(id)
                    || n.children.is_empty()
                    || (n.children.len() == 1 && n.state.is_some()),
                "candidate {id} is neither a leaf nor a one-child node with a state"
            );
            cands += usize::from(n.cand.is_some());
        }
        assert_eq!(kv, self.kv_tokens, "kv token recount");
        assert_eq!(states, self.states, "state recount");
        assert_eq!(cands, self.index.len(), "index size");
        if let Some(b) = self.units {
            assert!(
                b.fits(self.used_units()),
                "over the unit budget: {:?} > {b:?}",
                self.used_units()
            );
        }
        assert!(
            self.used_bytes() <= self.cfg.capacity_bytes,
            "over capacity: {} > {}",
            self.used_bytes(),
            self.cfg.capacity_bytes
        );
    }

    /// A chains-only cache (a lower tier) holds no KV that no state covers
    /// once nothing pins it: the engine's copies are chains. Holds between
    /// the tiered cache's calls (an admission may leave a stateless tail
    /// that its caller prunes).
    pub(crate) fn check_chains_only(&self) {
        if !self.chains_only {
            return;
        }
        for (id, n) in self.tree.nodes.iter().enumerate() {
            assert!(
                !n.live
                    || n.parent == NIL
                    || n.leases > 0
                    || !n.children.is_empty()
                    || n.state.is_some(),
                "chains-only cache keeps a stateless leaf {id} ({} tokens)",
                n.tokens.len()
            );
        }
    }
}
