"""libmarconi as SGLang 0.5.23's tree cache for hybrid (Full + Mamba) models.

The expectations are ported from SGLang's own unit tests (Apache-2.0,
github.com/sgl-project/sglang, test/registered/radix_cache/): the
TestUnifiedRadixCacheMamba cases, the Full + Mamba cases of
TestUnifiedRadixCacheSWAMamba, and test_mamba_unittest's
test_mamba_radix_cache_1. SGLang ships no tests in its wheel, and its pools
import triton (GPU only), so they run here over stand-ins of SGLang's pools
with SGLang's method names (sglang_stubs.py); each test keeps SGLang's name.
Where Marconi differs by design, the test asserts Marconi's behaviour and
says why (docs/sglang.md lists them).
"""

from __future__ import annotations

import pytest
from sglang_stubs import (
    CacheInitParams,
    EvictParams,
    FreeList,
    HybridReqToTokenPool,
    InsertParams,
    MatchPrefixParams,
    RadixKey,
    Req,
)

from marconi import MarconiPrefixCache
from marconi.adapter import SGLangTreeCache

# Nemotron-H's dimensions: KV and Mamba state bytes as libmarconi budgets them.
MODEL = "nemotron-h-8b"


def build_tree(kv_size=128, max_num_reqs=10, mamba_cache_size=20, max_context_len=128, page_size=1):
    rtp = HybridReqToTokenPool(max_num_reqs, mamba_cache_size, max_context_len)
    alloc = FreeList(kv_size, "KV indices")
    tree = MarconiPrefixCache(
        CacheInitParams(req_to_token_pool=rtp, token_to_kv_pool_allocator=alloc, page_size=page_size),
        MODEL,
    )
    assert isinstance(tree, SGLangTreeCache)

    def make_req():
        req = Req()
        rtp.alloc([req])
        return req

    return tree, alloc, rtp, make_req


def insert(tree, alloc, req, tokens, **kw):
    return tree.insert(
        InsertParams(key=RadixKey(tokens), value=alloc.alloc(len(tokens)), mamba_value=[req.mamba_pool_idx], **kw)
    )


def hit(tree, tokens, **kw):
    return tree.match_prefix(MatchPrefixParams(key=RadixKey(tokens), **kw)).device_prefix_len


def release_kv_cache(tree, req, checkpoint):
    """The tree calls of SGLang 0.5.23's mem_cache/common.py release_kv_cache,
    in its order, and nothing else (SGLang's own function, over SGLang's own
    pools and Req, runs in test_sglang_lifecycle.py): every Mamba slot the
    request holds is the tree's to hand back (checkpoint or on_release)."""
    owned = len(req.origin_input_ids) + len(req.output_ids)
    if checkpoint:
        req._finished = True
        tree.checkpoint(req, up_to=owned)
    tree.free_kv_row(req.kv, [(req.kv.cache_protected_len, owned)])
    tree.unlock(req.lock)
    req.lock = None
    tree.on_release(req, checkpointed=checkpoint)


def own_row(rtp, alloc, req, n):
    kv = alloc.alloc(n)
    rtp.write((req.req_pool_idx, slice(0, n)), kv)
    return kv


# -- TestUnifiedRadixCacheMamba -----------------------------------------------


def test_insert_and_match_basic():
    tree, alloc, _, make_req = build_tree()
    assert insert(tree, alloc, make_req(), [1, 2, 3]).prefix_len == 0
    assert insert(tree, alloc, make_req(), [1, 2, 3, 4, 5]).prefix_len == 3
    assert hit(tree, [1, 2, 3, 4, 5]) == 5
    assert hit(tree, [1, 2, 3, 4, 5, 6]) == 5
    assert hit(tree, [10, 11]) == 0
    tree.sanity_check()


def test_evict_full_tokens():
    tree, alloc, _, make_req = build_tree()
    insert(tree, alloc, make_req(), [1, 2, 3])
    insert(tree, alloc, make_req(), [10, 11, 12])
    assert tree.full_evictable_size() == 6
    free = alloc.available_size()
    result = tree.evict(EvictParams(num_tokens=3))
    assert result.num_tokens_evicted >= 3
    assert tree.full_evictable_size() <= 3
    # What was evicted went back to SGLang's allocator.
    assert alloc.available_size() == free + result.num_tokens_evicted
    tree.sanity_check()


