"""The store tier through the C ABI (marconi.Store, docs/store.md): the
directory, a real redis-server started here on 127.0.0.1 (skipped when the
binary is absent, failed instead with MARCONI_STORE_STRICT=1), and a store
of Python callbacks; faults read as misses, bad input as MarconiError."""

import ctypes
import os
import time

import pytest
from conftest import free_port, running_redis

import marconi
from marconi import _lib

TOKENS = list(range(100, 140))  # 40 tokens: 5 blocks of 8
STATE = bytes((i * 7) & 0xFF for i in range(50_000))


def store(tmp_path, **kw):
    args = dict(model="model-a", block_size=8, max_value_bytes=1 << 20)
    args.update(kw)
    return marconi.Store("dir", str(tmp_path), **args)


def test_dir_round_trip_sharing_and_separation(tmp_path):
    with store(tmp_path) as a, store(tmp_path) as b, store(tmp_path, model="model-b") as other:
        a.put_state(TOKENS, 33, STATE)
        assert a.get_state(TOKENS, 33) == STATE
        assert b.get_state(TOKENS, 33) == STATE, "two engines of one model share"
        assert other.get_state(TOKENS, 33) is None, "two models never do"
        assert a.get_state(TOKENS, 32) is None
        blocks = [bytes([i]) * 1024 for i in range(5)]
        a.put_kv(TOKENS, 0, blocks)
        assert b.kv_prefix(TOKENS) == 5 and b.kv_prefix(TOKENS[:20]) == 2
        assert b.get_kv(TOKENS, 0, 1024, 10) == blocks
        assert b.get_kv(TOKENS, 3, 1024, 10) == blocks[3:]
        assert b.get_kv(TOKENS, 0, 1000, 10) == [], "another block size"
        a.delete_state(TOKENS, 33)
        assert a.get_state(TOKENS, 33) is None
        s = a.stats()
        assert (s["hits"], s["absent"], s["puts"], s["bytes_written"]) == (1, 2, 6, len(STATE) + 5 * 1024)


def test_dir_corrupt_truncated_swapped_objects_are_counted_misses(tmp_path):
    with store(tmp_path) as a:
        a.put_state(TOKENS, 16, STATE)
        a.put_state(TOKENS, 24, STATE[::-1])
        files = {p.name: p for p in tmp_path.iterdir()}
        assert len(files) == 2 and all(n.startswith("marconi-st-") for n in files)
        assert a.get_state(TOKENS, 16) == STATE
        p16 = next(p for p in files.values() if p.read_bytes().endswith(STATE))
        p24 = next(p for p in files.values() if p != p16)
        good = p16.read_bytes()
        p16.write_bytes(good[:-1])
        assert a.get_state(TOKENS, 16) is None
        bad = bytearray(good)
        bad[1000] ^= 1
        p16.write_bytes(bytes(bad))
        assert a.get_state(TOKENS, 16) is None
        p16.write_bytes(p24.read_bytes())
        assert a.get_state(TOKENS, 16) is None
        s = a.stats()
        assert (s["hits"], s["truncated"], s["corrupt"], s["wrong_key"]) == (1, 1, 1, 1)


def test_bad_input_is_refused(tmp_path):
    with store(tmp_path) as a:
        for call, name in [
            (lambda: a.get_state(TOKENS, 0), "POSITION_OUT_OF_RANGE"),
            (lambda: a.get_state(TOKENS, 41), "POSITION_OUT_OF_RANGE"),
            (lambda: a.put_state(TOKENS, 41, b"x"), "POSITION_OUT_OF_RANGE"),
            (lambda: a.get_state([], 1), "EMPTY_TOKENS"),
            (lambda: a.put_state(TOKENS, 8, bytes(2 << 20)), "INVALID_ARGUMENT"),
            (lambda: a.put_kv(TOKENS, 4, [b"a", b"b"]), "INVALID_ARGUMENT"),
            (lambda: a.get_kv(TOKENS, 9, 16, 1), "INVALID_ARGUMENT"),
        ]:
            with pytest.raises(marconi.MarconiError) as e:
                call()
            assert e.value.name == name, e.value
        a.put_state(TOKENS, 8, STATE)
        with pytest.raises(marconi.MarconiError) as e:
            a.get_state(TOKENS, 8, max_bytes=100)
        assert e.value.name == "BUFFER_TOO_SMALL"
        with pytest.raises(ValueError):
            a.get_state([2**32], 1)
    for kw, name in [
        (dict(block_size=0), "INVALID_CONFIG"),
        (dict(timeout_ms=0), "INVALID_CONFIG"),
        (dict(prefix="../x"), "INVALID_CONFIG"),
        (dict(max_value_bytes=0), "INVALID_CONFIG"),
    ]:
        with pytest.raises(marconi.MarconiError) as e:
            store(tmp_path, **kw)
        assert e.value.name == name, kw
    with pytest.raises(marconi.MarconiError) as e:
        marconi.Store("redis", "not a url", model="m", block_size=8)
    assert e.value.name == "INVALID_CONFIG"
    with pytest.raises(marconi.MarconiError) as e:
        marconi.Store("dir", None, model="m", block_size=8)
    assert e.value.name == "INVALID_CONFIG"
    with pytest.raises(ValueError):
        marconi.Store("s3", "x", model="m", block_size=8)


