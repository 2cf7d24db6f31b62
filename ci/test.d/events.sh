#!/usr/bin/env bash
# Cache events (docs/events.md): builds libmarconi (its default build has
# the ZeroMQ publisher, pure Rust), runs the C test of the events ABI under
# ASan/UBSan, then the Python tests in their own venv (pytest, msgspec,
# pyzmq, cbor2 from PyPI): a subscriber written from vLLM's schema decodes
# the stream, recomputes every block hash with vLLM's sha256_cbor and
# rebuilds the cached set, over loopback ZeroMQ with gaps repaired by
# replay. MARCONI_EVENTS_STRICT=1 turns any skip into a failure. The real
# consumers (vLLM's own classes, Dynamo's indexer): ci/test.d/consumers.sh.
# Runs from the repository root.
set -euo pipefail
cd "$(dirname "$0")/../.."

target="${CARGO_TARGET_DIR:-target}"
python="${PYTHON:-python3.11}"
command -v "$python" >/dev/null || python=python3
work="$(mktemp -d "${TMPDIR:-/tmp}/marconi-events.XXXXXX")"
trap 'rm -rf "$work"' EXIT

echo "--- cargo build --release -p marconi-ffi"
cargo build --release -p marconi-ffi
cp "$target/release/libmarconi.so" "$work/libmarconi.so"
# Programs linked against it record its SONAME: give it that name too.
soname="$(readelf -d "$work/libmarconi.so" | sed -n 's/.*(SONAME).*\[\(.*\)\]$/\1/p')"
[ -z "$soname" ] || ln -sfn libmarconi.so "$work/$soname"

echo "--- C test of the events ABI (ASan + UBSan)"
gcc -std=c11 -Wall -Wextra -Wpedantic -Werror -g -O1 -Iinclude \
  -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=all \
  marconi-ffi/tests/c/test_events.c -L"$work" -Wl,-rpath,"$work" -lmarconi -lm \
  -o "$work/test_events"
ASAN_OPTIONS="detect_leaks=1:abort_on_error=1" "$work/test_events"

venv="${MARCONI_EVENTS_VENV:-$target/events-venv}"
echo "--- $venv: pip install pytest msgspec pyzmq cbor2"
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
venv="$(cd "$venv" && pwd)"  # absolute: pytest runs from python-shim/tests
"$venv/bin/python" -m pip install --quiet pytest msgspec pyzmq cbor2

echo "--- pytest test_events*.py (publisher library, vLLM-schema subscriber)"
repo="$(pwd)"
(cd python-shim/tests && MARCONI_LIBRARY="$work/libmarconi.so" MARCONI_EVENTS_STRICT=1 \
  PYTHONPATH="$repo/python-shim" "$venv/bin/python" -m pytest -p no:cacheprovider -q -rs \
  test_events.py test_events_zmq.py test_signatures.py)
