"""Integer arguments and token arrays, checked and turned into what the C
functions take.

Token arrays cross the boundary without per-token Python work: a buffer that
already holds native uint32s (array('I'), a numpy uint32/int32 array, a torch
int32 tensor, a writable memoryview) is passed by address; anything else is
converted once, in bulk (array('I', list) checks the range in C; numpy and
torch convert with their own operations after a min/max range check). The
index of a bad token is only searched for once a bulk check has failed.
numpy and torch are never imported here: an array of theirs can only exist
if the caller imported them, so they are looked up in sys.modules.
"""

from __future__ import annotations

import array
import ctypes
import operator
import sys
from collections.abc import Sequence
from typing import Any, Optional, Union

U32_MAX = 0xFFFF_FFFF
U64_MAX = 0xFFFF_FFFF_FFFF_FFFF

Tokens = Union[Sequence[int], "array.array[int]", memoryview, bytes, bytearray, Any]
"""Token ids: a list/tuple (or other iterable) of ints; an array.array
('I', or another integer typecode, converted); a 1-D, C-contiguous numpy
array or CPU torch tensor of an integer dtype (uint32/int32 passed without a
copy, int64 and others converted once); any other buffer of native integers
(a format of 'B' or bytes/bytearray: raw native uint32s)."""

_U32 = ctypes.c_uint32
_array = array.array
_LITTLE = sys.byteorder == "little"
assert array.array("I").itemsize == 4, "array('I') is not 4 bytes on this platform"


class OutOfRangeError(ValueError, OverflowError):
    """An integer that does not fit its C type: both an OverflowError (as
    Python's own C conversions raise) and a ValueError (as a bad token id
    always raised here)."""


def _uint(value: Any, name: str, hi: Optional[int]) -> int:
    """`value` as a Python int in [0, hi] (hi None: no upper bound), for a
    C argument called `name`.
    ctypes would silently truncate an int that does not fit (2**64 + 1 -> 1,
    -1 -> UINT64_MAX) and take True as 1, so every integer argument of the
    public API goes through here: TypeError for bool, float and other
    non-integers, OutOfRangeError (an OverflowError and a ValueError) outside
    [0, hi]. Integer-like objects (numpy integers) are accepted via
    __index__. One comparison for the common case."""
    if type(value) is int and 0 <= value and (hi is None or value <= hi):
        return value
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__} {value!r}")
    v = operator.index(value)
    if hi is None:
        if v < 0:
            raise OutOfRangeError(f"{name}: {v} is negative")
    elif not 0 <= v <= hi:
        kind = "uint32" if hi == U32_MAX else "uint64" if hi == U64_MAX else f"[0, {hi}]"
        raise OutOfRangeError(f"{name}: {v} does not fit in {kind} (0 to {hi})")
    return v


def _u32(value: Any, name: str) -> int:
    return _uint(value, name, U32_MAX)


def _u64(value: Any, name: str) -> int:
    return _uint(value, name, U64_MAX)


# -- token arrays ------------------------------------------------------------
#
# _u32_source() validates and returns (src, n): `src` holds n native uint32s,
# either as an object with the buffer protocol (array('I'), bytearray,
# memoryview, numpy array) or as a torch tensor (int32/uint32, contiguous,
# CPU). _u32_pointer(src) makes the POINTER(c_uint32) argument. Both are
# split so that the adapter can join input and output ids before pointing at
# them.


def _bad_token(values: Any, what: str) -> None:
    """Raises the error of the first token of `values` (any iterable) that
    is not a uint32, naming it as what[i]. Only called once a bulk check
    failed, so the Python loop runs only on the error path."""
    for i, v in enumerate(values):
        _u32(v, f"{what}[{i}]")
    raise AssertionError(f"{what}: a bulk check failed but no token is out of range")


