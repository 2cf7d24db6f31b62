"""libmarconi inside vLLM's offloading connector (docs/vllm.md).

vLLM 0.33's `OffloadingConnector` keeps a host (CPU) tier of chunks, one
per KV-cache group and chunk position: for a hybrid model in Mamba align
mode, an attention KV chunk and a Mamba state chunk at every position. Which
chunk the tier drops when it is full is decided by a `CachePolicy` that the
configuration names:

    --kv-transfer-config '{"kv_connector": "OffloadingConnector",
      "kv_role": "kv_both",
      "kv_connector_extra_config": {"cpu_bytes_to_use": 8000000000,
        "eviction_policy": "MarconiCachePolicy",
        "cache_policy_module_path": "marconi.vllm",
        "marconi_model": "/models/my-hybrid/config.json"}}'

`MarconiCachePolicy` mirrors the host tier in a libmarconi prefix cache
(marconi.PrefixCache, the library's core over the C ABI): every request's
chunk keys, in prefix order, become one path of the mirror's tree, the
attention chunks its KV pages and the Mamba chunks its states. libmarconi
decides which states are worth keeping (its admission: branch points and
the ends of requests, where later requests resume) and, when vLLM asks for
room, what to drop (its FLOP-aware eviction, leaves first). Chunks the
mirror does not hold (states it did not admit, chunks it evicted) go first.

`MarconiStoreTier` is a secondary tier below that CPU tier (vLLM's
`TieringOffloadingSpec`, `"secondary_tiers": [{"type": "MarconiStoreTier",
"module_path": "marconi.vllm", "backend": "dir" or "redis", "location": ...}]`):
chunks in libmarconi's store (marconi.Store), shared by every process of
the same model, hashing and seed; a store fault is a miss.

vLLM is imported only when a class of this module is first used:
`import marconi` and `import marconi.vllm` work without it.
"""

from __future__ import annotations

import array
import logging
import os
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional

from .cache import MarconiError, PrefixCache
from .model import ModelSpec

__all__ = ["MarconiCachePolicy", "MarconiStoreTier", "MODEL_KEY", "STATE_GROUPS_KEY", "load_model_spec"]

logger = logging.getLogger(__name__)

MODEL_KEY = "marconi_model"
"""kv_connector_extra_config key naming the model: a libmarconi preset
("paper-7b", "nemotron-h-8b", ...) or the served model's config.json (or
its directory)."""

STATE_GROUPS_KEY = "marconi_state_groups"
"""Optional kv_connector_extra_config key: the KV-cache group indices that
hold recurrent (Mamba) state. Default: the groups vLLM offloads with a
window of one chunk (vLLM gives Mamba groups that window)."""

_U32 = 0xFFFF_FFFF


def load_model_spec(value: Any) -> ModelSpec:
    """The model of `kv_connector_extra_config["marconi_model"]`: a preset
    name, a config.json path (or a directory holding one), or a dict of
    marconi_model_spec fields. Raises ValueError naming the key when it is
    missing or unreadable (libmarconi's utility needs the model's sizes;
    vLLM does not pass them to a policy, and a guess would mis-rank)."""
    if value is None:
        raise ValueError(
            f"MarconiCachePolicy needs kv_connector_extra_config[{MODEL_KEY!r}]: a libmarconi "
            "model preset (e.g. 'paper-7b', 'nemotron-h-8b') or the served model's config.json path"
        )
    if isinstance(value, Mapping):
        return ModelSpec(dict(value))
    if not isinstance(value, (str, os.PathLike)):
        raise ValueError(f"kv_connector_extra_config[{MODEL_KEY!r}]: expected a preset name or a path, got {value!r}")
    text = os.fspath(value)
    path = Path(text)
    if path.is_dir():
        path = path / "config.json"
    if path.suffix == ".json" or os.sep in text or path.exists():
        try:
            return ModelSpec.from_hf_config(path)
        except (OSError, MarconiError) as e:
            raise ValueError(f"kv_connector_extra_config[{MODEL_KEY!r}] = {text!r}: {e}") from e
    try:
        return ModelSpec.preset(text)
    except MarconiError as e:
        raise ValueError(
            f"kv_connector_extra_config[{MODEL_KEY!r}] = {text!r} is neither a libmarconi model "
            f"preset nor a config.json path: {e}"
        ) from e


