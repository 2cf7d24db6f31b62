"""Status codes and errors of the C ABI: MarconiError and the check every
call's status goes through."""

from __future__ import annotations

import ctypes
from typing import Optional

from . import _lib
from ._convert import _u32

STATUS_NAMES = [
    "OK",
    "NULL_ARGUMENT",
    "INVALID_ARGUMENT",
    "BUFFER_TOO_SMALL",
    "PANIC",
    "POISONED",
    "INVALID_CONFIG",
    "UNKNOWN_PRESET",
    "EMPTY_TOKENS",
    "TOO_MANY_TOKENS",
    "UNKNOWN_LEASE",
    "PREFIX_MISMATCH",
    "BAD_PAGE_LIST",
    "NOT_PLANNED",
    "POSITION_OUT_OF_RANGE",
    "DUPLICATE_POSITION",
    "DUPLICATE_SLOT",
    "DUPLICATE_PAGE",
    "INVARIANT_VIOLATED",
    "UNSUPPORTED_STRUCT_SIZE",
    "UNKNOWN_HANDLE",
    "DOUBLE_FREE",
    "OUT_OF_MEMORY",
    "UNSUPPORTED",
    "BACKEND_FAILURE",
    "QUEUE_FULL",
]
"""marconi_status names (without the MARCONI_STATUS_ prefix), by value."""


def status_message(status: int) -> str:
    """The fixed text of a status code (marconi_status_message)."""
    status = _u32(status, "status")
    lib = _lib.load()
    n = lib.marconi_status_message(status, None, 0)
    buf = ctypes.create_string_buffer(n + 1)
    lib.marconi_status_message(status, buf, n + 1)
    return buf.value.decode()


def last_error() -> str:
    """This thread's last error detail (marconi_last_error)."""
    lib = _lib.load()
    n = lib.marconi_last_error(None, 0)
    buf = ctypes.create_string_buffer(n + 1)
    lib.marconi_last_error(buf, n + 1)
    return buf.value.decode(errors="replace")


def version() -> str:
    """The library version (marconi_version)."""
    return _lib.load().marconi_version().decode()


class MarconiError(Exception):
    """A call refused by libmarconi. `status` is the marconi_status value,
    `name` its name (e.g. "UNKNOWN_LEASE"), `function` the C function that
    refused (e.g. "marconi_cache_lookup", or None), `detail` the library's
    last-error text for that call (e.g. "marconi_cache_lookup: tokens is NULL
    but length is 12"; for MARCONI_STATUS_PANIC it carries the panic
    message). A refused call changed nothing in the cache."""

    def __init__(self, status: int, detail: str, function: Optional[str] = None):
        self.status = status
        self.name = STATUS_NAMES[status] if status < len(STATUS_NAMES) else f"STATUS_{status}"
        self.detail = detail
        self.function = function
        super().__init__(f"{self.name}: {status_message(status)} ({detail})")


def _check(status: int, function: str) -> None:
    """Raises MarconiError when `function` (just called by this thread)
    returned a failure. The library records "<function>: <detail>" as the
    thread's last error on every failure and leaves it alone on success, so
    a text naming another function is an older failure's: it is not passed
    off as this one's detail."""
    if status != 0:
        detail = last_error()
        if not detail.startswith(function + ":"):
            detail = f"{function}: no detail from the library (status {status})"
        raise MarconiError(status, detail, function)


def _config(lib: ctypes.CDLL, struct: type) -> ctypes.Structure:
    """A versioned config struct (marconi_cache_config, ...) holding the
    library's defaults, as its `<struct>_init` function writes them."""
    cfg = struct()
    fn = struct.__name__ + "_init"
    _check(getattr(lib, fn)(ctypes.byref(cfg), ctypes.sizeof(cfg)), fn)
    return cfg
