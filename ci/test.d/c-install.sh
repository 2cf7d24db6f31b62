#!/usr/bin/env bash
# The C user's path, as the README's "C ABI" section gives it: installs
# libmarconi with scripts/install.sh into a fresh prefix, then, with no
# LD_LIBRARY_PATH, builds and runs
#   - the README's C snippet with each `cc` line of that section's ```sh
#     blocks, exactly as written (shared library found through the RPATH, and
#     the static library), comparing the output with the README's;
#   - examples/c-cmake through find_package(marconi CONFIG REQUIRED), against
#     marconi::marconi and marconi::marconi_static;
# and checks the CMake version rules and a staged (--destdir) install.
# install.sh runs the same cargo command as c.sh, so the release build is
# shared (compiled once). Installs pkg-config and cmake with apt-get if they
# are missing.
# Runs from the repository root.
set -euo pipefail
cd "$(dirname "$0")/../.."
unset LD_LIBRARY_PATH PKG_CONFIG_PATH CMAKE_PREFIX_PATH

work="$(mktemp -d "${TMPDIR:-/tmp}/marconi-c-install.XXXXXX")"
trap 'rm -rf "$work"' EXIT
prefix="$work/prefix"

# The user's tools; installed as Debian packages where missing (CI images).
for tool in pkg-config cmake; do
  command -v "$tool" >/dev/null && continue
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "--- $tool is missing: apt-get install $tool"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$tool" >/dev/null
  else
    echo "$tool is missing and cannot be installed here (needs root and apt-get)" >&2
    exit 1
  fi
done

echo "--- scripts/install.sh --prefix $prefix"
scripts/install.sh --prefix "$prefix"
lib="$prefix/lib"

# The binary must take libmarconi from the prefix, or link none (static).
check_links() { # binary, expected: "prefix" or "none"
  local found
  found="$(ldd "$1" | awk '/libmarconi/ {print $3}')"
  case "$2" in
    prefix) [ "$(dirname "$found")" = "$lib" ] || { echo "$1: libmarconi from '$found', not $lib" >&2; exit 1; } ;;
    none) [ -z "$found" ] || { echo "$1: links $found, expected the static library" >&2; exit 1; } ;;
  esac
}

echo "--- the README's C snippet, built with the README's cc lines"
mkdir -p "$work/readme"
awk '/^## C ABI/{s=1} s&&/^```c$/{t=1;next} t&&/^```/{exit} t' README.md >"$work/readme/main.c"
expected="$(awk '/^## C ABI/{s=1} s&&/^```text$/{t=1;next} t&&/^```/{exit} t' README.md)"
awk '/^## C ABI/{s=1;next} s&&/^## /{exit} s&&/^```sh$/{t=1;next} t&&/^```/{t=0} t&&/^cc /' README.md \
  >"$work/readme/cc-lines"
[ -s "$work/readme/main.c" ] && [ "$(grep -c . "$work/readme/cc-lines")" -ge 2 ] || {
  echo "README's C ABI section lost its C snippet or its cc lines" >&2
  exit 1
}
export PKG_CONFIG_PATH="$lib/pkgconfig"
while IFS= read -r line; do
  out="$(printf '%s\n' "$line" | sed -n 's/.* -o \([^ ]*\).*/\1/p')"
  [ -n "$out" ] || { echo "README cc line without -o: $line" >&2; exit 1; }
  echo "$ $line"
  (cd "$work/readme" && bash -euo pipefail -c "$line")
  case "$line" in *libmarconi.a*) check_links "$work/readme/$out" none ;; *) check_links "$work/readme/$out" prefix ;; esac
  actual="$("$work/readme/$out")"
  if [ "$actual" != "$expected" ]; then
    printf 'README C snippet (%s) output differs.\nexpected:\n%s\nactual:\n%s\n' "$out" "$expected" "$actual" >&2
    exit 1
  fi
done <"$work/readme/cc-lines"
echo "$actual"
unset PKG_CONFIG_PATH

echo "--- examples/c-cmake with find_package(marconi CONFIG REQUIRED)"
cmake -S examples/c-cmake -B "$work/cmake" -DCMAKE_PREFIX_PATH="$prefix" \
  -DCMAKE_C_FLAGS="-Wall -Wextra -Werror" >"$work/cmake.log" || { cat "$work/cmake.log"; exit 1; }
cmake --build "$work/cmake"
check_links "$work/cmake/marconi_example" prefix
check_links "$work/cmake/marconi_example_static" none
"$work/cmake/marconi_example"
"$work/cmake/marconi_example_static"

echo "--- CMake version rules (ABI policy: 0.x keeps the ABI within a minor version)"
version="$(sed -n 's/^#define MARCONI_VERSION_STRING "\(.*\)"$/\1/p' include/marconi.h)"
IFS=. read -r major minor _ <<<"$version"
mkdir -p "$work/find"
printf '%s\n' 'cmake_minimum_required(VERSION 3.16)' 'project(find LANGUAGES C)' \
  'find_package(marconi ${V} CONFIG QUIET)' 'message(STATUS "marconi_FOUND=${marconi_FOUND}")' \
  >"$work/find/CMakeLists.txt"
finds() { # version to ask for; prints 1 when find_package accepts it
  cmake -S "$work/find" -B "$work/find/build-$1" -DV="$1" -DCMAKE_PREFIX_PATH="$prefix" |
    sed -n 's/^-- marconi_FOUND=//p'
}
[ "$(finds "$major.$minor")" = 1 ] || { echo "find_package(marconi $major.$minor) failed" >&2; exit 1; }
if [ "$major" = 0 ]; then wrong="0.$((minor + 1))"; else wrong="$((major + 1)).0"; fi
[ "$(finds "$wrong")" = 0 ] || { echo "find_package(marconi $wrong) accepted $version" >&2; exit 1; }
echo "$major.$minor accepted, $wrong refused"

echo "--- a staged install (--destdir) names the final prefix"
scripts/install.sh --no-build --prefix /opt/marconi --destdir "$work/stage" >/dev/null
grep -qx 'prefix=/opt/marconi' "$work/stage/opt/marconi/lib/pkgconfig/marconi.pc"
test -f "$work/stage/opt/marconi/include/marconi.h"
echo "ok"
