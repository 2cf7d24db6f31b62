# Sourced by ci/test.d/torch-engine.sh and ci/test.d/pml-engine.sh (from the
# repository root, with `target` and `python` set): makes sure the venv with
# the pinned torch and transformers exists and sets `venv` to its absolute
# path. ci/test.sh starts torch-engine.sh in the background, so the two may
# run at once: the check and the install hold a lock, and the second one
# waits for the first's install instead of deleting it.
#
# Installs torch and transformers (pinned: the engines use transformers 5's
# cache API) from PyPI into a venv under the cargo target dir, reused while
# it imports the pinned versions. PyPI's Linux torch wheel pulls ~3 GB of
# CUDA libraries that it needs even to import on CPU (`--no-deps` fails:
# libcudart and libcublasLt are loaded at import), so the install is made
# fast rather than small: uv (itself a PyPI wheel, installed with pip)
# downloads and unpacks in parallel. Measured on this 2-core machine while
# other builds ran: pip 4 min 32 s (quiet) to 9 min 1 s (loaded), uv 2 min 0 s
# (loaded) plus 12 s to install uv; 5.3 GB either way.

TORCH_VERSION=2.15.0
TRANSFORMERS_VERSION=5.23.0
venv="${TORCH_ENGINE_VENV:-$target/torch-engine-venv}"
case "$venv" in /*) ;; *) venv="$PWD/$venv" ;; esac  # pytest runs from examples/torch-engine
mkdir -p "$target"
exec {venv_lock}>"$target/torch-engine-venv.lock"
flock "$venv_lock"
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
flock -u "$venv_lock"
exec {venv_lock}>&-
