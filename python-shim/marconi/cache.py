"""The Pythonic API over the C ABI: PrefixCache, Lease, MarconiError."""

from __future__ import annotations

import array
import ctypes
import json
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

from . import _lib
from ._lib import NO_SLOT

Tokens = Union[Sequence[int], "array.array[int]", memoryview, bytes, bytearray]
"""Token ids: a list/tuple of ints, an array.array of 4-byte unsigned ints
('I', or 'L' where it is 4 bytes), or any buffer of native uint32."""

STATUS_NAMES = [
    "OK",
    "NULL_ARGUMENT",
    "INVALID_ARGUMENT",
    "BUFFER_TOO_SMALL",
    "PANIC",
    "POISONED",
    "INVALID_CONFIG",
    "UNKNOWN_PRESET",
    "EMPTY_TOKENS",
    "TOO_MANY_TOKENS",
    "UNKNOWN_LEASE",
    "PREFIX_MISMATCH",
    "BAD_PAGE_LIST",
    "NOT_PLANNED",
    "POSITION_OUT_OF_RANGE",
    "DUPLICATE_POSITION",
    "DUPLICATE_SLOT",
    "DUPLICATE_PAGE",
    "INVARIANT_VIOLATED",
    "UNSUPPORTED_STRUCT_SIZE",
]
"""marconi_status names (without the MARCONI_STATUS_ prefix), by value."""

ADMISSION = {"marconi": 0, "all_blocks": 1, "oracle": 2}
EVICTION = {"lru": 0, "flop_aware": 1}
OBJECTIVE = {"flops_saved": 0, "token_hits": 1}


def status_message(status: int) -> str:
    """The fixed text of a status code (marconi_status_message)."""
    lib = _lib.load()
    n = lib.marconi_status_message(status, None, 0)
    buf = ctypes.create_string_buffer(n + 1)
    lib.marconi_status_message(status, buf, n + 1)
    return buf.value.decode()


def last_error() -> str:
    """This thread's last error detail (marconi_last_error)."""
    lib = _lib.load()
    n = lib.marconi_last_error(None, 0)
    buf = ctypes.create_string_buffer(n + 1)
    lib.marconi_last_error(buf, n + 1)
    return buf.value.decode(errors="replace")


def version() -> str:
    """The library version (marconi_version)."""
    return _lib.load().marconi_version().decode()


class MarconiError(Exception):
    """A call refused by libmarconi. `status` is the marconi_status value,
    `name` its name (e.g. "UNKNOWN_LEASE"), `detail` the last-error text
    (e.g. "marconi_cache_lookup: tokens is NULL but length is 12"). A refused
    call changed nothing in the cache."""

    def __init__(self, status: int, detail: str):
        self.status = status
        self.name = STATUS_NAMES[status] if status < len(STATUS_NAMES) else f"STATUS_{status}"
        self.detail = detail
        super().__init__(f"{self.name}: {status_message(status)} ({detail})")


def _check(status: int) -> None:
    if status != 0:
        raise MarconiError(status, last_error())


def _u32_array(tokens: Tokens, what: str = "tokens"):
    """A ctypes uint32 array over `tokens` (zero-copy for writable uint32
    buffers), and its length."""
    if isinstance(tokens, (bytes, bytearray, memoryview, array.array)):
        mv = memoryview(tokens)
        if mv.format in ("I", "L", "=I", "<I") and mv.itemsize == 4:
            n = mv.nbytes // 4
            arr_t = ctypes.c_uint32 * n
            if n == 0:
                return None, 0
            if mv.readonly or not mv.c_contiguous:
                return arr_t.from_buffer_copy(mv), n
            return arr_t.from_buffer(mv), n
        if isinstance(tokens, (bytes, bytearray)) or mv.format == "B":
            if mv.nbytes % 4:
                raise ValueError(f"{what}: a byte buffer of {mv.nbytes} bytes is not uint32s")
            n = mv.nbytes // 4
            return ((ctypes.c_uint32 * n).from_buffer_copy(mv) if n else None), n
        tokens = mv.tolist()
    seq = list(tokens)
    for t in seq:
        if not isinstance(t, int) or not 0 <= t <= 0xFFFF_FFFF:
            raise ValueError(f"{what}: {t!r} is not a uint32 token id")
    n = len(seq)
    return ((ctypes.c_uint32 * n)(*seq) if n else None), n


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


