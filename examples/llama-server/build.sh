#!/usr/bin/env bash
# Builds what examples/llama-server needs, each step skipped when its output
# is there (everything cached under the cargo target dir):
#   - the build tools (cmake, g++, make, patch), installed with apt-get only
#     when one is missing;
#   - llama.cpp's sources: the llama-cpp-python sdist (pinned version,
#     sha256 checked) fetched with `pip download`, the same tree and cmake
#     build directory as ci/test.d/llama-engine.sh (whichever runs first
#     fetches it), with server.patch applied to tools/server;
#   - libmarconi (cargo build --release -p marconi-ffi);
#   - llama-server (CPU, -j$JOBS, default 2) and make-gguf;
#   - the random-weight hybrid GGUFs (make-gguf): tiny-nemotron-h.gguf,
#     tiny-granite-hybrid.gguf, tiny-falcon-h1.gguf, tiny-qwen35.gguf.
# Safe to start several times at once (serve.sh calls it): one flock on
# $CARGO_TARGET_DIR/llama.cpp/llama-server.lock; the first caller builds,
# the others wait for it and then find everything built.
# Prints the directory holding llama-server and the GGUFs as its last line.
set -euo pipefail
# As CI builds libmarconi (a different profile setting would rebuild it).
export CARGO_PROFILE_RELEASE_OVERFLOW_CHECKS="${CARGO_PROFILE_RELEASE_OVERFLOW_CHECKS:-true}"
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
cd "$root"

version=0.3.36
sha256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e

target="${CARGO_TARGET_DIR:-target}"
mkdir -p "$target"
target="$(cd "$target" && pwd)"
cache="$target/llama.cpp"
src="$cache/llama_cpp_python-$version/vendor/llama.cpp"
build="$cache/build-$version"
out="$target/llama-server"
jobs="${JOBS:-2}"
python="${PYTHON:-python3}"
mkdir -p "$cache" "$out"

# One build at a time; the others wait (bounded: 60 minutes).
exec 9>"$cache/llama-server.lock"
if ! flock -n 9; then
  echo "--- waiting for another examples/llama-server/build.sh to finish" >&2
  flock -w 3600 9 || { echo "build.sh: another build held the lock for an hour" >&2; exit 1; }
fi

missing=()
for tool in cmake g++ make patch readelf; do
  command -v "$tool" >/dev/null || missing+=("$tool")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "--- apt-get install cmake g++ make patch binutils (missing: ${missing[*]})" >&2
  sudo=""
  [ "$(id -u)" = 0 ] || sudo="sudo"
  $sudo apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends \
    cmake g++ make patch binutils util-linux >/dev/null
fi

if [ ! -f "$src/include/llama.h" ]; then
  tarball="$cache/llama_cpp_python-$version.tar.gz"
  if [ ! -f "$tarball" ]; then
    echo "--- pip download llama-cpp-python==$version (sdist: llama.cpp's sources)" >&2
    # A venv of its own (a system Python may refuse pip, PEP 668), the one
    # ci/test.d/llama-engine.sh makes. Only this package from source: its
    # build requirements (scikit-build-core, cmake) come as wheels to read
    # the sdist's metadata.
    [ -x "$cache/venv/bin/python" ] || "$python" -m venv "$cache/venv" >&2
    "$cache/venv/bin/python" -m pip download --quiet --no-deps --no-binary llama-cpp-python \
      "llama-cpp-python==$version" -d "$cache/download.$$" >&2
    mv "$cache/download.$$/llama_cpp_python-$version.tar.gz" "$tarball"
    rm -rf "$cache/download.$$"
  fi
  echo "$sha256  $tarball" | sha256sum -c - >&2 || { rm -f "$tarball"; exit 1; }
  rm -rf "$cache/llama_cpp_python-$version"
  tar -xzf "$tarball" -C "$cache"
fi

# server.patch, applied once (a tree already patched is recognised).
if ! patch -d "$src" -p1 -R --dry-run -s -f <"$here/server.patch" >/dev/null 2>&1; then
  echo "--- apply examples/llama-server/server.patch" >&2
  patch -d "$src" -p1 -s -f <"$here/server.patch"
fi

echo "--- cargo build --release -p marconi-ffi" >&2
cargo build --release -p marconi-ffi >&2
lib="$target/release"
soname="$(readelf -d "$lib/libmarconi.so" | sed -n 's/.*(SONAME).*\[\(.*\)\]$/\1/p')"
[ -z "$soname" ] || ln -sfn libmarconi.so "$lib/$soname"

stale=0
[ -f "$build/bin/llama-server" ] || stale=1
for f in "$here/hooks/marconi-hooks.cpp" "$here/hooks/marconi-hooks.h" "$here/server.patch" "$lib/libmarconi.so" \
         "$root/include/marconi.h"; do
  [ "$stale" = 1 ] || [ ! "$f" -nt "$build/bin/llama-server" ] || stale=1
done
if [ "$stale" = 1 ]; then
  echo "--- build llama-server (CPU, -j$jobs)" >&2
  start=$SECONDS
  cmake -S "$src" -B "$build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
    -DLLAMA_BUILD_COMMON=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_TOOLS=ON \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_OPENSSL=OFF -DGGML_OPENMP=OFF \
    -DMARCONI_HOOKS_DIR="$here/hooks" -DMARCONI_INCLUDE_DIR="$root/include" \
    -DMARCONI_LIBRARY="$lib/libmarconi.so" >"$cache/cmake-server.log" 2>&1 || { tail -40 "$cache/cmake-server.log" >&2; exit 1; }
  cmake --build "$build" -j"$jobs" --target llama-server >"$cache/build-server.log" 2>&1 || { tail -60 "$cache/build-server.log" >&2; exit 1; }
  touch "$build/bin/llama-server"
  echo "llama-server built in $((SECONDS - start)) s" >&2
fi
ln -sfn "$build/bin/llama-server" "$out/llama-server"

if [ ! -x "$out/make-gguf" ] || [ "$here/make-gguf.cpp" -nt "$out/make-gguf" ]; then
  g++ -O2 -std=c++17 -Wall -Wextra -Werror -I"$src/include" -I"$src/ggml/include" "$here/make-gguf.cpp" \
    -o "$out/make-gguf.$$" -L"$build/bin" -Wl,-rpath,"$build/bin" -lllama -lggml -lggml-base
  mv "$out/make-gguf.$$" "$out/make-gguf"
fi
for m in nemotron_h:tiny-nemotron-h granitehybrid:tiny-granite-hybrid falcon-h1:tiny-falcon-h1 qwen35:tiny-qwen35; do
  gguf="$out/${m#*:}.gguf"
  if [ ! -f "$gguf" ] || [ "$out/make-gguf" -nt "$gguf" ]; then
    "$out/make-gguf" "$src/models/ggml-vocab-phi-3.gguf" "$gguf.part" 12 "${m%%:*}" >&2
    mv "$gguf.part" "$gguf"
  fi
done
echo "$out"
