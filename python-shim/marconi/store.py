"""The store tier (docs/store.md) over the C ABI: KV blocks and recurrent
states to and from a directory, Redis/Valkey, or your own store through
callbacks, in checked envelopes. A store that is down, slow or returns
garbage gives misses (counted in stats()), never a wrong value.

    st = marconi.Store("redis", "redis://127.0.0.1:6379/0", model="nemotron-h-8b bf16 tp1", block_size=16)
    st.put_state(tokens, len(tokens), state_bytes)
    state = st.get_state(tokens, len(tokens))        # bytes, or None on a miss
    n = st.kv_prefix(tokens)                         # blocks the store says it has
    blocks = st.get_kv(tokens, 0, block_bytes, n)    # the verified ones, in order

Your own store: Store("callback", model=..., block_size=..., callbacks=obj)
where obj has get(name) -> Optional[bytes], put(name, data), exists(name) ->
bool and delete(name); an exception in one of them is a failed call (a miss).
"""

from __future__ import annotations

import ctypes
from typing import Any, Optional, Sequence

from . import _convert, _lib
from ._convert import _cstr
from ._errors import _check, _config
from ._handle import _Handle

BACKENDS = {"dir": 0, "redis": 1, "callback": 2}


def _uint(value: Any, name: str, bits: int) -> int:
    """`value` checked as TieredCache checks its ints: TypeError for a
    non-integer (bool included), OutOfRangeError (a ValueError and an
    OverflowError) outside 0 .. 2**bits - 1."""
    return _convert._uint(value, name, 2**bits - 1)


def _state_bytes(data: Any) -> bytes:
    """A state's bytes: bytes, bytearray, memoryview or another buffer
    (an int would make bytes(5) five zero bytes; a str has no byte form)."""
    if isinstance(data, (bytes, bytearray)):
        return bytes(data)
    if isinstance(data, (str, int)) or not _has_buffer(data):
        raise TypeError(f"data: expected bytes or a buffer, got {type(data).__name__}")
    return bytes(memoryview(data).cast("B"))


def _has_buffer(obj: Any) -> bool:
    try:
        memoryview(obj)
    except TypeError:
        return False
    return True


def _tokens(tokens: Sequence[int]) -> tuple[Any, int]:
    n = len(tokens)
    for t in tokens:
        _uint(t, "token", 32)
    return (ctypes.c_uint32 * max(n, 1))(*tokens), n


class _Adapter:
    """Turns a Python object's methods into the C callbacks (kept alive as
    long as the store)."""

    def __init__(self, obj: Any):
        self.obj = obj
        self.get = _lib.marconi_store_get_fn(self._get)
        self.put = _lib.marconi_store_put_fn(self._put)
        self.exists = _lib.marconi_store_exists_fn(self._exists)
        self.delete = _lib.marconi_store_delete_fn(self._delete)

    def _get(self, _user, name, buf, cap, length):
        try:
            v = self.obj.get(name.decode())
            if v is None:
                return _lib.STORE_CB_ABSENT
            v = bytes(v)
            length[0] = len(v)
            if len(v) > cap:
                return _lib.STORE_CB_TOO_SMALL
            ctypes.memmove(buf, v, len(v))
            return _lib.STORE_CB_OK
        except Exception:  # a failed call: a miss, never an exception into C
            return -1

    def _put(self, _user, name, data, length):
        try:
            self.obj.put(name.decode(), ctypes.string_at(data, length) if length else b"")
            return _lib.STORE_CB_OK
        except Exception:
            return -1

    def _exists(self, _user, name):
        try:
            return _lib.STORE_CB_OK if self.obj.exists(name.decode()) else _lib.STORE_CB_ABSENT
        except Exception:
            return -1

    def _delete(self, _user, name):
        try:
            self.obj.delete(name.decode())
            return _lib.STORE_CB_OK
        except Exception:
            return -1


