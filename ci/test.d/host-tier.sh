#!/usr/bin/env bash
# Host tier memory from C: the marconi_host_pool_* tests (allocate, resolve,
# demote / promote between a memfd device pool and the host pool byte for
# byte, misuse refused with nothing copied) built with AddressSanitizer and
# UndefinedBehaviorSanitizer, linked against libmarconi.so and libmarconi.a,
# and run. The Rust tests (marconi-gpu tests/host.rs) run with the
# workspace's `cargo test`, the Python ones (test_host_pool.py) in
# python.sh. Budget: under a minute once libmarconi is built. The
# throughput figures: docs/tiers.md ("Host tier memory"). Runs from the
# repository root.
set -euo pipefail
cd "$(dirname "$0")/../.."

target="${CARGO_TARGET_DIR:-target}"
out="$target/c-tests"
mkdir -p "$out"
cargo build --release -p marconi-ffi
lib="$(cd "$target/release" && pwd)"
soname="$(readelf -d "$lib/libmarconi.so" | sed -n 's/.*(SONAME).*\[\(.*\)\]$/\1/p')"
[ -z "$soname" ] || ln -sfn libmarconi.so "$lib/$soname"

san=(-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=all)
cflags=(-std=c11 -Wall -Wextra -Wpedantic -Werror -g -O1 -Iinclude)
export ASAN_OPTIONS="detect_leaks=1:abort_on_error=1"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
src=marconi-ffi/tests/c/test_host_pool.c

echo "--- C host pool tests against libmarconi.so (ASan + UBSan)"
gcc "${cflags[@]}" "${san[@]}" "$src" -L"$lib" -Wl,-rpath,"$lib" -lmarconi -lpthread \
  -o "$out/test_host_pool_shared"
"$out/test_host_pool_shared"

echo "--- C host pool tests against libmarconi.a (ASan + UBSan)"
gcc "${cflags[@]}" "${san[@]}" "$src" "$lib/libmarconi.a" -lpthread -ldl -lm \
  -o "$out/test_host_pool_static"
"$out/test_host_pool_static"