def _from_sequence(seq: Any, what: str) -> tuple[array.array, int]:
    if type(seq) not in (list, tuple):
        seq = list(seq)  # an iterator, range, deque, ...
    try:
        out = array.array("I", seq)  # checks every value's type and range, in C
    except (TypeError, OverflowError, ValueError):
        _bad_token(seq, what)
    if _has_bool(seq, out):
        _bad_token(seq, what)
    return out, len(out)


_HALF = bytes(i >> 1 for i in range(256))
"""A byte table: b -> b >> 1 (0 and 1 map to 0)."""
_LOW = 0 if _LITTLE else 3
"""The offset of a uint32's least significant byte."""


def _has_bool(seq: Any, out: array.array) -> bool:
    """Whether `seq` holds a bool: array('I') took True as 1 and False as 0,
    but the API refuses bools as integers. Only the tokens converted to 0
    or 1 can have been bools. Their lowest byte is 0 or 1: a strided slice
    of the converted bytes and one table translation (both in C) mark the
    tokens whose lowest byte is 0 or 1 with a zero byte, so Python looks at
    those few elements only (about 1 in 128 of random ids)."""
    low = out.tobytes()[_LOW::4].translate(_HALF)
    i = low.find(0)
    while i >= 0:
        if out[i] <= 1 and type(seq[i]) is bool:
            return True
        i = low.find(0, i + 1)
    return False


def _from_numpy(arr: Any, what: str, np: Any) -> tuple[Any, int]:
    if arr.ndim != 1:
        raise ValueError(f"{what}: expected a 1-D array of token ids, got shape {arr.shape}")
    dt = arr.dtype
    if dt.kind not in "iu":
        raise TypeError(f"{what}: expected an integer array of token ids, got dtype {dt}")
    if not arr.flags.c_contiguous:
        raise ValueError(f"{what}: the array is not contiguous (numpy.ascontiguousarray(...) copies it)")
    n = arr.shape[0]
    if n == 0:
        return arr, 0
    if dt.itemsize == 4 and dt.isnative:
        if dt.kind == "i" and arr.min() < 0:
            _bad_token(arr.tolist(), what)
        return arr, n
    if dt.itemsize == 8 and dt.isnative:
        # One pass: viewed as uint64, a negative int64 is above 2**63, so
        # every id is in range iff the largest is at most UINT32_MAX.
        if arr.view(np.uint64).max() > U32_MAX:
            _bad_token(arr.tolist(), what)
    elif (dt.kind == "i" and arr.min() < 0) or (dt.itemsize > 4 and arr.max() > U32_MAX):
        _bad_token(arr.tolist(), what)
    return arr.astype(np.uint32), n  # one bulk conversion, after the range check


def _from_torch(t: Any, what: str, torch: Any) -> tuple[Any, int]:
    if t.device.type != "cpu":
        raise ValueError(f"{what}: the tensor is on {t.device}; token ids must be on the CPU (tensor.cpu())")
    if t.dim() != 1:
        raise ValueError(f"{what}: expected a 1-D tensor of token ids, got shape {tuple(t.shape)}")
    dt = t.dtype
    if dt.is_floating_point or dt.is_complex or dt == torch.bool:
        raise TypeError(f"{what}: expected an integer tensor of token ids, got dtype {dt}")
    if not t.is_contiguous():
        raise ValueError(f"{what}: the tensor is not contiguous (tensor.contiguous() copies it)")
    n = t.numel()
    if n == 0:
        return t, 0
    if dt == getattr(torch, "uint32", None):
        return t, n
    if dt == torch.int32:
        if bool((t < 0).any()):
            _bad_token(t.tolist(), what)
        return t, n
    if (dt.is_signed and bool((t < 0).any())) or (t.element_size() > 4 and bool((t > U32_MAX).any())):
        _bad_token(t.tolist(), what)
    # One bulk conversion: every value is now in [0, 2**32), and int32
    # keeps its low 32 bits, which are the uint32 the library reads.
    return t.to(torch.int32), n


