"""ctypes declarations of the Prompt Markup Language functions of marconi.h
(marconi-ffi/src/pml.rs); _lib merges them into STRUCTS and SIGNATURES."""

from __future__ import annotations

from ctypes import CFUNCTYPE, POINTER, Structure, c_bool, c_char, c_char_p, c_double, c_int32, c_int64, c_size_t, c_uint8, c_uint32, c_uint64, c_void_p

MESSAGE_BYTES = 256
"""MARCONI_PML_ERROR_MESSAGE_BYTES."""

TOKENIZE_FN = CFUNCTYPE(c_int64, c_void_p, POINTER(c_uint8), c_size_t, POINTER(c_uint32), c_size_t)
"""marconi_pml_tokenize_fn."""


def _u64_fields(names: str) -> list:
    """The ctypes fields of a run of uint64_t struct members, named in
    order in `names` (separated by whitespace)."""
    return [(name, c_uint64) for name in names.split()]


class marconi_pml_error(Structure):
    """struct marconi_pml_error."""

    _fields_ = [("line", c_uint32), ("col", c_uint32), ("message", c_char * MESSAGE_BYTES)]


class marconi_pml_segment(Structure):
    """struct marconi_pml_segment."""

    _fields_ = [
        ("kind", c_uint32),
        ("cached", c_bool),
        ("start", c_uint32),
        ("len", c_uint32),
        ("module", c_int32),
        ("param", c_int32),
        ("tokens_offset", c_size_t),
    ]


MAX_SEGMENTS = 1 << 20
"""MARCONI_PML_MAX_SEGMENTS."""


class marconi_pml_cache_config(Structure):
    """struct marconi_pml_cache_config."""

    _fields_ = [
        ("struct_size", c_uint32),
        ("reserved", c_uint32),
        ("capacity_bytes", c_uint64),
        ("kv_bytes_per_token", c_uint64),
        ("state_bytes", c_uint64),
        ("operator_bytes", c_uint64),
        ("flops_per_token", c_double),
        ("flops_per_token_squared", c_double),
    ]


class marconi_pml_served(Structure):
    """struct marconi_pml_served."""

    _fields_ = [
        ("how", c_uint32),
        ("kind", c_uint32),
        ("start", c_uint32),
        ("len", c_uint32),
        ("recomputed", c_uint32),
        ("module", c_int32),
        ("in_run", c_bool),
        ("entry", c_uint64),
    ]


class marconi_pml_cache_stats(Structure):
    """struct marconi_pml_cache_stats."""

    _fields_ = [("struct_size", c_uint32), ("reserved", c_uint32)] + _u64_fields(
        """
        lookups hits misses recomputed admissions refused evictions entries resident_bytes pinned_bytes
        used_bytes capacity_bytes schemas
        """
    )


PML_STRUCTS = {
    c.__name__: c
    for c in (marconi_pml_error, marconi_pml_segment, marconi_pml_cache_config, marconi_pml_served, marconi_pml_cache_stats)
}

_schema_p = c_void_p
_cache_p = c_void_p
_status = c_uint32

PML_SIGNATURES = {
    "marconi_pml_schema_new": (
        _status,
        [POINTER(c_uint8), c_size_t, TOKENIZE_FN, c_void_p, POINTER(_schema_p), POINTER(marconi_pml_error)],
    ),
    "marconi_pml_schema_free": (None, [_schema_p]),
    "marconi_pml_schema_info": (_status, [_schema_p, POINTER(c_size_t), POINTER(c_uint32), POINTER(c_uint64)]),
    "marconi_pml_name": (c_size_t, [_schema_p, c_int32, c_int32, c_char_p, c_size_t]),
    "marconi_pml_layout": (
        _status,
        [
            _schema_p,
            POINTER(c_uint8),
            c_size_t,
            TOKENIZE_FN,
            c_void_p,
            POINTER(marconi_pml_segment),
            c_size_t,
            POINTER(c_size_t),
            POINTER(c_uint32),
            c_size_t,
            POINTER(c_size_t),
            POINTER(marconi_pml_error),
        ],
    ),
    "marconi_pml_cache_config_init": (_status, [POINTER(marconi_pml_cache_config), c_size_t]),
    "marconi_pml_cache_new": (_status, [POINTER(marconi_pml_cache_config), POINTER(_cache_p)]),
    "marconi_pml_cache_free": (_status, [_cache_p]),
    "marconi_pml_cache_register": (_status, [_cache_p, _schema_p, POINTER(c_uint64)]),
    "marconi_pml_cache_unregister": (_status, [_cache_p, c_uint64]),
    "marconi_pml_cache_lookup": (
        _status,
        [
            _cache_p,
            c_uint64,
            POINTER(marconi_pml_segment),
            c_size_t,
            c_uint32,
            c_uint32,
            POINTER(marconi_pml_served),
            c_size_t,
            POINTER(c_size_t),
        ],
    ),
    "marconi_pml_cache_admit": (_status, [_cache_p, c_uint64, c_uint32, c_uint32, POINTER(c_uint64)]),
    "marconi_pml_cache_admit_exact": (
        _status,
        [_cache_p, c_uint64, POINTER(marconi_pml_segment), c_size_t, c_size_t, POINTER(c_uint64)],
    ),
    "marconi_pml_cache_evicted": (_status, [_cache_p, POINTER(c_uint64), c_size_t, POINTER(c_size_t)]),
    "marconi_pml_cache_get_stats": (_status, [_cache_p, POINTER(marconi_pml_cache_stats)]),
}
"""The PML functions: name -> (restype, argtypes)."""
