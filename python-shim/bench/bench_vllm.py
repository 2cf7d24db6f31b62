"""Replay benchmark of vLLM 0.33.0's CPU offload tier (docs/vllm.md).

A seeded multi-turn chat trace (sessions sharing system prompts, each turn
extending its session) runs through vLLM's own Scheduler and
OffloadingConnector (python-shim/tests/vllm_engine.py: hybrid KV cache,
Mamba align mode, sha256_cbor, a fake model runner, transfers completed at
once) with the host tier's policy set to vLLM's `lru` and `arc`, ours
(`MarconiCachePolicy` from marconi.vllm) and `Clairvoyant` (defined here:
it knows the trace's future and evicts the idle chunk whose next use is
farthest away; a chunk's use is a later request whose longest prefix
shared with earlier requests covers it, the Mamba state only at the end of
that prefix). Every policy gets the same host bytes. Prints the token hit
rate (device + host hits over prompt tokens) per policy and host size, and
the per-call cost of `evict` and `insert` (p50/p99 µs).

    MARCONI_LIBRARY=target/release/libmarconi.so VLLM_TARGET_DEVICE=cpu \\
      PYTHONPATH=python-shim target/vllm/venv/bin/python python-shim/bench/bench_vllm.py

(target/vllm/venv: built by `bash ci/test.d/vllm.sh`.)
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import vllm_engine as ve  # noqa: E402

from vllm.utils.hashing import sha256_cbor  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.kv_offload.base import make_offload_key  # noqa: E402
from vllm.v1.kv_offload.cpu.policies.lru import LRUCachePolicy  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402

FUTURE: dict = {}
"""Set by the benchmark before each engine: key -> sorted request indices
that use it, and the index of the request being served."""


class Clairvoyant(LRUCachePolicy):
    """Belady's rule inside vLLM's contract: among idle, unprotected chunks,
    evict those used farthest in the future (never used: first)."""

    def evict(self, n, protected):
        if n == 0:
            return []
        now = FUTURE["now"]
        uses = FUTURE["uses"]

        def next_use(key):
            for i in uses.get(key, ()):
                if i > now:
                    return i
            return 1 << 60

        cands = [k for k in self._evictable if k not in protected]
        if len(cands) < n:
            return None
        # Farthest next use first; ties (e.g. never used again) go least
        # recently used first, so the order does not depend on set order.
        ranks = self._ranks
        cands.sort(key=lambda k: (next_use(k), tuple(-x for x in ranks[k])), reverse=True)
        out = []
        for k in cands[:n]:
            chunk = self.chunks.pop(k)
            self._evictable.discard(k)
            self._ranks.pop(k, None)
            out.append((k, chunk))
        return out


def trace(seed: int, block: int, sessions: int, turns: int, systems: int):
    rng = random.Random(seed)
    tok = lambda n: [rng.randrange(2, 40000) for _ in range(n)]  # noqa: E731
    sys_prompts = [tok(block * rng.randrange(4, 9)) for _ in range(systems)]
    convs = [sys_prompts[i % systems] + tok(rng.randrange(block, 3 * block)) for i in range(sessions)]
    out = []
    for _ in range(turns):
        order = list(range(sessions))
        rng.shuffle(order)
        for i in order:
            o = tok(rng.randrange(8, 40))
            out.append((list(convs[i]), o))
            convs[i] = convs[i] + o + tok(rng.randrange(block // 2, 2 * block))
    return out


def future_uses(tr, block: int, tokens_per_chunk: int):
    """key -> request indices that would use it (see the module doc)."""
    init_none_hash(sha256_cbor)
    hasher = get_request_block_hasher(block, sha256_cbor)
    seen: set = set()
    uses: dict = {}
    per = tokens_per_chunk // block
    for idx, (prompt, out) in enumerate(tr):
        req = Request(request_id=f"f{idx}", prompt_token_ids=prompt, sampling_params=SamplingParams(max_tokens=1),
                      pooling_params=None, block_hasher=hasher)
        hashes = [req.block_hashes[i] for i in range(per - 1, len(req.block_hashes), per)]
        shared = 0
        while shared < len(hashes) and hashes[shared] in seen:
            shared += 1
        for i in range(shared):
            uses.setdefault(make_offload_key(hashes[i], 0), []).append(idx)
        if shared:
            uses.setdefault(make_offload_key(hashes[shared - 1], 1), []).append(idx)
        # vLLM offloads prompt chunks only (offload_prompt_only, its default).
        seen.update(hashes)
    return uses


def timed(policy, name, sink):
    fn = getattr(policy, name)

    def wrapper(*a, **k):
        t = time.perf_counter_ns()
        try:
            return fn(*a, **k)
        finally:
            sink.append(time.perf_counter_ns() - t)

    setattr(policy, name, wrapper)


def pct(xs, q):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] / 1000.0


def main() -> None:
    sys.modules.setdefault("bench_vllm", sys.modules[__name__])  # vLLM imports Clairvoyant by module name
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--sessions", type=int, default=12)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--systems", type=int, default=3)
    ap.add_argument("--gpu-blocks", type=int, default=48)
    ap.add_argument("--host-chunks", type=int, nargs="+", default=[40, 80, 160])
    ap.add_argument("--block-sizes", type=int, nargs="+", default=[ve.TINY.vllm_block_size(), 16])
    args = ap.parse_args()
    model = ve.model_dir(tempfile.mkdtemp(prefix="marconi-bench-vllm-"))
    policies = [("lru", None), ("arc", None), ("MarconiCachePolicy", "marconi.vllm"), ("Clairvoyant", "bench_vllm")]
    print(f"model: {ve.TINY}; device {args.gpu_blocks} blocks per group")
    print("| block | seed | host chunks | host MB | lru | arc | ours | clairvoyant | ours - max(lru,arc) | share of lru->clairvoyant |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    costs: dict = {p: {"evict": [], "insert": [], "on_request_finished": []} for p, _ in policies}
    for block in args.block_sizes:
        for seed in args.seeds:
            tr = trace(seed, block, args.sessions, args.turns, args.systems)
            FUTURE["uses"] = future_uses(tr, block, block)
            for host in args.host_chunks:
                rates = {}
                for name, module in policies:
                    e = ve.Engine(model, block_size=block, gpu_blocks=args.gpu_blocks,
                                  cpu_bytes=ve.Engine.page_bytes_for(block) * host, policy=name, policy_module=module,
                                  extra={"marconi_model": os.path.join(model, "config.json")})
                    timed(e.policy, "evict", costs[name]["evict"])
                    timed(e.policy, "insert", costs[name]["insert"])
                    timed(e.policy, "on_request_finished", costs[name]["on_request_finished"])
                    tot = hit = 0
                    for idx, (prompt, out) in enumerate(tr):
                        FUTURE["now"] = idx
                        r = e.run(prompt, out)
                        tot += r["prompt"]
                        hit += r["hit"]
                    rates[name] = 100.0 * hit / tot
                lru, arc, ours, oracle = (rates[p] for p, _ in policies)
                share = (ours - lru) / (oracle - lru) if oracle - lru > 0.05 else float("nan")
                print(f"| {block} | {seed} | {host} | {ve.Engine.page_bytes_for(block) * host / 1e6:.2f} | {lru:.1f} % "
                      f"| {arc:.1f} % | {ours:.1f} % | {oracle:.1f} % | {ours - max(lru, arc):+.1f} | {share:.2f} |",
                      flush=True)
    print()
    print("| policy | evict p50 µs | evict p99 µs | insert p50 µs | insert p99 µs | on_request_finished p50 µs | p99 µs | evict calls |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, _ in policies:
        c = costs[name]
        print(f"| {name} | {pct(c['evict'], 0.5):.1f} | {pct(c['evict'], 0.99):.1f} | {pct(c['insert'], 0.5):.1f} "
              f"| {pct(c['insert'], 0.99):.1f} | {pct(c['on_request_finished'], 0.5):.1f} "
              f"| {pct(c['on_request_finished'], 0.99):.1f} | {len(c['evict'])} |")


if __name__ == "__main__":
    main()
