"""Shared paths for the tests: the repository, the header, the trace, and the
Rust replay binary (built by ci/test.d/python.sh)."""

import contextlib
import os
import shutil
import socket
import subprocess
import threading
import time
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


def run_threads(target, args) -> list:
    """Runs target(*a) on one thread for each tuple `a` of `args`, all at
    once, and returns the exceptions they raised (after joining them all)."""
    errors = []

    def run(*a):
        try:
            target(*a)
        except Exception as e:  # noqa: BLE001 (returned to the test)
            errors.append(e)

    threads = [threading.Thread(target=run, args=a) for a in args]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_redis(directory, strict: bool):
    """A redis-server (or valkey-server) on 127.0.0.1 for the block, answering
    PING, stopped afterwards: yields (process, port). Skips the test when
    none is installed, or fails when `strict`."""
    binary = shutil.which("redis-server") or shutil.which("valkey-server")
    if binary is None:
        assert not strict, "no redis-server or valkey-server on PATH (strict mode)"
        pytest.skip("no redis-server or valkey-server on PATH")
    port = free_port()
    proc = subprocess.Popen(
        [binary, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no",
         "--dir", str(directory)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2) as c:
                    c.sendall(b"PING\r\n")
                    if c.recv(16).startswith(b"+PONG"):
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.02)
        yield proc, port
    finally:
        proc.kill()
        proc.wait()
