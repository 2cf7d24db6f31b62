#!/usr/bin/env bash
# The multi-engine routing smoke: `marconi-sim route` on a
# small built-in chat trace (4 engines, evictions), every routing at two
# load weights; fails unless the router's index, fed by the engines'
# events, agreed with every routed engine's own lookup (idx miss = 0) and
# the figures were written. Budget: 2 minutes on 2 cores (the release build
# of the test run is reused). The full experiment: docs/routing.md.
# The index's own tests (loopback ZeroMQ included) run with the
# workspace's `cargo test`, marconi-router/tests/serve.rs among them (the
# HTTP server in process: a bounded load with stalled clients on
# 127.0.0.1); here they run again against the release binary
# `marconi-router serve` as a process (about 20 s).
# Runs from the repository root.
set -euo pipefail
cd "$(dirname "$0")/../.."
out="$(mktemp -d "${TMPDIR:-/tmp}/marconi-route.XXXXXX")"
trap 'rm -rf "$out"' EXIT
"$(bash ci/built.sh bin marconi-sim)" \
  route --workload chat --sessions 300 --session-rate 8 --engines 4 --capacity 500MB \
  --lambda 0,1 --threads 2 --out-dir "$out" --json > "$out/route.json"
python3 - "$out/route.json" <<'PY'
import json, sys
runs = json.load(open(sys.argv[1]))
assert len(runs) == 5, f"{len(runs)} runs, expected 5"
for r in runs:
    assert r["index_mismatches"] == 0, r
    assert r["requests"] == sum(r["requests_per_engine"]) > 0, r
    assert r["evictions"] > 0, r
print("route: %d runs, index exact; hit rates %s" % (
    len(runs), ", ".join("%s/%g %.1f%%" % (r["routing"], r["lambda"], 100 * r["token_hit_rate"]) for r in runs)))
PY
for f in route_hit_rate.svg route_ttft_mean.svg route_ttft_p95.svg route_busy_imbalance.svg; do
  test -s "$out/$f" || { echo "route: $f missing" >&2; exit 1; }
done

echo "--- marconi-router serve as a process: tests/serve.rs against the binary"
MARCONI_ROUTER_TEST_BIN="$(bash ci/built.sh bin marconi-router)" \
  "$(bash ci/built.sh test serve marconi-router)" --quiet
