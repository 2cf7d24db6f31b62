#!/usr/bin/env python3
"""Side by side: llama-server with no prompt cache, with its stock cache and
with libmarconi, on the same random-weight hybrid GGUF, driven over HTTP
with the OpenAI-compatible API (/v1/chat/completions, streamed, greedy,
logprobs on). Python standard library only.

Workloads (seeded; --workload):
  chat   sessions that share a few long system prompts and chat in turns
         (each turn sends the history back with the previous assistant
         reply); some requests regenerate the last reply (the same prompt
         again) or edit an earlier user message; more sessions than the
         state memory holds.
  agent  agent-harness sessions: tool definitions in a shared system
         prompt, user tasks with an injected timestamp, each task a loop of
         assistant turns (thinking, then a tool call) and tool results; when
         the next task starts the harness strips the thinking from the
         earlier assistant turns, so the history diverges in its middle.
The `off` server runs it first; its replies become the assistant messages of
every later run, so all servers see the same prompts, and every reply of the
caching servers is compared with `off` (tokens and logprobs). Each prompt's
tokens (/apply-template, /tokenize) give what libmarconi must resume from: a
regenerated prompt at its end (2 tokens before it), an edited history at the
deepest state saved before the edit, never after it.

Then a concurrent phase on the caching servers: several client threads over
--parallel slots, one request cancelled mid-prompt (the client closes the
socket) and one client that disconnects while the reply streams; afterwards
libmarconi's own accounting (its log line) must show no lease or saved state
left behind and its checks passing.

--negative zero-ssm|zero-conv: the negative control (off, then libmarconi
corrupting every restored state): every request resumed from a state must
then differ from `off`.

--stores: states in a store (--marconi-store): a server restarted
on a directory store resumes its sessions, a second server on the same
Redis resumes the first's, corrupted, truncated or swapped objects and a
dead store give misses and replies equal to `off`.

Exit status 0 when every check passes (see the FAIL lines).
"""

import argparse
import glob
import json
import os
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
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

LOGPROB_NOTE = ("logprobs == off in the concurrent phase is not expected bitwise for either server: with several "
                "slots busy llama.cpp decodes several sequences in one batch, and ggml then sums in another "
                "order; greedy tokens must still be equal")


def words(rng, lo, hi):
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


# A request's messages are a spec: dicts with a role and a content, or an
# assistant turn {"role": "assistant", "rid": i, "think": str|None,
# "tool": str|None} whose text is request i's reply on the `off` server.

def make_workload(seed, n_requests, n_sessions):
    """The chat workload: a list of requests (session, kind, spec, max_tokens)."""
    rng = random.Random(seed)
    systems = [words(rng, 220, 320) for _ in range(3)]
    sessions = []  # per session: the system prompt and its turns (user, request id)
    reqs = []

    def spec(system, history, user):
        m = [{"role": "system", "content": systems[system]}]
        for u, rid in history:
            m.append({"role": "user", "content": u})
            m.append({"role": "assistant", "rid": rid, "think": None, "tool": None})
        m.append({"role": "user", "content": user})
        return m

    for _ in range(n_requests):
        s = rng.randrange(n_sessions)
        while len(sessions) <= s:
            sessions.append(None)
        if sessions[s] is None:
            sessions[s] = {"system": rng.randrange(len(systems)), "turns": []}
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
                reqs.append({"session": s, "kind": kind, "spec": spec(sessions[s]["system"], base, user),
                             "max_tokens": rng.randint(6, 12)})
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
        reqs.append({"session": s, "kind": kind, "spec": spec(sessions[s]["system"], base, user),
                     "max_tokens": rng.randint(6, 12)})
    return reqs


TOOLS = ["read_file", "list_dir", "run_tests", "grep", "write_file", "web_search"]


