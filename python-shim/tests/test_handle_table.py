"""Misuse of every handle class from one shared table: close() while a call
runs on another thread, close() from a callback the running call makes
(tokenizer, store callbacks), and integers that do not fit their C types.

A native handle must never be freed under a running call (the other thread
would use freed memory: SIGSEGV): close() waits for a call of another thread
(or, with a timeout, gives up and leaves the freeing to that call) and is
refused (RuntimeError) from a callback of the running call, which then
completes. An integer that does
not fit is refused (TypeError for a non-integer, OverflowError/ValueError
out of range) before anything reaches ctypes, which would silently truncate
it (2**32 -> 0, -1 -> 4294967295)."""

import threading
import time
import types

import pytest

import marconi
import marconi.pml as pml
from conftest import REPO
from marconi import PrefixCache, Store, TieredCache
from marconi.pml import ModuleCache, Schema

FIX = REPO / "marconi-pml" / "tests" / "fixtures"
BIG = 100_000_000_000
MIB16 = 16 << 20


class FakeLib:
    """The real library with one function replaced by one that blocks until
    released (it does not touch the handle)."""

    def __init__(self, real, name):
        self._real = real
        self.entered, self.proceed = threading.Event(), threading.Event()
        real_fn = getattr(real, name)

        def blocked(*args):
            self.entered.set()
            assert self.proceed.wait(10), "the test never released the call"
            return real_fn(*args)

        setattr(self, name, blocked)

    def __getattr__(self, name):
        return getattr(self._real, name)


def words(text):
    return [len(w) for w in text.split()]


def schema():
    return Schema((FIX / "figure2_schema.xml").read_text(), tokenizer=words)


def module_cache():
    return ModuleCache(capacity_bytes=1 << 30, kv_bytes_per_token=16)


def store(tmp_path):
    return Store("dir", str(tmp_path / "store"), model="table", block_size=4)


def tiered():
    return TieredCache(BIG, host_bytes=BIG)


def prefix_cache():
    return PrefixCache(BIG)


def _patch_self_lib(obj, fn):
    fake = FakeLib(obj._lib, fn)
    obj._lib = fake
    return fake


def _patch_pml_lib(monkeypatch, fn):
    fake = FakeLib(marconi._lib.load(), fn)
    monkeypatch.setattr(pml, "_lib", types.SimpleNamespace(load=lambda: fake))
    return fake


# name -> (make(tmp_path), native function a call blocks in, the call,
#          how the library is patched: "self" (obj._lib) or "pml")
HANDLES = {
    "PrefixCache": (lambda p: prefix_cache(), "marconi_cache_stats", lambda o: o.stats(), "self"),
    "TieredCache": (lambda p: tiered(), "marconi_cache_tier_stats", lambda o: o.stats(), "self"),
    "Store": (store, "marconi_store_get_stats", lambda o: o.stats(), "self"),
    "Schema": (lambda p: schema(), "marconi_pml_name", lambda o: o.name_of(0), "pml"),
    "ModuleCache": (lambda p: module_cache(), "marconi_pml_cache_get_stats", lambda o: o.stats(), "pml"),
    "Pool": (lambda p: marconi.Pool(MIB16, 4096, 8192), "marconi_pool_get_stats", lambda o: o.stats(), "self"),
    "HostPool": (lambda p: marconi.HostPool(MIB16, 4096, 8192), "marconi_host_pool_get_stats", lambda o: o.stats(),
                 "self"),
    "PooledCache": (lambda p: marconi.PooledCache(1 << 30, backend="none"), "marconi_cache_pool_stats", lambda o: o.stats(), "self"),
    "CacheEvents": (lambda p: marconi.CacheEvents(PrefixCache(BIG)), "marconi_events_drain", lambda o: o.drain(),
                    "self"),
}


