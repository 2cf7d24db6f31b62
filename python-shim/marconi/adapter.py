"""MarconiPrefixCache: libmarconi behind the method names Python engines
already use for their radix caches (SGLang's RadixCache / BasePrefixCache:
match_prefix, insert, evict, inc_lock_ref / dec_lock_ref, evictable_size,
cache_finished_req, cache_unfinished_req), so that an engine can swap it in.

How the names map onto libmarconi's request cycle:

* match_prefix(key) is a lookup: it counts in the stats and returns a
  MatchResult whose `last_device_node` is a MarconiNode holding the lease.
  Unlike a KV-only radix cache, the usable prefix is `node.hit_tokens`
  (a recurrent state must exist there), which can be shorter than the KV
  that matched (`node.kv_matched_tokens`).
* inc_lock_ref(node) / dec_lock_ref(node) count users of the node; the lease
  is released when the count drops back to 0 (or in cache_finished_req).
* cache_unfinished_req(req) admits what a running request has so far
  (chunked prefill); cache_finished_req(req) admits the finished sequence
  with its saved states and releases the lease.
* evict(num_tokens) frees about num_tokens tokens' worth of bytes and hands
  the freed KV page ids to evict_callback (and returns them with the freed
  state slots).
* evictable_size() and protected_size() are in token equivalents (bytes /
  KV bytes per token), since libmarconi budgets bytes of KV and states
  together.

A request object (`req`) needs `origin_input_ids`, `output_ids` and
`last_node` (the node from match_prefix); optionally `saved_states`
((position, slot) pairs the engine saved at node.plan positions and at the
end) and `kv_pages` (one page id per full page of input + output).
"""

from __future__ import annotations

import ctypes
from array import array as _array
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Optional

from ._convert import U64_MAX, Tokens, _u32_concat, _u32_source, _uint
from ._lib import LOOKUP_NO_KV_PAGES, LOOKUP_WHOLE_INPUT
from .cache import AdmitResult, Lease, MarconiError, PrefixCache


@dataclass(eq=False)
class MarconiNode:
    """What match_prefix returns as the "last node": the lease of one
    lookup and what it found."""

    lease: Lease
    key_len: int
    lock_ref: int = 0
    done: bool = field(default=False)

    @property
    def hit_tokens(self) -> int:
        """Usable prefix length (a state exists there)."""
        return self.lease.hit_tokens

    @property
    def kv_matched_tokens(self) -> int:
        """Prefix length whose KV is cached (usable or not)."""
        return self.lease.kv_matched_tokens

    @property
    def plan(self) -> list[int]:
        """Positions at which to save recurrent states during prefill."""
        return self.lease.plan

    @property
    def state_slot(self) -> Optional[int]:
        """The cached state slot to resume from."""
        return self.lease.state_slot

    @property
    def copy_order(self) -> Optional[tuple[int, int]]:
        """(src_slot, dst_slot) to copy before resuming."""
        return self.lease.copy_order


class MatchResult(NamedTuple):
    """The result of match_prefix, shaped like SGLang's MatchResult."""

    device_indices: list[int]
    """KV page ids of the usable prefix (empty when pages are not tracked)."""
    last_device_node: MarconiNode
    """The node holding the lease."""
    last_host_node: MarconiNode
    """The same node (libmarconi has no host tier)."""


class MarconiPrefixCache:
    """A drop-in for a Python engine's radix prefix cache, backed by
    libmarconi (see the module docstring for the mapping).

    Given SGLang's CacheInitParams (anything with a token_to_kv_pool_allocator)
    instead of a capacity, it is the SGLang 0.5.23 tree cache over SGLang's
    pools (SGLangTreeCache)."""

    def __new__(cls, *args: Any, **kwargs: Any):
        first = args[0] if args else kwargs.get("params")
        if cls is MarconiPrefixCache and hasattr(first, "token_to_kv_pool_allocator"):
            return object.__new__(SGLangTreeCache)
        return object.__new__(cls)

    def __init__(self, capacity_bytes: int, model: Any = "paper-7b", **config: Any):
        self._args = ((capacity_bytes, model), config)
        self.cache = PrefixCache(capacity_bytes, model, **config)
        self._kv_bpt = max(1, self.cache.stats()["kv_bytes_per_token"])

    def reset(self) -> None:
        """Drops everything (a new cache with the same configuration)."""
        args = self._args
        self.cache.close()
        self.cache = PrefixCache(*args[0], **args[1])

    # -- lookups and locks -------------------------------------------------

    def match_prefix(
        self,
        key: Tokens,
        namespace: int = 0,
        dst_slot: Optional[int] = None,
        checkpoints: Optional[Tokens] = None,
        **_: Any,
    ) -> MatchResult:
        """Looks up `key`; the usable prefix is result.last_device_node.hit_tokens.
        `checkpoints`: application checkpoint hints (PrefixCache.lookup), e.g.
        the end of the system prompt; they appear in the node's plan."""
        lease = self.cache.lookup(key, namespace, dst_slot, checkpoints)
        try:
            node = MarconiNode(lease, key_len=lease.input_len)
            return MatchResult(lease.kv_pages, node, node)
        except BaseException:
            lease.release()  # the caller never gets the node that would release it
            raise

    def inc_lock_ref(self, node: MarconiNode) -> int:
        """Marks one more user of the node (its lease stays pinned)."""
        node.lock_ref += 1
        return 0

    def dec_lock_ref(self, node: MarconiNode) -> int:
        """One user fewer; the lease is released when none is left."""
        if node.lock_ref <= 0:
            raise ValueError("dec_lock_ref without inc_lock_ref")
        node.lock_ref -= 1
        if node.lock_ref == 0:
            self._finish(node)
        return 0

    def _finish(self, node: MarconiNode) -> None:
        if not node.done:
            node.done = True
            # Unless already released by its id, or with its cache by reset().
            node.lease._release_if_live()

    # -- insertion ---------------------------------------------------------

    def insert(self, key: Tokens, value: Optional[Tokens] = None, states=None) -> int:
        """Caches `key` (with its KV page ids `value` if pages are tracked, and
        the saved `states` as (position, slot) pairs: by default none, so only
        the KV is cached and no prefix of it becomes usable). Returns the
        number of leading tokens that were already cached (as SGLang does)."""
        with self.cache.lookup(key) as lease:
            lease.admit(key, states or (), value)
            return lease.kv_matched_tokens

    def cache_unfinished_req(self, req: Any) -> AdmitResult:
        """Admits what a running request has so far (e.g. after a prefill
        chunk), keeping its lease."""
        return self._admit_req(req)

    def cache_finished_req(self, req: Any) -> AdmitResult:
        """Admits the finished request's input + output with its saved states
        and releases its lease."""
        try:
            return self._admit_req(req)
        finally:
            node: MarconiNode = req.last_node
            node.lock_ref = 0
            self._finish(node)

    def _admit_req(self, req: Any) -> AdmitResult:
        node: MarconiNode = req.last_node
        lease = node.lease
        # Input and output ids are joined once, in bulk (lists: one list
        # concatenation and one conversion; arrays and tensors: their bytes),
        # never token by token.
        out = getattr(req, "output_ids", None)
        src, n, _ = _u32_concat(req.origin_input_ids, out, "origin_input_ids", "output_ids")
        states = getattr(req, "saved_states", None) or ()
        pages = getattr(req, "kv_pages", None)
        return lease._cache._admit(lease.id, src, n, states, pages)

    # -- eviction and sizes ------------------------------------------------

    def evict(self, num_tokens: int, evict_callback: Optional[Callable[[list[int]], Any]] = None):
        """Frees about `num_tokens` tokens' worth of bytes (any
        number: more than the cache holds frees everything). Freed KV page ids go to
        `evict_callback` (if given); returns (page ids, state slots)."""
        # A request beyond what a uint64 of bytes holds is "everything".
        self.cache.evict(min(_uint(num_tokens, "num_tokens", None) * self._kv_bpt, U64_MAX))
        pages, slots = self.cache.drain_freed()
        if evict_callback is not None and pages:
            evict_callback(pages)
        return pages, slots

    def evictable_size(self) -> int:
        """Bytes eviction could free now, in token equivalents."""
        return self.cache.stats()["evictable_bytes"] // self._kv_bpt

    def protected_size(self) -> int:
        """Bytes pinned by leases, in token equivalents."""
        s = self.cache.stats()
        return (s["used_bytes"] - s["evictable_bytes"]) // self._kv_bpt

    def total_size(self) -> int:
        """Bytes in use, in token equivalents."""
        return self.cache.stats()["used_bytes"] // self._kv_bpt

    def pretty_print(self) -> None:
        """Prints the stats."""
        print(self.cache.stats())


