#!/usr/bin/env bash
# The Rust side under the sanitizers and Miri (the C side runs under ASan/UBSan
# in c.sh already). Needs a nightly toolchain with rust-src and miri; installs
# it with rustup when missing. Runs from the repository root.
#
#   ASan  libmarconi built with -Zsanitizer=address (-Zbuild-std): the C tests
#         linked against it (gcc's ASan runtime), marconi-ffi's multithreaded
#         test and a short C-ABI fuzz campaign.
#   TSan  the C tests (the pool test's threads on one pool included),
#         marconi-ffi's multithreaded tests (a shared cache, two shared pools
#         with handles passed across, a shared cache over pools) and a
#         multithreaded fuzz campaign.
#   Miri  marconi-ffi's unit tests (its unsafe boundary) and a few marconi-core
#         tests: its search worker's threads and its error paths (MIRI_FULL=1:
#         every marconi-core test; slow).
#
# Every build here has overflow checks on. The instrumented builds use
# opt-level 1 and line tables only: enough for a report's file and line, and
# quicker to build than the release profile's opt-level 3 with debuginfo.
#
# `sanitizers.sh build` compiles everything and runs nothing: ci/test.sh
# starts it in the background at the beginning, at a low priority, so the
# builds use the cores the other steps leave idle; this step then runs the
# tests on the finished builds. `sanitizers.sh` alone builds and runs.
set -euo pipefail
cd "$(dirname "$0")/../.."
phase="${1:-all}"
case "$phase" in build | all) ;; *) echo "usage: sanitizers.sh [build]" >&2; exit 2 ;; esac

nightly="${MARCONI_NIGHTLY:-nightly}"
if ! cargo "+$nightly" miri --version >/dev/null 2>&1 ||
  ! rustup component list --toolchain "$nightly" --installed 2>/dev/null | grep -q '^rust-src'; then
  echo "--- rustup toolchain install $nightly (rust-src, miri)"
  rustup toolchain install "$nightly" --profile minimal --component rust-src --component miri
fi
cargo "+$nightly" --version

host="$(rustc -vV | sed -n 's/^host: //p')"
base="${CARGO_TARGET_DIR:-target}"
export CARGO_PROFILE_RELEASE_OVERFLOW_CHECKS=true
# A fuzz smoke per sanitizer: the long campaign is in docs/testing.md.
fuzz_calls="${MARCONI_SAN_FUZZ_CALLS:-200000}"

san_cargo() { # san_cargo SANITIZER cargo-args...
  local san="$1"
  shift
  RUSTFLAGS="-Zsanitizer=$san -Cforce-frame-pointers=yes" \
    RUSTDOCFLAGS="-Zsanitizer=$san" \
    CARGO_TARGET_DIR="$base/san-$san" \
    CARGO_PROFILE_RELEASE_OPT_LEVEL=1 CARGO_PROFILE_RELEASE_DEBUG=line-tables-only \
    cargo "+$nightly" "$@" -Zbuild-std --target "$host" --release
}
miri_cargo() { # miri_cargo cargo-miri-args...
  CARGO_TARGET_DIR="$base/miri" cargo "+$nightly" miri "$@"
}
# Isolation off: proptest reads the working directory. Tests that start a child
# process are ignored under Miri (cfg_attr(miri, ignore)).
export MIRIFLAGS="${MIRIFLAGS:--Zmiri-disable-isolation}"
export PROPTEST_CASES="${PROPTEST_CASES:-2}"

# What the runs below need, and only that: libmarconi and the fuzzer (the C
# tests link the one, the fuzz smoke is the other), the threaded test binary,
# and Miri's builds. marconi-ffi's unit tests run under Miri, which finds
# more in them than ASan would.
build_all() {
  echo "--- build: ASan"
  san_cargo address build -p marconi-ffi --lib --example fuzz_abi
  san_cargo address test -p marconi-ffi --test threads --no-run
  echo "--- build: TSan"
  san_cargo thread build -p marconi-ffi --lib --example fuzz_abi
  san_cargo thread test -p marconi-ffi --test threads --no-run
  echo "--- build: Miri"
  miri_cargo test -p marconi-ffi --lib --no-run
  if [ "${MIRI_FULL:-0}" = 1 ]; then
    miri_cargo test -p marconi-core --no-run
  else
    miri_cargo test -p marconi-core --lib --test errors --no-run
  fi
}
build_all
[ "$phase" = all ] || exit 0

