"""CPU time per request of the Python paths into libmarconi, on long inputs.

    python python-shim/bench/bench_adapter.py [--requests N] [--tokens T]

Multi-turn conversations whose inputs are about T tokens (10,000 by
default): each turn's input is the conversation so far plus a new user
message, and each request is served the way an engine does it, through

* direct:  PrefixCache.lookup(input) -> Lease.admit(input + output, states)
           -> release, and
* adapter: MarconiPrefixCache.match_prefix(input) -> inc_lock_ref ->
           cache_finished_req(req) (SGLang's method names),

with the token ids held as array('I') (read in place), as Python lists
(converted once per call) and, if numpy is installed, as numpy int64 arrays
(converted once, in bulk). Then the repository's multi-turn test trace is
replayed through both paths. Two floors come first: the three ctypes calls
alone with every argument built beforehand (the library's work plus ctypes'
cost per call), and the same calls with their buffers and pointers made per
request as any caller must ("C ABI alone"). Prints CPU microseconds per request
(time.process_time: this process's CPU, whatever else the machine runs),
the best of --repeat runs; figures include the library's own work (the
radix tree walk over every token).
"""

from __future__ import annotations

import argparse
import array
import ctypes
import json
import random
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import marconi
from marconi import NO_SLOT, _lib

HERE = Path(__file__).resolve().parent
TRACE = HERE.parent / "tests" / "data" / "trace.jsonl"
CAPACITY = 100 << 30


