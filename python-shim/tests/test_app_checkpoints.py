"""Application checkpoint hints (lookup(checkpoints=...)) and the tuning
settings of marconi_cache_config version 3 (policy presets, tuner and
shadow keyword arguments)."""

import array

import pytest

from marconi import MarconiError, MarconiPrefixCache, PrefixCache

BIG = 100_000_000_000
PROMPT = list(range(1000))


def request(user: int) -> list:
    return PROMPT + list(range(10_000 * (user + 1), 10_000 * (user + 1) + 50))


def test_a_hint_lets_the_second_request_reuse_a_new_system_prompt():
    with PrefixCache(BIG, decision_log=True) as plain, PrefixCache(BIG, decision_log=True) as hinted:
        plain.serve(request(0), [7])
        assert plain.serve(request(1), [8]).hit_tokens == 0
        lease = hinted.serve(request(0), [7], checkpoints=[1000])
        assert lease.plan == [1000]
        plans = [r for r in hinted.drain_log() if r["kind"] == "plan"]
        assert plans == [{"kind": "plan", "lease": lease.id, "positions": [1000], "reason": "AppCheckpoint"}]
        with hinted.lookup(request(1), checkpoints=[1000]) as second:
            assert second.hit_tokens == 1000
            assert second.plan == []
        hinted.check()


def test_hints_are_filtered_and_take_any_token_form():
    with PrefixCache(BIG, page_size=16, checkpoint_grid=64) as cache:
        # Unsorted, duplicated, past the input, below the grid: kept 640 and 896.
        hints = [901, 700, 5000, 0, 700, 899]
        for form in (hints, tuple(hints), array.array("I", hints)):
            with cache.lookup(list(range(1000)), checkpoints=form) as lease:
                assert lease.plan == [640, 896]
        with cache.lookup(list(range(1000)), checkpoints=[]) as lease:
            assert lease.plan == []
        with pytest.raises(TypeError):
            cache.lookup(list(range(10)), checkpoints=[1.5])
        with pytest.raises(ValueError):
            cache.lookup(list(range(10)), checkpoints=[-1])
        assert cache.stats()["leases"] == 0


def test_admitting_at_a_hint():
    with PrefixCache(BIG) as cache:
        with cache.lookup(request(0), checkpoints=[300]) as lease:
            assert lease.plan == [300]
            with pytest.raises(MarconiError) as e:
                lease.admit(request(0), [(400, 1)])
            assert e.value.name == "NOT_PLANNED"
            res = lease.admit(request(0), [(300, 1), (1050, 2)])
            assert res.states_taken == 2
        with cache.lookup(PROMPT[:300] + [5, 6]) as lease:
            assert (lease.hit_tokens, lease.state_slot) == (300, 1)


@pytest.mark.parametrize(
    "policy, fields",
    [
        ("marconi-paper", {"protect_branch_states": 0, "tuner_retune": 0, "tuner_objective": 1, "tuner_tune_rules": 0}),
        ("marconi", {"tuner_tune_rules": 1, "tuner_max_window": 0, "shadows": 0}),
        ("marconi-tuned", {"tuner_tune_rules": 1, "tuner_max_window": 100, "shadows": 0}),
        ("marconi-shadow", {"shadows": 1, "shadow_tuned": 1, "shadow_half_life": 200}),
        ("sglang-plus", {"eviction": 0, "alpha_mode": 0}),
    ],
)
def test_policy_presets(policy, fields):
    import ctypes

    from marconi import _lib

    lib = _lib.load()
    cfg = _lib.marconi_cache_config()
    assert lib.marconi_cache_config_preset(ctypes.byref(cfg), ctypes.sizeof(cfg), policy.encode()) == 0
    for k, v in fields.items():
        assert getattr(cfg, k) == v, k
    with PrefixCache(2_000_000_000, policy=policy) as cache:
        for k in range(40):
            cache.serve(PROMPT[:200] + list(range(1000 * (k + 2), 1000 * (k + 2) + 200)))
        cache.check()


