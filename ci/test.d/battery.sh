#!/usr/bin/env bash
# The battery gate: every policy and the clairvoyant reference on the
# battery's traces over 40 seeds (synthetic workloads, and ShareGPT samples
# when the data can be had: pip, network; the battery says so and runs the
# synthetic rows when it cannot), at 3 capacities, and the per-cell check
# (docs/results.md, "Per cell, over many seeds"): marconi within 0.2 points of the reference that does better
# on average, on every workload at every capacity. 40 seeds a cell: 107 s
# on a 2-core machine (80 seeds took 3 min; the worst cell, chat at 5 %, is
# -0.12 ± 0.16 points at 40 seeds, inside the gate). The 80-seed gate is
# `marconi-sim battery --seeds 0..80 --sharegpt-seeds 0..80 --check-cells`,
# the full battery `marconi-sim battery` (docs/results.md, "Battery").
# Runs from the repository root.
set -euo pipefail
cd "$(dirname "$0")/../.."
out="$(mktemp -d "${TMPDIR:-/tmp}/marconi-battery.XXXXXX")"
trap 'rm -rf "$out"' EXIT
# The test run's own marconi-sim (ci/built.sh): its build is reused. One run
# (the --quick battery it used to start with added no check this one lacks):
# the per-cell gate, then its files.
"$(bash ci/built.sh bin marconi-sim)" \
  battery --quiet --seeds 0..40 --sharegpt-seeds 0..40 --check-cells --out-dir "$out" \
  | grep -E '^([0-9]+ cells|note:)' || { echo "battery: marconi loses on a cell (seeds 0..40)" >&2; exit 1; }
for f in battery.md battery.csv battery.json battery.svg; do
  test -s "$out/$f" || { echo "battery: $f missing" >&2; exit 1; }
done