# -- SGLang 0.5.23 (BasePrefixCache over SGLang's own pools) -----------------
#
# SGLang's tree caches take parameter objects (MatchPrefixParams,
# InsertParams, EvictParams, DecLockRefParams) and return MatchResult /
# InsertResult / EvictResult / IncLockRefResult; the pools
# (params.req_to_token_pool, params.token_to_kv_pool_allocator and the
# Mamba slot allocator) are SGLang's. The adapter reads those objects by
# attribute name and builds its results from SGLang's own classes when
# SGLang is importable (otherwise from the stand-ins below, which have the
# same field names), so this module imports nothing from SGLang at load time.

_WHOLE = LOOKUP_WHOLE_INPUT
"""Lookups for SGLang may hit the whole key: libmarconi by default leaves
one token to compute, while SGLang's callers already pass the key they want
matched in full."""

_WHOLE_NO_PAGES = LOOKUP_WHOLE_INPUT | LOOKUP_NO_KV_PAGES
"""As _WHOLE, with the hit's page ids fetched only when asked
(path_device_indices): most matches never ask."""


def _like(ref: Any, ids: list[int]) -> Any:
    """`ids` as the same kind of container as `ref` (a torch tensor on the
    same device when `ref` is one), so SGLang's allocators get what they take."""
    if ref is not None and type(ref).__module__.startswith("torch"):
        import torch

        return torch.tensor(ids, dtype=torch.int64, device=ref.device)
    return list(ids)


def _i64_ids(ids: Any, what: str = "tokens") -> _array:
    """`ids` (a list, tuple, array, numpy array or torch tensor of ints) as
    an array('q'): the same object when it is one already (SGLang's
    RadixKey.token_ids, Req.origin_input_ids), else one bulk conversion in
    C, never a Python loop over the ids. A value that is not an int raises
    as the library's own check names it."""
    cls = ids.__class__
    if cls is _array:
        return ids if ids.typecode == "q" else _array("q", ids)
    if type(ids).__module__.startswith("torch"):
        import torch

        t = ids.detach().reshape(-1)
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.to(torch.int64).contiguous()
        out = _array("q")
        if t.numel():
            out.frombytes(ctypes.string_at(t.data_ptr(), 8 * t.numel()))
        return out
    if cls is not list and cls is not tuple:
        ids = list(ids.tolist() if hasattr(ids, "tolist") else ids)
    if ids and ids[0].__class__ is bool:
        _u32_source(ids, what)  # raises, naming the value
    try:
        return _array("q", ids)
    except (TypeError, OverflowError):
        _u32_source(ids, what)  # raises, naming the value
        raise


def _key_ids(key: Any) -> _array:
    """The token ids of a RadixKey (or of a plain sequence, array or
    tensor) as an array('q'), honouring RadixKey.limit."""
    ids = getattr(key, "token_ids", key)
    if ids is None:
        return _array("q")
    out = _i64_ids(ids)
    limit = getattr(key, "limit", None)
    if limit.__class__ is int and 0 <= limit < len(out):
        out = out[:limit]
    return out


def _index_ids(value: Any, n: int) -> Any:
    """The first n KV indices of `value` as int64 ids the library reads in
    place: a contiguous CPU int64 tensor for a tensor (one bulk copy to the
    CPU and to int64 where it is not one), else an array('q')."""
    if value is not None and type(value).__module__.startswith("torch"):
        import torch

        t = value if value.dim() == 1 else value.reshape(-1)
        if len(t) > n:
            t = t[:n]
        if t.device.type != "cpu":
            t = t.cpu()
        if t.dtype != torch.int64:
            t = t.to(torch.int64)
        return t if t.is_contiguous() else t.contiguous()
    ids = _i64_ids(value if value is not None else (), "value")
    return ids if len(ids) <= n else ids[:n]


def _first_id(value: Any) -> Optional[int]:
    """The first id of a Mamba value (a tensor, array or sequence), or None."""
    if value is None or len(value) == 0:
        return None
    v = value.tolist() if hasattr(value, "tolist") else value  # one element: no per-id work
    while v.__class__ is list or v.__class__ is tuple:
        v = v[0]
    return int(v)


def _pages_to_indices(pages: _array, ps: int, count: int) -> _array:
    """KV indices of the first `count` tokens covered by `pages` (page ids
    of size ps), as an array('q')."""
    if ps == 1:
        return _array("q", pages[:count])
    return _array("q", [p * ps + i for p in pages for i in range(ps)][:count])


class _Tail:
    """indices[start:] of an insert's KV indices (an int64 tensor or
    array('q')), sliced only when asked for."""

    __slots__ = ("indices", "start")

    def __init__(self, indices: Any, start: int):
        self.indices = indices
        self.start = start

    def __getitem__(self, item: slice) -> Any:
        return self.indices[self.start :][item]


def _checkpoint_grid(page_size: int) -> int:
    """SGLang's Mamba checkpoint grid for this page size (the least common
    multiple of the page and the model's state chunk: positions where
    SGLang can save a state), from SGLang's runtime context where it is set
    up; the page size where it is not (no SGLang, no server arguments)."""
    try:
        from sglang.srt.runtime_context import mamba_checkpoint_grid

        g = int(mamba_checkpoint_grid(page_size))
    except Exception:  # SGLang absent, or its server arguments are not set here
        return page_size
    return g if g > 0 and g % page_size == 0 else page_size


def _truncate_parts(parts: tuple, n: int) -> tuple:
    """The (ids, count) pieces of an SGLangNode covering only its first n tokens."""
    out = []
    for ids, c in parts:
        if n <= 0:
            break
        out.append((ids, min(c, n)))
        n -= c
    return tuple(out)


