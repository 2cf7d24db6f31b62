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
#   parameter and result fields, the registry and its flag);
# * python-shim/tests/test_sglang_lifecycle.py and test_sglang_real_pools.py:
#   SGLang imported and driven: its own Req life cycle, release_kv_cache,
#   retraction and strict idle pool check over its own CPU pools, in both
#   Mamba modes (no_buffer, extra_buffer), page sizes 1 and 16. SGLang runs
#   in a venv layered on ci/torch-engine-venv.sh's (torch, transformers: a
#   .pth file, nothing copied), with the sha256-checked wheel unzipped and
#   the pure-Python modules SGLang's imported code needs, pinned, installed
#   without their dependencies (~150 MB).
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
(cd python-shim/tests &&
  "$venv/bin/python" -m pytest -p no:cacheprovider -q -rs test_sglang.py test_sglang_interface.py test_sglang_plugin.py)

# SGLang importable: the wheel (checked above) over the torch venv.
SGLANG_PY_DEPS="aiohappyeyeballs==2.7.1 aiohttp==3.14.5 aiosignal==1.4.0 apache-tvm-ffi==0.1.11 attrs==26.1.0
certifi==2026.10.19.post1 compressed-tensors==0.20.1 dill==0.4.1 frozenlist==1.8.0 gguf==0.19.0 ipython==9.18.1
loguru==0.7.3 msgspec==0.22.0 multidict==7.2.1 openai==3.57.0 orjson==3.13.0 partial-json-parser==0.2.1.1.post7
pillow==13.0.0 propcache==0.5.4 psutil==7.2.2 pybase64==1.5.1 pyzmq==27.3.0 requests==2.34.2 sentencepiece==0.2.3
sniffio==1.3.1 starlette==1.10.0 torchvision==0.29.2 traitlets==5.16.1 urllib3==2.8.0 yarl==1.25.1"
. ci/torch-engine-venv.sh  # sets venv to the torch venv (absolute)
torch_venv="$venv"
real="$cache/real-venv"
stamp="$SGLANG_SHA256 $(echo $SGLANG_PY_DEPS) $torch_venv"
exec {real_lock}>"$cache/real-venv.lock"
flock "$real_lock"
if [ "$(cat "$real/stamp" 2>/dev/null)" != "$stamp" ]; then
  echo "--- $real: SGLang $SGLANG_VERSION over $torch_venv"
  start=$SECONDS
  rm -rf "$real"
  "$python" -m venv "$real"
  site="$("$real/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  torch_site="$("$torch_venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  "$real/bin/python" -m zipfile -e "$wheel" "$real/sglang-wheel"
  printf '%s\n' "$torch_site" > "$site/torch-engine-venv.pth"
  printf '%s\n' "$real/sglang-wheel" > "$site/sglang-wheel.pth"
  # shellcheck disable=SC2086  # one requirement per word
  "$real/bin/python" -m pip install --quiet --no-deps $SGLANG_PY_DEPS
  echo "$stamp" > "$real/stamp"
  echo "installed in $((SECONDS - start)) s"
fi
flock -u "$real_lock"
exec {real_lock}>&-

echo "--- pytest test_sglang_lifecycle.py test_sglang_real_pools.py (SGLang imported)"
set +e
(cd python-shim/tests && SGLANG_REAL=1 HF_HUB_OFFLINE=1 PYTHONWARNINGS=ignore \
  "$real/bin/python" -m pytest -p no:cacheprovider -q -rs test_sglang_lifecycle.py test_sglang_real_pools.py)
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: that is a failure here" >&2
  exit 1
fi
exit "$rc"
