"""Shared paths for the tests: the repository, the header, the trace, and the
Rust replay binary (built by ci/test.d/python.sh)."""

import os
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
HEADER = REPO / "include" / "marconi.h"
TRACE = HERE / "data" / "trace.jsonl"


@pytest.fixture
def header_text() -> str:
    return HEADER.read_text()


def target_dir() -> Path:
    return Path(os.environ.get("CARGO_TARGET_DIR") or REPO / "target")
