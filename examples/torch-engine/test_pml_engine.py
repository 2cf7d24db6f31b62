"""The PML engine's checks (pytest; needs torch and transformers): Mamba-2
state composition is exact on one layer with fixed inputs, the hybrid exact
mode equals a full prefill within TOLERANCE, a module's KV reused at its
schema positions equals computing it there, the engine honours libmarconi's
module store (its plans, its sizes, its evictions under a budget that
binds), and the table at smoke size."""

import math
import zlib
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache
from transformers.models.nemotron_h.modeling_nemotron_h import mamba2_chunk_scan

from engine import TOLERANCE, measured_bytes, tiny_nemotron_h
from marconi.pml import SERVED, MarconiError, Schema
from pml_engine import (
    WINDOWS,
    Encoded,
    ExactEntry,
    PmlEngine,
    tensor_bytes,
    compare,
    document_prompt,
    document_schema,
    documents,
    table,
    tiny_llama,
    within_tolerance,
)

torch.set_num_threads(1)

FIXTURES = Path(__file__).resolve().parents[2] / "marconi-pml" / "tests" / "fixtures"


def words(text: str) -> list:
    """A word tokenizer (one id per whitespace-separated word): the paper's
    Figure 2 needs "3 days" to fit a parameter of 2 positions."""
    return [zlib.crc32(w.encode()) % 256 for w in text.split()]


def mamba_run(cfg, mixer, x, states=None):
    """One Mamba-2 mixer alone over inputs x ([1, tokens, hidden]) from an
    empty cache (or from `states`): its (conv, ssm) state after them."""
    cache = DynamicCache(config=cfg)
    li = mixer.layer_idx
    if states is not None:
        cache.update_conv_state(states[0].clone(), li, conv_kernel_size=states[0].shape[-1])
        cache.update_recurrent_state(states[1].clone(), li)
    with torch.no_grad():
        mixer(x, cache_params=cache)
    return cache.layers[li].conv_states[0].clone(), cache.layers[li].recurrent_states[0].clone()


@pytest.mark.parametrize("split", [1, 5, 23, 36])
def test_composition_is_exact_on_the_ssm_scan_with_fixed_inputs(split):
    """One Mamba-2 scan (transformers' own), fixed inputs (x, dt, B, C after
    the conv): h(A.B) = Phi_B h(A) + h_B(0), Phi_B = exp(A sum dt) per head."""
    g = torch.Generator().manual_seed(split)
    L, H, P, G, N = 40, 4, 8, 2, 16
    x = torch.randn(1, L, H, P, generator=g)
    dt = torch.rand(1, L, H, generator=g) * 0.5
    A = -torch.rand(H, generator=g) - 0.1
    B = torch.randn(1, L, G, N, generator=g)
    C = torch.randn(1, L, G, N, generator=g)

    def scan(lo, hi, h0=None):
        _, h = mamba2_chunk_scan(x[:, lo:hi], dt[:, lo:hi], A, B[:, lo:hi], C[:, lo:hi], chunk_size=16,
                                 initial_states=h0, return_final_states=True)
        return h

    h_ab, h_a, h_b0 = scan(0, L), scan(0, split), scan(split, L)
    phi = torch.exp(A * dt[0, split:].sum(0))[None, :, None, None]
    scale = max(1.0, h_ab.abs().max().item())
    assert (phi * h_a + h_b0 - h_ab).abs().max().item() <= TOLERANCE * scale
    # Negative controls: without the decay, or without h(A), it is wrong.
    assert (h_a + h_b0 - h_ab).abs().max().item() > 100 * TOLERANCE * scale
    assert (h_b0 - h_ab).abs().max().item() > 100 * TOLERANCE * scale


