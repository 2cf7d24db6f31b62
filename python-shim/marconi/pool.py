"""Memory pools and state snapshots over the C ABI: Pool (marconi_pool_*),
HostPool (marconi_host_pool_*: host tier memory and the moves between a
device pool and it) and the snapshot functions over a caller's buffer
(marconi_snapshot_*).

A Pool holds two pools of fixed-size units over one byte budget: KV pages
("kv") and recurrent-state slots ("state"), split statically or moved on
demand by AVMP migration, backed by nothing ("none": handles and offsets
only), a Linux memfd ("memfd": host memory, addresses into a mapping) or
CUDA virtual memory ("cuda": device addresses; a library built without CUDA,
or a machine without a driver, raises MarconiError UNSUPPORTED).

Unit handles are 64-bit integers below 2^63 (opaque; 0 is never live), so
int64 numpy arrays and torch tensors hold them. Handle lists
(allocate's result, free's and resolve's argument) are array('Q'), a
sequence of ints, or a numpy/torch integer array (converted in bulk).

A cache over pools is a PrefixCache created with pools=Pools(...) (its
pool methods: lookup_pooled, reserve, admit_pooled, free_units, ...);
PooledCache is the deprecated earlier form, over the same calls.

A view of a unit (Pool.view, PrefixCache.view, PooledCache.view) keeps the native object's
memory mapped until the view and every buffer made from it are gone: after
close() the memory stays valid for them (and is freed with the last one),
so a view can never crash the interpreter.
"""

from __future__ import annotations

import array
import ctypes
import sys
from dataclasses import dataclass
from typing import Any, Optional

from . import _lib
from ._convert import OutOfRangeError, _real, _u32, _u32_bytes, _u32_pointer, _u32_source, _u64
from ._errors import _check, _config
from ._handle import _Handle
from .cache import PrefixCache, _model_into

BACKEND = {"none": 0, "memfd": 1, "cuda": 2}
MIGRATION = {"static": 0, "avmp": 1}
KIND = {"kv": 0, "state": 1}
KIND_NAME = {v: k for k, v in KIND.items()}
PROMOTE = {"swap": 0, "copy_into": 1}


def out_size(code: str) -> int:
    """Bytes of one array item of typecode `code`."""
    return array.array(code).itemsize


def _choice(value: Any, table: dict, name: str) -> int:
    if not isinstance(value, str) or value not in table:
        raise ValueError(f"{name}: expected one of {sorted(table)}, got {value!r}")
    return table[value]


@dataclass(frozen=True)
class UnitLocation:
    """Where a live handle's unit is (marconi_unit_location)."""

    address: int
    """First byte: a host address (memfd), a device address (cuda), 0 (none).
    Valid while the handle is live: migrations never move a live unit."""
    byte_offset: int
    """Offset of the unit in its pool's range."""
    unit_bytes: int
    """Bytes of the unit."""
    kind: str
    """"kv" or "state"."""
    index: int
    """Unit index in its pool."""


def _handles(handles: Any, what: str) -> tuple[Any, int]:
    """(array('Q') or numpy uint64 array, n): `handles` as n native uint64s.
    Accepts array('Q'), a sequence of ints, or a numpy/torch integer array
    (converted in bulk); negative values and bools are refused."""
    if isinstance(handles, array.array) and handles.typecode == "Q":
        return handles, len(handles)
    np = sys.modules.get("numpy")
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(handles, torch.Tensor):
        if handles.dtype.is_floating_point or handles.dtype.is_complex or handles.dtype == torch.bool:
            raise TypeError(f"{what}: expected an integer tensor, got {handles.dtype}")
        handles = handles.detach().cpu().reshape(-1)
        if np is not None:
            handles = handles.numpy()
        else:
            handles = handles.tolist()
    elif np is not None and isinstance(handles, np.ndarray):
        if handles.dtype.kind not in "iu":
            raise TypeError(f"{what}: expected an integer array, got dtype {handles.dtype}")
        flat = handles.reshape(-1)
        if flat.dtype.kind == "i" and flat.size and int(flat.min()) < 0:
            raise OutOfRangeError(f"{what}: handles are not negative")
        out = np.ascontiguousarray(flat, dtype=np.uint64)
        return out, int(out.size)
    if isinstance(handles, (str, bytes, bytearray, memoryview)) or not hasattr(handles, "__iter__"):
        raise TypeError(f"{what}: expected a sequence of handles, got {type(handles).__name__}")
    out = array.array("Q", (_u64(h, f"{what}[{i}]") for i, h in enumerate(handles)))
    return out, len(out)


