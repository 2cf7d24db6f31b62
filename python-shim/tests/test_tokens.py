"""Every accepted form of a token array gives the same lookup and admit, the
forms that match uint32 are read in place (no copy), and every bad one is
refused with an error naming the argument (and the index of the first bad
token). numpy and torch cases run where those are installed."""

import array
import ctypes
import re
import sys

import pytest

from marconi import MarconiPrefixCache, OutOfRangeError, PrefixCache
from marconi._convert import _u32_concat, _u32_pointer, _u32_source

BIG = 100_000_000_000
SMALL = list(range(100, 164))  # fits every integer type from uint8 up
PROMPT = SMALL + [0xFFFF_FFFF]  # the largest id as well
OUTPUT = list(range(7, 17))
FULL = PROMPT + OUTPUT


def check_form(make, prompt=PROMPT):
    """`make(ids)` builds one form of a token array: served as input and
    output, then looked up, it hits like the list it was made from; the
    adapter admits a request made of it."""
    FULL = prompt + OUTPUT
    PROMPT = prompt
    with PrefixCache(BIG) as cache:
        cache.serve(make(PROMPT), make(OUTPUT))
        with cache.lookup(make(FULL + [5])) as lease:
            assert (lease.hit_tokens, lease.input_len) == (len(FULL), len(FULL) + 1)
            lease.admit(make(FULL + [5]), [(len(FULL) + 1, 3)])
        with cache.lookup(FULL + [5, 6]) as lease:
            assert lease.hit_tokens == len(FULL) + 1
    tree = MarconiPrefixCache(BIG)
    node = tree.match_prefix(make(PROMPT)).last_device_node
    tree.inc_lock_ref(node)
    req = type("Req", (), {})()
    req.origin_input_ids, req.output_ids, req.last_node = make(PROMPT), make(OUTPUT), node
    req.saved_states = [(len(FULL), 1)]
    assert tree.cache_finished_req(req).new_kv_tokens == len(FULL)
    assert tree.match_prefix(FULL + [1]).last_device_node.hit_tokens == len(FULL)


def address(src) -> int:
    return ctypes.addressof(_u32_pointer(src, 1)._obj)


BUILTIN_FORMS = {
    "list": list,
    "tuple": tuple,
    "iterator": iter,
    "array_I": lambda ids: array.array("I", ids),
    "array_L_or_Q": lambda ids: array.array("L", ids),
    "array_q": lambda ids: array.array("q", ids),
    "array_H": None,  # below: 16-bit ids only
    "memoryview": lambda ids: memoryview(array.array("I", ids)),
    "memoryview_readonly": lambda ids: memoryview(array.array("I", ids)).toreadonly(),
    "bytes": lambda ids: array.array("I", ids).tobytes(),
    "bytearray": lambda ids: bytearray(array.array("I", ids).tobytes()),
}


@pytest.mark.parametrize("form", [k for k, v in BUILTIN_FORMS.items() if v])
def test_builtin_forms(form):
    check_form(BUILTIN_FORMS[form])


def test_signed_int32_buffers_are_read_in_place():
    # array('i') cannot hold 0xFFFF_FFFF: small ids only.
    ids = array.array("i", range(100))
    src, n = _u32_source(ids)
    assert n == 100 and address(src) == ids.buffer_info()[0]
    with PrefixCache(BIG) as cache:
        cache.serve(ids, array.array("i", [1, 2]))
        with cache.lookup(list(range(100)) + [1, 2, 3]) as lease:
            assert lease.hit_tokens == 102


def test_small_integer_buffers_are_converted():
    src, n = _u32_source(array.array("H", [1, 65535]))
    assert n == 2 and list(memoryview(src)) == [1, 65535]


def test_uint32_buffers_are_not_copied():
    ids = array.array("I", FULL)
    src, n = _u32_source(ids)
    assert src is ids and address(src) == ids.buffer_info()[0]
    buf = bytearray(ids.tobytes())
    src, n = _u32_source(buf)
    assert n == len(FULL) and address(src) == ctypes.addressof(ctypes.c_char.from_buffer(buf))


