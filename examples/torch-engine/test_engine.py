"""The torch engine's checks (pytest; needs torch and transformers):
every request of a chat workload with evictions matches a no-cache run, the
negative controls fail that check, and the byte sizes libmarconi computes
from each family's config.json equal the tensors the model's own cache holds."""

import pytest
import torch

import marconi
from engine import FAULTS, TOLERANCE, Engine, measured_bytes, run, tiny_nemotron_h

torch.set_num_threads(1)


def test_every_request_matches_the_no_cache_run():
    s = run(0)
    assert s["requests"] >= 20
    assert s["evictions"] > 0, "the capacity must be small enough to evict"
    assert s["requests_with_hit"] >= s["requests"] // 2
    assert s["hit_tokens"] > 0 and s["prefill_tokens_cached"] < s["prefill_tokens_no_cache"]
    assert sum(r.states_taken for r in s["results"]) > 0
    assert s["mismatched_requests"] == 0, [r.max_diff for r in s["results"]]
    assert all(r.matches for r in s["results"])
    assert s["max_relative_diff"] <= TOLERANCE



def test_a_failed_admission_returns_every_slot_and_page():
    cfg, model = tiny_nemotron_h(0, 64)
    spec = marconi.ModelSpec.from_hf_config(cfg)
    with marconi.PrefixCache(1, model=spec) as probe:
        sizes = probe.stats()
    capacity = 6 * sizes["state_bytes_per_entry"] + 384 * sizes["kv_bytes_per_token"]
    engine = Engine(cfg, model, capacity, chunk_tokens=64, max_request_tokens=1024)
    v = cfg.vocab_size
    prompt = [i * 7 % (v - 1) + 1 for i in range(199)]
    more = [i * 13 % (v - 1) + 1 for i in range(120)]
    turn2 = prompt + engine.serve(prompt, 6).output + more  # resumes from the first turn's state
    before = (sorted(engine.free_slots), sorted(engine.free_pages))
    admit = engine.cache.admit

    def failing_admit(*args, **kwargs):
        raise marconi.MarconiError(2, "injected", "marconi_cache_admit")

    engine.cache.admit = failing_admit
    with pytest.raises(marconi.MarconiError):
        engine.serve(turn2, 6)  # a hit, new states and pages
    assert (sorted(engine.free_slots), sorted(engine.free_pages)) == before
    engine.cache.admit = admit
    assert engine.serve(turn2, 6).hit_tokens > 0
    engine.cache.check()

@pytest.mark.parametrize("fault", FAULTS)
def test_a_lost_state_fails_the_check(fault):
    s = run(1, fault=fault, sessions=4)
    assert s["requests_with_hit"] > 0
    # Every request that resumed from a (zeroed) state is caught; requests
    # without a hit restore nothing and still match.
    assert s["mismatched_requests"] == s["requests_with_hit"]
    for r in s["results"]:
        assert (r.max_diff > 100 * TOLERANCE * max(1.0, r.max_logit)) == (r.hit_tokens > 0)


def _families():
    from transformers import (
        BambaConfig,
        BambaForCausalLM,
        FalconH1Config,
        FalconH1ForCausalLM,
        GraniteMoeHybridConfig,
        GraniteMoeHybridForCausalLM,
        JambaConfig,
        JambaForCausalLM,
        Zamba2Config,
        Zamba2ForCausalLM,
    )

    m2 = dict(mamba_d_state=16, mamba_d_conv=4, mamba_expand=2)
    m2h = dict(m2, mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=1)
    return {
        "bamba": (BambaConfig, BambaForCausalLM, dict(m2h, num_hidden_layers=4, attn_layer_indices=[1])),
        "granitemoehybrid": (
            GraniteMoeHybridConfig,
            GraniteMoeHybridForCausalLM,
            dict(
                m2h,
                num_hidden_layers=4,
                layer_types=["mamba", "attention", "mamba", "mamba"],
                num_local_experts=4,
                num_experts_per_tok=2,
                shared_intermediate_size=64,
            ),
        ),
        "falcon_h1": (FalconH1Config, FalconH1ForCausalLM, dict(m2h, num_hidden_layers=2, head_dim=16, mamba_d_ssm=128)),
        "zamba2": (
            Zamba2Config,
            Zamba2ForCausalLM,
            dict(
                m2,
                num_hidden_layers=4,
                layers_block_type=["mamba", "hybrid", "mamba", "hybrid"],
                n_mamba_heads=8,
                mamba_headdim=16,
                mamba_ngroups=1,
                num_mem_blocks=1,
            ),
        ),
        "jamba": (
            JambaConfig,
            JambaForCausalLM,
            dict(
                m2,
                num_hidden_layers=4,
                attn_layer_period=2,
                attn_layer_offset=1,
                expert_layer_period=2,
                expert_layer_offset=1,
                num_experts=4,
                num_experts_per_tok=2,
            ),
        ),
    }


def _library_sizes(cfg):
    spec = marconi.ModelSpec.from_hf_config(cfg)
    with marconi.PrefixCache(1, model=spec) as cache:
        st = cache.stats()
    return st["kv_bytes_per_token"], st["state_bytes_per_entry"]


def test_nemotron_h_sizes_equal_its_cache_tensors():
    cfg, model = tiny_nemotron_h()
    got = measured_bytes(model, cfg)
    assert _library_sizes(cfg) == (got["kv_bytes_per_token"], got["state_bytes"])
    # Read back from the JSON transformers writes (layers_block_type list).
    assert marconi.ModelSpec.from_hf_config(cfg.to_json_string()) == marconi.ModelSpec.from_hf_config(cfg)


@pytest.mark.parametrize("family", ["bamba", "granitemoehybrid", "falcon_h1", "zamba2", "jamba"])
def test_other_families_sizes_equal_their_cache_tensors(family):
    config_cls, model_cls, kw = _families()[family]
    torch.manual_seed(0)
    common = dict(vocab_size=128, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96)
    cfg = config_cls(**common, **kw, dtype="float32")
    model = model_cls(cfg).eval()
    got = measured_bytes(model, cfg)
    assert got["kv_bytes_per_token"] > 0 and got["state_bytes"] > 0
    assert _library_sizes(cfg) == (got["kv_bytes_per_token"], got["state_bytes"])
