#!/usr/bin/env python3
"""Side by side: llama-server with no prompt cache, with its stock cache and
with libmarconi, on the same random-weight hybrid GGUF, driven over HTTP
with the OpenAI-compatible API (/v1/chat/completions, streamed, greedy,
logprobs on). Python standard library only.

Workload (seeded): sessions that share a few long system prompts and chat in
turns (each turn sends the history back with the previous assistant reply),
some requests branch (regenerate an earlier reply, or edit an earlier user
message), more sessions than the state memory holds. The `off` server runs
it first; its replies become the assistant messages of every later run, so
all servers see the same prompts, and every reply of the caching servers is
compared with `off` (tokens and logprobs).

Then a concurrent phase on the caching servers: several client threads over
--parallel slots, one request cancelled mid-prompt (the client closes the
socket) and one client that disconnects while the reply streams; afterwards
libmarconi's own accounting (its log line) must show no lease or saved state
left behind and marconi_cache_check passing.

Exit status 0 when libmarconi processed fewer prompt tokens than stock, every
sequential libmarconi reply equals `off`, and the concurrent phase left no
state behind.
"""

import argparse
import json
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))

WORDS = (
    "the cache keeps state of every prefix that later requests share while memory lasts and a model "
    "with recurrent layers cannot roll back so each saved checkpoint must be chosen with care because "
    "tokens after the checkpoint are processed again when nothing deeper was kept the server answers "
    "questions about rivers mountains history code music gardens trains weather cooking physics maps "
    "letters numbers colours stories planets oceans forests deserts cities bridges engines clocks"
).split()


def words(rng, lo, hi):
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def make_workload(seed, n_requests, n_sessions):
    """Returns a list of requests: dicts with the session, the kind and a
    function of the replies so far giving the messages."""
    rng = random.Random(seed)
    systems = [words(rng, 220, 320) for _ in range(3)]
    sessions = []  # per session: list of (user text) turns; a turn index refers to a reply
    reqs = []
    for _ in range(n_requests):
        s = rng.randrange(n_sessions)
        while len(sessions) <= s:
            sessions.append(None)
        if sessions[s] is None:
            sessions[s] = {"system": rng.randrange(len(systems)), "turns": []}  # turns: list of (user, request id)
            kind = "new"
            base = []
        else:
            turns = sessions[s]["turns"]
            u = rng.random()
            if len(turns) >= 2 and u < 0.15:
                kind = "regenerate"  # the last turn again: same prompt
                base = turns[:-1]
                user = turns[-1][0]
                sessions[s]["turns"] = base + [(user, len(reqs))]
                reqs.append({"session": s, "kind": kind, "system": sessions[s]["system"],
                             "history": list(base), "user": user, "max_tokens": rng.randint(6, 12)})
                continue
            if len(turns) >= 2 and u < 0.3:
                kind = "edit"  # rewrite an earlier user message, drop what followed
                cut = rng.randrange(1, len(turns))
                base = turns[:cut]
            else:
                kind = "turn"
                base = turns
        user = words(rng, 8, 40)
        sessions[s]["turns"] = list(base) + [(user, len(reqs))]
        reqs.append({"session": s, "kind": kind, "system": sessions[s]["system"],
                     "history": list(base), "user": user, "max_tokens": rng.randint(6, 12)})
    return systems, reqs


def messages(systems, req, replies):
    m = [{"role": "system", "content": systems[req["system"]]}]
    for user, rid in req["history"]:
        m.append({"role": "user", "content": user})
        m.append({"role": "assistant", "content": replies[rid]})
    m.append({"role": "user", "content": req["user"]})
    return m


