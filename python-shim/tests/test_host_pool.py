"""marconi.HostPool: host tier memory over the C ABI. Units of its own
(a device Pool refuses its handles and the reverse), demote / promote
between a memfd device Pool and the host pool (bytes arrive both ways),
all or nothing on a bad pair, and misuse refused with its status."""

import pytest

from marconi import HostPool, MarconiError, Pool

MIB = 1 << 20
PAGE = 16 << 10
STATE = 64 << 10


def device(**kw):
    args = dict(budget_bytes=8 * MIB, kv_page_bytes=PAGE, state_slot_bytes=STATE, migration="static")
    args.update(kw)
    return Pool(**args)


def host(**kw):
    args = dict(capacity_bytes=8 * MIB, page_bytes=PAGE, state_bytes=STATE)
    args.update(kw)
    return HostPool(**args)


def test_capacity_stats_and_config_errors():
    with host(state_fraction=0.25) as h:
        s = h.stats()
        assert s["capacity_bytes"] == 8 * MIB
        assert (s["state_capacity"], s["page_capacity"]) == (2 * MIB // STATE, 6 * MIB // PAGE)
        assert (s["pages_live"], s["states_live"]) == (0, 0)
        assert isinstance(s["pinned"], bool)
    for bad in (dict(capacity_bytes=3 * MIB), dict(page_bytes=0), dict(state_fraction=1.0), dict(chunk_bytes=1000)):
        with pytest.raises(MarconiError) as e:
            host(**bad)
        assert e.value.name == "INVALID_CONFIG"


def test_demote_and_promote_move_the_bytes():
    with device() as dev, host() as hp:
        ds = dev.allocate("state", 2)
        dk = dev.allocate("kv", 3)
        hs = hp.allocate("state", 2)
        hk = hp.allocate("kv", 3)
        for i, x in enumerate(list(ds) + list(dk)):
            v = dev.view(x)
            v[:] = bytes([(i * 37 + b) % 251 for b in range(256)]) * (len(v) // 256)
        n = hp.demote(dev, list(zip(ds, hs)) + list(zip(dk, hk)))
        assert n == 2 * STATE + 3 * PAGE
        for a, b in zip(list(ds) + list(dk), list(hs) + list(hk)):
            assert bytes(dev.view(a)) == bytes(hp.view(b))
        hp.view(hs[1])[:] = b"\x77" * STATE
        assert hp.promote(dev, [(hs[1], ds[0])]) == STATE
        assert bytes(dev.view(ds[0])) == b"\x77" * STATE
        s = hp.stats()
        assert (s["bytes_demoted"], s["bytes_promoted"], s["units_moved"]) == (2 * STATE + 3 * PAGE, STATE, 6)
        assert hp.demote(dev, []) == 0
        locs = hp.resolve(hk)
        assert [l.kind for l in locs] == ["kv"] * 3 and all(l.unit_bytes == PAGE for l in locs)
        hp.free(hk)
        hp.free(hs)


def test_bad_handles_refuse_the_batch_and_copy_nothing():
    with device() as dev, host() as hp:
        ds = dev.allocate("state", 1)[0]
        dk = dev.allocate("kv", 1)[0]
        hs = hp.allocate("state", 1)[0]
        gone = hp.allocate("kv", 1)[0]
        hp.free([gone])
        hp.view(hs)[:] = b"\x5a" * STATE
        cases = [
            ([(hs, ds)], "UNKNOWN_HANDLE"),  # host handle on the device side
            ([(ds, hs), (dk, gone)], "DOUBLE_FREE"),  # freed host unit
            ([(dk, hs)], "INVALID_ARGUMENT"),  # page into a state slot
            ([(ds, hs), (ds, hs)], "INVALID_ARGUMENT"),  # destination twice
        ]
        for pairs, status in cases:
            with pytest.raises(MarconiError) as e:
                hp.demote(dev, pairs)
            assert e.value.name == status, pairs
        assert bytes(hp.view(hs)) == b"\x5a" * STATE
        assert hp.stats()["units_moved"] == 0
        # Each pool refuses the other's handles.
        with pytest.raises(MarconiError) as e:
            hp.free([ds])
        assert e.value.name == "UNKNOWN_HANDLE"
        with pytest.raises(MarconiError) as e:
            dev.free([hs])
        assert e.value.name == "UNKNOWN_HANDLE"
        with pytest.raises(TypeError):
            hp.demote(hp, [(hs, hs)])
    with device(backend="none") as none, host() as hp:
        s = none.allocate("state", 1)[0]
        h = hp.allocate("state", 1)[0]
        with pytest.raises(MarconiError) as e:
            hp.demote(none, [(s, h)])
        assert e.value.name == "UNSUPPORTED"


def test_closed_host_pool_refuses_calls():
    hp = host()
    hp.close()
    with pytest.raises(ValueError):
        hp.allocate("kv", 1)
    hp.close()
