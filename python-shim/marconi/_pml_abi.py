"""ctypes declarations of the Prompt Markup Language functions of marconi.h
(marconi-ffi/src/pml.rs); _lib merges them into STRUCTS and SIGNATURES."""

from __future__ import annotations

from ctypes import CFUNCTYPE, POINTER, Structure, c_bool, c_char, c_char_p, c_int32, c_int64, c_size_t, c_uint8, c_uint32, c_uint64, c_void_p

MESSAGE_BYTES = 256
"""MARCONI_PML_ERROR_MESSAGE_BYTES."""

TOKENIZE_FN = CFUNCTYPE(c_int64, c_void_p, POINTER(c_uint8), c_size_t, POINTER(c_uint32), c_size_t)
"""marconi_pml_tokenize_fn."""


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


PML_STRUCTS = {c.__name__: c for c in (marconi_pml_error, marconi_pml_segment)}

_schema_p = c_void_p
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
}
"""The PML functions: name -> (restype, argtypes)."""
