"""Stand-ins for SGLang 0.5.23's pools, request and parameter objects, with
SGLang's attribute and method names, for running SGLang's own tree-cache
expectations on CPU without SGLang's GPU stack (its pools import triton).

Unlike SGLang's allocators, these refuse a double free or an index they
never handed out, so a cache that frees what it does not own fails here.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional


class FreeList:
    """SGLang's TokenToKVPoolAllocator / MambaSlotAllocator surface:
    size, alloc(n), free(indices), available_size(). Index 0 is reserved
    (SGLang's padding slot), as in SGLang."""

    def __init__(self, size: int, what: str):
        self.size = size
        self.what = what
        self._free = list(range(size, 0, -1))  # handed out from the end: 1, 2, ...
        self._out: set[int] = set()

    def alloc(self, n: int) -> Optional[list[int]]:
        if n > len(self._free):
            return None
        got = self._free[len(self._free) - n :]
        del self._free[len(self._free) - n :]
        self._out.update(got)
        return got

    def free(self, indices: Any) -> None:
        for i in list(indices):
            i = int(i)
            if i not in self._out:
                raise AssertionError(f"{self.what}: freeing {i}, which is not allocated")
            self._out.remove(i)
            self._free.append(i)

    def available_size(self) -> int:
        return len(self._free)


class MambaPool:
    """The state tensors, one value per slot; copy_from as SGLang's."""

    def __init__(self, size: int):
        self.size = size
        self.state = [0] * (size + 1)

    def copy_from(self, src: Any, dst: Any) -> None:
        for s, d in zip(list(src), list(dst)):
            self.state[int(d)] = self.state[int(s)]


class HybridReqToTokenPool:
    """SGLang's HybridReqToTokenPool surface: req_to_token rows,
    mamba_allocator, mamba_pool, alloc([req]), write, free(req)."""

    def __init__(self, size: int, mamba_size: int, max_context_len: int):
        self.req_to_token = [[0] * max_context_len for _ in range(size)]
        self._rows = FreeList(size, "req_to_token rows")
        self.mamba_allocator = FreeList(mamba_size, "mamba slots")
        self.mamba_pool = MambaPool(mamba_size)

    def alloc(self, reqs: list) -> list[int]:
        out = []
        for req in reqs:
            row = self._rows.alloc(1)[0] - 1
            slot = self.mamba_allocator.alloc(1)[0]
            # A state of the request's own: its value tells copies apart.
            self.mamba_pool.state[slot] = 1000 + slot
            req.kv.req_pool_idx = row
            req.kv.mamba_pool_idx = slot
            out.append(row)
        return out

    def write(self, where: tuple, values: Any) -> None:
        row, sl = where
        self.req_to_token[row][sl] = list(values)

    def free(self, req: Any) -> None:
        self._rows.free([req.kv.req_pool_idx + 1])

    def available_size(self) -> int:
        return self._rows.available_size()


@dataclasses.dataclass
class CacheInitParams:
    req_to_token_pool: Any
    token_to_kv_pool_allocator: Any
    page_size: int = 1
    disable: bool = False


@dataclasses.dataclass
class RadixKey:
    token_ids: list
    extra_key: Optional[str] = None


@dataclasses.dataclass
class MatchPrefixParams:
    key: Any
    cow_mamba: bool = False
    req: Any = None


@dataclasses.dataclass
class InsertParams:
    key: Any = None
    value: Any = None
    mamba_value: Any = None
    prev_prefix_len: int = 0


@dataclasses.dataclass
class EvictParams:
    num_tokens: int = 0
    swa_num_tokens: int = 0
    mamba_num: int = 0


@dataclasses.dataclass
class ReqKv:
    """Req.kv of SGLang 0.5.23 (ReqKvInfo): the row and what the tree protects."""

    req_pool_idx: Optional[int] = None
    mamba_pool_idx: Optional[int] = None
    cache_protected_len: int = 0
    cache_inserted_len: int = 0


class Req:
    def __init__(self, origin_input_ids: Optional[list] = None):
        self.rid = 0
        self.origin_input_ids = list(origin_input_ids or [])
        self.output_ids: list = []
        self.fill_ids: list = []
        self.kv = ReqKv()
        self.lock = None
        self.last_node = None
        self.prefix_len = 0
        self.extra_key = None
        self._finished = False

    @property
    def mamba_pool_idx(self) -> Optional[int]:
        return self.kv.mamba_pool_idx

    @property
    def req_pool_idx(self) -> Optional[int]:
        return self.kv.req_pool_idx

    @property
    def cache_protected_len(self) -> int:
        return self.kv.cache_protected_len

    def finished(self) -> bool:
        return self._finished
