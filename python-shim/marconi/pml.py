"""Prompt Markup Language (Prompt Cache's PML) through libmarconi:
register a schema, lay prompts out over it (position ids, which segments
come from the module cache and which the engine computes), and keep module
states in a budgeted module store.

    from marconi.pml import ModuleCache, Schema
    with Schema(open("schema.xml").read(), tokenizer=tok.encode) as s:
        for seg in s.layout(prompt_xml, tokenizer=tok.encode):
            ...  # seg.kind, seg.name, seg.start, seg.len, seg.cached, seg.tokens

    store = ModuleCache(capacity_bytes=1 << 30, kv_bytes_per_token=kv)
    store.register(s)                                  # its modules pinned
    for name, kind, start, length, how in store.lookup(layout, mode="attention"):
        ...  # "attention": reuse; "miss": compute, then store.admit(s, name)

The tokenizer is a callable from text to token ids (None: one token per
UTF-8 byte); use the same one for the schema and its prompts. Invalid PML
raises PmlError with the line and column; other refusals raise MarconiError.
"""

from __future__ import annotations

import ctypes
from ctypes import POINTER, byref, c_size_t, c_uint8, c_uint32, c_uint64, c_void_p
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional, Sequence

from . import _lib, _pml_abi
from ._convert import OutOfRangeError, _u32, _u64, _uint
from ._errors import MarconiError, _check, _config, last_error
from ._handle import _Handle

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
    module: int = -1
    """Index of its module in the schema (-1 for anonymous and prompt text)."""
    param: int = -1
    """Index of the parameter in its module (kind "param"), else -1."""


class Layout(list):
    """A prompt's segments (a list of Segment), remembering the schema they
    were laid out over: what ModuleCache.lookup takes."""

    def __init__(self, segments, schema: "Schema", raw):
        super().__init__(segments)
        self.schema = schema
        self._raw = raw


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


_I32_MAX = 2**31 - 1


def _index(value, name: str, lo: int = 0) -> int:
    """`value` as an int32 index in [lo, 2**31 - 1] (TypeError for a
    non-integer, OutOfRangeError outside)."""
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__} {value!r}")
    v = value.__index__()
    if not lo <= v <= _I32_MAX:
        raise OutOfRangeError(f"{name}: {v} does not fit in [{lo}, {_I32_MAX}]")
    return v


class Schema(_Handle):
    """A registered schema (marconi_pml_schema_new). Thread-safe for
    layouts; close() waits for the calls running on other threads, and is
    refused (RuntimeError) from the tokenizer a layout calls."""

    _WHAT = "schema"
    _FREE = "marconi_pml_schema_free"

    def __init__(self, xml, tokenizer: Optional[Tokenizer] = None):
        self._guard_init()
        lib = _lib.load()
        data = _bytes(xml)
        cb = _Callback(tokenizer)
        handle = c_void_p()
        err = _pml_abi.marconi_pml_error()
        status = lib.marconi_pml_schema_new(_u8(data), len(data), cb.fn, None, byref(handle), byref(err))
        cb.reraise()
        _raise_pml(status, err, "marconi_pml_schema_new")
        self._adopt(lib, handle)
        n, total, ns = c_size_t(), c_uint32(), c_uint64()
        _check(lib.marconi_pml_schema_info(handle, byref(n), byref(total), byref(ns)), "marconi_pml_schema_info")
        self.n_modules = n.value
        """Modules in the schema, nested ones included."""
        self.total_positions = total.value
        """The schema spans positions 0 .. total_positions."""
        self.namespace = ns.value
        """The cache namespace of this schema (with this tokenizer)."""

    def name_of(self, module: int, param: int = -1) -> str:
        """The name of module `module` or of its parameter `param` (-1: the
        module's own name)."""
        module = _index(module, "module")
        param = _index(param, "param", -1)
        lib = _lib.load()
        with self._using() as h:
            n = lib.marconi_pml_name(h, module, param, None, 0)
            buf = ctypes.create_string_buffer(n + 1)
            lib.marconi_pml_name(h, module, param, buf, n + 1)
        return buf.value.decode("utf-8")

    def layout(self, prompt, tokenizer: Optional[Tokenizer] = None) -> Layout:
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
            with self._using() as h:
                status = lib.marconi_pml_layout(
                    h, _u8(data), len(data), cb.fn, None,
                    segs, cap_s, byref(ns), toks, cap_t, byref(nt), byref(err),
                )
            cb.reraise()
            if status == _BUFFER_TOO_SMALL:
                cap_s, cap_t = max(ns.value, 1), max(nt.value, 1)
                continue
            _raise_pml(status, err, "marconi_pml_layout")
            break
        out = []
        raw = (_pml_abi.marconi_pml_segment * max(ns.value, 1))()
        ctypes.memmove(raw, segs, ctypes.sizeof(_pml_abi.marconi_pml_segment) * ns.value)
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
                    module=g.module,
                    param=g.param,
                )
            )
        return Layout(out, self, raw)