def test_evict_mamba_only():
    tree, alloc, rtp, make_req = build_tree()
    insert(tree, alloc, make_req(), [1, 2, 3])
    insert(tree, alloc, make_req(), [1, 2, 3, 4, 5, 6, 7])
    assert tree.mamba_evictable_size() == 2
    slots = rtp.mamba_allocator.available_size()
    result = tree.evict(EvictParams(num_tokens=0, mamba_num=1))
    assert result.mamba_num_evicted >= 1
    assert rtp.mamba_allocator.available_size() == slots + result.mamba_num_evicted
    assert tree.full_evictable_size() >= 0
    tree.sanity_check()


def test_evict_mamba_breaks_match():
    tree, alloc, _, make_req = build_tree()
    insert(tree, alloc, make_req(), [1, 2, 3])
    insert(tree, alloc, make_req(), [1, 2, 3, 4, 5])
    tree.evict(EvictParams(num_tokens=0, mamba_num=2))
    assert tree.mamba_evictable_size() == 0
    assert hit(tree, [1, 2, 3, 4, 5]) == 0
    tree.sanity_check()


def test_evict_respects_lock_ref():
    tree, alloc, _, make_req = build_tree()
    insert(tree, alloc, make_req(), [1, 2, 3])
    insert(tree, alloc, make_req(), [10, 11, 12])
    locked = tree.match_prefix(MatchPrefixParams(key=RadixKey([1, 2, 3]))).last_device_node
    tree.inc_lock_ref(locked)
    assert tree.evict(EvictParams(num_tokens=6)).num_tokens_evicted >= 3
    assert hit(tree, [1, 2, 3]) == 3
    tree.dec_lock_ref(locked)
    assert tree.evict(EvictParams(num_tokens=3)).num_tokens_evicted >= 3
    tree.sanity_check()


def test_evict_result_accounting():
    tree, alloc, _, make_req = build_tree()
    insert(tree, alloc, make_req(), [1, 2, 3])
    result = tree.evict(EvictParams(num_tokens=3))
    assert result.num_tokens_evicted >= 3
    assert result.mamba_num_evicted >= 1
    tree.sanity_check()


def test_insert_prev_prefix_len():
    tree, alloc, _, make_req = build_tree()
    initial = alloc.available_size()
    insert(tree, alloc, make_req(), [1, 2, 3])
    assert alloc.available_size() == initial - 3
    # prev_prefix_len=0: the duplicate [0:3] goes back to the allocator.
    assert insert(tree, alloc, make_req(), [1, 2, 3, 4, 5], prev_prefix_len=0).prefix_len == 3
    assert alloc.available_size() == initial - 3 - 2
    # prev_prefix_len=5: nothing before 5 is the caller's to free.
    before = alloc.available_size()
    assert insert(tree, alloc, make_req(), [1, 2, 3, 4, 5, 6], prev_prefix_len=5).prefix_len == 5
    assert alloc.available_size() == before - 6
    tree.sanity_check()


def test_diagnostics(capsys):
    tree, alloc, _, make_req = build_tree()
    insert(tree, alloc, make_req(), [1, 2, 3])
    diag = tree.available_and_evictable_str()
    assert "Available full tokens" in diag
    assert "mamba" in diag.lower()
    assert f"full_available_size={alloc.available_size()}" in diag
    tree.pretty_print()
    assert "kv_bytes" in capsys.readouterr().out
    tree.sanity_check()


# -- TestUnifiedRadixCacheSWAMamba, its Full + Mamba cases -----------------------------


def test_cache_finished_req_insert():
    tree, alloc, rtp, make_req = build_tree()
    req = make_req()
    req.origin_input_ids = [1, 2, 3, 4, 5]
    req.output_ids = [6, 7]
    own_row(rtp, alloc, req, 7)
    req.last_node = tree.root_node
    release_kv_cache(tree, req, checkpoint=True)
    assert hit(tree, [1, 2, 3, 4, 5, 6, 7]) == 7
    # The tree took the finished request's state slot; nothing leaked or doubled.
    assert req.kv.mamba_pool_idx is None
    assert tree.mamba_evictable_size() == 1
    tree.sanity_check()


def test_cache_finished_req_no_insert():
    tree, alloc, rtp, make_req = build_tree()
    req = make_req()
    req.origin_input_ids = [1, 2, 3]
    own_row(rtp, alloc, req, 3)
    req.last_node = tree.root_node
    before = alloc.available_size()
    slots = rtp.mamba_allocator.available_size()
    release_kv_cache(tree, req, checkpoint=False)
    assert alloc.available_size() == before + 3
    # on_release gave the request's Mamba slot back (SGLang's own cache does).
    assert req.kv.mamba_pool_idx is None
    assert rtp.mamba_allocator.available_size() == slots + 1
    assert hit(tree, [1, 2, 3]) == 0
    tree.sanity_check()


