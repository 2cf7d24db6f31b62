//! The arena radix tree over token ids. Structure only: splitting, merging,
//! walking. Byte accounting and policies live in `cache`.

use std::collections::BTreeMap;
use std::sync::Arc;

/// Index of a node in the arena.
pub(crate) type NodeId = u32;

/// Marks "no node" (the parent of a root).
pub(crate) const NIL: NodeId = u32::MAX;

/// A recurrent-state checkpoint at the end of a node's edge.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct StateRef {
    /// The engine's slot id, if the engine tracks slots.
    pub(crate) slot: Option<u32>,
}

#[derive(Clone, Debug, Default)]
pub(crate) struct Node {
    pub(crate) parent: NodeId,
    /// The edge label: tokens from the parent's end to this node's end.
    /// Copy-on-write: a copy of the tree (the tuner's window snapshot)
    /// shares the buffers instead of copying every cached token, and an edge
    /// that changes while shared is copied then (`Arc::make_mut`), on a path
    /// that walks that edge anyway.
    pub(crate) tokens: Arc<Vec<u32>>,
    /// Prefix length at the end of the edge.
    pub(crate) depth: u32,
    /// Children keyed by their edge's first token, sorted.
    pub(crate) children: Vec<(u32, NodeId)>,
    /// The checkpoint at `depth`, if cached.
    pub(crate) state: Option<StateRef>,
    /// The engine's KV page ids for this edge (`tokens.len() / page_size`),
    /// or empty when the engine does not track pages. Shared as `tokens` is.
    pub(crate) pages: Arc<Vec<u32>>,
    /// Logical time of the last access.
    pub(crate) last_access: u64,
    /// Leases whose pinned path runs through this node.
    pub(crate) leases: u32,
    /// Key under which the node sits in the eviction index, if it does.
    pub(crate) cand: Option<crate::index::CandKey>,
    /// Whether the node's index entry awaits re-derivation (listed in
    /// `Core::dirty`; see `Core::refresh`).
    pub(crate) dirty: bool,
    /// Whether the node has ever had two children: a prefix shared by
    /// several requests (paper §4.1's "purely input" reuse).
    pub(crate) was_branch: bool,
    pub(crate) live: bool,
}

impl Node {
    /// Children whose edge starts with `token` (one when pages hold one
    /// token; with larger pages, siblings may share a first token but never
    /// a whole first page).
    pub(crate) fn children_starting(&self, token: u32) -> &[(u32, NodeId)] {
        let lo = self.children.partition_point(|&(t, _)| t < token);
        let hi = self.children.partition_point(|&(t, _)| t <= token);
        &self.children[lo..hi]
    }

    fn add_child(&mut self, token: u32, id: NodeId) {
        let i = self.children.partition_point(|&(t, _)| t <= token);
        self.children.insert(i, (token, id));
    }

    fn replace_child(&mut self, old: NodeId, new: NodeId) {
        let e = self
            .children
            .iter_mut()
            .find(|(_, c)| *c == old)
            .expect("child link");
        e.1 = new;
    }

    fn remove_child(&mut self, id: NodeId) {
        self.children.retain(|&(_, c)| c != id);
    }
}

/// Where a walk along a token sequence stopped.
#[derive(Clone, Debug)]
pub(crate) struct Walk {
    /// Fully matched nodes from the root's first child down (root excluded).
    pub(crate) path: Vec<NodeId>,
    /// Tokens matched, token-exact (may end inside `partial`'s edge).
    pub(crate) matched: u32,
    /// The node whose edge the match ended inside, with the tokens matched on it.
    pub(crate) partial: Option<(NodeId, u32)>,
    /// Whether the walk stopped because the tokens ran out (at a node, inside
    /// an edge, or less than a page into an edge, which `matched` does not
    /// count) rather than at a mismatch: a longer sequence may match further,
    /// so only such a walk needs resuming for an extension of its tokens.
    pub(crate) ran_out: bool,
}

/// Nodes per copy-on-write chunk of the arena.
const CHUNK: usize = 16;