def _u64_pointer(src: Any, n: int) -> Any:
    """POINTER(c_uint64) to the n handles of a _handles() source (None for 0)."""
    if n == 0:
        return None
    if isinstance(src, array.array):
        return ctypes.cast((ctypes.c_uint64 * n).from_buffer(src), ctypes.POINTER(ctypes.c_uint64))
    return src.ctypes.data_as(ctypes.POINTER(ctypes.c_uint64))


def _pairs_source(pairs: Any, wide: bool = True) -> tuple[Any, int]:
    """(src, n_pairs): `pairs` as 2*n native uint64s (handles; uint32 slot
    indices when not `wide`) (src, dst, src, dst, ...). Accepts a sequence of (src, dst) tuples, a numpy/torch array of
    shape (n, 2), or a flat sequence of 2n integers."""
    np = sys.modules.get("numpy")
    torch = sys.modules.get("torch")
    if (np is not None and isinstance(pairs, np.ndarray)) or (torch is not None and isinstance(pairs, torch.Tensor)):
        if pairs.ndim == 2:
            if pairs.shape[1] != 2:
                raise ValueError(f"pairs: expected shape (n, 2), got {tuple(pairs.shape)}")
            pairs = pairs.reshape(-1)
    elif isinstance(pairs, (list, tuple)):
        flat = []
        for i, p in enumerate(pairs):
            if not isinstance(p, (tuple, list)) or len(p) != 2:
                raise ValueError(f"pairs[{i}]: expected a (src, dst) pair, got {p!r}")
            flat += p
        pairs = flat
    src, n = _handles(pairs, "pairs") if wide else _u32_source(pairs, "pairs")
    if n % 2:
        raise ValueError(f"pairs: {n} integers do not make (src, dst) pairs")
    return src, n // 2


def _pairs_pointer(src: Any, n_pairs: int, wide: bool = True) -> Any:
    if not wide:
        p = _u32_pointer(src, 2 * n_pairs)
        return None if p is None else ctypes.cast(p, ctypes.POINTER(_lib.marconi_copy_order))
    p = _u64_pointer(src, 2 * n_pairs)
    return None if p is None else ctypes.cast(p, ctypes.POINTER(_lib.marconi_state_copy))


def _fields(s: Any) -> dict:
    """A versioned output struct's fields as a dict (without struct_size and
    reserved padding)."""
    return {name: getattr(s, name) for name, _ in s._fields_ if not name.startswith(("struct_size", "reserved"))}


def _stats(o: Any, fn: str, struct: Any) -> Any:
    """An output struct `struct` filled by `fn(handle, &s)` (its struct_size set)."""
    s = struct()
    s.struct_size = ctypes.sizeof(s)
    o._call(fn, ctypes.byref(s))
    return s


def _locations(o: Any, fn: str, handles: Any) -> list[UnitLocation]:
    """Where each handle's unit is, by `fn` (marconi_pool_resolve, ...; all or nothing)."""
    src, n = _handles(handles, "handles")
    out = (_lib.marconi_unit_location * max(n, 1))()
    o._call(fn, _u64_pointer(src, n), n, out, n)
    return [
        UnitLocation(x.address, x.byte_offset, x.unit_bytes, KIND_NAME.get(x.kind, str(x.kind)), x.index)
        for x in out[:n]
    ]


def _free_handles(o: Any, fn: str, handles: Any) -> None:
    """Frees units by `fn` (marconi_pool_free_units, ...); all or nothing."""
    src, n = _handles(handles, "handles")
    o._call(fn, _u64_pointer(src, n), n)


def _unit_view(o: Any, fn: str, handle: int) -> memoryview:
    """A writable view of a live unit of `o` (resolved by `fn`) that keeps
    the native memory mapped while it (or any buffer made from it) is alive."""
    if o.backend != "memfd":
        raise ValueError(f"view: backend {o.backend!r} has no host memory to view")
    src, n = _handles([handle], "handle")
    out = _lib.marconi_unit_location()
    h = o._begin()
    try:
        _check(getattr(o._lib, fn)(h, _u64_pointer(src, n), n, ctypes.byref(out), 1), fn)
        raw = (ctypes.c_char * out.unit_bytes).from_address(out.address)
        # ctypes instances keep attributes: the view's base holds the owner.
        raw._marconi_owner = o._owner
    finally:
        o._end()
    return memoryview(raw).cast("B")