def test_the_raw_abi_refuses_null_and_foreign_handles(tmp_path):
    lib = _lib.load()
    toks = (ctypes.c_uint32 * 4)(1, 2, 3, 4)
    n, found = ctypes.c_size_t(), ctypes.c_uint32()
    buf = (ctypes.c_uint8 * 16)()
    assert lib.marconi_store_get_state(None, toks, 4, 1, buf, 16, ctypes.byref(n), ctypes.byref(found)) == 1
    foreign = (ctypes.c_uint64 * 8)()
    st = lib.marconi_store_get_state(ctypes.cast(foreign, ctypes.c_void_p), toks, 4, 1, buf, 16,
                                     ctypes.byref(n), ctypes.byref(found))
    assert st == 2 and "not a marconi_store handle" in marconi.last_error()
    lib.marconi_store_free(None)
    lib.marconi_store_free(ctypes.cast(foreign, ctypes.c_void_p))  # refused, not freed
    cfg = _lib.marconi_store_config()
    assert lib.marconi_store_config_init(ctypes.byref(cfg), 8) == 19  # UNSUPPORTED_STRUCT_SIZE
    assert lib.marconi_store_new(None, None) == 1
    with store(tmp_path) as a:
        h = a._begin()
        try:
            assert lib.marconi_store_get_state(h, None, 4, 1, buf, 16, ctypes.byref(n), ctypes.byref(found)) == 1
            assert lib.marconi_store_get_state(h, toks, 4, 1, None, 16, ctypes.byref(n), ctypes.byref(found)) == 1
            assert lib.marconi_store_put_kv(h, toks, 4, 0, 1, None, 16) == 1
            assert lib.marconi_store_get_stats(h, None) == 1
            small = _lib.marconi_store_stats()
            small.struct_size = 4
            assert lib.marconi_store_get_stats(h, ctypes.byref(small)) == 19
        finally:
            a._end()


class DictStore:
    def __init__(self):
        self.d = {}
        self.fail = False

    def get(self, name):
        if self.fail:
            raise OSError("down")
        return self.d.get(name)

    def put(self, name, data):
        if self.fail:
            raise OSError("down")
        self.d[name] = data

    def exists(self, name):
        if self.fail:
            raise OSError("down")
        return name in self.d

    def delete(self, name):
        self.d.pop(name, None)


def test_callback_store_round_trip_and_faults():
    cb = DictStore()
    with marconi.Store("callback", model="m", block_size=8, callbacks=cb) as a:
        a.put_state(TOKENS, 20, STATE)
        assert a.get_state(TOKENS, 20) == STATE, "grows its buffer past the 4 KiB first try"
        (name,) = cb.d
        assert name.startswith("marconi-st-")
        cb.d[name] = cb.d[name][:100]
        assert a.get_state(TOKENS, 20) is None
        cb.d[name] = b"garbage" * 100
        assert a.get_state(TOKENS, 20) is None
        cb.fail = True
        assert a.get_state(TOKENS, 20) is None
        assert a.kv_prefix(TOKENS) == 0
        with pytest.raises(marconi.MarconiError) as e:
            a.put_state(TOKENS, 20, STATE)
        assert e.value.name == "BACKEND_FAILURE"
        s = a.stats()
        assert (s["hits"], s["truncated"], s["corrupt"], s["failed"], s["put_failures"]) == (1, 1, 1, 2, 1)


@pytest.fixture
def redis_server(tmp_path):
    with running_redis(tmp_path, os.environ.get("MARCONI_STORE_STRICT") == "1") as (proc, port):
        yield proc, f"redis://127.0.0.1:{port}/"


def test_redis_round_trip_and_a_killed_server_gives_quick_misses(redis_server):
    proc, url = redis_server
    with marconi.Store("redis", url, model="m", block_size=8, timeout_ms=100, connect_timeout_ms=100) as a, \
            marconi.Store("redis", url, model="m", block_size=8) as b:
        a.put_state(TOKENS, 40, STATE)
        assert b.get_state(TOKENS, 40) == STATE
        a.put_kv(TOKENS, 0, [b"k" * 64] * 5)
        assert b.kv_prefix(TOKENS) == 5
        proc.kill()
        proc.wait()
        for _ in range(10):
            t = time.monotonic()
            assert a.get_state(TOKENS, 40) is None
            assert a.get_kv(TOKENS, 0, 64, 5) == []
            assert time.monotonic() - t < 1.0
        s = a.stats()
        assert s["hits"] == 0 and s["unavailable"] + s["timeout"] == 20


def test_redis_never_started_gives_quick_misses():
    with marconi.Store("redis", f"redis://127.0.0.1:{free_port()}/", model="m", block_size=8) as a:
        t = time.monotonic()
        for _ in range(20):
            assert a.get_state(TOKENS, 8) is None
            assert a.kv_prefix(TOKENS) == 0
        assert time.monotonic() - t < 2.0
        assert a.stats()["unavailable"] == 40