/// The node arena, in copy-on-write chunks of [`CHUNK`] nodes: a copy (the
/// tuner's window snapshot, taken on a request) shares every chunk, and a
/// chunk is copied when first changed while shared, so the copy costs
/// O(nodes / CHUNK) on the request that takes it and the rest is spread over
/// the requests that change the tree afterwards, 16 nodes at a time.
#[derive(Clone, Debug, Default)]
pub(crate) struct Nodes {
    chunks: Vec<Arc<Vec<Node>>>,
    len: usize,
}

impl Nodes {
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    fn get(&self, i: usize) -> &Node {
        &self.chunks[i / CHUNK][i % CHUNK]
    }

    fn get_mut(&mut self, i: usize) -> &mut Node {
        &mut Arc::make_mut(&mut self.chunks[i / CHUNK])[i % CHUNK]
    }

    fn push(&mut self, node: Node) {
        if self.len % CHUNK == 0 {
            self.chunks.push(Arc::new(Vec::with_capacity(CHUNK)));
        }
        let last = self.chunks.last_mut().expect("a chunk with room");
        Arc::make_mut(last).push(node);
        self.len += 1;
    }

    /// Every node, by id.
    pub(crate) fn iter(&self) -> impl Iterator<Item = &Node> {
        self.chunks.iter().flat_map(|c| c.iter())
    }
}

/// The arena of nodes, with one root per namespace.
#[derive(Clone, Debug, Default)]
pub(crate) struct Tree {
    pub(crate) nodes: Nodes,
    free: Vec<NodeId>,
    pub(crate) roots: BTreeMap<u64, NodeId>,
}

/// Length of the common prefix of two slices.
pub(crate) fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    // Whole chunks are compared by an xor-or reduction (branch-free and
    // vectorised, no call per chunk); the first differing chunk is then
    // scanned token by token. Matches run to tens of thousands of tokens,
    // so this is the hot loop of every lookup.
    const CHUNK: usize = 32;
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut i = 0;
    for (x, y) in a.chunks_exact(CHUNK).zip(b.chunks_exact(CHUNK)) {
        if x.iter().zip(y).fold(0, |acc, (p, q)| acc | (p ^ q)) != 0 {
            break;
        }
        i += CHUNK;
    }
    i + a[i..]
        .iter()
        .zip(&b[i..])
        .take_while(|(x, y)| x == y)
        .count()
}

impl Tree {
    pub(crate) fn node(&self, id: NodeId) -> &Node {
        self.nodes.get(id as usize)
    }

    pub(crate) fn node_mut(&mut self, id: NodeId) -> &mut Node {
        self.nodes.get_mut(id as usize)
    }

    pub(crate) fn live_count(&self) -> usize {
        self.nodes.len() - self.free.len()
    }

    fn alloc(&mut self, node: Node) -> NodeId {
        if let Some(id) = self.free.pop() {
            *self.nodes.get_mut(id as usize) = node;
            id
        } else {
            self.nodes.push(node);
            (self.nodes.len() - 1) as NodeId
        }
    }

    fn release(&mut self, id: NodeId) {
        *self.nodes.get_mut(id as usize) = Node::default();
        self.free.push(id);
    }

    pub(crate) fn root(&self, ns: u64) -> Option<NodeId> {
        self.roots.get(&ns).copied()
    }

    pub(crate) fn root_or_insert(&mut self, ns: u64) -> NodeId {
        if let Some(r) = self.root(ns) {
            return r;
        }
        let id = self.alloc(Node {
            parent: NIL,
            live: true,
            ..Node::default()
        });
        self.roots.insert(ns, id);
        id
    }

    pub(crate) fn is_root(&self, id: NodeId) -> bool {
        self.node(id).parent == NIL
    }

    /// The child of `cur` sharing the most tokens with `rest` (whose first
    /// token is `first`), with the count; at most one child shares a whole page.
    pub(crate) fn best_child(
        &self,
        cur: NodeId,
        first: u32,
        rest: &[u32],
    ) -> Option<(usize, NodeId)> {
        self.node(cur)
            .children_starting(first)
            .iter()
            .map(|&(_, c)| (common_prefix(&self.node(c).tokens, rest), c))
            .max_by_key(|&(n, c)| (n, std::cmp::Reverse(c)))
    }

