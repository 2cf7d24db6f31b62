#!/usr/bin/env bash
# The one test command (README names it; .ci/run calls it). Installs what it needs,
# then runs every test: Rust, C, Python. Safe to run on a fresh machine.
#
# Every step is timed; a table of the steps' times and results is printed at
# the end (also when a step fails). One build serves most steps: clippy, doc,
# the tests, the fuzz smoke and the marconi-sim steps of ci/test.d all use
# `--release --features marconi-core/strict-checks` with overflow checks on;
# the C and Python steps build libmarconi as users get it (default features).
# Downloads (nightly toolchain, Python wheels, llama.cpp) are cached under the
# target dir or rustup's home; the nightly toolchain and the PyTorch step
# (mostly downloads) run in the background while the first steps compile.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TERM_COLOR="${CARGO_TERM_COLOR:-never}"
# Every build of the test run traps integer overflow (release builds wrap otherwise);
# set once here so clippy, the tests and the C/Python steps share one build.
export CARGO_PROFILE_RELEASE_OVERFLOW_CHECKS=true
# This run's id: steps that measure the README's figures record it beside them
# ($CARGO_TARGET_DIR/readme-figures), and ci/test.d/readme.sh compares only this run's.
export MARCONI_CI_RUN="${MARCONI_CI_RUN:-$(date -u +%Y%m%dT%H%M%SZ)-$$}"
strict=(--release --features marconi-core/strict-checks)

if ! command -v cargo >/dev/null; then
  echo "cargo not found: install Rust (rustup) first" >&2
  exit 1
fi
rustup component add rustfmt clippy >/dev/null 2>&1 || true

steps=()   # "seconds<TAB>status<TAB>name"
t_all=$SECONDS
summary() {
  local rc=$?
  echo
  echo "ci/test.sh: step times ($(nproc) cores; load average at the end: $(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo '?'))"
  printf '%8s  %-6s  %s\n' "time" "result" "step"
  local s
  for s in "${steps[@]}"; do
    IFS=$'\t' read -r secs status name <<<"$s"
    printf '%5d:%02d  %-6s  %s\n' $((secs / 60)) $((secs % 60)) "$status" "$name"
  done
  local total=$((SECONDS - t_all))
  printf '%5d:%02d  %-6s  %s\n' $((total / 60)) $((total % 60)) "$([ "$rc" -eq 0 ] && echo ok || echo FAILED)" "total"
}
trap summary EXIT

# step NAME COMMAND...: runs the command, times it, records the result; a
# failure stops the run (the summary still prints).
step() {
  local name="$1"
  shift
  printf '\n==> %s\n' "$name"
  local t0=$SECONDS rc=0
  "$@" || rc=$?
  steps+=("$((SECONDS - t0))"$'\t'"$([ "$rc" -eq 0 ] && echo ok || echo FAILED)"$'\t'"$name")
  printf '<== %s: %d s%s\n' "$name" $((SECONDS - t0)) "$([ "$rc" -eq 0 ] || echo ", FAILED (exit $rc)")"
  return "$rc"
}

# The nightly toolchain (sanitizers, Miri) downloads while the first steps
# compile; sanitizers.sh installs it itself if this did not.
nightly="${MARCONI_NIGHTLY:-nightly}"
prefetch_log="$(mktemp "${TMPDIR:-/tmp}/marconi-nightly.XXXXXX")"
if ! rustup component list --toolchain "$nightly" --installed 2>/dev/null | grep -q '^miri'; then
  rustup toolchain install "$nightly" --profile minimal --component rust-src --component miri \
    >"$prefetch_log" 2>&1 &
  prefetch_pid=$!
else
  prefetch_pid=
fi

# Steps that mostly download (torch and transformers, ~5 GB) run in the
# background from the start, in their own process group (stopped if the run
# ends first), their output kept and printed when they are waited for.
background=(ci/test.d/torch-engine.sh)
declare -A bg_pid=() bg_log=()
for extra in "${background[@]}"; do
  [ -e "$extra" ] || continue
  bg_log[$extra]="$(mktemp "${TMPDIR:-/tmp}/marconi-bg.XXXXXX")"
  setsid bash -c 't0=$SECONDS; rc=0; bash "$1" >"$2" 2>&1 || rc=$?; echo "$((SECONDS - t0)) $rc" >"$2.done"' \
    _ "$extra" "${bg_log[$extra]}" &
  bg_pid[$extra]=$!
done
stop_background() {
  local extra
  for extra in "${!bg_pid[@]}"; do
    kill -- "-${bg_pid[$extra]}" 2>/dev/null || true
    rm -f "${bg_log[$extra]}" "${bg_log[$extra]}.done"
  done
}
trap 'summary; stop_background' EXIT
wait_background() { # wait_background SCRIPT: its output, then its status
  local extra="$1" secs rc
  wait "${bg_pid[$extra]}" || true
  unset "bg_pid[$extra]"
  cat "${bg_log[$extra]}"
  read -r secs rc <"${bg_log[$extra]}.done" || { secs=0; rc=1; }
  rm -f "${bg_log[$extra]}" "${bg_log[$extra]}.done"
  echo "(ran in the background: ${secs} s)"
  return "$rc"
}

# (Each of these functions chains with &&: errexit does not apply inside a function that
# step runs under `||`.)
fuzz_smoke() {
  # The fuzzer as the test step built it (ci/built.sh: no second build).
  local fuzz
  fuzz="$(bash ci/built.sh example fuzz_abi)" &&
    "$fuzz" --seed 1 --seconds 45 &&
    "$fuzz" --seed 100001 --seconds 30 --threads 2 --caches 2
}
cuda_feature() {
  cargo clippy -p marconi-gpu --all-targets --release --features cuda -- -D warnings &&
    cargo test -p marconi-gpu --release --features cuda
}

step "format" cargo fmt --all -- --check
step "clippy" cargo clippy --workspace --all-targets "${strict[@]}" -- -D warnings
step "docs (no warnings)" env RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps "${strict[@]}"
step "rust tests" cargo test --workspace "${strict[@]}" --no-fail-fast
step "C-ABI fuzz smoke (docs/testing.md has the long campaign)" fuzz_smoke
step "snapshots" bash ci/check-snapshots.sh
# Every crate packages (versions on path dependencies, licenses, readme, files
# inside each crate); the build of the packaged crates is `cargo package
# --workspace` (docs/testing.md), left out here: it compiles everything again.
# --allow-dirty: the working tree is what is tested.
step "publish dry run (packaging, in dependency order)" \
  cargo publish --workspace --dry-run --no-verify --allow-dirty
# Not on the AVMP replay: a recount per operation makes its 240 runs take minutes.
step "marconi-gpu allocator tests with its strict checks" \
  cargo test -p marconi-gpu --release --features strict-checks --lib --test allocator --test physical
step "marconi-gpu with the cuda feature (no CUDA toolkit needed; GPU tests skip)" cuda_feature

if [ -n "$prefetch_pid" ]; then
  wait "$prefetch_pid" || { echo "background nightly install failed (sanitizers.sh retries):"; cat "$prefetch_log"; }
fi
rm -f "$prefetch_log"

# Crate-specific steps (C ABI, Python, engines, simulator smokes).
for extra in ci/test.d/*.sh; do
  [ -e "$extra" ] || continue
  if [ -n "${bg_pid[$extra]:-}" ]; then
    step "$extra (started in the background at the beginning)" wait_background "$extra"
  else
    step "$extra" bash "$extra"
  fi
done
echo
echo "ci/test.sh: all green"
