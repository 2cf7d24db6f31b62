#!/usr/bin/env bash
# scripts/libmarconi-startup.sh LIB [RUNS]: the median time, over RUNS
# (default 30) fresh processes, to dlopen LIB (a libmarconi.so) and call
# marconi_events_has_publisher, in microseconds (page cache warm: three
# runs first). Used for docs/events.md §9.
set -euo pipefail
lib="$1"
runs="${2:-30}"
work="$(mktemp -d "${TMPDIR:-/tmp}/marconi-startup.XXXXXX")"
trap 'rm -rf "$work"' EXIT
cat > "$work/t.c" <<'C'
#include <dlfcn.h>
#include <stdio.h>
#include <time.h>
int main(int argc, char **argv) {
  struct timespec a, b;
  (void)argc;
  clock_gettime(CLOCK_MONOTONIC, &a);
  void *h = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (!h) { fprintf(stderr, "%s\n", dlerror()); return 1; }
  int (*has)(void) = (int (*)(void))dlsym(h, "marconi_events_has_publisher");
  if (!has) { fprintf(stderr, "%s\n", dlerror()); return 1; }
  int p = has();
  clock_gettime(CLOCK_MONOTONIC, &b);
  printf("%d %.1f\n", p, (double)(b.tv_sec - a.tv_sec) * 1e6 + (double)(b.tv_nsec - a.tv_nsec) / 1e3);
  return 0;
}
C
gcc -O2 -o "$work/t" "$work/t.c" -ldl
for _ in 1 2 3; do "$work/t" "$lib" >/dev/null; done
for _ in $(seq "$runs"); do "$work/t" "$lib"; done | sort -k2 -n |
  awk '{a[NR] = $2; p = $1} END {printf "publisher=%d dlopen+call median %.0f us over %d runs\n", p, a[int((NR + 1) / 2)], NR}'