_NATIVE = "@=" + ("<" if _LITTLE else ">!")


def _from_buffer(mv: memoryview, obj: Any, what: str) -> tuple[Any, int]:
    if mv.ndim != 1:
        raise ValueError(f"{what}: expected a 1-D buffer of token ids, got shape {mv.shape}")
    if not mv.c_contiguous:
        raise ValueError(f"{what}: the buffer is not contiguous")
    fmt = mv.format
    code = fmt[1:] if fmt[:1] in _NATIVE else fmt
    size = mv.itemsize
    if code in ("B", "c") or isinstance(obj, (bytes, bytearray)):
        # Raw bytes are native uint32s (as they always were here).
        if mv.nbytes % 4:
            raise ValueError(f"{what}: a byte buffer of {mv.nbytes} bytes is not uint32s")
        return mv, mv.nbytes // 4
    if len(code) != 1 or code not in "bBhHiIlLqQnN":
        raise TypeError(f"{what}: expected a buffer of integer token ids, got format {fmt!r}")
    n = mv.nbytes // size
    if n == 0:
        return mv, 0
    signed = code.islower()
    if size == 4:
        # The sign bit of each signed value is in its most significant byte.
        if signed and not mv.tobytes()[3 if _LITTLE else 0 :: 4].isascii():
            _bad_token(mv.tolist(), what)
        return mv, n
    if size == 8:
        # The values fit iff their high 32-bit halves are all zero; then
        # the low halves are the uint32s. Strided bytes slices do both in C.
        raw = mv.tobytes()
        hi, lo = (4, 0) if _LITTLE else (0, 4)
        zeros = bytes(n)
        if any(raw[hi + k :: 8] != zeros for k in range(4)):
            _bad_token(mv.tolist(), what)
        out = bytearray(4 * n)
        for k in range(4):
            out[k::4] = raw[lo + k :: 8]
        return out, n
    try:  # 1 or 2 bytes: rare, converted by the array module (in C)
        return array.array("I", mv), n
    except OverflowError:
        _bad_token(mv.tolist(), what)


def _u32_source(tokens: Tokens, what: str = "tokens") -> tuple[Any, int]:
    """Checks `tokens` and returns (src, n): src holds the n token ids as
    native uint32s, shared with `tokens` where its type allows (see
    Tokens), for _u32_pointer. TypeError for a non-integer token or dtype,
    OutOfRangeError naming what[i] for the first token outside uint32,
    ValueError for an array that is not 1-D or not contiguous."""
    tp = type(tokens)
    if tp is list or tp is tuple:
        return _from_sequence(tokens, what)
    if tp is array.array and tokens.typecode == "I":
        return tokens, len(tokens)
    np = sys.modules.get("numpy")
    if np is not None and isinstance(tokens, np.ndarray):
        return _from_numpy(tokens, what, np)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(tokens, torch.Tensor):
        return _from_torch(tokens, what, torch)
    try:
        mv = memoryview(tokens)
    except TypeError:
        return _from_sequence(tokens, what)
    return _from_buffer(mv, tokens, what)


def _u32_pointer(src: Any, n: int) -> Any:
    """The POINTER(c_uint32) argument for a _u32_source() result (None when
    empty). While it is alive, a buffer it points into is exported, so it
    cannot be resized under the call (ctypes releases the GIL during calls);
    drop it right after the call. A torch tensor is pointed at by its
    address (keep the tensor referenced until the call returns)."""
    if n == 0:
        return None
    if hasattr(src, "data_ptr"):  # a torch tensor
        return ctypes.byref(_U32.from_address(src.data_ptr()))
    try:
        return ctypes.byref(_U32.from_buffer(src))  # no copy
    except TypeError:  # a read-only buffer
        pass
    np = sys.modules.get("numpy")
    if np is not None and isinstance(src, np.ndarray):
        return ctypes.byref(_U32.from_address(src.ctypes.data))
    return ctypes.byref(_U32.from_buffer(bytearray(src)))  # bytes, read-only views: one copy