def _namespace(key: Any) -> int:
    """RadixKey.extra_key (and cache_salt) as a libmarconi namespace: the
    same strings always give the same namespace; none gives 0."""
    extra = getattr(key, "extra_key", None)
    salt = getattr(key, "cache_salt", None)
    if extra is None and salt is None:
        return 0
    import hashlib

    digest = hashlib.blake2b(repr((extra, salt)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") or 1


def _sglang_class(module: str, name: str, fallback: Any) -> Any:
    try:
        mod = __import__(module, fromlist=[name])
        return getattr(mod, name)
    except Exception:  # SGLang absent or not importable here (no GPU stack)
        return fallback


@dataclass
class _MatchResult:
    device_prefix_len: int
    last_device_node: Any
    last_host_node: Any
    best_match_node: Any
    host_hit_length: int = 0
    swa_host_hit_length: int = 0
    swa_branching_seqlen: Optional[int] = None
    mamba_host_hit_length: int = 0
    mamba_branching_seqlen: Optional[int] = None
    cache_protected_len: Optional[int] = None
    full_kv_hit_length: int = 0
    cache_actions: tuple = ()
    last_visited_node_id: Optional[int] = None
    full_device_match_len: Optional[int] = None


@dataclass
class _InsertResult:
    prefix_len: int
    total_len: int = 0
    last_device_node: Any = None
    mamba_exist: bool = False
    swa_branch_inserted: bool = False


@dataclass
class _EvictResult:
    num_tokens_evicted: int = 0
    swa_num_tokens_evicted: int = 0
    mamba_num_evicted: int = 0


@dataclass
class _IncLockRefResult:
    delta: Optional[int] = None
    node_id: Optional[int] = None

    def to_dec_params(self) -> Any:
        return None


@dataclass
class _DecLockRefResult:
    delta: Optional[int] = None


@dataclass
class _TreeLock:
    node: Any
    receipt: Any = None
    swa_released: bool = False


@dataclass(eq=False)
class SGLangNode:
    """The "last node" SGLang keeps in req.last_node: one matched prefix
    (the first `hit` ids of `key`, their KV indices and the state slot) and,
    while locked, the libmarconi lease that pins it. KV indices are kept as
    the buffers they came in (`parts`) and joined only when asked for
    (path_device_indices)."""

    node_id: int
    namespace: int
    key: Any
    """array('q') whose first `hit` ids are the prefix."""
    hit: int
    parts: Optional[tuple] = ()
    """(ids, count) pieces of the KV indices, in order: an array('I') of
    page ids (count tokens' worth), a slice of an engine tensor/list of
    indices (count of them), or None: the library's page ids, fetched when
    asked for. None for the whole: all of the prefix's pages are fetched."""
    state_slot: Optional[int] = None
    lease: Optional[int] = None
    """The id of the libmarconi lease pinning the prefix, or None."""
    lock_ref: int = 0
    indices: Any = None
    """The joined KV indices, once asked for."""
    looked_up: int = 0
    """The lease is a lookup of key[:looked_up] (whole input): an insert
    whose key starts with it may admit under it. 0: not known."""

    @property
    def hit_tokens(self) -> int:
        return self.hit


class SGLangTreeCache(MarconiPrefixCache):
    """SGLang 0.5.23's BasePrefixCache interface for hybrid (Mamba) models,
    over libmarconi and SGLang's pools: the KV indices and Mamba slots the
    cache keeps are SGLang's, handed back to SGLang's allocators when
    libmarconi evicts them. See docs/sglang.md for the mapping and for what
    differs by design (admission without a branch, FLOP-aware eviction)."""

    disable = False
    cache_controller = None
    metrics_collector = None
    buffer_pipeline = None
    storage_prefetch_retries = None
    kv_events = None
    draft_swa_window = 0
    sliding_window_size = None
    enable_session_radix_cache = False

    def __init__(self, params: Any, model: Any = "paper-7b", **config: Any):
        self.req_to_token_pool = params.req_to_token_pool
        self.token_to_kv_pool_allocator = params.token_to_kv_pool_allocator
        self.page_size = int(getattr(params, "page_size", 1) or 1)
        self.disable = bool(getattr(params, "disable", False))
        self._model = model
        self._config = dict(config)
        self._config.setdefault("page_size", self.page_size)
        self._mamba_allocator = getattr(self.req_to_token_pool, "mamba_allocator", None)
        self._mamba_pool = getattr(self.req_to_token_pool, "mamba_pool", None)
        # SGLang's Mamba strategy: `extra_buffer` (its default `auto` with
        # overlap scheduling) tracks states into per-request ping-pong slots,
        # `no_buffer` hands over the request's working slot.
        self._extra_buffer = bool(
            getattr(params, "enable_mamba_extra_buffer", False)
            or getattr(self.req_to_token_pool, "enable_mamba_extra_buffer", False)
        )
        self._grid = _checkpoint_grid(self.page_size)
        self._MatchResult = _sglang_class("sglang.srt.mem_cache.base_prefix_cache", "MatchResult", _MatchResult)
        self._InsertResult = _sglang_class("sglang.srt.mem_cache.base_prefix_cache", "InsertResult", _InsertResult)
        self._EvictResult = _sglang_class("sglang.srt.mem_cache.base_prefix_cache", "EvictResult", _EvictResult)
        self._IncResult = _sglang_class("sglang.srt.mem_cache.base_prefix_cache", "IncLockRefResult", _IncLockRefResult)
        self._DecResult = _sglang_class("sglang.srt.mem_cache.base_prefix_cache", "DecLockRefResult", _DecLockRefResult)
        self._TreeLock = _sglang_class("sglang.srt.mem_cache.base_prefix_cache", "TreeLock", _TreeLock)
        self._next_id = 1
        # SGLang's pools hold torch tensors: the index lists handed back are
        # tensors on their device from the start (lists with list pools).
        rows = getattr(self.req_to_token_pool, "req_to_token", None)
        self._index_ref = rows if type(rows).__module__.startswith("torch") else None
        self.cache: Optional[PrefixCache] = None
        self.reset()

    # -- construction ---------------------------------------------------------

    def _pool_sizes(self) -> tuple[int, int]:
        alloc = self.token_to_kv_pool_allocator
        kv = int(getattr(alloc, "size", 0) or alloc.available_size())
        m = self._mamba_allocator
        if m is None:
            raise ValueError("req_to_token_pool has no mamba_allocator: libmarconi's SGLang cache is for hybrid (Mamba) models")
        slots = int(getattr(m, "size", 0) or getattr(self._mamba_pool, "size", 0) or m.available_size())
        if kv <= 0 or slots <= 0:
            raise ValueError(f"empty pools: {kv} KV tokens, {slots} Mamba slots")
        return kv, slots

    def reset(self) -> None:
        """Drops everything; the KV indices and slots the cache held go back
        to SGLang's allocators."""
        if self.cache is not None and not self.cache.closed:
            self.cache.evict(U64_MAX)
            self._give_back()
            self.cache.close()
        kv, slots = self._pool_sizes()
        with PrefixCache(1 << 40, self._model, **self._config) as probe:
            s = probe.stats()
        self._kv_bpt = max(1, s["kv_bytes_per_token"])
        self._state_b = max(1, s["state_bytes_per_entry"])
        # One byte budget the size of SGLang's pools: libmarconi never keeps
        # more KV or states than the pools hold.
        self._capacity = kv * self._kv_bpt + slots * self._state_b
        self.cache = PrefixCache(self._capacity, self._model, **self._config)
        self.root_node = SGLangNode(0, 0, _array("q"), 0)
        self._locked: dict[int, SGLangNode] = {}
        # Leases of matched nodes not locked yet (lease id -> node): lock()
        # takes its node's over (one lookup per match + lock), and all are
        # released before anything admits or evicts, so that a match never
        # pins what SGLang expects evictable.
        self._pending: dict[int, SGLangNode] = {}

    # -- what the cache is -------------------------------------------------------

    def supports_mamba(self) -> bool:
        return True

    def supports_swa(self) -> bool:
        return False

    def supports_auxiliary_swa(self) -> bool:
        return False

    def supports_prefix_sharing(self) -> bool:
        return True

    def supports_fast_match_prefix(self) -> bool:
        return False

    def swa_reprefill_tail_tokens(self, req: Any = None) -> int:
        return 0

    def swa_retain_floor(self, req: Any) -> None:
        return None

    def root_node_handle(self, extra_key: Optional[str] = None) -> SGLangNode:
        return self.root_node

    def resolve_node_handle(self, node_handle: Any) -> Any:
        return node_handle

    def is_root(self, node: Any) -> bool:
        return node is self.root_node

    def dfs_weight_order(self, node_handles: Any) -> list[int]:
        """Request indices with the deepest matches first (requests on the
        same node together), in place of SGLang's walk of its tree."""
        return sorted(range(len(node_handles)), key=lambda i: (-node_handles[i].hit_tokens, node_handles[i].node_id, i))

    def rotation_base_of(self, node: Any) -> None:
        return None

    # -- lookups ------------------------------------------------------------------

    _MAX_PENDING = 64
    """Unlocked matches whose leases are kept for lock(); older ones are released."""

    def _lookup(self, ids: _array, n: int, ns: int, flags: int = _WHOLE_NO_PAGES) -> tuple:
        """One lookup of ids[:n] (read in place; all n may be a hit):
        PrefixCache._lookup_prefix's tuple, with no page count unless `flags` asks for
        the pages."""
        return self.cache._lookup_prefix(ids, n, ns, flags)

    def _release(self, lid: Optional[int]) -> None:
        if lid is not None:
            cache = self.cache
            if not cache._closing and lid in cache._live:
                cache._release(lid)

    def _release_pending(self) -> None:
        """Releases the leases of matches that were not locked."""
        pending = self._pending
        while pending:
            lid, node = pending.popitem()
            if node.lease == lid and node.lock_ref == 0:
                node.lease = None
            self._release(lid)

    def _node(self, ids: _array, ns: int, found: tuple) -> SGLangNode:
        """The node of a lookup's result (its lease still live)."""
        lid, hit, _, slot, n_pages = found
        # The page ids are fetched when asked for (path_device_indices),
        # while the lease that pins them is live if it still is.
        node = SGLangNode(self._next_id, ns, ids, hit, None, slot)
        self._next_id += 1
        return node

    def _node_pages(self, node: SGLangNode) -> _array:
        """The page ids of the node's prefix, from its live lease, else from
        a new lookup (fewer if evicted since, as the cache now holds them)."""
        n_pages = node.hit // self.page_size
        lid = node.lease
        cache = self.cache
        if lid is not None and lid in cache._live:
            return cache._lease_pages(lid, n_pages)
        found = self._lookup(node.key, node.hit, node.namespace, _WHOLE)
        try:
            return cache._lease_pages(found[0], min(found[4], n_pages))
        finally:
            self._release(found[0])

    def match_prefix(self, params: Any) -> Any:
        """The longest cached prefix of params.key that has a Mamba state
        (libmarconi resumes only from a state). Pins nothing: lock() pins
        (with this lookup's lease, unless the cache admitted or evicted in
        between). With params.cow_mamba and params.req, the state is copied
        into the request's own Mamba slot (allocated here if it has none)."""
        key = params.key
        ids = _key_ids(key)
        n = len(ids)
        if self.disable or n == 0:
            return self._miss(n)
        ns = _namespace(key)
        found = self._lookup(ids, n, ns)
        lid = found[0]
        try:
            hit = found[1]
            kv_matched = min(found[2], n)
            if hit == 0:
                self._release(lid)
                return self._miss(kv_matched)
            node = self._node(ids, ns, found)
        except BaseException:
            self._release(lid)
            raise
        node.lease = lid
        node.looked_up = n
        pending = self._pending
        pending[lid] = node
        if len(pending) > self._MAX_PENDING:
            old = next(iter(pending))
            old_node = pending.pop(old)
            if old_node.lock_ref == 0:
                old_node.lease = None
            self._release(old)
        req = getattr(params, "req", None)
        if getattr(params, "cow_mamba", False) and req is not None and node.state_slot is not None:
            if not self._copy_state_into(req, node):
                # No slot for the request's copy even after evicting a state:
                # a miss, never a hit whose state the request does not hold.
                return self._miss(kv_matched)
        return self._match(node, kv_matched)

    def _miss(self, kv_matched: int) -> Any:
        return self._match(self.root_node, kv_matched)

    def _match(self, node: SGLangNode, kv_matched: int) -> Any:
        result = self._MatchResult(
            device_prefix_len=node.hit_tokens,
            last_device_node=node,
            last_host_node=node,
            best_match_node=node,
            # The deepest page-aligned prefix whose KV is cached: a state saved
            # there would make it a hit (SGLang's branching point).
            mamba_branching_seqlen=self._branching_seqlen(kv_matched, node.hit_tokens),
            full_kv_hit_length=max(kv_matched, node.hit_tokens),
        )
        return result

    def _branching_seqlen(self, kv_matched: int, hit: int) -> Optional[int]:
        """The deepest position on SGLang's Mamba checkpoint grid (the page
        size and its state chunk) within the cached KV and past the hit, as
        SGLang's Mamba component computes it: where a request whose KV
        matches further than any state should save one (in `extra_buffer`
        mode SGLang tracks the state there during the prefill, and the
        finished request hands it to the tree: Marconi's state at a branch
        point). None when there is none."""
        g = self._grid
        aligned = (kv_matched // g) * g
        return aligned if aligned > hit else None

    def _copy_state_into(self, req: Any, node: SGLangNode) -> bool:
        """Gives the request a copy of the node's state: as SGLang's Mamba
        component does, deferred to the batch (req.kv.mamba_cow_src_index)
        when the request has that field, else copied now
        (mamba_pool.copy_from). A slot is allocated if the request has none,
        evicting one state if the pool is empty (the node locked meanwhile).
        False when no slot can be had."""
        kv = getattr(req, "kv", req)
        src = node.state_slot
        dst = getattr(kv, "mamba_pool_idx", None)
        if dst is None:
            alloc = self._mamba_allocator
            if alloc is None:
                return False
            got = alloc.alloc(1)
            if got is None or len(got) == 0:
                self.inc_lock_ref(node)
                try:
                    self.evict(_Evict(0, 1))
                finally:
                    self.dec_lock_ref(node)
                got = alloc.alloc(1)
                if got is None or len(got) == 0 or node.state_slot != src:
                    if got is not None and len(got):
                        alloc.free(got)
                    return False
            dst = got[0]
            kv.mamba_pool_idx = dst
        ref = dst if type(dst).__module__.startswith("torch") else None
        if hasattr(kv, "mamba_cow_src_index"):
            kv.mamba_cow_src_index = _like(ref, [src])
            if hasattr(kv, "mamba_needs_clear"):
                kv.mamba_needs_clear = False
            return True
        pool = self._mamba_pool
        if pool is None or not hasattr(pool, "copy_from"):
            return False
        pool.copy_from(_like(ref, [src]), _like(ref, [int(dst)]))
        return True

    def touch_prefix(self, key: Any) -> None:
        """A lookup without a copy: refreshes the prefix's recency."""
        ids = _key_ids(key)
        if len(ids) and not self.disable:
            self._release(self._lookup(ids, len(ids), _namespace(key))[0])

    # -- locks --------------------------------------------------------------------

    def inc_lock_ref(self, node: Any) -> Any:
        """Pins the node's prefix (a libmarconi lease) until dec_lock_ref."""
        if not isinstance(node, SGLangNode):
            raise TypeError(f"node: expected a node from this cache's match_prefix, got {type(node).__name__}")
        if node is not self.root_node:
            if node.lock_ref == 0:
                lid = node.lease
                if lid is None or self._pending.pop(lid, None) is not node:
                    # Not the match's own lease (released since): look up again.
                    looked_up = node.hit
                    found = self._lookup(node.key, looked_up, node.namespace)
                    lid, hit, slot = found[0], found[1], found[3]
                    node.looked_up = looked_up
                    if hit < node.hit:
                        # Evicted since the match: the pin covers what is still there.
                        node.hit = hit
                        node.parts = None if node.parts is None else _truncate_parts(node.parts, hit)
                        node.indices = None
                        node.state_slot = slot
                    node.lease = lid
                self._locked[node.node_id] = node
            node.lock_ref += 1
        return self._IncResult(delta=0, node_id=node.node_id)

    def dec_lock_ref(self, node: Any, params: Any = None) -> Any:
        if not isinstance(node, SGLangNode):
            raise TypeError(f"node: expected a node from this cache's match_prefix, got {type(node).__name__}")
        if node is not self.root_node:
            if node.lock_ref <= 0:
                raise ValueError("dec_lock_ref without inc_lock_ref")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._locked.pop(node.node_id, None)
                lid, node.lease = node.lease, None
                self._release(lid)
        return self._DecResult(delta=0)

    def lock(self, node: Any) -> Any:
        self.inc_lock_ref(node)
        return self._TreeLock(node, None)

    def unlock(self, lock: Any) -> None:
        if lock is not None:
            self.dec_lock_ref(lock.node)

    # -- insertion ------------------------------------------------------------------

    def insert(self, params: Any) -> Any:
        """Caches params.key with its KV indices params.value and, when given,
        the Mamba state params.mamba_value at the key's end. Duplicate KV
        (indices from params.prev_prefix_len on that the tree already holds)
        goes back to the allocator; result.mamba_exist says the cache did
        not take the offered state (the caller keeps or frees it).
        The key and the indices are read in place (int64), never as lists."""
        ids = _key_ids(params.key)
        value = params.value
        torch_value = value is not None and type(value).__module__.startswith("torch")
        if torch_value:
            self._index_ref = value
        ps = self.page_size
        n = (len(ids) // ps) * ps
        if n < len(ids):
            ids = ids[:n]
        indices = _index_ids(value, n)
        if len(indices) < n:
            raise ValueError(f"value: {len(indices)} KV indices for a key of {n} tokens")
        ns = _namespace(params.key)
        slot = _first_id(getattr(params, "mamba_value", None))
        states = [(n, slot)] if slot is not None and n > 0 else []
        prev = max(0, int(getattr(params, "prev_prefix_len", 0) or 0))
        if n == 0:
            return self._InsertResult(
                prefix_len=0, total_len=0, last_device_node=self.root_node, mamba_exist=slot is not None
            )
        if ps == 1:
            pages, n_pages = indices, n
        elif hasattr(indices, "data_ptr"):
            # One page id per page, in one tensor operation (read in place).
            pages = (indices[::ps] // ps).contiguous()
            n_pages = len(pages)
        else:
            pages = _array("q", [int(i) // ps for i in indices[::ps]])
            n_pages = len(pages)
        # The admission runs under the lease of this request's match (or lock)
        # when one looked up a prefix of this key: no second lookup.
        lid, borrowed = self._borrow_lease(ids, n, ns)
        self._release_pending()  # nothing a match pinned may keep the admission from evicting
        matched = None
        try:
            if lid is not None:
                was_hit = self._borrowed_hit
                try:
                    admitted = self.cache._admit_i64(lid, ids, states, pages, n_pages)
                except MarconiError as e:
                    if e.name != "PREFIX_MISMATCH":
                        raise
                    admitted = None  # not this request's lease after all: nothing changed
                if admitted is None and borrowed == "pending":
                    self._release(lid)
                if admitted is None:
                    lid = None
            if lid is None:
                # The default limit (one token left), as the admission's hit; no page list.
                lid, was_hit, matched, _, _ = self._lookup(ids, n, ns, LOOKUP_NO_KV_PAGES)
                borrowed = None
                admitted = self.cache._admit_i64(lid, ids, states, pages, n_pages)
        finally:
            if lid is not None and borrowed != "locked":
                self._release(lid)
        taken_states, start, stop, truncated, rejected, taken = admitted
        # The tokens already cached before this insert (SGLang's prefix_len).
        if stop > start:
            prefix_len = start * ps
        elif not rejected and not truncated:
            prefix_len = n
        else:
            if matched is None:
                # Under a borrowed lease, and nothing taken: the tree as before.
                found = self._lookup(ids, n, ns, LOOKUP_NO_KV_PAGES)
                self._release(found[0])
                matched = found[2]
            prefix_len = min(matched, n)
        # The duplicates: positions the tree already held before this insert,
        # from prev_prefix_len on (before it, they are the tree's own). What
        # the cache did not take beyond them (no space) stays the caller's.
        if prev < prefix_len:
            if torch_value:
                self.token_to_kv_pool_allocator.free(value.reshape(-1)[prev:prefix_len])
            else:
                self.token_to_kv_pool_allocator.free(list(indices[prev:prefix_len]))
        self._give_back()
        if states and taken[0] and ps == 1 and stop > start and start == was_hit and stop == n:
            # The usual case (a conversation's next turn): the path is the hit's
            # KV then the indices just taken, and the state at its end is the one
            # just admitted: no second lookup.
            # The hit's page ids are fetched when asked for (path_device_indices).
            tail = _Tail(indices, was_hit)
            parts = ((None, was_hit), (tail, n - was_hit)) if was_hit else ((tail, n),)
            node = SGLangNode(self._next_id, ns, ids, n, parts, slot)
            self._next_id += 1
        else:
            node = self._node_for(ids, n, ns)
        result = self._InsertResult(
            prefix_len=prefix_len,
            total_len=n,
            last_device_node=node,
            mamba_exist=bool(states) and not taken[0],
        )
        # Leading positions of the key whose KV the tree now owns (the caller
        # must not free them): what was cached plus what the cache took.
        result.tree_kv_len = max(prefix_len, stop * ps if stop > start else 0)
        return result

    def _borrow_lease(self, ids: _array, n: int, ns: int) -> tuple:
        """The live lease of the newest unlocked match, else of the newest
        lock, whose lookup was of a prefix of ids[:n] in namespace ns (ends
        checked here, the whole prefix by the admission): (lease id,
        "pending" or "locked"), or (None, None). A pending lease leaves
        self._pending (the insert releases it); its hit is in
        self._borrowed_hit."""
        live = self.cache._live
        for group, nodes in (("pending", self._pending), ("locked", self._locked)):
            for node in reversed(nodes.values()):
                k = node.looked_up
                lid = node.lease
                if (
                    0 < k <= n
                    and node.namespace == ns
                    and lid is not None
                    and lid in live
                    and node.key[k - 1] == ids[k - 1]
                    and node.key[0] == ids[0]
                ):
                    if group == "pending":
                        del nodes[lid]
                        if node.lock_ref == 0:
                            node.lease = None
                    self._borrowed_hit = node.hit
                    return lid, group
                break  # only the newest of each: an older one is another request's
        return None, None

    def _node_for(self, ids: _array, n: int, ns: int) -> SGLangNode:
        found = self._lookup(ids, n, ns)
        try:
            return self._node(ids, ns, found)
        finally:
            self._release(found[0])

    def checkpoint(self, req: Any, *, up_to: int, **kwargs: Any) -> None:
        """A finished request: inserts its KV up to `up_to` with its Mamba
        state (the tree takes the slot, or it is freed), repoints its row onto
        the tree's KV, moves its lock onto the new node and advances
        cache_protected_len past all the KV the tree now owns.

        A running request (a chunk's checkpoint) is left as it is: libmarconi
        pins only prefixes that end at a state, so KV cached before the
        request ends would be evictable under the running request's row.
        Its KV and state are admitted when it finishes."""
        finished = bool(req.finished()) if callable(getattr(req, "finished", None)) else False
        if finished:
            self._checkpoint_finished(req, up_to)

    def _finished_state(self, req: Any, n_tokens: int) -> tuple:
        """The Mamba state a finished request hands to the tree, as SGLang's
        own Mamba component picks it: (position, slot, keep) where position
        is the number of tokens the state has consumed, slot its Mamba slot
        and keep the ping-pong entry holding it (None: the request's working
        slot, `no_buffer`); (0, None, None) when the request holds none that
        a key of n_tokens tokens can name.

        `no_buffer`: the working slot, after all n_tokens tokens.
        `extra_buffer`: the working slot may still be written by a forward in
        flight (overlap scheduling), so the state is the one SGLang tracked
        into a ping-pong slot: at `mamba_last_track_seqlen` (the prefill's
        end on the checkpoint grid, or the branch point this cache returned
        as `mamba_branching_seqlen`), else the previous tracked one
        (`mamba_prev_track_seqlen`, in the other entry) when the last ran
        past the key (SGLang's `_select_finished_checkpoint`)."""
        kv = getattr(req, "kv", req)
        if not self._extra_buffer:
            slot = getattr(kv, "mamba_pool_idx", None)
            return (n_tokens, slot, None) if slot is not None else (0, None, None)
        buf = getattr(kv, "mamba_ping_pong_track_buffer", None)
        keep = getattr(kv, "mamba_last_track_idx", None)
        if buf is None or keep is None:
            return 0, None, None
        pos = getattr(kv, "mamba_last_track_seqlen", None) or 0
        if pos > n_tokens:
            prev = getattr(kv, "mamba_prev_track_seqlen", None)
            if len(buf) != 2 or prev is None or prev > n_tokens:
                return 0, None, None
            pos, keep = prev, 1 - keep
        empty = getattr(kv, "mamba_ping_pong_empty", None)
        if pos <= 0 or (empty is not None and empty[keep]):
            return 0, None, None
        slot = int(buf[keep])
        return (pos, slot, keep) if slot >= 0 else (0, None, None)

    def _free_request_mamba(self, req: Any, keep: Optional[int] = None) -> None:
        """Frees the Mamba slots the request still holds (its working slot
        and, in `extra_buffer` mode, its ping-pong tracking slots except the
        entry `keep`, which the tree took) through SGLang's own
        `free_mamba_cache`, as SGLang's Mamba component does when it caches
        or releases a request."""
        kv = getattr(req, "kv", req)
        pool = self.req_to_token_pool
        holds = getattr(kv, "mamba_pool_idx", None) is not None
        if holds and hasattr(pool, "free_mamba_cache") and hasattr(kv, "mamba_ping_pong_track_buffer"):
            pool.free_mamba_cache(req, mamba_ping_pong_track_buffer_to_keep=keep) if self._extra_buffer else pool.free_mamba_cache(req)
            return
        if holds:
            self._free_slot(kv.mamba_pool_idx)
            kv.mamba_pool_idx = None
        buf = getattr(kv, "mamba_ping_pong_track_buffer", None)
        if buf is not None:
            # Tracking slots without a working slot (not a state SGLang makes):
            # each entry that holds a slot, but the kept one, goes back.
            empty = getattr(kv, "mamba_ping_pong_empty", None) or [False] * len(buf)
            for i in range(len(buf)):
                if i != keep and not empty[i] and int(buf[i]) >= 0:
                    self._free_slot(buf[i : i + 1])
            kv.mamba_ping_pong_track_buffer = None
            kv.mamba_ping_pong_empty = None

    def _checkpoint_finished(self, req: Any, up_to: int) -> None:
        kv = getattr(req, "kv", req)
        ids = getattr(req, "full_untruncated_fill_ids", None)
        if ids is None or not len(ids):
            ids = _i64_ids(req.origin_input_ids) + _i64_ids(getattr(req, "output_ids", None) or ())
        tokens = _key_ids(ids)[:up_to]
        ps = self.page_size
        pos, slot, keep = self._finished_state(req, len(tokens))
        if self._extra_buffer:
            # As SGLang's cache: the key ends at the tracked state (its KV
            # past it is the request's to free).
            tokens = tokens[:pos]
        n = (len(tokens) // ps) * ps
        protected = int(getattr(kv, "cache_protected_len", 0) or 0)
        if self.disable or n <= protected:
            self._free_request_mamba(req)
            return
        row = self.req_to_token_pool.req_to_token[kv.req_pool_idx]
        values = row[:n]
        # The state is the one after `pos` tokens: offered only when that is
        # the key's end on a page boundary (libmarconi keeps states at page ends).
        offer = slot is not None and pos == n
        key = _Key(tokens[:n], getattr(req, "extra_key", None))
        ref = getattr(kv, "mamba_pool_idx", None)
        result = self.insert(_Insert(key, values, _like(ref if type(ref).__module__.startswith("torch") else None, [int(slot)]) if offer else None, protected))
        taken = offer and not result.mamba_exist
        if taken and keep is None:
            kv.mamba_pool_idx = None  # `no_buffer`: the working slot is the tree's now
        else:
            self._free_request_mamba(req, keep if taken else None)
        node = result.last_device_node
        owned_by_tree = max(protected, result.tree_kv_len)
        # The row reads the tree's KV where the tree kept its own copy (and
        # freed the request's duplicate).
        h = min(node.hit_tokens, owned_by_tree)
        if h > protected:
            new = self.path_device_indices(node)[protected:h]
            row[protected:h] = new if isinstance(row, list) else _like(values, list(new)) if not hasattr(new, "to") else new.to(row.dtype)
        old = getattr(req, "lock", None)
        new_lock = self.lock(node)
        self.unlock(old)
        req.lock = new_lock
        req.last_node = node
        kv.cache_protected_len = owned_by_tree
        if hasattr(kv, "cache_inserted_len"):
            kv.cache_inserted_len = max(kv.cache_inserted_len, n)

    def cache_unfinished_req(self, req: Any, **kwargs: Any) -> None:
        """Older SGLang's name for a checkpoint of a running request."""
        ids = getattr(req, "fill_ids", None) or list(req.origin_input_ids) + list(getattr(req, "output_ids", []) or [])
        self.checkpoint(req, up_to=len(ids))  # a running request: see checkpoint

    def cache_finished_req(self, req: Any, is_insert: bool = True, **kwargs: Any) -> None:
        """Older SGLang's name for releasing a finished request's row
        (SGLang 0.5.23's release_kv_cache): checkpoint it when `is_insert`,
        free the KV the tree did not take, drop the lock."""
        kv = getattr(req, "kv", req)
        ids = getattr(req, "fill_ids", None) or list(req.origin_input_ids) + list(getattr(req, "output_ids", []) or [])
        owned = len(ids)
        if is_insert:
            self._checkpoint_finished(req, owned)
        protected = int(getattr(kv, "cache_protected_len", 0) or 0)
        self.free_kv_row(kv, [(protected, owned)])
        self.unlock(getattr(req, "lock", None))
        req.lock = None
        self._free_request_mamba(req)

    def _free_slot(self, slot: Any) -> None:
        if self._mamba_allocator is not None:
            ref = slot if type(slot).__module__.startswith("torch") else None
            self._mamba_allocator.free(_like(ref, [int(slot)]))

    def path_device_indices(self, node: Any) -> Any:
        """The node's KV indices: an int64 tensor on the pools' device (a
        list with list pools), joined from the buffers they came in."""
        if node.indices is not None:
            return node.indices
        ref = getattr(self, "_index_ref", None)
        ps = self.page_size
        if node.parts is None or any(ids is None for ids, _ in node.parts):
            pages = self._node_pages(node)
            got = len(pages) * ps
            if node.parts is None:
                node.parts = ((pages, min(got, node.hit)),)
            else:
                node.parts = tuple((pages, min(c, got)) if ids is None else (ids, c) for ids, c in node.parts)
                if got < node.parts[0][1]:  # evicted since: only what is still cached
                    node.parts = node.parts[:1]
        if ref is not None and type(ref).__module__.startswith("torch"):
            import torch

            dev = ref.device
            tensors = []
            for ids, count in node.parts:
                if ids.__class__ is _array:  # page ids (uint32) from the library
                    t = torch.frombuffer(ids, dtype=torch.int32).to(torch.int64) if len(ids) else torch.empty(0, dtype=torch.int64)
                    if ps > 1:
                        t = (t[:, None] * ps + torch.arange(ps)).reshape(-1)
                    t = t[:count].to(dev)
                else:
                    t = ids[:count]
                    if not hasattr(t, "to"):  # an array('q') or list of indices
                        t = torch.tensor(t, dtype=torch.int64) if t.__class__ is list else torch.frombuffer(t, dtype=torch.int64) if len(t) else torch.empty(0, dtype=torch.int64)
                    t = t.to(device=dev, dtype=torch.int64)
                tensors.append(t)
            out = torch.cat(tensors) if tensors else torch.empty(0, dtype=torch.int64, device=dev)
        else:
            out = []
            for ids, count in node.parts:
                if ids.__class__ is _array and ids.typecode == "I":
                    ids = _pages_to_indices(ids, ps, count)
                out += ids[:count].tolist() if hasattr(ids, "tolist") else list(ids[:count])
        node.indices = out
        return out

    def prefix_device_indices(self, req: Any) -> Any:
        path = self.path_device_indices(req.last_node)
        if len(path) < req.prefix_len:
            raise ValueError(f"request {getattr(req, 'rid', '?')}: prefix_len {req.prefix_len} beyond its node ({len(path)})")
        return path[: req.prefix_len]

    def free_kv_row(self, kv: Any, ranges: list) -> None:
        row = self.req_to_token_pool.req_to_token[kv.req_pool_idx]
        for start, end in ranges:
            if end > start:
                self.token_to_kv_pool_allocator.free(row[start:end])

    def maybe_hand_to_session(self, req: Any) -> None:
        pass

    def claim_kv_row(self, req: Any) -> bool:
        return False

    def on_release(self, req: Any, *, checkpointed: bool) -> None:
        """SGLang's release_kv_cache, after the row is freed and the lock
        dropped. A request released without caching (abort, retraction, an
        output that is not kept) gives back the Mamba slots it still holds,
        its working slot and any ping-pong tracking slots, as SGLang's own
        cache does; a cached one gave them back (or to the tree) at its
        checkpoint."""
        if not checkpointed:
            self._free_request_mamba(req)

    # -- eviction -------------------------------------------------------------------

    def _give_back(self) -> tuple[int, int]:
        """Hands the KV indices and Mamba slots libmarconi freed to SGLang's
        allocators; returns (tokens, slots) handed back. The ids are read
        in place from the drain's buffer into one tensor (page ids times the
        page size plus each page's offsets, in one broadcast), never through
        a Python object per id."""
        pages, n_pages, slots, n_slots = self.cache._drain_freed_raw()
        if not n_pages and not n_slots:
            return 0, 0
        ps = self.page_size
        ref = getattr(self, "_index_ref", None)
        if ref is not None and type(ref).__module__.startswith("torch"):
            import torch

            def ids(buf: Any, n: int, step: int) -> Any:
                # uint32 ids, read as int32 and widened without sign.
                t = torch.frombuffer(buf, dtype=torch.int32, count=n).to(torch.int64) & 0xFFFFFFFF
                if step > 1:
                    t = (t[:, None] * step + torch.arange(step, dtype=torch.int64)).reshape(-1)
                return t.to(ref.device)

            if n_pages:
                self.token_to_kv_pool_allocator.free(ids(pages, n_pages, ps))
            if n_slots:
                self._mamba_allocator.free(ids(slots, n_slots, 1))
        else:
            if n_pages:
                got = _array("I")
                got.frombytes(ctypes.string_at(pages, 4 * n_pages))
                self.token_to_kv_pool_allocator.free(list(_pages_to_indices(got, ps, n_pages * ps)))
            if n_slots:
                self._mamba_allocator.free(list(slots[:n_slots]))
        return n_pages * ps, n_slots

    def evict(self, params: Any) -> Any:
        """Evicts at least params.num_tokens tokens of KV and params.mamba_num
        Mamba states (as SGLang counts them: amounts to free, not targets),
        or all that is evictable; libmarconi picks what (FLOP-aware)."""
        self._release_pending()
        want_kv = max(0, int(getattr(params, "num_tokens", 0) or 0))
        want_states = max(0, int(getattr(params, "mamba_num", 0) or 0))
        got_kv = got_states = 0
        # Each round frees at least one node or stops: bounded by the node count.
        for _ in range(self.cache.stats()["nodes"] + 1):
            if got_kv >= want_kv and got_states >= want_states:
                break
            s = self.cache.stats()
            free = s["capacity_bytes"] - s["used_bytes"]
            need = max(want_kv - got_kv, 0) * self._kv_bpt + max(want_states - got_states, 0) * self._state_b
            self.cache.evict(min(free + max(need, 1), U64_MAX))
            k, m = self._give_back()
            if k == 0 and m == 0:
                break
            got_kv += k
            got_states += m
        return self._EvictResult(num_tokens_evicted=got_kv, mamba_num_evicted=got_states)

    def evict_for_alloc(self, params: Any, *, allocation_reclaim_satisfied: Optional[Callable[[], bool]] = None) -> Any:
        if allocation_reclaim_satisfied is not None:
            raise NotImplementedError("libmarconi's cache does not support joint reclaim")
        return self.evict(params)

    # -- sizes and diagnostics ----------------------------------------------------------

    def _split(self) -> tuple[int, int, int, int]:
        """(evictable KV tokens, protected KV tokens, evictable states,
        protected states), exact under any number of locks: libmarconi
        counts what no lease pins, and what the locks pin is the union of
        their paths (a prefix under several locks counts once, separate
        prefixes add up). Leases of matches not locked yet are released
        first: SGLang's match pins nothing, so what they pin is evictable."""
        self._release_pending()
        s = self.cache.stats()
        kv = s["kv_bytes"] // self._kv_bpt
        ev_kv, ev_states = s["evictable_kv_tokens"], s["evictable_states"]
        return ev_kv, kv - ev_kv, ev_states, s["states"] - ev_states

    def full_evictable_size(self) -> int:
        return self._split()[0]

    def evictable_size(self) -> int:
        return self.full_evictable_size()

    def mamba_evictable_size(self) -> int:
        return self._split()[2]

    def protected_size(self) -> int:
        return self._split()[1]

    def full_protected_size(self) -> int:
        return self._split()[1]

    def mamba_protected_size(self) -> int:
        return self._split()[3]

    def swa_evictable_size(self) -> int:
        return 0

    def swa_protected_size(self) -> int:
        return 0

    def swa_transient_size(self) -> int:
        return 0

    def total_size(self) -> tuple[int, int]:
        s = self.cache.stats()
        return s["kv_bytes"] // self._kv_bpt, s["states"]

    def available_and_evictable_str(self) -> str:
        avail = self.token_to_kv_pool_allocator.available_size()
        ev = self.full_evictable_size()
        m_avail = self._mamba_allocator.available_size()
        m_ev = self.mamba_evictable_size()
        return (
            f"Available full tokens: {avail + ev} (full_available_size={avail} + full_evictable_size_={ev})\n"
            f"Available mamba: {m_avail + m_ev} (available_size={m_avail} + component_evictable_size_={m_ev})\n"
        )

    def sanity_check(self) -> None:
        """libmarconi's own invariant check, plus: the cache never holds more
        KV or states than SGLang's pools."""
        self.cache.check()
        kv, slots = self._pool_sizes()
        total_kv, states = self.total_size()
        if total_kv > kv or states > slots:
            raise AssertionError(f"cache holds {total_kv} KV tokens / {states} states, pools {kv} / {slots}")

    def pretty_print(self) -> None:
        print(self.cache.stats())

    def init_metrics_collector(self) -> None:
        """libmarconi keeps its own counters (pretty_print, PrefixCache.stats)."""

    def update_eviction_metrics(self, num_evicted: int, start_time: float) -> None:
        pass

    def take_events(self) -> list:
        return []

    def flush_pending_backups(self) -> None:
        pass

    def release_host_resources(self) -> None:
        pass

    def release_aborted_request(self, handle: Any) -> None:
        pass

    def finish(self, handle: Any, outcome: Any) -> None:
        pass

    # -- tiers libmarconi's SGLang cache has none of (no host tier, no storage,
    # no sliding windows): what SGLang's base class answers for a cache without them.

    def init_load_back(self, params: Any) -> Any:
        raise NotImplementedError("libmarconi's SGLang cache has no host tier")

    def load_back_is_cache_owned(self) -> bool:
        return True

    def finish_storage_prefetch_admission(self, handle: Any, fulfilled_tokens: int, reason: Optional[str]) -> None:
        pass

    def discard_storage_prefetch_accounting(self, handle: Any) -> None:
        pass

    def waiting_storage_span(self, request: Any) -> None:
        return None

    def pop_prefetch_loaded_span(self, handle: Any) -> tuple[int, None]:
        return 0, None

    def ready_to_load_host_cache(self) -> Any:
        raise NotImplementedError("libmarconi's SGLang cache has no host tier")

    def check_hicache_events(self) -> Any:
        raise NotImplementedError("libmarconi's SGLang cache has no host tier")

    @property
    def swa_retain_window(self) -> None:
        return None

    def evict_sliding_windows(self, req: Any, pre_len: int, *, eviction_interval: int = 1) -> None:
        pass

    def release_session(self, session_id: str) -> None:
        pass

    def release_radix_session(self, session_id: str) -> None:
        pass

    def session_records(self) -> dict:
        return {}


@dataclass
class _Key:
    token_ids: list
    extra_key: Any = None


@dataclass
class _Evict:
    num_tokens: int
    mamba_num: int


@dataclass
class _Insert:
    key: Any
    value: Any
    mamba_value: Any
    prev_prefix_len: int


FALLBACK_MODEL = "paper-7b"
"""The preset the SGLang factory falls back to when the served model's
config cannot be read (it says so in the log)."""


def sglang_model(ctx: Any) -> Any:
    """The served model as libmarconi describes it (its KV and state byte
    sizes, the FLOPs eviction weighs): SGLang's model config
    (ctx.model_config.hf_config, the model's Hugging Face config) read by
    libmarconi's own reader (ModelSpec.from_hf_config). Where that fails (no
    config, a model type the reader does not know), the FALLBACK_MODEL
    preset, with a warning in the `marconi` log that says why."""
    import logging

    from .model import ModelSpec

    mc = getattr(ctx, "model_config", None)
    hf = getattr(mc, "hf_text_config", None) or getattr(mc, "hf_config", None)
    if hf is None:
        why = "SGLang gave no model config"
    else:
        try:
            return ModelSpec.from_hf_config(hf)
        except (MarconiError, TypeError, ValueError, OSError) as e:
            why = f"its config does not read ({e})"
            if hf is not getattr(mc, "hf_config", hf):
                try:
                    return ModelSpec.from_hf_config(mc.hf_config)
                except (MarconiError, TypeError, ValueError, OSError) as e2:
                    why = f"its config does not read ({e2})"
    logging.getLogger("marconi").warning(
        "libmarconi's SGLang cache: %s; sizing and eviction use the %r preset instead", why, FALLBACK_MODEL
    )
    return FALLBACK_MODEL


def sglang_factory(ctx: Any) -> SGLangTreeCache:
    """SGLang's RadixCacheFactory: builds the cache from a
    TreeCacheBuildContext (its CacheInitParams and pools), for the served
    model (sglang_model: SGLang's model config, else a logged preset)."""
    if not getattr(ctx, "is_hybrid_ssm", True):
        raise NotImplementedError("libmarconi's SGLang cache is for hybrid (Mamba) models")
    return SGLangTreeCache(ctx.params, sglang_model(ctx))


def register_with_sglang(name: str = "marconi") -> None:
    """Registers the cache with SGLang (register_radix_cache_backend), so
    that `--radix-cache-backend marconi` selects it.

    The installed package declares this function as an SGLang general
    plugin (entry point group `sglang.srt.plugins`), which SGLang 0.5.23's
    `load_plugins()` runs early in every process (engine, scheduler): once
    `marconi` is installed, the flag alone selects it. Calling it again (by
    hand as well as through the plugin) is a no-op; a name registered to
    another factory is SGLang's error."""
    from sglang.srt.mem_cache.registry import get_radix_cache_factory, register_radix_cache_backend

    if get_radix_cache_factory(name) is sglang_factory:
        return
    register_radix_cache_backend(name, sglang_factory)