def _offloading_spec_from_caller() -> Optional[Any]:
    """The vLLM OffloadingSpec whose manager is constructing this policy.

    vLLM's CPUOffloadingManager builds its policy as `cls(cache_capacity=n)`
    and passes nothing else; the spec that called it (CPUOffloadingSpec.
    get_manager; TieringOffloadingSpec, its subclass, builds its primary
    tier's manager the same way, not tested here) holds
    kv_connector_extra_config and the groups. The caller frames are read,
    not changed; at most 16 are looked at."""
    frame = sys._getframe(2)
    for _ in range(16):
        if frame is None:
            return None
        obj = frame.f_locals.get("self")
        if obj is not None and hasattr(obj, "extra_config") and hasattr(getattr(obj, "config", None), "groups"):
            return obj
        frame = frame.f_back
    return None


def _chunk_tokens(block_hash: bytes, tokens_per_chunk: int) -> "array.array[int]":
    """The mirror's token ids for one chunk: its block hash (chained over the
    whole prefix by vLLM, so equal hashes mean equal prefixes) as uint32
    words, repeated to the chunk's length."""
    h = bytes(block_hash)
    if len(h) % 4:
        h += b"\0" * (4 - len(h) % 4)
    if not h:
        h = b"\0\0\0\0"
    n = tokens_per_chunk * 4
    data = (h * (n // len(h) + 1))[:n]
    out = array.array("I")
    out.frombytes(data)
    return out


def _build_classes() -> dict:
    from vllm.v1.kv_offload.base import get_offload_block_hash
    from vllm.v1.kv_offload.cpu.policies.base import CachePolicy

    class MarconiCachePolicy(CachePolicy):
        """vLLM CachePolicy whose eviction decisions come from libmarconi.

        Built by vLLM as `MarconiCachePolicy(cache_capacity=num_chunks)`;
        the model, the Mamba groups and the chunk size are read from the
        OffloadingSpec constructing it (kv_connector_extra_config
        ["marconi_model"], the spec's groups). Direct construction (tests,
        other managers) passes them as keyword arguments.

        State: `_chunks` (every resident chunk, as vLLM's LRU keeps it),
        `_idle` (ref_cnt 0), `_pool` (resident chunks the mirror does not
        hold, oldest first: the first candidates), and the ids the mirror
        holds (`_page_keys`, `_slot_keys`). `evict` keeps vLLM's contract:
        exactly n idle chunks outside `protected`, or None with the
        resident set unchanged."""

        def __init__(
            self,
            cache_capacity: int,
            *,
            model: Any = None,
            state_groups: Optional[Iterable[int]] = None,
            tokens_per_chunk: Optional[int] = None,
        ) -> None:
            super().__init__(cache_capacity)
            if model is None:
                spec = _offloading_spec_from_caller()
                if spec is None:
                    raise ValueError(
                        "MarconiCachePolicy: no model given and no vLLM OffloadingSpec found among "
                        f"the callers; set kv_connector_extra_config[{MODEL_KEY!r}] (vLLM) or pass model="
                    )
                extra = spec.extra_config
                model = load_model_spec(extra.get(MODEL_KEY))
                groups = spec.config.groups
                sizes = {g.tokens_per_block * spec.blocks_per_chunk for g in groups}
                if len(sizes) != 1:
                    raise ValueError(
                        f"MarconiCachePolicy needs one chunk size across the offloaded groups, got {sorted(sizes)}"
                    )
                tokens_per_chunk = sizes.pop()
                if extra.get(STATE_GROUPS_KEY) is not None:
                    state_groups = extra[STATE_GROUPS_KEY]
                else:
                    state_groups = [g.group_id for g in groups if g.sliding_window_size_in_chunks == 1]
            else:
                model = load_model_spec(model) if not isinstance(model, ModelSpec) else model
            if tokens_per_chunk is None or int(tokens_per_chunk) <= 0:
                raise ValueError(f"tokens_per_chunk: expected a positive chunk size, got {tokens_per_chunk!r}")
            self.tokens_per_chunk = int(tokens_per_chunk)
            self.state_groups = frozenset(int(g) for g in (state_groups or ()))
            self._state_tags = frozenset(g.to_bytes(4, "big") for g in self.state_groups)
            self.model = model
            self._new_mirror()

        # -- the mirror ------------------------------------------------------

        def _new_mirror(self) -> None:
            self._chunks: dict = {}
            self._idle: set = set()
            self._pool: OrderedDict = OrderedDict()
            self._fresh: OrderedDict = OrderedDict()  # inserted, not yet offered to the mirror
            self._pending: dict = {}
            self._page_keys: dict[int, tuple] = {}
            self._slot_keys: dict[int, tuple] = {}
            self._held: dict = {}  # key -> ("p" or "s", id)
            self._next_id = 0
            self._free_ids: list[int] = []  # ids the mirror does not reference
            self._tokens: dict = {}  # resident KV key -> its chunk's token ids (bytes)
            T = self.tokens_per_chunk
            probe = PrefixCache(1 << 40, model=dict(self.model), page_size=T, checkpoint_grid=T)
            st = probe.stats()
            probe.close()
            kv_chunk = max(1, st["kv_bytes_per_token"] * T)
            state = max(1, st["state_bytes_per_entry"])
            # Large enough that the mirror never evicts on its own: it holds
            # at most what vLLM's tier holds; evictions happen when asked.
            capacity = min((1 << 62), (self.cache_capacity + 1) * (kv_chunk + state) * 4)
            self._unit = min(kv_chunk, state)
            old = getattr(self, "_mirror", None)
            if old is not None:
                old.close()
            self._mirror = PrefixCache(
                capacity,
                model=dict(self.model),
                page_size=T,
                checkpoint_grid=T,
                tuner_adoption="deterministic",
            )

        def _new_id(self) -> int:
            if self._free_ids:
                return self._free_ids.pop()
            i = self._next_id
            if i >= _U32:
                raise MarconiError(4, "MarconiCachePolicy ran out of 32-bit ids", "MarconiCachePolicy")
            self._next_id = i + 1
            return i

        def _flush(self) -> None:
            if not self._pending:
                return
            pending, self._pending = self._pending, {}
            for ctx in pending.values():
                try:
                    self._mirror_request(ctx)
                except MarconiError as e:  # the mirror stays consistent; the chunks become candidates
                    logger.warning("MarconiCachePolicy: mirror update failed (%s); chunks kept as candidates", e)
            # What the mirror did not take (states it did not plan, chunks
            # past a gap) joins the candidates, after the older ones.
            self._pool.update(self._fresh)
            self._fresh.clear()

        def _mirror_request(self, ctx: Any) -> None:
            """One request's resident prefix, as one lookup + admit of the
            mirror: its KV chunks (contiguous from the start) as pages, its
            resident Mamba chunks at libmarconi's planned positions and at
            the end as states."""
            positions = getattr(ctx, "_offload_key_positions", None)
            if not positions:
                return
            T = self.tokens_per_chunk
            kv_at: dict[int, list] = {}
            st_at: dict[int, list] = {}
            state_tags = self._state_tags
            for key, pos in positions.items():
                (st_at if key[-4:] in state_tags else kv_at).setdefault(pos, []).append(key)
            chunks = self._chunks
            depth = 0
            while True:
                keys = kv_at.get((depth + 1) * T)
                if not keys or any(k not in chunks for k in keys):
                    break
                depth += 1
            if depth == 0:
                return
            tokens = array.array("I")
            cache = self._tokens
            parts = []
            for i in range(depth):
                key = kv_at[(i + 1) * T][0]
                part = cache.get(key)
                if part is None:
                    part = cache[key] = _chunk_tokens(get_offload_block_hash(key), T).tobytes()
                parts.append(part)
            tokens.frombytes(b"".join(parts))
            mirror = self._mirror
            with mirror.lookup(tokens) as lease:
                wanted = set(lease.plan)
                wanted.add(depth * T)
                states = []
                for pos in sorted(wanted):
                    keys = st_at.get(pos)
                    if not keys or any(k not in chunks or k in self._held for k in keys):
                        continue
                    states.append((pos, self._new_id(), tuple(keys)))
                pages = []
                for i in range(depth):
                    keys = tuple(kv_at[(i + 1) * T])
                    held = self._held.get(keys[0])
                    pages.append((held[1] if held is not None and held[0] == "p" else self._new_id(), keys))
                res = lease.admit(tokens, [(p, s) for p, s, _ in states], [p for p, _ in pages])
            for (pos, slot, keys), taken in zip(states, res.taken):
                if not taken:
                    self._free_ids.append(slot)
                if taken:
                    self._slot_keys[slot] = keys
                    for k in keys:
                        self._held[k] = ("s", slot)
                        self._pool.pop(k, None)
                        self._fresh.pop(k, None)
            taken_pages = res.kv_pages_taken
            for i, (pid, keys) in enumerate(pages):
                if i not in taken_pages and keys[0] not in self._held:
                    self._free_ids.append(pid)
            for i in taken_pages:
                pid, keys = pages[i]
                if keys[0] in self._held:
                    continue
                self._page_keys[pid] = keys
                for k in keys:
                    self._held[k] = ("p", pid)
                    self._pool.pop(k, None)
                    self._fresh.pop(k, None)
            self._drain()

        def _drain(self) -> list:
            """Moves what the mirror freed to the pool; returns those keys."""
            pages, slots = self._mirror.drain_freed()
            freed = []
            for ids, table in ((pages, self._page_keys), (slots, self._slot_keys)):
                for i in ids:
                    self._free_ids.append(i)
                    for k in table.pop(i, ()):
                        if self._held.pop(k, None) is not None and k in self._chunks:
                            self._pool[k] = None
                            freed.append(k)
            return freed

        # -- vLLM's CachePolicy --------------------------------------------

        def get(self, key):
            return self._chunks.get(key)

        def insert(self, key, chunk, req_context) -> None:
            self._chunks[key] = chunk
            self._pool.pop(key, None)
            self._fresh[key] = None
            self._pending[id(req_context)] = req_context
            if chunk.ref_cnt == 0:
                self._idle.add(key)

        def remove(self, key) -> None:
            del self._chunks[key]
            self._tokens.pop(key, None)
            self._idle.discard(key)
            self._pool.pop(key, None)
            self._fresh.pop(key, None)
            held = self._held.pop(key, None)
            if held is not None:  # the mirror keeps the id until it frees it; the key is gone
                table = self._page_keys if held[0] == "p" else self._slot_keys
                keys = tuple(k for k in table.get(held[1], ()) if k != key)
                table[held[1]] = keys

        def touch(self, keys, req_context) -> None:
            self._pending[id(req_context)] = req_context

        def on_request_finished(self, key_groups, insertion_only_keys, reused_keys, req_context) -> None:
            self._pending[id(req_context)] = req_context
            self._flush()

        def mark_evictable(self, key) -> None:
            self._idle.add(key)

        def mark_non_evictable(self, key) -> None:
            self._idle.discard(key)

        def clear(self) -> None:
            self._new_mirror()

        def evict(self, n: int, protected: set):
            if n == 0:
                return []
            idle = self._idle
            selected: list = []
            chosen: set = set()
            # The candidates first (chunks the mirror does not hold); the
            # requests whose chunks are not offered to the mirror yet only
            # when those do not suffice.
            for flush in (False, True):
                if flush:
                    if not self._pending and not self._fresh:
                        break
                    self._flush()
                for key in self._pool:
                    if key in idle and key not in protected and key not in chosen:
                        selected.append(key)
                        chosen.add(key)
                        if len(selected) == n:
                            break
                if len(selected) == n:
                    break
            mirror = self._mirror
            while len(selected) < n:
                try:
                    free = mirror.evict(0)
                    mirror.evict(free + (n - len(selected)) * self._unit)
                    freed = self._drain()
                    if not freed and mirror.evict(0) == free:
                        break  # the mirror has nothing left to give
                except MarconiError as e:  # never into vLLM: fewer candidates, maybe None
                    logger.warning("MarconiCachePolicy: mirror eviction failed (%s)", e)
                    break
                for key in freed:
                    if key in idle and key not in protected and key not in chosen:
                        selected.append(key)
                        chosen.add(key)
                        if len(selected) == n:
                            break
            if len(selected) < n:
                return None
            out = []
            for key in selected:
                chunk = self._chunks.pop(key)
                self._tokens.pop(key, None)
                idle.discard(key)
                self._pool.pop(key, None)
                out.append((key, chunk))
            return out

        def close(self) -> None:
            self._mirror.close()

    MarconiCachePolicy.__module__ = __name__
    MarconiCachePolicy.__qualname__ = "MarconiCachePolicy"
    return {"MarconiCachePolicy": MarconiCachePolicy}


def _key_tokens(key: bytes) -> list[int]:
    """A chunk key (block hash + 4-byte group index) as the uint32 token ids
    of its store name: the store names it like a state after these tokens."""
    b = bytes(key)
    if len(b) % 4:
        b += b"\0" * (4 - len(b) % 4)
    a = array.array("I")
    a.frombytes(b)
    return list(a)


def _build_tier_class() -> type:
    from vllm.v1.kv_offload.base import LookupResult, Medium, RequestOffloadingContext, get_offload_block_hash
    from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager

    from .store import Store

    class MarconiStoreTier(SecondaryTierManager):
        """vLLM secondary tier (below the CPU tier of TieringOffloadingSpec)
        over libmarconi's store (marconi.Store: a directory or Redis/Valkey,
        checksummed envelopes). Selected by configuration:

            "spec_name": "TieringOffloadingSpec",
            "secondary_tiers": [{"type": "MarconiStoreTier", "module_path": "marconi.vllm",
                                 "backend": "dir", "location": "/var/cache/marconi"}]

        A chunk (vLLM block hash + group index) is one store object,
        named by its key under a fingerprint of the model identity (model,
        KV dtype, chunk size and bytes, group layout, parallel layout) and
        the block-hash seed, so processes of one model share every chunk and
        two models none. What is written: every attention chunk of a store
        job, and Mamba state chunks only at the positions libmarconi's
        admission keeps (the branch points its planner names for the
        request's path, and the job's last position). A miss of any kind
        (absent, corrupt, truncated, another model, store down or slow) is a
        MISS; a lookup HIT has already read and verified the chunk, so the
        load that follows cannot return other bytes.

        Calls are synchronous and bounded by the store's timeouts
        (`timeout_ms`, `connect_timeout_ms`; a Redis that is down is skipped
        for a backoff after the first failure)."""

        medium = Medium.STORAGE

        def __init__(
            self,
            offloading_spec: Any,
            primary_kv_view: memoryview,
            tier_type: str,
            backpressure_detector: Any = None,
            backend: str = "dir",
            location: Optional[str] = None,
            namespace: Optional[str] = None,
            timeout_ms: int = 50,
            connect_timeout_ms: int = 50,
            ttl_s: int = 0,
            staged_bytes: int = 256 << 20,
            marconi_model: Any = None,
            **unknown: Any,
        ) -> None:
            super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
            unknown.pop("locality", None)
            if unknown:
                raise ValueError(f"MarconiStoreTier: unknown settings {sorted(unknown)}")
            if backend not in ("dir", "redis"):
                raise ValueError(f"MarconiStoreTier: backend must be 'dir' or 'redis', got {backend!r}")
            if not location:
                raise ValueError("MarconiStoreTier: 'location' (a directory, or redis://host:port/db) is required")
            spec = offloading_spec
            cfg = spec.config
            extra = spec.extra_config
            groups = cfg.groups
            sizes = {g.tokens_per_block * spec.blocks_per_chunk for g in groups}
            if len(sizes) != 1:
                raise ValueError(f"MarconiStoreTier needs one chunk size across the groups, got {sorted(sizes)}")
            self.tokens_per_chunk = sizes.pop()
            if extra.get(STATE_GROUPS_KEY) is not None:
                sg = extra[STATE_GROUPS_KEY]
            else:
                sg = [g.group_id for g in groups if g.sliding_window_size_in_chunks == 1]
            self.state_groups = frozenset(int(g) for g in sg)
            self._state_tags = frozenset(g.to_bytes(4, "big") for g in self.state_groups)
            model = marconi_model if marconi_model is not None else extra.get(MODEL_KEY)
            if model is None:
                raise ValueError(
                    f"MarconiStoreTier needs kv_connector_extra_config[{MODEL_KEY!r}] (or {MODEL_KEY!r} in its tier "
                    "config): libmarconi's admission plans states with the model's sizes"
                )
            self.model = load_model_spec(model)
            par = cfg.parallel
            layout = ",".join(f"{g.group_id}:{g.sliding_window_size_in_chunks}" for g in groups)
            self.fingerprint = (
                f"vllm model={cfg.model.name} dtype={cfg.model.dtype} chunk_tokens={self.tokens_per_chunk} "
                f"chunk_bytes={self.block_size_bytes} groups={layout} tp={par.tp_size} pp={par.pp_size} "
                f"pcp={par.pcp_size} dcp={par.dcp_size} layout={cfg.kv_cache_layout} canonical={cfg.canonical_layout}"
            )
            # Block hashes chain from vLLM's NONE_HASH, derived from
            # PYTHONHASHSEED when set (a fixed default for sha256 /
            # sha256_cbor otherwise): the seed goes into the names too.
            self.hash_seed = os.environ.get("PYTHONHASHSEED", "vllm-default")
            self.store = Store(backend, location, model=self.fingerprint, block_size=self.tokens_per_chunk,
                               namespace=namespace, seed=self.hash_seed, timeout_ms=timeout_ms,
                               connect_timeout_ms=connect_timeout_ms, ttl_s=ttl_s,
                               max_value_bytes=max(self.block_size_bytes, 1))
            self._flat = primary_kv_view.cast("B") if primary_kv_view.ndim != 1 or primary_kv_view.format != "B" \
                else primary_kv_view
            self._staged: OrderedDict = OrderedDict()  # key -> verified bytes, from lookup to load
            # Chunks read by a lookup HIT, waiting for their load (bounded in bytes).
            self._staged_cap = max(1, int(staged_bytes) // max(self.block_size_bytes, 1))
            self._done: list = []
            self.counts = {"written": 0, "skipped_states": 0, "put_failures": 0, "hits": 0, "misses": 0,
                           "loaded": 0, "load_failures": 0}
            T = self.tokens_per_chunk
            self._mirror = PrefixCache(1 << 36, model=dict(self.model), page_size=T, checkpoint_grid=T,
                                       tuner_adoption="deterministic")
            self._ids = 0
            self._free: list[int] = []

        # -- admission -----------------------------------------------------

        def _new_id(self) -> int:
            if self._free:
                return self._free.pop()
            self._ids += 1
            return self._ids

        def _kept_states(self, ctx: Any, job_positions: list[int]) -> set:
            """Positions of this job whose Mamba state is written: the
            job's last one and those libmarconi's planner names for the
            request's path (its branch points against what it has seen)."""
            keep = {max(job_positions)} if job_positions else set()
            positions = getattr(ctx, "_offload_key_positions", None)
            if not positions:
                return keep
            T = self.tokens_per_chunk
            kv_at: dict[int, bytes] = {}
            for key, pos in positions.items():
                if key[-4:] not in self._state_tags:
                    kv_at.setdefault(pos, key)
            depth = 0
            while (depth + 1) * T in kv_at:
                depth += 1
            if depth == 0:
                return keep
            tokens = array.array("I")
            tokens.frombytes(b"".join(_chunk_tokens(get_offload_block_hash(kv_at[(i + 1) * T]), T).tobytes()
                                      for i in range(depth)))
            try:
                with self._mirror.lookup(tokens) as lease:
                    plan = set(lease.plan)
                    pages = [self._new_id() for _ in range(depth)]
                    slot = self._new_id()
                    res = lease.admit(tokens, [(depth * T, slot)], pages)
                freed_pages, freed_slots = self._mirror.drain_freed()
                self._free.extend(freed_pages)
                self._free.extend(freed_slots)
                taken = set(res.kv_pages_taken)
                self._free.extend(p for i, p in enumerate(pages) if i not in taken)
                if not res.taken or not res.taken[0]:
                    self._free.append(slot)
            except MarconiError as e:  # admission falls back to the job's last state
                logger.warning("MarconiStoreTier: admission plan failed (%s); keeping the last state only", e)
                return keep
            return keep | {p for p in plan if p in set(job_positions)}

        # -- vLLM's SecondaryTierManager -----------------------------------

        def _chunk(self, chunk_id: int) -> memoryview:
            n = self.block_size_bytes
            return self._flat[int(chunk_id) * n:(int(chunk_id) + 1) * n]

        def lookup(self, key, req_context):
            if key in self._staged:
                return LookupResult.HIT
            try:
                data = self.store.get_state(_key_tokens(key), len(_key_tokens(key)),
                                            max_bytes=max(self.block_size_bytes, 1))
            except Exception as e:  # noqa: BLE001 - any store trouble is a miss
                logger.debug("MarconiStoreTier: lookup failed: %s", e)
                data = None
            if data is None or len(data) != self.block_size_bytes:
                self.counts["misses"] += 1
                return LookupResult.MISS
            self._staged[key] = data
            while len(self._staged) > self._staged_cap:
                self._staged.popitem(last=False)
            self.counts["hits"] += 1
            return LookupResult.HIT

        def submit_store(self, job_metadata) -> None:
            keys = list(job_metadata.keys)
            ids = list(job_metadata.chunk_ids)
            ctx = job_metadata.req_context
            ok = True
            try:
                pos = {k: ctx.get_offload_key_position(k) for k in keys}
                st_pos = [p for k, p in pos.items() if k[-4:] in self._state_tags and p is not None]
                keep = self._kept_states(ctx, st_pos)
                for key, cid in zip(keys, ids):
                    if key[-4:] in self._state_tags and pos.get(key) not in keep:
                        self.counts["skipped_states"] += 1
                        continue
                    try:
                        self.store.put_state(_key_tokens(key), len(_key_tokens(key)), bytes(self._chunk(cid)))
                        self.counts["written"] += 1
                    except Exception as e:  # noqa: BLE001 - a refused write is only a later miss
                        self.counts["put_failures"] += 1
                        logger.debug("MarconiStoreTier: write failed: %s", e)
            except Exception:  # noqa: BLE001
                logger.exception("MarconiStoreTier: store job failed")
                ok = False
            self._done.append(JobResult(job_id=job_metadata.job_id, success=ok))

        def submit_load(self, job_metadata) -> None:
            good = []
            for key, cid in zip(list(job_metadata.keys), list(job_metadata.chunk_ids)):
                data = self._staged.pop(key, None)
                if data is None:
                    try:
                        data = self.store.get_state(_key_tokens(key), len(_key_tokens(key)),
                                                    max_bytes=max(self.block_size_bytes, 1))
                    except Exception:  # noqa: BLE001
                        data = None
                if data is None or len(data) != self.block_size_bytes:
                    self.counts["load_failures"] += 1
                    continue
                self._chunk(cid)[:] = data
                self.counts["loaded"] += 1
                good.append(key)
            n = len(job_metadata.keys)
            if len(good) == n:
                self._done.append(JobResult(job_id=job_metadata.job_id, success=True))
            else:
                self._done.append(JobResult(job_id=job_metadata.job_id, success=False, successful_keys=good))

        def get_finished_jobs(self):
            out, self._done = self._done, []
            return out

        def on_new_request(self, req_context):
            return RequestOffloadingContext()

        def drain_jobs(self) -> None:
            return  # synchronous: every job is done when submit_* returns

        def shutdown(self) -> None:
            self._staged.clear()
            self.store.close()
            self._mirror.close()
            if self._flat is not self._primary_kv_view:
                self._flat.release()  # the CPU tier's region can be unmapped

    MarconiStoreTier.__module__ = __name__
    MarconiStoreTier.__qualname__ = "MarconiStoreTier"
    return MarconiStoreTier


_classes: dict = {}


def __getattr__(name: str):
    if name in ("MarconiCachePolicy", "MarconiStoreTier"):
        if name not in _classes:
            try:
                if name == "MarconiCachePolicy":
                    _classes.update(_build_classes())
                else:
                    _classes[name] = _build_tier_class()
            except ImportError as e:
                raise ImportError(f"marconi.vllm.{name} needs vLLM 0.33 (pip install vllm==0.33.0): {e}") from e
        return _classes[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
