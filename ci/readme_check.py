#!/usr/bin/env python3
"""The README's figures against what its commands printed (ci/test.d/readme.sh
runs the commands from a fresh clone and calls this with their outputs).

usage: readme_check.py OUT_DIR FIGURES_DIR

OUT_DIR holds what readme.sh captured: compare.txt (the main job's stdout),
tiers.txt (the tiers row's command), route.txt (docs/routing.md's command),
help.txt (`marconi-sim --help`), commands.json (the README commands run and
where). FIGURES_DIR (`$CARGO_TARGET_DIR/readme-figures`) holds the figures
the heavy steps measured (llama-engine.json, llama-server.json,
consumers.json); a row is compared when its file comes from this CI run
(MARCONI_CI_RUN) or, run alone, from a run of this commit or of one that
differs from it in documentation (or this check) only; otherwise the output says it was
not checked (and in a CI run, fails: those steps run before readme.sh). MARCONI_BLESS=1 rewrites what differs.
Runs from the repository root; exit status 1 on a difference."""

import json
import os
import re
import subprocess
import sys

out_dir, figures_dir = sys.argv[1], sys.argv[2]
bless = os.environ.get("MARCONI_BLESS") == "1"
ci_run = os.environ.get("MARCONI_CI_RUN", "")
failures = []
checked = []  # (what, where checked, result)
readme = open("README.md").read()


def fail(msg):
    failures.append(msg)
    print("FAIL: " + msg)


# 1. The headline table: the main job's printed table, rendered as the README shows it.
labels = [
    ("marconi", "marconi (default)"), ("marconi-paper", "marconi-paper"),
    ("marconi-tuned", "marconi-tuned"), ("sglang-plus", "sglang-plus"),
    ("vllm-plus", "vllm-plus"), ("no-cache", "no-cache"),
    ("clairvoyant", "clairvoyant (knows the future)"), ("oracle", "oracle (unbounded)"),
]
printed = {}
for line in open(os.path.join(out_dir, "compare.txt")):
    f = line.split()
    # policy capacity... tok hit% req hit% FLOP sv% p50 p95 evictions rejected alpha wall req/s Mtok/s
    if len(f) >= 12 and f[0] in dict(labels):
        printed[f[0]] = (f[-11], f[-10], f[-9], f[-6])
missing = [n for n, _ in labels if n not in printed]
if missing:
    fail("the main job printed no row for %s" % ", ".join(missing))
else:
    rows = ["| policy | token hit | requests with a hit | FLOPs saved | evictions |",
            "|---|---:|---:|---:|---:|"]
    for name, label in labels:
        tok, req, flop, ev = printed[name]
        rows.append("| %s | %s %% | %s %% | %s %% | %s |" % (label, tok, req, flop, ev))
    table = "\n".join(rows)
    m = re.search(r"(<!-- headline:begin[^>]*-->\n)(.*?)(<!-- headline:end -->)", readme, re.S)
    assert m, "README.md lost its headline markers"
    if m.group(2).strip() != table:
        if bless:
            readme = readme[:m.start(2)] + table + "\n" + readme[m.end(2):]
            print("README.md: headline table rewritten")
        else:
            fail("README headline table differs from what the main job prints:\n--- README\n%s\n--- printed\n%s"
                 % (m.group(2).strip(), table))
    checked.append(("headline table", "compared with the main job's printed table"))

# 2. docs/routing.md's route table.
route = "\n".join(l for l in open(os.path.join(out_dir, "route.txt")).read().split("\n")
                  if l and not l.startswith("Columns:") and " runs in " not in l)
doc = open("docs/routing.md").read()
m = re.search(r"(<!-- route:begin -->\n```text\n)(.*?)(\n```\n<!-- route:end -->)", doc, re.S)
assert m, "docs/routing.md lost its route markers"
if m.group(2) != route:
    if bless:
        open("docs/routing.md", "w").write(doc[:m.start(2)] + route + doc[m.end(2):])
        print("docs/routing.md: route table rewritten")
    else:
        fail("docs/routing.md's route table differs from the command's:\n--- doc\n%s\n--- now\n%s"
             % (m.group(2), route))

# 3. Every `marconi-sim CMD` the README names is a command --help lists.
help_text = open(os.path.join(out_dir, "help.txt")).read()
commands = set(re.findall(r"^  ([a-z][a-z-]*)\s", help_text, re.M))
named = re.findall(r"marconi-sim(?: --)?\s+([a-z][a-z-]*)", readme)
for cmd in named:
    if cmd not in commands:
        fail(f"README runs `marconi-sim {cmd}`, which --help does not list: {sorted(commands)}")


# The second table's rows: the row whose "measured by" cell holds `key`.
def table_row(key):
    rows = [l for l in readme.split("\n") if l.startswith("| ") and key in l]
    assert len(rows) == 1, f"README: {len(rows)} table rows name {key!r}"
    return rows[0]


def table_cmd(row):
    return row.rstrip(" |").split(" | ")[-1].split("`")[1]


def check_numbers(row_key, patterns, values, source):
    """patterns: regexes whose groups are the row's figures; values: what
    the command measured, in group order (strings as the README writes them)."""
    global readme
    row = table_row(row_key)
    new_row, diffs = row, []
    for pat, vals in zip(patterns, values):
        m = re.search(pat, new_row)
        if not m:
            fail(f"README row of `{table_cmd(row)}`: no text matching {pat!r}")
            return
        got = m.groups()
        if list(got) != list(vals):
            diffs.append(f"{m.group(0)!r}: the README says {list(got)}, {source} measured {list(vals)}")
            pieces, last = [], 0
            for k, v in enumerate(vals, 1):
                pieces += [new_row[last:m.start(k)], v]
                last = m.end(k)
            new_row = "".join(pieces) + new_row[last:]
    if diffs and bless:
        readme = readme.replace(row, new_row)
        print(f"README.md: row of `{table_cmd(row)}` rewritten")
    elif diffs:
        fail(f"README row of `{table_cmd(row)}` differs:\n  " + "\n  ".join(diffs))
    checked.append((f"examples table row of `{table_cmd(row)}`", f"compared with {source}"))


