#!/usr/bin/env bash
# Builds what examples/llama-server needs, each step skipped when its output
# is there (everything cached under the cargo target dir):
#   - llama.cpp's sources from the PyPI sdist of llama-cpp-python (pinned
#     version, sha256 checked; the same tree and build directory as
#     ci/test.d/llama-engine.sh), with server.patch applied to tools/server;
#   - libmarconi (cargo build --release -p marconi-ffi);
#   - llama-server (CPU) and make-gguf;
#   - the random-weight hybrid GGUF, tiny-nemotron-h.gguf.
# Prints the directory holding llama-server and the GGUF as its last line.
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

for tool in cmake g++ make patch; do
  if ! command -v "$tool" >/dev/null; then
    echo "--- apt-get install cmake g++ make patch" >&2
    apt-get update -qq && apt-get install -y -qq cmake g++ make patch >/dev/null
    break
  fi
done

if [ ! -f "$src/include/llama.h" ]; then
  tarball="$cache/llama_cpp_python-$version.tar.gz"
  if [ ! -f "$tarball" ]; then
    echo "--- download llama-cpp-python $version sdist (llama.cpp's sources)" >&2
    # The sdist itself from PyPI's files host: pip download would build the
    # package's build dependencies (cmake) from source to read its metadata.
    "$python" - "$version" "$tarball" <<'PY'
import sys, urllib.request
v, dst = sys.argv[1], sys.argv[2]
url = f"https://files.pythonhosted.org/packages/source/l/llama_cpp_python/llama_cpp_python-{v}.tar.gz"
with urllib.request.urlopen(url, timeout=300) as r, open(dst + ".part", "wb") as f:
    f.write(r.read())
import os; os.replace(dst + ".part", dst)
PY
  fi
  echo "$sha256  $tarball" | sha256sum -c - >&2
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

if [ ! -f "$build/bin/llama-server" ] || [ "$here/hooks/marconi-hooks.cpp" -nt "$build/bin/llama-server" ] \
   || [ "$here/server.patch" -nt "$build/bin/llama-server" ] || [ "$lib/libmarconi.so" -nt "$build/bin/llama-server" ]; then
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
  echo "llama-server built in $((SECONDS - start)) s" >&2
fi
ln -sfn "$build/bin/llama-server" "$out/llama-server"

if [ ! -x "$out/make-gguf" ] || [ "$here/make-gguf.cpp" -nt "$out/make-gguf" ]; then
  g++ -O2 -std=c++17 -Wall -Wextra -Werror -I"$src/include" -I"$src/ggml/include" "$here/make-gguf.cpp" \
    -o "$out/make-gguf" -L"$build/bin" -Wl,-rpath,"$build/bin" -lllama -lggml -lggml-base
fi
gguf="$out/tiny-nemotron-h.gguf"
if [ ! -f "$gguf" ] || [ "$out/make-gguf" -nt "$gguf" ]; then
  "$out/make-gguf" "$src/models/ggml-vocab-phi-3.gguf" "$gguf.part" >&2
  mv "$gguf.part" "$gguf"
fi
echo "$out"
