"""The Pythonic API over the C ABI: the request cycle, errors carrying the
status message, context managers, buffers, threads."""

import array
import threading

import pytest

import marconi
from conftest import run_threads
from marconi import MarconiError, PrefixCache

BIG = 100_000_000_000


def test_version_matches_header(header_text):
    assert f'#define MARCONI_VERSION_STRING "{marconi.version()}"' in header_text
    assert marconi.version() == marconi.__version__


def test_multi_turn_request_cycle():
    with PrefixCache(BIG, "paper-7b", decision_log=True) as cache:
        prompt = list(range(100))
        with cache.lookup(prompt, dst_slot=1) as lease:
            assert (lease.hit_tokens, lease.kv_matched_tokens, lease.state_slot) == (0, 0, None)
            assert lease.copy_order is None
            full = prompt + list(range(1000, 1020))
            res = lease.admit(full, [(120, 7)])
            assert res.taken == [True] and res.states_taken == 1 and not res.rejected
            assert res.new_kv_tokens == 120
        assert lease.released
        turn2 = full + list(range(2000, 2010))
        with cache.lookup(turn2, dst_slot=8) as lease:
            assert (lease.hit_tokens, lease.state_slot, lease.copy_order) == (120, 7, (7, 8))
            lease.admit(turn2 + [5, 6], [(132, 9)])
        # A branch at 50: KV matches but no state there, so Marconi plans one.
        other = prompt[:50] + list(range(5000, 5030))
        with cache.lookup(other) as lease:
            assert (lease.hit_tokens, lease.kv_matched_tokens, lease.plan) == (0, 50, [50])
            lease.admit(other, [(50, 10), (80, 11)])
        with cache.lookup(prompt[:50] + [1, 2, 3]) as lease:
            assert (lease.hit_tokens, lease.state_slot) == (50, 10)
        s = cache.stats()
        assert s["requests"] == 4 and s["hit_requests"] == 2
        assert s["hit_tokens"] == 120 + 50
        assert s["kv_matched_unusable_tokens"] == 50
        assert s["leases"] == 0 and s["states"] == 4
        log = cache.drain_log()
        kinds = [r["kind"] for r in log]
        assert kinds.count("lookup") == 4 and kinds.count("release") == 4
        # Log lease ids are the ABI's: the last lookup logged is this lease.
        assert [r["lease"] for r in log if r["kind"] == "lookup"][-1] == lease.id
        assert cache.drain_log() == []
        cache.check()


def test_errors_carry_status_and_detail_and_change_nothing():
    with PrefixCache(BIG) as cache:
        cache.serve(list(range(30)), list(range(30, 40)))
        before = cache.stats()
        with pytest.raises(MarconiError) as e:
            cache.lookup([])
        assert e.value.name == "EMPTY_TOKENS" and e.value.status == 8
        assert "token array is empty" in str(e.value)
        with pytest.raises(MarconiError) as e:
            cache.release(12345)
        assert e.value.name == "UNKNOWN_LEASE"
        assert "lease 12345 was not issued by this cache" in e.value.detail
        lease = cache.lookup(list(range(30)) + [500] * 15)
        mid = cache.stats()
        with pytest.raises(MarconiError) as e:
            lease.admit(list(range(30)) + [500] * 15, [(17, 1)])
        assert e.value.name == "NOT_PLANNED" and "position 17" in e.value.detail
        with pytest.raises(MarconiError) as e:
            lease.admit(list(range(30)) + [500] * 15, [(30, 1), (45, 1)])
        assert e.value.name == "DUPLICATE_SLOT"
        with pytest.raises(MarconiError) as e:
            lease.admit([9] * 45, [])
        assert e.value.name == "PREFIX_MISMATCH"
        assert cache.stats() == mid
        lease.release()
        with pytest.raises(MarconiError) as e:
            lease.release()
        assert e.value.name == "UNKNOWN_LEASE"
        with pytest.raises(MarconiError) as e:
            cache.admit(lease, list(range(45)), [])
        assert e.value.name == "UNKNOWN_LEASE"
        after = cache.stats()
        assert after["requests"] == before["requests"] + 1
        with pytest.raises(ValueError):
            cache.lookup([1, -2, 3])
        with pytest.raises(ValueError):
            cache.lookup([1, 2**32])
    with pytest.raises(MarconiError) as e:
        PrefixCache(0)
    assert e.value.name == "INVALID_CONFIG" and "capacity_bytes is 0" in e.value.detail
    with pytest.raises(MarconiError) as e:
        PrefixCache(BIG, "no-such-model")
    assert e.value.name == "UNKNOWN_PRESET" and "paper-7b" in e.value.detail
    with pytest.raises(MarconiError) as e:
        PrefixCache(BIG, page_size=16, admission="all_blocks", block_size=24)
    assert e.value.name == "INVALID_CONFIG"


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1.0])
def test_a_bad_superseded_age_is_refused_with_its_reason(value):
    with pytest.raises(MarconiError) as e:
        PrefixCache(BIG, superseded_age=value)
    assert e.value.name == "INVALID_CONFIG" and "superseded_age" in e.value.detail


