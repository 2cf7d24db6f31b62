"""A model's dimensions from its GGUF file (llama.cpp's format), through
marconi_model_spec_from_gguf: the dict it returns is what PrefixCache's
`model=` takes, so an engine never types a model's dimensions by hand."""

from __future__ import annotations

import ctypes
import os
from typing import Union

from . import _lib
from .cache import _check
from .model import ModelSpec, _from_struct


def model_spec_from_gguf(path: Union[str, bytes, "os.PathLike[str]"]) -> ModelSpec:
    """The ModelSpec (a dict of marconi_model_spec fields) of the model in the GGUF file
    at `path` (also ModelSpec.from_gguf), read from its header and metadata only. Sizes are those
    llama.cpp stores (KV in f16, recurrent states in f32, conv_kernel - 1
    conv columns). Raises MarconiError (INVALID_ARGUMENT: unreadable or not
    GGUF; INVALID_CONFIG: unsupported architecture or a missing key) with the
    library's detail, ValueError for a path containing NUL."""
    raw = os.fsencode(path)
    if b"\0" in raw:
        raise ValueError(f"path contains NUL: {path!r}")
    spec = _lib.marconi_model_spec()
    _check(_lib.load().marconi_model_spec_from_gguf(raw, ctypes.byref(spec)), "marconi_model_spec_from_gguf")
    return ModelSpec(_from_struct(spec))


def model_spec_from_gguf_bytes(data: bytes) -> ModelSpec:
    """Like model_spec_from_gguf, from the start of a GGUF file in memory
    (at least up to the end of its metadata)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"data: expected bytes, got {type(data).__name__}")
    buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(bytes(data))
    spec = _lib.marconi_model_spec()
    _check(
        _lib.load().marconi_model_spec_from_gguf_bytes(buf, len(data), ctypes.byref(spec)),
        "marconi_model_spec_from_gguf_bytes",
    )
    return ModelSpec(_from_struct(spec))