def test_a_buffer_is_exported_only_during_the_call():
    ids = array.array("I", FULL)
    with PrefixCache(BIG) as cache:
        with pytest.raises(OutOfRangeError):
            cache.lookup(ids, namespace=2**64)  # refused before any pointer exists
        with cache.lookup(ids):
            ids.append(1)  # would raise BufferError if the lookup still exported it
        cache.serve(ids, ids)
        ids.append(2)


def test_joined_input_and_output_forms():
    src, n, n_in = _u32_concat(array.array("I", [1, 2]), [3], "a", "b")
    assert (n, n_in) == (3, 2) and list(memoryview(src).cast("I")) == [1, 2, 3]
    src, n, n_in = _u32_concat(iter([1, 2]), None, "a", "b")
    assert (n, n_in) == (2, 2)
    src, n, n_in = _u32_concat([], array.array("I", [4]), "a", "b")
    assert (n, n_in) == (1, 0) and list(memoryview(src).cast("I")) == [4]


@pytest.mark.parametrize(
    "tokens, error, text",
    [
        ([1, True], TypeError, "tokens[1]: expected an int, got bool True"),
        # A bool among many ids (found by the bulk scan of 0/1 ids), also
        # False, and next to ids whose lowest byte is 0 or 1.
        ([256, 257, 513] * 3000 + [False] + [2] * 10, TypeError, "tokens[9000]: expected an int, got bool False"),
        ([1, 0, 65537] * 2000 + [True], TypeError, "tokens[6000]: expected an int, got bool True"),
        ([1, 2, 2.0], TypeError, "tokens[2]: expected an int, got float"),
        ([1, "2"], TypeError, "tokens[1]"),
        ([1, -1], OutOfRangeError, "tokens[1]: -1 does not fit in uint32"),
        ([2**32], OutOfRangeError, "tokens[0]: 4294967296 does not fit in uint32"),
        (array.array("i", [1, 2, -3]), OutOfRangeError, "tokens[2]: -3 does not fit"),
        (array.array("q", [1, 2**32]), OutOfRangeError, "tokens[1]: 4294967296 does not fit"),
        (array.array("q", [-1]), OutOfRangeError, "tokens[0]: -1 does not fit"),
        (array.array("Q", [5, 2**63]), OutOfRangeError, "tokens[1]"),
        (array.array("b", [1, -1]), OutOfRangeError, "tokens[1]: -1 does not fit"),
        (array.array("d", [1.0]), TypeError, "tokens: expected a buffer of integer token ids, got format 'd'"),
        (b"\x01\x00\x00", ValueError, "tokens: a byte buffer of 3 bytes is not uint32s"),
        (memoryview(array.array("I", range(8)))[::2], ValueError, "tokens: the buffer is not contiguous"),
        (memoryview(bytearray(16)).cast("I", (2, 2)), ValueError, "tokens: expected a 1-D buffer"),
        (7, TypeError, "not iterable"),
    ],
    ids=lambda v: type(v).__name__ if not isinstance(v, str) else v[:24],
)
def test_bad_tokens_are_refused_by_name(tokens, error, text):
    with PrefixCache(BIG) as cache:
        with pytest.raises(error) as e:
            cache.lookup(tokens)
        assert text in str(e.value)
        assert cache.stats()["leases"] == 0


def test_adapter_names_the_request_field():
    tree = MarconiPrefixCache(BIG)
    node = tree.match_prefix([1, 2, 3]).last_device_node
    req = type("Req", (), {})()
    req.origin_input_ids, req.output_ids, req.last_node = [1, 2, 3], [4, -5], node
    with pytest.raises(OutOfRangeError, match=r"output_ids\[1\]: -5"):
        tree.cache_unfinished_req(req)
    req.origin_input_ids, req.output_ids = array.array("I", [1, 2, 3]), array.array("q", [4, 2**40])
    with pytest.raises(OutOfRangeError, match=r"output_ids\[1\]: 1099511627776"):
        tree.cache_unfinished_req(req)
    req.output_ids = None
    assert tree.cache_finished_req(req).new_kv_tokens == 3


