"""The event stream against a consumer written from vLLM's published schema
(docs/events.md): msgspec structs as vLLM declares them, block hashes
recomputed with vLLM's sha256_cbor (cbor2 + hashlib), and the cached set
rebuilt from the stream checked against the cache after a replay with
evictions; then over loopback ZeroMQ (the library's publisher, gaps repaired
by replay; and an engine publishing drained batches itself)."""


import hashlib
import os
import random
from typing import Any

import pytest

import marconi

STRICT = os.environ.get("MARCONI_EVENTS_STRICT") == "1"
"""Set by ci/test.d/events.sh: missing modules or publisher fail, not skip."""


def _need(mod: str):
    if STRICT:
        return __import__(mod)
    return pytest.importorskip(mod)


msgspec = _need("msgspec")
cbor2 = _need("cbor2")


# -- vLLM's schema (vllm/distributed/kv_events.py), both layouts ------------


def vllm_structs(array_like: bool):
    class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list[Any]
        data_parallel_rank: int | None = None

    class KVCacheEvent(msgspec.Struct, array_like=array_like, omit_defaults=True, gc=False, tag=True):
        pass

    class BlockStored(KVCacheEvent):
        block_hashes: list[int | bytes]
        parent_block_hash: int | bytes | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None
        extra_keys: list[tuple[Any, ...] | None] | None = None
        group_idx: int | None = None
        kv_cache_spec_kind: str | None = None
        kv_cache_spec_sliding_window: int | None = None

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[int | bytes]
        medium: str | None
        group_idx: int | None = None

    class AllBlocksCleared(KVCacheEvent):
        pass

    class KVEventBatch(EventBatch):
        events: list[BlockStored | BlockRemoved | AllBlocksCleared]

    return KVEventBatch, BlockStored, BlockRemoved, AllBlocksCleared


# -- vLLM's sha256_cbor chained hashes --------------------------------------


def sha256_cbor(x) -> bytes:
    return hashlib.sha256(cbor2.dumps(x, canonical=True)).digest()


NONE_HASH = sha256_cbor("vllm-none-hash")


def as_int(h) -> int:
    return int.from_bytes(h, "big") & (2**64 - 1) if isinstance(h, bytes) else h


class Consumer:
    """Rebuilds the cached set from decoded batches and recomputes every
    stored hash from its tokens and parent (vLLM's hash_block_tokens)."""

    def __init__(self, array_like: bool, namespaces: str = "cache_salt"):
        self.array_like = array_like
        self.namespaces = namespaces
        self.Batch, self.Stored, self.Removed, self.Cleared = vllm_structs(array_like)
        self.decoder = msgspec.msgpack.Decoder(type=self.Batch)
        self.set: set[tuple[int, int]] = set()
        self.digest: dict[int, bytes] = {}  # int hash -> full digest, learned by recomputation
        self.verified = 0

    def recompute(self, ev) -> None:
        bs = ev.block_size
        if ev.parent_block_hash is None:
            parent = NONE_HASH
        else:
            parent = self.digest[as_int(ev.parent_block_hash)]
        ns_keys = ev.extra_keys or [None] * len(ev.block_hashes)
        if ev.group_idx == 1:  # a state: the chain continued over its block's tokens
            assert len(ev.block_hashes) == 1 and 1 <= len(ev.token_ids) <= bs
            blocks = [ev.token_ids]
        else:
            assert len(ev.token_ids) == bs * len(ev.block_hashes)
            blocks = [ev.token_ids[i * bs:(i + 1) * bs] for i in range(len(ev.block_hashes))]
        for h, toks, extra in zip(ev.block_hashes, blocks, ns_keys):
            d = sha256_cbor((parent, tuple(toks), self.hash_keys(extra)))
            if isinstance(h, bytes):
                assert h == d
            else:
                assert h == int.from_bytes(d, "big") & (2**64 - 1)
            self.digest[as_int(h)] = d
            self.verified += 1
            parent = d

    def hash_keys(self, extra):
        """A block's hashed extra keys from its published ones: vLLM tags
        a cache salt ("cache_salt", salt) and a LoRA adapter ("lora", name,
        path); libmarconi's LoRA namespaces have an empty path."""
        if extra is None:
            return None
        if self.namespaces == "cache_salt":
            return tuple(("cache_salt", k) for k in extra)
        if self.namespaces == "lora":
            return tuple(("lora", k, "") for k in extra)
        return tuple(extra)

    def apply(self, payload: bytes) -> None:
        batch = self.decoder.decode(payload)
        for ev in batch.events:
            if isinstance(ev, self.Cleared):
                self.set.clear()
            elif isinstance(ev, self.Stored):
                assert ev.kv_cache_spec_kind == ("mamba" if ev.group_idx == 1 else "full_attention")
                self.recompute(ev)
                self.set.update((ev.group_idx, as_int(h)) for h in ev.block_hashes)
            else:
                for h in ev.block_hashes:
                    assert (ev.group_idx, as_int(h)) in self.set, "removed before stored"
                    self.set.remove((ev.group_idx, as_int(h)))


