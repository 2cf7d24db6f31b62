"""MarconiPrefixCache used the way a Python engine uses its radix cache."""

from types import SimpleNamespace

import pytest

from marconi import MarconiPrefixCache


def test_engine_flow_with_radix_cache_method_names():
    tree = MarconiPrefixCache(100_000_000_000, "paper-7b", page_size=1)
    next_slot = iter(range(1, 1000))

    def run(input_ids, output_ids):
        match = tree.match_prefix(input_ids)
        node = match.last_device_node
        tree.inc_lock_ref(node)
        req = SimpleNamespace(origin_input_ids=input_ids, output_ids=output_ids, last_node=node)
        # The engine saves states at the plan positions and at the end.
        end = len(input_ids) + len(output_ids)
        req.saved_states = [(p, next(next_slot)) for p in node.plan] + [(end, next(next_slot))]
        assert tree.protected_size() >= 0
        res = tree.cache_finished_req(req)
        assert not res.rejected
        return node

    prompt = list(range(200))
    n1 = run(prompt, list(range(1000, 1010)))
    assert n1.hit_tokens == 0
    n2 = run(prompt + list(range(1000, 1010)) + [1, 2], [3])
    assert n2.hit_tokens == 210 and n2.state_slot is not None
    assert tree.evictable_size() == tree.total_size() > 213

    # insert() caches KV only (no state): it matches, but is not usable.
    assert tree.insert([7] * 40) == 0
    assert tree.insert([7] * 40 + [8] * 10) == 40
    m = tree.match_prefix([7] * 40 + [9])
    assert m.last_device_node.kv_matched_tokens == 40
    assert m.last_device_node.hit_tokens == 0
    tree.inc_lock_ref(m.last_device_node)
    tree.dec_lock_ref(m.last_device_node)
    with pytest.raises(ValueError):
        tree.dec_lock_ref(m.last_device_node)

    freed = []
    pages, slots = tree.evict(10**9, evict_callback=freed.extend)
    assert len(slots) == 2 and pages == freed == []  # no page ids were given
    assert tree.total_size() == 0
    tree.reset()
    assert tree.cache.stats()["requests"] == 0