def agent_system(rng, k):
    tools = []
    for name in TOOLS:
        tools.append(json.dumps({"type": "function", "function": {
            "name": name, "description": words(rng, 12, 24),
            "parameters": {"type": "object", "properties": {"path": {"type": "string", "description": words(rng, 4, 8)},
                                                            "query": {"type": "string"}}}}}))
    return (f"You are coding agent {k}. Current date: 2026-11-28.\n" + words(rng, 120, 160)
            + "\n# Tools\n<tools>\n" + "\n".join(tools) + "\n</tools>\n" + words(rng, 40, 60))


def make_agent_workload(seed, n_requests, n_sessions, max_words=1500):
    """Agent-harness sessions: a user task (timestamped), then assistant
    turns with thinking and a tool call, each answered by a tool result
    (timestamped), until a final answer; the next task's history keeps the
    tool calls and results but strips the thinking of earlier turns."""
    rng = random.Random(seed)
    systems = [agent_system(rng, k) for k in range(2)]
    sessions = [None] * n_sessions
    reqs = []
    clock = [9 * 3600]

    def stamp():
        clock[0] += rng.randint(3, 90)
        t = clock[0]
        return f"[2026-11-28 {t // 3600:02d}:{t // 60 % 60:02d}:{t % 60:02d}]"

    for _ in range(n_requests):
        s = rng.randrange(n_sessions)
        st = sessions[s]
        kind = "tool"
        if st is None or (st["task"] is None and st["words"] > max_words):
            st = sessions[s] = {"system": rng.randrange(len(systems)), "history": [], "task": None, "words": 0}
            kind = "new"
        if st["task"] is None:
            if kind != "new":
                kind = "task"  # the earlier turns' thinking stripped: diverges mid-history
            user = {"role": "user", "content": f"{stamp()} " + words(rng, 10, 40)}
            st["task"] = {"user": user, "steps": [], "n_steps": rng.randint(1, 4)}
            st["words"] += len(user["content"].split())
        task = st["task"]
        m = [{"role": "system", "content": systems[st["system"]]}] + st["history"] + [task["user"]]
        for step in task["steps"]:
            m.append({"role": "assistant", "rid": step["rid"], "think": step["think"], "tool": step["tool"]})
            m.append(step["result"])
        rid = len(reqs)
        reqs.append({"session": s, "kind": kind, "spec": m, "max_tokens": rng.randint(6, 12)})
        if len(task["steps"]) < task["n_steps"]:
            name = rng.choice(TOOLS)
            call = json.dumps({"name": name, "arguments": {"path": "src/" + rng.choice(WORDS) + ".rs"}})
            result = {"role": "user", "content": f"<tool_response>\n{stamp()} {name}: " + words(rng, 20, 70)
                      + "\n</tool_response>"}
            task["steps"].append({"rid": rid, "think": words(rng, 15, 50), "tool": f"<tool_call>\n{call}\n</tool_call>",
                                  "result": result})
            st["words"] += 80
        else:
            # The final answer ends the task: the harness keeps the tool
            # calls and results, without the thinking.
            h = st["history"] + [task["user"]]
            for step in task["steps"]:
                h.append({"role": "assistant", "rid": step["rid"], "think": None, "tool": step["tool"]})
                h.append(step["result"])
            h.append({"role": "assistant", "rid": rid, "think": None, "tool": None})
            st["history"] = h
            st["task"] = None
    return reqs


def messages(req, replies):
    out = []
    for m in req["spec"]:
        if m["role"] != "assistant":
            out.append({"role": m["role"], "content": m["content"]})
            continue
        text = replies[m["rid"]]
        if m["think"]:
            text = f"<think>\n{m['think']}\n</think>\n{text}"
        if m["tool"]:
            text = f"{text}\n{m['tool']}"
        out.append({"role": "assistant", "content": text})
    return out


