"""Lower tiers and pools as options of the one cache handle
(marconi.PrefixCache(..., tiers=marconi.Tiers(...)), docs/tiers.md; and
marconi.PrefixCache(..., pools=marconi.Pools(...))): the engine's copies
kept in step through the tier methods, the device view of lookup() on such
a cache, every tier method refused on a cache without tiers, and the
deprecated TieredCache still working over the same handle; the pooled
request cycle through the pool methods with the invariants of test_pooled,
every pool method refused on a cache without pools, the methods over engine
ids refused on a cache over pools, and the deprecated PooledCache calling
the same functions; pools and tiers together, with an engine that moves
bytes between the units and its lower-tier copies."""

import hashlib
import random

import pytest

import marconi
import test_pooled
from test_tiered import chain_bytes, serve_in_step


class OneHandle:
    """The TieredCache calls test_tiered's Engine makes, on a PrefixCache."""

    def __init__(self, pc):
        self.pc = pc

    def lookup(self, tokens, store=None):
        return self.pc.lookup_tiered(tokens, store=store)

    def __getattr__(self, name):
        return getattr(self.pc, name)


@pytest.mark.parametrize("as_dict,write", [(False, "back"), (True, "through")])
def test_the_engine_copies_stay_in_step_through_the_one_handle(as_dict, write):
    host = chain_bytes(900)
    tiers = {"host_bytes": host, "write": write}
    if not as_dict:
        tiers = marconi.Tiers(**tiers)
    with marconi.PrefixCache(chain_bytes(300), "paper-7b", tiers=tiers) as pc:
        assert pc.has_tiers
        serve_in_step(OneHandle(pc), pc.tier_stats)
        assert pc.stats()["requests"] == 60


def test_lookup_on_a_tiered_cache_is_the_device_view():
    c = chain_bytes(100)
    with marconi.PrefixCache(c, "paper-7b", tiers=marconi.Tiers(host_bytes=10 * c, host_gbps=1e6)) as pc:
        a = list(range(80))
        b = list(range(1000, 1080))
        for seq in (a, b):
            hit = pc.lookup_tiered(seq)
            pc.admit(hit.lease, seq, [(len(seq), 1 if seq is a else 2)])
            pc.release(hit.lease)
            pc.drain_ops()
            pc.drain_freed()
        probe = a + [9]
        tiered = pc.lookup_tiered(probe)
        assert tiered.tier == "host" and tiered.hit_tokens == 80
        assert pc.lease_loads(tiered.lease) == tiered.loads and tiered.loads
        with pc.lookup(probe) as lease:
            assert lease.hit_tokens == tiered.device_hit_tokens < tiered.hit_tokens
            assert pc.lease_loads(lease) == []
        pc.release(tiered.lease)
        pc.check()


def test_every_tier_method_refuses_on_a_cache_without_tiers():
    with marconi.PrefixCache(1 << 30) as pc:
        assert not pc.has_tiers
        lease = pc.lookup([1, 2, 3])
        calls = {
            "marconi_cache_lookup_tiered": lambda: pc.lookup_tiered([1, 2, 3]),
            "marconi_cache_lease_loads": lambda: pc.lease_loads(lease),
            "marconi_cache_report_load_failure": lambda: pc.report_load_failure(lease),
            "marconi_cache_settle": pc.settle,
            "marconi_cache_drain_ops": pc.drain_ops,
            "marconi_cache_tier_stats": pc.tier_stats,
        }
        for name, call in calls.items():
            with pytest.raises(marconi.MarconiError) as e:
                call()
            assert e.value.name == "UNSUPPORTED", name
            assert "marconi_cache_config.tiers" in str(e.value), str(e.value)
        lease.release()
        pc.check()


def test_bad_tiers_are_refused():
    with pytest.raises(ValueError, match="write"):
        marconi.PrefixCache(1 << 30, tiers=marconi.Tiers(host_bytes=1 << 30, write="sideways"))
    with pytest.raises(TypeError, match="exclusive"):
        marconi.PrefixCache(1 << 30, tiers={"host_bytes": 1 << 30, "exclusive": 1})
    with pytest.raises(TypeError, match="tiers"):
        marconi.PrefixCache(1 << 30, tiers=42)
    with pytest.raises(marconi.MarconiError) as e:
        marconi.PrefixCache(1 << 30, tiers=marconi.Tiers(store_bytes=1 << 30))
    assert e.value.name == "INVALID_CONFIG"


