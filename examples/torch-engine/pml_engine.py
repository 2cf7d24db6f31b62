"""Prompt modules (Prompt Cache's PML) served by a PyTorch engine: each
module's states are computed once, alone, at the positions its schema fixes,
and reused wherever a prompt imports it; the layout (segments, position ids,
cached or computed) comes from libmarconi (`marconi.pml.Schema.layout`), and
which segments are served from which entry from libmarconi's module store
(`marconi.pml.ModuleCache`): the engine keeps the tensors keyed by the
store's entry ids, admits what it computes and frees what the store evicts.

Three ways to serve a prompt's cached segments:

- attention (a Llama, RoPE by position ids): every module's KV, computed
  alone at its schema positions, is concatenated in layout order and only
  the arguments and the prompt's text are prefilled (Prompt Cache §3.4,
  §4.2: discontinuous position ids);
- exact (a hybrid NemotronH): the leading run of modules (from position 0,
  no gap) is served from the store's exact entries (per segment: its KV
  computed in context, and the SSM and conv states at its end), the rest is
  prefilled; equal to a full prefill within engine.py's TOLERANCE;
- composed (NemotronH, HYPIC-style): after the exact run, each cached
  segment's first `window` tokens are recomputed in context, and the rest of
  it is composed: per Mamba-2 layer h(A.B) = Phi_B h(A) + h_B(0), with Phi_B
  the per-head decay over the segment and h_B(0) the state its tokens give
  from zero (both from the module's run alone), its conv state and its
  attention KV from that run too. Approximate: in a stack of layers a
  segment's inputs to every layer above the first depend on its context.

    python examples/torch-engine/pml_engine.py --table           # the table
    python examples/torch-engine/pml_engine.py --table --smoke   # CI size

The models for the table are trained here for a few minutes on a byte
tokenizer over /usr/share/common-licenses (Debian's base-files), cached
under the cargo target dir; nothing is stored in git.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import random
import statistics
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from xml.sax.saxutils import escape

import torch
import torch.nn.functional as F
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from engine import TOLERANCE, layer_kinds, measured_bytes, tiny_nemotron_h
from marconi.pml import MarconiError, ModuleCache, Schema

MODES = ("attention", "exact", "composed")
WINDOWS = (0, 4, 16, 64)
"""The composed mode's boundary windows the table reports (and the ones a
module's encoding keeps states for, by default)."""


@dataclass
class ExactEntry:
    """What the engine keeps for one exact entry of the store (a segment of
    a leading run, computed in context from position 0): the segment's KV
    in every attention layer and, for hybrids, every recurrent layer's
    (conv, ssm) state at its end."""

    kv: dict
    states: list


def tensor_bytes(obj) -> int:
    """Bytes of the tensors in `obj` (nested dicts, lists, tuples, dataclasses)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    if hasattr(obj, "__dataclass_fields__"):
        return sum(tensor_bytes(getattr(obj, f)) for f in obj.__dataclass_fields__)
    return 0


# -- models ----------------------------------------------------------------------


def tiny_llama(seed: int = 0, hidden: int = 64, layers: int = 2) -> tuple[LlamaConfig, LlamaForCausalLM]:
    """A Llama over bytes (vocab 256), float32, RoPE by position ids."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 16,
        num_key_value_heads=hidden // 32,
        head_dim=16,
        max_position_embeddings=8192,
        initializer_range=0.1,
        dtype="float32",
    )
    return cfg, LlamaForCausalLM(cfg).eval()


def corpus() -> bytes:
    """The training text: Debian's licence texts, read from the installed
    system (base-files ships /usr/share/common-licenses)."""
    root = Path("/usr/share/common-licenses")
    files = sorted(p for p in root.iterdir() if p.is_file() and not p.is_symlink())
    if not files:
        raise RuntimeError(f"{root}: no licence texts (Debian's base-files package ships them)")
    return b"\n\n".join(p.read_bytes() for p in files)


def cache_dir() -> Path:
    d = Path(os.environ.get("CARGO_TARGET_DIR", Path(__file__).resolve().parents[2] / "target")) / "pml-engine"
    d.mkdir(parents=True, exist_ok=True)
    return d