asan_lib="$base/san-address/$host/release"
out="$base/san-address/c-tests"
mkdir -p "$out"

echo "--- ASan: C tests against the instrumented libmarconi.a"
gcc -std=c11 -g -O1 -Iinclude -fsanitize=address,undefined -fno-omit-frame-pointer \
  -fno-sanitize-recover=all \
  marconi-ffi/tests/c/test_cache.c marconi-ffi/tests/c/test_include_twice.c \
  "$asan_lib/libmarconi.a" -lpthread -ldl -lm -o "$out/test_cache"
ASAN_OPTIONS="detect_leaks=1:abort_on_error=1" UBSAN_OPTIONS="halt_on_error=1" "$out/test_cache"

echo "--- ASan: marconi-ffi's multithreaded test"
ASAN_OPTIONS="detect_leaks=1" san_cargo address test -p marconi-ffi --test threads
if [ "${MARCONI_SAN_UNIT:-0}" = 1 ]; then
  echo "--- ASan: marconi-ffi's unit tests (MARCONI_SAN_UNIT=1)"
  ASAN_OPTIONS="detect_leaks=1" san_cargo address test -p marconi-ffi --lib
fi

echo "--- ASan: C-ABI fuzz smoke ($fuzz_calls calls)"
ASAN_OPTIONS="detect_leaks=1" "$asan_lib/examples/fuzz_abi" --seed 1 --calls "$fuzz_calls"

echo "--- TSan: marconi-ffi multithreaded test"
TSAN_OPTIONS="halt_on_error=1" san_cargo thread test -p marconi-ffi --test threads
tsan_lib="$base/san-thread/$host/release"
echo "--- TSan: C tests (their threaded test included) against the instrumented libmarconi.a"
# gcc instruments the C side; the runtime is the toolchain's own (gcc 12's libtsan
# lacks the __tsan_memcpy family that the Rust side calls). A planted race in C is
# reported with this link (checked by hand).
tsan_rt="$(ls "$(rustc "+$nightly" --print sysroot)/lib/rustlib/$host/lib/"*_rt.tsan.a | head -n1)"
for c in test_cache test_include_twice; do
  gcc -std=c11 -g -O1 -Iinclude -fsanitize=thread -c "marconi-ffi/tests/c/$c.c" -o "$base/san-thread/$c.o"
done
g++ "$base/san-thread/test_cache.o" "$base/san-thread/test_include_twice.o" "$tsan_lib/libmarconi.a" \
  -Wl,--whole-archive "$tsan_rt" -Wl,--no-whole-archive -lpthread -ldl -lm -lrt \
  -o "$base/san-thread/test_cache"
TSAN_OPTIONS="halt_on_error=1" "$base/san-thread/test_cache"
echo "--- TSan: the pool C test (threads sharing a memfd pool)"
gcc -std=c11 -g -O1 -Iinclude -fsanitize=thread -c marconi-ffi/tests/c/test_pool.c -o "$base/san-thread/test_pool.o"
g++ "$base/san-thread/test_pool.o" "$tsan_lib/libmarconi.a" \
  -Wl,--whole-archive "$tsan_rt" -Wl,--no-whole-archive -lpthread -ldl -lm -lrt \
  -o "$base/san-thread/test_pool"
TSAN_OPTIONS="halt_on_error=1" "$base/san-thread/test_pool"
echo "--- TSan: C-ABI fuzz smoke, 4 threads on shared caches"
TSAN_OPTIONS="halt_on_error=1" "$tsan_lib/examples/fuzz_abi" --seed 2 --calls "$fuzz_calls" --threads 4

echo "--- Miri: marconi-ffi unit tests"
miri_cargo test -p marconi-ffi --lib
echo "--- Miri: marconi-core"
if [ "${MIRI_FULL:-0}" = 1 ]; then
  miri_cargo test -p marconi-core
else
  # A smoke: marconi-core has no unsafe code, so Miri looks at its threads and
  # channels (the α-search worker: spawn, rounds, a dead worker, cancellation on
  # drop) and the error paths. MIRI_FULL=1 runs every marconi-core test (its lib
  # and error tests alone, with the slowest property tests skipped, took 369 s
  # under Miri on a loaded 2-core machine; the skipped ones take minutes each).
  miri_cargo test -p marconi-core --lib -- \
    one_worker_serves_every_round a_dead_worker_is_replaced dropping_the_cache_mid_search \
    without_a_thread_deterministic after_a_fork_no_request_waits
  miri_cargo test -p marconi-core --test errors
fi