MODES = {"attention": 0, "exact": 1, "composed": 2}
"""marconi_pml_reuse_mode values by name."""

SERVED = ("exact", "attention", "composed", "recomputed", "miss", "computed")
"""marconi_pml_served_how names, by value."""


class _ServedFields(NamedTuple):
    name: Optional[str]
    kind: str
    start: int
    len: int
    served_how: str


class Served(_ServedFields):
    """One segment's answer: a tuple (name, kind, start, len, served_how),
    served_how one of SERVED, with attributes `entry` (the serving entry's
    id, 0 when none), `recomputed` (tokens recomputed at its start,
    "composed" only), `module` (its module's index; an anonymous text's
    index among the schema's anonymous texts; -1 for prompt text) and
    `in_run` (in the exact leading run: a "miss" there is admitted with
    ModuleCache.admit_exact, elsewhere with ModuleCache.admit)."""

    entry: int = 0
    recomputed: int = 0
    module: int = -1
    in_run: bool = False


class ModuleCache(_Handle):
    """The module store (marconi_pml_cache_*): a registered schema's module
    entries pinned in a byte budget, evicted by utility once unregistered.

    Sizes: a module entry is its tokens times `kv_bytes_per_token` (every
    attention layer) plus, for hybrids, `state_bytes` (its end state) and
    `operator_bytes` (its transition operator); an exact entry (a segment of
    the leading run, computed in context) its tokens' KV plus `state_bytes`.
    `flops_per_token` and `flops_per_token_squared` give the prefill FLOPs
    eviction weighs per byte (default: tokens). Thread-safe."""

    _WHAT = "module cache"
    _FREE = "marconi_pml_cache_free"

    def __init__(
        self,
        capacity_bytes: int,
        kv_bytes_per_token: int,
        state_bytes: int = 0,
        operator_bytes: int = 0,
        flops_per_token: float = 1.0,
        flops_per_token_squared: float = 0.0,
    ):
        self._guard_init()
        lib = _lib.load()
        cfg = _config(lib, _pml_abi.marconi_pml_cache_config)
        for name, v in (
            ("capacity_bytes", capacity_bytes),
            ("kv_bytes_per_token", kv_bytes_per_token),
            ("state_bytes", state_bytes),
            ("operator_bytes", operator_bytes),
        ):
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{name} must be an int, not {type(v).__name__}")
            if not 0 <= v < 2**64:
                raise ValueError(f"{name} must be in 0 .. 2**64 - 1, not {v}")
            setattr(cfg, name, v)
        cfg.flops_per_token = float(flops_per_token)
        cfg.flops_per_token_squared = float(flops_per_token_squared)
        handle = c_void_p()
        _check(lib.marconi_pml_cache_new(byref(cfg), byref(handle)), "marconi_pml_cache_new")
        self._adopt(lib, handle)
        self.hybrid = state_bytes > 0
        """Whether the model has recurrent state (modes exact and composed)."""
        self._ids: dict = {}

    def register(self, schema: Schema) -> int:
        """Registers `schema`: reserves and pins all its module entries
        (MarconiError OUT_OF_MEMORY when they do not fit beside those
        already pinned). Returns its id."""
        if not isinstance(schema, Schema):
            raise TypeError(f"schema: expected a Schema, got {type(schema).__name__}")
        sid = c_uint64()
        with self._using() as h, schema._using() as sh:
            st = _lib.load().marconi_pml_cache_register(h, sh, byref(sid))
        _check(st, "marconi_pml_cache_register")
        self._ids.setdefault(schema.namespace, []).append(sid.value)
        return sid.value

    def _id(self, schema) -> int:
        if isinstance(schema, int) and not isinstance(schema, bool):
            return _u64(schema, "schema id")
        ids = self._ids.get(getattr(schema, "namespace", None))
        if not ids:
            raise ValueError("schema is not registered in this module cache")
        return ids[-1]

    def unregister(self, schema) -> None:
        """Drops one registration of `schema` (a Schema or its id); at the
        last its module entries become evictable."""
        sid = self._id(schema)
        with self._using() as h:
            st = _lib.load().marconi_pml_cache_unregister(h, sid)
        _check(st, "marconi_pml_cache_unregister")
        for ns, ids in list(self._ids.items()):
            if sid in ids:
                ids.remove(sid)
                if not ids:
                    del self._ids[ns]
                break

    def lookup(self, layout: Layout, mode: str = "attention", window: int = 16) -> list:
        """How each segment of `layout` (from Schema.layout of a registered
        schema) is served under `mode` ("attention", "exact" or "composed"
        with `window` tokens recomputed per composed segment): a list of
        Served (name, kind, start, len, served_how). A mode the model does
        not support raises MarconiError UNSUPPORTED; modes never mix."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {sorted(MODES)}, not {mode!r}")
        if not isinstance(layout, Layout):
            raise TypeError("layout must come from Schema.layout")
        window = _u32(window, "window")
        n = len(layout)
        out = (_pml_abi.marconi_pml_served * max(n, 1))()
        n_out = c_size_t()
        sid = self._id(layout.schema)
        with self._using() as h:
            st = _lib.load().marconi_pml_cache_lookup(h, sid, layout._raw, n, MODES[mode], window, out, n, byref(n_out))
        _check(st, "marconi_pml_cache_lookup")
        result = []
        for g, o in zip(layout, out[: n_out.value]):
            r = Served(g.name, g.kind, o.start, o.len, SERVED[o.how])
            r.entry, r.recomputed, r.module, r.in_run = o.entry, o.recomputed, o.module, bool(o.in_run)
            result.append(r)
        return result

    def admit(self, schema, module_name: Optional[str] = None, *, anonymous: Optional[int] = None) -> int:
        """Admits module `module_name` of `schema` (or its anonymous text
        number `anonymous`) once the engine has computed it. Returns its
        entry id (the same one when already resident)."""
        if (module_name is None) == (anonymous is None):
            raise ValueError("give a module_name or anonymous=index")
        if module_name is not None:
            if not isinstance(schema, Schema):
                raise TypeError("admit by module name needs the Schema")
            index = next((i for i in range(schema.n_modules) if schema.name_of(i) == module_name), None)
            if index is None:
                raise ValueError(f"schema has no module named {module_name!r}")
            kind = 0
        else:
            kind, index = 1, _u32(anonymous, "anonymous")
        entry = c_uint64()
        sid = self._id(schema)
        with self._using() as h:
            st = _lib.load().marconi_pml_cache_admit(h, sid, kind, index, byref(entry))
        _check(st, "marconi_pml_cache_admit")
        return entry.value

    def admit_exact(self, layout: Layout, segment: int) -> int:
        """Admits the exact entry of `layout[segment]` (in the leading run)
        once the engine has computed the run up to it in context. Returns
        its entry id; MarconiError OUT_OF_MEMORY when it cannot fit."""
        if not isinstance(layout, Layout):
            raise TypeError("layout must come from Schema.layout")
        segment = _uint(segment, "segment", 2**64 - 1)
        entry = c_uint64()
        sid = self._id(layout.schema)
        with self._using() as h:
            st = _lib.load().marconi_pml_cache_admit_exact(h, sid, layout._raw, len(layout), segment, byref(entry))
        _check(st, "marconi_pml_cache_admit_exact")
        return entry.value

    def evicted(self) -> list:
        """Ids of entries evicted since the last call (free their memory)."""
        lib = _lib.load()
        n = c_size_t()
        while True:
            cap = max(n.value, 16)
            buf = (c_uint64 * cap)()
            with self._using() as h:
                status = lib.marconi_pml_cache_evicted(h, buf, cap, byref(n))
            if status == _BUFFER_TOO_SMALL:
                continue
            _check(status, "marconi_pml_cache_evicted")
            return list(buf[: n.value])

    def stats(self) -> dict:
        """Counters and sizes: lookups, hits, misses, recomputed, admissions,
        refused, evictions, entries, resident_bytes, pinned_bytes,
        used_bytes, capacity_bytes, schemas."""
        st = _pml_abi.marconi_pml_cache_stats()
        st.struct_size = ctypes.sizeof(st)
        with self._using() as h:
            status = _lib.load().marconi_pml_cache_get_stats(h, byref(st))
        _check(status, "marconi_pml_cache_get_stats")
        return {name: getattr(st, name) for name, _ in st._fields_[2:]}


__all__ = [
    "KINDS",
    "MODES",
    "SERVED",
    "Layout",
    "MarconiError",
    "ModuleCache",
    "PmlError",
    "Schema",
    "Segment",
    "Served",
    "Tokenizer",
    "last_error",
]
