"""SGLangTreeCache over SGLang 0.5.23's own CPU pools and result classes
(TokenToKVPoolAllocator, HybridReqToTokenPool, MatchResult, EvictResult),
where SGLang imports (ci/test.d/sglang.sh installs it and sets
SGLANG_REAL=1: there a missing SGLang fails rather than skips)."""

from __future__ import annotations

import os
import sys
from array import array
from pathlib import Path

import pytest

try:
    import sglang_real  # noqa: F401  (first: it sets up SGLang's modules)
except ImportError as e:
    if os.environ.get("SGLANG_REAL") == "1":
        raise
    pytest.skip(f"SGLang does not import here: {e}", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import bench_sglang  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import (  # noqa: E402
    EvictParams,
    EvictResult,
    InsertParams,
    MatchPrefixParams,
    MatchResult,
)
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixKey  # noqa: E402

from marconi import MarconiPrefixCache  # noqa: E402


def test_insert_match_evict_over_sglangs_pools():
    _, alloc, rtp = bench_sglang._sglang_tree(256, 8)
    tree = MarconiPrefixCache(
        CacheInitParams(req_to_token_pool=rtp, token_to_kv_pool_allocator=alloc, page_size=1, disable=False),
        "nemotron-h-8b",
    )
    kv0, slots0 = alloc.available_size(), rtp.mamba_allocator.available_size()
    first = alloc.alloc(3)
    tree.insert(InsertParams(key=RadixKey(array("q", [1, 2, 3])), value=first, mamba_value=rtp.mamba_allocator.alloc(1)))
    second = alloc.alloc(5)
    r = tree.insert(
        InsertParams(
            key=RadixKey(array("q", [1, 2, 3, 4, 5])), value=second, mamba_value=rtp.mamba_allocator.alloc(1), prev_prefix_len=0
        )
    )
    assert r.prefix_len == 3
    assert alloc.available_size() == kv0 - 5  # the 3 duplicates went back
    m = tree.match_prefix(MatchPrefixParams(key=RadixKey(array("q", [1, 2, 3, 4, 5, 6]))))
    assert isinstance(m, MatchResult) and m.device_prefix_len == 5
    path = tree.path_device_indices(m.last_device_node)
    assert path.tolist() == first.tolist() + second[3:].tolist()
    e = tree.evict(EvictParams(num_tokens=1000, mamba_num=100))
    assert isinstance(e, EvictResult) and (e.num_tokens_evicted, e.mamba_num_evicted) == (5, 2)
    assert alloc.available_size() == kv0 and rtp.mamba_allocator.available_size() == slots0
    tree.sanity_check()
