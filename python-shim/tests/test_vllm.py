"""marconi.vllm inside vLLM 0.33.0's own Scheduler + OffloadingConnector
(CPU tier) on CPU, with a fake model runner (vllm_engine.py).

Needs the pinned vLLM (ci/test.d/vllm.sh builds its venv); skipped without
it, failed instead when MARCONI_VLLM_STRICT=1.
"""

from __future__ import annotations

import os
import random

import pytest

STRICT = os.environ.get("MARCONI_VLLM_STRICT") == "1"
try:
    import vllm  # noqa: F401
    from vllm.v1.kv_offload.base import ReqContext, get_offload_group_idx, make_offload_key
    from vllm.v1.kv_offload.cpu.policies.base import CachePolicy, ChunkStatus
except ImportError as e:  # pragma: no cover - depends on the venv
    if STRICT:
        raise
    pytest.skip(f"vLLM is not installed: {e}", allow_module_level=True)

import vllm_engine as ve

import marconi.vllm as mv

B = ve.TINY.vllm_block_size()
MODEL = "paper-7b"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return ve.model_dir(str(tmp_path_factory.mktemp("model")))


def _engine(model_dir, host_chunks, policy="MarconiCachePolicy", module="marconi.vllm", extra=None, gpu_blocks=40):
    cfg = {"marconi_model": os.path.join(model_dir, "config.json")}
    cfg.update(extra or {})
    return ve.Engine(model_dir, block_size=B, gpu_blocks=gpu_blocks, cpu_bytes=ve.Engine.page_bytes_for(B) * host_chunks,
                     policy=policy, policy_module=module, extra=cfg)


def _trace(seed, nconv=8, turns=4):
    rng = random.Random(seed)
    tok = lambda n: [rng.randrange(2, 40000) for _ in range(n)]  # noqa: E731
    systems = [tok(B * 6) for _ in range(2)]
    convs = [systems[i % 2] + tok(B * 2 + 5) for i in range(nconv)]
    out = []
    for _ in range(turns):
        order = list(range(nconv))
        rng.shuffle(order)
        for i in order:
            o = tok(20)
            out.append((list(convs[i]), o))
            convs[i] = convs[i] + o + tok(B + 3)
    return out


class TierChecker:
    """Watches vLLM's CPU manager (its prepare_store / prepare_load, not the
    policy): which chunks were really written to the tier and not evicted,
    and, for every load vLLM plans, that each loaded chunk is one of them
    and that the loaded Mamba state sits exactly at the end of the loaded
    attention chunks (a hybrid hit resumes from the state at its end)."""

    def __init__(self, engine):
        self.stored: set = set()
        self.loads = 0
        self.state_groups = engine.policy.state_groups if hasattr(engine.policy, "state_groups") else {1}
        m = engine.manager
        store, load = m.prepare_store, m.prepare_load

        def prepare_store(keys, req_context):
            out = store(keys, req_context)
            if out is not None:
                self.stored.difference_update(out.evicted_keys)
                self.stored.update(out.keys_to_store)
            return out

        def prepare_load(keys, req_context):
            keys = list(keys)
            missing = [k for k in keys if k not in self.stored]
            assert not missing, f"vLLM loads {len(missing)} chunks the tier does not hold"
            kv = [req_context.get_offload_key_position(k) for k in keys if get_offload_group_idx(k) not in self.state_groups]
            st = [req_context.get_offload_key_position(k) for k in keys if get_offload_group_idx(k) in self.state_groups]
            assert st, "a hybrid hit without a Mamba state"
            assert max(st) == max(kv), f"the state loaded is at {max(st)}, the hit ends at {max(kv)}"
            self.loads += 1
            return load(keys, req_context)

        m.prepare_store = prepare_store
        m.prepare_load = prepare_load


def test_config_selects_the_policy(model_dir):
    e = _engine(model_dir, 60)
    assert type(e.policy).__name__ == "MarconiCachePolicy"
    assert isinstance(e.policy, CachePolicy)
    assert e.policy.state_groups == {1}
    assert e.policy.tokens_per_chunk == B


