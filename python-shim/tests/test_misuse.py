"""Misuse that must be refused cleanly: copies of a cache,
close() racing other threads, integers that do not fit the C types, leases
leaked or released twice on error paths, and error details that must name
the failing call."""

import array
import copy
import pickle
import re
import threading
import time

import pytest

import marconi
from marconi import MarconiError, MarconiPrefixCache, PrefixCache

BIG = 100_000_000_000
U32 = 2**32
U64 = 2**64


class FakeLib:
    """The real library with some functions replaced (for calls that block
    until the test lets them go, or fail as a buggy library would)."""

    def __init__(self, lib, **replaced):
        self._real = lib
        self.__dict__.update(replaced)

    def __getattr__(self, name):
        return getattr(self._real, name)


class Blocked:
    """A native call that blocks until `proceed` is set, without touching
    the handle, and logs its end and the cache's free into `order`."""

    def __init__(self, cache, name):
        self.entered, self.proceed = threading.Event(), threading.Event()
        self.order = []
        real = cache._lib

        def blocked(*args):
            self.entered.set()
            self.proceed.wait()
            self.order.append("call done")
            return 0

        def free(h):
            self.order.append("free")
            real.marconi_cache_free(h)

        cache._lib = FakeLib(real, **{name: blocked, "marconi_cache_free": free})

    def start(self, fn):
        """Runs fn in a thread and returns once it is inside the native call."""
        self.thread = threading.Thread(target=fn)
        self.thread.start()
        self.entered.wait()

    def finish(self):
        self.proceed.set()
        self.thread.join()


# -- copies ---------------------------------------------------------------


@pytest.mark.parametrize("how", [copy.copy, copy.deepcopy, pickle.dumps])
def test_a_cache_or_lease_cannot_be_copied_or_pickled(how):
    with PrefixCache(BIG) as cache:
        with pytest.raises(TypeError, match="PrefixCache cannot be"):
            how(cache)
        with cache.lookup([1, 2, 3]) as lease:
            with pytest.raises(TypeError, match="Lease cannot be"):
                how(lease)
        assert cache.stats()["leases"] == 0
    if how is not copy.copy:  # a shallow copy of the adapter shares its cache
        with pytest.raises(TypeError, match="PrefixCache cannot be"):
            how(MarconiPrefixCache(BIG))


# -- close() and threads --------------------------------------------------


def test_close_waits_for_a_call_in_flight_and_refuses_new_ones():
    cache = PrefixCache(BIG)
    call = Blocked(cache, "marconi_cache_stats")
    call.start(cache.stats)
    closer = threading.Thread(target=cache.close)
    closer.start()
    while not cache.closed and closer.is_alive():  # until close() has begun
        time.sleep(0.001)
    assert cache.closed
    with pytest.raises(ValueError, match="closed"):
        cache.lookup([1, 2, 3])
    with pytest.raises(ValueError, match="closed"):
        cache.handle
    assert call.order == []  # the handle is not freed under the running call
    call.finish()
    closer.join()
    assert call.order == ["call done", "free"]


def test_close_with_a_timeout_refuses_and_the_last_call_frees():
    cache = PrefixCache(BIG)
    call = Blocked(cache, "marconi_cache_evict")
    call.start(lambda: cache.evict(0))
    with pytest.raises(TimeoutError, match="1 call is still running"):
        cache.close(timeout=0)
    assert cache.closed
    with pytest.raises(ValueError, match="closed"):
        cache.stats()
    assert call.order == []
    call.finish()  # the call in flight returns and frees the cache
    assert call.order == ["call done", "free"]
    cache.close()  # already freed: a no-op
    assert call.order == ["call done", "free"]
    with pytest.raises(TypeError, match="timeout"):
        cache.close(timeout="1")


