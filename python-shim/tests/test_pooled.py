"""marconi.PooledCache (the cache over pools) and marconi.plan: multi-turn
conversations through the full request cycle over the memfd backend, with
the invariants checked after every step (check() passes, every handle the
cache holds resolves, evicted handles come back once and are not held,
physical bytes never exceed the budget), the planning numbers against
hand computations, and misuse."""

import array
import random

import pytest

import marconi
from marconi import MarconiError, PooledCache

PAGE = 16


def test_plan_matches_hand_computation():
    budget = 8 << 30
    p = marconi.plan("nemotron-h-8b", budget, page_size=PAGE, state_fraction=0.25, context_tokens=4096, batch=8)
    assert p["page_size"] == PAGE and p["budget_bytes"] == budget
    assert p["kv_page_bytes"] % 128 == 0 and p["state_slot_bytes"] % 128 == 0
    assert p["kv_page_bytes"] >= p["kv_bytes_per_token"] * PAGE
    assert p["max_kv_tokens"] == budget // p["kv_page_bytes"] * PAGE
    assert p["max_state_slots"] == budget // p["state_slot_bytes"]
    # floor(budget * 0.25) bytes of states, the rest KV, in whole units
    assert p["split_state_slots"] == (budget // 4) // p["state_slot_bytes"]
    assert p["split_kv_pages"] == (budget - budget // 4) // p["kv_page_bytes"]
    pages = 4096 // PAGE
    assert p["max_batch_avmp"] == budget // (pages * p["kv_page_bytes"] + p["state_slot_bytes"])
    assert p["max_batch_static"] == min(p["split_kv_pages"] // pages, p["split_state_slots"])
    assert p["max_batch_unified"] == p["unified_units"] // (pages + 1)
    assert p["max_batch_avmp"] >= p["max_batch_static"]
    assert p["max_context_avmp"] >= p["max_context_static"]
    with pytest.raises(MarconiError) as e:
        marconi.plan("paper-7b-attn", budget)
    assert e.value.name == "INVALID_CONFIG"
    with pytest.raises(MarconiError) as e:
        marconi.plan("no-such-model", budget)
    assert e.value.name == "UNKNOWN_PRESET"
    with pytest.raises(MarconiError) as e:
        marconi.plan("nemotron-h-8b", budget, state_fraction=1.0)
    assert e.value.name == "INVALID_CONFIG"
    with pytest.raises(TypeError):
        marconi.plan(3, budget)


def small_cache(migration="avmp", fraction=0.3):
    p = marconi.plan("nemotron-h-8b", 1 << 30, page_size=PAGE)
    budget = 6 * p["state_slot_bytes"] + 2600 // PAGE * p["kv_page_bytes"]
    budget = -(-budget // (2 << 20)) * (2 << 20)
    cache = PooledCache(
        budget, "nemotron-h-8b", page_size=PAGE, migration=migration, state_fraction=fraction, alpha=1.0
    )
    return cache, budget


def check_invariants(cache, budget, seen_freed):
    cache.check()
    held = cache.held()
    if held:
        assert len(cache.resolve(held)) == len(held)  # every held handle is live
    s = cache.stats()
    assert s["held_kv_pages"] + s["held_state_slots"] == len(held)
    assert s["physical_bytes"] <= budget
    freed = cache.drain_freed()
    assert not set(freed) & set(held)
    for h in freed:  # between requests nothing is the caller's: stale
        with pytest.raises(MarconiError):
            cache.resolve([h])
    seen_freed.extend(freed)
    assert len(cache.drain_freed()) == 0


def serve(cache, tokens, input_len, budget, seen_freed):
    look = cache.lookup(tokens[:input_len])
    assert look.hit_tokens < input_len and len(look.kv_pages) == look.hit_tokens // PAGE
    full = len(tokens)
    try:
        pages, slots = cache.reserve(full // PAGE - len(look.kv_pages), len(look.plan) + 1)
    except MarconiError as e:
        assert e.name == "OUT_OF_MEMORY"
        cache.release(look)
        check_invariants(cache, budget, seen_freed)
        return False
    if look.state_handle is not None:
        cache.copy_states([(look.state_handle, slots[0])])
    cache.view(slots[0])[:8] = full.to_bytes(8, "little")
    states = [(pos, slots[i + 1]) for i, pos in enumerate(look.plan)] + [(full // PAGE * PAGE, slots[0])]
    a = cache.admit(look, tokens, states, list(look.kv_pages) + list(pages))
    cache.free(a.returned)
    cache.release(look)
    with pytest.raises(MarconiError) as e:
        cache.release(look)
    assert e.value.name == "UNKNOWN_LEASE"
    check_invariants(cache, budget, seen_freed)
    return True


def conversations(cache, budget, seen, rng, turns):
    """`turns` random requests through serve() (a seeded generator: which
    session speaks, how much it appends and decodes, forks from a shared
    prefix); returns (served, refused)."""
    system = [rng.randrange(1 << 20) for _ in range(160)]
    sessions = []
    served = refused = 0
    for _ in range(turns):
        if not sessions or (len(sessions) < 6 and rng.random() < 0.2):
            base = rng.choice(sessions) if sessions and rng.random() < 0.5 else system
            sessions.append(list(base))
        s = rng.choice(sessions)
        s += [rng.randrange(1 << 20) for _ in range(rng.randrange(1, 200))]
        input_len = len(s)
        s += [rng.randrange(1 << 20) for _ in range(rng.randrange(1, 64))]
        if len(s) > 4000:
            sessions.remove(s)
            continue
        if serve(cache, s, input_len, budget, seen):
            served += 1
        else:
            refused += 1
    return served, refused


@pytest.mark.parametrize("migration,seed", [("avmp", 1), ("avmp", 2), ("static", 1)])
def test_full_cycle_keeps_the_invariants(migration, seed):
    """Random conversations (see conversations()), the invariants checked
    after every request."""
    rng = random.Random(seed)
    cache, budget = small_cache(migration)
    seen = []
    with cache:
        check_invariants(cache, budget, seen)
        served, refused = conversations(cache, budget, seen, rng, 40)
        st = cache.stats()
        assert st["requests"] == served + refused
        assert st["reservations_refused"] == refused
        assert st["hit_tokens"] > 0 and st["evictions"] > 0 and seen
        assert st["leases"] == 0
        if migration == "static":
            assert st["migrations"] == 0
    assert cache.closed


def test_resumed_state_is_the_cached_one():
    cache, _ = small_cache()
    with cache:
        tokens = list(range(1000, 1000 + 256))
        look = cache.lookup(tokens[:200])
        pages, slots = cache.reserve(256 // PAGE, len(look.plan) + 1)
        cache.view(slots[0])[:4] = b"abcd"
        states = [(p, slots[i + 1]) for i, p in enumerate(look.plan)] + [(256, slots[0])]
        a = cache.admit(look, tokens, states, pages)
        assert a.taken[-1]
        cache.free(a.returned)
        cache.release(look)
        look = cache.lookup(tokens + [1, 2, 3])
        assert look.hit_tokens == 256 and look.state_handle == slots[0]
        _, mine = cache.reserve(0, 1)
        cache.copy_states([(look.state_handle, mine[0])])
        assert bytes(cache.view(mine[0])[:4]) == b"abcd"
        with pytest.raises(MarconiError) as e:  # the cache's state is never a destination
            cache.copy_states([(mine[0], look.state_handle)])
        assert e.value.name == "UNKNOWN_HANDLE"
        with pytest.raises(MarconiError) as e:  # nor the caller's to free
            cache.free([look.state_handle])
        assert e.value.name == "UNKNOWN_HANDLE"
        cache.free(mine)
        with pytest.raises(MarconiError) as e:
            cache.free(mine)
        assert e.value.name == "UNKNOWN_HANDLE"
        cache.release(look)
        cache.check()


def test_misuse():
    with pytest.raises(MarconiError) as e:
        PooledCache(64 << 20, "paper-7b-attn")
    assert e.value.name == "INVALID_CONFIG"
    with pytest.raises(MarconiError) as e:
        PooledCache(64 << 20, "nemotron-h-8b", state_slot_bytes=128)
    assert e.value.name == "INVALID_CONFIG"
    cache, _ = small_cache()
    look = cache.lookup(list(range(64)))
    with pytest.raises(MarconiError) as e:
        cache.reserve(10**6, 0)
    assert e.value.name == "OUT_OF_MEMORY"
    with pytest.raises(MarconiError) as e:
        cache.admit(look.lease + 1, list(range(64)))
    assert e.value.name == "UNKNOWN_LEASE"
    with pytest.raises(MarconiError) as e:
        cache.admit(look, list(range(64)), [(64, 0xFFFFFFF0)], [])
    assert e.value.name in ("UNKNOWN_HANDLE", "BAD_PAGE_LIST")
    with pytest.raises(MarconiError) as e:
        cache.lookup([])
    assert e.value.name == "EMPTY_TOKENS"
    cache.release(look)
    cache.close()
    with pytest.raises(ValueError):
        cache.stats()


def _chat_trace(sessions: int, turns: int, seed: int = 7) -> list:
    """Interleaved multi-turn conversations: each turn extends the previous
    sequence (prompt and answer) with a question, and answers it."""
    rng = random.Random(seed)
    seqs = [[] for _ in range(sessions)]
    out = []
    for turn in range(turns):
        for s in range(sessions):
            question = [rng.randrange(1 << 20) for _ in range(48 if turn == 0 else 16)]
            answer = [rng.randrange(1 << 20) for _ in range(16)]
            input_len = len(seqs[s]) + len(question)
            seqs[s] = seqs[s] + question + answer
            out.append((array.array("I", seqs[s]), input_len))
    return out


def test_converged_split_follows_the_trace():
    budget = 1 << 30
    chat = _chat_trace(24, 3)
    a = marconi.converged_split("paper-7b", budget, chat, page_size=PAGE, state_fraction=0.1)
    assert a["requests"] == len(chat)
    assert a["start_fraction"] == 0.1
    assert a["migrations"] > 0 and a["bytes_migrated"] > 0
    # a 27 MB state per conversation against a few MB of KV: toward states
    assert a["settled_fraction"] > 0.3
    assert 0 < a["token_hit_rate"] < 1
    # deterministic; lists, numpy-free sequences and all-input requests accepted
    assert marconi.converged_split("paper-7b", budget, chat, page_size=PAGE, state_fraction=0.1) == a
    rng = random.Random(3)
    docs = []
    for _ in range(12):
        doc = [rng.randrange(1 << 20) for _ in range(2000)]
        docs.append(doc)
        for _ in range(3):
            docs.append((doc[:1984] + [rng.randrange(1 << 20) for _ in range(24)], 2000))
    b = marconi.converged_split("paper-7b", budget, docs, page_size=PAGE, state_fraction=0.9)
    assert b["settled_fraction"] < 0.6 < a["settled_fraction"]


def test_converged_split_refuses_bad_traces():
    with pytest.raises(MarconiError) as e:
        marconi.converged_split("paper-7b", 1 << 30, [])
    assert e.value.name == "INVALID_ARGUMENT"
    with pytest.raises(MarconiError) as e:
        marconi.converged_split("paper-7b", 1 << 30, [[1, 2, 3], []])
    assert e.value.name == "INVALID_ARGUMENT" and "request 1" in str(e.value)
    with pytest.raises(MarconiError) as e:
        marconi.converged_split("paper-7b", 1 << 30, [([1, 2, 3], 4)])
    assert e.value.name == "INVALID_ARGUMENT" and "input_lens[0]" in str(e.value)
    with pytest.raises(MarconiError) as e:
        marconi.converged_split("paper-7b", 1 << 30, [[1, 2]], state_fraction=0.0)
    assert e.value.name == "INVALID_CONFIG"
    with pytest.raises(MarconiError) as e:
        marconi.converged_split("no-such-model", 1 << 30, [[1, 2]])
    assert e.value.name == "UNKNOWN_PRESET"
    with pytest.raises(ValueError):
        marconi.converged_split("paper-7b", 1 << 30, [([1, 2], 1, 3)])
