#!/usr/bin/env bash
# The PyTorch engine (examples/torch-engine): a tiny random-weight NemotronH
# from transformers served through `import marconi`; every request of a chat
# workload with evictions is compared with a no-cache run, the negative
# controls (zeroed SSM state, zeroed conv state) must fail that comparison,
# and the byte sizes read from each hybrid family's config.json must equal
# the tensors its cache holds; the tiered engine (tiered.py: a cache with a
# host and a store tier, a second engine resuming from the first's store,
# corrupted objects counted as misses), about 15 s.
#
# The venv (pinned torch and transformers from PyPI, under the cargo target
# dir) is ci/torch-engine-venv.sh's.
# Runs from the repository root.
set -euo pipefail
cd "$(dirname "$0")/../.."

target="${CARGO_TARGET_DIR:-target}"
python="${PYTHON:-python3.11}"
command -v "$python" >/dev/null || python=python3

echo "--- cargo build --release -p marconi-ffi"
cargo build --release -p marconi-ffi
lib="$(cd "$target/release" && pwd)/libmarconi.so"

. ci/torch-engine-venv.sh

export MARCONI_LIBRARY="$lib"
export PYTHONPATH="$PWD/python-shim${PYTHONPATH:+:$PYTHONPATH}"
export TRANSFORMERS_VERBOSITY=error

echo "--- examples/torch-engine/engine.py (the workload, checked against no cache)"
"$venv/bin/python" examples/torch-engine/engine.py

echo "--- pytest examples/torch-engine/test_engine.py test_tiered.py (test_pml_engine.py is pml-engine.sh's)"
set +e
(cd examples/torch-engine && "$venv/bin/python" -m pytest -p no:cacheprovider -q test_engine.py test_tiered.py)
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: that is a failure here" >&2
  exit 1
fi
exit "$rc"