def test_cache_unfinished_req():
    """SGLang caches a running request's KV at each checkpoint and protects
    it (cache_protected_len 5). By design Marconi admits a request when it
    finishes: libmarconi pins only prefixes ending at a state, so KV cached
    mid-request would be evictable under the request's row. The request
    keeps its row and state; the finish caches them."""
    tree, alloc, rtp, make_req = build_tree()
    req = make_req()
    req.origin_input_ids = [1, 2, 3, 4, 5]
    req.fill_ids = req.origin_input_ids[:]
    own_row(rtp, alloc, req, 5)
    req.last_node = tree.root_node
    before = alloc.available_size()
    tree.cache_unfinished_req(req)
    assert req.cache_protected_len == 0
    assert req.kv.mamba_pool_idx is not None
    assert hit(tree, [1, 2, 3, 4, 5]) == 0
    assert alloc.available_size() == before
    release_kv_cache(tree, req, checkpoint=True)
    assert hit(tree, [1, 2, 3, 4, 5]) == 5
    assert alloc.available_size() == before  # the tree holds the 5 indices
    tree.sanity_check()


def test_evict_empty_tree():
    tree, _, _, _ = build_tree()
    result = tree.evict(EvictParams(num_tokens=10, mamba_num=5))
    assert result.num_tokens_evicted == 0
    assert result.mamba_num_evicted == 0
    tree.sanity_check()


def test_evict_until_empty():
    tree, alloc, rtp, make_req = build_tree()
    for i in range(5):
        insert(tree, alloc, make_req(), list(range(i * 10, i * 10 + 5)))
    assert tree.full_evictable_size() == 25
    result = tree.evict(EvictParams(num_tokens=100))
    assert result.num_tokens_evicted >= 25
    assert tree.full_evictable_size() == 0
    assert tree.mamba_evictable_size() == 0
    assert hit(tree, [0, 1, 2, 3, 4]) == 0
    assert alloc.available_size() == 128
    tree.sanity_check()


def test_match_cow_mamba():
    tree, alloc, rtp, make_req = build_tree()
    req1 = make_req()
    src = req1.mamba_pool_idx
    insert(tree, alloc, req1, [1, 2, 3, 4, 5])
    req2 = make_req()
    m = tree.match_prefix(MatchPrefixParams(key=RadixKey([1, 2, 3, 4, 5]), cow_mamba=True, req=req2))
    assert m.device_prefix_len == 5
    assert req2.mamba_pool_idx is not None and req2.mamba_pool_idx != src
    assert m.last_device_node.state_slot == src
    assert rtp.mamba_pool.state[req2.mamba_pool_idx] == rtp.mamba_pool.state[src] == 1000 + src
    tree.sanity_check()


# -- test_mamba_unittest ---------------------------------------------------------------


def test_mamba_radix_cache_1():
    tree, alloc, rtp, make_req = build_tree()
    insert(tree, alloc, make_req(), [1, 2, 3])
    insert(tree, alloc, make_req(), [1, 2, 3, 4, 5, 6, 7])
    insert(tree, alloc, make_req(), [10, 11, 12])
    insert(tree, alloc, make_req(), [1, 2, 3, 4, 5, 60, 70])
    assert tree.evict(EvictParams(num_tokens=1)).num_tokens_evicted >= 1
    assert tree.evict(EvictParams(num_tokens=0, mamba_num=1)).mamba_num_evicted >= 1
    # SGLang's LRU evicts the state of [1, 2, 3], so [1..5] misses there;
    # libmarconi's eviction is FLOP-aware and may keep that state (a hit of
    # 3), never invents one at 5 (no state was saved there).
    assert hit(tree, [1, 2, 3, 4, 5]) in (0, 3)
    # SGLang's LRU evicts [10, 11, 12] and then the state of [1, 2, 3], and
    # both 7-token leaves stay full hits. libmarconi's eviction is FLOP-aware:
    # here it takes the [6, 7] leaf first, so [1..7] resumes from the state
    # of [1, 2, 3]. Either way a hit is a position where a state was
    # inserted, and one 7-token leaf is still whole.
    hits = [hit(tree, [1, 2, 3, 4, 5, 60, 70]), hit(tree, [1, 2, 3, 4, 5, 6, 7])]
    assert all(h in (0, 3, 7) for h in hits) and 7 in hits
    before = sum(hits)
    assert tree.evict(EvictParams(num_tokens=0, mamba_num=1)).mamba_num_evicted >= 1
    req9 = make_req()
    m = tree.match_prefix(MatchPrefixParams(key=RadixKey([1, 2, 3, 4, 5, 6, 7]), req=req9, cow_mamba=True))
    if m.device_prefix_len:
        node = m.last_device_node
        assert rtp.mamba_pool.state[req9.mamba_pool_idx] == rtp.mamba_pool.state[node.state_slot]
    assert hit(tree, [1, 2, 3, 4, 5, 60, 70]) + hit(tree, [1, 2, 3, 4, 5, 6, 7]) < before
    assert "Available full tokens" in tree.available_and_evictable_str()
    tree.sanity_check()


