"""ModelSpec.from_hf_config: a Hugging Face config.json read by the library
(marconi_model_spec_from_hf_config), every accepted form of the config, and
clear errors for bad ones. The sizes checked against the tensors a real
model stores are in examples/torch-engine (needs torch)."""

import json

import pytest

import marconi

TINY = {
    "model_type": "nemotron_h",
    "hidden_size": 64,
    "hybrid_override_pattern": "M-M*-",
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "mlp_hidden_act": "relu2",
    "mamba_num_heads": 8,
    "mamba_head_dim": 16,
    "ssm_state_size": 16,
    "n_groups": 2,
    "conv_kernel": 4,
    "torch_dtype": "float32",
}


class FakeConfig:
    """What a transformers PretrainedConfig offers."""

    def to_json_string(self):
        return json.dumps(TINY)


def test_every_form_gives_the_same_spec(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY))
    specs = [
        marconi.ModelSpec.from_hf_config(x)
        for x in (TINY, json.dumps(TINY), json.dumps(TINY).encode(), path, FakeConfig())
    ]
    assert all(s == specs[0] for s in specs)
    s = specs[0]
    assert (s["attn_layers"], s["ssm_layers"], s["mlp_layers"]) == (1, 2, 2)
    assert s["conv_channels"] == 8 * 16 + 2 * 2 * 16
    assert s["dtype_bytes"] == s["state_dtype_bytes"] == 4


def test_the_library_byte_sizes_follow_the_config():
    spec = marconi.ModelSpec.from_hf_config(TINY)
    with marconi.PrefixCache(1 << 20, model=spec) as cache:
        st = cache.stats()
    assert st["kv_bytes_per_token"] == 1 * 2 * 2 * 16 * 4
    assert st["state_bytes_per_entry"] == 2 * (8 * 16 * 16 + (128 + 64) * 4) * 4


def test_nemotron_h_8b_is_the_preset():
    cfg = dict(
        TINY,
        hidden_size=4096,
        hybrid_override_pattern="M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-M-M-M-M-M-M-",
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=21504,
        mamba_num_heads=128,
        mamba_head_dim=64,
        ssm_state_size=128,
        n_groups=8,
        torch_dtype="bfloat16",
    )
    assert marconi.ModelSpec.from_hf_config(cfg) == marconi.ModelSpec.preset("nemotron-h-8b")


@pytest.mark.parametrize(
    "bad, status, words",
    [
        ("{oops", "INVALID_ARGUMENT", "not valid JSON"),
        ("", "INVALID_ARGUMENT", "empty"),
        (b"\xff", "INVALID_ARGUMENT", "UTF-8"),
        ({"model_type": "llama"}, "INVALID_CONFIG", "unsupported model_type"),
        ({k: v for k, v in TINY.items() if k != "n_groups"}, "INVALID_CONFIG", "n_groups"),
        (dict(TINY, hybrid_override_pattern="M-X"), "INVALID_CONFIG", "hybrid_override_pattern"),
        (dict(TINY, torch_dtype="complex64"), "INVALID_CONFIG", "dtype"),
    ],
)
def test_bad_configs_are_clear_errors(bad, status, words):
    with pytest.raises(marconi.MarconiError) as e:
        marconi.ModelSpec.from_hf_config(bad)
    assert e.value.name == status
    assert e.value.function == "marconi_model_spec_from_hf_config"
    assert words in e.value.detail


def test_wrong_types_are_refused_before_the_library():
    with pytest.raises(TypeError):
        marconi.ModelSpec.from_hf_config(42)


@pytest.mark.parametrize(
    "field, value",
    [("conv_kernel", 0), ("n_groups", 0), ("num_key_value_heads", 8)],
)
def test_impossible_models_are_refused(field, value):
    with pytest.raises(marconi.MarconiError) as e:
        marconi.ModelSpec.from_hf_config(dict(TINY, **{field: value}))
    assert e.value.name == "INVALID_CONFIG"


def test_a_path_that_is_not_a_regular_file_is_refused_without_blocking(tmp_path):
    import os
    import pathlib

    import threading

    fifo = tmp_path / "config.json"
    os.mkfifo(fifo)  # no writer: a plain open() would block for ever
    raised = []

    def read_all():
        for path in (fifo, tmp_path, pathlib.Path("/dev/zero")):
            try:
                marconi.ModelSpec.from_hf_config(path)
            except OSError:
                raised.append(path)

    # On a thread, so that a regression fails here instead of hanging.
    t = threading.Thread(target=read_all, daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "from_hf_config blocked on a non-regular file"
    assert raised == [fifo, tmp_path, pathlib.Path("/dev/zero")]
    big = tmp_path / "big.json"
    big.write_bytes(b" " * ((16 << 20) + 10))
    with pytest.raises(marconi.MarconiError) as e:
        marconi.ModelSpec.from_hf_config(big)
    assert e.value.name == "INVALID_ARGUMENT"
