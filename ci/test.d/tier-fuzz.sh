#!/usr/bin/env bash
# The tiered cache driven as an engine drives it, through the C ABI: the ABI
# fuzzer's tiered lives only (ops replayed in order, the engine's copies
# checked against each tier's claims byte for byte after every request, two
# engines sharing a directory store across namespaces, deferred moves).
# fuzz_abi is already built by ci/test.sh's fuzz smoke with these features,
# so this is the run alone: 20 s, bounded by time. docs/fuzzing.md has the
# long campaign. Runs from the repository root.
set -euo pipefail
cd "$(dirname "$0")/../.."

echo "--- fuzz_abi --only-tiered (20 s)"
"$(bash ci/built.sh example fuzz_abi)" \
  --only-tiered --seed 1 --calls 8 --seconds 20