@pytest.mark.parametrize("split", [1, 5, 23])
def test_composition_with_a_conv_window_is_exact_on_one_mamba2_layer(split):
    """A whole Mamba-2 mixer (conv + scan) with fixed inputs: B's first
    conv_kernel - 1 tokens see A through the causal conv, so they are the
    window recomputed from h(A); the rest of B composes exactly, Phi from the
    engine's own dt * A extraction, and the conv state is B's alone. Without
    the window the conv boundary is wrong (why windows matter)."""
    cfg, model = tiny_nemotron_h(0, 64)
    eng = PmlEngine(cfg, model)
    mixer = model.model.layers[eng.rec[0]].mixer
    w = mixer.conv_kernel_size - 1
    x = torch.randn(1, 40, cfg.hidden_size, generator=torch.Generator().manual_seed(split))
    conv_ab, h_ab = mamba_run(cfg, mixer, x)
    s_aw = mamba_run(cfg, mixer, x[:, : split + w])  # A and the window, in context
    b = x[:, split:]
    _, h_alone_w = mamba_run(cfg, mixer, b[:, :w])
    sink = {}
    hooks = eng._logdecay_hooks(sink)
    try:
        conv_b0, h_alone = mamba_run(cfg, mixer, b)
    finally:
        for h in hooks:
            h.remove()
    steps = torch.cat(sink[eng.rec[0]])
    phi = torch.exp(steps[w:].sum(0))[None, :, None, None]
    assert phi.shape[1] == mixer.num_heads and bool((phi < 1).all()) and bool((phi > 0).all())
    composed = phi * s_aw[1] + (h_alone - phi * h_alone_w)
    scale = max(1.0, h_ab.abs().max().item())
    assert (composed - h_ab).abs().max().item() <= TOLERANCE * scale
    assert torch.equal(conv_ab, conv_b0)
    # Window 0: the conv boundary makes it approximate.
    _, h_a = mamba_run(cfg, mixer, x[:, :split])
    phi0 = torch.exp(steps.sum(0))[None, :, None, None]
    assert (phi0 * h_a + h_alone - h_ab).abs().max().item() > 10 * TOLERANCE * scale


def test_composition_matches_resuming_from_the_state():
    """The engine's _compose over a module run alone equals running the same
    mixer inputs from the real state: checked on a one-layer slice by
    resuming the mixer from h(A) over B."""
    cfg, model = tiny_nemotron_h(1, 64)
    eng = PmlEngine(cfg, model)
    mixer = model.model.layers[eng.rec[0]].mixer
    x = torch.randn(1, 30, cfg.hidden_size, generator=torch.Generator().manual_seed(7))
    s_a = mamba_run(cfg, mixer, x[:, :12])
    _, h_resumed = mamba_run(cfg, mixer, x[:, 12:], states=s_a)
    _, h_direct = mamba_run(cfg, mixer, x)
    assert (h_resumed - h_direct).abs().max().item() <= TOLERANCE * max(1.0, h_direct.abs().max().item())


def hybrid_case(seed=0):
    cfg, model = tiny_nemotron_h(seed, 64)
    docs = documents(4, 120, seed)
    return PmlEngine(cfg, model), docs


@pytest.mark.parametrize("imports", [[0, 1, 3], [0, 2], [1, 2, 3]])
def test_exact_mode_equals_a_full_prefill(imports):
    eng, docs = hybrid_case()
    with Schema(document_schema(docs)) as schema:
        eng.register(schema)
        layout = schema.layout(document_prompt(docs, imports, imports[-1], 3)[0])
        eng.prepare(layout, "exact")
        plan = eng.store.lookup(layout, "exact")
        run = [p for p in plan if p.served_how == "exact"]
        # The system text always leads; doc0, doc1, ... join the run while
        # the imports follow the schema without a gap.
        lead = next((k for k in range(len(imports)) if imports[k] != k), len(imports))
        assert run[0][1] == "anonymous" and len(run) == 1 + lead
        assert all(p.served_how in ("recomputed", "computed") for p in plan[len(run):])
        got, count = eng.prefill(layout, "exact")
        assert count["reused"] == sum(p[3] for p in run) > 0
        ref = eng.full(layout)
        assert within_tolerance(got, ref), (got - ref).abs().max().item()


def test_exact_mode_check_catches_a_lost_state():
    """Negative control: the same run with its SSM states zeroed fails the check."""
    eng, docs = hybrid_case()
    with Schema(document_schema(docs)) as schema:
        eng.register(schema)
        layout = schema.layout(document_prompt(docs, [0, 1], 1, 3)[0])
        eng.prepare(layout, "exact")
        exact = [e for e in eng.entries.values() if isinstance(e, ExactEntry)]
        assert len(exact) == 3  # the system text, doc0, doc1
        for e in exact:
            for _, ssm in e.states:
                ssm.zero_()
        got, _ = eng.prefill(layout, "exact")
        assert not within_tolerance(got, eng.full(layout))