def _hammer(n, op, close):
    """Runs `op(t, i)` for i = 0, 1, ... on n threads until it raises; once
    every thread has called it at least once, calls `close()` (whose
    TimeoutError is allowed). Returns what each thread stopped on."""
    started = threading.Barrier(n + 1)
    outcomes = []

    def worker(t):
        i = 0
        try:
            while True:
                op(t, i)
                if i == 0:
                    started.wait()
                i += 1
        except ValueError as e:
            outcomes.append(str(e))
        except Exception as e:  # anything else is a failure
            outcomes.append(repr(e))
        if i == 0:
            started.abort()  # failed before the barrier: main must not wait

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(n)]
    for th in threads:
        th.start()
    started.wait()  # every worker has called op at least once
    try:
        close()
    except TimeoutError:
        pass
    for th in threads:
        th.join()
    return outcomes


def test_close_while_threads_hammer_the_cache():
    cache = PrefixCache(50_000_000)
    outcomes = _hammer(4, lambda t, i: cache.serve([t, i, i + 1, i + 2] * 8, [7, 8, 9]), cache.close)
    assert len(outcomes) == 4 and all("the cache is closed" in o for o in outcomes), outcomes


def test_close_without_waiting_while_threads_hammer_the_cache():
    """close(timeout=0) under load: it returns or raises TimeoutError, every
    worker then stops on "closed", and the handle is freed exactly once,
    by close() or by the last call to return (a double free or a call on a
    freed handle would crash the process or the library's checks)."""
    for _ in range(20):
        cache = PrefixCache(50_000_000)
        frees = []
        real = cache._lib

        def free(h, real=real, frees=frees):
            frees.append(h.value)
            real.marconi_cache_free(h)

        cache._lib = FakeLib(real, marconi_cache_free=free)

        def op(t, i, cache=cache):
            with cache.lookup([t, i, i + 1] * 8) as lease:
                lease.admit([t, i, i + 1] * 8 + [5], [(25, None)])

        outcomes = _hammer(3, op, lambda cache=cache: cache.close(timeout=0))
        assert len(outcomes) == 3 and all("the cache is closed" in o for o in outcomes), outcomes
        assert len(frees) == 1 and cache._handle is None and not cache._calls
        cache.close()  # freed already: a no-op
        assert len(frees) == 1


def test_leases_are_released_by_close():
    cache = PrefixCache(BIG)
    with cache.lookup([1, 2, 3]) as lease:
        cache.close()
        assert lease.released
    # Leaving the block after close does not touch the freed handle.
    with pytest.raises(ValueError, match="closed"):
        lease.release()


# -- integers that do not fit ---------------------------------------------


def _served():
    cache = PrefixCache(BIG)
    cache.serve(list(range(40)), [1, 2], namespace=1)
    return cache