# -- Marconi's own: the scheduler's path over SGLang's pools ----------------------------


def test_scheduler_cycle_frees_everything_it_was_given():
    """A multi-turn chat as SGLang's scheduler runs it (match with
    copy-on-write, lock, a chunk's checkpoint, the finish's checkpoint and
    release): every turn resumes from the previous turn's state, and after
    eviction of everything every KV index and Mamba slot is back in SGLang's
    allocators, none freed twice (the stand-ins refuse a double or foreign free)."""
    tree, alloc, rtp, make_req = build_tree(kv_size=256, mamba_cache_size=12)
    history = list(range(500, 520))
    for turn in range(6):
        req = make_req()
        own_slot = req.mamba_pool_idx
        req.origin_input_ids = history + [turn, turn + 1, turn + 2]
        m = tree.match_prefix(MatchPrefixParams(key=RadixKey(req.origin_input_ids), cow_mamba=True, req=req))
        req.last_node, req.prefix_len = m.last_device_node, m.device_prefix_len
        req.lock = tree.lock(req.last_node)
        assert req.prefix_len == (len(history) if turn else 0)
        if turn:  # the cached state was copied into the request's own slot
            assert rtp.mamba_pool.state[own_slot] == rtp.mamba_pool.state[m.last_device_node.state_slot]
        prefix = list(tree.prefix_device_indices(req))
        req.output_ids = [7, 8]
        n = len(req.origin_input_ids) + 2
        row = rtp.req_to_token[req.req_pool_idx]
        row[: req.prefix_len] = prefix
        row[req.prefix_len : n] = alloc.alloc(n - req.prefix_len)
        req.kv.cache_protected_len = req.prefix_len
        tree.checkpoint(req, up_to=len(req.origin_input_ids))  # a chunk's end
        tree.evict(EvictParams(num_tokens=10_000))  # the running request's prefix is locked
        assert list(tree.prefix_device_indices(req)) == prefix
        if req.prefix_len:  # still cached: the lock held it through the eviction
            assert hit(tree, req.origin_input_ids[: req.prefix_len]) == req.prefix_len
        release_kv_cache(tree, req, checkpoint=True)
        rtp.free(req)
        history = req.origin_input_ids + req.output_ids
        tree.sanity_check()
    assert tree.protected_size() == 0
    tree.evict(EvictParams(num_tokens=10_000, mamba_num=100))
    assert alloc.available_size() == 256
    assert rtp.mamba_allocator.available_size() == 12


def test_rejects_a_node_it_did_not_make():
    tree, alloc, _, make_req = build_tree()
    with pytest.raises(TypeError):
        tree.inc_lock_ref(object())
    insert(tree, alloc, make_req(), [1, 2, 3])
    node = tree.match_prefix(MatchPrefixParams(key=RadixKey([1, 2, 3]))).last_device_node
    with pytest.raises(ValueError, match="without inc_lock_ref"):
        tree.dec_lock_ref(node)


def test_needs_a_mamba_pool():
    class Plain:
        req_to_token = [[0] * 8]

    with pytest.raises(ValueError, match="mamba"):
        MarconiPrefixCache(CacheInitParams(req_to_token_pool=Plain(), token_to_kv_pool_allocator=FreeList(8, "kv")))


def test_cow_is_deferred_to_the_batch_as_sglangs():
    """With SGLang's ReqKvInfo fields, the copy is left to the batch
    (mamba_cow_src_index), as SGLang's Mamba component does."""
    tree, alloc, rtp, make_req = build_tree()
    req1 = make_req()
    src = req1.mamba_pool_idx
    insert(tree, alloc, req1, [1, 2, 3, 4])
    req2 = Req()
    req2.kv.mamba_cow_src_index = None
    req2.kv.mamba_needs_clear = True
    m = tree.match_prefix(MatchPrefixParams(key=RadixKey([1, 2, 3, 4, 5]), cow_mamba=True, req=req2))
    assert m.device_prefix_len == 4
    assert req2.kv.mamba_cow_src_index == [src]
    assert req2.kv.mamba_needs_clear is False
    assert req2.mamba_pool_idx is not None and req2.mamba_pool_idx != src


