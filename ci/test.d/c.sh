#!/usr/bin/env bash
# C ABI tests: builds libmarconi, checks the committed header is fresh, then
# compiles the C tests (two translation units, the header included twice) and
# a C++ program against include/marconi.h, with AddressSanitizer and
# UndefinedBehaviorSanitizer, linked once against libmarconi.so and once
# against libmarconi.a, and runs them; test_cuda.c (run on a GPU by
# scripts/gpu-check.sh) is compiled and linked. Runs from the repository root.
set -euo pipefail
cd "$(dirname "$0")/../.."

target="${CARGO_TARGET_DIR:-target}"
lib="$target/release"
out="$target/c-tests"
mkdir -p "$out"

echo "--- cargo build --release -p marconi-ffi"
cargo build --release -p marconi-ffi
test -f "$lib/libmarconi.so" && test -f "$lib/libmarconi.a"
lib="$(cd "$lib" && pwd)"
# Programs linked here record the library's SONAME (libmarconi.so.0.2 when
# marconi-ffi sets one); give it the name scripts/install.sh gives it.
soname="$(readelf -d "$lib/libmarconi.so" | sed -n 's/.*(SONAME).*\[\(.*\)\]$/\1/p')"
[ -z "$soname" ] || ln -sfn libmarconi.so "$lib/$soname"

echo "--- header is fresh (cbindgen, pinned)"
# The test run's own binary (ci/built.sh): `cargo test -p marconi-ffi` alone
# would compile cbindgen and its dependencies a second time.
(cd marconi-ffi && "$(bash ../ci/built.sh test header marconi-ffi)" --quiet)

san=(-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=all)
cflags=(-std=c11 -Wall -Wextra -Wpedantic -Werror -g -O1 -Iinclude)
src=(marconi-ffi/tests/c/test_cache.c marconi-ffi/tests/c/test_include_twice.c)
export ASAN_OPTIONS="detect_leaks=1:abort_on_error=1"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"

echo "--- C tests against libmarconi.so (ASan + UBSan)"
gcc "${cflags[@]}" "${san[@]}" "${src[@]}" -L"$lib" -Wl,-rpath,"$lib" -lmarconi -lpthread \
  -o "$out/test_cache_shared"
"$out/test_cache_shared"

echo "--- C tests against libmarconi.a (ASan + UBSan)"
gcc "${cflags[@]}" "${san[@]}" "${src[@]}" "$lib/libmarconi.a" -lpthread -ldl -lm \
  -o "$out/test_cache_static"
"$out/test_cache_static"

echo "--- C pool, snapshot, cache-over-pools, planning and tiered-cache tests (.so and .a, ASan + UBSan)"
for t in test_pool test_pooled test_tiered; do
  gcc "${cflags[@]}" "${san[@]}" "marconi-ffi/tests/c/$t.c" -L"$lib" -Wl,-rpath,"$lib" -lmarconi \
    -lpthread -o "$out/${t}_shared"
  "$out/${t}_shared"
  gcc "${cflags[@]}" "${san[@]}" "marconi-ffi/tests/c/$t.c" "$lib/libmarconi.a" -lpthread -ldl -lm \
    -o "$out/${t}_static"
  "$out/${t}_static"
done

echo "--- C++ compile of the header"
g++ -std=c++17 -pthread -Wall -Wextra -Wpedantic -Werror -g -Iinclude "${san[@]}" \
  marconi-ffi/tests/c/test_cxx.cpp -L"$lib" -Wl,-rpath,"$lib" -lmarconi -o "$out/test_cxx"
"$out/test_cxx"

echo "--- a deprecated call warns, naming the call to use (C and C++), unless silenced"
printf '#include "marconi.h"\nint main(void) { marconi_pooled_cache_free(0); return 0; }\n' \
  >"$out/deprecated.c"
cp "$out/deprecated.c" "$out/deprecated.cpp"
for compile in "gcc -std=c11 -x c" "g++ -std=c++17 -x c++"; do
  src="$out/deprecated.c"
  [ "${compile%% *}" = g++ ] && src="$out/deprecated.cpp"
  if $compile -Iinclude -Werror=deprecated-declarations -c "$src" -o "$out/deprecated.o" \
    2>"$out/deprecated.err"; then
    echo "${compile%% *}: a call of a deprecated function compiled without a warning" >&2
    exit 1
  fi
  grep -q 'use marconi_cache_free' "$out/deprecated.err" || {
    cat "$out/deprecated.err" >&2
    echo "${compile%% *}: the warning does not name the call to use" >&2
    exit 1
  }
  $compile -Iinclude -Wall -Werror -DMARCONI_NO_DEPRECATION_WARNINGS -c "$src" -o "$out/deprecated.o"
done

echo "--- test_cuda.c compiles and links (it runs on a GPU: scripts/gpu-check.sh)"
# It shares check.h with the tests above; built here so that a change there
# cannot break it unseen. Not run: without a GPU it only prints SKIPPED.
gcc "${cflags[@]}" "${san[@]}" marconi-ffi/tests/c/test_cuda.c -L"$lib" -Wl,-rpath,"$lib" -lmarconi \
  -lpthread -ldl -o "$out/test_cuda"

echo "--- the README's C snippet"
# The first ```c block after "## C ABI", and the ```text block after it (its output).
awk '/^## C ABI/{s=1} s&&/^```c$/{t=1;next} t&&/^```/{exit} t' README.md >"$out/readme.c"
expected="$(awk '/^## C ABI/{s=1} s&&/^```text$/{t=1;next} t&&/^```/{exit} t' README.md)"
test -s "$out/readme.c"
gcc "${cflags[@]}" "${san[@]}" "$out/readme.c" -L"$lib" -Wl,-rpath,"$lib" -lmarconi -o "$out/readme"
actual="$("$out/readme")"
if [ "$actual" != "$expected" ]; then
  printf 'README C snippet output differs.\nexpected:\n%s\nactual:\n%s\n' "$expected" "$actual" >&2
  exit 1
fi
echo "$actual"
