"""The tiered cache through the C ABI (marconi.TieredCache, docs/tiers.md):
an engine's copies kept in step with the tiers through the ops, a second
cache resuming from a directory store the first wrote (as a second engine
process does), a corrupt object and a store that is down giving misses,
and bad input refused with MarconiError."""

import copy
import time
import pickle

import pytest

import marconi



def chain_bytes(tokens):
    spec = marconi.PrefixCache(1 << 40, "paper-7b")
    try:
        s = spec.stats()
        return tokens * s["kv_bytes_per_token"] + s["state_bytes_per_entry"]
    finally:
        spec.close()


def workload(sessions, turns, seed):
    x = (seed * 2654435761 + 1) & 0xFFFFFFFF

    def rnd():
        nonlocal x
        x ^= (x << 13) & 0xFFFFFFFF
        x ^= x >> 17
        x ^= (x << 5) & 0xFFFFFFFF
        return x

    hist = [[1_000_000 + i for i in range(64)] for _ in range(sessions)]
    out = []
    for _ in range(turns):
        for h in hist:
            h.extend(rnd() % 50_000 for _ in range(10 + rnd() % 60))
            reply = [rnd() % 50_000 for _ in range(5 + rnd() % 30)]
            out.append((list(h), reply))
            h.extend(reply)
    return out