def test_no_slot_for_the_copy_is_a_miss():
    """A hit the request cannot hold a state copy for is a miss, never a
    hit over a state it does not have; a state is evicted to make room
    first, but not the matched node's."""
    tree, alloc, rtp, make_req = build_tree(mamba_cache_size=2)
    insert(tree, alloc, make_req(), [1, 2, 3])
    insert(tree, alloc, make_req(), [7, 8, 9])
    assert rtp.mamba_allocator.available_size() == 0
    req = Req()
    m = tree.match_prefix(MatchPrefixParams(key=RadixKey([1, 2, 3, 4]), cow_mamba=True, req=req))
    # [7, 8, 9]'s state made room: a hit with the request's own copy.
    assert m.device_prefix_len == 3 and req.mamba_pool_idx is not None
    assert hit(tree, [7, 8, 9]) == 0
    req2 = Req()  # now no state but the locked-for-copy one is left to evict
    tree.inc_lock_ref(m.last_device_node)
    m2 = tree.match_prefix(MatchPrefixParams(key=RadixKey([1, 2, 3, 4]), cow_mamba=True, req=req2))
    assert m2.device_prefix_len == 0 and req2.mamba_pool_idx is None
    assert m2.last_device_node is tree.root_node
    tree.dec_lock_ref(m.last_device_node)
    tree.sanity_check()


# -- the request path (ours): int64 keys, one lookup per match + lock ---------


def test_match_then_lock_is_one_lookup():
    """The lock right after a match pins with the match's lease: one library
    lookup for both. A lock after an insert (the match's lease released
    before the admission) looks up again and still pins the whole prefix."""
    from array import array

    tree, alloc, rtp, make_req = build_tree()
    req = make_req()
    kv = alloc.alloc(5)
    tree.insert(InsertParams(key=RadixKey([1, 2, 3, 4, 5]), value=kv, mamba_value=[req.mamba_pool_idx]))
    before = tree.cache.stats()["requests"]
    m = tree.match_prefix(MatchPrefixParams(key=RadixKey(array("q", [1, 2, 3, 4, 5, 6]))))
    assert m.device_prefix_len == 5
    lock = tree.lock(m.last_device_node)
    assert tree.cache.stats()["requests"] == before + 1
    assert tree.cache.stats()["leases"] == 1
    assert tree.protected_size() == 5
    tree.unlock(lock)
    assert tree.cache.stats()["leases"] == 0
    # Matched, then an insert in between: the match's lease is gone, the lock looks up again.
    m = tree.match_prefix(MatchPrefixParams(key=RadixKey([1, 2, 3, 4, 5])))
    req2 = make_req()
    insert(tree, alloc, req2, [9, 8, 7])
    assert tree.cache.stats()["leases"] == 0
    lock = tree.lock(m.last_device_node)
    assert tree.cache.stats()["leases"] == 1 and tree.protected_size() == 5
    assert list(tree.path_device_indices(m.last_device_node)) == list(kv)
    tree.unlock(lock)
    # Matches that are never locked keep at most a bounded number of leases.
    for _ in range(3 * SGLangTreeCache._MAX_PENDING):
        tree.match_prefix(MatchPrefixParams(key=RadixKey([1, 2, 3, 4, 5])))
    assert tree.cache.stats()["leases"] <= SGLangTreeCache._MAX_PENDING
    tree.evict(EvictParams(num_tokens=128, mamba_num=0))
    assert tree.cache.stats()["leases"] == 0
    tree.sanity_check()


