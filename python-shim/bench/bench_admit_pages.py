"""CPU time of lookup, admit and release through the C ABI when the engine
tracks KV pages: 200 multi-turn requests of about 10,000 tokens
(bench_adapter.conversations), array('I') ids, one fresh page id per token,
a state at each sequence's end.

    python python-shim/bench/bench_admit_pages.py
"""

from __future__ import annotations

import sys
import time
from array import array
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_adapter import conversations  # noqa: E402

from marconi import PrefixCache  # noqa: E402


def main() -> None:
    requests = conversations(200, 10_000)
    keys = [(array("I", i), array("I", i + o)) for i, o in requests]
    cache = PrefixCache(1 << 44, "nemotron-h-8b")
    clock = time.process_time
    spent = {"lookup": 0.0, "admit": 0.0, "release": 0.0}
    next_page = 0
    for slot, (inp, full) in enumerate(keys):
        n = len(full)
        pages = array("I", range(next_page, next_page + n))
        next_page += n
        t0 = clock()
        lease = cache.lookup(inp)
        t1 = clock()
        lease.admit(full, [(n, slot)], pages)
        t2 = clock()
        lease.release()
        t3 = clock()
        spent["lookup"] += t1 - t0
        spent["admit"] += t2 - t1
        spent["release"] += t3 - t2
    s = cache.stats()
    assert s["hit_requests"] > len(keys) // 2 and s["evictions"] == 0, s
    print(f"{len(keys)} requests, mean input {sum(len(i) for i, _ in keys) / len(keys):.0f} tokens, pages tracked")
    for name, sec in spent.items():
        print(f"{name:8s} {sec / len(keys) * 1e6:8.1f} us CPU / request")


if __name__ == "__main__":
    main()
