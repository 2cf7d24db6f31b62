"""The Pythonic API over the C ABI: PrefixCache, Lease, MarconiError."""

from __future__ import annotations

import array
import ctypes
import json
import struct
from _thread import get_ident as _get_ident
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Union

from . import _lib
from ._convert import (  # noqa: F401 (U64_MAX, _uint: imported from here by the adapter)
    U32_MAX,
    U64_MAX,
    OutOfRangeError,
    Tokens,
    _u32,
    _u32_concat,
    _states_array,
    _u32_arg,
    _u32_pointer,
    _u32_source,
    _flag,
    _real,
    _u64,
    _uint,
)
from ._errors import STATUS_NAMES, MarconiError, _check, _config, last_error, status_message, version  # noqa: F401 (re-exported)
from ._handle import _Handle, _Unique
from ._lib import NO_SLOT

if TYPE_CHECKING:
    from .pool import Pools
    from .tiered import Tiers

_array = array.array
_U32 = ctypes.c_uint32
_Lookup = _lib.marconi_lookup
_ZERO_U32 = (0,)
_AdmitRaw = _lib.marconi_admit_result
_SavedState = _lib.marconi_saved_state
_ADMIT_FIELDS = struct.Struct("=6I?")
"""The fields of marconi_admit_result, read in one call."""
assert _ADMIT_FIELDS.size <= ctypes.sizeof(_AdmitRaw)
_LOOKUP_FIELDS = struct.Struct("=Q8I")
"""The fields of marconi_lookup (copy_order's two slots last), read in one call."""
assert _LOOKUP_FIELDS.size == ctypes.sizeof(_Lookup)
_new = object.__new__
_setattr = object.__setattr__

def _saved_states(states: Iterable) -> tuple[Any, int]:
    """(marconi_saved_state array or None, k) for the (position, slot)
    pairs `states` (slot None: MARCONI_NO_SLOT), every value checked. One
    pair of plain ints in a list or tuple (an engine's usual final state) is
    checked here and built as one struct; anything else goes through
    _states_array, whose errors name states[i].position or .slot."""
    if (states.__class__ is list or states.__class__ is tuple) and len(states) == 1:
        pair = states[0]
        if pair.__class__ is tuple and len(pair) == 2:
            p, s = pair
            if p.__class__ is int and 0 <= p <= U32_MAX:
                if s is None:
                    return _SavedState(p, NO_SLOT), 1
                if s.__class__ is int and 0 <= s <= U32_MAX:
                    return _SavedState(p, s), 1
    flat = _states_array(states)  # (position, slot) pairs: the layout of marconi_saved_state
    k = len(flat) >> 1
    return ((_SavedState * k).from_buffer_copy(flat) if k else None), k


def _model_into(target: Any, model: Any) -> Any:
    """Sets a struct's model_preset / model fields from a preset name or a
    dict of marconi_model_spec fields; returns what must stay alive."""
    if isinstance(model, str):
        if "\0" in model:
            raise ValueError(f"model: a preset name cannot contain NUL: {model!r}")
        keep = model.encode()
        target.model_preset = keep
        return keep
    if isinstance(model, Mapping):
        fields = dict(_lib.marconi_model_spec._fields_)
        for k, v in model.items():
            if k not in fields:
                raise ValueError(f"model: unknown model field {k!r}")
            hi = U32_MAX if fields[k] is ctypes.c_uint32 else U64_MAX
            setattr(target.model, k, _uint(v, f"model.{k}", hi))
        target.model_preset = None
        return None
    raise TypeError(f"model: expected a preset name or a dict of model fields, got {type(model).__name__}")


ADMISSION = {"marconi": 0, "all_blocks": 1, "oracle": 2}
EVICTION = {"lru": 0, "flop_aware": 1}
OBJECTIVE = {"flops_saved": 0, "token_hits": 1}
ADOPTION = {"when_ready": 0, "deterministic": 1}


@dataclass(frozen=True)
class AdmitResult:
    """What marconi_cache_admit did."""

    states_taken: int
    """States the cache took (their slots are now the cache's)."""
    slots_returned: int
    """Offered slots the cache did not take (still the engine's)."""
    kv_pages_taken: range
    """Indices into the admitted page list of the pages the cache took."""
    new_kv_tokens: int
    """Tokens of KV newly cached."""
    truncated_to: Optional[int]
    """Only this many leading tokens were cached (lack of space), or None."""
    rejected: bool
    """Nothing was cached: not even a prefix fits."""
    taken: list[bool]
    """taken[i]: the i-th offered state was taken."""


