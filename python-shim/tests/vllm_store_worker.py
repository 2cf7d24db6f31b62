"""One vLLM scheduler process with MarconiStoreTier below its CPU tier
(TieringOffloadingSpec), used by test_vllm.py: run as a script, it serves a
seeded trace and prints a JSON summary; imported, it gives the engine and
the checks.

    python vllm_store_worker.py '{"location": ..., "backend": "dir", "model_dir": ..., "seed": 1}'

The checks are on vLLM's own calls, not on the tier's word:
- every chunk the CPU tier writes down through the tier is first filled
  with bytes derived from its key (block hash + group index), so a chunk
  read back from the store is recognisable: after every load vLLM asks
  the tier for, each loaded chunk's CPU slot must hold exactly its own
  key's bytes;
- every load vLLM plans from the CPU tier to the device (prepare_load)
  holds a Mamba state chunk, at exactly the end of the loaded attention
  chunks.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

from vllm.v1.kv_offload.base import get_offload_group_idx

import vllm_engine as ve


def key_bytes(key: bytes, n: int) -> bytes:
    h = hashlib.sha256(bytes(key)).digest()
    return (h * (n // len(h) + 1))[:n]


def engine(model_dir: str, block_size: int, location: str, backend: str = "dir", host_chunks: int = 40,
           gpu_blocks: int = 40, **tier) -> ve.Engine:
    cfg = {"type": "MarconiStoreTier", "module_path": "marconi.vllm", "backend": backend, "location": location}
    cfg.update(tier)
    extra = {"marconi_model": os.path.join(model_dir, "config.json"), "spec_name": "TieringOffloadingSpec",
             "secondary_tiers": [cfg]}
    return ve.Engine(model_dir, block_size=block_size, gpu_blocks=gpu_blocks,
                     cpu_bytes=ve.Engine.page_bytes_for(block_size) * host_chunks, extra=extra)


class StoreChecker:
    """Marks the bytes written down and checks the bytes and positions
    loaded (see the module text)."""

    def __init__(self, e: ve.Engine) -> None:
        self.tier = tier = e.tiers[0]
        self.state_groups = tier.state_groups
        self.verified = 0  # chunks read back from the store with their own key's bytes
        self.loads = 0  # device loads vLLM planned
        n = tier.block_size_bytes
        store, load = tier.submit_store, tier.submit_load

        def submit_store(job):
            for key, cid in zip(list(job.keys), list(job.chunk_ids)):
                tier._chunk(cid)[:] = key_bytes(key, n)
            return store(job)

        def submit_load(job):
            keys, ids = list(job.keys), list(job.chunk_ids)
            for cid in ids:
                tier._chunk(cid)[:] = b"\0" * n
            before = len(tier._done)
            load(job)
            res = tier._done[before:]
            assert len(res) == 1
            ok = set(keys) if res[0].success else set(res[0].successful_keys or ())
            for key, cid in zip(keys, ids):
                if key in ok:
                    assert bytes(tier._chunk(cid)) == key_bytes(key, n), "a loaded chunk holds another key's bytes"
                    self.verified += 1

        tier.submit_store, tier.submit_load = submit_store, submit_load
        m = e.manager
        prepare = m.prepare_load

        def prepare_load(keys, req_context):
            keys = list(keys)
            pos = req_context.get_offload_key_position
            kv = [pos(k) for k in keys if get_offload_group_idx(k) not in self.state_groups]
            st = [pos(k) for k in keys if get_offload_group_idx(k) in self.state_groups]
            assert st, "a hybrid hit without a Mamba state"
            assert max(st) == max(kv), f"the state loaded is at {max(st)}, the hit ends at {max(kv)}"
            self.loads += 1
            return prepare(keys, req_context)

        m.prepare_load = prepare_load


def serve(e: ve.Engine, trace) -> dict:
    tot, hit, host = ve.serve(e, trace)
    return {"prompt": tot, "hit": hit, "host_hit": host}


def main(cfg: dict) -> dict:
    import test_vllm as tv

    e = engine(cfg["model_dir"], tv.B, cfg["location"], backend=cfg.get("backend", "dir"),
               host_chunks=cfg.get("host_chunks", 40))
    check = StoreChecker(e)
    nconv, turns = cfg.get("sessions", 8), cfg.get("turns", 4)
    trace = tv._trace(cfg.get("seed", 1), nconv=nconv, turns=turns)
    lo, hi = cfg.get("serve", [0, turns])  # the turns this process serves (the trace is turn-major)
    mlo, mhi = cfg.get("measure", [lo, hi])
    out = serve(e, trace[lo * nconv:mlo * nconv])
    out = serve(e, trace[mlo * nconv:mhi * nconv])  # the figures are of these turns
    serve(e, trace[mhi * nconv:hi * nconv])
    out.update(counts=dict(check.tier.counts), verified=check.verified, loads=check.loads, pid=os.getpid(),
               fingerprint=check.tier.fingerprint)
    e.manager.shutdown()
    return out


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(json.loads(sys.argv[1]))), flush=True)