class _Units(_Handle):
    """The unit calls Pool and HostPool share, over the library functions
    named `_PREFIX` + "_allocate", "_free_units", "_resolve". Safe to share
    between threads (the library locks internally); close() waits for the
    calls in flight on other threads and frees the memory (views keep it
    mapped until they are gone); later calls raise ValueError."""

    _PREFIX = ""
    _NOT_COPIED = "it owns native memory (share the object instead)"
    _NOT_PICKLED = "it owns native memory of this process"

    def allocate(self, kind: str, n: int) -> "array.array[int]":
        """Allocates n units of `kind` ("kv" or "state"); all or nothing
        (MarconiError OUT_OF_MEMORY when they are not there, even after the
        migration a device pool's AVMP allows). Returns their handles as
        array('Q')."""
        k = _choice(kind, KIND, "kind")
        n = _u32(n, "n")
        out = array.array("Q", bytes(8 * n))
        self._call(self._PREFIX + "_allocate", k, n, _u64_pointer(out, n), n)
        return out

    def free(self, handles: Any) -> None:
        """Frees the handles; all or nothing (MarconiError DOUBLE_FREE for a
        freed or repeated handle, UNKNOWN_HANDLE for a stale or foreign one;
        nothing is freed then)."""
        _free_handles(self, self._PREFIX + "_free_units", handles)

    def resolve(self, handles: Any) -> list[UnitLocation]:
        """Where each handle's unit is (all or nothing)."""
        return _locations(self, self._PREFIX + "_resolve", handles)

    def addresses(self, handles: Any) -> "array.array[int]":
        """The units' addresses as array('Q') (see resolve)."""
        return array.array("Q", (loc.address for loc in self.resolve(handles)))

    def view(self, handle: int) -> memoryview:
        """A writable memoryview of a live unit's bytes (memfd only; e.g.
        numpy.frombuffer(pool.view(h), dtype)). Its bytes are the unit's
        while the handle is live; after free() they may belong to the unit's
        next owner. The view keeps the memory mapped after close() until
        the view is gone."""
        return _unit_view(self, self._PREFIX + "_resolve", handle)


def _pool_config(
    budget_bytes: int,
    kv_page_bytes: int,
    state_slot_bytes: int,
    backend: str,
    migration: str,
    state_fraction: float,
    migration_batch_units: int,
    chunk_bytes: int,
    cuda_device: int,
) -> Any:
    lib = _lib.load()
    cfg = _config(lib, _lib.marconi_pool_config)
    cfg.backend = _choice(backend, BACKEND, "backend")
    cfg.migration = _choice(migration, MIGRATION, "migration")
    cfg.budget_bytes = _u64(budget_bytes, "budget_bytes")
    cfg.kv_page_bytes = _u64(kv_page_bytes, "kv_page_bytes")
    cfg.state_slot_bytes = _u64(state_slot_bytes, "state_slot_bytes")
    cfg.state_fraction = _real(state_fraction, "state_fraction")
    cfg.migration_batch_units = _u32(migration_batch_units, "migration_batch_units")
    cfg.chunk_bytes = _u64(chunk_bytes, "chunk_bytes")
    cfg.cuda_device = _u32(cuda_device, "cuda_device")
    return cfg


class Pool(_Units):
    """A libmarconi memory pool (marconi_pool). Safe to share between
    threads (the library locks internally). Close it with close() or a
    `with` block: close() waits for calls in flight on other threads, and
    later calls raise ValueError. Closing frees the memory, so every address
    obtained from the pool is invalid afterwards; a view keeps the memory
    until it is gone (see the module documentation).

    budget_bytes: both pools together (memfd and cuda round it down to whole
    chunks); kv_page_bytes, state_slot_bytes: unit sizes; state_fraction:
    the state pool's initial share (0 < f < 1); migration: "avmp" (an
    allocation that does not fit moves capacity from the other pool's free
    tail, migration_batch_units at a time; 0 means 128) or "static";
    chunk_bytes: the memfd chunk (0: 2 MiB).
    """

    _FREE = "marconi_pool_free"
    _WHAT = "pool"
    _PREFIX = "marconi_pool"

    def __init__(
        self,
        budget_bytes: int,
        kv_page_bytes: int,
        state_slot_bytes: int,
        *,
        backend: str = "memfd",
        migration: str = "avmp",
        state_fraction: float = 0.5,
        migration_batch_units: int = 0,
        chunk_bytes: int = 0,
        cuda_device: int = 0,
    ):
        self._guard_init()
        lib = _lib.load()
        cfg = _pool_config(
            budget_bytes,
            kv_page_bytes,
            state_slot_bytes,
            backend,
            migration,
            state_fraction,
            migration_batch_units,
            chunk_bytes,
            cuda_device,
        )
        handle = ctypes.c_void_p()
        _check(lib.marconi_pool_new(ctypes.byref(cfg), ctypes.byref(handle)), "marconi_pool_new")
        self._adopt(lib, handle, views=True)
        self.backend = backend

    def migrate(self, recipient: str, donor_units: int = 0) -> dict:
        """Moves capacity toward pool `recipient` from the other pool's free
        tail (donor_units of the donor, or its AVMP batch for 0). Returns
        {"donor", "donor_units", "recipient_units", "donor_bytes"}."""
        k = _choice(recipient, KIND, "recipient")
        m = _lib.marconi_migration()
        self._call("marconi_pool_migrate", k, _u32(donor_units, "donor_units"), ctypes.byref(m))
        return {
            "donor": KIND_NAME.get(m.donor, str(m.donor)),
            "donor_units": m.donor_units,
            "recipient_units": m.recipient_units,
            "donor_bytes": m.donor_bytes,
        }

    def stats(self) -> dict:
        """Counters and gauges (marconi_pool_stats) as a dict."""
        s = _stats(self, "marconi_pool_get_stats", _lib.marconi_pool_stats)
        out = _fields(s)
        out["backend"] = {v: k for k, v in BACKEND.items()}.get(s.backend, s.backend)
        return out

    # -- snapshots -------------------------------------------------------------

    def copy_states(self, pairs: Any) -> None:
        """Copies state slots by handle: pairs of (src, dst) state handles
        (a list of tuples, an (n, 2) integer numpy array, or a flat sequence).
        Checked whole first (live state handles, no self copy, no
        destination twice or also read); memfd copies on the host."""
        src, n = _pairs_source(pairs)
        self._call("marconi_pool_copy_states", _pairs_pointer(src, n), n)

    def fork_state(self, src: int, dsts: Any) -> None:
        """Copies state handle `src` into every handle of `dsts`."""
        s = _u64(src, "src")
        d, n = _handles(dsts, "dsts")
        self._call("marconi_pool_fork_state", s, _u64_pointer(d, n), n)

    def promote_state(self, state: int, candidates: Any, accepted: int, mode: str = "swap") -> int:
        """Makes candidates[accepted] the request's state; returns the handle
        holding it ("swap": the candidate's, no bytes move; "copy_into": the
        candidate is copied into `state`, which is returned)."""
        st = _u64(state, "state")
        c, n = _handles(candidates, "candidates")
        out = ctypes.c_uint64()
        self._call(
            "marconi_pool_promote_state",
            st,
            _u64_pointer(c, n),
            n,
            _u64(accepted, "accepted"),
            _choice(mode, PROMOTE, "mode"),
            ctypes.byref(out),
        )
        return out.value