class Store(_Handle):
    """A store handle (marconi_store). Thread-safe; close() (or `with`)
    frees it."""

    _WHAT = "store"
    _FREE = "marconi_store_free"

    def __init__(
        self,
        backend: str,
        location: Optional[str] = None,
        *,
        model: str,
        block_size: int,
        prefix: Optional[str] = None,
        namespace: Optional[str] = None,
        seed: Optional[str] = None,
        ns: int = 0,
        layout_version: int = 1,
        timeout_ms: int = 50,
        connect_timeout_ms: int = 50,
        max_value_bytes: int = 256 << 20,
        ttl_s: int = 0,
        callbacks: Any = None,
    ):
        self._guard_init()
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {sorted(BACKENDS)}")
        if (backend == "callback") != (callbacks is not None):
            raise ValueError("callbacks are given exactly with the 'callback' backend")
        lib = _lib.load()
        cfg = _config(lib, _lib.marconi_store_config)
        keep = [_cstr(location, "location"), _cstr(model, "model"), _cstr(prefix, "prefix"),
                _cstr(namespace, "namespace"), _cstr(seed, "seed")]
        cfg.backend = BACKENDS[backend]
        cfg.location, cfg.model, cfg.prefix, cfg.namespace_, cfg.seed = keep
        cfg.ns = _uint(ns, "ns", 64)
        cfg.block_size = _uint(block_size, "block_size", 32)
        cfg.layout_version = _uint(layout_version, "layout_version", 32)
        cfg.timeout_ms = _uint(timeout_ms, "timeout_ms", 32)
        cfg.connect_timeout_ms = _uint(connect_timeout_ms, "connect_timeout_ms", 32)
        cfg.max_value_bytes = _uint(max_value_bytes, "max_value_bytes", 64)
        cfg.ttl_s = _uint(ttl_s, "ttl_s", 64)
        self._adapter = None
        if callbacks is not None:
            self._adapter = _Adapter(callbacks)
            cfg.get, cfg.put = self._adapter.get, self._adapter.put
            cfg.exists = self._adapter.exists
            setattr(cfg, "del", self._adapter.delete)  # `del` is a Python keyword
        h = ctypes.c_void_p()
        _check(lib.marconi_store_new(ctypes.byref(cfg), ctypes.byref(h)), "marconi_store_new")
        self._adopt(lib, h)
        self.max_value_bytes = max_value_bytes
        self._hint = 1 << 20

    def _fn(self, name: str, ns: Optional[int]) -> tuple[str, tuple]:
        """The C function and its leading arguments after the handle: the
        `_ns` variant with `ns` when given, else the plain one (the handle's
        configured ns)."""
        if ns is None:
            return name, ()
        return name + "_ns", (_uint(ns, "ns", 64),)

    def put_state(self, tokens: Sequence[int], position: int, data: bytes, *, ns: Optional[int] = None) -> None:
        """Writes the state after tokens[:position] (`data`: bytes or a
        buffer) in cache namespace `ns` (None: the handle's `ns`, 0 by
        default); read only by calls in the same namespace. Raises
        MarconiError (BACKEND_FAILURE) when the store did not take it."""
        t, n = _tokens(tokens)
        position = _uint(position, "position", 64)
        data = _state_bytes(data)
        fn, pre = self._fn("marconi_store_put_state", ns)
        buf = (ctypes.c_uint8 * max(len(data), 1)).from_buffer_copy(data or b"\0")
        self._call(fn, *pre, t, n, position, buf, len(data))

    def get_state(
        self, tokens: Sequence[int], position: int, max_bytes: Optional[int] = None, *, ns: Optional[int] = None
    ) -> Optional[bytes]:
        """The state after tokens[:position], or None on a miss. The buffer
        starts at the last state's size (1 MiB at first) and grows once when
        the state is larger (a second read); `max_bytes` caps it
        (MarconiError BUFFER_TOO_SMALL beyond)."""
        t, n = _tokens(tokens)
        limit = self.max_value_bytes if max_bytes is None else _uint(max_bytes, "max_bytes", 64)
        position = _uint(position, "position", 64)
        fn, pre = self._fn("marconi_store_get_state", ns)
        cap = min(self._hint, limit)
        length, found = ctypes.c_size_t(0), ctypes.c_uint32(0)
        for _ in range(2):
            buf = (ctypes.c_uint8 * max(cap, 1))()
            h = self._begin()
            try:
                st = getattr(self._lib, fn)(h, *pre, t, n, position, buf, cap,
                                            ctypes.byref(length), ctypes.byref(found))
            finally:
                self._end()
            if st == 3 and length.value <= limit and length.value > cap:  # BUFFER_TOO_SMALL
                cap = length.value
                continue
            _check(st, fn)
            break
        if not found.value:
            return None
        self._hint = max(length.value, 1)
        return ctypes.string_at(buf, length.value)

    def delete_state(self, tokens: Sequence[int], position: int, *, ns: Optional[int] = None) -> None:
        """Removes the state after tokens[:position] (namespace `ns`)."""
        t, n = _tokens(tokens)
        position = _uint(position, "position", 64)
        fn, pre = self._fn("marconi_store_delete_state", ns)
        self._call(fn, *pre, t, n, position)

    def put_kv(self, tokens: Sequence[int], first_block: int, blocks: Sequence[bytes], *,
               ns: Optional[int] = None) -> None:
        """Writes KV blocks first_block.. of tokens' full blocks (all of one
        size; namespace `ns`)."""
        if not blocks or len({len(b) for b in blocks}) != 1:
            raise ValueError("blocks: at least one, all of the same size")
        t, n = _tokens(tokens)
        first_block = _uint(first_block, "first_block", 64)
        data = b"".join(_state_bytes(b) for b in blocks)
        fn, pre = self._fn("marconi_store_put_kv", ns)
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data) if data else None
        self._call(fn, *pre, t, n, first_block, len(blocks), buf, len(blocks[0]))

    def get_kv(self, tokens: Sequence[int], first_block: int, block_bytes: int, max_blocks: int, *,
               ns: Optional[int] = None) -> list[bytes]:
        """The verified KV blocks from first_block (each block_bytes long),
        up to the first miss, at most max_blocks (namespace `ns`)."""
        t, n = _tokens(tokens)
        first_block = _uint(first_block, "first_block", 64)
        _uint(block_bytes, "block_bytes", 64)
        cap = block_bytes * _uint(max_blocks, "max_blocks", 32)
        fn, pre = self._fn("marconi_store_get_kv", ns)
        buf = (ctypes.c_uint8 * max(cap, 1))()
        got = ctypes.c_size_t(0)
        self._call(fn, *pre, t, n, first_block, block_bytes, buf if cap else None, cap, ctypes.byref(got))
        raw = ctypes.string_at(buf, got.value * block_bytes)
        return [raw[i * block_bytes:(i + 1) * block_bytes] for i in range(got.value)]

    def kv_prefix(self, tokens: Sequence[int], *, ns: Optional[int] = None) -> int:
        """How many of tokens' full blocks, from block 0, the store says it
        has in namespace `ns` (a hint; get_kv verifies)."""
        t, n = _tokens(tokens)
        fn, pre = self._fn("marconi_store_kv_prefix", ns)
        got = ctypes.c_size_t(0)
        self._call(fn, *pre, t, n, ctypes.byref(got))
        return got.value

    def stats(self) -> dict[str, int]:
        """Hits, misses by kind, writes (marconi_store_get_stats)."""
        s = _lib.marconi_store_stats()
        s.struct_size = ctypes.sizeof(s)
        self._call("marconi_store_get_stats", ctypes.byref(s))
        return {f: getattr(s, f) for f in _lib.STORE_STATS_FIELDS}