# -- numpy ---------------------------------------------------------------------


@pytest.fixture
def np():
    return pytest.importorskip("numpy")


@pytest.mark.parametrize("dtype", ["uint32", "int32", "int64", "uint64", "int16", "uint8", ">u4", ">i8"])
def test_numpy_integer_arrays(np, dtype):
    big = np.iinfo(np.dtype(dtype)).max >= 0xFFFF_FFFF
    check_form(lambda ids: np.array(ids, dtype=dtype), PROMPT if big else SMALL)


@pytest.mark.parametrize("dtype", ["uint32", "int32"])
def test_numpy_32_bit_arrays_are_not_copied(np, dtype):
    arr = np.arange(100, dtype=dtype)
    src, _ = _u32_source(arr)
    assert src is arr and address(src) == arr.ctypes.data
    arr.flags.writeable = False  # read in place too (by address)
    src, _ = _u32_source(arr)
    assert src is arr and address(src) == arr.ctypes.data


def lookup_refuses(tokens, error, text):
    """A lookup of `tokens` raises `error` whose message holds `text`."""
    with PrefixCache(BIG) as cache:
        with pytest.raises(error) as e:
            cache.lookup(tokens)
        assert text in str(e.value)


@pytest.mark.parametrize(
    "make, error, text",
    [
        (lambda np: np.array([1, -2], dtype=np.int32), OutOfRangeError, "tokens[1]: -2 does not fit"),
        (lambda np: np.array([1, 2, 2**32], dtype=np.int64), OutOfRangeError, "tokens[2]: 4294967296"),
        (lambda np: np.array([-7], dtype=np.int64), OutOfRangeError, "tokens[0]: -7"),
        (lambda np: np.array([2**64 - 1], dtype=np.uint64), OutOfRangeError, "tokens[0]"),
        (lambda np: np.array([1.0, 2.0]), TypeError, "got dtype float64"),
        (lambda np: np.array([True]), TypeError, "got dtype bool"),
        (lambda np: np.arange(10, dtype=np.uint32)[::2], ValueError, "not contiguous"),
        (lambda np: np.zeros((2, 3), dtype=np.uint32), ValueError, "got shape (2, 3)"),
        (lambda np: np.array(5, dtype=np.uint32), ValueError, "got shape ()"),
        (lambda np: np.uint32(5), ValueError, "expected a 1-D buffer"),
    ],
)
def test_numpy_bad_arrays_are_refused(np, make, error, text):
    lookup_refuses(make(np), error, text)


def test_numpy_is_never_imported_by_the_package():
    import subprocess

    code = "import sys, marconi; marconi.PrefixCache(10**9).serve([1, 2]); print('numpy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "False"


# -- torch ----------------------------------------------------------------------
#
# CI does not install torch (GBs): there these tests run on a numpy-backed
# stand-in of the few tensor members the package uses, which checks the
# package's logic but not torch itself; where torch is installed they run on it.


def fake_torch(np):
    import types

    class Dtype:
        def __init__(self, name):
            self.np = np.dtype(name)
            self.name = name
            self.is_floating_point = self.np.kind == "f"
            self.is_complex = self.np.kind == "c"
            self.is_signed = self.np.kind in "if"

        def __repr__(self):
            return f"torch.{self.name}"

    dtypes = {n: Dtype(n) for n in ("bool", "uint8", "int16", "int32", "int64", "uint32", "float32")}

    class Tensor:
        def __init__(self, a, device="cpu"):
            self.a, self.device, self.dtype = a, types.SimpleNamespace(type=device), dtypes[a.dtype.name]
            self.shape = a.shape

        def dim(self):
            return self.a.ndim

        def is_contiguous(self):
            return self.a.flags.c_contiguous

        def numel(self):
            return self.a.size

        def element_size(self):
            return self.a.itemsize

        def data_ptr(self):
            return self.a.ctypes.data

        def to(self, dtype):
            return Tensor(self.a.astype(dtype.np))

        def __lt__(self, x):
            return Tensor(self.a < x)

        def __gt__(self, x):
            return Tensor(self.a > x)

        def any(self):
            return Tensor(np.array(self.a.any()))

        def __bool__(self):
            return bool(self.a)

        def __getitem__(self, k):
            return Tensor(self.a[k])

        def tolist(self):
            return self.a.tolist()

    torch = types.ModuleType("torch")
    torch.Tensor = Tensor
    torch.__dict__.update(dtypes)
    def tensor(data, dtype=None):
        if dtype is None:  # torch's defaults
            dtype = dtypes["float32" if np.array(data).dtype.kind == "f" else "int64"]
        return Tensor(np.array(data, dtype=dtype.np))

    torch.tensor = tensor
    torch.arange = lambda n, dtype=dtypes["int64"]: Tensor(np.arange(n, dtype=dtype.np))
    torch.zeros = lambda shape, dtype=dtypes["float32"]: Tensor(np.zeros(shape, dtype=dtype.np))
    return torch


