#!/usr/bin/env bash
# The one test command (README names it; .ci/run calls it). Installs what it needs,
# then runs every test: Rust, C, Python. Safe to run on a fresh machine.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TERM_COLOR="${CARGO_TERM_COLOR:-never}"
# Every build of the test run traps integer overflow (release builds wrap otherwise);
# set once here so clippy, the tests and the C/Python steps share one build.
export CARGO_PROFILE_RELEASE_OVERFLOW_CHECKS=true

step() { printf '\n==> %s\n' "$*"; }

if ! command -v cargo >/dev/null; then
  echo "cargo not found: install Rust (rustup) first" >&2
  exit 1
fi
rustup component add rustfmt clippy >/dev/null 2>&1 || true

step "format"
cargo fmt --all -- --check

step "clippy"
cargo clippy --workspace --all-targets --release --features marconi-core/strict-checks -- -D warnings

step "docs (no warnings)"
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --release

step "rust tests"
cargo test --workspace --release --no-fail-fast --features marconi-core/strict-checks

step "C-ABI fuzz smoke (seeded random calls, invariants after each; README has the long campaign)"
cargo run --release -p marconi-ffi --example fuzz_abi -- --seed 1 --seconds 45
cargo run --release -p marconi-ffi --example fuzz_abi -- --seed 100001 --seconds 30 --threads 2 --caches 2

step "snapshots"
bash ci/check-snapshots.sh

step "marconi-gpu allocator tests with its strict checks (free-list recount after every step)"
# Not on the AVMP replay: a recount per operation makes its 240 runs take minutes.
cargo test -p marconi-gpu --release --features strict-checks --lib --test allocator --test physical

step "marconi-gpu with the cuda feature (compiles without a CUDA toolkit; GPU tests skip without one)"
cargo clippy -p marconi-gpu --all-targets --release --features cuda -- -D warnings
cargo test -p marconi-gpu --release --features cuda

# Crate-specific steps (C ABI tests, Python shim tests).
for extra in ci/test.d/*.sh; do
  [ -e "$extra" ] || continue
  step "$extra"
  bash "$extra"
done
echo
echo "ci/test.sh: all green"
