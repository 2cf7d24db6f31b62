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
    assert [(g.kind, g.start, g.len) for g in segs][-2:] == [("anonymous", 63, 15), ("text", 78, 9)]
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