class HostPool(_Units):
    """Host tier memory (marconi_host_pool): KV pages ("kv") and state slots
    ("state") in host RAM (a memfd; page-locked for CUDA in builds with the
    `cuda` feature where a device exists: stats()["pinned"]). Its handles
    follow Pool's rules and are its own: a device Pool refuses them and
    this pool refuses a Pool's (MarconiError UNKNOWN_HANDLE).

    capacity_bytes: pages and states together (rounded down to whole
    chunks, at least two); page_bytes, state_bytes: the device pool's unit
    sizes, so that units move between them; state_fraction: the states'
    share (0 < f < 1); chunk_bytes: the memfd chunk (0: 2 MiB).

    demote(device, pairs) copies a memfd device Pool's units into this
    pool's, promote(device, pairs) the reverse: pairs of (src, dst)
    handles, checked whole first (live on their side, same kind and size,
    no destination twice), so nothing moves when one is bad. A "cuda" or
    "none" device pool raises MarconiError UNSUPPORTED: resolve() gives the
    host addresses to copy on the engine's own stream. Safe to share
    between threads; close() as for Pool.
    """

    _FREE = "marconi_host_pool_free"
    _WHAT = "host pool"
    _PREFIX = "marconi_host_pool"

    def __init__(
        self,
        capacity_bytes: int,
        page_bytes: int,
        state_bytes: int,
        *,
        state_fraction: float = 0.5,
        chunk_bytes: int = 0,
    ):
        self._guard_init()
        lib = _lib.load()
        cfg = _config(lib, _lib.marconi_host_pool_config)
        cfg.capacity_bytes = _u64(capacity_bytes, "capacity_bytes")
        cfg.page_bytes = _u64(page_bytes, "page_bytes")
        cfg.state_bytes = _u64(state_bytes, "state_bytes")
        cfg.state_fraction = _real(state_fraction, "state_fraction")
        cfg.chunk_bytes = _u64(chunk_bytes, "chunk_bytes")
        handle = ctypes.c_void_p()
        _check(lib.marconi_host_pool_new(ctypes.byref(cfg), ctypes.byref(handle)), "marconi_host_pool_new")
        self._adopt(lib, handle, views=True)
        self.backend = "memfd"

    def stats(self) -> dict:
        """Gauges and counters (marconi_host_pool_stats) as a dict."""
        s = _stats(self, "marconi_host_pool_get_stats", _lib.marconi_host_pool_stats)
        out = _fields(s)
        out["pinned"] = bool(s.pinned)
        return out

    def demote(self, device: "Pool", pairs: Any) -> int:
        """Copies device units into host units: pairs of (device handle,
        host handle). All or nothing; returns the bytes copied."""
        return self._move("marconi_host_pool_demote", device, pairs)

    def promote(self, device: "Pool", pairs: Any) -> int:
        """Copies host units into device units: pairs of (host handle,
        device handle). All or nothing; returns the bytes copied."""
        return self._move("marconi_host_pool_promote", device, pairs)

    def _move(self, name: str, device: "Pool", pairs: Any) -> int:
        if not isinstance(device, Pool):
            raise TypeError(f"device: expected a marconi.Pool, got {type(device).__name__}")
        src, n = _pairs_source(pairs)
        p = _pairs_pointer(src, n)
        moves = None if p is None else ctypes.cast(p, ctypes.POINTER(_lib.marconi_unit_move))
        out = ctypes.c_uint64()
        h = self._begin()
        try:
            d = device._begin()
            try:
                _check(getattr(self._lib, name)(h, d, moves, n, ctypes.byref(out)), name)
            finally:
                device._end()
        finally:
            self._end()
        return out.value

