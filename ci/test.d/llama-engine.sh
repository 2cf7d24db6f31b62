#!/usr/bin/env bash
# The llama.cpp engine (examples/llama-engine): fetches llama.cpp's sources
# from the PyPI sdist of llama-cpp-python (pinned version, sha256 checked),
# builds only the llama + ggml libraries, CPU only (once per target dir:
# the build is cached under $CARGO_TARGET_DIR/llama.cpp), builds the engine
# against them and libmarconi, and runs it: every request's logits must be
# bitwise equal to a no-cache run, and both negative controls (zeroed SSM
# state, zeroed conv state on restore) must be detected. Then the tiered
# mode (docs/tiers.md): two engine processes share a store (a directory,
# then a real redis-server on 127.0.0.1 started and stopped here): the
# second continues the first's sessions from the states it stored, bitwise
# equal to no cache; corrupted objects and a store killed mid-run give
# counted misses, never errors or wrong logits. Runs from the repository
# root. Budget: 10 minutes on 2 cores, llama.cpp build included (the tiered
# runs: about 40 s).
set -euo pipefail
cd "$(dirname "$0")/../.."
repo="$(pwd)"

version=0.3.36
sha256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e

target="${CARGO_TARGET_DIR:-target}"
mkdir -p "$target"
target="$(cd "$target" && pwd)"
cache="$target/llama.cpp"
src="$cache/llama_cpp_python-$version/vendor/llama.cpp"
build="$cache/build-$version"
python="${PYTHON:-python3}"

