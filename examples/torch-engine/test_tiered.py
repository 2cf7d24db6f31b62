"""The torch engine over the tiered cache (tiered.py; needs torch and
transformers): engine A writes its states through a directory store, a
fresh engine B continues A's sessions from them, every logit of both within
TOLERANCE of a no-cache run; with the store's objects corrupted, B's loads
miss (counted) and its logits still match."""

import torch

from engine import TOLERANCE
from tiered import run_pair

torch.set_num_threads(1)


def test_a_second_engine_resumes_from_the_shared_store(tmp_path):
    r = run_pair(str(tmp_path))
    a, b, bad = r["a"], r["b"], r["b_corrupt"]
    assert a["requests"] >= 20 and a["host"] > 0, a
    assert a["host_writes"] > 0 and a["host_drops"] > 0 and a["store_writes"] > 0
    # B's cache starts empty: what it resumes from, A stored.
    assert b["shared"] > 0 and b["store"] == b["shared"] and b["load_misses"] == 0, b
    assert b["stats"]["shared_hits"] == b["shared"]
    assert b["hit_tokens"] > b["input_tokens"] // 2
    # Every object corrupted: the probe still finds names, every read misses.
    assert bad["load_misses"] > 0 and bad["store"] == 0, bad
    assert bad["stats"]["load_failures"] == bad["load_misses"]
    assert r["store"]["corrupt"] == bad["load_misses"]
    for k in ("a", "b", "b_corrupt"):
        assert r[k]["max_relative_diff"] <= TOLERANCE, (k, r[k]["max_relative_diff"])