def test_match_reads_the_key_in_place_and_lists_pages_when_asked():
    """match_prefix looks the key up in place (the key's own array, no copy
    with an end marker) and may hit all of it; its lease lists no page ids
    until path_device_indices asks, and then the ones inserted."""
    from array import array

    tree, alloc, rtp, make_req = build_tree()
    req = make_req()
    kv = alloc.alloc(5)
    tree.insert(InsertParams(key=RadixKey([1, 2, 3, 4, 5]), value=kv, mamba_value=[req.mamba_pool_idx]))
    seen = []
    real = tree.cache._lookup_prefix

    def spy(ids, n, ns, flags):
        found = real(ids, n, ns, flags)
        seen.append((ids, n, found[4]))
        return found

    tree.cache._lookup_prefix = spy
    key = array("q", [1, 2, 3, 4, 5])
    m = tree.match_prefix(MatchPrefixParams(key=RadixKey(key)))
    assert m.device_prefix_len == 5
    assert len(seen) == 1 and seen[0][0] is key and seen[0][1] == 5
    assert seen[0][2] == 0  # no page list copied at the lookup
    assert list(tree.path_device_indices(m.last_device_node)) == list(kv)
    lock = tree.lock(m.last_device_node)
    assert len(seen) == 1 and tree.protected_size() == 5
    tree.unlock(lock)
    # A longer key: the hit is the cached prefix, still read in place.
    longer = array("q", [1, 2, 3, 4, 5, 6, 7])
    assert tree.match_prefix(MatchPrefixParams(key=RadixKey(longer))).device_prefix_len == 5
    assert seen[-1][0] is longer and seen[-1][1] == 7
    del tree.cache._lookup_prefix
    tree.evict(EvictParams(num_tokens=128, mamba_num=0))
    assert tree.cache.stats()["leases"] == 0
    tree.sanity_check()


def test_insert_admits_under_the_match_lease():
    """An insert whose key starts with the key its request matched admits
    under the match's lease (one library lookup per match + insert; the
    lease released once), under a lock's lease (kept for the unlock), and
    a lease that looked up another key is refused by the library (prefix
    check) and replaced by the insert's own lookup, the result the same."""
    from array import array

    tree, alloc, rtp, make_req = build_tree(kv_size=256)
    req = make_req()
    kv = alloc.alloc(5)
    tree.insert(InsertParams(key=RadixKey([1, 2, 3, 4, 5]), value=kv, mamba_value=[req.mamba_pool_idx]))
    requests = lambda: tree.cache.stats()["requests"]  # noqa: E731
    # Match then insert: one lookup, the lease released by the insert.
    before = requests()
    m = tree.match_prefix(MatchPrefixParams(key=RadixKey(array("q", [1, 2, 3, 4, 5, 6]))))
    assert m.device_prefix_len == 5
    req2 = make_req()
    r = insert(tree, alloc, req2, array("q", [1, 2, 3, 4, 5, 6, 7, 8]), prev_prefix_len=0)
    assert (r.prefix_len, requests(), tree.cache.stats()["leases"]) == (5, before + 1, 0)
    assert hit(tree, [1, 2, 3, 4, 5, 6, 7, 8]) == 8
    # Match, lock, insert: the lock's lease admits and stays until the unlock.
    m = tree.match_prefix(MatchPrefixParams(key=RadixKey([1, 2, 3, 4, 5, 6, 7, 8, 9])))
    lock = tree.lock(m.last_device_node)
    before = requests()
    r = insert(tree, alloc, make_req(), [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], prev_prefix_len=0)
    assert (r.prefix_len, requests(), tree.cache.stats()["leases"]) == (8, before, 1)
    tree.unlock(lock)
    assert tree.cache.stats()["leases"] == 0
    # The same ends but another middle: refused under the match's lease,
    # admitted after a lookup of its own; nothing pinned afterwards.
    tree.match_prefix(MatchPrefixParams(key=RadixKey([1, 2, 3, 4, 5])))
    refused = []
    real = tree.cache._admit_i64

    def spy(*a):
        try:
            return real(*a)
        except Exception as e:
            refused.append(e.name)
            raise

    tree.cache._admit_i64 = spy
    before = requests()
    r = insert(tree, alloc, make_req(), [1, 9, 9, 9, 5, 6], prev_prefix_len=0)
    del tree.cache._admit_i64
    assert refused == ["PREFIX_MISMATCH"]
    assert (r.prefix_len, tree.cache.stats()["leases"]) == (1, 0)
    assert requests() > before  # its own lookup
    assert hit(tree, [1, 9, 9, 9, 5, 6]) == 6
    assert hit(tree, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]) == 10
    tree.sanity_check()