def post(port, path, body, timeout=60.0):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def prompt_tokens(port, msgs):
    """The prompt's tokens as the server sees them (template, then tokenizer)."""
    prompt = post(port, "/apply-template", {"messages": msgs})["prompt"]
    return post(port, "/tokenize", {"content": prompt, "add_special": True, "parse_special": True})["tokens"]


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
    model = "nemotron-h"

    def __init__(self, cache, port, parallel, mib, logdir, extra=(), tag=""):
        self.cache, self.port = cache, port
        self.log_path = os.path.join(logdir, f"server-{cache}{tag}-{port}.log")
        self.log = open(self.log_path, "w")
        cmd = [os.path.join(HERE, "serve.sh"), "--port", str(port), "--cache", cache, "--parallel", str(parallel),
               "--mib", str(mib), "--model", Server.model]
        if extra:
            cmd += ["--"] + list(extra)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, limit_s):
        end = time.monotonic() + limit_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.cache} server exited; see {self.log_path}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except Exception:
                pass
            time.sleep(0.3)
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


def run_sequential(server, reqs, replies, ref, ids=None, want_tokens=False):
    """Runs reqs[i] for i in ids (default all) in order. With ref None, the
    replies are recorded (the `off` run)."""
    rows = {}
    for i in (range(len(reqs)) if ids is None else ids):
        q = reqs[i]
        msgs = messages(q, replies)
        toks, lps, text, t, ttft = chat(server.port, msgs, q["max_tokens"])
        if ref is None:
            assert len(replies) == i, "the off run goes in request order"
            replies.append(text)
        row = {"tokens": toks, "logprobs": lps, "prompt_n": t["prompt_n"], "cache_n": t["cache_n"], "ttft": ttft,
               "kind": q["kind"]}
        if want_tokens:
            pt = prompt_tokens(server.port, msgs)
            n = t["prompt_n"] + t["cache_n"]
            if len(pt) != n:
                raise RuntimeError(f"request {i}: /tokenize gives {len(pt)} tokens, the server processed {n}")
            row["prompt"] = pt
        rows[i] = row
    return rows


def lcp(a, b):
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def resume_points(reqs, ref):
    """Per request: (deepest, limit). `limit`: the longest prefix shared with
    any earlier prompt (no cache can resume past it: the edit is there);
    `deepest`: the deepest state every earlier prompt left (its key, all
    but its last 2 tokens) that this prompt starts with: where libmarconi
    resumes when nothing was evicted."""
    out = {}
    earlier = []
    for i in range(len(reqs)):
        p = ref[i]["prompt"]
        key = len(p) - 2
        limit, deepest = 0, 0
        for e in earlier:
            c = lcp(p, e)
            limit = max(limit, c)
            if len(e) - 2 <= key and c >= len(e) - 2:
                deepest = max(deepest, len(e) - 2)
        out[i] = (deepest, min(limit, key))
        earlier.append(p)
    return out


def check_resumes(reqs, ref, rows, strict):
    """libmarconi's hit (cache_n) per request against the resume points."""
    pts = resume_points(reqs, ref)
    counts = {}
    past, short = [], []
    for i, r in rows.items():
        deepest, limit = pts[i]
        kind = reqs[i]["kind"]
        c = counts.setdefault(kind, [0, 0])
        c[1] += 1
        if r["cache_n"] > limit:
            past.append(i)
        elif r["cache_n"] >= deepest:
            c[0] += 1
        else:
            short.append(i)
    text = ", ".join(f"{k} {v[0]}/{v[1]}" for k, v in sorted(counts.items()))
    print(f"libmarconi resumed at the deepest state saved before the prompt diverges (regenerate: its end): {text}; "
          f"past the divergence: {len(past)}")
    ok = not past
    if past:
        print(f"FAIL: requests {past[:5]} resumed past where their prompt diverges from every earlier one")
    if strict and short:
        print(f"FAIL: requests {short[:5]} resumed before the deepest state saved (nothing was evicted)")
        ok = False
    return ok


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