def _state_buffer(buffer: Any, slots: int, layers: int) -> tuple[Any, Any]:
    """(marconi_state_buffer, keepalive) over a writable buffer holding
    layers x slots equal slots (numpy arrays, bytearray, memoryview...)."""
    slots = _u32(slots, "slots")
    layers = _u32(layers, "layers")
    if slots == 0 or layers == 0:
        raise ValueError(f"slots {slots} and layers {layers} must be at least 1")
    mv = memoryview(buffer)
    if mv.readonly:
        raise ValueError("buffer: a writable buffer is needed (the copies write it)")
    if not mv.c_contiguous:
        raise ValueError("buffer: not contiguous")
    nbytes = mv.nbytes
    if nbytes == 0 or nbytes % (slots * layers):
        raise ValueError(f"buffer: {nbytes} bytes do not split into {layers} layers x {slots} slots")
    raw = (ctypes.c_uint8 * nbytes).from_buffer(mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv)
    b = _lib.marconi_state_buffer()
    b.base = ctypes.cast(raw, ctypes.POINTER(ctypes.c_uint8))
    b.slot_bytes = nbytes // (slots * layers)
    b.slots = slots
    b.layers = layers
    return b, raw


def _snapshot_call(name: str, b: Any, *args: Any) -> None:
    _check(getattr(_lib.load(), name)(ctypes.byref(b), *args), name)


def snapshot_copy(buffer: Any, slots: int, pairs: Any, layers: int = 1) -> None:
    """Copies slot states in a caller's buffer, a layer-major tensor
    [layers][slots][state] (a numpy array, bytearray, ...): for each
    (src, dst) pair, slot src into slot dst in every layer. Checked whole
    first (marconi_snapshot_copy)."""
    b, keep = _state_buffer(buffer, slots, layers)
    src, n = _pairs_source(pairs, wide=False)
    _snapshot_call("marconi_snapshot_copy", b, _pairs_pointer(src, n, wide=False), n)
    del keep


def snapshot_fork(buffer: Any, slots: int, src: int, dsts: Any, layers: int = 1) -> None:
    """Copies slot `src` into every slot of `dsts` (marconi_snapshot_fork)."""
    b, keep = _state_buffer(buffer, slots, layers)
    d, n = _u32_source(dsts, "dsts")
    _snapshot_call("marconi_snapshot_fork", b, _u32(src, "src"), _u32_pointer(d, n), n)
    del keep


def snapshot_promote(
    buffer: Any, slots: int, state_slot: int, candidates: Any, accepted: int, mode: str = "swap", layers: int = 1
) -> int:
    """Promotes candidates[accepted] (see Pool.promote_state); returns the
    slot holding the request's state."""
    b, keep = _state_buffer(buffer, slots, layers)
    c, n = _u32_source(candidates, "candidates")
    out = ctypes.c_uint32()
    _snapshot_call(
        "marconi_snapshot_promote",
        b,
        _u32(state_slot, "state_slot"),
        _u32_pointer(c, n),
        n,
        _u64(accepted, "accepted"),
        _choice(mode, PROMOTE, "mode"),
        ctypes.byref(out),
    )
    del keep
    return out.value


# -- memory planning -------------------------------------------------------------


def _plan_request(lib: Any, model: Any, budget_bytes: int, page_size: int, state_fraction: float) -> tuple:
    """A marconi_plan_request for these arguments, and what must stay alive
    while it is used."""
    req = _config(lib, _lib.marconi_plan_request)
    keep = _model_into(req, model)
    req.page_size = _u32(page_size, "page_size")
    req.budget_bytes = _u64(budget_bytes, "budget_bytes")
    req.state_fraction = _real(state_fraction, "state_fraction")
    return req, keep