def test_missing_model_is_a_clear_error(model_dir):
    with pytest.raises(ValueError, match="marconi_model"):
        ve.Engine(model_dir, block_size=B, gpu_blocks=40, cpu_bytes=ve.Engine.page_bytes_for(B) * 60,
                  policy="MarconiCachePolicy", policy_module="marconi.vllm")
    with pytest.raises(ValueError, match="no-such-preset"):
        _engine(model_dir, 60, extra={"marconi_model": "no-such-preset"})


@pytest.mark.parametrize("policy,module", [("lru", None), ("MarconiCachePolicy", "marconi.vllm")])
def test_host_hits_resume_from_a_stored_state(model_dir, policy, module):
    e = _engine(model_dir, 40, policy=policy, module=module)
    check = TierChecker(e)
    tot, hit, host = ve.serve(e, _trace(1))
    assert check.loads > 0 and host > 0, (check.loads, host)
    assert hit <= tot


def _leaky_class():
    from vllm.v1.kv_offload.cpu.policies.lru import LRUCachePolicy

    class Leaky(LRUCachePolicy):
        """Negative control: vLLM's LRU, except that it evicts Mamba states
        but keeps answering get() for them, as a policy that lost track of a
        state would. vLLM then plans loads of states the tier does not hold."""

        def __init__(self, cache_capacity, **kw):
            super().__init__(cache_capacity, **kw)
            self.ghosts = {}

        def evict(self, n, protected):
            out = super().evict(n, protected)
            for key, chunk in out or ():
                if get_offload_group_idx(key) == 1:
                    ghost = ChunkStatus(chunk.chunk_id)
                    ghost.ref_cnt = 0
                    self.ghosts[key] = ghost
            return out

        def get(self, key):
            return super().get(key) or self.ghosts.get(key)

        def insert(self, key, chunk, req_context):
            self.ghosts.pop(key, None)
            super().insert(key, chunk, req_context)

    return Leaky


def __getattr__(name):
    if name == "Leaky":
        return _leaky_class()
    raise AttributeError(name)


def test_negative_control_a_dropped_state_is_caught(model_dir):
    e = _engine(model_dir, 40, policy="Leaky", module="test_vllm")
    assert type(e.policy).__name__ == "Leaky"
    TierChecker(e)
    with pytest.raises(AssertionError, match="does not hold"):
        ve.serve(e, _trace(1))


def _keys(rng, paths, T):
    """A request: a path through a random tree of chunk hashes."""
    base = rng.choice(paths) if paths and rng.random() < 0.7 else []
    cut = rng.randrange(0, len(base) + 1) if base else 0
    path = list(base[:cut]) + [rng.randbytes(32) for _ in range(rng.randrange(1, 5))]
    paths.append(path)
    return path


