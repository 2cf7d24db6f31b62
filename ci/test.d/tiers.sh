#!/usr/bin/env bash
# The tiers smoke: `marconi-sim replay --tiers` on a small built-in chat
# trace with a device, a host and a store, `--json`: fails unless the
# per-tier hit rates add up to token_hit_rate, the host served hits, every
# tier stayed within its capacity, and the tiers beat the device alone;
# then `marconi-sim tiers --quick` (one seed) must print its table. Budget:
# under 2 minutes on 2 cores (the release build of the test run is
# reused). The full measurement: docs/tiers.md. The core's tier tests run
# with the workspace's `cargo test`.
# Runs from the repository root.
set -euo pipefail
cd "$(dirname "$0")/../.."
out="$(mktemp -d "${TMPDIR:-/tmp}/marconi-tiers.XXXXXX")"
trap 'rm -rf "$out"' EXIT
# The test run's own marconi-sim (ci/built.sh): `cargo run -p marconi-sim`
# resolves its features alone and would compile a second build.
sim=("$(bash ci/built.sh bin marconi-sim)")
"${sim[@]}" trace synth --kind chat --sessions 120 --seed 9 --out "$out/chat.jsonl" > /dev/null
"${sim[@]}" replay --trace "$out/chat.jsonl" --policy marconi --capacity 300MB --json -q > "$out/one.json"
"${sim[@]}" replay --trace "$out/chat.jsonl" --policy marconi \
  --tiers device:300MB,host:2400MB,store:6GB --json -q > "$out/tiers.json"
python3 - "$out/one.json" "$out/tiers.json" <<'PY'
import json, sys
one = json.load(open(sys.argv[1]))
r = json.load(open(sys.argv[2]))
t = r["tiers"]
assert abs(sum(t["token_hit_rate_by_tier"]) - r["token_hit_rate"]) < 1e-9, r
assert t["hits_by_tier"][1] > 0 and t["bytes_loaded"][1] > 0 and t["bytes_written"][1] > 0, t
for used, cap in zip(t["used_bytes"], t["capacity_bytes"]):
    assert used <= cap, t
assert r["token_hit_rate"] > one["token_hit_rate"], (r["token_hit_rate"], one["token_hit_rate"])
print("tiers: token hit rate %.2f%% (device %.2f%%, host %.2f%%, store %.2f%%) vs %.2f%% on the device alone"
      % tuple(100 * x for x in [r["token_hit_rate"], *t["token_hit_rate_by_tier"], one["token_hit_rate"]]))
PY
"${sim[@]}" tiers --quick --seeds 0 --workloads chat,longout > "$out/table.md"
grep -q '^| chat | 5 % | 1 |' "$out/table.md" || { cat "$out/table.md" >&2; echo "tiers: table missing" >&2; exit 1; }
