"""marconi.Pool and the snapshot functions: allocate / resolve / free over
the memfd backend (addresses that hold what is written there), AVMP
migration within the budget, snapshot copy / fork / promote over a pool's
state slots and over caller buffers (numpy read in place), and misuse (each
refused with its status, changing nothing)."""

import array
import copy
import os
import pickle

import pytest

import marconi
from conftest import run_threads
from marconi import MarconiError, Pool

MIB = 1 << 20


def memfd_pool(**kw):
    args = dict(budget_bytes=16 * MIB, kv_page_bytes=64 << 10, state_slot_bytes=128 << 10, chunk_bytes=MIB)
    args.update(kw)
    return Pool(**args)


def test_allocate_resolve_write_free():
    with memfd_pool(migration="static", state_fraction=0.25) as pool:
        s = pool.stats()
        assert (s["backend"], s["budget_bytes"], s["budget_chunks"]) == ("memfd", 16 * MIB, 16)
        assert (s["kv_capacity"], s["state_capacity"]) == (192, 32)
        assert s["physical_bytes"] == 0
        kv = pool.allocate("kv", 10)
        assert isinstance(kv, array.array) and len(kv) == 10 and all(0 < h < 1 << 63 for h in kv)
        locs = pool.resolve(kv)
        assert [loc.kind for loc in locs] == ["kv"] * 10
        assert all(loc.unit_bytes == 64 << 10 and loc.byte_offset == loc.index * (64 << 10) for loc in locs)
        for i, h in enumerate(kv):
            v = pool.view(h)
            v[:] = bytes([i + 1]) * len(v)
        assert [pool.view(h)[100] for h in kv] == list(range(1, 11))
        assert list(pool.addresses(kv)) == [loc.address for loc in locs]
        s = pool.stats()
        assert s["kv_free"] == 182
        assert 10 * (64 << 10) <= s["physical_bytes"] <= s["budget_bytes"]
        pool.free(kv[:5])
        assert pool.stats()["kv_free"] == 187
        with pytest.raises(MarconiError) as e:
            pool.free(kv[:1])
        assert e.value.name == "DOUBLE_FREE" and e.value.function == "marconi_pool_free_units"
        # all or nothing: a freed handle in the list leaves the live ones live
        with pytest.raises(MarconiError) as e:
            pool.free([kv[5], kv[0]])
        assert e.value.name == "DOUBLE_FREE"
        assert pool.resolve([kv[5]])[0].index == locs[5].index
        with pytest.raises(MarconiError) as e:
            pool.resolve([0])
        assert e.value.name == "UNKNOWN_HANDLE"
        # static: too many units is out of memory, nothing allocated
        with pytest.raises(MarconiError) as e:
            pool.allocate("kv", 500)
        assert e.value.name == "OUT_OF_MEMORY"
        assert pool.stats()["kv_free"] == 187
        with pytest.raises(MarconiError) as e:
            pool.migrate("state")
        assert e.value.name == "UNSUPPORTED"
        pool.free(kv[5:])
        assert pool.stats()["kv_free"] == 192


def test_numpy_handles_are_read_in_place():
    np = pytest.importorskip("numpy")
    with memfd_pool() as pool:
        h = np.frombuffer(pool.allocate("state", 6), dtype=np.uint64).copy()
        locs = pool.resolve(h)
        assert [loc.kind for loc in locs] == ["state"] * 6
        pool.free(h.astype(np.int64))
        assert pool.stats()["state_free"] == pool.stats()["state_capacity"]