def test_composed_with_a_window_over_every_segment_is_exact_and_without_one_is_not():
    eng, docs = hybrid_case()
    with Schema(document_schema(docs)) as schema:
        eng.register(schema)
        layout = schema.layout(document_prompt(docs, [1, 3], 3, 5)[0])
        eng.prepare(layout, "composed")
        ref = eng.full(layout)
        longest = max(s.len for s in layout)
        got, count = eng.prefill(layout, "composed", window=longest)
        assert count["composed"] == 0 and within_tolerance(got, ref)
        got0, count0 = eng.prefill(layout, "composed", window=0)
        assert count0["composed"] > 0
        d, kl = compare(got0, ref)
        assert d > TOLERANCE and math.isfinite(kl)
        # A wider window recomputes more and composes less.
        counts = [eng.prefill(layout, "composed", window=w)[1] for w in WINDOWS]
        assert [c["composed"] for c in counts] == sorted((c["composed"] for c in counts), reverse=True)


def test_a_module_kv_reused_at_its_schema_positions_equals_computing_it_there():
    """Llama, the paper's Figure 2: a prompt importing only `miami` (schema
    positions 7..) and text; its KV computed alone at those positions and
    reused equals one prefill of the same tokens at the same positions."""
    cfg, model = tiny_llama(0, 64)
    eng = PmlEngine(cfg, model)
    with Schema((FIXTURES / "figure2_schema.xml").read_text(), tokenizer=words) as schema:
        prompt = '<prompt schema="cities"><miami/> Highlight the surf spots.</prompt>'
        layout = schema.layout(prompt, tokenizer=words)
        assert [s.kind for s in layout] == ["module", "text"] and layout[0].start > 0
        eng.register(schema)
        eng.prepare(layout, "attention")
        got, count = eng.prefill(layout, "attention")
        assert count["reused"] == layout[0].len
        assert within_tolerance(got, eng.full(layout))
        # The whole figure: trip-plan with its argument, miami, then text.
        fig = schema.layout((FIXTURES / "figure2_prompt.xml").read_text(), tokenizer=words)
        eng.prepare(fig, "attention")
        got, count = eng.prefill(fig, "attention")
        assert count["reused"] == sum(s.len for s in fig if s.cached)
        d, kl = compare(got, eng.full(fig))
        assert math.isfinite(d) and math.isfinite(kl)


def check_held(eng):
    """The engine holds tensors for exactly the store's resident entries,
    none of those it was told were evicted, within the budget."""
    st = eng.store.stats()
    assert len(eng.entries) == st["entries"]
    assert not set(eng.freed) & set(eng.entries)
    assert st["used_bytes"] <= st["capacity_bytes"]


def test_engine_serves_the_store_plans_with_measured_sizes():
    """The travel fixture on a hybrid: sizes from the model's tensors, what
    lookup says before and after prepare, and each exact entry's tensors
    exactly the bytes the store charges for it."""
    cfg, model = tiny_nemotron_h(0, 64)
    eng = PmlEngine(cfg, model)
    sizes = measured_bytes(model, cfg)
    assert (eng.kv_bytes_per_token, eng.state_bytes) == (sizes["kv_bytes_per_token"], sizes["state_bytes"]) != (0, 0)
    mixer = model.model.layers[eng.rec[0]].mixer
    assert eng.operator_bytes == len(eng.rec) * mixer.num_heads * 4
    with Schema((FIXTURES / "travel_schema.xml").read_text()) as schema:
        layout = schema.layout((FIXTURES / "travel_prompt.xml").read_text())
        eng.register(schema)
        st = eng.store.stats()
        assert st["pinned_bytes"] == st["used_bytes"] > 0 and st["entries"] == 0
        before = [p.served_how for p in eng.store.lookup(layout, "exact")]
        # anonymous and travel-plan lead from 0; the argument `days` ends the run.
        assert before[:3] == ["miss", "miss", "computed"]
        assert all(h in ("recomputed", "computed") for h in before[3:])
        eng.prepare(layout, "exact")
        plan = eng.store.lookup(layout, "exact")
        assert [p.served_how for p in plan[:3]] == ["exact", "exact", "computed"]
        for seg, p in zip(layout[:2], plan):
            held = eng.entries[p.entry]
            assert isinstance(held, ExactEntry)
            assert tensor_bytes(held) == seg.len * eng.kv_bytes_per_token + eng.state_bytes
        check_held(eng)
        assert all(p.served_how == "miss" for p, s in zip(eng.store.lookup(layout, "composed", 4)[3:], layout[3:])
                   if s.cached)
        eng.prepare(layout, "composed", 4)
        composed = eng.store.lookup(layout, "composed", window=4)
        assert composed[0].entry == plan[0].entry  # the run's exact entries serve both modes
        for p, s in zip(composed[3:], layout[3:]):
            if s.cached:
                assert p.served_how == "composed" and p.recomputed == min(4, s.len)
                assert isinstance(eng.entries[p.entry], Encoded)
        assert all(p.served_how in SERVED for m in ("exact", "composed") for p in eng.store.lookup(layout, m))
        check_held(eng)
        got, count = eng.prefill(layout, "composed", 4, admit=False)
        assert count["reused"] == sum(s.len for s in layout[:2]) and count["composed"] > 0
        assert eng.store.stats()["evictions"] == 0 and not eng.freed
        empty = schema.layout('<prompt schema="travel"></prompt>')
        with pytest.raises(ValueError):
            eng.prefill([s for s in empty if s.kind == "param"], "exact")


