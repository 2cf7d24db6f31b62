"""A small PyTorch engine that delegates every prefix-caching decision to
libmarconi (`import marconi`) and checks every output against a no-cache run.

The model is a tiny random-weight NemotronH (Mamba-2 + attention + MLP
layers, transformers' own implementation, float32) whose ModelSpec is read
from its config by marconi.ModelSpec.from_hf_config. States live in slot
tensors indexed by the slot ids the engine hands libmarconi (and gets back on
eviction); KV lives in page tensors indexed by page ids the same way.

One request: lookup -> restore the cached state and KV of the hit -> prefill
the rest in chunks split at the planned positions, saving the states there
-> decode greedily -> admit (states and KV pages) -> release -> drain the
evicted ids back into the free lists. The same request is then run without
any cache (one prefill from token 0, then the same decoded tokens) and every
logit the cached run computed is compared with it.

    python examples/torch-engine/engine.py            # the workload, checked
    python examples/torch-engine/engine.py --fault zero_ssm   # must fail
    python examples/torch-engine/engine.py --hidden 512 --scale 4   # timing

The exit status is 0 when every request matches (without --fault), or when
the check caught the fault (with --fault); 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, NemotronHConfig, NemotronHForCausalLM

import marconi

TOLERANCE = 1e-5
"""Largest |logit difference| accepted between a cached and a no-cache run,
relative to the request's largest |logit| when that is above 1 (an absolute
1e-5 below). float32: a resumed run differs from a from-scratch one only in
summation order (the chunked SSM scan and attention see the same numbers
split at other positions). Measured: at most 2.6e-6 on the default model
(logits up to ~3); round-off grows with width and length (hidden 512, inputs
up to ~1000 tokens: 2.6e-5 absolute on logits up to 10.7, 2.4e-6 relative),
hence the relative bound. A lost state moves logits by ~1e-2 (zeroed SSM state) to ~1
(zeroed conv state): three orders of magnitude above the bound."""

FAULTS = ("zero_ssm", "zero_conv")


def tiny_nemotron_h(seed: int = 0, hidden: int = 64) -> tuple[NemotronHConfig, NemotronHForCausalLM]:
    """A random-weight NemotronH: 10 layers (4 Mamba-2, 2 attention, 4 MLP),
    hidden size `hidden` (a multiple of 32; 64 by default: 0.24 M
    parameters; 512: 12.6 M), heads of 16.

    initializer_range 0.1 (the default 0.02 makes a lost SSM state move the
    logits by ~1e-5, below what a check can tell from float noise); the SSM
    time step is unclamped in prefill and decode alike (time_step_limit
    (0, inf)), since transformers clamps it only in the chunked prefill."""
    torch.manual_seed(seed)
    cfg = NemotronHConfig(
        vocab_size=256,
        hidden_size=hidden,
        hybrid_override_pattern="M-M*-M-M*-",
        num_attention_heads=hidden // 16,
        num_key_value_heads=hidden // 32,
        head_dim=16,
        intermediate_size=2 * hidden,
        mamba_num_heads=hidden // 8,
        mamba_head_dim=16,
        ssm_state_size=16,
        n_groups=2,
        conv_kernel=4,
        initializer_range=0.1,
        time_step_limit=(0.0, math.inf),
        dtype="float32",
    )
    model = NemotronHForCausalLM(cfg).eval()
    for module in model.modules():
        if hasattr(module, "time_step_limit"):
            module.time_step_limit = (0.0, math.inf)
    return cfg, model


def layer_kinds(cache: DynamicCache) -> tuple[list[int], list[int]]:
    """(recurrent layer indices, attention layer indices) of a model's cache."""
    rec = [i for i, l in enumerate(cache.layers) if hasattr(l, "conv_states")]
    att = [i for i, l in enumerate(cache.layers) if type(l).__name__ == "DynamicLayer"]
    return rec, att