@pytest.mark.parametrize(
    "name, call, error",
    [
        ("capacity_bytes", lambda c: PrefixCache(-1), OverflowError),
        ("capacity_bytes", lambda c: PrefixCache(U64 + 5), OverflowError),
        ("capacity_bytes", lambda c: PrefixCache(1.5e9), TypeError),
        ("capacity_bytes", lambda c: PrefixCache(True), TypeError),
        ("page_size", lambda c: PrefixCache(BIG, page_size=U32 + 1), OverflowError),
        ("checkpoint_grid", lambda c: PrefixCache(BIG, checkpoint_grid=-1), OverflowError),
        ("block_size", lambda c: PrefixCache(BIG, block_size=U32 + 32), OverflowError),
        ("tuner_threads", lambda c: PrefixCache(BIG, tuner_threads=-1), OverflowError),
        ("decision_log", lambda c: PrefixCache(BIG, decision_log=2), ValueError),
        ("protect_branch_states", lambda c: PrefixCache(BIG, protect_branch_states="no"), TypeError),
        ("alpha", lambda c: PrefixCache(BIG, alpha=True), TypeError),
        ("tuner_grid[1]", lambda c: PrefixCache(BIG, tuner_grid=[0.5, "x"]), TypeError),
        ("model.attn_layers", lambda c: PrefixCache(BIG, {"attn_layers": U32 + 2}), OverflowError),
        ("model.d_model", lambda c: PrefixCache(BIG, {"d_model": -4}), OverflowError),
        ("model", lambda c: PrefixCache(BIG, "paper-7b\0junk"), ValueError),
        ("model", lambda c: PrefixCache(BIG, 7), TypeError),
        ("namespace", lambda c: c.lookup(list(range(41)), namespace=U64 + 1), OverflowError),
        ("namespace", lambda c: c.lookup(list(range(41)), namespace=-1), OverflowError),
        ("namespace", lambda c: c.lookup(list(range(41)), namespace=True), TypeError),
        ("namespace", lambda c: c.lookup(list(range(41)), namespace=1.0), TypeError),
        ("dst_slot", lambda c: c.lookup([1], dst_slot=U32 + 7), OverflowError),
        ("dst_slot", lambda c: c.lookup([1], dst_slot=-1), OverflowError),
        ("tokens[1]", lambda c: c.lookup([1, True]), TypeError),
        ("tokens[1]", lambda c: c.lookup([1, 2.0]), TypeError),
        ("tokens[0]", lambda c: c.lookup([U32]), OverflowError),
        ("kv_pages[1]", lambda c: c.admit(0, [1], [], [0, -1]), OverflowError),
        ("lease", lambda c: c.release(-1), OverflowError),
        ("lease", lambda c: c.plan(U64 + 1), OverflowError),
        ("lease", lambda c: c.admit(U64, [1], []), OverflowError),
        ("nbytes", lambda c: c.evict(-1), OverflowError),
        ("nbytes", lambda c: c.evict(U64), OverflowError),
        ("nbytes", lambda c: c.evict(1.0), TypeError),
        ("status", lambda c: marconi.status_message(U32 + 10), OverflowError),
        ("num_tokens", lambda c: MarconiPrefixCache(BIG).evict(-1), OverflowError),
        ("namespace", lambda c: MarconiPrefixCache(BIG).match_prefix([1], namespace=U64 + 1), OverflowError),
        ("dst_slot", lambda c: MarconiPrefixCache(BIG).match_prefix([1], dst_slot=U32), OverflowError),
    ],
)
def test_integers_are_checked_against_their_c_type(name, call, error):
    with _served() as cache:
        before = cache.stats()
        with pytest.raises(error) as e:
            call(cache)
        assert str(e.value).startswith(f"{name}: "), str(e.value)
        if error is OverflowError:
            assert isinstance(e.value, ValueError)  # out of range is both
        assert cache.stats() == before  # nothing happened: no hit, no eviction


def test_states_and_leases_out_of_range_change_nothing():
    with PrefixCache(BIG) as cache:
        with cache.lookup(list(range(40))) as lease:
            for states, name in (
                ([(40, U32 + 7)], "states[0].slot"),
                ([(40, -1)], "states[0].slot"),
                ([(40, 1), (U32 + 40, 2)], "states[1].position"),
                ([(40, 1.0)], "states[0].slot"),
            ):
                with pytest.raises((OverflowError, TypeError), match="^" + re.escape(name)):
                    lease.admit(list(range(40)), states)
            # An id that wraps onto this lease's id is refused, not released.
            with pytest.raises(OverflowError):
                cache.release(lease.id + U64)
            assert not lease.released and cache.stats()["leases"] == 1
        assert cache.stats()["states"] == 0 and cache.stats()["leases"] == 0


def test_evict_negative_does_not_evict_everything():
    with _served() as cache:
        with pytest.raises(OverflowError):
            cache.evict(-1)
        assert cache.stats()["evictions"] == 0 and cache.stats()["nodes"] > 0


# -- leases ---------------------------------------------------------------


