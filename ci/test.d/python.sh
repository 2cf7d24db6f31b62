#!/usr/bin/env bash
# Python shim tests: builds libmarconi and the Rust replay example, installs
# python-shim into a fresh virtual environment (.venv) with pytest, and runs
# the suite against the installed package. Runs from the repository root.
set -euo pipefail
cd "$(dirname "$0")/../.."

target="${CARGO_TARGET_DIR:-target}"
python="${PYTHON:-python3.11}"
command -v "$python" >/dev/null || python=python3

echo "--- cargo build --release -p marconi-ffi (library + replay_stats example)"
cargo build --release -p marconi-ffi --lib --example replay_stats
lib="$(cd "$target/release" && pwd)"
test -f "$lib/libmarconi.so"

venv="${MARCONI_VENV:-.venv}"
echo "--- $venv: pip install pytest ./python-shim"
rm -rf "$venv" python-shim/build python-shim/*.egg-info  # no stale setuptools build dir
"$python" -m venv "$venv"
venv="$(cd "$venv" && pwd)"
"$venv/bin/python" -m pip install --quiet --upgrade pip
"$venv/bin/python" -m pip install --quiet pytest ./python-shim

echo "--- pytest python-shim/tests"
export MARCONI_LIBRARY="$lib/libmarconi.so"
export MARCONI_REPLAY_STATS="$lib/examples/replay_stats"
# Run from outside python-shim/ so that `import marconi` is the installed package.
set +e
(cd python-shim/tests && "$venv/bin/python" -m pytest -p no:cacheprovider -q .)
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: that is a failure here" >&2
  exit 1
fi
exit "$rc"