def chat(port, msgs, max_tokens, timeout=120.0):
    """One streamed greedy chat completion. Returns (tokens, logprobs, text,
    timings, ttft_s)."""
    body = json.dumps({"messages": msgs, "max_tokens": max_tokens, "temperature": 0.0, "seed": 0,
                       "logprobs": True, "stream": True, "stream_options": {"include_usage": True}}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    t0 = time.monotonic()
    ttft = None
    toks, lps, text, timings = [], [], [], None
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if "timings" in ev:
                timings = ev["timings"]
            for ch in ev.get("choices", []):
                lp = (ch.get("logprobs") or {}).get("content") or []
                if lp and ttft is None:
                    ttft = time.monotonic() - t0
                for x in lp:
                    toks.append(x["token"])
                    lps.append(x["logprob"])
                text.append((ch.get("delta") or {}).get("content") or "")
    if timings is None:
        raise RuntimeError("no timings in the streamed reply")
    return toks, lps, "".join(text), timings, (ttft if ttft is not None else time.monotonic() - t0)


class Server:
    def __init__(self, cache, port, parallel, mib, logdir):
        self.cache, self.port = cache, port
        self.log_path = os.path.join(logdir, f"server-{cache}-{port}.log")
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [os.path.join(HERE, "serve.sh"), "--port", str(port), "--cache", cache, "--parallel", str(parallel),
             "--mib", str(mib)], stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, limit_s):
        end = time.monotonic() + limit_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.cache} server exited; see {self.log_path}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except Exception:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.cache} server not ready in {limit_s} s; see {self.log_path}")

    def stop(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=20)
        self.log.close()

    def marconi_line(self):
        last = None
        with open(self.log_path, errors="replace") as f:
            for line in f:
                if line.startswith("marconi: admitted") or line.startswith("marconi: abandoned"):
                    last = line
        if last is None:
            return None
        return {k: int(v) for k, v in re.findall(r"([a-z_]+) (\d+)", last.split(":", 1)[1])}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def run_sequential(server, systems, reqs, replies, ref):
    rows = []
    for i, q in enumerate(reqs):
        toks, lps, text, t, ttft = chat(server.port, messages(systems, q, replies), q["max_tokens"])
        if ref is None:
            replies.append(text)
        rows.append({"tokens": toks, "logprobs": lps, "prompt_n": t["prompt_n"], "cache_n": t["cache_n"],
                     "ttft": ttft, "kind": q["kind"]})
    return rows


def cancel_mid_prompt(port, msgs):
    """Sends a long prompt, streamed, and closes the socket before any reply."""
    body = json.dumps({"messages": msgs, "max_tokens": 8, "temperature": 0.0, "stream": True}).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        time.sleep(0.05)