def test_release_by_id_marks_the_lease():
    with PrefixCache(BIG) as cache:
        with cache.lookup([1, 2, 3]) as lease:
            cache.release(lease.id)
            assert lease.released
        # The with block did not release it twice; an explicit second release
        # is still refused by the library.
        with pytest.raises(MarconiError) as e:
            cache.release(lease)
        assert e.value.name == "UNKNOWN_LEASE"
        lease2 = cache.lookup([1, 2, 3])
        lease2.release()
        with pytest.raises(MarconiError):
            cache.release(lease2.id)
        assert cache.stats()["leases"] == 0


def test_lookup_releases_its_lease_when_it_fails_after_the_lookup():
    with PrefixCache(BIG) as cache:
        cache.serve(list(range(100)))
        cache._lib = FakeLib(cache._lib, marconi_cache_lease_plan=lambda *a: 2)
        with pytest.raises(MarconiError):
            cache.lookup(list(range(50)) + [999] * 10)  # a branch at 50: a plan to read
        assert cache.stats()["leases"] == 0


def test_match_prefix_releases_its_lease_on_error(monkeypatch):
    import marconi.adapter

    tree = MarconiPrefixCache(BIG)

    def broken(*a, **k):
        raise RuntimeError("engine bug")

    monkeypatch.setattr(marconi.adapter, "MarconiNode", broken)
    with pytest.raises(RuntimeError):
        tree.match_prefix([1, 2, 3])
    assert tree.cache.stats()["leases"] == 0


def test_match_prefix_counts_tokens_of_any_key_form():
    tree = MarconiPrefixCache(BIG)
    for key in (iter([1, 2, 3]), array.array("I", [1, 2, 3]).tobytes(), (1, 2, 3)):
        node = tree.match_prefix(key).last_device_node
        assert node.key_len == 3
        tree.inc_lock_ref(node)
        tree.dec_lock_ref(node)
    assert tree.cache.stats()["leases"] == 0


def test_adapter_evict_saturates_a_huge_request():
    tree = MarconiPrefixCache(BIG)
    tree.insert(list(range(100)), states=[(100, 1)])
    assert tree.total_size() > 0
    _, slots = tree.evict(2**70)
    assert tree.total_size() == 0 and slots == [1]


# -- error details --------------------------------------------------------


def test_errors_carry_the_failing_calls_detail():
    with PrefixCache(BIG) as cache:
        cases = [
            (lambda: cache.lookup([]), "marconi_cache_lookup"),
            (lambda: cache.release(12345), "marconi_cache_release"),
            (lambda: cache.plan(12345), "marconi_cache_lease_plan"),
            (lambda: cache.admit(12345, [1]), "marconi_cache_admit"),
            (lambda: PrefixCache(0), "marconi_cache_new"),
        ]
        for call, fn in cases:
            with pytest.raises(MarconiError) as e:
                call()
            assert e.value.function == fn
            assert e.value.detail.startswith(f"{fn}: ") and e.value.detail in str(e.value)


def test_a_stale_last_error_is_not_reported_as_the_detail():
    with PrefixCache(BIG) as cache:
        with pytest.raises(MarconiError):
            cache.release(12345)  # the thread's last error now names release
        cache._lib = FakeLib(cache._lib, marconi_cache_evict=lambda *a: 4)  # PANIC, no detail set
        with pytest.raises(MarconiError) as e:
            cache.evict(0)
        assert e.value.name == "PANIC" and e.value.function == "marconi_cache_evict"
        assert "12345" not in str(e.value) and "no detail" in e.value.detail


def test_a_node_of_a_reset_cache_finishes_quietly():
    tree = MarconiPrefixCache(BIG)
    node = tree.match_prefix([1, 2, 3]).last_device_node
    tree.inc_lock_ref(node)
    tree.reset()  # closes the old cache: its leases went with it
    assert node.lease.released
    tree.dec_lock_ref(node)
    req = type("Req", (), {"origin_input_ids": [1, 2, 3], "output_ids": [], "last_node": node})()
    with pytest.raises(ValueError, match="closed"):
        tree.cache_finished_req(req)  # admitting into the closed cache is refused
    assert tree.cache.stats()["leases"] == 0
