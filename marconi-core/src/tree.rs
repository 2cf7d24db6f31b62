//! The arena radix tree over token ids. Structure only: splitting, merging,
//! walking. Byte accounting and policies live in `cache`.

use std::collections::BTreeMap;
use std::ops::Deref;
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

/// A range of a shared buffer of `u32`s: an edge's tokens or its page ids.
///
/// Splitting an edge cuts its range in two over the same buffer (O(1), no
/// copy). Merging a node into its child (an eviction) joins two ranges:
/// O(1) when they are adjacent in one buffer (a chain one admission
/// inserted, or the two halves of a split); when the parent's range ends
/// a buffer it holds alone, the child's tokens are appended to it (the
/// buffer grows as a `Vec` does); when the child holds its buffer alone
/// with room before its range, the parent's are written there; else both
/// are copied into a new buffer with as much room again after them. On
/// the decision-latency workload nearly every merge appends: states go
/// oldest first, so a node that absorbed its parent is soon absorbed into
/// its own child, and the grown buffer travels down instead of being
/// copied again at every step. A copy of the tree (the tuner's window
/// snapshot) shares the buffers: a buffer held by more than one span is
/// never written, only read or copied.
///
/// A buffer lives while any range of it does, so an edge may keep the
/// tokens of evicted neighbours: a join copies an adjacent result into a
/// tight buffer when the one it would keep is more than four times its
/// content, and [`Tree::remove_leaf`] tightens the parent's buffers when
/// the parent holds them alone (the usual case: the leaf evicted was the
/// end of the parent's chain).
#[derive(Clone, Debug, Default)]
pub(crate) struct Span {
    /// `None`: empty (no allocation for an empty edge or page list).
    buf: Option<Arc<Vec<u32>>>,
    start: u32,
    end: u32,
}

impl Deref for Span {
    type Target = [u32];

    fn deref(&self) -> &[u32] {
        match &self.buf {
            Some(b) => &b[self.start as usize..self.end as usize],
            None => &[],
        }
    }
}

impl Span {
    /// The whole of `v`.
    pub(crate) fn from_vec(v: Vec<u32>) -> Span {
        if v.is_empty() {
            return Span::default();
        }
        let end = u32::try_from(v.len()).expect("an edge is shorter than 2^32 tokens");
        Span {
            buf: Some(Arc::new(v)),
            start: 0,
            end,
        }
    }

    /// `self[from..to]`, sharing the buffer.
    pub(crate) fn slice(&self, from: usize, to: usize) -> Span {
        debug_assert!(from <= to && to <= self.len());
        if from == to {
            return Span::default();
        }
        Span {
            buf: self.buf.clone(),
            start: self.start + from as u32,
            end: self.start + to as u32,
        }
    }

    /// Cuts after `at` items: (`self[..at]`, `self[at..]`), one buffer.
    fn split_at(self, at: usize) -> (Span, Span) {
        (self.slice(0, at), self.slice(at, self.len()))
    }

    /// Length of the buffer behind the range (0 when empty).
    fn buf_len(&self) -> usize {
        self.buf.as_ref().map_or(0, |b| b.len())
    }

    /// Whether the buffer holds much more than the range: more than four
    /// times, and more than a small edge's worth.
    fn wasteful(&self) -> bool {
        let (len, cap) = (self.len(), self.buf_len());
        cap > 64 && cap > 4 * len
    }

    /// Copies the range into a tight buffer when the buffer is wasteful
    /// and this span holds it alone (a shared buffer is left as it is: the
    /// other holders still read it).
    fn tighten(&mut self) {
        if self.wasteful() && self.buf.as_ref().is_some_and(|b| Arc::strong_count(b) == 1) {
            *self = Span::from_vec(self.to_vec());
        }
    }

    /// `head` followed by `tail`. O(1) when they are adjacent in one
    /// buffer; O(`tail`) amortised when `head` holds its buffer alone and
    /// ends it (the buffer grows as a `Vec` does); O(`head`) when `tail`
    /// holds its buffer alone with room for `head` in front of its range;
    /// else O(`head` + `tail`) into a new buffer with room for as much
    /// again after it.
    fn join(mut head: Span, mut tail: Span) -> Span {
        if head.is_empty() {
            return tail;
        }
        if tail.is_empty() {
            return head;
        }
        let adjacent = match (&head.buf, &tail.buf) {
            (Some(a), Some(b)) => Arc::ptr_eq(a, b) && head.end == tail.start,
            _ => false,
        };
        if adjacent {
            let start = head.start;
            drop(head);
            tail.start = start;
            if !tail.wasteful() {
                return tail;
            }
            return Span::from_vec(tail.to_vec());
        }
        let (h, t) = (head.len(), tail.len());
        let end = u32::try_from(h + t).expect("an edge is shorter than 2^32 tokens");
        if head.start == 0 {
            let head_end = head.end as usize;
            if let Some(buf) = head.buf.as_mut().and_then(Arc::get_mut) {
                if buf.len() == head_end {
                    buf.extend_from_slice(&tail);
                    head.end = end;
                    return head;
                }
            }
        }
        if tail.start as usize >= h && !tail.wasteful() {
            if let Some(buf) = tail.buf.as_mut().and_then(Arc::get_mut) {
                let at = tail.start as usize - h;
                buf[at..at + h].copy_from_slice(&head);
                tail.start = at as u32;
                return tail;
            }
        }
        let mut v = Vec::with_capacity(2 * (h + t));
        v.extend_from_slice(&head);
        v.extend_from_slice(&tail);
        Span {
            buf: Some(Arc::new(v)),
            start: 0,
            end,
        }
    }
}

