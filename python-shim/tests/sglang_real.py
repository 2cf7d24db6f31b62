"""SGLang 0.5.23's own request life cycle over its own CPU pools, for any
tree cache (SGLang's UnifiedRadixCache or libmarconi's SGLangTreeCache).

Everything here is SGLang's code, imported from the pinned wheel: `Req`
and `Req.init_next_round_input` (the match, with copy-on-write of the
Mamba state), `tree.lock`, `alloc_req_slots` (the request row, its Mamba
slot and, in `extra_buffer` mode, its two ping-pong tracking slots),
`alloc_token_slots` / `alloc_paged_token_slots_extend` (KV, evicting from
the tree), `ScheduleBatch._mamba_radix_cache_v2_req_prepare_for_extend`
(where `extra_buffer` tracks the prefill's state, the branch point
included), `release_kv_cache` (checkpoint of the finished request, free of
the row, unlock, `on_release`), `release_req` (retraction) and the
scheduler's idle check (`SchedulerInvariantChecker._check_all_pools` over
`SchedulerPoolStatsObserver.get_pool_stats()`, `_check_req_pool`,
`_check_tree_cache`, strict: a leak raises). What the model would compute
is not computed: the pools hold no values that matter, and the output
tokens are given.

Needs SGLang importable (the wheel and the modules it imports; see
docs/sglang.md). Import this module before any other SGLang module: it
fixes the one model-config lookup the harness has no model for (the Mamba
state chunk, `CHUNK` tokens) before SGLang's scheduler modules bind it.
"""

from __future__ import annotations

import os
from array import array
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Optional

os.environ.setdefault("SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE", "1")
os.environ.setdefault("SGLANG_ENABLE_TREE_CACHE_SANITY_CHECK", "1")

import sglang.srt.runtime_context as _rc  # noqa: E402

CHUNK = 64
"""The Mamba state chunk (SGLang reads it from the model config): SGLang
tracks states every CHUNK tokens of a prefill."""
_rc.mamba_cache_chunk_size = lambda: CHUNK

import torch  # noqa: E402
from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape  # noqa: E402
from sglang.srt.disaggregation.utils import DisaggregationMode  # noqa: E402
from sglang.srt.environ import envs  # noqa: E402
from sglang.srt.managers.schedule_batch import FINISH_ABORT, FINISH_LENGTH, Req, ScheduleBatch, release_req  # noqa: E402
from sglang.srt.managers.scheduler_components.invariant_checker import SchedulerInvariantChecker  # noqa: E402
from sglang.srt.managers.scheduler_components.pool_stats_observer import SchedulerPoolStatsObserver  # noqa: E402
from sglang.srt.mem_cache.allocation import (  # noqa: E402
    alloc_paged_token_slots_extend,
    alloc_req_slots,
    alloc_token_slots,
)
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.common import release_kv_cache  # noqa: E402
from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, HybridReqToTokenPool  # noqa: E402
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType  # noqa: E402
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402
from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler  # noqa: E402


def pools(kv_tokens: int, mamba_slots: int, *, extra_buffer: bool, page_size: int = 1, rows: int = 16, context: int = 8192):
    """SGLang's CPU pools for a small Full + Mamba model (3 Mamba layers, 1
    attention layer), and the CacheInitParams a tree cache is built from
    (as SGLang's scheduler builds them). Sets SGLang's server arguments."""
    set_global_server_args_for_scheduler(ServerArgs(model_path="dummy", page_size=page_size))
    layers, full = 4, [3]
    mamba = [i for i in range(layers) if i not in full]
    with envs.SGLANG_MAMBA_SSM_DTYPE.override("bfloat16"):
        shape = Mamba2StateShape.create(
            tp_world_size=1, intermediate_size=64, n_groups=1, num_heads=2, head_dim=32, state_size=8, conv_kernel=4
        )
        cache_params = Mamba2CacheParams(shape=shape, layers=mamba)
    rtp = HybridReqToTokenPool(
        size=rows, mamba_size=mamba_slots, mamba_spec_state_size=rows, max_context_len=context, device="cpu",
        enable_memory_saver=False, cache_params=cache_params, mamba_layer_ids=mamba,
        enable_mamba_extra_buffer=extra_buffer, speculative_num_draft_tokens=3,
    )
    kv_pool = HybridLinearKVPool(
        size=kv_tokens, dtype=torch.bfloat16, page_size=page_size, head_num=1, head_dim=8,
        full_attention_layer_ids=full, device="cpu", enable_memory_saver=False, mamba_pool=rtp.mamba_pool,
    )
    if page_size == 1:
        alloc = TokenToKVPoolAllocator(size=kv_tokens, dtype=torch.bfloat16, device="cpu", kvcache=kv_pool, need_sort=False)
    else:
        alloc = PagedTokenToKVPoolAllocator(
            size=kv_tokens, page_size=page_size, dtype=torch.bfloat16, device="cpu", kvcache=kv_pool, need_sort=False
        )
    params = CacheInitParams(
        req_to_token_pool=rtp, token_to_kv_pool_allocator=alloc, page_size=page_size, disable=False,
        tree_components=(ComponentType.FULL, ComponentType.MAMBA), enable_mamba_extra_buffer=extra_buffer,
    )
    return params


