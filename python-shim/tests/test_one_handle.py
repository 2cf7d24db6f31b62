"""Lower tiers as an option of the one cache handle
(marconi.PrefixCache(..., tiers=marconi.Tiers(...)), docs/tiers.md): the
engine's copies kept in step through the tier methods, the device view of
lookup() on such a cache, every tier method refused on a cache without
tiers, and the deprecated TieredCache still working over the same handle."""

import pytest

import marconi
from test_tiered import Engine, chain_bytes, workload


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
        e = Engine(OneHandle(pc))
        for prompt, output in workload(10, 6, 3):
            e.serve(prompt, output)
            pc.check()
        s = pc.tier_stats()
        assert s["requests"] == 60
        assert s["hits_by_tier"]["host"] > 0 and s["writes"]["host"] > 0
        assert pc.stats()["requests"] == 60
        assert e.failures == 0


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
