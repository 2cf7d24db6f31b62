"""Replaying the trace through Python and the C ABI gives exactly the stats
the Rust replay (PrefixCache::serve) gives, under a capacity where evictions
and an alpha tuning round happen."""

import json
import os
import subprocess

import marconi
from conftest import REPO, TRACE, target_dir

CAPACITY = 300_000_000


def rust_stats() -> dict:
    exe = os.environ.get("MARCONI_REPLAY_STATS") or str(target_dir() / "release" / "examples" / "replay_stats")
    if os.path.exists(exe):
        cmd = [exe, str(TRACE), str(CAPACITY)]
    else:
        cmd = ["cargo", "run", "-q", "--release", "-p", "marconi-ffi", "--example", "replay_stats", "--", str(TRACE), str(CAPACITY)]
    out = subprocess.run(cmd, cwd=REPO, check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def python_stats() -> dict:
    """The engine's request cycle through the C ABI, with state slots that
    are recycled when evictions free them."""
    free_slots: list[int] = []
    next_slot = [1]

    def slot() -> int:
        if free_slots:
            return free_slots.pop()
        next_slot[0] += 1
        return next_slot[0]

    with marconi.PrefixCache(CAPACITY, "paper-7b", tuner_adoption="deterministic") as cache:
        for line in TRACE.read_text().splitlines():
            req = json.loads(line)
            inp, out = req["input"], req["output"]
            full = inp + out
            dst = slot()
            with cache.lookup(inp, dst_slot=dst) as lease:
                if lease.state_slot is not None:
                    assert lease.copy_order == (lease.state_slot, dst)
                positions = lease.plan + ([len(full)] if len(full) not in lease.plan else [])
                states = [(p, slot()) for p in positions]
                res = lease.admit(full, states)
                # Slots the cache did not take stay ours.
                free_slots.extend(s for (_, s), t in zip(states, res.taken) if not t)
            free_slots.append(dst)
            free_slots.extend(cache.drain_freed()[1])
        cache.check()
        return cache.stats()


def test_python_replay_matches_rust_replay():
    rust = rust_stats()
    py = python_stats()
    assert rust["evictions"] > 0 and rust["tuning_rounds"] > 0, rust
    missing = sorted(k for k in rust if k not in py)
    assert not missing, f"marconi_stats lacks core Stats fields {missing}: extend the ABI"
    assert {k: py[k] for k in rust} == rust
    # The ABI's extra gauges agree with the core's fields.
    assert py["used_bytes"] == rust["kv_bytes"] + rust["state_bytes"]
    assert py["evictable_bytes"] == py["used_bytes"]
