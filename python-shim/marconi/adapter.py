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

from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Optional

from ._convert import U64_MAX, Tokens, _u32_concat, _uint
from .cache import AdmitResult, Lease, PrefixCache


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
    libmarconi (see the module docstring for the mapping)."""

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