    /// The child of `cur` on the path of `rest`, known to exist: the one
    /// whose first page matches (only that much is compared).
    pub(crate) fn child_on_path(&self, cur: NodeId, rest: &[u32], page_size: u32) -> NodeId {
        let probe = &rest[..rest.len().min(page_size as usize)];
        self.node(cur)
            .children_starting(rest[0])
            .iter()
            .map(|&(_, c)| c)
            .find(|&c| self.node(c).tokens.starts_with(probe))
            .expect("path exists")
    }

    /// Walks `tokens` from `root`.
    pub(crate) fn walk(&self, root: NodeId, tokens: &[u32], page_size: u32) -> Walk {
        let start = Walk {
            path: Vec::new(),
            matched: 0,
            partial: None,
            ran_out: false,
        };
        self.walk_from(root, start, tokens, page_size)
    }

    /// Resumes `walk` (a walk of a prefix of `tokens` from `root`, on the
    /// unchanged tree) over the rest of `tokens`.
    pub(crate) fn walk_from(
        &self,
        root: NodeId,
        mut walk: Walk,
        tokens: &[u32],
        page_size: u32,
    ) -> Walk {
        if let Some((id, on_edge)) = walk.partial {
            let edge = &self.node(id).tokens;
            let pos = walk.matched as usize;
            let n = common_prefix(&edge[on_edge as usize..], &tokens[pos..]);
            walk.matched += n as u32;
            let on = on_edge as usize + n;
            if on < edge.len() {
                walk.partial = Some((id, on as u32));
                walk.ran_out = pos + n == tokens.len();
                return walk;
            }
            walk.partial = None;
            walk.path.push(id);
        }
        let mut cur = walk.path.last().copied().unwrap_or(root);
        loop {
            let pos = walk.matched as usize;
            let Some(&first) = tokens.get(pos) else {
                walk.ran_out = true;
                return walk;
            };
            let Some((n, child)) = self.best_child(cur, first, &tokens[pos..]) else {
                walk.ran_out = false;
                return walk;
            };
            let edge = &self.node(child).tokens;
            // Mismatch or end of the tokens on this edge? No child shares
            // more than `n` with them, so when the tokens went on past `n`
            // no extension can match further.
            walk.ran_out = pos + n == tokens.len();
            if n < edge.len() && (n as u32) < page_size {
                // Less than a page in common: nothing reusable on this edge.
                return walk;
            }
            walk.matched += n as u32;
            if n < edge.len() {
                walk.partial = Some((child, n as u32));
                return walk;
            }
            walk.path.push(child);
            cur = child;
        }
    }

    /// Whether the tokens from the root to the end of `id`'s edge begin
    /// with `prefix` (no longer than `id`'s depth).
    pub(crate) fn path_starts_with(&self, id: NodeId, prefix: &[u32]) -> bool {
        let mut cur = id;
        while cur != NIL && !self.is_root(cur) {
            let n = self.node(cur);
            let start = (n.depth as usize).saturating_sub(n.tokens.len());
            if start < prefix.len() {
                let end = prefix.len().min(n.depth as usize);
                if n.tokens[..end - start] != prefix[start..end] {
                    return false;
                }
            }
            cur = n.parent;
        }
        prefix.len() <= self.node(id).depth as usize
    }

    /// Splits `id`'s edge after `at` tokens (`0 < at < edge length`): a new
    /// node takes the first `at` tokens (and their pages) and becomes `id`'s
    /// parent. Returns the new node. The new node inherits `id`'s lease count
    /// (every lease pinning `id` runs through it) and last access.
    pub(crate) fn split(&mut self, id: NodeId, at: u32, page_size: u32) -> NodeId {
        let (parent, head, head_pages, depth, leases, last_access) = {
            let n = self.node_mut(id);
            debug_assert!(at > 0 && (at as usize) < n.tokens.len());
            let tokens = Arc::make_mut(&mut n.tokens);
            let tail = tokens.split_off(at as usize);
            let head = std::mem::replace(tokens, tail);
            let head_pages = if n.pages.is_empty() {
                Vec::new()
            } else {
                let pages = Arc::make_mut(&mut n.pages);
                let tail_pages = pages.split_off((at / page_size) as usize);
                std::mem::replace(pages, tail_pages)
            };
            let depth = n.depth - (n.tokens.len() as u32);
            (n.parent, head, head_pages, depth, n.leases, n.last_access)
        };
        let second = self.node(id).tokens[0];
        let new = self.alloc(Node {
            parent,
            tokens: Arc::new(head),
            depth,
            children: vec![(second, id)],
            state: None,
            pages: Arc::new(head_pages),
            last_access,
            leases,
            cand: None,
            dirty: false,
            was_branch: false,
            live: true,
        });
        self.node_mut(id).parent = new;
        self.node_mut(parent).replace_child(id, new);
        new
    }