def run_concurrent(server, reqs, replies, ref_rows, n_clients):
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
                toks, lps, _, _, _ = chat(server.port, messages(q, replies), q["max_tokens"])
                results[i] = (toks, lps)
        except Exception as e:  # reported below
            errors.append(repr(e))

    first = messages(reqs[0], replies)
    long_msgs = [{"role": "system", "content": first[0]["content"] * 2}, {"role": "user", "content": "cancelled"}]
    threads = [threading.Thread(target=client, args=(ids,)) for ids in by_client]
    for t in threads:
        t.start()
    cancel_mid_prompt(server.port, long_msgs)
    disconnect_mid_reply(server.port, first)
    for t in threads:
        t.join(timeout=600)
    if errors:
        raise RuntimeError(f"concurrent clients failed: {errors[:3]}")
    tok_mis = sum(1 for i, (toks, _) in results.items() if toks != ref_rows[i]["tokens"])
    lp_mis = sum(1 for i, (_, lps) in results.items() if lps != ref_rows[i]["logprobs"])
    # let the server finish the cancelled and disconnected requests
    time.sleep(2.0)
    return len(results), tok_mis, lp_mis


def leak(line):
    return (line is None or line["leases"] != 0 or line["in_flight"] != 0 or line["blobs"] != line["states"]
            or line["check_failures"] != 0 or line["restore_failures"] != 0)


def off_run(args, reqs, logdir):
    replies = []
    srv = Server("off", free_port(), 1, args.mib, logdir).wait_ready(args.ready_s)
    try:
        ref = run_sequential(srv, reqs, replies, None, want_tokens=True)
    finally:
        srv.stop()
    return replies, ref


def compare(rows, ref):
    tok = sum(1 for i, r in rows.items() if r["tokens"] != ref[i]["tokens"])
    lp = sum(1 for i, r in rows.items() if r["logprobs"] != ref[i]["logprobs"])
    return tok, lp


def side_by_side(args, reqs, logdir):
    ok = True
    replies, ref = off_run(args, reqs, logdir)
    table = {}
    mrows = None
    for cache in ("off", "stock", "marconi"):
        if cache == "off":
            rows = ref
        else:
            srv = Server(cache, free_port(), 1, args.mib, logdir).wait_ready(args.ready_s)
            try:
                rows = run_sequential(srv, reqs, replies, ref)
                line = srv.marconi_line() if cache == "marconi" else None
            finally:
                srv.stop()
            if cache == "marconi":
                mrows, mline = rows, line
        tok_mis, lp_mis = compare(rows, ref)
        ttfts = [r["ttft"] * 1000 for r in rows.values()]
        table[cache] = {"prompt_n": sum(r["prompt_n"] for r in rows.values()),
                        "cache_n": sum(r["cache_n"] for r in rows.values()),
                        "p50": statistics.median(ttfts), "p95": pct(ttfts, 0.95), "tok_mis": tok_mis, "lp_mis": lp_mis}
    n = len(reqs)
    total = sum(r["prompt_n"] + r["cache_n"] for r in ref.values())
    print(f"\nsequential, 1 slot, {args.mib} MiB of saved states (+ stock's 32 checkpoints, see docs):")
    print(f"{'server':<9} {'prompt_n':>9} {'cache_n':>8} {'of tokens':>10} {'TTFT p50 ms':>12} {'p95 ms':>8} "
          f"{'tokens == off':>14} {'logprobs == off':>16}")
    for cache, t in table.items():
        print(f"{cache:<9} {t['prompt_n']:>9} {t['cache_n']:>8} {100.0 * t['prompt_n'] / total:>9.1f}% "
              f"{t['p50']:>12.1f} {t['p95']:>8.1f} {n - t['tok_mis']:>8}/{n:<5} "
              f"{n - t['lp_mis']:>10}/{n:<5}")
    ratio = 100.0 * table["marconi"]["prompt_n"] / max(1, table["stock"]["prompt_n"])
    print(f"libmarconi processed {ratio:.1f}% of stock's prompt tokens")
    if mline:
        print(f"libmarconi at the end: {mline}")
    ok &= check_resumes(reqs, ref, mrows, strict=bool(mline) and mline["evictions"] == 0)
    if table["marconi"]["prompt_n"] >= table["stock"]["prompt_n"]:
        print("FAIL: libmarconi did not process fewer prompt tokens than stock")
        ok = False
    if args.max_ratio is not None and ratio > args.max_ratio:
        print(f"FAIL: libmarconi processed more than {args.max_ratio}% of stock's prompt tokens")
        ok = False
    if table["marconi"]["tok_mis"] or table["marconi"]["lp_mis"]:
        print("FAIL: libmarconi's greedy replies differ from the server with prompt caching off")
        ok = False
    if leak(mline):
        print("FAIL: libmarconi left a lease or a state behind, or its checks failed")
        ok = False
    if args.clients == 0:
        return ok

    print(f"\nconcurrent: {args.clients} clients over --parallel {args.parallel}, one request cancelled mid-prompt, "
          "one client disconnecting mid-reply")
    for cache in ("stock", "marconi"):
        srv = Server(cache, free_port(), args.parallel, args.mib, logdir).wait_ready(args.ready_s)
        try:
            n, tok_mis, lp_mis = run_concurrent(srv, reqs, replies, ref, args.clients)
            with urllib.request.urlopen(f"http://127.0.0.1:{srv.port}/health", timeout=10) as r:
                healthy = r.status == 200
            line = srv.marconi_line() if cache == "marconi" else None
        finally:
            srv.stop()
        print(f"{cache:<9} {n} requests, tokens == off {n - tok_mis}/{n}, logprobs == off {n - lp_mis}/{n}, "
              f"healthy after: {healthy}")
        if tok_mis:
            print(f"FAIL: {cache}'s greedy replies differ from off in the concurrent phase")
            ok = False
        if cache == "marconi":
            print(f"libmarconi at the end: {line}")
            if leak(line) or not healthy:
                print("FAIL: libmarconi left a lease or a state behind, or its checks failed")
                ok = False
    print(f"note: {LOGPROB_NOTE}")
    return ok