def test_avmp_migrates_and_stays_within_the_budget():
    with memfd_pool(migration="avmp", state_fraction=0.5, migration_batch_units=8) as pool:
        assert (pool.stats()["kv_capacity"], pool.stats()["state_capacity"]) == (128, 64)
        kv = pool.allocate("kv", 128)
        more = pool.allocate("kv", 8)  # the KV pool is full: one batch of 8 state slots moves
        s = pool.stats()
        assert (s["migrations"], s["kv_capacity"], s["state_capacity"]) == (1, 144, 56)
        for h in list(kv) + list(more):
            v = pool.view(h)
            v[:] = b"\x07" * len(v)
        s = pool.stats()
        assert s["mapped_chunks"] <= s["budget_chunks"]
        assert 136 * (64 << 10) <= s["physical_bytes"] <= s["budget_bytes"]
        with pytest.raises(MarconiError) as e:
            pool.migrate("state", 16)  # the KV tail is in use
        assert e.value.name == "OUT_OF_MEMORY"
        pool.free(kv)
        pool.free(more)
        m = pool.migrate("state", 16)
        assert m == {"donor": "kv", "donor_units": 16, "recipient_units": 8, "donor_bytes": 16 * (64 << 10)}
        assert pool.stats()["physical_bytes"] <= 16 * MIB


def test_pool_snapshots():
    with memfd_pool() as pool:
        st = pool.allocate("state", 8)
        for i, h in enumerate(st):
            pool.view(h)[:] = bytes([i + 1]) * (128 << 10)
        pool.copy_states([(st[0], st[1]), (st[2], st[3])])
        assert pool.view(st[1])[-1] == 1 and pool.view(st[3])[0] == 3
        pool.fork_state(st[7], st[4:7])
        assert [pool.view(h)[5] for h in st[4:7]] == [8, 8, 8]
        pool.view(st[5])[:] = b"\x55" * (128 << 10)
        assert pool.promote_state(st[0], st[4:7], 1, "copy_into") == st[0]
        assert pool.view(st[0])[9] == 0x55
        assert pool.promote_state(st[0], st[4:7], 2, "swap") == st[6]
        pool.view(st[1])[:] = b"\x11" * (128 << 10)
        for bad in ([(st[0], st[1]), (st[2], st[1])], [(st[0], st[1]), (st[1], st[2])], [(st[3], st[3])]):
            with pytest.raises(MarconiError) as e:
                pool.copy_states(bad)
            assert e.value.name == "INVALID_ARGUMENT"
        assert pool.view(st[1])[0] == 0x11
        kv = pool.allocate("kv", 1)
        with pytest.raises(MarconiError) as e:
            pool.copy_states([(kv[0], st[1])])
        assert e.value.name == "UNKNOWN_HANDLE"
        with pytest.raises(ValueError):
            pool.copy_states([(1, 2, 3)])
        with pytest.raises(ValueError):
            pool.promote_state(st[0], st[4:7], 0, "sideways")
        pool.copy_states([])


def test_pool_snapshots_take_numpy_pairs():
    np = pytest.importorskip("numpy")
    with memfd_pool() as pool:
        st = np.frombuffer(pool.allocate("state", 4), dtype=np.int64)
        for i, h in enumerate(st):
            np.frombuffer(pool.view(int(h)), dtype=np.uint8)[:] = i
        pool.copy_states(np.array([[st[0], st[2]], [st[1], st[3]]], dtype=np.int64))
        assert np.frombuffer(pool.view(int(st[2])), dtype=np.uint8).max() == 0
        assert np.frombuffer(pool.view(int(st[3])), dtype=np.uint8).min() == 1
        with pytest.raises(ValueError):
            pool.copy_states(np.zeros((2, 3), dtype=np.int64))


