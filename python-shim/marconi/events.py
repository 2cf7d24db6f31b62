"""Cache events as vLLM KV cache events (docs/events.md), over the C ABI.

    cache = marconi.PrefixCache(capacity_bytes=..., page_size=16)
    ev = marconi.CacheEvents(cache)                 # turns the stream on
    ...                                             # serve requests
    payload = ev.drain()                            # one msgpack KVEventBatch, b"" if nothing changed
    sock.send_multipart([topic, seq.to_bytes(8, "big"), payload])   # publish it yourself

or let libmarconi publish with vLLM's framing (the default build has the
publisher, pure Rust; has_publisher() says whether the loaded library does):

    ev = marconi.CacheEvents(cache, endpoint="tcp://*:5557", replay_endpoint="tcp://*:5558")
    seq = ev.publish()                              # None if nothing changed
"""

from __future__ import annotations

import ctypes
import math
import time
from typing import Optional

from . import _lib
from ._convert import _cstr, _real
from ._errors import _check, _config
from ._handle import _Handle
from .cache import PrefixCache

HASH_FORMAT = {"int": 0, "bytes": 1}
LAYOUT = {"map": 0, "array": 1}
NAMESPACES = {"cache_salt": 0, "lora": 1, "extra_keys": 2}
"""How a namespace n != 0 is published: vLLM's cache_salt "n" (default),
vLLM's LoRA adapter named "n", or the earlier extra keys [n]."""
NO_SEQ = 2**64 - 1
"""MARCONI_NO_SEQ: marconi_events_publish published nothing."""


def has_publisher() -> bool:
    """Whether the loaded libmarconi has the ZeroMQ publisher."""
    return bool(_lib.load().marconi_events_has_publisher())


def _ts(ts: Optional[float]) -> float:
    if ts is None:
        return time.time()
    t = _real(ts, "ts")
    if not math.isfinite(t):
        raise ValueError(f"ts: {t} is not a finite number of seconds")
    return t


class CacheEvents(_Handle):
    """The event stream of one PrefixCache (marconi_events). One per cache.
    Close it (or use `with`) before or after the cache; closing it turns the
    cache's stream off. Thread-safe."""

    _WHAT = "events handle"

    def __init__(
        self,
        cache: PrefixCache,
        *,
        states: bool = True,
        hash_format: str = "int",
        layout: str = "map",
        seed: Optional[str] = None,
        medium: str = "GPU",
        data_parallel_rank: int = 0,
        endpoint: Optional[str] = None,
        replay_endpoint: Optional[str] = None,
        topic: str = "",
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        max_queue: int = 100_000,
        replay_topic: bool = True,
        namespaces: str = "cache_salt",
    ):
        self._guard_init()
        if not isinstance(cache, PrefixCache):
            raise TypeError("cache: expected a marconi.PrefixCache")
        if hash_format not in HASH_FORMAT or layout not in LAYOUT:
            raise ValueError(f"hash_format must be one of {sorted(HASH_FORMAT)}, layout one of {sorted(LAYOUT)}")
        if namespaces not in NAMESPACES:
            raise ValueError(f"namespaces must be one of {sorted(NAMESPACES)}")
        for name, v in (("data_parallel_rank", data_parallel_rank), ("buffer_steps", buffer_steps),
                        ("hwm", hwm), ("max_queue", max_queue)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{name}: expected an int")
        if not (-(2**63) <= data_parallel_rank < 2**63 and 0 < buffer_steps < 2**64
                and 0 <= hwm < 2**31 and 0 < max_queue < 2**31):
            raise ValueError("data_parallel_rank, buffer_steps, hwm or max_queue out of range")
        lib = _lib.load()
        cfg = _config(lib, _lib.marconi_events_config)
        # Keep the encoded strings alive until marconi_events_new returns.
        keep = [_cstr(seed, "seed"), _cstr(medium, "medium"), _cstr(endpoint, "endpoint"),
                _cstr(replay_endpoint, "replay_endpoint"), _cstr(topic, "topic")]
        cfg.states = int(bool(states))
        cfg.hash_format = HASH_FORMAT[hash_format]
        cfg.layout = LAYOUT[layout]
        cfg.seed, cfg.medium, cfg.endpoint, cfg.replay_endpoint, cfg.topic = keep
        cfg.data_parallel_rank = data_parallel_rank
        cfg.buffer_steps = buffer_steps
        cfg.hwm = hwm
        cfg.max_queue = max_queue
        cfg.replay_topic = int(bool(replay_topic))
        cfg.namespaces = NAMESPACES[namespaces]
        h = ctypes.c_void_p()
        with cache._using() as ch:
            _check(lib.marconi_events_new(ch, ctypes.byref(cfg), ctypes.byref(h)), "marconi_events_new")
        self._cache = cache
        self._adopt(lib, h)

    def _call_bytes(self, fn_name: str, ts: Optional[float]) -> bytes:
        ts = _ts(ts)
        fn = getattr(self._lib, fn_name)
        n = ctypes.c_size_t(0)
        cap = 1 << 16
        with self._using() as h, self._cache._using() as ch:
            while True:
                buf = (ctypes.c_uint8 * cap)()
                st = fn(h, ch, ts, buf, cap, ctypes.byref(n))
                if st == 3:  # BUFFER_TOO_SMALL: n holds the size
                    cap = n.value
                    continue
                _check(st, fn_name)
                return bytes(buf[: n.value])

    def drain(self, ts: Optional[float] = None) -> bytes:
        """The changes since the last drain as one msgpack KVEventBatch
        (b"" when nothing changed). `ts`: the batch's timestamp (default now)."""
        return self._call_bytes("marconi_events_drain", ts)

    def snapshot(self, ts: Optional[float] = None) -> bytes:
        """A batch that rebuilds the cache's current content from any view
        (AllBlocksCleared first). Does not drain."""
        return self._call_bytes("marconi_events_snapshot", ts)

    def publish(self, ts: Optional[float] = None) -> Optional[int]:
        """Drains and publishes the changes as one batch; its sequence
        number, or None when nothing changed."""
        ts = _ts(ts)
        seq = ctypes.c_uint64()
        with self._using() as h, self._cache._using() as ch:
            _check(self._lib.marconi_events_publish(h, ch, ts, ctypes.byref(seq)), "marconi_events_publish")
        return None if seq.value == NO_SEQ else seq.value

    def _endpoint(self, which: int) -> str:
        n = ctypes.c_size_t(0)
        buf = ctypes.create_string_buffer(1024)
        self._call("marconi_events_endpoint", which, buf, 1024, ctypes.byref(n))
        return buf.raw[: n.value].decode()

    @property
    def endpoint(self) -> str:
        """The PUB endpoint as bound ("tcp://127.0.0.1:40123" for a "*" port)."""
        return self._endpoint(0)

    @property
    def replay_endpoint(self) -> str:
        """The replay ROUTER endpoint as bound."""
        return self._endpoint(1)

    def _free_native(self, h) -> None:
        """Frees the handle (stopping its publisher) and turns the cache's
        stream off (the cache is left alone once it is closed)."""
        try:
            ch = self._cache._begin()
        except ValueError:  # the cache is closed already
            self._lib.marconi_events_free(h, None)
            return
        try:
            self._lib.marconi_events_free(h, ch)
        finally:
            self._cache._end()