def test_unknown_policy_and_bad_tuning_values_are_refused():
    with pytest.raises(MarconiError) as e:
        PrefixCache(BIG, policy="marconi-best")
    assert e.value.name == "UNKNOWN_PRESET" and "marconi-paper" in str(e.value)
    # A policy name is not called a model preset.
    with pytest.raises(MarconiError) as e:
        PrefixCache(BIG, policy="lru")
    assert "policy preset" in str(e.value) and "model preset" not in str(e.value)
    with pytest.raises(TypeError):
        PrefixCache(BIG, policy=3)
    for kwargs in (
        {"tuner_retune_every": 0},
        {"shadows": {"hysteresis": -1.0}},
        {"shadows": {"sample_tokens": 0}},
        {"shadows": {"tuned": False}},
        {"shadows": True, "alpha": 0.5},
        {"shadows": {"alphas": [float("nan")]}},
    ):
        with pytest.raises(MarconiError) as e:
            PrefixCache(BIG, **kwargs)
        assert e.value.name == "INVALID_CONFIG", kwargs
    # Rule tuning is on by default and ignored with a fixed alpha.
    with PrefixCache(BIG, alpha=0.5) as cache:
        assert cache.stats()["alpha"] == 0.5
    with pytest.raises(ValueError):
        PrefixCache(BIG, shadows={"colour": 1})
    with pytest.raises(ValueError):
        PrefixCache(BIG, tuner_max_window=-1)
    with pytest.raises(ValueError):
        PrefixCache(BIG, admission="every_token")


def test_tuning_settings_build_working_caches():
    settings = [
        {"tuner_tune_rules": True, "tuner_max_window": 50, "tuner_apply_after": 0, "tuner_adoption": "deterministic"},
        {"shadows": {"alphas": [0.5, 2.0], "lru": True, "half_life": 20, "exact_bytes": 1 << 20}},
        {"policy": "marconi-paper", "protect_branch_states": True},
        {"tuner_bootstrap_factor": 2, "tuner_min_window": 4, "tuner_retune_every": 1, "tuner_min_gain": 0.01},
        {"min_branch_depth": 0, "tuner_retune": False, "tuner_retune_neighbours": 0},
    ]
    for kwargs in settings:
        with PrefixCache(500_000_000, **kwargs) as cache:
            for k in range(60):
                cache.serve(PROMPT[: 100 + 50 * (k % 3)] + list(range(2000 * (k + 1), 2000 * (k + 1) + 100)))
            assert cache.stats()["requests"] == 60
            cache.check()


def test_the_adapter_passes_hints():
    a = MarconiPrefixCache(BIG)
    res = a.match_prefix(request(0), checkpoints=[1000])
    node = res.last_device_node
    assert node.plan == [1000]
    a.inc_lock_ref(node)
    a.dec_lock_ref(node)
    res = a.match_prefix(request(0))
    assert res.last_device_node.plan == []
    a.inc_lock_ref(res.last_device_node)
    a.dec_lock_ref(res.last_device_node)
    a.cache.check()
    a.cache.close()


def test_the_pooled_cache_takes_hints():
    import marconi

    p = marconi.plan("nemotron-h-8b", 1 << 30, page_size=16)
    budget = 8 * p["state_slot_bytes"] + 2048 // 16 * p["kv_page_bytes"] + (4 << 20)
    with marconi.PooledCache(budget, "nemotron-h-8b", page_size=16, alpha=1.0) as cache:
        a = PROMPT[:320] + list(range(100_000, 100_080))
        lease = cache.lookup(a, checkpoints=[330, 320])
        assert lease.plan == [320]
        cache.release(lease)
        lease = cache.lookup(a, checkpoints=[])
        assert lease.plan == []
        cache.release(lease)
        with pytest.raises(ValueError):
            cache.lookup(a, checkpoints=[-1])
        assert cache.stats()["leases"] == 0
        cache.check()
