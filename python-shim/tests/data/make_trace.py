"""Writes trace.jsonl: a small deterministic multi-turn workload.

Three system prompts shared by sixteen conversations of four turns each,
interleaved (64 requests). Each line is {"input": [...], "output": [...]}:
the input is the whole history (system prompt, earlier turns and their
outputs) plus the new user message. Run: python3 make_trace.py > trace.jsonl
"""

import json
import random

rng = random.Random(7)
systems = [[1_000_000 * (s + 1) + i for i in range(rng.randint(60, 120))] for s in range(3)]
convs = []
for c in range(16):
    convs.append({"history": list(systems[c % 3]), "next": 10_000 * (c + 1), "turns": 0})

order = [c for c in range(16) for _ in range(4)]
rng.shuffle(order)
for c in order:
    conv = convs[c]
    user = [conv["next"] + i for i in range(rng.randint(15, 40))]
    conv["next"] += 100
    out = [conv["next"] + i for i in range(rng.randint(8, 30))]
    conv["next"] += 100
    inp = conv["history"] + user
    print(json.dumps({"input": inp, "output": out}, separators=(",", ":")))
    conv["history"] = inp + out