def test_a_prompt_that_ends_inside_the_exact_run():
    """A prompt of modules only, all in the leading run: the last token's
    logits must still be computed, so its last segment is recomputed in
    context (the engine before the store had no computed piece left and
    failed on an empty list)."""
    eng, docs = hybrid_case()
    with Schema(document_schema(docs)) as schema:
        eng.register(schema)
        layout = schema.layout('<prompt schema="library"><doc0/><doc1/></prompt>')
        assert [s.kind for s in layout] == ["anonymous", "module", "module"]
        eng.prepare(layout, "exact")
        assert [p.served_how for p in eng.store.lookup(layout, "exact")] == ["exact"] * 3
        for mode in ("exact", "composed"):
            got, count = eng.prefill(layout, mode)
            assert count["reused"] == layout[0].len + layout[1].len and count["recomputed"] == layout[2].len
            assert within_tolerance(got, eng.full(layout))


def test_a_mode_the_model_lacks_is_an_error():
    """Attention-only reuse on a hybrid and composition on an attention-only
    model are refused by the store (MarconiError UNSUPPORTED), never served
    another way; nothing is admitted."""
    docs = documents(2, 100, 0)
    hybrid = PmlEngine(*tiny_nemotron_h(0, 64))
    llama = PmlEngine(*tiny_llama(0, 64))
    with Schema(document_schema(docs)) as schema:
        layout = schema.layout(document_prompt(docs, [0, 1], 1, 3)[0])
        for eng, mode in ((hybrid, "attention"), (llama, "composed")):
            eng.register(schema)
            with pytest.raises(MarconiError, match="UNSUPPORTED"):
                eng.store.lookup(layout, mode)
            with pytest.raises(MarconiError, match="UNSUPPORTED"):
                eng.prefill(layout, mode)
            with pytest.raises(ValueError):
                eng.prefill(layout, "approximate")
            assert not eng.entries and eng.store.stats()["admissions"] == 0
        # The modes each model has are served.
        assert within_tolerance(hybrid.prefill(layout, "exact")[0], hybrid.full(layout))
        assert llama.prefill(layout, "attention")[1]["computed"] > 0


def test_a_binding_budget_evicts_frees_and_recomputes_the_exact_run():
    """A hybrid whose budget leaves room for about two exact entries beside
    the pinned modules: a five-segment run evicts its own entries, the
    engine frees their tensors, later lookups miss and recompute, and every
    output stays within TOLERANCE of a full prefill."""
    cfg, model = tiny_nemotron_h(0, 64)
    docs = documents(4, 120, 0)
    with Schema(document_schema(docs)) as schema:
        probe = PmlEngine(cfg, model)
        probe.register(schema)
        pinned = probe.store.stats()["pinned_bytes"]
        room = 2 * (len(docs[0]) * probe.kv_bytes_per_token + probe.state_bytes)
        eng = PmlEngine(cfg, model, capacity_bytes=pinned + room)
        eng.register(schema)
        long = schema.layout(document_prompt(docs, [0, 1, 2, 3], 3, 3)[0])
        short = schema.layout(document_prompt(docs, [0, 2], 2, 4)[0])
        misses = 0
        for layout in (long, short, long, short, long):
            plan = eng.store.lookup(layout, "exact")
            misses += sum(p.served_how == "miss" for p in plan)
            got, _ = eng.prefill(layout, "exact")
            assert within_tolerance(got, eng.full(layout)), (got - eng.full(layout)).abs().max().item()
            check_held(eng)
        st = eng.store.stats()
        assert st["evictions"] > 0 and len(eng.freed) == st["evictions"]
        assert misses > 5  # the first lookup of `long` misses 5; later ones miss again
        assert eng.store.lookup(long, "exact")[0].served_how in ("exact", "miss")


