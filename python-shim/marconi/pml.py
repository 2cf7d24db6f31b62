"""Prompt Markup Language (Prompt Cache's PML) through libmarconi:
register a schema, lay prompts out over it (position ids, which segments
come from the module cache and which the engine computes).

    from marconi.pml import Schema
    with Schema(open("schema.xml").read(), tokenizer=tok.encode) as s:
        for seg in s.layout(prompt_xml, tokenizer=tok.encode):
            ...  # seg.kind, seg.name, seg.start, seg.len, seg.cached, seg.tokens

The tokenizer is a callable from text to token ids (None: one token per
UTF-8 byte); use the same one for the schema and its prompts. Invalid PML
raises PmlError with the line and column; other refusals raise MarconiError.
"""

from __future__ import annotations

import ctypes
from ctypes import POINTER, byref, c_size_t, c_uint8, c_uint32, c_uint64, c_void_p
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from . import _lib, _pml_abi
from .cache import MarconiError, _check, _Closing, last_error

Tokenizer = Callable[[str], Sequence[int]]
"""Text to token ids (each in 0 .. 2**32 - 1)."""

KINDS = ("module", "anonymous", "param", "text")
"""marconi_pml_segment_kind names, by value."""

_INVALID_ARGUMENT = 2
_BUFFER_TOO_SMALL = 3


class PmlError(ValueError):
    """A schema or prompt that is not valid PML: `line` and `col` (1-based;
    0 when the error has no place in the document) and `reason`."""

    def __init__(self, line: int, col: int, reason: str):
        self.line, self.col, self.reason = line, col, reason
        super().__init__(f"{line}:{col}: {reason}")


@dataclass(frozen=True)
class Segment:
    """A run of tokens at consecutive position ids start .. start + len."""

    kind: str
    name: Optional[str]
    start: int
    len: int
    cached: bool
    tokens: list


class _Callback:
    """A Python tokenizer as a marconi_pml_tokenize_fn. An exception (or a
    bad id) is kept and re-raised after the call; the library sees -1."""

    def __init__(self, tokenize: Optional[Tokenizer]):
        self.error: Optional[BaseException] = None
        # TOKENIZE_FN() is the NULL function pointer: the byte tokenizer.
        self.fn = _pml_abi.TOKENIZE_FN() if tokenize is None else _pml_abi.TOKENIZE_FN(self._call)
        self.tokenize = tokenize
        self.last: tuple = ("", [])

    def _call(self, _user, text, text_len, out, cap):
        try:
            s = ctypes.string_at(text, text_len).decode("utf-8")
            # The library asks again with a larger buffer: tokenize once.
            if self.last[0] != s or self.last[1] is None:
                ids = [int(t) for t in self.tokenize(s)]
                if any(t < 0 or t > 0xFFFF_FFFF for t in ids):
                    raise ValueError("token ids must be in 0 .. 2**32 - 1")
                self.last = (s, ids)
            ids = self.last[1]
            if len(ids) <= cap:
                for i, t in enumerate(ids):
                    out[i] = t
            return len(ids)
        except BaseException as e:  # noqa: BLE001 - re-raised after the call
            self.error = e
            return -1

    def reraise(self) -> None:
        if self.error is not None:
            e, self.error = self.error, None
            raise e


def _raise_pml(status: int, err: _pml_abi.marconi_pml_error, function: str) -> None:
    if status == _INVALID_ARGUMENT and err.line:
        raise PmlError(err.line, err.col, err.message.decode("utf-8", "replace"))
    _check(status, function)


def _bytes(xml) -> bytes:
    if isinstance(xml, str):
        return xml.encode("utf-8")
    if isinstance(xml, (bytes, bytearray)):
        return bytes(xml)
    raise TypeError(f"PML must be str or bytes, not {type(xml).__name__}")


def _u8(data: bytes):
    return ctypes.cast(ctypes.c_char_p(data), POINTER(c_uint8))


class Schema(_Closing):
    """A registered schema (marconi_pml_schema_new). Thread-safe for layouts."""

    def __init__(self, xml, tokenizer: Optional[Tokenizer] = None):
        lib = _lib.load()
        data = _bytes(xml)
        cb = _Callback(tokenizer)
        handle = c_void_p()
        err = _pml_abi.marconi_pml_error()
        status = lib.marconi_pml_schema_new(_u8(data), len(data), cb.fn, None, byref(handle), byref(err))
        cb.reraise()
        _raise_pml(status, err, "marconi_pml_schema_new")
        self._h = handle
        n, total, ns = c_size_t(), c_uint32(), c_uint64()
        _check(lib.marconi_pml_schema_info(handle, byref(n), byref(total), byref(ns)), "marconi_pml_schema_info")
        self.n_modules = n.value
        """Modules in the schema, nested ones included."""
        self.total_positions = total.value
        """The schema spans positions 0 .. total_positions."""
        self.namespace = ns.value
        """The cache namespace of this schema (with this tokenizer)."""

    def _handle(self) -> c_void_p:
        if self._h is None:
            raise ValueError("schema is closed")
        return self._h

    def name_of(self, module: int, param: int = -1) -> str:
        """The name of module `module` or of its parameter `param`."""
        lib = _lib.load()
        n = lib.marconi_pml_name(self._handle(), module, param, None, 0)
        buf = ctypes.create_string_buffer(n + 1)
        lib.marconi_pml_name(self._handle(), module, param, buf, n + 1)
        return buf.value.decode("utf-8")

    def layout(self, prompt, tokenizer: Optional[Tokenizer] = None) -> list:
        """The segments of `prompt` (a `<prompt schema="...">` document), in
        the order the engine concatenates them."""
        lib = _lib.load()
        data = _bytes(prompt)
        cb = _Callback(tokenizer)
        cap_s, cap_t = 16, 1024
        while True:
            segs = (_pml_abi.marconi_pml_segment * cap_s)()
            toks = (c_uint32 * cap_t)()
            ns, nt = c_size_t(), c_size_t()
            err = _pml_abi.marconi_pml_error()
            status = lib.marconi_pml_layout(
                self._handle(), _u8(data), len(data), cb.fn, None,
                segs, cap_s, byref(ns), toks, cap_t, byref(nt), byref(err),
            )
            cb.reraise()
            if status == _BUFFER_TOO_SMALL:
                cap_s, cap_t = max(ns.value, 1), max(nt.value, 1)
                continue
            _raise_pml(status, err, "marconi_pml_layout")
            break
        out = []
        for g in segs[: ns.value]:
            name = None if g.module < 0 else self.name_of(g.module, g.param)
            out.append(
                Segment(
                    kind=KINDS[g.kind],
                    name=name,
                    start=g.start,
                    len=g.len,
                    cached=bool(g.cached),
                    tokens=list(toks[g.tokens_offset : g.tokens_offset + g.len]),
                )
            )
        return out

    def close(self) -> None:
        """Frees the schema (marconi_pml_schema_free); later calls raise ValueError."""
        if self._h is not None:
            _lib.load().marconi_pml_schema_free(self._h)
            self._h = None

    def __reduce__(self):
        raise TypeError("a marconi.pml.Schema cannot be pickled or copied")


__all__ = ["KINDS", "MarconiError", "PmlError", "Schema", "Segment", "Tokenizer", "last_error"]