class Lease:
    """The result of a lookup, pinning what the request reuses until
    released. A context manager: leaving the `with` block releases it (if not
    released already)."""

    def __init__(self, cache: "PrefixCache", raw: Any, kv_pages: list[int], plan: list[int]):
        self._cache = cache
        self.id: int = raw.lease
        """The lease id (never reused, never valid in another cache)."""
        self.hit_tokens: int = raw.hit_tokens
        """Leading tokens the engine may skip (< input length)."""
        self.kv_matched_tokens: int = raw.kv_matched_tokens
        """Leading tokens whose KV is cached (hit or not)."""
        self.state_slot: Optional[int] = None if raw.state_slot == NO_SLOT else raw.state_slot
        """The cached state slot to resume from, or None."""
        self.copy_order: Optional[tuple[int, int]] = (
            (raw.copy_order.src_slot, raw.copy_order.dst_slot) if raw.n_copy_orders else None
        )
        """(src_slot, dst_slot) to copy before resuming, or None."""
        self.kv_pages: list[int] = kv_pages
        """KV page ids of the first hit_tokens tokens (when pages are tracked)."""
        self.plan: list[int] = plan
        """Positions at which to save recurrent states during this prefill."""
        self.released = False

    def admit(self, tokens: Tokens, states: Iterable = (), kv_pages: Optional[Tokens] = None) -> AdmitResult:
        """PrefixCache.admit under this lease."""
        return self._cache.admit(self, tokens, states, kv_pages)

    def release(self) -> None:
        """Releases the lease (PrefixCache.release)."""
        self._cache.release(self)

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, *exc) -> None:
        if not self.released:
            self.release()

    def __repr__(self) -> str:
        return (
            f"Lease(id={self.id}, hit_tokens={self.hit_tokens}, "
            f"kv_matched_tokens={self.kv_matched_tokens}, state_slot={self.state_slot}, "
            f"plan={self.plan})"
        )