#[derive(Clone, Debug, Default)]
pub(crate) struct Node {
    pub(crate) parent: NodeId,
    /// The edge label: tokens from the parent's end to this node's end, a
    /// range of a shared buffer ([`Span`]): a copy of the tree (the tuner's
    /// window snapshot) shares the buffers instead of copying every cached
    /// token, and splits and most merges copy no token.
    pub(crate) tokens: Span,
    /// Prefix length at the end of the edge.
    pub(crate) depth: u32,
    /// Children keyed by their edge's first token, sorted.
    pub(crate) children: Vec<(u32, NodeId)>,
    /// The checkpoint at `depth`, if cached.
    pub(crate) state: Option<StateRef>,
    /// The engine's KV page ids for this edge (`tokens.len() / page_size`),
    /// or empty when the engine does not track pages. Shared as `tokens` is.
    pub(crate) pages: Span,
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
            // O(1): both halves keep ranges of the same buffers.
            let (head, tail) = std::mem::take(&mut n.tokens).split_at(at as usize);
            n.tokens = tail;
            let page_cut = ((at / page_size) as usize).min(n.pages.len());
            let (head_pages, tail_pages) = std::mem::take(&mut n.pages).split_at(page_cut);
            n.pages = tail_pages;
            let depth = n.depth - (n.tokens.len() as u32);
            (n.parent, head, head_pages, depth, n.leases, n.last_access)
        };
        let second = self.node(id).tokens[0];
        let new = self.alloc(Node {
            parent,
            tokens: head,
            depth,
            children: vec![(second, id)],
            state: None,
            pages: head_pages,
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
    #[cfg(test)]
    pub(crate) fn add_leaf(
        &mut self,
        parent: NodeId,
        tokens: Vec<u32>,
        pages: Vec<u32>,
        now: u64,
    ) -> NodeId {
        self.add_leaf_span(parent, Span::from_vec(tokens), Span::from_vec(pages), now)
    }

    /// Adds a leaf under `parent` with the given edge (a range of a buffer
    /// that may hold a whole chain: see [`Span`]).
    pub(crate) fn add_leaf_span(
        &mut self,
        parent: NodeId,
        tokens: Span,
        pages: Span,
        now: u64,
    ) -> NodeId {
        let depth = self.node(parent).depth + tokens.len() as u32;
        let first = tokens[0];
        let id = self.alloc(Node {
            parent,
            tokens,
            depth,
            children: Vec::new(),
            state: None,
            pages,
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
        self.release(id);
        let p = self.node_mut(parent);
        p.remove_child(id);
        // The leaf was often the end of its parent's chain: the buffer they
        // shared is the parent's alone now.
        p.tokens.tighten();
        p.pages.tighten();
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
            c.tokens = Span::join(tokens, std::mem::take(&mut c.tokens));
            c.pages = Span::join(pages, std::mem::take(&mut c.pages));
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

    /// Every way two spans are joined gives the concatenation, and a
    /// shared buffer is never written.
    #[test]
    fn span_joins_and_splits() {
        use super::Span;
        let whole = Span::from_vec((0..100).collect());
        let (a, b) = whole.clone().split_at(30);
        assert_eq!(&a[..], &(0..30).collect::<Vec<u32>>()[..]);
        assert_eq!(&b[..], &(30..100).collect::<Vec<u32>>()[..]);
        // Adjacent in one buffer.
        let j = Span::join(a.clone(), b.clone());
        assert_eq!(&j[..], &whole[..]);
        // Not adjacent: b then a, copied (both shared with `whole`).
        let j = Span::join(b.clone(), a.clone());
        let want: Vec<u32> = (30..100).chain(0..30).collect();
        assert_eq!(&j[..], &want[..]);
        assert_eq!(
            &whole[..],
            &(0..100).collect::<Vec<u32>>()[..],
            "shared buffer unchanged"
        );
        // Appended in place to a buffer the head holds alone, then again.
        let head = Span::from_vec(vec![7, 8]);
        let j = Span::join(head, Span::from_vec(vec![9]));
        let j = Span::join(j, Span::from_vec(vec![10, 11]));
        assert_eq!(&j[..], &[7, 8, 9, 10, 11]);
        // A head that shares its buffer (a snapshot's copy) is not written.
        let snap = j.clone();
        let k = Span::join(j, Span::from_vec(vec![12]));
        assert_eq!(&k[..], &[7, 8, 9, 10, 11, 12]);
        assert_eq!(&snap[..], &[7, 8, 9, 10, 11]);
        // Written in front of a tail that holds its buffer alone with room.
        let (front, tail) = Span::from_vec((0..10).collect()).split_at(4);
        drop(front);
        let j = Span::join(Span::from_vec(vec![50, 51]), tail);
        assert_eq!(&j[..], &[50, 51, 4, 5, 6, 7, 8, 9]);
        // Empty sides.
        assert_eq!(&Span::join(Span::default(), b.clone())[..], &b[..]);
        assert_eq!(&Span::join(b.clone(), Span::default())[..], &b[..]);
    }

    /// Evicting the end of a chain tightens what is left of its buffer.
    #[test]
    fn a_removed_leaf_tightens_its_parents_buffer() {
        use super::Span;
        let mut t = Tree::default();
        let root = t.root_or_insert(0);
        let chain = Span::from_vec((0..1000).collect());
        let a = t.add_leaf_span(root, chain.slice(0, 100), Span::default(), 0);
        let b = t.add_leaf_span(a, chain.slice(100, 1000), Span::default(), 0);
        drop(chain);
        assert_eq!(t.node(a).tokens.buf_len(), 1000);
        assert_eq!(t.remove_leaf(b), a);
        assert_eq!(t.node(a).tokens.buf_len(), 100);
        assert_eq!(&t.node(a).tokens[..], &(0..100).collect::<Vec<u32>>()[..]);
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