def test_superseded_age_is_passed_to_the_library():
    for value in (0, 0.5, 2.0):
        with PrefixCache(BIG, superseded_age=value) as cache:
            assert cache.serve(list(range(40)), [1, 2]).hit_tokens == 0
            assert cache.serve(list(range(40)) + [1, 2, 7], [3]).hit_tokens == 42
    with pytest.raises(TypeError):
        PrefixCache(BIG, superseded_age="2")


def test_status_messages():
    assert marconi.status_message(0) == "ok"
    assert marconi.status_message(10) == "lease is unknown or already released"
    assert marconi.status_message(123456) == marconi.status_message(2)


def test_token_buffers_without_numpy():
    tokens = list(range(64))
    with PrefixCache(BIG) as cache:
        cache.serve(tokens, list(range(100, 110)))
        full = tokens + list(range(100, 110)) + [7]
        for form in (
            full,
            tuple(full),
            array.array("I", full),
            memoryview(array.array("I", full)),
            array.array("I", full).tobytes(),
            bytearray(array.array("I", full).tobytes()),
        ):
            with cache.lookup(form) as lease:
                assert lease.hit_tokens == 74, type(form)


def test_custom_model_and_pages():
    spec = {
        "attn_layers": 2, "ssm_layers": 6, "mlp_layers": 8, "d_model": 512,
        "n_heads": 8, "kv_heads": 2, "head_dim": 64, "ffn_dim": 2048, "ffn_matrices": 3,
        "ssm_inner": 1024, "d_state": 16, "ssm_state_channels": 1024,
        "conv_channels": 1024, "conv_kernel": 4, "dtype_bytes": 2, "state_dtype_bytes": 4,
    }
    with PrefixCache(10**9, spec, page_size=16) as cache:
        tokens = list(range(70))  # 4 full pages
        with cache.lookup(tokens) as lease:
            res = lease.admit(tokens, [(64, 3)], kv_pages=[10, 11, 12, 13])
            assert res.kv_pages_taken == range(0, 4)
        with cache.lookup(tokens + [1]) as lease:
            assert lease.hit_tokens == 64
            assert lease.kv_pages == [10, 11, 12, 13]
        s = cache.stats()
        assert s["kv_bytes_per_token"] == 2 * 2 * 2 * 64 * 2  # layers*K,V*heads*dim*bytes
        assert s["kv_bytes"] == 64 * s["kv_bytes_per_token"]
        cache.evict(10**9)
        pages, slots = cache.drain_freed()
        assert sorted(pages) == [10, 11, 12, 13] and slots == [3]
        assert cache.drain_freed() == ([], [])


def test_threads_share_a_cache():
    cache = PrefixCache(1_500_000_000)
    slot_lock = threading.Lock()
    next_slot = [1]

    def fresh():
        with slot_lock:
            next_slot[0] += 1
            return next_slot[0]

    def worker(t):
        for conv in range(6):
            hist = list(range(32))
            for turn in range(3):
                hist += range(10**6 * (t + 1) + 1000 * conv + 100 * turn, 10**6 * (t + 1) + 1000 * conv + 100 * turn + 10)
                out = list(range(9 * 10**8 + 10**5 * t + 1000 * conv + 10 * turn, 9 * 10**8 + 10**5 * t + 1000 * conv + 10 * turn + 5))
                lease = cache.serve(hist, out, slots=fresh)
                assert lease.hit_tokens < len(hist)
                hist += out

    assert run_threads(worker, [(t,) for t in range(4)]) == []
    s = cache.stats()
    assert s["requests"] == 4 * 6 * 3 and s["leases"] == 0
    assert s["evictions"] > 0 and s["hit_requests"] > 0
    cache.check()
    cache.close()
    cache.close()  # idempotent
    with pytest.raises(ValueError):
        cache.stats()


def test_tuner_adoption_modes():
    # Engines get when_ready by default; deterministic is there for replays.
    for mode in ("when_ready", "deterministic"):
        with marconi.PrefixCache(1 << 30, "paper-7b", tuner_adoption=mode) as cache:
            lease = cache.lookup([1, 2, 3])
            cache.release(lease)
    with pytest.raises(ValueError, match="tuner_adoption"):
        marconi.PrefixCache(1 << 30, "paper-7b", tuner_adoption="eventually")