# -- pools -------------------------------------------------------------------


class PooledOneHandle:
    """The PooledCache calls test_pooled's serve() and check_invariants()
    make, on a PrefixCache with pools."""

    def __init__(self, pc):
        self.pc = pc

    def lookup(self, tokens):
        return self.pc.lookup_pooled(tokens)

    def admit(self, lease, tokens, states, pages):
        return self.pc.admit_pooled(lease, tokens, states, pages)

    def free(self, handles):
        self.pc.free_units(handles)

    def drain_freed(self):
        return self.pc.drain_freed_units()

    def stats(self):
        return self.pc.pool_stats()

    def __getattr__(self, name):
        return getattr(self.pc, name)


def pooled_budget():
    p = marconi.plan("nemotron-h-8b", 1 << 30, page_size=test_pooled.PAGE)
    budget = 6 * p["state_slot_bytes"] + 2600 // test_pooled.PAGE * p["kv_page_bytes"]
    return -(-budget // (2 << 20)) * (2 << 20)


@pytest.mark.parametrize("as_dict,seed", [(False, 1), (True, 2)])
def test_the_pooled_cycle_through_the_one_handle(as_dict, seed):
    budget = pooled_budget()
    pools = {"budget_bytes": budget, "state_fraction": 0.3}
    if not as_dict:
        pools = marconi.Pools(**pools)
    rng = random.Random(seed)
    pc = marconi.PrefixCache(0, "nemotron-h-8b", page_size=test_pooled.PAGE, alpha=1.0, decision_log=True, pools=pools)
    with pc:
        assert pc.has_pools and not pc.has_tiers and pc.backend == "memfd"
        cache, seen = PooledOneHandle(pc), []
        test_pooled.check_invariants(cache, budget, seen)
        served, refused = test_pooled.conversations(cache, budget, seen, rng, 30)
        ps, st = pc.pool_stats(), pc.stats()
        assert ps["requests"] == st["requests"] == served + refused
        assert ps["reservations_refused"] == refused
        assert ps["hit_tokens"] == st["hit_tokens"] > 0
        assert ps["evictions"] == st["evictions"] > 0 and seen
        assert ps["leases"] == st["leases"] == 0
        assert st["capacity_bytes"] == ps["budget_bytes"] <= budget
        log = pc.drain_log()
        assert {d["kind"] for d in log} >= {"lookup", "admit", "release"}
        # A view outlives close(): the memory stays mapped for it.
        _, slots = pc.reserve(0, 1)
        view = pc.view(slots[0])
        view[:4] = b"abcd"
    assert pc.closed
    assert bytes(view[:4]) == b"abcd"
    del view


def test_the_resumed_state_is_the_cached_one_through_the_one_handle():
    with marconi.PrefixCache(0, "nemotron-h-8b", page_size=16, alpha=1.0, pools=marconi.Pools(pooled_budget())) as pc:
        tokens = list(range(1000, 1000 + 256))
        look = pc.lookup_pooled(tokens[:200], checkpoints=[160])
        assert look.plan == [160]
        pages, slots = pc.reserve(256 // 16, 2)
        pc.view(slots[0])[:4] = b"abcd"
        a = pc.admit_pooled(look, tokens, [(160, slots[1]), (256, slots[0])], pages)
        assert a.taken == [True, True]
        pc.free_units(a.returned)
        pc.release(look)
        assert look.lease not in pc._live
        look = pc.lookup_pooled(tokens + [1, 2, 3])
        assert look.hit_tokens == 256 and look.state_handle == slots[0]
        assert list(look.kv_pages) == list(pages)
        assert pc.plan(look.lease) == []
        _, mine = pc.reserve(0, 1)
        pc.copy_states([(look.state_handle, mine[0])])
        assert bytes(pc.view(mine[0])[:4]) == b"abcd"
        assert [loc.kind for loc in pc.resolve([look.state_handle, pages[0]])] == ["state", "kv"]
        pc.free_units(mine)
        pc.release(look.lease)
        assert sorted(pc.held()) == sorted(list(pages) + list(slots))
        pc.check()


def test_every_pool_method_refuses_on_a_cache_without_pools():
    with marconi.PrefixCache(1 << 30, "nemotron-h-8b") as pc:
        assert not pc.has_pools and pc.backend is None
        lease = pc.lookup(list(range(64)))
        calls = {
            "marconi_cache_lookup_pooled": lambda: pc.lookup_pooled([1, 2, 3]),
            "marconi_cache_lookup_pooled_hinted": lambda: pc.lookup_pooled([1, 2, 3], checkpoints=[2]),
            "marconi_cache_reserve": lambda: pc.reserve(1, 1),
            "marconi_cache_admit_pooled": lambda: pc.admit_pooled(lease, list(range(64)), [(64, 1)], [1, 2, 3, 4]),
            "marconi_cache_free_units": lambda: pc.free_units([1]),
            "marconi_cache_drain_freed_units": pc.drain_freed_units,
            "marconi_cache_held": pc.held,
            "marconi_cache_resolve": lambda: pc.resolve([1]),
            "marconi_cache_copy_states": lambda: pc.copy_states([(1, 2)]),
            "marconi_cache_pool_stats": pc.pool_stats,
        }
        for name, call in calls.items():
            with pytest.raises(marconi.MarconiError) as e:
                call()
            assert e.value.name == "UNSUPPORTED", name
            assert e.value.function == name, (name, e.value.function)
            assert "marconi_cache_config.pools" in str(e.value), str(e.value)
        with pytest.raises(marconi.MarconiError) as e:
            pc.view(1)
        assert e.value.name == "UNSUPPORTED"
        assert pc.stats()["leases"] == 1  # nothing changed
        lease.release()
        pc.check()


def test_the_methods_over_engine_ids_refuse_on_a_cache_over_pools():
    with marconi.PrefixCache(0, "nemotron-h-8b", page_size=16, pools=marconi.Pools(8 << 30, backend="none")) as pc:
        look = pc.lookup_pooled(list(range(64)))
        calls = {
            "marconi_cache_lookup_pooled": lambda: pc.lookup(list(range(64))),
            "marconi_cache_admit_pooled": lambda: pc.admit(look.lease, list(range(64)), [(64, 1)]),
            "marconi_cache_drain_freed_units": pc.drain_freed,
            "marconi_cache_reserve": lambda: pc.evict(1 << 20),
        }
        for name, call in calls.items():
            with pytest.raises(marconi.MarconiError) as e:
                call()
            assert e.value.name == "UNSUPPORTED", name
            assert name in str(e.value), str(e.value)
        with pytest.raises(marconi.MarconiError) as e:
            pc.lookup_tiered([1, 2, 3])
        assert e.value.name == "UNSUPPORTED"
        assert pc.pool_stats()["leases"] == 1  # nothing changed
        with pytest.raises(ValueError):
            pc.view(look.lease)  # backend none: no host memory
        pc.release(look)
        pc.check()


def test_the_events_over_pools_are_those_over_engine_ids():
    """Events name tokens, never units: the same admission publishes the
    same batches byte for byte on a cache over pools and on one over ids
    the engine owns (drained, and as a snapshot)."""
    tokens = list(range(1000, 1000 + 256))
    batches = []
    with marconi.PrefixCache(0, "nemotron-h-8b", page_size=16, alpha=1.0,
                             pools=marconi.Pools(1 << 30, backend="none")) as pc, marconi.CacheEvents(pc) as ev:
        look = pc.lookup_pooled(tokens[:200], checkpoints=[160])
        pages, slots = pc.reserve(256 // 16, 2)
        a = pc.admit_pooled(look, tokens, [(160, slots[1]), (256, slots[0])], pages)
        assert a.taken == [True, True]
        pc.release(look)
        batches += [ev.drain(ts=1.0), ev.drain(ts=1.5), ev.snapshot(ts=2.0)]
    with marconi.PrefixCache(1 << 30, "nemotron-h-8b", page_size=16, alpha=1.0) as c, marconi.CacheEvents(c) as ev:
        look = c.lookup(tokens[:200], checkpoints=[160])
        r = c.admit(look, tokens, [(160, 1), (256, 0)], kv_pages=list(range(16)))
        assert r.taken == [True, True]
        look.release()
        batches += [ev.drain(ts=1.0), ev.drain(ts=1.5), ev.snapshot(ts=2.0)]
    assert len(batches[0]) > 100 and batches[1] == batches[4] == b""
    assert batches[:3] == batches[3:]


def test_a_cache_over_pools_needs_no_capacity():
    """The pools' budget is the capacity: capacity_bytes may be left out
    with pools=, and is required without them."""
    with marconi.PrefixCache(model="nemotron-h-8b", page_size=16, pools=marconi.Pools(1 << 30, backend="none")) as pc:
        assert pc.has_pools
        assert pc.stats()["capacity_bytes"] == pc.pool_stats()["budget_bytes"] > 0
    with pytest.raises(TypeError, match="capacity_bytes is required unless pools="):
        marconi.PrefixCache(model="nemotron-h-8b")


def test_bad_pools_are_refused():
    with pytest.raises(TypeError, match="pools"):
        marconi.PrefixCache(0, "nemotron-h-8b", pools=42)
    with pytest.raises(TypeError, match="budget"):
        marconi.PrefixCache(0, "nemotron-h-8b", pools={"budget": 1 << 30})
    with pytest.raises(ValueError, match="backend"):
        marconi.PrefixCache(0, "nemotron-h-8b", pools=marconi.Pools(1 << 30, backend="disk"))
    with pytest.raises(marconi.MarconiError) as e:
        marconi.PrefixCache(0, "paper-7b-attn", pools=marconi.Pools(1 << 30))
    assert e.value.name == "INVALID_CONFIG"
    with pytest.raises(marconi.MarconiError) as e:
        marconi.PrefixCache(
            0, "nemotron-h-8b", pools=marconi.Pools(1 << 30), tiers=marconi.Tiers(host_bytes=1 << 30)
        )
    assert e.value.name == "INVALID_CONFIG" and "written through" in str(e.value)


def test_the_deprecated_pooled_cache_calls_the_one_handle():
    cache, _ = test_pooled.small_cache()
    with cache:
        look = cache.lookup(list(range(64)))
        with pytest.raises(marconi.MarconiError) as e:
            cache.reserve(10**6, 0)
        assert e.value.function == "marconi_cache_reserve"
        cache.release(look)
        assert cache.stats()["requests"] == 1
        cache.check()


class BytesEngine:
    """An engine over a cache with pools and tiers that moves bytes: the
    first 32 bytes of each KV page and state name the tokens they cover
    (what a recompute would write); every device hit, host write and load
    is checked against them. Its lower-tier copies are its own, by
    (namespace, chain), as the tier ops say."""

    def __init__(self, pc):
        self.pc, self.page = pc, pc.page_size
        self.copies = {"host": {}, "store": {}}
        self.host_hits = self.device_hits = self.writes = self.drops = 0

    @staticmethod
    def tag(kind, tokens):
        return hashlib.blake2b(repr((kind, list(tokens))).encode(), digest_size=32).digest()

    def put(self, h, data):
        self.pc.view(h)[:32] = data

    def get(self, h):
        return bytes(self.pc.view(h)[:32])

    def carry_out(self, ops, pages, states):
        for op in ops:
            key = (op.ns, tuple(op.tokens))
            if op.kind == "write" and op.tier == "host":
                slot = dict(states)[op.position]  # a state of the admission that decided it
                n = op.position // self.page
                copy = (self.get(slot), [self.get(h) for h in pages[:n]])
                assert copy[0] == self.tag("state", op.tokens)
                assert copy[1] == [self.tag("kv", op.tokens[: (i + 1) * self.page]) for i in range(n)]
                self.copies["host"][key] = copy
                self.writes += 1
            elif op.kind == "write":
                self.copies["store"][key] = self.copies["host"][key]
            else:
                del self.copies[op.tier][key]
                self.drops += 1

    def request(self, full, input_len, ns=0):
        pc, page = self.pc, self.page
        look = pc.lookup_pooled(full[:input_len], namespace=ns)
        for i, h in enumerate(look.kv_pages):
            assert self.get(h) == self.tag("kv", full[: (i + 1) * page])
        loads = pc.lease_loads(look)
        if not loads and look.hit_tokens:
            assert self.get(look.state_handle) == self.tag("state", full[: look.hit_tokens])
            self.device_hits += 1
        dev = len(look.kv_pages)
        pages, slots = pc.reserve(len(full) // page - dev, len(look.plan) + 1)
        done = dev
        for o in loads:
            copies = self.copies[o.tier]
            if o.kind == "kv":
                src = next(c for (n, chain), c in copies.items() if n == ns and chain[: o.end] == tuple(full[: o.end]))
                for i in range(o.start // page, -(-o.end // page)):
                    self.put(pages[i - dev], src[1][i])
                    done = max(done, i + 1)
            else:
                state, _ = copies[(ns, tuple(full[: o.position]))]
                assert state == self.tag("state", full[: o.position])
                assert o.position == look.hit_tokens and look.state_handle is None
                self.host_hits += o.tier == "host"
        for i in range(done, len(full) // page):
            self.put(pages[i - dev], self.tag("kv", full[: (i + 1) * page]))
        positions = sorted(set(look.plan) | {len(full)})
        states = list(zip(positions, slots))
        for p, s in states:
            self.put(s, self.tag("state", full[:p]))
        all_pages = list(look.kv_pages) + list(pages)
        a = pc.admit_pooled(look, full, states, all_pages)
        self.carry_out(pc.drain_ops(), all_pages, states)
        pc.free_units(list(a.returned) + list(slots[len(states):]))
        pc.release(look)
        later = pc.drain_ops()
        assert not [o for o in later if o.kind == "write" and o.tier == "host"]
        self.carry_out(later, [], [])
        pc.check()


@pytest.mark.parametrize("store", [False, True])
def test_pools_with_tiers_load_what_the_engine_wrote_down(store):
    page = 16
    p = marconi.plan("nemotron-h-8b", 1 << 30, page_size=page)
    budget = 4 * p["state_slot_bytes"] + 40 * p["kv_page_bytes"]
    budget = -(-budget // (2 << 20)) * (2 << 20)
    chain = 6 * page * p["kv_page_bytes"] // page + p["state_slot_bytes"]
    tiers = marconi.Tiers(
        host_bytes=(3 if store else 100) * chain, store_bytes=100 * chain if store else 0, write="through", always_load=True
    )
    pools = marconi.Pools(budget, state_fraction=0.3)
    with marconi.PrefixCache(model="nemotron-h-8b", page_size=page, alpha=1.0, pools=pools, tiers=tiers) as pc:
        assert pc.has_pools and pc.has_tiers
        e = BytesEngine(pc)
        for _ in range(4):
            for d in range(8):  # 8 documents of 6 pages, a question and an answer each
                doc = [d * 10_000 + i for i in range(6 * page)]
                full = doc + [random.randrange(1 << 30) for _ in range(2 * page)]
                e.request(full, len(full) - page)
                e.request(doc + full[len(doc):], len(full) - page)  # the same request again: a device hit
        ts = pc.tier_stats()
        assert e.writes > 0 and e.device_hits == ts["hits_by_tier"]["device"] > 0
        assert (ts["hits_by_tier"]["store" if store else "host"]) > 0
        assert e.host_hits == ts["hits_by_tier"]["host"]
        if store:
            assert e.drops > 0
        with pytest.raises(marconi.MarconiError) as err:
            pc.lookup_tiered([1, 2, 3])
        assert err.value.name == "UNSUPPORTED" and "marconi_cache_lookup_pooled" in str(err.value)