def measured_bytes(model, cfg, tokens: int = 24) -> dict:
    """The bytes the model's own cache holds after a prefill of `tokens`
    tokens: KV per token (every attention layer's key and value tensors) and
    one checkpoint (every recurrent layer's conv and SSM state tensors)."""
    cache = DynamicCache(config=cfg)
    ids = torch.arange(tokens)[None] % cfg.vocab_size
    with torch.no_grad():
        model(input_ids=ids, position_ids=torch.arange(tokens)[None], past_key_values=cache, use_cache=True)
    kv = state = 0
    shapes = {}
    for i, layer in enumerate(cache.layers):
        if hasattr(layer, "conv_states"):
            for t in list(layer.conv_states.values()) + list(layer.recurrent_states.values()):
                if t is not None:
                    state += t.numel() * t.element_size()
            shapes[i] = [tuple(t.shape) for t in (layer.conv_states[0], layer.recurrent_states[0]) if t is not None]
        keys = getattr(layer, "keys", None)
        if keys is not None and keys.numel():
            assert keys.shape[-2] == tokens
            kv += (keys.numel() * keys.element_size() + layer.values.numel() * layer.values.element_size()) // tokens
            shapes[i] = [tuple(keys.shape), tuple(layer.values.shape)]
    return {"kv_bytes_per_token": kv, "state_bytes": state, "shapes": shapes}


@dataclass
class Result:
    """One request served with the cache, and its comparison."""

    input_len: int
    hit_tokens: int
    prefill_tokens: int
    prefill_s: float
    ref_prefill_s: float
    max_diff: float
    max_logit: float
    states_offered: int
    states_taken: int
    output: list[int] = field(default_factory=list)

    @property
    def matches(self) -> bool:
        """Within TOLERANCE of the no-cache run."""
        return self.max_diff <= TOLERANCE * max(1.0, self.max_logit)


