"""vLLM 0.33.0's own scheduler and offloading connector, driven on CPU with
a fake model runner (used by test_vllm.py and bench/bench_vllm.py).

What runs is vLLM's code: `Scheduler` (with its `KVCacheManager` over a
hybrid KV cache config: one full-attention group and one Mamba group in
align mode, built by vLLM's own planner from per-layer specs), the
scheduler side of `OffloadingConnector` with the `CPUOffloadingSpec` named
by `kv_connector_extra_config`, its `CPUOffloadingManager` and the cache
policy the config names. The model runner is replaced: each step produces
one token per running request, and every transfer job the connector asks
for (stores and loads) is reported complete in the same step. No tensor is
ever allocated.

`Engine.run(prompt, output_len)` serves one request to completion and
returns the tokens it computed and the tokens it got from the offload tier
(the connector's external hit), read from the Request (num_cached_tokens,
num_external_computed_tokens).
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from vllm.config import (
    CacheConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
    OffloadingWorkerMetadata,
)
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256_cbor
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MambaSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

EOS = 0


@dataclass
class Hybrid:
    """The sizes of a hybrid model's caches as vLLM's specs hold them."""

    attn_layers: int
    ssm_layers: int
    kv_heads: int
    head_dim: int
    ssm_heads: int
    ssm_head_dim: int
    d_state: int
    conv_dim: int
    conv_kernel: int
    dtype: torch.dtype = torch.bfloat16

    def mamba_shapes(self):
        return ((self.conv_kernel - 1, self.conv_dim), (self.ssm_heads, self.ssm_head_dim, self.d_state))

    def mamba_page_bytes(self) -> int:
        size = torch.tensor([], dtype=self.dtype).element_size()
        return sum(int(torch.tensor(s).prod()) for s in self.mamba_shapes()) * size

    def attn_bytes_per_token(self) -> int:
        size = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * self.kv_heads * self.head_dim * size

    def vllm_block_size(self, kernel: int = 16) -> int:
        """The attention block size at which one layer's attention page
        holds one Mamba state (what vLLM picks for a hybrid model in align
        mode: the smallest multiple of the kernel block size)."""
        per = self.attn_bytes_per_token()
        tokens = -(-self.mamba_page_bytes() // per)
        return -(-tokens // kernel) * kernel


TINY = Hybrid(attn_layers=1, ssm_layers=1, kv_heads=2, head_dim=64, ssm_heads=8, ssm_head_dim=32,
              d_state=16, conv_dim=576, conv_kernel=4)
"""A small NemotronH-like shape; its config.json is written by model_dir()."""

TINY_CONFIG = {
    "model_type": "nemotron_h", "architectures": ["NemotronHForCausalLM"], "hidden_size": 256,
    "num_hidden_layers": 2, "hybrid_override_pattern": "M*", "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 512, "mamba_num_heads": 8,
    "mamba_head_dim": 32, "ssm_state_size": 16, "n_groups": 1, "conv_kernel": 4, "expand": 1,
    "vocab_size": 50000, "max_position_embeddings": 65536, "torch_dtype": "bfloat16",
}


def model_dir(root: Optional[str] = None) -> str:
    d = Path(root or tempfile.mkdtemp(prefix="marconi-vllm-model-"))
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(TINY_CONFIG))
    return str(d)


class Engine:
    """One vLLM scheduler with the offloading connector's CPU tier.

    gpu_blocks: device blocks (per group, as vLLM's pool counts them);
    cpu_bytes: the host tier's bytes (`cpu_bytes_to_use`); policy: the
    `eviction_policy` (plus `cache_policy_module_path` for ours);
    extra: more kv_connector_extra_config entries."""

    def __init__(
        self,
        model_path: str,
        block_size: int,
        gpu_blocks: int,
        cpu_bytes: int,
        policy: str = "lru",
        policy_module: Optional[str] = None,
        extra: Optional[dict] = None,
        hybrid: Hybrid = TINY,
        max_model_len: int = 32768,
        max_batched_tokens: int = 8192,
    ) -> None:
        extra_config: dict[str, Any] = {"cpu_bytes_to_use": cpu_bytes, "eviction_policy": policy}
        if policy_module:
            extra_config["cache_policy_module_path"] = policy_module
        extra_config.update(extra or {})
        model_config = ModelConfig(model=model_path, skip_tokenizer_init=True, max_model_len=max_model_len,
                                   dtype="bfloat16")
        cache_config = CacheConfig(block_size=block_size, enable_prefix_caching=True, mamba_cache_mode="align")
        cache_config.num_gpu_blocks = gpu_blocks
        scheduler_config = SchedulerConfig(max_model_len=max_model_len, is_encoder_decoder=False,
                                           max_num_batched_tokens=max_batched_tokens, max_num_seqs=16,
                                           enable_chunked_prefill=True)
        self.vllm_config = VllmConfig(
            model_config=model_config,
            cache_config=cache_config,
            scheduler_config=scheduler_config,
            kv_transfer_config=KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both",
                                                kv_connector_extra_config=extra_config),
        )
        # Both groups share one page size (vLLM's hybrid allocator): the
        # smaller page is padded to the larger.
        page = max(block_size * hybrid.attn_bytes_per_token(), hybrid.mamba_page_bytes())
        attn = FullAttentionSpec(block_size=block_size, num_kv_heads=hybrid.kv_heads, head_size=hybrid.head_dim,
                                 dtype=hybrid.dtype,
                                 page_size_padded=page if page != block_size * hybrid.attn_bytes_per_token() else None)
        assert attn.page_size_bytes == page, (attn.page_size_bytes, page)
        mamba = MambaSpec(block_size=block_size, shapes=hybrid.mamba_shapes(), dtypes=(hybrid.dtype, hybrid.dtype),
                          mamba_cache_mode="align", page_size_padded=page)
        assert mamba.page_size_bytes == page, (mamba.page_size_bytes, page)
        self.page_bytes = page
        attn_names = [f"model.layers.{i}.mixer.attn" for i in range(hybrid.attn_layers)]
        ssm_names = [f"model.layers.{i + hybrid.attn_layers}.mixer" for i in range(hybrid.ssm_layers)]
        tensors = [KVCacheTensor(size=page * gpu_blocks, layers=[a, m], layer_stride=0, block_stride=page)
                   for a, m in zip(attn_names, ssm_names)]
        self.kv_cache_config = KVCacheConfig(
            num_blocks=gpu_blocks,
            kv_cache_tensors=tensors,
            kv_cache_groups=[KVCacheGroupSpec(attn_names, attn), KVCacheGroupSpec(ssm_names, mamba)],
        )
        self.scheduler = Scheduler(
            vllm_config=self.vllm_config,
            kv_cache_config=self.kv_cache_config,
            structured_output_manager=StructuredOutputManager(self.vllm_config),
            block_size=block_size,
            log_stats=True,
        )
        self.block_size = block_size
        init_none_hash(sha256_cbor)
        self.hasher = get_request_block_hasher(block_size, sha256_cbor)
        self._next = 0
        self.connector = self.scheduler.connector
        cs = self.connector.connector_scheduler
        self.manager = cs.manager
        # TieringOffloadingSpec: the CPU tier is the manager's primary tier.
        self.primary = getattr(self.manager, "primary_tier", self.manager)
        self.policy = getattr(self.primary, "_policy", None)
        self.tiers = list(getattr(self.manager, "secondary_tiers", ()))
        self._hit: dict = {}
        self._external: dict = {}
        # Records what the connector answers (the host tier's hit) without
        # changing it.
        inner = self.connector.get_num_new_matched_tokens

        def matched(request, num_computed_tokens):
            n, load_async = inner(request, num_computed_tokens)
            if n:
                self._external[request.request_id] = n
            return n, load_async

        self.connector.get_num_new_matched_tokens = matched

    @staticmethod
    def page_bytes_for(block_size: int, hybrid: Hybrid = TINY) -> int:
        """Bytes of one chunk (one block of one group) in the host tier."""
        return max(block_size * hybrid.attn_bytes_per_token(), hybrid.mamba_page_bytes())

    def run(self, prompt: list, output: list) -> dict:
        """Serves one request (prompt, then the tokens of `output` as its
        decoded tokens) to completion. Returns its prompt length, the
        tokens the GPU prefix cache and the offload tier gave it."""
        self._next += 1
        rid = f"r{self._next}"
        sp = SamplingParams(max_tokens=len(output), ignore_eos=True)
        req = Request(request_id=rid, prompt_token_ids=list(prompt), sampling_params=sp, pooling_params=None,
                      block_hasher=self.hasher)
        self.scheduler.add_request(req)
        outs = iter(output)
        steps = 0
        while self.scheduler.has_requests() or self.connector.connector_scheduler.has_pending_push_work():
            steps += 1
            if steps > 100000:
                raise RuntimeError("the scheduler did not finish the request")
            so = self.scheduler.schedule()
            for new in so.scheduled_new_reqs:
                self._hit.setdefault(new.req_id, new.num_computed_tokens)
            meta = so.kv_connector_metadata
            done: dict = {}
            recving: set = set()
            if isinstance(meta, OffloadingConnectorMetadata):
                for jid, job in meta.store_jobs.items():
                    done[jid] = 1
                for jid, job in meta.load_jobs.items():
                    done[jid] = 1
                    recving.add(job.req_id)
            sampled = []
            ids = []
            for r in self.scheduler.running:
                n = so.num_scheduled_tokens.get(r.request_id, 0)
                if n == 0:
                    continue
                ids.append(r.request_id)
                if r.num_computed_tokens + n >= r.num_tokens:
                    sampled.append([next(outs, 1)])
                else:
                    sampled.append([])
            out = ModelRunnerOutput(
                req_ids=ids,
                req_id_to_index={r: i for i, r in enumerate(ids)},
                sampled_token_ids=sampled,
                logprobs=None,
                prompt_logprobs_dict={},
                pooler_output=[],
                kv_connector_output=KVConnectorOutput(
                    finished_recving=recving or None,
                    kv_connector_worker_meta=OffloadingWorkerMetadata(completed_jobs=done),
                ),
            )
            self.scheduler.update_from_output(so, out)
        return {
            "prompt": len(prompt),
            "hit": self._hit.get(rid, 0),
            "host_hit": self._external.get(rid, 0),
        }


def serve(engine: "Engine", trace) -> tuple[int, int, int]:
    """Runs each (prompt, output) of `trace` through `engine`: (prompt
    tokens, hit tokens, host-tier hit tokens) summed."""
    tot = hit = host = 0
    for prompt, out in trace:
        r = engine.run(prompt, out)
        tot += r["prompt"]
        hit += r["hit"]
        host += r["host_hit"]
    return tot, hit, host