def test_caller_buffer_snapshots():
    np = pytest.importorskip("numpy")
    layers, slots, width = 3, 8, 10
    states = np.arange(layers * slots * width, dtype=np.float32).reshape(layers, slots, width)
    before = states.copy()
    marconi.snapshot_copy(states, slots, [(0, 5), (1, 6)], layers=layers)
    assert (states[:, 5] == before[:, 0]).all() and (states[:, 6] == before[:, 1]).all()
    assert (states[:, 7] == before[:, 7]).all()
    marconi.snapshot_fork(states, slots, 7, [2, 3], layers=layers)
    assert (states[:, 2] == before[:, 7]).all() and (states[:, 3] == before[:, 7]).all()
    assert marconi.snapshot_promote(states, slots, 0, [4, 6], 1, "copy_into", layers=layers) == 0
    assert (states[:, 0] == before[:, 1]).all()
    assert marconi.snapshot_promote(states, slots, 0, [4, 6], 0, layers=layers) == 4
    snap = states.copy()
    with pytest.raises(MarconiError) as e:
        marconi.snapshot_copy(states, slots, [(0, slots)], layers=layers)
    assert e.value.name == "INVALID_ARGUMENT" and "out of range" in e.value.detail
    with pytest.raises(MarconiError):
        marconi.snapshot_fork(states, slots, 1, [2, 2], layers=layers)
    assert (states == snap).all()
    with pytest.raises(ValueError):
        marconi.snapshot_copy(bytes(80), 8, [(0, 1)])  # read-only
    with pytest.raises(ValueError):
        marconi.snapshot_copy(bytearray(81), 8, [(0, 1)])  # does not split into slots
    with pytest.raises(ValueError):
        marconi.snapshot_copy(bytearray(80), 0, [(0, 1)])
    buf = bytearray(b"abcdefgh")
    marconi.snapshot_copy(buf, 4, [(3, 0)])
    assert buf == b"ghcdefgh"


def test_bad_configurations_are_refused():
    with pytest.raises(MarconiError) as e:
        Pool(0, 4096, 8192)
    assert e.value.name == "INVALID_CONFIG"
    with pytest.raises(MarconiError) as e:
        Pool(16 * MIB, 0, 8192)
    assert e.value.name == "INVALID_CONFIG"
    with pytest.raises(MarconiError) as e:
        Pool(16 * MIB, 4096, 8192, state_fraction=1.0)
    assert e.value.name == "INVALID_CONFIG"
    with pytest.raises(MarconiError) as e:
        Pool(3 * MIB, 4096, 8192)  # one 2 MiB chunk: not two pools
    assert e.value.name == "INVALID_CONFIG"
    with pytest.raises(ValueError):
        Pool(16 * MIB, 4096, 8192, backend="gpu")
    with pytest.raises(TypeError):
        Pool(16 * MIB, 4096, 8192, state_fraction="half")
    with pytest.raises(OverflowError):
        Pool(2**64, 4096, 8192)
    try:  # no GPU in CI (or a build without CUDA): a status, never a crash
        Pool(16 * MIB, 4096, 8192, backend="cuda").close()
    except MarconiError as e:
        assert e.name == "UNSUPPORTED"



def _device_bytes(torch, address, n):
    """A uint8 tensor over n bytes of device memory at `address`, in place
    (the CUDA array interface: no copy, no ownership)."""

    class _Device:
        __cuda_array_interface__ = {"shape": (n,), "typestr": "|u1", "data": (address, False), "version": 3}

    return torch.as_tensor(_Device(), device="cuda")


