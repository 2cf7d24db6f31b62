#!/usr/bin/env bash
# The llama.cpp engine (examples/llama-engine): fetches llama.cpp's sources
# from the PyPI sdist of llama-cpp-python (pinned version, sha256 checked),
# builds only the llama + ggml libraries, CPU only (once per target dir:
# the build is cached under $CARGO_TARGET_DIR/llama.cpp), builds the engine
# against them and libmarconi, and runs it: every request's logits must be
# bitwise equal to a no-cache run, and both negative controls (zeroed SSM
# state, zeroed conv state on restore) must be detected. Runs from the
# repository root. Budget: 10 minutes on 2 cores, llama.cpp build included.
set -euo pipefail
cd "$(dirname "$0")/../.."

version=0.3.36
sha256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e

target="${CARGO_TARGET_DIR:-target}"
mkdir -p "$target"
target="$(cd "$target" && pwd)"
cache="$target/llama.cpp"
src="$cache/llama_cpp_python-$version/vendor/llama.cpp"
build="$cache/build-$version"
python="${PYTHON:-python3}"

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
