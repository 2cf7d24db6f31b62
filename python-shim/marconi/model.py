"""ModelSpec: a model description (the fields of struct marconi_model_spec),
from a preset or from a Hugging Face config.json."""

from __future__ import annotations

import ctypes
import json
import os
from collections.abc import Mapping
from typing import Any

from . import _lib
from .cache import _check


def _from_struct(raw: _lib.marconi_model_spec) -> dict:
    return {name: getattr(raw, name) for name, _ in raw._fields_ if name != "reserved"}


class ModelSpec(dict):
    """A dict of marconi_model_spec fields (attn_layers, ssm_layers,
    d_model, ..., dtype_bytes, state_dtype_bytes), accepted wherever a model
    is (PrefixCache(model=...)). Build one with from_hf_config or preset;
    the byte formulas are the library's (see PrefixCache.stats():
    kv_bytes_per_token, state_bytes_per_entry)."""

    @classmethod
    def from_hf_config(cls, config: Any) -> "ModelSpec":
        """Reads a Hugging Face config (marconi_model_spec_from_hf_config):
        `config` is the JSON text (str or bytes), a path to config.json (an
        os.PathLike), a dict of its fields, or an object with
        to_json_string() (a transformers PretrainedConfig). Raises
        MarconiError (INVALID_ARGUMENT for text that is not a JSON object,
        INVALID_CONFIG for an unsupported model_type or a missing field, named
        in the detail)."""
        if isinstance(config, os.PathLike):
            with open(config, "rb") as f:
                text = f.read()
        elif isinstance(config, bytes):
            text = config
        elif isinstance(config, str):
            text = config.encode()
        elif isinstance(config, Mapping):
            text = json.dumps(dict(config)).encode()
        elif callable(getattr(config, "to_json_string", None)):
            text = config.to_json_string().encode()
        else:
            raise TypeError(
                "config: expected JSON text, a path, a dict or a transformers config, "
                f"got {type(config).__name__}"
            )
        raw = _lib.marconi_model_spec()
        st = _lib.load().marconi_model_spec_from_hf_config(text, len(text), ctypes.byref(raw))
        _check(st, "marconi_model_spec_from_hf_config")
        return cls(_from_struct(raw))

    @classmethod
    def from_gguf(cls, path: Any) -> "ModelSpec":
        """Reads a GGUF file's metadata (marconi_model_spec_from_gguf): see
        marconi.model_spec_from_gguf. `path` is a str, bytes or os.PathLike;
        bytes-like contents of a file go to from_gguf_bytes."""
        from .gguf import model_spec_from_gguf

        return cls(model_spec_from_gguf(path))

    @classmethod
    def from_gguf_bytes(cls, data: bytes) -> "ModelSpec":
        """Like from_gguf, from the start of a GGUF file in memory."""
        from .gguf import model_spec_from_gguf_bytes

        return cls(model_spec_from_gguf_bytes(data))

    @classmethod
    def preset(cls, name: str) -> "ModelSpec":
        """The dimensions of a preset (marconi_model_spec_preset)."""
        if not isinstance(name, str) or "\0" in name:
            raise ValueError(f"name: expected a preset name, got {name!r}")
        raw = _lib.marconi_model_spec()
        _check(_lib.load().marconi_model_spec_preset(name.encode(), ctypes.byref(raw)), "marconi_model_spec_preset")
        return cls(_from_struct(raw))


