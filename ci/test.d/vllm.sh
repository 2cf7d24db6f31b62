#!/usr/bin/env bash
# libmarconi inside vLLM 0.33.0 (docs/vllm.md): marconi.vllm's
# MarconiCachePolicy selected by kv_connector_extra_config, driven through
# vLLM's own Scheduler, hybrid KVCacheManager (one full-attention group, one
# Mamba group, align mode, sha256_cbor) and OffloadingConnector with its CPU
# tier, on CPU with a fake model runner (python-shim/tests/vllm_engine.py):
# python-shim/tests/test_vllm.py; with TieringOffloadingSpec, MarconiStoreTier
# below the CPU tier over a directory, a Redis nobody listens on and a
# redis-server started by the test on 127.0.0.1 (installed here when missing).
#
# The venv (ci/vllm-venv.sh) overlays the pinned vLLM wheel (version and
# sha256) on the torch engine's venv, under the target dir, behind a lock.
# MARCONI_VLLM_STRICT=1: a missing piece fails instead of skipping. Runs
# from the repository root.
set -euo pipefail
cd "$(dirname "$0")/../.."

target="${CARGO_TARGET_DIR:-target}"
python="${PYTHON:-python3.11}"
command -v "$python" >/dev/null || python=python3
start=$SECONDS

echo "--- cargo build --release -p marconi-ffi"
cargo build --release -p marconi-ffi
lib="$(cd "$target/release" && pwd)/libmarconi.so"

if ! command -v redis-server >/dev/null && ! command -v valkey-server >/dev/null; then
  echo "--- apt-get install redis-server"
  sudo=""
  [ "$(id -u)" = 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends redis-server >/dev/null
fi

source ci/vllm-venv.sh  # sets vllm_venv
echo "--- venv ready after $((SECONDS - start)) s"

echo "--- pytest test_vllm.py (vLLM's Scheduler + OffloadingConnector, CPU)"
repo="$(pwd)"
mkdir -p "$target/vllm/cache"
cache_root="$(cd "$target/vllm/cache" && pwd)"
# VLLM_TARGET_DEVICE=cpu: vLLM's CPU platform (no GPU is needed by the
# scheduler side). VLLM_CACHE_ROOT: vLLM's model-info cache stays under the
# target dir.
(cd python-shim/tests && MARCONI_LIBRARY="$lib" MARCONI_VLLM_STRICT=1 VLLM_TARGET_DEVICE=cpu \
  VLLM_CACHE_ROOT="$cache_root" PYTHONPATH="$repo/python-shim" \
  "$vllm_venv/bin/python" -m pytest -p no:cacheprovider -q -rs test_vllm.py)
echo "--- vllm.sh done in $((SECONDS - start)) s"