def plan(
    model: Any,
    budget_bytes: int,
    *,
    page_size: int = 16,
    state_fraction: float = 0.5,
    context_tokens: int = 0,
    batch: int = 0,
) -> dict:
    """Memory planning (marconi_plan): for `model` (a preset name or a dict of
    model fields), `page_size`-token KV pages and a device budget, the unit
    sizes, the KV tokens and state slots of the static split at
    `state_fraction`, and with `context_tokens` / `batch` the largest batch
    and context under a static split, AVMP and a padded unified table.
    MarconiError INVALID_CONFIG for a model without recurrent layers, a
    budget below one page and one slot, a fraction outside (0, 1)."""
    lib = _lib.load()
    req, keep = _plan_request(lib, model, budget_bytes, page_size, state_fraction)
    req.context_tokens = _u64(context_tokens, "context_tokens")
    req.batch = _u64(batch, "batch")
    out = _lib.marconi_memory_plan()
    out.struct_size = ctypes.sizeof(out)
    _check(lib.marconi_plan(ctypes.byref(req), ctypes.byref(out)), "marconi_plan")
    del keep
    return {name: getattr(out, name) for name, _ in out._fields_ if name != "struct_size"}


def converged_split(
    model: Any,
    budget_bytes: int,
    requests: Any,
    *,
    page_size: int = 16,
    state_fraction: float = 0.5,
) -> dict:
    """Where AVMP capacity migration takes the split on a trace
    (marconi_plan_converged_split): replays `requests` in order through a
    marconi cache over AVMP pools of `budget_bytes` starting at
    `state_fraction`, and returns the split it settles at
    (`settled_fraction`: the state share to configure a static pool with,
    or to start AVMP from), the final split, the replay's token hit rate and
    the pools' counters (refused, migrations, bytes_migrated,
    evictions_for_memory). Each request is a token sequence (all input) or a
    pair (tokens, input_len) whose first input_len tokens are the input and
    the rest the output. model: a preset name or a dict of model fields.
    Blocks for the replay (about a second for 7,000 requests)."""
    lib = _lib.load()
    req, keep = _plan_request(lib, model, budget_bytes, page_size, state_fraction)
    tokens = array.array("I")
    offs = [0]
    inputs = array.array("I")
    for i, r in enumerate(requests):
        if isinstance(r, tuple):
            if len(r) != 2:
                raise ValueError(f"requests[{i}]: expected tokens or (tokens, input_len)")
            seq, input_len = r
        else:
            seq, input_len = r, None
        src, n = _u32_source(seq, f"requests[{i}]")
        tokens.frombytes(_u32_bytes(src, n))
        offs.append(len(tokens))
        inputs.append(_u32(n if input_len is None else input_len, f"requests[{i}] input_len"))
    n_req = len(offs) - 1
    offsets = (ctypes.c_size_t * len(offs))(*offs)
    tok_ptr = _u32_pointer(tokens, len(tokens))
    in_ptr = _u32_pointer(inputs, n_req)
    out = _lib.marconi_converged_split()
    out.struct_size = ctypes.sizeof(out)
    _check(
        lib.marconi_plan_converged_split(
            ctypes.byref(req), tok_ptr, len(tokens), offsets, len(offs), in_ptr, n_req, ctypes.byref(out)
        ),
        "marconi_plan_converged_split",
    )
    del keep
    return {name: getattr(out, name) for name, _ in out._fields_ if name not in ("struct_size", "reserved")}


# -- the cache over pools -----------------------------------------------------------


@dataclass(frozen=True)
class PooledLookup:
    """What PooledCache.lookup found."""

    lease: int
    """The lease id: pass it to admit, then release."""
    hit_tokens: int
    """Leading tokens the engine may skip."""
    kv_matched_tokens: int
    """Leading tokens whose KV is cached."""
    state_handle: Optional[int]
    """The cache's state slot to resume from (copy it into a slot of the
    request's own with copy_states), or None."""
    kv_pages: "array.array[int]"
    """The cache's page handles of the hit (read them, never free them)."""
    plan: list
    """Positions at which to save states during this prefill."""


@dataclass(frozen=True)
class PooledAdmit:
    """What PooledCache.admit did."""

    taken: list
    """taken[i]: the i-th state's slot is now the cache's."""
    kv_pages_taken: range
    """Indices into the admitted page list of the pages the cache took."""
    returned: "array.array[int]"
    """The caller's pages and slots passed in that the cache did not take
    (still the caller's: free or reuse them)."""
    new_kv_tokens: int
    truncated_to: Optional[int]
    rejected: bool


