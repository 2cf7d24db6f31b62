"""marconi.model_spec_from_gguf: a ModelSpec read from GGUF metadata, fed
to a cache; errors carry the library's detail."""

import struct

import pytest

import marconi


def _s(x: str) -> bytes:
    b = x.encode()
    return struct.pack("<Q", len(b)) + b


def gguf(kvs) -> bytes:
    """A GGUF v3 file with no tensors: kvs is [(key, value)] with str, int
    (u32) or list of int (i32 array, as PyPI gguf writes per-layer counts)."""
    out = b"GGUF" + struct.pack("<IQQ", 3, 0, len(kvs))
    for k, v in kvs:
        out += _s(k)
        if isinstance(v, str):
            out += struct.pack("<I", 8) + _s(v)
        elif isinstance(v, list):
            out += struct.pack("<IIQ", 9, 5, len(v)) + b"".join(struct.pack("<i", x) for x in v)
        else:
            out += struct.pack("<II", 4, v)
    return out


NEMOTRON = [
    ("general.architecture", "nemotron_h"),
    ("nemotron_h.block_count", 4),
    ("nemotron_h.embedding_length", 128),
    ("nemotron_h.attention.head_count", [0, 4, 0, 0]),
    ("nemotron_h.attention.head_count_kv", [0, 2, 0, 0]),
    ("nemotron_h.feed_forward_length", [0, 0, 256, 0]),
    ("nemotron_h.ssm.conv_kernel", 4),
    ("nemotron_h.ssm.inner_size", 256),
    ("nemotron_h.ssm.state_size", 16),
    ("nemotron_h.ssm.group_count", 1),
]


def test_from_file_drives_a_cache(tmp_path):
    path = tmp_path / "tiny.gguf"
    path.write_bytes(gguf(NEMOTRON) + b"\xab" * 4096)  # tensor data is not read
    spec = marconi.model_spec_from_gguf(path)
    assert (spec["attn_layers"], spec["ssm_layers"], spec["mlp_layers"]) == (1, 2, 1)
    assert (spec["kv_heads"], spec["head_dim"], spec["dtype_bytes"]) == (2, 32, 2)
    # llama.cpp's conv state keeps conv_kernel - 1 columns, in f32.
    assert (spec["conv_channels"], spec["conv_kernel"], spec["state_dtype_bytes"]) == (256 + 32, 3, 4)
    assert spec == marconi.model_spec_from_gguf_bytes(gguf(NEMOTRON))
    assert spec == marconi.ModelSpec.from_gguf(str(path)) == marconi.ModelSpec.from_gguf_bytes(gguf(NEMOTRON))
    assert isinstance(marconi.ModelSpec.from_gguf(path), marconi.ModelSpec)
    with marconi.PrefixCache(1 << 20, model=spec) as cache:
        with cache.lookup(list(range(10))) as lease:
            assert lease.hit_tokens == 0


def test_errors_name_the_file_and_key(tmp_path):
    with pytest.raises(marconi.MarconiError) as e:
        marconi.model_spec_from_gguf(tmp_path / "missing.gguf")
    assert e.value.name == "INVALID_ARGUMENT" and "missing.gguf: cannot open" in e.value.detail
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(gguf(NEMOTRON)[:-2])
    with pytest.raises(marconi.MarconiError) as e:
        marconi.model_spec_from_gguf(cut)
    assert "inside its GGUF metadata" in e.value.detail
    with pytest.raises(marconi.MarconiError) as e:
        marconi.model_spec_from_gguf_bytes(gguf(NEMOTRON[:3]))
    assert e.value.name == "INVALID_CONFIG" and "nemotron_h.attention.head_count" in e.value.detail
    with pytest.raises(ValueError):
        marconi.model_spec_from_gguf("a\0b")
    with pytest.raises(TypeError):
        marconi.model_spec_from_gguf_bytes("GGUF")


def test_a_path_that_is_not_a_regular_file_is_refused_without_blocking(tmp_path):
    import os

    fifo = tmp_path / "m.gguf"
    os.mkfifo(fifo)  # no writer: a blocking open would never return
    for path in (fifo, tmp_path, "/dev/zero"):
        with pytest.raises(marconi.MarconiError) as e:
            marconi.model_spec_from_gguf(path)
        assert e.value.name == "INVALID_ARGUMENT" and "not a regular file" in e.value.detail


def test_impossible_models_are_invalid_config():
    for key, value in [("nemotron_h.ssm.group_count", 0), ("nemotron_h.embedding_length", 0)]:
        kv = [(k, value if k == key else v) for k, v in NEMOTRON]
        with pytest.raises(marconi.MarconiError) as e:
            marconi.model_spec_from_gguf_bytes(gguf(kv))
        assert e.value.name == "INVALID_CONFIG", key
