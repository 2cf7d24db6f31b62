"""marconi.pml: layouts through the C ABI with the byte tokenizer and a
Python tokenizer, PML errors with line and column, tokenizer failures."""

import pytest

from conftest import REPO
from marconi import MarconiError
from marconi.pml import PmlError, Schema

FIX = REPO / "marconi-pml" / "tests" / "fixtures"


def words(text):
    return [len(w) for w in text.split()]


def test_figure2_with_a_python_tokenizer():
    with Schema((FIX / "figure2_schema.xml").read_text(), tokenizer=words) as s:
        assert (s.n_modules, s.total_positions) == (3, 14)
        segs = s.layout((FIX / "figure2_prompt.xml").read_text(), tokenizer=words)
        assert [(g.kind, g.name, g.start, g.len, g.cached) for g in segs] == [
            ("module", "trip-plan", 0, 4, True),
            ("param", "duration", 4, 2, False),
            ("module", "trip-plan", 6, 1, True),
            ("module", "miami", 7, 6, True),
            ("text", None, 13, 4, False),
        ]
        assert segs[1].tokens == [1, 4]


def test_travel_with_bytes():
    s = Schema((FIX / "travel_schema.xml").read_bytes())
    segs = s.layout((FIX / "travel_prompt.xml").read_text())
    assert [(g.kind, g.start, g.len) for g in segs][-2:] == [("anonymous", 65, 15), ("text", 80, 9)]
    assert bytes(segs[-1].tokens) == b"Any tips?"
    assert s.namespace == Schema((FIX / "travel_schema.xml").read_bytes()).namespace
    s.close()
    with pytest.raises(ValueError, match="closed"):
        s.layout("<prompt schema='travel'/>")


def test_bad_pml_raises_with_line_and_column():
    with pytest.raises(PmlError) as e:
        Schema("<schema name='s'>\n  <module name='a'><param name='p' len='0'/></module></schema>")
    assert (e.value.line, e.value.col) == (2, 36)
    assert "not a positive integer" in e.value.reason
    s = Schema((FIX / "figure2_schema.xml").read_text())
    with pytest.raises(PmlError, match=r"^2:14: argument for param 'duration'"):
        s.layout((FIX / "figure2_prompt.xml").read_text())
    with pytest.raises(PmlError, match="unknown module 'paris'"):
        s.layout("<prompt schema='cities'><paris/></prompt>")
    with pytest.raises(PmlError, match="not UTF-8"):
        s.layout(b"<prompt schema='cities'>\xff</prompt>")
    with pytest.raises(MarconiError, match="EMPTY_TOKENS"):
        s.layout("")
    with pytest.raises(TypeError):
        s.layout(42)


def test_tokenizer_failures_are_raised():
    def boom(text):
        raise KeyError("no vocab")

    with pytest.raises(KeyError):
        Schema((FIX / "figure2_schema.xml").read_text(), tokenizer=boom)
    with pytest.raises(ValueError, match="token ids"):
        Schema((FIX / "figure2_schema.xml").read_text(), tokenizer=lambda t: [-1])
    s = Schema((FIX / "figure2_schema.xml").read_text(), tokenizer=words)
    with pytest.raises(KeyError):
        s.layout((FIX / "figure2_prompt.xml").read_text(), tokenizer=boom)


def test_large_layouts_grow_the_buffers():
    body = "".join(f"<module name='m{i}'>{'x' * 300}</module>" for i in range(40))
    s = Schema(f"<schema name='big'>{body}</schema>")
    prompt = "<prompt schema='big'>" + "".join(f"<m{i}/>" for i in range(40)) + "</prompt>"
    segs = s.layout(prompt)
    assert len(segs) == 40 and sum(g.len for g in segs) == 12000
    assert segs[-1].start == 39 * 300


# The module store. Byte tokenizer: sys 0..3, doc 3..9, q 9..13 (param at
# 10..12), tail 13..15: 15 module tokens.
STORE_S = (
    '<schema name="r"><module name="sys">SYS</module><module name="doc">DOCDOC</module>'
    '<module name="q">Q<param name="p" len="2"/>Z</module><module name="tail">TT</module></schema>'
)
STORE_P = '<prompt schema="r"><sys/><doc/><tail/>ask</prompt>'


def test_module_cache_attention_misses_then_serves_admitted_modules():
    from marconi.pml import ModuleCache

    with Schema(STORE_S) as s, ModuleCache(capacity_bytes=1000, kv_bytes_per_token=10) as mc:
        mc.register(s)
        assert mc.stats()["pinned_bytes"] == 150
        layout = s.layout(STORE_P)
        assert mc.lookup(layout) == [
            ("sys", "module", 0, 3, "miss"),
            ("doc", "module", 3, 6, "miss"),
            ("tail", "module", 13, 2, "miss"),
            (None, "text", 15, 3, "computed"),
        ]
        e = mc.admit(s, "doc")
        got = mc.lookup(layout, mode="attention")
        assert [g.served_how for g in got] == ["miss", "attention", "miss", "computed"]
        assert got[1].entry == e and got[0].entry == 0
        assert mc.admit(s, "doc") == e
        st = mc.stats()
        assert (st["hits"], st["misses"], st["entries"], st["resident_bytes"]) == (1, 5, 1, 60)
        # Composed does not apply to an attention-only model: an error.
        with pytest.raises(MarconiError) as ei:
            mc.lookup(layout, mode="composed")
        assert ei.value.name == "UNSUPPORTED"
        with pytest.raises(ValueError, match="mode"):
            mc.lookup(layout, mode="approximate")
        with pytest.raises(ValueError, match="no module named"):
            mc.admit(s, "nope")