@dataclass(frozen=True)
class Pools:
    """The library's pools as the memory of a PrefixCache
    (marconi_pool_config), passed as PrefixCache(..., pools=Pools(...)) (or a
    dict of these fields). The cache's capacity is then the pools' budget
    (PrefixCache's capacity_bytes is ignored), admission keeps KV pages and
    state slots as handles, eviction frees them (drain_freed_units), and
    when a pool is short a reservation migrates free capacity (AVMP) before
    evicting by utility.

    budget_bytes: both pools together (memfd and cuda round it down to whole
    chunks). backend: "memfd" (host memory, the default), "none" (handles
    and offsets only) or "cuda". migration: "avmp" or "static".
    state_fraction: the state pool's initial share (0 < f < 1).
    kv_page_bytes / state_slot_bytes: 0 for the model's (128-aligned);
    larger for an engine's padded layout. chunk_bytes: the memfd chunk (0:
    2 MiB). The model must have recurrent layers.
    """

    budget_bytes: int
    backend: str = "memfd"
    migration: str = "avmp"
    state_fraction: float = 0.5
    migration_batch_units: int = 0
    chunk_bytes: int = 0
    kv_page_bytes: int = 0
    state_slot_bytes: int = 0
    cuda_device: int = 0

    def _config(self) -> Any:
        """The marconi_pool_config these stand for (checked)."""
        return _pool_config(
            self.budget_bytes,
            self.kv_page_bytes,
            self.state_slot_bytes,
            self.backend,
            self.migration,
            self.state_fraction,
            self.migration_batch_units,
            self.chunk_bytes,
            self.cuda_device,
        )


def _pools(pools: Any) -> Pools:
    """A Pools from a Pools or a dict of its fields."""
    if isinstance(pools, Pools):
        return pools
    if isinstance(pools, dict):
        known = set(Pools.__dataclass_fields__)
        unknown = sorted(set(pools) - known)
        if unknown:
            raise TypeError(f"pools: unknown field(s) {unknown} (known: {sorted(known)})")
        return Pools(**pools)
    raise TypeError(f"pools: expected a marconi.Pools or a dict, got {type(pools).__name__}")


# The request cycle over pools, shared by PrefixCache(pools=...) and the
# deprecated PooledCache: `o` is a marconi._handle._Handle (with, for views,
# a backend).


def _olist(o: Any, name: str, *args: Any, code: str = "Q") -> "array.array[int]":
    """A list the library writes with the (buf, cap, out_len) convention
    (uint64 handles, or uint32 for code "I")."""
    n = ctypes.c_size_t()
    h = o._begin()
    try:
        while True:
            out = array.array(code, bytes(out_size(code) * max(n.value, 1)))
            ptr = _u64_pointer(out, len(out)) if code == "Q" else _u32_pointer(out, len(out))
            st = getattr(o._lib, name)(h, *args, ptr, len(out), ctypes.byref(n))
            if st == 3 and n.value > len(out):  # BUFFER_TOO_SMALL: grow to the count
                continue
            _check(st, name)
            return out[: n.value]
    finally:
        o._end()


def _pooled_lookup(o: Any, tokens: Any, namespace: int, checkpoints: Any) -> PooledLookup:
    ns = _u64(namespace, "namespace")
    src, n = _u32_source(tokens)
    out = _lib.marconi_pooled_lookup()
    if checkpoints is None:
        o._call("marconi_cache_lookup_pooled", ns, _u32_pointer(src, n), n, ctypes.byref(out))
    else:
        hsrc, hn = _u32_source(checkpoints, "checkpoints")
        o._call(
            "marconi_cache_lookup_pooled_hinted",
            ns,
            _u32_pointer(src, n),
            n,
            _u32_pointer(hsrc, hn),
            hn,
            ctypes.byref(out),
        )
    pages = _olist(o, "marconi_cache_lease_kv_handles", out.lease) if out.n_kv_pages else array.array("Q")
    plan_ = list(_olist(o, "marconi_cache_lease_plan", out.lease, code="I")) if out.n_plan else []
    return PooledLookup(out.lease, out.hit_tokens, out.kv_matched_tokens, out.state_handle or None, pages, plan_)


def _reserve(o: Any, kv_pages: int, state_slots: int) -> tuple:
    kp, ss = _u32(kv_pages, "kv_pages"), _u32(state_slots, "state_slots")
    pages, slots = array.array("Q", bytes(8 * kp)), array.array("Q", bytes(8 * ss))
    o._call("marconi_cache_reserve", kp, ss, _u64_pointer(pages, kp), kp, _u64_pointer(slots, ss), ss)
    return pages, slots