def disconnect_mid_reply(port, msgs):
    """Streams a reply and closes the connection after its first event."""
    body = json.dumps({"messages": msgs, "max_tokens": 64, "temperature": 0.0, "stream": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    r = urllib.request.urlopen(req, timeout=60)
    r.readline()
    r.close()


def run_concurrent(server, systems, reqs, replies, ref_rows, n_clients):
    """Sessions split over client threads (each keeps its sessions' order);
    returns (requests served, token mismatches, logprob mismatches)."""
    by_client = [[] for _ in range(n_clients)]
    for i, q in enumerate(reqs):
        by_client[q["session"] % n_clients].append(i)
    results, errors = {}, []

    def client(ids):
        try:
            for i in ids:
                q = reqs[i]
                toks, lps, _, _, _ = chat(server.port, messages(systems, q, replies), q["max_tokens"])
                results[i] = (toks, lps)
        except Exception as e:  # reported below
            errors.append(repr(e))

    long_msgs = [{"role": "system", "content": " ".join(systems)}, {"role": "user", "content": "cancelled"}]
    threads = [threading.Thread(target=client, args=(ids,)) for ids in by_client]
    for t in threads:
        t.start()
    cancel_mid_prompt(server.port, long_msgs)
    disconnect_mid_reply(server.port, messages(systems, reqs[0], replies))
    for t in threads:
        t.join(timeout=600)
    if errors:
        raise RuntimeError(f"concurrent clients failed: {errors[:3]}")
    tok_mis = sum(1 for i, (toks, _) in results.items() if toks != ref_rows[i]["tokens"])
    lp_mis = sum(1 for i, (_, lps) in results.items() if lps != ref_rows[i]["logprobs"])
    # let the server finish the cancelled and disconnected requests
    time.sleep(2.0)
    return len(results), tok_mis, lp_mis


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--sessions", type=int, default=12)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--mib", type=int, default=8, help="serve.sh --mib: the state memory of both caches")
    ap.add_argument("--parallel", type=int, default=3, help="slots of the concurrent phase")
    ap.add_argument("--clients", type=int, default=4, help="client threads of the concurrent phase")
    ap.add_argument("--logdir", default=None)
    args = ap.parse_args()
    logdir = args.logdir or os.path.join(os.environ.get("CARGO_TARGET_DIR", os.path.join(HERE, "../../target")),
                                         "llama-server", "logs")
    os.makedirs(logdir, exist_ok=True)
    subprocess.run([os.path.join(HERE, "build.sh")], check=True, stdout=subprocess.DEVNULL)

    systems, reqs = make_workload(args.seed, args.requests, args.sessions)
    kinds = {k: sum(1 for q in reqs if q["kind"] == k) for k in ("new", "turn", "regenerate", "edit")}
    print(f"workload: {len(reqs)} requests over {args.sessions} sessions, 3 system prompts, seed {args.seed}: "
          + ", ".join(f"{v} {k}" for k, v in kinds.items()), flush=True)

    replies, table, ok = [], {}, True
    ref = None
    for cache in ("off", "stock", "marconi"):
        srv = Server(cache, free_port(), 1, args.mib, logdir)
        try:
            srv.wait_ready(600)
            rows = run_sequential(srv, systems, reqs, replies, ref)
            line = srv.marconi_line() if cache == "marconi" else None
        finally:
            srv.stop()
        if ref is None:
            ref = rows
        tok_mis = sum(1 for a, b in zip(rows, ref) if a["tokens"] != b["tokens"])
        lp_mis = sum(1 for a, b in zip(rows, ref) if a["logprobs"] != b["logprobs"])
        ttfts = [r["ttft"] * 1000 for r in rows]
        table[cache] = {"prompt_n": sum(r["prompt_n"] for r in rows), "cache_n": sum(r["cache_n"] for r in rows),
                        "p50": statistics.median(ttfts), "p95": pct(ttfts, 0.95), "tok_mis": tok_mis, "lp_mis": lp_mis}
        if line:
            table[cache]["line"] = line
    total = sum(r["prompt_n"] + r["cache_n"] for r in ref)
    print(f"\nsequential, 1 slot, {args.mib} MiB of saved states (+ stock's 32 checkpoints, see docs):")
    print(f"{'server':<9} {'prompt_n':>9} {'cache_n':>8} {'of tokens':>10} {'TTFT p50 ms':>12} {'p95 ms':>8} "
          f"{'tokens == off':>14} {'logprobs == off':>16}")
    for cache, t in table.items():
        print(f"{cache:<9} {t['prompt_n']:>9} {t['cache_n']:>8} {100.0 * t['prompt_n'] / total:>9.1f}% "
              f"{t['p50']:>12.1f} {t['p95']:>8.1f} {len(reqs) - t['tok_mis']:>8}/{len(reqs):<5} "
              f"{len(reqs) - t['lp_mis']:>10}/{len(reqs):<5}")
    if "line" in table["marconi"]:
        print(f"libmarconi at the end: {table['marconi']['line']}")
    if table["marconi"]["prompt_n"] >= table["stock"]["prompt_n"]:
        print("FAIL: libmarconi did not process fewer prompt tokens than stock")
        ok = False
    if table["marconi"]["tok_mis"] or table["marconi"]["lp_mis"]:
        print("FAIL: libmarconi's greedy replies differ from the server with prompt caching off")
        ok = False

    print(f"\nconcurrent: {args.clients} clients over --parallel {args.parallel}, one request cancelled mid-prompt, "
          "one client disconnecting mid-reply")
    for cache in ("stock", "marconi"):
        srv = Server(cache, free_port(), args.parallel, args.mib, logdir)
        try:
            srv.wait_ready(600)
            n, tok_mis, lp_mis = run_concurrent(srv, systems, reqs, replies, ref, args.clients)
            with urllib.request.urlopen(f"http://127.0.0.1:{srv.port}/health", timeout=10) as r:
                healthy = r.status == 200
            line = srv.marconi_line() if cache == "marconi" else None
        finally:
            srv.stop()
        print(f"{cache:<9} {n} requests, tokens == off {n - tok_mis}/{n}, logprobs == off {n - lp_mis}/{n}, "
              f"healthy after: {healthy}")
        if cache == "marconi":
            print(f"libmarconi at the end: {line}")
            leak = (line is None or line["leases"] != 0 or line["in_flight"] != 0 or line["blobs"] != line["states"]
                    or line["check_failures"] != 0 or line["restore_failures"] != 0)
            if leak or not healthy:
                print("FAIL: libmarconi left a lease or a state behind, or its checks failed")
                ok = False
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