if ! command -v redis-server >/dev/null && ! command -v valkey-server >/dev/null; then
  echo "--- apt-get install redis-server"
  sudo=""
  [ "$(id -u)" = 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends redis-server >/dev/null
fi

for tool in cmake g++ make; do
  if ! command -v "$tool" >/dev/null; then
    echo "--- apt-get install cmake g++ make"
    apt-get update -qq && apt-get install -y -qq cmake g++ make >/dev/null
    break
  fi
done

if [ ! -f "$src/include/llama.h" ]; then
  echo "--- pip download llama-cpp-python==$version (sdist: llama.cpp's sources)"
  mkdir -p "$cache"
  # A venv of its own: a system Python may refuse pip (PEP 668).
  "$python" -m venv "$cache/venv"
  "$cache/venv/bin/python" -m pip download --quiet --no-binary :all: --no-deps "llama-cpp-python==$version" -d "$cache"
  echo "$sha256  $cache/llama_cpp_python-$version.tar.gz" | sha256sum -c -
  tar -xzf "$cache/llama_cpp_python-$version.tar.gz" -C "$cache"
fi

if [ ! -f "$build/bin/libllama.so" ]; then
  echo "--- build llama.cpp (llama + ggml libraries only, CPU)"
  start=$SECONDS
  cmake -S "$src" -B "$build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
    -DLLAMA_BUILD_COMMON=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_TOOLS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_OPENSSL=OFF -DGGML_OPENMP=OFF >"$cache/cmake.log" 2>&1 || { tail -40 "$cache/cmake.log"; exit 1; }
  cmake --build "$build" -j2 --target llama >"$cache/build.log" 2>&1 || { tail -60 "$cache/build.log"; exit 1; }
  echo "llama.cpp built in $((SECONDS - start)) s"
fi

echo "--- cargo build --release -p marconi-ffi"
cargo build --release -p marconi-ffi
lib="$target/release"
# The engine records libmarconi's SONAME; give it the name scripts/install.sh gives it.
soname="$(readelf -d "$lib/libmarconi.so" | sed -n 's/.*(SONAME).*\[\(.*\)\]$/\1/p')"
[ -z "$soname" ] || ln -sfn libmarconi.so "$lib/$soname"
out="$target/llama-engine"
mkdir -p "$out"
make -s -C examples/llama-engine LLAMA_SRC="$src" LLAMA_BUILD="$build" \
  MARCONI_LIB="$lib" OUT="$out"

echo "--- llama-engine: every request bitwise equal to no cache"
cd "$out"
./llama-engine --gguf tiny-nemotron-h.gguf
echo "--- llama-engine negative controls: a corrupted restored state must be detected"
./llama-engine --gguf tiny-nemotron-h.gguf --negative zero-ssm
./llama-engine --gguf tiny-nemotron-h.gguf --negative zero-conv

echo "--- llama-engine tiers: a second process resumes from a shared directory store"
work="$(mktemp -d "$out/tiers.XXXXXX")"
redis_pid=""
cleanup() {
  [ -z "$redis_pid" ] || kill "$redis_pid" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
start=$SECONDS
# A: evicted states go to its host buffers; every state is written through
# to the store (shared with other processes) and its sessions recorded.
./llama-engine --gguf tiny-nemotron-h.gguf --requests 32 --tiers --tier-write through \
  --store "dir:$work/store" --transcript-out "$work/sessions.txt"
# B: a fresh process (empty device cache) continues A's sessions.
./llama-engine --gguf tiny-nemotron-h.gguf --tiers --store "dir:$work/store" \
  --resume "$work/sessions.txt" --expect shared | tee "$work/resume.txt"
# The README's figures of this run (its examples table; ci/test.d/readme.sh
# compares the deterministic ones: requests resumed, from the other process).
mkdir -p "$target/readme-figures"
"$python" - "$work/resume.txt" "$target/readme-figures/llama-engine.json" "${MARCONI_CI_RUN:-}" \
  "$(git -C "$repo" rev-parse HEAD 2>/dev/null || true)" <<'PY'
import json, re, sys, time
text = open(sys.argv[1]).read()
row = lambda name: re.search(r"^  %s +(\d+) prompt tokens, +(\d+) prefilled .*?(\d+) hit requests, prefill +([\d.]+) s$"
                             % name, text, re.M)
cached, nocache = row("libmarconi tiers"), row("no cache")
shared = re.search(r"^hits by tier .*\((\d+) of them written by another process\)", text, re.M)
exact = re.search(r"^exactness: (\d+) of (\d+) requests bitwise equal to no cache \((\d+) served", text, re.M)
assert cached and nocache and shared and exact, "llama-engine's output lost a line readme-figures reads"
json.dump({"step": "ci/test.d/llama-engine.sh", "run": sys.argv[3], "commit": sys.argv[4],
           "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "figures": {"resumed": int(exact.group(3)), "requests": int(exact.group(2)),
                       "from_other_process": int(shared.group(1)), "bitwise_equal": int(exact.group(1))},
           "timings": {"prefill_s_cached": float(cached.group(4)), "prefill_s_no_cache": float(nocache.group(4))}},
          open(sys.argv[2], "w"), indent=1)
PY
echo "--- llama-engine tiers: corrupted store objects are misses"
for f in "$work"/store/*; do
  size=$(stat -c %s "$f")
  printf '\xff' | dd of="$f" bs=1 seek=$((size / 2)) conv=notrunc status=none
done
./llama-engine --gguf tiny-nemotron-h.gguf --tiers --store "dir:$work/store" \
  --resume "$work/sessions.txt" --expect load-failures

echo "--- llama-engine tiers: redis-server on 127.0.0.1, killed mid-run of the second process"
redis="$(command -v redis-server || command -v valkey-server)"
port="$("$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
"$redis" --bind 127.0.0.1 --port "$port" --save '' --appendonly no --protected-mode yes \
  >"$work/redis.log" 2>&1 &
redis_pid=$!
for _ in $(seq 50); do
  (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && break
  sleep 0.1
done
./llama-engine --gguf tiny-nemotron-h.gguf --requests 32 --tiers --tier-write through \
  --store "redis://127.0.0.1:$port" --transcript-out "$work/sessions-redis.txt"
./llama-engine --gguf tiny-nemotron-h.gguf --tiers --store "redis://127.0.0.1:$port" \
  --resume "$work/sessions-redis.txt" --kill-store-pid "$redis_pid" --kill-after 5 --expect store-down
wait "$redis_pid" 2>/dev/null || true
redis_pid=""
echo "tiered runs: $((SECONDS - start)) s"
