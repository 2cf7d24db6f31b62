#!/usr/bin/env bash
# The README's headline table, regenerated: runs the README's main command
# (`marconi-sim compare`, the built-in agentic workload, every policy) with
# --json, renders the table the README shows between its headline markers,
# and fails when they differ (MARCONI_BLESS=1 rewrites the README's table).
# The figures are deterministic (the speed columns are not shown). Also
# checks that every `cargo run ... marconi-sim -- CMD` line of the README
# names a command `marconi-sim --help` lists. Budget: about 1 minute on 2
# cores (the test run's release build is reused). Runs from the repository
# root.
set -euo pipefail
cd "$(dirname "$0")/../.."
out="$(mktemp -d "${TMPDIR:-/tmp}/marconi-readme.XXXXXX")"
trap 'rm -rf "$out"' EXIT
sim=(cargo run --release -q -p marconi-sim --features marconi-core/strict-checks --)

echo "--- marconi-sim compare --json (the README's headline command)"
"${sim[@]}" compare --quiet --out-dir "$out" --json >"$out/compare.json"

"${sim[@]}" --help >"$out/help.txt"
python3 - "$out/compare.json" "$out/help.txt" "${MARCONI_BLESS:-0}" <<'PY'
import json, re, sys
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
