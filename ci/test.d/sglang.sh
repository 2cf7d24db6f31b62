#!/usr/bin/env bash
# libmarconi as SGLang 0.5.23's tree cache (docs/sglang.md): downloads the
# pinned SGLang wheel from PyPI (no dependencies: it is read, not imported;
# cached under the target dir, checked against its sha256), then runs
#
# * python-shim/tests/test_sglang.py: SGLang's own unit-test expectations
#   for its Full + Mamba tree cache (ported; SGLang ships no tests in the
#   wheel) over stand-ins of SGLang's pools, and the scheduler's calls;
# * python-shim/tests/test_sglang_interface.py: the adapter against the
#   wheel's source (BasePrefixCache's methods and their arguments, the
#   parameter and result fields, the registry and its flag).
#
# SGLANG_WHEEL is set, so a missing wheel fails rather than skips. Runs from
# the repository root.
set -euo pipefail
cd "$(dirname "$0")/../.."

SGLANG_VERSION=0.5.23
SGLANG_SHA256=00b3cd5b265ac76c64185fbb6b95424f324ddd9f428d0306b77bc9db9d859937
WHEEL_NAME="sglang-$SGLANG_VERSION-cp311-cp311-manylinux_2_34_x86_64.whl"
target="${CARGO_TARGET_DIR:-target}"
python="${PYTHON:-python3.11}"
command -v "$python" >/dev/null || python=python3

echo "--- cargo build --release -p marconi-ffi"
cargo build --release -p marconi-ffi
lib="$(cd "$target/release" && pwd)/libmarconi.so"

cache="$target/sglang"
mkdir -p "$cache"
cache="$(cd "$cache" && pwd)"
venv="$cache/venv"
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
"$venv/bin/python" -c 'import pytest' 2>/dev/null || "$venv/bin/python" -m pip install --quiet pytest

wheel="$cache/$WHEEL_NAME"
if ! echo "$SGLANG_SHA256  $wheel" | sha256sum -c --status 2>/dev/null; then
  echo "--- pip download sglang==$SGLANG_VERSION --no-deps"
  rm -f "$wheel"
  # The wheel's tags, not this machine's: it is only read.
  "$venv/bin/python" -m pip download --quiet --no-deps --only-binary=:all: \
    --platform manylinux_2_34_x86_64 --python-version 3.11 --implementation cp --abi cp311 \
    -d "$cache" "sglang==$SGLANG_VERSION"
  echo "$SGLANG_SHA256  $wheel" | sha256sum -c
fi

# The package itself, installed as a user would (`pip install ./python-shim`
# builds marconi-ffi and bundles libmarconi; cargo reuses the target dir):
# its entry point is what makes SGLang's plugin loader register the cache.
echo "--- $venv: pip install ./python-shim"
"$venv/bin/python" -m pip install --quiet ./python-shim
rm -rf python-shim/build python-shim/*.egg-info

echo "--- pytest test_sglang.py test_sglang_interface.py test_sglang_plugin.py"
export MARCONI_LIBRARY="$lib"
export PYTHONPATH="$PWD/python-shim${PYTHONPATH:+:$PYTHONPATH}"
export SGLANG_WHEEL="$wheel"
cd python-shim/tests
"$venv/bin/python" -m pytest -p no:cacheprovider -q -rs test_sglang.py test_sglang_interface.py test_sglang_plugin.py
