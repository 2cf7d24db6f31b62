"""Two vLLM scheduler processes sharing libmarconi's store through
MarconiStoreTier (docs/vllm.md).

A seeded multi-turn chat trace (python-shim/tests/test_vllm.py's: sessions
over shared system prompts, each turn extending its session) runs through
vLLM 0.33.0's own Scheduler and OffloadingConnector with
TieringOffloadingSpec (CPU tier, vLLM's LRU) and MarconiStoreTier below it
(python-shim/tests/vllm_store_worker.py, one process each):

- one process alone serves every turn over an empty store; its token hit
  rate (device + host hits over prompt tokens) on the later turns is the
  reference;
- process A serves the earlier turns, then process B (a fresh scheduler:
  empty device and CPU tier) serves the later turns over the same store;
- process C serves the later turns over an empty store (what B would get
  without the store).

Prints B's rate, the reference, their ratio (goal: >= 80 %) and C's, per
backend (a directory; Redis when redis-server or valkey-server is on PATH,
started here on 127.0.0.1 and stopped).

    MARCONI_LIBRARY=$PWD/target/release/libmarconi.so VLLM_TARGET_DEVICE=cpu PYTHONPATH=python-shim \\
      target/vllm/venv/bin/python python-shim/bench/bench_vllm_store.py
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1] / "tests"


def worker(cfg: dict) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), str(TESTS.parent), env.get("PYTHONPATH", "")])
    env["PYTHONHASHSEED"] = "1234"
    p = subprocess.run([sys.executable, str(TESTS / "vllm_store_worker.py"), json.dumps(cfg)], cwd=str(TESTS),
                       env=env, capture_output=True, text=True, timeout=600)
    lines = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    if p.returncode != 0 or not lines:
        raise SystemExit(f"worker failed ({p.returncode}): {p.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def redis_server(tmp: str):
    binary = shutil.which("redis-server") or shutil.which("valkey-server")
    if binary is None:
        return None, None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([binary, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no",
                             "--databases", "64", "--dir", tmp], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2) as c:
                c.sendall(b"PING\r\n")
                if c.recv(16).startswith(b"+PONG"):
                    return proc, f"redis://127.0.0.1:{port}/"
        except OSError:
            time.sleep(0.02)
    proc.kill()
    proc.wait()
    raise SystemExit("redis-server did not start")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="1,2", help="trace seeds (comma-separated)")
    ap.add_argument("--host-chunks", default="40,80", help="CPU tier sizes in chunks (comma-separated)")
    ap.add_argument("--backends", default="dir,redis", help="dir and/or redis (redis needs redis-server)")
    args = ap.parse_args()
    seeds = [int(x) for x in args.seeds.split(",")]
    hosts = [int(x) for x in args.host_chunks.split(",")]
    from vllm_engine import model_dir  # noqa: E402 - needs TESTS on sys.path

    tmp = tempfile.mkdtemp(prefix="marconi-vllm-store-")
    md = model_dir(os.path.join(tmp, "model"))
    turns, split = 4, 2
    # A SIGTERM unwinds through the `finally` below: the server is stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    proc, url = redis_server(os.path.join(tmp))
    print("| backend | seed | host chunks | one process, turns 3-4 | B after A, turns 3-4 | B / one | "
          "C, empty store | B chunks loaded (verified) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    cell = 0
    try:
        for backend in args.backends.split(","):
            if backend == "redis" and not url:
                print("| redis | no redis-server or valkey-server on PATH |")
                continue
            for seed in seeds:
                for host in hosts:
                    def loc(name, db):
                        return os.path.join(tmp, f"{name}-{seed}-{host}") if backend == "dir" else f"{url}{db}"
                    base = {"model_dir": md, "backend": backend, "seed": seed, "host_chunks": host, "turns": turns}
                    db, cell = 3 * cell, cell + 1
                    one = worker(dict(base, location=loc("one", db), serve=[0, turns], measure=[split, turns]))
                    worker(dict(base, location=loc("shared", db + 1), serve=[0, split]))
                    b = worker(dict(base, location=loc("shared", db + 1), serve=[split, turns]))
                    c = worker(dict(base, location=loc("empty", db + 2), serve=[split, turns]))
                    rate = lambda r: r["hit"] / r["prompt"]  # noqa: E731
                    print(f"| {backend} | {seed} | {host} | {100 * rate(one):.1f} % | {100 * rate(b):.1f} % | "
                          f"{100 * rate(b) / rate(one):.0f} % | {100 * rate(c):.1f} % | {b['counts']['loaded']} "
                          f"({b['verified']}) |", flush=True)
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.path.insert(0, str(TESTS))
    main()
