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

Then match_prefix + insert alone per request (no lock, no row). With
--sglang, the comparison that counts: the same match_prefix + insert through
SGLang's own UnifiedRadixCache (FULL + MAMBA, its Rust tree core) and
through libmarconi's SGLangTreeCache, both over SGLang's own CPU pools, keys
as array('q') (as SGLang 0.5.23 holds them), the cache calls timed alone and
with the harness; --breakdown adds libmarconi's CPU per step. --sglang needs
SGLang importable: the extracted wheel on PYTHONPATH and its imported
dependencies installed (see docs/sglang.md for the command); without them
it says so and exits non-zero.

Prints CPU microseconds per request (time.process_time), the best of
--repeat runs.
"""

from __future__ import annotations

import argparse
import gc
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
    InsertParams,
    MatchPrefixParams,
    RadixKey,
    Req,
)

from marconi import MarconiPrefixCache  # noqa: E402


def _marconi_tree(requests, model: str) -> tuple:
    """(request-to-token pool, KV allocator, MarconiPrefixCache) sized for
    `requests` (nothing is evicted)."""
    longest = max(len(i) + len(o) for i, o in requests)
    total = sum(len(i) + len(o) for i, o in requests) + 16
    rtp = HybridReqToTokenPool(2, len(requests) + 4, longest + 1)
    alloc = FreeList(total, "KV indices")
    tree = MarconiPrefixCache(CacheInitParams(rtp, alloc), model)
    return rtp, alloc, tree


def run_marconi(requests, model: str) -> float:
    rtp, alloc, tree = _marconi_tree(requests, model)
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


def run_marconi_tree(requests, model: str) -> float:
    """match_prefix + insert per request (the calls run_sglang makes)."""
    rtp, alloc, tree = _marconi_tree(requests, model)
    t0 = time.process_time()
    for inp, out in requests:
        m = tree.match_prefix(MatchPrefixParams(key=RadixKey(inp)))
        k = m.device_prefix_len
        full = inp + out
        value = list(tree.path_device_indices(m.last_device_node))[:k] + alloc.alloc(len(full) - k)
        tree.insert(InsertParams(key=RadixKey(full), value=value, mamba_value=rtp.mamba_allocator.alloc(1), prev_prefix_len=k))
    dt = time.process_time() - t0
    assert tree.cache.stats()["evictions"] == 0
    return dt / len(requests)


def _sglang_tree(total_tokens: int, n_states: int):
    """SGLang's UnifiedRadixCache (FULL + MAMBA, its Rust tree core) over its
    own CPU pools, small layers (the tree's cost does not depend on them):
    tests/sglang_real.py's pools (`no_buffer`, page size 1)."""
    import sglang_real

    params = sglang_real.pools(total_tokens, n_states, extra_buffer=False, rows=2, context=64)
    return sglang_real.sglang_cache(params), params.token_to_kv_pool_allocator, params.req_to_token_pool


def _same_calls(tree, alloc, rtp, requests) -> tuple[float, float]:
    """match_prefix + insert per request as SGLang's scheduler makes them,
    over SGLang's own pools: keys are array('q') as SGLang 0.5.23's Req and
    RadixKey hold them (built before the clock starts, as the request
    arrives with them), the inserted value is the matched prefix's indices
    then newly allocated ones (int64 tensors). Returns (CPU seconds per
    request in the two cache calls alone, CPU seconds per request in the
    whole loop, the harness's tensor work included)."""
    from array import array

    import torch
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams as SInsert
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams as SMatch
    from sglang.srt.mem_cache.radix_cache import RadixKey as SKey

    torch.set_num_threads(1)  # CPU time without idle worker threads spinning
    keys = [(array("q", inp), array("q", inp + out)) for inp, out in requests]
    # The objects of the imports (torch, SGLang) out of the collector's
    # sight, as SGLang's scheduler does after warm-up (gc.freeze): a full
    # collection walks them all and would land on whichever call crosses
    # the threshold.
    gc.collect()
    gc.freeze()
    clock = time.process_time
    in_calls = 0.0
    t0 = clock()
    for inp, full in keys:
        a = clock()
        m = tree.match_prefix(SMatch(key=SKey(inp)))
        in_calls += clock() - a
        k = m.device_prefix_len
        prefix = tree.path_device_indices(m.last_device_node)[:k]
        value = torch.cat([prefix.to(torch.int64), alloc.alloc(len(full) - k).to(torch.int64)])
        slot = rtp.mamba_allocator.alloc(1)
        a = clock()
        tree.insert(SInsert(key=SKey(full), value=value, mamba_value=slot, prev_prefix_len=k))
        in_calls += clock() - a
    total = clock() - t0
    return in_calls / len(requests), total / len(requests)


def run_sglang(requests) -> tuple[float, float]:
    """The calls through SGLang's own UnifiedRadixCache."""
    total = sum(len(i) + len(o) for i, o in requests) + 16
    tree, alloc, rtp = _sglang_tree(total, len(requests) + 4)
    return _same_calls(tree, alloc, rtp, requests)


def run_marconi_sglang_pools(requests, model: str) -> tuple[float, float]:
    """The same calls through libmarconi's SGLangTreeCache over SGLang's
    own pools (the same harness as run_sglang)."""
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams as SParams

    total = sum(len(i) + len(o) for i, o in requests) + 16
    _, alloc, rtp = _sglang_tree(total, len(requests) + 4)
    tree = MarconiPrefixCache(SParams(req_to_token_pool=rtp, token_to_kv_pool_allocator=alloc, page_size=1, disable=False), model)
    out = _same_calls(tree, alloc, rtp, requests)
    s = tree.cache.stats()
    assert s["evictions"] == 0 and s["states"] > 0, s
    return out


def breakdown(requests, model: str) -> dict:
    """CPU microseconds per request in each step of libmarconi's
    match_prefix + insert (the harness of run_marconi_sglang_pools), each
    step timed by a wrapper (about 1 us of its own per call included):
    native calls (_lookup_prefix, _admit_i64, _release, _lease_pages,
    drain in _give_back) and the adapter's conversions."""
    import marconi.adapter as adapter

    spent: dict = {}
    saved = []

    def wrap(obj, name):
        f = getattr(obj, name)
        saved.append((obj, name, f))
        clock = time.process_time

        def timed(*a, **k):
            t = clock()
            try:
                return f(*a, **k)
            finally:
                spent[name] = spent.get(name, 0.0) + clock() - t

        setattr(obj, name, timed)

    from marconi.cache import PrefixCache

    for name in ("_lookup_prefix", "_admit_i64", "_release", "_lease_pages"):
        wrap(PrefixCache, name)
    for name in ("_key_ids", "_index_ids", "_first_id", "_namespace"):
        wrap(adapter, name)
    for name in ("_lookup", "_release_pending", "_give_back"):
        wrap(adapter.SGLangTreeCache, name)
    try:
        run_marconi_sglang_pools(requests, model)
    finally:
        for obj, name, f in reversed(saved):
            setattr(obj, name, f)
    return {k: v / len(requests) for k, v in spent.items()}


def lifecycle(kind: str, extra: bool, page_size: int, conversations: int, turns: int, tokens: int, model: str) -> dict:
    """One run of SGLang's own request life cycle (tests/sglang_real.py:
    Req, init_next_round_input, lock, slot and KV allocation, the prefill's
    state tracking, release_kv_cache, the strict idle check after every
    request) over agentic sessions: `conversations` sessions of `turns`
    turns, each turn the session so far (outputs included) plus a new
    message, a shared system prompt, pools a third of what the trace would
    need (so the cache evicts). Returns CPU microseconds per request (the
    whole loop: the caches' calls and SGLang's own work around them; the
    idle check excluded) and the token hit rate."""
    import random

    import sglang_real

    rng = random.Random(11)
    system = [rng.randrange(1, 30000) for _ in range(tokens // 4)]
    sessions = [list(system) for _ in range(conversations)]
    need = conversations * (tokens // 4 + turns * (tokens // (2 * turns) + 64))
    params = sglang_real.pools(
        max(need // 3, 4 * tokens), 8 + 3 * conversations // 2, extra_buffer=extra, page_size=page_size,
        rows=8, context=4 * tokens + 8 * turns * 64,
    )
    tree = sglang_real.sglang_cache(params) if kind == "sglang" else MarconiPrefixCache(params, model)
    engine = sglang_real.Engine(tree, params)
    engine.idle_check = lambda: None  # timed apart below
    check = sglang_real.Engine.idle_check
    import torch

    torch.set_num_threads(1)
    gc.collect()
    gc.freeze()
    spent = 0.0
    clock = time.process_time
    for _ in range(turns):
        for c in rng.sample(range(conversations), conversations):
            sessions[c] += [rng.randrange(1, 30000) for _ in range(rng.randrange(tokens // (4 * turns), tokens // (2 * turns)))]
            out = [rng.randrange(1, 30000) for _ in range(rng.randrange(8, 64))]
            t = clock()
            engine.step([(list(sessions[c]), out)])
            spent += clock() - t
            check(engine)
            sessions[c] += out
    gc.unfreeze()
    n = engine.counts.requests
    evicted = tree.cache.stats()["evictions"] if kind == "marconi" else None
    return {
        "us_per_request": spent / n * 1e6, "hit_rate": engine.counts.hit_tokens / engine.counts.input_tokens,
        "requests": n, "evictions": evicted,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=200, help="requests per run (default 200)")
    ap.add_argument("--tokens", type=int, default=10_000, help="input length, about (default 10000)")
    ap.add_argument("--repeat", type=int, default=3, help="runs, best taken (default 3)")
    ap.add_argument("--model", default="nemotron-h-8b", help="libmarconi model preset")
    ap.add_argument("--sglang", action="store_true", help="also run SGLang's own UnifiedRadixCache")
    ap.add_argument("--breakdown", action="store_true", help="with --sglang: where libmarconi's time goes, per step")
    ap.add_argument(
        "--lifecycle", action="store_true",
        help="instead: SGLang's own request life cycle, both caches, no_buffer and extra_buffer (needs SGLang)",
    )
    ap.add_argument("--conversations", type=int, default=8, help="with --lifecycle: sessions (default 8)")
    ap.add_argument("--turns", type=int, default=6, help="with --lifecycle: turns per session (default 6)")
    a = ap.parse_args()
    if a.lifecycle:
        tokens = min(a.tokens, 4000)
        print(f"SGLang's request life cycle, {a.conversations} sessions x {a.turns} turns, up to ~{tokens} tokens,"
              f" best of {a.repeat} (CPU us per request, whole loop; token hit rate)")
        for extra, ps in ((False, 1), (True, 1), (True, 16)):
            mode = f"{'extra_buffer' if extra else 'no_buffer'}, page {ps}"
            row = {}
            for kind in ("sglang", "marconi"):
                runs = [lifecycle(kind, extra, ps, a.conversations, a.turns, tokens, a.model) for _ in range(a.repeat)]
                row[kind] = (min(r["us_per_request"] for r in runs), runs[0]["hit_rate"], runs[0]["evictions"])
            (ts, th, _), (ms, mh, ev) = row["sglang"], row["marconi"]
            print(f"{mode:22s} SGLang {ts:7.1f} us {th:6.1%}  libmarconi {ms:7.1f} us {mh:6.1%} ({ev} evictions)"
                  f"  libmarconi/SGLang {ms / ts:.2f}x")
        return
    requests = conversations(a.requests, a.tokens)
    mean = sum(len(i) for i, _ in requests) / len(requests)
    print(f"{len(requests)} requests, mean input {mean:.0f} tokens")
    ours = min(run_marconi(requests, a.model) for _ in range(a.repeat))
    print(f"libmarconi (SGLangTreeCache): {ours * 1e6:10.1f} us CPU / request")
    tree = min(run_marconi_tree(requests, a.model) for _ in range(a.repeat))
    print(f"libmarconi, match_prefix + insert: {tree * 1e6:10.1f} us CPU / request")
    if a.sglang:
        try:
            theirs = [run_sglang(requests) for _ in range(a.repeat)]
            ours = [run_marconi_sglang_pools(requests, a.model) for _ in range(a.repeat)]
        except ImportError as e:
            sys.exit(f"SGLang's UnifiedRadixCache does not import here: {e}")
        print("over SGLang's own CPU pools, array('q') keys, the same harness (best of runs):")
        t_calls, t_loop = min(c for c, _ in theirs), min(t for _, t in theirs)
        o_calls, o_loop = min(c for c, _ in ours), min(t for _, t in ours)
        print(f"SGLang UnifiedRadixCache, match_prefix + insert: {t_calls * 1e6:10.1f} us CPU / request"
              f" (loop with harness {t_loop * 1e6:.1f})")
        print(f"libmarconi SGLangTreeCache, match_prefix + insert: {o_calls * 1e6:10.1f} us CPU / request"
              f" (loop with harness {o_loop * 1e6:.1f})")
        print(f"SGLang's cache costs {t_calls / o_calls:.1f}x libmarconi's in the cache calls"
              f" ({t_loop / o_loop:.1f}x over the whole loop)")
        if a.breakdown:
            print("libmarconi's steps, us CPU / request (match_prefix + insert + the harness's path_device_indices):")
            for name, sec in sorted(breakdown(requests, a.model).items(), key=lambda kv: -kv[1]):
                print(f"  {name:18s} {sec * 1e6:8.1f}")

if __name__ == "__main__":
    main()