def negative(args, reqs, logdir):
    """The negative control: every restored state corrupted must change the reply's logprobs."""
    replies, ref = off_run(args, reqs, logdir)
    srv = Server("marconi", free_port(), 1, args.mib, logdir, ["--marconi-negative", args.negative],
                 tag="-negative").wait_ready(args.ready_s)
    try:
        rows = run_sequential(srv, reqs, replies, ref)
        line = srv.marconi_line()
    finally:
        srv.stop()
    hits = [i for i, r in rows.items() if r["cache_n"] > 0]
    detected = [i for i in hits if rows[i]["logprobs"] != ref[i]["logprobs"]]
    clean = [i for i, r in rows.items() if r["cache_n"] == 0 and r["logprobs"] != ref[i]["logprobs"]]
    print(f"negative control {args.negative}: {line and line['corrupted']} restored states corrupted; "
          f"{len(detected)} of the {len(hits)} requests resumed from one differ from off (logprobs); "
          f"requests with no hit that differ: {len(clean)}")
    ok = bool(hits) and len(detected) == len(hits) and not clean and line and line["corrupted"] == len(hits)
    print("negative control detected" if ok else "FAIL: a corrupted restored state went unnoticed")
    return ok


def start_redis(workdir):
    redis = shutil.which("redis-server") or shutil.which("valkey-server")
    if not redis:
        raise RuntimeError("no redis-server or valkey-server on PATH")
    port = free_port()
    log = open(os.path.join(workdir, f"redis-{port}.log"), "w")
    proc = subprocess.Popen([redis, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no",
                             "--protected-mode", "yes"], stdout=log, stderr=subprocess.STDOUT)
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc, port
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("redis-server did not start")