def test_cuda_pool_units_are_device_memory_torch_writes_in_place():
    """On a GPU (scripts/gpu-check.sh sets MARCONI_REQUIRE_GPU=1, where a
    missing GPU fails): a CUDA pool's units are device memory that torch
    reads and writes in place, and copy_states / fork_state / a migration
    move or keep those bytes on the device."""
    required = os.environ.get("MARCONI_REQUIRE_GPU") == "1"
    try:
        import torch
    except ImportError:
        if required:
            raise
        pytest.skip("no torch")
    if not torch.cuda.is_available():
        assert not required, "MARCONI_REQUIRE_GPU=1 but torch sees no GPU"
        pytest.skip("no CUDA device")
    try:
        # Migrations of 16 state slots (one 2 MiB chunk): the state pool's
        # tail is free while its head holds the live slots below.
        pool = Pool(32 * MIB, 64 << 10, 128 << 10, backend="cuda", migration="avmp", migration_batch_units=16)
    except MarconiError as e:
        assert not required, f"backend cuda refused on a GPU: {e}"
        pytest.skip(f"backend cuda refused: {e.name}")
    with pool:
        assert pool.stats()["backend"] == "cuda"
        st = pool.allocate("state", 4)
        views = [_device_bytes(torch, loc.address, loc.unit_bytes) for loc in pool.resolve(st)]
        g = torch.Generator(device="cuda").manual_seed(7)
        for v in views:
            v.copy_(torch.randint(0, 256, v.shape, dtype=torch.uint8, device="cuda", generator=g))
        want = [v.clone() for v in views]
        torch.cuda.synchronize()
        pool.copy_states([(st[0], st[1])])
        pool.fork_state(st[2], [st[3]])
        assert torch.equal(views[1], want[0]) and torch.equal(views[0], want[0])
        assert torch.equal(views[3], want[2]) and torch.equal(views[2], want[2])
        # Fill the KV pool and take one page more: chunks move from the
        # state pool, and the live state slots keep their bytes.
        kv = pool.allocate("kv", pool.stats()["kv_capacity"] + 1)
        assert pool.stats()["migrations"] >= 1
        assert torch.equal(views[0], want[0]) and torch.equal(views[2], want[2])
        pool.free(kv)
        pool.free(st)


def test_none_backend_has_offsets_and_no_copies():
    with Pool(16 * MIB, 4096, 8192, backend="none") as pool:
        st = pool.allocate("state", 2)
        locs = pool.resolve(st)
        assert [loc.address for loc in locs] == [0, 0]
        assert locs[1].byte_offset == locs[1].index * 8192
        with pytest.raises(MarconiError) as e:
            pool.copy_states([(st[0], st[1])])
        assert e.value.name == "UNSUPPORTED"
        with pytest.raises(ValueError):
            pool.view(st[0])


def test_misuse_of_the_object():
    pool = memfd_pool()
    with pytest.raises(TypeError):
        copy.copy(pool)
    with pytest.raises(TypeError):
        pickle.dumps(pool)
    with pytest.raises(ValueError):
        pool.allocate("ssm", 1)
    with pytest.raises(TypeError):
        pool.allocate("kv", 1.5)
    with pytest.raises(OverflowError):
        pool.free([-1])
    pool.close()
    pool.close()
    assert pool.closed
    with pytest.raises(ValueError):
        pool.stats()


def test_threads_share_a_pool():
    with memfd_pool() as pool:
        def work(kind):
            for _ in range(200):
                h = pool.allocate(kind, 4)
                pool.resolve(h)
                pool.free(h)

        assert run_threads(work, [(k,) for k in ("kv", "state", "kv", "state")]) == []
        s = pool.stats()
        assert (s["kv_free"], s["state_free"]) == (s["kv_capacity"], s["state_capacity"])


def test_a_view_outlives_close_without_crashing():
    # Writing a view after close() used to write into unmapped memory and
    # kill the interpreter; the view now keeps the mapping until it is gone.
    pool = memfd_pool()
    (h,) = pool.allocate("state", 1)
    v = pool.view(h)
    w = pool.view(h)[:16]
    pool.close()
    v[:] = b"\x07" * len(v)
    assert v[0] == 7 and v[-1] == 7 and w[15] == 7
    del v
    w[0] = 9
    assert w[0] == 9
    del w
    with pytest.raises(ValueError):
        pool.view(h)


def test_handles_of_another_pool_are_refused():
    with memfd_pool() as a, memfd_pool() as b:
        ha, hb = a.allocate("kv", 3), b.allocate("kv", 3)
        assert set(ha).isdisjoint(hb)
        for h in ha:
            with pytest.raises(MarconiError) as e:
                b.free([h])
            assert e.value.name == "UNKNOWN_HANDLE"
        assert b.stats()["kv_free"] == b.stats()["kv_capacity"] - 3
        a.free(ha)
        b.free(hb)
