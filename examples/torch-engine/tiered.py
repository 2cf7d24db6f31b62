"""The torch engine over libmarconi's cache with lower tiers
(marconi.PrefixCache(tiers=marconi.Tiers(...)), docs/tiers.md): the device
tier is the engine's slot and page tensors (as in engine.py), the host tier
is engine memory holding evicted chains (a state and the KV of its tokens,
cloned tensors keyed by the tokens), the store is a marconi.Store (a
directory here) shared by engines.

Engine A serves a chat workload writing every state through to the store;
engine B, a fresh engine with its own empty cache and pools, continues A's
sessions and resumes from the states A stored. Every request of both is
compared with a no-cache run (within engine.TOLERANCE); with every store
object corrupted, B's loads miss (counted) and it recomputes.

    python examples/torch-engine/tiered.py /tmp/store-dir
"""

from __future__ import annotations

import random
import sys
import time

import torch
from transformers import DynamicCache

import marconi
from engine import TOLERANCE, Engine, chat_workload, tiny_nemotron_h


class TieredEngine(Engine):
    """Engine whose cache is a marconi.PrefixCache with a host tier and,
    when `store` is given, a store tier shared through it."""

    def __init__(self, cfg, model, capacity_bytes: int, *, host_bytes: int, store: marconi.Store | None,
                 write: str = "back", **kw):
        super().__init__(cfg, model, capacity_bytes, **kw)
        self.cache.close()
        sizes = dict(state=self.conv_slots[0].nbytes + self.ssm_slots[0].nbytes,
                     kv=(self.k_pages[0].nbytes + self.v_pages[0].nbytes) // self.P)
        self.store = store
        self.cache = marconi.PrefixCache(
            capacity_bytes, self.spec, page_size=self.P, tuner_adoption="deterministic",
            tiers=marconi.Tiers(
                host_bytes=host_bytes,
                # Rates of this CPU engine: every load beats recomputing.
                host_gbps=5, host_latency_us=10, compute_flops=1e9,
                store_bytes=(4096 * sizes["state"] + 65536 * sizes["kv"]) if store is not None else 0,
                store_gbps=1, store_latency_us=200, store_states_hold_kv=True, write=write,
            ),
        )
        self.host: dict[tuple, tuple] = {}
        self.slot_chain: dict[int, tuple] = {}
        self.page_key: dict[int, tuple] = {}
        self.page_of: dict[tuple, int] = {}
        self.counts = dict(device=0, host=0, store=0, shared=0, load_misses=0, host_writes=0, host_drops=0,
                           store_writes=0, store_put_failures=0)

    # -- chains: (conv [rec, ...], ssm [rec, ...], K [att, heads, p, hd], V) --

    def _chain_from_device(self, chain: tuple, request: DynamicCache, seq: list[int]):
        slot = next((s for s, c in self.slot_chain.items() if c == chain), None)
        if slot is None:
            raise RuntimeError("the tiers asked for a host copy of a state no slot holds")
        p = len(chain)
        if tuple(seq[:p]) == chain and request.get_seq_length() >= p:
            k = torch.stack([request.layers[li].keys[0, :, :p] for li in self.att])
            v = torch.stack([request.layers[li].values[0, :, :p] for li in self.att])
        else:
            pages = [self.page_of[chain[: (i + 1) * self.P]] for i in range(p // self.P)]
            idx = torch.tensor(pages, dtype=torch.long)
            heads = self.cfg.num_key_value_heads
            k = self.k_pages[idx].permute(1, 2, 0, 3, 4).reshape(len(self.att), heads, p, -1)
            v = self.v_pages[idx].permute(1, 2, 0, 3, 4).reshape(len(self.att), heads, p, -1)
        return (self.conv_slots[slot].clone(), self.ssm_slots[slot].clone(), k.clone(), v.clone())

    @staticmethod
    def _to_bytes(c) -> bytes:
        return torch.cat([t.reshape(-1) for t in c]).numpy().tobytes()

    def _from_bytes(self, data: bytes, p: int):
        flat = torch.frombuffer(bytearray(data), dtype=torch.float32)
        kv = (len(self.att), self.cfg.num_key_value_heads, p, self.cfg.head_dim)
        shapes = [tuple(self.conv_slots[0].shape), tuple(self.ssm_slots[0].shape), kv, kv]
        out, at = [], 0
        for s in shapes:
            n = 1
            for d in s:
                n *= d
            out.append(flat[at:at + n].reshape(s))
            at += n
        if at != flat.numel():
            return None  # another layout: a miss
        return tuple(out)

    def _restore_chain(self, c, h: int) -> DynamicCache:
        conv, ssm, k, v = c
        cache = DynamicCache(config=self.cfg)
        for j, li in enumerate(self.rec):
            x = conv[j][None].clone()
            cache.update_conv_state(x, li, conv_kernel_size=x.shape[-1])
            cache.update_recurrent_state(ssm[j][None].clone(), li)
        for j, li in enumerate(self.att):
            cache.update(k[j][None].clone(), v[j][None].clone(), li)
        assert cache.get_seq_length() == h
        return cache

    class _DeviceLease:
        """What Engine._restore reads of a lease."""

        def __init__(self, h, slot, pages):
            self.hit_tokens, self.state_slot, self.kv_pages = h, slot, pages

    def _apply_ops(self, request: DynamicCache, seq: list[int]) -> None:
        for op in self.cache.drain_ops():
            chain = tuple(op.tokens)
            if op.kind == "write" and op.tier == "host":
                self.host[chain] = self._chain_from_device(chain, request, seq)
                self.counts["host_writes"] += 1
            elif op.kind == "write":
                try:
                    self.store.put_state(op.tokens, op.position, self._to_bytes(self.host[chain]))
                    self.counts["store_writes"] += 1
                except marconi.MarconiError as e:
                    if e.name != "BACKEND_FAILURE":
                        raise
                    self.counts["store_put_failures"] += 1
            elif op.tier == "host":
                del self.host[chain]
                self.counts["host_drops"] += 1

    @torch.no_grad()
    def serve(self, tokens: list[int], n_decode: int):
        n_in = len(tokens)
        n_total = n_in + n_decode
        final = n_total - n_total % self.P
        hit = self.cache.lookup_tiered(tokens, store=self.store)
        h, cache = hit.hit_tokens, None
        t0 = time.perf_counter()
        if hit.tier != "device":
            c = None
            if hit.tier == "host":
                c = self.host.get(tuple(tokens[:h]))
            else:
                data = self.store.get_state(tokens, h)
                c = self._from_bytes(data, h) if data is not None else None
            if c is None:
                self.cache.report_load_failure(hit.lease)
                self.counts["load_misses"] += 1
                h = hit.device_hit_tokens
            else:
                cache = self._restore_chain(c, h)
                self.counts[hit.tier] += 1
                self.counts["shared"] += hit.shared
        if cache is None:
            pages = hit.kv_pages[: h // self.P]
            cache = self._restore(self._DeviceLease(h, hit.device_state_slot, pages))
            self.counts["device"] += h > 0
        save_at = {p for p in hit.plan if h < p <= n_in}
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
        prefill_logits = torch.cat(logits)
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
        for p, slot in states:
            self.slot_chain[slot] = tuple(seq[:p])
        # The device's hit pages (already the cache's), then new pages from
        # the request's KV (what a lower-tier load brought in included).
        dev_pages = hit.device_hit_tokens // self.P
        pages = list(hit.kv_pages[:dev_pages]) + self._store_pages(cache, dev_pages, final // self.P)
        res = self.cache.admit(hit.lease, seq, states, kv_pages=pages if pages else None)
        self.cache.release(hit.lease)
        for i in res.kv_pages_taken:
            key = tuple(seq[: (i + 1) * self.P])
            self.page_of[key] = pages[i]
            self.page_key[pages[i]] = key
        # The ops first: a state the device did not take may go straight to
        # the host, copied from its slot.
        self._apply_ops(cache, seq)
        for (_, slot), taken in zip(states, res.taken):
            if not taken:
                self.free_slots.append(slot)
                del self.slot_chain[slot]
        for i in range(dev_pages, len(pages)):
            if i not in res.kv_pages_taken:
                self.free_pages.append(pages[i])
        freed_pages, freed_slots = self.cache.drain_freed()
        for pg in freed_pages:
            key = self.page_key.pop(pg, None)
            if key is not None:
                self.page_of.pop(key, None)
        for s in freed_slots:
            del self.slot_chain[s]
        self.free_pages.extend(freed_pages)
        self.free_slots.extend(freed_slots)

        ref_cache = DynamicCache(config=self.cfg)
        ref_prefill = self._forward(ref_cache, tokens, 0)
        ref_dec = [self._forward(ref_cache, [tok], n_in + i)[-1] for i, tok in enumerate(out)]
        diff = (prefill_logits - ref_prefill[h:]).abs().max().item()
        if n_decode:
            diff = max(diff, (torch.stack(dec_logits) - torch.stack(ref_dec)).abs().max().item())
        scale = max(1.0, ref_prefill.abs().max().item(), max((x.abs().max().item() for x in ref_dec), default=0.0))
        return h, out, diff / scale, prefill_s


def run_pair(store_dir: str, seed: int = 0, sessions: int = 8) -> dict:
    """A serves the chat workload into the store; B continues A's sessions."""
    cfg, model = tiny_nemotron_h(seed, 64)
    spec = marconi.ModelSpec.from_hf_config(cfg)
    with marconi.PrefixCache(1, model=spec) as probe:
        sizes = probe.stats()
    capacity = 6 * sizes["state_bytes_per_entry"] + 384 * sizes["kv_bytes_per_token"]
    host = 12 * sizes["state_bytes_per_entry"] + 768 * sizes["kv_bytes_per_token"]
    out = {}
    with marconi.Store("dir", store_dir, model=f"tiny nemotron-h seed {seed} torch f32 chains", block_size=8) as st:
        def engine(write):
            return TieredEngine(cfg, model, capacity, host_bytes=host, store=st, write=write, chunk_tokens=64)

        a = engine("through")
        gen = chat_workload(seed, sessions=sessions)
        msg, last, worst_a, n_a = None, {}, 0.0, 0
        try:
            while True:
                s, tokens = gen.send(msg)
                h, o, rel, _ = a.serve(tokens, 6)
                worst_a, n_a = max(worst_a, rel), n_a + 1
                msg = last[s] = tokens + o
        except StopIteration:
            pass
        out["a"] = dict(a.counts, requests=n_a, max_relative_diff=worst_a, stats=a.cache.tier_stats())
        a.cache.close()

        def continue_sessions(tag):
            b = engine("back")
            rng = random.Random(seed + 1)
            worst, n, hit_tokens, input_tokens = 0.0, 0, 0, 0
            for s in sorted(last):
                tokens = last[s] + [rng.randrange(256) for _ in range(rng.randint(8, 40))]
                h, o, rel, _ = b.serve(tokens, 6)
                worst, n = max(worst, rel), n + 1
                hit_tokens, input_tokens = hit_tokens + h, input_tokens + len(tokens)
            out[tag] = dict(b.counts, requests=n, max_relative_diff=worst, hit_tokens=hit_tokens,
                            input_tokens=input_tokens, stats=b.cache.tier_stats())
            b.cache.close()

        continue_sessions("b")
        for f in list(__import__("pathlib").Path(store_dir).iterdir()):
            if f.is_file():
                data = bytearray(f.read_bytes())
                data[len(data) // 2] ^= 0xFF
                f.write_bytes(bytes(data))
        continue_sessions("b_corrupt")
        out["store"] = st.stats()
    return out


if __name__ == "__main__":
    torch.set_num_threads(1)
    r = run_pair(sys.argv[1])
    for k in ("a", "b", "b_corrupt"):
        v = dict(r[k])
        v.pop("stats")
        print(k, v)
    print("store", r["store"])
    ok = (r["b"]["shared"] > 0 and r["b_corrupt"]["load_misses"] > 0
          and max(r[k]["max_relative_diff"] for k in ("a", "b", "b_corrupt")) <= TOLERANCE)
    print("PASS" if ok else "FAIL")
    sys.exit(0 if ok else 1)
