#!/usr/bin/env bash
# The README's headline table, regenerated: runs the README's main command
# (`marconi-sim compare`, the built-in agentic workload, every policy) with
# --json, renders the table the README shows between its headline markers,
# and fails when they differ (MARCONI_BLESS=1 rewrites the README's table).
# The figures are deterministic (the speed columns are not shown). The same
# for the table of docs/routing.md (between its route markers) and the
# `marconi-sim route` command written above it. Also checks that every `cargo run ... marconi-sim -- CMD` line of the README
# names a command `marconi-sim --help` lists. Measured: 62 s of CPU, 4 min 55 s of
# wall time on 2 cores at load average 20 (the test run's release build is
# reused). Runs from the repository
# root.
set -euo pipefail
cd "$(dirname "$0")/../.."
out="$(mktemp -d "${TMPDIR:-/tmp}/marconi-readme.XXXXXX")"
trap 'rm -rf "$out"' EXIT
sim=(cargo run --release -q -p marconi-sim --features marconi-core/strict-checks --)

echo "--- marconi-sim compare --json (the README's headline command)"
"${sim[@]}" compare --quiet --out-dir "$out" --json >"$out/compare.json"

echo "--- marconi-sim route (docs/routing.md's command)"
route_cmd="$(sed -n 's/^cargo run --release -p marconi-sim -- route /route /p' docs/routing.md | head -n1)"
[ -n "$route_cmd" ] || { echo "docs/routing.md lost its route command" >&2; exit 1; }
# shellcheck disable=SC2086  # the documented arguments, split as a shell would
"${sim[@]}" $route_cmd -q --out-dir "$out" >"$out/route.txt"

"${sim[@]}" --help >"$out/help.txt"
python3 - "$out/compare.json" "$out/help.txt" "${MARCONI_BLESS:-0}" "$out/route.txt" <<'PY'
import json, re, sys
route = "\n".join(l for l in open(sys.argv[4]).read().split("\n")
                  if l and not l.startswith("Columns:") and " runs in " not in l)
doc = open("docs/routing.md").read()
m = re.search(r"(<!-- route:begin -->\n```text\n)(.*?)(\n```\n<!-- route:end -->)", doc, re.S)
assert m, "docs/routing.md lost its route markers"
if m.group(2) != route:
    if sys.argv[3] == "1":
        open("docs/routing.md", "w").write(doc[:m.start(2)] + route + doc[m.end(2):])
        print("docs/routing.md: route table rewritten")
    else:
        sys.exit("docs/routing.md's route table differs from the command's:\n--- doc\n%s\n--- now\n%s"
                 % (m.group(2), route))
reports = {r["policy"]: r for r in json.load(open(sys.argv[1]))}
labels = [
    ("marconi", "marconi (default)"), ("marconi-paper", "marconi-paper"),
    ("marconi-tuned", "marconi-tuned"), ("sglang-plus", "sglang-plus"),
    ("vllm-plus", "vllm-plus"), ("no-cache", "no-cache"),
    ("clairvoyant", "clairvoyant (knows the future)"), ("oracle", "oracle (unbounded)"),
]
rows = ["| policy | token hit | requests with a hit | FLOPs saved | evictions |",
        "|---|---:|---:|---:|---:|"]
for name, label in labels:
    r = reports[name]
    rows.append("| %s | %.2f %% | %.2f %% | %.2f %% | %d |" % (
        label, 100 * r["token_hit_rate"], 100 * r["request_hit_rate"],
        100 * r["flop_savings_rate"], r["evictions"]))
table = "\n".join(rows)
text = open("README.md").read()
m = re.search(r"(<!-- headline:begin[^>]*-->\n)(.*?)(<!-- headline:end -->)", text, re.S)
assert m, "README.md lost its headline markers"
if m.group(2).strip() != table:
    if sys.argv[3] == "1":
        open("README.md", "w").write(text[:m.start(2)] + table + "\n" + text[m.end(2):])
        print("README.md: headline table rewritten")
    else:
        sys.exit("README headline table differs from `marconi-sim compare`:\n--- README\n%s\n--- now\n%s"
                 % (m.group(2).strip(), table))
help_text = open(sys.argv[2]).read()
commands = set(re.findall(r"^  ([a-z][a-z-]*)\s", help_text, re.M))
for cmd in re.findall(r"marconi-sim --\s+([a-z][a-z-]*)", text):
    assert cmd in commands, f"README runs `marconi-sim {cmd}`, which --help does not list: {sorted(commands)}"
print("README: headline table equals `marconi-sim compare`; %d sim commands exist" %
      len(re.findall(r"marconi-sim --\s+[a-z]", text)))
PY