@pytest.mark.parametrize("timeout", [None, 0.05], ids=["waits", "gives_up"])
@pytest.mark.parametrize("name", sorted(HANDLES))
def test_close_during_a_call_on_another_thread_never_frees_under_it(name, timeout, tmp_path, monkeypatch):
    """close() refuses new calls at once and waits for the running one
    before freeing; with a timeout it gives up (TimeoutError) and the
    running call frees the handle as it returns. Every handle class alike."""
    make, fn, call, how = HANDLES[name]
    obj = make(tmp_path)
    fake = _patch_self_lib(obj, fn) if how == "self" else _patch_pml_lib(monkeypatch, fn)
    result, errors = [], []

    def run():
        try:
            result.append(call(obj))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    t = threading.Thread(target=run)
    t.start()
    assert fake.entered.wait(10)
    closer_outcome = []

    def close():
        try:
            obj.close(timeout=timeout)
            closer_outcome.append("closed")
        except (RuntimeError, TimeoutError) as e:
            closer_outcome.append(type(e).__name__)

    c = threading.Thread(target=close)
    c.start()
    if timeout is None:
        for _ in range(1000):  # until close() has begun (bounded: 10 s)
            if obj.closed:
                break
            time.sleep(0.01)
        assert obj.closed and c.is_alive(), f"{name}.close() did not wait for the running call"
    else:
        c.join(5)
        assert not c.is_alive(), f"{name}.close(timeout=...) hung while a call ran"
        assert closer_outcome == ["TimeoutError"], closer_outcome
    with pytest.raises(ValueError, match=f"the {obj._WHAT} is closed"):
        call(obj)  # refused at once, whether close() waits or gave up
    # The handle was not freed under the running call.
    assert obj._handle is not None and not result
    fake.proceed.set()
    t.join(10)
    c.join(10)
    assert not errors, errors
    assert len(result) == 1
    if timeout is None:
        assert closer_outcome == ["closed"], closer_outcome
    assert obj._handle is None, "freed by close() or by the call that returned last"
    obj.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        call(obj)


def test_schema_close_from_its_tokenizer_is_refused():
    s = schema()
    seen = []

    def tok(text):
        try:
            s.close()
            seen.append("closed")
        except RuntimeError:
            seen.append("refused")
        return words(text)

    segs = s.layout((FIX / "figure2_prompt.xml").read_text(), tokenizer=tok)
    assert seen and set(seen) == {"refused"}, seen
    assert segs[0].name == "trip-plan"
    assert s.name_of(1) == "tokyo"  # still alive
    s.close()


class Counted:
    """The real library with native function `name` counted into `calls`."""

    def __init__(self, real, name, calls):
        fn = getattr(real, name)
        self._real = real
        setattr(self, name, lambda *a: (calls.append(a), fn(*a))[1])

    def __getattr__(self, name):
        return getattr(self._real, name)


@pytest.mark.parametrize("name", sorted(HANDLES))
def test_close_under_load_frees_exactly_once(name, tmp_path):
    """close(timeout=0) while three threads call in a loop: every thread
    then stops on "closed", and the native handle is freed exactly once
    (by close() or by the call that returned last), never under a call."""
    make, _, call, _ = HANDLES[name]
    obj = make(tmp_path)
    frees = []
    if obj._owner is not None:  # views may share it: the owner frees
        free = obj._owner._free
        obj._owner._free = lambda h: (frees.append(h), free(h))[1]
    else:
        obj._lib = Counted(obj._lib, "marconi_events_free" if name == "CacheEvents" else obj._FREE, frees)
    started = threading.Barrier(4, timeout=10)
    outcomes = []

    def worker():
        i = 0
        try:
            while True:
                call(obj)
                if i == 0:
                    started.wait()
                i += 1
        except ValueError as e:
            outcomes.append(str(e))
        except Exception as e:  # noqa: BLE001 - anything else fails below
            outcomes.append(repr(e))
        if i == 0:
            started.abort()

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    started.wait()
    try:
        obj.close(timeout=0)
    except TimeoutError:
        pass
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads)
    assert len(outcomes) == 3 and all(o == f"the {obj._WHAT} is closed" for o in outcomes), outcomes
    assert len(frees) == 1 and obj._handle is None and not obj._calls
    obj.close()  # freed already: a no-op
    assert len(frees) == 1