def _u32_arg(src: Any, n: int) -> Any:
    """_u32_pointer() for a POINTER(c_uint32) argument of a ctypes call:
    an array('I') or bytearray (the common cases) is passed as a c_uint32
    over its buffer, which ctypes passes by reference (one object fewer
    than byref(); the buffer stays exported for as long as it lives)."""
    cls = src.__class__
    if (cls is _array or cls is bytearray) and n:
        return _U32.from_buffer(src)
    return _u32_pointer(src, n)


def _states_array(states: Any) -> "array.array[int]":
    """(position, slot) pairs as a flat array('I') in the layout of
    marconi_saved_state (slot None: MARCONI_NO_SLOT). Plain ints are
    appended by the array (which checks their range in C); anything else,
    or a value out of range, goes through the checked path, whose error
    names states[i].position or states[i].slot."""
    if states.__class__ is not list and states.__class__ is not tuple:
        states = list(states)  # iterated twice on the error path
    flat = _array("I")
    append = flat.append
    try:
        for p, s in states:
            if p.__class__ is not int or (s is not None and s.__class__ is not int):
                raise TypeError
            append(p)
            append(U32_MAX if s is None else s)
    except (TypeError, OverflowError):
        flat = _array("I")
        for i, (p, s) in enumerate(states):
            flat.append(_u32(p, f"states[{i}].position"))
            flat.append(U32_MAX if s is None else _u32(s, f"states[{i}].slot"))
    return flat


def _u32_bytes(src: Any, n: int) -> Any:
    """The 4*n bytes of a _u32_source() result, as a buffer."""
    if hasattr(src, "data_ptr"):
        return ctypes.string_at(src.data_ptr(), 4 * n)
    return memoryview(src).cast("B")


def _u32_concat(a: Tokens, b: Optional[Tokens], what_a: str, what_b: str) -> tuple[Any, int, int]:
    """(src, n, len(a)): _u32_source of `a` followed by `b` (b None: just
    `a`). Lists are joined then converted once, arrays are joined in bulk.
    A bad token is named what_a[i] or what_b[i]."""
    if b is None:
        src, n = _u32_source(a, what_a)
        return src, n, n
    ta, tb = type(a), type(b)
    if ta in (list, tuple) and tb in (list, tuple):
        try:
            out, n = _from_sequence([*a, *b], what_a)
        except (TypeError, ValueError):
            _u32_source(a, what_a)  # raise the error under the right name
            _u32_source(b, what_b)
            raise
        return out, n, len(a)
    if ta is array.array is tb and a.typecode == "I" == b.typecode:
        out = a + b
        return out, len(out), len(a)
    sa, na = _u32_source(a, what_a)
    sb, nb = _u32_source(b, what_b)
    if nb == 0:
        return sa, na, na
    out = bytearray(_u32_bytes(sa, na)) if na else bytearray()
    out += _u32_bytes(sb, nb)
    return out, na + nb, na


def _flag(value: Any, name: str) -> int:
    """A bool argument (True/False, or the ints 0 and 1) as 0 or 1."""
    if value is True or value is False:
        return int(value)
    if type(value) is int:
        if value in (0, 1):
            return value
        raise ValueError(f"{name}: expected a bool, got {value!r}")
    raise TypeError(f"{name}: expected a bool, got {type(value).__name__} {value!r}")


def _real(value: Any, name: str) -> float:
    """A float argument: an int or a float, not a bool."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected a float, got {type(value).__name__} {value!r}")
    return float(value)


def _cstr(value: Optional[str], name: str) -> Optional[bytes]:
    """A str argument (None: NULL) as NUL-terminated bytes for a char* field."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise TypeError(f"{name}: expected a str, got {type(value).__name__}")
    if "\0" in value:
        raise ValueError(f"{name}: cannot contain NUL")
    return value.encode()