def test_module_cache_hybrid_exact_and_composed():
    from marconi.pml import ModuleCache

    s = Schema(STORE_S)
    mc = ModuleCache(2000, 10, state_bytes=100, operator_bytes=50)
    mc.register(s)
    assert mc.stats()["pinned_bytes"] == 150 + 4 * 150
    layout = s.layout(STORE_P)
    with pytest.raises(MarconiError):
        mc.lookup(layout, mode="attention")
    found = mc.lookup(layout, mode="exact")
    assert [g.served_how for g in found] == ["miss", "miss", "recomputed", "computed"]
    assert [g.in_run for g in found] == [True, True, False, False]
    e0, e1 = mc.admit_exact(layout, 0), mc.admit_exact(layout, 1)
    with pytest.raises(MarconiError):
        mc.admit_exact(layout, 2)  # not in the exact run
    mc.admit(s, "tail")
    got = mc.lookup(layout, mode="composed", window=1)
    assert [g.served_how for g in got] == ["exact", "exact", "composed", "computed"]
    assert (got[0].entry, got[1].entry, got[2].recomputed) == (e0, e1, 1)
    assert [g.served_how for g in mc.lookup(layout, mode="exact")] == ["exact", "exact", "recomputed", "computed"]
    mc.close()
    with pytest.raises(ValueError, match="closed"):
        mc.stats()
    s.close()


def test_module_cache_budget_pinning_and_eviction():
    from marconi.pml import ModuleCache

    u_xml = '<schema name="u">Head<module name="c">CCCC</module></schema>'  # 4 + 4 tokens
    u_prompt = '<prompt schema="u"><c/></prompt>'
    with Schema(STORE_S) as s, Schema(u_xml) as u, ModuleCache(20, 1) as mc:
        mc.register(s)  # 15 pinned
        with pytest.raises(MarconiError) as ei:
            mc.register(u)  # 15 + 8 > 20
        assert ei.value.name == "OUT_OF_MEMORY"
        mc.admit(s, "sys")
        mc.unregister(s)
        with pytest.raises(ValueError, match="not registered"):
            mc.unregister(s)
        st = mc.stats()
        assert (st["pinned_bytes"], st["used_bytes"], st["entries"]) == (0, 3, 1)
        mc.register(u)  # 8 pinned + 3 unpinned <= 20: nothing evicted
        assert mc.evicted() == []
        assert mc.stats()["evictions"] == 0
    with Schema(STORE_S) as s, Schema(u_xml) as u, ModuleCache(15, 1) as mc:
        mc.register(s)
        sys_entry = mc.admit(s, "sys")
        mc.unregister(s)
        mc.register(u)
        assert mc.lookup(u.layout(u_prompt)) == [
            (None, "anonymous", 0, 4, "miss"),
            ("c", "module", 4, 4, "miss"),
        ]
        head = mc.admit(u, anonymous=0)
        c = mc.admit(u, "c")
        assert [g.entry for g in mc.lookup(u.layout(u_prompt))] == [head, c]
        mc.unregister(u)
        # S again: sys is its own, pinned again and served at once; U's two
        # unpinned entries (8 bytes) no longer fit beside S's 15: evicted,
        # the older first.
        mc.register(s)
        assert mc.evicted() == [head, c]
        got = mc.lookup(s.layout(STORE_P))
        assert (got[0].served_how, got[0].entry) == ("attention", sys_entry)
        st = mc.stats()
        assert (st["evictions"], st["used_bytes"], st["capacity_bytes"]) == (2, 15, 15)


def test_module_cache_bad_arguments():
    from marconi.pml import ModuleCache

    with pytest.raises(MarconiError) as ei:
        ModuleCache(0, 10)
    assert ei.value.name == "INVALID_CONFIG"
    with pytest.raises(MarconiError):
        ModuleCache(100, 0)
    with pytest.raises(ValueError):
        ModuleCache(-1, 10)
    with pytest.raises(TypeError):
        ModuleCache(1.5, 10)
    with Schema(STORE_S) as s, ModuleCache(100, 1) as mc:
        with pytest.raises(ValueError, match="not registered"):
            mc.lookup(s.layout(STORE_P))
        with pytest.raises(TypeError):
            mc.lookup([("sys", "module", 0, 3, True)])
        mc.register(s)
        with pytest.raises(MarconiError):
            mc.admit(s, anonymous=0)  # S has no anonymous text
