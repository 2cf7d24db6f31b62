#!/usr/bin/env bash
# Python shim tests, run as a user would: a fresh virtual environment (.venv),
# `pip install pytest numpy ./python-shim` with no MARCONI_LIBRARY (pip builds
# marconi-ffi and bundles libmarconi into the package), then the pytest suite
# against the installed package. The Rust replay example, which the replay
# test compares with, is built by cargo beforehand. Runs from the repository
# root.
set -euo pipefail
cd "$(dirname "$0")/../.."

target="${CARGO_TARGET_DIR:-target}"
python="${PYTHON:-python3.11}"
command -v "$python" >/dev/null || python=python3

echo "--- cargo build --release -p marconi-ffi --example replay_stats"
cargo build --release -p marconi-ffi --example replay_stats
replay="$(cd "$target/release/examples" && pwd)/replay_stats"
test -x "$replay"

venv="${MARCONI_VENV:-.venv}"
echo "--- $venv: pip install pytest numpy ./python-shim (builds and bundles libmarconi)"
rm -rf "$venv" python-shim/build python-shim/*.egg-info  # no stale setuptools build dir
"$python" -m venv "$venv"
venv="$(cd "$venv" && pwd)"
"$venv/bin/python" -m pip install --quiet --upgrade pip
# No MARCONI_LIBRARY: the installed package must find its own library. pip
# builds in place, so cargo reuses the target dir ($CARGO_TARGET_DIR, passed
# through, or the workspace's target/); only marconi-ffi's crates built
# without dev-dependencies are compiled again (about 30 s on 2 cores).
# numpy is one wheel; its tests skip without it. torch is not installed (GBs):
# its tests skip here.
unset MARCONI_LIBRARY
"$venv/bin/python" -m pip install --quiet pytest numpy ./python-shim
rm -rf python-shim/build python-shim/*.egg-info

echo "--- pytest python-shim/tests (installed package, bundled library)"
export MARCONI_REPLAY_STATS="$replay"
# Run from outside python-shim/ so that `import marconi` is the installed package.
set +e
(cd python-shim/tests && "$venv/bin/python" -m pytest -p no:cacheprovider -q -rs .)
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: that is a failure here" >&2
  exit 1
fi
exit "$rc"