@pytest.mark.parametrize("seed", range(4))
def test_policy_keeps_vllms_contract(seed):
    """Seeded random operations as CPUOffloadingManager makes them: evict
    returns exactly n idle, unprotected, resident chunks or None (and then
    changes nothing), get answers for resident chunks only, remove and
    clear work, and the mirror's invariants hold (check())."""
    rng = random.Random(seed)
    T = 16
    cap = 24
    p = mv.MarconiCachePolicy(cap, model=MODEL, state_groups=[1], tokens_per_chunk=T)
    resident: dict = {}
    paths: list = []
    next_chunk = 0
    for step in range(400):
        op = rng.random()
        if op < 0.45:
            ctx = ReqContext(req_id=f"q{step}")
            path = _keys(rng, paths, T)
            keys = []
            for i, h in enumerate(path):
                for g in (0, 1):
                    k = make_offload_key(h, g)
                    ctx.set_offload_key_position(k, (i + 1) * T)
                    keys.append(k)
            new = [k for k in keys if k not in resident]
            need = len(new) - (cap - len(resident))
            if need > 0:
                idle = {k for k, c in resident.items() if c.ref_cnt == 0} - set(keys)
                protected = set(keys)
                before = dict(resident)
                out = p.evict(need, protected)
                if out is None:
                    assert len(idle) < need, "None with enough idle chunks"
                    assert dict(resident) == before
                    for k in resident:
                        assert p.get(k) is resident[k]
                    continue
                assert len(out) == need
                assert len({k for k, _ in out}) == need
                for k, c in out:
                    assert k in idle, "evicted a busy or protected chunk"
                    assert resident.pop(k) is c
                    assert p.get(k) is None
            for k in new:
                c = ChunkStatus(next_chunk)
                next_chunk += 1
                p.insert(k, c, ctx)
                resident[k] = c
            for k in new:
                if rng.random() < 0.9:
                    resident[k].ref_cnt = 0
                    p.mark_evictable(k)
            p.on_request_finished(((),), set(), set(), ctx)
        elif op < 0.6 and resident:
            k = rng.choice(list(resident))
            c = resident[k]
            if c.ref_cnt == 0:
                c.ref_cnt = 1
                p.mark_non_evictable(k)
            elif c.ref_cnt == 1:
                c.ref_cnt = 0
                p.mark_evictable(k)
        elif op < 0.65 and resident:
            k = rng.choice(list(resident))
            if resident[k].ref_cnt == -1:
                p.remove(k)
                del resident[k]
        elif op < 0.85 and resident:
            n = rng.randrange(0, 5)
            protected = set(rng.sample(list(resident), min(len(resident), rng.randrange(0, 4))))
            idle = {k for k, c in resident.items() if c.ref_cnt == 0} - protected
            before = dict(resident)
            out = p.evict(n, protected)
            if out is None:
                assert len(idle) < n, "None with enough idle chunks"
                assert dict(resident) == before
            else:
                assert len(out) == n and len({k for k, _ in out}) == n
                for k, c in out:
                    assert k in idle
                    assert resident.pop(k) is c
        elif op < 0.86:
            p.clear()
            resident.clear()
        for k, c in resident.items():
            assert p.get(k) is c
        p._mirror.check()
    p.close()


def test_evict_none_only_when_not_enough_idle():
    p = mv.MarconiCachePolicy(8, model=MODEL, state_groups=[1], tokens_per_chunk=16)
    ctx = ReqContext(req_id="a")
    keys = []
    for i in range(3):
        h = bytes([i + 1]) * 32
        for g in (0, 1):
            k = make_offload_key(h, g)
            ctx.set_offload_key_position(k, (i + 1) * 16)
            c = ChunkStatus(len(keys))
            p.insert(k, c, ctx)
            c.ref_cnt = 0
            p.mark_evictable(k)
            keys.append(k)
    p.on_request_finished(((),), set(), set(), ctx)
    assert p.evict(7, set()) is None
    assert all(p.get(k) is not None for k in keys)
    assert p.evict(6, set(keys[:1])) is None
    out = p.evict(5, set(keys[:1]))
    assert out is not None and len(out) == 5 and keys[0] not in {k for k, _ in out}
    p.close()


def test_doc_config_lines(model_dir):
    """The `vllm serve` line of docs/vllm.md, parsed by vLLM 0.33.0's own
    argument parser and EngineArgs, runs as written (model path and host
    bytes replaced) through vLLM's scheduler and connector."""
    import shlex
    from pathlib import Path

    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    doc = (Path(__file__).resolve().parents[2] / "docs" / "vllm.md").read_text()
    block = doc.split("<!-- vllm-serve -->", 1)[1].split("```sh", 1)[1].split("```", 1)[0]
    argv = shlex.split(block.strip())
    assert argv[:2] == ["vllm", "serve"]
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(["--model", argv[2], *argv[3:]])
    ea = EngineArgs.from_cli_args(args)
    assert ea.enable_prefix_caching is True
    kt = ea.kv_transfer_config
    assert kt.kv_connector == "OffloadingConnector"
    extra = dict(kt.kv_connector_extra_config)
    assert extra["eviction_policy"] == "MarconiCachePolicy" and extra["cache_policy_module_path"] == "marconi.vllm"
    extra["marconi_model"] = os.path.join(model_dir, "config.json")
    host = ve.Engine.page_bytes_for(B) * 40
    extra["cpu_bytes_to_use"] = host
    e = ve.Engine(model_dir, block_size=B, gpu_blocks=40, cpu_bytes=host, policy=extra.pop("eviction_policy"),
                  policy_module=extra.pop("cache_policy_module_path"), extra=extra)
    assert type(e.policy).__name__ == "MarconiCachePolicy"
    TierChecker(e)
    tot, hit, host_hit = ve.serve(e, _trace(3))
    assert host_hit > 0


