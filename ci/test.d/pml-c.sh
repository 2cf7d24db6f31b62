#!/usr/bin/env bash
# PML through the C ABI (marconi_pml_*): marconi-ffi/tests/c/test_pml.c and
# test_pml_cache.c (the module store) with
# AddressSanitizer and UndefinedBehaviorSanitizer, against libmarconi.so and
# libmarconi.a. Runs from the repository root; reuses c.sh's release build.
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

gcc "${cflags[@]}" "${san[@]}" marconi-ffi/tests/c/test_pml.c -L"$lib" -Wl,-rpath,"$lib" -lmarconi \
  -lpthread -o "$out/test_pml_shared"
"$out/test_pml_shared"
gcc "${cflags[@]}" "${san[@]}" marconi-ffi/tests/c/test_pml.c "$lib/libmarconi.a" -lpthread -ldl -lm \
  -o "$out/test_pml_static"
"$out/test_pml_static"
for t in test_pml_cache; do
  gcc "${cflags[@]}" "${san[@]}" "marconi-ffi/tests/c/$t.c" -L"$lib" -Wl,-rpath,"$lib" -lmarconi \
    -lpthread -o "$out/${t}_shared"
  "$out/${t}_shared"
  gcc "${cflags[@]}" "${san[@]}" "marconi-ffi/tests/c/$t.c" "$lib/libmarconi.a" -lpthread -ldl -lm \
    -o "$out/${t}_static"
  "$out/${t}_static"
done