    /// Adds a leaf under `parent` with the given edge.
    pub(crate) fn add_leaf(
        &mut self,
        parent: NodeId,
        tokens: Vec<u32>,
        pages: Vec<u32>,
        now: u64,
    ) -> NodeId {
        let depth = self.node(parent).depth + tokens.len() as u32;
        let first = tokens[0];
        let id = self.alloc(Node {
            parent,
            tokens: Arc::new(tokens),
            depth,
            children: Vec::new(),
            state: None,
            pages: Arc::new(pages),
            last_access: now,
            leases: 0,
            cand: None,
            dirty: false,
            was_branch: false,
            live: true,
        });
        let p = self.node_mut(parent);
        p.add_child(first, id);
        p.was_branch |= p.children.len() >= 2;
        id
    }

    /// Removes leaf `id` (not a root); returns its parent.
    pub(crate) fn remove_leaf(&mut self, id: NodeId) -> NodeId {
        let parent = self.node(id).parent;
        debug_assert!(self.node(id).children.is_empty() && parent != NIL);
        self.node_mut(parent).remove_child(id);
        self.release(id);
        parent
    }

    /// Merges one-child node `id` (not a root) into its child: the child's
    /// edge is prefixed with `id`'s edge and takes `id`'s place under its
    /// parent. Returns the child.
    pub(crate) fn merge_into_child(&mut self, id: NodeId) -> NodeId {
        let (parent, child, tokens, pages) = {
            let n = self.node_mut(id);
            debug_assert!(n.children.len() == 1 && n.parent != NIL);
            (
                n.parent,
                n.children[0].1,
                std::mem::take(&mut n.tokens),
                std::mem::take(&mut n.pages),
            )
        };
        {
            let c = self.node_mut(child);
            // Unshared (no snapshot holds it), the parent's buffer is reused.
            let mut tokens = Arc::unwrap_or_clone(tokens);
            tokens.extend_from_slice(&c.tokens);
            c.tokens = Arc::new(tokens);
            if !c.pages.is_empty() || !pages.is_empty() {
                let mut pages = Arc::unwrap_or_clone(pages);
                pages.extend_from_slice(&c.pages);
                c.pages = Arc::new(pages);
            }
            c.parent = parent;
        }
        self.node_mut(parent).replace_child(id, child);
        self.release(id);
        child
    }
}

#[cfg(test)]
mod tests {
    use super::{common_prefix, Tree};

    #[test]
    fn path_starts_with_reads_every_edge_of_the_path() {
        let mut t = Tree::default();
        let root = t.root_or_insert(0);
        let a = t.add_leaf(root, (0..10).collect(), Vec::new(), 0);
        let b = t.add_leaf(a, (10..30).collect(), Vec::new(), 0);
        let s = t.split(b, 5, 1);
        let path: Vec<u32> = (0..30).collect();
        for n in [0, 1, 10, 14, 15, 29, 30] {
            assert!(t.path_starts_with(b, &path[..n]), "{n}");
        }
        assert!(t.path_starts_with(s, &path[..15]));
        assert!(!t.path_starts_with(s, &path[..16]), "longer than the path");
        for at in [0, 9, 10, 14, 15, 29] {
            let mut bad = path.clone();
            bad[at] = 99;
            assert!(!t.path_starts_with(b, &bad), "{at}");
        }
    }

    #[test]
    fn common_prefix_at_every_offset() {
        let a: Vec<u32> = (0..200).collect();
        for cut in 0..200 {
            let mut b = a.clone();
            b[cut] = 9999;
            assert_eq!(common_prefix(&a, &b), cut);
            assert_eq!(common_prefix(&a[..cut], &a), cut);
        }
        assert_eq!(common_prefix(&a, &a), 200);
        assert_eq!(common_prefix(&[], &a), 0);
    }
}
