"""libmarconi's SGLangTreeCache under SGLang 0.5.23's own request life cycle
(tests/sglang_real.py: SGLang's Req, init_next_round_input, tree.lock,
alloc_req_slots, token allocation, the prefill's Mamba state tracking,
release_kv_cache, release_req, and the scheduler's strict idle pool check
after every batch), over SGLang's own CPU pools, in SGLang's two Mamba
modes (`no_buffer`; `extra_buffer`, its default with overlap scheduling)
and page sizes 1 and 16 (SGLang's Mamba cache takes pages > 1 only with
`extra_buffer`), with aborts and retractions. SGLang's own
UnifiedRadixCache runs the same traces: the harness is right where it
passes.

Needs SGLang importable (docs/sglang.md; ci/test.d/sglang.sh installs it
and sets SGLANG_REAL=1, so there a missing SGLang fails rather than skips).
"""

from __future__ import annotations

import os
import random

import pytest

try:
    import sglang_real as S  # first: it sets up SGLang's modules
except ImportError as e:
    if os.environ.get("SGLANG_REAL") == "1":
        raise
    pytest.skip(f"SGLang does not import here: {e}", allow_module_level=True)
from sglang.srt.mem_cache.base_prefix_cache import EvictParams  # noqa: E402

from marconi import MarconiPrefixCache  # noqa: E402

MODES = [
    pytest.param(False, 1, id="no_buffer-page1"),
    pytest.param(True, 1, id="extra_buffer-page1"),
    pytest.param(True, 16, id="extra_buffer-page16"),
]


def build(kind: str, extra: bool, ps: int, kv: int = 6144, slots: int = 24):
    params = S.pools(kv, slots, extra_buffer=extra, page_size=ps)
    tree = S.sglang_cache(params) if kind == "sglang" else MarconiPrefixCache(params, "nemotron-h-8b")
    return S.Engine(tree, params)


def trace(seed: int, conversations: int, turns: int):
    """Multi-turn sessions: two shared system prompts (192 and 130 tokens),
    user turns of 20 to 150 tokens, outputs of 2 to 40 tokens; each turn's
    input is the whole conversation so far, outputs included. Yields (conversation, turn
    number, tokens, output) in an interleaved order."""
    rng = random.Random(seed)
    systems = [[rng.randrange(1, 30000) for _ in range(n)] for n in (192, 130)]
    history = [list(systems[c % 2]) for c in range(conversations)]
    order = [c for _ in range(turns) for c in rng.sample(range(conversations), conversations)]
    seen = [0] * conversations
    for c in order:
        history[c] += [rng.randrange(1, 30000) for _ in range(rng.randrange(20, 150))]
        out = [rng.randrange(1, 30000) for _ in range(rng.randrange(2, 40))]
        yield c, seen[c], list(history[c]), out
        history[c] += out
        seen[c] += 1


def run_trace(engine, seed=7, conversations=6, turns=4, batch=3):
    """Serves the trace in prefill batches of `batch`; one request in nine
    is aborted after its prefill, one in eleven while waiting, one in
    seven retracted and re-run. A finished turn's output joins the
    conversation. SGLang's idle check runs after every batch."""
    items = list(trace(seed, conversations, turns))
    outputs = {}
    i = 0
    while i < len(items):
        group = items[i : i + batch]
        # A conversation's next turn waits for its previous one.
        convs = set()
        picked = []
        for it in group:
            if it[0] in convs:
                break
            convs.add(it[0])
            picked.append(it)
        outcome = []
        for k, _ in enumerate(picked):
            n = i + k
            outcome.append("abort" if n % 9 == 4 else "abort_waiting" if n % 11 == 6 else "retract" if n % 7 == 2 else "finish")
        engine.step([(tokens, out) for _, _, tokens, out in picked], outcome)
        for (c, t, _, out), what in zip(picked, outcome):
            outputs[(c, t)] = out if what in ("finish", "retract") else None
        i += len(picked)
    return engine.counts


def drained(engine):
    """Evicts everything the tree holds: every KV index and Mamba slot is
    then free in SGLang's allocators."""
    engine.tree.evict(EvictParams(num_tokens=1 << 30, mamba_num=1 << 30))
    return engine.alloc.available_size(), engine.rtp.mamba_allocator.available_size()



@pytest.mark.parametrize("extra,ps", MODES)
@pytest.mark.parametrize("kind", ["sglang", "marconi"])
def test_multi_turn_trace_leaks_nothing(kind, extra, ps):
    """A multi-turn trace with aborts and retractions under small pools
    (evictions): SGLang's strict idle check passes after every batch, and
    after the tree is drained every KV index and Mamba slot is free. In
    `extra_buffer` mode libmarconi's cache failed in SGLang's request-slot
    allocation ('Not enough space for mamba ping pong idx') before it freed
    the tracking slots."""
    engine = build(kind, extra, ps)
    counts = run_trace(engine)
    assert counts.finished >= 18 and counts.aborted >= 2 and counts.retracted >= 2, counts
    assert counts.hit_tokens > 0, counts
    kv, slots = drained(engine)
    assert kv == engine.alloc.size and slots == engine.rtp.mamba_pool.size
    engine.idle_check()


@pytest.mark.parametrize("kind", ["sglang", "marconi"])
@pytest.mark.parametrize("ps", [1, 16])
def test_extra_buffer_branch_point_state_is_cached(kind, ps):
    """Two requests share a 192-token system prompt and diverge: the
    second's match returns the branch point (192, on the checkpoint grid)
    as mamba_branching_seqlen, SGLang tracks the state there during the
    prefill, and the finished request hands it to the tree: a third request
    with the same system prompt resumes from it."""
    engine = build(kind, True, ps)
    rng = random.Random(3)
    system = [rng.randrange(1, 30000) for _ in range(192)]

    def turn():
        return system + [rng.randrange(1, 30000) for _ in range(100)], [rng.randrange(1, 30000) for _ in range(5)]

    engine.step([turn()])
    before = len(engine.counts.branch_points)
    engine.step([turn()])
    assert engine.counts.branch_points[before:] == [192]
    third = engine.new_req(turn()[0], 5)
    engine.admit(third)
    assert third.prefix_len == 192
    engine.prefill(third)
    engine.abort(third)
    engine.idle_check()


@pytest.mark.parametrize("extra,ps", MODES)
def test_releases_without_caching_give_back_every_slot(extra, ps):
    """Each of SGLang's releases without caching (an abort after the
    prefill, an abort while waiting that holds the matched state's copy,
    a retraction) leaves SGLang's pools as they were: the request's
    Mamba slot (and ping-pong tracking slots) go back through on_release.
    libmarconi's on_release did nothing: SGLang's strict idle check then
    reported the leak."""
    engine = build("marconi", extra, ps)
    rng = random.Random(5)
    prompt = [rng.randrange(1, 30000) for _ in range(200)]
    engine.step([(prompt, [1, 2, 3])])  # cached: the next ones get a copy of its state
    for what in ("abort", "abort_waiting", "retract"):
        follow = prompt + [1, 2, 3] + [rng.randrange(1, 30000) for _ in range(70)]
        engine.step([(follow, [4, 5])], [what])
    assert engine.counts.aborted == 2 and engine.counts.retracted == 1
