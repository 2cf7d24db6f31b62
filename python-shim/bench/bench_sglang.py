"""CPU time per request of libmarconi as SGLang 0.5.23's tree cache.

    python python-shim/bench/bench_sglang.py [--requests N] [--tokens T] [--sglang]

Multi-turn conversations (bench_adapter.conversations: inputs of about T
tokens, 10,000 by default, each turn the conversation so far plus a new
message) served through the tree-cache calls SGLang's scheduler makes for a
Full + Mamba model: match_prefix (copy-on-write into the request's Mamba
slot) -> lock -> checkpoint of the finished request (insert with its KV
indices and state; duplicates back to the allocator) -> free the row past
the protected prefix -> unlock. Pools are the test stand-ins
(tests/sglang_stubs.py), sized so that nothing is evicted; token ids are
Python lists, as SGLang's Req holds them.

--sglang also runs SGLang's own UnifiedRadixCache (FULL + MAMBA) through
insert + match_prefix on the same requests, if SGLang and torch import here
(they need SGLang's dependencies: torch, triton, ...); without them it says
so and exits non-zero.

Prints CPU microseconds per request (time.process_time), the best of
--repeat runs.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

from bench_adapter import conversations  # noqa: E402
from sglang_stubs import (  # noqa: E402
    CacheInitParams,
    FreeList,
    HybridReqToTokenPool,
    MatchPrefixParams,
    RadixKey,
    Req,
)

from marconi import MarconiPrefixCache  # noqa: E402


def run_marconi(requests, model: str) -> float:
    longest = max(len(i) + len(o) for i, o in requests)
    total = sum(len(i) + len(o) for i, o in requests) + 16
    rtp = HybridReqToTokenPool(2, len(requests) + 4, longest + 1)
    alloc = FreeList(total, "KV indices")
    tree = MarconiPrefixCache(CacheInitParams(rtp, alloc), model)
    t0 = time.process_time()
    for inp, out in requests:
        req = Req(inp)
        rtp.alloc([req])
        m = tree.match_prefix(MatchPrefixParams(key=RadixKey(inp), cow_mamba=True, req=req))
        req.last_node, req.prefix_len = m.last_device_node, m.device_prefix_len
        req.lock = tree.lock(req.last_node)
        n = len(inp) + len(out)
        row = rtp.req_to_token[req.req_pool_idx]
        row[: req.prefix_len] = tree.prefix_device_indices(req)
        row[req.prefix_len : n] = alloc.alloc(n - req.prefix_len)
        req.kv.cache_protected_len = req.prefix_len
        req.output_ids = out
        req._finished = True
        tree.checkpoint(req, up_to=n)
        tree.free_kv_row(req.kv, [(req.kv.cache_protected_len, n)])
        tree.unlock(req.lock)
        rtp.free(req)
    dt = time.process_time() - t0
    s = tree.cache.stats()
    assert s["states"] > 0 and s["evictions"] == 0, s
    return dt / len(requests)


def run_sglang(requests) -> float:
    import torch  # noqa: F401
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams as SMatch
    from sglang.srt.mem_cache.radix_cache import RadixKey as SKey

    raise SystemExit("SGLang imported, but building its UnifiedRadixCache here is not written: " + repr((InsertParams, SMatch, SKey)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=200, help="requests per run (default 200)")
    ap.add_argument("--tokens", type=int, default=10_000, help="input length, about (default 10000)")
    ap.add_argument("--repeat", type=int, default=3, help="runs, best taken (default 3)")
    ap.add_argument("--model", default="nemotron-h-8b", help="libmarconi model preset")
    ap.add_argument("--sglang", action="store_true", help="also run SGLang's own UnifiedRadixCache")
    a = ap.parse_args()
    requests = conversations(a.requests, a.tokens)
    mean = sum(len(i) for i, _ in requests) / len(requests)
    print(f"{len(requests)} requests, mean input {mean:.0f} tokens")
    ours = min(run_marconi(requests, a.model) for _ in range(a.repeat))
    print(f"libmarconi (SGLangTreeCache): {ours * 1e6:10.1f} us CPU / request")
    if a.sglang:
        try:
            theirs = min(run_sglang(requests) for _ in range(a.repeat))
        except ImportError as e:
            sys.exit(f"SGLang's UnifiedRadixCache does not import here: {e}")
        print(f"SGLang UnifiedRadixCache:     {theirs * 1e6:10.1f} us CPU / request ({theirs / ours:.1f}x)")


if __name__ == "__main__":
    main()
