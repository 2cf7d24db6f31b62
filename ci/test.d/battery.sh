#!/usr/bin/env bash
# The battery smoke: every policy and the clairvoyant
# reference on small synthetic traces (2 seeds per workload) and, when the
# ShareGPT data can be had (pip, network), 3 small samples of it, at 3
# capacities; the battery says so and runs the synthetic rows when it
# cannot. Then the per-cell check over 80 seeds (README, "Per cell, over
# many seeds"): marconi within 0.2 points of the reference that does better
# on average, on every workload at every capacity. Budget: 4 minutes on 2
# cores. The full battery is `marconi-sim battery` (README, "Battery").
# Runs from the repository root.
set -euo pipefail
cd "$(dirname "$0")/../.."
out="$(mktemp -d "${TMPDIR:-/tmp}/marconi-battery.XXXXXX")"
trap 'rm -rf "$out"' EXIT
# The same features as the test run: its release build is reused.
cargo run --release -q -p marconi-sim --features marconi-core/strict-checks -- \
  battery --quick --quiet --out-dir "$out"
for f in battery.md battery.csv battery.json battery.svg; do
  test -s "$out/$f" || { echo "battery: $f missing" >&2; exit 1; }
done
cargo run --release -q -p marconi-sim --features marconi-core/strict-checks -- \
  battery --quiet --seeds 0..80 --sharegpt-seeds 0..80 --check-cells --out-dir "$out" \
  | grep -E '^([0-9]+ cells|note:)' || { echo "battery: marconi loses on a cell (seeds 0..80)" >&2; exit 1; }