class ClosingCallbacks:
    """Store callbacks over a dict whose reads (get, exists) first try
    `close()`, recording "closed" or "refused" in `seen`."""

    def __init__(self, close):
        self.close, self.d, self.seen = close, {}, []

    def _try_close(self):
        try:
            self.close()
            self.seen.append("closed")
        except RuntimeError:
            self.seen.append("refused")

    def get(self, name):
        self._try_close()
        return self.d.get(name)

    def put(self, name, data):
        self.d[name] = bytes(data)

    def exists(self, name):
        self._try_close()
        return name in self.d

    def delete(self, name):
        self.d.pop(name, None)


def test_store_close_from_its_callback_is_refused():
    cb = ClosingCallbacks(lambda: st.close())
    st = Store("callback", model="table", block_size=4, callbacks=cb)
    st.put_state([1, 2, 3, 4], 4, b"abc")
    assert st.get_state([1, 2, 3, 4], 4) == b"abc"
    assert cb.seen == ["refused"]
    st.close()


# -- integers that do not fit ------------------------------------------------

U32, U64 = 2**32, 2**64


def _layout(s):
    return s.layout((FIX / "figure2_prompt.xml").read_text(), tokenizer=words)


def _registered():
    s, m = schema(), module_cache()
    m.register(s)
    return s, m


# (what, call(objects)) -> each must raise TypeError or OverflowError
# (OverflowError also a ValueError where it is out of range).
BAD_INTS = [
    ("Schema.name_of(2**32)", lambda o: o["schema"].name_of(U32)),
    ("Schema.name_of(-1)", lambda o: o["schema"].name_of(-1)),
    ("Schema.name_of(0, -2)", lambda o: o["schema"].name_of(0, -2)),
    ("Schema.name_of(0, 2**31)", lambda o: o["schema"].name_of(0, 2**31)),
    ("Schema.name_of(1.0)", lambda o: o["schema"].name_of(1.0)),
    ("Schema.name_of(True)", lambda o: o["schema"].name_of(True)),
    ("ModuleCache.admit(anonymous=2**32)", lambda o: o["cache"].admit(o["schema"], anonymous=U32)),
    ("ModuleCache.admit(anonymous=-1)", lambda o: o["cache"].admit(o["schema"], anonymous=-1)),
    ("ModuleCache.admit(anonymous='0')", lambda o: o["cache"].admit(o["schema"], anonymous="0")),
    ("ModuleCache.lookup(window=-1)", lambda o: o["cache"].lookup(o["layout"], window=-1)),
    ("ModuleCache.lookup(window=2**32)", lambda o: o["cache"].lookup(o["layout"], window=U32)),
    ("ModuleCache.lookup(window=1.5)", lambda o: o["cache"].lookup(o["layout"], window=1.5)),
    ("ModuleCache.admit_exact(segment=-1)", lambda o: o["cache"].admit_exact(o["layout"], -1)),
    ("ModuleCache.admit_exact(segment=2**64)", lambda o: o["cache"].admit_exact(o["layout"], U64)),
    ("ModuleCache.unregister(2**64)", lambda o: o["cache"].unregister(U64)),
    ("ModuleCache.unregister(-1)", lambda o: o["cache"].unregister(-1)),
    ("Store.put_state(position=2**64)", lambda o: o["store"].put_state([1, 2, 3, 4], U64, b"x")),
    ("Store.put_state(position=-1)", lambda o: o["store"].put_state([1, 2, 3, 4], -1, b"x")),
    ("Store.put_state(data=5)", lambda o: o["store"].put_state([1, 2, 3, 4], 4, 5)),
    ("Store.put_state(data='abc')", lambda o: o["store"].put_state([1, 2, 3, 4], 4, "abc")),
    ("Store.put_state(data=None)", lambda o: o["store"].put_state([1, 2, 3, 4], 4, None)),
    ("Store.put_state(token=2**32)", lambda o: o["store"].put_state([1, U32, 3, 4], 4, b"x")),
    ("Store.get_state(position=2**64)", lambda o: o["store"].get_state([1, 2, 3, 4], U64)),
    ("Store.get_state(ns=2**64)", lambda o: o["store"].get_state([1, 2, 3, 4], 4, ns=U64)),
    ("Store.get_state(ns=-1)", lambda o: o["store"].get_state([1, 2, 3, 4], 4, ns=-1)),
    ("Store.put_kv(first_block=-1)", lambda o: o["store"].put_kv([1, 2, 3, 4], -1, [b"ab"])),
    ("Store.delete_state(position=1.0)", lambda o: o["store"].delete_state([1, 2, 3, 4], 1.0)),
    ("TieredCache.lookup(ns=2**64)", lambda o: o["tiered"].lookup([1, 2, 3], ns=U64)),
    ("TieredCache.lookup(ns=-1)", lambda o: o["tiered"].lookup([1, 2, 3], ns=-1)),
    ("TieredCache.lookup(token=2**32)", lambda o: o["tiered"].lookup([1, U32, 3])),
    ("PrefixCache.lookup(token=-1)", lambda o: o["prefix"].lookup([1, -1, 3])),
    ("PrefixCache.lookup(ns=2**64)", lambda o: o["prefix"].lookup([1, 2, 3], ns=U64)),
]


