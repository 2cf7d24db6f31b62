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
from typing import Any, Iterable, Optional, Sequence, Union

from . import _lib
from ._convert import _u32, _u64
from ._convert import _real
from ._errors import _check
from ._handle import _Handle
from .cache import ADOPTION, AdmitResult, _model_into, _saved_states
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
        o = _lib.marconi_tier_options()
        _check(lib.marconi_tier_options_init(ctypes.byref(o), ctypes.sizeof(o)), "marconi_tier_options_init")
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


# The tier calls, shared by PrefixCache (marconi_cache_* names) and the
# deprecated TieredCache (its marconi_tiered_* names): `o` is a
# marconi._handle._Handle.


def _list(o: Any, fn: str, lease: int, ctype: Any, n: int) -> list:
    buf = (ctype * max(n, 1))()
    got = ctypes.c_size_t(0)
    o._call(fn, _u64(lease, "lease"), buf, n, ctypes.byref(got))
    return list(buf[: got.value])


def _lookup(o: Any, names: dict, tokens: Sequence[int], ns: int, checkpoints: Sequence[int],
            store: Optional[Store]) -> TieredHit:
    t, n = _tokens(tokens)
    c, k = _tokens(checkpoints)
    raw = _lib.marconi_tiered_hit()
    store_h = None
    if store is not None:
        if not isinstance(store, Store):
            raise TypeError(f"store: expected a marconi.Store, got {type(store).__name__}")
        store_h = store._begin()
    try:
        o._call(names["lookup"], _u64(ns, "ns"), t, n, c if k else None, k, store_h, ctypes.byref(raw))
    finally:
        if store is not None:
            store._end()
    lease = raw.lease
    orders = _list(o, names["loads"], lease, _lib.marconi_load_order, raw.n_loads)
    loads = [LoadOrder(TIERS[x.tier], ("kv", "state")[x.kind], x.start, x.end, x.position, x.bytes) for x in orders]
    return TieredHit(
        lease=lease,
        hit_tokens=raw.hit_tokens,
        tier=TIERS[raw.tier],
        device_hit_tokens=raw.device_hit_tokens,
        device_kv_tokens=raw.device_kv_tokens,
        device_state_slot=None if raw.device_state_slot == _lib.NO_SLOT else raw.device_state_slot,
        loads=loads,
        plan=_list(o, names["plan"], lease, ctypes.c_uint32, raw.n_plan),
        kv_pages=_list(o, names["kv_pages"], lease, ctypes.c_uint32, raw.n_kv_pages),
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


CACHE_NAMES = {
    "lookup": "marconi_cache_lookup_tiered",
    "loads": "marconi_cache_lease_loads",
    "plan": "marconi_cache_lease_plan",
    "kv_pages": "marconi_cache_lease_kv_pages",
}
TIERED_NAMES = {
    "lookup": "marconi_tiered_lookup",
    "loads": "marconi_tiered_lease_loads",
    "plan": "marconi_tiered_lease_plan",
    "kv_pages": "marconi_tiered_lease_kv_pages",
}


class TieredCache(_Handle):
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
    dropped from that tier (a "drop" op); False keeps a copy there.
    """

    _WHAT = "tiered cache"
    _FREE = "marconi_tiered_free"

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
        self._guard_init()
        if tuner_adoption not in ADOPTION:
            raise ValueError(f"tuner_adoption: expected one of {sorted(ADOPTION)}, got {tuner_adoption!r}")
        lib = _lib.load()
        dev = _lib.marconi_cache_config()
        _check(lib.marconi_cache_config_init(ctypes.byref(dev), ctypes.sizeof(dev)), "marconi_cache_config_init")
        keep = _model_into(dev, model)
        dev.capacity_bytes = _u64(device_bytes, "device_bytes")
        dev.page_size = _u32(page_size, "page_size")
        dev.tuner_adoption = ADOPTION[tuner_adoption]
        if alpha is not None:
            dev.alpha_mode = 0
            dev.alpha = _real(alpha, "alpha")
        tiers = Tiers(host_bytes=host_bytes, store_bytes=store_bytes, host_gbps=host_gbps,
                      host_latency_us=host_latency_us, store_gbps=store_gbps, store_latency_us=store_latency_us,
                      write=write, compute_flops=compute_flops, promote=promote, always_load=always_load,
                      lower_plans=lower_plans, defer_moves=defer_moves, max_store_probe=max_store_probe,
                      store_states_hold_kv=store_states_hold_kv, exclusive=exclusive)
        opts = tiers._options(lib)
        dev.tiers = ctypes.pointer(opts)
        h = ctypes.c_void_p()
        _check(lib.marconi_cache_new(ctypes.byref(dev), ctypes.byref(h)), "marconi_cache_new")
        del keep, opts  # read only during marconi_cache_new
        self._adopt(lib, h)

    def lookup(
        self,
        tokens: Sequence[int],
        ns: int = 0,
        checkpoints: Sequence[int] = (),
        store: Optional[Store] = None,
    ) -> TieredHit:
        """Looks tokens up in every tier (and in `store`, a store shared
        with other processes, when given) and returns the hit with a lease;
        release it with release()."""
        return _lookup(self, TIERED_NAMES, tokens, ns, checkpoints, store)

    def admit(
        self,
        lease: int,
        tokens: Sequence[int],
        states: Iterable = (),
        kv_pages: Optional[Sequence[int]] = None,
    ) -> AdmitResult:
        """Admits tokens (input + output) under `lease` with the saved
        (position, slot) states; then drain_ops() before freeing the slots
        of states not taken (one may go straight to the host)."""
        t, n = _tokens(tokens)
        saved, k = _saved_states(list(states))
        pages, np_ = _tokens(kv_pages or [])
        taken = (ctypes.c_uint8 * k)() if k else None
        raw = _lib.marconi_admit_result()
        self._call("marconi_tiered_admit", _u64(lease, "lease"), t, n, saved, k, pages if np_ else None, np_,
                   taken, ctypes.byref(raw))
        return AdmitResult(
            states_taken=raw.states_taken,
            slots_returned=raw.slots_returned,
            kv_pages_taken=range(raw.kv_pages_taken_start, raw.kv_pages_taken_end),
            new_kv_tokens=raw.new_kv_tokens,
            truncated_to=raw.truncated_to or None,
            rejected=bool(raw.rejected),
            taken=[bool(x) for x in taken] if k else [],
        )

    def release(self, lease: int) -> None:
        """Releases the lease in every tier."""
        self._call("marconi_tiered_release", _u64(lease, "lease"))

    def report_load_failure(self, lease: int) -> None:
        """Counts a load the engine could not make (it recomputed from the
        device's hit instead)."""
        self._call("marconi_tiered_report_load_failure", _u64(lease, "lease"))

    def settle(self) -> None:
        """Runs the moves into the lower tiers that defer_moves left waiting."""
        self._call("marconi_tiered_settle")

    def drain_ops(self) -> list[TierOp]:
        """The writes into and drops from the lower tiers since the last
        drain, in the order to carry them out."""
        return _drain_ops(self, "marconi_tiered_drain_ops")

    def drain_freed(self) -> tuple[list[int], list[int]]:
        """(KV page ids, state slot ids) the device freed since the last drain."""
        n_p, n_s = ctypes.c_size_t(0), ctypes.c_size_t(0)
        for _ in range(4):
            pages = (ctypes.c_uint32 * max(n_p.value, 1))()
            slots = (ctypes.c_uint32 * max(n_s.value, 1))()
            h = self._begin()
            try:
                st = self._lib.marconi_tiered_drain_freed(h, pages, n_p.value, ctypes.byref(n_p), slots, n_s.value,
                                                          ctypes.byref(n_s))
            finally:
                self._end()
            if st == 3:
                continue
            _check(st, "marconi_tiered_drain_freed")
            return list(pages[: n_p.value]), list(slots[: n_s.value])
        raise RuntimeError("marconi_tiered_drain_freed: the freed ids kept growing")

    def stats(self) -> dict:
        """Counters and gauges; per-tier values are dicts keyed by tier name."""
        return _tier_stats(self, "marconi_tiered_get_stats")

    def check(self) -> None:
        """Raises MarconiError (INVARIANT_VIOLATED) when a tier's invariant fails."""
        self._call("marconi_tiered_check")