def sglang_cache(params):
    """SGLang's own tree cache for a Full + Mamba model (what
    `--radix-cache-backend` selects by default)."""
    return UnifiedRadixCache(params=params)


@dataclass
class Counts:
    requests: int = 0
    finished: int = 0
    aborted: int = 0
    retracted: int = 0
    input_tokens: int = 0
    hit_tokens: int = 0
    branch_points: list = field(default_factory=list)


class Engine:
    """One scheduler's worth of SGLang's life cycle around `tree` (built
    from `params`): `step(batch)` admits a batch of requests (match, lock,
    slots, KV, the prefill's state tracking), then finishes, aborts or
    retracts each, as asked, and runs SGLang's idle check."""

    def __init__(self, tree, params):
        self.tree = tree
        self.rtp = params.req_to_token_pool
        self.alloc = params.token_to_kv_pool_allocator
        self.ps = params.page_size
        self.extra = params.enable_mamba_extra_buffer
        self.counts = Counts()
        self._rid = 0
        kv_total = self.alloc.size
        self.observer = SchedulerPoolStatsObserver(
            tree_cache=tree, token_to_kv_pool_allocator=self.alloc, req_to_token_pool=self.rtp,
            session_controller=SimpleNamespace(sessions={}), hisparse_coordinator=None, is_hybrid_swa=False,
            is_hybrid_ssm=True, enable_hisparse=False, full_tokens_per_layer=None, swa_tokens_per_layer=None,
            max_total_num_tokens=kv_total,
        )
        self.checker = SchedulerInvariantChecker(
            is_hybrid_swa=False, is_hybrid_ssm=True, disaggregation_mode=DisaggregationMode.NULL,
            page_size=self.ps, full_tokens_per_layer=None, swa_tokens_per_layer=None, max_total_num_tokens=kv_total,
            tree_cache=tree, token_to_kv_pool_allocator=self.alloc, req_to_token_pool=self.rtp,
            pool_stats_observer=self.observer, get_last_batch=lambda: None, get_running_batch=lambda: None,
            scheduler_stage_metrics=None,
        )
        # What ScheduleBatch's prefill preparation reads besides the request.
        self._batch = SimpleNamespace(
            model_config=SimpleNamespace(hf_text_config=SimpleNamespace(mamba_chunk_size=CHUNK)),
            tree_cache=tree, req_to_token_pool=self.rtp,
        )

    # -- SGLang's scheduler steps -------------------------------------------------

    def idle_check(self) -> None:
        """Scheduler.on_idle's pool check, strict (a leak raises)."""
        has_leak, messages = self.checker._check_all_pools(self.observer.get_pool_stats())
        if has_leak:
            self.checker._report_leak("pool", "\n".join(messages))
        self.checker._check_req_pool()
        self.checker._check_tree_cache()

    def new_req(self, tokens, max_new_tokens: int) -> Req:
        self._rid += 1
        return Req(str(self._rid), "", array("q", tokens), SamplingParams(max_new_tokens=max_new_tokens))

    def admit(self, req: Req) -> None:
        """The match (with the Mamba copy-on-write) and the lock the
        scheduler takes when the request joins a prefill batch."""
        req.init_next_round_input(self.tree)
        req.lock = self.tree.lock(req.last_node)
        self.counts.requests += 1
        self.counts.input_tokens += len(req.origin_input_ids)
        self.counts.hit_tokens += req.prefix_len
        if req.mamba_branching_seqlen is not None:
            self.counts.branch_points.append(req.mamba_branching_seqlen)

    def _extend(self, req: Req, start: int, end: int) -> None:
        """KV for row positions [start, end), allocated by SGLang's functions
        (which evict from the tree when the pool is short)."""
        row = self.rtp.req_to_token[req.kv.req_pool_idx]
        n = end - start
        if n <= 0:
            return
        if self.ps == 1:
            loc = alloc_token_slots(self.tree, n)
        else:
            last = row[start - 1 : start].to(torch.int64) if start > 0 else torch.full((1,), -1, dtype=torch.int64)
            t = torch.tensor
            loc = alloc_paged_token_slots_extend(self.tree, t([start]), t([start]), t([end]), t([end]), last, n)
        row[start:end] = loc.to(row.dtype)
        req.kv.kv_allocated_len = end
        req.kv.kv_committed_len = end

    def prefill(self, req: Req) -> None:
        """Slots (row, Mamba, ping-pong), the matched prefix written into the
        row, the prefill's KV, and the state tracking the prefill does in
        `extra_buffer` mode (at the prefill's end on the grid, or at the
        branch point the match returned)."""
        alloc_req_slots(self.rtp, [req], self.tree)
        row = self.rtp.req_to_token[req.kv.req_pool_idx]
        if req.prefix_len:
            row[: req.prefix_len] = self.tree.prefix_device_indices(req).to(row.dtype)
        req.extend_end = len(req.origin_input_ids)
        if self.extra:
            ScheduleBatch._mamba_radix_cache_v2_req_prepare_for_extend(self._batch, req)
        self._extend(req, req.prefix_len, req.extend_end)

    def decode(self, req: Req, output) -> None:
        """The output tokens; KV for all but the last (whose KV a finished
        request never computes)."""
        req.output_ids = array("q", output)
        self._extend(req, len(req.origin_input_ids), len(req.origin_input_ids) + len(output) - 1)

    def finish(self, req: Req) -> None:
        req.finished_reason = FINISH_LENGTH(len(req.output_ids))
        release_kv_cache(req, self.tree, checkpoint=True)
        self.counts.finished += 1

    def abort(self, req: Req) -> None:
        """An abort: SGLang releases the request without caching."""
        req.finished_reason = FINISH_ABORT("aborted")
        release_kv_cache(req, self.tree, checkpoint=False)
        self.counts.aborted += 1

    def retract(self, req: Req) -> None:
        """SGLang's retraction of a running request (release_req: released
        without caching, evict, reset for its later re-run)."""
        release_req(
            req=req, remaing_req_count=1, req_to_token_pool=self.rtp, token_to_kv_pool_allocator=self.alloc,
            tree_cache=self.tree, hisparse_coordinator=None,
        )
        self.counts.retracted += 1

    # -- a whole request ----------------------------------------------------------

    def step(self, batch: list, outcome: Optional[list] = None) -> list:
        """Serves `batch` ((tokens, output) pairs) as one prefill batch: all
        are matched and locked, then given slots and KV in turn, then each
        ends as `outcome` says ("finish", "abort" after its prefill,
        "abort_waiting" before any slot, "retract" after its prefill, which
        is then re-run to its finish); then SGLang's idle check. Returns the
        finished requests' Req objects (None for the others)."""
        outcome = outcome or ["finish"] * len(batch)
        reqs = [self.new_req(tokens, max(1, len(out))) for tokens, out in batch]
        for r in reqs:
            self.admit(r)
        done = []
        for r, (tokens, out), what in zip(reqs, batch, outcome):
            if what == "abort_waiting":
                # Aborted in the waiting queue: the match's lock is dropped and
                # the request released before it got a row.
                self.tree.unlock(r.lock)
                r.lock = None
                r.finished_reason = FINISH_ABORT("aborted")
                release_kv_cache(r, self.tree, checkpoint=False)
                self.counts.aborted += 1
                done.append(None)
                continue
            self.prefill(r)
            if what == "abort":
                self.abort(r)
                done.append(None)
                continue
            if what == "retract":
                self.retract(r)
                self.admit(r)
                self.prefill(r)
            self.decode(r, out)
            self.finish(r)
            done.append(r)
        self.idle_check()
        return done