def store_tests(args, reqs, logdir):
    """Restart on a directory store, sharing through Redis, bad objects, a dead store."""
    ok = True
    replies, ref = off_run(args, reqs, logdir)
    # Phase 1: the first half of the requests; phase 2: the rest (the same
    # sessions continued).
    half = len(reqs) // 2
    p1, p2 = list(range(half)), list(range(half, len(reqs)))
    work = tempfile.mkdtemp(prefix="stores.", dir=logdir)
    procs = []

    def server(store, tag, extra=()):
        s = Server("marconi", free_port(), 1, args.mib, logdir, ["--marconi-store", store] + list(extra), tag=tag)
        procs.append(s)
        return s.wait_ready(args.ready_s)

    def phase(srv, ids):
        rows = run_sequential(srv, reqs, replies, ref, ids)
        tok, lp = compare(rows, ref)
        return sum(r["cache_n"] for r in rows.values()), tok, lp

    def report(name, hit, tok, lp, n, line, base=None):
        nonlocal ok
        rel = "" if base is None else f" ({100.0 * hit / max(1, base):.1f}% of {base})"
        print(f"{name:<44} hit tokens {hit:>6}{rel}, tokens == off {n - tok}/{n}, logprobs == off {n - lp}/{n}; "
              f"host_hits {line['host_hits']} store_hits {line['store_hits']} load_failures {line['load_failures']} "
              f"store_puts {line['store_puts']} store_misses {line['store_misses']}")
        if tok or lp:
            print(f"FAIL: {name}: replies differ from off")
            ok = False
        if leak(line):
            print(f"FAIL: {name}: a lease or a state left behind, or a check failed")
            ok = False

    redis_proc = None
    try:
        print(f"\nstores: {half} requests, then {len(reqs) - half} more of the same sessions")
        # Baseline: one server, both phases, never restarted.
        a = server(os.path.join(work, "base"), "-base")
        phase(a, p1)
        base_hit, tok, lp = phase(a, p2)
        a.stop()
        report("no restart (phase 2)", base_hit, tok, lp, len(p2), a.marconi_line())

        # Restart: phase 1, stop, a new server on the same directory.
        d = os.path.join(work, "dir")
        a = server(d, "-dir1")
        phase(a, p1)
        a.stop()
        snapshot = os.path.join(work, "dir-snapshot")
        shutil.copytree(d, snapshot)
        b = server(d, "-dir2")
        hit, tok, lp = phase(b, p2)
        b.stop()
        report("restarted on the directory store (phase 2)", hit, tok, lp, len(p2), b.marconi_line(), base_hit)
        if hit < 0.9 * base_hit:
            print("FAIL: after a restart, fewer than 90% of the hit tokens of the server that was not restarted")
            ok = False

        # Bad objects: every object of the phase-1 snapshot corrupted,
        # truncated or swapped with another's bytes.
        objs = sorted(f for f in glob.glob(os.path.join(snapshot, "**", "*"), recursive=True) if os.path.isfile(f))
        for k, f in enumerate(objs):
            size = os.path.getsize(f)
            if k % 3 == 0:
                with open(f, "r+b") as fh:
                    fh.seek(size // 2)
                    b0 = fh.read(1)
                    fh.seek(size // 2)
                    fh.write(bytes([(b0[0] if b0 else 0) ^ 0xFF]))
            elif k % 3 == 1:
                os.truncate(f, size // 2)
            elif k >= 2:
                shutil.copyfile(objs[k - 2], f)
        c = server(snapshot, "-bad")
        hit, tok, lp = phase(c, p2)
        c.stop()
        line = c.marconi_line()
        report(f"{len(objs)} objects corrupted/truncated/swapped", hit, tok, lp, len(p2), line)
        if objs and line["store_misses"] == 0 and line["load_failures"] == 0:
            print("FAIL: bad objects were not counted as misses")
            ok = False

        # Another model's states: the same store, another identity.
        e = server(d, "-foreign", ["--marconi-model-id", "another-model"])
        hit, tok, lp = phase(e, p2)
        e.stop()
        line = e.marconi_line()
        report("another model on the same directory", hit, tok, lp, len(p2), line)
        if line["store_hits"] != 0:
            print("FAIL: a server of another model used this model's states")
            ok = False

        # Sharing: two servers, one Redis.
        redis_proc, port = start_redis(work)
        url = f"redis://127.0.0.1:{port}"
        a = server(url, "-redis1")
        phase(a, p1)
        b = server(url, "-redis2")
        hit, tok, lp = phase(b, p2)
        report("second server on the first's Redis (phase 2)", hit, tok, lp, len(p2), b.marconi_line(), base_hit)
        if hit < 0.8 * base_hit:
            print("FAIL: the second server got fewer than 80% of the first's hit tokens")
            ok = False
        b.stop()
        # A dead store: Redis killed, the first server goes on.
        redis_proc.kill()
        redis_proc.wait(timeout=20)
        redis_proc = None
        hit, tok, lp = phase(a, p2)
        a.stop()
        line = a.marconi_line()
        report("Redis killed, the first server goes on", hit, tok, lp, len(p2), line)
    finally:
        for s in procs:
            s.stop() if not s.log.closed else None
        if redis_proc:
            redis_proc.kill()
            redis_proc.wait(timeout=20)
        shutil.rmtree(work, ignore_errors=True)
    return ok


def main():
    # A run stopped by a timeout or ^C still stops the servers it started
    # (the finally blocks run on SystemExit).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", choices=("chat", "agent"), default="chat")
    ap.add_argument("--requests", type=int, default=None, help="default 48 (chat), 64 (agent)")
    ap.add_argument("--sessions", type=int, default=None, help="default 12 (chat), 6 (agent)")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--mib", type=int, default=8, help="serve.sh --mib: the state memory of both caches")
    ap.add_argument("--parallel", type=int, default=3, help="slots of the concurrent phase")
    ap.add_argument("--clients", type=int, default=4, help="client threads of the concurrent phase (0: none)")
    ap.add_argument("--max-ratio", type=float, default=None,
                    help="fail when libmarconi processes more than this %% of stock's prompt tokens")
    ap.add_argument("--negative", choices=("zero-ssm", "zero-conv"), default=None,
                    help="run the negative control instead of the side by side")
    ap.add_argument("--stores", action="store_true",
                    help="run the store tests (restart on a directory, sharing through Redis) instead")
    ap.add_argument("--model", choices=("nemotron-h", "granite-hybrid", "falcon-h1", "qwen35"), default="nemotron-h",
                    help="serve.sh --model: the random-weight hybrid family")
    ap.add_argument("--ready-s", type=float, default=3600, help="how long a server may take to start (a build)")
    ap.add_argument("--logdir", default=None)
    args = ap.parse_args()
    Server.model = args.model
    if args.requests is None:
        args.requests = 64 if args.workload == "agent" else 48
    if args.sessions is None:
        args.sessions = 6 if args.workload == "agent" else 12
    logdir = args.logdir or os.path.join(os.environ.get("CARGO_TARGET_DIR", os.path.join(HERE, "../../target")),
                                         "llama-server", "logs")
    os.makedirs(logdir, exist_ok=True)
    subprocess.run([os.path.join(HERE, "build.sh")], check=True, stdout=subprocess.DEVNULL)

    if args.workload == "agent":
        reqs = make_agent_workload(args.seed, args.requests, args.sessions)
    else:
        reqs = make_workload(args.seed, args.requests, args.sessions)
    kinds = {}
    for q in reqs:
        kinds[q["kind"]] = kinds.get(q["kind"], 0) + 1
    print(f"model tiny-{args.model}, workload {args.workload}: {len(reqs)} requests over {args.sessions} sessions, seed {args.seed}: "
          + ", ".join(f"{v} {k}" for k, v in kinds.items()), flush=True)

    if args.negative:
        ok = negative(args, reqs, logdir)
    elif args.stores:
        ok = store_tests(args, reqs, logdir)
    else:
        ok = side_by_side(args, reqs, logdir)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
