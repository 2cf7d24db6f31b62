#!/usr/bin/env bash
# The store tier (docs/store.md) against a real Redis: installs Debian's
# redis-server when it is missing (apt-get, quietly), then runs
# marconi-store's tests (directory, callback and Redis fault tests; each
# Redis test starts its own server on 127.0.0.1 with a random free port and
# stops it) and the Python tests of the store ABI. MARCONI_STORE_STRICT=1
# turns the "no redis-server" skip into a failure. Runs from the repository
# root; about a minute once ci/test.sh's workspace build is done.
set -euo pipefail
cd "$(dirname "$0")/../.."

target="${CARGO_TARGET_DIR:-target}"
python="${PYTHON:-python3.11}"
command -v "$python" >/dev/null || python=python3
export MARCONI_STORE_STRICT=1

if ! command -v redis-server >/dev/null && ! command -v valkey-server >/dev/null; then
  echo "--- apt-get install redis-server"
  sudo=""
  [ "$(id -u)" = 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends redis-server >/dev/null
fi
# The test starts its own servers; a packaged service is not used.
"$(command -v redis-server || command -v valkey-server)" --version

echo "--- marconi-store's tests (strict: a missing server fails)"
# The test run's own test binaries (ci/built.sh): `cargo test -p
# marconi-store` resolves its features alone and compiles a second build
# (its dev-dependencies included). Each binary runs from the crate's directory,
# as cargo runs it.
while read -r t; do
  (cd marconi-store && "$t" --quiet)
done < <(bash ci/built.sh tests marconi-store)

echo "--- cargo build --release -p marconi-ffi"
cargo build --release -p marconi-ffi

venv="${MARCONI_STORE_VENV:-$target/store-venv}"
echo "--- $venv: pip install pytest"
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
venv="$(cd "$venv" && pwd)"
"$venv/bin/python" -m pip install --quiet pytest

echo "--- pytest test_store.py test_signatures.py"
repo="$(pwd)"
lib="$(cd "$target/release" && pwd)/libmarconi.so"
(cd python-shim/tests && MARCONI_LIBRARY="$lib" PYTHONPATH="$repo/python-shim" \
  "$venv/bin/python" -m pytest -p no:cacheprovider -q -rs test_store.py test_signatures.py)