# 4. The tiers row: recomputed from its command's printed table (the 5 % rows).
tiers = {}
for line in open(os.path.join(out_dir, "tiers.txt")):
    c = [x.strip() for x in line.strip().strip("|").split("|")]
    if len(c) >= 8 and c[1] == "5 %":
        tiers[c[0]] = (float(c[3]), float(c[5].split()[0]), float(c[6].split()[0]))
if set(tiers) != {"agentic", "chat", "longout"}:
    fail(f"the tiers command printed 5 % rows for {sorted(tiers)}, not agentic, chat, longout")
else:
    dev = [t[0] for t in tiers.values()]
    mar = [t[1] for t in tiers.values()]
    gap = [t[1] - t[2] for t in tiers.values()]
    vals = ["%.0f" % min(mar), "%.0f" % max(mar), "%.0f" % min(dev), "%.0f" % max(dev),
            "%.1f" % min(gap), "%.1f" % max(gap)]
    check_numbers("`marconi-sim tiers ",
                  [r"token hit rate (\d+)–(\d+) % vs (\d+)–(\d+) % with the GPU alone; "
                   r"(\d+\.\d)–(\d+\.\d) points above an LRU host tier"],
                  [vals], "the tiers command (its 5 % rows)")

# 5. Rows measured by the heavy steps: their figures files.
head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
not_checked = []


def code_unchanged_since(commit):
    """Whether HEAD differs from commit in documentation only (Markdown, docs/, this check)."""
    r = subprocess.run(["git", "diff", "--quiet", commit, "HEAD", "--", ".", ":(exclude)*.md",
                        ":(exclude)docs", ":(exclude)ci/readme_check.py", ":(exclude)ci/test.d/readme.sh"],
                       capture_output=True)
    return r.returncode == 0


def figures(name, row_key):
    path = os.path.join(figures_dir, name + ".json")
    step = f"ci/test.d/{name}.sh"
    if not os.path.exists(path):
        why = f"{path} missing: {step} did not run in this target dir"
    else:
        f = json.load(open(path))
        if ci_run and f.get("run") == ci_run:
            return f["figures"], f"{step} of this CI run"
        if not ci_run and f.get("commit") == head:
            return f["figures"], f"{step} run at {f.get('written')} on this commit"
        if not ci_run and f.get("commit") and code_unchanged_since(f["commit"]):
            return f["figures"], (f"{step} run at {f.get('written')} on {f['commit'][:12]} "
                                  "(only documentation or this check changed since)")
        why = (f"{path} comes from another run (run {f.get('run')!r}, commit {f.get('commit', '?')[:12]}, "
               f"{f.get('written')})")
    if ci_run:
        fail(f"row `{row_key}`: {why}, though {step} runs before this step in ci/test.sh")
    not_checked.append((f"examples table row of `{table_cmd(table_row(row_key))}`", why))
    return None, None


fig, src = figures("llama-engine", "bash ci/test.d/llama-engine.sh")
if fig:
    if fig["bitwise_equal"] != fig["requests"]:
        fail(f"llama-engine: {fig['bitwise_equal']} of {fig['requests']} requests bitwise equal")
    check_numbers("bash ci/test.d/llama-engine.sh",
                  [r"resumes (\d+) of (\d+) requests, (\d+) from the first one's states"],
                  [[str(fig["resumed"]), str(fig["requests"]), str(fig["from_other_process"])]], src)
fig, src = figures("llama-server", "side_by_side.py")
if fig:
    if fig["restart_pct"] != fig["redis_pct"]:
        fail(f"llama-server: restart resumes {fig['restart_pct']} %, Redis {fig['redis_pct']} %: "
             "the README quotes one figure for both")
    check_numbers("side_by_side.py",
                  [r"\((\d+) multi-turn requests", r"([\d,]+) prompt tokens processed vs ([\d,]+)",
                   r"resumes (\d+) % of the first one's hit tokens"],
                  [[str(fig["requests"])], ["{:,}".format(fig["prompt_n_marconi"]),
                                            "{:,}".format(fig["prompt_n_stock"])],
                   [str(fig["restart_pct"])]], src)
fig, src = figures("consumers", "bash ci/test.d/consumers.sh")
if fig:
    check_numbers("bash ci/test.d/consumers.sh",
                  [r"(\d+) of (\d+) \(worker, query\) scores over-reported vs (\d+)",
                   r"on (\d+) requests to both HTTP APIs \((\d+) documented differences\)"],
                  [[str(fig["over_router"]), str(fig["pairs"]), str(fig["over_dynamo"])],
                   [str(fig["api_alike"]), str(fig["api_differences"])]], src)

if bless:
    open("README.md", "w").write(readme)

# The list of the README's commands and where each is run or checked.
print("\nREADME commands and where CI runs or checks them:")
for what, where in json.load(open(os.path.join(out_dir, "commands.json"))):
    print(f"  {what}\n      {where}")
print("\nfigures compared:")
for what, how in checked:
    print(f"  {what}: {how}")
if not_checked:
    print("\nnot checked here (run the step first):")
    for what, why in not_checked:
        print(f"  {what}: {why}")
if failures:
    sys.exit(f"\n{len(failures)} failure(s) above: figures that differ from what their command printed "
             "(MARCONI_BLESS=1 rewrites them) or that could not be compared")
print("\nREADME: every figure compared equals what its command printed")