class Lease(_Unique):
    """The result of a lookup, pinning what the request reuses until
    released. A context manager: leaving the `with` block releases it (if not
    released already). Not copyable: it is one pin, released once."""

    _NOT_COPIED = "it is one pin of a cache, released once"
    _NOT_PICKLED = "it is only valid in the process and cache that made it"

    def __init__(self, cache: "PrefixCache", raw: Any, kv_pages: list[int], plan: list[int], input_len: int = 0):
        lid, hit, kv, slot, _, _, n_copy, src, dst = _LOOKUP_FIELDS.unpack_from(raw)
        self._cache = cache
        self.id: int = lid
        """The lease id (never reused, never valid in another cache)."""
        self.input_len: int = input_len
        """Tokens looked up (the input's length)."""
        self.hit_tokens: int = hit
        """Leading tokens the engine may skip (< input length)."""
        self.kv_matched_tokens: int = kv
        """Leading tokens whose KV is cached (hit or not)."""
        self.state_slot: Optional[int] = None if slot == NO_SLOT else slot
        """The cached state slot to resume from, or None."""
        self.copy_order: Optional[tuple[int, int]] = (src, dst) if n_copy else None
        """(src_slot, dst_slot) to copy before resuming, or None."""
        self.kv_pages: list[int] = kv_pages
        """KV page ids of the first hit_tokens tokens (when pages are tracked)."""
        self.plan: list[int] = plan
        """Positions at which to save recurrent states during this prefill."""

    @property
    def released(self) -> bool:
        """True once released, whether through this object, by its id
        (PrefixCache.release(lease.id)), or by closing the cache."""
        cache = self._cache
        return cache._closing or self.id not in cache._live

    def admit(self, tokens: Tokens, states: Iterable = (), kv_pages: Optional[Tokens] = None) -> AdmitResult:
        """PrefixCache.admit under this lease."""
        return self._cache.admit(self, tokens, states, kv_pages)

    def release(self) -> None:
        """Releases the lease (PrefixCache.release)."""
        self._cache.release(self)

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, *exc) -> None:
        cache = self._cache
        if not cache._closing and self.id in cache._live:
            cache._release(self.id)

    def _release_if_live(self) -> None:
        """Releases the lease unless it is released already."""
        cache = self._cache
        if not cache._closing and self.id in cache._live:
            cache._release(self.id)

    def __repr__(self) -> str:
        return (
            f"Lease(id={self.id}, hit_tokens={self.hit_tokens}, "
            f"kv_matched_tokens={self.kv_matched_tokens}, state_slot={self.state_slot}, "
            f"plan={self.plan})"
        )