# -- MarconiStoreTier: libmarconi's store below vLLM's CPU tier --------------

import json  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import vllm_store_worker as sw  # noqa: E402
from conftest import free_port, running_redis  # noqa: E402

HERE = Path(__file__).resolve().parent


@pytest.fixture
def tiered(model_dir):
    """Builds engines with MarconiStoreTier and shuts each down at the end
    (its CPU tier's shared-memory region goes with it)."""
    made = []

    def make(location, **kw):
        e = sw.engine(model_dir, B, location, **kw)
        made.append(e)
        return e

    yield make
    for e in made:
        e.manager.shutdown()


def _worker(cfg: dict) -> dict:
    """One scheduler process (vllm_store_worker.py) serving a trace over a store."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(HERE.parent), env.get("PYTHONPATH", "")])
    env["PYTHONHASHSEED"] = "1234"  # the block-hash seed both processes share
    p = subprocess.run([sys.executable, str(HERE / "vllm_store_worker.py"), json.dumps(cfg)], cwd=str(HERE), env=env,
                       capture_output=True, text=True, timeout=300)
    lines = [line for line in p.stdout.splitlines() if line.startswith("RESULT ")]
    assert p.returncode == 0 and lines, (p.returncode, p.stdout[-2000:], p.stderr[-4000:])
    return json.loads(lines[-1][len("RESULT "):])


def test_store_tier_is_selected_by_config(model_dir, tmp_path, tiered):
    e = tiered(str(tmp_path / "store"))
    assert type(e.manager).__name__ == "TieringOffloadingManager"
    assert [type(t).__name__ for t in e.tiers] == ["MarconiStoreTier"]
    t = e.tiers[0]
    assert t.state_groups == {1} and t.tokens_per_chunk == B
    assert "model=" + model_dir in t.fingerprint
    with pytest.raises(ValueError, match="location"):
        tiered("")


def test_store_tier_second_process_resumes_the_first(model_dir, tmp_path):
    """Two scheduler processes over one directory store: the second serves
    the first's sessions from what the first wrote down, each loaded chunk
    holding its own key's bytes and each hit's Mamba state at its end."""
    cfg = {"model_dir": model_dir, "backend": "dir", "location": str(tmp_path / "store"), "seed": 1}
    a = _worker(cfg)
    b = _worker(cfg)
    assert a["pid"] != b["pid"] and a["fingerprint"] == b["fingerprint"]
    assert a["counts"]["written"] > 0
    assert b["counts"]["hits"] > 0 and b["verified"] > 0 and b["loads"] > 0
    # Hits the second could not have had alone: it starts with an empty device and CPU tier.
    assert b["hit"] > a["hit"], (a, b)
    assert b["hit"] / b["prompt"] >= 0.8 * a["hit"] / a["prompt"]


def _first_and_rest(e, trace):
    first = e.run(*trace[0])
    rest = sw.serve(e, trace[1:])
    return first, rest


def test_store_tier_corrupt_objects_are_misses(model_dir, tmp_path, tiered):
    """A directory whose objects are truncated, bit-flipped or swapped gives
    misses (and the requests complete); an intact copy gives hits."""
    store = tmp_path / "store"
    a = tiered(str(store))
    sw.StoreChecker(a)
    trace = _trace(1)
    sw.serve(a, trace)
    intact = tmp_path / "intact"
    shutil.copytree(store, intact)
    files = sorted(p for p in store.rglob("*") if p.is_file())
    assert len(files) > 3
    original = [f.read_bytes() for f in files]
    for i, f in enumerate(files):
        data = original[i]
        if i % 3 == 0:
            f.write_bytes(data[: len(data) // 2])
        elif i % 3 == 1:
            b = bytearray(data)
            b[len(b) // 2] ^= 0x40
            f.write_bytes(bytes(b))
        else:
            f.write_bytes(original[i - 1])  # a valid object under another key's name
    good = tiered(str(intact))
    sw.StoreChecker(good)
    first, _ = _first_and_rest(good, trace)
    assert first["host_hit"] > 0, first
    bad = tiered(str(store))
    check = sw.StoreChecker(bad)
    first, rest = _first_and_rest(bad, trace)
    assert first["host_hit"] == 0 and first["hit"] == 0, first
    st = check.tier.store.stats()
    assert st["truncated"] > 0 and st["corrupt"] > 0 and st["wrong_key"] > 0, st
    assert rest["prompt"] > 0


def test_store_tier_redis_down_gives_misses(tiered):
    """A Redis nobody listens on: every lookup misses, writes are refused
    and counted, the requests complete with what the CPU tier holds."""
    e = tiered(f"redis://127.0.0.1:{free_port()}/0", backend="redis")
    check = sw.StoreChecker(e)
    out = sw.serve(e, _trace(1))
    c = check.tier.counts
    assert out["prompt"] > 0
    assert c["hits"] == 0 and c["loaded"] == 0 and c["misses"] > 0 and c["written"] == 0 and c["put_failures"] > 0, c
    st = check.tier.store.stats()
    assert st["hits"] == 0 and st["unavailable"] + st["timeout"] > 0, st


@pytest.fixture
def redis_url(tmp_path):
    with running_redis(tmp_path, STRICT) as (_, port):
        yield f"redis://127.0.0.1:{port}/0"


def test_store_tier_two_processes_share_redis(model_dir, redis_url):
    cfg = {"model_dir": model_dir, "backend": "redis", "location": redis_url, "seed": 2}
    a = _worker(cfg)
    b = _worker(cfg)
    assert a["counts"]["written"] > 0 and a["counts"]["put_failures"] == 0, a
    assert b["counts"]["hits"] > 0 and b["verified"] > 0 and b["loads"] > 0, b
    assert b["hit"] > a["hit"], (a, b)


def test_doc_store_tier_config(model_dir, redis_url):
    """The store tier's kv-transfer-config in docs/vllm.md, loaded by vLLM
    0.33.0's KVTransferConfig, runs as written (Redis location, model path
    and host bytes replaced) through vLLM's scheduler and connector."""
    from vllm.config import KVTransferConfig

    doc = (HERE.parents[1] / "docs" / "vllm.md").read_text()
    block = doc.split("<!-- vllm-store-tier -->", 1)[1].split("```json", 1)[1].split("```", 1)[0]
    kt = KVTransferConfig(**json.loads(block))
    assert kt.kv_connector == "OffloadingConnector"
    extra = json.loads(json.dumps(dict(kt.kv_connector_extra_config)))
    assert extra["spec_name"] == "TieringOffloadingSpec"
    (tier,) = extra["secondary_tiers"]
    assert tier["type"] == "MarconiStoreTier" and tier["module_path"] == "marconi.vllm"
    tier["location"] = redis_url
    extra["marconi_model"] = os.path.join(model_dir, "config.json")
    host = ve.Engine.page_bytes_for(B) * 40
    extra["cpu_bytes_to_use"] = host
    e = ve.Engine(model_dir, block_size=B, gpu_blocks=40, cpu_bytes=host, extra=extra)
    try:
        check = sw.StoreChecker(e)
        sw.serve(e, _trace(3))
        assert check.tier.counts["written"] > 0 and check.tier.counts["put_failures"] == 0
        assert check.tier.store.stats()["hits"] > 0 and check.verified > 0
    finally:
        e.manager.shutdown()


def test_negative_control_a_tier_that_mixes_keys_is_caught(tmp_path, tiered):
    """Negative control: a tier that reads a Mamba state chunk's block under
    the attention group's key (valid bytes of another chunk, as a tier
    keyed without the group index would) is caught by StoreChecker."""
    store = str(tmp_path / "store")
    a = tiered(store)
    sw.StoreChecker(a)
    sw.serve(a, _trace(1))
    b = tiered(store)
    check = sw.StoreChecker(b)
    real = check.tier.store.get_state

    def mixed(tokens, position, max_bytes=None):
        t = list(tokens)
        t[-1] = 0  # the group-index word: group 0's chunk of the same block
        return real(t, position, max_bytes)

    check.tier.store.get_state = mixed
    with pytest.raises(AssertionError, match="another key's bytes"):
        sw.serve(b, _trace(1))