@pytest.fixture
def torch(monkeypatch):
    try:
        import torch

        return torch
    except ImportError:
        stand_in = fake_torch(pytest.importorskip("numpy"))
        monkeypatch.setitem(sys.modules, "torch", stand_in)
        return stand_in


def test_torch_tensor_on_another_device_is_refused(torch):
    t = torch.arange(4, dtype=torch.int32)
    if hasattr(t, "a"):  # the stand-in
        t.device.type = "cuda"
    elif torch.cuda.is_available():
        t = t.cuda()
    else:
        pytest.skip("no CUDA device")
    with pytest.raises(ValueError, match="token ids must be on the CPU"):
        _u32_source(t)


@pytest.mark.parametrize("dtype", ["int32", "int64"])
def test_torch_cpu_tensors(torch, dtype):
    check_form(lambda ids: torch.tensor(ids, dtype=getattr(torch, dtype)), PROMPT if dtype == "int64" else SMALL)


def test_torch_int32_is_not_copied(torch):
    t = torch.arange(100, dtype=torch.int32)
    src, _ = _u32_source(t)
    assert src is t and address(src) == t.data_ptr()


@pytest.mark.parametrize(
    "make, error, text",
    [
        (lambda torch: torch.tensor([1, -2], dtype=torch.int32), OutOfRangeError, "tokens[1]: -2"),
        (lambda torch: torch.tensor([1, 2**32], dtype=torch.int64), OutOfRangeError, "tokens[1]: 4294967296"),
        (lambda torch: torch.tensor([1.0]), TypeError, "got dtype torch.float32"),
        (lambda torch: torch.arange(10)[::2], ValueError, "not contiguous"),
        (lambda torch: torch.zeros((2, 2), dtype=torch.int64), ValueError, "got shape (2, 2)"),
    ],
)
def test_torch_bad_tensors_are_refused(torch, make, error, text):
    lookup_refuses(make(torch), error, text)


def test_saved_states_forms_and_bad_states():
    """States are (position, slot) pairs of ints (slot None when untracked),
    from a list, a tuple or any iterable; a bool, float or out-of-range value
    is refused naming states[i].position or .slot, before any call."""
    ids = list(range(1, 41))
    with PrefixCache(BIG) as cache:
        for states, name in (
            ([(40, True)], "states[0].slot"),
            ([(2**32, 1)], "states[0].position"),
            ([(-1, None)], "states[0].position"),
            (((40, 1), (False, 2)), "states[1].position"),
            (iter([(40, 1), (20, 2**32)]), "states[1].slot"),
        ):
            with cache.lookup(ids) as lease:
                with pytest.raises((TypeError, OverflowError), match="^" + re.escape(name)):
                    lease.admit(ids, states)
        assert cache.stats()["states"] == 0
        with cache.lookup(ids) as lease:
            r = lease.admit(ids, ((p, s) for p, s in [(40, 7)]))  # a generator
        assert r.states_taken == 1 and r.taken == [True]
        with cache.lookup(ids + [50]) as lease:
            assert lease.hit_tokens == 40 and lease.state_slot == 7