def _admit_pooled(o: Any, lease: Any, tokens: Any, states: Any, kv_pages: Any) -> PooledAdmit:
    lid = _u64(lease.lease if isinstance(lease, PooledLookup) else lease, "lease")
    src, n = _u32_source(tokens)
    pg, npg = _handles(kv_pages, "kv_pages")
    st = list(states)
    arr = (_lib.marconi_pooled_state * max(len(st), 1))()
    for i, s in enumerate(st):
        pos, slot = s
        arr[i].position = _u32(pos, f"states[{i}].position")
        arr[i].state_handle = _u64(slot, f"states[{i}].slot")
    taken = (ctypes.c_uint8 * max(len(st), 1))()
    res = _lib.marconi_admit_result()
    o._call(
        "marconi_cache_admit_pooled",
        lid,
        _u32_pointer(src, n),
        n,
        arr if st else None,
        len(st),
        _u64_pointer(pg, npg),
        npg,
        taken if st else None,
        ctypes.byref(res),
    )
    page_list = array.array("Q", (int(h) for h in pg)) if npg else array.array("Q")
    kv_range = range(res.kv_pages_taken_start, res.kv_pages_taken_end)
    # Pages outside the taken range are the hit's (the cache's) or the
    # caller's, which come back.
    outside = [h for i, h in enumerate(page_list) if i not in kv_range]
    cached = set(_olist(o, "marconi_cache_held")) if outside else set()
    returned = array.array("Q", (h for h in outside if h not in cached))
    flags = [bool(taken[i]) for i in range(len(st))]
    returned.extend(int(st[i][1]) for i in range(len(st)) if not flags[i])
    return PooledAdmit(flags, kv_range, returned, res.new_kv_tokens, res.truncated_to or None, bool(res.rejected))


def _copy_states(o: Any, pairs: Any) -> None:
    src, n = _pairs_source(pairs)
    o._call("marconi_cache_copy_states", _pairs_pointer(src, n), n)


def _pool_stats(o: Any) -> dict:
    s = _stats(o, "marconi_cache_pool_stats", _lib.marconi_pooled_stats)
    out = _fields(s)
    out["backend"] = {v: k for k, v in BACKEND.items()}.get(s.backend, s.backend)
    return out


class PooledCache(PrefixCache):
    """Deprecated (removed in the next release): use
    PrefixCache(..., pools=Pools(...)), whose lookup_pooled, reserve,
    admit_pooled, free_units, release, drain_freed_units, held, resolve,
    view, copy_states, pool_stats and check are this class's lookup,
    reserve, admit, free, release, drain_freed, held, resolve, view,
    copy_states, stats and check (the same calls: a cache over pools is a
    marconi_cache created with marconi_cache_config.pools).

    A prefix cache deciding over real pools: its capacity is what the pools
    hold, admission keeps KV pages and state slots as handles, eviction
    frees them (drain_freed), and when a pool is short a reservation
    migrates free capacity (AVMP) before evicting by utility.

    The request cycle: lookup(tokens) -> reserve(pages, slots) ->
    copy_states([(hit state, own slot)]) -> admit(lease, tokens, states,
    pages) -> free(returned) -> release(lease). model: a preset name or a
    dict of model fields; kv_page_bytes / state_slot_bytes 0: the model's.
    Thread-safe like PrefixCache; close() frees the pools' memory. It is
    a PrefixCache over pools whose pool methods go by these names.
    """

    _NOT_COPIED = "it owns native memory (share the object instead)"
    _NOT_PICKLED = "it owns native memory of this process"

    def __init__(
        self,
        budget_bytes: int,
        model: Any = "paper-7b",
        *,
        page_size: int = 16,
        backend: str = "memfd",
        migration: str = "avmp",
        state_fraction: float = 0.5,
        chunk_bytes: int = 0,
        kv_page_bytes: int = 0,
        state_slot_bytes: int = 0,
        eviction: str = "flop_aware",
        alpha: Optional[float] = None,
        cuda_device: int = 0,
    ):
        pools = Pools(
            budget_bytes=budget_bytes,
            backend=backend,
            migration=migration,
            state_fraction=state_fraction,
            chunk_bytes=chunk_bytes,
            kv_page_bytes=kv_page_bytes,
            state_slot_bytes=state_slot_bytes,
            cuda_device=cuda_device,
        )
        super().__init__(budget_bytes, model, page_size=page_size, eviction=eviction, alpha=alpha, pools=pools)

    def lookup(self, tokens: Any, namespace: int = 0, checkpoints: Any = None) -> PooledLookup:
        """PrefixCache.lookup_pooled."""
        return self.lookup_pooled(tokens, namespace, checkpoints)

    def admit(self, lease: Any, tokens: Any, states: Any = (), kv_pages: Any = ()) -> PooledAdmit:
        """PrefixCache.admit_pooled."""
        return self.admit_pooled(lease, tokens, states, kv_pages)

    def free(self, handles: Any) -> None:
        """PrefixCache.free_units."""
        self.free_units(handles)

    def drain_freed(self) -> "array.array[int]":
        """PrefixCache.drain_freed_units."""
        return self.drain_freed_units()

    def stats(self) -> dict:
        """PrefixCache.pool_stats."""
        return self.pool_stats()