def conversations(n_requests: int, tokens: int, n_conv: int = 8, turn: int = 100, seed: int = 1):
    """(input, output) pairs as lists: n_conv conversations, interleaved,
    each starting from a (tokens - turn * turns)-token context and growing
    by a turn-token user message and a turn-token reply per request."""
    rng = random.Random(seed)
    turns = max(1, n_requests // n_conv)
    start = max(turn, tokens - turn * turns)
    history = [[rng.randrange(1, 150_000) for _ in range(start)] for _ in range(n_conv)]
    out = []
    for _ in range(turns):
        for h in history:
            inp = h + [rng.randrange(1, 150_000) for _ in range(turn)]
            reply = [rng.randrange(1, 150_000) for _ in range(turn)]
            out.append((inp, reply))
            h[:] = inp + reply
    return out


def run_abi(requests, join) -> float:
    """The floor: the same three C calls per request through ctypes with
    the token buffers already uint32 and no checks (the library's own work,
    plus ctypes' call overhead)."""
    U = ctypes.c_uint32
    with marconi.PrefixCache(CAPACITY, "paper-7b") as cache:
        lib, h = cache._lib, cache._handle
        raw, res = _lib.marconi_lookup(), _lib.marconi_admit_result()
        state, taken = array.array("I", [0, 0]), bytearray(1)
        t0 = time.process_time()
        for k, (inp, out) in enumerate(requests):
            lib.marconi_cache_lookup(h, 0, ctypes.byref(U.from_buffer(inp)), len(inp), NO_SLOT, ctypes.byref(raw))
            full = join(inp, out)
            state[0], state[1] = len(full), k + 1
            lib.marconi_cache_admit(
                h, raw.lease, ctypes.byref(U.from_buffer(full)), len(full),
                ctypes.byref(_lib.marconi_saved_state.from_buffer(state)), 1, None, 0,
                ctypes.byref(ctypes.c_uint8.from_buffer(taken)), ctypes.byref(res),
            )
            lib.marconi_cache_release(h, raw.lease)
        return time.process_time() - t0


def run_calls(requests, join) -> float:
    """Below the floor: only the three ctypes calls are timed, with every
    argument (joined uint32 buffer, pointers, saved state) built
    beforehand: the library's work plus ctypes' cost per call."""
    U = ctypes.c_uint32
    prebuilt = []
    for k, (inp, out) in enumerate(requests):
        full = join(inp, out)
        state = (_lib.marconi_saved_state * 1)((len(full), k + 1))
        prebuilt.append((full, ctypes.byref(U.from_buffer(full)), len(inp), len(full), state))
    with marconi.PrefixCache(CAPACITY, "paper-7b") as cache:
        lib, h = cache._lib, cache._handle
        lookup, admit, release = lib.marconi_cache_lookup, lib.marconi_cache_admit, lib.marconi_cache_release
        raw, res, taken = _lib.marconi_lookup(), _lib.marconi_admit_result(), (ctypes.c_uint8 * 1)()
        p_raw, p_res = ctypes.byref(raw), ctypes.byref(res)
        t0 = time.process_time()
        for _, ptr, n_in, n, state in prebuilt:
            lookup(h, 0, ptr, n_in, NO_SLOT, p_raw)
            admit(h, raw.lease, ptr, n, state, 1, None, 0, taken, p_res)
            release(h, raw.lease)
        return time.process_time() - t0


def run_direct(requests, join) -> float:
    with marconi.PrefixCache(CAPACITY, "paper-7b") as cache:
        slot = 0
        t0 = time.process_time()
        for inp, out in requests:
            with cache.lookup(inp) as lease:
                full = join(inp, out)
                slot += 1
                lease.admit(full, [(len(full), slot)])
        return time.process_time() - t0


def run_adapter(requests, join) -> float:
    tree = marconi.MarconiPrefixCache(CAPACITY, "paper-7b")
    slot = 0
    t0 = time.process_time()
    for inp, out in requests:
        node = tree.match_prefix(inp).last_device_node
        tree.inc_lock_ref(node)
        slot += 1
        req = SimpleNamespace(
            origin_input_ids=inp, output_ids=out, last_node=node, saved_states=[(len(inp) + len(out), slot)]
        )
        tree.cache_finished_req(req)
    return time.process_time() - t0


def join_arrays(a, b):
    return a + b


def best(fn, requests, join, repeat: int) -> float:
    """Best CPU µs per request over `repeat` runs (a fresh cache each run)."""
    return min(fn(requests, join) for _ in range(repeat)) / len(requests) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=200, help="requests per run (default 200)")
    ap.add_argument("--tokens", type=int, default=10_000, help="input length, about (default 10000)")
    ap.add_argument("--repeat", type=int, default=3, help="runs, best taken (default 3)")
    args = ap.parse_args()

    reqs = conversations(args.requests, args.tokens)
    mean_in = sum(len(i) for i, _ in reqs) / len(reqs)
    print(f"libmarconi {marconi.version()} at {marconi.library_path()}, Python {sys.version.split()[0]}")
    print(f"{len(reqs)} requests, {mean_in:,.0f} input + {len(reqs[0][1])} output tokens on average")
    print("CPU µs per request (lookup + admit + release); C ABI alone: the floor, see run_abi")

    forms = [
        ("array('I')", lambda ids: array.array("I", ids), join_arrays),
        ("list", list, lambda a, b: a + b),
    ]
    try:
        import numpy as np

        forms.append(("numpy int64", lambda ids: np.array(ids, dtype=np.int64), lambda a, b: np.concatenate((a, b))))
    except ImportError:
        pass
    as_arrays = [(array.array("I", i), array.array("I", o)) for i, o in reqs]
    calls = best(run_calls, as_arrays, join_arrays, args.repeat)
    print(f"the three ctypes calls alone, every argument built beforehand: {calls:.1f} µs")
    print(f"{'token ids as':<22} {'C ABI alone':>12} {'direct':>9} {'adapter':>9} {'adapter/direct':>15}")
    floor = best(run_abi, as_arrays, join_arrays, args.repeat)
    for name, make, join in forms:
        data = [(make(i), make(o)) for i, o in reqs]
        d = best(run_direct, data, join, args.repeat)
        a = best(run_adapter, data, join, args.repeat)
        print(f"{name:<22} {floor:>12.1f} {d:>9.1f} {a:>9.1f} {a / d:>14.2f}x")

    if TRACE.exists():
        trace = [json.loads(line) for line in TRACE.read_text().splitlines()]
        data = [(array.array("I", r["input"]), array.array("I", r["output"])) for r in trace]
        mean_in = sum(len(i) for i, _ in data) / len(data)
        floor = best(run_abi, data, join_arrays, args.repeat)
        d = best(run_direct, data, join_arrays, args.repeat)
        a = best(run_adapter, data, join_arrays, args.repeat)
        print(f"{'trace, array(I)':<22} {floor:>12.1f} {d:>9.1f} {a:>9.1f} {a / d:>14.2f}x")
        print(f"  (the trace: tests/data/{TRACE.name}, {len(data)} requests, {mean_in:,.0f} input tokens on average)")
    print("goals: adapter within 1.5x of direct; direct <= 20 µs on a 10k-token input")


if __name__ == "__main__":
    main()
