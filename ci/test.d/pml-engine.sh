#!/usr/bin/env bash
# Prompt modules in the PyTorch engine (examples/torch-engine/pml_engine.py):
# PML layouts and the module store from libmarconi (`marconi.pml`), module KV
# reused at schema positions on a Llama, the hybrid exact mode checked against
# a full prefill within 1e-5 (also under a budget that evicts), evicted
# modules encoded again, Mamba-2 state composition exact on one layer with
# fixed inputs, and the table at smoke size (models trained for seconds on
# /usr/share/common-licenses, cached under the target dir). The full table
# is `python examples/torch-engine/pml_engine.py --table` (docs/prompt-modules.md).
# Shares the torch venv with torch-engine.sh (ci/torch-engine-venv.sh).
# Runs from the repository root.
set -euo pipefail
cd "$(dirname "$0")/../.."

target="${CARGO_TARGET_DIR:-target}"
python="${PYTHON:-python3.11}"
command -v "$python" >/dev/null || python=python3
[ -d /usr/share/common-licenses ] || { echo "/usr/share/common-licenses missing (Debian's base-files)" >&2; exit 1; }

echo "--- cargo build --release -p marconi-ffi"
cargo build --release -p marconi-ffi
lib="$(cd "$target/release" && pwd)/libmarconi.so"

. ci/torch-engine-venv.sh

export MARCONI_LIBRARY="$lib"
export PYTHONPATH="$PWD/python-shim${PYTHONPATH:+:$PYTHONPATH}"
export TRANSFORMERS_VERBOSITY=error

echo "--- pytest examples/torch-engine/test_pml_engine.py"
start=$SECONDS
set +e
(cd examples/torch-engine && "$venv/bin/python" -m pytest -p no:cacheprovider -q test_pml_engine.py)
rc=$?
set -e
echo "pytest took $((SECONDS - start)) s"
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: that is a failure here" >&2
  exit 1
fi
exit "$rc"
