#!/usr/bin/env bash
# Every CUDA test and benchmark of libmarconi, for a machine with an NVIDIA GPU
# (docs/testing.md, "On a GPU"). CI has no GPU: there these paths compile
# (ci/test.sh's cuda step) and their tests skip; this script is what runs them.
#
#   scripts/gpu-check.sh              build here, then run here (cargo + GPU)
#   scripts/gpu-check.sh build DIR    build the test programs into DIR (needs
#                                     cargo and gcc, no GPU): for a GPU machine
#                                     without a Rust toolchain
#   scripts/gpu-check.sh run DIR      run what `build` put in DIR (needs the
#                                     NVIDIA driver; NVRTC optional)
#
# What runs, each with MARCONI_REQUIRE_GPU=1 (a missing GPU fails instead of
# skipping):
#   * marconi-gpu's tests built with `--features cuda`, ignored ones included:
#     CUDA virtual memory (cuMemCreate/cuMemMap, remaps keep bytes), the
#     physical backend against the trait contract, the snapshot kernel against
#     the host byte for byte, NVRTC compiling the kernel source, the host pool
#     page-locked with cuMemHostRegister; and every other marconi-gpu test;
#   * marconi-ffi/tests/c/test_cuda.c against libmarconi built with
#     `--features cuda`: pools of backend CUDA through the C ABI (units keep
#     their bytes, AVMP migration remaps, snapshot copy/fork/promote on the
#     device, threads, and the cache over CUDA pools through the request cycle);
#   * the snapshot benchmark's GPU part (copy kernel vs cuMemcpy).
#
# The build goes to its own target dir ($target/gpu) so that the default
# libmarconi.so of target/release is left as it is.
set -euo pipefail
cd "$(dirname "$0")/.."

target="${CARGO_TARGET_DIR:-target}"

build() {
  local dir="$1"
  mkdir -p "$dir/bin" "$dir/lib"
  local gpu_target="$target/gpu"
  export CARGO_PROFILE_RELEASE_OVERFLOW_CHECKS=true
  echo "--- cargo test -p marconi-gpu --features cuda --no-run (target dir $gpu_target)"
  cargo test -p marconi-gpu --release --features cuda --target-dir "$gpu_target" --no-run \
    --message-format=json-render-diagnostics |
    python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        print(m["target"]["name"], m["executable"])
' >"$dir/tests.txt"
  echo "--- cargo bench -p marconi-gpu --features cuda --bench snapshot --no-run"
  cargo bench -p marconi-gpu --features cuda --target-dir "$gpu_target" --bench snapshot --no-run \
    --message-format=json-render-diagnostics |
    python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable"):
        print(m["target"]["name"], m["executable"])
' >"$dir/benches.txt"
  local name exe
  while read -r name exe; do
    cp "$exe" "$dir/bin/test-$name"
  done <"$dir/tests.txt"
  while read -r name exe; do
    cp "$exe" "$dir/bin/bench-$name"
  done <"$dir/benches.txt"
  echo "--- cargo build -p marconi-ffi --features cuda (libmarconi.so with the CUDA backend)"
  cargo build --release -p marconi-ffi --features cuda --target-dir "$gpu_target"
  cp "$gpu_target/release/libmarconi.so" "$dir/lib/"
  # Programs linked here record the SONAME (a copy, not a link: the folder
  # may travel to another machine without its links).
  local soname
  soname="$(readelf -d "$dir/lib/libmarconi.so" | sed -n 's/.*(SONAME).*\[\(.*\)\]$/\1/p')"
  [ -z "$soname" ] || cp "$dir/lib/libmarconi.so" "$dir/lib/$soname"
  echo "--- gcc marconi-ffi/tests/c/test_cuda.c"
  gcc -std=c11 -Wall -Wextra -Werror -O1 -g -Iinclude marconi-ffi/tests/c/test_cuda.c \
    -L"$dir/lib" -Wl,-rpath,'$ORIGIN/../lib' -lmarconi -lpthread -ldl -o "$dir/bin/c-test_cuda"
  strip --strip-debug "$dir"/bin/* "$dir"/lib/*
  rm -f "$dir/tests.txt" "$dir/benches.txt"
  du -sh "$dir"
}

run() {
  local dir="$1" failed=0 t
  export MARCONI_REQUIRE_GPU=1
  # NVRTC may sit beside the toolkit or in a pip wheel; the driver is on the
  # loader's path already.
  local extra sp
  for extra in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
    [ -d "$extra" ] && LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$extra"
  done
  for sp in $(python3 -c 'import site; print(*site.getsitepackages())' 2>/dev/null || true); do
    for extra in "$sp"/nvidia/*/lib "$sp"/nvidia/cu*/lib; do
      [ -d "$extra" ] && LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$extra"
    done
  done
  export LD_LIBRARY_PATH
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || true
  # Each program is bounded (a hung kernel or driver call fails, never waits).
  local threads
  for t in "$dir"/bin/test-*; do
    threads=()
    [ "${t##*/}" = test-cuda ] && threads=(--test-threads 1) # one device, tests in order
    echo "--- ${t##*/} --include-ignored"
    timeout 300 "$t" --include-ignored "${threads[@]}" || { echo "FAILED: ${t##*/}"; failed=1; }
  done
  echo "--- c-test_cuda"
  timeout 120 "$dir/bin/c-test_cuda" || { echo "FAILED: c-test_cuda"; failed=1; }
  # The pip package over the CUDA build, with the machine's torch on the GPU.
  if python3 -c 'import torch, pytest' 2>/dev/null; then
    echo "--- pytest python-shim/tests/test_pool.py test_tokens.py test_pooled.py (libmarconi with cuda)"
    MARCONI_LIBRARY="$(cd "$dir/lib" && pwd)/libmarconi.so" PYTHONPATH="$PWD/python-shim" \
      timeout 300 python3 -m pytest -q -p no:cacheprovider python-shim/tests/test_pool.py \
      python-shim/tests/test_tokens.py python-shim/tests/test_pooled.py ||
      { echo "FAILED: pytest"; failed=1; }
  else
    echo "FAILED: python3 with torch and pytest not found (the CUDA pool's torch test did not run)"
    failed=1
  fi
  for t in "$dir"/bin/bench-*; do
    echo "--- ${t##*/} --bench (short criterion runs)"
    timeout 300 "$t" --bench --warm-up-time 1 --measurement-time 2 ||
      { echo "FAILED: ${t##*/}"; failed=1; }
  done
  [ "$failed" -eq 0 ] && echo "gpu-check: all GPU tests passed" || echo "gpu-check: FAILURES above"
  return "$failed"
}

case "${1:-}" in
  build) build "${2:?build DIR}" ;;
  run) run "${2:?run DIR}" ;;
  "")
    dir="$target/gpu-check"
    build "$dir"
    run "$dir"
    ;;
  *)
    echo "usage: $0 [build DIR | run DIR]" >&2
    exit 2
    ;;
esac
