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
# target dir or rustup's home; the PyTorch step (mostly downloads) and the
# sanitizer builds (at the lowest priority) run in the background while the
# other steps run.
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

# Background work from the start, each in its own process group (stopped if
# the run ends first), its output kept and printed when it is waited for:
#  - steps that mostly download (torch and transformers, ~5 GB): the whole
#    step runs there and is waited for in its turn;
#  - the sanitizer and Miri builds (the nightly toolchain installed first),
#    at the lowest priority: they take the cores the other steps leave idle
#    (downloads, servers, single-threaded tests) and never slow those steps;
#    their step in its turn waits for them, then runs the tests.
background=(ci/test.d/torch-engine.sh)
prebuild=(ci/test.d/sanitizers.sh)
declare -A bg_pid=() bg_log=() pre_pid=()
# A new session is also a new scheduling group where the kernel groups
# sessions (autogroup): the group's own niceness is set too, or the
# background would share the cores equally with the foreground, whatever
# its processes' niceness.
start_background() { # start_background SCRIPT NICENESS ARGS...
  local extra="$1" niceness="$2"
  shift 2
  bg_log[$extra]="$(mktemp "${TMPDIR:-/tmp}/marconi-bg.XXXXXX")"
  setsid nice -n "$niceness" bash -c \
    'echo "$3" 2>/dev/null >/proc/self/autogroup || true
     t0=$SECONDS; rc=0; bash "$1" "${@:4}" >"$2" 2>&1 || rc=$?; echo "$((SECONDS - t0)) $rc" >"$2.done"' \
    _ "$extra" "${bg_log[$extra]}" "$niceness" "$@" &
  bg_pid[$extra]=$!
}
for extra in "${background[@]}"; do
  [ -e "$extra" ] && start_background "$extra" 0
done
for extra in "${prebuild[@]}"; do
  [ -e "$extra" ] && start_background "$extra" 19 build && pre_pid[$extra]=1
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
prebuilt_step() { # prebuilt_step SCRIPT: waits for its background build, then runs it
  local extra="$1" t0=$SECONDS
  wait_background "$extra" || return
  echo "(waited $((SECONDS - t0)) s for the background build)"
  bash "$extra"
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

# Crate-specific steps (C ABI, Python, engines, simulator smokes).
# The steps built in the background run last: their builds get every idle
# core until then.
for extra in ci/test.d/*.sh; do
  [ -e "$extra" ] || continue
  if [ -n "${pre_pid[$extra]:-}" ]; then
    continue
  elif [ -n "${bg_pid[$extra]:-}" ]; then
    step "$extra (started in the background at the beginning)" wait_background "$extra"
  else
    step "$extra" bash "$extra"
  fi
done
for extra in "${!pre_pid[@]}"; do
  step "$extra (built in the background from the beginning)" prebuilt_step "$extra"
done
echo
echo "ci/test.sh: all green"