@pytest.fixture
def objects(tmp_path):
    s, m = _registered()
    o = {
        "schema": s,
        "cache": m,
        "layout": _layout(s),
        "store": store(tmp_path),
        "tiered": tiered(),
        "prefix": prefix_cache(),
    }
    yield o
    for k in ("cache", "schema", "store", "tiered", "prefix"):
        o[k].close()


@pytest.mark.parametrize("what,call", BAD_INTS, ids=[w for w, _ in BAD_INTS])
def test_an_int_that_does_not_fit_is_refused(objects, what, call):
    before = objects["cache"].stats()
    with pytest.raises((TypeError, OverflowError)) as e:
        call(objects)
    if not isinstance(e.value, TypeError):
        assert isinstance(e.value, ValueError), f"{what}: {type(e.value).__name__} is not also a ValueError"
    assert objects["cache"].stats() == before, f"{what} changed the module cache"


def test_put_state_refused_leaves_nothing(tmp_path):
    st = store(tmp_path)
    with pytest.raises(TypeError):
        st.put_state([1, 2, 3, 4], 4, 5)
    assert st.get_state([1, 2, 3, 4], 4) is None, "five zero bytes were stored"
    st.put_state([1, 2, 3, 4], 4, bytearray(b"\x01\x02"))
    assert st.get_state([1, 2, 3, 4], 4) == b"\x01\x02"
    st.put_state([1, 2, 3, 4], 4, memoryview(b"\x03"))
    assert st.get_state([1, 2, 3, 4], 4) == b"\x03"
    st.close()


def test_store_namespaces_never_meet(tmp_path):
    st = store(tmp_path)
    toks = list(range(16))
    st.put_state(toks, 8, b"plain")
    st.put_state(toks, 8, b"one", ns=1)
    assert st.get_state(toks, 8) == b"plain"
    assert st.get_state(toks, 8, ns=0) == b"plain"
    assert st.get_state(toks, 8, ns=1) == b"one"
    assert st.get_state(toks, 8, ns=2) is None
    st.put_kv(toks, 0, [b"k0", b"k1"], ns=3)
    assert st.kv_prefix(toks, ns=3) == 2
    assert st.kv_prefix(toks) == 0
    assert st.get_kv(toks, 0, 2, 4, ns=3) == [b"k0", b"k1"]
    st.delete_state(toks, 8, ns=1)
    assert st.get_state(toks, 8, ns=1) is None
    assert st.get_state(toks, 8) == b"plain"
    st.close()


def test_cache_close_from_a_store_callback_is_refused():
    """A PrefixCache closed from a callback of the store that its
    lookup_tiered probes: the call in flight is this thread's own, so
    close() cannot wait for it. It is refused (RuntimeError) and the cache
    stays usable; it used to wait for the call forever."""
    cache = PrefixCache(BIG, tiers=marconi.Tiers(host_bytes=BIG, store_bytes=BIG))
    cb = ClosingCallbacks(lambda: cache.close())
    st = Store("callback", model="table", block_size=4, callbacks=cb)
    hits = []
    t = threading.Thread(target=lambda: hits.append(cache.lookup_tiered(list(range(64)), store=st)), daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "close() from the store callback hung"
    assert cb.seen and set(cb.seen) == {"refused"}, cb.seen
    assert len(hits) == 1
    cache.release(hits[0].lease)  # still usable
    cache.close()
    st.close()