def test_int64_keys_match_list_keys_and_bad_ids_are_refused():
    """array('q') keys (as SGLang 0.5.23 holds them) and lists give the same
    hits; an id that is not a uint32 is refused by name, nothing cached."""
    from array import array

    from marconi import MarconiError

    tree, alloc, rtp, make_req = build_tree()
    req = make_req()
    key = array("q", [5, 6, 7, 8])
    tree.insert(InsertParams(key=RadixKey(key), value=alloc.alloc(4), mamba_value=[req.mamba_pool_idx]))
    assert hit(tree, [5, 6, 7, 8]) == 4
    assert hit(tree, array("q", [5, 6, 7, 8, 9])) == 4
    assert hit(tree, array("q", [5, 6, 7])) == 0
    nodes = tree.cache.stats()["nodes"]
    with pytest.raises(MarconiError, match=r"tokens\[1\] = -3"):
        hit(tree, array("q", [5, -3, 7]))
    req2 = make_req()
    with pytest.raises(MarconiError, match=r"tokens\[2\] = 4294967296"):
        tree.insert(
            InsertParams(key=RadixKey(array("q", [1, 2, 1 << 32])), value=alloc.alloc(3), mamba_value=[req2.mamba_pool_idx])
        )
    with pytest.raises(MarconiError, match=r"tokens\[1\] = -3"):
        hit(tree, [5, -3, 7])
    assert tree.cache.stats()["nodes"] == nodes
    assert tree.cache.stats()["leases"] <= 1  # at most the match kept for a lock
    tree.sanity_check()


def test_page_size_2_caches_whole_pages_and_gives_them_back():
    """Pages of 2 tokens: a key is cached up to its last full page, the
    path's indices are the inserted ones (pages in the order given), a
    longer key hits at the page boundary, and eviction gives every index of
    every cached page back to the allocator."""
    tree, alloc, rtp, make_req = build_tree(kv_size=16, page_size=2)
    every = alloc.alloc(16)  # indices 1..16 (0 is SGLang's padding slot)
    alloc.free([i for i in every if i > 8])
    req = make_req()
    value = [2, 3, 6, 7, 4, 5, 8]  # pages 1, 3, 2 (index // 2, aligned as SGLang's paged allocator gives them), then half a page
    r = tree.insert(InsertParams(key=RadixKey([11, 12, 13, 14, 15, 16, 17]), value=value, mamba_value=[req.mamba_pool_idx]))
    assert (r.prefix_len, r.total_len, r.mamba_exist) == (0, 6, False)
    m = tree.match_prefix(MatchPrefixParams(key=RadixKey([11, 12, 13, 14, 15, 16, 17, 18])))
    assert m.device_prefix_len == 6
    assert list(tree.path_device_indices(m.last_device_node)) == value[:6]
    assert hit(tree, [11, 12, 13, 14, 15]) == 0  # no state at 4
    assert tree.total_size() == (6, 1)
    tree.sanity_check()
    free_before = alloc.available_size()
    res = tree.evict(EvictParams(num_tokens=16, mamba_num=1))
    assert (res.num_tokens_evicted, res.mamba_num_evicted) == (6, 1)
    assert alloc.available_size() == free_before + 6
    assert sorted(alloc._free[-6:]) == sorted(value[:6])
    assert tree.total_size() == (0, 0)


def test_two_locks_on_separate_prefixes_protect_both():
    """Two requests lock separate cached prefixes of 100 and 60 tokens:
    160 tokens and 2 states are protected, none evictable (SGLang's
    accounting), and eviction then frees nothing. The sizes counted only
    the largest locked prefix (60 evictable / 100 protected)."""
    tree, alloc, rtp, make_req = build_tree(kv_size=512, mamba_cache_size=20)
    a, b = list(range(1, 101)), list(range(1000, 1060))
    insert(tree, alloc, make_req(), a)
    insert(tree, alloc, make_req(), b)
    la = tree.lock(tree.match_prefix(MatchPrefixParams(key=RadixKey(a))).last_device_node)
    lb = tree.lock(tree.match_prefix(MatchPrefixParams(key=RadixKey(b))).last_device_node)
    assert (tree.full_evictable_size(), tree.full_protected_size()) == (0, 160)
    assert (tree.mamba_evictable_size(), tree.mamba_protected_size()) == (0, 2)
    r = tree.evict(EvictParams(num_tokens=60, mamba_num=1))
    assert (r.num_tokens_evicted, r.mamba_num_evicted) == (0, 0)
    tree.unlock(la)
    assert (tree.full_evictable_size(), tree.full_protected_size()) == (100, 60)
    tree.unlock(lb)
    assert (tree.full_evictable_size(), tree.full_protected_size()) == (160, 0)
    tree.sanity_check()