FULL_TRAINING = dict(steps=300, hidden=128, seq=1024, batch=1)
"""The table's models: 5 to 15 minutes each on one loaded CPU core. Windows
of 1024 bytes: the table's prompts span at most that many positions, so no
query-key distance is outside what the Llama was trained on (RoPE depends
on relative positions only)."""
SMOKE_TRAINING = dict(steps=15, hidden=64, seq=64, batch=8)
"""CI's: seconds; the models barely leave their random start."""


def trained(family: str, steps: int, seed: int = 0, hidden: int = 128, seq: int = 128, batch: int = 8):
    """A `family` ("llama" or "nemotron_h") model trained `steps` AdamW steps
    on `corpus()`; the weights are cached under the target dir by every
    argument and the corpus's hash. Returns (cfg, model, final training
    loss in nats per byte)."""
    data = corpus()
    tag = hashlib.sha256(data + f"{family}-{steps}-{seed}-{hidden}-{seq}-{batch}".encode()).hexdigest()[:16]
    if family == "llama":
        cfg, model = tiny_llama(seed, hidden, layers=4)
    else:
        cfg, model = tiny_nemotron_h(seed, hidden)
    path = cache_dir() / f"{family}-{tag}.pt"
    if path.exists():
        state = torch.load(path, weights_only=True)
        loss = float(state.pop("_loss"))
        model.load_state_dict(state)
        return cfg, model.eval(), loss
    text = torch.tensor(list(data), dtype=torch.long)
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    model.train()
    losses = []
    for step in range(steps):
        for group in opt.param_groups:  # linear warm-up, cosine decay
            group["lr"] = 3e-3 * min(1.0, (step + 1) / 20) * 0.5 * (1 + math.cos(math.pi * step / steps))
        at = torch.randint(0, len(text) - seq - 1, (batch,), generator=g)
        x = torch.stack([text[i : i + seq + 1] for i in at.tolist()])
        logits = model(input_ids=x[:, :-1]).logits
        loss = F.cross_entropy(logits.reshape(-1, 256), x[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    model.eval()
    loss = statistics.mean(losses[-10:])
    tmp = path.with_suffix(".tmp")
    torch.save({**model.state_dict(), "_loss": torch.tensor(loss)}, tmp)
    tmp.replace(path)
    return cfg, model, loss


# -- the engine ------------------------------------------------------------------


@dataclass
class Encoded:
    """One module computed alone: its tokens in schema order, per segment
    (start, len, offset in the run); the attention layers' KV over the run;
    for a hybrid, the states at cut points (offset -> per recurrent layer
    (conv, ssm)) and the cumulative log-decay per recurrent layer
    ([tokens + 1, heads]: sum of dt * A)."""

    segments: list
    kv: dict
    states: dict
    logdecay: dict


class PmlEngine:
    """Serves PML prompts on a model (Llama: attention mode; NemotronH:
    exact and composed). The bookkeeping is libmarconi's module store
    (`marconi.pml.ModuleCache`, one byte budget); the tensors are the
    engine's, keyed by the store's entry ids: an `Encoded` per module entry
    (a module computed alone), an `ExactEntry` per exact entry (a segment of
    a leading run computed in context). The engine admits what it computes,
    frees the tensors of every entry the store evicts, and serves each
    segment as the store's lookup says.

    Sizes come from the model's own tensors: KV bytes per token and the
    recurrent state as engine.py's `measured_bytes` measures them after a
    prefill, the transition operator as the bytes of one Phi (a decay per
    head of every Mamba-2 layer). `windows`: the composed windows a module's
    encoding keeps states for (a composed lookup with another is refused)."""

    def __init__(self, cfg, model, capacity_bytes: int = 1 << 30, windows: tuple = WINDOWS):
        self.cfg, self.model = cfg, model
        probe = DynamicCache(config=cfg)
        self.rec, self.att = layer_kinds(probe)
        self.hybrid = bool(self.rec)
        self.windows = tuple(windows)
        sizes = measured_bytes(model, cfg)
        self.kv_bytes_per_token, self.state_bytes = sizes["kv_bytes_per_token"], sizes["state_bytes"]
        self.operator_bytes = 0
        if self.hybrid:
            self.kernel = model.model.layers[self.rec[0]].mixer.conv_kernel_size
            sink: dict = {}
            hooks = self._logdecay_hooks(sink)
            try:
                self._forward(DynamicCache(config=cfg), [0, 1], [0, 1])
            finally:
                for h in hooks:
                    h.remove()
            # One Phi: exp(sum of dt * A) over a segment, per head, per layer.
            self.operator_bytes = sum(tensor_bytes(torch.exp(torch.cat(v).sum(0))) for v in sink.values())
        self.store = ModuleCache(capacity_bytes, self.kv_bytes_per_token, self.state_bytes, self.operator_bytes)
        self.entries: dict[int, object] = {}
        """Entry id -> its tensors (Encoded or ExactEntry)."""
        self.freed: deque = deque(maxlen=4096)
        """Ids of the last 4096 entries the store evicted, whose tensors were dropped."""

    # -- the store -----------------------------------------------------------------

    def register(self, schema: Schema) -> int:
        """Registers `schema` with the store (its modules pinned); frees
        what the registration evicted."""
        sid = self.store.register(schema)
        self._free_evicted()
        return sid

    def unregister(self, schema: Schema) -> None:
        """Drops one registration: its modules become evictable."""
        self.store.unregister(schema)

    def _free_evicted(self) -> None:
        for e in self.store.evicted():
            self.entries.pop(e, None)
            self.freed.append(e)

    def _tensors(self, entry: int, kind: type):
        t = self.entries.get(entry)
        if not isinstance(t, kind):
            raise RuntimeError(f"the store serves entry {entry}, which the engine does not hold as {kind.__name__}")
        return t

    def _admit(self, schema: Schema, seg, served, tensors) -> None:
        """Admits `seg`'s module (the store's answer `served` says which)
        with `tensors` (its Encoded)."""
        if seg.kind == "anonymous":
            entry = self.store.admit(schema, anonymous=served.module)
        else:
            entry = self.store.admit(schema, seg.name)
        self.entries.setdefault(entry, tensors)

    def held_bytes(self) -> int:
        """Bytes of the tensors the engine holds for the store's entries."""
        return sum(tensor_bytes(t) for t in self.entries.values())

    # -- one forward ------------------------------------------------------------

    def _forward(self, cache, tokens: list, positions: list) -> torch.Tensor:
        x = torch.tensor([tokens])
        pos = torch.tensor([positions])
        return self.model(input_ids=x, position_ids=pos, past_key_values=cache, use_cache=True).logits[0]

    def _logdecay_hooks(self, sink: dict):
        """Hooks that append each Mamba-2 mixer's dt * A ([tokens, heads])
        to sink[layer], computed from the mixer's own input as it does."""
        hooks = []
        for li in self.rec:
            mixer = self.model.model.layers[li].mixer

            def hook(mod, args, kwargs, li=li):
                hs = args[0] if args else kwargs["hidden_states"]
                proj = mod.in_proj(hs)
                dt = proj[..., mod.intermediate_size + mod.conv_dim :]
                dt = F.softplus(dt + mod.dt_bias).clamp(*mod.time_step_limit)
                sink.setdefault(li, []).append((dt * -torch.exp(mod.A_log.float()))[0])

            hooks.append(mixer.register_forward_pre_hook(hook, with_kwargs=True))
        return hooks

    def _states(self, cache) -> list:
        return [
            (cache.layers[li].conv_states[0].clone(), cache.layers[li].recurrent_states[0].clone()) for li in self.rec
        ]

    def _set_states(self, cache, states) -> None:
        for li, (conv, ssm) in zip(self.rec, states):
            layer = cache.layers[li]
            if layer.is_conv_states_initialized[0] and layer.has_previous_state[0]:
                layer.conv_states[0].copy_(conv)
                layer.recurrent_states[0].copy_(ssm)
            else:
                cache.update_conv_state(conv.clone(), li, conv_kernel_size=conv.shape[-1])
                cache.update_recurrent_state(ssm.clone(), li)

    def _append_kv(self, cache, kv: dict, lo: int, hi: int) -> None:
        for li in self.att:
            k, v = kv[li]
            cache.update(k[:, :, lo:hi].clone(), v[:, :, lo:hi].clone(), li)

    # -- encoding ----------------------------------------------------------------

    @torch.no_grad()
    def encode(self, segs: list) -> Encoded:
        """Computes one module alone, from an empty cache, at its schema
        positions: `segs` are its cached segments (from a layout)."""
        segs = sorted(segs, key=lambda s: s.start)
        tokens = [t for s in segs for t in s.tokens]
        positions = [p for s in segs for p in range(s.start, s.start + s.len)]
        offsets, off = [], 0
        for s in segs:
            offsets.append((s.start, s.len, off))
            off += s.len
        cuts = {0, len(tokens)}
        if self.hybrid:
            for _, n, o in offsets:
                cuts |= {o, o + n} | {o + min(w, n) for w in self.windows}
        cache = DynamicCache(config=self.cfg)
        sink: dict = {}
        hooks = self._logdecay_hooks(sink) if self.hybrid else []
        states = {}
        try:
            pos = 0
            for cut in sorted(cuts):
                if cut > pos:
                    self._forward(cache, tokens[pos:cut], positions[pos:cut])
                    pos = cut
                if self.hybrid and pos > 0:
                    states[pos] = self._states(cache)
        finally:
            for h in hooks:
                h.remove()
        if self.hybrid:
            # From zero: the state before the first token.
            states[0] = [(torch.zeros_like(c), torch.zeros_like(s)) for c, s in states[len(tokens)]]
        kv = {li: (cache.layers[li].keys.clone(), cache.layers[li].values.clone()) for li in self.att}
        logdecay = {}
        for li, parts in sink.items():
            steps = torch.cat(parts)  # [tokens, heads]
            logdecay[li] = torch.cat([torch.zeros(1, steps.shape[1]), steps.cumsum(0)])
        return Encoded(offsets, kv, states, logdecay)

    def prepare(self, layout, mode: str, window: int = 16) -> None:
        """Fills the store for `layout` (what an application does before
        serving prompts of a registered schema): one prefill that computes
        and admits every entry its lookup misses."""
        self.prefill_cache(layout, mode, window, admit=True)

    # -- one prompt ----------------------------------------------------------------

    def prefill(self, layout, mode: str, window: int = 16, admit: bool = True) -> tuple[torch.Tensor, dict]:
        """Next-token logits of the prompt laid out as `layout`, its cached
        segments served as the store says for `mode`; and counts (tokens
        reused, composed, recomputed, computed)."""
        logits, count, _ = self.prefill_cache(layout, mode, window, admit)
        return logits, count

    @torch.no_grad()
    def prefill_cache(self, layout, mode: str, window: int = 16, admit: bool = True):
        """prefill, and the cache it leaves (to go on from). With `admit`,
        what the lookup reported as a miss is admitted once computed: a run
        segment with the KV and state of its in-context computation
        (`admit_exact`), a module after the prefill by encoding it alone
        (`admit`)."""
        if not any(s.len for s in layout):
            raise ValueError("the prompt lays out to no tokens: nothing to prefill")
        plan = self.store.lookup(layout, mode, window)
        cache = DynamicCache(config=self.cfg)
        count = dict.fromkeys(("reused", "composed", "recomputed", "computed"), 0)
        # The last token is always computed: its logits are the answer. A
        # prompt that ends inside the exact run recomputes its last segment.
        last = max(i for i, s in enumerate(layout) if s.len)
        hits = 0
        while hits < last and plan[hits].served_how == "exact":
            hits += 1
        if hits:
            # Every exact entry of the run up to here: the KV in order, the
            # state at the last one's end.
            got = [self._tensors(p.entry, ExactEntry) for p in plan[:hits]]
            for seg, ent in zip(layout, got):
                self._append_kv(cache, ent.kv, 0, seg.len)
            if self.hybrid:
                self._set_states(cache, got[-1].states)
            count["reused"] += sum(s.len for s in layout[:hits])
        # The tensors a hit needs, taken before any admission (admit_exact
        # may evict an entry this lookup reported).
        served = {i: self._tensors(p.entry, Encoded) for i, p in enumerate(plan)
                  if p.served_how in ("attention", "composed")}
        # Consecutive computed pieces go through the model in one forward.
        pending_t, pending_p, out = [], [], []

        def compute(tokens, positions):
            pending_t.extend(tokens)
            pending_p.extend(positions)

        def flush():
            if pending_t:
                out.append(self._forward(cache, pending_t, pending_p)[-1])
                pending_t.clear()
                pending_p.clear()

        missed = []
        for i in range(hits, len(layout)):
            seg, p = layout[i], plan[i]
            how = p.served_how
            if not seg.len:
                continue
            positions = list(range(seg.start, seg.start + seg.len))
            if how in ("attention", "composed"):
                enc = served[i]
                off = next(o for s, ln, o in enc.segments if (s, ln) == (seg.start, seg.len))
                n = seg.len - (i == last)
                w = 0 if how == "attention" else min(p.recomputed, n)
                if how == "composed" and (n - w < self.kernel or off + w not in enc.states):
                    # Too short to take the conv state from the module's run
                    # alone, or a window its encoding has no state for.
                    w = n
                if w:
                    compute(seg.tokens[:w], positions[:w])
                    count["recomputed"] += w
                if n > w:
                    flush()
                    if how == "composed":
                        self._compose(cache, enc, off + w, off + n)
                        count["composed"] += n - w
                    else:
                        count["reused"] += n - w
                    self._append_kv(cache, enc.kv, off + w, off + n)
                if n < seg.len:
                    compute(seg.tokens[n:], positions[n:])
                    count["computed"] += 1
            elif p.in_run and mode != "attention":
                # A run segment missed (or the run's last, recomputed):
                # computed in context from position 0, so the KV and the
                # state at its end are its exact entry's.
                compute(seg.tokens, positions)
                count["recomputed"] += seg.len
                if admit and how == "miss":
                    flush()
                    self._admit_exact(layout, i, cache)
            else:
                compute(seg.tokens, positions)
                count["computed" if how == "computed" else "recomputed"] += seg.len
                if how == "miss":
                    missed.append(i)
        flush()
        if admit and missed:
            self._admit_modules(layout, plan, missed)
        return out[-1], count, cache

    def _admit_exact(self, layout, i: int, cache) -> None:
        """Admits run segment `i`, just computed in context into `cache`."""
        seg = layout[i]
        try:
            entry = self.store.admit_exact(layout, i)
        except MarconiError:
            return  # does not fit beside the pinned modules: the store refused it
        finally:
            self._free_evicted()
        a, b = seg.start, seg.start + seg.len
        kv = {li: (cache.layers[li].keys[:, :, a:b].clone(), cache.layers[li].values[:, :, a:b].clone())
              for li in self.att}
        self.entries.setdefault(entry, ExactEntry(kv, self._states(cache) if self.hybrid else []))

    def _admit_modules(self, layout, plan, missed: list) -> None:
        """Encodes each module with a missed segment alone (all its cached
        segments of the layout) and admits it."""
        key = lambda i: (layout[i].kind, plan[i].module)  # noqa: E731
        done = set()
        for i in missed:
            if key(i) in done:
                continue
            done.add(key(i))
            segs = [s for j, s in enumerate(layout) if s.cached and key(j) == key(i)]
            self._admit(layout.schema, layout[i], plan[i], self.encode(segs))

    def _compose(self, cache, enc: Encoded, a: int, b: int) -> None:
        """Advances every Mamba-2 layer's state over the module's tokens
        [a, b) (offsets in its run alone) without computing them:
        h <- Phi h + (h_alone(b) - Phi h_alone(a)), Phi = exp(sum of dt * A
        over [a, b)) per head; the conv state is the run's at b."""
        fresh = not any(cache.layers[li].is_conv_states_initialized[0] for li in self.rec)
        new = []
        for j, li in enumerate(self.rec):
            phi = torch.exp(enc.logdecay[li][b] - enc.logdecay[li][a])[None, :, None, None]
            conv_b, ssm_b = enc.states[b][j]
            _, ssm_a = enc.states[a][j]
            h = torch.zeros_like(ssm_b) if fresh else cache.layers[li].recurrent_states[0]
            new.append((conv_b, phi * h + (ssm_b - phi * ssm_a)))
        self._set_states(cache, new)

    @torch.no_grad()
    def full(self, layout, contiguous: bool = False) -> torch.Tensor:
        """Next-token logits of one prefill of the layout's tokens from an
        empty cache, at the layout's position ids (or at 0 .. n)."""
        tokens = [t for s in layout for t in s.tokens]
        if contiguous:
            positions = list(range(len(tokens)))
        else:
            positions = [p for s in layout for p in range(s.start, s.start + s.len)]
        return self._forward(DynamicCache(config=self.cfg), tokens, positions)[-1]


def compare(a: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(max |logit difference|, KL(ref || a) of the next-token distributions)."""
    kl = F.kl_div(F.log_softmax(a, -1), F.log_softmax(ref, -1), log_target=True, reduction="sum").item()
    return (a - ref).abs().max().item(), max(kl, 0.0)


def within_tolerance(a: torch.Tensor, ref: torch.Tensor) -> bool:
    """engine.py's rule: TOLERANCE relative to the largest |logit| above 1."""
    return (a - ref).abs().max().item() <= TOLERANCE * max(1.0, ref.abs().max().item())


# -- schemas and prompts ---------------------------------------------------------


def documents(n: int, length: int, seed: int) -> list[str]:
    """n passages of about `length` bytes of licence text (ASCII, one line
    each), chosen with `seed`."""
    rng = random.Random(seed)
    text = corpus().decode("ascii", "ignore")
    paras = [" ".join(p.split()) for p in text.split("\n\n")]
    paras = [p for p in paras if len(p) >= length]
    return [p[:length].rsplit(" ", 1)[0] for p in rng.sample(paras, n)]


def document_schema(docs: list[str]) -> str:
    """A schema: a system text (anonymous), one module per document, and a
    question module with a parameter."""
    body = "".join(f'  <module name="doc{i}">{escape(d)}</module>\n' for i, d in enumerate(docs))
    return (
        '<schema name="library">\n  <system>Answer from the documents below.</system>\n'
        f"{body}"
        '  <module name="question">Quote the passage about <param name="topic" len="24"/> and go on:</module>\n'
        "</schema>\n"
    )


ATTR = {'"': "&quot;"}
"""What escape() leaves that a double-quoted attribute value needs."""


def document_prompt(docs: list[str], imports: list[int], quote: int, seed: int) -> tuple[str, list[int]]:
    """A prompt importing the documents `imports` and asking to continue a
    passage of document `quote` (which it imports): the prompt ends with the
    passage's first 24 bytes. Returns the prompt and the true continuation
    (the passage's next 32 bytes, as byte tokens)."""
    rng = random.Random(seed)
    d = docs[quote]
    at = rng.randrange(0, max(1, len(d) - 64))
    lead, cont = d[at : at + 24], d[at + 24 : at + 56]
    words = d.split()
    topic = " ".join(words[: 3])[:24]
    parts = "".join(f"<doc{i}/>" for i in imports)
    prompt = (
        f'<prompt schema="library"><user>{parts}<question topic="{escape(topic, ATTR)}"/>'
        f"{escape(lead)}</user></prompt>"
    )
    return prompt, list(cont.encode())


# -- the table -----------------------------------------------------------------------


def ttft(cached, full, repeats: int) -> tuple[float, float]:
    """Median wall times (seconds) of cached() and full() over `repeats`
    runs each, alternated so that a load on the machine weighs on both."""
    a, b = [], []
    for _ in range(repeats):
        for fn, times in ((cached, a), (full, b)):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(a), statistics.median(b)


@torch.no_grad()
def continuation_nll(engine: PmlEngine, layout, mode: str, window: int, cont: list[int], cached: bool) -> float:
    """Mean NLL (nats per byte) of the true continuation `cont` after the
    prompt, prefilled cached (as `mode` serves it) or in full; teacher-forced."""
    if cached:
        cache_logits, _, cache = engine.prefill_cache(layout, mode, window)
    else:
        cache = DynamicCache(config=engine.cfg)
        tokens = [t for s in layout for t in s.tokens]
        positions = [p for s in layout for p in range(s.start, s.start + s.len)]
        cache_logits = engine._forward(cache, tokens, positions)[-1]
    end = layout[-1].start + layout[-1].len
    rest = engine._forward(cache, cont[:-1], list(range(end, end + len(cont) - 1))) if len(cont) > 1 else None
    logits = torch.cat([cache_logits[None], rest]) if rest is not None else cache_logits[None]
    return F.cross_entropy(logits, torch.tensor(cont)).item()


def table(smoke: bool = False, seed: int = 0, verbose: bool = True) -> list[dict]:
    """The rows: (model, mode, window) with TTFT cached and full (median of
    repeats), speedup, and over the prompts the largest max|dlogit| and KL
    against the full prefill at the same position ids (Llama: and at
    contiguous ones), and the continuation NLL cached vs full."""
    torch.manual_seed(seed)
    train = SMOKE_TRAINING if smoke else FULL_TRAINING
    n_docs, doc_len, n_prompts, repeats = (4, 160, 2, 1) if smoke else (5, 180, 4, 5)
    docs = documents(n_docs, doc_len, seed)
    xml = document_schema(docs)
    rng = random.Random(seed)
    prompts = []
    for p in range(n_prompts):
        imports = sorted(rng.sample(range(n_docs), 3))
        if p % 2 == 0 and 0 not in imports:
            imports = [0] + imports[1:]  # the exact run covers the system text and doc0
        prompts.append(document_prompt(docs, imports, rng.choice(imports), seed + p))
    rows = []
    t0 = time.perf_counter()
    llama = trained("llama", seed=seed, **train)
    nem = trained("nemotron_h", seed=seed, **train)
    if verbose:
        print(f"trained {train} (or read the cache): llama loss {llama[2]:.3f}, nemotron_h loss {nem[2]:.3f} "
              f"nats/byte, {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    configs = [("llama", llama, "attention", None)]
    configs += [("nemotron_h", nem, "exact", None)]
    configs += [("nemotron_h", nem, "composed", w) for w in WINDOWS]
    engines = {}
    with Schema(xml) as schema:
        layouts = [(schema.layout(p), cont) for p, cont in prompts]
        for family, (cfg, model, _), mode, w in configs:
            if family not in engines:
                engines[family] = PmlEngine(cfg, model)
                engines[family].register(schema)
            eng = engines[family]
            win = w or 0
            row = {"model": family, "mode": mode if w is None else f"composed w={w}", "dlogit": 0.0, "kl": 0.0,
                   "dlogit_contig": 0.0, "kl_contig": 0.0, "cached_s": [], "full_s": [], "nll_cached": [],
                   "nll_full": [], "reused": 0, "tokens": 0, "max_logit": 0.0}
            for layout, cont in layouts:
                eng.prepare(layout, mode, win)
                a, count = eng.prefill(layout, mode, win)
                ref = eng.full(layout)
                d, kl = compare(a, ref)
                row["dlogit"], row["kl"] = max(row["dlogit"], d), max(row["kl"], kl)
                row["max_logit"] = max(row["max_logit"], ref.abs().max().item())
                if family == "llama":
                    d2, kl2 = compare(a, eng.full(layout, contiguous=True))
                    row["dlogit_contig"], row["kl_contig"] = max(row["dlogit_contig"], d2), max(row["kl_contig"], kl2)
                c, f = ttft(lambda: eng.prefill(layout, mode, win), lambda: eng.full(layout), repeats)
                row["cached_s"].append(c)
                row["full_s"].append(f)
                row["nll_cached"].append(continuation_nll(eng, layout, mode, win, cont, True))
                row["nll_full"].append(continuation_nll(eng, layout, mode, win, cont, False))
                row["reused"] += count["reused"] + count["composed"]
                row["tokens"] += sum(s.len for s in layout)
            for k in ("cached_s", "full_s", "nll_cached", "nll_full"):
                row[k] = statistics.mean(row[k])
            row["speedup"] = row["full_s"] / row["cached_s"]
            st = eng.store.stats()
            row["store"] = {k: st[k] for k in ("entries", "evictions", "resident_bytes", "used_bytes")}
            row["store"]["held_bytes"] = eng.held_bytes()
            rows.append(row)
    return rows


def print_table(rows: list[dict]) -> None:
    print("| model | mode | reused tokens | TTFT cached ms | TTFT full ms | speedup | max abs dlogit | KL "
          "| continuation NLL cached / full |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['model']} | {r['mode']} | {r['reused']}/{r['tokens']} | {r['cached_s'] * 1e3:.1f} | "
            f"{r['full_s'] * 1e3:.1f} | {r['speedup']:.2f}x | {r['dlogit']:.2e} | {r['kl']:.2e} | "
            f"{r['nll_cached']:.3f} / {r['nll_full']:.3f} |"
        )
    last = {r["model"]: r for r in rows}
    for family, r in last.items():
        st = r["store"]
        print(f"\n{family}: the module store holds {st['entries']} entries charged {st['resident_bytes']} bytes "
              f"({st['used_bytes']} of the budget in use, pinned reservations included), {st['evictions']} "
              f"evictions; the engine's tensors for them take {st['held_bytes']} bytes")
    for r in rows:
        if r["model"] == "llama":
            print(f"\nllama attention mode against a full prefill at contiguous positions 0..n: "
                  f"max abs dlogit {r['dlogit_contig']:.2e}, KL {r['kl_contig']:.2e}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--table", action="store_true", help="print the table (trains the models on first use)")
    ap.add_argument("--smoke", action="store_true", help="CI size: short training, short documents")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    if not a.table:
        ap.print_help()
        return 2
    torch.set_num_threads(1)
    print_table(table(smoke=a.smoke, seed=a.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