class PrefixCache:
    """A libmarconi prefix cache (marconi_cache). Safe to share between
    threads (the library locks internally; ctypes releases the GIL during
    calls). Close it with close() or a `with` block.

    model: a preset name ("paper-7b", "jamba-1.5-mini", "nemotron-h-8b", ...)
    or a dict of marconi_model_spec fields. alpha: None for online tuning,
    or a fixed float.
    """

    def __init__(
        self,
        capacity_bytes: int,
        model: Union[str, dict] = "paper-7b",
        *,
        page_size: int = 1,
        checkpoint_grid: int = 1,
        admission: str = "marconi",
        block_size: int = 32,
        eviction: str = "flop_aware",
        alpha: Optional[float] = None,
        tuner_grid: Optional[Sequence[float]] = None,
        tuner_objective: str = "flops_saved",
        tuner_threads: int = 0,
        decision_log: bool = False,
        protect_branch_states: bool = True,
    ):
        lib = _lib.load()
        cfg = _lib.marconi_cache_config()
        _check(lib.marconi_cache_config_init(ctypes.byref(cfg), ctypes.sizeof(cfg)))
        if isinstance(model, str):
            preset = model.encode()
            cfg.model_preset = preset
        else:
            for k, v in model.items():
                if k not in dict(_lib.marconi_model_spec._fields_):
                    raise ValueError(f"unknown model field {k!r}")
                setattr(cfg.model, k, v)
        if admission not in ADMISSION or eviction not in EVICTION or tuner_objective not in OBJECTIVE:
            raise ValueError("admission, eviction or tuner_objective is not a known policy")
        cfg.capacity_bytes = capacity_bytes
        cfg.page_size = page_size
        cfg.checkpoint_grid = checkpoint_grid
        cfg.admission = ADMISSION[admission]
        cfg.block_size = block_size
        cfg.eviction = EVICTION[eviction]
        cfg.decision_log = int(decision_log)
        cfg.protect_branch_states = int(protect_branch_states)
        cfg.tuner_objective = OBJECTIVE[tuner_objective]
        cfg.tuner_threads = tuner_threads
        if alpha is None:
            cfg.alpha_mode = 1
        else:
            cfg.alpha_mode = 0
            cfg.alpha = alpha
        grid = None
        if tuner_grid is not None:
            grid = (ctypes.c_double * len(tuner_grid))(*tuner_grid)
            cfg.tuner_grid = ctypes.cast(grid, ctypes.POINTER(ctypes.c_double))
            cfg.tuner_grid_len = len(tuner_grid)
        handle = ctypes.c_void_p()
        _check(lib.marconi_cache_new(ctypes.byref(cfg), ctypes.byref(handle)))
        self._lib = lib
        self._handle: Optional[ctypes.c_void_p] = handle
        self._close_lock = threading.Lock()
        self.page_size = page_size

    # -- lifetime --------------------------------------------------------

    def close(self) -> None:
        """Frees the cache (marconi_cache_free). Idempotent; no call may run
        concurrently with it."""
        with self._close_lock:
            h, self._handle = self._handle, None
        if h is not None:
            self._lib.marconi_cache_free(h)

    def __enter__(self) -> "PrefixCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    @property
    def handle(self) -> ctypes.c_void_p:
        """The raw marconi_cache pointer (for passing to other C code)."""
        if self._handle is None:
            raise ValueError("the cache is closed")
        return self._handle

    # -- the request cycle -----------------------------------------------

    def lookup(self, tokens: Tokens, namespace: int = 0, dst_slot: Optional[int] = None) -> Lease:
        """Looks up `tokens`: the usable hit, the KV pages and plan, and a
        lease (release it, or use it as a context manager). With `dst_slot`
        (the request's own state slot) the lease carries the copy order when
        the hit resumes from a cached slot."""
        arr, n = _u32_array(tokens)
        raw = _lib.marconi_lookup()
        h = self.handle
        _check(
            self._lib.marconi_cache_lookup(
                h, namespace, arr, n, NO_SLOT if dst_slot is None else dst_slot, ctypes.byref(raw)
            )
        )
        pages = self._lease_list(self._lib.marconi_cache_lease_kv_pages, raw.lease, raw.n_kv_pages)
        plan = self._lease_list(self._lib.marconi_cache_lease_plan, raw.lease, raw.n_plan)
        return Lease(self, raw, pages, plan)

    def _lease_list(self, fn, lease: int, n: int) -> list[int]:
        buf = (ctypes.c_uint32 * max(n, 1))()
        out = ctypes.c_size_t()
        _check(fn(self.handle, lease, buf, n, ctypes.byref(out)))
        return list(buf[: out.value])

    def plan(self, lease: Union[Lease, int]) -> list[int]:
        """The checkpoint positions planned for a lease."""
        lid = lease.id if isinstance(lease, Lease) else lease
        out = ctypes.c_size_t()
        st = self._lib.marconi_cache_lease_plan(self.handle, lid, None, 0, ctypes.byref(out))
        if st not in (0, 3):
            _check(st)
        return self._lease_list(self._lib.marconi_cache_lease_plan, lid, out.value)

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
        lid = lease.id if isinstance(lease, Lease) else lease
        arr, n = _u32_array(tokens)
        st_list = [(p, NO_SLOT if s is None else s) for p, s in states]
        st_arr = (_lib.marconi_saved_state * len(st_list))(*st_list) if st_list else None
        pages, n_pages = _u32_array(kv_pages if kv_pages is not None else [], "kv_pages")
        taken = (ctypes.c_uint8 * len(st_list))() if st_list else None
        raw = _lib.marconi_admit_result()
        _check(
            self._lib.marconi_cache_admit(
                self.handle, lid, arr, n, st_arr, len(st_list), pages, n_pages, taken, ctypes.byref(raw)
            )
        )
        return AdmitResult(
            states_taken=raw.states_taken,
            slots_returned=raw.slots_returned,
            kv_pages_taken=range(raw.kv_pages_taken_start, raw.kv_pages_taken_end),
            new_kv_tokens=raw.new_kv_tokens,
            truncated_to=raw.truncated_to or None,
            rejected=bool(raw.rejected),
            taken=[bool(t) for t in taken] if taken is not None else [],
        )

    def release(self, lease: Union[Lease, int]) -> None:
        """Releases a lease; MarconiError(UNKNOWN_LEASE) if already released."""
        lid = lease.id if isinstance(lease, Lease) else lease
        _check(self._lib.marconi_cache_release(self.handle, lid))
        if isinstance(lease, Lease):
            lease.released = True

    def serve(self, input: Tokens, output: Tokens = (), namespace: int = 0, slots=None) -> Lease:
        """One whole request as an engine runs it: lookup, save a state at
        every planned position and at the end, admit input + output, release.
        `slots` is an optional callable returning a fresh slot id per state.
        Returns the (released) lease with the lookup's results."""
        inp = list(input) if not isinstance(input, list) else input
        full = inp + list(output)
        with self.lookup(inp, namespace) as lease:
            final = len(full) - len(full) % self.page_size
            positions = list(lease.plan)
            if final > 0 and final not in positions:
                positions.append(final)
            states = [(p, slots() if slots else None) for p in positions]
            lease.admit(full, states)
        return lease

    # -- eviction, stats, log ----------------------------------------------

    def drain_freed(self) -> tuple[list[int], list[int]]:
        """(kv page ids, state slot ids) freed by evictions since the last
        drain; the engine may reuse them."""
        h = self.handle
        while True:
            np_, ns_ = ctypes.c_size_t(), ctypes.c_size_t()
            st = self._lib.marconi_cache_drain_freed(h, None, 0, ctypes.byref(np_), None, 0, ctypes.byref(ns_))
            if st == 0:
                return [], []
            if st != 3:
                _check(st)
            pages = (ctypes.c_uint32 * max(np_.value, 1))()
            slots = (ctypes.c_uint32 * max(ns_.value, 1))()
            st = self._lib.marconi_cache_drain_freed(
                h, pages, np_.value, ctypes.byref(np_), slots, ns_.value, ctypes.byref(ns_)
            )
            if st == 3:  # another thread added ids in between: ask again
                continue
            _check(st)
            return list(pages[: np_.value]), list(slots[: ns_.value])

    def evict(self, nbytes: int) -> int:
        """Evicts until `nbytes` are free (or nothing evictable is left);
        returns the bytes now free."""
        out = ctypes.c_uint64()
        _check(self._lib.marconi_cache_evict(self.handle, nbytes, ctypes.byref(out)))
        return out.value

    def stats(self) -> dict:
        """Counters and gauges (marconi_stats) as a dict."""
        s = _lib.marconi_stats()
        s.struct_size = ctypes.sizeof(s)
        _check(self._lib.marconi_cache_stats(self.handle, ctypes.byref(s)))
        return {name: getattr(s, name) for name, _ in s._fields_ if name != "struct_size"}

    def drain_log(self) -> list[dict]:
        """Decision-log records since the last drain (decision_log=True), as
        dicts parsed from the JSON lines."""
        h = self.handle
        out = []
        n = ctypes.c_size_t()
        cap = 1 << 16
        while True:
            buf = ctypes.create_string_buffer(cap)
            st = self._lib.marconi_cache_drain_log(h, buf, cap, ctypes.byref(n))
            if st == 3:
                cap = max(cap * 2, n.value)
                continue
            _check(st)
            if n.value == 0:
                return out
            out.extend(json.loads(line) for line in buf.raw[: n.value].decode().splitlines())

    def check(self) -> None:
        """Checks the internal invariants (MarconiError(INVARIANT_VIOLATED))."""
        _check(self._lib.marconi_cache_check(self.handle))