@pytest.mark.parametrize("seed", range(6))
def test_sizes_are_the_union_of_the_locked_paths(seed):
    """Property: under any set of locks (random prefixes of a random tree of
    conversations, some locked twice, locks dropped in random order), the
    protected KV is the number of distinct token positions on the locked
    paths, the protected states the distinct states on them, evictable +
    protected + free is each pool's size, and evicting everything frees
    exactly the evictable sizes."""
    import random

    rng = random.Random(seed)
    tree, alloc, rtp, make_req = build_tree(kv_size=4096, max_num_reqs=64, mamba_cache_size=64, max_context_len=512)
    roots = [[rng.randrange(1, 50_000) for _ in range(rng.randrange(5, 40))] for _ in range(3)]
    seqs = []
    for _ in range(14):
        base = rng.choice(roots + seqs) if seqs else rng.choice(roots)
        cut = rng.randrange(1, len(base) + 1)
        seq = base[:cut] + [rng.randrange(1, 50_000) for _ in range(rng.randrange(3, 30))]
        req = make_req()
        m = tree.match_prefix(MatchPrefixParams(key=RadixKey(seq)))
        k = m.device_prefix_len
        value = list(tree.path_device_indices(m.last_device_node))[:k] + alloc.alloc(len(seq) - k)
        r = tree.insert(InsertParams(key=RadixKey(seq), value=value, mamba_value=[req.mamba_pool_idx], prev_prefix_len=k))
        if r.mamba_exist:
            rtp.mamba_allocator.free([req.mamba_pool_idx])
        seqs.append(seq)
    locks = []
    for _ in range(rng.randrange(1, 9)):
        m = tree.match_prefix(MatchPrefixParams(key=RadixKey(rng.choice(seqs))))
        if m.device_prefix_len:
            locks.append((tree.lock(m.last_device_node), m.last_device_node))
    kv_total, states_total = tree.total_size()

    def check():
        paths = [node.key[: node.hit_tokens].tolist() for _, node in locks]
        positions = {tuple(p[: i + 1]) for p in paths for i in range(len(p))}
        # A state sits at the end of every inserted sequence still cached: on a
        # locked path where an inserted sequence is a prefix of it.
        state_ends = {tuple(s) for s in seqs if hit(tree, s) == len(s)}
        states = {e for e in state_ends if e in positions}
        assert tree.full_protected_size() == len(positions)
        assert tree.full_evictable_size() == kv_total - len(positions)
        assert tree.mamba_protected_size() == len(states)
        assert tree.mamba_evictable_size() == states_total - len(states)

    check()
    rng.shuffle(locks)
    while locks:
        lk, _ = locks.pop()
        tree.unlock(lk)
        check()
    assert tree.full_protected_size() == 0 and tree.mamba_protected_size() == 0
    tree.sanity_check()


def test_factory_builds_the_cache_for_the_served_model(caplog):
    """SGLang's build context carries the served model's config
    (ctx.model_config.hf_config): the cache's byte sizes are that model's,
    as libmarconi's config reader gives them. Without a readable config the
    factory falls back to the preset and says so in the log."""
    import json
    from types import SimpleNamespace

    import marconi
    from marconi.adapter import FALLBACK_MODEL, sglang_factory

    tiny = {
        "model_type": "nemotron_h", "hidden_size": 64, "hybrid_override_pattern": "M-M*-",
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128,
        "mlp_hidden_act": "relu2", "mamba_num_heads": 8, "mamba_head_dim": 16, "ssm_state_size": 16,
        "n_groups": 2, "conv_kernel": 4, "torch_dtype": "float32",
    }

    class HFConfig:  # what a transformers PretrainedConfig offers
        def __init__(self, fields):
            self.fields = fields

        def to_json_string(self):
            return json.dumps(self.fields)

    def ctx(hf):
        rtp = HybridReqToTokenPool(4, 8, 64)
        params = CacheInitParams(req_to_token_pool=rtp, token_to_kv_pool_allocator=FreeList(256, "KV"), page_size=1)
        return SimpleNamespace(params=params, is_hybrid_ssm=True, model_config=SimpleNamespace(hf_config=hf))

    tree = sglang_factory(ctx(HFConfig(tiny)))
    want = marconi.PrefixCache(1 << 30, model=marconi.ModelSpec.from_hf_config(tiny)).stats()
    got = tree.cache.stats()
    assert (got["kv_bytes_per_token"], got["state_bytes_per_entry"]) == (
        want["kv_bytes_per_token"], want["state_bytes_per_entry"])
    assert not caplog.records
    with caplog.at_level("WARNING", logger="marconi"):
        tree = sglang_factory(ctx(HFConfig({"model_type": "llama"})))
    preset = marconi.PrefixCache(1 << 30, model=FALLBACK_MODEL).stats()
    assert tree.cache.stats()["kv_bytes_per_token"] == preset["kv_bytes_per_token"]
    assert any(FALLBACK_MODEL in r.getMessage() and "unsupported model_type" in r.getMessage() for r in caplog.records)