class Engine:
    """Serves requests on a model through a marconi.PrefixCache."""

    def __init__(
        self,
        cfg,
        model,
        capacity_bytes: int,
        *,
        page_size: int = 8,
        chunk_tokens: int = 64,
        max_request_tokens: int = 1024,
        max_states_per_request: int = 16,
        fault: str | None = None,
    ):
        if fault not in (None, *FAULTS):
            raise ValueError(f"fault: one of {FAULTS} or None, got {fault!r}")
        self.cfg, self.model, self.fault = cfg, model, fault
        self.P, self.chunk_tokens = page_size, chunk_tokens
        self.spec = marconi.ModelSpec.from_hf_config(cfg)
        self.cache = marconi.PrefixCache(
            capacity_bytes,
            model=self.spec,
            page_size=page_size,
            tuner_adoption="deterministic",
        )
        probe = DynamicCache(config=cfg)
        self.rec, self.att = layer_kinds(probe)
        mixer = model.model.layers[self.rec[0]].mixer
        self.conv_shape = (mixer.conv_dim, mixer.conv_kernel_size)
        self.ssm_shape = (mixer.num_heads, mixer.head_dim, mixer.ssm_state_size)
        stats = self.cache.stats()
        # The engine's pools hold what the cache may own (its capacity over
        # the library's byte sizes) plus one request in flight.
        n_slots = capacity_bytes // stats["state_bytes_per_entry"] + max_states_per_request
        n_pages = capacity_bytes // (stats["kv_bytes_per_token"] * page_size) + max_request_tokens // page_size + 1
        f32 = dict(dtype=torch.float32)
        self.conv_slots = torch.zeros((n_slots, len(self.rec), *self.conv_shape), **f32)
        self.ssm_slots = torch.zeros((n_slots, len(self.rec), *self.ssm_shape), **f32)
        kv_shape = (n_pages, len(self.att), cfg.num_key_value_heads, page_size, cfg.head_dim)
        self.k_pages = torch.zeros(kv_shape, **f32)
        self.v_pages = torch.zeros(kv_shape, **f32)
        self.free_slots = list(range(n_slots))[::-1]
        self.free_pages = list(range(n_pages))[::-1]
        # One slot and one page hold exactly what the library charges.
        assert self.conv_slots[0].nbytes + self.ssm_slots[0].nbytes == stats["state_bytes_per_entry"]
        assert self.k_pages[0].nbytes + self.v_pages[0].nbytes == stats["kv_bytes_per_token"] * page_size

    # -- state and KV movement ---------------------------------------------

    def _take(self, free: list, what: str) -> int:
        if not free:
            raise RuntimeError(f"engine out of {what}: the pools are sized from the cache capacity")
        return free.pop()

    def _save_state(self, cache: DynamicCache) -> int:
        slot = self._take(self.free_slots, "state slots")
        for j, li in enumerate(self.rec):
            layer = cache.layers[li]
            self.conv_slots[slot, j].copy_(layer.conv_states[0][0])
            self.ssm_slots[slot, j].copy_(layer.recurrent_states[0][0])
        return slot

    def _restore(self, lease) -> DynamicCache:
        cache = DynamicCache(config=self.cfg)
        h = lease.hit_tokens
        if h == 0:
            return cache
        slot = lease.state_slot
        assert slot is not None, "a hit on a model with recurrent layers resumes from a state"
        for j, li in enumerate(self.rec):
            conv = self.conv_slots[slot, j][None].clone()
            ssm = self.ssm_slots[slot, j][None].clone()
            if self.fault == "zero_conv":
                conv.zero_()
            if self.fault == "zero_ssm":
                ssm.zero_()
            cache.update_conv_state(conv, li, conv_kernel_size=conv.shape[-1])
            cache.update_recurrent_state(ssm, li)
        pages = torch.tensor(lease.kv_pages, dtype=torch.long)
        assert len(pages) * self.P == h, "one page per hit page"
        for j, li in enumerate(self.att):
            # [pages, kv_heads, P, hd] -> [1, kv_heads, h, hd]
            k = self.k_pages[pages, j].permute(1, 0, 2, 3).reshape(1, self.cfg.num_key_value_heads, h, -1)
            v = self.v_pages[pages, j].permute(1, 0, 2, 3).reshape(1, self.cfg.num_key_value_heads, h, -1)
            cache.update(k.clone(), v.clone(), li)
        assert cache.get_seq_length() == h
        return cache

    def _store_pages(self, cache: DynamicCache, first: int, last: int) -> list[int]:
        """New pages for tokens [first*P, last*P) of the request's cache."""
        ids = []
        for p in range(first, last):
            page = self._take(self.free_pages, "KV pages")
            lo, hi = p * self.P, (p + 1) * self.P
            for j, li in enumerate(self.att):
                self.k_pages[page, j].copy_(cache.layers[li].keys[0, :, lo:hi])
                self.v_pages[page, j].copy_(cache.layers[li].values[0, :, lo:hi])
            ids.append(page)
        return ids

    def _forward(self, cache, ids: list[int], start: int) -> torch.Tensor:
        x = torch.tensor([ids])
        pos = torch.arange(start, start + len(ids))[None]
        return self.model(input_ids=x, position_ids=pos, past_key_values=cache, use_cache=True).logits[0]

    # -- one request ---------------------------------------------------------

    @torch.no_grad()
    def serve(self, tokens: list[int], n_decode: int) -> Result:
        n_in = len(tokens)
        n_total = n_in + n_decode
        final = n_total - n_total % self.P  # the final state's position
        lease = self.cache.lookup(tokens)
        states, pages, hit_pages = [], [], 0
        try:
            h = lease.hit_tokens
            t0 = time.perf_counter()
            cache = self._restore(lease)
            # Prefill [h, n_in) in chunks, cut at every planned position (and
            # the final one when it falls in the input), at most chunk_tokens.
            save_at = {p for p in lease.plan if h < p <= n_in}
            if h < final <= n_in:
                save_at.add(final)
            cuts = sorted(save_at | set(range(h + self.chunk_tokens, n_in, self.chunk_tokens)) | {n_in})
            states, logits, pos = [], [], h
            for cut in cuts:
                if cut <= pos:
                    continue
                logits.append(self._forward(cache, tokens[pos:cut], pos))
                pos = cut
                if pos in save_at:
                    states.append((pos, self._save_state(cache)))
            prefill_s = time.perf_counter() - t0
            prefill_logits = torch.cat(logits)  # positions h .. n_in-1
            # Decode greedily; every decoded token is fed (its KV and state
            # are part of the admitted sequence).
            out, dec_logits, last = [], [], prefill_logits[-1]
            for _ in range(n_decode):
                tok = int(last.argmax())
                out.append(tok)
                last = self._forward(cache, [tok], pos)[-1]
                dec_logits.append(last)
                pos += 1
                if pos == final and final > n_in:
                    states.append((pos, self._save_state(cache)))
            seq = tokens + out
            # KV pages: the hit's (already the cache's), then new ones.
            hit_pages = h // self.P
            pages = list(lease.kv_pages) + self._store_pages(cache, hit_pages, final // self.P)
            res = self.cache.admit(lease, seq, states, kv_pages=pages if pages else None)
        except BaseException:
            # Admission is all or nothing: on any failure the cache took
            # nothing, so every slot and new page this request filled goes
            # back to the free lists (the hit's pages stay the cache's).
            self.free_slots.extend(slot for _, slot in states)
            self.free_pages.extend(pages[hit_pages:])
            raise
        finally:
            if not lease.released:
                lease.release()
        # Ownership: what the cache did not take comes back to the pools.
        for (_, slot), taken in zip(states, res.taken):
            if not taken:
                self.free_slots.append(slot)
        for i in range(hit_pages, len(pages)):
            if i not in res.kv_pages_taken:
                self.free_pages.append(pages[i])
        freed_pages, freed_slots = self.cache.drain_freed()
        self.free_pages.extend(freed_pages)
        self.free_slots.extend(freed_slots)

        # The same request without any cache.
        t0 = time.perf_counter()
        ref_cache = DynamicCache(config=self.cfg)
        ref_prefill = self._forward(ref_cache, tokens, 0)
        ref_prefill_s = time.perf_counter() - t0
        ref_dec = []
        for i, tok in enumerate(out):
            ref_dec.append(self._forward(ref_cache, [tok], n_in + i)[-1])
        diff = (prefill_logits - ref_prefill[h:]).abs().max().item()
        if n_decode:
            diff = max(diff, (torch.stack(dec_logits) - torch.stack(ref_dec)).abs().max().item())
        return Result(
            input_len=n_in,
            hit_tokens=h,
            prefill_tokens=n_in - h,
            prefill_s=prefill_s,
            ref_prefill_s=ref_prefill_s,
            max_diff=diff,
            max_logit=max(ref_prefill.abs().max().item(), max((x.abs().max().item() for x in ref_dec), default=0.0)),
            states_offered=len(states),
            states_taken=res.states_taken,
            output=out,
        )


def chat_workload(seed: int, sessions: int = 10, systems: int = 2, turns: int = 3, scale: int = 1):
    """A multi-session chat generator: `systems` shared system prompts,
    sessions that each start from one of them or branch off another
    session's history at a turn boundary, user turns of random tokens; the
    assistant's turns are what the engine decodes; `scale` multiplies the
    prompt and turn lengths. Yields (session, user
    tokens); the caller sends back the session's new history."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(48 * scale, 96 * scale))] for _ in range(systems)]
    histories: dict[int, list[int]] = {}
    snapshots: list[list[int]] = []  # histories at turn boundaries, to branch from
    todo = {s: turns for s in range(sessions)}
    while todo:
        s = rng.choice(sorted(todo))
        if s not in histories:
            if snapshots and rng.random() < 0.4:
                histories[s] = list(rng.choice(snapshots))  # a branch
            else:
                histories[s] = list(rng.choice(prompts))
        user = [rng.randrange(256) for _ in range(rng.randint(8 * scale, 40 * scale))]
        new_history = yield s, histories[s] + user
        histories[s] = new_history
        snapshots.append(list(new_history))
        todo[s] -= 1
        if not todo[s]:
            del todo[s]


def run(seed: int = 0, *, fault: str | None = None, capacity_states: int = 6, decode: int = 6,
        sessions: int = 10, hidden: int = 64, scale: int = 1, verbose: bool = False) -> dict:
    """Serves the chat workload; returns the summary (per-request results
    under "requests")."""
    cfg, model = tiny_nemotron_h(seed, hidden)
    spec = marconi.ModelSpec.from_hf_config(cfg)
    with marconi.PrefixCache(1, model=spec) as probe:
        sizes = probe.stats()
    # Room for a few checkpoints and a few hundred tokens of KV: the
    # workload's distinct tokens and states do not fit, so the cache evicts.
    capacity = capacity_states * sizes["state_bytes_per_entry"] + 384 * scale * sizes["kv_bytes_per_token"]
    engine = Engine(cfg, model, capacity, fault=fault, chunk_tokens=64 * scale, max_request_tokens=1024 * scale)
    results = []
    gen = chat_workload(seed, sessions=sessions, scale=scale)
    msg = None
    try:
        while True:
            s, tokens = gen.send(msg)
            r = engine.serve(tokens, decode)
            results.append(r)
            if verbose:
                print(
                    f"req {len(results):3} session {s:2} input {r.input_len:4} hit {r.hit_tokens:4} "
                    f"states {r.states_taken}/{r.states_offered} max|dlogit| {r.max_diff:.2e}"
                )
            msg = tokens + r.output
    except StopIteration:
        pass
    stats = engine.cache.stats()
    engine.cache.check()
    hit = [r for r in results if r.hit_tokens]
    return {
        "fault": fault,
        "tolerance": TOLERANCE,
        "requests": len(results),
        "requests_with_hit": len(hit),
        "input_tokens": sum(r.input_len for r in results),
        "hit_tokens": sum(r.hit_tokens for r in results),
        "prefill_tokens_cached": sum(r.prefill_tokens for r in results),
        "prefill_tokens_no_cache": sum(r.input_len for r in results),
        "prefill_s_cached": sum(r.prefill_s for r in results),
        "prefill_s_no_cache": sum(r.ref_prefill_s for r in results),
        "max_diff": max(r.max_diff for r in results),
        "max_diff_on_hits": max((r.max_diff for r in hit), default=0.0),
        "max_logit": max(r.max_logit for r in results),
        "max_relative_diff": max(r.max_diff / max(1.0, r.max_logit) for r in results),
        "mismatched_requests": sum(not r.matches for r in results),
        "evictions": stats["evictions"],
        "capacity_bytes": capacity,
        "kv_bytes_per_token": stats["kv_bytes_per_token"],
        "state_bytes_per_entry": stats["state_bytes_per_entry"],
        "results": results,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sessions", type=int, default=10)
    ap.add_argument("--fault", choices=FAULTS)
    ap.add_argument("--hidden", type=int, default=64, help="model width (multiple of 32)")
    ap.add_argument("--scale", type=int, default=1, help="multiplies prompt and turn lengths")
    ap.add_argument("--json", action="store_true", help="print the summary as JSON")
    ap.add_argument("-v", "--verbose", action="store_true", help="one line per request")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    s = run(a.seed, fault=a.fault, sessions=a.sessions, hidden=a.hidden, scale=a.scale, verbose=a.verbose)
    s.pop("results")
    if a.json:
        print(json.dumps(s, indent=1))
    else:
        saved = 1 - s["prefill_s_cached"] / s["prefill_s_no_cache"]
        print(
            f"requests {s['requests']} ({s['requests_with_hit']} with a hit), evictions {s['evictions']}\n"
            f"hit tokens {s['hit_tokens']} of {s['input_tokens']} input tokens\n"
            f"prefill tokens: {s['prefill_tokens_cached']} with libmarconi, "
            f"{s['prefill_tokens_no_cache']} without\n"
            f"prefill time: {s['prefill_s_cached']:.2f} s with libmarconi (restore included), "
            f"{s['prefill_s_no_cache']:.2f} s without ({saved:.0%} saved)\n"
            f"max |logit difference| vs no cache: {s['max_diff']:.2e} "
            f"(on hits {s['max_diff_on_hits']:.2e}; largest |logit| {s['max_logit']:.2f}; "
            f"relative {s['max_relative_diff']:.2e}, tolerance {TOLERANCE:g}); "
            f"requests over it: {s['mismatched_requests']}"
        )
    failed = s["mismatched_requests"] > 0
    if a.fault:
        print(f"fault {a.fault}: {'caught' if failed else 'NOT caught'} by the check")
        return 0 if failed else 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
