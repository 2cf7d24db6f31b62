#!/usr/bin/env bash
# The PyTorch engine (examples/torch-engine): a tiny random-weight NemotronH
# from transformers served through `import marconi`; every request of a chat
# workload with evictions is compared with a no-cache run, the negative
# controls (zeroed SSM state, zeroed conv state) must fail that comparison,
# and the byte sizes read from each hybrid family's config.json must equal
# the tensors its cache holds.
#
# Installs torch and transformers (pinned: the engine uses transformers 5's
# cache API) from PyPI into a venv under the cargo target dir, reused while
# it imports the pinned versions. PyPI's Linux torch wheel pulls ~3 GB of
# CUDA libraries that it needs even to import on CPU (`--no-deps` fails:
# libcudart and libcublasLt are loaded at import), so the install is made
# fast rather than small: uv (itself a PyPI wheel, installed with pip)
# downloads and unpacks in parallel. Measured on this 2-core machine while
# other builds ran: pip 4 min 32 s (quiet) to 9 min 1 s (loaded), uv 2 min 0 s
# (loaded) plus 12 s to install uv; 5.3 GB either way.
# Runs from the repository root.
set -euo pipefail
cd "$(dirname "$0")/../.."

TORCH_VERSION=2.15.0
TRANSFORMERS_VERSION=5.23.0
target="${CARGO_TARGET_DIR:-target}"
python="${PYTHON:-python3.11}"
command -v "$python" >/dev/null || python=python3

echo "--- cargo build --release -p marconi-ffi"
cargo build --release -p marconi-ffi
lib="$(cd "$target/release" && pwd)/libmarconi.so"

venv="${TORCH_ENGINE_VENV:-$target/torch-engine-venv}"
case "$venv" in /*) ;; *) venv="$PWD/$venv" ;; esac  # pytest runs from examples/torch-engine
want="$TORCH_VERSION $TRANSFORMERS_VERSION"
have="$("$venv/bin/python" -c 'import torch, transformers; print(torch.__version__.split("+")[0], transformers.__version__)' 2>/dev/null || true)"
if [ "$have" != "$want" ]; then
  echo "--- $venv: uv pip install torch==$TORCH_VERSION transformers==$TRANSFORMERS_VERSION pytest"
  start=$SECONDS
  rm -rf "$venv"
  tools="$target/torch-engine-uv"
  [ -x "$tools/bin/uv" ] || { "$python" -m venv "$tools" && "$tools/bin/python" -m pip install --quiet uv; }
  # The machine's Python (uv must not fetch one: only PyPI is reachable).
  UV_PYTHON_DOWNLOADS=never "$tools/bin/uv" venv --quiet --python "$(command -v "$python")" "$venv"
  # The system CA bundle, as pip is configured here (uv's own roots otherwise).
  VIRTUAL_ENV="$(cd "$venv" && pwd)" "$tools/bin/uv" pip install --quiet --native-tls \
    "torch==$TORCH_VERSION" "transformers==$TRANSFORMERS_VERSION" pytest
  echo "installed in $((SECONDS - start)) s"
else
  echo "--- $venv: torch $TORCH_VERSION and transformers $TRANSFORMERS_VERSION already installed"
fi

export MARCONI_LIBRARY="$lib"
export PYTHONPATH="$PWD/python-shim${PYTHONPATH:+:$PYTHONPATH}"
export TRANSFORMERS_VERBOSITY=error

echo "--- examples/torch-engine/engine.py (the workload, checked against no cache)"
"$venv/bin/python" examples/torch-engine/engine.py

echo "--- pytest examples/torch-engine"
set +e
(cd examples/torch-engine && "$venv/bin/python" -m pytest -p no:cacheprovider -q .)
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: that is a failure here" >&2
  exit 1
fi
exit "$rc"