class PrefixCache(_Handle):
    """A libmarconi prefix cache (marconi_cache). Safe to share between
    threads (the library locks internally; ctypes releases the GIL during
    calls). Close it with close() or a `with` block; close() waits for the
    calls other threads have in flight (close(timeout=...) gives up with
    TimeoutError and leaves the freeing to the last of them), marks every
    Lease released, and later calls raise ValueError. Not copyable or
    picklable (it owns the native cache).

    model: a preset name ("paper-7b", "jamba-1.5-mini", "nemotron-h-8b", ...)
    or a dict of marconi_model_spec fields. alpha: None for online tuning,
    or a fixed float. tuner_adoption: "when_ready" (the default: a request
    never waits for the background alpha search, it adopts the result once
    it is done) or "deterministic" (adopted at a fixed request, waiting for
    the search there: the same trace gives the same decisions on any
    machine, as marconi-core's PrefixCache and the simulator do).

    policy: None, or a policy preset ("marconi", "marconi-paper",
    "marconi-tuned", "marconi-shadow", "sglang-plus", "vllm-plus";
    marconi_cache_config_preset) whose fields the other policy arguments
    then override; every policy argument left at None keeps the preset's
    value (the library's default without a preset). min_branch_depth:
    the shallowest prefix treated as shared (tokens): no branch checkpoint
    and no branch protection shallower. superseded_age: how many mean turn
    gaps older than its last use a state counts once the request that
    resumed from it takes a deeper state below it (FLOP-aware eviction;
    default 1, 0 the paper's rule).
    Tuning: tuner_grid,
    tuner_objective, tuner_bootstrap_factor, tuner_min_window,
    tuner_max_window (0: no limit), tuner_retune, tuner_retune_every,
    tuner_retune_neighbours, tuner_apply_after, tuner_min_gain,
    tuner_tune_rules (also tune the eviction rules; on by default, ignored
    with a fixed alpha); shadows: True (shadow caches with the default
    settings), False, or a dict of shadow settings
    (alphas, tuned, lru, half_life, hysteresis, exact_bytes, sample_tokens;
    the marconi_cache_config shadow_* fields) that turns them on. A value
    the library refuses raises MarconiError (INVALID_CONFIG) with its
    reason.

    tiers: a marconi.Tiers (or a dict of its fields): lower tiers below the
    cache (lookup_tiered and the other tier methods). pools: a marconi.Pools
    (or a dict of its fields): the cache lives in the library's pools
    (capacity_bytes may then be left out, and is ignored: the pools' budget
    is the capacity) and runs the request cycle over unit handles with
    lookup_pooled, reserve, copy_states, admit_pooled, free_units, release
    and drain_freed_units; lookup, admit, drain_freed and evict, over ids
    the engine owns, raise MarconiError (UNSUPPORTED) on it. Both: tiers
    below the pools, written through (Tiers(write="through"); write-back
    and defer_moves are INVALID_CONFIG: an eviction's copy would read units
    the same reserve hands out). lookup_pooled then gives the hit of every
    tier: carry out lease_loads(lease) into reserved units; after
    admit_pooled, carry out drain_ops() (a host "write" copies a chain of
    that admission: the state in the slot given for its position, the KV
    in its first ceil(position / page_size) pages) before free_units.

    Every integer argument is checked against its C type before the call
    (ctypes would silently wrap it: namespace 2**64 + 1 would be namespace
    1): TypeError for a bool, float or other non-integer, an OverflowError
    that is also a ValueError for a value out of range (negative, or above
    UINT32_MAX / UINT64_MAX), both naming the argument.
    """

    _WHAT = "cache"
    _FREE = "marconi_cache_free"
    _NOT_COPIED = "it owns its native cache (share the object instead)"
    _NOT_PICKLED = "it owns a native cache of this process"

    def __init__(
        self,
        capacity_bytes: Optional[int] = None,
        model: Union[str, dict] = "paper-7b",
        *,
        page_size: int = 1,
        checkpoint_grid: int = 1,
        admission: Optional[str] = None,
        block_size: Optional[int] = None,
        eviction: Optional[str] = None,
        alpha: Optional[float] = None,
        tuner_grid: Optional[Sequence[float]] = None,
        tuner_objective: Optional[str] = None,
        tuner_threads: int = 0,
        tuner_adoption: str = "when_ready",
        decision_log: bool = False,
        protect_branch_states: Optional[bool] = None,
        min_branch_depth: Optional[int] = None,
        superseded_age: Optional[float] = None,
        policy: Optional[str] = None,
        tuner_bootstrap_factor: Optional[int] = None,
        tuner_min_window: Optional[int] = None,
        tuner_max_window: Optional[int] = None,
        tuner_retune: Optional[bool] = None,
        tuner_retune_every: Optional[int] = None,
        tuner_retune_neighbours: Optional[int] = None,
        tuner_apply_after: Optional[int] = None,
        tuner_min_gain: Optional[float] = None,
        tuner_tune_rules: Optional[bool] = None,
        shadows: Union[None, bool, Mapping] = None,
        tiers: Union[None, "Tiers", Mapping] = None,
        pools: Union[None, "Pools", Mapping] = None,
    ):
        # The guard first, so that close() (from __del__) works on an object
        # whose __init__ raised.
        self._guard_init()
        self._live: set = set()
        """Ids of the leases this object handed out and has not released
        (cleared by close(); Lease.released reads it)."""
        lib = _lib.load()
        if policy is None:
            cfg = _config(lib, _lib.marconi_cache_config)
        elif isinstance(policy, str) and "\0" not in policy:
            cfg = _lib.marconi_cache_config()
            st = lib.marconi_cache_config_preset(ctypes.byref(cfg), ctypes.sizeof(cfg), policy.encode())
            _check(st, "marconi_cache_config_preset")
        else:
            raise TypeError(f"policy: expected a preset name, got {policy!r}")
        keep = _model_into(cfg, model)
        for name, value, known in (
            ("admission", admission, ADMISSION),
            ("eviction", eviction, EVICTION),
            ("tuner_objective", tuner_objective, OBJECTIVE),
        ):
            if value is not None and value not in known:
                raise ValueError(f"{name}: expected one of {sorted(known)}, got {value!r}")
        if tuner_adoption not in ADOPTION:
            raise ValueError(f"tuner_adoption: expected one of {sorted(ADOPTION)}, got {tuner_adoption!r}")
        if capacity_bytes is None:
            if pools is None:
                raise TypeError("capacity_bytes is required unless pools= is given (the pools' budget is then the capacity)")
            capacity_bytes = 0
        cfg.capacity_bytes = _u64(capacity_bytes, "capacity_bytes")
        cfg.page_size = page_size = _u32(page_size, "page_size")
        cfg.checkpoint_grid = _u32(checkpoint_grid, "checkpoint_grid")
        if admission is not None:
            cfg.admission = ADMISSION[admission]
        if eviction is not None:
            cfg.eviction = EVICTION[eviction]
        if tuner_objective is not None:
            cfg.tuner_objective = OBJECTIVE[tuner_objective]
        cfg.decision_log = _flag(decision_log, "decision_log")
        cfg.tuner_threads = _u32(tuner_threads, "tuner_threads")
        cfg.tuner_adoption = ADOPTION[tuner_adoption]
        for name, value, conv in (
            ("block_size", block_size, _u32),
            ("protect_branch_states", protect_branch_states, _flag),
            ("min_branch_depth", min_branch_depth, _u32),
            ("superseded_age", superseded_age, _real),
            ("tuner_bootstrap_factor", tuner_bootstrap_factor, _u32),
            ("tuner_min_window", tuner_min_window, _u32),
            ("tuner_max_window", tuner_max_window, _u32),
            ("tuner_retune", tuner_retune, _flag),
            ("tuner_retune_every", tuner_retune_every, _u32),
            ("tuner_retune_neighbours", tuner_retune_neighbours, _u32),
            ("tuner_apply_after", tuner_apply_after, _u32),
            ("tuner_min_gain", tuner_min_gain, _real),
            ("tuner_tune_rules", tuner_tune_rules, _flag),
        ):
            if value is not None:
                setattr(cfg, name, conv(value, name))
        if alpha is not None:
            cfg.alpha_mode = 0
            cfg.alpha = _real(alpha, "alpha")
        elif policy is None:
            cfg.alpha_mode = 1
        shadow_alphas = None
        if shadows is not None:
            if isinstance(shadows, Mapping):
                settings = dict(shadows)
                cfg.shadows = 1
            else:
                settings = {}
                cfg.shadows = _flag(shadows, "shadows")
            for k, v in settings.items():
                if k == "alphas":
                    values = [_real(x, f"shadows['alphas'][{i}]") for i, x in enumerate(v)]
                    shadow_alphas = (ctypes.c_double * len(values))(*values)
                    cfg.shadow_alphas = ctypes.cast(shadow_alphas, ctypes.POINTER(ctypes.c_double))
                    cfg.shadow_alphas_len = len(values)
                elif k in ("tuned", "lru"):
                    setattr(cfg, f"shadow_{k}", _flag(v, f"shadows[{k!r}]"))
                elif k in ("half_life", "sample_tokens"):
                    setattr(cfg, f"shadow_{k}", _u32(v, f"shadows[{k!r}]"))
                elif k == "exact_bytes":
                    cfg.shadow_exact_bytes = _u64(v, "shadows['exact_bytes']")
                elif k == "hysteresis":
                    cfg.shadow_hysteresis = _real(v, "shadows['hysteresis']")
                else:
                    raise ValueError(f"shadows: unknown setting {k!r}")
        grid = None
        if tuner_grid is not None:
            values = [_real(x, f"tuner_grid[{i}]") for i, x in enumerate(tuner_grid)]
            grid = (ctypes.c_double * len(values))(*values)
            cfg.tuner_grid = ctypes.cast(grid, ctypes.POINTER(ctypes.c_double))
            cfg.tuner_grid_len = len(values)
        opts = None
        if tiers is not None:
            from .tiered import _tiers

            opts = _tiers(dict(tiers) if isinstance(tiers, Mapping) else tiers)._options(lib)
            cfg.tiers = ctypes.pointer(opts)
        popts = None
        self.backend: Optional[str] = None
        """With pools: their backend ("memfd", "none", "cuda")."""
        if pools is not None:
            from .pool import _pools

            p = _pools(dict(pools) if isinstance(pools, Mapping) else pools)
            popts = p._config()
            cfg.pools = ctypes.pointer(popts)
            self.backend = p.backend
        handle = ctypes.c_void_p()
        _check(lib.marconi_cache_new(ctypes.byref(cfg), ctypes.byref(handle)), "marconi_cache_new")
        del opts, popts, keep  # read only during marconi_cache_new
        # With pools, views of their units share the native cache (it is
        # freed with the last of them).
        self._adopt(lib, handle, views=pools is not None)
        self.page_size = page_size
        self.has_tiers = tiers is not None
        """Whether the cache has lower tiers (the tier methods need them)."""
        self.has_pools = pools is not None
        """Whether the cache lives in the library's pools (the pool methods
        need them; lookup, admit and drain_freed, over ids the engine owns,
        refuse)."""

    # -- lifetime (_Handle) ----------------------------------------------
    #
    # The hot paths below inline _begin() and _end(): append this thread's
    # ident to self._calls, then read self._closing; after the call, remove
    # the ident, then read self._closing again (see marconi._handle).

    def _on_close(self) -> None:
        self._live.clear()  # every Lease now reads as released: the library drops them with the cache

    @property
    def handle(self) -> ctypes.c_void_p:
        """The raw marconi_cache pointer (for passing to other C code, which
        must be done with it before close() is called)."""
        with self._state:
            if self._closing:
                raise ValueError("the cache is closed")
            return self._handle

    # -- the request cycle -----------------------------------------------

    def lookup(
        self,
        tokens: Tokens,
        namespace: int = 0,
        dst_slot: Optional[int] = None,
        checkpoints: Optional[Tokens] = None,
    ) -> Lease:
        """Looks up `tokens` (see Tokens for the accepted forms: a uint32 or
        int32 buffer is read in place): the usable hit, the KV pages and
        plan, and a lease (release it, or use it as a context manager). With
        `dst_slot` (the request's own state slot) the lease carries the copy
        order when the hit resumes from a cached slot.

        `checkpoints`: application checkpoint hints, positions of `tokens`
        later requests are expected to share (the end of a system prompt,
        of tool definitions, of a document; marconi_cache_lookup_hinted).
        Each is rounded down to the checkpoint grid and added to the plan
        when above the hit, within the input and not already cached; others
        are dropped silently."""
        ns = namespace if namespace.__class__ is int and 0 <= namespace <= U64_MAX else _u64(namespace, "namespace")
        dst = NO_SLOT if dst_slot is None else _u32(dst_slot, "dst_slot")
        if checkpoints is not None:
            src, n = _u32_source(tokens)
            return self._lookup(src, n, ns, dst, _u32_source(checkpoints, "checkpoints"))
        if tokens.__class__ is _array and tokens.typecode == "I":
            return self._lookup(tokens, len(tokens), ns, dst)
        src, n = _u32_source(tokens)
        return self._lookup(src, n, ns, dst)

    def _lookup(self, src: Any, n: int, ns: int, dst: int, hints: Optional[tuple] = None) -> Lease:
        """lookup() of the first n tokens of a _u32_source() result, with
        the hints of a _u32_source() result if given."""
        raw = _Lookup()
        lib = self._lib
        calls = self._calls
        ident = _get_ident()
        calls.append(ident)  # _begin(), inlined
        try:
            if self._closing:
                raise ValueError("the cache is closed")
            h = self._handle
            # The pointer exports the buffer (it cannot be resized under the call,
            # which runs without the GIL) until it is dropped right after the call.
            ptr = _U32.from_buffer(src) if src.__class__ is _array and n else _u32_arg(src, n)
            if hints is None:
                st = lib.marconi_cache_lookup(h, ns, ptr, n, dst, raw)
                del ptr
                if st:
                    _check(st, "marconi_cache_lookup")
            else:
                hsrc, hn = hints
                hptr = _u32_arg(hsrc, hn)
                st = lib.marconi_cache_lookup_hinted(h, ns, ptr, n, hptr, hn, dst, raw)
                del ptr, hptr
                if st:
                    _check(st, "marconi_cache_lookup_hinted")
            lid = raw.lease
            try:
                k = raw.n_kv_pages
                pages = self._lease_list(h, "marconi_cache_lease_kv_pages", lid, k) if k else []
                k = raw.n_plan
                plan = self._lease_list(h, "marconi_cache_lease_plan", lid, k) if k else []
                lease = Lease(self, raw, pages, plan, n)
                # If close() began meanwhile, it frees the lease with the
                # cache, and lease.released reads True from self._closing.
                self._live.add(lid)
            except BaseException:
                # Nobody would ever see this lease: release it (the error
                # raised is the first one, whose detail is already read).
                lib.marconi_cache_release(h, lid)
                raise
        finally:
            calls.remove(ident)  # _end(), inlined
            if self._closing:
                self._ended()
        return lease

    # -- the request path of adapters (no Python lists) -------------------
    #
    # Ids are array.array('q') (int64, as SGLang's RadixKey and Req hold
    # them; marconi_cache_lookup_i64 / _admit_i64 read them in place) or
    # array('I') (uint32); page ids may also be a contiguous CPU int64 torch
    # tensor. Leases are ids registered in self._live, released with
    # _release_if_live(); no Lease object is built.

    def _lookup_prefix(self, ids: "array.array[int]", n: int, ns: int, flags: int) -> tuple[int, int, int, Optional[int], int]:
        """marconi_cache_lookup_i64_flags of `ids[:n]` (array('q'), 0 < n <=
        len(ids), read in place: no copy) with `flags`
        (LOOKUP_WHOLE_INPUT, LOOKUP_NO_KV_PAGES): (lease id, hit tokens,
        KV-matched tokens, state slot or None, number of KV pages)."""
        if not 0 < n <= len(ids):
            raise ValueError(f"n: {n} tokens of a key of {len(ids)}")
        raw = _Lookup()
        calls = self._calls
        ident = _get_ident()
        calls.append(ident)  # _begin(), inlined
        try:
            if self._closing:
                raise ValueError("the cache is closed")
            ptr = ctypes.c_int64.from_buffer(ids)
            st = self._lib.marconi_cache_lookup_i64_flags(self._handle, ns, ptr, n, NO_SLOT, flags, raw)
            del ptr
            if st:
                _check(st, "marconi_cache_lookup_i64_flags")
            lid = raw.lease
            self._live.add(lid)
        finally:
            calls.remove(ident)  # _end(), inlined
            if self._closing:
                self._ended()
        slot = raw.state_slot
        return lid, raw.hit_tokens, raw.kv_matched_tokens, None if slot == NO_SLOT else slot, raw.n_kv_pages

    def _lease_pages(self, lid: int, n: int) -> "array.array[int]":
        """The first n KV page ids of a live lease (n at most its count), as
        an array('I') (one copy, no Python ints)."""
        buf = _array("I", _ZERO_U32) * n
        if n == 0:
            return buf
        out = ctypes.c_size_t()
        h = self._begin()
        try:
            st = self._lib.marconi_cache_lease_kv_pages(h, lid, _U32.from_buffer(buf), n, ctypes.byref(out))
            if st and st != 3:
                _check(st, "marconi_cache_lease_kv_pages")
        finally:
            self._end()
        return buf

    def _admit_i64(self, lid: int, ids: "array.array[int]", states: Any, pages: Any, n_pages: int) -> tuple:
        """marconi_cache_admit_i64 of array('q') `ids` under lease `lid`
        with the saved `states` and `n_pages` int64 page ids (`pages`: an
        array('q') or a contiguous CPU int64 tensor; None with 0). Returns
        (states taken, pages taken start, end, truncated_to or 0, rejected,
        taken flags as a list of bools)."""
        saved, k = _saved_states(states)
        taken = (ctypes.c_uint8 * k)() if k else None
        raw = _AdmitRaw()
        if pages is None or n_pages == 0:
            pptr = None
        elif hasattr(pages, "data_ptr"):
            pptr = ctypes.c_int64.from_address(pages.data_ptr())
        else:
            pptr = ctypes.c_int64.from_buffer(pages)
        calls = self._calls
        ident = _get_ident()
        calls.append(ident)  # _begin(), inlined
        try:
            if self._closing:
                raise ValueError("the cache is closed")
            tptr = ctypes.c_int64.from_buffer(ids) if len(ids) else None
            st = self._lib.marconi_cache_admit_i64(
                self._handle, lid, tptr, len(ids), saved, k, pptr, n_pages, taken, raw
            )
            del tptr, pptr
            if st:
                _check(st, "marconi_cache_admit_i64")
        finally:
            calls.remove(ident)  # _end(), inlined
            if self._closing:
                self._ended()
        states_taken, _, start, end, _, truncated, rejected = _ADMIT_FIELDS.unpack_from(raw)
        return states_taken, start, end, truncated, rejected, [t != 0 for t in taken] if k else []

    def _lease_list(self, h: ctypes.c_void_p, fn: str, lease: int, n: int) -> list[int]:
        if n == 0:
            return []
        buf = (ctypes.c_uint32 * n)()
        out = ctypes.c_size_t()
        st = getattr(self._lib, fn)(h, lease, buf, n, ctypes.byref(out))
        if st:
            _check(st, fn)
        return buf[: out.value]

    def _lease_id(self, lease: Union[Lease, int]) -> int:
        if isinstance(lease, Lease):
            return lease.id
        # A PooledLookup or a TieredHit: its lease id.
        return _u64(getattr(lease, "lease", lease), "lease")

    def plan(self, lease: Union[Lease, int]) -> list[int]:
        """The checkpoint positions planned for a lease."""
        lid = self._lease_id(lease)
        fn = "marconi_cache_lease_plan"
        out = ctypes.c_size_t()
        h = self._begin()
        try:
            st = self._lib.marconi_cache_lease_plan(h, lid, None, 0, ctypes.byref(out))
            if st not in (0, 3):
                _check(st, fn)
            return self._lease_list(h, fn, lid, out.value)
        finally:
            self._end()

    def admit(
        self,
        lease: Union[Lease, int],
        tokens: Tokens,
        states: Iterable = (),
        kv_pages: Optional[Tokens] = None,
    ) -> AdmitResult:
        """Admits `tokens` (the input, optionally followed by decoded output)
        under `lease` with the saved `states`: (position, slot) pairs (slot
        None when slots are not tracked). The slots of taken states and the
        pages in `kv_pages_taken` become the cache's."""
        lid = lease.id if isinstance(lease, Lease) else _u64(lease, "lease")
        if tokens.__class__ is _array and tokens.typecode == "I":
            return self._admit(lid, tokens, len(tokens), states, kv_pages)
        src, n = _u32_source(tokens)
        return self._admit(lid, src, n, states, kv_pages)

    def _admit(self, lid: int, src: Any, n: int, states: Iterable, kv_pages: Optional[Tokens]) -> AdmitResult:
        """admit() of the first n tokens of a _u32_source() result."""
        saved, k = _saved_states(states)
        pages, n_pages = _u32_source(kv_pages, "kv_pages") if kv_pages is not None else (None, 0)
        taken = (ctypes.c_uint8 * k)() if k else None
        raw = _AdmitRaw()
        lib = self._lib
        calls = self._calls
        ident = _get_ident()
        calls.append(ident)  # _begin(), inlined
        try:
            if self._closing:
                raise ValueError("the cache is closed")
            st = lib.marconi_cache_admit(
                self._handle,
                lid,
                _U32.from_buffer(src) if src.__class__ is _array and n else _u32_arg(src, n),
                n,
                saved,
                k,
                _u32_pointer(pages, n_pages),
                n_pages,
                taken,
                raw,
            )
            if st:
                _check(st, "marconi_cache_admit")
        finally:
            calls.remove(ident)  # _end(), inlined
            if self._closing:
                self._ended()
        states_taken, returned, start, end, new_kv, truncated, rejected = _ADMIT_FIELDS.unpack_from(raw)
        result = _new(AdmitResult)
        _setattr(
            result,
            "__dict__",
            {
                "states_taken": states_taken,
                "slots_returned": returned,
                "kv_pages_taken": range(start, end),
                "new_kv_tokens": new_kv,
                "truncated_to": truncated or None,
                "rejected": rejected,
                "taken": ([taken[0] != 0] if k == 1 else list(map(bool, taken[:]))) if k else [],
            },
        )
        return result

    def release(self, lease: Union[Lease, int]) -> None:
        """Releases a lease, given as its Lease or its id (either way the
        Lease object is marked released); MarconiError(UNKNOWN_LEASE) if
        already released."""
        self._release(self._lease_id(lease))

    def _release(self, lid: int) -> None:
        calls = self._calls
        ident = _get_ident()
        calls.append(ident)  # _begin(), inlined
        try:
            if self._closing:
                raise ValueError("the cache is closed")
            st = self._lib.marconi_cache_release(self._handle, lid)
            if st:
                _check(st, "marconi_cache_release")
        finally:
            calls.remove(ident)  # _end(), inlined
            if self._closing:
                self._ended()
        self._live.discard(lid)  # the Lease (if any) now reads as released

    def serve(
        self,
        input: Tokens,
        output: Tokens = (),
        namespace: int = 0,
        slots=None,
        checkpoints: Optional[Tokens] = None,
    ) -> Lease:
        """One whole request as an engine runs it: lookup (with the
        application `checkpoints`, as lookup()), save a state at every
        planned position and at the end, admit input + output, release.
        `slots` is an optional callable returning a fresh slot id per state.
        Returns the (released) lease with the lookup's results."""
        ns = _u64(namespace, "namespace")
        full, n, n_in = _u32_concat(input, output, "input", "output")
        hints = None if checkpoints is None else _u32_source(checkpoints, "checkpoints")
        with self._lookup(full, n_in, ns, NO_SLOT, hints) as lease:
            final = n - n % self.page_size
            positions = list(lease.plan)
            if final > 0 and final not in positions:
                positions.append(final)
            states = [(p, slots() if slots else None) for p in positions]
            self._admit(lease.id, full, n, states, None)
        return lease

    # -- eviction, stats, log ----------------------------------------------

    def drain_freed(self) -> tuple[list[int], list[int]]:
        """(kv page ids, state slot ids) freed by evictions since the last
        drain; the engine may reuse them."""
        fn = "marconi_cache_drain_freed"
        drain = self._lib.marconi_cache_drain_freed
        h = self._begin()
        try:
            while True:
                np_, ns_ = ctypes.c_size_t(), ctypes.c_size_t()
                st = drain(h, None, 0, ctypes.byref(np_), None, 0, ctypes.byref(ns_))
                if st == 0:
                    return [], []
                if st != 3:
                    _check(st, fn)
                pages = (ctypes.c_uint32 * max(np_.value, 1))()
                slots = (ctypes.c_uint32 * max(ns_.value, 1))()
                st = drain(h, pages, np_.value, ctypes.byref(np_), slots, ns_.value, ctypes.byref(ns_))
                if st == 3:  # another thread added ids in between: ask again
                    continue
                _check(st, fn)
                return list(pages[: np_.value]), list(slots[: ns_.value])
        finally:
            self._end()

    def _drain_freed_raw(self) -> tuple:
        """As drain_freed, into buffers this cache keeps and reuses (grown
        when too small): (pages, n_pages, slots, n_slots), the ids in
        pages[:n_pages] and slots[:n_slots] as uint32 (ctypes arrays, valid
        until the next call). One native call when the buffers are large
        enough; no Python object per id."""
        fn = "marconi_cache_drain_freed"
        drain = self._lib.marconi_cache_drain_freed
        bufs = getattr(self, "_freed_bufs", None)
        if bufs is None:
            bufs = self._freed_bufs = [(ctypes.c_uint32 * 1024)(), (ctypes.c_uint32 * 256)()]
        np_, ns_ = ctypes.c_size_t(), ctypes.c_size_t()
        h = self._begin()
        try:
            while True:
                pages, slots = bufs
                st = drain(h, pages, len(pages), ctypes.byref(np_), slots, len(slots), ctypes.byref(ns_))
                if st == 3:  # too small: grow to what is pending, and ask again
                    bufs[0] = (ctypes.c_uint32 * max(np_.value, len(pages)))()
                    bufs[1] = (ctypes.c_uint32 * max(ns_.value, len(slots)))()
                    continue
                _check(st, fn)
                return pages, np_.value, slots, ns_.value
        finally:
            self._end()

    def evict(self, nbytes: int) -> int:
        """Evicts until `nbytes` are free (or nothing evictable is left);
        returns the bytes now free."""
        nbytes = _u64(nbytes, "nbytes")
        out = ctypes.c_uint64()
        h = self._begin()
        try:
            _check(self._lib.marconi_cache_evict(h, nbytes, ctypes.byref(out)), "marconi_cache_evict")
        finally:
            self._end()
        return out.value

    def stats(self) -> dict:
        """Counters and gauges (marconi_stats) as a dict."""
        s = _lib.marconi_stats()
        s.struct_size = ctypes.sizeof(s)
        h = self._begin()
        try:
            _check(self._lib.marconi_cache_stats(h, ctypes.byref(s)), "marconi_cache_stats")
        finally:
            self._end()
        return {name: getattr(s, name) for name, _ in s._fields_ if name != "struct_size"}

    def drain_log(self) -> list[dict]:
        """Decision-log records since the last drain (decision_log=True), as
        dicts parsed from the JSON lines."""
        out = []
        n = ctypes.c_size_t()
        cap = 1 << 16
        h = self._begin()
        try:
            while True:
                buf = ctypes.create_string_buffer(cap)
                st = self._lib.marconi_cache_drain_log(h, buf, cap, ctypes.byref(n))
                if st == 3:
                    cap = max(cap * 2, n.value)
                    continue
                _check(st, "marconi_cache_drain_log")
                if n.value == 0:
                    break
                out.append(buf.raw[: n.value])
        finally:
            self._end()
        return [json.loads(line) for chunk in out for line in chunk.decode().splitlines()]

    # -- lower tiers (tiers=...; docs/tiers.md) --------------------------
    #
    # On a cache without tiers each raises MarconiError (UNSUPPORTED) with
    # what to configure. lookup() and the other calls keep their meaning
    # on a cache with tiers: they see the device tier only.

    def lookup_tiered(
        self,
        tokens: Sequence[int],
        ns: int = 0,
        checkpoints: Sequence[int] = (),
        store: Any = None,
    ) -> Any:
        """Looks tokens up in every tier (and in `store`, a marconi.Store
        shared with other processes, when given) and returns a
        marconi.TieredHit whose lease (an id) admit(), release() and the
        other lease calls take. Its loads say what to read from the lower
        tiers before prefilling from hit_tokens."""
        from .tiered import _lookup

        hit = _lookup(self, tokens, ns, checkpoints, store)
        self._live.add(hit.lease)
        return hit

    def lease_loads(self, lease: Union[Lease, int]) -> list:
        """The load orders of a lease (marconi.LoadOrder; none for a device hit)."""
        from .tiered import _lease_loads

        return _lease_loads(self, "marconi_cache_lease_loads", self._lease_id(lease))

    def report_load_failure(self, lease: Union[Lease, int]) -> None:
        """Counts a load the engine could not make (it recomputed from the
        device's hit instead)."""
        self._call("marconi_cache_report_load_failure", self._lease_id(lease))

    def settle(self) -> None:
        """Runs the moves into the lower tiers that defer_moves left waiting."""
        self._call("marconi_cache_settle")

    def drain_ops(self) -> list:
        """The writes into and drops from the lower tiers since the last
        drain (marconi.TierOp), in the order to carry them out: before
        drain_freed()."""
        from .tiered import _drain_ops

        return _drain_ops(self, "marconi_cache_drain_ops")

    def tier_stats(self) -> dict:
        """The tiers' counters and gauges; per-tier values are dicts keyed
        by tier name ("device", "host", "store"). stats() has the device's."""
        from .tiered import _tier_stats

        return _tier_stats(self, "marconi_cache_tier_stats")

    # -- pools (pools=...; a cache over the library's memory) ----------------
    #
    # On a cache without pools each raises MarconiError (UNSUPPORTED) with
    # what to configure; on a cache with pools, lookup(), admit(),
    # drain_freed() and evict() (over ids the engine owns) raise it, naming
    # the call to use. release(), plan(), stats(), drain_log() and check()
    # work on both.

    def lookup_pooled(self, tokens: Tokens, namespace: int = 0, checkpoints: Optional[Tokens] = None) -> Any:
        """Looks up `tokens` (as lookup() takes them, with the application
        `checkpoints` as lookup() takes them: the kept ones are in the plan,
        reserve a state slot for each) and returns a marconi.PooledLookup:
        the hit, the cache's state handle to resume from (copy it into a
        slot of the request's with copy_states), the hit's page handles and
        the plan. release() takes it (or its lease id)."""
        from .pool import _pooled_lookup

        hit = _pooled_lookup(self, tokens, namespace, checkpoints)
        self._live.add(hit.lease)
        return hit

    def reserve(self, kv_pages: int, state_slots: int) -> tuple:
        """(page handles, slot handles) reserved for a request, as
        array('Q'): migrating free capacity and evicting as needed; all or
        nothing (MarconiError OUT_OF_MEMORY when even that cannot make
        room). The caller's until admitted or freed (free_units)."""
        from .pool import _reserve

        return _reserve(self, kv_pages, state_slots)

    def admit_pooled(self, lease: Any, tokens: Tokens, states: Any = (), kv_pages: Any = ()) -> Any:
        """Admits `tokens` under `lease` (a PooledLookup or its id) with its
        page handles (the hit's, then reserved ones: one per full page) and
        the states saved as (position, slot handle) pairs; returns a
        marconi.PooledAdmit (its `returned` units are still the caller's)."""
        from .pool import _admit_pooled

        return _admit_pooled(self, self._lease_id(lease), tokens, states, kv_pages)

    def free_units(self, handles: Any) -> None:
        """Frees units the caller holds (reserved, not taken); all or nothing."""
        from .pool import _free_handles

        _free_handles(self, "marconi_cache_free_units", handles)

    def drain_freed_units(self) -> "array.array[int]":
        """Handles evicted since the last call (already back in their pool:
        stale), as array('Q')."""
        from .pool import _olist

        return _olist(self, "marconi_cache_drain_freed_units")

    def held(self) -> "array.array[int]":
        """Handles the cache holds now (pages and slots), sorted."""
        from .pool import _olist

        return _olist(self, "marconi_cache_held")

    def resolve(self, handles: Any) -> list:
        """Where each live handle's unit is (marconi.UnitLocation; all or nothing)."""
        from .pool import _locations

        return _locations(self, "marconi_cache_resolve", handles)

    def view(self, handle: int) -> memoryview:
        """A writable view of a live unit's bytes (memfd only), as
        Pool.view: the unit's while the handle is live; the view keeps the
        memory mapped after close() until it is gone."""
        from .pool import _locations, _unit_view

        if not self.has_pools:
            # The library's refusal: MarconiError UNSUPPORTED, saying what to configure.
            _locations(self, "marconi_cache_resolve", [])
            raise ValueError("view: this cache has no pools")
        return _unit_view(self, "marconi_cache_resolve", handle)

    def copy_states(self, pairs: Any) -> None:
        """Copies states by handle, (src, dst) pairs (e.g. the lookup's
        state into the request's own slot); a destination must be the
        caller's."""
        from .pool import _copy_states

        _copy_states(self, pairs)

    def pool_stats(self) -> dict:
        """The pools' counters (marconi_pooled_stats) as a dict; stats()
        has the cache's."""
        from .pool import _pool_stats

        return _pool_stats(self)

    def check(self) -> None:
        """Checks the internal invariants (MarconiError(INVARIANT_VIOLATED))."""
        h = self._begin()
        try:
            _check(self._lib.marconi_cache_check(h), "marconi_cache_check")
        finally:
            self._end()
