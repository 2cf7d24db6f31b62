"""Lower tiers (docs/tiers.md): a host tier and a store tier below the
device cache. The library decides which hit to resume from (loading it or
recomputing it, by the tiers' bandwidths), what to copy into which tier and
which copies to free; the engine moves the bytes. A store shared with other
processes (a marconi.Store) is probed at lookup, so that a state another
engine wrote is resumed from; a store that is down or slow gives misses
within its timeout.

Tiers are an option of the one cache handle:

    pc = marconi.PrefixCache(device_bytes, "nemotron-h-8b",
                             tiers=marconi.Tiers(host_bytes=8 * device_bytes,
                                                 store_bytes=64 * device_bytes,
                                                 store_states_hold_kv=True))
    hit = pc.lookup_tiered(prompt, store=shared)   # a TieredHit
    for order in hit.loads: ...                    # from host copies or the store
    pc.admit(hit.lease, prompt + output, [(len(prompt + output), slot)])
    pc.release(hit.lease)
    for op in pc.drain_ops(): ...                  # copy into / free from host, store
    pages, slots = pc.drain_freed()

marconi.TieredCache is the deprecated earlier form (one release more).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

from . import _lib
from ._convert import _real, _u32, _u64
from ._errors import _check, _config
from .cache import PrefixCache
from .store import Store, _tokens

TIERS = ("device", "host", "store")
WRITE_MODES = {"back": 0, "through": 1}


@dataclass(frozen=True)
class LoadOrder:
    """One load before prefill: the KV of tokens start..end, or the state at
    `position` (kind "state"), from `tier`."""

    tier: str
    kind: str
    start: int
    end: int
    position: int
    bytes: int


@dataclass(frozen=True)
class TieredHit:
    """What TieredCache.lookup found (marconi_tiered_hit and its lists)."""

    lease: int
    hit_tokens: int
    tier: str
    device_hit_tokens: int
    device_kv_tokens: int
    device_state_slot: Optional[int]
    loads: list[LoadOrder]
    plan: list[int]
    kv_pages: list[int]
    shared: bool
    """The state is one only the shared store probe knew of (another process wrote it)."""
    declined: Optional[tuple[str, int]]
    """A longer hit left unused because recomputing is faster: (tier, tokens)."""
    load_s: float
    recompute_s: float


@dataclass(frozen=True)
class TierOp:
    """One op of drain_ops: kind "write" (copy the chain tokens[:position]
    into `tier`: from the device's copy for the host, from the host's copy
    for the store) or "drop" (free the copy in `tier`)."""

    kind: str
    tier: str
    ns: int
    position: int
    tokens: list[int]
    bytes: int


def _spec(spec: Any, capacity: int, gbps: Optional[float], latency_us: Optional[float], name: str) -> None:
    spec.capacity_bytes = _u64(capacity, f"{name}_bytes")
    if gbps is not None:
        spec.bandwidth_bytes_per_s = _real(gbps, f"{name}_gbps") * 1e9
    if latency_us is not None:
        spec.latency_s = _real(latency_us, f"{name}_latency_us") * 1e-6


@dataclass(frozen=True)
class Tiers:
    """The lower tiers of a PrefixCache (marconi_tier_options), passed as
    PrefixCache(..., tiers=Tiers(...)) (or a dict of these fields).

    host_bytes / store_bytes: the lower tiers' capacities (0: absent; a
    store needs a host). host_gbps (25), host_latency_us (10), store_gbps
    (5), store_latency_us (1000): the rates a load is weighed by. write:
    "back" (demote on eviction, the default) or "through". compute_flops:
    the device's effective prefill FLOP/s (default 989e12 x 0.4).
    store_states_hold_kv: the engine's state objects in the store carry
    their KV (whole-sequence snapshots). exclusive (default True): a host
    or store hit the device took in is dropped from that tier (a "drop"
    op); False keeps a copy there. defer_moves: moves wait for settle().
    """

    host_bytes: int = 0
    store_bytes: int = 0
    host_gbps: Optional[float] = None
    host_latency_us: Optional[float] = None
    store_gbps: Optional[float] = None
    store_latency_us: Optional[float] = None
    write: str = "back"
    compute_flops: Optional[float] = None
    promote: bool = False
    always_load: bool = False
    lower_plans: bool = True
    defer_moves: bool = False
    max_store_probe: int = 1024
    store_states_hold_kv: bool = False
    exclusive: bool = True

    def _options(self, lib: Any) -> Any:
        """The marconi_tier_options these stand for (checked)."""
        if self.write not in WRITE_MODES:
            raise ValueError(f"write: expected one of {sorted(WRITE_MODES)}, got {self.write!r}")
        for name in ("promote", "always_load", "lower_plans", "defer_moves", "store_states_hold_kv", "exclusive"):
            v = getattr(self, name)
            if not isinstance(v, bool):
                raise TypeError(f"{name}: expected a bool, got {type(v).__name__}")
        o = _config(lib, _lib.marconi_tier_options)
        _spec(o.host, self.host_bytes, self.host_gbps, self.host_latency_us, "host")
        _spec(o.store, self.store_bytes, self.store_gbps, self.store_latency_us, "store")
        o.write_mode = WRITE_MODES[self.write]
        if self.compute_flops is not None:
            o.compute_flops = _real(self.compute_flops, "compute_flops")
        o.promote, o.always_load, o.lower_plans = int(self.promote), int(self.always_load), int(self.lower_plans)
        o.defer_moves, o.store_states_hold_kv = int(self.defer_moves), int(self.store_states_hold_kv)
        o.exclusive = int(self.exclusive)
        o.max_store_probe = _u32(self.max_store_probe, "max_store_probe")
        return o


def _tiers(tiers: Union["Tiers", dict]) -> "Tiers":
    if isinstance(tiers, Tiers):
        return tiers
    if isinstance(tiers, dict):
        return Tiers(**tiers)
    raise TypeError(f"tiers: expected a marconi.Tiers or a dict, got {type(tiers).__name__}")


# The tier calls of PrefixCache (and so of the deprecated TieredCache): `o`
# is the PrefixCache, fn the marconi_cache_* function.


def _list(o: Any, fn: str, lease: int, ctype: Any, n: int) -> list:
    buf = (ctype * max(n, 1))()
    got = ctypes.c_size_t(0)
    o._call(fn, _u64(lease, "lease"), buf, n, ctypes.byref(got))
    return list(buf[: got.value])


def _lookup(o: Any, tokens: Sequence[int], ns: int, checkpoints: Sequence[int], store: Optional[Store]) -> TieredHit:
    t, n = _tokens(tokens)
    c, k = _tokens(checkpoints)
    raw = _lib.marconi_tiered_hit()
    store_h = None
    if store is not None:
        if not isinstance(store, Store):
            raise TypeError(f"store: expected a marconi.Store, got {type(store).__name__}")
        store_h = store._begin()
    try:
        o._call("marconi_cache_lookup_tiered", _u64(ns, "ns"), t, n, c if k else None, k, store_h, ctypes.byref(raw))
    finally:
        if store is not None:
            store._end()
    lease = raw.lease
    orders = _list(o, "marconi_cache_lease_loads", lease, _lib.marconi_load_order, raw.n_loads)
    loads = [LoadOrder(TIERS[x.tier], ("kv", "state")[x.kind], x.start, x.end, x.position, x.bytes) for x in orders]
    return TieredHit(
        lease=lease,
        hit_tokens=raw.hit_tokens,
        tier=TIERS[raw.tier],
        device_hit_tokens=raw.device_hit_tokens,
        device_kv_tokens=raw.device_kv_tokens,
        device_state_slot=None if raw.device_state_slot == _lib.NO_SLOT else raw.device_state_slot,
        loads=loads,
        plan=_list(o, "marconi_cache_lease_plan", lease, ctypes.c_uint32, raw.n_plan),
        kv_pages=_list(o, "marconi_cache_lease_kv_pages", lease, ctypes.c_uint32, raw.n_kv_pages),
        shared=bool(raw.shared),
        declined=(TIERS[raw.declined_tier], raw.declined_tokens) if raw.declined_tokens else None,
        load_s=raw.load_s,
        recompute_s=raw.recompute_s,
    )


def _lease_loads(o: Any, fn: str, lease: int) -> list[LoadOrder]:
    n = ctypes.c_size_t(0)
    h = o._begin()
    try:
        st = getattr(o._lib, fn)(h, _u64(lease, "lease"), None, 0, ctypes.byref(n))
    finally:
        o._end()
    if st not in (0, 3):
        _check(st, fn)
    orders = _list(o, fn, lease, _lib.marconi_load_order, n.value)
    return [LoadOrder(TIERS[x.tier], ("kv", "state")[x.kind], x.start, x.end, x.position, x.bytes) for x in orders]


def _drain_ops(o: Any, fn: str) -> list[TierOp]:
    n_ops, n_tok = ctypes.c_size_t(0), ctypes.c_size_t(0)
    for _ in range(4):
        ops = (_lib.marconi_tier_op * max(n_ops.value, 1))()
        toks = (ctypes.c_uint32 * max(n_tok.value, 1))()
        h = o._begin()
        try:
            st = getattr(o._lib, fn)(h, ops, n_ops.value, ctypes.byref(n_ops), toks, n_tok.value,
                                     ctypes.byref(n_tok))
        finally:
            o._end()
        if st == 3:  # BUFFER_TOO_SMALL: the counts are written; more may arrive meanwhile
            continue
        _check(st, fn)
        return [
            TierOp(("write", "drop")[x.kind], TIERS[x.tier], x.ns, x.position,
                   list(toks[x.tokens_offset: x.tokens_offset + x.position]), x.bytes)
            for x in ops[: n_ops.value]
        ]
    raise RuntimeError(f"{fn}: the pending ops kept growing")


def _tier_stats(o: Any, fn: str) -> dict:
    s = _lib.marconi_tiered_stats()
    s.struct_size = ctypes.sizeof(s)
    o._call(fn, ctypes.byref(s))
    out: dict = {}
    for f in _lib.TIERED_STATS_SCALARS_1 + _lib.TIERED_STATS_SCALARS_2:
        out[f] = getattr(s, f)
    for f in _lib.TIERED_STATS_ARRAYS_1 + _lib.TIERED_STATS_ARRAYS_2:
        out[f] = dict(zip(TIERS, getattr(s, f)))
    out["load_s"] = s.load_s
    return out


class TieredCache(PrefixCache):
    """Deprecated (removed in the next release): use
    PrefixCache(..., tiers=Tiers(...)), whose lookup_tiered, lease_loads,
    report_load_failure, settle, drain_ops and tier_stats are this class's
    lookup, (TieredHit.loads), report_load_failure, settle, drain_ops and
    stats. A tiered cache handle (marconi_tiered, which is a marconi_cache
    with tiers). Thread-safe; close() (or `with`) frees it. Not copyable or
    picklable.

    device_bytes: the device cache's capacity. model: a preset name or a
    dict of marconi_model_spec fields. host_bytes / store_bytes: the lower
    tiers' capacities (0: absent; a store needs a host). host_gbps (25),
    host_latency_us (10), store_gbps (5), store_latency_us (1000): the
    rates a load is weighed by. write: "back" (demote on eviction, the
    default) or "through". compute_flops: the device's effective prefill
    FLOP/s (default 989e12 x 0.4). store_states_hold_kv: the engine's state
    objects in the store carry their KV (whole-sequence snapshots).
    exclusive (default True): a host or store hit the device took in is
    dropped from that tier (a "drop" op); False keeps a copy there. It is
    a PrefixCache with tiers whose tier methods go by these names.
    """

    _WHAT = "tiered cache"

    def __init__(
        self,
        device_bytes: int,
        model: Union[str, dict] = "paper-7b",
        *,
        host_bytes: int = 0,
        store_bytes: int = 0,
        host_gbps: Optional[float] = None,
        host_latency_us: Optional[float] = None,
        store_gbps: Optional[float] = None,
        store_latency_us: Optional[float] = None,
        page_size: int = 1,
        alpha: Optional[float] = None,
        tuner_adoption: str = "when_ready",
        write: str = "back",
        compute_flops: Optional[float] = None,
        promote: bool = False,
        always_load: bool = False,
        lower_plans: bool = True,
        defer_moves: bool = False,
        max_store_probe: int = 1024,
        store_states_hold_kv: bool = False,
        exclusive: bool = True,
    ):
        tiers = Tiers(host_bytes=host_bytes, store_bytes=store_bytes, host_gbps=host_gbps,
                      host_latency_us=host_latency_us, store_gbps=store_gbps, store_latency_us=store_latency_us,
                      write=write, compute_flops=compute_flops, promote=promote, always_load=always_load,
                      lower_plans=lower_plans, defer_moves=defer_moves, max_store_probe=max_store_probe,
                      store_states_hold_kv=store_states_hold_kv, exclusive=exclusive)
        super().__init__(device_bytes, model, page_size=page_size, alpha=alpha, tuner_adoption=tuner_adoption,
                         tiers=tiers)

    def lookup(
        self,
        tokens: Sequence[int],
        ns: int = 0,
        checkpoints: Sequence[int] = (),
        store: Optional[Store] = None,
    ) -> TieredHit:
        """PrefixCache.lookup_tiered: the hit in every tier (and in `store`,
        a store shared with other processes, when given) with a lease;
        release it with release()."""
        return self.lookup_tiered(tokens, ns, checkpoints, store)

    def stats(self) -> dict:
        """PrefixCache.tier_stats: per-tier values are dicts keyed by tier name."""
        return self.tier_stats()