def blob(tokens):
    h = 0xCBF29CE484222325
    for t in tokens:
        h = ((h ^ t) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return b"".join(((h ^ i).to_bytes(8, "little")) for i in range(8))


class Engine:
    """Device slots hold chains, the host copies are a dict, the store is a
    marconi.Store (or None)."""

    def __init__(self, tc, store=None):
        self.tc, self.store = tc, store
        self.slots, self.next_slot, self.host = {}, 0, {}
        self.failures = 0
        self.put_failures = 0
        self.drops = 0

    def read(self, tier, chain):
        if tier == "host":
            return self.host.get(tuple(chain))
        return self.store.get_state(chain, len(chain))

    def serve(self, prompt, output):
        hit = self.tc.lookup(prompt, store=self.store)
        h = hit.hit_tokens
        if hit.tier != "device":
            state = hit.loads[-1]
            assert state.kind == "state" and state.position == h
            got = self.read(state.tier, prompt[:h])
            if got is None:
                self.tc.report_load_failure(hit.lease)
                self.failures += 1
                h = hit.device_hit_tokens
            else:
                assert got == blob(prompt[:h])
        elif h:
            assert self.slots[hit.device_state_slot] == prompt[:h]
        full = prompt + output
        states = []
        for p in [p for p in hit.plan if p > h] + [len(full)]:
            self.slots[self.next_slot] = full[:p]
            states.append((p, self.next_slot))
            self.next_slot += 1
        r = self.tc.admit(hit.lease, full, states)
        self.tc.release(hit.lease)
        self.apply()
        for (_, slot), taken in zip(states, r.taken):
            if not taken:
                del self.slots[slot]
        return hit

    def apply(self):
        for op in self.tc.drain_ops():
            assert len(op.tokens) == op.position
            self.drops += op.kind == "drop"
            key = tuple(op.tokens)
            if op.kind == "write" and op.tier == "host":
                assert op.tokens in self.slots.values(), "a host write of a chain no slot holds"
                self.host[key] = blob(op.tokens)
            elif op.kind == "write":
                assert key in self.host, "a store write of a chain the host lacks"
                try:
                    self.store.put_state(op.tokens, op.position, self.host[key])
                except marconi.MarconiError as e:
                    assert e.name == "BACKEND_FAILURE"
                    self.put_failures += 1
            elif op.tier == "host":
                del self.host[key]
        _, slots = self.tc.drain_freed()
        for s in slots:
            del self.slots[s]


def serve_in_step(cache, tier_stats):
    """Serves the 60-request workload through an Engine over `cache` (the
    TieredCache calls), checking the invariants after each request, and
    checks that the host tier was used and no load failed."""
    e = Engine(cache)
    for prompt, output in workload(10, 6, 3):
        e.serve(prompt, output)
        cache.check()
    s = tier_stats()
    assert s["requests"] == 60
    assert s["hits_by_tier"]["host"] > 0 and s["writes"]["host"] > 0
    assert e.failures == 0


def test_the_engine_copies_stay_in_step_with_the_tiers():
    with marconi.TieredCache(chain_bytes(300), "paper-7b", host_bytes=chain_bytes(900)) as tc:
        serve_in_step(tc, tc.stats)


def test_exclusive_tiers_drop_what_they_served_in_step_with_the_engine(tmp_path):
    c = chain_bytes(300)
    seen = {}
    # A drop of a chain the engine never copied fails in Engine.apply (del).
    for exclusive in (True, False):
        d = tmp_path / str(exclusive)
        d.mkdir()
        with marconi.Store("dir", str(d), model="paper-7b py", block_size=16) as st, \
                marconi.TieredCache(2 * c, "paper-7b", host_bytes=3 * c, store_bytes=6 * c, store_gbps=20,
                                    store_latency_us=10, store_states_hold_kv=True, exclusive=exclusive) as tc:
            e = Engine(tc, st)
            for prompt, output in workload(3, 8, 3):
                e.serve(prompt, output)
                tc.check()
            s = tc.stats()
            assert s["hits_by_tier"]["host"] + s["hits_by_tier"]["store"] > 0
            assert e.failures == 0
            seen[exclusive] = (e.drops, s["writes"]["host"] + s["writes"]["store"])
    # The chains a lower tier served are dropped there: more drops per write.
    (de, we), (di, wi) = seen[True], seen[False]
    assert de * wi > di * we, seen
    with pytest.raises(TypeError):
        marconi.TieredCache(c, host_bytes=c, exclusive=1)


def tiered(**kw):
    args = dict(host_bytes=chain_bytes(600), store_bytes=chain_bytes(100_000), store_gbps=20,
                store_latency_us=10, store_states_hold_kv=True)
    args.update(kw)
    return marconi.TieredCache(chain_bytes(300), "paper-7b", **args)


def test_a_second_cache_resumes_from_the_shared_store(tmp_path):
    reqs = workload(8, 5, 11)
    with marconi.Store("dir", str(tmp_path), model="paper-7b py", block_size=16) as st:
        with tiered() as a:
            ea = Engine(a, st)
            for prompt, output in reqs:
                ea.serve(prompt, output)
            assert a.stats()["writes"]["store"] > 0
        with tiered() as b:
            eb = Engine(b, st)
            shared = sum(eb.serve(p, o).shared for p, o in reqs[-8:])
            assert shared > 0
            assert b.stats()["shared_hits"] == shared
            assert eb.failures == 0
        # Corrupt every object: the probe still sees names, every read misses.
        for f in tmp_path.iterdir():
            if f.is_file():
                data = bytearray(f.read_bytes())
                data[-1] ^= 0xFF
                f.write_bytes(bytes(data))
        with tiered() as c:
            ec = Engine(c, st)
            for p, o in reqs[-8:]:
                ec.serve(p, o)
            s = c.stats()
            assert ec.failures > 0 and s["load_failures"] == ec.failures == s["shared_hits"]
        assert st.stats()["corrupt"] >= ec.failures


def test_a_store_that_is_down_gives_misses():
    with marconi.Store("redis", "redis://127.0.0.1:1", model="m", block_size=16) as st, tiered() as tc:
        e = Engine(tc, st)
        for p, o in workload(4, 3, 5):
            e.serve(p, o)
        s = tc.stats()
        assert e.put_failures > 0
        assert s["store_probes"] > 0 and s["store_probe_failures"] == s["store_probes"]
        assert s["load_failures"] == e.failures


def test_bad_input_is_refused():
    with pytest.raises(marconi.MarconiError) as e:
        marconi.TieredCache(chain_bytes(300), store_bytes=chain_bytes(600))
    assert e.value.name == "INVALID_CONFIG"
    with pytest.raises(marconi.MarconiError) as e:
        marconi.TieredCache(0, host_bytes=chain_bytes(600))
    assert e.value.name == "INVALID_CONFIG"
    with pytest.raises(marconi.MarconiError) as e:
        marconi.TieredCache(chain_bytes(300), host_bytes=chain_bytes(600), host_gbps=0)
    assert e.value.name == "INVALID_CONFIG"
    with pytest.raises(ValueError):
        marconi.TieredCache(chain_bytes(300), write="sideways")
    with pytest.raises(TypeError):
        marconi.TieredCache(chain_bytes(300), promote=1)
    tc = marconi.TieredCache(chain_bytes(300), host_bytes=chain_bytes(600))
    with pytest.raises(marconi.MarconiError) as e:
        tc.lookup([])
    assert e.value.name == "EMPTY_TOKENS"
    with pytest.raises(ValueError):
        tc.lookup([2**32])
    with pytest.raises(TypeError):
        tc.lookup([1, 2, 3], store="not a store")
    hit = tc.lookup(list(range(50)))
    assert hit.tier == "device" and hit.hit_tokens == 0 and hit.loads == []
    with pytest.raises(marconi.MarconiError) as e:
        tc.release(hit.lease ^ 1)
    assert e.value.name == "UNKNOWN_LEASE"
    with pytest.raises(marconi.MarconiError) as e:
        tc.admit(hit.lease, list(range(50)), [(7, 1)])
    assert e.value.name == "NOT_PLANNED"
    tc.release(hit.lease)
    with pytest.raises(marconi.MarconiError) as e:
        tc.release(hit.lease)
    assert e.value.name == "UNKNOWN_LEASE"
    with pytest.raises(TypeError):
        copy.copy(tc)
    with pytest.raises(TypeError):
        pickle.dumps(tc)
    tc.close()
    tc.close()
    with pytest.raises(ValueError):
        tc.lookup([1, 2, 3])


class SlowStore:
    """A store of Python callbacks whose every existence query takes 100 ms."""

    def __init__(self):
        self.calls = 0

    def get(self, name):
        return None

    def put(self, name, data):
        pass

    def exists(self, name):
        self.calls += 1
        time.sleep(0.1)
        return False

    def delete(self, name):
        pass


def test_a_slow_store_gives_misses_within_its_timeout():
    slow = SlowStore()
    with marconi.Store("callback", model="m", block_size=16, timeout_ms=20, callbacks=slow) as st, tiered() as tc:
        prompt = list(range(300))
        start = time.monotonic()
        hit = tc.lookup(prompt, store=st)
        elapsed = time.monotonic() - start
        tc.release(hit.lease)
        # 299 candidate positions, each 100 ms: the deadline (20 ms) stops
        # the probe after the first call, and the lookup misses.
        assert slow.calls == 1
        assert elapsed < 1.0
        assert hit.hit_tokens == 0 and not hit.shared
        s = tc.stats()
        assert s["store_probes"] == 1 and s["store_probe_failures"] == 1
        assert st.stats()["timeout"] == 1
