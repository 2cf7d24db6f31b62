#!/usr/bin/env bash
# Installs libmarconi for C and C++ users (Linux):
#
#   PREFIX/include/marconi.h
#   PREFIX/LIBDIR/libmarconi.so[.X.Y.Z, with SONAME links when the library has one]
#   PREFIX/LIBDIR/libmarconi.a
#   PREFIX/LIBDIR/pkgconfig/marconi.pc
#   PREFIX/LIBDIR/cmake/marconi/marconiConfig.cmake, marconiConfigVersion.cmake
#
# It builds marconi-ffi with the same command as ci/test.d/c.sh
# (`cargo build --release -p marconi-ffi`, honouring CARGO_TARGET_DIR), so a
# tree that is already built is not compiled again. The templates are in
# scripts/install/. Usage: scripts/install.sh --help
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"

usage() {
  cat <<USAGE
usage: scripts/install.sh [--prefix DIR] [--libdir DIR] [--destdir DIR] [--no-build]

  --prefix DIR   where the files go and where they will be used from
                 (default /usr/local; written into marconi.pc)
  --libdir DIR   library directory, relative to the prefix (default lib)
  --destdir DIR  stage the files under DIR/PREFIX instead (for packagers)
  --no-build     install what target/release already holds (e.g. under sudo)

Then: PKG_CONFIG_PATH=PREFIX/LIBDIR/pkgconfig pkg-config --cflags --libs marconi,
or CMAKE_PREFIX_PATH=PREFIX and find_package(marconi CONFIG REQUIRED).
USAGE
}

prefix=/usr/local
libdir=lib
destdir=
build=1
while [ $# -gt 0 ]; do
  case "$1" in
    --prefix) prefix="${2:?--prefix needs a directory}"; shift 2 ;;
    --prefix=*) prefix="${1#*=}"; shift ;;
    --libdir) libdir="${2:?--libdir needs a directory}"; shift 2 ;;
    --libdir=*) libdir="${1#*=}"; shift ;;
    --destdir) destdir="${2:?--destdir needs a directory}"; shift 2 ;;
    --destdir=*) destdir="${1#*=}"; shift ;;
    --no-build) build=; shift ;;
    -h | --help) usage; exit 0 ;;
    *) printf 'install.sh: unknown argument %s\n\n' "$1" >&2; usage >&2; exit 2 ;;
  esac
done

die() { printf 'install.sh: %s\n' "$*" >&2; exit 1; }
[ "$(uname -s)" = Linux ] || die "only Linux (ELF shared libraries) is supported for now"
# The prefix is written into marconi.pc, so it must be absolute; a relative
# one is taken from the current directory, as `make install` users expect.
case "$prefix" in /*) ;; *) mkdir -p "$prefix" && prefix="$(cd "$prefix" && pwd)" ;; esac
prefix="${prefix%/}"
case "$libdir" in /* | *..*) die "--libdir must be relative to the prefix, without '..': $libdir" ;; esac
libdir="${libdir%/}"

# A relative CARGO_TARGET_DIR means the caller's directory, as for cargo.
target="${CARGO_TARGET_DIR:-$root/target}"
case "$target" in /*) ;; *) target="$PWD/$target" ;; esac
export CARGO_TARGET_DIR="$target"
cd "$root"
if [ -n "$build" ]; then
  echo "--- cargo build --release -p marconi-ffi"
  cargo build --release -p marconi-ffi
fi
built="$target/release"
for f in libmarconi.so libmarconi.a; do
  [ -f "$built/$f" ] || die "$built/$f is missing (run without --no-build, or set CARGO_TARGET_DIR)"
done

# Version from the committed header (a test keeps it equal to Cargo.toml).
version="$(sed -n 's/^#define MARCONI_VERSION_STRING "\(.*\)"$/\1/p' include/marconi.h)"
[ -n "$version" ] || die "no MARCONI_VERSION_STRING in include/marconi.h"

# With a SONAME (libmarconi.so.0.2), install libmarconi.so.0.2.0 and the usual
# two links; without one, programs record "libmarconi.so" itself.
soname="$(readelf -d "$built/libmarconi.so" | sed -n 's/.*(SONAME).*\[\(.*\)\]$/\1/p')"
if [ -n "$soname" ]; then
  case "$soname" in libmarconi.so.*) ;; *) die "unexpected SONAME $soname" ;; esac
  shared="libmarconi.so.$version"
else
  shared=libmarconi.so
fi

# The CMake files find the prefix relative to themselves (relocatable).
ups=../..
rest="$libdir"
while :; do
  ups="$ups/.."
  case "$rest" in */*) rest="${rest#*/}" ;; *) break ;; esac
done

stage="$destdir$prefix"
inc="$stage/include"
lib="$stage/$libdir"
echo "--- installing libmarconi $version into $stage"
install -d "$inc" "$lib/pkgconfig" "$lib/cmake/marconi"
install -m 644 include/marconi.h "$inc/marconi.h"
install -m 644 "$built/libmarconi.a" "$lib/libmarconi.a"
# Replace, never write through, an existing file or link (a running program
# may have the old library mapped).
rm -f "$lib/$shared"
install -m 755 "$built/libmarconi.so" "$lib/$shared"
if [ -n "$soname" ]; then
  ln -sfn "$shared" "$lib/$soname"
  ln -sfn "$soname" "$lib/libmarconi.so"
fi

subst() {
  sed -e "s|@PREFIX@|$prefix|g" -e "s|@LIBDIR@|$libdir|g" -e "s|@VERSION@|$version|g" \
    -e "s|@SHARED@|$shared|g" -e "s|@SONAME@|$soname|g" -e "s|@UPS@|$ups|g" "$1"
}
subst scripts/install/marconi.pc.in >"$lib/pkgconfig/marconi.pc"
subst scripts/install/marconiConfig.cmake.in >"$lib/cmake/marconi/marconiConfig.cmake"
subst scripts/install/marconiConfigVersion.cmake.in >"$lib/cmake/marconi/marconiConfigVersion.cmake"
chmod 644 "$lib/pkgconfig/marconi.pc" "$lib/cmake/marconi/"*.cmake

for f in "$inc/marconi.h" "$lib"/libmarconi.* "$lib/pkgconfig/marconi.pc" "$lib/cmake/marconi/"*; do
  printf '    %s%s\n' "$f" "$([ -L "$f" ] && printf ' -> %s' "$(readlink "$f")")"
done
[ -n "$soname" ] || echo "note: this libmarconi.so has no SONAME; programs record libmarconi.so"
# As `make install` does for shared libraries: refresh the loader's cache, so
# that programs linked without an RPATH find the library in system prefixes.
if [ -z "$destdir" ] && [ "$(id -u)" = 0 ] && command -v ldconfig >/dev/null; then
  ldconfig || true
fi