def workload(seed: int, n: int):
    rng = random.Random(seed)
    systems = [[1000 * (s + 1) + i for i in range(40)] for s in range(3)]
    sessions: list[tuple[int, list[int]]] = []
    for _ in range(n):
        if not sessions or rng.random() < 0.3:
            ns, ctx = (7 if rng.random() < 0.25 else 0), list(rng.choice(systems))
        else:
            ns, ctx = rng.choice(sessions)
            ctx = list(ctx)
        ctx += [rng.randrange(50_000) for _ in range(rng.randrange(5, 45))]
        out = [rng.randrange(50_000) for _ in range(rng.randrange(1, 30))]
        sessions.append((ns, ctx + out))
        if len(sessions) > 12:
            sessions.pop(rng.randrange(12))
        yield ns, ctx, out


def small_cache(page: int) -> marconi.PrefixCache:
    probe = marconi.PrefixCache(capacity_bytes=1 << 40, model="paper-7b")
    st = probe.stats()
    probe.close()
    cap = 600 * st["kv_bytes_per_token"] + 6 * st["state_bytes_per_entry"]
    return marconi.PrefixCache(capacity_bytes=cap, model="paper-7b", page_size=page, alpha=1.0)


def check_against_cache(cache, ev, consumer: Consumer) -> None:
    """The rebuilt set equals the cache's content: the snapshot batch
    (derived from the tree, not from the stream), and the cache's own byte
    counters (cached tokens = KV blocks x page size; states)."""
    snap = Consumer(consumer.array_like, consumer.namespaces)
    snap.apply(ev.snapshot(ts=0.0))
    assert consumer.set == snap.set
    st = cache.stats()
    kv = sum(1 for g, _ in consumer.set if g == 0)
    assert kv * cache.page_size * st["kv_bytes_per_token"] == st["kv_bytes"]
    assert sum(1 for g, _ in consumer.set if g == 1) == st["states"]


@pytest.mark.parametrize("layout", ["map", "array"])
@pytest.mark.parametrize("hash_format", ["int", "bytes"])
@pytest.mark.parametrize("page", [1, 4])
@pytest.mark.parametrize("namespaces", ["cache_salt", "lora", "extra_keys"])
def test_drained_stream_rebuilds_the_cached_set_after_evictions(layout, hash_format, page, namespaces):
    cache = small_cache(page)
    ev = marconi.CacheEvents(cache, layout=layout, hash_format=hash_format, namespaces=namespaces)
    consumer = Consumer(array_like=(layout == "array"), namespaces=namespaces)
    for i, (ns, ctx, out) in enumerate(workload(page, 250)):
        cache.serve(ctx, out, namespace=ns)
        payload = ev.drain(ts=float(i))
        if payload:
            consumer.apply(payload)
        if i % 25 == 0:
            check_against_cache(cache, ev, consumer)
    check_against_cache(cache, ev, consumer)
    assert cache.stats()["evictions"] > 50
    assert consumer.verified > 100
    assert ev.drain() == b""
    ev.close()
    cache.close()


def test_warm_cache_and_misuse():
    cache = small_cache(4)
    for ns, ctx, out in workload(3, 60):
        cache.serve(ctx, out, namespace=ns)
    with marconi.CacheEvents(cache) as ev:
        consumer = Consumer(array_like=False)
        consumer.set.add((0, 12345))  # stale view, dropped by AllBlocksCleared
        consumer.apply(ev.drain())
        check_against_cache(cache, ev, consumer)
        with pytest.raises(ValueError):
            ev.drain(ts=float("nan"))
        if not marconi.has_publisher():
            with pytest.raises(marconi.MarconiError):
                ev.publish()
    with pytest.raises(ValueError):
        ev.drain()
    with pytest.raises(marconi.MarconiError):
        marconi.CacheEvents(cache, endpoint="nonsense://x")
    with pytest.raises(ValueError):
        marconi.CacheEvents(cache, namespaces="tenant")
    cache.close()
    with pytest.raises(ValueError):
        marconi.CacheEvents(cache)