@pytest.mark.parametrize("family,mode", [("llama", "attention"), ("nemotron_h", "composed")])
def test_evicted_modules_are_encoded_again_and_serve_the_same_output(family, mode):
    """Two schemas whose modules do not fit together: registering one after
    unregistering the other evicts the other's modules (their tensors
    freed); its prompts then miss, are computed in context (equal to a full
    prefill), admitted again under new ids, and served as before."""
    cfg, model = tiny_llama(0, 64) if family == "llama" else tiny_nemotron_h(0, 64)
    docs_a, docs_b = documents(3, 150, 0), documents(3, 150, 1)
    with Schema(document_schema(docs_a)) as a, Schema(document_schema(docs_b)) as b:
        probe = PmlEngine(cfg, model)
        pa = probe.register(a) and probe.store.stats()["pinned_bytes"]
        probe.unregister(a)
        pb = probe.register(b) and probe.store.stats()["pinned_bytes"]
        eng = PmlEngine(cfg, model, capacity_bytes=max(pa, pb) + min(pa, pb) // 2)
        la = a.layout(document_prompt(docs_a, [1, 2], 2, 3)[0])
        lb = b.layout(document_prompt(docs_b, [0, 2], 0, 4)[0])
        eng.register(a)
        eng.prepare(la, mode, 4)
        first, _ = eng.prefill(la, mode, 4)
        ids_a = {p.entry for p in eng.store.lookup(la, mode, 4) if p.entry}
        eng.unregister(a)
        eng.register(b)
        eng.prepare(lb, mode, 4)
        assert set(eng.freed) & ids_a
        check_held(eng)
        eng.unregister(b)
        eng.register(a)
        plan = eng.store.lookup(la, mode, 4)
        assert any(p.served_how == "miss" and not p.in_run for p in plan)
        got, count = eng.prefill(la, mode, 4)
        assert count["recomputed"] > 0
        if all(p.served_how in ("miss", "computed") for p in plan):
            assert within_tolerance(got, eng.full(la))
        again = eng.store.lookup(la, mode, 4)
        assert all(p.served_how != "miss" for p in again)
        assert {p.entry for p in again if p.served_how != "exact" and p.entry} - ids_a  # admitted again
        got, _ = eng.prefill(la, mode, 4)
        assert within_tolerance(got, first), (got - first).abs().max().item()
        check_held(eng)


def test_table_at_smoke_size():
    rows = table(smoke=True, verbose=False)
    by = {(r["model"], r["mode"]): r for r in rows}
    assert set(by) == {("llama", "attention"), ("nemotron_h", "exact")} | {
        ("nemotron_h", f"composed w={w}") for w in WINDOWS
    }
    exact = by[("nemotron_h", "exact")]
    assert exact["dlogit"] <= TOLERANCE * max(1.0, exact["max_logit"])
    assert by[("nemotron_h", "composed w=0")]["dlogit"] > exact["dlogit"]
    llama = by[("llama", "attention")]
    assert llama["reused"] > 0 and llama["dlogit_contig"] > 0
    for r in rows:
        assert r["cached_s"] > 0 and r["full_s"] > 0
        assert math.isfinite(r["kl"]) and math.isfinite(r["nll_cached"]) and math.isfinite(r["nll_full"])


def test_document_prompts_escape_quotes_and_markup():
    """A passage whose first words hold quotes, '<' and '&' (the question's
    argument is taken from them) still makes valid PML: it failed before
    the attribute was escaped for '"'."""
    docs = ['"Licensed" <work> & "you" may copy the "Work" as it is, without any warranty or condition at all.'] * 2
    docs[1] = "Plain text of a second passage, long enough to quote from in a prompt."
    with Schema(document_schema(docs)) as schema:
        prompt, cont = document_prompt(docs, [0, 1], 0, 1)
        layout = schema.layout(prompt)
        arg = next(s for s in layout if s.kind == "param")
        assert bytes(arg.tokens).decode() == '"Licensed" <work> &'
        assert len(cont) == 32 and layout[-1].kind == "text"
