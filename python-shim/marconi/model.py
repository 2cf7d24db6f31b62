"""ModelSpec: a model description (the fields of struct marconi_model_spec),
from a preset or from a Hugging Face config.json."""

from __future__ import annotations

import ctypes
import errno
import json
import os
import stat
from collections.abc import Mapping
from typing import Any

from . import _lib
from .cache import _check


# The most bytes of a config.json read (the library refuses more).
_MAX_CONFIG_BYTES = 16 << 20


def _read_config_file(path: "os.PathLike[str]") -> bytes:
    """The bytes of the regular file at `path`, at most _MAX_CONFIG_BYTES + 1
    (the library refuses a longer text). Opened without blocking and checked
    on the opened file: a FIFO, directory or device raises OSError instead
    of blocking the caller or reading for ever."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0)
    fd = os.open(path, flags)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", os.fspath(path))
        chunks = []
        left = _MAX_CONFIG_BYTES + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


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
        to_json_string() (a transformers PretrainedConfig); a path that is
        not a regular file (FIFO, directory, device) raises OSError without
        blocking. Raises
        MarconiError (INVALID_ARGUMENT for text that is not a JSON object,
        INVALID_CONFIG for an unsupported model_type or a missing field, named
        in the detail)."""
        if isinstance(config, os.PathLike):
            text = _read_config_file(config)
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


